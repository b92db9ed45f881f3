"""PrefillSpec on the CPU: supported values, the rules across fields, readable names, and
that no family registry reaches it while it has no kernel (docs/prefill.md)."""

from __future__ import annotations

import itertools

import pytest
from test_specs import combinations, is_valid

from flashinfer_jit.pipeline import render
from flashinfer_jit.pipeline.matrix import parse_matrix_text
from flashinfer_jit.prefill.spec import HEAD_DIM_PAIRS, PrefillSpec
from flashinfer_jit.specs import FAMILIES

BF16 = dict(dtype_q="bfloat16", dtype_kv="bfloat16", dtype_o="bfloat16")


@pytest.mark.parametrize("spec, name", [
    (PrefillSpec(**BF16, head_dim_qk=128, head_dim_vo=128), "prefill_bf16_bf16_bf16_hd128_vo128_paged"),
    (PrefillSpec("float16", "float8_e4m3fn", "float16", 192, 128, page_table="block_table_kv_separate",
                 kv_layout="HND", mask="causal", soft_cap=True, sinks=True),
     "prefill_f16_e4m3_f16_hd192_vo128_paged_btkv_hnd_causal_cap_sinks"),
    (PrefillSpec(**BF16, head_dim_qk=64, head_dim_vo=64, kv_source="ragged", mask="custom",
                 pos_encoding="rope_llama"), "prefill_bf16_bf16_bf16_hd64_vo64_ragged_custom_rope_llama"),
    (PrefillSpec("float16", "float16", "bfloat16", 256, 256, page_table="block_table"),
     "prefill_f16_f16_bf16_hd256_vo256_paged_bt"),
])
def test_readable_names(spec, name):
    assert spec.validate().name == name


def test_valid_combinations_have_distinct_names_and_the_rest_raise_value_error():
    specs = combinations(PrefillSpec)
    good = [s for s in specs if is_valid(s)]
    assert len({s.name for s in good}) == len(good)
    # 2 q x kv (paged: same or 2 fp8; ragged: same) x 2 out x (paged: 3 page tables x 2 layouts)
    # x 3 masks x (2 cap x 2 sinks x (5 head pairs x 2: none, RoPE; less RoPE at 192/128)
    # + 5 head pairs with ALiBi, which takes neither cap nor sinks)
    paged = 2 * 3 * 2 * 6 * 3 * (2 * 2 * (2 * 5 - 1) + 5)
    ragged = 2 * 1 * 2 * 1 * 3 * (2 * 2 * (2 * 5 - 1) + 5)
    assert len(good) == paged + ragged
    for spec in specs:
        if not is_valid(spec):
            with pytest.raises(ValueError, match="PrefillSpec"):
                spec.validate()


@pytest.mark.parametrize("params, message", [
    (dict(head_dim_qk=448, head_dim_vo=256), r"head_dim_qk=448 is not supported; supported: 64, 128, 192, 256, 512"),
    (dict(head_dim_qk=64, head_dim_vo=128), r"head_dim_qk=64 with head_dim_vo=128 is not supported; .*\(192, 128\)"),
    (dict(head_dim_qk=192, head_dim_vo=128, pos_encoding="rope_llama"), "apply RoPE to the rope dims before"),
    (dict(dtype_kv="float16"), "a float16 K/V needs q of the same dtype, got bfloat16"),
    (dict(dtype_kv="float8_e5m2", kv_source="ragged"), "fp8 K/V .* is for the paged cache only"),
    (dict(kv_source="ragged", kv_layout="HND"), "ragged K/V has no page table or KV layout"),
    (dict(kv_source="ragged", page_table="block_table"), "ragged K/V has no page table or KV layout"),
    (dict(mask="sliding"), r"mask='sliding' is not supported; supported: 'none', 'causal', 'custom'"),
    (dict(dtype_o="float32"), "dtype_o='float32' is not supported"),
])
def test_unsupported_combinations_say_what_is_supported(params, message):
    spec = PrefillSpec(**{**BF16, "head_dim_qk": 128, "head_dim_vo": 128, **params})
    with pytest.raises(ValueError, match=message):
        spec.validate()


def test_fp8_paged_and_every_head_dim_pair_are_accepted():
    for fp8, (qk, vo) in itertools.product(("float8_e4m3fn", "float8_e5m2"), HEAD_DIM_PAIRS):
        PrefillSpec("float16", fp8, "bfloat16", qk, vo, mask="causal").validate()
    spec = PrefillSpec.from_params({"dtype_q": "bfloat16", "dtype_kv": "bfloat16", "dtype_o": "bfloat16",
                                    "head_dim_qk": 192, "head_dim_vo": 128, "mask": "custom"})
    assert spec.canonical()["params"]["mask"] == "custom"


def test_registered_and_rendered():
    """The family is registered (matrix files, the AOT CLI, tests/test_specs.py reach it) and
    renders one module holding both query tiles (at head_dim_qk 256 too: 8 warps of 16 rows)."""
    assert FAMILIES["prefill"] is PrefillSpec
    (spec,) = parse_matrix_text("prefill dtype_q=bfloat16 dtype_kv=bfloat16 dtype_o=bfloat16 head_dim_qk=128 "
                                "head_dim_vo=128 mask=causal")
    assert spec.name == "prefill_bf16_bf16_bf16_hd128_vo128_paged_causal"
    rendered = render.render(spec)
    assert "PrefillMask::kCausal" in rendered.sources["kernel.cu"]
    assert "prefill/prefill.cuh" in rendered.headers and "common/page_table.cuh" in rendered.headers
    assert spec.tile_rows == (64, 128)
    assert PrefillSpec(**BF16, head_dim_qk=256, head_dim_vo=256).tile_rows == (64, 128)
    assert PrefillSpec(**BF16, head_dim_qk=512, head_dim_vo=512).tile_rows == (64,)  # 8 warps, 192 KB

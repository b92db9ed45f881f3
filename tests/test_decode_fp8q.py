"""Batch decode with fp8 queries (issue 63, item 2): q_data_type float8_e4m3fn or
float8_e5m2 over a cache of the same fp8 dtype, with run()'s q_scale, k_scale and v_scale.

The kernels widen an fp8 q to fp16 where they load it (exactly, as they widen fp8 K/V);
q_scale folds into the logits' scale on the host. The output is 16-bit: float16 unless
plan() gets o_data_type=torch.bfloat16 (FlashInfer's later name; FlashInfer itself
defaults the output to q's dtype, which would be fp8 here: see docs/decode.md). Batch
prefill takes no fp8 q, as FlashInfer's FA2 prefill takes none.

CPU tests (no marker): spec and plan() validation, the rendered query type, the
reference's dequantization, the tests' AOT matrix. GPU tests compare with the float64
reference (flashinfer_jit/reference/decode.py) on fresh random data, with NaN-poisoned
outputs between sentinel rows and NaN in every page no request reads, through the plain,
tuple / single-tensor / strided caches, fast_decode_plan, CUDA-graph, single-decode,
multi-token and torch.compile paths. Helpers shared with tests/test_decode.py are
imported from it. Their modules (6) are in scripts/matrices/tests.
"""

from __future__ import annotations

import functools
import random
from typing import NamedTuple

import pytest
import torch
from kv_helpers import (
    DEV,
    assert_sentinels,
    assert_tests_matrix_has,
    make_page_table,
    poisoned,
    replay_poisoned,
)
from test_decode import check_decode, make_cache, nan_pages

import flashinfer_jit as fij
from flashinfer_jit.decode.spec import group_tile
from flashinfer_jit.pipeline import render
from flashinfer_jit.reference.decode import decode_ref
from flashinfer_jit.runtime.page_table import csr_page_table
from flashinfer_jit.specs import DecodeSpec

E4M3, E5M2, F16, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16
SHORT = {E4M3: "e4m3", E5M2: "e5m2", F16: "f16", BF16: "bf16", None: "f16"}
TABLE_TAG = {"csr": "csr", "block_table": "bt", "block_table_kv_separate": "btkv"}


class Case(NamedTuple):
    dtype: torch.dtype      # q and cache
    head_dim: int
    heads: tuple            # (num_qo_heads, num_kv_heads): GQA 4 or 8, MHA with RoPE
    page_size: int
    page_table: str
    kv_layout: str
    cache_form: str         # "tuple", "single" [P, 2, ...], "halves" (K, V strided halves of one buffer)
    rope: bool
    soft_cap: float | None
    window_left: int
    o_dtype: torch.dtype | None  # plan()'s o_data_type (None: float16)
    scales: tuple           # (q_scale, k_scale, v_scale), None: not passed
    return_lse: bool
    split: str              # "auto", "no_split", "fixed64"


CASES = [
    Case(E4M3, 128, (32, 8), 16, "csr", "NHD", "tuple", False, None, -1, None, (None, None, None), True, "auto"),
    Case(E4M3, 128, (32, 8), 1, "csr", "NHD", "single", False, None, -1, None, (0.5, 2.0, 0.75), True, "fixed64"),
    Case(E4M3, 128, (32, 8), 16, "csr", "NHD", "halves", False, None, 37, F16, (3.0, None, 1.5), False, "no_split"),
    Case(E4M3, 128, (64, 8), 16, "csr", "NHD", "tuple", False, None, -1, BF16, (1.5, 0.5, 2.0), True, "auto"),
    Case(E4M3, 128, (64, 8), 1, "csr", "NHD", "halves", False, None, -1, BF16, (0.25, None, None), True, "fixed64"),
    Case(E4M3, 256, (32, 8), 1, "block_table", "HND", "tuple", False, None, -1, None, (2.0, 0.7, 1.3), True, "auto"),
    Case(E4M3, 256, (32, 8), 16, "block_table", "HND", "single", False, None, 100, None, (None, 1.25, None), False,
         "no_split"),
    Case(E5M2, 64, (64, 8), 16, "block_table_kv_separate", "NHD", "tuple", False, 30.0, -1, None, (1.25, 0.5, 2.0),
         True, "auto"),
    Case(E5M2, 64, (64, 8), 1, "block_table_kv_separate", "NHD", "halves", False, 30.0, -1, None, (0.5, None, None),
         False, "fixed64"),
    Case(E4M3, 64, (8, 8), 16, "csr", "NHD", "tuple", True, None, -1, BF16, (1.5, 0.5, 2.0), True, "auto"),
    Case(E4M3, 64, (8, 8), 1, "csr", "NHD", "single", True, None, 37, BF16, (None, None, None), True, "no_split"),
]
MULTI_TOKENS = 2  # the multi-token case: (E4M3, 128, (32, 8), csr, NHD)


def case_spec(c: Case, q_tokens: int = 1) -> DecodeSpec:
    return DecodeSpec(str(c.dtype).replace("torch.", ""), str(c.dtype).replace("torch.", ""), c.head_dim,
                      group_tile(*c.heads, c.head_dim, q_tokens), c.page_table, c.kv_layout, c.rope,
                      c.soft_cap is not None, q_tokens, "bfloat16" if c.o_dtype is BF16 else "float16")


def case_id(i: int, c: Case) -> str:
    parts = [f"{i:02d}", SHORT[c.dtype], f"hd{c.head_dim}", f"{c.heads[0]}x{c.heads[1]}", f"p{c.page_size}",
             TABLE_TAG[c.page_table], c.kv_layout, c.cache_form, f"o{SHORT[c.o_dtype]}"]
    parts += ["rope"] * c.rope + ["cap"] * (c.soft_cap is not None) + [f"w{c.window_left}"] * (c.window_left >= 0)
    parts += ["q{}-k{}-v{}".format(*c.scales)] * any(s is not None for s in c.scales)
    parts += ["lse"] * c.return_lse + [c.split] * (c.split != "auto")
    return "-".join(parts)


def specs_needed() -> set:
    """Every DecodeSpec the GPU tests of this file load."""
    return {case_spec(c) for c in CASES} | {case_spec(CASES[0], MULTI_TOKENS)}


def _split_kwargs(split: str) -> dict:
    return {"auto": {}, "no_split": {"disable_split_kv": True}, "fixed64": {"fixed_split_size": 64}}[split]


def _scales(scales: tuple) -> dict:
    return {name: s for name, s in zip(("q_scale", "k_scale", "v_scale"), scales) if s is not None}


def fp8_q(shape, dtype: torch.dtype, gen: torch.Generator, q_scale=None, spread: float = 1.0) -> torch.Tensor:
    """A query as an engine quantizes it: values / q_scale rounded to fp8 (q_scale None: 1)."""
    return (torch.randn(shape, generator=gen, device=DEV) * spread / (q_scale or 1.0)).to(dtype)


def _lengths(rnd: random.Random, page_size: int, max_len: int) -> list[int]:
    """Random lengths: one empty request (padding), one on a page boundary, one token."""
    lens = [rnd.randint(1, max_len) for _ in range(rnd.randint(6, 30))]
    lens[:3] = [0, 2 * page_size, 1]
    rnd.shuffle(lens)
    return lens


# --- CPU: specs, plan(), rendering, the reference, the matrix ------------------------------------
@pytest.mark.parametrize("q", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("out", ["float16", "bfloat16"])
def test_spec_takes_fp8_q_over_the_same_fp8_cache(q, out):
    spec = DecodeSpec(q, q, 128, 4, dtype_o=out).validate()
    assert spec.out_dtype == out and spec.name.endswith(f"_o{'f16' if out == 'float16' else 'bf16'}")


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype_q="float8_e4m3fn", dtype_kv="float8_e5m2", dtype_o="float16"), "same dtype"),
    (dict(dtype_q="float8_e4m3fn", dtype_kv="bfloat16", dtype_o="float16"), "same dtype"),
    (dict(dtype_q="float8_e4m3fn", dtype_kv="float8_e4m3fn"), "dtype_o"),
    (dict(dtype_q="bfloat16", dtype_kv="bfloat16", dtype_o="bfloat16"), "dtype_o"),
    (dict(dtype_q="float16", dtype_kv="float8_e4m3fn", dtype_o="bfloat16"), "dtype_o"),
    (dict(dtype_q="float8_e4m3fn", dtype_kv="float8_e4m3fn", dtype_o="float8_e4m3fn"), "dtype_o"),
])
def test_spec_rejects_other_fp8_q_combinations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecodeSpec(head_dim=128, **kwargs).validate()


def test_rendered_query_type():
    """An fp8-q module's kernels take fij::QueryOut<fp8, output> as their query type and
    merge in the output's dtype; a 16-bit q's sources name q's type as before."""
    fp8 = render.render(DecodeSpec("float8_e4m3fn", "float8_e4m3fn", 128, 4, dtype_o="bfloat16")).sources["kernel.cu"]
    assert "DecodeMmaTraits<fij::QueryOut<__nv_fp8_e4m3, nv_bfloat16>, __nv_fp8_e4m3, 128, 4," in fp8
    assert "launch_merge_splits<nv_bfloat16>" in fp8
    rope = render.render(DecodeSpec("float8_e5m2", "float8_e5m2", 64, 1, rope=True, dtype_o="float16"))
    assert "DecodeTraits<fij::QueryOut<__nv_fp8_e5m2, half>, __nv_fp8_e5m2, 64, 1," in rope.sources["kernel.cu"]
    plain = render.render(DecodeSpec("bfloat16", "float8_e4m3fn", 128, 4)).sources["kernel.cu"]
    assert "QueryOut" not in plain and "DecodeMmaTraits<nv_bfloat16, __nv_fp8_e4m3, 128, 4," in plain


PLAN = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)


def _csr(batch: int = 3, pages_each: int = 2):
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_each
    return indptr, torch.arange(batch * pages_each, dtype=torch.int32), torch.full((batch,), 5, dtype=torch.int32)


def _cpu_wrapper(cls=fij.BatchDecodeWithPagedKVCacheWrapper, **kwargs):
    return cls(torch.zeros(1 << 20, dtype=torch.uint8), "NHD", **kwargs)


@pytest.mark.parametrize("q,kv,o,want", [
    (E4M3, None, None, "float16"),
    ("float8_e4m3fn", "float8_e4m3fn", "bfloat16", "bfloat16"),
    (E5M2, E5M2, F16, "float16"),
])
def test_plan_takes_fp8_q(q, kv, o, want):
    """plan() with fp8 q (a dtype or its name; the cache's dtype defaults to q's) picks the
    fp8-q module with the output dtype o_data_type, float16 by default."""
    w = _cpu_wrapper()
    w.plan(*_csr(), **PLAN, q_data_type=q, kv_data_type=kv, o_data_type=o)
    spec = w._plan.spec
    assert spec.dtype_q == spec.dtype_kv == str(q).replace("torch.", "") and spec.dtype_o == want
    assert w._plan.config.out_dtype == getattr(torch, want)


def test_fast_decode_plan_and_cuda_graph_wrapper_take_fp8_q():
    """fast_decode_plan (bound as SGLang binds it) and the CUDA-graph wrapper plan the same
    fp8-q module as plan()."""
    w = _cpu_wrapper()
    indptr, indices, last = _csr()
    w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=BF16)  # the prior plan fast_decode_plan needs
    w.plan = functools.partial(fij.decode.fast_decode_plan, w)
    w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=E4M3, kv_data_type=E4M3, o_data_type=BF16,
           global_override_indptr_cpu=indptr)
    assert w._plan.spec == DecodeSpec("float8_e4m3fn", "float8_e4m3fn", 128, 4, dtype_o="bfloat16")
    i32 = torch.zeros(64, dtype=torch.int32)
    g = fij.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.zeros(1 << 20, dtype=torch.uint8), i32[:9], i32, i32[:8])
    g.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=E4M3)
    assert g._plan.spec == DecodeSpec("float8_e4m3fn", "float8_e4m3fn", 128, 4, dtype_o="float16")


@pytest.mark.parametrize("kwargs,argument", [
    (dict(q_data_type=E4M3, kv_data_type=BF16), "kv_data_type"),
    (dict(q_data_type=E4M3, kv_data_type=E5M2), "kv_data_type"),
    (dict(q_data_type=E5M2, kv_data_type=E4M3), "kv_data_type"),
    (dict(q_data_type=E4M3, o_data_type=E4M3), "o_data_type"),
    (dict(q_data_type=E4M3, o_data_type=torch.float32), "o_data_type"),
    (dict(q_data_type=BF16, o_data_type=F16), "o_data_type"),
    (dict(q_data_type=BF16, kv_data_type=E4M3, o_data_type=E4M3), "o_data_type"),
    (dict(q_data_type=torch.float32), "q_data_type"),
])
def test_plan_rejects_what_fp8_q_does_not_take(kwargs, argument):
    """Each unsupported dtype combination is a ValueError naming the plan() argument, before
    anything is built."""
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        _cpu_wrapper().plan(*_csr(), **PLAN, **kwargs)


def test_16bit_q_plans_as_before():
    """o_data_type None or q's own dtype: the module without dtype_o (unchanged)."""
    for o in (None, BF16):
        w = _cpu_wrapper()
        w.plan(*_csr(), **PLAN, q_data_type=BF16, kv_data_type=E4M3, o_data_type=o)
        assert w._plan.spec == DecodeSpec("bfloat16", "float8_e4m3fn", 128, 4) and w._plan.config.out_dtype is None


@pytest.mark.parametrize("wrapper", ["paged", "ragged"])
def test_prefill_rejects_fp8_q(wrapper):
    """Batch prefill takes fp8 q only as FP8 attention, on the Hopper kernel (e4m3, ragged K/V,
    head_dim 128, an sm_90 GPU: tests/test_prefill_sm90.py); FlashInfer's FA2 prefill asserts
    on fp8 q. Elsewhere, here a paged cache or a CPU workspace: a ValueError naming
    q_data_type."""
    ws = torch.zeros(1 << 20, dtype=torch.uint8)
    qo_indptr = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="^q_data_type float8_e4m3fn"):
        if wrapper == "paged":
            indptr, indices, last = _csr(2)
            fij.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD").plan(
                qo_indptr, indptr, indices, last, 32, 8, 128, 16, q_data_type=E4M3, kv_data_type=E4M3)
        else:
            fij.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD").plan(
                qo_indptr, torch.tensor([0, 40, 90], dtype=torch.int32), 32, 8, 128, q_data_type=E4M3)


def test_reference_dequantizes_fp8_q_exactly():
    """decode_ref on fp8 q equals decode_ref on the same values in float32, with q_scale."""
    gen = torch.Generator().manual_seed(3)
    lens, ps, hk, d = [40, 0, 17], 16, 2, 64
    table = csr_page_table(torch.tensor([0, 3, 3, 5], dtype=torch.int32), torch.arange(5, dtype=torch.int32),
                           torch.tensor([8, 0, 1], dtype=torch.int32))
    k = torch.randn(5, ps, hk, d, generator=gen).to(E4M3)
    v = torch.randn(5, ps, hk, d, generator=gen).to(E4M3)
    q = (torch.randn(3, 8, d, generator=gen) * 3).to(E4M3)
    got = decode_ref(q, k, v, table, lens, q_scale=0.5, k_scale=2.0, v_scale=0.25)
    want = decode_ref(q.float(), k, v, table, lens, q_scale=0.5, k_scale=2.0, v_scale=0.25)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    half = decode_ref(q.float(), k, v, table, lens, sm_scale=0.5 / d ** 0.5, k_scale=2.0, v_scale=0.25)
    torch.testing.assert_close(got[0], half[0], rtol=1e-6, atol=1e-6)  # q_scale is a factor of the logits


def test_tests_matrix_has_every_fp8q_module():
    assert_tests_matrix_has(specs_needed(), DecodeSpec, 6, "fp8-q decode")


# --- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("index", [pytest.param(i, id=case_id(i, c)) for i, c in enumerate(CASES)])
def test_batch_decode_fp8_q(index, workspace):
    c = CASES[index]
    rnd = random.Random(600 + index)
    gen = torch.Generator(device=DEV).manual_seed(600 + index)
    (hq, hk), d, ps = c.heads, c.head_dim, c.page_size
    lens = _lengths(rnd, ps, 2048 if c.rope else 3000)
    batch = len(lens)
    num_pages = sum(-(-n // ps) for n in lens) + 5
    paged = make_page_table(c.page_table, lens, ps, num_pages, rnd, host_indptr=index % 2 == 0)
    cache, k_cache, v_cache = make_cache(c.cache_form, c.kv_layout, num_pages, ps, hk, d, c.dtype, gen)
    nan_pages(k_cache, paged.k_unused)
    nan_pages(v_cache, paged.v_unused)
    scales = _scales(c.scales)
    q = fp8_q((batch, hq, d), c.dtype, gen, scales.get("q_scale"), 4.0 if c.soft_cap else 1.0)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, c.kv_layout)
    wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps,
                 pos_encoding_mode="ROPE_LLAMA" if c.rope else "NONE", window_left=c.window_left,
                 logits_soft_cap=c.soft_cap, q_data_type=c.dtype, kv_data_type=c.dtype if index % 2 else None,
                 o_data_type=c.o_dtype, **_split_kwargs(c.split))
    assert wrapper._plan.spec == case_spec(c)
    out_dtype = c.o_dtype or F16
    out_buf, out = poisoned((batch, hq, d), out_dtype)
    lse_buf, lse = poisoned((batch, hq), torch.float32)
    ref_out, ref_lse = decode_ref(q, k_cache, v_cache, paged.table, lens, c.kv_layout, None, c.window_left,
                                  c.soft_cap, "ROPE_LLAMA" if c.rope else "NONE", **scales)
    for _ in range(2):  # the op, then run()'s fast path
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        result = wrapper.run(q, cache, out=out, lse=lse if c.return_lse else None, return_lse=c.return_lse, **scales)
        torch.cuda.synchronize()
        result = result[0] if c.return_lse else result
        assert result.data_ptr() == out.data_ptr() and result.dtype == out_dtype
        assert_sentinels(out_buf, "out")
        assert_sentinels(lse_buf, "lse")
        check_decode(out, lse if c.return_lse else None, ref_out, ref_lse, lens, out_dtype)
    allocated = wrapper.run(q, cache, **scales)  # out allocated by run(): the output dtype
    assert allocated.dtype == out_dtype and allocated.shape == q.shape


@pytest.mark.gpu
def test_batch_decode_fp8_q_multi_token(workspace):
    """Two query tokens a request (q_len_per_req=2), fp8 q, with scales."""
    c = CASES[0]
    rnd = random.Random(71)
    gen = torch.Generator(device=DEV).manual_seed(71)
    (hq, hk), d, ps, n = c.heads, c.head_dim, c.page_size, MULTI_TOKENS
    lens = [rnd.randint(n, 2500) for _ in range(11)] + [n, n + 1, n]  # (plan() takes none under n tokens)
    rnd.shuffle(lens)
    num_pages = sum(-(-x // ps) for x in lens) + 5
    paged = make_page_table("csr", lens, ps, num_pages, rnd)
    _, k_cache, v_cache = make_cache("tuple", "NHD", num_pages, ps, hk, d, E4M3, gen)
    nan_pages(k_cache, paged.k_unused)
    scales = dict(q_scale=0.75, k_scale=1.5, v_scale=0.5)
    q = fp8_q((len(lens) * n, hq, d), E4M3, gen, 0.75)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps, q_data_type=E4M3,
                 q_len_per_req=n)
    assert wrapper._plan.spec == case_spec(c, n)
    out_buf, out = poisoned(q.shape, F16)
    lse_buf, lse = poisoned(q.shape[:2], torch.float32)
    wrapper.run(q, (k_cache, v_cache), out=out, lse=lse, **scales)
    torch.cuda.synchronize()
    assert_sentinels(out_buf, "out")
    assert_sentinels(lse_buf, "lse")
    ref_out, ref_lse = decode_ref(q, k_cache, v_cache, paged.table, lens, q_len_per_req=n, **scales)
    visible = [max(0, x - n + 1 + t) for x in lens for t in range(n)]  # keys row t of a request sees
    check_decode(out, lse, ref_out, ref_lse, visible, F16)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,o_dtype", [((32, 8), None), ((64, 8), BF16)], ids=["gqa4-f16", "gqa8-bf16"])
def test_cuda_graph_fp8_q(heads, o_dtype, workspace):
    """CUDAGraphBatchDecodeWithPagedKVCacheWrapper: run() with fp8 q and scales captured
    once at capacity 12, replayed after plans of other lengths and of fewer requests (q
    padded to the capacity)."""
    capacity, (hq, hk), d, ps, pool = 12, heads, 128, 16, 3000
    rnd = random.Random(81)
    gen = torch.Generator(device=DEV).manual_seed(81)
    _, k, v = make_cache("tuple", "NHD", pool, ps, hk, d, E4M3, gen)
    indptr_buf = torch.zeros(capacity + 1, dtype=torch.int32, device=DEV)
    indices_buf = torch.zeros(pool, dtype=torch.int32, device=DEV)
    last_buf = torch.zeros(capacity, dtype=torch.int32, device=DEV)
    wrapper = fij.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(workspace, indptr_buf, indices_buf, last_buf, "NHD")
    scales = dict(q_scale=0.5, k_scale=1.5, v_scale=0.8)
    out_dtype = o_dtype or F16
    q_buf = fp8_q((capacity, hq, d), E4M3, gen, 0.5)
    out_buf = torch.full((capacity, hq, d), float("nan"), dtype=out_dtype, device=DEV)
    lse_buf = torch.full((capacity, hq), float("nan"), dtype=torch.float32, device=DEV)
    graph = None
    for lens in ([rnd.randint(1, 1500) for _ in range(capacity)], [0, 9000] + [rnd.randint(1, 200) for _ in range(10)],
                 [2500, 0, 1, 16, 17]):
        paged = make_page_table("csr", lens, ps, pool, rnd, host_indptr=True)
        wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=ps,
                     q_data_type=E4M3, kv_data_type=E4M3, o_data_type=o_dtype)
        q_buf.copy_(fp8_q(q_buf.shape, E4M3, gen, 0.5))
        graph = replay_poisoned(graph, lambda: wrapper.run(q_buf, (k, v), out=out_buf, lse=lse_buf, return_lse=True,
                                                           **scales), out_buf, lse_buf)
        ref_out, ref_lse = decode_ref(q_buf[:len(lens)], k, v, paged.table, lens, **scales)
        check_decode(out_buf[:len(lens)], lse_buf[:len(lens)], ref_out, ref_lse, lens, out_dtype)


@pytest.mark.gpu
def test_fast_decode_plan_fp8_q(workspace):
    """fast_decode_plan bound as SGLang binds it (begin_forward, host indptr), fp8 q with a
    bf16 output: the same output as plan()'s, bit for bit, and the reference's; then a
    re-plan of other lengths."""
    hq, hk, d, ps = 64, 8, 128, 16
    rnd = random.Random(91)
    gen = torch.Generator(device=DEV).manual_seed(91)
    scales = dict(q_scale=2.0, k_scale=0.5, v_scale=1.5)
    for round_, lens in enumerate(([120, 4000, 17, 0, 640], [3, 900, 2049])):
        num_pages = sum(-(-n // ps) for n in lens) + 4
        paged = make_page_table("csr", lens, ps, num_pages, rnd)
        _, k, v = make_cache("tuple", "NHD", num_pages, ps, hk, d, E4M3, gen)
        nan_pages(k, paged.k_unused)
        q = fp8_q((len(lens), hq, d), E4M3, gen, 2.0)
        indptr, indices, last = (paged.plan_args[n] for n in ("indptr", "indices", "last_page_len"))
        plain = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        plain.plan(indptr, indices, last, hq, hk, d, ps, q_data_type=E4M3, o_data_type=BF16)
        expected = plain.run(q, (k, v), **scales).clone()
        w = fij.BatchDecodeWithPagedKVCacheWrapper(torch.zeros_like(workspace), "NHD")
        w.plan(indptr, indices, last, hq, hk, d, ps, q_data_type=BF16)  # the prior plan fast_decode_plan needs
        w.begin_forward = functools.partial(fij.decode.fast_decode_plan, w)
        w.begin_forward(indptr, indices, last, hq, hk, d, ps, q_data_type=E4M3, kv_data_type=E4M3, o_data_type=BF16,
                        global_override_indptr_cpu=indptr.cpu())
        out_buf, out = poisoned(q.shape, BF16)
        w.forward(q, (k, v), out=out, **scales)
        torch.cuda.synchronize()
        assert_sentinels(out_buf, "out")
        torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"round {round_}")
        ref_out, _ = decode_ref(q, k, v, paged.table, lens, **scales)
        check_decode(out, None, ref_out, None, lens, BF16)


@pytest.mark.gpu
def test_single_decode_fp8_q():
    gen = torch.Generator(device=DEV).manual_seed(17)
    hq, hk, d, kv_len = 32, 8, 128, 3001
    q = fp8_q((hq, d), E4M3, gen, 0.5)
    k = torch.randn(kv_len, hk, d, generator=gen, device=DEV).to(E4M3)
    v = torch.randn(kv_len, hk, d, generator=gen, device=DEV).to(E4M3)
    scales = dict(q_scale=0.5, k_scale=1.25, v_scale=0.5)
    out, lse = fij.single_decode_with_kv_cache(q, k, v, return_lse=True, **scales)
    assert out.shape == (hq, d) and out.dtype == F16 and lse.shape == (hq,)
    table = csr_page_table(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                           torch.tensor([kv_len], dtype=torch.int32))
    ref_out, ref_lse = decode_ref(q[None], k[None], v[None], table, [kv_len], **scales)
    check_decode(out[None], lse[None], ref_out, ref_lse, [kv_len], F16)


@pytest.mark.gpu
def test_run_checks_the_output_dtype(workspace):
    """out= must have the planned output dtype: fp16 (or o_data_type), never q's fp8."""
    lens = [100, 7]
    rnd = random.Random(5)
    gen = torch.Generator(device=DEV).manual_seed(5)
    paged = make_page_table("csr", lens, 16, 12, rnd)
    _, k, v = make_cache("tuple", "NHD", 12, 16, 8, 128, E4M3, gen)
    q = fp8_q((2, 32, 128), E4M3, gen)
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(**paged.plan_args, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, q_data_type=E4M3)
    for wrong in (E4M3, BF16):
        with pytest.raises(ValueError, match=r"^out: .*float16"):
            wrapper.run(q, (k, v), out=torch.empty(q.shape, dtype=wrong, device=DEV))
    with pytest.raises(TypeError, match=r"^q:"):
        wrapper.run(q.to(F16), (k, v))


@pytest.mark.gpu
def test_torch_compile_fullgraph_fp8_q(workspace):
    """torch.compile(fullgraph=True) around run() with fp8 q: no graph break, out in the
    planned dtype, the same values as eager."""
    import torch._dynamo

    lens = [900, 65, 3000]
    rnd = random.Random(8)
    gen = torch.Generator(device=DEV).manual_seed(8)
    num_pages = sum(-(-n // 16) for n in lens) + 4
    paged = make_page_table("csr", lens, 16, num_pages, rnd)
    _, k, v = make_cache("tuple", "NHD", num_pages, 16, 8, 128, E4M3, gen)
    q = fp8_q((3, 64, 128), E4M3, gen)
    w = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    w.plan(**paged.plan_args, num_qo_heads=64, num_kv_heads=8, head_dim=128, page_size=16, q_data_type=E4M3,
           o_data_type=BF16)

    def layer(q, k, v):
        return w.run(q, (k, v), q_scale=0.5, k_scale=2.0, return_lse=True)

    eager = layer(q, k, v)
    explain = torch._dynamo.explain(layer)(q, k, v)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(q, k, v)
    assert got[0].dtype == BF16
    torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], eager[1], rtol=0, atol=0)

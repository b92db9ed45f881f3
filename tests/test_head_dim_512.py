"""head_dim 512: batch decode (the CUDA-core kernel, which takes every head_dim 512 decode) and
batch prefill (paged, ragged, single), causal or not, with and without ROPE_LLAMA, bf16 and
fp16, fp8 e4m3 K/V; against the float64 references, outputs poisoned with NaN first
(docs/prefill.md, docs/decode.md: head_dim 512). The CPU tests: the specs and planners accept
512, every test module is in the tests matrix, and one module of each family renders and
builds for sm_90a."""

from __future__ import annotations

import random
import re

import pytest
import torch
from kv_helpers import DEV, assert_sentinels, assert_tests_matrix_has, dtype_of, make_page_table, poisoned, randn
from test_decode import check_decode, make_cache, nan_pages
from test_prefill import (
    check_out,
    check_prefill,
    indptr_of,
    make_q,
    make_rows,
    paged_kv,
    paged_wrapper,
    plan_kv,
    prefill_spec,
    ragged_kv,
    ragged_wrapper,
    reference,
    run_poisoned,
    tolerance,
)

import flashinfer_jit as fij
from flashinfer_jit.decode.spec import group_tile, uses_tensor_cores
from flashinfer_jit.pipeline import render
from flashinfer_jit.prefill.spec import PrefillSpec
from flashinfer_jit.reference.decode import decode_ref
from flashinfer_jit.reference.prefill import prefill_ref
from flashinfer_jit.specs import DecodeSpec

D = 512
F16, BF16 = "float16", "bfloat16"
HEADS = (8, 2)  # GQA-4: a 64-row tile holds 16 tokens x 4 heads
# (qo_len, kv_len): a chunk at the end of its keys, one token, self-attention off the tile
# sizes, a request with no queries, one with no keys
SHAPES = [(17, 97), (1, 300), (130, 130), (0, 40), (64, 1000), (3, 0), (33, 33 + 257)]

# (q dtype, source, causal, pos_encoding): fp16 every combination (FlashInfer's own head_dim
# 512 tests run fp16, paged and ragged, causal or not, NONE or ROPE_LLAMA), bf16 four of them
PREFILL_CASES = [(F16, src, causal, pe) for src in ("csr", "ragged") for causal in (False, True)
                 for pe in ("NONE", "ROPE_LLAMA")]
PREFILL_CASES += [(BF16, "csr", True, "NONE"), (BF16, "csr", False, "ROPE_LLAMA"), (BF16, "ragged", True, "ROPE_LLAMA"),
                  (BF16, "ragged", False, "NONE")]
FP8_PREFILL = (BF16, "float8_e4m3fn", "csr", True)  # q, K/V, page table, causal

# (q = K/V dtype, (num_qo_heads, num_kv_heads), pos_encoding, page size): GQA groups 1, 4, 8
# (tiles 1, 4 and 8; at most 4 heads a thread, csrc/decode/decode.cuh)
DECODE_CASES = [(F16, (4, 4), "NONE", 16), (F16, (32, 4), "NONE", 1), (F16, (4, 4), "ROPE_LLAMA", 8),
                (F16, (32, 4), "ROPE_LLAMA", 16), (BF16, (32, 8), "NONE", 16), (BF16, (32, 8), "ROPE_LLAMA", 5)]
FP8_DECODE = (F16, "float8_e4m3fn", (32, 8))


def _pf_spec(q, source, causal, pe, kv=None) -> PrefillSpec:
    return prefill_spec(q, kv, dims=(D, D), source=source, mask="causal" if causal else "none", pos_encoding=pe)


def _dec_spec(q, kv, heads, pe) -> DecodeSpec:
    return DecodeSpec(q, kv, D, group_tile(*heads, D), rope=pe == "ROPE_LLAMA")


def specs_needed() -> set:
    specs = {_pf_spec(q, src, causal, pe) for q, src, causal, pe in PREFILL_CASES}
    q, kv, src, causal = FP8_PREFILL
    specs.add(_pf_spec(q, src, causal, "NONE", kv))
    specs |= {_dec_spec(q, q, heads, pe) for q, heads, pe, _ in DECODE_CASES}
    specs.add(_dec_spec(FP8_DECODE[0], FP8_DECODE[1], FP8_DECODE[2], "NONE"))
    return specs


# --- CPU: specs, planners, the tests matrix, one build ---------------------------------------------
def test_specs_accept_512_and_decode_takes_the_cuda_core_kernel():
    spec = PrefillSpec(BF16, BF16, BF16, 512, 512, mask="causal", pos_encoding="rope_llama").validate()
    assert spec.name == "prefill_bf16_bf16_bf16_hd512_vo512_paged_causal_rope_llama"
    assert spec.tile_rows == (64,)
    assert PrefillSpec(BF16, "float8_e4m3fn", BF16, 512, 512).validate().tile_rows == (64,)
    dec = DecodeSpec(F16, F16, 512, group_tile(32, 4, 512)).validate()
    assert dec.group_tile == 8 and not dec.context()["tensor_cores"]
    assert not uses_tensor_cores(False, 512) and uses_tensor_cores(False, 256)
    with pytest.raises(ValueError, match=r"\(multi-token decode\) runs on tensor cores, which take head_dim <= 256"):
        DecodeSpec(F16, F16, 512, 2, q_tokens=2).validate()
    # FlashInfer's (448, 256) probe stays unsupported, with the pairs listed
    with pytest.raises(ValueError, match=r"head_dim_qk=448 is not supported; supported: 64, 128, 192, 256, 512"):
        PrefillSpec(F16, F16, F16, 448, 256).validate()
    with pytest.raises(ValueError, match=r"head_dim_qk=512 with head_dim_vo=256 is not supported; .*\(512, 512\)"):
        PrefillSpec(F16, F16, F16, 512, 256).validate()


def test_wrappers_plan_512_on_the_host():
    """plan() on the CPU (no launch): the prefill planners (C++ and its numpy twin) pick the
    64-row tile, a pinned 128 and a CUDA-graph wrapper's included (one block an SM on its
    grid); decode's plan() takes head_dim 512 and refuses multi-token decode there."""
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    for native in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FLASHINFER_JIT_NATIVE_PLAN", native)
            for graph, pinned in ((False, None), (False, 128), (True, None)):
                kwargs = dict(use_cuda_graph=True, paged_kv_indices_buf=torch.zeros(64, dtype=torch.int32)) \
                    if graph else {}
                w = fij.BatchPrefillWithPagedKVCacheWrapper(ws, **kwargs)
                w._force_tile_rows = pinned
                w.plan(i32([0, 512, 1024]), i32([0, 32, 64]), i32(list(range(64))), i32([16, 16]), 8, 2, 512, 16,
                       causal=True, q_data_type=torch.float16)
                assert w._plan.tile_rows == 64, (native, graph, pinned)
                if graph:
                    assert w._plan.grid == 132, "one 8-warp block of 192 KB an SM"
            r = fij.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
            r.plan(i32([0, 300, 301]), i32([0, 1000, 1100]), 8, 2, 512, causal=False, q_data_type=torch.bfloat16)
            assert r._plan.tile_rows == 64
    dw = fij.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)  # as multi-token decode asks
    with pytest.raises(ValueError, match="multi-token decode runs on tensor cores"):
        dw.plan(i32([0, 1]), i32([0]), i32([1]), 8, 2, 512, 16, q_len_per_req=2)


def test_tests_matrix_has_every_head_dim_512_module():
    assert_tests_matrix_has(specs_needed(), PrefillSpec, 13, "head_dim 512 prefill")


@pytest.mark.parametrize("spec", [
    PrefillSpec(BF16, BF16, BF16, 512, 512, mask="causal"),
    DecodeSpec(F16, F16, 512, 4, rope=True),
], ids=["prefill", "decode"])
def test_512_renders(spec):
    rendered = render.render(spec.validate())
    assert "512" in rendered.sources["kernel.cu"]


@pytest.mark.thorough  # two full hd512 builds (~28 s): CI's --exhaustive run
@pytest.mark.parametrize("spec", [
    PrefillSpec(BF16, BF16, BF16, 512, 512, mask="causal", pos_encoding="rope_llama"),
    DecodeSpec(F16, F16, 512, 8, rope=True),
], ids=["prefill", "decode"])
def test_512_builds_for_sm90a_without_spills(spec, fresh_cache, monkeypatch):
    """A module of each family builds for 9.0a (and loads: its op registers), and ptxas
    reports no spill in any of its kernels (build.log keeps the -Xptxas -v report)."""
    from test_cache import _have_toolchain

    from flashinfer_jit.pipeline import jit
    if not _have_toolchain():
        pytest.skip("needs nvcc, ninja and g++")
    monkeypatch.setenv("FLASHINFER_JIT_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv("FLASHINFER_JIT_DISABLE_JIT", raising=False)
    jit.get_module(spec.validate())
    (log,) = fresh_cache.glob(f"{spec.name}-*/build.log")
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.read_text())
    assert spills and all(s == ("0", "0") for s in spills), spills


# --- GPU: prefill --------------------------------------------------------------------------------
def _prefill_inputs(q_name, source, shapes, seed, kv_name=None, page_size=16):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    rnd = random.Random(seed)
    q_dtype = dtype_of(q_name)
    qo_lens, kv_lens = [m for m, _ in shapes], [n for _, n in shapes]
    k_rows, v_rows = make_rows(kv_lens, HEADS[1], (D, D), q_dtype, gen)
    if source == "ragged":
        kv = ragged_kv(k_rows, v_rows, kv_lens)
    else:
        kv = paged_kv(k_rows, v_rows, kv_lens, page_size, source, "NHD", "tuple", rnd,
                      dtype=dtype_of(kv_name) if kv_name else None)
    q = make_q(sum(qo_lens), HEADS[0], D, q_dtype, gen)
    return q, indptr_of(qo_lens), kv


def _run_prefill(workspace, q_name, kv, q, qo_indptr, causal, pe, kv_name=None, **plan_kwargs):
    wrapper = ragged_wrapper(workspace) if kv.table is None else paged_wrapper(workspace)
    plan_kv(wrapper, qo_indptr, kv, *HEADS, (D, D), 16 if kv.table is not None else None, causal=causal,
            pos_encoding_mode=pe, q_data_type=dtype_of(q_name), kv_data_type=dtype_of(kv_name or q_name),
            **plan_kwargs)
    return run_poisoned(wrapper, q, kv, D, dtype_of(q_name))


@pytest.mark.gpu
@pytest.mark.parametrize("q_name,source,causal,pe", PREFILL_CASES,
                         ids=[f"{q}-{s}-{'causal' if c else 'none'}-{p}" for q, s, c, p in PREFILL_CASES])
def test_batch_prefill_512(q_name, source, causal, pe, workspace):
    q, qo_indptr, kv = _prefill_inputs(q_name, source, SHAPES, 512)
    out, lse = _run_prefill(workspace, q_name, kv, q, qo_indptr, causal, pe)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal, pos_encoding_mode=pe)
    check_prefill(out, lse, ref_out, ref_lse, SHAPES, tolerance(q_name))


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["csr", "ragged"])
def test_batch_prefill_512_split_and_graph(source, workspace):
    """A long request split into chunks (fixed_split_size: partial rows, the in-kernel merge)
    and the same batch on a CUDA-graph wrapper (its grid loops over the items), fp16 causal."""
    shapes = [(40, 2000), (5, 700), (64, 64)]
    q, qo_indptr, kv = _prefill_inputs(F16, source, shapes, 7)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=True)
    tol = tolerance(F16)
    out, lse = _run_prefill(workspace, F16, kv, q, qo_indptr, True, "NONE", fixed_split_size=256)
    check_prefill(out, lse, ref_out, ref_lse, shapes, tol)
    make = ragged_wrapper if kv.table is None else paged_wrapper
    qo_buf = torch.empty(8, dtype=torch.int32, device=DEV)
    graph_kwargs = dict(use_cuda_graph=True, qo_indptr_buf=qo_buf)
    if kv.table is None:
        graph_kwargs["kv_indptr_buf"] = torch.empty(8, dtype=torch.int32, device=DEV)
    else:
        graph_kwargs["paged_kv_indptr_buf"] = torch.empty(8, dtype=torch.int32, device=DEV)
        graph_kwargs["paged_kv_last_page_len_buf"] = torch.empty(8, dtype=torch.int32, device=DEV)
    wrapper = make(workspace, **graph_kwargs)
    plan_kv(wrapper, qo_indptr, kv, *HEADS, (D, D), 16 if kv.table is not None else None, causal=True,
            q_data_type=torch.float16)
    out2, lse2 = run_poisoned(wrapper, q, kv, D, torch.float16)
    check_prefill(out2, lse2, ref_out, ref_lse, shapes, tol)


@pytest.mark.gpu
def test_batch_prefill_512_fp8_kv(workspace):
    q_name, kv_name, source, causal = FP8_PREFILL
    q, qo_indptr, kv = _prefill_inputs(q_name, source, SHAPES, 9, kv_name)
    out, lse = _run_prefill(workspace, q_name, kv, q, qo_indptr, causal, "NONE", kv_name)
    ref_out, ref_lse = reference(q, qo_indptr, kv, causal=causal)
    check_prefill(out, lse, ref_out, ref_lse, SHAPES, tolerance(q_name, fp8=True))


@pytest.mark.gpu
@pytest.mark.parametrize("causal,pe", [(True, "NONE"), (False, "ROPE_LLAMA"), (True, "ROPE_LLAMA"), (False, "NONE")])
def test_single_prefill_512(causal, pe):
    gen = torch.Generator(device=DEV).manual_seed(11)
    m, n = 77, 300
    q = make_q(m, HEADS[0], D, torch.float16, gen)
    k, v = make_rows([n], HEADS[1], (D, D), torch.float16, gen)
    out, lse = fij.single_prefill_with_kv_cache(q, k, v, causal=causal, pos_encoding_mode=pe, return_lse=True)
    assert out.shape == (m, HEADS[0], D) and lse.shape == (m, HEADS[0])
    ref_out, ref_lse = prefill_ref(q, indptr_of([m]), k, v, indptr_of([n]), causal=causal, pos_encoding_mode=pe)
    check_prefill(out, lse, ref_out, ref_lse, [(m, n)], tolerance(F16))
    check_out(fij.single_prefill_with_kv_cache(q, k, v, causal=causal, pos_encoding_mode=pe), ref_out, [(m, n)],
              tolerance(F16))


# --- GPU: decode ---------------------------------------------------------------------------------
def _decode(workspace, q_name, kv_name, heads, pe, page_size, lens, seed, **plan_kwargs):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    rnd = random.Random(seed)
    q_dtype, kv_dtype = dtype_of(q_name), dtype_of(kv_name)
    hq, hk = heads
    num_pages = sum(-(-n // page_size) for n in lens) + 3
    paged = make_page_table("csr", lens, page_size, num_pages, rnd)
    cache, k, v = make_cache("tuple", "NHD", num_pages, page_size, hk, D, kv_dtype, gen)
    nan_pages(k, paged.k_unused)
    nan_pages(v, paged.v_unused)
    q = randn((len(lens), hq, D), q_dtype, gen)
    scales = dict(k_scale=0.5, v_scale=2.0) if kv_dtype.itemsize == 1 else {}
    wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=seed % 2 == 0)
    wrapper.plan(**paged.plan_args, num_qo_heads=hq, num_kv_heads=hk, head_dim=D, page_size=page_size,
                 pos_encoding_mode=pe, q_data_type=q_dtype, kv_data_type=kv_dtype, **plan_kwargs)
    out_buf, out = poisoned((len(lens), hq, D), q_dtype)
    lse_buf, lse = poisoned((len(lens), hq), torch.float32)
    wrapper.run(q, cache, out=out, lse=lse, return_lse=True, **scales)
    torch.cuda.synchronize()
    assert_sentinels(out_buf, "out")
    assert_sentinels(lse_buf, "lse")
    ref_out, ref_lse = decode_ref(q, k, v, paged.table, lens, "NHD", None, -1, None, pe, **scales)
    check_decode(out, lse, ref_out, ref_lse, lens, q_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("q_name,heads,pe,page_size", DECODE_CASES,
                         ids=[f"{q}-{h[0]}x{h[1]}-{p}-p{s}" for q, h, p, s in DECODE_CASES])
def test_batch_decode_512(q_name, heads, pe, page_size, workspace):
    """Lengths 0 to 2048 (RoPE's fp32 angles stay exact enough there), a split forced on the
    long ones and the automatic split of a small batch."""
    lens = [0, 1, 54, 97, 512, 2048, 16, 700]
    _decode(workspace, q_name, q_name, heads, pe, page_size, lens, 21, fixed_split_size=256)
    _decode(workspace, q_name, q_name, heads, pe, page_size, [2048, 3], 22)


@pytest.mark.gpu
def test_batch_decode_512_fp8_kv(workspace):
    q_name, kv_name, heads = FP8_DECODE
    _decode(workspace, q_name, kv_name, heads, "NONE", 16, [0, 5, 300, 1500, 33], 31)


@pytest.mark.gpu
def test_single_decode_512():
    gen = torch.Generator(device=DEV).manual_seed(41)
    (hq, hk), kv_len = (32, 8), 1001
    q = randn((hq, D), torch.bfloat16, gen)
    k, v = randn((kv_len, hk, D), torch.bfloat16, gen), randn((kv_len, hk, D), torch.bfloat16, gen)
    out, lse = fij.single_decode_with_kv_cache(q, k, v, return_lse=True)
    from flashinfer_jit.runtime.page_table import csr_page_table
    table = csr_page_table(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                           torch.tensor([kv_len], dtype=torch.int32))
    ref_out, ref_lse = decode_ref(q[None], k[None], v[None], table, [kv_len], "NHD", None, -1)
    check_decode(out[None], lse[None], ref_out, ref_lse, [kv_len], torch.bfloat16)

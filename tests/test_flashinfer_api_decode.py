"""Batch decode called the way FlashInfer's users write it (issue: a true drop-in): the
soft cap 0.0 as "off", int64 index tensors, CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
fast_decode_plan (SGLang), the older method names, torch.compile(fullgraph=True) through
run() and mode="reduce-overhead" around single_decode_with_kv_cache inside a custom op.
Kernel results are compared with the float64 reference on fresh random data."""

from __future__ import annotations

import functools
import random

import pytest
import torch

import flashinfer_jit as fij
from flashinfer_jit.page_table import csr_page_table
from flashinfer_jit.reference.decode import decode_ref

DEV = "cuda"
HQ, HK, D, PS = 32, 8, 128, 16


def _csr(lens, page_size=PS, device="cpu", dtype=torch.int32, seed=0):
    rnd = random.Random(seed)
    pages = [-(-n // page_size) for n in lens]
    ids = rnd.sample(range(sum(pages) + 4), sum(pages))
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)]
    return (torch.tensor(indptr, dtype=dtype, device=device), torch.tensor(ids, dtype=dtype, device=device),
            torch.tensor(last, dtype=dtype, device=device))


# --- CPU: argument conventions ----------------------------------------------------------------------
def test_decode_submodule_has_flashinfer_names():
    from flashinfer_jit import decode

    for name in ("BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
                 "single_decode_with_kv_cache", "fast_decode_plan"):
        assert callable(getattr(decode, name)) and name in decode.__all__
    assert fij.CUDAGraphBatchDecodeWithPagedKVCacheWrapper is decode.CUDAGraphBatchDecodeWithPagedKVCacheWrapper
    w = decode.BatchDecodeWithPagedKVCacheWrapper
    assert w.begin_forward is w.plan and w.forward is w.run


def test_soft_cap_zero_is_off_and_int64_plans_like_int32():
    lens = [37, 0, 300, 16]
    ws = torch.zeros(1 << 20, dtype=torch.uint8)
    plans = []
    for dtype, cap in ((torch.int32, None), (torch.int64, 0.0)):
        w = fij.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(*_csr(lens, dtype=dtype), HQ, HK, D, PS, logits_soft_cap=cap, q_data_type=torch.bfloat16)
        plans.append(w)
    a, b = plans
    assert a._plan.spec == b._plan.spec and not b._plan.spec.soft_cap and b._plan.config.soft_cap == 0.0
    end = a._views_key[1][-1]  # the packed plan buffer's used length
    assert a._views_key == b._views_key and torch.equal(a._buf[:end], b._buf[:end])
    for bad in (-1.0, float("nan"), "x"):
        with pytest.raises(ValueError, match="logits_soft_cap"):
            b.plan(*_csr(lens), HQ, HK, D, PS, logits_soft_cap=bad)
    with pytest.raises(TypeError, match="indptr"):
        b.plan(*_csr(lens, dtype=torch.int16), HQ, HK, D, PS)


def test_backend_and_sinks_are_checked():
    ws = torch.zeros(1 << 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="backend"):
        fij.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="trtllm-gen")
    fij.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")


# --- GPU ----------------------------------------------------------------------------------------------
def _inputs(lens, seed, dtype=torch.bfloat16, n_tok=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    pages = sum(-(-n // PS) for n in lens) + 4
    k = torch.randn(pages, PS, HK, D, generator=gen, device=DEV).to(dtype)
    v = torch.randn(pages, PS, HK, D, generator=gen, device=DEV).to(dtype)
    q = torch.randn(len(lens) * n_tok, HQ, D, generator=gen, device=DEV).to(dtype)
    return q, k, v


@pytest.fixture(scope="module")
def workspace():
    return torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)


@pytest.mark.gpu
def test_int64_indices_and_zero_soft_cap_match_int32(workspace):
    lens = [700, 1, 0, 2049, 33]
    q, k, v = _inputs(lens, 3)
    outs = []
    for dtype, cap in ((torch.int32, None), (torch.int64, 0.0)):
        w = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(*_csr(lens, device=DEV, dtype=dtype, seed=5), HQ, HK, D, PS, logits_soft_cap=cap,
               q_data_type=torch.bfloat16)
        outs.append(w.run(q, (k, v), return_lse=True))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    table = csr_page_table(*_csr(lens, device=DEV, seed=5))
    ref, _ = decode_ref(q, k, v, table, lens)
    err = float((outs[1][0].double() - ref.double()).norm() / ref.double().norm())
    assert err < 1e-2


@pytest.mark.gpu
def test_fast_decode_plan_as_sglang_binds_it(workspace):
    """SGLang: wrapper.begin_forward = partial(fast_decode_plan, wrapper), called with the
    host copy of indptr (global_override_indptr_cpu): the same plan as plan()."""
    lens = [120, 4000, 17]
    q, k, v = _inputs(lens, 4)
    indptr, indices, last = _csr(lens, device=DEV, seed=6)
    ref_w = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    ref_w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=torch.bfloat16)
    expected = ref_w.run(q, (k, v)).clone()
    w = fij.BatchDecodeWithPagedKVCacheWrapper(torch.zeros_like(workspace), "NHD")
    w.begin_forward = functools.partial(fij.decode.fast_decode_plan, w)
    w.begin_forward(indptr, indices, last, HQ, HK, D, PS, data_type=torch.bfloat16, q_data_type=torch.bfloat16,
                    global_override_indptr_cpu=indptr.cpu())
    torch.testing.assert_close(w.forward(q, (k, v)), expected, rtol=0, atol=0)
    out, lse = w.run_return_lse(q, (k, v))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    w.end_forward()


@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [1, 4])
def test_torch_compile_fullgraph_traces_run(n_tok, workspace):
    """torch.compile(fullgraph=True) of a function around run(): no graph break, the same
    output as eager, and still right after a re-plan with other lengths (the graph reads
    the plan's buffers)."""
    import torch._dynamo

    lens = [900, 65, 3000]
    q, k, v = _inputs(lens, 7, n_tok=n_tok)
    w = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    w.plan(*_csr(lens, device=DEV, seed=8), HQ, HK, D, PS, q_data_type=torch.bfloat16, q_len_per_req=n_tok)

    def layer(q, k, v):
        out, lse = w.run(q * 1.0, (k, v), return_lse=True)
        return out.float() * 2.0, lse

    eager = layer(q, k, v)
    explain = torch._dynamo.explain(layer)(q, k, v)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled(q, k, v)
    torch.testing.assert_close(got[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], eager[1], rtol=0, atol=0)
    lens2 = [1500, 20, 77]  # same batch, other lengths: a re-plan, the same compiled graph
    w.plan(*_csr(lens2, device=DEV, seed=9), HQ, HK, D, PS, q_data_type=torch.bfloat16, q_len_per_req=n_tok)
    got2 = compiled(q, k, v)
    eager2 = layer(q, k, v)
    torch.testing.assert_close(got2[0], eager2[0], rtol=0, atol=0)


@pytest.mark.gpu
def test_reduce_overhead_around_single_decode_in_a_custom_op():
    """FlashInfer issue 541's pattern: single_decode_with_kv_cache inside a user's custom op,
    the caller compiled with mode="reduce-overhead" (CUDA-graph trees): replays match eager
    on new inputs written into the same tensors."""
    kv_len = 1000

    @torch.library.custom_op("fij_api_test::attend", mutates_args=())
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fij.single_decode_with_kv_cache(q, k, v)

    @attend.register_fake
    def _(q, k, v):
        return torch.empty_like(q)

    def step(q, k, v):
        return attend(q * 1.0, k, v) + 1.0

    gen = torch.Generator(device=DEV).manual_seed(11)
    q = torch.randn(HQ, D, generator=gen, device=DEV).to(torch.float16)
    k = torch.randn(kv_len, HK, D, generator=gen, device=DEV).to(torch.float16)
    v = torch.randn(kv_len, HK, D, generator=gen, device=DEV).to(torch.float16)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for i in range(5):
        q.copy_(torch.randn(q.shape, generator=gen, device=DEV))
        got = compiled(q, k, v).clone()
        torch.testing.assert_close(got, step(q, k, v), rtol=0, atol=0)
    table = csr_page_table(torch.tensor([0, 1], dtype=torch.int32, device=DEV),
                           torch.zeros(1, dtype=torch.int32, device=DEV),
                           torch.tensor([kv_len], dtype=torch.int32, device=DEV))
    ref, _ = decode_ref(q[None], k[None], v[None], table, [kv_len])
    direct = fij.single_decode_with_kv_cache(q, k, v)
    err = float((direct.double() - ref[0].double()).norm() / ref.double().norm())
    assert err < 2e-3

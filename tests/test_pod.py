"""POD (PODWithPagedKVCacheWrapper, BatchPODWithPagedKVCacheWrapper): a prefill side and a
batch of one-token decodes in one launch, each side against its float64 reference
(flashinfer_jit/reference/prefill.py and decode.py).

Single POD runs one prefill request on ragged K/V (k_p, v_p) and the decodes on a paged
cache; batch POD runs several prefill requests and the decodes, both on paged caches (one
shared tensor with disjoint pages, or two). CASES is a chosen list, not a product: dtypes,
head dims, GQA groups, prefill shapes (qo_len x kv_len, causal), decode batches, lengths and
page sizes. The tests after it take one option each (LSE, custom mask, window, scales, cache
forms and layouts, re-plan, batch POD, CUDA graphs) at bf16, head_dim 128, 32/8 heads.

Every GPU test uses fresh random data. Cache slots no request reads hold NaN, so a read
through a wrong page id or past a request's length shows. POD allocates its outputs, so they
cannot be poisoned in place: NaN blocks of the outputs' sizes are freed just before run()
(the caching allocator tends to hand them back), and every output is checked for NaN and
compared in full: |out - ref| <= tol * (1 + |ref|) (tol by dtype, looser with fp8 K/V, as
test_prefill.py), LSEs (base 2) within LSE_TOL * max(1, |ref|).

The CPU tests check PodSpec (rendering, one nvcc build marked slow), that the AOT matrix of
the tests lists every module used here, and the wrappers' argument checks, which raise
before any launch (their cuda variants run where a GPU is).
"""

from __future__ import annotations

import itertools
import random
import re
from typing import NamedTuple

import pytest
import torch
from kv_helpers import DEV, assert_tests_matrix_has, capture_graph, dtype_of, grid_case, randn

import flashinfer_jit as fij
from flashinfer_jit.pipeline import render, toolchain
from flashinfer_jit.pipeline.errors import ToolchainError
from flashinfer_jit.pipeline.jit import get_module
from flashinfer_jit.pod import wrapper as pod_mod
from flashinfer_jit.pod.spec import PodSpec, pod_spec
from flashinfer_jit.reference.decode import decode_ref
from flashinfer_jit.reference.prefill import packbits_ref, prefill_ref
from flashinfer_jit.runtime.page_table import PageTable, csr_page_table
from flashinfer_jit.specs import FAMILIES

TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}  # |out - ref| <= tol * (1 + |ref|)
FP8_FACTOR = 2.5  # fp8 decode cache: the kernel may round P more coarsely
LSE_TOL = 1e-2  # base 2, relative to max(1, |lse|)
FP8_NAN = 0x7F  # NaN in e4m3fn
BF16, LLAMA, HD = torch.bfloat16, (32, 8), 128
SHORT = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3"}


@pytest.fixture(autouse=True)
def mma_pod_by_default(monkeypatch):
    """The POD wrappers' and BatchAttention's default prefill_backend is "auto" (POD on Hopper on
    sm_90 where the prefill side plans the Hopper kernel). The cases of this file, of
    test_batch_attention.py and of test_pod_host.py that set none were written for the mma.sync
    POD and keep it ("fa2"); the POD-on-Hopper cases set "auto" or "fa3" themselves, and
    test_default_prefill_backend_is_auto checks the default. (FlashInfer's own tests of these
    wrappers run with the default: docs/api.md.)"""
    from flashinfer_jit.pod import batch_attention
    monkeypatch.setattr(pod_mod._Pod, "prefill_backend", "fa2")
    monkeypatch.setattr(batch_attention, "DEFAULT_PREFILL_BACKEND", "fa2")


# --- the grid ----------------------------------------------------------------------------------
class Case(NamedTuple):
    dtype: str       # q_p, k_p, v_p, q_d, the decode cache and both outputs
    head_dim: int
    heads: tuple     # (num_qo_heads, num_kv_heads)
    qo_len: int      # the prefill request
    kv_len: int
    causal: bool
    batch: int       # decode requests
    max_kv: int      # decode lengths: random in 1..max_kv, with max_kv, 1 and page boundaries among them
    page_size: int


PREFILL_SHAPES = [(qo, kv, causal) for qo in (1, 127, 1000) for kv in (127, 2048) for causal in (False, True)
                  if not (causal and kv < qo)]  # 11
DECODE_SHAPES = list(itertools.product((1, 17, 130), (1, 127, 3000), (1, 16)))  # (batch, max_kv, page_size): 18
# (dtype, head_dim, heads, prefill shapes); the decode shapes are dealt in turn. 8 modules:
# (4, 1) shares (32, 8)'s group tile; head_dim 64 and 256 one mask each. Single POD runs one
# K/V dtype and its k_p / v_p take q's, so fp8 caches are batch POD's (test_batch_pod).
GROUPS = [
    ("bfloat16", 128, (32, 8), PREFILL_SHAPES),
    ("float16", 128, (32, 8), PREFILL_SHAPES),
    ("bfloat16", 128, (8, 8), PREFILL_SHAPES),
    ("bfloat16", 128, (4, 1), [(127, 2048, True), (1000, 127, False), (1, 2048, False)]),
    ("float16", 64, (32, 8), [(127, 127, False), (1000, 2048, False), (1, 2048, False)]),
    ("bfloat16", 256, (32, 8), [(127, 127, True), (1000, 2048, True), (1, 127, True)]),
]
_deal = itertools.cycle(DECODE_SHAPES)
CASES = [Case(dt, d, heads, qo, kv, causal, *next(_deal))
         for dt, d, heads, shapes in GROUPS for qo, kv, causal in shapes]


def case_id(i: int, c: Case) -> str:
    return (f"{i:02d}-{SHORT[c.dtype]}-hd{c.head_dim}-{c.heads[0]}x{c.heads[1]}-p{c.qo_len}x{c.kv_len}"
            f"{'-causal' if c.causal else ''}-d{c.batch}x{c.max_kv}-ps{c.page_size}")


def specs_needed() -> set:
    """Every POD module the GPU tests of this file load."""
    def spec(dtype, kv, d=HD, heads=LLAMA, prefill_kv="ragged", layout="NHD", mask="none"):
        return pod_spec(dtype, kv, d, prefill_kv, "csr", layout, mask, *heads)
    specs = {spec(c.dtype, c.dtype, c.head_dim, c.heads, mask="causal" if c.causal else "none") for c in CASES}
    specs |= {spec("bfloat16", "bfloat16", mask=m) for m in ("none", "causal", "custom")}  # LSE, window, mask, scales
    specs |= {spec("bfloat16", "bfloat16", layout=lay, mask="causal") for lay in ("NHD", "HND")}  # cache forms
    specs |= {spec("bfloat16", kv, prefill_kv="paged", mask=m)  # batch POD
              for kv in ("bfloat16", "float8_e4m3fn") for m in ("none", "causal")}
    return specs


# --- inputs --------------------------------------------------------------------------------------
def _i32(values, device=DEV) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _seeded(seed: int):
    return random.Random(seed), torch.Generator(device=DEV).manual_seed(seed)


def decode_lens(batch: int, max_kv: int, page_size: int, rnd: random.Random) -> list[int]:
    lens = [rnd.randint(1, max_kv) for _ in range(batch)]
    for i, n in enumerate([max_kv, 1, page_size, page_size + 1][:batch]):
        lens[i] = min(n, max_kv)
    rnd.shuffle(lens)
    return lens


class Paged(NamedTuple):
    run_arg: object      # what run() takes: (k, v) or one [P, 2, ...] tensor
    k: torch.Tensor      # the K and V views, for the references
    v: torch.Tensor
    layout: str


class Table(NamedTuple):
    plan_args: tuple     # (indptr, indices, last_page_len), int32 on the GPU
    table: PageTable     # for the references
    lens: list


def make_cache(num_pages, page_size, num_kv_heads, head_dim, dtype, gen, layout="NHD", single=False) -> Paged:
    page = (page_size, num_kv_heads) if layout == "NHD" else (num_kv_heads, page_size)
    if single:
        buf = randn((num_pages, 2, *page, head_dim), dtype, gen)
        return Paged(buf, buf[:, 0], buf[:, 1], layout)
    k, v = (randn((num_pages, *page, head_dim), dtype, gen) for _ in range(2))
    return Paged((k, v), k, v, layout)


def csr_table(lens, page_size: int, page_ids: list) -> Table:
    """The requests' pages, in order, from `page_ids`."""
    pages = [-(-n // page_size) for n in lens]
    indptr, indices = _i32(list(itertools.accumulate(pages, initial=0))), _i32(page_ids[: sum(pages)])
    last = _i32([n - (p - 1) * page_size for n, p in zip(lens, pages)])
    return Table((indptr, indices, last), csr_page_table(indptr, indices, last), list(lens))


def nan_outside(cache: Paged, page_size: int, tables) -> None:
    """NaN into every slot of the cache that no request of `tables` reads."""
    used = torch.zeros(cache.k.shape[0], page_size, dtype=torch.bool)
    for t in tables:
        indptr, indices = t.plan_args[0].tolist(), t.plan_args[1].cpu().long()
        for b, n in enumerate(t.lens):
            j = torch.arange(n)
            used[indices[indptr[b]:][j // page_size], j % page_size] = True
    unused = (~used).to(DEV)
    for part in (cache.k, cache.v):
        raw = part.view(torch.uint8) if part.element_size() == 1 else part
        slots = raw if cache.layout == "NHD" else raw.transpose(1, 2)  # [P, page_size, Hk, D] either way
        slots[unused] = FP8_NAN if part.element_size() == 1 else float("nan")


class Decode(NamedTuple):
    q: torch.Tensor
    cache: Paged
    table: Table


def make_decode(lens, heads, head_dim, page_size, dtype, kv_dtype, gen, rnd, layout="NHD", single=False) -> Decode:
    num_pages = sum(-(-n // page_size) for n in lens) + 4
    table = csr_table(lens, page_size, rnd.sample(range(num_pages), num_pages))
    cache = make_cache(num_pages, page_size, heads[1], head_dim, kv_dtype, gen, layout, single)
    nan_outside(cache, page_size, [table])
    return Decode(randn((len(lens), heads[0], head_dim), dtype, gen), cache, table)


def make_prefill(qo_len, kv_len, heads, head_dim, dtype, gen):
    """(q_p, k_p, v_p): one request, NHD."""
    hq, hk = heads
    return (randn((qo_len, hq, head_dim), dtype, gen), randn((kv_len, hk, head_dim), dtype, gen),
            randn((kv_len, hk, head_dim), dtype, gen))


def prefill_reference(q, k, v, **kwargs):
    return prefill_ref(q, _i32([0, q.shape[0]]), k, v, kv_indptr=_i32([0, k.shape[0]]), **kwargs)


def decode_reference(dec: Decode, **kwargs):
    return decode_ref(dec.q, dec.cache.k, dec.cache.v, dec.table.table, dec.table.lens, dec.cache.layout, **kwargs)


# --- running and checking -----------------------------------------------------------------------
def plan_pod(w, dec: Decode, page_size: int, dtype, kv_dtype=None, **kwargs) -> None:
    num_kv_heads = dec.cache.k.shape[2 if dec.cache.layout == "NHD" else 1]
    w.plan(*dec.table.plan_args, dec.q.shape[1], num_kv_heads, dec.q.shape[2], page_size, q_data_type=dtype,
           kv_data_type=kv_dtype, **kwargs)


def _poison_allocator(*qs) -> None:
    """Best effort: NaN blocks of the outputs' sizes (q's, and the float32 LSEs), freed at
    once; the caching allocator hands a freed block to the next allocation of its size, so
    an output row the kernel skips most likely shows as NaN."""
    for q in qs:
        torch.full_like(q, float("nan"))
        torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)


def unpack(result, want_p: bool, want_d: bool):
    """run()'s result -> (out_p, out_d, lse_p, lse_d); an LSE not asked for must be None."""
    if not (want_p or want_d):
        out_p, out_d = result
        return out_p, out_d, None, None
    (out_p, out_d), (lse_p, lse_d) = result
    assert (lse_p is not None, lse_d is not None) == (want_p, want_d), "LSEs returned other than asked for"
    return out_p, out_d, lse_p, lse_d


def run_pod(w, q_p, k_p, v_p, dec: Decode, **kwargs):
    _poison_allocator(q_p, dec.q)
    result = w.run(q_p, k_p, v_p, dec.q, dec.cache.run_arg, **kwargs)
    torch.cuda.synchronize()
    return unpack(result, kwargs.get("return_lse_p", False), kwargs.get("return_lse_d", False))


def check_out(out, ref, tol: float, what: str) -> None:
    """No NaN; every element within tol * (1 + |ref|)."""
    o, r = out.double(), ref.double().to(out.device)
    assert o.shape == r.shape, f"{what}: shape {tuple(o.shape)}, expected {tuple(r.shape)}"
    assert not torch.isnan(r).any(), f"{what}: NaN in the reference (it read a poisoned slot: a test bug)"
    nan_rows = torch.isnan(o).flatten(1).any(1).nonzero().flatten().tolist()
    assert not nan_rows, f"{what}: NaN in rows {nan_rows[:8]} of {o.shape[0]}"
    excess = ((o - r).abs() - tol * (1 + r.abs())).flatten(1).amax(1)
    bad = (excess > 0).nonzero().flatten().tolist()
    if bad:
        worst = max(bad, key=lambda i: float(excess[i]))
        err = float((o[worst] - r[worst]).abs().max())
        pytest.fail(f"{what}: {len(bad)} of {o.shape[0]} rows off; worst row {worst} by {err:.3e} "
                    f"(> {tol:g} x (1 + |ref|)); rows {bad[:8]}")


def check_lse(lse, ref, what: str) -> None:
    """float32, no NaN, -inf exactly where the reference is, elsewhere within LSE_TOL."""
    s, r = lse.double(), ref.double().to(lse.device)
    assert lse.dtype == torch.float32 and s.shape == r.shape, f"{what}: {lse.dtype} {tuple(s.shape)}"
    if s.numel() == 0:  # (a side without requests)
        return
    assert not torch.isnan(s).any(), f"{what}: NaN"
    empty = torch.isneginf(r)
    assert torch.equal(torch.isneginf(s), empty), f"{what}: -inf where the reference is finite or the other way round"
    err = float(torch.where(empty, 0.0, (s - r).abs() / r.abs().clamp(min=1.0)).max())
    assert err <= LSE_TOL, f"{what}: off by {err:.3e} (relative to max(1, |ref|)) > {LSE_TOL}"


def check_pod(outs, ref_p, ref_d, dtype, fp8: bool = False) -> None:
    """outs: (out_p, out_d, lse_p, lse_d); ref_p, ref_d: (out, lse) of the references."""
    out_p, out_d, lse_p, lse_d = outs
    assert out_p.dtype == dtype and out_d.dtype == dtype, (out_p.dtype, out_d.dtype)
    tol = TOL[dtype] * (FP8_FACTOR if fp8 else 1.0)
    check_out(out_p, ref_p[0], tol, "out_p")
    check_out(out_d, ref_d[0], tol, "out_d")
    if lse_p is not None:
        check_lse(lse_p, ref_p[1], "lse_p")
    if lse_d is not None:
        check_lse(lse_d, ref_d[1], "lse_d")


# --- single POD ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("index", [pytest.param(i, id=case_id(i, c)) for i, c in enumerate(CASES)])
def test_pod(index, workspace):
    case, rnd, gen = grid_case(CASES, index, 7000)
    dtype = dtype_of(case.dtype)
    q_p, k_p, v_p = make_prefill(case.qo_len, case.kv_len, case.heads, case.head_dim, dtype, gen)
    lens = decode_lens(case.batch, case.max_kv, case.page_size, rnd)
    dec = make_decode(lens, case.heads, case.head_dim, case.page_size, dtype, dtype, gen, rnd)
    lse = index % 3 == 0  # both LSEs in a third of the cases
    w = fij.PODWithPagedKVCacheWrapper(workspace, "NHD")
    plan_pod(w, dec, case.page_size, dtype)
    outs = run_pod(w, q_p, k_p, v_p, dec, causal_p=case.causal, return_lse_p=lse, return_lse_d=lse)
    check_pod(outs, prefill_reference(q_p, k_p, v_p, causal=case.causal), decode_reference(dec), dtype)


def _llama(seed: int, qo_len=127, kv_len=700, batch=17, max_kv=1000, page_size=16, **decode_kwargs):
    """bf16, head_dim 128, 32/8 heads: (q_p, k_p, v_p, decode, rnd, gen)."""
    rnd, gen = _seeded(seed)
    q_p, k_p, v_p = make_prefill(qo_len, kv_len, LLAMA, HD, BF16, gen)
    dec = make_decode(decode_lens(batch, max_kv, page_size, rnd), LLAMA, HD, page_size, BF16, BF16, gen, rnd,
                      **decode_kwargs)
    return q_p, k_p, v_p, dec, rnd, gen


@pytest.mark.gpu
@pytest.mark.parametrize("want_p, want_d", [(True, False), (False, True)], ids=["lse_p", "lse_d"])
def test_pod_returns_the_lse_asked_for(want_p, want_d, workspace):
    q_p, k_p, v_p, dec, _, _ = _llama(1, qo_len=300, kv_len=300)
    w = fij.PODWithPagedKVCacheWrapper(workspace, "NHD")
    plan_pod(w, dec, 16, BF16)
    outs = run_pod(w, q_p, k_p, v_p, dec, causal_p=True, return_lse_p=want_p, return_lse_d=want_d)
    check_pod(outs, prefill_reference(q_p, k_p, v_p, causal=True), decode_reference(dec), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
def test_pod_custom_mask(packed, workspace):
    """custom_mask_p [qo_len, kv_len] (True keeps) or its bits (little order); a row that
    keeps no key gives zeros and LSE -inf."""
    q_p, k_p, v_p, dec, _, gen = _llama(2 + packed, qo_len=127, kv_len=300)
    mask = torch.rand(127, 300, generator=gen, device=DEV) < 0.5
    mask[5], mask[6] = False, True
    given = dict(packed_custom_mask_p=packbits_ref(mask.reshape(-1), "little")) if packed else dict(custom_mask_p=mask)
    w = fij.PODWithPagedKVCacheWrapper(workspace, "NHD")
    plan_pod(w, dec, 16, BF16)
    outs = run_pod(w, q_p, k_p, v_p, dec, return_lse_p=True, **given)
    check_pod(outs, prefill_reference(q_p, k_p, v_p, custom_mask=mask.reshape(-1)), decode_reference(dec), BF16)
    assert bool((outs[0][5] == 0).all()), "a row that keeps no key must be exactly zero"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_pod_window_left(causal, workspace):
    """window_left_p on the prefill side (keys from pos_i - w), plan(window_left=) on the decode side."""
    q_p, k_p, v_p, dec, _, _ = _llama(4, qo_len=200, kv_len=700)
    w = fij.PODWithPagedKVCacheWrapper(workspace, "NHD")
    plan_pod(w, dec, 16, BF16, window_left=37)
    outs = run_pod(w, q_p, k_p, v_p, dec, causal_p=causal, window_left_p=50, return_lse_p=True, return_lse_d=True)
    check_pod(outs, prefill_reference(q_p, k_p, v_p, causal=causal, window_left=50),
              decode_reference(dec, window_left=37), BF16)


@pytest.mark.gpu
def test_pod_scales(workspace):
    """sm_scale_p on the prefill side; plan()'s sm_scale times q_scale and k_scale, and v_scale
    on out_d, on the decode side (single POD's scales are the decode side's, as FlashInfer's)."""
    q_p, k_p, v_p, dec, _, _ = _llama(5)
    scales = dict(q_scale=1.25, k_scale=0.8, v_scale=1.5)
    w = fij.PODWithPagedKVCacheWrapper(workspace, "NHD")
    plan_pod(w, dec, 16, BF16, sm_scale=0.07)
    outs = run_pod(w, q_p, k_p, v_p, dec, sm_scale_p=0.05, return_lse_p=True, return_lse_d=True, **scales)
    check_pod(outs, prefill_reference(q_p, k_p, v_p, sm_scale=0.05), decode_reference(dec, sm_scale=0.07, **scales),
              BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("single", [False, True], ids=["tuple", "single"])
def test_pod_cache_forms_and_layouts(layout, single, workspace):
    """The decode cache as a (k, v) tuple or one [P, 2, ...] tensor, NHD or HND (the wrapper's kv_layout)."""
    q_p, k_p, v_p, dec, _, _ = _llama(6, qo_len=127, kv_len=2048, batch=33, layout=layout, single=single)
    w = fij.PODWithPagedKVCacheWrapper(workspace, layout)
    plan_pod(w, dec, 16, BF16)
    outs = run_pod(w, q_p, k_p, v_p, dec, causal_p=True, kv_layout_d=layout)
    check_pod(outs, prefill_reference(q_p, k_p, v_p, causal=True), decode_reference(dec), BF16)


@pytest.mark.gpu
def test_pod_runs_twice_and_after_a_replan(workspace):
    """One plan(), two run()s with new q values in the same tensors (the outputs change and
    both match), then a plan() of another decode batch and its run()."""
    q_p, k_p, v_p, dec, rnd, gen = _llama(7, qo_len=300, kv_len=1200, max_kv=2000)
    w = fij.PODWithPagedKVCacheWrapper(workspace, "NHD")
    plan_pod(w, dec, 16, BF16)
    first = [t.clone() for t in run_pod(w, q_p, k_p, v_p, dec, causal_p=True)[:2]]
    check_pod((*first, None, None), prefill_reference(q_p, k_p, v_p, causal=True), decode_reference(dec), BF16)
    q_p.copy_(randn(q_p.shape, BF16, gen))
    dec.q.copy_(randn(dec.q.shape, BF16, gen))
    second = run_pod(w, q_p, k_p, v_p, dec, causal_p=True)
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1]), "new q, the same outputs"
    check_pod(second, prefill_reference(q_p, k_p, v_p, causal=True), decode_reference(dec), BF16)
    dec = make_decode(decode_lens(5, 3000, 16, rnd), LLAMA, HD, 16, BF16, BF16, gen, rnd)
    plan_pod(w, dec, 16, BF16)
    third = run_pod(w, q_p, k_p, v_p, dec, causal_p=True)
    assert third[1].shape[0] == 5
    check_pod(third, prefill_reference(q_p, k_p, v_p, causal=True), decode_reference(dec), BF16)


@pytest.mark.gpu
def test_pod_cuda_graph_replay(workspace):
    """run() captured once with use_cuda_graph=True (the decode page table in fixed buffers),
    replayed with new q values in the same tensors, then after a plan() of other decode
    lengths (same batch) over the same cache, refilled in place."""
    rnd, gen = _seeded(8)
    batch, page_size, max_kv = 17, 16, 1000
    num_pages = batch * -(-max_kv // page_size) + 4
    cache = make_cache(num_pages, page_size, LLAMA[1], HD, BF16, gen)
    w = fij.PODWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=_i32([0] * (batch + 1)),
        paged_kv_indices_buffer=_i32([0] * num_pages), paged_kv_last_page_len_buffer=_i32([0] * batch))
    q_p, k_p, v_p = make_prefill(127, 1000, LLAMA, HD, BF16, gen)
    q_d = randn((batch, LLAMA[0], HD), BF16, gen)
    graph = outs = table = None
    for step in range(3):
        if step != 1:  # step 1: the same plan, new q values only
            lens = decode_lens(batch, max_kv, page_size, rnd)
            table = csr_table(lens, page_size, rnd.sample(range(num_pages), num_pages))
            for part in (cache.k, cache.v):
                part.copy_(randn(part.shape, BF16, gen))
            nan_outside(cache, page_size, [table])
            w.plan(*table.plan_args, *LLAMA, HD, page_size, q_data_type=BF16)
        q_p.copy_(randn(q_p.shape, BF16, gen))
        q_d.copy_(randn(q_d.shape, BF16, gen))
        if graph is None:
            graph, outs = capture_graph(lambda: w.run(q_p, k_p, v_p, q_d, cache.run_arg, causal_p=True))
        for t in outs:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_pod((*outs, None, None), prefill_reference(q_p, k_p, v_p, causal=True),
                  decode_reference(Decode(q_d, cache, table)), BF16)


# --- batch POD -----------------------------------------------------------------------------------
# (causal_p, one shared cache, return_lse, cache dtype, scales): batch POD applies q_scale,
# k_scale and v_scale to both sides (both read the paged caches; FlashInfer: the decode side's)
BATCH_CASES = [
    pytest.param(False, True, True, BF16, {}, id="shared-lse"),
    pytest.param(True, True, False, BF16, {}, id="shared-causal"),
    pytest.param(True, False, True, BF16, dict(q_scale=1.25, k_scale=0.8, v_scale=1.5), id="two-caches-causal-scales"),
    pytest.param(False, False, False, BF16, {}, id="two-caches"),
    pytest.param(True, True, True, torch.float8_e4m3fn, dict(k_scale=0.5, v_scale=2.0), id="e4m3-shared-causal-lse"),
    pytest.param(False, False, False, torch.float8_e4m3fn, {}, id="e4m3-two-caches"),
]


def two_sides(kv_lens, lens_d, page_size: int, hk: int, head_dim: int, kv_dtype, shared: bool, rnd, gen) -> tuple:
    """Batch POD's inputs: the prefill's and the decodes' CSR tables over disjoint page ids of
    one cache (shared) or one cache each, every slot outside them NaN: (table_p, table_d,
    cache_p, cache_d)."""
    pages_p, pages_d = (sum(-(-n // page_size) for n in lens) for lens in (kv_lens, lens_d))
    num_pages = pages_p + pages_d + 5
    ids = rnd.sample(range(num_pages), num_pages)
    table_p, table_d = csr_table(kv_lens, page_size, ids[:pages_p]), csr_table(lens_d, page_size, ids[pages_p:])
    cache_p = make_cache(num_pages, page_size, hk, head_dim, kv_dtype, gen)
    cache_d = cache_p if shared else make_cache(num_pages, page_size, hk, head_dim, kv_dtype, gen)
    nan_outside(cache_p, page_size, [table_p, table_d] if shared else [table_p])
    if not shared:
        nan_outside(cache_d, page_size, [table_d])
    return table_p, table_d, cache_p, cache_d


@pytest.mark.gpu
@pytest.mark.parametrize("causal, shared, return_lse, kv_dtype, scales", BATCH_CASES)
def test_batch_pod(causal, shared, return_lse, kv_dtype, scales, workspace):
    """Prefill requests (qo 7, 300, 1 over kv 500, 300, 2048) and 9 decodes on paged caches:
    one cache with disjoint page ids for the two sides, or one cache each."""
    rnd, gen = _seeded(9 + 2 * causal + shared + 4 * (kv_dtype != BF16))
    page_size, (hq, hk) = 16, LLAMA
    qo_lens, kv_lens, lens_d = [7, 300, 1], [500, 300, 2048], decode_lens(9, 1500, page_size, rnd)
    table_p, table_d, cache_p, cache_d = two_sides(kv_lens, lens_d, page_size, hk, HD, kv_dtype, shared, rnd, gen)
    qo_indptr_p = _i32(list(itertools.accumulate(qo_lens, initial=0)))
    q_p = randn((sum(qo_lens), hq, HD), BF16, gen)
    dec = Decode(randn((len(lens_d), hq, HD), BF16, gen), cache_d, table_d)
    w = fij.BatchPODWithPagedKVCacheWrapper(workspace, "NHD")
    w.plan(qo_indptr_p, *table_p.plan_args, _i32(list(range(len(lens_d) + 1))), *table_d.plan_args, hq, hk, HD,
           page_size, q_data_type=BF16, kv_data_type=kv_dtype)
    _poison_allocator(q_p, dec.q)
    result = w.run(q_p, cache_p.run_arg, dec.q, cache_d.run_arg, causal_p=causal, return_lse=return_lse, **scales)
    torch.cuda.synchronize()
    ref_p = prefill_ref(q_p, qo_indptr_p, cache_p.k, cache_p.v, page_table=table_p.table, causal=causal, **scales)
    check_pod(unpack(result, return_lse, return_lse), ref_p, decode_reference(dec, **scales), BF16,
              fp8=kv_dtype.itemsize == 1)



@pytest.mark.gpu
def test_batch_pod_orders_both_sides_pages_in_one_launch(workspace):
    """Batch POD's plan() launches its two sides' page orders as one kernel
    (page_order.launch_pending): each side's reordered page ids, and the prefill work list's
    first page ids, equal those of the decode and prefill wrappers planned alone."""
    rnd, gen = _seeded(41)
    page_size, (hq, hk) = 16, LLAMA
    qo_lens, kv_lens, lens_d = [7, 300, 64], [500, 1300, 4000], decode_lens(12, 3000, page_size, rnd)
    table_p, table_d, _, _ = two_sides(kv_lens, lens_d, page_size, hk, HD, BF16, True, rnd, gen)
    qo_indptr_p = _i32(list(itertools.accumulate(qo_lens, initial=0)))
    w = fij.BatchPODWithPagedKVCacheWrapper(workspace, "NHD")
    w.plan(qo_indptr_p, *table_p.plan_args, _i32(list(range(len(lens_d) + 1))), *table_d.plan_args, hq, hk, HD,
           page_size, q_data_type=BF16, kv_data_type=BF16, causal=True)
    orders = (w._decode._page_order, w._prefill._page_order)
    assert not any(o.pending or o.defer for o in orders)
    ws = [torch.empty(64 << 20, dtype=torch.uint8, device=DEV) for _ in range(2)]
    d = fij.BatchDecodeWithPagedKVCacheWrapper(ws[0], "NHD", use_tensor_cores=True)
    d.plan(*table_d.plan_args, hq, hk, HD, page_size, q_data_type=BF16, kv_data_type=BF16)
    p = fij.BatchPrefillWithPagedKVCacheWrapper(ws[1], "NHD", backend="fa2")
    p._force_tile_rows = w._prefill._force_tile_rows
    p.plan(qo_indptr_p, *table_p.plan_args, hq, hk, HD, page_size, q_data_type=BF16, kv_data_type=BF16, causal=True)
    torch.cuda.synchronize()
    pages_d, pages_p = int(table_d.plan_args[0][-1]), int(table_p.plan_args[0][-1])
    assert w._decode._plan.unordered is not None and w._prefill._plan.unordered is not None  # (both reordered)
    assert torch.equal(w._decode._plan.args[0][1][:pages_d], d._plan.args[0][1][:pages_d])
    assert torch.equal(w._prefill._plan.args[0][1][:pages_p], p._plan.args[0][1][:pages_p])
    end = p._plan_buffer.end
    assert end == w._prefill._plan_buffer.end
    assert torch.equal(w._prefill._plan_buffer.buf[:end], p._plan_buffer.buf[:end])  # (the pairs' first page ids)


# --- POD on Hopper (prefill_backend="auto": csrc/pod/pod_sm90.cuh) -------------------------------
# (prefill (qo, kv) chunks, decodes, causal, head_dim, prefill_blocks pinned (None: the planner's),
# return_lse, shared cache, options)
SM90_CASES = [
    pytest.param([(300, 500), (700, 700), (129, 2000)], 40, True, 128, None, True, True, {}, id="causal-lse"),
    pytest.param([(512, 512), (256, 1024)], 130, False, 128, None, False, False, dict(q_scale=1.25, k_scale=0.8,
                 v_scale=1.5), id="full-two-caches-scales"),
    pytest.param([(1000, 3000)], 64, True, 128, 1, True, True, {}, id="one-prefill-block"),
    pytest.param([(1000, 3000)], 64, True, 128, 131, True, True, {}, id="one-decode-block"),
    pytest.param([(600, 900), (300, 1700)], 33, True, 64, None, True, True, {}, id="hd64"),
    pytest.param([(2500, 4000)], 9, True, 256, None, False, True, {}, id="hd256"),  # (auto: 2048 keys a tile)
    pytest.param([(700, 1500), (400, 400)], 50, True, 128, None, True, True, dict(window_left=300), id="window"),
    pytest.param([(200, 300)], 4, True, 128, None, True, True, {}, id="small"),  # (the sanitizers' case)
    # decodes of up to 9000 keys: those over 4096 split into chunks of 2048 (sm90_decode_split)
    pytest.param([(600, 1000)], 40, True, 128, None, True, True, dict(decode_max=9000), id="long-decodes"),
    # the decode side empty (its counter still reset), and many decodes beside one chunk
    pytest.param([(700, 1200)], 0, True, 128, None, True, True, {}, id="no-decodes"),
    pytest.param([(256, 2300)], 300, True, 128, None, True, True, {}, id="many-decodes"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("chunks, decodes, causal, head_dim, blocks, return_lse, shared, options", SM90_CASES)
def test_batch_pod_on_hopper(chunks, decodes, causal, head_dim, blocks, return_lse, shared, options, workspace):
    """prefill_backend="auto" on sm_90: prefill chunks long enough for the Hopper kernel beside
    one-token decodes, in one launch of POD on Hopper (the planner's split, or pinned to one
    prefill block or one decode block), against the float64 references, outputs poisoned."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("POD on Hopper runs on sm_90")
    rnd, gen = _seeded(90 + len(chunks) + decodes + head_dim)
    page_size, (hq, hk) = 16, LLAMA
    options = dict(options)
    window, decode_max = options.pop("window_left", -1), options.pop("decode_max", 2500)
    qo_lens, kv_lens = [m for m, _ in chunks], [n for _, n in chunks]
    lens_d = decode_lens(decodes, decode_max, page_size, rnd) if decodes else []
    table_p, table_d, cache_p, cache_d = two_sides(kv_lens, lens_d, page_size, hk, head_dim, BF16, shared, rnd, gen)
    qo_indptr_p = _i32(list(itertools.accumulate(qo_lens, initial=0)))
    q_p = randn((sum(qo_lens), hq, head_dim), BF16, gen)
    dec = Decode(randn((len(lens_d), hq, head_dim), BF16, gen), cache_d, table_d)
    w = fij.BatchPODWithPagedKVCacheWrapper(workspace, "NHD")
    w.prefill_backend = "auto"
    w.force_prefill_blocks = blocks
    w.plan(qo_indptr_p, *table_p.plan_args, _i32(list(range(len(lens_d) + 1))), *table_d.plan_args, hq, hk, head_dim,
           page_size, q_data_type=BF16, kv_data_type=BF16, causal=causal, window_left=window)
    assert w._prefill.planned_backend == "fa3"
    d_bytes = float(sum(lens_d)) * hk * 4 * head_dim
    assert w._decode._plan.config.fixed_split_size == pod_mod.sm90_decode_split(max(lens_d, default=0), w._flops,
                                                                                d_bytes)
    if decode_max > 4096:  # (the case meant to split: the decode side is the longer by far)
        assert w._decode._plan.config.fixed_split_size == 2048
    _poison_allocator(q_p, dec.q)
    result = w.run(q_p, cache_p.run_arg, dec.q, cache_d.run_arg, causal_p=causal, return_lse=return_lse, **options)
    torch.cuda.synchronize()
    ref_p = prefill_ref(q_p, qo_indptr_p, cache_p.k, cache_p.v, page_table=table_p.table, causal=causal,
                        window_left=window, **options)
    check_pod(unpack(result, return_lse, return_lse), ref_p, decode_reference(dec, window_left=window, **options), BF16)
    # twice: the counters the first launch left at zero
    _poison_allocator(q_p, dec.q)
    again = w.run(q_p, cache_p.run_arg, dec.q, cache_d.run_arg, causal_p=causal, return_lse=return_lse, **options)
    torch.cuda.synchronize()
    check_pod(unpack(again, return_lse, return_lse), ref_p, decode_reference(dec, window_left=window, **options), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("qo_len, kv_len, causal, head_dim, return_lse, decode_max", [
    (1500, 2500, True, 128, True, 3000), (2048, 2048, False, 128, False, 3000), (900, 1700, True, 64, True, 3000),
    (700, 3000, True, 256, False, 3000), (600, 900, True, 128, True, 7000)],
    ids=["causal", "full", "hd64", "hd256", "decode-split"])
def test_single_pod_on_hopper(qo_len, kv_len, causal, head_dim, return_lse, decode_max, workspace):
    """PODWithPagedKVCacheWrapper with prefill_backend="auto" on sm_90: one prefill request's
    K/V rows on the Hopper kernel's blocks beside one-token decodes, one launch (the pod_sm90
    module with prefill_kv="ragged"), against the float64 references, outputs poisoned; twice
    (the counters the first launch left at zero), then again after a second plan(); then the
    same wrapper with a custom mask, which runs the mma.sync POD. decode-split: decodes of up
    to 7000 keys beside a short prefill, which the first run() re-plans into chunks of 2048
    keys (sm90_decode_split) and the second plan() plans so at once."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("POD on Hopper runs on sm_90")
    rnd, gen = _seeded(77 + head_dim + qo_len)
    q_p, k_p, v_p = make_prefill(qo_len, kv_len, LLAMA, head_dim, BF16, gen)
    dec = make_decode(decode_lens(37, decode_max, 16, rnd), LLAMA, head_dim, 16, BF16, BF16, gen, rnd)
    w = fij.PODWithPagedKVCacheWrapper(workspace, "NHD")
    w.prefill_backend = "auto"
    split = 2048 if decode_max > 4096 else None
    ref_p, ref_d = prefill_reference(q_p, k_p, v_p, causal=causal), decode_reference(dec)
    for _ in range(2):
        plan_pod(w, dec, 16, BF16)
        for _ in range(2):
            outs = run_pod(w, q_p, k_p, v_p, dec, causal_p=causal, return_lse_p=return_lse, return_lse_d=return_lse)
            assert w._prefill.planned_backend == "fa3" and w._sm90_key[0].kv_source == "ragged"
            assert (w._decode._plan.config.fixed_split_size or None) == split
            check_pod(outs, ref_p, ref_d, BF16)
    mask = torch.rand(qo_len, kv_len, generator=torch.Generator().manual_seed(3)) < 0.7
    outs = run_pod(w, q_p, k_p, v_p, dec, custom_mask_p=mask.reshape(-1).to(DEV))
    assert w._prefill.planned_backend == "fa2"
    check_pod(outs, prefill_reference(q_p, k_p, v_p, custom_mask=mask.reshape(-1)), ref_d, BF16)


def test_default_prefill_backend_is_auto(monkeypatch):
    """Without the file's fixture (undone): every POD wrapper and BatchAttention starts on "auto"."""
    monkeypatch.undo()
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    assert fij.BatchPODWithPagedKVCacheWrapper(ws, "NHD").prefill_backend == "auto"
    assert fij.PODWithPagedKVCacheWrapper(ws, "NHD").prefill_backend == "auto"
    ba = fij.BatchAttention("NHD", device="cpu")
    assert ba.prefill_backend == ba._pod.prefill_backend == ba._prefill._backend == "auto"


@pytest.mark.gpu
def test_default_batch_pod_on_hopper(monkeypatch):
    """Without the file's fixture (undone), on an H100 / H200: a batch POD of a 2k chunk beside
    decodes plans POD on Hopper by default and matches the float64 references."""
    monkeypatch.undo()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("POD on Hopper runs on sm_90")
    rnd, gen = _seeded(5)
    page_size, (hq, hk) = 16, LLAMA
    lens_d = decode_lens(24, 2000, page_size, rnd)
    table_p, table_d, cache_p, cache_d = two_sides([2048], lens_d, page_size, hk, HD, BF16, True, rnd, gen)
    qo_indptr_p = _i32([0, 2048])
    q_p = randn((2048, hq, HD), BF16, gen)
    dec = Decode(randn((len(lens_d), hq, HD), BF16, gen), cache_d, table_d)
    w = fij.BatchPODWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=DEV), "NHD")
    w.plan(qo_indptr_p, *table_p.plan_args, _i32(list(range(len(lens_d) + 1))), *table_d.plan_args, hq, hk, HD,
           page_size, q_data_type=BF16, causal=True)
    assert w._prefill.planned_backend == "fa3"
    _poison_allocator(q_p, dec.q)
    result = w.run(q_p, cache_p.run_arg, dec.q, cache_d.run_arg, causal_p=True, return_lse=True)
    torch.cuda.synchronize()
    ref_p = prefill_ref(q_p, qo_indptr_p, cache_p.k, cache_p.v, page_table=table_p.table, causal=True)
    check_pod(unpack(result, True, True), ref_p, decode_reference(dec), BF16)


def test_single_pod_on_hopper_plans_on_the_cpu(monkeypatch):
    """The single form's prefill side with prefill_backend "auto" plans the Hopper kernel where
    its rule takes the request (the arch check passed), and its POD module is the ragged one;
    a short request, a custom mask or HND k_p / v_p keep the mma.sync POD; "fa3" names what it
    does not take."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    w = fij.PODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    w.prefill_backend = "auto"
    w.plan(*_cpu_pod_tables()[5:], *LLAMA, HD, 16, q_data_type=BF16, kv_data_type=BF16)
    q_p, k_p = torch.zeros(1000, LLAMA[0], HD, dtype=BF16), torch.zeros(1500, LLAMA[1], HD, dtype=BF16)
    w._plan_prefill(q_p, k_p, None, None, True, None, -1)
    assert w._prefill.planned_backend == "fa3"
    spec = pod_mod._pod_sm90_spec_of(w._prefill._plan.spec, w._decode._plan.spec, "NHD")
    assert spec.prefill_kv == "ragged" and "pragged" in spec.name and spec.prefill_spec().kv_source == "ragged"
    w._plan_prefill(q_p[:10], k_p, None, None, True, None, -1)  # (10 query rows: auto's rule declines)
    assert w._prefill.planned_backend == "fa2"
    w._plan_prefill(q_p, k_p, None, None, True, None, -1, "HND")
    assert w._prefill.planned_backend == "fa2"
    w.prefill_backend = "fa3"
    with pytest.raises(ValueError, match="prefill_backend='fa3'.*HND"):
        w._plan_prefill(q_p, k_p, None, None, True, None, -1, "HND")
    with pytest.raises(ValueError, match="prefill_backend='fa3'.*custom mask"):
        w._plan_prefill(q_p, k_p, torch.ones(1000 * 1500, dtype=torch.bool), None, False, None, -1)


def test_single_pod_on_hopper_splits_long_decodes_on_the_cpu(monkeypatch):
    """The single form on Hopper splits its decode side as batch POD does (sm90_decode_split):
    plan() cannot know the prefill, so the first run()'s prefill plan re-plans the decode side
    into chunks of 2048 keys where the rule asks; the next plan() takes the split at once; a
    prefill that makes the sides comparable, or the mma.sync POD, plans it unsplit again. The
    re-plan reads copies of plan()'s index tensors, not the caller's (refilled here)."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    lens = [8192] * 16  # 16 decodes of 8k keys: the longer side by far beside a 1k prefill
    pages = [n // 16 for n in lens]
    indptr = _i32([0, *itertools.accumulate(pages)], "cpu")
    indices, last = _i32(range(sum(pages)), "cpu"), _i32([16] * len(lens), "cpu")
    w = fij.PODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    w.prefill_backend = "auto"

    def plan():
        w.plan(indptr, indices, last, *LLAMA, HD, 16, q_data_type=BF16, kv_data_type=BF16)
        return w._decode._plan.config.fixed_split_size

    assert plan() in (None, 0)  # (no prefill known yet)
    q_p, k_p = torch.zeros(1000, LLAMA[0], HD, dtype=BF16), torch.zeros(1000, LLAMA[1], HD, dtype=BF16)
    indices.fill_(-7)  # (the caller refills its buffers after plan(): the re-plan reads plan()'s copies)
    w._plan_prefill(q_p, k_p, None, None, True, None, -1)
    assert w._prefill.planned_backend == "fa3" and w._decode._plan.config.fixed_split_size == 2048
    assert sorted(w._decode._plan.args[0][1].tolist()) == list(range(sum(pages)))  # (plan()'s page ids)
    assert int(w._decode._plan.config.fixed_split_size) == pod_mod.sm90_decode_split(
        8192, w._flops, float(sum(lens)) * LLAMA[1] * 4 * HD)
    indices.copy_(torch.arange(sum(pages), dtype=torch.int32))
    assert plan() == 2048  # (the last prefill's split, at plan())
    big = torch.zeros(16000, LLAMA[0], HD, dtype=BF16), torch.zeros(16000, LLAMA[1], HD, dtype=BF16)
    w._plan_prefill(*big, None, None, True, None, -1)  # (comparable sides: no split)
    assert w._prefill.planned_backend == "fa3" and w._decode._plan.config.fixed_split_size in (None, 0)
    w.prefill_backend = "fa2"
    assert plan() in (None, 0)
    w._plan_prefill(q_p, k_p, None, None, True, None, -1)
    assert w._prefill.planned_backend == "fa2" and w._decode._plan.config.fixed_split_size in (None, 0)


@pytest.mark.gpu
def test_batch_attention_on_hopper():
    """BatchAttention with prefill_backend="auto": decodes interleaved with two long chunks and
    4-token requests, one launch of POD on Hopper, every row written in place, against the
    float64 reference of the whole batch."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("POD on Hopper runs on sm_90")
    rnd, gen = _seeded(4242)
    reqs = [(1, rnd.randint(1, 3000)) for _ in range(30)] + [(900, 2000)] + \
        [(1, rnd.randint(1, 3000)) for _ in range(30)] + [(700, 700)]
    ba, run_and_check = _hopper_batch_attention(reqs, rnd, gen)
    assert ba._pod._prefill.planned_backend == "fa3"
    run_and_check()


def _hopper_batch_attention(reqs, rnd, gen):
    """A BatchAttention with prefill_backend="auto" planned (causal, bf16, LLAMA heads, pages
    of 16 in random order, NaN outside them) for requests (qo_len, kv_len), and a call that
    runs it on fresh q into NaN-poisoned out / lse and checks both against the float64
    reference of the whole batch."""
    page_size, (hq, hk) = 16, LLAMA
    qo_lens, kv_lens = [m for m, _ in reqs], [n for _, n in reqs]
    pages = sum(-(-n // page_size) for n in kv_lens)
    ids = rnd.sample(range(pages + 3), pages)
    table = csr_table(kv_lens, page_size, ids)
    cache = make_cache(pages + 3, page_size, hk, HD, BF16, gen)
    nan_outside(cache, page_size, [table])
    qo_indptr = _i32(list(itertools.accumulate(qo_lens, initial=0)), "cpu")
    ba = fij.BatchAttention("NHD")
    ba.prefill_backend = "auto"
    ba.plan(qo_indptr, table.plan_args[0].cpu(), table.plan_args[1], torch.tensor(kv_lens, dtype=torch.int32), hq, hk,
            HD, HD, page_size, causal=True, q_data_type=BF16, kv_data_type=BF16)

    def run_and_check():
        q = randn((sum(qo_lens), hq, HD), BF16, gen)
        out = torch.full((q.shape[0], hq, HD), float("nan"), dtype=BF16, device=DEV)
        lse = torch.full((q.shape[0], hq), float("nan"), dtype=torch.float32, device=DEV)
        ba.run(q, cache.run_arg, out=out, lse=lse)
        torch.cuda.synchronize()
        ref_out, ref_lse = prefill_ref(q, qo_indptr.to(DEV), cache.k, cache.v, page_table=table.table, causal=True)
        check_out(out, ref_out, TOL[BF16], "out")
        check_lse(lse, ref_lse, "lse")

    return ba, run_and_check

@pytest.mark.gpu
@pytest.mark.parametrize("order", ["short-first", "interleaved"])
def test_batch_attention_speculative_step_on_hopper(order):
    """BatchAttention with prefill_backend="auto", a speculative-decoding step (4-token
    verification requests beside long chunks, no one-token decode): two launches, the short
    requests on the mma.sync kernel's packed rows and the chunks on the Hopper kernel ("split"
    mode), every row written in place (interleaved: through the gather and scatter), against
    the float64 reference of the whole batch, outputs poisoned."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90")
    rnd, gen = _seeded(777 + len(order))
    spec = [(4, rnd.randint(4, 3000)) for _ in range(24)] + [(0, 50)] + [(3, 700)]
    chunks = [(600, 2000), (300, 300)]
    reqs = spec + chunks if order == "short-first" else spec[:10] + chunks[:1] + spec[10:] + chunks[1:]
    ba, run_and_check = _hopper_batch_attention(reqs, rnd, gen)
    assert ba._planned[0] == "split"
    assert ba._long.planned_backend == "fa3" and ba._prefill.planned_backend == "fa2"
    assert (ba._planned[2] is None) == (order == "short-first")  # the gather's permutation
    for _ in range(2):
        run_and_check()


def test_batch_attention_split_mode_plans_on_the_cpu(monkeypatch):
    """"split" mode's plan (the Hopper arch check passed): verification requests of at most 16
    tokens (and a padding request) on the mma.sync prefill wrapper, the longer ones on the
    Hopper one, each side's rows as runs of the batch's or a permutation; a batch of short
    requests alone, or with one-token decodes, or with prefill_backend "fa2", is not split."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    page_size = 16

    def plan(qo_lens, kv_lens, backend="auto"):
        pages = [-(-n // page_size) for n in kv_lens]
        ba = fij.BatchAttention("NHD", device="cpu")
        ba.prefill_backend = backend
        ba.plan(_i32(list(itertools.accumulate(qo_lens, initial=0)), "cpu"),
                _i32(list(itertools.accumulate(pages, initial=0)), "cpu"), _i32(range(sum(pages)), "cpu"),
                _i32(kv_lens, "cpu"), *LLAMA, HD, HD, page_size, causal=True, q_data_type=BF16, kv_data_type=BF16)
        return ba

    ba = plan([4, 4, 0, 16, 900, 600], [4000, 300, 20, 800, 2000, 3000])
    mode, _, perm, rows, *_, short_rows, short_run, long_run = ba._planned
    assert (mode, perm, rows, short_rows, short_run, long_run) == ("split", None, 1524, 24, (0, 24), (24, 1524))
    assert ba._long.planned_backend == "fa3" and ba._prefill.planned_backend == "fa2"
    assert ba._prefill._plan.batch == 4 and ba._long._plan.qo_tokens == 1500
    ba = plan([900, 4, 600, 4], [2000, 300, 3000, 500])
    assert ba._planned[0] == "split" and ba._planned[2].tolist() == [*range(900, 904), *range(1504, 1508),
                                                                      *range(900), *range(904, 1504)]
    assert plan([4, 4], [300, 400])._planned[0] == "prefill"  # short requests alone: one launch
    assert plan([4, 1, 900], [300, 400, 2000])._planned[0] == "pod"  # one-token decodes: POD
    assert plan([4, 900], [300, 2000], backend="fa2")._planned[0] == "prefill"
    assert plan([4, 900], [300, 2000], backend="fa2")._long is None


@pytest.mark.gpu
@pytest.mark.parametrize("tile_rows, share, sms", [(64, None, None), (128, None, None), (64, 0.0, 0), (64, 0.25, 0),
                                                   (64, 1.0, 0), (128, 0.0, 0), (128, 0.5, 0), (128, 1.0, 0),
                                                   (128, 1.0, 5), (128, 1.0, 66), (64, 0.5, 100)])
def test_batch_pod_replan_tiles_and_shares(tile_rows, share, sms, workspace):
    """The prefill side's two tiles and schedules from no decode blocks beside prefill ones (the
    prefill first) to all (the decodes first), and decode-only SMs, each over two plans of the
    same mask with other lengths (the second plan must plan the prefill side again), two runs
    each: the counters the first launch leaves are what the second starts from."""
    rnd, gen = _seeded(31 + tile_rows + int(10 * (share or 0)) + (sms or 0))
    page_size, (hq, hk) = 16, LLAMA
    w = fij.BatchPODWithPagedKVCacheWrapper(workspace, "NHD")
    w.tile_rows = tile_rows
    w.force_decode_share, w.force_decode_sms = share, sms
    for qo_lens, kv_lens, batch_d in (([300, 1, 64], [700, 2048, 64], 40), ([1000, 5], [1000, 1500], 7)):
        lens_d = decode_lens(batch_d, 1500, page_size, rnd)
        pages_p, pages_d = (sum(-(-n // page_size) for n in lens) for lens in (kv_lens, lens_d))
        num_pages = pages_p + pages_d + 3
        ids = rnd.sample(range(num_pages), num_pages)
        table_p, table_d = csr_table(kv_lens, page_size, ids[:pages_p]), csr_table(lens_d, page_size, ids[pages_p:])
        cache = make_cache(num_pages, page_size, hk, HD, BF16, gen)
        nan_outside(cache, page_size, [table_p, table_d])
        qo_indptr_p = _i32(list(itertools.accumulate(qo_lens, initial=0)))
        w.plan(qo_indptr_p, *table_p.plan_args, _i32(list(range(batch_d + 1))), *table_d.plan_args, hq, hk, HD,
               page_size, q_data_type=BF16, causal=True)
        assert w._prefill._plan.tile_rows == tile_rows
        for _ in range(2):
            q_p = randn((sum(qo_lens), hq, HD), BF16, gen)
            dec = Decode(randn((batch_d, hq, HD), BF16, gen), cache, table_d)
            _poison_allocator(q_p, dec.q)
            result = w.run(q_p, cache.run_arg, dec.q, cache.run_arg, causal_p=True, return_lse=True)
            torch.cuda.synchronize()
            ref_p = prefill_ref(q_p, qo_indptr_p, cache.k, cache.v, page_table=table_p.table, causal=True)
            check_pod(unpack(result, True, True), ref_p, decode_reference(dec), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_rows", [None, 64, "hopper"], ids=["planner-tile", "t64", "pod-on-hopper"])
def test_batch_pod_cuda_graph_replay(tile_rows, workspace):
    """Batch POD with use_cuda_graph=True (both sides' page tables in FlashInfer's fixed
    buffers): run() captured once, replayed with new q values in the same tensors, then after
    plans of other lengths (the same numbers of requests, within the buffers) over the same
    cache refilled in place, on the wide tile the first plan picked (a graph keeps its plan's
    tile) or 64 rows pinned; or POD on Hopper (prefill_backend "fa3", sm_90)."""
    hopper = tile_rows == "hopper"
    if hopper and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("POD on Hopper runs on sm_90")
    rnd, gen = _seeded(41 + (64 if tile_rows == 64 else 0) + (7 if hopper else 0))
    page_size, (hq, hk) = 16, LLAMA
    batch_p, batch_d, max_kv_p, max_kv_d = 3, 21, 1500, 1200
    max_pages_p, max_pages_d = batch_p * -(-max_kv_p // page_size), batch_d * -(-max_kv_d // page_size)
    num_pages = max_pages_p + max_pages_d + 4
    cache = make_cache(num_pages, page_size, hk, HD, BF16, gen)
    zeros = lambda n: _i32([0] * n)  # noqa: E731
    w = fij.BatchPODWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, qo_indptr_buf_p=zeros(batch_p + 1),
        paged_kv_indptr_buf_p=zeros(batch_p + 1), paged_kv_indices_buf_p=zeros(max_pages_p),
        paged_kv_last_page_len_buf_p=zeros(batch_p), paged_kv_indptr_buf_d=zeros(batch_d + 1),
        paged_kv_indices_buf_d=zeros(max_pages_d), paged_kv_last_page_len_buf_d=zeros(batch_d))
    if hopper:
        w.prefill_backend = "fa3"
    else:
        w.tile_rows = tile_rows
    q_p = randn((600, hq, HD), BF16, gen)
    q_d = randn((batch_d, hq, HD), BF16, gen)
    graph = outs = None
    lengths = [([500, 37, 63], [1400, 37, 900]), None, ([300, 200, 100], [300, 1500, 700])]
    for step, shape in enumerate(lengths):
        if shape is not None:  # step 1: the same plan, new q values only
            qo_lens, kv_lens = shape
            lens_d = decode_lens(batch_d, max_kv_d, page_size, rnd)
            ids = rnd.sample(range(num_pages), num_pages)
            pages_p = sum(-(-n // page_size) for n in kv_lens)
            table_p = csr_table(kv_lens, page_size, ids[:pages_p])
            table_d = csr_table(lens_d, page_size, ids[pages_p:])
            for part in (cache.k, cache.v):
                part.copy_(randn(part.shape, BF16, gen))
            nan_outside(cache, page_size, [table_p, table_d])
            qo_indptr_p = _i32(list(itertools.accumulate(qo_lens, initial=0)))
            w.plan(qo_indptr_p, *table_p.plan_args, _i32(list(range(batch_d + 1))), *table_d.plan_args, hq, hk, HD,
                   page_size, q_data_type=BF16, causal=True)
            assert w._prefill.planned_backend == ("fa3" if hopper else "fa2")
        q_p.copy_(randn(q_p.shape, BF16, gen))
        q_d.copy_(randn(q_d.shape, BF16, gen))
        tokens = sum(qo_lens)
        if graph is None:
            graph, outs = capture_graph(lambda: w.run(q_p[:tokens], cache.run_arg, q_d, cache.run_arg, causal_p=True,
                                                      return_lse=True))
            (out_p, out_d), (lse_p, lse_d) = outs
        for t in (out_p, out_d, lse_p, lse_d):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        # (both plans have 600 prefill tokens: the captured q_p[:600] and outputs serve both)
        ref_p = prefill_ref(q_p[:tokens], qo_indptr_p, cache.k, cache.v, page_table=table_p.table, causal=True)
        check_pod((out_p, out_d, lse_p, lse_d), ref_p, decode_reference(Decode(q_d, cache, table_d)), BF16)


def test_decode_share_follows_the_sides_estimated_times():
    """decode_share: the decode side's share of the two sides' estimated times alone."""
    from flashinfer_jit.pod.wrapper import csr_kv_lens, decode_share, prefill_flops

    assert prefill_flops([4], [4], True, 1, 1) == (4 + 3 + 2 + 1) * 4  # causal: the keys each row sees
    assert prefill_flops([4], [10], False, 2, 8) == 4 * 10 * 2 * 8 * 4
    assert csr_kv_lens([0, 2, 2, 5], [3, 1, 16], 16).tolist() == [19, 0, 48]
    assert decode_share(0.0, 1e9) == 1.0 and decode_share(1e12, 0.0) == 0.0
    assert 0.0 < decode_share(1e11, 1e9) < decode_share(1e11, 2e9) < 1.0


def test_pod_schedule_picks_decode_sms_for_decode_heavy_batches_on_the_128_row_tile():
    from flashinfer_jit.pod.wrapper import pod_schedule

    flops, kv_bytes = 7e10, 1.07e9  # mix 1: 2 x 2k causal chunks beside 128 decodes of 2k (about half each)
    share, sms = pod_schedule(flops, 2 * kv_bytes, 128, 132)
    assert share == 1.0 and 66 < sms < 132
    assert pod_schedule(flops, 2 * kv_bytes, 64, 132)[1] == 0  # the 64-row tile: a share of every SM
    assert pod_schedule(4 * flops, kv_bytes, 128, 132)[1] == 0  # prefill-heavy: both on every SM


# --- argument checks: before any launch (CPU; the cuda variants where a GPU is) ------------------
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PLAN = (32, 8, HD, 16)  # num_qo_heads, num_kv_heads, head_dim, page_size


def _small(device: str, batch: int = 3, qo_len: int = 10, kv_len: int = 20, heads_p: int = 32, dtype_p=BF16):
    """(page table of `batch` requests of 2 pages, q_p, k_p, v_p, q_d, (k, v) cache) on `device`."""
    table = (_i32([2 * b for b in range(batch + 1)], device), _i32(list(range(2 * batch)), device),
             _i32([5] * batch, device))

    def t(*shape, dtype=BF16):
        return torch.randn(*shape, device=device).to(dtype)
    return (table, t(qo_len, heads_p, HD, dtype=dtype_p), t(kv_len, 8, HD, dtype=dtype_p),
            t(kv_len, 8, HD, dtype=dtype_p), t(batch, 32, HD), (t(2 * batch, 16, 8, HD), t(2 * batch, 16, 8, HD)))


def _pod(device: str, cls: str = "PODWithPagedKVCacheWrapper"):
    try:
        return getattr(fij, cls)(torch.zeros(1 << 20, dtype=torch.uint8, device=device), "NHD")
    except Exception as exc:  # noqa: BLE001
        if device == "cpu":
            pytest.skip(f"{cls} on a CPU workspace raised {type(exc).__name__}: {exc}; the cuda variant checks this")
        raise


def _planned(device: str, batch: int = 3):
    """A single-POD wrapper planned for `batch` decodes (bf16, 32/8 heads, head_dim 128, page 16)."""
    w = _pod(device)
    try:
        w.plan(*_small(device, batch)[0], *PLAN, q_data_type=BF16)
    except Exception as exc:  # noqa: BLE001
        if device == "cpu":
            pytest.skip(f"plan() with CPU tensors raised {type(exc).__name__}: {exc}; the cuda variant checks this")
        raise
    return w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", ["PODWithPagedKVCacheWrapper", "BatchPODWithPagedKVCacheWrapper"], ids=["pod", "batch"])
def test_run_before_plan_is_an_error(cls, device):
    _, q_p, k_p, v_p, q_d, cache = _small(device)
    w = _pod(device, cls)
    with pytest.raises(RuntimeError, match="plan"):
        if cls == "PODWithPagedKVCacheWrapper":
            w.run(q_p, k_p, v_p, q_d, cache)
        else:
            w.run(q_p, cache, q_d, cache)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", ["PODWithPagedKVCacheWrapper", "BatchPODWithPagedKVCacheWrapper"], ids=["pod", "batch"])
def test_plan_rejects_in_kernel_rope(cls, device):
    table = _small(device)[0]
    w = _pod(device, cls)
    args = table
    if cls == "BatchPODWithPagedKVCacheWrapper":  # two prefill requests (4 and 6 rows over 21 and 16 keys), 3 decodes
        args = (_i32([0, 4, 10], device), _i32([0, 2, 3], device), _i32([0, 1, 2], device), _i32([5, 16], device),
                _i32([0, 1, 2, 3], device), *table)
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        w.plan(*args, *PLAN, pos_encoding_mode="ROPE_LLAMA", q_data_type=BF16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change, match", [
    (dict(pos_encoding_mode_p="ROPE_LLAMA"), "pos_encoding_mode"),
    (dict(batch=4), r"q_d|batch"),  # 4 decodes where 3 were planned
    (dict(heads_p=16), r"q_p.*head"),  # 16 query heads on the prefill side, 32 planned for the decodes
    (dict(dtype_p=torch.float16), r"q_p.*dtype"),  # an fp16 prefill (q_p, k_p, v_p), bf16 decodes
], ids=["rope_p", "decode_batch", "heads", "dtype"])
def test_run_rejects_what_the_plan_does_not_fit(change, match, device):
    w = _planned(device)
    run_kwargs = {k: change[k] for k in ("pos_encoding_mode_p", "causal_p") if k in change}
    _, q_p, k_p, v_p, q_d, cache = _small(device, **{k: v for k, v in change.items() if k not in run_kwargs})
    with pytest.raises(ValueError) as info:
        w.run(q_p, k_p, v_p, q_d, cache, **run_kwargs)
    if device == "cpu" and "CUDA" in str(info.value):
        pytest.skip(f"on CPU tensors the device check comes first ({info.value}); the cuda variant checks this")
    assert re.search(match, str(info.value)), f"{info.value!r} does not match {match!r}"


@pytest.mark.parametrize("device", DEVICES)
def test_run_time_decode_settings_follow_flashinfer(device):
    """FlashInfer's rule (its test_pod_with_paged_kv_cache_decode_plan_settings): the decode
    side's sm_scale and window come from plan(); run()'s sm_scale_d / window_left_d warn as
    deprecated and must equal plan()'s; causal_d=True is a NotImplementedError. All raise
    before any launch."""
    w = _planned(device)
    _, q_p, k_p, v_p, q_d, cache = _small(device)
    with pytest.raises(NotImplementedError, match="non-causal"):
        w.run(q_p, k_p, v_p, q_d, cache, causal_d=True)
    for change in (dict(window_left_d=7), dict(sm_scale_d=0.01)):
        with pytest.raises(ValueError, match="differs from the value planned"), \
                pytest.warns(DeprecationWarning, match="deprecated"):
            w.run(q_p, k_p, v_p, q_d, cache, **change)
    if device == "cuda":  # equal to plan()'s: a warning, and the same outputs
        out_p, out_d = w.run(q_p, k_p, v_p, q_d, cache)
        with pytest.warns(DeprecationWarning, match="deprecated"):
            again_p, again_d = w.run(q_p, k_p, v_p, q_d, cache, sm_scale_d=w._decode._plan.config.sm_scale,
                                          window_left_d=-1)
        torch.testing.assert_close(again_p, out_p, rtol=0, atol=0)
        torch.testing.assert_close(again_d, out_d, rtol=0, atol=0)


# --- the spec, the AOT matrix, one build (CPU) -----------------------------------------------------
SPEC = PodSpec(dtype_q="bfloat16", dtype_kv="bfloat16", head_dim=128, prefill_kv="ragged", page_table="csr",
               kv_layout="NHD", mask="causal", group_tile=4)


def test_spec_is_registered_and_renders_both_families_block_functions():
    """One module holds both sides, calling the prefill and decode families' device code
    (csrc/prefill/, csrc/decode/) over the shared page table, not a copy of it."""
    assert FAMILIES[PodSpec.FAMILY] is PodSpec
    spec = SPEC.validate()
    module = render.render(spec)
    for name, text in module.sources.items():
        assert "{{" not in text and "{%" not in text and spec.name in text, name
    assert any(h.startswith("prefill/") for h in module.headers), sorted(module.headers)
    assert any(h.startswith("decode/") for h in module.headers), sorted(module.headers)
    assert "common/page_table.cuh" in module.headers
    others = [PodSpec(**{**SPEC.canonical()["params"], **change}) for change in
              (dict(mask="none"), dict(mask="custom"), dict(prefill_kv="paged"), dict(group_tile=1))]
    assert len({s.name for s in [spec, *others]}) == 5, "two configurations share a name"


@pytest.mark.parametrize("change, match", [
    (dict(head_dim=96), "head_dim"), (dict(mask="sliding"), "mask"), (dict(dtype_kv="float16"), "dtype"),
    (dict(dtype_kv="float8_e4m3fn"), "ragged|fp8"),  # single POD: k_p / v_p take q's dtype
], ids=["head_dim", "mask", "kv_dtype", "fp8_ragged"])
def test_spec_rejects_unsupported_values(change, match):
    with pytest.raises(ValueError, match=match):
        PodSpec(**{**SPEC.canonical()["params"], **change}).validate()


def test_tests_matrix_has_every_pod_module():
    assert_tests_matrix_has(specs_needed(), PodSpec, 16, "pod")


@pytest.mark.slow
def test_module_builds_and_registers_its_ops_without_a_gpu(fresh_cache):
    try:
        toolchain.get()
    except ToolchainError as exc:
        pytest.skip(f"needs nvcc, ninja and g++: {exc}")
    module = get_module(SPEC)
    assert module.path.is_relative_to(fresh_cache), module.path  # built here, not found elsewhere
    for op in SPEC.op_schemas():
        assert callable(getattr(module, op)), op


# --- POD on Hopper's bad input (CPU: the checks come before any launch) --------------------------
def _hopper_pod_plan(monkeypatch, backend="auto", use_cuda_graph=False, **plan_kwargs):
    """A batch POD planned on the CPU for two long chunks and two decodes, prefill_backend
    `backend`, the arch check passed (sm_90's plan)."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    w = fij.BatchPODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD",
                                            use_cuda_graph=use_cuda_graph)
    w.prefill_backend = backend
    w.plan(*_cpu_pod_tables(), *LLAMA, HD, 16, q_data_type=BF16, kv_data_type=BF16, causal=True, **plan_kwargs)
    return w


def _cpu_pod_tables() -> tuple:
    """batch POD's plan() tables on the CPU: two chunks (200 tokens on 300 and 500 keys) and
    two decodes (40, 70 keys), pages of 16, ids 0.. in order."""
    def csr(lens, first):
        pages = [-(-n // 16) for n in lens]
        return (_i32([0, *itertools.accumulate(pages)], "cpu"), _i32(range(first, first + sum(pages)), "cpu"),
                _i32([n - 16 * (p - 1) for n, p in zip(lens, pages)], "cpu"))
    return (_i32([0, 200, 400], "cpu"), *csr([300, 500], 0), _i32([0, 1, 2], "cpu"), *csr([40, 70], 60))


def _cpu_block_tables(lens, first, separate=False):
    """[B, max_pages] (or [B, 2, max_pages], V ids + 1000) block tables of ids first.., and the lengths."""
    pages = [-(-n // 16) for n in lens]
    width = max(pages) + 2
    table = torch.full((len(lens), 2, width) if separate else (len(lens), width), -1, dtype=torch.int32)
    for b, p in enumerate(pages):
        ids = torch.arange(first + 16 * b, first + 16 * b + p, dtype=torch.int32)
        if separate:
            table[b, 0, :p], table[b, 1, :p] = ids, ids + 1000
        else:
            table[b, :p] = ids
    return table, _i32(lens, "cpu")


@pytest.mark.parametrize("separate", [False, True], ids=["block_table", "block_table_kv_separate"])
def test_batch_pod_plans_block_tables(separate):
    """Batch POD's plan(block_tables_p=, seq_lens_p=, block_tables_d=, seq_lens_d=): both sides
    plan the layout; the work estimates are the CSR plan's; mixed forms, one side's tables
    alone, two layouts and a side's wrong lengths are ValueErrors naming the argument."""
    bt_p, sl_p = _cpu_block_tables([300, 500], 0, separate)
    bt_d, sl_d = _cpu_block_tables([40, 70], 100, separate)
    args = (_i32([0, 200, 400], "cpu"), None, None, None, _i32([0, 1, 2], "cpu"), None, None, None, *LLAMA, HD, 16)
    w = fij.BatchPODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    w.plan(*args, q_data_type=BF16, kv_data_type=BF16, causal=True, block_tables_p=bt_p, seq_lens_p=sl_p,
           block_tables_d=bt_d, seq_lens_d=sl_d)
    layout = "block_table_kv_separate" if separate else "block_table"
    assert w._prefill._plan.spec.page_table == w._decode._plan.spec.page_table == layout
    csr = fij.BatchPODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    csr.plan(*_cpu_pod_tables(), *LLAMA, HD, 16, q_data_type=BF16, kv_data_type=BF16, causal=True)
    assert (w._flops, w._kv_bytes) == (csr._flops, csr._kv_bytes)
    kw = dict(q_data_type=BF16, causal=True)
    with pytest.raises(ValueError, match="block_tables_p: pass one page table a side"):
        w.plan(_i32([0, 200, 400], "cpu"), *_cpu_pod_tables()[1:4], *args[4:], block_tables_p=bt_p, seq_lens_p=sl_p,
               block_tables_d=bt_d, seq_lens_d=sl_d, **kw)
    with pytest.raises(ValueError, match="block_tables_d: POD reads both sides through one page-table layout"):
        w.plan(*args, block_tables_p=bt_p, seq_lens_p=sl_p, **kw)
    other, _ = _cpu_block_tables([40, 70], 100, not separate)
    with pytest.raises(ValueError, match="block_tables_d: .* beside the prefill side's"):
        w.plan(*args, block_tables_p=bt_p, seq_lens_p=sl_p, block_tables_d=other, seq_lens_d=sl_d, **kw)
    with pytest.raises(ValueError, match=r"seq_lens: expected \[2\].*seq_lens_d"):
        w.plan(*args, block_tables_p=bt_p, seq_lens_p=sl_p, block_tables_d=bt_d, seq_lens_d=sl_d[:1], **kw)


def test_pod_on_hopper_rejects_what_it_does_not_take(monkeypatch):
    """prefill_backend: a value it does not know is a ValueError at plan() naming it; "fa3"
    with a custom mask at run() too (before any launch); "fa3" on a device that is not sm_90
    names the arch. A CUDA-graph wrapper plans POD on Hopper as an eager one does."""
    with pytest.raises(ValueError, match="prefill_backend"):
        _hopper_pod_plan(monkeypatch, backend="fa4")
    assert _hopper_pod_plan(monkeypatch, backend="fa3", use_cuda_graph=True)._prefill.planned_backend == "fa3"
    w = _hopper_pod_plan(monkeypatch, backend="fa3")
    assert w._prefill.planned_backend == "fa3"
    q_p, q_d = torch.zeros(400, *LLAMA[:1], HD, dtype=BF16), torch.zeros(2, LLAMA[0], HD, dtype=BF16)
    cache = torch.zeros(70, 2, 16, LLAMA[1], HD, dtype=BF16)
    with pytest.raises(ValueError, match="prefill_backend='fa3'.*custom mask"):
        w.run(q_p, cache, q_d, cache, custom_mask_p=torch.ones(200 * 300 + 200 * 500, dtype=torch.bool))
    monkeypatch.undo()
    w = fij.BatchPODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    w.prefill_backend = "fa3"
    with pytest.raises(ValueError, match="sm_90"):
        w.plan(*_cpu_pod_tables(), *LLAMA, HD, 16, q_data_type=BF16, kv_data_type=BF16, causal=True)
    # (the prefill wrapper alone runs an fp8 cache over a copy of the batch's pages; POD on Hopper reads the cache)
    with pytest.raises(ValueError, match="kv_data_type float8_e4m3fn in POD"):
        w.plan(*_cpu_pod_tables(), *LLAMA, HD, 16, q_data_type=BF16, kv_data_type=torch.float8_e4m3fn, causal=True)
    with pytest.raises(ValueError, match="prefill_backend"):
        fij.BatchAttention("NHD", device="cpu").prefill_backend = "fa1"


@pytest.mark.parametrize("backend", ["fa3", "auto", "fa2"])
def test_single_pod_refuses_an_fp8_decode_cache_before_any_launch(monkeypatch, backend):
    """The single form over an fp8 decode cache: POD runs one K/V dtype and k_p / v_p take q's,
    so run() raises a ValueError before any launch on either POD. POD on Hopper ("fa3", and
    "auto", which plans the Hopper kernel for the 16-bit k_p / v_p) has no module for that
    decode side (its decode blocks read a cache of q's dtype): before 2026-11-30 it launched
    the 16-bit module over the fp8 cache (an illegal address on the H200, bench_pod.py's e4m3
    row). The same after a run() of a 16-bit decode side on POD on Hopper, plan() of the fp8
    one keeping the prefill's plan."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    w = fij.PODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    w.prefill_backend = backend
    indptr, last = torch.tensor([0, 19, 38], dtype=torch.int32), torch.tensor([12, 12], dtype=torch.int32)
    ids = torch.arange(38, dtype=torch.int32)
    q_p, q_d = torch.randn(512, LLAMA[0], HD).to(BF16), torch.randn(2, LLAMA[0], HD).to(BF16)
    k_p, v_p = torch.randn(2048, LLAMA[1], HD).to(BF16), torch.randn(2048, LLAMA[1], HD).to(BF16)
    cache = torch.randn(38, 2, 16, LLAMA[1], HD).to(torch.float8_e4m3fn)
    w.plan(indptr, ids, last, *LLAMA, HD, 16, q_data_type=BF16, kv_data_type=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_p/v_p and paged_kv_cache_d: POD runs one K/V dtype"):
        w.run(q_p, k_p, v_p, q_d, cache, causal_p=True)
    assert w._prefill.planned_backend == ("fa3" if backend == "fa3" else w._prefill.planned_backend)
    if backend == "fa3":
        assert w._sm90_op is None and w._sm90_spec is None  # (no module for this decode side)
        w.plan(indptr, ids, last, *LLAMA, HD, 16, q_data_type=BF16, kv_data_type=BF16)
        with pytest.raises(ValueError, match="CUDA tensors"):  # (a 16-bit decode side: POD on Hopper's checks)
            w.run(q_p, k_p, v_p, q_d, cache.to(BF16), causal_p=True)
        w.plan(indptr, ids, last, *LLAMA, HD, 16, q_data_type=BF16, kv_data_type=torch.float8_e4m3fn)
        with pytest.raises(ValueError, match="POD runs one K/V dtype"):
            w.run(q_p, k_p, v_p, q_d, cache, causal_p=True)


def test_pod_on_hopper_run_checks_each_side_before_any_launch(monkeypatch):
    """run() of a POD on Hopper plan with a q_p of another dtype or head_dim than plan()'s, or
    tensors off the GPU: a ValueError from the prefill side's own checks, before any launch
    (the decode side's checks are the decode wrapper's, tested with it)."""
    w = _hopper_pod_plan(monkeypatch)
    assert w._prefill.planned_backend == "fa3"
    cache = torch.zeros(70, 2, 16, LLAMA[1], HD, dtype=BF16)
    q_p, q_d = torch.zeros(400, LLAMA[0], HD, dtype=BF16), torch.zeros(2, LLAMA[0], HD, dtype=BF16)
    for bad, match in ((q_p.half(), r"q: expected bfloat16 \(plan\(\)'s q_data_type\)"),
                       (q_p[..., :64].contiguous(), r"q: expected \[qo_tokens, 32, 128\] \(plan\(\)'s heads\)"),
                       (q_p, "CUDA tensors")):
        with pytest.raises(ValueError, match=match):
            w.run(bad, cache, q_d, cache, causal_p=True)

"""BatchAttention (flashinfer_jit/pod/batch_attention.py): one mixed batch of decodes, prompt
chunks, speculative requests and empty requests over one paged cache, split by plan() into a
decode side and a prefill side and run as POD, as one family, or serially (soft cap).

The GPU tests check the WHOLE batch against prefill_ref (flashinfer_jit/reference/prefill.py),
which treats every request as prefill: a decode row is a prefill row of one token (with
causal it still sees all its keys). Both out and lse are checked with test_pod.py's
check_out / check_lse and tolerances. Cache slots no request with rows reads hold NaN (the
pages of qo_len-0 requests included), so a wrong page id, a read past kv_len or a request
run on the wrong side's table shows. Outputs the wrapper allocates are NaN-poisoned through
the caching allocator (best effort); outputs given to run() are poisoned in place between
sentinel rows (kv_helpers.poisoned).

The CPU tests check split_batch, _side_table, plan()'s mode and checks on host tensors (the
host planners are built with nvcc where not cached: no GPU needed), run()'s checks before any
launch, the exports, and that the tests' AOT matrix lists every module the GPU tests load.
"""

from __future__ import annotations

import itertools
import random
from typing import NamedTuple

import numpy as np
import pytest
import torch
from kv_helpers import DEV, assert_sentinels, assert_tests_matrix_has, capture_graph, poisoned, randn
from test_pod import mma_pod_by_default  # noqa: F401  (autouse: see test_pod.py)
from test_pod import FP8_FACTOR, TOL, Table, check_lse, check_out, make_cache, nan_outside

import flashinfer_jit as fij
from flashinfer_jit.pipeline.errors import ToolchainError
from flashinfer_jit.pod.batch_attention import BatchAttention, BatchSplit, _side_ids, _side_table, split_batch
from flashinfer_jit.pod.spec import PodSpec
from flashinfer_jit.reference.prefill import prefill_ref
from flashinfer_jit.runtime.page_table import csr_page_table

BF16, F16, E4M3 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
LLAMA, HD = (32, 8), 128


# --- batches: (qo_len, kv_len) per request ---------------------------------------------------------
def _decodes(rnd: random.Random, n: int, max_kv: int = 3000) -> list:
    """n one-token requests on random contexts 1..max_kv, with 1, 16, 17 and max_kv among them."""
    lens = [rnd.randint(1, max_kv) for _ in range(n)]
    lens[:4] = [1, 16, 17, max_kv][:n]
    rnd.shuffle(lens)
    return [(1, kv_len) for kv_len in lens]


CHUNKS = [(300, 1000), (1000, 2048)]  # prompt chunks
BATCHES = {
    "decodes-first": lambda rnd: _decodes(rnd, 64) + CHUNKS,
    "decodes-last": lambda rnd: CHUNKS + _decodes(rnd, 64),
    "interleaved": lambda rnd: _decodes(rnd, 20) + CHUNKS[:1] + _decodes(rnd, 20) + CHUNKS[1:] + _decodes(rnd, 24),
    "decode-only": lambda rnd: _decodes(rnd, 100),
    "prefill-only": lambda rnd: [(300, 1000), (4, 129), (1000, 2048), (2, 17), (16, 3000)],
    # speculative verification: 4-token requests between decodes (1, 4, 4, 1, 4, 4, ...)
    "speculative": lambda rnd: [(4 if i % 3 else 1, rnd.randint(4, 3000)) for i in range(64)],
    "empty-requests": lambda rnd: _decodes(rnd, 16) + [(0, 500), (300, 1000), (0, 0)],
    # the prefill side holds only empty requests: POD with a prefill side of no rows
    "decodes-and-padding": lambda rnd: _decodes(rnd, 32) + [(0, 0), (0, 0)],
}


def expected_mode(requests, cap, pos="NONE") -> str:
    ones = [qo == 1 for qo, _ in requests]
    if not any(ones) or pos != "NONE":
        return "prefill"
    if all(qo <= 1 for qo, _ in requests):  # every row a decode's (the rest: requests without rows)
        return "decode"
    return "serial" if cap else "pod"


class Batch(NamedTuple):
    requests: list
    plan_args: tuple     # qo_indptr, kv_indptr, kv_indices, kv_len_arr (int32)
    last: torch.Tensor   # last_page_len, for the reference's page table
    num_pages: int


def make_batch(requests, page_size: int, rnd: random.Random, device=DEV, host_indptr=False, pool=None) -> Batch:
    """The requests' pages drawn at random from a pool with 8 spare pages (or of `pool`
    pages); kv_indices on `device`, the other index tensors too unless host_indptr."""
    qo_lens, kv_lens = zip(*requests) if requests else ((), ())
    pages = [-(-n // page_size) for n in kv_lens]
    num_pages = pool or sum(pages) + 8
    ids = rnd.sample(range(num_pages), num_pages)[: sum(pages)]
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)]
    host = "cpu" if host_indptr else device

    def i32(values, dev=host):
        return torch.tensor(list(values), dtype=torch.int32, device=dev)
    args = (i32(itertools.accumulate(qo_lens, initial=0)), i32(itertools.accumulate(pages, initial=0)),
            i32(ids, device), i32(kv_lens))
    return Batch(list(requests), args, i32(last, device), num_pages)


# --- the GPU cases ---------------------------------------------------------------------------------
class Case(NamedTuple):
    batch: str                     # a BATCHES key
    dtype: torch.dtype = BF16      # q and out (and the cache unless kv_dtype)
    causal: bool = False
    head_dim: int = HD
    page_size: int = 16
    kv_dtype: torch.dtype | None = None
    layout: str = "NHD"
    single: bool = False           # one [P, 2, ...] cache tensor instead of (k, v)
    cap: float | None = None       # logits_soft_cap: serial mode
    sm_scale: float | None = None
    kv_scales: tuple = ()          # (k_scale, v_scale) given to run()
    pos: str = "NONE"              # pos_encoding_mode: ROPE_LLAMA / ALIBI put every request on the prefill side


CASES = {
    "decodes-first-causal": Case("decodes-first", causal=True),
    "decodes-last-sm_scale": Case("decodes-last", sm_scale=0.05),
    "interleaved-causal": Case("interleaved", causal=True),
    "interleaved-f16-causal-ps1": Case("interleaved", F16, causal=True, page_size=1),
    "decode-only": Case("decode-only"),
    "decode-only-f16": Case("decode-only", F16),
    "prefill-only": Case("prefill-only"),
    "prefill-only-causal": Case("prefill-only", causal=True),
    "speculative-causal": Case("speculative", causal=True),
    "empty-requests-causal": Case("empty-requests", causal=True),
    "decodes-and-padding": Case("decodes-and-padding"),
    "decodes-first-f16-hd64": Case("decodes-first", F16, head_dim=64),
    "decodes-last-causal-hd256": Case("decodes-last", causal=True, head_dim=256),
    "decodes-first-e4m3-causal-scales": Case("decodes-first", causal=True, kv_dtype=E4M3, kv_scales=(0.5, 2.0)),
    "interleaved-e4m3": Case("interleaved", kv_dtype=E4M3),
    "decode-only-e4m3-scales": Case("decode-only", kv_dtype=E4M3, kv_scales=(0.5, 2.0)),
    "interleaved-causal-softcap": Case("interleaved", causal=True, cap=30.0),
    "decodes-last-causal-softcap": Case("decodes-last", causal=True, cap=30.0),
    "decodes-first-causal-5d": Case("decodes-first", causal=True, single=True),
    "interleaved-causal-HND": Case("interleaved", causal=True, layout="HND"),
    "decodes-first-causal-HND-5d": Case("decodes-first", causal=True, layout="HND", single=True),
    "interleaved-causal-rope": Case("interleaved", causal=True, pos="ROPE_LLAMA"),
    "decodes-first-causal-alibi": Case("decodes-first", causal=True, pos="ALIBI"),
}
IN_PLACE = ["decodes-first", "decodes-last", "interleaved", "decode-only", "prefill-only"]
REPLAN = [Case("interleaved", causal=True), Case("decodes-last", causal=True), Case("decode-only")]


def plan(ba: BatchAttention, batch: Batch, case: Case) -> None:
    ba.plan(*batch.plan_args, *LLAMA, case.head_dim, case.head_dim, case.page_size, causal=case.causal,
            sm_scale=case.sm_scale, logits_soft_cap=case.cap, q_data_type=case.dtype,
            kv_data_type=case.kv_dtype or case.dtype, pos_encoding_mode=case.pos)


def make_inputs(case: Case, seed: int, host_indptr=False):
    """(batch, cache, q, gen) on the GPU; cache slots no request with rows reads hold NaN."""
    rnd, gen = random.Random(seed), torch.Generator(device=DEV).manual_seed(seed)
    batch = make_batch(BATCHES[case.batch](rnd), case.page_size, rnd, host_indptr=host_indptr)
    cache = make_cache(batch.num_pages, case.page_size, LLAMA[1], case.head_dim, case.kv_dtype or case.dtype, gen,
                       case.layout, case.single)
    kv_indptr, kv_indices = batch.plan_args[1].to(DEV), batch.plan_args[2]
    read = [kv if qo else 0 for qo, kv in batch.requests]  # qo_len 0: nothing read, all NaN
    nan_outside(cache, case.page_size, [Table((kv_indptr, kv_indices, batch.last), None, read)])
    q = randn((int(batch.plan_args[0][-1]), LLAMA[0], case.head_dim), case.dtype, gen)
    return batch, cache, q, gen


def reference(q, batch: Batch, cache, case: Case):
    k_scale, v_scale = case.kv_scales or (None, None)
    indptr, indices = (t.to(DEV) for t in batch.plan_args[1:3])
    return prefill_ref(q, batch.plan_args[0].to(DEV), cache.k, cache.v,
                       page_table=csr_page_table(indptr, indices, batch.last), kv_layout=cache.layout,
                       causal=case.causal, sm_scale=case.sm_scale, logits_soft_cap=case.cap, k_scale=k_scale,
                       v_scale=v_scale, pos_encoding_mode=case.pos)


def run_kwargs(case: Case) -> dict:
    kwargs = dict(zip(("k_scale", "v_scale"), case.kv_scales))
    if case.cap:
        kwargs["logits_soft_cap"] = case.cap  # the plan's value again: accepted
    return kwargs


def check(out, lse, ref, case: Case) -> None:
    assert out.dtype == case.dtype and lse.dtype == torch.float32, (out.dtype, lse.dtype)
    fp8 = case.kv_dtype is not None and case.kv_dtype.itemsize == 1
    check_out(out, ref[0], TOL[case.dtype] * (FP8_FACTOR if fp8 else 1.0), "out")
    check_lse(lse, ref[1], "lse")


def _poison_allocator(q, head_dim_vo: int, blocks: int = 3) -> None:
    """Best effort: NaN blocks of the sizes run() allocates (out, lse, and the perm path's
    gathered q and side-order outputs), alive together, then freed for run() to reuse."""
    t, h = q.shape[:2]
    held = [torch.full((t, h, head_dim_vo), float("nan"), dtype=q.dtype, device=q.device) for _ in range(blocks)]
    held += [torch.full((t, h), float("nan"), dtype=torch.float32, device=q.device) for _ in range(blocks)]
    del held


# --- GPU tests ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("seed, name", [pytest.param(i, n, id=n) for i, n in enumerate(CASES)])
def test_mixed_batch(seed, name):
    case = CASES[name]
    batch, cache, q, _ = make_inputs(case, 100 + seed)
    ba = fij.BatchAttention(case.layout)
    plan(ba, batch, case)
    assert ba._planned[0] == expected_mode(batch.requests, case.cap, case.pos)
    _poison_allocator(q, case.head_dim)
    out, lse = ba.run(q, cache.run_arg, **run_kwargs(case))
    torch.cuda.synchronize()
    check(out, lse, reference(q, batch, cache, case), case)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["decodes-first-e4m3-causal-scales", "interleaved-e4m3"])
def test_fp8_cache_under_auto(name):
    """prefill_backend "auto" over an fp8 cache: on sm_90 the two sides one after the other, the
    prefill side on the Hopper kernel over a widened copy of its pages (_fp8_serial); elsewhere
    POD. Against the float64 reference, outputs poisoned."""
    case = CASES[name]
    batch, cache, q, _ = make_inputs(case, 700 + len(name))
    ba = fij.BatchAttention(case.layout)
    ba.prefill_backend = "auto"
    plan(ba, batch, case)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert ba._planned[0] == ("serial" if hopper else "pod")
    if hopper:
        assert ba._prefill.planned_backend == "fa3"
    _poison_allocator(q, case.head_dim)
    out, lse = ba.run(q, cache.run_arg, **run_kwargs(case))
    torch.cuda.synchronize()
    check(out, lse, reference(q, batch, cache, case), case)


@pytest.mark.gpu
@pytest.mark.parametrize("separate", [False, True], ids=["block_table", "block_table_kv_separate"])
@pytest.mark.parametrize("name, backend", [("interleaved-causal", "fa2"), ("decodes-first-causal", "fa2"),
                                           ("prefill-only-causal", "fa2"), ("decode-only", "fa2"),
                                           ("decodes-first-causal", "auto")])
def test_mixed_batch_block_tables(name, backend, separate):
    """The batch's page table as block tables (vLLM's, or TensorRT-LLM's with the V pages
    elsewhere in the V cache): the same outputs as the float64 reference of its CSR table,
    outputs poisoned; "auto": POD on Hopper where the chunks take the Hopper kernel."""
    case = CASES[name]
    batch, cache, q, _ = make_inputs(case, 300 + len(name))
    perm = torch.randperm(batch.num_pages, generator=torch.Generator().manual_seed(5)).to(DEV)
    table = block_tables_of(batch, separate, perm).to(DEV)
    if separate:  # V page i moves to perm[i]
        v = torch.empty_like(cache.v)
        v[perm] = cache.v
        kv_cache = (cache.k, v)
    else:
        kv_cache = cache.run_arg
    ba = fij.BatchAttention(case.layout)
    ba.prefill_backend = backend
    ba.plan(batch.plan_args[0], None, None, batch.plan_args[3], *LLAMA, case.head_dim, case.head_dim,
            case.page_size, causal=case.causal, q_data_type=case.dtype, kv_data_type=case.dtype,
            block_tables=table)
    assert ba._planned[0] == expected_mode(batch.requests, case.cap)
    if backend == "auto" and ba._planned[0] == "pod" and torch.cuda.get_device_capability() == (9, 0):
        assert ba._pod._prefill.planned_backend == "fa3"
    _poison_allocator(q, case.head_dim)
    out, lse = ba.run(q, kv_cache)
    torch.cuda.synchronize()
    check(out, lse, reference(q, batch, cache, case), case)


@pytest.mark.gpu
@pytest.mark.parametrize("name", IN_PLACE)
def test_out_and_lse_in_place(name):
    """out / lse given: the same objects back, every row written (NaN before), nothing
    written outside them (sentinel rows around)."""
    case = Case(name, causal=True)
    batch, cache, q, _ = make_inputs(case, 200 + IN_PLACE.index(name))
    ba = fij.BatchAttention()
    plan(ba, batch, case)
    out_buf, out = poisoned((q.shape[0], LLAMA[0], HD), BF16)
    lse_buf, lse = poisoned((q.shape[0], LLAMA[0]), torch.float32)
    got = ba.run(q, cache.run_arg, out=out, lse=lse)
    torch.cuda.synchronize()
    assert got[0] is out and got[1] is lse, "run() returned other tensors than the out / lse given"
    assert_sentinels(out_buf, "out")
    assert_sentinels(lse_buf, "lse")
    check(out, lse, reference(q, batch, cache, case), case)


@pytest.mark.gpu
def test_plan_once_run_twice_then_replan():
    """One plan(), two run()s with new q values in the same tensor; then plan() of other
    batches (index tensors on the host but kv_indices) on the same wrapper, and their runs."""
    first_case = REPLAN[0]
    batch, cache, q, gen = make_inputs(first_case, 300)
    ba = fij.BatchAttention()
    plan(ba, batch, first_case)
    first = [t.clone() for t in ba.run(q, cache.run_arg)]
    check(*first, reference(q, batch, cache, first_case), first_case)
    q.copy_(randn(q.shape, BF16, gen))
    second = ba.run(q, cache.run_arg)
    assert not torch.equal(first[0], second[0]), "new q, the same output"
    check(*second, reference(q, batch, cache, first_case), first_case)
    for i, case in enumerate(REPLAN[1:]):
        batch, cache, q, _ = make_inputs(case, 301 + i, host_indptr=True)
        plan(ba, batch, case)
        assert ba._planned[0] == expected_mode(batch.requests, None)
        out, lse = ba.run(q, cache.run_arg)
        torch.cuda.synchronize()
        check(out, lse, reference(q, batch, cache, case), case)


# --- CUDA graphs (use_cuda_graph=True) ---------------------------------------------------------------
GRAPH_STEPS = [  # (qo_len, kv_len) per request; None: the previous plan again, new q values only
    lambda rnd: _decodes(rnd, 10, 1500) + [(300, 1000)] + _decodes(rnd, 10, 1500) + [(200, 700)],
    None,
    lambda rnd: _decodes(rnd, 36, 1500),                                     # decodes only
    lambda rnd: [(4, 900), (300, 1000), (4, 2000), (0, 0), (2, 17)],         # no one-token request
    lambda rnd: [(500, 1500)] + _decodes(rnd, 20, 1200) + [(0, 0)],          # decodes last, padding
    lambda rnd: [(0, 0), (0, 0)],                                            # no rows at all
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["pod", "pod-on-hopper", "softcap"])
def test_cuda_graph_replay_after_replan(variant):
    """use_cuda_graph=True: run() captured once into given out / lse (q a fixed tensor of
    max_num_tokens rows), then replayed after plans of other batches over the same cache
    refilled in place: other decode / prefill counts, either side empty, no rows at all. The
    plan's rows against the float64 reference (outputs NaN before each replay), the rows past
    them zero. pod: one POD launch; pod-on-hopper: prefill_backend "fa3" (sm_90); softcap: the
    two families' CUDA-graph wrappers one after the other."""
    if variant == "pod-on-hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("POD on Hopper runs on sm_90")
    rnd, gen = random.Random(77), torch.Generator(device=DEV).manual_seed(77)
    case = Case("interleaved", causal=True, cap=30.0 if variant == "softcap" else None)
    max_batch, max_tokens, pool = 40, 600, 4000
    ba = fij.BatchAttention("NHD", use_cuda_graph=True, max_batch_size=max_batch, max_num_tokens=max_tokens,
                            max_num_pages=pool)
    if variant == "pod-on-hopper":
        ba.prefill_backend = "fa3"
    cache = make_cache(pool, case.page_size, LLAMA[1], HD, BF16, gen)
    q = randn((max_tokens, LLAMA[0], HD), BF16, gen)
    out, lse = torch.empty((max_tokens, LLAMA[0], HD), dtype=BF16, device=DEV), \
        torch.empty((max_tokens, LLAMA[0]), dtype=torch.float32, device=DEV)
    graph = batch = None
    for step, make in enumerate(GRAPH_STEPS):
        if make is not None:
            batch = make_batch(make(rnd), case.page_size, rnd, pool=pool)
            requests = batch.requests
            for part in (cache.k, cache.v):
                part.copy_(randn(part.shape, BF16, gen))
            read = [kv if qo else 0 for qo, kv in requests]
            nan_outside(cache, case.page_size, [Table((batch.plan_args[1], batch.plan_args[2], batch.last), None,
                                                      read)])
            plan(ba, batch, case)
            assert ba._planned[0] == ("serial" if case.cap else "pod"), ba._planned[0]
            if variant == "pod-on-hopper":
                assert ba._pod._prefill.planned_backend == "fa3"
        q.copy_(randn(q.shape, BF16, gen))
        if graph is None:
            graph, got = capture_graph(lambda: ba.run(q, cache.run_arg, out=out, lse=lse, **run_kwargs(case)))
            assert got[0] is out and got[1] is lse
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        tokens = int(batch.plan_args[0][-1])
        assert bool((out[tokens:] == 0).all()) and bool((lse[tokens:] == 0).all()), f"step {step}: rows past the plan"
        if tokens:
            check(out[:tokens], lse[:tokens], reference(q[:tokens], batch, cache, case), case)


# --- split_batch (CPU) ------------------------------------------------------------------------------
def _indptr(lens) -> np.ndarray:
    return np.array(list(itertools.accumulate(lens, initial=0)), dtype=np.int64)


@pytest.mark.parametrize("lens, decode, prefill, decode_rows, prefill_rows, perm", [
    pytest.param([1, 1, 1, 5, 0, 3], [0, 1, 2], [3, 4, 5], (0, 3), (3, 11), None, id="decodes-first"),
    pytest.param([5, 2, 0, 1, 1], [3, 4], [0, 1, 2], (7, 9), (0, 7), None, id="decodes-last"),
    pytest.param([1, 4, 1, 0, 1, 3], [0, 2, 4], [1, 3, 5], None, None, [0, 5, 6, 1, 2, 3, 4, 7, 8, 9],
                 id="interleaved"),
    pytest.param([3, 1, 3], [1], [0, 2], None, None, [3, 0, 1, 2, 4, 5, 6], id="one-decode-inside"),
    pytest.param([3, 0, 2, 16], [], [0, 1, 2, 3], None, (0, 21), None, id="no-decodes"),
    pytest.param([1, 1, 1], [0, 1, 2], [], (0, 3), None, None, id="only-decodes"),
    # requests without rows (padding) do not break a side's run of rows
    pytest.param([5, 1, 1, 0], [1, 2], [0, 3], (5, 7), (0, 5), None, id="decodes-last-then-padding"),
    pytest.param([0, 1, 1, 5], [1, 2], [0, 3], (0, 2), (2, 7), None, id="padding-then-decodes-first"),
])
def test_split_batch(lens, decode, prefill, decode_rows, prefill_rows, perm):
    """One token: decode side; 0 and 2+ tokens: prefill side. Each side's rows one run of the
    batch's (decodes first or last), else perm: decode rows then prefill rows, each in order."""
    split = split_batch(_indptr(lens))
    assert isinstance(split, BatchSplit)
    assert split.decode.tolist() == decode and split.prefill.tolist() == prefill
    assert split.decode_rows == decode_rows and split.prefill_rows == prefill_rows
    if perm is None:
        assert split.perm is None
        return
    got = split.perm.tolist()
    assert got == perm
    owner = [r for r, n in enumerate(lens) for _ in range(n)]  # the request of each row
    nd = len(decode)
    assert sorted(got) == list(range(sum(lens))), "not a permutation of the batch's rows"
    assert all(owner[i] in decode for i in got[:nd]) and all(owner[i] in prefill for i in got[nd:])
    assert got[:nd] == sorted(got[:nd]) and got[nd:] == sorted(got[nd:]), "a side's rows out of batch order"


def test_split_batch_without_decode_kernel_sends_everything_to_prefill():
    split = split_batch(_indptr([1, 1, 5, 1]), decode_ok=False)
    assert split.decode.tolist() == [] and split.prefill.tolist() == [0, 1, 2, 3]
    assert (split.decode_rows, split.prefill_rows, split.perm) == (None, (0, 8), None)


# --- _side_table (CPU) ------------------------------------------------------------------------------
PS = 4
KV_LENS = np.array([5, 1, 8, 0, 13, 4])      # pages 2, 1, 2, 0, 4, 1
KV_INDPTR = np.array([0, 2, 3, 5, 5, 9, 10])


@pytest.mark.parametrize("requests, view", [
    ([1, 2, 3], True), ([0, 1, 2, 3, 4, 5], True), ([3, 4], True), ([3], True),
    ([0, 2, 4], False), ([1, 5], False), ([0, 3], False),
], ids=lambda v: "-".join(map(str, v)) if isinstance(v, list) else ("view" if v else "gathered"))
def test_side_table(requests, view):
    kv_indices = torch.arange(100, 110, dtype=torch.int32)
    indptr, last, where = _side_table(np.array(requests, dtype=np.int64), KV_INDPTR, KV_LENS, PS)
    ids = _side_ids(where, kv_indices)
    pages = [int(KV_INDPTR[r + 1] - KV_INDPTR[r]) for r in requests]
    assert indptr.tolist() == list(itertools.accumulate(pages, initial=0))
    assert ids.tolist() == [100 + i for r in requests for i in range(KV_INDPTR[r], KV_INDPTR[r + 1])]
    assert last.tolist() == [int(KV_LENS[r]) - (p - 1) * PS if p else 0 for r, p in zip(requests, pages)]
    assert indptr.dtype == last.dtype == ids.dtype == torch.int32
    shares = ids.untyped_storage().data_ptr() == kv_indices.untyped_storage().data_ptr()
    assert shares == view, "expected a view of kv_indices" if view else "expected a copy"


def test_side_table_of_no_requests():
    indptr, last, where = _side_table(np.zeros(0, dtype=np.int64), KV_INDPTR, KV_LENS, PS)
    ids = _side_ids(where, torch.arange(10))
    assert indptr.tolist() == [0] and ids.numel() == 0 and last.numel() == 0


# --- plan() and run() on the host (CPU; the checks' cuda variants where a GPU is) -----------------
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _plan(ba, args, head_dims=(HD, HD), page_size=16, **kwargs) -> None:
    try:
        ba.plan(*args, *LLAMA, *head_dims, page_size, **kwargs)
    except ToolchainError as exc:
        pytest.skip(f"plan() builds its host planners: {exc}")


def _args(qo_lens, kv_lens, device="cpu", page_size=16):
    """A batch's plan() index tensors (page ids drawn from 0..pages + 7)."""
    batch = make_batch(list(zip(qo_lens, kv_lens)), page_size, random.Random(0), device)
    return batch.plan_args


@pytest.mark.parametrize("qo_lens, kv_lens, kwargs, mode, decode", [
    pytest.param([300, 4, 0], [1000, 129, 0], {}, "prefill", [], id="prefill"),
    pytest.param([1, 1, 1], [1, 17, 3000], {}, "decode", [0, 1, 2], id="decode"),
    pytest.param([1, 300, 1, 4], [20, 1000, 3000, 50], dict(causal=True), "pod", [0, 2], id="pod"),
    pytest.param([1, 300, 1], [20, 1000, 3], dict(logits_soft_cap=30.0), "serial", [0, 2], id="serial-softcap"),
    pytest.param([1, 300, 1], [20, 1000, 3], dict(head_dims=(192, 128)), "prefill", [], id="hd192-128"),
    pytest.param([1, 0, 1], [20, 0, 3], {}, "decode", [0, 2], id="decodes-and-padding"),
    pytest.param([1, 300, 1], [20, 1000, 3], dict(pos_encoding_mode="ROPE_LLAMA"), "prefill", [], id="rope"),
    pytest.param([1, 1], [20, 3], dict(pos_encoding_mode="ALIBI"), "prefill", [], id="alibi-decodes"),
])
def test_plan_on_host_picks_the_mode(qo_lens, kv_lens, kwargs, mode, decode):
    ba = fij.BatchAttention(device="cpu")
    _plan(ba, _args(qo_lens, kv_lens), **kwargs)
    assert ba._planned[0] == mode
    assert ba._planned[1].decodes == len(decode)
    assert ba._planned[3] == sum(qo_lens)
    if "pos_encoding_mode" in kwargs:  # the prefill kernel rotates (adds the bias) in-kernel
        want = {"ROPE_LLAMA": "rope_llama", "ALIBI": "alibi"}[kwargs["pos_encoding_mode"]]
        assert ba._prefill._plan.spec.pos_encoding == want


@pytest.mark.parametrize("qo_lens, backend, kv_dtype, mode, prefill", [
    pytest.param([1, 2048, 1, 1], "auto", E4M3, "serial", "fa3", id="e4m3-chunk"),
    pytest.param([1, 10, 1, 1], "auto", E4M3, "pod", None, id="e4m3-short-chunk"),
    pytest.param([1, 2048, 1, 1], "fa2", E4M3, "pod", None, id="e4m3-fa2"),
    pytest.param([1, 2048, 1, 1], "auto", BF16, "pod", None, id="bf16"),
])
def test_plan_runs_fp8_caches_on_sm90_as_two_launches(monkeypatch, qo_lens, backend, kv_dtype, mode, prefill):
    """An fp8 cache on sm_90 under "auto" (the arch check passed on the CPU): serial mode where
    the prefill side plans the Hopper kernel (POD on Hopper reads no fp8 cache, and the mma.sync
    POD was slower than the two launches: docs/pod.md), POD where it does not (a short chunk),
    under "fa2", and for a 16-bit cache (POD on Hopper); under "auto" an fp8 cache's plan()
    plans in full each time (not POD's repeat path)."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    ba = fij.BatchAttention(device="cpu")
    ba.prefill_backend = backend
    for _ in range(2):  # (the second plan() of the same arguments: the same mode)
        _plan(ba, _args(qo_lens, [20, 2048, 3000, 50]), causal=True, kv_data_type=kv_dtype)
        assert ba._planned[0] == mode
    if prefill is not None:
        assert ba._prefill.planned_backend == prefill
    assert (ba._pod_options is None) == (kv_dtype == E4M3 and backend == "auto")
    # the same batch through vLLM's block tables: the same mode
    batch = make_batch(list(zip(qo_lens, [20, 2048, 3000, 50])), 16, random.Random(0), "cpu")
    bt = fij.BatchAttention(device="cpu")
    bt.prefill_backend = backend
    _plan(bt, (batch.plan_args[0], None, None, batch.plan_args[3]), causal=True, kv_data_type=kv_dtype,
          block_tables=block_tables_of(batch, False))
    assert bt._planned[0] == mode


def test_plan_rejects_an_unknown_pos_encoding_mode():
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        _plan(fij.BatchAttention(device="cpu"), _args([1, 5], [20, 40]), pos_encoding_mode="ROPE")


def block_tables_of(batch: Batch, separate: bool, v_perm: torch.Tensor | None = None) -> torch.Tensor:
    """The batch's CSR page table as block tables, vLLM's [B, max_pages] or TensorRT-LLM's
    [B, 2, max_pages]; the V ids v_perm[K id] (the V cache's pages permuted so), padding -1."""
    qo, kv, ids, lens = batch.plan_args
    kv, ids = kv.cpu(), ids.cpu()
    pages = (kv[1:] - kv[:-1]).tolist()
    width = max(pages + [1]) + 2
    table = torch.full((len(pages), 2, width) if separate else (len(pages), width), -1, dtype=torch.int32)
    for b, n in enumerate(pages):
        row = ids[int(kv[b]):int(kv[b]) + n]
        if separate:
            table[b, 0, :n] = row
            table[b, 1, :n] = v_perm.cpu()[row.long()].int()
        else:
            table[b, :n] = row
    return table


@pytest.mark.parametrize("separate", [False, True], ids=["block_table", "block_table_kv_separate"])
@pytest.mark.parametrize("qo_lens, kv_lens, mode, view", [
    pytest.param([1, 1, 300, 4], [20, 3000, 1000, 50], "pod", True, id="decodes-first"),
    pytest.param([1, 300, 1, 4], [20, 1000, 3000, 50], "pod", False, id="interleaved"),
    pytest.param([300, 4, 0], [1000, 129, 0], "prefill", True, id="prefill-only"),
    pytest.param([1, 1, 1], [1, 17, 3000], "decode", True, id="decode-only"),
])
def test_plan_takes_block_tables(qo_lens, kv_lens, mode, view, separate):
    """BatchAttention.plan(block_tables=..., kv_indptr / kv_indices None): each side plans
    its requests' rows of the table (a view where they are one run of rows) in the table's
    layout, with their lengths; the mode and the cut are the CSR plan's."""
    batch = make_batch(list(zip(qo_lens, kv_lens)), 16, random.Random(0), "cpu")
    table = block_tables_of(batch, separate, torch.arange(batch.num_pages).flip(0))
    csr = fij.BatchAttention(device="cpu")
    _plan(csr, batch.plan_args)
    ba = fij.BatchAttention(device="cpu")
    _plan(ba, (batch.plan_args[0], None, None, batch.plan_args[3]), block_tables=table)
    assert ba._planned[0] == csr._planned[0] == mode
    layout = "block_table_kv_separate" if separate else "block_table"
    split = split_batch(batch.plan_args[0].numpy())
    sides = {"pod": (ba._pod._prefill, ba._pod._decode), "prefill": (ba._prefill,), "decode": (ba._decode,)}[mode]
    for side in sides:
        assert side._plan.spec.page_table == layout
    if mode == "pod":
        rows = ba._pod._decode._plan.args[0][0]  # (its block table as planned: the decode side's rows)
        assert torch.equal(rows, table[torch.from_numpy(split.decode)])
        assert (rows.data_ptr() - table.data_ptr() == int(split.decode[0]) * table.stride(0) * 4) == view
    with pytest.raises(ValueError, match="block_tables: pass kv_indptr and kv_indices as None"):
        _plan(ba, batch.plan_args, block_tables=table)
    with pytest.raises(ValueError, match="kv_len_arr and qo_indptr: expected"):
        _plan(ba, (batch.plan_args[0], None, None, batch.plan_args[3][:-1]), block_tables=table)
    with pytest.raises(TypeError, match="block_tables: expected an int32 or int64 tensor"):
        _plan(ba, (batch.plan_args[0], None, None, batch.plan_args[3]), block_tables=table.float())
    short = torch.tensor(kv_lens, dtype=torch.int32)
    short[0] = table.shape[-1] * 16 + 1
    with pytest.raises(ValueError, match=r"kv_len_arr\[0\].*block_tables holds"):
        _plan(ba, (batch.plan_args[0], None, None, short), block_tables=table)


def test_plan_takes_int64_index_tensors():
    ba = fij.BatchAttention(device="cpu")
    _plan(ba, [t.long() for t in _args([1, 300, 1], [20, 1000, 3])])
    assert ba._planned[0] == "pod" and ba._planned[2].tolist() == [0, 301, *range(1, 301)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change, match", [
    (dict(kv_lens=[33, 40, 3]), r"kv_len_arr\[0\]"),   # 33 tokens on 2 pages of 16
    (dict(kv_lens=[20, 32, 3]), r"kv_len_arr\[1\]"),   # 32 tokens on 3 pages: one page too many
    (dict(qo=[0, 1, 6, 7, 7]), "qo_indptr and kv_indptr"),
    (dict(kv=[0, 2, 5]), "qo_indptr and kv_indptr"),
    (dict(use_profiler=True), "use_profiler"),
], ids=["kv_len_too_long", "kv_len_too_short", "qo_indptr_length", "kv_indptr_length", "profiler"])
def test_plan_rejects(change, match, device):
    qo, kv, ids, lens = _args([1, 5, 1], [20, 40, 3])  # pages 2, 3, 1
    lens = torch.tensor(change.get("kv_lens", lens.tolist()), dtype=torch.int32)
    qo = torch.tensor(change.get("qo", qo.tolist()), dtype=torch.int32)
    kv = torch.tensor(change.get("kv", kv.tolist()), dtype=torch.int32)
    ba = fij.BatchAttention(device=device)
    with pytest.raises(ValueError, match=match):
        ba.plan(*(t.to(device) for t in (qo, kv, ids, lens)), *LLAMA, HD, HD, 16,
                use_profiler=change.get("use_profiler", False))


def _planned_pod(device):
    """A wrapper planned for 2 decodes and a 5-token chunk (bf16, 32/8 heads, head_dim 128,
    page 16), and a q and (k, v) cache that fit it."""
    ba = fij.BatchAttention(device=device)
    _plan(ba, [t.to(device) for t in _args([1, 5, 1], [20, 40, 3])])
    cache = tuple(torch.zeros(14, 16, 8, HD, dtype=BF16, device=device) for _ in range(2))
    return ba, torch.zeros(7, 32, HD, dtype=BF16, device=device), cache


@pytest.mark.parametrize("device", DEVICES)
def test_run_before_plan_is_an_error(device):
    ba = fij.BatchAttention(device=device)
    with pytest.raises(RuntimeError, match="plan"):
        ba.run(torch.zeros(7, 32, HD, dtype=BF16, device=device), torch.zeros(6, 2, 16, 8, HD, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change, match", [
    (dict(kv_cache_sf=torch.zeros(1)), "kv_cache_sf"),
    (dict(q=(6, 32, HD)), r"q: expected \[7, 32, 128\]"),
    (dict(q=(7, 16, HD)), r"q: expected \[7, 32, 128\]"),
    (dict(q_dtype=F16), "q: planned for"),
    (dict(logits_soft_cap=5.0), "logits_soft_cap"),
    (dict(out=(7, 32, 64)), "out"),
    (dict(lse=torch.float16), "lse"),
], ids=["kv_cache_sf", "q_tokens", "q_heads", "q_dtype", "soft_cap", "out_shape", "lse_dtype"])
def test_run_rejects(change, match, device):
    ba, q, cache = _planned_pod(device)
    if "q" in change or "q_dtype" in change:
        q = torch.zeros(change.get("q", q.shape), dtype=change.get("q_dtype", BF16), device=device)
    kwargs = {k: v for k, v in change.items() if k in ("kv_cache_sf", "logits_soft_cap")}
    if "out" in change:
        kwargs["out"] = torch.zeros(change["out"], dtype=BF16, device=device)
    if "lse" in change:
        kwargs["lse"] = torch.zeros(7, 32, dtype=change["lse"], device=device)
    with pytest.raises(ValueError, match=match):
        ba.run(q, cache, **kwargs)


@pytest.mark.parametrize("cap", [None, 30.0], ids=["pod", "serial"])
@pytest.mark.parametrize("given", [False, True], ids=["allocated", "in-place"])
@pytest.mark.parametrize("name", ["decodes-first", "decodes-last", "interleaved", "speculative", "decode-only",
                                  "prefill-only", "empty-requests", "decodes-and-padding"])
def test_run_routes_each_row_to_its_side(name, given, cap, monkeypatch):
    """run() on the host with the launches replaced by fakes that copy q to out and write
    their side's tag (prefill 1, decode 2) to lse: every row of out is its row of q (the
    views, or the gather and scatter of the perm path) and carries its request's side."""
    rnd = random.Random(0)
    batch = make_batch(BATCHES[name](rnd), 16, rnd, "cpu")
    ba = fij.BatchAttention(device="cpu")
    _plan(ba, batch.plan_args, logits_soft_cap=cap)
    rows = []

    def side(tag):
        def fill(q, out, lse):
            rows.append((tag, q.shape[0]))
            out.copy_(q)
            lse.fill_(tag)
        return fill
    prefill, decode = side(1.0), side(2.0)
    monkeypatch.setattr(ba._pod, "_run_into", lambda q_p, kv_p, q_d, kv_d, *a, **_: (prefill(q_p, *a[-4:-2]),
                                                                                     decode(q_d, *a[-2:])))
    monkeypatch.setattr(ba._prefill, "run", lambda q, kv, out=None, lse=None, **_: prefill(q, out, lse))
    monkeypatch.setattr(ba._decode, "run", lambda q, kv, out=None, lse=None, **_: decode(q, out, lse))
    q = torch.randn(int(batch.plan_args[0][-1]), 32, HD).to(BF16)
    out, lse = (torch.full((*q.shape[:2], HD), float("nan"), dtype=BF16), torch.full(q.shape[:2], float("nan"))) \
        if given else (None, None)
    got_out, got_lse = ba.run(q, (torch.zeros(1), torch.zeros(1)), out=out, lse=lse)
    assert not given or (got_out is out and got_lse is lse)
    assert torch.equal(got_out, q), "rows of out are not their rows of q"
    tags = torch.tensor([2.0 if qo == 1 else 1.0 for qo, _ in batch.requests for _ in range(qo)])
    assert torch.equal(got_lse, tags[:, None].expand(-1, 32)), "rows on the wrong side"
    num_decodes = sum(qo == 1 for qo, _ in batch.requests)
    want = {1.0: q.shape[0] - num_decodes, 2.0: num_decodes}
    assert sorted(rows) == sorted((t, n) for t, n in want.items() if n or ba._planned[0] in ("pod", "serial"))


def test_exported_at_flashinfers_paths():
    import flashinfer_jit.attention
    import flashinfer_jit.pod

    assert fij.BatchAttention is flashinfer_jit.attention.BatchAttention is flashinfer_jit.pod.BatchAttention
    assert BatchAttention.begin_forward is BatchAttention.plan and BatchAttention.forward is BatchAttention.run


# --- the AOT matrix (CPU) ---------------------------------------------------------------------------
def specs_needed() -> set:
    """Every module the GPU tests load: each case planned on the host, the modules read off
    the plans (POD: the spec run() builds from both sides' plans)."""
    cases = [*CASES.values(), *(Case(n, causal=True) for n in IN_PLACE), *REPLAN]
    specs = set()
    for case in cases:
        rnd = random.Random(0)
        ba = BatchAttention(case.layout, device="cpu")
        plan(ba, make_batch(BATCHES[case.batch](rnd), case.page_size, rnd, "cpu"), case)
        mode = ba._planned[0]
        if mode == "pod":
            q = torch.empty(0, LLAMA[0], case.head_dim, dtype=case.dtype)
            specs.add(ba._pod._spec("paged", q, q))
        else:
            wrappers = {"prefill": [ba._prefill], "decode": [ba._decode], "serial": [ba._prefill, ba._decode]}
            specs |= {w._plan.spec for w in wrappers[mode]}
    return specs


def test_tests_matrix_has_every_module():
    try:
        needed = specs_needed()
    except ToolchainError as exc:
        pytest.skip(f"plan() builds its host planners: {exc}")
    assert_tests_matrix_has(needed, PodSpec, 8, "BatchAttention POD")


def test_plan_rejects_a_page_id_list_shorter_than_the_table():
    qo, kv, ids, lens = _args([1, 5, 1], [20, 40, 3])
    ba = fij.BatchAttention(device="cpu")
    with pytest.raises(ValueError, match=r"kv_indices: 5 page ids, fewer than kv_indptr\[-1\] = 6"):
        ba.plan(qo, kv, ids[:5], lens, *LLAMA, HD, HD, 16)


def test_a_side_planners_error_names_the_batchs_requests():
    """A side's planner names its own request numbers; the message says which of the batch's
    they are (the prefill side's request 0 is the batch's request 2 here). And causal with
    fewer keys than queries, once such an error, plans: its first rows see no key, as in
    FlashInfer."""
    import types

    from flashinfer_jit.pod.batch_attention import _SideErrors

    split = types.SimpleNamespace(decode=np.array([0, 1]), prefill=np.array([2]))
    with pytest.raises(ValueError, match=r"request 0: .*the prefill side's \[2\]"):
        with _SideErrors("the prefill side", split):
            raise ValueError("request 0: something the prefill planner rejects")
    ba = fij.BatchAttention(device="cpu")
    _plan(ba, _args([1, 1, 10], [5, 5, 3]), causal=True)


def test_run_rejects_q_on_another_device():
    ba = fij.BatchAttention(device="cpu")
    _plan(ba, _args([1, 5, 1], [20, 40, 3]))
    q = torch.empty(7, 32, HD, dtype=BF16, device="meta")
    cache = tuple(torch.zeros(14, 16, 8, HD, dtype=BF16) for _ in range(2))
    with pytest.raises(ValueError, match="q: on meta, but the wrapper .* is on cpu"):
        ba.run(q, cache)


# --- CUDA-graph plans (CPU) --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, mode", [
    pytest.param({}, "pod", id="pod"),
    pytest.param(dict(logits_soft_cap=30.0), "serial", id="softcap"),
    pytest.param(dict(head_dims=(192, 128)), "prefill", id="hd192-128"),
])
def test_graph_plans_keep_one_launch_form(kwargs, mode):
    """A CUDA-graph wrapper runs every plan in the form its configuration fixes (decodes only,
    no decodes, no rows: still POD), and each plan ships where each row lives in the sides'
    fixed rows: fwd (a side row's batch row: the decode side's max_batch_size rows, then the
    prefill side's) and inv (a batch row's side row; past the plan's rows, the zero row)."""
    ba = fij.BatchAttention(device="cpu", use_cuda_graph=True, max_batch_size=6, max_num_tokens=320,
                            max_num_pages=400)
    assert ba.is_cuda_graph_enabled()
    for qo_lens, kv_lens in [([1, 300, 1, 4], [20, 1000, 3000, 50]), ([1, 1, 1], [1, 17, 3000]),
                             ([300, 4, 0], [1000, 129, 0]), ([0, 0], [0, 0])]:
        _plan(ba, _args(qo_lens, kv_lens), **kwargs)
        assert ba._planned[0] == mode
        if mode == "prefill":
            assert ba._graph.rows is None
            continue
        fwd, inv, _ = (t.tolist() for t in ba._graph.rows)
        qo = list(itertools.accumulate(qo_lens, initial=0))
        decode_rows = [qo[r] for r, n in enumerate(qo_lens) if n == 1]
        prefill_rows = [row for r, n in enumerate(qo_lens) if n != 1 for row in range(qo[r], qo[r + 1])]
        assert fwd[:len(decode_rows)] == decode_rows and fwd[6:6 + len(prefill_rows)] == prefill_rows
        want = [0] * 320
        for i, row in enumerate(decode_rows):
            want[row] = i
        for i, row in enumerate(prefill_rows):
            want[row] = 6 + i
        for row in range(qo[-1], 320):
            want[row] = 6 + 320
        assert inv == want


@pytest.mark.parametrize("change, match", [
    (dict(qo_lens=[1] * 7, kv_lens=[5] * 7), "7 requests exceed .* max_batch_size 6"),
    (dict(qo_lens=[1, 320], kv_lens=[5, 400]), "321 query tokens exceed .* max_num_tokens 320"),
    (dict(qo_lens=[1, 20], kv_lens=[5, 6500]), "408 page ids exceed .* max_num_pages 400"),
    (dict(causal=True), "keeps its first plan"),
    (dict(sm_scale=0.1), "keeps its first plan"),
], ids=["batch", "tokens", "pages", "causal", "sm_scale"])
def test_graph_plan_rejects_what_the_capture_does_not_hold(change, match):
    ba = fij.BatchAttention(device="cpu", use_cuda_graph=True, max_batch_size=6, max_num_tokens=320,
                            max_num_pages=400)
    _plan(ba, _args([1, 300, 1], [20, 1000, 3]))
    args = _args(change.get("qo_lens", [1, 5, 1]), change.get("kv_lens", [20, 40, 3]))
    kwargs = {k: v for k, v in change.items() if k in ("causal", "sm_scale")}
    with pytest.raises(ValueError, match=match):
        _plan(ba, args, **kwargs)


def test_graph_capacities_need_use_cuda_graph():
    with pytest.raises(ValueError, match="max_batch_size: a capacity of a CUDA-graph wrapper"):
        fij.BatchAttention(device="cpu", max_batch_size=8)
    with pytest.raises(ValueError, match="max_num_tokens: expected a positive int"):
        fij.BatchAttention(device="cpu", use_cuda_graph=True, max_num_tokens=0)
    ba = fij.BatchAttention(device="cpu", use_cuda_graph=True)
    _plan(ba, _args([1, 300, 1], [20, 1000, 3]))
    with pytest.raises(ValueError, match="prefill_backend: a CUDA-graph BatchAttention keeps the kernel"):
        ba.prefill_backend = "auto"


def test_graph_run_checks_q_rows_against_plan_and_capacity():
    ba = fij.BatchAttention(device="cpu", use_cuda_graph=True, max_num_tokens=320)
    _plan(ba, _args([1, 5, 1], [20, 40, 3]))
    cache = tuple(torch.zeros(14, 16, 8, HD, dtype=BF16) for _ in range(2))
    for rows in (6, 321):
        with pytest.raises(ValueError, match=r"q: expected \[rows, 32, 128\] with qo_indptr\[-1\] = 7 <= rows <= "
                                             r"max_num_tokens = 320"):
            ba.run(torch.zeros(rows, 32, HD, dtype=BF16), cache)

"""POD's host time (docs/pod.md "Host time"): plan()'s per-request arithmetic in C++ and run()'s
fast path, for BatchPODWithPagedKVCacheWrapper, PODWithPagedKVCacheWrapper and BatchAttention.

CPU tests: fij_fastcall's pod_work and batch_split give what the numpy code gives (and what the
code before them gave: the FLOP formula, the split and the side tables, inlined below) on random
batches; plans made through them equal the numpy path's (schedules, sides' buffers); the
signature and pod_run refuse other forms; the wrappers take a recorded launch only for its
common form and key, fall back to the op otherwise, and never under torch.compile.

GPU tests: a recorded launch's results equal the op path's bit for bit and the float64
references, outputs poisoned with NaN first (given ones in place, allocated ones through the
caching allocator); a call of another signature falls back to the op and records again; during
CUDA-graph capture the entry refuses and the op is captured.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from kv_helpers import DEV, randn
from test_pod import mma_pod_by_default  # noqa: F401  (autouse: see test_pod.py)
from test_pod import (BF16, HD, LLAMA, TOL, Decode, _poison_allocator, check_lse, check_out, check_pod, csr_table,
                      decode_reference, make_cache, make_prefill, nan_outside, prefill_reference, unpack)

import flashinfer_jit as fij
from flashinfer_jit.pod import batch_attention as ba_mod
from flashinfer_jit.prefill import wrapper as pf
from flashinfer_jit.pod import wrapper as pod_mod
from flashinfer_jit.pod.batch_attention import cut_batch, native_cut, split_batch
from flashinfer_jit.reference.prefill import prefill_ref
from flashinfer_jit.runtime import fastcall
from flashinfer_jit.runtime.page_table import csr_kv_lens_host, csr_page_table


@pytest.fixture(scope="module")
def ext():
    e = fastcall.extension()
    if e is None:
        pytest.skip("fij_fastcall could not be built here")
    return e


def _i32(values, device="cpu"):
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def _csr(kv_lens, page_size, rnd=None):
    pages = [-(-n // page_size) for n in kv_lens]
    ids = list(range(sum(pages)))
    if rnd is not None:
        rnd.shuffle(ids)
    return (_i32(itertools.accumulate(pages, initial=0)), _i32(ids),
            _i32(n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)))


def _old_prefill_flops(qo_lens, kv_lens, causal, hq, d) -> float:
    """The FLOP estimate before pod_work (float64 numpy), which the schedule must keep."""
    q, k = np.asarray(qo_lens, dtype=np.float64), np.asarray(kv_lens, dtype=np.float64)
    seen = np.maximum(k - (q - 1) * 0.5, 0.0) if causal else k
    return float(q @ seen) * hq * d * 4.0


def _random_pod_batch(rnd: random.Random, page_size: int):
    n_p, n_d = rnd.randint(0, 20), rnd.randint(0, 300)
    qo_p = [rnd.choice([0, 1, 2, 7, rnd.randint(1, 600)]) for _ in range(n_p)]
    kv_p = [rnd.choice([0, q, q + rnd.randint(0, 5000), max(0, q - 3)]) for q in qo_p]
    kv_d = [rnd.choice([0, 1, page_size, rnd.randint(1, 9000)]) for _ in range(n_d)]
    return qo_p, kv_p, kv_d


# --- plan(): C++ and numpy agree with the code before them (CPU) ----------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_pod_work_equals_numpy_and_the_old_estimate(ext, seed):
    rnd = random.Random(seed)
    page_size = rnd.choice([1, 16, 64])
    qo_p, kv_p, kv_d = _random_pod_batch(rnd, page_size)
    ip_p, _, last_p = _csr(kv_p, page_size)
    ip_d, _, last_d = _csr(kv_d, page_size)
    qo_indptr = _i32(itertools.accumulate(qo_p, initial=0))
    full, causal2, keys_d, ok, longest = ext.pod_work(qo_indptr, ip_p, last_p, ip_d, last_d, None, page_size)
    assert ok and (full, causal2) == pod_mod.prefill_work(qo_p, kv_p) and keys_d == sum(kv_d)
    assert longest == max(kv_d, default=0)
    assert (keys_d == int(csr_kv_lens_host(ip_d.numpy().astype(np.int64), last_d.numpy(), page_size).sum()))
    for causal in (False, True):
        hq, d = rnd.choice([(32, 128), (8, 64), (4, 256)])
        assert pod_mod.work_flops((full, causal2), causal, hq, d) == _old_prefill_flops(qo_p, kv_p, causal, hq, d)


@pytest.mark.parametrize("longest, ratio, split", [(0, 3.0, None), (4096, 3.0, None), (4097, 3.0, 2048),
                                                   (65536, 2.0, 2048), (8192, 1.9, None), (8192, 1.2, None)])
def test_sm90_decode_split(longest, ratio, split):
    """POD on Hopper's decode side splits requests over 4096 keys into chunks of 2048 where its
    estimated time is at least twice the prefill side's (the H200 runs in docs/pod.md)."""
    flops = 1e12
    kv_bytes = ratio * flops / pod_mod._SM90_PREFILL_FLOPS_PER_S * pod_mod._DECODE_BYTES_PER_S
    assert pod_mod.sm90_decode_split(longest, flops, kv_bytes) == split
    # the mixes it was measured on (bf16, 32 / 8 heads, head_dim 128, causal): 4 splits, 5 and 3 not
    hk, d = 8, 128
    mix = {4: ((4096, 4096), 128 * 8192), 5: ((6000, 7000), 128 * 8192), 3: ((4096, 4096), 128 * 4096)}
    for n, ((q, k), keys) in mix.items():
        flops = pod_mod.work_flops(pod_mod.prefill_work([q], [k]), True, 32, d)
        got = pod_mod.sm90_decode_split(keys // 128, flops, float(keys) * hk * 4 * d)
        assert got == (2048 if n == 4 else None), n


def test_pod_work_refuses_other_forms(ext):
    qo, (ip, _, last) = _i32([0, 3]), _csr([20], 16)
    assert ext.pod_work(qo, ip, last, ip, last, None, 16)[3]
    assert not ext.pod_work(qo, ip, last, ip, last, _i32([0, 2]), 16)[3]  # a decode of two tokens
    for bad in (ip.long(), ip[:1], torch.zeros(2, 1, dtype=torch.int32), _i32([0, 2, 9])[::2], [0, 2]):
        assert ext.pod_work(qo, bad, last, ip, last, None, 16) == -1
    # a CUDA-graph wrapper's last_page_len buffer, longer than the batch: its first values
    assert ext.pod_work(qo, ip, _i32([4, 99, 99]), ip, last, None, 16)[0] == 3 * 20


def _plan_pod(w, batch, page_size, causal, host_form):
    qo_p, kv_p, kv_d = batch
    rnd = random.Random(1)
    ip_p, ids_p, last_p = _csr(kv_p, page_size, rnd)
    ip_d, ids_d, last_d = _csr(kv_d, page_size, rnd)
    qo = _i32(itertools.accumulate(qo_p, initial=0))
    qo_d = torch.arange(len(kv_d) + 1, dtype=torch.int32)
    tables = [qo, ip_p, ids_p, last_p, qo_d, ip_d, ids_d, last_d]
    if host_form == "int64":  # not plan()'s common form: the numpy path (same planners)
        tables = [t.long() for t in tables]
    w.plan(*tables, *LLAMA, HD, page_size, q_data_type=BF16, causal=causal)


def _planned(side) -> list:
    """A side's planned device lists (prefill: qo_indptr, work, merge_indptr; decode: work,
    merge_indptr), each work list cut to its items: its view runs to the plan buffer's end
    (its first element counts the items: prefill pairs of _PAIR_INTS a KV head, decode items
    of 4 ints)."""
    if isinstance(side, fij.BatchDecodeWithPagedKVCacheWrapper):
        work, merge = side._plan.args[1:3]
        return [work[: 1 + 4 * int(work[0])], merge]
    qo, work, merge = side._plan.args[1:4]
    return [qo, work[: 1 + pf._PAIR_INTS * (int(work[0]) // side._plan.config.num_kv_heads)], merge]


def _plan_state(w):
    """What a plan decides: the schedule's inputs and result, and both sides' planned buffers."""
    tensors = [*_planned(w._prefill)[:3], *_planned(w._decode)[:2]]
    return (w._flops, w._kv_bytes, w._planned_schedule, w._prefill._plan.tile_rows, w._prefill._plan.grid,
            w._decode._plan.args[8], [t.clone() for t in tensors if t is not None])


@pytest.mark.parametrize("seed", range(6))
def test_batch_pod_plan_through_cxx_equals_the_numpy_path(ext, seed):
    rnd = random.Random(100 + seed)
    page_size = rnd.choice([16, 1])
    batch = _random_pod_batch(rnd, page_size)
    hq, hk = LLAMA
    for causal in (False, True):
        states = []
        for form in ("int32", "int64"):
            w = fij.BatchPODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
            _plan_pod(w, batch, page_size, causal, form)
            states.append(_plan_state(w))
            kv_bytes = float(sum(batch[2])) * hk * HD * 2 * 2  # K and V, bf16
            flops = _old_prefill_flops(batch[0], batch[1], causal, hq, HD)
            assert (w._flops, w._kv_bytes) == (flops, kv_bytes), "not the estimate of the code before"
        (a, b) = states
        assert a[:6] == b[:6]
        assert all(torch.equal(x, y) for x, y in zip(a[6], b[6]))


def test_batch_pod_plan_checks_the_decode_side_the_same_way(ext):
    w = fij.BatchPODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    ip, ids, last = _csr([20, 30], 16)
    for qo_d in (_i32([0, 1, 3]), _i32([0, 1, 3]).long()):  # C++, numpy
        with pytest.raises(ValueError, match="qo_indptr_d: the decode side takes one query token"):
            w.plan(_i32([0, 5, 9]), ip, ids, last, qo_d, ip, ids, last, *LLAMA, HD, 16, q_data_type=BF16)


# --- a repeated plan (_Pod._replan) equals a full plan (CPU, POD on Hopper's planners) ------------
def _hopper_batch(rnd: random.Random, page_size: int, kind: str):
    """A batch POD step: "common" prefill chunks that "auto" puts on the Hopper kernel beside
    decodes; "short" ones it declines; "long" decodes beside a small prefill (the decode side
    splits); "empty" sides; "bad" a last_page_len over page_size on the decode side."""
    n_p = {"common": rnd.randint(1, 6), "short": 2, "long": 1, "empty": 0, "bad": 2}[kind]
    qo_p = [rnd.randint(3, 8) if kind == "short" else rnd.randint(300, 2000) for _ in range(n_p)]
    kv_p = [q + rnd.randint(0, 3000) for q in qo_p]
    n_d = 0 if kind == "empty" and rnd.random() < 0.5 else rnd.randint(1, 200)
    kv_d = [rnd.randint(6000, 9000) if kind == "long" else rnd.choice([1, page_size, rnd.randint(1, 5000)])
            for _ in range(n_d)]
    rng = random.Random(rnd.random())
    ip_p, ids_p, last_p = _csr(kv_p, page_size, rng)
    ip_d, ids_d, last_d = _csr(kv_d, page_size, rng)
    if kind == "bad":
        last_d[0] = page_size + 1
    qo = _i32(itertools.accumulate(qo_p, initial=0))
    return [qo, ip_p, ids_p, last_p, torch.arange(n_d + 1, dtype=torch.int32), ip_d, ids_d, last_d]


def _hopper_plan_state(w) -> tuple:
    """What a POD-on-Hopper plan leaves for run(): both sides' plans (the Hopper work list and
    page ids, the decode side's tables, work list and launch values) and POD's schedule."""
    p, d = w._prefill._plan, w._decode._plan
    tables, work, merge = d.args[0], d.args[1], d.args[2]
    dec = (tuple(t.clone() for t in tables if t is not None), work[: 1 + 4 * int(work[0])].clone(), merge.clone(),
           d.args[5:10], d.batch, d.capacity, d.cluster, d.kv_heads_per_block, d.spec.name,
           d.config.fixed_split_size)
    pre = (p.work[: p.work_ints].clone(), p.page_ids.clone(), p.grid, p.qo_tokens, p.spec.name)
    pod = (w._flops, w._kv_bytes, w._sm90_blocks, w._prefill_work, w._prefill_mask, w._planned_schedule, w._quick)
    return pre, dec, pod


@pytest.mark.parametrize("seed", range(6))
def test_a_repeated_batch_pod_plan_equals_a_full_plan(ext, seed, monkeypatch):
    """An eager batch POD wrapper planned step after step in one configuration replans from its
    recipe (_replan: no full plan()) and ends in the state a fresh wrapper's full plan() of the
    same step gives, bit for bit; steps it does not take ("auto" declining short chunks, another
    decode split, int64 vectors, a bad value) go the full way, with the full path's errors."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    replans = []
    original = pod_mod.BatchPODWithPagedKVCacheWrapper._replan
    monkeypatch.setattr(pod_mod.BatchPODWithPagedKVCacheWrapper, "_replan",
                        lambda self, *a: replans.append(original(self, *a)) or replans[-1])

    def wrapper():
        w = fij.BatchPODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
        w.prefill_backend = "auto"
        return w

    rnd = random.Random(700 + seed)
    page_size = rnd.choice([16, 32])
    causal = seed % 2 == 0
    kinds = ["common"] * 4 + ["short", "common", "long", "common", "int64", "common", "bad", "common", "empty",
                              "common"]
    repeated = wrapper()
    for step, kind in enumerate(kinds):
        tables = _hopper_batch(rnd, page_size, "common" if kind == "int64" else kind)
        if kind == "int64":
            tables = [t.long() for t in tables]
        before = len(replans)
        if kind == "bad":
            with pytest.raises(ValueError) as got:
                repeated.plan(*tables, *LLAMA, HD, page_size, q_data_type=BF16, causal=causal)
            with pytest.raises(ValueError) as want:
                wrapper().plan(*tables, *LLAMA, HD, page_size, q_data_type=BF16, causal=causal)
            assert str(got.value) == str(want.value)
            continue
        repeated.plan(*tables, *LLAMA, HD, page_size, q_data_type=BF16, causal=causal)
        fresh = wrapper()
        fresh.plan(*tables, *LLAMA, HD, page_size, q_data_type=BF16, causal=causal)
        assert repeated._prefill.planned_backend == fresh._prefill.planned_backend, (step, kind)
        if fresh._prefill.planned_backend != "fa3":
            assert kind in ("short", "empty") and repeated._recipe is None
            continue
        took = len(replans) > before and replans[-1]
        a, b = _hopper_plan_state(repeated), _hopper_plan_state(fresh)
        assert _same(a, b), (step, kind, took)
        assert repeated._prefill_args[:4] == tuple(tables[:4]) and repeated._prefill_args[4:] == \
            fresh._prefill_args[4:]
        # the steps a recipe takes: one of the configuration before it, in plan()'s common form
        after_common = step > 0 and kinds[step - 1] in ("common", "long") and fresh._prefill.planned_backend == "fa3"
        if kind == "int64" or not after_common:
            assert not took, (step, kind)
        elif kind == "common" and kinds[step - 1] == "common":
            assert took, (step, kind)
    assert sum(replans) >= 3


def test_a_changed_option_plans_in_full(ext, monkeypatch):
    """A recipe holds one configuration: plan() with another option (causal, sm_scale, the
    backend, a pinned split) plans in full and records the new one."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    rnd = random.Random(5)
    w = fij.BatchPODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    w.prefill_backend = "auto"
    tables = _hopper_batch(rnd, 16, "common")
    calls = []
    original = pod_mod.BatchPODWithPagedKVCacheWrapper._replan
    monkeypatch.setattr(pod_mod.BatchPODWithPagedKVCacheWrapper, "_replan",
                        lambda self, *a: calls.append(1) or original(self, *a))
    w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, causal=True)
    w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, causal=True)
    assert len(calls) == 1 and w._recipe is not None
    for change in (dict(causal=False), dict(causal=True, sm_scale=0.1)):
        w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, **change)
        assert len(calls) == 1 and w._recipe[0][13] == change["causal"]
    w.force_decode_split = 512
    w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, causal=True, sm_scale=0.1)
    assert len(calls) == 1 and w._decode._plan.config.fixed_split_size == 512
    w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, causal=True, sm_scale=0.1)
    assert len(calls) == 2 and w._decode._plan.config.fixed_split_size == 512
    # a run() with a custom mask plans the prefill side on the mma.sync POD: the next plan()
    # repeats the recipe's (Hopper) prefill side all the same, as a full plan() would
    qo_lens = (tables[0][1:] - tables[0][:-1]).long()
    pages = (tables[1][1:] - tables[1][:-1]).long()
    kv_lens = torch.where(pages > 0, (pages - 1) * 16 + tables[3].long(), 0)
    w._plan_prefill(False, torch.ones(int((qo_lens * kv_lens).sum()), dtype=torch.bool), None)
    assert w._prefill.planned_backend == "fa2"
    w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, causal=True, sm_scale=0.1)
    fresh = fij.BatchPODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    fresh.force_decode_split, fresh.prefill_backend = 512, "auto"
    fresh.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, causal=True, sm_scale=0.1)
    assert len(calls) == 3 and w._prefill.planned_backend == "fa3"
    assert _same(_hopper_plan_state(w), _hopper_plan_state(fresh))
    # ... and "auto"'s rule, not the custom mask's mma.sync choice, decides a batch of short chunks
    w._plan_prefill(False, torch.ones(int((qo_lens * kv_lens).sum()), dtype=torch.bool), None)
    short = _hopper_batch(rnd, 16, "short")
    for x in (w, fresh):
        x.plan(*short, *LLAMA, HD, 16, q_data_type=BF16, causal=True, sm_scale=0.1)
    assert w._prefill.planned_backend == fresh._prefill.planned_backend == "fa2"


def test_a_repeated_batch_attention_plan_equals_a_full_plan(ext, monkeypatch):
    """BatchAttention's POD steps (decodes first or last, chunks beside them) take its short
    path (_plan_pod_again: the cut in C++) and its POD wrapper's recipe (_replan), and equal a fresh
    BatchAttention's full plans."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    replans = []
    original = pod_mod.BatchPODWithPagedKVCacheWrapper._replan
    monkeypatch.setattr(pod_mod.BatchPODWithPagedKVCacheWrapper, "_replan",
                        lambda self, *a: replans.append(original(self, *a)) or replans[-1])
    quick = []  # (the short paths taken: _plan_pod_again's C++ cut, else _plan_pod's)
    for name in ("_plan_pod_again", "_plan_pod"):
        short = getattr(ba_mod.BatchAttention, name)
        monkeypatch.setattr(ba_mod.BatchAttention, name,
                            lambda self, *a, short=short, name=name: quick.append((name, short(self, *a))) or
                            quick[-1][1])
    rnd = random.Random(11)
    repeated = fij.BatchAttention(device="cpu")
    for step in range(8):
        chunks = [rnd.randint(300, 2000) for _ in range(rnd.randint(1, 4))]
        qo = [1] * rnd.randint(1, 100) + chunks
        if step % 2:
            qo.reverse()
        kv = [q + rnd.randint(0, 4000) for q in qo]
        (qo_t, kv_t, lens_t), ids = _mixed_tensors(qo, kv, 16)
        planned = []
        for ba in (repeated, fij.BatchAttention(device="cpu")):
            ba.prefill_backend = "fa3"
            ba.plan(qo_t, kv_t, ids, lens_t, *LLAMA, HD, HD, 16, causal=True)
            assert ba._planned[0] == "pod" and ba._pod._prefill.planned_backend == "fa3"
            planned.append((_hopper_plan_state(ba._pod), ba._planned[3:]))
        assert _same(*planned), step
    assert sum(replans) >= 6 and sum(taken for name, taken in quick if name == "_plan_pod_again") >= 6
    bad = lens_t.clone()
    bad[-1] += 16 * 5  # (more keys than the request's pages hold)
    messages = []
    for ba in (repeated, fij.BatchAttention(device="cpu")):
        ba.prefill_backend = "fa3"
        with pytest.raises(ValueError) as got:
            ba.plan(qo_t, kv_t, ids, bad, *LLAMA, HD, HD, 16, causal=True)
        messages.append(str(got.value))
    assert messages[0] == messages[1] and "kv_len_arr" in messages[0]


# --- BatchAttention's cut (CPU) -------------------------------------------------------------------
def _old_side_table(requests, kv_indptr, kv_lens, page_size, kv_indices):
    """BatchAttention's side table before cut_batch (indptr, ids, last)."""
    pages = kv_indptr[requests + 1] - kv_indptr[requests]
    indptr = np.zeros(len(requests) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    last = np.where(pages > 0, kv_lens[requests] - (pages - 1) * page_size, 0).astype(np.int32)
    if len(requests) == 0:
        return indptr, kv_indices[:0], last
    where = np.concatenate([np.arange(kv_indptr[r], kv_indptr[r + 1]) for r in requests])
    return indptr, kv_indices[torch.from_numpy(where)], last


def _random_mixed(rnd: random.Random, page_size: int):
    n = rnd.randint(0, 40)
    order = rnd.choice(["decodes-first", "decodes-last", "mixed"])
    qo = [rnd.choice([0, 1, 1, 1, 2, 4, rnd.randint(5, 300)]) for _ in range(n)]
    if order != "mixed":
        qo.sort(key=lambda q: (q != 1) == (order == "decodes-first"))
    kv = [0 if rnd.random() < 0.1 else rnd.randint(q, q + 3000) for q in qo]
    return qo, kv


def _mixed_tensors(qo, kv, page_size, wide=False):
    ip, ids, _ = _csr(kv, page_size, random.Random(7))
    t = [_i32(itertools.accumulate(qo, initial=0)), ip, _i32(kv)]
    return [x.long() for x in t] if wide else t, ids


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("seed", range(16))
def test_batch_split_equals_cut_batch_and_the_old_split(ext, seed):
    rnd = random.Random(seed)
    page_size = rnd.choice([1, 4, 16])
    qo, kv = _random_mixed(rnd, page_size)
    decode_ok = seed % 5 != 4
    for wide in (False, True):
        (qo_t, kv_t, lens_t), ids = _mixed_tensors(qo, kv, page_size, wide)
        got = native_cut(qo_t, kv_t, lens_t, page_size, decode_ok)
        arrays = [t.numpy().astype(np.int64) for t in (qo_t, kv_t, lens_t)]
        want = cut_batch(*arrays, page_size, decode_ok)
        assert got is not None and all(_same(x, y) for x, y in zip(got, want)), (got, want)
        # against the code before: split_batch's split and the old side tables
        split = split_batch(arrays[0], decode_ok)
        assert (got.decodes, got.prefills, got.decode_rows, got.prefill_rows) == \
            (len(split.decode), len(split.prefill), split.decode_rows, split.prefill_rows)
        assert _same(got.perm, None if split.perm is None else torch.from_numpy(split.perm))
        for side, requests in ((got.decode, split.decode), (got.prefill[1:], split.prefill)):
            indptr, old_ids, last = _old_side_table(requests, arrays[1], arrays[2], page_size, ids)
            assert np.array_equal(side[0].numpy(), indptr) and np.array_equal(side[1].numpy(), last)
            assert torch.equal(ba_mod._side_ids(side[2], ids), old_ids)
        p_qo = np.concatenate([[0], np.cumsum(np.diff(arrays[0])[split.prefill])]).astype(np.int32)
        assert np.array_equal(got.prefill[0].numpy(), p_qo)


@pytest.mark.parametrize("seed", range(24))
def test_pod_cut_equals_batch_split_its_page_ids_and_pod_work(ext, seed):
    """fij_fastcall.pod_cut (BatchAttention's repeated POD step) gives batch_split's cut, each
    side's page ids as _side_ids slices them and pod_work's sums of the two sides' tables, on
    POD's common form (decodes and chunks each one run of rows), and -1 on every other batch."""
    rnd = random.Random(seed)
    page_size = rnd.choice([1, 4, 16])
    qo, kv = _random_mixed(rnd, page_size)
    if seed % 3 == 0:  # (a POD step as an engine plans it: decodes first or last, chunks beside them)
        chunks = [rnd.randint(2, 300) for _ in range(rnd.randint(1, 4))]
        qo = [1] * rnd.randint(1, 40) + chunks
        if seed % 2:
            qo.reverse()
        kv = [q + rnd.randint(0, 3000) for q in qo]
    for wide in (False, True):
        (qo_t, kv_t, lens_t), ids = _mixed_tensors(qo, kv, page_size, wide)
        ids = torch.cat([ids, ids])[::2] if seed % 4 == 1 else ids  # (a strided kv_indices)
        got = ext.pod_cut(qo_t, kv_t, lens_t, page_size, ids)
        cut = native_cut(qo_t, kv_t, lens_t, page_size, True)
        common = cut is not None and cut.decodes > 0 and cut.perm is None and cut.decode_rows != (0, cut.rows) \
            and type(cut.decode[2]) is tuple and type(cut.prefill[3]) is tuple
        if seed % 3 == 0:
            assert common, (qo, kv)
        if not common:
            assert got == -1
            continue
        assert _same(ba_mod.BatchCut(*got[:9]), cut)
        assert torch.equal(got[9], ba_mod._side_ids(cut.decode[2], ids))
        assert torch.equal(got[10], ba_mod._side_ids(cut.prefill[3], ids))
        assert got[9].data_ptr() == ids[cut.decode[2][0]:].data_ptr()  # (views of kv_indices)
        (d_ip, d_last, _), (p_qo, p_ip, p_last, _) = cut.decode, cut.prefill
        assert got[11] == ext.pod_work(p_qo, p_ip, p_last, d_ip, d_last, None, page_size)
    assert ext.pod_cut(qo_t, kv_t, lens_t, page_size, ids.long()) == -1  # (int64 page ids: the general path)


@pytest.mark.parametrize("qo, kv, lens", [
    ([0, 1, 3], [0, 2, 3], [33, 5]),        # 33 keys on 2 pages of 16
    ([0, 1, 3], [0, 2, 3], [20, 17]),       # 17 keys on 1 page
    ([0, 2, 1], [0, 1, 2], [5, 5]),         # qo_indptr decreasing
    ([0, 1, 2], [0, 1], [5, 5]),            # kv_indptr too short
    ([1, 2, 3], [0, 1, 2], [5, 5]),         # not from 0
    ([0, 1, 2], [0, 0, 1], [3, 5]),         # keys without pages
])
def test_batch_split_leaves_bad_batches_to_the_numpy_checks(ext, qo, kv, lens):
    assert native_cut(_i32(qo), _i32(kv), _i32(lens), 16, True) is None
    ba = fij.BatchAttention(device="cpu")
    with pytest.raises(ValueError, match="kv_len_arr|qo_indptr and kv_indptr"):
        ba.plan(_i32(qo), _i32(kv), _i32(range(8)), _i32(lens), *LLAMA, HD, HD, 16)


@pytest.mark.parametrize("seed", range(6))
def test_batch_attention_plan_through_cxx_equals_the_numpy_path(ext, seed, monkeypatch):
    rnd = random.Random(50 + seed)
    qo, kv = _random_mixed(rnd, 16)
    (qo_t, kv_t, lens_t), ids = _mixed_tensors(qo, kv, 16)
    planned = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(ba_mod, "native_cut", lambda *a: None)
        ba = fij.BatchAttention(device="cpu")
        ba.plan(qo_t, kv_t, ids, lens_t, *LLAMA, HD, HD, 16, causal=True)
        mode = ba._planned[0]
        sides = {"pod": [ba._pod._prefill, ba._pod._decode], "prefill": [ba._prefill], "decode": [ba._decode],
                 "serial": [ba._prefill, ba._decode]}[mode]
        buffers = [t.clone() for w in sides for t in _planned(w) if isinstance(t, torch.Tensor)]
        sched = (ba._pod._flops, ba._pod._kv_bytes, ba._pod._planned_schedule) if mode == "pod" else None
        planned.append((mode, ba._planned[3:], ba._planned[2], sched, buffers))
    (a, b) = planned
    assert (a[0], a[1], a[3]) == (b[0], b[1], b[3]) and _same(a[2], b[2])
    assert len(a[4]) == len(b[4]) and all(torch.equal(x, y) for x, y in zip(a[4], b[4]))


# --- run(): the signature and pod_run (CPU) -------------------------------------------------------
def _pod_args(q_p, kv_p, q_d, kv_d, out=None, lse=None, rows=(0, 0), want=0):
    return (q_p, kv_p, q_d, kv_d, out, out, lse, lse, *rows, want)


class _Sub(torch.Tensor):
    pass


def test_pod_signature_tells_apart_what_the_launch_depends_on(ext):
    q = torch.zeros(7, 4, 64, dtype=BF16)
    k, v = torch.zeros(5, 16, 2, 64, dtype=BF16), torch.zeros(5, 16, 2, 64, dtype=BF16)
    cache = torch.zeros(5, 2, 16, 2, 64, dtype=BF16)
    base = ext.pod_signature(*_pod_args(q, (k, v), q, (k, v)))
    assert isinstance(base, bytes)
    same = ext.pod_signature(*_pod_args(q.clone(), (k.clone(), v.clone()), q.clone(), (k, v)))
    assert same != base  # q_p is no longer q_d: the outputs are allocated apart
    assert ext.pod_signature(*_pod_args(q, (k.clone(), v), q, (k, v))) == base  # new addresses only
    others = [
        _pod_args(q[:6], (k, v), q[:6], (k, v)),                      # rows
        _pod_args(q.float(), (k, v), q.float(), (k, v)),              # dtype
        _pod_args(q, (k, v), q, cache),                               # one cache tensor
        _pod_args(q, (k, v), q, (k, v), want=1),                      # an LSE asked for
        _pod_args(q, (k, v), q, (k, v), rows=(0, 3)),                 # the sides' rows
        _pod_args(q, (k, v), q, (k, v), out=torch.zeros(7, 4, 64, dtype=BF16)),  # out given
        _pod_args(q, (k, v.transpose(1, 2).contiguous().transpose(1, 2)), q, (k, v)),  # strides
    ]
    sigs = [ext.pod_signature(*a) for a in others]
    assert all(isinstance(s, bytes) and s != base for s in sigs) and len(set(sigs)) == len(sigs)
    assert ext.pod_signature(*_pod_args(q, [k, v], q, (k, v))) is None  # a list: not the common form
    assert ext.pod_signature(*_pod_args(q, (k, v), q.as_subclass(_Sub), (k, v))) is None  # a subclass


def test_pod_run_launches_only_its_signature_on_a_cuda_device(ext):
    q = torch.zeros(7, 4, 64, dtype=BF16)
    kv = (torch.zeros(5, 16, 2, 64, dtype=BF16), torch.zeros(5, 16, 2, 64, dtype=BF16))
    sig = ext.pod_signature(*_pod_args(q, kv, q, kv))
    assert ext.pod_run(1, 1, sig, *_pod_args(q, kv, q, kv), False) == -2  # its signature, on the CPU
    assert ext.pod_run(1, 1, sig, *_pod_args(q[:5], kv, q[:5], kv), False) == -1
    assert ext.pod_run(1, 1, sig, *_pod_args(q, kv, q, list(kv)), False) == -1
    with pytest.raises(ValueError, match="null entry"):
        ext.pod_run(0, 1, sig, *_pod_args(q, kv, q, kv), False)
    with pytest.raises(TypeError, match="signature"):
        ext.pod_run(1, 1, b"short", *_pod_args(q, kv, q, kv), False)


# --- run(): which path the wrappers take (CPU, a stand-in record) ---------------------------------
class _Spy:
    """A stand-in for fij_fastcall.pod_run: records its arguments, returns `result`."""

    def __init__(self, result):
        self.result, self.calls = result, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.result


def _planned_batch_pod(causal=True):
    w = fij.BatchPODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    _plan_pod(w, ([5, 9], [40, 100], [20, 30, 3]), 16, causal, "int32")
    return w


def _record(w, spy, key):
    w._quick = pod_mod.QuickLaunch(spy, 11, torch.zeros(8, dtype=torch.uint8), 22, b"sig", key, None)


def test_batch_pod_run_takes_the_record_for_its_common_form():
    w = _planned_batch_pod()
    q_p, q_d = torch.zeros(14, 32, HD, dtype=BF16), torch.zeros(3, 32, HD, dtype=BF16)
    cache = torch.zeros(20, 2, 16, 8, HD, dtype=BF16)
    outs = tuple(torch.zeros(1) for _ in range(4))
    spy = _Spy(outs)
    _record(w, spy, True)
    assert w.run(q_p, cache, q_d, cache, causal_p=True) == outs[:2]
    assert w.run(q_p, cache, q_d, cache, causal_p=True, return_lse=True) == (outs[:2], outs[2:])
    assert spy.calls[0] == (11, 22, b"sig", q_p, cache, q_d, cache, None, None, None, None, 0, 0, 0, w._pdl)
    assert spy.calls[1][13] == 3  # both LSEs asked for
    # not its form or key: the op path (which on CPU tensors stops at the device check)
    for kwargs in (dict(causal_p=False), dict(causal_p=True, k_scale=2.0),
                   dict(causal_p=True, packed_custom_mask_p=torch.zeros(1, dtype=torch.uint8))):
        spy = _Spy(outs)
        _record(w, spy, True)
        with pytest.raises(ValueError):
            w.run(q_p, cache, q_d, cache, **kwargs)
        assert not spy.calls, kwargs


@pytest.mark.parametrize("code, error", [(-1, ValueError), (-2, ValueError), (-3, ValueError)])
def test_a_refused_record_falls_back_to_the_op(code, error):
    """-1: not the signature, -2: not on a CUDA device, -3: the stream captures a graph."""
    w = _planned_batch_pod()
    q_p, q_d = torch.zeros(14, 32, HD, dtype=BF16), torch.zeros(3, 32, HD, dtype=BF16)
    cache = torch.zeros(20, 2, 16, 8, HD, dtype=BF16)
    spy = _Spy(code)
    _record(w, spy, True)
    with pytest.raises(error, match="CUDA"):  # the op path's checks ran
        w.run(q_p, cache, q_d, cache, causal_p=True)
    assert len(spy.calls) == 1


def test_a_launch_error_of_the_record_is_raised(monkeypatch):
    w = _planned_batch_pod()
    monkeypatch.setattr(pod_mod, "launch_failed", lambda spec, family, code: RuntimeError(f"{family} {code}"))
    _record(w, _Spy(700), True)
    cache = torch.zeros(20, 2, 16, 8, HD, dtype=BF16)
    with pytest.raises(RuntimeError, match="pod 700"):
        w.run(torch.zeros(14, 32, HD, dtype=BF16), cache, torch.zeros(3, 32, HD, dtype=BF16), cache, causal_p=True)


def test_plans_and_pinned_schedules_drop_the_record():
    w = _planned_batch_pod()
    for drop in (lambda: setattr(w, "force_decode_share", 0.5), lambda: setattr(w, "force_decode_sms", 4),
                 lambda: _plan_pod(w, ([5], [40], [20]), 16, True, "int32"),
                 lambda: w._plan_prefill(False, None, None)):
        _record(w, _Spy(-1), True)
        drop()
        assert w._quick is None
    assert (w.force_decode_share, w.force_decode_sms) == (0.5, 4)


def test_single_pod_run_takes_the_record_for_its_key():
    w = fij.PODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    ip, ids, last = _csr([20, 30, 3], 16)
    w.plan(ip, ids, last, *LLAMA, HD, 16, q_data_type=BF16)
    q_p, k_p, v_p = torch.zeros(9, 32, HD, dtype=BF16), torch.zeros(30, 8, HD, dtype=BF16), \
        torch.zeros(30, 8, HD, dtype=BF16)
    q_d, cache = torch.zeros(3, 32, HD, dtype=BF16), torch.zeros(6, 2, 16, 8, HD, dtype=BF16)
    outs = tuple(torch.zeros(1) for _ in range(4))
    spy = _Spy(outs)
    _record(w, spy, (True, None, -1, "NHD"))
    assert w.run(q_p, k_p, v_p, q_d, cache, causal_p=True, return_lse_d=True) == (outs[:2], outs[2:])
    args = spy.calls[0]
    assert args[3] is q_p and args[4] == (k_p, v_p) and args[5] is q_d and args[13] == 2
    for kwargs in (dict(causal_p=False), dict(causal_p=True, sm_scale_p=0.1), dict(causal_p=True, kv_layout_p="HND"),
                   dict(causal_p=True, v_scale=2.0)):
        spy = _Spy(outs)
        _record(w, spy, (True, None, -1, "NHD"))
        with pytest.raises(ValueError):
            w.run(q_p, k_p, v_p, q_d, cache, **kwargs)
        assert not spy.calls, kwargs


@pytest.mark.parametrize("qo_lens, taken", [([1, 1, 5], True), ([5, 1, 1], True), ([1, 5, 1], False)],
                         ids=["decodes-first", "decodes-last", "interleaved"])
def test_batch_attention_run_takes_the_record_where_both_sides_are_runs(qo_lens, taken):
    ba = fij.BatchAttention(device="cpu")
    kv = [20, 40, 3]
    (qo_t, kv_t, lens_t), ids = _mixed_tensors(qo_lens, kv, 16)
    ba.plan(qo_t, kv_t, ids, lens_t, *LLAMA, HD, HD, 16, causal=True)
    assert ba._planned[0] == "pod"
    q, cache = torch.zeros(7, 32, HD, dtype=BF16), torch.zeros(8, 2, 16, 8, HD, dtype=BF16)
    outs = tuple(torch.zeros(1) for _ in range(4))
    spy = _Spy(outs)
    _record(ba._pod, spy, None)
    if taken:
        assert ba.run(q, cache) == (outs[0], outs[2])
        _, (d0, _), (p0, _) = ba._planned[10:13]
        assert spy.calls[0][3:] == (q, cache, q, cache, None, None, None, None, p0, d0, 3, ba._pod._pdl)
    else:  # the gather and scatter: the op path
        with pytest.raises(ValueError, match="CUDA"):
            ba.run(q, cache)
        assert not spy.calls
    with pytest.raises(ValueError):  # scales: the op path
        ba.run(q, cache, k_scale=2.0)
    assert len(spy.calls) == int(taken)


def test_the_record_is_never_taken_under_torch_compile(monkeypatch):
    """Dynamo traces run() to the op (test_torch_compile.py's stand-ins): a record left on the
    wrapper is not called."""
    from test_torch_compile import _explain_and_compile, _stand_in_library, _NS
    from flashinfer_jit.runtime.checks import constant_result

    _stand_in_library()
    monkeypatch.setattr(pod_mod, "_pod_namespace", constant_result(lambda *a: _NS))
    import flashinfer_jit.decode.wrapper as dw
    import flashinfer_jit.prefill.wrapper as pw
    monkeypatch.setattr(dw, "traced_namespace", constant_result(lambda *a: _NS))
    monkeypatch.setattr(pw, "traced_namespace", constant_result(lambda *a: _NS))
    w = _planned_batch_pod()
    spy = _Spy(-1)
    _record(w, spy, True)
    q_p, q_d = torch.randn(14, 32, HD).to(BF16), torch.randn(3, 32, HD).to(BF16)
    k, v = (torch.randn(20, 16, 8, HD).to(BF16) for _ in range(2))

    def step(q_p, q_d, k, v):
        return w.run(q_p, (k, v), q_d, (k, v), causal_p=True)

    graphs, compiled = _explain_and_compile(step, q_p, q_d, k, v)
    out_p, out_d = compiled(q_p, q_d, k, v)
    assert torch.equal(out_p, q_p * 2) and torch.equal(out_d, q_d * 3) and not spy.calls


# --- the first run() after a plan(): the record kept (_replan_bounds) and fij_fastcall.pod_rerun -----
class _FakeExtension:
    """fastcall.extension() with pod_rerun replaced by a spy."""

    def __init__(self, real, rerun):
        self._real, self.pod_rerun = real, rerun

    def __getattr__(self, name):
        return getattr(self._real, name)


def _hopper_wrapper(monkeypatch, rnd, causal=True):
    """A batch POD wrapper planned on POD on Hopper on the CPU (the arch check skipped, the
    relaunch entry a stand-in address 99)."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    w = fij.BatchPODWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    w.prefill_backend = "auto"
    w.plan(*_hopper_batch(rnd, 16, "common"), *LLAMA, HD, 16, q_data_type=BF16, causal=causal)
    assert w._prefill.planned_backend == "fa3"
    w._sm90_relaunch = 99  # (a CPU workspace looks none up)
    return w


def _hopper_record(w, spy=None, key=True):
    w._quick = pod_mod.QuickLaunch(spy or _Spy(-1), 11, torch.zeros(8, dtype=torch.uint8), 22, b"sig", key,
                                   w._sm90_spec, (w._prefill._plan.config, w._decode._plan.config))


def test_a_plan_of_the_recorded_configuration_keeps_the_hopper_record(ext, monkeypatch):
    """POD on Hopper's record outlives a plan() of its module and both sides' configurations:
    the plan leaves it with the new plan's op arguments (as _run_sm90 passes them) and its
    bounds on q's rows; anything else drops it: another mask (another module), another option
    (another configuration), a pinned split, the mma.sync POD's record, a CUDA-graph wrapper."""
    rnd = random.Random(41)
    w = _hopper_wrapper(monkeypatch, rnd)
    for step in range(3):  # (new lengths each step, the record kept: recipe and full plans alike)
        _hopper_record(w)
        tables = _hopper_batch(rnd, 16, "common" if step != 1 else "long")
        w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, causal=True)
        assert w._quick is not None and w._replan_bounds is not None, step
        plan, bounds = w._replan_args, w._replan_bounds  # (gathered by plan(), for the next run())
        assert all(a is b or a == b for a, b in zip(plan, w._relaunch_plan()))
        p, d = w._prefill._plan, w._decode._plan
        assert bounds == (p.qo_tokens, 1 << 62, d.batch, d.batch)
        assert plan[0] is p.work and plan[1] is p.page_ids and plan[3] == tuple(d.args[0]) and plan[4] is d.args[1]
        assert plan[9] is d.args[10] and plan[10] is w._counters and plan[19] == w._sm90_blocks
        assert plan[11] == p.config.logit_scale and plan[13] == d.config.logit_scale and plan[17] == d.args[8]
        assert len(plan) == 20 and w._quick.signature == b"sig"
        # (what pod_rerun reads as tensors is one: items 0-2, 4-8 and 10; 9 a tensor or None)
        assert all(isinstance(plan[i], torch.Tensor) for i in (0, 1, 2, 4, 5, 6, 7, 8, 10)), step
        assert plan[9] is None or isinstance(plan[9], torch.Tensor)
        assert all(isinstance(t, torch.Tensor) for t in plan[3])
    w.force_prefill_blocks = 7
    _hopper_record(w)
    w.plan(*_hopper_batch(rnd, 16, "common"), *LLAMA, HD, 16, q_data_type=BF16, causal=True)
    assert w._replan_bounds is not None and w._replan_args[19] == 7  # (a pinned split: in the plan's arguments)
    w.force_prefill_blocks = None
    tables = _hopper_batch(rnd, 16, "common")
    for change in (dict(causal=False), dict(causal=True, sm_scale=0.1), dict(causal=True, window_left=100)):
        _hopper_record(w)
        w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, **change)
        assert w._quick is None, change
    w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, causal=True)
    _hopper_record(w)
    w._quick = w._quick._replace(configs=None)  # (the mma.sync POD's record: no configurations)
    w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, causal=True)
    assert w._quick is None and w._replan_bounds is None
    _hopper_record(w)
    w._sm90_relaunch = None  # (no relaunch entry: the debug mode, no extension)
    w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, causal=True)
    assert w._quick is None and w._replan_bounds is None
    w._sm90_relaunch = 99
    _hopper_record(w)
    w.force_prefill_blocks = 3  # (a pin after the plan: dropped, as every pin drops it)
    assert w._quick is None


def test_the_first_run_after_a_plan_takes_pod_rerun(ext, monkeypatch):
    """The run() after a plan() hands the kept record, the plan's arguments and bounds and the
    call's tensors to fij_fastcall.pod_rerun; its result is returned and the record takes its
    signature (the next run() goes through pod_run). Refused (-1, -3), the op path runs."""
    rnd = random.Random(43)
    w = _hopper_wrapper(monkeypatch, rnd)
    outs = tuple(torch.zeros(1) for _ in range(4))
    reruns = _Spy(outs + (b"new",))
    monkeypatch.setattr(fastcall, "extension", lambda: _FakeExtension(ext, reruns))
    _hopper_record(w)
    tables = _hopper_batch(rnd, 16, "common")
    w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, causal=True)
    rows = w._prefill._plan.qo_tokens
    q_p, q_d = torch.zeros(rows, 32, HD, dtype=BF16), torch.zeros(w._decode._plan.batch, 32, HD, dtype=BF16)
    cache = torch.zeros(20, 2, 16, 8, HD, dtype=BF16)
    plan, bounds = w._replan_args, w._replan_bounds
    assert w.run(q_p, cache, q_d, cache, causal_p=True, return_lse=True) == (outs[:2], outs[2:])
    assert reruns.calls[0][:3] == (99, 22, b"sig") and reruns.calls[0][4:] == (
        bounds, (-1, -1), q_p, cache, q_d, cache, None, None, None, None, 0, 0, 3)
    assert all(a is b or a == b for a, b in zip(reruns.calls[0][3], plan))  # (the plan's op arguments, at run())
    assert w._replan_bounds is None and w._quick.signature == b"new"
    w._quick = w._quick._replace(run=_Spy(outs))  # (the next run(): pod_run)
    assert w.run(q_p, cache, q_d, cache, causal_p=True) == outs[:2] and len(reruns.calls) == 1
    for code in (-1, -3):  # refused: the op path (on CPU tensors it stops at the device check)
        _hopper_record(w)
        w.plan(*tables, *LLAMA, HD, 16, q_data_type=BF16, causal=True)
        refused = _Spy(code)
        monkeypatch.setattr(fastcall, "extension", lambda: _FakeExtension(ext, refused))
        with pytest.raises(ValueError, match="CUDA"):
            w.run(q_p, cache, q_d, cache, causal_p=True)
        assert len(refused.calls) == 1 and w._replan_bounds is not None


def test_batch_attention_passes_its_rows_to_pod_rerun(ext, monkeypatch):
    """BatchAttention's run() after a plan(): each side's offset and row count in the mixed q,
    and the mixed batch's token count as the bound on q's rows."""
    from flashinfer_jit.prefill import sm90
    monkeypatch.setattr(sm90, "arch_error", lambda device: None)
    ba = fij.BatchAttention(device="cpu")
    ba.prefill_backend = "auto"
    qo, kv = [1] * 30 + [700, 400], [rnd_len for rnd_len in range(100, 3100, 100)][:30] + [900, 1500]
    (qo_t, kv_t, lens_t), ids = _mixed_tensors(qo, kv, 16)
    ba.plan(qo_t, kv_t, ids, lens_t, *LLAMA, HD, HD, 16, causal=True)
    assert ba._planned[0] == "pod" and ba._pod._prefill.planned_backend == "fa3"
    ba._pod._sm90_relaunch = 99  # (a CPU workspace looks none up)
    _hopper_record(ba._pod, key=None)
    ba.plan(qo_t, kv_t, ids, lens_t, *LLAMA, HD, HD, 16, causal=True)
    assert ba._pod._quick is not None and ba._pod._replan_bounds is not None
    outs = tuple(torch.zeros(1) for _ in range(4))
    reruns = _Spy(outs + (b"new",))
    monkeypatch.setattr(fastcall, "extension", lambda: _FakeExtension(ext, reruns))
    tokens = sum(qo)
    q, cache = torch.zeros(tokens, 32, HD, dtype=BF16), torch.zeros(200, 2, 16, 8, HD, dtype=BF16)
    assert ba.run(q, cache) == (outs[0], outs[2])
    (d0, d1), (p0, p1) = ba._planned[11:13]
    args = reruns.calls[0]
    assert args[4] == (tokens,) * 4 and args[5] == (p1 - p0, d1 - d0)
    assert args[6:] == (q, cache, q, cache, None, None, None, None, p0, d0, 3)


# --- GPU: the recorded launch against the op and the references ----------------------------------
def _spy_record(w):
    """Wrap the wrapper's record so the test sees each fast call's result."""
    results = []
    run = w._quick.run

    def spy(*args):
        results.append(run(*args))
        return results[-1]

    w._quick = w._quick._replace(run=spy)
    return results


def _host_batch(page_size=16, seed=5, shared=True, qo_lens=(7, 300, 1), kv_lens=(500, 300, 2048), decodes=9,
                num_pages=None):
    """Prefill requests (qo 7, 300, 1 over kv 500, 300, 2048 unless given) and 9 decodes (unless
    given), host indptr / last_page_len (plan()'s common form), page ids on the GPU; one cache or
    two (of num_pages pages: an engine's cache keeps its shape from step to step; default
    just enough)."""
    rnd, gen = random.Random(seed), torch.Generator(device=DEV).manual_seed(seed)
    qo_lens, kv_lens = list(qo_lens), list(kv_lens)
    lens_d = [rnd.randint(1, 1500) for _ in range(decodes)]
    pages_p, pages_d = (sum(-(-n // page_size) for n in lens) for lens in (kv_lens, lens_d))
    assert num_pages is None or num_pages >= pages_p + pages_d
    num_pages = num_pages or pages_p + pages_d + 5
    ids = rnd.sample(range(num_pages), num_pages)
    table_p, table_d = csr_table(kv_lens, page_size, ids[:pages_p]), csr_table(lens_d, page_size, ids[pages_p:])
    cache_p = make_cache(num_pages, page_size, LLAMA[1], HD, BF16, gen, single=shared)
    cache_d = cache_p if shared else make_cache(num_pages, page_size, LLAMA[1], HD, BF16, gen)
    nan_outside(cache_p, page_size, [table_p, table_d] if shared else [table_p])
    if not shared:
        nan_outside(cache_d, page_size, [table_d])
    qo_indptr = _i32(itertools.accumulate(qo_lens, initial=0))
    q_p = randn((sum(qo_lens), LLAMA[0], HD), BF16, gen)
    dec = Decode(randn((len(lens_d), LLAMA[0], HD), BF16, gen), cache_d, table_d)
    host = lambda t: (t[0].cpu(), t[1], t[2].cpu())  # noqa: E731
    plan_args = (qo_indptr, *host(table_p.plan_args), torch.arange(decodes + 1, dtype=torch.int32),
                 *host(table_d.plan_args))
    return plan_args, q_p, cache_p, dec, table_p, qo_indptr


def _backend(w, backend: str) -> None:
    """The POD wrapper's prefill_backend: "fa2" (the mma.sync POD) or "fa3" (POD on Hopper,
    whose module records PodSm90Launch; sm_90 only)."""
    if backend == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("POD on Hopper runs on sm_90")
    w.prefill_backend = backend


def _planned_as(w, backend: str) -> None:
    assert w._prefill.planned_backend == backend


# (every GPU case for both POD kernels: the mma.sync POD's PodLaunch and POD on Hopper's PodSm90Launch)
BACKENDS = pytest.mark.parametrize("backend", ["fa2", "fa3"], ids=["mma", "hopper"])


@pytest.mark.gpu
@BACKENDS
@pytest.mark.parametrize("causal, return_lse, shared", [(True, False, True), (False, True, False)],
                         ids=["causal-one-cache", "lse-two-caches"])
def test_gpu_batch_pod_fast_path_equals_the_op_and_the_reference(causal, return_lse, shared, backend, workspace):
    plan_args, q_p, cache_p, dec, table_p, qo_indptr = _host_batch(shared=shared)
    w = fij.BatchPODWithPagedKVCacheWrapper(workspace, "NHD")
    _backend(w, backend)
    w.plan(*plan_args, *LLAMA, HD, 16, q_data_type=BF16, causal=causal)
    _planned_as(w, backend)

    def call():
        _poison_allocator(q_p, dec.q)
        got = unpack(w.run(q_p, cache_p.run_arg, dec.q, dec.cache.run_arg, causal_p=causal, return_lse=return_lse),
                     return_lse, return_lse)
        torch.cuda.synchronize()
        return [t.clone() if t is not None else None for t in got]

    by_op = call()
    assert w._quick is not None, "the op recorded no launch"
    results = _spy_record(w)
    fast = call()
    assert results and type(results[-1]) is tuple, f"the fast path was not taken: {results}"
    for a, b in zip(by_op, fast):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    ref_p = prefill_ref(q_p, qo_indptr.to(DEV), cache_p.k, cache_p.v, page_table=table_p.table, causal=causal)
    check_pod(fast, ref_p, decode_reference(dec), BF16)
    # another signature (the other LSE request): refused (-1), the op runs and records it
    recorded = w._quick.signature
    other = unpack(w.run(q_p, cache_p.run_arg, dec.q, dec.cache.run_arg, causal_p=causal,
                         return_lse=not return_lse), not return_lse, not return_lse)
    torch.cuda.synchronize()
    assert results[-1] == -1 and w._quick.signature != recorded
    assert torch.equal(other[0], by_op[0]) and torch.equal(other[1], by_op[1])


@pytest.mark.gpu
def test_gpu_repeated_plans_equal_the_reference(workspace):
    """POD on Hopper planned step after step by one wrapper (each step's batch and cache new):
    from the second step plan() replans from its recipe (_replan), and each step's run(),
    through the op and then through its recorded launch, equals the float64 references."""
    w = fij.BatchPODWithPagedKVCacheWrapper(workspace, "NHD")
    _backend(w, "fa3")
    replans = []
    original = w._replan
    w._replan = lambda *a: replans.append(original(*a)) or replans[-1]
    for step, causal in enumerate((True, True, True, False, False)):
        plan_args, q_p, cache_p, dec, table_p, qo_indptr = _host_batch(seed=20 + step)
        w.plan(*plan_args, *LLAMA, HD, 16, q_data_type=BF16, causal=causal)
        _planned_as(w, "fa3")
        ref_p = prefill_ref(q_p, qo_indptr.to(DEV), cache_p.k, cache_p.v, page_table=table_p.table, causal=causal)
        for _ in range(2):  # (the op, then the launch it recorded)
            _poison_allocator(q_p, dec.q)
            got = unpack(w.run(q_p, cache_p.run_arg, dec.q, dec.cache.run_arg, causal_p=causal, return_lse=True),
                         True, True)
            torch.cuda.synchronize()
            check_pod(got, ref_p, decode_reference(dec), BF16)
    assert replans == [True, True, True], replans


def _ba_run(ba, q, cache, given: bool) -> tuple:
    """BatchAttention.run() with out / lse given (filled with NaN first: written in place) or
    allocated (the caching allocator's blocks poisoned first); synchronized."""
    if given:
        out = torch.full((q.shape[0], LLAMA[0], HD), float("nan"), dtype=BF16, device=DEV)
        lse = torch.full((q.shape[0], LLAMA[0]), float("nan"), device=DEV)
        got = ba.run(q, cache.run_arg, out=out, lse=lse)
        assert got[0] is out and got[1] is lse
    else:
        _poison_allocator(q)
        got = ba.run(q, cache.run_arg)
    torch.cuda.synchronize()
    return got


def _spy_reruns(monkeypatch):
    """fij_fastcall.pod_rerun wrapped: the test sees each call's result (a tuple: launched)."""
    real = fastcall.extension()
    results = []

    def rerun(*args):
        results.append(real.pod_rerun(*args))
        return results[-1]
    monkeypatch.setattr(fastcall, "extension", lambda: _FakeExtension(real, rerun))
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("prepared", [True, False])
def test_gpu_the_first_run_after_each_plan_equals_the_reference(workspace, monkeypatch, prepared):
    """An engine's steps on POD on Hopper: each plan() of new lengths (other prefill chunks,
    another decode count, so q's rows change) keeps the record and resolves the next run()'s
    launch for the plan's rows (pod_prepare), which that run() takes through pod_run (no
    pod_rerun, no op call); without the plan's resolution (prepared False), or for a q_p of
    more rows than the plan's tokens (one step), the run() resolves and launches through
    pod_rerun. Its results, and those of the next run() through pod_run, equal the float64
    references. A q with the old step's rows is refused and the op path raises its error."""
    if not prepared:
        monkeypatch.setattr(pod_mod.BatchPODWithPagedKVCacheWrapper, "_prepare_first_run", lambda self, *a: None)
    w = fij.BatchPODWithPagedKVCacheWrapper(workspace, "NHD")
    _backend(w, "fa3")
    reruns = _spy_reruns(monkeypatch)
    ops = []
    steps = [((7, 300, 1), (500, 300, 2048), 9), ((129, 64), (700, 64), 33), ((5,), (1300,), 1),
             ((300, 2, 250), (900, 2, 2000), 17), ((16,), (16,), 12), ((64,), (4000,), 1)]
    prev = None
    for step, (qo_lens, kv_lens, decodes) in enumerate(steps):
        plan_args, q_p, cache_p, dec, table_p, qo_indptr = _host_batch(seed=60 + step, qo_lens=qo_lens,
                                                                        kv_lens=kv_lens, decodes=decodes,
                                                                        num_pages=3400)
        w.plan(*plan_args, *LLAMA, HD, 16, q_data_type=BF16, causal=True)
        _planned_as(w, "fa3")
        if step == 0:  # (one module for every step: the plan keeps its op, which the test counts)
            real_op = w._sm90_op
            w._sm90_op = lambda *a: ops.append(step) or real_op(*a)
        kept = w._quick is not None and w._replan_bounds is not None
        if prev is not None and step > 0:
            assert kept, f"step {step}: the plan dropped the record"
            assert w._run_prepared == prepared, step
            with pytest.raises(ValueError):  # (the last step's q: refused, the op path's row check)
                w.run(prev[0], cache_p.run_arg, prev[1], dec.cache.run_arg, causal_p=True)
        ref_p = prefill_ref(q_p, qo_indptr.to(DEV), cache_p.k, cache_p.v, page_table=table_p.table, causal=True)
        tokens = q_p.shape[0]
        padded = prepared and step == 3  # (q_p of more rows than the plan's: pod_rerun takes them)
        q_call = torch.cat([q_p, randn((5, *q_p.shape[1:]), BF16, torch.Generator(device=DEV))]) if padded else q_p
        for call in range(2):  # (after the plan: its prepared launch or pod_rerun from the second step; then pod_run)
            before, op_calls = len(reruns), len(ops)
            _poison_allocator(q_call, dec.q)
            got = unpack(w.run(q_call, cache_p.run_arg, dec.q, dec.cache.run_arg, causal_p=True, return_lse=True),
                         True, True)
            torch.cuda.synchronize()
            if step > 0 and call == 0:
                if prepared and not padded:
                    assert len(reruns) == before and w._replan_bounds is None, (step, reruns[before:])
                else:
                    assert len(reruns) > before and type(reruns[-1]) is tuple, (step, reruns[before:])
                assert len(ops) == op_calls, f"step {step}: the op ran"
            check_pod((got[0][:tokens], got[1], got[2][:tokens], got[3]), ref_p, decode_reference(dec), BF16)
        prev = (q_p, dec.q)
    expected = 1 if prepared else len(steps) - 1
    assert sum(type(r) is tuple for r in reruns) == expected and ops == [0], (reruns, ops)


@pytest.mark.gpu
@pytest.mark.parametrize("prepared", [True, False])
def test_gpu_batch_attention_first_run_after_each_plan_equals_the_reference(monkeypatch, prepared):
    """BatchAttention's mixed batches step after step (decodes first or last, other counts and
    chunks): the run() after each plan() takes the launch plan() resolved for its rows in the
    mixed q (pod_prepare, through pod_run), or without it (prepared False) goes through
    pod_rerun, and equals the float64 reference; outputs allocated for three steps, then given
    (in place) for three: the first given step is another form of call (out / lse tensors
    where the record had none), which both refuse and the op runs and records."""
    if not prepared:
        monkeypatch.setattr(pod_mod.BatchPODWithPagedKVCacheWrapper, "_prepare_first_run", lambda self, *a: None)
    ba = fij.BatchAttention(device=DEV)
    _backend(ba, "fa3")
    reruns = _spy_reruns(monkeypatch)
    rnd, gen = random.Random(71), torch.Generator(device=DEV).manual_seed(71)
    taken = []
    for step in range(6):
        chunks = [rnd.randint(100, 600) for _ in range(rnd.randint(1, 3))]
        qo = [1] * rnd.randint(8, 60) + chunks
        if step % 2:
            qo = qo[len(qo) - len(chunks):] + qo[:len(qo) - len(chunks)]
        kv = [rnd.randint(1, 500) if n == 1 else n + rnd.randint(0, 900) for n in qo]
        (qo_t, kv_t, lens_t), ids = _mixed_tensors(qo, kv, 16)
        ids = ids.to(DEV)
        assert int(kv_t[-1]) <= 2600
        cache = make_cache(2600, 16, LLAMA[1], HD, BF16, gen, single=True)  # (one shape every step)
        ba.plan(qo_t, kv_t, ids, lens_t, *LLAMA, HD, HD, 16, causal=True, q_data_type=BF16, kv_data_type=BF16)
        assert ba._planned[0] == "pod"
        _planned_as(ba._pod, "fa3")
        q = randn((sum(qo), LLAMA[0], HD), BF16, gen)
        before, was_prepared = len(reruns), ba._pod._run_prepared
        got = _ba_run(ba, q, cache, step >= 3)
        if step > 0 and prepared:  # (the prepared launch: no pod_rerun unless it refused the call)
            assert was_prepared, step
            taken.append(len(reruns) == before and ba._pod._replan_bounds is None)
        elif step > 0:
            assert len(reruns) == before + 1, (step, reruns[before:])
            taken.append(type(reruns[-1]) is tuple)
        ref = prefill_ref(q, qo_t.to(DEV), cache.k, cache.v, page_table=csr_page_table(kv_t.to(DEV), ids,
                          _csr(kv, 16)[2].to(DEV)), causal=True)
        check_out(got[0], ref[0], TOL[BF16], "out")
        check_lse(got[1], ref[1], "lse")
    assert taken == [True, True, False, True, True], (taken, reruns)


@pytest.mark.gpu
@BACKENDS
def test_gpu_single_pod_fast_path_equals_the_op_and_the_reference(backend, workspace):
    rnd, gen = random.Random(3), torch.Generator(device=DEV).manual_seed(3)
    lens = [rnd.randint(1, 1000) for _ in range(17)]
    num_pages = sum(-(-n // 16) for n in lens) + 4
    table = csr_table(lens, 16, rnd.sample(range(num_pages), num_pages))
    cache = make_cache(num_pages, 16, LLAMA[1], HD, BF16, gen)
    nan_outside(cache, 16, [table])
    dec = Decode(randn((17, LLAMA[0], HD), BF16, gen), cache, table)
    q_p, k_p, v_p = make_prefill(127, 700, LLAMA, HD, BF16, gen)
    w = fij.PODWithPagedKVCacheWrapper(workspace, "NHD")
    _backend(w, backend)
    w.plan(table.plan_args[0].cpu(), table.plan_args[1], table.plan_args[2].cpu(), *LLAMA, HD, 16, q_data_type=BF16)

    def call():
        _poison_allocator(q_p, dec.q)
        got = unpack(w.run(q_p, k_p, v_p, dec.q, cache.run_arg, causal_p=True, return_lse_p=True), True, False)
        torch.cuda.synchronize()
        return [t.clone() if t is not None else None for t in got]

    by_op = call()
    _planned_as(w, backend)
    results = _spy_record(w)
    fast = call()
    assert results and type(results[-1]) is tuple
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(by_op, fast))
    check_pod(fast, prefill_reference(q_p, k_p, v_p, causal=True), decode_reference(dec), BF16)


@pytest.mark.gpu
@BACKENDS
@pytest.mark.parametrize("given", [False, True], ids=["allocated", "in-place"])
@pytest.mark.parametrize("decodes_first", [True, False], ids=["decodes-first", "decodes-last"])
def test_gpu_batch_attention_fast_path_equals_the_op_and_the_reference(given, decodes_first, backend):
    rnd, gen = random.Random(11), torch.Generator(device=DEV).manual_seed(11)
    qo = [1] * 40 + [300, 17]
    if not decodes_first:
        qo = qo[40:] + qo[:40]
    kv = [rnd.randint(1, 2000) if n == 1 else n + rnd.randint(0, 900) for n in qo]
    (qo_t, kv_t, lens_t), ids = _mixed_tensors(qo, kv, 16)
    ids = ids.to(DEV)
    cache = make_cache(int(kv_t[-1]) + 3, 16, LLAMA[1], HD, BF16, gen, single=True)
    ba = fij.BatchAttention(device=DEV)
    _backend(ba, backend)
    ba.plan(qo_t, kv_t, ids, lens_t, *LLAMA, HD, HD, 16, causal=True, q_data_type=BF16, kv_data_type=BF16)
    assert ba._planned[0] == "pod"
    _planned_as(ba._pod, backend)
    q = randn((sum(qo), LLAMA[0], HD), BF16, gen)

    def call():
        return [t.clone() for t in _ba_run(ba, q, cache, given)]

    by_op = call()
    results = _spy_record(ba._pod)
    fast = call()
    assert results and type(results[-1]) is tuple, f"the fast path was not taken: {results}"
    assert torch.equal(by_op[0], fast[0]) and torch.equal(by_op[1], fast[1])
    ref = prefill_ref(q, qo_t.to(DEV), cache.k, cache.v, page_table=csr_page_table(kv_t.to(DEV), ids,
                      _csr(kv, 16)[2].to(DEV)), causal=True)
    check_out(fast[0], ref[0], TOL[BF16], "out")
    check_lse(fast[1], ref[1], "lse")


@pytest.mark.gpu
@BACKENDS
def test_gpu_capture_takes_the_op_and_replays(backend, workspace):
    """A recorded launch is refused while the stream captures a CUDA graph (FIJ_FAST_CAPTURING):
    the op is captured, and the replay gives the op's results."""
    plan_args, q_p, cache_p, dec, table_p, qo_indptr = _host_batch()
    w = fij.BatchPODWithPagedKVCacheWrapper(workspace, "NHD")
    _backend(w, backend)
    w.plan(*plan_args, *LLAMA, HD, 16, q_data_type=BF16, causal=True)
    _planned_as(w, backend)
    by_op = [t.clone() for t in w.run(q_p, cache_p.run_arg, dec.q, dec.cache.run_arg, causal_p=True)]
    results = _spy_record(w)
    from kv_helpers import capture_graph
    graph, outs = capture_graph(lambda: w.run(q_p, cache_p.run_arg, dec.q, dec.cache.run_arg, causal_p=True))
    assert -3 in results, f"the entry launched during capture: {results}"
    for t in outs:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs[0], by_op[0]) and torch.equal(outs[1], by_op[1])


def test_sm90_prefill_blocks_split():
    """POD on Hopper's split: every SM to the side that alone has work; else the SMs on which
    the prefill ends as the decodes end (SMs x t_p / t_d), at most 0.45 of them, at least one
    a side."""
    from flashinfer_jit.pod import wrapper as pw

    rate_p, rate_d = pw._SM90_PREFILL_FLOPS_PER_S, pw._DECODE_BYTES_PER_S
    assert pw.sm90_prefill_blocks(1e12, 0.0, 132) == 132
    assert pw.sm90_prefill_blocks(0.0, 1e9, 132) == 0
    # t_p / t_d = 0.3: 40 of 132 SMs; 0.6 and 3.0: the cap, 59
    assert pw.sm90_prefill_blocks(0.3 * rate_p, rate_d, 132) == 40
    assert pw.sm90_prefill_blocks(0.6 * rate_p, rate_d, 132) == 59
    assert pw.sm90_prefill_blocks(3.0 * rate_p, rate_d, 132) == 59
    assert pw.sm90_prefill_blocks(1e-6 * rate_p, rate_d, 132) == 1  # a tiny prefill: one SM
    assert pw.sm90_prefill_blocks(0.5 * rate_p, rate_d, 2) == 1  # two SMs: one a side
    for sms in (2, 3, 78, 114, 132):
        for ratio in (1e-3, 0.1, 0.5, 1.0, 10.0):
            blocks = pw.sm90_prefill_blocks(ratio * rate_p, rate_d, sms)
            assert 1 <= blocks <= sms - 1

"""The host side of batch decode (flashinfer_jit/decode/wrapper.py), on the CPU: no GPU; one build,
the C++ planner module (DecodePlanSpec, host code only) that plan() calls.

The op is replaced by a recorder (and, on CPU tensors, the CUDA-device check by a
same-device one), so each test sees exactly what run() would hand the kernel:
  - plan()'s work list, merge index, page-table arrays, grid size and merge rows equal
    those of the straightforward implementation it replaced (plan_split_reference and
    expected_op_args below, written as that code computed them), for uniform, skewed
    and empty batches, every page-table layout, fixed_split_size, disable_split_kv and
    CUDA-graph padding, across consecutive plans that reuse buffers and views;
  - plan() through the C++ planner ships the same buffer and launch as through its numpy
    path, which the tests above also check against the references;
  - plan() copies to the device once (twice in CUDA-graph mode, where the page ids go
    into the fixed buffer, unless they already are it);
  - run()'s fast path (the checks skipped for a q and cache like the last that passed)
    raises exactly the errors of a fresh wrapper for bad inputs, after a successful call.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import random

import numpy as np
import pytest
import torch

import flashinfer_jit as fij
from flashinfer_jit.decode import wrapper as decode
from flashinfer_jit.decode.spec import group_tile, uses_tensor_cores
from flashinfer_jit.pipeline.jit import get_module
from flashinfer_jit.reference.decode import ordered_pages_ref
from flashinfer_jit.runtime import fastcall
from flashinfer_jit.runtime.page_table import csr_page_table
from flashinfer_jit.runtime.shared_specs import PageOrderSpec

HQ, HK, D, PS = 32, 8, 128, 16
WORKSPACE_BYTES = 1 << 20
CPU_SMS = 132  # plan()'s SM count without a CUDA device


def cpu_target_blocks(hq: int, hk: int, d: int, rope: bool = False) -> int:
    """plan()'s split target: 2 blocks per SM for the tensor-core kernel (head_dim <= 128,
    tiles of 1 to 8 heads), 3 for its 16-head tiles and for the CUDA-core kernel."""
    return (2 if _two_per_sm(hq, hk, d, rope) else 3) * CPU_SMS


def _two_per_sm(hq: int, hk: int, d: int, rope: bool = False) -> bool:
    return group_tile(hq, hk, d) <= 8 and not rope and d <= 128


def skewed_target(target: int, hq: int, hk: int, d: int, rope: bool = False) -> int | None:
    """The target of a skewed batch: twice the split target where that is 2 per SM."""
    return 2 * target if _two_per_sm(hq, hk, d, rope) else None


class Recorder:
    """Stands in for the decode op: keeps the arguments of each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)

    @property
    def last(self) -> dict:
        names = ("q", "k", "v", "page_table", "work", "merge_indptr", "out", "lse", "partial_o", "partial_lse",
                 "logit_scale", "v_scale", "soft_cap", "window_left", "rope_scale", "rope_theta", "grid_items",
                 "merge_rows", "merge_counters", "enable_pdl", "prepared", "kv_heads_per_block", "cluster_size",
                 "cluster_warps")
        return dict(zip(names, self.calls[-1]))


@pytest.fixture
def op(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(decode, "module_op", lambda spec, name, debug: recorder)
    monkeypatch.setattr(decode, "fast_entry", lambda spec, family, debug: None)  # every call reaches the recorder
    monkeypatch.setattr(decode, "same_cuda_device", lambda ts: all(t.device == ts[0].device for t in ts))
    return recorder


# --- the implementation plan() replaced, as the reference --------------------------------------
def plan_split_reference(kv_lens, blocks_per_item, target_blocks, fixed_split_size, disable_split_kv,
                         max_items=None, max_partials=None, min_chunk=64, max_chunks=None, skewed_target=None,
                         full_grid=None, sms=CPU_SMS):
    """Written out longhand, one request at a time: the chunk target (skewed_target where
    a request under half a chunk stays whole while others split), round(length / chunk)
    equal chunks in whole 32-token tiles (fixed_split_size: chunks of that length),
    doubled until the capacities fit; split items longest first. full_grid (tokens, with
    skewed_target: the tensor-core kernel, as plan() sizes it): a batch that is not skewed
    and whose unsplit grid covers 70% of the SMs to under the target splits in two only
    where its longest request has >= full_grid tokens (1024 where the grid covers < 90%) and
    two chunks stay within the target, else not at all."""
    batch = len(kv_lens)
    longest = int(kv_lens.max()) if batch else 0
    auto = False
    if disable_split_kv or longest == 0:
        chunk = max(longest, 1)
    elif fixed_split_size:
        chunk = int(fixed_split_size)
    else:
        wanted = math.ceil(int(kv_lens.sum()) * blocks_per_item / target_blocks)
        skewed = skewed_target and 2 * longest >= 3 * wanted and any(0 < 2 * int(n) < wanted for n in kv_lens)
        if skewed:
            wanted = math.ceil(int(kv_lens.sum()) * blocks_per_item / skewed_target)
        floor = min(min_chunk, max(64, math.ceil(math.ceil(longest / 16) / 32) * 32))
        if max_chunks:  # the longest request in at most max_chunks chunks
            floor = max(floor, math.ceil(math.ceil(longest / max_chunks) / 32) * 32)
        chunk, auto = max(floor, -(-wanted // 32) * 32), True
        blocks = batch * blocks_per_item
        heads = blocks * 2 * sms / target_blocks  # the target is 2 one-head blocks an SM
        if skewed_target and full_grid and not skewed and 0.7 * sms <= heads and blocks < target_blocks:
            enough = longest >= (full_grid if heads >= 0.9 * sms else 1024)
            if 2 * blocks <= target_blocks and enough:
                chunk = max(floor, math.ceil(longest / 2 / 32) * 32)
            else:
                chunk = longest

    def pieces(n, chunk):  # [(start, end)] of one request
        if not auto:
            count = max(1, math.ceil(n / chunk))
            return [(i * chunk, min(n, (i + 1) * chunk)) for i in range(count)]
        count = max(1, math.floor(n / chunk + 0.5))
        size = max(32, math.ceil(math.ceil(n / count) / 32) * 32)
        count = max(1, math.ceil(n / size))
        return [(i * size, min(n, (i + 1) * size)) for i in range(count)]

    while True:
        per_request = [pieces(int(n), chunk) for n in kv_lens]
        items = sum(len(p) for p in per_request)
        partials = sum(len(p) for p in per_request if len(p) > 1)
        if (max_items is None or items <= max_items) and (max_partials is None or partials <= max_partials):
            break
        if chunk >= longest:
            raise ValueError("does not fit")
        chunk = min(longest, chunk * 2)
    rows, merge, row = [], [0], 0
    for b, p in enumerate(per_request):
        split = len(p) > 1
        for i, (s, e) in enumerate(p):
            rows.append((b, s, e, row + i if split else -1))
        row += len(p) if split else 0
        merge.append(row)
    work = np.array(rows, dtype=np.int32).reshape(-1, 4)
    any_split = any(len(p) > 1 for p in per_request)
    if any_split:  # longest items first (stable)
        work = work[np.argsort(work[:, 1] - work[:, 2], kind="stable")]
    return chunk, work, np.array(merge, dtype=np.int32), any_split


def _pad(values, length: int, fill) -> list:
    values = [int(x) for x in values]
    return values + [int(fill)] * (length - len(values))


def expected_op_args(table: dict, lens, capacity: int | None = None, hq: int = HQ, hk: int = HK, d: int = D,
                     fixed_split_size=None, disable_split_kv=False, target=None, rope=False,
                     page_order: bool = False) -> dict:
    """The op's planned arguments as the replaced plan() computed them (capacity: the
    CUDA-graph capacity, None outside CUDA-graph mode; target: blocks per SM x SMs), with
    the later changes: split items longest first, 2 blocks per SM for tensor cores (4 for
    skewed batches), CUDA-graph grids under 2 blocks per SM; page_order: a CSR table's ids
    as a GPU plan() reorders them (each request's full pages by page id)."""
    target = cpu_target_blocks(hq, hk, d, rope) if target is None else target
    tensor_cores = uses_tensor_cores(rope)
    lens = np.asarray(lens, dtype=np.int64)
    batch = len(lens)
    graph = capacity is not None
    capacity = capacity if graph else batch
    blocks_per_item = hk * (hq // hk // group_tile(hq, hk, d))
    partial_rows = WORKSPACE_BYTES // ((hq * d + hq) * 4)
    max_items = decode.graph_grid_items(capacity, blocks_per_item, target, CPU_SMS) if graph else None
    _, work, merge, any_split = plan_split_reference(lens, blocks_per_item, target, fixed_split_size,
                                                     disable_split_kv, max_items, partial_rows,
                                                     min_chunk=128 if tensor_cores else 64,
                                                     max_chunks=32 if tensor_cores else None,
                                                     skewed_target=skewed_target(target, hq, hk, d, rope),
                                                     full_grid=3072)
    grid_items = max_items if graph else len(work)
    expected = {"work": [len(work)] + _pad(work.reshape(-1), 4 * grid_items, 0),
                "merge_indptr": _pad(merge, capacity + 1, merge[-1]), "grid_items": grid_items,
                "merge_rows": capacity if (graph or any_split) else 0}
    if "indptr" in table:
        ids = table["indices"].tolist()
        if page_order:
            csr_table = csr_page_table(table["indptr"], table["indices"], table["last_page_len"])
            segment = int(get_module(PageOrderSpec()).segment())
            ids = [i for k_ids, _ in ordered_pages_ref(csr_table, lens, PS, segment) for i in k_ids]
        expected["page_table"] = [_pad(table["indptr"], capacity + 1, table["indptr"][-1]),
                                  ids, _pad(table["last_page_len"], capacity, 0)]
    else:
        expected["page_table"] = [table["block_tables"].tolist(), _pad(table["seq_lens"], capacity, 0)]
    return expected


def actual_op_args(recorder: Recorder, table: dict, graph: bool, args: dict | None = None) -> dict:
    args = args or recorder.last
    tables = [t.tolist() for t in args["page_table"]]
    # The fixed id buffers (graphs) and the page order's CSR copy (its whole buffer: the
    # kernels read ids by indptr) hold the current plan's ids first
    if graph or "indices" in table:
        ids = table["indices"] if "indices" in table else table["block_tables"]
        at = 1 if "indices" in table else 0
        tables[at] = tables[at][:len(ids)]
    # (the work list's view runs to the plan buffer's end: the op reads grid_items items)
    return {"work": args["work"][:1 + 4 * args["grid_items"]].tolist(), "merge_indptr": args["merge_indptr"].tolist(),
            "grid_items": args["grid_items"], "merge_rows": args["merge_rows"], "page_table": tables}


# --- inputs --------------------------------------------------------------------------------------
def csr(lens, page_size: int = PS, seed: int = 0, junk_last: bool = False) -> dict:
    """CSR page table on the CPU; junk_last: requests without pages get a last_page_len
    outside 1..page_size (it must be ignored)."""
    rnd = random.Random(seed)
    pages = [-(-n // page_size) for n in lens]
    starts = np.concatenate([[0], np.cumsum(pages)]).astype(np.int64)
    ids = rnd.sample(range(int(starts[-1]) + 8), int(starts[-1]))
    last = [n - (p - 1) * page_size if p else (rnd.choice([-3, 0, 99]) if junk_last else 0)
            for n, p in zip(lens, pages)]
    return dict(indptr=torch.tensor(starts, dtype=torch.int32), indices=torch.tensor(ids, dtype=torch.int32),
                last_page_len=torch.tensor(last, dtype=torch.int32))


def block_table(lens, kv_separate: bool = False, page_size: int = PS, seed: int = 0) -> dict:
    rnd = random.Random(seed)
    width = max([-(-n // page_size) for n in lens] + [0]) + 1
    shape = (len(lens), 2, width) if kv_separate else (len(lens), width)
    bt = torch.tensor(np.array([rnd.randrange(1000) for _ in range(int(np.prod(shape)))]).reshape(shape),
                      dtype=torch.int32)
    return dict(block_tables=bt, seq_lens=torch.tensor(lens, dtype=torch.int32))


def wrapper(graph_capacity: int | None = None, pool: int = 4096, **kwargs):
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)
    if graph_capacity is None:
        return fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **kwargs)
    buf = lambda n: torch.zeros(n, dtype=torch.int32)  # noqa: E731
    return fij.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=buf(graph_capacity + 1),
        paged_kv_indices_buffer=buf(pool), paged_kv_last_page_len_buffer=buf(graph_capacity), **kwargs)


def qkv(batch: int, num_pages: int = 64, dtype=torch.float16, kv_dtype=None):
    q = torch.randn(batch, HQ, D).to(dtype)
    cache = tuple(torch.randn(num_pages, PS, HK, D).to(kv_dtype or dtype) for _ in range(2))
    return q, cache


def plan_and_capture(w, table: dict, op: Recorder, q_rows: int, **kwargs) -> None:
    w.plan(**table, num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.float16,
           **kwargs)
    q, cache = qkv(q_rows)
    w.run(q, cache)


SKEWED = [300, 17, 0, 1, 16, 32768, 32763, 32007, 0, 5] + [random.Random(1).randint(1, 300) for _ in range(30)]
BATCHES = {
    "uniform_256x2048": [2048] * 256,
    "uniform_small": [100, 200, 300],
    "skewed": SKEWED,
    "one_long": [50000],
    "zero_lengths": [0, 7, 0, 4096, 0, 16, 17],
    "all_empty": [0, 0, 0, 0],
    "no_requests": [],
    "page_multiples": [16, 32, 48, 4096],
}
SPLITS = {"auto": {}, "fixed64": dict(fixed_split_size=64), "no_split": dict(disable_split_kv=True)}


# --- plan(): the same op arguments as the replaced implementation --------------------------------
@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("layout", ["csr", "block_table", "block_table_kv_separate"])
def test_plan_matches_the_reference(name, split, layout, op):
    lens = BATCHES[name]
    if layout == "csr":
        table = csr(lens, junk_last=True)
    else:
        table = block_table(lens, kv_separate=layout == "block_table_kv_separate")
    w = wrapper()
    plan_and_capture(w, table, op, len(lens), **SPLITS[split])
    assert actual_op_args(op, table, graph=False) == expected_op_args(table, lens, **SPLITS[split])


def test_consecutive_plans_reuse_buffers_and_stay_exact(op):
    """Plans in turn (the two host buffers alternate, views are kept while the offsets
    stay, buffers grow): each run sees its own plan's values."""
    rnd = random.Random(7)
    w = wrapper()
    batches = [[2048] * 64, [2049] * 64, [rnd.randint(0, 9000) for _ in range(64)], [30000, 1, 0],
               [2048] * 256, [rnd.randint(1, 300) for _ in range(256)], [5, 6], [2048] * 64]
    for i, lens in enumerate(batches):
        table = csr(lens, seed=i) if i % 3 else block_table(lens, seed=i)
        plan_and_capture(w, table, op, len(lens))
        assert actual_op_args(op, table, graph=False) == expected_op_args(table, lens), f"plan {i}"


def test_plan_configurations_in_turn(op):
    """Scalar arguments are looked up by value (and type): plans alternating between
    configurations get each one's own scalars."""
    w = wrapper()
    table, lens = csr([100, 2000, 37]), [100, 2000, 37]
    options = [dict(), dict(sm_scale=0.07, logits_soft_cap=30.0), dict(window_left=37, rope_theta=5e5),
               dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=8.0)]
    for opts in options + options:
        plan_and_capture(w, table, op, 3, **opts)
        args = op.last
        sm_scale = opts.get("sm_scale", 1 / math.sqrt(D))
        cap = opts.get("logits_soft_cap", 0.0)
        assert args["logit_scale"] == (sm_scale / cap if cap else sm_scale * 1.4426950408889634)
        assert args["soft_cap"] == cap and args["window_left"] == opts.get("window_left", -1)
        assert args["rope_scale"] == opts.get("rope_scale", 1.0) and args["rope_theta"] == opts.get("rope_theta", 1e4)
        rope = opts.get("pos_encoding_mode") == "ROPE_LLAMA"
        assert actual_op_args(op, table, graph=False) == expected_op_args(table, lens, rope=rope)
    # equal values of another type are checked again, not taken from the cache
    with pytest.raises(ValueError, match="head_dim"):
        w.plan(**table, num_qo_heads=HQ, num_kv_heads=HK, head_dim=float(D), page_size=PS,
               q_data_type=torch.float16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        w.plan(**table, num_qo_heads=HQ, num_kv_heads=True, head_dim=D, page_size=PS)


@pytest.mark.parametrize("layout", ["csr", "block_table"])
def test_cuda_graph_plans_pad_to_the_capacity(layout, op):
    """CUDA-graph mode on CPU tensors: the capacity is the first batch; later, smaller
    batches are padded (merge_indptr and indptr repeat their last entry, lengths 0)."""
    capacity = 16
    w = wrapper(graph_capacity=capacity)
    rnd = random.Random(3)
    rounds = [[rnd.randint(1, 1500) for _ in range(16)], [0, 8000] + [rnd.randint(1, 200) for _ in range(14)],
              [3000, 0, 1, 16, 17] + [rnd.randint(1, 900) for _ in range(4)], [2048] * 16]
    for i, lens in enumerate(rounds):
        table = csr(lens, seed=i) if layout == "csr" else block_table(lens, seed=i)
        if layout == "block_table":  # the fixed buffer keeps its width: pad the table to it
            width = 8000 // PS + 2
            bt = torch.zeros(len(lens), width, dtype=torch.int32)
            bt[:, :table["block_tables"].shape[1]] = table["block_tables"]
            table["block_tables"] = bt
        plan_and_capture(w, table, op, capacity)
        assert actual_op_args(op, table, graph=True) == expected_op_args(table, lens, capacity=capacity), f"plan {i}"


def test_plan_split_fast_path_matches_the_general_one():
    rnd = np.random.default_rng(0)
    for trial in range(300):
        batch = int(rnd.integers(0, 40))
        lens = rnd.integers(0, 5000, batch) * (rnd.random(batch) < 0.9)
        if trial % 3 == 0:
            lens = np.full(batch, int(rnd.integers(0, 3000)))
        args = (lens.astype(np.int64), int(rnd.integers(1, 64)), int(rnd.integers(100, 1000)),
                [None, 64, 1000][trial % 3 == 1], trial % 7 == 0, [None, batch, batch + 20][trial % 3],
                [None, 0, 100000][trial % 3])
        min_chunk, max_chunks = [(64, None), (128, 32), (128, 16)][trial % 3]
        skewed = [None, 2 * args[2]][trial % 2]
        try:
            expected = plan_split_reference(*args, min_chunk=min_chunk, max_chunks=max_chunks, skewed_target=skewed)
        except ValueError:
            with pytest.raises(ValueError):
                decode.plan_split(*args, min_chunk=min_chunk, max_chunks=max_chunks, skewed_target_blocks=skewed)
            continue
        chunk, work, merge, any_split = decode.plan_split(*args, min_chunk=min_chunk, max_chunks=max_chunks,
                                                          skewed_target_blocks=skewed)
        assert (chunk, any_split) == expected[::3] and work.dtype == np.int32 and merge.dtype == np.int32
        np.testing.assert_array_equal(work, expected[1])
        np.testing.assert_array_equal(merge, expected[2])


@pytest.mark.parametrize("kv_dtype,kv_layout,lens,graph,pairs", [
    (torch.float8_e4m3fn, "NHD", [4096] * 64, False, 2),  # 64 requests x 4 pairs >= 132 SMs
    (torch.float8_e4m3fn, "NHD", [2048], False, 1),  # 16 chunks x 4 pairs: half the SMs idle
    (torch.float8_e4m3fn, "NHD", [8192] * 11, False, 2),  # split: 3 chunks each, 33 items x 4 pairs >= 132 SMs
    (torch.float8_e4m3fn, "NHD", [8192] * 20, False, 1),  # 160 one-head blocks cover the SMs: whole
    (torch.float8_e4m3fn, "NHD", [8192] * 16, False, 1),  # split: 32 items x 4 pairs < 132 SMs
    (torch.float8_e4m3fn, "HND", [4096] * 64, False, 1),  # a head's page is contiguous already
    (torch.bfloat16, "NHD", [4096] * 64, False, 1),  # 256-byte rows
    (torch.float8_e4m3fn, "NHD", [100] * 64, True, 2),  # CUDA graph: by the capacity
    (torch.float8_e4m3fn, "NHD", [100] * 16, True, 1),
])
def test_plan_pairs_kv_heads_where_the_grid_fills_the_sms(kv_dtype, kv_layout, lens, graph, pairs, op):
    """Blocks take KV-head pairs (rows of <= 128 bytes in NHD) only where the paired grid
    still gives every SM a block; the op receives the choice, and the work list is sized
    for it (half the blocks per item, half the target)."""
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)
    kwargs = {}
    if graph:
        buf = lambda n: torch.zeros(n, dtype=torch.int32)  # noqa: E731
        kwargs = dict(use_cuda_graph=True, paged_kv_indptr_buffer=buf(len(lens) + 1),
                      paged_kv_indices_buffer=buf(8192), paged_kv_last_page_len_buffer=buf(len(lens)))
    w = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout, **kwargs)
    table = csr(lens)
    w.plan(**table, num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.bfloat16,
           kv_data_type=kv_dtype)
    assert w._plan.kv_heads_per_block == pairs
    q = torch.randn(len(lens), HQ, D).to(torch.bfloat16)
    shape = (64, PS, HK, D) if kv_layout == "NHD" else (64, HK, PS, D)
    k = torch.randn(shape).to(kv_dtype)
    w.run(q, (k, k.clone()))
    assert op.last["kv_heads_per_block"] == pairs and op.last["cluster_size"] == 1
    # the work list is the one plan_split gives for the chosen blocks per item and target
    blocks_per_item, target = HK // pairs, cpu_target_blocks(HQ, HK, D) // pairs
    capacity = len(lens)
    max_items = decode.graph_grid_items(capacity, blocks_per_item, target, CPU_SMS) if graph else None
    _, work, _, _ = plan_split_reference(np.asarray(lens, dtype=np.int64), blocks_per_item, target, None, False,
                                         max_items, WORKSPACE_BYTES // ((HQ * D + HQ) * 4), min_chunk=128,
                                         max_chunks=32, skewed_target=skewed_target(target, HQ, HK, D),
                                         full_grid=3072)
    assert op.last["work"].tolist()[0] == len(work)
    assert op.last["grid_items"] == (max_items if graph else len(work))


def test_plan_split_targets_two_blocks_per_sm_but_four_for_skewed_batches():
    """Tensor-core plans (32/8 heads, 132 SMs): a uniform batch splits to about 2 blocks per
    SM, a skewed one (short requests beside long ones) to about 4."""
    target = cpu_target_blocks(HQ, HK, D)
    skewed = skewed_target(target, HQ, HK, D)
    assert (target, skewed) == (2 * CPU_SMS, 4 * CPU_SMS)

    def chunks(lens):
        _, work, merge, _ = decode.plan_split(np.asarray(lens, dtype=np.int64), HK, target, None, False,
                                              min_chunk=128, max_chunks=32, skewed_target_blocks=skewed)
        return np.diff(merge).tolist(), len(work)

    assert chunks([2048] * 16) == ([2] * 16, 32)  # 256 blocks
    assert chunks([8192] * 16) == ([2] * 16, 32)
    per_request, items = chunks([256] * 56 + [8192] * 8)
    assert per_request == [0] * 56 + [7] * 8 and items == 56 + 56  # 7 chunks of the 8k requests, not 3
    assert chunks([0] * 4 + [8192] * 8)[0] == [0] * 4 + [4] * 8  # empty requests do not make a batch skewed
    assert chunks([2048])[1] == 16  # b=1: the 128-token floor


@pytest.mark.parametrize("capacity, blocks_per_item, target, expected", [
    (1, 8, 528, 32),     # b=1, 8 head tiles: 256 blocks, under 2 per SM (264)
    (16, 8, 528, 32),    # 128 blocks of requests: the spares stop at 32 rows
    (17, 8, 528, 149),   # 136 blocks, one per SM: every spare (a skewed batch splits its long requests)
    (64, 4, 132, 130),   # paired fp8 blocks at capacity 64 (half the blocks, half the target)
    (256, 8, 528, 388),
    (1, 4, 264, 65),     # paired blocks: 4 per item
    (1, 64, 396, 4),     # 64 head tiles (CUDA cores, MHA): 4 rows, 256 blocks
    (1, 1, 6, 13),       # a small target: its 2 x target / blocks per item spares, not more
])
def test_graph_grid_items_spares_under_two_blocks_per_sm(capacity, blocks_per_item, target, expected):
    """A CUDA-graph wrapper's grid rows: the capacity plus spare rows for splits, as long as
    the whole grid stays under 2 blocks per SM (132 SMs here), or all of them where the
    capacity alone gives every SM a block."""
    rows = decode.graph_grid_items(capacity, blocks_per_item, target, CPU_SMS)
    assert rows == expected
    assert rows >= capacity
    assert capacity * blocks_per_item >= CPU_SMS or rows * blocks_per_item < 2 * CPU_SMS


# --- plan(): the wave split of large uniform batches ----------------------------------------------
def plan_uniform(native: str, monkeypatch, batch: int, kv_len: int, num_qo_heads: int, **plan_kwargs):
    """A wrapper (64 MB host workspace) planned by the C++ (native "1") or the numpy ("0")
    planner for `batch` requests of kv_len tokens (CSR, bf16 q, HK KV heads, head_dim D,
    page PS); checks that the planner asked for planned it."""
    monkeypatch.setenv("FLASHINFER_JIT_NATIVE_PLAN", native)
    w = fij.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD", use_tensor_cores=True)
    w.plan(**csr([kv_len] * batch), num_qo_heads=num_qo_heads, num_kv_heads=HK, head_dim=D, page_size=PS,
           q_data_type=torch.bfloat16, **plan_kwargs)
    assert (w._plan.config.native is not False) == (native == "1")
    return w


WAVE_CASES = [  # (requests, tokens each, num_qo_heads, kv dtype, chunks per request) on 132 SMs
    (256, 32768, 32, torch.bfloat16, 3),   # 2048 blocks = 3.9 waves of 528, 16 MB each: ~12 waves
    (256, 8192, 64, torch.bfloat16, 3),    # 4 MB blocks
    (512, 8192, 32, torch.bfloat16, 2),    # 7.8 waves
    (256, 32768, 32, torch.float8_e4m3fn, 3),  # paired blocks (16 MB): 1024 blocks, 264 at once
    (256, 8192, 32, torch.float8_e4m3fn, 1),   # paired 4 MB blocks: a 1.1 GB wave
    (160, 16384, 32, torch.float8_e4m3fn, 2),  # paired, 2.42 waves -> 4.85
    (256, 4096, 32, torch.bfloat16, 1),    # 2 MB blocks, 1.1 GB waves: not at 3.5+ waves
    (96, 4096, 32, torch.bfloat16, 2),     # ... but at 1.45
    (1024, 4096, 32, torch.bfloat16, 1),   # 15.5 waves already
    (80, 16384, 32, torch.bfloat16, 4),    # 1.21 waves: 4.85 leaves the fewest idle slots
    (96, 32768, 32, torch.bfloat16, 2),    # 1.45 waves -> 2.91 (4 ties, fewer chunks win)
    (160, 8192, 32, torch.bfloat16, 2),    # 2.42 -> 4.85
    (96, 2048, 32, torch.bfloat16, 1),     # 1 MB blocks: 0.55 GB waves
    (128, 32768, 32, torch.bfloat16, 1),   # 1.94 waves: every k leaves as many idle slots
    (192, 16384, 32, torch.bfloat16, 1),   # 2.91
    (64, 32768, 32, torch.bfloat16, 1),    # one wave
    (128, 32768, 32, torch.float8_e4m3fn, 1),  # paired: 512 blocks, 1.94 waves
    (256, 32768, 128, torch.bfloat16, 1),  # 16-head tiles: their residency is not measured
    (96, 32768, 8, torch.bfloat16, 2),     # groups of 1 (8/8 heads) take the same tensor-core blocks
]


MULTI_TOKEN_WAVE_CASES = [  # (batch, kv_len, num_qo_heads, q_len_per_req, chunks): 8 KV heads, 132 SMs
    (64, 4096, 32, 4, 3),  # 512 blocks of 16 rows, 396 at once: 3 chunks leave the fewest idle
    (64, 4096, 32, 2, 1),  # 8-row tiles, 4 an SM: one wave
    (64, 4096, 64, 8, 1),  # 4 tiles a KV head: 2048 blocks, 5.2 waves: whole (2 chunks lost on the H100)
]


@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp", "numpy"])
@pytest.mark.parametrize("batch,kv_len,hq,n_tok,chunks", MULTI_TOKEN_WAVE_CASES)
def test_plan_multi_token_waves(batch, kv_len, hq, n_tok, chunks, native, op, monkeypatch):
    """A block of N query tokens weighs N times its bytes in the wave split, and 16-row tiles
    count 3 blocks an SM: the b=64 x 4 tokens batch splits in 3 (measured best on the H200)."""
    w = plan_uniform(native, monkeypatch, batch, kv_len, hq, q_len_per_req=n_tok)
    assert w._plan.args[8] == batch * chunks  # grid items
    # a CUDA-graph wrapper at that capacity has the rows for the same split
    g = fij.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD", use_cuda_graph=True,
                                               use_tensor_cores=True)
    g.plan(**csr([kv_len] * batch), num_qo_heads=hq, num_kv_heads=HK, head_dim=D, page_size=PS,
           q_data_type=torch.bfloat16, q_len_per_req=n_tok)
    assert int(g._plan.args[1][0]) == batch * chunks and g._plan.args[8] >= batch * chunks


@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp", "numpy"])
@pytest.mark.parametrize("batch,kv_len,hq,kv_dtype,chunks", WAVE_CASES)
def test_plan_splits_large_uniform_batches_by_their_waves(batch, kv_len, hq, kv_dtype, chunks, native, op,
                                                           monkeypatch):
    """A batch that fills the GPU still splits where its grid's last wave would leave slots
    idle for a long block (decode.py _WAVE_SPLIT_MIN_BYTES): each request in `chunks`
    chunks of equal whole tiles, by both planners."""
    w = plan_uniform(native, monkeypatch, batch, kv_len, hq, kv_data_type=kv_dtype)
    assert w._plan.args[8] == batch * chunks  # grid items
    assert w._plan.args[9] == (batch if chunks > 1 else 0)  # merge rows
    work = w._plan.args[1]
    rows = work[1:1 + 4 * batch * chunks].view(-1, 4).tolist()
    assert int(work[0]) == batch * chunks
    size = math.ceil(kv_len / chunks / 32) * 32  # whole 32-token tiles
    for r in (0, batch - 1):  # each request's chunks: equal whole tiles, covering it once
        spans = sorted((start, end) for req, start, end, _ in rows if req == r)
        assert spans == [(i * size, min(kv_len, (i + 1) * size)) for i in range(chunks)]


FULL_GRID_CASES = [  # (batch, kv_len, num_qo_heads, kv dtype, chunks): 8 KV heads, 132 SMs
    (16, 512, 32, torch.bfloat16, 1),     # 128 blocks (>= 9/10 of the SMs): the target split 2 chunks
    (16, 2048, 64, torch.bfloat16, 1),
    (16, 3072, 32, torch.bfloat16, 2),    # from 3072 tokens: in two
    (16, 8192, 32, torch.float8_e4m3fn, 2),
    (16, 2048, 32, torch.float8_e4m3fn, 1),  # fp8 by tokens too (paired sizing: 64 pairs, the same grid)
    (12, 512, 32, torch.bfloat16, 1),     # 96 blocks (7/10 to 9/10): the target split 3 chunks
    (12, 1024, 32, torch.bfloat16, 2),    # from 1024 tokens: two chunks, not the target's three
    (12, 8192, 32, torch.bfloat16, 2),
    (20, 2048, 32, torch.bfloat16, 1),    # 160 blocks: over the SMs, under the target: whole
    (20, 32768, 32, torch.bfloat16, 1),
    (20, 8192, 32, torch.float8_e4m3fn, 1),
    (10, 2048, 32, torch.bfloat16, 3),    # 80 blocks (under 7/10): the target's split
    (8, 512, 32, torch.bfloat16, 4),
    (16, 512, 8, torch.bfloat16, 1),      # 1-head tiles (8/8 heads) as well
]


@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp", "numpy"])
@pytest.mark.parametrize("peak,batch,kv_len,chunks", [
    (4.9e12, 16, 2048, 2),   # H200: over the 4 TB/s peak, 128 blocks split from 1024 tokens
    (4.9e12, 16, 1024, 2),
    (4.9e12, 16, 512, 1),
    (4.9e12, 20, 2048, 1),   # over the SM count: whole on any GPU
    (3.35e12, 16, 2048, 1),  # H100
    (3.35e12, 16, 3072, 2),
])
def test_plan_full_grid_split_length_follows_the_dram_peak(peak, batch, kv_len, chunks, native, op, monkeypatch):
    """A grid that covers >= 9/10 of the SMs splits in two from 3072 tokens where the DRAM
    peak is at most _LONG_CLUSTER_MAX_PEAK_BYTES_PER_S, from 1024 above it; both planners."""
    monkeypatch.setattr(decode, "_peak_dram_bytes_per_s", lambda device: peak)
    w = plan_uniform(native, monkeypatch, batch, kv_len, HQ, kv_data_type=torch.bfloat16)
    assert w._plan.args[8] == batch * chunks


@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp", "numpy"])
@pytest.mark.parametrize("batch,kv_len,hq,kv_dtype,chunks", FULL_GRID_CASES)
def test_plan_splits_a_grid_that_covers_the_sms_in_two_at_most(batch, kv_len, hq, kv_dtype, chunks, native, op,
                                                              monkeypatch):
    """A uniform batch whose unsplit grid covers >= 7/10 of the SMs (decode.py
    _FULL_GRID_MIN_TENTHS) stays whole, or splits in two where its requests are long, by
    both planners; smaller grids keep the target's split."""
    w = plan_uniform(native, monkeypatch, batch, kv_len, hq, kv_data_type=kv_dtype)
    assert w._plan.cluster == 1
    assert w._plan.args[8] == batch * chunks  # grid items
    assert w._plan.args[9] == (batch if chunks > 1 else 0)  # merge rows


@pytest.mark.parametrize("case", [
    dict(lens=[32768] * 255 + [16000]),   # not uniform: a request under 3/4 of the longest
    dict(lens=[32768] * 255 + [0]),        # an empty request
    dict(lens=[32768] * 256, fixed_split_size=32768),
    dict(lens=[32768] * 256, disable_split_kv=True),
])
def test_wave_split_only_for_uniform_batches_and_automatic_splits(case, op):
    case = dict(case)
    lens = case.pop("lens")
    w = fij.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD")
    w.plan(**csr(lens), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.bfloat16,
           **case)
    assert w._plan.args[8] == len(lens) and w._plan.args[9] == 0


def test_wave_split_in_cuda_graph_mode_fits_the_captured_grid(op):
    """A CUDA-graph wrapper's grid is fixed at capture (capacity + spare rows): the wave
    split of b=256 does not fit it, so the chunk doubles back to whole requests, as any
    split that outgrows the grid does."""
    lens = [32768] * 256
    buf = lambda n: torch.zeros(n, dtype=torch.int32)  # noqa: E731
    w = fij.BatchDecodeWithPagedKVCacheWrapper(  # a workspace that holds the split's partial rows
        torch.zeros(64 << 20, dtype=torch.uint8), "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=buf(257),
        paged_kv_indices_buffer=buf(256 * 2048), paged_kv_last_page_len_buffer=buf(256))
    w.plan(**csr(lens), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.bfloat16)
    rows = decode.graph_grid_items(256, HK, cpu_target_blocks(HQ, HK, D), CPU_SMS)
    assert w._plan.args[8] == rows
    work = w._plan.args[1]
    assert int(work[0]) == 256  # items: one per request


# --- plan(): the cluster split (sm_90+) ----------------------------------------------------------
@pytest.mark.parametrize("lens,cluster", [([2048], 16), ([1000, 0, 33], 16), ([31], 8), ([0], 16), ([], 16),
                                          ([32768, 5000], 8)])
def test_plan_cluster_covers_each_request_in_equal_tiles(lens, cluster):
    """Row r x cluster + i is chunk i of request r; a request's chunks tile [0, length) in
    order, all of one length in whole 32-token tiles (the last ones shorter or empty);
    no partial rows."""
    work = decode.plan_cluster(np.array(lens, dtype=np.int64), cluster)
    assert work.dtype == np.int32 and work.shape == (len(lens) * cluster, 4)
    for r, n in enumerate(lens):
        rows = work[r * cluster:(r + 1) * cluster]
        assert (rows[:, 0] == r).all() and (rows[:, 3] == -1).all()
        size = max(32, -(-(-(-n // cluster)) // 32) * 32)
        assert rows[0, 1] == 0 and rows[-1, 2] == n and (rows[1:, 1] == rows[:-1, 2]).all()
        assert ((rows[:, 2] - rows[:, 1]) <= size).all() and ((rows[:, 1] % 32 == 0) | (rows[:, 1] == n)).all()
        full = rows[:, 2] - rows[:, 1] == size
        assert full[: int(full.sum())].all(), "the full chunks come first"


@pytest.fixture
def clusters(monkeypatch):
    """plan() on the CPU as on an sm_90 device (thread-block clusters)."""
    monkeypatch.setattr(decode, "supports_clusters", lambda device: True)


@pytest.mark.parametrize("lens,hk,d,kv_dtype,expected,warps", [
    ([1024], 8, 128, torch.float16, 8, 4),         # 8 blocks per item x 8 <= 132 SMs; 64 KB a block
    ([512], 8, 128, torch.float16, 8, 4),          # 64 tokens per block: the least taken
    ([511], 8, 128, torch.float16, 1, 4),          # fewer: the split with partial states
    ([1025], 8, 128, torch.float16, 8, 8),         # over 64 KB a block: 8-warp blocks
    ([8192], 8, 128, torch.float16, 8, 8),         # 512 KB a block
    ([32768], 8, 128, torch.float16, 8, 8),        # 2 MB a block (16-bit, head_dim 128): the most taken
    ([32769], 8, 128, torch.float16, 1, 4),        # over it: the split with partial states
    ([1024, 1024], 8, 128, torch.float16, 8, 4),   # 128 blocks of 4 warps
    ([1025, 1025], 8, 128, torch.float16, 1, 4),   # 128 blocks of 8 warps: more than half the SMs
    ([30000, 0], 4, 128, torch.float16, 8, 8),     # 2 x 4 x 8 = 64 blocks of 8 warps
    ([8193], 8, 64, torch.float16, 8, 8),          # 256 KB a block at head_dim 64
    ([16385], 8, 64, torch.float16, 1, 4),         # over 512 KB at head_dim 64: not measured, split
    ([1024], 8, 128, torch.float8_e4m3fn, 8, 4),   # fp8: 4 warps to 32 KB a block
    ([1025], 8, 128, torch.float8_e4m3fn, 8, 8),
    ([2048], 8, 128, torch.float8_e4m3fn, 8, 8),
    ([4096], 8, 128, torch.float8_e4m3fn, 8, 8),   # fp8: 128 KB a block at most
    ([4097], 8, 128, torch.float8_e4m3fn, 1, 4),
    ([1000, 0, 700], 4, 128, torch.float16, 8, 4),  # 3 x 4 x 8 = 96 blocks
    ([1000, 1000, 1000], 8, 128, torch.float16, 1, 4),  # 3 x 8 x 8 = 192 > 132 SMs
    ([2048], 8, 64, torch.float16, 8, 4),
    ([512], 8, 256, torch.float16, 8, 4),
    ([513], 8, 256, torch.float16, 8, 8),
    ([4096], 8, 256, torch.float16, 8, 8),
    ([4097], 8, 256, torch.float16, 1, 4),
])
def test_plan_takes_the_cluster_split_for_small_batches(lens, hk, d, kv_dtype, expected, warps, op, clusters):
    w = wrapper()
    table = csr(lens)
    hq = 4 * hk
    w.plan(**table, num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=PS, q_data_type=torch.float16,
           kv_data_type=kv_dtype)
    assert w._plan.cluster == expected and w._plan.cluster_warps == warps
    w.run(torch.randn(len(lens), hq, d).to(torch.float16),
          tuple(torch.randn(64, PS, hk, d).to(kv_dtype) for _ in range(2)))
    last = op.last
    assert last["cluster_size"] == expected and last["cluster_warps"] == warps and last["kv_heads_per_block"] == 1
    if expected > 1:
        assert last["grid_items"] == len(lens) * expected and last["merge_rows"] == 0
        assert last["merge_counters"] is None
        n = int(last["work"][0])
        work = last["work"][1:1 + 4 * n].reshape(n, 4).numpy()
        np.testing.assert_array_equal(work, decode.plan_cluster(np.array(lens), expected))
        assert (last["merge_indptr"] == 0).all()


@pytest.mark.parametrize("peak,lens,expected,warps", [
    (3.35e12, [32768], 8, 8),   # H100 SXM: 2 MB a block on 8-warp clusters
    (4.0e12, [32768], 8, 8),    # at the limit: still taken
    (4.9e12, [32768], 1, 4),    # H200: the 64 blocks' ~2.8 TB/s is below the split's rate
    (4.9e12, [8192], 8, 8),     # 512 KB a block: the wide clusters' limit stays
    (4.9e12, [8193], 1, 4),
    (4.9e12, [1024], 8, 4),     # the 4-warp clusters are unchanged
])
@pytest.mark.parametrize("native", ["0", "1"])
def test_plan_long_clusters_only_up_to_a_dram_peak(peak, lens, expected, warps, native, op, clusters, monkeypatch):
    """The 8-warp clusters over 512 KB a block (16-bit caches, head_dim 128) are taken only
    on GPUs whose DRAM peak is at most _LONG_CLUSTER_MAX_PEAK_BYTES_PER_S; both planners
    take the limit from the configuration."""
    monkeypatch.setattr(decode, "_peak_dram_bytes_per_s", lambda device: peak)
    monkeypatch.setenv("FLASHINFER_JIT_NATIVE_PLAN", native)
    w = wrapper()
    w.plan(**csr(lens), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.float16)
    assert (w._plan.cluster, w._plan.cluster_warps) == (expected, warps)


def test_cuda_graph_wrapper_keeps_the_split_above_the_dram_peak(op, clusters, monkeypatch):
    """A CUDA-graph wrapper takes its 8-warp clusters for any later length, so not where
    long requests would run slower on them."""
    monkeypatch.setattr(decode, "_peak_dram_bytes_per_s", lambda device: 4.9e12)
    w = wrapper(graph_capacity=1, pool=8192)
    w.plan(**csr([10]), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.float16)
    assert w._plan.cluster == 1


def test_peak_dram_bytes_per_s_is_none_off_cuda():
    assert decode._peak_dram_bytes_per_s(torch.device("cpu")) is None


@pytest.mark.parametrize("kwargs", [dict(fixed_split_size=256), dict(disable_split_kv=True)])
def test_plan_cluster_split_yields_to_forced_splits(kwargs, op, clusters):
    w = wrapper()
    w.plan(**csr([1000]), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.float16,
           **kwargs)
    assert w._plan.cluster == 1


def test_plan_cluster_split_off_by_environment(op, clusters, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_DECODE_CLUSTERS", "0")
    w = wrapper()
    w.plan(**csr([1000]), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.float16)
    assert w._plan.cluster == 1


def test_plan_cluster_split_off_without_clusters(op):
    """No sm_90 device (here: the CPU), no cluster split."""
    w = wrapper()
    w.plan(**csr([1000]), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.float16)
    assert w._plan.cluster == 1


def test_cuda_graph_wrapper_takes_8_warp_clusters_by_its_capacity(op, clusters):
    """A CUDA-graph wrapper's grid and kernel are fixed at capture: it decides the cluster
    split by its capacity alone. At capacity 1 (8 KV heads x 8 blocks: half the SMs), a
    16-bit cache at head_dim 128 takes 8-warp clusters whatever the lengths of this plan
    or a later one; each request gets a cluster, the rows of the ones it lacks are zeros."""
    w = wrapper(graph_capacity=1, pool=8192)
    plan_and_capture(w, csr([10]), op, 1)  # too short for the eager planner's clusters
    first = op.last
    assert w._plan.cluster == 8 and w._plan.cluster_warps == 8
    assert first["cluster_size"] == 8 and first["cluster_warps"] == 8 and first["grid_items"] == 8
    for lens in ([100000], [0], [3000]):  # longer than an eager plan's 2 MB a block, empty, mid
        w.plan(**csr(lens), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS,
               q_data_type=torch.float16)
        q, cache = qkv(1)
        w.run(q, cache)
        last = op.last
        assert (last["cluster_size"], last["cluster_warps"], last["grid_items"]) == (8, 8, 8)
        assert last["merge_rows"] == 0 and last["merge_counters"] is None  # merged on chip
        work = last["work"][1:1 + 4 * 8].reshape(8, 4).numpy()
        assert int(last["work"][0]) == 8
        np.testing.assert_array_equal(work, decode.plan_cluster(np.array(lens), 8))


@pytest.mark.parametrize("capacity,hk,d,kv_dtype", [
    (2, 8, 128, torch.float16),           # 2 x 8 x 8 = 128 blocks of 8 warps: over half the SMs
    (1, 8, 128, torch.float8_e4m3fn),     # fp8: 8-warp clusters lose from 128 KB a block
    (1, 8, 64, torch.float16),            # head_dim 64: measured to 512 KB a block only
])
def test_cuda_graph_wrapper_keeps_the_split_with_partial_states(capacity, hk, d, kv_dtype, op, clusters):
    """Elsewhere a CUDA-graph wrapper keeps the split with partial states: a fixed cluster
    shape would run a later plan's long requests much slower."""
    w = wrapper(graph_capacity=capacity)
    w.plan(**csr([1000] * capacity), num_qo_heads=4 * hk, num_kv_heads=hk, head_dim=d, page_size=PS,
           q_data_type=torch.float16, kv_data_type=kv_dtype)
    assert w._plan.cluster == 1


def test_cuda_graph_wrapper_cluster_grid_takes_padding(op, clusters):
    """At capacity 2 with 4 KV heads (2 x 4 x 8 = 64 blocks), a plan of one request fills
    the first cluster's rows; the second cluster's rows are zeros past the item count."""
    w = wrapper(graph_capacity=2)
    kw = dict(num_qo_heads=16, num_kv_heads=4, head_dim=128, page_size=PS, q_data_type=torch.float16)
    w.plan(**csr([500, 700]), **kw)
    assert w._plan.cluster == 8 and w._plan.cluster_warps == 8
    w.plan(**csr([4000]), **kw)
    w.run(torch.randn(1, 16, 128).to(torch.float16), tuple(torch.randn(300, PS, 4, 128).to(torch.float16)
                                                             for _ in range(2)))
    last = op.last
    assert last["grid_items"] == 16 and int(last["work"][0]) == 8 and last["merge_rows"] == 0
    work = last["work"][1:1 + 4 * 16].reshape(16, 4).numpy()
    np.testing.assert_array_equal(work[:8], decode.plan_cluster(np.array([4000]), 8))
    assert (work[8:] == 0).all()


# --- plan(): one copy to the device --------------------------------------------------------------
@contextlib.contextmanager
def counting_copies():
    """Tensor.copy_ calls (destination shape, source shape) while in the with-block."""
    copies = []
    original = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        copies.append((tuple(self.shape), tuple(src.shape)))
        return original(self, src, non_blocking)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "copy_", copy_)
        yield copies


def test_plan_copies_once():
    w = wrapper()
    for lens in ([2048] * 256, [10, 20000, 0], [2048] * 256):
        table = csr(lens)
        with counting_copies() as copies:
            w.plan(**table, num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS)
        assert len(copies) == 1, copies


def test_cuda_graph_plan_skips_the_id_copy_into_its_own_buffer():
    """The id copy into the fixed buffer is skipped when the ids given are that buffer
    (engines fill paged_kv_indices_buffer in place and pass a slice of it)."""
    w = wrapper(graph_capacity=4, pool=256)
    table = csr([100, 200, 300, 400])
    with counting_copies() as copies:
        w.plan(**table, num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS)
    assert len(copies) == 2  # the packed buffer, then the ids into the fixed buffer
    fixed = w._user_buffers[1]
    n = table["indices"].numel()
    fixed[:n].copy_(table["indices"])
    with counting_copies() as copies:
        w.plan(**(table | dict(indices=fixed[:n])), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS)
    assert len(copies) == 1
    assert w._plan.args[0][1] is fixed


# --- run(): the fast path raises what the full checks raise --------------------------------------
def _planned(batch: int = 3, graph_capacity: int | None = None, **kwargs):
    w = wrapper(graph_capacity)
    w.plan(**csr([40] * batch), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS,
           q_data_type=torch.float16, **kwargs)
    return w


def _misaligned_q(batch: int):
    flat = torch.zeros(batch * HQ * D + 1, dtype=torch.float16)
    return flat[1:].view(batch, HQ, D)  # 2 bytes past a 16-byte boundary


BAD_RUNS = {
    "q_wrong_heads": lambda: (torch.zeros(3, 16, D, dtype=torch.float16), qkv(3)[1]),
    "q_wrong_head_dim": lambda: (torch.zeros(3, HQ, 64, dtype=torch.float16), qkv(3)[1]),
    "q_2d": lambda: (torch.zeros(3, HQ * D, dtype=torch.float16), qkv(3)[1]),
    "q_4d": lambda: (torch.zeros(1, 3, HQ, D, dtype=torch.float16), qkv(3)[1]),
    "q_dtype": lambda: (torch.zeros(3, HQ, D, dtype=torch.bfloat16), qkv(3)[1]),
    "q_batch": lambda: (torch.zeros(4, HQ, D, dtype=torch.float16), qkv(3)[1]),
    "q_not_a_tensor": lambda: (np.zeros((3, HQ, D), np.float16), qkv(3)[1]),
    "q_misaligned": lambda: (_misaligned_q(3), qkv(3)[1]),
    "q_head_dim_strided": lambda: (torch.zeros(3, HQ, 2 * D, dtype=torch.float16)[..., ::2], qkv(3)[1]),
    "kv_dtype": lambda: (qkv(3)[0], qkv(3, kv_dtype=torch.float8_e4m3fn)[1]),
    "kv_heads": lambda: (qkv(3)[0], tuple(torch.zeros(8, PS, 4, D, dtype=torch.float16) for _ in range(2))),
    "kv_page_size": lambda: (qkv(3)[0], tuple(torch.zeros(8, 32, HK, D, dtype=torch.float16) for _ in range(2))),
    "kv_shapes_differ": lambda: (qkv(3)[0], (torch.zeros(8, PS, HK, D, dtype=torch.float16),
                                             torch.zeros(9, PS, HK, D, dtype=torch.float16))),
    "kv_not_tensors": lambda: (qkv(3)[0], ([1, 2], [3, 4])),
    "kv_one_tensor_bad": lambda: (qkv(3)[0], torch.zeros(8, 3, PS, HK, D, dtype=torch.float16)),
    "kv_misaligned": lambda: (qkv(3)[0], (torch.zeros(8 * PS * HK * D + 1, dtype=torch.float16)[1:]
                                          .view(8, PS, HK, D),) * 2),
    "kv_wrong_device": lambda: (qkv(3)[0], tuple(torch.zeros(8, PS, HK, D, dtype=torch.float16, device="meta")
                                                 for _ in range(2))),
}


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)
    return None


@pytest.mark.parametrize("name", sorted(BAD_RUNS))
def test_run_fast_path_rejects_what_the_full_checks_reject(name, op):
    q_bad, cache_bad = BAD_RUNS[name]()
    fresh = _error(lambda: _planned().run(q_bad, cache_bad))
    assert fresh is not None, f"{name}: a fresh wrapper accepted it"
    primed = _planned()
    q, cache = qkv(3)
    primed.run(q, cache)  # passes the checks: later calls like it skip them
    calls = len(op.calls)
    assert _error(lambda: primed.run(q_bad, cache_bad)) == fresh
    assert len(op.calls) == calls, "nothing may launch after a failed check"
    primed.run(q, cache)  # and the good input still runs
    assert len(op.calls) == calls + 1


def test_run_fast_path_skips_the_checks_only_for_the_same_signature(op, monkeypatch):
    w = _planned()
    checks = []
    full = w._check_run
    monkeypatch.setattr(w, "_check_run", lambda *a: checks.append(1) or full(*a))
    q, cache = qkv(3)
    for _ in range(3):
        w.run(q, cache)
    assert len(checks) == 1
    w.run(torch.randn(3, HQ, D).to(torch.float16), tuple(c.clone() for c in cache))  # other tensors, same kind
    assert len(checks) == 1
    w.run(q.transpose(0, 1).contiguous().transpose(0, 1), cache)  # other strides
    assert len(checks) == 2
    w.run(q, cache)  # the last signature that passed is the one remembered
    assert len(checks) == 3
    w.plan(**csr([40] * 3, seed=5), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS,
           q_data_type=torch.float16)
    w.run(q, cache)  # a new plan, same configuration and batch: still checked
    assert len(checks) == 3
    w.plan(**csr([40] * 4), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.float16)
    with pytest.raises(ValueError, match="batch"):
        w.run(q, cache)  # another batch size: checked in full again
    w.plan(**csr([40] * 3), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.bfloat16)
    with pytest.raises(TypeError, match="q: planned for bfloat16"):
        w.run(q, cache)  # another configuration


def test_cuda_graph_run_above_capacity_after_a_good_run(op):
    w = _planned(batch=4, graph_capacity=4)
    q, cache = qkv(4)
    w.run(q, cache)
    with pytest.raises(ValueError, match="capacity"):
        w.run(torch.zeros(5, HQ, D, dtype=torch.float16), cache)
    w.plan(**csr([40] * 2), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.float16)
    w.run(q, cache)  # 2 planned, q padded to the captured 4
    assert op.last["merge_rows"] == 4 and op.last["page_table"][0].tolist() == [0, 3, 6, 6, 6]
    with pytest.raises(ValueError, match="between the planned 2"):
        w.run(torch.zeros(1, HQ, D, dtype=torch.float16), cache)


def test_run_outputs_and_scales(op):
    w = _planned(logits_soft_cap=None, sm_scale=0.1)
    q, cache = qkv(3)
    out = w.run(q, cache)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert op.last["lse"].numel() == 0 and op.last["v_scale"] == 1.0
    assert op.last["logit_scale"] == 0.1 * 1.4426950408889634
    out, lse = w.run(q, cache, return_lse=True, q_scale=2.0, k_scale=0.5, v_scale=3.0, window_left=5)
    assert lse.shape == (3, HQ) and lse.dtype == torch.float32 and op.last["lse"] is lse
    assert op.last["logit_scale"] == 0.1 * 2.0 * 0.5 * 1.4426950408889634
    assert op.last["v_scale"] == 3.0 and op.last["window_left"] == 5
    q_strided = torch.randn(3, HQ, 2 * D).to(torch.float16)[..., :D]  # rows of a wider buffer
    out = w.run(q_strided, cache)
    assert out.is_contiguous()
    with pytest.raises(ValueError, match="out"):
        w.run(q, cache, out=torch.empty(3, HQ, D, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="lse"):
        w.run(q, cache, lse=torch.empty(3, HQ + 1), return_lse=True)
    # one [num_pages, 2, ...] tensor: its K and V views reach the op
    single = torch.randn(8, 2, PS, HK, D).to(torch.float16)
    w.run(q, single)
    assert op.last["k"].data_ptr() == single.data_ptr() and op.last["v"].data_ptr() == single[:, 1].data_ptr()


@pytest.mark.gpu
def test_host_page_ids_travel_in_the_one_copy(op):
    """A CUDA workspace with page ids on the host: they go with the packed buffer (one ship
    of it, the C copy or torch's; the ids the op reads lie inside its device buffer)."""
    from flashinfer_jit.runtime.plan_buffer import PlanBuffer

    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    w = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    lens = [100, 0, 3000, 17]
    table = csr(lens)
    ships, original = [], PlanBuffer.ship
    with counting_copies() as copies, pytest.MonkeyPatch.context() as patch:
        patch.setattr(PlanBuffer, "ship", lambda self, *a: ships.append(a) or original(self, *a))
        w.plan(**table, num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS)
    assert len(ships) == 1 and len(copies) <= 1, (ships, copies)
    q = torch.randn(4, HQ, D, device="cuda").to(torch.float16)
    cache = tuple(torch.randn(8, PS, HK, D, device="cuda").to(torch.float16) for _ in range(2))
    w.run(q, cache)
    assert op.last["page_table"][1].device.type == "cuda"
    # (the op reads the page-id-ordered copy; the ids as planned are the packed buffer's)
    ids, buf = (w._plan.unordered or op.last["page_table"])[1], w._plan_buffer.buf
    assert buf.data_ptr() <= ids.data_ptr() < buf.data_ptr() + 4 * buf.numel()
    target = cpu_target_blocks(HQ, HK, D) // CPU_SMS * torch.cuda.get_device_properties(0).multi_processor_count
    assert actual_op_args(op, table, graph=False) == expected_op_args(table, lens, target=target, page_order=True)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_plans_ahead_of_a_busy_gpu_keep_their_values(graph, op):
    """plan() after plan() while the GPU is still busy (the copies queue up; the host
    buffers alternate, the third plan waits for the first copy): each run sees its own
    plan's values (snapshots taken in stream order, compared after a sync)."""
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    capacity = 40
    kwargs = dict(use_cuda_graph=True, paged_kv_indices_buffer=torch.zeros(16384, dtype=torch.int32, device="cuda")) \
        if graph else {}
    w = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **kwargs)
    target = cpu_target_blocks(HQ, HK, D) // CPU_SMS * torch.cuda.get_device_properties(0).multi_processor_count
    rnd = random.Random(9)
    busy = torch.randn(2048, 2048, device="cuda")
    q = torch.randn(capacity, HQ, D, device="cuda").to(torch.float16)
    cache = tuple(torch.randn(8, PS, HK, D, device="cuda").to(torch.float16) for _ in range(2))
    seen = []
    for i in range(8):
        for _ in range(20):  # a few ms of work ahead of each plan's copy
            busy = torch.tanh(busy @ busy)
        lens = [capacity * 100] + [rnd.randint(0, 3000) for _ in range(capacity - 1 - i % 5)]
        table = csr(lens, seed=i)
        w.plan(**(table | dict(indices=table["indices"].cuda())), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D,
               page_size=PS)
        w.run(q if graph else q[:len(lens)], cache)
        args = dict(op.last)  # device tensors a later plan() may overwrite: copied in stream order
        args["page_table"] = [t.clone() for t in args["page_table"]]
        args["work"], args["merge_indptr"] = args["work"].clone(), args["merge_indptr"].clone()
        seen.append((args, table, lens))
    torch.cuda.synchronize()
    for i, (args, table, lens) in enumerate(seen):
        want = expected_op_args(table, lens, capacity=capacity if graph else None, target=target, page_order=True)
        assert actual_op_args(op, table, graph, args) == want, f"plan {i}"


# --- plan(): bad page-table values -----------------------------------------------------------------
BAD_TABLES = {
    "indptr_not_from_0": (dict(indptr=[1, 2, 3]), "indptr"),
    "indptr_decreasing": (dict(indptr=[0, 5, 3]), "indptr"),
    "indptr_past_indices": (dict(indptr=[0, 2, 9]), "indptr"),
    "indptr_wraps_int32": (dict(indptr=[0, 2**31 - 1, -2]), "indptr"),
    "last_0": (dict(last_page_len=[0, 3]), "last_page_len"),
    "last_above_page": (dict(last_page_len=[PS + 1, 3]), "last_page_len"),
    "last_negative": (dict(last_page_len=[3, -1]), "last_page_len"),
    "last_int32_min": (dict(last_page_len=[3, -2**31]), "last_page_len"),
    "last_int32_max": (dict(last_page_len=[2**31 - 1, 3]), "last_page_len"),
    "last_wrong_length": (dict(last_page_len=[3]), "last_page_len"),
    "indptr_int16": (dict(indptr=torch.tensor([0, 2, 4], dtype=torch.int16)), "indptr"),  # int32 or int64 only
    "seq_lens_negative": (dict(seq_lens=[-1, 5]), "seq_lens"),
    "seq_lens_past_table": (dict(seq_lens=[3 * PS + 1, 5]), "seq_lens"),
}


@pytest.mark.parametrize("name", sorted(BAD_TABLES))
def test_plan_rejects_bad_page_table_values(name):
    change, match = BAD_TABLES[name]
    if "seq_lens" in change:
        table = dict(block_tables=torch.zeros(2, 3, dtype=torch.int32),
                     seq_lens=torch.tensor(change["seq_lens"], dtype=torch.int32))
    else:
        table = dict(indptr=[0, 2, 4], indices=list(range(8)), last_page_len=[3, 4]) | change
        table = {k: v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.int32)
                 for k, v in table.items()}
    w = wrapper()
    w.plan(**csr([40, 40]), num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS)  # a good plan first
    with pytest.raises((ValueError, TypeError), match=match):
        w.plan(**table, num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS)


# --- plan(): the C++ planner against the numpy path ------------------------------------------------
def _shipped(w) -> tuple:
    """What a plan leaves for the device and the op: the shipped buffer up to its end, its
    layout (views key) and the op's launch arguments."""
    plan = w._plan
    shipped = w._plan_buffer
    end = shipped.end
    return (shipped.buf[:end].clone(), shipped.views_key, plan.args[8], plan.args[9], plan.args[10] is not None,
            plan.kv_heads_per_block, plan.cluster, plan.cluster_warps, plan.batch, plan.capacity)


def _plan_both(native, reference, numpy_plans: list, lens, args: dict, plan_kwargs: dict, monkeypatch,
               fresh_configs: bool) -> bool:
    """Plans `args` on the C++ planner's wrapper and on the numpy path's; both raise the
    same error, or ship the same buffer and launch (True: compared)."""
    errors = []
    for w, flag in ((native, "1"), (reference, "0")):
        monkeypatch.setenv("FLASHINFER_JIT_NATIVE_PLAN", flag)
        if fresh_configs:
            w._configs.clear()  # the planner choice is made per configuration
        try:
            w.plan(**args, **plan_kwargs)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    assert errors[0] == errors[1], lens
    if errors[0] is not None:
        numpy_plans.clear()  # (the C++ planner leaves what it rejects to the numpy path's error)
        return False
    assert not numpy_plans, f"the C++ planner left {len(lens)} requests to the numpy path"
    assert reference._plan.config.native is False
    a, b = _shipped(native), _shipped(reference)
    assert torch.equal(a[0], b[0]), f"buffers differ for {len(lens)} requests"
    assert a[1:] == b[1:]
    return True


PLAN_CONFIGS = [  # (num_qo_heads, num_kv_heads, head_dim, kv dtype, plan kwargs)
    (32, 8, 128, torch.float16, {}),
    (32, 8, 128, torch.float16, dict(q_len_per_req=4)),  # 16-row multi-token tiles: 3 an SM
    (64, 8, 128, torch.float8_e4m3fn, dict(q_len_per_req=2)),
    (64, 8, 128, torch.float16, {}),
    (32, 8, 128, torch.float8_e4m3fn, {}),           # paired KV heads where the grid fills the SMs
    (64, 8, 128, torch.float8_e4m3fn, {}),
    (128, 8, 128, torch.float16, {}),                # 16-head tiles
    (32, 32, 128, torch.float16, {}),                # group 1 (tensor cores, 1-head tiles)
    (32, 8, 64, torch.float16, dict(pos_encoding_mode="ROPE_LLAMA")),
    (32, 8, 256, torch.float16, {}),
    (32, 8, 128, torch.float16, dict(fixed_split_size=96)),
    (32, 8, 128, torch.float16, dict(disable_split_kv=True)),
]


@functools.lru_cache(maxsize=None)
def _planner_batches(table: str) -> list:
    """(lengths, page-table arguments) of the planner tests, made once per layout."""
    rnd = random.Random(7)
    batches = [[2048] * 256, [1000], [700, 0, 33], [], [0, 0], [32768], [5] * 3, [8192, 8193], [8192] * 160,
               [rnd.randint(1, 300) for _ in range(56)] + [8192] * 8,
               [512] * 16, [4096] * 16, [1024, 3000] * 6, [2048] * 20]  # grids that cover the SMs unsplit
    for _ in range(6):
        lens = [rnd.choice([0, 1, 16, 17, rnd.randint(1, 3000)]) for _ in range(rnd.randint(1, 300))]
        lens[rnd.randrange(len(lens))] = rnd.randint(1, 40000)  # one long request, or none
        batches.append(lens)
    return [(lens, csr(lens, seed=i) if table == "csr" else
             block_table(lens, kv_separate=table == "block_table_kv_separate", seed=i))
            for i, lens in enumerate(batches)]


@pytest.mark.parametrize("config", range(len(PLAN_CONFIGS)))
@pytest.mark.parametrize("table", ["csr", "block_table", "block_table_kv_separate"])
@pytest.mark.parametrize("with_clusters", [False, True], ids=["sm80", "sm90"])
def test_native_planner_matches_the_numpy_path(config, table, with_clusters, op, monkeypatch):
    """plan() through the C++ planner (csrc/decode/decode_plan.h) ships the same buffer and
    launch as through the numpy path (FLASHINFER_JIT_NATIVE_PLAN=0), over random
    batches: uniform, skewed, short, long, empty requests, one request, none; with and
    without the cluster split; and with a workspace so small that chunks double."""
    if with_clusters:
        monkeypatch.setattr(decode, "supports_clusters", lambda device: True)
    hq, hk, d, kv_dtype, kwargs = PLAN_CONFIGS[config]
    for workspace_bytes in (WORKSPACE_BYTES, 64 << 10):
        ws = torch.zeros(workspace_bytes, dtype=torch.uint8)
        native = fij.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        numpy_ws = torch.zeros(workspace_bytes, dtype=torch.uint8)
        reference = fij.BatchDecodeWithPagedKVCacheWrapper(numpy_ws, "NHD", use_tensor_cores=True)
        numpy_plans = []  # the native wrapper's plans that took the numpy path
        numpy_path = native._host_page_table  # the numpy path's first step
        native._host_page_table = lambda *a: numpy_plans.append(a) or numpy_path(*a)
        plan_kwargs = dict(num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=PS,
                           q_data_type=torch.float16, kv_data_type=kv_dtype, **kwargs)
        for lens, args in _planner_batches(table):
            _plan_both(native, reference, numpy_plans, lens, args, plan_kwargs, monkeypatch, fresh_configs=True)


@pytest.mark.parametrize("bad", [
    dict(last_page_len=torch.tensor([0], dtype=torch.int32)),
    dict(last_page_len=torch.tensor([PS + 1], dtype=torch.int32)),
    dict(indptr=torch.tensor([1, 3], dtype=torch.int32)),
    dict(indptr=torch.tensor([0, 99], dtype=torch.int32)),
])
def test_native_planner_leaves_bad_csr_to_the_numpy_errors(bad, op):
    """Input the planner rejects reaches the numpy path, which raises its own message."""
    args = csr([40]) | bad
    w = wrapper()
    with pytest.raises(ValueError, match="last_page_len|indptr"):
        w.plan(**args, num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.float16)


@pytest.mark.parametrize("config", [0, 1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("table", ["csr", "block_table"])
@pytest.mark.parametrize("capacity", [1, 8, 300])
@pytest.mark.parametrize("with_clusters", [False, True], ids=["sm80", "sm90"])
def test_native_planner_matches_the_numpy_path_in_cuda_graph_mode(config, table, capacity, with_clusters, op,
                                                                  monkeypatch):
    """The same in CUDA-graph mode: arrays padded to the capacity, the grid fixed by it
    (spare rows zero), KV-head pairs and clusters decided by it; consecutive plans of
    fewer requests."""
    if with_clusters:
        monkeypatch.setattr(decode, "supports_clusters", lambda device: True)
    hq, hk, d, kv_dtype, kwargs = PLAN_CONFIGS[config]
    plan_kwargs = dict(num_qo_heads=hq, num_kv_heads=hk, head_dim=d, page_size=PS, q_data_type=torch.float16,
                       kv_data_type=kv_dtype, **kwargs)
    pool = 1 << 20
    wrappers = []
    for flag in ("1", "0"):
        monkeypatch.setenv("FLASHINFER_JIT_NATIVE_PLAN", flag)
        w = wrapper(graph_capacity=capacity, pool=pool, use_tensor_cores=True)
        first = [3000] * capacity  # the capture-time plan sets the capacity
        args = csr(first) if table == "csr" else block_table(first)
        w.plan(**args, **plan_kwargs)
        wrappers.append(w)
    native, reference = wrappers
    compared = 0
    numpy_plans = []
    numpy_path = native._host_page_table
    native._host_page_table = lambda *a: numpy_plans.append(a) or numpy_path(*a)
    # (4: the multi-token configs' longest q_len_per_req, the shortest request they take)
    singles = [([n], csr([n], seed=n) if table == "csr" else block_table([n], seed=n)) for n in (5, 0, 4, 2048, 2999)]
    for lens, args in _planner_batches(table) + singles:
        if not lens or len(lens) > capacity:
            continue
        if table == "block_table":  # the capture's width, as an engine's block-table buffer has
            fixed = native._graph_ids.block_tables.shape[1]
            bt = args["block_tables"]
            if bt.shape[1] > fixed:
                continue
            args = dict(args, block_tables=torch.nn.functional.pad(bt, (0, fixed - bt.shape[1]), value=7))
        compared += _plan_both(native, reference, numpy_plans, lens, args, plan_kwargs, monkeypatch,
                               fresh_configs=False)
    assert compared >= 5, compared


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_csr_plans_reach_the_planner_through_the_extension(graph, monkeypatch):
    """plan() of a CSR table in the common form (int32 host indptr and last_page_len) calls the
    C++ planner through fij_fastcall.decode_plan, without ctypes' conversions; the plan is
    the one the ctypes call gives (and, in the comparisons above, the numpy path's)."""
    if fastcall.extension() is None:
        pytest.skip("the fij_fastcall extension is unavailable here")
    monkeypatch.setenv("FLASHINFER_JIT_NATIVE_PLAN", "1")
    w = fij.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8), "NHD", use_tensor_cores=True,
                                               use_cuda_graph=graph)
    kwargs = dict(num_qo_heads=32, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.bfloat16)
    w.plan(**csr(SKEWED), **kwargs)
    native = w._plan.config.native
    run, address = native[3]
    calls = []
    w._plan.config.native = native[:3] + ((lambda *a: calls.append(a[2]) or run(*a), address),)
    table = csr(SKEWED[::-1], seed=3)
    w.plan(**table, **kwargs)
    assert calls and calls[0] is table["indptr"]
    through_extension = _shipped(w)
    w._plan.config.native = native[:3] + (None,)
    w.plan(**table, **kwargs)
    through_ctypes = _shipped(w)
    assert torch.equal(through_extension[0], through_ctypes[0])
    assert through_extension[1:] == through_ctypes[1:]


# --- the planners' start offset (POD: two work lists in one buffer) -------------------------------
SENTINEL = -7  # what a host buffer holds before a planner writes it


def _native_at(w, table: dict, batch: int, start: int, capacity: int = 0, host_size: int = 1 << 18):
    """(status, host buffer, results) of the C++ planner (csrc/decode/decode_plan.h) for the CSR
    table `table`, under w's last plan's configuration, writing its section from `start`."""
    fn, _, struct, _ = decode._native_config(w._plan.config)
    struct.start = start
    host = np.full(host_size, SENTINEL, dtype=np.int32)
    result = np.zeros(7, dtype=np.int64)
    code = fn(ctypes.addressof(struct), table["indptr"].data_ptr(), table["last_page_len"].data_ptr(), None, batch,
              table["indices"].shape[0], capacity, host.ctypes.data, host_size, result.ctypes.data)
    return code, host, result


@pytest.mark.parametrize("lens", [SKEWED, [2048] * 64, [700, 0, 33]], ids=["skewed", "uniform", "short"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_native_planner_writes_its_section_at_a_start_offset(lens, graph, op, monkeypatch):
    """The C++ planner at start k writes what it writes at 0, k ints later, and nothing
    before k; and it is the numpy path's buffer (FLASHINFER_JIT_NATIVE_PLAN=0), shifted."""
    monkeypatch.setenv("FLASHINFER_JIT_NATIVE_PLAN", "0")
    capacity = len(lens) if graph else 0  # (a CUDA-graph wrapper's first plan sets it)
    table = csr(lens)
    kwargs = dict(num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.float16)
    reference = wrapper(graph_capacity=capacity or None, pool=1 << 16)
    reference.plan(**table, **kwargs)
    monkeypatch.setenv("FLASHINFER_JIT_NATIVE_PLAN", "1")
    code, at_zero, result = _native_at(reference, table, len(lens), 0, capacity)
    assert code == 0
    end = decode._offsets("csr", capacity or len(lens), int(result[5]), 0)[-1]
    np.testing.assert_array_equal(at_zero[:end], _shipped(reference)[0].numpy())
    assert (at_zero[end:] == SENTINEL).all()
    for start in (1, 37, 4096):
        code, shifted, shifted_result = _native_at(reference, table, len(lens), start, capacity)
        assert code == 0 and (shifted_result == result).all()
        assert (shifted[:start] == SENTINEL).all(), "the planner wrote before its start"
        np.testing.assert_array_equal(shifted[start:start + end], at_zero[:end])
        assert (shifted[start + end:] == SENTINEL).all()
    # too small a buffer: the size it needs counts the start
    assert _native_at(reference, table, len(lens), 100, capacity, host_size=100 + end - 1)[0] == 100 + end


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_native_planner_reports_a_request_under_min_kv_len(graph, op, monkeypatch):
    """DecodePlanConfig.min_kv_len (q_len_per_req where > 1): a shorter request is -7, and
    nothing is written; a plan of one token a request (min_kv_len 0) takes empty requests.
    plan() then raises the numpy path's "empty KV range" error."""
    monkeypatch.setenv("FLASHINFER_JIT_NATIVE_PLAN", "1")
    kwargs = dict(num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=PS, q_data_type=torch.float16)
    multi = wrapper(graph_capacity=3 if graph else None, pool=64, use_tensor_cores=True)
    multi.plan(**csr([40, 4, 700]), **kwargs, q_len_per_req=4)
    assert multi._plan.config.native is not False
    capacity = 3 if graph else 0
    for lens, want in (([40, 4, 700], 0), ([40, 3, 700], -7), ([0, 40, 40], -7), ([], 0)):
        code, host, _ = _native_at(multi, csr(lens), len(lens), 0, capacity)
        assert code == want, lens
        if want:
            assert (host == SENTINEL).all()
    one = wrapper(graph_capacity=3 if graph else None, pool=64)
    one.plan(**csr([40, 0, 700]), **kwargs)
    assert _native_at(one, csr([0, 1, 0]), 3, 0, capacity)[0] == 0
    with pytest.raises(ValueError, match="request 1 has kv_len 3 < q_len_per_req 4, an empty KV range"):
        multi.plan(**csr([40, 3, 700]), **kwargs, q_len_per_req=4)


@pytest.mark.parametrize("capacity", [None, 48], ids=["eager", "graph"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
def test_numpy_packing_writes_its_section_at_a_start_offset(capacity, split):
    """The numpy twin (pack_plan at _offsets(..., start)) writes the same ints k later and
    nothing before k: split lists and one item per request, eager and padded to a capacity."""
    lens = SKEWED
    batch, table = len(lens), csr(lens)
    kv_lens = np.array(lens, dtype=np.int64)
    cap = capacity or batch
    if split:
        _, work, merge, _ = decode.plan_split(kv_lens, HK, cpu_target_blocks(HQ, HK, D), None, False)
        grid = max(len(work), 4 * cap) if capacity else len(work)
    else:
        work = merge = None
        grid = cap
    host_tables = (table["indptr"].numpy(), table["last_page_len"].numpy())
    sections = []
    for start in (0, 53):
        offsets = decode._offsets("csr", cap, grid, 0, start)
        host = np.full(offsets[-1] + 16, SENTINEL, dtype=np.int32)
        decode.pack_plan(host, offsets, cap, host_tables, kv_lens, work, merge, None)
        assert (host[:start] == SENTINEL).all(), "pack_plan wrote before its start"
        assert (host[offsets[-1]:] == SENTINEL).all()
        assert (host[start:offsets[-1]] != SENTINEL).all(), "every int of the section is written"
        sections.append(host[start:offsets[-1]])
    np.testing.assert_array_equal(sections[0], sections[1])

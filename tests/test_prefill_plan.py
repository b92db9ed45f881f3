"""Batch prefill's plan() on the host: the C++ planner (csrc/prefill/prefill_plan.h) against its
numpy twin (prefill._plan_numpy / plan_work), the work list's invariants, and plan()'s
errors. CPU only: plan() on a CPU workspace validates and plans without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashinfer_jit.prefill import wrapper as prefill
from flashinfer_jit.prefill.wrapper import _CSR, _RAGGED, _SEQ_LENS, _native_planner, _plan_numpy, _PlanConfig


def _config(side, group=4, heads=8, causal=1, page_size=16, split=1, fixed=0, capacity=0, partial=10**9, tile=0,
            short=0, max_tile=128):
    return _PlanConfig(group=group, num_kv_heads=heads, kv_side=side, page_size=page_size, causal=causal,
                       tile_rows=tile, max_tile_rows=max_tile, target_blocks=264, min_chunk=256, fixed_split_size=fixed,
                       split=split, capacity=capacity, short_causal_keys=short, work_capacity=0,
                       max_partial_rows=partial, max_kv_len=0)


def _batch(rng, b, side, page_size=16, long=False):
    qo = rng.integers(0, 2000 if long else 40, b)
    kv = qo + rng.integers(0, 3000 if long else 100, b)
    kv[rng.random(b) < 0.1] = 0  # padding requests
    return _index_arrays(qo, kv, side, page_size)


def _index_arrays(qo, kv, side, page_size=16):
    """(qo_indptr, the K/V side's first array, its second or None) of these lengths."""
    qo_indptr = torch.tensor(np.concatenate(([0], np.cumsum(qo))), dtype=torch.int32)
    if side == _RAGGED:
        return qo_indptr, torch.tensor(np.concatenate(([0], np.cumsum(kv))), dtype=torch.int32), None
    if side == _SEQ_LENS:
        return qo_indptr, torch.tensor(kv, dtype=torch.int32), None
    pages = -(-kv // page_size)
    last = np.where(pages > 0, kv - (pages - 1) * page_size, 0)
    return (qo_indptr, torch.tensor(np.concatenate(([0], np.cumsum(pages))), dtype=torch.int32),
            torch.tensor(last, dtype=torch.int32))


def _run_native(cfg, qo, a, b, batch):
    fn, _ = _native_planner()
    host = np.zeros(1 << 22, dtype=np.int32)
    result = np.zeros(12, dtype=np.int64)
    status = fn(__import__("ctypes").addressof(cfg), qo.data_ptr(), a.data_ptr(), b.data_ptr() if b is not None
                else None, batch, host.ctypes.data, host.shape[0], result.ctypes.data)
    return status, host, result


@pytest.mark.parametrize("side", [_CSR, _SEQ_LENS, _RAGGED])
@pytest.mark.parametrize("seed", range(4))
def test_native_planner_matches_numpy(side, seed):
    rng = np.random.default_rng(seed)
    long = seed % 2 == 1
    qo, a, b = _batch(rng, 3 if long else 37, side, long=long)
    batch = qo.shape[0] - 1
    for fixed, short in ((0, 0), (256, 0), (0, 256), (0, 64)):
        cfg = _config(side, fixed=fixed, causal=seed % 3 != 0, short=short)
        status, host, result = _run_native(cfg, qo, a, b, batch)
        ref_host = np.zeros_like(host)
        ref_result = np.zeros(12, dtype=np.int64)
        assert _plan_numpy(cfg, qo, a, b, batch, ref_host, ref_result) == status == 0
        np.testing.assert_array_equal(result, ref_result)
        end = int(result[prefill._END])
        np.testing.assert_array_equal(host[:end], ref_host[:end])


@pytest.mark.parametrize("side", [_CSR, _SEQ_LENS, _RAGGED])
def test_native_planner_matches_numpy_on_a_large_batch_with_ties(side):
    """The planner orders requests by their heaviest pair (ties in request order) and each
    request's pairs by cost (ties in their order): 300 requests, many of equal lengths
    (decode-like, one pair each), some long (several tiles and chunks), some padding."""
    rng = np.random.default_rng(11)
    b = 300
    qo = np.where(rng.random(b) < 0.6, 4, rng.integers(0, 300, b))
    kv = np.where(qo == 4, 1024, qo + rng.integers(0, 3000, b))
    kv[rng.random(b) < 0.05] = 0
    qo_indptr, a, last = _index_arrays(qo, kv, side)
    for causal, fixed, tile in ((0, 0, 0), (1, 0, 64), (1, 256, 0), (0, 512, 128)):
        cfg = _config(side, causal=causal, fixed=fixed, tile=tile)
        status, host, result = _run_native(cfg, qo_indptr, a, last, b)
        ref_host, ref_result = np.zeros_like(host), np.zeros(12, dtype=np.int64)
        assert _plan_numpy(cfg, qo_indptr, a, last, b, ref_host, ref_result) == status == 0
        np.testing.assert_array_equal(result, ref_result)
        end = int(result[prefill._END])
        np.testing.assert_array_equal(host[:end], ref_host[:end])


def test_work_list_covers_every_row_and_key_once():
    rng = np.random.default_rng(7)
    qo, a, _ = _batch(rng, 9, _RAGGED, long=True)
    cfg = _config(_RAGGED, fixed=512, causal=0)
    status, host, result = _run_native(cfg, qo, a, None, qo.shape[0] - 1)
    assert status == 0 and result[prefill._PARTIAL_ROWS] > 0
    w = host[int(result[prefill._WORK_AT]):]
    heads = 8
    assert w[0] % heads == 0
    pairs = w[1: 1 + prefill._PAIR_INTS * (w[0] // heads)].reshape(-1, prefill._PAIR_INTS)
    # item i: pair i // heads, KV head i % heads (csrc/prefill/prefill.cuh load_prefill_item), as
    # (request, kv_head, row0, kv_start, kv_end)
    items = np.array([(*pairs[i // heads][:1], i % heads, *pairs[i // heads][1:4]) for i in range(w[0])])
    qo_lens, kv_lens = np.diff(qo.numpy()), np.diff(a.numpy())
    tile = int(result[prefill._TILE_ROWS])
    for b in range(qo_lens.shape[0]):
        for h in range(heads):
            mine = items[(items[:, 0] == b) & (items[:, 1] == h)]
            rows = set(mine[:, 2].tolist())
            assert rows == set(range(0, qo_lens[b] * 4, tile))
            for r in rows:
                chunks = mine[mine[:, 2] == r]
                spans = sorted(zip(chunks[:, 3].tolist(), chunks[:, 4].tolist()))
                covered = [j for lo, hi in spans for j in range(lo, hi)]
                assert covered == list(range(kv_lens[b]))


@pytest.mark.parametrize("kv_lens", [[4096] * 32, [8192], [5000, 300, 0, 2900]])
def test_split_chunks_are_even_within_a_request(kv_lens):
    """plan()'s own split evens a request's chunks out (its keys over its chunks, up to a
    multiple of 64: 4096 keys as 2 x 2048, not 4032 + 64) and covers every key once, in
    the C++ planner and the numpy twin alike; a fixed_split_size is kept as given."""
    kv_lens = np.array(kv_lens)
    qo_lens = np.minimum(kv_lens, 4 if kv_lens.shape[0] > 1 else 512)
    qo = torch.tensor(np.concatenate(([0], np.cumsum(qo_lens))), dtype=torch.int32)
    a = torch.tensor(np.concatenate(([0], np.cumsum(kv_lens))), dtype=torch.int32)
    batch = kv_lens.shape[0]
    for fixed in (0, 1024):
        cfg = _config(_RAGGED, fixed=fixed, causal=1)
        status, host, result = _run_native(cfg, qo, a, None, batch)
        ref_host, ref_result = np.zeros_like(host), np.zeros(12, dtype=np.int64)
        assert _plan_numpy(cfg, qo, a, None, batch, ref_host, ref_result) == status == 0
        np.testing.assert_array_equal(host[:int(result[prefill._END])], ref_host[:int(result[prefill._END])])
        assert result[prefill._PARTIAL_ROWS] > 0
        w = host[int(result[prefill._WORK_AT]):]
        pairs = w[1: 1 + prefill._PAIR_INTS * (w[0] // 8)].reshape(-1, prefill._PAIR_INTS)
        for b in range(batch):
            mine = pairs[(pairs[:, 0] == b) & (pairs[:, 1] == 0)]
            spans = sorted(zip(mine[:, 2].tolist(), mine[:, 3].tolist()))
            if kv_lens[b] == 0:
                assert spans in ([], [(0, 0)])
                continue
            assert [j for lo, hi in spans for j in range(lo, hi)] == list(range(kv_lens[b]))
            sizes = [hi - lo for lo, hi in spans]
            assert all(lo % 64 == 0 for lo, _ in spans)
            if fixed:
                assert all(n == fixed for n in sizes[:-1])
            elif len(spans) > 1:
                assert max(sizes) - min(sizes) < 64 * len(spans)
                assert sizes[0] == -(-(-(-kv_lens[b] // len(spans))) // 64) * 64
        if not fixed and batch == 32:
            assert sorted(set(spans)) == [(0, 2048), (2048, 4096)]


@pytest.mark.parametrize("side", [_RAGGED, _CSR, _SEQ_LENS])
def test_work_pairs_carry_their_requests_extent(side):
    """Each pair carries its request's qo_indptr[b], qo_len, kv_len and kv_indptr[b] (ragged)
    or the page table's indptr[b] (CSR)
    (fields 7-10: the kernel reads them with the pair instead of after it), in the C++
    planner and the numpy twin alike; padding requests included."""
    rng = np.random.default_rng(8)
    qo, a, b_arg = _batch(rng, 23, side, long=side == _RAGGED)
    batch = qo.shape[0] - 1
    cfg = _config(side, fixed=512 if side == _CSR else 0, causal=0)
    status, host, result = _run_native(cfg, qo, a, b_arg, batch)
    assert status == 0
    ref_host, ref_result = np.zeros_like(host), np.zeros(12, dtype=np.int64)
    assert _plan_numpy(cfg, qo, a, b_arg, batch, ref_host, ref_result) == 0
    np.testing.assert_array_equal(host[:int(result[prefill._END])], ref_host[:int(result[prefill._END])])
    w = host[int(result[prefill._WORK_AT]):]
    pairs = w[1: 1 + prefill._PAIR_INTS * (w[0] // 8)].reshape(-1, prefill._PAIR_INTS)
    assert pairs.shape[0] > 0
    qo_np = qo.numpy()
    if side == _RAGGED:
        kv_lens, kv_first = np.diff(a.numpy()), a.numpy()[:-1]
    elif side == _SEQ_LENS:
        kv_lens, kv_first = a.numpy(), np.zeros(batch, dtype=np.int64)
    else:
        pages = np.diff(a.numpy())
        kv_lens = np.where(pages > 0, (pages - 1) * 16 + b_arg.numpy(), 0)
        kv_first = a.numpy()[:-1]
    r = pairs[:, 0]
    np.testing.assert_array_equal(pairs[:, 7], qo_np[r])
    np.testing.assert_array_equal(pairs[:, 8], qo_np[r + 1] - qo_np[r])
    np.testing.assert_array_equal(pairs[:, 9], kv_lens[r])
    np.testing.assert_array_equal(pairs[:, 10], kv_first[r])


@pytest.mark.parametrize("fixed", [0, 512])
def test_work_list_keeps_requests_together_heaviest_first(fixed):
    """Requests by their heaviest pair, descending; each request's pairs contiguous and
    descending in the keys they see (blocks in flight share a request's K/V in L2)."""
    qo = torch.tensor([0, 256, 512, 600, 1600, 1601], dtype=torch.int32)  # 256, 256, 88, 1000, 1
    kv = torch.tensor([0, 256, 512, 700, 2700, 2701], dtype=torch.int32)
    cfg = _config(_RAGGED, fixed=fixed, causal=1)
    status, host, result = _run_native(cfg, qo, kv, None, 5)
    assert status == 0
    w = host[int(result[prefill._WORK_AT]):]
    pairs = w[1: 1 + prefill._PAIR_INTS * (w[0] // 8)].reshape(-1, prefill._PAIR_INTS)
    qo_lens, kv_lens = np.diff(qo.numpy()), np.diff(kv.numpy())
    tile = int(result[prefill._TILE_ROWS])
    # the keys each pair sees: causal stops at its last row's diagonal, within its chunk
    last_token = np.minimum(qo_lens[pairs[:, 0]], (pairs[:, 1] + tile - 1) // 4 + 1) - 1
    visible = last_token + kv_lens[pairs[:, 0]] - qo_lens[pairs[:, 0]] + 1
    cost = np.maximum(np.minimum(pairs[:, 3], visible) - pairs[:, 2], 0)
    order = [int(r) for i, r in enumerate(pairs[:, 0]) if i == 0 or pairs[i - 1, 0] != r]
    assert sorted(order) == sorted(set(order)), f"a request's pairs are not contiguous: {order}"
    heaviest = [int(cost[pairs[:, 0] == r].max()) for r in order]
    assert heaviest == sorted(heaviest, reverse=True) and order[0] == 3
    for r in order:
        mine = cost[pairs[:, 0] == r]
        assert (np.diff(mine) <= 0).all()


@pytest.mark.parametrize("side,status", [(_CSR, 3), (_RAGGED, 2), (_SEQ_LENS, 5)])
def test_native_planner_rejects_bad_kv_side(side, status):
    qo = torch.tensor([0, 4, 8], dtype=torch.int32)
    if side == _CSR:
        a, b = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([5, 17], dtype=torch.int32)  # 17 > page
    elif side == _RAGGED:
        a, b = torch.tensor([0, 9, 5], dtype=torch.int32), None
    else:
        a, b = torch.tensor([9, -1], dtype=torch.int32), None
    got, _, result = _run_native(_config(side), qo, a, b, 2)
    assert got == status and result[1] == 1


def _paged(**kwargs):
    w = prefill.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), **kwargs)
    return w


def _plan(w, qo, indptr, last, causal=True, **kwargs):
    w.plan(torch.tensor(qo, dtype=torch.int32), torch.tensor(indptr, dtype=torch.int32),
           torch.arange(max(indptr[-1], 1), dtype=torch.int32), torch.tensor(last, dtype=torch.int32), 8, 2, 128, 16,
           causal=causal, q_data_type=torch.bfloat16, **kwargs)


@pytest.mark.parametrize("qo,match", [([0, 5, 3], "qo_indptr"), ([1, 5, 9], "qo_indptr")])
def test_plan_rejects_bad_qo_indptr(qo, match):
    with pytest.raises(ValueError, match=match):
        _plan(_paged(), qo, [0, 1, 2], [5, 5], causal=False)


def test_plan_takes_causal_kv_shorter_than_qo():
    """FlashInfer's semantics: bottom-right aligned, the rows above the diagonal see no key
    (their zeros and -inf are the kernel's; test_prefill.py checks them on a GPU)."""
    _plan(_paged(), [0, 4, 24], [0, 1, 2], [5, 5])


@pytest.mark.parametrize("side", [_CSR, _SEQ_LENS, _RAGGED])
def test_native_planner_matches_numpy_where_causal_rows_see_no_key(side):
    """Causal requests with fewer keys than queries (some rows, whole tiles, whole requests
    above the diagonal), split and not: the C++ planner and its numpy twin agree."""
    qo = np.array([20, 7, 300, 0, 5, 129, 64])
    kv = np.array([5, 7, 64, 3, 0, 1, 2000])
    qo_indptr, a, b = _index_arrays(qo, kv, side)
    for fixed in (0, 64):
        cfg = _config(side, fixed=fixed, causal=1)
        status, host, result = _run_native(cfg, qo_indptr, a, b, qo.shape[0])
        ref_host, ref_result = np.zeros_like(host), np.zeros(12, dtype=np.int64)
        assert _plan_numpy(cfg, qo_indptr, a, b, qo.shape[0], ref_host, ref_result) == status == 0
        np.testing.assert_array_equal(result, ref_result)
        end = int(result[prefill._END])
        np.testing.assert_array_equal(host[:end], ref_host[:end])


def test_plan_rejects_decreasing_kv_indptr_and_bad_last_page_len():
    with pytest.raises(ValueError, match="paged_kv_indptr"):
        _plan(_paged(), [0, 1, 2], [0, 2, 1], [5, 5], causal=False)
    with pytest.raises(ValueError, match="paged_kv_last_page_len"):
        _plan(_paged(), [0, 1, 2], [0, 1, 2], [5, 0], causal=False)


def test_plan_rejects_unsupported_heads_and_backends():
    with pytest.raises(ValueError, match="head_dim_qk=96"):
        _paged().plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                      torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), 8, 2, 96, 16)
    with pytest.raises(ValueError, match="num_qo_heads"):
        _paged().plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                      torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), 6, 4, 128, 16)
    with pytest.raises(ValueError, match="fa3.*Hopper"):  # (the Hopper path: at plan(), on a GPU workspace)
        _plan(_paged(backend="fa3"), [0, 1, 2], [0, 1, 2], [5, 5], causal=False)
    with pytest.raises(ValueError, match="backend"):
        _paged(backend="trtllm-gen")


def test_plan_rejects_packed_mask_without_indptr_or_of_wrong_length():
    mask = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="mask_indptr"):
        _plan(_paged(), [0, 2, 4], [0, 1, 2], [5, 5], causal=False, packed_custom_mask=mask)
    with pytest.raises(ValueError, match="mask_indptr"):
        _plan(_paged(), [0, 2, 4], [0, 1, 2], [5, 5], causal=False, packed_custom_mask=mask,
              mask_indptr=torch.tensor([0, 1, 3], dtype=torch.int32))


def test_graph_wrapper_keeps_its_capacity():
    buf = torch.zeros(64, dtype=torch.int32)
    w = _paged(use_cuda_graph=True, paged_kv_indices_buf=buf)
    _plan(w, [0, 3, 6], [0, 1, 2], [5, 5])
    _plan(w, [0, 7], [0, 1], [9])  # fewer requests: fine
    with pytest.raises(ValueError, match="capacity|exceeds"):
        _plan(w, [0, 1, 2, 3], [0, 1, 2, 3], [5, 5, 5])


@pytest.mark.parametrize("head_dim", [128, 256])
def test_tile_choice_and_graph_wrappers_at_head_dim_256(head_dim):
    """Long queries take the 128-row tile at every head_dim (at 256: 8 warps, one block an
    SM); short queries (16 rows a request) take 64 rows. A CUDA-graph wrapper holds the tile
    of its first plan() (a captured run() replays that tile's kernel, which covers only its
    own rows of an item), and at head_dim 256 never takes the 128-row tile (its grid loops;
    that kernel takes one item a block). Its grid is a wave of the tile's blocks."""
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    long_tile = 64 if head_dim == 256 else 128
    cases = ((False, ((512, 128), (4, 64))), (True, ((512, long_tile), (4, long_tile))),
             (True, ((4, 64), (512, 64))))
    for graph, plans in cases:
        kwargs = dict(use_cuda_graph=True, paged_kv_indices_buf=torch.zeros(64, dtype=torch.int32)) if graph else {}
        w = _paged(**kwargs)
        for qo_len, tile in plans:
            w.plan(i32([0, qo_len, 2 * qo_len]), i32([0, 32, 64]), i32(list(range(64))), i32([16, 16]), 32, 8,
                   head_dim, 16, causal=True, q_data_type=torch.bfloat16)
            assert w._plan.tile_rows == tile, (graph, qo_len)
            if graph:
                assert w._plan.grid == 132 * prefill._blocks_per_sm(head_dim, tile), (head_dim, tile)


@pytest.mark.parametrize("side", [_CSR, _SEQ_LENS, _RAGGED])
def test_pinned_tile_is_held_to_the_largest_the_wrapper_runs(side):
    """A pinned tile (tile_rows, the tests' and benchmarks' _force_tile_rows) larger than
    max_tile_rows takes max_tile_rows, in both planners: a CUDA-graph wrapper at head_dim 256
    never gets the 128-row tile, whose kernel takes one item a block (csrc/prefill/prefill.cuh
    kOneItemABlock) and would leave a looping grid's later items undone."""
    qo, a, b = _index_arrays(np.array([512, 300, 7]), np.array([600, 300, 900]), side)
    for tile, max_tile, expected in ((128, 64, 64), (128, 128, 128), (64, 128, 64), (0, 64, 64)):
        cfg = _config(side, tile=tile, max_tile=max_tile)
        host = np.zeros(1 << 20, dtype=np.int32)
        result = np.zeros(12, dtype=np.int64)
        assert _plan_numpy(cfg, qo, a, b, 3, host, result) == 0
        status, _, native = _run_native(cfg, qo, a, b, 3)
        assert status == 0
        assert result[prefill._TILE_ROWS] == native[prefill._TILE_ROWS] == expected, (tile, max_tile)


def test_graph_wrapper_at_head_dim_256_holds_a_pinned_tile_to_64_rows():
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    w = _paged(use_cuda_graph=True, paged_kv_indices_buf=torch.zeros(64, dtype=torch.int32))
    w._force_tile_rows = 128
    w.plan(i32([0, 512, 1024]), i32([0, 32, 64]), i32(list(range(64))), i32([16, 16]), 32, 8, 256, 16,
           causal=False, q_data_type=torch.bfloat16)
    assert w._plan.tile_rows == 64


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_short_causal_requests_take_64_rows_at_head_dim_256(head_dim, causal):
    """At head_dim 256, causal batches whose requests average at most 256 keys take the
    64-row tile (measured 2-6% faster on the H100 than the 8-warp 128-row tile, which is one
    block an SM); longer ones, non-causal ones and other head dims keep 128 rows."""
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    w = _paged()
    for qo_len, kv_pages in ((256, 16), (128, 16), (256, 17), (1024, 64), (200, 32)):
        w.plan(i32([0, qo_len, 2 * qo_len]), i32([0, kv_pages, 2 * kv_pages]), i32(list(range(2 * kv_pages))),
               i32([16, 16]), 32, 8, head_dim, 16, causal=causal, q_data_type=torch.bfloat16)
        short = head_dim == 256 and causal and kv_pages * 16 <= 256
        assert w._plan.tile_rows == (64 if short else 128), (qo_len, kv_pages)


def _plans_and_errors(w_paged, w_ragged) -> list:
    """What plan() leaves for a few batches (the plan buffer, its layout, the plan's
    numbers) and the errors of bad ones, for index vectors of several forms."""
    rng = np.random.default_rng(3)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    got = []

    def record(w, call):
        try:
            call()
        except (ValueError, TypeError) as exc:
            got.append((type(exc).__name__, str(exc)))
            return
        buf, key, p = w._plan_buffer.buf, w._plan_buffer.views_key, w._plan
        got.append((buf[: w._plan_buffer.end].tolist(), key, p.batch, p.qo_tokens, p.tile_rows, p.grid, p.merge_rows))

    for b in (1, 7, 256):
        qo = rng.integers(1, 17, b)
        kv = qo + rng.integers(0, 2000, b)
        pages = -(-kv // 16)
        qo_indptr, indptr = np.concatenate(([0], np.cumsum(qo))), np.concatenate(([0], np.cumsum(pages)))
        last, ids = kv - (pages - 1) * 16, torch.arange(int(indptr[-1]), dtype=torch.int32)
        kv_indptr = np.concatenate(([0], np.cumsum(kv)))
        for form in (i32, lambda v: torch.tensor(v), lambda v: i32(np.repeat(v, 2))[::2]):  # int32, int64, strided
            for causal in (True, False):
                record(w_paged, lambda: w_paged.plan(form(qo_indptr), form(indptr), ids, form(last), 32, 8, 128, 16,
                                                     causal=causal, q_data_type=torch.bfloat16))
                record(w_ragged, lambda: w_ragged.plan(form(qo_indptr), form(kv_indptr), 32, 8, 128, causal=causal,
                                                       q_data_type=torch.bfloat16))
        record(w_paged, lambda: w_paged.plan(i32(qo_indptr), None, None, None, 32, 8, 128, 16,
                                             block_tables=torch.zeros(b, int(pages.max()), dtype=torch.int32),
                                             seq_lens=i32(kv), causal=True, q_data_type=torch.bfloat16))
    for qo, indptr, last in (([0, 5, 3], [0, 1, 2], [4, 4]), ([0, 1, 2], [0, 1], [4, 4]), ([0, 1, 2], [0, 1, 2], [4]),
                             ([0, 1, 2], [0, 2, 1], [4, 4]), ([0, 1, 2], [0, 1, 2], [4, 17]), ([0, 9], [0, 1], [4]),
                             ([], [0], [])):
        record(w_paged, lambda: w_paged.plan(i32(qo), i32(indptr), i32([0, 1]), i32(last), 8, 2, 128, 16,
                                             causal=True))
    record(w_paged, lambda: w_paged.plan(i32([0, 1, 2]), i32([0, 1, 2]), i32([0, 1]), None, 8, 2, 128, 16))
    record(w_ragged, lambda: w_ragged.plan(i32([0, 1, 2]), i32([0, 3, 1]), 8, 2, 128))
    return got


def test_plan_through_fij_fastcall_and_through_ctypes_alike(monkeypatch):
    """plan() hands index vectors of the common form (contiguous int32 CPU tensors) to the
    planner as given, through fij_fastcall, and any other form, or all of them without the
    extension, through ctypes after its conversions and checks: the same plan buffers and
    the same errors either way."""
    from flashinfer_jit.runtime import fastcall

    def wrappers():
        ws = torch.empty(1 << 24, dtype=torch.uint8)
        return prefill.BatchPrefillWithPagedKVCacheWrapper(ws), prefill.BatchPrefillWithRaggedKVCacheWrapper(ws)

    prefill._native_planner.cache_clear()
    fn, fast = _native_planner()
    if fast is None:
        pytest.skip("fij_fastcall is unavailable here (no Python.h or compiler)")
    calls = []

    def counted(*args):
        calls.append(fast[0](*args))
        return calls[-1]

    monkeypatch.setattr(prefill, "_native_planner", lambda: (fn, (counted, fast[1])))
    through_fastcall = _plans_and_errors(*wrappers())
    assert calls.count(-1) > 0 and sum(1 for c in calls if c >= 0) > 10  # both routes taken
    monkeypatch.undo()
    monkeypatch.setattr(fastcall, "extension", lambda: None)
    prefill._native_planner.cache_clear()
    try:
        assert prefill._native_planner()[1] is None
        through_ctypes = _plans_and_errors(*wrappers())
    finally:
        prefill._native_planner.cache_clear()
    assert through_fastcall == through_ctypes
    # the errors: 8 (causal qo 9 over 4 keys plans: its first rows see no key, as in FlashInfer)
    assert sum(1 for g in through_ctypes if len(g) == 2) == 8


@pytest.mark.parametrize("side", [_CSR, _SEQ_LENS, _RAGGED])
@pytest.mark.parametrize("causal", [0, 1])
def test_movable_pages(side, causal):
    """The planner reports the most pages of any request that plan()'s page order may move
    (flashinfer_jit/runtime/page_order.py): every page but the last; causal, at most those of keys
    j <= kv_len - qo_len (every query row sees them); ragged, none. Both planners agree."""
    qo_lens, kv_lens = np.array([4, 700, 0, 33, 1]), np.array([4096, 700, 300, 33 + 16 * 5 - 1, 16])
    # pages that may move a request: non-causal [255, 43, 18, 6, 0], causal [255, 0, 18, 5, 0]
    for first, want in ((0, 255), (1, 18 if causal else 43)):  # all requests, then without the first
        qo, a, b = _index_arrays(qo_lens[first:], kv_lens[first:], side)
        cfg = _config(side, causal=causal)
        status, _, result = _run_native(cfg, qo, a, b, 5 - first)
        ref_result = np.zeros(12, dtype=np.int64)
        assert status == _plan_numpy(cfg, qo, a, b, 5 - first, np.zeros(1 << 22, dtype=np.int32), ref_result) == 0
        want = 0 if side == _RAGGED else want
        assert int(result[prefill._MOVABLE_PAGES]) == int(ref_result[prefill._MOVABLE_PAGES]) == want


# --- the planners' start offset (POD: two work lists in one buffer) -------------------------------
SENTINEL = -7  # what a host buffer holds before a planner writes it


def _both_at(cfg, start: int, qo, a, b, batch: int, size: int = 1 << 20):
    """((status, host, result) of the C++ planner, the same of its numpy twin), each writing
    its section from `start` into a buffer of SENTINEL."""
    cfg.start = start
    runs = []
    for twin in ("cpp", "numpy"):
        host = np.full(size, SENTINEL, dtype=np.int32)
        result = np.zeros(12, dtype=np.int64)
        if twin == "cpp":
            fn, _ = _native_planner()
            status = fn(__import__("ctypes").addressof(cfg), qo.data_ptr(), a.data_ptr(),
                        b.data_ptr() if b is not None else None, batch, host.ctypes.data, size, result.ctypes.data)
        else:
            status = _plan_numpy(cfg, qo, a, b, batch, host, result)
        runs.append((status, host, result))
    return runs


@pytest.mark.parametrize("side", [_CSR, _SEQ_LENS, _RAGGED])
@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
@pytest.mark.parametrize("capacity", [0, 64], ids=["eager", "graph"])
def test_planners_write_their_section_at_a_start_offset(side, split, capacity):
    """Both planners at start k write what they write at 0, k ints later, and nothing before
    k; their offsets (table .. end) move by k, the rest of the result stays; the twins agree."""
    rng = np.random.default_rng(5)
    qo, a, b = _batch(rng, 23, side, long=split)
    batch = qo.shape[0] - 1
    cfg = _config(side, fixed=512 if split else 0, split=int(split), capacity=capacity)
    zero = _both_at(cfg, 0, qo, a, b, batch)
    result0 = zero[0][2]
    end = int(result0[prefill._END])
    assert (result0[prefill._PARTIAL_ROWS] > 0) == split
    moved = slice(prefill._TABLE_AT, prefill._END + 1)
    for start in (1, 61, 5000):
        for (status, host, result), (status0, host0, _) in zip(_both_at(cfg, start, qo, a, b, batch), zero):
            assert status == status0 == 0
            np.testing.assert_array_equal(result[moved], result0[moved] + start)
            np.testing.assert_array_equal(np.delete(result, np.r_[moved]), np.delete(result0, np.r_[moved]))
            assert (host[:start] == SENTINEL).all(), "the planner wrote before its start"
            np.testing.assert_array_equal(host[start:start + end], host0[:end])
            assert (host[start + end:] == SENTINEL).all()
        (_, cpp, _), (_, twin, _) = _both_at(cfg, start, qo, a, b, batch)
        np.testing.assert_array_equal(cpp[:start + end], twin[:start + end])
    # too small a buffer: the size needed counts the start; a negative start is refused
    for status, _, result in _both_at(cfg, 100, qo, a, b, batch, size=100 + end - 1):
        assert status == prefill._SLOT_TOO_SMALL and result[prefill._END] == 100 + end
    for status, host, _ in _both_at(cfg, -1, qo, a, b, batch):
        assert status == prefill._BAD_START and (host == SENTINEL).all()


def test_a_caller_lse_needs_float_alignment_only():
    """The LSE is stored a float at a time: a contiguous [tokens, 7] LSE (28-byte rows: 7
    query heads, as FlashInfer's BatchAttention tests run) is taken; the output rows'
    16-byte stores keep their rule."""
    import torch

    from flashinfer_jit.prefill.wrapper import _check_out

    lse = torch.empty(5, 7)
    _check_out(lse, (5, 7), torch.float32, lse.device, "lse", contiguous=True, align=4)
    with pytest.raises(ValueError, match="lse: expected a contiguous tensor"):
        _check_out(torch.empty(7, 5).t(), (5, 7), torch.float32, lse.device, "lse", contiguous=True, align=4)
    out = torch.empty(5, 7, 6, dtype=torch.bfloat16)  # 12-byte rows
    with pytest.raises(ValueError, match="out: .*multiples of 16 bytes"):
        _check_out(out, (5, 7, 6), torch.bfloat16, out.device, "out")

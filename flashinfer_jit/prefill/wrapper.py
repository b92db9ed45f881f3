"""Batch prefill over a paged KV cache or ragged K/V on tensor cores (FlashInfer's
BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper and
single_prefill_with_kv_cache; docs/prefill.md).

plan() runs on the host once per batch: it validates the configuration, picks the module
(PrefillSpec), the query tile (rows of (token, query head) pairs a block) and whether long
requests split their keys over several blocks (split-KV, when the batch alone cannot fill
the GPU), and writes the work list, the merge index and the small index arrays into one
pinned buffer that reaches the device in one copy (plan_buffer.PlanBuffer). run()
validates q and K/V against the plan and launches one op: the prefill kernel over the work
list and, for split requests, the merge of their partial states (fixed order:
deterministic).

With use_cuda_graph=True every buffer has a fixed size set by the first plan() (its batch
is the capacity; its work list is sized for _GRAPH_ITEMS_FACTOR times its items), the
kernel's grid and query tile are fixed (blocks loop over the work list; later plans keep
the first plan's tile, whose kernel the graph holds) and no request is split, so a graph
captured around run() replays correctly after plans with other lengths and up to the
captured number of requests.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from ..pipeline import env
from ..pipeline.jit import get_module, op_cache, traced_op
from ..pipeline.spec import FP8_DTYPES, dtype_name
from ..runtime import fastcall
from ..runtime.capacity import graph_capacity
from ..runtime.checks import (
    BACKENDS,
    POS_ENCODING_MODES,
    as_dtype,
    as_int32_index,
    compiling,
    dtype_str,
    expect_bool,
    expect_choice,
    expect_heads,
    expect_window_left,
    expect_workspace,
    host_index,
    passed_run_checks,
    remembered,
    run_signature,
    same_cuda_device,
    soft_cap_value,
    static_inputs,
)
from ..runtime.device import (
    empty_f32,
    keep_plan,
    outside_graph_pool,
    placeholder,
    raw_stream,
    single_workspace,
    sm_count,
    supports_pdl,
)
from ..runtime.graph_ids import GraphPageIds
from ..runtime.launch import (
    fast_entry,
    launch_buffer,
    launch_failed,
    module_op,
    recorded,
    traced_key,
    traced_namespace,
)
from ..runtime.native import ctypes_entry, optional_entry
from ..runtime.page_order import PageOrder
from ..runtime.page_table import (
    csr_kv_lens_host,
    expect_one_page_table,
    parse_block_tables,
    unpack_paged_kv_cache,
)
from ..runtime.plan_buffer import PlanBuffer
from ..runtime.scales import logit_scale, soft_cap_log2
from ..runtime.split_kv import SplitBuffers
from . import sm90
from .spec import HEAD_DIM_PAIRS, PrefillPlanSpec, PrefillSpec, tile_rows_of

_PAIR_INTS = 15  # csrc/prefill/prefill_params.h kPrefillPairInts: a (tile, chunk) pair; its items differ in the KV head
_PAIR_IDS_AT, _PAIR_IDS = 11, 4  # (kPrefillPairIdsAt, kPrefillPairIds: the chunk's first page ids, -1 until filled)
_BLOCKS_PER_SM = 2  # csrc/prefill/prefill.cuh kMinBlocksPerSM: the blocks a wave holds per SM (the split's target)
_MIN_CHUNK = 256  # keys: a split chunk below this spends more on its merge than it saves
# keys: causal batches at head_dim 256 whose requests average at most this many take the
# 64-row tile (csrc/prefill/prefill_plan.h PrefillPlanConfig.short_causal_keys)
_SHORT_CAUSAL_KEYS = 256
_GRAPH_ITEMS_FACTOR = 4
_GRAPH_MIN_ITEMS = 4096
_Q_DTYPES = (torch.float16, torch.bfloat16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# plan()'s pos_encoding_mode -> PrefillSpec.pos_encoding (ALIBI: FlashInfer's linear bias, its
# slopes from num_qo_heads; not with a soft cap or sinks)
_POS_ENCODINGS = {"NONE": "none", "ROPE_LLAMA": "rope_llama", "ALIBI": "alibi"}
# the K/V side of plan() (csrc/prefill/prefill_plan.h PrefillKVSide) and its arguments' names
_CSR, _SEQ_LENS, _RAGGED = 0, 1, 2
_SIDE_NAMES = {_CSR: ("paged_kv_indptr", "paged_kv_last_page_len"), _SEQ_LENS: ("seq_lens", ""),
               _RAGGED: ("kv_indptr", "")}
# the planner's result slots and statuses (csrc/prefill/prefill_plan.h PrefillPlanResult / Error)
_ITEMS, _TILE_ROWS, _QO_TOKENS, _PARTIAL_ROWS, _TABLE_AT, _MERGE_AT, _WORK_AT, _END, _KV_ROWS, _MOVABLE_PAGES = range(2, 12)
_RESULT_INTS = 12  # (csrc/prefill/prefill_plan.h kResultInts)
_SLOT_TOO_SMALL, _WORK_CAPACITY, _BAD_START = 6, 7, 9


def _blocks_per_sm(head_dim_qk: int, tile_rows: int) -> int:
    """Blocks of a tile an SM holds (csrc/prefill/prefill.cuh kMinBlocksPerSM): the 64-row tile at
    head_dim_qk <= 128 runs four (kQuad), head_dim 256's 128-row tile one, the others two."""
    if tile_rows == 64 and head_dim_qk <= 128:
        return 4
    if head_dim_qk >= 512:  # the 64-row tile of 8 warps, 192 KB of shared memory
        return 1
    return 1 if tile_rows == 128 and head_dim_qk >= 256 else _BLOCKS_PER_SM


class _PlanConfig(ctypes.Structure):
    """csrc/prefill/prefill_plan.h PrefillPlanConfig (same fields, same order; the planner module
    reports its size, checked at load)."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "group", "num_kv_heads", "kv_side", "page_size", "causal", "tile_rows", "max_tile_rows", "target_blocks",
        "min_chunk", "fixed_split_size", "split", "capacity", "short_causal_keys")] + \
        [(name, ctypes.c_int64) for name in ("work_capacity", "max_partial_rows", "max_kv_len", "start")]


@op_cache
def _native_planner():
    """(<namespace>_prefill_plan of the PrefillPlanSpec module through ctypes, (fij_fastcall's
    prefill_plan, its address) or None without the extension), built or loaded at the first
    plan(); None with a warning where the planner cannot be had: plan() then runs
    _plan_numpy, slower on the host but the same plan."""
    def load():
        fn = ctypes_entry(PrefillPlanSpec(), "prefill_plan", [ctypes.c_void_p] * 4 + [ctypes.c_longlong] +
                          [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p], ctypes.c_longlong, _PlanConfig,
                          "config_bytes")
        return fn, fastcall.runner("prefill_plan", fn)

    return optional_entry(load, "batch prefill's plan() runs its numpy path",
                          f"the C++ planner {PrefillPlanSpec().name}")


def _host_i32(t, name: str) -> torch.Tensor:
    """An index vector as the planner reads it: a contiguous int32 CPU tensor (as given when
    it is one; int64 narrowed, device tensors copied)."""
    if type(t) is torch.Tensor and t.dtype is torch.int32 and t.is_cpu and t.dim() == 1 and t.is_contiguous():
        return t
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        got = f"{dtype_str(t.dtype)} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a 1-D int32 or int64 tensor, got {got}")
    return t.to(device="cpu", dtype=torch.int32).contiguous()


def _expect_length(t: torch.Tensor, name: str, n: int) -> None:
    if t.shape[0] != n:
        raise ValueError(f"{name}: expected {n} entries (from qo_indptr's batch size), got {t.shape[0]}")


def _host_vectors(qo_indptr, side: int, kv_a, kv_b) -> tuple:
    """(qo_indptr, kv_a, kv_b (None but for _CSR), batch): plan()'s index vectors as the
    planner reads them (_host_i32), their forms and lengths checked."""
    a_name, b_name = _SIDE_NAMES[side]
    kv_a = _host_i32(kv_a, a_name)
    if side == _CSR:
        kv_b = _host_i32(kv_b, b_name)
    qo = _host_i32(qo_indptr, "qo_indptr")
    batch = qo.shape[0] - 1
    if batch < 0:
        raise ValueError("qo_indptr: expected batch_size + 1 offsets, got an empty tensor")
    _expect_length(kv_a, a_name, batch + (0 if side == _SEQ_LENS else 1))
    if side == _CSR:
        _expect_length(kv_b, b_name, batch)
    return qo, kv_a, kv_b, batch


def _kv_lens_numpy(side: int, kv_a: torch.Tensor, kv_b, page_size: int) -> np.ndarray:
    a = kv_a.numpy().astype(np.int64)
    if side == _SEQ_LENS:
        return a
    if side == _CSR:
        return csr_kv_lens_host(a, kv_b.numpy(), page_size)
    return np.diff(a)


def multi_item_mask(qo_lens, kv_lens, prefix_lens, token_pos, token_pos_len: int) -> np.ndarray:
    """FlashInfer's multi-item scoring mask (its logits_mask_multi_item_scoring), as the
    custom mask of each request, flattened and concatenated (qo_len x kv_len bools a request).

    Request b's query row i sits at position pos = kv_len - qo_len + i (bottom-right) and
    sees key j <= pos; a row past the shared prefix (pos >= prefix_len) sees, beyond the
    prefix (j < prefix_len), only its own item's keys: j > pos - t, where t =
    token_pos[b * token_pos_len + pos - prefix_len] is the row's position in its item (0 for
    a delimiter, which then sees the prefix alone; 1 for an item's first token)."""
    parts = []
    for b, (q, k, p) in enumerate(zip(qo_lens.tolist(), kv_lens.tolist(), prefix_lens.tolist())):
        pos = np.arange(q, dtype=np.int64) + (k - q)
        keys = np.arange(k, dtype=np.int64)
        t = np.zeros(q, dtype=np.int64)
        items = pos >= p
        t[items] = token_pos[b * token_pos_len + pos[items] - p]
        sees = keys[None, :] <= pos[:, None]
        in_item = (keys[None, :] < p) | (pos[:, None] < keys[None, :] + t[:, None])
        parts.append((sees & (in_item | ~items[:, None])).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def _multi_item_custom_mask(qo_indptr, kv_lens: np.ndarray, prefix_len_ptr, token_pos_in_items_ptr,
                            token_pos_in_items_len, max_item_len_ptr) -> torch.Tensor:
    """plan()'s multi-item scoring arguments checked and turned into a custom mask (bools,
    on the host): multi_item_mask."""
    if prefix_len_ptr is None or token_pos_in_items_ptr is None:
        raise ValueError("prefix_len_ptr and token_pos_in_items_ptr: multi-item scoring takes both (max_item_len_ptr "
                         "is optional)")
    if not isinstance(token_pos_in_items_len, int) or token_pos_in_items_len < 0:
        raise ValueError(f"token_pos_in_items_len: expected a non-negative int, got {token_pos_in_items_len!r}")
    qo = host_index(qo_indptr, "qo_indptr", any_int=True)
    qo_lens = np.diff(qo)
    batch = qo_lens.shape[0]
    if kv_lens.shape[0] != batch:
        raise ValueError(f"qo_indptr: {batch} requests, the page table has {kv_lens.shape[0]}")
    prefix = host_index(prefix_len_ptr, "prefix_len_ptr", any_int=True)
    if prefix.shape[0] != batch:
        raise ValueError(f"prefix_len_ptr: expected one prefix length a request ({batch}), got {prefix.shape[0]}")
    if ((prefix < 0) | (prefix > kv_lens)).any():
        b = int(np.nonzero((prefix < 0) | (prefix > kv_lens))[0][0])
        raise ValueError(f"prefix_len_ptr: request {b}'s prefix {int(prefix[b])} is not within its {int(kv_lens[b])} "
                         "keys")
    token_pos = host_index(token_pos_in_items_ptr, "token_pos_in_items_ptr", any_int=True)
    if (token_pos < 0).any():
        raise ValueError("token_pos_in_items_ptr: expected positions >= 0 (0 a delimiter, 1.. an item's tokens), got "
                         f"{int(token_pos.min())}")
    need = np.maximum(kv_lens - prefix, 0)  # entries a request reads: positions prefix_len .. kv_len - 1
    if batch > 1 and (need > token_pos_in_items_len).any():
        b = int(np.nonzero(need > token_pos_in_items_len)[0][0])
        raise ValueError(f"token_pos_in_items_len: request {b} has {int(need[b])} tokens past its prefix, more than "
                         f"the {token_pos_in_items_len} entries a request of token_pos_in_items_ptr holds")
    last = (np.arange(batch) * token_pos_in_items_len + need).max(initial=0)
    if last > token_pos.shape[0]:
        raise ValueError(f"token_pos_in_items_ptr: {token_pos.shape[0]} entries, fewer than the {int(last)} the "
                         "requests' tokens past their prefixes read")
    if max_item_len_ptr is not None and host_index(max_item_len_ptr, "max_item_len_ptr", any_int=True).shape[0] != batch:
        raise ValueError(f"max_item_len_ptr: expected one value a request ({batch})")
    return torch.from_numpy(multi_item_mask(qo_lens, kv_lens, prefix, token_pos, token_pos_in_items_len))


def _plan_numpy(cfg, qo: torch.Tensor, kv_a: torch.Tensor, kv_b, batch: int, host: np.ndarray,
                result: np.ndarray) -> int:
    """csrc/prefill/prefill_plan.h prefill_plan() in numpy (plan_work): the same validation, layout
    and work list; the fallback where the C++ planner cannot be loaded."""
    result[:] = 0
    cap = max(cfg.capacity, batch)
    if cfg.capacity and batch > cfg.capacity:
        result[0], result[1] = 8, batch
        return 8
    if cfg.start < 0:
        result[0] = _BAD_START
        return _BAD_START
    ptr = qo.numpy().astype(np.int64)
    qo_lens = np.diff(ptr)
    if ptr[0] != 0 or (qo_lens < 0).any():
        bad = 0 if ptr[0] != 0 else int(np.nonzero(qo_lens < 0)[0][0])
        result[0], result[1] = 1, bad
        return 1
    side = cfg.kv_side
    a = kv_a.numpy().astype(np.int64)
    if side != _SEQ_LENS:
        d = np.diff(a)
        if a[0] != 0 or (d < 0).any():
            result[0], result[1] = 2, 0 if a[0] != 0 else int(np.nonzero(d < 0)[0][0])
            return 2
    if side == _CSR:
        last = kv_b.numpy()
        bad = np.nonzero((d > 0) & ((last < 1) | (last > cfg.page_size)))[0]
        if bad.size:
            result[0], result[1] = 3, int(bad[0])
            return 3
    if side == _SEQ_LENS:
        bad = np.nonzero((a < 0) | ((a > cfg.max_kv_len) if cfg.max_kv_len > 0 else False))[0]
        if bad.size:
            result[0], result[1] = 5, int(bad[0])
            return 5
    kv_lens = _kv_lens_numpy(side, kv_a, kv_b, cfg.page_size)
    result[_KV_ROWS] = 0 if side == _SEQ_LENS else int(a[batch])
    if side != _RAGGED and batch:  # (csrc/prefill/prefill_plan.h kMovablePages)
        movable = -(-kv_lens // cfg.page_size) - 1
        if cfg.causal:
            movable = np.minimum(movable, np.maximum(kv_lens - qo_lens + 1, 0) // cfg.page_size)
        result[_MOVABLE_PAGES] = max(0, int(movable[kv_lens > 0].max(initial=0)))
    active = int((qo_lens > 0).sum())
    rows_total = int(qo_lens.sum()) * cfg.group
    tile = (min(cfg.tile_rows, cfg.max_tile_rows) if cfg.tile_rows
            else 128 if cfg.max_tile_rows >= 128 and active and rows_total > 64 * active else 64)
    if (not cfg.tile_rows and tile == 128 and cfg.causal and cfg.short_causal_keys > 0
            and int(kv_lens[qo_lens > 0].sum()) <= cfg.short_causal_keys * active):
        tile = 64  # (csrc/prefill/prefill_plan.h PrefillPlanConfig.short_causal_keys)
    first = a[:batch] if side != _SEQ_LENS else None  # (kv_indptr[b], or the CSR indptr[b])
    work, merge = plan_work(qo_lens, kv_lens, cfg.group, cfg.num_kv_heads, tile, bool(cfg.causal), cfg.target_blocks,
                            cfg.fixed_split_size or None, bool(cfg.split), cfg.max_partial_rows, cfg.min_chunk,
                            first)
    items = int(work[0])
    if cfg.work_capacity and items > cfg.work_capacity:
        result[_ITEMS] = items
        result[0] = 7
        return 7
    # the layout within this plan's section, which starts at cfg.start (reported from the buffer's start)
    table_at = cap + 1
    merge_at = table_at + (2 * cap + 1 if side == _CSR else cap if side == _SEQ_LENS else cap + 1)
    work_at = merge_at + (merge.shape[0] if merge is not None else 0)
    end = work_at + 1 + _PAIR_INTS * -(-(cfg.work_capacity or items) // cfg.num_kv_heads)
    start = cfg.start
    result[_ITEMS], result[_TILE_ROWS], result[_QO_TOKENS] = items, tile, int(ptr[-1])
    result[_PARTIAL_ROWS] = int(merge[-1]) if merge is not None else 0
    result[_TABLE_AT:_END + 1] = start + table_at, start + merge_at, start + work_at, start + end
    if host.shape[0] < start + end:
        result[0], result[1] = _SLOT_TOO_SMALL, start + end
        return _SLOT_TOO_SMALL
    host = host[start:]
    host[: batch + 1] = ptr
    host[batch + 1: cap + 1] = ptr[-1]
    if side == _CSR:
        host[table_at: table_at + batch + 1] = a
        host[table_at + batch + 1: table_at + cap + 1] = a[-1]
        host[table_at + cap + 1: table_at + cap + 1 + batch] = np.where(d > 0, kv_b.numpy(), 0)
        host[table_at + cap + 1 + batch: merge_at] = 0
    elif side == _SEQ_LENS:
        host[table_at: table_at + batch] = kv_lens
        host[table_at + batch: merge_at] = 0
    else:
        host[table_at: table_at + batch + 1] = a
        host[table_at + batch + 1: merge_at] = a[-1]
    if merge is not None:
        host[merge_at: work_at] = merge
    host[work_at: work_at + work.shape[0]] = work
    return 0


def _carve(buf: torch.Tensor, key: tuple) -> tuple:
    """(qo_indptr, the K/V side's arrays, merge_indptr or None, work, mask_indptr or None):
    views of the device plan buffer for key (side, capacity, and the planner's offsets,
    from the buffer's start: qo_indptr ends where the K/V side's arrays start; end None: no
    mask index, the work list runs to the buffer's end, the ops reading its count from its
    first element)."""
    side, cap, table_at, merge_at, work_at, end, total = key
    if side == _CSR:
        table = (buf[table_at: table_at + cap + 1], buf[table_at + cap + 1: table_at + 2 * cap + 1])
    elif side == _SEQ_LENS:
        table = (buf[table_at: table_at + cap],)
    else:
        table = (buf[table_at: table_at + cap + 1],)
    merge = buf[merge_at: work_at] if work_at > merge_at else None
    if end is None:
        return buf[table_at - cap - 1: table_at], table, merge, buf[work_at:], None
    return buf[table_at - cap - 1: table_at], table, merge, buf[work_at: end], buf[end: total]


_PREFILL_BACKENDS = BACKENDS + ("fa3",)  # "fa3": the Hopper path (flashinfer_jit/prefill/sm90.py)


def _check_backend(backend: str) -> None:
    expect_choice(backend, "backend", _PREFILL_BACKENDS)


def _host_vector(t, name: str) -> np.ndarray:
    """A 1-D int32/int64 index tensor (any device) as an int64 numpy array."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        got = f"{dtype_str(t.dtype)} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a 1-D int32 or int64 tensor, got {got}")
    return (t if t.is_cpu else t.cpu()).numpy().astype(np.int64)


def plan_work(qo_lens: np.ndarray, kv_lens: np.ndarray, group: int, num_kv_heads: int, tile_rows: int, causal: bool,
              target_blocks: int, chunk: int | None, split: bool, max_partial_rows: int, min_chunk: int = _MIN_CHUNK,
              first: np.ndarray | None = None):
    """The work list of a batch: (work int32 [1 + _PAIR_INTS n], merge_indptr int32 [qo_tokens + 1] or
    None (nothing split)). work[0] counts the items, n x num_kv_heads; then n (tile, chunk)
    pairs (request, row0, kv_start, kv_end, partial_row, chunks, chunk, and the request's
    qo_start, qo_len, kv_len and first[b]: ragged, its first K/V row, kv_indptr[b]; a CSR page
    table, its first entry, indptr[b]; None: 0; then the chunk's first page ids, -1 here:
    plan()'s page-order launch fills them in), item i being pair
    i // num_kv_heads for KV head i % num_kv_heads (csrc/prefill/prefill_params.h). Requests split
    their keys into chunks of `chunk` keys (a multiple of 64), or, with chunk None and split
    True, of the size that brings the items near target_blocks when the unsplit batch falls
    short of it (and no chunk under _MIN_CHUNK keys), evened out per request (its keys over
    its chunks, up to a multiple of 64: 4096 keys as 2 x 2048, not 4032 + 64); split False:
    no request splits. Requests run heaviest first, each
    request's items together and heaviest first (causal tiles near the end of a request
    first): the last wave is made of short items, and the blocks in flight share a request's
    K/V in L2."""
    batch = qo_lens.shape[0]
    tiles = -(-(qo_lens * group) // tile_rows)  # per request; 0 for qo_len 0
    num_tiles = int(tiles.sum())
    tile_req = np.repeat(np.arange(batch), tiles)
    tile_first = np.cumsum(tiles) - tiles
    row0 = (np.arange(num_tiles) - tile_first[tile_req]) * tile_rows
    qo_t, kv_t = qo_lens[tile_req], kv_lens[tile_req]
    # keys a tile can see: causal stops at its last row's diagonal
    last_token = np.minimum(qo_t, (row0 + tile_rows - 1) // group + 1) - 1
    visible = np.minimum(kv_t, last_token + kv_t - qo_t + 1) if causal else kv_t
    visible = np.maximum(visible, 0)
    chunks_req = np.ones(batch, dtype=np.int64)
    if split and batch:
        fixed = chunk is not None
        if chunk is None:
            items = num_tiles * num_kv_heads
            if items < target_blocks:
                work_keys = int(visible.sum()) * num_kv_heads
                chunk = max(min_chunk, -(-work_keys // target_blocks))
        if chunk is not None:
            chunk = -(-chunk // 64) * 64
            chunks_req = np.maximum(1, -(-kv_lens // chunk))
            chunk_req = np.full(batch, chunk, dtype=np.int64)  # keys a chunk, per request
            if not fixed:  # evened out per request (csrc/prefill/prefill_plan.h says why)
                even = -(-kv_lens // chunks_req)  # a request's keys over its chunks, rounded up
                chunk_req = np.where(chunks_req > 1, -(-even // 64) * 64, chunk)
                chunks_req = np.maximum(1, -(-kv_lens // chunk_req))
            partial_rows = int((qo_lens * chunks_req * (chunks_req > 1)).sum())
            if partial_rows > max_partial_rows:
                chunks_req[:] = 1  # the workspace cannot hold the partial states: run unsplit
    split_req = chunks_req > 1
    any_split = bool(split_req.any())
    qo_start = np.cumsum(qo_lens) - qo_lens  # qo_indptr[b] (plan() checked: from 0, rising)
    merge_indptr = None
    partial_base = np.full(batch, -1, dtype=np.int64)
    if any_split:
        per_token = np.repeat(np.where(split_req, chunks_req, 0), qo_lens)
        merge_indptr = np.zeros(per_token.shape[0] + 1, dtype=np.int64)
        np.cumsum(per_token, out=merge_indptr[1:])
        partial_base = np.where(split_req, merge_indptr[qo_start], -1)
    # tiles x chunks x heads
    n_chunks_t = chunks_req[tile_req]
    pair_tile = np.repeat(np.arange(num_tiles), n_chunks_t)
    pair_first = np.cumsum(n_chunks_t) - n_chunks_t
    pair_chunk = np.arange(pair_tile.shape[0]) - pair_first[pair_tile]
    b = tile_req[pair_tile]
    if any_split:
        kv_start = pair_chunk * chunk_req[b]
        kv_end = np.where(n_chunks_t[pair_tile] > 1, kv_start + chunk_req[b], kv_lens[b])
        kv_end = np.minimum(kv_end, kv_lens[b])
        cost = np.maximum(np.minimum(kv_end, visible[pair_tile]) - kv_start, 0)
    else:
        kv_start = np.zeros_like(pair_chunk)
        kv_end = kv_lens[b]
        cost = visible[pair_tile]
    # requests heaviest first (by their heaviest pair), each request's pairs together and
    # heaviest first (csrc/prefill/prefill_plan.h says why); ties keep request order
    request_cost = np.zeros(batch, dtype=np.int64)
    np.maximum.at(request_cost, b, cost)
    order = np.lexsort((-cost, b, -request_cost[b]))
    n = order.shape[0]
    fields = np.empty((n, _PAIR_INTS), dtype=np.int32)
    fields[:, 0] = b[order]
    fields[:, 1] = row0[pair_tile[order]]
    fields[:, 2] = kv_start[order]
    fields[:, 3] = kv_end[order]
    fields[:, 4] = partial_base[b[order]]
    fields[:, 5] = n_chunks_t[pair_tile[order]]
    fields[:, 6] = pair_chunk[order]
    # the request's extent (csrc/prefill/prefill_params.h PrefillItem): qo_indptr[b], qo_len, kv_len,
    # and its first K/V row (ragged: kv_indptr[b]) or first page-table entry (CSR: indptr[b])
    fields[:, 7] = qo_start[b[order]]
    fields[:, 8] = qo_lens[b[order]]
    fields[:, 9] = kv_lens[b[order]]
    fields[:, 10] = first[b[order]] if first is not None else 0
    fields[:, _PAIR_IDS_AT:] = -1  # (plan()'s page-order launch fills them in, csrc/runtime/page_order.cuh)
    work = np.empty(1 + fields.size, dtype=np.int32)
    work[0] = n * num_kv_heads
    work[1:] = fields.reshape(-1)
    return work, (merge_indptr.astype(np.int32) if merge_indptr is not None else None)


_GENERAL = object()  # _sm90_plan_common: not the common form, the general path plans it


class _NotCommonForm(Exception):
    """_sm90_plan_common's tiles_of: the C++ planner declined the vectors (the general path's)."""


def _csr_page_ids(page_ids, last_offset: int) -> torch.Tensor:
    """A Hopper plan's CSR page ids (paged_kv_indices) as int32, checked against the indptr's
    last offset: a 1-D tensor holding at least that many ids."""
    ids = as_int32_index(page_ids, "paged_kv_indices")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
        raise ValueError("paged_kv_indices: expected a 1-D int32 or int64 tensor")
    if ids.shape[0] < last_offset:
        raise ValueError(f"paged_kv_indptr: its last offset {last_offset} exceeds the {ids.shape[0]} page ids "
                         "of paged_kv_indices")
    return ids


class _Config:
    __slots__ = ("num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo", "page_size", "mask", "pos_encoding",
                 "window_left", "soft_cap", "sm_scale", "rope_scale", "rope_theta", "q_dtype", "kv_dtype", "o_dtype",
                 "fixed_split_size", "disable_split_kv", "group", "logit_scale", "cap_log2", "structs", "plain_specs",
                 "pages_movable")


class _Plan:
    __slots__ = ("config", "spec", "op", "batch", "qo_tokens", "args", "tile_rows", "grid", "merge_rows", "layout",
                 "mask_args", "checked", "fast", "quick", "sinks_spec", "unordered")


class _PrefillWrapper:
    """What the paged and ragged wrappers share: configuration, planning, the op call."""

    _ragged = False
    _force_tile_rows = None  # benchmarks and tests pin the query tile (64 or 128 rows) here
    _force_key_tile = None  # ... and the Hopper kernel's key tile (sm90.key_tile's choices) here
    _force_query_tile = None  # ... and its query tile (192: head_dim 64, three consumer warpgroups; an A/B's pin)
    # whether a Hopper plan may run over a copy of the batch's pages (sm90.gathers: an fp8 cache,
    # RoPE over the paged cache); POD's prefill side may not (its kernel reads the cache)
    _gather_ok = True
    # (an A/B's pin of the copy of the batch's pages, read as rows: None, the rules below; True,
    # every paged Hopper plan over it where it may; False, none that the rules alone would copy)
    _force_copy = None

    def __init__(self, float_workspace_buffer, kv_layout: str, use_cuda_graph: bool, qo_indptr_buf, custom_mask_buf,
                 mask_indptr_buf, backend: str):
        expect_workspace(float_workspace_buffer)
        expect_choice(kv_layout, "kv_layout", ("NHD", "HND"))
        _check_backend(backend)
        self._backend = backend
        self._sm90 = None  # the Hopper path's planner (sm90.Sm90Planner), made at its first plan
        self._common_plan = None  # the last Hopper plan of the common form (_sm90_plan_common)
        self._sm90_refusals = {}  # sm90.refusal's answer per (configuration, table, gather_ok)
        self._graph_backend = None  # CUDA graphs: the kernel of the first plan ("fa3" or "fa2"), kept
        self._workspace = float_workspace_buffer
        self._device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        for name, buf in (("qo_indptr_buf", qo_indptr_buf), ("mask_indptr_buf", mask_indptr_buf)):
            if buf is not None and (not isinstance(buf, torch.Tensor) or buf.dim() != 1 or
                                    buf.dtype not in (torch.int32, torch.int64)):
                raise TypeError(f"{name}: expected a 1-D int32 tensor")
        self._qo_indptr_buf = qo_indptr_buf
        self._custom_mask_buf = custom_mask_buf
        self._mask_indptr_buf = mask_indptr_buf
        self._plan_buffer = PlanBuffer(self._device, self._use_cuda_graph)
        # CUDA graphs: the requests a plan may hold, fixed by the constructor's qo_indptr_buf
        # (FlashInfer's rule), else by the first plan()
        self._capacity = qo_indptr_buf.shape[0] - 1 if self._use_cuda_graph and qo_indptr_buf is not None else None
        self._graph_items = None
        # CUDA graphs: the query tile, fixed by the first plan(): a captured run() replays that
        # tile's kernel, which covers only its own rows of a work item
        self._graph_tile = None
        self._configs = {}
        self._plan = None
        self._traced = None  # plan()'s values for a run() under torch.compile (_run_traced)
        self._pdl = supports_pdl(self._device)
        self._result = np.zeros(_RESULT_INTS, dtype=np.int64)  # the planner's results (PrefillPlanResult)
        self._result_ptr = self._result.ctypes.data
        self._slot_size = 4096
        self._kv_rows = 0
        # split-KV's partial states (in the workspace) and the split tiles' merge counters
        # (csrc/prefill/prefill.cuh prefill_merge_if_last)
        self._split = SplitBuffers(float_workspace_buffer, self._use_cuda_graph)
        # what an unsplit plan passes for the partial states, merge index and counters
        self._placeholders = (empty_f32(self._device), placeholder(self._device, torch.int32))
        # paged: plan()'s copy of the page ids with each request's movable pages in id order
        # (sort_pages; a CUDA-graph wrapper decides at its first plan)
        self._page_order = PageOrder(self._device, self._use_cuda_graph, (_PAIR_INTS, _PAIR_IDS_AT, _PAIR_IDS))

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def planned_backend(self) -> str | None:
        """What run() launches for the current plan: "fa3" (the Hopper path) or "fa2" (the
        mma.sync kernel); None before the first plan()."""
        plan = self._plan
        return None if plan is None else "fa3" if type(plan) is sm90.Sm90Plan else "fa2"

    def _plan_sm90(self, config: _Config, qo_indptr, kv_indptr, non_blocking: bool, table: str = "csr",
                   page_ids=None, last_page_len=None, mask_args: tuple = (None, None, None)) -> bool:
        """plan() on the Hopper path where the backend takes it; False: the mma.sync kernel's
        plan follows. Ragged: kv_indptr the K/V rows' offsets. Paged: the CSR page table
        (table "csr": kv_indptr, page_ids, last_page_len) or block tables (table
        parse_block_tables' layout: kv_indptr seq_lens, page_ids the int32 table, vLLM's
        [B, max_pages] or TensorRT-LLM's [B, 2, max_pages]). "fa3": the Hopper path, or a ValueError saying why it
        cannot run (a feature, then the device: sm90.refusal). "auto": the Hopper path where
        it can run and the batch is one it measured faster on (sm90.auto_takes). A CUDA-graph
        wrapper keeps its first plan's kernel (a captured run() replays that kernel): with
        "auto", later plans take the same one."""
        backend = self._backend
        if self._use_cuda_graph and backend == "auto" and self._graph_backend is not None:
            backend = self._graph_backend
        if backend == "fa2" and sm90.fp8_attention(config):
            raise ValueError("q_data_type float8_e4m3fn: FP8 attention runs on the Hopper kernel only (backend='fa3', "
                             "or 'auto' on sm_90); backend='fa2' takes 16-bit q")
        plan = None if backend == "fa2" else self._sm90_plan(backend, config, qo_indptr, kv_indptr, non_blocking,
                                                              table, page_ids, last_page_len, mask_args)
        if plan is None:
            self._graph_backend = self._graph_backend or "fa2"
            return False
        if self._use_cuda_graph:
            self._graph_backend = "fa3"
        self._install_sm90(plan)
        return True

    def _install_sm90(self, plan) -> None:
        """A Hopper plan made the current one (plan()'s, and POD's repeated plan's:
        pod/wrapper.py _Pod._replan), with the module op of the previous plan where the spec is
        the same."""
        previous = self._plan
        if previous is not None and getattr(previous, "spec", None) is plan.spec:
            plan.op, plan.traced_key = previous.op, previous.traced_key
        if plan.traced_key is None:
            plan.traced_key = traced_key(plan.spec)
        self._plan = plan
        self._traced = None
        static_inputs(plan.work, plan.counters, plan.page_ids, plan.mask, *(plan.rope[:4] if plan.rope else ()),
                      *(plan.gather or ()))

    def _sm90_plan(self, backend: str, config: _Config, qo_indptr, kv_indptr, non_blocking: bool, table: str,
                   page_ids, last_page_len, mask_args: tuple):
        """_plan_sm90's plan for backend "fa3" or "auto", or None where "auto" declines.
        mask_args: plan()'s (custom_mask, packed_custom_mask, mask_indptr)."""
        graph = self._use_cuda_graph
        # (per configuration: the reasons depend on it, the table and the wrapper alone)
        refusal_key = (config, table, self._gather_ok)
        why = self._sm90_refusals.get(refusal_key, False)
        if why is False:
            why = self._sm90_refusals[refusal_key] = sm90.refusal(config, self._ragged, self._device, table, graph,
                                                                  self._gather_ok)
        if why is not None:
            if backend == "fa3" or sm90.fp8_attention(config):  # (fp8 q: no mma.sync kernel to fall back to)
                raise ValueError(why)
            return None
        causal = config.mask == "causal"
        # (the kernel reads a copy of the batch's pages: an fp8 cache, RoPE, small pages, long prompts)
        copy = sm90.gathers(config) or self._force_copy is True or \
            (table == "csr" and self._force_copy is None and self._copies_for_speed(config, qo_indptr, kv_indptr))
        if not graph and (self._ragged or table == "csr") and config.mask != "custom" and \
                config.pos_encoding == "none" and not copy:
            plan = self._sm90_plan_common(backend, config, qo_indptr, kv_indptr, last_page_len, page_ids, non_blocking)
            if plan is not _GENERAL:
                return plan
        v_ids = 0  # (separate K/V page ids: where a request's V ids start past its K ids)
        # (native: sm90_tiles' vectors, the tiles planned in C++: Sm90Planner.native_tiles)
        if self._ragged:
            qo_t, kv_t, _, batch = _host_vectors(qo_indptr, _RAGGED, kv_indptr, None)
            native = (_RAGGED, qo_t, kv_t, None, 0, 0)
            qo, kv = qo_t.numpy(), kv_t.numpy()
            kv_lens, ids, page_size = None, None, None
        elif table != "csr":  # a block table [B, max_pages] or [B, 2, max_pages], int32 (parse_block_tables)
            qo_t, lens, _, batch = _host_vectors(qo_indptr, _SEQ_LENS, kv_indptr, None)
            qo, kv_lens = qo_t.numpy(), lens.numpy().astype(np.int64)
            page_size = config.page_size
            if graph:  # the table in the wrapper's fixed buffer, whose address the captured launch holds
                self._capacity = graph_capacity(self._capacity, batch)
                page_ids = self._graph_ids.fill_block_tables(page_ids, self._capacity)[:batch]
            ids, kv, v_ids = sm90.block_table_ids(page_ids, kv_lens, page_size)
            native = (_SEQ_LENS, qo_t, lens, None, page_size, int(kv[1] - kv[0]) if batch else 0)
        else:
            qo_t, kv_t, last, batch = _host_vectors(qo_indptr, _CSR, kv_indptr, last_page_len)
            native = (_CSR, qo_t, kv_t, last, config.page_size, 0)
            qo, kv = qo_t.numpy(), kv_t.numpy()
            page_size = config.page_size
            # (numpy's lengths where the mask or the copy reads them; the tiles compute their own)
            kv_lens = csr_kv_lens_host(kv, last.numpy(), page_size) if config.mask == "custom" or copy else None
            ids = _csr_page_ids(page_ids, int(kv[-1]))
        gather, first, key_rows, layout = None, None, None, self._kv_layout
        if self._ragged:
            key_rows = (kv.astype(np.int64), np.diff(kv.astype(np.int64)))
        elif copy:  # (paged)
            # an fp8 cache, RoPE, pages under 16 tokens or long prompts: the ragged kernel reads
            # a copy of the batch's pages (NHD, q's dtype, keys rotated), which run() makes, a
            # request's pages one run of rows (no CUDA graphs: sm90.unsupported)
            first, copy_pages = kv, sm90.copy_offsets(kv_lens, page_size)
            kv, layout = copy_pages * page_size, "NHD"  # (each request's first row in the copy)
            key_rows = (kv, kv_lens)
            native = None  # (the tiles index the copy's rows: numpy's plan_tiles)
        if self._sm90 is None:
            self._sm90 = sm90.Sm90Planner(self._device, graph)
        window = config.window_left

        def tiles_of(keys_a_tile: int, rows: int):
            """(tiles, active, their column 6's sum): in C++ where the vectors allow it, else numpy."""
            got = self._sm90.native_tiles(*native, causal, keys_a_tile, window, rows) if native is not None else None
            if got is None:  # (CSR without the lengths computed above: numpy's, here)
                lens = kv_lens if kv_lens is not None or native is None or native[0] != _CSR else \
                    csr_kv_lens_host(kv, native[3].numpy(), page_size)
                t, a = sm90.plan_tiles(qo, kv, causal, keys_a_tile, lens, window, rows)
                got = t, a, int(t[:, 6].sum(dtype=np.int64))
            return got

        # (a copy's rows: the ragged kernel's key tile)
        chosen = self._sm90_tiles(backend, config, graph, None if first is not None else page_size, tiles_of,
                                  lambda: (int(qo[-1]) - int(qo[0]), batch))
        if chosen is None:
            return None
        keys_a_tile, rows, tiles, active = chosen
        if graph:
            self._capacity = graph_capacity(self._capacity, batch)
        if self._ragged:
            self._kv_rows = int(kv[-1])
        elif first is not None:  # (what run() gathers into the copy, on the device; the kernel reads its rows)
            gather = sm90.gather_ids(ids, first, copy_pages, v_ids, self._device, non_blocking)
            gather = (*gather, sm90.pad_rows(copy_pages, kv_lens, page_size, self._device, non_blocking))
            ids, v_ids, layout = None, 0, "NHD"
        elif graph and table == "csr":  # the ids in the wrapper's fixed buffer (as the block table above)
            ids = self._graph_ids.fill_indices(ids, "paged_kv_indices")
        else:
            ids = ids.to(self._device, non_blocking=non_blocking)
        mask = None
        if config.mask == "custom":  # the bits in a padded buffer of words, each tile's first bit
            qo_lens = np.diff(qo.astype(np.int64))
            lens = np.diff(kv.astype(np.int64)) if kv_lens is None else kv_lens
            custom_mask, packed_custom_mask, mask_indptr = mask_args
            starts = self._mask_offsets(qo_lens, lens, custom_mask, packed_custom_mask, mask_indptr)
            packed = self._packed_mask(config, qo_lens, lens, custom_mask, packed_custom_mask, starts)
            mask = (sm90.mask_buffer(packed, self._device), sm90.mask_bases(tiles, qo, lens, starts))
        return self._sm90.plan(config, qo, tiles, active, non_blocking, keys_a_tile, ids, layout, v_ids, rows, mask,
                               key_rows, gather)

    def _copies_for_speed(self, config: _Config, qo_indptr, kv_indptr) -> bool:
        """Whether a paged plan over the CSR table, which could read the cache, reads a copy of
        its pages instead (sm90.copies_for_speed: long prompts or long chunks over long contexts,
        a copy of bounded size), from host vectors alone (no device read): eager wrappers
        outside POD."""
        if self._ragged or self._use_cuda_graph or not self._gather_ok:
            return False
        for t in (qo_indptr, kv_indptr):
            if type(t) is not torch.Tensor or not t.is_cpu or t.dim() != 1 or t.shape[0] < 2:
                return False
        batch = qo_indptr.shape[0] - 1
        mean_qo = (int(qo_indptr[-1]) - int(qo_indptr[0])) / batch
        if mean_qo < min(sm90.COPY_MIN_MEAN_QO_LEN, sm90.COPY_MIN_CHUNK_QO_LEN):
            return False
        rows = (int(kv_indptr[-1]) - int(kv_indptr[0])) * config.page_size  # (whole pages: the copy's rows)
        row_bytes = config.num_kv_heads * (config.head_dim_qk + config.head_dim_vo) * config.q_dtype.itemsize
        return sm90.copies_for_speed(mean_qo, rows / batch, rows * row_bytes)

    def _sm90_tiles(self, backend: str, config: _Config, graph: bool, page_size, tiles_of, counts):
        """A Hopper plan's (key tile, query tile, tiles, active tiles), both paths': key_tile()'s
        tile (176 narrowed to 128 wherever 176 computes more keys), "auto"'s decision on
        its tiles (None: it declines), head_dim 64's 192-row tiles where they are long.
        tiles_of(keys_a_tile, rows) plans the tiles: (tiles, active, their column 6's sum);
        counts(), after the first: (the batch's query rows, its requests)."""
        fp8 = sm90.fp8_attention(config)  # (its form: 128-key tiles, and "auto" takes every batch)
        keys_a_tile = self._force_key_tile or \
            (128 if fp8 else sm90.key_tile(config.head_dim_qk, config.mask == "causal", page_size))
        rows = self._force_query_tile or sm90.TILE_ROWS
        if keys_a_tile == 176 and not graph and self._force_key_tile is None:
            # 128-key tiles first, which nearly every batch takes (narrower_tile); the keys a tile
            # visits (column 6) do not depend on the key tile, so they decide for 176 as well
            tiles, active, keys = tiles_of(128, rows)
            if sm90.narrower_tile(tiles[:, 6]):
                keys_a_tile = 128
            else:
                tiles, active, keys = tiles_of(keys_a_tile, rows)
        else:
            tiles, active, keys = tiles_of(keys_a_tile, rows)
        if backend == "auto" and not fp8:
            qo_tokens, batch = counts()
            if not (batch > 0 and tiles.shape[0] > 0 and sm90.auto_takes_means(config, float(qo_tokens) / batch,
                                                                                keys / tiles.shape[0])):
                return None
        if self._force_query_tile is None and not graph:  # head_dim 64's 192-row tiles on long tiles
            wide = sm90.query_tile(config, tiles[:, 6], self._force_key_tile is not None)
            if wide != rows:
                rows = wide
                tiles, active, keys = tiles_of(keys_a_tile, rows)
        return keys_a_tile, rows, tiles, active

    def _sm90_plan_common(self, backend: str, config: _Config, qo_indptr, kv_indptr, last_page_len, page_ids,
                          non_blocking: bool):
        """_sm90_plan for the common form (an eager wrapper; ragged, or paged through the CSR
        table; no custom mask, no positional encoding, no copy of pages; the index vectors
        contiguous int32 CPU tensors): the work list planned in C++ straight into the plan
        buffer's pinned slot (Sm90Planner.native_work), without numpy. Its plan, None where
        "auto" declines, or _GENERAL where the vectors are of another form (the general path
        then plans them, or raises their errors)."""
        if self._sm90 is None:
            self._sm90 = sm90.Sm90Planner(self._device, False)
        planner = self._sm90
        causal, window, heads = config.mask == "causal", config.window_left, config.num_qo_heads
        side, kv_b, page_size = (_RAGGED, None, None) if self._ragged else (_CSR, last_page_len, config.page_size)
        got = None  # native_work's last result: the plan's slot and the batch's scalars

        def tiles_of(keys_a_tile: int, rows: int):
            nonlocal got
            got = planner.native_work(side, qo_indptr, kv_indptr, kv_b, page_size or 0, causal, keys_a_tile, window,
                                      rows, heads, None if got is None else got[0])
            if got is None or (side == _CSR and last_page_len.shape[0] != got[4]):  # (the general path's errors)
                raise _NotCommonForm
            return got[1], got[2], got[3]

        try:  # (native_work's scalars: batch, qo_indptr's first and last entries)
            chosen = self._sm90_tiles(backend, config, False, page_size, tiles_of, lambda: (got[6] - got[5], got[4]))
        except _NotCommonForm:
            if got is not None:
                planner._plan_buffer.give_back()
            return _GENERAL
        if chosen is None:
            planner._plan_buffer.give_back()
            return None
        keys_a_tile, rows, tiles, _ = chosen
        slot, qo_last, kv_last = got[0], got[6], got[7]
        if tiles.shape[0] * heads >= 2 ** 31:
            raise ValueError(f"qo_indptr: {tiles.shape[0]} query tiles x {heads} heads exceed the Hopper path's "
                             "int32 item count")
        if self._ragged:
            self._kv_rows = kv_last
            ids = None
        else:
            ids = _csr_page_ids(page_ids, kv_last)
            if ids.device != self._device:
                ids = ids.to(self._device, non_blocking=non_blocking)
        plan = self._common_plan = planner.finish(config, slot, tiles.shape[0], non_blocking, keys_a_tile, ids,
                                                  self._kv_layout, rows, qo_last)
        return plan

    # --- plan ---------------------------------------------------------------------------------
    def _configure(self, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, causal, custom,
                   pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type,
                   kv_data_type, o_data_type, fixed_split_size, disable_split_kv) -> _Config:
        c = _Config()
        expect_heads(num_qo_heads, num_kv_heads, head_dim_qk=head_dim_qk)
        head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
        if (head_dim_qk, head_dim_vo) not in HEAD_DIM_PAIRS:
            raise ValueError(f"head_dim_qk={head_dim_qk}, head_dim_vo={head_dim_vo}: supported (qk, vo) pairs are "
                             f"{', '.join(map(str, HEAD_DIM_PAIRS))}")
        expect_choice(pos_encoding_mode, "pos_encoding_mode", POS_ENCODING_MODES)
        expect_window_left(window_left)
        c.num_qo_heads, c.num_kv_heads, c.group = num_qo_heads, num_kv_heads, num_qo_heads // num_kv_heads
        c.head_dim_qk, c.head_dim_vo, c.page_size = head_dim_qk, head_dim_vo, page_size
        c.mask = "custom" if custom else ("causal" if causal else "none")
        c.pos_encoding = _POS_ENCODINGS[pos_encoding_mode]
        c.window_left = window_left
        c.soft_cap = soft_cap_value(logits_soft_cap)
        if c.pos_encoding == "alibi" and c.soft_cap:
            raise ValueError("pos_encoding_mode='ALIBI' with logits_soft_cap is not supported (pass one of them)")
        c.sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim_qk)
        c.rope_scale = float(rope_scale) if rope_scale is not None else 1.0
        c.rope_theta = float(rope_theta) if rope_theta is not None else 1e4
        c.q_dtype = as_dtype(q_data_type, "q_data_type", torch.float16)
        c.kv_dtype = as_dtype(kv_data_type, "kv_data_type", c.q_dtype)
        # FP8 attention (q, K and V in e4m3; the Hopper kernel only): the output float16 unless
        # o_data_type says bfloat16, as the decode wrapper's fp8 q
        fp8 = sm90.fp8_attention(c)
        c.o_dtype = as_dtype(o_data_type, "o_data_type", torch.float16 if fp8 else c.q_dtype)
        for name, value, allowed in (("q_data_type", c.q_dtype, _Q_DTYPES + (torch.float8_e4m3fn,)),
                                     ("o_data_type", c.o_dtype, _Q_DTYPES),
                                     ("kv_data_type", c.kv_dtype, _Q_DTYPES + _FP8_DTYPES)):
            if value not in allowed:
                raise ValueError(f"{name}: expected one of {', '.join(dtype_str(d) for d in allowed)}, got "
                                 f"{dtype_str(value)}")
        if fp8 and c.kv_dtype != c.q_dtype:
            raise ValueError(f"kv_data_type: FP8 attention (q_data_type float8_e4m3fn) takes e4m3 K and V, got "
                             f"{dtype_str(c.kv_dtype)}")
        if fixed_split_size is not None and (not isinstance(fixed_split_size, int) or fixed_split_size <= 0):
            raise ValueError(f"fixed_split_size: expected None or a positive int (keys per chunk), got "
                             f"{fixed_split_size!r}")
        c.fixed_split_size, c.disable_split_kv = fixed_split_size, bool(disable_split_kv)
        c.logit_scale, c.cap_log2 = _logit_scales(c, None, None)
        # whether plan() may reorder a paged batch's pages (sort_pages): no term depends on a
        # key's position (no RoPE, no ALiBi bias; flashinfer_jit/runtime/page_order.py), and the
        # pages are on a GPU
        c.pages_movable = c.mask != "custom" and c.pos_encoding == "none" and window_left < 0 and \
            self._device.type == "cuda"
        if not fp8:  # (fp8: the Hopper kernel's fp8 form or nothing; plan() says why not, sm90.unsupported)
            self._spec(c, "csr", False)  # validates the dtypes and head dims now (ValueError, nothing built)
        # what plan() keeps per configuration: K/V side -> (the planner's _PlanConfig, its
        # address), page table -> the spec of a run() without sinks
        c.structs, c.plain_specs = {}, {}
        return c

    def _spec(self, c: _Config, page_table: str, sinks: bool) -> PrefillSpec:
        kv_dtype = dtype_name(c.kv_dtype)
        if self._ragged and kv_dtype in FP8_DTYPES:
            raise ValueError(f"kv_data_type: fp8 ({kv_dtype}) K/V is for the paged cache only; ragged K/V takes q's dtype")
        return _prefill_spec(dtype_name(c.q_dtype), kv_dtype, dtype_name(c.o_dtype), c.head_dim_qk, c.head_dim_vo,
                             "ragged" if self._ragged else "paged", "csr" if self._ragged else page_table,
                             "NHD" if self._ragged else self._kv_layout, c.mask, c.pos_encoding, c.soft_cap > 0, sinks)

    def _config(self, args: tuple) -> _Config:
        return remembered(self._configs, args, self._configure)

    def _plan_common(self, config: _Config, qo_indptr, side: int, kv_a, kv_b, table_layout: str, ids_dev,
                     max_kv_len: int, custom_mask, packed_custom_mask, mask_indptr, non_blocking: bool,
                     sort_pages: bool = False) -> None:
        """side: _CSR (kv_a = page indptr, kv_b = last_page_len), _SEQ_LENS (kv_a = seq_lens)
        or _RAGGED (kv_a = kv_indptr), index vectors as given (kv_b: None but for _CSR);
        ids_dev: the page ids on the device (paged) or None; sort_pages: plan()'s argument."""
        planner = _native_planner() if env.native_prefill_plan() else None
        graph = self._use_cuda_graph
        result = self._result
        slot = self._plan_buffer.host(self._slot_size)
        status = -1
        if planner is not None and planner[1] is not None and not graph and config.mask != "custom":
            # Index vectors of the common form (contiguous int32 CPU tensors of the batch's
            # lengths) go to the planner as given, through fij_fastcall: neither converted nor
            # checked here, nor passed through ctypes (-1: another form, converted and checked
            # below). Capacity 0 is the batch's own.
            run, address = planner[1]
            cfg, cfg_address = self._plan_struct(config, side, 0, max_kv_len)
            status = run(address, cfg_address, side, qo_indptr, kv_a, kv_b, slot.address, slot.array.shape[0],
                         self._result_ptr)
        if status >= 0:
            qo = qo_indptr
            batch = capacity = qo.shape[0] - 1
            extra = 0
        else:
            qo, kv_a, kv_b, batch = _host_vectors(qo_indptr, side, kv_a, kv_b)
            if graph:
                self._capacity = graph_capacity(self._capacity, batch)
            capacity = self._capacity if graph else batch
            cfg, cfg_address = self._plan_struct(config, side, capacity if graph else 0, max_kv_len)
            extra = capacity + 1 if config.mask == "custom" else 0  # mask_indptr, after the work list
            status = self._call_planner(planner, cfg, cfg_address, qo, kv_a, kv_b, batch, slot, extra)
        if status == _SLOT_TOO_SMALL:  # the planner said how much it needs: once more, in a larger slot
            self._slot_size = int(result[_END]) + extra
            slot = self._plan_buffer.regrow(self._slot_size)
            status = self._call_planner(planner, cfg, cfg_address, qo, kv_a, kv_b, batch, slot, extra)
        if status:
            self._raise_plan_error(int(status), int(result[1]), config, side, qo, kv_a, kv_b, int(result[_ITEMS]))
        if graph and self._graph_items is None:
            # the first CUDA-graph plan sizes the work list for later plans with more items
            self._graph_items = max(_GRAPH_MIN_ITEMS, _GRAPH_ITEMS_FACTOR * int(result[_ITEMS]))
            self._graph_tile = int(result[_TILE_ROWS])
            self._plan_common(config, qo_indptr, side, kv_a, kv_b, table_layout, ids_dev, max_kv_len, custom_mask,
                              packed_custom_mask, mask_indptr, non_blocking, sort_pages)
            return
        _, _, items, tile_rows, qo_tokens, partial_rows, table_at, merge_at, work_at, end, kv_rows, movable = \
            result.tolist()
        if side == _CSR and kv_rows > ids_dev.shape[0]:
            raise ValueError(f"paged_kv_indptr: its last offset {kv_rows} exceeds the {ids_dev.shape[0]} page ids of "
                             "paged_kv_indices")
        if side == _RAGGED:
            self._kv_rows = kv_rows
        mask_args = (None, None)
        if config.mask == "custom":
            qo_lens = np.diff(qo.numpy().astype(np.int64))
            kv_lens = _kv_lens_numpy(side, kv_a, kv_b, config.page_size)
            starts = self._mask_offsets(qo_lens, kv_lens, custom_mask, packed_custom_mask, mask_indptr)
            slot.array[end:end + batch + 1] = starts
            slot.array[end + batch + 1:end + capacity + 1] = starts[-1]
            mask_args = (self._packed_mask(config, qo_lens, kv_lens, custom_mask, packed_custom_mask, starts), None)
        total = end + extra
        self._plan_buffer.ship(slot, total, non_blocking)
        # (without a mask index the work list's view runs to the buffer's end: the key, and so
        # the views, stay while plans of one batch size differ in items)
        key = (side, capacity, table_at, merge_at, work_at) + ((end, total) if total > end else (None, None))
        qo_dev, table_dev, merge_dev, work_dev, mask_indptr_dev = self._plan_buffer.views(key, _carve)
        if mask_args[0] is not None:
            mask_args = (mask_args[0], mask_indptr_dev)
        plan = _Plan()
        plan.config = config
        previous = self._plan
        # (dtype names and the spec's construction: once per configuration, not every plan)
        spec = config.plain_specs.get(table_layout)
        if spec is None:
            spec = config.plain_specs[table_layout] = self._spec(config, table_layout, False)
        plan.spec = spec
        # the module is looked up at run() (a run with sinks takes the sinks module: loading
        # the plain one here would build a module that no run() uses)
        plan.op = previous.op if previous is not None and previous.spec is spec else None
        plan.batch, plan.qo_tokens, plan.tile_rows = batch, qo_tokens, tile_rows
        plan.grid = self._graph_grid(config.head_dim_qk, tile_rows) if graph else items
        plan.merge_rows = qo_tokens if partial_rows else 0
        plan.layout = table_layout
        kv_index = list(table_dev) if side == _RAGGED else self._kv_index(table_dev, ids_dev)
        plan.unordered = None
        if side != _RAGGED:
            # Each request's pages that every query row sees whole, in page-id order (the H100
            # reads ascending addresses faster), where no term depends on a key's position
            # (flashinfer_jit/runtime/page_order.py); a run() with a window reads the ids as given.
            csr = side == _CSR
            # (and writes each pair's first page ids into the work list: csrc/prefill/prefill_params.h)
            ordered = self._page_order.order(ids_dev, table_dev[0], csr, batch, movable, config.page_size,
                                             sort_pages and config.pages_movable,
                                             qo_dev if config.mask == "causal" else None,
                                             table_dev[1] if csr else None, work_dev.data_ptr() + 4,
                                             items // config.num_kv_heads)
            if ordered is not None:
                plan.unordered = kv_index
                kv_index = self._kv_index(table_dev, ordered)
        if partial_rows:
            po, pl = self._split.views(partial_rows, config.num_qo_heads, config.head_dim_vo)
            plan.args = (kv_index, qo_dev, work_dev, merge_dev, po, pl, self._split.merge_counters(pl.numel()))
        else:  # (no merge index, partial states or counters: placeholders)
            none_f32, none_i32 = self._placeholders
            plan.args = (kv_index, qo_dev, work_dev, merge_dev if merge_dev is not None else none_i32, none_f32,
                         none_f32, none_i32)
        plan.mask_args = mask_args
        plan.fast = [None, None]  # run()'s recorded launch, without and with sinks (_run)
        plan.quick = None  # run()'s common form through fij_fastcall.prefill_run (_run)
        plan.sinks_spec = None  # the module a run() with sinks takes (_run)
        plan.checked = None  # run()'s checks: at the first run() of each plan (kv rows, tokens change)
        self._plan = plan
        # what a run() under torch.compile reads (plain values Dynamo traces; see _run_traced),
        # its tensors marked static inputs (CUDA-graph trees take them where they are)
        traced = self._traced
        key = traced[0] if traced is not None and previous is not None and previous.spec is spec else traced_key(spec)
        static_inputs(*plan.args[0], *plan.args[1:], *mask_args, *(plan.unordered or ()))
        self._traced = (key, plan.args, plan.unordered, mask_args, plan.grid, tile_rows, plan.merge_rows,
                        bool(partial_rows), qo_tokens, config)

    def _call_planner(self, planner, cfg, cfg_address: int, qo, kv_a, kv_b, batch: int, slot, extra: int) -> int:
        """The C++ planner (or its numpy twin) into `slot`, leaving `extra` int32s at its end
        for mask_indptr; the status, with the results in self._result."""
        room = slot.array.shape[0] - extra
        if planner is None:
            return _plan_numpy(cfg, qo, kv_a, kv_b, batch, slot.array[:room], self._result)
        return planner[0](cfg_address, qo.data_ptr(), kv_a.data_ptr(), kv_b.data_ptr() if kv_b is not None else None,
                          batch, slot.address, room, self._result_ptr)

    def _max_tile_rows(self, config: _Config) -> int:
        """The largest query tile plan() may pick. A CUDA-graph wrapper's grid loops over the
        work list (_graph_grid); head_dim 256's non-causal 128-row tile takes one item a block
        (8 warps, csrc/prefill/prefill.cuh kWide, kOneItemABlock), so its graphs keep the 64-row tile.
        head_dim 512's modules hold the 64-row tile alone (tile_rows_of)."""
        tiles = tile_rows_of(config.head_dim_qk)
        return min(tiles) if self._use_cuda_graph and config.head_dim_qk >= 256 else max(tiles)

    def _graph_grid(self, head_dim_qk: int, tile_rows: int) -> int:
        """A CUDA-graph launch's fixed grid: one wave of the tile's blocks, which loop over the
        work list."""
        return sm_count(self._device) * _blocks_per_sm(head_dim_qk, tile_rows)

    def _plan_struct(self, config: _Config, side: int, capacity: int, max_kv_len: int):
        """(the planner's configuration for this plan, its address): kept per configuration
        and K/V side, the per-plan fields updated in place."""
        kept = config.structs.get(side)
        if kept is None:
            cfg = _PlanConfig(group=config.group, num_kv_heads=config.num_kv_heads, kv_side=side,
                              page_size=config.page_size, causal=int(config.mask == "causal"),
                              max_tile_rows=self._max_tile_rows(config),
                              short_causal_keys=_SHORT_CAUSAL_KEYS if config.head_dim_qk >= 256 else 0,
                              target_blocks=sm_count(self._device) * _BLOCKS_PER_SM, min_chunk=_MIN_CHUNK,
                              fixed_split_size=int(config.fixed_split_size or 0),
                              split=int(not self._use_cuda_graph and not config.disable_split_kv),
                              max_partial_rows=self._split.rows(config.num_qo_heads, config.head_dim_vo))
            kept = config.structs[side] = (cfg, ctypes.addressof(cfg))
        cfg = kept[0]
        # benchmarks and tests pin the tile; a CUDA-graph wrapper holds its first plan's
        cfg.tile_rows = self._force_tile_rows or self._graph_tile or 0
        cfg.capacity = capacity
        cfg.work_capacity = self._graph_items or 0
        cfg.max_kv_len = max_kv_len
        return kept

    def _raise_plan_error(self, status: int, index: int, config: _Config, side: int, qo, kv_a, kv_b, items: int):
        a_name, b_name = _SIDE_NAMES[side]
        if status == 1:
            raise ValueError(f"qo_indptr: expected non-decreasing offsets starting at 0; offset {index} to {index + 1} "
                             f"goes from {int(qo[index])} to {int(qo[index + 1]) if index + 1 < qo.shape[0] else '?'}")
        if status == 2:
            raise ValueError(f"{a_name}: expected non-decreasing offsets starting at 0 (at offset {index})")
        if status == 3:
            raise ValueError(f"{b_name}: expected 1..page_size ({config.page_size}) for every request with pages; "
                             f"request {index} has {int(kv_b[index])}")
        if status == 5:
            raise ValueError(f"{a_name}: expected 0..max_pages x page_size for every request; request {index} has "
                             f"{int(kv_a[index])}")
        if status == 7:
            raise ValueError(f"qo_indptr: this plan needs {items} work items, more than the {self._graph_items} this "
                             "CUDA-graph wrapper sized its work list for at its first plan()")
        if status == 8:
            raise ValueError(f"qo_indptr: {index} requests exceed this CUDA-graph wrapper's capacity {self._capacity}")
        raise RuntimeError(f"prefill plan(): planner status {status}")

    def _mask_offsets(self, qo_lens, kv_lens, custom_mask, packed_custom_mask, mask_indptr) -> np.ndarray:
        """Byte offsets of each request's packed mask (mask_indptr of the packed form)."""
        sizes_bits = qo_lens * kv_lens
        if packed_custom_mask is not None:
            if not isinstance(packed_custom_mask, torch.Tensor) or packed_custom_mask.dtype != torch.uint8:
                raise ValueError("packed_custom_mask: expected a uint8 tensor (bits packed little-endian, "
                                 "segment_packbits(..., bitorder='little'))")
            nbytes = -(-sizes_bits // 8)
            if mask_indptr is None:
                if qo_lens.shape[0] > 1:
                    raise ValueError("mask_indptr: required with packed_custom_mask for batch size > 1 (byte offsets "
                                     "of each request's packed mask, as segment_packbits returns)")
                starts = np.array([0, int(nbytes.sum())], dtype=np.int64)
            else:
                starts = _host_vector(mask_indptr, "mask_indptr")
            if starts.shape[0] != qo_lens.shape[0] + 1 or starts[0] != 0 or \
                    (np.diff(starts) != nbytes).any() or starts[-1] > packed_custom_mask.numel():
                raise ValueError(f"mask_indptr: expected byte offsets with ceil(qo_len x kv_len / 8) = "
                                 f"{nbytes[:8].tolist()}... bytes per request, ending within packed_custom_mask's "
                                 f"{packed_custom_mask.numel()} bytes; got {starts[:9].tolist()}")
            return starts
        if not isinstance(custom_mask, torch.Tensor) or custom_mask.dtype not in (torch.bool, torch.uint8):
            raise ValueError("custom_mask: expected a bool tensor, each request's qo_len x kv_len mask flattened, "
                             "one after another")
        if mask_indptr is not None:
            starts = _host_vector(mask_indptr, "mask_indptr")
            if starts.shape[0] != qo_lens.shape[0] + 1 or starts[0] != 0 or (np.diff(starts) != sizes_bits).any():
                raise ValueError(f"mask_indptr: expected element offsets of qo_len x kv_len per request "
                                 f"({sizes_bits[:8].tolist()}...); got {starts[:9].tolist()}")
        if custom_mask.numel() != int(sizes_bits.sum()):
            raise ValueError(f"custom_mask: expected sum(qo_len x kv_len) = {int(sizes_bits.sum())} elements, got "
                             f"{custom_mask.numel()}")
        return np.concatenate(([0], np.cumsum(-(-sizes_bits // 8))))

    def _packed_mask(self, config, qo_lens, kv_lens, custom_mask, packed_custom_mask, byte_starts) -> torch.Tensor:
        if packed_custom_mask is not None:
            return packed_custom_mask.to(self._device).reshape(-1)
        return _pack_segments(custom_mask.reshape(-1).to(self._device), qo_lens * kv_lens, byte_starts)

    # --- run ----------------------------------------------------------------------------------
    def _run(self, q, k, v, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl, window_left, sinks):
        if type(self._plan) is sm90.Sm90Plan:
            return self._run_sm90(q, k, v, q_scale, k_scale, v_scale, out, lse, return_lse, window_left, sinks)
        if compiling():
            return self._run_traced(q, k, v, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl,
                                    window_left, sinks)
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() before plan(): call plan() once per batch first")
        c = plan.config
        quick = plan.quick
        if quick is not None and lse is None and not return_lse and sinks is None and window_left is None and \
                q_scale is None and k_scale is None and v_scale is None and (out is not None or type(q) is _Tensor):
            # The common form of a recorded signature: fij_fastcall checks in C++ that q, K/V
            # and out are still what the op recorded, and launches (a negative code: they are
            # not; the checks in full below)
            if out is None:
                out = torch.empty((q.shape[0], c.num_qo_heads, c.head_dim_vo), dtype=c.o_dtype, device=q.device)
            code = quick[0](quick[1], quick[2], quick[3], q, k, v, out, c.logit_scale, c.cap_log2, 1.0,
                            c.window_left, self._pdl if enable_pdl is None else enable_pdl)
            if code == 0:
                return out
            if code > 0:
                raise launch_failed(plan.spec, "prefill", code)
        # The checks in full only for a q or K/V unlike the last that passed them (in shape,
        # strides, dtype or device); alignment depends on the address: every call.
        ptrs = passed_run_checks(q, k, v, plan.checked)
        if ptrs is not None:
            qp, kp, vp = ptrs
        else:
            self._check_run(q, k, v, plan)
            qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        spec = plan.spec
        if sinks is not None:
            _check_sinks(sinks, c.num_qo_heads, q.device)
            if c.pos_encoding == "alibi":
                raise ValueError("sinks: not supported with pos_encoding_mode='ALIBI' (expected None)")
            spec = plan.sinks_spec
            if spec is None:
                spec = plan.sinks_spec = self._spec(c, plan.layout, True)
        window_left = _run_window(window_left, c)
        # (a window given to run() on a plan that reordered the pages reads the ids as given;
        # plan() reorders only without a window, so any window here is run()'s)
        as_given = window_left >= 0 and plan.unordered is not None
        tokens = q.shape[0]
        if out is None:
            out = torch.empty((tokens, c.num_qo_heads, c.head_dim_vo), dtype=c.o_dtype, device=q.device)
            out_standard, op = True, out.data_ptr()
        else:
            out_standard = type(out) is _Tensor and out.is_contiguous()
            op = out.data_ptr() if out_standard else 0
            if not (out_standard and out.shape == (tokens, c.num_qo_heads, c.head_dim_vo) and
                    out.dtype is c.o_dtype and not op & 15 and out.device == q.device):
                _check_out(out, (tokens, c.num_qo_heads, c.head_dim_vo), c.o_dtype, q.device, "out")
        if return_lse and lse is None:
            lse = torch.empty((tokens, c.num_qo_heads), dtype=torch.float32, device=q.device)
        elif lse is not None:
            _check_out(lse, (tokens, c.num_qo_heads), torch.float32, q.device, "lse", contiguous=True, align=4)
        if q_scale is None and k_scale is None:
            logit_scale, cap_log2 = c.logit_scale, c.cap_log2
        else:
            logit_scale, cap_log2 = _logit_scales(c, q_scale, k_scale)
        vs = 1.0 if v_scale is None else float(v_scale)
        pdl = self._pdl if enable_pdl is None else bool(enable_pdl)
        with_sinks = sinks is not None
        fast = plan.fast[with_sinks]
        if fast is not None and out_standard and not as_given:
            # The launch the op resolved at an earlier call with this signature, with this
            # call's pointers and scalars: no dispatcher.
            call, _, address, device_index = fast
            code = call(address, qp, kp, vp, op, 0 if lse is None else lse.data_ptr(),
                        sinks.data_ptr() if with_sinks else 0, logit_scale, cap_log2, vs, window_left,
                        raw_stream(device_index), pdl)
            if code:
                raise launch_failed(spec, "prefill", code)
            return (out, lse) if return_lse else out
        if spec is plan.spec:
            op = plan.op
            if op is None:
                op = plan.op = module_op(spec, "prefill", env.debug())
        else:
            op = module_op(spec, "prefill", env.debug())
        entry = fast_entry(spec, "prefill", env.debug()) if out_standard and not as_given else None
        prepared = launch_buffer(entry)
        record_quick = entry is not None and entry.runner is not None and not with_sinks and lse is None and \
            q_scale is None and k_scale is None and v_scale is None and window_left == c.window_left
        kv_index, qo_indptr, work, merge, po, pl, counters = plan.args
        if as_given:
            kv_index = plan.unordered
        mask, mask_indptr = plan.mask_args
        op(q, k, v, kv_index, qo_indptr, work, merge, mask, mask_indptr, sinks, out,
           lse if lse is not None else empty_f32(q.device), po, pl, counters, logit_scale, cap_log2, vs, window_left,
           c.rope_scale, c.rope_theta, plan.grid, plan.tile_rows, plan.merge_rows, pdl, prepared)
        if prepared is not None:  # later calls with this signature take the fast path
            plan.fast[with_sinks] = recorded(entry, prepared, q.get_device())
            if record_quick:  # (prepared stays alive in plan.fast[False])
                run, address = entry.runner
                plan.quick = (run, address, prepared.data_ptr(), fastcall.tensor_signature(q, k, v, out))
        return (out, lse) if return_lse else out

    def _run_sm90(self, q, k, v, q_scale, k_scale, v_scale, out, lse, return_lse, window_left, sinks):
        """run() of a plan on the Hopper path: the checks run() makes for the mma.sync kernel,
        then its op (one launch: no split, no merge)."""
        plan = self._plan
        c = plan.config
        if sinks is not None:
            _check_sinks(sinks, c.num_qo_heads, q.device)
            if c.pos_encoding == "alibi":
                raise ValueError("sinks: not supported with pos_encoding_mode='ALIBI' (expected None)")
        out, lse, logit_scale, vs = self._sm90_args(q, k, v, q_scale, k_scale, v_scale, out, lse, return_lse,
                                                    window_left)
        if plan.gather is not None:  # an fp8 cache or RoPE over the paged cache: a copy of the batch's pages
            k, v = sm90.gather_pages(k, v, plan.gather, self._kv_layout, c.q_dtype)
        if plan.rope is not None:  # ROPE_LLAMA: q and k (ragged, or the copy's rows) rotated first
            q, k = sm90.rope_prepass(q, k, plan.rope, c)  # (a copy's rows too)
        if compiling():
            op = traced_op(traced_namespace(*plan.traced_key), "prefill_sm90")
        else:
            op = plan.op
            if op is None:
                op = plan.op = module_op(plan.spec, "prefill_sm90", env.debug())
        op(q, k, v, plan.work, plan.page_ids, plan.mask, plan.counters, out, lse if lse is not None else empty_f32(q.device),
           sinks if sinks is not None else empty_f32(q.device), logit_scale, c.cap_log2, c.window_left, vs, plan.grid)
        return (out, lse) if return_lse else out

    def _sm90_args(self, q, k, v, q_scale, k_scale, v_scale, out, lse, return_lse, window_left=None) -> tuple:
        """A Hopper-path run()'s checks and outputs: (out, lse or None, logit scale, v scale),
        out and lse allocated where not given. POD on Hopper takes them too."""
        plan = self._plan
        c = plan.config
        if window_left is not None and max(window_left, -1) != max(c.window_left, -1):
            raise ValueError(f"window_left={window_left}: a plan on the Hopper path runs plan()'s window "
                             f"({c.window_left}); plan() with this one (its first key tiles follow the window)")
        traced = compiling()
        if not traced and passed_run_checks(q, k, v, plan.checked) is None:
            self._check_run(q, k, v, plan)
        tokens = q.shape[0]
        if traced:
            self._check_traced(q, k, v, c, plan.qo_tokens)
        if out is None:
            out = torch.empty((tokens, c.num_qo_heads, c.head_dim_vo), dtype=c.o_dtype, device=q.device)
        elif not traced:
            _check_out(out, (tokens, c.num_qo_heads, c.head_dim_vo), c.o_dtype, q.device, "out")
        if return_lse and lse is None:
            lse = torch.empty((tokens, c.num_qo_heads), dtype=torch.float32, device=q.device)
        elif lse is not None and not traced:
            _check_out(lse, (tokens, c.num_qo_heads), torch.float32, q.device, "lse", contiguous=True, align=4)
        logit_scale = c.logit_scale if q_scale is None and k_scale is None else _logit_scales(c, q_scale, k_scale)[0]
        return out, lse, logit_scale, 1.0 if v_scale is None else float(v_scale)

    def _run_traced(self, q, k, v, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl, window_left,
                    sinks):
        """run() as torch.compile traces it: checks of shapes and dtypes only (no addresses,
        no host caches, no fij_fastcall), then the module's op, which the graph records (a
        torch op whose writes its schema declares). It reads plain values that plan() leaves
        in self._traced; the plan's buffers enter the graph as (static) inputs, so a re-plan
        between calls changes their contents, not the graph."""
        q, k, v, out, lse, _, args = self._traced_args(q, k, v, q_scale, k_scale, v_scale, out, lse, return_lse,
                                                       window_left)
        traced = self._traced
        c = traced[-1]
        spec_type, params = traced[0]
        if sinks is not None:
            if sinks.dtype != torch.float32 or tuple(sinks.shape) != (c.num_qo_heads,):
                raise ValueError(f"sinks: expected a contiguous float32 tensor [{c.num_qo_heads}] (one logit per "
                                 "query head)")
            params = tuple((name, True if name == "sinks" else value) for name, value in params)
        op = traced_op(traced_namespace(spec_type, params), "prefill")
        kv_index, qo_indptr, work, merge, mask, mask_indptr, out, lse, po, pl, counters, logit_scale, vs, window, \
            grid, tile_rows, merge_rows = args
        op(q, k, v, list(kv_index), qo_indptr, work, merge, mask, mask_indptr, sinks, out, lse, po, pl, counters,
           logit_scale, soft_cap_log2(c.soft_cap), vs, window, c.rope_scale, c.rope_theta, grid, tile_rows,
           merge_rows, self._pdl if enable_pdl is None else enable_pdl, None)
        return (out, lse) if return_lse else out

    def _check_traced(self, q, k, v, c: _Config, qo_tokens: int) -> None:
        """run()'s checks while torch.compile traces it: shapes and dtypes against the plan (no
        addresses, no host caches)."""
        if q.dim() != 3 or q.shape[1] != c.num_qo_heads or q.shape[2] != c.head_dim_qk or q.dtype != c.q_dtype:
            raise ValueError(f"q: expected {dtype_str(c.q_dtype)} [qo_tokens, {c.num_qo_heads}, {c.head_dim_qk}] as "
                             f"planned, got {dtype_str(q.dtype)} {tuple(q.shape)}")
        if q.shape[0] < qo_tokens:
            raise ValueError(f"q: {q.shape[0]} tokens, fewer than qo_indptr[-1] = {qo_tokens}")
        for name, t, dim in (("k", k, c.head_dim_qk), ("v", v, c.head_dim_vo)):
            if t.dtype != c.kv_dtype or t.shape[-1] != dim:
                raise ValueError(f"{name}: expected {dtype_str(c.kv_dtype)} with head_dim {dim} as planned, got "
                                 f"{dtype_str(t.dtype)} {tuple(t.shape)}")
        self._check_kv(k, v, c)

    def _traced_args(self, q, k, v, q_scale, k_scale, v_scale, out, lse, return_lse, window_left) -> tuple:
        """What run() and POD's run() take of the plan while torch.compile traces: q's and
        K/V's checks of shape and dtype, out (given, or new) and lse (given, new with
        return_lse, else an empty tensor) and the op's planned arguments: (q, k, v, out, lse,
        lse asked for or given, (kv_index, qo_indptr, work, merge_indptr, mask, mask_indptr,
        out, lse, partial_o, partial_lse, merge_counters, logit_scale, v_scale, window_left,
        grid, tile_rows, merge_rows)). An unsplit plan's placeholders are new empty tensors
        (the graph's own): one kept tensor passed as two mutable arguments would alias them."""
        traced = self._traced
        if traced is None:
            raise RuntimeError("run() before plan(): call plan() once per batch first (outside the compiled region)")
        _, args, unordered, mask_args, grid, tile_rows, merge_rows, split, qo_tokens, c = traced
        self._check_traced(q, k, v, c, qo_tokens)
        tokens = q.shape[0]
        if out is None:
            out = torch.empty((tokens, c.num_qo_heads, c.head_dim_vo), dtype=c.o_dtype, device=q.device)
        asked = return_lse or lse is not None
        if lse is None:
            lse = torch.empty((tokens, c.num_qo_heads) if return_lse else (0,), dtype=torch.float32, device=q.device)
        window = c.window_left if window_left is None else window_left
        logit_scale = c.logit_scale if q_scale is None and k_scale is None else _logit_scales(c, q_scale, k_scale)[0]
        kv_index, qo_indptr, work, merge, po, pl, counters = args
        if window >= 0 and unordered is not None:
            kv_index = unordered  # (a window reads the page ids as given: see _run)
        if not split:
            po = torch.empty(0, dtype=torch.float32, device=q.device)
            pl = torch.empty(0, dtype=torch.float32, device=q.device)
            counters = torch.empty(0, dtype=torch.int32, device=q.device)
        mask, mask_indptr = mask_args
        return q, k, v, out, lse, asked, (kv_index, qo_indptr, work, merge, mask, mask_indptr, out, lse, po, pl,
                                          counters, logit_scale, 1.0 if v_scale is None else v_scale, window, grid,
                                          tile_rows, merge_rows)

    def _resolved_args(self, q, k, v, q_scale, k_scale, v_scale, return_lse, window_left, out=None,
                       lse=None) -> tuple:
        """What POD (flashinfer_jit/pod/) launches of this wrapper's plan: run()'s checks and
        outputs, and the prefill op's arguments without sinks, soft cap and RoPE (POD runs
        neither): (out, lse or None, (q, k, v, kv_index, qo_indptr, work, merge_indptr, mask,
        mask_indptr, out, lse, partial_o, partial_lse, merge_counters, logit_scale, v_scale,
        window_left, grid, tile_rows, merge_rows))."""
        if compiling():  # (checks of shapes and dtypes only, the op's arguments from self._traced)
            q, k, v, out, lse, asked, args = self._traced_args(q, k, v, q_scale, k_scale, v_scale, out, lse,
                                                               return_lse, window_left)
            return out, (lse if asked else None), (q, k, v, *args)
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() before plan(): call plan() once per batch first")
        c = plan.config
        if passed_run_checks(q, k, v, plan.checked) is None:
            self._check_run(q, k, v, plan)
        window_left = _run_window(window_left, c)
        tokens = q.shape[0]
        # (out / lse given: rows of a mixed batch's outputs, BatchAttention's views)
        if out is None:
            out = torch.empty((tokens, c.num_qo_heads, c.head_dim_vo), dtype=c.o_dtype, device=q.device)
        else:
            _check_out(out, (tokens, c.num_qo_heads, c.head_dim_vo), c.o_dtype, q.device, "out")
        if lse is not None:
            _check_out(lse, (tokens, c.num_qo_heads), torch.float32, q.device, "lse", contiguous=True, align=4)
        elif return_lse:
            lse = torch.empty((tokens, c.num_qo_heads), dtype=torch.float32, device=q.device)
        logit_scale = c.logit_scale if q_scale is None and k_scale is None else _logit_scales(c, q_scale, k_scale)[0]
        kv_index, qo_indptr, work, merge, po, pl, counters = plan.args
        if window_left >= 0 and plan.unordered is not None:
            kv_index = plan.unordered  # (a window reads the page ids as given: see _run)
        mask, mask_indptr = plan.mask_args
        args = (q, k, v, kv_index, qo_indptr, work, merge, mask, mask_indptr, out,
                lse if lse is not None else empty_f32(q.device), po, pl, counters, logit_scale,
                1.0 if v_scale is None else float(v_scale), window_left, plan.grid, plan.tile_rows, plan.merge_rows)
        return out, lse, args

    def _check_run(self, q, k, v, plan: _Plan) -> None:
        c = plan.config
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ValueError(f"q: expected a [qo_tokens, {c.num_qo_heads}, {c.head_dim_qk}] tensor")
        if q.dtype != c.q_dtype:
            raise ValueError(f"q: expected {dtype_str(c.q_dtype)} (plan()'s q_data_type), got {dtype_str(q.dtype)}")
        if q.shape[1] != c.num_qo_heads or q.shape[2] != c.head_dim_qk:
            raise ValueError(f"q: expected [qo_tokens, {c.num_qo_heads}, {c.head_dim_qk}] (plan()'s heads), got "
                             f"{tuple(q.shape)}")
        if q.shape[0] < plan.qo_tokens:
            raise ValueError(f"q: {q.shape[0]} tokens, fewer than qo_indptr[-1] = {plan.qo_tokens}")
        if q.stride(-1) != 1:
            raise ValueError("q: the head_dim axis must be contiguous")
        if max(q.stride(0), q.stride(1)) >= 2 ** 31:
            raise ValueError(f"q: token and head strides must be below 2^31 elements, got {q.stride()}")
        for name, t, dim in (("k", k, c.head_dim_qk), ("v", v, c.head_dim_vo)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor")
            if t.dtype != c.kv_dtype:
                raise ValueError(f"{name}: expected {dtype_str(c.kv_dtype)} (plan()'s kv_data_type), got "
                                 f"{dtype_str(t.dtype)}")
            if t.shape[-1] != dim or t.stride(-1) != 1:
                raise ValueError(f"{name}: expected a contiguous last dimension of head_dim {dim}, got shape "
                                 f"{tuple(t.shape)} strides {t.stride()}")
        if not same_cuda_device((q, k, v)):
            raise ValueError(f"q, k and v must be CUDA tensors on one device, got {q.device}, {k.device}, {v.device}")
        if q.device != self._device:
            raise ValueError(f"q: on {q.device}, but the workspace (and the plan) is on {self._device}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            es = t.element_size()
            if t.data_ptr() % 16 or any((s * es) % 16 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
                raise ValueError(f"{name}: the start address and every stride but the last must be multiples of 16 "
                                 f"bytes; got strides {t.stride()}")
        self._check_kv(k, v, c)
        plan.checked = run_signature(q, k, v)
        plan.fast = [None, None]  # a recorded launch holds the strides of the last signature
        plan.quick = None

    def _check_kv(self, k, v, c: _Config) -> None:
        raise NotImplementedError


_Tensor = torch.Tensor



def _run_window(window_left, c) -> int:
    """run()'s window_left: the planned one when None, else checked."""
    if window_left is None:
        return c.window_left
    if type(window_left) is not int or window_left < -1:
        raise ValueError(f"window_left: expected -1 (off) or a non-negative int, got {window_left!r}")
    return window_left


def _logit_scales(c, q_scale, k_scale) -> tuple[float, float]:
    """(logit_scale, soft_cap_log2) of csrc/prefill/prefill_params.h for these scales."""
    return logit_scale(c.sm_scale, c.soft_cap, q_scale, k_scale), soft_cap_log2(c.soft_cap)


def _check_sinks(sinks, num_qo_heads: int, device) -> None:
    """run(sinks=...): one float32 logit per query head, contiguous, on q's device."""
    if type(sinks) is not _Tensor or sinks.dtype != torch.float32 or sinks.shape != (num_qo_heads,) or \
            sinks.device != device or not sinks.is_contiguous():
        raise ValueError(f"sinks: expected a contiguous float32 tensor [{num_qo_heads}] (one logit per query head) "
                         f"on {device}")


def _check_out(t, shape: tuple, dtype, device, name: str, contiguous: bool = False, align: int = 16) -> None:
    """An output the caller passes: its shape, dtype and device; a contiguous last dimension
    (contiguous: all of it); the start and every outer stride a multiple of `align` bytes (16:
    the output rows' 16-byte stores; the LSE, stored a float at a time, takes 4)."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        got = f"{dtype_str(t.dtype)} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected {dtype_str(dtype)} {shape} on {device}, got {got}")
    if (contiguous and not t.is_contiguous()) or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected {'a contiguous tensor' if contiguous else 'a contiguous last dimension'}")
    es = t.element_size()
    if t.data_ptr() % align or any((st * es) % align for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
        raise ValueError(f"{name}: the start address and every stride but the last must be multiples of {align} "
                         f"bytes ({align}-byte stores); got strides {t.stride()}")
    if max(t.stride(), default=0) >= 2 ** 31:
        raise ValueError(f"{name}: strides must be below 2^31 elements, got {t.stride()}")


def _pack_segments(bits: torch.Tensor, sizes: np.ndarray, byte_starts: np.ndarray) -> torch.Tensor:
    """Each request's bits packed from its own byte (segment_packbits, little bit order), on
    the bits' device."""
    total_bytes = int(byte_starts[-1])
    device = bits.device
    if total_bytes == 0:
        return torch.zeros(1, dtype=torch.uint8, device=device)
    seg = torch.repeat_interleave(torch.arange(sizes.shape[0], device=device),
                                  torch.as_tensor(sizes, device=device))
    elem_start = torch.as_tensor(np.concatenate(([0], np.cumsum(sizes)[:-1])), device=device)
    dest = torch.as_tensor(byte_starts[:-1] * 8, device=device)[seg] + \
        (torch.arange(bits.numel(), device=device) - elem_start[seg])
    flat = torch.zeros(total_bytes * 8, dtype=torch.uint8, device=device)
    flat[dest] = (bits != 0).to(torch.uint8)
    weights = (1 << torch.arange(8, device=device, dtype=torch.int32))
    return (flat.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


class BatchPrefillWithPagedKVCacheWrapper(_PrefillWrapper):
    """FlashInfer's paged prefill wrapper: plan() once per batch, run() per layer.

    backend: "fa2" runs the tensor-core (mma.sync) kernel; "fa3" the Hopper path (sm_90;
    flashinfer_jit/prefill/sm90.py lists what it takes: the CSR table or block tables, pages
    of 16-128 tokens, CUDA graphs; plan() raises ValueError naming anything else); "auto" as
    the ragged wrapper's."""

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto",
                 jit_args=None, jit_kwargs=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, custom_mask_buf,
                         mask_indptr_buf, backend)
        # CUDA graphs: the page ids a captured run() reads
        self._graph_ids = GraphPageIds.from_constructor(
            self._device, ("paged_kv_indptr_buf", "paged_kv_indices_buf", "paged_kv_last_page_len_buf"),
            (paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf))

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, page_size: int, head_dim_vo=None, custom_mask=None,
             packed_custom_mask=None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, sm_scale=None, window_left: int = -1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking: bool = True, prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0,
             max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None, max_token_per_sequence=None,
             max_sequence_kv=None, fixed_split_size=None, disable_split_kv: bool = False, mask_indptr=None,
             sort_pages: bool = True) -> None:
        """Index tensors may be int32 or int64, on the host or the device. The page table is
        CSR (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len) or, with those None,
        block_tables [B, max_pages] (vLLM) or [B, 2, max_pages] (K and V page ids) with
        seq_lens [B]. custom_mask (bools) or packed_custom_mask (uint8, little bit order,
        mask_indptr in bytes as segment_packbits returns) replace causal. o_data_type: the
        output dtype (default q's). fixed_split_size (keys a chunk) / disable_split_kv force
        plan()'s split-KV choice. pos_encoding_mode: "NONE", "ROPE_LLAMA" or "ALIBI"
        (FlashInfer's linear bias; not with logits_soft_cap, nor with run()'s sinks).

        Multi-item scoring (FlashInfer's prefix_len_ptr [B], token_pos_in_items_ptr: each
        token's position in its item past the shared prefix, 0 for a delimiter, request b's
        from entry b x token_pos_in_items_len; max_item_len_ptr [B], accepted and unused):
        each token past its request's prefix sees the prefix and its own item, causally
        (multi_item_mask). It runs as a custom mask built here from those tensors (read on
        the host: a device tensor costs a synchronization), replacing causal and any custom
        mask.

        sort_pages (not in FlashInfer): where nothing depends on a key's position (no RoPE or
        ALiBi in the kernel, no window, no custom mask), run() reads the pages that every query
        row of a request sees whole (all but the last; causal: those of keys up to kv_len -
        qo_len) in ascending page-id order, from a copy plan() writes on the GPU; the output is
        the same up to rounding (the sums run in another order). False: the pages as given."""
        expect_bool(sort_pages, "sort_pages")
        if not isinstance(page_size, int) or not 1 <= page_size <= 1024:
            raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
        if prefix_len_ptr is not None or token_pos_in_items_ptr is not None or max_item_len_ptr is not None:
            # multi-item scoring: FlashInfer's mask, as a custom mask built here (it replaces
            # causal and any custom mask, as FlashInfer's MULTIITEMSCORING mode does)
            if block_tables is not None:
                kv_lens = host_index(seq_lens, "seq_lens", any_int=True) if seq_lens is not None else None
                if kv_lens is None:
                    raise ValueError("seq_lens: block_tables take seq_lens")
            else:
                ip = host_index(paged_kv_indptr, "paged_kv_indptr", any_int=True)
                last = host_index(paged_kv_last_page_len, "paged_kv_last_page_len", any_int=True)
                if last.shape[0] != ip.shape[0] - 1:
                    raise ValueError(f"paged_kv_last_page_len: expected {ip.shape[0] - 1} values, got {last.shape[0]}")
                kv_lens = csr_kv_lens_host(ip, last, page_size)
            custom_mask = _multi_item_custom_mask(qo_indptr, kv_lens, prefix_len_ptr, token_pos_in_items_ptr,
                                                  token_pos_in_items_len, max_item_len_ptr)
            packed_custom_mask, mask_indptr = None, None
        args = (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, bool(causal),
                custom_mask is not None or packed_custom_mask is not None, pos_encoding_mode, window_left,
                logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type, kv_data_type, o_data_type,
                fixed_split_size, disable_split_kv)
        config = self._config(args)
        if block_tables is not None:
            expect_one_page_table("paged_kv_indptr/paged_kv_indices/paged_kv_last_page_len",
                                  paged_kv_indptr is not None or paged_kv_last_page_len is not None)
            layout, block_tables = parse_block_tables(block_tables, seq_lens)
            if self._plan_sm90(config, qo_indptr, seq_lens, non_blocking, layout, block_tables,
                               mask_args=(custom_mask, packed_custom_mask, mask_indptr)):
                return
        elif self._plan_sm90(config, qo_indptr, paged_kv_indptr, non_blocking, "csr", paged_kv_indices,
                             paged_kv_last_page_len, (custom_mask, packed_custom_mask, mask_indptr)):
            return
        if block_tables is not None:
            if self._use_cuda_graph:
                ids = self._graph_ids.fill_block_tables(block_tables, self._capacity)
            else:
                ids = block_tables.to(self._device)
            self._plan_common(config, qo_indptr, _SEQ_LENS, seq_lens, None, layout, ids,
                              block_tables.shape[-1] * page_size, custom_mask, packed_custom_mask, mask_indptr,
                              non_blocking, sort_pages)
            return
        indices = as_int32_index(paged_kv_indices, "paged_kv_indices")
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
            raise ValueError("paged_kv_indices: expected a 1-D int32 tensor of page ids")
        if self._use_cuda_graph:
            ids = self._graph_ids.fill_indices(indices, "paged_kv_indices")
        else:
            ids = indices if indices.device == self._device else indices.to(self._device)
        self._plan_common(config, qo_indptr, _CSR, paged_kv_indptr, paged_kv_last_page_len, "csr", ids, 0,
                          custom_mask, packed_custom_mask, mask_indptr, non_blocking, sort_pages)

    def _kv_index(self, table_dev, ids_dev):
        if len(table_dev) == 2:  # csr: indptr, last_page_len
            return [table_dev[0], ids_dev, table_dev[1]]
        return [ids_dev, table_dev[0]]

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None):
        """out [qo_tokens, num_qo_heads, head_dim_vo] (or (out, lse) with return_lse; lse float32,
        base 2). k_scale folds into the logits' scale, v_scale multiplies the output (fp8
        caches). sinks: float32 [num_qo_heads], gpt-oss attention sinks."""
        if args:
            raise TypeError("run(): pass q_scale, k_scale, v_scale, out, lse and return_lse by keyword")
        if type(paged_kv_cache) is tuple and len(paged_kv_cache) == 2:
            k, v = paged_kv_cache  # (checked with q by _run, in full for a signature it has not seen)
        else:  # one [num_pages, 2, ...] tensor: its K and V views (or its error)
            cache = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout, same_head_dim=False)
            k, v = cache.k, cache.v
        return self._run(q, k, v, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl, window_left, sinks)

    def run_return_lse(self, q, paged_kv_cache, *args, **kwargs):
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    def forward(self, q, paged_kv_cache, *args, **kwargs):
        return self.run(q, paged_kv_cache, *args, **kwargs)

    def end_forward(self) -> None:
        pass

    def _check_run(self, q, k, v, plan: _Plan) -> None:
        unpack_paged_kv_cache((k, v), self._kv_layout, same_head_dim=False)  # (errors that name paged_kv_cache)
        super()._check_run(q, k, v, plan)

    def _check_kv(self, k, v, c: _Config) -> None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"paged_kv_cache: expected K and V [num_pages, page_size, {c.num_kv_heads}, head_dim] "
                             f"({self._kv_layout}), got {tuple(k.shape)} and {tuple(v.shape)}")
        nhd = self._kv_layout == "NHD"
        heads, page = (k.shape[2], k.shape[1]) if nhd else (k.shape[1], k.shape[2])
        if heads != c.num_kv_heads:
            raise ValueError(f"paged_kv_cache: {heads} KV heads, but plan() was given num_kv_heads={c.num_kv_heads}")
        if page != c.page_size:
            raise ValueError(f"paged_kv_cache: page size {page}, but plan() was given page_size={c.page_size}")


class BatchPrefillWithRaggedKVCacheWrapper(_PrefillWrapper):
    """FlashInfer's ragged prefill wrapper: K/V as rows [kv_tokens, num_kv_heads, head_dim]
    (any token and head strides), request b's at kv_indptr[b] .. kv_indptr[b + 1].

    backend: "fa2" runs the tensor-core (mma.sync) kernel; "fa3" the Hopper path (sm_90:
    wgmma, TMA, warp-specialized and persistent; flashinfer_jit/prefill/sm90.py lists what it
    takes, and plan() raises ValueError naming anything else); "auto" takes the Hopper path
    on an sm_90 GPU for a configuration it takes, requests averaging 64 or more query tokens
    and query tiles averaging enough keys (sm90.AUTO_MIN_KEYS), else the mma.sync
    kernel. `planned_backend` tells which a plan runs."""

    _ragged = True

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend: str = "auto", jit_args=None, jit_kwargs=None):
        if kv_layout != "NHD":
            raise ValueError(f"kv_layout: ragged K/V are [kv_tokens, num_kv_heads, head_dim] (NHD), got {kv_layout!r}")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, custom_mask_buf,
                         mask_indptr_buf, backend)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, window_left: int = -1, logits_soft_cap=None, sm_scale=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking: bool = True, prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0,
             max_item_len_ptr=None, fixed_split_size=None, disable_split_kv: bool = False, mask_indptr=None) -> None:
        """As the paged wrapper's plan(), with kv_indptr [B+1] offsets of each request's rows."""
        if prefix_len_ptr is not None or token_pos_in_items_ptr is not None or max_item_len_ptr is not None:
            raise ValueError("prefix_len_ptr / token_pos_in_items_ptr / max_item_len_ptr (multi-item scoring) are not "
                             "supported by flashinfer_jit")
        args = (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, 0, bool(causal),
                custom_mask is not None or packed_custom_mask is not None, pos_encoding_mode, window_left,
                logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type, kv_data_type, o_data_type,
                fixed_split_size, disable_split_kv)
        config = self._config(args)
        if self._plan_sm90(config, qo_indptr, kv_indptr, non_blocking,
                           mask_args=(custom_mask, packed_custom_mask, mask_indptr)):
            return
        self._plan_common(config, qo_indptr, _RAGGED, kv_indptr, None, "csr", None, 0, custom_mask,
                          packed_custom_mask, mask_indptr, non_blocking)

    def _kv_index(self, table_dev, ids_dev):
        return [table_dev[0]]

    def run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None):
        if args:
            raise TypeError("run(): pass out, lse and return_lse by keyword")
        return self._run(q, k, v, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl, window_left, sinks)

    def run_return_lse(self, q, k, v, *args, **kwargs):
        return self.run(q, k, v, *args, return_lse=True, **kwargs)

    def forward(self, q, k, v, *args, **kwargs):
        return self.run(q, k, v, *args, **kwargs)

    def end_forward(self) -> None:
        pass

    def _check_kv(self, k, v, c: _Config) -> None:
        if k.dim() != 3 or v.dim() != 3 or k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
            raise ValueError(f"k, v: expected [kv_tokens, {c.num_kv_heads}, head_dim] each, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if k.shape[1] != c.num_kv_heads:
            raise ValueError(f"k: {k.shape[1]} KV heads, but plan() was given num_kv_heads={c.num_kv_heads}")
        if k.shape[0] < self._kv_rows:
            raise ValueError(f"k: {k.shape[0]} rows, fewer than kv_indptr[-1] = {self._kv_rows}")


def _prefill_spec(*fields) -> PrefillSpec:
    spec = _SPECS.get(fields)
    if spec is None:
        names = ("dtype_q", "dtype_kv", "dtype_o", "head_dim_qk", "head_dim_vo", "kv_source", "page_table",
                 "kv_layout", "mask", "pos_encoding", "soft_cap", "sinks")
        spec = _SPECS[fields] = PrefillSpec(**dict(zip(names, fields))).validate()
    return spec


_SPECS: dict = {}


def block_shape(spec: PrefillSpec, tile_rows: int) -> tuple[int, int, int]:
    """(threads, shared memory bytes, registers) of the block of a tile of `tile_rows` rows
    (the GPU tells the registers)."""
    return tuple(get_module(spec).block_shape(tile_rows))


# --- single request ---------------------------------------------------------------------------
_SINGLE_PLANS = 32  # single_prefill_with_kv_cache's planned wrappers kept (by configuration and lengths)
_single_plans: dict = {}


def _single_planned(key: tuple | None, shape: tuple, options: dict,
                    device: torch.device) -> BatchPrefillWithRaggedKVCacheWrapper:
    """A ragged wrapper planned for one request of these lengths and options (shape: qo_len,
    kv_len, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, q and K/V dtypes): planned
    once, outside a CUDA-graph pool, so that later calls (and a CUDA graph captured around
    them: torch.compile's reduce-overhead mode, a custom op's graph) only run, and what it
    keeps is not counted as the graph's allocations. Under torch.compile the planned
    wrapper must exist (an eager call of the same shape first; Dynamo cannot trace a plan).
    The oldest of _SINGLE_PLANS is dropped past that. key None: planned, not kept."""
    wrapper = _single_plans.get(key) if key is not None else None
    if wrapper is not None:
        return wrapper
    if compiling():
        raise RuntimeError("single_prefill_with_kv_cache under torch.compile: no plan for these lengths and options "
                           "yet; call it once eagerly with them first (Dynamo cannot trace plan())")
    qo_len, kv_len, hq, hk, dqk, dvo, q_dtype, kv_dtype = shape
    o = dict(options)
    custom_mask, packed_custom_mask, o_dtype = o.pop("custom_mask"), o.pop("packed_custom_mask"), o.pop("o_dtype")
    backend = o.pop("backend")

    def planned():
        w = BatchPrefillWithRaggedKVCacheWrapper(single_workspace(device, 64 << 20), backend=backend)
        mask_indptr = None
        if packed_custom_mask is not None:
            mask_indptr = torch.tensor([0, packed_custom_mask.numel()], dtype=torch.int32)
        w.plan(torch.tensor([0, qo_len], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32), hq, hk,
               dqk, head_dim_vo=dvo, custom_mask=None if custom_mask is None else custom_mask.reshape(-1),
               packed_custom_mask=packed_custom_mask, q_data_type=q_dtype, kv_data_type=kv_dtype,
               o_data_type=o_dtype, mask_indptr=mask_indptr, **o)
        empty_f32(device)  # run()'s placeholder LSE, kept per device
        return w

    wrapper = outside_graph_pool(planned, device)
    keep_plan(_single_plans, key, wrapper, _SINGLE_PLANS)
    return wrapper


def single_prefill_with_kv_cache(q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None, custom_mask=None,
                                 packed_custom_mask=None, causal: bool = False, kv_layout: str = "NHD",
                                 pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, sm_scale=None,
                                 window_left: int = -1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                                 backend: str = "auto", return_lse: bool = False):
    """One request: q [qo_len, Hq, Dqk], k/v [kv_len, Hk, D] (NHD) or [Hk, kv_len, D] (HND).
    Returns out [qo_len, Hq, Dvo] (and lse [qo_len, Hq] with return_lse)."""
    _check_backend(backend)
    expect_choice(kv_layout, "kv_layout", ("NHD", "HND"))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor")
    if scale_q is not None or scale_k is not None or scale_v is not None:
        raise ValueError("scale_q / scale_k / scale_v (per-head fp8 scales) are not supported; use the batch "
                         "wrappers' q_scale / k_scale / v_scale")
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    options = dict(custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
                   pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                   sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta, o_dtype=o_dtype,
                   backend=backend)
    shape = (q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], v.shape[2], q.dtype, k.dtype)
    key = None
    if custom_mask is None and packed_custom_mask is None:  # (a mask's bits are values: planned every call)
        key = (q.device, shape, tuple((value, type(value)) for value in options.values()))
        if not compiling():  # (Dynamo traces the lookup of a key of constants)
            try:
                hash(key)
            except TypeError:  # an unhashable option: planned without the cache (and most likely rejected)
                key = None
    wrapper = _single_planned(key, shape, options, q.device)
    return wrapper.run(q, k, v, return_lse=return_lse)


def single_prefill_with_kv_cache_return_lse(q, k, v, *args, **kwargs):
    """single_prefill_with_kv_cache(..., return_lse=True): (out, lse)."""
    return single_prefill_with_kv_cache(q, k, v, *args, return_lse=True, **kwargs)


__all__ = ["BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper", "single_prefill_with_kv_cache",
           "single_prefill_with_kv_cache_return_lse", "block_shape", "plan_work"]

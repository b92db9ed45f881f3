"""Batch decode over the paged KV cache (FlashInfer's BatchDecodeWithPagedKVCacheWrapper
and single_decode_with_kv_cache).

plan() runs on the host once per batch: it validates the configuration, picks the
module (DecodeSpec), splits long requests into chunks when the batch alone cannot fill the
GPU (split-KV), and writes the work list, the merge index and the small page-table arrays
into one pinned buffer that reaches the device in one copy. run() validates q and the
cache against the plan and launches one op (decode kernel + merge of split requests).

Both run on the host between kernel launches, so their Python costs are budgeted (issue:
plan() <= 50 us for 256 requests, run() <= 10 us on top of the op call; measured by
scripts/bench_decode_host.py): plan() validates its scalar arguments once per distinct
set (serving engines repeat them every step), reads host tensors without copies, fills
one of two pinned buffers in turn (waiting only if the copy before last is still
queued) and keeps its device views while the offsets stay; run() checks q and the cache
in full only when their shapes, strides, dtypes or devices differ from the last call
that passed (addresses: at every call).

With use_cuda_graph=True every buffer has a fixed size set by the first plan() (its batch
size is the capacity), the decode grid covers the capacity and exits early past the
planned work, so a graph captured around run() stays valid across later plan() calls with
other lengths and batch sizes up to the capacity.
"""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np
import torch

from ..pipeline import env
from ..pipeline.jit import op_cache, traced_op
from ..pipeline.spec import dtype_name
from ..runtime import fastcall
from ..runtime.capacity import graph_capacity, heads_fixed
from ..runtime.checks import (
    BACKENDS,
    POS_ENCODING_MODES,
    aligned16,
    as_dtype,
    as_int32_index,
    compiling,
    dtype_str,
    expect_bool,
    expect_choice,
    expect_heads,
    expect_window_left,
    expect_workspace,
    passed_run_checks,
    remembered,
    run_signature,
    same_cuda_device,
    soft_cap_value,
    static_inputs,
)

# (under decode's own names: plan() and run() look them up here, where the tests patch them)
from ..runtime.device import empty_f32 as _empty_f32
from ..runtime.device import peak_dram_bytes_per_s as _peak_dram_bytes_per_s
from ..runtime.device import raw_stream as _raw_stream
from ..runtime.device import keep_plan, outside_graph_pool, single_workspace, sm_count, supports_clusters, supports_pdl
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
    expect_one_page_table,
    parse_block_tables,
    unpack_paged_kv_cache,
)
from ..runtime.plan_buffer import PlanBuffer
from ..runtime.scales import logit_scale as scaled_logits
from ..runtime.split_kv import SplitBuffers
from .spec import (
    DECODE_HEAD_DIMS,
    MAX_MMA_HEAD_DIM,
    MAX_Q_TOKENS,
    DecodePlanSpec,
    DecodeSpec,
    cluster_blocks,
    group_tile,
    kv_heads_per_block,
    max_tile_rows,
    pairs_kv_heads,
    uses_tensor_cores,
)

_MIN_CHUNK = 64  # tokens; two 32-token tiles, so a chunk still pipelines its loads
# Tensor-core kernel: up to 128 tokens, as far as that keeps a request in <= 16 chunks.
# Its in-kernel merge reads 16 partials per round trip, and a 64-token chunk's two tiles
# are in flight from its first load on, so the longer chunks ran small batches faster
# (docs/decode.md).
_MMA_MIN_CHUNK = 128
# At most this many chunks per request on the tensor-core kernel: its last block merges
# them all, and 64 partials of 8 heads took longer than the KV reads they sped up.
_MMA_MAX_CHUNKS = 32
_SPLIT_BLOCKS_PER_SM = 3
# Split small batches into about 2 blocks of the tensor-core kernel per SM (tiles of 4 or 8
# heads, head_dim <= 128), not the 4 an SM holds: half the partial states to write and merge,
# and the grid's blocks land evenly (docs/decode.md).
_MMA_SPLIT_BLOCKS_PER_SM = 2
# Not for a skewed batch, though (some requests under half a chunk, others split): its long
# requests split to 4 per SM, which ran such batches faster than 2.
_MMA_SKEWED_SPLIT_BLOCKS_PER_SM = 4
# Small batches on sm_90+: each request split over one thread-block cluster (8 blocks, one
# chunk each), merged through distributed shared memory in the same kernel: no partial
# states in global memory, no counter, no last-block round trips. But b=1 at 8 KV heads is
# then 64 blocks, one per SM on half the SMs, and one block an SM streams slowly: the split
# pays only while each block reads little. Taken where batch x blocks per item x cluster
# fits the SMs, the longest request gives each block >= _CLUSTER_MIN_CHUNK tokens and <=
# _CLUSTER_MAX_BLOCK_BYTES of K and V (128 tokens, where 4 warps a block stay faster).
# Above that, up to _WIDE_CLUSTER_MAX_BLOCK_BYTES, the clusters' blocks have 8 warps
# (twice the warps per SM hide the per-tile latency chain); fp8 stops at a quarter of
# bf16's bytes: an fp8 byte is twice the tokens' work, and the split prefetches fp8 grids
# of up to 16 MB into L2. Each bound is where the split with partial states overtook the
# clusters (sweep_decode.py --only cluster; docs/decode.md).
_CLUSTER_MIN_CHUNK = 64
# Large uniform batches that fill the GPU (nothing splits by the target above) still
# split when their grid's waves end badly: the tensor-core blocks of a wave (4 per SM at
# head_dim <= 128, the skewed target's blocks) all read as much and end together, and the
# last wave's empty slots idle for as long as a wave takes. What counts is the K and V a
# whole wave reads (block bytes x blocks at once): its time.
# - a last wave under ~80% full, waves of >= _WAVE_SPLIT_MIN_BYTES: the k in 1..4 chunks
#   leaving the fewest idle block-slots (empty slots of the last wave / k); fuller last
#   waves tie at k = 1 and stay whole;
# - 3.5 waves or more, waves of >= _WAVE_SPLIT_MANY_MIN_BYTES: about _WAVE_SPLIT_WAVES
#   waves (k = 12 / waves, rounded, at most 4; the mechanism is not established: 2 chunks
#   of b=256 lost, 3 and 4 won). Waves of ~1.1 GB gained nothing.
# Measured on the H100 against FlashInfer 0.5.3's tensor-core path in the same runs
# (2026-11-23, 8a99a11; docs/decode.md).
# Batches whose unsplit grid (tensor-core kernel, 2 blocks an SM as the target) already
# covers >= 7/10 of the SMs: splitting adds partial states and a merge (~2-4 us) to gain
# only the idle SMs, and chunks rounded to the target put a grid just over 2 blocks an SM
# (b=12, 32/8 heads: 288 blocks; b=20: 320). So such a grid splits in two at most (k =
# target // blocks), and only where its longest request has >= _FULL_GRID_SPLIT_MIN_TOKENS
# (>= _PART_GRID_SPLIT_MIN_TOKENS where the grid covers under 9/10 of the SMs); from the
# SM count up it stays whole. Tokens, not bytes: fp8 paid for the split at the lengths
# bf16 did. Swept on the H100 (sweep_decode.py --only split, 2026-11-26, e8c4075;
# docs/decode.md).
_FULL_GRID_MIN_TENTHS = 7
_FULL_GRID_MOST_TENTHS = 9
_FULL_GRID_SPLIT_MIN_TOKENS = 3072
_PART_GRID_SPLIT_MIN_TOKENS = 1024
# ... but on GPUs whose DRAM peak is over _LONG_CLUSTER_MAX_PEAK_BYTES_PER_S one block an SM
# streams too slowly for the rest, and the grid that covers >= 9/10 of the SMs splits from
# _PART_GRID_SPLIT_MIN_TOKENS too (measured on the H200; docs/decode.md).
_WAVE_SPLIT_MIN_BYTES = 1_000_000_000  # K and V bytes a wave of blocks reads
_WAVE_SPLIT_MANY_MIN_BYTES = 2_000_000_000
_WAVE_SPLIT_WAVES = 12
_CLUSTER_MAX_BLOCK_BYTES = {2: 64 << 10, 1: 32 << 10}  # by the cache's bytes per element
_WIDE_CLUSTER_MAX_BLOCK_BYTES = {2: 512 << 10, 1: 128 << 10}
# 16-bit caches at head_dim 128: up to _LONG_CLUSTER_MAX_BLOCK_BYTES (4096 tokens), where
# the 8-warp blocks, reading their page ids through the read-only path (csrc/decode/decode_mma.cuh
# kWide), beat the split with partial states at b=1. 8-warp blocks run one per SM, and only
# where the grid takes at most half the SMs (b=1 at 8 KV heads: 64 blocks): at b=2 (128
# blocks) they lost from 256 KB a block, as 128 one-block-per-SM clusters stream slower
# than 256 split blocks (a pure read shows the same: scripts/bench_read_ceiling.py;
# docs/decode.md).
_LONG_CLUSTER_MAX_BLOCK_BYTES = 2 << 20
# ... but only on GPUs whose DRAM peak (memory clock x bus width) is at most
# _LONG_CLUSTER_MAX_PEAK_BYTES_PER_S. Those 64 one-per-SM blocks stream at most ~2.8 TB/s
# on the H100 and the H200 alike: near the H100's copy rate (3.0 TB/s), two thirds of the
# H200's (4.2), where the split with partial states ran long requests faster. Above the
# peak the 16-bit blocks at head_dim 128 keep _WIDE_CLUSTER_MAX_BLOCK_BYTES
# (docs/decode.md).
_LONG_CLUSTER_MAX_PEAK_BYTES_PER_S = 4.0e12
_TABLE_ARGS = ("indptr", "indices", "last_page_len", "block_tables", "seq_lens")  # plan()'s index tensors
# the constructor's backends: BACKENDS run here; "fa3" is FlashInfer's name, accepted and
# a NotImplementedError at plan(), as FlashInfer's decode wrapper does (prefill's "fa3" is
# a ValueError at construction: prefill/wrapper.py _check_backend)
_DECODE_BACKENDS = BACKENDS + ("fa3",)
_16BIT_DTYPES = (torch.float16, torch.bfloat16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_Tensor = torch.Tensor


def plan_split(kv_lens: np.ndarray, blocks_per_item: int, target_blocks: int, fixed_split_size, disable_split_kv,
               max_items: int | None = None, max_partials: int | None = None, min_chunk: int = _MIN_CHUNK,
               sized: tuple | None = None, max_chunks: int | None = None, skewed_target_blocks: int | None = None):
    """Chunk size for the work list, and the list: (request, start, end, partial_row) rows
    and merge_indptr. Pure function of host values (unit-tested without a GPU).

    The chunk is the total work spread over about target_blocks blocks (skewed_target_blocks
    where some requests are under half a chunk and others split), never below min_chunk
    tokens, nor so small that the longest request gets over max_chunks. A request takes
    round(length / chunk) chunks (at least one), of equal size rounded up to whole 32-token
    tiles: a uniform batch that about fills the GPU is not split (with a fixed chunk and a
    remainder, 64 x 4k tokens became 64 x (4000 + 96): twice the blocks and a merge, for
    nothing), while the long requests of a skewed one are (56 x 256 + 8 x 8k tokens:
    unsplit, the eight 8k requests ran 5x longer than the rest). fixed_split_size is the chunk length itself (FlashInfer's meaning).
    The chunk is doubled until the list fits the capacities (CUDA-graph buffers, the
    workspace). Split requests' items are listed longest first. sized: _chunk_size's
    result for these arguments, when the caller already has it.
    """
    batch = len(kv_lens)
    chunk, longest, auto = sized or _chunk_size(kv_lens, blocks_per_item, target_blocks, fixed_split_size,
                                                disable_split_kv, min_chunk, max_chunks, skewed_target_blocks)
    if _nothing_splits(chunk, longest, batch, max_items, auto):
        work = _one_item_per_request(batch).copy()
        work[:, 2] = kv_lens
        return chunk, work, np.zeros(batch + 1, dtype=np.int32), False
    while True:
        size, n_chunks = _chunk_lengths(kv_lens, chunk, auto)
        split = n_chunks > 1
        items = int(n_chunks.sum())
        partials = int(n_chunks[split].sum())
        if (max_items is None or items <= max_items) and (max_partials is None or partials <= max_partials):
            break
        if chunk >= longest:
            raise ValueError(f"the work list needs {items} items / {partials} partial rows, more than the "
                             f"buffers hold ({max_items} / {max_partials}); give a larger float_workspace_buffer")
        chunk = min(longest, chunk * 2)
    request = np.repeat(np.arange(batch, dtype=np.int64), n_chunks)
    first = np.cumsum(n_chunks) - n_chunks
    local = np.arange(items, dtype=np.int64) - np.repeat(first, n_chunks)
    start = local * size[request]
    end = np.minimum(start + size[request], kv_lens[request])
    merge_indptr = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(np.where(split, n_chunks, 0), out=merge_indptr[1:])
    partial_row = np.where(split[request], merge_indptr[request] + local, -1)
    work = np.stack([request, start, end, partial_row], axis=1).astype(np.int32)
    if split.any():
        # Longest items first: blocks start in work-list order, so the short items fill
        # the SMs that the long ones leave free instead of trailing after them.
        work = work[np.argsort(start - end, kind="stable")]
    return chunk, work, merge_indptr.astype(np.int32), bool(split.any())


def plan_cluster(kv_lens: np.ndarray, cluster: int) -> np.ndarray:
    """Work rows (request, start, end, -1) of the cluster split: every request in `cluster`
    chunks of equal length in whole 32-token tiles (the last ones may be empty), chunk i of
    request r at row r x cluster + i (the block of rank i in its cluster). Pure function
    of host values (unit-tested without a GPU)."""
    batch = len(kv_lens)
    lens = np.asarray(kv_lens, dtype=np.int64)
    size = np.maximum(32, _round_up(_ceil_div(lens, cluster), 32))
    request = np.repeat(np.arange(batch, dtype=np.int64), cluster)
    start = np.minimum(np.tile(np.arange(cluster, dtype=np.int64), batch) * size[request], lens[request])
    end = np.minimum(start + size[request], lens[request])
    return np.stack([request, start, end, np.full_like(start, -1)], axis=1).astype(np.int32)


def _ceil_div(a, b):
    return -(-a // b)


def _round_up(a, multiple: int):
    return _ceil_div(a, multiple) * multiple


def graph_grid_items(capacity: int, blocks_per_item: int, target_blocks: int, sms: int, graph_chunks: int = 1) -> int:
    """Work items (grid rows) of a CUDA-graph wrapper, whose grid is fixed at capture: the
    capacity, plus 2 x target_blocks / blocks_per_item spare rows for splitting the long
    requests of a later batch (plan_split fits its splits into the rows there are). A
    capacity under one block per SM gets only the spare rows that keep the grid under 2
    blocks per SM: from 2 per SM up, the H100's block scheduler placed the working blocks
    of a split b=1 unevenly (up to 3 on one SM), and the slowest decided the merge; fewer,
    longer chunks cost little there. Larger capacities keep every spare row: a skewed
    batch needs them to split its long requests, and idle rows cost nothing measurable
    there (docs/decode.md)."""
    spare = -(-2 * target_blocks // blocks_per_item)
    if capacity * blocks_per_item >= sms:
        # (graph_chunks: room for that many chunks of every request, for the wave split of
        # multi-token tiles at the capacity; only under 3.5 waves, where that split may
        # happen, since idle rows of a large grid cost time: docs/decode.md)
        few_waves = 2 * capacity * blocks_per_item < 7 * target_blocks
        return max(capacity + spare, capacity * graph_chunks if few_waves else 0)
    return capacity + min(spare, (2 * sms - 1) // blocks_per_item - capacity)


def _chunk_lengths(kv_lens: np.ndarray, chunk: int, auto: bool) -> tuple:
    """(chunk length, number of chunks) per request. auto: round(length / chunk) chunks
    of equal length in whole 32-token tiles; else chunks of `chunk` tokens."""
    if not auto:
        return np.full_like(kv_lens, chunk), np.maximum(1, -(-kv_lens // chunk))
    wanted = np.maximum(1, (2 * kv_lens + chunk) // (2 * chunk))  # round half up
    size = np.maximum(32, _round_up(_ceil_div(kv_lens, wanted), 32))
    return size, np.maximum(1, -(-kv_lens // size))


def _chunk_size(kv_lens: np.ndarray, blocks_per_item: int, target_blocks: int, fixed_split_size,
                disable_split_kv, min_chunk: int = _MIN_CHUNK, max_chunks: int | None = None,
                skewed_target_blocks: int | None = None, block_token_bytes: int = 0, sms: int = 0,
                full_grid_min_tokens: int = _FULL_GRID_SPLIT_MIN_TOKENS, many_waves: bool = True) -> tuple:
    """(chunk, longest request, auto) before the chunk is fitted to the capacities; auto:
    the chunk is a target that requests round to (not a fixed length). skewed_target_blocks:
    the target instead where the batch mixes requests under half a chunk with split ones;
    it is also the blocks that run at once (4 per SM), which the wave split of a batch that
    fills the GPU counts with block_token_bytes, a block's K and V bytes per token (0: no
    wave split). With skewed_target_blocks and sms, a batch that is not skewed and whose
    unsplit grid already covers most SMs splits as _full_grid_chunks says (with
    full_grid_min_tokens for a grid over 9/10 of the SMs)."""
    longest = int(np.maximum.reduce(kv_lens)) if len(kv_lens) else 0
    if disable_split_kv or longest == 0:
        return max(longest, 1), longest, False
    if fixed_split_size:
        return int(fixed_split_size), longest, False
    total = int(np.add.reduce(kv_lens))
    wanted = math.ceil(total * blocks_per_item / target_blocks)
    skewed = False
    if skewed_target_blocks and 2 * longest >= 3 * wanted and bool(((kv_lens > 0) & (2 * kv_lens < wanted)).any()):
        # Something splits, and some requests are under half a chunk (they stay whole):
        # a skewed batch, whose long requests split finer (_MMA_SKEWED_SPLIT_BLOCKS_PER_SM).
        wanted = math.ceil(total * blocks_per_item / skewed_target_blocks)
        skewed = True
    # min_chunk applies only as far as it keeps the longest request in <= 16 chunks
    floor = min(min_chunk, max(_MIN_CHUNK, _round_up(_ceil_div(longest, 16), 32)))
    if max_chunks:
        floor = max(floor, _round_up(_ceil_div(longest, max_chunks), 32))
    if skewed_target_blocks and sms and not skewed:
        k = _full_grid_chunks(len(kv_lens) * blocks_per_item, target_blocks, sms, longest, full_grid_min_tokens)
        if k == 1:
            return longest, longest, True
        if k:
            return max(floor, _round_up(_ceil_div(longest, k), 32)), longest, True
    chunk = max(floor, -(-wanted // 32) * 32)
    if skewed_target_blocks and block_token_bytes and 2 * longest < 3 * chunk:  # nothing splits by the target
        k = _wave_chunks(kv_lens, longest, len(kv_lens) * blocks_per_item, skewed_target_blocks,
                         longest * block_token_bytes, many_waves)
        if k > 1:
            chunk = max(floor, _round_up(_ceil_div(longest, k), 32))
    return chunk, longest, True


def _wave_chunks(kv_lens: np.ndarray, longest: int, blocks: int, wave: int, block_bytes: int,
                 many_waves: bool = True) -> int:
    """Chunks per request (1: none) for a grid of `blocks` equal blocks of `block_bytes`,
    `wave` of which run at once (see _WAVE_SPLIT_MIN_BYTES). Only for near-uniform batches
    (every request at least 3/4 of the longest): the rule counts equal blocks. many_waves
    False: no split from 3.5 waves up (multi-token tiles lost there; docs/decode.md)."""
    wave_bytes = block_bytes * wave
    if wave_bytes < _WAVE_SPLIT_MIN_BYTES or blocks <= wave or 4 * int(np.minimum.reduce(kv_lens)) < 3 * longest:
        return 1
    if 2 * blocks >= 7 * wave:
        if not many_waves or wave_bytes < _WAVE_SPLIT_MANY_MIN_BYTES:
            return 1
        return max(1, min(4, (2 * _WAVE_SPLIT_WAVES * wave + blocks) // (2 * blocks)))
    # idle block-slots of the last wave, in twelfths of an unsplit block; ties keep fewer chunks
    return min((1, 2, 3, 4), key=lambda k: (-k * blocks) % wave * (12 // k))


def _full_grid_chunks(blocks: int, target_blocks: int, sms: int, longest: int,
                      most_min_tokens: int = _FULL_GRID_SPLIT_MIN_TOKENS) -> int:
    """Chunks per request (1: none) for an unsplit grid of `blocks` blocks, the longest
    request `longest` tokens, that covers at least _FULL_GRID_MIN_TENTHS of the SMs but
    stays under target_blocks; 0 where it is smaller or larger (the target decides). The
    tensor-core target is 2 one-head blocks an SM, so blocks x 2 x sms / target_blocks is
    the grid in one-head blocks, whether its blocks take one KV head or a pair (half the
    blocks, half the target). most_min_tokens: the split's length where the grid covers
    >= _FULL_GRID_MOST_TENTHS of the SMs. See _FULL_GRID_MIN_TENTHS."""
    heads = blocks * 2 * sms // target_blocks
    if 10 * heads < _FULL_GRID_MIN_TENTHS * sms or blocks >= target_blocks:
        return 0
    most = 10 * heads >= _FULL_GRID_MOST_TENTHS * sms
    if target_blocks // blocks < 2 or longest < (most_min_tokens if most else _PART_GRID_SPLIT_MIN_TOKENS):
        return 1
    return 2


def _nothing_splits(chunk: int, longest: int, batch: int, max_items: int | None, auto: bool) -> bool:
    """One item per request, no partial rows (any batch that fills the GPU): plan_split's
    general path gives the same list with ~20 more numpy calls."""
    fits = 2 * longest < 3 * chunk if auto else chunk >= longest  # auto: round(longest / chunk) <= 1
    return fits and (max_items is None or batch <= max_items)


@functools.lru_cache(maxsize=16)
def _one_item_per_request(batch: int) -> np.ndarray:
    """Work rows (request, 0, 0, -1), read-only: callers copy, then fill in the ends."""
    rows = np.zeros((batch, 4), dtype=np.int32)
    rows[:, 0] = np.arange(batch)
    rows[:, 3] = -1
    rows.setflags(write=False)
    return rows


def _int32_vector(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1


def _host_array(t: torch.Tensor) -> np.ndarray:
    """The values of a host or device tensor as numpy (no copy for a host tensor: plan()
    reads them before it returns)."""
    return t.numpy() if t.is_cpu else t.cpu().numpy()


def _out_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype, o_dtype: torch.dtype | None) -> torch.dtype | None:
    """The output's dtype where it is not q's (fp8 q: o_data_type, float16 by default), or
    None (16-bit q writes its own dtype); plan()'s dtype arguments checked, each error
    naming its argument."""
    if q_dtype not in _16BIT_DTYPES + _FP8_DTYPES:
        raise ValueError(f"q_data_type: expected one of {', '.join(map(dtype_str, _16BIT_DTYPES + _FP8_DTYPES))}, "
                         f"got {dtype_str(q_dtype)}")
    if q_dtype in _16BIT_DTYPES:
        if o_dtype is not None and o_dtype != q_dtype:
            raise ValueError(f"o_data_type: {dtype_str(q_dtype)} q writes {dtype_str(q_dtype)} (other output dtypes "
                             f"are for fp8 q); got {dtype_str(o_dtype)}")
        return None
    if kv_dtype != q_dtype:
        raise ValueError(f"kv_data_type: fp8 q ({dtype_str(q_dtype)}) needs a cache of the same dtype, got "
                         f"{dtype_str(kv_dtype)}")
    if o_dtype is None:
        return torch.float16
    if o_dtype not in _16BIT_DTYPES:
        raise ValueError(f"o_data_type: fp8 q writes float16 or bfloat16 (an fp8 output is not supported), got "
                         f"{dtype_str(o_dtype)}")
    return o_dtype


class _Config:
    """What plan() derives from its scalar arguments (heads, dtypes, options), checked
    once: a serving engine re-plans with the same ones at every step, so plan() looks
    them up by value instead of re-validating them."""

    __slots__ = ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "q_dtype", "kv_dtype", "tile",
                 "blocks_per_item", "target", "partial_o", "partial_lse", "sm_scale", "logit_scale", "soft_cap",
                 "window_left", "rope_scale", "rope_theta", "rope", "alibi", "fixed_split_size", "disable_split_kv",
                 "specs", "tensor_cores", "min_chunk", "max_chunks", "pairs", "sms", "skew_factor", "cluster",
                 "token_bytes", "cluster_max_bytes", "wide_cluster_max_bytes", "full_grid_min_tokens", "native",
                 "orders_pages", "q_tokens", "wave_token_bytes", "graph_chunks", "out_dtype")

    def skewed_target(self, target: int) -> int | None:
        """The split target for a skewed batch, given the (possibly paired) one."""
        return target * self.skew_factor if self.skew_factor else None

    def spec(self, table_layout: str, kv_layout: str) -> DecodeSpec:
        spec = self.specs.get(table_layout)
        if spec is None:  # validated once per page-table layout (an invalid one raises every time)
            spec = DecodeSpec(dtype_name(self.q_dtype), dtype_name(self.kv_dtype), self.head_dim, self.tile,
                              table_layout, kv_layout, self.rope, self.soft_cap != 0.0, self.q_tokens,
                              dtype_o=None if self.out_dtype is None else dtype_name(self.out_dtype),
                              alibi=self.alibi)
            spec.validate()
            self.specs[table_layout] = spec
        return spec


class _Plan:
    """One plan()'s result: the op's planned arguments (args: page-table tensors, work,
    merge_indptr, partial_o, partial_lse, soft_cap, rope_scale, rope_theta, grid_items,
    merge_rows) and what run() has already checked against it (checked: the signature of
    the last q and cache that passed every check, q_standard: whether that q had
    contiguous strides, so that empty_like(q) is contiguous too, no_lse: the empty LSE
    tensor on its device), and run()'s fast path once a call through the op has recorded
    its launch for that signature (fast: a runtime.launch.RecordedLaunch, or None;
    kv_heads_per_block: 2 where the blocks take KV-head pairs; cluster: blocks per
    thread-block cluster of the cluster split, 1 without; cluster_warps: warps per block
    of that split, 4 or 8; unordered: where args' page ids are the reordered copy (plan's
    sort_pages), the page-table tensors with the ids as given, for a run() with a window)."""

    __slots__ = ("config", "spec", "op", "batch", "capacity", "max_items", "args", "checked", "q_standard", "no_lse",
                 "fast", "kv_heads_per_block", "cluster", "cluster_warps", "unordered")


class _NativeConfig(ctypes.Structure):
    """csrc/decode/decode_plan.h DecodePlanConfig (same fields, same order; the planner module
    reports its size, checked at load)."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "page_size", "blocks_per_item", "target", "pairs", "sms", "cluster", "fixed_split_size", "disable_split_kv",
        "min_chunk", "max_chunks", "skew_factor", "token_bytes", "cluster_max_block_bytes",
        "wide_cluster_max_block_bytes", "full_grid_min_tokens", "wave_token_bytes", "graph_chunks", "min_kv_len")] + \
        [("max_partials", ctypes.c_int64), ("start", ctypes.c_int64)]


def _native_config(config: _Config):
    """(the C++ planner, the address of its configuration struct for `config`, the
    struct, (fij_fastcall's decode_plan, the planner's address) or None without the
    extension), or False: no planner (FLASHINFER_JIT_NATIVE_PLAN=0 or none loads)."""
    if not env.native_decode_plan():
        return False
    fn = _native_planner()
    if fn is None:
        return False
    struct = _NativeConfig(
        page_size=config.page_size, blocks_per_item=config.blocks_per_item, target=config.target,
        pairs=int(config.pairs), sms=config.sms, cluster=config.cluster,
        fixed_split_size=int(config.fixed_split_size or 0), disable_split_kv=int(bool(config.disable_split_kv)),
        min_chunk=config.min_chunk, max_chunks=int(config.max_chunks or 0), skew_factor=int(config.skew_factor or 0),
        token_bytes=config.token_bytes, cluster_max_block_bytes=config.cluster_max_bytes,
        wide_cluster_max_block_bytes=config.wide_cluster_max_bytes, full_grid_min_tokens=config.full_grid_min_tokens,
        wave_token_bytes=config.wave_token_bytes, graph_chunks=config.graph_chunks,
        min_kv_len=config.q_tokens if config.q_tokens > 1 else 0, max_partials=int(config.partial_o.shape[0]))
    return fn, ctypes.addressof(struct), struct, fastcall.runner("decode_plan", fn)


@op_cache
def _native_planner():
    """The C++ planner's entry point (<namespace>_decode_plan of the DecodePlanSpec module,
    built or loaded at the first plan()), or None with a warning where it cannot be had:
    plan() then runs its numpy path, slower on the host but the same plan."""
    def load():
        return ctypes_entry(DecodePlanSpec(), "decode_plan", [ctypes.c_void_p] * 4 + [ctypes.c_longlong] * 3 +
                            [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p], ctypes.c_longlong, _NativeConfig,
                            "config_bytes")

    return optional_entry(load, "batch decode's plan() runs its numpy path",
                          f"the C++ planner {DecodePlanSpec().name}")


def _same_launch(a: _Plan, b: _Plan) -> bool:
    """Whether two plans of one configuration and batch give the op the same launch
    (DecodeLaunch): the same device views (plan() keeps them while the buffer offsets
    stay), page ids at the same address and strides, grid, merge rows, counters and
    blocks. The views and counters are compared as objects (the older plan holds them)."""
    (ta, *rest_a), (tb, *rest_b) = a.args, b.args
    if a.kv_heads_per_block != b.kv_heads_per_block or (a.cluster, a.cluster_warps) != (b.cluster, b.cluster_warps) \
            or rest_a[0] is not rest_b[0] or rest_a[1] is not rest_b[1] \
            or rest_a[7:9] != rest_b[7:9] or rest_a[9] is not rest_b[9] or len(ta) != len(tb):
        return False
    csr = len(ta) == 3  # (indptr, indices, last_page_len); block tables: (ids, seq_lens)
    ids = 1 if csr else 0
    x, y = ta[ids], tb[ids]  # the launch holds a block table's width (max_pages), not the CSR ids' count
    return all(u is w for i, (u, w) in enumerate(zip(ta, tb)) if i != ids) and x.data_ptr() == y.data_ptr() \
        and x.stride() == y.stride() and (csr or x.shape == y.shape)


class BatchDecodeWithPagedKVCacheWrapper:
    """FlashInfer's decode wrapper: plan() once per batch, run() per layer.

    backend: "auto" (and FlashInfer's "fa2") run this library's kernels; "fa3" is accepted
    here and a NotImplementedError at plan() (as in FlashInfer, whose decode runs fa2
    kernels); other FlashInfer backends ("trtllm-gen", ...) are a ValueError.

    use_tensor_cores: ignored for one query token a request (the spec picks the kernel);
    plan(q_len_per_req > 1) needs it True, as FlashInfer's (its CUDA-core decode takes one
    token a request)."""

    # True for the decode side of a POD wrapper (flashinfer_jit/pod/): plans for blocks of one
    # KV head and no clusters, which POD's kernel runs beside prefill blocks
    _pod_side = False

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto", jit_args=None):
        expect_workspace(float_workspace_buffer)
        expect_choice(kv_layout, "kv_layout", ("NHD", "HND"))
        expect_choice(backend, "backend", _DECODE_BACKENDS)
        self._backend = backend
        self._workspace = float_workspace_buffer
        self._device = float_workspace_buffer.device
        self._device_is_cpu = self._device.type == "cpu"
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        # Ignored for one token a request: the spec picks the kernel (tensor cores without an
        # in-kernel positional encoding, whatever the group, CUDA cores with RoPE or ALiBi;
        # specs.decode.uses_tensor_cores), whatever the caller asks. plan(q_len_per_req > 1)
        # checks it is True, FlashInfer's rule (its CUDA-core decode is single-token).
        self._use_tensor_cores = bool(use_tensor_cores)
        self._user_buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        # CUDA graphs: the page ids a captured run() reads
        self._graph_ids = GraphPageIds.from_constructor(
            self._device, ("paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer"),
            self._user_buffers)
        self._plan = None
        self._native_planned = False  # whether the C++ planner made the current plan (_plan_native)
        self._traced = None  # plan()'s values for a run() under torch.compile
        self._split = SplitBuffers(float_workspace_buffer, self._use_cuda_graph)  # partial states, merge counters
        # CUDA-graph mode: the requests a plan may hold, fixed by the constructor's
        # paged_kv_indptr_buffer (FlashInfer's fixed batch size, an upper bound here), else by
        # the first plan()
        self._given_capacity = paged_kv_indptr_buffer.shape[0] - 1 \
            if self._use_cuda_graph and paged_kv_indptr_buffer is not None else None
        self._capacity = self._given_capacity
        self._configs = {}  # plan()'s scalar arguments -> _Config
        self._plan_buffer = PlanBuffer(self._device, self._use_cuda_graph)
        self._pdl = supports_pdl(self._device)  # run(enable_pdl=None): as FlashInfer, on from sm_90
        self._native_result = np.zeros(7, dtype=np.int64)  # the C++ planner's results (DecodePlanResult)
        self._native_result_ptr = self._native_result.ctypes.data
        # eager GPU wrappers fold page ids given on the host into the plan buffer (numpy path)
        self._folds_host_ids = not self._use_cuda_graph and not self._device_is_cpu
        # plan()'s reordered page ids (_order_pages); a CUDA-graph wrapper decides at its
        # first plan whether its captured run() reads the reordered buffer (then every plan
        # writes it)
        self._page_order = PageOrder(self._device, self._use_cuda_graph)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def use_tensor_cores(self) -> bool:
        """The constructor's use_tensor_cores, as FlashInfer's attribute. Which kernel runs is
        the spec's choice (q_len_per_req > 1 needs True)."""
        return self._use_tensor_cores

    # --- plan ---------------------------------------------------------------------------------
    def plan(self, indptr=None, indices=None, last_page_len=None, num_qo_heads=None, num_kv_heads=None,
             head_dim=None, page_size=None, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap=None, q_data_type="float16", kv_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None, non_blocking: bool = True, block_tables=None, seq_lens=None,
             fixed_split_size=None, disable_split_kv: bool = False, sort_pages: bool = True,
             q_len_per_req: int = 1, o_data_type=None) -> None:
        """Index tensors may be int32 (used as given) or int64 (narrowed once).
        logits_soft_cap None or 0.0: off.

        q_data_type float16 or bfloat16, or fp8 (float8_e4m3fn, float8_e5m2) over a cache
        of the same fp8 dtype: q is then widened to fp16 in the kernel (exactly), run()'s
        q_scale folds into the logits' scale, and the output is o_data_type, float16
        (default) or bfloat16. o_data_type (keyword; FlashInfer's later name): the output's
        dtype, None or q's for 16-bit q.

        pos_encoding_mode: "NONE", "ROPE_LLAMA" (q and K rotated in the kernel) or "ALIBI"
        (FlashInfer's linear bias, slopes from num_qo_heads; not with a soft cap); both run
        on CUDA cores, whatever use_tensor_cores says.

        q_len_per_req: query tokens per request (speculative-decoding verification, MTP):
        run() then takes q [batch x q_len_per_req, num_qo_heads, head_dim], request-major,
        and token t of a request attends to its keys 0 .. kv_len - q_len_per_req + t (causal
        among the request's tokens). One kernel reads each request's K/V once for all its
        tokens (a tile's rows are (token, query head) pairs). Up to 16 tokens (8 at head_dim
        256), without in-kernel RoPE or ALiBi. As FlashInfer's: above 1 it needs
        use_tensor_cores=True and every request kv_len >= q_len_per_req, and a CUDA-graph
        wrapper keeps its first plan's value (each a ValueError).

        sort_pages (not in FlashInfer): where nothing depends on a token's position (no
        RoPE or ALiBi in the kernel, no window, one query token), run() reads each request's
        full pages in ascending page-id order, from a copy plan() writes on the GPU; the output is
        the same up to rounding (the sums run in another order). False: the pages as given."""
        tables = (indptr, indices, last_page_len, block_tables, seq_lens)
        if any(type(t) is _Tensor and t.dtype is not torch.int32 for t in tables):  # int64: narrowed once
            indptr, indices, last_page_len, block_tables, seq_lens = map(as_int32_index, tables, _TABLE_ARGS)
        args = (num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left, logits_soft_cap,
                q_data_type, kv_data_type, data_type, sm_scale, rope_scale, rope_theta, fixed_split_size,
                disable_split_kv, sort_pages, q_len_per_req, o_data_type)
        config = remembered(self._configs, args, self._configure)
        graph = self._use_cuda_graph
        layout = "csr"
        if block_tables is not None:
            expect_one_page_table("indptr/indices/last_page_len", indptr is not None or last_page_len is not None)
            layout, block_tables = parse_block_tables(block_tables, seq_lens)
        native = self._plan_native(config, layout, indptr, indices, last_page_len, block_tables, seq_lens, page_size)
        if native is not None:  # the C++ planner filled a host slot (page ids not folded into it)
            self._install_native(config, layout, native, indices if layout == "csr" else block_tables, non_blocking)
        else:
            table_host, kv_lens = self._host_page_table(layout, indptr, indices, last_page_len, block_tables,
                                                        seq_lens, page_size)
            if config.q_tokens > 1:  # (the C++ planner leaves such a batch to this path: min_kv_len)
                _expect_kv_ranges(kv_lens, config.q_tokens)
            spec = config.spec(layout, self._kv_layout)
            batch = len(kv_lens)
            longest = int(np.maximum.reduce(kv_lens, initial=0))
            if graph:
                self._capacity = graph_capacity(self._capacity, batch)
            capacity = self._capacity if graph else batch
            cluster, cluster_warps = self._cluster_shape(config, kv_lens, capacity)
            if cluster > 1:  # each request over one cluster, merged on chip: no partial rows
                # (a CUDA-graph grid: a cluster for each request it can take, the unused ones exit)
                per_block, max_items, any_split = 1, (capacity * cluster if graph else None), False
                work, merge_indptr = plan_cluster(kv_lens, cluster), np.zeros(batch + 1, dtype=np.int32)
                items = len(work)
            else:
                per_block, blocks_per_item, target, sized = self._pairing(config, kv_lens, capacity)
                max_items = graph_grid_items(capacity, blocks_per_item, target, config.sms, config.graph_chunks) \
                    if graph else None
                skewed_target = config.skewed_target(target)
                if sized is None:
                    sized = _chunk_size(kv_lens, blocks_per_item, target, config.fixed_split_size,
                                        config.disable_split_kv, config.min_chunk, config.max_chunks, skewed_target,
                                        per_block * config.wave_token_bytes, config.sms, config.full_grid_min_tokens,
                                        config.q_tokens == 1)
                if _nothing_splits(*sized[:2], batch, max_items, sized[2]):
                    work = merge_indptr = None  # _pack writes one item per request straight into the buffer
                    items, any_split = batch, False
                else:
                    _, work, merge_indptr, any_split = plan_split(
                        kv_lens, blocks_per_item, target, config.fixed_split_size, config.disable_split_kv,
                        max_items, config.partial_o.shape[0], config.min_chunk, sized, config.max_chunks,
                        skewed_target)
                    items = len(work)
            grid_items = max_items if graph else items
            ids = indices if layout == "csr" else block_tables
            # Page ids on the host (rare: engines keep them on the device) travel in the packed
            # buffer too, so plan() makes one host-to-device copy whatever it is given.
            fold_ids = ids.is_cpu and self._folds_host_ids
            offsets = _offsets(layout, capacity, grid_items, ids.numel() if fold_ids else 0)
            slot = self._plan_buffer.host(offsets[-1])
            pack_plan(slot.array, offsets, capacity, table_host, kv_lens, work, merge_indptr, ids if fold_ids else None)
            self._install(config, spec, layout, slot, offsets, ids, fold_ids, batch, capacity, max_items, grid_items,
                          any_split, cluster, cluster_warps, per_block, longest, non_blocking)
            self._native_planned = False

    def _install_native(self, config: _Config, layout: str, native: tuple, ids: torch.Tensor,
                        non_blocking: bool) -> None:
        """The plan of a host slot the C++ planner filled (_plan_native's result), shipped and
        made current: plan()'s, and POD's repeated plan's (pod/wrapper.py _Pod._replan). ids: the
        page ids as given (indices, or the block table)."""
        batch, capacity, slot, items, grid_items, any_split, cluster, cluster_warps, per_block, longest = native
        spec = config.spec(layout, self._kv_layout)
        max_items = grid_items if self._use_cuda_graph else None
        self._install(config, spec, layout, slot, _offsets(layout, capacity, grid_items, 0), ids, False, batch,
                      capacity, max_items, grid_items, any_split, cluster, cluster_warps, per_block, longest,
                      non_blocking)
        self._native_planned = True

    def _install(self, config: _Config, spec, layout: str, slot, offsets: tuple, ids: torch.Tensor, fold_ids: bool,
                 batch: int, capacity: int, max_items, grid_items: int, any_split: bool, cluster: int,
                 cluster_warps: int, per_block: int, longest: int, non_blocking: bool) -> None:
        """A planned host slot shipped to the device and made the current plan (with its
        views, page ids, page order and what run() carries over from the previous plan)."""
        graph = self._use_cuda_graph
        previous = self._plan
        if graph and previous is not None and (previous.config is not config or previous.max_items != max_items):
            _expect_graph_replan(previous, config.q_tokens, max_items)
        plan_buffer = self._plan_buffer
        plan_buffer.ship(slot, offsets[-1], non_blocking)
        # (without folded ids the work list's view runs to the buffer's end: the key, and so
        # the views, stay while plans of one batch size differ in items)
        merge_dev, work_dev, table_dev, ids_dev = plan_buffer.views(
            (layout, offsets, ids.shape) if fold_ids else (layout, offsets[:3], None), _carve_views)
        if not fold_ids:
            ids_dev = self._device_ids(layout, ids, capacity)
        tables = (table_dev[0], ids_dev, table_dev[1]) if layout == "csr" else (ids_dev, table_dev[0])
        # (the ids as given stay on the device too, in CUDA-graph mode in the fixed buffer: a
        # run() with a window reads them)
        unordered = None
        ordered = self._order_pages(config, ids_dev, table_dev[0], layout == "csr", batch, longest)
        if ordered is not None:
            unordered = tables
            tables = (table_dev[0], ordered, table_dev[1]) if layout == "csr" else (ordered, table_dev[0])
        plan = _Plan()
        plan.config, plan.spec = config, spec
        # the module now, not at the first run(): a run() under torch.compile only calls it
        plan.op = previous.op if previous is not None and previous.spec is spec else \
            (None if self._device_is_cpu or self._pod_side else module_op(spec, "decode", env.debug()))
        plan.fast = None
        plan.batch, plan.capacity, plan.max_items, plan.kv_heads_per_block = batch, capacity, max_items, per_block
        plan.cluster, plan.cluster_warps, plan.unordered = cluster, cluster_warps, unordered
        # (a CUDA-graph grid keeps partial rows for a later plan's splits, but a cluster
        # grid never splits: it merges on chip)
        merge_rows = capacity if ((graph and cluster == 1) or any_split) else 0
        # Both kernels merge split requests themselves (their block functions do the whole
        # item): the last block of a request (per head tile) to finish, counted in zeroed
        # int32s that it resets. One per request, KV head and tile (config.blocks_per_item,
        # one-head blocks), as the op checks, whether or not blocks pair KV heads.
        counters = self._split.merge_counters(capacity * config.blocks_per_item) if merge_rows else None
        plan.args = (tables, work_dev, merge_dev, config.partial_o, config.partial_lse, config.soft_cap,
                     config.rope_scale, config.rope_theta, grid_items, merge_rows, counters)
        if previous is not None and previous.config is config and previous.batch == batch \
                and previous.capacity == capacity:
            # run()'s checks depend on the configuration and the batch alone: what passed
            # them under the previous plan still does
            plan.checked, plan.q_standard, plan.no_lse = previous.checked, previous.q_standard, previous.no_lse
            if previous.fast is not None and _same_launch(previous, plan):
                # the launch the op resolved under the previous plan is this plan's too (same
                # buffers, page ids, grid): run() takes the fast path from its first call
                plan.fast = previous.fast
        else:
            plan.checked, plan.q_standard, plan.no_lse = None, False, None
        self._plan = plan
        # what a run() under torch.compile reads (plain values Dynamo traces; see _run_traced),
        # its tensors marked static inputs (CUDA-graph trees take them where they are)
        traced = self._traced
        key = traced[0] if traced is not None and previous is not None and previous.spec is spec else traced_key(spec)
        static_inputs(*tables, work_dev, merge_dev, counters, *(unordered or ()))
        self._traced = (key, plan.args, unordered, config.num_qo_heads, config.head_dim, config.q_tokens,
                        config.q_dtype, config.kv_dtype, config.sm_scale, config.soft_cap, config.window_left,
                        per_block, cluster, cluster_warps, batch, capacity if graph else batch,
                        config.out_dtype or config.q_dtype)

    def _cluster_shape(self, config: _Config, kv_lens: np.ndarray, capacity: int) -> tuple[int, int]:
        """(blocks per cluster, warps per block) of the cluster split, or (1, 4) (not
        taken): where the module and device have it, no split size is forced, batch x
        blocks per item x cluster fits the SMs, and the longest request gives each block at
        least _CLUSTER_MIN_CHUNK tokens and at most the configuration's wide_cluster_max_bytes
        of K and V; blocks of 8 warps above _CLUSTER_MAX_BLOCK_BYTES, only where the grid
        takes at most half the SMs. A CUDA-graph wrapper, whose grid and kernel are fixed at
        capture, decides by its capacity alone, whatever the lengths: 8-warp clusters where
        its configuration has them up to _LONG_CLUSTER_MAX_BLOCK_BYTES (16-bit caches at
        head_dim 128) and they take at most half the SMs, else none (4-warp clusters lose
        from 128 KB a block: a later plan of long requests would run much slower on them)."""
        c = config.cluster
        if c <= 1 or config.fixed_split_size or config.disable_split_kv:
            return 1, 4
        if self._use_cuda_graph:
            if config.wide_cluster_max_bytes >= _LONG_CLUSTER_MAX_BLOCK_BYTES and \
                    2 * capacity * config.blocks_per_item * c <= config.sms:
                return c, 8
            return 1, 4
        if capacity * config.blocks_per_item * c > config.sms or not len(kv_lens):
            return 1, 4
        longest = int(np.maximum.reduce(kv_lens))
        block_bytes = -(-longest // c) * config.token_bytes
        if longest < _CLUSTER_MIN_CHUNK * c:
            return 1, 4
        if block_bytes <= config.cluster_max_bytes:
            return c, 4
        if block_bytes > config.wide_cluster_max_bytes or 2 * capacity * config.blocks_per_item * c > config.sms:
            return 1, 4
        return c, 8

    def _pairing(self, config: _Config, kv_lens: np.ndarray, capacity: int) -> tuple:
        """(KV heads per block, blocks per item, target blocks, _chunk_size's result or
        None). Blocks of KV-head pairs (where the module has them) have two blocks' warps
        and shared memory, so half the blocks and half the target; they are chosen only
        where their grid still gives every SM a block (small batches keep one-head blocks,
        which ran them faster). A CUDA-graph wrapper decides by its
        capacity, once (its grid is fixed at capture)."""
        if not config.pairs:
            return 1, config.blocks_per_item, config.target, None
        bpi, target = config.blocks_per_item // 2, config.target // 2
        if self._use_cuda_graph:
            return (2, bpi, target, None) if capacity * bpi >= config.sms else (1, config.blocks_per_item,
                                                                                config.target, None)
        sized = _chunk_size(kv_lens, bpi, target, config.fixed_split_size, config.disable_split_kv,
                            config.min_chunk, config.max_chunks, config.skewed_target(target), 2 * config.wave_token_bytes,
                            config.sms, config.full_grid_min_tokens, config.q_tokens == 1)
        chunk, longest, auto = sized
        items = len(kv_lens) if _nothing_splits(chunk, longest, len(kv_lens), None, auto) \
            else int(_chunk_lengths(kv_lens, chunk, auto)[1].sum())
        if items * bpi >= config.sms:
            return 2, bpi, target, sized
        return 1, config.blocks_per_item, config.target, None

    def _configure(self, num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left,
                   logits_soft_cap, q_data_type, kv_data_type, data_type, sm_scale, rope_scale, rope_theta,
                   fixed_split_size, disable_split_kv, sort_pages, q_len_per_req, o_data_type) -> _Config:
        """plan()'s scalar arguments checked, and what follows from them."""
        if self._backend == "fa3":  # (never remembered: every plan() raises)
            raise NotImplementedError("backend='fa3': the decode wrapper runs backend='fa2' / 'auto' kernels (this "
                                      "library's tensor-core and CUDA-core decode); construct it with "
                                      "backend='auto' or 'fa2'")
        expect_heads(num_qo_heads, num_kv_heads, head_dim=head_dim, page_size=page_size)
        expect_choice(pos_encoding_mode, "pos_encoding_mode", POS_ENCODING_MODES)
        if head_dim not in DECODE_HEAD_DIMS:
            raise ValueError(f"head_dim: {head_dim} is not supported; supported: "
                             f"{', '.join(map(str, DECODE_HEAD_DIMS))}")
        expect_window_left(window_left)
        soft_cap = soft_cap_value(logits_soft_cap)
        if pos_encoding_mode == "ALIBI" and soft_cap:
            raise ValueError("pos_encoding_mode='ALIBI' with logits_soft_cap is not supported (pass one of them)")
        if not isinstance(q_len_per_req, int) or isinstance(q_len_per_req, bool) or \
                not 1 <= q_len_per_req <= MAX_Q_TOKENS:
            raise ValueError(f"q_len_per_req: expected an int in 1..{MAX_Q_TOKENS}, got {q_len_per_req!r}")
        if q_len_per_req > 1:
            if not self._use_tensor_cores:
                raise ValueError(f"q_len_per_req={q_len_per_req} needs use_tensor_cores=True: multi-token decode "
                                 "runs on the tensor-core kernel, as FlashInfer's (its CUDA-core decode takes one "
                                 "token a request); construct the wrapper with use_tensor_cores=True")
            if pos_encoding_mode != "NONE":
                raise ValueError(f"q_len_per_req={q_len_per_req}: multi-token decode takes pos_encoding_mode='NONE' "
                                 f"(rotate q and k before the append), got {pos_encoding_mode!r}")
            if not uses_tensor_cores(False, head_dim):
                raise ValueError(f"q_len_per_req={q_len_per_req}: multi-token decode runs on tensor cores, which take "
                                 f"head_dim <= {MAX_MMA_HEAD_DIM}, got {head_dim}")
            if q_len_per_req > max_tile_rows(head_dim):
                raise ValueError(f"q_len_per_req: at most {max_tile_rows(head_dim)} tokens at head_dim {head_dim}, "
                                 f"got {q_len_per_req}")
        if fixed_split_size is not None and (not isinstance(fixed_split_size, int) or fixed_split_size <= 0):
            raise ValueError(f"fixed_split_size: expected a positive int, got {fixed_split_size!r}")
        expect_bool(sort_pages, "sort_pages")
        c = _Config()
        c.num_qo_heads, c.num_kv_heads, c.head_dim, c.page_size = num_qo_heads, num_kv_heads, head_dim, page_size
        # FlashInfer's rule for its deprecated data_type: it fills q_data_type and kv_data_type
        # where they are None, so with q_data_type's default it sets the cache's dtype only
        data = as_dtype(data_type, "data_type")
        c.q_dtype = as_dtype(q_data_type, "q_data_type", data or torch.float16)
        c.kv_dtype = as_dtype(kv_data_type, "kv_data_type", data or c.q_dtype)
        c.out_dtype = _out_dtype(c.q_dtype, c.kv_dtype, as_dtype(o_data_type, "o_data_type"))
        c.q_tokens = q_len_per_req
        c.tile = group_tile(num_qo_heads, num_kv_heads, head_dim, q_len_per_req)
        c.rope = pos_encoding_mode == "ROPE_LLAMA"
        c.alibi = pos_encoding_mode == "ALIBI"
        paired = pairs_kv_heads(dtype_name(c.kv_dtype), head_dim, c.tile, c.rope or c.alibi, self._kv_layout,
                                q_len_per_req)
        # blocks may take KV-head pairs (half as many blocks per item; plan() decides)
        # (a POD side's blocks take one KV head: POD's blocks all have 4 warps)
        c.pairs = kv_heads_per_block(paired, num_qo_heads, num_kv_heads, c.tile) == 2 and not self._pod_side
        c.blocks_per_item = num_kv_heads * (num_qo_heads // num_kv_heads // c.tile)
        # Split only when the batch gives fewer blocks than the split target: 2 blocks of the
        # tensor-core kernel per SM at head_dim <= 128 and tiles of 4 or 8 heads (see
        # _MMA_SPLIT_BLOCKS_PER_SM), 3 for 16-head tiles (as many as their registers allow
        # at once; not measured against fewer), about 3 of the CUDA-core kernel (two 32-token
        # stages in flight each); a split costs a partial-state write and the merge.
        device = self._device
        c.tensor_cores = uses_tensor_cores(c.rope or c.alibi, head_dim)
        per_sm = _MMA_SPLIT_BLOCKS_PER_SM if c.tensor_cores and head_dim <= 128 else _SPLIT_BLOCKS_PER_SM
        if c.tensor_cores and head_dim <= 128 and c.tile * q_len_per_req > 8:  # 16-row tiles
            per_sm = 3  # 16-head tiles take more registers (csrc/decode/decode_mma.cuh kMinBlocksPerSM)
        c.min_chunk = _MMA_MIN_CHUNK if c.tensor_cores else _MIN_CHUNK
        c.max_chunks = _MMA_MAX_CHUNKS if c.tensor_cores else None
        c.sms = sm_count(device)
        c.cluster = cluster_blocks(head_dim) if c.tensor_cores and supports_clusters(device) and \
            env.decode_clusters() and not self._pod_side else 1  # (a POD side: no clusters in its grid)
        c.token_bytes = 2 * head_dim * c.kv_dtype.itemsize  # K and V of one token and KV head
        # The wave split (_wave_chunks) weighs a block by the K and V it reads; a block of N
        # query tokens takes about N times as long for the same bytes, so they count N times
        # (docs/decode.md, multi-token decode, has the measurements).
        c.wave_token_bytes = c.token_bytes * q_len_per_req
        # A CUDA-graph grid of multi-token tiles keeps rows for 3 chunks of every request, so
        # that a batch at the capacity can still take its wave split (see graph_grid_items).
        c.graph_chunks = 3 if q_len_per_req > 1 else 1
        # the cluster split's blocks of 4 warps, and of 8: 2 MB of a 16-bit cache at head_dim 128
        # (measured there only) on GPUs of up to _LONG_CLUSTER_MAX_PEAK_BYTES_PER_S
        c.cluster_max_bytes = _CLUSTER_MAX_BLOCK_BYTES[c.kv_dtype.itemsize]
        peak = _peak_dram_bytes_per_s(device)
        long_clusters = peak is None or peak <= _LONG_CLUSTER_MAX_PEAK_BYTES_PER_S
        c.wide_cluster_max_bytes = _LONG_CLUSTER_MAX_BLOCK_BYTES \
            if long_clusters and c.kv_dtype.itemsize == 2 and head_dim == 128 \
            else _WIDE_CLUSTER_MAX_BLOCK_BYTES[c.kv_dtype.itemsize]
        c.full_grid_min_tokens = _FULL_GRID_SPLIT_MIN_TOKENS if long_clusters else _PART_GRID_SPLIT_MIN_TOKENS
        c.target = per_sm * c.sms
        # skewed batches split to more blocks per SM on those tiles (_MMA_SKEWED_SPLIT_BLOCKS_PER_SM)
        c.skew_factor = _MMA_SKEWED_SPLIT_BLOCKS_PER_SM // per_sm if per_sm == _MMA_SPLIT_BLOCKS_PER_SM else None
        if q_len_per_req > 1 and per_sm == 3:
            # 16-row multi-token tiles (168 registers) run 3 blocks an SM: the skewed target,
            # which the wave split counts as the blocks at once, is the target itself
            c.skew_factor = 1
        # partial states of (token, head) rows: q_len_per_req x num_qo_heads per request
        rows = num_qo_heads * q_len_per_req
        c.partial_o, c.partial_lse = self._split.views(self._split.rows(rows, head_dim), rows, head_dim)
        static_inputs(c.partial_o, c.partial_lse)
        c.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        c.soft_cap = soft_cap
        # the logit scale of a run() without q_scale / k_scale (base 2 unless soft-capped)
        c.logit_scale = scaled_logits(c.sm_scale, c.soft_cap, None, None)
        c.window_left = window_left
        c.rope_scale = float(1.0 if rope_scale is None else rope_scale)
        c.rope_theta = float(1e4 if rope_theta is None else rope_theta)
        c.fixed_split_size, c.disable_split_kv = fixed_split_size, disable_split_kv
        c.specs = {}
        c.native = None  # the C++ planner's (function, configuration struct), False: none; at the first plan()
        # whole pages in any order give the same attention where no term depends on a
        # token's position (no RoPE, no ALiBi bias): plan() may read them in page-id order
        # (_order_pages) (not with several query tokens: their causal limits are positions too)
        c.orders_pages = sort_pages and not (c.rope or c.alibi) and window_left < 0 and device.type == "cuda" and \
            q_len_per_req == 1
        return c

    def _plan_native(self, config: _Config, layout: str, indptr, indices, last_page_len, block_tables, seq_lens,
                     page_size) -> tuple | None:
        """plan()'s host part by the C++ planner (csrc/decode/decode_plan.h, one ctypes call):
        (batch, capacity, filled host slot, work items, grid items, any split, cluster,
        cluster warps, KV heads per block, longest request). block_tables: as
        parse_block_tables returned them (layout: its layout, or csr). None where the numpy path runs
        instead: no planner module (FLASHINFER_JIT_NATIVE_PLAN=0, or it failed to load: a
        warning says why), page ids on the host of an eager GPU wrapper (they travel in the
        packed buffer), or arguments the planner does not take as they are (the numpy
        path then plans them, or raises its error: bad tables, a batch over the capacity, a
        request shorter than q_len_per_req > 1)."""
        native = config.native
        if native is None:
            native = config.native = _native_config(config)
        if native is False:
            return None
        fn, config_ptr, _, runner = native
        if runner is not None and layout == "csr" and type(indptr) is _Tensor and type(indices) is _Tensor and \
                not (self._folds_host_ids and indices.is_cpu):
            # The common form (contiguous int32 host indptr and last_page_len, int32 page ids)
            # goes to the planner as given, checked in C++ (fij_fastcall.decode_plan); None:
            # another form, which the code below converts and checks.
            batch = indptr.shape[0] - 1
            capacity = self._native_capacity(batch) if batch >= 0 else None
            if capacity is not None:  # (a batch over a CUDA-graph capacity: the numpy path's error)
                result = self._native_result_ptr
                planned = self._native_call(
                    lambda slot: runner[0](runner[1], config_ptr, indptr, last_page_len, indices, capacity,
                                           slot.address, len(slot.array), result), batch, capacity)
                if planned is not False:
                    return planned
        if layout == "csr":
            if not (_int32_vector(indptr) and _int32_vector(indices) and _int32_vector(last_page_len)):
                return None
            batch = indptr.shape[0] - 1
            if batch < 0 or last_page_len.shape[0] != batch or (indices.is_cpu and self._folds_host_ids):
                return None
            ptr = indptr if indptr.is_cpu else indptr.cpu()
            last = last_page_len if last_page_len.is_cpu else last_page_len.cpu()
            if (batch and last.stride(0) != 1) or ptr.stride(0) != 1:
                return None
            layout, a, b, c, limit = "csr", ptr.data_ptr(), last.data_ptr(), None, indices.shape[0]
        else:
            if seq_lens.dtype != torch.int32 or (block_tables.is_cpu and self._folds_host_ids):
                return None
            seq = seq_lens if seq_lens.is_cpu else seq_lens.cpu()
            batch = seq.shape[0]
            if batch and seq.stride(0) != 1:
                return None
            a, b, c, limit = None, None, seq.data_ptr(), block_tables.shape[-1] * page_size
        capacity = self._native_capacity(batch)
        if capacity is None:
            return None  # the numpy path raises graph_capacity's error, after its checks of the table
        result = self._native_result_ptr
        return self._native_call(lambda slot: fn(config_ptr, a, b, c, batch, limit, capacity, slot.address,
                                                 len(slot.array), result), batch, capacity)

    def _native_capacity(self, batch: int) -> int | None:
        """The planner's capacity for `batch` requests: 0 in an eager wrapper; a CUDA-graph
        wrapper's (its first plan's batch, fixed here), None where the batch is over it."""
        if not self._use_cuda_graph:
            return 0
        if self._capacity is None:
            self._capacity = batch
        return self._capacity if batch <= self._capacity else None

    def _native_call(self, call, batch: int, capacity: int):
        """_plan_native's result from the C++ planner run as call(host slot) (through
        fij_fastcall or ctypes), again in a larger slot where it asks for one; False where
        call returns None (fij_fastcall: not the common form; the slot goes unused)."""
        plan_buffer = self._plan_buffer
        slot = plan_buffer.host(7 * batch + 8)  # a list without splits fits; a split one may ask for more
        code = call(slot)
        if code is None:
            plan_buffer.give_back()
            if self._use_cuda_graph and self._plan is None:
                self._capacity = self._given_capacity  # (the path that takes the form decides)
            return False
        if code > 0:  # the list needs a larger slot: the same slot, grown
            slot = plan_buffer.regrow(code)
            code = call(slot)
        if code != 0:
            if self._use_cuda_graph and self._plan is None:
                # the numpy path decides, and a first plan it rejects fixes nothing
                self._capacity = self._given_capacity
            return None
        items, any_split, cluster, warps, per_block, grid_items, longest = self._native_result.tolist()
        return batch, capacity or batch, slot, items, grid_items, bool(any_split), cluster, warps, per_block, longest

    def _host_page_table(self, layout: str, indptr, indices, last_page_len, block_tables, seq_lens, page_size):
        """(host int arrays to ship, kv lengths as int64) from CSR arguments, or from block
        tables as parse_block_tables returned them."""
        if layout != "csr":
            lens = _host_array(seq_lens).astype(np.int64)
            if np.minimum.reduce(lens, initial=0) < 0 or \
                    np.maximum.reduce(lens, initial=0) > block_tables.shape[-1] * page_size:
                raise ValueError(f"seq_lens: expected 0..max_pages * page_size ({block_tables.shape[-1] * page_size})")
            return (lens,), lens
        if not (_int32_vector(indptr) and _int32_vector(indices) and _int32_vector(last_page_len)):
            for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
                if not _int32_vector(t):
                    raise ValueError(f"{name}: expected a 1-D int32 tensor (or block_tables= and seq_lens=)")
        if indptr.shape[0] < 1 or last_page_len.shape[0] != indptr.shape[0] - 1:
            raise ValueError(f"last_page_len: expected {indptr.shape[0] - 1} entries (batch size), got "
                             f"{last_page_len.shape[0]}")
        ptr = indptr.numpy() if indptr.is_cpu else indptr.cpu().numpy()
        last = last_page_len.numpy() if last_page_len.is_cpu else last_page_len.cpu().numpy()
        # Few numpy calls: each costs 0.5-1.5 us, about as much on 256 requests as on 1.
        # Page counts in int64, exact whatever the offsets.
        offsets = ptr.astype(np.int64)
        pages = offsets[1:] - offsets[:-1]
        fewest = np.minimum.reduce(pages, initial=1)
        if ptr[0] != 0 or fewest < 0 or ptr[-1] > indices.shape[0]:
            raise ValueError("indptr: expected non-decreasing offsets from 0 to at most len(indices)")
        unused = page_size - last  # slots past the last token; 0..page_size - 1 when valid
        if fewest == 0:  # requests without pages: their last_page_len is ignored, length 0
            unused *= pages > 0
        # as unsigned, a negative count (last_page_len > page_size) wraps above page_size
        if np.maximum.reduce(unused.view(np.uint32), initial=0) >= page_size:
            raise ValueError(f"last_page_len: expected 1..page_size ({page_size}) for every request with pages")
        lens = pages * page_size
        lens -= unused
        return (ptr, last), lens

    def _device_ids(self, layout: str, t: torch.Tensor, capacity: int) -> torch.Tensor:
        """Page ids (indices or block_tables) on the device; in CUDA-graph mode in the fixed
        buffer a replay reads (runtime/graph_ids.py: the user's paged_kv_indices_buffer, or
        one allocated at the first plan)."""
        if not self._use_cuda_graph:
            return t.to(self._device, non_blocking=True) if t.device != self._device else t
        if layout == "csr":
            return self._graph_ids.fill_indices(t, "indices")
        return self._graph_ids.fill_block_tables(t, capacity)

    def _order_pages(self, config: _Config, ids: torch.Tensor, lens: torch.Tensor, csr: bool, batch: int,
                     longest: int) -> torch.Tensor | None:
        """The page ids (indices, or block tables: [batch, max_pages] or [batch, 2,
        max_pages]) with each request's full pages in ascending page-id order (K ids, V ids
        alongside; flashinfer_jit/runtime/page_order.py), written on the device into this wrapper's
        buffer, or None: run() reads the ids as given. lens: the device's indptr (csr) or
        seq_lens; longest: the longest request's tokens.

        The H100 streams pages faster in address order (about 3% at b=1 kv=32k;
        docs/decode.md): one launch per plan() (~12 us of GPU time at b=1 kv=32k), read by
        every layer's run(). Eager plans skip it where no request has 3 pages (nothing to
        reorder)."""
        full_pages = max(0, -(-longest // config.page_size) - 1)  # the last page stays last
        return self._page_order.order(ids, lens, csr, batch, full_pages, config.page_size, config.orders_pages)

    # --- run ----------------------------------------------------------------------------------
    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None):
        """q [batch x q_len_per_req, num_qo_heads, head_dim] (q_len_per_req as planned;
        passing it here only checks it). Returns out (and lse [tokens, num_qo_heads], base 2,
        with return_lse). Under torch.compile, run() traces to the module's op alone."""
        if compiling():
            return self._run_traced(q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl,
                                    window_left, sinks, q_len_per_req)
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() before plan(): call plan() with this batch's page table first")
        if sinks is not None:
            raise ValueError("sinks: attention sinks are not supported by batch decode yet (expected None)")
        if q_len_per_req is not None and q_len_per_req != plan.config.q_tokens:
            raise ValueError(f"q_len_per_req: run() got {q_len_per_req}, plan() was given {plan.config.q_tokens}; "
                             "pass q_len_per_req to plan()")
        if type(paged_kv_cache) is tuple and len(paged_kv_cache) == 2:
            k, v = paged_kv_cache
        else:  # one [num_pages, 2, ...] tensor: its K and V views (or its error)
            k, v, _ = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        # The checks in full only for a q or cache unlike the last that passed them (in
        # shape, strides, dtype or device); alignment depends on the address: every call.
        ptrs = passed_run_checks(q, k, v, plan.checked)
        if ptrs is not None:
            qp, kp, vp = ptrs
        else:
            k, v = self._check_run(q, paged_kv_cache, plan)
            qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        config = plan.config
        out_dtype = config.out_dtype  # None: q's (16-bit q)
        if out is None:  # empty_like: 1.8 us on the GPU host, torch.empty(shape, dtype=, device=) 4.9
            if out_dtype is not None:  # fp8 q
                out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
            else:
                out = torch.empty_like(q) if plan.q_standard else \
                    torch.empty_like(q, memory_format=torch.contiguous_format)
        elif type(out) is not _Tensor or out.shape != q.shape or out.dtype != (out_dtype or q.dtype) or \
                out.stride(-1) != 1 or (config.q_tokens > 1 and out.stride(0) != config.num_qo_heads * out.stride(1)):
            raise ValueError(f"out: expected shape {tuple(q.shape)} and dtype {dtype_str(out_dtype or q.dtype)}"
                             + (", heads packed (stride(0) = num_qo_heads x stride(1))" if config.q_tokens > 1 else ""))
        if return_lse and lse is None:
            lse = torch.empty(q.shape[0], config.num_qo_heads, dtype=torch.float32, device=q.device)
        if lse is not None:
            _check_lse(lse, q.shape[0], config.num_qo_heads)
        if q_scale is None and k_scale is None:
            logit_scale = config.logit_scale
        else:
            logit_scale = scaled_logits(config.sm_scale, config.soft_cap, q_scale, k_scale)
        v_scale = 1.0 if v_scale is None else float(v_scale)
        window = config.window_left if window_left is None else int(window_left)
        pdl = self._pdl if enable_pdl is None else bool(enable_pdl)
        # a window masks by position: the pages in the order given, not plan()'s reordered copy
        as_given = window >= 0 and plan.unordered is not None
        fast = plan.fast
        if fast is not None and not as_given and out.is_contiguous():
            # The launch the op resolved at an earlier call with this q and cache signature,
            # with this call's pointers: no dispatcher, ~2 us of host time instead of ~12.
            call, _, address, device_index = fast
            code = call(address, qp, kp, vp, out.data_ptr(), 0 if lse is None else lse.data_ptr(), logit_scale,
                        v_scale, window, _raw_stream(device_index), pdl)
            if code:
                raise launch_failed(plan.spec, "decode", code)
            return (out, lse) if return_lse else out
        op = plan.op
        if op is None:  # the module loads (or builds) at the first run() after a plan(), in the debug mode then
            op = plan.op = module_op(plan.spec, "decode", env.debug())
        tables, work, merge_indptr, partial_o, partial_lse, soft_cap, rope_scale, rope_theta, grid_items, \
            merge_rows, counters = plan.args
        if as_given:
            tables = plan.unordered
        entry = fast_entry(plan.spec, "decode", env.debug()) if plan.checked is not None and not as_given else None
        prepared = launch_buffer(entry)
        q_op, out_op, lse_op = _token_rows(q, out, plan.no_lse if lse is None else lse, config.q_tokens,
                                           config.num_qo_heads)
        op(q_op, k, v, tables, work, merge_indptr, out_op, lse_op, partial_o, partial_lse,
           logit_scale, v_scale, soft_cap, window, rope_scale, rope_theta, grid_items, merge_rows, counters, pdl,
           prepared, plan.kv_heads_per_block, plan.cluster, plan.cluster_warps)
        if prepared is not None:  # later calls with this signature take the fast path
            plan.fast = recorded(entry, prepared, q.get_device())
        return (out, lse) if return_lse else out

    def _run_traced(self, q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl,
                    window_left, sinks, q_len_per_req):
        """run() as torch.compile traces it: checks of shapes and dtypes only (no addresses,
        no host caches), then the module's op, which the graph records (a torch op whose
        writes its schema declares). It reads plain values that plan() leaves in
        self._traced; the plan's buffers enter the graph as (static) inputs, so a re-plan
        between calls changes their contents, not the graph."""
        if sinks is not None:
            raise ValueError("sinks: attention sinks are not supported by batch decode yet (expected None)")
        q, k, v, out, lse, _, args = self._traced_args(q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse,
                                                       return_lse, window_left, q_len_per_req)
        traced = self._traced
        op = traced_op(traced_namespace(*traced[0]), "decode")
        per_block, cluster, cluster_warps = traced[11:14]
        n, hq = traced[5], traced[3]
        q_op, out_op, lse_op = _token_rows(q, out, lse, n, hq)
        tables, work, merge_indptr, partial_o, partial_lse, logit_scale, v_scale, window, soft_cap, rope_scale, \
            rope_theta, grid_items, merge_rows, counters = args
        op(q_op, k, v, list(tables), work, merge_indptr, out_op, lse_op, partial_o, partial_lse, logit_scale,
           v_scale, soft_cap, window, rope_scale, rope_theta, grid_items, merge_rows, counters,
           self._pdl if enable_pdl is None else enable_pdl, None, per_block, cluster, cluster_warps)
        return (out, lse) if return_lse else out

    def _traced_args(self, q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, return_lse, window_left=None,
                     q_len_per_req=None) -> tuple:
        """What run() and POD's run() take of the plan while torch.compile traces: q's and
        the cache's checks of shape and dtype, out (given, or new) and lse (given, new with
        return_lse, else an empty tensor) and the op's planned arguments: (q, k, v, out, lse,
        lse asked for or given, (page_table, work, merge_indptr, partial_o, partial_lse,
        logit_scale, v_scale, window_left, soft_cap, rope_scale, rope_theta, grid_items,
        merge_rows, merge_counters))."""
        traced = self._traced
        if traced is None:
            raise RuntimeError("run() before plan(): call plan() with this batch's page table first (outside the "
                               "compiled region)")
        _, args, unordered, hq, d, n, q_dtype, kv_dtype, sm_scale, cap, window_planned, _, _, _, batch, capacity, \
            out_dtype = traced
        if q_len_per_req is not None and q_len_per_req != n:
            raise ValueError(f"q_len_per_req: run() got {q_len_per_req}, plan() was given {n}; pass q_len_per_req "
                             "to plan()")
        if type(paged_kv_cache) is tuple:
            k, v = paged_kv_cache
        else:
            k, v, _ = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        if q.dim() != 3 or q.shape[1] != hq or q.shape[2] != d or q.dtype != q_dtype or k.dtype != kv_dtype:
            raise ValueError(f"q: expected {dtype_str(q_dtype)} [tokens, {hq}, {d}] and a {dtype_str(kv_dtype)} "
                             "cache as planned")
        _check_q_rows(q.shape[0], batch, capacity, n, self._use_cuda_graph)
        if out is None:
            out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
        asked = return_lse or lse is not None
        if lse is None:
            lse = torch.empty((q.shape[0], hq) if return_lse else (0,), dtype=torch.float32, device=q.device)
        logit_scale = scaled_logits(sm_scale, cap, q_scale, k_scale)
        window = window_planned if window_left is None else window_left
        tables, work, merge_indptr, partial_o, partial_lse, soft_cap, rope_scale, rope_theta, grid_items, \
            merge_rows, counters = args
        if window >= 0 and unordered is not None:
            tables = unordered
        return q, k, v, out, lse, asked, (tables, work, merge_indptr, partial_o, partial_lse, logit_scale,
                                          1.0 if v_scale is None else v_scale, window, soft_cap, rope_scale,
                                          rope_theta, grid_items, merge_rows, counters)

    forward = run
    begin_forward = plan  # FlashInfer's older names

    def end_forward(self) -> None:
        """FlashInfer's older API: nothing to release."""

    def run_return_lse(self, q, paged_kv_cache, *args, **kwargs):
        """run(..., return_lse=True), as FlashInfer names it."""
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    forward_return_lse = run_return_lse

    def _resolved_args(self, q, paged_kv_cache, q_scale, k_scale, v_scale, return_lse, out=None, lse=None) -> tuple:
        """What POD (flashinfer_jit/pod/) launches of this wrapper's plan: run()'s checks and
        outputs, and the decode op's arguments for one-token requests on blocks of one KV
        head, without clusters (a POD side's plan: _pod_side): (out, lse or None, (q, k, v,
        page_table, work, merge_indptr, out, lse, partial_o, partial_lse, logit_scale,
        v_scale, window_left, grid_items, merge_rows, merge_counters))."""
        if compiling():  # (checks of shapes and dtypes only, the op's arguments from self._traced)
            q, k, v, out, lse, asked, a = self._traced_args(q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse,
                                                            return_lse)
            tables, work, merge_indptr, partial_o, partial_lse, logit_scale, v_scale, window, _, _, _, grid_items, \
                merge_rows, counters = a
            return out, (lse if asked else None), (q, k, v, tables, work, merge_indptr, out, lse, partial_o,
                                                   partial_lse, logit_scale, v_scale, window, grid_items, merge_rows,
                                                   counters)
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() before plan(): call plan() with this batch's page table first")
        if type(paged_kv_cache) is tuple and len(paged_kv_cache) == 2:
            k, v = paged_kv_cache
        else:
            k, v, _ = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        if passed_run_checks(q, k, v, plan.checked) is None:
            k, v = self._check_run(q, paged_kv_cache, plan)
        config = plan.config
        assert config.q_tokens == 1 and plan.kv_heads_per_block == 1 and plan.cluster == 1, "not a POD side's plan"
        # (out / lse given: rows of a mixed batch's outputs, BatchAttention's views)
        out_dtype = config.out_dtype or q.dtype
        if out is None:
            out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
        elif type(out) is not _Tensor or out.shape != q.shape or out.dtype != out_dtype or out.stride(-1) != 1:
            raise ValueError(f"out: expected shape {tuple(q.shape)} and dtype {dtype_str(out_dtype)}")
        if lse is not None:
            _check_lse(lse, q.shape[0], config.num_qo_heads)
        elif return_lse:
            lse = torch.empty(q.shape[0], config.num_qo_heads, dtype=torch.float32, device=q.device)
        logit_scale = config.logit_scale if q_scale is None and k_scale is None else \
            scaled_logits(config.sm_scale, config.soft_cap, q_scale, k_scale)
        tables, work, merge_indptr, partial_o, partial_lse, _, _, _, grid_items, merge_rows, counters = plan.args
        args = (q, k, v, tables, work, merge_indptr, out, plan.no_lse if lse is None else lse, partial_o, partial_lse,
                logit_scale, 1.0 if v_scale is None else float(v_scale), config.window_left, grid_items, merge_rows,
                counters)
        return out, lse, args

    def _check_run(self, q, paged_kv_cache, plan: _Plan):
        """run()'s checks in full; returns the cache's (k, v) and remembers the signature
        of what passed, so that later calls like it skip them."""
        cache = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        config = plan.config
        hq, d = config.num_qo_heads, config.head_dim
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[1] != hq or q.shape[2] != d:
            raise ValueError(f"q: expected [batch, num_qo_heads={hq}, head_dim={d}], got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        if q.dtype != config.q_dtype:
            raise TypeError(f"q: planned for {dtype_str(config.q_dtype)}, got {dtype_str(q.dtype)}")
        n = config.q_tokens
        _check_q_rows(q.shape[0], plan.batch, plan.capacity, n, self._use_cuda_graph)
        if n > 1 and q.shape[0] > 1 and q.stride(0) != hq * q.stride(1):
            raise ValueError(f"q: multi-token decode reads a request's tokens as one row of heads: expected "
                             f"stride(0) = num_qo_heads x stride(1) = {hq * q.stride(1)}, got {q.stride(0)}")
        if q.stride(-1) != 1 or not aligned16(q):
            raise ValueError("q: head_dim must be contiguous and rows 16-byte aligned")
        if cache.k.dtype != config.kv_dtype:
            raise TypeError(f"paged_kv_cache: planned for a {dtype_str(config.kv_dtype)} cache, got "
                            f"{dtype_str(cache.k.dtype)}")
        if cache.num_kv_heads != config.num_kv_heads or cache.head_dim != d or cache.page_size != config.page_size:
            raise ValueError(f"paged_kv_cache: expected {config.num_kv_heads} kv heads, head_dim {d}, page size "
                             f"{config.page_size} ({self._kv_layout}); got {cache.num_kv_heads}, {cache.head_dim}, "
                             f"{cache.page_size}")
        for name, t in (("k_cache", cache.k), ("v_cache", cache.v)):
            if not aligned16(t):
                raise ValueError(f"paged_kv_cache ({name}): pages, tokens and heads must start on 16-byte boundaries")
        if not same_cuda_device((q, cache.k, cache.v)):
            raise ValueError(f"q and paged_kv_cache: expected CUDA tensors on one device, got {q.device}, "
                             f"{cache.k.device}")
        if q.device != self._device:  # the plan, the workspace and the page table live there
            raise ValueError(f"q: on {q.device}, but the workspace (and the plan) is on {self._device}")
        plan.checked = run_signature(q, cache.k, cache.v)
        plan.fast = None  # a launch prepared for another signature no longer applies
        plan.q_standard = q.stride() == (hq * d, d, 1)
        plan.no_lse = _empty_f32(q.device)
        return cache.k, cache.v


def _check_q_rows(rows, batch: int, capacity: int, n: int, graph: bool) -> None:
    """q's rows against the plan: batch x q_len_per_req (a CUDA-graph wrapper: up to its
    captured capacity x q_len_per_req, whole requests), as FlashInfer's tensor-core decode
    checks them (a q of another q_len_per_req than plan()'s is a ValueError, not a launch)."""
    per = f" x q_len_per_req {n}" if n > 1 else ""
    if graph:
        if not batch * n <= rows <= capacity * n or rows % n:
            raise ValueError(f"q: batch {rows} must lie between the planned {batch}{per} and the captured capacity "
                             f"{capacity}{per}" + (f" (q_len_per_req {n} was planned: {rows} rows are not whole "
                                                   "requests)" if rows % n else ""))
    elif rows != batch * n:
        raise ValueError(f"q: {rows} rows, but plan() planned a batch of {batch} requests" + (
            f" x q_len_per_req {n} = {batch * n} rows" if n > 1 else "") + (
            f" ({rows} rows are not whole requests of q_len_per_req {n}; q's rows are [batch x q_len_per_req])"
            if n > 1 and rows % n else ""))


def _expect_kv_ranges(kv_lens: np.ndarray, n: int) -> None:
    """Every request of a plan with n query tokens a request holds at least n tokens (its
    first token sits at kv_len - n and sees keys 0 .. kv_len - n), FlashInfer's rule for
    multi-token decode. Called only where n > 1: one-token plans keep empty requests."""
    short = np.flatnonzero(kv_lens < n)
    if len(short):
        i = int(short[0])
        raise ValueError(f"q_len_per_req={n}: request {i} has kv_len {int(kv_lens[i])} < q_len_per_req {n}, an "
                         f"empty KV range for its first query token (token t sees keys 0 .. kv_len - {n} + t); "
                         f"every request needs kv_len >= q_len_per_req ({len(short)} of {len(kv_lens)} do not)")


def _expect_graph_replan(previous: _Plan, q_tokens: int, max_items) -> None:
    """A CUDA-graph wrapper's later plan against its first: the captured run() launches the
    first plan's module (its q_len_per_req) over its grid (max_items rows)."""
    if previous.config.q_tokens != q_tokens:
        raise ValueError(f"q_len_per_req={q_tokens}: a CUDA-graph wrapper's q_len_per_req is frozen at its first "
                         f"plan() ({previous.config.q_tokens}), whose kernel a captured run() launches; make a new "
                         "wrapper for another q_len_per_req")
    if previous.max_items != max_items:
        raise heads_fixed()


def _check_lse(lse, rows: int, hq: int) -> None:
    if type(lse) is not _Tensor or lse.shape != (rows, hq) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"lse: expected a contiguous float32 [{rows}, {hq}] tensor")


def _token_rows(q, out, lse, n: int, hq: int) -> tuple:
    """q, out [batch x n, hq, D] and lse [batch x n, hq] as the op takes them for n query
    tokens a request: [batch, n x hq, D] and [batch, n x hq] (the heads of a request's tokens
    in one row; run() checks that the strides allow it). One token: as given."""
    if n == 1:
        return q, out, lse
    rows = q.shape[0] // n
    return (q.view(rows, n * hq, q.shape[2]), out.view(rows, n * hq, out.shape[2]),
            lse.view(rows, n * hq) if lse.numel() else lse)


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """FlashInfer's CUDA-graph decode wrapper: BatchDecodeWithPagedKVCacheWrapper with
    use_cuda_graph=True and the caller's fixed page-table buffers (indptr [max_batch + 1],
    indices [max_pages], last_page_len [max_batch], int32 on the GPU). The first plan()
    fixes the capacity; a run() captured in a graph replays correctly after later plans of
    up to that many requests."""

    def __init__(self, workspace_buffer, indptr_buffer, indices_buffer, last_page_len_buffer, kv_layout: str = "NHD",
                 use_tensor_cores: bool = False):
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                         paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer)


def fast_decode_plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                     page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap=None,
                     q_data_type=None, kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
                     rope_theta=None, non_blocking: bool = True, fixed_split_size=None, disable_split_kv: bool = False,
                     global_override_indptr_cpu=None, o_data_type=None, q_len_per_req: int = 1) -> None:
    """FlashInfer's fast_decode_plan(wrapper, ...) (SGLang's multi-step draft path, which
    binds it as the wrapper's begin_forward): plan() of `self`, reading the lengths from
    global_override_indptr_cpu (indptr on the host, no device-to-host copy) when given.
    As FlashInfer's, it re-plans a wrapper planned before: on one never planned it is a
    ValueError.
    plan() itself already makes one host-to-device copy and no other. It calls the class's
    plan(), never the instance's attribute: FlashInfer's tests and SGLang bind this function
    as `wrapper.plan = functools.partial(fast_decode_plan, wrapper)`, and `self.plan` would
    then be this function again (a RecursionError)."""
    if self._plan is None:
        raise ValueError("fast_decode_plan: the wrapper needs a prior plan() (fast_decode_plan re-plans a planned "
                         "wrapper, as FlashInfer's); call wrapper.plan(...) once first")
    if global_override_indptr_cpu is not None:
        indptr = global_override_indptr_cpu
    type(self).plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                    pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                    q_data_type=q_data_type if q_data_type is not None else (data_type or "float16"),
                    kv_data_type=kv_data_type, data_type=data_type, sm_scale=sm_scale, rope_scale=rope_scale,
                    rope_theta=rope_theta, non_blocking=non_blocking, fixed_split_size=fixed_split_size,
                    disable_split_kv=disable_split_kv, q_len_per_req=q_len_per_req, o_data_type=o_data_type)


def _offsets(layout: str, capacity: int, grid_items: int, num_ids: int, start: int = 0) -> tuple:
    """(merge, table, work, ids, end) offsets of the packed plan buffer, in int32 elements:
    merge_indptr [capacity + 1]; the page-table arrays (csr: indptr [capacity + 1] and
    last_page_len [capacity]; block tables: seq_lens [capacity]); the work list (count,
    then 4 ints per item, grid_items of them); page ids from the host, if any. The
    variable-length parts come last, so the other views keep their offsets. start: int32s
    before this section (DecodePlanConfig.start: POD's other work list), 0 for a wrapper's own."""
    table = start + capacity + 1
    work = table + (2 * capacity + 1 if layout == "csr" else capacity)
    ids = work + 1 + 4 * grid_items
    return (start, table, work, ids, ids + num_ids)


def pack_plan(host: np.ndarray, offsets: tuple, capacity: int, table_host: tuple, kv_lens: np.ndarray, work,
              merge_indptr, host_ids) -> None:
    """Everything plan() ships, into `host` at _offsets (from its start onwards), padded to
    the capacity; work None: one item per request, nothing to merge. The numpy twin of
    csrc/decode/decode_plan.h's packing. Every element of the section is written (no stale
    values from earlier plans), nothing before it."""
    merge, table, work_at, ids_at, end = offsets
    batch = len(kv_lens)
    pad = capacity > batch  # CUDA-graph mode with fewer requests than captured
    if work is None:
        host[merge:table] = 0
        items = batch
        rows = host[work_at + 1:work_at + 1 + 4 * batch].reshape(batch, 4)
        rows[...] = _one_item_per_request(batch)
        rows[:, 2] = kv_lens
    else:
        host[merge:merge + batch + 1] = merge_indptr
        if pad:
            host[merge + batch + 1:table] = merge_indptr[-1]
        items = len(work)
        host[work_at + 1:work_at + 1 + 4 * items] = work.reshape(-1)
    host[work_at] = items
    if work_at + 1 + 4 * items < ids_at:  # CUDA-graph grid: rows past the planned items, never read
        host[work_at + 1 + 4 * items:ids_at] = 0
    if len(table_host) == 2:  # csr: indptr [capacity + 1], last_page_len [capacity]
        ptr, last = table_host
        last_at = table + capacity + 1
        host[table:table + batch + 1] = ptr
        host[last_at:last_at + batch] = last
        if pad:
            host[table + batch + 1:last_at] = ptr[-1]
            host[last_at + batch:work_at] = 0
    else:  # seq_lens [capacity]
        host[table:table + batch] = table_host[0]
        if pad:
            host[table + batch:work_at] = 0
    if host_ids is not None:
        host[ids_at:end] = host_ids.numpy().reshape(-1)


def _carve_views(buf: torch.Tensor, key: tuple) -> tuple:
    """(merge_indptr, work, page-table arrays, folded page ids or None): views of the
    device buffer for key (layout, _offsets' result, the folded ids' shape; or without folded
    ids, _offsets' first three and None: the work list then runs to the buffer's end, the ops
    reading its count from its first element)."""
    layout, offsets, ids_shape = key
    merge, table, work_at = offsets[:3]
    if layout == "csr":  # indptr [capacity + 1], last_page_len [capacity]
        last_at = table + (table - merge)  # indptr and merge_indptr: capacity + 1 each
        table_dev = (buf[table:last_at], buf[last_at:work_at])
    else:
        table_dev = (buf[table:work_at],)
    if ids_shape is None:
        return buf[merge:table], buf[work_at:], table_dev, None
    ids_at, end = offsets[3:]
    return buf[merge:table], buf[work_at:ids_at], table_dev, buf[ids_at:end].view(ids_shape)


_SINGLE_PLANS = 32  # single_decode_with_kv_cache's planned wrappers kept (by configuration and length)


_single_plans: dict = {}


def _single_planned(key: tuple | None, heads: tuple, kv_len: int, options: dict, kv_layout: str,
                    device: torch.device) -> BatchDecodeWithPagedKVCacheWrapper:
    """A wrapper planned for one request of this configuration and length (heads: num_qo_heads,
    num_kv_heads, head_dim): planned once, so that later calls (and a CUDA graph captured
    around them, e.g. by torch.compile's reduce-overhead mode) only run. The oldest of
    _SINGLE_PLANS is dropped past that. key None: planned, not kept."""
    wrapper = _single_plans.get(key) if key is not None else None
    if wrapper is None:
        if compiling():
            raise RuntimeError("single_decode_with_kv_cache under torch.compile: no plan for this length and these "
                               "options yet; call it once eagerly with them first (Dynamo cannot trace plan())")

        def planned():
            w = BatchDecodeWithPagedKVCacheWrapper(single_workspace(device, 32 << 20), kv_layout)
            w.plan(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32, device=device),
                   torch.tensor([kv_len], dtype=torch.int32), *heads, max(kv_len, 1), **options)
            _empty_f32(device)  # run()'s placeholder LSE, kept per device
            return w

        wrapper = outside_graph_pool(planned, device)
        keep_plan(_single_plans, key, wrapper, _SINGLE_PLANS)
    return wrapper


def single_decode_with_kv_cache(q, k, v, kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                use_tensor_cores: bool = False, q_scale=None, k_scale=None, v_scale=None,
                                window_left: int = -1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                                rope_theta=None, return_lse: bool = False):
    """Decode of one query ([num_qo_heads, head_dim]) against contiguous K/V
    ([kv_len, num_kv_heads, head_dim] NHD or [num_kv_heads, kv_len, head_dim] HND): the
    batch kernel with one request whose single page holds the whole sequence."""
    expect_choice(kv_layout, "kv_layout", ("NHD", "HND"))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor")
    if q.dim() != 2:
        raise ValueError(f"q: expected [num_qo_heads, head_dim], got {tuple(q.shape)}")
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k/v: expected [kv_len, num_kv_heads, head_dim] ({kv_layout}) of one shape, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    kv_len = k.shape[0] if kv_layout == "NHD" else k.shape[1]
    num_kv_heads = k.shape[1] if kv_layout == "NHD" else k.shape[0]
    dev = q.device
    options = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                   q_data_type=q.dtype, kv_data_type=k.dtype, sm_scale=sm_scale, rope_scale=rope_scale,
                   rope_theta=rope_theta)
    heads = (q.shape[0], num_kv_heads, q.shape[1])
    key = (dev, kv_layout, kv_len) + heads + tuple((v, type(v)) for v in options.values())
    if not compiling():  # (Dynamo traces the lookup of a key of constants)
        try:
            hash(key)
        except TypeError:  # an unhashable option: planned without the cache (and most likely rejected)
            key = None
    wrapper = _single_planned(key, heads, kv_len, options, kv_layout, dev)
    result = wrapper.run(q.unsqueeze(0), (k.unsqueeze(0), v.unsqueeze(0)), q_scale=q_scale, k_scale=k_scale,
                         v_scale=v_scale, return_lse=return_lse)
    if return_lse:
        return result[0].squeeze(0), result[1].squeeze(0)
    return result.squeeze(0)


# FlashInfer's decode names (plan_split and plan_cluster, the planners' pure functions, stay
# importable for tests and tools)
__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "fast_decode_plan",
           "single_decode_with_kv_cache"]

"""The Hopper prefill path (backend "fa3"; csrc/hopper/prefill_sm90.cuh, docs/hopper.md):
which configurations it takes, its planner (a work list of 128-row query tiles, heaviest
first) and its plan object. Both batch prefill wrappers and single_prefill_with_kv_cache
plan it; flashinfer_jit/prefill/wrapper.py runs it."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from ..pipeline.jit import get_module, traced_op
from ..pipeline.spec import dtype_name
from ..runtime import fastcall
from ..runtime.capacity import grown_size
from ..runtime.checks import compiling, constant_result
from ..runtime.device import placeholder, sm_count
from ..runtime.plan_buffer import PlanBuffer
from ..runtime.shared_specs import RopeSpec
from .spec import SM90_HEAD_DIM_VO, SM90_HEAD_DIMS, SM90_MASKS, PrefillSm90Spec

TILE_ROWS = 128  # csrc/hopper/prefill_sm90.cuh kBlockM: query rows an item (192: pinned, head_dim 64 only)
TILE_INTS, WORK_HEADER = 8, 4  # csrc/hopper/prefill_sm90_params.h kSm90TileInts, kSm90WorkHeader


def fp8_attention(c) -> bool:
    """Whether a configuration is FP8 attention: q (and K, V) in e4m3, the output 16-bit (the
    Hopper kernel's fp8 form, PrefillSm90Spec.fp8; the mma.sync kernel takes no fp8 q)."""
    return c.q_dtype == torch.float8_e4m3fn


def key_tile(head_dim: int, causal: bool, page_size: int | None = None) -> int:
    """Keys a K/V tile of the kernel (the spec's key_tile). head_dim 256: 80 (FA3's tile) where
    pages (if any) divide it, pages of up to 16 tokens, else 64; an A/B on an H200 (2026-11-29,
    docs/history/hopper.md) measured 80 at 0.88-0.98x the time of 64. head_dim 128 without a causal
    mask: 176 where pages divide it (16 tokens). Else 128."""
    if head_dim == 256:
        return 80 if page_size is None or 80 % page_size == 0 else 64
    return 176 if head_dim == 128 and not causal and (page_size is None or 176 % page_size == 0) else 128


# A batch keeps key_tile()'s 176-key tile only where it visits at most WIDE_TILE_MAX_PAD times
# the keys that 128-key tiles visit (each tile's keys rounded up to whole tiles): a request of
# 256 keys is two tiles either way, 352 keys computed at 176 against 256 at 128. Since the
# consumers wait for V after the Q K^T (f229984), 128-key tiles (two Q stages, the staged
# epilogue) ran full 4 x 4096 at 0.96x the time of 176 (3% fewer keys) and 16 x 1024 at 0.90x
# (H200, both pinned in the same rounds, docs/hopper.md), so 176 stays only where it visits
# fewer keys. A CUDA-graph wrapper keeps key_tile()'s choice (its captured launch is one module).
WIDE_TILE_MAX_PAD = 1.0


def narrower_tile(keys: np.ndarray) -> bool:
    """Whether a batch whose query tiles visit `keys` keys (plan_tiles' column 6) should take
    128-key tiles rather than 176."""
    wide = float(np.sum(-(-keys.astype(np.int64) // 176))) * 176
    narrow = float(np.sum(-(-keys.astype(np.int64) // 128))) * 128
    return wide > WIDE_TILE_MAX_PAD * narrow


# head_dim 64 takes 192-row query tiles (three consumer warpgroups, FA3's tile) where its query
# tiles visit on average at least QUERY_TILE_MIN_KEYS keys (measured at 128-row tiles). An A/B
# on an H200 (2026-11-29, docs/history/hopper.md) timed 192 rows at 0.85x the time of 128 on causal
# 1 x 16384, 0.84x on 4 x 4096 without a mask, 0.92x on causal 4 x 4096 (2112 keys a tile) and
# 16 x 1024 without a mask (1024 keys), but 1.14x on causal 16 x 1024 (576 keys) and 1.2-1.5x on
# 64 x 256: a short tile's diagonal and its item's start weigh more on three warpgroups.
QUERY_TILE_MIN_KEYS = 768


def query_tile(c, keys: np.ndarray, forced_key_tile: bool) -> int:
    """Rows of a query tile for this plan: 192 for head_dim 64 on 128-key tiles without a
    custom mask, soft cap, window or ALiBi whose 128-row query tiles visit on average at least
    QUERY_TILE_MIN_KEYS keys (keys: plan_tiles' column 6 at 128 rows), else TILE_ROWS.
    A CUDA-graph wrapper keeps 128 (its captured launch is one module)."""
    if (c.head_dim_qk != 64 or forced_key_tile or c.mask not in ("none", "causal") or c.soft_cap
            or c.window_left >= 0 or c.pos_encoding != "none" or keys.size == 0):
        return TILE_ROWS
    return 192 if float(keys.mean()) >= QUERY_TILE_MIN_KEYS else TILE_ROWS


# backend "auto" takes the Hopper path for a batch whose requests average at least
# AUTO_MIN_MEAN_QO_LEN query tokens and whose query tiles visit on average at least
# AUTO_MIN_KEYS[head_dim] keys. Shorter queries (decode-like rows, speculative verification)
# keep the mma.sync kernel's packed (token, head) rows, which they fill (a 128-row tile of one
# head holds one 4-token request's 4 rows); tiles with few keys spend more on each item's
# start than the Hopper kernel gains on its loop. Measured on an H200 (docs/hopper.md,
# 2026-11-29): head_dim 128 from 192 keys (causal 64 x 256, 192 keys a query tile: 1.14x the
# mma.sync kernel); head_dim 64 from 512 (causal 16 x 1024, 576 keys: 1.07x; 64 x 256 0.97x);
# head_dim 256 from 2048 (causal 4 x 4096, 2112 keys: 1.90x; nothing shorter measured); head_dim
# (192, 128) from 512 (causal 16 x 1024, 576 keys: 2.03x; nothing shorter measured).
AUTO_MIN_MEAN_QO_LEN = 64
AUTO_MIN_KEYS = {64: 512.0, 128: 192.0, 192: 512.0, 256: 2048.0}
_GRAPH_MIN_TILES = 1024  # a CUDA-graph wrapper's work list holds at least this many tiles
_GRAPH_TILES_FACTOR = 4  # ... and this many times its first plan's


# One TMA box a page: a page divides the key tile. (Pages of 8 tokens, one 1 KB swizzle atom a
# box, run too, and were measured 1.03-1.07x the mma.sync kernel, against 1.6-1.9x for the copy
# that smaller pages take (H200, docs/hopper.md): they take the copy.)
PAGE_SIZES = (16, 32, 64, 128)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# Pages of 1, 2, 4 or 8 tokens (SGLang's 1, among others): a swizzled TMA box a page is too small
# (1-4) or too slow (8): run() copies the batch's pages, which the kernel reads as rows.
def small_pages(c) -> bool:
    """Whether a paged plan's pages are smaller than the kernel reads one TMA box a page
    (PAGE_SIZES): run() then copies them, and the kernel reads the copy's rows (gather_pages)."""
    return 0 < c.page_size < PAGE_SIZES[0]


# A paged plan reads a copy of its pages as rows (the ragged kernel) where the copy's read and
# write cost less than one TMA box a page: long prompts, and chunks of 512 or more over long
# contexts. H200, head_dim 128, copy / boxes time (docs/hopper.md, Performance): 0.82-0.90 at
# 4k-16k query tokens a request (6b14452); chunks (89c64c3, both in the same rounds) 512 on 4k
# keys 0.98, 512 on 8k 0.94-0.96, 1024 on 16k 0.90, but 256 on 2k-8k 1.10-1.13, 128 on 8k 1.39,
# and causal 1k prompts 1.02. The copy is allocated per run(): at most COPY_MAX_BYTES of it for
# speed alone.
COPY_MIN_MEAN_QO_LEN = 2048
COPY_MIN_CHUNK_QO_LEN, COPY_MIN_CHUNK_KV_LEN = 512, 4096
COPY_MAX_BYTES = 1 << 30


def copies_for_speed(mean_qo_len: float, mean_kv_len: float, copy_bytes: int) -> bool:
    """Whether a paged plan (eager, not POD's, the CSR table: the caller's checks) of requests
    of mean_qo_len query tokens and mean_kv_len keys on average, whose copy of its pages (K and
    V in q's dtype) takes copy_bytes, reads that copy rather than the cache: prompts of
    COPY_MIN_MEAN_QO_LEN, or chunks of COPY_MIN_CHUNK_QO_LEN on COPY_MIN_CHUNK_KV_LEN keys, and
    a copy of at most COPY_MAX_BYTES."""
    long_enough = mean_qo_len >= COPY_MIN_MEAN_QO_LEN or \
        (mean_qo_len >= COPY_MIN_CHUNK_QO_LEN and mean_kv_len >= COPY_MIN_CHUNK_KV_LEN)
    return long_enough and copy_bytes <= COPY_MAX_BYTES


def gathers(c) -> bool:
    """Whether a paged plan runs the Hopper kernel over a copy of the batch's pages
    (gather_pages), which it reads as ragged rows (each request's pages one run of rows): an
    fp8 cache (the copy in q's dtype, exact), RoPE in the kernel's place (the copy's keys
    rotated), or pages of fewer than 16 tokens."""
    return c.kv_dtype != c.q_dtype or c.pos_encoding == "rope_llama" or small_pages(c)


def unsupported(c, ragged: bool, table: str | None = "csr", graph: bool = False, gather: bool = True) -> str | None:
    """Why the Hopper path cannot run this configuration (the feature, as plan()'s argument
    names it), or None. c: the wrapper's _Config; table: a paged plan's page table layout
    ("csr", "block_table": vLLM's [B, max_pages], "block_table_kv_separate": TensorRT-LLM's
    [B, 2, max_pages]; the Hopper path takes all three); graph: a CUDA-graph wrapper;
    gather: whether the caller runs the copy of the batch's pages that an fp8 cache or
    RoPE over the paged cache take (gathers; POD on Hopper does not)."""
    if not ragged:
        sizes = [p for p in PAGE_SIZES if key_tile(c.head_dim_qk, False, p) % p == 0]
        small = small_pages(c) and c.page_size & (c.page_size - 1) == 0  # (1, 2, 4, 8: over a copy)
        if small and graph:
            return f"page_size={c.page_size} with use_cuda_graph=True (pages under 16 tokens run over a copy)"
        if small and not gather:
            return f"page_size={c.page_size} in POD (pages under 16 tokens run over a copy of the batch's pages)"
        if c.page_size not in sizes and not small:
            return (f"page_size={c.page_size} (the Hopper path takes pages of 1, 2, 4, 8 (over a copy) or "
                    f"{', '.join(map(str, sizes))} tokens at head_dim {c.head_dim_qk})")
    if SM90_HEAD_DIM_VO.get(c.head_dim_qk) != c.head_dim_vo:
        pairs = ", ".join(f"({qk}, {vo})" for qk, vo in SM90_HEAD_DIM_VO.items())
        return f"head_dim_qk={c.head_dim_qk}, head_dim_vo={c.head_dim_vo} (the Hopper path takes {pairs})"
    if c.mask not in SM90_MASKS:
        return f"a {c.mask} mask"
    if c.mask == "custom" and graph:  # (plan() copies the bits into a buffer of each batch's size)
        return "custom_mask / packed_custom_mask with use_cuda_graph=True"
    # (RoPE: q and k rotated before the kernel, rope_prepass; over the paged cache, the keys of
    # the copy of the batch's pages, gather_pages; both allocate per run(), which a captured
    # run() cannot replay for other batches)
    if c.pos_encoding == "rope_llama" and graph:
        return "pos_encoding_mode='ROPE_LLAMA' with use_cuda_graph=True"
    if c.pos_encoding == "rope_llama" and not ragged and not gather:
        return "pos_encoding_mode='ROPE_LLAMA' with a paged cache in POD"
    if c.pos_encoding not in ("none", "alibi", "rope_llama"):  # (ALiBi with a soft cap: plan()'s ValueError before)
        return f"pos_encoding_mode={c.pos_encoding.upper()!r}"
    if fp8_attention(c):  # (e4m3 q, K and V; the kernel's fp8 form: PrefillSm90Spec.check)
        if not ragged:
            return "q_data_type float8_e4m3fn with a paged cache (FP8 attention reads ragged K/V)"
        if c.head_dim_qk != 128:
            return f"q_data_type float8_e4m3fn at head_dim {c.head_dim_qk} (FP8 attention: head_dim 128)"
        if c.mask == "custom" or c.soft_cap or c.pos_encoding != "none":
            return "q_data_type float8_e4m3fn with a custom mask, a soft cap or a positional encoding"
        if graph:
            return "q_data_type float8_e4m3fn with use_cuda_graph=True"
        return None
    if c.kv_dtype != c.q_dtype:
        if c.kv_dtype not in _FP8 or c.q_dtype in _FP8 or ragged:
            return f"kv_data_type {dtype_name(c.kv_dtype)} with q_data_type {dtype_name(c.q_dtype)}"
        if graph:
            return f"kv_data_type {dtype_name(c.kv_dtype)} with use_cuda_graph=True"
        if not gather:
            return f"kv_data_type {dtype_name(c.kv_dtype)} in POD"
    if c.o_dtype != c.q_dtype:
        return f"o_data_type {dtype_name(c.o_dtype)} with q_data_type {dtype_name(c.q_dtype)}"
    return None


@cache
def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def arch_error(device: torch.device) -> str | None:
    """Why `device` cannot run the Hopper path (it needs sm_90: wgmma and setmaxnreg exist on
    no other arch), or None."""
    cap = _capability(device)
    if cap == (9, 0):
        return None
    where = f"{device} is sm_{cap[0]}{cap[1]}" if cap is not None else f"the workspace is on {device}"
    return f"backend='fa3': the Hopper path runs on sm_90 GPUs (H100, H200) only; {where}"


def refusal(c, ragged: bool, device: torch.device, table: str | None = "csr", graph: bool = False,
            gather: bool = True) -> str | None:
    """Why the Hopper path cannot run this plan, as backend 'fa3''s ValueError says it: a
    feature it does not take yet (unsupported; table, graph, gather: as there), else the device
    (arch_error); None: it can."""
    why = unsupported(c, ragged, table, graph, gather)
    if why is not None and fp8_attention(c):  # (no other kernel takes fp8 q)
        return f"{why}: FP8 attention runs on the Hopper kernel's fp8 form only, which does not take that yet"
    if why is not None:
        return (f"backend='fa3': not supported on the Hopper path yet: {why}; use backend='auto' or 'fa2' (the "
                "mma.sync kernel takes it)")
    why = arch_error(device)
    return f"q_data_type float8_e4m3fn (FP8 attention): {why}" if why is not None and fp8_attention(c) else why


def auto_takes(c, qo_lens: np.ndarray, keys: np.ndarray) -> bool:
    """Whether backend 'auto' takes the Hopper path for a batch it can run: requests of
    AUTO_MIN_MEAN_QO_LEN or more query tokens on average and query tiles that visit
    AUTO_MIN_KEYS or more keys on average (keys: plan_tiles' column 6). Every option the
    Hopper path takes is measured faster there than on the mma.sync kernel at those lengths
    (H200, 2026-11-29, scripts/bench_prefill_features.py, causal 4 x 4k and 16 x 1k: soft cap
    1.20-1.31x, window 1.32-1.38x, custom mask 1.65-1.74x, sinks 1.34-1.55x, head_dim
    (192, 128) 2.03-2.19x), so none of them keeps the mma.sync kernel."""
    return qo_lens.size > 0 and keys.size > 0 and auto_takes_means(c, float(qo_lens.mean()), float(keys.mean()))


# Pages of 8 tokens over the copy (small_pages): the mma.sync kernel reads them well enough that
# the copy pays only where query tiles see more keys: H200, hd128 causal 64 x 256 (192 keys a
# tile) 0.89x the mma.sync kernel's speed, full 64 x 256 (256 keys) 1.13x, 16 x 1k causal
# 1.11x (docs/hopper.md). Pages of 1-4 tokens: 1.20x and more on every row measured.
AUTO_MIN_KEYS_PAGE_8 = 256.0


def auto_takes_means(c, mean_qo_len: float, mean_keys: float) -> bool:
    """auto_takes from the means: query tokens a request, keys a query tile (both batches
    non-empty)."""
    least = AUTO_MIN_KEYS[c.head_dim_qk]
    if small_pages(c) and c.page_size >= 8:
        least = max(least, AUTO_MIN_KEYS_PAGE_8)
    return mean_qo_len >= AUTO_MIN_MEAN_QO_LEN and mean_keys >= least


def block_table_ids(tables: torch.Tensor, kv_lens: np.ndarray, page_size: int) -> tuple[torch.Tensor, np.ndarray, int]:
    """(page ids, first, v_ids): a block table (int32, its last dimension contiguous:
    parse_block_tables), vLLM's [B, max_pages] or TensorRT-LLM's [B, 2, max_pages] (K ids,
    V ids), as the kernel reads a page-id vector: a 1-D view from row 0 to the end of the
    last row, request b's first (K) page id at b x the row stride (plan_tiles' kv_indptr,
    B + 1 entries), its V ids v_ids further on (0: the same ids). kv_lens: seq_lens on the
    host, checked here (the Hopper path returns before the mma.sync planner's checks)."""
    batch, max_pages = tables.shape[0], tables.shape[-1]
    v_ids = tables.stride(1) if tables.dim() == 3 else 0
    if kv_lens.size and int(kv_lens.min()) < 0:
        raise ValueError(f"seq_lens: expected lengths >= 0, got {int(kv_lens.min())}")
    pages = -(-kv_lens // page_size)
    if pages.size and int(pages.max()) > max_pages:
        b = int(np.argmax(pages))
        raise ValueError(f"seq_lens: request {b}'s {int(kv_lens[b])} keys need {int(pages[b])} pages of {page_size}; "
                         f"block_tables holds {max_pages} a request")
    stride = tables.stride(0) if batch > 0 else max_pages
    first = np.arange(batch + 1, dtype=np.int64) * stride
    if batch and int(first[-1]) >= 2 ** 31:
        raise ValueError(f"block_tables: {batch} rows of stride {stride} exceed the Hopper path's int32 page index")
    span = (batch - 1) * stride + v_ids + max_pages if batch > 0 else 0
    return torch.as_strided(tables, (span,), (1,), tables.storage_offset()), first, v_ids


def plan_tiles(qo_indptr: np.ndarray, kv_indptr: np.ndarray, causal: bool, keys_a_tile: int = TILE_ROWS,
               kv_lens: np.ndarray | None = None, window_left: int = -1,
               tile_rows: int = TILE_ROWS) -> tuple[np.ndarray, int]:
    """The tiles of a batch (int32 [tiles, TILE_INTS]: Sm90Tile's fields; column 6, which
    the kernel does not read, the keys the tile visits), the ones with the most key tiles
    (of keys_a_tile: key_tile()) first, ties in request and tile order, and how many see a
    key at all. Causal masks are bottom-right aligned: row i of a request sees keys
    j <= i + kv_len - qo_len. Ragged: kv_indptr the requests' K/V rows. Paged: kv_indptr
    the index of each request's first page id in the page-id vector (the CSR table's indptr;
    block tables: b x the table's row stride), so a tile's kv_row0 is that index,
    and kv_lens the requests' key counts. window_left >= 0 (a sliding window: the row at
    position pos sees keys >= pos - window_left): column 7 the first key tile a tile
    visits (its first row's window start), column 6 the keys from there. tile_rows: query
    rows a tile (the kernel's kBlockM)."""
    qo = qo_indptr.astype(np.int64)
    kv = kv_indptr.astype(np.int64)
    qo_lens = np.diff(qo)
    kv_lens = np.diff(kv) if kv_lens is None else kv_lens.astype(np.int64)
    per_req = (qo_lens + tile_rows - 1) // tile_rows
    n = int(per_req.sum())
    req = np.repeat(np.arange(qo_lens.size), per_req)
    starts = np.repeat(np.cumsum(per_req) - per_req, per_req)
    q_start = (np.arange(n) - starts) * tile_rows
    tiles = np.zeros((n, TILE_INTS), dtype=np.int64)
    kvl = kv_lens[req]
    diag = q_start + kvl - qo_lens[req]
    kv_end = np.clip(np.minimum(kvl, diag + tile_rows), 0, None) if causal else kvl
    kv_tiles = (kv_end + keys_a_tile - 1) // keys_a_tile
    first = np.zeros_like(kv_tiles)
    kv_start = np.zeros_like(kv_end)
    if window_left >= 0:
        kv_start = np.clip(diag - window_left, 0, None)
        first = np.minimum(kv_start // keys_a_tile, kv_tiles)
        kv_tiles = np.where(kv_start < kv_end, kv_tiles, 0)  # a window past every key: no key tile
        first = np.where(kv_tiles > 0, first, 0)
    tiles[:, 0] = qo[req] + q_start
    tiles[:, 1] = np.minimum(tile_rows, qo_lens[req] - q_start)
    tiles[:, 2] = kv[req]
    tiles[:, 3] = kvl
    tiles[:, 4] = diag
    tiles[:, 5] = kv_tiles
    tiles[:, 6] = np.where(kv_tiles > 0, kv_end - kv_start, 0)
    tiles[:, 7] = first
    visited = kv_tiles - first
    order = np.argsort(-visited, kind="stable")
    return tiles[order].astype(np.int32), int(np.count_nonzero(visited))


def mask_bases(tiles: np.ndarray, qo_indptr: np.ndarray, kv_lens: np.ndarray, byte_starts: np.ndarray) -> np.ndarray:
    """A custom mask's first bit of each tile (plan_tiles' order): its request's byte offset
    (mask_indptr of the packed form) x 8 + the tile's first row's position in the request x
    kv_len, int64 (the packed bits of row i, key j of a request at i x kv_len + j)."""
    qo = qo_indptr.astype(np.int64)
    q_row0 = tiles[:, 0].astype(np.int64)
    req = np.searchsorted(qo, q_row0, side="right") - 1
    return byte_starts.astype(np.int64)[req] * 8 + (q_row0 - qo[req]) * kv_lens.astype(np.int64)[req]


def mask_buffer(packed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A custom mask's packed bits (uint8) in a buffer the kernel reads as 32-bit words: 16-byte
    aligned, padded with 64 zero bytes past the bits (a tile's last row reads up to a key tile
    and two words past its request's keys; csrc/hopper/prefill_sm90.cuh load_mask)."""
    n = packed.numel()
    buf = torch.zeros((n + 64 + 15) // 16 * 16, dtype=torch.uint8, device=device)
    buf[:n].copy_(packed.reshape(-1))
    return buf


class Sm90Plan:
    """A plan on the Hopper path: the spec, the work list on the device (its first work_ints
    int32: an eager plan's device buffer may be longer), the grid; the
    fields run()'s shared checks read and write (config, qo_tokens, checked, fast, quick)."""

    __slots__ = ("config", "spec", "op", "work", "work_ints", "page_ids", "mask", "counters", "grid", "qo_tokens",
                 "checked", "fast", "quick", "traced_key", "rope", "gather")


class Sm90Planner:
    """A wrapper's Hopper-path planning: its work-list buffer (fixed at the first plan for a
    CUDA-graph wrapper, whose captured launch reads whatever plan() wrote there last)."""

    def __init__(self, device: torch.device, use_cuda_graph: bool):
        self._device = device
        self._graph = use_cuda_graph
        self._buffer = None  # CUDA graphs: the fixed work list
        self._specs = {}
        # the kernel's dynamic schedule: two counters, zeros that every launch leaves at zero
        # (csrc/hopper/prefill_sm90.cuh); one pair a wrapper, as its plan is
        self._counters = torch.zeros(2, dtype=torch.int32, device=device)
        self._no_ids = torch.empty(0, dtype=torch.int32, device=device)  # ragged K/V's page_ids
        self._no_mask = torch.empty(0, dtype=torch.uint8, device=device)  # no custom mask
        self._tiles = np.zeros(64 * TILE_INTS, dtype=np.int32)  # native_tiles' output, grown as needed
        # the work list: pinned host slots and one C copy (runtime/plan_buffer.py; eager plans:
        # a CUDA-graph wrapper's list is its fixed buffer)
        self._plan_buffer = None if use_cuda_graph else PlanBuffer(device, False)
        self._work_guess = WORK_HEADER + 64 * TILE_INTS  # (native_work's first slot size: the largest list so far)
        self._sms = sm_count(device)

    def native_tiles(self, side: int, qo: torch.Tensor, kv_a: torch.Tensor, kv_b, page_size: int, row_stride: int,
                     causal: bool, keys_a_tile: int, window_left: int, tile_rows: int):
        """plan_tiles in C++ (csrc/hopper/prefill_sm90_plan.h, through fij_fastcall.sm90_tiles):
        (tiles, a view of this planner's scratch until the next call; active; the sum of their
        column 6), or None where the extension is unavailable or the vectors are not of its
        common form (contiguous int32 CPU tensors of the batch's lengths, lengths >= 0).
        side: 0 csr (kv_a the page indptr, kv_b last_page_len), 1 seq_lens (kv_a; a request's
        first page-id index b x row_stride), 2 ragged (kv_a the K/V rows' indptr)."""
        ext = fastcall.extension()
        if ext is None:
            return None
        for _ in range(2):  # (once more where the scratch was too small)
            buf = self._tiles
            got = ext.sm90_tiles(side, qo, kv_a, kv_b, page_size, row_stride, causal, keys_a_tile, window_left,
                                 tile_rows, buf.ctypes.data, buf.size // TILE_INTS, 0)
            if got == -1:
                return None
            n, active, keys_sum = got[:3]
            if n * TILE_INTS <= buf.size:
                return buf[:n * TILE_INTS].reshape(n, TILE_INTS), active, keys_sum
            self._tiles = np.zeros(grown_size(n * TILE_INTS), dtype=np.int32)
        return None

    def native_work(self, side: int, qo: torch.Tensor, kv_a: torch.Tensor, kv_b, page_size: int, causal: bool,
                    keys_a_tile: int, window_left: int, tile_rows: int, heads: int, slot=None):
        """The common form's whole work list, planned in C++ (fij_fastcall.sm90_tiles with its
        header) straight into a pinned slot of this planner's plan buffer: (slot, its tiles
        as an [n, TILE_INTS] view, active, keys_sum, batch, qo_indptr's first and last entries,
        kv_a's last); None where native_tiles would return None (the slot goes back) or the
        wrapper is a CUDA-graph one. side: native_tiles' 0 (csr) or 2 (ragged). slot: plan
        again into that slot (another key or query tile), else a fresh one."""
        ext = fastcall.extension()
        if ext is None or self._plan_buffer is None:
            return None
        buffer = self._plan_buffer
        if slot is None:
            slot = buffer.host(self._work_guess)
        for _ in range(2):  # (once more in a grown slot)
            room = (len(slot.array) - WORK_HEADER) // TILE_INTS
            got = ext.sm90_tiles(side, qo, kv_a, kv_b, page_size, 0, causal, keys_a_tile, window_left, tile_rows,
                                 slot.address, room, heads)
            if got == -1:
                buffer.give_back()
                return None
            n = got[0]
            if n <= room:
                self._work_guess = max(self._work_guess, WORK_HEADER + n * TILE_INTS)
                tiles = slot.array[WORK_HEADER: WORK_HEADER + n * TILE_INTS].reshape(n, TILE_INTS)
                return (slot, tiles) + got[1:]
            slot = buffer.regrow(WORK_HEADER + n * TILE_INTS)
        buffer.give_back()
        return None

    def finish(self, c, slot, tiles: int, non_blocking: bool, keys_a_tile: int, page_ids: torch.Tensor | None,
               layout: str, tile_rows: int, qo_tokens: int, mask: tuple | None = None, gather: tuple | None = None,
               size: int | None = None) -> Sm90Plan:
        """The plan of a work list filled in `slot` (eager) or given as `slot` (a CUDA-graph
        wrapper's host array): shipped to the device, with the spec and the fields run() reads.
        tiles: the list's tiles; size: its int32s (default: the header and the tiles);
        qo_tokens: the batch's query rows (qo_indptr's last entry)."""
        heads = c.num_qo_heads
        items = tiles * heads
        size = WORK_HEADER + tiles * TILE_INTS if size is None else size
        if self._graph:
            host = slot
            src = torch.from_numpy(host)
            if self._buffer is None:
                capacity = max(_GRAPH_MIN_TILES, _GRAPH_TILES_FACTOR * tiles)
                self._buffer = torch.zeros(WORK_HEADER + capacity * TILE_INTS, dtype=torch.int32,
                                           device=self._device)
            if host.size > self._buffer.numel():
                raise ValueError(f"qo_indptr: {tiles} query tiles of {tile_rows} rows exceed the "
                                 f"{(self._buffer.numel() - WORK_HEADER) // TILE_INTS} this CUDA-graph wrapper's "
                                 "first plan sized its work list for")
            self._buffer[:host.size].copy_(src, non_blocking=non_blocking)
            work = self._buffer
            grid = self._sms
        else:  # (the device buffer stays while it is large enough: a later plan's copy follows this
            # plan's run() in stream order)
            self._plan_buffer.ship(slot, size, non_blocking)
            work = self._plan_buffer.buf  # (its first `size` ints: the kernel reads the header's counts)
            grid = max(1, min(self._sms, items))
        p = Sm90Plan()
        paged = page_ids is not None
        alibi = c.pos_encoding == "alibi"
        key = (c.q_dtype, c.o_dtype, c.head_dim_qk, c.mask, paged, layout, keys_a_tile, bool(c.soft_cap), tile_rows,
               alibi)
        spec = self._specs.get(key)
        if spec is None:
            fp8 = fp8_attention(c)  # (the spec's dtype: the output's)
            spec = self._specs[key] = PrefillSm90Spec(dtype_name(c.o_dtype if fp8 else c.q_dtype), c.head_dim_qk,
                                                      c.mask, "paged" if paged else "ragged",
                                                      layout if paged else "NHD", keys_a_tile, bool(c.soft_cap),
                                                      tile_rows, alibi, fp8).validate()
        p.config, p.spec, p.op, p.work, p.counters, p.grid = c, spec, None, work, self._counters, grid
        p.work_ints = size
        p.page_ids = page_ids if paged else self._no_ids
        p.mask = mask[0] if mask is not None else self._no_mask
        p.qo_tokens = qo_tokens
        p.checked, p.fast, p.quick, p.traced_key = None, [None, None], None, None
        p.rope, p.gather = None, gather
        return p

    def plan(self, c, qo_indptr: np.ndarray, tiles: np.ndarray, active_tiles: int, non_blocking: bool,
             keys_a_tile: int, page_ids: torch.Tensor | None = None, layout: str = "NHD", v_ids: int = 0,
             tile_rows: int = TILE_ROWS, mask: tuple | None = None, key_rows: tuple | None = None,
             gather: tuple | None = None) -> Sm90Plan:
        """tiles, active_tiles: plan_tiles' result for this batch, in key tiles of keys_a_tile;
        page_ids: the CSR page table's indices, int32 on the device (paged), else None; mask:
        a custom mask's (packed bits on the device, padded: mask_buffer; each tile's first
        bit: mask_bases), else None. key_rows (pos_encoding_mode ROPE_LLAMA): (each request's
        first key row in the K that the kernel reads, B + 1 offsets; its keys, B) as int64
        arrays, for the rotation before the kernel (rope_prepass). gather: the pages a paged
        run() copies first (gather_pages: K's and V's page ids on the device), else None."""
        heads = c.num_qo_heads
        items = tiles.shape[0] * heads
        if items >= 2 ** 31:
            raise ValueError(f"qo_indptr: {tiles.shape[0]} query tiles x {heads} heads exceed the Hopper path's "
                             "int32 item count")
        bases = 0 if mask is None else 2 * tiles.shape[0]  # (an int64 a tile, after the tiles)
        size = WORK_HEADER + tiles.size + bases
        slot = self._plan_buffer.host(size) if self._plan_buffer is not None else None
        host = slot.array[:size] if slot is not None else np.zeros(size, dtype=np.int32)
        host[0], host[1], host[2], host[3] = items, active_tiles * heads, v_ids, 0
        host[WORK_HEADER: WORK_HEADER + tiles.size] = tiles.reshape(-1)
        alibi = c.pos_encoding == "alibi"
        if alibi and tiles.shape[0]:  # each tile's kv_len - qo_len in its `keys` (the LSE's shift; the kernel's)
            req = np.searchsorted(qo_indptr, tiles[:, 0], side="right") - 1
            qo_lens = (qo_indptr[req + 1] - qo_indptr[req]).astype(np.int64)
            view = host[WORK_HEADER: WORK_HEADER + tiles.size].reshape(tiles.shape)
            view[:, 6] = tiles[:, 3].astype(np.int64) - qo_lens
        if mask is not None:
            host[WORK_HEADER + tiles.size:] = mask[1].astype(np.int64).view(np.int32)
        p = self.finish(c, host if self._graph else slot, tiles.shape[0], non_blocking, keys_a_tile, page_ids, layout,
                        tile_rows, int(qo_indptr[-1]), mask, gather, size)
        if c.pos_encoding == "rope_llama":
            # q row i of request b at position kv_len - qo_len + i, key j at j (the mma.sync
            # kernel's in-kernel RoPE): each side's offsets over its own row ranges (a copy of
            # pages: rows past a request's keys in its last page rotate too, and are never read)
            qo64, (kv64, kv_lens) = qo_indptr.astype(np.int64), key_rows
            shift = kv_lens - (qo64[1:] - qo64[:-1])
            host_rope = np.concatenate([qo64, shift, kv64, np.zeros(len(kv64) - 1, np.int64)]).astype(np.int32)
            dev = torch.from_numpy(host_rope).to(self._device, non_blocking=non_blocking)
            b = len(qo64) - 1
            # every request's queries at its keys' rows and positions (ragged, qo_len = kv_len):
            # one call rotates q and k together
            same = gather is None and np.array_equal(qo64, kv64) and not shift.any()
            p.rope = (dev[: b + 1], dev[b + 1: 2 * b + 1], dev[2 * b + 1: 3 * b + 2], dev[3 * b + 2:], same)
        return p


def copy_offsets(kv_lens: np.ndarray, page_size: int) -> np.ndarray:
    """Each request's first page in the copy of the batch's pages (gathers), B + 1 int64."""
    pages = -(-kv_lens.astype(np.int64) // page_size)
    offsets = np.zeros(pages.shape[0] + 1, dtype=np.int64)
    np.cumsum(pages, out=offsets[1:])
    return offsets


def gather_ids(ids: torch.Tensor, first: np.ndarray, offsets: np.ndarray, v_ids: int, device: torch.device,
               non_blocking: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What gather_pages copies for a paged plan over the copy of its pages (gathers): (K page
    ids, V page ids) on the device, the copy's pages in order. ids: the page-id vector the
    kernel would read (CSR indices, or a block table's 1-D view: block_table_ids), request b's
    pages from entry first[b], its V ids v_ids further on; offsets: copy_offsets."""
    pages = np.diff(offsets)
    total = int(offsets[-1])
    first = first.astype(np.int64)
    ids = ids.to(device, non_blocking=non_blocking)
    one_run = pages.shape[0] <= 1 or bool((first[:-1] + pages == first[1:]).all())
    if one_run and v_ids == 0:  # (CSR: the batch's ids are one run of the vector)
        start = int(first[0]) if pages.shape[0] else 0
        k_ids = v_ids_dev = ids[start:start + total]
    else:
        at = np.repeat(first[:-1] - offsets[:-1], pages) + np.arange(total, dtype=np.int64)
        at_dev = torch.from_numpy(at).to(device, non_blocking=non_blocking)
        k_ids = ids[at_dev]
        v_ids_dev = ids[at_dev + v_ids] if v_ids else k_ids
    return k_ids, v_ids_dev


def pad_rows(offsets: np.ndarray, kv_lens: np.ndarray, page_size: int, device: torch.device,
             non_blocking: bool) -> torch.Tensor:
    """The rows of a copy of the batch's pages (gather_pages) past each request's keys, in its
    last page (offsets: copy_offsets), int64 on the device: gather_pages zeros V's there, since
    the ragged kernel reads a tile's rows past kv_len and P's zeros do not cancel whatever the
    cache's unused slots hold (NaN included); K's are masked."""
    ends = offsets[1:].astype(np.int64) * page_size
    lens = kv_lens.astype(np.int64)
    counts = ends - (offsets[:-1].astype(np.int64) * page_size + lens)
    rows = np.repeat(ends - counts, counts) + (np.arange(int(counts.sum()), dtype=np.int64) -
                                               np.repeat(np.cumsum(counts) - counts, counts))
    return torch.from_numpy(rows).to(device, non_blocking=non_blocking)


def gather_pages(k: torch.Tensor, v: torch.Tensor, gather: tuple, layout: str, dtype: torch.dtype):
    """The batch's K and V pages (gather: their ids) copied into new tensors of `dtype`, as
    rows [pages x page_size, heads, head_dim] (a request's pages one run of rows, from row
    copy_offsets x page_size), which the Hopper kernel reads as ragged K/V: an fp8 cache widened
    to q's dtype (exactly: e4m3 and e5m2 values are bf16 and f16 values), any layout or
    strides, V's rows past each request's keys zeroed (gather's third entry: pad_rows).
    k_scale and v_scale stay the kernel's."""
    out = []
    for t, ids in zip((k, v), gather[:2]):
        nhd = t.transpose(1, 2) if layout == "HND" else t  # [pages, page_size, heads, dim], a view
        copy = torch.empty((ids.shape[0], *nhd.shape[1:]), dtype=dtype, device=t.device)
        if t.dtype == dtype:  # one pass: the pages gathered straight into the copy's rows
            torch.index_select(nhd, 0, ids, out=copy)
        else:  # an fp8 cache: its bytes gathered (index_select takes no fp8), then widened
            copy.copy_(nhd.view(torch.uint8).index_select(0, ids).view(t.dtype))
        out.append(copy.view(-1, *copy.shape[2:]))
    if gather[2].numel():
        out[1].index_fill_(0, gather[2], 0)
    return out[0], out[1]


@cache
def _rope_spec(dtype: str) -> RopeSpec:
    """The RoPE kernel's module for the pass: NeoX halves, positions from row offsets, angles
    computed (the mma.sync kernel's in-kernel RoPE)."""
    return RopeSpec(dtype, dtype, False, "indptr", "computed").validate()


@constant_result
def _rope_namespace(dtype: str) -> str:
    return get_module(_rope_spec(dtype)).namespace


def rope_prepass(q: torch.Tensor, k: torch.Tensor, rope: tuple, c) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated (ROPE_LLAMA, NeoX halves; rope_scale and rope_theta from the plan's
    configuration) into new tensors, by the RoPE kernel (runtime/shared_specs.py RopeSpec, the
    module kvcache's apply_rope runs), each on its own row offsets: the Hopper path's
    pos_encoding_mode="ROPE_LLAMA", before the kernel (ragged K/V, or the rows of a copy of
    the batch's pages: gather_pages; measured 2.2-3.1x the mma.sync kernel's in-kernel RoPE
    on ragged K/V: docs/hopper.md). Where every request's queries sit at its keys' rows and
    positions (the plan's `same`: ragged, qo_len = kv_len) one call rotates both; otherwise one
    call a tensor, whose second input is a one-head view of it, its output dropped. q and k
    passed run()'s checks (dtype, heads, 16-byte rows)."""
    if c.rope_scale <= 0 or c.rope_theta <= 0:  # (as apply_rope's check)
        raise ValueError(f"rope_scale and rope_theta must be positive, got {c.rope_scale}, {c.rope_theta}")
    dtype = dtype_name(q.dtype)
    traced = compiling()
    op = traced_op(_rope_namespace(dtype), "rope") if traced else get_module(_rope_spec(dtype)).rope
    device = q.device
    # (absent optional tensors: kept placeholders, new ones while Dynamo traces)
    none_i32, none_f32 = ((torch.empty(0, dtype=torch.int32, device=device),
                           torch.empty(0, dtype=torch.float32, device=device)) if traced else
                          (placeholder(device, torch.int32), placeholder(device, torch.float32)))
    qo, q_shift, kv, k_shift, same = rope
    scale, theta = float(c.rope_scale), float(c.rope_theta)
    if same:
        q_rot, k_rot = torch.empty_like(q), torch.empty_like(k)
        op(q, k, none_i32, none_i32, q_rot, k_rot, none_i32, none_i32, none_i32, qo, q_shift, none_f32,
           scale, theta, 0.0, 0.0, 1.0, 1.0)
        return q_rot, k_rot
    out = []
    for t, indptr, offsets in ((q, qo, q_shift), (k, kv, k_shift)):
        rotated, one_head = torch.empty_like(t), t[:, :1]
        op(t, one_head, none_i32, none_i32, rotated, torch.empty_like(one_head), none_i32, none_i32, none_i32, indptr,
           offsets, none_f32, scale, theta, 0.0, 0.0, 1.0, 1.0)
        out.append(rotated)
    return out[0], out[1]


__all__ = ["AUTO_MIN_KEYS", "AUTO_MIN_MEAN_QO_LEN", "PAGE_SIZES", "WIDE_TILE_MAX_PAD", "block_table_ids", "copy_offsets",
           "gather_ids", "gather_pages", "gathers", "key_tile", "small_pages", "copies_for_speed",
           "mask_bases", "mask_buffer",
           "narrower_tile", "QUERY_TILE_MIN_KEYS", "query_tile", "rope_prepass", "Sm90Plan", "Sm90Planner", "arch_error", "auto_takes", "plan_tiles", "refusal", "unsupported"]

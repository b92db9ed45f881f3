"""Batch decode over the paged KV cache (FlashInfer's BatchDecodeWithPagedKVCacheWrapper
and single_decode_with_kv_cache).

plan() runs on the host once per batch: it validates the configuration, picks the
module (DecodeSpec), splits long requests into chunks when the batch alone cannot fill the
GPU (split-KV), and writes the work list, the merge index and the small page-table arrays
into one pinned buffer that reaches the device in one copy. run() validates q and the
cache against the plan and launches one op (decode kernel + merge of split requests).

With use_cuda_graph=True every buffer has a fixed size set by the first plan() (its batch
size is the capacity), the decode grid covers the capacity and exits early past the
planned work, so a graph captured around run() stays valid across later plan() calls with
other lengths and batch sizes up to the capacity.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from . import env
from .checks import aligned16, dtype_str, expect_choice, same_cuda_device
from .jit import get_module, op_cache
from .page_table import PageTable, unpack_paged_kv_cache
from .specs.append import HEAD_DIMS
from .specs.base import dtype_name
from .specs.decode import DecodeSpec, group_tile

POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA")
_LOG2E = 1.4426950408889634
_MIN_CHUNK = 64  # tokens; two 32-token tiles, so a chunk still pipelines its loads
_SPLIT_BLOCKS_PER_SM = 3


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _as_dtype(value, name: str, default=None) -> torch.dtype:
    if value is None:
        return default
    if isinstance(value, torch.dtype):
        return value
    dt = getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"{name}: expected a torch dtype or its name, got {value!r}")
    return dt


def plan_split(kv_lens: np.ndarray, blocks_per_item: int, target_blocks: int, fixed_split_size, disable_split_kv,
               max_items: int | None = None, max_partials: int | None = None):
    """Chunk size for the work list, and the list: (request, start, end, partial_row) rows
    and merge_indptr. Pure function of host values (unit-tested without a GPU).

    The chunk is the total work spread over about target_blocks blocks (never below
    _MIN_CHUNK tokens); a request no longer than the chunk is one item, so a uniform batch
    that fills the GPU is not split, while the long requests of a skewed one are (56 x 256
    + 8 x 8k tokens: unsplit, the eight 8k requests ran 5x longer than the rest). The chunk
    is then doubled until the list fits the capacities (CUDA-graph buffers, the workspace).
    """
    batch = len(kv_lens)
    longest = int(kv_lens.max()) if batch else 0
    if disable_split_kv or longest == 0:
        chunk = max(longest, 1)
    elif fixed_split_size:
        chunk = int(fixed_split_size)
    else:
        wanted = math.ceil(int(kv_lens.sum()) * blocks_per_item / target_blocks)
        chunk = max(_MIN_CHUNK, -(-wanted // 32) * 32)
    while True:
        n_chunks = np.maximum(1, -(-kv_lens // chunk))
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
    start = local * chunk
    end = np.minimum(start + chunk, kv_lens[request])
    merge_indptr = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(np.where(split, n_chunks, 0), out=merge_indptr[1:])
    partial_row = np.where(split[request], merge_indptr[request] + local, -1)
    work = np.stack([request, start, end, partial_row], axis=1).astype(np.int32)
    return chunk, work, merge_indptr.astype(np.int32), bool(split.any())


class BatchDecodeWithPagedKVCacheWrapper:
    """FlashInfer's decode wrapper: plan() once per batch, run() per layer."""

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto", jit_args=None):
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise TypeError("float_workspace_buffer: expected a tensor (e.g. 128 MB of uint8 on the GPU)")
        expect_choice(kv_layout, "kv_layout", ("NHD", "HND"))
        self._workspace = float_workspace_buffer
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        # use_tensor_cores selects FlashInfer's prefill-based decode; this kernel runs on CUDA
        # cores for every group size (decode is bound by memory, not by arithmetic).
        self._use_tensor_cores = bool(use_tensor_cores)
        self._user_buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self._plan = None
        self._capacity = None  # CUDA-graph mode: fixed at the first plan()

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    # --- plan ---------------------------------------------------------------------------------
    def plan(self, indptr=None, indices=None, last_page_len=None, num_qo_heads=None, num_kv_heads=None,
             head_dim=None, page_size=None, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap=None, q_data_type="float16", kv_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None, non_blocking: bool = True, block_tables=None, seq_lens=None,
             fixed_split_size=None, disable_split_kv: bool = False) -> None:
        for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        expect_choice(pos_encoding_mode, "pos_encoding_mode", POS_ENCODING_MODES)
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: {head_dim} is not supported; supported: {', '.join(map(str, HEAD_DIMS))}")
        if not isinstance(window_left, int) or window_left < -1:
            raise ValueError(f"window_left: expected -1 (off) or a non-negative int, got {window_left!r}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap: expected None or a positive float, got {logits_soft_cap!r}")
        if fixed_split_size is not None and (not isinstance(fixed_split_size, int) or fixed_split_size <= 0):
            raise ValueError(f"fixed_split_size: expected a positive int, got {fixed_split_size!r}")
        q_dtype = _as_dtype(data_type, "data_type") or _as_dtype(q_data_type, "q_data_type", torch.float16)
        kv_dtype = _as_dtype(kv_data_type, "kv_data_type", q_dtype)
        table_layout, table_host, kv_lens = self._host_page_table(indptr, indices, last_page_len, block_tables,
                                                                  seq_lens, page_size)
        batch = len(kv_lens)
        tile = group_tile(num_qo_heads, num_kv_heads)
        spec = DecodeSpec(dtype_name(q_dtype), dtype_name(kv_dtype), head_dim, tile, table_layout,
                          self._kv_layout, pos_encoding_mode == "ROPE_LLAMA", logits_soft_cap is not None)
        spec.validate()
        device = self._workspace.device
        if self._use_cuda_graph:
            if self._capacity is None:
                self._capacity = batch
            elif batch > self._capacity:
                raise ValueError(f"batch size {batch} exceeds the {self._capacity} requests this CUDA-graph "
                                 "wrapper was first planned (captured) with")
        capacity = self._capacity if self._use_cuda_graph else batch
        blocks_per_item = num_kv_heads * (num_qo_heads // num_kv_heads // tile)
        # Split only when the batch gives fewer than ~3 blocks per SM: each block keeps two
        # 32-token K/V stages in flight, so 3 per SM already cover the memory latency, and a
        # split costs a partial-state write and a merge launch.
        target = _SPLIT_BLOCKS_PER_SM * (_num_sms(device.index or 0) if device.type == "cuda" else 132)
        partial_o, partial_lse = self._partial_views(num_qo_heads, head_dim)
        max_items = capacity + -(-2 * target // blocks_per_item) if self._use_cuda_graph else None
        _, work, merge_indptr, any_split = plan_split(kv_lens, blocks_per_item, target, fixed_split_size,
                                                      disable_split_kv, max_items, partial_o.shape[0])
        if self._use_cuda_graph and self._plan is not None and self._plan["max_items"] != max_items:
            raise ValueError("a CUDA-graph wrapper keeps its head configuration; make a new wrapper")
        grid_items = max_items if self._use_cuda_graph else len(work)
        offsets = self._offsets(table_layout, capacity, grid_items)
        packed = self._pack(work, merge_indptr, table_host, capacity, offsets)
        device_buf = self._device_buffer(packed.numel(), device)
        device_buf.copy_(packed, non_blocking=non_blocking)  # the one host-to-device copy
        if device.type == "cuda":
            self._copy_event = torch.cuda.Event()
            self._copy_event.record()
        work_dev = device_buf[offsets["work"]:offsets["work"] + 1 + 4 * grid_items]
        merge_dev = device_buf[offsets["merge"]:offsets["merge"] + capacity + 1]
        tensors = self._device_page_table(table_layout, device_buf, offsets, capacity, indices, block_tables)
        sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        self._plan = dict(
            spec=spec, op=None, debug=env.debug(), partial_o=partial_o, partial_lse=partial_lse, batch=batch,
            capacity=capacity, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype, work=work_dev,
            merge_indptr=merge_dev, page_table=PageTable(table_layout, tensors, capacity), grid_items=grid_items,
            merge_rows=capacity if (self._use_cuda_graph or any_split) else 0, max_items=max_items,
            sm_scale=sm_scale, soft_cap=float(logits_soft_cap or 0.0), window_left=window_left,
            rope_scale=float(1.0 if rope_scale is None else rope_scale),
            rope_theta=float(1e4 if rope_theta is None else rope_theta))

    def _host_page_table(self, indptr, indices, last_page_len, block_tables, seq_lens, page_size):
        """(layout, host arrays to ship, kv lengths) from CSR or block-table arguments."""
        if block_tables is not None:
            if indptr is not None or last_page_len is not None:
                raise ValueError("give either indptr/indices/last_page_len or block_tables/seq_lens, not both")
            if not isinstance(block_tables, torch.Tensor) or block_tables.dtype != torch.int32 or \
                    block_tables.dim() not in (2, 3) or (block_tables.dim() == 3 and block_tables.shape[1] != 2):
                raise ValueError("block_tables: expected int32 [batch, max_pages] or [batch, 2, max_pages] (K and V "
                                 "page ids, TensorRT-LLM style)")
            if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 \
                    or seq_lens.shape[0] != block_tables.shape[0]:
                raise ValueError(f"seq_lens: expected int32 [{block_tables.shape[0]}] (one length per request)")
            if block_tables.stride(-1) != 1:
                raise ValueError("block_tables: the max_pages dimension must be contiguous")
            lens = seq_lens.cpu().numpy().astype(np.int64)
            if (lens < 0).any() or (lens > block_tables.shape[-1] * page_size).any():
                raise ValueError(f"seq_lens: expected 0..max_pages * page_size ({block_tables.shape[-1] * page_size})")
            layout = "block_table_kv_separate" if block_tables.dim() == 3 else "block_table"
            return layout, {"seq_lens": lens}, lens
        for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
                raise ValueError(f"{name}: expected a 1-D int32 tensor (or block_tables= and seq_lens=)")
        if indptr.shape[0] < 1 or last_page_len.shape[0] != indptr.shape[0] - 1:
            raise ValueError(f"last_page_len: expected {indptr.shape[0] - 1} entries (batch size), got "
                             f"{last_page_len.shape[0]}")
        ptr = indptr.cpu().numpy().astype(np.int64)
        last = last_page_len.cpu().numpy().astype(np.int64)
        pages = ptr[1:] - ptr[:-1]
        if ptr[0] != 0 or (pages < 0).any() or ptr[-1] > indices.shape[0]:
            raise ValueError("indptr: expected non-decreasing offsets from 0 to at most len(indices)")
        if ((pages > 0) & ((last < 1) | (last > page_size))).any():
            raise ValueError(f"last_page_len: expected 1..page_size ({page_size}) for every request with pages")
        lens = np.where(pages > 0, (pages - 1) * page_size + last, 0)
        return "csr", {"indptr": ptr, "last_page_len": last}, lens

    @staticmethod
    def _offsets(layout: str, capacity: int, grid_items: int) -> dict:
        work = 0
        merge = 1 + 4 * grid_items
        table = merge + capacity + 1
        if layout == "csr":
            return {"work": work, "merge": merge, "indptr": table, "last_page_len": table + capacity + 1,
                    "end": table + 2 * capacity + 1}
        return {"work": work, "merge": merge, "seq_lens": table, "end": table + capacity}

    def _pack(self, work, merge_indptr, table_host, capacity, offsets) -> torch.Tensor:
        """Everything plan() ships, in one pinned host buffer (padded to the capacity)."""
        host = self._host_buffer(offsets["end"])
        host[:] = 0
        host[0] = len(work)
        host[1:1 + 4 * len(work)] = work.reshape(-1)
        batch = len(merge_indptr) - 1
        host[offsets["merge"]:offsets["merge"] + batch + 1] = merge_indptr
        host[offsets["merge"] + batch + 1:offsets["merge"] + capacity + 1] = merge_indptr[-1]
        if "indptr" in offsets:
            host[offsets["indptr"]:offsets["indptr"] + batch + 1] = table_host["indptr"]
            host[offsets["indptr"] + batch + 1:offsets["indptr"] + capacity + 1] = table_host["indptr"][-1]
            host[offsets["last_page_len"]:offsets["last_page_len"] + batch] = table_host["last_page_len"]
        else:
            host[offsets["seq_lens"]:offsets["seq_lens"] + batch] = table_host["seq_lens"]
        return self._host_tensor[: offsets["end"]]

    def _host_buffer(self, size: int) -> np.ndarray:
        """A persistent pinned host buffer (pinning per plan() would cost more than the plan).
        The previous plan's copy from it may still be queued: wait for that copy first."""
        event = getattr(self, "_copy_event", None)
        if event is not None:
            event.synchronize()
        tensor = getattr(self, "_host_tensor", None)
        if tensor is None or tensor.numel() < size:
            tensor = torch.zeros(max(size, 4096), dtype=torch.int32)
            if torch.cuda.is_available():
                tensor = tensor.pin_memory()
            self._host_tensor = tensor
        return tensor.numpy()[:size]

    def _device_buffer(self, size: int, device) -> torch.Tensor:
        buf = getattr(self, "_buf", None)
        if buf is None or buf.numel() < size:
            if self._use_cuda_graph and buf is not None:
                raise ValueError("a CUDA-graph wrapper cannot grow its plan buffers after the first plan()")
            buf = torch.empty(size, dtype=torch.int32, device=device)
            self._buf = buf
        return buf[:size]

    def _device_page_table(self, layout, device_buf, offsets, capacity, indices, block_tables):
        if layout == "csr":
            indptr = device_buf[offsets["indptr"]:offsets["indptr"] + capacity + 1]
            last = device_buf[offsets["last_page_len"]:offsets["last_page_len"] + capacity]
            return (indptr, self._device_copy("indices", indices), last)
        seq = device_buf[offsets["seq_lens"]:offsets["seq_lens"] + capacity]
        return (self._device_copy("block_tables", block_tables), seq)

    def _device_copy(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Page ids on the device. In CUDA-graph mode they go into a fixed buffer (the
        user's paged_kv_indices_buffer, or one allocated at the first plan), so a replay
        reads the current plan's ids."""
        device = self._workspace.device
        if not self._use_cuda_graph:
            return t.to(device, non_blocking=True) if t.device != device else t
        key = "_fixed_" + name
        fixed = getattr(self, key, None)
        if fixed is None:
            fixed = self._user_buffers[1] if (name == "indices" and self._user_buffers[1] is not None) else \
                torch.empty_like(t, device=device)
            setattr(self, key, fixed)
        if name == "indices":
            if t.numel() > fixed.numel():
                raise ValueError(f"indices: {t.numel()} page ids exceed the {fixed.numel()} the CUDA-graph buffer holds")
            fixed[: t.numel()].copy_(t, non_blocking=True)
            return fixed
        if t.shape[1:] != fixed.shape[1:] or t.shape[0] > fixed.shape[0]:
            raise ValueError(f"block_tables: shape {tuple(t.shape)} does not fit the CUDA-graph buffer {tuple(fixed.shape)}")
        fixed[: t.shape[0]].copy_(t, non_blocking=True)
        return fixed

    # --- run ----------------------------------------------------------------------------------
    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, window_left=None):
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() before plan(): call plan() with this batch's page table first")
        cache = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        self._check_run(q, cache, plan)
        batch_rows = q.shape[0]
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
            raise ValueError(f"out: expected shape {tuple(q.shape)} and dtype {dtype_str(q.dtype)}")
        if return_lse and lse is None:
            lse = torch.empty(batch_rows, plan["num_qo_heads"], dtype=torch.float32, device=q.device)
        if lse is not None and (lse.shape != (batch_rows, plan["num_qo_heads"]) or lse.dtype != torch.float32
                                or not lse.is_contiguous()):
            raise ValueError(f"lse: expected a contiguous float32 [{batch_rows}, {plan['num_qo_heads']}] tensor")
        logit_scale = plan["sm_scale"] * (1.0 if q_scale is None else float(q_scale)) * \
            (1.0 if k_scale is None else float(k_scale))
        logit_scale = logit_scale / plan["soft_cap"] if plan["soft_cap"] else logit_scale * _LOG2E
        wl = plan["window_left"] if window_left is None else int(window_left)
        if plan["op"] is None:  # the module loads (or builds) at the first run() after a plan()
            plan["op"] = _decode_op(plan["spec"], plan["debug"])
        plan["op"](
            q, cache.k, cache.v, plan["page_table"].tensors, plan["work"], plan["merge_indptr"], out,
            lse if lse is not None else _empty_f32(q.device), plan["partial_o"], plan["partial_lse"], logit_scale,
            1.0 if v_scale is None else float(v_scale), plan["soft_cap"], wl, plan["rope_scale"],
            plan["rope_theta"], plan["grid_items"], plan["merge_rows"])
        return (out, lse) if return_lse else out

    forward = run

    def _partial_views(self, num_qo_heads: int, head_dim: int):
        """Split-KV's partial outputs [rows, heads, head_dim] and LSEs [rows, heads] (float32)
        as views of the workspace; rows = as many as it holds."""
        rows = self._workspace.numel() * self._workspace.element_size() // ((num_qo_heads * head_dim + num_qo_heads) * 4)
        flat = self._workspace.view(torch.uint8).view(torch.float32) if self._workspace.dtype == torch.uint8 \
            else self._workspace.view(torch.float32)
        o = flat[: rows * num_qo_heads * head_dim].view(rows, num_qo_heads, head_dim)
        s = flat[rows * num_qo_heads * head_dim:][: rows * num_qo_heads]
        return o, s.view(rows, num_qo_heads)

    def _check_run(self, q, cache, plan) -> None:
        hq, d = plan["num_qo_heads"], plan["head_dim"]
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[1] != hq or q.shape[2] != d:
            raise ValueError(f"q: expected [batch, num_qo_heads={hq}, head_dim={d}], got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        if q.dtype != plan["q_dtype"]:
            raise TypeError(f"q: planned for {dtype_str(plan['q_dtype'])}, got {dtype_str(q.dtype)}")
        if self._use_cuda_graph:
            if not plan["batch"] <= q.shape[0] <= plan["capacity"]:
                raise ValueError(f"q: batch {q.shape[0]} must lie between the planned {plan['batch']} and the "
                                 f"captured capacity {plan['capacity']}")
        elif q.shape[0] != plan["batch"]:
            raise ValueError(f"q: batch size {q.shape[0]} differs from the planned {plan['batch']}")
        if q.stride(-1) != 1 or not aligned16(q):
            raise ValueError("q: head_dim must be contiguous and rows 16-byte aligned")
        if cache.k.dtype != plan["kv_dtype"]:
            raise TypeError(f"paged_kv_cache: planned for a {dtype_str(plan['kv_dtype'])} cache, got "
                            f"{dtype_str(cache.k.dtype)}")
        if cache.num_kv_heads != plan["num_kv_heads"] or cache.head_dim != d or cache.page_size != plan["page_size"]:
            raise ValueError(f"paged_kv_cache: expected {plan['num_kv_heads']} kv heads, head_dim {d}, page size "
                             f"{plan['page_size']} ({self._kv_layout}); got {cache.num_kv_heads}, {cache.head_dim}, "
                             f"{cache.page_size}")
        for name, t in (("k_cache", cache.k), ("v_cache", cache.v)):
            if not aligned16(t):
                raise ValueError(f"paged_kv_cache ({name}): pages, tokens and heads must start on 16-byte boundaries")
        if not same_cuda_device((q, cache.k, cache.v)):
            raise ValueError(f"q and paged_kv_cache: expected CUDA tensors on one device, got {q.device}, "
                             f"{cache.k.device}")


@functools.cache
def _empty_f32(device):
    return torch.empty(0, dtype=torch.float32, device=device)


@op_cache
def _decode_op(spec: DecodeSpec, debug: bool):
    return get_module(spec).decode


@functools.cache
def _single_wrapper(device: torch.device, kv_layout: str) -> BatchDecodeWithPagedKVCacheWrapper:
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device=device)
    return BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout)


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
    wrapper = _single_wrapper(q.device, kv_layout)
    dev = q.device
    wrapper.plan(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32, device=dev),
                 torch.tensor([kv_len], dtype=torch.int32), q.shape[0], num_kv_heads, q.shape[1], max(kv_len, 1),
                 pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                 q_data_type=q.dtype, kv_data_type=k.dtype, sm_scale=sm_scale, rope_scale=rope_scale,
                 rope_theta=rope_theta)
    result = wrapper.run(q.unsqueeze(0), (k.unsqueeze(0), v.unsqueeze(0)), q_scale=q_scale, k_scale=k_scale,
                         v_scale=v_scale, return_lse=return_lse)
    if return_lse:
        return result[0].squeeze(0), result[1].squeeze(0)
    return result.squeeze(0)


__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "single_decode_with_kv_cache", "plan_split"]

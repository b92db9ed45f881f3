"""BatchAttention: one mixed batch as an engine holds it (FlashInfer's persistent wrapper's
name and signature), run as POD (docs/pod.md#batchattention).

plan() splits the batch by request: one query token goes to the decode side (the tensor-core
decode block), every other request (chunks of prompts, speculative verification's 2-16
tokens, empty requests) to the prefill side, whose packed (token, query head) rows run short
requests at the decode kernel's speed (docs/prefill.md). Each side gets its own CSR page
table, cut from the batch's without touching the pages. run() launches both sides in one POD
kernel, reading q and writing out / lse in place where each side's rows are one run of the
batch's (decodes first or last, as vLLM and SGLang order them), else through one gather of q
and one scatter of the outputs. A batch of one kind runs that family's own wrapper; a
configuration POD does not take (soft cap, head_dim 192/128) runs the two sides one after
the other. Under prefill_backend "auto" / "fa3", a speculative-decoding step (verification
requests of at most 16 tokens beside chunks, no one-token request) runs as two prefill
launches, the short requests on the mma.sync kernel, the chunks on the Hopper kernel
("split" mode, _SHORT_TOKENS).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..decode.spec import HEAD_DIMS as DECODE_HEAD_DIMS
from ..decode.wrapper import BatchDecodeWithPagedKVCacheWrapper
from ..prefill.wrapper import BatchPrefillWithPagedKVCacheWrapper
from ..pipeline.spec import FP8_DTYPES, dtype_name
from ..runtime import fastcall
from ..runtime.checks import (as_dtype, compiling, dtype_str, expect_bool, expect_choice, expect_heads, remembered,
                              expect_positive_int, host_index,
                              static_inputs)
from ..runtime.page_table import parse_block_tables, unpack_paged_kv_cache
from ..runtime.plan_buffer import PlanBuffer
from .wrapper import BatchPODWithPagedKVCacheWrapper

__all__ = ["BatchAttention", "split_batch", "BatchSplit", "BatchCut", "cut_batch"]

_WORKSPACE_BYTES = 128 << 20  # each of the wrappers' float workspace
# A new BatchAttention's prefill_backend (the POD wrappers' default too: _Pod.prefill_backend)
DEFAULT_PREFILL_BACKEND = "auto"
# A batch without one-token requests whose requests of at most this many tokens (speculative
# verification) sit beside longer ones (chunks of prompts), under prefill_backend "auto" or
# "fa3": the short ones on the mma.sync kernel's packed (token, head) rows, the long ones on
# the Hopper kernel, two launches ("split" mode). One launch holds one kernel and one tile
# size: on the Hopper kernel the short requests' tiles are mostly empty rows, on the mma.sync
# kernel the chunks run at its rate (docs/pod.md, mix 7).
_SHORT_TOKENS = 16


class BatchSplit(NamedTuple):
    """How plan() divides a mixed batch (split_batch)."""

    decode: np.ndarray   # request ids of the decode side, in batch order
    prefill: np.ndarray  # request ids of the prefill side, in batch order
    # rows of q / out: (start, end) of each side's rows where they form one run of the batch's
    # rows, the decode side's and the prefill side's; None: not so (perm then)
    decode_rows: tuple | None
    prefill_rows: tuple | None
    # the batch's rows in side order (the decode side's, then the prefill side's); None when
    # both sides are runs
    perm: np.ndarray | None


def split_batch(qo_indptr: np.ndarray, decode_ok: bool = True, first_side_max: int = 1) -> BatchSplit:
    """Which requests of a batch (qo_indptr [B+1], host) run on which side: one query token on
    the decode side (when decode_ok), everything else on the prefill side; and whether each
    side's rows are one run of the batch's rows (requests without rows, padding, lie on
    either side of a run without breaking it). first_side_max > 1: the first ("decode") side
    takes every request of at most that many tokens (BatchAttention's short side, padding
    included). Pure function (numpy)."""
    qo_indptr = np.asarray(qo_indptr, dtype=np.int64)
    lens = np.diff(qo_indptr)
    if first_side_max > 1:
        is_decode = lens <= first_side_max
    else:
        is_decode = (lens == 1) if decode_ok else np.zeros(len(lens), dtype=bool)
    decode = np.flatnonzero(is_decode)
    prefill = np.flatnonzero(~is_decode)
    total = int(qo_indptr[-1]) if len(qo_indptr) else 0
    row_is_decode = np.repeat(is_decode, lens)  # a side label a row
    nd = int(np.count_nonzero(row_is_decode))  # the decode side's rows
    if nd == 0 or nd == total:  # one side has every row (a side without requests: None)
        return BatchSplit(decode, prefill, (0, nd) if nd else None, (nd, total) if len(prefill) else None, None)
    changes = int(np.count_nonzero(row_is_decode[1:] != row_is_decode[:-1]))
    if changes == 1:  # decodes first or last: both sides are runs of rows
        dr = (0, nd) if row_is_decode[0] else (total - nd, total)
        pr = (nd, total) if row_is_decode[0] else (0, total - nd)
        return BatchSplit(decode, prefill, dr, pr, None)
    rows = [np.arange(qo_indptr[r], qo_indptr[r + 1]) for r in np.concatenate([decode, prefill])]
    perm = np.concatenate(rows)
    return BatchSplit(decode, prefill, None, None, perm)


class BatchCut(NamedTuple):
    """plan()'s cut of a mixed batch into its two sides' host tables (cut_batch in numpy, or
    fij_fastcall's batch_split in C++: the same values)."""

    decodes: int  # requests on each side
    prefills: int
    rows: int  # qo_indptr[-1]
    pages: int  # kv_indptr[-1]
    decode_rows: tuple | None  # BatchSplit's
    prefill_rows: tuple | None
    perm: torch.Tensor | None  # BatchSplit's, int64
    decode: tuple  # (indptr, last_page_len, pages): int32 CPU tensors; pages: _side_table's
    prefill: tuple  # (qo_indptr, indptr, last_page_len, pages)


def _side_table(requests: np.ndarray, kv_indptr: np.ndarray, kv_lens: np.ndarray, page_size: int) -> tuple:
    """A side's CSR page table cut from the batch's, on the host: (indptr, last_page_len,
    pages), int32 tensors; pages: (first, end) of kv_indices where the side's pages are one run
    of them, else their positions (int64; _side_ids gathers them)."""
    pages = kv_indptr[requests + 1] - kv_indptr[requests]
    indptr = np.zeros(len(requests) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    lens = kv_lens[requests]
    last = np.where(pages > 0, lens - (pages - 1) * page_size, 0).astype(np.int32)
    first, end = (int(kv_indptr[requests[0]]), int(kv_indptr[requests[-1] + 1])) if len(requests) else (0, 0)
    if end - first != int(indptr[-1]):
        where = np.concatenate([np.arange(kv_indptr[r], kv_indptr[r + 1]) for r in requests])
        return torch.from_numpy(indptr), torch.from_numpy(last), torch.from_numpy(where)
    return torch.from_numpy(indptr), torch.from_numpy(last), (first, end)


def _side_ids(pages, kv_indices: torch.Tensor) -> torch.Tensor:
    """A side's page ids: a view of kv_indices where they are one run of it ((first, end)),
    else gathered at those positions (int64, host: one small index_select on kv_indices'
    device). Block tables too: their rows (_side_blocks)."""
    if type(pages) is tuple:
        return kv_indices[pages[0]:pages[1]]
    index = pages
    if kv_indices.device.type == "cuda":
        index = index.pin_memory().to(kv_indices.device, non_blocking=True)
    return kv_indices.index_select(0, index)


def _side_blocks(block_tables: torch.Tensor, lens: np.ndarray, requests: np.ndarray) -> dict:
    """A side's page table from the batch's block tables: its requests' rows (a view where
    they are one run of rows, else one index_select on the table's device) and their KV
    lengths (int32, host), as the families' plan() takes them (block_tables=, seq_lens=)."""
    n = len(requests)
    first = int(requests[0]) if n else 0
    run = n == 0 or int(requests[-1]) - first + 1 == n
    rows = _side_ids((first, first + n) if run else torch.from_numpy(requests.astype(np.int64)), block_tables)
    return {"block_tables": rows, "seq_lens": torch.from_numpy(lens[requests].astype(np.int32))}


def cut_batch(qo: np.ndarray, kv: np.ndarray, lens: np.ndarray, page_size: int, decode_ok: bool) -> BatchCut:
    """The two sides' host tables of a batch whose vectors passed plan()'s checks (numpy)."""
    split = split_batch(qo, decode_ok)
    p_qo = np.zeros(len(split.prefill) + 1, dtype=np.int32)
    np.cumsum(np.diff(qo)[split.prefill], out=p_qo[1:])
    perm = None if split.perm is None else torch.from_numpy(split.perm)
    return BatchCut(len(split.decode), len(split.prefill), int(qo[-1]), int(kv[-1]), split.decode_rows,
                    split.prefill_rows, perm, _side_table(split.decode, kv, lens, page_size),
                    (torch.from_numpy(p_qo), *_side_table(split.prefill, kv, lens, page_size)))


def native_cut(qo_indptr, kv_indptr, kv_len_arr, page_size: int, decode_ok: bool) -> BatchCut | None:
    """cut_batch's tables from the tensors as given, in C++ (fij_fastcall batch_split), where
    they are contiguous int32 or int64 CPU tensors whose values pass plan()'s checks; None
    otherwise (plan() then reads them into numpy, checks them and raises its errors)."""
    ext = fastcall.extension()
    if ext is None or type(page_size) is not int:
        return None
    got = ext.batch_split(qo_indptr, kv_indptr, kv_len_arr, page_size, decode_ok)
    return None if got == -1 else BatchCut(*got)


class _LazySplit:
    """split_batch of the batch, made only where an error message names its requests
    (_SideErrors) after a native cut."""

    def __init__(self, qo_indptr, decode_ok: bool):
        self._args = (qo_indptr, decode_ok)

    def __getattr__(self, name):
        qo_indptr, decode_ok = self._args
        return getattr(split_batch(host_index(qo_indptr, "qo_indptr"), decode_ok), name)


class _SideErrors:
    """A side's planner names its own request numbers: say which of the batch's they are
    (a context manager; a class rather than contextlib's generator, which cost plan() 1-2 us)."""

    __slots__ = ("side", "split", "names")

    def __init__(self, side: str, split: BatchSplit, names: tuple = ("decode", "prefill")):
        self.side, self.split, self.names = side, split, names

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is None or not issubclass(kind, ValueError):
            return False

        def ids(a):
            return ", ".join(map(str, a[:8].tolist())) + (", ..." if len(a) > 8 else "")

        split, names = self.split, self.names
        raise ValueError(f"{exc} (planning {self.side}: the {names[0]} side's requests 0, 1, ... are the batch's "
                         f"[{ids(split.decode)}], the {names[1]} side's [{ids(split.prefill)}])") from exc


class _Options(NamedTuple):
    """What plan() makes of its scalar arguments (_options), remembered per argument tuple."""

    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    cap: float  # the soft cap, 0.0 for none
    rope: dict  # in-kernel RoPE / ALiBi: the families' plan() keywords (read only), else {}
    decode_ok: bool  # whether the decode kernels take this configuration


def _options(num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, causal, q_data_type, kv_data_type,
             logits_soft_cap, use_profiler, pos_encoding_mode, rope_scale, rope_theta) -> _Options:
    """plan()'s checks of its scalar arguments (ValueError) and what it makes of them."""
    expect_heads(num_qo_heads, num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, page_size=page_size)
    expect_bool(causal, "causal")
    if use_profiler:
        raise ValueError("use_profiler: FlashInfer's persistent kernel's profiler has no counterpart here; pass False")
    expect_choice(pos_encoding_mode, "pos_encoding_mode", ("NONE", "ROPE_LLAMA", "ALIBI"))
    rope = {} if pos_encoding_mode == "NONE" else dict(pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                                                       rope_theta=rope_theta)
    # (in-kernel RoPE / ALiBi: every request on the prefill kernel; the tensor-core decode block
    # takes neither, and the CUDA-core decode kernel that does made the two sides one after the
    # other slower: H200, 8bb3d5f, mix 2 1197 us against 906, mix 6 2668 against 1917)
    decode_ok = head_dim_qk == head_dim_vo and head_dim_qk in DECODE_HEAD_DIMS and not rope
    q_dtype = as_dtype(q_data_type, "q_data_type", torch.bfloat16)
    kv_dtype = as_dtype(kv_data_type, "kv_data_type", q_dtype)
    return _Options(q_dtype, kv_dtype, 0.0 if logits_soft_cap is None else float(logits_soft_cap), rope, decode_ok)


class _GraphKey(NamedTuple):
    """What a CUDA-graph BatchAttention's first plan fixes for its captured launch."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int
    causal: bool
    sm_scale: float | None
    soft_cap: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    pos_encoding_mode: str
    rope_scale: float | None
    rope_theta: float | None
    csr: bool  # (block tables: False)


class _GraphBatch:
    """A CUDA-graph BatchAttention's fixed state. A captured run() replays one launch form
    over buffers whose addresses the graph holds, so every plan of such a wrapper runs the
    same form, chosen by its configuration alone: "pod" (both sides in one POD launch, either
    side possibly empty), "serial" (a soft cap: the two families' CUDA-graph wrappers one
    after the other) or "prefill" (head_dim 192/128, which no decode kernel takes, or in-kernel
    RoPE / ALiBi: every request on the prefill side, reading q and writing the outputs in
    place). For "pod" and "serial", run() gathers q into the sides' fixed rows (the decode
    side's max_batch_size rows, then the prefill side's max_num_tokens) and gathers the
    outputs back into the batch's order, through two index vectors each plan() ships (one copy): `fwd`, a side
    row's row of the batch; `inv`, a batch row's side row (rows past the plan's tokens: a
    row of zeros no launch writes)."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str, caps: tuple):
        self.workspace, self.kv_layout, self.caps = workspace, kv_layout, caps
        self.mode = self.key = None
        self.pod = self.prefill = self.decode = None
        self.stage = None  # (q, out, lse) of the sides' rows: [B + T (+ 1), ...]
        self.rows = None  # (fwd, inv, the plan buffer's device buffer they view)
        self.buffer = PlanBuffer(workspace.device, True)

    def setup(self, cut: BatchCut, key: _GraphKey, decode_ok: bool, backend: str) -> str:
        """The launch form of this plan: at the first plan the wrappers and buffers (sized by
        the capacities given, else this plan's), at later ones the checks that the plan fits
        them (ValueError)."""
        batch = cut.decodes + cut.prefills
        if self.mode is None:
            caps = tuple(max(1, c if c is not None else n) for c, n in zip(self.caps, (batch, cut.rows, cut.pages)))
            self.caps = caps
            self.mode = "prefill" if not decode_ok else "serial" if key.soft_cap > 0 else "pod"
            self._make(caps, key, backend)
            self.key = key
        elif key != self.key:
            raise ValueError("a CUDA-graph BatchAttention keeps its first plan()'s heads, head dims, page size, "
                             "causal, sm_scale, logits_soft_cap, dtypes and page-table layout (its captured launch "
                             "was recorded for them); make another wrapper for another configuration")
        b, t, p = self.caps
        if batch > b:
            raise ValueError(f"qo_indptr: {batch} requests exceed this CUDA-graph BatchAttention's max_batch_size {b}")
        if cut.rows > t:
            raise ValueError(f"qo_indptr: {cut.rows} query tokens exceed this CUDA-graph BatchAttention's "
                             f"max_num_tokens {t}")
        if key.csr and cut.pages > p:
            raise ValueError(f"kv_indptr: {cut.pages} page ids exceed this CUDA-graph BatchAttention's max_num_pages "
                             f"{p}")
        return self.mode

    def _make(self, caps: tuple, key: _GraphKey, backend: str) -> None:
        b, t, p = caps
        hq, dqk, dvo = key.num_qo_heads, key.head_dim_qk, key.head_dim_vo
        dev = self.workspace.device

        def ids(n):
            return torch.zeros(n, dtype=torch.int32, device=dev)

        if self.mode == "pod":
            self.pod = BatchPODWithPagedKVCacheWrapper(self.workspace, self.kv_layout, True, ids(b + 1), ids(b + 1),
                                                       ids(p), ids(b), ids(b + 1), ids(p), ids(b))
            self.pod.prefill_backend = backend
        else:
            self.prefill = BatchPrefillWithPagedKVCacheWrapper(self.workspace, self.kv_layout, True, ids(b + 1),
                                                               ids(b + 1), ids(p), ids(b), backend=backend)
            if self.mode == "serial":
                self.decode = BatchDecodeWithPagedKVCacheWrapper(
                    torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=dev), self.kv_layout, True, True,
                    ids(b + 1), ids(p), ids(b))
        if self.mode != "prefill":
            self.stage = (torch.empty((b + t, hq, dqk), dtype=key.q_dtype, device=dev),
                          torch.zeros((b + t + 1, hq, dvo), dtype=key.q_dtype, device=dev),
                          torch.zeros((b + t + 1, hq), dtype=torch.float32, device=dev))

    def ship_rows(self, qo: np.ndarray, decode: np.ndarray) -> None:
        """fwd and inv of a batch (qo_indptr on the host) whose decode side holds the requests
        `decode` (split_batch's), in one copy to the fixed device buffer."""
        b, t, _ = self.caps
        lens = np.diff(qo)
        decode_rows = qo[decode]
        on_decode = np.zeros(len(lens), dtype=bool)
        on_decode[decode] = True
        prefill_rows = np.flatnonzero(~np.repeat(on_decode, lens))
        slot = self.buffer.host(b + 2 * t)
        fwd, inv = slot.array[:b + t], slot.array[b + t:b + 2 * t]
        fwd.fill(0)
        inv.fill(b + t)
        fwd[:len(decode_rows)] = decode_rows
        fwd[b:b + len(prefill_rows)] = prefill_rows
        inv[decode_rows] = np.arange(len(decode_rows))
        inv[prefill_rows] = b + np.arange(len(prefill_rows))
        self.buffer.ship(slot, b + 2 * t, True)
        buf = self.buffer.buf
        if self.rows is None or self.rows[2] is not buf:
            self.rows = (buf[:b + t], buf[b + t:b + 2 * t], buf)


class BatchAttention:
    """FlashInfer's BatchAttention: one batch of requests of any lengths (decodes, chunks of
    prompts, speculative verification) over one paged KV cache, one q and one output.

    plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, ...): kv_indptr / kv_indices are a CSR
    page table, kv_len_arr [B] each request's keys in tokens. Index tensors may be int32 or
    int64; on the host, plan() reads them without any device synchronization (on the device:
    one blocking copy of qo_indptr, kv_indptr and kv_len_arr, which any planner must read).
    run(q, kv_cache) returns (out, lse): out [tokens, num_qo_heads, head_dim_vo] in q's dtype,
    lse [tokens, num_qo_heads] float32, base 2 (FlashInfer's convention), written in place
    into `out` / `lse` where given."""

    def __init__(self, kv_layout: str = "NHD", device="cuda", use_cuda_graph: bool = False, *,
                 max_batch_size=None, max_num_tokens=None, max_num_pages=None):
        """use_cuda_graph (not in FlashInfer's): run() may be captured in a CUDA graph and
        replayed after later plans of other batches (docs/pod.md#cuda-graphs-of-a-mixed-batch).
        Such a wrapper holds at most max_batch_size requests, max_num_tokens query rows and
        max_num_pages page ids a plan (block tables: rows of the first plan's width); each
        not given is the first plan()'s."""
        expect_choice(kv_layout, "kv_layout", ("NHD", "HND"))
        expect_bool(use_cuda_graph, "use_cuda_graph")
        caps = {"max_batch_size": max_batch_size, "max_num_tokens": max_num_tokens, "max_num_pages": max_num_pages}
        for name, value in caps.items():
            if value is not None:
                if not use_cuda_graph:
                    raise ValueError(f"{name}: a capacity of a CUDA-graph wrapper; pass use_cuda_graph=True or leave "
                                     "it None")
                expect_positive_int(value, name)
        self._device = torch.device(device)
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        ws = [torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self._device)
              for _ in range(1 if use_cuda_graph else 3)]
        self._device = ws[0].device  # ("cuda" made an index: what q and the outputs are compared with)
        if use_cuda_graph:  # (the wrappers, sized at the first plan(): _GraphBatch)
            self._graph = _GraphBatch(ws[0], kv_layout, tuple(caps.values()))
            self._pod = self._prefill = self._decode = None
        else:
            self._graph = None
            self._pod = BatchPODWithPagedKVCacheWrapper(ws[0], kv_layout)
            self._pod._prepares_first_run = False  # (plan() prepares run()'s launch for its rows: _prepare_run)
            self._prefill = BatchPrefillWithPagedKVCacheWrapper(ws[1], kv_layout, backend="fa2")
            self._decode = BatchDecodeWithPagedKVCacheWrapper(ws[2], kv_layout, use_tensor_cores=True)
        self.prefill_backend = DEFAULT_PREFILL_BACKEND  # (its setter passes it to the wrappers)
        self._long = None  # "split" mode's Hopper prefill of the long requests (at its first use)
        self._planned = None
        self._configs = {}  # plan()'s scalar arguments -> _Options (remembered)
        self._pod_options = None  # the _Options of the last plan() that ran POD through the CSR table (_plan_pod)

    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def prefill_backend(self) -> str:
        """The prefill side's kernel (BatchPODWithPagedKVCacheWrapper.prefill_backend): "fa2", or
        "auto" (the default, DEFAULT_PREFILL_BACKEND): POD on Hopper for a mixed batch whose
        prefill side plans the Hopper kernel, and the Hopper kernel for a batch without decodes
        (elsewhere the mma.sync kernels, as "fa2"); "fa3": POD on Hopper or a ValueError naming
        why not. Set it before plan() (BatchPODWithPagedKVCacheWrapper's
        prefill_backend says what POD on Hopper does not take yet)."""
        return self._backend

    @prefill_backend.setter
    def prefill_backend(self, value: str) -> None:
        expect_choice(value, "prefill_backend", ("fa2", "auto", "fa3"))
        if self._graph is not None and self._graph.mode is not None and value != self._backend:
            raise ValueError("prefill_backend: a CUDA-graph BatchAttention keeps the kernel of its first plan(); set "
                             "it before that plan")
        self._backend = value
        if self._graph is None:
            self._pod.prefill_backend = value
            self._prefill._backend = value

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, head_dim_vo: int, page_size: int, causal: bool = False, sm_scale=None,
             logits_soft_cap=None, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
             use_profiler: bool = False, *, block_tables=None, pos_encoding_mode: str = "NONE", rope_scale=None,
             rope_theta=None) -> None:
        """block_tables (keyword, not in FlashInfer): the batch's page table as block tables,
        vLLM's [B, max_pages] or TensorRT-LLM's [B, 2, max_pages] (K and V page ids), with
        kv_len_arr each request's keys, in place of kv_indptr / kv_indices (None). Each side
        gets the rows of its requests (a view where they are one run of the table's rows).

        pos_encoding_mode (keyword, not in FlashInfer's BatchAttention): "ROPE_LLAMA" rotates q
        and K in the kernel (rope_scale, rope_theta: the prefill wrapper's defaults 1 and 1e4),
        "ALIBI" adds FlashInfer's linear bias. Every request then runs on the prefill side, one
        launch of the prefill kernel, which takes either in-kernel (the tensor-core decode block
        POD runs takes neither)."""
        # (the scalar arguments' checks, remembered: an engine plans with the same ones every step)
        options = remembered(
            self._configs, (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, causal, q_data_type,
                            kv_data_type, logits_soft_cap, use_profiler, pos_encoding_mode, rope_scale, rope_theta),
            _options)
        cut = None  # (native_cut's, where the short path made it: plan() below takes it too)
        fp8_serial = None  # (serial mode for an fp8 cache on sm_90: _fp8_serial)
        if options is self._pod_options and block_tables is None:
            # (_pod_options is a POD step's: decodes taken, so the cuts below are the same one)
            if self._plan_pod_again(options, qo_indptr, kv_indptr, kv_len_arr, kv_indices, num_qo_heads,
                                    num_kv_heads, head_dim_qk, head_dim_vo, page_size, causal, sm_scale):
                return
            cut = native_cut(qo_indptr, kv_indptr, kv_len_arr, page_size, True)
            if self._plan_pod(options, cut, qo_indptr, kv_indices, num_qo_heads, num_kv_heads, head_dim_qk,
                              head_dim_vo, page_size, causal, sm_scale):
                return
        self._pod_options = None
        q_dtype, kv_dtype, cap, rope, decode_ok = options
        if block_tables is not None:  # (the cut below reads each request's page count)
            if kv_indptr is not None or kv_indices is not None:
                raise ValueError("block_tables: pass kv_indptr and kv_indices as None with block tables (kv_len_arr "
                                 "gives each request's keys)")
            lens = host_index(kv_len_arr, "kv_len_arr")
            qo_rows = qo_indptr.shape[0] if isinstance(qo_indptr, torch.Tensor) else len(qo_indptr)
            if isinstance(block_tables, torch.Tensor) and block_tables.dim() in (2, 3) and \
                    (len(lens) != block_tables.shape[0] or qo_rows != len(lens) + 1):
                raise ValueError(f"kv_len_arr and qo_indptr: expected {block_tables.shape[0]} lengths and "
                                 f"{block_tables.shape[0] + 1} offsets (block_tables has {block_tables.shape[0]} "
                                 f"rows), got {len(lens)} and {qo_rows}")
            _, block_tables = parse_block_tables(block_tables, kv_len_arr)
            pages = -(-lens // page_size)
            if len(pages) and int(pages.max()) > block_tables.shape[-1]:
                r = int(np.argmax(pages))
                raise ValueError(f"kv_len_arr[{r}] = {int(lens[r])} needs {int(pages[r])} pages of {page_size} tokens; "
                                 f"block_tables holds {block_tables.shape[-1]} a request")
            kv_indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(pages)]).astype(np.int32))
        if cut is None:
            cut = native_cut(qo_indptr, kv_indptr, kv_len_arr, page_size, decode_ok)
        split = _LazySplit(qo_indptr, decode_ok)
        if cut is None:
            cut, split = self._cut_numpy(qo_indptr, kv_indptr, kv_len_arr, page_size, decode_ok)
        if block_tables is None:
            if not isinstance(kv_indices, torch.Tensor) or kv_indices.dim() != 1:
                raise ValueError("kv_indices: expected a 1-D int32 tensor of page ids")
            if kv_indices.numel() < cut.pages:
                raise ValueError(f"kv_indices: {kv_indices.numel()} page ids, fewer than kv_indptr[-1] = {cut.pages}")
            if kv_indices.dtype != torch.int32:
                kv_indices = kv_indices.to(torch.int32)
        if self._graph is not None:  # one launch form for every plan: the captured one
            key = _GraphKey(num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, causal, sm_scale, cap,
                            q_dtype, kv_dtype, pos_encoding_mode, rope_scale, rope_theta, block_tables is None)
            mode = self._graph.setup(cut, key, decode_ok, self._backend)
            self._pod, self._prefill, self._decode = self._graph.pod, self._graph.prefill, self._graph.decode
        elif cut.decodes == 0:
            mode = "prefill"
        elif cut.decode_rows == (0, cut.rows):  # every row a decode's (the rest: requests without rows)
            mode = "decode"
        elif cap > 0:
            mode = "serial"  # POD runs no soft cap; the families do
        elif self._fp8_serial(kv_dtype):
            mode = fp8_serial = "serial"  # (back to "pod" below unless the prefill side plans the Hopper kernel)
        else:
            mode = "pod"
        heads = (num_qo_heads, num_kv_heads)
        if mode == "prefill" and self._backend != "fa2" and block_tables is None and self._graph is None:
            options = dict(head_dim_vo=head_dim_vo, causal=causal, sm_scale=sm_scale, logits_soft_cap=cap or None,
                           q_data_type=q_dtype, kv_data_type=kv_dtype, **rope)
            short_long = self._plan_short_long(qo_indptr, kv_indptr, kv_indices, kv_len_arr, heads, head_dim_qk,
                                               page_size, options)
            if short_long is not None:
                split, short_rows = short_long
                perm = None if split.perm is None else self._device_perm(torch.from_numpy(split.perm))
                self._planned = ("split", None, perm, cut.rows, num_qo_heads, head_dim_qk, head_dim_vo, q_dtype, cap,
                                 causal, short_rows, split.decode_rows, split.prefill_rows)
                return
        d_indptr, d_last, d_pages = cut.decode
        p_qo, p_indptr, p_last, p_pages = cut.prefill
        if block_tables is None:
            p_table = (p_indptr, _side_ids(p_pages, kv_indices), p_last) if mode != "decode" else None
            d_table = (d_indptr, _side_ids(d_pages, kv_indices), d_last) if mode != "prefill" else None
            p_blocks = d_blocks = pod_blocks = {}
        else:  # each side's rows of the block table and its lengths (the CSR arguments None)
            p_table = d_table = (None, None, None)
            p_blocks = _side_blocks(block_tables, lens, split.prefill) if mode != "decode" else {}
            d_blocks = _side_blocks(block_tables, lens, split.decode) if mode != "prefill" else {}
            pod_blocks = {f"{k}_{side}": v for side, b in (("p", p_blocks), ("d", d_blocks)) for k, v in b.items()}
        if mode == "prefill":  # the whole batch: the prefill side takes every request
            self._prefill.plan(p_qo, *p_table, *heads, head_dim_qk, page_size, head_dim_vo=head_dim_vo, causal=causal,
                               sm_scale=sm_scale, logits_soft_cap=cap or None, q_data_type=q_dtype,
                               kv_data_type=kv_dtype, **p_blocks, **rope)
        elif mode == "serial":  # (the prefill side first: an fp8 cache's serial mode rests on its kernel)
            with _SideErrors("the prefill side", split):
                self._prefill.plan(p_qo, *p_table, *heads, head_dim_qk, page_size, head_dim_vo=head_dim_vo,
                                   causal=causal, sm_scale=sm_scale, logits_soft_cap=cap or None,
                                   q_data_type=q_dtype, kv_data_type=kv_dtype, **p_blocks)
            if fp8_serial and self._prefill.planned_backend != "fa3":
                mode = "pod"  # (the prefill side runs the mma.sync kernel: POD's place)
        if mode in ("serial", "decode"):
            with _SideErrors("the decode side", split):
                self._decode.plan(*d_table, *heads, head_dim_qk, page_size, logits_soft_cap=cap or None,
                                  q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=sm_scale, **d_blocks)
        if mode == "pod":
            with _SideErrors("both sides", split):
                self._pod.plan(p_qo, *p_table, None, *d_table, *heads, head_dim_qk, page_size,
                               q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=sm_scale, causal=causal,
                               **pod_blocks)
        if self._graph is not None:  # each row's place in the fixed buffers of the sides' rows
            if mode != "prefill":
                self._graph.ship_rows(host_index(qo_indptr, "qo_indptr"), split.decode)
            cut = cut._replace(perm=None)
        perm = None if cut.perm is None else self._device_perm(cut.perm)
        self._set_planned(mode, cut, perm, num_qo_heads, head_dim_qk, head_dim_vo, q_dtype, cap, causal)
        if mode == "pod" and self._graph is None:
            self._prepare_run(cut)
        if mode == "pod" and block_tables is None and self._graph is None and not fp8_serial:
            self._pod_options = options  # (an fp8 cache on sm_90 plans in full each time: _fp8_serial)

    def _fp8_serial(self, kv_dtype: torch.dtype) -> bool:
        """Whether an eager plan() under prefill_backend "auto" runs the two sides one after the
        other for POD's sake: an fp8 cache on an sm_90 GPU. POD on Hopper reads no fp8 cache, and
        there the Hopper prefill (over a copy of the batch's pages, widened) then the decode took
        0.64-0.82x the mma.sync POD's time on the four e4m3 rows of scripts/bench_pod.py (H200,
        2026-11-30, docs/pod.md). plan() goes back to POD where the prefill side does not plan
        the Hopper kernel (auto's rule: short chunks)."""
        from ..prefill import sm90

        return self._backend == "auto" and dtype_name(kv_dtype) in FP8_DTYPES and sm90.arch_error(self._device) is None

    def _plan_pod_again(self, options: _Options, qo_indptr, kv_indptr, kv_len_arr, kv_indices, num_qo_heads: int,
                        num_kv_heads: int, head_dim_qk: int, head_dim_vo: int, page_size: int, causal: bool,
                        sm_scale) -> bool:
        """plan() of a POD step after a POD step of the same scalar arguments (an engine's every
        step), where the batch is of POD's common form (fij_fastcall pod_cut: the cut, each
        side's page ids a view of kv_indices and both sides' work, in one C++ call) and the POD
        wrapper has the recipe of its last plan(): that plan() again (_Pod._plan_again, the
        recipe's _replan), without the cut's tensors, the page ids' slices and the work's sums
        made again in Python. False, having changed nothing, otherwise: _plan_pod, then the full
        plan()."""
        ext = fastcall.extension()
        if ext is None or type(page_size) is not int:
            return False
        got = ext.pod_cut(qo_indptr, kv_indptr, kv_len_arr, page_size, kv_indices)
        if type(got) is not tuple:
            return False
        cut = BatchCut(*got[:9])
        (d_indptr, d_last, _), (p_qo, p_indptr, p_last, _) = cut.decode, cut.prefill
        pod = self._pod
        # (the key plan() makes of _plan_pod's call below: its defaults past the dtypes)
        key = pod._plan_key(num_qo_heads, num_kv_heads, head_dim_qk, page_size, "NONE", -1, options.q_dtype,
                            options.kv_dtype, None, sm_scale, None, None, True, causal)
        if not pod._plan_again(key, got[11], p_qo, p_indptr, got[10], p_last, d_indptr, got[9], d_last):
            return False
        self._set_planned("pod", cut, None, num_qo_heads, head_dim_qk, head_dim_vo, options.q_dtype, options.cap,
                          causal)
        self._prepare_run(cut)
        return True

    def _set_planned(self, mode: str, cut: BatchCut, perm, num_qo_heads: int, head_dim_qk: int, head_dim_vo: int,
                     q_dtype, cap, causal: bool) -> None:
        """What run() reads of the plan (as plain ints, the decode side's requests and each
        side's run of rows: Dynamo traces run() under torch.compile)."""
        self._planned = (mode, cut, perm, cut.rows, num_qo_heads, head_dim_qk, head_dim_vo, q_dtype, cap, causal,
                         cut.decodes, cut.decode_rows, cut.prefill_rows)

    def _prepare_run(self, cut: BatchCut) -> None:
        """After a POD plan() that kept run()'s record: the next run()'s launch resolved now for
        q of the batch's rows, each side on its run of them (_Pod._prepare_first_run)."""
        pod = self._pod
        if pod._replan_bounds is not None and cut.perm is None and cut.decode_rows is not None and \
                cut.prefill_rows is not None:
            (d0, d1), (p0, p1) = cut.decode_rows, cut.prefill_rows
            pod._prepare_first_run((cut.rows, cut.rows), (p0, d0), (p1 - p0, d1 - d0))

    def _plan_pod(self, options: _Options, cut: BatchCut | None, qo_indptr, kv_indices, num_qo_heads: int,
                  num_kv_heads: int, head_dim_qk: int, head_dim_vo: int, page_size: int, causal: bool,
                  sm_scale) -> bool:
        """plan() of a batch whose scalar arguments are those of the last plan(), which ran
        POD through the CSR table (an engine's every step): where this batch is of plan()'s
        common form again (native_cut's vectors, decodes beside other requests, each side's
        rows one run of the batch's, kv_indices an int32 vector of the pages), the POD
        wrapper's plan() of the two sides (which repeats its own recipe, _Pod._replan) without
        the mode's decisions; False (nothing changed) otherwise: plan() then plans in full.
        cut: native_cut of the batch (decodes taken), or None."""
        if cut is None or cut.decodes == 0 or cut.perm is not None or cut.decode_rows == (0, cut.rows) or \
                type(kv_indices) is not torch.Tensor or kv_indices.dtype is not torch.int32 or \
                kv_indices.dim() != 1 or kv_indices.shape[0] < cut.pages:
            return False
        (d_indptr, d_last, d_pages), (p_qo, p_indptr, p_last, p_pages) = cut.decode, cut.prefill
        with _SideErrors("both sides", _LazySplit(qo_indptr, True)):
            self._pod.plan(p_qo, p_indptr, _side_ids(p_pages, kv_indices), p_last, None, d_indptr,
                           _side_ids(d_pages, kv_indices), d_last, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
                           q_data_type=options.q_dtype, kv_data_type=options.kv_dtype, sm_scale=sm_scale, causal=causal)
        self._set_planned("pod", cut, None, num_qo_heads, head_dim_qk, head_dim_vo, options.q_dtype, options.cap,
                          causal)
        self._prepare_run(cut)
        return True

    def _device_perm(self, perm: torch.Tensor) -> torch.Tensor:
        """A plan's row permutation (int64, host) on the wrapper's device, marked a static input
        (read by a run() that torch.compile traces: see runtime.checks)."""
        if self._device.type == "cuda":
            perm = perm.pin_memory().to(self._device, non_blocking=True)
        static_inputs(perm)
        return perm

    def _plan_short_long(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, heads: tuple, head_dim_qk: int,
                         page_size: int, options: dict) -> tuple | None:
        """"split" mode's plans (_SHORT_TOKENS): the requests of at most _SHORT_TOKENS tokens on
        self._prefill's mma.sync kernel, the longer ones on the Hopper kernel (self._long,
        prefill_backend's choice); (split_batch's split, the short side's rows), or None where
        the batch has not both kinds with rows or the Hopper kernel does not take the long
        ones (plan() then runs the batch as one prefill launch). After plan()'s checks of the
        vectors."""
        qo = host_index(qo_indptr, "qo_indptr")
        q_lens = np.diff(qo)
        short = q_lens <= _SHORT_TOKENS
        if short.all() or not (q_lens[short] > 0).any():
            return None
        kv, lens = host_index(kv_indptr, "kv_indptr"), host_index(kv_len_arr, "kv_len_arr")
        split = split_batch(qo, first_side_max=_SHORT_TOKENS)

        def side_table(requests: np.ndarray) -> tuple:
            side_qo = np.zeros(len(requests) + 1, dtype=np.int32)
            np.cumsum(q_lens[requests], out=side_qo[1:])
            indptr, last, pages = _side_table(requests, kv, lens, page_size)
            return torch.from_numpy(side_qo), indptr, _side_ids(pages, kv_indices), last

        if self._long is None:
            self._long = BatchPrefillWithPagedKVCacheWrapper(
                torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self._device), self._kv_layout)
        self._long._backend = self._backend
        names = ("short", "long")
        with _SideErrors("the long side", split, names):
            self._long.plan(*side_table(split.prefill), *heads, head_dim_qk, page_size, **options)
        if self._long.planned_backend != "fa3":
            return None
        backend, self._prefill._backend = self._prefill._backend, "fa2"  # (the packed rows' kernel)
        try:
            with _SideErrors("the short side", split, names):
                self._prefill.plan(*side_table(split.decode), *heads, head_dim_qk, page_size, **options)
        finally:
            self._prefill._backend = backend
        return split, int(q_lens[short].sum())

    @staticmethod
    def _cut_numpy(qo_indptr, kv_indptr, kv_len_arr, page_size: int, decode_ok: bool) -> tuple:
        """(cut_batch's tables, split_batch's split) of the vectors read into numpy, after
        plan()'s checks of them (ValueError)."""
        qo = host_index(qo_indptr, "qo_indptr")
        kv = host_index(kv_indptr, "kv_indptr")
        lens = host_index(kv_len_arr, "kv_len_arr")
        batch = len(lens)
        if len(qo) != batch + 1 or len(kv) != batch + 1:
            raise ValueError(f"qo_indptr and kv_indptr: expected {batch + 1} entries (kv_len_arr has {batch}), got "
                             f"{len(qo)} and {len(kv)}")
        if qo[0] != 0 or (np.diff(qo) < 0).any() or kv[0] != 0 or (np.diff(kv) < 0).any():
            raise ValueError("qo_indptr and kv_indptr: expected non-decreasing offsets from 0")
        pages = np.diff(kv)
        bad = np.flatnonzero((lens > pages * page_size) | ((pages > 0) & (lens <= (pages - 1) * page_size)) |
                             ((pages == 0) & (lens != 0)))
        if len(bad):
            r = int(bad[0])
            raise ValueError(f"kv_len_arr[{r}] = {int(lens[r])} does not fit request {r}'s {int(pages[r])} pages of "
                             f"{page_size} tokens")
        cut = cut_batch(qo, kv, lens, page_size, decode_ok)
        return cut, split_batch(qo, decode_ok)

    begin_forward = plan

    def run(self, q, kv_cache, out=None, lse=None, k_scale=None, v_scale=None, logits_soft_cap: float = 0.0,
            profiler_buffer=None, kv_cache_sf=None) -> tuple:
        if self._planned is None:
            raise RuntimeError("run() before plan(): call plan() with this batch first")
        mode, _, perm, tokens, hq, dqk, dvo, q_dtype, cap, causal, nd, decode_rows, prefill_rows = self._planned
        # (recorded by this wrapper's run(): its POD wrapper is its own)
        quick = self._pod._quick if self._graph is None else None
        if quick is not None and mode == "pod" and perm is None and not compiling() and k_scale is None and \
                v_scale is None and not logits_soft_cap and kv_cache_sf is None:
            # The common form of a recorded launch: fij_fastcall checks q, the cache and out /
            # lse as given against its signature in C++ and launches both sides on their rows
            # (None: not of it; the checks and the op below)
            (d0, d1), (p0, p1) = decode_rows, prefill_rows
            got = self._pod._quick_run(quick, q, kv_cache, q, kv_cache, out, out, lse, lse, p0, d0, 3, None,
                                       (p1 - p0, d1 - d0), (tokens, tokens, tokens, tokens))
            if got is not None:
                return got[0], got[2]
        out_given, lse_given = out, lse
        if kv_cache_sf is not None:
            raise ValueError("kv_cache_sf: NVFP4 K/V caches are not supported (expected None)")
        if logits_soft_cap and float(logits_soft_cap) != cap:
            raise ValueError(f"logits_soft_cap: run() got {logits_soft_cap}, plan() was given {cap or None}; the soft "
                             "cap is a plan() value")
        rows, expected = tokens, f"[{tokens}, {hq}, {dqk}] (qo_indptr[-1], num_qo_heads, head_dim_qk)"
        if self._graph is not None:  # (a captured q keeps its rows: at least the plan's, at most the capacity)
            cap_rows = self._graph.caps[1]
            rows = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 and \
                tokens <= q.shape[0] <= cap_rows else -1
            expected = f"[rows, {hq}, {dqk}] with qo_indptr[-1] = {tokens} <= rows <= max_num_tokens = {cap_rows}"
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] != rows or q.shape[1] != hq or \
                q.shape[2] != dqk:
            raise ValueError(f"q: expected {expected}, got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        if q.dtype != q_dtype:
            raise ValueError(f"q: planned for {dtype_str(q_dtype)}, got {dtype_str(q.dtype)}")
        if q.device != self._device:
            raise ValueError(f"q: on {q.device}, but the wrapper (its workspace and plan) is on {self._device}")
        if out is None:
            out = torch.empty((rows, hq, dvo), dtype=q.dtype, device=q.device)
        elif not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows, hq, dvo) or out.dtype != q.dtype or \
                out.device != q.device or out.stride(-1) != 1:
            raise ValueError(f"out: expected {dtype_str(q.dtype)} [{rows}, {hq}, {dvo}] on {q.device} with a "
                             "contiguous last dimension")
        if lse is None:
            lse = torch.empty((rows, hq), dtype=torch.float32, device=q.device)
        elif not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (rows, hq) or lse.dtype != torch.float32 \
                or not lse.is_contiguous() or lse.device != q.device:
            raise ValueError(f"lse: expected a contiguous float32 [{rows}, {hq}] tensor on {q.device}")
        if self._graph is not None and mode != "prefill":
            self._run_graph(mode, q, kv_cache, out, lse, k_scale, v_scale)
            return out, lse
        if mode == "prefill":
            self._prefill.run(q, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse)
            return out, lse
        if mode == "decode":
            self._decode.run(q, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse)
            return out, lse
        if perm is not None:  # the sides' rows interleave: run them gathered, scatter the outputs back
            qq = q.index_select(0, perm)
            oo = torch.empty((tokens, hq, dvo), dtype=q.dtype, device=q.device)
            ll = torch.empty((tokens, hq), dtype=torch.float32, device=q.device)
            self._run_sides(mode, qq[nd:], qq[:nd], kv_cache, oo[nd:], ll[nd:], oo[:nd], ll[:nd], k_scale, v_scale)
            out.index_copy_(0, perm, oo)
            lse.index_copy_(0, perm, ll)
            return out, lse
        (d0, d1), (p0, p1) = decode_rows, prefill_rows
        if (out_given is not None or lse_given is not None) and mode == "pod" and compiling():
            # the caller's out / lse are graph inputs: the two sides' rows as two mutated views
            # of one input can become a synthetic base, copied whole; the op writes a fresh pair
            o, l = self.run(q, kv_cache, None, None, k_scale, v_scale, logits_soft_cap)
            return out.copy_(o), lse.copy_(l)
        # (the fast path's record: q, the cache, out and lse as given, each side from its rows)
        record = (q, kv_cache, q, kv_cache, out_given, out_given, lse_given, lse_given, p0, d0, 3) \
            if k_scale is None and v_scale is None else None
        self._run_sides(mode, q[p0:p1], q[d0:d1], kv_cache, out[p0:p1], lse[p0:p1], out[d0:d1], lse[d0:d1], k_scale,
                        v_scale, record)
        return out, lse

    forward = run

    def _run_graph(self, mode: str, q, kv_cache, out, lse, k_scale, v_scale) -> None:
        """A CUDA-graph wrapper's run of both sides (_GraphBatch): q gathered into the sides'
        fixed rows, both sides launched there, the outputs gathered back in the batch's order
        (rows past the plan's: zeros)."""
        g = self._graph
        b, t, _ = g.caps
        fwd, inv, _ = g.rows
        qs, os_, ls = g.stage
        n = q.shape[0]
        if n == 0:
            return
        torch.index_select(q, 0, fwd, out=qs)
        self._run_sides(mode, qs[b:], qs[:b], kv_cache, os_[b:b + t], ls[b:b + t], os_[:b], ls[:b], k_scale, v_scale)
        for dst, src in ((out, os_), (lse, ls)):
            if dst.is_contiguous():
                torch.index_select(src, 0, inv[:n], out=dst)
            else:
                dst.copy_(src.index_select(0, inv[:n]))

    def _run_sides(self, mode, q_p, q_d, kv_cache, out_p, lse_p, out_d, lse_d, k_scale, v_scale,
                   record=None) -> None:
        if mode == "pod":
            if type(kv_cache) is tuple and len(kv_cache) == 2:
                kv = kv_cache
            else:
                k, v, _ = unpack_paged_kv_cache(kv_cache, self._kv_layout)
                kv = (k, v)
            self._pod._run_into(q_p, kv, q_d, kv, None, k_scale, v_scale, True, None, out_p, lse_p, out_d, lse_d,
                                record=record)
        elif mode == "split":  # the long requests on the Hopper kernel, then the short ones
            self._long.run(q_p, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out_p, lse=lse_p)
            self._prefill.run(q_d, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out_d, lse=lse_d)
        else:  # serial: the prefill side, then the decode side
            self._prefill.run(q_p, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out_p, lse=lse_p)
            self._decode.run(q_d, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out_d, lse=lse_d)

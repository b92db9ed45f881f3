"""Page order: a wrapper's copy of its page table with each request's movable pages in
ascending page-id order (csrc/runtime/page_order.cuh), written on the device by one call per
plan() and read by every run(). Batch decode and batch prefill call it; for batch prefill the
same call then writes each work pair's first page ids into the pair (fill_pair_ids_kernel).

The H100 streams a request's pages faster in ascending address order than in a random one
(about 3% for one 32k-token request, docs/decode.md). Attention is the same over any order
of the pages every query row sees whole, where no term depends on a key's position (no RoPE
in the kernel, no window, no custom mask): decode's full pages (the last, which may be
partial, stays last) and, for a causal prefill, the pages of keys j <= kv_len - qo_len. The
caller decides whether its configuration may reorder; this module writes the copy."""
from __future__ import annotations

import ctypes
import functools

import torch

from ..pipeline.jit import op_cache
from . import fastcall
from .capacity import grown_size
from .device import raw_stream
from .native import ctypes_entry, optional_entry
from .shared_specs import PageOrderSpec

__all__ = ["PageOrderParams", "PageOrder", "launch_pending", "page_orderer", "shipper"]


class PageOrderParams(ctypes.Structure):
    """csrc/runtime/page_order.cuh PageOrderParams (same fields, same order; the module reports its
    size, checked at load)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("indptr", "seq_lens", "src", "dst")] + \
        [(name, ctypes.c_int64) for name in ("src_row", "dst_row", "src_v", "dst_v", "row_pages", "longest_pages")] + \
        [(name, ctypes.c_void_p) for name in ("qo_indptr", "last_page_len")] + \
        [(name, ctypes.c_int32) for name in ("page_size", "batch", "sort")] + \
        [("pairs", ctypes.c_void_p)] + \
        [(name, ctypes.c_int32) for name in ("num_pairs", "pair_ints", "pair_ids_at", "pair_ids")]


@op_cache
def page_orderer():
    """(<namespace>_order_pages, <namespace>_error_string, <namespace>_order_pages_pair) of
    the PageOrderSpec module (through fij_fastcall where it loads, else ctypes), built or loaded at the first plan() that reorders pages; None with a
    warning where it cannot be had: plan() then keeps the pages as given (same results,
    slower reads)."""
    def load():
        fn = ctypes_entry(PageOrderSpec(), "order_pages", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_int,
                          PageOrderParams, "params_bytes")
        pair = ctypes_entry(PageOrderSpec(), "order_pages_pair", [ctypes.c_void_p] * 3 + [ctypes.c_int], ctypes.c_int)
        # (through fij_fastcall: ~1 us of ctypes' conversions less a plan; fn itself without it)
        return (fastcall.bind("order_pages", fn),
                ctypes_entry(PageOrderSpec(), "error_string", [ctypes.c_int], ctypes.c_char_p),
                fastcall.bind("order_pages_pair", pair))

    return optional_entry(load, "plan() keeps each request's pages as given",
                          f"the page-order module {PageOrderSpec().name}")


@op_cache
def shipper():
    """The same module's plan-buffer entries (runtime/plan_buffer.py): (ship(dst, src, bytes,
    stream, device, event) through fij_fastcall, event_create(device, out), event_query,
    event_synchronize, event_destroy, error_string) through ctypes; None with a warning where the
    module cannot be had: plan buffers then copy with torch (the same copy, ~6 us more host
    time a plan() on the GPU host)."""
    def load():
        entry = functools.partial(ctypes_entry, PageOrderSpec())
        ship = entry("ship", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int,
                              ctypes.c_void_p], ctypes.c_int)
        return (fastcall.bind("ship", ship), entry("event_create", [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)],
                                                   ctypes.c_int),
                entry("event_query", [ctypes.c_void_p], ctypes.c_int),
                entry("event_synchronize", [ctypes.c_void_p], ctypes.c_int),
                entry("event_destroy", [ctypes.c_void_p], ctypes.c_int),
                entry("error_string", [ctypes.c_int], ctypes.c_char_p))

    return optional_entry(load, "plan buffers copy with torch", f"the page-order module {PageOrderSpec().name}")


class PageOrder:
    """One wrapper's reordered page ids: the device buffer (grown as needed; fixed in CUDA-
    graph mode, whose first plan decides for the captured run() whether it reads the
    reordered buffer, after which every plan writes it, with a plain copy where that plan may
    not reorder) and the kernel's params."""

    __slots__ = ("device", "graph", "buf", "view", "params", "params_address", "graph_orders", "csr_fields", "defer",
                 "pending")

    def __init__(self, device: torch.device, graph: bool, pair_layout: tuple[int, int, int] = (0, 0, 0)):
        """pair_layout (batch prefill): its work pairs' (ints a pair, field of the first page
        id, page ids a pair), where order()'s pairs get their chunks' first page ids."""
        self.device, self.graph = device, graph
        self.buf = self.view = None
        self.params = PageOrderParams()
        self.params.pair_ints, self.params.pair_ids_at, self.params.pair_ids = pair_layout
        self.params_address = ctypes.addressof(self.params)
        self.graph_orders = None
        self.csr_fields = None  # True: params hold a csr table's layout fields
        # POD's plan() plans both sides, then launches both orders at once (launch_pending):
        # with defer set, order() fills the params and leaves the launch pending
        self.defer = False
        self.pending = False

    def order(self, ids: torch.Tensor, lens: torch.Tensor, csr: bool, batch: int, movable_pages: int,
              page_size: int, may_order: bool, qo_indptr: torch.Tensor | None = None,
              last_page_len: torch.Tensor | None = None, pairs_at: int = 0,
              num_pairs: int = 0) -> torch.Tensor | None:
        """The page ids (indices, or block tables [batch, max_pages] or [batch, 2,
        max_pages]) with each request's movable pages in ascending page-id order (K ids, V
        ids alongside), or None: run() reads the ids as given. lens: the device's indptr
        (csr) or seq_lens; movable_pages: the most pages any request may reorder (the grid's
        segments); may_order: the configuration allows it. qo_indptr (device, causal
        prefill): each request moves only the pages of keys every query row sees; csr then
        reads last_page_len (device; ignored without qo_indptr). pairs_at (batch prefill): the
        device address of the work list's first pair (int32, laid out as the constructor's
        pair_layout says), num_pairs of them, whose chunks' first page ids the launch writes
        into them from its table.
        Eager plans skip the launch where no request has 2 pages to reorder."""
        if self.graph:
            if self.graph_orders is None:  # the first plan decides for the captured run()
                self.graph_orders = may_order and page_orderer() is not None
            if not self.graph_orders:
                return None
        elif not may_order or movable_pages < 2 or page_orderer() is None:
            return None
        n = ids.numel()
        buf = self.buf
        if buf is None or buf.numel() < n:  # (a CUDA-graph wrapper's ids are its fixed buffer: one size)
            size = n if self.graph else grown_size(n)
            buf = self.buf = torch.empty(size, dtype=torch.int32, device=self.device)
            self.view = None
        if csr:  # (the whole buffer: its first n ids are written, the kernels read by indptr; a view
            view = buf  # of n a plan cost ~6 us of host time where n changes from one plan to the next)
        else:
            view = self.view
            if view is None or view.shape != ids.shape:
                view = self.view = buf[:n].view(ids.shape)
        p = self.params
        if csr:
            if self.csr_fields is not True:  # (the layout's fields: set when the layout changes)
                p.seq_lens, p.src_row, p.dst_row, p.src_v, p.dst_v, p.row_pages = None, 0, 0, 0, 0, 0
                self.csr_fields = True
            p.indptr = lens.data_ptr()
        else:
            p.indptr, p.seq_lens = None, lens.data_ptr()
            p.src_row, p.dst_row, p.row_pages = ids.stride(0), view.stride(0), ids.shape[-1]
            p.src_v, p.dst_v = (ids.stride(1), view.stride(1)) if ids.dim() == 3 else (0, 0)
            self.csr_fields = False
        p.src, p.dst = ids.data_ptr(), view.data_ptr()
        p.longest_pages = movable_pages + 1  # (the kernel's launch sorts longest_pages - 1 a request)
        p.qo_indptr = qo_indptr.data_ptr() if qo_indptr is not None else None
        p.last_page_len = last_page_len.data_ptr() if qo_indptr is not None and csr else None
        p.page_size, p.batch, p.sort = page_size, batch, int(may_order)
        p.pairs, p.num_pairs = (pairs_at, num_pairs) if pairs_at and num_pairs > 0 else (None, 0)
        if self.defer:
            self.pending = True
        else:
            self._launch()
        return view

    def _launch(self) -> None:
        fn, error, _ = page_orderer()
        self.pending = False
        code = fn(self.params_address, raw_stream(self.device.index), self.device.index)
        if code:
            raise RuntimeError(f"{PageOrderSpec().name}: order_pages: CUDA error {code} ({error(code).decode()})")


def launch_pending(first: PageOrder, second: PageOrder) -> None:
    """The launches two deferred order() calls left pending (POD: its decode side's, then its
    prefill side's), in one kernel where both are pending (csrc/runtime/page_order.cuh
    launch_order_pages_pair; ~5-9 us of plan()'s host time a launch on the H200 host), and
    deferral ends for both. Each side's run() reads its buffer after this, in stream order."""
    first.defer = second.defer = False
    if first.pending and second.pending and first.device == second.device:
        _, error, pair = page_orderer()
        first.pending = second.pending = False
        index = first.device.index
        code = pair(first.params_address, second.params_address, raw_stream(index), index)
        if code:
            raise RuntimeError(f"{PageOrderSpec().name}: order_pages_pair: CUDA error {code} "
                               f"({error(code).decode()})")
        return
    for side in (first, second):
        if side.pending:
            side._launch()

"""The Python side of the one page-table abstraction (csrc/common/page_table.cuh).

A `PageTable` is the layout name plus the tensors the kernels read, in the order the
host binding unpacks them (csrc/runtime/torch_binding.h: make_page_table):
  csr:                     (kv_indptr[B+1], kv_indices[nnz_pages], kv_last_page_len[B])
  block_table:             (block_tables[B, max_pages], seq_lens[B])
  block_table_kv_separate: (block_tables[B, 2, max_pages], seq_lens[B])
`PagedKVCache` is the (k_cache, v_cache) pair in NHD or HND, with any strides as long
as head_dim is contiguous; a single [num_pages, 2, ...] tensor is split into two views.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..pipeline.spec import KV_LAYOUTS, PAGE_TABLES, dtype_name
from .checks import (
    as_int32_index,
    expect_choice,
    expect_dim,
    expect_last_dim_contiguous,
    index_ok,
    index_vector,
)


class PageTable(NamedTuple):
    layout: str
    tensors: tuple
    batch_size: int

    @property
    def device(self):
        return self.tensors[0].device

    def kv_lens(self, page_size: int):
        """Tokens per request (a device tensor); used by references and debug checks."""
        if self.layout == "csr":
            indptr, _, last = self.tensors
            pages = indptr[1:] - indptr[:-1]
            return torch.where(pages > 0, (pages - 1) * page_size + last, torch.zeros_like(pages))
        return self.tensors[1]

    def capacity(self) -> "object":
        """Pages per request the table holds."""
        if self.layout == "csr":
            indptr = self.tensors[0]
            return indptr[1:] - indptr[:-1]
        bt = self.tensors[0]
        return torch.full((self.batch_size,), bt.shape[-1], dtype=torch.int32, device=bt.device)

    def check_values(self, num_pages: int, page_size: int) -> None:
        """Value checks (device sync): page ids in range, lengths consistent."""
        if self.layout == "csr":
            indptr, indices, last = self.tensors
            if indptr.numel() and int(indptr[0]) != 0:
                raise ValueError(f"kv_indptr: must start at 0, got {int(indptr[0])}")
            if (indptr[1:] < indptr[:-1]).any():
                raise ValueError("kv_indptr: must be non-decreasing")
            if int(indptr[-1]) > indices.numel():
                raise ValueError(f"kv_indptr: last entry {int(indptr[-1])} exceeds len(kv_indices) = {indices.numel()}")
            used = indices[: int(indptr[-1])]
            pages = indptr[1:] - indptr[:-1]
            bad = (pages > 0) & ((last < 1) | (last > page_size)) if last.numel() else pages < 0
            if bad.any():
                b = int(torch.nonzero(bad)[0])
                raise ValueError(
                    f"kv_last_page_len: request {b} has {int(pages[b])} page(s) and last_page_len "
                    f"{int(last[b])}; expected 1..page_size ({page_size})")
        else:
            bt, seq_lens = self.tensors
            cap = bt.shape[-1] * page_size
            if ((seq_lens < 0) | (seq_lens > cap)).any():
                raise ValueError(f"seq_lens: expected 0..max_pages*page_size ({cap}) per request")
            # Only the columns a request's length reaches are read; padding (-1) beyond is fine.
            pages = (seq_lens.long() + page_size - 1) // page_size
            cols = torch.arange(bt.shape[-1], device=bt.device)
            mask = cols[None, :] < pages[:, None]
            used = (bt[:, 0] if bt.dim() == 3 else bt)[mask]
            if bt.dim() == 3:
                used = torch.cat([used, bt[:, 1][mask]])
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
            raise ValueError(
                f"page ids out of range: expected 0..{num_pages - 1}, got min {int(used.min())} "
                f"max {int(used.max())}")


def csr_kv_lens_host(indptr: np.ndarray, last_page_len: np.ndarray, page_size: int) -> np.ndarray:
    """Each request's keys from a CSR page table on the host: (pages - 1) x page_size + the
    last page's, 0 for a request without pages (get_seq_lens' formula). last_page_len has one
    value a request (a longer buffer, a CUDA-graph wrapper's: cut it first)."""
    pages = np.diff(indptr)
    return np.where(pages > 0, (pages - 1) * page_size + last_page_len, 0)


def csr_page_table(kv_indptr, kv_indices, kv_last_page_len=None) -> PageTable:
    """FlashInfer's CSR page table. Writers (append, rope+append) locate slots with
    indptr/indices alone, so kv_last_page_len may be None there; readers need it."""
    if index_ok(kv_indptr) and kv_indptr.shape[0] >= 1 and index_ok(kv_indices) and \
            kv_last_page_len is not None and index_ok(kv_last_page_len, kv_indptr.shape[0] - 1):
        return PageTable("csr", (kv_indptr, kv_indices, kv_last_page_len), kv_indptr.shape[0] - 1)
    # Anything else, int64 tensors included (narrowed to int32 once, here), is checked in turn.
    kv_indptr = index_vector(kv_indptr, "kv_indptr", what="[batch_size + 1]")
    if kv_indptr.shape[0] < 1:
        raise ValueError("kv_indptr: expected batch_size + 1 >= 1 entries, got 0")
    batch = kv_indptr.shape[0] - 1
    kv_indices = index_vector(kv_indices, "kv_indices", what="[number of pages used]")
    if kv_last_page_len is None:
        kv_last_page_len = torch.empty(0, dtype=torch.int32, device=kv_indptr.device)
    else:
        kv_last_page_len = index_vector(kv_last_page_len, "kv_last_page_len", batch,
                                        "[batch_size] (one per request)")
    return PageTable("csr", (kv_indptr, kv_indices, kv_last_page_len), batch)


def expect_one_page_table(csr_args: str, csr_given: bool) -> None:
    """plan() takes one page table: the CSR arguments (named in csr_args) or block_tables."""
    if csr_given:
        raise ValueError(f"give either {csr_args} or block_tables/seq_lens, not both")


def parse_block_tables(block_tables, seq_lens) -> tuple[str, torch.Tensor]:
    """(layout, block_tables as int32): the block-table form of a page table, checked in
    shape, as decode's and prefill's plan() and block_page_table take it. [B, max_pages]
    is vLLM's block_table; [B, 2, max_pages] (K page ids, V page ids) TensorRT-LLM's
    block_table_kv_separate. seq_lens: one KV length per request; its dtype and values are
    for the caller to check (a planner reads it on the host, a kernel on the device)."""
    name = "block_tables"
    if not isinstance(block_tables, torch.Tensor):
        raise TypeError(f"{name}: expected an int32 or int64 tensor, got {type(block_tables).__name__}")
    block_tables = as_int32_index(block_tables, name)
    dims = block_tables.dim()
    if dims not in (2, 3) or (dims == 3 and block_tables.shape[1] != 2):
        raise ValueError(f"{name}: expected [batch_size, max_pages] or [batch_size, 2, max_pages] (K and V page ids, "
                         f"TensorRT-LLM style), got shape {tuple(block_tables.shape)}")
    if block_tables.stride(-1) != 1:
        raise ValueError(f"{name}: the max_pages dimension must be contiguous")
    batch = block_tables.shape[0]
    if not isinstance(seq_lens, torch.Tensor):
        raise TypeError(f"seq_lens: expected an int32 or int64 tensor [{batch}], got {type(seq_lens).__name__}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens: expected [{batch}] (one KV length per request), got shape {tuple(seq_lens.shape)}")
    return ("block_table_kv_separate" if dims == 3 else "block_table"), block_tables


def block_page_table(block_tables, seq_lens, kv_separate: bool = False) -> PageTable:
    """A block-table PageTable of the layout the caller's module was built for
    (kv_separate: block_table_kv_separate), seq_lens as the kernels read it (int32)."""
    layout, block_tables = parse_block_tables(block_tables, seq_lens)
    if (layout == "block_table_kv_separate") != kv_separate:
        want = "block_table_kv_separate expects [batch_size, 2, max_pages] (K page ids, V page ids)" if kv_separate \
            else "block_table expects [batch_size, max_pages]"
        raise ValueError(f"block_tables: {want}, got shape {tuple(block_tables.shape)}")
    batch = block_tables.shape[0]
    seq_lens = index_vector(seq_lens, "seq_lens", batch, "[batch_size]")
    return PageTable(layout, (block_tables, seq_lens), batch)


class PagedKVCache(NamedTuple):
    k: object
    v: object
    layout: str

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def page_size(self) -> int:
        return self.k.shape[1] if self.layout == "NHD" else self.k.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2] if self.layout == "NHD" else self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self):
        return self.k.dtype

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.k.dtype)


def unpack_paged_kv_cache(paged_kv_cache, kv_layout: str, name: str = "paged_kv_cache",
                          same_head_dim: bool = True) -> PagedKVCache:
    """same_head_dim=False: K and V may differ in head_dim (prefill's head_dim_qk 192 with
    head_dim_vo 128); every other dimension must match."""
    if type(paged_kv_cache) is tuple and len(paged_kv_cache) == 2 and kv_layout in KV_LAYOUTS:
        k, v = paged_kv_cache  # fast path; anything unusual takes the checks below
        if _tensor(k) and _tensor(v) and k.dim() == 4 and k.shape == v.shape and k.dtype == v.dtype \
                and k.stride(-1) == 1 and v.stride(-1) == 1:
            return PagedKVCache(k, v, kv_layout)
    expect_choice(kv_layout, "kv_layout", KV_LAYOUTS)
    dims = "[num_pages, page_size, num_kv_heads, head_dim]" if kv_layout == "NHD" else \
        "[num_pages, num_kv_heads, page_size, head_dim]"
    if isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(f"{name}: a single tensor must be [num_pages, 2, ...] with ... = {dims} "
                             f"({kv_layout}), got shape {tuple(paged_kv_cache.shape)}")
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    elif isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
        k, v = paged_kv_cache
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise TypeError(f"{name}: expected (k_cache, v_cache) tensors")
    else:
        raise TypeError(f"{name}: expected a (k_cache, v_cache) tuple or one [num_pages, 2, ...] tensor, "
                        f"got {type(paged_kv_cache).__name__}")
    expect_dim(k, f"{name} (k_cache)", 4, f"{dims} ({kv_layout})")
    expect_dim(v, f"{name} (v_cache)", 4, f"{dims} ({kv_layout})")
    if tuple(k.shape[: 4 if same_head_dim else 3]) != tuple(v.shape[: 4 if same_head_dim else 3]):
        raise ValueError(f"{name}: k_cache {tuple(k.shape)} and v_cache {tuple(v.shape)} differ in shape")
    if k.dtype != v.dtype:
        raise TypeError(f"{name}: k_cache is {k.dtype} but v_cache is {v.dtype}")
    expect_last_dim_contiguous(k, f"{name} (k_cache)")
    expect_last_dim_contiguous(v, f"{name} (v_cache)")
    return PagedKVCache(k, v, kv_layout)


def _tensor(t) -> bool:
    return isinstance(t, torch.Tensor)


__all__ = ["PageTable", "PagedKVCache", "csr_page_table", "block_page_table", "parse_block_tables",
           "expect_one_page_table",
           "unpack_paged_kv_cache", "PAGE_TABLES"]

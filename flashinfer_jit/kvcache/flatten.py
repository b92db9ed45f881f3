"""flatten_kv_cache: paged K/V -> contiguous per-request K/V, zero-filled padded tail."""

from __future__ import annotations

from ..pipeline import env
from ..pipeline.jit import get_module
from ..pipeline.spec import FP8_DTYPES, dtype_name
from ..runtime.checks import expect_choice, expect_same_cuda_device, index_vector
from ..runtime.page_table import PageTable, block_page_table, csr_page_table
from .flatten_spec import FlattenSpec


def _page_table_arg(page_table, kv_seqlens) -> PageTable:
    """PageTable, a block table [B, P] / [B, 2, P] (lengths = kv_seqlens), or
    FlashInfer's (kv_indptr, kv_indices)."""
    import torch

    if isinstance(page_table, PageTable):
        return page_table
    if isinstance(page_table, torch.Tensor):
        if page_table.dim() >= 1 and page_table.shape[0] != kv_seqlens.shape[0]:
            raise ValueError(f"kv_seqlens: {kv_seqlens.shape[0]} requests, the block table has "
                             f"{page_table.shape[0]} rows")
        return block_page_table(page_table, kv_seqlens, kv_separate=page_table.dim() == 3)
    if isinstance(page_table, (tuple, list)) and len(page_table) == 2:
        return csr_page_table(page_table[0], page_table[1])
    raise TypeError("page_table: expected a PageTable, a block table tensor [B, max_pages] or "
                    "[B, 2, max_pages], or a (kv_indptr, kv_indices) tuple")


def flatten_kv_cache(k_cache, v_cache, kv_seqlens, page_table, out_size: int | None = None,
                     layout: str = "shd", k_scale: float | None = None, v_scale: float | None = None,
                     out_dtype=None, kv_layout: str = "NHD"):
    """Copy each request's first kv_seqlens[b] K and V rows, in request order, into
    contiguous (k_out, v_out) of shape [out_size, H, D] ("shd") or [H, out_size, D]
    ("hsd"). Rows from sum(kv_seqlens) to out_size are zeros. fp8 caches are dequantized
    with k_scale / v_scale (default 1) into out_dtype (default: bfloat16 for fp8 caches,
    the cache dtype otherwise).

    out_size defaults to sum(kv_seqlens), which costs a device sync; pass it (e.g. a
    captured maximum) to keep the call sync-free and CUDA-graph capturable.
    """
    import torch

    from ..runtime.page_table import unpack_paged_kv_cache

    cache = unpack_paged_kv_cache((k_cache, v_cache), kv_layout, name="k_cache/v_cache")
    expect_choice(layout, "layout", ("shd", "hsd"))
    kv_seqlens = index_vector(kv_seqlens, "kv_seqlens", what="[batch_size]")
    table = _page_table_arg(page_table, kv_seqlens)
    if table.batch_size != kv_seqlens.shape[0]:
        raise ValueError(f"kv_seqlens: {kv_seqlens.shape[0]} requests, the page table has {table.batch_size}")
    fp8 = cache.dtype_name in FP8_DTYPES
    if out_dtype is None:
        out_dtype = torch.bfloat16 if fp8 else cache.dtype
    if not fp8 and (k_scale not in (None, 1, 1.0) or v_scale not in (None, 1, 1.0)):
        raise ValueError("k_scale/v_scale: only fp8 caches are dequantized; leave them None")
    from ..runtime.checks import expect_vector_aligned

    for name, t in (("k_cache", cache.k), ("v_cache", cache.v)):
        expect_vector_aligned(t, name, 8 * t.element_size())
    spec = FlattenSpec(cache.dtype_name, dtype_name(out_dtype), cache.head_dim, kv_layout, table.layout)
    spec.validate()
    expect_same_cuda_device({"k_cache": cache.k, "v_cache": cache.v, "kv_seqlens": kv_seqlens,
                             **{f"page_table[{i}]": t for i, t in enumerate(table.tensors)}})
    if out_size is None:
        out_size = int(kv_seqlens.sum())
    if not isinstance(out_size, int) or isinstance(out_size, bool) or out_size < 0:
        raise ValueError(f"out_size: expected a non-negative int, got {out_size!r}")
    if env.debug():
        _check_flatten_values(kv_seqlens, table, out_size, cache.num_pages, cache.page_size)
    shape = (out_size, cache.num_kv_heads, cache.head_dim) if layout == "shd" else \
        (cache.num_kv_heads, out_size, cache.head_dim)
    k_out = torch.empty(shape, dtype=out_dtype, device=cache.k.device)
    v_out = torch.empty(shape, dtype=out_dtype, device=cache.k.device)
    cu_seqlens = torch.cumsum(kv_seqlens, 0, dtype=torch.int32)
    get_module(spec).flatten_kv_cache(cache.k, cache.v, cu_seqlens, table.tensors, k_out, v_out,
                                      float(1.0 if k_scale is None else k_scale),
                                      float(1.0 if v_scale is None else v_scale), layout == "hsd")
    return k_out, v_out


def _check_flatten_values(kv_seqlens, table: PageTable, out_size: int, num_pages: int, page_size: int) -> None:
    """Debug mode (a device sync): lengths fit the table and out_size; page ids in range."""
    if (kv_seqlens < 0).any():
        raise ValueError("kv_seqlens: lengths must be >= 0")
    total = int(kv_seqlens.sum())
    if total > out_size:
        raise ValueError(f"out_size: {out_size} is smaller than sum(kv_seqlens) = {total}")
    if ((kv_seqlens + page_size - 1) // page_size > table.capacity()).any():
        raise ValueError("kv_seqlens: a request is longer than the pages its page table holds")
    table.check_values(num_pages, page_size)


__all__ = ["flatten_kv_cache"]

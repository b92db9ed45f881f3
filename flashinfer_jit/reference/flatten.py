"""Reference of flatten_kv_cache: a Python loop over requests, float32 dequantization."""

from __future__ import annotations

import torch

from ..runtime.page_table import PageTable


def flatten_kv_cache_ref(k_cache, v_cache, kv_seqlens, page_table: PageTable, out_size: int,
                         layout="shd", k_scale=1.0, v_scale=1.0, out_dtype=torch.bfloat16, kv_layout="NHD"):
    k = (k_cache if kv_layout == "NHD" else k_cache.transpose(1, 2)).cpu().float()
    v = (v_cache if kv_layout == "NHD" else v_cache.transpose(1, 2)).cpu().float()
    table = PageTable(page_table.layout, tuple(t.cpu() for t in page_table.tensors), page_table.batch_size)
    page_size = k.shape[1]
    heads, dim = k.shape[2], k.shape[3]
    k_out = torch.zeros(out_size, heads, dim, dtype=torch.float32)
    v_out = torch.zeros_like(k_out)
    seqlens = kv_seqlens.cpu().tolist()
    row = 0
    for b, n in enumerate(seqlens):
        for pos in range(n):
            logical, slot = divmod(pos, page_size)
            kp, vp = _pages(table, b, logical)
            k_out[row] = k[kp, slot] * k_scale
            v_out[row] = v[vp, slot] * v_scale
            row += 1
    if layout == "hsd":
        k_out, v_out = k_out.transpose(0, 1).contiguous(), v_out.transpose(0, 1).contiguous()
    return k_out.to(out_dtype), v_out.to(out_dtype)


def _pages(table: PageTable, b: int, logical: int):
    if table.layout == "csr":
        indptr, indices, _ = table.tensors
        page = int(indices[int(indptr[b]) + logical])
        return page, page
    bt = table.tensors[0]
    if table.layout == "block_table":
        page = int(bt[b, logical])
        return page, page
    return int(bt[b, 0, logical]), int(bt[b, 1, logical])

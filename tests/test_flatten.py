"""flatten_kv_cache against a per-request loop: request order, every page-table layout,
NHD/HND, shd/hsd, fp8 dequantization, and a padded tail of zeros even where the cache
beyond each request's length holds NaN."""

from __future__ import annotations

import pytest
import torch

import flashinfer_jit as fij
from flashinfer_jit.reference.flatten import flatten_kv_cache_ref
from flashinfer_jit.runtime.page_table import PageTable, block_page_table, csr_page_table

DEV = "cuda"
NAN_BYTE = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7F}


def _make(layout, lens, page_size, num_pages, gen):
    pages = [(n + page_size - 1) // page_size for n in lens]
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    if layout == "csr":
        indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0)), dtype=torch.int32)
        return csr_page_table(indptr.to(DEV), perm[: int(indptr[-1])].to(DEV)), seqlens
    max_pages = max(pages) + 2
    sep = layout == "block_table_kv_separate"
    bt = torch.zeros((len(lens), 2, max_pages) if sep else (len(lens), max_pages), dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages):
        if sep:
            bt[b, 0, :p] = perm[used: used + p]
            bt[b, 1, :p] = perm.flip(0)[used: used + p]
        else:
            bt[b, :p] = perm[used: used + p]
        used += p
    return block_page_table(bt.to(DEV), seqlens, kv_separate=sep), seqlens


def _poison_beyond(cache, table: PageTable, lens, page_size, kv_layout, which: int):
    """NaN into every slot of each request's pages at or past its length, and every page no
    request uses (a consumer reading the padded tail must never see these). `which` is 0
    for the K cache, 1 for the V cache (their pages differ in block_table_kv_separate)."""
    c = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    nan = NAN_BYTE.get(cache.dtype, float("nan"))
    used = torch.zeros(cache.shape[0], dtype=torch.bool)
    for b, n in enumerate(lens):
        for logical in range((n + page_size - 1) // page_size + 1):
            pos0 = logical * page_size
            page = _page_of(table, b, logical, which)
            if page is None:
                continue
            used[page] = True
            for slot in range(max(0, n - pos0), page_size):
                if kv_layout == "NHD":
                    c[page, slot] = nan
                else:
                    c[page, :, slot] = nan
    c[~used.to(c.device)] = nan


def _page_of(table, b, logical, which):
    if table.layout == "csr":
        indptr, indices, _ = table.tensors
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        return int(indices[lo + logical]) if lo + logical < hi else None
    bt = table.tensors[0]
    return int(bt[b, which, logical] if bt.dim() == 3 else bt[b, logical]) if logical < bt.shape[-1] else None


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", ["csr", "block_table", "block_table_kv_separate"])
@pytest.mark.parametrize("kv_layout,out_layout", [("NHD", "shd"), ("HND", "hsd"), ("NHD", "hsd")])
def test_flatten(cache_dtype, layout, kv_layout, out_layout):
    gen = torch.Generator().manual_seed(3)
    page_size, num_pages, heads, dim = 16, 64, 4, 128
    lens = [37, 0, 16, 100, 1]
    table, seqlens = _make(layout, lens, page_size, num_pages, gen)
    shape = (num_pages, page_size, heads, dim) if kv_layout == "NHD" else (num_pages, heads, page_size, dim)
    base = torch.randn(shape, generator=gen)
    k_cache = base.to(cache_dtype).to(DEV)
    v_cache = (base * 0.5 + 1).to(cache_dtype).to(DEV)
    for which, c in enumerate((k_cache, v_cache)):
        _poison_beyond(c, table, lens, page_size, kv_layout, which)
    out_size = sum(lens) + 29  # a padded size, as a FlashAttention-3 varlen call would use
    fp8 = cache_dtype.itemsize == 1
    scales = dict(k_scale=0.5, v_scale=3.0) if fp8 else {}
    k_out, v_out = fij.flatten_kv_cache(k_cache, v_cache, seqlens, table, out_size=out_size, layout=out_layout,
                                        kv_layout=kv_layout, **scales)
    out_dtype = torch.bfloat16 if fp8 else cache_dtype
    assert k_out.dtype == out_dtype
    k_ref, v_ref = flatten_kv_cache_ref(k_cache, v_cache, seqlens, table, out_size, out_layout,
                                        scales.get("k_scale", 1.0), scales.get("v_scale", 1.0), out_dtype, kv_layout)
    for out, ref in ((k_out, k_ref), (v_out, v_ref)):
        out = out.cpu()
        assert not torch.isnan(out.float()).any(), "NaN from beyond a request's length leaked"
        assert torch.equal(out.float(), ref.float())
    tail = slice(sum(lens), out_size)
    assert (k_out[tail] if out_layout == "shd" else k_out[:, tail]).float().abs().sum() == 0


@pytest.mark.gpu
def test_flatten_strided_views_and_graph_capture():
    """K and V as halves of one [P, S, H, 2D] buffer (no copy), and out_size given so the
    call needs no sync and can be captured in a CUDA graph."""
    gen = torch.Generator().manual_seed(4)
    page_size, num_pages, heads, dim = 16, 32, 8, 64
    lens = [5, 60, 33]
    table, seqlens = _make("csr", lens, page_size, num_pages, gen)
    combined = torch.randn(num_pages, page_size, heads, 2 * dim, generator=gen).to(torch.bfloat16).to(DEV)
    k_cache, v_cache = combined[..., :dim], combined[..., dim:]
    out_size = 128
    k_out, v_out = fij.flatten_kv_cache(k_cache, v_cache, seqlens, table, out_size=out_size)
    k_ref, v_ref = flatten_kv_cache_ref(k_cache, v_cache, seqlens, table, out_size)
    assert torch.equal(k_out.cpu(), k_ref) and torch.equal(v_out.cpu(), v_ref)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fij.flatten_kv_cache(k_cache, v_cache, seqlens, table, out_size=out_size)  # warm up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            k_g, v_g = fij.flatten_kv_cache(k_cache, v_cache, seqlens, table, out_size=out_size)
    combined.copy_(torch.randn(combined.shape, generator=gen).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    k_ref, v_ref = flatten_kv_cache_ref(k_cache, v_cache, seqlens, table, out_size)
    assert torch.equal(k_g.cpu(), k_ref) and torch.equal(v_g.cpu(), v_ref)


def test_flatten_rejects_bad_arguments():
    k = torch.empty(4, 16, 2, 64, dtype=torch.bfloat16)
    seqlens = torch.tensor([3], dtype=torch.int32)
    bt = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="layout"):
        fij.flatten_kv_cache(k, k, seqlens, bt, layout="sdh")
    with pytest.raises(TypeError, match="kv_seqlens"):
        fij.flatten_kv_cache(k, k, seqlens.short(), bt)
    with pytest.raises(ValueError, match="kv_seqlens: 2 requests"):
        fij.flatten_kv_cache(k, k, torch.tensor([1, 2], dtype=torch.int32), bt)
    with pytest.raises(ValueError, match="k_scale"):
        fij.flatten_kv_cache(k, k, seqlens, bt, k_scale=2.0)
    with pytest.raises(ValueError, match="head_dim"):
        fij.flatten_kv_cache(torch.empty(4, 16, 2, 96, dtype=torch.bfloat16),
                             torch.empty(4, 16, 2, 96, dtype=torch.bfloat16), seqlens, bt)
    with pytest.raises(ValueError, match="expected CUDA tensors"):
        fij.flatten_kv_cache(k, k, seqlens, bt, out_size=8)

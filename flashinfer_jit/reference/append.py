"""References of append_paged_kv_cache and get_batch_indices_positions.

Append is a copy, so the reference is exact in the cache's own dtype: rows are moved
as raw bytes (a uint8 view), which also covers fp8 caches, where torch has no indexing
kernels on some devices. Everything is vectorized torch on the tensors' own device; no
Python loop over tokens.
"""

from __future__ import annotations

import torch

from ..runtime.page_table import PageTable


def get_batch_indices_positions_ref(append_indptr: torch.Tensor, seq_lens: torch.Tensor,
                                    nnz: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token t < nnz: its request b (append_indptr[b] <= t < append_indptr[b+1]) and
    position seq_lens[b] - append_len(b) + (t - append_indptr[b]); tokens at or past
    append_indptr[-1] are padding: batch index -1, position 0. int32, on
    append_indptr's device."""
    indptr = append_indptr.detach().cpu().long()
    seq = seq_lens.detach().cpu().long()
    counts = indptr[1:] - indptr[:-1]
    batch_of = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    batch_indices = torch.full((nnz,), -1, dtype=torch.int64)
    positions = torch.zeros(nnz, dtype=torch.int64)
    real = min(nnz, int(indptr[-1]))
    t = torch.arange(real)
    b = batch_of[:real]
    batch_indices[:real] = b
    positions[:real] = seq[b] - counts[b] + (t - indptr[b])
    device = append_indptr.device
    return batch_indices.to(torch.int32).to(device), positions.to(torch.int32).to(device)


def page_slots_ref(batch_indices: torch.Tensor, positions: torch.Tensor, page_table: PageTable,
                   page_size: int, num_pages: int, *, skip_invalid: bool = False):
    """Where each real token goes: (token ids, K page ids, V page ids, slots), int64 on
    the page table's device. Padding (batch index -1) is left out.

    A token that lies outside its request's pages or the cache (batch index out of
    range, position past the table's pages, page id >= num_pages) raises ValueError,
    or is left out with skip_invalid=True (what the kernel does: skip, never write out
    of bounds). Two tokens landing on one slot raise ValueError either way: the result
    would depend on the order of the writes.
    """
    device = page_table.device
    bi = batch_indices.to(device).long()
    pos = positions.to(device).long()
    tokens = torch.nonzero(bi != -1).flatten()
    b, p = bi[tokens], pos[tokens]
    capacity = page_table.capacity().to(device).long()
    valid = (b >= 0) & (b < page_table.batch_size) & (p >= 0)
    safe_b = torch.where(valid, b, torch.zeros_like(b))
    logical = torch.div(p, page_size, rounding_mode="floor")
    valid &= logical < capacity[safe_b] if capacity.numel() else torch.zeros_like(valid)
    safe_logical = torch.where(valid, logical, torch.zeros_like(logical))
    k_page, v_page = _page_ids(page_table, safe_b, safe_logical, valid)
    valid &= (k_page >= 0) & (k_page < num_pages) & (v_page >= 0) & (v_page < num_pages)
    if not bool(valid.all()):
        if not skip_invalid:
            first = int(tokens[~valid][0])
            raise ValueError(
                f"token {first} (batch index {int(bi[first])}, position {int(pos[first])}) lies "
                "outside its request's pages or the cache")
        tokens, k_page, v_page, p = tokens[valid], k_page[valid], v_page[valid], p[valid]
    slot = p % page_size
    for name, page in (("K", k_page), ("V", v_page)):
        flat = page * page_size + slot
        if torch.unique(flat).numel() != flat.numel():
            raise ValueError(f"two tokens write the same {name} slot; the result would depend "
                             "on the order of the writes")
    return tokens, k_page, v_page, slot


def _page_ids(page_table: PageTable, b: torch.Tensor, logical: torch.Tensor, valid: torch.Tensor):
    if page_table.layout == "csr":
        indptr, indices, _ = page_table.tensors
        flat = indptr.long()[b] + logical
        if indices.numel() == 0:
            page = torch.full_like(flat, -1)
        else:
            inside = valid & (flat < indices.numel())
            page = torch.where(inside, indices.long()[torch.where(inside, flat, 0)], -1)
        return page, page
    block_tables = page_table.tensors[0].long()
    if page_table.layout == "block_table":
        page = block_tables[b, logical] if block_tables.numel() else torch.full_like(b, -1)
        return page, page
    if block_tables.numel() == 0:
        return torch.full_like(b, -1), torch.full_like(b, -1)
    return block_tables[b, 0, logical], block_tables[b, 1, logical]


def append_paged_kv_cache_ref(append_key: torch.Tensor, append_value: torch.Tensor,
                              batch_indices: torch.Tensor, positions: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: PageTable,
                              kv_layout: str = "NHD", *, skip_invalid: bool = False):
    """New (k_cache, v_cache) (clones; the inputs are untouched) after writing row i of
    append_key/append_value ([nnz, num_kv_heads, head_dim]) at (batch_indices[i],
    positions[i]). Padding tokens (batch index -1) change nothing.

    The K page of a token is kv_indices[kv_indptr[b] + pos // page_size] (csr),
    block_tables[b, pos // page_size] (block_table) or block_tables[b, 0, pos // page_size]
    with the V page at block_tables[b, 1, ...] (block_table_kv_separate); the slot in the
    page is pos % page_size. Caches are NHD [pages, page_size, heads, dim] or HND
    [pages, heads, page_size, dim].
    """
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    tokens, k_page, v_page, slot = page_slots_ref(batch_indices, positions, page_table, page_size,
                                                  k_cache.shape[0], skip_invalid=skip_invalid)
    k_new, v_new = k_cache.clone(), v_cache.clone()
    for cache, rows, page in ((k_new, append_key, k_page), (v_new, append_value, v_page)):
        dev = cache.device
        data = rows[tokens.to(rows.device)].to(dev).contiguous().view(torch.uint8)
        raw = cache.view(torch.uint8)
        if kv_layout == "NHD":
            raw[page.to(dev), slot.to(dev)] = data
        else:  # advanced indices around a slice: the indexed dims come first, [n, H, D]
            raw[page.to(dev), :, slot.to(dev)] = data
    return k_new, v_new


__all__ = ["append_paged_kv_cache_ref", "get_batch_indices_positions_ref", "page_slots_ref"]

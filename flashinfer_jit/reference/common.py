"""What the PyTorch references of several families share: the paged cache read through a
page table (request_pages_ref, gather_rows_ref), the RoPE math (as csrc/common/rope.cuh
is the kernels') and ALiBi's slopes and bias (csrc/common/pos_encoding.cuh). Plain torch,
float64."""

from __future__ import annotations

import math

import torch

from ..runtime.page_table import PageTable

LN2 = math.log(2.0)


def request_pages_ref(page_table: PageTable, b: int, num_pages: int) -> tuple[list[int], list[int]]:
    """(K page ids, V page ids) of request b's first `num_pages` logical pages."""
    if num_pages == 0:
        return [], []
    if page_table.layout == "csr":
        indptr, indices, _ = page_table.tensors
        start = int(indptr[b])
        pages = indices[start: start + num_pages].tolist()
        return pages, pages
    block_tables = page_table.tensors[0]
    if page_table.layout == "block_table":
        pages = block_tables[b, :num_pages].tolist()
        return pages, pages
    return block_tables[b, 0, :num_pages].tolist(), block_tables[b, 1, :num_pages].tolist()


def gather_rows_ref(cache: torch.Tensor, pages: list[int], kv_len: int, kv_layout: str) -> torch.Tensor:
    """The first kv_len token rows [kv_len, num_kv_heads, head_dim] (float64) of the given
    pages of one cache (NHD [P, S, H, D] or HND [P, H, S, D], any strides)."""
    index = torch.tensor(pages, dtype=torch.long, device=cache.device)
    # fp8 gathered as raw bytes: torch lacks index kernels for fp8 on some devices
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    picked = raw.index_select(0, index)
    if cache.element_size() == 1:
        picked = picked.view(cache.dtype)
    if kv_layout == "HND":
        picked = picked.transpose(1, 2)
    heads, dim = picked.shape[2], picked.shape[3]
    return picked.reshape(-1, heads, dim)[:kv_len].float().double()


def inv_freq_ref(rotary_dim: int, rope_scale: float = 1.0, rope_theta: float = 1e4,
                 llama31: tuple[float, float, float] | None = None) -> torch.Tensor:
    """freq_i = theta^(-2i/rotary_dim), scaled by 1/rope_scale; Llama 3.1 keeps high
    frequencies, scales low ones and interpolates between (low, high, old_context_len)."""
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    freq = rope_theta ** (-2.0 * i / rotary_dim)
    if llama31 is None:
        return freq / rope_scale
    low, high, old_len = llama31
    smooth = ((old_len * freq / (2 * math.pi)) - low) / (high - low)
    smooth = smooth.clamp(0.0, 1.0)
    return (1 - smooth) * freq / rope_scale + smooth * freq


def cos_sin_from_freq(positions: torch.Tensor, inv_freq: torch.Tensor):
    angle = positions.double().cpu()[:, None] * inv_freq[None, :]
    return torch.cos(angle), torch.sin(angle)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [nnz, H, R] (float64), cos/sin [nnz, R/2] -> rotated [nnz, H, R]."""
    c, s = cos[:, None, :], sin[:, None, :]
    if interleave:
        even, odd = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = even * c - odd * s
        out[..., 1::2] = odd * c + even * s
        return out
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def alibi_slopes_ref(num_heads: int) -> torch.Tensor:
    """ALiBi's slope of each of num_heads query heads (float64 [num_heads]), FlashInfer's
    get_alibi_slopes written as a closed form: with n' the largest power of two <= num_heads,
    head h < n' takes 2^(-8 (h + 1) / n'), and head h >= n' takes 2^(-4 (2 (h - n') + 1) / n')
    (the odd steps of the slopes of 2n' heads)."""
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads: expected a positive int, got {num_heads!r}")
    pow2 = 1 << (num_heads.bit_length() - 1)
    h = torch.arange(num_heads, dtype=torch.float64)
    exponent = torch.where(h < pow2, -8.0 * (h + 1), -4.0 * (2.0 * (h - pow2) + 1.0))
    return torch.exp2(exponent / pow2)


def alibi_bias_ref(num_heads: int, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """FlashInfer's ALiBi bias on the natural-log logits (after sm_scale and the fp8
    scales): slope[h] * (key - row), float64 [num_heads, len(rows), len(keys)]. rows are the
    query rows' indices within their request (0 .. qo_len - 1; 0 for a decode query), not
    their positions kv_len - qo_len + i: FlashInfer's kernels pass those as qo_idx. (A
    constant per row: the softmax is the same either way, the LSE is not.)"""
    distance = keys.double().cpu()[None, :] - rows.double().cpu()[:, None]
    return alibi_slopes_ref(num_heads)[:, None, None] * distance[None]


def rope_at_positions_ref(x: torch.Tensor, positions: torch.Tensor, rope_scale: float = 1.0,
                          rope_theta: float = 1e4) -> torch.Tensor:
    """x [n, H, D] (float64) rotated NeoX style (halves) over all D dims at `positions` [n],
    on x's device: the attention kernels' ROPE_LLAMA (decode, prefill)."""
    cos, sin = cos_sin_from_freq(positions, inv_freq_ref(x.shape[-1], rope_scale, rope_theta))
    return rotate_ref(x, cos.to(x.device), sin.to(x.device), interleave=False)

"""Float64 references of batch decode over the paged KV cache and of the merge of
attention states (docs/architecture.md, semantics).

One query per request, at position kv_len - 1, against that request's kv_len keys and
values, gathered through the page table (csr, block_table, block_table_kv_separate) from
an NHD or HND cache with any strides. A plain loop over requests; within a request
everything is vectorized over heads and tokens, in float64 on the caches' device.

  logits_j = (q . k_j) * sm_scale * q_scale * k_scale    (sm_scale default 1/sqrt(head_dim))
  soft cap c:       logits_j = c * tanh(logits_j / c)
  window_left w:    only keys j >= kv_len - 1 - w (w = -1: all)
  ROPE_LLAMA:       q rotated at position kv_len - 1, k_j at j, NeoX style (halves);
                    the cache holds unrotated K
  ALIBI:            logits_j += slope[h] * j (FlashInfer's bias slope (j - qo_idx), qo_idx 0
                    for a decode query; reference/common.py alibi_slopes_ref over num_qo_heads);
                    not with a soft cap or q_len_per_req > 1 (rejected as by plan())
  out = sum_j softmax(logits)_j * v_j * v_scale,  lse = log2(sum_j exp(logits_j))
fp8 K/V, and an fp8 q, are dequantized as float(value) (q_scale, k_scale and v_scale apply as
above). A request of length 0: out zeros, lse -inf.
Query head h reads KV head h // (num_qo_heads // num_kv_heads).

q_len_per_req N (multi-token decode): q holds N rows a request (request-major); row t of
request b sits at position kv_len - N + t and sees keys 0 .. kv_len - N + t (and, with a
window, from kv_len - N + t - w); a row that sees no key gives zeros and -inf.
"""

from __future__ import annotations

import math

import torch

from ..runtime.page_table import PageTable
from .common import LN2, alibi_bias_ref, gather_rows_ref, request_pages_ref, rope_at_positions_ref

def ordered_pages_ref(page_table: PageTable, kv_lens, page_size: int, segment: int,
                      qo_lens=None) -> list[tuple[list, list]]:
    """plan()'s page reordering (sort_pages, flashinfer_jit/runtime/page_order.py): per request, (K
    page ids, V page ids) of its pages with its movable pages in ascending (K id, V id)
    order, a `segment` of pages at a time, as the int32 ids read as unsigned; the others
    stay where they are. Movable: every page but the last (which may be partial); with
    qo_lens (a causal prefill), at most the pages of keys j <= kv_len - qo_len."""
    result = []
    for b, n in enumerate(kv_lens):
        pages = -(-int(n) // page_size)
        movable = max(pages - 1, 0)
        if qo_lens is not None:
            movable = max(0, min(movable, (int(n) - int(qo_lens[b]) + 1) // page_size))
        k_ids, v_ids = request_pages_ref(page_table, b, pages)
        pairs = list(zip(k_ids, v_ids))
        ordered = []
        for lo in range(0, movable, segment):
            chunk = pairs[lo: min(lo + segment, movable)]
            ordered += sorted(chunk, key=lambda kv: (kv[0] & 0xFFFFFFFF, kv[1] & 0xFFFFFFFF))
        ordered += pairs[movable:]
        result.append(([k for k, _ in ordered], [v for _, v in ordered]))
    return result


def decode_ref(q, k_cache, v_cache, page_table: PageTable, kv_lens, kv_layout="NHD", sm_scale=None,
               window_left=-1, logits_soft_cap=None, pos_encoding_mode="NONE", rope_scale=1.0,
               rope_theta=1e4, k_scale=1.0, v_scale=1.0, q_scale=1.0, q_len_per_req=1):
    """(out float32 [B x N, Hq, D], lse float32 [B x N, Hq], base 2) on q's device.

    q [B x N, Hq, D] (N = q_len_per_req); k_cache/v_cache NHD or HND (for a single
    [P, 2, ...] tensor pass its [:, 0] and [:, 1]); kv_lens [B] (tensor or list). None for
    a scale or a RoPE parameter means its default, as in the API.
    """
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    if pos_encoding_mode not in ("NONE", "ROPE_LLAMA", "ALIBI"):
        raise ValueError(f"pos_encoding_mode: expected 'NONE', 'ROPE_LLAMA' or 'ALIBI', got {pos_encoding_mode!r}")
    alibi = pos_encoding_mode == "ALIBI"
    if alibi and (q_len_per_req > 1 or (logits_soft_cap is not None and logits_soft_cap > 0)):
        raise ValueError("pos_encoding_mode='ALIBI': not with logits_soft_cap or q_len_per_req > 1")
    n_tok = q_len_per_req
    rows, num_qo_heads, head_dim = q.shape
    batch = rows // n_tok
    page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    num_kv_heads = k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_qo_heads // num_kv_heads
    scale = (1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale) * \
        (1.0 if q_scale is None else q_scale) * (1.0 if k_scale is None else k_scale)
    v_scale = 1.0 if v_scale is None else v_scale
    rope_scale = 1.0 if rope_scale is None else rope_scale
    rope_theta = 1e4 if rope_theta is None else rope_theta
    lens = kv_lens.tolist() if isinstance(kv_lens, torch.Tensor) else list(kv_lens)
    table = PageTable(page_table.layout, tuple(t.cpu() for t in page_table.tensors), page_table.batch_size)
    device = k_cache.device
    out = torch.zeros(rows, num_qo_heads, head_dim, dtype=torch.float64, device=device)
    lse = torch.full((rows, num_qo_heads), -math.inf, dtype=torch.float64, device=device)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        if n_tok > 1:
            _multi_token_rows(q, k_cache, v_cache, table, b, n, n_tok, kv_layout, page_size, scale, v_scale,
                              window_left, logits_soft_cap, out, lse)
            continue
        k_pages, v_pages = request_pages_ref(table, b, -(-n // page_size))
        k = gather_rows_ref(k_cache, k_pages, n, kv_layout)
        v = gather_rows_ref(v_cache, v_pages, n, kv_layout)
        qb = q[b].to(device).double()
        if pos_encoding_mode == "ROPE_LLAMA":
            qb = rope_at_positions_ref(qb[None], torch.tensor([n - 1]), rope_scale, rope_theta)[0]
            k = rope_at_positions_ref(k, torch.arange(n), rope_scale, rope_theta)
        qg = qb.view(num_kv_heads, group, head_dim)
        logits = torch.einsum("kgd,nkd->kgn", qg, k) * scale  # [Hk, group, n]
        if alibi:
            bias = alibi_bias_ref(num_qo_heads, torch.zeros(1), torch.arange(n))  # [Hq, 1, n]
            logits = logits + bias.to(device).view(num_kv_heads, group, n)
        if logits_soft_cap is not None and logits_soft_cap > 0:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        if window_left >= 0:
            keep = torch.arange(n, device=device) >= n - 1 - window_left
            logits = logits.masked_fill(~keep, -math.inf)
        lse_e = torch.logsumexp(logits, dim=-1)  # natural log, [Hk, group]
        p = torch.exp(logits - lse_e[..., None])
        out[b] = (torch.einsum("kgn,nkd->kgd", p, v) * v_scale).reshape(num_qo_heads, head_dim)
        lse[b] = (lse_e / LN2).reshape(num_qo_heads)
    return out.float().to(q.device), lse.float().to(q.device)


def _multi_token_rows(q, k_cache, v_cache, table, b, n, n_tok, kv_layout, page_size, scale, v_scale, window_left,
                      logits_soft_cap, out, lse) -> None:
    """Rows b x N .. b x N + N - 1 of decode_ref's out and lse for request b (n keys)."""
    device = k_cache.device
    num_qo_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]
    group = num_qo_heads // num_kv_heads
    k_pages, v_pages = request_pages_ref(table, b, -(-n // page_size))
    k = gather_rows_ref(k_cache, k_pages, n, kv_layout)
    v = gather_rows_ref(v_cache, v_pages, n, kv_layout)
    keys = torch.arange(n, device=device)
    for t in range(n_tok):
        row = b * n_tok + t
        pos = n - n_tok + t
        keep = keys <= pos
        if window_left >= 0:
            keep &= keys >= pos - window_left
        if not bool(keep.any()):
            continue
        qg = q[row].to(device).double().view(num_kv_heads, group, head_dim)
        logits = torch.einsum("kgd,nkd->kgn", qg, k) * scale
        if logits_soft_cap is not None and logits_soft_cap > 0:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        logits = logits.masked_fill(~keep, -math.inf)
        lse_e = torch.logsumexp(logits, dim=-1)
        p = torch.exp(logits - lse_e[..., None])
        out[row] = (torch.einsum("kgn,nkd->kgd", p, v) * v_scale).reshape(num_qo_heads, head_dim)
        lse[row] = (lse_e / LN2).reshape(num_qo_heads)


def merge_state_ref(v_a, s_a, v_b, s_b):
    """Merge of two partial states: (v float32 [n, H, D], s float32 [n, H], base 2).
    A state with s = -inf has weight 0 (its v is ignored); both -inf: v 0, s -inf."""
    v = torch.stack([v_a, v_b], dim=1)
    s = torch.stack([s_a, s_b], dim=1)
    return merge_states_ref(v, s)


def merge_states_ref(v, s):
    """merge_states: v [n, S, H, D], s [n, S, H] (base-2 LSEs) -> (v float32 [n, H, D],
    s float32 [n, H]). All S states -inf: v 0, s -inf (no NaN)."""
    v64, s64 = v.double(), s.double()
    s_max = s64.max(dim=1).values  # [n, H]
    finite = torch.isfinite(s_max)
    safe_max = torch.where(finite, s_max, torch.zeros_like(s_max))
    w = torch.exp2(s64 - safe_max[:, None])  # -inf entries -> 0
    w = torch.where(finite[:, None], w, torch.zeros_like(w))
    total = w.sum(dim=1)  # [n, H]
    merged = torch.einsum("nsh,nshd->nhd", w, torch.where(w[..., None] > 0, v64, torch.zeros_like(v64)))
    merged = torch.where(finite[..., None], merged / torch.where(finite, total, 1.0)[..., None],
                         torch.zeros_like(merged))
    s_out = torch.where(finite, safe_max + torch.log2(torch.where(finite, total, 1.0)),
                        torch.full_like(s_max, -math.inf))
    return merged.float(), s_out.float()


__all__ = ["decode_ref", "gather_rows_ref", "merge_state_ref", "merge_states_ref", "ordered_pages_ref", "request_pages_ref"]

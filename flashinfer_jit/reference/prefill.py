"""Float64 reference of batch prefill (BatchPrefillWithPagedKVCacheWrapper,
BatchPrefillWithRaggedKVCacheWrapper, single_prefill_with_kv_cache; docs/prefill.md), and
FlashInfer's packbits / segment_packbits, which make the bit-packed custom masks.

Request b has qo_len = qo_indptr[b + 1] - qo_indptr[b] query rows of q and kv_len keys and
values: paged (`page_table`, kv_len from the table, NHD or HND caches with any strides,
K/V pages read through reference/decode.py's helpers) or ragged (`kv_indptr`, rows
kv_indptr[b] .. kv_indptr[b + 1] of k and v [kv_tokens, Hk, D]). Query row i of a request
sits at position pos_i = kv_len - qo_len + i, key j at j; query head h reads KV head
h // (Hq // Hk). head_dim_qk (q, k) may differ from head_dim_vo (v, out), e.g. 192 / 128.

  logits_ij = (q_i . k_j) * sm_scale * q_scale * k_scale      sm_scale default 1/sqrt(head_dim_qk)
  soft cap c > 0:   logits_ij = c * tanh(logits_ij / c)       (None or 0.0: off)
  key j allowed for row i where the mask allows it and, with window_left w >= 0, j >= pos_i - w
    mask none:   every key
    causal:      j <= pos_i (bottom-right aligned); with kv_len < qo_len the first rows see no key
    custom:      bit i * kv_len + j of the request's row-major qo_len x kv_len mask; replaces
                 `causal` (FlashInfer's plan(): causal counts only without a custom mask)
  ROPE_LLAMA:     q_i rotated at pos_i, k_j at j, NeoX style over all head_dim_qk dims
                  (reference/rope.py); the cache holds unrotated K
  ALIBI:          logits_ij += slope[h] * (j - i), i the row's index in its request (FlashInfer's
                  qo_idx, not pos_i; reference/common.py alibi_slopes_ref over Hq); not with
                  a soft cap or sinks (rejected as by plan() and run())
  sinks s [Hq]:   D_ih = sum_j allowed exp(logits_ij) + exp(s_h)  (without sinks: no exp(s_h) term)
  out_ih = sum_j allowed exp(logits_ij) v_j / D_ih * v_scale,    lse_ih = log2(D_ih)

Sinks (gpt-oss): s_h is a logit in the units of the scaled logits, neither multiplied by
sm_scale nor soft-capped; it adds exp(s_h) to each row's denominator once and no value.
The LSE includes it: FlashInfer's FA2 AttentionSink variant (flashinfer/jit/attention/
variants.py, attention_sink_fa2_decl) adds 2^(s_h * log2 e) to d in update_m_d (KV tile 0
only) before the kernel writes lse = m + log2(d), and its test reference
(tests/test_helpers/sink_attention_reference.py, sink_softmax) appends the raw sink to the
scaled logits. So merge_state with a state that has no sink counts the sink once.

A row that sees no key (kv_len 0, an all-false custom mask row, a window past every key)
gives out zeros and lse -inf; with sinks its lse is the sink's term alone, s_h * log2 e.
Requests with qo_len 0 have no rows. fp8 K/V are dequantized as float(value). A plain
loop over requests, vectorized within one; computed on k's device, returned on q's device
as (out float64 [qo_tokens, Hq, head_dim_vo], lse float64 [qo_tokens, Hq]).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from ..runtime.checks import index_vector, soft_cap_value
from ..runtime.page_table import PageTable
from .common import LN2, alibi_bias_ref, gather_rows_ref, request_pages_ref, rope_at_positions_ref

BITORDERS = ("big", "little")


# --- packbits / segment_packbits (flashinfer.quantization) ----------------------------
def packbits_ref(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """The 1-D binary array x packed 8 to a uint8, as numpy.packbits: "big" puts element 0
    in bit 7, "little" in bit 0 (the order the prefill kernels read). FlashInfer's default
    order is "big"; its plan() packs custom masks "little"."""
    if bitorder not in BITORDERS:
        raise ValueError(f"bitorder: expected 'big' or 'little', got {bitorder!r}")
    bits = x.reshape(-1).to(torch.uint8) != 0
    pad = -bits.numel() % 8
    bits = torch.cat([bits, bits.new_zeros(pad)]).view(-1, 8).to(torch.int32)
    weights = 1 << torch.arange(8, dtype=torch.int32, device=x.device)
    if bitorder == "big":
        weights = weights.flip(0)
    return (bits * weights).sum(dim=1).to(torch.uint8)


def segment_packbits_ref(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big"):
    """(packed uint8, new_indptr int32): segment b = x[indptr[b]:indptr[b + 1]] packed on
    its own from byte new_indptr[b], so new_indptr[b + 1] - new_indptr[b] = ceil(len / 8)."""
    bounds = index_vector(indptr, "indptr").tolist()
    flat = x.reshape(-1)
    parts = [packbits_ref(flat[lo:hi], bitorder) for lo, hi in zip(bounds[:-1], bounds[1:])]
    sizes = [0] + [p.numel() for p in parts]
    new_indptr = torch.tensor(sizes, dtype=torch.int32, device=indptr.device).cumsum(0).to(torch.int32)
    packed = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=x.device)
    return packed, new_indptr


def unpack_mask_ref(packed: torch.Tensor, start_byte: int, count: int) -> torch.Tensor:
    """`count` bools from byte `start_byte` of a little-endian packed mask: bit t is
    (packed[start_byte + t // 8] >> (t % 8)) & 1, as the kernels read it."""
    data = packed.reshape(-1)[start_byte: start_byte + -(-count // 8)].to(torch.int32)
    bits = (data[:, None] >> torch.arange(8, device=packed.device)) & 1
    return bits.reshape(-1)[:count].bool()


# --- the reference --------------------------------------------------------------------
class _Scores(NamedTuple):
    """Run-time values of the logits and the softmax, fixed for a whole call."""
    scale: float           # sm_scale * q_scale * k_scale
    soft_cap: float        # 0.0: off
    window_left: int       # -1: off
    rope: tuple | None     # (rope_scale, rope_theta) for ROPE_LLAMA
    alibi: bool            # ALIBI's bias
    sinks: torch.Tensor | None  # [Hq] float64
    v_scale: float


def prefill_ref(q, qo_indptr, k, v, kv_indptr=None, page_table: PageTable | None = None, kv_layout="NHD", *,
                causal=False, custom_mask=None, packed_custom_mask=None, mask_indptr=None, sm_scale=None,
                window_left=-1, logits_soft_cap=None, pos_encoding_mode="NONE", rope_scale=None, rope_theta=None,
                q_scale=None, k_scale=None, v_scale=None, sinks=None):
    """(out float64 [qo_tokens, Hq, head_dim_vo], lse float64 [qo_tokens, Hq], base 2).

    q [qo_tokens, Hq, head_dim_qk]; qo_indptr [B + 1]. K/V either ragged: k, v
    [kv_tokens, Hk, D] with kv_indptr [B + 1]; or paged: k, v the K and V caches (NHD or
    HND; for a single [P, 2, ...] tensor pass its [:, 0] and [:, 1]) with `page_table`.
    custom_mask: bools, request b's qo_len x kv_len from element mask_indptr[b];
    packed_custom_mask (taken over custom_mask when both are given): uint8 bits, little
    bit order, request b's from byte mask_indptr[b]. mask_indptr defaults to the packing of
    the requests' masks one after another (cumulative qo_len * kv_len elements, or
    ceil(qo_len * kv_len / 8) bytes as segment_packbits makes it). Index tensors int32 or
    int64. None for a scale or a RoPE parameter means its default, as in the API.
    """
    if (kv_indptr is None) == (page_table is None):
        raise ValueError("prefill_ref: give kv_indptr (ragged K/V) or page_table (paged K/V), not both or neither")
    if pos_encoding_mode not in ("NONE", "ROPE_LLAMA", "ALIBI"):
        raise ValueError(f"pos_encoding_mode: expected 'NONE', 'ROPE_LLAMA' or 'ALIBI', got {pos_encoding_mode!r}")
    if pos_encoding_mode == "ALIBI" and (soft_cap_value(logits_soft_cap) > 0 or sinks is not None):
        raise ValueError("pos_encoding_mode='ALIBI': not with logits_soft_cap or sinks")
    qo_bounds = _bounds(qo_indptr, "qo_indptr", q.shape[0])
    kv_rows = _kv_rows_ref(k, v, kv_indptr, page_table, kv_layout, len(qo_bounds) - 1)
    kv_lens = [n for n, _ in kv_rows]
    masks = _request_masks(qo_bounds, kv_lens, causal, custom_mask, packed_custom_mask, mask_indptr)
    num_qo_heads = q.shape[1]
    num_kv_heads = k.shape[1] if page_table is not None and kv_layout == "HND" else k.shape[-2]
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    device = k.device
    rope = (_or_one(rope_scale), 1e4 if rope_theta is None else rope_theta)
    scores = _Scores(
        scale=(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale) * _or_one(q_scale) * _or_one(k_scale),
        soft_cap=soft_cap_value(logits_soft_cap), window_left=window_left,
        rope=rope if pos_encoding_mode == "ROPE_LLAMA" else None, alibi=pos_encoding_mode == "ALIBI",
        sinks=None if sinks is None else sinks.to(device).double().reshape(num_qo_heads),
        v_scale=_or_one(v_scale))
    head_dim_vo = v.shape[-1]
    out = torch.zeros(q.shape[0], num_qo_heads, head_dim_vo, dtype=torch.float64, device=device)
    lse = torch.full((q.shape[0], num_qo_heads), -math.inf, dtype=torch.float64, device=device)
    for b, (lo, hi) in enumerate(zip(qo_bounds[:-1], qo_bounds[1:])):
        if hi == lo:
            continue
        keys, values = kv_rows[b][1]()
        out[lo:hi], lse[lo:hi] = _attend(q[lo:hi].to(device).double(), keys, values, masks[b], scores)
    return out.to(q.device), lse.to(q.device)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scores: _Scores):
    """One request: q [m, Hq, Dqk], k [n, Hk, Dqk], v [n, Hk, Dvo] (float64), mask None,
    "causal" or bool [m, n] -> (out [m, Hq, Dvo], lse [m, Hq])."""
    m, n = q.shape[0], k.shape[0]
    num_qo_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_qo_heads // num_kv_heads
    positions = torch.arange(n - m, n, device=q.device)  # of the query rows
    keys = torch.arange(n, device=q.device)
    if scores.rope is not None:
        q = rope_at_positions_ref(q, positions, *scores.rope)
        k = rope_at_positions_ref(k, keys, *scores.rope)
    logits = torch.einsum("mkgd,nkd->kgmn", q.view(m, num_kv_heads, group, -1), k) * scores.scale
    if scores.alibi:
        bias = alibi_bias_ref(num_qo_heads, torch.arange(m), torch.arange(n))  # [Hq, m, n]
        logits = logits + bias.to(q.device).view(num_kv_heads, group, m, n)
    if scores.soft_cap > 0:
        logits = scores.soft_cap * torch.tanh(logits / scores.soft_cap)
    if mask is None:
        allowed = torch.ones(m, n, dtype=torch.bool, device=q.device)
    elif isinstance(mask, str):  # "causal"
        allowed = keys[None, :] <= positions[:, None]
    else:
        allowed = mask.to(q.device)
    if scores.window_left >= 0:
        allowed = allowed & (keys[None, :] >= positions[:, None] - scores.window_left)
    logits = logits.masked_fill(~allowed, -math.inf)
    terms = logits
    if scores.sinks is not None:  # one more logit per row, with no value
        sink = scores.sinks.view(num_kv_heads, group, 1, 1).expand(-1, -1, m, 1)
        terms = torch.cat([logits, sink], dim=-1)
    lse_e = torch.logsumexp(terms, dim=-1)  # natural log [Hk, group, m]; -inf where nothing
    p = torch.exp(logits - torch.where(torch.isinf(lse_e), 0.0, lse_e)[..., None])
    out = torch.einsum("kgmn,nkd->mkgd", p, v) * scores.v_scale
    return out.reshape(m, num_qo_heads, -1), (lse_e / LN2).permute(2, 0, 1).reshape(m, num_qo_heads)


def _or_one(value) -> float:
    return 1.0 if value is None else value


def _bounds(indptr, name: str, rows: int | None = None) -> list[int]:
    """An indptr's entries, checked: starts at 0, non-decreasing, ends at `rows` if given."""
    bounds = index_vector(indptr, name).tolist()
    if not bounds or bounds[0] != 0 or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"{name}: expected a non-decreasing [batch_size + 1] vector starting at 0, got {bounds}")
    if rows is not None and bounds[-1] != rows:
        raise ValueError(f"{name}: ends at {bounds[-1]} but the tensor has {rows} rows")
    return bounds


def _kv_rows_ref(k, v, kv_indptr, page_table: PageTable | None, kv_layout: str, batch: int):
    """Per request, (kv_len, a function giving its K and V rows [kv_len, Hk, D] float64)."""
    if page_table is None:
        bounds = _bounds(kv_indptr, "kv_indptr", k.shape[0])
        if len(bounds) != batch + 1:
            raise ValueError(f"kv_indptr: {len(bounds) - 1} requests, qo_indptr {batch}")
        return [(hi - lo, lambda lo=lo, hi=hi: (_float64(k[lo:hi]), _float64(v[lo:hi])))
                for lo, hi in zip(bounds[:-1], bounds[1:])]
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    if page_table.batch_size != batch:
        raise ValueError(f"page_table: {page_table.batch_size} requests, qo_indptr {batch}")
    page_size = k.shape[1] if kv_layout == "NHD" else k.shape[2]
    table = PageTable(page_table.layout, tuple(t.cpu() for t in page_table.tensors), batch)
    lens = table.kv_lens(page_size).tolist()

    def rows(b: int, n: int):
        k_pages, v_pages = request_pages_ref(table, b, -(-n // page_size))
        return gather_rows_ref(k, k_pages, n, kv_layout), gather_rows_ref(v, v_pages, n, kv_layout)

    return [(n, lambda b=b, n=n: rows(b, n)) for b, n in enumerate(lens)]


def _float64(x: torch.Tensor) -> torch.Tensor:
    return x.float().double() if x.element_size() == 1 else x.double()  # fp8 through float32, as gather_rows_ref


def _request_masks(qo_bounds, kv_lens, causal, custom_mask, packed_custom_mask, mask_indptr) -> list:
    """Per request: None (no mask), "causal" or a bool [qo_len, kv_len] tensor."""
    qo_lens = [hi - lo for lo, hi in zip(qo_bounds[:-1], qo_bounds[1:])]
    if custom_mask is None and packed_custom_mask is None:
        return ["causal" if causal else None] * len(qo_lens)
    packed = packed_custom_mask is not None
    sizes = [-(-m * n // 8) if packed else m * n for m, n in zip(qo_lens, kv_lens)]
    if mask_indptr is None:
        starts = list(itertools.accumulate(sizes, initial=0))
    else:
        starts = _bounds(mask_indptr, "mask_indptr")
    name = "packed_custom_mask" if packed else "custom_mask"
    data = (packed_custom_mask if packed else custom_mask).reshape(-1)
    if len(starts) != len(sizes) + 1 or [b - a for a, b in zip(starts[:-1], starts[1:])] != sizes \
            or starts[-1] > data.numel():
        raise ValueError(f"{name}: expected {'bytes' if packed else 'elements'} per request {sizes} from "
                         f"mask_indptr {starts} within its {data.numel()}")
    masks = []
    for b, (m, n) in enumerate(zip(qo_lens, kv_lens)):
        bits = unpack_mask_ref(data, starts[b], m * n) if packed else data[starts[b]: starts[b] + m * n].bool()
        masks.append(bits.view(m, n))
    return masks


__all__ = ["packbits_ref", "prefill_ref", "segment_packbits_ref", "unpack_mask_ref"]

"""Float64 references of the RoPE family (apply_rope*, llama31, cos/sin cache, fp8
quantize and the fused append). Plain torch, vectorized, on the inputs' device."""

from __future__ import annotations


import torch

from ..runtime.page_table import PageTable
from .common import cos_sin_from_freq, inv_freq_ref, rope_at_positions_ref, rotate_ref  # noqa: F401


def positions_from_indptr(indptr: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    indptr, offsets = indptr.cpu().long(), offsets.cpu().long()
    counts = indptr[1:] - indptr[:-1]
    b = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    t = torch.arange(int(indptr[-1]))
    return (offsets[b] + t - indptr[b]).to(torch.int32)


def apply_rope_ref(q, k, positions, rotary_dim=None, interleave=False, rope_scale=1.0, rope_theta=1e4,
                   llama31=None, cos_sin_cache=None):
    """(q_rope, k_rope) in float64 on the CPU: the first rotary_dim dims rotated."""
    rd = q.shape[-1] if rotary_dim is None else rotary_dim
    if cos_sin_cache is not None:
        table = cos_sin_cache.double().cpu()[positions.cpu().long()]
        cos, sin = table[:, : rd // 2], table[:, rd // 2:]
    else:
        cos, sin = cos_sin_from_freq(positions, inv_freq_ref(rd, rope_scale, rope_theta, llama31))
    outs = []
    for x in (q, k):
        x = x.double().cpu()
        outs.append(torch.cat([rotate_ref(x[..., :rd], cos, sin, interleave), x[..., rd:]], dim=-1))
    return tuple(outs)


def cos_sin_cache_ref(max_position: int, rotary_dim: int, rope_theta: float = 1e4) -> torch.Tensor:
    """vLLM's cos_sin_cache: [max_position, rotary_dim] float32 = [cos | sin]."""
    cos, sin = cos_sin_from_freq(torch.arange(max_position), inv_freq_ref(rotary_dim, 1.0, rope_theta))
    return torch.cat([cos, sin], dim=-1).float()


def rope_quantize_ref(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, interleave,
                      quant_scale_q, quant_scale_kv, dtype):
    """(q_rope_out, k_rope_out, q_nope_out, k_nope_out) quantized to `dtype`: fp8(x * scale)
    of the rotated (float64) rope parts and the nope parts; 2-D (MLA) k tensors stay 2-D."""
    rd = q_rope.shape[-1]
    table = cos_sin_cache.double().cpu()[pos_ids.cpu().long()]
    cos, sin = table[:, : rd // 2], table[:, rd // 2:]

    def rot(x):
        x3 = x.double().cpu()
        x3 = x3.unsqueeze(1) if x3.dim() == 2 else x3
        out = rotate_ref(x3, cos, sin, interleave)
        return out.squeeze(1) if x.dim() == 2 else out

    def quant(x, scale):
        return (x.double().cpu() * scale).to(dtype)

    return (quant(rot(q_rope), quant_scale_q), quant(rot(k_rope), quant_scale_kv),
            quant(q_nope, quant_scale_q), quant(k_nope, quant_scale_kv))


def rope_quantize_append_ref(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, caches,
                             page_table: PageTable, batch_indices, positions, interleave,
                             quant_scale_q, quant_scale_kv, kv_layout="NHD"):
    """The fused op on clones of `caches`: returns (q_rope_out, q_nope_out, new caches).
    Padding tokens (batch index -1): q outputs zero, nothing written."""
    from .append import page_slots_ref

    dtype = caches[0].dtype
    mla = k_rope.dim() == 2
    qr, kr, qn, kn = rope_quantize_ref(q_rope, k_rope, q_nope, k_nope, cos_sin_cache,
                                       torch.where(batch_indices >= 0, pos_ids, 0), interleave,
                                       quant_scale_q, quant_scale_kv, dtype)
    pad = (batch_indices < 0).cpu()
    qr = qr.view(torch.uint8).clone()
    qn = qn.view(torch.uint8).clone()
    qr[pad] = 0
    qn[pad] = 0
    out = [c.clone() for c in caches]
    num_pages = caches[0].shape[0]
    page_size = caches[0].shape[1] if (mla or kv_layout == "NHD") else caches[0].shape[2]
    tokens, k_page, v_page, slot = page_slots_ref(batch_indices, positions, page_table, page_size, num_pages)
    tokens, k_page, v_page, slot = (x.cpu() for x in (tokens, k_page, v_page, slot))
    if mla:  # (ckv_cache [P, S, N], kpe_cache [P, S, R])
        ckv, kpe = (c.cpu().view(torch.uint8) for c in out)
        ckv[k_page, slot] = kn.view(torch.uint8)[tokens]
        kpe[k_page, slot] = kr.view(torch.uint8)[tokens]
        new = (ckv.view(dtype).to(caches[0].device), kpe.view(dtype).to(caches[0].device))
    else:
        kc, vc = (c.cpu().view(torch.uint8) for c in out)
        krow = torch.cat([kr.view(torch.uint8), kn.view(torch.uint8)], dim=-1)[tokens]
        vrow = (v.double().cpu() * quant_scale_kv).to(dtype).view(torch.uint8)[tokens]
        if kv_layout == "NHD":
            kc[k_page, slot] = krow
            vc[v_page, slot] = vrow
        else:
            kc[k_page, :, slot] = krow
            vc[v_page, :, slot] = vrow
        new = (kc.view(dtype).to(caches[0].device), vc.view(dtype).to(caches[0].device))
    return qr.view(dtype), qn.view(dtype), new

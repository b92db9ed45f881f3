"""RoPE (FlashInfer's API): apply_rope*, apply_llama31_rope*, apply_rope_with_cos_sin_cache*,
rope_quantize_fp8 and rope_quantize_fp8_append_paged_kv_cache.

All of them run one kernel (csrc/kvcache/rope.cuh, RopeSpec). A head row is split into a rotated
part (the first rotary_dim dims, or MLA's separate rope tensor) and a passed-through part;
the split is expressed as tensor views, so partial rotary dims, in-place updates and MLA
need no copies.
"""

from __future__ import annotations

import functools
import math

import torch

from ..pipeline import env
from ..pipeline.jit import get_module, op_cache, traced_op
from ..pipeline.spec import FP8_DTYPES, dtype_name
from ..runtime.checks import (
    aligned16,
    as_int32_index,
    compiling,
    constant_result,
    dtype_str,
    expect_index_vector,
    expect_same_cuda_device,
    expect_vector_aligned,
    index_ok,
    index_vector,
    same_cuda_device,
)
from ..runtime.device import placeholder
from ..runtime.page_table import PageTable, csr_page_table, unpack_paged_kv_cache
from ..runtime.shared_specs import RopeSpec

_HALF = ("float16", "bfloat16")
_HALF_TORCH = (torch.float16, torch.bfloat16)
_FP8_TORCH = (torch.float8_e4m3fn, torch.float8_e5m2)


def _empty_like_rows(t, width: int):
    """A [nnz, heads, 0]-style empty view standing in for an absent part."""
    return t.new_empty((t.shape[0], t.shape[1], width))


def _check_qk(q, k, name_q="q", name_k="k"):
    import torch

    for name, t in ((name_q, q), (name_k, k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name}: expected [nnz, num_heads, head_dim], got shape {tuple(t.shape)}")
        if dtype_name(t.dtype) not in _HALF:
            raise TypeError(f"{name}: expected dtype float16 or bfloat16, got {dtype_str(t.dtype)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head_dim dimension must be contiguous")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{name_k}: expected {q.shape[0]} tokens like {name_q}, got {k.shape[0]}")
    if q.dtype != k.dtype:
        raise TypeError(f"{name_k}: dtype {dtype_str(k.dtype)} differs from {name_q}'s {dtype_str(q.dtype)}")


def _rotary_dim(head_dim: int, rotary_dim: int | None) -> int:
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if not (0 < rotary_dim <= head_dim) or rotary_dim % 16 or head_dim % 16:
        raise ValueError(f"rotary_dim: expected a multiple of 16 in 16..head_dim ({head_dim}), got {rotary_dim}"
                         + ("" if head_dim % 16 == 0 else f"; head_dim {head_dim} must be a multiple of 16"))
    return rotary_dim


def _llama31_smooth(low_freq_factor: float, high_freq_factor: float, old_context_len: float):
    """Llama 3.1: s = clamp(freq * a + b, 0, 1) with a = L / (2 pi (high - low)),
    b = -low / (high - low); freq' = (1 - s) freq / scale + s freq."""
    if high_freq_factor <= low_freq_factor:
        raise ValueError(f"high_freq_factor ({high_freq_factor}) must exceed low_freq_factor ({low_freq_factor})")
    span = high_freq_factor - low_freq_factor
    return old_context_len / (2 * math.pi * span), -low_freq_factor / span


def _run_rope(q, k, q_out, k_out, *, rotary_dim, interleave, pos_ids=None, indptr=None, offsets=None,
              cos_sin_cache=None, rope_scale=1.0, rope_theta=1e4, smooth=(0.0, 0.0)) -> None:
    import torch

    _check_qk(q, k)
    head_dim = q.shape[2]
    if k.shape[2] != head_dim:
        raise ValueError(f"k: head_dim {k.shape[2]} differs from q's {head_dim}")
    rd = _rotary_dim(head_dim, rotary_dim)
    if not isinstance(interleave, bool):
        raise TypeError(f"interleave: expected a bool, got {type(interleave).__name__}")
    nnz = q.shape[0]
    empty = _empty_int32(q.device)
    if pos_ids is not None:
        pos_ids = index_vector(pos_ids, "pos_ids", nnz, "[nnz] (one per token)")
        positions, named = "pos_ids", {"pos_ids": pos_ids}
        indptr = offsets = empty
    else:
        indptr = index_vector(indptr, "indptr", what="[batch_size + 1]")
        offsets = index_vector(offsets, "offsets", indptr.shape[0] - 1, "[batch_size]")
        positions, named = "indptr", {"indptr": indptr, "offsets": offsets}
        pos_ids = empty
    if cos_sin_cache is not None:
        _check_cos_sin_cache(cos_sin_cache, rd)
        named["cos_sin_cache"] = cos_sin_cache
    if rope_scale <= 0 or rope_theta <= 0:
        raise ValueError(f"rope_scale and rope_theta must be positive, got {rope_scale}, {rope_theta}")
    if not aligned16(q, k, q_out, k_out):  # 8 elements of 16 bits: 16 bytes, checked in one pass
        for name, t in (("q", q), ("k", k), ("q_out", q_out), ("k_out", k_out)):
            expect_vector_aligned(t, name, 8 * t.element_size())
    if not same_cuda_device((q, k, q_out, k_out, *named.values())):
        expect_same_cuda_device({"q": q, "k": k, "q_out": q_out, "k_out": k_out, **named})
    config = (q.dtype, q.dtype, interleave, positions, cos_sin_cache is not None, "none", "NHD")
    if compiling():  # Dynamo traces this: no value checks (a device sync), the op by its name
        op = traced_op(_rope_namespace(*config), "rope")
    else:
        debug = env.debug()
        if debug and cos_sin_cache is not None:
            _check_positions_in_cache(pos_ids, cos_sin_cache)
        op = _rope_op(*config, debug)
    if rd == head_dim:  # the whole row rotates: no views needed
        parts = (q, k, empty, empty, q_out, k_out, empty, empty)
    else:
        parts = (q[..., :rd], k[..., :rd], q[..., rd:], k[..., rd:], q_out[..., :rd], k_out[..., :rd],
                 q_out[..., rd:], k_out[..., rd:])
    op(*parts, pos_ids, indptr, offsets, cos_sin_cache if cos_sin_cache is not None else _empty_f32(q.device),
       float(rope_scale), float(rope_theta), float(smooth[0]), float(smooth[1]), 1.0, 1.0)


def _rope_spec(dtype_in, dtype_out, interleave: bool, positions: str, cached_angles: bool,
               table_layout: str = "none", kv_layout: str = "NHD") -> RopeSpec:
    return RopeSpec(dtype_name(dtype_in), dtype_name(dtype_out), interleave, positions,
                    "cache" if cached_angles else "computed", table_layout, kv_layout).validate()


@op_cache
def _rope_op(dtype_in, dtype_out, interleave: bool, positions: str, cached_angles: bool, table_layout: str,
             kv_layout: str, debug: bool):
    """The module's one op: `rope`, or `rope_append` where a page table is given."""
    spec = _rope_spec(dtype_in, dtype_out, interleave, positions, cached_angles, table_layout, kv_layout)
    return getattr(get_module(spec), "rope_append" if spec.append else "rope")


@constant_result
def _rope_namespace(dtype_in, dtype_out, interleave: bool, positions: str, cached_angles: bool,
                    table_layout: str, kv_layout: str) -> str:
    spec = _rope_spec(dtype_in, dtype_out, interleave, positions, cached_angles, table_layout, kv_layout)
    return get_module(spec).namespace


def _empty_f32(device):
    return _new_empty(device, torch.float32) if compiling() else placeholder(device, torch.float32)


def _check_cos_sin_cache(cos_sin_cache, rope_dim: int) -> None:
    import torch

    if not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dtype != torch.float32:
        raise TypeError("cos_sin_cache: expected a float32 tensor [max_position, rotary_dim] "
                        "(cos in the first half, sin in the second)")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rope_dim or not cos_sin_cache.is_contiguous():
        raise ValueError(f"cos_sin_cache: expected a contiguous [max_position, {rope_dim}] tensor, "
                         f"got shape {tuple(cos_sin_cache.shape)}")


def _check_positions_in_cache(pos_ids, cos_sin_cache, mask=None) -> None:
    """Debug mode (a device sync): every position has a cos_sin_cache row."""
    pos = pos_ids if mask is None else pos_ids[mask]
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= cos_sin_cache.shape[0]):
        raise ValueError(f"cos_sin_cache: has {cos_sin_cache.shape[0]} rows but pos_ids reach "
                         f"{int(pos.max())} (min {int(pos.min())}); extend the cache")


# --- FlashInfer's apply_rope family ---------------------------------------------------------
def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    _run_rope(q, k, q, k, rotary_dim=rotary_dim, interleave=interleave, indptr=indptr, offsets=offsets,
              rope_scale=rope_scale, rope_theta=rope_theta)


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    q_rope, k_rope = _outputs_like(q, k)
    _run_rope(q, k, q_rope, k_rope, rotary_dim=rotary_dim, interleave=interleave, indptr=indptr,
              offsets=offsets, rope_scale=rope_scale, rope_theta=rope_theta)
    return q_rope, k_rope


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    _run_rope(q, k, q, k, rotary_dim=rotary_dim, interleave=interleave, pos_ids=pos_ids,
              rope_scale=rope_scale, rope_theta=rope_theta)


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    q_rope, k_rope = _outputs_like(q, k)
    _run_rope(q, k, q_rope, k_rope, rotary_dim=rotary_dim, interleave=interleave, pos_ids=pos_ids,
              rope_scale=rope_scale, rope_theta=rope_theta)
    return q_rope, k_rope


def apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8,
                               rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=8192):
    _run_rope(q, k, q, k, rotary_dim=rotary_dim, interleave=interleave, indptr=indptr, offsets=offsets,
              rope_scale=rope_scale, rope_theta=rope_theta,
              smooth=_llama31_smooth(low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8,
                       rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=8192):
    q_rope, k_rope = _outputs_like(q, k)
    _run_rope(q, k, q_rope, k_rope, rotary_dim=rotary_dim, interleave=interleave, indptr=indptr,
              offsets=offsets, rope_scale=rope_scale, rope_theta=rope_theta,
              smooth=_llama31_smooth(low_freq_factor, high_freq_factor, old_context_len))
    return q_rope, k_rope


def apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8,
                                       rope_theta=5e5, low_freq_factor=1, high_freq_factor=4,
                                       old_context_len=8192):
    _run_rope(q, k, q, k, rotary_dim=rotary_dim, interleave=interleave, pos_ids=pos_ids,
              rope_scale=rope_scale, rope_theta=rope_theta,
              smooth=_llama31_smooth(low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8,
                               rope_theta=5e5, low_freq_factor=1, high_freq_factor=4, old_context_len=8192):
    q_rope, k_rope = _outputs_like(q, k)
    _run_rope(q, k, q_rope, k_rope, rotary_dim=rotary_dim, interleave=interleave, pos_ids=pos_ids,
              rope_scale=rope_scale, rope_theta=rope_theta,
              smooth=_llama31_smooth(low_freq_factor, high_freq_factor, old_context_len))
    return q_rope, k_rope


def _outputs_like(q, k):
    import torch

    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise TypeError("q and k must be tensors")
    # Dims past rotary_dim are copied by the kernel, so plain empty outputs are fully written.
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format)


def _heads_view(t, name: str, head_size: int):
    """vLLM/SGLang's [nnz, heads * head_size] -> [nnz, heads, head_size] (a view)."""
    import torch

    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name}: expected [nnz, num_heads * head_size], got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.shape[1] % head_size:
        raise ValueError(f"{name}: width {t.shape[1]} is not a multiple of head_size {head_size}")
    return t.view(t.shape[0], -1, head_size)


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    q, k = _heads_view(query, "query", head_size), _heads_view(key, "key", head_size)
    _check_cos_sin_cache(cos_sin_cache, cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1)
    _run_rope(q, k, q, k, rotary_dim=cos_sin_cache.shape[1], interleave=not is_neox, pos_ids=positions,
              cos_sin_cache=cos_sin_cache)


def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    import torch

    q, k = _heads_view(query, "query", head_size), _heads_view(key, "key", head_size)
    _check_cos_sin_cache(cos_sin_cache, cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1)
    query_out, key_out = torch.empty_like(query), torch.empty_like(key)
    _run_rope(q, k, query_out.view_as(q), key_out.view_as(k), rotary_dim=cos_sin_cache.shape[1],
              interleave=not is_neox, pos_ids=positions, cos_sin_cache=cos_sin_cache)
    return query_out, key_out


# --- fp8: rope + quantize (+ append) -------------------------------------------------------
def _quantize_dtype(quantize_dtype, *outs):
    import torch

    if quantize_dtype is None:  # the first given output's, else e4m3 (FlashInfer's rule)
        given = [o.dtype for o in outs if o is not None]
        quantize_dtype = given[0] if given else torch.float8_e4m3fn
    if dtype_name(quantize_dtype) not in FP8_DTYPES:
        raise TypeError(f"quantize_dtype: expected float8_e4m3fn or float8_e5m2, got {dtype_str(quantize_dtype)}")
    return quantize_dtype


def _as_rows(t, name: str):
    """MLA passes 2-D k tensors [nnz, dim]: one head."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t


def _check_rows(t, name: str, nnz: int, heads: int, dtype) -> None:
    if t.dim() != 3 or t.shape[0] != nnz or t.shape[1] != heads:
        raise ValueError(f"{name}: expected [nnz={nnz}, {heads} heads, dim], got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype_str(dtype)} like q_rope, got {dtype_str(t.dtype)}")
    if t.shape[2] % 16:
        raise ValueError(f"{name}: the head dimension ({t.shape[2]}) must be a multiple of 16")
    if t.shape[2] and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")
    if t.numel():
        expect_vector_aligned(t, name, 8 * t.element_size())


def _fp8_inputs(q_rope, k_rope, q_nope, k_nope):
    """Normalise (q_rope, k_rope, q_nope, k_nope) to 3-D with empty nope parts where absent."""
    import torch

    if not isinstance(q_rope, torch.Tensor) or q_rope.dim() != 3:
        raise ValueError("q_rope: expected [nnz, num_qo_heads, rope_dim]")
    if dtype_name(q_rope.dtype) not in _HALF:
        raise TypeError(f"q_rope: expected dtype float16 or bfloat16, got {dtype_str(q_rope.dtype)}")
    mla = isinstance(k_rope, torch.Tensor) and k_rope.dim() == 2
    k_rope = _as_rows(k_rope, "k_rope")
    nnz, hq, rope_dim = q_rope.shape
    hk = k_rope.shape[1]
    q_nope = _empty_like_rows(q_rope, 0) if q_nope is None else q_nope
    k_nope = _empty_like_rows(k_rope, 0) if k_nope is None else _as_rows(k_nope, "k_nope")
    _check_rows(q_rope, "q_rope", nnz, hq, q_rope.dtype)
    _check_rows(k_rope, "k_rope", nnz, hk, q_rope.dtype)
    _check_rows(q_nope, "q_nope", nnz, hq, q_rope.dtype)
    _check_rows(k_nope, "k_nope", nnz, hk, q_rope.dtype)
    if k_rope.shape[2] != rope_dim:
        raise ValueError(f"k_rope: rope dim {k_rope.shape[2]} differs from q_rope's {rope_dim}")
    if q_nope.shape[2] != k_nope.shape[2]:
        raise ValueError(f"k_nope: dim {k_nope.shape[2]} differs from q_nope's {q_nope.shape[2]}")
    return q_rope, k_rope, q_nope, k_nope, mla


def rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox=True,
                      quantize_dtype=None, quant_scale_q=1.0, quant_scale_kv=1.0, q_rope_out=None,
                      k_rope_out=None, q_nope_out=None, k_nope_out=None, enable_pdl=False, backend="cuda"):
    """RoPE on the rope parts, then every part quantized to fp8 (x * scale).
    Returns (q_rope_out, k_rope_out, q_nope_out, k_nope_out). backend: "cuda" (FlashInfer's
    default) or "auto" run this package's kernel; FlashInfer's "cutile" is not available."""
    _check_backend(backend)
    k_rope_in, k_nope_in = k_rope, k_nope
    q_rope, k_rope, q_nope, k_nope, mla = _fp8_inputs(q_rope, k_rope, q_nope, k_nope)
    qdt = _quantize_dtype(quantize_dtype, q_rope_out, k_rope_out, q_nope_out, k_nope_out)
    outs = []
    for given, like, name in ((q_rope_out, q_rope, "q_rope_out"), (k_rope_out, k_rope_in, "k_rope_out"),
                              (q_nope_out, q_nope, "q_nope_out"),
                              (k_nope_out, k_nope_in if k_nope_in is not None else k_nope, "k_nope_out")):
        out = torch.empty(like.shape, dtype=qdt, device=like.device) if given is None else given
        if tuple(out.shape) != tuple(like.shape) or out.dtype != qdt:
            raise ValueError(f"{name}: expected shape {tuple(like.shape)} and dtype {dtype_str(qdt)}, "
                             f"got {tuple(out.shape)} {dtype_str(out.dtype)}")
        outs.append(out)
    for name, o in zip(("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"), outs):
        if o.numel():
            expect_vector_aligned(o, name, 8)
    _check_cos_sin_cache(cos_sin_cache, q_rope.shape[2])
    pos_ids = index_vector(pos_ids, "pos_ids", q_rope.shape[0], "[nnz]")
    config = (q_rope.dtype, qdt, not is_neox, "pos_ids", True, "none", "NHD")
    expect_same_cuda_device({"q_rope": q_rope, "k_rope": k_rope, "pos_ids": pos_ids,
                             "cos_sin_cache": cos_sin_cache, **{f"out{i}": o for i, o in enumerate(outs)}})
    if compiling():
        op = traced_op(_rope_namespace(*config), "rope")
    else:
        debug = env.debug()
        if debug:
            _check_positions_in_cache(pos_ids, cos_sin_cache)
        op = _rope_op(*config, debug)
    empty = _empty_int32(q_rope.device)
    rows = [o.unsqueeze(1) if o.dim() == 2 else o for o in outs]
    op(q_rope, k_rope, q_nope, k_nope, rows[0], rows[1], rows[2], rows[3], pos_ids, empty, empty,
       cos_sin_cache, 1.0, 1e4, 0.0, 0.0, float(quant_scale_q), float(quant_scale_kv))
    return tuple(outs)


def mla_rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox=True,
                          quantize_dtype=None, quant_scale_q=1.0, quant_scale_kv=1.0, q_rope_out=None,
                          k_rope_out=None, q_nope_out=None, k_nope_out=None, enable_pdl=False):
    """FlashInfer's MLA name for rope_quantize_fp8 (k_rope, k_nope 2-D [nnz, dim]: one
    latent head); the same arguments and return value."""
    return rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox, quantize_dtype,
                             quant_scale_q, quant_scale_kv, q_rope_out, k_rope_out, q_nope_out, k_nope_out,
                             enable_pdl)


_BACKENDS = ("auto", "cuda")  # both run this package's kernel
_FLASHINFER_ONLY_BACKENDS = ("cutile",)  # FlashInfer's cuda.tile kernel: not here


def _check_backend(backend) -> None:
    if backend in _BACKENDS:
        return
    if backend in _FLASHINFER_ONLY_BACKENDS:
        raise ValueError(f"backend: {backend!r} is FlashInfer's cuda.tile kernel, which flashinfer_jit does "
                         f"not have; use {' or '.join(map(repr, _BACKENDS))} (this package's CUDA kernel)")
    raise ValueError(f"backend: expected {', '.join(map(repr, _BACKENDS + _FLASHINFER_ONLY_BACKENDS))}, "
                     f"got {backend!r}")


def rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache, kv_indices=None,
        kv_indptr=None, batch_indices=None, positions=None, is_neox=True, quantize_dtype=None,
        quant_scale_q=1.0, quant_scale_kv=1.0, page_size=16, kv_layout="NHD", q_rope_out=None,
        q_nope_out=None, enable_pdl=False, *, page_table: PageTable | None = None):
    """RoPE + fp8 quantization of q, k (and v), k/v written into the paged cache at
    (batch_indices, positions); returns the quantized (q_rope_out, q_nope_out).

    GQA/MHA: paged_kv_cache = (k_cache, v_cache) 4-D (NHD/HND), K rows = [rope | nope].
    MLA (2-D k_rope): paged_kv_cache = (ckv_cache, kpe_cache) 3-D [pages, page_size, dim], v None.
    Tokens with batch_indices == -1 are padding: no RoPE, no K/V store, no cache write;
    their q outputs are zeros. The page table is FlashInfer's (kv_indices, kv_indptr) or
    any flashinfer_jit.runtime.page_table layout via page_table=.
    """
    args = None
    if q_nope is None and k_nope is None and page_table is None and q_nope_out is None:
        args = _fused_fast(q_rope, k_rope, v, cos_sin_cache, pos_ids, paged_kv_cache, kv_indices, kv_indptr,
                           batch_indices, positions, quantize_dtype, page_size, kv_layout, q_rope_out)
    if args is None:  # anything unusual, or bad input: the detailed path (raises naming the argument)
        pos_ids = as_int32_index(pos_ids, "pos_ids")  # int64 indices are narrowed once, here
        batch_indices = as_int32_index(batch_indices, "batch_indices")
        positions = as_int32_index(positions, "positions")
        args = _fused_slow(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache,
                           kv_indices, kv_indptr, batch_indices, positions, quantize_dtype, page_size,
                           kv_layout, q_rope_out, q_nope_out, page_table)
    (q_rope, k_rope, q_nope, k_nope, v, q_rope_out, q_nope_out, k_rope_cache, k_nope_cache, nope_offset,
     v_cache, table, layout, qdt, num_pages, cache_page_size) = args
    config = (q_rope.dtype, qdt, not is_neox, "pos_ids", True, table.layout, layout)
    if compiling():  # Dynamo traces this: no value checks (a device sync), the op by its name
        op = traced_op(_rope_namespace(*config), "rope_append")
    else:
        debug = env.debug()
        if debug:
            from .append import check_append_values

            _check_positions_in_cache(pos_ids, cos_sin_cache, batch_indices >= 0)
            check_append_values(batch_indices, positions, table, num_pages, cache_page_size)
        op = _rope_op(*config, debug)
    empty = _empty_int32(q_rope.device)
    op(q_rope, k_rope, q_nope, k_nope, v, q_rope_out, q_nope_out, pos_ids, empty, empty, cos_sin_cache,
       1.0, 1e4, 0.0, 0.0, float(quant_scale_q), float(quant_scale_kv), k_rope_cache, k_nope_cache,
       nope_offset, v_cache, table.tensors, batch_indices, positions)
    return q_rope_out, q_nope_out


def _empty_int32(device):
    """A 0-element int32 placeholder for absent optional tensors: one per device, made once;
    a new one while torch.compile traces (Dynamo would trace through the cache, warning)."""
    return _new_empty(device, torch.int32) if compiling() else placeholder(device, torch.int32)


def _new_empty(device, dtype):
    return torch.empty(0, dtype=dtype, device=device)


def _fused_fast(q_rope, k_rope, v, cos_sin_cache, pos_ids, paged_kv_cache, kv_indices, kv_indptr,
                batch_indices, positions, quantize_dtype, page_size, kv_layout, q_rope_out):
    """The common GQA/MHA call (no nope parts, CSR table) checked in one cheap pass;
    None sends the call down the detailed path."""
    if not (isinstance(q_rope, torch.Tensor) and isinstance(k_rope, torch.Tensor) and isinstance(v, torch.Tensor)
            and type(paged_kv_cache) is tuple and len(paged_kv_cache) == 2 and kv_layout in ("NHD", "HND")
            and q_rope.dim() == 3 and k_rope.dim() == 3 and v.dim() == 3):
        return None
    k_cache, v_cache = paged_kv_cache
    qdt = torch.float8_e4m3fn if quantize_dtype is None and q_rope_out is None else \
        (quantize_dtype if quantize_dtype is not None else q_rope_out.dtype)
    nnz, _, rope_dim = q_rope.shape
    dtype = q_rope.dtype
    if not (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor) and k_cache.dim() == 4
            and k_cache.shape == v_cache.shape and k_cache.dtype == qdt and v_cache.dtype == qdt
            and qdt in _FP8_TORCH and dtype in _HALF_TORCH and k_rope.dtype == dtype and v.dtype == dtype):
        return None
    heads = k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]
    cache_page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    if not (rope_dim % 16 == 0 and k_rope.shape == (nnz, heads, rope_dim) and v.shape == (nnz, heads, rope_dim)
            and k_cache.shape[3] == rope_dim and page_size == cache_page_size
            and q_rope.stride(-1) == 1 and k_rope.stride(-1) == 1 and v.stride(-1) == 1
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
            and isinstance(cos_sin_cache, torch.Tensor) and cos_sin_cache.dtype == torch.float32
            and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == rope_dim and cos_sin_cache.is_contiguous()
            and index_ok(pos_ids, nnz) and index_ok(batch_indices, nnz) and index_ok(positions, nnz)
            and index_ok(kv_indptr) and kv_indptr.shape[0] >= 1 and index_ok(kv_indices)
            and aligned16(q_rope, k_rope, v, k_cache, v_cache)):
        return None
    if q_rope_out is None:
        q_rope_out = torch.empty(q_rope.shape, dtype=qdt, device=q_rope.device)
    elif not (q_rope_out.shape == q_rope.shape and q_rope_out.dtype == qdt and aligned16(q_rope_out)):
        return None
    if not same_cuda_device((q_rope, k_rope, v, k_cache, v_cache, cos_sin_cache, pos_ids, batch_indices,
                             positions, kv_indptr, kv_indices, q_rope_out)):
        return None
    empty = _empty_int32(q_rope.device)
    table = PageTable("csr", (kv_indptr, kv_indices, empty), kv_indptr.shape[0] - 1)
    return (q_rope, k_rope, empty, empty, v, q_rope_out, empty, k_cache, k_cache, rope_dim, v_cache, table,
            kv_layout, qdt, k_cache.shape[0], cache_page_size)


def _fused_slow(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache, kv_indices,
                kv_indptr, batch_indices, positions, quantize_dtype, page_size, kv_layout, q_rope_out,
                q_nope_out, page_table):
    """Every check, one at a time, raising naming the argument; returns the normalized
    arguments of the op (see rope_quantize_fp8_append_paged_kv_cache)."""
    q_rope, k_rope, q_nope, k_nope, mla = _fp8_inputs(q_rope, k_rope, q_nope, k_nope)
    nnz, _, rope_dim = q_rope.shape
    qdt = _quantize_dtype(quantize_dtype, q_rope_out, q_nope_out)
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        raise TypeError("paged_kv_cache: expected a (k_cache, v_cache) or, for MLA, (ckv_cache, kpe_cache) tuple")
    if mla:
        if v is not None:
            raise ValueError("v: MLA (2-D k_rope) has no separate V; pass None")
        ckv, kpe = paged_kv_cache
        for name, t, dim in (("ckv_cache", ckv, k_nope.shape[2]), ("kpe_cache", kpe, rope_dim)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[2] != dim:
                raise ValueError(f"paged_kv_cache ({name}): expected [num_pages, page_size, {dim}], got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            if t.dtype != qdt:
                raise TypeError(f"paged_kv_cache ({name}): expected dtype {dtype_str(qdt)}, got {dtype_str(t.dtype)}")
            if t.stride(-1) != 1:
                raise ValueError(f"paged_kv_cache ({name}): the last dimension must be contiguous")
        if ckv.shape[:2] != kpe.shape[:2]:
            raise ValueError("paged_kv_cache: ckv_cache and kpe_cache differ in [num_pages, page_size]")
        k_rope_cache, k_nope_cache, v_cache, v = kpe, ckv, ckv.new_empty(0), q_rope.new_empty(0)
        cache_page_size, num_pages, layout = kpe.shape[1], kpe.shape[0], "NHD"
    else:
        cache = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
        if cache.dtype != qdt:
            raise TypeError(f"paged_kv_cache: expected dtype {dtype_str(qdt)} (quantize_dtype), got {cache.dtype_name}")
        if cache.head_dim != rope_dim + k_nope.shape[2]:
            raise ValueError(f"paged_kv_cache: head_dim {cache.head_dim} != rope dim {rope_dim} + nope dim "
                             f"{k_nope.shape[2]}")
        if cache.num_kv_heads != k_rope.shape[1]:
            raise ValueError(f"k_rope: {k_rope.shape[1]} heads, but the cache has {cache.num_kv_heads}")
        if not isinstance(v, torch.Tensor):
            raise ValueError("v: GQA/MHA needs a V tensor [nnz, num_kv_heads, head_dim]")
        _check_rows(v, "v", nnz, cache.num_kv_heads, q_rope.dtype)
        if v.shape[2] != cache.head_dim:
            raise ValueError(f"v: head_dim {v.shape[2]} differs from the cache's {cache.head_dim}")
        k_rope_cache, k_nope_cache, v_cache = cache.k[..., :rope_dim], cache.k[..., rope_dim:], cache.v
        cache_page_size, num_pages, layout = cache.page_size, cache.num_pages, kv_layout
    if page_size != cache_page_size:
        raise ValueError(f"page_size: {page_size} does not match the cache's page size {cache_page_size}")
    if page_table is None:
        page_table = csr_page_table(kv_indptr, kv_indices)
    elif kv_indices is not None or kv_indptr is not None:
        raise ValueError("give either kv_indices/kv_indptr or page_table=, not both")
    expect_index_vector(batch_indices, "batch_indices", nnz, "[nnz]")
    expect_index_vector(positions, "positions", nnz, "[nnz]")
    expect_index_vector(pos_ids, "pos_ids", nnz, "[nnz]")
    _check_cos_sin_cache(cos_sin_cache, rope_dim)
    q_rope_out = torch.empty(q_rope.shape, dtype=qdt, device=q_rope.device) if q_rope_out is None else q_rope_out
    q_nope_out = torch.empty(q_nope.shape, dtype=qdt, device=q_rope.device) if q_nope_out is None else q_nope_out
    for name, out, like in (("q_rope_out", q_rope_out, q_rope), ("q_nope_out", q_nope_out, q_nope)):
        if tuple(out.shape) != tuple(like.shape) or out.dtype != qdt:
            raise ValueError(f"{name}: expected shape {tuple(like.shape)} dtype {dtype_str(qdt)}")
    for name, t in (("paged_kv_cache (k rope part)", k_rope_cache), ("paged_kv_cache (k nope part)", k_nope_cache),
                    ("paged_kv_cache (v_cache)", v_cache), ("q_rope_out", q_rope_out), ("q_nope_out", q_nope_out)):
        if t.numel():
            expect_vector_aligned(t, name, 8)
    if not compiling():  # an unsupported combination: ValueError before the device check
        _rope_spec(q_rope.dtype, qdt, False, "pos_ids", True, page_table.layout, layout)
    expect_same_cuda_device({"q_rope": q_rope, "k_rope": k_rope, "pos_ids": pos_ids, "cos_sin_cache": cos_sin_cache,
                             "batch_indices": batch_indices, "positions": positions,
                             "paged_kv_cache": k_rope_cache,
                             **{f"page_table[{i}]": t for i, t in enumerate(page_table.tensors)}})
    k_offset = 0
    if not mla:  # GQA/MHA: rope and nope parts are one k_cache row, nope at offset rope_dim
        k_rope_cache, k_nope_cache, k_offset = cache.k, cache.k, rope_dim
    return (q_rope, k_rope, q_nope, k_nope, v, q_rope_out, q_nope_out, k_rope_cache, k_nope_cache, k_offset,
            v_cache, page_table, layout, qdt, num_pages, cache_page_size)


# FlashInfer's public names of flashinfer.rope (`from flashinfer_jit.rope import ...`)
__all__ = ["apply_rope", "apply_rope_inplace", "apply_rope_pos_ids", "apply_rope_pos_ids_inplace",
           "apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
           "apply_llama31_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache",
           "apply_rope_with_cos_sin_cache_inplace", "mla_rope_quantize_fp8", "rope_quantize_fp8",
           "rope_quantize_fp8_append_paged_kv_cache"]

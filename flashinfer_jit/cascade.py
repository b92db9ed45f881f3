"""merge_state / merge_states (FlashInfer's cascade API): combine partial attention
outputs by their base-2 log-sum-exps."""

from __future__ import annotations

import torch

from .pipeline.jit import get_module, op_cache
from .pipeline.spec import HEAD_DIMS, dtype_name
from .runtime.checks import dtype_str, expect_same_cuda_device
from .runtime.shared_specs import MergeSpec

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@op_cache
def _merge_op(dtype, head_dim: int, debug: bool):
    return get_module(MergeSpec(dtype_name(dtype), head_dim).validate()).merge_states


def merge_states(v, s):
    """v [n, num_states, num_heads, head_dim], s [n, num_states, num_heads] float32 ->
    (v [n, num_heads, head_dim], s [n, num_heads]). States with s = -inf weigh nothing;
    all -inf gives zeros and -inf."""
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError("v: expected [n, num_states, num_heads, head_dim]")
    if v.dtype not in _DTYPES:
        raise TypeError(f"v: expected float16, bfloat16 or float32, got {dtype_str(v.dtype)}")
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != tuple(v.shape[:3]):
        raise ValueError(f"s: expected float32 {tuple(v.shape[:3])} (the states' LSEs), got "
                         f"{tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__}")
    if v.shape[3] not in HEAD_DIMS:
        raise ValueError(f"v: head_dim {v.shape[3]} is not supported; supported: {', '.join(map(str, HEAD_DIMS))}")
    if v.stride(-1) != 1 or v.data_ptr() % 16 or any((st * v.element_size()) % 16 for st in v.stride()[:-1]):
        v = v.contiguous()
    s = s.contiguous()
    expect_same_cuda_device({"v": v, "s": s})
    n, _, heads, dim = v.shape
    v_out = torch.empty(n, heads, dim, dtype=v.dtype, device=v.device)
    s_out = torch.empty(n, heads, dtype=torch.float32, device=v.device)
    from .pipeline import env

    _merge_op(v.dtype, dim, env.debug())(v, s, v_out, s_out)
    return v_out, s_out


def merge_state(v_a, s_a, v_b, s_b):
    """Two partial states (v [n, num_heads, head_dim], s [n, num_heads]) -> merged (v, s)."""
    for name, t in (("v_a", v_a), ("v_b", v_b), ("s_a", s_a), ("s_b", s_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor")
    if v_a.shape != v_b.shape or v_a.dim() != 3:
        raise ValueError(f"v_a/v_b: expected one shape [n, num_heads, head_dim], got {tuple(v_a.shape)} and "
                         f"{tuple(v_b.shape)}")
    if s_a.shape != v_a.shape[:2] or s_b.shape != v_a.shape[:2]:
        raise ValueError(f"s_a/s_b: expected {tuple(v_a.shape[:2])}")
    return merge_states(torch.stack([v_a, v_b], dim=1), torch.stack([s_a, s_b], dim=1))


# FlashInfer's names of flashinfer.cascade that this package has (its cascade wrappers and
# merge_state_in_place it has not)
__all__ = ["merge_state", "merge_states"]

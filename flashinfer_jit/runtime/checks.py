"""Argument checks for the public API: each failure names the argument and what was
expected, and all of them run before anything is launched.

They cost well under a microsecond each (attribute reads, no device sync). Checks that
must read tensor *values* (page ids in range, last_page_len in 1..page_size, ...) need
a device sync, so they run only in debug mode (FLASHINFER_JIT_DEBUG=1) or where the
caller asks for them.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import torch

# True while torch.compile's Dynamo traces a call (the only part of torch.compile that runs
# this Python; AOTAutograd and Inductor see the graph it records). Tensors are fakes then,
# with no data pointer, so the checks that read one pass and the ops' bindings check the
# same at run time (csrc/runtime/torch_binding.h: expect_aligned). False in eager mode at ~30 ns.
compiling = torch.compiler.is_dynamo_compiling


def static_inputs(*tensors) -> None:
    """torch._dynamo.mark_static_address(t) for each tensor (None skipped), without its
    `import torch._dynamo` (seconds, see constant_result): the same mark, which Dynamo reads
    when a traced run() first reads the tensor. A wrapper marks what it keeps and its ops
    read or write (plan buffers, workspace views, merge counters): under
    mode="reduce-overhead" CUDA-graph trees then take them at their own addresses (no copy
    before each replay), and an op that writes one (partial states, counters) does not make
    them skip the graph ("mutated inputs"). Unguarded: a tensor at a new address (a plan
    that grew a buffer) re-records the graph instead of recompiling it. ~55 ns a tensor."""
    for t in tensors:
        if t is not None:
            t._dynamo_static_input_type = "unguarded"


def constant_result(fn):
    """torch.compiler.assume_constant_result(fn) without its `import torch._dynamo`: the
    same mark, which Dynamo reads when it traces a call of fn (it runs fn once, at trace
    time, and records the result as a constant). torch's version imports Dynamo where it
    decorates, at the import of flashinfer_jit.rope and .append: 1.1 s on the CPU machine,
    4-4.7 s on the H100 host, paid by the first RoPE or append call of every process
    (tests/test_flashinfer_api.py checks that the mark is still torch's)."""
    fn._dynamo_marked_constant = True
    return fn


_Tensor = torch.Tensor


def dtype_str(dtype) -> str:
    return str(dtype).replace("torch.", "")


def expect_dtype(t, name: str, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        raise TypeError(
            f"{name}: expected dtype {' or '.join(dtype_str(d) for d in allowed)}, got {dtype_str(t.dtype)}"
        )


def expect_dim(t, name: str, dim: int, what: str) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor {what}, got shape {tuple(t.shape)}")


def expect_shape(t, name: str, shape: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {what} = {tuple(shape)}, got {tuple(t.shape)}")


def expect_index_vector(t, name: str, length: int | None = None, what: str = "") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected an int32 or int64 tensor, got {type(t).__name__}")
    expect_dtype(t, name, (torch.int32,))
    expect_dim(t, name, 1, what)
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name}: expected {length} entries {what}, got {t.shape[0]}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def expect_last_dim_contiguous(t, name: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous; strides {t.stride()}")


def expect_same_cuda_device(named: dict) -> None:
    """All tensors on one CUDA device (checked last, so shape errors show on any device)."""
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             "expected all tensors on one CUDA device")
    if first.device.type != "cuda":
        raise ValueError(f"{first_name}: expected CUDA tensors, got device {first.device}")


# plan()'s pos_encoding_mode values decode and prefill run (FlashInfer's names; POD takes "NONE" only)
POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
# the wrappers' backend values that run this package's kernels (FlashInfer's "fa2" included)
BACKENDS = ("auto", "fa2")


def expect_workspace(float_workspace_buffer) -> None:
    if not isinstance(float_workspace_buffer, torch.Tensor):
        raise TypeError("float_workspace_buffer: expected a tensor (e.g. 128 MB of uint8 on the GPU)")


def expect_page_table_buffer(buf, name: str, device: torch.device) -> None:
    """A wrapper constructor's fixed page-table buffer (paged_kv_indices_buffer, ...; CUDA
    graphs), None or a contiguous 1-D int32 tensor on the workspace's device."""
    if buf is None:
        return
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.int32 or buf.dim() != 1 or not buf.is_contiguous():
        got = f"{dtype_str(buf.dtype)} {tuple(buf.shape)}" if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise TypeError(f"{name}: expected a contiguous 1-D int32 tensor (the kernels read it as the page table), "
                        f"got {got}")
    if buf.device != device:
        raise ValueError(f"{name}: expected it on the workspace's device {device}, got {buf.device}")


def expect_positive_int(value, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def expect_heads(num_qo_heads, num_kv_heads, **sizes) -> None:
    """Attention heads and `sizes` (head_dim=..., page_size=...): positive ints, the query
    heads a multiple of the KV heads (GQA)."""
    # (the common case first, in one pass: plain positive ints; plan() calls this each step)
    if type(num_qo_heads) is int and type(num_kv_heads) is int and num_kv_heads > 0 and num_qo_heads > 0 and \
            num_qo_heads % num_kv_heads == 0 and all(type(v) is int and v > 0 for v in sizes.values()):
        return
    for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), *sizes.items()):
        expect_positive_int(value, name)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def expect_window_left(window_left) -> None:
    if not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left: expected -1 (off) or a non-negative int, got {window_left!r}")


def expect_bool(value, name: str) -> None:
    if type(value) is not bool:
        raise ValueError(f"{name}: expected True or False, got {value!r}")


def expect_choice(value, name: str, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, allowed))}, got {value!r}")


def expect_vector_aligned(t, name: str, vector_bytes: int = 16) -> None:
    """The kernels move `vector_bytes` at a time: the start address and every stride but
    the last (of a dimension longer than 1) must be multiples of it, or the access would
    fault ("misaligned address") and take the CUDA context down with it."""
    if compiling():
        return
    size = t.element_size()
    misaligned = t.data_ptr() % vector_bytes != 0 or any(
        (stride * size) % vector_bytes for stride, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    if misaligned:
        raise ValueError(f"{name}: the start address and every stride but the last must be multiples of "
                         f"{vector_bytes} bytes (the kernels use {vector_bytes}-byte vector accesses); got "
                         f"address % {vector_bytes} = {t.data_ptr() % vector_bytes}, strides {t.stride()} "
                         f"of {size}-byte elements")


def same_cuda_device(tensors) -> bool:
    """Fast path of expect_same_cuda_device: True when all are on one CUDA device."""
    first = tensors[0]
    if not first.is_cuda:
        return False
    index = first.get_device()
    return all(t.get_device() == index for t in tensors)


def aligned16(*tensors) -> bool:
    """Fast path of expect_vector_aligned(t, name, 16) for several tensors."""
    if compiling():
        return True
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        size = t.element_size()
        for stride, n in zip(t.stride()[:-1], t.shape[:-1]):
            if n > 1 and (stride * size) % 16:
                return False
    return True


def index_ok(t, length: int | None = None) -> bool:
    """Fast path of expect_index_vector."""
    return isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1 and \
        t.is_contiguous() and (length is None or t.shape[0] == length)


def as_int32_index(t, name: str):
    """An index tensor as the kernels take it: int32 as given (the fast path, no copy), int64
    (FlashInfer accepts both) narrowed to int32 in a new tensor on the same device. Values
    past int32 would wrap: page ids, offsets and positions of a serving engine stay far
    below 2^31. None passes through; any other dtype is a TypeError naming `name`."""
    if t is None or not isinstance(t, torch.Tensor) or t.dtype == torch.int32:
        return t
    if t.dtype == torch.int64:
        return t.to(torch.int32)
    raise TypeError(f"{name}: expected an int32 or int64 tensor, got {dtype_str(t.dtype)}")


def index_vector(t, name: str, length: int | None = None, what: str = ""):
    """as_int32_index, then expect_index_vector: the int32 vector the kernels read."""
    if index_ok(t, length):  # int32 as given: one cheap pass
        return t
    t = as_int32_index(t, name)
    expect_index_vector(t, name, length, what)
    return t


def as_dtype(value, name: str, default=None) -> torch.dtype | None:
    """A dtype argument (q_data_type, kv_data_type, ...): a torch.dtype, or its name with or
    without "torch."; None: `default`, parsed the same way (None stays None).

    Anything else is a TypeError, as FlashInfer's canonicalize_torch_dtype raises for a
    value that is not a dtype, and as this package raises for a tensor of the wrong dtype
    (expect_dtype): FlashInfer code that catches it keeps working. A dtype that is one but
    not supported by a family is that family's ValueError."""
    if value is None:
        if default is None:
            return None
        value = default
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name}: expected a torch dtype or its name, got {value!r}")
    return dtype


def soft_cap_value(logits_soft_cap, name: str = "logits_soft_cap") -> float:
    """FlashInfer's soft cap: None or 0.0 is off (0.0 returned), a positive number is the cap;
    anything else is a ValueError naming `name`."""
    if logits_soft_cap is None:
        return 0.0
    try:
        value = float(logits_soft_cap)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected None, 0.0 (off) or a positive float, got {logits_soft_cap!r}") from None
    if not value >= 0.0 or math.isinf(value):
        raise ValueError(f"{name}: expected None, 0.0 (off) or a positive float, got {logits_soft_cap!r}")
    return value


# distinct plan() configurations a wrapper remembers (usually one: an engine re-plans with
# the same scalar arguments at every step)
MAX_CONFIGS = 16


def remembered(cache: dict, args: tuple, check, limit: int = MAX_CONFIGS):
    """check(*args) for plan()'s scalar arguments, remembered in `cache` (serving engines
    repeat them at every step): the key holds the values and their types (1 == True == 1.0,
    but only ints pass the checks); unhashable arguments are checked (and most likely
    rejected) without caching; past `limit` entries the cache starts over."""
    key = (args, tuple(map(type, args)))
    try:
        value = cache.get(key)
    except TypeError:
        value, key = None, None
    if value is None:
        value = check(*args)
        if key is not None:
            if len(cache) >= limit:
                cache.clear()
            cache[key] = value
    return value



def run_signature(q, k, v) -> tuple:
    """What a run()'s full checks read from q and the K/V tensors, the addresses aside:
    shapes, strides, dtypes, devices. A wrapper keeps the signature that last passed them."""
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
            v.shape, v.stride(), v.dtype, v.device)


def passed_run_checks(q, k, v, signature) -> tuple | None:
    """(q, k, v data pointers) when q, k and v are plain tensors, 16-byte aligned, of the
    signature whose full checks passed last (run()'s fast path); None: check them in full."""
    if type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor:
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if not (qp | kp | vp) & 15 and run_signature(q, k, v) == signature:
            return qp, kp, vp
    return None


def host_index(t, name: str, any_int: bool = False) -> np.ndarray:
    """A 1-D index vector on the host, as int64 numpy (a copy; a device tensor is read with a
    synchronization): an int32 or int64 tensor (with any_int, any integer dtype: FlashInfer's
    uint16 / uint32 multi-item arrays), or a sequence of ints."""
    if isinstance(t, torch.Tensor):
        ok = t.dtype in (torch.int32, torch.int64) or (
            any_int and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool))
        if t.dim() != 1 or not ok:
            raise ValueError(f"{name}: expected a 1-D {'integer' if any_int else 'int32 or int64'} tensor, got "
                             f"{t.dtype} {tuple(t.shape)}")
        if t.device.type != "cpu" or t.requires_grad:
            t = t.detach().cpu()
        return t.numpy().astype(np.int64)
    return np.asarray(t, dtype=np.int64).reshape(-1)

"""A family's op and the record of a run()'s launch, for every attention family.

run() calls its module's op through the torch dispatcher the first time it sees a q and
K/V signature; the op also writes the launch it resolved (grid, params, kernel) into a CPU
byte tensor, `prepared`. Later calls of that signature skip the dispatcher: they hand
`prepared` and their own pointers and scalars to the module's C entry
<namespace>_<family>_fast (csrc/runtime/fast_entry.h), through fij_fastcall (fastcall.py),
~2 us of host time instead of ~12. This module looks the op and the entry up (cached per
spec, as functools caches: the registry's clear_registry() forgets them) and keeps the
record a plan holds (RecordedLaunch).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..pipeline.jit import get_module, op_cache
from ..pipeline.spec import Spec
from . import fastcall
from .checks import constant_result
from .native import ctypes_entry

# The ctypes argument types of <namespace>_<family>_fast (csrc/runtime/fast_entry.h):
# prepared, q, k, v, out, lse (prefill: and sinks), the scalars, the stream and pdl.
_FAST_ARGS = {
    "decode": [ctypes.c_void_p] * 6 + [ctypes.c_float] * 2 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int],
    "prefill": [ctypes.c_void_p] * 7 + [ctypes.c_float] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int],
    # POD: prepared, the ten tensors' addresses (an array), the stream, pdl
    "pod": [ctypes.c_void_p] * 3 + [ctypes.c_int],
}
# Families whose common run() fij_fastcall also launches from the tensors themselves
# (checking their signature in C++): the extension's function for it. POD has only this
# form (FastEntry.call None): anything else runs its op.
_RUNNERS = {"prefill": "prefill_run", "pod": "pod_run"}
_POINTER_CALLERS = ("decode", "prefill")


class FastEntry(NamedTuple):
    """A module's fast launch: `call` (the C entry through fij_fastcall, else ctypes; None
    for POD), the bytes of a prepared launch, and `runner` ((extension function, entry
    address) for the tensor-taking form, or None)."""

    call: Callable | None
    launch_bytes: int
    runner: tuple | None


class RecordedLaunch(NamedTuple):
    """What run()'s fast path calls: `call`(address, pointers..., stream, pdl). `prepared`
    keeps the bytes at `address` alive; device_index: the device whose current stream the
    launch takes."""

    call: Callable
    prepared: torch.Tensor
    address: int
    device_index: int


@op_cache
def module_op(spec: Spec, name: str, debug: bool):
    """Op `name` of spec's module (built or loaded at the first call). debug is part of the
    key: FLASHINFER_JIT_DEBUG set later gets a fresh lookup."""
    return getattr(get_module(spec), name)


def traced_key(spec: Spec) -> tuple:
    """What traced_namespace takes for `spec`: its class and its fields' values, constants
    that Dynamo passes as they are (a plan keeps it for a run() under torch.compile)."""
    return type(spec), tuple((f.name, getattr(spec, f.name)) for f in spec.fields())


@constant_result
def traced_namespace(spec_type, params: tuple) -> str:
    """The torch.ops namespace of the module of traced_key's (spec_type, params), for a run()
    that torch.compile traces: Dynamo runs this once, at trace time (the module is loaded,
    or built on a miss, then), and records the string; the op is then
    pipeline.jit.traced_op(namespace, name), an attribute chain it follows."""
    return get_module(spec_type(**dict(params))).namespace


@op_cache
def fast_entry(spec: Spec, family: str, debug: bool) -> FastEntry | None:
    """The module's <namespace>_<family>_fast for run()'s fast path; None in the debug mode
    (every launch through the op, with its checks) or without a CUDA device."""
    if debug or not torch.cuda.is_available():
        return None
    fn = ctypes_entry(spec, f"{family}_fast", _FAST_ARGS[family], ctypes.c_int)
    launch_bytes = int(ctypes_entry(spec, f"{family}_launch_bytes", [], ctypes.c_int)())
    runner = fastcall.runner(_RUNNERS[family], fn) if family in _RUNNERS else None
    return FastEntry(fastcall.bind(family, fn) if family in _POINTER_CALLERS else None, launch_bytes, runner)


@op_cache
def relaunch_entry(spec: Spec, debug: bool) -> int | None:
    """The address of POD on Hopper's <namespace>_pod_relaunch (csrc/runtime/fast_entry.h
    fij_pod_relaunch_fn): the first run() after a plan() resolves and launches there, without
    the dispatcher (fij_fastcall.pod_rerun); None where run() has no fast path (fast_entry's
    rule: the debug mode, no CUDA device, no fij_fastcall)."""
    entry = fast_entry(spec, "pod", debug)
    if entry is None or entry.runner is None:
        return None
    fn = ctypes_entry(spec, "pod_relaunch", [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2,
                      ctypes.c_int)
    return ctypes.cast(fn, ctypes.c_void_p).value


def launch_buffer(entry: FastEntry | None) -> torch.Tensor | None:
    """The CPU bytes an op call fills with its resolved launch, or None: nothing recorded."""
    return None if entry is None else torch.empty(entry.launch_bytes, dtype=torch.uint8)


def recorded(entry: FastEntry, prepared: torch.Tensor, device_index: int) -> RecordedLaunch:
    """The record of a launch the op has prepared (kept only once the op returned: an op
    that raised leaves the last launch and its buffer together)."""
    return RecordedLaunch(entry.call, prepared, prepared.data_ptr(), device_index)


@op_cache
def _error_string(spec: Spec, code: int) -> str:
    return ctypes_entry(spec, "error_string", [ctypes.c_int], ctypes.c_char_p)(code).decode()


def launch_failed(spec: Spec, family: str, code: int) -> RuntimeError:
    """The error of a fast launch that returned CUDA error `code`."""
    return RuntimeError(f"{spec.name}: {family}: CUDA error {code} ({_error_string(spec, code)})")

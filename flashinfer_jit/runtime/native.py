"""C entry points of loaded modules through ctypes: a family's fast launch of a recorded
run() (decode: <namespace>_decode_fast) and its host-side helpers (decode: the C++ planner,
the page-order kernel). A call through ctypes skips the torch dispatcher (~2 us of host time
instead of ~12 on the GPU host).

A struct passed by address has a ctypes mirror in the family's module; the C++ side
reports its size, checked once at load, so a field added on one side only is an error, not
a misread.
"""

from __future__ import annotations

import ctypes
import warnings

from ..pipeline.errors import SettingError
from ..pipeline.jit import get_module, op_cache
from ..pipeline.spec import Spec


@op_cache
def module_library(spec: Spec) -> tuple:
    """(the loaded module's shared library through ctypes, its namespace)."""
    module = get_module(spec)
    return ctypes.CDLL(str(module.path / module.manifest["library"])), module.namespace


def ctypes_entry(spec: Spec, symbol: str, argtypes: list, restype, mirror: type | None = None, size_op: str = ""):
    """<namespace>_<symbol> of spec's module through ctypes; with a mirror, once the struct
    it takes (whose size the module's op `size_op` reports) matches that ctypes mirror."""
    lib, namespace = module_library(spec)
    if mirror is not None:
        size = int(getattr(get_module(spec), size_op)())
        if size != ctypes.sizeof(mirror):
            raise RuntimeError(f"its struct has {size} bytes, the ctypes mirror {mirror.__name__} "
                               f"{ctypes.sizeof(mirror)}")
    fn = getattr(lib, f"{namespace}_{symbol}")
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def optional_entry(load, fallback: str, what: str):
    """load()'s result, or None with a RuntimeWarning where it raises: for a native helper
    the host code can do without (`fallback` says what it does instead, `what` names the
    helper). Callers cache the result (op_cache), so the warning comes once."""
    try:
        return load()
    except SettingError:
        raise  # a bad setting is the user's to fix, never a reason to run another code path
    except Exception as exc:  # noqa: BLE001 - any failure leaves the caller on its fallback, said once
        warnings.warn(f"flashinfer_jit: {fallback} ({what} is unavailable: {type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=4)
        return None

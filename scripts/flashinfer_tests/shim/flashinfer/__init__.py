"""`import flashinfer` for FlashInfer's own test files, run against flashinfer_jit
(scripts/flashinfer_tests/run.py). Every name and submodule a test reaches is
flashinfer_jit's (`flashinfer.decode` is `flashinfer_jit.decode`, ...), except FlashInfer's
build machinery, which the tests call to warm their JIT up: `flashinfer.jit` and the
helpers in `flashinfer.utils` answer as a machine whose modules build on first use.
This package is only put on the path by the runner; it is not installed."""

import importlib
import sys

import flashinfer_jit as _fij

for _sub in ("decode", "prefill", "pod", "attention", "page", "rope", "cascade"):
    sys.modules[f"{__name__}.{_sub}"] = importlib.import_module(f"flashinfer_jit.{_sub}")

from . import jit, utils  # noqa: E402,F401  (the shim's own)


def __getattr__(name):
    return getattr(_fij, name)

"""run()'s C launch entries called without ctypes: the `fij_fastcall` CPython extension.

A recorded run() (decode's and prefill's fast path) calls its module's C entry
<namespace>_<family>_fast with a dozen addresses and scalars. Through ctypes that call
costs ~1.1 us of argument conversion and libffi on the CPU machine (13 arguments); the
extension's METH_FASTCALL functions (csrc/fastcall.cc) read the Python ints and floats
into the entry's C types (csrc/fast_entry.h) and call it by address in ~0.1 us.

The extension needs CPython's headers and the host C++ compiler, not torch or nvcc. It
is built once per Python ABI, compiler and source into `.fastcall/<key>/` of the cache
root (a hidden folder: not a module entry), found there by later processes and in the
read-only roots of FLASHINFER_JIT_CACHE_PATH, and `flashinfer-jit aot` builds it beside
the modules. Where it cannot be built or loaded (no Python.h, no compiler, the JIT
disabled and nothing prebuilt), bind() hands back the ctypes function itself: the same
call, slower, said once as a warning when a build failed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from . import cache, env
from .errors import BuildError, JitDisabledError, ToolchainError
from .native import optional_entry
from .toolchain import _version_line, find_cxx

MODULE = "fij_fastcall"
SOURCES = ("fastcall.cc", "fast_entry.h")
SUBDIR = ".fastcall"


def _suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def _python_include() -> Path:
    inc = Path(sysconfig.get_paths()["include"])
    if not (inc / "Python.h").is_file():
        raise ToolchainError(f"Python.h not found in {inc} (install the Python development headers, e.g. "
                             f"python3-dev)")
    return inc


def key(cxx: str) -> str:
    """The extension's cache key: its sources, the Python ABI (the extension suffix names
    it) and the compiler's version line."""
    h = hashlib.sha256()
    csrc = env.source_dir("csrc")
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (csrc / name).read_bytes() + b"\0")
    h.update(f"{_suffix()}|{sys.version}|{_version_line([cxx, '--version'], 'c++')}".encode())
    return h.hexdigest()[:20]


def _library(root: Path, k: str) -> Path:
    return root / SUBDIR / k / f"{MODULE}{_suffix()}"


def find(k: str) -> Path | None:
    """The built extension of key k in a lookup root (prebuilt roots first), or None."""
    for root in cache.lookup_roots():
        path = _library(root, k)
        if path.is_file():
            return path
    return None


def build(root: Path | None = None) -> Path:
    """The extension's library under `root` (default: the build root), built if missing.
    Concurrent builders each compile privately; the first to publish wins."""
    cxx = find_cxx()
    if cxx is None:
        raise ToolchainError("no C++ compiler (set CXX, or put c++ or g++ on PATH)")
    k = key(cxx)
    root = root or cache.build_root()
    target = _library(root, k)
    if target.is_file():
        return target
    (root / ".tmp").mkdir(parents=True, exist_ok=True)
    tmp = cache.private_build_dir(root, f"fastcall-{k}")
    out = tmp / target.name
    csrc = env.source_dir("csrc")
    cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-fvisibility=hidden", f"-I{_python_include()}",
           f"-I{csrc}", str(csrc / "fastcall.cc"), "-o", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        cache.discard(tmp, root)
        raise BuildError(f"{MODULE}: could not run {cxx}: {exc}") from exc
    if done.returncode != 0:
        log = cache.save_failed_log(root, f"fastcall-{k}", " ".join(cmd) + "\n" + done.stdout + done.stderr)
        cache.discard(tmp, root)
        errors = [line for line in (done.stdout + done.stderr).splitlines() if "error" in line][:4]
        raise BuildError(f"{MODULE}: the C++ compiler failed (log: {log}): {' | '.join(errors)}")
    os.chmod(tmp, 0o755)
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, target.parent)
    except OSError:  # another process published it first
        cache.discard(tmp, root)
    return target


def load(path: Path):
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _find_or_build():
    cxx = find_cxx()
    found = find(key(cxx)) if cxx is not None else None
    if found is None:
        if env.jit_disabled():
            raise JitDisabledError(f"{MODULE} is not in the cache and FLASHINFER_JIT_DISABLE_JIT is set "
                                   f"(`flashinfer-jit aot` builds it)")
        found = build()
    return load(found)


@functools.cache
def extension():
    """The loaded extension, or None (a RuntimeWarning says why, once)."""
    return optional_entry(_find_or_build, "run() calls its C entry through ctypes (~1 us slower)",
                          f"the {MODULE} extension")


def bind(family: str, fn):
    """A callable taking fn's arguments that calls C entry `fn` (a ctypes function of
    `family`'s fast-entry signature, csrc/fast_entry.h) through the extension; fn itself
    where the extension is unavailable."""
    ext = extension()
    if ext is None:
        return fn
    return functools.partial(getattr(ext, family), ctypes.cast(fn, ctypes.c_void_p).value)

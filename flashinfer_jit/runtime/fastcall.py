"""run()'s C launch entries (and prefill plan()'s planner) called without ctypes: the
`fij_fastcall` CPython extension.

A recorded run() (decode's and prefill's fast path) calls its module's C entry
<namespace>_<family>_fast with a dozen addresses and scalars. Through ctypes that call
costs ~1.1 us of argument conversion and libffi on the CPU machine (13 arguments); the
extension's METH_FASTCALL functions (csrc/runtime/fastcall.cc) read the Python ints and floats
into the entry's C types (csrc/runtime/fast_entry.h) and call it by address in ~0.1 us.

prefill's run() of the common form goes further (`prefill_run`): q, K/V and out come in
as tensors, and the check that they still have the shapes, strides, dtypes and devices
the op recorded (`tensor_signature`), their alignment and the current stream are done
in C++ on torch's tensors, so run() does little more in Python than pass its arguments.

plan()'s page order (flashinfer_jit/runtime/page_order.py, decode and prefill) calls the page-order
module's launch entry through `order_pages` (~1 us of ctypes' conversions less a plan).

prefill's plan() hands its C++ planner (csrc/runtime/plan_entry.h) the index vectors as they came
(`prefill_plan`) where they are contiguous 1-D int32 CPU tensors of the batch's lengths:
no conversion or length check in Python and no ctypes call (~2 us of the 256-request
plan() on the CPU machine); any other form gets -1 back and takes the Python route.

POD (flashinfer_jit/pod/) has its callers in csrc/pod/pod_fastcall.cc, a second translation
unit of the same extension: run()'s fast path of both POD wrappers and BatchAttention
(`pod_signature`, `pod_run`: the tensors checked against a recorded signature in C++, the
outputs allocated there) and plan()'s per-request arithmetic (`pod_work`: both sides' work
for the schedule; `batch_split`: BatchAttention's cut of a mixed batch into the two sides).

The extension needs CPython's and torch's headers and the host C++ compiler, not nvcc
(10-30 s to build). It is built once per Python ABI, torch, compiler and source into
`.fastcall/<key>/` of the cache root (a hidden folder: not a module entry, but with a manifest
of its own, checked before it is loaded, and the same per-key lock for its builders), found
there by later processes and in the read-only roots of FLASHINFER_JIT_CACHE_PATH; `flashinfer-jit
aot` builds it beside the modules and `pack` carries it. Where it cannot be built or
loaded (no Python.h, no compiler, the JIT disabled and nothing prebuilt), bind() hands
back the ctypes function itself and runner() None: the same calls, slower, said once in a
RuntimeWarning.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from filelock import FileLock

from ..pipeline import cache, env
from ..pipeline.errors import BuildError, JitDisabledError, ToolchainError
from ..pipeline.log import logger
from ..pipeline.toolchain import _version_line, find_cxx
from .native import optional_entry

MODULE = "fij_fastcall"
# the extension's translation units (POD's callers beside the families' own), then the
# headers they include from csrc/
UNITS = ("runtime/fastcall.cc", "pod/pod_fastcall.cc")
SOURCES = (*UNITS, "runtime/fast_entry.h", "runtime/fastcall_common.h", "runtime/plan_entry.h",
           "hopper/prefill_sm90_plan.h", "hopper/prefill_sm90_params.h")
SUBDIR = ".fastcall"


def _suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def _python_include() -> Path:
    inc = Path(sysconfig.get_paths()["include"])
    if not (inc / "Python.h").is_file():
        raise ToolchainError(f"Python.h not found in {inc} (install the Python development headers, e.g. "
                             f"python3-dev)")
    return inc


def _torch() -> tuple[list[str], str, int, str]:
    """(include folders, library folder, C++ ABI flag, identity) of the running torch: the
    extension reads its tensors (torch/csrc/autograd/python_variable.h) and links
    libtorch_python and libc10."""
    import torch
    from torch.utils import cpp_extension

    lib = str(Path(torch.__file__).parent / "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return cpp_extension.include_paths(), lib, abi, f"torch {torch.__version__} cuda {torch.version.cuda} abi {abi}"


def key(cxx: str) -> str:
    """The extension's cache key: its sources, the Python ABI (the extension suffix names
    it), the torch it reads tensors of and the compiler's version line."""
    h = hashlib.sha256()
    csrc = env.source_dir("csrc")
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (csrc / name).read_bytes() + b"\0")
    h.update(f"{_suffix()}|{sys.version}|{_torch()[3]}|{_version_line([cxx, '--version'], 'c++')}".encode())
    return h.hexdigest()[:20]


def _library(root: Path, k: str) -> Path:
    return root / SUBDIR / k / f"{MODULE}{_suffix()}"


def find(k: str) -> Path | None:
    """The built extension of key k in a lookup root (prebuilt roots first), verified
    against its manifest, or None. A folder that does not verify is skipped with a
    warning; in a writable root it is removed (the next build replaces it)."""
    for root in cache.lookup_roots():
        path = _library(root, k)
        if not path.is_file():
            continue
        wrong = cache.verify_extension_folder(path.parent)
        if wrong is None:
            return path
        prebuilt = root in cache.prebuilt_roots()
        warnings.warn(f"flashinfer_jit: {path.parent}: {wrong}; "
                      + ("skipped (a prebuilt root: repair the image it comes from)" if prebuilt
                         else "removed, to be built again"), RuntimeWarning, stacklevel=2)
        if not prebuilt:
            with contextlib.suppress(OSError):
                with FileLock(str(_lock_path(root, k))):
                    if cache.verify_extension_folder(path.parent) is not None:
                        cache.discard(path.parent, root)
    return None


def _lock_path(root: Path, k: str) -> Path:
    """The extension's build lock, beside the module entries' (one per key)."""
    return root / ".locks" / f"{MODULE}-{k}.lock"


def build(root: Path | None = None) -> Path:
    """The extension's library under `root` (default: the build root), built if missing.
    Concurrent builders each compile privately; the first to publish wins."""
    cxx = find_cxx()
    if cxx is None:
        raise ToolchainError("no C++ compiler (set CXX, or put c++ or g++ on PATH)")
    k = key(cxx)
    root = root or cache.build_root()
    target = _library(root, k)
    if target.is_file() and cache.verify_extension_folder(target.parent) is None:
        return target
    (root / ".locks").mkdir(parents=True, exist_ok=True)
    with FileLock(str(_lock_path(root, k))):  # concurrent builders: one compiles, the others find it
        if target.is_file() and cache.verify_extension_folder(target.parent) is None:
            return target
        if target.parent.exists():  # a damaged or half-unpacked folder: out of the way first
            cache.discard(target.parent, root)
        return _build_locked(cxx, k, root, target)


def _build_locked(cxx: str, k: str, root: Path, target: Path) -> Path:
    (root / ".tmp").mkdir(parents=True, exist_ok=True)
    tmp = cache.private_build_dir(root, f"fastcall-{k}")
    out = tmp / target.name
    csrc = env.source_dir("csrc")
    includes, lib, abi, _ = _torch()
    flags = ["-O2", "-fPIC", "-std=c++17", "-fvisibility=hidden", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-I{_python_include()}", *(f"-I{inc}" for inc in includes), f"-I{csrc}"]
    # one compile step a unit, side by side (each is mostly torch's headers), then the link
    objects = [tmp / (Path(unit).stem + ".o") for unit in UNITS]
    steps = [[*env.compiler_launcher(), cxx, *flags, "-c", str(csrc / unit), "-o", str(obj)]
             for unit, obj in zip(UNITS, objects)]
    link = [cxx, "-shared", *map(str, objects), "-o", str(out), f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_python",
            "-ltorch_cpu", "-lc10"]
    logger.info("building %s (run()'s caller of the C launch entries) on first use into %s; expect about "
                "10-30 s, once", MODULE, target.parent)
    t0 = time.perf_counter()

    def run(cmd):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    try:
        with ThreadPoolExecutor(len(steps)) as pool:
            done = list(pool.map(run, steps))
        failed = [d for d in done if d.returncode != 0]
        if not failed:
            done = [run(link)]
            failed = [d for d in done if d.returncode != 0]
    except (OSError, subprocess.SubprocessError) as exc:
        cache.discard(tmp, root)
        raise BuildError(MODULE, "(none: the compiler did not run)", [f"could not run {cxx}: {exc}"]) from exc
    if failed:
        output = "".join(d.stdout + d.stderr for d in failed)
        commands = "\n".join(" ".join(map(str, d.args)) for d in failed)
        try:  # (on a full disk the log itself may not fit: the error says so instead)
            log = str(cache.save_failed_log(root, f"fastcall-{k}", commands + "\n" + output))
        except OSError as exc:
            log = f"(not saved: {exc})"
        cache.discard(tmp, root)
        raise BuildError(MODULE, log, [line for line in output.splitlines() if "error" in line][:4])
    for obj in objects:  # the library is the entry; its objects are not
        obj.unlink(missing_ok=True)
    logger.info("built %s in %.1f s", MODULE, time.perf_counter() - t0)
    cache.write_extension_manifest(tmp, MODULE, k, target.name)  # (tmp is named after nothing: the manifest names the key its folder will have)
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
    return optional_entry(_find_or_build, "run() and prefill's plan() call their C entries through ctypes "
                          "(~1 us slower each)",
                          f"the {MODULE} extension")


def bind(family: str, fn):
    """A callable taking fn's arguments that calls C entry `fn` (a ctypes function of
    `family`'s fast-entry signature, csrc/runtime/fast_entry.h) through the extension; fn itself
    where the extension is unavailable."""
    ext = extension()
    if ext is None:
        return fn
    return functools.partial(getattr(ext, family), ctypes.cast(fn, ctypes.c_void_p).value)


def runner(name: str, fn):
    """(the extension's function `name`, the address of C entry `fn`) for a caller that
    hands the extension its tensors (prefill_run, prefill_plan); None where the extension
    is unavailable."""
    ext = extension()
    if ext is None:
        return None
    return getattr(ext, name), ctypes.cast(fn, ctypes.c_void_p).value


def tensor_signature(*tensors) -> bytes:
    """The extension's signature of the tensors (q, k, v, out) a runner compares against."""
    return extension().tensor_signature(*tensors)

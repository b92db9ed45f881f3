"""Locating and describing the tools a build needs: nvcc, a host C++ compiler, ninja,
torch's headers and libraries, and the CUDA runtime.

Each probe runs once per process (`functools.cache`) and only when a build or a key
needs it; importing this module runs nothing.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import env
from .errors import ToolchainError


@dataclass(frozen=True)
class Toolchain:
    nvcc: str
    nvcc_version: str
    cxx: str
    cxx_version: str
    ninja: str
    cuda_include: str
    cuda_lib: str
    torch_version: str
    torch_cuda: str
    torch_include: tuple[str, ...]
    torch_lib: str
    cxx11_abi: bool
    # Link inputs that make the module use the process's shared libstdc++ (see
    # shared_libstdcxx); empty where the compiler links it shared by itself.
    cxx_runtime: tuple[str, ...] = ()

    def compiler_identity(self) -> dict:
        """The compilers' part of the cache key: versions, never install paths (plus a
        mark where the C++ runtime is named on the link line: entries linked before that,
        with a private libstdc++, are not reused)."""
        ident = {"nvcc": self.nvcc_version, "cxx": self.cxx_version}
        return ident | ({"cxx_runtime": "shared libstdc++ named"} if self.cxx_runtime else {})


def _version_line(cmd: list[str], what: str) -> str:
    """The version line of a compiler. Running `nvcc --version` costs tens of ms per
    process, so the answer is remembered on disk (`_memoized`)."""
    return _memoized(cmd[0], "", lambda: _run_version(cmd, what))


def _memoized(binary: str, question: str, answer: Callable[[], str], remember: bool = True) -> str:
    """answer(), remembered on disk keyed by the binary's resolved path, size, mtime and
    inode, plus `question`: replacing or upgrading the binary changes the key. With
    remember=False a memo is read but never written (`flashinfer-jit doctor` only reads)."""
    memo_key = _binary_key(binary)
    memo_key = memo_key and memo_key + question
    memo = _read_version_memo()
    if memo_key and memo_key in memo:
        return memo[memo_key]
    value = answer()
    if memo_key and remember:
        _write_version_memo({**memo, memo_key: value})
    return value


def _binary_key(binary: str) -> str | None:
    try:
        path = os.path.realpath(shutil.which(binary) or binary)
        st = os.stat(path)
    except (OSError, TypeError):
        return None
    return f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _memo_path():
    return env.user_cache_root() / ".compiler-versions.json"


def _read_version_memo() -> dict:
    import json

    try:
        data = json.loads(_memo_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_version_memo(memo: dict) -> None:
    import json
    import tempfile

    try:  # best effort: a read-only home only costs the probe next time
        path = _memo_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".compiler-versions.")
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _run_version(cmd: list[str], what: str) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainError(f"could not run {what} ({' '.join(cmd)}): {exc}") from exc
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    # nvcc prints its release on the last lines; compilers on the first.
    return lines[-1] if "nvcc" in cmd[0] else lines[0]


def find_nvcc() -> str | None:
    home = env.cuda_home()
    if home is not None and (home / "bin" / "nvcc").is_file():
        return str(home / "bin" / "nvcc")
    return shutil.which("nvcc")


def find_ninja() -> str | None:
    found = shutil.which("ninja")
    if found:
        return found
    try:  # the `ninja` wheel ships a binary beside its Python package
        import ninja  # type: ignore

        candidate = Path(ninja.BIN_DIR) / "ninja"
        return str(candidate) if candidate.is_file() else None
    except Exception:
        return None


def find_cxx() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _print_file_name(cxx: str, name: str, remember: bool = True) -> str | None:
    """Where `cxx` finds library file `name` when linking; None where it does not (GCC
    and clang then echo the bare name). Remembered on disk like the version line."""
    def ask() -> str:
        return subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True,
                              timeout=60, check=True).stdout.strip()

    try:
        out = _memoized(cxx, f"|print-file-name={name}", ask, remember)
    except (OSError, subprocess.SubprocessError):
        return None
    return out if os.path.isabs(out) and os.path.exists(out) else None


def _loaded_libstdcxx() -> str | None:
    """The libstdc++.so.6 mapped into this process (torch's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        pass
    return None


def shared_libstdcxx(cxx: str, remember: bool = True) -> tuple[str, ...]:
    """Extra link inputs so a module shares the process's libstdc++.

    A compiler that has only libstdc++.a on its library path (a relocated GCC such as
    /opt/gcc, where `-print-file-name=libstdc++.so` finds nothing) links a private copy of
    libstdc++ into every module. That copy's iostreams then meet the process's locale
    objects, and the first error message that formats a number (`TORCH_CHECK(..., n)`)
    crashes with SIGSEGV instead of raising. Naming the shared libstdc++.so.6 on the link
    line before the compiler's implicit -lstdc++ resolves every C++ runtime symbol from
    it, so nothing is taken from the archive. `remember`: as in _memoized."""
    if _print_file_name(cxx, "libstdc++.so", remember) is not None:
        return ()
    shared = _print_file_name(cxx, "libstdc++.so.6", remember) or _loaded_libstdcxx()
    return (shared,) if shared else ()


@functools.cache
def nvcc_version() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise ToolchainError(
            "nvcc not found: set CUDA_HOME to the CUDA toolkit (the folder holding bin/nvcc), "
            "or put nvcc on PATH"
        )
    return _version_line([nvcc, "--version"], "nvcc")


@functools.cache
def get() -> Toolchain:
    """The full toolchain for building; raises ToolchainError naming what is missing."""
    import torch

    nvcc = find_nvcc()
    if nvcc is None:
        nvcc_version()  # raises with the fix
    ninja = find_ninja()
    if ninja is None:
        raise ToolchainError(
            "ninja not found: `pip install ninja` or install it with your package manager "
            "so that `ninja` is on PATH"
        )
    cxx = find_cxx()
    if cxx is None:
        raise ToolchainError("no host C++ compiler: install g++ or set CXX to one")
    home = env.cuda_home() or Path(nvcc).resolve().parent.parent
    cuda_lib = next((str(home / d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")
                     if (home / d / "libcudart.so").exists()), str(home / "lib64"))
    torch_dir = Path(torch.__file__).resolve().parent
    return Toolchain(
        nvcc=nvcc,
        nvcc_version=nvcc_version(),
        cxx=cxx,
        cxx_version=_version_line([cxx, "--version"], "the host C++ compiler"),
        ninja=ninja,
        cuda_include=str(home / "include"),
        cuda_lib=cuda_lib,
        torch_version=torch.__version__,
        torch_cuda=str(torch.version.cuda),
        torch_include=(str(torch_dir / "include"),
                       str(torch_dir / "include" / "torch" / "csrc" / "api" / "include")),
        torch_lib=str(torch_dir / "lib"),
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        cxx_runtime=shared_libstdcxx(cxx),
    )


def torch_identity() -> dict:
    """torch's part of the cache key; needs no compiler, so an image without nvcc can
    still find the entries built for its torch."""
    import torch

    return {
        "torch": torch.__version__,
        "torch_cuda": str(torch.version.cuda),
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    }

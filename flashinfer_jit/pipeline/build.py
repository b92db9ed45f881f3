"""Compiler flags, generated build.ninja files, and running ninja.

One module = one kernel translation unit (nvcc, CUDA and csrc headers only) + one
binding translation unit (host C++, torch headers) linked into `<name>.so` against
libc10, libtorch_cpu and cudart. No torch CUDA library is linked, so CI's CPU-only
torch builds and imports the same modules the GPU machine runs.

Paths in a build.ninja are relative to the folder ninja runs in, so an entry's file
keeps working after the entry is moved into place, and the AOT path can put many
entries under one ninja (`write_combined`) with each entry's files under its prefix.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import env
from .errors import BuildError
from .toolchain import Toolchain

KERNEL_SOURCE = "kernel.cu"
BINDING_SOURCE = "binding.cc"


def arch_flags(archs: tuple[str, ...]) -> list[str]:
    """'9.0a' -> -gencode=arch=compute_90a,code=sm_90a; '9.0+PTX' also embeds PTX."""
    flags = []
    for arch in archs:
        ptx = arch.endswith("+PTX")
        base = arch[:-4] if ptx else arch
        num = base.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


@dataclass(frozen=True)
class Flags:
    """Compiler and linker flags. `identity()` (what the cache key sees) holds every
    flag that changes the output and none of the install paths."""

    nvcc: tuple[str, ...]
    cxx: tuple[str, ...]
    ld: tuple[str, ...]
    archs: tuple[str, ...]
    debug: bool

    def identity(self) -> dict:
        return {"nvcc": list(self.nvcc), "cxx": list(self.cxx), "ld": list(self.ld),
                "archs": list(self.archs), "debug": self.debug}


def make_flags(archs: tuple[str, ...], debug: bool, cxx11_abi: bool) -> Flags:
    common = ["-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}"]
    if debug:
        nvcc = ["-G", "-lineinfo", "-O0", "-DFIJ_DEBUG=1"]
        cxx = ["-O0", "-g", "-DFIJ_DEBUG=1"]
    else:
        # -lineinfo costs nothing at run time and lets ncu attribute stalls to lines;
        # -Xptxas=-v puts registers/spills of every kernel into build.log.
        nvcc = ["-O3", "-DNDEBUG", "-lineinfo", "-Xptxas=-v"]
        cxx = ["-O2", "-DNDEBUG"]
    nvcc += common + ["--expt-relaxed-constexpr", "-Xcompiler=-fPIC,-fvisibility=hidden"]
    nvcc += arch_flags(archs)
    cxx += common + ["-fPIC", "-fvisibility=hidden"]
    ld = ["-shared", "-lc10", "-ltorch_cpu", "-lcudart"]
    return Flags(tuple(nvcc), tuple(cxx), tuple(ld), tuple(archs), debug)


def _q(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _flag_vars(tc: Toolchain, flags: Flags) -> str:
    """The nvcc, cxx and link flags of an entry, as ninja variable lines."""
    torch_inc = " ".join(f"-isystem {_q(p)}" for p in tc.torch_include)
    threads = f"--threads {env.nvcc_threads()}"
    return f"""nvcc_flags = {' '.join(flags.nvcc)} {threads}
cxx_flags = {' '.join(flags.cxx)} {torch_inc}
ldflags = {' '.join(flags.ld)}{''.join(' ' + _q(p) for p in tc.cxx_runtime)} -L{_q(tc.torch_lib)} -L{_q(tc.cuda_lib)} -Wl,-rpath,{_q(tc.torch_lib)} -Wl,-rpath,{_q(tc.cuda_lib)}
"""


def ninja_rules(tc: Toolchain, flags: Flags) -> str:
    """Variables and rules, shared by every entry of a build.ninja (an entry whose flags
    differ sets its own: ninja_builds)."""
    launcher = " ".join(_q(w) for w in env.compiler_launcher())
    return f"""ninja_required_version = 1.3
launcher = {launcher}
nvcc = {_q(tc.nvcc)}
cxx = {_q(tc.cxx)}
{_flag_vars(tc, flags)}
# $launcher: FLASHINFER_JIT_COMPILER_LAUNCHER (e.g. ccache) before each compile step.
# Each step writes its output to $out.log (merged into the entry's build.log by
# collect_logs, so an entry built among many in one AOT ninja keeps its own ptxas report)
# and prints it only on failure, where ninja shows it under FAILED.
rule nvcc
  command = $launcher $nvcc $nvcc_flags -I$incdir -MD -MF $out.d -c $in -o $out > $out.log 2>&1 || {{ cat $out.log; exit 1; }}
  depfile = $out.d
  deps = gcc
  description = NVCC $out

rule cxx
  command = $launcher $cxx -MMD -MF $out.d $cxx_flags -I$incdir -c $in -o $out > $out.log 2>&1 || {{ cat $out.log; exit 1; }}
  depfile = $out.d
  deps = gcc
  description = CXX $out

rule link
  command = $cxx $in $ldflags -o $out > $out.log 2>&1 || {{ cat $out.log; exit 1; }}
  description = LINK $out
"""


def ninja_builds(prefix: str, library: str, tc: Toolchain | None = None, flags: Flags | None = None) -> str:
    """Build statements of one entry whose files lie under `prefix` ('' or 'dir/'). With
    `flags` (and `tc`), the entry compiles and links with its own flags, not the file's: an
    AOT build.ninja holds entries of other archs (a host-only module has none) or debug."""
    inc = f"{prefix}csrc" if prefix else "csrc"
    own = "".join(f"  {line}\n" for line in _flag_vars(tc, flags).splitlines()) if flags is not None else ""
    return f"""
build {prefix}kernel.o: nvcc {prefix}{KERNEL_SOURCE}
  incdir = {inc}
{own}build {prefix}binding.o: cxx {prefix}{BINDING_SOURCE}
  incdir = {inc}
{own}build {prefix}{library}: link {prefix}kernel.o {prefix}binding.o
{own}"""


def write_entry_ninja(build_dir: Path, tc: Toolchain, flags: Flags, library: str) -> None:
    text = ninja_rules(tc, flags) + ninja_builds("", library) + f"\ndefault {library}\n"
    (build_dir / "build.ninja").write_text(text)


def collect_logs(build_dir: Path, ninja_output: str = "") -> str:
    """Ninja's output followed by every step's own log; the step logs are removed."""
    parts = [ninja_output] if ninja_output else []
    for log in sorted(build_dir.glob("*.log")):
        if log.name == "build.log":
            continue
        parts.append(f"--- {log.name[:-4]} ---\n{log.read_text(errors='replace')}")
        log.unlink()
    return "\n".join(parts)


def _jobs(requested: int | None) -> list[str]:
    jobs = requested or env.max_jobs()
    return ["-j", str(jobs)] if jobs else []


_ERROR_LINE = re.compile(r"(error|Error|ERROR|undefined reference|fatal|cannot find)")


def first_errors(log: str, limit: int = 12) -> list[str]:
    """The first compiler error lines of a log, with the line after each for context."""
    lines = log.splitlines()
    picked: list[str] = []
    for i, line in enumerate(lines):
        if _ERROR_LINE.search(line) and not line.startswith(("FAILED:", "ninja:")):
            picked.append(line.rstrip())
            if i + 1 < len(lines) and not _ERROR_LINE.search(lines[i + 1]):
                picked.append(lines[i + 1].rstrip())
        if len(picked) >= limit:
            break
    return picked[:limit]


def run_ninja(tc: Toolchain, build_dir: Path, jobs: int | None = None,
              on_line: Callable[[str], None] | None = None) -> tuple[int, str, float]:
    """Run ninja in `build_dir`; returns (exit code, output, seconds)."""
    cmd = [tc.ninja, "-C", str(build_dir), *_jobs(jobs)]
    if env.verbose():
        cmd.append("-v")
        print("flashinfer_jit:", " ".join(cmd), file=sys.stderr)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "NINJA_STATUS": "[%f/%t] "})
    lines = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line)
            elif env.verbose():
                sys.stderr.write(line)
        code = proc.wait()
    except BaseException:  # an interrupt here: ninja stops too (it removes its unfinished outputs), then it passes on
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    return code, "".join(lines), time.perf_counter() - start


def raise_build_error(module: str, log_path: Path | str, log: str, hint: str | None = None) -> None:
    raise BuildError(module, str(log_path), first_errors(log), hint)

"""`flashinfer-jit` (also `python -m flashinfer_jit`): doctor, aot, pack, list, verify, clean.

Each command is a `cmd_*` function returning the exit code; what they print is built
by small pure functions (`check_line`, `progress_line`, `summary_lines`, `entry_row`,
`parse_duration`, `parse_size`, `lru_order`, ...) so tests can check the policy without
building anything.
Exit codes: 0 success, 1 a problem found (a failed build, a bad entry, a missing tool),
2 a usage error (bad arguments, an unreadable matrix).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import subprocess
import threading
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TextIO

from . import __version__
from .pipeline import cache, env, toolchain
from .pipeline.errors import JitError

# A module's build folder peaks at a few MiB (sources, csrc copy, objects, .so); 256 MiB
# leaves room for a large AOT matrix, its logs and the temp folder of one build.
MIN_FREE_BYTES = 256 << 20
# A temp folder untouched this long belongs to a build that died (a live build writes
# into its folder every few seconds: objects, ninja's log).
STALE_TEMP_SECONDS = 3600
# How long clean/verify --fix wait for an entry's lock before skipping it: a holder is
# building that entry now and will publish a good one.
LOCK_WAIT_SECONDS = 1.0


def _shipped_matrices() -> list[str]:
    from .pipeline import matrix

    return matrix.shipped_matrices()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    problem = usage_problem(args)
    if problem:
        args.parser.print_help(sys.stderr)
        print(f"\nflashinfer-jit {args.command}: {problem}", file=sys.stderr)
        return 2
    return args.func(args)


def usage_problem(args: argparse.Namespace) -> str | None:
    """What argparse cannot say: options needed together or apart."""
    if args.command == "aot" and not (args.matrix or args.entry):
        return "say what to build: --matrix FILE and/or --entry LINE"
    if args.command == "clean":
        chosen = [name for name, on in (("--older-than", args.older_than is not None),
                                        ("--stale", args.stale),
                                        ("--keep-size", args.keep_size is not None)) if on]
        if args.all and chosen:
            return f"--all removes every entry; it does not go with {', '.join(chosen)}"
        if not (args.all or chosen):
            return "say what to remove: --older-than DURATION, --stale, --keep-size SIZE or --all"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashinfer-jit",
        description="Build, inspect and maintain the flashinfer_jit module cache.")
    parser.add_argument("--version", action="version", version=f"flashinfer_jit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, func: Callable, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func, parser=p)
        return p

    command("doctor", cmd_doctor, "check the toolchain, target archs, cache and GPUs")
    aot = command("aot", cmd_aot, "build the modules of a matrix file or matrix lines ahead of time")
    aot.add_argument("--matrix", metavar="FILE",
                     help="matrix file, or the name of one that ships with the package: "
                          f"{', '.join(_shipped_matrices()) or 'none found'}")
    aot.add_argument("--entry", action="append", default=[], metavar="LINE",
                     help="one matrix line, e.g. 'append dtype_kv=bfloat16 head_dim=128' "
                          "(repeatable; with or without --matrix)")
    aot.add_argument("--out", metavar="DIR",
                     help="the cache root to build into; only entries there count as cached "
                          "(default: FLASHINFER_JIT_CACHE_DIR's root)")
    aot.add_argument("-j", "--jobs", type=_positive_int, metavar="N",
                     help="parallel compile jobs (default: MAX_JOBS, else the CPU count)")
    aot.add_argument("--arch", metavar="ARCHS",
                     help='target archs, e.g. "9.0a" or "8.0 9.0a" '
                          "(default: FLASHINFER_JIT_CUDA_ARCH_LIST, else the visible GPUs)")
    aot.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    aot.add_argument("--lock-timeout", type=_nonnegative_float, metavar="SECONDS",
                     help="give up (exit 1) after waiting this long for an entry's lock held by another "
                          "process (default: wait; the wait is announced after a few seconds, naming the holder)")
    pack = command("pack", cmd_pack, "archive the complete entries of a cache folder "
                   "(e.g. the --out of aot) for a deployment image")
    pack.add_argument("dir", metavar="DIR", help="the cache folder")
    pack.add_argument("--out", metavar="FILE",
                      help="the archive, *.tar.gz or *.tar.zst (smaller; unpacking it needs zstd) "
                           "(default: DIR.tar.gz beside DIR)")
    ls = command("list", cmd_list, "list the cache entries")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    verify = command("verify", cmd_verify, "check every entry against its manifest")
    verify.add_argument("--fix", action="store_true",
                        help="remove the bad entries (each rebuilds on its next use); "
                             "prebuilt read-only roots are only reported")
    clean = command("clean", cmd_clean, "remove cache entries, stale temp folders and old logs "
                    "(writable roots only; under each entry's build lock)")
    clean.add_argument("--older-than", type=parse_duration, metavar="DURATION",
                       help="entries built longer ago than this, e.g. 7d, 12h, 30m")
    clean.add_argument("--stale", action="store_true",
                       help="entries built by another package, torch, CUDA or compiler version "
                            "(marked stale by `list`)")
    clean.add_argument("--keep-size", type=parse_size, metavar="SIZE",
                       help="then the least recently used entries until the entries take at most "
                            "SIZE, e.g. 5G, 500M (binary units: 1G = 1024^3 bytes)")
    clean.add_argument("--all", action="store_true", help="every entry")
    clean.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    return parser


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of jobs, got {text}")
    return value


# --- doctor ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    note: bool = False  # ok, but worth reading: what this host can't do (no GPU to run on)


def check_line(check: Check) -> str:
    status = "PROBLEM" if not check.ok else "NOTE" if check.note else "OK"
    return f"{status:<8} {check.name:<8} {check.detail}"


def cmd_doctor(args: argparse.Namespace) -> int:
    """Reads only: no lock, temp folder, probe file or compiler memo is written, and a
    cache root that does not exist yet is not created. A host without a GPU is a NOTE (it
    builds modules, the README's CPU setup); only a PROBLEM exits 1."""
    checks = [run_check(name, probe) for name, probe in DOCTOR_CHECKS]
    for check in checks:
        print(check_line(check))
    problems = [c.name for c in checks if not c.ok]
    if problems:
        print(f"\n{len(problems)} problem(s) ({', '.join(problems)}): fix them to build modules")
        return 1
    notes = [c.name for c in checks if c.note]
    print("\neverything needed to build modules is in place"
          + (f" (see the NOTE on {', '.join(notes)})" if notes else ""))
    return 0


def run_check(name: str, probe: Callable[[], Check]) -> Check:
    """A probe that crashes is a problem to report, not a reason to stop the others."""
    try:
        return probe()
    except Exception as exc:  # noqa: BLE001 - doctor reports whatever went wrong
        return Check(name, False, f"check failed: {type(exc).__name__}: {exc}")


def tool_output(cmd: list[str]) -> list[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def check_tool(name: str, path: str | None, missing: str, version_line=lambda lines: lines[0]) -> Check:
    """A tool found at `path` (with the line of its --version output that version_line
    picks), or the `missing` explanation and fix."""
    if path is None:
        return Check(name, False, missing)
    return Check(name, True, f"{path} ({version_line(tool_output([path, '--version']))})")


def check_nvcc() -> Check:
    return check_tool("nvcc", toolchain.find_nvcc(),
                      "not found (CUDA_HOME unset or wrong, no nvcc on PATH, no /usr/local/cuda); fix: set "
                      "CUDA_HOME to the CUDA toolkit folder (the one holding bin/nvcc) or put nvcc on PATH",
                      lambda lines: next((l for l in lines if "release" in l), lines[-1] if lines else "?"))


def check_cxx() -> Check:
    check = check_tool("c++", toolchain.find_cxx(),
                       "no host C++ compiler; fix: install g++ (e.g. `apt-get install g++`) or set CXX to one")
    if check.ok:
        runtime = toolchain.shared_libstdcxx(toolchain.find_cxx(), remember=False)
        if runtime:  # a compiler with only libstdc++.a on its path (see shared_libstdcxx)
            return Check(check.name, True, f"{check.detail}; it has no libstdc++.so, so modules link {runtime[0]}")
    return check


def check_ninja() -> Check:
    return check_tool("ninja", toolchain.find_ninja(),
                      "not found; fix: `pip install ninja` or install it with your package manager so that "
                      "`ninja` is on PATH")


def check_torch() -> Check:
    import torch

    if torch.version.cuda is None:
        return Check("torch", True, f"{torch.__version__}, CPU build: fine for building and "
                     "importing modules; running kernels needs a CUDA build of torch")
    return Check("torch", True, f"{torch.__version__}, CUDA {torch.version.cuda}")


def check_archs() -> Check:
    """A bad FLASHINFER_JIT_CUDA_ARCH_LIST is a problem; none at all on a host without a
    GPU is a note: host-only modules build anyway, and `aot --arch` can name targets."""
    if os.environ.get("FLASHINFER_JIT_CUDA_ARCH_LIST"):
        try:
            archs = env.parse_arch_list(os.environ["FLASHINFER_JIT_CUDA_ARCH_LIST"])
        except ValueError as exc:
            return Check("archs", False, str(exc))
        return Check("archs", True, f"{' '.join(archs)} (from FLASHINFER_JIT_CUDA_ARCH_LIST)")
    archs = env.visible_gpu_archs()
    if not archs:
        return Check("archs", True, "none: no GPU visible and FLASHINFER_JIT_CUDA_ARCH_LIST is unset; "
                     "host-only modules build as they are, kernels need targets, e.g. "
                     "FLASHINFER_JIT_CUDA_ARCH_LIST='9.0a' (or `aot --arch 9.0a`)", note=True)
    return Check("archs", True, f"{' '.join(archs)} (from the visible GPUs)")


def check_jit_enabled() -> Check:
    if env.jit_disabled():
        return Check("jit", False, "FLASHINFER_JIT_DISABLE_JIT is set: cache misses are errors "
                     "and `aot` refuses to build; unset it to build")
    return Check("jit", True, "enabled (a cache miss compiles the module)")


def check_cache() -> Check:
    """Where builds would go, found without writing there (cache.planned_build_root)."""
    root = cache.planned_build_root()
    if root is None:
        return Check("cache", False, f"no writable cache directory: tried "
                     f"{', '.join(map(str, cache.writable_roots()))}; "
                     "set FLASHINFER_JIT_CACHE_DIR to a writable folder")
    existing = next(folder for folder in (root, *root.parents) if folder.is_dir())
    free = shutil.disk_usage(existing).free
    entries = [path for path, _ in cache.iter_entries() if cache.is_entry_dir(path)]
    size = sum(cache.dir_size(path) for path in entries)
    detail = (f"{root} ({'writable' if root.is_dir() else 'created by the first build'}, "
              f"{human_bytes(free)} free; {plural(len(entries), 'entry')}, {human_bytes(size)})")
    configured = env.cache_root()
    if root != configured:
        detail += f"; {configured} is not writable, so builds go to this fallback"
    if cache.prebuilt_roots():
        detail += f"; searched first, read only: {', '.join(map(str, cache.prebuilt_roots()))}"
    if free < MIN_FREE_BYTES:
        return Check("cache", False, f"{detail}: under {human_bytes(MIN_FREE_BYTES)} free; "
                     "free space there or set FLASHINFER_JIT_CACHE_DIR to another disk")
    return Check("cache", True, detail)


def check_gpus() -> Check:
    import torch

    if torch.cuda.is_available():
        gpus = [gpu_description(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
                for i in range(torch.cuda.device_count())]
        return Check("gpus", True, "; ".join(gpus))
    # Information, not a problem: a CPU host builds modules (README, "Install and test").
    if os.environ.get("FLASHINFER_JIT_CUDA_ARCH_LIST"):
        return Check("gpus", True, "no GPU visible: kernels are built for FLASHINFER_JIT_CUDA_ARCH_LIST's "
                     "targets but cannot run on this host", note=True)
    return Check("gpus", True, "no GPU visible: kernels can be built with FLASHINFER_JIT_CUDA_ARCH_LIST "
                 "(e.g. '9.0a') but cannot run on this host", note=True)


def gpu_description(name: str, capability: tuple[int, int]) -> str:
    """'NVIDIA H100 80GB HBM3 (compute capability 9.0)'"""
    return f"{name} (compute capability {capability[0]}.{capability[1]})"


DOCTOR_CHECKS: list[tuple[str, Callable[[], Check]]] = [
    ("nvcc", check_nvcc), ("c++", check_cxx), ("ninja", check_ninja), ("torch", check_torch),
    ("archs", check_archs), ("jit", check_jit_enabled), ("cache", check_cache),
    ("gpus", check_gpus),
]


# --- aot ------------------------------------------------------------------------------
def progress_line(done: int, total: int, seconds: float, width: int = 30, steps: tuple[int, int] = (0, 0)) -> str:
    """'[##########....................] 4/12 entries  45.2s', with ninja's compile steps
    once it has said them: '... 4/12 entries, 57/190 steps  45.2s'. The bar fills by
    steps where known (they move long before the first entry completes)."""
    frac = steps[0] / steps[1] if steps[1] else (done / total if total else 1.0)
    filled = min(width, int(width * frac))
    counted = f", {steps[0]}/{steps[1]} steps" if steps[1] else ""
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} entries{counted}  {seconds:.1f}s"


class ProgressBar:
    """build_many's progress callback: one line redrawn with \\r on a terminal, where a clock
    redraws it every second between ninja's steps too; one line per completed entry
    otherwise (logs, CI), and one every 30 s while none completes."""

    def __init__(self, stream: TextIO, tick: float = 1.0, quiet_line: float = 30.0):
        self.stream = stream
        self.tty = stream.isatty()
        self.open = False  # a redrawn line is on screen without its newline
        self.state = None  # (done, total, seconds, steps, when)
        self.last_line = 0.0
        self.quiet_line = quiet_line
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.clock = None
        if self.tty:
            self.clock = threading.Thread(target=self._tick, args=(tick,), daemon=True)
            self.clock.start()

    def __call__(self, done: int, total: int, seconds: float, steps_done: int = 0, steps_total: int = 0) -> None:
        with self.lock:
            previous = self.state
            self.state = (done, total, seconds, (steps_done, steps_total), time.monotonic())
            if self.tty:
                self._draw(seconds)
            elif previous is None or done != previous[0] or time.monotonic() - self.last_line >= self.quiet_line:
                self.stream.write(progress_line(done, total, seconds, steps=(steps_done, steps_total)) + "\n")
                self.stream.flush()
                self.last_line = time.monotonic()

    def _draw(self, seconds: float) -> None:
        done, total, _, steps, _ = self.state
        self.stream.write("\r" + progress_line(done, total, seconds, steps=steps))
        self.open = done < total
        if not self.open:
            self.stream.write("\n")
        self.stream.flush()

    def _tick(self, every: float) -> None:
        while not self.stop.wait(every):
            with self.lock:
                if self.state is not None and self.open:
                    done, total, seconds, steps, when = self.state
                    self._draw(seconds + time.monotonic() - when)

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            if self.open:
                self.stream.write("\n")
                self.open = False


def summary_lines(report) -> list[str]:
    """The end of `aot`: counts, then each failure with the log that says why."""
    lines = [f"built {len(report.built)}, already cached {len(report.cached)}, "
             f"failed {len(report.failed)} in {report.seconds:.1f}s"]
    for name, log in sorted(report.failed.items()):
        lines.append(f"  FAILED {name}: see {log}")
    if report.hint:
        lines.append(report.hint)
    elif report.failed:
        lines.append("fix the first compiler errors in each log; rerun with "
                     "FLASHINFER_JIT_VERBOSE=1 for the full command lines")
    return lines


def report_json(report, matrix: str, archs: tuple[str, ...], jobs: int | None) -> dict:
    return {"matrix": matrix, "archs": list(archs), "jobs": jobs,
            "entries": len(report.built) + len(report.cached) + len(report.failed),
            "built": list(report.built), "cached": list(report.cached),
            "failed": dict(report.failed), "seconds": round(report.seconds, 3)}


def aot_specs(matrix_file: str | None, entries: list[str]) -> list:
    """The modules of the matrix file and of each --entry line, deduplicated, in order."""
    from .pipeline import matrix

    specs = matrix.parse_matrix(matrix_file) if matrix_file else []
    for number, line in enumerate(entries, 1):
        specs += matrix.parse_matrix_text(line, source=f"--entry {number}")
    return list(dict.fromkeys(specs))


def cmd_aot(args: argparse.Namespace) -> int:
    from .pipeline import jit

    try:
        specs = aot_specs(args.matrix, args.entry)
        # host-only modules build for every GPU: a matrix of only those needs no targets
        needs_archs = any(not spec.HOST_ONLY for spec in specs)
        archs = (env.parse_arch_list(args.arch, source="--arch") if args.arch
                 else env.target_archs() if needs_archs else ())
        jobs = args.jobs or env.max_jobs()
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"flashinfer-jit aot: {exc}", file=sys.stderr)
        return 2
    source = " and ".join(filter(None, [args.matrix, plural(len(args.entry), "--entry line")
                                        if args.entry else ""]))
    print(f"aot: {len(specs)} modules from {source} for {' '.join(archs) or 'the host'}"
          f"{f' into {args.out}' if args.out else ''}, {jobs or os.cpu_count()} jobs", file=sys.stderr)
    bar = ProgressBar(sys.stderr)
    try:
        report = jit.build_many(specs, jobs=jobs, archs=archs, progress=bar,
                                root=Path(args.out) if args.out else None, lock_timeout=args.lock_timeout,
                                strict_root=True)
    except JitError as exc:
        bar.close()
        print(f"flashinfer-jit aot: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C, or a signal that stopped ninja: one line, what was kept
        bar.close()
        kept = len(exc.report.built) if isinstance(exc, jit.BuildInterrupted) else 0
        left = len(exc.unfinished) if isinstance(exc, jit.BuildInterrupted) else None
        print(f"flashinfer-jit aot: interrupted; {plural(kept, 'entry')} complete and kept"
              + (f", {left} not built" if left is not None else "")
              + ": run the same command again to build the rest", file=sys.stderr)
        return 130
    bar.close()
    print("\n".join(summary_lines(report)))
    _aot_fastcall(Path(args.out) if args.out else None)
    if args.json:
        Path(args.json).write_text(json.dumps(report_json(report, args.matrix, archs, jobs),
                                              indent=2) + "\n")
    return 1 if report.failed else 0


def _aot_fastcall(root: Path | None) -> None:
    """Builds run()'s fij_fastcall extension beside the modules (flashinfer_jit/runtime/fastcall.py);
    a failure is said, not fatal (run() then calls its C entries through ctypes)."""
    from .pipeline.errors import JitError
    from .runtime import fastcall

    try:
        print(f"fastcall: {fastcall.build(root)}")
    except (JitError, OSError) as exc:
        print(f"fastcall: not built ({exc}); run() will call its C entries through ctypes", file=sys.stderr)


# --- pack -----------------------------------------------------------------------------
def cmd_pack(args: argparse.Namespace) -> int:
    from .pipeline import pack

    root = Path(args.dir)
    try:
        archive = Path(args.out) if args.out else pack.default_archive(root.resolve())
        report = pack.pack(root, archive)
    except (OSError, ValueError) as exc:
        print(f"flashinfer-jit pack: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) or not root.is_dir() else 1
    for name, reason in sorted(report.skipped.items()):
        print(f"skipped {name}: {reason}")
    if not report.packed:  # pack.pack wrote nothing
        what = (f"no complete entry ({plural(len(report.skipped), 'folder')} left out)"
                if report.skipped else "no entries")
        print(f"flashinfer-jit pack: {what} in {root}: nothing written", file=sys.stderr)
        return 1
    print(f"packed {plural(len(report.packed), 'entry')} of {root} into {report.archive} "
          f"({report.compression}, {human_bytes(report.size_bytes)})")
    if report.fastcall:
        print(f"with run()'s fij_fastcall extension ({', '.join(report.fastcall)})")
    if report.skipped:
        print(f"{plural(len(report.skipped), 'entry')} left out: `flashinfer-jit verify` says why; "
              "rebuild them with `aot` before deploying")
    print(f"unpack with: mkdir -p ROOT && tar -xf {report.archive.name} -C ROOT "
          "(then FLASHINFER_JIT_CACHE_PATH=ROOT or FLASHINFER_JIT_CACHE_DIR=ROOT)")
    return 1 if report.skipped else 0


# --- list -----------------------------------------------------------------------------
def installed_identity() -> dict:
    """What an entry built here now would record (cache.stale_reason's `here`): package and
    torch versions, and the compilers where one may run."""
    here = {"package_version": __version__, "torch": toolchain.torch_identity()}
    if not env.jit_disabled():
        with contextlib.suppress(JitError):
            here["toolchain"] = toolchain.get().compiler_identity()
    return here


def entry_row(path: Path, manifest: dict | None, here: dict | None = None) -> dict:
    """What `list` shows of one entry; a folder without a readable manifest shows its name.
    `stale` says why the entry was built for another installation (None: it was not, or
    `here` was not given); `prebuilt`: it lies in a read-only root of FLASHINFER_JIT_CACHE_PATH."""
    m = manifest or {}
    name, _, key = path.name.rpartition("-")
    return {"name": m.get("name", name or path.name), "key": m.get("key", key),
            "path": str(path), "size_bytes": cache.dir_size(path),
            "built_at": m.get("built_at"), "build_seconds": m.get("build_seconds"),
            "built_by": m.get("built_by"), "archs": m.get("archs", []),
            "family": m.get("family"), "spec": m.get("spec"),
            "manifest": manifest is not None,
            "last_used": datetime.datetime.fromtimestamp(cache.last_used(path), datetime.timezone.utc)
            .isoformat(timespec="seconds"),
            "stale": cache.stale_reason(manifest, here) if here else None,
            "prebuilt": cache.is_prebuilt(path)}


def row_note(row: dict) -> str:
    """'prebuilt', 'STALE: built for torch 2.5.0 (here 2.13.0)', both, or ''."""
    notes = ["prebuilt"] if row.get("prebuilt") else []
    if row.get("stale"):
        notes.append(f"STALE: {row['stale']}")
    return "; ".join(notes)


def format_table(rows: list[dict]) -> str:
    header = ("NAME", "KEY", "SIZE", "BUILT (UTC)", "SECONDS", "BY", "ARCHS", "NOTE")
    cells = [header] + [(
        r["name"], (r["key"] or "")[:16], human_bytes(r["size_bytes"]),
        _short_time(r["built_at"]) if r["manifest"] else "(no manifest)",
        "" if r["build_seconds"] is None else f"{r['build_seconds']:.1f}",
        r["built_by"] or "", " ".join(r["archs"]), row_note(r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _short_time(iso: str | None) -> str:
    """'2026-11-22T06:52:04+00:00' -> '2026-11-22 06:52'"""
    return iso[:16].replace("T", " ") if iso else "?"


def cmd_list(args: argparse.Namespace) -> int:
    """The entries (cache.is_entry_dir, as verify and clean judge them); the table names
    any other folder of a root after them."""
    here = installed_identity()
    folders = list(cache.iter_entries())
    rows = [entry_row(path, manifest, here) for path, manifest in folders if cache.is_entry_dir(path)]
    strangers = [str(path) for path, _ in folders if not cache.is_entry_dir(path)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no entries in {', '.join(map(str, cache.lookup_roots()))}")
    else:
        print(format_table(rows))
        total = sum(r["size_bytes"] for r in rows)
        stale = sum(bool(r["stale"]) for r in rows)
        print(f"\n{plural(len(rows), 'entry')}, {human_bytes(total)}"
              + (f"; {stale} stale (never loaded by this installation): "
                 "`flashinfer-jit clean --stale` removes them" if stale else ""))
    if strangers:
        print(f"not entries of this cache, so not listed: {', '.join(strangers)}")
    return 0


# --- verify ---------------------------------------------------------------------------
# What verify and clean say of a folder in a cache root that is not provably an entry.
NOT_AN_ENTRY = "not an entry of this cache: left alone"


class CannotRemove(Exception):
    """A removal this user may not make (a read-only mount, another owner): one line
    naming what was to go and the file the system refused."""

    def __init__(self, path: Path, exc: OSError):
        refused = f"{exc.filename}: " if exc.filename else ""
        super().__init__(f"cannot remove {path}: {refused}{exc.strerror or exc}; stopped there "
                         "(a read-only cache? run this as a user who may write it)")


def cmd_verify(args: argparse.Namespace) -> int:
    """Checks every entry; with --fix removes the bad ones of the writable roots. A folder
    that is not provably an entry (cache.is_entry_dir) is named and never removed. A
    removal this user may not make (a read-only cache) ends the command with one line."""
    try:
        return verify_entries(args.fix)
    except CannotRemove as exc:
        print(f"\nflashinfer-jit verify --fix: {exc}", file=sys.stderr)
        return 1


def verify_entries(fix: bool) -> int:
    bad = kept = checked = 0
    for path, manifest in cache.iter_entries():
        if not cache.is_entry_dir(path):
            print(f"SKIP {path}: {NOT_AN_ENTRY}")
            continue
        checked += 1
        reason = cache.verify_entry(path, manifest)
        print(f"OK   {path.name}" if reason is None else f"BAD  {path.name}: {reason}")
        if reason is None:
            continue
        bad += 1
        if fix and cache.is_prebuilt(path):
            kept += 1
            print("     kept: a prebuilt read-only root (FLASHINFER_JIT_CACHE_PATH); lookups skip it, "
                  "so repair the image it comes from")
        elif fix and discard_locked(path, lambda: cache.verify_entry(path) is not None):
            print("     removed; its next use rebuilds it")
        else:
            kept += 1
            if fix:
                print("     kept: a build holds its lock, or rebuilt it meanwhile")
    # run()'s fij_fastcall extension (.fastcall/<key>/, flashinfer_jit/runtime/fastcall.py): its manifest too
    for root in cache.lookup_roots():
        for folder in cache.extension_folders(root):
            checked += 1
            label = f"{folder.parent.name}/{folder.name}"
            reason = cache.verify_extension_folder(folder)
            print(f"OK   {label}" if reason is None else f"BAD  {label}: {reason}")
            if reason is None:
                continue
            bad += 1
            if fix and root not in cache.prebuilt_roots():
                try:
                    cache.discard(folder, root)
                    print("     removed; run() builds it again (or `flashinfer-jit aot`)")
                    continue
                except OSError as exc:
                    print(f"     kept: cannot remove it ({exc})")
            elif fix:
                print("     kept: a prebuilt read-only root (FLASHINFER_JIT_CACHE_PATH)")
            kept += 1
    if not checked:  # as `list` says it
        print(f"no entries in {', '.join(map(str, cache.lookup_roots()))}")
        return 0
    print("\n" + verify_summary(bad, kept, fix))
    return 1 if kept else 0


def verify_summary(bad: int, kept: int, fix: bool) -> str:
    if not bad:
        return "every entry matches its manifest"
    if fix:
        return f"{plural(bad, 'bad entry')}, {bad - kept} removed, {kept} kept"
    return (f"{plural(bad, 'bad entry')}: `flashinfer-jit verify --fix` removes them "
            "(each rebuilds on its next use)")


@contextlib.contextmanager
def entry_lock(path: Path) -> Iterator[None]:
    """The lock builders take for this entry (`<root>/.locks/<dirname>.lock`); the file
    stays: another process may hold or be about to take it."""
    from filelock import FileLock

    locks = path.parent / ".locks"
    locks.mkdir(exist_ok=True)
    with FileLock(str(locks / f"{path.name}.lock"), timeout=LOCK_WAIT_SECONDS):
        yield


def discard_locked(path: Path, still_wanted: Callable[[], bool]) -> bool:
    """Remove an entry under its lock if `still_wanted()` holds once the lock is taken
    (a builder may have replaced it meanwhile). False if it was kept; CannotRemove if
    the lock or the move was refused (the entry is then whole: the move is one rename)."""
    from filelock import Timeout

    try:
        with entry_lock(path):
            if not path.exists() or not still_wanted():
                return False
            cache.discard(path, path.parent)
            return True
    except Timeout:
        return False
    except OSError as exc:
        raise CannotRemove(path, exc) from exc


# --- clean ----------------------------------------------------------------------------
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """'7d' -> 604800.0; '1d12h' and '90s' work too."""
    compact = text.strip().lower().replace(" ", "")
    if not compact or _DURATION_PART.sub("", compact):
        raise argparse.ArgumentTypeError(
            f"cannot read duration {text!r}; expected a number and a unit (s, m, h, d, w), "
            "e.g. 7d, 12h, 30m")
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(compact))


def built_at_seconds(manifest: dict | None, path: Path) -> float:
    """When an entry was built (epoch seconds): its manifest's built_at; a folder
    without a readable one falls back to its modification time."""
    try:
        return datetime.datetime.fromisoformat(manifest["built_at"]).timestamp()
    except (TypeError, KeyError, ValueError):
        return path.stat().st_mtime


def newest_mtime(path: Path) -> float:
    times = [path.stat().st_mtime]
    for child in path.rglob("*"):
        with contextlib.suppress(OSError):
            times.append(child.lstat().st_mtime)
    return max(times)


def is_older(timestamp: float, now: float, max_age: float | None) -> bool:
    """None means every age (--all)."""
    return max_age is None or now - timestamp > max_age


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?")
_UNIT_BYTES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'5G' -> 5 * 1024**3; also 500M, 1.5G, 64K, 2T, 5GiB, 5GB (binary units: disk
    space as `du -h` and `list` show it) and plain bytes."""
    match = _SIZE.fullmatch(text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(
            f"cannot read size {text!r}; expected a number and a unit (K, M, G, T), e.g. 5G, 500M")
    return int(float(match.group(1)) * _UNIT_BYTES[match.group(2)])


def lru_order(entries: list[tuple[Path, int, float]]) -> list[tuple[Path, int, float]]:
    """(path, size, last used) least recently used first; ties by path, so every run
    picks the same."""
    return sorted(entries, key=lambda e: (e[2], str(e[0])))


def cmd_clean(args: argparse.Namespace) -> int:
    """Entries of the writable roots only (never FLASHINFER_JIT_CACHE_PATH's), each removed
    under its build lock after its reason is checked again (a build may have replaced it,
    or a process loaded it, meanwhile). A process that loaded an entry keeps using it: its
    .so stays mapped after the files go (Linux). Folders that are not provably entries
    (cache.is_entry_dir) are named and left; a removal this user may not make (a read-only
    cache) ends the command with one line."""
    try:
        return clean_entries(args)
    except CannotRemove as exc:
        print(f"flashinfer-jit clean: {exc}", file=sys.stderr)
        return 1


def clean_entries(args: argparse.Namespace) -> int:
    now = time.time()
    verb = "would remove" if args.dry_run else "removed"
    here = installed_identity() if args.stale else None
    max_age = None if args.all else args.older_than

    def reason(path: Path, manifest: dict | None) -> str | None:
        if args.all:
            return "all"
        if max_age is not None and is_older(built_at_seconds(manifest, path), now, max_age):
            return "old"
        stale = cache.stale_reason(manifest, here) if here else None
        return stale and f"stale: {stale}"

    removed = freed = 0

    def remove(path: Path, size: int, why: str, still_wanted: Callable[[], bool]) -> bool:
        nonlocal removed, freed
        if not (args.dry_run or discard_locked(path, still_wanted)):
            print(f"kept {path}: a build holds its lock, or replaced or used it meanwhile")
            return False
        print(f"{verb} {path}" + ("" if why in ("all", "old") else f" ({why})"))
        removed, freed = removed + 1, freed + size
        return True

    survivors = []  # (path, size, last used)
    for path, manifest in cache.iter_entries(roots=cache.writable_roots()):
        if not cache.is_entry_dir(path):
            print(f"left alone {path}: not an entry of this cache")
            continue
        why, size = reason(path, manifest), cache.dir_size(path)
        if not (why and remove(path, size, why, lambda: reason(path, cache.read_manifest(path)) is not None)):
            survivors.append((path, size, cache.last_used(path)))
    total = sum(size for _, size, _ in survivors)
    for path, size, used in lru_order(survivors) if args.keep_size is not None else []:
        if total <= args.keep_size:
            break
        # used since it was listed: now the most recent, so it stays
        if remove(path, size, "least recently used", lambda: cache.last_used(path) <= used):
            total -= size
    # run()'s fij_fastcall extension: every build with --all; with --stale those of another
    # installation (a key this Python, torch and compiler would not build) and damaged ones
    extensions = 0
    if args.all or args.stale:
        from .runtime import fastcall

        cxx = toolchain.find_cxx()
        current = None
        with contextlib.suppress(Exception):
            current = fastcall.key(cxx) if cxx else None
        for root in cache.writable_roots():
            for folder in cache.extension_folders(root):
                why = "all" if args.all else ("damaged" if cache.verify_extension_folder(folder) else
                                              None if folder.name == current else "stale: another installation's")
                if why is None:
                    continue
                size = cache.dir_size(folder)
                if not args.dry_run:
                    try:
                        cache.discard(folder, root)
                    except OSError as exc:
                        raise CannotRemove(f"cannot remove {folder}: {exc}") from exc
                print(f"{verb} {folder}" + ("" if why == "all" else f" ({why})"))
                extensions, freed = extensions + 1, freed + size
    temps, logs = clean_side_folders(now, max_age, args.all or args.older_than is not None,
                                     args.dry_run, verb)
    print(f"{verb} {plural(removed, 'entry')}"
          + (f" and {plural(extensions, 'fij_fastcall extension')}" if extensions else "")
          + f" ({human_bytes(freed)}), {plural(temps, 'stale temp folder')}, {plural(logs, 'log')}; "
          "lock files are kept")
    if args.keep_size is not None:
        print(f"the entries {'would ' if args.dry_run else ''}take {human_bytes(total)} "
              f"(--keep-size {human_bytes(args.keep_size)})")
    return 0


def clean_side_folders(now: float, max_age: float | None, remove_logs: bool, dry_run: bool,
                       verb: str) -> tuple[int, int]:
    """Temp folders of builds that died (untouched for an hour), and, if remove_logs,
    failed-build logs older than max_age, in every writable root. `.locks/` is never
    touched, nor is anything in a prebuilt root."""
    temps = logs = 0
    for root in cache.writable_roots():
        for folder in sorted((root / ".tmp").glob("*")) if (root / ".tmp").is_dir() else []:
            if is_older(newest_mtime(folder), now, STALE_TEMP_SECONDS):
                if not dry_run:
                    _remove(folder)
                print(f"{verb} {folder}")
                temps += 1
        for log in sorted((root / ".logs").glob("*.log")) if remove_logs and (root / ".logs").is_dir() else []:
            if is_older(log.stat().st_mtime, now, max_age):
                if not dry_run:
                    _remove(log)
                logs += 1
    return temps, logs


def _remove(path: Path) -> None:
    """A stale temp folder or a log (nothing loads either); CannotRemove if refused. A
    temp folder refused part way is still only a temp folder."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except FileNotFoundError:
        pass  # another clean took it (or part of it) first; a stale temp folder may stay
    except OSError as exc:
        raise CannotRemove(path, exc) from exc


# --- shared ---------------------------------------------------------------------------
def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def plural(n: int, noun: str) -> str:
    """plural(1, 'entry') -> '1 entry'; plural(2, 'bad entry') -> '2 bad entries'."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") else f"{n} {noun}s"

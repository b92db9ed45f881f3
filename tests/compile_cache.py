#!/usr/bin/env python3
"""The test suite's compiler launcher (FLASHINFER_JIT_COMPILER_LAUNCHER, set by conftest.py):
the same compile step twice in one test session runs the compiler once.

Many tests build the same small module into a fresh cache of their own (a corrupted entry
rebuilt, eight processes racing, a second architecture, the AOT CLI's reports, ...). What
they test is the cache and the pipeline around the compiler, not the compiler: the first
build of each step is real, later ones reuse its output. Usage, as any launcher:

    compile_cache.py <compiler> <args...>        (FIJ_TEST_COMPILE_CACHE: the store)

A compiler script marked COUNTED_COMPILER (a test's logging nvcc) always runs. The key of a
step is the whole command (the compiler's path included), except
the paths after -o and -MF, plus the contents of every input file named on it and of every
include folder named `csrc` (the module's staged copy of the sources, or the checkout's);
other include folders (torch's, Python's) are fixed for the session and enter by path. A
hit copies the stored output and dependency file into place and prints the stored compiler
output (ptxas' register report for build.log); where the copy fails (a full disk, a file-size
limit), the step fails with the system's message (what the pipeline reads to blame the disk).
Without FIJ_TEST_COMPILE_CACHE the compiler runs as if called directly.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PATH_ARGS = ("-o", "-MF")  # what follows them is where this step writes, not what it is
# A compiler script holding this line runs every time (test_cache.make_toolkit's nvcc, which
# logs each compile for the tests that count them).
COUNTED_COMPILER = "fij-test: every compile counted"


def counted(compiler: str) -> bool:
    try:
        with open(compiler, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return head.startswith(b"#!") and COUNTED_COMPILER.encode() in head


def _tree(h, folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(folder)).encode() + b"\0")
            h.update(hashlib.sha256(path.read_bytes()).digest())


def step_key(cmd: list[str]) -> tuple[str, dict]:
    """(key, {flag: path}) of the step: the paths after -o / -MF apart."""
    h = hashlib.sha256()
    where, skip = {}, None
    for arg in cmd:
        if skip:
            where[skip], skip = arg, None
            continue
        if arg in PATH_ARGS:
            skip = arg
            h.update(arg.encode() + b"\0")
            continue
        h.update(arg.encode() + b"\0")
        folder = arg[2:] if arg.startswith("-I") else None
        if folder is not None and Path(folder).name == "csrc" and Path(folder).is_dir():
            _tree(h, Path(folder))
        elif not arg.startswith("-") and os.path.isfile(arg):
            h.update(hashlib.sha256(Path(arg).read_bytes()).digest())
    return h.hexdigest(), where


def run_compiler(cmd: list[str]) -> int:
    return subprocess.run(cmd).returncode


def main(argv: list[str]) -> int:
    cmd = argv[1:]
    store = os.environ.get("FIJ_TEST_COMPILE_CACHE")
    if not cmd:
        print("compile_cache.py: no compiler command", file=sys.stderr)
        return 2
    if not store or counted(cmd[0]):
        return run_compiler(cmd)
    key, where = step_key(cmd)
    out = where.get("-o")
    if out is None:
        return run_compiler(cmd)
    slot = Path(store) / key
    if (slot / "output").is_file():
        try:
            shutil.copyfile(slot / "output", out)
            shutil.copymode(slot / "output", out)
            if "-MF" in where and (slot / "deps").is_file():
                shutil.copyfile(slot / "deps", where["-MF"])
        except OSError as exc:  # a full disk, a file-size limit: fail as the compiler would, saying why
            print(f"compile_cache.py: cannot write {out}: {exc}", file=sys.stderr)
            return 1
        sys.stdout.write((slot / "log").read_text(errors="replace"))
        return 0
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.returncode == 0 and os.path.isfile(out):
        try:
            Path(store).mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.", dir=store))
            shutil.copyfile(out, tmp / "output")
            shutil.copymode(out, tmp / "output")
            if "-MF" in where and os.path.isfile(where["-MF"]):
                shutil.copyfile(where["-MF"], tmp / "deps")
            (tmp / "log").write_text(done.stdout + done.stderr)
            try:
                os.rename(tmp, slot)  # another process stored it first: keep theirs
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # a store that cannot be written only costs the next compile
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python3
"""Run FlashInfer's own test files against flashinfer_jit, through `import flashinfer`.

FlashInfer's tests import `flashinfer`; here that name is a shim (shim/flashinfer/) whose
names and submodules are flashinfer_jit's, with FlashInfer's JIT warm-up calls answered as
no-ops (flashinfer_jit builds a module on first use). The test files run unchanged, copied
with FlashInfer's tests/test_helpers/ into a work folder (jit_utils.py, the warm-up's module
lists, replaced by stubs/jit_utils.py). Nothing of FlashInfer is stored in this repository:
point --flashinfer at a FlashInfer checkout.

Before the run, the modules the selected cases need are found and built in parallel: the
cases run with FLASHINFER_JIT_DISABLE_JIT=1, each one that stops on a missing module records
that module's matrix line (conftest_plugin.py), `flashinfer-jit aot -j JOBS` builds them,
and again, until no case finds one missing (--rounds; 0: build on first use instead).

  python3 scripts/flashinfer_tests/run.py --flashinfer ~/flashinfer \\
      utils/test_pod_kernels.py attention/test_batch_attention.py \\
      [--sample 64] [--exclude 'nvfp4|profiler'] [--jobs 16] [--junit out.xml] [-- PYTEST_ARGS]

Exit status: pytest's. docs/api.md says which files were run, on what, and what is left out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_EXCLUDE = r"nvfp4|profiler|cutile|qk448_vo256"


def prepare(flashinfer: Path, files: list[str], work: Path) -> list[str]:
    tests = flashinfer / "tests"
    if not tests.is_dir():
        raise SystemExit(f"--flashinfer: {flashinfer} has no tests/ folder (expected a FlashInfer checkout)")
    if work.exists():
        shutil.rmtree(work)
    helpers = work / "tests" / "test_helpers"
    helpers.mkdir(parents=True)
    for src in (tests / "test_helpers").glob("*.py"):
        shutil.copy2(src, helpers / src.name)
    shutil.copy2(HERE / "stubs" / "jit_utils.py", helpers / "jit_utils.py")
    (work / "tests" / "__init__.py").touch()
    (helpers / "__init__.py").touch()
    targets = []
    for rel in files:
        src = tests / rel
        if not src.is_file():
            raise SystemExit(f"{rel}: not a file under {tests}")
        dst = work / "tests" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        targets.append(str(dst))
    (work / "pytest.ini").write_text("[pytest]\n")  # not this repository's pytest settings
    return targets


def pytest_env(args, work: Path, **extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(work), str(HERE / "shim"), str(HERE), str(REPO),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["FIJ_FI_EXCLUDE"] = args.exclude
    env["FIJ_FI_SAMPLE"] = str(args.sample)
    env["FIJ_FI_SEED"] = str(args.seed)
    env.update(extra)
    return env


def run_pytest(args, work: Path, targets: list[str], extra_args: list[str], **env) -> int:
    cmd = [sys.executable, "-m", "pytest", "-c", str(work / "pytest.ini"), "--rootdir", str(work),
           "-p", "conftest_plugin", "-p", "no:cacheprovider", *targets, *extra_args]
    return subprocess.call(cmd, cwd=work, env=pytest_env(args, work, **env))


def build_missing(args, work: Path, targets: list[str]) -> None:
    seen: set[str] = set()
    for round_ in range(args.rounds):
        misses = work / f"misses_{round_}.txt"
        run_pytest(args, work, targets, ["-q", "-p", "no:randomly", "--tb=no", "-o", "console_output_style=classic"],
                   FLASHINFER_JIT_DISABLE_JIT="1", FIJ_FI_MISSES=str(misses))
        lines = set(misses.read_text().split("\n")) - {""} if misses.exists() else set()
        new = sorted(lines - seen)
        print(f"flashinfer_tests: round {round_}: {len(new)} module(s) to build", flush=True)
        if not new:
            return
        seen.update(new)
        matrix = work / f"matrix_{round_}"
        matrix.write_text("\n".join(new) + "\n")
        rc = subprocess.call([sys.executable, "-m", "flashinfer_jit", "aot", "--matrix", str(matrix), "-j",
                              str(args.jobs)], cwd=REPO)
        if rc != 0:
            print(f"flashinfer_tests: aot exited {rc}; the run builds what is left on first use", flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="test files, relative to the checkout's tests/")
    ap.add_argument("--flashinfer", required=True, type=Path, help="a FlashInfer checkout (its tests/ are run)")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fij_flashinfer_tests")
    ap.add_argument("--exclude", default=DEFAULT_EXCLUDE, help=f"regex of node ids left out ({DEFAULT_EXCLUDE!r})")
    ap.add_argument("--sample", type=int, default=0, help="at most N cases per file, a fixed sample (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of finding and building missing modules")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--junit", type=Path, default=None)
    args = ap.parse_args(argv)
    work = args.work.resolve()
    targets = prepare(args.flashinfer.resolve(), args.files, work)
    build_missing(args, work, targets)
    final = ["-q", "-rfE", "--tb=short"] + (["--junitxml", str(args.junit.resolve())] if args.junit else []) + extra
    return run_pytest(args, work, targets, final)


if __name__ == "__main__":
    sys.exit(main())

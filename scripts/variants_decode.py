#!/usr/bin/env python3
"""Same-machine A/B of source variants: each variant is a copy of the checkout with some
text replaced, built into its own cache and run in its own process, one after the other.

A diagnostic for tuning (what docs/performance.md's "rejected" and "kept" entries rest
on), not a benchmark: the product's sources are not touched. A variant is
NAME=FILE:OLD=>NEW[;FILE:OLD=>NEW...] (each OLD must occur exactly once in FILE; NAME
alone is the unchanged tree; NAME=@FILE reads the edits from a JSON list of [FILE, OLD, NEW]
triples, for code with semicolons). The command runs in each copy with {out} replaced by the
variant's result file; its JSON, whatever it is, lands in one combined file.

    python3 scripts/variants_decode.py --out $OUT/variants.json \\
        --variant base --variant 'big=csrc/decode_mma.cuh:98304 : 49152=>122880 : 49152' \\
        --command 'python3 scripts/sweep_decode.py --only cluster --out {out}'
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ("csrc", "templates", "flashinfer_jit", "scripts")


def parse_variant(text: str) -> tuple[str, list[tuple[str, str, str]]]:
    name, _, edits = text.partition("=")
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--variant: a name of letters, digits and _ first, got {text!r}")
    if edits.startswith("@"):
        try:
            triples = json.loads(Path(edits[1:]).read_text())
        except (OSError, ValueError) as e:
            raise argparse.ArgumentTypeError(f"--variant {name}: cannot read the edits in {edits[1:]}: {e}")
        if not all(isinstance(t, list) and len(t) == 3 and all(isinstance(x, str) for x in t) for t in triples):
            raise argparse.ArgumentTypeError(f"--variant {name}: {edits[1:]} must hold a list of [FILE, OLD, NEW]")
        return name, [tuple(t) for t in triples]
    changes = []
    for edit in filter(None, edits.split(";")):
        path, sep, rest = edit.partition(":")
        old, arrow, new = rest.partition("=>")
        if not (sep and arrow and old):
            raise argparse.ArgumentTypeError(f"--variant {name}: expected FILE:OLD=>NEW, got {edit!r}")
        changes.append((path, old, new))
    return name, changes


def make_copy(dest: Path, changes) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    for name in TREE:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for path, old, new in changes:
        f = dest / path
        text = f.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"variants_decode: {old!r} occurs {text.count(old)} times in {path}, not once")
        f.write_text(text.replace(old, new))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", type=parse_variant, required=True)
    p.add_argument("--command", required=True, help="run in each copy; {out}: the variant's JSON file")
    p.add_argument("--out", required=True, help="the combined JSON")
    p.add_argument("--work", default="/tmp/fij_variants")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per variant")
    args = p.parse_args(argv)
    work = Path(args.work)
    combined = {"command": args.command, "variants": {}}
    for name, changes in args.variant:
        dest = work / name
        make_copy(dest / "src", changes)
        out = dest / "result.json"
        env = dict(os.environ, PYTHONPATH=str(dest / "src"), FLASHINFER_JIT_CACHE_DIR=str(dest / "cache"),
                   PYTHONUNBUFFERED="1")
        t0 = time.perf_counter()
        print(f"=== variant {name}: {changes or 'unchanged'}", flush=True)
        try:
            rc = subprocess.call(args.command.format(out=out), shell=True, cwd=dest / "src", env=env,
                                 timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        entry = {"changes": changes, "rc": rc, "seconds": round(time.perf_counter() - t0, 1)}
        if out.exists():
            entry["result"] = json.loads(out.read_text())
        combined["variants"][name] = entry
        Path(args.out).write_text(json.dumps(combined, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

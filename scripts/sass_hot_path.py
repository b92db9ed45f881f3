#!/usr/bin/env python3
"""No GPU, no measurement: the static issue cycles of a kernel's hot path, from its SASS.

cuobjdump's SASS carries each instruction's control bits; their stall field is the number of
cycles ptxas schedules before the warp may issue its next instruction. Summed along the path a
warp runs, that is the least time one warp takes through it with the pipes and the scoreboards
to itself: what a warp spends beyond it is waiting (on wgmma, barriers, MUFU results, other
warps' use of a pipe).

Which instructions form the hot path comes from ncu: `--ncu CSV` (gzipped or not) is the
source page of a run with the SourceCounters section (`ncu -i REP --page source --csv
--print-source sass`), and the instructions executed exactly `--count` times (by default the
count that holds the most executed instructions: once a warp a key tile, in the Hopper
prefill loop) are the path. The module must be the one ncu ran, or one built from the same source by the same nvcc:
the script checks that the two listings have the same opcodes in the same order.

  python3 scripts/sass_hot_path.py MODULE.so --ncu source.csv.gz [--list]

Without `--ncu`, `--from REGEX --to REGEX` sums the listing's instructions between the first
match of each (every branch's code included, taken or not).

Prints instructions and stall cycles by opcode, and (`--list`) the path with each
instruction's stall and ncu's warp samples. Needs `cuobjdump` on PATH (scripts/README.md says
where the CPU machine gets it) or `CUOBJDUMP`.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import os
import re
import subprocess
import sys

_INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* (0x[0-9a-f]{16}) \*/")
_CTRL = re.compile(r"\s*/\* (0x[0-9a-f]{16}) \*/")


def sass(module: str) -> list[tuple[str, int]]:
    """(instruction text, stall cycles) of every instruction of the module's SASS, in order."""
    tool = os.environ.get("CUOBJDUMP", "cuobjdump")
    lines = subprocess.run([tool, "-sass", module], check=True, capture_output=True, text=True).stdout.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        m = _INSN.match(line)
        c = _CTRL.match(lines[i + 1]) if m else None
        if m and c:
            # the 128-bit instruction's control bits are the top 23 of its second word; stall: 4 bits
            out.append((m.group(2).strip(), (int(c.group(1), 16) >> 41) & 0xF))
    return out


def opcode(text: str) -> str:
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def ncu_rows(path: str) -> list[tuple[str, int, int]]:
    """(source, instructions executed, warp samples) of each SASS line of an ncu source page."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        reader = csv.reader(fh)
        next(reader)  # the kernel's name
        hdr = next(reader)
        src, ex = hdr.index("Source"), hdr.index("Instructions Executed")
        smp = hdr.index("Warp Stall Sampling (All Samples)")
        return [(r[src].strip(), int(r[ex] or 0), int(r[smp] or 0)) for r in reader]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module")
    ap.add_argument("--ncu", help="ncu source page (CSV, optionally .gz) of the same kernel")
    ap.add_argument("--count", type=int, help="the hot path's execution count (default: the commonest)")
    ap.add_argument("--from", dest="start", help="without --ncu: the first instruction matching this")
    ap.add_argument("--to", dest="end", help="without --ncu: up to the first match after --from")
    ap.add_argument("--list", action="store_true", help="print the path")
    a = ap.parse_args()
    code = sass(a.module)
    if a.ncu:
        rows = ncu_rows(a.ncu)
        if len(rows) != len(code) or any(opcode(x[0]) != opcode(y[0]) for x, y in zip(code, rows)):
            sys.exit(f"{a.module} is not the kernel of {a.ncu}: {len(code)} against {len(rows)} instructions, "
                     "or other opcodes")
        per_count = collections.Counter(r[1] for r in rows if r[1] > 0)
        count = a.count or max(per_count, key=lambda c: c * per_count[c])  # where most execution is
        path = [(t, st, r[2]) for (t, st), r in zip(code, rows) if r[1] == count]
        print(f"hot path: the instructions executed {count} times")
    else:
        if not (a.start and a.end):
            sys.exit("give --ncu, or --from and --to")
        i = next((k for k, x in enumerate(code) if re.search(a.start, x[0])), None)
        j = None if i is None else next((k for k in range(i + 1, len(code)) if re.search(a.end, code[k][0])), None)
        if j is None:
            sys.exit(f"no instruction matches --from {a.start!r}, or none after it matches --to {a.end!r}")
        path = [(t, st, 0) for t, st in code[i:j]]
    by_n, by_st = collections.Counter(), collections.Counter()
    for t, st, _ in path:
        op = opcode(t).split(".")[0]
        by_n[op] += 1
        by_st[op] += st
    print(f"instructions {len(path)}, stall cycles {sum(st for _, st, _ in path)}")
    for op, st in by_st.most_common():
        print(f"  {op:12s} {by_n[op]:4d} instructions  {st:5d} cycles")
    if a.list:
        total = 0
        for t, st, s in path:
            total += st
            print(f"{total:6d} {st:3d} {s:7d}  {t}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

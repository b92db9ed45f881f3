#!/usr/bin/env python3
"""Instruction mix of a kernel's hottest loop, from SASS (cuobjdump -sass on the device).

The loop is the backward branch whose body holds the most HMMA (tensor-core MMA)
instructions; ties go to the shortest body. Prints the opcode counts of one iteration.

  cuobjdump -sass -fun decode_mma_kernel MODULE.so | python3 scripts/sass_loop_mix.py
  python3 scripts/sass_loop_mix.py --module-dir DIR   (runs cuobjdump on DIR/*.so)
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
TARGET = re.compile(r"(?:0x([0-9a-f]+)|`\(\.L_x_(\d+)\))")
LABEL = re.compile(r"^\s*\.L_x_(\d+):")


def parse(text: str):
    """[(address, opcode, operands)], {label: address}"""
    instrs, labels, pending = [], {}, []
    for line in text.splitlines():
        m = LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = INSTR.search(line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = addr
            pending = []
            instrs.append((addr, m.group(3), m.group(4)))
    return instrs, labels


def hottest_loop(instrs, labels):
    loops = []
    for addr, op, rest in instrs:
        if not op.startswith("BRA"):
            continue
        m = TARGET.search(rest)
        if not m:
            continue
        target = int(m.group(1), 16) if m.group(1) else labels.get(m.group(2))
        if target is not None and target < addr:
            loops.append((target, addr))
    if not loops:
        return None

    def hmma(lo_hi):
        return sum(1 for a, op, _ in instrs if lo_hi[0] <= a <= lo_hi[1] and op.startswith("HMMA"))

    return max(loops, key=lambda lh: (hmma(lh), -(lh[1] - lh[0])))


def mix(text: str) -> dict:
    instrs, labels = parse(text)
    loop = hottest_loop(instrs, labels)
    if loop is None:
        return {"error": "no loop found"}
    body = [op for a, op, _ in instrs if loop[0] <= a <= loop[1]]
    counts = collections.Counter(op.split(".")[0] for op in body)
    return {"loop": [hex(loop[0]), hex(loop[1])], "instructions": len(body), "opcodes": dict(counts.most_common())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module-dir", help="a built module's folder: cuobjdump -sass its .so")
    ap.add_argument("--function", default="decode_mma_kernel")
    args = ap.parse_args(argv)
    if args.module_dir:
        so = next(Path(args.module_dir).glob("*.so"))
        text = subprocess.run(["cuobjdump", "-sass", str(so)], capture_output=True, text=True, check=True).stdout
        # keep only the function's section
        parts = re.split(r"\n\s*Function : ", text)
        text = "\n".join(p for p in parts if args.function in p.split("\n", 1)[0])
    else:
        text = sys.stdin.read()
    result = mix(text)
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

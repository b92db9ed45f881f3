#!/usr/bin/env python3
"""Static SASS metrics of a built prefill module (a development tool; no GPU needed).

For each prefill_kernel in the module's .so (cuobjdump -sass), of the 128-row tile by default:
  - how far each ldmatrix result is from its first use: instructions and HMMAs in between,
    and the share of loads whose data an HMMA wants after fewer than 2 HMMAs (those HMMAs
    wait on the shared-memory load: ncu's short-scoreboard stalls). S = Q K^T (LDSM) and
    O += P V (LDSM.MT88, the V fragments) apart;
  - local-memory spill instructions (LDL/STL) between the kernel's first and last HMMA.
They predicted the measured order (docs/prefill.md, where the time goes), head_dim 128,
128-row tile: c5f680e's kernel (ragged) 7.2 / 5.1 HMMAs between a q or K / a V fragment's
load and its use (20% / 30% under 2), 6d5838c's paired tiles (paged) 8.3 / 10.4 (10% / 5%),
and FA2's kernel, by the same measure over its hot loop in ncu's source view, 7.1 / 10.6
(6% / 6%).

  python3 scripts/sass_ldsm_distance.py CACHE_DIR/prefill_..._paged-<hash>/*.so [--rows 64]

Needs cuobjdump: the CUDA toolkit's, or the nvidia-cuda-cuobjdump wheel's
(`pip download --no-deps nvidia-cuda-cuobjdump`, unzip, nvidia/cu13/bin/cuobjdump), or
CUOBJDUMP=path."""
import argparse
import os
import re
import shutil
import subprocess
import sys

_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_PRED = re.compile(r"^(@!?U?P\w+\s+)?(\S+)\s*(.*)$")


def functions(sass: str):
    """(name, [instruction text]) of each function in cuobjdump -sass output."""
    for chunk in sass.split("Function : ")[1:]:
        name = chunk.split("\n", 1)[0].strip()
        yield name, [m.group(2).strip() for m in _INS.finditer(chunk)]


def sources(text: str) -> set:
    """Registers an instruction reads (everything but a defining first operand)."""
    m = _PRED.match(text)
    opcode, args = m.group(2), m.group(3)
    ops = [o.strip() for o in args.split(",")] if args else []
    writes_first = not opcode.startswith(("ST", "BRA", "BAR", "LDGSTS", "RED", "ATOM", "EXIT", "ISETP", "FSETP"))
    regs = set()
    for k, op in enumerate(ops):
        if k == 0 and writes_first and not op.startswith("["):
            continue
        regs |= {int(r) for r in re.findall(r"(?<![U\w])R(\d+)\b", op)}
    return regs


def distances(ins: list) -> dict:
    """kind -> [(instructions to first use, HMMAs in between)] for every LDSM."""
    out = {"S = Q K^T": [], "O += P V": []}
    for i, text in enumerate(ins):
        m = re.match(r"^(?:@!?U?P\w+\s+)?(LDSM\S*)\s+R(\d+)", text)
        if not m:
            continue
        loaded = set(range(int(m.group(2)), int(m.group(2)) + 4))
        hmmas = 0
        for j in range(i + 1, min(i + 400, len(ins))):
            if re.search(r"\bBRA\b", ins[j]):
                break
            if sources(ins[j]) & loaded:
                out["O += P V" if ".MT88" in m.group(1) else "S = Q K^T"].append((j - i, hmmas))
                break
            if "HMMA" in ins[j]:
                hmmas += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("so", help="a built prefill module (.so)")
    ap.add_argument("--rows", type=int, choices=(64, 128), default=128, help="the tile's rows (default 128)")
    args = ap.parse_args()
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if tool is None:
        print("sass_ldsm_distance: no cuobjdump (CUDA toolkit, the nvidia-cuda-cuobjdump wheel, or CUOBJDUMP=path)",
              file=sys.stderr)
        return 2
    sass = subprocess.run([tool, "-sass", args.so], check=True, capture_output=True, text=True).stdout
    mfrags = "Li2EE" if args.rows == 128 else "Li1EE"
    found = False
    for name, ins in functions(sass):
        if "prefill_kernel" not in name or mfrags not in name:
            continue
        found = True
        hmma = [i for i, t in enumerate(ins) if "HMMA" in t]
        spills = [t for i, t in enumerate(ins) if hmma and hmma[0] < i < hmma[-1] and re.match(r"^(@\S+\s+)?(LDL|STL)", t)]
        print(f"{name[:110]}...\n  {len(ins)} instructions, {len(hmma)} HMMA, {len(spills)} LDL/STL inside the HMMA span")
        for kind, ds in distances(ins).items():
            if ds:
                n = len(ds)
                print(f"  {kind}: {n} ldmatrix, {sum(d for d, _ in ds) / n:.1f} instructions and "
                      f"{sum(h for _, h in ds) / n:.1f} HMMAs to first use, {sum(h < 2 for _, h in ds) / n:.0%} under 2 HMMAs")
    if not found:
        print(f"sass_ldsm_distance: no {args.rows}-row prefill_kernel in {args.so}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

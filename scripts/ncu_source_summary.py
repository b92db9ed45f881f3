#!/usr/bin/env python3
"""The SASS instructions where a kernel's warps stall most, from ncu's source page.

  ncu --clock-control none --kernel-name regex:prefill_sm90 --launch-skip 2 --launch-count 1 \\
      --section SourceCounters --section WarpStateStats --import-source yes -o prof \\
      python3 scripts/ncu_prefill_sm90.py ours 128 causal 64 256
  ncu -i prof.ncu-rep --page source --csv --print-source sass > source.csv
  python3 scripts/ncu_source_summary.py source.csv [--top 25]

Reads the CSV (one row an instruction: its address, its SASS, and the warp-state sampling
columns), ranks the instructions by their stall samples, and prints the top ones with each
sampling column that is not zero, plus the sum of every column over the kernel. A diagnostic
for docs/hopper.md's short rows; it reads whatever sampling columns this ncu version names.
"""

from __future__ import annotations

import argparse
import csv
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        lines = [line for line in f if line.strip()]
    # ncu may print its own lines before the table: the header is the first row naming "Source"
    start = next((i for i, line in enumerate(lines) if "Source" in line and "," in line), None)
    if start is None:
        print("no source table in the CSV", file=sys.stderr)
        return 1
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        print("empty source table", file=sys.stderr)
        return 1
    cols = list(rows[0].keys())
    # the sampling totals and, where this ncu version prints them, the per-reason columns
    sampling = [c for c in cols if "Sampl" in c or c.strip().lower().startswith("stall")]
    total_col = next((c for c in sampling if "All" in c), sampling[0] if sampling else None)
    if total_col is None:
        print(f"no sampling column among {cols}", file=sys.stderr)
        return 1
    address = next((c for c in cols if "Address" in c), cols[0])
    source = next((c for c in cols if c.strip() == "Source"), cols[1])
    sums = {c: sum(number(r[c]) for r in rows) for c in sampling}
    grand = sums[total_col] or 1.0
    print(f"{len(rows)} instructions; {total_col}: {sums[total_col]:.0f} samples")
    for c in sorted(sampling, key=lambda c: -sums[c]):
        if sums[c] and c != total_col:
            print(f"  {c}: {sums[c]:.0f} ({100 * sums[c] / grand:.1f}%)")
    print()
    for r in sorted(rows, key=lambda r: -number(r[total_col]))[:args.top]:
        parts = [f"{c}={number(r[c]):.0f}" for c in sampling if c != total_col and number(r[c])]
        print(f"{number(r[total_col]):7.0f} {100 * number(r[total_col]) / grand:5.1f}%  {r[address]:>8}  "
              f"{r[source].strip()[:70]:<70}  {' '.join(parts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

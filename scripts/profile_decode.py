"""Run one batch-decode case a few times, for a profiler (not a benchmark):

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        -k regex:decode --launch-skip 3 --launch-count 1 \\
        python3 scripts/profile_decode.py --kv-dtype float8_e4m3fn --gqa 4 --batch 64 --kv-len 4096

Inputs are the benchmark's (scripts/bench_decode.py): bf16 q, head_dim 128, page 16, NHD,
CSR with randomly permuted pages, random (never zero) K/V.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode as bd  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--gqa", type=int, choices=sorted(bd.GQA_HEADS), default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kv-len", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    import torch

    case = bd.uniform(args.kv_dtype, args.gqa, args.batch, args.kv_len)
    inputs = bd.Inputs(case, n_sets=1, seed=0)
    plan, run = bd.make_runner("ours", inputs, None)
    plan()
    for _ in range(args.iters):
        run(0)
    torch.cuda.synchronize()
    print(f"ran {case} x {args.iters}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

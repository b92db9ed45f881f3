#!/usr/bin/env python3
"""One mix of scripts/bench_pod_hopper.py run three times by one implementation, for ncu to
profile the third launch (no timing, no L2 flush; ncu flushes between its passes).

  ncu --clock-control none --kernel-name regex:pod_sm90 --launch-skip 2 --launch-count 1 \
      --metrics dram__bytes_read.sum,... python3 scripts/ncu_pod_hopper.py pod_hopper 4

implementation: one of bench_pod_hopper.IMPLS (kernels: pod_sm90_kernel, decode_mma_kernel,
prefill_sm90_kernel); mix: 1-6 (default 4). docs/pod.md cites the run of 2026-11-30.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pod as bpod  # noqa: E402
import bench_pod_hopper as b  # noqa: E402


def main() -> None:
    import torch

    name = sys.argv[1]
    row = b.rows([int(sys.argv[2]) if len(sys.argv) > 2 else 4])[0]
    x = bpod.Inputs(row, 0)
    f = b.make(name, x, row)
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    print("done", name, row.label)


if __name__ == "__main__":
    main()

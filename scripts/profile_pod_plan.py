#!/usr/bin/env python3
"""Where a batch POD plan() spends its host time: cProfile over many plans of
bench_pod_host.py's batch (16 prefill chunks + 256 decodes, two batches in turn), the
functions sorted by their own time. A diagnostic for docs/pod.md's Host time; run it on the
GPU host (on a CPU-only machine the plans take CPU tensors: no copies, no launches).

  python3 scripts/profile_pod_plan.py [--plans N] [--top K] [--backend fa2|auto] [--wrapper pod|batch_attention]
                                     [--as-sm90] [--rounds R]

--wrapper batch_attention profiles BatchAttention.plan() of the same requests as one mixed
batch (decodes first), as bench_pod_host.py times it. --as-sm90 (for a CPU-only machine)
plans as on an H100 / H200 (the Hopper kernel's arch check skipped, as the CPU tests of
its planner do), so the path POD on Hopper takes is the one profiled, less its copies.
--rounds R times R rounds of --plans plans before the profile and prints their minimum and
median (a round's mean a plan), the figure docs/pod.md's Host time quotes for the CPU machine.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402,F401  (puts the repository on sys.path)
from bench_pod_host import HEADS, mixed  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", type=int, default=2000)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--backend", default="fa2")
    ap.add_argument("--wrapper", default="pod", choices=("pod", "batch_attention"))
    ap.add_argument("--as-sm90", action="store_true")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    import torch

    import flashinfer_jit as fij

    if args.as_sm90:
        from flashinfer_jit.prefill import sm90
        sm90.arch_error = lambda device: None

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = [mixed(torch, s, device) for s in (0, 1)]
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    if args.wrapper == "pod":
        pod = fij.BatchPODWithPagedKVCacheWrapper(ws, "NHD")
        pod.prefill_backend = args.backend

        def plan(i):
            p, d, _ = batches[i & 1]
            pod.plan(p[0], p[1], p[2], p[3], d[0], d[1], d[2], d[3], *HEADS, q_data_type=torch.bfloat16,
                     causal=True)
    else:
        ba = fij.BatchAttention("NHD", device=str(device))
        ba.prefill_backend = args.backend

        def plan(i):
            m = batches[i & 1][2]
            ba.plan(m[0], m[1], m[2], m[4], 32, 8, 128, 128, 16, causal=True, q_data_type=torch.bfloat16,
                    kv_data_type=torch.bfloat16)

    for i in range(200):
        plan(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rounds = []
    for _ in range(max(1, args.rounds)):
        t = time.perf_counter_ns()
        for i in range(args.plans):
            plan(i)
        rounds.append((time.perf_counter_ns() - t) / args.plans / 1e3)
    plain = min(rounds)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(args.plans):
        plan(i)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    print(f"{args.wrapper} plan() {plain:.1f} us a call without the profiler ({device}{', as sm90' if args.as_sm90 else ''}, "
          f"prefill_backend {args.backend}; min of {len(rounds)} rounds of {args.plans}, median "
          f"{sorted(rounds)[len(rounds) // 2]:.1f})")
    print(s.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())

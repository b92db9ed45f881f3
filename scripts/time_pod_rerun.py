#!/usr/bin/env python3
"""Drives fij_fastcall's pod_rerun and pod_run 4000 times each (20 rounds of 200, a sync
between) on profile_pod_run.py's small batch (POD on Hopper, sm_90), then a bare torch launch;
prints each call's median from Python ("PY ..."). In a tree instrumented by
scripts/instrument_pod_rerun.py the stage timings print to stderr beside them.

  python3 scripts/time_pod_rerun.py          # from the repository root; GPU (sm_90) only
"""
import sys, time
from pathlib import Path
sys.path[:0] = [".", "scripts"]
import torch
import flashinfer_jit as fij
from bench_pod_host import HEADS, csr
from flashinfer_jit.runtime import fastcall

dev = torch.device("cuda")
bf16 = torch.bfloat16
p, d = csr(torch, [16], [1024], dev), csr(torch, [1] * 8, [2048] * 8, dev)
cache = torch.randn(512, 2, 16, 8, 128, device=dev).to(bf16)
q_p, q_d = torch.randn(16, 32, 128, device=dev).to(bf16), torch.randn(8, 32, 128, device=dev).to(bf16)
w = fij.BatchPODWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD")
w.prefill_backend = "fa3"
plan = lambda: w.plan(p[0], p[1], p[2], p[3], d[0], d[1], d[2], d[3], *HEADS, q_data_type=bf16, kv_data_type=bf16, causal=True)
plan()
w.run(q_p, cache, q_d, cache, causal_p=True)
plan()
kept, bounds = w._quick, w._replan_bounds
assert kept is not None and bounds is not None
ext = fastcall.extension()
rerun_args = (w._sm90_relaunch, kept.address, kept.signature, w._relaunch_plan(), bounds, (-1, -1), q_p, cache, q_d,
              cache, None, None, None, None, 0, 0, 0)
got = ext.pod_rerun(*rerun_args)
assert type(got) is tuple
torch.cuda.synchronize()


def loop(fn, label):
    per = []
    for _ in range(20):
        torch.cuda.synchronize()
        t = time.perf_counter_ns()
        for _ in range(200):
            fn()
        per.append((time.perf_counter_ns() - t) / 200 / 1e3)
    per.sort()
    print(f"PY {label}: median {per[10]:.2f} us a call (rounds of 200)", file=sys.stderr, flush=True)


loop(lambda: ext.pod_rerun(*rerun_args), "pod_rerun")
fresh = w._quick
sig = got[4]
run_args = (fresh.entry, fresh.address, sig, q_p, cache, q_d, cache, None, None, None, None, 0, 0, 0, False)
assert type(fresh.run(*run_args)) is tuple
loop(lambda: fresh.run(*run_args), "pod_run")
x = torch.empty(1024, device=dev)
loop(lambda: x.add_(1.0), "bare torch launch")
torch.cuda.synchronize()

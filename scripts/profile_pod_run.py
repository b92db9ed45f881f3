#!/usr/bin/env python3
"""Where POD on Hopper's run() spends its host time when it cannot take its recorded launch:
the first run() after each plan(), which an engine pays once a step (docs/pod.md, Host time).

bench_pod_host.py's small batch (one 16-token chunk on 1k keys and 8 decodes on 2k, bf16,
32 / 8 heads, head_dim 128, page 16, causal; its GPU time is below the host's), on a
BatchPODWithPagedKVCacheWrapper with prefill_backend "fa3". Timed with time.perf_counter_ns
(no sync inside a round; median over rounds, µs a call):
  fast           run() through its recorded launch (fij_fastcall.pod_run)
  op             run() with the record dropped before each call (the op path, recording again)
  op_no_record   the same, the record not made (the op called without `prepared`)
  run_after_plan plan() (two batches of other lengths in turn, untimed), then run(), each
                 run() timed alone (median of --calls): the first run() after a plan, through
                 fij_fastcall.pod_rerun; run_after_plan_op the same with plan() dropping
                 the record (through the op)
  rerun_loop     run() through pod_rerun in a hot loop (the plan's kept record restored
                 before each call); pod_rerun_alone and pod_run_alone the two extension calls
                 by themselves
  *_after_plan, *_after_spin, *_alone  a bare torch launch and run() (pod_rerun), each
                 call timed alone after an untimed plan() (also plan() and a sync), a 60 µs
                 spin of the CPU, or nothing: what the time straight after a plan() costs
                 any launch
  raw_op         the POD op alone, called with the arguments the wrapper passed it (the
                 dispatcher, the C++ resolve and the launch)
and the op path's parts (each timed by a wrapper around it, ~0.2 µs each added): the prefill
side's argument checks (_sm90_args), the decode side's (_resolved_args), the record's
signature and buffer (_record_for), the op call. Then cProfile of the op path, by own time.

  python3 scripts/profile_pod_run.py [--calls N] [--rounds R] [--top K] [--out FILE]
GPU only (sm_90).
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (also puts the repository on sys.path)
from bench_pod_host import HEADS, csr, timed_parts  # noqa: E402
from bench_prefill_host import per_call_us  # noqa: E402


def timed_after(prep, call, n: int) -> dict:
    """call() timed alone after an untimed prep(), n times (after 4 untimed): median, min µs."""
    times = []
    for i in range(n + 4):
        prep()
        t = time.perf_counter_ns()
        call()
        if i >= 4:
            times.append((time.perf_counter_ns() - t) / 1e3)
    times.sort()
    return {"median_us": round(times[len(times) // 2], 2), "min_us": round(times[0], 2), "n": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    import flashinfer_jit as fij
    if not torch.cuda.is_available():
        print("profile_pod_run.py: needs a GPU (sm_90)", file=sys.stderr)
        return 2
    from flashinfer_jit.decode.wrapper import BatchDecodeWithPagedKVCacheWrapper
    from flashinfer_jit.pod.wrapper import _Pod
    from flashinfer_jit.prefill.wrapper import BatchPrefillWithPagedKVCacheWrapper

    device = torch.device("cuda")
    bf16 = torch.bfloat16
    sync = torch.cuda.synchronize
    p = csr(torch, [16], [1024], device)
    p2 = csr(torch, [12], [1500], device)
    d = csr(torch, [1] * 8, [2048] * 8, device)
    d2 = csr(torch, [1] * 8, [1800] * 8, device)
    num_pages = 512
    cache = torch.randn(num_pages, 2, 16, 8, 128, device=device).to(bf16)
    q_p = torch.randn(16, 32, 128, device=device).to(bf16)
    q_p2 = torch.randn(12, 32, 128, device=device).to(bf16)
    q_d = torch.randn(8, 32, 128, device=device).to(bf16)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    w = fij.BatchPODWithPagedKVCacheWrapper(ws, "NHD")
    w.prefill_backend = "fa3"

    def plan(pp, dd):
        w.plan(pp[0], pp[1], pp[2], pp[3], dd[0], dd[1], dd[2], dd[3], *HEADS, q_data_type=bf16, kv_data_type=bf16,
               causal=True)

    plan(p, d)
    w.run(q_p, cache, q_d, cache, causal_p=True)
    sync()
    res = {"meta": bc.run_metadata(), "fast_path_taken": w._quick is not None}
    run = lambda: w.run(q_p, cache, q_d, cache, causal_p=True)  # noqa: E731
    res["fast"] = per_call_us(run, args.calls, args.rounds, sync)

    def op():
        w._quick = None
        w.run(q_p, cache, q_d, cache, causal_p=True)
    res["op"] = per_call_us(op, args.calls, args.rounds, sync)

    record_for = inspect.getattr_static(_Pod, "_record_for")
    _Pod._record_for = staticmethod(lambda spec, record: None)
    try:
        res["op_no_record"] = per_call_us(op, args.calls, args.rounds, sync)
    finally:
        _Pod._record_for = record_for

    # an engine's step: plan() of new lengths (untimed), then run(), timed alone (q's rows follow
    # the plan): through pod_rerun, then with plan() dropping the record (through the op)
    from bench_pod_host import run_after_plan
    batches = ((p, d, q_p, q_d), (p2, d2, q_p2, q_d))
    res["run_after_plan"] = run_after_plan(torch, w, batches, cache, args.calls)
    res["rerun_taken"] = w._quick is not None and w._replan_bounds is None
    w._replans_record = False
    res["run_after_plan_op"] = run_after_plan(torch, w, batches, cache, args.calls)
    w._replans_record = True

    # the rerun path in a hot loop (the kept record restored before each run()), and the two
    # extension calls alone: pod_rerun (resolve, record, launch) against pod_run (relaunch)
    from flashinfer_jit.runtime import fastcall
    plan(p, d)
    kept, bounds = w._quick, w._replan_bounds
    assert kept is not None and bounds is not None, "plan() dropped the record"

    def rerun():
        w._quick, w._replan_bounds = kept, bounds
        w.run(q_p, cache, q_d, cache, causal_p=True)
    res["rerun_loop"] = per_call_us(rerun, args.calls, args.rounds, sync)
    ext = fastcall.extension()
    rerun_args = (w._sm90_relaunch, kept.address, kept.signature, w._relaunch_plan(), bounds, (-1, -1), q_p, cache,
                  q_d, cache, None, None, None, None, 0, 0, 0)
    assert type(ext.pod_rerun(*rerun_args)) is tuple
    res["pod_rerun_alone"] = per_call_us(lambda: ext.pod_rerun(*rerun_args), args.calls, args.rounds, sync)
    fresh = w._quick
    run_args = (fresh.entry, fresh.address, fresh.signature, q_p, cache, q_d, cache, None, None, None, None, 0, 0, 0,
                False)
    assert w._replan_bounds is None and type(fresh.run(*run_args)) is tuple
    res["pod_run_alone"] = per_call_us(lambda: fresh.run(*run_args), args.calls, args.rounds, sync)

    # what "straight after a plan()" costs any launch: each call below timed alone (median of
    # --calls) after an untimed step: a plan() of the two batches in turn, the same plus a
    # device sync, a 60 µs spin of the CPU (no plan), or nothing; the call a bare torch launch
    # or run() (through pod_rerun: the kept record restored where no plan() precedes it)
    x = torch.empty(1024, device=device)
    step = [0]

    def plan_next():
        step[0] += 1
        pp, dd, _, _ = batches[step[0] % 2]
        plan(pp, dd)

    def run_planned():
        _, _, qp, qd = batches[step[0] % 2]
        w.run(qp, cache, qd, cache, causal_p=True)

    def restore():
        w._quick, w._replan_bounds = kept, bounds

    def spin():
        restore()
        t = time.perf_counter_ns()
        while time.perf_counter_ns() - t < 60_000:
            pass
    plan(p, d)
    step[0] = 0
    controls = {"bare_launch_after_plan": (plan_next, lambda: x.add_(1.0)),
                "bare_launch_after_spin": (spin, lambda: x.add_(1.0)),
                "bare_launch_alone": (lambda: None, lambda: x.add_(1.0)),
                "rerun_after_plan": (plan_next, run_planned),
                "rerun_after_plan_synced": (lambda: (plan_next(), sync()), run_planned),
                "rerun_after_spin": (spin, run),
                "rerun_alone": (restore, run)}
    for label, (prep, call) in controls.items():
        plan(p, d)
        step[0] = 0
        kept, bounds = w._quick, w._replan_bounds
        res[label] = timed_after(prep, call, args.calls * 2)
        sync()

    # the op alone, with the arguments the wrapper last passed it
    plan(p, d)
    captured = {}
    real_op = w._sm90_op

    def spy(*a):
        captured["args"] = a
        return real_op(*a)
    w._sm90_op = spy
    op()
    w._sm90_op = real_op
    a = list(captured["args"])
    a[-1] = None  # (no record)
    res["raw_op"] = per_call_us(lambda: real_op(*a), args.calls, args.rounds, sync)

    class OpHolder:  # the op call as a part of its own
        pass
    parts = {"prefill _sm90_args": (BatchPrefillWithPagedKVCacheWrapper, "_sm90_args"),
             "decode _resolved_args": (BatchDecodeWithPagedKVCacheWrapper, "_resolved_args"),
             "_record_for": (_Pod, "_record_for"), "_keep_record": (_Pod, "_keep_record"),
             "_run_sm90 (all of the op path below run())": (_Pod, "_run_sm90")}
    OpHolder.op = staticmethod(real_op)
    w._sm90_op = lambda *x: OpHolder.op(*x)
    parts["op call"] = (OpHolder, "op")
    res["op_parts"] = timed_parts(args.calls * 5, op, parts)
    w._sm90_op = real_op

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls * 5):
        op()
    prof.disable()
    sync()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    text = s.getvalue()
    print(json.dumps(res, indent=1))
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        Path(args.out).with_suffix(".profile.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

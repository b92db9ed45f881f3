#!/usr/bin/env python3
"""What a split of the SMs can give POD on Hopper, measured before writing it
(docs/pod.md, "POD on Hopper"): our Hopper prefill (backend "fa3", paged) with its persistent
grid cut to N blocks on one stream and our decode on a second stream at the same time (the
decode's blocks take the SMs the prefill leaves, then the ones it frees), against the two back
to back and each alone, and the mma.sync POD, on bench_pod.py's mixes 1-6 (bf16, 32/8 heads,
head_dim 128, page 16). CUDA events around the whole region, L2 flushed, median of 25.
Prints one line a mix: P, D (each alone), serial, pod_mmasync, concN (both streams, the
prefill on N blocks) and PN (the prefill alone on N blocks), µs.

  python3 scripts/pod_two_streams.py [--warm]   (--warm: build the modules, time nothing)"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pod as bpod
import flashinfer_jit as fij

dev = "cuda"
flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
rows = [r for r in bpod.row_list(True) if r.decodes > 0]
for row in rows:
    x = bpod.Inputs(row, 0)
    heads = (32, 8, 128, 16)
    ws1 = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ws2 = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ws3 = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    pw = fij.BatchPrefillWithPagedKVCacheWrapper(ws1, "NHD", backend="fa3")
    pw.plan(x.qo_indptr_p, x.kv_indptr_p, x.indices_p, x.last_p, *heads, causal=True, q_data_type=torch.bfloat16)
    dw = fij.BatchDecodeWithPagedKVCacheWrapper(ws2, "NHD", use_tensor_cores=True)
    dw.plan(x.kv_indptr_d, x.indices_d, x.last_d, *heads, q_data_type=torch.bfloat16)
    pod = fij.BatchPODWithPagedKVCacheWrapper(ws3, kv_layout="NHD")
    pod.plan(x.qo_indptr_p, x.kv_indptr_p, x.indices_p, x.last_p, x.qo_indptr_d, x.kv_indptr_d, x.indices_d,
             x.last_d, *heads, q_data_type=torch.bfloat16, causal=True)
    full = pw._plan.grid
    if "--warm" in sys.argv:  # builds (JIT) only
        pw.run(x.q_p, x.cache_p); dw.run(x.q_d, x.cache_d); pod.run(x.q_p, x.cache_p, x.q_d, x.cache_d, causal_p=True)
        torch.cuda.synchronize(); print("warmed", row.note[:6], flush=True)
        continue

    def timed(fn, reps=25):
        for _ in range(3): fn()
        ts = []
        for _ in range(reps):
            flush.zero_()
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record(); fn(); e1.record(); e1.synchronize(); ts.append(e0.elapsed_time(e1) * 1e3)
        return statistics.median(ts)

    def prefill(): pw.run(x.q_p, x.cache_p)
    def decode(): dw.run(x.q_d, x.cache_d)
    def serial(): prefill(); decode()
    def podrun(): pod.run(x.q_p, x.cache_p, x.q_d, x.cache_d, causal_p=True)

    def concurrent():
        main = torch.cuda.current_stream()
        s1.wait_stream(main); s2.wait_stream(main)
        with torch.cuda.stream(s1): prefill()
        with torch.cuda.stream(s2): decode()
        main.wait_stream(s1); main.wait_stream(s2)

    res = {"P": timed(prefill), "D": timed(decode), "serial": timed(serial), "pod_mmasync": timed(podrun)}
    for n in (full, 120, 110, 100, 92, 84, 76, 66):
        pw._plan.grid = n
        pw._plan.fast, pw._plan.quick = [None, None], None
        res[f"conc{n}"] = timed(concurrent)
        res[f"P{n}"] = timed(prefill)
    pw._plan.grid = full
    best = min(v for k, v in res.items() if k.startswith("conc"))
    print(f"SP {row.note.split(';')[0]:8s} " + " ".join(f"{k}={v:.0f}" for k, v in res.items())
          + f" | serial/best_conc={res['serial'] / best:.2f} bound=max(P,D)={max(res['P'], res['D']):.0f}", flush=True)

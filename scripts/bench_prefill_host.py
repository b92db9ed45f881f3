#!/usr/bin/env python3
"""Host cost of the prefill wrappers: plan() and run().

The issue's targets: plan() costs <= 50 us of host time for 256 requests, with at most one
host-to-device copy; run() adds <= 10 us of host time. Measured:
  (a) plan() of BatchPrefillWithPagedKVCacheWrapper for 256 requests of 1-16 query tokens
      on 1-2k keys (speculative verification / chunked steps), page 16, 32 query / 8 KV
      heads, head_dim 128, bf16, causal, CSR page table with host int32 qo_indptr, indptr
      and last_page_len and the page ids on the device; two batches of different lengths
      alternate. The C++ planner, and the numpy path (FLASHINFER_JIT_NATIVE_PLAN=0).
  (b) with a GPU: run()'s enqueue time (no sync inside a round) for that batch (also with
      its C entry called through ctypes instead of fij_fastcall) and for one request of
      16 tokens, next to one bare torch launch; FlashInfer's FA2 plan() and
      run() on the same batch where `import flashinfer` works.
Each figure is time.perf_counter_ns over n calls per round, the median over rounds.

  python3 scripts/bench_prefill_host.py [--out FILE] [--rounds N] [--no-flashinfer]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (also puts the repository on sys.path)


def per_call_us(fn, n: int, rounds: int, sync=None) -> dict:
    samples = []
    for _ in range(rounds):
        if sync:
            sync()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter_ns() - t0) / n / 1e3)
    return {"median_us": round(statistics.median(samples), 2), "min_us": round(min(samples), 2), "n": n,
            "rounds": rounds}


def batch(torch, device, seed: int, requests: int = 256, page_size: int = 16):
    g = torch.Generator().manual_seed(seed)
    qo = torch.randint(1, 17, (requests,), generator=g)
    kv = qo + torch.randint(1024, 2048, (requests,), generator=g)
    pages = (kv + page_size - 1) // page_size
    qo_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), qo.cumsum(0)]).int()
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)]).int()
    last = (kv - (pages - 1) * page_size).int()
    indices = torch.randperm(int(indptr[-1]), generator=g).int().to(device)
    return qo_indptr, indptr, indices, last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args()
    import torch

    import flashinfer_jit as fij

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    sync = torch.cuda.synchronize if gpu else None
    res = {"benchmark": "prefill_host", "meta": bc.run_metadata(), "gpu": gpu}
    heads = (32, 8, 128, 16)
    batches = [batch(torch, device, s) for s in (0, 1)]
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)

    def plan_pair(w):
        def two():
            for qo_indptr, indptr, indices, last in batches:
                w.plan(qo_indptr, indptr, indices, last, *heads, causal=True, q_data_type=torch.bfloat16)
        return two

    for label, native in (("plan_native", "1"), ("plan_numpy", "0")):
        os.environ["FLASHINFER_JIT_NATIVE_PLAN"] = native
        w = fij.BatchPrefillWithPagedKVCacheWrapper(ws)
        plan_pair(w)()
        r = per_call_us(plan_pair(w), 50, args.rounds)
        r = {k: (round(v / 2, 2) if k.endswith("_us") else v) for k, v in r.items()}  # two plans a call
        res[label] = r
    os.environ["FLASHINFER_JIT_NATIVE_PLAN"] = "1"
    if gpu:
        w = fij.BatchPrefillWithPagedKVCacheWrapper(ws)
        qo_indptr, indptr, indices, last = batches[0]
        w.plan(qo_indptr, indptr, indices, last, *heads, causal=True, q_data_type=torch.bfloat16)
        num_pages = int(indptr[-1])
        k = torch.randn(num_pages, 16, 8, 128, dtype=torch.bfloat16, device=device)
        v = torch.randn_like(k)
        q = torch.randn(int(qo_indptr[-1]), 32, 128, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(q)
        w.run(q, (k, v), out=out)
        res["run_256_small"] = per_call_us(lambda: w.run(q, (k, v), out=out), 20, args.rounds, sync)
        res["run_256_small_alloc"] = per_call_us(lambda: w.run(q, (k, v)), 20, args.rounds, sync)
        res["run_256_small_no_pdl"] = per_call_us(lambda: w.run(q, (k, v), out=out, enable_pdl=False), 20,
                                                  args.rounds, sync)
        res["pdl_default"] = bool(w._pdl)
        # the launch alone: the recorded C entry point run() calls, with the same arguments
        fast = w._plan.fast[0]
        if fast is not None:
            fn, _, prepared_ptr, device_index = fast
            stream = torch.cuda.current_stream().cuda_stream
            qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
            c = w._plan.config
            for pdl in (0, 1):
                res["run_256_small_c_launch" + ("_pdl" if pdl else "")] = per_call_us(
                    lambda: fn(prepared_ptr, qp, kp, vp, op, 0, 0, c.logit_scale, c.cap_log2, 1.0, -1, stream, pdl),
                    20, args.rounds, sync)
        # the same run() with its C entry called through ctypes (fij_fastcall off): what the
        # extension saves
        from flashinfer_jit.runtime import fastcall, launch
        ext = fastcall.extension
        try:
            fastcall.extension = lambda: None
            launch.fast_entry.cache_clear()
            wc = fij.BatchPrefillWithPagedKVCacheWrapper(ws)
            wc.plan(qo_indptr, indptr, indices, last, *heads, causal=True, q_data_type=torch.bfloat16)
            wc.run(q, (k, v), out=out)
            wc.run(q, (k, v), out=out)
            res["run_256_small_ctypes"] = per_call_us(lambda: wc.run(q, (k, v), out=out), 20, args.rounds, sync)
        finally:
            fastcall.extension = ext
            launch.fast_entry.cache_clear()
        res["fastcall"] = "fij_fastcall" if ext() is not None else "ctypes (the extension is unavailable)"
        # one request (16 tokens on 1k keys): the GPU's time under the host's
        w1 = fij.BatchPrefillWithPagedKVCacheWrapper(ws)
        one = (torch.tensor([0, 16], dtype=torch.int32), torch.tensor([0, 64], dtype=torch.int32),
               torch.arange(64, dtype=torch.int32, device=device), torch.tensor([16], dtype=torch.int32))
        w1.plan(*one, *heads, causal=True, q_data_type=torch.bfloat16)
        q1, out1 = q[:16], out[:16]
        w1.run(q1, (k, v), out=out1)
        res["run_1_request"] = per_call_us(lambda: w1.run(q1, (k, v), out=out1), 20, args.rounds, sync)
        # decode's run() and C launch beside prefill's (the same ctypes fast path): b=1, kv 1k
        d = fij.BatchDecodeWithPagedKVCacheWrapper(ws)
        d.plan(torch.tensor([0, 64], dtype=torch.int32), torch.arange(64, dtype=torch.int32),
               torch.tensor([16], dtype=torch.int32), 32, 8, 128, 16, q_data_type=torch.bfloat16)
        qd = q[:1].clone()
        od = torch.empty_like(qd)
        d.run(qd, (k, v), out=od)
        d.run(qd, (k, v), out=od)
        res["decode_run_1_request"] = per_call_us(lambda: d.run(qd, (k, v), out=od), 20, args.rounds, sync)
        dp = d._plan
        if dp.fast is not None:
            stream = torch.cuda.current_stream().cuda_stream
            da = (dp.fast.address, qd.data_ptr(), k.data_ptr(), v.data_ptr(), od.data_ptr(), 0,
                  dp.config.logit_scale, 1.0, -1, stream, 0)
            res["decode_1_request_c_launch"] = per_call_us(lambda: dp.fast.call(*da), 20, args.rounds, sync)
            da = da[:-1] + (1,)
            res["decode_1_request_c_launch_pdl"] = per_call_us(lambda: dp.fast.call(*da), 20, args.rounds, sync)
        x = torch.empty(1, device=device)
        res["bare_torch_launch"] = per_call_us(lambda: x.add_(1), 200, args.rounds, sync)
        if not args.no_flashinfer:
            try:
                import flashinfer
                fw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8,
                                                                                device=device), backend="fa2")
                fargs = (qo_indptr, indptr, indices, last, 32, 8, 128, 16)
                fw.plan(*fargs, causal=True, q_data_type=torch.bfloat16)
                fw.run(q, (k, v), out=out)
                res["flashinfer_plan"] = per_call_us(lambda: fw.plan(*fargs, causal=True, q_data_type=torch.bfloat16),
                                                     50, args.rounds)
                fw.plan(*fargs, causal=True, q_data_type=torch.bfloat16)
                res["flashinfer_run"] = per_call_us(lambda: fw.run(q, (k, v), out=out), 20, args.rounds, sync)
            except Exception as exc:  # noqa: BLE001 - the peer is optional
                res["flashinfer"] = f"skipped: {type(exc).__name__}: {exc}"[:300]
    out_path = Path(args.out or os.path.join(os.environ.get("OUT", "bench_results"), "bench_prefill_host.json"))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1))
    for key, val in res.items():
        if isinstance(val, dict) and "median_us" in val:
            print(f"{key:24s} {val['median_us']:8.2f} us (min {val['min_us']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""head_dim 512: batch decode and batch prefill (paged, fp16/bf16), ours against FlashInfer's
FA2 (CUDA-core decode, use_tensor_cores=False and True; FA2 prefill) where `import flashinfer`
works (e.g. PYTHONPATH=.peers/site). Device time by CUDA events (bench_common.time_cuda), the
median of --reps runs, inputs large enough to leave L2. Each FlashInfer column is built on
first use; a column whose build or run fails is reported as skipped. Writes JSON to --out
(default $OUT/bench_hd512.json).

    python3 scripts/bench_hd512.py [--reps 30] [--time-limit 200]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from bench_common import default_out, finish, log, no_gpu, run_metadata, table, time_cuda

PAGE = 16
# (label, batch, kv_len, num_qo_heads, num_kv_heads)
DECODE_ROWS = [("decode b=1 kv=16k", 1, 16384, 16, 16), ("decode b=16 kv=4k", 16, 4096, 16, 16),
               ("decode b=64 kv=2k GQA-4", 64, 2048, 32, 8)]
# (label, batch, qo_len, kv_len, causal)
PREFILL_ROWS = [("prefill causal 1x4k", 1, 4096, 4096, True), ("prefill full 4x1k", 4, 1024, 1024, False),
                ("prefill causal 16x512", 16, 512, 512, True)]
HEADS_PREFILL = (16, 4)


def paged(batch: int, kv_len: int, hk: int, dtype, torch):
    pages = -(-kv_len // PAGE)
    n = batch * pages
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    ids = torch.randperm(n, dtype=torch.int32)
    last = torch.full((batch,), kv_len - (pages - 1) * PAGE, dtype=torch.int32)
    k = torch.randn(n, PAGE, hk, 512, dtype=dtype, device="cuda")
    v = torch.randn(n, PAGE, hk, 512, dtype=dtype, device="cuda")
    return indptr, ids, last, (k, v)


def decode_row(mod, row, dtype, torch, reps, tensor_cores=False):
    _, batch, kv_len, hq, hk = row
    indptr, ids, last, cache = paged(batch, kv_len, hk, dtype, torch)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = mod.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    w.plan(indptr.cuda(), ids.cuda(), last.cuda(), hq, hk, 512, PAGE, q_data_type=dtype, kv_data_type=dtype)
    q = torch.randn(batch, hq, 512, dtype=dtype, device="cuda")
    out = w.run(q, cache)
    r = time_cuda(lambda i: w.run(q, cache), reps=reps)
    r["bytes"] = 2 * batch * kv_len * hk * 512 * dtype.itemsize
    return r, out


def prefill_row(mod, row, dtype, torch, reps):
    _, batch, qo_len, kv_len, causal = row
    hq, hk = HEADS_PREFILL
    indptr, ids, last, cache = paged(batch, kv_len, hk, dtype, torch)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    kwargs = {"backend": "fa2"} if mod.__name__ == "flashinfer" else {}
    w = mod.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **kwargs)
    qo = torch.arange(batch + 1, dtype=torch.int32) * qo_len
    w.plan(qo.cuda(), indptr.cuda(), ids.cuda(), last.cuda(), hq, hk, 512, PAGE, causal=causal, q_data_type=dtype,
           kv_data_type=dtype)
    q = torch.randn(batch * qo_len, hq, 512, dtype=dtype, device="cuda")
    out = w.run(q, cache)
    r = time_cuda(lambda i: w.run(q, cache), reps=reps)
    flops = 4 * batch * qo_len * kv_len * hq * 512 * (0.5 if causal else 1.0)
    r["tflops"] = flops / (r["median_us"] * 1e-6) / 1e12
    return r, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--time-limit", type=float, default=200.0, help="seconds; rows left are skipped")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if no_gpu("bench_hd512"):
        return 2
    import torch

    import flashinfer_jit as ours
    try:
        import flashinfer as theirs
    except Exception as e:  # noqa: BLE001
        log(f"flashinfer not importable ({e}); ours only")
        theirs = None
    started = time.perf_counter()
    res = {"meta": run_metadata(), "rows": {}}
    lines = []
    jobs = [("decode", r) for r in DECODE_ROWS] + [("prefill", r) for r in PREFILL_ROWS]
    for dtype in (torch.float16, torch.bfloat16):
        for kind, row in jobs:
            label = f"{row[0]} {str(dtype)[6:]}"
            if time.perf_counter() - started > args.time_limit:
                res["rows"][label] = "skipped: time limit"
                continue
            entry = {}
            fn = decode_row if kind == "decode" else prefill_row
            torch.manual_seed(0)
            mine, out = fn(ours, row, dtype, torch, args.reps)
            entry["ours"] = mine
            peers = [("fa2", {})] if kind == "prefill" else [("fi_cuda_cores", {}), ("fi_tensor_cores",
                                                                                   {"tensor_cores": True})]
            for name, kw in peers if theirs is not None else []:
                if time.perf_counter() - started > args.time_limit:
                    entry[name] = "skipped: time limit"
                    continue
                try:
                    torch.manual_seed(0)
                    r, ref = fn(theirs, row, dtype, torch, args.reps, **kw)
                    r["max_abs_diff"] = float((ref.float() - out.float()).abs().max())
                    entry[name] = r
                except Exception as e:  # noqa: BLE001
                    entry[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            res["rows"][label] = entry
            cells = [label, f"{mine['median_us']:.1f}"]
            for name in ("fa2", "fi_cuda_cores", "fi_tensor_cores"):
                v = entry.get(name)
                cells.append(f"{v['median_us']:.1f} ({v['median_us'] / mine['median_us']:.2f}x)" if isinstance(v, dict)
                             else ("" if v is None else v[:40]))
            lines.append(cells)
            log(" | ".join(cells))
    report = table(lines, ["row", "ours us", "FA2 prefill", "FI decode CUDA cores", "FI decode tensor cores"])
    return finish(args.out or default_out("bench_hd512.json"), res, lambda r: report, started)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""FP8 attention on Hopper: the ragged wrapper with q, K and V in e4m3 (the Hopper kernel's fp8
form, docs/hopper.md) against the same wrapper in bf16 on the same values (e4m3 values are
exact in bf16), and FlashInfer's FA3 backend in bf16 where FlashInfer is importable
(PYTHONPATH=.peers/site). Issue 64's head_dim-128 rows, ragged, 32 query / 8 KV heads; the bf16
matmul and the e4m3 matmul (torch._scaled_mm) as ceilings in the same run.

  python3 scripts/bench_fp8_attention.py [--reps N] [--only 'causal 1x16k;full 4x4k'] [--out FILE]

Each row's providers are timed interleaved (bench_prefill.time_interleaved: CUDA events around
each eager run(), an L2 flush before it, the median); the fp8 output is compared with the bf16
one (max |a - b| / max |b|: P rounded to e4m3 makes a few percent).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
from bench_prefill import Flush, attention_flops, matmul_rate, time_interleaved  # noqa: E402

HEADS, HEAD_DIM = (32, 8), 128
SCALES = (0.7, 1.3, 0.9)  # q, k, v
# (label, batch, length (qo = kv), causal)
ROWS = [("causal 1x16k", 1, 16384, True), ("causal 4x4k", 4, 4096, True), ("full 4x4k", 4, 4096, False),
        ("causal 16x1k", 16, 1024, True), ("full 16x1k", 16, 1024, False), ("causal 64x256", 64, 256, True),
        ("full 64x256", 64, 256, False)]
WORKSPACE_BYTES = 256 << 20


def fp8_matmul_rate(n: int = 8192, reps: int = 30) -> dict | None:
    """e4m3 x e4m3 -> bf16 torch._scaled_mm n x n x n (per-tensor scales), or None where torch
    has none."""
    import torch

    mm = getattr(torch, "_scaled_mm", None)
    if mm is None:
        return None
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # (column-major B)
    one = torch.ones((), device="cuda")
    try:
        t = bc.time_cuda(lambda _: mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 1, warmup=5,
                         reps=reps)
    except RuntimeError as exc:
        return {"error": str(exc)[:300]}
    return {"n": n, "median_us": t["median_us"], "tflops": 2 * n ** 3 / t["median_us"] / 1e6}


def measure_row(label: str, batch: int, length: int, causal: bool, reps: int, flush, fi) -> dict:
    import torch

    import flashinfer_jit as fij

    hq, hk = HEADS
    tokens = batch * length
    g = torch.Generator(device="cuda").manual_seed(length + batch)
    q = (torch.randn(tokens, hq, HEAD_DIM, device="cuda", generator=g) * 2.0 / SCALES[0]).to(torch.float8_e4m3fn)
    k = (torch.randn(tokens, hk, HEAD_DIM, device="cuda", generator=g) / SCALES[1]).to(torch.float8_e4m3fn)
    v = (torch.randn(tokens, hk, HEAD_DIM, device="cuda", generator=g) / SCALES[2]).to(torch.float8_e4m3fn)
    q16, k16, v16 = (x.to(torch.bfloat16) for x in (q, k, v))
    indptr = torch.arange(0, tokens + 1, length, dtype=torch.int32)
    scales = dict(q_scale=SCALES[0], k_scale=SCALES[1], v_scale=SCALES[2])
    outs, fns, names = {}, [], []

    def ours(fp8: bool):
        w = fij.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"),
                                                     "NHD", backend="fa3")
        dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
        w.plan(indptr, indptr, hq, hk, HEAD_DIM, causal=causal, q_data_type=dt, kv_data_type=dt,
               o_data_type=torch.bfloat16)
        out = torch.full((tokens, hq, HEAD_DIM), float("nan"), dtype=torch.bfloat16, device="cuda")
        args = (q, k, v) if fp8 else (q16, k16, v16)
        return (lambda: w.run(*args, out=out, **scales)), out

    for name, make in (("ours_fp8", lambda: ours(True)), ("ours_bf16", lambda: ours(False))):
        fn, out = make()
        fn()
        outs[name] = out
        fns.append(fn)
        names.append(name)
    if fi is not None:  # FlashInfer's FA3 in bf16, the scales folded as its ragged run() has none
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"),
                                                    "NHD", backend="fa3")
        w.plan(indptr.cuda(), indptr.cuda(), hq, hk, HEAD_DIM, causal=causal, q_data_type=torch.bfloat16,
               sm_scale=SCALES[0] * SCALES[1] / HEAD_DIM ** 0.5)
        fi_out = torch.empty((tokens, hq, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
        fns.append(lambda: w.run(q16, k16, v16, out=fi_out))
        names.append("fa3_bf16")
    torch.cuda.synchronize()
    timings = time_interleaved(fns, reps, flush)
    flops = attention_flops(batch, length, length, causal, hq, HEAD_DIM)
    res = {"label": f"hd128 {label} ragged", "batch": batch, "length": length, "causal": causal, "flops": flops}
    for name, t in zip(names, timings):
        if "error" in t:
            res[name] = t
            continue
        t.pop("_samples", None)
        res[name] = {"median_us": t["median_us"], "tflops": flops / t["median_us"] / 1e6, "timing": t}
    a, b = outs["ours_fp8"].double(), outs["ours_bf16"].double()
    res["fp8_vs_bf16_rel_err"] = float((a - b).abs().max() / b.abs().max())
    res["fp8_wrote_every_row"] = not bool(torch.isnan(a).any())
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default="", help="';'-separated parts of the row labels to run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if bc.no_gpu("bench_fp8_attention"):
        return 2
    import torch

    try:
        import flashinfer as fi  # noqa: PLC0415  (the peer, from PYTHONPATH=.peers/site)
    except ImportError:
        fi = None
    started = time.perf_counter()
    only = [s.strip() for s in args.only.split(";") if s.strip()]
    rows = [r for r in ROWS if not only or any(s in r[0] for s in only)]
    res = {"benchmark": "bench_fp8_attention", "meta": bc.run_metadata(), "heads": HEADS, "head_dim": HEAD_DIM,
           "scales": SCALES, "flashinfer": getattr(fi, "__version__", None), "rows": []}
    res["matmul_bf16"] = matmul_rate()
    res["matmul_e4m3"] = fp8_matmul_rate()
    flush = Flush()
    for label, batch, length, causal in rows:
        res["rows"].append(measure_row(label, batch, length, causal, args.reps, flush, fi))
        torch.cuda.empty_cache()

    def report(r: dict) -> str:
        lines = [f"bf16 matmul {r['matmul_bf16']['tflops']:.0f} TFLOP/s; e4m3 matmul "
                 f"{(r['matmul_e4m3'] or {}).get('tflops', float('nan')):.0f}"]
        rows_ = []
        for row in r["rows"]:
            cells = [row["label"]]
            for name in ("ours_fp8", "ours_bf16", "fa3_bf16"):
                e = row.get(name)
                cells.append(f"{e['tflops']:.0f} ({e['median_us']:.0f} us)" if e and "tflops" in e else "-")
            f8, b16 = row.get("ours_fp8", {}), row.get("ours_bf16", {})
            cells.append(f"{b16['median_us'] / f8['median_us']:.2f}" if "median_us" in f8 and "median_us" in b16
                         else "-")
            cells.append(f"{row['fp8_vs_bf16_rel_err']:.3f}")
            rows_.append(cells)
        lines.append(bc.table(rows_, ["row", "ours fp8", "ours bf16", "FA3 bf16", "fp8 speedup", "fp8 vs bf16 err"]))
        return "\n".join(lines)

    return bc.finish(args.out or bc.default_out("bench_fp8_attention.json"), res, report, started)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Batch prefill with each option the Hopper path takes or lacks: what `backend="auto"`'s
rules for them rest on (docs/hopper.md, "Using it").

For each option and batch (bf16, 32 query / 8 KV heads, head_dim 128 unless the option is a
head_dim), in one process, providers interleaved in every round, L2 flushed before each run,
CUDA events, the median of --reps runs:
  fa2        the mma.sync kernel with the option (backend="fa2");
  fa3        the Hopper kernel with it (backend="fa3"), or the ValueError's reason where it
             does not take it;
  fa3_plain  the Hopper kernel on the same batch without the option: the option's cost on the
             Hopper path, or the best it could do where it lacks the option;
  prepass    where a separate launch stands in for the option before the Hopper kernel:
             RoPE (q and k rotated by flashinfer_jit.apply_rope, ragged), an fp8 cache (the
             pages dequantized to bf16 first, paged). Timed with the pre-pass included.
Options: none, logits_soft_cap, window_left, a custom mask (the causal pattern as bits, so
fa3_plain is the causal kernel), run(sinks=), RoPE (ROPE_LLAMA), ALiBi, an fp8 e4m3 cache
(paged, pages of 16), head_dim (192, 128). Batches: causal 4 x 4k and 16 x 1k (ragged; the
fp8 rows paged). Outputs of fa3 and the pre-pass are checked against fa2's.

  python3 scripts/bench_prefill_features.py [--only 'rope;fp8'] [--reps N] [--out FILE] [--list]
JSON: meta, rows (option, batch, form, flops, impls {name: median_us, tflops, or skipped}).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (also puts the repository on sys.path)

HQ, HK = 32, 8
BATCHES = {"causal 4x4k": (4, 4096), "causal 16x1k": (16, 1024)}
OPTIONS = ("none", "soft_cap", "window", "custom_mask", "sinks", "rope", "alibi", "fp8_kv", "hd192x128")
PAGE = 16
DEV = "cuda"  # (tests plan on the CPU)


def rows(only: list[str] | None) -> list[tuple[str, str]]:
    out = [(o, b) for o in OPTIONS for b in BATCHES]
    return [r for r in out if not only or any(s in f"{r[0]} {r[1]}" for s in only)]


def causal_flops(batch: int, seq: int, dqk: int, dvo: int, window: int = -1) -> float:
    """Q K^T and P V of the keys each causal row sees (within the window, if any)."""
    pairs = sum(min(i + 1, window + 1) if window >= 0 else i + 1 for i in range(seq)) * batch
    return 2.0 * pairs * HQ * (dqk + dvo)


def make_plans(option: str, batch_label: str, ws) -> tuple[dict, dict, dict]:
    """The row's planned wrappers {provider: wrapper} (fa2, fa3, fa3_plain, and prepass's),
    the providers skipped {provider: reason}, and run()'s keyword arguments {provider: ...}."""
    import torch

    import flashinfer_jit as fij

    batch, seq = BATCHES[batch_label]
    dqk, dvo = (192, 128) if option == "hd192x128" else (128, 128)
    dev, bf16 = DEV, torch.bfloat16
    qo = torch.arange(batch + 1, dtype=torch.int32) * seq
    plan_kw = dict(causal=True, q_data_type=bf16)
    plain_kw = dict(causal=True, q_data_type=bf16)
    sinks = {}
    if option == "soft_cap":
        plan_kw["logits_soft_cap"] = 30.0
    elif option == "window":
        plan_kw["window_left"] = 1024
    elif option == "custom_mask":  # the causal pattern, so that fa3_plain (causal) does the same work
        tri = torch.ones(seq, seq, dtype=torch.bool, device=dev).tril()
        plan_kw = dict(custom_mask=tri.reshape(-1).repeat(batch), q_data_type=bf16)
    elif option == "sinks":
        sinks = {"sinks": torch.randn(HQ, dtype=torch.float32, device=dev)}
    elif option in ("rope", "alibi"):
        plan_kw["pos_encoding_mode"] = "ROPE_LLAMA" if option == "rope" else "ALIBI"
    wrappers, skipped, run_kw = {}, {}, {}
    if option == "fp8_kv":
        pages = batch * seq // PAGE
        ids = torch.randperm(pages, generator=torch.Generator().manual_seed(3)).int().to(dev)
        kv_ip = torch.arange(batch + 1, dtype=torch.int32) * (seq // PAGE)
        last = torch.full((batch,), PAGE, dtype=torch.int32)
        todo = (("fa2", "fa2", torch.float8_e4m3fn), ("fa3", "fa3", torch.float8_e4m3fn),
                ("fa3_plain", "fa3", bf16), ("prepass", "fa3", bf16))
        for name, backend, kv_dtype in todo:
            try:
                w = fij.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
                w.plan(qo, kv_ip, ids, last, HQ, HK, dqk, PAGE, causal=True, q_data_type=bf16, kv_data_type=kv_dtype)
                wrappers[name] = w
            except ValueError as exc:
                skipped[name] = str(exc)[:300]
        return wrappers, skipped, run_kw
    todo = [("fa2", "fa2", plan_kw, sinks), ("fa3", "fa3", plan_kw, sinks), ("fa3_plain", "fa3", plain_kw, {})]
    if option == "rope":
        todo.append(("prepass", "fa3", plain_kw, {}))
    for name, backend, kw, rk in todo:
        try:
            w = fij.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
            w.plan(qo, qo, HQ, HK, dqk, head_dim_vo=dvo, **kw)
            wrappers[name], run_kw[name] = w, rk
        except ValueError as exc:
            skipped[name] = str(exc)[:300]
    return wrappers, skipped, run_kw


def prebuild(todo: list[tuple[str, str]], ws) -> dict:
    """Every module the rows' plans run, built in parallel (one ninja run) before any timing:
    a plan's spec, and the sinks module of the mma.sync kernel's sinks row."""
    from flashinfer_jit.pipeline.jit import build_many

    specs = []
    for option, batch in todo:
        wrappers, _, _ = make_plans(option, batch, ws)
        for name, w in wrappers.items():
            plan = w._plan
            specs.append(plan.spec)
            if option == "sinks" and name == "fa2":
                specs.append(w._spec(plan.config, plan.layout, True))
    started = time.perf_counter()
    report = build_many(specs, jobs=16)
    return {"modules": len(specs), "seconds": time.perf_counter() - started, "report": str(report)[:400]}


def measure(option: str, batch_label: str, reps: int, ws, flush) -> dict:
    import torch

    import flashinfer_jit as fij

    batch, seq = BATCHES[batch_label]
    dqk, dvo = (192, 128) if option == "hd192x128" else (128, 128)
    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(11)
    n = batch * seq
    q = torch.randn(n, HQ, dqk, dtype=bf16, device=dev, generator=g)
    k = torch.randn(n, HK, dqk, dtype=bf16, device=dev, generator=g)
    v = torch.randn(n, HK, dvo, dtype=bf16, device=dev, generator=g)
    window = 1024 if option == "window" else -1
    res = {"option": option, "batch": batch_label, "form": "paged" if option == "fp8_kv" else "ragged",
           "flops": causal_flops(batch, seq, dqk, dvo, window), "impls": {}}
    wrappers, skipped, run_kw = make_plans(option, batch_label, ws)
    res["impls"].update({name: {"skipped": why} for name, why in skipped.items()})
    calls, outs = {}, {}
    if option == "fp8_kv":
        pages = n // PAGE
        k8 = (k.view(pages, PAGE, HK, dqk) * 0.5).to(torch.float8_e4m3fn)
        v8 = (v.view(pages, PAGE, HK, dvo) * 0.5).to(torch.float8_e4m3fn)
        cache_bf = (k8.to(bf16), v8.to(bf16))
        for name, w in wrappers.items():
            if name == "prepass":  # the pages dequantized to bf16, then the Hopper kernel
                calls[name] = (lambda w=w: w.run(q, (k8.to(bf16), v8.to(bf16))))
            else:
                cache = cache_bf if name == "fa3_plain" else (k8, v8)
                calls[name] = (lambda w=w, cache=cache: w.run(q, cache))
    else:
        qo_dev = (torch.arange(batch + 1, dtype=torch.int32) * seq).to(dev)
        offsets = torch.zeros(batch, dtype=torch.int32, device=dev)
        for name, w in wrappers.items():
            if name == "prepass":  # q and k rotated (ROPE_LLAMA's positions: qo_len == kv_len here), then fa3
                calls[name] = (lambda w=w: w.run(*fij.apply_rope(q, k, qo_dev, offsets), v))
            else:
                calls[name] = (lambda w=w, rk=run_kw[name]: w.run(q, k, v, **rk))
    for fn in calls.values():  # warm-up (builds, first launches)
        fn()
    torch.cuda.synchronize()
    for name, fn in calls.items():
        outs[name] = fn().float()
    if "fa2" in outs:
        for name, out in outs.items():
            if name not in ("fa2", "fa3_plain"):
                res["impls"].setdefault(name, {})["max_abs_diff_vs_fa2"] = float((out - outs["fa2"]).abs().max())
    times = {name: [] for name in calls}
    warm_until = time.perf_counter() + bc.warmup_ms() / 1e3  # (bench_common's warm-up, all providers)
    while time.perf_counter() < warm_until:
        for fn in calls.values():
            fn()
        torch.cuda.synchronize()
    for _ in range(reps):
        for name, fn in calls.items():
            flush.zero_()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times[name].append(e0.elapsed_time(e1) * 1e3)
    for name, ts in times.items():
        s = bc.summarize(ts)
        res["impls"].setdefault(name, {}).update(median_us=s["median_us"], p10_us=s["p10_us"], p90_us=s["p90_us"],
                                                 tflops=res["flops"] / s["median_us"] / 1e6)
    return res


def report(res: dict) -> str:
    names = ("fa2", "fa3", "fa3_plain", "prepass")
    out = []
    for r in res["rows"]:
        im = r["impls"]
        us = {n: im.get(n, {}).get("median_us") for n in names}
        speed = us["fa2"] / us["fa3"] if us["fa2"] and us["fa3"] else None
        out.append([r["option"], r["batch"], r["form"], *[us[n] for n in names], speed,
                    *[im.get(n, {}).get("tflops") for n in ("fa2", "fa3")]])
    return bc.table(out, ["option", "batch", "form", "fa2 us", "fa3 us", "fa3 plain us", "prepass us", "fa2/fa3",
                          "fa2 TF/s", "fa3 TF/s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="';'-separated substrings of 'option batch' (e.g. 'rope;fp8')")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--list", action="store_true", help="print the rows, then exit (no GPU needed)")
    args = ap.parse_args()
    only = [s for s in args.only.split(";") if s] if args.only else None
    todo = rows(only)
    if args.list:
        for option, batch in todo:
            print(f"{option:12s} {batch}")
        return 0
    if bc.no_gpu("bench_prefill_features"):
        return 2
    import torch

    started = time.perf_counter()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    flush = torch.empty(max(256 << 20, 4 * bc.l2_bytes()), dtype=torch.uint8, device="cuda")
    res = {"benchmark": "bench_prefill_features", "meta": bc.run_metadata(), "rows": [], "errors": []}
    try:
        res["build"] = prebuild(todo, ws)
        bc.log(f"prebuilt: {res['build']}")
    except Exception as exc:  # noqa: BLE001  (the rows then build what they need themselves)
        res["build"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    for option, batch in todo:
        try:
            res["rows"].append(measure(option, batch, args.reps, ws, flush))
            bc.log(f"{option} {batch}: {res['rows'][-1]['impls']}")
        except Exception as exc:  # noqa: BLE001  (one row's failure is recorded, the rest run)
            res["errors"].append({"row": f"{option} {batch}", "error": f"{type(exc).__name__}: {exc}"[:500]})
            bc.log(f"{option} {batch}: {type(exc).__name__}: {exc}")
    return bc.finish(args.out or bc.default_out("bench_prefill_features.json"), res, report, started)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""POD's schedule, swept: the prefill side's tile (64 or 128 rows) and the decode share of each
SM's blocks (csrc/pod/pod.cuh launch_pod), on the mixes of scripts/bench_pod.py, against each
side alone (with each tile, and the decode as POD plans it: no KV-head pairs or clusters) and
the two launches in turn. What flashinfer_jit/pod/wrapper.py's schedule (tile, decode share,
decode SMs) is calibrated from (docs/pod.md).

Per row, interleaved (bench_prefill.time_interleaved: CUDA events on eager calls, L2 flushed
before each, median of --reps): serial (our prefill, planner's tile, then the tensor-core
decode), prefill_t64 / prefill_t128 / prefill_auto, decode_only, decode_pod (the POD side's
plan, its own kernel), and pod_t{tile}_s{share}_k{sms} for each of VARIANTS: every SM with a
share of decode blocks (k0), or k SMs decode-only and the others prefill-only while both
sides have work. Every POD's outputs are checked against serial's (max abs diff < 2e-2).

  python3 scripts/sweep_pod.py [--rows 'p2x2k;4k@4k'] [--reps 30] [--variants 128:0.5:0,...] [--no-streams] [--out F]
JSON (default $OUT/sweep_pod.json): meta, rows (per row: impls with median_us ..., checks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
import bench_pod as bpod  # noqa: E402
import bench_prefill as bp  # noqa: E402

# (tile, decode share of an SM's blocks, decode SMs: 0 = every SM); share 1.0 with K SMs: K SMs
# run only decodes and the others only prefill tiles, while both have work
VARIANTS = [(64, 0.5, 0), (64, 0.75, 0), (64, 1.0, 44), (64, 1.0, 66),
            (128, 0.5, 0), (128, 1.0, 33), (128, 1.0, 44), (128, 1.0, 55), (128, 1.0, 66), (128, 1.0, 88)]


def providers(row, x, variants=VARIANTS, streams=True):
    import torch

    import flashinfer_jit as fij

    d, bf16 = row.head_dim, torch.bfloat16
    heads = (bpod.NUM_QO_HEADS, bpod.NUM_KV_HEADS, d, bpod.PAGE_SIZE)

    def ws():
        return torch.empty(bpod.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")

    out = {}

    def prefill(tile):
        pw = fij.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD")
        pw._force_tile_rows = tile
        pw.plan(x.qo_indptr_p, x.kv_indptr_p, x.indices_p, x.last_p, *heads, causal=True, q_data_type=bf16,
                kv_data_type=x.kv_dtype)
        return lambda: pw.run(x.q_p, x.cache_p)

    def decode(pod_side):
        dw = fij.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True)
        dw._pod_side = pod_side
        dw.plan(x.kv_indptr_d, x.indices_d, x.last_d, *heads, q_data_type=bf16, kv_data_type=x.kv_dtype)
        return lambda: dw.run(x.q_d, x.cache_d)

    pre, dec = prefill(None), decode(False)
    out["serial"] = lambda: (pre(), dec())
    out["prefill_auto"] = pre
    for tile in (64, 128) if d <= 128 else (64,):
        out[f"prefill_t{tile}"] = prefill(tile)
    out["decode_only"] = dec
    out["decode_pod"] = decode(True)
    for tile, share, sms in variants:
        if tile == 128 and d > 128:
            continue
        w = fij.BatchPODWithPagedKVCacheWrapper(ws(), kv_layout="NHD")
        w.tile_rows, w.force_decode_share, w.force_decode_sms = tile, share, sms
        w.plan(x.qo_indptr_p, x.kv_indptr_p, x.indices_p, x.last_p, x.qo_indptr_d, x.kv_indptr_d, x.indices_d,
               x.last_d, *heads, q_data_type=bf16, kv_data_type=x.kv_dtype, causal=True)
        out[f"pod_t{tile}_s{share:g}_k{sms}"] = (lambda w=w: w.run(x.q_p, x.cache_p, x.q_d, x.cache_d, causal_p=True))
    # the two families' kernels on two streams at once: the prefill's grid pinned to g blocks (one
    # or two an SM: what room its 128-row tile leaves for decode blocks beside it)
    side = torch.cuda.Stream()
    for g in (132, 264) if streams else ():
        for pod_side in (False, True):
            pw = fij.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD")
            pw._force_tile_rows = 128 if d <= 128 else 64
            pw.plan(x.qo_indptr_p, x.kv_indptr_p, x.indices_p, x.last_p, *heads, causal=True, q_data_type=bf16,
                    kv_data_type=x.kv_dtype)
            pw._plan.grid = min(pw._plan.grid, g)
            dd = decode(pod_side)

            def streams(pw=pw, dd=dd):
                cur = torch.cuda.current_stream()
                side.wait_stream(cur)
                a = pw.run(x.q_p, x.cache_p)
                with torch.cuda.stream(side):
                    b = dd()
                cur.wait_stream(side)
                return a, b
            out[f"streams_g{g}{'_podside' if pod_side else ''}"] = streams
    # the default choice (the wrapper's tile and decode_share())
    w = fij.BatchPODWithPagedKVCacheWrapper(ws(), kv_layout="NHD")
    w.plan(x.qo_indptr_p, x.kv_indptr_p, x.indices_p, x.last_p, x.qo_indptr_d, x.kv_indptr_d, x.indices_d,
           x.last_d, *heads, q_data_type=bf16, kv_data_type=x.kv_dtype, causal=True)
    out["pod_default"] = lambda: w.run(x.q_p, x.cache_p, x.q_d, x.cache_d, causal_p=True)
    out["pod_default"].share = w._schedule()
    return out


def sweep_row(row, reps: int, flush, seed: int, variants=VARIANTS, streams=True) -> dict:
    import torch

    x = bpod.Inputs(row, seed)
    fns = providers(row, x, variants, streams)
    res = {"label": row.label, "row": row._asdict(), "impls": {}, "checks": {},
           "default_share": getattr(fns["pod_default"], "share", None)}
    ref = fns["serial"]()
    torch.cuda.synchronize()
    ref = tuple(t.clone() for t in ref)
    for name, fn in fns.items():
        if name.startswith("pod"):
            got = fn()
            torch.cuda.synchronize()
            res["checks"][name] = bpod.compare(got, ref)
    names = list(fns)
    for name, t in zip(names, bp.time_interleaved([fns[n] for n in names], reps, flush)):
        t.pop("_samples", None)
        res["impls"][name] = t
    us = {k: v.get("median_us") for k, v in res["impls"].items()}
    pods = {k: v for k, v in us.items() if k.startswith("pod_t") and v}
    best = min(pods, key=pods.get) if pods else None
    res["best"] = best
    if best and us.get("serial"):
        res["serial_over_best"] = us["serial"] / pods[best]
        ideal = max(us["prefill_auto"], us["decode_only"])
        res["ideal_over_best"] = ideal / pods[best]
    del x, fns
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="", help="';'-separated substrings of bench_pod's row labels")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="", help="POD schedules to time, e.g. '128:0.5:0,128:1:66' "
                    "(tile:decode share:decode SMs; default: all of VARIANTS)")
    ap.add_argument("--no-streams", action="store_true", help="leave out the two-stream probe")
    args = ap.parse_args(argv)
    variants = [(int(t), float(s), int(k)) for t, s, k in (v.split(":") for v in args.variants.split(",") if v)]
    variants = variants or VARIANTS
    only = tuple(s for s in args.rows.split(";") if s)
    rows = bpod.row_list(False, only)
    if bc.no_gpu("sweep_pod", " (run it on the GPU machine)"):
        return 2
    res = {"benchmark": "sweep_pod", "meta": bc.run_metadata(), "reps": args.reps, "rows": []}
    flush = bp.Flush()
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "sweep_pod.json")
    for row in rows:
        t0 = time.perf_counter()
        try:
            r = sweep_row(row, args.reps, flush, args.seed, variants, not args.no_streams)
        except Exception as exc:  # noqa: BLE001  (one row's failure must not end the sweep)
            r = {"label": row.label, "error": f"{type(exc).__name__}: {exc}"[:1500]}
        res["rows"].append(r)
        out.write_text(json.dumps(res, indent=1))
        us = {k: round(v.get("median_us") or 0, 1) for k, v in r.get("impls", {}).items()}
        bad = [k for k, c in r.get("checks", {}).items() if not c.get("agrees")]
        bc.log(f"{row.label} ({time.perf_counter() - t0:.0f} s): best {r.get('best')} "
               f"serial/best {r.get('serial_over_best', 0):.3f} ideal/best {r.get('ideal_over_best', 0):.3f} "
               f"default share {r.get('default_share')} {us} {'MISMATCH ' + str(bad) if bad else ''}"
               f"{r.get('error', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

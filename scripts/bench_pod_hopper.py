#!/usr/bin/env python3
"""Benchmark POD on Hopper (csrc/pod/pod_sm90.cuh: the Hopper prefill kernel's blocks and the
tensor-core decode blocks in one launch, prefill_backend="auto") on issue 62's mixes, against
the same work as two launches and each half alone, and the mma.sync POD.

Rows: bench_pod.py's mixes 1-6 (bf16, 32 query / 8 KV heads, head_dim 128, page 16, causal
prefill chunks on the cache the decodes read, every page id from a random permutation; the
same inputs, bench_pod.Inputs). Per row, on the same tensors, timed interleaved
(bench_prefill.time_interleaved: CUDA events around each eager call, an L2 flush before it,
warm-up, median of --reps):
  pod_hopper          BatchPODWithPagedKVCacheWrapper, prefill_backend="auto" (the planner's split)
  pod_hopper_P<n>     the same with the split pinned: n blocks start on prefill items (--blocks)
  pod_hopper_S<t>[_P<n>]  the decode side split into chunks of t tokens (its fixed_split_size;
                      S0: the decode planner's own choice), and the split pinned (--variants)
  single_hopper       PODWithPagedKVCacheWrapper, prefill_backend="auto": the single form, the
                      prefill request's K/V as rows (bpod.Inputs' copies; rows with one prefill)
  ba_hopper           BatchAttention, prefill_backend="auto": the row as one batch, decodes first
  serial              our prefill (backend "auto": the Hopper kernel here) then our decode
  serial_fa2          our mma.sync prefill then our decode
  pod_fa2             the mma.sync POD (prefill_backend="fa2", the wrappers' default)
  prefill_only, decode_only: each half alone (the Hopper prefill)
Derived: serial / pod_hopper, serial_fa2 / pod_hopper, ideal / pod_hopper with ideal =
max(prefill_only, decode_only), and the best pinned split. Every output is checked against
serial's (max abs difference below 2e-2).

  python3 scripts/bench_pod_hopper.py [--reps 20] [--blocks 44,66,88] [--rows 1,3] [--out F]
  python3 scripts/bench_pod_hopper.py --list
JSON (--out, default $OUT/bench_pod_hopper.json): meta, rows (per row impls with the summary
and samples, speedup, check).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (also puts the repository on sys.path)
import bench_pod as bpod  # noqa: E402  (the rows and their inputs)
import bench_prefill as bp  # noqa: E402  (flush, interleaved timing)

IMPLS = ("pod_hopper", "single_hopper", "ba_hopper", "serial", "serial_fa2", "pod_fa2", "prefill_only", "decode_only")
MAX_ABS_DIFF = 2e-2


def rows(only=()) -> list:
    """The mixes with decodes (1-6), or those whose numbers are in `only`."""
    mixes = [r for r in bpod.row_list(True) if r.decodes > 0]
    return [r for i, r in enumerate(mixes, 1) if not only or i in only]


def make(name: str, x, row):
    """A zero-argument call of implementation `name` on x (planned outside the timing),
    returning (prefill out, decode out)."""
    import torch

    import flashinfer_jit as fij

    heads, bf16 = (bpod.NUM_QO_HEADS, bpod.NUM_KV_HEADS, row.head_dim, bpod.PAGE_SIZE), torch.bfloat16

    def ws():
        return torch.empty(bpod.WORKSPACE_BYTES, dtype=torch.uint8, device=bpod.DEVICE)

    if name.startswith("pod"):
        w = fij.BatchPODWithPagedKVCacheWrapper(ws(), "NHD")
        w.prefill_backend = "fa2" if name == "pod_fa2" else "auto"
        for part in name.removeprefix("pod_hopper").split("_")[1:]:  # pinned: _P<prefill blocks>, _S<decode split>
            if part[0] == "P":
                w.force_prefill_blocks = int(part[1:])
            elif part[0] == "S":
                w.force_decode_split = int(part[1:])
        w.plan(x.qo_indptr_p, x.kv_indptr_p, x.indices_p, x.last_p, x.qo_indptr_d, x.kv_indptr_d, x.indices_d,
               x.last_d, *heads, q_data_type=bf16, kv_data_type=bf16, causal=True)
        if name != "pod_fa2" and w._prefill.planned_backend != "fa3":
            raise RuntimeError(f"{name}: the prefill side planned {w._prefill.planned_backend}, not the Hopper kernel")
        return lambda: w.run(x.q_p, x.cache_p, x.q_d, x.cache_d, causal_p=True)
    if name == "single_hopper":  # the single form (one prefill request's K/V rows, bpod.Inputs' copies)
        if not row.single:
            raise RuntimeError("single_hopper: the row has more than one prefill request")
        w = fij.PODWithPagedKVCacheWrapper(ws(), "NHD")
        w.prefill_backend = "auto"
        w.plan(x.kv_indptr_d, x.indices_d, x.last_d, *heads, q_data_type=bf16, kv_data_type=bf16)
        w.run(x.q_p, x.k_p, x.v_p, x.q_d, x.cache_d, causal_p=True)  # (plans the prefill side: outside the timing)
        if w._prefill.planned_backend != "fa3":
            raise RuntimeError(f"{name}: the prefill side planned {w._prefill.planned_backend}, not the Hopper kernel")
        return lambda: w.run(x.q_p, x.k_p, x.v_p, x.q_d, x.cache_d, causal_p=True)
    if name == "ba_hopper":
        b = bpod.make_batch(x, row, interleaved=False)
        w = fij.BatchAttention(kv_layout="NHD", device=bpod.DEVICE)
        w.prefill_backend = "auto"
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len_arr, *heads[:3], row.head_dim, bpod.PAGE_SIZE,
               causal=True, q_data_type=bf16, kv_data_type=bf16)
        out = torch.empty(b.q.shape[0], bpod.NUM_QO_HEADS, row.head_dim, dtype=bf16, device=bpod.DEVICE)
        lse = torch.empty(b.q.shape[0], bpod.NUM_QO_HEADS, dtype=torch.float32, device=bpod.DEVICE)

        def run():
            w.run(b.q, x.cache_p, out=out, lse=lse)
            return out.index_select(0, b.rows_p), out.index_select(0, b.rows_d)
        run.timed = lambda: w.run(b.q, x.cache_p, out=out, lse=lse)
        return run
    pw = fij.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD", backend="fa2" if name == "serial_fa2" else "auto")
    pw.plan(x.qo_indptr_p, x.kv_indptr_p, x.indices_p, x.last_p, *heads, causal=True, q_data_type=bf16)
    dw = fij.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True)
    dw.plan(x.kv_indptr_d, x.indices_d, x.last_d, *heads, q_data_type=bf16)
    if name == "prefill_only":
        return lambda: (pw.run(x.q_p, x.cache_p), None)
    if name == "decode_only":
        return lambda: (None, dw.run(x.q_d, x.cache_d))
    return lambda: (pw.run(x.q_p, x.cache_p), dw.run(x.q_d, x.cache_d))


def measure(row, names: list, reps: int, flush) -> dict:
    import torch

    x = bpod.Inputs(row, 0)
    fns, built = [], {}
    res = {"label": row.label, "note": row.note, "impls": {}, "check": {}}
    for name in names:
        try:
            built[name] = make(name, x, row)
        except Exception as exc:  # noqa: BLE001  (one failing implementation must not end the row)
            res["impls"][name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
    live = list(built)
    ref = built["serial"]() if "serial" in built else None
    torch.cuda.synchronize()
    for name in live:  # outputs against serial's (same inputs), before any timing
        if ref is None or name in ("serial", "prefill_only", "decode_only"):
            continue
        got = built[name]()
        torch.cuda.synchronize()
        diff = max(float((g.float() - r.float()).abs().max()) for g, r in zip(got, ref) if g is not None)
        res["check"][name] = {"max_abs_diff": diff, "agrees": diff < MAX_ABS_DIFF}
    fns = [getattr(built[n], "timed", built[n]) for n in live]
    for name, t in zip(live, bp.time_interleaved(fns, reps, flush)):
        res["impls"][name] = {k: v for k, v in t.items()}
    us = {k: v.get("median_us") for k, v in res["impls"].items()}
    sp = {}
    if us.get("pod_hopper"):
        for other in ("serial", "serial_fa2", "pod_fa2"):
            if us.get(other):
                sp[f"{other}_over_pod_hopper"] = us[other] / us["pod_hopper"]
        if us.get("prefill_only") and us.get("decode_only"):
            sp["ideal_over_pod_hopper"] = max(us["prefill_only"], us["decode_only"]) / us["pod_hopper"]
    pinned = {k: v for k, v in us.items() if k.startswith("pod_hopper_") and v}
    if pinned:
        best = min(pinned, key=pinned.get)
        sp["best_pinned"] = best
        if us.get("serial"):
            sp["serial_over_best_pinned"] = us["serial"] / pinned[best]
    if us.get("ba_hopper") and us.get("serial"):
        sp["serial_over_ba_hopper"] = us["serial"] / us["ba_hopper"]
    res["speedup"] = sp
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--blocks", default="44,66,88", help="pinned splits (blocks that start on prefill), comma-separated")
    ap.add_argument("--rows", default="", help="mix numbers, comma-separated (default: 1-6)")
    ap.add_argument("--variants", default="", help="pinned variants, comma-separated: S<decode split tokens>, "
                    "P<prefill blocks> or both (S512_P44)")
    ap.add_argument("--impls", default=",".join(IMPLS), help="the unpinned implementations to time")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    only = tuple(int(v) for v in args.rows.split(",") if v)
    if args.list:
        for r in rows(only):
            print(r.label, "|", r.note)
        return 0
    import torch

    names = [n for n in args.impls.split(",") if n] + [f"pod_hopper_P{int(b)}" for b in args.blocks.split(",") if b]
    names += [f"pod_hopper_{v}" for v in args.variants.split(",") if v]
    flush = bp.Flush()
    result = {"benchmark": "pod_hopper", "meta": bc.run_metadata(), "impls": names, "rows": []}
    for row in rows(only):
        res = measure(row, names, args.reps, flush)
        result["rows"].append(res)
        us = {k: v.get("median_us") for k, v in res["impls"].items()}
        cells = " ".join(f"{k}={v:.0f}" if v else f"{k}=ERR" for k, v in us.items())
        sp = " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in res["speedup"].items())
        bad = [k for k, c in res["check"].items() if not c["agrees"]]
        print(f"POD {row.note.split(';')[0].split(':')[0]:6s} {cells} | {sp}" + (f" | MISMATCH {bad}" if bad else ""),
              flush=True)
        torch.cuda.empty_cache()
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "bench_pod_hopper.json")
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A/B of the whole kernel source tree (csrc/ and templates/) against a base commit's, in one
process, on the rows of the decode and prefill benchmarks of record: is a refactor of the
device code free? Not a benchmark of record itself (no peers), the check that one is still
valid for the new tree.

  python3 scripts/ab_tree.py --base DIR [--out FILE] [--only decode|prefill] [--build-only] [--jobs 16]

DIR holds the base commit's csrc/ and templates/ (e.g. `git archive 0ab8de0 csrc templates`,
unpacked). Both variants run under this checkout's Python: the base variant's modules are
rendered from DIR's templates and headers (laid into today's template folders by a small
shim; the specs, op schemas and fast-entry signatures must be the same in both trees), the
new variant's from the checkout. Host-only modules (the planners, the page order) and the
fastcall extension are the checkout's in both: they are loaded first and stay loaded.

Each row plans one wrapper per variant on the same inputs, checks that their outputs agree,
then times them interleaved in the same way as the benchmark of record:
- prefill rows (scripts/bench_prefill.py's rows, paged and ragged): eager run()s, an L2
  flush before each, CUDA events, bench_prefill.time_interleaved's balanced rounds;
- decode rows (scripts/bench_decode.py's case list): CUDA-graph replays over rotating input
  sets (bench_common.capture_graph / time_graph), ROUNDS rounds of one timing per variant in
  alternating order.
A row reports each variant's median, new/base time (< 1: the new tree is faster) and, for
prefill, the paired ratio (per round). Rows whose outputs differ by more than a 16-bit
output's rounding are flagged.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_common as bc  # noqa: E402

# the order each row plans and times them in (AB_ORDER=base,new swaps it)
VARIANTS = tuple(os.environ.get("AB_ORDER", "new,base").split(","))


# --- the two source trees ------------------------------------------------------------------------
def make_shim(base: Path) -> Path:
    """DIR's templates laid into the folders today's specs name (templates/<family>/x.j2 <-
    DIR/templates/x.j2 where DIR is flat), and DIR's csrc as it is."""
    from flashinfer_jit.specs import FAMILIES

    shim = Path(tempfile.mkdtemp(prefix="ab_tree_base_"))
    shutil.copytree(base / "csrc", shim / "csrc")
    for cls in FAMILIES.values():
        for rel in cls.TEMPLATES.values():
            src = base / "templates" / rel
            if not src.is_file():
                src = base / "templates" / Path(rel).name
            dst = shim / "templates" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    return shim


class Trees:
    """Switches which tree the kernel modules come from. The module registry and the kernel
    op caches are forgotten at each switch (a spec's module differs between the trees); the
    host planners and the page order stay as first loaded (the checkout's)."""

    def __init__(self, shim: Path):
        from flashinfer_jit.pipeline import env

        self.env, self.shim, self.checkout = env, shim, env.source_dir
        self.current = "new"

    def use(self, variant: str) -> None:
        from flashinfer_jit.pipeline import jit
        from flashinfer_jit.runtime import launch, native

        if variant == self.current:
            return
        self.env.source_dir = self.checkout if variant == "new" else (lambda kind: self.shim / kind)
        # every cache keyed by a kernel module's spec: the registry, the ops, the fast
        # entries and the libraries they come from (a fast entry from the other tree's
        # library would run that tree's kernel under this one's name)
        for cached in (jit._registry, launch.module_op, launch.fast_entry, launch._error_string,
                       native.module_library):
            cached.cache_clear()
        self.current = variant

    @staticmethod
    def library(spec) -> str:
        """The path of the library spec's module loads from in the current tree."""
        from flashinfer_jit.pipeline import jit

        module = jit.get_module(spec)
        return str(module.path / module.manifest["library"])


# --- prefill ---------------------------------------------------------------------------------------
def prefill_rows(head_dims, only=()):
    import bench_prefill as bp

    return bp.row_list(head_dims, only)


def prefill_specs(rows):
    from flashinfer_jit.specs import PrefillSpec

    specs = set()
    for r in rows:
        for form in r.forms:
            specs.add(PrefillSpec("bfloat16", "bfloat16", "bfloat16", r.head_dim, r.head_dim, kv_source=form,
                                  mask="causal" if r.causal else "none"))
    return sorted(specs, key=lambda s: s.name)


def measure_prefill_row(row, trees: Trees, reps: int, flush, seed: int) -> list[dict]:
    import torch

    import bench_prefill as bp
    import flashinfer_jit as fij

    inputs = bp.Inputs(row, seed, ragged="ragged" in row.forms, dense=False)
    bf16 = torch.bfloat16
    results = []
    for form in row.forms:
        runs, outs, libs = {}, {}, {}
        for variant in VARIANTS:
            trees.use(variant)
            ws = torch.empty(bp.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
            out = torch.full_like(inputs.q, float("nan"))
            if form == "paged":
                w = fij.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
                w.plan(inputs.qo_indptr, inputs.page_indptr, inputs.indices, inputs.last_page_len, bp.NUM_QO_HEADS,
                       bp.NUM_KV_HEADS, row.head_dim, bp.PAGE_SIZE, causal=row.causal, q_data_type=bf16,
                       kv_data_type=bf16)
                run = (lambda w=w, out=out: w.run(inputs.q, (inputs.k_cache, inputs.v_cache), out=out))
            else:
                w = fij.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
                w.plan(inputs.qo_indptr, inputs.kv_indptr, bp.NUM_QO_HEADS, bp.NUM_KV_HEADS, row.head_dim,
                       causal=row.causal, q_data_type=bf16, kv_data_type=bf16)
                run = (lambda w=w, out=out: w.run(inputs.q, inputs.k, inputs.v, out=out))
            run()
            run()  # the second call takes the fast path (the recorded launch)
            torch.cuda.synchronize()
            runs[variant], outs[variant] = run, out
            libs[variant] = trees.library(w._plan.spec)
        trees.use("new")
        assert libs["new"] != libs["base"], f"both variants loaded {libs['new']}"
        diff = float((outs["new"].float() - outs["base"].float()).abs().max())
        wrote = not bool(torch.isnan(outs["new"]).any() or torch.isnan(outs["base"]).any())
        t = bp.time_interleaved([runs[v] for v in VARIANTS], reps, flush)
        res = {"family": "prefill", "label": f"{row.label} {form}", "max_abs_diff": diff, "wrote_every_row": wrote}
        for v, tv in zip(VARIANTS, t):
            res[v] = {"median_us": tv.get("median_us"), "samples_us": [round(x, 2) for x in tv.get("_samples", [])]}
        res["new_over_base"] = res["new"]["median_us"] / res["base"]["median_us"]
        paired = bp.paired_ratio(res["new"]["samples_us"], res["base"]["samples_us"])
        res["paired_new_over_base"] = paired
        results.append(res)
        bc.log(f"{res['label']}: new {res['new']['median_us']:.1f} us, base {res['base']['median_us']:.1f} us, "
               f"new/base {res['new_over_base']:.4f}, diff {diff:.2g}")
    del inputs
    torch.cuda.empty_cache()
    return results


# --- decode ------------------------------------------------------------------------------------------
def decode_cases(quick: bool):
    import bench_decode as bd

    return bd.case_list(quick)


def decode_specs(cases):
    import bench_decode as bd
    from flashinfer_jit.decode.spec import group_tile
    from flashinfer_jit.specs import DecodeSpec

    specs = set()
    for c in cases:
        hq, hk = bd.GQA_HEADS[c.gqa]
        specs.add(DecodeSpec("bfloat16", c.kv_dtype, bd.HEAD_DIM, group_tile(hq, hk, bd.HEAD_DIM)))
    return sorted(specs, key=lambda s: s.name)


def measure_decode_case(case, trees: Trees, reps: int, rounds: int, max_gb: float, seed: int) -> dict:
    import torch

    import bench_decode as bd
    import flashinfer_jit as fij

    res = {"family": "decode", "label": case.label}
    if case.cache_bytes() / 1e9 > max_gb:
        return res | {"skipped": f"K+V cache {case.cache_bytes() / 1e9:.1f} GB > {max_gb} GB"}
    n_sets = max(1, min(8, int(4 * bc.l2_bytes() // max(case.cache_bytes(), 1)) + 1))
    inputs = bd.Inputs(case, n_sets, seed)
    kv_dtype = getattr(torch, case.kv_dtype)
    graphs, outs, libs = {}, {}, {}
    inner = n_sets * max(1, math.ceil((2 if case.bytes_moved() > (1 << 30) else 8) / n_sets))
    for variant in VARIANTS:
        trees.use(variant)
        ws = torch.zeros(bd.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        w = fij.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(*inputs.plan_args(), q_data_type=torch.bfloat16, kv_data_type=kv_dtype)

        def run(i, w=w):
            s = inputs.sets[i]
            w.run(s["q"], (s["k"], s["v"]), out=s["out"])

        run(0)  # the op's call, then the recorded launch's (the graph captures the latter)
        graphs[variant] = bc.capture_graph(run, n_sets, inner)
        libs[variant] = trees.library(w._plan.spec)
        out0 = inputs.sets[0]["out"]
        out0.fill_(float("nan"))
        graphs[variant].replay()
        torch.cuda.synchronize()
        outs[variant] = out0.clone()
    trees.use("new")
    assert libs["new"] != libs["base"], f"both variants loaded {libs['new']}"
    res["max_abs_diff"] = float((outs["new"].float() - outs["base"].float()).abs().max())
    res["wrote_every_row"] = not bool(torch.isnan(outs["new"]).any() or torch.isnan(outs["base"]).any())
    medians = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for v in order:
            medians[v].append(bc.time_graph(graphs[v], inner, reps=reps)["median_us"])
    for v in VARIANTS:
        res[v] = {"median_us": sorted(medians[v])[len(medians[v]) // 2], "round_medians_us": medians[v]}
    res["new_over_base"] = res["new"]["median_us"] / res["base"]["median_us"]
    ratios = sorted(a / b for a, b in zip(medians["new"], medians["base"]))
    res["paired_new_over_base"] = {"median": ratios[len(ratios) // 2], "min": ratios[0], "max": ratios[-1]}
    bc.log(f"{case.label}: new {res['new']['median_us']:.2f} us, base {res['base']['median_us']:.2f} us, "
           f"new/base {res['new_over_base']:.4f}, diff {res['max_abs_diff']:.2g}")
    del graphs
    inputs.release()
    torch.cuda.empty_cache()
    return res


# --- builds --------------------------------------------------------------------------------------------
def build(trees: Trees, specs, jobs: int) -> dict:
    """Both variants' kernel modules, in parallel (one ninja per variant)."""
    from flashinfer_jit.pipeline import jit

    report = {}
    for variant in VARIANTS:
        trees.use(variant)
        t0 = time.time()
        r = jit.build_many(list(specs), jobs=jobs)
        report[variant] = {"seconds": round(time.time() - t0, 1), "built": len(r.built), "cached": len(r.cached),
                           "failed": r.failed}
    trees.use("new")
    return report


def warm_host_modules() -> None:
    """The checkout's planners, page order and fastcall extension, loaded before any switch."""
    import torch

    import flashinfer_jit as fij

    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    k = torch.randn(8, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    indptr = torch.tensor([0, 4, 8], dtype=torch.int32)
    indices = torch.randperm(8, dtype=torch.int32).cuda()
    last = torch.tensor([16, 9], dtype=torch.int32)
    d = fij.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    d.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    p = fij.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    p.plan(torch.tensor([0, 3, 5], dtype=torch.int32), indptr, indices, last, 32, 8, 128, 16, causal=True,
           q_data_type=torch.bfloat16)
    del k
    torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="folder with the base commit's csrc/ and templates/")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ab_tree.json"))
    ap.add_argument("--only", choices=("decode", "prefill"), default=None)
    ap.add_argument("--quick", action="store_true", help="bench_decode's quick cases and head_dim 128's prefill rows")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5, help="decode: timings per variant, alternating")
    ap.add_argument("--max-cache-gb", type=float, default=24.0)
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--time-limit", type=float, default=540.0)
    args = ap.parse_args(argv)
    started = time.time()

    import torch

    import bench_prefill as bp

    shim = make_shim(Path(args.base).resolve())
    trees = Trees(shim)
    head_dims = [int(x) for x in args.head_dims.split(",")]
    p_rows = [] if args.only == "decode" else prefill_rows([128] if args.quick else head_dims)
    d_cases = [] if args.only == "prefill" else decode_cases(args.quick)
    specs = prefill_specs(p_rows) + decode_specs(d_cases)
    res = {"meta": bc.run_metadata(), "base": str(args.base),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "rows": [],
           "skipped": []}
    res["builds"] = build(trees, specs, args.jobs)
    bc.log(f"builds: {res['builds']}")
    if args.build_only or not torch.cuda.is_available():
        shutil.rmtree(shim, ignore_errors=True)
        return 0
    res["device"] = torch.cuda.get_device_name(0)
    warm_host_modules()
    flush = bp.Flush()
    deadline = started + args.time_limit
    for i, row in enumerate(p_rows):
        if time.time() > deadline:
            res["skipped"].append(row.label)
            continue
        res["rows"] += measure_prefill_row(row, trees, args.reps, flush, seed=1000 + i)
    for i, case in enumerate(d_cases):
        if time.time() > deadline:
            res["skipped"].append(case.label)
            continue
        res["rows"].append(measure_decode_case(case, trees, args.reps, args.rounds, args.max_cache_gb, seed=2000 + i))
    timed = [r for r in res["rows"] if "new_over_base" in r]
    if timed:
        ratios = [r["new_over_base"] for r in timed]
        res["summary"] = {"rows": len(timed), "min": min(ratios), "max": max(ratios),
                          "within_1pct": sum(abs(x - 1) <= 0.01 for x in ratios),
                          "slower_than_1pct": [r["label"] for r in timed if r["new_over_base"] > 1.01]}
        bc.log(f"summary: {res['summary']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    shutil.rmtree(shim, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

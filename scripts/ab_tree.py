#!/usr/bin/env python3
"""A/B of the whole kernel source tree (csrc/ and templates/) against a base commit's, in one
process, on the rows of the prefill benchmark of record: is a refactor of the device code
free? Not a benchmark of record itself (no peers), the check that one is still valid for
the new tree.

  python3 scripts/ab_tree.py --base DIR [--out FILE] [--head-dims 64,128,256] [--build-only] [--jobs 16]

DIR holds the base commit's csrc/ and templates/ (e.g. `git archive 0ab8de0 csrc templates`,
unpacked). Both variants run under this checkout's Python: the base variant's modules are
rendered from DIR's templates and headers (laid into today's template folders by a small
shim; the specs, op schemas and fast-entry signatures must be the same in both trees), the
new variant's from the checkout. Host-only modules (the planners, the page order) and the
fastcall extension are the checkout's in both: they are loaded first and stay loaded. Each
row asserts that the two variants ran different libraries.

Each row plans one wrapper per variant on the same inputs, checks that their outputs agree,
then times them as the benchmark of record does (scripts/bench_prefill.py's rows, paged and
ragged; eager run()s, an L2 flush before each, CUDA events, bench_prefill.time_interleaved's
balanced rounds). A row reports each variant's median, new/base time (< 1: the new tree is
faster) and the paired ratio (per round, "paired_new_over_base": new's time over base's, the
same sense; the JSON files written before 2026-11-30's fix of it, up to `0d06f3b`, hold base's
time over new's under that key, a speedup).

Decode is A/B'd in separate processes instead (scripts/bench_decode.py run in each tree,
alternately: scripts/README.md). With two builds of one decode spec in one process, the
first build's CUDA-graph replays of split and cluster plans timed at ~1.5 us a call and a
later one raised an illegal-address error (H200, 2026-11-29); one build per process ran
clean, and the cause was not established.
"""

from __future__ import annotations

import argparse
import datetime
import json
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


def sm90_specs(rows) -> list:
    """The Hopper kernel's modules the rows' wrappers plan under "auto" (key and query tiles,
    the copy of long prompts' pages read by the ragged module), found by planning each row's
    host vectors on the CPU with the arch check passed; [] off sm_90 plans (the mma.sync
    modules come from prefill_specs)."""
    import bench_prefill as bp
    import torch

    import flashinfer_jit as fij
    from flashinfer_jit.prefill import sm90

    def indptr(n, step):
        return torch.arange(0, n * step + 1, step, dtype=torch.int32)

    saved, sm90.arch_error = sm90.arch_error, (lambda device: None)
    specs = set()
    try:
        ws = torch.empty(64 << 20, dtype=torch.uint8)
        for r in rows:
            for form in r.forms:
                args = dict(causal=r.causal, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                if form == "paged":
                    pages = -(-r.kv_len // bp.PAGE_SIZE)
                    w = fij.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
                    w.plan(indptr(r.batch, r.qo_len), indptr(r.batch, pages),
                           torch.arange(r.batch * pages, dtype=torch.int32),
                           torch.full((r.batch,), r.kv_len - (pages - 1) * bp.PAGE_SIZE, dtype=torch.int32),
                           bp.NUM_QO_HEADS, bp.NUM_KV_HEADS, r.head_dim, bp.PAGE_SIZE, **args)
                else:
                    w = fij.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
                    w.plan(indptr(r.batch, r.qo_len), indptr(r.batch, r.kv_len), bp.NUM_QO_HEADS, bp.NUM_KV_HEADS,
                           r.head_dim, **args)
                if w.planned_backend == "fa3":
                    specs.add(w._plan.spec)
    finally:
        sm90.arch_error = saved
    return sorted(specs, key=lambda s: s.name)


def measure_prefill_row(row, trees: Trees, reps: int, flush, seed: int) -> list[dict]:
    import bench_prefill as bp
    import torch

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
                run = (lambda w=w, out=out, x=inputs: w.run(x.q, (x.k_cache, x.v_cache), out=out))
            else:
                w = fij.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
                w.plan(inputs.qo_indptr, inputs.kv_indptr, bp.NUM_QO_HEADS, bp.NUM_KV_HEADS, row.head_dim,
                       causal=row.causal, q_data_type=bf16, kv_data_type=bf16)
                run = (lambda w=w, out=out, x=inputs: w.run(x.q, x.k, x.v, out=out))
            run()
            run()  # the second call takes the fast path (the recorded launch)
            torch.cuda.synchronize()
            runs[variant], outs[variant] = run, out
            libs[variant] = trees.library(w._plan.spec)
        trees.use("new")
        if libs["new"] == libs["base"]:  # (a row whose kernel neither tree changed: the mma.sync one under "auto")
            bc.log(f"{row.label} {form}: both variants loaded {libs['new']}; not timed")
            results.append({"family": "prefill", "label": f"{row.label} {form}", "same_library": libs["new"]})
            continue
        diff = float((outs["new"].float() - outs["base"].float()).abs().max())
        wrote = not bool(torch.isnan(outs["new"]).any() or torch.isnan(outs["base"]).any())
        t = bp.time_interleaved([runs[v] for v in VARIANTS], reps, flush)
        res = {"family": "prefill", "label": f"{row.label} {form}", "max_abs_diff": diff, "wrote_every_row": wrote}
        for v, tv in zip(VARIANTS, t):
            res[v] = {"median_us": tv.get("median_us"), "samples_us": [round(x, 2) for x in tv.get("_samples", [])]}
        res["new_over_base"] = res["new"]["median_us"] / res["base"]["median_us"]
        paired = bp.paired_ratio(res["base"]["samples_us"], res["new"]["samples_us"])  # new / base
        res["paired_new_over_base"] = paired
        results.append(res)
        bc.log(f"{res['label']}: new {res['new']['median_us']:.1f} us, base {res['base']['median_us']:.1f} us, "
               f"new/base {res['new_over_base']:.4f}, diff {diff:.2g}")
    del inputs
    torch.cuda.empty_cache()
    return results


# --- builds --------------------------------------------------------------------------------------------
def build(trees: Trees, specs, jobs: int) -> dict:
    """Both variants' kernel modules, in parallel (one ninja per variant): the mma.sync ones
    (prefill_specs) and the Hopper ones the rows plan under "auto" (sm90_specs), which a row
    would otherwise build one at a time on first use."""
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
    """The checkout's planners, page order and fastcall extension, loaded before any switch
    (a decode plan loads the page order and the fastcall extension too)."""
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
    ap.add_argument("--quick", action="store_true", help="head_dim 128's rows only")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--time-limit", type=float, default=540.0)
    args = ap.parse_args(argv)
    started = time.time()

    import bench_prefill as bp
    import torch

    shim = make_shim(Path(args.base).resolve())
    trees = Trees(shim)
    head_dims = [int(x) for x in args.head_dims.split(",")]
    p_rows = prefill_rows([128] if args.quick else head_dims)
    specs = prefill_specs(p_rows) + sm90_specs(p_rows)  # (both trees' modules, built side by side)
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

#!/usr/bin/env python3
"""Tuning sweeps for batch decode (issue 4): what the planner's defaults rest on.

In one process on one GPU, ours only (bench_decode.py compares with FlashInfer):
  - split: small batches (b=1, 16) x kv_len, bf16 and fp8 KV, GQA-4 and GQA-8: device
    time of run() by CUDA-graph replay for the planner's own choice, each
    fixed_split_size of 32..4096 tokens and disable_split_kv, with programmatic dependent
    launch (enable_pdl) on and off;
  - layout: b=64 kv=4k, bf16 and fp8 KV, NHD and HND pages (same bytes, other order);
  - cluster: small batches split over thread-block clusters (plan()'s choice on sm_90+)
    against the split with partial states (FLASHINFER_JIT_DECODE_CLUSTERS=0), eager and
    CUDA-graph wrappers, in interleaved rounds (a case under the planner's 64 tokens per
    block is forced onto clusters; an eager case over the planner's bytes a block runs the
    split with partial states in both columns; a CUDA-graph wrapper takes clusters by its
    capacity, whatever the lengths);
  - host: where run()'s host time goes (run() on its fast path, run() through the torch
    op as after a plan() with another launch, the op alone, plan() and plan() + run() where
    the launch stays (the fast path from the first run), run()'s Python alone, one torch
    launch, a ctypes call).
Every timed configuration is checked first: one replay writes every output element
(outputs are NaN-poisoned) and agrees with the planner's default (rel. L2 < 1e-2).
Head_dim 128, page 16, CSR page table, bf16 q; inputs rotate over sets of > 4x L2.

  python3 scripts/sweep_decode.py [--out FILE] [--only split,layout,host]
                                  [--splits 512,1008,1024] [--cases 'bfloa gqa4 b=1 kv=32768;...']
                                  [--layout-cases bfloat16:4:1:32768,...]
                                  [--sets 1]   (1: the same inputs every replay, a warm L2)
Writes JSON (--out, default $OUT/sweep_decode.json) and prints tables.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

HEAD_DIM, PAGE_SIZE = 128, 16
HEADS = {1: (32, 32), 2: (32, 16), 4: (32, 8), 8: (64, 8)}  # gqa -> (num_qo_heads, num_kv_heads)
SPLIT_CASES = [  # (kv dtype, gqa, batch, kv_len)
    ("bfloat16", 4, 1, 2048), ("bfloat16", 4, 1, 8192), ("bfloat16", 4, 1, 32768),
    ("float8_e4m3fn", 4, 1, 2048), ("float8_e4m3fn", 4, 1, 32768),
    ("bfloat16", 8, 1, 2048), ("bfloat16", 8, 1, 8192), ("bfloat16", 8, 1, 32768), ("float8_e4m3fn", 8, 1, 8192),
    ("bfloat16", 4, 16, 2048), ("bfloat16", 4, 16, 8192),
]
# Grids whose unsplit blocks cover most SMs (decode.py _FULL_GRID_MIN_TENTHS; swept for
# e8c4075 on 2026-11-26: b=16 at short lengths, where cuDNN's SDPA on a dense cache led):
# run only when --cases names them.
FULL_GRID_CASES = [
    ("bfloat16", 4, 16, 512), ("bfloat16", 8, 16, 512), ("bfloat16", 8, 16, 2048),
    ("bfloat16", 4, 16, 4096), ("bfloat16", 4, 16, 32768), ("bfloat16", 8, 16, 8192),
    ("float8_e4m3fn", 4, 16, 512), ("float8_e4m3fn", 4, 16, 2048), ("float8_e4m3fn", 4, 16, 8192),
    ("bfloat16", 4, 12, 512), ("bfloat16", 4, 12, 2048), ("bfloat16", 4, 8, 512), ("bfloat16", 4, 8, 2048),
    ("bfloat16", 4, 20, 512), ("bfloat16", 4, 24, 512), ("bfloat16", 4, 24, 2048),
    ("bfloat16", 4, 16, 256), ("bfloat16", 4, 16, 1024), ("bfloat16", 8, 16, 1024), ("bfloat16", 4, 12, 1024),
    ("bfloat16", 4, 20, 1024), ("bfloat16", 4, 20, 2048), ("bfloat16", 4, 32, 512), ("bfloat16", 4, 12, 256),
    ("float8_e4m3fn", 4, 16, 1024), ("float8_e4m3fn", 4, 12, 512), ("float8_e4m3fn", 8, 16, 512),
    ("float8_e4m3fn", 4, 20, 512), ("bfloat16", 4, 10, 512), ("bfloat16", 4, 10, 2048),
    ("bfloat16", 4, 20, 8192), ("float8_e4m3fn", 4, 20, 8192), ("bfloat16", 4, 20, 32768),
    ("float8_e4m3fn", 4, 16, 4096), ("bfloat16", 4, 12, 8192), ("bfloat16", 8, 20, 2048),
    # the same grids of MHA (32/32 heads) and GQA-2 (32/16): 128 blocks at b=4 / b=8
    ("bfloat16", 1, 4, 512), ("bfloat16", 1, 4, 2048), ("bfloat16", 1, 4, 4096), ("bfloat16", 1, 3, 2048),
    ("bfloat16", 2, 8, 512), ("bfloat16", 2, 8, 2048), ("float8_e4m3fn", 1, 4, 2048), ("bfloat16", 1, 5, 2048),
]
SPLITS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
FORCE_SETS = 0  # --sets: input sets to rotate over (0: enough to exceed 4x L2; 1: a warm L2)
MIN_SETS = 1  # at least this many sets when FORCE_SETS is 0
LAYOUT_CASES = [("bfloat16", 4, 64, 4096), ("float8_e4m3fn", 4, 64, 4096)]
CLUSTER_CASES = [(kv, 4, 1, n) for kv in ("bfloat16", "float8_e4m3fn") for n in (512, 1024, 2048, 4096, 8192, 32768)]
CLUSTER_CASES += [("bfloat16", 8, 1, n) for n in (2048, 8192, 32768)] + [("float8_e4m3fn", 8, 1, 8192)]
# b=2 at 8 KV heads: 128 one-block-per-SM clusters (where the long blocks stop paying)
CLUSTER_CASES += [("bfloat16", 4, 1, 16384)] + [("bfloat16", 4, 2, n) for n in (2048, 4096, 16384)]
# b=1 past an eager plan's 2 MB a block: eager columns split with partial states, a CUDA-graph
# wrapper (capacity 1) keeps its 8-warp clusters at any length
CLUSTER_CASES += [("bfloat16", 4, 1, n) for n in (65536, 131072)]


class Inputs:
    """A page table for `batch` requests of kv_len tokens and n_sets (q, K, V, out) sets."""

    def __init__(self, kv_dtype: str, gqa: int, batch: int, kv_len: int, layout: str = "NHD", seed: int = 0):
        import torch

        hq, hk = HEADS[gqa]
        self.hq, self.hk, self.batch, self.kv_len, self.layout = hq, hk, batch, kv_len, layout
        self.kv_dtype = getattr(torch, kv_dtype)
        pages = -(-kv_len // PAGE_SIZE)
        self.num_pages = pages * batch
        gen = torch.Generator().manual_seed(seed)
        self.indptr = torch.arange(0, self.num_pages + 1, pages, dtype=torch.int32)
        self.last = torch.full((batch,), kv_len - (pages - 1) * PAGE_SIZE, dtype=torch.int32)
        self.indices = torch.randperm(self.num_pages, generator=gen).to(torch.int32).cuda()
        self.kv_bytes = 2 * batch * kv_len * hk * HEAD_DIM * self.kv_dtype.itemsize
        shape = (self.num_pages, PAGE_SIZE, hk, HEAD_DIM) if layout == "NHD" else (self.num_pages, hk, PAGE_SIZE, HEAD_DIM)
        self.n_sets = max(MIN_SETS, min(bc.rotation_sets(self.kv_bytes), int(12e9 // self.kv_bytes)))
        if FORCE_SETS:
            self.n_sets = FORCE_SETS

        def cache():
            return torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(self.kv_dtype)

        self.sets = [dict(q=torch.randn(batch, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16), k=cache(),
                          v=cache(), out=torch.empty(batch, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
                     for _ in range(self.n_sets)]

    def wrapper(self, use_cuda_graph: bool = False, **plan_kwargs):
        """A planned wrapper; use_cuda_graph: a CUDA-graph one, with its own page-table
        buffers of this batch."""
        import torch

        import flashinfer_jit as fij

        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        kwargs = bc.cuda_graph_buffers(self.batch, self.num_pages) if use_cuda_graph else {}
        w = fij.BatchDecodeWithPagedKVCacheWrapper(ws, self.layout, **kwargs)
        self.plan(w, **plan_kwargs)
        return w

    def plan(self, w, **plan_kwargs) -> None:
        import torch

        w.plan(self.indptr, self.indices, self.last, self.hq, self.hk, HEAD_DIM, PAGE_SIZE,
               q_data_type=torch.bfloat16, kv_data_type=self.kv_dtype, **plan_kwargs)


def timed(inputs: Inputs, reference=None, pdl: bool = True, use_cuda_graph: bool = False, **plan_kwargs) -> dict:
    """Graph-replay µs of run() under plan(**plan_kwargs); checks one replay's output.
    use_cuda_graph: the wrapper's CUDA-graph mode (the replay is a graph either way)."""
    import torch

    w = inputs.wrapper(use_cuda_graph, **plan_kwargs)
    items = int(w._plan.args[8])  # grid items: work items the kernel runs

    def run(i):
        s = inputs.sets[i]
        w.run(s["q"], (s["k"], s["v"]), out=s["out"], enable_pdl=pdl)

    inner = inputs.n_sets * max(1, -(-8 // inputs.n_sets))
    graph = bc.capture_graph(run, inputs.n_sets, inner)
    out0 = inputs.sets[0]["out"]
    out0.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    result = {"grid_items": items, "wrote_all": not bool(torch.isnan(out0).any())}
    if reference is not None:
        result["rel_diff"] = float((out0.float() - reference.float()).norm() / reference.float().norm())
    else:
        result["_out0"] = out0.clone()
    t = bc.time_graph(graph, inner, reps=40)
    result |= {"median_us": t["median_us"], "tb_per_s": inputs.kv_bytes / t["median_us"] / 1e6}
    return result


def _label(kv: str, gqa: int, batch: int, kv_len: int) -> str:
    return f"{kv[:5]} gqa{gqa} b={batch} kv={kv_len}"


def split_cases(only_cases=None) -> list:
    """The split sweep's cases: SPLIT_CASES, or those of SPLIT_CASES and FULL_GRID_CASES
    that only_cases names (labels)."""
    if not only_cases:
        return SPLIT_CASES
    return [c for c in SPLIT_CASES + FULL_GRID_CASES if _label(*c) in only_cases]


def sweep_split(copy_gbps: float, splits=SPLITS, only_cases=None) -> list:
    rows = []
    for kv, gqa, batch, kv_len in split_cases(only_cases):
        label = _label(kv, gqa, batch, kv_len)
        inputs = Inputs(kv, gqa, batch, kv_len)
        auto = timed(inputs, pdl=True)
        ref = auto.pop("_out0")
        row = {"case": label, "kv_dtype": kv, "gqa": gqa, "batch": batch, "kv_len": kv_len,
               "kv_bytes": inputs.kv_bytes, "results": {"auto pdl": auto}}
        row["results"]["auto nopdl"] = timed(inputs, ref, pdl=False)
        for split in splits:
            if split < kv_len:
                for pdl in (True, False):
                    row["results"][f"{split} {'pdl' if pdl else 'nopdl'}"] = \
                        timed(inputs, ref, pdl=pdl, fixed_split_size=split)
        row["results"]["nosplit pdl"] = timed(inputs, ref, pdl=True, disable_split_kv=True)
        best = min(row["results"].items(), key=lambda kv_: kv_[1]["median_us"])
        row["best"] = best[0]
        bc.log(f"{label}: auto {auto['median_us']:.1f} us (pdl), {row['results']['auto nopdl']['median_us']:.1f} "
               f"(no pdl); best {best[0]} {best[1]['median_us']:.1f} us")
        rows.append(row)
        del inputs
        import torch

        torch.cuda.empty_cache()
    return rows


def sweep_cluster(only_cases=None, rounds: int = 3) -> list:
    """Per case and round: the cluster split (forced where the planner would not take it)
    and the split with partial states, eager and CUDA-graph wrappers, each checked against
    the first output."""
    import os

    import torch

    from flashinfer_jit.decode import wrapper as decode

    rows = []
    for kv, gqa, batch, kv_len in CLUSTER_CASES:
        label = _label(kv, gqa, batch, kv_len)
        if only_cases and label not in only_cases:
            continue
        inputs = Inputs(kv, gqa, batch, kv_len)
        row = {"case": label, "kv_dtype": kv, "gqa": gqa, "batch": batch, "kv_len": kv_len,
               "kv_bytes": inputs.kv_bytes, "rounds": []}
        ref = None
        for _ in range(rounds):
            results = {}
            for variant in ("cluster", "partials"):
                for graph in (False, True):
                    os.environ["FLASHINFER_JIT_DECODE_CLUSTERS"] = "1" if variant == "cluster" else "0"
                    saved = decode._CLUSTER_MIN_CHUNK
                    decode._CLUSTER_MIN_CHUNK = 1  # forced onto clusters below the planner's line
                    try:
                        r = timed(inputs, ref, pdl=True, use_cuda_graph=graph)
                    finally:
                        decode._CLUSTER_MIN_CHUNK = saved
                        os.environ.pop("FLASHINFER_JIT_DECODE_CLUSTERS", None)
                    if ref is None:
                        ref = r.pop("_out0")
                    results[f"{variant}{' graph' if graph else ''}"] = r
            row["rounds"].append(results)
        row["median_us"] = {k: float(sorted(r[k]["median_us"] for r in row["rounds"])[rounds // 2])
                            for k in row["rounds"][0]}
        row["ok"] = all(v["wrote_all"] and v.get("rel_diff", 0) < 1e-2 for r in row["rounds"] for v in r.values())
        bc.log(f"cluster {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["median_us"].items()) +
               ("" if row["ok"] else " BAD OUTPUT"))
        rows.append(row)
        del inputs
        torch.cuda.empty_cache()
    return rows


def sweep_layout(cases=LAYOUT_CASES) -> list:
    rows = []
    for kv, gqa, batch, kv_len in cases:
        for layout in ("NHD", "HND"):
            inputs = Inputs(kv, gqa, batch, kv_len, layout)
            r = timed(inputs, pdl=True)
            r.pop("_out0")
            rows.append({"case": f"{kv[:5]} gqa{gqa} b={batch} kv={kv_len} {layout}", "layout": layout,
                         "kv_dtype": kv, "kv_bytes": inputs.kv_bytes} | r)
            bc.log(f"{rows[-1]['case']}: {r['median_us']:.1f} us {r['tb_per_s']:.2f} TB/s")
            del inputs
    return rows


def host_breakdown() -> dict:
    """µs of host time per call (enqueue rate while the device lags behind)."""
    import torch
    from bench_decode import enqueue_us

    out = {}
    for label, (batch, kv_len) in {"b=1 kv=16": (1, 16), "b=64 kv=4k": (64, 4096)}.items():
        inputs = Inputs("bfloat16", 4, batch, kv_len)
        inputs.sets = inputs.sets[:1]
        s = inputs.sets[0]
        w = inputs.wrapper()
        call = lambda: w.run(s["q"], (s["k"], s["v"]), out=s["out"])  # noqa: E731
        r = {"run": enqueue_us(call), "run_new_out": enqueue_us(lambda: w.run(s["q"], (s["k"], s["v"])))}
        plan = w._plan

        def through_op():  # as the first run() after a plan(): the op, which prepares the fast path
            plan.fast = None
            call()

        r["run_through_op"] = enqueue_us(through_op)
        a = plan.args
        args = (s["q"], s["k"], s["v"], a[0], a[1], a[2], s["out"], plan.no_lse, a[3], a[4], 1.0, 1.0, a[5], -1,
                a[6], a[7], a[8], a[9], a[10], True, None, plan.kv_heads_per_block, plan.cluster,
                plan.cluster_warps)
        r["op_alone"] = enqueue_us(lambda: plan.op(*args))
        call()
        fast = plan.fast
        plan.fast = fast._replace(call=lambda *a_: 0)
        r["run_python_only"] = bc.time_python(call, 20000)
        plan.fast = fast
        # a decode step: plan() (same launch as the last plan: its first run() is fast), run()
        r["plan_alone"] = enqueue_us(lambda: inputs.plan(w))
        r["plan_then_run"] = enqueue_us(lambda: (inputs.plan(w), call()))
        # ... as when the launch changes: the first run() through the op
        r["plan_then_run_op"] = enqueue_us(lambda: (inputs.plan(w), setattr(w._plan, "fast", None), call()))
        out[label] = r
        bc.log(f"host {label}: {r}")
    buf = torch.zeros(1, device="cuda")
    out["torch_add_"] = enqueue_us(lambda: buf.add_(1))
    libc = ctypes.CDLL(None)
    labs = libc.labs
    out["ctypes_call_3_args_us"] = bc.time_python(lambda: labs(-5), 200000)
    q = torch.zeros(4, device="cuda")
    out["data_ptr_us"] = bc.time_python(lambda: q.data_ptr(), 200000)
    out["raw_stream_us"] = bc.time_python(lambda: torch._C._cuda_getCurrentRawStream(0), 200000)
    out["empty_like_us"] = bc.time_python(lambda: torch.empty_like(q), 50000)
    return out


def build_modules(parts=("split", "layout", "cluster", "host"), layout_cases=LAYOUT_CASES, only_cases=None) -> None:
    """The modules the chosen sweeps use, in one parallel build (run() would build them one by one)."""
    from flashinfer_jit.decode.spec import group_tile
    from flashinfer_jit.pipeline.jit import build_many
    from flashinfer_jit.specs import DecodeSpec

    groups = (("split", split_cases(only_cases)), ("cluster", CLUSTER_CASES), ("host", SPLIT_CASES[:1]))
    cases = [(c, "NHD") for part, group in groups
             if part in parts for c in group]
    cases += [(c, layout) for c in layout_cases for layout in ("NHD", "HND")] if "layout" in parts else []
    specs = {DecodeSpec("bfloat16", kv, HEAD_DIM, group_tile(*HEADS[gqa], HEAD_DIM), "csr", layout)
             for (kv, gqa, _, _), layout in cases}
    report = build_many(sorted(specs, key=lambda s: s.name), jobs=16)
    bc.log(f"modules: {len(report.built)} built, {len(report.cached)} cached, failed {dict(report.failed)}")


def parse_layout_cases(text: str) -> list:
    """--layout-cases: 'kv_dtype:gqa:batch:kv_len,...' as (kv_dtype, gqa, batch, kv_len) tuples."""
    cases = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) != 4 or not all(x.isdigit() for x in parts[1:]) or int(parts[1]) not in HEADS:
            raise argparse.ArgumentTypeError(
                f"expected kv_dtype:gqa:batch:kv_len with gqa in {sorted(HEADS)}, got {item!r}")
        cases.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3])))
    return cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--only", default="split,layout,host", help="comma-separated: split, layout, cluster, host")
    p.add_argument("--splits", default=",".join(map(str, SPLITS)),
                   help="fixed_split_size values for the split sweep (tokens, comma-separated)")
    p.add_argument("--cases", default="",
                   help="split cases to run, by label, ';'-separated (e.g. 'bfloa gqa4 b=1 kv=2048'), of SPLIT_CASES "
                        "and FULL_GRID_CASES; default SPLIT_CASES")
    p.add_argument("--layout-cases", type=parse_layout_cases, default=[],
                   help="layout sweep cases, kv_dtype:gqa:batch:kv_len, comma-separated "
                        "(e.g. bfloat16:4:1:32768); default b=64 kv=4k bf16 and fp8")
    p.add_argument("--sets", type=int, default=0,
                   help="input sets to rotate over (default: enough for 4x L2; 1 keeps a small case in L2)")
    args = p.parse_args(argv)
    global FORCE_SETS
    FORCE_SETS = args.sets
    out_path = args.out or bc.default_out("sweep_decode.json")
    import torch

    if not torch.cuda.is_available():
        print("sweep_decode: no CUDA GPU visible", file=sys.stderr)
        return 2
    parts = set(args.only.split(","))
    layout_cases = args.layout_cases or LAYOUT_CASES
    t0 = time.perf_counter()
    only_cases = [c.strip() for c in args.cases.split(";") if c.strip()]
    build_modules(parts, layout_cases, only_cases)
    res = {"meta": bc.run_metadata(), "config": {"head_dim": HEAD_DIM, "page_size": PAGE_SIZE, "q": "bfloat16",
                                                 "page_table": "csr", "timed_by": "cuda-graph replay, median",
                                                 "sets": FORCE_SETS or "auto"}}
    res["copy"] = bc.copy_bandwidth()
    if "split" in parts:
        splits = tuple(int(x) for x in args.splits.split(",") if x)
        res["split"] = sweep_split(res["copy"]["gb_per_s"], splits, only_cases)
        bc.write_json(out_path, res)
    if "cluster" in parts:
        res["cluster"] = sweep_cluster(only_cases)
        bc.write_json(out_path, res)
    if "layout" in parts:
        res["layout"] = sweep_layout(layout_cases)
        bc.write_json(out_path, res)
    if "host" in parts:
        res["host"] = host_breakdown()
    res["seconds"] = time.perf_counter() - t0
    bc.write_json(out_path, res)
    for row in res.get("split", []):
        cells = ", ".join(f"{k} {v['median_us']:.1f}" + ("" if v["wrote_all"] and v.get("rel_diff", 0) < 1e-2 else " BAD")
                          for k, v in row["results"].items())
        print(f"{row['case']}: {cells}")
    for row in res.get("cluster", []):
        print(f"{row['case']}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["median_us"].items()) +
              ("" if row["ok"] else " BAD"))
    for row in res.get("layout", []):
        print(f"{row['case']}: {row['median_us']:.1f} us {row['tb_per_s']:.2f} TB/s wrote_all={row['wrote_all']}")
    if "host" in res:
        print("host:", res["host"])
    print(f"(JSON: {out_path}; {res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

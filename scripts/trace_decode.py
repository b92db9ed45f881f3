#!/usr/bin/env python3
"""Where a small-batch decode kernel's time goes: a timeline from %globaltimer stamps.

A diagnostic, not a benchmark. It copies the checkout to a temporary folder, adds stamps
to the tensor-core decode kernel there (thread 0 of every block writes the GPU's global
timer at fixed points into a __device__ array; the product's sources are not touched),
builds the two modules it needs into that folder's own cache, and replays run() in a
CUDA graph as scripts/bench_decode.py does (inputs rotating over > 4x L2, programmatic
dependent launch on). For the kernels of the last replay it prints, in microseconds from
the end of the kernel before (negative: the block was resident before that):

  entry      the block starts (under PDL, while the kernel before still runs)
  wait       griddepcontrol.wait returns (the kernel before has finished)
  tile0      warp 0's first K/V tile has arrived
  tile1..3   ... its second to fourth (blocks with that many tiles)
  loop_end   every warp of the block is done with its chunk
  warps      the block's warps have merged their states in shared memory
  partial    the block's output or partial state is written
  counted    the last block of a split request knows it is last (fence + atomic)
  weights    ... has the partials' LSEs and weights
  merged     ... has written the merged output: the kernel's end
  period     this kernel's end - the previous kernel's end (its share of a replay)

as min / median / max over blocks (the merge stamps over the last blocks only). --raw also
keeps every block's stamps of the first timed kernel (with its SM and grid position) in
the JSON, for per-block questions (which blocks finish last, and why).

    python3 scripts/trace_decode.py [--cases 'bfloat16:1:2048,float8_e4m3fn:1:2048'] [--graph-mode]
                                    [--sets 2] [--raw] [--out FILE]

Cases are kv dtype : batch : kv_len, GQA-4 (32/8 heads), head_dim 128, page 16, bf16 q,
CSR with permuted pages. Stamps cost a few registers and stores; compare periods with
the benchmark's times before reading much into differences under ~0.2 us.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOTS = 16  # stamps per block
KEYS = {0: "entry", 1: "wait", 2: "tile0", 11: "tile1", 12: "tile2", 13: "tile3", 3: "loop_end", 9: "warps",
        4: "partial", 5: "counted", 8: "weights", 6: "merged"}
MERGE_KEYS = (5, 8, 6)  # stamped by the last block of a split request only


def _instrument(root: Path) -> None:
    """Adds the stamps to root/csrc/decode_mma.cuh and the readers to the decode template.
    Each anchor must match once: a kernel edit that moves one fails here, loudly."""
    path = root / "csrc" / "decode_mma.cuh"
    s = path.read_text()

    def insert(anchor: str, code: str, before: bool = False) -> None:
        nonlocal s
        if s.count(anchor) != 1:
            raise SystemExit(f"trace_decode: anchor not found once in decode_mma.cuh: {anchor!r}")
        s = s.replace(anchor, code + anchor if before else anchor + code, 1)

    def stamp(k: int) -> str:
        return f"\n  if (threadIdx.x == 0) fij_trace[trace_base + {k}] = trace_now();\n"

    insert("namespace fij {\n", f"__device__ unsigned long long fij_trace[64 * 1024 * {SLOTS}];\n"
           "FIJ_DEVICE unsigned long long trace_now() {\n  unsigned long long t;\n"
           "  asm volatile(\"mov.u64 %0, %globaltimer;\" : \"=l\"(t));\n  return t;\n}\n")
    # a kernel's stamps go to slot (q address / 512) % 61 (the inputs' q tensors differ)
    insert("  if (static_cast<int>(blockIdx.y) >= num_items) return;",
           f"\n  const unsigned long long trace_base = ((reinterpret_cast<unsigned long long>(p.q) >> 9) % 61 * 1024 +"
           f" blockIdx.x + gridDim.x * blockIdx.y) * {SLOTS};\n"
           "  if (threadIdx.x == 0) {\n    fij_trace[trace_base + 7] = reinterpret_cast<unsigned long long>(p.q);\n"
           "    fij_trace[trace_base + 5] = fij_trace[trace_base + 6] = fij_trace[trace_base + 8] = 0;\n"
           "    unsigned smid;\n    asm volatile(\"mov.u32 %0, %smid;\" : \"=r\"(smid));\n"
           "    fij_trace[trace_base + 10] = smid;\n"
           "    fij_trace[trace_base + 14] = blockIdx.x;\n    fij_trace[trace_base + 15] = blockIdx.y;\n"
           "    fij_trace[trace_base + 0] = trace_now();\n  }\n")
    insert("  pdl_wait();\n", stamp(1))
    insert("    const unsigned char* ks = stage_k(tile % Traits::kStages);",
           "    if (tile == 0 && threadIdx.x == 0) fij_trace[trace_base + 2] = trace_now();\n"
           "    if (tile >= 1 && tile <= 3 && threadIdx.x == 0) fij_trace[trace_base + 10 + tile] = trace_now();\n",
           before=True)
    insert("  cp_async_wait<0>();\n  __syncthreads();  // every warp is done with the stages", stamp(3))
    insert("\n  // Thread -> (block row h, 4 dims)", stamp(9), before=True)
    insert("  if (partial_row < 0 || p.merge_counters == nullptr) return;",
           "  if (threadIdx.x == 0) fij_trace[trace_base + 4] = trace_now();\n", before=True)
    # the cluster split: states sent (partial), the cluster barrier passed (counted), merged
    insert("    // the barrier's release orders this block's remote stores before every block's acquire",
           "    if (threadIdx.x == 0) fij_trace[trace_base + 4] = trace_now();\n", before=True)
    insert("    cluster_arrive_release();\n    cluster_wait();\n",
           "    if (threadIdx.x == 0) fij_trace[trace_base + 5] = trace_now();\n")
    insert("    cluster_merge<Traits>(p, b, block_head0, rank, smem);\n",
           "    if (threadIdx.x == 0) fij_trace[trace_base + 6] = trace_now();\n")
    insert("  __syncthreads();\n  if (!last_block) return;", stamp(5))
    insert("  __syncthreads();\n  for (int slot_i = tid; slot_i < kSlotsT; slot_i += Traits::kThreads) {",
           "\n    if (slot_i == tid && tid == 0) fij_trace[trace_base + 8] = trace_now();")
    end = ("    if (p.lse != nullptr && x4 == 0) p.lse[b * p.num_qo_heads + qo_head] = empty ? -CUDART_INF_F : "
           "head_m[h] + log2f(den);\n  }\n")
    insert(end, "  __syncthreads();\n  if (threadIdx.x == 0) fij_trace[trace_base + 6] = trace_now();\n")
    path.write_text(s)
    template = root / "templates" / "decode.cu.j2"
    template.write_text(template.read_text() + f"""
FIJ_EXPORT int fij_trace_read(void* host, unsigned long long bytes) {{
  return static_cast<int>(cudaMemcpyFromSymbol(host, fij::fij_trace, bytes));
}}
FIJ_EXPORT int fij_trace_clear() {{
  static unsigned long long zeros[1024 * {SLOTS}] = {{}};
  for (int i = 0; i < 64; ++i) cudaMemcpyToSymbol(fij::fij_trace, zeros, sizeof(zeros), i * sizeof(zeros));
  return static_cast<int>(cudaGetLastError());
}}
""")


def _inner(cases: list[tuple[str, int, int]], out: str, use_cuda_graph: bool = False, sets: int = 0,
           raw: bool = False) -> int:
    """In the instrumented copy: build, replay, read the stamps, print the timeline."""
    import ctypes

    import numpy as np
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_common as bc
    import sweep_decode as sd

    if sets == 1:
        print("trace_decode: --sets 1 leaves no kernel before a kernel to time from; use 2", file=sys.stderr)
        return 1
    sd.FORCE_SETS = sets
    sd.MIN_SETS = 2  # a period needs the kernel before (a case over 12 GB still gets 2 sets)
    from flashinfer_jit.jit import build_many, get_module
    from flashinfer_jit.specs import DecodeSpec

    specs = {kv: DecodeSpec("bfloat16", kv, 128, 4, "csr", "NHD") for kv, _, _ in cases}
    report = build_many(sorted(set(specs.values()), key=lambda s: s.name), jobs=4)
    if report.failed:
        print(f"trace_decode: build failed: {dict(report.failed)}", file=sys.stderr)
        return 1
    result = {"meta": bc.run_metadata(), "units": "us from the previous kernel's end", "use_cuda_graph": use_cuda_graph,
              "sets": sets or "auto", "cases": {}}
    for kv, batch, kv_len in cases:
        module = get_module(specs[kv])
        lib = ctypes.CDLL(str(module.path / module.manifest["library"]))
        inputs = sd.Inputs(kv, 4, batch, kv_len)
        slots = [(s["q"].data_ptr() >> 9) % 61 for s in inputs.sets]
        if len(set(slots)) != len(slots):
            print(f"trace_decode: {kv}:{batch}:{kv_len}: two input sets share a stamp slot", file=sys.stderr)
            return 1
        w = inputs.wrapper(use_cuda_graph)

        def run(i, w=w, inputs=inputs):
            s = inputs.sets[i]
            w.run(s["q"], (s["k"], s["v"]), out=s["out"], enable_pdl=True)

        inner = inputs.n_sets * max(1, -(-8 // inputs.n_sets))
        graph = bc.capture_graph(run, inputs.n_sets, inner)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        assert lib.fij_trace_clear() == 0
        graph.replay()
        torch.cuda.synchronize()
        buf = np.zeros(64 * 1024 * SLOTS, dtype=np.uint64)
        assert lib.fij_trace_read(buf.ctypes.data_as(ctypes.c_void_p), ctypes.c_ulonglong(buf.nbytes)) == 0
        stamps = buf.reshape(64, 1024, SLOTS).astype(np.int64)
        # the last replay runs the sets in order: set i's kernel follows set i-1's
        kernels = [stamps[slot][stamps[slot][:, 0] != 0] for slot in slots]
        ends = [max(k[:, 4].max(), k[:, 6].max()) for k in kernels]
        rows = []
        for i in range(1, len(kernels)):
            k, e0 = kernels[i], ends[i - 1]
            last = k[k[:, 6] != 0]
            per_sm = np.bincount(k[:, 10], minlength=1)
            row = {"blocks": len(k), "last_blocks": len(last), "period": (ends[i] - e0) / 1e3,
                   "sms_used": int((per_sm > 0).sum()), "most_blocks_on_an_sm": int(per_sm.max())}
            # loop_end of the blocks by how many of this kernel's blocks shared their SM
            sharing = per_sm[k[:, 10]]
            row["loop_end_by_sharing"] = {int(n): float(np.median(k[sharing == n, 3] - e0)) / 1e3
                                          for n in np.unique(sharing)}
            for slot, name in KEYS.items():
                col = (last if slot in MERGE_KEYS else k)[:, slot]
                if slot in (11, 12, 13, *MERGE_KEYS):
                    col = col[col != 0]  # blocks with fewer tiles; merges without that step
                if len(col):
                    rel = col - e0  # int64: the timer (ns since an epoch) has no exact float64
                    row[name] = [rel.min() / 1e3, float(np.median(rel)) / 1e3, rel.max() / 1e3]
            if raw and i == 1:
                # per block: x, y (work item), SM, then stamps in us from e0 (0: not stamped)
                rel = np.where(k[:, [0, 1, 2, 11, 12, 13, 3, 9, 4]] != 0, k[:, [0, 1, 2, 11, 12, 13, 3, 9, 4]] - e0, 0)
                row["raw_columns"] = ["x", "y", "sm", "entry", "wait", "tile0", "tile1", "tile2", "tile3",
                                      "loop_end", "warps", "partial"]
                row["raw"] = [[int(x), int(y), int(sm), *[round(float(t) / 1e3, 3) for t in r]]
                              for x, y, sm, r in zip(k[:, 14], k[:, 15], k[:, 10], rel)]
            rows.append(row)
        label = f"{kv} b={batch} kv={kv_len}"
        scalars = ("blocks", "last_blocks", "period", "sms_used", "most_blocks_on_an_sm")
        median = {key: (float(np.median([r[key] for r in rows])) if key in scalars
                        else [float(np.median([r[key][j] for r in rows if key in r])) for j in range(3)])
                  for key in rows[0] if key not in ("loop_end_by_sharing", "raw", "raw_columns")}
        result["cases"][label] = {"median_over_kernels": median, "kernels": rows[:4]}
        print(f"\n{label}: {median['blocks']:.0f} blocks, {median['last_blocks']:.0f} merging; "
              f"period {median['period']:.2f} us (median over {len(rows)} kernels); on {median['sms_used']:.0f} SMs, "
              f"up to {median['most_blocks_on_an_sm']:.0f} on one")
        for name in KEYS.values():
            if name in median:
                lo, mid, hi = median[name]
                print(f"  {name:9s} {lo:8.2f} {mid:8.2f} {hi:8.2f}")
        for r in rows[:3]:
            print("  loop_end median by blocks sharing the SM: " +
                  ", ".join(f"{n}: {t:.2f}" for n, t in r["loop_end_by_sharing"].items()))
        del graph, w, inputs
        torch.cuda.empty_cache()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1, default=float))
    print(f"\n(JSON: {out})")
    return 0


def _parse_cases(text: str) -> list[tuple[str, int, int]]:
    cases = []
    for item in filter(None, (c.strip() for c in text.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in ("bfloat16", "float8_e4m3fn", "float8_e5m2") \
                or not all(x.isdigit() and int(x) > 0 for x in parts[1:]):
            raise argparse.ArgumentTypeError(f"--cases: expected kv_dtype:batch:kv_len items (kv_dtype bfloat16, "
                                             f"float8_e4m3fn or float8_e5m2; positive ints), got {item!r}")
        cases.append((parts[0], int(parts[1]), int(parts[2])))
    if not cases:
        raise argparse.ArgumentTypeError("--cases: no case given")
    return cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="bfloat16:1:2048,float8_e4m3fn:1:2048,bfloat16:1:32768",
                   help="kv_dtype:batch:kv_len, comma-separated")
    p.add_argument("--out", default=None)
    p.add_argument("--graph-mode", action="store_true",
                   help="the wrapper in CUDA-graph mode (use_cuda_graph=True, its grid padded to the capacity)")
    p.add_argument("--sets", type=int, default=0,
                   help="input sets to rotate over (default: > 4x L2; 2 keeps a small case in L2)")
    p.add_argument("--raw", action="store_true",
                   help="also keep every block's stamps (and SM, work item) of the first timed kernel in the JSON")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        cases = _parse_cases(args.cases)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_common as bc

    out = args.out or bc.default_out("trace_decode.json")
    if args.inner:
        return _inner(cases, out, args.graph_mode, args.sets, args.raw)
    with tempfile.TemporaryDirectory(prefix="fij_trace_") as tmp:
        copy = Path(tmp) / "src"
        for name in ("csrc", "templates", "flashinfer_jit", "scripts"):
            shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
        _instrument(copy)
        env = dict(os.environ, PYTHONPATH=str(copy), FLASHINFER_JIT_CACHE_DIR=str(Path(tmp) / "cache"))
        cmd = [sys.executable, str(copy / "scripts" / "trace_decode.py"), "--inner", "--cases", args.cases,
               *(["--graph-mode"] if args.graph_mode else []), *(["--raw"] if args.raw else []),
               "--sets", str(args.sets),
               "--out", str(Path(out).resolve())]
        return subprocess.call(cmd, env=env, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())

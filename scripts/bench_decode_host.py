#!/usr/bin/env python3
"""Host cost of the decode wrapper (BatchDecodeWithPagedKVCacheWrapper): plan() and run().

The issue's targets: plan() makes at most one host-to-device copy and costs <= 50 us on
the host for 256 requests; run() adds <= 10 us of host time to the op call. Measured:
  (a) plan() for 256 requests x 2048 tokens, page 16, 32 query / 8 KV heads, head_dim
      128, bf16, CSR page table with host int32 indptr / last_page_len and the indices
      on the device; two batches of slightly different lengths alternate (lengths change
      at every decode step, so nothing may be cached by value). Also in CUDA-graph mode,
      and both again on the numpy path (FLASHINFER_JIT_NATIVE_PLAN=0) the C++ planner replaced.
      Without a GPU everything (indices, workspace) lives on the CPU.
  (b) run() with the op replaced by a no-op (jit's module is never loaded): the Python
      overhead alone, b=1 and b=256, with out= given and with out allocated by run().
      Without a GPU the CUDA-device check is replaced by a same-device check.
  (c) with a GPU: run()'s real enqueue time (no sync inside a round) for b=1 and b=64
      x 2048 tokens, one bare torch launch for scale, and FlashInfer's plan() and run()
      where `import flashinfer` works. Our decode module and FlashInfer's compile at
      first use unless cached (AOT: `flashinfer-jit aot`), which can take longer than
      this script's own few seconds; --no-flashinfer skips FlashInfer.
Each figure is time.perf_counter_ns over n calls per round, median (and min) over
rounds. On the GPU VMs the same code measures up to 1.5x apart from run to run (CPU
clock and neighbours): compare figures from one run (e.g. against FlashInfer's).

Writes JSON (--out, default $OUT/bench_decode_host.json, else bench_results/) and prints
a short summary.
  python3 scripts/bench_decode_host.py [--out FILE] [--rounds N] [--no-flashinfer]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (also puts the repository on sys.path)
import torch  # noqa: E402

import flashinfer_jit as fij  # noqa: E402
from flashinfer_jit.decode import wrapper as decode_mod  # noqa: E402

HQ, HK, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
PLAN_BATCH, KV_LEN = 256, 2048
DTYPE = torch.bfloat16
WORKSPACE_BYTES = 128 << 20


def per_call_us(fn, n: int, rounds: int, sync=None, calls_per_fn: int = 1) -> dict:
    """Host µs per call: n calls per round (timed without any sync), median of rounds;
    `sync` runs between rounds, outside the clock."""
    for _ in range(min(n, 50)):
        fn()
    if sync:
        sync()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        t1 = time.perf_counter_ns()
        if sync:
            sync()
        samples.append((t1 - t0) / (n * calls_per_fn) / 1e3)
    return {"median_us": statistics.median(samples), "min_us": min(samples), "calls": n * calls_per_fn,
            "rounds": rounds}


def csr_batch(batch: int, kv_len: int, device, jitter: int = 0, seed: int = 0) -> dict:
    """CSR page table: indptr and last_page_len on the host (as serving engines keep
    them), indices on `device`. jitter > 0 adds 0..jitter tokens per request."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.full((batch,), kv_len, dtype=torch.int64)
    if jitter:
        lens += torch.randint(0, jitter + 1, (batch,), generator=gen)
    pages = (lens + PAGE_SIZE - 1) // PAGE_SIZE
    indptr = torch.zeros(batch + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    last = (lens - (pages - 1) * PAGE_SIZE).to(torch.int32)
    indices = torch.randperm(int(pages.sum()), generator=gen).to(torch.int32).to(device)
    return dict(indptr=indptr, indices=indices, last_page_len=last, num_pages=int(pages.sum()))


def plan_args(t: dict) -> tuple:
    return (t["indptr"], t["indices"], t["last_page_len"], HQ, HK, HEAD_DIM, PAGE_SIZE)


def make_wrapper(lib, device, graph_capacity: int | None = None, num_pages: int = 0):
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    if graph_capacity is None:
        return lib.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    buf = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
    return lib.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=buf(graph_capacity + 1),
        paged_kv_indices_buffer=buf(num_pages), paged_kv_last_page_len_buffer=buf(graph_capacity))


# --- (a) plan ----------------------------------------------------------------------------------
def bench_plan(lib, device, rounds: int, sync, graph: bool = False) -> dict:
    a = csr_batch(PLAN_BATCH, KV_LEN, device, seed=1)
    b = csr_batch(PLAN_BATCH, KV_LEN, device, jitter=16, seed=2)
    num_pages = max(a["num_pages"], b["num_pages"])
    wrapper = make_wrapper(lib, device, PLAN_BATCH if graph else None, num_pages)
    args_a, args_b = plan_args(a), plan_args(b)

    def two_plans():
        wrapper.plan(*args_a, q_data_type=DTYPE, kv_data_type=DTYPE)
        wrapper.plan(*args_b, q_data_type=DTYPE, kv_data_type=DTYPE)

    return per_call_us(two_plans, 100, rounds, sync, calls_per_fn=2)


# --- (b) and (c) run ---------------------------------------------------------------------------
def run_inputs(batch: int, device) -> tuple:
    t = csr_batch(batch, KV_LEN, device, seed=3)
    q = torch.randn(batch, HQ, HEAD_DIM, device=device).to(DTYPE)
    shape = (t["num_pages"], PAGE_SIZE, HK, HEAD_DIM)
    # torch.empty: pages are never read here (stub) or their values do not matter (enqueue)
    k, v = torch.empty(shape, dtype=DTYPE, device=device), torch.empty(shape, dtype=DTYPE, device=device)
    return t, q, (k, v)


def bench_run(lib, batch: int, device, rounds: int, sync, n: int) -> dict:
    t, q, cache = run_inputs(batch, device)
    wrapper = make_wrapper(lib, device)
    wrapper.plan(*plan_args(t), q_data_type=DTYPE, kv_data_type=DTYPE)
    out = torch.empty_like(q)
    return {"out_given": per_call_us(lambda: wrapper.run(q, cache, out=out), n, rounds, sync),
            "out_allocated": per_call_us(lambda: wrapper.run(q, cache), n, rounds, sync)}


def _noop(*args):
    return None


class StubbedOp:
    """The decode op replaced by a no-op (and, without a GPU, the CUDA-device check by a
    same-device one) for the duration of a with-block."""

    def __enter__(self):
        self.saved = {name: getattr(decode_mod, name) for name in ("module_op", "fast_entry", "same_cuda_device")}
        decode_mod.module_op = lambda spec, name, debug: _noop
        decode_mod.fast_entry = lambda spec, family, debug: None
        if not torch.cuda.is_available():
            decode_mod.same_cuda_device = lambda ts: all(t.device == ts[0].device for t in ts)
        return self

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            setattr(decode_mod, name, value)


def flashinfer_or_reason():
    try:
        import flashinfer  # noqa: PLC0415
        return flashinfer, None
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"[:300]


def _guard(fn, *args, **kwargs) -> dict:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/bench_decode_host.json)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer even where it imports")
    args = p.parse_args()
    out_path = args.out or bc.default_out("bench_decode_host.json")
    started = time.perf_counter()
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    sync = torch.cuda.synchronize if gpu else None
    res = {"meta": bc.run_metadata() | {"device_kind": device.type}, "plan_256": {}, "run_stub": {},
           "run_enqueue": {}}

    res["plan_256"]["ours"] = _guard(bench_plan, fij, device, args.rounds, sync)
    res["plan_256"]["ours_cuda_graph"] = _guard(bench_plan, fij, device, args.rounds, sync, graph=True)
    # the same plans on the numpy path (FLASHINFER_JIT_NATIVE_PLAN=0), the C++ planner's reference
    with mock.patch.dict(os.environ, {"FLASHINFER_JIT_NATIVE_PLAN": "0"}):
        res["plan_256"]["ours_numpy"] = _guard(bench_plan, fij, device, args.rounds, sync)
        res["plan_256"]["ours_numpy_cuda_graph"] = _guard(bench_plan, fij, device, args.rounds, sync, graph=True)
    with StubbedOp():
        for batch in (1, PLAN_BATCH):
            res["run_stub"][f"b={batch}"] = _guard(bench_run, fij, batch, device, args.rounds, sync, 2000)

    if gpu:
        fi, reason = (None, "--no-flashinfer") if args.no_flashinfer else flashinfer_or_reason()
        res["flashinfer"] = getattr(fi, "__version__", "?") if fi else reason
        for batch in (1, 64):
            row = res["run_enqueue"][f"b={batch}"] = {"ours": _guard(bench_run, fij, batch, device, args.rounds,
                                                                     sync, 200)}
            if fi is not None:
                row["flashinfer"] = _guard(bench_run, fi, batch, device, args.rounds, sync, 200)
        if fi is not None:
            res["plan_256"]["flashinfer"] = _guard(bench_plan, fi, device, args.rounds, sync)
        buf = torch.zeros(1, device=device)
        res["one_torch_launch_us"] = per_call_us(lambda: buf.add_(1), 200, args.rounds, sync)["median_us"]
    res["seconds"] = time.perf_counter() - started
    bc.write_json(out_path, res)
    print(summary(res))
    print(f"wrote {out_path}")
    return 0


def summary(res: dict) -> str:
    def fmt(r):
        return f"{r['median_us']:.1f} us (min {r['min_us']:.1f})" if "median_us" in r else r.get("error", "?")

    meta = res["meta"]
    lines = [f"decode host costs on {meta.get('device', 'CPU only')} ({meta['host']}, Python {meta['python']}, "
             f"torch {meta['torch']}), {res['seconds']:.0f} s"]
    for impl, r in res["plan_256"].items():
        lines.append(f"  plan() 256 x {KV_LEN} tokens, {impl}: {fmt(r)}")
    for label, r in res["run_stub"].items():
        lines.append(f"  run() Python overhead (no-op op), {label}: out given {fmt(r.get('out_given', r))}, "
                     f"out allocated {fmt(r.get('out_allocated', r))}")
    for label, impls in res["run_enqueue"].items():
        for impl, r in impls.items():
            lines.append(f"  run() enqueue {label} x {KV_LEN}, {impl}: out given {fmt(r.get('out_given', r))}, "
                         f"out allocated {fmt(r.get('out_allocated', r))}")
    if "one_torch_launch_us" in res:
        lines.append(f"  one bare torch launch: {res['one_torch_launch_us']:.1f} us")
    if "flashinfer" in res:
        lines.append(f"  flashinfer: {res['flashinfer']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

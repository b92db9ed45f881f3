#!/usr/bin/env python3
"""Benchmark batch decode (BatchDecodeWithPagedKVCacheWrapper) against the copy ceiling and FlashInfer.

Measures, in one process on one GPU (issue 4):
  - the copy-bandwidth ceiling (bench_common.copy_bandwidth: torch copy_ of 1 GiB);
  - decode with bf16 q, head_dim 128, page 16, NHD, CSR page table, bf16 and fp8 e4m3 KV,
    GQA-4 (32 query / 8 KV heads) and GQA-8 (64 / 8), batch 1/16/64/256 x kv_len
    512/2k/4k/8k/32k (a case whose K+V cache would exceed --max-cache-gb is skipped and
    listed), and the skewed mix (56 requests of 256 tokens + 8 of 8k, bf16, GQA-4);
  - per case: device time of one run() by CUDA-graph replay (plan() outside the graph;
    inputs rotate among several cache sets where they fit, so a round touches >= 4x L2),
    achieved bandwidth = (K and V bytes each request reads, at the KV dtype, + q + out
    bytes) / time, its fraction of the copy ceiling, and the speedup over FlashInfer's
    wrapper on the same inputs (use_tensor_cores False and True: each, and the faster);
    a replay is checked to have written every output row, and FlashInfer's output is
    compared with ours;
  - per uniform bf16 case, the same requests on a dense K/V cache ([B, H_kv, L, D], gathered
    from the paged one, so the outputs are compared with ours), and ours on the same cache
    read in page order (an identity page table: what the random one costs): torch's
    scaled_dot_product_attention with each of its cuDNN, flash and memory-efficient backends
    (enable_gqa for grouped heads), and a plain PyTorch reference (two matmuls and a float32
    softmax), timed the same way (fp8 K/V and the skewed mix have no dense peer; a dense
    copy over --sdpa-max-gb is skipped; each says why);
  - host time of plan() for 256 requests and host time of run() (ours and FlashInfer).

FlashInfer is optional: the carried peer on PYTHONPATH (.peers/site; scripts/gpu_check.sh
sets it for benchmark processes). Its decode modules compile at first use (~20-40 s) in
background processes while our kernels are measured (FLASHINFER_WORKSPACE_BASE: a temp
folder unless set). Without it the FlashInfer columns say why.

Writes JSON (--out, default $OUT/bench_decode.json) and prints the table last.
  PYTHONPATH=.peers/site python3 scripts/bench_decode.py [--quick] [--time-limit S] [--out FILE]
  python3 scripts/bench_decode.py --list     (the cases and skips; no GPU needed)
  python3 scripts/bench_decode.py --cases 'bf16 gqa4 b=256 kv=32k;bf16 gqa8 b=256 kv=32k' --max-cache-gb 40
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (also puts the repository on sys.path)

HEAD_DIM, PAGE_SIZE = 128, 16
# group -> (num_qo_heads, num_kv_heads). The issue's table is GQA-4 and GQA-8 (8 KV heads,
# Llama-3-like); --groups 1,2 adds MHA (32/32, Llama-2-7B-like) and group 2 (32/16), whose
# 1- and 2-head tiles run on the same tensor-core kernel.
GQA_HEADS = {1: (32, 32), 2: (32, 16), 4: (32, 8), 8: (64, 8)}
ISSUE_GROUPS = (4, 8)
Q_DTYPE = "bfloat16"
KV_DTYPES = ("bfloat16", "float8_e4m3fn")
BATCHES = (1, 16, 64, 256)
KV_LENS = (512, 2048, 4096, 8192, 32768)
SKEWED = (56, 256, 8, 8192)  # 56 requests of 256 tokens + 8 of 8k
WORKSPACE_BYTES = 256 << 20
RESERVE_S = 25.0  # left at the end for host timings and the report

# Issue 4's targets (FlashInfer 0.5.3 on this H100: b=64 kv=4k 362 µs, fp8 459 µs,
# skewed 151 µs, b=1 2k 10.5 µs, b=1 32k 55 µs, b=256 kv=512 190 µs).
TARGETS = {
    ("bfloat16", 4, 1, 2048): ("max_us", 7.0),
    ("bfloat16", 4, 1, 32768): ("max_us", 48.0),
    ("float8_e4m3fn", 4, 64, 4096): ("max_us", 190.0),
    ("bfloat16", 4, "skewed"): ("min_speedup", 1.25),
}

FLASHINFER_WARMUP = r"""
import json, sys, time
t0 = time.perf_counter()
try:
    import torch, flashinfer
    kv_dtype, tensor_cores = getattr(torch, sys.argv[1]), sys.argv[2] == "1"
    ws = torch.zeros(16 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    indptr, last = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    indices = torch.zeros(1, dtype=torch.int32, device="cuda")
    cache = torch.randn(2, 16, 8, 128, device="cuda").to(kv_dtype)
    for hq in (32, 64):
        w.plan(indptr, indices, last, hq, 8, 128, 16, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
        w.run(torch.randn(1, hq, 128, device="cuda", dtype=torch.bfloat16), (cache, cache))
    torch.cuda.synchronize()
    print(json.dumps({"ok": True, "version": getattr(flashinfer, "__version__", "?"),
                      "seconds": time.perf_counter() - t0}))
except BaseException as exc:  # report anything, never hang the benchmark
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[-3000:]}))
"""


class Case(NamedTuple):
    kv_dtype: str
    gqa: int
    batch: int
    kv_len: int | None  # None: the skewed mix
    lens: tuple

    @property
    def label(self) -> str:
        kv = _kib(self.kv_len) if self.kv_len else f"{SKEWED[0]}x{_kib(SKEWED[1])}+{SKEWED[2]}x{_kib(SKEWED[3])}"
        return f"{_short(self.kv_dtype)} gqa{self.gqa} b={self.batch} kv={kv}"

    def cache_bytes(self) -> int:
        item = 1 if self.kv_dtype.startswith("float8") else 2
        return 2 * sum(self.lens) * GQA_HEADS[self.gqa][1] * HEAD_DIM * item

    def bytes_moved(self) -> int:
        """K and V rows each request reads (KV dtype) + q read + out written (bf16)."""
        hq = GQA_HEADS[self.gqa][0]
        return self.cache_bytes() + 2 * self.batch * hq * HEAD_DIM * 2


def _kib(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float8_e4m3fn": "e4m3"}[dtype]


def uniform(kv_dtype, gqa, batch, kv_len) -> Case:
    return Case(kv_dtype, gqa, batch, kv_len, (kv_len,) * batch)


def skewed() -> Case:
    short_n, short_len, long_n, long_len = SKEWED
    lens = [short_len] * short_n + [long_len] * long_n
    random.Random(0).shuffle(lens)
    return Case("bfloat16", 4, short_n + long_n, None, tuple(lens))


def case_list(quick: bool, groups=ISSUE_GROUPS) -> list[Case]:
    """The issue's reference rows first (measured even when time runs short), then the rest;
    only rows of the given GQA groups."""
    first = [uniform("bfloat16", 4, 64, 4096), uniform("float8_e4m3fn", 4, 64, 4096), skewed(),
             uniform("bfloat16", 4, 1, 2048), uniform("bfloat16", 4, 1, 32768), uniform("bfloat16", 4, 256, 512)]
    if quick:
        rest = [uniform(kv, 4, b, n) for kv in KV_DTYPES for b, n in ((1, 2048), (1, 8192), (64, 2048), (64, 8192))]
        rest += [uniform("float8_e4m3fn", 4, 1, 32768), uniform("bfloat16", 8, 64, 4096)]
    else:
        rest = [uniform(kv, gqa, b, n) for kv in KV_DTYPES for gqa in groups for b in BATCHES for n in KV_LENS]
    if quick and tuple(groups) != ISSUE_GROUPS:
        rest += [uniform(kv, gqa, b, n) for kv in KV_DTYPES for gqa in groups for b, n in ((1, 2048), (64, 4096))]
    cases = []
    for c in first + rest:
        if c.gqa in groups and c not in cases:
            cases.append(c)
    return cases


# --- FlashInfer in the background ---------------------------------------------------------------
class Peer:
    """FlashInfer's four decode modules (bf16 / fp8 KV x CUDA-core / tensor-core path),
    each built by a background process's first plan()."""

    def __init__(self, enabled: bool, timeout: float):
        self.info: dict = {"available": False}
        self.module = None
        self.procs = {}
        self.started = time.perf_counter()
        self.timeout = timeout
        if not enabled:
            self.info["reason"] = "--no-flashinfer"
            return
        if importlib.util.find_spec("flashinfer") is None:
            self.info["reason"] = "flashinfer not importable (carry .peers and run with PYTHONPATH=.peers/site)"
            return
        os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", tempfile.mkdtemp(prefix="flashinfer_ws_"))
        self.info["workspace"] = os.environ["FLASHINFER_WORKSPACE_BASE"]
        env = dict(os.environ)
        paths = env.get("PYTHONPATH", "").split(os.pathsep)  # made absolute, in case it was given relative
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in paths if p)
        env.setdefault("MAX_JOBS", "8")  # four builds at once on 16 cores
        for kv in KV_DTYPES:
            for tc in (0, 1):
                self.procs[(kv, tc)] = subprocess.Popen(
                    [sys.executable, "-c", FLASHINFER_WARMUP, kv, str(tc)], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True, cwd=bc.REPO, env=env)
        bc.log("flashinfer: building its decode modules in the background")

    def done(self) -> bool:
        return all(p.poll() is not None for p in self.procs.values())

    def ready(self, deadline: float):
        """The flashinfer module once every warm-up has finished (None if it failed or
        did not finish by min(deadline, start + timeout); why goes to self.info)."""
        if self.module is not None or not self.procs:
            return self.module
        stop = min(deadline, self.started + self.timeout)
        builds = {}
        for (kv, tc), proc in self.procs.items():
            try:
                out, err = proc.communicate(timeout=max(1.0, stop - time.perf_counter()))
            except subprocess.TimeoutExpired:
                for p in self.procs.values():
                    p.kill()
                    p.communicate()
                self.procs = {}
                self.info["reason"] = f"first-use build did not finish in {stop - self.started:.0f} s"
                bc.log(f"flashinfer: {self.info['reason']}")
                return None
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            builds[f"{kv} tensor_cores={bool(tc)}"] = json.loads(lines[-1]) if lines else \
                {"ok": False, "error": err[-2000:]}
        self.procs = {}
        self.info["builds"] = builds
        self.info["build_wall_s"] = time.perf_counter() - self.started
        failed = {k: v.get("error", "?")[-400:] for k, v in builds.items() if not v.get("ok")}
        if failed:
            self.info["failed"] = failed
            bc.log(f"flashinfer: warm-up failed for {sorted(failed)}")
        try:
            import flashinfer

            self.module = flashinfer
            self.info.update(available=True, version=getattr(flashinfer, "__version__", "?"))
        except Exception as exc:  # noqa: BLE001  (a peer failing must not end the benchmark)
            self.info["reason"] = f"import failed: {type(exc).__name__}: {exc}"[:800]
        return self.module


# --- inputs ---------------------------------------------------------------------------------------
class Inputs:
    """One case's page table and `n_sets` (q, K cache, V cache, out) sets; every set uses
    the same page table (so one plan() serves all), its pages randomly permuted."""

    def __init__(self, case: Case, n_sets: int, seed: int):
        import torch

        self.case, self.n_sets = case, n_sets
        hq, hk = GQA_HEADS[case.gqa]
        gen = torch.Generator().manual_seed(seed)
        lens = torch.tensor(case.lens, dtype=torch.int64)
        pages = (lens + PAGE_SIZE - 1) // PAGE_SIZE
        self.num_pages = int(pages.sum())
        indptr = torch.zeros(case.batch + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(pages, 0)
        self.indptr = indptr  # host, as serving engines keep it
        self.last_page_len = (lens - (pages - 1) * PAGE_SIZE).to(torch.int32)
        self.indices = torch.randperm(self.num_pages, generator=gen).to(torch.int32).cuda()
        kv_dtype = getattr(torch, case.kv_dtype)
        shape = (self.num_pages, PAGE_SIZE, hk, HEAD_DIM)
        self.sets = [dict(q=torch.randn(case.batch, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                          k=_random_cache(shape, kv_dtype), v=_random_cache(shape, kv_dtype),
                          out=torch.empty(case.batch, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
                     for _ in range(n_sets)]

    def plan_args(self):
        hq, hk = GQA_HEADS[self.case.gqa]
        return (self.indptr, self.indices, self.last_page_len, hq, hk, HEAD_DIM, PAGE_SIZE)

    def in_page_order(self) -> "Inputs":
        """The same sets and lengths with an identity page table (outputs differ: other
        tokens sit at each position)."""
        import copy

        import torch

        alt = copy.copy(self)
        alt.indices = torch.arange(self.num_pages, dtype=torch.int32, device=self.indices.device)
        return alt

    def release(self):
        self.sets = None


def _random_cache(shape, dtype, chunk_pages: int = 1 << 15):
    """Random values (never zeros), filled in chunks so an 8 GB fp8 cache needs no
    second 8 GB of bf16 staging."""
    import torch

    cache = torch.empty(shape, dtype=dtype, device="cuda")
    for start in range(0, shape[0], chunk_pages):
        part = cache[start:start + chunk_pages]
        if dtype.itemsize == 1:
            part.copy_(torch.randn(part.shape, device="cuda", dtype=torch.bfloat16))
        else:
            part.normal_()
    return cache


# --- implementations ------------------------------------------------------------------------------
def make_runner(impl: str, inputs: Inputs, fi, graph_mode: bool = False):
    """(plan thunk, run(set_index)) for 'ours', 'ours_pages_as_given' (plan(sort_pages=False):
    the pages in the page table's order, as FlashInfer reads them) or 'flashinfer_cc' /
    'flashinfer_tc'."""
    import torch

    import flashinfer_jit as fij

    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    kv_dtype = getattr(torch, inputs.case.kv_dtype)
    ours = impl in ("ours", "ours_pages_as_given")
    if ours:
        kwargs = bc.cuda_graph_buffers(inputs.case.batch, inputs.num_pages) if graph_mode else {}
        wrapper = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **kwargs)
    else:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=impl == "flashinfer_tc")

    extra = dict(sort_pages=impl == "ours") if ours else {}

    def plan():
        wrapper.plan(*inputs.plan_args(), q_data_type=torch.bfloat16, kv_data_type=kv_dtype, **extra)

    def run(i):
        s = inputs.sets[i]
        wrapper.run(s["q"], (s["k"], s["v"]), out=s["out"])

    return plan, run


# --- dense peers: torch's SDPA backends and a plain PyTorch reference ----------------------------
# A dense engine keeps each request's K and V contiguous ([B, H_kv, L, D]), so these read the
# same bytes as the paged decode without its page table. Our output is the reference.
SDPA_BACKENDS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION"}
DENSE_IMPLS = (*SDPA_BACKENDS, "torch_eager")


def dense_from_paged(cache, pages, kv_len: int):
    """[B, H_kv, kv_len, D] from a paged NHD cache [num_pages, page, H_kv, D] and each
    request's page ids [B, pages a request] (uniform lengths), a request at a time so the
    staging stays one request's size."""
    import torch

    batch, heads, dim = pages.shape[0], cache.shape[2], cache.shape[3]
    dense = torch.empty(batch, heads, kv_len, dim, dtype=cache.dtype, device=cache.device)
    for b in range(batch):
        dense[b].copy_(cache[pages[b]].reshape(-1, heads, dim)[:kv_len].transpose(0, 1))
    return dense


def eager_attention(q, k, v):
    """The plain PyTorch reference: q [B, H_qo, 1, D], k/v [B, H_kv, L, D] (H_qo a multiple
    of H_kv, grouped by reshaping q, no copy of K/V), scores and softmax in float32, the
    probabilities back in q's dtype for the second matmul. Returns [B, H_qo, 1, D]."""
    import torch

    batch, hq, _, dim = q.shape
    hk = k.shape[1]
    qg = q.reshape(batch, hk, hq // hk, dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * dim ** -0.5
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).reshape(batch, hq, 1, dim)


def dense_skip_reason(case: Case, max_gb: float) -> str | None:
    if case.kv_len is None:
        return "variable lengths: a dense cache would pad every request to the longest"
    if case.kv_dtype != "bfloat16":
        return f"scaled_dot_product_attention takes no {case.kv_dtype} K/V"
    if case.cache_bytes() > max_gb * 1e9:
        return f"dense K/V copy {case.cache_bytes() / 1e9:.1f} GB > --sdpa-max-gb {max_gb:g}"
    return None


class DenseInputs:
    """The paged sets' requests as dense K/V (the same values) and q as [B, H_qo, 1, D];
    "out" holds the last output a run() returned for the set."""

    def __init__(self, paged: Inputs, n_sets: int):
        self.case, self.n_sets = paged.case, n_sets
        pages = paged.indices.long().view(paged.case.batch, -1)
        self.sets = [dict(q=s["q"].unsqueeze(2), k=dense_from_paged(s["k"], pages, paged.case.kv_len),
                          v=dense_from_paged(s["v"], pages, paged.case.kv_len), out=None)
                     for s in paged.sets[:n_sets]]

    def release(self):
        self.sets = None


def make_dense_runner(impl: str, dense: DenseInputs):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hk = GQA_HEADS[dense.case.gqa]
    if impl == "torch_eager":
        attend = eager_attention
    else:
        backend = getattr(SDPBackend, SDPA_BACKENDS[impl])

        def attend(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hk)

    def run(i):
        s = dense.sets[i]
        s["out"] = attend(s["q"], s["k"], s["v"])

    return (lambda: None), run


def measure_dense(row: dict, inputs: Inputs, reps: int, copy_gbps: float, reference, max_gb: float) -> None:
    """The dense peers on this case's requests (set 0's output checked against ours)."""
    import torch

    n_sets = max(1, min(inputs.n_sets, int(max_gb * 1e9 // max(1, inputs.case.cache_bytes()))))
    reason = dense_skip_reason(inputs.case, max_gb)
    if reason is None and reference is None:
        reason = "no output of ours to compare with"
    if reason is not None:
        for impl in DENSE_IMPLS:
            row["impls"][impl] = {"skipped": reason}
        return
    # Ours on the same caches read in page order (an identity page table: each request's
    # tokens contiguous, as a dense [B, L, H_kv, D] cache): what the scrambled table costs.
    row["impls"]["ours_pages_in_order"] = measure("ours", inputs.in_page_order(), None, reps, copy_gbps)
    dense = DenseInputs(inputs, n_sets)
    for impl in DENSE_IMPLS:
        row["impls"][impl] = measure(impl, dense, None, reps, copy_gbps, reference) | {"input_sets": n_sets}
    dense.release()
    torch.cuda.empty_cache()
    _fastest_peer(row, SDPA_BACKENDS, "sdpa")
    ours = row["impls"].get("ours", {}).get("median_us")
    eager = row["impls"]["torch_eager"].get("median_us")
    if ours and eager:
        row["speedup_vs_torch_eager"] = eager / ours


def _fastest_peer(row: dict, impls, name: str) -> None:
    """row[name + "_best"]: the fastest of the peers `impls` measured in the row, and
    row["speedup_vs_" + name + "_best"]: its µs over ours (> 1: ours faster)."""
    ours = row["impls"].get("ours", {}).get("median_us")
    times = {k: row["impls"][k].get("median_us") for k in impls}
    times = {k: v for k, v in times.items() if v}
    if ours and times:
        best = min(times, key=times.get)
        row[f"{name}_best"] = best
        row[f"speedup_vs_{name}_best"] = times[best] / ours


def measure(impl: str, inputs: Inputs, fi, reps: int, copy_gbps: float, reference=None, graph_mode=False,
            keep_output=False) -> dict:
    """Plan, capture `inner` run() calls (all sets) in a CUDA graph, check one replay wrote
    every output row of set 0 (and matches `reference` if given), then time replays.
    keep_output: return set 0's output as "_out0" (the reference for FlashInfer)."""
    import torch

    try:
        plan, run = make_dense_runner(impl, inputs) if impl in DENSE_IMPLS else make_runner(impl, inputs, fi, graph_mode)
        plan()
        heavy = inputs.case.bytes_moved() > (1 << 30)
        inner = inputs.n_sets * max(1, math.ceil((2 if heavy else 8) / inputs.n_sets))
        graph = bc.capture_graph(run, inputs.n_sets, inner)
        out0 = inputs.sets[0]["out"]  # a dense peer's: set 0's output of its last captured call
        out0.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        wrote = not bool(torch.isnan(out0).any())
        result = {}
        if reference is not None:
            diff = float((out0.float().reshape(reference.shape) - reference.float()).norm() / reference.float().norm())
            result["rel_diff_vs_ours"] = diff
            result["agrees_with_ours"] = diff < 2e-2
        if keep_output:
            result["_out0"] = out0.clone()
        t = bc.time_graph(graph, inner, reps=reps)
        del graph
    except Exception as exc:  # noqa: BLE001  (one failing case must not end the run)
        bc.log(f"{impl} {inputs.case.label}: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"[:800]}
    gb = bc.gbps(inputs.case.bytes_moved(), t["median_us"])
    return result | {"median_us": t["median_us"], "gb_per_s": gb, "frac_copy": gb / copy_gbps,
                     "replay_wrote_output": wrote, "timed_by": "cuda-graph replay", "timing": t}


FI_IMPLS = ("flashinfer_cc", "flashinfer_tc")


def measure_flashinfer(row: dict, inputs: Inputs, fi, reps: int, copy_gbps: float, reference) -> None:
    for impl in FI_IMPLS:
        row["impls"][impl] = measure(impl, inputs, fi, reps, copy_gbps, reference)
    _fastest_peer(row, FI_IMPLS, "flashinfer")
    ours = row["impls"].get("ours", {}).get("median_us")
    if "flashinfer_best" in row:
        row["speedup_vs_flashinfer"] = {k: row["impls"][k]["median_us"] / ours for k in FI_IMPLS
                                        if row["impls"][k].get("median_us")}


# --- host costs -----------------------------------------------------------------------------------
def enqueue_us(fn, n: int = 200, rounds: int = 5) -> float:
    """Host µs per call while the device lags behind (no sync inside a round): the
    Python + launch cost alone, as long as n calls fit the launch queue."""
    import statistics

    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def bench_host(fi) -> dict:
    """plan() for 256 requests x 2k tokens, and run() host time (b=1 kv=16, and b=64
    kv=4k), ours and FlashInfer's, measured after every build has finished."""
    import torch

    out = {"plan_256_requests": {}, "run": {}}
    big = Inputs(uniform("bfloat16", 4, 256, 2048), 1, seed=3)
    impls = ["ours"] + (list(FI_IMPLS) if fi is not None else [])
    for impl in ["ours_pages_as_given", *impls]:  # (as given: plan() without its reordering launch)
        try:
            plan, _ = make_runner(impl, big, fi)
            out["plan_256_requests"][impl] = bc.time_host(plan, 200, sync_each=False) | \
                {"sync_each": bc.time_host(plan, 50, sync_each=True)["median_us"]}
        except Exception as exc:  # noqa: BLE001
            out["plan_256_requests"][impl] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    big.release()
    for label, case in (("b=1 kv=16", uniform("bfloat16", 4, 1, 16)), ("b=64 kv=4k", uniform("bfloat16", 4, 64, 4096))):
        inputs = Inputs(case, 1, seed=4)
        out["run"][label] = {}
        for impl in impls:
            try:
                plan, run = make_runner(impl, inputs, fi)
                plan()
                call = lambda: run(0)  # noqa: E731
                out["run"][label][impl] = {"enqueue_us": enqueue_us(call),
                                           "wall_us_no_sync": bc.time_host(call, 500, sync_each=False)["median_us"]}
            except Exception as exc:  # noqa: BLE001
                out["run"][label][impl] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        inputs.release()
    buf = torch.zeros(1, device="cuda")
    out["one_torch_launch_enqueue_us"] = enqueue_us(lambda: buf.add_(1))
    torch.cuda.empty_cache()
    return out


# --- the run ---------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help="the issue's reference rows, batch 1/64 x 2k/8k, b=1 32k, GQA-8 b=64 4k, the skewed mix")
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/bench_decode.json)")
    p.add_argument("--reps", type=int, default=50, help="timed graph replays per measurement (default 50)")
    p.add_argument("--time-limit", type=float, default=230.0,
                   help="seconds for the whole run, FlashInfer's build included (default 230); "
                        "cases left when it runs short are listed as skipped")
    p.add_argument("--max-cache-gb", type=float, default=24.0,
                   help="skip cases whose K+V cache exceeds this many GB (default 24)")
    p.add_argument("--keep-gb", type=float, default=16.0,
                   help="GB of inputs kept for FlashInfer while its build is still running (default 16)")
    p.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer")
    p.add_argument("--no-sdpa", dest="sdpa", action="store_false",
                   help="skip the dense peers (torch SDPA backends and the PyTorch reference)")
    p.add_argument("--sdpa-max-gb", type=float, default=12.0,
                   help="GB of dense K/V copies the dense peers may take (default 12); a case whose "
                        "one set exceeds it has no dense peer")
    p.add_argument("--flashinfer-timeout", type=float, default=150.0,
                   help="seconds to wait for FlashInfer's first-use builds (default 150)")
    p.add_argument("--graph-mode", choices=("auto", "yes", "no"), default="auto",
                   help="also time ours with use_cuda_graph=True (auto: not with --quick)")
    p.add_argument("--cases", default="",
                   help="only these cases: labels as --list prints them, ';'-separated (e.g. 'bf16 gqa4 b=256 kv=32k')")
    p.add_argument("--groups", default=",".join(map(str, ISSUE_GROUPS)),
                   help="GQA groups of the rows, of " + ", ".join(f"{g} ({hq}/{hk} heads)" for g, (hq, hk) in
                                                              GQA_HEADS.items()) + " (default: the issue's 4,8)")
    p.add_argument("--list", action="store_true", help="print the cases and skips, then exit (no GPU needed)")
    args = p.parse_args(argv)
    try:
        args.groups = tuple(sorted({int(g) for g in args.groups.split(",") if g.strip()}))
    except ValueError:
        args.groups = ()
    if not args.groups or not set(args.groups) <= set(GQA_HEADS):
        p.error(f"--groups: a comma-separated list of {sorted(GQA_HEADS)}, got {args.groups!r}")
    if args.cases:
        labels = {c.label for c in case_list(args.quick, args.groups)}
        args.cases = [c.strip() for c in args.cases.split(";") if c.strip()]
        unknown = [c for c in args.cases if c not in labels]
        if unknown or not args.cases:
            p.error(f"--cases: unknown {unknown or args.cases!r}; the cases are: {'; '.join(sorted(labels))}")
    args.out = args.out or bc.default_out("bench_decode.json")
    return args


def planned(args) -> tuple[list[Case], list[dict]]:
    cases, skipped = [], []
    for case in case_list(args.quick, args.groups):
        if args.cases and case.label not in args.cases:
            continue
        if case.cache_bytes() > args.max_cache_gb * 1e9:
            skipped.append({"case": case.label, "reason": f"K+V cache {case.cache_bytes() / 1e9:.1f} GB > "
                                                          f"--max-cache-gb {args.max_cache_gb:g}"})
        else:
            cases.append(case)
    return cases, skipped


def build_ours(cases) -> dict:
    """Our modules, built in one parallel ninja run before anything is timed."""
    from flashinfer_jit.decode.spec import group_tile
    from flashinfer_jit.pipeline.jit import build_many
    from flashinfer_jit.specs import DecodeSpec

    specs = sorted({DecodeSpec(Q_DTYPE, c.kv_dtype, HEAD_DIM, group_tile(*GQA_HEADS[c.gqa], HEAD_DIM), "csr", "NHD")
                    for c in cases}, key=lambda s: s.name)
    t0 = time.perf_counter()
    try:
        report = build_many(specs, jobs=16)
        return {"specs": [s.name for s in specs], "built": len(report.built), "cached": len(report.cached),
                "failed": dict(report.failed), "seconds": time.perf_counter() - t0}
    except Exception as exc:  # noqa: BLE001  (run() will JIT what is missing)
        return {"specs": [s.name for s in specs], "error": f"{type(exc).__name__}: {exc}"[:800],
                "seconds": time.perf_counter() - t0}


def new_row(case: Case, inputs: Inputs) -> dict:
    hq, hk = GQA_HEADS[case.gqa]
    return {"case": case.label, "kv_dtype": case.kv_dtype, "q_dtype": Q_DTYPE, "gqa": case.gqa,
            "num_qo_heads": hq, "num_kv_heads": hk, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE,
            "batch": case.batch, "kv_len": case.kv_len if case.kv_len else "skewed",
            "lens": None if case.kv_len else f"{SKEWED[0]}x{SKEWED[1]} + {SKEWED[2]}x{SKEWED[3]}",
            "bytes": case.bytes_moved(), "cache_bytes": case.cache_bytes(), "input_sets": inputs.n_sets,
            "impls": {}}


def bench_cases(cases, args, peer: Peer, copy_gbps: float, deadline: float, skipped: list) -> list:
    import torch

    graph_mode = args.graph_mode == "yes" or (args.graph_mode == "auto" and not args.quick)
    reps = max(20, args.reps)
    rows, kept = [], []  # kept: (row, inputs, ours' output) awaiting FlashInfer
    kept_bytes = 0
    fi = None
    for index, case in enumerate(cases):
        if time.perf_counter() > deadline - RESERVE_S:
            skipped.append({"case": case.label, "reason": f"--time-limit {args.time_limit:g} s reached"})
            continue
        budget = min(args.keep_gb * 1e9 / 2, 12e9)
        n_sets = max(1, min(bc.rotation_sets(case.bytes_moved()), int(budget // max(1, case.cache_bytes()))))
        inputs = Inputs(case, n_sets, seed=index)
        row = new_row(case, inputs)
        ours = measure("ours", inputs, None, reps, copy_gbps, keep_output=True)
        reference = ours.pop("_out0", None)
        row["impls"]["ours"] = ours
        # the same plan with the pages as given (plan()'s reordering off): what it gains
        row["impls"]["ours_pages_as_given"] = measure("ours_pages_as_given", inputs, None, reps, copy_gbps, reference)
        if graph_mode:
            row["impls"]["ours_use_cuda_graph"] = measure("ours", inputs, None, reps, copy_gbps, graph_mode=True)
        if args.sdpa:
            measure_dense(row, inputs, reps, copy_gbps, reference, args.sdpa_max_gb)
        bc.log(f"{case.label}: ours {ours.get('median_us', float('nan')):.1f} µs"
               + (f", SDPA best {row['speedup_vs_sdpa_best']:.2f}x" if "speedup_vs_sdpa_best" in row else ""))
        rows.append(row)
        if peer.procs and fi is None and not peer.done() and \
                kept_bytes + case.cache_bytes() * n_sets <= args.keep_gb * 1e9:
            kept.append((row, inputs, reference))  # FlashInfer still building: measure it later
            kept_bytes += case.cache_bytes() * n_sets
            continue
        fi = fi or peer.ready(deadline - RESERVE_S)
        for row_k, inputs_k, ref_k in kept + [(row, inputs, reference)]:
            if fi is not None:
                measure_flashinfer(row_k, inputs_k, fi, reps, copy_gbps, ref_k)
            inputs_k.release()
        kept, kept_bytes = [], 0
        torch.cuda.empty_cache()
    fi = fi or peer.ready(deadline - RESERVE_S)
    for row_k, inputs_k, ref_k in kept:
        if fi is not None and time.perf_counter() < deadline - RESERVE_S:
            measure_flashinfer(row_k, inputs_k, fi, reps, copy_gbps, ref_k)
        inputs_k.release()
    torch.cuda.empty_cache()
    for row in rows:
        if fi is None:
            row["impls"].setdefault("flashinfer_cc", {"error": peer.info.get("reason", "unavailable")})
        _judge(row)
    return rows


def _judge(row: dict) -> None:
    key = (row["kv_dtype"], row["gqa"], row["batch"], row["kv_len"]) if row["kv_len"] != "skewed" else \
        (row["kv_dtype"], row["gqa"], "skewed")
    ours = row["impls"].get("ours", {}).get("median_us")
    checks = []
    if key in TARGETS:
        kind, value = TARGETS[key]
        if kind == "max_us":
            checks.append((f"<= {value:g} us", ours is not None and ours <= value))
        else:
            s = row.get("speedup_vs_flashinfer_best")
            checks.append((f">= {value:g}x FlashInfer", s is not None and s >= value))
    if "speedup_vs_flashinfer_best" in row:
        checks.append((">= 1.0x FlashInfer", row["speedup_vs_flashinfer_best"] >= 1.0))
    row["targets"] = {name: ok for name, ok in checks}


def report(res: dict) -> str:
    lines = []
    copy = res["copy"]["gb_per_s"]
    fi = res["flashinfer"]
    lines.append(f"device {res['meta'].get('device')}; copy bandwidth {copy:.0f} GB/s; FlashInfer "
                 + (f"{fi.get('version')} (builds {fi.get('build_wall_s', 0):.0f} s)" if fi.get("available")
                    else f"not measured: {fi.get('reason')}"))
    ob = res.get("build_ours", {})
    lines.append(f"our modules: {ob.get('built', '?')} built, {ob.get('cached', '?')} cached, "
                 f"{ob.get('seconds', 0):.0f} s" + (f", error {ob['error']}" if "error" in ob else ""))
    host = res.get("host", {})
    for impl, r in host.get("plan_256_requests", {}).items():
        lines.append(f"plan() 256 requests, {impl}: "
                     + (f"{r['median_us']:.1f} us (sync each {r['sync_each']:.1f} us)" if "median_us" in r
                        else r.get("error", "?")))
    for label, impls in host.get("run", {}).items():
        for impl, r in impls.items():
            lines.append(f"run() host {label}, {impl}: "
                         + (f"{r['enqueue_us']:.1f} us enqueue, {r['wall_us_no_sync']:.1f} us wall/call"
                            if "enqueue_us" in r else r.get("error", "?")))
    if "one_torch_launch_enqueue_us" in host:
        lines.append(f"one torch kernel launch: {host['one_torch_launch_enqueue_us']:.1f} us enqueue")
    for s in res["skipped"]:
        lines.append(f"skipped {s['case']}: {s['reason']}")
    rows = []
    for r in res["rows"]:
        ours, cc, tc = (r["impls"].get(k, {}) for k in ("ours", "flashinfer_cc", "flashinfer_tc"))
        agree = all(r["impls"].get(k, {}).get("agrees_with_ours", True)
                    for k in (*FI_IMPLS, *DENSE_IMPLS, "ours_pages_as_given"))
        targets = {k: v for k, v in r.get("targets", {}).items() if k != ">= 1.0x FlashInfer"}  # see "x FI best"
        sdpa = r["impls"].get(r.get("sdpa_best", ""), {})
        rows.append([r["case"], ours.get("median_us"), _tb(ours), _pct(ours), cc.get("median_us"),
                     tc.get("median_us"), r.get("speedup_vs_flashinfer_best"),
                     f"{sdpa['median_us']:.1f} {r['sdpa_best'][5:]}" if "median_us" in sdpa else None,
                     r.get("speedup_vs_sdpa_best"), r["impls"].get("torch_eager", {}).get("median_us"),
                     r["impls"].get("ours_pages_as_given", {}).get("median_us"),
                     r["impls"].get("ours_pages_in_order", {}).get("median_us"),
                     r["impls"].get("ours_use_cuda_graph", {}).get("median_us"),
                     " ".join(("ok " if ok else "MISS ") + name for name, ok in targets.items()) or "-",
                     ("" if agree else "DIFFERS ") + ("" if ours.get("replay_wrote_output", True) else "NO-OUTPUT")
                     + (ours.get("error", "")[:40] if "error" in ours else "")])
    lines.append("")
    lines.append(bc.table(rows, ["case", "ours us", "TB/s", "% copy", "FI cc us", "FI tc us", "x FI best",
                                 "SDPA best us", "x SDPA", "eager us", "ours as-given us", "ours in-order us", "ours graph-mode us", "targets", "notes"]))
    return "\n".join(lines)


def _tb(r):
    return r["gb_per_s"] / 1e3 if "gb_per_s" in r else None


def _pct(r):
    return 100 * r["frac_copy"] if "frac_copy" in r else None


def main(argv=None) -> int:
    args = parse_args(argv)
    cases, skipped = planned(args)
    if args.list:
        for c in cases:
            print(f"{c.label:32s} {c.cache_bytes() / 1e9:7.2f} GB cache, {c.bytes_moved() / 1e9:7.3f} GB moved")
        for s in skipped:
            print(f"skip {s['case']}: {s['reason']}")
        return 0
    import torch

    if bc.no_gpu("bench_decode"):
        return 2
    started = time.perf_counter()
    deadline = started + args.time_limit
    peer = Peer(not args.no_flashinfer, args.flashinfer_timeout)
    res = {"meta": bc.run_metadata(), "config": {
        "q_dtype": Q_DTYPE, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE, "kv_layout": "NHD", "page_table": "csr",
        "gqa_heads": {str(k): v for k, v in GQA_HEADS.items()}, "groups": list(args.groups), "quick": args.quick,
        "reps": args.reps,
        "time_limit_s": args.time_limit,
        "bytes_counted": "K+V rows each request reads (KV dtype) + q read + out written (bf16)",
        "speedup": "FlashInfer median µs / ours (> 1: ours faster)",
        "dense_peers": "torch SDPA (cuDNN, flash, efficient backends) and eager PyTorch on a dense copy of "
                       "the same K/V; speedup_vs_sdpa_best = the fastest backend's µs / ours" if args.sdpa else
                       "--no-sdpa"}}
    res["build_ours"] = build_ours(cases)
    bc.log(f"our modules: {res['build_ours']}")
    # Nothing is timed while FlashInfer's warm-up processes build (16 compiler jobs) and hold
    # CUDA contexts of their own: in a full run with them alongside (2026-11-26, before ec03e28),
    # b=1 kv=32k (the fifth row) read 48.7 us, against 47.9-48.0 in runs of the first rows
    # without them.
    peer.ready(deadline)
    torch.manual_seed(0)
    res["copy"] = bc.copy_bandwidth()
    bc.log(f"copy ceiling: {res['copy']['gb_per_s']:.0f} GB/s")
    res["rows"] = bench_cases(cases, args, peer, res["copy"]["gb_per_s"], deadline, skipped)
    fi = peer.ready(deadline)
    res["flashinfer"] = peer.info
    res["host"] = bench_host(fi)
    res["skipped"] = skipped
    return bc.finish(args.out, res, report, started)


if __name__ == "__main__":
    sys.exit(main())

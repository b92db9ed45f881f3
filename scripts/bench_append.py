#!/usr/bin/env python3
"""Benchmark append_paged_kv_cache against the copy ceiling, PyTorch and FlashInfer.

Measures, in one process on one GPU:
  - the copy-bandwidth ceiling: torch copy_ of a 1 GiB buffer, bytes read + written;
  - append of 8k/16k/32k/64k tokens x 8 KV heads x head_dim 128 into a page-16 NHD cache,
    bf16 and fp8 e4m3: time (median of >= 50 CUDA-event runs, inputs rotating so one
    round touches >= 4x L2), achieved bandwidth = (bytes read + written) / time and its
    fraction of the copy ceiling; for ours, a PyTorch implementation (index arithmetic +
    index_copy_) and FlashInfer's flashinfer.page.append_paged_kv_cache, each checked
    byte for byte against ours;
  - the decode step: 256 requests x 1 token, µs per call (CUDA-graph replay: device
    time; eager: host wall clock of back-to-back calls);
  - host overhead of one call with tiny inputs (wrapper, raw torch op, FlashInfer;
    without and with a device sync per call);
  - the registry hit (get_module of a loaded spec) and the warm load of a cached module
    in a new process (median of 5), and in full mode the cold build of one module.

FlashInfer is optional: the peer copy is put on PYTHONPATH for this process only
(PYTHONPATH=.peers/site); it compiles its page module at first use, which runs in a
background process (FLASHINFER_WORKSPACE_BASE: a temp folder unless set) while our
kernels are measured. Without it the FlashInfer columns say why.

Writes JSON (--out, default $OUT/bench_append.json) and prints the table last.
  PYTHONPATH=.peers/site python3 scripts/bench_append.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (also puts the repository on sys.path)

HEADS, HEAD_DIM, PAGE_SIZE = 8, 128, 16
TOKENS, QUICK_TOKENS = (8192, 16384, 32768, 65536), (8192, 65536)
DTYPES = ("bfloat16", "float8_e4m3fn")
TOKENS_PER_REQUEST = 1024  # a prefill of 1k tokens per request, after 0..1k cached tokens
DECODE_REQUESTS, DECODE_MAX_KV = 256, 4096
IMPLS = ("ours", "torch", "flashinfer")
DEVICE = "cuda"

FLASHINFER_WARMUP = r"""
import json, sys, time
t0 = time.perf_counter()
try:
    import flashinfer, flashinfer.page
    t1 = time.perf_counter()
    flashinfer.page.get_page_module()
    t2 = time.perf_counter()
    print(json.dumps({"ok": True, "version": getattr(flashinfer, "__version__", "?"),
                      "import_s": t1 - t0, "build_s": t2 - t1}))
except BaseException as exc:  # report anything, never hang the benchmark
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[-3000:]}))
"""

WARM_LOAD = r"""
import json, time
import torch
t0 = time.perf_counter()
import flashinfer_jit
from flashinfer_jit.pipeline.jit import get_module
from flashinfer_jit.specs import AppendSpec
t1 = time.perf_counter()
get_module(AppendSpec("bfloat16", 128, "NHD", "csr"))
t2 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "get_module_ms": (t2 - t1) * 1e3,
                  "total_ms": (t2 - t0) * 1e3}))
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help=f"tokens {QUICK_TOKENS} only, fewer host-overhead calls, no cold build")
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/bench_append.json)")
    p.add_argument("--reps", type=int, default=100, help="timed runs per case (>= 50; default 100)")
    p.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer")
    p.add_argument("--flashinfer-timeout", type=float, default=420.0,
                   help="seconds to wait for FlashInfer's first-use build (default 420)")
    p.add_argument("--cold-build", choices=("auto", "yes", "no"), default="auto",
                   help="time building one module into an empty cache (auto: not with --quick)")
    args = p.parse_args(argv)
    args.reps = max(50, args.reps)
    args.out = args.out or bc.default_out("bench_append.json")
    return args


# --- the implementations ---------------------------------------------------------------------
def raw_view(t):
    """fp8 tensors as uint8 (same bytes; torch's index kernels may lack fp8)."""
    import torch

    return t.view(torch.uint8) if t.element_size() == 1 else t


def torch_append(key, value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
                 page_size):
    """The same append in plain PyTorch: slot arithmetic, then one index_copy_ per cache
    (NHD, contiguous caches; no padding tokens)."""
    import torch

    b, p = batch_indices.long(), positions.long()
    page = kv_indices.long()[kv_indptr.long()[b] + torch.div(p, page_size, rounding_mode="floor")]
    flat = page * page_size + p % page_size
    heads, dim = k_cache.shape[-2:]
    raw_view(k_cache).view(-1, heads, dim).index_copy_(0, flat, raw_view(key))
    raw_view(v_cache).view(-1, heads, dim).index_copy_(0, flat, raw_view(value))


class Peer:
    """FlashInfer, warmed up in a background process while ours is measured."""

    def __init__(self, enabled: bool, timeout: float):
        self.info: dict = {"available": False}
        self.module = None
        self.proc = None
        self.timeout = timeout
        self.started = time.perf_counter()
        if not enabled:
            self.info["reason"] = "--no-flashinfer"
            return
        if importlib.util.find_spec("flashinfer") is None:
            self.info["reason"] = ("flashinfer not importable (carry .peers and run with "
                                   "PYTHONPATH=.peers/site)")
            return
        os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", tempfile.mkdtemp(prefix="flashinfer_ws_"))
        self.info["workspace"] = os.environ["FLASHINFER_WORKSPACE_BASE"]
        env = dict(os.environ)  # the peer's path made absolute, in case it was given relative
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in
                                            env.get("PYTHONPATH", "").split(os.pathsep) if p)
        self.proc = subprocess.Popen([sys.executable, "-c", FLASHINFER_WARMUP], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=bc.REPO, env=env)
        bc.log("flashinfer: building its page module in the background")

    def ready(self):
        """The flashinfer.page module, or None (reason in self.info)."""
        if self.proc is None or self.module is not None:
            return self.module
        left = max(1.0, self.timeout - (time.perf_counter() - self.started))
        try:
            out, err = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            self.info["reason"] = f"first-use build did not finish in {self.timeout:.0f} s"
            self.proc = None
            return None
        self.proc = None
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        report = json.loads(lines[-1]) if lines else {"ok": False, "error": err[-3000:]}
        self.info.update({k: v for k, v in report.items() if k != "ok"})
        if not report.get("ok"):
            self.info["reason"] = "warm-up failed: " + report.get("error", "?")[-500:]
            bc.log(f"flashinfer: {self.info['reason']}")
            return None
        try:
            import flashinfer.page

            flashinfer.page.get_page_module()
            self.module = flashinfer.page
            self.info["available"] = True
        except Exception as exc:  # noqa: BLE001  (a peer failing must not end the benchmark)
            self.info["reason"] = f"import after build failed: {type(exc).__name__}: {exc}"[:800]
        return self.module


# --- append cases --------------------------------------------------------------------------------
class AppendCase:
    """`tokens` appended tokens in requests of 1k (each after 0..1k cached tokens), into
    an NHD page-16 cache; `n_sets` input sets, each with its own append rows and its own
    (randomly permuted) pages, so a round of calls touches >= 4x L2."""

    def __init__(self, tokens: int, dtype_name: str, seed: int):
        import torch

        from flashinfer_jit.reference import get_batch_indices_positions_ref

        self.tokens, self.dtype_name = tokens, dtype_name
        dtype = getattr(torch, dtype_name)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.row_bytes = tokens * HEADS * HEAD_DIM * itemsize
        # K and V rows read, K and V rows written, batch index + position read per token
        self.bytes = 4 * self.row_bytes + 8 * tokens
        self.n_sets = bc.rotation_sets(self.bytes)
        gen = torch.Generator().manual_seed(seed)
        batch = max(1, tokens // TOKENS_PER_REQUEST)
        per_request = tokens // batch
        before = torch.randint(0, TOKENS_PER_REQUEST, (batch,), generator=gen)
        seq = before + per_request
        pages = (seq + PAGE_SIZE - 1) // PAGE_SIZE
        pages_per_set = int(pages.sum())
        num_pages = pages_per_set * self.n_sets
        dev = DEVICE
        rand = lambda *shape: torch.randn(shape, device=dev).to(dtype)  # noqa: E731
        self.k_cache = rand(num_pages, PAGE_SIZE, HEADS, HEAD_DIM)
        self.v_cache = rand(num_pages, PAGE_SIZE, HEADS, HEAD_DIM)
        self.initial = (self.k_cache.clone(), self.v_cache.clone())
        append_indptr = torch.arange(batch + 1, dtype=torch.int32) * per_request
        kv_indptr = torch.zeros(batch + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(pages, 0)
        last = (seq - (pages - 1) * PAGE_SIZE).to(torch.int32)
        bi, pos = get_batch_indices_positions_ref(append_indptr, seq.to(torch.int32), tokens)
        self.sets = []
        for i in range(self.n_sets):
            indices = (i * pages_per_set + torch.randperm(pages_per_set, generator=gen)).to(torch.int32)
            self.sets.append({
                "key": rand(tokens, HEADS, HEAD_DIM), "value": rand(tokens, HEADS, HEAD_DIM),
                "batch_indices": bi.to(dev), "positions": pos.to(dev),
                "kv_indices": indices.to(dev), "kv_indptr": kv_indptr.to(dev),
                "kv_last_page_len": last.to(dev)})
        self.reference = None  # the caches after ours ran on set 0

    def call(self, impl, peer_module=None):
        import flashinfer_jit as fij

        def run(i):
            s = self.sets[i]
            args = (s["key"], s["value"], s["batch_indices"], s["positions"])
            if impl == "ours":
                fij.append_paged_kv_cache(*args, (self.k_cache, self.v_cache), s["kv_indices"],
                                          s["kv_indptr"], s["kv_last_page_len"])
            elif impl == "torch":
                torch_append(*args, self.k_cache, self.v_cache, s["kv_indices"], s["kv_indptr"],
                             PAGE_SIZE)
            else:
                peer_module.append_paged_kv_cache(*args, (self.k_cache, self.v_cache), s["kv_indices"],
                                                  s["kv_indptr"], s["kv_last_page_len"], "NHD")
        return run

    def check(self, impl, run) -> bool:
        """Run once on set 0 from the initial cache; ours becomes the reference the
        others are compared with byte for byte (ours itself is tested in tests/)."""
        import torch

        self.k_cache.copy_(self.initial[0])
        self.v_cache.copy_(self.initial[1])
        run(0)
        torch.cuda.synchronize()
        if self.reference is None:
            self.reference = (self.k_cache.clone(), self.v_cache.clone())
            changed = not torch.equal(self.reference[0].view(torch.uint8), self.initial[0].view(torch.uint8))
            return changed
        return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip((self.k_cache, self.v_cache), self.reference))

    def measure(self, impl, run, reps: int, copy_gbps: float) -> dict:
        try:
            match = self.check(impl, run)
            # Device time from CUDA-graph replays (a whole rotation of input sets per
            # replay): eager timing would also count host time whenever the Python call
            # takes longer than the kernel, which it does below ~64k tokens.
            inner = self.n_sets * max(1, -(-8 // self.n_sets))
            t = bc.time_cuda_graph(run, self.n_sets, inner=inner, reps=reps)
            eager = bc.time_cuda(run, self.n_sets, warmup=max(5, self.n_sets * 2), reps=reps)
        except Exception as exc:  # noqa: BLE001
            return {"error": f"{type(exc).__name__}: {exc}"[:800]}
        gb = bc.gbps(self.bytes, t["median_us"])
        return {"median_us": t["median_us"], "gb_per_s": gb, "frac_copy": gb / copy_gbps,
                "matches_ours": match, "timed_by": "cuda-graph replay", "timing": t,
                "eager_event_us": eager["median_us"], "eager": eager}

    def release(self):
        self.sets = self.k_cache = self.v_cache = self.initial = self.reference = None


def bench_append(token_list, reps, copy_gbps, peer):
    import torch

    cases, results = [], []
    for tokens in token_list:
        for dtype_name in DTYPES:
            case = AppendCase(tokens, dtype_name, seed=tokens + len(dtype_name))
            row = {"tokens": tokens, "dtype_kv": dtype_name, "heads": HEADS, "head_dim": HEAD_DIM,
                   "page_size": PAGE_SIZE, "bytes_per_call": case.bytes, "input_sets": case.n_sets,
                   "impls": {}}
            for impl in ("ours", "torch"):
                row["impls"][impl] = case.measure(impl, case.call(impl), reps, copy_gbps)
            bc.log(f"append {tokens} {dtype_name}: ours {_us(row, 'ours')} µs, torch {_us(row, 'torch')} µs")
            cases.append(case)
            results.append(row)
            # keep the data for the FlashInfer pass; free the rotation sets' memory if large
    module = peer.ready()
    for case, row in zip(cases, results):
        if module is not None:
            row["impls"]["flashinfer"] = case.measure("flashinfer", case.call("flashinfer", module),
                                                      reps, copy_gbps)
        else:
            row["impls"]["flashinfer"] = {"error": peer.info.get("reason", "unavailable")}
        case.release()
    torch.cuda.empty_cache()
    return results


def _us(row, impl):
    r = row["impls"].get(impl, {})
    return f"{r['median_us']:.1f}" if "median_us" in r else "err"


# --- decode step, host overhead, registry, load ----------------------------------------------------
def decode_inputs(requests: int, dtype_name: str, seed: int, max_kv: int = DECODE_MAX_KV):
    """`requests` requests appending 1 token each after 0..max_kv-1 cached tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    before = torch.randint(0, max_kv, (requests,), generator=gen)
    seq = before + 1
    pages = (seq + PAGE_SIZE - 1) // PAGE_SIZE
    total = int(pages.sum())
    kv_indptr = torch.zeros(requests + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    dev = DEVICE
    return {
        "key": torch.randn(requests, HEADS, HEAD_DIM, device=dev).to(dtype),
        "value": torch.randn(requests, HEADS, HEAD_DIM, device=dev).to(dtype),
        "batch_indices": torch.arange(requests, dtype=torch.int32, device=dev),
        "positions": before.to(torch.int32).to(dev),
        "k_cache": torch.randn(total, PAGE_SIZE, HEADS, HEAD_DIM, device=dev).to(dtype),
        "v_cache": torch.randn(total, PAGE_SIZE, HEADS, HEAD_DIM, device=dev).to(dtype),
        "kv_indices": torch.randperm(total, generator=gen).to(torch.int32).to(dev),
        "kv_indptr": kv_indptr.to(dev),
        "kv_last_page_len": (seq - (pages - 1) * PAGE_SIZE).to(torch.int32).to(dev),
    }


def impl_call(impl, d, peer_module=None):
    import flashinfer_jit as fij

    args = (d["key"], d["value"], d["batch_indices"], d["positions"])
    table = (d["kv_indices"], d["kv_indptr"], d["kv_last_page_len"])
    cache = (d["k_cache"], d["v_cache"])
    if impl == "ours":
        return lambda *_: fij.append_paged_kv_cache(*args, cache, *table)
    if impl == "torch":
        return lambda *_: torch_append(*args, *cache, d["kv_indices"], d["kv_indptr"], PAGE_SIZE)
    return lambda *_: peer_module.append_paged_kv_cache(*args, cache, *table, "NHD")


def decode_landing_check(d):
    """(poison, landed): overwrite each request's destination row with the complement of
    its append row; after one run, check every row landed. Proves that a timed launch
    (a graph replay above all) did the work, not that the rest of the cache is intact
    (tests/ does that)."""
    import torch

    from flashinfer_jit.reference import page_slots_ref
    from flashinfer_jit.runtime.page_table import csr_page_table

    table = csr_page_table(d["kv_indptr"], d["kv_indices"], d["kv_last_page_len"])
    tokens, page, _, slot = page_slots_ref(d["batch_indices"], d["positions"], table, PAGE_SIZE,
                                           d["k_cache"].shape[0])
    pairs = [(d["k_cache"].view(torch.uint8), d["key"].view(torch.uint8)[tokens]),
             (d["v_cache"].view(torch.uint8), d["value"].view(torch.uint8)[tokens])]

    def poison():
        for cache, rows in pairs:
            cache[page, slot] = 255 - rows

    def landed() -> bool:
        torch.cuda.synchronize()
        return all(torch.equal(cache[page, slot], rows) for cache, rows in pairs)

    return poison, landed


def bench_decode(peer_module, quick: bool):
    import torch

    rows = []
    for dtype_name in DTYPES:
        d = decode_inputs(DECODE_REQUESTS, dtype_name, seed=1)
        poison, landed = decode_landing_check(d)
        row = {"requests": DECODE_REQUESTS, "tokens_per_request": 1, "dtype_kv": dtype_name,
               "max_kv_len": DECODE_MAX_KV, "impls": {}}
        for impl in IMPLS:
            if impl == "flashinfer" and peer_module is None:
                continue
            fn = impl_call(impl, d, peer_module)
            try:
                poison()
                fn()
                eager_ok = landed()
                inner = 20
                graph = bc.capture_graph(fn, inner=inner)
                poison()
                graph.replay()
                graph_ok = landed()
                timing = bc.time_graph(graph, inner, reps=100)
                del graph
                eager = bc.time_host(fn, 300 if quick else 1000, sync_each=False)
                events = bc.time_cuda(fn, 1, warmup=10, reps=100, inner=1)
                row["impls"][impl] = {
                    "graph_us_per_call": timing["median_us"] if graph_ok else None,
                    "eager_host_us_per_call": eager["median_us"],
                    "eager_event_us": events["median_us"],
                    "writes_landed_eager": eager_ok, "writes_landed_graph": graph_ok,
                    "graph": timing, "eager": eager, "events": events}
            except Exception as exc:  # noqa: BLE001
                row["impls"][impl] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
        rows.append(row)
        bc.log(f"decode {dtype_name}: " + ", ".join(
            f"{k} {v.get('graph_us_per_call') or float('nan'):.2f} µs" for k, v in row["impls"].items()))
        del d, poison, landed
        torch.cuda.empty_cache()
    return rows


def bench_host_overhead(peer_module, quick: bool):
    """One call with tiny inputs (1 request, 1 token): what the Python path costs."""
    import torch

    from flashinfer_jit.pipeline.jit import get_module
    from flashinfer_jit.specs import AppendSpec

    d = decode_inputs(1, "bfloat16", seed=2, max_kv=16)
    n = 500 if quick else 2000
    module = get_module(AppendSpec("bfloat16", HEAD_DIM, "NHD", "csr"))
    table = [d["kv_indptr"], d["kv_indices"], d["kv_last_page_len"]]
    raw = lambda: module.append_paged_kv_cache(d["key"], d["value"], d["batch_indices"],  # noqa: E731
                                               d["positions"], d["k_cache"], d["v_cache"], table)
    calls = {"ours (append_paged_kv_cache)": impl_call("ours", d),
             "ours raw torch op": raw,
             "torch.cuda.synchronize alone": torch.cuda.synchronize}
    if peer_module is not None:
        calls["flashinfer (append_paged_kv_cache)"] = impl_call("flashinfer", d, peer_module)
    out = {}
    for name, fn in calls.items():
        try:
            out[name] = {"no_sync_us": bc.time_host(fn, n, sync_each=False)["median_us"],
                         "sync_each_us": bc.time_host(fn, n // 4, sync_each=True)["median_us"]}
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
    return out


def bench_registry():
    from flashinfer_jit.pipeline.jit import get_module
    from flashinfer_jit.specs import AppendSpec

    spec = AppendSpec("bfloat16", HEAD_DIM, "NHD", "csr")
    get_module(spec)
    return {
        "get_module_hit_us": bc.time_python(lambda: get_module(spec)),
        "spec_validate_and_hit_us": bc.time_python(
            lambda: get_module(AppendSpec("bfloat16", HEAD_DIM, "NHD", "csr").validate())),
    }


def bench_warm_load(runs: int = 5):
    """A new process: import flashinfer_jit and get_module of the module this process
    has already loaded (so a cache hit: render, key, verify, load), by the default path."""
    env = dict(os.environ)
    samples = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", WARM_LOAD], cwd=bc.REPO, env=env,
                             capture_output=True, text=True, timeout=120)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode != 0 or not lines:
            return {"error": (out.stderr or out.stdout)[-800:]}
        samples.append(json.loads(lines[-1]))
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    return med | {"runs": runs, "samples": samples}


def bench_cold_build():
    """Build one append module into an empty cache in a new process (MAX_JOBS=16)."""
    with tempfile.TemporaryDirectory(prefix="fij_cold_") as tmp:
        env = dict(os.environ, FLASHINFER_JIT_CACHE_DIR=tmp, MAX_JOBS="16")
        env.pop("FLASHINFER_JIT_DISABLE_JIT", None)
        code = ("import time, json; t0 = time.perf_counter(); "
                "from flashinfer_jit.pipeline.jit import get_module; from flashinfer_jit.specs import AppendSpec; "
                "get_module(AppendSpec('bfloat16', 128, 'NHD', 'csr')); "
                "print(json.dumps({'seconds': time.perf_counter() - t0}))")
        out = subprocess.run([sys.executable, "-c", code], cwd=bc.REPO, env=env, capture_output=True,
                             text=True, timeout=600)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode != 0 or not lines:
            return {"error": (out.stderr or out.stdout)[-800:]}
        return json.loads(lines[-1]) | {"module": "append_bf16_hd128_nhd_csr", "max_jobs": 16}


# --- report ------------------------------------------------------------------------------------------
def report(res: dict) -> str:
    copy = res["copy"]["gb_per_s"]
    lines = [f"device {res['meta'].get('device')}  torch {res['meta']['torch']} (CUDA "
             f"{res['meta']['torch_cuda']})  commit {res['meta']['commit'][:12]}",
             f"copy ceiling (1 GiB copy_, read+write): {copy:.0f} GB/s", ""]
    rows = []
    for r in res["append"]:
        cells = [r["tokens"], r["dtype_kv"], r["input_sets"]]
        for impl in IMPLS:
            m = r["impls"].get(impl, {})
            if "median_us" in m:
                flag = "" if m.get("matches_ours", True) else " MISMATCH"
                cells += [m["median_us"], f"{m['gb_per_s']:.0f}", f"{100 * m['frac_copy']:.0f}%{flag}"]
            else:
                cells += ["-", "-", "err" if "error" in m else "-"]
        rows.append(cells)
    lines.append(f"append {HEADS} heads x {HEAD_DIM}, page {PAGE_SIZE}, NHD (µs, GB/s, % of copy)")
    lines.append(bc.table(rows, ["tokens", "dtype", "sets", "ours µs", "GB/s", "%copy",
                                 "torch µs", "GB/s", "%copy", "flashinfer µs", "GB/s", "%copy"]))
    rows = []
    for r in res["decode_step"]:
        for impl, m in r["impls"].items():
            note = "error" if "error" in m else (
                "" if m.get("writes_landed_graph") and m.get("writes_landed_eager") else
                f"writes missing (eager {m.get('writes_landed_eager')}, graph {m.get('writes_landed_graph')})")
            rows.append([r["dtype_kv"], impl, m.get("graph_us_per_call"), m.get("eager_event_us"),
                         m.get("eager_host_us_per_call"), note])
    lines += ["", f"decode step: {DECODE_REQUESTS} requests x 1 token (µs per call)",
              bc.table(rows, ["dtype", "impl", "graph replay", "eager (events)", "eager (host loop)", ""])]
    rows = [[name, m.get("no_sync_us"), m.get("sync_each_us")] for name, m in res["host_overhead"].items()]
    lines += ["", "host overhead, 1 token (µs per call)",
              bc.table(rows, ["call", "no sync", "sync each"])]
    reg, warm = res["registry"], res["warm_load"]
    lines += ["", f"registry hit: {reg['get_module_hit_us']:.2f} µs (spec + validate + hit "
                  f"{reg['spec_validate_and_hit_us']:.2f} µs)"]
    if "total_ms" in warm:
        lines.append(f"warm load in a new process (after import torch): {warm['total_ms']:.0f} ms "
                     f"(import {warm['import_ms']:.0f} ms + get_module {warm['get_module_ms']:.0f} ms), "
                     f"median of {warm['runs']}")
    else:
        lines.append(f"warm load: error {warm.get('error', '')[:200]}")
    cold = res.get("cold_build")
    if cold:
        lines.append(f"cold build of one append module: "
                     + (f"{cold['seconds']:.1f} s" if "seconds" in cold else f"error {cold['error'][:200]}"))
    fi = res["flashinfer"]
    lines.append("flashinfer: " + (f"{fi.get('version')} (first-use build {fi.get('build_s', 0):.0f} s)"
                                   if fi.get("available") else f"not measured: {fi.get('reason')}"))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if bc.no_gpu("bench_append"):
        return 2
    started = time.perf_counter()
    peer = Peer(not args.no_flashinfer, args.flashinfer_timeout)
    res = {"meta": bc.run_metadata(), "config": {
        "heads": HEADS, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE, "kv_layout": "NHD",
        "page_table": "csr", "tokens_per_request": TOKENS_PER_REQUEST, "reps": args.reps,
        "quick": args.quick, "bytes_counted": "K+V rows read + K+V rows written + 8 B/token indices"}}
    torch.manual_seed(0)
    res["copy"] = bc.copy_bandwidth(device=DEVICE)
    bc.log(f"copy ceiling: {res['copy']['gb_per_s']:.0f} GB/s")
    res["append"] = bench_append(QUICK_TOKENS if args.quick else TOKENS, args.reps,
                                 res["copy"]["gb_per_s"], peer)
    module = peer.ready()
    res["flashinfer"] = peer.info
    res["decode_step"] = bench_decode(module, args.quick)
    res["host_overhead"] = bench_host_overhead(module, args.quick)
    res["registry"] = bench_registry()
    res["warm_load"] = bench_warm_load()
    if args.cold_build == "yes" or (args.cold_build == "auto" and not args.quick):
        res["cold_build"] = bench_cold_build()
    return bc.finish(args.out, res, report, started)


if __name__ == "__main__":
    sys.exit(main())

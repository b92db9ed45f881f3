#!/usr/bin/env python3
"""Benchmark POD (one launch of a prefill next to a batch of decodes) against the same work as
two launches, each half alone, BatchAttention (the same work as one mixed batch), and
FlashInfer 0.5.3's POD and BatchAttention.

Rows: mixed batches from serving (chunked prefill beside decodes), bf16, 32 query / 8 KV
heads, head_dim 128 unless the label says, page 16 (NHD, CSR page table, every page id from a
random permutation of the pool: the decode reads are not sequential), causal prefill aligned
bottom-right. Label `hd128 p1x2k@8k+d128x2k`: one prefill chunk of 2k query tokens on an 8k
context, 128 decodes of 2k keys each; `e4m3`: the paged cache fp8 (the single form's ragged K/V: bf16
copies of the prefill's pages).
The caches are 0.5-2 GB, 10x L2 or more. Inputs are standard normal (never zeros).

Per row, on the same tensors (our implementations first, then FlashInfer's):
  pod                    BatchPODWithPagedKVCacheWrapper: the prefill paged (same pool as the decodes)
  pod_single             PODWithPagedKVCacheWrapper: the prefill's K/V ragged (rows of one prefill request)
  serial                 BatchPrefillWithPagedKVCacheWrapper.run then BatchDecodeWithPagedKVCacheWrapper
                         (use_tensor_cores=True).run, timed as one region (the prefill's backend
                         "auto": the Hopper kernel on sm_90 where its rule takes the batch)
  serial_single          single_prefill_with_kv_cache then the same decode
  prefill_only, prefill_single_only, decode_only: each half of those alone
  batch_attention        BatchAttention: the row as one batch in the order engines build it (the
                         decodes, then the prefill requests): one q (q_d's rows, then q_p's), one
                         CSR page table (the decodes' pages, then the prefills'; the pod form's
                         pages), kv_len_arr in tokens; run(q, cache, out=, lse=) into buffers
                         allocated once. It splits into the pod form's two sides (views of q, out,
                         lse and of the page ids) and launches the same POD module
  batch_attention_interleaved (rows marked `interleaved`, the reference row and p2x2k): the same
                         batch with the prefill requests spread among the decodes (one prefill: in
                         the middle), which BatchAttention runs through one gather of q and one
                         scatter of out / lse: what not being decodes-first costs
  batch_attention_graph  the batch_attention batch on a use_cuda_graph=True BatchAttention: run()
                         captured once, timed as the graph's replay (the sides' fixed rows: a
                         gather of q and of the outputs around the POD launch)
  batch_attention_rope   the batch_attention batch with pos_encoding_mode="ROPE_LLAMA": every
                         request on the prefill side, the prefill kernel rotating q and K; not
                         checked here (tests/test_batch_attention.py checks it)
  pod_hopper, batch_attention_hopper, pod_single_hopper: batch POD, BatchAttention and the single
                         form (its prefill request's K/V rows) with prefill_backend="auto"
                         (POD on Hopper, csrc/pod/pod_sm90.cuh, where the prefill side plans the
                         Hopper kernel; sm_90 only: elsewhere their rows record the error), timed in
                         both passes like pod and batch_attention; the last table
  flashinfer_pod, flashinfer_pod_single, flashinfer_serial (FA2 paged prefill + tensor-core
                         decode), flashinfer_batch_attention (its persistent BatchAttention, the
                         batch_attention batch): FlashInfer 0.5.3 on the head_dim 128 bf16 rows
Reported per row: median us of each; serial/pod (> 1: POD saves time), ideal/pod with ideal =
max(prefill_only, decode_only) (1.0: perfect overlap), captured = (serial - pod) / (serial -
ideal), pod/BA (the cost of BatchAttention's split and views: ideally 1.0), serial/BA,
BAi/BA (interleaved over decodes-first), FlashInfer's POD over ours, FlashInfer's
BatchAttention over ours; and a check, once: every POD's outputs (prefill and decode) against
the serial outputs of the same form, each BatchAttention's outputs, split back into the prefill
and the decode rows, against the pod form's (serial's where pod failed) (max abs diff; agrees
below 2e-2; a row where one of ours does not is marked MISMATCH). Every implementation's failure
is caught and recorded.

Timing (bench_prefill's): CUDA events around each eager call (plan() once before, outside the
timing; POD is never captured in a graph: FlashInfer's POD records nothing there), an L2 flush
before each call, >= 200 ms of warm-up per implementation, then --reps runs each (twice as many
under 1 ms), the row's implementations interleaved run by run (bench_prefill.time_interleaved);
median, p10, p90 and every sample in the JSON.

Builds: our modules are built first by background processes in parallel (they run small
kernels, so they all end before anything is timed; BatchAttention uses the same POD module, no
build of its own). FlashInfer's four modules for head_dim 128 (FA2 prefill, which its
tensor-core decode uses too, POD, batch POD, BatchAttention's persistent module; POD ~3.5 min)
build in one background ninja at a lower CPU priority while our rows are measured (where that
ninja fails: the first three in one ninja again, then the persistent one, then one by one; a
module that fails is recorded and its implementation skipped); FlashInfer is then timed in a
second pass, interleaved with our pod, pod_single and batch_attention again (their `pass2`
timing: what the FlashInfer ratios use). Cold, that build outlasts the default --time-limit: give
--time-limit 540 for FlashInfer in one call, or run --build-only first on a warm machine
(FLASHINFER_WORKSPACE_BASE, default <tmp>/flashinfer_ws, keeps it). Ours alone: ~1-1.5 min.

  PYTHONPATH=.peers/site python3 scripts/bench_pod.py [--quick] [--rows 'p2x2k;e4m3'] [--time-limit 540] [--out F]
  python3 scripts/bench_pod.py --list          (the rows; no GPU needed)
  python3 scripts/bench_pod.py --no-flashinfer (ours only)
JSON (--out, default $OUT/bench_pod.json): meta (device, date, commit from FIJ_COMMIT or git,
torch, CUDA), config, flashinfer, builds, rows (per row impls with median_us / p10_us / p90_us /
samples_us or error / skipped, speedups, paired, check, mismatch) and skipped.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (also puts the repository on sys.path)
import bench_prefill as bp  # noqa: E402  (its flush, interleaved timing and FlashInfer lookup)

NUM_QO_HEADS, NUM_KV_HEADS, PAGE_SIZE = 32, 8, 16
WORKSPACE_BYTES = 256 << 20
MAX_ABS_DIFF = 2e-2  # a POD's outputs against the serial outputs of the same form (bf16)
RESERVE_S = 5.0  # left at the end for the report
DEVICE = "cuda"
OURS = ("pod", "pod_single", "serial", "serial_single", "prefill_only", "prefill_single_only", "decode_only",
        "batch_attention", "batch_attention_interleaved", "batch_attention_t64", "pod_hopper",
        "batch_attention_hopper", "pod_single_hopper", "batch_attention_rope", "batch_attention_graph")
HOPPER = ("pod_hopper", "batch_attention_hopper", "pod_single_hopper")  # prefill_backend="auto": POD on Hopper
FI = ("flashinfer_pod", "flashinfer_pod_single", "flashinfer_serial", "flashinfer_batch_attention")
SINGLE = ("pod_single", "serial_single", "prefill_single_only", "flashinfer_pod_single",
          "pod_single_hopper")  # one prefill request
INTERLEAVED = ("batch_attention_interleaved",)  # on the rows marked interleaved only
# rows of decodes=0; batch_attention_t64: its prefill side pinned to 64-row tiles
NO_DECODES = ("batch_attention", "batch_attention_t64", "prefill_only", "flashinfer_batch_attention",
              "batch_attention_hopper", "batch_attention_rope", "batch_attention_graph")
# what each output is checked against: the first of these that ran
CHECKS = {"pod": ("serial",), "pod_single": ("serial_single",), "pod_single_hopper": ("serial_single",), "batch_attention": ("pod", "serial", "prefill_only"),
          "batch_attention_t64": ("pod", "serial", "prefill_only"), "pod_hopper": ("serial",),
          "batch_attention_hopper": ("pod", "serial", "prefill_only"),
          "batch_attention_interleaved": ("pod", "serial"), "batch_attention_graph": ("pod", "serial", "prefill_only"),
          "flashinfer_pod": ("serial",),
          "flashinfer_pod_single": ("serial_single",), "flashinfer_serial": ("serial",),
          "flashinfer_batch_attention": ("serial", "prefill_only")}
FI_MODULE = {"flashinfer_pod": "batch_pod", "flashinfer_pod_single": "pod", "flashinfer_serial": "prefill",
             "flashinfer_batch_attention": "batch_attention"}
FI_SCOPE = "FlashInfer is measured on the head_dim 128 bf16 rows only (each POD module builds for ~3.5 min)"
REFERENCE = "FlashInfer 0.5.3 on H100 (peer README): POD 404 us, decode alone 388, FA2 prefill alone 145"


# --- rows -----------------------------------------------------------------------------------------
class Row(NamedTuple):
    head_dim: int
    prefill: tuple  # ((qo_len, kv_len), ...) a chunk each
    decodes: int
    decode_kv: int
    kv_dtype: str = "bfloat16"  # of the paged cache
    note: str = ""
    interleaved: bool = False  # also time batch_attention_interleaved (the prefills among the decodes)
    name: str = ""  # the label, where the default would mislead

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        (qo, kv) = self.prefill[0]
        return (f"hd{self.head_dim} p{len(self.prefill)}x{bp._k(qo)}@{bp._k(kv)}+d{self.decodes}x{bp._k(self.decode_kv)}"
                + (" e4m3" if self.kv_dtype != "bfloat16" else ""))

    @property
    def single(self) -> bool:
        return len(self.prefill) == 1

    @property
    def flashinfer(self) -> bool:
        return self.head_dim == 128 and self.kv_dtype == "bfloat16"

    def impls(self, names) -> list[str]:
        if self.decodes == 0:  # one mixed batch without one-token decodes: BatchAttention's rows
            return [n for n in names if n in NO_DECODES]
        return [n for n in names if (self.single or n not in SINGLE) and (self.interleaved or n not in INTERLEAVED)]

    def prefill_flops(self) -> int:
        return sum(bp.attention_flops(1, qo, kv, True, NUM_QO_HEADS, self.head_dim) for qo, kv in self.prefill)

    def decode_kv_bytes(self) -> int:
        item = 2 if self.kv_dtype == "bfloat16" else 1
        return 2 * self.decodes * self.decode_kv * NUM_KV_HEADS * self.head_dim * item

    def est_us(self) -> float:
        """A rough POD time (H200: 350 TFLOP/s prefill, 4 TB/s decode) for the time budget."""
        return self.prefill_flops() / 350e6 + self.decode_kv_bytes() / 4e6

    def budget_s(self, n_impls: int, reps: int) -> float:
        runs = reps * (2 if self.est_us() < 1000 else 1)
        return 2.0 + n_impls * (bc.warmup_ms() / 1e3 + 0.05 + runs * (1.5 * self.est_us() + 150) * 1e-6)


def row_list(quick: bool, only=()) -> list[Row]:
    """The issue's mixes (note "mix N"; --quick: those alone), then the other rows."""
    mixes = [Row(128, ((2048, 2048),) * 2, 128, 2048, note="mix 1", interleaved=True),
             Row(128, ((2048, 2048),), 128, 2048, note="mix 2; " + REFERENCE, interleaved=True),
             Row(128, ((4096, 4096),), 128, 4096, note="mix 3"),
             Row(128, ((4096, 4096),), 128, 8192, note="mix 4"),
             Row(128, ((6000, 7000),), 128, 8192, note="mix 5"),
             Row(128, ((512, 4096),) * 4, 256, 2048, note="mix 6: chunked prefill as served"),
             Row(128, ((512, 4096),) * 2 + ((4, 4096),) * 64, 0, 4096, name="hd128 p2x512@4k+v64x4@4k",
                 note="mix 7: speculative verification (64 x 4 tokens) beside 2 chunks, through BatchAttention")]
    rows = mixes + [Row(128, ((512, 512),), 128, 2048), Row(128, ((1024, 1024),), 128, 2048),
                    Row(128, ((2048, 8192),), 128, 2048), Row(128, ((1024, 1024),), 64, 8192),
                    Row(128, ((1024, 1024),), 256, 1024), Row(128, ((512, 4096),) * 4, 128, 4096),
                    Row(64, ((2048, 2048),), 128, 2048), Row(256, ((2048, 2048),), 128, 2048),
                    Row(128, ((2048, 2048),), 128, 2048, "float8_e4m3fn"),
                    # (fp8 caches run the mma.sync POD on sm_90 too: where the serial pair is faster)
                    Row(128, ((4096, 4096),), 128, 4096, "float8_e4m3fn"),
                    Row(128, ((512, 4096),) * 4, 256, 2048, "float8_e4m3fn"),
                    Row(128, ((512, 512),), 128, 2048, "float8_e4m3fn")]
    if quick:
        rows = mixes
    return [r for r in rows if not only or any(o in r.label for o in only)]


# --- background jobs --------------------------------------------------------------------------------
OURS_WARMUP = r"""
import itertools, json, sys, time
t0 = time.perf_counter()
try:
    import torch
    import flashinfer_jit as fij
    hd, kvdt, what = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3]
    hq, hk, page, bf16, dev = 32, 8, 16, torch.bfloat16, "cuda"
    ws = lambda: torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    randn = lambda *s: torch.randn(*s, device=dev, dtype=bf16)

    def paged(lens, dtype):
        n = [-(-n // page) for n in lens]
        cache = tuple(randn(sum(n), page, hk, hd).to(dtype) for _ in "kv")
        indptr = torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32)
        last = torch.tensor([n_ - (m - 1) * page for n_, m in zip(lens, n)], dtype=torch.int32)
        return cache, indptr, torch.randperm(sum(n), device=dev).int(), last

    # one request and many, short and long, a partial last page: what plan() may pick kernels for
    for qo, kv, nd, dkv in ((40, 40, 3, 100), (1024, 1024, 16, 2048), (256, 2048, 64, 512)):
        q_p, q_d, k_p, v_p = randn(qo, hq, hd), randn(nd, hq, hd), randn(kv, hk, hd), randn(kv, hk, hd)
        cache_p, ip_p, ix_p, last_p = paged([kv], kvdt)
        cache_d, ip_d, ix_d, last_d = paged([dkv] * nd, kvdt)
        if what in ("pod", "pod_hopper"):
            if what == "pod_hopper" and torch.cuda.get_device_capability() != (9, 0):
                break
            w = fij.BatchPODWithPagedKVCacheWrapper(ws(), kv_layout="NHD")
            w.prefill_backend = "auto" if what == "pod_hopper" else "fa2"
            w.plan(torch.tensor([0, qo], dtype=torch.int32), ip_p, ix_p, last_p, torch.arange(nd + 1, dtype=torch.int32),
                   ip_d, ix_d, last_d, hq, hk, hd, page, q_data_type=bf16, kv_data_type=kvdt, causal=True)
            w.run(q_p, cache_p, q_d, cache_d, causal_p=True)
        elif what in ("pod_single", "pod_single_hopper"):
            if what == "pod_single_hopper" and torch.cuda.get_device_capability() != (9, 0):
                break
            w = fij.PODWithPagedKVCacheWrapper(ws(), kv_layout="NHD")
            w.prefill_backend = "auto" if what == "pod_single_hopper" else "fa2"
            w.plan(ip_d, ix_d, last_d, hq, hk, hd, page, q_data_type=bf16, kv_data_type=kvdt)
            w.run(q_p, k_p, v_p, q_d, cache_d, causal_p=True)
        elif what == "prefill":
            w = fij.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD")
            w.plan(torch.tensor([0, qo], dtype=torch.int32), ip_p, ix_p, last_p, hq, hk, hd, page, causal=True,
                   q_data_type=bf16, kv_data_type=kvdt)
            w.run(q_p, cache_p)
            fij.single_prefill_with_kv_cache(q_p, k_p, v_p, causal=True)
        else:
            w = fij.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True)
            w.plan(ip_d, ix_d, last_d, hq, hk, hd, page, q_data_type=bf16, kv_data_type=kvdt)
            w.run(q_d, cache_d)
    torch.cuda.synchronize()
    print(json.dumps({"ok": True, "seconds": time.perf_counter() - t0}))
except BaseException as exc:  # report anything, never hang the benchmark
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[-1500:], "seconds": time.perf_counter() - t0}))
"""

FLASHINFER_BUILD = r"""
import json, time
t0 = time.perf_counter()
try:
    import torch
    from flashinfer.jit import (build_jit_specs, gen_batch_attention_module, gen_batch_pod_module,
                                gen_batch_prefill_module, gen_pod_module)
    bf16, i32 = torch.bfloat16, torch.int32
    pod = (bf16, bf16, bf16, 128, 0, False, False, False, i32, 0, False, False)  # flashinfer/pod.py run()'s
    specs = {"prefill": gen_batch_prefill_module("fa2", bf16, bf16, bf16, i32, 128, 128, 0, False, False, False),
             "pod": gen_pod_module(*pod), "batch_pod": gen_batch_pod_module(*pod),
             # flashinfer/attention.py BatchAttention.plan()'s (q, kv, o dtypes, kv_indptr's dtype, head_dims,
             # no RoPE, no soft cap, no profiler): the persistent module
             "batch_attention": gen_batch_attention_module(bf16, bf16, bf16, i32, 128, 128, 0, False, False)}
    modules = {}
    try:
        build_jit_specs(list(specs.values()), verbose=False)  # one ninja, every module
        modules = {name: {"ok": True} for name in specs}
    except Exception:
        # ninja stops at the first failure: the three modules of before in one ninja again (what
        # the first one finished is kept), the persistent one alone, one by one where a group fails
        for group in (("prefill", "pod", "batch_pod"), ("batch_attention",)):
            try:
                build_jit_specs([specs[name] for name in group], verbose=False)
                modules.update({name: {"ok": True} for name in group})
                continue
            except Exception:
                pass
            for name in group:  # which one failed
                try:
                    specs[name].build(verbose=False)
                    modules[name] = {"ok": True}
                except Exception as exc:
                    modules[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-1500:]}
    print(json.dumps({"ok": True, "modules": modules, "seconds": time.perf_counter() - t0}))
except BaseException as exc:
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[-1500:], "seconds": time.perf_counter() - t0}))
"""


class Job:
    """A background process in its own process group that prints one JSON line (logs in logdir)."""

    def __init__(self, name: str, code: str, argv: list[str], logdir: Path, env=None, nice: int = 0):
        self.name, self.started, self.result = name, time.perf_counter(), None
        self.out, self.err = logdir / f"{name}.out", logdir / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=out, stderr=err, cwd=bc.REPO,
                                         env=env, start_new_session=True,
                                         preexec_fn=(lambda: os.nice(nice)) if nice else None)

    def poll(self) -> dict | None:
        if self.result is None and self.proc.poll() is not None:
            lines = [ln for ln in self.out.read_text(errors="replace").splitlines() if ln.startswith("{")]
            try:
                self.result = json.loads(lines[-1])
            except (IndexError, json.JSONDecodeError):
                tail = self.err.read_text(errors="replace")[-1500:]
                self.result = {"ok": False, "error": f"exit {self.proc.returncode}: {tail}"}
            self.result["wall_s"] = time.perf_counter() - self.started
            bc.log(f"builds: {self.name} {'ok' if self.result.get('ok') else 'FAILED'} ({self.result['wall_s']:.0f} s)")
        return self.result

    def kill(self, reason: str) -> None:
        if self.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group we started (python, ninja, nvcc)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            self.result = {"ok": False, "error": reason, "wall_s": time.perf_counter() - self.started}


def wait_jobs(jobs: list[Job], until: float) -> None:
    while any(j.poll() is None for j in jobs) and time.perf_counter() < until:
        time.sleep(0.2)


def start_warmups(rows: list[Row], logdir: Path) -> list[Job]:
    keys = set()
    for r in rows:
        keys |= {(r.head_dim, r.kv_dtype, "pod"), (r.head_dim, r.kv_dtype, "decode"),
                 (r.head_dim, r.kv_dtype, "prefill")} | ({(r.head_dim, r.kv_dtype, "pod_single")} if r.single else set())
        if r.kv_dtype == "bfloat16":  # (POD on Hopper: 16-bit caches)
            keys.add((r.head_dim, r.kv_dtype, "pod_hopper"))
            if r.single:
                keys.add((r.head_dim, r.kv_dtype, "pod_single_hopper"))
    return [Job(f"ours_hd{hd}_{dt}_{what}", OURS_WARMUP, [str(hd), dt, what], logdir) for hd, dt, what in sorted(keys)]


def fi_reason(job: Job | None, impl: str) -> str | None:
    """None if FlashInfer's module for `impl` was built, else why not."""
    r = job.poll() if job else {"ok": False, "error": "not started"}
    if r is None:
        return "build still running"
    if not r.get("ok"):
        return f"build failed: {r.get('error')}"[:600]
    m = r.get("modules", {}).get(FI_MODULE[impl], {})
    return None if m.get("ok") else f"{FI_MODULE[impl]} build failed: {m.get('error')}"[:600]


# --- inputs and implementations ---------------------------------------------------------------------
class Inputs:
    """q for the prefill [sum qo, Hq, D] and the decodes [n, Hq, D]; one paged pool (at the row's KV
    dtype) whose pages, in a random permutation, hold the prefill contexts and the decode caches; the
    single prefill's K/V as ragged bf16 [kv, Hk, D] copies of its pages."""

    def __init__(self, row: Row, seed: int):
        import torch

        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        d, bf16, i32 = row.head_dim, torch.bfloat16, torch.int32
        self.kv_dtype = getattr(torch, row.kv_dtype)

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=DEVICE, dtype=bf16)

        def perm(n):
            return torch.randperm(n, generator=gen, device=DEVICE).to(i32)

        pages_p = [-(-kv // PAGE_SIZE) for _, kv in row.prefill]
        per_d = -(-row.decode_kv // PAGE_SIZE)
        n_p, n_d = sum(pages_p), row.decodes * per_d
        self.cache_p = self.cache_d = tuple(randn(n_p + n_d, PAGE_SIZE, NUM_KV_HEADS, d).to(self.kv_dtype)
                                            for _ in "kv")
        ids = perm(n_p + n_d)
        self.indices_p, self.indices_d = ids[:n_p].contiguous(), ids[n_p:].contiguous()
        self.qo_indptr_p = torch.tensor([0, *itertools.accumulate(qo for qo, _ in row.prefill)], dtype=i32)
        self.kv_indptr_p = torch.tensor([0, *itertools.accumulate(pages_p)], dtype=i32)
        self.last_p = torch.tensor([kv - (p - 1) * PAGE_SIZE for (_, kv), p in zip(row.prefill, pages_p)], dtype=i32)
        self.qo_indptr_d = torch.arange(row.decodes + 1, dtype=i32)
        self.kv_indptr_d = torch.arange(0, n_d + 1, per_d, dtype=i32)
        self.last_d = torch.full((row.decodes,), row.decode_kv - (per_d - 1) * PAGE_SIZE, dtype=i32)
        self.q_p = randn(sum(qo for qo, _ in row.prefill), NUM_QO_HEADS, d)
        self.q_d = randn(row.decodes, NUM_QO_HEADS, d)
        if row.single:
            kv = row.prefill[0][1]
            self.k_p, self.v_p = (c[self.indices_p.long()].reshape(-1, NUM_KV_HEADS, d)[:kv].to(bf16).contiguous()
                                  for c in self.cache_p)


class Batch(NamedTuple):
    """The row as one mixed batch (BatchAttention's plan() and run() arguments), built once
    outside the timing, and where its prefill and decode rows lie."""
    qo_indptr: object    # [B + 1] int32, host
    kv_indptr: object    # [B + 1] int32, host
    kv_indices: object   # page ids, int32, on the device: the requests' pages in batch order
    kv_len_arr: object   # [B] int32, host: keys in tokens
    q: object            # [tokens, Hq, D] on the device
    rows_p: object       # the prefill rows (q_p's order) in q, int64 on the device
    rows_d: object       # the decode rows (q_d's order) in q


def batch_order(row: Row, interleaved: bool) -> list[tuple[str, int]]:
    """The requests of the row's batch: ("d", i) the decode i, ("p", j) the prefill chunk j.
    Decodes first, then the prefill requests (vLLM's and SGLang's order: each side's rows
    one run); interleaved: prefill j after decode (j + 1) * n_d // (n_p + 1) (one prefill: in
    the middle), so that neither side's rows are one run."""
    n_d, n_p = row.decodes, len(row.prefill)
    if not interleaved:
        return [("d", i) for i in range(n_d)] + [("p", j) for j in range(n_p)]
    order, after = [], [(j + 1) * n_d // (n_p + 1) for j in range(n_p)]
    for i in range(n_d + 1):
        order += [("p", j) for j in range(n_p) if after[j] == i]
        if i < n_d:
            order.append(("d", i))
    return order


def make_batch(x: Inputs, row: Row, interleaved: bool) -> Batch:
    """One batch over x's tensors: q the rows of q_d and q_p in batch order, the page table the
    pod form's pages (indices_d's and indices_p's) in batch order, kv_len_arr the lengths."""
    import torch

    i32 = torch.int32
    qo_p, kv_p, kv_d = (t.tolist() for t in (x.qo_indptr_p, x.kv_indptr_p, x.kv_indptr_d))
    qs, pages, rows, qo, kv, lens = [], [], {"p": [], "d": []}, [0], [0], []
    for side, i in batch_order(row, interleaved):
        if side == "d":
            q, ids, n = x.q_d[i:i + 1], x.indices_d[kv_d[i]:kv_d[i + 1]], row.decode_kv
        else:
            q, ids, n = x.q_p[qo_p[i]:qo_p[i + 1]], x.indices_p[kv_p[i]:kv_p[i + 1]], row.prefill[i][1]
        rows[side].append(torch.arange(qo[-1], qo[-1] + q.shape[0]))
        qs.append(q)
        pages.append(ids)
        qo.append(qo[-1] + q.shape[0])
        kv.append(kv[-1] + ids.numel())
        lens.append(n)
    return Batch(torch.tensor(qo, dtype=i32), torch.tensor(kv, dtype=i32), torch.cat(pages).contiguous(),
                 torch.tensor(lens, dtype=i32), torch.cat(qs).contiguous(),
                 *(torch.cat(rows[side] or [torch.arange(0)]).to(DEVICE) for side in "pd"))


def make(name: str, x: Inputs, row: Row, fi):
    """Provider `name` planned on x (outside the timing): a zero-argument call that runs it and
    returns its output ((prefill out, decode out) for the POD and serial forms; BatchAttention
    returns (out, lse) of the whole batch, and its call's `parts` gives (prefill out, decode out)
    of that for the check)."""
    import torch

    import flashinfer_jit as fij

    lib = fi if name.startswith("flashinfer_") else fij
    base, d, bf16 = name.removeprefix("flashinfer_"), row.head_dim, torch.bfloat16
    heads = (NUM_QO_HEADS, NUM_KV_HEADS, d, PAGE_SIZE)

    def ws():
        return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=DEVICE)

    if base.startswith("batch_attention"):
        b = make_batch(x, row, interleaved=base == "batch_attention_interleaved")
        # (use_cuda_graph: ours only; FlashInfer 0.5.3's BatchAttention takes no such argument)
        graph = {"use_cuda_graph": True} if base == "batch_attention_graph" else {}
        w = lib.BatchAttention(kv_layout="NHD", device=DEVICE, **graph)
        if base == "batch_attention_t64":
            w._prefill._force_tile_rows = 64
        if base == "batch_attention_hopper":
            w.prefill_backend = "auto"
        # FlashInfer's plan() synchronizes the device (and reads the index tensors on the host); ours takes
        # host tensors without any synchronization
        # (batch_attention_rope: in-kernel RoPE, every request on the prefill side; not checked here, its
        # outputs are another function's: tests/test_batch_attention.py checks them)
        rope = {"pos_encoding_mode": "ROPE_LLAMA"} if base == "batch_attention_rope" else {}
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len_arr, NUM_QO_HEADS, NUM_KV_HEADS, d, d, PAGE_SIZE,
               causal=True, q_data_type=bf16, kv_data_type=x.kv_dtype, **rope)
        out = torch.empty(b.q.shape[0], NUM_QO_HEADS, d, dtype=bf16, device=DEVICE)
        lse = torch.empty(b.q.shape[0], NUM_QO_HEADS, dtype=torch.float32, device=DEVICE)

        def run():
            return w.run(b.q, x.cache_p, out=out, lse=lse)

        if base == "batch_attention_graph":  # run() captured once (after warm-up runs), timed as a replay
            graph = bc.capture_graph(lambda _: w.run(b.q, x.cache_p, out=out, lse=lse), inner=1)

            def run():  # noqa: F811
                graph.replay()
                return out, lse

            run.wrapper = w  # (the graph reads the wrapper's buffers: it must outlive the graph)

        run.parts = lambda got: (got[0].index_select(0, b.rows_p), got[0].index_select(0, b.rows_d))
        return run
    if base in ("pod", "pod_hopper"):
        w = lib.BatchPODWithPagedKVCacheWrapper(ws(), kv_layout="NHD")
        if base == "pod_hopper":
            w.prefill_backend = "auto"
        # ours plans the prefill's mask at plan() (causal: not in FlashInfer; else re-planned at the first run())
        causal = {"causal": True} if "causal" in inspect.signature(w.plan).parameters else {}
        w.plan(x.qo_indptr_p, x.kv_indptr_p, x.indices_p, x.last_p, x.qo_indptr_d, x.kv_indptr_d, x.indices_d,
               x.last_d, *heads, q_data_type=bf16, kv_data_type=x.kv_dtype, **causal)
        return lambda: w.run(x.q_p, x.cache_p, x.q_d, x.cache_d, causal_p=True)
    if base in ("pod_single", "pod_single_hopper"):
        w = lib.PODWithPagedKVCacheWrapper(ws(), kv_layout="NHD")
        if base == "pod_single_hopper":
            w.prefill_backend = "auto"
        w.plan(x.kv_indptr_d, x.indices_d, x.last_d, *heads, q_data_type=bf16, kv_data_type=x.kv_dtype)
        return lambda: w.run(x.q_p, x.k_p, x.v_p, x.q_d, x.cache_d, causal_p=True)
    if base in ("serial_single", "prefill_single_only"):
        def prefill():
            return lib.single_prefill_with_kv_cache(x.q_p, x.k_p, x.v_p, causal=True)
    elif base != "decode_only":
        pw = lib.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD", **({"backend": "fa2"} if lib is fi else {}))
        pw.plan(x.qo_indptr_p, x.kv_indptr_p, x.indices_p, x.last_p, *heads, causal=True, q_data_type=bf16,
                kv_data_type=x.kv_dtype)

        def prefill():
            return pw.run(x.q_p, x.cache_p)
    if base.startswith("prefill"):
        if row.decodes == 0:  # the whole batch (checked against): no decode rows
            return lambda: (prefill(), x.q_d)
        return prefill
    dw = lib.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=True)
    dw.plan(x.kv_indptr_d, x.indices_d, x.last_d, *heads, q_data_type=bf16, kv_data_type=x.kv_dtype)
    if base == "decode_only":
        return lambda: dw.run(x.q_d, x.cache_d)
    return lambda: (prefill(), dw.run(x.q_d, x.cache_d))


def compare(got, ref) -> dict:
    """max |got - ref| of the prefill and the decode outputs (NaN: None); agrees below MAX_ABS_DIFF."""
    import torch

    out = {}
    for part, a, b in (("prefill", got[0], ref[0]), ("decode", got[1], ref[1])):
        if a.shape != b.shape:
            out[part] = f"shape {tuple(a.shape)}, expected {tuple(b.shape)}"
            continue
        if a.numel() == 0:  # a batch without rows of this kind (mix 7: no one-token decodes)
            out[part] = 0.0
            continue
        diff = (a.float() - b.float()).abs()
        out[part] = None if bool(torch.isnan(diff).any()) else float(diff.max())
    worst = [v for v in out.values() if isinstance(v, float)]
    ok = len(worst) == 2 and max(worst) < MAX_ABS_DIFF
    return {"prefill_max_abs_diff": out["prefill"], "decode_max_abs_diff": out["decode"],
            "max_abs_diff": max(worst) if len(worst) == 2 else None, "agrees": ok}


def measure(row: Row, names: list[str], refs: list[str], ctx, seed: int) -> tuple[dict, dict]:
    """Plan every provider of `names` (timed) and `refs` (checked against only), run each once for
    the check, then time `names` interleaved. Returns (entries, checks)."""
    import torch

    x = Inputs(row, seed)
    entries, outs, timed = {}, {}, []
    for name in refs + names:
        try:
            fn = make(name, x, row, ctx["fi"])
            got = fn()
            torch.cuda.synchronize()
            if hasattr(fn, "parts"):  # one batch's output: its prefill and decode rows
                got = fn.parts(got)
            outs[name] = tuple(t.clone() for t in got) if isinstance(got, tuple) else got.clone()
            if name in names:
                timed.append((name, fn))
        except Exception as exc:  # noqa: BLE001  (one failing provider must not end the row)
            entries[name] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
            bc.log(f"{row.label} {name}: {entries[name]['error']}")
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001  (a sticky CUDA error: the next rows will say so)
                pass
    for (name, _), t in zip(timed, bp.time_interleaved([fn for _, fn in timed], ctx["reps"], ctx["flush"])):
        if "error" not in t:
            t["samples_us"] = [round(s, 2) for s in t.pop("_samples", [])]
        entries[name] = t
    checks = {}
    for n, against in CHECKS.items():
        r = next((r for r in against if r in outs), None)
        if n in outs and n in names and r:
            checks[n] = compare(outs[n], outs[r]) | {"against": r}
    del x, outs, timed
    torch.cuda.empty_cache()
    return entries, checks


def derive(res: dict) -> None:
    im = res["impls"]
    us = {k: v.get("median_us") for k, v in im.items()}
    sp, paired = {}, {}

    def ratio(key, num, den):
        if num and den:
            sp[key] = num / den

    for pod, serial, pre in (("pod", "serial", "prefill_only"), ("pod_single", "serial_single", "prefill_single_only")):
        ideal = max(us[pre], us["decode_only"]) if us.get(pre) and us.get("decode_only") else None
        ratio(f"{pod}_vs_{serial}", us.get(serial), us.get(pod))
        ratio(f"{pod}_vs_ideal", ideal, us.get(pod))
        if ideal and us.get(pod) and us.get(serial) and us[serial] > ideal:
            sp[f"{pod}_overlap_captured"] = (us[serial] - us[pod]) / (us[serial] - ideal)
        p = bp.paired_ratio(im.get(pod, {}).get("samples_us") or [], im.get(serial, {}).get("samples_us") or [])
        if p:
            paired[f"{serial}_over_{pod}"] = p
        pass2 = im.get(pod, {}).get("pass2", {})
        ratio(f"{pod}_vs_flashinfer_{pod}", us.get(f"flashinfer_{pod}"), pass2.get("median_us"))
        p = bp.paired_ratio(pass2.get("samples_us") or [], im.get(f"flashinfer_{pod}", {}).get("samples_us") or [])
        if p:
            paired[f"flashinfer_{pod}_over_{pod}"] = p
        ratio(f"flashinfer_{pod}_vs_flashinfer_serial", us.get("flashinfer_serial"), us.get(f"flashinfer_{pod}"))
    # BatchAttention: the same pass as pod and serial; FlashInfer's against ours' pass2
    samples = {k: v.get("samples_us") or [] for k, v in im.items()}
    ratio("batch_attention_vs_pod", us.get("pod"), us.get("batch_attention"))
    ratio("batch_attention_vs_serial", us.get("serial"), us.get("batch_attention"))
    ratio("batch_attention_vs_interleaved", us.get("batch_attention_interleaved"), us.get("batch_attention"))
    for other in ("pod", "batch_attention_interleaved"):
        p = bp.paired_ratio(samples.get("batch_attention", []), samples.get(other, []))
        if p:
            paired[f"{other}_over_batch_attention"] = p
    pass2 = im.get("batch_attention", {}).get("pass2", {})
    ratio("flashinfer_ba_vs_ours", us.get("flashinfer_batch_attention"), pass2.get("median_us"))  # FI's time / ours
    p = bp.paired_ratio(pass2.get("samples_us") or [], samples.get("flashinfer_batch_attention", []))
    if p:
        paired["flashinfer_batch_attention_over_batch_attention"] = p
    ratio("flashinfer_batch_attention_vs_flashinfer_pod", us.get("flashinfer_pod"),
          us.get("flashinfer_batch_attention"))
    # POD on Hopper: against our serial pair (its prefill the Hopper kernel where auto takes it)
    # and the mma.sync POD in the first pass; FlashInfer's against its second-pass times
    ratio("pod_hopper_vs_serial", us.get("serial"), us.get("pod_hopper"))
    ratio("pod_hopper_vs_pod", us.get("pod"), us.get("pod_hopper"))
    if us.get("prefill_only") and us.get("decode_only"):
        ratio("pod_hopper_vs_ideal", max(us["prefill_only"], us["decode_only"]), us.get("pod_hopper"))
    ratio("batch_attention_hopper_vs_serial", us.get("serial"), us.get("batch_attention_hopper"))
    h2 = im.get("pod_hopper", {}).get("pass2", {})
    ratio("pod_hopper_vs_flashinfer_pod", us.get("flashinfer_pod"), h2.get("median_us"))
    s2 = im.get("pod_single_hopper", {}).get("pass2", {})
    ratio("pod_single_hopper_vs_serial_single", us.get("serial_single"), us.get("pod_single_hopper"))
    ratio("pod_single_hopper_vs_flashinfer_pod_single", us.get("flashinfer_pod_single"), s2.get("median_us"))
    ba2 = im.get("batch_attention_hopper", {}).get("pass2", {})
    ratio("flashinfer_ba_vs_batch_attention_hopper", us.get("flashinfer_batch_attention"), ba2.get("median_us"))
    res["speedup"], res["paired"] = sp, paired
    res["mismatch"] = any(not c["agrees"] for n, c in res["check"].items() if not n.startswith("flashinfer"))


# --- report -----------------------------------------------------------------------------------------
def _us(entry: dict | None, key: str = "median_us"):
    if not entry:
        return None
    if key in entry:
        return entry[key]
    return "err" if "error" in entry else "skip" if "skipped" in entry else None


CHECKED_OURS = ("pod", "pod_single", "batch_attention", "batch_attention_interleaved", *HOPPER)


def _check(res: dict, names) -> str:
    short = {"pod": "pod", "pod_single": "pod1", "batch_attention": "BA", "batch_attention_interleaved": "BAi",
             "flashinfer_pod": "pod", "flashinfer_pod_single": "pod1", "flashinfer_serial": "serial",
             "flashinfer_batch_attention": "BA", "pod_hopper": "podH", "batch_attention_hopper": "BAH",
             "pod_single_hopper": "pod1H"}
    parts = [f"{short[n]} {'ok' if c['agrees'] else 'DIFF'} " + ("NaN" if c["max_abs_diff"] is None else
                                                              f"{c['max_abs_diff']:.4f}")
             for n, c in res["check"].items() if n in names]
    return ("MISMATCH " if res.get("mismatch") and names == CHECKED_OURS else "") + ", ".join(parts)


COLS1 = ["row", "pod", "pod1", "serial", "serial1", "prefill", "pre1", "decode", "BA", "ser/pod", "idl/pod",
         "ser1/pod1", "idl1/pod1", "pod/BA", "check"]
COLS2 = ["row", "pod", "pod1", "BA", "FI pod", "FI pod1", "FI serial", "FI BA", "FI/pod", "FI1/pod1", "FIBA/BA",
         "FIs/FIpod", "FI check"]
COLS3 = ["row", "pod", "BA", "BAi", "pod/BA", "ser/BA", "BAi/BA", "BAi/BA paired", "BAgraph", "BArope", "BA t64"]
COLS4 = ["row", "podH", "BAH", "serial", "pod", "ser/podH", "pod/podH", "idl/podH", "FI/podH", "FIBA/BAH",
         "pod1H", "ser1/pod1H", "FI1/pod1H", "check"]


def line1(res: dict) -> list:
    im, sp = res["impls"], res["speedup"]
    return [res["label"], *[_us(im.get(k)) for k in OURS
                            if k not in ("batch_attention_interleaved", "batch_attention_t64", *HOPPER)],
            sp.get("pod_vs_serial"), sp.get("pod_vs_ideal"), sp.get("pod_single_vs_serial_single"),
            sp.get("pod_single_vs_ideal"), sp.get("batch_attention_vs_pod"), _check(res, CHECKED_OURS)]


def line2(res: dict) -> list:
    im, sp = res["impls"], res["speedup"]
    return [res["label"], *[_us(im.get(k, {}).get("pass2")) for k in ("pod", "pod_single", "batch_attention")],
            *[_us(im.get(k)) for k in FI], sp.get("pod_vs_flashinfer_pod"),
            sp.get("pod_single_vs_flashinfer_pod_single"), sp.get("flashinfer_ba_vs_ours"),
            sp.get("flashinfer_pod_vs_flashinfer_serial"), _check(res, FI)]


def line3(res: dict) -> list:
    im, sp = res["impls"], res["speedup"]
    return [res["label"], *[_us(im.get(k)) for k in ("pod", "batch_attention", "batch_attention_interleaved")],
            sp.get("batch_attention_vs_pod"), sp.get("batch_attention_vs_serial"),
            sp.get("batch_attention_vs_interleaved"),
            res["paired"].get("batch_attention_interleaved_over_batch_attention", {}).get("median"),
            _us(im.get("batch_attention_graph")), _us(im.get("batch_attention_rope")),
            bc._cell(_us(im.get("batch_attention_t64")))]  # (fmt prints the last cell as given)


def line4(res: dict) -> list:
    """POD on Hopper's row (prefill_backend="auto"): its times, and its ratios to ours and FlashInfer's."""
    im, sp = res["impls"], res["speedup"]
    return [res["label"], *[_us(im.get(k)) for k in ("pod_hopper", "batch_attention_hopper", "serial", "pod")],
            sp.get("pod_hopper_vs_serial"), sp.get("pod_hopper_vs_pod"), sp.get("pod_hopper_vs_ideal"),
            sp.get("pod_hopper_vs_flashinfer_pod"), sp.get("flashinfer_ba_vs_batch_attention_hopper"),
            _us(im.get("pod_single_hopper")), sp.get("pod_single_hopper_vs_serial_single"),
            sp.get("pod_single_hopper_vs_flashinfer_pod_single"), _check(res, HOPPER)]


def fmt(cells: list) -> str:
    return f"{bc._cell(cells[0]):34s}" + "".join(f"{bc._cell(c):>10s}" for c in cells[1:-1]) + f"  {cells[-1]}"


def report(res: dict) -> str:
    m, fi = res["meta"], res["flashinfer"]
    lines = [(f"device {m.get('device')}, commit {m.get('commit')}, {m.get('date')}, torch {m.get('torch')}; "
              f"FlashInfer {fi.get('version') or fi.get('reason') or 'not measured (see builds)'}"),
             ("us per call (median); ser/pod: serial over pod; idl/pod: max(prefill, decode alone) over pod "
              "(1: full overlap); 1: the single-prefill form; BA: BatchAttention on the same batch, decodes first "
              "(pod/BA: pod over BA, ideally 1.0)"), bc.table([line1(r) for r in res["rows"]], COLS1)]
    ba_rows = [r for r in res["rows"] if "median_us" in r["impls"].get("batch_attention", {})]
    if ba_rows:
        lines += ["", ("BatchAttention (BA: decodes first, in place; BAi: the prefills among the decodes, a "
                       "gather of q and a scatter of out / lse; x/BA: x's time over BA's; BAgraph: a "
                       "use_cuda_graph=True BatchAttention's replay; BArope: with in-kernel RoPE)"),
                  bc.table([line3(r) for r in ba_rows], COLS3)]
    if any(any(k in r["impls"] and "median_us" in r["impls"][k] for k in FI) for r in res["rows"]):
        lines += ["", ("FlashInfer (pod, pod1, BA: ours again, interleaved with FlashInfer; FI/pod, FIBA/BA: "
                       "FlashInfer's time over ours)"),
                  bc.table([line2(r) for r in res["rows"] if r["flashinfer_row"]], COLS2)]
    hopper_rows = [r for r in res["rows"] if any("median_us" in r["impls"].get(k, {}) for k in HOPPER)]
    if hopper_rows:
        lines += ["", ("POD on Hopper (podH: batch POD, BAH: BatchAttention, pod1H: the single form, "
                       "prefill_backend='auto'; x/podH: x's time over podH's; FlashInfer's over podH's, BAH's and "
                       "pod1H's second-pass times)"),
                  bc.table([line4(r) for r in hopper_rows], COLS4)]
    lines += [f"skipped {s['row']}: {s['reason']}" for s in res["skipped"]]
    return "\n".join(lines)


# --- the run ----------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--list", action="store_true", help="print the rows, then exit (no GPU needed)")
    p.add_argument("--quick", action="store_true", help="3 rows (head_dim 128 bf16) and --reps 30 unless given")
    p.add_argument("--rows", default="", help="only rows whose label contains one of these ';'-separated strings")
    p.add_argument("--reps", type=int, default=None, help="timed runs per implementation (default 50, --quick 30; "
                                                          "twice as many under 1 ms)")
    p.add_argument("--time-limit", type=float, default=200.0,
                   help="seconds for the whole run, builds included (default 200); rows that would end past it "
                        "are skipped and listed")
    p.add_argument("--out", default=None, help="JSON file (default $OUT/bench_pod.json)")
    p.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer (and its build)")
    p.add_argument("--build-only", action="store_true", help="build our modules and FlashInfer's, then exit")
    args = p.parse_args(argv)
    args.only = tuple(o.strip() for o in args.rows.split(";") if o.strip())
    args.reps = args.reps or (30 if args.quick else 50)
    args.out = args.out or bc.default_out("bench_pod.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = row_list(args.quick, args.only)
    if args.list:
        for r in rows:
            print(f"{r.label:34s} forms {'batch+single' if r.single else 'batch':12s} prefill "
                  f"{r.prefill_flops() / 1e12:6.3f} TFLOP  decode KV {r.decode_kv_bytes() / 1e9:5.2f} GB  "
                  f"~{r.est_us():5.0f} us  {'+FlashInfer' if r.flashinfer else ''}"
                  f"{'  +interleaved' if r.interleaved else ''}")
        return 0
    if not rows:
        print(f"bench_pod: no row matches --rows {args.rows!r} (see --list)", file=sys.stderr)
        return 2
    if bc.no_gpu("bench_pod", " (run it on the GPU machine)"):
        return 2
    started = time.perf_counter()
    deadline = started + args.time_limit
    logdir = Path(tempfile.mkdtemp(prefix="bench_pod_builds_"))
    fi_info = bp.flashinfer_status(not args.no_flashinfer)
    fi_rows = [r for r in rows if r.flashinfer]
    fi_job = Job("flashinfer_hd128", FLASHINFER_BUILD, [], logdir, bp.fi_env(), nice=10) \
        if fi_info["available"] and fi_rows else None
    warmups = start_warmups(rows, logdir)
    jobs = warmups + ([fi_job] if fi_job else [])
    try:
        return run(args, rows, fi_info, fi_job, warmups, jobs, logdir, started, deadline)
    finally:  # whatever happened, no build of ours outlives the run
        for j in jobs:
            j.kill("ended: the run finished first")


def run(args, rows, fi_info, fi_job, warmups, jobs, logdir, started, deadline) -> int:
    import torch

    res = {"benchmark": "bench_pod", "meta": bc.run_metadata(), "flashinfer": fi_info, "rows": [], "skipped": [],
           "config": {"dtype": "bfloat16", "num_qo_heads": NUM_QO_HEADS, "num_kv_heads": NUM_KV_HEADS,
                      "page_size": PAGE_SIZE, "kv_layout": "NHD", "causal_prefill": "bottom-right aligned",
                      "page_table": "csr; page ids a random permutation of one pool (the row's KV dtype) holding the "
                                    "prefill contexts and the decode caches; the single form's ragged K/V: bf16 copies",
                      "inputs": "standard normal q, K, V", "reps": args.reps, "quick": args.quick,
                      "rows": list(args.only), "time_limit_s": args.time_limit, "flashinfer_scope": FI_SCOPE,
                      "timing": "bench_prefill.time_interleaved: CUDA events around each eager call (plan() "
                                "outside), L2 flushed before each, >= 200 ms warm-up, --reps runs (2x under 1 ms), "
                                "the row's providers interleaved; FlashInfer in a second pass with ours' pod, "
                                "pod_single and batch_attention again (impls.pod.pass2, ...), which its ratios use",
                      "speedup": "x_vs_y: y's median over x's (> 1: x faster); ideal = max(prefill_only, "
                                 "decode_only); overlap_captured = (serial - pod) / (serial - ideal); except "
                                 "flashinfer_ba_vs_ours: flashinfer_batch_attention's median over batch_attention's "
                                 "pass2 (> 1: ours faster, as pod_vs_flashinfer_pod)",
                      "batch_attention": "BatchAttention.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, ..., "
                                         "causal=True) on the row as one batch: the decodes, then the prefill "
                                         "requests; q = cat(q_d, q_p) and the page table = the pod form's pages in "
                                         "that order (both built before the timing); run(q, cache, out=, lse=) into "
                                         "buffers allocated once; batch_attention_interleaved (rows with "
                                         "interleaved): prefill j after decode (j + 1) * decodes // (prefills + 1)",
                      "check": f"each POD's (prefill, decode) outputs against the serial ones of the same form, each "
                               f"BatchAttention's (its prefill and decode rows) against pod's (serial's where pod "
                               f"failed): max abs diff, agrees below {MAX_ABS_DIFF:g}; mismatch: one of ours does "
                               f"not"}}
    bc.log(f"bench_pod: {len(rows)} rows; FlashInfer {'building' if fi_job else fi_info.get('reason')}; "
           f"{len(warmups)} warm-ups of ours")
    wait_jobs(warmups, deadline - RESERVE_S)  # they run kernels: all end before anything is timed
    for j in warmups:
        j.kill(f"ended: not finished {args.time_limit:g} s into the run (--time-limit)")
    if args.build_only:
        wait_jobs(jobs, deadline - RESERVE_S)
    res["builds"] = {"logs": str(logdir), "ours": {j.name: j.poll() or {"ok": False, "error": "still running"}
                                                   for j in warmups}}
    ctx = {"fi": None, "reps": args.reps, "flush": bp.Flush() if not args.build_only else None}
    torch.manual_seed(0)
    measured = []
    if not args.build_only:
        print(fmt(COLS1), flush=True)
    for index, row in enumerate([] if args.build_only else rows):
        names = row.impls(OURS)
        base = {"label": row.label, "head_dim": row.head_dim, "prefill": [list(c) for c in row.prefill],
                "decodes": row.decodes, "decode_kv": row.decode_kv, "kv_dtype": row.kv_dtype,
                "prefill_flops": row.prefill_flops(), "decode_kv_bytes": row.decode_kv_bytes(),
                "flashinfer_row": row.flashinfer, "interleaved_row": row.interleaved,
                **({"reference": row.note} if row.note else {})}
        if time.perf_counter() + row.budget_s(len(names), args.reps) > deadline - RESERVE_S:
            res["skipped"].append({"row": row.label, "reason": f"--time-limit {args.time_limit:g} s: no time left"})
            continue
        try:
            entries, checks = measure(row, names, [], ctx, seed=index)
        except Exception as exc:  # noqa: BLE001  (e.g. out of memory building the inputs)
            res["skipped"].append({"row": row.label, "reason": f"{type(exc).__name__}: {exc}"[:800]})
            bc.log(f"{row.label}: {res['skipped'][-1]['reason']}")
            torch.cuda.empty_cache()
            continue
        r = base | {"impls": entries, "check": checks}
        for impl in row.impls(FI):
            r["impls"][impl] = {"skipped": fi_info.get("reason") or ("FlashInfer measured in the second pass" if
                                                                      row.flashinfer else FI_SCOPE)}
        derive(r)
        res["rows"].append(r)
        measured.append((index, row, r))
        print(fmt(line1(r)), flush=True)
    # FlashInfer: a second pass over its rows, once its modules are built
    todo = [(i, row, r) for i, row, r in measured if row.flashinfer]
    if fi_job and (todo or args.build_only):
        first = min([row.budget_s(len(row.impls(FI)) + 3, args.reps) for _, row, _ in todo] or [0])
        wait_jobs([fi_job], deadline - RESERVE_S - first)
        fi_job.kill(f"ended: not finished {args.time_limit:g} s into the run (--time-limit)")
        res["builds"]["flashinfer"] = fi_job.poll()
        if fi_job.poll().get("ok") and todo:
            try:
                import flashinfer

                ctx["fi"], fi_info["version"] = flashinfer, getattr(flashinfer, "__version__", "?")
            except Exception as exc:  # noqa: BLE001  (a peer failing must not end the benchmark)
                fi_info.update(available=False, reason=f"import failed: {type(exc).__name__}: {exc}"[:800])
        if todo:
            print("\n" + fmt(COLS2), flush=True)
        for index, row, r in todo:
            why = {n: fi_info.get("reason") or fi_reason(fi_job, n) or (None if ctx["fi"] else "not imported")
                   for n in row.impls(FI)}
            names = [n for n, w in why.items() if w is None]
            r["impls"].update({n: {"skipped": w} for n, w in why.items() if w})
            if not names:
                continue
            ours = [n for n in ("pod", "pod_single", "batch_attention", *HOPPER) if "median_us" in r["impls"].get(n, {})]
            if time.perf_counter() + row.budget_s(len(names) + len(ours), args.reps) > deadline - RESERVE_S:
                for n in names:
                    r["impls"][n] = {"skipped": f"--time-limit {args.time_limit:g} s: no time left"}
                continue
            refs = [n for n in ("serial", "serial_single") if n in row.impls(OURS)]
            try:
                entries, checks = measure(row, ours + names, refs, ctx, seed=index)
            except Exception as exc:  # noqa: BLE001  (e.g. out of memory building the inputs)
                r["impls"].update({n: {"error": f"{type(exc).__name__}: {exc}"[:800]} for n in names})
                torch.cuda.empty_cache()
                continue
            for n in ours:
                r["impls"][n]["pass2"] = entries.get(n, {"error": "not run"})
            r["impls"].update({n: entries.get(n, {"error": "not run"}) for n in names})
            r["check"].update({n: c for n, c in checks.items() if n in names})
            derive(r)
            print(fmt(line2(r)), flush=True)
    if fi_job:
        fi_job.kill(f"ended: not finished {args.time_limit:g} s into the run (--time-limit)")
        res["builds"]["flashinfer"] = fi_job.poll()
    res["flashinfer"] = fi_info
    print()
    return bc.finish(args.out, res, report, started)


if __name__ == "__main__":
    sys.exit(main())

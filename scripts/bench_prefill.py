#!/usr/bin/env python3
"""Benchmark batch prefill (BatchPrefillWithPagedKVCacheWrapper / BatchPrefillWithRaggedKVCacheWrapper)
against FlashInfer's FA2 and FA3 backends, torch SDPA and the bf16 matmul rate.

Measures, in one process on one GPU (docs/prefill.md, "Speed"):
  - the ceilings: the bf16 matmul rate (torch.matmul 8192^3, TFLOP/s) and the copy bandwidth;
  - bf16 q/K/V/out, 32 query / 8 KV heads (GQA-4), head_dim 64, 128 and 256 (--head-dims),
    page 16 (NHD, CSR page table, pages in random order) and ragged K/V, per row:
      prefill, causal and not, batch x qo_len with kv_len = qo_len: 1x16k, 4x4k, 16x1k, 64x256;
      chunked prefill: 8 requests x qo 512 on kv 8192, causal, paged;
      speculative verification: 64 requests x qo 4 on kv 4096, causal, paged, also our
      BatchDecodeWithPagedKVCacheWrapper on the same cache with q_len_per_req=4 and with one
      token a request (target: prefill <= 1.3x the one-token decode);
  - per row and provider: device time of one run() (plan() once, outside the timing), TFLOP/s
    (4 x sum over requests of qo_len x keys attended x num_qo_heads x head_dim; causal counts
    the unmasked keys only, bottom-right aligned), its fraction of the matmul rate, and for
    the KV-bound rows the KV bytes read per second. Providers: ours (paged, ragged; planned
    with backend="fa2", today's mma.sync kernels, whatever backend="auto" would pick), our
    Hopper path (sm90 only; ours_fa3_ragged: the ragged wrapper with backend="fa3";
    ours_fa3_paged: the paged wrapper with backend="fa3" on the same page table, cache and
    page size as ours_paged, every row, the chunked and speculative rows included; a
    configuration the constructor or plan() declines with a ValueError is skipped with that
    error's text), FlashInfer FA2 and FA3 (sm90 only; paged, ragged), torch SDPA's
    FLASH_ATTENTION and CUDNN_ATTENTION backends on dense [B, H, L, D] copies of the same
    values (enable_gqa, else the KV heads repeated; bottom-right causal where qo_len < kv_len).
    Each that cannot run says why;
  - per row: ours' speed over FA2's (FA2 us / ours us; target >= 1.0, paged and ragged), our
    Hopper path's over the best of FlashInfer FA3 ragged, SDPA cuDNN and SDPA flash
    (fa3_path_vs_best_peer: the fastest one's us / ours_fa3_ragged us) and over ours ragged
    (fa3_path_vs_ours_ragged); the paged Hopper column's likewise over the best of FlashInfer
    FA3 paged, FA3 ragged, SDPA cuDNN and SDPA flash (fa3_paged_vs_best_peer, naming it in
    fa3_paged_best_peer) and over ours paged (fa3_paged_vs_ours_paged); and a check, once,
    that every provider's output agrees with ours (max abs diff; ours' output buffer
    NaN-poisoned first, so a row it does not write shows); the Hopper path's outputs are
    checked against ours of the same form (check_fa3_path against ours ragged,
    check_fa3_paged against ours paged; the peers' tolerance; a disagreement is a missed
    target).

Timing: CUDA events around each eager run(), an L2 flush (a memset of max(4 x L2, 64 MiB))
before each, warm-up of at least 200 ms a provider (bench_common.warmup_ms), then the median
of --reps runs (twice as many where a provider of the row runs under 1 ms), the row's
providers interleaved run by run (time_interleaved: rounds that run each provider once, in
the orders of a Williams design: each provider in every place and after every other provider
equally often, none twice in a row), so that the GPU's clock drift over a row (the long
rows run at the power cap, where the clock falls as it heats) weighs on each provider alike.
(Until 2026-11-27 each provider ran its runs in two blocks, the row's providers in order and
then in reverse order; one provider's two block medians differed by up to 6% on head_dim
128's 1 x 16k.) A short GPU sleep before the rounds lets the host enqueue ahead, so host
time never shows.
Random inputs (normal, never zeros).

Builds: FlashInfer 0.5.3 JIT-compiles its prefill modules at first use (one module per
backend and head dim serves paged and ragged, causal and not; ~40 s FA2 and ~60 s FA3 each
with 16 jobs, per the peer README). They are built in the background, one ninja per head
dim in row order (128 first), while our modules are warmed up by background processes
(a plan() and run() of small problems per configuration; they land in our JIT cache). The
rows of a head dim are measured once its builds are done, while the later head dims'
FlashInfer builds run (such rows say build_running; --no-overlap waits for every build
first). Our warm-ups run kernels on the GPU, so all of them end before the first timed run
(matmul and copy rates included): only nvcc processes (CPU) overlap the timing. (Until
2026-11-27 the warm-ups of later head dims ran beside the first head dim's timed rows.) The
FlashInfer cache is FLASHINFER_WORKSPACE_BASE (default <tmp>/flashinfer_ws, kept on a
warm machine, so a second run builds nothing). Without the peer (.peers/site on
PYTHONPATH) its columns say why. Estimated (not yet measured) on an H100 with 16 cores:
cold, the six FlashInfer modules take ~3-3.5 min and the whole run ~4 min (the last head
dim's rows are skipped if --time-limit comes first); with the builds cached ~1.5 min;
--quick ~1.5-2 min cold. --build-only in one call, then the run in the next, splits it.

Writes JSON (--out; default $OUT/bench_prefill.json, else docs/results/<date>_prefill.json)
and prints the tables last.
  PYTHONPATH=.peers/site python3 scripts/bench_prefill.py [--quick] [--head-dims 64,128,256] [--out FILE]
  python3 scripts/bench_prefill.py --list      (the rows, FLOPs and bytes; no GPU needed)
  python3 scripts/bench_prefill.py --only 'hd128 causal;spec' --no-sdpa
  PYTHONPATH=.peers/site python3 scripts/bench_prefill.py --head-dims 128 --only 'hd128 causal 4x4k;hd128 chunked;spec;hd128 causal 1x16k'
      (the sm90 columns, ragged and paged, on the rows that matter most to them)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (also puts the repository on sys.path)

NUM_QO_HEADS, NUM_KV_HEADS, PAGE_SIZE = 32, 8, 16
FA3_PAGED_COPY = None  # --fa3-paged-copy (None: the planner's rule)
# --fa3-paged-copy both: ours_fa3_paged with the rule, and these two more providers of the same
# paged wrapper pinned over the copy and off it, interleaved with the rest in the same rounds
FA3_PAGED_PINNED = {"ours_fa3_paged_copy": True, "ours_fa3_paged_boxes": False}
FA3_PAGED_PINS = ()  # (the pinned providers that run: FA3_PAGED_PINNED's keys with "both")
# --fa3-key-tiles T1,T2: ours_fa3_ragged_n<T>, the ragged wrapper with its key tile pinned to T
# (wrapper._force_key_tile), in the same rounds as the rest
FA3_TILE_PINS = ()
DTYPE = "bfloat16"
HEAD_DIMS = (64, 128, 256)
PREFILL_SHAPES = ((1, 16384), (4, 4096), (16, 1024), (64, 256))  # batch x qo_len (= kv_len)
CHUNKED = (8, 512, 8192)  # batch, qo_len, kv_len
CHUNKED_ROWS = None  # --chunked: the chunked rows measured (None: CHUNKED, the record's)
SPEC = (64, 4, 4096)  # batch, tokens a request, kv_len
WORKSPACE_BYTES = 256 << 20
TARGET_SPEEDUP_VS_FA2 = 1.0  # FA2 us / ours us, paged and ragged, every row
TARGET_SPEC_OVER_DECODE = 1.3  # ours' prefill us / our one-token decode us on the spec row
ATOL, RTOL = 2e-2, 2e-2  # the loose agreement check: |a - b| <= ATOL + RTOL * |b| everywhere
RESERVE_S = 5.0  # left at the end for the report
DEVICE = "cuda"

WRAPPERS = ("BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper")
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}
FA3_PATH = "ours_fa3_ragged"  # our Hopper (sm_90a) path: the ragged wrapper with backend="fa3"
FA3_PAGED = "ours_fa3_paged"  # the same path over the paged cache: the paged wrapper with backend="fa3"
FA3_IMPLS = (FA3_PATH, FA3_PAGED)
IMPLS = ("ours_paged", "ours_ragged", FA3_PATH, FA3_PAGED, "fa2_paged", "fa2_ragged", "fa3_paged", "fa3_ragged",
         *SDPA_BACKENDS)
CHECK_PEERS = ("fa2_paged", "fa2_ragged", "sdpa_flash", "sdpa_cudnn", "fa3_paged", "fa3_ragged")
FA3_PATH_PEERS = ("fa3_ragged", "sdpa_cudnn", "sdpa_flash")  # fa3_path_vs_best_peer: the fastest of these
FA3_PAGED_PEERS = ("fa3_paged", "fa3_ragged", "sdpa_cudnn", "sdpa_flash")  # fa3_paged_vs_best_peer: likewise


# --- rows -----------------------------------------------------------------------------------------
class Row(NamedTuple):
    kind: str  # "prefill", "chunked" or "spec"
    head_dim: int
    batch: int
    qo_len: int
    kv_len: int
    causal: bool

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"hd{self.head_dim} {'causal' if self.causal else 'full'} {self.batch}x{_k(self.qo_len)}"
        return f"hd{self.head_dim} {self.kind} {self.batch}x{self.qo_len} on {_k(self.kv_len)}"

    @property
    def forms(self) -> tuple:
        """The K/V forms measured: paged and ragged for the prefill rows, paged for the others."""
        return ("paged", "ragged") if self.kind == "prefill" else ("paged",)

    def flops(self) -> int:
        return attention_flops(self.batch, self.qo_len, self.kv_len, self.causal, NUM_QO_HEADS, self.head_dim)

    def kv_bytes(self) -> int:
        """K and V bytes the requests read (bf16)."""
        return 2 * self.batch * self.kv_len * NUM_KV_HEADS * self.head_dim * 2

    def budget_s(self, reps: int) -> float:
        """A rough upper estimate of the row's wall time (10 providers, ~300 TFLOP/s, warm-up,
        plan, checks): a row that would end past --time-limit is not started."""
        return 10 * (0.55 + (reps + 12) * self.flops() / 300e12)

    def io_bytes(self) -> int:
        """q + K + V + out bytes (bf16): what a run touches at least once."""
        return self.kv_bytes() + 2 * self.batch * self.qo_len * NUM_QO_HEADS * self.head_dim * 2


def keys_attended(qo_len: int, kv_len: int, causal: bool) -> int:
    """(query row, key) pairs a request computes: qo x kv, or with the causal mask aligned
    bottom-right (row i sees keys 0 .. kv - qo + i) sum_i (kv - qo + i + 1)."""
    if not causal:
        return qo_len * kv_len
    if kv_len < qo_len:
        raise ValueError(f"causal needs kv_len >= qo_len, got {qo_len} on {kv_len}")
    return qo_len * (kv_len - qo_len) + qo_len * (qo_len + 1) // 2


def attention_flops(batch: int, qo_len: int, kv_len: int, causal: bool, num_qo_heads: int, head_dim: int) -> int:
    """4 x pairs x heads x head_dim: QK^T and PV, a multiply-add (2 FLOPs) each."""
    return 4 * batch * keys_attended(qo_len, kv_len, causal) * num_qo_heads * head_dim


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def head_dim_order(head_dims) -> list[int]:
    """128 first (the reference rows), then the others largest first: their FlashInfer builds
    are the longest, so they run while the earlier rows are measured."""
    return sorted(set(head_dims), key=lambda d: (d != 128, -d))


def row_list(head_dims, only=()) -> list[Row]:
    rows = []
    for hd in head_dim_order(head_dims):
        for causal in (True, False):
            rows += [Row("prefill", hd, b, n, n, causal) for b, n in PREFILL_SHAPES]
        rows += [Row("chunked", hd, b, q, kv, True) for b, q, kv in (CHUNKED_ROWS or [CHUNKED])]
        rows.append(Row("spec", hd, SPEC[0], SPEC[1], SPEC[2], True))
    if only:
        rows = [r for r in rows if any(o in r.label for o in only)]
    return rows


def ours_configs(rows, hd: int, prefill: bool, fa3: bool = False) -> list[str]:
    """Our configurations the rows of head dim `hd` use, as the warm-up names them
    (<form>_<mask> for backend="fa2"; <form>_<mask>_fa3 for the Hopper path, with `fa3`)."""
    found = []
    for r in rows:
        if r.head_dim != hd:
            continue
        if prefill:
            mask = "causal" if r.causal else "full"
            found += [f"{form}_{mask}" for form in r.forms]
            if fa3:
                found += [f"{form}_{mask}_fa3" for form in r.forms]
        if r.kind == "spec":
            found += ["decode4", "decode1"]
    return sorted(set(found))


# --- background builds ------------------------------------------------------------------------------
FLASHINFER_BUILD = r"""
import json, sys, time
t0 = time.perf_counter()
try:
    import torch
    from flashinfer.jit.attention.modules import gen_batch_prefill_module
    from flashinfer.jit.core import build_jit_specs
    hd, backends = int(sys.argv[1]), sys.argv[2].split(",")
    # the module plan() asks for: bf16 q/kv/out, int32 indptr, no RoPE, no window, no soft cap,
    # no fp16 QK reduction (flashinfer/prefill.py, get_module_args)
    specs = {b: gen_batch_prefill_module(b, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32,
                                         hd, hd, 0, False, False, False) for b in backends}
    modules = {}
    try:
        build_jit_specs(list(specs.values()), verbose=False)  # one ninja, every module
        modules = {b: {"ok": True} for b in specs}
    except Exception:
        for b, spec in specs.items():  # which one failed
            try:
                spec.build(verbose=False)
                modules[b] = {"ok": True}
            except Exception as exc:
                modules[b] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-1500:]}
    print(json.dumps({"ok": True, "modules": modules, "seconds": time.perf_counter() - t0}))
except BaseException as exc:  # report anything, never hang the benchmark
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[-1500:], "seconds": time.perf_counter() - t0}))
"""

OURS_WARMUP = r"""
import json, sys, time
t0 = time.perf_counter()
try:
    import torch
    import flashinfer_jit as fij
    hd, what = int(sys.argv[1]), sys.argv[2]
    hq, hk, page, bf16 = 32, 8, 16, torch.bfloat16
    unsupported = None  # fa3: the ValueError with which plan() declined the configuration
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")

    def paged(batch, kv):
        pages = -(-kv // page)
        cache = torch.randn(batch * pages, page, hk, hd, device="cuda", dtype=bf16)
        indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32)
        indices = torch.randperm(batch * pages, device="cuda").int()
        last = torch.full((batch,), kv - (pages - 1) * page, dtype=torch.int32)
        return cache, indptr, indices, last

    if what.startswith("decode"):
        n = int(what[len("decode"):])
        for batch, kv in ((1, 40), (8, 1024), (64, 4096)):
            cache, indptr, indices, last = paged(batch, kv)
            w = fij.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            w.plan(indptr, indices, last, hq, hk, hd, page, q_data_type=bf16, kv_data_type=bf16, q_len_per_req=n)
            w.run(torch.randn(batch * n, hq, hd, device="cuda", dtype=bf16), (cache, cache))
    else:
        form, mask, *rest = what.split("_")  # <form>_<mask>[_fa3]
        causal, backend = mask == "causal", (rest or ["fa2"])[0]
        # fa2: short and long queries, one and many requests, a partial last page: what plan()
        # may pick different kernels for; fa3 (ragged and paged, pages of 16): the benchmark's
        # kind, qo = kv (one module a form, mask and head dim serves every length)
        shapes = ((1, 40, 40), (4, 4, 1024), (2, 256, 2048), (1, 1024, 1024)) if backend == "fa2" else \
            ((1, 1024, 1024), (4, 256, 256))
        for batch, qo, kv in shapes:
            q = torch.randn(batch * qo, hq, hd, device="cuda", dtype=bf16)
            qo_indptr = torch.arange(0, batch * qo + 1, qo, dtype=torch.int32)
            try:
                if form == "paged":
                    cache, indptr, indices, last = paged(batch, kv)
                    w = fij.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
                    w.plan(qo_indptr, indptr, indices, last, hq, hk, hd, page, causal=causal, q_data_type=bf16,
                           kv_data_type=bf16)
                    run = lambda: w.run(q, (cache, cache))
                else:
                    k = torch.randn(batch * kv, hk, hd, device="cuda", dtype=bf16)
                    w = fij.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
                    w.plan(qo_indptr, torch.arange(0, batch * kv + 1, kv, dtype=torch.int32), hq, hk, hd,
                           causal=causal, q_data_type=bf16, kv_data_type=bf16)
                    run = lambda: w.run(q, k, k)
            except ValueError as exc:  # the Hopper path declines this configuration: nothing to
                if backend != "fa3":   # warm up (the row's plan() says why again, and is skipped)
                    raise
                unsupported = f"{type(exc).__name__}: {exc}"[-600:]
                break
            run()
    torch.cuda.synchronize()
    print(json.dumps({"ok": True, "seconds": time.perf_counter() - t0}
                     | ({"unsupported": unsupported} if unsupported else {})))
except BaseException as exc:  # report anything, never hang the benchmark
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[-1500:], "seconds": time.perf_counter() - t0}))
"""


class Builds:
    """Background builds, in stages: stage k (head dim k of the rows' order) starts FlashInfer's
    modules for that head dim (one process, one ninja, MAX_JOBS = the CPU count unless set);
    stage k+1 starts when stage k's FlashInfer build ends (at once where it has none). Our
    warm-up processes, which run kernels, all start with stage 0 and end before the first
    timed run (ours_done). Each process prints one JSON line; its output goes to a log file."""

    def __init__(self, stages: list[tuple[int, list[str], list[str]]], fi_env: dict | None):
        self.stages = stages  # (head_dim, FlashInfer backends, our configurations)
        self.fi_env = fi_env
        self.jobs: dict[tuple, dict] = {}
        self.next_stage = 0
        self.killed: str | None = None  # why the builds were ended early, if they were
        self.started = time.perf_counter()
        self.logdir = Path(tempfile.mkdtemp(prefix="bench_prefill_builds_"))
        self._advance()

    def _launch(self, key: tuple, argv: list[str], env: dict | None) -> None:
        name = "_".join(map(str, key))
        out, err = open(self.logdir / f"{name}.out", "w"), open(self.logdir / f"{name}.err", "w")
        proc = subprocess.Popen([sys.executable, "-c", *argv], stdout=out, stderr=err, cwd=bc.REPO,
                                env=env, start_new_session=True)  # its own group: killed with its ninja
        out.close()
        err.close()
        self.jobs[key] = {"proc": proc, "started": time.perf_counter(), "result": None, "name": name}

    def _advance(self) -> None:
        while self.next_stage < len(self.stages):
            if self.next_stage > 0:
                prev = self.jobs.get(("fa", self.stages[self.next_stage - 1][0]))
                if prev is not None and prev["result"] is None:
                    return
            hd, backends, configs = self.stages[self.next_stage]
            if backends and self.fi_env is not None:
                self._launch(("fa", hd), [FLASHINFER_BUILD, str(hd), ",".join(backends)], self.fi_env)
            if self.next_stage == 0:
                # our warm-ups run kernels: all of them now, done before anything is timed
                # (ours_done), so that only FlashInfer's compiles (CPU) overlap the timing
                for shd, _, sconfigs in self.stages:
                    for what in sconfigs:
                        self._launch(("ours", shd, what), [OURS_WARMUP, str(shd), what], None)
            bc.log(f"builds: head_dim {hd} started (FlashInfer {','.join(backends) or '-'}, "
                   f"ours {','.join(configs) or '-'})")
            self.next_stage += 1

    def ours_done(self, until: float) -> None:
        """Until every warm-up of ours has ended (they run kernels on the GPU) or the clock
        reaches `until`."""
        while time.perf_counter() < until:
            self.poll()
            if all(j["result"] is not None for k, j in self.jobs.items() if k[0] == "ours"):
                return
            time.sleep(0.2)

    def poll(self) -> None:
        for job in self.jobs.values():
            if job["result"] is None and job["proc"].poll() is not None:
                job["result"] = self._read(job)
                job["result"]["wall_s"] = time.perf_counter() - job["started"]
                bc.log(f"builds: {job['name']} {'ok' if job['result'].get('ok') else 'FAILED'} "
                       f"({job['result']['wall_s']:.0f} s)")
        self._advance()

    def _read(self, job) -> dict:
        out = (self.logdir / f"{job['name']}.out").read_text(errors="replace")
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if lines:
            try:
                return json.loads(lines[-1])
            except json.JSONDecodeError:
                pass
        err = (self.logdir / f"{job['name']}.err").read_text(errors="replace")
        return {"ok": False, "error": f"exit {job['proc'].returncode}: {err[-1500:]}"}

    def running(self) -> bool:
        self.poll()
        return any(j["result"] is None for j in self.jobs.values()) or self.next_stage < len(self.stages)

    def wait(self, hd: int | None, until: float) -> None:
        """Until the builds of head dim `hd` (every build, None) are done or the clock
        reaches `until`."""
        while True:
            self.poll()
            keys = [k for k in self.jobs if hd is None or k[1] == hd]
            pending = hd is None and self.next_stage < len(self.stages) or \
                hd is not None and hd not in [s[0] for s in self.stages[:self.next_stage]]
            if not pending and all(self.jobs[k]["result"] is not None for k in keys):
                return
            if time.perf_counter() >= until:
                return
            time.sleep(0.2)

    def kill(self, reason: str) -> None:
        """End every build still running (each process group we started, by its id)."""
        for job in self.jobs.values():
            if job["result"] is None:
                try:
                    os.killpg(job["proc"].pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                job["proc"].wait()
                job["result"] = {"ok": False, "error": reason, "wall_s": time.perf_counter() - job["started"]}
        self.killed = self.killed or reason
        self.next_stage = len(self.stages)

    def status(self, key: tuple, backend: str | None = None) -> str | None:
        """None if the build `key` (and its module `backend`) succeeded, else why not."""
        job = self.jobs.get(key)
        if job is None:
            return f"build not started: {self.killed}" if self.killed else "not in the build plan"
        r = job["result"]
        if r is None:
            return "build still running"
        if not r.get("ok"):
            return f"build failed: {r.get('error', '?')}"[:600]
        if backend is not None:
            m = r.get("modules", {}).get(backend, {"ok": False, "error": "not built"})
            if not m.get("ok"):
                return f"{backend} build failed: {m.get('error', '?')}"[:600]
        return None

    def summary(self) -> dict:
        out = {"logs": str(self.logdir), "flashinfer": {}, "ours": {}}
        for key, job in self.jobs.items():
            r = dict(job["result"] or {"ok": False, "error": "still running"})
            if key[0] == "fa":
                out["flashinfer"][f"hd{key[1]}"] = r
            else:
                out["ours"][f"hd{key[1]} {key[2]}"] = r
        return out


# --- timing -----------------------------------------------------------------------------------------
class Flush:
    """A memset of max(4 x L2, 64 MiB) between runs: every run starts from DRAM."""

    def __init__(self):
        import torch

        self.buf = torch.empty(max(4 * bc.l2_bytes(), 64 << 20), dtype=torch.uint8, device=DEVICE)

    def __call__(self):
        self.buf.zero_()


def _gate() -> None:
    """About 10 ms of GPU sleep: the host enqueues the timed runs behind it."""
    import torch

    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(1 << 24)


def round_order(live: list, r: int, last=None) -> list:
    """Round r's order: row r of a Williams design over the providers (a balanced crossover
    design: over n rounds, 2n for an odd n, each provider takes every place of the round
    equally often and follows every other provider equally often), so that no provider
    always runs after the same one; `last`, the provider that ran last, never opens the round
    (for two providers: a, b every round). The kernel that ran before one moved its time by
    up to 3% in an A/B (docs/prefill.md). Until 2026-11-27 the rounds were the providers
    rotated by r (a, b, c; b, c, a; ...): each provider then ran after the same one in all but
    one round of n; before that, forward-then-reverse rounds ran the first and the last
    provider of a row twice in a row at every turn."""
    n = len(live)
    if n < 3:  # a, b every round (each follows the other)
        return list(live) if not live or live[0] != last else live[::-1]
    # first row 0, 1, n-1, 2, n-2, ...; row k adds k (mod n); odd n: then the rows reversed,
    # stepping so that no round opens with the provider that closed the one before
    first = [(j + 1) // 2 if j % 2 else -(j // 2) % n for j in range(n)]
    k = r % (n if n % 2 == 0 else 2 * n)
    if k >= n:
        k = (k - n) * (-1 if first[-1] == n - 1 else 1)
        row = [(x + k) % n for x in reversed(first)]
    else:
        row = [(x + k) % n for x in first]
    order = [live[x] for x in row]
    if order[0] == last:
        order = order[1:] + order[:1]
    return order


def time_interleaved(fns: list, reps: int, flush: Flush) -> list[dict]:
    """Median device time of one call of each of a row's providers (fns), timed interleaved:
    CUDA events around each run and an L2 flush before it, in rounds that run every provider
    once (round_order(): a balanced order), so that the GPU's clock drift over the
    row (the long rows run at the power cap, and the clock falls as the GPU heats) weighs on
    every provider alike. Before the rounds each provider warms up for at least
    bench_common.warmup_ms() (3 runs at least), in rounds too. Every provider gets --reps
    runs, or twice as many when one of them takes under 1 ms. Per fn: the summary
    (bench_common.summarize), warmup_runs, halves_median_us (the medians of the first and
    the second half of the rounds: the drift over the row) and _samples (every run, in round
    order); an fn that raises gets {"error": ...} and leaves the rounds."""
    import torch

    n = len(fns)
    out: list[dict] = [{} for _ in range(n)]
    live = list(range(n))

    def call(i, before=None, after=None):
        """fns[i]() with a flush before it; False (and its error recorded) when it raises."""
        try:
            flush()
            if before is not None:
                before.record()
            fns[i]()
            if after is not None:
                after.record()
            return True
        except Exception as exc:  # noqa: BLE001  (one failing provider must not end the row)
            out[i] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
            bc.log(f"timing: provider {i}: {out[i]['error']}")
            return False

    one_ms = [0.0] * n
    for i in list(live):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if not call(i, start, end):
            live.remove(i)
            continue
        end.synchronize()
        one_ms[i] = start.elapsed_time(end)
    warm = {i: min(10_000, max(3, math.ceil(bc.warmup_ms() / max(one_ms[i], 1e-3)))) for i in live}
    left = dict(warm)
    while any(left.values()):
        for i in [i for i in live if left[i]]:
            left[i] -= 1
            if not call(i):
                live.remove(i)
                left[i] = 0
    torch.cuda.synchronize()
    runs = reps if all(one_ms[i] >= 1.0 for i in live) else 2 * reps
    events = {i: [] for i in live}
    _gate()
    last = None
    for r in range(runs):
        for i in round_order(live, r, last):
            last = i
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if call(i, start, end):
                events[i].append((start, end))
        live = [i for i in live if "error" not in out[i]]
    torch.cuda.synchronize()
    for i in live:
        samples = [a.elapsed_time(b) * 1e3 for a, b in events[i]]
        half = len(samples) // 2
        out[i] = bc.summarize(samples) | {
            "warmup_runs": warm[i], "_samples": samples,
            "halves_median_us": [statistics.median(samples[:half]), statistics.median(samples[half:])]}
    return out


def matmul_rate(n: int = 8192, reps: int = 30) -> dict:
    """bf16 torch.matmul n x n x n: the tensor-core ceiling the TFLOP/s are read against."""
    import torch

    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=DEVICE, dtype=torch.bfloat16)
    t = bc.time_cuda(lambda _: torch.matmul(a, b, out=c), 1, warmup=5, reps=reps)
    del a, b, c
    torch.cuda.empty_cache()
    return {"m": n, "n": n, "k": n, "dtype": DTYPE, "median_us": t["median_us"],
            "tflops": 2 * n ** 3 / t["median_us"] / 1e6, "timing": t}


# --- inputs -----------------------------------------------------------------------------------------
class Inputs:
    """One row's values in every form: q [B x qo, Hq, D]; K/V token-major [B x kv, Hk, D]
    (the ragged form), the same tokens in a paged NHD cache (pages in random order, CSR
    table: indptr and last_page_len on the host, indices on the device), and dense
    [B, H, L, D] copies for SDPA. Random normal values; the cache's padding slots too."""

    def __init__(self, row: Row, seed: int, ragged: bool, dense: bool, device=None):
        import torch

        b, qo, kv, d = row.batch, row.qo_len, row.kv_len, row.head_dim
        bf16 = torch.bfloat16
        device = device or DEVICE
        gen = torch.Generator(device=device).manual_seed(seed)
        self.row = row
        self.q = torch.randn(b * qo, NUM_QO_HEADS, d, generator=gen, device=device, dtype=bf16)
        k_tok = torch.randn(b * kv, NUM_KV_HEADS, d, generator=gen, device=device, dtype=bf16)
        v_tok = torch.randn(b * kv, NUM_KV_HEADS, d, generator=gen, device=device, dtype=bf16)
        pages = -(-kv // PAGE_SIZE)
        self.num_pages = b * pages
        perm = torch.randperm(self.num_pages, generator=gen, device=device)
        self.indices = perm.to(torch.int32)  # request r's page j is physical page indices[r * pages + j]
        self.page_indptr = torch.arange(0, self.num_pages + 1, pages, dtype=torch.int32)
        self.last_page_len = torch.full((b,), kv - (pages - 1) * PAGE_SIZE, dtype=torch.int32)
        self.qo_indptr = torch.arange(0, b * qo + 1, qo, dtype=torch.int32)
        self.kv_indptr = torch.arange(0, b * kv + 1, kv, dtype=torch.int32)

        def paged(tok):
            padded = tok.view(b, kv, NUM_KV_HEADS, d)
            if pages * PAGE_SIZE != kv:
                pad = torch.randn(b, pages * PAGE_SIZE - kv, NUM_KV_HEADS, d, generator=gen, device=device, dtype=bf16)
                padded = torch.cat([padded, pad], 1)
            cache = torch.empty(self.num_pages, PAGE_SIZE, NUM_KV_HEADS, d, device=device, dtype=bf16)
            cache[perm] = padded.reshape(self.num_pages, PAGE_SIZE, NUM_KV_HEADS, d)
            return cache

        self.k_cache, self.v_cache = paged(k_tok), paged(v_tok)
        self.k, self.v = (k_tok, v_tok) if ragged else (None, None)
        self.dense = None
        if dense:
            self.dense = {"q": to_dense(self.q, b), "k": to_dense(k_tok, b), "v": to_dense(v_tok, b)}
        self.out = torch.empty_like(self.q)


def to_dense(tokens, batch: int):
    """[B x L, H, D] token-major -> [B, H, L, D] contiguous."""
    return tokens.view(batch, -1, *tokens.shape[1:]).transpose(1, 2).contiguous()


def from_dense(x):
    """[B, H, L, D] -> [B x L, H, D] (token-major, as the wrappers write)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def lower_right_mask(qo_len: int, kv_len: int, device):
    """The causal mask aligned bottom-right: row i sees keys 0 .. kv_len - qo_len + i."""
    import torch

    return torch.ones(qo_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - qo_len)


def sdpa_attend(impl: str, q, k, v, causal: bool):
    """torch SDPA with one backend on [B, H, L, D] tensors (KV heads grouped by enable_gqa
    where k has fewer heads than q). Causal with qo_len < kv_len is aligned bottom-right:
    FLASH_ATTENTION through its own op (whose is_causal is bottom-right, as torch's
    causal_lower_right dispatch calls it), CUDNN_ATTENTION with the boolean mask."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lower_right = causal and q.shape[2] != k.shape[2]
    if impl == "sdpa_flash" and lower_right:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
    mask = lower_right_mask(q.shape[2], k.shape[2], q.device) if lower_right else None
    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[impl])):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and not lower_right, enable_gqa=k.shape[1] != q.shape[1])


def compare(out, ref) -> dict:
    """max |out - ref| and whether |out - ref| <= ATOL + RTOL |ref| everywhere (NaN: no)."""
    import torch

    o, r = out.float(), ref.float().reshape(out.shape)
    nan = bool(torch.isnan(o).any())
    d = (o - r).abs()
    worst = float(d.max()) if not nan else None
    ok = not nan and float((d - RTOL * r.abs()).max()) <= ATOL
    return {"max_abs_diff": worst, "agrees": ok} | ({"nan": True} if nan else {})


# --- one row ----------------------------------------------------------------------------------------
class Context(NamedTuple):
    fi: object  # the flashinfer module or None
    fi_reason: str | None
    fa3_reason: str | None
    ours_reason: str | None  # why our prefill wrappers are absent, or None
    sdpa: bool
    builds: Builds | None
    reps: int
    flush: Flush
    matmul_tflops: float
    fa3_path_reason: str | None = None  # why our Hopper path (ours_fa3_ragged / _paged) is not tried, or None


def measure_row(row: Row, ctx: Context, seed: int) -> dict:
    import torch

    import flashinfer_jit as fij

    hd = row.head_dim
    res = {"label": row.label, "kind": row.kind, "head_dim": hd, "batch": row.batch, "qo_len": row.qo_len,
           "kv_len": row.kv_len, "causal": row.causal, "num_qo_heads": NUM_QO_HEADS, "num_kv_heads": NUM_KV_HEADS,
           "page_size": PAGE_SIZE, "forms": list(row.forms), "flops": row.flops(), "kv_bytes": row.kv_bytes(),
           "io_bytes": row.io_bytes(), "build_running": bool(ctx.builds and ctx.builds.running()), "impls": {}}
    inputs = Inputs(row, seed, ragged="ragged" in row.forms, dense=ctx.sdpa)
    bf16 = torch.bfloat16
    mask = "causal" if row.causal else "full"
    ref = {}  # "out": ours' output, the row's reference ("impl": whose); "ours_ragged" / "ours_paged": that one's
    planned = {}  # impl -> our wrapper's planned_backend after plan() (where the wrapper has one)
    # The row's providers are prepared (planned, checked) one by one, then timed together,
    # interleaved run by run (time_interleaved), so that the GPU's clock drift over the row
    # weighs on each alike.
    timed = []  # (impl, entry, run)

    def set_timing(entry: dict, t: dict) -> None:
        """A provider's figures from its timing (the row's FLOPs unless the entry names its own)."""
        us = t["median_us"]
        entry |= {"median_us": us, "tflops": entry.get("flops", row.flops()) / us / 1e6,
                  "kv_tb_per_s": row.kv_bytes() / us / 1e6, "timing": t}
        if "flops" not in entry:
            entry["frac_matmul"] = entry["tflops"] / ctx.matmul_tflops

    def wrapper_runner(module, form: str, backend: str | None, impl: str | None = None):
        """A planned wrapper's run(). For ours (`impl` given), the backend plan() settled on
        (planned_backend, where the wrapper has it) is recorded, and must be the one asked for."""
        kw = {} if backend is None else {"backend": backend}
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=DEVICE)
        if form == "paged":
            w = module.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **kw)
            if impl == FA3_PAGED and FA3_PAGED_COPY is not None:  # (an A/B: the copy of the pages or not)
                w._force_copy = FA3_PAGED_COPY
            elif impl in FA3_PAGED_PINNED:
                w._force_copy = FA3_PAGED_PINNED[impl]
            w.plan(inputs.qo_indptr, inputs.page_indptr, inputs.indices, inputs.last_page_len, NUM_QO_HEADS,
                   NUM_KV_HEADS, hd, PAGE_SIZE, causal=row.causal, q_data_type=bf16, kv_data_type=bf16)
            run = lambda: w.run(inputs.q, (inputs.k_cache, inputs.v_cache), out=inputs.out)
        else:
            w = module.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", **kw)
            if impl in FA3_TILE_PINS:
                w._force_key_tile = int(impl.rsplit("_n", 1)[1])
            w.plan(inputs.qo_indptr, inputs.kv_indptr, NUM_QO_HEADS, NUM_KV_HEADS, hd, causal=row.causal,
                   q_data_type=bf16, kv_data_type=bf16)
            run = lambda: w.run(inputs.q, inputs.k, inputs.v, out=inputs.out)
        if impl is not None:
            got = getattr(w, "planned_backend", None)
            if got is not None:
                planned[impl] = got
                if backend is not None and got != backend:
                    raise RuntimeError(f"plan() with backend={backend!r} planned {got!r}")
        return run

    def measure(impl: str, prepare, reference=None, unsupported=()) -> dict:
        """prepare() -> (run, output): plan outside the timing; one checked run (outputs
        NaN-poisoned first); the entry's timing comes with the row's (time_interleaved). An
        exception of the types `unsupported` from prepare() (a plan() that declines the
        configuration) makes the entry skipped, with the exception's text."""
        try:
            inputs.out.fill_(float("nan"))
            try:
                run, output = prepare()
            except unsupported as exc:
                why = f"{type(exc).__name__}: {exc}"[:800]
                bc.log(f"{row.label} {impl}: skipped: {why}")
                return {"skipped": why}
            run()
            torch.cuda.synchronize()
            entry = {}
            if reference is not None:
                entry["vs_ours"] = compare(output(), reference)
            elif impl.startswith("ours") and impl not in FA3_IMPLS and "out" not in ref:
                got = output()
                entry["wrote_every_row"] = not bool(torch.isnan(got).any())
                ref["out"], ref["impl"] = got.clone(), impl
            elif impl in FA3_IMPLS:  # no output of ours to check it against
                entry["wrote_every_row"] = not bool(torch.isnan(output()).any())
            if impl in ("ours_ragged", "ours_paged"):  # the Hopper path's reference, form for form
                ref[impl] = ref["out"] if ref.get("impl") == impl else output().clone()
            if impl in planned:
                entry["planned_backend"] = planned[impl]
        except Exception as exc:  # noqa: BLE001  (one failing provider must not end the run)
            bc.log(f"{row.label} {impl}: {type(exc).__name__}: {exc}")
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001  (a sticky CUDA error: the next rows will say so)
                pass
            return {"error": f"{type(exc).__name__}: {exc}"[:800]}
        timed.append((impl, entry, run))
        return entry

    def ours_reference():
        return ref.get("out")

    def out_of_wrapper():
        return inputs.out

    # ours, paged then ragged (the first to run is the row's reference), backend="fa2": today's
    # kernels, whichever backend="auto" would pick
    for form in ("paged", "ragged"):
        impl = f"ours_{form}"
        if form not in row.forms:
            res["impls"][impl] = {"skipped": f"{row.kind} rows are paged only"}
            continue
        why = ctx.ours_reason or (ctx.builds and ctx.builds.status(("ours", hd, f"{form}_{mask}")))
        res["impls"][impl] = {"skipped": f"ours: {why}"} if why else \
            measure(impl, lambda f=form, i=impl: (wrapper_runner(fij, f, "fa2", i), out_of_wrapper),
                    ours_reference())
    # our Hopper path: the ragged wrapper with backend="fa3" (ours_fa3_ragged), then the paged
    # one on the same page table and cache as ours_paged (ours_fa3_paged), each checked against
    # ours of its form (else against the row's reference); a configuration the constructor or
    # plan() declines (ValueError) is skipped with the error's text
    for form, impl in (("ragged", FA3_PATH), ("paged", FA3_PAGED)):
        if form not in row.forms:
            res["impls"][impl] = {"skipped": f"{row.kind} rows are paged only"}
            continue
        why = ctx.ours_reason or ctx.fa3_path_reason or \
            (ctx.builds and ctx.builds.status(("ours", hd, f"{form}_{mask}_fa3")))
        if why:
            res["impls"][impl] = {"skipped": f"ours: {why}"}
            continue
        against = f"ours_{form}" if f"ours_{form}" in ref else ref.get("impl")
        res["impls"][impl] = measure(
            impl, lambda f=form, i=impl: (wrapper_runner(fij, f, "fa3", i), out_of_wrapper),
            ref.get(f"ours_{form}", ref.get("out")), unsupported=(ValueError,))
        if "vs_ours" in res["impls"][impl]:
            res["impls"][impl]["checked_against"] = against
    # pinned variants of our Hopper path, in the same rounds: (--fa3-paged-copy both) the paged
    # wrapper over the copy of its pages and off it; (--fa3-key-tiles) the ragged one's key tile
    pins = [(impl, "paged", FA3_PAGED) for impl in FA3_PAGED_PINS] + \
        [(impl, "ragged", FA3_PATH) for impl in FA3_TILE_PINS]
    for impl, form, base in pins:
        if form not in row.forms or "skipped" in res["impls"].get(base, {}):
            res["impls"][impl] = {"skipped": f"as {base}"}
            continue
        res["impls"][impl] = measure(
            impl, lambda i=impl, f=form: (wrapper_runner(fij, f, "fa3", i), out_of_wrapper),
            ref.get(f"ours_{form}", ref.get("out")), unsupported=(ValueError,))
    # FlashInfer FA2 and FA3
    for backend in ("fa2", "fa3"):
        for form in ("paged", "ragged"):
            impl = f"{backend}_{form}"
            why = ctx.fi_reason or (ctx.fa3_reason if backend == "fa3" else None) or \
                (None if form in row.forms else f"{row.kind} rows are paged only") or \
                (ctx.builds and ctx.builds.status(("fa", hd), backend))
            res["impls"][impl] = {"skipped": why} if why else \
                measure(impl, lambda f=form, b=backend: (wrapper_runner(ctx.fi, f, b), out_of_wrapper),
                        ours_reference())
    # torch SDPA on the dense copies
    for impl in SDPA_BACKENDS:
        res["impls"][impl] = measure_sdpa(impl, inputs, row, measure, ours_reference()) if ctx.sdpa else \
            {"skipped": "--no-sdpa"}
    # our decode on the spec row's cache: q_len_per_req tokens a request, and one
    if row.kind == "spec":
        measure_decode(res, inputs, row, ctx, measure, ours_reference())
    for (impl, entry, _), t in zip(timed, time_interleaved([run for _, _, run in timed], ctx.reps, ctx.flush)):
        if "error" in t:
            entry["error"] = t["error"]
            continue
        # (every provider of the row has one sample a round, in round order: derive() pairs them)
        t["samples_us"] = [round(x, 2) for x in t.pop("_samples", [])]
        set_timing(entry, t)
        bc.log(f"{row.label} {impl}: {entry['median_us']:.1f} us, {entry['tflops']:.0f} TFLOP/s")
    timed.clear()
    derive(res)
    del inputs
    ref.clear()
    torch.cuda.empty_cache()
    return res


def measure_sdpa(impl: str, inputs: Inputs, row: Row, measure, reference) -> dict:
    import torch

    dense = inputs.dense
    held = {}

    def prepare():
        q, k, v = dense["q"], dense["k"], dense["v"]
        try:  # KV heads grouped by enable_gqa (or, for flash with a bottom-right mask, natively)
            with warnings.catch_warnings():  # a backend that declines says why in a warning, then raises
                warnings.simplefilter("ignore")
                sdpa_attend(impl, q, k, v, row.causal)
            held["kv_heads"] = f"{k.shape[1]} (grouped)"
        except RuntimeError as exc:  # the backend takes no grouped heads here: repeat them
            held["grouped_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if "k_rep" not in dense:
                group = q.shape[1] // k.shape[1]
                dense["k_rep"] = k.repeat_interleave(group, dim=1)
                dense["v_rep"] = v.repeat_interleave(group, dim=1)
            k, v = dense["k_rep"], dense["v_rep"]
            held["kv_heads"] = f"{k.shape[1]} (repeat_interleave)"
        torch.cuda.synchronize()

        def run():
            held["out"] = sdpa_attend(impl, q, k, v, row.causal)
        return run, lambda: from_dense(held["out"])

    entry = measure(impl, prepare, reference)
    for key in ("kv_heads", "grouped_error"):
        if key in held:
            entry[key] = held[key]
    held.clear()
    return entry


def measure_decode(res: dict, inputs: Inputs, row: Row, ctx: Context, measure, reference) -> None:
    """Our batch decode on the same paged cache: q_len_per_req = the row's tokens (the same
    queries and causal rule as the prefill) and one token a request (the last token's query,
    which attends to every key)."""
    import torch

    import flashinfer_jit as fij

    b, n, hd = row.batch, row.qo_len, row.head_dim
    q_last = inputs.q.view(b, n, NUM_QO_HEADS, hd)[:, -1].contiguous()
    out_last = torch.empty_like(q_last)
    ref_last = None if reference is None else reference.view(b, n, NUM_QO_HEADS, hd)[:, -1]
    for impl, tokens in (("ours_decode_q4", n), ("ours_decode_q1", 1)):
        why = ctx.builds and ctx.builds.status(("ours", hd, f"decode{tokens}"))
        if why:
            res["impls"][impl] = {"skipped": f"ours: {why}"}
            continue
        q, out = (inputs.q, inputs.out) if tokens == n else (q_last, out_last)

        def prepare(q=q, out=out, tokens=tokens):
            out.fill_(float("nan"))
            ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=DEVICE)
            w = fij.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            w.plan(inputs.page_indptr, inputs.indices, inputs.last_page_len, NUM_QO_HEADS, NUM_KV_HEADS, hd,
                   PAGE_SIZE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, q_len_per_req=tokens)
            return (lambda: w.run(q, (inputs.k_cache, inputs.v_cache), out=out)), (lambda: out)

        e = res["impls"][impl] = measure(impl, prepare, reference if tokens == n else ref_last)
        e["q_len_per_req"] = tokens  # (the same dict: the row's timing fills it in)
        if tokens == 1 and "error" not in e:  # one token a request: not the row's FLOPs (set_timing reads them)
            e["flops"] = attention_flops(b, 1, row.kv_len, False, NUM_QO_HEADS, hd)


def paired_ratio(a: list, b: list) -> dict | None:
    """b's time over a's run by run, for samples taken a round each (time_interleaved): a
    ratio of one round's two runs leaves out the clock's drift between rounds, which two
    medians keep (the long rows run at the power cap: their runs spread by +-7%). The median
    of those ratios and its p10 / p90; None unless both have one sample a round."""
    if not a or len(a) != len(b):
        return None
    ratios = sorted(y / x for x, y in zip(a, b))
    pick = lambda q: ratios[min(len(ratios) - 1, int(q * len(ratios)))]  # noqa: E731
    return {"median": statistics.median(ratios), "p10": pick(0.1), "p90": pick(0.9), "rounds": len(ratios)}


def paired_speedup(ours: dict, fa2: dict) -> dict | None:
    """FA2's time over ours, paired round by round (paired_ratio), from two providers' entries."""
    return paired_ratio(ours.get("timing", {}).get("samples_us") or [], fa2.get("timing", {}).get("samples_us") or [])


def derive(res: dict) -> None:
    """Speed over FA2, our Hopper columns' speed over their best peer (derive_fa3), the
    agreement checks and the targets of one row."""
    impls = res["impls"]
    us = {k: v.get("median_us") for k, v in impls.items()}
    res["speedup_vs_fa2"], res["time_ratio_ours_over_fa2"] = {}, {}
    for form in res["forms"]:
        ours, fa2 = us.get(f"ours_{form}"), us.get(f"fa2_{form}")
        if ours and fa2:
            res["speedup_vs_fa2"][form] = fa2 / ours
            res["time_ratio_ours_over_fa2"][form] = ours / fa2
        paired = paired_speedup(impls.get(f"ours_{form}", {}), impls.get(f"fa2_{form}", {}))
        if paired is not None:
            res.setdefault("paired_speedup_vs_fa2", {})[form] = paired
    for form in res["forms"]:
        ours, fa3 = us.get(f"ours_{form}"), us.get(f"fa3_{form}")
        if ours and fa3:
            res.setdefault("speedup_vs_fa3", {})[form] = fa3 / ours
    ours_impl = next((f"ours_{f}" for f in res["forms"] if us.get(f"ours_{f}")), None)
    peer = next((p for p in CHECK_PEERS if "vs_ours" in impls.get(p, {})), None)
    if ours_impl and peer:
        res["check"] = {"ours": ours_impl, "reference": peer, "tolerance": f"|ours - ref| <= {ATOL:g} + {RTOL:g} |ref|",
                        **impls[peer]["vs_ours"]}
        res["check"]["ours_wrote_every_row"] = impls.get(res["check"]["ours"], {}).get("wrote_every_row")
    else:
        res["check"] = {"skipped": "no output of ours" if not ours_impl else "no peer ran (FA2, SDPA, FA3)"}
    # our Hopper path, ragged (fa3_path_*) and paged (fa3_paged_*): over the fastest of its
    # peers, and over ours of its form
    derive_fa3(res, FA3_PATH, "fa3_path", FA3_PATH_PEERS, "ours_ragged")
    derive_fa3(res, FA3_PAGED, "fa3_paged", FA3_PAGED_PEERS, "ours_paged")
    targets = {}
    for form, s in res["speedup_vs_fa2"].items():
        targets[f"{form} >= {TARGET_SPEEDUP_VS_FA2:g}x FA2"] = s >= TARGET_SPEEDUP_VS_FA2
    for key, name in (("check_fa3_path", "sm90 rg"), ("check_fa3_paged", "sm90 pg")):
        if key in res:
            targets[f"{name} agrees with ours"] = bool(res[key]["agrees"])
    if res["kind"] == "spec":
        prefill, q4, q1 = us.get("ours_paged"), us.get("ours_decode_q4"), us.get("ours_decode_q1")
        res["prefill_over_decode"] = {}
        if prefill and q4:
            res["prefill_over_decode"]["q_len_per_req"] = prefill / q4
        if prefill and q1:
            res["prefill_over_decode"]["one_token"] = prefill / q1
            targets[f"prefill <= {TARGET_SPEC_OVER_DECODE:g}x one-token decode"] = \
                prefill / q1 <= TARGET_SPEC_OVER_DECODE
    res["targets"] = targets


def derive_fa3(res: dict, impl: str, key: str, peers: tuple, ours: str) -> None:
    """One Hopper column's figures, under `key` (fa3_path: ours_fa3_ragged; fa3_paged:
    ours_fa3_paged): <key>_vs_best_peer, the fastest (median us) of `peers` that ran on the
    row (<key>_best_peer) over `impl` (None where either did not run); paired_<key>_vs_best_peer,
    the same paired round by round; <key>_vs_<ours>, ours' us over `impl`'s; check_<key>, its
    output against ours of its form (vs_ours)."""
    impls = res["impls"]
    us = {k: v.get("median_us") for k, v in impls.items()}
    entry, own = impls.get(impl, {}), us.get(impl)
    ran = {p: us[p] for p in peers if us.get(p)}
    best = min(ran, key=ran.get) if ran else None
    res[f"{key}_vs_best_peer"] = ran[best] / own if own and best else None
    res[f"{key}_best_peer"] = best if own else None
    paired = paired_ratio((entry.get("timing") or {}).get("samples_us") or [],
                          (impls.get(best, {}).get("timing") or {}).get("samples_us") or []) if own and best else None
    if paired is not None:
        res[f"paired_{key}_vs_best_peer"] = paired
    if own and us.get(ours):
        res[f"{key}_vs_{ours}"] = us[ours] / own
    if "vs_ours" in entry:
        res[f"check_{key}"] = {"impl": impl, "reference": entry.get("checked_against"),
                               "tolerance": f"|{impl} - ref| <= {ATOL:g} + {RTOL:g} |ref|", **entry["vs_ours"]}


# --- report -----------------------------------------------------------------------------------------
SHORT = {"ours_paged": "ours pg", "ours_ragged": "ours rg", FA3_PATH: "ours sm90 rg", FA3_PAGED: "ours sm90 pg",
         "fa2_paged": "FA2 pg", "fa2_ragged": "FA2 rg", "fa3_paged": "FA3 pg", "fa3_ragged": "FA3 rg",
         "sdpa_flash": "SDPA flash", "sdpa_cudnn": "SDPA cuDNN"}


def _cell(entry: dict | None, key: str):
    if not entry:
        return None
    if key in entry:
        return entry[key]
    return "err" if "error" in entry else "skip" if "skipped" in entry else None


def _agreement(chk: dict) -> str:
    if "agrees" not in chk:
        return "-"
    if chk.get("max_abs_diff") is None:
        return "NaN"
    return f"{'ok' if chk['agrees'] else 'DIFFERS'} {chk['max_abs_diff']:.3f}"


def report(res: dict) -> str:
    meta = res["meta"]
    lines = [f"device {meta.get('device')} (sm {meta.get('capability')}), commit {meta.get('commit')}, "
             f"{meta.get('date')}, torch {meta.get('torch')} CUDA {meta.get('torch_cuda')} cuDNN {meta.get('cudnn')}"]
    mm = res.get("matmul", {})
    lines.append(f"bf16 matmul {mm.get('tflops', float('nan')):.0f} TFLOP/s; copy "
                 f"{res.get('copy', {}).get('gb_per_s', float('nan')):.0f} GB/s; FlashInfer "
                 + (f"{res['flashinfer'].get('version')}" if res["flashinfer"].get("available")
                    else f"not measured: {res['flashinfer'].get('reason')}"))
    builds = res.get("builds", {})
    fi_builds, ours_builds = builds.get("flashinfer", {}), builds.get("ours", {})
    if fi_builds or ours_builds:
        ok = lambda r: r.get("ok") and all(m.get("ok") for m in r.get("modules", {}).values())  # noqa: E731
        lines.append("builds: FlashInfer " + (", ".join(f"{name} {r.get('wall_s', 0):.0f} s" for name, r in
                                                        fi_builds.items()) or "-")
                     + f"; ours {sum(1 for r in ours_builds.values() if ok(r))}/{len(ours_builds)} warmed up, "
                     f"{max([r.get('wall_s', 0) for r in ours_builds.values()] or [0]):.0f} s at most")
        for kind, group in (("FlashInfer", fi_builds), ("ours", ours_builds)):
            for name, r in group.items():
                if not ok(r):
                    lines.append(f"  build {kind} {name} FAILED: " + json.dumps(
                        {k: v for k, v in r.items() if k not in ("seconds", "wall_s")})[:400])
    for s in res.get("skipped", []):
        lines.append(f"skipped {s['row']}: {s['reason']}")
    notes = {}
    for r in res["rows"]:
        for impl, e in r["impls"].items():
            why = e.get("skipped") or e.get("error")
            if why:
                notes.setdefault(f"{impl}: {why[:160]}", []).append(r["label"])
    for note, labels in notes.items():
        lines.append(f"  {note}  [{len(labels)} rows]")
    tf_rows, us_rows = [], []
    for r in res["rows"]:
        im = r["impls"]
        chk = r.get("check", {})
        agree = _agreement(chk)
        miss = [name for name, ok in r.get("targets", {}).items() if not ok]
        best, best_pg = r.get("fa3_path_best_peer"), r.get("fa3_paged_best_peer")
        tf_rows.append([r["label"], *[_cell(im.get(k), "tflops") for k in IMPLS],
                        _cell(im.get("ours_paged"), "frac_matmul"),
                        r["speedup_vs_fa2"].get("paged"), r["speedup_vs_fa2"].get("ragged"),
                        *[r.get("paired_speedup_vs_fa2", {}).get(f, {}).get("median") for f in ("paged", "ragged")],
                        r.get("fa3_path_vs_best_peer"), SHORT.get(best, best),
                        r.get("paired_fa3_path_vs_best_peer", {}).get("median"),
                        r.get("fa3_paged_vs_best_peer"), SHORT.get(best_pg, best_pg),
                        r.get("paired_fa3_paged_vs_best_peer", {}).get("median"),
                        f"{chk.get('reference', '')} {agree}".strip(),
                        _agreement(r.get("check_fa3_path", {})), _agreement(r.get("check_fa3_paged", {})),
                        ("MISS " + "; ".join(miss)) if miss else ("ok" if r.get("targets") else "-")])
        us_rows.append([r["label"], *[_cell(im.get(k), "median_us") for k in IMPLS]])
    lines += ["", "TFLOP/s (x FA2: FA2 us / ours us, >= 1 is ours faster; paired: the median over the rounds of "
                  "that ratio in one round; frac: ours paged / matmul rate; sm90 x best: the best peer's us (of "
                  "FA3 rg, SDPA cuDNN, SDPA flash; which: best peer) / ours sm90 rg us, paired likewise; "
                  "sm90 pg x best: the same for ours sm90 pg, its peers FA3 pg, FA3 rg, SDPA cuDNN, SDPA flash; "
                  "sm90 check / sm90 pg check: ours sm90 rg against ours rg, ours sm90 pg against ours pg)",
              bc.table(tf_rows, ["row", *[SHORT[k] for k in IMPLS], "frac", "x FA2 pg", "x FA2 rg", "paired pg",
                                 "paired rg", "sm90 x best", "best peer", "paired best", "sm90 pg x best",
                                 "pg best peer", "paired pg best", "check", "sm90 check", "sm90 pg check",
                                 "targets"]),
              "", "us per run()", bc.table(us_rows, ["row", *[SHORT[k] for k in IMPLS]])]
    spec = [r for r in res["rows"] if r["kind"] == "spec"]
    if spec:
        sp = []
        for r in spec:
            im = r["impls"]
            sp.append([r["label"], _cell(im.get("ours_paged"), "median_us"), _cell(im.get("ours_paged"), "kv_tb_per_s"),
                       _cell(im.get("ours_decode_q4"), "median_us"), _cell(im.get("ours_decode_q1"), "median_us"),
                       r.get("prefill_over_decode", {}).get("q_len_per_req"),
                       r.get("prefill_over_decode", {}).get("one_token"), _cell(im.get(FA3_PAGED), "median_us"),
                       _cell(im.get("fa2_paged"), "median_us"), _cell(im.get("fa3_paged"), "median_us")])
        lines += ["", f"speculative verification (target: ours prefill <= {TARGET_SPEC_OVER_DECODE:g}x our "
                      "one-token decode)",
                  bc.table(sp, ["row", "ours prefill us", "KV TB/s", "decode q4 us", "decode q1 us",
                                "prefill/q4", "prefill/q1", "ours sm90 pg us", "FA2 us", "FA3 us"])]
    return "\n".join(lines)


# --- the run ----------------------------------------------------------------------------------------
def default_out() -> str:
    if os.environ.get("OUT"):
        return str(Path(os.environ["OUT"]) / "bench_prefill.json")
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return str(bc.REPO / "docs" / "results" / f"{day}_prefill.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true", help="head_dim 128 only and --reps 10 (unless given)")
    p.add_argument("--head-dims", default=None,
                   help=f"comma-separated, of {','.join(map(str, HEAD_DIMS))} (default: all; --quick: 128)")
    p.add_argument("--only", default="",
                   help="only rows whose label contains one of these ';'-separated strings (e.g. 'hd128 causal;spec'; "
                        "--list prints the labels)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed runs per measurement, the median reported (default 50, --quick 10; runs under 1 ms "
                        "take twice as many)")
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/bench_prefill.json, else "
                                               "docs/results/<date>_prefill.json)")
    p.add_argument("--time-limit", type=float, default=240.0,
                   help="seconds for the whole run, builds included (default 240); rows left when it runs out "
                        "are listed as skipped")
    p.add_argument("--build-timeout", type=float, default=215.0,
                   help="seconds from the start after which builds still running are ended and their columns "
                        "skipped (default 215)")
    p.add_argument("--no-overlap", action="store_true",
                   help="time nothing until every build has finished (default: a head dim's rows are measured "
                        "once its own builds are done, while later head dims' builds run)")
    p.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer (FA2 and FA3)")
    p.add_argument("--no-fa3", action="store_true", help="skip FlashInfer's FA3 backend (and its build)")
    p.add_argument("--no-sdpa", dest="sdpa", action="store_false", help="skip torch SDPA")
    p.add_argument("--build-only", action="store_true",
                   help="build FlashInfer's modules and warm up ours, then exit (no timing)")
    p.add_argument("--list", action="store_true", help="print the rows, then exit (no GPU needed)")
    p.add_argument("--fa3-paged-copy", choices=("auto", "on", "off", "both"), default="auto",
                   help="ours_fa3_paged over a copy of the batch's pages read as rows: the planner's rule (auto), "
                        "always (on) or never where the rule alone would (off); the wrapper's _force_copy pin, "
                        "for an A/B of the copy against one TMA box a page. both: the rule, and two more "
                        "providers pinned on and off (" + ", ".join(FA3_PAGED_PINNED) + "), in the same rounds")
    p.add_argument("--page-size", type=int, default=PAGE_SIZE,
                   help=f"tokens a page of every paged form (default {PAGE_SIZE})")
    p.add_argument("--fa3-key-tiles", default="",
                   help="comma-separated key tiles (64, 80, 128, 176): ours_fa3_ragged_n<T> providers, the ragged "
                        "Hopper path with its key tile pinned, in the same rounds (an A/B of the tile rule)")
    p.add_argument("--chunked", default=None,
                   help="the chunked rows, ';'-separated BxQ/KV (chunks of Q query tokens on KV keys, B requests; "
                        "default " + "{}x{}/{}".format(*CHUNKED) + ")")
    args = p.parse_args(argv)
    if args.chunked is not None:
        try:
            shapes = []
            for item in args.chunked.split(";"):
                bq, kv = item.strip().split("/")
                b, q = bq.split("x")
                shapes.append((int(b), int(q), int(kv)))
        except ValueError:
            p.error("--chunked: ';'-separated BxQ/KV, e.g. 8x512/8192;8x256/8192")
        if not shapes or any(b < 1 or q < 1 or kv < q for b, q, kv in shapes):
            p.error("--chunked: B and Q at least 1, KV at least Q")
        globals()["CHUNKED_ROWS"] = shapes
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        p.error("--page-size: a power of two")
    globals()["PAGE_SIZE"] = args.page_size  # (read by the inputs and plans below)
    globals()["FA3_PAGED_COPY"] = {"auto": None, "on": True, "off": False, "both": None}[args.fa3_paged_copy]
    globals()["FA3_PAGED_PINS"] = tuple(FA3_PAGED_PINNED) if args.fa3_paged_copy == "both" else ()
    try:
        tiles = [int(t) for t in args.fa3_key_tiles.split(",") if t.strip()]
    except ValueError:
        tiles = [0]
    if any(t not in (64, 80, 128, 176) for t in tiles):
        p.error("--fa3-key-tiles: comma-separated key tiles of 64, 80, 128, 176")
    globals()["FA3_TILE_PINS"] = tuple(f"{FA3_PATH}_n{t}" for t in tiles)
    if args.head_dims is None:
        args.head_dims = (128,) if args.quick else HEAD_DIMS
    else:
        try:
            args.head_dims = tuple(int(x) for x in args.head_dims.split(",") if x.strip())
        except ValueError:
            args.head_dims = ()
        if not args.head_dims or not set(args.head_dims) <= set(HEAD_DIMS):
            p.error(f"--head-dims: a comma-separated list of {','.join(map(str, HEAD_DIMS))}")
    args.only = tuple(o.strip() for o in args.only.split(";") if o.strip())
    if args.reps is None:
        args.reps = 10 if args.quick else 50
    if args.reps < 1:
        p.error("--reps: at least 1")
    args.out = args.out or default_out()
    return args


def flashinfer_status(enabled: bool) -> dict:
    if not enabled:
        return {"available": False, "reason": "--no-flashinfer"}
    if importlib.util.find_spec("flashinfer") is None:
        return {"available": False,
                "reason": "flashinfer not importable (carry .peers and run with PYTHONPATH=.peers/site)"}
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", os.path.join(tempfile.gettempdir(), "flashinfer_ws"))
    return {"available": True, "workspace": os.environ["FLASHINFER_WORKSPACE_BASE"]}


def fi_env() -> dict:
    env = dict(os.environ)
    paths = env.get("PYTHONPATH", "").split(os.pathsep)  # made absolute, in case it was given relative
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in paths if p)
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 16))
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = row_list(args.head_dims, args.only)
    if args.list:
        for r in rows:
            print(f"{r.label:28s} {'/'.join(r.forms):12s} {r.flops() / 1e12:8.3f} TFLOP  "
                  f"K+V {r.kv_bytes() / 1e6:9.1f} MB  q+K+V+out {r.io_bytes() / 1e6:9.1f} MB")
        return 0
    if not rows:
        print(f"bench_prefill: no row matches --only {';'.join(args.only)!r} (see --list)", file=sys.stderr)
        return 2
    import torch

    if bc.no_gpu("bench_prefill", " (run it on the GPU machine)"):
        return 2
    started = time.perf_counter()
    deadline = started + args.time_limit
    build_deadline = min(deadline, started + args.build_timeout)
    cap = torch.cuda.get_device_capability()
    fi_info = flashinfer_status(not args.no_flashinfer)
    fa3_reason = "--no-fa3" if args.no_fa3 else None if cap[0] == 9 else \
        f"FA3 needs sm90 (this device is sm{cap[0]}{cap[1]})"
    # our Hopper path (ours_fa3_ragged, ours_fa3_paged) is tried on sm90 only; there plan() says what
    # it declines
    fa3_path_reason = None if cap[0] == 9 else f"the sm90 path needs sm90 (this device is sm{cap[0]}{cap[1]})"
    import flashinfer_jit as fij

    try:
        missing = [w for w in WRAPPERS if not hasattr(fij, w)]
        ours_reason = f"flashinfer_jit has no {' / '.join(missing)} yet" if missing else None
    except Exception as exc:  # noqa: BLE001  (the prefill module failing to import)
        ours_reason = f"importing flashinfer_jit's prefill wrappers failed: {type(exc).__name__}: {exc}"[:600]
    order = head_dim_order(r.head_dim for r in rows)
    stages = [(hd, (["fa2"] + ([] if fa3_reason else ["fa3"])) if fi_info["available"] else [],
               ours_configs(rows, hd, prefill=ours_reason is None, fa3=fa3_path_reason is None)) for hd in order]
    builds = Builds(stages, fi_env() if fi_info["available"] else None)
    try:
        return run(args, rows, builds, fi_info, fa3_reason, ours_reason, order, started, deadline, build_deadline,
                   fa3_path_reason)
    finally:  # whatever happened, no build of ours outlives the run
        if builds.running():
            builds.kill("ended: the run finished first")


def run(args, rows, builds, fi_info, fa3_reason, ours_reason, order, started, deadline, build_deadline,
        fa3_path_reason=None) -> int:
    import torch

    res = {"benchmark": "bench_prefill", "meta": bc.run_metadata() | {"cudnn": torch.backends.cudnn.version()},
           "config": {
               "dtype": DTYPE, "num_qo_heads": NUM_QO_HEADS, "num_kv_heads": NUM_KV_HEADS, "page_size": PAGE_SIZE,
               "kv_layout": "NHD", "page_table": "csr, pages in random order", "head_dims": order,
               "prefill_shapes": [f"{b}x{n}" for b, n in PREFILL_SHAPES],
               "chunked": ";".join("x".join(map(str, c)) for c in (CHUNKED_ROWS or [CHUNKED])),
               "spec": "x".join(map(str, SPEC)), "quick": args.quick, "only": list(args.only), "reps": args.reps,
               "time_limit_s": args.time_limit, "build_timeout_s": args.build_timeout, "overlap": not args.no_overlap,
               "flops": "4 x sum over requests of (qo_len x keys attended) x num_qo_heads x head_dim; causal: "
                        "bottom-right aligned, sum_i (kv_len - qo_len + i + 1)",
               "timing": "CUDA events around each eager run() (plan() once before), L2 flushed before each run "
                         f"(memset of max(4 x L2, 64 MiB)), >= {bc.warmup_ms():g} ms warm-up, median of --reps runs "
                         "(2x where a provider of the row runs under 1 ms), the row's providers interleaved run by "
                         "run (rounds of every provider once in the orders of a Williams design: each provider in "
                         "every place and after every other equally often, none twice in a row; "
                         "timing.halves_median_us: the medians of the first and second half of the rounds; "
                         "timing.samples_us: every run, in round order)",
               "speedup_vs_fa2": "FA2 median us / ours (>= 1: ours as fast or faster); time_ratio_ours_over_fa2 "
                                 "its inverse; paired_speedup_vs_fa2: the median (p10, p90) over the rounds of FA2's "
                                 "time over ours in the same round",
               "ours": "ours_paged / ours_ragged: our wrappers planned with backend='fa2' (today's mma.sync "
                       "kernels, whatever 'auto' would pick); ours_fa3_ragged / ours_fa3_paged: the ragged / "
                       "paged wrapper with backend='fa3' (the Hopper path; sm90 only; the paged one on "
                       "ours_paged's page table, cache and page size, every row; skipped with the "
                       "constructor's or plan()'s ValueError where it declines the configuration); "
                       "planned_backend: the wrapper's, after plan()",
               "fa3_path_vs_best_peer": "the fastest (median us) of " + ", ".join(FA3_PATH_PEERS)
                                        + " (fa3_path_best_peer) over ours_fa3_ragged (>= 1: ours faster); "
                                          "paired_fa3_path_vs_best_peer: the same paired round by round; "
                                          "fa3_path_vs_ours_ragged: ours_ragged us / ours_fa3_ragged us",
               "check_fa3_path": "ours_fa3_ragged's output against ours_ragged's (else the row's reference), "
                                 f"agrees if |d| <= {ATOL:g} + {RTOL:g} |ref| everywhere; a disagreement "
                                 "misses the row's targets",
               "fa3_paged_vs_best_peer": "the fastest (median us) of " + ", ".join(FA3_PAGED_PEERS)
                                         + " that ran on the row (fa3_paged_best_peer) over ours_fa3_paged (>= 1: "
                                           "ours faster); paired_fa3_paged_vs_best_peer: the same paired round by "
                                           "round; fa3_paged_vs_ours_paged: ours_paged us / ours_fa3_paged us",
               "check_fa3_paged": "ours_fa3_paged's output against ours_paged's (else the row's reference), "
                                  f"agrees if |d| <= {ATOL:g} + {RTOL:g} |ref| everywhere; a disagreement "
                                  "misses the row's targets ('sm90 pg agrees with ours')",
               "check": f"every provider's output against ours: max abs diff, agrees if |d| <= {ATOL:g} + "
                        f"{RTOL:g} |ours| everywhere",
               "sdpa": "dense [B, H, L, D] copies of the same values; enable_gqa (or the KV heads repeated); "
                       "causal with qo_len < kv_len bottom-right (flash: its op's is_causal; cuDNN: a boolean mask)"
               if args.sdpa else "--no-sdpa"},
           "flashinfer": fi_info, "ours": {"prefill": ours_reason or "available",
                                           "fa3_path": ours_reason or fa3_path_reason or "tried (sm90)"}}
    bc.log(f"bench_prefill: {len(rows)} rows, head dims {order}; FlashInfer "
           f"{'available' if fi_info['available'] else fi_info['reason']}; ours {ours_reason or 'available'}")

    if args.build_only:
        builds.wait(None, build_deadline)
        if builds.running():
            builds.kill(f"ended: not finished {args.build_timeout:g} s into the run (--build-timeout)")
        res["builds"], res["rows"], res["skipped"] = builds.summary(), [], []
        return bc.finish(args.out, res, report, started)
    torch.manual_seed(0)
    flush = Flush()
    builds.ours_done(build_deadline)  # nothing but CPU work beside the timed runs from here on
    running = builds.running()
    res["matmul"] = matmul_rate() | {"build_running": running}
    res["copy"] = bc.copy_bandwidth() | {"build_running": running}
    bc.log(f"matmul {res['matmul']['tflops']:.0f} TFLOP/s, copy {res['copy']['gb_per_s']:.0f} GB/s")
    if args.no_overlap:
        builds.wait(None, build_deadline)
    fi = None
    if fi_info["available"]:
        try:
            import flashinfer

            fi = flashinfer
            fi_info["version"] = getattr(flashinfer, "__version__", "?")
        except Exception as exc:  # noqa: BLE001  (a peer failing must not end the benchmark)
            fi_info.update(available=False, reason=f"import failed: {type(exc).__name__}: {exc}"[:800])
    ctx = Context(fi, None if fi is not None else fi_info.get("reason", "unavailable"), fa3_reason, ours_reason,
                  args.sdpa, builds, args.reps, flush, res["matmul"]["tflops"], fa3_path_reason)
    res["rows"], res["skipped"] = [], []
    for index, row in enumerate(rows):
        if time.perf_counter() < build_deadline:
            builds.wait(row.head_dim, build_deadline)
        if time.perf_counter() >= build_deadline and builds.running():
            builds.kill(f"ended: not finished {args.build_timeout:g} s into the run (--build-timeout)")
        if time.perf_counter() + row.budget_s(args.reps) > deadline - RESERVE_S:
            res["skipped"].append({"row": row.label, "reason": f"--time-limit {args.time_limit:g} s: no time left "
                                                              f"for it (~{row.budget_s(args.reps):.0f} s)"})
            continue
        try:
            res["rows"].append(measure_row(row, ctx, seed=index))
        except Exception as exc:  # noqa: BLE001  (e.g. out of memory building the inputs)
            bc.log(f"{row.label}: {type(exc).__name__}: {exc}")
            res["skipped"].append({"row": row.label, "reason": f"{type(exc).__name__}: {exc}"[:800]})
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001  (a sticky CUDA error)
                pass
    if builds.running():
        builds.kill("ended: the run finished first")
    res["builds"] = builds.summary()
    res["flashinfer"] = fi_info
    return bc.finish(args.out, res, report, started)


if __name__ == "__main__":
    sys.exit(main())

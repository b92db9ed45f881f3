#!/usr/bin/env python3
"""Start-up and per-step host costs of a Llama-3-8B-shaped layer step (scripts/layer_step.py:
RoPE + fp8 quantize + append, decode, prefill; the batch indices and plans they need).

  (a) cold cache, JIT: a new process on an empty cache builds every module it needs with
      nvcc and runs the first step: seconds from the process's start to the first result;
  (b) cold cache, prebuilt: the same process on an empty writable cache, with
      FLASHINFER_JIT_CACHE_PATH on a cache built by `aot --matrix scripts/matrices/llama
      --arch "8.0 9.0a" --out DIR` (--prebuilt DIR, else built here first with no GPU visible),
      FLASHINFER_JIT_DISABLE_JIT=1 and no nvcc on PATH;
  (c) warm start: a new process on the cache (a) filled: import, module loads, first step;
  (d) per step, host time: eager (plan() of both wrappers, then the step's launches) against
      the step captured in a CUDA graph (plan(), then one replay), with the GPU kept ahead:
      time.perf_counter over many steps without a sync inside a round, median of rounds.
Each child process reports times from its own start (time.time() at the parent's
Popen against the child's report; the import of torch included); the first step's result
is checked against float64 references (layer_step.verify) after the timing.

  python3 scripts/bench_deploy.py [--out FILE] [--prebuilt DIR] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (also puts the repository on sys.path)

REPO = bc.REPO

# The child: first step of a small mixed batch, timed from the parent's Popen (argv[1]).
CHILD = r"""
import json, os, sys, time
t_start = float(sys.argv[1])
t0 = time.time()
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import flashinfer_jit
from layer_step import LayerStep, llama8b_batch, verify
import random
t_import = time.time()
torch.zeros(1, device="cuda")  # the CUDA context
torch.cuda.synchronize()
t_context = time.time()
step = LayerStep(device="cuda", graph=False, pool_pages=1024)
torch.cuda.synchronize()
t_alloc = time.time()
step.prepare(llama8b_batch(random.Random(0), 8, 2, 256, max_kv=1000), seed=1)  # loads decode, prefill, planners
before = (step.k_cache.clone(), step.v_cache.clone())
torch.cuda.synchronize()
t_plan = time.time()
step.run()
torch.cuda.synchronize()
t_first = time.time()
verify(step, before, "first step")
print(json.dumps({"python_start_s": t0 - t_start, "to_import_s": t_import - t_start,
                  "context_s": t_context - t_import, "buffers_s": t_alloc - t_context,
                  "prepare_s": t_plan - t_alloc, "run_s": t_first - t_plan,
                  "to_first_result_s": t_first - t_start, "first_step_s": t_first - t_import}))
"""


def child(env: dict) -> dict:
    t = time.time()
    p = subprocess.run([sys.executable, "-c", CHILD, repr(t)], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=1800)
    if p.returncode:
        raise RuntimeError(f"child failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.time() - t
    res["built"] = [line.split("building", 1)[1].split()[0] for line in p.stderr.splitlines()
                    if "flashinfer_jit: building" in line]
    return res


def no_nvcc_path(tmp: Path) -> str:
    """A PATH with nothing on it: the child is started by sys.executable's full path."""
    empty = tmp / "empty-path"
    empty.mkdir(exist_ok=True)
    return str(empty)


def host_per_step(rounds: int, n: int) -> dict:
    """(d): host µs per step, eager and graph, plan() included and alone."""
    import random

    import torch
    from layer_step import LayerStep, llama8b_batch

    def rate(fn) -> float:
        samples = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            samples.append((time.perf_counter_ns() - t0) / n / 1e3)
            torch.cuda.synchronize()
        return round(sorted(samples)[len(samples) // 2], 2)

    batch = llama8b_batch(random.Random(1), 16, 4, 512, max_kv=2000)
    eager = LayerStep(graph=False, seed=0)
    eager.prepare(batch, seed=2)
    graph = LayerStep(graph=True, decode_cap=16, prefill_cap=4, prefill_tokens=512, seed=0)
    graph.prepare(batch, seed=2)
    graph.capture()
    for _ in range(20):  # warm: modules loaded, run()'s fast paths recorded
        eager.plan(), eager.run(), graph.plan(), graph.replay()
    torch.cuda.synchronize()
    e_run = bc.time_cuda(lambda _: eager.run(), warmup=5, reps=50)["median_us"]
    g_run = bc.time_cuda(lambda _: graph.replay(), warmup=5, reps=50)["median_us"]
    return {
        "batch": {"decode_kv": batch.decode_kv, "prefill": batch.prefill},
        "launches_eager": "rope_append, cast, decode (+ merge when split), prefill (+ merge when split)",
        "eager_step_us": rate(lambda: (eager.plan(), eager.run())),
        "graph_step_us": rate(lambda: (graph.plan(), graph.replay())),
        "eager_run_only_us": rate(eager.run),
        "graph_replay_only_us": rate(graph.replay),
        "plan_only_us": rate(eager.plan),
        "device_us": {"eager_step": round(e_run, 2), "graph_step": round(g_run, 2)},
        "rounds": rounds, "steps_per_round": n,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--prebuilt", default=None, help="a cache built by aot --matrix scripts/matrices/llama --out")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--skip-cold-jit", action="store_true", help="skip (a) (and so (c) runs on the prebuilt cache)")
    args = ap.parse_args()
    if bc.no_gpu("bench_deploy"):
        return 2
    started = time.perf_counter()
    out = args.out or bc.default_out("bench_deploy.json")
    res = {"meta": bc.run_metadata(), "what": "Llama-3-8B layer step: 32/8 heads, head_dim 128, fp8 e4m3 "
                                                "paged cache (page 16), bf16 activations"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_JIT_")}
    with tempfile.TemporaryDirectory(prefix="fij-deploy-") as tmp_name:
        tmp = Path(tmp_name)
        jit_cache = tmp / "jit-cache"
        if not args.skip_cold_jit:
            res["cold_jit"] = child(dict(base, FLASHINFER_JIT_CACHE_DIR=str(jit_cache), FLASHINFER_JIT_VERBOSE="1"))
            bc.log(f"cold, JIT: {res['cold_jit']['to_first_result_s']:.1f} s, built {len(res['cold_jit']['built'])}")
        prebuilt = args.prebuilt
        if prebuilt is None:
            prebuilt = str(tmp / "llama")
            t = time.time()
            subprocess.run([sys.executable, "-m", "flashinfer_jit", "aot", "--matrix", "scripts/matrices/llama",
                            "--arch", "8.0 9.0a", "--out", prebuilt, "-j", str(args.jobs)], cwd=REPO, check=True,
                           env=dict(base, CUDA_VISIBLE_DEVICES=""))  # as an image build: no GPU
            res["aot_llama_s"] = time.time() - t
        res["cold_prebuilt"] = child(dict(base, FLASHINFER_JIT_CACHE_DIR=str(tmp / "empty-cache"),
                                          FLASHINFER_JIT_CACHE_PATH=prebuilt, FLASHINFER_JIT_DISABLE_JIT="1",
                                          CUDA_HOME=str(tmp / "no-cuda"), PATH=no_nvcc_path(tmp),
                                          FLASHINFER_JIT_VERBOSE="1"))
        assert not res["cold_prebuilt"]["built"], res["cold_prebuilt"]["built"]
        bc.log(f"cold, prebuilt: {res['cold_prebuilt']['to_first_result_s']:.2f} s")
        warm_env = dict(base, FLASHINFER_JIT_CACHE_DIR=str(jit_cache)) if not args.skip_cold_jit else \
            dict(base, FLASHINFER_JIT_CACHE_DIR=str(tmp / "empty-cache"), FLASHINFER_JIT_CACHE_PATH=prebuilt)
        res["warm"] = [child(warm_env) for _ in range(3)]
        bc.log(f"warm: {[round(w['to_first_result_s'], 2) for w in res['warm']]} s")
    res["host_per_step"] = host_per_step(rounds=7, n=100)
    return bc.finish(out, res, report, started)


def report(res: dict) -> str:
    rows = []
    for name, key in (("cold cache, JIT", "cold_jit"), ("cold cache, prebuilt (no nvcc)", "cold_prebuilt")):
        if key in res:
            r = res[key]
            rows.append([name, r["to_import_s"], r["context_s"], r["buffers_s"], r["prepare_s"], r["run_s"],
                         r["to_first_result_s"], len(r["built"])])
    warm = sorted(res["warm"], key=lambda r: r["to_first_result_s"])[len(res["warm"]) // 2]
    rows.append(["warm start (median of 3)", warm["to_import_s"], warm["context_s"], warm["buffers_s"],
                 warm["prepare_s"], warm["run_s"], warm["to_first_result_s"], 0])
    h = res["host_per_step"]
    lines = [bc.table(rows, ["start", "import s", "CUDA context s", "buffers s", "prepare (plans) s", "first run s",
                             "to first result s", "modules built"]), "",
             bc.table([["eager: plan + launches", h["eager_step_us"], h["eager_run_only_us"],
                        h["device_us"]["eager_step"]],
                       ["graph: plan + replay", h["graph_step_us"], h["graph_replay_only_us"],
                        h["device_us"]["graph_step"]]],
                      ["per step", "host us", "host us w/o plan", "device us"]),
             f"plan() of both wrappers alone: {h['plan_only_us']} us"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

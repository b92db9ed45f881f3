"""Shared pieces of the benchmark scripts: timing, the copy-bandwidth ceiling, run
metadata, tables and JSON.

Timing rules (METHOD.md in the device notes): device work is timed with CUDA events
after a warm-up; the figure is the median of many runs; inputs rotate among several
sets whose total exceeds L2 several times, so the numbers are DRAM numbers, not cache
numbers. Launch-bound cases are also timed as CUDA-graph replays. Host-side costs are
timed with the host clock.

Importing this module touches neither the GPU nor torch's CUDA state.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 scripts/bench_x.py` puts only scripts/ on the path
    sys.path.insert(0, str(REPO))

L2_FALLBACK_BYTES = 50 * 1024 * 1024  # H100 SXM
ROTATE_TARGET_FACTOR = 4  # rotate until the inputs of one round are >= 4x L2


# --- metadata -------------------------------------------------------------------------------
def git_commit() -> str:
    if os.environ.get("FIJ_COMMIT"):  # set by gpu_check.sh where the copy has no .git
        return os.environ["FIJ_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
        commit = out.stdout.strip()
        if out.returncode != 0 or not commit:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_metadata() -> dict:
    import torch

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "host": platform.node(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta.update(device=props.name, sm_count=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1),
                    l2_bytes=l2_bytes())
    try:
        meta["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return meta


def l2_bytes() -> int:
    import torch

    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_FALLBACK_BYTES)


def rotation_sets(bytes_per_call: int, max_sets: int = 16) -> int:
    """How many input sets to rotate among so one round touches >= 4x L2."""
    target = ROTATE_TARGET_FACTOR * l2_bytes()
    return max(1, min(max_sets, math.ceil(target / max(1, bytes_per_call))))


# --- timing ---------------------------------------------------------------------------------
def summarize(samples_us: Sequence[float]) -> dict:
    s = sorted(samples_us)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return {"median_us": statistics.median(s), "p10_us": q(0.1), "p90_us": q(0.9),
            "min_us": s[0], "runs": len(s)}


# The warm-up runs at least this long (milliseconds; FIJ_BENCH_WARMUP_MS overrides it, 0: the
# count alone), as triton.testing.do_bench's does (25 ms): a few calls of a heavy case (3
# replays of 2 x 0.36 ms) left the GPU in a slower state for most of the timed runs. H100,
# fp8 MHA b=256 kv=512 in the full bench_decode run: replays of 363 and 424 us in one
# sample (median 424), 364 in the next impl's sample of the same inputs; A/B, two rounds:
# 423.2 / 423.8 us with the count alone, 363.9 / 364.0 with 25 ms (bf16 GQA-2 b=256
# kv=512: 417.2 / 418.8 -> 357.4 / 357.4). Which GPU state the short warm-up left is not
# established. 25 ms still left the first measurements of a row slow (2026-11-26, 2917729: in one
# bench_decode row, ours 48.5 us eager, the same kernel 48.0 in graph mode measured later;
# A/B of the first rows, two rounds each, 25 -> 200 ms: bf16 b=1 kv=32k 48.7 / 48.3 -> 47.9 /
# 48.0, fp8 b=64 kv=4k 186.1 / 186.3 -> 185.0 / 184.8, bf16 b=64 kv=4k and b=16 kv=2k level),
# so every measurement (ours and the peers alike) warms up for 200 ms.
WARMUP_MS = 200.0


def warmup_ms() -> float:
    return float(os.environ.get("FIJ_BENCH_WARMUP_MS", WARMUP_MS))


def time_cuda(fn: Callable[[int], object], n_sets: int = 1, warmup: int = 10, reps: int = 50,
              inner: int = 1) -> dict:
    """Median device time of one call of fn(set_index), by CUDA events, after `warmup`
    calls and at least warmup_ms() of them. Each sample times `inner` back-to-back calls
    (on rotating sets) and divides by `inner`."""
    import torch

    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    least_ms = warmup_ms()
    if least_ms > 0:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(0)
        end.record()
        end.synchronize()
        more = math.ceil(least_ms / max(start.elapsed_time(end), 1e-3))
        for i in range(min(more, 100_000)):
            fn(i % n_sets)
        torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    call = 0
    for r in range(reps):
        starts[r].record()
        for _ in range(inner):
            fn(call % n_sets)
            call += 1
        ends[r].record()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) * 1e3 / inner for s, e in zip(starts, ends)])


def cuda_graph_buffers(batch: int, num_pages: int) -> dict:
    """Keyword arguments for a decode wrapper in CUDA-graph mode: use_cuda_graph and its
    fixed page-table buffers for `batch` requests over `num_pages` pages."""
    import torch

    def buffer(n):
        return torch.empty(n, dtype=torch.int32, device="cuda")

    return dict(use_cuda_graph=True, paged_kv_indptr_buffer=buffer(batch + 1),
                paged_kv_indices_buffer=buffer(num_pages), paged_kv_last_page_len_buffer=buffer(batch))


def capture_graph(fn: Callable[[int], object], n_sets: int = 1, inner: int = 20):
    """`inner` calls of fn(set_index) captured in one CUDA graph (after a warm-up on a
    side stream, so module loads and allocations stay out of the capture)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i % n_sets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(inner):
            fn(i % n_sets)
    return graph


def time_graph(graph, calls_per_graph: int, warmup: int = 3, reps: int = 50) -> dict:
    """Median device time per call from replays of a captured graph: the figure for
    launch-bound work (launch gaps shrink to the graph's)."""
    per_replay = time_cuda(lambda _: graph.replay(), 1, warmup, reps, 1)
    result = {k: (v / calls_per_graph if k.endswith("_us") else v) for k, v in per_replay.items()}
    return result | {"calls_per_graph": calls_per_graph}


def time_cuda_graph(fn: Callable[[int], object], n_sets: int = 1, inner: int = 20,
                    warmup: int = 3, reps: int = 50) -> dict:
    """capture_graph + time_graph in one: median device time per call from replays.
    (A launch that escapes the capture records nothing and looks free: where that can
    happen, capture_graph, replay once and check the output before timing.)"""
    graph = capture_graph(fn, n_sets, inner)
    return time_graph(graph, inner, warmup, reps)


def time_host(fn: Callable[[], object], n: int, sync_each: bool, warmup: int = 50) -> dict:
    """Host wall-clock per call over n calls (median of 5 batches of n). Without
    sync_each, the device is synchronized once at the end of each batch."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    batches = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        batches.append((time.perf_counter() - t0) / n * 1e6)
    return {"median_us": statistics.median(batches), "min_us": min(batches), "calls": n,
            "batches": 5, "sync_each": sync_each}


def time_python(fn: Callable[[], object], n: int = 100_000) -> float:
    """µs per call of a host-only function (median of 5 batches)."""
    for _ in range(min(n, 1000)):
        fn()
    batches = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        batches.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(batches)


# --- ceilings -------------------------------------------------------------------------------
def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 30, device="cuda") -> dict:
    """Device-to-device copy of a 1 GiB buffer (torch copy_), bytes read + written per
    second: the practical ceiling of any pure data movement."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t = time_cuda(lambda _: dst.copy_(src), 1, warmup=5, reps=reps)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes_per_copy": 2 * nbytes, "median_us": t["median_us"],
            "gb_per_s": 2 * nbytes / (t["median_us"] * 1e-6) / 1e9, "timing": t}


def gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


# --- output ---------------------------------------------------------------------------------
def default_out(name: str) -> str:
    """$OUT/name on the device; elsewhere bench_results/name in the checkout (ignored
    through .git/info/exclude, so it neither shows in git status nor travels)."""
    out = os.environ.get("OUT")
    return str(Path(out) / name) if out else str(REPO / "bench_results" / name)


def write_json(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def no_gpu(name: str, hint: str = "") -> bool:
    """Whether no CUDA GPU is visible; where none is, says so on stderr: benchmark `name` has
    nothing to measure (`hint` appended). The caller then exits with status 2."""
    import torch

    if torch.cuda.is_available():
        return False
    print(f"{name}: no CUDA GPU visible; nothing to measure{hint}", file=sys.stderr)
    return True


def finish(path: str, res: dict, report, started: float) -> int:
    """The end of a benchmark run: the total seconds into res, the JSON written, the
    report printed. Returns the exit status (0)."""
    res["seconds"] = time.perf_counter() - started
    write_json(path, res)
    print(report(res))
    print(f"(JSON: {path}; {res['seconds']:.0f} s)")
    return 0


def table(rows: list[list], headers: list[str]) -> str:
    text = [[str(h) for h in headers]] + [[_cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths)))
             for r in text]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)

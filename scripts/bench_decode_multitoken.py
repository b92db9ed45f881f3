"""Multi-token decode (plan(q_len_per_req=N): speculative-decoding verification) against our
one-token decode of the same batch and cache, and against FlashInfer's batch prefill with N
query tokens a request (causal): FlashInfer 0.5.3 runs decode with q_len_per_req only on its
trtllm-gen backend (sm_100), so prefill is how its users verify drafts on Hopper.

Timing: CUDA-graph replays of our run() (median of many), FlashInfer by CUDA events on
eager launches; the cache (random values, random page order) is far larger than L2. Each
row also checks our output against FlashInfer's where it ran, and records device, date and
commit.

    python3 scripts/bench_decode_multitoken.py [--quick] [--out FILE] [--no-flashinfer]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time

import bench_common as bc

HQ, HK, D, PAGE = 32, 8, 128, 16


def rows(quick: bool) -> list[dict]:
    """(batch, tokens a request, kv_len, cache dtype): the issue's row first."""
    out = [dict(batch=64, tokens=4, kv_len=4096, kv="bfloat16", split_probes=(2, 3, 4))]
    if not quick:
        out += [dict(batch=64, tokens=2, kv_len=4096, kv="bfloat16"),
                dict(batch=64, tokens=8, kv_len=4096, kv="bfloat16"),
                dict(batch=64, tokens=4, kv_len=4096, kv="float8_e4m3fn"),
                dict(batch=16, tokens=4, kv_len=8192, kv="bfloat16"),
                dict(batch=1, tokens=4, kv_len=32768, kv="bfloat16")]
    return out


def measure_row(row: dict, fi, reps: int) -> dict:
    import torch

    import flashinfer_jit as fij

    b, n, kv_len = row["batch"], row["tokens"], row["kv_len"]
    kv_dtype = getattr(torch, row["kv"])
    gen = torch.Generator(device="cuda").manual_seed(b * 1000 + n)
    pages_each = kv_len // PAGE
    num_pages = b * pages_each + 1
    k_cache = torch.randn(num_pages, PAGE, HK, D, generator=gen, device="cuda").to(kv_dtype)
    v_cache = torch.randn(num_pages, PAGE, HK, D, generator=gen, device="cuda").to(kv_dtype)
    indices = torch.randperm(num_pages, generator=gen, device="cuda")[: b * pages_each].int()
    indptr = torch.arange(0, b * pages_each + 1, pages_each, dtype=torch.int32, device="cuda")
    last = torch.full((b,), PAGE, dtype=torch.int32, device="cuda")
    q_multi = torch.randn(b * n, HQ, D, generator=gen, device="cuda").to(torch.bfloat16)
    q_one = q_multi[::n].contiguous()
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    kv_bytes = 2 * b * kv_len * HK * D * kv_dtype.itemsize
    scales = dict(k_scale=1.0, v_scale=1.0) if kv_dtype.itemsize == 1 else {}
    result = dict(row, kv_bytes=kv_bytes, impls={})

    def ours(tokens: int, q, **split):
        w = fij.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True,
                                                   **bc.cuda_graph_buffers(b, num_pages))
        w.plan(indptr, indices, last, HQ, HK, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
               q_len_per_req=tokens, **split)
        out = torch.empty_like(q)
        t = bc.time_cuda_graph(lambda _: w.run(q, (k_cache, v_cache), out=out, **scales), 1, inner=10, reps=reps)
        w.run(q, (k_cache, v_cache), out=out, **scales)
        return t, out

    t_multi, out_multi = ours(n, q_multi)
    t_one, _ = ours(1, q_one)
    result["impls"]["ours_multi"] = t_multi
    result["impls"]["ours_one_token"] = t_one
    result["multi_over_one"] = t_multi["median_us"] / t_one["median_us"]
    result["kv_tb_per_s"] = kv_bytes / t_multi["median_us"] / 1e6
    for chunks in row.get("split_probes", ()):  # the plan's choice against fixed splits
        result["impls"][f"ours_multi_{chunks}_chunks"] = ours(n, q_multi, fixed_split_size=-(-kv_len // chunks))[0]
    if fi is not None:
        for backend in ("fa2", "fa3"):
            try:
                qo_indptr = torch.arange(0, b * n + 1, n, dtype=torch.int32, device="cuda")
                w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                           "NHD", backend=backend)
                w.plan(qo_indptr, indptr, indices, last, HQ, HK, D, PAGE, causal=True, q_data_type=torch.bfloat16,
                       kv_data_type=kv_dtype)
                fo = w.run(q_multi, (k_cache, v_cache))
                t = bc.time_cuda(lambda _: w.run(q_multi, (k_cache, v_cache)), 1, reps=reps)
                err = float((out_multi.double() - fo.double()).norm() / fo.double().norm())
                result["impls"][f"flashinfer_prefill_{backend}"] = t | {"rel_err_vs_ours": err}
            except Exception as exc:  # noqa: BLE001 - a peer that does not run is recorded, not fatal
                result["impls"][f"flashinfer_prefill_{backend}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    del k_cache, v_cache, workspace
    torch.cuda.empty_cache()
    return result


def flashinfer_module(enabled: bool):
    if not enabled or importlib.util.find_spec("flashinfer") is None:
        return None
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", tempfile.mkdtemp(prefix="flashinfer_ws_"))
    import flashinfer

    return flashinfer


def report(res: dict) -> str:
    lines = [f"{res['meta'].get('device')} commit {res['meta'].get('commit')} {res['meta'].get('date')}"]
    table = []
    for r in res["rows"]:
        fi2 = r["impls"].get("flashinfer_prefill_fa2", {}).get("median_us")
        fi3 = r["impls"].get("flashinfer_prefill_fa3", {}).get("median_us")
        table.append([f"b={r['batch']} N={r['tokens']} kv={r['kv_len']} {r['kv']}",
                      r["impls"]["ours_multi"]["median_us"], r["impls"]["ours_one_token"]["median_us"],
                      r["multi_over_one"], r["kv_tb_per_s"], fi2, fi3])
    lines.append(bc.table(table, ["case", "ours N tok (us)", "ours 1 tok (us)", "ratio", "KV TB/s",
                                  "FI prefill fa2", "FI prefill fa3"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the issue's row only (b=64, 4 tokens, kv 4k)")
    p.add_argument("--out", default=bc.default_out("decode_multitoken"))
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    started = time.perf_counter()
    fi = flashinfer_module(not args.no_flashinfer)
    res = {"meta": bc.run_metadata(), "copy": bc.copy_bandwidth(),
           "flashinfer": getattr(fi, "__version__", None), "rows": []}
    for row in rows(args.quick):
        bc.log(f"row {row}")
        res["rows"].append(measure_row(row, fi, args.reps))
    return bc.finish(args.out, res, report, started)


if __name__ == "__main__":
    raise SystemExit(main())

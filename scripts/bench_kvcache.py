"""Benchmarks of the KV-cache write/read paths other than plain append (issue 3):

* fused RoPE + fp8 quantize + append (Llama-like: 32 q / 8 kv heads, head_dim 128, page 16)
  against the same work as separate launches (our RoPE, a torch quantize, our append),
  FlashInfer's rope_quantize_fp8_append_paged_kv_cache and a PyTorch implementation;
* flatten_kv_cache of 64 requests x 2k tokens (bf16, and fp8 dequantized to bf16)
  against a PyTorch gather;
* the decode-step case: 1 token per request, 256 requests (launch-bound: CUDA-graph
  replay time and host time per call).

Every figure is bytes read + written / median time, next to the measured copy bandwidth.
Run on the GPU machine: python3 scripts/bench_kvcache.py [--quick] [--out FILE]
(FlashInfer is used when importable: PYTHONPATH=.peers/site for this process only.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from bench_common import (
    copy_bandwidth,
    default_out,
    gbps,
    log,
    rotation_sets,
    run_metadata,
    table,
    time_cuda,
    time_cuda_graph,
    time_host,
    write_json,
)

HQ, HK, D, PAGE = 32, 8, 128, 16


def _flashinfer():
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", tempfile.mkdtemp(prefix="fi-ws-"))
    try:
        import flashinfer
        import flashinfer.rope  # noqa: F401  (the fused op lives here in 0.5.3)

        return flashinfer
    except Exception as exc:  # not carried, or failed to import: reported, not fatal
        log(f"FlashInfer unavailable: {exc}")
        return None


def _append_batch(nnz: int, requests: int, fp8, gen):
    """Inputs of one fused append: nnz tokens spread over `requests` requests, each
    request's pages allotted contiguously in a shuffled page pool."""
    import torch

    import flashinfer_jit as fij
    from flashinfer_jit.reference.rope import cos_sin_cache_ref

    per = nnz // requests
    seq_lens = torch.full((requests,), per, dtype=torch.int32)
    append_indptr = torch.arange(requests + 1, dtype=torch.int32) * per
    pages_per = (per + PAGE - 1) // PAGE
    num_pages = requests * pages_per
    kv_indptr = torch.arange(requests + 1, dtype=torch.int32) * pages_per
    kv_indices = torch.randperm(num_pages, generator=gen).to(torch.int32)
    dev = "cuda"
    batch_indices, positions = fij.get_batch_indices_positions(append_indptr.to(dev), seq_lens.to(dev), nnz)
    return {
        "q": torch.randn(nnz, HQ, D, dtype=torch.bfloat16, device=dev),
        "k": torch.randn(nnz, HK, D, dtype=torch.bfloat16, device=dev),
        "v": torch.randn(nnz, HK, D, dtype=torch.bfloat16, device=dev),
        "cos_sin": cos_sin_cache_ref(max(per, 1), D).to(dev),
        "pos": positions, "batch_indices": batch_indices, "positions": positions,
        "kv_indptr": kv_indptr.to(dev), "kv_indices": kv_indices.to(dev),
        "kv_last_page_len": torch.full((requests,), per - (pages_per - 1) * PAGE, dtype=torch.int32, device=dev),
        "k_cache": torch.empty(num_pages, PAGE, HK, D, dtype=fp8, device=dev).view(torch.uint8).random_(0, 0x70).view(fp8),
        "v_cache": torch.empty(num_pages, PAGE, HK, D, dtype=fp8, device=dev).view(torch.uint8).random_(0, 0x70).view(fp8),
    }


def _fused_bytes(b) -> int:
    nnz = b["q"].shape[0]
    read = (b["q"].numel() + b["k"].numel() + b["v"].numel()) * 2 + 3 * 4 * nnz
    read += b["cos_sin"].shape[0] * D * 4  # each distinct position's cos/sin row, once
    written = nnz * (HQ + 2 * HK) * D  # fp8 q out, k and v into the cache
    return read + written


def bench_fused(nnz: int, requests: int, fi, quick: bool) -> dict:
    import torch

    import flashinfer_jit as fij

    fp8 = torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(nnz)
    one = _append_batch(nnz, requests, fp8, gen)
    nbytes = _fused_bytes(one)
    sets = [one] + [_append_batch(nnz, requests, fp8, gen) for _ in range(rotation_sets(nbytes) - 1)]
    reps = 20 if quick else 50

    def ours(i):
        b = sets[i]
        fij.rope_quantize_fp8_append_paged_kv_cache(
            b["q"], b["k"], None, None, b["v"], b["cos_sin"], b["pos"], (b["k_cache"], b["v_cache"]),
            b["kv_indices"], b["kv_indptr"], b["batch_indices"], b["positions"], quantize_dtype=fp8,
            quant_scale_q=0.5, quant_scale_kv=0.5, page_size=PAGE)

    def separate(i):  # the same work as three steps: RoPE, quantize (torch), append
        b = sets[i]
        q, k = fij.apply_rope_with_cos_sin_cache(b["pos"], b["q"].view(nnz, -1), b["k"].view(nnz, -1), D, b["cos_sin"])
        (q * 0.5).to(fp8)
        k8 = (k.view(nnz, HK, D) * 0.5).to(fp8)
        v8 = (b["v"] * 0.5).to(fp8)
        fij.append_paged_kv_cache(k8, v8, b["batch_indices"], b["positions"], (b["k_cache"], b["v_cache"]),
                                  b["kv_indices"], b["kv_indptr"], b["kv_last_page_len"])

    def torch_impl(i):  # plain PyTorch: rotate, quantize, scatter by (page, slot)
        b = sets[i]
        cs = b["cos_sin"][b["pos"].long()]
        cos, sin = cs[:, None, : D // 2], cs[:, None, D // 2:]

        def rot(x):
            x1, x2 = x[..., : D // 2].float(), x[..., D // 2:].float()
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

        (rot(b["q"]) * 0.5).to(fp8)
        page = b["kv_indices"][b["kv_indptr"][b["batch_indices"].long()].long() + b["positions"].long() // PAGE].long()
        slot = (b["positions"] % PAGE).long()
        b["k_cache"][page, slot] = (rot(b["k"]) * 0.5).to(fp8)
        b["v_cache"][page, slot] = (b["v"] * 0.5).to(fp8)

    def flashinfer_fused(i):
        b = sets[i]
        fi.rope.rope_quantize_fp8_append_paged_kv_cache(
            b["q"], b["k"], None, None, b["v"], b["cos_sin"], b["pos"], (b["k_cache"], b["v_cache"]),
            b["kv_indices"], b["kv_indptr"], b["batch_indices"], b["positions"], quantize_dtype=fp8,
            quant_scale_q=0.5, quant_scale_kv=0.5, page_size=PAGE)

    rows = {"ours (fused)": ours, "ours, 3 separate steps": separate, "PyTorch": torch_impl}
    if fi is not None:
        rows["FlashInfer 0.5.3 (fused)"] = flashinfer_fused
    result = {"nnz": nnz, "requests": requests, "bytes": nbytes, "rows": {}}
    for name, fn in rows.items():
        try:  # device time by graph replay; eager events would add host time (see bench_append)
            t = time_cuda_graph(fn, len(sets), inner=len(sets) * max(1, -(-4 // len(sets))), reps=reps)
            eager = time_cuda(fn, len(sets), warmup=5, reps=reps)
            result["rows"][name] = t | {"gb_per_s": gbps(nbytes, t["median_us"]), "eager_us": eager["median_us"]}
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            result["rows"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            log(f"{name} failed: {exc}")
    return result


def bench_flatten(requests: int, tokens: int, fp8: bool, quick: bool) -> dict:
    import torch

    import flashinfer_jit as fij

    dev = "cuda"
    gen = torch.Generator().manual_seed(7)
    pages_per = (tokens + PAGE - 1) // PAGE
    num_pages = requests * pages_per
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    out_elem = 2
    nbytes = 2 * requests * tokens * HK * D * (cache_dtype.itemsize + out_elem)
    n_sets = rotation_sets(nbytes)

    def make():
        k = torch.randn(num_pages, PAGE, HK, D, device=dev).to(cache_dtype)
        v = torch.randn(num_pages, PAGE, HK, D, device=dev).to(cache_dtype)
        bt = torch.randperm(num_pages, generator=gen).to(torch.int32).view(requests, pages_per).to(dev)
        return k, v, bt

    sets = [make() for _ in range(n_sets)]
    seqlens = torch.full((requests,), tokens, dtype=torch.int32, device=dev)
    out_size = requests * tokens
    scale = dict(k_scale=0.5, v_scale=0.5) if fp8 else {}

    def ours(i):
        k, v, bt = sets[i]
        fij.flatten_kv_cache(k, v, seqlens, bt, out_size=out_size, **scale)

    def torch_impl(i):
        k, v, bt = sets[i]
        pages = bt.reshape(-1).long()
        k_out = k[pages].reshape(out_size, HK, D)
        v_out = v[pages].reshape(out_size, HK, D)
        if fp8:
            (k_out.to(torch.bfloat16) * 0.5), (v_out.to(torch.bfloat16) * 0.5)

    reps = 20 if quick else 50
    result = {"requests": requests, "tokens": tokens, "cache_dtype": str(cache_dtype), "bytes": nbytes, "rows": {}}
    for name, fn in (("ours", ours), ("PyTorch gather", torch_impl)):
        t = time_cuda_graph(fn, n_sets, inner=n_sets * max(1, -(-4 // n_sets)), reps=reps)
        eager = time_cuda(fn, n_sets, warmup=5, reps=reps)
        result["rows"][name] = t | {"gb_per_s": gbps(nbytes, t["median_us"]), "eager_us": eager["median_us"]}
    return result


def bench_decode_step(fi) -> dict:
    """256 requests x 1 token: per-call device time in a CUDA graph and host time."""
    import torch

    import flashinfer_jit as fij

    fp8 = torch.float8_e4m3fn
    b = _append_batch(256, 256, fp8, torch.Generator().manual_seed(0))
    k8, v8 = b["k"].to(fp8), b["v"].to(fp8)

    def fused(_):
        fij.rope_quantize_fp8_append_paged_kv_cache(
            b["q"], b["k"], None, None, b["v"], b["cos_sin"], b["pos"], (b["k_cache"], b["v_cache"]),
            b["kv_indices"], b["kv_indptr"], b["batch_indices"], b["positions"], quantize_dtype=fp8, page_size=PAGE)

    def append(_):
        fij.append_paged_kv_cache(k8, v8, b["batch_indices"], b["positions"], (b["k_cache"], b["v_cache"]),
                                  b["kv_indices"], b["kv_indptr"], b["kv_last_page_len"])

    out = {}
    for name, fn in (("fused rope+fp8+append", fused), ("append (fp8 cache)", append)):
        out[name] = {"graph": time_cuda_graph(fn), "host": time_host(lambda: fn(0), 2000, False)}
    if fi is not None:
        def fi_fused(_):
            fi.rope.rope_quantize_fp8_append_paged_kv_cache(
                b["q"], b["k"], None, None, b["v"], b["cos_sin"], b["pos"], (b["k_cache"], b["v_cache"]),
                b["kv_indices"], b["kv_indptr"], b["batch_indices"], b["positions"], quantize_dtype=fp8,
                page_size=PAGE)
        try:
            out["FlashInfer fused"] = {"graph": time_cuda_graph(fi_fused), "host": time_host(lambda: fi_fused(0), 2000, False)}
        except Exception as exc:
            out["FlashInfer fused"] = {"error": str(exc)[:300]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--out", default=default_out("bench_kvcache.json"))
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_kvcache: needs a CUDA GPU", file=sys.stderr)
        return 2
    fi = None if args.no_flashinfer else _flashinfer()
    copy = copy_bandwidth()
    ceiling = copy["gb_per_s"]
    fused = [bench_fused(n, 64, fi, args.quick) for n in ((8192, 65536) if args.quick else (8192, 16384, 32768, 65536))]
    flat = [bench_flatten(64, 2048, fp8, args.quick) for fp8 in (False, True)]
    decode = bench_decode_step(fi)
    data = {"meta": run_metadata(), "copy_bandwidth": copy, "fused": fused, "flatten": flat, "decode_step": decode}
    write_json(args.out, data)

    rows = []
    for f in fused:
        for name, r in f["rows"].items():
            rows.append([f"rope+fp8+append {f['nnz']} tok", name, r.get("median_us"), r.get("gb_per_s"),
                         None if "gb_per_s" not in r else 100 * r["gb_per_s"] / ceiling, r.get("eager_us")])
    for f in flat:
        for name, r in f["rows"].items():
            rows.append([f"flatten 64x2k {f['cache_dtype'].replace('torch.', '')}", name, r["median_us"],
                         r["gb_per_s"], 100 * r["gb_per_s"] / ceiling, r.get("eager_us")])
    print(f"\ncopy bandwidth {ceiling:.0f} GB/s ({run_metadata().get('device')})")
    print(table(rows, ["case", "impl", "graph us", "GB/s", "% copy", "eager us"]))
    drows = [[name, r.get("graph", {}).get("median_us"), r.get("host", {}).get("median_us")]
             for name, r in decode.items()]
    print("\ndecode step: 256 requests x 1 token (fp8 cache)")
    print(table(drows, ["op", "graph-replay us/call", "host us/call"]))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plots of the recorded benchmark JSON (docs/results/) into docs/figures/.

    python3 scripts/plot_results.py [--date 2026-11-22]

Needs matplotlib (a development tool here, not a package dependency).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS, FIGURES = REPO / "docs" / "results", REPO / "docs" / "figures"
# the decode figure's run (docs/performance.md's table): the full benchmark at this commit
DECODE_RESULT = "2026-11-26_h100_decode_full_4a1b234.json"


def _load(pattern: str) -> dict:
    files = sorted(RESULTS.glob(pattern))
    if not files:
        raise SystemExit(f"no {pattern} in {RESULTS}")
    return json.loads(files[-1].read_text())


def plot_append(plt, data: dict, out: Path) -> None:
    copy = data["copy"]["gb_per_s"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, dtype in zip(axes, ("bfloat16", "float8_e4m3fn")):
        rows = [r for r in data["append"] if r["dtype_kv"] == dtype]
        tokens = [r["tokens"] for r in rows]
        for impl, style in (("ours", "o-"), ("flashinfer", "s--"), ("torch", "^:")):
            frac = [100 * r["impls"][impl]["frac_copy"] if "frac_copy" in r["impls"][impl] else None for r in rows]
            ax.plot(tokens, frac, style, label={"ours": "flashinfer_jit", "flashinfer": "FlashInfer 0.5.3",
                                                 "torch": "PyTorch index_copy_"}[impl])
        ax.axhline(80, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(tokens, [f"{t // 1024}k" for t in tokens])
        ax.set_title(f"append_paged_kv_cache, {dtype} cache")
        ax.set_xlabel("appended tokens (8 heads x 128, page 16)")
    axes[0].set_ylabel(f"% of copy bandwidth ({copy:.0f} GB/s)")
    axes[0].set_ylim(0, 100)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{data['meta']['device']}, {data['meta']['date'][:10]}, commit {data['meta']['commit'][:10]}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_kvcache(plt, data: dict, out: Path) -> None:
    copy = data["copy_bandwidth"]["gb_per_s"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    tokens = [f["nnz"] for f in data["fused"]]
    for name, style in (("ours (fused)", "o-"), ("FlashInfer 0.5.3 (fused)", "s--"),
                        ("ours, 3 separate steps", "d-."), ("PyTorch", "^:")):
        vals = [100 * f["rows"].get(name, {}).get("gb_per_s", float("nan")) / copy for f in data["fused"]]
        if any(v == v for v in vals):
            ax1.plot(tokens, vals, style, label=name)
    ax1.axhline(75, color="grey", lw=0.8, ls="--")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(tokens, [f"{t // 1024}k" for t in tokens])
    ax1.set_ylim(0, 100)
    ax1.set_ylabel(f"% of copy bandwidth ({copy:.0f} GB/s)")
    ax1.set_xlabel("tokens (q 32 heads, k/v 8 heads, head_dim 128, fp8 e4m3 cache)")
    ax1.set_title("RoPE + fp8 quantize + append")
    ax1.legend(fontsize=8)
    labels, ours, torch_ = [], [], []
    for f in data["flatten"]:
        labels.append(f["cache_dtype"].replace("torch.", "").replace("float8_e4m3fn", "fp8 e4m3"))
        ours.append(100 * f["rows"]["ours"]["gb_per_s"] / copy)
        torch_.append(100 * f["rows"]["PyTorch gather"]["gb_per_s"] / copy)
    xs = range(len(labels))
    ax2.bar([x - 0.2 for x in xs], ours, 0.4, label="flashinfer_jit")
    ax2.bar([x + 0.2 for x in xs], torch_, 0.4, label="PyTorch gather")
    ax2.axhline(80, color="grey", lw=0.8, ls="--")
    ax2.set_xticks(list(xs), labels)
    ax2.set_ylim(0, 100)
    ax2.set_title("flatten_kv_cache, 64 x 2k tokens")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{data['meta']['device']}, {data['meta']['date'][:10]}, commit {data['meta']['commit'][:10]}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_decode(plt, data: dict, out: Path) -> None:
    """Achieved KV bandwidth against kv_len per batch size, ours (solid) and the faster
    FlashInfer path (dashed), one panel per KV dtype x GQA group; the copy ceiling dotted."""
    copy = data["copy"]["gb_per_s"]
    panels = [("bfloat16", 4), ("bfloat16", 8), ("float8_e4m3fn", 4), ("float8_e4m3fn", 8)]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8), sharey=True)
    for ax, (dtype, gqa) in zip(axes, panels):
        rows = [r for r in data["rows"] if r["kv_dtype"] == dtype and r["gqa"] == gqa and isinstance(r.get("kv_len"), int)
                and "impls" in r]
        for batch, color in zip(sorted({r["batch"] for r in rows}), ("C0", "C1", "C2", "C3")):
            sel = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["kv_len"])
            lens = [r["kv_len"] for r in sel]
            ours = [r["impls"]["ours"].get("gb_per_s", float("nan")) / 1e3 for r in sel]
            fi = [r["impls"][r["flashinfer_best"]].get("gb_per_s", float("nan")) / 1e3 if r.get("flashinfer_best")
                  else float("nan") for r in sel]
            ax.plot(lens, ours, "-o", color=color, label=f"b={batch} flashinfer_jit")
            ax.plot(lens, fi, "--x", color=color, alpha=0.6, label=f"b={batch} FlashInfer (faster path)")
        ax.axhline(copy / 1e3, color="k", linestyle=":", label="copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype.replace('float8_', '')} KV, {gqa * 8}/8 heads")
        ax.set_xlabel("kv_len (tokens)")
    axes[0].set_ylabel("KV bytes read / time (TB/s)")
    axes[-1].legend(fontsize=6, loc="lower right")
    fig.suptitle(f"batch decode, head_dim 128, page 16 ({data['meta'].get('device', '')}, "
                 f"{data['meta'].get('date', '')[:10]}, {DECODE_RESULT.rsplit('_', 1)[-1][:-5]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# the prefill figure's run (docs/prefill.md's table)
PREFILL_RESULT = "2026-11-27_h100_prefill_497f941.json"


def plot_prefill(plt, data: dict, out: Path) -> None:
    """TFLOP/s per benchmark row, one panel per head_dim: ours (paged, ragged), FlashInfer's
    FA2 and FA3 (paged, ragged), cuDNN's SDPA on dense copies; the bf16 matmul rate dotted."""
    impls = [("ours_paged", "flashinfer_jit paged", "C0", None), ("ours_ragged", "flashinfer_jit ragged", "C0", "//"),
             ("fa2_paged", "FA2 paged", "C1", None), ("fa2_ragged", "FA2 ragged", "C1", "//"),
             ("fa3_paged", "FA3 paged", "C2", None), ("fa3_ragged", "FA3 ragged", "C2", "//"),
             ("sdpa_cudnn", "SDPA cuDNN (dense)", "C7", None)]
    dims = sorted({r["head_dim"] for r in data["rows"]})
    fig, axes = plt.subplots(len(dims), 1, figsize=(14, 3.6 * len(dims)), sharey=True)
    width = 0.8 / len(impls)
    for ax, d in zip(axes, dims):
        rows = [r for r in data["rows"] if r["head_dim"] == d and "spec" not in r["label"]]
        for k, (key, label, color, hatch) in enumerate(impls):
            vals = [r["impls"].get(key, {}).get("tflops", float("nan")) for r in rows]
            ax.bar([i + (k - len(impls) / 2 + 0.5) * width for i in range(len(rows))], vals, width, color=color,
                   hatch=hatch, alpha=0.5 if key.startswith("sdpa") else 0.9, label=label, edgecolor="white")
        ax.axhline(data["matmul"]["tflops"], color="k", linestyle=":", label="bf16 matmul")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["label"].split(" ", 1)[1] for r in rows], fontsize=8)
        ax.set_title(f"head_dim {d}", fontsize=9)
        ax.set_ylabel("TFLOP/s")
    axes[0].legend(fontsize=7, ncol=4, loc="upper right")
    fig.suptitle(f"batch prefill, bf16, 32/8 heads, page 16 ({data['meta'].get('device', '')}, "
                 f"{data['meta'].get('date', '')[:10]}, {data['meta'].get('commit', '')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--date", default="", help="prefix of the result files to plot (default: newest)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    FIGURES.mkdir(parents=True, exist_ok=True)
    plot_append(plt, _load(f"{args.date}*append.json"), FIGURES / "append_bandwidth.png")
    plot_kvcache(plt, _load(f"{args.date}*kvcache.json"), FIGURES / "kvcache_bandwidth.png")
    plot_decode(plt, _load(DECODE_RESULT), FIGURES / "decode_bandwidth.png")
    plot_prefill(plt, _load(PREFILL_RESULT), FIGURES / "prefill_tflops.png")
    print(f"wrote {FIGURES}/append_bandwidth.png, kvcache_bandwidth.png, decode_bandwidth.png, prefill_tflops.png")


if __name__ == "__main__":
    main()

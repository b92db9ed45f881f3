#!/usr/bin/env python3
"""One ragged prefill row run three times by one implementation, for ncu to profile the third
launch (no timing, no L2 flush; ncu flushes between its passes). bf16, 32 query / 8 KV heads,
random inputs.

  ncu --clock-control none --kernel-name regex:'prefill_sm90|PrefillWithKVCache' --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight ... python3 scripts/ncu_prefill_sm90.py ours 128 full 4 4096

implementation: ours (the ragged wrapper, backend="fa3": kernel prefill_sm90_kernel), fa3
(FlashInfer's ragged wrapper, backend="fa3": kernel PrefillWithKVCacheKernel; FlashInfer on
PYTHONPATH, as bench_prefill.py) or cudnn (torch SDPA's CUDNN_ATTENTION backend on dense
[B, H, L, D] copies, KV heads grouped by enable_gqa, as bench_prefill.py's sdpa_cudnn; equal
lengths only; its kernel's name is cuDNN's: profile with --kernel-name regex:'cudnn|sm90').
Arguments: head_dim, causal|full, requests, tokens a request (query and key alike).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository (ours)


def make_runner(impl: str, hd: int, mask: str, batch: int, n: int):
    """The row's inputs and a closure that runs it once by `impl` (returns the output)."""
    import torch

    if impl == "ours":
        import flashinfer_jit as module
    elif impl == "fa3":
        import flashinfer as module
    elif impl != "cudnn":
        raise SystemExit(f"implementation: ours, fa3 or cudnn, not {impl!r}")
    torch.manual_seed(0)
    heads, kv_heads, dev = 32, 8, "cuda"
    if impl == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q = torch.randn(batch, heads, n, hd, dtype=torch.bfloat16, device=dev)
        k = torch.randn(batch, kv_heads, n, hd, dtype=torch.bfloat16, device=dev)
        v = torch.randn(batch, kv_heads, n, hd, dtype=torch.bfloat16, device=dev)

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=mask == "causal",
                                                                        enable_gqa=True)
        return run
    q = torch.randn(batch * n, heads, hd, dtype=torch.bfloat16, device=dev)
    k = torch.randn(batch * n, kv_heads, hd, dtype=torch.bfloat16, device=dev)
    v = torch.randn(batch * n, kv_heads, hd, dtype=torch.bfloat16, device=dev)
    indptr = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = module.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    w.plan(indptr.to(dev) if impl == "fa3" else indptr, indptr.to(dev) if impl == "fa3" else indptr, heads,
           kv_heads, hd, causal=mask == "causal", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return lambda: w.run(q, k, v)


def main() -> None:
    import torch

    impl, hd, mask, batch, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    run = make_runner(impl, hd, mask, batch, n)
    for _ in range(3):
        out = run()
    torch.cuda.synchronize()
    print("done", impl, hd, mask, batch, n, float(out.float().abs().mean()))


if __name__ == "__main__":
    main()

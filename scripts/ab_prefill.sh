#!/usr/bin/env bash
# One device call of a prefill A/B (scripts/ab_prefill_variants.py), from the repository root:
# prebuilds every variant's modules (AOT, 16 jobs) while FlashInfer's FA2 prefill modules build
# in the background (JIT, the peer on PYTHONPATH: ../shared/peers/flashinfer/README.md), then
# times the variants and FA2 interleaved. Results: $OUT/ab.txt (a line a row), the build logs.
#
#   VARIANTS="BASE NEW BASEB" VARIANT_DIR=.carry/var MATRIX=.carry/m_ab FIDIMS=128 \
#     DIMS=128 FORMS=ragged,paged SHAPES=64x256,16x1024,4x4096,1x16384 MASKS=full,causal \
#     ROUNDS=3 FLUSH=0 bash scripts/ab_prefill.sh
#
# VARIANT_DIR/NAME.cuh replaces csrc/prefill.cuh for variant NAME (csrc/prefill.cuh is put
# back at the end); MATRIX names the modules the rows need (an AOT matrix file: every
# variant builds it). A copy of the base under a second name (BASEB) measures the noise.
# Measured on an H100, 2026-11-27: about 45-70 s of builds for 3 variants x 1-12 modules with
# FA2 for three head dims, then 1-2 min of timing for 4-48 rows.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT: the results folder}" "${VARIANTS:?VARIANTS: the names of the variants}" "${MATRIX:?MATRIX: an AOT matrix file}"
VARIANT_DIR=${VARIANT_DIR:-.carry/var}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws} MAX_JOBS=${MAX_JOBS:-16}
export FLASHINFER_JIT_CACHE_DIR=${FLASHINFER_JIT_CACHE_DIR:-/tmp/fij_ab_cache}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
cp csrc/prefill.cuh /tmp/prefill.cuh.orig
trap 'cp /tmp/prefill.cuh.orig csrc/prefill.cuh' EXIT
# FlashInfer's FA2 prefill modules for the head dims given: a tiny plan() and run() each
PYTHONPATH=.peers/site timeout 400 python3 - "${FIDIMS:-128}" > "$OUT/fi_warm.log" 2>&1 <<'PY' &
import sys, torch, flashinfer
for d in [int(x) for x in sys.argv[1].split(',')]:
    ws = torch.empty(64 << 20, dtype=torch.uint8, device='cuda')
    qo = torch.tensor([0, 64], dtype=torch.int32, device='cuda')
    q = torch.randn(64, 32, d, dtype=torch.bfloat16, device='cuda')
    k = torch.randn(64, 8, d, dtype=torch.bfloat16, device='cuda')
    for causal in (False, True):
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, backend='fa2')
        w.plan(qo, qo, 32, 8, d, causal=causal, q_data_type=torch.bfloat16)
        w.run(q, k, k)
    torch.cuda.synchronize()
    print('fa2 built', d, flush=True)
PY
t0=$(date +%s)
for V in $VARIANTS; do
  name=${V%%@*}
  cp "$VARIANT_DIR/$name.cuh" csrc/prefill.cuh
  python3 -m flashinfer_jit aot --matrix "$MATRIX" -j "$MAX_JOBS" > "$OUT/aot_$name.log" 2>&1 || echo "aot $name failed"
  tail -1 "$OUT/aot_$name.log"
done
cp /tmp/prefill.cuh.orig csrc/prefill.cuh
echo "builds $(( $(date +%s) - t0 )) s"
wait
tail -3 "$OUT/fi_warm.log"
echo "FlashInfer ready $(( $(date +%s) - t0 )) s"
PYTHONPATH=.peers/site VARIANT_DIR="$VARIANT_DIR" FI=${FI:-1} timeout "${AB_TIMEOUT:-450}" \
  python3 scripts/ab_prefill_variants.py 2>&1 | grep -v Warning | tee "$OUT/ab.txt"

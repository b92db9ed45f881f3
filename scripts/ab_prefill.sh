#!/usr/bin/env bash
# One device call of a prefill A/B (scripts/ab_prefill_variants.py), from the repository root:
# prebuilds every variant's modules (AOT, the variants side by side in scratch copies, 16 jobs
# in all) while FlashInfer's FA2 prefill modules build in the background (JIT, the peer on
# PYTHONPATH: ../shared/peers/flashinfer/README.md), then times the variants and FA2
# interleaved. Results: $OUT/ab.txt (a line a row), the build logs.
#
#   VARIANTS="BASE NEW BASEB" VARIANT_DIR=.carry/var MATRIX=.carry/m_ab FIDIMS=128,64 \
#     DIMS=128 FORMS=ragged,paged SHAPES=64x256,16x1024,4x4096,1x16384 MASKS=full,causal \
#     ROUNDS=3 FLUSH=0 bash scripts/ab_prefill.sh
#
# VARIANT_DIR/NAME.cuh replaces csrc/prefill/prefill.cuh for variant NAME (csrc/prefill/prefill.cuh is put
# back at the end); MATRIX names the modules the rows need (an AOT matrix file: every
# variant builds it). A copy of the base under a second name (BASEB) measures the noise.
# Measured on an H100, 2026-11-27 (with FA2 built by a plan() and run() then): 43-71 s of
# builds for 3 variants x 1-12 modules and FA2 at 1-3 head dims, one variant after the other;
# side by side, 30-90 s for 1-6 variants of 2-6 modules; then about 15 s of timing for 4 rows
# (6 rounds) and 50 s for 48 rows (3 rounds).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT: the results folder}" "${VARIANTS:?VARIANTS: the names of the variants}" "${MATRIX:?MATRIX: an AOT matrix file}"
VARIANT_DIR=${VARIANT_DIR:-.carry/var}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws} MAX_JOBS=${MAX_JOBS:-16}
export FLASHINFER_JIT_CACHE_DIR=${FLASHINFER_JIT_CACHE_DIR:-/tmp/fij_ab_cache}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
cp csrc/prefill/prefill.cuh /tmp/prefill.cuh.orig
trap 'cp /tmp/prefill.cuh.orig csrc/prefill/prefill.cuh' EXIT
# FlashInfer's FA2 prefill modules for the head dims given, built (CPU only) by the
# benchmark's own builder (bench_prefill.FLASHINFER_BUILD), one head dim after the other
FI_BUILD=$(python3 -c 'import sys; sys.path.insert(0, "scripts"); import bench_prefill; print(bench_prefill.FLASHINFER_BUILD)')
(for hd in ${FIDIMS//,/ }; do
  PYTHONPATH=.peers/site timeout 400 python3 -c "$FI_BUILD" "$hd" fa2
done > "$OUT/fi_build.log" 2>&1) &
t0=$(date +%s)
# every distinct variant built side by side, each in a scratch copy of the tracked tree with
# its csrc/prefill/prefill.cuh (the cache key holds the sources' contents, not their paths: the
# timing below finds them); VJ jobs a variant (default 16 over the variants)
names=$(for V in $VARIANTS; do echo "${V%%@*}"; done | sort -u)
count=$(echo "$names" | wc -l)
VJ=${VJ:-$(( MAX_JOBS / count > 1 ? MAX_JOBS / count : 1 ))}
root=$(pwd)
case $MATRIX in /*) matrix=$MATRIX ;; *) matrix=$root/$MATRIX ;; esac
for name in $names; do
  scratch=$(mktemp -d)
  (git ls-files -z | xargs -0 -I{} cp --parents {} "$scratch/" 2>/dev/null
   cp "$VARIANT_DIR/$name.cuh" "$scratch/csrc/prefill/prefill.cuh"
   cd "$scratch" && python3 -m flashinfer_jit aot --matrix "$matrix" -j "$VJ" > "$OUT/aot_$name.log" 2>&1 \
     || echo "aot $name failed"
   tail -1 "$OUT/aot_$name.log"; rm -rf "$scratch") &
done
wait
echo "builds $(( $(date +%s) - t0 )) s"
wait
tail -3 "$OUT/fi_build.log"
echo "FlashInfer ready $(( $(date +%s) - t0 )) s"
PYTHONPATH=.peers/site VARIANT_DIR="$VARIANT_DIR" FI=${FI:-1} timeout "${AB_TIMEOUT:-450}" \
  python3 scripts/ab_prefill_variants.py 2>&1 | grep -v Warning | tee "$OUT/ab.txt"

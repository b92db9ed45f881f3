#!/usr/bin/env bash
# One device call of the A/B of this tree against a base commit's, on the rows of the decode
# and prefill benchmarks of record (ours against ours, no peers): the check that a refactor
# of the kernels or the host code costs nothing.
#
#   here:      git archive BASE flashinfer_jit csrc templates scripts pyproject.toml | gzip > .carry/base.tgz
#   on the GPU (carry .carry):
#              OUT=<results> ROUNDS=2 bash scripts/ab_trees.sh .carry/base.tgz
#
# - prefill: scripts/ab_tree.py in one process (both trees' modules side by side, interleaved,
#   outputs compared), every row of bench_prefill.py;
# - decode: scripts/bench_decode.py --no-flashinfer --no-sdpa in each tree, one process each,
#   ROUNDS times in the order new, base, new, base, ...; row by row, new/base of the medians
#   of each tree's runs.
# $OUT gets ab_tree.json, ab_tree.log, dec_<tree>_<round>.json (7 files with ROUNDS=2; the
# device tool returns 8) and the summary dec_cmp.txt. Measured on an H200 (2026-11-29):
# about 2 min of builds on a fresh machine, 1.5 min for the prefill rows at head_dim 128
# (3 head dims: ~4 min), 45 s a decode run.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT: the results folder}"
BASE_TGZ=${1:?the base tree: a .tgz of its flashinfer_jit csrc templates scripts pyproject.toml}
ROUNDS=${ROUNDS:-2}
export FLASHINFER_JIT_CACHE_DIR=${FLASHINFER_JIT_CACHE_DIR:-/tmp/ab_trees_cache} PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16}
R=$PWD
B=$(mktemp -d)
tar -xzf "$BASE_TGZ" -C "$B"
T0=$SECONDS
# the decode benchmark's modules, in both trees at once
printf 'decode dtype_q=bfloat16 dtype_kv=bfloat16,float8_e4m3fn head_dim=128 group_tile=4,8\ndecode_plan\npage_order\n' \
  > "$B/dec_matrix"
(cd "$B" && python3 -m flashinfer_jit aot --matrix "$B/dec_matrix" -j 8 > "$B/aot.log" 2>&1) &
python3 -m flashinfer_jit aot --matrix "$B/dec_matrix" -j 8 > /dev/null 2>&1
wait
python3 scripts/ab_tree.py --base "$B" --out "$OUT/ab_tree.json" --jobs "$MAX_JOBS" --time-limit "${AB_TIME_LIMIT:-280}" > "$OUT/ab_tree.log" 2>&1
echo "prefill: rc $? at $((SECONDS - T0)) s; $(grep summary "$OUT/ab_tree.log" | tail -1)"
for r in $(seq 1 "$ROUNDS"); do
  for tree in new base; do
    dir=$R; [ "$tree" = base ] && dir=$B
    (cd "$dir" && FIJ_COMMIT=$tree python3 scripts/bench_decode.py --no-flashinfer --no-sdpa --graph-mode no --time-limit "${DEC_TIME_LIMIT:-70}" \
       --out "$OUT/dec_${tree}_$r.json" > "$B/dec_${tree}_$r.log" 2>&1)
    echo "decode $tree round $r: rc $? at $((SECONDS - T0)) s"
  done
done
python3 - "$OUT" <<'EOF' | tee "$OUT/dec_cmp.txt"
import glob, json, statistics, sys
out = sys.argv[1]
runs = {"new": [], "base": []}
for tree in runs:
    for f in sorted(glob.glob(f"{out}/dec_{tree}_*.json")):
        runs[tree].append({r["case"]: r["impls"]["ours"]["median_us"] for r in json.load(open(f))["rows"]
                           if "median_us" in r["impls"].get("ours", {})})
med = {t: {k: statistics.median(run[k] for run in rs if k in run) for k in rs[0]} for t, rs in runs.items() if rs}
rows = sorted((med["new"][k] / med["base"][k], k) for k in med["new"] if k in med["base"])
print(f"decode: {len(rows)} rows, new/base {rows[0][0]:.4f}-{rows[-1][0]:.4f}, "
      f"{sum(abs(x - 1) <= 0.01 for x, _ in rows)} within 1% ({len(runs['new'])} runs of each tree)")
for x, k in rows[:3] + rows[-5:]:
    print(f"  {k:28s} {x:.4f}")
EOF
rm -rf "$B"

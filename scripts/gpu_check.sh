#!/usr/bin/env bash
# The GPU check: the one command a device call runs (docs/architecture.md, verifying on the GPU).
#
#   OUT=<results dir> bash scripts/gpu_check.sh [--quick | --bench]
#     (default)  AOT-build scripts/matrices/tests, run the GPU tests, run every
#                scripts/bench_*.py with --quick
#     --quick    AOT + GPU tests only
#     --bench    AOT + benchmarks only, full size (no --quick)
#     --full     AOT + GPU tests + benchmarks at full size
#   GPU_CHECK_PACK=0 skips packing the cache (when it would not fit the carry limit);
#   FIJ_COMMIT=<sha> names the commit where the device copy has no .git
#   bash scripts/gpu_check.sh --restore-from DIR   (here, after a call; no OUT needed)
#   GPU_CHECK_MATRIX=FILE (default scripts/matrices/tests), GPU_CHECK_BUDGET=SECONDS (560)
#   The GPU tests also get the llama deployment matrix prebuilt apart, as FIJ_PREBUILT_LLAMA
#   (tests/test_deploy_gpu.py loads it without nvcc): .carry/llama/cache when carried, else
#   built into a temp folder with no GPU visible (CUDA_VISIBLE_DEVICES=) for 8.0 and 9.0a. It is
#   built here, not on the CPU machine: its torch (2.13 CPU) differs from the GPU machine's, and
#   entries built against another torch are refused
#
# Device call (from the repository root):
#   run(command="bash scripts/gpu_check.sh", carry=[".carry", ".peers"], timeout_s=600)
#   .carry/ holds the module cache packed by the previous call (absent the first time:
#   everything is built, ~2 min with 16 jobs); .peers/site is the FlashInfer peer
#   (python3 ../shared/peers/flashinfer/make_site.py .peers/site, from the checkout), put on PYTHONPATH
#   for the benchmark processes only, never for the tests.
#
# What comes back in $OUT (the device tool returns at most 8 files of <= 16 MiB):
#   gpu_check.log   everything printed (pytest output included)
#   junit.xml       the GPU tests
#   aot.json        the AOT build report (built / cached / failed, seconds)
#   summary.json    tests passed/failed/skipped, AOT seconds, step times, bench files,
#                   commit, date, device
#   bench_*.json    one per benchmark (bundled into bench.tar.gz if files would exceed 8)
#   cache.tar.zst   the module cache (cache.tar.gz where zstd is missing), split into
#                   cache.tar.zst.part-aa, -ab, ... of 15 MiB when larger
# Carrying the cache into the next call, here (files_at is the reply's folder):
#   bash scripts/gpu_check.sh --restore-from <files_at>
# which amounts to: mkdir -p .carry; rm -f .carry/cache.tar.*;
#   cp <files_at>/cache.tar.zst .carry/    (or .gz), or for parts:
#   cat <files_at>/cache.tar.zst.part-* > .carry/cache.tar.zst
# .carry/ and .peers/ are git-ignored; both travel only because carry names them
# (64 MiB in all: the peer is ~28 MiB, the packed cache a few MiB).

set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=default
RESTORE_FROM=
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) MODE=quick ;;
    --bench) MODE=bench ;;
    --full) MODE=full ;;
    --restore-from) RESTORE_FROM=${2:?--restore-from needs a folder}; shift ;;
    -h|--help) sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (expected --quick, --bench or --restore-from DIR)" >&2; exit 2 ;;
  esac
  shift
done

# --- here: put a returned cache archive into .carry/ for the next call ------------------------
if [ -n "$RESTORE_FROM" ]; then
  mkdir -p .carry
  for ext in tar.zst tar.gz; do
    parts=("$RESTORE_FROM"/cache.$ext.part-*)
    if [ -e "${parts[0]}" ]; then
      rm -f .carry/cache.tar.*
      cat "${parts[@]}" > ".carry/cache.$ext"
    elif [ -f "$RESTORE_FROM/cache.$ext" ]; then
      rm -f .carry/cache.tar.*
      cp "$RESTORE_FROM/cache.$ext" ".carry/cache.$ext"
    else
      continue
    fi
    echo "gpu_check: .carry/cache.$ext ($(du -h ".carry/cache.$ext" | cut -f1)); carry .carry and .peers"
    exit 0
  done
  echo "gpu_check: no cache.tar.zst or cache.tar.gz (or parts) in $RESTORE_FROM" >&2
  exit 1
fi

# --- on the device ------------------------------------------------------------------------------
: "${OUT:?gpu_check: set OUT to the results folder}"
mkdir -p "$OUT"
export OUT
OUT_TMP=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")  # scratch that does not come back (unlike $OUT)
trap 'rm -rf "$OUT_TMP"' EXIT
exec 3>&1 4>&2 > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-560}  # seconds; the device call's limit is 600
CACHE=$ROOT/.carry/cache
export FLASHINFER_JIT_CACHE_DIR=$CACHE
export MAX_JOBS=${MAX_JOBS:-16}
STEPS=()  # "name status seconds"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
cap() {  # cap SECONDS: the smaller of SECONDS and the budget left minus a reserve for packing
  local l; l=$(( $(left) - 40 )); [ "$l" -lt 10 ] && l=10
  [ "$1" -lt "$l" ] && echo "$1" || echo "$l"
}
step() {  # step NAME MAX_SECONDS CMD...: run with a time cap, record status and duration
  local name=$1 max=$2; shift 2
  local t0 rc limit; t0=$(date +%s); limit=$(cap "$max")
  echo; echo "=== $name (limit ${limit}s) ==="
  timeout --kill-after=10 "$limit" "$@"; rc=$?
  STEPS+=("$name $rc $(( $(date +%s) - t0 ))")
  [ "$rc" -eq 124 ] && echo "gpu_check: $name hit its ${limit}s limit"
  return "$rc"
}

echo "=== environment ==="
nvidia-smi -L || echo "gpu_check: nvidia-smi failed"
python3 - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"GPU visible: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
EOF
(nvcc --version | tail -n 2; echo "ninja $(ninja --version 2>&1)") || true
COMMIT=${FIJ_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export FIJ_COMMIT=$COMMIT  # the benchmarks record it too
echo "commit $COMMIT, mode $MODE, cache $CACHE"

# --- the carried cache ------------------------------------------------------------------------
restore_cache() {
  local archive="" parts
  for ext in tar.zst tar.gz; do
    parts=(.carry/cache.$ext.part-*)
    if [ -e "${parts[0]}" ]; then
      cat "${parts[@]}" > "/tmp/cache.$ext" && archive=/tmp/cache.$ext; break
    elif [ -f ".carry/cache.$ext" ]; then
      archive=.carry/cache.$ext; break
    fi
  done
  [ -n "$archive" ] || { echo "no carried cache: everything builds"; return 0; }
  mkdir -p "$CACHE"
  case "$archive" in
    *.zst) zstd -dc "$archive" | tar -x -C "$CACHE" ;;
    *) tar -xzf "$archive" -C "$CACHE" ;;
  esac || { echo "gpu_check: could not unpack $archive; building from scratch"; return 0; }
  echo "unpacked $archive: $(find "$CACHE" -maxdepth 1 -mindepth 1 -not -name '.*' | wc -l) entries"
}
cache_listing() { [ -d "$CACHE" ] && find "$CACHE" -maxdepth 1 -mindepth 1 -not -name '.*' | sort; }
PACKED_LISTING=
pack_cache() {
  [ "${GPU_CHECK_PACK:-1}" = 0 ] && return 0
  [ -d "$CACHE" ] || return 0
  local listing; listing=$(cache_listing)
  [ "$listing" = "$PACKED_LISTING" ] && return 0
  rm -f "$OUT"/cache.tar.*
  local name
  if command -v zstd >/dev/null; then
    name=cache.tar.zst
    tar -C "$CACHE" --exclude=./.tmp --exclude=./.logs --exclude=./.locks -cf - . \
      | zstd -q -T0 -10 -o "$OUT/$name"
  else
    name=cache.tar.gz
    tar -C "$CACHE" --exclude=./.tmp --exclude=./.logs --exclude=./.locks -czf "$OUT/$name" .
  fi
  local size; size=$(stat -c %s "$OUT/$name")
  if [ "$size" -gt $(( 15 * 1024 * 1024 )) ]; then
    split -b 15m "$OUT/$name" "$OUT/$name.part-" && rm -f "$OUT/$name"
    echo "packed the cache: $name, $size bytes, split into $(ls "$OUT/$name".part-* | wc -l) parts of 15 MiB"
  else
    echo "packed the cache: $name, $size bytes"
  fi
  PACKED_LISTING=$listing
}
echo; echo "=== cache ==="
restore_cache

# --- AOT build of what the GPU tests need ---------------------------------------------------------
AOT_RC=0
MATRIX=${GPU_CHECK_MATRIX:-scripts/matrices/tests}
step aot 330 python3 -m flashinfer_jit aot --matrix "$MATRIX" -j 16 --json "$OUT/aot.json" \
  || AOT_RC=$?
pack_cache  # now, so the cache comes back even if a later step runs out of time

# --- GPU tests ------------------------------------------------------------------------------------
TEST_RC=skipped
if [ "$MODE" != bench ]; then
  # the llama deployment matrix in a folder of its own, for the no-compiler deployment test
  if [ -d .carry/llama/cache ]; then
    FIJ_PREBUILT_LLAMA=$ROOT/.carry/llama/cache
    echo; echo "llama matrix: carried in $FIJ_PREBUILT_LLAMA"
  else
    FIJ_PREBUILT_LLAMA=$OUT_TMP/llama
    # with no GPU visible, for both architectures, as a deployment build runs (the same torch as the
    # tests: entries built against another torch are refused, never loaded)
    step aot-llama 240 env CUDA_VISIBLE_DEVICES= python3 -m flashinfer_jit aot --matrix scripts/matrices/llama \
      --arch "8.0 9.0a" --out "$FIJ_PREBUILT_LLAMA" -j 16 || AOT_RC=$?
  fi
  export FIJ_PREBUILT_LLAMA
  TIMEOUT_OPT=()
  python3 -c "import pytest_timeout" 2>/dev/null && TIMEOUT_OPT=(--timeout=240)
  step tests 300 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider "${TIMEOUT_OPT[@]}" \
    --junitxml="$OUT/junit.xml"
  TEST_RC=$?
fi

# --- benchmarks -----------------------------------------------------------------------------------
BENCH_FILES=()
if [ "$MODE" != quick ]; then
  PEER=()
  if [ -d .peers/site ]; then
    PEER=(env "PYTHONPATH=$ROOT/.peers/site${PYTHONPATH:+:$PYTHONPATH}"
          "FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}")
  else
    echo "gpu_check: no .peers/site (carry .peers): benchmarks run without FlashInfer"
  fi
  for bench in scripts/bench_*.py; do
    name=$(basename "$bench" .py)
    [ "$name" = bench_common ] && continue
    opts=(--out "$OUT/$name.json")
    [ "$MODE" = default ] && grep -q -- '--quick' "$bench" && opts+=(--quick)
    step "$name" 300 "${PEER[@]}" python3 "$bench" "${opts[@]}"
    [ -f "$OUT/$name.json" ] && BENCH_FILES+=("$name.json")
  done
fi

pack_cache  # again if the tests or benchmarks built more entries

# --- summary ---------------------------------------------------------------------------------------
# Keep $OUT at <= 8 files: bundle the benchmark JSON if they would push it over.
count=$(find "$OUT" -maxdepth 1 -type f | wc -l)
count=$(( count + 1 ))  # summary.json
if [ "$count" -gt 8 ] && [ ${#BENCH_FILES[@]} -gt 1 ]; then
  tar -C "$OUT" -czf "$OUT/bench.tar.gz" "${BENCH_FILES[@]}" && (cd "$OUT" && rm -f "${BENCH_FILES[@]}")
  echo "gpu_check: bundled ${#BENCH_FILES[@]} benchmark files into bench.tar.gz"
  BENCH_FILES=(bench.tar.gz)
fi

STEPS_TEXT=$(printf '%s\n' "${STEPS[@]}") BENCH_TEXT=$(printf '%s\n' "${BENCH_FILES[@]}") \
COMMIT=$COMMIT MODE=$MODE TOTAL=$(( $(date +%s) - START )) python3 - <<'EOF'
import datetime, json, os, subprocess
import xml.etree.ElementTree as ET
out = os.environ["OUT"]
summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": os.environ["COMMIT"], "mode": os.environ["MODE"],
           "total_seconds": int(os.environ["TOTAL"])}
try:
    summary["device"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                       timeout=20).stdout.strip()
except Exception as exc:
    summary["device"] = f"unknown ({exc})"
try:
    import torch
    summary["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
except Exception:
    pass
summary["steps"] = [dict(zip(("name", "rc", "seconds"), (s.split()[0], int(s.split()[1]), int(s.split()[2]))))
                    for s in os.environ["STEPS_TEXT"].splitlines() if s.strip()]
junit = os.path.join(out, "junit.xml")
if os.path.exists(junit):
    try:
        root = ET.parse(junit).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        failed = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
                  if c.find("failure") is not None or c.find("error") is not None]
        total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
        summary["tests"] = total | {"failed_names": failed[:100]}
    except ET.ParseError as exc:
        summary["tests"] = {"error": f"junit.xml unreadable: {exc}"}
aot = os.path.join(out, "aot.json")
if os.path.exists(aot):
    try:
        a = json.load(open(aot))
        summary["aot"] = {"seconds": a.get("seconds"), "entries": a.get("entries"),
                          "built": len(a.get("built", [])), "cached": len(a.get("cached", [])),
                          "failed": a.get("failed", {})}
    except ValueError as exc:
        summary["aot"] = {"error": str(exc)}
step_secs = {s["name"]: s["seconds"] for s in summary["steps"]}
if "aot" in step_secs:
    summary.setdefault("aot", {})["wall_seconds"] = step_secs["aot"]
summary["bench_files"] = [b for b in os.environ["BENCH_TEXT"].splitlines() if b]
summary["cache_files"] = sorted(f for f in os.listdir(out) if f.startswith("cache.tar"))
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
t = summary.get("tests", {})
print("\n=== summary ===")
print(f"device: {summary['device']}")
print(f"commit {summary['commit']}, mode {summary['mode']}, {summary['total_seconds']} s in all")
for s in summary["steps"]:
    print(f"  {s['name']:<24} rc {s['rc']:<4} {s['seconds']} s")
if "aot" in summary:
    a = summary["aot"]
    print(f"aot: {a.get('entries')} entries, built {a.get('built')}, cached {a.get('cached')}, "
          f"failed {len(a.get('failed') or {})}, {a.get('seconds')} s")
if t:
    print(f"tests: {t.get('passed')} passed, {t.get('failures')} failed, {t.get('errors')} errors, "
          f"{t.get('skipped')} skipped")
    for name in t.get("failed_names", [])[:20]:
        print(f"  FAILED {name}")
print(f"files: {sorted(os.listdir(out))}")
EOF

RC=0
[ "$AOT_RC" != 0 ] && RC=1
[ "$TEST_RC" != skipped ] && [ "$TEST_RC" != 0 ] && RC=1
exec 1>&3 2>&4  # close the log's pipe and let tee finish writing it
wait "$TEE_PID" 2>/dev/null
exit $RC

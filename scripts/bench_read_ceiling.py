"""Read-bandwidth ceilings: how fast a kernel that only reads can stream a buffer the size
of a decode's KV cache, with each way a decode kernel can issue its loads (16-byte loads to
registers, 16-byte cp.async to shared memory, bulk copies on an mbarrier), per-block
contiguous chunks (a split decode's blocks) or a grid-stride sweep, and the copy ceiling
(read + write) measured the same way. Decode reads its KV once and writes next to nothing,
so its ceiling is the best of these reads, not the copy.

    python3 scripts/bench_read_ceiling.py [--sizes-mib 128 1024] [--quick] [--paged | --bulk | --locality | --units | --select | --wg-units | --warp-units] [--out F]

(--quick: 128 MiB only, the size of bf16 b=1 kv=32k's K and V at 8 KV heads. --paged: only
the rows of the decode's own access pattern, 16-token pages of 8 KV heads read a head (or
2 or 8 adjacent heads) a block, pages in order, scrambled, or looked up in a table (one
tile ahead, or copied into shared memory before the wait), and the same on larger
non-portable clusters of 10-16 blocks; each row's label says on how many SMs the last
launch ran and at most how many blocks an SM took. The full run ends with them too.
--bulk: that pattern (one head a block, 64 blocks) through 16-byte cp.async against
256-byte bulk copies on per-warp mbarriers. --locality: its page orders, in order,
scrambled, scrambled within 2 MB, and scrambled with each block's chunk sorted by page id.
Both run their rows in two interleaved rounds. --units: POD on Hopper's decode units, 12
warps a block and one block an SM on 48 to all SMs, each warp streaming its own 8-token groups
of one head with 4 stages, through 16-byte cp.async, 256-byte bulk copies and 1 KB TMA boxes.
--select: those reads with whole pages from a counter, on N SMs chosen by blockIdx (as POD on
Hopper splits its grid), by low SM ids, by SM ids spread evenly, or one SM a TPC; and with the
other SMs prefetching the pages next in line into L2 (cp.async.bulk.prefetch.L2).
--wg-units: the decode units as POD on Hopper runs them, a warpgroup a unit of 2048 keys from a
counter, of one KV head (the decode block's) or of 2, 4 or 8 adjacent heads' rows.
--warp-units: the --select streams with a warp's unit of 1 to 128 pages of 1 to 8 adjacent KV
heads (a whole page: 1 x 8; the decode unit's shape, one warp's share: 128 x 1).)

Builds scripts/ceilings/read_ceiling.cu with nvcc for sm_90a (the device's nvcc), runs it,
and writes its rows with the run's metadata to JSON. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

SRC = Path(__file__).resolve().parent / "ceilings" / "read_ceiling.cu"


def build(arch: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix="read_ceiling_")) / "read_ceiling"
    cmd = ["nvcc", "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
           "-diag-suppress", "1886", "-I", str(SRC.parents[2] / "csrc"), "-o", str(out), str(SRC)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
    return out


def report(res: dict) -> str:
    rows = []
    best = {}
    for r in res["rows"]:
        rows.append([r["bytes"] >> 20, r["kind"], r["variant"], r["blocks"], r["threads"], r["us"], r["gbps"]])
        if r["kind"] != "copy":
            key = r["bytes"]
            if key not in best or r["gbps"] > best[key]["gbps"]:
                best[key] = r
    lines = [bc.table(rows, ["MiB", "kind", "variant", "blocks", "threads", "us", "GB/s"])]
    for size, r in sorted(best.items()):
        lines.append(f"best read of {size >> 20} MiB: {r['gbps']:.0f} GB/s ({r['kind']} {r['variant']}, "
                     f"{r['blocks']} x {r['threads']}), {r['us']:.1f} us")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--quick", action="store_true", help="128 MiB only")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--paged", action="store_true", help="only the paged rows (the decode's access pattern)")
    only.add_argument("--bulk", action="store_true",
                    help="only cp.async against bulk copies on the paged pattern (one head a block, 64 blocks)")
    only.add_argument("--locality", action="store_true",
                    help="only the paged pattern's page orders: in order, scrambled, scrambled within 2 MB, "
                         "each block's chunk sorted by physical page")
    only.add_argument("--select", action="store_true",
                    help="only the units' reads on N of the SMs chosen by blockIdx (POD on Hopper's split), by low "
                         "SM ids, by SM ids spread evenly, or one SM a TPC; and with the other SMs prefetching "
                         "the next pages into L2")
    only.add_argument("--wg-units", action="store_true",
                    help="only POD on Hopper's decode units as units of a warpgroup (2048 keys of 1, 2, 4 or 8 KV "
                         "heads, taken from a counter) on 66-132 SMs")
    only.add_argument("--warp-units", action="store_true",
                    help="only the select rows' streams with a warp's unit of 1-128 pages of 1-8 KV heads, taken "
                         "from a counter, on 66, 94 and all SMs")
    only.add_argument("--units", action="store_true",
                    help="only POD on Hopper's decode units (12 warps, one block an SM, on 48-132 SMs): 16-byte "
                         "cp.async, 256-byte bulk copies and 1 KB TMA boxes")
    ap.add_argument("--arch", default="90a")
    ap.add_argument("--out", default=bc.default_out("read_ceiling.json"))
    args = ap.parse_args()
    started = time.perf_counter()
    sizes = [128] if args.quick else args.sizes_mib
    exe = build(args.arch)
    try:
        modes = [m for m in ("paged", "bulk", "locality", "units", "select", "wg_units", "warp_units") if getattr(args, m)]
        proc = subprocess.run([str(exe)] + modes + [str(s) for s in sizes], capture_output=True, text=True)
    finally:
        shutil.rmtree(exe.parent, ignore_errors=True)
    if proc.stderr:
        print(proc.stderr, end="", file=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"read_ceiling failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}")
    data = json.loads(proc.stdout)
    res = {"meta": bc.run_metadata(), **data}
    return bc.finish(args.out, res, report, started)


if __name__ == "__main__":
    sys.exit(main())

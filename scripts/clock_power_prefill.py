#!/usr/bin/env python3
"""SM clock and board power while one ragged prefill row runs back to back, for several
implementations in alternate bursts: does a kernel that is slower per launch run at a lower
clock (the board's power limit) or at the same clock (its schedule)? A diagnostic, not a
benchmark of record (no L2 flush between launches, a sustained load).

  PYTHONPATH=.peers/site python3 scripts/clock_power_prefill.py --impls ours,fa3,cudnn \\
      --row 128,causal,1,16384 --seconds 3 --rounds 3 --out result.json

Each burst launches the row's run() for about --seconds, timing every launch with CUDA events,
while `nvidia-smi -lms 50` logs clocks.sm and power.draw; a burst reports its median time a
launch, and the mean SM clock (MHz) and power (W) of the samples inside it. The rows and
implementations are scripts/ncu_prefill_sm90.py's (bf16, 32 query / 8 KV heads, random inputs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from ncu_prefill_sm90 import make_runner  # noqa: E402


def parse_samples(path: Path) -> list[tuple[float, float, float]]:
    """(host time, SM MHz, watts) from nvidia-smi's csv lines."""
    out = []
    for line in path.read_text().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(parts[1]), float(parts[2])))
        except ValueError:
            continue
    return out


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="ours,fa3")
    ap.add_argument("--row", default="128,causal,1,16384", help="head_dim,causal|full,requests,tokens")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    hd, mask, batch, n = a.row.split(",")
    hd, batch, n = int(hd), int(batch), int(n)
    flops = 4 * batch * 32 * hd * (n * (n + 1) // 2 if mask == "causal" else n * n)
    runners = {}
    for impl in a.impls.split(","):
        try:
            runners[impl] = make_runner(impl, hd, mask, batch, n)
            for _ in range(3):
                runners[impl]()
            torch.cuda.synchronize()
        except Exception as e:  # a peer that is not there
            print(f"{impl}: not run ({type(e).__name__}: {e})", flush=True)
            runners.pop(impl, None)
    log = Path("/tmp/clock_power_smi.csv")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50", "-i", str(torch.cuda.current_device())], stdout=log.open("w"),
                           stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    bursts = []
    try:
        for r in range(a.rounds):
            order = list(runners) if r % 2 == 0 else list(reversed(runners))
            for impl in order:
                run = runners[impl]
                times, t0 = [], time.time()
                while time.time() - t0 < a.seconds:
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                    ev[0].record()
                    run()
                    ev[1].record()
                    ev[1].synchronize()
                    times.append(ev[0].elapsed_time(ev[1]) * 1e3)
                bursts.append({"impl": impl, "round": r, "start": t0, "end": time.time(), "launches": len(times),
                               "median_us": statistics.median(times[len(times) // 4:])})
                time.sleep(0.5)
    finally:
        time.sleep(0.2)
        smi.terminate()
        smi.wait()
    samples = parse_samples(log)
    for b in bursts:
        # the burst's second half: the clock and power after the load settled
        mid = (b["start"] + b["end"]) / 2
        inside = [s for s in samples if mid <= s[0] <= b["end"]]
        b["sm_mhz"] = statistics.mean(s[1] for s in inside) if inside else None
        b["watts"] = statistics.mean(s[2] for s in inside) if inside else None
        b["samples"] = len(inside)
        b["tflops"] = flops / b["median_us"] / 1e6
        print(f"{b['impl']:6s} round {b['round']}: {b['median_us']:.1f} us ({b['tflops']:.0f} TFLOP/s) "
              f"{b['sm_mhz'] or 0:.0f} MHz {b['watts'] or 0:.0f} W over {b['samples']} samples, {b['launches']} launches",
              flush=True)
    if a.out:
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "row": a.row, "date":
                                     datetime.date.today().isoformat(), "bursts": bursts}, indent=1))


if __name__ == "__main__":
    main()

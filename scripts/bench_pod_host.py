#!/usr/bin/env python3
"""Host cost of the POD wrappers and BatchAttention: plan() and run().

The issue's targets: plan() <= 80 us of host time for 16 prefills plus 256 decodes; run()
adds <= 10 us. Measured (bf16, 32 query / 8 KV heads, head_dim 128, page 16, CSR page
tables with host int32 indptr / last_page_len and the page ids on the device):
  (a) plan() of BatchPODWithPagedKVCacheWrapper for 16 prefill chunks (64-512 query tokens
      on 1-4k keys) and 256 decodes (1-4k keys), two batches of different lengths in turn;
      BatchAttention.plan() for the same requests as one mixed batch (decodes first).
  (b) with a GPU: run()'s enqueue time (no sync inside a round) for a small batch (one
      16-token chunk and 8 decodes, whose GPU time is below the host's), next to the same
      batch run by the prefill and the decode wrappers one after the other, and one bare
      torch launch; on sm_90 the same batch through POD on Hopper (prefill_backend "fa3"), with
      its recorded launch and through its op, and the first run() after each plan() (two small
      batches planned in turn, each run() after its plan() timed alone): as it runs (the launch
      plan() resolved, through pod_run; --disable prepare: through pod_rerun), and through the op
      (plan() dropping the record, as before pod_rerun); a bare torch launch timed the same way
      after each plan(); BatchAttention's first run() after each plan() of two small mixed
      batches.
  (a') with a GPU, the same plans after one run() of each wrapper: an engine's plans, which keep
      run()'s recorded launch (POD on Hopper) and hand it the new plan's op arguments.
  (c) plan_parts: where a batch POD plan() of (a) spends its time, each step timed by a
      wrapper around it over 2,000 plans (min, p10, median, µs a call; the wrappers add
      ~0.2 us each): a plan repeated from its recipe (pod_replan) and its parts (the Hopper
      side's common-form planner, the decode side's C++ planner and its install), or each
      side's full plan() where the recipe does not apply (their own copy and page order
      included), the plan buffers' copies (PlanBuffer.ship) and the page-order launches
      (PageOrder.order).
Each figure is time.perf_counter_ns over n calls a round, the median over rounds. "adds" =
POD run() - (prefill run() + decode run()) would be the fused call's cost over the two it
replaces; the target reads run()'s own host time as what a POD launch adds to a step.

  python3 scripts/bench_pod_host.py [--out FILE] [--rounds N] [--disable prepare,pod_cut]
--disable takes this tree's newer host paths out (an A/B in one tree, in one host state).
On a machine without a GPU only (a) runs (the plans on CPU tensors: the host time the
planners and the wrappers' Python take, without the page order's launch).
JSON: meta, plan_batch_pod, plan_batch_attention, plan_parts, plan_*_with_record (with GPU: the same plans
with run()'s record kept, record_kept), run_* (median_us, min_us, n, rounds; the
run_after_plan_* rows median_us, min_us, n over single calls), pod_rerun_taken,
pod_fast_path, pod_fast_path_hopper (whether the POD runs took the recorded launch).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (also puts the repository on sys.path)
from bench_prefill_host import per_call_us  # noqa: E402

HEADS = (32, 8, 128, 16)


def csr(torch, qo, kv, device, page_size=16):
    """(qo_indptr, kv_indptr, kv_indices, last_page_len, kv_lens): host int32 but the ids."""
    pages = [-(-n // page_size) for n in kv]
    def i32(v):
        return torch.tensor(list(v), dtype=torch.int32)

    ids = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(len(kv))).int().to(device)
    return (i32(itertools.accumulate(qo, initial=0)), i32(itertools.accumulate(pages, initial=0)), ids,
            i32(n - (p - 1) * page_size for n, p in zip(kv, pages)), i32(kv))


def mixed(torch, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    qo_p = torch.randint(64, 513, (16,), generator=g).tolist()
    kv_p = [q + int(torch.randint(1024, 4096, (1,), generator=g)) for q in qo_p]
    kv_d = torch.randint(1024, 4096, (256,), generator=g).tolist()
    return (csr(torch, qo_p, kv_p, device), csr(torch, [1] * 256, kv_d, device),
            csr(torch, [1] * 256 + qo_p, kv_d + kv_p, device))


def run_after_plan(torch, w, batches, cache, n: int, timed=None) -> dict:
    """The host time of the first run() after each plan() (µs; median and min of n): plan()
    of each batch in turn (untimed), then run() of its q, timed alone. timed(i): another call
    timed in the run()'s place (a bare launch after each plan(), the same comparison)."""
    import time

    bf16 = torch.bfloat16
    times = []
    for i in range(n + 4):
        p, d, q_p, q_d = batches[i % len(batches)]
        w.plan(p[0], p[1], p[2], p[3], d[0], d[1], d[2], d[3], *HEADS, q_data_type=bf16, kv_data_type=bf16,
               causal=True)
        t = time.perf_counter_ns()
        if timed is None:
            w.run(q_p, cache, q_d, cache, causal_p=True)
        else:
            timed(i)
        if i >= 4:  # (the first plans warm up)
            times.append((time.perf_counter_ns() - t) / 1e3)
    times.sort()
    return {"median_us": round(times[len(times) // 2], 2), "min_us": round(times[0], 2), "n": n}


def ba_run_after_plan(torch, ba, batches, cache, n: int) -> dict:
    """run_after_plan of BatchAttention: plan() of each mixed batch (qo_indptr, kv_indptr,
    kv_indices, kv_len_arr, q) in turn, then run() of its q, timed alone."""
    import time

    bf16 = torch.bfloat16
    times = []
    for i in range(n + 4):
        qo, kv, ids, lens, q = batches[i % len(batches)]
        ba.plan(qo, kv, ids, lens, 32, 8, 128, 128, 16, causal=True, q_data_type=bf16, kv_data_type=bf16)
        t = time.perf_counter_ns()
        ba.run(q, cache)
        if i >= 4:
            times.append((time.perf_counter_ns() - t) / 1e3)
    times.sort()
    return {"median_us": round(times[len(times) // 2], 2), "min_us": round(times[0], 2), "n": n}


def disable(names: str) -> None:
    """--disable: paths taken out for an A/B in one tree: "prepare" (a plan() keeping run()'s
    record does not resolve that run()'s launch: it goes through pod_rerun), "pod_cut"
    (BatchAttention's repeated POD step cuts through batch_split and the POD wrapper's plan())."""
    from flashinfer_jit.pod.batch_attention import BatchAttention
    from flashinfer_jit.pod.wrapper import BatchPODWithPagedKVCacheWrapper
    for name in filter(None, names.split(",")):
        if name == "prepare":
            BatchPODWithPagedKVCacheWrapper._prepare_first_run = lambda self, *a: None
        elif name == "pod_cut":
            BatchAttention._plan_pod_again = lambda self, *a: False
        else:
            raise SystemExit(f"--disable: unknown path {name!r} (prepare, pod_cut)")


def timed_parts(calls: int, fn, parts: dict) -> dict:
    """Each (class, method) of `parts` ({label: (owner, name)}) timed by a wrapper around it
    over `calls` calls of fn: {label: n, min_us, p10_us, median_us} (~0.2 us a wrapper)."""
    import inspect
    import time

    times = {label: [] for label in parts}
    originals = {}

    def timed(f, into):
        def call(*a, **k):
            t = time.perf_counter_ns()
            r = f(*a, **k)
            into.append(time.perf_counter_ns() - t)
            return r
        return call

    for label, (owner, name) in parts.items():
        originals[label] = inspect.getattr_static(owner, name)
        f = timed(getattr(owner, name), times[label])
        setattr(owner, name, staticmethod(f) if isinstance(originals[label], staticmethod) else f)
    try:
        for _ in range(calls):
            fn()
    finally:
        for label, (owner, name) in parts.items():
            setattr(owner, name, originals[label])
    out = {}
    for label, ts in times.items():
        ts.sort()
        if ts:
            out[label] = {"n": len(ts), "min_us": round(ts[0] / 1e3, 2), "p10_us": round(ts[len(ts) // 10] / 1e3, 2),
                          "median_us": round(ts[len(ts) // 2] / 1e3, 2)}
    return out


def plan_parts(plan_pod, calls: int) -> dict:
    """(c): each step of a batch POD plan() timed by a wrapper around it, `calls` x 2 plans."""
    from flashinfer_jit.decode.wrapper import BatchDecodeWithPagedKVCacheWrapper
    from flashinfer_jit.pod.wrapper import BatchPODWithPagedKVCacheWrapper
    from flashinfer_jit.prefill.wrapper import BatchPrefillWithPagedKVCacheWrapper
    from flashinfer_jit.runtime.page_order import PageOrder
    from flashinfer_jit.runtime.plan_buffer import PlanBuffer

    steps = {"pod_plan": (BatchPODWithPagedKVCacheWrapper, "plan"),
             "pod_replan": (BatchPODWithPagedKVCacheWrapper, "_replan"),
             "decode_side_plan": (BatchDecodeWithPagedKVCacheWrapper, "plan"),
             "prefill_side_plan": (BatchPrefillWithPagedKVCacheWrapper, "plan"),
             "prefill_side_common_form": (BatchPrefillWithPagedKVCacheWrapper, "_sm90_plan_common"),
             "decode_side_native": (BatchDecodeWithPagedKVCacheWrapper, "_plan_native"),
             "decode_side_install": (BatchDecodeWithPagedKVCacheWrapper, "_install_native"),
             "plan_buffer_copy": (PlanBuffer, "ship"), "page_order_launch": (PageOrder, "order")}
    return timed_parts(calls, plan_pod, steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--disable", default="", help="prepare,pod_cut: paths taken out (an A/B in one tree)")
    args = ap.parse_args()
    import torch

    import flashinfer_jit as fij
    disable(args.disable)

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    sync = torch.cuda.synchronize if gpu else None
    res = {"benchmark": "pod_host", "meta": bc.run_metadata(), "gpu": gpu, "disabled": args.disable}
    bf16 = torch.bfloat16
    batches = [mixed(torch, s, device) for s in (0, 1)]
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=device)

    pod = fij.BatchPODWithPagedKVCacheWrapper(ws, "NHD")

    def plan_pod():
        for p, d, _ in batches:
            pod.plan(p[0], p[1], p[2], p[3], d[0], d[1], d[2], d[3], *HEADS, q_data_type=bf16, kv_data_type=bf16,
                     causal=True)

    ba = fij.BatchAttention("NHD", device=str(device))

    def plan_ba():
        for _, _, m in batches:
            ba.plan(m[0], m[1], m[2], m[4], 32, 8, 128, 128, 16, causal=True, q_data_type=bf16, kv_data_type=bf16)

    for label, fn in (("plan_batch_pod", plan_pod), ("plan_batch_attention", plan_ba)):
        try:
            fn()
            r = per_call_us(fn, 20, args.rounds)
            res[label] = {k: (round(v / 2, 2) if k.endswith("_us") else v) for k, v in r.items()}  # two plans a call
        except Exception as exc:  # noqa: BLE001  (a CPU-only machine may lack a planner's module)
            res[label] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        bc.log(f"{label}: {res[label]}")
    if "error" not in res["plan_batch_pod"]:
        res["plan_parts"] = plan_parts(plan_pod, 1000)
        bc.log(f"plan_parts: {res['plan_parts']}")
    if gpu and all("error" not in res[k] for k in ("plan_batch_pod", "plan_batch_attention")):
        # an engine's plans keep run()'s record (POD on Hopper): such a plan() also hands the next
        # run() the new plan's op arguments. One run() of each wrapper's last plan records its
        # launch; the same plans are then timed with the record kept
        pages = max(int(b[2][1][-1]) for b in batches)
        big_cache = torch.randn(pages, 2, 16, 8, 128, device=device).to(bf16)
        p, d, m = batches[-1]  # (what both wrappers planned last)
        pod.run(torch.randn(int(p[0][-1]), 32, 128, device=device).to(bf16), big_cache,
                torch.randn(len(d[1]) - 1, 32, 128, device=device).to(bf16), big_cache, causal_p=True)
        ba.run(torch.randn(int(m[0][-1]), 32, 128, device=device).to(bf16), big_cache)
        sync()
        for label, fn, w in (("plan_batch_pod_with_record", plan_pod, pod), ("plan_batch_attention_with_record",
                                                                              plan_ba, ba._pod)):
            r = per_call_us(fn, 20, args.rounds)
            res[label] = {k: (round(v / 2, 2) if k.endswith("_us") else v) for k, v in r.items()}
            res[label]["record_kept"] = w._quick is not None and w._replan_bounds is not None
            bc.log(f"{label}: {res[label]}")
    if gpu:
        p, d, _ = (csr(torch, [16], [1024], device), csr(torch, [1] * 8, [2048] * 8, device), None)
        num_pages = int(p[1][-1]) + int(d[1][-1])
        cache = torch.randn(num_pages, 2, 16, 8, 128, device=device).to(bf16)
        q_p = torch.randn(16, 32, 128, device=device).to(bf16)
        q_d = torch.randn(8, 32, 128, device=device).to(bf16)
        w = fij.BatchPODWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(p[0], p[1], p[2], p[3], d[0], d[1], d[2], d[3], *HEADS, q_data_type=bf16, kv_data_type=bf16,
               causal=True)
        w.run(q_p, cache, q_d, cache, causal_p=True)
        res["run_batch_pod_small"] = per_call_us(lambda: w.run(q_p, cache, q_d, cache, causal_p=True), 20,
                                                 args.rounds, sync)
        # the same batch on POD on Hopper (prefill_backend "fa3", sm_90): its recorded launch
        # (PodSm90Launch), and its op (the record dropped before each call, so each call also
        # records again: an upper bound of the op path)
        if torch.cuda.get_device_capability(device) == (9, 0):
            wh = fij.BatchPODWithPagedKVCacheWrapper(ws, "NHD")
            wh.prefill_backend = "fa3"
            wh.plan(p[0], p[1], p[2], p[3], d[0], d[1], d[2], d[3], *HEADS, q_data_type=bf16, kv_data_type=bf16,
                    causal=True)
            wh.run(q_p, cache, q_d, cache, causal_p=True)
            res["run_batch_pod_hopper_small"] = per_call_us(lambda: wh.run(q_p, cache, q_d, cache, causal_p=True), 20,
                                                            args.rounds, sync)
            res["pod_fast_path_hopper"] = wh._quick is not None

            def op_path():
                wh._quick = None
                wh.run(q_p, cache, q_d, cache, causal_p=True)
            res["run_batch_pod_hopper_small_op"] = per_call_us(op_path, 20, args.rounds, sync)
            # an engine's step: plan() of new lengths (two small batches in turn, so q's rows
            # change), then run(): the run()'s own host time (each call timed alone, the median
            # of 20 x rounds), through pod_rerun (the plan keeps the record) and with the record
            # dropped by each plan (through the op, as before pod_rerun)
            p2, d2 = csr(torch, [12], [1500], device), csr(torch, [1] * 6, [1800] * 6, device)
            q_p2, q_d2 = q_p[:12].clone(), q_d[:6].clone()
            res["run_after_plan_hopper_small"] = run_after_plan(torch, wh, ((p, d, q_p, q_d), (p2, d2, q_p2, q_d2)),
                                                                cache, 20 * args.rounds)
            res["pod_rerun_taken"] = wh._quick is not None and wh._replan_bounds is None
            xb = torch.empty(1024, device=device)
            res["bare_launch_after_plan"] = run_after_plan(torch, wh, ((p, d, q_p, q_d), (p2, d2, q_p2, q_d2)), cache,
                                                           20 * args.rounds, timed=lambda i: xb.add_(1.0))
            # BatchAttention's: two small mixed batches (decodes first) in turn
            mixes = []
            for dec, chunk in (((8, 2048), (16, 1024)), ((6, 1800), (12, 1500))):
                mm = csr(torch, [1] * dec[0] + [chunk[0]], [dec[1]] * dec[0] + [chunk[1]], device)
                mixes.append((mm[0], mm[1], mm[2], mm[4], torch.cat([q_d[:dec[0]], q_p[:chunk[0]]])))
            bh = fij.BatchAttention("NHD", device="cuda")
            bh.prefill_backend = "fa3"
            bh.plan(*mixes[0][:4], 32, 8, 128, 128, 16, causal=True, q_data_type=bf16, kv_data_type=bf16)
            bh.run(mixes[0][4], cache)
            res["run_after_plan_batch_attention_small"] = ba_run_after_plan(torch, bh, mixes, cache, 20 * args.rounds)
            res["batch_attention_small_mode"] = bh._planned[0]
            wh._replans_record = False
            res["run_after_plan_hopper_small_op"] = run_after_plan(torch, wh, ((p, d, q_p, q_d), (p2, d2, q_p2, q_d2)),
                                                                   cache, 20 * args.rounds)
            wh._replans_record = True
        pw = fij.BatchPrefillWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=device))
        pw.plan(p[0], p[1], p[2], p[3], *HEADS, causal=True, q_data_type=bf16)
        dw = fij.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=device), "NHD")
        dw.plan(d[1], d[2], d[3], *HEADS, q_data_type=bf16)
        pw.run(q_p, cache), dw.run(q_d, cache)
        res["run_prefill_small"] = per_call_us(lambda: pw.run(q_p, cache), 20, args.rounds, sync)
        res["run_decode_small"] = per_call_us(lambda: dw.run(q_d, cache), 20, args.rounds, sync)
        m = csr(torch, [1] * 8 + [16], [2048] * 8 + [1024], device)
        b = fij.BatchAttention("NHD", device="cuda")
        b.plan(m[0], m[1], m[2], m[4], 32, 8, 128, 128, 16, causal=True, q_data_type=bf16, kv_data_type=bf16)
        q_m = torch.cat([q_d, q_p])
        b.run(q_m, cache)
        res["run_batch_attention_small"] = per_call_us(lambda: b.run(q_m, cache), 20, args.rounds, sync)
        # whether the runs above took the recorded launch (fij_fastcall pod_run) or the op
        res["pod_fast_path"] = {"batch_pod": w._quick is not None, "batch_attention": b._pod._quick is not None}
        x = torch.empty(1024, device=device)
        res["bare_torch_launch"] = per_call_us(lambda: x.add_(1.0), 20, args.rounds, sync)
        res["fastcall"] = os.environ.get("FLASHINFER_JIT_FASTCALL", "default")
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "bench_pod_host.json")
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "meta"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

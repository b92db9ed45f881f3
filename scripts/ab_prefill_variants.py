#!/usr/bin/env python3
"""A/B of csrc/prefill/prefill.cuh variants in one process (a development tool, not a benchmark of
record): every variant's modules loaded side by side (jit.clear_registry between them; each
module's namespace carries its source hash), timed interleaved per shape (A B A B ..., the
minimum over ROUNDS of the median of up to 50 runs enqueued back to back) after a 3 s GPU warm-up, so clock drift
hits every variant alike. Run-to-run noise between two copies of one kernel: +-2-4%.

  VARIANTS="BASE NEW" VARIANT_DIR=/path/to/variants DIMS=128,256 FORMS=ragged,paged \
      SHAPES=1x16384,4x4096,16x1024,64x256 MASKS=causal,full ROUNDS=3 FI=1 FLUSH=0 python3 scripts/ab_prefill_variants.py

(scripts/ab_prefill.sh prebuilds the variants and FlashInfer's modules side by side first.)

A shape BxL is B requests of L query tokens on L keys; BxQ:K, Q query tokens on K keys (the
queries last, as in chunked prefill and speculative verification).
FORMS: ragged, paged (page 16, pages in random order) and pagedseq (page 16, pages in order:
the ragged rows' layout, which separates the page table's addressing from the page order).

Variant NAME is $VARIANT_DIR/NAME.cuh, copied over csrc/prefill/prefill.cuh while its wrappers plan
and make their first run (csrc/prefill/prefill.cuh is restored at the end). NAME@costorder plans with
the numpy twin and the work order before fc1ff93 (pairs by cost alone); NAME@r64 / NAME@r128 pins the query
tile (as ROWS=64/128 does for every variant); NAME@split1024 forces KV chunks of 1024 keys
(fixed_split_size), NAME@nosplit disables the split, NAME@sorted gives the variant (not FA2)
each request's full pages but the last in ascending id order before plan(); NAME@rot the same
order with request r's run rotated by r (P - 1) / B pages (the requests then sweep the pool
from different places), planned with sort_pages=False; PERM_VARY=1 draws a new page order a
row (else one, seed 1, for every row). @sorted and @rot reorder every page but the last
whatever the mask: with a causal mask they are only valid where every query row sees those
pages (kv_len - qo_len + 1 >= (P - 1) x 16: speculative verification, not L x L causal
shapes, whose outputs then differ). NAME@nosort plans
with sort_pages=False (plan() then keeps the pages as given). FI=1 adds FlashInfer's
fa2 on the same inputs (needs the peer on PYTHONPATH). Prebuild each variant (aot) to keep JIT builds
out of the run. Results: docs/results/2026-11-26_h100_prefill_ab_fc1ff93.json,
docs/results/2026-11-26_h200_prefill_ab_f18239e.json."""
import os
import shutil
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
os.chdir(sys.path[0])
import flashinfer_jit as fi
from flashinfer_jit.pipeline import jit

variants = os.environ.get('VARIANTS', 'BASE2 S2').split()
dims = [int(x) for x in os.environ.get('DIMS', '128,256').split(',')]
forms = os.environ.get('FORMS', 'ragged,paged').split(',')
# BxL: B requests of L query tokens on L keys; BxQ:K: Q query tokens on K keys (the queries last)
shapes = [(int(x.split('x')[0]), int(x.split('x')[1].split(':')[0]), int(x.split(':')[-1] if ':' in x else x.split('x')[1]))
          for x in os.environ.get('SHAPES', '1x16384,4x4096,16x1024,64x256').split(',')]
rounds = int(os.environ.get('ROUNDS', '3'))
use_fi = os.environ.get('FI') == '1'
masks = os.environ.get('MASKS', 'causal,full').split(',')  # causal, full
if use_fi:
    import flashinfer
dev = 'cuda'
hq, hk = 32, 8
sys.path.insert(0, os.path.join(sys.path[0], 'scripts'))
from bench_prefill import Flush, paired_ratio, time_interleaved

# FLUSH=1: bench_prefill.py's L2 flush (a memset of max(4 x L2, 64 MiB)) before each timed run,
# outside its events, as the benchmark of record times (on head_dim 128's ragged non-causal
# 64 x 256 it moved neither ours nor FA2's time relative to the other, 2026-11-27)
flush = Flush() if os.environ.get('FLUSH') == '1' else None
# INTERLEAVE=1: bench_prefill.py's time_interleaved (REPS rounds, each variant once a round,
# in a balanced order (round_order()), none twice in a row) instead of blocks of runs of one variant: every
# run then follows another kernel, as in the benchmark (the kernel before moved one
# kernel's time by up to 3% there). Blocks of one kernel (INTERLEAVE=0) follow themselves.
interleave = os.environ.get('INTERLEAVE') == '1'
reps = int(os.environ.get('REPS', '40'))
orig = open('csrc/prefill/prefill.cuh').read()

def bench(fn, ms_budget=60.0):
    """Median device time of fn() over up to 50 runs enqueued back to back behind a GPU sleep
    (events around each run, one synchronization at the end): the host's time in fn() stays
    out of the figure. (Until 2026-11-27 each run was synchronized, so a run's figure held
    the host time between its start event and its kernel's launch, and the GPU started each
    run idle: FA2 measured up to 7% slower that way than back to back, 241 against 225 us on
    head_dim 128 64 x 256 and 2858 against 2698 us on 4 x 4k, ours 0-3%.)"""
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record(); fn(); e.record(); e.synchronize()
    one = max(s.elapsed_time(e), 1e-3)
    iters = int(min(50, max(5, ms_budget / one)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda._sleep(1 << 24)  # about 10 ms: the host enqueues the runs behind it
    for i in range(iters):
        if flush is not None:
            flush()
        starts[i].record(); fn(); ends[i].record()
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) * 1e3 for a, b in zip(starts, ends)]))

import contextlib

from flashinfer_jit.prefill import wrapper as _pf


class _OldOrder:  # the numpy twin with the order before fc1ff93: pairs by cost alone
    def __getattr__(self, n): return getattr(np, n)
    def lexsort(self, keys): return np.argsort(keys[0], kind='stable')
@contextlib.contextmanager
def plan_as(var):
    if '@costorder' not in var:
        yield; return
    os.environ['FLASHINFER_JIT_NATIVE_PLAN'] = '0'; _pf.np = _OldOrder()
    try: yield
    finally:
        os.environ.pop('FLASHINFER_JIT_NATIVE_PLAN'); _pf.np = np

def tile_of(var):
    """The query tile a variant pins: NAME@r64 / NAME@r128, else ROWS, else plan()'s choice."""
    for tag in var.split('@')[1:]:
        if tag.startswith('r') and tag[1:].isdigit():
            return int(tag[1:])
    return int(os.environ.get('ROWS', '0')) or None

def split_of(var):
    """plan()'s keyword arguments for a variant: NAME@splitN forces KV chunks of N keys
    (fixed_split_size), NAME@nosplit disables the split."""
    for tag in var.split('@')[1:]:
        if tag.startswith('split') and tag[5:].isdigit():
            return {'fixed_split_size': int(tag[5:])}
        if tag == 'nosplit':
            return {'disable_split_kv': True}
    return {}

def order_of(var, form):
    """plan()'s sort_pages for a variant: NAME@nosort reads the pages as given (paged forms)."""
    return {'sort_pages': False} if ('@nosort' in var or '@rot' in var) and form != 'ragged' else {}

def warm(seconds=2.0):
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(20): a @ a
        torch.cuda.synchronize()

warm(3.0)
_row_no = 0
ws = {v: torch.empty(256 << 20, dtype=torch.uint8, device=dev) for v in variants}
for d in dims:
  for (B, Lq, L) in shapes:
    for causal in [m == 'causal' for m in masks]:
      qo = torch.arange(B + 1, dtype=torch.int32) * Lq
      kvi = torch.arange(B + 1, dtype=torch.int32) * L
      q = torch.randn(B * Lq, hq, d, dtype=torch.bfloat16, device=dev)
      k = torch.randn(B * L, hk, d, dtype=torch.bfloat16, device=dev)
      v = torch.randn(B * L, hk, d, dtype=torch.bfloat16, device=dev)
      keys = (Lq * L - Lq * (Lq - 1) / 2) if causal else Lq * L
      F = 4 * B * keys * hq * d
      _row_no += 1
      for form in forms:
        fns = {}
        outs = {}
        for var in variants:
          shutil.copy(os.path.join(os.environ.get('VARIANT_DIR', '.carry/var'), var.split('@')[0] + '.cuh'), 'csrc/prefill/prefill.cuh')
          jit.clear_registry()
          if form in ('paged', 'pagedseq'):
            # P pages a request, its rows at their start (a key count off the page size leaves
            # the last page part full, the rest zero)
            page = 16; P = -(-L // page); npg = B * P
            kc = k.new_zeros(B, P * page, hk, d); vc = v.new_zeros(B, P * page, hk, d)
            kc[:, :L] = k.view(B, L, hk, d); vc[:, :L] = v.view(B, L, hk, d)
            kc = kc.view(npg, page, hk, d); vc = vc.view(npg, page, hk, d)
            # PERM_VARY=1: a new page order for every row (else the same, seed 1, for all)
            g = torch.Generator().manual_seed(1 + (_row_no if os.environ.get('PERM_VARY') == '1' else 0))
            # paged: pages in random order; pagedseq: in order (the ragged rows' layout)
            ids = (torch.randperm(npg, generator=g) if form == 'paged' else torch.arange(npg)).int().to(dev)
            ids_given = ids  # FA2's (the tags below reorder the variant's copy)
            if '@sorted' in var:  # each request's full pages but the last in ascending id order
              ids = ids.view(B, P).clone(); ids[:, :P - 1] = ids[:, :P - 1].sort(dim=1).values; ids = ids.view(-1)
            if '@rot' in var:  # sorted as @sorted, then request r's sorted run rotated by r (P - 1) / B
              ids = ids.view(B, P).clone(); srt = ids[:, :P - 1].sort(dim=1).values
              for r in range(B): ids[r, :P - 1] = srt[r].roll(-(r * (P - 1) // B))
              ids = ids.view(-1)
            kvp = torch.arange(B + 1, dtype=torch.int32) * P
            last = torch.full((B,), L - (P - 1) * page, dtype=torch.int32)
            w = fi.BatchPrefillWithPagedKVCacheWrapper(ws[var])
            if tile_of(var): w._force_tile_rows = tile_of(var)
            with plan_as(var): w.plan(qo, kvp, ids, last, hq, hk, d, page, causal=causal, q_data_type=torch.bfloat16, **split_of(var), **order_of(var, form))
            kv_arg = (kc, vc)
            fn = (lambda w=w, kv_arg=kv_arg, q=q: w.run(q, kv_arg))
          else:
            w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws[var])
            if tile_of(var): w._force_tile_rows = tile_of(var)
            with plan_as(var): w.plan(qo, kvi, hq, hk, d, causal=causal, q_data_type=torch.bfloat16, **split_of(var))
            fn = (lambda w=w, q=q, k=k, v=v: w.run(q, k, v))
          outs[var] = fn()
          fns[var] = fn
        if use_fi and form == 'ragged':
          fw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws[variants[0]], backend='fa2')
          fw.plan(qo.to(dev), kvi.to(dev), hq, hk, d, causal=causal, q_data_type=torch.bfloat16)
          fns["FA2"] = lambda fw=fw, q=q, k=k, v=v: fw.run(q, k, v)
        elif use_fi:
          fw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws[variants[0]], 'NHD', backend='fa2')
          fw.plan(qo.to(dev), kvp.to(dev), ids_given, last.to(dev), hq, hk, d, page, causal=causal, q_data_type=torch.bfloat16)
          fns["FA2"] = lambda fw=fw, q=q, kv_arg=kv_arg: fw.run(q, kv_arg)
        ref = outs[variants[0]].float()
        agree = {var: float((outs[var].float() - ref).abs().max()) for var in variants[1:]}
        if interleave:
          # the benchmark's protocol: every variant (and FA2) once a round, L2 flushed before
          # each run if FLUSH=1
          names = list(fns)
          got = time_interleaved([fns[n] for n in names], reps, flush if flush is not None else (lambda: None))
          best = {n: g.get('median_us', float('nan')) for n, g in zip(names, got)}
          # paired: the median over rounds of the base's time over the variant's in the same round
          paired = {n: pr['median'] for n, g in zip(names, got)
                    if (pr := paired_ratio(g.get('_samples'), got[0].get('_samples') or [])) is not None}
        else:
          best = {n: 1e30 for n in fns}
          for r in range(rounds):
            for n, fn in fns.items():
              best[n] = min(best[n], bench(fn))
          paired = {}
        base = best[variants[0]]
        line = f"{form:8s} d={d} {B}x{Lq}{'' if Lq == L else f':{L}'} {'causal' if causal else 'full  '}:"
        for n in fns:
          line += f"  {n} {best[n]:8.1f}us {F / best[n] / 1e6:5.0f}TF ({base / best[n]:.3f})"
          if n in paired:
            line += f" [paired {paired[n]:.3f}]"
        line += f"  maxdiff {agree}"
        print(line, flush=True)
        del fns, outs
      del q, k, v
      torch.cuda.empty_cache()
open('csrc/prefill/prefill.cuh', 'w').write(orig)

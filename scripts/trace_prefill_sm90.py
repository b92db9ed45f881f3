#!/usr/bin/env python3
"""A diagnostic of the Hopper prefill kernel's loop for a throwaway copy of the tree (the device
machine's): where a key tile's cycles go, per consumer warpgroup, from SM clock stamps.

  python3 scripts/trace_prefill_sm90.py --edit-in-place     # patch csrc/ (a throwaway copy only)
  python3 -m flashinfer_jit aot --entry "prefill_sm90 dtype_q=bfloat16 head_dim=128 mask=causal key_tile=128" ...
  python3 scripts/trace_prefill_sm90.py --run 128,causal,1,16384 [--out trace.json]

--edit-in-place adds stamps to csrc/hopper/prefill_sm90.cuh's consumer loop: thread 0 of each
consumer warpgroup of block 0 reads clock64() at eight points of each loop iteration (tile n >= 1
of an item) and writes them with the tile's index and its item's to a buffer. The buffer rides on
run(sinks=...): the kernel reads sinks[head] for heads 0 .. H - 1 (kept at -inf: no effect on
the output) and, patched, writes its stamps from float 64 on (12 uint32 a tile, 4096 tiles a
warpgroup), so no argument, op schema or binding changes. The stamps cost each iteration a few
instructions and one 32-byte store on one thread: the figures describe the patched kernel.

The points: t0 the iteration's start (the previous tile's P packed), t1 the turn taken (after
K's wait), t2 both GEMMs issued and the turn passed (after V's wait), t3 S complete
(wgmma wait 1), inside the softmax ta (the rows' maxima known) and tb (the exponentials and
sums done), t4 the softmax done, t5 P V complete (wgmma wait 0); the next iteration's t0
closes the P packing. --run reports, over the warpgroups' iterations whose next one is in the
same item, the median cycles of each phase and of the period (t1 to the next t1), and the lag
of warpgroup 1's turn behind warpgroup 0's (t1 of the same tile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

KERNEL = HERE.parent / "csrc" / "hopper" / "prefill_sm90.cuh"
SLOTS, MAX_TILES, OFFSET = 12, 4096, 64  # uint32 a tile, tiles a warpgroup, floats before the stamps

PATCHES = [
    # inside the softmax: ts[0] once the rows' maxima are known (before the exponentials),
    # ts[1] once the exponentials and sums are done
    ("""  static FIJ_SM90 void softmax(float (&s)[kS], int n, const Rows& r, float (&m)[2], float (&l)[2],
                               float (&corr)[2], const MaskBits& bits) {""",
     """  static FIJ_SM90 void softmax(float (&s)[kS], int n, const Rows& r, float (&m)[2], float (&l)[2],
                               float (&corr)[2], const MaskBits& bits, uint32_t* ts = nullptr) {"""),
    ("""    float sum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
""", """    if (ts != nullptr) ts[0] = uint32_t(clock64());
    float sum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
"""),
    ("""    for (int i = 0; i < 2; ++i) l[i] = fmaf(l[i], corr[i], sum[i][0] + sum[i][1]);
  }""", """    if (ts != nullptr) ts[1] = uint32_t(clock64());
    for (int i = 0; i < 2; ++i) l[i] = fmaf(l[i], corr[i], sum[i][0] + sum[i][1]);
  }"""),
    ("""      K::softmax(s, n0 + n, rows, m, l, corr, bits);
""", """      K::softmax(s, n0 + n, rows, m, l, corr, bits, tr_ + 6);
"""),
    ("""    K::pack_p(s, pa);
    for (int n = 1; n < n_tiles; ++n) {
      const Stage cur""", """    K::pack_p(s, pa);
    for (int n = 1; n < n_tiles; ++n) {
      uint32_t tr_[8];
      tr_[0] = uint32_t(clock64());
      const Stage cur"""),
    ("""      h::mbar_wait(&k_full[st], cur.parity);
      my_turn();
      K::issue_qk(s, q_base, k0 + st * kKTileBytes);""", """      h::mbar_wait(&k_full[st], cur.parity);
      my_turn();
      tr_[1] = uint32_t(clock64());
      K::issue_qk(s, q_base, k0 + st * kKTileBytes);"""),
    ("""      K::issue_pv(o, pa, v0 + sp * kVTileBytes);
      pass_turn();
      if constexpr (kCustom) K::load_mask(bits, p.mask, mask_base, n0 + n, rows, tile.rows);
      h::wgmma_wait<1>();  // S of tile n (committed first)
      h::fence_regs(s);""", """      K::issue_pv(o, pa, v0 + sp * kVTileBytes);
      pass_turn();
      tr_[2] = uint32_t(clock64());
      if constexpr (kCustom) K::load_mask(bits, p.mask, mask_base, n0 + n, rows, tile.rows);
      h::wgmma_wait<1>();  // S of tile n (committed first)
      h::fence_regs(s);
      tr_[3] = uint32_t(clock64());"""),
    ("""      h::wgmma_wait<0>();  // P V of tile n - 1
      h::fence_regs(o);
      h::fence_regs(pa);
      if (lane == 0) h::mbar_arrive(&pv_empty[sp]);
      K::pack_p(s, pa);
    }""", """      tr_[4] = uint32_t(clock64());
      h::wgmma_wait<0>();  // P V of tile n - 1
      h::fence_regs(o);
      h::fence_regs(pa);
      tr_[5] = uint32_t(clock64());
      if (lane == 0) h::mbar_arrive(&pv_empty[sp]);
      K::pack_p(s, pa);
      if (p.sinks != nullptr && blockIdx.x == 0 && t == 0 && tr_count < %d) {
        uint4* at = reinterpret_cast<uint4*>(const_cast<float*>(p.sinks) + %d) + 3 * (wi * %d + tr_count);
        at[0] = make_uint4(tr_[0], tr_[1], tr_[2], tr_[3]);
        at[1] = make_uint4(tr_[4], tr_[5], uint32_t(n), uint32_t(k));
        at[2] = make_uint4(tr_[6], tr_[7], 0u, 0u);
      }
      ++tr_count;
    }""" % (MAX_TILES, OFFSET, MAX_TILES)),
    ("""  int it = 0;
  for (int k = 0;; ++k) {
    const int qs = k % kQStages;
    h::mbar_wait(&q_full[qs], (k / kQStages) & 1);""", """  int it = 0;
  int tr_count = 0;
  for (int k = 0;; ++k) {
    const int qs = k % kQStages;
    h::mbar_wait(&q_full[qs], (k / kQStages) & 1);"""),
]


def edit_in_place() -> None:
    s = KERNEL.read_text()
    for old, new in PATCHES:
        assert s.count(old) == 1, old
        s = s.replace(old, new)
    KERNEL.write_text(s)
    print(f"patched {KERNEL}")


def run(row: str, out: Path | None) -> None:
    import torch

    import flashinfer_jit as fij

    hd, mask, batch, n = row.split(",")
    hd, batch, n = int(hd), int(batch), int(n)
    heads, kv_heads, dev = 32, 8, "cuda"
    torch.manual_seed(0)
    q = torch.randn(batch * n, heads, hd, dtype=torch.bfloat16, device=dev)
    k = torch.randn(batch * n, kv_heads, hd, dtype=torch.bfloat16, device=dev)
    v = torch.randn(batch * n, kv_heads, hd, dtype=torch.bfloat16, device=dev)
    indptr = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32)
    w = fij.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD",
                                                 backend="fa3")
    w.plan(indptr, indptr, heads, kv_heads, hd, causal=mask == "causal", q_data_type=torch.bfloat16)
    buf = torch.zeros(OFFSET + 2 * MAX_TILES * SLOTS, dtype=torch.float32, device=dev)
    buf[:OFFSET] = float("-inf")
    for _ in range(3):  # the third launch's stamps are kept (each launch overwrites them)
        buf[OFFSET:] = 0
        w.run(q, k, v, sinks=buf[:heads])
    torch.cuda.synchronize()
    raw = buf[OFFSET:].view(torch.int32).cpu().numpy().astype("uint32").reshape(2, MAX_TILES, SLOTS)
    report = {"row": row, "device": torch.cuda.get_device_name(), "warpgroups": []}
    for wi in range(2):
        tiles = [r for r in raw[wi] if r[1] != 0 or r[0] != 0]
        phases = {name: [] for name in ("k_and_turn", "issue", "s_wait", "softmax", "softmax_max", "softmax_exp",
                                        "softmax_rest", "pv_wait", "pack", "period")}
        for a, b in zip(tiles, tiles[1:]):
            if b[7] != a[7] or b[6] != a[6] + 1:  # the next iteration is another item's
                continue
            d = lambda x, y: int((int(y) - int(x)) & 0xFFFFFFFF)  # noqa: E731
            phases["k_and_turn"].append(d(a[0], a[1]))
            phases["issue"].append(d(a[1], a[2]))
            phases["s_wait"].append(d(a[2], a[3]))
            phases["softmax"].append(d(a[3], a[4]))
            phases["softmax_max"].append(d(a[3], a[8]))  # masks, the rows' maxima, the stale-max test
            phases["softmax_exp"].append(d(a[8], a[9]))  # the exponentials and the sums
            phases["softmax_rest"].append(d(a[9], a[4]))  # l, the vote
            phases["pv_wait"].append(d(a[4], a[5]))
            phases["pack"].append(d(a[5], b[0]))
            phases["period"].append(d(a[1], b[1]))
        med = {k_: statistics.median(v_) if v_ else None for k_, v_ in phases.items()}
        report["warpgroups"].append({"tiles": len(tiles), "pairs": len(phases["period"]), "median_cycles": med})
        print(f"warpgroup {wi}: {len(tiles)} tiles stamped; median cycles {med}")
    # warpgroup 1's turn behind warpgroup 0's, the same (item, tile)
    first = {(int(r[7]), int(r[6])): int(r[1]) for r in raw[0] if r[1] or r[0]}
    lags = [int((int(r[1]) - first[(int(r[7]), int(r[6]))]) & 0xFFFFFFFF) for r in raw[1]
            if (r[1] or r[0]) and (int(r[7]), int(r[6])) in first]
    lags = [x for x in lags if x < 1 << 30]
    report["wg1_turn_lag_median"] = statistics.median(lags) if lags else None
    print(f"warpgroup 1's turn after warpgroup 0's (same tile): median {report['wg1_turn_lag_median']} cycles")
    if out:
        out.write_text(json.dumps(report, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--edit-in-place", action="store_true")
    ap.add_argument("--run", metavar="HD,causal|full,REQUESTS,TOKENS")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.edit_in_place:
        edit_in_place()
    if a.run:
        run(a.run, a.out)
    if not (a.edit_in_place or a.run):
        ap.error("--edit-in-place and/or --run")


if __name__ == "__main__":
    main()

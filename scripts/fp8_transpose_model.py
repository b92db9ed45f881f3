#!/usr/bin/env python3
"""A byte-level model, in numpy, of csrc/hopper/sm90_fp8.cuh's FP8 pieces, run on the CPU:
- transpose_v_e4m3: V [128 keys x 128 dims] in a 128B-swizzled tile into V^T [128 dims x 128
  keys] with the keys in vt_key's order; checks every byte, that the passes cover every unit
  once, and that every 4-byte read and write of a warp's pass hits 32 distinct banks;
- pack_p_e4m3: P from S's fp32 accumulator layout into the e4m3 A fragments, under the first
  candidate fragment layout (the one tests/hopper/fp8_probe.cu's GPU run must confirm);
  checks that the fragments against that V^T give P V.
It mirrors the C++ by hand (a change there must be made here too); the GPU probe
(tests/test_hopper_blocks.py::test_fp8_probe_on_hopper) checks the C++ itself.

  python3 scripts/fp8_transpose_model.py [--warps 4]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def vt_key(col: int) -> int:
    return (col & ~15) + 2 * ((col & 15) >> 2) + (col & 1) + 8 * ((col >> 1) & 1)


def swizzle128(row: int, col: int) -> int:
    return row * 128 + ((((col >> 4) ^ row) & 7) << 4) + (col & 15)


def byte_perm(x: int, y: int, sel: int) -> int:
    b = [(x >> (8 * i)) & 255 for i in range(4)] + [(y >> (8 * i)) & 255 for i in range(4)]
    return sum(b[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def transpose(v_tile: np.ndarray, warps: int) -> tuple[np.ndarray, int, set]:
    """(V^T tile, the worst bank multiplicity of any pass's access, the units moved)."""
    vt = np.zeros_like(v_tile)

    def word(off: int) -> int:
        return int.from_bytes(v_tile[off:off + 4].tobytes(), "little")

    worst, units = 0, set()
    for warp in range(warps):
        for pas in range(warp, 32, warps):
            accesses = [[] for _ in range(8)]
            for lane in range(32):
                q, g = lane % 4, lane // 4
                w = 8 * (pas // 8) + ((g + pas % 8) & 7)  # the pass's s = pas % 8, w0 = 8 (pas // 8)
                k0 = 16 * g + 2 * q
                units.add((g, q, w))
                reads = [swizzle128(k, 4 * w) for k in (k0, k0 + 1, k0 + 8, k0 + 9)]
                a0, a1, a2, a3 = (word(o) for o in reads)
                t0, t1 = byte_perm(a0, a1, 0x5140), byte_perm(a0, a1, 0x7362)
                u0, u1 = byte_perm(a2, a3, 0x5140), byte_perm(a2, a3, 0x7362)
                col = 16 * g + 4 * q
                writes = [swizzle128(4 * w + i, col) for i in range(4)]
                values = [byte_perm(t0, u0, 0x5410), byte_perm(t0, u0, 0x7632), byte_perm(t1, u1, 0x5410),
                          byte_perm(t1, u1, 0x7632)]
                for o, val in zip(writes, values):
                    vt[o:o + 4] = np.frombuffer(val.to_bytes(4, "little"), np.uint8)
                for i, o in enumerate(reads + writes):
                    accesses[i].append((o // 4) % 32)
            worst = max(worst, *(int(np.bincount(a).max()) for a in accesses))
    return vt, worst, units


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warps", type=int, default=4)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    assert sorted(vt_key(c) for c in range(128)) == list(range(128)), "vt_key is not a permutation"
    v = rng.integers(0, 256, (128, 128), dtype=np.uint8)  # [key][dim]
    tile = np.zeros(128 * 128, np.uint8)
    for k in range(128):
        for d in range(128):
            tile[swizzle128(k, d)] = v[k, d]
    vt_tile, worst, units = transpose(tile, args.warps)
    vt = np.array([[vt_tile[swizzle128(d, c)] for c in range(128)] for d in range(128)])
    transposed = all(vt[d, c] == v[vt_key(c), d] for d in range(128) for c in range(128))
    # pack_p_e4m3's fragments under layout 0: register 0 row r columns 4q.., 1 row r + 8, 2 row r
    # columns 16 + 4q.., 3 row r + 8 (of each 32-key k-step)
    p = rng.random((64, 128))
    frag = np.full((64, 128), np.nan)
    for t in range(128):
        r, q = 16 * (t // 32) + (t % 32) // 4, t % 4
        s = np.zeros(64)
        for j in range(16):
            s[4 * j:4 * j + 4] = p[r, 8 * j + 2 * q], p[r, 8 * j + 2 * q + 1], p[r + 8, 8 * j + 2 * q], \
                p[r + 8, 8 * j + 2 * q + 1]
        for kk in range(4):
            j = 4 * kk
            regs = [(s[4 * j], s[4 * j + 1], s[4 * j + 4], s[4 * j + 5]),
                    (s[4 * j + 2], s[4 * j + 3], s[4 * j + 6], s[4 * j + 7]),
                    (s[4 * j + 8], s[4 * j + 9], s[4 * j + 12], s[4 * j + 13]),
                    (s[4 * j + 10], s[4 * j + 11], s[4 * j + 14], s[4 * j + 15])]
            for reg, (row, c0) in zip(regs, [(r, 4 * q), (r + 8, 4 * q), (r, 16 + 4 * q), (r + 8, 16 + 4 * q)]):
                frag[row, 32 * kk + c0: 32 * kk + c0 + 4] = reg
    vf = rng.random((128, 128))
    vtf = np.array([[vf[vt_key(c), d] for c in range(128)] for d in range(128)])
    err = float(np.abs(frag @ vtf.T - p @ vf).max())
    print(f"transpose exact: {transposed}; units moved: {len(units)} of 1024; worst bank multiplicity: {worst}; "
          f"P V from the packed fragments: max error {err:.2g}")
    return 0 if transposed and len(units) == 1024 and worst == 1 and err < 1e-12 else 1


if __name__ == "__main__":
    sys.exit(main())

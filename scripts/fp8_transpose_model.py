#!/usr/bin/env python3
"""A byte-level model, in numpy, of csrc/hopper/sm90_fp8.cuh's FP8 pieces, run on the CPU:
- transpose_v_e4m3: V [128 keys x 128 dims] in a 128B-swizzled tile into V^T [128 dims x 128
  keys] with the keys in vt_key's order, by ldmatrix, byte permutes and a transposing stmatrix;
  checks every byte, that the steps cover every unit (16 keys x 16 dims) once, and that every
  phase (one 8 x 16-byte matrix) of each ldmatrix and stmatrix hits 8 distinct 16-byte bank
  groups;
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
    """(V^T tile, the worst bank multiplicity of any phase of any step's ldmatrix or stmatrix,
    the units moved). ldmatrix .x4 (b16, not transposed): lane 8 m + r gives the address of row
    r of matrix m (16 bytes); thread t gets matrix m's row t // 4, bytes 4 (t % 4) .. + 3.
    stmatrix .x4 .trans (b16): thread t's register m goes to matrix m's rows 2 (t % 4) (low
    half) and 2 (t % 4) + 1 (high half), bytes 2 (t // 4) and 2 (t // 4) + 1."""
    vt = np.zeros_like(v_tile)
    worst, units = 0, set()

    def lane_consts(lane: int) -> tuple:
        m, r = lane >> 3, lane & 7
        j, odd = m >> 1, m & 1
        kl = 2 * (r >> 1) + ((r & 1) ^ odd)
        ld_row = 128 * (kl + 8 * (r & 1))
        up = r >> 1
        use_r1 = int(up in (1, 2)) ^ odd
        dl = 4 * up + 2 * use_r1 + (r & 1)
        return j, kl, ld_row, dl, 128 * dl

    def selectors(lane: int) -> tuple:
        rho, u = lane >> 2, lane & 3
        r0, r1 = (0x1504, 0x3726) if rho & 1 else (0x5140, 0x7362)
        return (r1, r0) if u in (1, 2) else (r0, r1)

    for warp in range(warps):
        for step in range(warp, 32, warps):
            ld_addr, st_addr = [], []
            for lane in range(32):
                j, kl, ld_row, dl, st_row = lane_consts(lane)
                unit = 2 * step + j
                g, d = unit & 7, unit >> 3
                units.add((g, d))
                ld_addr.append(ld_row + 2048 * g + (((d ^ kl) & 7) << 4))
                st_addr.append(st_row + 2048 * d + (((g ^ dl) & 7) << 4))
            for m in range(4):  # one phase a matrix: eight rows of 16 bytes
                for addrs in (ld_addr, st_addr):
                    banks = [(a // 16) % 8 for a in addrs[8 * m:8 * m + 8]]
                    worst = max(worst, int(np.bincount(banks).max()))
            regs = []
            for t in range(32):
                x = [int.from_bytes(v_tile[ld_addr[8 * m + t // 4] + 4 * (t % 4):][:4].tobytes(), "little")
                     for m in range(4)]
                sa, sb = selectors(t)
                regs.append([byte_perm(x[0], x[1], sa), byte_perm(x[0], x[1], sb), byte_perm(x[2], x[3], sa),
                             byte_perm(x[2], x[3], sb)])
            for t in range(32):
                for m in range(4):
                    val = regs[t][m]
                    for half in range(2):
                        row = st_addr[8 * m + 2 * (t % 4) + half]
                        off = row + 2 * (t // 4)
                        vt[off] = (val >> (16 * half)) & 255
                        vt[off + 1] = (val >> (16 * half + 8)) & 255
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
    print(f"transpose exact: {transposed}; units moved: {len(units)} of 64; worst bank multiplicity: {worst}; "
          f"P V from the packed fragments: max error {err:.2g}")
    return 0 if transposed and len(units) == 64 and worst == 1 and err < 1e-12 else 1


if __name__ == "__main__":
    sys.exit(main())

// FP8 attention's pieces on Hopper, around csrc/hopper/sm90.cuh's e4m3 wgmma (docs/hopper.md,
// FP8 attention). 8-bit wgmma reads both operands K-major, so P V takes V^T: V's tile, as TMA
// brings it ([keys x head_dim], 128-byte swizzled rows), is transposed in shared memory
// (ldmatrix, byte permutes, a transposing stmatrix). P
// comes from the softmax in S's fp32 accumulator layout, where a thread holds keys 8 j + 2 q +
// {0, 1} (q = lane % 4); the e4m3 A fragment wants four consecutive k-columns a register. P is
// packed where it lies, and V^T's keys are permuted to match (vt_key), which the transpose
// writes for free: no shuffle of P between lanes. tests/hopper/fp8_probe.cu checks both.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

#include "hopper/sm90.cuh"

namespace fij::sm90 {

// Four floats as e4m3 x4, byte i from x_i (round to nearest even, saturated to +-448).
FIJ_SM90 uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x2, x3), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// The key that column `col` of V^T's rows holds: in each group of 16, column 4 q + i takes key
// 2 q + (i & 1) + 8 (i >> 1), the keys a thread's register of P holds (pack_p_e4m3).
__host__ __device__ constexpr int vt_key(int col) {
  return (col & ~15) + 2 * ((col & 15) >> 2) + (col & 1) + 8 * ((col >> 1) & 1);
}

// P of a key tile (s: S's layout, kS = keys / 2 floats a thread: s[4 j + {0, 1}] row r,
// s[4 j + {2, 3}] row r + 8, keys 8 j + 2 q + {0, 1}) packed in place to the e4m3 A fragments of
// wgmma_rs_n128_e4m3, one a k-step of 32 keys: registers {row r keys 0-15 of the step, row r + 8
// the same, row r keys 16-31, row r + 8 the same} (kLayout 0; 1 swaps the middle two), each
// holding keys 2 q, 2 q + 1, 8 + 2 q, 9 + 2 q of its 16 (vt_key's order).
template <int kLayout = 0, int kS>
FIJ_SM90 void pack_p_e4m3(const float (&s)[kS], uint32_t (&pa)[kS / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kS / 16; ++kk) {
    const int j = 4 * kk;  // slabs j .. j + 3: j, j + 1 the step's first 16 keys, j + 2, j + 3 its last
    const uint32_t r_lo = pack_e4m3x4(s[4 * j], s[4 * j + 1], s[4 * j + 4], s[4 * j + 5]);
    const uint32_t r8_lo = pack_e4m3x4(s[4 * j + 2], s[4 * j + 3], s[4 * j + 6], s[4 * j + 7]);
    const uint32_t r_hi = pack_e4m3x4(s[4 * j + 8], s[4 * j + 9], s[4 * j + 12], s[4 * j + 13]);
    const uint32_t r8_hi = pack_e4m3x4(s[4 * j + 10], s[4 * j + 11], s[4 * j + 14], s[4 * j + 15]);
    pa[kk][0] = r_lo;
    pa[kk][1] = kLayout == 0 ? r8_lo : r_hi;
    pa[kk][2] = kLayout == 0 ? r_hi : r8_lo;
    pa[kk][3] = r8_hi;
  }
}

// stmatrix .x4 .trans of four 8x8 b16 matrices: lanes 8 m .. 8 m + 7 give the row addresses
// of matrix m; this thread's r[m] goes to matrix m's rows 2 (lane % 4) (its low half) and
// 2 (lane % 4) + 1 (its high half), b16 column lane / 4.
FIJ_SM90 void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
// ldmatrix .x4 (not transposed): lanes 8 m .. give matrix m's row addresses; r[m] holds this
// thread's 4 bytes of matrix m: row lane / 4, bytes 4 (lane % 4) .. + 3. (common/mma.cuh's
// ldmatrix_x4 without a memory clobber; this one stays after the mbarrier wait for the tile.)
FIJ_SM90 void ldmatrix_x4_rows(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// V [kKeys x 128] e4m3 (one TMA tile: a key a row, 128B-swizzled: byte (row, col) at row x 128 +
// (((col / 16) ^ row) % 8) x 16 + col % 16; shared address v) into V^T
// [128 x kKeys] (a head_dim column a row; kKeys = 128: one swizzle atom a row; columns in
// vt_key's order; shared address vt), by `warps` whole warps, this thread `t` of them.
//
// A unit is 16 keys (group G, the keys of one 16-column run of V^T's rows) by 16 dims (segment
// D). An ldmatrix brings it as two 8 x 16-byte matrices X, Y of V's rows: row rho of X holds
// key ka = 16 G + 2 (rho / 2) + 8 (rho % 2) for even rho and ka + 1 for odd rho, Y the other one
// of the pair, so a thread (row rho, dims 4 u .. 4 u + 3) holds both keys of V^T's byte columns
// 2 rho and 2 rho + 1 (vt_key: keys ka, ka + 1). Two __byte_perm make its pairs (dims 4 u and
// 4 u + 1: R0; 4 u + 2 and 4 u + 3: R1), and a transposing stmatrix writes each b16 (two keys)
// to V^T's row of its dim at b16 column rho: matrix A takes R0 of the threads with u = 0 or 3
// and R1 of u = 1 or 2, B the others, so each matrix's eight rows (dims) differ mod 8. Every
// phase of both instructions then reads or writes eight distinct 16-byte bank groups under the
// 128B swizzle (checked, with every byte, by scripts/fp8_transpose_model.py). An ldmatrix .x4
// and a stmatrix .x4 move two units: 32 of each a tile, against 256 4-byte loads and stores.
// Synchronize, and fence_proxy_async, before a wgmma reads vt.
template <int kKeys>
FIJ_SM90 void transpose_v_e4m3(uint32_t v, uint32_t vt, int t, int warps) {
  static_assert(kKeys == 128, "V^T rows of one 128-byte swizzle atom");
  const int lane = t % 32, m = lane >> 3, r = lane & 7, j = m >> 1, odd = m & 1;
  // this lane's row of matrix m (X / A even m, Y / B odd m) of unit j of each step
  const int kl = 2 * (r >> 1) + ((r & 1) ^ odd);  // its key mod 8; the key: 16 G + kl + 8 (r % 2)
  const uint32_t ld_row = v + 128 * (kl + 8 * (r & 1));
  const int up = r >> 1, use_r1 = (up == 1 || up == 2) ^ odd;
  const int dl = 4 * up + 2 * use_r1 + (r & 1);  // its dim mod 16
  const uint32_t st_row = vt + 128 * dl;
  // this thread's pairs: X's row rho holds ka (even rho) or ka + 1 (odd)
  const int rho = lane >> 2, u = lane & 3;
  const uint32_t r0 = (rho & 1) ? 0x1504u : 0x5140u, r1 = (rho & 1) ? 0x3726u : 0x7362u;
  const bool swap = u == 1 || u == 2;
  const uint32_t sel_a = swap ? r1 : r0, sel_b = swap ? r0 : r1;
  for (int step = t / 32; step < 32; step += warps) {
    const int unit = 2 * step + j, g = unit & 7, d = unit >> 3;
    uint32_t x[4], y[4];
    ldmatrix_x4_rows(ld_row + 2048 * g + (((d ^ kl) & 7) << 4), x);
    y[0] = __byte_perm(x[0], x[1], sel_a);
    y[1] = __byte_perm(x[0], x[1], sel_b);
    y[2] = __byte_perm(x[2], x[3], sel_a);
    y[3] = __byte_perm(x[2], x[3], sel_b);
    stmatrix_x4_trans(st_row + 2048 * d + (((g ^ dl) & 7) << 4), y);
  }
}

}  // namespace fij::sm90

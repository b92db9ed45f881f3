// FP8 attention's pieces on Hopper, around csrc/hopper/sm90.cuh's e4m3 wgmma (docs/hopper.md,
// FP8 attention). 8-bit wgmma reads both operands K-major, so P V takes V^T: V's tile, as TMA
// brings it ([keys x head_dim], 128-byte swizzled rows), is transposed in shared memory. P
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

// Byte (row, col) of a 128B-swizzled tile of 128-byte rows (TMA's CU_TENSOR_MAP_SWIZZLE_128B:
// the 16-byte chunk index XOR the row's index mod 8).
FIJ_SM90 int swizzle128(int row, int col) { return row * 128 + ((((col >> 4) ^ row) & 7) << 4) + (col & 15); }

// V [kKeys x 128] e4m3 (one TMA tile: a key a row, 128B-swizzled) into V^T [128 x kKeys] (a
// head_dim column a row; kKeys = 128: one swizzle atom a row; columns in vt_key's order), by
// `warps` whole warps, this thread `t` of them. A unit moves four keys (the four of one V^T
// word in vt_key's order: 16 g + 2 q + {0, 1, 8, 9}) by four dims (4 w ..): four 4-byte reads,
// a byte transpose by __byte_perm, four 4-byte writes. Lane a + 4 b of a warp's pass takes q = a,
// g = b, w = w0 + ((b + s) mod 8) (the pass's s in 0..7, w0 in {0, 8, 16, 24}): every read and
// every write of a pass then hits 32 distinct banks under the 128B swizzle (checked, with
// every byte, by scripts/fp8_transpose_model.py). Synchronize, and fence_proxy_async, before a wgmma
// reads vt. ldmatrix / stmatrix (16 bytes a lane) would move the tile in fewer instructions.
template <int kKeys>
FIJ_SM90 void transpose_v_e4m3(const unsigned char* v, unsigned char* vt, int t, int warps) {
  static_assert(kKeys == 128, "V^T rows of one 128-byte swizzle atom");
  const int lane = t % 32, q = lane % 4, g = lane / 4;
  for (int pass = t / 32; pass < 32; pass += warps) {
    const int s = pass % 8, w = 8 * (pass / 8) + ((g + s) & 7);  // dims 4 w .. 4 w + 3
    const int k0 = 16 * g + 2 * q;
    const uint32_t a0 = *reinterpret_cast<const uint32_t*>(v + swizzle128(k0, 4 * w));
    const uint32_t a1 = *reinterpret_cast<const uint32_t*>(v + swizzle128(k0 + 1, 4 * w));
    const uint32_t a2 = *reinterpret_cast<const uint32_t*>(v + swizzle128(k0 + 8, 4 * w));
    const uint32_t a3 = *reinterpret_cast<const uint32_t*>(v + swizzle128(k0 + 9, 4 * w));
    const uint32_t t0 = __byte_perm(a0, a1, 0x5140), t1 = __byte_perm(a0, a1, 0x7362);  // a0/a1 bytes interleaved
    const uint32_t u0 = __byte_perm(a2, a3, 0x5140), u1 = __byte_perm(a2, a3, 0x7362);
    const int col = 16 * g + 4 * q;  // byte i of each word: key vt_key(col + i)
    *reinterpret_cast<uint32_t*>(vt + swizzle128(4 * w, col)) = __byte_perm(t0, u0, 0x5410);
    *reinterpret_cast<uint32_t*>(vt + swizzle128(4 * w + 1, col)) = __byte_perm(t0, u0, 0x7632);
    *reinterpret_cast<uint32_t*>(vt + swizzle128(4 * w + 2, col)) = __byte_perm(t1, u1, 0x5410);
    *reinterpret_cast<uint32_t*>(vt + swizzle128(4 * w + 3, col)) = __byte_perm(t1, u1, 0x7632);
  }
}

}  // namespace fij::sm90

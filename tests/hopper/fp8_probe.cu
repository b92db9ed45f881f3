// Probe of csrc/hopper/sm90.cuh's e4m3 wgmma on an sm_90a GPU, the building blocks of FP8
// attention (tests/test_hopper_blocks.py builds and runs it):
//  1. S = Q K^T: Q [64 x 128] and K [128 x 128] e4m3, K-major, brought by TMA (8-bit maps,
//     128-byte rows: one 128B-swizzle atom a row), wgmma m64n128k32 from two descriptors.
//  2. O = P V with P [64 x 128] e4m3 from registers and V^T [128 x 128] (keys contiguous,
//     K-major: 8-bit wgmma has no transposed B) by TMA. P goes into the A fragment in each
//     of two candidate layouts (which registers hold which rows and columns), reported.
//  3. The same O from P as the attention kernel holds it: its rows' probabilities in the
//     fp32 accumulator layout of S (columns 8 j + 2 (t % 4) + {0, 1} of rows r and r + 8),
//     packed to e4m3 in place (csrc/hopper/sm90_fp8.cuh pack_p_e4m3), with V^T's keys
//     permuted in each group of 16 to match (vt_key), on the host: no shuffle of P.
//  4. The e4m3 wgmma issue rate (test 1's four k-steps repeated on every SM).
//  5. As 3, with V [keys x dims] brought by TMA and transposed in shared memory into the
//     permuted V^T (transpose_v_e4m3), as the kernel will.
// Inputs are random normal values rounded to e4m3; references in double on the host from the
// rounded values. Prints "name value" lines; exit 0 when 1, 3 and 5 match and a candidate of 2.
// "Match": a max error relative to the largest reference value below kFp8Tol. The e4m3 wgmma
// does not add in full fp32: on an H200 (2026-11-30) Q K^T came out 2.4e-4 off and P V 3.5e-4
// (about 2^-12, the 13-14 bits an fp8 MMA is known to keep while it accumulates), where the bf16
// probe's are below 1e-5; the wrong A layout is 0.58 off.
#include <cuda_fp8.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "hopper/sm90.cuh"
#include "hopper/sm90_fp8.cuh"
#include "hopper/tma_host.h"
#include "probe_common.cuh"

using fp8 = __nv_fp8_e4m3;
namespace h = fij::sm90;

constexpr double kFp8Tol = 2e-3;

constexpr int kM = 64, kD = 128, kN = 128;  // rows, head_dim, keys (PV's k: kN, its n: kD)

// 1 and 4: Q (64 rows) then K (128 rows), 128 bytes a row, into the block's shared memory;
// returns Q's tile (K's follows it).
__device__ unsigned char* load_qk(unsigned char* smem_raw, const CUtensorMap* q_map, const CUtensorMap* k_map) {
  __shared__ uint64_t bar;
  unsigned char* sq = h::align_1024(smem_raw);
  load_once(&bar, (kM + kN) * kD, [&] {
    h::tma_load_2d(sq, q_map, &bar, 0, 0);
    h::tma_load_2d(sq + kM * kD, k_map, &bar, 0, 0);
  });
  return sq;
}

// S (+)= Q K^T of the tiles load_qk left at sq, its four k-steps issued (kAccumulate false: the
// first k-step overwrites S).
template <bool kAccumulate>
__device__ void issue_qk(float (&d)[64], const unsigned char* sq) {
  const uint32_t q = h::smem_addr(sq), k = q + kM * kD;
#pragma unroll
  for (int ks = 0; ks < kD / 32; ++ks)
    if (ks == 0 && !kAccumulate)
      h::wgmma_ss_n128_e4m3<0>(d, h::kmajor_desc(q, kM, ks), h::kmajor_desc(k, kN, ks));
    else
      h::wgmma_ss_n128_e4m3(d, h::kmajor_desc(q, kM, ks), h::kmajor_desc(k, kN, ks));
}

__global__ void __launch_bounds__(128) qk_kernel(const __grid_constant__ CUtensorMap q_map,
                                                 const __grid_constant__ CUtensorMap k_map, float* s_out) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned char* sq = load_qk(smem_raw, &q_map, &k_map);
  float d[64];
  h::wgmma_fence();
  issue_qk<false>(d, sq);
  h::wgmma_commit();
  h::wgmma_wait<0>();
  h::fence_regs(d);
  store_acc<kN>(d, s_out);
}

// Four consecutive e4m3 of row `row` from column `col` as one register (byte i: column col + i).
__device__ uint32_t four(const fp8* p, int row, int col) {
  return *reinterpret_cast<const uint32_t*>(p + row * kN + col);
}

// O = P V over the key tile's four k-steps: P's fragments a (all written before the fence, else
// ptxas injects one, C7519), V^T K-major at vt_tile; O to o_out.
__device__ void pv_rs(const uint32_t (&a)[kN / 32][4], uint32_t vt_tile, float* o_out) {
  float d[64];
  h::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kN / 32; ++kk) {
    const uint64_t b = h::kmajor_desc(vt_tile, kD, kk);
    if (kk == 0)
      h::wgmma_rs_n128_e4m3<0>(d, a[kk], b);
    else
      h::wgmma_rs_n128_e4m3(d, a[kk], b);
  }
  h::wgmma_commit();
  h::wgmma_wait<0>();
  h::fence_regs(d);
  store_acc<kD>(d, o_out);
}

// 2: layout 0 takes {row r cols 4q.., row r + 8 cols 4q.., row r cols 16 + 4q.., row r + 8
// cols 16 + 4q..} (the bf16 fragment's order, a register four columns wide); layout 1 {row r
// cols 4q.., row r cols 16 + 4q.., row r + 8 cols 4q.., row r + 8 cols 16 + 4q..}.
__global__ void __launch_bounds__(128) pv_kernel(const fp8* p, const __grid_constant__ CUtensorMap vt_map, int layout,
                                                 float* o_out) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* svt = h::align_1024(smem_raw);
  __shared__ uint64_t bar;
  load_once(&bar, kD * kN, [&] { h::tma_load_2d(svt, &vt_map, &bar, 0, 0); });
  const int t = threadIdx.x, r = 16 * (t / 32) + (t % 32) / 4, q = t % 4;
  uint32_t a[kN / 32][4];
#pragma unroll
  for (int kk = 0; kk < kN / 32; ++kk) {
    const int c = 32 * kk + 4 * q;
    a[kk][0] = four(p, r, c);
    a[kk][1] = layout == 0 ? four(p, r + 8, c) : four(p, r, c + 16);
    a[kk][2] = layout == 0 ? four(p, r, c + 16) : four(p, r + 8, c);
    a[kk][3] = four(p, r + 8, c + 16);
  }
  pv_rs(a, h::smem_addr(svt), o_out);
}

// 3 and 5: P read into the S accumulator layout (floats, as the softmax leaves them), then
// packed where they lie (pack_p_e4m3 in layout `layout`). 3: V^T with its keys permuted comes
// by TMA (vt_map). 5: V [keys x dims] comes by TMA (vt_map then maps V) and is transposed here.
template <int kLayout>
__device__ void pv_from_s(const float* p, const CUtensorMap* vt_map, bool transpose, float* o_out) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sv = h::align_1024(smem_raw);  // the TMA tile: V^T (3) or V (5)
  unsigned char* svt = sv + kD * kN;             // 5: the transposed V^T
  __shared__ uint64_t bar;
  load_once(&bar, kD * kN, [&] { h::tma_load_2d(sv, vt_map, &bar, 0, 0); });
  if (transpose) {
    h::transpose_v_e4m3<kN>(h::smem_addr(sv), h::smem_addr(svt), threadIdx.x, 4);
    h::fence_proxy_async();  // the generic writes, before the wgmma (the async proxy) reads them
    __syncthreads();
  }
  const int t = threadIdx.x, r = 16 * (t / 32) + (t % 32) / 4, q = t % 4;
  float s[64];  // S's layout: s[4 j + {0, 1}] row r, s[4 j + {2, 3}] row r + 8, columns 8 j + 2 q + {0, 1}
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    s[4 * j] = p[r * kN + 8 * j + 2 * q];
    s[4 * j + 1] = p[r * kN + 8 * j + 2 * q + 1];
    s[4 * j + 2] = p[(r + 8) * kN + 8 * j + 2 * q];
    s[4 * j + 3] = p[(r + 8) * kN + 8 * j + 2 * q + 1];
  }
  uint32_t a[kN / 32][4];
  h::pack_p_e4m3<kLayout>(s, a);
  pv_rs(a, h::smem_addr(transpose ? svt : sv), o_out);
}

__global__ void __launch_bounds__(128) pv_from_s_kernel(const float* p, const __grid_constant__ CUtensorMap vt_map,
                                                        int layout, int transpose, float* o_out) {
  if (layout == 0)
    pv_from_s<0>(p, &vt_map, transpose != 0, o_out);
  else
    pv_from_s<1>(p, &vt_map, transpose != 0, o_out);
}

__global__ void __launch_bounds__(128) rate_kernel(const __grid_constant__ CUtensorMap q_map,
                                                   const __grid_constant__ CUtensorMap k_map, int reps, float* sink) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned char* sq = load_qk(smem_raw, &q_map, &k_map);
  float d[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  for (int rep = 0; rep < reps; ++rep) {
    h::wgmma_fence();
    issue_qk<true>(d, sq);
    h::wgmma_commit();
    h::wgmma_wait<1>();
  }
  h::wgmma_wait<0>();
  h::fence_regs(d);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) s += d[i];
  if (s == 12345.f) sink[0] = s;  // keeps the loop
}

int main() {
  std::mt19937 gen(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  auto rand_fp8 = [&](size_t n, bool probabilities) {
    std::vector<fp8> v(n);
    for (auto& x : v) x = fp8(probabilities ? ud(gen) : nd(gen));
    return v;
  };
  const std::vector<fp8> q = rand_fp8(kM * kD, false), k = rand_fp8(kN * kD, false), p = rand_fp8(kM * kN, true),
                         v = rand_fp8(kN * kD, false);  // v [keys][dims]
  std::vector<fp8> vt(kD * kN), vt_perm(kD * kN);      // [dims][keys]
  for (int key = 0; key < kN; ++key)
    for (int c = 0; c < kD; ++c) vt[c * kN + key] = v[key * kD + c];
  for (int c = 0; c < kD; ++c)
    for (int col = 0; col < kN; ++col) vt_perm[c * kN + col] = v[h::vt_key(col) * kD + c];
  std::vector<float> p_float(kM * kN);
  for (size_t i = 0; i < p.size(); ++i) p_float[i] = float(p[i]);  // exactly e4m3 values: packing keeps them

  fp8 *dq, *dk, *dp, *dvt, *dvtp, *dv;
  float *dpf, *ds, *dout;
  CHECK_CUDA(cudaMalloc(&dq, q.size()));
  CHECK_CUDA(cudaMalloc(&dk, k.size()));
  CHECK_CUDA(cudaMalloc(&dp, p.size()));
  CHECK_CUDA(cudaMalloc(&dvt, vt.size()));
  CHECK_CUDA(cudaMalloc(&dvtp, vt_perm.size()));
  CHECK_CUDA(cudaMalloc(&dv, v.size()));
  CHECK_CUDA(cudaMalloc(&dpf, p_float.size() * 4));
  CHECK_CUDA(cudaMalloc(&ds, kM * kN * 4));
  CHECK_CUDA(cudaMalloc(&dout, kM * kD * 4));
  CHECK_CUDA(cudaMemcpy(dq, q.data(), q.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, k.data(), k.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dp, p.data(), p.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dvt, vt.data(), vt.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dvtp, vt_perm.data(), vt_perm.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, v.data(), v.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dpf, p_float.data(), p_float.size() * 4, cudaMemcpyHostToDevice));

  // maps: 128-byte rows (one swizzle atom), the whole tile one box
  const uint64_t q_dims[2] = {kD, kM}, k_dims[2] = {kD, kN}, vt_dims[2] = {kN, kD}, v_dims[2] = {kD, kN};
  const uint64_t row_bytes[1] = {128};
  const uint32_t q_box[2] = {kD, kM}, k_box[2] = {kD, kN}, vt_box[2] = {kN, kD}, v_box[2] = {kD, kN};
  const auto u8 = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  CUtensorMap q_map, k_map, vt_map, vtp_map, v_map;
  try {
    q_map = h::tensor_map(dq, 2, q_dims, row_bytes, q_box, u8, CU_TENSOR_MAP_SWIZZLE_128B);
    k_map = h::tensor_map(dk, 2, k_dims, row_bytes, k_box, u8, CU_TENSOR_MAP_SWIZZLE_128B);
    vt_map = h::tensor_map(dvt, 2, vt_dims, row_bytes, vt_box, u8, CU_TENSOR_MAP_SWIZZLE_128B);
    vtp_map = h::tensor_map(dvtp, 2, vt_dims, row_bytes, vt_box, u8, CU_TENSOR_MAP_SWIZZLE_128B);
    v_map = h::tensor_map(dv, 2, v_dims, row_bytes, v_box, u8, CU_TENSOR_MAP_SWIZZLE_128B);
  } catch (const std::exception& e) {
    std::printf("tensor_map_error %s\n", e.what());
    return 2;
  }
  const int qk_smem = (kM + kN) * kD + 1024, pv_smem = kD * kN + 1024, pv_t_smem = 2 * kD * kN + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(qk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, qk_smem));
  CHECK_CUDA(cudaFuncSetAttribute(rate_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, qk_smem));
  CHECK_CUDA(cudaFuncSetAttribute(pv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, pv_smem));
  CHECK_CUDA(cudaFuncSetAttribute(pv_from_s_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, pv_t_smem));

  // 1. S = Q K^T
  CHECK_CUDA(cudaMemset(ds, 0xff, kM * kN * 4));  // NaN: unwritten elements fail
  qk_kernel<<<1, 128, qk_smem>>>(q_map, k_map, ds);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> s(kM * kN);
  CHECK_CUDA(cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost));
  const auto e4m3 = [](fp8 x) { return float(x); };
  const std::vector<double> s_ref = ref_matmul(q.data(), k.data(), kM, kN, kD, true, e4m3);
  const double qk_err = max_rel_err(s, s_ref);
  std::printf("fp8_qk_ss_rel_err %.3g\n", qk_err);

  // 2 and 3. O = P V
  const std::vector<double> o_ref = ref_matmul(p.data(), v.data(), kM, kD, kN, false, e4m3);
  // mode 0: P's fragment read whole (2), 1: P from S's layout against the permuted V^T (3),
  // 2: the same with V transposed in shared memory (5)
  auto run_pv = [&](int mode, int layout, double* err) -> int {
    CHECK_CUDA(cudaMemset(dout, 0xff, kM * kD * 4));
    if (mode == 0)
      pv_kernel<<<1, 128, pv_smem>>>(dp, vt_map, layout, dout);
    else
      pv_from_s_kernel<<<1, 128, pv_t_smem>>>(dpf, mode == 1 ? vtp_map : v_map, layout, mode == 2, dout);
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<float> o(kM * kD);
    CHECK_CUDA(cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost));
    *err = max_rel_err(o, o_ref);
    return 0;
  };
  int pv_match = -1, from_s_ok = 0;
  for (int layout = 0; layout < 2; ++layout) {
    double err = INFINITY;
    if (run_pv(0, layout, &err) != 0) return 2;
    std::printf("fp8_pv_rs_layout%d_rel_err %.3g\n", layout, err);
    if (err < kFp8Tol && pv_match < 0) pv_match = layout;
  }
  for (int mode = 1; mode <= 2; ++mode)
    for (int layout = 0; layout < 2; ++layout) {  // (either register order)
      double err = INFINITY;
      if (run_pv(mode, layout, &err) != 0) return 2;
      std::printf("fp8_pv_%s_layout%d_rel_err %.3g\n", mode == 1 ? "from_s" : "transposed", layout, err);
      from_s_ok += err < kFp8Tol && layout == pv_match;
    }

  // 4. issue rate
  if (report_rate("wgmma_ss_n128_e4m3",
                  [&](int blocks, int reps) { rate_kernel<<<blocks, 128, qk_smem>>>(q_map, k_map, reps, ds); },
                  (kD / 32) * 2.0 * kM * kN * 32) != 0)
    return 2;
  return qk_err < kFp8Tol && pv_match >= 0 && from_s_ok == 2 ? 0 : 1;
}

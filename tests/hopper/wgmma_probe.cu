// Probe of csrc/hopper/sm90.cuh on an sm_90a GPU (tests/test_hopper_blocks.py builds and runs it):
//  1. S = Q K^T: Q [64 x 128] and K [128 x 128] bf16, both K-major, brought by TMA with the
//     128B swizzle, multiplied by wgmma m64n128k16 from two shared-memory descriptors.
//  2. O = P V: P [64 x 64] bf16 from registers (the A fragment), V [64 x 128] row-major
//     (MN-major B) by TMA, wgmma m64n128k16 with B transposed; each candidate (LBO, SBO)
//     pair of the MN-major descriptor is tried and reported.
//  3. The wgmma issue rate: every SM's blocks repeat test 1's eight k-steps from shared
//     memory; TFLOP/s of the dense bf16 rate the wrappers reach.
// Inputs are random normal bf16; references in double on the host. Prints one line per
// result ("name value"); exit 0 when 1 and at least one candidate of 2 match.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "hopper/sm90.cuh"
#include "hopper/tma_host.h"
#include "probe_common.cuh"

using bf16 = __nv_bfloat16;
namespace h = fij::sm90;

constexpr int kM = 64, kD = 128, kN = 128, kKv = 64;

// Test 1's tiles: Q [64 x 128] and K [128 x 128], each two 64-wide atoms.
__device__ void load_qk(unsigned char* sq, unsigned char* sk, const CUtensorMap* q_map, const CUtensorMap* k_map,
                        uint64_t* bar) {
  load_once(bar, (kM + kN) * kD * 2, [&] {
    for (int a = 0; a < kD / 64; ++a) {
      h::tma_load_2d(sq + a * kM * 128, q_map, bar, 64 * a, 0);
      h::tma_load_2d(sk + a * kN * 128, k_map, bar, 64 * a, 0);
    }
  });
}

__global__ void __launch_bounds__(128) qk_kernel(const __grid_constant__ CUtensorMap q_map,
                                                 const __grid_constant__ CUtensorMap k_map, float* s_out) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = h::align_1024(smem_raw);
  unsigned char* sq = smem;                  // 2 atoms x 64 rows x 128 B
  unsigned char* sk = smem + kM * kD * 2;    // 2 atoms x 128 rows x 128 B
  __shared__ uint64_t bar;
  load_qk(sq, sk, &q_map, &k_map, &bar);
  float d[kN / 2];
  h::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks)
    if (ks == 0)
      h::wgmma_ss_n128<0, 0>(d, h::kmajor_desc(h::smem_addr(sq), kM, ks), h::kmajor_desc(h::smem_addr(sk), kN, ks),
                             bf16{});
    else
      h::wgmma_ss_n128<0>(d, h::kmajor_desc(h::smem_addr(sq), kM, ks), h::kmajor_desc(h::smem_addr(sk), kN, ks),
                          bf16{});
  h::wgmma_commit();
  h::wgmma_wait<0>();
  h::fence_regs(d);
  store_acc<kN>(d, s_out);
}

__device__ uint32_t pack2(const bf16* p) {
  __nv_bfloat162 v = __halves2bfloat162(p[0], p[1]);
  return *reinterpret_cast<uint32_t*>(&v);
}

__global__ void __launch_bounds__(128) pv_kernel(const bf16* p, const __grid_constant__ CUtensorMap v_map,
                                                 uint32_t lbo, uint32_t sbo, float* o_out) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sv = h::align_1024(smem_raw);
  __shared__ uint64_t bar;
  load_once(&bar, kKv * kN * 2, [&] {
    for (int a = 0; a < kN / 64; ++a) h::tma_load_2d(sv + a * kKv * 128, &v_map, &bar, 64 * a, 0);
  });
  const int t = threadIdx.x, r = 16 * (t / 32) + (t % 32) / 4, c = 2 * (t % 4);
  float d[kN / 2];
  h::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kKv / 16; ++ks) {
    const uint32_t a[4] = {pack2(p + r * kKv + 16 * ks + c), pack2(p + (r + 8) * kKv + 16 * ks + c),
                           pack2(p + r * kKv + 16 * ks + 8 + c), pack2(p + (r + 8) * kKv + 16 * ks + 8 + c)};
    const uint64_t b = h::make_desc(h::smem_addr(sv) + ks * 16 * 128, lbo, sbo, h::Swizzle::k128B);
    if (ks == 0)
      h::wgmma_rs_n128<1, 0>(d, a, b, bf16{});
    else
      h::wgmma_rs_n128<1>(d, a, b, bf16{});
  }
  h::wgmma_commit();
  h::wgmma_wait<0>();
  h::fence_regs(d);
  store_acc<kN>(d, o_out);
}

// Each block: test 1's tiles loaded once, then `reps` rounds of its eight k-steps.
__global__ void __launch_bounds__(128) rate_kernel(const __grid_constant__ CUtensorMap q_map,
                                                   const __grid_constant__ CUtensorMap k_map, int reps, float* sink) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = h::align_1024(smem_raw);
  unsigned char* sq = smem;
  unsigned char* sk = smem + kM * kD * 2;
  __shared__ uint64_t bar;
  load_qk(sq, sk, &q_map, &k_map, &bar);
  float d[kN / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) d[i] = 0.f;
  for (int rep = 0; rep < reps; ++rep) {
    h::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks)
      h::wgmma_ss_n128<0>(d, h::kmajor_desc(h::smem_addr(sq), kM, ks), h::kmajor_desc(h::smem_addr(sk), kN, ks),
                          bf16{});
    h::wgmma_commit();
    h::wgmma_wait<1>();
  }
  h::wgmma_wait<0>();
  h::fence_regs(d);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) s += d[i];
  if (s == 12345.f) sink[0] = s;  // keeps the loop
}

int main() {
  std::mt19937 gen(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto rand_bf16 = [&](size_t n) {
    std::vector<bf16> v(n);
    for (auto& x : v) x = __float2bfloat16(nd(gen));
    return v;
  };
  const std::vector<bf16> q = rand_bf16(kM * kD), k = rand_bf16(kN * kD), p = rand_bf16(kM * kKv),
                          v = rand_bf16(kKv * kN);
  bf16 *dq, *dk, *dp, *dv;
  float *ds, *dout;
  CHECK_CUDA(cudaMalloc(&dq, q.size() * 2));
  CHECK_CUDA(cudaMalloc(&dk, k.size() * 2));
  CHECK_CUDA(cudaMalloc(&dp, p.size() * 2));
  CHECK_CUDA(cudaMalloc(&dv, v.size() * 2));
  CHECK_CUDA(cudaMalloc(&ds, kM * kN * 4));
  CHECK_CUDA(cudaMalloc(&dout, kM * kN * 4));
  CHECK_CUDA(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dp, p.data(), p.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice));

  // maps: Q [64 rows][128], K [128 rows][128], V [64 rows][128]; boxes 64 wide (128 B)
  const uint64_t q_dims[2] = {kD, kM}, k_dims[2] = {kD, kN}, v_dims[2] = {kN, kKv};
  const uint64_t row_bytes[1] = {kD * 2};
  const uint32_t q_box[2] = {64, kM}, k_box[2] = {64, kN}, v_box[2] = {64, kKv};
  CUtensorMap q_map, k_map, v_map;
  try {
    q_map = h::tensor_map_16bit(dq, 2, q_dims, row_bytes, q_box, true, CU_TENSOR_MAP_SWIZZLE_128B);
    k_map = h::tensor_map_16bit(dk, 2, k_dims, row_bytes, k_box, true, CU_TENSOR_MAP_SWIZZLE_128B);
    v_map = h::tensor_map_16bit(dv, 2, v_dims, row_bytes, v_box, true, CU_TENSOR_MAP_SWIZZLE_128B);
  } catch (const std::exception& e) {
    std::printf("tensor_map_error %s\n", e.what());
    return 2;
  }
  const int qk_smem = (kM + kN) * kD * 2 + 1024, pv_smem = kKv * kN * 2 + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(qk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, qk_smem));
  CHECK_CUDA(cudaFuncSetAttribute(rate_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, qk_smem));
  CHECK_CUDA(cudaFuncSetAttribute(pv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, pv_smem));

  // 1. S = Q K^T
  CHECK_CUDA(cudaMemset(ds, 0xff, kM * kN * 4));  // NaN: unwritten elements fail
  qk_kernel<<<1, 128, qk_smem>>>(q_map, k_map, ds);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> s(kM * kN);
  CHECK_CUDA(cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost));
  const auto widen = [](bf16 x) { return __bfloat162float(x); };
  const std::vector<double> s_ref = ref_matmul(q.data(), k.data(), kM, kN, kD, true, widen);
  const double qk_err = max_rel_err(s, s_ref);
  std::printf("qk_ss_kmajor_rel_err %.3g\n", qk_err);
  const bool qk_ok = qk_err < 1e-5;

  // 2. O = P V, candidates of the MN-major descriptor
  const std::vector<double> o_ref = ref_matmul(p.data(), v.data(), kM, kN, kKv, false, widen);
  const uint32_t candidates[][2] = {{kKv * 128, 1024}, {1024, kKv * 128}, {16, 1024}, {1024, 16}};
  int pv_match = 0;
  for (const auto& cand : candidates) {
    CHECK_CUDA(cudaMemset(dout, 0xff, kM * kN * 4));
    pv_kernel<<<1, 128, pv_smem>>>(dp, v_map, cand[0], cand[1], dout);
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<float> o(kM * kN);
    CHECK_CUDA(cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost));
    const double err = max_rel_err(o, o_ref);
    std::printf("pv_rs_mnmajor_lbo%u_sbo%u_rel_err %.3g\n", cand[0], cand[1], err);
    pv_match += err < 1e-5;
  }

  // 3. issue rate
  if (report_rate("wgmma_ss_n128",
                  [&](int blocks, int reps) { rate_kernel<<<blocks, 128, qk_smem>>>(q_map, k_map, reps, ds); },
                  (kD / 16) * 2.0 * kM * kN * 16) != 0)
    return 2;
  return qk_ok && pv_match > 0 ? 0 : 1;
}

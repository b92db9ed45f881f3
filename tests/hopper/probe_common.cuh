// What the standalone Hopper probes share (tests/hopper/*.cu): the CUDA error check of
// their main()s, a warpgroup's accumulators written out, one TMA load waited for, a double
// reference of a product and the error against it.
#pragma once
#include <cmath>
#include <cstdio>
#include <vector>

#include <cuda_runtime.h>

#include "hopper/sm90.cuh"

// Prints the error and returns 2 from the calling function (main or a step of it).
#define CHECK_CUDA(x)                                                                     \
  do {                                                                                    \
    cudaError_t e = (x);                                                                  \
    if (e != cudaSuccess) {                                                               \
      std::printf("cuda_error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      return 2;                                                                           \
    }                                                                                     \
  } while (0)

// The warpgroup's accumulators d [64 x N] to out (row-major, ld N): thread t holds rows
// 16 (t / 32) + (t % 32) / 4 and + 8, columns 8 j + 2 (t % 4) + {0, 1}.
template <int N>
__device__ void store_acc(const float (&d)[N / 2], float* out) {
  const int t = threadIdx.x % 128, row = 16 * (t / 32) + (t % 32) / 4, col = 2 * (t % 4);
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    out[row * N + 8 * j + col] = d[4 * j];
    out[row * N + 8 * j + col + 1] = d[4 * j + 1];
    out[(row + 8) * N + 8 * j + col] = d[4 * j + 2];
    out[(row + 8) * N + 8 * j + col + 1] = d[4 * j + 3];
  }
}

// One barrier; thread 0 issues `bytes` of TMA loads (issue()), every thread waits for them.
template <typename Issue>
__device__ void load_once(uint64_t* bar, uint32_t bytes, Issue issue) {
  if (threadIdx.x == 0) {
    fij::sm90::mbar_init(bar, 1);
    fij::sm90::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    fij::sm90::mbar_expect_tx(bar, bytes);
    issue();
  }
  fij::sm90::mbar_wait(bar, 0);
}

// The double reference of a [m x n] product: C = A B^T with b_nt (B [n x k], as K in Q K^T),
// else C = A B (B [k x n], as V in P V); A [m x k], row-major; value(x) widens an element.
template <typename T, typename Value>
std::vector<double> ref_matmul(const T* a, const T* b, int m, int n, int k, bool b_nt, Value value) {
  std::vector<double> c(size_t(m) * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double acc = 0;
      for (int x = 0; x < k; ++x) acc += double(value(a[i * k + x])) * double(value(b_nt ? b[j * k + x] : b[x * n + j]));
      c[size_t(i) * n + j] = acc;
    }
  return c;
}

// max |got - ref| / max |ref|; infinite where got has a non-finite value (an unwritten NaN).
inline double max_rel_err(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num = std::fmax(num, std::fabs(got[i] - ref[i]));
    den = std::fmax(den, std::fabs(ref[i]));
  }
  return num / den;
}

// A probe's issue rate: launch(blocks, reps) runs `reps` rounds on `blocks` blocks (two an SM),
// timed by CUDA events after a warm-up of 16 rounds; prints "<name>_tflops" (flops a block and
// round) and "<name>_blocks". 0, or 2 on a CUDA error.
template <typename Launch>
int report_rate(const char* name, Launch launch, double flops_a_block_round) {
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int blocks = 2 * sms, reps = 4096;
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  launch(blocks, 16);  // warm-up
  CHECK_CUDA(cudaEventRecord(e0));
  launch(blocks, reps);
  CHECK_CUDA(cudaEventRecord(e1));
  CHECK_CUDA(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  std::printf("%s_tflops %.1f\n", name, double(blocks) * reps * flops_a_block_round / (ms * 1e-3) / 1e12);
  std::printf("%s_blocks %d\n", name, blocks);
  return 0;
}

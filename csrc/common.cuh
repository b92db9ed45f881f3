// Device-side basics shared by every kernel: dtype traits, 16-byte vectors, launch
// error reporting. CUDA headers only; never torch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#define FIJ_DEVICE __device__ __forceinline__
#define FIJ_HOST_DEVICE __host__ __device__ __forceinline__

namespace fij {

// 16 bytes: the widest single load/store a thread issues (LDG.128 / STG.128).
using Vec16 = uint4;

template <typename T>
struct VecTraits {
  static constexpr int kElems = 16 / sizeof(T);
};

template <typename T>
FIJ_DEVICE Vec16 load_vec16(const T* ptr) {
  return *reinterpret_cast<const Vec16*>(ptr);
}

// Inputs read exactly once: stream them past L1/L2 so the cache keeps what is reused.
template <typename T>
FIJ_DEVICE Vec16 load_vec16_streaming(const T* ptr) {
  return __ldcs(reinterpret_cast<const Vec16*>(ptr));
}

template <typename T>
FIJ_DEVICE void store_vec16(T* ptr, const Vec16& v) {
  *reinterpret_cast<Vec16*>(ptr) = v;
}

FIJ_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Multiprocessors of the current device, read once per device.
inline int num_sms() {
  static int cached[64] = {0};
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= 64) device = 0;
  if (cached[device] == 0) {
    cudaDeviceGetAttribute(&cached[device], cudaDevAttrMultiProcessorCount, device);
  }
  return cached[device] > 0 ? cached[device] : 1;
}

// The launchers return cudaError_t as an int so the host binding needs no CUDA header.
inline int last_launch_error() { return static_cast<int>(cudaGetLastError()); }

}  // namespace fij

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
// A C entry point of a module (modules build with hidden visibility), for ctypes.
#define FIJ_EXPORT extern "C" __attribute__((visibility("default")))

namespace fij {

// 16 bytes: the widest single load/store a thread issues (LDG.128 / STG.128).
using Vec16 = uint4;

// The query type a kernel's traits take: q's element type, which is also the output's
// (fp16, bf16), or QueryOut<fp8 type, 16-bit type> for an fp8 q (decode), which is widened
// to fp16 where it is loaded and writes the 16-bit output type. QueryTypes reads either.
template <typename TQ, typename TO>
struct QueryOut {};
template <typename T>
struct QueryTypes {
  using Q = T;
  using O = T;
};
template <typename TQ, typename TO>
struct QueryTypes<QueryOut<TQ, TO>> {
  using Q = TQ;
  using O = TO;
};

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

// Eight elements at ptr as floats: 16 bytes of a 16-bit type, or 8 bytes of fp8 (exact).
template <typename T>
FIJ_DEVICE void load8_float(const T* ptr, float (&x)[8]) {
  if constexpr (sizeof(T) == 2) {
    const Vec16 raw = load_vec16(ptr);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = static_cast<float>(v[i]);
  } else {  // fp8: 8 bytes
    const uint2 raw = *reinterpret_cast<const uint2*>(ptr);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = static_cast<float>(v[i]);
  }
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

// Makes `device` current for the scope and restores the caller's device after it: the C
// entry points ctypes calls launch on the device their plan was made for, whichever device
// the calling thread has current (several GPUs in one process).
class DeviceScope {
 public:
  explicit DeviceScope(int device) : device_(device) {
    cudaGetDevice(&previous_);
    if (previous_ != device_) cudaSetDevice(device_);
  }
  ~DeviceScope() {
    if (previous_ != device_ && previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int device_;
  int previous_ = -1;
};

// The launchers return cudaError_t as an int so the host binding needs no CUDA header.
inline int last_launch_error() { return static_cast<int>(cudaGetLastError()); }

// --- asynchronous copies (sm_80+) -----------------------------------------------------------
// The shared-memory address of a generic pointer into shared memory (what the shared-state
// space's instructions take; kernels that step through a tile keep it in a register).
FIJ_DEVICE uint32_t smem_u32(const void* ptr) { return static_cast<uint32_t>(__cvta_generic_to_shared(ptr)); }
// 16 bytes global -> shared, bypassing L1; valid false writes 16 zero bytes (src unread).
FIJ_DEVICE void cp_async_16(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0));
}
FIJ_DEVICE void cp_async_16(void* smem, const void* gmem, bool valid) { cp_async_16(smem_u32(smem), gmem, valid); }
// Brings `bytes` (a multiple of 16, 16-byte aligned) at gmem into L2 without waiting: one
// bulk request on sm_90+, one per 128-byte line before.
FIJ_DEVICE void prefetch_l2(const void* gmem, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(gmem), "r"(bytes) : "memory");
#else
  for (int off = 0; off < bytes; off += 128)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(static_cast<const char*>(gmem) + off));
#endif
}
FIJ_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N committed groups of this thread are still in flight.
template <int N>
FIJ_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// --- one-instruction math (MUFU) ---------------------------------------------------------------
// 2^x, flushing subnormals to zero (the softmax's exponents never need them)
FIJ_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// 1 / x and log2(x) for a normal x > 0, within 2 ulp
FIJ_DEVICE float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
FIJ_DEVICE float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// --- atomics -------------------------------------------------------------------------------
// *addr += v at GPU scope with acquire-release semantics (sm_70+); returns the old value.
// Release: what this thread (and, through a block barrier before it, its block) wrote is
// visible to whoever acquires a later value; acquire: the same, the other way.
FIJ_DEVICE int atomic_add_acq_rel(int* addr, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(addr), "r"(v) : "memory");
  return old;
}

// --- thread-block clusters (sm_90+) --------------------------------------------------------
// A block's rank in its cluster; the address of `smem` (this block's shared memory) in block
// `rank`'s shared memory, and stores there; the cluster barrier in its two halves: every
// thread of every block arrives (release: its earlier stores, remote ones included, are
// visible to the threads that return from the wait after it; relaxed: no ordering, as at the
// start, where it only tells that the block runs) and later waits (acquire). A block may
// write another's shared memory only after a barrier phase that both arrived at: before
// it, the other block may not have started. Never called before sm_90 (plan() asks for
// clusters only there); the fallbacks keep older targets compiling.
FIJ_DEVICE unsigned cluster_ctarank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}
FIJ_DEVICE unsigned map_shared_rank(const void* smem, unsigned rank) {
  unsigned r = static_cast<unsigned>(__cvta_generic_to_shared(smem));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %0, %1;\n" : "+r"(r) : "r"(rank));
#endif
  return r;
}
FIJ_DEVICE void st_cluster_f32x4(unsigned addr, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#endif
}
FIJ_DEVICE void st_cluster_f32(unsigned addr, float a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(addr), "f"(a) : "memory");
#endif
}
FIJ_DEVICE void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}
FIJ_DEVICE void cluster_arrive_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
FIJ_DEVICE void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

// n / d and n % d for 0 <= n < 2^31 and d >= 1 by a multiply-high, with magic =
// (2^32 - 1) / d (computed once, by the host): the product's high word is the quotient or one short
// (n (2^32 - 1) / d / 2^32 > n / d - 1 for n < 2^31), and one compare corrects it. A
// handful of instructions instead of a runtime division's twenty.
struct DivMod {
  int quot, rem;
};
FIJ_DEVICE DivMod divmod(int n, int d, uint32_t magic) {
  int q = static_cast<int>(__umulhi(static_cast<uint32_t>(n), magic));
  int r = n - q * d;
  if (r >= d) {
    ++q;
    r -= d;
  }
  return {q, r};
}

// --- programmatic dependent launch (sm_90+) -------------------------------------------------
// A kernel launched with launch_kernel(..., pdl = true) may start while the kernel before it
// in the stream is finishing. pdl_wait() returns once that kernel has completed and its
// writes are visible: nothing it may have written is read, and nothing is written, before
// it. pdl_trigger() lets the next such kernel start launching. Both are no-ops for a
// kernel launched without the attribute (and before sm_90).
FIJ_DEVICE void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
FIJ_DEVICE void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// --- how a block function meets the kernel that runs it --------------------------------------
// A family's block function (decode_mma_block, decode_cuda_core_block, prefill_block) does
// one work item and assumes nothing of the grid around it: the same block runs under its
// family's own thin kernel, one item a block, or inside POD's kernel beside the other
// family's blocks. What depends on the grid comes from a launch object the kernel hands it:
//   wait_for_inputs()  the block calls it before it reads q, K/V or writes anything
//                      (only the plan's work list and the page table are read before);
//   release_next()     the block calls it where the next kernel's blocks may start launching;
//   prefetch           whether the block may bring its K/V into L2 before the wait, as its
//                      share of a budget that its item's blocks and the other items' share
//                      (the kernel before still runs: a dependent launch of the family's own
//                      grid only).
//   thread(), sync()   the block's thread index and its barrier (decode_mma_block): the CUDA
//                      block's, or a warpgroup's where the block is a "virtual" one.
// StreamLaunch is a family's own kernel, launched after the kernel before it in the stream
// (programmatic dependent launch where asked: pdl_wait / pdl_trigger). A kernel that has
// waited once at its start for all its blocks (POD) hands a launch whose calls do nothing.
// WarpgroupLaunch runs a 128-thread block function on one warpgroup of a larger block (POD on
// Hopper: csrc/pod/pod_sm90.cuh), with its own named barrier.
struct StreamLaunch {
  bool prefetch = false;
  FIJ_DEVICE void wait_for_inputs() const { pdl_wait(); }
  FIJ_DEVICE void release_next() const { pdl_trigger(); }
  FIJ_DEVICE int thread() const { return static_cast<int>(threadIdx.x); }
  FIJ_DEVICE void sync() const { __syncthreads(); }
};
struct InsideLaunch {
  static constexpr bool prefetch = false;
  FIJ_DEVICE void wait_for_inputs() const {}
  FIJ_DEVICE void release_next() const {}
  FIJ_DEVICE int thread() const { return static_cast<int>(threadIdx.x); }
  FIJ_DEVICE void sync() const { __syncthreads(); }
};
struct WarpgroupLaunch {
  static constexpr bool prefetch = false;
  int warpgroup;  // threads [128 warpgroup, 128 warpgroup + 128) of the CUDA block
  int barrier;    // a named barrier (1-15) no other code of the kernel uses at the same time
  FIJ_DEVICE void wait_for_inputs() const {}
  FIJ_DEVICE void release_next() const {}
  FIJ_DEVICE int thread() const { return static_cast<int>(threadIdx.x) - 128 * warpgroup; }
  FIJ_DEVICE void sync() const { asm volatile("bar.sync %0, 128;" ::"r"(barrier) : "memory"); }
};

// cudaFuncSetAttribute(Kernel, Attr, value) once per device and kernel: it costs ~1 us of
// host time per call.
template <auto* Kernel, cudaFuncAttribute Attr>
inline int set_attribute_once(int value) {
  static bool granted[64] = {};
  int device = 0;
  cudaGetDevice(&device);
  const bool known = device >= 0 && device < 64;
  if (known && granted[device]) return 0;
  const cudaError_t err = cudaFuncSetAttribute(Kernel, Attr, value);
  if (err == cudaSuccess && known) granted[device] = true;
  return static_cast<int>(err);
}

// Lets Kernel use `bytes` of dynamic shared memory (above 48 KB it must be asked for).
template <auto* Kernel>
inline int allow_dynamic_smem(int bytes) {
  return bytes <= 48 * 1024 ? 0 : set_attribute_once<Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize>(bytes);
}

// Lets Kernel run in clusters of more than 8 blocks (the H100 takes up to 16, a
// non-portable size).
template <auto* Kernel>
inline int allow_cluster_size(int blocks) {
  return blocks <= 8 ? 0 : set_attribute_once<Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed>(1);
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent
// launch when pdl (the kernel must call pdl_wait() before touching what earlier kernels
// write). Returns the launch's cudaError_t as an int.
// cluster_y > 1: the grid's blocks form clusters of (1, cluster_y, 1) (over 8 needs the
// kernel's non-portable cluster size allowed: allow_cluster_size).
template <typename... Params, typename... Args>
inline int launch_kernel_ex(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, cudaStream_t stream, bool pdl,
                            int cluster_y, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  config.attrs = attr;
  if (pdl) {
    attr[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[config.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_y > 1) {
    attr[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attr[config.numAttrs].val.clusterDim.x = 1;
    attr[config.numAttrs].val.clusterDim.y = static_cast<unsigned>(cluster_y);
    attr[config.numAttrs++].val.clusterDim.z = 1;
  }
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  return static_cast<int>(err != cudaSuccess ? err : cudaGetLastError());
}

template <typename... Params, typename... Args>
inline int launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, cudaStream_t stream, bool pdl,
                         Args&&... args) {
  return launch_kernel_ex(kernel, grid, block, smem, stream, pdl, 1, std::forward<Args>(args)...);
}

}  // namespace fij

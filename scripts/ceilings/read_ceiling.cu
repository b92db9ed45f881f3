// Read-bandwidth ceilings for decode: how fast can a kernel only *read* a buffer the size
// of a decode's KV cache (nothing written back), with each of the ways a decode kernel can
// issue its loads? Decode reads K/V once and writes almost nothing, so its ceiling is a
// read stream, not the copy (read + write) that bench_common.copy_bandwidth measures.
//
// Built and run by scripts/bench_read_ceiling.py (nvcc -arch=sm_90a). Prints one JSON
// object on stdout. Every kernel folds the bytes it reads into a value that decides a
// (never taken) store, so no load can be dropped.
//
// Timing: a CUDA graph of `inner` launches, each reading the next of `sets` buffers
// (sets x size >= 4x L2, so every launch reads DRAM), replayed after a warm-up; the figure
// is the median over replays of (replay time / inner), as bench_decode times run().
#include <cuda_runtime.h>

#include "hopper/tma_host.h"  // (csrc/: the TMA maps of the units rows)

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

enum Hint { kNone = 0, kL2_128 = 1, kL2_256 = 2 };

template <int H>
__device__ __forceinline__ int4 ldg16(const int4* p) {
  int4 v;
  if constexpr (H == kL2_256)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if constexpr (H == kL2_128)
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ unsigned fold(int4 v) { return unsigned(v.x ^ v.y ^ v.z ^ v.w); }

__device__ __forceinline__ void sink_if(unsigned acc, unsigned* sink) {
  if (acc == 0x9E3779B9u) atomicAdd(sink, 1u);  // data is random: (almost) never taken
}

// Each block reads one contiguous chunk (as a split decode block reads its chunk), its
// threads U 16-byte loads in flight each, a warp's loads coalesced.
template <int U, int H>
__global__ void read_chunk_ldg(const int4* __restrict__ base, size_t chunk16, unsigned* sink) {
  const int4* p = base + size_t(blockIdx.x) * chunk16;
  unsigned acc = 0;
  const size_t step = size_t(blockDim.x) * U;
  size_t i = threadIdx.x;
  for (; i + (U - 1) * blockDim.x < chunk16; i += step) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ldg16<H>(p + i + size_t(u) * blockDim.x);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= fold(v[u]);
  }
  for (; i < chunk16; i += blockDim.x) acc ^= fold(ldg16<H>(p + i));
  sink_if(acc, sink);
}

// Grid-stride: consecutive blocks read consecutive pieces (the whole grid sweeps the
// buffer front to back, as a large-batch decode's many requests roughly do).
template <int U, int H>
__global__ void read_stride_ldg(const int4* __restrict__ p, size_t n16, unsigned* sink) {
  unsigned acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < n16; i += U * stride) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ldg16<H>(p + i + size_t(u) * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= fold(v[u]);
  }
  for (; i < n16; i += stride) acc ^= fold(ldg16<H>(p + i));
  sink_if(acc, sink);
}

// cp.async 16 B a thread into S shared-memory stages of `stage` bytes (the decode kernel's
// path: 16-byte cp.async, 3 stages of 16 KB a block), chunked per block.
template <int S, int H, bool Pdl = false>
__global__ void read_chunk_cpasync(const char* __restrict__ base, size_t chunk, int stage, unsigned* sink) {
  extern __shared__ __align__(16) char smem[];
  if constexpr (Pdl) {  // as the decode kernel: wait for the kernel before, then let the next one launch
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
  const char* p = base + size_t(blockIdx.x) * chunk;
  const int tiles = int(chunk / stage);
  const int per_thread = stage / 16 / blockDim.x;
  auto issue = [&](int t) {
    if (t < tiles) {
      char* dst = smem + (t % S) * stage;
      for (int j = 0; j < per_thread; ++j) {
        const int off = (j * blockDim.x + threadIdx.x) * 16;
        const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst + off));
        if constexpr (H == kL2_256)
          asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(p + size_t(t) * stage + off));
        else if constexpr (H == kL2_128)
          asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(d), "l"(p + size_t(t) * stage + off));
        else
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(p + size_t(t) * stage + off));
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  for (int t = 0; t < S - 1; ++t) issue(t);
  unsigned acc = 0;
  for (int t = 0; t < tiles; ++t) {
    issue(t + S - 1);
    asm volatile("cp.async.wait_group %0;" ::"n"(S - 1));
    // each thread reads back what it copied (the decode's warps read their own rows)
    const char* src = smem + (t % S) * stage;
    for (int j = 0; j < per_thread; ++j)
      acc ^= fold(*reinterpret_cast<const int4*>(src + (j * blockDim.x + threadIdx.x) * 16));
  }
  sink_if(acc, sink);
}

// The paged rows' blocks: which SM each ran on (when smids is given), and the tiles
// [t0, t0 + tiles) of its head's head_tiles that block `chunk` of per_group takes, split as
// evenly as whole tiles allow (chunks differ by one tile at most).
__device__ __forceinline__ void record_sm(int* smids) {
  if (smids != nullptr && threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    smids[blockIdx.x] = int(sm);
  }
}
__device__ __forceinline__ int2 chunk_tiles(int chunk, int head_tiles, int per_group) {
  const int t0 = int(int64_t(chunk) * head_tiles / per_group), t1 = int(int64_t(chunk + 1) * head_tiles / per_group);
  return make_int2(t0, t1 - t0);
}

// The decode's own access pattern: K and V caches of `pages` pages x 16 tokens x 8 heads x
// 128 dims (16-bit, NHD; a token's head rows 256 bytes apart), each block reading its heads'
// rows ([hpb] adjacent heads: hpb x 256 contiguous bytes a token) of a chunk of tokens, a
// tile of 16 KB of K and 16 KB of V a stage, as the cluster split's 8-warp kernel does
// (its warps copy 16 bytes a lane with cp.async, S stages, one wait a tile). The physical
// page of logical page l: Ids 0: l (pages in order), 1: an odd multiple of l mod pages (a
// fixed scramble, nothing read), 2: table[l] read through ld.global.nc one tile ahead (the
// decode's lookups), 3: the chunk's table entries copied into shared memory before the
// wait (while the kernel before runs), then read from there; table holding the same
// scramble (or another: locality_rows), 4: scrambled within 2 MB windows (64 pages of 32
// KB), nothing read. Each head's tiles are split over its blocks as evenly as whole tiles
// allow.
template <int S, int Ids, int Half = 16384>
__global__ void read_paged_cpasync(const char* __restrict__ k, const char* __restrict__ v, const int* __restrict__ table,
                                   int pages, int hpb, int head_tiles, unsigned* sink, int* smids) {
  extern __shared__ __align__(16) char smem[];
  if constexpr (Ids != 3) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
  constexpr int kTokenBytes = 8 * 256, kPageBytes = 16 * kTokenBytes, kHalf = Half;
  const int groups = 8 / hpb;
  const int per_group = gridDim.x / groups;
  const int group = blockIdx.x / per_group, chunk = blockIdx.x % per_group;
  const int row_bytes = 256 * hpb, row_chunks = row_bytes / 16;
  const int tile_tokens = kHalf / row_bytes;
  const int2 range = chunk_tiles(chunk, head_tiles, per_group);
  const int tok0 = range.x * tile_tokens, tiles = range.y;
  record_sm(smids);
  const size_t head_off = size_t(group) * row_bytes;
  constexpr int kPer = kHalf / 16 / 256;  // 16-byte copies a thread, K and V each (256 threads)
  // Ids 3: the chunk's page ids into shared memory (after the stages) before the wait,
  // while the kernel before still runs (the page table is an input no kernel before writes)
  int* chunk_ids = reinterpret_cast<int*>(smem + S * 2 * kHalf);
  const int page0 = tok0 / 16;
  if constexpr (Ids == 3) {
    const int n = (tiles * tile_tokens + 15) / 16;
    for (int i = threadIdx.x; i < n; i += blockDim.x) chunk_ids[i] = __ldg(table + page0 + i);
    __syncthreads();
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
  auto phys = [&](int logical) {
    if constexpr (Ids == 0) return logical;
    else if constexpr (Ids == 1) return (logical * 1031 + 7) & (pages - 1);
    else if constexpr (Ids == 4) return (logical & ~63) | ((logical * 37 + 5) & 63);  // scrambled within 2 MB
    else if constexpr (Ids == 2) return __ldg(table + logical);
    else return chunk_ids[logical - page0];
  };
  int ids[kPer], next[kPer];
  auto lookup = [&](int t, int* out) {
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int q = threadIdx.x + 256 * u;
      const int j = tok0 + t * tile_tokens + q / row_chunks;
      out[u] = t < tiles ? phys(j >> 4) : 0;
    }
  };
  auto issue = [&](int t, const int* pg) {
    if (t < tiles) {
      char* dst = smem + (t % S) * 2 * kHalf;
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int q = threadIdx.x + 256 * u;
        const int j = tok0 + t * tile_tokens + q / row_chunks;
        const size_t off = size_t(pg[u]) * kPageBytes + (j & 15) * kTokenBytes + head_off + (q % row_chunks) * 16;
        const unsigned dk = static_cast<unsigned>(__cvta_generic_to_shared(dst + q * 16));
        const unsigned dv = static_cast<unsigned>(__cvta_generic_to_shared(dst + kHalf + q * 16));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dk), "l"(k + off));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dv), "l"(v + off));
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  for (int t = 0; t < S - 1; ++t) {
    lookup(t, ids);
    issue(t, ids);
  }
  lookup(S - 1, next);
  unsigned acc = 0;
  for (int t = 0; t < tiles; ++t) {
#pragma unroll
    for (int u = 0; u < kPer; ++u) ids[u] = next[u];
    lookup(t + S, next);
    issue(t + S - 1, ids);
    asm volatile("cp.async.wait_group %0;" ::"n"(S - 1));
    const char* src = smem + (t % S) * 2 * kHalf;
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int q = threadIdx.x + 256 * u;
      acc ^= fold(*reinterpret_cast<const int4*>(src + q * 16)) ^ fold(*reinterpret_cast<const int4*>(src + kHalf + q * 16));
    }
  }
  sink_if(acc, sink);
}

// The bulk copy engine (cp.async.bulk, 1-D, no tensor map), completing on an mbarrier per
// stage; one thread issues, every thread waits for the stage's bytes, reads them, and a
// block barrier frees the stage.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "r"(bytes));
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned phase) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile(
      "{\n .reg .pred P;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
      " @!P bra WAIT_%=;\n}\n" ::"r"(a), "r"(phase));
}
template <int S>
__global__ void read_chunk_bulk(const char* __restrict__ base, size_t chunk, int stage, unsigned* sink) {
  extern __shared__ __align__(128) char bulk_smem[];
  char* smem = bulk_smem;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + S * stage);
  const char* p = base + size_t(blockIdx.x) * chunk;
  const int tiles = int(chunk / stage);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(&bars[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  auto issue = [&](int t) {
    if (threadIdx.x == 0 && t < tiles) {
      uint64_t* bar = &bars[t % S];
      mbar_expect_tx(bar, stage);
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
              static_cast<unsigned>(__cvta_generic_to_shared(smem + (t % S) * stage))),
          "l"(p + size_t(t) * stage), "r"(stage), "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar)))
          : "memory");
    }
  };
  for (int t = 0; t < S; ++t) issue(t);
  unsigned acc = 0;
  const int per_thread = stage / 16 / blockDim.x;
  for (int t = 0; t < tiles; ++t) {
    mbar_wait(&bars[t % S], (t / S) & 1);
    const char* src = smem + (t % S) * stage;
    for (int j = 0; j < per_thread; ++j)
      acc ^= fold(*reinterpret_cast<const int4*>(src + (j * blockDim.x + threadIdx.x) * 16));
    __syncthreads();
    issue(t + S);
  }
  sink_if(acc, sink);
}

// The decode's paged pattern (one head a block, 64 blocks of 8 warps in clusters of 8, as
// read_paged_cpasync with hpb 1) through the bulk copy engine: each warp's 8 token rows of
// K and of V a tile (256 bytes each) as 16 one-dimensional bulk copies (one a lane, lanes
// 0-15), completing on an mbarrier of the warp's for the stage, rows 272 bytes apart in
// shared memory (a stride that keeps ldmatrix's 8-row phases on distinct banks without a
// swizzle, which a bulk copy cannot apply). A warp waits for its own barrier only, as the
// kernel's warps wait for their own cp.async groups. Ids as read_paged_cpasync (0, 2, 3).
constexpr int kBulkRowStride = 272;                                // bytes between rows in shared memory
constexpr int kBulkWarpBytes = 2 * 8 * kBulkRowStride;             // a warp's 8 K and 8 V rows
constexpr int kBulkStageBytes = 8 * kBulkWarpBytes;                // 8 warps
template <int S, int Ids>
__global__ void read_paged_bulk(const char* __restrict__ k, const char* __restrict__ v, const int* __restrict__ table,
                                int pages, int head_tiles, unsigned* sink, int* smids) {
  extern __shared__ __align__(128) char smem[];
  constexpr int kTokenBytes = 8 * 256, kPageBytes = 16 * kTokenBytes, kTileTokens = 64;
  constexpr int kStride = kBulkRowStride, kWarpBytes = kBulkWarpBytes, kStage = kBulkStageBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + S * kStage);  // [warp][stage]
  int* chunk_ids = reinterpret_cast<int*>(bars + 8 * S);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int per_group = gridDim.x / 8;
  const int group = blockIdx.x / per_group, chunk = blockIdx.x % per_group;
  const int2 range = chunk_tiles(chunk, head_tiles, per_group);
  const int tok0 = range.x * kTileTokens, tiles = range.y, page0 = tok0 / 16;
  record_sm(smids);
  if (lane == 0) {
    for (int s = 0; s < S; ++s) mbar_init(&bars[warp * S + s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  if constexpr (Ids == 3) {
    for (int i = threadIdx.x; i < tiles * kTileTokens / 16; i += blockDim.x) chunk_ids[i] = __ldg(table + page0 + i);
  }
  __syncthreads();
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
  const size_t head_off = size_t(group) * 256;
  const int r = lane & 7;
  const char* src_base = (lane & 8 ? v : k) + head_off;
  auto phys = [&](int logical) {
    if constexpr (Ids == 0) return logical;
    else if constexpr (Ids == 2) return __ldg(table + logical);
    else return chunk_ids[logical - page0];
  };
  auto lookup = [&](int t) {  // this lane's row of tile t: its page
    const int j = tok0 + t * kTileTokens + warp * 8 + r;
    return t < tiles ? phys(j >> 4) : 0;
  };
  auto issue = [&](int t, int pg) {
    if (t < tiles) {
      const int s = t % S;
      uint64_t* bar = &bars[warp * S + s];
      if (lane == 0) mbar_expect_tx(bar, 16 * 256);
      __syncwarp();
      if (lane < 16) {
        const int j = tok0 + t * kTileTokens + warp * 8 + r;
        const char* src = src_base + size_t(pg) * kPageBytes + (j & 15) * kTokenBytes;
        char* dst = smem + s * kStage + warp * kWarpBytes + (lane >> 3) * 8 * kStride + r * kStride;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 256, [%2];" ::"r"(
                static_cast<unsigned>(__cvta_generic_to_shared(dst))),
            "l"(src), "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar)))
            : "memory");
      }
    }
  };
  for (int t = 0; t < S - 1; ++t) issue(t, lookup(t));
  int next = lookup(S - 1);
  unsigned acc = 0;
  for (int t = 0; t < tiles; ++t) {
    const int cur = next;
    next = lookup(t + S);
    __syncwarp();  // every lane is done with the stage refilled now (tile t - 1's)
    issue(t + S - 1, cur);
    mbar_wait(&bars[warp * S + t % S], (t / S) & 1);
    const char* src = smem + (t % S) * kStage + warp * kWarpBytes;
#pragma unroll
    for (int u = 0; u < 8; ++u) {  // 16 rows x 256 bytes, a lane 16 bytes of every other row
      const int row = 2 * u + (lane >> 4), col = (lane & 15) * 16;
      acc ^= fold(*reinterpret_cast<const int4*>(src + row * kStride + col));
    }
  }
  sink_if(acc, sink);
}


// One group of the decode's paged pattern into a 4 KB stage: 8 rows of one head, K's (2 KB) then
// V's, rows 2 KB apart from `base`, a warp's 16-byte cp.async (two rows a pass, four passes).
__device__ __forceinline__ void copy_group(char* dst, const char* k, const char* v, size_t base, int lane) {
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int r = lane / 16 + 2 * u, c = lane % 16;
    const size_t off = base + r * 2048 + c * 16;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst + r * 256 + c * 16))), "l"(k + off));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst + 2048 + r * 256 + c * 16))), "l"(v + off));
  }
}

// POD on Hopper's decode units (csrc/pod/pod_sm90.cuh): one block an SM of 12 warps, each warp
// on its own (head, 8-token half page) groups of the decode's paged pattern (NHD pages of 16
// tokens x 8 heads x 256 bytes, scrambled), S stages of the group's K and V rows (4 KB) a
// warp, each waiting for its own copies only; a block's warps take groups grid-stride.
// Copy 0: 16-byte cp.async, a lane a chunk (the decode block's); 1: a 256-byte bulk copy a
// row (lanes 0-15), on an mbarrier a warp and stage; 2: TMA boxes of 8 rows x 64 dims (1 KB,
// 128-byte swizzle) of a 3-D map (dim, head, token), four a group, issued by lane 0.
constexpr int kUnitWarps = 12;
template <int Copy>
__host__ __device__ constexpr int unit_stage_bytes() { return Copy == 1 ? 16 * 272 : 4096; }
template <int Copy, int S>
__global__ void __launch_bounds__(32 * kUnitWarps, 1)
    read_units(const char* __restrict__ k, const char* __restrict__ v, const __grid_constant__ CUtensorMap k_map,
               const __grid_constant__ CUtensorMap v_map, int pages, int per_warp, unsigned* sink) {
  extern __shared__ __align__(1024) char smem[];
  constexpr int kStage = unit_stage_bytes<Copy>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  char* stages = smem + warp * S * kStage;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + kUnitWarps * S * kStage) + warp * S;
  const int warps = gridDim.x * kUnitWarps, wid = blockIdx.x * kUnitWarps + warp;
  if (Copy != 0 && lane == 0) {
    for (int s = 0; s < S; ++s) mbar_init(&bars[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncwarp();
  auto group = [&](int i, int& page, int& token0, int& head) {  // warp's i-th group
    const int g = wid + i * warps;
    head = g & 7;
    const int lp = (g >> 3) >> 1;
    page = (lp * 1031 + 7) & (pages - 1);
    token0 = ((g >> 3) & 1) * 8;
  };
  auto issue = [&](int i) {
    if (i >= per_warp) {
      if (Copy == 0) asm volatile("cp.async.commit_group;");
      return;
    }
    const int s = i % S;
    char* dst = stages + s * kStage;
    int page, token0, head;
    group(i, page, token0, head);
    const size_t base = size_t(page) * 32768 + size_t(token0) * 2048 + head * 256;
    if constexpr (Copy == 0) {
      copy_group(dst, k, v, base, lane);
      asm volatile("cp.async.commit_group;");
    } else if constexpr (Copy == 1) {
      if (lane == 0) mbar_expect_tx(&bars[s], 4096);
      __syncwarp();
      if (lane < 16) {
        const int r = lane & 7;
        const char* src = (lane & 8 ? v : k) + base + r * 2048;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 256, [%2];" ::"r"(
                         static_cast<unsigned>(__cvta_generic_to_shared(dst + (lane >> 3) * 8 * 272 + r * 272))),
                     "l"(src), "r"(static_cast<unsigned>(__cvta_generic_to_shared(&bars[s])))
                     : "memory");
      }
    } else {
      if (lane == 0) {
        mbar_expect_tx(&bars[s], 4096);
        const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&bars[s]));
        const int token = page * 16 + token0;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const CUtensorMap* map = q < 2 ? &k_map : &v_map;
          asm volatile(
              "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(
                  static_cast<unsigned>(__cvta_generic_to_shared(dst + q * 1024))),
              "l"(map), "r"(bar), "r"((q & 1) * 64), "r"(head), "r"(token)
              : "memory");
        }
      }
    }
  };
  for (int i = 0; i < S - 1; ++i) issue(i);
  unsigned acc = 0;
  for (int i = 0; i < per_warp; ++i) {
    if constexpr (Copy == 0) {
      asm volatile("cp.async.wait_group %0;" ::"n"(S - 2));
    } else {
      mbar_wait(&bars[i % S], (i / S) & 1);
    }
    __syncwarp();
    issue(i + S - 1);
    const char* src = stages + (i % S) * kStage;
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= fold(*reinterpret_cast<const int4*>(src + (u * 32 + lane) * 16));
  }
  if constexpr (Copy == 0) asm volatile("cp.async.wait_group 0;");
  sink_if(acc, sink);
}

// POD on Hopper's split, probed: one block of 12 warps on every SM; role[] (by the block's SM
// id, or by blockIdx where by_smid is 0) says what the block does: 0 nothing, 1 stream (each
// warp 16-byte cp.async of the units' pattern, 4 stages of 4 KB, whole pages taken from
// counters[0]), 2 prefetch into L2 (lane 0 of warp 0 issues cp.async.bulk.prefetch.L2 of the
// next page's K and V, 32 KB each, taken from counters[1], at most `ahead` pages past the
// streams' counter). Which SM a block ran on goes to smids[blockIdx].
__global__ void __launch_bounds__(32 * kUnitWarps, 1)
    read_select(const char* __restrict__ k, const char* __restrict__ v, const unsigned char* __restrict__ role,
                int by_smid, int pages, int ahead, int* counters, int* smids, unsigned* sink, int unit_pages = 1,
                int unit_heads = 8) {
  extern __shared__ __align__(1024) char smem[];
  constexpr int S = 4, kStage = 4096;
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  if (threadIdx.x == 0) smids[blockIdx.x] = int(sm);
  const int r = role[by_smid ? (sm & 255) : blockIdx.x];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto phys = [&](int lp) { return (lp * 1031 + 7) & (pages - 1); };
  if (r == 2) {
    if (threadIdx.x != 0) return;
    volatile int* streamed = counters;
    for (;;) {
      const int p = atomicAdd(counters + 1, 1);
      if (p >= pages) return;
      while (p >= *streamed + ahead) __nanosleep(200);
      const size_t off = size_t(phys(p)) * 32768;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], 32768;" ::"l"(k + off) : "memory");
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], 32768;" ::"l"(v + off) : "memory");
    }
  }
  if (r != 1) return;
  char* stages = smem + warp * S * kStage;
  // a warp's unit: unit_pages pages of unit_heads adjacent KV heads (1 x 8: a whole page), its
  // groups in (page, half, head) order
  const int H = unit_heads, P = unit_pages, per_unit = 2 * H * P, units = pages / P * (8 / H);
  int issued = 0, unit = 0;
  bool done = false;
  auto issue = [&]() {
    if (!done && issued % per_unit == 0) {
      int got = 0;
      if (lane == 0) got = atomicAdd(counters, 1);
      unit = __shfl_sync(0xffffffffu, got, 0);
      done = unit >= units;
    }
    if (!done) {
      const int g = issued % per_unit, head = (unit % (8 / H)) * H + g % H, token0 = ((g / H) % 2) * 8;
      const int page = (unit / (8 / H)) * P + g / (2 * H);
      char* dst = stages + (issued % S) * kStage;
      copy_group(dst, k, v, size_t(phys(page)) * 32768 + size_t(token0) * 2048 + head * 256, lane);
      ++issued;
    }
    asm volatile("cp.async.commit_group;");
  };
  for (int i = 0; i < S - 1; ++i) issue();
  unsigned acc = 0;
  for (int i = 0; i < issued; ++i) {
    asm volatile("cp.async.wait_group %0;" ::"n"(S - 2));
    __syncwarp();
    issue();
    const char* src = stages + (i % S) * kStage;
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= fold(*reinterpret_cast<const int4*>(src + (u * 32 + lane) * 16));
  }
  asm volatile("cp.async.wait_group 0;");
  sink_if(acc, sink);
}

// POD on Hopper's decode units, probed as units: each warpgroup (three a block) takes units
// from counters[0] as decode_mma_block does: unit u = (request u / (8 / H) of P pages, heads
// (u % (8 / H)) x H .. + H - 1), its groups (8 rows of one head: page, half, head in block)
// in that order, warp w of the warpgroup on groups w, w + 4, ... with 4 stages of 4 KB (K + V);
// each unit starts its pipeline afresh. H = 1, P = 128: the decode unit of 2048 keys of one KV
// head; H = 8: whole pages. role[blockIdx]: 1 stream, else return.
template <int H>
__global__ void __launch_bounds__(32 * kUnitWarps, 1)
    read_wg_units(const char* __restrict__ k, const char* __restrict__ v, const unsigned char* __restrict__ role,
                  int pages, int per_unit_pages, int* counters, unsigned* sink, int active_wgs = 3) {
  extern __shared__ __align__(1024) char smem[];
  __shared__ int claim[kUnitWarps / 4];
  constexpr int S = 4, kStage = 4096;
  if (role[blockIdx.x] != 1) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4, w = warp % 4;
  if (wg >= active_wgs) return;  // (a block of fewer streaming warpgroups: the others idle)
  const int P = per_unit_pages, units = pages / P * (8 / H);
  auto phys = [&](int lp) { return (lp * 1031 + 7) & (pages - 1); };
  char* stages = smem + warp * S * kStage;
  unsigned acc = 0;
  for (;;) {
    if (threadIdx.x % 128 == 0) claim[wg] = atomicAdd(counters, 1);
    asm volatile("bar.sync %0, 128;" ::"r"(1 + wg));
    const int u = claim[wg];
    if (u >= units) break;
    const int req = u / (8 / H), hb = u % (8 / H);
    const int mine = (P * 2 * H) / 4;  // this warp's groups
    auto issue = [&](int i) {
      if (i < mine) {
        const int g = w + 4 * i, hi = g % H, half = (g / H) % 2, pg = g / (2 * H);
        char* dst = stages + (i % S) * kStage;
        copy_group(dst, k, v, size_t(phys(req * P + pg)) * 32768 + size_t(half) * 8 * 2048 + (hb * H + hi) * 256,
                   lane);
      }
      asm volatile("cp.async.commit_group;");
    };
    for (int i = 0; i < S - 1; ++i) issue(i);
    for (int i = 0; i < mine; ++i) {
      asm volatile("cp.async.wait_group %0;" ::"n"(S - 2));
      __syncwarp();
      issue(i + S - 1);
      const char* src = stages + (i % S) * kStage;
#pragma unroll
      for (int q = 0; q < 8; ++q) acc ^= fold(*reinterpret_cast<const int4*>(src + (q * 32 + lane) * 16));
    }
    asm volatile("cp.async.wait_group 0;");
    asm volatile("bar.sync %0, 128;" ::"r"(1 + wg));
  }
  sink_if(acc, sink);
}

__global__ void fill(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed ^ uint32_t(i >> 32);
    x ^= x >> 15; x *= 2246822519u; x ^= x >> 13; x *= 3266489917u; x ^= x >> 16;
    p[i] = x;
  }
}

struct Ctx {
  std::vector<char*> bufs;
  size_t size = 0;
  unsigned* sink = nullptr;
  cudaStream_t stream;
  int inner = 20, warmup = 3, reps = 30;
};

template <typename Launch>
double time_graph(Ctx& c, Launch launch) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < c.inner; ++i) launch(c.bufs[i % c.bufs.size()]);
  CK(cudaStreamEndCapture(c.stream, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < c.warmup; ++i) CK(cudaGraphLaunch(ge, c.stream));
  std::vector<double> us;
  for (int r = 0; r < c.reps; ++r) {
    CK(cudaEventRecord(e0, c.stream));
    CK(cudaGraphLaunch(ge, c.stream));
    CK(cudaEventRecord(e1, c.stream));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(1000.0 * ms / c.inner);
  }
  CK(cudaGetLastError());
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// kernel<<<blocks, threads, smem, c.stream>>>(args...) through cudaLaunchKernelEx: as a
// programmatic dependent launch when pdl, in clusters of `cluster` blocks along x when > 1
// (as the decode's cluster split places them).
template <typename Kernel, typename... Args>
void launch_ex(Ctx& c, Kernel kernel, int blocks, int threads, int smem, bool pdl, int cluster, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = c.stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster;
    attr[n].val.clusterDim.y = 1;
    attr[n++].val.clusterDim.z = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

static bool first_row = true;
static void row(const char* kind, const char* variant, size_t bytes, int blocks, int threads, double us) {
  printf("%s\n    {\"kind\": \"%s\", \"variant\": \"%s\", \"bytes\": %zu, \"blocks\": %d, \"threads\": %d, "
         "\"us\": %.3f, \"gbps\": %.1f}",
         first_row ? "" : ",", kind, variant, bytes, blocks, threads, us, bytes / us / 1e3);
  first_row = false;
  fflush(stdout);
}

// Whether `blocks` equal chunks of c.size split into whole stages of whole 16-byte passes
// of `threads`; says so on stderr when not (the row is left out).
static bool chunks_fit(const Ctx& c, int blocks, int threads, int stage, const char* name) {
  const bool fit = c.size % (size_t(blocks) * stage) == 0 && stage % (16 * threads) == 0;
  if (!fit) fprintf(stderr, "read_ceiling: %s left out: %zu bytes do not split into %d x %d-byte stages\n", name,
                    c.size, blocks, stage);
  return fit;
}

template <int U, int H>
void run_ldg(Ctx& c, int blocks, int threads, bool chunked, const char* name) {
  const size_t n16 = c.size / 16;
  double us;
  if (chunked) {
    if (!chunks_fit(c, blocks, threads, 16 * threads, name)) return;
    const size_t chunk16 = n16 / blocks;
    us = time_graph(c, [&](char* b) {
      read_chunk_ldg<U, H><<<blocks, threads, 0, c.stream>>>(reinterpret_cast<const int4*>(b), chunk16, c.sink);
    });
  } else {
    us = time_graph(c, [&](char* b) {
      read_stride_ldg<U, H><<<blocks, threads, 0, c.stream>>>(reinterpret_cast<const int4*>(b), n16, c.sink);
    });
  }
  row(chunked ? "ldg_chunk" : "ldg_stride", name, c.size, blocks, threads, us);
}

template <int S, int H, bool Pdl = false>
void run_cpasync(Ctx& c, int blocks, int threads, int stage, const char* name, int cluster = 1) {
  const size_t chunk = c.size / blocks;
  if (!chunks_fit(c, blocks, threads, stage, name)) return;
  auto k = read_chunk_cpasync<S, H, Pdl>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, S * stage));
  double us = time_graph(c, [&](char* b) {
    launch_ex(c, k, blocks, threads, S * stage, Pdl, cluster, static_cast<const char*>(b), chunk, stage, c.sink);
  });
  row(Pdl ? "cpasync_chunk_pdl" : "cpasync_chunk", name, c.size, blocks, threads, us);
}

template <int S>
void run_bulk(Ctx& c, int blocks, int threads, int stage, const char* name) {
  const size_t chunk = c.size / blocks;
  if (!chunks_fit(c, blocks, threads, stage, name)) return;
  auto k = read_chunk_bulk<S>;
  const int smem = S * stage + 8 * S;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  double us = time_graph(c, [&](char* b) { k<<<blocks, threads, smem, c.stream>>>(b, chunk, stage, c.sink); });
  row("bulk_chunk", name, c.size, blocks, threads, us);
}

// A paged row's time, and where its last launch's blocks ran: on how many SMs, at most how
// many blocks an SM (launch(buffer, smids) records each block's SM in smids).
struct Placed {
  double us;
  int used, most;
};
template <typename Launch>
Placed time_placed(Ctx& c, int blocks, Launch launch) {
  int* smids;
  CK(cudaMalloc(&smids, blocks * sizeof(int)));
  Placed r{time_graph(c, [&](char* b) { launch(b, smids); }), 0, 0};
  std::vector<int> host(blocks), per_sm(1024, 0);
  CK(cudaMemcpy(host.data(), smids, blocks * sizeof(int), cudaMemcpyDeviceToHost));
  CK(cudaFree(smids));
  for (int sm : host) {
    if (per_sm[sm & 1023]++ == 0) ++r.used;
    r.most = std::max(r.most, per_sm[sm & 1023]);
  }
  return r;
}

// The paged rows' page table: logical page l at (l x 1031 + 7) mod pages (the scramble that
// Ids 1 computes), each of `sorted_chunks` equal runs of it sorted when > 0. On the device.
static int* scrambled_table(int pages, int sorted_chunks = 0) {
  std::vector<int> host(pages);
  for (int l = 0; l < pages; ++l) host[l] = (l * 1031 + 7) & (pages - 1);
  for (int b = 0; b < sorted_chunks; ++b)
    std::sort(host.begin() + size_t(b) * pages / sorted_chunks, host.begin() + size_t(b + 1) * pages / sorted_chunks);
  int* table;
  CK(cudaMalloc(&table, pages * sizeof(int)));
  CK(cudaMemcpy(table, host.data(), pages * sizeof(int), cudaMemcpyHostToDevice));
  return table;
}

// The paged rows above over a buffer of c.size bytes (K its first half, V its second), 256
// threads a block in clusters of `cluster` blocks along x (8 unless given), under PDL;
// blocks = 64 (one per SM on half the SMs, as the cluster split's grid at b=1 kv=32k) or
// more. Each head's tiles are split over its blocks as evenly as whole tiles allow. The
// label gets where the last launch's blocks ran: on how many SMs, at most how many an SM.
template <int S, int Ids, int Half = 16384>
void run_paged(Ctx& c, const int* table, int hpb, int blocks, const char* name, int cluster = 8) {
  constexpr int kPageBytes = 16 * 8 * 256;
  const int pages = int(c.size / 2 / kPageBytes);
  const int per_group = blocks / (8 / hpb);
  const int tile_tokens = Half / (256 * hpb);
  const int head_tiles = pages * 16 / tile_tokens;
  if (per_group * (8 / hpb) != blocks || blocks % cluster != 0 || head_tiles < per_group ||
      (pages * 16) % tile_tokens != 0 || (pages & (pages - 1)) != 0) {
    fprintf(stderr, "read_ceiling: paged %s left out\n", name);
    return;
  }
  auto kern = read_paged_cpasync<S, Ids, Half>;
  const int max_tiles = (head_tiles + per_group - 1) / per_group;
  const int smem = S * 2 * Half + (Ids == 3 ? (max_tiles * tile_tokens + 15) / 16 * 4 : 0);
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (cluster > 8) CK(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  const Placed r = time_placed(c, blocks, [&](char* b, int* smids) {
    launch_ex(c, kern, blocks, 256, smem, true, cluster, static_cast<const char*>(b),
              static_cast<const char*>(b) + c.size / 2, table, pages, hpb, head_tiles, c.sink, smids);
  });
  char label[200];
  snprintf(label, sizeof label, "%s, %d head%s a block (%d-byte rows), clusters of %d, on %d SMs (at most %d an SM)",
           name, hpb, hpb > 1 ? "s" : "", 256 * hpb, cluster, r.used, r.most);
  row("cpasync_paged", label, c.size, blocks, 256, r.us);
}

template <int S, int Ids>
void run_paged_bulk(Ctx& c, const int* table, int blocks, const char* name) {
  constexpr int kPageBytes = 16 * 8 * 256, kTileTokens = 64;
  const int pages = int(c.size / 2 / kPageBytes);
  const int per_group = blocks / 8;
  const int head_tiles = pages * 16 / kTileTokens;
  if (per_group * 8 != blocks || head_tiles < per_group) {
    fprintf(stderr, "read_ceiling: paged bulk %s left out\n", name);
    return;
  }
  auto kern = read_paged_bulk<S, Ids>;
  const int max_tiles = (head_tiles + per_group - 1) / per_group;
  const int smem = S * kBulkStageBytes + 8 * S * 8 + max_tiles * kTileTokens / 16 * 4;  // stages, barriers, ids
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const Placed r = time_placed(c, blocks, [&](char* b, int* smids) {
    launch_ex(c, kern, blocks, 256, smem, true, 8, static_cast<const char*>(b), static_cast<const char*>(b) + c.size / 2,
              table, pages, head_tiles, c.sink, smids);
  });
  char label[200];
  snprintf(label, sizeof label, "%s, 1 head a block (256-byte rows), clusters of 8, on %d SMs (at most %d an SM)", name,
           r.used, r.most);
  row("bulk_paged", label, c.size, blocks, 256, r.us);
}

static void paged_rows(Ctx& c) {
  int* table = scrambled_table(int(c.size / 2 / (16 * 8 * 256)));
  for (int hpb : {1, 2, 8}) {
    run_paged<3, 0>(c, table, hpb, 64, "3 x 32 KB, pages in order");
    run_paged<3, 1>(c, table, hpb, 64, "3 x 32 KB, pages scrambled (computed)");
    run_paged<3, 2>(c, table, hpb, 64, "3 x 32 KB, pages scrambled (table, one tile ahead)");
    run_paged<3, 3>(c, table, hpb, 64, "3 x 32 KB, pages scrambled (table into shared memory before the wait)");
    run_paged<4, 1>(c, table, hpb, 64, "4 x 32 KB, pages scrambled (computed)");
  }
  // stage count against bytes in flight (one head a block)
  run_paged<2, 1>(c, table, 1, 64, "2 x 32 KB, pages scrambled (computed)");
  run_paged<4, 1, 8192>(c, table, 1, 64, "4 x 16 KB, pages scrambled (computed)");
  run_paged<6, 1, 8192>(c, table, 1, 64, "6 x 16 KB, pages scrambled (computed)");
  run_paged<8, 1, 8192>(c, table, 1, 64, "8 x 16 KB, pages scrambled (computed)");
  run_paged<3, 1>(c, table, 1, 128, "3 x 32 KB, pages scrambled (computed)");
  run_paged<3, 1>(c, table, 8, 128, "3 x 32 KB, pages scrambled (computed)");
  // more blocks a head in larger (non-portable) clusters: 80, 96, 112, 128 blocks
  for (int cl : {10, 12, 14, 16}) {
    run_paged<3, 1>(c, table, 1, 8 * cl, "3 x 32 KB, pages scrambled (computed)", cl);
    run_paged<3, 2>(c, table, 1, 8 * cl, "3 x 32 KB, pages scrambled (table, one tile ahead)", cl);
  }
  CK(cudaFree(table));
}

// Where scrambled pages lose against pages in order (one head a block, 64 blocks, 3 x 32 KB
// cp.async stages): pages scrambled only within 2 MB windows (64 records of 32 KB), and the
// scrambled table with each block's chunk sorted by physical page (the same pages, read
// in address order), against in order and scrambled all over; two interleaved rounds.
static void locality_rows(Ctx& c) {
  const int pages = int(c.size / 2 / (16 * 8 * 256));
  // 8 blocks a head, each a chunk of pages / 8 (whole tiles of 4 pages)
  int *table = scrambled_table(pages), *table_sorted = scrambled_table(pages, 8);
  for (int round = 0; round < 2; ++round) {
    run_paged<3, 0>(c, table, 1, 64, "3 x 32 KB, pages in order");
    run_paged<3, 1>(c, table, 1, 64, "3 x 32 KB, pages scrambled (computed)");
    run_paged<3, 4>(c, table, 1, 64, "3 x 32 KB, pages scrambled within 2 MB (computed)");
    run_paged<3, 2>(c, table, 1, 64, "3 x 32 KB, pages scrambled (table, one tile ahead)");
    run_paged<3, 2>(c, table_sorted, 1, 64, "3 x 32 KB, pages scrambled, each chunk sorted (table, one tile ahead)");
    run_paged<3, 3>(c, table, 1, 64, "3 x 32 KB, pages scrambled (table into shared memory before the wait)");
    run_paged<3, 3>(c, table_sorted, 1, 64, "3 x 32 KB, pages scrambled, each chunk sorted (table into shared memory before the wait)");
  }
  CK(cudaFree(table));
  CK(cudaFree(table_sorted));
}

// cp.async against bulk copies on the paged pattern (one head a block, 64 blocks), the
// rows interleaved over two rounds.
static void bulk_rows(Ctx& c) {
  int* table = scrambled_table(int(c.size / 2 / (16 * 8 * 256)));
  for (int round = 0; round < 2; ++round) {
    run_paged<3, 0>(c, table, 1, 64, "3 x 32 KB, pages in order");
    run_paged<3, 2>(c, table, 1, 64, "3 x 32 KB, pages scrambled (table, one tile ahead)");
    run_paged<3, 3>(c, table, 1, 64, "3 x 32 KB, pages scrambled (table into shared memory before the wait)");
    run_paged_bulk<3, 0>(c, table, 64, "3 x 32 KB, pages in order");
    run_paged_bulk<3, 2>(c, table, 64, "3 x 32 KB, pages scrambled (table, one tile ahead)");
    run_paged_bulk<3, 3>(c, table, 64, "3 x 32 KB, pages scrambled (table into shared memory before the wait)");
    run_paged_bulk<2, 3>(c, table, 64, "2 x 32 KB, pages scrambled (table into shared memory before the wait)");
  }
  CK(cudaFree(table));
}


// The units rows: each copy kind on `blocks` SMs (one block each), over a buffer of c.size
// bytes (K its first half, V its second); GB/s over the bytes the warps' whole groups read.
template <int Copy, int S>
void run_units(Ctx& c, int blocks, const char* name) {
  constexpr int kPageBytes = 16 * 8 * 256;
  const int pages = int(c.size / 2 / kPageBytes);
  const int warps = blocks * kUnitWarps, per_warp = pages * 2 * 8 / warps;
  auto kern = read_units<Copy, S>;
  const int smem = kUnitWarps * S * unit_stage_bytes<Copy>() + kUnitWarps * S * 8;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<CUtensorMap> maps;  // per buffer: K, V (dims: 128 elements, 8 heads, tokens)
  for (char* b : c.bufs) {
    for (int half = 0; half < 2; ++half) {
      const uint64_t dims[3] = {128, 8, uint64_t(pages) * 16}, strides[2] = {256, 2048};
      const uint32_t box[3] = {64, 1, 8};
      maps.push_back(fij::sm90::tensor_map_16bit(b + half * (c.size / 2), 3, dims, strides, box, true,
                                                 CU_TENSOR_MAP_SWIZZLE_128B));
    }
  }
  const double us = time_graph(c, [&](char* b) {
    int i = 0;
    while (c.bufs[i] != b) ++i;
    kern<<<blocks, 32 * kUnitWarps, smem, c.stream>>>(b, b + c.size / 2, maps[2 * i], maps[2 * i + 1], pages, per_warp,
                                                      c.sink);
  });
  char label[160];
  snprintf(label, sizeof label, "%s, %d x 4 KB stages a warp, 12 warps a block, one block an SM", name, S);
  row("units", label, size_t(per_warp) * warps * 4096, blocks, 32 * kUnitWarps, us);
}

// POD on Hopper's decode units' copies on part of the SMs: 16-byte cp.async, 256-byte bulk
// copies, 1 KB TMA boxes; two interleaved rounds.
static void units_rows(Ctx& c, int sms) {
  for (int round = 0; round < 2; ++round) {
    for (int blocks : {48, 72, 96, sms}) {
      run_units<0, 4>(c, blocks, "cp.async 16 B");
      run_units<1, 4>(c, blocks, "bulk 256 B rows");
      run_units<2, 4>(c, blocks, "TMA 1 KB boxes");
    }
  }
}

// The select rows: the units' reads on N SMs chosen four ways, the others idle or prefetching
// into L2 ahead of the streams. Roles: by blockIdx (POD on Hopper's split: blocks >= sms - N
// stream), SM ids below N, SM ids spread evenly, odd SM ids (one SM a TPC, N = sms / 2).
static void select_rows(Ctx& c, int sms, bool units_only_shapes = false) {
  constexpr int kPageBytes = 16 * 8 * 256;
  const int pages = int(c.size / 2 / kPageBytes);
  const int smem = kUnitWarps * 4 * 4096;
  CK(cudaFuncSetAttribute(read_select, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  unsigned char* role;
  int *counters, *smids;
  CK(cudaMalloc(&role, 256));
  CK(cudaMalloc(&counters, 2 * sizeof(int)));
  CK(cudaMalloc(&smids, sms * sizeof(int)));
  bool printed_map = false;
  auto one = [&](const std::vector<unsigned char>& host, int by_smid, int ahead, const char* what, int n) {
    CK(cudaMemcpy(role, host.data(), 256, cudaMemcpyHostToDevice));
    const double us = time_graph(c, [&](char* b) {
      CK(cudaMemsetAsync(counters, 0, 2 * sizeof(int), c.stream));
      read_select<<<sms, 32 * kUnitWarps, smem, c.stream>>>(b, b + c.size / 2, role, by_smid, pages, ahead, counters,
                                                            smids, c.sink);
    });
    std::vector<int> got(sms);
    CK(cudaMemcpy(got.data(), smids, sms * sizeof(int), cudaMemcpyDeviceToHost));
    int streaming = 0;
    for (int b = 0; b < sms; ++b) streaming += host[by_smid ? (got[b] & 255) : b] == 1;
    if (!printed_map) {
      fprintf(stderr, "blockIdx -> smid:");
      for (int b = 0; b < sms; ++b) fprintf(stderr, " %d", got[b]);
      fprintf(stderr, "\n");
      printed_map = true;
    }
    char label[160];
    snprintf(label, sizeof label, "%s, %d SMs streaming%s", what, streaming,
             ahead > 0 ? ", the others prefetching into L2" : "");
    if (ahead > 0) snprintf(label + strlen(label), sizeof label - strlen(label), " (%d pages ahead)", ahead);
    row("select", label, c.size, n, 32 * kUnitWarps, us);
  };
  if (units_only_shapes) {  // a warp's unit shapes on POD's split (blocks >= sms - N stream)
    for (int round = 0; round < 2; ++round) {
      for (int n : {66, 94, sms}) {
        std::vector<unsigned char> block(256, 0);
        for (int b = 0; b < sms; ++b) block[b] = b >= sms - n;
        CK(cudaMemcpy(role, block.data(), 256, cudaMemcpyHostToDevice));
        for (auto ph : {std::pair<int, int>{1, 8}, {16, 8}, {32, 4}, {64, 2}, {128, 1}, {8, 1}}) {
          const double us = time_graph(c, [&](char* b) {
            CK(cudaMemsetAsync(counters, 0, 2 * sizeof(int), c.stream));
            read_select<<<sms, 32 * kUnitWarps, smem, c.stream>>>(b, b + c.size / 2, role, 0, pages, 0, counters,
                                                                  smids, c.sink, ph.first, ph.second);
          });
          char label[160];
          snprintf(label, sizeof label, "a warp's unit: %d page(s) x %d KV head(s) (%d keys), %d SMs", ph.first,
                   ph.second, 16 * ph.first, n);
          row("warp_units", label, c.size, n, 32 * kUnitWarps, us);
        }
      }
    }
    CK(cudaFree(role));
    CK(cudaFree(counters));
    CK(cudaFree(smids));
    return;
  }
  for (int round = 0; round < 2; ++round) {
    for (int n : {66, 87, 94, sms}) {
      std::vector<unsigned char> block(256, 0), low(256, 0), spread(256, 0);
      for (int b = 0; b < sms; ++b) block[b] = b >= sms - n;
      for (int s = 0; s < 256; ++s) low[s] = s < n;
      for (int s = 0; s < sms; ++s) spread[s] = (s + 1) * n / sms > s * n / sms;
      one(block, 0, 0, "by blockIdx (POD's split)", n);
      one(low, 1, 0, "SM ids below N", n);
      one(spread, 1, 0, "SM ids spread evenly", n);
      if (n < sms) {
        std::vector<unsigned char> pf = block;
        for (int b = 0; b < sms; ++b) pf[b] = b >= sms - n ? 1 : 2;
        for (int ahead : {32, 128, 512}) one(pf, 0, ahead, "by blockIdx (POD's split)", n);
      }
      if (n == 66) {
        std::vector<unsigned char> odd(256, 0);
        for (int s = 0; s < 256; ++s) odd[s] = s & 1;
        one(odd, 1, 0, "odd SM ids (one SM a TPC)", n);
      }
    }
  }
  CK(cudaFree(role));
  CK(cudaFree(counters));
  CK(cudaFree(smids));
}

// The wg-units rows: read_wg_units on N SMs (blocks >= sms - N, POD on Hopper's split), each
// unit 2048 keys of H KV heads' rows (P = 128 / H pages); two interleaved rounds.
template <int H>
void run_wg_units(Ctx& c, int sms, int n, unsigned char* role, int* counters, int active_wgs = 3,
                  int unit_pages = 0) {
  constexpr int kPageBytes = 16 * 8 * 256;
  const int pages = int(c.size / 2 / kPageBytes), per_unit = unit_pages > 0 ? unit_pages : 128 / H;
  const int smem = kUnitWarps * 4 * 4096;
  CK(cudaFuncSetAttribute(read_wg_units<H>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<unsigned char> host(256, 0);
  for (int b = 0; b < sms; ++b) host[b] = b >= sms - n;
  CK(cudaMemcpy(role, host.data(), 256, cudaMemcpyHostToDevice));
  const double us = time_graph(c, [&](char* b) {
    CK(cudaMemsetAsync(counters, 0, 2 * sizeof(int), c.stream));
    read_wg_units<H><<<sms, 32 * kUnitWarps, smem, c.stream>>>(b, b + c.size / 2, role, pages, per_unit, counters,
                                                                c.sink, active_wgs);
  });
  char label[160];
  snprintf(label, sizeof label, "units of a warpgroup: %d KV head(s) x %d pages (%d keys), %d SMs, %d warpgroup(s) an SM",
           H, per_unit, 16 * H * per_unit, n, active_wgs);
  row("wg_units", label, c.size, n, 32 * kUnitWarps, us);
}

static void wg_units_rows(Ctx& c, int sms) {
  unsigned char* role;
  int* counters;
  CK(cudaMalloc(&role, 256));
  CK(cudaMalloc(&counters, 2 * sizeof(int)));
  // one or two streaming warpgroups an SM on every SM (a decode warpgroup beside a one-consumer
  // prefill block), against three; 128-key units (8 pages of one head) too
  for (int round = 0; round < 2; ++round) {
    for (int wgs : {1, 2, 3}) {
      run_wg_units<1>(c, sms, sms, role, counters, wgs);
      run_wg_units<1>(c, sms, sms, role, counters, wgs, 8);
    }
  }
  for (int round = 0; round < 2; ++round) {
    for (int n : {66, 73, 94, sms}) {
      run_wg_units<1>(c, sms, n, role, counters);
      run_wg_units<2>(c, sms, n, role, counters);
      run_wg_units<4>(c, sms, n, role, counters);
      run_wg_units<8>(c, sms, n, role, counters);
    }
  }
  CK(cudaFree(role));
  CK(cudaFree(counters));
}

int main(int argc, char** argv) {
  // argv: [paged | bulk | locality] size_mib ... (each a buffer size to measure; paged: only the
  // paged rows; bulk: only cp.async against bulk copies on the paged pattern)
  std::vector<size_t> sizes;
  bool paged_only = false, bulk_only = false, locality_only = false, units_only = false, select_only = false, wg_only = false, warp_units = false;
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "paged") == 0) paged_only = true;
    else if (strcmp(argv[i], "bulk") == 0) bulk_only = true;
    else if (strcmp(argv[i], "locality") == 0) locality_only = true;
    else if (strcmp(argv[i], "units") == 0) units_only = true;
    else if (strcmp(argv[i], "select") == 0) select_only = true;
    else if (strcmp(argv[i], "wg_units") == 0) wg_only = true;
    else if (strcmp(argv[i], "warp_units") == 0) warp_units = true;
    else sizes.push_back(size_t(atoll(argv[i])) << 20);
  }
  if (sizes.empty()) sizes = {128, 1024};
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  Ctx c;
  CK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
  CK(cudaMalloc(&c.sink, 4));
  CK(cudaMemset(c.sink, 0, 4));
  printf("{\"device\": \"%s\", \"sms\": %d, \"l2_bytes\": %d, \"rows\": [", prop.name, sms, prop.l2CacheSize);
  for (size_t size : sizes) {
    c.size = size;
    const size_t want = std::max<size_t>(4 * size_t(prop.l2CacheSize), 2 * size);
    const int sets = int(std::min<size_t>(16, (want + size - 1) / size));
    for (char* b : c.bufs) CK(cudaFree(b));
    c.bufs.clear();
    for (int i = 0; i < sets; ++i) {
      char* b;
      CK(cudaMalloc(&b, size));
      fill<<<4 * sms, 256, 0, c.stream>>>(reinterpret_cast<uint32_t*>(b), size / 4, 0x1234u + i);
      c.bufs.push_back(b);
    }
    CK(cudaStreamSynchronize(c.stream));
    c.inner = size >= (size_t(1) << 30) ? 6 : 20;
    if (paged_only) {
      paged_rows(c);
      continue;
    }
    if (bulk_only) {
      bulk_rows(c);
      continue;
    }
    if (locality_only) {
      locality_rows(c);
      continue;
    }
    if (units_only) {
      units_rows(c, sms);
      continue;
    }
    if (select_only) {
      select_rows(c, sms);
      continue;
    }
    if (wg_only) {
      wg_units_rows(c, sms);
      continue;
    }
    if (warp_units) {
      select_rows(c, sms, true);
      continue;
    }
    // the copy ceiling, the same way (read + write counted)
    {
      char* dst;
      CK(cudaMalloc(&dst, size));
      double us = time_graph(c, [&](char* b) { CK(cudaMemcpyAsync(dst, b, size, cudaMemcpyDeviceToDevice, c.stream)); });
      row("copy", "cudaMemcpyAsync d2d, read + write counted", 2 * size, 0, 0, us);
      CK(cudaFree(dst));
    }
    // the decode's own shape at b=1 kv=32k: 256 blocks x 128 threads, a contiguous chunk each
    // a contiguous chunk a block, on the decode's grid at b=1 kv=32k (256 blocks: 8 KV
    // heads x 32 chunks); the grid-stride sweep over more grid sizes
    constexpr int kChunkBlocks = 256;
    for (int threads : {128, 256}) {
      run_ldg<4, kNone>(c, kChunkBlocks, threads, true, "U=4");
      run_ldg<8, kNone>(c, kChunkBlocks, threads, true, "U=8");
      run_ldg<16, kNone>(c, kChunkBlocks, threads, true, "U=16");
      run_ldg<8, kL2_256>(c, kChunkBlocks, threads, true, "U=8 L2::256B");
      for (int blocks : {kChunkBlocks, 2 * sms, 4 * sms, 8 * sms}) {
        run_ldg<8, kNone>(c, blocks, threads, false, "U=8");
        run_ldg<16, kNone>(c, blocks, threads, false, "U=16");
        run_ldg<8, kL2_256>(c, blocks, threads, false, "U=8 L2::256B");
      }
    }
    run_cpasync<3, kNone>(c, kChunkBlocks, 128, 16384, "3 x 16 KB (the decode's)");
    run_cpasync<3, kNone, true>(c, kChunkBlocks, 128, 16384, "3 x 16 KB, programmatic dependent launches");
    run_cpasync<4, kNone, true>(c, kChunkBlocks, 128, 16384, "4 x 16 KB, programmatic dependent launches");
    run_cpasync<3, kL2_256>(c, kChunkBlocks, 128, 16384, "3 x 16 KB L2::256B");
    run_cpasync<4, kNone>(c, kChunkBlocks, 128, 16384, "4 x 16 KB");
    run_cpasync<6, kNone>(c, kChunkBlocks, 128, 8192, "6 x 8 KB");
    run_cpasync<3, kNone>(c, kChunkBlocks, 256, 32768, "3 x 32 KB, 256 threads");
    // Fewer, wider blocks, one per SM (a cluster split's grid at b=1: 8 KV heads x 8 or 16
    // blocks), deeper stages: can half the SMs stream the buffer at the full rate?
    for (int blocks : {64, 128}) {
      run_cpasync<4, kNone, true>(c, blocks, 256, 32768, "4 x 32 KB, 256 threads, PDL", 1);
      run_cpasync<6, kNone, true>(c, blocks, 256, 32768, "6 x 32 KB, 256 threads, PDL", 1);
      run_cpasync<4, kNone, true>(c, blocks, 256, 32768, "4 x 32 KB, 256 threads, PDL, clusters of 8", 8);
      run_cpasync<6, kNone, true>(c, blocks, 256, 32768, "6 x 32 KB, 256 threads, PDL, clusters of 8", 8);
      run_cpasync<3, kNone, true>(c, blocks, 256, 32768, "3 x 32 KB, 256 threads, PDL, clusters of 8", 8);
    }
    run_bulk<3>(c, kChunkBlocks, 128, 16384, "3 x 16 KB");
    run_bulk<4>(c, kChunkBlocks, 128, 16384, "4 x 16 KB");
    run_bulk<6>(c, kChunkBlocks, 128, 8192, "6 x 8 KB");
    run_bulk<3>(c, kChunkBlocks, 128, 32768, "3 x 32 KB");
    run_bulk<2>(c, kChunkBlocks, 128, 32768, "2 x 32 KB");
    paged_rows(c);
  }
  unsigned hits = 0;
  CK(cudaMemcpy(&hits, c.sink, 4, cudaMemcpyDeviceToHost));
  printf("\n], \"sink_hits\": %u}\n", hits);
  return 0;
}

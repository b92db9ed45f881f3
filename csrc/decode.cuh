// Batch decode over the paged KV cache: one query token per request.
//
// A block takes one work item (a request, or a chunk of it under split-KV) for one KV head
// and a tile of up to 8 of its query heads. Threads are (x, y, z):
//   x  kBdx = head_dim / 8 lanes, each holding 8 dims of a row (q, k, v, o)
//   y  the query heads of the tile: they share every K/V row
//   z  token lanes: each runs its own online softmax over its tokens of a tile
// K/V tiles of kTileTokens rows are staged in shared memory by cp.async, two stages deep,
// so the loads of tile i+1 are in flight while tile i is computed; every query head of the
// group reads them from there. At the end the z lanes' states merge through shared
// memory. Logits live in the log2 domain (exp2), and so does the LSE written out.
#pragma once
#include <math_constants.h>

#include "common.cuh"
#include "decode_params.h"
#include "page_table.cuh"

namespace fij {

template <typename TQ, typename TKV, int HeadDim, int GroupTile, PageTableLayout Table, bool Rope,
          bool SoftCap>
struct DecodeTraits {
  using Q = TQ;
  using KV = TKV;
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kVec = 8;  // elements of a row per lane
  static constexpr int kBdx = HeadDim / kVec;
  static constexpr int kBdy = GroupTile;
  static constexpr int kThreads = kBdx * kBdy >= 128 ? kBdx * kBdy : 128;
  static constexpr int kBdz = kThreads / (kBdx * kBdy);
  // >= 32 tokens per tile, so a stage moves >= 8 KB of bf16 K+V per sync at head_dim 128.
  static constexpr int kTokensPerZ = 32 / kBdz >= 4 ? 32 / kBdz : 4;
  static constexpr int kTileTokens = kBdz * kTokensPerZ;
  static constexpr int kRowBytes = HeadDim * int(sizeof(TKV));
  static constexpr int kChunksPerRow = kRowBytes / 16;  // 16-byte cp.async chunks
  static constexpr int kStages = 2;
  static constexpr int kStageBytes = 2 * kTileTokens * kRowBytes;  // K and V
  static constexpr int kMergeBytes = kBdz * kBdy * (HeadDim + 2) * 4;
  static constexpr int kSmemBytes = kStages * kStageBytes > kMergeBytes ? kStages * kStageBytes : kMergeBytes;
  static constexpr PageTableLayout kTable = Table;
  static constexpr bool kRope = Rope;
  static constexpr bool kSoftCap = SoftCap;
  static_assert(kBdx <= 32 && 32 % kBdx == 0, "a row's lanes must sit in one warp");
  static_assert(kRowBytes % 16 == 0, "rows are moved in 16-byte chunks");
};

// --- small pieces ---------------------------------------------------------------------------
FIJ_DEVICE void cp_async_16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;  // 0: zero-fill (tokens past the chunk's end)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
FIJ_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
FIJ_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <typename T>
FIJ_DEVICE void load8_float(const T* ptr, float (&x)[8]) {
  if constexpr (sizeof(T) == 2) {
    const Vec16 raw = *reinterpret_cast<const Vec16*>(ptr);
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

// Sum over the kBdx lanes of a row (consecutive lanes of one warp).
template <int Lanes>
FIJ_DEVICE float row_sum(float v) {
#pragma unroll
  for (int offset = Lanes / 2; offset >= 1; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// NeoX RoPE on a row spread over kBdx lanes: lane x holds dims [8x, 8x+8); its partner
// x ^ kBdx/2 holds the other half of each pair. freq[e] is the frequency of dim 8x+e.
template <int Lanes>
FIJ_DEVICE void rope_row(float (&v)[8], const float (&freq)[8], float pos, int x) {
  const bool first_half = x < Lanes / 2;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float partner = __shfl_xor_sync(0xffffffffu, v[e], Lanes / 2);
    float s, c;
    sincosf(pos * freq[e], &s, &c);
    v[e] = first_half ? v[e] * c - partner * s : v[e] * c + partner * s;
  }
}

// Online softmax state of one (query head, token lane): running max m (log2 domain),
// denominator d and unnormalized output o (8 dims). m = -inf, d = 0: nothing seen yet;
// updates never subtract two infinities (see update()).
struct SoftmaxState {
  float m = -__builtin_huge_valf();
  float d = 0.f;
  float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
};

// --- the kernel -----------------------------------------------------------------------------
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) decode_kernel(const __grid_constant__ DecodeParams p) {
  using Q = typename Traits::Q;
  using KV = typename Traits::KV;
  constexpr int D = Traits::kHeadDim;
  extern __shared__ __align__(16) unsigned char smem[];

  // blockIdx.y = work item, blockIdx.x = (kv head, head tile): blocks launch in linear
  // order, so a CUDA-graph grid sized for the capacity runs every real item before any
  // idle one (with items on x, idle and real blocks interleaved and loaded SMs unevenly:
  // +45% at b=64, kv=4k).
  if (static_cast<int>(blockIdx.y) >= p.work[0]) return;
  const int32_t* item = p.work + 1 + 4 * blockIdx.y;
  const int b = item[0], chunk_start = item[1], chunk_end = item[2], partial_row = item[3];
  const int tiles_per_kv_head = (p.group + Traits::kBdy - 1) / Traits::kBdy;
  const int kv_head = blockIdx.x / tiles_per_kv_head;
  const int x = threadIdx.x, y = threadIdx.y, z = threadIdx.z;
  const int tid = x + Traits::kBdx * (y + Traits::kBdy * z);
  const int qo_head = kv_head * p.group + (blockIdx.x % tiles_per_kv_head) * Traits::kBdy + y;

  PageTable<Traits::kTable> table{p.table};
  const int kv_len = table.kv_len(b);
  // Keys this item attends to: its chunk, cut by the sliding window.
  const int window_start = p.window_left >= 0 ? max(0, kv_len - 1 - p.window_left) : 0;
  const int start = max(chunk_start, window_start);
  const int end = min(chunk_end, kv_len);

  // q: 8 dims per lane, rotated at position kv_len - 1, scaled for the logits.
  float q[8], freq[8];
  const int q_head = min(qo_head, p.num_qo_heads - 1);  // the tile always fits (group % kBdy == 0)
  load8_float(static_cast<const Q*>(p.q) + b * p.q_stride_b + q_head * p.q_stride_h + x * 8, q);
  if constexpr (Traits::kRope) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int i = (x * 8 + e) % (D / 2);
      freq[e] = p.rope_rcp_scale * exp2f(-2.f * float(i) / float(D) * p.rope_log2_theta);
    }
    rope_row<Traits::kBdx>(q, freq, float(kv_len - 1), x);
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) q[e] *= p.logit_scale;

  // Stage s: K rows then V rows. Addresses are computed, not kept in an array indexed by a
  // run-time stage (which would live in local memory).
  auto stage_k = [&](int s) { return reinterpret_cast<KV*>(smem + s * Traits::kStageBytes); };
  auto stage_v = [&](int s) { return stage_k(s) + Traits::kTileTokens * D; };
  // Issue the copies of the tile starting at `tile_start` into stage `s`.
  auto load_tile = [&](int tile_start, int s) {
    constexpr int kChunks = Traits::kTileTokens * Traits::kChunksPerRow;
    constexpr int kElemsPerChunk = 16 / int(sizeof(KV));
#pragma unroll
    for (int c = tid; c < kChunks; c += Traits::kThreads) {
      const int t = c / Traits::kChunksPerRow, ch = c % Traits::kChunksPerRow;
      const int j = tile_start + t;
      const bool valid = j < end;
      int k_page = 0, v_page = 0, slot = 0;
      if (valid) {
        const int logical = j / p.table.page_size;
        slot = j - logical * p.table.page_size;
        k_page = table.k_page(b, logical);
        v_page = table.v_page(b, logical);
      }
      const KV* k_src = paged_ptr<KV>(p.kv.k, k_page, slot, kv_head) + ch * kElemsPerChunk;
      const KV* v_src = paged_ptr<KV>(p.kv.v, v_page, slot, kv_head) + ch * kElemsPerChunk;
      cp_async_16(stage_k(s) + t * D + ch * kElemsPerChunk, valid ? k_src : static_cast<const KV*>(p.kv.k.data), valid);
      cp_async_16(stage_v(s) + t * D + ch * kElemsPerChunk, valid ? v_src : static_cast<const KV*>(p.kv.v.data), valid);
    }
    cp_async_commit();
  };

  SoftmaxState st;
  const int num_tiles = end > start ? (end - start + Traits::kTileTokens - 1) / Traits::kTileTokens : 0;
  if (num_tiles > 0) load_tile(start, 0);
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int tile_start = start + tile * Traits::kTileTokens;
    if (tile + 1 < num_tiles) {
      load_tile(tile_start + Traits::kTileTokens, (tile + 1) % Traits::kStages);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const KV* ks = stage_k(tile % Traits::kStages);
    const KV* vs = stage_v(tile % Traits::kStages);

    float logits[Traits::kTokensPerZ];
    float tile_max = -CUDART_INF_F;
#pragma unroll
    for (int i = 0; i < Traits::kTokensPerZ; ++i) {
      const int t = z * Traits::kTokensPerZ + i;
      const int j = tile_start + t;
      float k[8];
      load8_float(ks + t * D + x * 8, k);
      if constexpr (Traits::kRope) rope_row<Traits::kBdx>(k, freq, float(j), x);
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) s += q[e] * k[e];
      s = row_sum<Traits::kBdx>(s);
      if constexpr (Traits::kSoftCap) s = p.soft_cap * tanhf(s) * 1.4426950408889634f;  // q carried sm/cap
      logits[i] = j < end ? s : -CUDART_INF_F;
      tile_max = fmaxf(tile_max, logits[i]);
    }
    const float m_new = fmaxf(st.m, tile_max);
    if (m_new != -CUDART_INF_F) {  // at least one key so far: no inf - inf below
      const float rescale = exp2f(st.m - m_new);
      st.d *= rescale;
#pragma unroll
      for (int e = 0; e < 8; ++e) st.o[e] *= rescale;
#pragma unroll
      for (int i = 0; i < Traits::kTokensPerZ; ++i) {
        const float prob = exp2f(logits[i] - m_new);
        float v[8];
        load8_float(vs + (z * Traits::kTokensPerZ + i) * D + x * 8, v);
        st.d += prob;
#pragma unroll
        for (int e = 0; e < 8; ++e) st.o[e] += prob * v[e];
      }
      st.m = m_new;
    }
    __syncthreads();  // the stage is refilled next iteration
  }

  // Merge the kBdz token lanes' states of each query head through shared memory.
  float* merge_o = reinterpret_cast<float*>(smem);                       // [z][y][D]
  float* merge_md = merge_o + Traits::kBdz * Traits::kBdy * D;            // [z][y][2]
  if constexpr (Traits::kBdz > 1) {
#pragma unroll
    for (int e = 0; e < 8; ++e) merge_o[(z * Traits::kBdy + y) * D + x * 8 + e] = st.o[e];
    if (x == 0) {
      merge_md[(z * Traits::kBdy + y) * 2] = st.m;
      merge_md[(z * Traits::kBdy + y) * 2 + 1] = st.d;
    }
    __syncthreads();
    if (z != 0) return;
    float m = -CUDART_INF_F;
#pragma unroll
    for (int zz = 0; zz < Traits::kBdz; ++zz) m = fmaxf(m, merge_md[(zz * Traits::kBdy + y) * 2]);
    st = SoftmaxState{};
    st.m = m;
    if (m != -CUDART_INF_F) {
#pragma unroll
      for (int zz = 0; zz < Traits::kBdz; ++zz) {
        const float w = exp2f(merge_md[(zz * Traits::kBdy + y) * 2] - m);
        st.d += w * merge_md[(zz * Traits::kBdy + y) * 2 + 1];
#pragma unroll
        for (int e = 0; e < 8; ++e) st.o[e] += w * merge_o[(zz * Traits::kBdy + y) * D + x * 8 + e];
      }
    }
  }

  if (qo_head >= p.num_qo_heads) return;
  const bool empty = st.d == 0.f;  // no key: zeros and -inf, never NaN
  const float norm = empty ? 0.f : 1.f / st.d;
  const float lse = empty ? -CUDART_INF_F : st.m + log2f(st.d);
  if (partial_row < 0) {
    Q* out = static_cast<Q*>(p.out) + b * p.out_stride_b + qo_head * p.out_stride_h + x * 8;
    Vec16 raw;
    Q* o = reinterpret_cast<Q*>(&raw);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = static_cast<Q>(st.o[e] * norm * p.v_scale);
    store_vec16(out, raw);
    if (p.lse != nullptr && x == 0) p.lse[b * p.num_qo_heads + qo_head] = lse;
  } else {
    float* out = p.partial_o + (int64_t(partial_row) * p.num_qo_heads + qo_head) * D + x * 8;
    reinterpret_cast<float4*>(out)[0] = make_float4(st.o[0] * norm * p.v_scale, st.o[1] * norm * p.v_scale,
                                                    st.o[2] * norm * p.v_scale, st.o[3] * norm * p.v_scale);
    reinterpret_cast<float4*>(out)[1] = make_float4(st.o[4] * norm * p.v_scale, st.o[5] * norm * p.v_scale,
                                                    st.o[6] * norm * p.v_scale, st.o[7] * norm * p.v_scale);
    if (x == 0) p.partial_lse[int64_t(partial_row) * p.num_qo_heads + qo_head] = lse;
  }
}

template <class Traits>
int launch_decode(const DecodeParams& p, int grid_items, int num_kv_heads, cudaStream_t stream) {
  if (grid_items <= 0) return 0;
  if constexpr (Traits::kSmemBytes > 48 * 1024) {  // must be asked for, per device
    const cudaError_t err = cudaFuncSetAttribute(decode_kernel<Traits>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 Traits::kSmemBytes);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  const int tiles = (p.group + Traits::kBdy - 1) / Traits::kBdy;
  const dim3 grid(num_kv_heads * tiles, grid_items);
  const dim3 block(Traits::kBdx, Traits::kBdy, Traits::kBdz);
  decode_kernel<Traits><<<grid, block, Traits::kSmemBytes, stream>>>(p);
  return last_launch_error();
}

}  // namespace fij

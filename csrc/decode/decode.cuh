// Batch decode over the paged KV cache: one query token per request.
//
// A block takes one work item (a request, or a chunk of it under split-KV) for one KV head
// and a tile of up to 4 of its query heads. Threads are (x, z):
//   x  kBdx = head_dim / kVec lanes, each holding kVec dims of a row (q, k, v, o) for every
//      head of the tile: each K/V element is converted once and used by all the heads,
//      and their dot products are reduced together (reduce_heads)
//   z  token lanes: each runs its own online softmax over its tokens of a tile
// K/V tiles of kTileTokens rows are staged in shared memory by cp.async, two stages deep,
// so the loads of tile i+1 are in flight while tile i is computed; every query head of the
// group reads them from there. At the end the z lanes' states merge through shared
// memory. Logits live in the log2 domain (exp2), and so does the LSE written out.
// In-kernel positional encodings (RoPE on q and K, the ALiBi bias: csrc/common/pos_encoding.cuh)
// run here, on CUDA cores; decode_mma.cuh has none.
#pragma once
#include <math_constants.h>

#include "common/common.cuh"
#include "decode/decode_params.h"
#include "common/merge.cuh"
#include "common/page_table.cuh"
#include "common/pos_encoding.cuh"
#include "common/rope.cuh"
#include "common/softmax.cuh"

namespace fij {

template <typename TQ, typename TKV, int HeadDim, int GroupTile, PageTableLayout Table, PosEncoding Pos,
          bool SoftCap>
struct DecodeTraits {
  using Q = typename QueryTypes<TQ>::Q;  // q's elements (fp8 q: loaded as floats, exactly)
  using O = typename QueryTypes<TQ>::O;  // the output's: q's type, 16-bit for an fp8 q
  using KV = TKV;
  static constexpr int kHeadDim = HeadDim;
  // Elements of a row per lane: 8, 16 at head_dim 512 (a row's lanes sit in one warp: 32
  // lanes of 16, as FlashInfer's CUDA-core decode takes head_dim 512).
  static constexpr int kVec = HeadDim > 256 ? 16 : 8;
  static constexpr int kBdx = HeadDim / kVec;
  // Query heads per thread: every K/V element is converted once and used for all of them.
  // A group of 8 runs as two tiles of 4 (8 heads x 16 accumulators would cost occupancy).
  static constexpr int kHeads = GroupTile < 4 ? GroupTile : 4;
  static constexpr int kThreads = 128;
  // 4 blocks of 128 threads per SM: at most 128 registers (136 uncapped at 4 heads gave 3
  // blocks per SM and ran bf16 b=64 kv=4k 10% slower than the one-head-per-thread kernel).
  // head_dim 256 keeps its registers (capped at 128 its RoPE variant spilled 96 bytes).
  static constexpr int kMinBlocksPerSM = HeadDim <= 128 ? 4 : 2;
  static constexpr int kBdz = kThreads / kBdx;  // token lanes
  // a stage moves 16 KB of bf16 K+V at head_dim 128; 16 tokens at head_dim 512 (32 KB: two
  // stages take 64 KB, so two blocks an SM still fit)
  static constexpr int kTileTokens = HeadDim > 256 ? 16 : 32;
  static constexpr int kTokensPerZ = kTileTokens / kBdz;
  static constexpr int kRowBytes = HeadDim * int(sizeof(TKV));
  static constexpr int kChunksPerRow = kRowBytes / 16;  // 16-byte cp.async chunks
  static constexpr int kStages = 2;
  static constexpr int kStageBytes = 2 * kTileTokens * kRowBytes;  // K and V
  static constexpr int kMergeBytes = kBdz * kHeads * (HeadDim + 2) * 4;
  static constexpr int kSmemBytes = kStages * kStageBytes > kMergeBytes ? kStages * kStageBytes : kMergeBytes;
  static constexpr PageTableLayout kTable = Table;
  static constexpr bool kRope = Pos == PosEncoding::kRopeLlama;
  static constexpr bool kAlibi = Pos == PosEncoding::kAlibi;
  static constexpr bool kSoftCap = SoftCap;
  static_assert(kBdx <= 32 && 32 % kBdx == 0, "a row's lanes must sit in one warp");
  static_assert(kBdx >= 2 * kHeads, "the reduce-scatter needs two lanes per head split");
  static_assert(kTokensPerZ >= 1 && kTileTokens % kBdz == 0, "token lanes must divide the tile");
  static_assert(kRowBytes % 16 == 0, "rows are moved in 16-byte chunks");
  static_assert(sizeof(O) == 2, "a 16-bit output (8 dims: one 16-byte store)");
  static_assert(kVec % 8 == 0, "a lane's dims in whole 16-byte (8 x 16-bit) pieces");
  // (the ALiBi bias joins logits in the log2 domain: logit_scale then carries log2 e)
  static_assert(!(kAlibi && kSoftCap), "ALiBi with a soft cap: DecodeSpec rejects it");
};

// --- small pieces ---------------------------------------------------------------------------
// (load8_float: csrc/common/common.cuh)

// A lane's V dims of a row (V a multiple of 8) as floats.
template <int V, typename T>
FIJ_DEVICE void load_vec_float(const T* ptr, float (&x)[V]) {
#pragma unroll
  for (int i = 0; i < V / 8; ++i) load8_float(ptr + 8 * i, *reinterpret_cast<float(*)[8]>(x + 8 * i));
}

// Sum over the kBdx lanes of a row (consecutive lanes of one warp).
template <int Lanes>
FIJ_DEVICE float row_sum(float v) {
#pragma unroll
  for (int offset = Lanes / 2; offset >= 1; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The full dot products of kHeads query heads with one key, each spread over the Lanes
// lanes of a row: a reduce-scatter (each round a lane keeps half of its partial sums and
// sends the other half to its partner) then a butterfly over the remaining lanes; 4 heads
// over 16 lanes cost 2 + 1 + 1 + 1 shuffles instead of 4 x 4. Lane l ends up holding the
// sum of head_of_lane(l); broadcast_heads() gives every lane all of them.
template <int Lanes, int Heads>
FIJ_DEVICE int head_of_lane(int lane) {
  if constexpr (Heads == 1) return 0;
  else if constexpr (Heads == 2) return (lane & (Lanes / 2)) ? 1 : 0;
  else return ((lane & (Lanes / 2)) ? 2 : 0) + ((lane & (Lanes / 4)) ? 1 : 0);
}

template <int Lanes, int Heads>
FIJ_DEVICE int lane_of_head(int head) {  // a lane (within the row) holding head's sum
  if constexpr (Heads == 1) return 0;
  else if constexpr (Heads == 2) return head * (Lanes / 2);
  else return (head >> 1) * (Lanes / 2) + (head & 1) * (Lanes / 4);
}

template <int Lanes, int Heads>
FIJ_DEVICE void reduce_heads(const float (&partial)[Heads], int lane, float (&sums)[Heads]) {
  constexpr unsigned kFull = 0xffffffffu;
  float s;
  if constexpr (Heads == 1) {
    s = partial[0];
  } else if constexpr (Heads == 2) {
    const bool upper = lane & (Lanes / 2);
    s = (upper ? partial[1] : partial[0]) + __shfl_xor_sync(kFull, upper ? partial[0] : partial[1], Lanes / 2);
  } else {
    const bool upper = lane & (Lanes / 2);
    const float a = (upper ? partial[2] : partial[0]) + __shfl_xor_sync(kFull, upper ? partial[0] : partial[2], Lanes / 2);
    const float b = (upper ? partial[3] : partial[1]) + __shfl_xor_sync(kFull, upper ? partial[1] : partial[3], Lanes / 2);
    const bool upper2 = lane & (Lanes / 4);
    s = (upper2 ? b : a) + __shfl_xor_sync(kFull, upper2 ? a : b, Lanes / 4);
  }
  constexpr int kFirstFree = Heads == 1 ? Lanes / 2 : (Heads == 2 ? Lanes / 4 : Lanes / 8);
#pragma unroll
  for (int offset = kFirstFree; offset >= 1; offset /= 2) s += __shfl_xor_sync(kFull, s, offset);
#pragma unroll
  for (int h = 0; h < Heads; ++h) sums[h] = __shfl_sync(kFull, s, lane_of_head<Lanes, Heads>(h), Lanes);
}

// NeoX RoPE on a row spread over kBdx lanes: lane x holds dims [V x, V x + V); its partner
// x ^ kBdx/2 holds the other half of each pair. freq[e] is the frequency of dim V x + e.
template <int Lanes, int V>
FIJ_DEVICE void rope_row(float (&v)[V], const float (&freq)[V], float pos, int x) {
  const bool first_half = x < Lanes / 2;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const float partner = __shfl_xor_sync(0xffffffffu, v[e], Lanes / 2);
    float s, c;
    sincosf(pos * freq[e], &s, &c);
    v[e] = rope_turn(v[e], partner, c, s, first_half);
  }
}

// One token lane's rows for kHeads query heads: the online softmax (softmax.cuh) and the
// unnormalized output of this lane's V dims.
template <int Heads, int V>
struct LaneRows {
  OnlineSoftmax<SoftmaxStart::kNegInf> sm[Heads];
  float o[Heads][V];
  FIJ_DEVICE void init() {
#pragma unroll
    for (int h = 0; h < Heads; ++h) {
      sm[h].init();
#pragma unroll
      for (int e = 0; e < V; ++e) o[h][e] = 0.f;
    }
  }
};

// --- the block function and the kernel -------------------------------------------------------
// A split request's merge by the last of its blocks (for this head tile) to finish: the
// block's H heads over the request's partial states (float32), by merge.cuh's rule.
template <class Traits>
FIJ_DEVICE void decode_merge_split(const DecodeParams& p, int b, int head0, int tid) {
  using O = typename Traits::O;
  constexpr int D = Traits::kHeadDim;
  const int begin = p.merge_indptr[b], count = p.merge_indptr[b + 1] - begin;
  for (int i = tid; i < Traits::kHeads * (D / 4); i += Traits::kThreads) {
    const int qo_head = head0 + i / (D / 4), dim = 4 * (i % (D / 4));
    auto row = [&](int s) { return int64_t(begin + s) * p.num_qo_heads + qo_head; };
    float mx = -CUDART_INF_F;
    for (int s = 0; s < count; ++s) mx = fmaxf(mx, __ldcg(p.partial_lse + row(s)));
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float den = 0.f;
    for (int s = 0; s < count; ++s) {
      const float w = merge_weight(__ldcg(p.partial_lse + row(s)), mx);
      den += w;
      add_weighted4(acc, w, __ldcg(reinterpret_cast<const float4*>(p.partial_o + row(s) * D + dim)));
    }
    const Merged r = merged(mx, den);
    store4(static_cast<O*>(p.out) + b * p.out_stride_b + qo_head * p.out_stride_h + dim, acc.x * r.norm,
           acc.y * r.norm, acc.z * r.norm, acc.w * r.norm);
    if (p.lse != nullptr && dim == 0) p.lse[b * p.num_qo_heads + qo_head] = r.lse;
  }
}

// One block's work: work item `item_index` for head block `head_block` (of `head_blocks`:
// KV head head_block / tiles, query-head tile head_block % tiles), split merge included
// (in the kernel when p.merge_counters is set, else merge_splits_kernel runs after).
// decode_kernel calls it with (blockIdx.y, blockIdx.x, gridDim.x) and a StreamLaunch;
// POD calls it for its decode blocks (common.cuh: the launch object). smem: kSmemBytes.
template <class Traits, class Launch>
FIJ_DEVICE void decode_cuda_core_block(const DecodeParams& p, int item_index, int head_block, int head_blocks,
                                       unsigned char* smem, const Launch& launch) {
  using Q = typename Traits::Q;
  using O = typename Traits::O;
  using KV = typename Traits::KV;
  constexpr int D = Traits::kHeadDim;
  constexpr int H = Traits::kHeads;
  constexpr int V = Traits::kVec;  // a lane's dims of a row

  if (item_index >= p.work[0]) return;
  const int32_t* item = p.work + 1 + 4 * item_index;
  const int b = item[0], chunk_start = item[1], chunk_end = item[2], partial_row = item[3];
  const int tiles_per_kv_head = p.group / H;
  const int kv_head = head_block / tiles_per_kv_head;
  const int head0 = kv_head * p.group + (head_block % tiles_per_kv_head) * H;  // first query head
  const int x = threadIdx.x, z = threadIdx.y;
  const int tid = x + Traits::kBdx * z;

  PageTable<Traits::kTable> table{p.table};
  const int kv_len = table.kv_len(b);
  // Keys this item attends to: its chunk, cut by the sliding window.
  const int window_start = p.window_left >= 0 ? max(0, kv_len - 1 - p.window_left) : 0;
  const int start = max(chunk_start, window_start);
  const int end = min(chunk_end, kv_len);

  launch.wait_for_inputs();  // q, K, V and the outputs only after the kernel before

  // q of the tile's heads: V dims each per lane, rotated at position kv_len - 1, scaled.
  float q[H][V], freq[V];
  if constexpr (Traits::kRope) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int i = (x * V + e) % (D / 2);
      freq[e] = p.rope_rcp_scale * rope_inv_freq(float(i), float(D), p.rope_log2_theta);
    }
  }
  // ALiBi: each head's slope (log2 domain); its bias slope (j - (kv_len - 1)) is <= 0
  float slope[H];
#pragma unroll
  for (int h = 0; h < H; ++h) slope[h] = Traits::kAlibi ? alibi_slope_log2(head0 + h, p.num_qo_heads) : 0.f;
#pragma unroll
  for (int h = 0; h < H; ++h) {
    load_vec_float<V>(static_cast<const Q*>(p.q) + b * p.q_stride_b + (head0 + h) * p.q_stride_h + x * V, q[h]);
    if constexpr (Traits::kRope) rope_row<Traits::kBdx>(q[h], freq, float(kv_len - 1), x);
#pragma unroll
    for (int e = 0; e < V; ++e) q[h][e] *= p.logit_scale;
  }

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

  LaneRows<H, V> st;
  st.init();
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

    // Logits of this lane's tokens for every head: each K element converted once.
    float logits[Traits::kTokensPerZ][H];
    float tile_max[H];
#pragma unroll
    for (int h = 0; h < H; ++h) tile_max[h] = -CUDART_INF_F;
#pragma unroll
    for (int i = 0; i < Traits::kTokensPerZ; ++i) {
      const int t = z * Traits::kTokensPerZ + i;
      const int j = tile_start + t;
      float k[V];
      load_vec_float<V>(ks + t * D + x * V, k);
      if constexpr (Traits::kRope) rope_row<Traits::kBdx>(k, freq, float(j), x);
      float partial[H];
#pragma unroll
      for (int h = 0; h < H; ++h) {
        partial[h] = 0.f;
#pragma unroll
        for (int e = 0; e < V; ++e) partial[h] += q[h][e] * k[e];
      }
      float s[H];
      reduce_heads<Traits::kBdx, H>(partial, x, s);
#pragma unroll
      for (int h = 0; h < H; ++h) {
        float v = s[h];
        if constexpr (Traits::kSoftCap) v = p.soft_cap * tanhf(v) * 1.4426950408889634f;  // q carried sm/cap
        if constexpr (Traits::kAlibi) v = fmaf(slope[h], float(j - (kv_len - 1)), v);
        logits[i][h] = j < end ? v : -CUDART_INF_F;
        tile_max[h] = fmaxf(tile_max[h], logits[i][h]);
      }
    }
    float rescale[H];
#pragma unroll
    for (int h = 0; h < H; ++h) {
      rescale[h] = st.sm[h].move_max(fmaxf(st.sm[h].m, tile_max[h]));
      st.sm[h].d *= rescale[h];
#pragma unroll
      for (int e = 0; e < V; ++e) st.o[h][e] *= rescale[h];
    }
#pragma unroll
    for (int i = 0; i < Traits::kTokensPerZ; ++i) {
      float v[V];
      load_vec_float<V>(vs + (z * Traits::kTokensPerZ + i) * D + x * V, v);
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const float prob = st.sm[h].prob(logits[i][h]);
        st.sm[h].d += prob;
#pragma unroll
        for (int e = 0; e < V; ++e) st.o[h][e] += prob * v[e];
      }
    }
    __syncthreads();  // the stage is refilled next iteration
  }

  // Merge the kBdz token lanes' states through shared memory; z = 0 writes.
  launch.release_next();  // the next kernel may start launching

  float* merge_o = reinterpret_cast<float*>(smem);       // [z][h][D]
  float* merge_md = merge_o + Traits::kBdz * H * D;       // [z][h][2]
  if constexpr (Traits::kBdz > 1) {
#pragma unroll
    for (int h = 0; h < H; ++h) {
#pragma unroll
      for (int e = 0; e < V; ++e) merge_o[(z * H + h) * D + x * V + e] = st.o[h][e];
      if (x == 0) {
        merge_md[(z * H + h) * 2] = st.sm[h].m;
        merge_md[(z * H + h) * 2 + 1] = st.sm[h].d;
      }
    }
    __syncthreads();
  }
  if (z == 0) {  // the lanes' (m, d) states into z = 0's, by merge.cuh's rule, which writes
    if constexpr (Traits::kBdz > 1) {
#pragma unroll
      for (int h = 0; h < H; ++h) {
        float m = -CUDART_INF_F;
        for (int zz = 0; zz < Traits::kBdz; ++zz) m = fmaxf(m, merge_md[(zz * H + h) * 2]);
        st.sm[h].m = m;
        st.sm[h].d = 0.f;
#pragma unroll
        for (int e = 0; e < V; ++e) st.o[h][e] = 0.f;
        if (m == -CUDART_INF_F) continue;  // no key in any lane
        for (int zz = 0; zz < Traits::kBdz; ++zz) {
          const float w = exp2f(merge_md[(zz * H + h) * 2] - m);
          st.sm[h].d += w * merge_md[(zz * H + h) * 2 + 1];
#pragma unroll
          for (int e = 0; e < V; ++e) st.o[h][e] += w * merge_o[(zz * H + h) * D + x * V + e];
        }
      }
    }
#pragma unroll
    for (int h = 0; h < H; ++h) {
      const int qo_head = head0 + h;
      const Merged r = merged(st.sm[h].m, st.sm[h].d, p.v_scale);  // no key: zeros and -inf, never NaN
      // (ALiBi: the LSE of FlashInfer's bias slope j, pos_encoding.cuh; -inf stays -inf)
      const float norm = r.norm, lse = Traits::kAlibi ? r.lse + slope[h] * float(kv_len - 1) : r.lse;
      if (partial_row < 0) {
        O* out = static_cast<O*>(p.out) + b * p.out_stride_b + qo_head * p.out_stride_h + x * V;
#pragma unroll
        for (int i = 0; i < V / 8; ++i) {  // 8 dims a 16-byte store
          Vec16 raw;
          O* o = reinterpret_cast<O*>(&raw);
#pragma unroll
          for (int e = 0; e < 8; ++e) o[e] = static_cast<O>(st.o[h][8 * i + e] * norm);
          store_vec16(out + 8 * i, raw);
        }
        if (p.lse != nullptr && x == 0) p.lse[b * p.num_qo_heads + qo_head] = lse;
      } else {
        float* out = p.partial_o + (int64_t(partial_row) * p.num_qo_heads + qo_head) * D + x * V;
#pragma unroll
        for (int i = 0; i < V / 4; ++i)
          reinterpret_cast<float4*>(out)[i] = make_float4(st.o[h][4 * i] * norm, st.o[h][4 * i + 1] * norm,
                                                          st.o[h][4 * i + 2] * norm, st.o[h][4 * i + 3] * norm);
        if (x == 0) p.partial_lse[int64_t(partial_row) * p.num_qo_heads + qo_head] = lse;
      }
    }
  }
  // A split request: the last of its blocks (for this head tile) merges the partial states.
  if (partial_row < 0 || p.merge_counters == nullptr) return;
  auto counter = [&] {
    return SplitCounter{p.merge_counters + b * head_blocks + head_block, p.merge_indptr[b + 1] - p.merge_indptr[b]};
  };
  if (!last_of_split(tid == 0, *reinterpret_cast<int*>(smem), counter)) return;
  decode_merge_split<Traits>(p, b, head0, tid);
}

// The thin kernel: blockIdx.y = work item, blockIdx.x = (kv head, head tile). Blocks launch
// in linear order, so a CUDA-graph grid sized for the capacity runs every real item first.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSM) decode_kernel(const __grid_constant__ DecodeParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  decode_cuda_core_block<Traits>(p, static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.x),
                                 static_cast<int>(gridDim.x), smem, StreamLaunch{});
}

template <class Traits>
int launch_decode(const DecodeParams& p, int grid_items, int num_kv_heads, cudaStream_t stream, bool pdl) {
  if (grid_items <= 0) return 0;
  if (const int err = allow_dynamic_smem<decode_kernel<Traits>>(Traits::kSmemBytes)) return err;
  const dim3 grid(num_kv_heads * (p.group / Traits::kHeads), grid_items);
  return launch_kernel(decode_kernel<Traits>, grid, dim3(Traits::kBdx, Traits::kBdz), Traits::kSmemBytes, stream, pdl,
                       p);
}

}  // namespace fij

// Batch decode on tensor cores, for every GQA group (MHA included) without in-kernel RoPE.
//
// The CUDA-core kernel (decode.cuh) spends 2 x group FMAs per K/V element; at group 8 and
// an fp8 cache that is most of the GPU's FMA issue rate at HBM speed. Here the group's
// query heads are the rows of an mma.sync tile, so one K/V element costs a fraction of a
// tensor-core instruction whatever the group. Tiles of 1 or 2 heads leave more of the
// tile's rows idle but run the same instructions per K/V byte as a 4-head tile, and beat
// the CUDA-core kernel there too, most of all with fp8 caches, whose arithmetic limited
// the CUDA-core kernel (docs/decode.md). The two products:
//   S   = Q K^T    m16n8k16: rows = query heads (16, padded: group 4 and 8 leave rows
//                  idle, which costs nothing that matters), cols = a warp's 8 tokens
//   O^T = V^T P^T  m16n8k8 (k16 for fp8): rows = head_dim, cols = query heads, k = the
//                  warp's tokens. The
//                  S accumulator of a lane (head g, tokens 2c, 2c+1) is exactly the P^T
//                  fragment this product needs, and the transposed output keeps only the
//                  8 head columns (32 accumulators per lane at head_dim 128, not 64).
// A block takes one work item for one KV head and a tile of up to 16 of its query heads
// (or for two adjacent KV heads and all their query heads, two warps each: kKvHeads).
// Four warps split each K/V tile (8 tokens each, 16 for fp8; eight warps in the cluster
// split's kernel for larger blocks), with their own online softmax; their states merge
// through shared memory at the end. K/V tiles arrive by
// cp.async, kStages deep, their page ids looked up one tile before their copies are issued;
// each warp copies its own rows and waits only for them (no block barrier per tile).
// A request split over several blocks (split-KV) is merged by the last of its blocks to
// finish (a counter per request and head tile), not by a second kernel.
//
// Fragments are read from shared memory with a permuted head_dim order where that saves
// instructions (the dot product does not care which k index holds which dim, as long as
// q uses the same order): a lane reads 16 contiguous bytes of a K row and feeds them to
// consecutive k-steps. fp8 K/V are widened to fp16 in registers, exactly (one cvt per
// pair on sm_89+). q, fp16 or bf16, runs in the K/V type's mma (fp16 for fp8 caches); an
// fp8 q (over an fp8 cache) is widened to fp16 as it is loaded, exactly, and the output
// is 16-bit (Traits::O).
#pragma once
#include <math_constants.h>

#include "common/common.cuh"
#include "decode/decode_params.h"
#include "common/merge.cuh"
#include "common/mma.cuh"
#include "common/page_table.cuh"
#include "common/softmax.cuh"

namespace fij {


template <typename TQ, typename TKV, int HeadDim, int GroupTile, PageTableLayout Table, bool SoftCap,
          int KvHeads = 1, int Cluster = 1, int WarpsPerHead = 4, int QTokens = 1, int StageBudget = 0>
struct DecodeMmaTraits {
  using Q = typename QueryTypes<TQ>::Q;  // q's elements
  using O = typename QueryTypes<TQ>::O;  // the output's: q's type, 16-bit for an fp8 q
  using KV = TKV;
  using M = typename MmaTypeOf<TKV>::type;
  static constexpr bool kFp8 = sizeof(TKV) == 1;
  static constexpr int kHeadDim = HeadDim;
  // Query tokens per request (multi-token decode: speculative verification, plan()'s
  // q_len_per_req), causal among themselves: token t of N sees keys 0 .. kv_len - N + t.
  // A tile's rows are (token, query head) pairs, token-major: row r = token r / GroupTile,
  // head r % GroupTile of the tile, so the request's tokens share every K/V tile read.
  static constexpr int kQTokens = QTokens;
  static constexpr int kTileHeads = GroupTile;         // query heads of the tile
  static constexpr int kLiveRows = QTokens * GroupTile;  // rows with a query
  // mma rows of the tile: 1, 2, 4, 8 or 16 (rows past kLiveRows idle)
  static constexpr int kRows = kLiveRows <= 1 ? 1 : kLiveRows <= 2 ? 2 : kLiveRows <= 4 ? 4 : kLiveRows <= 8 ? 8 : 16;
  static constexpr int kHeadTiles = (kRows + 7) / 8;   // 8-column tiles of O^T
  // KV heads a block takes: 1, or 2 adjacent heads (warps 0-3 the first, 4-7 the second,
  // on the same tokens) when a head's row is 128 bytes or less in an NHD cache. Two heads'
  // rows of a token are then adjacent in memory and requested together: an fp8 head_dim
  // 128 row alone (128 of every 1024 bytes at 8 KV heads) reached ~5% less of the DRAM
  // bandwidth than pairs at large batch (docs/decode.md). A paired block is two blocks'
  // worth of warps, stages and registers, so an SM holds as many warps.
  static constexpr int kKvHeads = KvHeads;
  // Blocks per thread-block cluster along the grid's y (work items), 1 = none. A request
  // split over a cluster (plan(): small batches, one chunk per block of the cluster) is
  // merged through distributed shared memory instead of global partial states and a
  // counter: each block sends its state's dims to the block that merges them (block r:
  // dims [r kSlice, (r + 1) kSlice) of every head), one cluster barrier, and every block
  // writes its slice of the output. Its blocks run about one per SM, so their stages take
  // twice the shared memory (more tiles in flight per SM).
  static constexpr int kCluster = Cluster;
  static constexpr int kSlice = HeadDim / Cluster;
  // Warps on one KV head's tokens: 4, or 8 for clusters whose blocks read more than 64 KB
  // (plan()'s choice). A block alone on its SM with 4 warps (one a scheduler) leaves its
  // per-tile latency chain unhidden; 8 warps hide it, but at <= 64 KB a block 4 warps stay
  // faster (docs/decode.md).
  static constexpr int kWarpsPerHead = WarpsPerHead;
  // The cluster split's 8-warp kernel ("wide"): one block per SM on at most half the SMs
  // (plan()), each streaming twice a split block's rate; its main loop takes its page ids
  // and copies in another order (see the kernel).
  static constexpr bool kWide = kCluster > 1 && kWarpsPerHead == 8;
  static constexpr int kWarps = kWarpsPerHead * kKvHeads;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockRows = kKvHeads * kLiveRows;  // query rows a block writes (see row_head)
  // Tokens per warp per tile: 8 (one m16n8k8 for O^T) for 16-bit caches; 16 (m16n8k16)
  // for fp8, whose tiles would otherwise carry half the bytes for the same fixed costs.
  static constexpr int kWarpTokens = kFp8 ? 16 : 8;
  static constexpr int kNTiles = kWarpTokens / 8;           // 8-token column tiles of S
  static constexpr int kTileTokens = kWarpsPerHead * kWarpTokens;  // a head's tokens per tile: 32 or 64
  static constexpr int kChunk = 16;                         // bytes per cp.async / LDS.128
  static constexpr int kElemsPerChunk = kChunk / int(sizeof(TKV));
  static constexpr int kChunksPerRow = HeadDim * int(sizeof(TKV)) / kChunk;  // R
  // A warp copies its own token rows of a tile (and only it reads them), so the main loop
  // needs no block barrier: warps wait for their own copies and drift apart, which keeps
  // an SM's requests flowing instead of arriving in per-tile bursts.
  static constexpr int kRowsPerPass = 32 / kChunksPerRow;                    // a warp's rows per copy pass
  static constexpr int kTokensPerThread = kWarpTokens / kRowsPerPass;        // per tile
  static constexpr int kKSteps = HeadDim / 16;       // k-steps of S = Q K^T
  static constexpr int kStepsPerChunk = kElemsPerChunk / 4;
  static constexpr int kMTiles = HeadDim / 16;       // 16-dim row tiles of O^T
  // S = Q K^T accumulates in two independent chains (alternate k-steps) for 16-bit caches:
  // a block alone on its SM (small batches) is bound by each warp's latency chain per
  // tile, and one chain of 8 dependent mma was the longest part of it (docs/decode.md).
  // fp8 tiles already have two n-tiles (two chains).
  static constexpr int kSChains = kNTiles == 1 && kChunksPerRow >= 8 ? 2 : 1;
  // The warps' merge: padding of the O rows in shared memory (floats); each thread then
  // merges and stores 4 output dims (twice the threads of 8 dims a thread). Unpadded, a
  // warp's stores of its O accumulators (rows 2c, 2c + 1 of lanes c) fell 4-way (16-bit)
  // or 16-way (fp8) on the same banks (docs/decode.md).
  static constexpr int kORowPad = 4;
  static constexpr int kStageBytes = 2 * kWarps * kWarpTokens * HeadDim * int(sizeof(TKV));  // K + V rows of all warps
  // About 48 KB of stages per KV head: four heads' blocks fit an SM at head_dim <= 128 (one
  // wave for 132 SMs x 4 >= 64 requests x 8 KV heads), with 2 to 7 tiles in flight per warp.
  // (StageBudget > 0: that many bytes instead; POD on Hopper's blocks, which hold a third of
  // the SM's shared memory each: csrc/pod/pod_sm90.cuh)
  static constexpr int kStageBudget = StageBudget > 0 ? StageBudget : (kCluster > 1 ? 98304 : 49152) * kKvHeads;
  static constexpr int kStages = (kStageBudget / kStageBytes) < 2 ? 2
                                 : ((kStageBudget / kStageBytes) > 8 ? 8 : kStageBudget / kStageBytes);
  // The warps' states in shared memory: O rows of kOStride floats (padded by 4: the rows a
  // warp's lanes store at once, 2 apart, then fall on distinct banks), then m and d.
  static constexpr int kOStride = HeadDim + kORowPad;
  static constexpr int kMergeBytes = kWarps * kHeadTiles * 8 * (kOStride + 2) * 4;
  static constexpr int kFlagOffset = kStages * kStageBytes > kMergeBytes ? kStages * kStageBytes : kMergeBytes;
  // + the split-merge flag, + a cluster's receive buffer: [kCluster][kBlockRows] LSEs, then
  // [kCluster][kBlockRows][kSlice] output dims (over 48 KB, asked for)
  static constexpr int kRecvOffset = kFlagOffset + 16;
  static constexpr int kRecvBytes = kCluster > 1 ? kCluster * kBlockRows * (kSlice + 1) * 4 : 0;
  static constexpr int kSmemBytes = kRecvOffset + kRecvBytes;
  // Blocks per SM the registers must allow (128 threads each; twice that paired): 4 at
  // head_dim <= 128 (128 registers), but 3 for 16-head tiles, whose 64 O accumulators a
  // lane spilled at 128 registers; 2 at 256.
  // (In units of 4-warp blocks: a paired or 8-warp block counts twice, at least one.)
  static constexpr int kMinBlocks4 = HeadDim <= 128 ? (kRows == 16 ? 3 : 4) : 2;
  // The 8-warp kernel runs one block per SM but keeps room for two: under PDL the next
  // grid's blocks wait beside it. With one block's bound it took 144 registers and ran
  // slower, as stages past ~100 KB of shared memory did (docs/history/decode.md).
  static constexpr int kMinBlocksPerSM = kMinBlocks4 / (kWarps / 4) > 0 ? kMinBlocks4 / (kWarps / 4) : 1;
  // A grid whose K/V fit in this many bytes prefetches them into L2 before
  // griddepcontrol.wait, under a programmatic dependent launch (see the prologue). From a
  // sweep of budgets of 0-24 MB on the H100: 16 MB paid for fp8 but not for bf16, 8 MB kept
  // bf16's gain (docs/decode.md).
  static constexpr int64_t kPrefetchBytes = int64_t(kFp8 ? 16 : 8) << 20;
  // The in-kernel merge's partial outputs are stored in bf16 when the output is bf16 (as
  // FlashInfer stores its tmp_v in the output dtype): half the bytes written by every
  // block and read by the last one took a little off each split case on the H100
  // (docs/decode.md). A bf16 output rounds to the same 8 bits anyway; fp16
  // outputs keep float32 partials (fp16's range could clip a partial that the output's
  // average would not).
  static constexpr bool kBf16Partials = std::is_same_v<O, __nv_bfloat16>;
  static constexpr PageTableLayout kTable = Table;
  static constexpr bool kSoftCap = SoftCap;
  static_assert(sizeof(O) == 2 && (sizeof(Q) == 2 || (kFp8 && std::is_same_v<M, __half>)),
                "q fp16 or bf16, or fp8 over an fp8 cache (widened to fp16); a 16-bit output");
  static_assert(kLiveRows >= 1 && kLiveRows <= 16, "tensor-core decode takes 1 to 16 (token, head) rows a tile");
  static_assert(kQTokens == 1 || kKvHeads == 1, "multi-token tiles take one KV head a block");
  static_assert(kKvHeads == 1 || (kKvHeads == 2 && kRows <= 8), "a block takes one KV head or a pair (tiles <= 8)");
  static_assert(kCluster == 1 || (kKvHeads == 1 && HeadDim % kCluster == 0 && kSlice % 8 == 0 && kCluster <= 16),
                "a cluster's blocks take one KV head and merge slices of whole 8-dim groups");
  static_assert(kWarpsPerHead == 4 || (kWarpsPerHead == 8 && kCluster > 1),
                "8 warps a head: the cluster split's kernel for larger blocks");
  static_assert(kChunksPerRow >= 4 && 32 % kChunksPerRow == 0 && kWarpTokens % kRowsPerPass == 0,
                "rows must split into 16-byte chunks over a warp");
};

// --- small pieces ---------------------------------------------------------------------------
namespace mma_detail {
// Four dims of one output row, acc x norm, at out (8-byte aligned).
template <typename Q>
FIJ_DEVICE void store_out4(Q* out, const float4& acc, float norm) {
  uint2 raw;
  Q* ov = reinterpret_cast<Q*>(&raw);
  ov[0] = static_cast<Q>(acc.x * norm);
  ov[1] = static_cast<Q>(acc.y * norm);
  ov[2] = static_cast<Q>(acc.z * norm);
  ov[3] = static_cast<Q>(acc.w * norm);
  *reinterpret_cast<uint2*>(out) = raw;
}

// Four dims at src (float32, or 16-bit elements widened: store_out4's inverse), from L2:
// other blocks of this grid wrote them.
template <typename T>
FIJ_DEVICE float4 load4_cg(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return __ldcg(reinterpret_cast<const float4*>(src));
  } else {
    const uint2 raw = __ldcg(reinterpret_cast<const uint2*>(src));
    const T* v = reinterpret_cast<const T*>(&raw);
    return make_float4(static_cast<float>(v[0]), static_cast<float>(v[1]), static_cast<float>(v[2]),
                       static_cast<float>(v[3]));
  }
}

// A request split over a cluster, once every block of the cluster has sent its state's
// dims to the blocks that merge them and the cluster barrier has passed (the kernel):
// this block (rank r) merges dims [r kSlice, (r + 1) kSlice) of its heads over the
// cluster's states, in rank order (deterministic), and writes them; rank 0 writes the LSEs.
template <class Traits>
FIJ_DEVICE void cluster_merge(const DecodeParams& p, int b, int block_head0, unsigned rank,
                              const unsigned char* smem) {
  using O = typename Traits::O;
  constexpr int C = Traits::kCluster, H = Traits::kBlockRows, S = Traits::kSlice;
  const float* recv_lse = reinterpret_cast<const float*>(smem + Traits::kRecvOffset);  // [C][H]
  const float* recv_o = recv_lse + C * H;                                                // [C][H][S]
  for (int i = threadIdx.x; i < H * (S / 4); i += Traits::kThreads) {
    const int h = i / (S / 4), x4 = i % (S / 4);
    float lse[C], mx = -CUDART_INF_F;
#pragma unroll
    for (int r = 0; r < C; ++r) {
      lse[r] = recv_lse[r * H + h];
      mx = fmaxf(mx, lse[r]);
    }
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float den = 0.f;
    if (mx != -CUDART_INF_F) {
#pragma unroll
      for (int r = 0; r < C; ++r) {
        const float w = exp2f(lse[r] - mx);
        const float4 u = *reinterpret_cast<const float4*>(recv_o + (r * H + h) * S + 4 * x4);
        den += w;
        add_weighted4(acc, w, u);
      }
    }
    const float norm = merged(mx, den).norm;  // no key in any chunk: zeros and -inf
    // row h -> its (token, head) as the kernel's row_head maps it
    const int qo_head = block_head0 + (Traits::kQTokens == 1 ? h
                                           : h / Traits::kTileHeads * (p.num_qo_heads / Traits::kQTokens) +
                                                 h % Traits::kTileHeads);
    O* out = static_cast<O*>(p.out) + b * p.out_stride_b + qo_head * p.out_stride_h + rank * S + 4 * x4;
    store_out4(out, acc, norm);
    if (p.lse != nullptr && rank == 0 && x4 == 0) p.lse[b * p.num_qo_heads + qo_head] = merged_lse(mx, den);
  }
}

}  // namespace mma_detail

// --- the block function and the kernel -------------------------------------------------------
// One block's work: work item `item_index` for head block `head_block` (of `head_blocks`:
// KV head (pair) head_block / tiles, query-head tile head_block % tiles), split merge
// included (the last block of a split request merges it). decode_mma_kernel calls it with
// (blockIdx.y, blockIdx.x, gridDim.x) and a StreamLaunch; POD calls it for its decode
// blocks (common.cuh: the launch object). smem: Traits::kSmemBytes, 128-byte aligned.
// (A cluster kernel's blocks, kCluster > 1, need their cluster: they run in their own kernel.)
template <class Traits, class Launch>
FIJ_DEVICE void decode_mma_block(const DecodeParams& p, int item_index, int head_block, int head_blocks,
                                 unsigned char* smem, const Launch& launch) {
  using namespace mma_detail;
  using Q = typename Traits::Q;
  using O = typename Traits::O;
  using KV = typename Traits::KV;
  using MT = typename Traits::M;
  constexpr int D = Traits::kHeadDim;
  constexpr int R = Traits::kChunksPerRow;
  constexpr int E = Traits::kElemsPerChunk;
  constexpr int HT = Traits::kHeadTiles;
  constexpr int kRowBytes = D * int(sizeof(KV));

  // The item count and the item load together (rows up to gridDim.y exist: a CUDA-graph
  // grid's spare rows are zeros), not one after the other.
  const int num_items = p.work[0];
  const int32_t* item = p.work + 1 + 4 * item_index;
  const int b = item[0], chunk_start = item[1], chunk_end = item[2], partial_row = item[3];
  // (In a cluster grid the item count is a multiple of the cluster size: whole clusters exit.)
  if (item_index >= num_items) return;
  // A cluster's first barrier phase: every block has started (so its shared memory may
  // be written) once the wait before the first remote store returns, long after this.
  if constexpr (Traits::kCluster > 1) cluster_arrive_relaxed();
  const int tid = launch.thread(), warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;
  const unsigned rank = Traits::kCluster > 1 ? cluster_ctarank() : 0;  // in the cluster (its chunk of the request)
  // Block x: KV head (pair) head_block / tiles, query-head tile head_block % tiles (one
  // tile when paired, so the block's kBlockRows query heads are contiguous from block_head0).
  const int tiles_per_kv_head = p.group / Traits::kTileHeads;
  const int head_slot = warp / Traits::kWarpsPerHead;  // which KV head of the block this warp takes
  const int kv_head = head_block / tiles_per_kv_head * Traits::kKvHeads + head_slot;
  const int block_head0 = head_block / tiles_per_kv_head * Traits::kKvHeads * p.group +
                          head_block % tiles_per_kv_head * Traits::kTileHeads;
  const int head0 = block_head0 + head_slot * Traits::kTileHeads;  // this warp's first query head
  // Row r of a block -> its query "head" from block_head0: with N query tokens a request's
  // rows are N x num_qo_heads (token-major, q seen as [B, N x Hq, D]; p.num_qo_heads counts
  // them), and row r is token r / kTileHeads, head r % kTileHeads of the tile. One token: r.
  const int heads_per_token = p.num_qo_heads / Traits::kQTokens;
  auto row_head = [&](int r) {
    return Traits::kQTokens == 1 ? r : r / Traits::kTileHeads * heads_per_token + r % Traits::kTileHeads;
  };

  PageTable<Traits::kTable> table{p.table};
  // plan() clips every chunk to its request's length, so the length itself (one more
  // dependent load before the first page id) is read only for a sliding window.
  // (With N query tokens the earliest, token 0 at kv_len - N, sets the window's start.)
  const int start =
      p.window_left >= 0 ? max(chunk_start, table.kv_len(b) - Traits::kQTokens - p.window_left) : chunk_start;
  const int end = chunk_end;
  const int num_tiles = end > start ? (end - start + Traits::kTileTokens - 1) / Traits::kTileTokens : 0;

  // Shared-memory swizzles (16-byte chunk q of token row t). K rows are read as 2 rows x 4
  // chunks per 8 lanes, V rows as 8 rows of one chunk (ldmatrix) or 4 rows x 2 chunks
  // (fp8): flipping bit 2 by the row parity, resp. XOR with the row's low 3 bits, keeps
  // each 8-lane phase on distinct banks. Rows of 4 chunks (64 bytes) need no swizzle.
  auto k_off = [](int t, int q) { return t * kRowBytes + ((R >= 8 ? q ^ ((t & 1) << 2) : q) * 16); };
  auto v_off = [](int t, int q) { return t * kRowBytes + ((R >= 8 ? q ^ (t & 7) : q) * 16); };
  auto stage_k = [&](int s) { return smem + s * Traits::kStageBytes; };
  auto stage_v = [&](int s) { return smem + s * Traits::kStageBytes + Traits::kStageBytes / 2; };

  // --- copies: lane moves chunk (lane % R) of its warp's tokens lane / R + kRowsPerPass * i ---
  // Stage rows: warp w owns rows [w kWarpTokens, (w + 1) kWarpTokens) of every stage; they
  // hold its head's tokens tok_w + 0 .. kWarpTokens - 1 of the tile.
  const int wt = warp * Traits::kWarpTokens;                                 // the warp's first stage row
  const int tok_w = warp % Traits::kWarpsPerHead * Traits::kWarpTokens;      // ... and its first token of a tile
  const int my_chunk = lane % R, my_row = wt + lane / R, my_tok = tok_w + lane / R;
  constexpr int TPT = Traits::kTokensPerThread;
  constexpr bool kSeparate = Traits::kTable == PageTableLayout::kBlockTableKVSeparate;
  // Page ids (-1: past the end) and slots of this thread's tokens of a tile.
  struct Pages {
    int k[TPT], v[kSeparate ? TPT : 1], slot[TPT];
  };
  // Token j's page slot: shifts for a power-of-two page size (a uniform branch), else a
  // division; the request's page-id rows are looked up once.
  const int page_size = p.table.page_size;
  const bool pow2_pages = (page_size & (page_size - 1)) == 0;
  const int page_shift = __ffs(page_size) - 1;
  const int32_t* k_row = table.k_row(b);
  const int32_t* v_row = kSeparate ? table.v_row(b) : k_row;
  // The wide kernel reads its page ids through the read-only path (ld.global.nc): each of
  // its blocks streams about twice a split block's rate, and lookups through L1 held them
  // back (docs/decode.md).
  auto page_id = [](const int32_t* row, int logical) {
    if constexpr (Traits::kWide) {
      return __ldg(row + logical);
    } else {
      return row[logical];
    }
  };
  auto lookup_as = [&](auto pow2, int tile, Pages& pg) {
    const int j0 = start + tile * Traits::kTileTokens + my_tok;
#pragma unroll
    for (int i = 0; i < TPT; ++i) {
      const int j = j0 + i * Traits::kRowsPerPass;
      const int logical = decltype(pow2)::value ? j >> page_shift : j / page_size;
      const bool valid = j < end;
      pg.k[i] = valid ? page_id(k_row, logical) : -1;
      if constexpr (kSeparate) pg.v[i] = valid ? page_id(v_row, logical) : -1;
      pg.slot[i] = j - logical * page_size;
    }
  };
  // The wide kernel finds token j's page (j / page_size) as the high half of j x
  // page_magic, which is exact or one short for every 0 <= j < 2^31 and page size, then
  // corrected by its remainder: one main-loop body for every page size, where the uniform
  // branch between shifts (power-of-two pages) and a division kept both bodies in its loop
  // and slowed it. The split kernels keep the branch (the multiply-high cost them a little
  // at large batch). Its loop below repeats lookup_as's on purpose: one loop for both
  // compiled the 8-warp kernel otherwise and slowed it (docs/history/decode.md).
  const uint32_t page_magic = 0xFFFFFFFFu / static_cast<uint32_t>(page_size);
  auto lookup = [&](int tile, Pages& pg) {
    if constexpr (Traits::kWide) {
      const int j0 = start + tile * Traits::kTileTokens + my_tok;
#pragma unroll
      for (int i = 0; i < TPT; ++i) {
        const int j = j0 + i * Traits::kRowsPerPass;
        int logical = static_cast<int>(__umulhi(static_cast<uint32_t>(j), page_magic));
        int slot = j - logical * page_size;
        if (slot >= page_size) {
          ++logical;
          slot -= page_size;
        }
        const bool valid = j < end;
        pg.k[i] = valid ? page_id(k_row, logical) : -1;
        if constexpr (kSeparate) pg.v[i] = valid ? page_id(v_row, logical) : -1;
        pg.slot[i] = slot;
      }
    } else if (pow2_pages) {
      lookup_as(std::true_type{}, tile, pg);
    } else {
      lookup_as(std::false_type{}, tile, pg);
    }
  };
  // Element offsets in 32 bits but for page x stride_page (the host checks that the
  // strides fit); this thread's head and chunk folded into the bases once.
  const int k_sp = static_cast<int>(p.kv.k.stride_page), k_st = static_cast<int>(p.kv.k.stride_token);
  const int v_sp = static_cast<int>(p.kv.v.stride_page), v_st = static_cast<int>(p.kv.v.stride_token);
  const KV* k_base = static_cast<const KV*>(p.kv.k.data) + (kv_head * static_cast<int>(p.kv.k.stride_head) + my_chunk * E);
  const KV* v_base = static_cast<const KV*>(p.kv.v.data) + (kv_head * static_cast<int>(p.kv.v.stride_head) + my_chunk * E);
  auto issue = [&](int s, const Pages& pg) {  // the tile's copies into stage s
#pragma unroll
    for (int i = 0; i < TPT; ++i) {
      const int t = my_row + i * Traits::kRowsPerPass;
      const bool valid = pg.k[i] >= 0;
      const int vp = kSeparate ? pg.v[kSeparate ? i : 0] : pg.k[i];
      // past the end: zeros, from an address that is never read
      const KV* k_src = valid ? k_base + (mul_wide(pg.k[i], k_sp) + pg.slot[i] * k_st) : k_base;
      const KV* v_src = valid ? v_base + (mul_wide(vp, v_sp) + pg.slot[i] * v_st) : v_base;
      cp_async_16(stage_k(s) + k_off(t, my_chunk), k_src, valid);
      cp_async_16(stage_v(s) + v_off(t, my_chunk), v_src, valid);
    }
  };

  // Prologue: the page ids of tiles 0 .. kStages-1 requested together (one round trip, not
  // one per tile), then tiles 0 .. kStages-2 in flight.
  Pages next, first[Traits::kStages - 1];
#pragma unroll
  for (int s = 0; s < Traits::kStages - 1; ++s)
    if (s < num_tiles) lookup(s, first[s]);
  if (Traits::kStages - 1 < num_tiles) lookup(Traits::kStages - 1, next);

  // A small grid (its K/V within kPrefetchBytes, each block's chunk within its equal
  // share of the item's head_blocks blocks and the other items'; launch.prefetch: a
  // programmatic dependent launch of decode's own grid) brings its chunk into L2 now, a
  // thread a token, while the kernel before it still runs: the first tiles then come
  // from L2. Larger grids do not: the prefetched lines were evicted before use while the
  // kernel before streamed its own, and without a dependent launch nothing overlaps
  // (docs/decode.md). Safe before the wait even if the kernel before
  // writes K/V: a prefetch moves nothing into this block, every write lands in L2, and
  // the copies below read L2.
  if (launch.prefetch) {
    constexpr int kTokenBytes = 2 * kRowBytes * Traits::kKvHeads;
    const int64_t share = Traits::kPrefetchBytes / (int64_t(head_blocks) * num_items * kTokenBytes);
    const int count = end - start;
    if (count > 0 && count <= share) {
      // the block's first head's rows (k_base / v_base are this thread's head and chunk)
      const int first_head = kv_head - head_slot;
      const KV* k_rows = static_cast<const KV*>(p.kv.k.data) + first_head * static_cast<int>(p.kv.k.stride_head);
      const KV* v_rows = static_cast<const KV*>(p.kv.v.data) + first_head * static_cast<int>(p.kv.v.stride_head);
      for (int i = tid; i < count; i += Traits::kThreads) {
        const int j = start + i;
        const int logical = pow2_pages ? j >> page_shift : j / page_size;
        const int slot = j - logical * page_size;
        const int kp = k_row[logical], vp = kSeparate ? v_row[logical] : kp;
#pragma unroll
        for (int h = 0; h < Traits::kKvHeads; ++h) {
          prefetch_l2(k_rows + (mul_wide(kp, k_sp) + slot * k_st + h * static_cast<int>(p.kv.k.stride_head)), kRowBytes);
          prefetch_l2(v_rows + (mul_wide(vp, v_sp) + slot * v_st + h * static_cast<int>(p.kv.v.stride_head)), kRowBytes);
        }
      }
    }
  }

  // So far only the plan's work list and the page table were read. Under a programmatic
  // dependent launch the kernel before this one may still be running: q, K, V, the
  // partial states and the merge counters are touched only after it has finished.
  launch.wait_for_inputs();
  // The next kernel's blocks may launch now (into free slots) and read their own work
  // items and page ids while this grid streams; they wait for all of it to finish before
  // touching anything it writes. (Triggering after the main loop left their launch and
  // prologue on the critical path of small grids.)
  launch.release_next();
  // The first tile's copies go out before q is loaded, the rest after: with q's loads
  // queued behind every prologue copy the first S waited longer, and with all of them
  // after q the first tile arrived later.
  const Q* q_rows = static_cast<const Q*>(p.q) + b * p.q_stride_b + head0 * p.q_stride_h;  // row r: + r q_row_stride
  const int q_row_stride = p.q_stride_h;  // in 32 bits (the tile's rows are < 16 heads apart)
  if (num_tiles > 0) issue(0, first[0]);
  cp_async_commit();

  // --- q as the A fragments of S = Q K^T, in the permuted dim order of the K reads -----------
  // k-step P*kStepsPerChunk + h, lane (g, c): a0/a2 = q[g][E*(4P+c) + 4h + {0,1} / {2,3}],
  // a1/a3 the same for row g + 8 (zero unless the tile has 16 heads).
  // A 1-head tile's row count is hidden from the compiler here. Seeing that only row 0
  // (lanes 0-3) loads, and rows 8-15 never, nvcc 13.0 (sm_90a) allocated the kernel's
  // registers otherwise and spilled at the 128-register cap, in every kernel of the tile.
  // With the count opaque (both halves) none spills on a CSR or block table and fewer with
  // separate K and V page ids, except in the 4-warp cluster kernel with separate ids,
  // which spills more that way and keeps the count visible.
  int tile_rows = Traits::kLiveRows;
  if constexpr (Traits::kRows == 1 && !(kSeparate && Traits::kCluster > 1 && !Traits::kWide))
    asm("" : "+r"(tile_rows));
  uint32_t qa[Traits::kKSteps][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = g + 8 * half;
    const bool live = row < tile_rows;
#pragma unroll
    for (int P = 0; P < R / 4; ++P) {
      uint32_t w[E / 2];
      const Q* src = q_rows + row_head(row) * q_row_stride + E * (4 * P + c);
      if constexpr (sizeof(Q) == 1) {  // fp8 q (fp8 cache, E = 16): 16 bytes, widened to fp16 pairs
        const uint4 raw = live ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
        fp8x4_to_half2x2<Q>(raw.x, w[0], w[1]);
        fp8x4_to_half2x2<Q>(raw.y, w[2], w[3]);
        fp8x4_to_half2x2<Q>(raw.z, w[4], w[5]);
        fp8x4_to_half2x2<Q>(raw.w, w[6], w[7]);
      } else {
#pragma unroll
        for (int v = 0; v < E / 8; ++v) {
          const uint4 raw = live ? *reinterpret_cast<const uint4*>(src + 8 * v) : make_uint4(0, 0, 0, 0);
          w[4 * v + 0] = q_word<Q, MT>(raw.x);
          w[4 * v + 1] = q_word<Q, MT>(raw.y);
          w[4 * v + 2] = q_word<Q, MT>(raw.z);
          w[4 * v + 3] = q_word<Q, MT>(raw.w);
        }
      }
#pragma unroll
      for (int h = 0; h < Traits::kStepsPerChunk; ++h) {
        qa[P * Traits::kStepsPerChunk + h][half] = w[2 * h];
        qa[P * Traits::kStepsPerChunk + h][2 + half] = w[2 * h + 1];
      }
    }
  }

#pragma unroll
  for (int s = 1; s < Traits::kStages - 1; ++s) {
    if (s < num_tiles) issue(s, first[s]);
    cp_async_commit();  // empty groups keep the wait counts uniform
  }

  const float logit_scale = p.logit_scale;  // soft cap: inside the tanh
  // Multi-token tiles mask per row: token t of N sees keys up to kv_len - N + t (causal
  // among the request's tokens) and, with a window, from kv_len - N + t - window_left.
  int row_end[HT], row_lo[HT];
  if constexpr (Traits::kQTokens > 1) {
    const int kv_len = table.kv_len(b);
#pragma unroll
    for (int t = 0; t < HT; ++t) {
      const int tok = min(g + 8 * t, Traits::kLiveRows - 1) / Traits::kTileHeads;
      row_end[t] = min(end, kv_len - (Traits::kQTokens - 1 - tok));
      row_lo[t] = p.window_left >= 0 ? kv_len - Traits::kQTokens + tok - p.window_left : 0;
    }
  }
  // Online softmax of heads g + 8t (this lane's S rows); d sums this lane's tokens only.
  OnlineSoftmax<SoftmaxStart::kNegInf> st[HT];
  float o[Traits::kMTiles][HT][4];
#pragma unroll
  for (int t = 0; t < HT; ++t) {
    st[t].init();
#pragma unroll
    for (int i = 0; i < Traits::kMTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[i][t][e] = 0.f;
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    if constexpr (Traits::kWide) {
      // The next page ids first (their loads ahead of this tile's copies), then the copies
      // into the stage of the tile before (this warp is done with its rows there), then
      // the wait for this tile: all kStages tiles in flight during the wait (the split
      // kernels, two blocks an SM, gained nothing from this order; docs/decode.md).
      const Pages cur = next;
      if (tile + Traits::kStages < num_tiles) lookup(tile + Traits::kStages, next);
      __syncwarp();
      if (tile + Traits::kStages - 1 < num_tiles) issue((tile + Traits::kStages - 1) % Traits::kStages, cur);
      cp_async_commit();
      cp_async_wait<Traits::kStages - 1>();
      __syncwarp();  // the warp's rows of the tile are in
    } else {
      cp_async_wait<Traits::kStages - 2>();
      __syncwarp();  // the warp's rows of the tile are in; its rows of the stage refilled below are free
      if (tile + Traits::kStages - 1 < num_tiles) issue((tile + Traits::kStages - 1) % Traits::kStages, next);
      cp_async_commit();
      if (tile + Traits::kStages < num_tiles) lookup(tile + Traits::kStages, next);
    }

    const unsigned char* ks = stage_k(tile % Traits::kStages);
    const unsigned char* vs = stage_v(tile % Traits::kStages);

    // S = Q K^T: lane (g, c) reads token wt + 8n + g, chunks 4P + c.
    constexpr int NT = Traits::kNTiles;
    // Odd k-steps go to a second accumulator where kSChains is 2, summed at the end: one
    // chain of a row's 8 dependent mma was a warp's longest latency chain per tile.
    constexpr bool kTwoChains = Traits::kSChains == 2;
    float s_acc[NT][4], s_alt[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s_acc[n][e] = s_alt[n][e] = 0.f;
#pragma unroll
      for (int P = 0; P < R / 4; ++P) {
        const uint4 raw = lds128(ks + k_off(wt + 8 * n + g, 4 * P + c));
        uint32_t w[E / 2];
        if constexpr (Traits::kFp8) {
          const uint32_t r4[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
          for (int v = 0; v < 4; ++v) fp8x4_to_half2x2<KV>(r4[v], w[2 * v], w[2 * v + 1]);
        } else {
          w[0] = raw.x;
          w[1] = raw.y;
          w[2] = raw.z;
          w[3] = raw.w;
        }
#pragma unroll
        for (int h = 0; h < Traits::kStepsPerChunk; ++h) {
          const int step = P * Traits::kStepsPerChunk + h;
          mma_k16<MT>(kTwoChains && step % 2 ? s_alt[n] : s_acc[n], qa[step], w[2 * h], w[2 * h + 1]);
        }
      }
      if constexpr (kTwoChains)
#pragma unroll
        for (int e = 0; e < 4; ++e) s_acc[n][e] += s_alt[n][e];
    }

    // Online softmax over the warp's tokens: s_acc[n][2t + e] is head g + 8t, token
    // 8n + 2c + e.
    const int j0 = start + tile * Traits::kTileTokens + tok_w + 2 * c;
    // Lazy rescaling (softmax.cuh): a head's running max moves only when one of the warp's
    // keys exceeds it by more than kLazy (one vote a tile), so most tiles take neither the
    // shuffles for the row max nor the rescale of O. A small grid's warps are bound by each
    // tile's latency chain, which this shortens (docs/decode.md).
    float prob[HT][NT][2], sv[HT][NT][2], lmx[HT];
    bool over = false;
#pragma unroll
    for (int t = 0; t < HT; ++t) {
      lmx[t] = -CUDART_INF_F;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = s_acc[n][2 * t + e];
          if constexpr (Traits::kSoftCap) v = p.soft_cap * tanhf(v * logit_scale) * 1.4426950408889634f;
          else v *= logit_scale;
          const int j = j0 + 8 * n + e;
          bool valid;
          if constexpr (Traits::kQTokens > 1) valid = j < row_end[t] && j >= row_lo[t];
          else valid = j < end;
          sv[t][n][e] = valid ? v : -CUDART_INF_F;
          lmx[t] = fmaxf(lmx[t], sv[t][n][e]);
        }
      }
      over |= st[t].lags(lmx[t]);  // no key yet: any key
    }
    if (__any_sync(0xffffffffu, over)) {
      float alpha[HT];
#pragma unroll
      for (int t = 0; t < HT; ++t) {
        float mx = lmx[t];
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        alpha[t] = st[t].move_max(fmaxf(st[t].m, mx));
        st[t].d *= alpha[t];
      }
      // O^T columns of this lane are heads 2c, 2c+1 (+8t): their factors sit in lanes 8c, 8c+4.
#pragma unroll
      for (int t = 0; t < HT; ++t) {
        const float a0 = __shfl_sync(0xffffffffu, alpha[t], 8 * c);
        const float a1 = __shfl_sync(0xffffffffu, alpha[t], 8 * c + 4);
#pragma unroll
        for (int i = 0; i < Traits::kMTiles; ++i) {
          o[i][t][0] *= a0;
          o[i][t][1] *= a1;
          o[i][t][2] *= a0;
          o[i][t][3] *= a1;
        }
      }
    }
#pragma unroll
    for (int t = 0; t < HT; ++t)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          prob[t][n][e] = st[t].prob(sv[t][n][e]);
          st[t].d += prob[t][n][e];
        }
    // P^T as B fragments: n-tile n of S is k-rows 8n .. 8n+7 of the O^T product.
    uint32_t pb[HT][NT];
#pragma unroll
    for (int t = 0; t < HT; ++t)
#pragma unroll
      for (int n = 0; n < NT; ++n) pb[t][n] = pack2<MT>(prob[t][n][0], prob[t][n][1]);

    // O^T += V^T P^T over the warp's 8 tokens.
    if constexpr (!Traits::kFp8) {
      static_assert(NT == 1, "16-bit caches take 8 tokens per warp");
      // ldmatrix.trans: lane l addresses token wt + l % 8 of chunk 4k + l / 8; registers
      // 0/1 are rows g / g+8 (dims 16(2k) + g, + 8 + g) of m-tile 2k, 2/3 those of 2k + 1.
#pragma unroll
      for (int k = 0; k < Traits::kMTiles / 2; ++k) {
        uint32_t r[4];
        ldmatrix_x4_trans(vs + v_off(wt + lane % 8, 4 * k + lane / 8), r);
#pragma unroll
        for (int t = 0; t < HT; ++t) {
          mma_k8<MT>(o[2 * k][t], r[0], r[1], pb[t][0]);
          mma_k8<MT>(o[2 * k + 1][t], r[2], r[3], pb[t][0]);
        }
      }
    } else {
      // Lane (g, c) reads tokens wt + 8n + 2c, + 1 (n < NT), bytes [g D/8, (g+1) D/8) of each
      // row, and pairs them by dim: m-tile i row g = dim g D/8 + 2i, row g + 8 = dim
      // g D/8 + 2i + 1; k-rows 8n + 2c, + 1 are the pair.
      constexpr int kSeg = D / 8;  // bytes (= dims) per lane per row: 8, 16 or 32
      uint32_t rows[NT][2][kSeg / 4];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int r2 = 0; r2 < 2; ++r2) {
          const int t = wt + 8 * n + 2 * c + r2;
          if constexpr (kSeg == 8) {
            const uint2 raw = lds64(vs + v_off(t, g / 2) + (g % 2) * 8);
            rows[n][r2][0] = raw.x;
            rows[n][r2][1] = raw.y;
          } else {
#pragma unroll
            for (int q = 0; q < kSeg / 16; ++q) {
              const uint4 raw = lds128(vs + v_off(t, g * (kSeg / 16) + q));
              rows[n][r2][4 * q + 0] = raw.x;
              rows[n][r2][4 * q + 1] = raw.y;
              rows[n][r2][4 * q + 2] = raw.z;
              rows[n][r2][4 * q + 3] = raw.w;
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < Traits::kMTiles; ++i) {
        // dims 2i, 2i+1 of the segment: bytes (2i) % 4 and + 1 of word (2i) / 4, each
        // paired with the same dim of the second token.
        const int wi = (2 * i) / 4;
        const uint32_t b0 = (2 * i) % 4, b1 = b0 + 1;
        // [token 0 dim 2i, token 1 dim 2i, token 0 dim 2i+1, token 1 dim 2i+1]
        const uint32_t sel = b0 | ((4 + b0) << 4) | (b1 << 8) | ((4 + b1) << 12);
        uint32_t a[NT][2];
#pragma unroll
        for (int n = 0; n < NT; ++n) fp8x4_to_half2x2<KV>(prmt(rows[n][0][wi], rows[n][1][wi], sel), a[n][0], a[n][1]);
#pragma unroll
        for (int t = 0; t < HT; ++t) {
          if constexpr (NT == 1) {
            mma_k8<MT>(o[i][t], a[0][0], a[0][1], pb[t][0]);
          } else {
            const uint32_t af[4] = {a[0][0], a[0][1], a[1][0], a[1][1]};
            mma_k16<MT>(o[i][t], af, pb[t][0], pb[t][1]);
          }
        }
      }
    }
  }

  // --- merge the warps: m, d per head and O per (head, dim) through shared memory ------------
  cp_async_wait<0>();
  launch.sync();  // every warp is done with the stages
  constexpr int kHeadsPad = 8 * HT;
  constexpr int OS = Traits::kOStride;
  float* red_o = reinterpret_cast<float*>(smem);                         // [warp][head][OS]
  float* red_md = red_o + Traits::kWarps * kHeadsPad * OS;               // [warp][head][2]
#pragma unroll
  for (int t = 0; t < HT; ++t) {
    st[t].d += __shfl_xor_sync(0xffffffffu, st[t].d, 1);
    st[t].d += __shfl_xor_sync(0xffffffffu, st[t].d, 2);
    if (c == 0) {
      red_md[(warp * kHeadsPad + g + 8 * t) * 2] = st[t].m;
      red_md[(warp * kHeadsPad + g + 8 * t) * 2 + 1] = st[t].d;
    }
#pragma unroll
    for (int i = 0; i < Traits::kMTiles; ++i) {
      int dim_lo, dim_hi;  // dims of rows g and g + 8 of m-tile i
      if constexpr (Traits::kFp8) {
        dim_lo = g * (D / 8) + 2 * i;
        dim_hi = dim_lo + 1;
      } else {
        dim_lo = 16 * i + g;
        dim_hi = dim_lo + 8;
      }
      float* base = red_o + (warp * kHeadsPad + 8 * t + 2 * c) * OS;
      base[dim_lo] = o[i][t][0];
      base[OS + dim_lo] = o[i][t][1];
      base[dim_hi] = o[i][t][2];
      base[OS + dim_hi] = o[i][t][3];
    }
  }
  launch.sync();

  // Thread -> (block row h, 4 dims); rows past the group tile are padding and never written.
  // Row h is local row h % kLiveRows of the warps that took KV head slot h / kLiveRows.
  constexpr int kSlots = Traits::kBlockRows * D / 4;
  constexpr int kWph = Traits::kWarpsPerHead;
  if constexpr (Traits::kCluster > 1) cluster_wait();  // every block of the cluster has started
  for (int slot_i = tid; slot_i < kSlots; slot_i += Traits::kThreads) {
    const int h = slot_i / (D / 4), x4 = slot_i % (D / 4);
    const int w0 = h / Traits::kLiveRows * kWph, hl = h % Traits::kLiveRows;
    float mw[kWph], mx = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < kWph; ++w) {
      mw[w] = red_md[((w0 + w) * kHeadsPad + hl) * 2];
      mx = fmaxf(mx, mw[w]);
    }
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float den = 0.f;
    if (mx != -CUDART_INF_F) {
#pragma unroll
      for (int w = 0; w < kWph; ++w) {
        const float wgt = exp2f(mw[w] - mx);
        den += wgt * red_md[((w0 + w) * kHeadsPad + hl) * 2 + 1];
        add_weighted4(acc, wgt, *reinterpret_cast<const float4*>(red_o + ((w0 + w) * kHeadsPad + hl) * OS + 4 * x4));
      }
    }
    const Merged merged_state = merged(mx, den, p.v_scale);  // no key: zeros and -inf, never NaN
    const float norm = merged_state.norm, lse = merged_state.lse;
    const int qo_head = block_head0 + row_head(h);
    if constexpr (Traits::kCluster > 1) {
      // dims 4 x4 .. 4 x4 + 3 of head h to the block that merges them, at this block's rank
      const unsigned dst = 4 * x4 / Traits::kSlice;
      float* recv_lse = reinterpret_cast<float*>(smem + Traits::kRecvOffset);
      float* slot = recv_lse + Traits::kCluster * Traits::kBlockRows +
                    (rank * Traits::kBlockRows + h) * Traits::kSlice + 4 * x4 % Traits::kSlice;
      st_cluster_f32x4(map_shared_rank(slot, dst), acc.x * norm, acc.y * norm, acc.z * norm, acc.w * norm);
      if (4 * x4 % Traits::kSlice == 0) st_cluster_f32(map_shared_rank(recv_lse + rank * Traits::kBlockRows + h, dst), lse);
    } else if (partial_row < 0) {
      store_out4(static_cast<O*>(p.out) + b * p.out_stride_b + qo_head * p.out_stride_h + 4 * x4, acc, norm);
      if (p.lse != nullptr && x4 == 0) p.lse[b * p.num_qo_heads + qo_head] = lse;
    } else {
      const int64_t at = (int64_t(partial_row) * p.num_qo_heads + qo_head) * D + 4 * x4;
      if (Traits::kBf16Partials && p.merge_counters != nullptr) {  // read by the merge below only
        store_out4(reinterpret_cast<O*>(p.partial_o) + at, acc, norm);
      } else {  // float32, as the separate merge kernel reads them
        *reinterpret_cast<float4*>(p.partial_o + at) = make_float4(acc.x * norm, acc.y * norm, acc.z * norm, acc.w * norm);
      }
      if (x4 == 0) p.partial_lse[int64_t(partial_row) * p.num_qo_heads + qo_head] = lse;
    }
  }
  if constexpr (Traits::kCluster > 1) {
    // the barrier's release orders this block's remote stores before every block's acquire
    // (st.async stores counted on the receiver's mbarrier were no faster: the chain, not
    // its protocol, is the merge's time; docs/history/decode.md)
    cluster_arrive_release();
    cluster_wait();
    cluster_merge<Traits>(p, b, block_head0, rank, smem);
    return;
  }
  if (partial_row < 0 || p.merge_counters == nullptr) return;

  // --- split request: the last of its blocks (for this head tile) merges the partials -------
  // (merge.cuh last_of_split: one counter per request and head block)
  auto counter = [&] {
    return SplitCounter{p.merge_counters + b * head_blocks + head_block, p.merge_indptr[b + 1] - p.merge_indptr[b]};
  };
  if (!last_of_split(tid == 0, *reinterpret_cast<int*>(smem + Traits::kFlagOffset), counter,
                     [&] { launch.sync(); }))
    return;
  // Parallel over partials: per head, the lanes of a warp find the largest LSE and the
  // weights 2^(lse_i - max) (kept in shared memory); then each thread sums one (head,
  // 4 dims) over the partials, 16 loads in flight (a serial loop waits for L2 once per
  // partial).
  const int begin = p.merge_indptr[b], count = p.merge_indptr[b + 1] - begin;
  constexpr int kRowsT = Traits::kBlockRows;
  float* head_m = reinterpret_cast<float*>(smem);  // [kRowsT]
  float* head_den = head_m + kRowsT;                // [kRowsT]
  float* weight = head_den + kRowsT;                // [partial][kRowsT], the first kMaxParts
  constexpr int kMaxParts = (Traits::kFlagOffset / 4 - 2 * kRowsT) / kRowsT;
  auto part_lse = [&](int i, int h) {
    return __ldcg(p.partial_lse + int64_t(begin + i) * p.num_qo_heads + block_head0 + row_head(h));
  };
  // Warp w takes heads w, w + 4, ...; their LSEs of partials lane, lane + 32, ... load
  // together, and partials 0..31 stay in registers for the weights (one round trip for
  // every head when count <= 32, not two per head).
  constexpr int kHeadsPerWarp = (kRowsT + Traits::kWarps - 1) / Traits::kWarps;
  constexpr int kSlotsT = kRowsT * (D / 4);
  const int64_t row_stride = int64_t(p.num_qo_heads) * D;
  // Partial outputs: bf16 or float32 elements (kBf16Partials), 4 dims a load.
  using PartialT = std::conditional_t<Traits::kBf16Partials, O, float>;
  auto slot_src = [&](int slot_i) {
    return reinterpret_cast<const PartialT*>(p.partial_o) +
           (int64_t(begin) * p.num_qo_heads + block_head0 + row_head(slot_i / (D / 4))) * D + 4 * (slot_i % (D / 4));
  };
  float lse0[kHeadsPerWarp], mx[kHeadsPerWarp], den[kHeadsPerWarp];
#pragma unroll
  for (int j = 0; j < kHeadsPerWarp; ++j) {
    const int h = warp + j * Traits::kWarps;
    lse0[j] = h < kRowsT && lane < count ? part_lse(lane, h) : -CUDART_INF_F;
  }
#pragma unroll
  for (int j = 0; j < kHeadsPerWarp; ++j) {
    const int h = warp + j * Traits::kWarps;
    mx[j] = lse0[j];
    if (h < kRowsT)
      for (int i = lane + 32; i < count; i += 32) mx[j] = fmaxf(mx[j], part_lse(i, h));
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], off));
  }
#pragma unroll
  for (int j = 0; j < kHeadsPerWarp; ++j) {
    const int h = warp + j * Traits::kWarps;
    if (h >= kRowsT) continue;  // warp-uniform
    const bool none = mx[j] == -CUDART_INF_F;
    den[j] = 0.f;
    if (lane < count) {
      const float w = none ? 0.f : exp2f(lse0[j] - mx[j]);
      den[j] = w;
      if (lane < kMaxParts) weight[lane * kRowsT + h] = w;
    }
    for (int i = lane + 32; i < count; i += 32) {
      const float w = none ? 0.f : exp2f(part_lse(i, h) - mx[j]);
      den[j] += w;
      if (i < kMaxParts) weight[i * kRowsT + h] = w;
    }
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) den[j] += __shfl_xor_sync(0xffffffffu, den[j], off);
    if (lane == 0) {
      head_m[h] = mx[j];
      head_den[h] = den[j];
    }
  }
  launch.sync();
  for (int slot_i = tid; slot_i < kSlotsT; slot_i += Traits::kThreads) {
    const int h = slot_i / (D / 4), x4 = slot_i % (D / 4);
    const PartialT* src = slot_src(slot_i);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    const int cached = min(count, kMaxParts);
    // Batches of 16 loads, all issued before any is used. Past the end a load repeats the
    // last partial with weight 0: unconditional loads issue back to back (a run-time-count
    // loop unrolled by the compiler left a serial remainder; loads under a condition were
    // slower).
    for (int i0 = 0; i0 < cached; i0 += 16) {
      float4 u[16];
#pragma unroll
      for (int j = 0; j < 16; ++j)
        u[j] = load4_cg(src + min(i0 + j, cached - 1) * row_stride);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float w = i0 + j < cached ? weight[(i0 + j) * kRowsT + h] : 0.f;
        acc.x += w * u[j].x;
        acc.y += w * u[j].y;
        acc.z += w * u[j].z;
        acc.w += w * u[j].w;
      }
    }
    for (int i = cached; i < count; ++i) {  // beyond the shared-memory weights (rare)
      const float w = head_m[h] == -CUDART_INF_F ? 0.f : exp2f(part_lse(i, h) - head_m[h]);
      const float4 u = load4_cg(src + i * row_stride);
      acc.x += w * u.x;
      acc.y += w * u.y;
      acc.z += w * u.z;
      acc.w += w * u.w;
    }
    const float den = head_den[h];
    const bool empty = den == 0.f;  // every partial empty: zeros and -inf
    const float norm = empty ? 0.f : 1.f / den;
    const int qo_head = block_head0 + row_head(h);
    O* out = static_cast<O*>(p.out) + b * p.out_stride_b + qo_head * p.out_stride_h + 4 * x4;
    store_out4(out, acc, norm);
    if (p.lse != nullptr && x4 == 0) p.lse[b * p.num_qo_heads + qo_head] = empty ? -CUDART_INF_F : head_m[h] + log2f(den);
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSM)
    decode_mma_kernel(const __grid_constant__ DecodeParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  decode_mma_block<Traits>(p, static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x),
                           smem, StreamLaunch{p.dependent_launch != 0});
}

template <class Traits>
int launch_decode_mma(const DecodeParams& p, int grid_items, int num_kv_heads, cudaStream_t stream, bool pdl) {
  if (grid_items <= 0) return 0;
  if (grid_items % Traits::kCluster != 0) return static_cast<int>(cudaErrorInvalidValue);  // whole clusters only
  if (const int err = allow_dynamic_smem<decode_mma_kernel<Traits>>(Traits::kSmemBytes)) return err;
  if (const int err = allow_cluster_size<decode_mma_kernel<Traits>>(Traits::kCluster)) return err;
  const dim3 grid(num_kv_heads / Traits::kKvHeads * (p.group / Traits::kTileHeads), grid_items);
  DecodeParams params = p;
  params.dependent_launch = pdl ? 1 : 0;
  return launch_kernel_ex(decode_mma_kernel<Traits>, grid, dim3(Traits::kThreads), Traits::kSmemBytes, stream, pdl,
                          Traits::kCluster, params);
}

}  // namespace fij

// Batch prefill on tensor cores (mma.sync m16n8k16, ldmatrix, cp.async; sm_80 and later).
//
// The algorithm is prefill_attend(), inside the block function prefill_block(): one work item (csrc/prefill/prefill_params.h PrefillItem) = a
// tile of kRows query rows of one request and one KV head against one chunk of the
// request's keys. The rows of a tile are (token, query head of the group) pairs, token-
// major (row r: token r / group, head r % group), so a GQA group fills the mma rows even
// for a request of one to a few tokens, and every K/V tile is read once for the group.
// prefill_kernel is a thin loop over the work list around it; POD calls the same function.
//
// A block is 4 warps (8 for head_dim 256's 128-row tile); warp w owns rows
// [w 16 kMFrags, (w + 1) 16 kMFrags). Per K/V tile of kTileKV keys, staged kStages deep by
// cp.async:
//   S = Q K^T    A = Q from shared memory (ldmatrix), B = K rows (ldmatrix): m16n8k16
//   online softmax on S's accumulators (log2 domain, rows reduced over a lane quad)
//   O += P V     A = P straight from S's accumulators (the C layout of two n8 tiles is the
//                A layout of one k16 step), B = V rows (ldmatrix.trans)
// 16-bit tiles in shared memory are swizzled (16-byte chunk c of row r at c ^ (r % 8)), so
// the 8 rows an ldmatrix reads fall on distinct banks. fp8 K/V arrive raw and are widened
// to fp16 tiles in one pass per tile; RoPE (ROPE_LLAMA) rotates q as it is loaded and each
// K tile in shared memory before use. ALiBi (csrc/common/pos_encoding.cuh) biases each
// logit by its row's slope times the key's distance to the row's position, in the log2
// domain, before the row max.
//
// Masks are applied only on tiles that need them (the chunk's end, the causal diagonal,
// the window's start, custom masks). A row that sees no key keeps m = -inf, d = 0 and
// writes zeros and lse = -inf (sinks: the sink's term alone); no inf - inf is formed.
#pragma once
#include <type_traits>
#include <math_constants.h>

#include "common/common.cuh"
#include "common/merge.cuh"
#include "common/mma.cuh"
#include "common/page_table.cuh"
#include "common/pos_encoding.cuh"
#include "common/rope.cuh"
#include "common/softmax.cuh"
#include "prefill/prefill_params.h"

namespace fij {

enum class PrefillMask : int { kNone = 0, kCausal = 1, kCustom = 2 };

template <typename TQ, typename TKV, typename TO, int HeadDimQK, int HeadDimVO, bool Ragged, PageTableLayout Table,
          PrefillMask Mask, PosEncoding Pos, bool SoftCap, bool Sinks, int MFrags>
struct PrefillTraits {
  static constexpr bool kRope = Pos == PosEncoding::kRopeLlama;
  static constexpr bool kAlibi = Pos == PosEncoding::kAlibi;
  using Q = TQ;
  using KV = TKV;
  using O = TO;
  using M = typename MmaTypeOf<TKV>::type;  // the mma's 16-bit type (fp16 for fp8 K/V)
  static constexpr bool kFp8 = sizeof(TKV) == 1;
  static constexpr int kDQK = HeadDimQK, kDVO = HeadDimVO;
  // A 128-row tile at head_dim_qk >= 256 (kWide): 8 warps of 16 rows (32 rows a warp would
  // hold 256 output accumulators a lane), one block an SM; K/V tiles of 64 keys, each read
  // once for 128 rows. Else 4 warps, 16 kMFrags rows each.
  static constexpr bool kWide = HeadDimQK >= 256 && MFrags == 2;
  // Head_dim_vo 512 (kVoSplit 2; the 64-row tile only): a 16-row warp would hold 256 output
  // accumulators a lane, so two warps take each 16-row slice, warp w rows of slice
  // w % kRowWarps and output dims [(w / kRowWarps) 256, + 256): 128 accumulators a lane, as
  // head_dim 256's tiles. Both warps of a slice compute the same S = Q K^T and softmax from
  // the same shared-memory tiles (the same instructions on the same values, so the same
  // results; no state crosses warps), at the price of the slice's QK^T twice (1.5x the
  // mma work of one pass). 8 warps, one block an SM: the q rows take 64 KB of shared
  // memory, two 32-key stages 128 KB.
  static constexpr int kVoSplit = HeadDimVO > 256 ? 2 : 1;
  static constexpr int kWarps = kWide ? 8 : 4 * kVoSplit;
  static constexpr int kRowWarps = kWarps / kVoSplit;  // warps of distinct rows
  static constexpr int kDVOWarp = HeadDimVO / kVoSplit;  // output dims a warp holds
  static constexpr int kThreads = 32 * kWarps;
  // Rows per warp: 16 kMFrags. Two 16-row fragments share every K/V fragment a warp reads
  // from shared memory (half the ldmatrix traffic per mma); head_dim 256 keeps one (its
  // 128 output accumulators a lane already).
  static constexpr int kMFrags = kWide ? 1 : MFrags;
  static constexpr int kRows = kRowWarps * 16 * kMFrags;
  // The 64-row tile at head_dim_qk <= 128 (kQuad): 32-key K/V tiles and four blocks an SM
  // (128 registers, 48 KB of shared memory at head_dim 128), where it ran 64-key tiles two
  // an SM. Its batches (short requests: speculative verification, small chunks) are bound
  // by the K/V read, which four smaller blocks an SM read faster, and 512 items (64
  // requests x 8 KV heads) run in one wave, not two. H100 A/B (docs/prefill.md): 64 x 4
  // tokens on 4k keys 1.02x at head_dim 128 (fp8 K/V 1.14x), 1.02-1.06x at 64; 64 x 16 on 1k
  // 1.08x; 256 requests of one token 0.99x. Three blocks an SM (168 registers): 0.82-0.95x.
  static constexpr bool kQuad = MFrags == 1 && HeadDimQK <= 128;
  // Keys a tile: 64 (32-row warps: 3-7% faster than 32 keys on the H100, for 44 bytes of
  // spills); 32 for 64-row tiles: at head_dim_qk >= 192 their q tile takes 48-64 KB (two
  // blocks an SM then still fit in shared memory), below it kQuad.
  static constexpr int kTileKV = (HeadDimQK >= 192 && !kWide) || kQuad ? 32 : 64;
  // Keys a softmax step takes: a 128-row tile computes its 64-key tiles in two halves (32
  // logit accumulators a lane, not 64, leave registers for the next fragments' loads).
  static constexpr int kSubKV = (kMFrags == 2 || kWide) && kTileKV == 64 ? 32 : kTileKV;
  static constexpr int kStages = 2;
  // Tiles in pairs (stage 0, then stage 1: every ldmatrix address a lane offset plus an
  // immediate, no per-tile address registers) and full tiles of a 128-row tile in one
  // 64-key softmax step (16 HMMAs a k step of S = Q K^T instead of 8; V fragments loaded
  // further ahead of their HMMAs). Measured on the H100 (docs/prefill.md): 1.03-1.09x at
  // head_dim 64 and for paged head_dim 128 (A/B at c5f680e); ragged head_dim 128 gains with
  // its k step's K fragments loaded before their mmas (1.04-1.10x against 6d5838c). For
  // 16-bit K/V without RoPE, soft cap, ALiBi or a custom mask (those, fp8 K/V and the 64-row
  // tile: not measured, and ptxas then spills in the loop; left as they were). Head_dim 256's
  // 128-row tile (kWide) takes the 64-key step without pairs.
  static constexpr bool kPairTiles = kMFrags == 2 && kTileKV == 64 && sizeof(TKV) == 2 && Pos == PosEncoding::kNone &&
                                     !SoftCap && Mask != PrefillMask::kCustom;
  static constexpr int kFullSubKV = kPairTiles || kWide ? kTileKV : kSubKV;
  // Those steps load a k step's K fragments before its mmas: ptxas then schedules them
  // further ahead of their HMMAs (1.04-1.10x for ragged head_dim 128 on the H100). Paged
  // rows gain only with the warp-blocked page copies of prefill_attend, which leave ptxas the
  // registers for it (alone 0.955-1.03x; together 1.01-1.06x, H200 A/B, docs/prefill.md).
  static constexpr bool kKFirst = kPairTiles || kWide;
  // K steps of S = Q K^T whose q fragments a warp holds in registers for the whole item
  // (loaded once, after q lands), not read from shared memory every tile; unmasked modules
  // only (their causal modules spilled 8-20 B and measured 0.98-1.02x). H200 A/B: head_dim
  // 64's 128-row tile, all 4 k steps (32 registers, 250-255 in all, no spills): non-causal
  // 1.02-1.07x; head_dim 256's 8-warp tile, 4 of its 16 k steps (16 registers; no spills,
  // 8 steps: 24 B): ragged 1.02-1.06x, paged 1.00-1.02x. Head_dim 128's 128-row tile, one
  // k step: 0.89-1.00x (spills), so none there. (16-bit K/V without RoPE, ALiBi or soft
  // cap, as kPairTiles: the others were not measured.)
  static constexpr bool kPlainLogits = Pos == PosEncoding::kNone && !SoftCap;
  static constexpr int kQRegSteps = Mask != PrefillMask::kNone || sizeof(TKV) != 2 || !kPlainLogits ? 0
                                    : kPairTiles && HeadDimQK == 64                               ? kDQK / 16
                                    : kWide                                                        ? 4
                                                                                                   : 0;
  // A kernel of one block an item that takes item blockIdx.x without reading the item count
  // first (prefill_kernel: one dependent global load less before an item's copies). Head_dim
  // 256's non-causal 128-row tile, which is never launched on a CUDA graph's fixed grid (its
  // plans keep the 64-row tile, and prefill_plan.h holds a pinned tile to max_tile_rows), so
  // its launch's grid is its item count. H100 A/B (docs/prefill.md): ragged 1.008-1.010x,
  // paged 0.998-1.001x; the causal tile measured 0.989-1.001x and head_dim 128's tiles
  // 0.980-1.002x without the count's load (with or without their loop), so neither takes it.
  static constexpr bool kOneItemABlock = kWide && Mask == PrefillMask::kNone;
  static constexpr int kQChunks = kDQK / 8;  // 16-byte chunks of a 16-bit row
  static constexpr int kKChunks = kDQK * int(sizeof(TKV)) / 16, kVChunks = kDVO * int(sizeof(TKV)) / 16;
  static constexpr int kQBytes = kRows * kDQK * 2;
  static constexpr int kKBytes = kTileKV * kDQK * int(sizeof(TKV)), kVBytes = kTileKV * kDVO * int(sizeof(TKV));
  static constexpr int kStageBytes = kKBytes + kVBytes;
  // fp8: the widened fp16 tiles the mma reads
  static constexpr int kWideBytes = kFp8 ? kTileKV * (kDQK + kDVO) * 2 : 0;
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes + kWideBytes;
  // Paged K/V copied a page a warp (prefill_attend): warp w copies rows [w kWarpRows,
  // (w + 1) kWarpRows) of a K/V tile, 32 / kKChunks rows a warp instruction. The 128-row
  // tiles of head_dim_qk >= 128 also get a kernel with only that copy path
  // (prefill_kernel<Traits, true>, chosen by launch_prefill): without the other paths' code
  // ptxas keeps bf16 head_dim 128's non-causal tile loop free of spills (1.02-1.04x on those
  // rows, H200 A/B; head_dim 64, whose loop did not spill: 0.94-1.01x, so not there).
  // K/V rows of whole 16-byte chunks a thread pass (head_dim_qk 192's rows of 12 or 24
  // chunks do not divide the block's threads: prefill_attend copies them by a general loop)
  static constexpr bool kWholeRows =
      kKChunks == kVChunks && kThreads % kKChunks == 0 && kTileKV % (kThreads / kKChunks) == 0;
  static constexpr int kWarpRows = kTileKV / kWarps;
  static constexpr bool kWarpPages = !Ragged && kWholeRows && kKChunks <= 32 && kWarpRows % (32 / kKChunks) == 0;
  static constexpr bool kWarpPagesKernel = kWarpPages && MFrags == 2 && HeadDimQK >= 128;
  // head_dim 128's ragged (16-bit) unmasked 128-row tile also gets a kernel without the
  // sliding window's code (prefill_kernel<Traits, false, true>), launched when there is
  // none: no spill reloaded in its tile loop, against 24 B of spills (1.007-1.016x on the
  // H100, docs/prefill.md); it runs its tiles one a trip, not in pairs (prefill_attend).
  // Not elsewhere: with it the ragged causal tile spilled 164 B (0 without), head_dim 256's
  // ragged tile 4 B (0), the page-a-warp kernels of head_dim 128 causal 32 B (20) and of
  // head_dim 256 8 B (0); head_dim 128's non-causal page-a-warp kernel 24 B (28), not
  // measured.
  static constexpr bool kNoWindowKernel = Ragged && MFrags == 2 && HeadDimQK == 128 && Mask == PrefillMask::kNone;
  // Whether pages hold a warp's rows of a tile: a power of two (page_shift: its log2, or -1)
  // of at least kWarpRows tokens. (The items must also start on a multiple of kWarpRows.)
  static FIJ_HOST_DEVICE bool pages_hold_warp_rows(int page_shift, int page_size) {
    return kWarpPages && page_shift >= 2 && page_size >= kWarpRows;
  }
  // Two blocks an SM (up to 255 registers a thread; capped at 168 for three blocks, the
  // 64-row tile of 64-key tiles spilled 180 bytes); four for kQuad (128 registers); one for
  // head_dim 256's 128-row tile.
  static constexpr int kMinBlocksPerSM = kWide || kVoSplit > 1 ? 1 : kQuad ? 4 : 2;
  static constexpr bool kRagged = Ragged;
  static constexpr PageTableLayout kTable = Table;
  static constexpr PrefillMask kMask = Mask;
  static constexpr bool kSoftCap = SoftCap;
  static constexpr bool kSinks = Sinks;
  static_assert(kDQK % 64 == 0 || kDQK == 192, "head_dim_qk: 64, 128, 192, 256 or 512");
  static_assert(kVoSplit == 1 || (MFrags == 1 && kDQK == kDVO), "head_dim 512: the 64-row tile of square heads");
  static_assert(kDVO % 16 == 0 && kQChunks % 8 == 0 && (kDVO / 8) % 8 == 0, "rows of whole 128-byte swizzle groups");
  static_assert(kMFrags == 1 || kMFrags == 2, "16 or 32 rows a warp");
  static_assert(!kRope || kDQK == kDVO, "RoPE rotates square heads");
  // (the ALiBi bias joins logits in the log2 domain, logit_scale applied first; PrefillSpec
  // rejects these combinations)
  static_assert(!(kAlibi && (kSoftCap || kSinks)), "ALiBi takes no soft cap and no sinks");
};

namespace prefill_detail {

// Element offset of (row, col) in a swizzled 16-bit tile of `chunks` 16-byte chunks a row;
// col is a multiple of 8 where a whole chunk is addressed.
template <int Chunks>
FIJ_DEVICE int swz(int row, int col) {
  return row * Chunks * 8 + ((((col >> 3) ^ row) & 7) | ((col >> 3) & ~7)) * 8 + (col & 7);
}

template <typename M>
FIJ_DEVICE void store8(M* dst, const float (&x)[8]) {
  uint4 w;
  w.x = mma_detail::pack2<M>(x[0], x[1]);
  w.y = mma_detail::pack2<M>(x[2], x[3]);
  w.z = mma_detail::pack2<M>(x[4], x[5]);
  w.w = mma_detail::pack2<M>(x[6], x[7]);
  *reinterpret_cast<uint4*>(dst) = w;
}

// Eight fp8 values (8 bytes at src) as eight fp16 (16 bytes at dst), exactly.
template <typename TKV>
FIJ_DEVICE void widen8(const void* src, void* dst) {
  const uint2 raw = *reinterpret_cast<const uint2*>(src);
  uint4 w;
  mma_detail::fp8x4_to_half2x2<TKV>(raw.x, w.x, w.y);
  mma_detail::fp8x4_to_half2x2<TKV>(raw.y, w.z, w.w);
  *reinterpret_cast<uint4*>(dst) = w;
}

// NeoX RoPE of the pair (lo = dims i .. i+7, hi = dims i + D/2 ..) at position pos.
template <int D>
FIJ_DEVICE void rope_pair(float (&lo)[8], float (&hi)[8], int i, float pos, float rcp_scale, float log2_theta) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float freq = rcp_scale * rope_inv_freq(float(i + e), float(D), log2_theta);
    float s, c;
    sincosf(pos * freq, &s, &c);
    rope_rotate(lo[e], hi[e], c, s);
  }
}

// Packed rows n, n + S, n + 2 S, ... (S a compile-time step) as element offsets of their
// (token, head) = divmod(row, group) in a tensor of token stride sn and head stride sh: one
// division for the first row, then each step adds S / group tokens and S % group heads, a
// head past the group wrapping into the next token (a few adds a row instead of a division
// and two multiplies).
struct PackedRowSteps {
  int64_t first;       // the first row's offset
  int64_t step, wrap;  // added a step; added too when the head wraps
  int rem, rem_step, group;
  FIJ_DEVICE PackedRowSteps(int n, int S, int group_, uint32_t magic, int64_t sn, int64_t sh) : group(group_) {
    const DivMod th = divmod(n, group, magic), st = divmod(S, group, magic);
    first = int64_t(th.quot) * sn + int64_t(th.rem) * sh;
    step = int64_t(st.quot) * sn + int64_t(st.rem) * sh;
    wrap = sn - int64_t(group) * sh;
    rem = th.rem;
    rem_step = st.rem;
  }
  // the offset from this row to the next
  FIJ_DEVICE int64_t next() {
    rem += rem_step;
    if (rem >= group) {
      rem -= group;
      return step + wrap;
    }
    return step;
  }
};

}  // namespace prefill_detail

// Where a request's K and V rows are: the paged cache through the page table, or ragged
// rows. locate(j) gives token j's K and V element offsets (head kv_head, dim 0) with one
// page-table lookup for both.
template <class Traits>
struct KVRows {
  const int32_t* k_ids;  // paged: the request's page ids
  const int32_t* v_ids;
  int64_t k_base, v_base;  // the head's offset (+ ragged: the request's first row)
  int64_t k_stride_page, v_stride_page, k_stride_token, v_stride_token;
  int page_size, page_shift;

  FIJ_DEVICE KVRows(const PrefillParams& p, const PrefillItem& item) {
    const int b = item.request, head = item.kv_head;
    k_stride_token = p.kv.k.stride_token;
    v_stride_token = p.kv.v.stride_token;
    k_base = int64_t(head) * p.kv.k.stride_head;
    v_base = int64_t(head) * p.kv.v.stride_head;
    if constexpr (Traits::kRagged) {
      const int64_t first = item.kv_first;
      k_base += first * k_stride_token;
      v_base += first * v_stride_token;
      k_ids = v_ids = nullptr;
      k_stride_page = v_stride_page = 0;
      page_size = 1;
      page_shift = 0;
    } else {
      // (a CSR row's start, indptr[b], comes with the item: no dependent load of it before
      // the first tile's page ids)
      PageTable<Traits::kTable> table{p.table};
      k_ids = table.k_row(b, item.kv_first);
      v_ids = table.v_row(b, item.kv_first);
      k_stride_page = p.kv.k.stride_page;
      v_stride_page = p.kv.v.stride_page;
      page_size = p.table.page_size;
      page_shift = p.page_shift;
    }
  }
  FIJ_DEVICE void locate(int j, int64_t& k_off, int64_t& v_off) const {
    if constexpr (Traits::kRagged) {
      k_off = k_base + int64_t(j) * k_stride_token;
      v_off = v_base + int64_t(j) * v_stride_token;
    } else {
      const int logical = page_shift >= 0 ? j >> page_shift : j / page_size;
      const int slot = j - logical * page_size;
      const int kp = __ldg(k_ids + logical);
      const int vp = Traits::kTable == PageTableLayout::kBlockTableKVSeparate ? __ldg(v_ids + logical) : kp;
      k_off = k_base + int64_t(kp) * k_stride_page + int64_t(slot) * k_stride_token;
      v_off = v_base + int64_t(vp) * v_stride_page + int64_t(slot) * v_stride_token;
    }
  }
};

// Shared-memory address of a swizzled 16-bit tile's row `row` at 16-byte chunk `chunk`
// (only the low 3 bits of the chunk are swizzled, with row % 8).
template <int Chunks>
FIJ_DEVICE uint32_t swz_addr(uint32_t tile, int row, int chunk) {
  return tile + uint32_t(row * Chunks + (chunk ^ (row & 7))) * 16u;
}

// Item i of the work list: pair i / num_kv_heads, KV head i % num_kv_heads
// (csrc/prefill/prefill_params.h).
FIJ_DEVICE PrefillItem load_prefill_item(const PrefillParams& p, int i) {
  const DivMod ph = divmod(i, p.kv.num_kv_heads, p.kv_head_magic);
  const int32_t* w = p.work + 1 + kPrefillPairInts * ph.quot;
  return PrefillItem{w[0], ph.rem, w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9], w[10],
                     w[kPrefillPairIdsAt + (threadIdx.x & (kPrefillPairIds - 1))]};
}

// A work item's attention: the tile's q rows against the chunk's keys; writes out/lse or
// its partial state (prefill_block adds the split's merge). smem: Traits::kSmemBytes.
// Every thread of the block calls it.
// WarpPagesOnly: every tile is copied a page a warp (Traits::kWarpPages; launch_prefill
// checks that the batch allows it), the other copy paths are not compiled in. NoWindow: no
// sliding window (launch_prefill checks window_left < 0), its code is not compiled in.
template <class Traits, bool WarpPagesOnly = false, bool NoWindow = false>
FIJ_DEVICE void prefill_attend(const PrefillParams& p, const PrefillItem& item, unsigned char* smem) {
  using namespace mma_detail;
  using namespace prefill_detail;
  using Q = typename Traits::Q;
  using KV = typename Traits::KV;
  using M = typename Traits::M;
  constexpr int DQK = Traits::kDQK, DVO = Traits::kDVO, TKV = Traits::kTileKV;
  constexpr int MF = Traits::kMFrags, ROWS = Traits::kRows, THREADS = Traits::kThreads;
  constexpr int QC = Traits::kQChunks, VOC = DVO / 8;  // 16-bit chunks a row
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c4 = lane % 4;
  // The warp's rows (rwarp: its 16 MF-row slice) and output dims [vo_part DVOW, + DVOW): the
  // warp itself and all of them but where head_dim 512 splits the dims (Traits::kVoSplit).
  // The K/V copies are spread over every warp (warp).
  constexpr int DVOW = Traits::kDVOWarp, OWC = DVOW / 8;  // output dims, 16-byte chunks a warp holds
  const int rwarp = Traits::kVoSplit == 1 ? warp : warp % Traits::kRowWarps;
  const int vo_part = Traits::kVoSplit == 1 ? 0 : warp / Traits::kRowWarps;

  M* sq = reinterpret_cast<M*>(smem);
  const uint32_t sq_u32 = smem_u32(sq);
  unsigned char* stages = smem + Traits::kQBytes;
  M* wide_k = reinterpret_cast<M*>(stages + Traits::kStages * Traits::kStageBytes);
  M* wide_v = wide_k + TKV * DQK;
  auto stage_k = [&](int s) { return reinterpret_cast<KV*>(stages + s * Traits::kStageBytes); };
  auto stage_v = [&](int s) { return reinterpret_cast<KV*>(stages + s * Traits::kStageBytes + Traits::kKBytes); };

  const int b = item.request, kv_head = item.kv_head, row0 = item.row0;
  const int group = p.group;
  const int qo_start = item.qo_start, qo_len = item.qo_len, kv_len = item.kv_len;
  const KVRows<Traits> rows(p, item);
  const int live_rows = min(ROWS, qo_len * group - row0);  // rows of this tile with a query
  const int delta = kv_len - qo_len;                         // row of token t sits at t + delta
  // packed row -> (token, head of the group), without a division
  auto split_row = [&](int pr) { return divmod(pr, group, p.group_magic); };
  const int pos_first = split_row(row0).quot + delta, pos_last = split_row(row0 + live_rows - 1).quot + delta;

  // Keys the tile reads: its chunk, cut by the causal diagonal of its last row and the
  // window of its first row.
  int start = item.kv_start, end = min(item.kv_end, kv_len);
  if constexpr (Traits::kMask == PrefillMask::kCausal) end = min(end, pos_last + 1);
  // (NoWindow: the kernel for launches without a sliding window, without its code; else
  // read from the params at each use, as ptxas allocates the loop best)
  auto window_left = [&]() { return NoWindow ? -1 : p.window_left; };
  if (window_left() >= 0) start = max(start, pos_first - window_left());
  const int num_tiles = end > start ? (end - start + TKV - 1) / TKV : 0;

  // --- q: the tile's rows, rotated at their positions, into swizzled shared memory --------
  // (token and head strides in 32 bits: the host checks that they fit; the request's and
  // the KV head's offset taken once)
  const Q* q_base = static_cast<const Q*>(p.q) + int64_t(qo_start) * p.q_stride_n + int64_t(kv_head * group) * p.q_stride_h;
  auto q_row = [&](int r) -> const Q* {  // null: a padding row
    if (r >= live_rows) return nullptr;
    const DivMod th = split_row(row0 + r);
    return q_base + (uint64_t(uint32_t(th.quot)) * uint32_t(p.q_stride_n) + uint32_t(th.rem) * uint32_t(p.q_stride_h));
  };
  // (no key to read: no q either; nothing is then in flight when the epilogue stages the
  // output in q's rows)
  if (num_tiles == 0) {
  } else if constexpr (std::is_same_v<Q, M> && !Traits::kRope && THREADS % QC == 0) {
    // a thread copies chunk tid % QC of rows tid / QC + it STEP, its source stepped by
    // PackedRowSteps; where every row of the tile holds a query and the group divides the
    // step (GQA groups of 1, 2, 4, 8), by a constant with no checks (16 rows: 61 instructions
    // a thread at head_dim 128, against about 700 with a division a row)
    constexpr int STEP = THREADS / QC;
    const int ch = tid % QC, r0 = tid / QC;
    PackedRowSteps rs(row0 + r0, STEP, group, p.group_magic, p.q_stride_n, p.q_stride_h);
    const Q* src = q_base + rs.first + ch * 8;
    if (live_rows == ROWS && rs.rem_step == 0) {
      // (rows STEP apart keep their swizzle where STEP is a multiple of 8: shared-memory
      // offsets step by a constant too)
      const uint32_t dst = sq_u32 + uint32_t(swz<QC>(r0, ch * 8)) * uint32_t(sizeof(M));
      const char* from = reinterpret_cast<const char*>(src);
      const int64_t step = rs.step * int64_t(sizeof(Q));
#pragma unroll
      for (int it = 0; it < ROWS / STEP; ++it) {
        if constexpr (STEP % 8 == 0) {
          cp_async_16(dst + uint32_t(it * STEP * QC * 16), from, true);
        } else {
          cp_async_16(sq + swz<QC>(r0 + it * STEP, ch * 8), from, true);
        }
        from += step;
      }
    } else {
#pragma unroll
      for (int it = 0; it < ROWS / STEP; ++it) {
        const int r = r0 + it * STEP;
        const bool live = r < live_rows;
        cp_async_16(sq + swz<QC>(r, ch * 8), live ? src : static_cast<const Q*>(p.q), live);
        src += rs.next();
      }
    }
  } else {
    constexpr int kPass = Traits::kRope ? QC / 2 : QC;  // RoPE: a thread takes a chunk and its partner
    for (int i = tid; i < ROWS * kPass; i += THREADS) {
      const int r = i / kPass, ch = i % kPass;
      const Q* src = q_row(r);
      float lo[8], hi[8];
      if (src == nullptr) {
#pragma unroll
        for (int e = 0; e < 8; ++e) lo[e] = hi[e] = 0.f;
      } else {
        load8_float<Q>(src + ch * 8, lo);
        if constexpr (Traits::kRope) {
          load8_float<Q>(src + ch * 8 + DQK / 2, hi);
          rope_pair<DQK>(lo, hi, ch * 8, float(split_row(row0 + r).quot + delta), p.rope_rcp_scale, p.rope_log2_theta);
        }
      }
      store8<M>(sq + swz<QC>(r, ch * 8), lo);
      if constexpr (Traits::kRope) store8<M>(sq + swz<QC>(r, ch * 8 + DQK / 2), hi);
    }
  }
  cp_async_commit();

  // --- K/V tiles: cp.async into stage s (16-bit: swizzled, fp8: raw rows) ------------------
  // A thread copies the same 16-byte chunk of every (THREADS / chunks)-th row, so its
  // shared-memory offsets step by constants; one page lookup serves a row's K and V.
  constexpr int KC = Traits::kKChunks, VC = Traits::kVChunks;
  // (head_dim_qk 192: rows of 12 or 24 chunks do not divide the block's threads; its copies
  // take the general loop, copy_tensor)
  constexpr bool kWholeRows = Traits::kWholeRows;
  constexpr int K_PASS = kWholeRows ? THREADS / KC : 1;  // rows a pass
  constexpr int KE = 16 / int(sizeof(KV));                      // elements a chunk
  const KV* k_data = static_cast<const KV*>(p.kv.k.data);
  const KV* v_data = static_cast<const KV*>(p.kv.v.data);
  const uint32_t stages_u32 = smem_u32(stages);
  // Paged rows with pages of 4 or more tokens (a power of two): a tile spans at most
  // TKV / 4 + 1 <= 32 pages, whose ids lane l holds (page kv0 / page_size + l), read a tile
  // ahead so that no copy waits on a page-table load; rows take theirs by shuffle.
  constexpr bool kIdsAhead = !Traits::kRagged && kWholeRows;
  constexpr bool kSeparate = Traits::kTable == PageTableLayout::kBlockTableKVSeparate;
  const bool ids_ahead = kIdsAhead && (WarpPagesOnly || rows.page_shift >= 2);
  // Warp-blocked pages: warp w copies the tile's rows [w RPW, (w + 1) RPW), which lie in one
  // page when pages hold at least RPW tokens and the item's keys start on a multiple of RPW
  // (every item but a sliding window's); the warp then takes one page id a tile and its
  // lanes step through the page as through ragged rows: no page arithmetic a row, 80-100
  // instructions a warp and tile instead of 170-200 (bf16 head_dim 128). Else the lookup a
  // row below.
  constexpr int RPW = Traits::kWarpRows;                  // rows a warp copies
  constexpr bool kWarpPages = Traits::kWarpPages;
  constexpr int RPI = kWarpPages ? 32 / KC : 1;           // rows a warp instruction
  static_assert(!WarpPagesOnly || kWarpPages, "a warp-pages-only kernel copies a page a warp");
  const bool warp_pages =
      WarpPagesOnly || (Traits::pages_hold_warp_rows(rows.page_shift, rows.page_size) && start % RPW == 0);
  int k_ids_lane = 0, v_ids_lane = 0;  // the next tile's page ids (ids_ahead)
  auto fetch_ids = [&](int kv0) {
    const int lp = (kv0 >> rows.page_shift) + lane;
    const bool in = lp <= (min(kv0 + TKV, end) - 1) >> rows.page_shift;
    k_ids_lane = in ? __ldg(rows.k_ids + lp) : 0;
    if constexpr (kSeparate) v_ids_lane = in ? __ldg(rows.v_ids + lp) : 0;
  };
  // One tensor's tile by the general loop (K: is_v false, V: true; rows of `chunks` 16-byte
  // chunks that need not divide the block's threads), one page lookup a row
  auto copy_tensor = [&](uint32_t tile, const KV* data, auto chunks, auto is_v, int kv0) {
    constexpr int C = decltype(chunks)::value;
#pragma unroll
    for (int it = 0; it < (TKV * C + THREADS - 1) / THREADS; ++it) {
      const int i = tid + it * THREADS;
      if (TKV * C % THREADS == 0 || i < TKV * C) {
        const int r = i / C, ch = i % C, j = kv0 + r;
        const bool valid = j < end;
        int64_t ko = 0, vo = 0;
        if (valid) rows.locate(j, ko, vo);
        cp_async_16(tile + (Traits::kFp8 ? uint32_t(r * C + ch) * 16u : swz_addr<C>(0, r, ch)),
                        data + (decltype(is_v)::value ? vo : ko) + ch * KE, valid);
      }
    }
  };
  // f(std::true_type) where every row of the tile at kv0 holds a key, else f(std::false_type)
  // (rows past the chunk's end copy nothing and zero-fill)
  auto by_fullness = [&](int kv0, auto&& f) {
    if (kv0 + TKV <= end) {
      f(std::true_type{});
    } else {
      f(std::false_type{});
    }
  };
  auto load_tile = [&](int kv0, int s) {
    const uint32_t k_tile = stages_u32 + s * Traits::kStageBytes, v_tile = k_tile + Traits::kKBytes;
    if constexpr (!kWholeRows) {  // head_dim_qk 192: K and V each by the general loop
      copy_tensor(k_tile, k_data, std::integral_constant<int, KC>{}, std::false_type{}, kv0);
      copy_tensor(v_tile, v_data, std::integral_constant<int, VC>{}, std::true_type{}, kv0);
    } else if (kWarpPages && warp_pages) {
      // lane: chunk lane % KC of rows wrow + g NI + it (g = lane / KC, it < NI), in the page
      // the warp's rows share; smem: (row & 7) = (g NI & 7) | it, so the swizzled chunk is the
      // lane's (ch ^ (g NI & 7)) XOR it, a constant
      constexpr int NI = RPW / RPI;
      const int wrow = warp * RPW, g = lane / KC, ch = lane % KC;
      const int first = kv0 >> rows.page_shift;
      const int j0 = kv0 + wrow;
      const int pg = ((j0 >> rows.page_shift) - first) & 31;
      const int kp = __shfl_sync(0xffffffffu, k_ids_lane, pg);
      const int vp = kSeparate ? __shfl_sync(0xffffffffu, v_ids_lane, pg) : kp;
      const int slot = (j0 & (rows.page_size - 1)) + g * NI;
      const char* kb = reinterpret_cast<const char*>(k_data + rows.k_base + int64_t(kp) * rows.k_stride_page +
                                                     int64_t(slot) * rows.k_stride_token + ch * KE);
      const char* vb = reinterpret_cast<const char*>(v_data + rows.v_base + int64_t(vp) * rows.v_stride_page +
                                                     int64_t(slot) * rows.v_stride_token + ch * KE);
      const int64_t kstep = int64_t(sizeof(KV)) * rows.k_stride_token, vstep = int64_t(sizeof(KV)) * rows.v_stride_token;
      const int r0 = wrow + g * NI;
      const int lim = end - kv0 - r0;  // row r0 + it holds a key: it < lim
      const uint32_t x = uint32_t(ch ^ ((g * NI) & 7));
      auto copy_rows = [&](auto full) {
        constexpr bool kFull = decltype(full)::value;
#pragma unroll
        for (int it = 0; it < NI; ++it) {
          const bool valid = kFull || it < lim;
          const uint32_t off = Traits::kFp8 ? uint32_t((r0 + it) * KC + ch) * 16u
                                            : uint32_t((r0 + it) * KC) * 16u + ((x ^ uint32_t(it & 7)) * 16u);
          cp_async_16(k_tile + off, kb, valid);
          cp_async_16(v_tile + off, vb, valid);
          kb += kstep;
          vb += vstep;
        }
      };
      by_fullness(kv0, copy_rows);
    } else if constexpr (!WarpPagesOnly) {  // one page lookup for the row's K and V
      // A thread's rows are r0 + it K_PASS at chunk ch: addresses step by constants (ragged:
      // K_PASS rows; shared memory: K_PASS rows keep the swizzle when a multiple of 8).
      const int r0 = tid / KC, ch = tid % KC;
      auto smem_off = [&](int it) -> uint32_t {
        const int r = r0 + it * K_PASS;
        if constexpr (Traits::kFp8) {
          return uint32_t(r * KC + ch) * 16u;
        } else if constexpr (K_PASS % 8 == 0) {
          return uint32_t(r * KC + (ch ^ (r0 & 7))) * 16u;
        } else {
          return swz_addr<KC>(0, r, ch);
        }
      };
      const int lim = end - kv0 - r0;  // row r0 + it K_PASS holds a key: it K_PASS < lim
      // (full: every row of the tile holds a key, by_fullness)
      auto copy_rows = [&](auto full) {
        constexpr bool kFull = decltype(full)::value;
        if constexpr (Traits::kRagged) {
          const char* kb = reinterpret_cast<const char*>(k_data + rows.k_base + int64_t(kv0 + r0) * rows.k_stride_token + ch * KE);
          const char* vb = reinterpret_cast<const char*>(v_data + rows.v_base + int64_t(kv0 + r0) * rows.v_stride_token + ch * KE);
          const int64_t kstep = int64_t(K_PASS * sizeof(KV)) * rows.k_stride_token;
          const int64_t vstep = int64_t(K_PASS * sizeof(KV)) * rows.v_stride_token;
#pragma unroll
          for (int it = 0; it < TKV / K_PASS; ++it) {
            const bool valid = kFull || it * K_PASS < lim;
            cp_async_16(k_tile + smem_off(it), kb, valid);
            cp_async_16(v_tile + smem_off(it), vb, valid);
            kb += kstep;
            vb += vstep;
          }
        } else if (ids_ahead) {  // the page ids fetched a tile ahead, one a lane
          const int first = kv0 >> rows.page_shift, slot_mask = (1 << rows.page_shift) - 1;
          const char* kb = reinterpret_cast<const char*>(k_data + rows.k_base + ch * KE);
          const char* vb = reinterpret_cast<const char*>(v_data + rows.v_base + ch * KE);
          const uint64_t ksp = uint64_t(rows.k_stride_page) * sizeof(KV), kst = uint64_t(rows.k_stride_token) * sizeof(KV);
          const uint64_t vsp = uint64_t(rows.v_stride_page) * sizeof(KV), vst = uint64_t(rows.v_stride_token) * sizeof(KV);
#pragma unroll
          for (int it = 0; it < TKV / K_PASS; ++it) {
            const int j = kv0 + r0 + it * K_PASS;
            const bool valid = kFull || it * K_PASS < lim;
            const int pg = ((j >> rows.page_shift) - first) & 31;
            const uint32_t kp = __shfl_sync(0xffffffffu, k_ids_lane, pg);
            const uint32_t vp = kSeparate ? __shfl_sync(0xffffffffu, v_ids_lane, pg) : kp;
            const uint32_t slot = j & slot_mask;
            cp_async_16(k_tile + smem_off(it), kb + kp * ksp + slot * kst, valid);
            cp_async_16(v_tile + smem_off(it), vb + vp * vsp + slot * vst, valid);
          }
        } else {
#pragma unroll
          for (int it = 0; it < TKV / K_PASS; ++it) {
            const bool valid = kFull || it * K_PASS < lim;
            int64_t ko = 0, vo = 0;
            if (valid) rows.locate(kv0 + r0 + it * K_PASS, ko, vo);
            cp_async_16(k_tile + smem_off(it), k_data + ko + ch * KE, valid);
            cp_async_16(v_tile + smem_off(it), v_data + vo + ch * KE, valid);
          }
        }
      };
      by_fullness(kv0, copy_rows);
    }
    cp_async_commit();
  };

  // Rows of this lane: (mf, half) -> row warp 16 MF + mf 16 + g + 8 half; their positions
  // and, with ALiBi, their heads' slopes (log2 domain; csrc/common/pos_encoding.cuh).
  int row_pos[MF][2];
  float row_slope[MF][2];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const DivMod th = split_row(row0 + rwarp * 16 * MF + mf * 16 + g + 8 * h);
      row_pos[mf][h] = th.quot + delta;
      row_slope[mf][h] = Traits::kAlibi ? alibi_slope_log2(kv_head * group + th.rem, p.num_qo_heads) : 0.f;
    }

  // The rows' online softmax (softmax.cuh); d sums this lane's keys of the row only.
  OnlineSoftmax<> st[MF][2];
  float o[MF][DVOW / 8][4];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int h = 0; h < 2; ++h) st[mf][h].init();
#pragma unroll
    for (int n = 0; n < DVOW / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mf][n][e] = 0.f;
  }
  // Logits' scale in the exponent (log2 e folded in by the host); soft-capped and ALiBi's
  // biased logits are already in the log2 domain.
  const float ls = Traits::kSoftCap || Traits::kAlibi ? 1.f : p.logit_scale;
  // A warp whose rows are all padding skips the math (it still copies and syncs).
  const bool warp_live = rwarp * 16 * MF < live_rows;
  const int64_t mask_base = Traits::kMask == PrefillMask::kCustom ? int64_t(p.mask_indptr[b]) * 8 : 0;

  // ldmatrix lane addresses. Lane l reads row r of a swizzled 16-bit tile at chunk 2 ks + h,
  // stored at chunk (2 ks + h) ^ (r % 8); in bytes (32 ks) ^ x with x = 16 (h ^ r % 8) < 128,
  // which is 128 (ks / 4) + ((32 (ks % 4)) ^ x). So four offsets a lane (k steps mod 4) and
  // immediates address every fragment, on a base that is the same for the whole block (the
  // stage): ptxas folds base + offset + immediate into the ldmatrix instead of keeping an
  // address a fragment in registers. A operands (q, and V through .trans) read rows l % 16 at
  // h = l / 16; K (the B operand) rows l % 8 + 8 (l / 16) at h = l / 8 % 2.
  struct {
    uint32_t q[4], k[4], v[4];
  } lane_off;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t ax = uint32_t((lane / 16) ^ (lane % 8)) * 16u, kx = uint32_t(((lane / 8) % 2) ^ (lane % 8)) * 16u;
    lane_off.q[j] = uint32_t((lane % 16) * QC) * 16u + ((32u * j) ^ ax);
    lane_off.v[j] = uint32_t((lane % 16) * VOC) * 16u + ((32u * j) ^ ax);
    lane_off.k[j] = uint32_t((lane % 8 + 8 * (lane / 16)) * QC) * 16u + ((32u * j) ^ kx);
  }
  const uint32_t q_warp = sq_u32 + uint32_t(rwarp * 16 * MF * QC) * 16u;  // the warp's q rows
  // q fragment of k step ks, row fragment mf (the warp's rows mf 16 ..)
  auto q_frag = [&](int ks, int mf, uint32_t(&a)[4]) {
    ldmatrix_x4(q_warp + lane_off.q[ks % 4] + uint32_t((ks / 4) * 128 + mf * 16 * QC * 16), a);
  };

  if (num_tiles > 0) {
    if (kIdsAhead && ids_ahead) {
      // The first tile's page ids came with the pair (item.first_id, written by plan()'s
      // page-order launch) where that tile is the chunk's first, spans at most
      // kPrefillPairIds pages and reads the table the launch read (no window: a run() with
      // one may read the ids as given); else loaded, a round trip after the work entry's.
      const int first = start >> rows.page_shift, last = (min(start + TKV, end) - 1) >> rows.page_shift;
      bool given = !kSeparate && window_left() < 0 && start == item.kv_start && last - first < kPrefillPairIds;
      given = given && __all_sync(0xffffffffu, lane > last - first || item.first_id >= 0);
      if (given) {
        k_ids_lane = lane <= last - first ? item.first_id : 0;
      } else {
        fetch_ids(start);
      }
    }
    load_tile(start, 0);
    if (kIdsAhead && ids_ahead && num_tiles > 1) fetch_ids(start + TKV);
  }
  constexpr int QR = Traits::kQRegSteps;
  uint32_t qreg[QR > 0 ? QR : 1][MF][4];
  if constexpr (QR > 0) {
    if (num_tiles > 0) {
      cp_async_wait<1>();  // q's copies (the first tile's are still in flight)
      __syncthreads();
#pragma unroll
      for (int ks = 0; ks < QR; ++ks)
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) q_frag(ks, mf, qreg[ks][mf]);
    }
  }
  // Tile `tile` in stage s (a constant where tiles run in pairs)
  auto tile_step = [&](int tile, auto stage) {
    const int s = stage;
    const int kv0 = start + tile * TKV;
    if (tile + 1 < num_tiles) {
      load_tile(kv0 + TKV, 1 - s);
      if (kIdsAhead && ids_ahead && tile + 2 < num_tiles) fetch_ids(kv0 + 2 * TKV);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const M* tk;
    const M* tv;
    if constexpr (Traits::kFp8) {
      // widen (and rotate) the tile into fp16 tiles
      // (fp8 to fp16 by decode's exact widening, csrc/common/mma.cuh, where nothing rotates)
      constexpr int kPass = Traits::kRope ? DQK / 16 : DQK / 8;
      for (int i = tid; i < TKV * kPass; i += THREADS) {
        const int r = i / kPass, ch = i % kPass;
        if constexpr (Traits::kRope) {
          float lo[8], hi[8];
          load8_float<KV>(stage_k(s) + r * DQK + ch * 8, lo);
          load8_float<KV>(stage_k(s) + r * DQK + ch * 8 + DQK / 2, hi);
          rope_pair<DQK>(lo, hi, ch * 8, float(kv0 + r), p.rope_rcp_scale, p.rope_log2_theta);
          store8<M>(wide_k + swz<QC>(r, ch * 8 + DQK / 2), hi);
          store8<M>(wide_k + swz<QC>(r, ch * 8), lo);
        } else {
          widen8<KV>(stage_k(s) + r * DQK + ch * 8, wide_k + swz<QC>(r, ch * 8));
        }
      }
      for (int i = tid; i < TKV * VOC; i += THREADS) {
        const int r = i / VOC, ch = i % VOC;
        widen8<KV>(stage_v(s) + r * DVO + ch * 8, wide_v + swz<VOC>(r, ch * 8));
      }
      __syncthreads();
      tk = wide_k;
      tv = wide_v;
    } else {
      tk = reinterpret_cast<const M*>(stage_k(s));
      tv = reinterpret_cast<const M*>(stage_v(s));
      if constexpr (Traits::kRope) {  // rotate the K tile in place
        for (int i = tid; i < TKV * (QC / 2); i += THREADS) {
          const int r = i / (QC / 2), ch = i % (QC / 2);
          M* lo_p = stage_k(s) + swz<QC>(r, ch * 8);
          M* hi_p = stage_k(s) + swz<QC>(r, ch * 8 + DQK / 2);
          float lo[8], hi[8];
          load8_float<M>(lo_p, lo);
          load8_float<M>(hi_p, hi);
          rope_pair<DQK>(lo, hi, ch * 8, float(kv0 + r), p.rope_rcp_scale, p.rope_log2_theta);
          store8<M>(lo_p, lo);
          store8<M>(hi_p, hi);
        }
        __syncthreads();
      }
    }

    // The tile's math; kMasked: with the masks (the chunk's end, causal, window, custom).
    auto compute = [&](auto masked) {
      // masked tiles keep the shorter step (their masks' registers)
      constexpr int SUB = decltype(masked)::value ? Traits::kSubKV : Traits::kFullSubKV, NTS = SUB / 8;
#pragma unroll
      for (int sub = 0; sub < TKV / SUB; ++sub) {  // keys sub SUB .. of the tile
      // (a masked tile that ends early, at the chunk's end or the causal diagonal of the
      // tile's last row, skips its sub-tiles past the end: causal tiles of 32 tokens end
      // half-way through every other 64-key tile)
      if (decltype(masked)::value && sub > 0 && kv0 + sub * SUB >= end) break;
      // S = Q K^T
      float sacc[MF][NTS][4];
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int n = 0; n < NTS; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) sacc[mf][n][e] = 0.f;
      // Lane addresses: row r of a tile at chunk 2 ks + hi sits at chunk (2 ks + hi) ^ (r % 8)
      // = 2 ks ^ (hi ^ r % 8): a per-lane base XOR a constant.
      const uint32_t tk_u32 = smem_u32(tk);
      // K fragment np (keys sub SUB + 16 np ..) of k step ks
      auto k_frag = [&](int ks, int np, uint32_t(&b)[4]) {
        ldmatrix_x4(tk_u32 + lane_off.k[ks % 4] + uint32_t((ks / 4) * 128 + (sub * SUB + np * 16) * QC * 16), b);
      };
#pragma unroll
      for (int ks = 0; ks < DQK / 16; ++ks) {
        uint32_t a[MF][4];
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
          if (ks < QR) {  // (ks < QR ? ks : 0: an index in bounds where QR is 0)
#pragma unroll
            for (int e = 0; e < 4; ++e) a[mf][e] = qreg[ks < QR ? ks : 0][mf][e];
          } else {
            q_frag(ks, mf, a[mf]);
          }
        }
        if constexpr (Traits::kKFirst) {
          // the k step's K fragments first, then its mmas row fragment by row fragment
          uint32_t bk[NTS / 2][4];
#pragma unroll
          for (int np = 0; np < NTS / 2; ++np) k_frag(ks, np, bk[np]);
#pragma unroll
          for (int mf = 0; mf < MF; ++mf)
#pragma unroll
            for (int np = 0; np < NTS / 2; ++np) mma_k16_pair<M>(sacc[mf][2 * np], sacc[mf][2 * np + 1], a[mf], bk[np]);
        } else {
#pragma unroll
          for (int np = 0; np < NTS / 2; ++np) {
            uint32_t bk[4];
            k_frag(ks, np, bk);
#pragma unroll
            for (int mf = 0; mf < MF; ++mf) mma_k16_pair<M>(sacc[mf][2 * np], sacc[mf][2 * np + 1], a[mf], bk);
          }
        }
      }
      // The keys each row may see, relative to this lane's first key jb = kv0 + 2 c4: the
      // chunk's end, the causal diagonal, the window's start
      int key_lo[MF][2], key_hi[MF][2];
      if constexpr (decltype(masked)::value) {
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int jb = kv0 + 2 * c4, pos = row_pos[mf][h];
            int hi = end - 1;
            if constexpr (Traits::kMask == PrefillMask::kCausal) hi = min(hi, pos);
            key_hi[mf][h] = hi - jb;
            key_lo[mf][h] = (window_left() >= 0 ? pos - window_left() : 0) - jb;
          }
      }
      // logits: soft-capped into the log2 domain, or left raw (the scale joins the exponent's
      // FFMA); masked where this tile needs it (kMasked: a separate copy of the tile's code,
      // so full tiles carry none of it)
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
        for (int n = 0; n < NTS; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = sacc[mf][n][e];
            if constexpr (Traits::kSoftCap) x = p.soft_cap_log2 * tanhf(x * p.logit_scale);
            if constexpr (Traits::kAlibi) {  // + slope (j - pos): <= 0 up to the causal diagonal
              const int j = kv0 + 2 * c4 + sub * SUB + n * 8 + (e & 1);
              x = fmaf(row_slope[mf][e >> 1], float(j - row_pos[mf][e >> 1]), x * p.logit_scale);
            }
            if constexpr (decltype(masked)::value) {
              // key j = jb + c sees row h iff lo <= j <= hi: c <= hi - jb and c >= lo - jb
              const int c = sub * SUB + n * 8 + (e & 1);
              bool ok = c <= key_hi[mf][e >> 1] && c >= key_lo[mf][e >> 1];
              if constexpr (Traits::kMask == PrefillMask::kCustom) {
                const int j = kv0 + 2 * c4 + c;
                const int pos = row_pos[mf][e >> 1];
                const int t = pos - delta;
                if (ok && t < qo_len) {
                  const int64_t bit = mask_base + int64_t(t) * kv_len + j;
                  ok = (__ldg(p.mask + (bit >> 3)) >> (bit & 7)) & 1;
                }
              }
              if (!ok) x = -CUDART_INF_F;
            }
            sacc[mf][n][e] = x;
          }
        }
      }
      // online softmax: per row, max over the lane quad, then rescale the state
      float scale[MF][2];
      bool grew = false;
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // (pairwise trees, not chains: two warps a scheduler leave a chain's latency exposed)
          float part[NTS];
#pragma unroll
          for (int n = 0; n < NTS; ++n) part[n] = fmaxf(sacc[mf][n][2 * h], sacc[mf][n][2 * h + 1]);
#pragma unroll
          for (int w = 1; w < NTS; w *= 2)
#pragma unroll
            for (int n = 0; n + w < NTS; n += 2 * w) part[n] = fmaxf(part[n], part[n + w]);
          float mx = part[0];
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          mx = mx * ls;  // log2 domain (ls > 0: the max commutes with the scale)
          // Lazy rescale (softmax.cuh): the warp skips the output's rescale when no row moved
          // its max (after a row's first keys, nearly always).
          const bool up = st[mf][h].lags(mx);
          scale[mf][h] = st[mf][h].move_max(up ? mx : st[mf][h].m);
#pragma unroll
          for (int n = 0; n < NTS; ++n) {
            sacc[mf][n][2 * h] = st[mf][h].prob(sacc[mf][n][2 * h], ls);
            sacc[mf][n][2 * h + 1] = st[mf][h].prob(sacc[mf][n][2 * h + 1], ls);
            part[n] = sacc[mf][n][2 * h] + sacc[mf][n][2 * h + 1];
          }
#pragma unroll
          for (int w = 1; w < NTS; w *= 2)
#pragma unroll
            for (int n = 0; n + w < NTS; n += 2 * w) part[n] += part[n + w];
          const float sum = part[0];
          st[mf][h].accumulate(scale[mf][h], sum);  // this lane's part of the row sum
          grew = grew || up;
        }
      }
      // The output's rescale, skipped when none of the warp's rows moved its max
      if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int n = 0; n < DVOW / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mf][n][e] *= scale[mf][e >> 1];
      }
      // O += P V
      // (the warp's dims of V: chunks vo_part OWC .., a multiple of 8, so the swizzle's low
      // bits and lane_off.v hold; 0 where the dims are not split)
      const uint32_t tv_u32 = smem_u32(tv) + uint32_t(vo_part * DVOW * 2);
#pragma unroll
      for (int kt = 0; kt < SUB / 16; ++kt) {
        uint32_t pa[MF][4];
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
          pa[mf][0] = pack2<M>(sacc[mf][2 * kt][0], sacc[mf][2 * kt][1]);
          pa[mf][1] = pack2<M>(sacc[mf][2 * kt][2], sacc[mf][2 * kt][3]);
          pa[mf][2] = pack2<M>(sacc[mf][2 * kt + 1][0], sacc[mf][2 * kt + 1][1]);
          pa[mf][3] = pack2<M>(sacc[mf][2 * kt + 1][2], sacc[mf][2 * kt + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < DVOW / 16; ++dp) {
          uint32_t bv[4];
          ldmatrix_x4_trans(tv_u32 + lane_off.v[dp % 4] + uint32_t((dp / 4) * 128 + (sub * SUB + kt * 16) * VOC * 16), bv);
#pragma unroll
          for (int mf = 0; mf < MF; ++mf) mma_k16_pair<M>(o[mf][2 * dp], o[mf][2 * dp + 1], pa[mf], bv);
        }
      }
      }
    };
    if (warp_live) {
      bool needs_mask = kv0 + TKV > end || Traits::kMask == PrefillMask::kCustom;
      if constexpr (Traits::kMask == PrefillMask::kCausal) needs_mask = needs_mask || kv0 + TKV - 1 > pos_first;
      if (window_left() >= 0) needs_mask = needs_mask || kv0 < pos_last - window_left();
      if (needs_mask) {
        compute(std::true_type{});
      } else {
        compute(std::false_type{});
      }
    }
    __syncthreads();  // the stage (and the widened tiles) are refilled next
  };
  static_assert(Traits::kStages == 2, "stage 1 - s is the next tile's");
  // The no-window kernel (head_dim 128's ragged unmasked tile) takes its tiles one a trip,
  // the 64-key step and K-first order kept: 5,280 instructions against 7,280 in pairs, and
  // faster on the H100 in all 13 A/B rows (1.002-1.037x, docs/prefill.md), though ptxas
  // spills 28 B (outside the tile loop) against 4 B.
  if constexpr (Traits::kPairTiles && !NoWindow) {
#pragma unroll 1
    for (int tile = 0; tile < num_tiles; tile += 2) {
      tile_step(tile, std::integral_constant<int, 0>{});
      if (tile + 1 < num_tiles) tile_step(tile + 1, std::integral_constant<int, 1>{});
    }
  } else {
    // (one tile a trip elsewhere: the pair's code is twice the size, and measured no faster)
#pragma unroll 1
    for (int tile = 0; tile < num_tiles; ++tile) tile_step(tile, tile % 2);
  }
  cp_async_wait<0>();  // q's copies, where no tile ran

  // --- epilogue: row sums over the quad, sinks, normalize, store ----------------------------
  if (!warp_live) return;
  float norm[MF][2];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      OnlineSoftmax<> row = st[mf][h];
      row.d += __shfl_xor_sync(0xffffffffu, row.d, 1);  // the row's whole sum
      row.d += __shfl_xor_sync(0xffffffffu, row.d, 2);
      const int r = rwarp * 16 * MF + mf * 16 + g + 8 * h;
      const DivMod th = split_row(row0 + r);
      const int t = th.quot, qo_head = kv_head * group + th.rem;
      if constexpr (Traits::kSinks) {
        if (item.chunk == 0 && r < live_rows) {
          const float scale = row.add_sink(p.sinks[qo_head] * 1.4426950408889634f);
#pragma unroll
          for (int n = 0; n < DVOW / 8; ++n) {
            o[mf][n][2 * h] *= scale;
            o[mf][n][2 * h + 1] *= scale;
          }
        }
      }
      norm[mf][h] = row.norm(p.v_scale);
      if (r >= live_rows) continue;
      // (ALiBi: the LSE of FlashInfer's bias slope (j - t), pos_encoding.cuh; -inf stays -inf)
      const float lse = Traits::kAlibi ? row.lse() + row_slope[mf][h] * float(delta) : row.lse();
      if (item.partial_row < 0) {
        if (p.lse != nullptr && c4 == 0 && vo_part == 0) p.lse[int64_t(qo_start + t) * p.num_qo_heads + qo_head] = lse;
      } else {
        const int64_t prow = int64_t(item.partial_row + t * item.chunks + item.chunk) * p.num_qo_heads + qo_head;
        float* dst = p.partial_o + prow * DVO + vo_part * DVOW;
#pragma unroll
        for (int n = 0; n < DVOW / 8; ++n)
          *reinterpret_cast<float2*>(dst + n * 8 + 2 * c4) =
              make_float2(o[mf][n][2 * h] * norm[mf][h], o[mf][n][2 * h + 1] * norm[mf][h]);
        if (c4 == 0 && vo_part == 0) p.partial_lse[prow] = lse;
      }
    }
  }
  // The output, normalized, into the warp's own q rows in shared memory (swizzled:
  // conflict-free), stored below in 16-byte pieces
  if (item.partial_row < 0) {
    using TO = typename Traits::O;
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      // stmatrix: four 8x8 tiles a call (rows 0-7 and 8-15 of columns n and n + 1), each
      // lane the address of one tile row: row (lane / 8 % 2) 8 + lane % 8 of the fragment,
      // chunk n + lane / 16, at (n + lane / 16) ^ (row % 8) = n ^ (lane / 16 ^ lane % 8)
      // (the warp's dims start at chunk vo_part OWC, a multiple of 8: outside the swizzle)
      const uint32_t row_addr =
          sq_u32 + uint32_t((rwarp * 16 * MF + mf * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * QC) * 16u +
          uint32_t(vo_part * DVOW * 2);
      const uint32_t x = uint32_t((lane >> 4) ^ (lane & 7)) * 16u;
#pragma unroll
      for (int n = 0; n < DVOW / 8; n += 2) {
        const uint32_t w0 = pack2<TO>(o[mf][n][0] * norm[mf][0], o[mf][n][1] * norm[mf][0]);
        const uint32_t w1 = pack2<TO>(o[mf][n][2] * norm[mf][1], o[mf][n][3] * norm[mf][1]);
        const uint32_t w2 = pack2<TO>(o[mf][n + 1][0] * norm[mf][0], o[mf][n + 1][1] * norm[mf][0]);
        const uint32_t w3 = pack2<TO>(o[mf][n + 1][2] * norm[mf][1], o[mf][n + 1][3] * norm[mf][1]);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                         row_addr + ((uint32_t(n) * 16u) ^ x)),
                     "r"(w0), "r"(w1), "r"(w2), "r"(w3));
      }
#else
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = rwarp * 16 * MF + mf * 16 + g + 8 * h;
        const uint32_t row_addr = sq_u32 + uint32_t(r * QC) * 16u + uint32_t(vo_part * DVOW * 2);
#pragma unroll
        for (int n = 0; n < DVOW / 8; ++n) {
          const uint32_t w = pack2<TO>(o[mf][n][2 * h] * norm[mf][h], o[mf][n][2 * h + 1] * norm[mf][h]);
          asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(row_addr + uint32_t((n ^ (r & 7)) * 16 + c4 * 4)), "r"(w));
        }
      }
#endif
    }
    __syncwarp();
    constexpr int kWarpRows = 16 * MF;
    static_assert(32 % OWC == 0, "whole output rows (of the warp's dims) a warp pass");
    // lane: chunk lane % OWC of the warp's dims of rows r0 + it STEP, its destination stepped by
    // PackedRowSteps
    constexpr int STEP = 32 / OWC;
    int r0 = rwarp * kWarpRows + lane / OWC;
    // (an empty asm ties what follows from r0 to this point: ptxas otherwise computed these
    // addresses before the tile loop and spilled them across it, 88 B at head_dim 128)
    asm volatile("" : "+r"(r0));
    PackedRowSteps rs(row0 + r0, STEP, group, p.group_magic, p.out_stride_n, p.out_stride_h);
    TO* dst = static_cast<TO*>(p.out) + int64_t(qo_start) * p.out_stride_n + int64_t(kv_head * group) * p.out_stride_h +
              rs.first + vo_part * DVOW + (lane % OWC) * 8;
    // The warp's rows read from shared memory first, all of them (rows past live_rows hold
    // the tile's unused rows: read, not stored), then stored: the reads' latencies overlap
    // instead of each store waiting on its own read behind a branch.
    uint4 vals[kWarpRows / STEP];
#pragma unroll
    for (int it = 0; it < kWarpRows / STEP; ++it)
      vals[it] = lds128(sq + swz<QC>(r0 + it * STEP, vo_part * DVOW + (lane % OWC) * 8));
#pragma unroll
    for (int it = 0; it < kWarpRows / STEP; ++it) {
      if (r0 + it * STEP < live_rows) *reinterpret_cast<uint4*>(dst) = vals[it];
      dst += rs.next();
    }
  }
}


// A split tile's merge, by the last of its chunk items to finish (for its KV head): the
// tile's rows from their partial states into out/lse, by csrc/common/merge.cuh's rule (max LSE,
// weights 2^(lse - max), chunks summed in order: deterministic), instead of a second
// kernel. Every thread of the block calls it after prefill_attend of work item `index` when
// p.merge_counters is set; smem: any 8 ROWS + 16 bytes. The counting: merge.cuh last_of_split.
// (Not inlined: the main loop's registers stay as they are without it.)
template <class Traits>
__device__ __noinline__ void prefill_merge_if_last(const PrefillParams& p, int index, unsigned char* smem) {
  constexpr int ROWS = Traits::kRows, THREADS = Traits::kThreads, DVO = Traits::kDVO;
  using TO = typename Traits::O;
  const PrefillItem item = load_prefill_item(p, index);  // (read again: nothing of it stays live across the tile)
  if (item.partial_row < 0) return;
  const int tid = threadIdx.x;
  const int num_kv_heads = p.num_qo_heads / p.group;
  const SplitCounter split{  // one a split tile and KV head
      p.merge_counters + (int64_t(item.partial_row) * p.group + item.row0) * num_kv_heads + item.kv_head, item.chunks};
  if (!last_of_split(tid == 0, *reinterpret_cast<int*>(smem), [&] { return split; })) return;
  const int b = item.request, group = p.group, chunks = item.chunks, H = p.num_qo_heads;
  const int qo_start = item.qo_start, qo_len = item.qo_len;
  const int live_rows = min(ROWS, qo_len * group - item.row0);
  float* row_max = reinterpret_cast<float*>(smem + 16);  // [ROWS]
  float* row_rcp = row_max + ROWS;                        // [ROWS]: 1 / sum of the weights, 0: no key
  // row r (token t, query head h): chunk c's state at partial row (partial_row + t chunks + c)
  auto state_of = [&](int r, int& t, int& h) -> int64_t {
    const DivMod th = divmod(item.row0 + r, group, p.group_magic);
    t = th.quot;
    h = item.kv_head * group + th.rem;
    return int64_t(item.partial_row + t * chunks) * H + h;  // chunk c: + c H
  };
  for (int r = tid; r < live_rows; r += THREADS) {
    int t, h;
    const int64_t s0 = state_of(r, t, h);
    float mx = -CUDART_INF_F;
    for (int c = 0; c < chunks; ++c) mx = fmaxf(mx, __ldcg(p.partial_lse + s0 + int64_t(c) * H));
    float den = 0.f;
    if (mx != -CUDART_INF_F)
      for (int c = 0; c < chunks; ++c) den += exp2f(__ldcg(p.partial_lse + s0 + int64_t(c) * H) - mx);
    row_max[r] = mx;
    row_rcp[r] = merged(mx, den).norm;
    if (p.lse != nullptr) p.lse[int64_t(qo_start + t) * H + h] = merged_lse(mx, den);
  }
  __syncthreads();
  constexpr int kSlots = DVO / 4;  // 4 dims a thread and step
  for (int i = tid; i < live_rows * kSlots; i += THREADS) {
    const int r = i / kSlots, d = (i % kSlots) * 4;
    int t, h;
    const int64_t s0 = state_of(r, t, h);
    const float mx = row_max[r];
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (mx != -CUDART_INF_F) {
      for (int c = 0; c < chunks; ++c) {
        const int64_t s = s0 + int64_t(c) * H;
        add_weighted4(acc, exp2f(__ldcg(p.partial_lse + s) - mx),
                      __ldcg(reinterpret_cast<const float4*>(p.partial_o + s * DVO + d)));
      }
    }
    const float rcp = row_rcp[r];
    store4(static_cast<TO*>(p.out) + int64_t(qo_start + t) * p.out_stride_n + int64_t(h) * p.out_stride_h + d,
           acc.x * rcp, acc.y * rcp, acc.z * rcp, acc.w * rcp);
  }
}

// The block function: work item `index` whole, the split's merge included (the last chunk
// of a split tile to finish merges it). prefill_kernel calls it for its items; POD calls it
// for its prefill blocks. It makes no grid-wide assumption: the kernel around it waits
// for the kernel before it (PDL) and loops over the grid. smem: Traits::kSmemBytes.
template <class Traits, bool WarpPagesOnly = false, bool NoWindow = false>
FIJ_DEVICE void prefill_block(const PrefillParams& p, int index, unsigned char* smem) {
  prefill_attend<Traits, WarpPagesOnly, NoWindow>(p, load_prefill_item(p, index), smem);
  if (p.merge_counters != nullptr) prefill_merge_if_last<Traits>(p, index, smem);
}

// The thin kernel: block i takes items i, i + gridDim.x, ... (a CUDA-graph grid is fixed
// and may be smaller or larger than the work list); a kOneItemABlock tile's block takes item
// blockIdx.x alone.
template <class Traits, bool WarpPagesOnly = false, bool NoWindow = false>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSM)
    prefill_kernel(const __grid_constant__ PrefillParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  pdl_wait();  // q, K/V and the outputs only after the kernel before (programmatic launch)
  if constexpr (Traits::kOneItemABlock) {  // the grid is the item count: item blockIdx.x
    prefill_block<Traits, WarpPagesOnly, NoWindow>(p, blockIdx.x, smem);
  } else {
    const int items = p.work[0];
    for (int i = blockIdx.x; i < items; i += gridDim.x) {
      prefill_block<Traits, WarpPagesOnly, NoWindow>(p, i, smem);
      __syncthreads();
    }
  }
  pdl_trigger();
}

// Whether every item of the launch can copy its K/V tiles a page a warp: pages of a power of
// two of at least a warp's rows (the page ids a lane: 4 tokens or more), and items starting
// on a multiple of 64 keys (the planner's chunks are; a sliding window starts anywhere).
template <class Traits>
bool prefill_warp_pages(const PrefillParams& p) {
  return Traits::pages_hold_warp_rows(p.page_shift, p.table.page_size) && p.window_left < 0;
}

template <class Traits, bool WarpPagesOnly, bool NoWindow>
int launch_prefill_kernel(const PrefillParams& p, int grid, cudaStream_t stream, bool pdl) {
  const int err = allow_dynamic_smem<prefill_kernel<Traits, WarpPagesOnly, NoWindow>>(Traits::kSmemBytes);
  if (err != 0) return err;
  return launch_kernel(prefill_kernel<Traits, WarpPagesOnly, NoWindow>, dim3(grid), dim3(Traits::kThreads),
                       Traits::kSmemBytes, stream, pdl, p);
}

// Which of a tile's kernels a launch of p takes (warp-page copies, no window, or the general
// one): calls f(std::bool_constant<WarpPagesOnly>, std::bool_constant<NoWindow>) and returns
// its result. prefill's own launch and POD's both choose by it.
template <class Traits, class F>
int with_prefill_variant(const PrefillParams& p, F&& f) {
  if constexpr (Traits::kWarpPagesKernel) {
    if (prefill_warp_pages<Traits>(p)) return f(std::true_type{}, std::false_type{});
  }
  if constexpr (Traits::kNoWindowKernel) {
    if (p.window_left < 0) return f(std::false_type{}, std::true_type{});
  }
  return f(std::false_type{}, std::false_type{});
}

template <class Traits>
int launch_prefill(const PrefillParams& p, int grid, cudaStream_t stream, bool pdl) {
  if (grid <= 0) return 0;
  return with_prefill_variant<Traits>(p, [&](auto warp_pages, auto no_window) {
    return launch_prefill_kernel<Traits, decltype(warp_pages)::value, decltype(no_window)::value>(p, grid, stream, pdl);
  });
}

}  // namespace fij

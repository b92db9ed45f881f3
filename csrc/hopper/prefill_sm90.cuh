// Batch prefill on Hopper (sm_90a): wgmma from shared memory, TMA loads, warp
// specialization, a persistent grid. Ragged or paged K/V; docs/hopper.md.
//
// One block per SM: a producer warpgroup and two consumer warpgroups (three for 192-row
// query tiles, at head_dim 64):
//   - warpgroup 0, the producer (24 registers): its first warp brings each item's Q tile and
//     its K and V tiles by TMA (128B swizzle) into two stages each, waiting on the stages'
//     "empty" barriers; Q has two stages too where shared memory allows (the next item's Q
//     loads while this one runs), else the next Q loads once every consumer has seen its
//     last Q K^T of this one complete. Paged K/V: one box a page, each page's box issued by
//     its own lane, the page ids of the next key tile read ahead of the stage's wait;
//   - warpgroups 1.., the consumers (240 registers, 160 with three), 64 query rows each:
//     S = Q K^T by wgmma from shared memory, the online softmax in registers, O += P V by
//     wgmma with P from registers and V MN-major. Tile n's S is issued before tile n - 1's
//     P V, and its softmax runs while that P V is on the tensor cores (intra-warpgroup
//     overlap); the consumers take turns to issue their wgmmas (ping-pong through named
//     barriers 1..), so one's softmax runs under the others' GEMMs.
// Items (one query tile of one query head) come from plan()'s list, heaviest first:
// block b takes item b, then each block's producer takes the next one left from an atomic
// counter (a greedy longest-first schedule, which keeps the SMs' sums close where the items
// differ, as a causal mask's do) and hands its index to the consumers in shared memory with
// the Q tile's barrier. The stages' barrier phases run on across items (one counter of key
// tiles).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "common/common.cuh"  // allow_dynamic_smem
#include "common/pos_encoding.cuh"  // alibi_slope_log2
#include "hopper/prefill_sm90_params.h"
#include "hopper/sm90.cuh"
#include "hopper/sm90_fp8.cuh"

namespace fij {

// The kernel's parameters, from PrefillSm90Args: the TMA maps encoded on the host
// (templates/prefill/prefill_sm90.cu.j2), passed as a __grid_constant__.
struct PrefillSm90Params {
  // q [q_tokens, num_qo_heads, D] as a TMA map (dims innermost first: D, heads, tokens;
  // 64-element boxes of 128 rows, 128B swizzle); K and V: ragged rows the same way (boxes
  // of the key tile's rows), or paged caches as 4-D maps (D, page_size, heads, pages:
  // boxes of one page's rows, whatever the layout's strides)
  CUtensorMap q_map, k_map, v_map;
  const int32_t* page_ids = nullptr;  // paged: the page table's indices
  int32_t page_shift = 0;             // paged: log2(page_size); a page divides the key tile
  void* out = nullptr;  // [q_tokens, num_qo_heads, D], any token and head strides
  int64_t out_stride_n = 0, out_stride_h = 0;
  float* lse = nullptr;  // [q_tokens, num_qo_heads] contiguous, base 2; null: not written
  const int32_t* work = nullptr;
  // [items taken past the first round, blocks done]: zeros between launches (the last
  // block to find no item left resets them)
  int32_t* counters = nullptr;
  int32_t num_qo_heads = 0;
  int32_t group = 1;        // num_qo_heads / num_kv_heads
  // sm_scale * q_scale * k_scale * log2(e); with a soft cap, sm_scale * q_scale * k_scale /
  // cap, the logits then cap * log2(e) * tanh(logit * that)
  float scale_log2 = 1.f;
  float soft_cap_log2 = 0.f;
  int32_t window_left = -1;  // a sliding window: row at position pos sees keys >= pos - window_left
  const float* sinks = nullptr;  // [num_qo_heads] logits (natural units) in each row's denominator; null: none
  float v_scale = 1.f;
  // a custom mask: the packed bits (little-endian; row i of a request sees key j where bit
  // base + i * kv_len + j is set, base the item's tile's entry of the work list's int64
  // array after the tiles), as 32-bit words of a buffer padded past the last bit read
  const uint32_t* mask = nullptr;
};

namespace sm90_prefill {

namespace h = fij::sm90;

constexpr int kStages = 2;

template <typename DType>
FIJ_SM90 uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<DType, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// A consumer thread's rows within its item: r0 and r0 + 8 of the tile (0..127); its key
// columns of a key tile: 8 j + cq (+ 1).
struct Rows {
  int r0, cq, first;  // first: the warpgroup's first row (0 or 64)
  int kv_len, diag;
  int window;          // PrefillSm90Params::window_left (-1: none)
  float scale_log2;    // the exponent's scale (1 with a soft cap: the capped logits are in log2 units)
  float cap_in, cap_log2;  // a soft cap: cap_log2 * tanh(s * cap_in); ALiBi: s * cap_in + bias
  float slope;             // ALiBi: the head's slope in log2 units (csrc/common/pos_encoding.cuh)
};

// kN: keys a K/V tile, 64, 80, 128 or 176 (the spec's key_tile; plan() counts key tiles in
// these units). 176, FA3's choice at head_dim 128 without a causal mask, takes fewer rounds
// of barriers and row reductions for the same work; head_dim 256 takes 64 (its Q tile is 64
// KB, two stages of 64-key K and V tiles 128 KB; O holds 128 registers a thread).
// kD: head_dim of q and K; V and the output take kDvo, the same but at 192 ((192, 128), the
// MLA-style pair: Q K^T over three 64-column atoms, P V and O over two).
template <int kD>
constexpr int sm90_head_dim_vo() {
  return kD == 192 ? 128 : kD;
}

// kM: query rows an item, 64 a consumer warpgroup: 128 (two consumers), or 192 (three, FA3's
// choice at head_dim 64, where one warpgroup's softmax takes about as long as the other's
// GEMMs and a third keeps the tensor cores fed).
// kStaleMax: the softmax's stale row max (kStaleLog2; off: the max moves with every tile and O
// is rescaled every tile, what POD on Hopper's prefill side runs: its kernel spilled 64 bytes
// with it and ran 1.07-1.20x the time on issue 62's mixes 2 and 4, H200, 63d94be).
// kFp8: FP8 attention, q, K and V in e4m3 (DType: the output's 16-bit type). Q K^T and P V
// run e4m3 wgmma (m64n128k32: a k-step is 32 bytes, as bf16's k16); 8-bit wgmma reads both
// operands K-major, so the producer warpgroup's warps 1-3 transpose each V tile into a V^T
// stage (sm90_fp8.cuh transpose_v_e4m3, keys in vt_key's order), and P is packed to e4m3
// where the softmax leaves it (pack_p_e4m3). Head_dim 128, 128-key tiles, ragged K/V.
template <typename DType, int kD, bool kCausal, int kN, bool kSoftCap = false, int kM = 128, bool kCustom = false,
          bool kAlibi = false, bool kStaleMax = true, bool kFp8 = false>
struct Sm90Kernel {
  static_assert(!(kCausal && kCustom), "a custom mask replaces the causal one");
  static_assert(!(kAlibi && kSoftCap), "ALiBi takes no soft cap");
  static_assert(kM == 128 || (kM == 192 && kD == 64), "192-row query tiles are for head_dim 64");
  static_assert(!kFp8 || (kD == 128 && kN == 128 && kM == 128 && !kCustom),
                "FP8 attention: head_dim 128, 128-key tiles");
  static constexpr int kBlockM = kM;
  static constexpr int kConsumers = kM / 64;            // consumer warpgroups
  static constexpr int kThreads = 128 * (1 + kConsumers);  // and the producer's
  // registers a thread after setmaxnreg (the file's 64K: 24 x 128 + 240 x 256, 24 x 128 + 160 x 384;
  // FP8 40 x 128 + 232 x 256, the producer's transposing warps holding a unit's four words)
  static constexpr int kProducerRegs = kFp8 ? 40 : 24, kConsumerRegs = kConsumers == 2 ? (kFp8 ? 232 : 240) : 160;
  // setmaxnreg moves registers within what the block was launched with: kThreads x the
  // launch's per-thread count (65536 / kThreads rounded down to 8: 168 at 384 threads, 128 at
  // 512). Asking for more blocks the consumers' setmaxnreg.inc forever (a hang, not an error:
  // 64 x 128 + 224 x 256 = 65536 hung the FP8 probe, branch next/fp8-vt-stages).
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536 / kThreads / 8 * 8 * kThreads,
                "setmaxnreg: the warpgroups' registers exceed the launch's");
  static constexpr int kBlockN = kN;
  static constexpr int kChains = kConsumers == 2 ? 4 : 2;  // softmax: partial row-max chains a row
  // softmax: how far (log2 units) a row's max may grow before it moves and O is rescaled
  static constexpr float kStaleLog2 = 8.f;
  // (FP8: P then stays below 2^8, within e4m3's 448, which pack_p_e4m3 saturates to)
  static_assert(!kFp8 || kStaleLog2 <= 8.f, "FP8 attention: P up to 2^kStaleLog2 must fit e4m3");
  static constexpr int kMaskChunks = (kN + 31) / 32;  // a custom mask: 32-bit chunks of a row's key tile
  using MaskBits = uint32_t[2][kMaskChunks];
  static constexpr int kDvo = sm90_head_dim_vo<kD>();
  static constexpr int kIn = kFp8 ? 1 : 2;               // bytes an element of q, K and V
  static constexpr int kAtomElems = 128 / kIn;            // elements a 128-byte swizzle atom's row
  static constexpr int kQBytes = kBlockM * kD * kIn;        // the Q tile
  static constexpr int kKTileBytes = kBlockN * kD * kIn;    // one K tile
  static constexpr int kVTileBytes = kBlockN * kDvo * kIn;  // one V tile (FP8: and one V^T tile)
  static constexpr int kQAtom = kBlockM * 128;         // a tile's rows of one 128-byte swizzle
  static constexpr int kKVAtom = kBlockN * 128;        // atom (1024-byte multiples)
  static constexpr int kAtoms = kD * kIn / 128;     // Q's and K's 128-byte atoms
  static constexpr int kVAtoms = kDvo * kIn / 128;  // V's
  static constexpr int kKSteps = kD * kIn / 32;     // Q K^T's k-steps (32 bytes each)
  static constexpr int kPaSteps = kBlockN * kIn / 32;  // P V's k-steps: P's A fragments
  // Two Q tiles where shared memory holds them (head_dim 64, and 128 with 128-key tiles):
  // the next item's Q then loads while this one runs, not after its last Q K^T, which
  // items of a few key tiles (short prompts, causal diagonals) wait for otherwise.
  static constexpr int kKVBytes = (kKTileBytes + kVTileBytes * (kFp8 ? 2 : 1)) * kStages;
  static constexpr int kQStages = 2 * kQBytes + kKVBytes + 1024 <= 227 * 1024 ? 2 : 1;
  static constexpr int kSmemBytes = kQBytes * kQStages + kKVBytes + 1024;
  static constexpr int kOut = kDvo / 2;  // O accumulators a thread
  static constexpr int kS = kBlockN / 2;  // S accumulators a thread

  // S = Q K^T of one key tile, issued (not waited for).
  static FIJ_SM90 void issue_qk(float (&s)[kS], uint32_t q_base, uint32_t k_tile) {
    h::wgmma_fence();
    const uint64_t a0 = h::make_desc(q_base, 16, 1024, h::Swizzle::k128B);
    const uint64_t b0 = h::kmajor_desc(k_tile, kBlockN, 0);
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      // k-step ks: atom ks / 4, 32 bytes a step inside it (h::kmajor_desc)
      const uint64_t a = h::desc_add(a0, (ks >> 2) * kQAtom + (ks & 3) * 32);
      const uint64_t b = h::desc_add(b0, (ks >> 2) * kKVAtom + (ks & 3) * 32);
      // S = Q K^T: the first k-step does not read the accumulators
      if constexpr (kFp8) {
        if (ks == 0)
          h::wgmma_ss_n128_e4m3<0>(s, a, b);
        else
          h::wgmma_ss_n128_e4m3<1>(s, a, b);
      } else if constexpr (kBlockN == 176) {
        if (ks == 0)
          h::wgmma_ss_n176<0, 0>(s, a, b, DType{});
        else
          h::wgmma_ss_n176<0>(s, a, b, DType{});
      } else if constexpr (kBlockN == 80) {
        if (ks == 0)
          h::wgmma_ss_n80<0, 0>(s, a, b, DType{});
        else
          h::wgmma_ss_n80<0>(s, a, b, DType{});
      } else if constexpr (kBlockN == 64) {
        if (ks == 0)
          h::wgmma_ss_n64<0, 0>(s, a, b, DType{});
        else
          h::wgmma_ss_n64<0>(s, a, b, DType{});
      } else {
        if (ks == 0)
          h::wgmma_ss_n128<0, 0>(s, a, b, DType{});
        else
          h::wgmma_ss_n128<0>(s, a, b, DType{});
      }
    }
    h::wgmma_commit();
  }

  // O += P V of one tile, P the A fragments of its k-steps, V MN-major (FP8: V^T K-major, a
  // head_dim column a row, keys in vt_key's order); issued.
  static FIJ_SM90 void issue_pv(float (&o)[kOut], uint32_t (&pa)[kPaSteps][4], uint32_t v_tile) {
    h::wgmma_fence();
    if constexpr (kFp8) {
#pragma unroll
      for (int kk = 0; kk < kPaSteps; ++kk) h::wgmma_rs_n128_e4m3<1>(o, pa[kk], h::kmajor_desc(v_tile, kDvo, kk));
    } else {
      const uint64_t b0 = h::make_desc(v_tile, kKVAtom, 1024, h::Swizzle::k128B);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint64_t b = h::desc_add(b0, kk * 16 * 128);
        if constexpr (kDvo == 256)
          h::wgmma_rs_n256<1>(o, pa[kk], b, DType{});
        else if constexpr (kDvo == 128)
          h::wgmma_rs_n128<1>(o, pa[kk], b, DType{});
        else
          h::wgmma_rs_n64<1>(o, pa[kk], b, DType{});
      }
    }
    h::wgmma_commit();
  }

  // The online softmax of key tile n (base 2): masks S (keys past kv_len; causal: key >
  // diag + row), moves the rows' max m (of the unscaled logits), rescales l, and leaves
  // P = 2^(S scale - m scale) in S's registers; corr: the factor O's rows take.
  // A custom mask's bits for this thread's two rows over key tile n: chunk c bit x is key
  // n * kBlockN + 32 c + x. Loaded before the tile's S is waited for (their latency under
  // the Q K^T). Rows past the tile's `rows` (not stored) read the last row's bits, so
  // every word read lies in the mask's buffer (plan() pads it past the last tile's keys).
  static FIJ_SM90 void load_mask(MaskBits& bits, const uint32_t* mask, int64_t base, int n, const Rows& r, int rows) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = min(r.r0 + 8 * i, rows - 1);
      const int64_t o = base + int64_t(row) * r.kv_len + int64_t(n) * kBlockN;
      const uint32_t* w = mask + (o >> 5);
      const int sh = static_cast<int>(o & 31);
      uint32_t words[kMaskChunks + 1];
#pragma unroll
      for (int c = 0; c <= kMaskChunks; ++c) words[c] = __ldg(w + c);
#pragma unroll
      for (int c = 0; c < kMaskChunks; ++c) bits[i][c] = __funnelshift_r(words[c], words[c + 1], sh);
    }
  }

  static FIJ_SM90 void softmax(float (&s)[kS], int n, const Rows& r, float (&m)[2], float (&l)[2],
                               float (&corr)[2]) {
    MaskBits none;
    softmax(s, n, r, m, l, corr, none);
  }
  struct NoMid {
    FIJ_SM90 void operator()(float) const {}
  };
  // bits: load_mask's (a custom mask only). mid: called with the partial row sums once half
  // of the tile's weights are out (the loop's wait for the P V before: its barrier reads them)
  template <bool kMayMask = true, class Mid = NoMid>
  static FIJ_SM90 void softmax(float (&s)[kS], int n, const Rows& r, float (&m)[2], float (&l)[2],
                               float (&corr)[2], const MaskBits& bits, Mid mid = Mid{}) {
    if constexpr (kSoftCap) {  // capped logits, in log2 units (m, P and the LSE follow in them)
#pragma unroll
      for (int i = 0; i < kS; ++i) s[i] = r.cap_log2 * tanhf(s[i] * r.cap_in);
    }
    const int key0 = n * kBlockN;
    if constexpr (kAlibi) {  // + slope (key - pos), pos = diag + row: <= 0 up to the causal diagonal
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + 8 * j + r.cq + (e & 1), pos = r.diag + r.r0 + 8 * (e >> 1);
          s[4 * j + e] = fmaf(r.slope, float(key - pos), s[4 * j + e] * r.cap_in);
        }
    }
    // a sliding window cuts keys below pos - window_left: up to the warpgroup's last row's
    const bool windowed = r.window >= 0 && key0 < r.diag + r.first + 63 - r.window;
    const bool edge = kMayMask && (kCustom || key0 + kBlockN > r.kv_len ||
                                   (kCausal && key0 + kBlockN - 1 > r.diag + r.first) || windowed);
    // Causal, and a custom mask at 128-key tiles: the bounds as columns c = 8 j + (e & 1) of this
    // thread's (key = key0 + cq + c), one compare of a constant a bound an element and fewer
    // registers live (ptxas, nvcc 13.0.88: the head_dim-64 causal 192-row modules' 76-88 bytes of
    // spills went, the custom mask's at 128-key tiles 32-36 to 0-4). H200 A/B (2026-11-30): the
    // causal rows 0.88-0.99x the time, but the non-causal ones 1.02-1.03x, which keep keys and
    // rows (as a custom mask at 80- or 176-key tiles, which spilled more with the bounds).
    if constexpr (kCausal || (kCustom && kBlockN == 128)) {
      if (edge) {
        const int base = key0 + r.cq, past = r.kv_len - base;  // keys from column `past` on: past kv_len
        int causal_to[2], window_from[2];  // row r0 + 8 i sees columns <= causal_to[i], >= window_from[i]
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          causal_to[i] = r.diag + r.r0 + 8 * i - base;
          window_from[i] = r.window >= 0 ? causal_to[i] - r.window : INT_MIN;
        }
        if (kCausal && r.window < 0) {
          // causal without a window (a warpgroup-uniform branch): keys past kv_len and past the
          // diagonal as one bound a row, one compare an element
          int last[2];
#pragma unroll
          for (int i = 0; i < 2; ++i) last[i] = min(causal_to[i], past - 1);
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (8 * j + (e & 1) > last[e >> 1]) s[4 * j + e] = -INFINITY;
        } else {
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int c = 8 * j + (e & 1), x = c + r.cq;
              const bool hidden = kCustom && ((bits[e >> 1][x >> 5] >> (x & 31)) & 1u) == 0u;
              if (c >= past || (kCausal && c > causal_to[e >> 1]) || c < window_from[e >> 1] || hidden)
                s[4 * j + e] = -INFINITY;
            }
        }
      }
    } else if (edge) {
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int x = 8 * j + r.cq + (e & 1), key = key0 + x, row = r.r0 + 8 * (e >> 1);
          const bool hidden = kCustom && ((bits[e >> 1][x >> 5] >> (x & 31)) & 1u) == 0u;
          if (key >= r.kv_len || (r.window >= 0 && key < r.diag + row - r.window) || hidden) s[4 * j + e] = -INFINITY;
        }
    }
    // the rows' maxima in kChains partial chains a row (four: a chain of kBlockN / 8 dependent
    // FMNMX, not kBlockN / 4, where two consumer warps a scheduler hide little latency; two
    // with three consumers, whose 160 registers a thread hold no more)
    float part[2][kChains];
#pragma unroll
    for (int c = 0; c < 2 * kChains; ++c) part[c / kChains][c % kChains] = m[c / kChains];
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = (kChains == 4 ? 2 * (j & 1) : 0) + (e & 1);
        part[e >> 1][c] = fmaxf(part[e >> 1][c], s[4 * j + e]);
      }
    float mx[2], base[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = kChains == 4 ? fmaxf(fmaxf(part[i][0], part[i][1]), fmaxf(part[i][2], part[i][kChains - 1]))
                           : fmaxf(part[i][0], part[i][1]);
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      // The max moves only where it grew by more than kStaleLog2 (log2 units): below that,
      // P's weights stay under 2^kStaleLog2 against the old max, which l, O and the LSE all
      // keep, so the result is the same, and O's rows need no rescale (corr exactly 1; the
      // loop skips the rescale where a warp's rows all keep theirs). A row's first key
      // always moves it (from -inf: the growth is +inf, or NaN with no key yet).
      if (!kStaleMax || !((mx[i] - m[i]) * r.scale_log2 <= kStaleLog2)) {
        // a row with no key yet: everything 0 (base 0 keeps -inf - base at -inf, not NaN)
        base[i] = mx[i] == -INFINITY ? 0.f : mx[i] * r.scale_log2;
        corr[i] = fast_exp2(m[i] * r.scale_log2 - base[i]);
        m[i] = mx[i];
      } else {
        base[i] = m[i] * r.scale_log2;
        corr[i] = 1.f;
      }
    }
    // P by the flush-to-zero MUFU alone (exp2f adds a range check and two multiplies an
    // exponent for subnormal results, weights below 2^-126 that cannot move a row's sum);
    // the rows' sums in two chains a row (one with three consumers)
    float sum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      if (j == kBlockN / 16) mid(sum[0][0] + sum[0][1] + sum[1][0] + sum[1][1]);
      const float p0 = fast_exp2(fmaf(s[4 * j], r.scale_log2, -base[0]));
      const float p1 = fast_exp2(fmaf(s[4 * j + 1], r.scale_log2, -base[0]));
      const float p2 = fast_exp2(fmaf(s[4 * j + 2], r.scale_log2, -base[1]));
      const float p3 = fast_exp2(fmaf(s[4 * j + 3], r.scale_log2, -base[1]));
      sum[0][kChains == 4 ? (j & 1) : 0] += p0 + p1;
      sum[1][kChains == 4 ? (j & 1) : 0] += p2 + p3;
      s[4 * j] = p0;
      s[4 * j + 1] = p1;
      s[4 * j + 2] = p2;
      s[4 * j + 3] = p3;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = fmaf(l[i], corr[i], sum[i][0] + sum[i][1]);
  }

  // P (in S's registers) to 16-bit A fragments of P V: k-step j / 2 takes {row r cols c, row
  // r + 8 cols c, row r cols c + 8, row r + 8 cols c + 8}. Only once the P V before is
  // complete: registers an in-flight wgmma reads must not be written (ptxas would serialize
  // the pipeline, advisory C7513).
  static FIJ_SM90 void pack_p(const float (&s)[kS], uint32_t (&pa)[kPaSteps][4]) {
    if constexpr (kFp8) {  // e4m3, packed in place against V^T's permuted keys
      h::pack_p_e4m3<0>(s, pa);
    } else {
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        pa[j / 2][(j & 1) * 2] = pack2<DType>(s[4 * j], s[4 * j + 1]);
        pa[j / 2][(j & 1) * 2 + 1] = pack2<DType>(s[4 * j + 2], s[4 * j + 3]);
      }
    }
  }

  // Whether any of this warp's rows moved its max in the last softmax (a warp-uniform branch
  // around rescale(): corr is exactly 1 on rows whose max stayed).
  static FIJ_SM90 bool moved(const float (&corr)[2]) {
    return __any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f);
  }

  static FIJ_SM90 void rescale(float (&o)[kOut], const float (&corr)[2]) {
#pragma unroll
    for (int j = 0; j < kDvo / 8; ++j) {
      o[4 * j] *= corr[0];
      o[4 * j + 1] *= corr[0];
      o[4 * j + 2] *= corr[1];
      o[4 * j + 3] *= corr[1];
    }
  }

  // Key tile n of item `tile` into a stage, issued by the producer warp (completes on
  // `full`). Ragged: lane 0, one box of the tile's rows an atom. Paged: lane i < pages the
  // boxes of the tile's page i (its id `page`, which the lane read ahead of the stage's
  // wait: next_page), only the request's pages (the last tile's rows past them are not
  // written: zero_tail clears V's before its P V).
  // (kTileAtoms: the tile's 64-column atoms, K's kAtoms or V's kVAtoms)
  template <bool kPaged, int kTileAtoms>
  static FIJ_SM90 void load_kv(const CUtensorMap* map, unsigned char* dst, uint64_t* full, const Sm90Tile& tile,
                               int n, int kv_head, int lane, int shift, int page) {
    if constexpr (!kPaged) {
      if (lane == 0) {
        h::mbar_expect_tx(full, kKVAtom * kTileAtoms);
#pragma unroll
        for (int a = 0; a < kTileAtoms; ++a)
          h::tma_load_3d(dst + a * kKVAtom, map, full, kAtomElems * a, kv_head, tile.kv_row0 + n * kBlockN);
      }
    } else {
      const int pages = tile_pages(tile, n, shift);
      if (lane == 0) h::mbar_expect_tx(full, (pages << shift) * 128 * kTileAtoms);
      __syncwarp();
      if (lane < pages) {
#pragma unroll
        for (int a = 0; a < kTileAtoms; ++a)
          h::tma_load_4d(dst + a * kKVAtom + (lane << shift) * 128, map, full, kAtomElems * a, 0, kv_head, page);
      }
    }
  }
  // Paged: the pages of key tile n that hold the request's keys, and lane `lane`'s page id
  // of that tile (0 past them, or past the item's tiles), read before it is needed.
  static FIJ_SM90 int tile_pages(const Sm90Tile& tile, int n, int shift) {
    const int first = (n * kBlockN) >> shift;
    return min(kBlockN >> shift, ((tile.kv_len + (1 << shift) - 1) >> shift) - first);
  }
  // v_ids: where the tile's V page ids start past its K ids (the work list's work[2]).
  static FIJ_SM90 int next_page(const PrefillSm90Params& p, const Sm90Tile& tile, int n, int lane, int v_ids = 0) {
    if (n >= tile.kv_tiles || lane >= tile_pages(tile, n, p.page_shift)) return 0;
    return p.page_ids[tile.kv_row0 + v_ids + ((n * kBlockN) >> p.page_shift) + lane];
  }

  // Zeros the rows of a V tile from `row` on (paged: the last tile's rows past kv_len hold
  // whatever the cache or an earlier tile left, NaN included, and P V multiplies them by
  // P's zeros). Whole 128-byte rows, so the swizzle does not matter; then made visible to
  // wgmma (the async proxy) and to the warpgroup's other warps. t: the thread in its
  // warpgroup; bar: the warpgroup's named barrier.
  static FIJ_SM90 void zero_tail(unsigned char* v_tile, int row, int t, int bar) {
    for (int off = row * 128 + t * 16; off < kBlockN * 128; off += 128 * 16)
#pragma unroll
      for (int a = 0; a < kVAtoms; ++a) *reinterpret_cast<uint4*>(v_tile + a * kKVAtom + off) = make_uint4(0, 0, 0, 0);
    h::fence_proxy_async();
    h::named_sync(bar, 128);
  }

  // The factors O's two rows of this thread take, 1 / l (times v_scale), and their LSE, which
  // lane cq 0 writes; l 0 (no key): 0 and -inf. A sink (a logit with no value) joins the
  // denominator first: a row with no key then writes 0 and the sink as its LSE, as the
  // mma.sync kernel does.
  static FIJ_SM90 void finish_rows(const PrefillSm90Params& p, const Sm90Tile& tile, int head, int r0, int cq,
                                   const float (&m)[2], const float (&l)[2], float (&inv)[2]) {
    const float m_scale = kSoftCap || kAlibi ? 1.f : p.scale_log2;
    const float sink = p.sinks != nullptr ? p.sinks[head] * 1.4426950408889634f : -INFINITY;  // log2 units
    // ALiBi: FlashInfer's bias is slope (key - i), i the row in the request; the softmax took
    // slope (key - pos), pos = i + kv_len - qo_len: the LSE gains slope (kv_len - qo_len), which
    // plan() leaves in the tile's `keys` (pos_encoding.cuh)
    const float shift = kAlibi ? alibi_slope_log2(head, p.num_qo_heads) * float(tile.keys) : 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r0 + 8 * r;
      float mlog2 = m[r] * m_scale, sum = l[r], sc = 1.f;  // (m -inf: no key)
      if (p.sinks != nullptr) {
        const float top = fmaxf(mlog2, sink);
        sc = exp2f(mlog2 - top);  // no key: 0
        sum = sum * sc + exp2f(sink - top);
        mlog2 = top;
      }
      inv[r] = sum > 0.f ? p.v_scale * sc / sum : 0.f;
      if (p.lse != nullptr && cq == 0 && row < tile.rows)  // (m times m_scale: log2 units; 1 with a soft cap)
        p.lse[(tile.q_row0 + row) * int64_t(p.num_qo_heads) + head] = sum > 0.f ? mlog2 + log2f(sum) + shift : -INFINITY;
    }
  }

  // O / l of this thread's two rows, straight from registers (4-byte stores), and the LSE.
  static FIJ_SM90 void store(const PrefillSm90Params& p, const Sm90Tile& tile, int head, int r0, int cq,
                             const float (&o)[kOut], const float (&m)[2], const float (&l)[2]) {
    float inv[2];
    finish_rows(p, tile, head, r0, cq, m, l, inv);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r0 + 8 * r;
      if (row >= tile.rows) continue;
      DType* out = static_cast<DType*>(p.out) + (tile.q_row0 + row) * p.out_stride_n + head * p.out_stride_h;
#pragma unroll
      for (int j = 0; j < kDvo / 8; ++j)
        *reinterpret_cast<uint32_t*>(out + 8 * j + cq) = pack2<DType>(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
    }
  }

  // O / l through shared memory: the warpgroup's own 64 rows of its item's Q tile (q_stage;
  // dead once its last Q K^T is complete) take O in Q's swizzled layout (stmatrix: a warp's
  // four 8 x 8 matrices an instruction, conflict-free), then leave in 16-byte stores, a row's
  // chunks from consecutive threads, where the output's rows and heads are 16-byte aligned
  // (else straight from registers). Every shared access by 32-bit address and the output's
  // pointer stepped a pass, not recomputed (the generic pointer cost 64-bit arithmetic and
  // ST.E / LD.E an access). wi: the warpgroup; t: the thread in it; bar: the warpgroup's
  // named barrier; q_empty: the stage's barrier, which this thread arrives on once its reads
  // of the stage are done (before its global stores: the next item's Q may load meanwhile).
  static FIJ_SM90 void store_staged(const PrefillSm90Params& p, const Sm90Tile& tile, int head, int wi, int t, int r0,
                                    int cq, const float (&o)[kOut], const float (&m)[2], const float (&l)[2],
                                    unsigned char* q_stage, int bar, uint64_t* q_empty) {
    const bool vec = ((reinterpret_cast<uintptr_t>(p.out) | uintptr_t(p.out_stride_n * 2) | uintptr_t(p.out_stride_h * 2)) & 15) == 0;
    if (!vec) {
      store(p, tile, head, r0, cq, o, m, l);
      h::mbar_arrive(q_empty);  // (the stage was not touched)
      return;
    }
    float inv[2];
    finish_rows(p, tile, head, r0, cq, m, l, inv);
    const uint32_t stage = h::smem_addr(q_stage);
    {
      // x4 over 16-byte chunks j, j + 1 (j even) of rows r0 and r0 + 8: matrix mt = 2 (c - j) + r;
      // lane l gives row l % 8 of matrix l / 8, whose chunk (j + l / 16) sits at
      // (j + l / 16) ^ (row % 8) = j ^ y (j even), row % 8 = l % 8
      const int lane = t % 32, row = 64 * wi + 16 * (t / 32) + 8 * ((lane / 8) & 1) + lane % 8;
      const int y = (lane / 16) ^ (lane % 8);
      const uint32_t row_addr = stage + row * 128;
#pragma unroll
      for (int j = 0; j < kDvo / 8; j += 2) {
        const uint32_t r[4] = {pack2<DType>(o[4 * j] * inv[0], o[4 * j + 1] * inv[0]),
                               pack2<DType>(o[4 * j + 2] * inv[1], o[4 * j + 3] * inv[1]),
                               pack2<DType>(o[4 * j + 4] * inv[0], o[4 * j + 5] * inv[0]),
                               pack2<DType>(o[4 * j + 6] * inv[1], o[4 * j + 7] * inv[1])};
        h::stmatrix_x4(row_addr + (j / 8) * kQAtom + (((j % 8) ^ y) * 16), r);
      }
    }
    h::named_sync(bar, 128);
    constexpr int kChunks = kDvo / 8, kRowsPass = 128 / kChunks;  // 16-byte chunks a row
    static_assert(kRowsPass % 8 == 0, "a thread's rows keep one swizzle phase");
    const int c = t % kChunks, sub = t / kChunks;
    const uint32_t src = stage + (c / 8) * kQAtom + (64 * wi + sub) * 128 + (((c % 8) ^ (sub % 8)) * 16);
    const int rows = tile.rows - 64 * wi - sub;  // this thread's rows i x kRowsPass < rows are the request's
    DType* out = static_cast<DType*>(p.out) + (tile.q_row0 + 64 * wi + sub) * p.out_stride_n + head * p.out_stride_h + 8 * c;
    const int64_t step = kRowsPass * p.out_stride_n;
    uint4 v[64 / kRowsPass];  // (O's registers are dead: room for all of them)
#pragma unroll
    for (int i = 0; i < 64 / kRowsPass; ++i)
      if (i * kRowsPass < rows) v[i] = h::lds128(src + i * kRowsPass * 128);
    h::fence_proxy_async();  // this thread's generic reads of the stage before the next TMA write
    h::mbar_arrive(q_empty);
#pragma unroll
    for (int i = 0; i < 64 / kRowsPass; ++i, out += step)
      if (i * kRowsPass < rows) h::stg128(out, v[i]);  // (as a uint4 store: four STG.E, H200 ncu at 39f6039)
  }

  // store_staged's earlier form, which the modules without a causal mask keep: 4-byte writes
  // through a generic pointer (64-bit address arithmetic, ST.E / LD.E), each output row's
  // address computed a pass. With store_staged instead, their long rows ran 1-4% slower on three
  // H200 A/Bs (2026-11-30) while the loop's SASS kept its instruction mix (its registers moved):
  // code generation, not the epilogue's own time. The caller releases the stage after it.
  static FIJ_SM90 void store_staged_words(const PrefillSm90Params& p, const Sm90Tile& tile, int head, int wi, int t, int r0,
                                    int cq, const float (&o)[kOut], const float (&m)[2], const float (&l)[2],
                                    unsigned char* q_stage, int bar) {
    const bool vec = ((reinterpret_cast<uintptr_t>(p.out) | uintptr_t(p.out_stride_n * 2) | uintptr_t(p.out_stride_h * 2)) & 15) == 0;
    if (!vec) return store(p, tile, head, r0, cq, o, m, l);
    float inv[2];
    finish_rows(p, tile, head, r0, cq, m, l, inv);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r0 + 8 * r;  // row % 8: lane / 4, so a warp's 8 rows take 8 distinct chunks
#pragma unroll
      for (int j = 0; j < kDvo / 8; ++j)
        *reinterpret_cast<uint32_t*>(q_stage + (j / 8) * kQAtom + row * 128 + (((j % 8) ^ (row % 8)) * 16) + cq * 2) =
            pack2<DType>(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
    }
    h::named_sync(bar, 128);
    constexpr int kChunks = kDvo / 8, kRowsPass = 128 / kChunks;  // 16-byte chunks a row
    const int c = t % kChunks;
#pragma unroll
    for (int i = 0; i < 64 / kRowsPass; ++i) {
      const int row = 64 * wi + i * kRowsPass + t / kChunks;
      if (row < tile.rows) {
        const uint4 v = *reinterpret_cast<const uint4*>(q_stage + (c / 8) * kQAtom + row * 128 + (((c % 8) ^ (row % 8)) * 16));
        DType* out = static_cast<DType*>(p.out) + (tile.q_row0 + row) * p.out_stride_n + head * p.out_stride_h + 8 * c;
        *reinterpret_cast<uint4*>(out) = v;
      }
    }
  }
};

// Key tile i, counted over every item a block has run, sits in stage i % kStages; its
// barriers' phase parity is (i / kStages) & 1 ("empty" waits take the other parity).
struct Stage {
  int s;
  uint32_t parity;
};
FIJ_SM90 Stage stage_of(int i) {  // (i >= 0: unsigned, no sign fix-ups)
  const uint32_t u = static_cast<uint32_t>(i);
  return {static_cast<int>(u % kStages), (u / kStages) & 1u};
}

FIJ_SM90 Sm90Tile load_tile(const int32_t* work, int t) {
  const int4* at = reinterpret_cast<const int4*>(work + kSm90WorkHeader + kSm90TileInts * t);
  const int4 a = at[0], b = at[1];
  return {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
}

}  // namespace sm90_prefill

// Where a block's items come from. The prefill kernel: block b's first item is b, the rest
// come from the counter past the grid (base = gridDim.x), and the last block to find none left
// resets the two counters. POD (csrc/pod/pod_sm90.cuh): the blocks that start on prefill take
// their index first, the others (first = -1) join from the counter once their decode units are
// done, and the last block also resets the decode side's counter (also_reset).
struct Sm90Schedule {
  int first;               // this block's first item, or -1: from the counter
  int base;                // item = base + the counter's value
  int32_t* also_reset;     // zeroed with the counters by the last block (null: none)
};

// One block's share of a launch: items from the schedule until none is left (the whole
// block, 128 x (1 + kM / 64) threads; shared memory at smem_raw: Sm90Kernel::kSmemBytes,
// which holds 1 KB for the alignment). The producer warpgroup returns when its last item is loaded,
// the consumers after the rows without keys are written.
template <typename DType, int kD, bool kCausal, int kN, bool kPaged, bool kSoftCap, int kM, bool kCustom,
          bool kAlibi = false, bool kStaleMax = true, bool kFp8 = false>
FIJ_DEVICE void prefill_sm90_block(const PrefillSm90Params& p, unsigned char* smem_raw, const Sm90Schedule sched) {
  using namespace sm90_prefill;
  using K = Sm90Kernel<DType, kD, kCausal, kN, kSoftCap, kM, kCustom, kAlibi, kStaleMax, kFp8>;
  static_assert(!kFp8 || (!kPaged && K::kQStages == 2), "FP8 attention: ragged K/V, two Q stages");
  constexpr int kC = K::kConsumers;
  constexpr bool kPvWaitLate = kC == 2 && kCausal && kD == 128 && !kFp8;  // (the loop, below)
  // (its barriers: one a consumer warp, 1 + 2 kC + 4 wi + warp, past the turns' and the
  // warpgroups' own; ids up to 15)
  static_assert(!kPvWaitLate || 1 + 2 * kC + 4 * (kC - 1) + 3 <= 15, "the consumer warps' named barriers");
  constexpr int kKTileBytes = K::kKTileBytes, kVTileBytes = K::kVTileBytes, kBlockN = K::kBlockN;
  unsigned char* smem = h::align_1024(smem_raw);
  constexpr int kQStages = K::kQStages;
  unsigned char* sq = smem;                                   // Q stage j at sq + j * kQBytes
  unsigned char* sk = smem + K::kQBytes * kQStages;  // K stage s at sk + s * kKTileBytes
  unsigned char* sv = sk + kKTileBytes * kStages;    // V stage s at sv + s * kVTileBytes
  unsigned char* svt = sv + kVTileBytes * kStages;   // FP8: V^T stage s at svt + s * kVTileBytes
  // item k's Q in stage k % kQStages; q_empty: every consumer thread has seen its last Q K^T
  // of the stage's item complete
  __shared__ uint64_t q_full[2], q_empty[2], k_full[kStages], v_full[kStages], k_empty[kStages], v_empty[kStages];
  // FP8: a V^T stage written (by the 96 transposing threads) and read (its P V complete); V's
  // stage is then empty once those threads have read it
  __shared__ uint64_t vt_full[kStages], vt_empty[kStages];
  // item k's index (-1: none left) and tile in slot k % 2: the producer reads the tile from
  // the work list while the consumers still run item k - 1, so theirs is a shared-memory read
  __shared__ int item_slot[2];
  __shared__ Sm90Tile tile_slot[2];
  __shared__ int64_t mask_slot[2];  // a custom mask: the item's tile's first bit

  const int num_items = p.work[0], active = p.work[1];
  // a custom mask: each tile's first bit, an int64 a tile after the tiles (16-byte aligned)
  const int64_t* mask_bases =
      kCustom ? reinterpret_cast<const int64_t*>(p.work + kSm90WorkHeader + kSm90TileInts * (num_items / p.num_qo_heads))
              : nullptr;
  // the warpgroup, broadcast from lane 0 so that the compiler knows it warp-uniform: the shared
  // addresses made from it (the wgmma descriptors) then live in uniform registers
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
  if (threadIdx.x == 0) {
    for (int j = 0; j < kQStages; ++j) {
      h::mbar_init(&q_full[j], 1);
      h::mbar_init(&q_empty[j], 128 * kC);  // every consumer thread
    }
    for (int s = 0; s < kStages; ++s) {
      h::mbar_init(&k_full[s], 1);
      h::mbar_init(&v_full[s], 1);
      h::mbar_init(&k_empty[s], 4 * kC);  // lane 0 of each consumer warp
      h::mbar_init(&v_empty[s], kFp8 ? 96 : 4 * kC);  // (FP8: every transposing thread)
      if constexpr (kFp8) {
        h::mbar_init(&vt_full[s], 96);
        h::mbar_init(&vt_empty[s], 4 * kC);
      }
    }
    h::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {  // producer: warp 0 issues every copy (lane 0, or a lane a page)
    h::regs_dealloc<K::kProducerRegs>();
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      if (lane == 0) {
        h::tma_prefetch_descriptor(&p.q_map);
        h::tma_prefetch_descriptor(&p.k_map);
        h::tma_prefetch_descriptor(&p.v_map);
      }
      const int v_ids = kPaged ? p.work[2] : 0;  // V page ids past K's (separate K/V tables)
      int it = 0;  // key tiles over every item so far (the stages' phases)
      // the next item reserved one item ahead (lane 0's `taken`), only while this block's
      // items are active: its atomic is in flight over the item before
      const bool fixed_first = sched.first >= 0;
      int taken = 0;
      if (lane == 0 && (!fixed_first || sched.first < active)) taken = atomicAdd(&p.counters[0], 1);
      for (int k = 0;; ++k) {
        int idx = sched.first;
        if (k > 0 || !fixed_first) {
          idx = sched.base + __shfl_sync(0xffffffffu, taken, 0);
          if (lane == 0 && idx < active) taken = atomicAdd(&p.counters[0], 1);
        }
        const Sm90Tile tile = idx < active ? load_tile(p.work, idx / p.num_qo_heads) : Sm90Tile{};
        int page = kPaged && idx < active ? K::next_page(p, tile, tile.first_tile, lane) : 0;
        int page_v = v_ids == 0 ? page : kPaged && idx < active ? K::next_page(p, tile, tile.first_tile, lane, v_ids) : 0;
        const int qs = k % kQStages, qu = k / kQStages;
        // the stage's last item has finished its Q K^T (and item k - 2's slot has been read)
        if (qu > 0) h::mbar_wait(&q_empty[qs], (qu - 1) & 1);
        if (idx >= active) {
          if (lane == 0) {
            item_slot[k & 1] = -1;
            h::mbar_arrive(&q_full[qs]);  // the consumers read -1: done
            if (atomicAdd(&p.counters[1], 1) == int(gridDim.x) - 1) {  // every block's last take is done
              p.counters[0] = p.counters[1] = 0;
              if (sched.also_reset != nullptr) *sched.also_reset = 0;
            }
          }
          break;
        }
        const int head = idx % p.num_qo_heads, kv_head = head / p.group;
        if (lane == 0) {
          item_slot[k & 1] = idx;
          tile_slot[k & 1] = tile;
          if constexpr (kCustom) mask_slot[k & 1] = mask_bases[idx / p.num_qo_heads];
          h::mbar_expect_tx(&q_full[qs], K::kQBytes);
          for (int a = 0; a < K::kAtoms; ++a)
            h::tma_load_3d(sq + qs * K::kQBytes + a * K::kQAtom, &p.q_map, &q_full[qs], K::kAtomElems * a, head,
                           tile.q_row0);
        }
        // K runs a tile ahead of V (FA3's order): the consumers issue tile n + 1's Q K^T beside
        // tile n's P V, and a stage's K is free again (its Q K^T complete) well before its V
        // (its P V complete), so K(n + 1) goes out before V(n) waits for its stage.
        {
          const Stage first = stage_of(it);
          h::mbar_wait(&k_empty[first.s], first.parity ^ 1);
          K::template load_kv<kPaged, K::kAtoms>(&p.k_map, sk + first.s * kKTileBytes, &k_full[first.s], tile,
                                                 tile.first_tile, kv_head, lane, p.page_shift, page);
        }
        int page_k = kPaged ? K::next_page(p, tile, tile.first_tile + 1, lane) : 0;  // tile n + 1's K ids
        for (int n = tile.first_tile; n < tile.kv_tiles; ++n, ++it) {
          const Stage cur = stage_of(it), nxt = stage_of(it + 1);
          const int this_k = page_k, this_v = page_v;  // tile n + 1's K ids, tile n's V ids
          if constexpr (kPaged) {  // in flight over the waits
            page_k = K::next_page(p, tile, n + 2, lane);
            page_v = v_ids == 0 ? this_k : K::next_page(p, tile, n + 1, lane, v_ids);
          }
          if (n + 1 < tile.kv_tiles) {
            h::mbar_wait(&k_empty[nxt.s], nxt.parity ^ 1);
            K::template load_kv<kPaged, K::kAtoms>(&p.k_map, sk + nxt.s * kKTileBytes, &k_full[nxt.s], tile, n + 1,
                                                   kv_head, lane, p.page_shift, this_k);
          }
          h::mbar_wait(&v_empty[cur.s], cur.parity ^ 1);
          K::template load_kv<kPaged, K::kVAtoms>(&p.v_map, sv + cur.s * kVTileBytes, &v_full[cur.s], tile, n, kv_head,
                                                  lane, p.page_shift, this_v);
        }
      }
    } else if constexpr (kFp8) {
      // warps 1-3: each V tile into its V^T stage, item after item as the consumers take them
      // (an item's slot is read before its last P V, so before the producer can reuse it)
      const int t = threadIdx.x - 32;
      const uint32_t sv_addr = h::smem_addr(sv), svt_addr = h::smem_addr(svt);
      int it = 0;
      for (int k = 0;; ++k) {
        h::mbar_wait(&q_full[k % kQStages], (k / kQStages) & 1);
        if (item_slot[k & 1] < 0) break;
        const Sm90Tile tile = tile_slot[k & 1];
        for (int n = tile.first_tile; n < tile.kv_tiles; ++n, ++it) {
          const Stage cur = stage_of(it);
          h::mbar_wait(&v_full[cur.s], cur.parity);
          h::mbar_wait(&vt_empty[cur.s], cur.parity ^ 1);
          h::transpose_v_e4m3<kBlockN>(sv_addr + cur.s * kVTileBytes, svt_addr + cur.s * kVTileBytes, t, 3);
          h::fence_proxy_async();  // the generic writes before the wgmma (async proxy) reads them
          h::mbar_arrive(&vt_full[cur.s]);
          h::mbar_arrive(&v_empty[cur.s]);
        }
      }
    }
    return;
  }

  // consumers
  h::regs_alloc<K::kConsumerRegs>();
  const int wi = wg - 1, t = threadIdx.x % 128, lane = t % 32;
  const int r0 = 64 * wi + 16 * (t / 32) + lane / 4, cq = 2 * (lane % 4);  // rows r0, r0 + 8 of a tile
  const uint32_t q0 = h::smem_addr(sq) + wi * 64 * 128;  // this warpgroup's 64 rows in each atom
  const uint32_t k0 = h::smem_addr(sk);
  // P V's operand: V's stages, or (FP8) the V^T stages, with their barriers
  const uint32_t v0 = h::smem_addr(kFp8 ? svt : sv);
  uint64_t* const pv_full = kFp8 ? vt_full : v_full;
  uint64_t* const pv_empty = kFp8 ? vt_empty : v_empty;
  // Each round's issue (the first S, one per further key tile, the last P V) waits for this
  // warpgroup's turn and passes it to the next (named barrier 1 + j: warpgroup j's turn, 256
  // threads: j's and the one before it); warpgroup 0 starts, and takes the last one's final
  // pass after its loop (none knows which item is its last before it has run it).
  const auto my_turn = [&] { h::named_sync(1 + wi, 256); };
  const auto pass_turn = [&] { h::named_arrive(1 + (wi + 1) % kC, 256); };
  if (wi == kC - 1) h::named_arrive(1, 256);
  const int own_bar = 1 + kC + wi;  // this warpgroup's own named barrier (zero_tail, the epilogue)

  int it = 0;
  for (int k = 0;; ++k) {
    const int qs = k % kQStages;
    h::mbar_wait(&q_full[qs], (k / kQStages) & 1);
    const uint32_t q_base = q0 + qs * K::kQBytes;
    const int idx = item_slot[k & 1];
    if (idx < 0) break;
    const Sm90Tile tile = tile_slot[k & 1];
    const int head = idx % p.num_qo_heads, n0 = tile.first_tile, n_tiles = tile.kv_tiles - n0;
    const Rows rows{r0, cq, 64 * wi, tile.kv_len, tile.diag, p.window_left, kSoftCap || kAlibi ? 1.f : p.scale_log2,
                    p.scale_log2, p.soft_cap_log2, kAlibi ? alibi_slope_log2(head, p.num_qo_heads) : 0.f};
    float o[K::kOut], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < K::kOut; ++i) o[i] = 0.f;
    uint32_t pa[K::kPaSteps][4];
    float s[K::kS], corr[2];
    typename K::MaskBits bits;  // a custom mask's, of the tile whose S is in flight
    const int64_t mask_base = kCustom ? mask_slot[k & 1] : 0;

    const Stage first = stage_of(it);
    const int s0 = first.s;
    h::mbar_wait(&k_full[s0], first.parity);
    my_turn();
    K::issue_qk(s, q_base, k0 + s0 * kKTileBytes);
    pass_turn();
    if constexpr (kCustom) K::load_mask(bits, p.mask, mask_base, n0, rows, tile.rows);
    h::wgmma_wait<0>();
    h::fence_regs(s);
    if (lane == 0) h::mbar_arrive(&k_empty[s0]);
    K::softmax(s, n0, rows, m, l, corr, bits);  // O is 0: nothing to rescale
    bool rescale = false;  // whether O takes corr before the next P V (K::moved; always without kStaleMax)
    K::pack_p(s, pa);
    // Tiles [1, plain) need no mask (under the diagonal and kv_len, no window, no custom mask):
    // a copy of the loop's body without the tile's mask test, whose row max starts right
    // after the S wait. Only items of >= 16 key tiles take it: on shorter ones (head_dim 128
    // full 16 x 1k paged) it measured 4% slower, ragged 3% faster (H200, 2026-11-30,
    // docs/hopper.md).
    int plain = 1;
    if (!kCustom && p.window_left < 0 && n_tiles >= 16) {
      const int below = kCausal ? min(tile.kv_len, tile.diag + 64 * wi + 1) : tile.kv_len;
      plain = min(n_tiles, max(1, below / kBlockN - n0));
    }
    const auto step = [&](auto may_mask, int n) {
      const Stage cur = stage_of(it + n), prev = stage_of(it + n - 1);
      const int st = cur.s, sp = prev.s;
      h::mbar_wait(&k_full[st], cur.parity);
      my_turn();
      K::issue_qk(s, q_base, k0 + st * kKTileBytes);
      // O to tile n - 1's max under this Q K^T, before its P V
      if (n > 1 && (!kStaleMax || rescale)) K::rescale(o, corr);
      // (V of tile n - 1 waited for only now: its load went out after K n's, and a late V
      // need not hold back the Q K^T)
      h::mbar_wait(&pv_full[sp], prev.parity);
      K::issue_pv(o, pa, v0 + sp * kVTileBytes);
      pass_turn();
      if constexpr (kCustom) K::load_mask(bits, p.mask, mask_base, n0 + n, rows, tile.rows);
      h::wgmma_wait<1>();  // S of tile n (committed first)
      h::fence_regs(s);
      if (lane == 0) h::mbar_arrive(&k_empty[st]);
      const auto pv_done = [&] {
        h::wgmma_wait<0>();  // P V of tile n - 1
        h::fence_regs(o);
        h::fence_regs(pa);
        if (lane == 0) h::mbar_arrive(&pv_empty[sp]);
      };
      // ptxas (nvcc 13.0) moves the P V's wait up to the softmax's start, so the softmax never
      // overlaps its own P V. A barrier that reads the row sums keeps it inside: one warp's
      // (named barriers 5..12), called once half of the tile's exponentials are out, the rest
      // interleaved with the pack. Measured (H200, 2026-11-30, docs/hopper.md): head_dim 128
      // causal 2-3.5% faster; in every two-consumer kernel, full rows gained less and head_dim
      // 64's causal 16 x 1k lost 3.5-6%, so only head_dim 128 causal takes it.
      if constexpr (kPvWaitLate) {
        K::template softmax<decltype(may_mask)::value>(s, n0 + n, rows, m, l, corr, bits, [&](float part) {
          h::named_sync_or(1 + 2 * kC + 4 * wi + t / 32, 32, part + l[0] != -1.f);
          pv_done();
        });
      } else {
        K::template softmax<decltype(may_mask)::value>(s, n0 + n, rows, m, l, corr, bits);
        pv_done();
      }
      if constexpr (kStaleMax) rescale = K::moved(corr);
      K::pack_p(s, pa);
    };
    int n = 1;
    for (; n < plain; ++n) step(std::false_type{}, n);
    for (; n < n_tiles; ++n) step(std::true_type{}, n);
    // one Q stage: every Q K^T of this item is complete, and this thread's reads of the
    // item's slot are done: each consumer thread arrives, since an arrival releases its own
    // thread's accesses only (with one arrival a warp or a warpgroup, racecheck reported the
    // other threads' slot reads against the producer's next writes of the slot). Two: the
    // next item's Q is in the other stage, and this one takes O on its way out first.
    if constexpr (kQStages == 1) h::mbar_arrive(&q_empty[qs]);
    const Stage last = stage_of(it + n_tiles - 1);
    const int sl = last.s;
    h::mbar_wait(&pv_full[sl], last.parity);
    if constexpr (kPaged) {
      const int tail = tile.kv_len - (tile.kv_tiles - 1) * kBlockN;  // the last tile's rows that are keys
      if (tail < kBlockN) K::zero_tail(sv + sl * kVTileBytes, tail, t, own_bar);
    }
    my_turn();
    if (n_tiles > 1 && (!kStaleMax || rescale)) K::rescale(o, corr);
    K::issue_pv(o, pa, v0 + sl * kVTileBytes);
    pass_turn();
    h::wgmma_wait<0>();
    h::fence_regs(o);
    h::fence_regs(pa);
    if (lane == 0) h::mbar_arrive(&pv_empty[sl]);
    it += n_tiles;

#pragma unroll
    for (int r = 0; r < 2; ++r) {  // the rows' sums over the quad
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    if constexpr (kQStages == 2 && kFp8) {  // (Q's stage is half O's bytes: straight from registers)
      K::store(p, tile, head, r0, cq, o, m, l);
      h::mbar_arrive(&q_empty[qs]);
    } else if constexpr (kQStages == 2 && kCausal) {
      K::store_staged(p, tile, head, wi, t, r0, cq, o, m, l, sq + qs * K::kQBytes, own_bar, &q_empty[qs]);
    } else if constexpr (kQStages == 2) {
      K::store_staged_words(p, tile, head, wi, t, r0, cq, o, m, l, sq + qs * K::kQBytes, own_bar);
      h::fence_proxy_async();  // this thread's generic accesses to the stage before the next TMA write
      h::mbar_arrive(&q_empty[qs]);
    } else {
      K::store(p, tile, head, r0, cq, o, m, l);
    }
  }
  if (wi == 0) my_turn();  // the last warpgroup's final pass

  // Items whose tiles see no key (the end of the list): zeros and an LSE of -inf, strided
  // over the blocks; no barrier.
  {
    float o[K::kOut], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < K::kOut; ++i) o[i] = 0.f;
    for (int idx = active + blockIdx.x; idx < num_items; idx += gridDim.x) {
      const Sm90Tile tile = load_tile(p.work, idx / p.num_qo_heads);
      K::store(p, tile, idx % p.num_qo_heads, r0, cq, o, m, l);
    }
  }
}

template <typename DType, int kD, bool kCausal, int kN, bool kPaged, bool kSoftCap, int kM = 128, bool kCustom = false,
          bool kAlibi = false, bool kFp8 = false>
__global__ void __launch_bounds__(128 * (1 + kM / 64), 1)
    prefill_sm90_kernel(const __grid_constant__ PrefillSm90Params p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  prefill_sm90_block<DType, kD, kCausal, kN, kPaged, kSoftCap, kM, kCustom, kAlibi, true, kFp8>(
      p, smem_raw, Sm90Schedule{int(blockIdx.x), int(gridDim.x), nullptr});
}

// Launches the kernel on `grid` blocks (one an SM: every block walks the list).
template <typename DType, int kD, bool kCausal, int kN, bool kPaged, bool kSoftCap = false, int kM = 128,
          bool kCustom = false, bool kAlibi = false, bool kFp8 = false>
inline int launch_prefill_sm90(const PrefillSm90Params& p, int grid, cudaStream_t stream) {
  using K = sm90_prefill::Sm90Kernel<DType, kD, kCausal, kN, kSoftCap, kM, kCustom, kAlibi, true, kFp8>;
  constexpr auto kernel = prefill_sm90_kernel<DType, kD, kCausal, kN, kPaged, kSoftCap, kM, kCustom, kAlibi, kFp8>;
  const int err = allow_dynamic_smem<kernel>(K::kSmemBytes);
  if (err != 0) return err;
  if (grid <= 0) return 0;
  kernel<<<grid, K::kThreads, K::kSmemBytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace fij

// Rotary position embedding, optionally quantizing and appending into the paged cache.
//
// Work split: a block takes one token at a time. Thread (x, y) owns unit x of a head row
// (16 elements) and rows y, y + blockDim.y, ... of the token (q heads, then k heads, then
// v heads in append mode). A rope unit's 8 angles are computed (or read from
// cos_sin_cache) once per token and reused for every head the thread visits.
//   NeoX (rotate halves)  unit j: elements [8j, 8j+8) paired with [R/2+8j, R/2+8j+8)
//   interleaved (GPT-J)   unit j: elements [16j, 16j+16), pairs (2e, 2e+1)
// both use frequencies 8j .. 8j+7. Units past R/16 pass through (scaled, converted).
#pragma once
#include <math_constants.h>

#include "common/common.cuh"
#include "common/page_table.cuh"
#include "common/rope.cuh"
#include "kvcache/rope_params.h"

namespace fij {

enum class PosSource : int32_t { kPosIds = 0, kIndptrOffsets = 1 };

template <typename TIn, typename TOut, bool Interleave, PosSource Pos, bool CosSinCache,
          bool Append, PageTableLayout Table>
struct RopeTraits {
  using In = TIn;
  using Out = TOut;
  static constexpr bool kInterleave = Interleave;
  static constexpr PosSource kPos = Pos;
  static constexpr bool kCosSinCache = CosSinCache;
  static constexpr bool kAppend = Append;
  static constexpr PageTableLayout kTable = Table;
  static constexpr int kUnit = 16;  // elements per unit
  static constexpr int kMaxThreads = 256;
  // Rows whose loads one thread keeps in flight: 2 covers Llama-like 32/8/8 heads in one
  // group (24 x 8 threads); 4 cost 19 more registers and an occupancy step.
  static constexpr int kMaxRowsPerThread = 2;
};

// --- 8-element conversions ---------------------------------------------------------
template <typename T>
FIJ_DEVICE void load8(const T* ptr, float (&x)[8]) {
  static_assert(sizeof(T) == 2, "inputs are fp16 or bf16");
  const Vec16 raw = load_vec16(ptr);
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = static_cast<float>(v[i]);
}

template <typename T>
FIJ_DEVICE void store8(T* ptr, const float (&x)[8], float scale) {
  if constexpr (sizeof(T) == 2) {
    Vec16 raw;
    T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = static_cast<T>(x[i] * scale);
    store_vec16(ptr, raw);
  } else {  // fp8: 8 bytes, saturated to the format's finite range
    uint2 raw;
    T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = T(x[i] * scale);
    *reinterpret_cast<uint2*>(ptr) = raw;
  }
}

template <typename T>
FIJ_DEVICE void store8_value(T* ptr, float value) {
  float x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = value;
  store8(ptr, x, 1.f);
}

// --- angles ---------------------------------------------------------------------------
template <class Traits>
FIJ_DEVICE int rope_position(const RopeParams& p, int token) {
  if constexpr (Traits::kPos == PosSource::kPosIds) {
    return p.pos_ids[token];
  } else {
    int lo = 0, hi = p.batch_size;  // last b with indptr[b] <= token
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (p.indptr[mid] <= token) lo = mid; else hi = mid;
    }
    return p.offsets[lo] + token - p.indptr[lo];
  }
}

// cos/sin of the 8 frequencies of rope unit j; false if pos is outside cos_sin_cache.
template <class Traits>
FIJ_DEVICE bool unit_angles(const RopeParams& p, int pos, int j, float (&c)[8], float (&s)[8]) {
  if constexpr (Traits::kCosSinCache) {
    if (pos < 0 || pos >= p.cos_sin_rows) return false;
    const float* row = p.cos_sin_cache + int64_t(pos) * p.rope_dim;
    const int half = p.rope_dim / 2;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      c[e] = row[8 * j + e];
      s[e] = row[half + 8 * j + e];
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float i = float(8 * j + e);
      float freq = rope_inv_freq(i, float(p.rope_dim), p.log2_theta);
      const float smooth = fminf(fmaxf(freq * p.smooth_a + p.smooth_b, 0.f), 1.f);
      freq = (1.f - smooth) * freq * p.rcp_scale + smooth * freq;
      sincosf(float(pos) * freq, &s[e], &c[e]);
    }
  }
  return true;
}

// --- the kernel ---------------------------------------------------------------------------
template <typename T>
FIJ_DEVICE const T* row_at(const void* base, int64_t stride_token, int64_t stride_head, int token, int head) {
  return static_cast<const T*>(base) + token * stride_token + head * stride_head;
}

template <typename T>
FIJ_DEVICE T* row_at_mut(void* base, int64_t stride_token, int64_t stride_head, int token, int head) {
  return static_cast<T*>(base) + token * stride_token + head * stride_head;
}

// This thread's 16 elements of one row: where they are read (two 8-element halves at
// src + lo and src + hi) and written, and whether they rotate.
template <class Traits>
struct UnitRef {
  const typename Traits::In* src = nullptr;  // null: this thread has no unit in the row
  typename Traits::Out* dst = nullptr;       // null: nothing to write (padding K/V, bad slot)
  int lo = 0, hi = 8;
  bool rotate = false;
  float scale = 1.f;
};

// Row r of a token: q heads, then k heads, then (append mode) v heads.
template <class Traits>
FIJ_DEVICE UnitRef<Traits> unit_ref(const RopeParams& p, int r, int token, int x, bool padding, int k_page,
                                    int v_page, int slot) {
  using In = typename Traits::In;
  using Out = typename Traits::Out;
  UnitRef<Traits> u;
  const int rope_units = p.rope_dim / Traits::kUnit;
  const bool in_rope = x < rope_units;
  const int hq = p.q.num_heads, hk = p.k.num_heads;
  if (r < hq + hk) {
    if (x >= (p.rope_dim + p.nope_dim) / Traits::kUnit) return u;
    const bool is_q = r < hq;
    const RopeRows& rows = is_q ? p.q : p.k;
    const int h = is_q ? r : r - hq;
    u.lo = in_rope ? (Traits::kInterleave ? Traits::kUnit * x : 8 * x) : Traits::kUnit * (x - rope_units);
    u.hi = in_rope ? (Traits::kInterleave ? u.lo + 8 : p.rope_dim / 2 + 8 * x) : u.lo + 8;
    u.rotate = in_rope;
    u.scale = is_q ? p.q_scale : p.kv_scale;
    u.src = in_rope ? row_at<In>(rows.rope_in, rows.rope_in_stride_token, rows.rope_in_stride_head, token, h)
                    : row_at<In>(rows.nope_in, rows.nope_in_stride_token, rows.nope_in_stride_head, token, h);
    if (!is_q && Traits::kAppend) {
      if (!padding && k_page >= 0) {
        u.dst = paged_ptr<Out>(in_rope ? p.k_rope_cache : p.k_nope_cache, k_page, slot, h);
      }
    } else if (is_q || !padding) {
      u.dst = in_rope ? row_at_mut<Out>(rows.rope_out, rows.rope_out_stride_token, rows.rope_out_stride_head, token, h)
                      : row_at_mut<Out>(rows.nope_out, rows.nope_out_stride_token, rows.nope_out_stride_head, token, h);
    }
    return u;
  }
  if constexpr (Traits::kAppend) {  // v: no rotation, quantize and store
    if (x >= p.v_dim / Traits::kUnit) return u;
    const int h = r - hq - hk;
    u.lo = Traits::kUnit * x;
    u.hi = u.lo + 8;
    u.scale = p.kv_scale;
    u.src = row_at<In>(p.v_in, p.v_in_stride_token, p.v_in_stride_head, token, h);
    if (!padding && k_page >= 0) u.dst = paged_ptr<Out>(p.v_cache, v_page, slot, h);
  }
  return u;
}

template <class Traits>
FIJ_DEVICE void finish_unit(const UnitRef<Traits>& u, const Vec16& raw_lo, const Vec16& raw_hi, bool zero,
                            bool angles_ok, const float (&c)[8], const float (&s)[8]) {
  using In = typename Traits::In;
  if (u.dst == nullptr) return;
  if (zero) {  // q of a padding token: defined zeros, no RoPE
    store8_value(u.dst + u.lo, 0.f);
    store8_value(u.dst + u.hi, 0.f);
    return;
  }
  if (u.rotate && !angles_ok) {  // position outside cos_sin_cache: visible, never stale
    store8_value(u.dst + u.lo, CUDART_NAN_F);
    store8_value(u.dst + u.hi, CUDART_NAN_F);
    return;
  }
  float a[8], b[8];
  const In* va = reinterpret_cast<const In*>(&raw_lo);
  const In* vb = reinterpret_cast<const In*>(&raw_hi);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    a[e] = static_cast<float>(va[e]);
    b[e] = static_cast<float>(vb[e]);
  }
  if (u.rotate) {
    float ra[8], rb[8];
    if constexpr (Traits::kInterleave) {  // a = elements 0..7, b = 8..15 of 8 pairs
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        ra[2 * e] = a[2 * e], ra[2 * e + 1] = a[2 * e + 1];
        rb[2 * e] = b[2 * e], rb[2 * e + 1] = b[2 * e + 1];
        rope_rotate(ra[2 * e], ra[2 * e + 1], c[e], s[e]);
        rope_rotate(rb[2 * e], rb[2 * e + 1], c[e + 4], s[e + 4]);
      }
    } else {  // a = first half, b = second half
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        ra[e] = a[e], rb[e] = b[e];
        rope_rotate(ra[e], rb[e], c[e], s[e]);
      }
    }
    store8(u.dst + u.lo, ra, u.scale);
    store8(u.dst + u.hi, rb, u.scale);
  } else {
    store8(u.dst + u.lo, a, u.scale);
    store8(u.dst + u.hi, b, u.scale);
  }
}

// Per token and group of up to kMaxRows rows per thread: (1) issue every input load of
// the group, (2) resolve the cache slot (batch index -> page table -> page, a chain of
// dependent loads) and the angles while those loads are in flight, (3) rotate, convert,
// store. Without (1) first, each token paid the page-table chain before its first load.
template <class Traits>
__global__ void __launch_bounds__(Traits::kMaxThreads)
    rope_kernel(const __grid_constant__ RopeParams p) {
  constexpr int kMaxRows = Traits::kMaxRowsPerThread;
  const int x = threadIdx.x;  // unit within a row
  const int rows = p.q.num_heads + p.k.num_heads + (Traits::kAppend ? p.num_v_heads : 0);
  const int group = blockDim.y * kMaxRows;

  for (int token = blockIdx.x; token < p.nnz; token += gridDim.x) {
    bool padding = false;
    if constexpr (Traits::kAppend) padding = p.batch_indices[token] < 0;
    // blockIdx.y splits a token's rows among blocks when tokens are too few to fill the GPU.
    for (int base = blockIdx.y * group; base < rows; base += gridDim.y * group) {
      UnitRef<Traits> units[kMaxRows];
      Vec16 raw_lo[kMaxRows], raw_hi[kMaxRows];
#pragma unroll
      for (int i = 0; i < kMaxRows; ++i) {  // (1) loads; destinations come later
        const int r = base + threadIdx.y + i * blockDim.y;
        if (r < rows) units[i] = unit_ref<Traits>(p, r, token, x, padding, 0, 0, 0);
        if (units[i].src != nullptr && !padding) {
          raw_lo[i] = load_vec16(units[i].src + units[i].lo);
          raw_hi[i] = load_vec16(units[i].src + units[i].hi);
        }
      }
      int k_page = 0, v_page = 0, slot = 0;  // (2)
      if constexpr (Traits::kAppend) {
        // A real token whose slot lies outside the table or cache writes no K/V (debug
        // mode rejects it before launch); its q is still computed.
        if (!padding && !locate_slot<Traits::kTable>(p.table, p.num_pages, p.batch_indices[token],
                                                     p.positions[token], k_page, v_page, slot)) {
          k_page = -1;
        }
      }
      float c[8], s[8];
      bool angles_ok = true;
      if (!padding && x < p.rope_dim / Traits::kUnit) {
        angles_ok = unit_angles<Traits>(p, rope_position<Traits>(p, token), x, c, s);
      }
#pragma unroll
      for (int i = 0; i < kMaxRows; ++i) {  // (3)
        const int r = base + threadIdx.y + i * blockDim.y;
        if (r >= rows || units[i].src == nullptr) continue;
        const UnitRef<Traits> u = unit_ref<Traits>(p, r, token, x, padding, k_page, v_page, slot);
        finish_unit<Traits>(u, raw_lo[i], raw_hi[i], padding, angles_ok, c, s);
      }
    }
  }
}

// Block shape: x = units of the widest row, y = rows in parallel, chosen so that the rows
// of a token split into equal rounds (48 rows of 8 units: 24 x 8 threads, 2 rows per
// thread, instead of 32 + 16); more than kMaxRowsPerThread rounds loop over row groups.
template <class Traits>
int launch_rope(const RopeParams& p, cudaStream_t stream) {
  if (p.nnz == 0) return 0;
  const int kv_units = (p.rope_dim + p.nope_dim) / Traits::kUnit;
  const int units = Traits::kAppend && p.num_v_heads > 0 ? max(kv_units, p.v_dim / Traits::kUnit) : kv_units;
  const int rows = p.q.num_heads + p.k.num_heads + (Traits::kAppend ? p.num_v_heads : 0);
  const int max_y = max(1, Traits::kMaxThreads / units);
  const int rounds = (rows + max_y - 1) / max_y;  // rows per thread, if one group covered them
  int y = (rows + rounds - 1) / rounds;
  // Few tokens (a decode step: 256 x 1): split each token's rows over blockIdx.y so that
  // about 4 blocks per SM run, instead of one latency-bound block per token.
  const int target_blocks = 4 * num_sms();
  int row_blocks = 1;
  if (p.nnz < target_blocks) {
    const int max_row_blocks = (rows + Traits::kMaxRowsPerThread - 1) / Traits::kMaxRowsPerThread;
    row_blocks = min(max_row_blocks, (target_blocks + p.nnz - 1) / p.nnz);
    const int rows_per_block = (rows + row_blocks - 1) / row_blocks;
    y = min(y, (rows_per_block + Traits::kMaxRowsPerThread - 1) / Traits::kMaxRowsPerThread);
    row_blocks = (rows + y * Traits::kMaxRowsPerThread - 1) / (y * Traits::kMaxRowsPerThread);
  }
  const int blocks = static_cast<int>(p.nnz < num_sms() * 32 ? p.nnz : num_sms() * 32);
  rope_kernel<Traits><<<dim3(blocks, row_blocks), dim3(units, y), 0, stream>>>(p);
  return last_launch_error();
}

}  // namespace fij

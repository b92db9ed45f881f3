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

#include "common.cuh"
#include "page_table.cuh"
#include "rope_params.h"

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
      float freq = exp2f(-2.f * i / float(p.rope_dim) * p.log2_theta);
      const float smooth = fminf(fmaxf(freq * p.smooth_a + p.smooth_b, 0.f), 1.f);
      freq = (1.f - smooth) * freq * p.rcp_scale + smooth * freq;
      sincosf(float(pos) * freq, &s[e], &c[e]);
    }
  }
  return true;
}

// --- one unit of one row ------------------------------------------------------------------
struct RowPtrs {  // this row's rope and nope parts, input and output
  const void* rope_in;
  const void* nope_in;
  void* rope_out;
  void* nope_out;
};

template <class Traits>
FIJ_DEVICE void rope_unit(const RopeParams& p, const RowPtrs& row, int x, bool angles_ok,
                          const float (&c)[8], const float (&s)[8], float scale) {
  using In = typename Traits::In;
  using Out = typename Traits::Out;
  const int rope_units = p.rope_dim / Traits::kUnit;
  float a[8], b[8];
  if (x >= rope_units) {  // pass-through unit of the nope part
    const int off = (x - rope_units) * Traits::kUnit;
    load8(static_cast<const In*>(row.nope_in) + off, a);
    load8(static_cast<const In*>(row.nope_in) + off + 8, b);
    store8(static_cast<Out*>(row.nope_out) + off, a, scale);
    store8(static_cast<Out*>(row.nope_out) + off + 8, b, scale);
    return;
  }
  const In* in = static_cast<const In*>(row.rope_in);
  Out* out = static_cast<Out*>(row.rope_out);
  const int lo = Traits::kInterleave ? Traits::kUnit * x : 8 * x;
  const int hi = Traits::kInterleave ? lo + 8 : p.rope_dim / 2 + 8 * x;
  if (!angles_ok) {  // position outside cos_sin_cache: make it visible, never stale
    store8_value(out + lo, CUDART_NAN_F);
    store8_value(out + hi, CUDART_NAN_F);
    return;
  }
  load8(in + lo, a);
  load8(in + hi, b);
  float ra[8], rb[8];
  if constexpr (Traits::kInterleave) {  // a = elements 0..7, b = 8..15 of 8 pairs
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      ra[2 * e] = a[2 * e] * c[e] - a[2 * e + 1] * s[e];
      ra[2 * e + 1] = a[2 * e + 1] * c[e] + a[2 * e] * s[e];
      rb[2 * e] = b[2 * e] * c[e + 4] - b[2 * e + 1] * s[e + 4];
      rb[2 * e + 1] = b[2 * e + 1] * c[e + 4] + b[2 * e] * s[e + 4];
    }
  } else {  // a = first half, b = second half
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      ra[e] = a[e] * c[e] - b[e] * s[e];
      rb[e] = b[e] * c[e] + a[e] * s[e];
    }
  }
  store8(out + lo, ra, scale);
  store8(out + hi, rb, scale);
}

template <typename T>
FIJ_DEVICE const T* row_at(const void* base, int64_t stride_token, int64_t stride_head, int token, int head) {
  return static_cast<const T*>(base) + token * stride_token + head * stride_head;
}

template <typename T>
FIJ_DEVICE T* row_at_mut(void* base, int64_t stride_token, int64_t stride_head, int token, int head) {
  return static_cast<T*>(base) + token * stride_token + head * stride_head;
}

template <class Traits>
FIJ_DEVICE RowPtrs tensor_row(const RopeRows& r, int token, int head) {
  using In = typename Traits::In;
  using Out = typename Traits::Out;
  return {row_at<In>(r.rope_in, r.rope_in_stride_token, r.rope_in_stride_head, token, head),
          row_at<In>(r.nope_in, r.nope_in_stride_token, r.nope_in_stride_head, token, head),
          row_at_mut<Out>(r.rope_out, r.rope_out_stride_token, r.rope_out_stride_head, token, head),
          row_at_mut<Out>(r.nope_out, r.nope_out_stride_token, r.nope_out_stride_head, token, head)};
}

// --- the kernel ---------------------------------------------------------------------------
template <class Traits>
__global__ void __launch_bounds__(Traits::kMaxThreads)
    rope_kernel(const __grid_constant__ RopeParams p) {
  using In = typename Traits::In;
  using Out = typename Traits::Out;
  const int x = threadIdx.x;  // unit within a row
  const int rope_units = p.rope_dim / Traits::kUnit;
  const int kv_units = (p.rope_dim + p.nope_dim) / Traits::kUnit;
  const int v_units = p.v_dim / Traits::kUnit;
  const int rows = p.q.num_heads + p.k.num_heads + (Traits::kAppend ? p.num_v_heads : 0);

  for (int token = blockIdx.x; token < p.nnz; token += gridDim.x) {
    bool padding = false;
    int k_page = 0, v_page = 0, slot = 0;
    if constexpr (Traits::kAppend) {
      const int b = p.batch_indices[token];
      padding = b < 0;
      // A real token whose slot is outside the table/cache writes no K/V (debug mode
      // rejects it before launch); its q is still computed.
      if (!padding && !locate_slot<Traits::kTable>(p.table, p.num_pages, b, p.positions[token],
                                                   k_page, v_page, slot)) {
        k_page = -1;
      }
    }
    float c[8], s[8];
    bool angles_ok = true;
    if (!padding && x < rope_units) {
      angles_ok = unit_angles<Traits>(p, rope_position<Traits>(p, token), x, c, s);
    }
    for (int r = threadIdx.y; r < rows; r += blockDim.y) {
      if (r < p.q.num_heads) {  // q: always written; zeros for padding tokens
        if (x >= kv_units) continue;
        const RowPtrs row = tensor_row<Traits>(p.q, token, r);
        if (padding) {
          const bool is_rope = x < rope_units;
          Out* dst = static_cast<Out*>(is_rope ? row.rope_out : row.nope_out);
          const int lo = is_rope ? (Traits::kInterleave ? 16 * x : 8 * x) : 16 * (x - rope_units);
          const int hi = is_rope ? (Traits::kInterleave ? lo + 8 : p.rope_dim / 2 + 8 * x) : lo + 8;
          store8_value(dst + lo, 0.f);
          store8_value(dst + hi, 0.f);
        } else {
          rope_unit<Traits>(p, row, x, angles_ok, c, s, p.q_scale);
        }
        continue;
      }
      if (padding) continue;  // padding tokens touch no K/V storage at all
      if (r < p.q.num_heads + p.k.num_heads) {
        if (x >= kv_units) continue;
        const int h = r - p.q.num_heads;
        RowPtrs row = tensor_row<Traits>(p.k, token, h);
        if constexpr (Traits::kAppend) {
          if (k_page < 0) continue;
          row.rope_out = paged_ptr<Out>(p.k_rope_cache, k_page, slot, h);
          row.nope_out = paged_ptr<Out>(p.k_nope_cache, k_page, slot, h);
        }
        rope_unit<Traits>(p, row, x, angles_ok, c, s, p.kv_scale);
        continue;
      }
      if constexpr (Traits::kAppend) {  // v: quantize and store, no rotation
        if (x >= v_units || k_page < 0) continue;
        const int h = r - p.q.num_heads - p.k.num_heads;
        const In* src = row_at<In>(p.v_in, p.v_in_stride_token, p.v_in_stride_head, token, h) + 16 * x;
        Out* dst = paged_ptr<Out>(p.v_cache, v_page, slot, h) + 16 * x;
        float a[8], b[8];
        load8(src, a);
        load8(src + 8, b);
        store8(dst, a, p.kv_scale);
        store8(dst + 8, b, p.kv_scale);
      }
    }
  }
}

// Block shape: x = units of the widest row, y = rows in parallel, chosen so that the rows
// of a token split into equal rounds (48 rows of 8 units: 24 x 8 threads, 2 full rounds
// instead of 32 + 16).
template <class Traits>
int launch_rope(const RopeParams& p, cudaStream_t stream) {
  if (p.nnz == 0) return 0;
  const int kv_units = (p.rope_dim + p.nope_dim) / Traits::kUnit;
  const int units = Traits::kAppend && p.num_v_heads > 0 ? max(kv_units, p.v_dim / Traits::kUnit) : kv_units;
  const int rows = p.q.num_heads + p.k.num_heads + (Traits::kAppend ? p.num_v_heads : 0);
  const int max_y = max(1, Traits::kMaxThreads / units);
  const int rounds = (rows + max_y - 1) / max_y;
  const int y = (rows + rounds - 1) / rounds;
  const int blocks = static_cast<int>(p.nnz < num_sms() * 32 ? p.nnz : num_sms() * 32);
  rope_kernel<Traits><<<blocks, dim3(units, y), 0, stream>>>(p);
  return last_launch_error();
}

}  // namespace fij

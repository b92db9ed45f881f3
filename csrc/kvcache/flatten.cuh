// flatten_kv_cache: each request's K and V rows, in request order, into contiguous
// outputs; the padded tail [sum(kv_seqlens), out_size) is zero-filled, never stale.
//
// A block takes kThreads / (heads * D/8) rows at a time; each thread moves 8 elements
// (16 B of a 16-bit cache, 8 B of fp8) per K and per V, converting and scaling when the
// cache is fp8 or the output dtype differs.
#pragma once
#include "common/common.cuh"
#include "kvcache/flatten_params.h"
#include "common/page_table.cuh"

namespace fij {

template <typename TCache, typename TOut, int HeadDim, PageTableLayout Table>
struct FlattenTraits {
  using Cache = TCache;
  using Out = TOut;
  static constexpr int kHeadDim = HeadDim;
  static constexpr PageTableLayout kTable = Table;
  static constexpr int kChunks = HeadDim / 8;  // 8-element chunks per head
  static constexpr int kThreads = 256;
  static constexpr bool kRawCopy = std::is_same_v<TCache, TOut>;
};

template <typename T>
FIJ_DEVICE void store_chunk8(T* dst, const float (&x)[8]) {
  if constexpr (sizeof(T) == 2) {
    Vec16 raw;
    T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = static_cast<T>(x[i]);
    store_vec16(dst, raw);
  } else if constexpr (sizeof(T) == 4) {
    float4* d = reinterpret_cast<float4*>(dst);
    d[0] = make_float4(x[0], x[1], x[2], x[3]);
    d[1] = make_float4(x[4], x[5], x[6], x[7]);
  } else {
    uint2 raw;
    T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = T(x[i]);
    *reinterpret_cast<uint2*>(dst) = raw;
  }
}

template <class Traits>
FIJ_DEVICE void move_chunk(const typename Traits::Cache* src, typename Traits::Out* dst, float scale) {
  if constexpr (Traits::kRawCopy && sizeof(typename Traits::Cache) == 2) {
    store_vec16(dst, load_vec16(src));
  } else {
    float x[8];
    load8_float(src, x);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] *= scale;
    store_chunk8(dst, x);
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) flatten_kv_cache_kernel(const __grid_constant__ FlattenParams p) {
  using Out = typename Traits::Out;
  using Cache = typename Traits::Cache;
  const int chunks_per_row = p.kv.num_kv_heads * Traits::kChunks;
  const int rows_per_step = max(1, Traits::kThreads / chunks_per_row);
  const int lane = threadIdx.x % chunks_per_row;
  const int sub_row = threadIdx.x / chunks_per_row;
  if (sub_row >= rows_per_step) return;
  const int total = p.batch_size > 0 ? p.cu_seqlens[p.batch_size - 1] : 0;
  PageTable<Traits::kTable> table{p.table};

  for (int t = blockIdx.x * rows_per_step + sub_row; t < p.out_size; t += gridDim.x * rows_per_step) {
    int b = -1, pos = 0;
    if (t < total) {  // first b with cu_seqlens[b] > t
      int lo = 0, hi = p.batch_size - 1;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (p.cu_seqlens[mid] > t) hi = mid; else lo = mid + 1;
      }
      b = lo;
      pos = t - (b > 0 ? p.cu_seqlens[b - 1] : 0);
    }
    int k_page = -1, v_page = -1;
    const int logical = pos / p.table.page_size;
    if (b >= 0 && logical < table.num_pages(b)) {
      k_page = table.k_page(b, logical);
      v_page = table.v_page(b, logical);
      if (!valid_page(k_page, p.kv.num_pages) || !valid_page(v_page, p.kv.num_pages)) k_page = -1;
    }
    const int slot = pos - logical * p.table.page_size;
    for (int l = lane; l < chunks_per_row; l += Traits::kThreads) {
      const int h = l / Traits::kChunks;
      const int c = (l % Traits::kChunks) * 8;
      Out* k_dst = static_cast<Out*>(p.k_out) + t * p.out_stride_token + h * p.out_stride_head + c;
      Out* v_dst = static_cast<Out*>(p.v_out) + t * p.out_stride_token + h * p.out_stride_head + c;
      if (k_page < 0) {  // padded tail (or a row outside the table): zeros
        const float zero[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        store_chunk8(k_dst, zero);
        store_chunk8(v_dst, zero);
        continue;
      }
      move_chunk<Traits>(paged_ptr<Cache>(p.kv.k, k_page, slot, h) + c, k_dst, p.k_scale);
      move_chunk<Traits>(paged_ptr<Cache>(p.kv.v, v_page, slot, h) + c, v_dst, p.v_scale);
    }
  }
}

template <class Traits>
int launch_flatten_kv_cache(const FlattenParams& p, cudaStream_t stream) {
  if (p.out_size == 0) return 0;
  const int chunks_per_row = p.kv.num_kv_heads * Traits::kChunks;
  const int rows_per_step = chunks_per_row >= Traits::kThreads ? 1 : Traits::kThreads / chunks_per_row;
  const int64_t wanted = ceil_div(p.out_size, rows_per_step);
  const int64_t cap = int64_t(num_sms()) * 16;
  flatten_kv_cache_kernel<Traits><<<static_cast<int>(wanted < cap ? wanted : cap), Traits::kThreads, 0, stream>>>(p);
  return last_launch_error();
}

}  // namespace fij

// The Hopper prefill kernel's params from the binding's resolved arguments (PrefillSm90Args):
// the TMA maps of q, K and V encoded on the host. The prefill module's launch and POD's
// Hopper launch (csrc/pod/pod_sm90.cuh) both build their prefill side here.
#pragma once
#include <cuda_bf16.h>

#include <stdexcept>
#include <type_traits>

#include "hopper/prefill_sm90.cuh"
#include "hopper/tma_host.h"

namespace fij::sm90_prefill {

// The 3-D map of a [tokens, heads, head_dim] tensor (strides in elements): boxes of one
// 128-byte swizzle atom (64 16-bit elements, or 128 e4m3 ones: fp8) by `rows` rows, rows past
// `tokens` read as zeros.
inline CUtensorMap rows_map(const void* base, int64_t tokens, int64_t heads, int64_t stride_n, int64_t stride_h,
                            uint32_t rows, int head_dim, bool bf16, bool fp8 = false) {
  const uint64_t bytes = fp8 ? 1 : 2;
  const uint64_t dims[3] = {uint64_t(head_dim), uint64_t(heads), uint64_t(tokens)};
  const uint64_t strides[2] = {uint64_t(stride_h) * bytes, uint64_t(stride_n) * bytes};
  const uint32_t box[3] = {uint32_t(128 / bytes), 1, rows};
  const CUtensorMapDataType type =
      fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return fij::sm90::tensor_map(base, 3, dims, strides, box, type, CU_TENSOR_MAP_SWIZZLE_128B);
}

// The 4-D map of a paged cache (strides in elements, whatever the layout): dims D,
// page_size, heads, pages; boxes of one page's rows and 64 elements.
inline CUtensorMap page_map(const void* base, int64_t pages, int64_t heads, int64_t page_size, int64_t stride_p,
                            int64_t stride_h, int64_t stride_n, int head_dim, bool bf16) {
  const uint64_t dims[4] = {uint64_t(head_dim), uint64_t(page_size), uint64_t(heads), uint64_t(pages)};
  const uint64_t strides[3] = {uint64_t(stride_n) * 2, uint64_t(stride_h) * 2, uint64_t(stride_p) * 2};
  const uint32_t box[4] = {64, uint32_t(page_size), 1, 1};
  return fij::sm90::tensor_map_16bit(base, 4, dims, strides, box, bf16, CU_TENSOR_MAP_SWIZZLE_128B);
}

// p from a: 0, or a CUDA error code (cudaErrorInvalidValue: a map the driver refused, a page
// size the key tile does not take, a custom mask without its bits). a.q_tokens > 0.
// kFp8: q, K and V in e4m3 (FP8 attention; ragged K/V), DType the output's.
template <typename DType, int kHeadDim, int kKeyTile, bool kPaged, bool kCustom, int kBlockM, bool kFp8 = false>
int make_params(const PrefillSm90Args& a, PrefillSm90Params& p) {
  static_assert(!(kFp8 && kPaged), "FP8 attention reads ragged K/V");
  constexpr bool kBf16 = std::is_same_v<DType, __nv_bfloat16>;
  constexpr int kHeadDimVo = sm90_head_dim_vo<kHeadDim>();
  try {
    p.q_map = rows_map(a.q, a.q_tokens, a.num_qo_heads, a.q_stride_n, a.q_stride_h, kBlockM, kHeadDim, kBf16, kFp8);
    if (a.kv_tokens == 0) {
      // No key at all (no row, or no page): every item only writes zeros and reads no K/V;
      // a map needs a tensor of one row at least, so q's stands in for them
      p.k_map = p.v_map = rows_map(a.q, a.q_tokens, a.num_qo_heads, a.q_stride_n, a.q_stride_h, kKeyTile, kHeadDim,
                                   kBf16, kFp8);
    } else if (kPaged) {
      if (a.page_size <= 0 || (a.page_size & (a.page_size - 1)) != 0 || kKeyTile % a.page_size != 0)
        return static_cast<int>(cudaErrorInvalidValue);
      p.k_map = page_map(a.k, a.kv_tokens, a.num_kv_heads, a.page_size, a.k_stride_p, a.k_stride_h, a.k_stride_n,
                         kHeadDim, kBf16);
      p.v_map = page_map(a.v, a.kv_tokens, a.num_kv_heads, a.page_size, a.v_stride_p, a.v_stride_h, a.v_stride_n,
                         kHeadDimVo, kBf16);
    } else {
      p.k_map = rows_map(a.k, a.kv_tokens, a.num_kv_heads, a.k_stride_n, a.k_stride_h, kKeyTile, kHeadDim, kBf16,
                         kFp8);
      p.v_map = rows_map(a.v, a.kv_tokens, a.num_kv_heads, a.v_stride_n, a.v_stride_h, kKeyTile, kHeadDimVo, kBf16,
                         kFp8);
    }
  } catch (const std::exception&) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (kPaged) {
    p.page_ids = a.page_ids;
    p.page_shift = a.page_size > 0 ? __builtin_ctz(static_cast<unsigned>(a.page_size)) : 0;
  }
  p.out = a.out;
  p.out_stride_n = a.out_stride_n;
  p.out_stride_h = a.out_stride_h;
  p.lse = a.lse;
  p.work = a.work;
  p.counters = a.counters;
  p.num_qo_heads = a.num_qo_heads;
  p.group = a.num_qo_heads / a.num_kv_heads;
  p.scale_log2 = a.scale_log2;
  p.soft_cap_log2 = a.soft_cap_log2;
  p.sinks = a.sinks;
  p.window_left = a.window_left;
  p.v_scale = a.v_scale;
  p.mask = static_cast<const uint32_t*>(a.mask);
  if (kCustom && p.mask == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  return 0;
}

}  // namespace fij::sm90_prefill

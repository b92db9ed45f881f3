// Parameters of flatten_kv_cache: paged K/V -> contiguous per-request K/V.
#pragma once
#include "common/page_table_params.h"

namespace fij {

struct FlattenParams {
  PagedKVParams kv;       // source cache
  PageTableParams table;  // page ids (lengths come from cu_seqlens, not the table)
  const int32_t* cu_seqlens = nullptr;  // [B]: inclusive prefix sum of kv_seqlens
  int32_t batch_size = 0;
  void* k_out = nullptr;  // [out_size, H, D] ("shd") or [H, out_size, D] ("hsd")
  void* v_out = nullptr;
  int64_t out_stride_token = 0, out_stride_head = 0;
  int32_t out_size = 0;   // rows from sum(kv_seqlens) to out_size are written as zeros
  float k_scale = 1.f, v_scale = 1.f;  // dequantization of fp8 caches
};

}  // namespace fij

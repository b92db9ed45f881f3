// Parameters of the merge of partial attention states (csrc/common/merge.cuh): split-KV's
// second step when it runs as its own kernel (decode and prefill), and FlashInfer's
// merge_states. Host code includes this header; merge.cuh holds the device code.
#pragma once
#include <cstdint>

namespace fij {

struct MergeParams {
  const float* partial_o = nullptr;  // [rows, heads, head_dim]
  const float* partial_lse = nullptr;
  const int32_t* merge_indptr = nullptr;  // [num_rows + 1]
  void* out = nullptr;
  int64_t out_stride_b = 0, out_stride_h = 0;
  float* lse = nullptr;
  int32_t num_rows = 0, num_heads = 0, head_dim = 0;
  // merge_states form: v [n, S, H, D] with its strides, s [n, S, H]
  const void* states = nullptr;
  int64_t states_stride_n = 0, states_stride_s = 0, states_stride_h = 0;
  const float* states_lse = nullptr;
  int64_t lse_stride_n = 0, lse_stride_s = 0;
  int32_t num_states = 0;
};

}  // namespace fij

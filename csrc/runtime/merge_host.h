// The merge kernels' parameters on the host: a split's merge (decode's and prefill's bindings)
// and merge_states' (the merge module's binding).
#pragma once
#include "common/merge_params.h"
#include "runtime/torch_binding.h"

namespace fij {

// A split's merge as its own kernel: output row r (of `rows`) from its partial rows
// merge_indptr[r] .. merge_indptr[r + 1] (float32 partial_o [rows, heads, head_dim],
// partial_lse [rows, heads]); rows with none were written by the attention kernel.
inline MergeParams split_merge_params(const float* partial_o, const float* partial_lse, const int32_t* merge_indptr,
                                      void* out, int64_t out_stride_row, int64_t out_stride_head, float* lse,
                                      int64_t rows, int32_t heads, int32_t head_dim) {
  MergeParams m;
  m.partial_o = partial_o;
  m.partial_lse = partial_lse;
  m.merge_indptr = merge_indptr;
  m.out = out;
  m.out_stride_b = out_stride_row;
  m.out_stride_h = out_stride_head;
  m.lse = lse;
  m.num_rows = static_cast<int32_t>(rows);
  m.num_heads = heads;
  m.head_dim = head_dim;
  return m;
}

// merge_states: v [n, S, H, D] (head_dim contiguous), s [n, S, H] (heads contiguous).
inline MergeParams make_merge_states_params(const at::Tensor& v, const at::Tensor& s, const at::Tensor& v_out,
                                            const at::Tensor& s_out) {
  expect_cuda(v, "v");
  TORCH_CHECK(v.dim() == 4 && s.dim() == 3 && s.stride(2) == 1, "merge_states: v [n, S, H, D], s [n, S, H]");
  MergeParams m;
  m.states = v.const_data_ptr();
  m.states_stride_n = v.stride(0);
  m.states_stride_s = v.stride(1);
  m.states_stride_h = v.stride(2);
  m.states_lse = static_cast<const float*>(s.const_data_ptr());
  m.lse_stride_n = s.stride(0);
  m.lse_stride_s = s.stride(1);
  m.out = v_out.data_ptr();
  m.out_stride_b = v_out.stride(0);
  m.out_stride_h = v_out.stride(1);
  m.lse = static_cast<float*>(s_out.data_ptr());
  m.num_rows = static_cast<int32_t>(v.size(0));
  m.num_states = static_cast<int32_t>(v.size(1));
  m.num_heads = static_cast<int32_t>(v.size(2));
  m.head_dim = static_cast<int32_t>(v.size(3));
  return m;
}

}  // namespace fij

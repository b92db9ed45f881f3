// Host side of batch decode: tensors -> params.
#pragma once
#include <cmath>
#include <cstring>

#include "decode/decode_params.h"
#include "runtime/merge_host.h"
#include "runtime/torch_binding.h"

namespace fij {

inline float* float_ptr_or_null(const at::Tensor& t) {
  return t.numel() == 0 ? nullptr : static_cast<float*>(t.data_ptr());
}

struct DecodeScalars {
  double logit_scale, v_scale, soft_cap;
  int64_t window_left;
  double rope_scale, rope_theta;
};

inline DecodeParams make_decode_params(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       at::TensorList page_table, const at::Tensor& work, const at::Tensor& out,
                                       const at::Tensor& lse, const at::Tensor& partial_o,
                                       const at::Tensor& partial_lse, const DecodeScalars& s, KVLayout layout,
                                       PageTableLayout table) {
  expect_cuda(q, "q");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3, "q and out must be [batch, num_qo_heads, head_dim]");
  DecodeParams p;
  p.q = q.const_data_ptr();
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.kv = make_paged_kv(k_cache, v_cache, layout);
  p.table = make_page_table(table, page_table, p.kv.page_size);
  p.work = static_cast<const int32_t*>(work.const_data_ptr());
  p.out = out.data_ptr();
  p.out_stride_b = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.lse = float_ptr_or_null(lse);
  p.partial_o = float_ptr_or_null(partial_o);
  p.partial_lse = float_ptr_or_null(partial_lse);
  p.num_qo_heads = static_cast<int32_t>(q.size(1));
  p.group = static_cast<int32_t>(q.size(1) / p.kv.num_kv_heads);
  p.logit_scale = static_cast<float>(s.logit_scale);
  p.v_scale = static_cast<float>(s.v_scale);
  p.soft_cap = static_cast<float>(s.soft_cap);
  p.window_left = static_cast<int32_t>(s.window_left);
  p.rope_rcp_scale = static_cast<float>(1.0 / s.rope_scale);
  p.rope_log2_theta = static_cast<float>(std::log2(s.rope_theta));
  return p;
}

inline MergeParams make_merge_splits_params(const DecodeParams& d, const at::Tensor& merge_indptr,
                                            const at::Tensor& out, int64_t merge_rows, int32_t head_dim) {
  return split_merge_params(d.partial_o, d.partial_lse, static_cast<const int32_t*>(merge_indptr.const_data_ptr()),
                            out.data_ptr(), out.stride(0), out.stride(1), d.lse, merge_rows, d.num_qo_heads, head_dim);
}

}  // namespace fij

// Host side of the RoPE family: tensors -> RopeParams.
#pragma once
#include <cmath>

#include "kvcache/rope_params.h"
#include "runtime/torch_binding.h"

namespace fij {

// q/k rows: rope part [nnz, heads, rope_dim] and nope part [nnz, heads, nope_dim]
// (nope may be empty); outputs the same shapes. Any token/head strides.
// An empty nope tensor (any shape) means nope_dim = 0: the whole row is rotated.
inline RopeRows make_rope_rows(const at::Tensor& rope_in, const at::Tensor& nope_in,
                               const at::Tensor& rope_out, const at::Tensor& nope_out) {
  TORCH_CHECK(rope_in.dim() == 3, "rope inputs must be [nnz, heads, dim]");
  for (const at::Tensor* t : {&rope_in, &nope_in, &rope_out, &nope_out}) {
    expect_aligned(*t, 8 * t->element_size(), "a RoPE input or output");  // 8-element vectors
  }
  RopeRows r;
  rows_of(rope_in, r.rope_in, r.rope_in_stride_token, r.rope_in_stride_head);
  rows_of(rope_out, r.rope_out, r.rope_out_stride_token, r.rope_out_stride_head);
  if (nope_in.numel() > 0) {
    TORCH_CHECK(nope_in.dim() == 3 && nope_out.dim() == 3, "nope parts must be [nnz, heads, dim]");
    rows_of(nope_in, r.nope_in, r.nope_in_stride_token, r.nope_in_stride_head);
    rows_of(nope_out, r.nope_out, r.nope_out_stride_token, r.nope_out_stride_head);
  }
  r.num_heads = static_cast<int32_t>(rope_in.size(1));
  return r;
}

inline int32_t nope_dim_of(const at::Tensor& nope) { return nope.numel() > 0 ? static_cast<int32_t>(nope.size(-1)) : 0; }

struct RopeScalars {
  double rope_scale, rope_theta, smooth_a, smooth_b, quant_scale_q, quant_scale_kv;
};

inline RopeParams make_rope_params(const at::Tensor& q_rope, const at::Tensor& k_rope,
                                   const at::Tensor& q_nope, const at::Tensor& k_nope,
                                   const at::Tensor& q_rope_out, const at::Tensor& k_rope_out,
                                   const at::Tensor& q_nope_out, const at::Tensor& k_nope_out,
                                   const at::Tensor& pos_ids, const at::Tensor& indptr,
                                   const at::Tensor& offsets, const at::Tensor& cos_sin_cache,
                                   const RopeScalars& s) {
  expect_cuda(q_rope, "q_rope");
  RopeParams p;
  p.q = make_rope_rows(q_rope, q_nope, q_rope_out, q_nope_out);
  p.k = make_rope_rows(k_rope, k_nope, k_rope_out, k_nope_out);
  p.nnz = static_cast<int32_t>(q_rope.size(0));
  p.rope_dim = static_cast<int32_t>(q_rope.size(2));
  p.nope_dim = nope_dim_of(q_nope);
  p.pos_ids = int32_ptr(pos_ids);
  p.indptr = int32_ptr(indptr);
  p.offsets = int32_ptr(offsets);
  p.batch_size = static_cast<int32_t>(offsets.numel());
  if (cos_sin_cache.numel() > 0) {
    p.cos_sin_cache = static_cast<const float*>(cos_sin_cache.const_data_ptr());
    p.cos_sin_rows = static_cast<int32_t>(cos_sin_cache.size(0));
  }
  p.rcp_scale = static_cast<float>(1.0 / s.rope_scale);
  p.log2_theta = static_cast<float>(std::log2(s.rope_theta));
  p.smooth_a = static_cast<float>(s.smooth_a);
  p.smooth_b = static_cast<float>(s.smooth_b);
  p.q_scale = static_cast<float>(s.quant_scale_q);
  p.kv_scale = static_cast<float>(s.quant_scale_kv);
  return p;
}

// Append form: k rows go to (k_rope_cache, k_nope_cache) slots, v rows to v_cache.
// GQA/MHA: both are the 4-D k_cache, the nope part starting k_nope_offset elements into
// each row (= rope_dim). MLA: 3-D kpe/ckv caches (offset 0) and an empty v.
inline void add_append_params(RopeParams& p, const at::Tensor& v, const at::Tensor& k_rope_cache,
                              const at::Tensor& k_nope_cache, int64_t k_nope_offset,
                              const at::Tensor& v_cache, at::TensorList page_table,
                              const at::Tensor& batch_indices, const at::Tensor& positions,
                              KVLayout layout, PageTableLayout table) {
  for (const at::Tensor* t : {&v, &k_rope_cache, &k_nope_cache, &v_cache}) {
    expect_aligned(*t, 8 * t->element_size(), "v or a paged cache");  // 8-element vectors
  }
  p.k_rope_cache = make_paged_tensor(k_rope_cache, layout);
  p.k_nope_cache = make_paged_tensor(k_nope_cache, layout);
  p.k_nope_cache.data = static_cast<char*>(p.k_nope_cache.data) + k_nope_offset * k_nope_cache.element_size();
  p.num_pages = static_cast<int32_t>(k_rope_cache.size(0));
  const int32_t page_size = static_cast<int32_t>(
      k_rope_cache.dim() == 3 ? k_rope_cache.size(1) : k_rope_cache.size(layout == KVLayout::kNHD ? 1 : 2));
  if (v.numel() > 0) {
    TORCH_CHECK(v.dim() == 3, "v must be [nnz, num_kv_heads, head_dim]");
    p.v_cache = make_paged_tensor(v_cache, layout);
    rows_of(v, p.v_in, p.v_in_stride_token, p.v_in_stride_head);
    p.num_v_heads = static_cast<int32_t>(v.size(1));
    p.v_dim = static_cast<int32_t>(v.size(2));
  }
  p.table = make_page_table(table, page_table, page_size);
  p.batch_indices = int32_ptr(batch_indices);
  p.positions = int32_ptr(positions);
}

}  // namespace fij

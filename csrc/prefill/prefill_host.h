// Host side of batch prefill: tensors -> PrefillParams, and the merge of split rows.
#pragma once
#include <cmath>
#include <cstring>

#include "prefill/prefill_params.h"
#include "runtime/merge_host.h"
#include "runtime/torch_binding.h"

namespace fij {

struct PrefillScalars {
  double logit_scale, soft_cap_log2, v_scale;
  int64_t window_left;
  double rope_scale, rope_theta;
};

inline float* f32_or_null(const at::Tensor& t) { return t.numel() == 0 ? nullptr : static_cast<float*>(t.data_ptr()); }

// q [qo_tokens, Hq, Dqk]; k/v: the paged caches (4-D, with the page table in kv_index) or
// ragged rows [kv_tokens, Hk, D] (kv_index = [kv_indptr]).
inline PrefillParams make_prefill_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         at::TensorList kv_index, const at::Tensor& qo_indptr, const at::Tensor& work,
                                         const at::Tensor& out, const at::Tensor& lse, const at::Tensor& partial_o,
                                         const at::Tensor& partial_lse, const PrefillScalars& s, bool ragged,
                                         KVLayout layout, PageTableLayout table) {
  expect_cuda(q, "q");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3, "q and out must be [qo_tokens, num_qo_heads, head_dim]");
  PrefillParams p;
  rows_of(q, p.q, p.q_stride_n, p.q_stride_h);
  p.qo_indptr = int32_ptr(qo_indptr);
  p.batch_size = static_cast<int32_t>(qo_indptr.numel() - 1);
  if (ragged) {
    TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && kv_index.size() == 1, "ragged k and v must be [kv_tokens, heads, dim]");
    p.kv.k.data = k.data_ptr();
    p.kv.k.stride_token = k.stride(0);
    p.kv.k.stride_head = k.stride(1);
    p.kv.v.data = v.data_ptr();
    p.kv.v.stride_token = v.stride(0);
    p.kv.v.stride_head = v.stride(1);
    p.kv.num_kv_heads = static_cast<int32_t>(k.size(1));
    p.kv.head_dim = static_cast<int32_t>(k.size(2));
    p.kv_indptr = int32_ptr(kv_index[0]);
  } else {
    p.kv = make_paged_kv(k, v, layout);
    p.table = make_page_table(table, kv_index, p.kv.page_size);
    const int ps = p.kv.page_size;
    if (ps > 0 && (ps & (ps - 1)) == 0) p.page_shift = __builtin_ctz(static_cast<unsigned>(ps));
  }
  p.work = int32_ptr(work);
  rows_of(out, p.out, p.out_stride_n, p.out_stride_h);
  // (the kernel forms a row's offset from these strides in 32-bit products)
  constexpr int64_t kMaxStride = (int64_t(1) << 31) - 1;
  TORCH_CHECK(p.q_stride_n >= 0 && p.q_stride_n <= kMaxStride && p.q_stride_h >= 0 && p.q_stride_h <= kMaxStride,
              "q: token and head strides must lie in [0, 2^31)");
  TORCH_CHECK(p.out_stride_n >= 0 && p.out_stride_n <= kMaxStride && p.out_stride_h >= 0 &&
                  p.out_stride_h <= kMaxStride,
              "out: token and head strides must lie in [0, 2^31)");
  p.lse = f32_or_null(lse);
  p.partial_o = f32_or_null(partial_o);
  p.partial_lse = f32_or_null(partial_lse);
  p.num_qo_heads = static_cast<int32_t>(q.size(1));
  TORCH_CHECK(p.kv.num_kv_heads > 0 && p.num_qo_heads % p.kv.num_kv_heads == 0,
              "num_qo_heads must be a multiple of num_kv_heads");
  p.group = p.num_qo_heads / p.kv.num_kv_heads;
  p.group_magic = 0xFFFFFFFFu / static_cast<uint32_t>(p.group);  // divmod's magic (csrc/common/common.cuh)
  p.kv_head_magic = 0xFFFFFFFFu / static_cast<uint32_t>(p.kv.num_kv_heads);
  p.logit_scale = static_cast<float>(s.logit_scale);
  p.soft_cap_log2 = static_cast<float>(s.soft_cap_log2);
  p.v_scale = static_cast<float>(s.v_scale);
  p.window_left = static_cast<int32_t>(s.window_left);
  p.rope_rcp_scale = static_cast<float>(1.0 / s.rope_scale);
  p.rope_log2_theta = static_cast<float>(std::log2(s.rope_theta));
  return p;
}

// The merge of split rows: output row t = qo token t, its partial rows merge_indptr[t] ..
// merge_indptr[t + 1] (none: not split, the prefill kernel wrote it).
inline MergeParams make_prefill_merge_params(const PrefillParams& p, const at::Tensor& merge_indptr, int64_t rows,
                                             int32_t head_dim) {
  return split_merge_params(p.partial_o, p.partial_lse, int32_ptr(merge_indptr), p.out, p.out_stride_n, p.out_stride_h,
                            p.lse, rows, p.num_qo_heads, head_dim);
}

}  // namespace fij

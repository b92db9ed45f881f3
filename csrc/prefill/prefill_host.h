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

// What a prefill module compiled in that the host side of its launch checks and uses.
struct PrefillModule {
  const char* name;  // the module's, for errors
  bool ragged;
  KVLayout layout;
  PageTableLayout table;
  int head_dim_qk, head_dim_vo;
  bool custom_mask, sinks;
};

// The prefill op's arguments (csrc/prefill/prefill.cuh; flashinfer_jit/prefill/spec.py op_schemas)
// resolved into a launch: the params, the merge of split rows (in the kernel given
// merge_counters, else by the merge kernel), the grid and the query tile. The prefill op
// launches it; POD launches it beside a decode launch (csrc/pod/pod.cuh).
inline PrefillLaunch resolve_prefill(const PrefillModule& m, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, at::TensorList kv_index, const at::Tensor& qo_indptr,
                                     const at::Tensor& work, const at::Tensor& merge_indptr,
                                     const std::optional<at::Tensor>& mask,
                                     const std::optional<at::Tensor>& mask_indptr,
                                     const std::optional<at::Tensor>& sinks, const at::Tensor& out,
                                     const at::Tensor& lse, const at::Tensor& partial_o,
                                     const at::Tensor& partial_lse, const at::Tensor& merge_counters,
                                     const PrefillScalars& s, int64_t grid, int64_t tile_rows, int64_t merge_rows) {
  PrefillParams p = make_prefill_params(q, k, v, kv_index, qo_indptr, work, out, lse, partial_o, partial_lse, s,
                                        m.ragged, m.layout, m.table);
  TORCH_CHECK(q.size(2) == m.head_dim_qk && out.size(2) == m.head_dim_vo, m.name, ": q / out: expected head_dim ",
              m.head_dim_qk, " / ", m.head_dim_vo);
  // (run() checks these in Python, except while torch.compile traces it: no addresses then)
  expect_aligned(q, 16, "q");
  expect_aligned(k, 16, "k");
  expect_aligned(v, 16, "v");
  if (m.custom_mask) {
    TORCH_CHECK(mask.has_value() && mask_indptr.has_value(), m.name,
                ": this module reads a custom mask: pass mask and mask_indptr");
    p.mask = static_cast<const uint8_t*>(mask->const_data_ptr());
    p.mask_indptr = int32_ptr(*mask_indptr);
  }
  if (m.sinks) {
    TORCH_CHECK(sinks.has_value() && sinks->scalar_type() == at::kFloat && sinks->numel() == q.size(1),
                "sinks: expected float32 [num_qo_heads]");
    p.sinks = static_cast<const float*>(sinks->const_data_ptr());
  }
  PrefillLaunch l;
  if (merge_rows > 0 && merge_counters.numel() > 0) {  // merged in the kernel by each split tile's last block
    TORCH_CHECK(merge_counters.scalar_type() == at::kInt && merge_counters.device() == q.device() &&
                    merge_counters.numel() >= partial_lse.numel(),
                "merge_counters: expected int32 zeros on q's device, at least as many as partial_lse's ",
                partial_lse.numel());
    p.merge_counters = static_cast<int32_t*>(merge_counters.data_ptr());
  } else if (merge_rows > 0) {
    l.merge = make_prefill_merge_params(p, merge_indptr, merge_rows, m.head_dim_vo);
  }
  l.params = p;
  l.grid = static_cast<int32_t>(grid);
  l.tile_rows = static_cast<int32_t>(tile_rows);
  l.device = q.device().index();
  return l;
}

}  // namespace fij

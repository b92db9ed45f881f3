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

// What a decode module compiled in that the host side of its launch checks and uses.
struct DecodeModule {
  KVLayout layout;
  PageTableLayout table;
  int head_dim;
  int group_tile;
  int q_tokens;        // query tokens a request (multi-token decode: > 1)
  bool tensor_cores;   // csrc/decode/decode_mma.cuh (else decode.cuh, which runs no clusters)
  int cluster_blocks;  // the tensor-core module's cluster size
};

// The decode op's arguments (flashinfer_jit/decode/spec.py op_schemas) resolved into a launch:
// params, the split's merge (in the kernel given merge_counters, else the merge kernel's),
// the grid, KV-head pairs and clusters. The decode op launches it; POD launches it beside
// a prefill launch (csrc/pod/pod.cuh).
inline DecodeLaunch resolve_decode(const DecodeModule& m, const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, at::TensorList page_table, const at::Tensor& work,
                                   const at::Tensor& merge_indptr, const at::Tensor& out, const at::Tensor& lse,
                                   const at::Tensor& partial_o, const at::Tensor& partial_lse,
                                   const DecodeScalars& s, int64_t grid_items, int64_t merge_rows,
                                   const std::optional<at::Tensor>& merge_counters, int64_t kv_heads_per_block,
                                   int64_t cluster_size, int64_t cluster_warps) {
  DecodeLaunch l;
  l.params = make_decode_params(q, k_cache, v_cache, page_table, work, out, lse, partial_o, partial_lse, s, m.layout,
                                m.table);
  if (m.q_tokens > 1) {
    // q, out and lse come as [batch, q_tokens x num_qo_heads, ...]: (token, head) rows of a request
    TORCH_CHECK(q.size(1) % (m.q_tokens * l.params.kv.num_kv_heads) == 0, "q: expected [batch, ", m.q_tokens,
                " x num_qo_heads, head_dim] (the request's tokens' heads)");
    l.params.group = static_cast<int32_t>(q.size(1) / (m.q_tokens * l.params.kv.num_kv_heads));
    TORCH_CHECK(kv_heads_per_block == 1, "a multi-token decode module runs no KV-head pairs");
  }
  // (run() checks these in Python, except while torch.compile traces it: no addresses then)
  expect_aligned(q, 16, "q");
  expect_aligned(k_cache, 16, "k_cache");
  expect_aligned(v_cache, 16, "v_cache");
  l.grid_items = static_cast<int32_t>(grid_items);
  l.num_kv_heads = l.params.kv.num_kv_heads;
  l.device = q.device().index();
  TORCH_CHECK(kv_heads_per_block == 1 || kv_heads_per_block == 2, "kv_heads_per_block: expected 1 or 2, got ",
              kv_heads_per_block);
  l.kv_heads_per_block = static_cast<int32_t>(kv_heads_per_block);
  if (m.tensor_cores) {
    TORCH_CHECK(cluster_size == 1 || (cluster_size == m.cluster_blocks && kv_heads_per_block == 1 &&
                                      grid_items % cluster_size == 0 && merge_rows == 0),
                "cluster_size: expected 1, or ", m.cluster_blocks,
                " with one KV head per block, whole clusters of work items and no partial rows; got ", cluster_size);
    TORCH_CHECK(cluster_warps == 4 || (cluster_warps == 8 && cluster_size > 1),
                "cluster_warps: expected 4, or 8 with cluster_size > 1; got ", cluster_warps);
  } else {
    TORCH_CHECK(cluster_size == 1 && cluster_warps == 4, "cluster_size: this module's kernel runs no clusters");
  }
  l.cluster = static_cast<int32_t>(cluster_size);
  l.cluster_warps = static_cast<int32_t>(cluster_warps);
  // The kernel merges split requests itself given zeroed counters (the last block of a
  // request and head tile to finish); without them the merge kernel runs after it.
  const bool fused_merge = merge_rows > 0 && merge_counters.has_value() && merge_counters->numel() > 0;
  if (fused_merge) {
    TORCH_CHECK(merge_counters->scalar_type() == at::kInt && merge_counters->is_contiguous() &&
                    merge_counters->numel() >=
                        (merge_indptr.numel() - 1) * l.num_kv_heads * (l.params.group / m.group_tile),
                "merge_counters: expected contiguous int32 zeros, one per request and head tile");
    l.params.merge_counters = static_cast<int32_t*>(merge_counters->data_ptr());
    l.params.merge_indptr = static_cast<const int32_t*>(merge_indptr.const_data_ptr());
  }
  if (merge_rows > 0 && !fused_merge) l.merge = make_merge_splits_params(l.params, merge_indptr, out, merge_rows, m.head_dim);
  return l;
}

}  // namespace fij

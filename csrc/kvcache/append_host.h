// Host side of append_paged_kv_cache / get_batch_indices_positions: tensors -> params.
#pragma once
#include "kvcache/append_params.h"
#include "runtime/torch_binding.h"

namespace fij {

inline AppendParams make_append_params(const at::Tensor& append_key, const at::Tensor& append_value,
                                       const at::Tensor& batch_indices, const at::Tensor& positions,
                                       const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       at::TensorList page_table, KVLayout layout,
                                       PageTableLayout table_layout) {
  expect_cuda(append_key, "append_key");
  expect_cuda(k_cache, "k_cache");
  TORCH_CHECK(append_key.dim() == 3 && append_value.dim() == 3, "append_key/value must be [nnz, heads, dim]");
  expect_aligned(append_key, 16, "append_key");
  expect_aligned(append_value, 16, "append_value");
  expect_aligned(k_cache, 16, "k_cache");
  expect_aligned(v_cache, 16, "v_cache");
  AppendParams p;
  rows_of(append_key, p.append_key, p.key_stride_token, p.key_stride_head);
  rows_of(append_value, p.append_value, p.value_stride_token, p.value_stride_head);
  p.batch_indices = int32_ptr(batch_indices);
  p.positions = int32_ptr(positions);
  p.nnz = static_cast<int32_t>(append_key.size(0));
  p.kv = make_paged_kv(k_cache, v_cache, layout);
  p.table = make_page_table(table_layout, page_table, p.kv.page_size);
  return p;
}

inline BatchIndicesParams make_batch_indices_params(const at::Tensor& append_indptr,
                                                    const at::Tensor& seq_lens,
                                                    const at::Tensor& batch_indices,
                                                    const at::Tensor& positions) {
  expect_cuda(append_indptr, "append_indptr");
  BatchIndicesParams p;
  p.append_indptr = int32_ptr(append_indptr);
  p.seq_lens = int32_ptr(seq_lens);
  p.batch_indices = static_cast<int32_t*>(batch_indices.data_ptr());
  p.positions = static_cast<int32_t*>(positions.data_ptr());
  p.batch_size = static_cast<int32_t>(append_indptr.numel() - 1);
  p.nnz = static_cast<int32_t>(batch_indices.numel());
  return p;
}

}  // namespace fij

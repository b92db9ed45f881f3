// Host side of flatten_kv_cache: tensors -> FlattenParams.
#pragma once
#include "kvcache/flatten_params.h"
#include "runtime/torch_binding.h"

namespace fij {

// k_out/v_out are [out_size, H, D] ("shd") or [H, out_size, D] ("hsd"): strides say which.
inline FlattenParams make_flatten_params(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const at::Tensor& cu_seqlens, at::TensorList page_table,
                                         const at::Tensor& k_out, const at::Tensor& v_out,
                                         double k_scale, double v_scale, bool hsd,
                                         KVLayout layout, PageTableLayout table) {
  expect_cuda(k_cache, "k_cache");
  TORCH_CHECK(k_out.dim() == 3 && k_out.strides() == v_out.strides(), "k_out/v_out must match");
  FlattenParams p;
  p.kv = make_paged_kv(k_cache, v_cache, layout);
  p.table = make_page_table(table, page_table, p.kv.page_size);
  p.cu_seqlens = int32_ptr(cu_seqlens);
  p.batch_size = static_cast<int32_t>(cu_seqlens.numel());
  p.k_out = k_out.data_ptr();
  p.v_out = v_out.data_ptr();
  p.out_stride_token = hsd ? k_out.stride(1) : k_out.stride(0);
  p.out_stride_head = hsd ? k_out.stride(0) : k_out.stride(1);
  p.out_size = static_cast<int32_t>(hsd ? k_out.size(1) : k_out.size(0));
  p.k_scale = static_cast<float>(k_scale);
  p.v_scale = static_cast<float>(v_scale);
  return p;
}

}  // namespace fij

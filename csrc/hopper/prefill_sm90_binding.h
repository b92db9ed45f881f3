// The Hopper prefill op's arguments resolved from torch tensors (PrefillSm90Args), as its
// binding (templates/prefill/prefill_sm90_binding.cc.j2) and POD's Hopper binding
// (templates/pod/pod_sm90_binding.cc.j2) take them. Host only (torch's headers, no CUDA's).
#pragma once
#include "hopper/prefill_sm90_params.h"
#include "runtime/torch_binding.h"

namespace fij {

// What a module's spec fixes: its name (for the errors), paged or ragged K/V, the paged
// layout (NHD or HND), the head dims, a custom mask, FP8 attention (q, K and V in e4m3, the
// output 16-bit; else all four 16-bit).
struct Sm90Module {
  const char* name;
  bool paged;
  bool nhd;
  int head_dim;
  int head_dim_vo;
  bool custom;
  bool fp8 = false;
};

// q [q_tokens, Hq, D]; k / v: paged, the caches [pages, page_size, Hk, D] (NHD) or
// [pages, Hk, page_size, D] (HND), with page_ids the page table's int32 indices; ragged,
// [kv_tokens, Hk, D] rows (last dim contiguous, 16-byte strides: run() checks them); work:
// plan()'s list on q's device; mask: a custom mask's packed bits (plan()'s padded copy; null or
// ignored for other masks); sinks: null or empty for none; counters: two int32 zeros on it, which the launch leaves at zero; lse:
// [q_tokens, Hq] or empty.
inline PrefillSm90Args resolve_prefill_sm90(const Sm90Module& m, const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& work, const at::Tensor& page_ids,
                                            const at::Tensor* mask, const at::Tensor& counters, const at::Tensor& out,
                                            const at::Tensor& lse, const at::Tensor* sinks, double scale_log2,
                                            double soft_cap_log2, int64_t window_left, double v_scale, int64_t grid) {
  expect_cuda(q, "q");
  const int kKVDims = m.paged ? 4 : 3;
  TORCH_CHECK(q.dim() == 3 && k.dim() == kKVDims && v.dim() == kKVDims && out.dim() == 3,
              m.name, ": q and out must be [tokens, heads, head_dim], k and v ", kKVDims, "-D");
  TORCH_CHECK(q.size(2) == m.head_dim && k.size(-1) == m.head_dim && v.size(-1) == m.head_dim_vo &&
                  out.size(2) == m.head_dim_vo,
              m.name, ": expected head_dim ", m.head_dim, " for q and K, ", m.head_dim_vo, " for V and out");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1 && out.stride(2) == 1,
              m.name, ": the head_dim axis must be contiguous");
  // (the TMA maps read elements of the module's width: run() checks the dtypes themselves)
  const int64_t in_bytes = m.fp8 ? 1 : 2;
  TORCH_CHECK(q.element_size() == in_bytes && k.element_size() == in_bytes && v.element_size() == in_bytes &&
                  out.element_size() == 2,
              m.name, ": expected ", m.fp8 ? "e4m3 q, k and v" : "16-bit q, k and v", " and a 16-bit out");
  expect_aligned(q, 16, "q");
  expect_aligned(k, 16, "k");
  expect_aligned(v, 16, "v");
  PrefillSm90Args a;
  a.q = q.const_data_ptr();
  a.q_tokens = q.size(0);
  a.q_stride_n = q.stride(0);
  a.q_stride_h = q.stride(1);
  a.k = k.const_data_ptr();
  a.v = v.const_data_ptr();
  if (m.paged) {
    // (NHD: [pages, page_size, heads, D]; HND: [pages, heads, page_size, D])
    const int kTok = m.nhd ? 1 : 2, kHead = m.nhd ? 2 : 1;
    TORCH_CHECK(k.sizes().slice(0, 3) == v.sizes().slice(0, 3), "paged_kv_cache: K and V must have one shape but for "
                "head_dim");
    a.kv_tokens = k.size(0);  // pages
    a.page_size = static_cast<int32_t>(k.size(kTok));
    a.num_kv_heads = static_cast<int32_t>(k.size(kHead));
    a.k_stride_p = k.stride(0);
    a.k_stride_n = k.stride(kTok);
    a.k_stride_h = k.stride(kHead);
    a.v_stride_p = v.stride(0);
    a.v_stride_n = v.stride(kTok);
    a.v_stride_h = v.stride(kHead);
    TORCH_CHECK(page_ids.scalar_type() == at::kInt && page_ids.device() == q.device(),
                "page_ids: expected int32 on q's device");
    a.page_ids = int32_ptr(page_ids);
  } else {
    a.kv_tokens = k.size(0);
    a.k_stride_n = k.stride(0);
    a.k_stride_h = k.stride(1);
    a.v_stride_n = v.stride(0);
    a.v_stride_h = v.stride(1);
    a.num_kv_heads = static_cast<int32_t>(k.size(1));
  }
  TORCH_CHECK(a.num_kv_heads > 0 && q.size(1) % a.num_kv_heads == 0, "num_qo_heads must be a multiple of num_kv_heads");
  a.num_qo_heads = static_cast<int32_t>(q.size(1));
  a.out = out.data_ptr();
  a.out_stride_n = out.stride(0);
  a.out_stride_h = out.stride(1);
  a.lse = lse.numel() == 0 ? nullptr : static_cast<float*>(lse.data_ptr());
  if (sinks != nullptr && sinks->numel() > 0) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->numel() == q.size(1) && sinks->is_contiguous() &&
                    sinks->device() == q.device(),
                "sinks: expected float32 [num_qo_heads] on q's device, or an empty tensor");
    a.sinks = static_cast<const float*>(sinks->const_data_ptr());
  }
  a.work = int32_ptr(work);
  if (m.custom) {
    TORCH_CHECK(mask != nullptr && mask->scalar_type() == at::kByte && mask->dim() == 1 && mask->is_contiguous() &&
                    mask->device() == q.device() && mask->numel() % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(mask->const_data_ptr()) % 16 == 0,
                "mask: expected plan()'s packed custom mask (uint8, 16-byte aligned and padded) on q's device");
    a.mask = mask->const_data_ptr();
  }
  TORCH_CHECK(counters.scalar_type() == at::kInt && counters.numel() >= 2 && counters.device() == q.device(),
              "counters: expected two int32 zeros on q's device");
  a.counters = static_cast<int32_t*>(counters.data_ptr());
  a.scale_log2 = static_cast<float>(scale_log2);
  a.soft_cap_log2 = static_cast<float>(soft_cap_log2);
  TORCH_CHECK(window_left >= -1 && window_left < (int64_t(1) << 30), "window_left: expected -1 or a count of keys");
  a.window_left = static_cast<int32_t>(window_left);
  a.v_scale = static_cast<float>(v_scale);
  a.grid = static_cast<int32_t>(grid);
  return a;
}

}  // namespace fij

// Host-only helpers for the generated binding translation units: turn torch tensors into
// the plain params structs, find torch's current CUDA stream, report launch errors.
//
// Built with the host C++ compiler against torch's headers and libc10/libtorch only. It
// links no CUDA library of torch's: the stream comes through c10's device-guard
// interface, which the CUDA build of torch fills in at run time. That is what lets the
// CPU build of torch on CI compile, link and import every module.
#pragma once
#include <cstring>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/library.h>

#include <string>

#include "common/page_table_params.h"

namespace fij {

// Launchers (compiled by nvcc) return cudaError_t as int; this turns it into text.
const char* launch_error_string(int code);

inline void check_launch(int code, const char* module, const char* op) {
  TORCH_CHECK(code == 0, module, "::", op, ": CUDA error ", code, " (", launch_error_string(code), ")");
}

// torch's current stream on `device`, as a cudaStream_t.
// Copies a resolved launch (a family's *Launch struct) into `prepared`, the CPU byte tensor
// run()'s fast path keeps.
template <class Launch>
inline void record_launch(const at::Tensor& prepared, const Launch& l) {
  TORCH_CHECK(prepared.device().is_cpu() && prepared.is_contiguous() && prepared.nbytes() == sizeof(Launch),
              "prepared: expected a contiguous CPU tensor of ", sizeof(Launch), " bytes");
  std::memcpy(prepared.data_ptr(), &l, sizeof(l));
}

inline void* current_stream(const c10::Device& device) {
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return impl.getStream(device).native_handle();
}

inline const int32_t* int32_ptr(const at::Tensor& t) {
  return t.numel() == 0 ? nullptr : static_cast<const int32_t*>(t.const_data_ptr());
}

// A [tokens, heads, dim] tensor's data and its token and head strides (elements), for
// params that take rows with any strides (const data for inputs, mutable for outputs).
inline void rows_of(const at::Tensor& t, const void*& data, int64_t& stride_token, int64_t& stride_head) {
  data = t.const_data_ptr();
  stride_token = t.stride(0);
  stride_head = t.stride(1);
}
inline void rows_of(const at::Tensor& t, void*& data, int64_t& stride_token, int64_t& stride_head) {
  data = t.data_ptr();
  stride_token = t.stride(0);
  stride_head = t.stride(1);
}

// The Python side has validated shapes, dtypes and devices; these checks only guard
// against a caller going around it with torch.ops directly.
inline void expect_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
}

// Kernels that move `bytes` at a time need the start and every stride but the last (of a
// dimension longer than 1) to be multiples of it, or the access faults and takes the CUDA
// context with it. Python checks this before launch with a clearer message, except while
// torch.compile traces the wrapper (no data pointers then): this is the run-time check.
inline void expect_aligned(const at::Tensor& t, int64_t bytes, const char* name) {
  if (t.numel() == 0) return;
  const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % bytes);
  bool ok = misaligned == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    ok = ok && (t.size(d) == 1 || (t.stride(d) * t.element_size()) % bytes == 0);
  }
  TORCH_CHECK(ok, name, ": the start address and every stride but the last must be multiples of ", bytes,
              " bytes (vector accesses); got address % ", bytes, " = ", misaligned, ", strides ", t.strides(),
              " of ", t.element_size(), "-byte elements");
}

// One paged tensor laid out NHD [pages, page_size, heads, dim] or HND
// [pages, heads, page_size, dim]; a 3-D MLA cache [pages, page_size, dim] has one head.
inline PagedTensor make_paged_tensor(const at::Tensor& t, KVLayout layout) {
  TORCH_CHECK(t.dim() == 4 || t.dim() == 3, "a paged cache must be 3-D or 4-D");
  TORCH_CHECK(t.stride(-1) == 1, "the head_dim axis of a paged cache must be contiguous");
  // Kernels keep element offsets within a page in 32 bits (page x stride_page in 64).
  for (int d = 0; d < t.dim(); ++d) {
    TORCH_CHECK(t.stride(d) >= 0 && t.stride(d) <= INT32_MAX, "a paged cache's strides must lie in [0, 2^31) elements, got ",
                t.strides());
  }
  PagedTensor p;
  p.data = t.data_ptr();
  p.stride_page = t.stride(0);
  if (t.dim() == 3) {
    p.stride_token = t.stride(1);
    return p;
  }
  p.stride_token = t.stride(layout == KVLayout::kNHD ? 1 : 2);
  p.stride_head = t.stride(layout == KVLayout::kNHD ? 2 : 1);
  return p;
}

// (k_cache, v_cache) of the same shape.
inline PagedKVParams make_paged_kv(const at::Tensor& k, const at::Tensor& v, KVLayout layout) {
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, "k_cache and v_cache must be 4-D");
  const bool nhd = layout == KVLayout::kNHD;
  PagedKVParams p;
  p.k = make_paged_tensor(k, layout);
  p.v = make_paged_tensor(v, layout);
  p.num_pages = static_cast<int32_t>(k.size(0));
  p.page_size = static_cast<int32_t>(k.size(nhd ? 1 : 2));
  p.num_kv_heads = static_cast<int32_t>(k.size(nhd ? 2 : 1));
  p.head_dim = static_cast<int32_t>(k.size(3));
  return p;
}

// The page table as the Python side packs it (flashinfer_jit/runtime/page_table.py):
//   kCSR:                  [indptr, indices, last_page_len]
//   kBlockTable:           [block_tables (B, P), seq_lens]
//   kBlockTableKVSeparate: [block_tables (B, 2, P), seq_lens]
inline PageTableParams make_page_table(PageTableLayout layout, at::TensorList table,
                                       int32_t page_size) {
  PageTableParams p;
  p.page_size = page_size;
  if (layout == PageTableLayout::kCSR) {
    TORCH_CHECK(table.size() == 3, "a csr page table is [indptr, indices, last_page_len]");
    p.indptr = int32_ptr(table[0]);
    p.indices = int32_ptr(table[1]);
    p.last_page_len = int32_ptr(table[2]);
    p.batch_size = static_cast<int32_t>(table[0].numel() - 1);
  } else {
    TORCH_CHECK(table.size() == 2, "a block-table page table is [block_tables, seq_lens]");
    const at::Tensor& bt = table[0];
    p.block_tables = int32_ptr(bt);
    p.seq_lens = int32_ptr(table[1]);
    p.batch_size = static_cast<int32_t>(bt.size(0));
    p.block_stride_batch = bt.stride(0);
    if (layout == PageTableLayout::kBlockTableKVSeparate) {
      TORCH_CHECK(bt.dim() == 3 && bt.size(1) == 2, "block_tables must be [B, 2, max_pages]");
      p.block_stride_kv = bt.stride(1);
      TORCH_CHECK(bt.stride(2) == 1, "block_tables must be contiguous along max_pages");
    } else {
      TORCH_CHECK(bt.dim() == 2 && bt.stride(1) == 1, "block_tables must be [B, max_pages], row-contiguous");
    }
    p.max_pages = static_cast<int32_t>(bt.size(-1));
  }
  return p;
}

}  // namespace fij

// Plain parameter structs describing a paged KV cache and its page table.
//
// Included by both the host binding (g++, with torch) and the kernels (nvcc, without
// torch), so it holds only fixed-width integers and pointers. Python never builds these
// directly: the host binding fills them from tensors (torch_binding.h).
#pragma once
#include <cstdint>

namespace fij {

enum class KVLayout : int32_t { kNHD = 0, kHND = 1 };

// Where are request b's pages?
//   kCSR                   indptr[B+1], indices[indptr[B]], last_page_len[B]
//   kBlockTable            block_tables[B, max_pages] (+ seq_lens[B]), vLLM's form
//   kBlockTableKVSeparate  block_tables[B, 2, max_pages]: K page ids, V page ids
//                          (TensorRT-LLM with uses_shared_paged_kv_idx=False)
enum class PageTableLayout : int32_t { kCSR = 0, kBlockTable = 1, kBlockTableKVSeparate = 2 };

struct PageTableParams {
  const int32_t* indptr = nullptr;         // kCSR
  const int32_t* indices = nullptr;        // kCSR
  const int32_t* last_page_len = nullptr;  // kCSR
  const int32_t* block_tables = nullptr;   // kBlockTable*
  const int32_t* seq_lens = nullptr;       // kBlockTable* (may be null where unused)
  int64_t block_stride_batch = 0;          // elements between requests' rows
  int64_t block_stride_kv = 0;             // kBlockTableKVSeparate: K row to V row
  int32_t max_pages = 0;                   // kBlockTable*: columns of the table
  int32_t batch_size = 0;
  int32_t page_size = 0;
};

// One paged cache tensor (K, V, or an MLA ckv/kpe cache), addressed by
// (page, slot in page, head); strides in elements, the head_dim axis contiguous.
// NHD and HND differ only in which of token/head stride is the smaller.
struct PagedTensor {
  void* data = nullptr;
  int64_t stride_page = 0, stride_token = 0, stride_head = 0;
};

// K and V caches with independent strides: strided views (K and V as slices of one
// buffer, an engine's own layout) need no copy.
struct PagedKVParams {
  PagedTensor k, v;
  int32_t num_pages = 0;
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
};

}  // namespace fij

// One page-table abstraction for every family: where are token `pos` of request `b`'s
// K and V? Decode, prefill, POD, append and flatten all go through `PageTable<L>`
// and `PagedKV<T, Layout>`, so a new page-table layout is added here once.
#pragma once
#include "common.cuh"
#include "page_table_params.h"

namespace fij {

template <PageTableLayout L>
struct PageTable {
  const PageTableParams& p;

  // Pages the table holds for request b (its capacity, not its length).
  FIJ_DEVICE int num_pages(int b) const {
    if constexpr (L == PageTableLayout::kCSR) {
      return p.indptr[b + 1] - p.indptr[b];
    } else {
      return p.max_pages;
    }
  }

  // Tokens request b holds. CSR: a request without pages has length 0 (padding).
  FIJ_DEVICE int kv_len(int b) const {
    if constexpr (L == PageTableLayout::kCSR) {
      const int pages = num_pages(b);
      return pages == 0 ? 0 : (pages - 1) * p.page_size + p.last_page_len[b];
    } else {
      return p.seq_lens[b];
    }
  }

  FIJ_DEVICE int k_page(int b, int logical_page) const {
    if constexpr (L == PageTableLayout::kCSR) {
      return p.indices[p.indptr[b] + logical_page];
    } else {
      return p.block_tables[b * p.block_stride_batch + logical_page];
    }
  }

  FIJ_DEVICE int v_page(int b, int logical_page) const {
    if constexpr (L == PageTableLayout::kBlockTableKVSeparate) {
      return p.block_tables[b * p.block_stride_batch + p.block_stride_kv + logical_page];
    } else {
      return k_page(b, logical_page);
    }
  }
};

// Addressing into the K and V caches. Strides are run-time values, so strided views
// (K and V as slices of one buffer, an engine's own layout) cost nothing extra.
template <typename T, KVLayout Layout>
struct PagedKV {
  const PagedKVParams& p;

  FIJ_DEVICE bool valid_page(int page) const {
    return static_cast<unsigned>(page) < static_cast<unsigned>(p.num_pages);
  }
  FIJ_DEVICE T* k_ptr(int page, int slot, int head) const {
    return static_cast<T*>(p.k_data) + page * p.k_stride_page + slot * p.k_stride_token +
           head * p.k_stride_head;
  }
  FIJ_DEVICE T* v_ptr(int page, int slot, int head) const {
    return static_cast<T*>(p.v_data) + page * p.v_stride_page + slot * p.v_stride_token +
           head * p.v_stride_head;
  }
};

}  // namespace fij

// One page-table abstraction for every family: where are token `pos` of request `b`'s
// K and V? Decode, prefill, POD, append and flatten all go through `PageTable<L>`
// and `paged_ptr`/`locate_slot`, so a new page-table layout is added here once.
#pragma once
#include "common/common.cuh"
#include "common/page_table_params.h"

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

  // Request b's page ids, K and V: row[logical_page] (one lookup of the row per request).
  FIJ_DEVICE const int32_t* k_row(int b) const {
    if constexpr (L == PageTableLayout::kCSR) {
      return p.indices + p.indptr[b];
    } else {
      return p.block_tables + int64_t(b) * p.block_stride_batch;
    }
  }
  FIJ_DEVICE const int32_t* v_row(int b) const {
    if constexpr (L == PageTableLayout::kBlockTableKVSeparate) {
      return k_row(b) + p.block_stride_kv;
    } else {
      return k_row(b);
    }
  }
  // The same where the caller already holds a CSR row's start, csr_first = indptr[b] (prefill's
  // work items carry it): no load of indptr[b] before the row's ids; block tables ignore it.
  FIJ_DEVICE const int32_t* k_row(int b, int64_t csr_first) const {
    if constexpr (L == PageTableLayout::kCSR) {
      return p.indices + csr_first;
    } else {
      return k_row(b);
    }
  }
  FIJ_DEVICE const int32_t* v_row(int b, int64_t csr_first) const {
    if constexpr (L == PageTableLayout::kBlockTableKVSeparate) {
      return v_row(b);
    } else {
      return k_row(b, csr_first);
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

FIJ_DEVICE bool valid_page(int page, int num_pages) {
  return static_cast<unsigned>(page) < static_cast<unsigned>(num_pages);
}

// Element (page, slot, head, 0) of a paged tensor.
template <typename T>
FIJ_DEVICE T* paged_ptr(const PagedTensor& t, int page, int slot, int head) {
  return static_cast<T*>(t.data) + page * t.stride_page + slot * t.stride_token + head * t.stride_head;
}

// Where token `pos` of request `b` lives: false for anything outside the page table or
// the cache (skipped by writers rather than written out of bounds).
template <PageTableLayout L>
FIJ_DEVICE bool locate_slot(const PageTableParams& p, int num_pages, int b, int pos, int& k_page,
                            int& v_page, int& slot) {
  if (b < 0 || b >= p.batch_size || pos < 0) return false;
  PageTable<L> table{p};
  const int logical = pos / p.page_size;
  if (logical >= table.num_pages(b)) return false;
  slot = pos - logical * p.page_size;
  k_page = table.k_page(b, logical);
  v_page = table.v_page(b, logical);
  return valid_page(k_page, num_pages) && valid_page(v_page, num_pages);
}

}  // namespace fij

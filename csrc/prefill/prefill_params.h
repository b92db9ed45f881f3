// Parameters of batch prefill (csrc/prefill/prefill.cuh): one struct, filled once by the host
// binding (csrc/prefill/prefill_host.h) from tensors and plan()'s work list.
#pragma once
#include "common/merge_params.h"  // a split tile's merge, when it runs as its own kernel
#include "common/page_table_params.h"

namespace fij {

// plan() writes, in one int32 buffer copied to the device at once, the work list:
//   work[0]                          number of work items (pairs x num_kv_heads)
//   work[1 + kPrefillPairInts*j + f] field f of pair j: PrefillItem's fields but kv_head
// An item is one query tile (up to a block's rows of (token, query head of the group) pairs
// of one request, for one KV head) against one chunk of the request's keys; the items of a
// (tile, chunk) pair differ only in the KV head, so the list holds each pair once and item
// i is pair i / num_kv_heads, KV head i % num_kv_heads (load_prefill_item): an eighth of the
// bytes plan() writes and copies for 8 KV heads. POD reads the same list beside decode's.
constexpr int kPrefillPairInts = 15;
// Fields 11-14 of a pair: the page ids of its chunk's first kPrefillPairIds pages (pages
// kv_start / page_size + l, K ids of the table a run() reads), written on the device by
// plan()'s page-order launch (csrc/runtime/page_order.cuh fill_pair_ids_kernel) and -1 where it did not
// run (the host planner's value). A block loads them with the pair, by the pair's index
// alone, so its first K/V tile's copies do not wait on the work entry and then on the page
// table (one dependent round trip less an item: the paged kernels, csrc/prefill/prefill.cuh).
constexpr int kPrefillPairIdsAt = 11, kPrefillPairIds = 4;
struct PrefillItem {
  int32_t request;      // b
  int32_t kv_head;
  int32_t row0;         // first packed row of the tile: row r = token r / group, head r % group
  int32_t kv_start;     // the chunk of keys [kv_start, kv_end); kv_end is capped by kv_len
  int32_t kv_end;
  int32_t partial_row;  // -1: the item covers every key and writes out/lse; else the first
                        // partial row of the request (token t, chunk c: partial_row + t * chunks + c)
  int32_t chunks;       // chunks the request is split into (1: not split)
  int32_t chunk;        // this item's chunk (the sinks join chunk 0 only)
  // The request's extent, copied into the pair by plan() so that an item's first loads do
  // not wait on the work entry and then on the index arrays (one dependent round trip less)
  int32_t qo_start;     // qo_indptr[b]
  int32_t qo_len;
  int32_t kv_len;
  int32_t kv_first;     // ragged: kv_indptr[b] (the request's first K/V row); a CSR page table:
                        // indptr[b] (its first page id's index); block tables: 0
  int32_t first_id;     // this lane's: the page id of the chunk's page lane % kPrefillPairIds, or -1
};

struct PrefillParams {
  // q [qo_tokens, num_qo_heads, head_dim_qk], any token and head strides
  const void* q = nullptr;
  int64_t q_stride_n = 0, q_stride_h = 0;
  const int32_t* qo_indptr = nullptr;  // [B+1]
  // K/V: the paged cache through the page table (kv, table), or ragged rows
  // k/v [kv_tokens, num_kv_heads, head_dim] at kv_indptr[b] + j (k_rows / v_rows, page 0)
  PagedKVParams kv;
  PageTableParams table;
  const int32_t* kv_indptr = nullptr;
  // custom mask: bit (mask_indptr[b] * 8 + t * kv_len + j) of mask, little bit order
  const uint8_t* mask = nullptr;
  const int32_t* mask_indptr = nullptr;
  const float* sinks = nullptr;  // [num_qo_heads], natural-log logits; null: none
  const int32_t* work = nullptr;
  void* out = nullptr;  // [qo_tokens, num_qo_heads, head_dim_vo]
  int64_t out_stride_n = 0, out_stride_h = 0;
  float* lse = nullptr;  // [qo_tokens, num_qo_heads], base 2; null: not written
  // split requests: [partial rows, num_qo_heads, head_dim_vo] normalized, and their LSEs
  float* partial_o = nullptr;
  float* partial_lse = nullptr;
  // split tiles merged in the kernel: a counter per (tile, KV head) at (partial_row group +
  // row0) num_kv_heads + kv_head, zero between launches (the last of the tile's chunk items
  // resets it); null: the merge kernel merges (MergeParams)
  int32_t* merge_counters = nullptr;
  int32_t batch_size = 0;
  int32_t num_qo_heads = 0;
  int32_t group = 1;          // num_qo_heads / num_kv_heads
  uint32_t group_magic = 0xFFFFFFFFu;  // (2^32 - 1) / group: csrc/common/common.cuh divmod (packed rows -> token, head)
  uint32_t kv_head_magic = 0xFFFFFFFFu;  // (2^32 - 1) / num_kv_heads: work item -> (pair, KV head)
  float logit_scale = 1.f;    // sm_scale * q_scale * k_scale (* log2 e without soft cap; / cap with it)
  float soft_cap_log2 = 0.f;  // cap * log2 e: logits (log2 domain) = soft_cap_log2 * tanh(acc * logit_scale)
  float v_scale = 1.f;
  int32_t window_left = -1;   // keys j >= pos - window_left; -1 = all
  int32_t page_shift = -1;    // log2(page_size) for a power of two (a shift, not a division), else -1
  float rope_rcp_scale = 1.f, rope_log2_theta = 13.287712f;
};

// One prefill call, resolved: what the torch op builds from its arguments, and what run()'s
// fast path (<namespace>_prefill_fast, called through ctypes) launches again with the
// per-call pointers and scalars replaced. Valid while the plan's buffers live.
struct PrefillLaunch {
  PrefillParams params;
  MergeParams merge;  // num_rows 0: nothing split, or merged in the kernel (merge_counters)
  int32_t grid = 0;
  int32_t tile_rows = 0;
  int32_t device = 0;
};

}  // namespace fij

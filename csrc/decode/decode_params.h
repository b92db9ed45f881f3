// Parameters of batch decode (MergeParams, for a split request's merge, beside csrc/common/merge.cuh).
#pragma once
#include "common/merge_params.h"
#include "common/page_table_params.h"

namespace fij {

// plan() writes, in one int32 buffer copied to the device at once:
//   work[0]                 number of work items
//   work[1 + 4*i + 0..3]    (request, kv_start, kv_end, partial_row); partial_row -1: the
//                           item covers the whole request and writes out/lse directly
// and merge_indptr[B+1] into the partial rows of split requests (empty for the rest).
struct DecodeParams {
  const void* q = nullptr;  // [B, num_qo_heads, head_dim]
  int64_t q_stride_b = 0, q_stride_h = 0;
  PagedKVParams kv;
  PageTableParams table;
  const int32_t* work = nullptr;
  void* out = nullptr;  // [B, num_qo_heads, head_dim], q's dtype (fp8 q: the module's 16-bit output dtype)
  int64_t out_stride_b = 0, out_stride_h = 0;
  float* lse = nullptr;  // [B, num_qo_heads], base 2; null: not written
  // [rows, num_qo_heads, head_dim], normalized; float32, but bf16 elements (packed at the
  // front of the buffer) where the tensor-core kernel merges them itself and the output is bf16
  float* partial_o = nullptr;
  float* partial_lse = nullptr;  // [rows, num_qo_heads]
  int32_t num_qo_heads = 0;
  int32_t group = 1;  // num_qo_heads / num_kv_heads
  float logit_scale = 1.f;  // sm_scale * q_scale * k_scale (* log2 e without soft cap)
  float v_scale = 1.f;
  float soft_cap = 0.f;      // c: logits = c * tanh(logits / c); 0 = off
  int32_t window_left = -1;  // keys j >= kv_len - 1 - window_left; -1 = all
  float rope_rcp_scale = 1.f, rope_log2_theta = 13.287712f;
  // Split-KV merged inside the decode kernel (tensor-core kernel): the last block done with
  // a request's chunks merges their partial states. merge_counters[B * gridDim.x] start
  // at 0 and are left at 0; null: a separate merge kernel runs instead.
  int32_t* merge_counters = nullptr;
  const int32_t* merge_indptr = nullptr;  // [B+1] partial rows of each request
  // Set by the launcher: the launch is a programmatic dependent one (the tensor-core kernel
  // then prefetches small grids' K/V into L2 while the kernel before it finishes).
  int32_t dependent_launch = 0;
};

// One decode call, resolved: what the torch op builds from its arguments, and what run()'s
// fast path (<namespace>_decode_fast, called through ctypes) launches again with the
// per-call pointers replaced. Valid while the plan's buffers live.
struct DecodeLaunch {
  DecodeParams params;
  MergeParams merge;  // the separate merge kernel's; num_rows 0: none (not split, or merged in-kernel)
  int32_t grid_items = 0;
  int32_t num_kv_heads = 0;
  int32_t device = 0;
  int32_t kv_heads_per_block = 1;  // 2: the tensor-core kernel's blocks take KV-head pairs (plan()'s choice)
  int32_t cluster = 1;  // > 1: the tensor-core kernel's blocks run in clusters of this many (plan()'s choice)
  int32_t cluster_warps = 4;  // ... of blocks of this many warps: 4, or 8 (plan()'s choice)

  // A recorded launch given a later call's tensors (run()'s fast paths: decode's and both POD
  // kernels'): q, the K and V caches, the output and the LSE (null: none), in the params and in
  // the separate merge's.
  void rebind(const void* q, void* k, void* v, void* out, float* lse) {
    params.q = q;
    params.kv.k.data = k;
    params.kv.v.data = v;
    params.out = merge.out = out;
    params.lse = merge.lse = lse;
  }
};

}  // namespace fij

// append_paged_kv_cache.
//
// Append is a pure data movement: every byte of append_key/append_value is read once
// and written once into its page slot. Each thread moves 16-byte vectors; a block
// covers kTokensPerBlock tokens at once, so each thread has a K and a V load of several
// tokens in flight before its first store.
#pragma once
#include "kvcache/append_params.h"
#include "common/common.cuh"
#include "common/page_table.cuh"

namespace fij {

template <typename T, int HeadDim, KVLayout Layout, PageTableLayout Table>
struct AppendTraits {
  using DType = T;
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kVecElems = VecTraits<T>::kElems;
  static constexpr int kVecsPerHead = HeadDim / kVecElems;
  static constexpr KVLayout kLayout = Layout;
  static constexpr PageTableLayout kTable = Table;
  // 256 threads; with 8 heads x 128 dims in bf16 (128 vectors per token) a block moves
  // 2 tokens per step and each thread has 2 x 16 B of K and V loads in flight.
  static constexpr int kThreads = 256;
  // Rounds of a wide token (heads * vectors per head > 256) whose loads a thread keeps
  // in flight together; registers for more rounds would cost occupancy for every shape.
  static constexpr int kUnroll = 2;
  static_assert(HeadDim % kVecElems == 0, "head_dim must be a multiple of a 16-byte vector");
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    append_paged_kv_cache_kernel(const __grid_constant__ AppendParams p) {
  using T = typename Traits::DType;
  const int vecs_per_token = p.kv.num_kv_heads * Traits::kVecsPerHead;
  const int threads = blockDim.x;  // kThreads, or fewer for small batches (see the launcher)
  const int tokens_per_step = max(1, threads / vecs_per_token);
  // Thread -> (token of this step, first (head, vector) it moves). A token with more
  // vectors than the block has threads is covered in strides of the block.
  const int lane = threadIdx.x % vecs_per_token;
  const int sub_token = threadIdx.x / vecs_per_token;
  if (sub_token >= tokens_per_step) return;

  const T* key = static_cast<const T*>(p.append_key);
  const T* value = static_cast<const T*>(p.append_value);
  // 16-byte vector l of a token: head .x, first element .y
  auto head_col = [](int l) {
    return make_int2(l / Traits::kVecsPerHead, (l % Traits::kVecsPerHead) * Traits::kVecElems);
  };

  for (int token = blockIdx.x * tokens_per_step + sub_token; token < p.nnz;
       token += gridDim.x * tokens_per_step) {
    // Loads first: they depend only on the token, while the destination needs a chain of
    // dependent loads (batch index -> page table -> page id) that now overlaps them.
    // A token wider than kUnroll rounds of the block (beyond 8 heads x 256 dims of bf16)
    // repeats the lookup per group of rounds; it is an L1 hit by then.
    for (int base = lane; base < vecs_per_token; base += threads * Traits::kUnroll) {
      Vec16 k[Traits::kUnroll], v[Traits::kUnroll];
#pragma unroll
      for (int i = 0; i < Traits::kUnroll; ++i) {
        const int l = base + i * threads;
        if (l < vecs_per_token) {
          const int2 hc = head_col(l);
          k[i] = load_vec16_streaming(key + token * p.key_stride_token + hc.x * p.key_stride_head + hc.y);
          v[i] = load_vec16_streaming(value + token * p.value_stride_token + hc.x * p.value_stride_head + hc.y);
        }
      }
      int k_page, v_page, slot;  // padding (batch index -1) and out-of-table slots: skipped
      if (!locate_slot<Traits::kTable>(p.table, p.kv.num_pages, p.batch_indices[token],
                                       p.positions[token], k_page, v_page, slot)) {
        break;
      }
#pragma unroll
      for (int i = 0; i < Traits::kUnroll; ++i) {
        const int l = base + i * threads;
        if (l < vecs_per_token) {
          const int2 hc = head_col(l);
          store_vec16(paged_ptr<T>(p.kv.k, k_page, slot, hc.x) + hc.y, k[i]);
          store_vec16(paged_ptr<T>(p.kv.v, v_page, slot, hc.x) + hc.y, v[i]);
        }
      }
    }
  }
}

template <class Traits>
int launch_append_paged_kv_cache(const AppendParams& p, cudaStream_t stream) {
  if (p.nnz == 0) return 0;
  const int vecs_per_token = p.kv.num_kv_heads * Traits::kVecsPerHead;
  // 256 threads, halved (down to 64) while the grid would not cover every SM twice: a
  // decode step (1 token x 256 requests, 8 heads x 128 bf16) is 128 blocks of 256 but
  // 512 blocks of 64, and each block's latency chain is what the call waits for.
  int threads = Traits::kThreads;
  while (threads > 64 && ceil_div(int64_t(p.nnz) * vecs_per_token, threads) < 2 * num_sms()) threads /= 2;
  const int tokens_per_step = vecs_per_token >= threads ? 1 : threads / vecs_per_token;
  // Enough blocks to fill every SM several times over; the grid-stride loop covers the rest.
  const int64_t wanted = ceil_div(p.nnz, tokens_per_step);
  const int64_t cap = int64_t(num_sms()) * 16 * (Traits::kThreads / threads);
  const int blocks = static_cast<int>(wanted < cap ? wanted : cap);
  append_paged_kv_cache_kernel<Traits><<<blocks, threads, 0, stream>>>(p);
  return last_launch_error();
}

}  // namespace fij

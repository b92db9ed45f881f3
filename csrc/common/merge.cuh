// Merging partial attention states by their base-2 LSEs, the one rule every merge follows:
// split-KV's second step (decode's and prefill's, in the kernel by the last block of a
// split, or as merge_splits_kernel), the merge of the warps that split a decode tile, and
// FlashInfer's merge_state / merge_states (merge_states_kernel).
//   m = max_i lse_i,  w_i = 2^(lse_i - m),  o = sum_i w_i o_i / sum_i w_i,
//   lse = m + log2(sum_i w_i).
// States with lse = -inf (no key) weigh nothing; if every state is empty, o = 0 and
// lse = -inf (no NaN: no weight is taken against m = -inf). The order of the sums is fixed
// (state index), so results are deterministic. States kept as (m, d) rather than an LSE
// (online softmax, softmax.cuh) merge by the same rule with lse_i = m_i + log2(d_i): the
// weight of state i is 2^(m_i - m) d_i, and m_i is never -inf there.
// Where the states live (registers, shared memory, L2) and how many threads share a row
// differ between callers; these functions are the arithmetic they share.
#pragma once
#include <math_constants.h>

#include "common/common.cuh"
#include "common/merge_params.h"

namespace fij {

template <typename TOut>
FIJ_DEVICE void store4(TOut* dst, float a, float b, float c, float d) {
  if constexpr (std::is_same_v<TOut, float>) {
    *reinterpret_cast<float4*>(dst) = make_float4(a, b, c, d);
  } else {
    dst[0] = static_cast<TOut>(a);
    dst[1] = static_cast<TOut>(b);
    dst[2] = static_cast<TOut>(c);
    dst[3] = static_cast<TOut>(d);
  }
}

// The weight of a state of LSE lse against the states' max LSE (0 when every state is empty).
FIJ_DEVICE float merge_weight(float lse, float max_lse) {
  return max_lse == -CUDART_INF_F ? 0.f : exp2f(lse - max_lse);
}
// The merged state, from the max LSE and the sum of the weights: norm, the factor the
// weighted sum of outputs is multiplied by (scale / the sum), and lse = max + log2(sum);
// when every state was empty (the sum is 0), norm 0 (the output is zeros) and lse -inf.
struct Merged {
  float norm, lse;
};
FIJ_DEVICE Merged merged(float max_lse, float weight_sum, float scale = 1.f) {
  const bool empty = weight_sum == 0.f;
  return {empty ? 0.f : scale / weight_sum, empty ? -CUDART_INF_F : max_lse + log2f(weight_sum)};
}
// The LSE alone, for a caller that writes it under a branch of its own (log2 only there).
FIJ_DEVICE float merged_lse(float max_lse, float weight_sum) {
  return weight_sum == 0.f ? -CUDART_INF_F : max_lse + log2f(weight_sum);
}
// acc += w u, four dims.
FIJ_DEVICE void add_weighted4(float4& acc, float w, const float4& u) {
  acc.x += w * u.x;
  acc.y += w * u.y;
  acc.z += w * u.z;
  acc.w += w * u.w;
}

// Split-KV merged inside the attention kernel: each block of a split request (or tile)
// counts itself done, and the last one merges the partial states. The split's counter
// (int32, zero before the launch) counts its `parts` blocks; the last one resets it to zero
// for the next launch. Every thread of the block calls this; `leader` is one thread, which
// alone calls counter() -> SplitCounter, after the barrier (the loads behind it stay off
// the other threads' path); `flag` is a word of shared memory. The block barrier puts every
// thread's partial-state stores before the leader's release; the last block's acquire,
// then its barrier, puts the other blocks' states before its loads, which bypass L1
// (ld.cg). (Fences around a relaxed atomicAdd were slower: docs/history/decode.md.)
struct SplitCounter {
  int* counter;
  int parts;
};
// (sync: the block's barrier; a virtual block's is a named one: WarpgroupLaunch::sync.)
template <class CounterFn, class SyncFn>
FIJ_DEVICE bool last_of_split(bool leader, int& flag, CounterFn counter, SyncFn sync) {
  sync();
  if (leader) {
    const SplitCounter c = counter();
    flag = atomic_add_acq_rel(c.counter, 1) == c.parts - 1;
    if (flag) *c.counter = 0;
  }
  sync();
  return flag;
}
template <class CounterFn>
FIJ_DEVICE bool last_of_split(bool leader, int& flag, CounterFn counter) {
  return last_of_split(leader, flag, counter, [] { __syncthreads(); });
}

// One block per (row, head); a thread per 4 dims. `state(i)` gives state i's (o ptr, lse).
template <typename TIn, typename TOut, typename StateFn>
FIJ_DEVICE void merge_row(int num_states, StateFn state, TOut* out, float* lse_out, int head_dim) {
  float m = -CUDART_INF_F;
  for (int i = 0; i < num_states; ++i) m = fmaxf(m, state(i).second);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float denom = 0.f;
  if (m != -CUDART_INF_F) {  // every state empty: nothing read (an empty state's o may be anything)
    for (int i = 0; i < num_states; ++i) {
      const auto st = state(i);
      const float w = exp2f(st.second - m);
      denom += w;
      const TIn* o = st.first + threadIdx.x * 4;
      add_weighted4(acc, w, make_float4(static_cast<float>(o[0]), static_cast<float>(o[1]),
                                        static_cast<float>(o[2]), static_cast<float>(o[3])));
    }
  }
  const Merged r = merged(m, denom);
  if (threadIdx.x * 4 < head_dim)
    store4(out + threadIdx.x * 4, acc.x * r.norm, acc.y * r.norm, acc.z * r.norm, acc.w * r.norm);
  if (lse_out != nullptr && threadIdx.x == 0) *lse_out = r.lse;
}

template <typename TOut>
__global__ void merge_splits_kernel(const __grid_constant__ MergeParams p) {
  const int row = blockIdx.x, head = blockIdx.y;
  if (row >= p.num_rows) return;
  pdl_wait();  // the partial states come from the decode kernel before
  const int begin = p.merge_indptr[row], count = p.merge_indptr[row + 1] - begin;
  if (count <= 0) return;  // not split: the decode kernel wrote this row itself
  auto state = [&](int i) {
    const int64_t r = int64_t(begin + i) * p.num_heads + head;
    return std::pair<const float*, float>(p.partial_o + r * p.head_dim, p.partial_lse[r]);
  };
  merge_row<float>(count, state, static_cast<TOut*>(p.out) + row * p.out_stride_b + head * p.out_stride_h,
                   p.lse != nullptr ? p.lse + row * p.num_heads + head : nullptr, p.head_dim);
}

template <typename T>
__global__ void merge_states_kernel(const __grid_constant__ MergeParams p) {
  const int row = blockIdx.x, head = blockIdx.y;
  auto state = [&](int i) {
    const T* o = static_cast<const T*>(p.states) + row * p.states_stride_n + i * p.states_stride_s +
                 head * p.states_stride_h;
    return std::pair<const T*, float>(o, p.states_lse[row * p.lse_stride_n + i * p.lse_stride_s + head]);
  };
  merge_row<T>(p.num_states, state, static_cast<T*>(p.out) + row * p.out_stride_b + head * p.out_stride_h,
               p.lse + row * p.num_heads + head, p.head_dim);
}

template <typename TOut>
int launch_merge_splits(const MergeParams& p, cudaStream_t stream, bool pdl) {
  if (p.num_rows <= 0) return 0;
  return launch_kernel(merge_splits_kernel<TOut>, dim3(p.num_rows, p.num_heads), dim3(p.head_dim / 4), 0, stream, pdl,
                       p);
}

template <typename T>
int launch_merge_states(const MergeParams& p, cudaStream_t stream) {
  if (p.num_rows <= 0) return 0;
  merge_states_kernel<T><<<dim3(p.num_rows, p.num_heads), p.head_dim / 4, 0, stream>>>(p);
  return last_launch_error();
}

}  // namespace fij

// Merging partial attention states by their base-2 LSEs: the second step of split-KV
// (merge_splits) and FlashInfer's merge_state / merge_states (merge_states).
//   m = max_i lse_i,  w_i = 2^(lse_i - m),  o = sum_i w_i o_i / sum_i w_i,
//   lse = m + log2(sum_i w_i).
// States with lse = -inf weigh nothing; all -inf: o = 0, lse = -inf (no NaN). The order
// of the sum is fixed (state index), so results are deterministic.
#pragma once
#include <math_constants.h>

#include "common/common.cuh"
#include "decode/decode_params.h"

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

// One block per (row, head); a thread per 4 dims. `state(i)` gives state i's (o ptr, lse).
template <typename TIn, typename TOut, typename StateFn>
FIJ_DEVICE void merge_row(int num_states, StateFn state, TOut* out, float* lse_out, int head_dim) {
  float m = -CUDART_INF_F;
  for (int i = 0; i < num_states; ++i) m = fmaxf(m, state(i).second);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float denom = 0.f;
  if (m != -CUDART_INF_F) {
    for (int i = 0; i < num_states; ++i) {
      const auto st = state(i);
      const float w = exp2f(st.second - m);
      denom += w;
      const TIn* o = st.first + threadIdx.x * 4;
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] += w * static_cast<float>(o[e]);
    }
  }
  const float norm = denom > 0.f ? 1.f / denom : 0.f;
  if (threadIdx.x * 4 < head_dim) {
    store4(out + threadIdx.x * 4, acc[0] * norm, acc[1] * norm, acc[2] * norm, acc[3] * norm);
  }
  if (lse_out != nullptr && threadIdx.x == 0) *lse_out = denom > 0.f ? m + log2f(denom) : -CUDART_INF_F;
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

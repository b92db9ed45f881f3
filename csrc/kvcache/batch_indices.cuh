// get_batch_indices_positions: which request and position each appended token has.
#pragma once
#include "kvcache/append_params.h"
#include "common/common.cuh"

namespace fij {

// Token t of the flattened append belongs to the request b with
// append_indptr[b] <= t < append_indptr[b+1]; its position is
// seq_lens[b] - append_len(b) + (t - append_indptr[b]). Tokens at or past
// append_indptr[batch_size] are padding: batch index -1, position 0.
__global__ void get_batch_indices_positions_kernel(const __grid_constant__ BatchIndicesParams p) {
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < p.nnz; t += gridDim.x * blockDim.x) {
    if (t >= p.append_indptr[p.batch_size]) {
      p.batch_indices[t] = -1;
      p.positions[t] = 0;
      continue;
    }
    int lo = 0, hi = p.batch_size;  // last b with append_indptr[b] <= t
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (p.append_indptr[mid] <= t) lo = mid; else hi = mid;
    }
    const int append_len = p.append_indptr[lo + 1] - p.append_indptr[lo];
    p.batch_indices[t] = lo;
    p.positions[t] = p.seq_lens[lo] - append_len + (t - p.append_indptr[lo]);
  }
}

inline int launch_get_batch_indices_positions(const BatchIndicesParams& p, cudaStream_t stream) {
  if (p.nnz == 0) return 0;
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(ceil_div(p.nnz, kThreads) < 4096 ? ceil_div(p.nnz, kThreads) : 4096);
  get_batch_indices_positions_kernel<<<blocks, kThreads, 0, stream>>>(p);
  return last_launch_error();
}

}  // namespace fij

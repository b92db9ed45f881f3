// Each request's full pages in ascending page-id order, for batch decode's plan().
//
// Why: a decode kernel streams each request's pages in page-table order, and the H100
// streams pages in ascending address order faster than in a random one (session 26,
// docs/performance.md: bf16 b=1 kv=32k 49.5 -> 48.1 us, b=16 kv=2k 49.7 -> 48.4 on the same
// pages; shuffled 2 MB windows gained nothing, so it is not the TLB). Attention with no
// position-dependent term (no RoPE in the kernel, no window) is the same over any order of
// whole pages: only the last page, which may be partial, must stay last. plan() writes the
// reordered table once; every run() (every layer) reads it.
//
// One block per (request, segment of kSegment pages), a thread per page: a bitonic sort of
// (K page id, V page id) pairs packed in 64 bits (V 0 where one id serves both), exchanged
// through shuffles within a warp and through shared memory across warps (15 of a 1024-page
// sort's 55 steps). A request longer than one segment is sorted a segment at a time:
// ascending runs of kSegment pages (16k tokens at page 16) stream as well (runs of 64 pages
// shuffled: 48.4 us at kv=32k).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace fij {

// The ctypes mirror is decode.py's _PageOrderParams: same fields, same order.
struct PageOrderParams {
  const int32_t* indptr;    // csr: [batch + 1] offsets into the ids (src and dst alike); null: block tables
  const int32_t* seq_lens;  // block tables: [batch] tokens per request
  const int32_t* src;       // the page ids as given
  int32_t* dst;             // the reordered ids, laid out as dst_row / dst_v say
  int64_t src_row, dst_row; // block tables: elements from one request's row to the next
  int64_t src_v, dst_v;     // [batch, 2, max_pages] tables: elements from K ids to V ids; 0: one id a page
  int64_t row_pages;        // block tables: pages a row holds (longer seq_lens are clamped to it)
  int64_t longest_pages;    // the most pages of any request (sets the grid's segments)
  int32_t page_size;
  int32_t batch;
  int32_t sort;             // 0: copy only (a CUDA-graph wrapper's buffer, for a plan that may not reorder)
};

namespace page_order {

constexpr int kSegment = 1024;  // pages sorted together: one a thread of a 1024-thread block

// (first id of the request in src, in dst, its pages)
struct Request {
  int64_t src, dst, pages;
};

__device__ __forceinline__ Request request_of(const PageOrderParams& p, int r) {
  if (p.indptr != nullptr) {
    const int64_t begin = p.indptr[r];
    return {begin, begin, p.indptr[r + 1] - begin};
  }
  const int64_t len = p.seq_lens[r];
  const int64_t pages = len > 0 ? min((len + p.page_size - 1) / p.page_size, p.row_pages) : 0;
  return {r * p.src_row, r * p.dst_row, pages};
}

__device__ __forceinline__ unsigned long long load_key(const PageOrderParams& p, int64_t at) {
  const unsigned long long k = static_cast<uint32_t>(p.src[at]);
  const unsigned long long v = p.src_v ? static_cast<uint32_t>(p.src[at + p.src_v]) : 0u;
  return (k << 32) | v;
}

__device__ __forceinline__ void store_key(const PageOrderParams& p, int64_t at, unsigned long long key) {
  p.dst[at] = static_cast<int32_t>(key >> 32);
  if (p.src_v) p.dst[at + p.dst_v] = static_cast<int32_t>(key & 0xffffffffull);
}

// Thread t's key after an ascending bitonic sort of the block's keys (blockDim.x, a power
// of two; every thread calls it). Element t meets t ^ stride: within a warp by a shuffle,
// else through one of two shared buffers in turn (one barrier a step: a buffer is written
// again only two steps later, after the barrier between).
__device__ __forceinline__ unsigned long long bitonic_sort(unsigned long long key, unsigned long long* buf) {
  const unsigned t = threadIdx.x, width = blockDim.x;
  int turn = 0;
  for (unsigned size = 2; size <= width; size <<= 1) {
    for (unsigned stride = size >> 1; stride > 0; stride >>= 1) {
      unsigned long long other;
      if (stride >= 32) {
        unsigned long long* b = buf + turn * kSegment;
        turn ^= 1;
        b[t] = key;
        __syncthreads();
        other = b[t ^ stride];
      } else {
        other = __shfl_xor_sync(0xffffffffu, key, stride);
      }
      const bool keep_min = ((t & stride) == 0) == ((t & size) == 0);
      key = keep_min ? min(key, other) : max(key, other);
    }
  }
  return key;
}

__global__ void __launch_bounds__(kSegment) order_pages_kernel(const PageOrderParams p) {
  __shared__ unsigned long long buf[2 * kSegment];
  const Request req = request_of(p, blockIdx.x);
  if (req.pages <= 0) return;  // (whole block: no barrier is skipped by some threads only)
  const int64_t full = req.pages - 1;  // the last page stays last: it may be partial
  if (blockIdx.y == 0 && threadIdx.x == 0) store_key(p, req.dst + full, load_key(p, req.src + full));
  const int64_t lo = int64_t(blockIdx.y) * blockDim.x;
  if (lo >= full) return;
  const int64_t n = full - lo;  // pages of this segment: threadIdx.x < n (at most blockDim.x)
  const int t = threadIdx.x;
  if (!p.sort) {
    if (t < n) store_key(p, req.dst + lo + t, load_key(p, req.src + lo + t));
    return;
  }
  const unsigned long long key = bitonic_sort(t < n ? load_key(p, req.src + lo + t) : ~0ull, buf);
  if (t < n) store_key(p, req.dst + lo + t, key);
}

}  // namespace page_order

inline cudaError_t launch_order_pages(const PageOrderParams& p, cudaStream_t stream) {
  if (p.batch <= 0) return cudaSuccess;
  // a thread per page of the longest request's full pages, up to a segment (32 at least)
  const int64_t full = p.longest_pages > 1 ? p.longest_pages - 1 : 1;
  int threads = 32;
  while (threads < full && threads < page_order::kSegment) threads <<= 1;
  const int64_t segments = (full + threads - 1) / threads;
  if (segments > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(segments));
  page_order::order_pages_kernel<<<grid, threads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fij

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
// One block per (request, segment of kSegment pages): a bitonic sort in shared memory of
// (K page id, V page id) pairs packed in 64 bits (V 0 where one id serves both). A request
// longer than one segment is sorted a segment at a time: ascending runs of kSegment pages
// (16k tokens at page 16) stream as well (runs of 64 pages shuffled: 48.4 us at kv=32k).
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

constexpr int kSegment = 1024;  // pages sorted together: 8 KB of 64-bit keys
constexpr int kThreads = 256;

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

// Ascending bitonic sort of keys[0, width), width a power of two; every thread calls it.
__device__ __forceinline__ void bitonic_sort(unsigned long long* keys, int width) {
  for (int size = 2; size <= width; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < width / 2; t += kThreads) {
        const int i = 2 * t - (t & (stride - 1));  // the lower element of pair t
        const unsigned long long a = keys[i], b = keys[i + stride];
        if ((a > b) == ((i & size) == 0)) keys[i] = b, keys[i + stride] = a;
      }
      __syncthreads();
    }
  }
}

__global__ void __launch_bounds__(kThreads) order_pages_kernel(const PageOrderParams p) {
  __shared__ unsigned long long keys[kSegment];
  const Request req = request_of(p, blockIdx.x);
  if (req.pages <= 0) return;
  const int64_t full = req.pages - 1;  // the last page stays last: it may be partial
  if (blockIdx.y == 0 && threadIdx.x == 0) store_key(p, req.dst + full, load_key(p, req.src + full));
  const int64_t lo = int64_t(blockIdx.y) * kSegment;
  if (lo >= full) return;
  const int n = full - lo < kSegment ? static_cast<int>(full - lo) : kSegment;
  if (!p.sort) {
    for (int i = threadIdx.x; i < n; i += kThreads) store_key(p, req.dst + lo + i, load_key(p, req.src + lo + i));
    return;
  }
  int width = 2;
  while (width < n) width <<= 1;
  for (int i = threadIdx.x; i < width; i += kThreads) keys[i] = i < n ? load_key(p, req.src + lo + i) : ~0ull;
  __syncthreads();
  bitonic_sort(keys, width);
  for (int i = threadIdx.x; i < n; i += kThreads) store_key(p, req.dst + lo + i, keys[i]);
}

}  // namespace page_order

inline cudaError_t launch_order_pages(const PageOrderParams& p, cudaStream_t stream) {
  if (p.batch <= 0) return cudaSuccess;
  const int64_t segments = (p.longest_pages - 1 + page_order::kSegment - 1) / page_order::kSegment;
  if (segments > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(segments > 1 ? segments : 1));
  page_order::order_pages_kernel<<<grid, page_order::kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fij

// Each request's movable pages in ascending page-id order, for the plan() of batch decode and
// batch prefill (flashinfer_jit/runtime/page_order.py).
//
// Why: a kernel streams each request's pages in page-table order, and the H100 streams
// pages faster in ascending address order than in a random one (about 3% at b=1 kv=32k;
// docs/decode.md). Attention with no position-dependent term (no RoPE in the kernel, no
// window, no custom mask) is the same over any order of the pages every query row sees
// whole: decode's full pages (the last, which may be partial, stays last), and for a causal
// prefill the pages below the first query row's diagonal (key j <= kv_len - qo_len: every
// row sees it); the pages after them stay where they are. plan() writes the reordered table
// once; every run() (every layer) reads it.
//
// One block per (request, segment of up to kSegment pages): a bitonic sort of the page ids
// (32-bit keys), or of (K id, V id) pairs packed in 64 bits where K and V pages are apart.
// Each of the block's W threads holds K keys, elements t, t + W, ..: they meet their
// partners in registers (strides >= W), through shuffles (< 32) or through shared memory.
// The launch takes the fewest keys a thread that cover the longest request with W <= 1024
// threads (more threads a step beat fewer steps a thread), and sorts a longer request a
// segment at a time; one segment covers 64k tokens at page 16, and a request sorted whole
// reads faster than one sorted in pieces.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>


namespace fij {

// The ctypes mirror is flashinfer_jit/runtime/page_order.py PageOrderParams: same fields, same order.
struct PageOrderParams {
  const int32_t* indptr;    // csr: [batch + 1] offsets into the ids (src and dst alike); null: block tables
  const int32_t* seq_lens;  // block tables: [batch] tokens per request
  const int32_t* src;       // the page ids as given
  int32_t* dst;             // the reordered ids, laid out as dst_row / dst_v say
  int64_t src_row, dst_row; // block tables: elements from one request's row to the next
  int64_t src_v, dst_v;     // [batch, 2, max_pages] tables: elements from K ids to V ids; 0: one id a page
  int64_t row_pages;        // block tables: pages a row holds (longer seq_lens are clamped to it)
  int64_t longest_pages;    // the most pages of any request (sets the grid's segments)
  const int32_t* qo_indptr;      // causal prefill: [batch + 1] query offsets; null: every full page moves
  const int32_t* last_page_len;  // csr with qo_indptr: [batch] tokens of each request's last page
  int32_t page_size;
  int32_t batch;
  int32_t sort;             // 0: copy only (a CUDA-graph wrapper's buffer, for a plan that may not reorder)
  // batch prefill: plan()'s work pairs (csrc/prefill/prefill_params.h: pair_ints ints each,
  // field 2 the chunk's first key), whose fields pair_ids_at.. get the page ids of their
  // chunk's first pair_ids pages from the table written here (fill_pair_ids_kernel); null:
  // none (decode). Tables of separate K and V ids skip it (src_v != 0): their pairs keep -1,
  // and the kernels load both. The layout is the caller's (the runtime knows no family's).
  int32_t* pairs;
  int32_t num_pairs;
  int32_t pair_ints, pair_ids_at, pair_ids;
};

namespace page_order {

constexpr int kMaxKeys = 4;  // keys a thread
constexpr int kMaxThreads = 1024;
constexpr int kSegment = kMaxKeys * kMaxThreads;  // pages sorted together (64k tokens at page 16)

// (first id of the request in src, in dst, its pages, the pages that may move: [0, movable))
struct Request {
  int64_t src, dst, pages, movable;
};

__device__ __forceinline__ Request request_of(const PageOrderParams& p, int r) {
  Request q;
  int64_t len;  // tokens (read only for a causal prefill's limit)
  if (p.indptr != nullptr) {
    const int64_t begin = p.indptr[r];
    q = {begin, begin, p.indptr[r + 1] - begin, 0};
    len = q.pages > 0 ? (q.pages - 1) * p.page_size + (p.last_page_len != nullptr ? p.last_page_len[r] : 0) : 0;
  } else {
    len = p.seq_lens[r];
    const int64_t pages = len > 0 ? min((len + p.page_size - 1) / p.page_size, p.row_pages) : 0;
    q = {r * p.src_row, r * p.dst_row, pages, 0};
  }
  q.movable = q.pages - 1;  // the last page stays last: it may be partial
  if (p.qo_indptr != nullptr) {
    // causal: the pages of keys j <= len - qo_len, which every query row sees
    const int64_t seen = len - (p.qo_indptr[r + 1] - p.qo_indptr[r]) + 1;
    q.movable = min(q.movable, seen > 0 ? seen / p.page_size : 0);
  }
  if (q.movable < 0) q.movable = 0;
  return q;
}

// Key: uint32_t (the page id, K and V alike) or unsigned long long (K id << 32 | V id).
template <typename Key>
__device__ __forceinline__ Key load_key(const PageOrderParams& p, int64_t at) {
  if constexpr (sizeof(Key) == 4) {
    return static_cast<uint32_t>(p.src[at]);
  } else {
    return (static_cast<Key>(static_cast<uint32_t>(p.src[at])) << 32) | static_cast<uint32_t>(p.src[at + p.src_v]);
  }
}

template <typename Key>
__device__ __forceinline__ void store_key(const PageOrderParams& p, int64_t at, Key key) {
  if constexpr (sizeof(Key) == 4) {
    p.dst[at] = static_cast<int32_t>(key);
  } else {
    p.dst[at] = static_cast<int32_t>(key >> 32);
    p.dst[at + p.dst_v] = static_cast<int32_t>(key & 0xffffffffull);
  }
}

// Elements i < j in one thread's registers: the smaller at i where ascending.
template <typename Key>
__device__ __forceinline__ void order_pair(Key& a, Key& b, bool ascending) {
  const Key lo = min(a, b), hi = max(a, b);
  a = ascending ? lo : hi;
  b = ascending ? hi : lo;
}

// Ascending bitonic sort of the block's K x W keys, element r W + t in key[r] of thread t
// (W = blockDim.x, a power of two >= 32; every thread calls it).
template <typename Key, int K>
__device__ __forceinline__ void bitonic_sort(Key (&key)[K], Key* buf) {
  const unsigned t = threadIdx.x, W = blockDim.x, width = K * W;
  for (unsigned size = 2; size <= width; size <<= 1) {
    for (unsigned stride = size >> 1; stride > 0; stride >>= 1) {
      if (stride >= W) {  // partners in this thread: registers r and r + stride / W
        if constexpr (K >= 2) {
          if (stride == W) {
#pragma unroll
            for (int r = 0; r < K; r += 2) order_pair(key[r], key[r + 1], ((t + r * W) & size) == 0);
          }
        }
        if constexpr (K >= 4) {
          if (stride == 2 * W) {
#pragma unroll
            for (int r = 0; r < 2; ++r) order_pair(key[r], key[r + 2], ((t + r * W) & size) == 0);
          }
        }
        continue;
      }
      Key other[K];
      if (stride >= 32) {
        __syncthreads();  // the last step's reads are done
#pragma unroll
        for (int r = 0; r < K; ++r) buf[r * W + t] = key[r];
        __syncthreads();
#pragma unroll
        for (int r = 0; r < K; ++r) other[r] = buf[r * W + (t ^ stride)];
      } else {
#pragma unroll
        for (int r = 0; r < K; ++r) other[r] = __shfl_xor_sync(0xffffffffu, key[r], stride);
      }
#pragma unroll
      for (int r = 0; r < K; ++r) {
        const bool keep_min = ((t & stride) == 0) == (((t + r * W) & size) == 0);
        key[r] = keep_min ? min(key[r], other[r]) : max(key[r], other[r]);
      }
    }
  }
}

// One block's part of a sort: request `r`'s segment blockIdx.y (the block returns whole
// where there is nothing to do: no barrier is left waiting).
template <typename Key, int K>
__device__ __forceinline__ void order_request(const PageOrderParams& p, int request, Key* buf) {
  const Request req = request_of(p, request);
  if (req.pages <= 0) return;
  const int64_t full = req.movable;  // pages [full, pages) stay where they are
  const int W = blockDim.x;
  if (blockIdx.y == 0)
    for (int64_t j = full + threadIdx.x; j < req.pages; j += W) store_key<Key>(p, req.dst + j, load_key<Key>(p, req.src + j));
  const int64_t lo = int64_t(blockIdx.y) * K * W;
  if (lo >= full) return;
  const int64_t n = full - lo;  // pages of this segment: element j < n (at most K W)
  const int t = threadIdx.x;
  if (!p.sort) {
#pragma unroll
    for (int r = 0; r < K; ++r)
      if (r * W + t < n) store_key<Key>(p, req.dst + lo + r * W + t, load_key<Key>(p, req.src + lo + r * W + t));
    return;
  }
  Key key[K];
#pragma unroll
  for (int r = 0; r < K; ++r) key[r] = r * W + t < n ? load_key<Key>(p, req.src + lo + r * W + t) : ~Key(0);
  bitonic_sort<Key, K>(key, buf);
#pragma unroll
  for (int r = 0; r < K; ++r)
    if (r * W + t < n) store_key<Key>(p, req.dst + lo + r * W + t, key[r]);
}

template <typename Key, int K>
__global__ void __launch_bounds__(kMaxThreads) order_pages_kernel(const PageOrderParams p) {
  __shared__ Key buf[K * kMaxThreads];
  order_request<Key, K>(p, blockIdx.x, buf);
}

// Two tables in one launch (POD's plan(): its decode side's and its prefill side's): blocks
// [0, first.batch) sort the first's requests, the rest the second's.
struct PageOrderPair {
  PageOrderParams first, second;
};

template <typename Key, int K>
__global__ void __launch_bounds__(kMaxThreads) order_pages_pair_kernel(const PageOrderPair pp) {
  __shared__ Key buf[K * kMaxThreads];
  const int r = static_cast<int>(blockIdx.x);
  if (r < pp.first.batch) order_request<Key, K>(pp.first, r, buf);
  else order_request<Key, K>(pp.second, r - pp.first.batch, buf);
}

// Thread i: page i % pair_ids of pair i / pair_ids's chunk (-1 past the request's pages),
// read from the table the sort wrote (launched after it, on the same stream).
__global__ void __launch_bounds__(256) fill_pair_ids_kernel(const PageOrderParams p) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t pair = i / p.pair_ids;
  if (pair >= p.num_pairs) return;
  const int l = static_cast<int>(i % p.pair_ids);
  int32_t* w = p.pairs + pair * p.pair_ints;
  const Request req = request_of(p, w[0]);
  const int64_t page = w[2] / p.page_size + l;  // (w[2]: the chunk's first key)
  w[p.pair_ids_at + l] = page < req.pages ? p.dst[req.dst + page] : -1;
}

template <typename Key, typename Params>
inline void launch(const Params& p, int keys, dim3 grid, int threads, cudaStream_t stream) {
  if constexpr (std::is_same_v<Params, PageOrderParams>) {
    if (keys == 1) order_pages_kernel<Key, 1><<<grid, threads, 0, stream>>>(p);
    else if (keys == 2) order_pages_kernel<Key, 2><<<grid, threads, 0, stream>>>(p);
    else order_pages_kernel<Key, 4><<<grid, threads, 0, stream>>>(p);
  } else {
    if (keys == 1) order_pages_pair_kernel<Key, 1><<<grid, threads, 0, stream>>>(p);
    else if (keys == 2) order_pages_pair_kernel<Key, 2><<<grid, threads, 0, stream>>>(p);
    else order_pages_pair_kernel<Key, 4><<<grid, threads, 0, stream>>>(p);
  }
}

// The shape of a sort of requests of up to `longest_pages` pages: the full pages over up to
// 1024 threads of 1, 2 or 4 keys (32 threads at least), segments of keys x threads pages.
struct SortShape {
  int keys, threads;
  int64_t segments;
};

inline SortShape sort_shape(int64_t longest_pages) {
  const int64_t full = longest_pages > 1 ? longest_pages - 1 : 1;
  SortShape s;
  s.keys = full <= kMaxThreads ? 1 : full <= 2 * kMaxThreads ? 2 : kMaxKeys;
  s.threads = 32;
  while (int64_t(s.keys) * s.threads < full && s.threads < kMaxThreads) s.threads <<= 1;
  const int64_t per_block = int64_t(s.keys) * s.threads;
  s.segments = (full + per_block - 1) / per_block;
  return s;
}

inline void fill_pairs(const PageOrderParams& p, cudaStream_t stream) {
  if (p.src_v == 0 && p.pairs != nullptr && p.num_pairs > 0 && p.pair_ids > 0) {
    const int64_t n = int64_t(p.num_pairs) * p.pair_ids;
    fill_pair_ids_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(p);
  }
}

}  // namespace page_order

inline cudaError_t launch_order_pages(const PageOrderParams& p, cudaStream_t stream) {
  if (p.batch <= 0) return cudaSuccess;
  const page_order::SortShape s = page_order::sort_shape(p.longest_pages);
  if (s.segments > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(s.segments));
  if (p.src_v) {
    page_order::launch<unsigned long long>(p, s.keys, grid, s.threads, stream);
  } else {
    page_order::launch<uint32_t>(p, s.keys, grid, s.threads, stream);
    page_order::fill_pairs(p, stream);
  }
  return cudaGetLastError();
}

// Two tables (one kernel where both hold one id a page; else one launch each): the sort's
// shape is the longer's, which sorts the shorter's requests as well (more keys a block
// than they need, padded).
inline cudaError_t launch_order_pages_pair(const PageOrderParams& a, const PageOrderParams& b, cudaStream_t stream) {
  if (a.batch <= 0 || b.batch <= 0 || a.src_v || b.src_v) {
    const cudaError_t err = launch_order_pages(a, stream);
    return err != cudaSuccess ? err : launch_order_pages(b, stream);
  }
  const page_order::SortShape s = page_order::sort_shape(a.longest_pages > b.longest_pages ? a.longest_pages
                                                                                          : b.longest_pages);
  if (s.segments > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(a.batch + b.batch), static_cast<unsigned>(s.segments));
  page_order::launch<uint32_t>(page_order::PageOrderPair{a, b}, s.keys, grid, s.threads, stream);
  page_order::fill_pairs(a, stream);
  page_order::fill_pairs(b, stream);
  return cudaGetLastError();
}

}  // namespace fij

// plan() of batch decode on the host, in C++: the page table's lengths, the split, the
// work list and the packed plan buffer in one call (flashinfer_jit/decode/wrapper.py calls it
// through ctypes for eager wrappers; the numpy functions there are the reference it is
// tested against, and the path for CUDA-graph wrappers, host page ids and bad input).
// Plain C++ (no CUDA, no torch): ~25 numpy calls of ~1 us each became one call.
#pragma once
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace fij {

// What plan() derives from its scalar arguments (decode.py _Config), fixed per wrapper
// configuration. The ctypes mirror is decode.py's _NativeConfig: same fields, same order.
struct DecodePlanConfig {
  int32_t page_size;
  int32_t blocks_per_item;  // one-head blocks per work item
  int32_t target;           // split target in blocks
  int32_t pairs;            // the module has the paired kernel (blocks of two KV heads)
  int32_t sms;
  int32_t cluster;          // blocks per cluster of the cluster split; 1: none
  int32_t fixed_split_size; // 0: none
  int32_t disable_split_kv;
  int32_t min_chunk;
  int32_t max_chunks;       // 0: none
  int32_t skew_factor;      // 0: none
  int32_t token_bytes;      // K and V bytes of one token and KV head
  int32_t cluster_max_block_bytes, wide_cluster_max_block_bytes;  // 4-warp, 8-warp cluster blocks
  int32_t full_grid_min_tokens;  // decode.py _full_grid_chunks's most_min_tokens
  int32_t wave_token_bytes;  // token_bytes x query tokens a request: the wave split's measure of a block
  int32_t graph_chunks;     // a CUDA-graph grid holds this many chunks of every request (1: the usual spare rows)
  int32_t min_kv_len;       // q_len_per_req where > 1, else 0: a shorter request is -7 (decode.py _expect_kv_ranges)
  int64_t max_partials;     // partial rows the workspace holds
  // int32s of the host buffer before this plan's section, which starts with merge_indptr
  // and ends with the work list: a fused launch (POD) places the prefill planner's section
  // and this one in one buffer, one after the other. 0: the buffer's start. Nothing before
  // it is written, and the section is the same ints wherever it starts (no entry holds a
  // position in the buffer).
  int64_t start;
};

// The planner's result besides the buffer (decode.py reads it as int64[kPlanResults]).
enum DecodePlanResult {
  kPlanItems,
  kPlanAnySplit,
  kPlanCluster,
  kPlanClusterWarps,
  kPlanKvHeadsPerBlock,
  kPlanGridItems,  // work-list rows (a CUDA-graph wrapper's fixed grid: decode.py graph_grid_items)
  kPlanLongest,    // the longest request's tokens (plan()'s page reordering sizes its grid by it)
  kPlanResults
};

namespace plan_detail {

constexpr int64_t kMinChunk = 64;        // decode.py _MIN_CHUNK
constexpr int64_t kClusterMinChunk = 64; // decode.py _CLUSTER_MIN_CHUNK
constexpr int64_t kLongClusterBlockBytes = int64_t(2) << 20;  // decode.py _LONG_CLUSTER_MAX_BLOCK_BYTES

inline int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t up_to(int64_t a, int64_t m) { return div_up(a, m) * m; }

struct Sized {
  int64_t chunk, longest;
  bool automatic;
};

constexpr int64_t kWaveSplitMinBytes = 1000000000;      // decode.py _WAVE_SPLIT_MIN_BYTES
constexpr int64_t kWaveSplitManyMinBytes = 2000000000;  // decode.py _WAVE_SPLIT_MANY_MIN_BYTES
constexpr int64_t kWaveSplitWaves = 12;                 // decode.py _WAVE_SPLIT_WAVES

// decode.py _wave_chunks
inline int64_t wave_chunks(const std::vector<int64_t>& lens, int64_t longest, int64_t blocks, int64_t wave,
                           int64_t block_bytes, bool many_waves) {
  const int64_t wave_bytes = block_bytes * wave;
  if (wave_bytes < kWaveSplitMinBytes || blocks <= wave) return 1;
  for (const int64_t n : lens)
    if (4 * n < 3 * longest) return 1;
  if (2 * blocks >= 7 * wave) {
    if (!many_waves || wave_bytes < kWaveSplitManyMinBytes) return 1;
    return std::max<int64_t>(1, std::min<int64_t>(4, (2 * kWaveSplitWaves * wave + blocks) / (2 * blocks)));
  }
  int64_t best = 1, best_cost = -1;
  for (int64_t k = 1; k <= 4; ++k) {
    const int64_t idle = (wave - (k * blocks) % wave) % wave;
    const int64_t cost = idle * (12 / k);
    if (best_cost < 0 || cost < best_cost) best = k, best_cost = cost;
  }
  return best;
}

constexpr int64_t kFullGridMinTenths = 7;          // decode.py _FULL_GRID_MIN_TENTHS
constexpr int64_t kFullGridMostTenths = 9;         // decode.py _FULL_GRID_MOST_TENTHS
constexpr int64_t kPartGridSplitMinTokens = 1024;  // decode.py _PART_GRID_SPLIT_MIN_TOKENS

// decode.py _full_grid_chunks
inline int64_t full_grid_chunks(int64_t blocks, int64_t target, int64_t sms, int64_t longest,
                                int64_t most_min_tokens) {
  const int64_t heads = blocks * 2 * sms / target;
  if (10 * heads < kFullGridMinTenths * sms || blocks >= target) return 0;
  const bool most = 10 * heads >= kFullGridMostTenths * sms;
  if (target / blocks < 2 || longest < (most ? most_min_tokens : kPartGridSplitMinTokens)) return 1;
  return 2;
}

// decode.py _chunk_size
inline Sized chunk_size(const std::vector<int64_t>& lens, int64_t longest, int64_t total, int64_t blocks_per_item,
                        int64_t target, const DecodePlanConfig& c, int64_t skewed_target,
                        int64_t block_token_bytes) {
  if (c.disable_split_kv || longest == 0) return {std::max<int64_t>(longest, 1), longest, false};
  if (c.fixed_split_size) return {c.fixed_split_size, longest, false};
  int64_t wanted = div_up(total * blocks_per_item, target);
  bool skewed = false;
  if (skewed_target && 2 * longest >= 3 * wanted) {
    bool short_one = false;
    for (const int64_t n : lens) short_one |= n > 0 && 2 * n < wanted;
    if (short_one) wanted = div_up(total * blocks_per_item, skewed_target), skewed = true;
  }
  int64_t floor = std::min<int64_t>(c.min_chunk, std::max(kMinChunk, up_to(div_up(longest, 16), 32)));
  if (c.max_chunks) floor = std::max(floor, up_to(div_up(longest, c.max_chunks), 32));
  if (skewed_target && c.sms && !skewed) {
    const int64_t k = full_grid_chunks(int64_t(lens.size()) * blocks_per_item, target, c.sms, longest,
                                       c.full_grid_min_tokens);
    if (k == 1) return {longest, longest, true};
    if (k) return {std::max(floor, up_to(div_up(longest, k), 32)), longest, true};
  }
  int64_t chunk = std::max(floor, div_up(wanted, 32) * 32);
  if (skewed_target && block_token_bytes && 2 * longest < 3 * chunk) {  // nothing splits by the target
    const int64_t k = wave_chunks(lens, longest, int64_t(lens.size()) * blocks_per_item, skewed_target,
                                  // (many waves split one-token tiles only: wave_token_bytes is token_bytes there)
                                  longest * block_token_bytes, c.wave_token_bytes == c.token_bytes);
    if (k > 1) chunk = std::max(floor, up_to(div_up(longest, k), 32));
  }
  return {chunk, longest, true};
}

// decode.py _nothing_splits (max_items < 0: no cap)
inline bool nothing_splits(const Sized& s, int64_t batch = 0, int64_t max_items = -1) {
  const bool fits = s.automatic ? 2 * s.longest < 3 * s.chunk : s.chunk >= s.longest;
  return fits && (max_items < 0 || batch <= max_items);
}

// decode.py graph_grid_items
inline int64_t graph_grid_items(int64_t capacity, int64_t blocks_per_item, int64_t target, int64_t sms,
                                int64_t graph_chunks) {
  const int64_t spare = div_up(2 * target, blocks_per_item);
  if (capacity * blocks_per_item >= sms) {
    const bool few_waves = 2 * capacity * blocks_per_item < 7 * target;  // where the wave split may take them
    return std::max(capacity + spare, few_waves ? capacity * graph_chunks : 0);
  }
  return capacity + std::min(spare, (2 * sms - 1) / blocks_per_item - capacity);
}

// decode.py _chunk_lengths, one request: (chunk length, chunks)
inline void chunk_length(int64_t n, int64_t chunk, bool automatic, int64_t& size, int64_t& count) {
  if (!automatic) {
    size = chunk;
    count = std::max<int64_t>(1, div_up(n, chunk));
    return;
  }
  const int64_t wanted = std::max<int64_t>(1, (2 * n + chunk) / (2 * chunk));
  size = std::max<int64_t>(32, up_to(div_up(n, wanted), 32));
  count = std::max<int64_t>(1, div_up(n, size));
}

inline int64_t count_items(const std::vector<int64_t>& lens, const Sized& s) {
  int64_t items = 0, size, count;
  for (const int64_t n : lens) {
    chunk_length(n, s.chunk, s.automatic, size, count);
    items += count;
  }
  return items;
}

}  // namespace plan_detail

// Returns 0 and fills host[c.start, end) and result; > 0: the host buffer must hold this
// many int32, c.start included (call again with a larger one); < 0: bad input, a batch
// over the capacity, a list over the workspace or a request under c.min_kv_len tokens
// (decode.py's numpy path then raises its error). CSR where
// indptr is given (indptr [batch + 1], last_page_len [batch], limit = len(indices)), else
// block tables (seq_lens [batch], limit = max_pages x page_size). capacity 0: an eager
// wrapper; > 0: a CUDA-graph wrapper's, every array padded to it and the grid fixed by it.
// Buffer layout: decode.py _offsets and pack_plan (no host page ids), from c.start.
inline int64_t decode_plan(const DecodePlanConfig& c, const int32_t* indptr, const int32_t* last,
                           const int32_t* seq_lens, int64_t batch, int64_t limit, int64_t capacity, int32_t* host,
                           int64_t host_size, int64_t* result) {
  using namespace plan_detail;
  if (batch < 0 || c.page_size <= 0 || c.target <= 0 || c.blocks_per_item <= 0 || c.start < 0) return -1;
  const bool graph = capacity > 0;
  if (graph && batch > capacity) return -6;
  const int64_t cap = graph ? capacity : batch;
  thread_local std::vector<int64_t> lens, size, count, merge;
  thread_local std::vector<int32_t> rows;
  thread_local std::vector<int64_t> order;
  const bool csr = indptr != nullptr;
  const int64_t ps = c.page_size;
  lens.resize(batch);
  int64_t longest = 0, total = 0;
  if (csr) {
    if (indptr[0] != 0 || indptr[batch] > limit) return -2;
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t pages = int64_t(indptr[i + 1]) - indptr[i];
      if (pages < 0) return -2;
      if (pages > 0 && (last[i] < 1 || last[i] > ps)) return -3;
      lens[i] = pages > 0 ? pages * ps - (ps - last[i]) : 0;
    }
  } else {
    for (int64_t i = 0; i < batch; ++i) {
      if (seq_lens[i] < 0 || seq_lens[i] > limit) return -4;
      lens[i] = seq_lens[i];
    }
  }
  for (const int64_t n : lens) {
    if (n < c.min_kv_len) return -7;
    longest = std::max(longest, n);
    total += n;
  }

  // decode.py _cluster_shape (a CUDA-graph wrapper decides by its capacity alone)
  int32_t cluster = 1, cluster_warps = 4;
  if (graph) {
    if (c.cluster > 1 && !c.fixed_split_size && !c.disable_split_kv &&
        c.wide_cluster_max_block_bytes >= kLongClusterBlockBytes && 2 * cap * c.blocks_per_item * c.cluster <= c.sms)
      cluster = c.cluster, cluster_warps = 8;
  } else if (c.cluster > 1 && !c.fixed_split_size && !c.disable_split_kv && batch > 0 &&
             batch * c.blocks_per_item * c.cluster <= c.sms) {
    const int64_t block_bytes = div_up(longest, c.cluster) * c.token_bytes;
    if (longest >= kClusterMinChunk * c.cluster) {
      if (block_bytes <= c.cluster_max_block_bytes) {
        cluster = c.cluster;
      } else if (block_bytes <= c.wide_cluster_max_block_bytes && 2 * batch * c.blocks_per_item * c.cluster <= c.sms) {
        cluster = c.cluster;  // 8-warp blocks, one per SM on at most half the SMs
        cluster_warps = 8;
      }
    }
  }

  int64_t items = 0, max_items = -1;
  bool any_split = false, one_per_request = false;
  int32_t per_block = 1;
  rows.clear();
  merge.assign(batch + 1, 0);
  if (cluster > 1) {  // decode.py plan_cluster
    items = batch * cluster;
    if (graph) max_items = cap * cluster;
    rows.resize(4 * items);
    for (int64_t r = 0; r < batch; ++r) {
      const int64_t sz = std::max<int64_t>(32, up_to(div_up(lens[r], cluster), 32));
      for (int64_t i = 0; i < cluster; ++i) {
        const int64_t start = std::min(i * sz, lens[r]), end = std::min(start + sz, lens[r]);
        int32_t* row = &rows[4 * (r * cluster + i)];
        row[0] = int32_t(r), row[1] = int32_t(start), row[2] = int32_t(end), row[3] = -1;
      }
    }
  } else {
    // decode.py _pairing (a CUDA-graph wrapper decides by its capacity)
    int64_t bpi = c.blocks_per_item, target = c.target;
    Sized sized{};
    bool have_sized = false;
    if (c.pairs && graph) {
      if (cap * (bpi / 2) >= c.sms) per_block = 2, bpi /= 2, target /= 2;
    } else if (c.pairs) {
      const int64_t bpi2 = bpi / 2, target2 = target / 2;
      const Sized s = chunk_size(lens, longest, total, bpi2, target2, c, c.skew_factor ? target2 * c.skew_factor : 0,
                                 2 * int64_t(c.wave_token_bytes));
      const int64_t n = nothing_splits(s) ? batch : count_items(lens, s);
      if (n * bpi2 >= c.sms) {
        per_block = 2, bpi = bpi2, target = target2, sized = s, have_sized = true;
      }
    }
    if (graph) max_items = graph_grid_items(cap, bpi, target, c.sms, c.graph_chunks);
    const int64_t skewed = c.skew_factor ? target * c.skew_factor : 0;
    if (!have_sized)
      sized = chunk_size(lens, longest, total, bpi, target, c, skewed, per_block * int64_t(c.wave_token_bytes));
    if (nothing_splits(sized, batch, max_items)) {
      one_per_request = true;
      items = batch;
    } else {  // decode.py plan_split (eager: the partial rows are the only cap)
      size.resize(batch);
      count.resize(batch);
      int64_t chunk = sized.chunk;
      while (true) {
        int64_t partials = 0;
        items = 0;
        for (int64_t r = 0; r < batch; ++r) {
          chunk_length(lens[r], chunk, sized.automatic, size[r], count[r]);
          items += count[r];
          if (count[r] > 1) partials += count[r];
        }
        if ((max_items < 0 || items <= max_items) && partials <= c.max_partials) break;
        if (chunk >= longest) return -5;
        chunk = std::min(longest, chunk * 2);
      }
      for (int64_t r = 0; r < batch; ++r) {
        const bool split = count[r] > 1;
        merge[r + 1] = merge[r] + (split ? count[r] : 0);
        any_split |= split;
      }
      rows.resize(4 * items);
      int64_t k = 0;
      for (int64_t r = 0; r < batch; ++r) {
        const bool split = count[r] > 1;
        for (int64_t i = 0; i < count[r]; ++i, ++k) {
          const int64_t start = i * size[r], end = std::min(start + size[r], lens[r]);
          int32_t* row = &rows[4 * k];
          row[0] = int32_t(r), row[1] = int32_t(start), row[2] = int32_t(end);
          row[3] = split ? int32_t(merge[r] + i) : -1;
        }
      }
      if (any_split) {  // longest items first, stable (numpy argsort(start - end, kind="stable"))
        order.resize(items);
        std::iota(order.begin(), order.end(), int64_t(0));
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
          return rows[4 * a + 1] - rows[4 * a + 2] < rows[4 * b + 1] - rows[4 * b + 2];
        });
        thread_local std::vector<int32_t> tmp;
        tmp.resize(4 * items);
        for (int64_t j = 0; j < items; ++j) std::copy_n(&rows[4 * order[j]], 4, &tmp[4 * j]);
        rows.swap(tmp);
      }
    }
  }

  // decode.py _offsets and pack_plan: every array padded to the capacity; offsets from
  // here on are within this plan's section, which starts at host + c.start
  const int64_t grid_items = graph ? max_items : items;
  const int64_t table = cap + 1;
  const int64_t work_at = table + (csr ? 2 * cap + 1 : cap);
  const int64_t end = work_at + 1 + 4 * grid_items;
  if (c.start + end > host_size) return c.start + end;
  host += c.start;
  for (int64_t i = 0; i <= batch; ++i) host[i] = one_per_request ? 0 : int32_t(merge[i]);
  std::fill(host + batch + 1, host + table, one_per_request ? 0 : int32_t(merge[batch]));
  if (csr) {
    const int64_t last_at = table + cap + 1;
    std::copy_n(indptr, batch + 1, host + table);
    std::fill(host + table + batch + 1, host + last_at, indptr[batch]);
    std::copy_n(last, batch, host + last_at);
    std::fill(host + last_at + batch, host + work_at, 0);
  } else {
    std::copy_n(seq_lens, batch, host + table);
    std::fill(host + table + batch, host + work_at, 0);
  }
  host[work_at] = int32_t(items);
  std::fill(host + work_at + 1 + 4 * items, host + end, 0);  // a CUDA-graph grid's spare rows
  int32_t* out = host + work_at + 1;
  if (one_per_request) {
    for (int64_t r = 0; r < batch; ++r) {
      out[4 * r] = int32_t(r), out[4 * r + 1] = 0, out[4 * r + 2] = int32_t(lens[r]), out[4 * r + 3] = -1;
    }
  } else {
    std::copy(rows.begin(), rows.end(), out);
  }
  result[kPlanItems] = items;
  result[kPlanAnySplit] = any_split;
  result[kPlanCluster] = cluster;
  result[kPlanClusterWarps] = cluster_warps;
  result[kPlanKvHeadsPerBlock] = per_block;
  result[kPlanGridItems] = grid_items;
  result[kPlanLongest] = longest;
  return 0;
}

}  // namespace fij

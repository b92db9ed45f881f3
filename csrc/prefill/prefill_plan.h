// Batch prefill's plan() on the host, in C++ (flashinfer_jit/prefill/wrapper.py calls it through
// ctypes; its numpy twin, prefill.plan_work, is the readable specification and the
// fallback). It validates the index arrays, picks the query tile, splits long requests'
// keys where the batch cannot fill the GPU, and writes, into one pinned host slot that
// reaches the device in one copy:
//   qo_indptr [capacity + 1]
//   the K/V side's arrays: csr: indptr [capacity + 1], last_page_len [capacity];
//     block tables: seq_lens [capacity]; ragged: kv_indptr [capacity + 1]
//   merge_indptr [qo_tokens + 1] (only when a request is split)
//   the work list: the item count, then kPrefillPairInts ints a (tile, chunk) pair, whose
//     num_kv_heads items differ in the KV head only (csrc/prefill/prefill_params.h)
// Index arrays past the batch (CUDA-graph capacity) repeat their last offset or hold 0.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "prefill/prefill_params.h"

namespace fij {

enum class PrefillKVSide : int32_t { kCSR = 0, kSeqLens = 1, kRagged = 2 };

struct PrefillPlanConfig {
  int32_t group = 1, num_kv_heads = 1;
  int32_t kv_side = 0;       // PrefillKVSide
  int32_t page_size = 1;
  int32_t causal = 0;
  int32_t tile_rows = 0;     // 0: chosen here (64 or 128, see max_tile_rows); else pinned, at most max_tile_rows
  // the largest tile the wrapper may run (a CUDA graph at head_dim 256: 64; csrc/prefill/prefill.cuh
  // kOneItemABlock relies on it)
  int32_t max_tile_rows = 128;
  int32_t target_blocks = 264;  // blocks of a full wave
  int32_t min_chunk = 256;
  int32_t fixed_split_size = 0;  // > 0: keys a chunk (forced)
  int32_t split = 1;             // 0: no request splits
  int32_t capacity = 0;          // index arrays' length (the batch, or a CUDA-graph capacity)
  // > 0: causal batches whose requests average at most this many keys take the 64-row tile
  // (head_dim 256, whose 128-row tile is one block an SM: short causal tiles, mostly
  // masked, gain 2-6% with 64 rows on the H100; non-causal ones lose 1-6%)
  int32_t short_causal_keys = 0;
  int64_t work_capacity = 0;     // > 0: the work list's fixed size in items (CUDA graphs)
  int64_t max_partial_rows = 0;  // partial rows the workspace holds
  int64_t max_kv_len = 0;        // > 0: block tables' seq_lens at most this (max_pages x page_size)
  // int32s of the host buffer before this plan's section (qo_indptr .. the work list): a
  // fused launch (POD) places the decode planner's section and this one in one buffer, one
  // after the other. 0: the buffer's start. Nothing before it is written; the result's
  // offsets (kTableAt .. kEnd) count from the buffer's start, and the section is the same
  // ints wherever it starts (no entry holds a position in the buffer).
  int64_t start = 0;
};

// result[]: what plan() reads back
enum PrefillPlanResult : int {
  kStatus = 0,      // 0, or an error below
  kBadIndex = 1,    // the request (or offset) an error is about
  kItems = 2,
  kTileRows = 3,
  kQoTokens = 4,
  kPartialRows = 5,  // > 0: split; merge_indptr[qo_tokens] = this
  kTableAt = 6,
  kMergeAt = 7,
  kWorkAt = 8,
  kEnd = 9,  // the end of what is written (or the buffer size needed, with kSlotTooSmall), start included
  kKvRows = 10,  // ragged: kv_indptr[batch]; csr: indptr[batch] (pages)
  // paged: the most pages of any request that plan()'s page order may reorder (every page
  // but the last; causal: the pages of keys j <= kv_len - qo_len, which every query row
  // sees; flashinfer_jit/runtime/page_order.py); ragged: 0
  kMovablePages = 11,
  kResultInts = 12
};
enum PrefillPlanError : int {
  kQoIndptr = 1,       // not starting at 0 or decreasing
  kKvIndptr = 2,       // ragged kv_indptr / csr indptr: not starting at 0 or decreasing
  kLastPageLen = 3,    // outside 1..page_size for a request with pages
  // 4: no longer returned (causal with kv_len < qo_len is planned: rows that see no key write
  // zeros and lse -inf, as FlashInfer's)
  kSeqLens = 5,        // negative, or over max_kv_len
  kSlotTooSmall = 6,   // host_size < result[kEnd]
  kWorkCapacity = 7,   // more items than work_capacity
  kCapacity = 8,       // batch > capacity
  kBadStart = 9,       // PrefillPlanConfig.start < 0
};

inline int64_t prefill_plan(const PrefillPlanConfig& c, const int32_t* qo_indptr, const int32_t* kv_a,
                            const int32_t* kv_b, int64_t batch, int32_t* host, int64_t host_size, int64_t* result) {
  for (int i = 0; i < kResultInts; ++i) result[i] = 0;
  auto fail = [&](int code, int64_t index) {
    result[kStatus] = code;
    result[kBadIndex] = index;
    return int64_t(code);
  };
  const int64_t cap = c.capacity > batch ? c.capacity : batch;
  if (c.capacity > 0 && batch > c.capacity) return fail(kCapacity, batch);
  if (c.start < 0) return fail(kBadStart, 0);
  // lengths, validated
  std::vector<int32_t> kv_len(batch);
  if (qo_indptr[0] != 0) return fail(kQoIndptr, 0);
  int64_t qo_tokens = 0, rows_total = 0, active = 0, active_keys = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t q = qo_indptr[b + 1] - qo_indptr[b];
    if (q < 0) return fail(kQoIndptr, b);
    qo_tokens += q;
    active += q > 0;
  }
  const auto side = static_cast<PrefillKVSide>(c.kv_side);
  if (side != PrefillKVSide::kSeqLens && kv_a[0] != 0) return fail(kKvIndptr, 0);
  for (int64_t b = 0; b < batch; ++b) {
    int32_t n;
    if (side == PrefillKVSide::kCSR) {
      const int32_t pages = kv_a[b + 1] - kv_a[b];
      if (pages < 0) return fail(kKvIndptr, b);
      if (pages > 0 && (kv_b[b] < 1 || kv_b[b] > c.page_size)) return fail(kLastPageLen, b);
      n = pages > 0 ? (pages - 1) * c.page_size + kv_b[b] : 0;
    } else if (side == PrefillKVSide::kSeqLens) {
      n = kv_a[b];
      if (n < 0 || (c.max_kv_len > 0 && n > c.max_kv_len)) return fail(kSeqLens, b);
    } else {
      n = kv_a[b + 1] - kv_a[b];
      if (n < 0) return fail(kKvIndptr, b);
    }
    const int32_t q = qo_indptr[b + 1] - qo_indptr[b];
    kv_len[b] = n;
    if (q > 0) active_keys += n;
    if (side != PrefillKVSide::kRagged && n > 0) {
      int64_t movable = (int64_t(n) + c.page_size - 1) / c.page_size - 1;
      if (c.causal) movable = std::min<int64_t>(movable, std::max<int64_t>(0, int64_t(n) - q + 1) / c.page_size);
      result[kMovablePages] = std::max<int64_t>(result[kMovablePages], movable);
    }
  }
  result[kKvRows] = side == PrefillKVSide::kSeqLens ? 0 : kv_a[batch];
  // the query tile: 128 rows where requests average more than 64 (token, head) rows (and,
  // with short_causal_keys, more keys than that)
  rows_total = qo_tokens * c.group;
  int32_t tile = std::min(c.tile_rows, c.max_tile_rows);
  if (tile <= 0) {
    tile = (c.max_tile_rows >= 128 && active > 0 && rows_total > 64 * active) ? 128 : 64;
    if (tile == 128 && c.causal && c.short_causal_keys > 0 && active_keys <= int64_t(c.short_causal_keys) * active)
      tile = 64;
  }
  // tiles, the keys each can see, and the split; request b's tiles are tile_first[b] ..
  // tile_first[b + 1]
  std::vector<int64_t> tile_first(batch + 1);
  tile_first[0] = 0;
  for (int64_t b = 0; b < batch; ++b)
    tile_first[b + 1] = tile_first[b] + (int64_t(qo_indptr[b + 1] - qo_indptr[b]) * c.group + tile - 1) / tile;
  const int64_t num_tiles = tile_first[batch];
  struct Tile {
    int32_t row0, visible;
  };
  std::vector<Tile> tiles(static_cast<size_t>(num_tiles));
  int64_t visible_sum = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t q = qo_indptr[b + 1] - qo_indptr[b], n = kv_len[b];
    Tile* tl = tiles.data() + tile_first[b];
    const int64_t rows = int64_t(q) * c.group;
    for (int64_t r0 = 0; r0 < rows; r0 += tile, ++tl) {
      int32_t vis = n;
      if (c.causal) {
        const int64_t last_token = std::min<int64_t>(q, (r0 + tile - 1) / c.group + 1) - 1;
        vis = static_cast<int32_t>(std::max<int64_t>(0, std::min<int64_t>(n, last_token + n - q + 1)));
      }
      *tl = {static_cast<int32_t>(r0), vis};
      visible_sum += vis;
    }
  }
  int64_t chunk = 0;
  if (c.split && batch > 0) {
    if (c.fixed_split_size > 0) {
      chunk = c.fixed_split_size;
    } else if (num_tiles * c.num_kv_heads < c.target_blocks) {
      const int64_t work = visible_sum * c.num_kv_heads;
      chunk = std::max<int64_t>(c.min_chunk, (work + c.target_blocks - 1) / c.target_blocks);
    }
    if (chunk > 0) chunk = (chunk + 63) / 64 * 64;
  }
  // chunks[b] chunks of chunk_keys[b] keys a request (its last one shorter). The chunk size
  // plan() picked is then evened out per request (its key count over its chunks, up to a
  // multiple of 64): 4096 keys at a 4032-key chunk run as 2 x 2048, not 4032 + 64, where
  // every long chunk took as long as the unsplit request (H100: 1.06x on 32 x 4 tokens on
  // 4k keys, head_dim 128). A fixed_split_size is kept as given.
  std::vector<int32_t> chunks(batch, 1);
  std::vector<int64_t> chunk_keys(batch, chunk);
  int64_t partial_rows = 0;
  if (chunk > 0) {
    for (int64_t b = 0; b < batch; ++b) {
      chunks[b] = static_cast<int32_t>(std::max<int64_t>(1, (kv_len[b] + chunk - 1) / chunk));
      if (chunks[b] > 1 && c.fixed_split_size <= 0) {
        chunk_keys[b] = ((kv_len[b] + chunks[b] - 1) / chunks[b] + 63) / 64 * 64;
        chunks[b] = static_cast<int32_t>((kv_len[b] + chunk_keys[b] - 1) / chunk_keys[b]);
      }
      if (chunks[b] > 1) partial_rows += int64_t(qo_indptr[b + 1] - qo_indptr[b]) * chunks[b];
    }
    if (partial_rows > c.max_partial_rows) {  // the workspace cannot hold them: unsplit
      std::fill(chunks.begin(), chunks.end(), 1);
      partial_rows = 0;
    }
  }
  // (tile, chunk) pairs with the keys each sees, request b's at pair_first[b] ..
  // pair_first[b + 1], and each request's heaviest pair
  struct Pair {
    int32_t tile, chunk, cost;
  };
  std::vector<int64_t> pair_first(batch + 1);
  pair_first[0] = 0;
  for (int64_t b = 0; b < batch; ++b)
    pair_first[b + 1] = pair_first[b] + (tile_first[b + 1] - tile_first[b]) * chunks[b];
  std::vector<Pair> pairs(static_cast<size_t>(pair_first[batch]));
  std::vector<int32_t> request_cost(batch, 0);
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t n = chunks[b];
    Pair* pr = pairs.data() + pair_first[b];
    int32_t heaviest = 0;
    for (int64_t t = tile_first[b]; t < tile_first[b + 1]; ++t) {
      const int32_t visible = tiles[t].visible;
      for (int32_t k = 0; k < n; ++k, ++pr) {
        int32_t cost = visible;
        if (n > 1) {
          const int64_t lo = int64_t(k) * chunk_keys[b], hi = std::min<int64_t>(lo + chunk_keys[b], kv_len[b]);
          cost = static_cast<int32_t>(std::max<int64_t>(0, std::min<int64_t>(hi, visible) - lo));
        }
        *pr = {static_cast<int32_t>(t), k, cost};
        heaviest = std::max(heaviest, cost);
      }
    }
    request_cost[b] = heaviest;
  }
  // Requests heaviest first (by their heaviest pair), each request's pairs together,
  // heaviest first: the last wave holds the short pairs of the lightest request, and the
  // blocks in flight at a time read the K/V of a request or two, which stay in L2 (pairs
  // sorted by cost alone interleave every request's causal tiles: at head_dim 256 that
  // read each request's K/V from DRAM once per tile). Ties keep request order, and a
  // request's pairs of equal cost their (tile, chunk) order, the order they were made in:
  // both sorts below are total orders, so std::sort needs no stability (nor its buffer).
  // In two steps: the requests by an integer key (unique, the request breaks ties), then
  // each request's own pairs; one stable_sort of every pair by a comparison that looked up
  // the pairs' requests' costs took 4 of the planner's 8 us for 256 one-pair requests (the
  // CPU machine).
  std::vector<uint64_t> order;  // requests with pairs: (~cost) << 32 | request, ascending
  order.reserve(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b)
    if (pair_first[b + 1] > pair_first[b]) order.push_back(uint64_t(~uint32_t(request_cost[b])) << 32 | uint32_t(b));
  std::sort(order.begin(), order.end());
  for (int64_t b = 0; b < batch; ++b)
    std::sort(pairs.data() + pair_first[b], pairs.data() + pair_first[b + 1], [](const Pair& x, const Pair& y) {
      if (x.cost != y.cost) return x.cost > y.cost;
      return x.tile != y.tile ? x.tile < y.tile : x.chunk < y.chunk;
    });
  const int64_t items = static_cast<int64_t>(pairs.size()) * c.num_kv_heads;
  if (c.work_capacity > 0 && items > c.work_capacity) {
    result[kItems] = items;
    return fail(kWorkCapacity, items);
  }
  // layout, within this plan's section (reported from the buffer's start)
  const int64_t table_at = cap + 1;
  int64_t merge_at = table_at;
  if (side == PrefillKVSide::kCSR) merge_at += 2 * cap + 1;
  else if (side == PrefillKVSide::kSeqLens) merge_at += cap;
  else merge_at += cap + 1;
  const int64_t work_at = merge_at + (partial_rows > 0 ? qo_tokens + 1 : 0);
  const int64_t work_items = c.work_capacity > 0 ? c.work_capacity : items;
  const int64_t work_pairs = (work_items + c.num_kv_heads - 1) / c.num_kv_heads;
  const int64_t end = work_at + 1 + int64_t(kPrefillPairInts) * work_pairs;
  result[kItems] = items;
  result[kTileRows] = tile;
  result[kQoTokens] = qo_tokens;
  result[kPartialRows] = partial_rows;
  result[kTableAt] = c.start + table_at;
  result[kMergeAt] = c.start + merge_at;
  result[kWorkAt] = c.start + work_at;
  result[kEnd] = c.start + end;
  if (host_size < c.start + end) return fail(kSlotTooSmall, c.start + end);
  host += c.start;
  // qo_indptr and the K/V side, padded to the capacity
  for (int64_t b = 0; b <= batch; ++b) host[b] = qo_indptr[b];
  for (int64_t b = batch + 1; b <= cap; ++b) host[b] = qo_indptr[batch];
  int32_t* t = host + table_at;
  if (side == PrefillKVSide::kCSR) {
    for (int64_t b = 0; b <= batch; ++b) t[b] = kv_a[b];
    for (int64_t b = batch + 1; b <= cap; ++b) t[b] = kv_a[batch];
    int32_t* last = t + cap + 1;
    for (int64_t b = 0; b < batch; ++b) last[b] = kv_a[b + 1] > kv_a[b] ? kv_b[b] : 0;
    for (int64_t b = batch; b < cap; ++b) last[b] = 0;
  } else if (side == PrefillKVSide::kSeqLens) {
    for (int64_t b = 0; b < batch; ++b) t[b] = kv_len[b];
    for (int64_t b = batch; b < cap; ++b) t[b] = 0;
  } else {
    for (int64_t b = 0; b <= batch; ++b) t[b] = kv_a[b];
    for (int64_t b = batch + 1; b <= cap; ++b) t[b] = kv_a[batch];
  }
  // merge_indptr over q tokens, and each split request's first partial row
  std::vector<int32_t> partial_base(batch, -1);
  if (partial_rows > 0) {
    int32_t* m = host + merge_at;
    int64_t acc = 0, token = 0;
    m[0] = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const int32_t q = qo_indptr[b + 1] - qo_indptr[b];
      const int32_t per = chunks[b] > 1 ? chunks[b] : 0;
      if (per) partial_base[b] = static_cast<int32_t>(acc);
      for (int32_t i = 0; i < q; ++i) {
        acc += per;
        m[++token] = static_cast<int32_t>(acc);
      }
    }
  }
  // the work list
  int32_t* w = host + work_at;
  w[0] = static_cast<int32_t>(items);
  int32_t* it = w + 1;
  for (const uint64_t key : order) {
    const int64_t b = static_cast<int64_t>(key & 0xffffffffu);
    const int32_t n = chunks[b];
    for (int64_t j = pair_first[b]; j < pair_first[b + 1]; ++j) {
      const Pair& pr = pairs[j];
      const int32_t kv_start = n > 1 ? static_cast<int32_t>(int64_t(pr.chunk) * chunk_keys[b]) : 0;
      const int32_t kv_end =
          n > 1 ? static_cast<int32_t>(std::min<int64_t>(kv_start + chunk_keys[b], kv_len[b])) : kv_len[b];
      it[0] = static_cast<int32_t>(b);
      it[1] = tiles[pr.tile].row0;
      it[2] = kv_start;
      it[3] = kv_end;
      it[4] = partial_base[b];
      it[5] = n;
      it[6] = pr.chunk;
      it[7] = qo_indptr[b];
      it[8] = qo_indptr[b + 1] - qo_indptr[b];
      it[9] = kv_len[b];
      it[10] = side == PrefillKVSide::kSeqLens ? 0 : kv_a[b];  // kv_indptr[b] / the CSR indptr[b]
      for (int l = 0; l < kPrefillPairIds; ++l) it[kPrefillPairIdsAt + l] = -1;  // (the page-order launch's)
      it += kPrefillPairInts;
    }
  }
  return 0;
}

}  // namespace fij

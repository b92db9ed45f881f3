// The Hopper path's query tiles, planned on the host: flashinfer_jit/prefill/sm90.py plan_tiles'
// C++ twin (the same values, tests/test_prefill_sm90.py compares them), which plan() calls
// through fij_fastcall.sm90_tiles (csrc/runtime/fastcall.cc) where the index vectors are of the
// common form: numpy's version costs ~40 us of host time a plan on the CPU machine for 16
// requests, this one ~1.
//
// A tile is kSm90TileInts int32 (csrc/hopper/prefill_sm90_params.h Sm90Tile): its first query
// row, rows, the request's first K/V row (ragged) or page-id index (paged), keys, diagonal
// (the causal mask's offset: kv_len - qo_len + the tile's first row), key tiles to visit, the
// keys it visits (column 6, which the kernel does not read) and its first key tile (a window).
// Tiles are ordered by key tiles visited, most first, ties in request and tile order.
#pragma once
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "hopper/prefill_sm90_params.h"

namespace fij::sm90_plan {

constexpr int kTileInts = kSm90TileInts;

struct TileStats {
  int64_t tiles = 0;     // the batch's tiles (written only when they fit)
  int64_t active = 0;    // tiles that visit a key tile
  int64_t keys_sum = 0;  // column 6 summed (auto's mean keys a tile)
};

// request b's (first K/V row or page-id index, keys) from row0(b) and len(b); qo: qo_indptr
// [batch + 1] (lengths >= 0, checked by the caller). Writes the tiles into out when there is
// room for them (capacity tiles); scratch: reused between plans.
template <class Row0, class Len>
TileStats plan_tiles(int64_t batch, const int32_t* qo, Row0 row0, Len len, bool causal, int64_t keys_a_tile,
                     int64_t window_left, int64_t tile_rows, int32_t* out, int64_t capacity,
                     std::vector<int64_t>& scratch) {
  TileStats s;
  for (int64_t b = 0; b < batch; ++b) s.tiles += (qo[b + 1] - qo[b] + tile_rows - 1) / tile_rows;
  if (s.tiles > capacity) return s;
  // fields as int64 (numpy's arithmetic), then the order, then int32 (numpy's astype)
  scratch.resize(static_cast<size_t>(s.tiles) * (kTileInts + 1));
  int64_t* fields = scratch.data();
  int64_t* visited = fields + s.tiles * kTileInts;
  int64_t n = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = qo[b + 1] - qo[b], kv_len = len(b), first_row = row0(b);
    for (int64_t q_start = 0; q_start < q_len; q_start += tile_rows, ++n) {
      const int64_t diag = q_start + kv_len - q_len;
      const int64_t kv_end = causal ? std::max<int64_t>(std::min(kv_len, diag + tile_rows), 0) : kv_len;
      int64_t kv_tiles = (kv_end + keys_a_tile - 1) / keys_a_tile, first = 0, kv_start = 0;
      if (window_left >= 0) {
        kv_start = std::max<int64_t>(diag - window_left, 0);
        first = std::min(kv_start / keys_a_tile, kv_tiles);
        if (kv_start >= kv_end) kv_tiles = 0;  // a window past every key: no key tile
        if (kv_tiles == 0) first = 0;
      }
      int64_t* f = fields + n * kTileInts;
      f[0] = qo[b] + q_start;
      f[1] = std::min(tile_rows, q_len - q_start);
      f[2] = first_row;
      f[3] = kv_len;
      f[4] = diag;
      f[5] = kv_tiles;
      f[6] = kv_tiles > 0 ? kv_end - kv_start : 0;
      f[7] = first;
      visited[n] = kv_tiles - first;
      s.active += visited[n] != 0;
      s.keys_sum += f[6];
    }
  }
  std::vector<int64_t> order(static_cast<size_t>(s.tiles));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return visited[a] > visited[b]; });
  for (int64_t i = 0; i < s.tiles; ++i) {
    const int64_t* f = fields + order[i] * kTileInts;
    for (int j = 0; j < kTileInts; ++j) out[i * kTileInts + j] = static_cast<int32_t>(f[j]);
  }
  return s;
}

}  // namespace fij::sm90_plan

// The Hopper prefill kernel's work list and launch arguments (csrc/hopper/prefill_sm90.cuh):
// no CUDA types here, so that the torch binding, compiled without CUDA's headers, shares them.
#pragma once
#include <cstdint>

namespace fij {

// plan() writes the work list (flashinfer_jit/prefill/sm90.py plan_sm90), int32 on the device:
//   work[0]   items: tiles x num_qo_heads (an item is one query tile of one query head)
//   work[1]   active items: the first ones, whose tiles see at least one key; the rest (at
//             the end of the list) only write zeros and an LSE of -inf
//   work[2]   paged: where a tile's V page ids start past its K page ids (0: one id a page
//             for both, the CSR table and vLLM's block table; TensorRT-LLM's [B, 2, max_pages]
//             table: its stride between the K and the V row)
//   work[3]   unused (the tiles start 16-byte aligned)
//   work[4 + kSm90TileInts * t + f]  field f of tile t (Sm90Tile), heaviest tile first
//   then, with a custom mask, one int64 a tile (in the tiles' order): the packed mask's bit
//   of the tile's first row and the request's first key (the request's mask_indptr x 8 + the
//   row's position in the request x kv_len)
// Item i is tile i / num_qo_heads, query head i % num_qo_heads: one round of the persistent
// grid holds a few tiles of every head, so a KV head's keys serve its group from L2.
constexpr int kSm90TileInts = 8, kSm90WorkHeader = 4;
struct Sm90Tile {
  int32_t q_row0;    // the tile's first query row (token) in q
  int32_t rows;      // its rows that belong to the request (<= 128)
  int32_t kv_row0;   // ragged: the request's first K/V row; paged: the index of its first
                     // page id in the page table's indices (paged_kv_indptr[b])
  int32_t kv_len;
  int32_t diag;      // causal: the last key the tile's first row sees (its position in the
                     // request + kv_len - qo_len: bottom-right aligned); row r sees keys <= diag + r
  int32_t kv_tiles;  // the key tiles (of the kernel's key_tile) up to the last the tile visits
                     // (0: none; a row with no key gives 0, LSE -inf)
  int32_t keys;      // the keys the tile visits (plan()'s cost; the kernel does not read it), but
                     // with ALiBi its request's kv_len - qo_len (the LSE's shift: prefill_sm90.cuh)
  int32_t first_tile;  // the first key tile it visits (a sliding window's start; else 0)
};

// What the host binding resolves from the op's tensors (no CUDA types: the binding is
// compiled without the CUDA headers); the module's launch() encodes the TMA maps from it.
struct PrefillSm90Args {
  const void* q = nullptr;  // [q_tokens, num_qo_heads, D]; strides in elements
  int64_t q_tokens = 0, q_stride_n = 0, q_stride_h = 0;
  // ragged: k / v [kv_tokens, num_kv_heads, D]; paged: the caches [pages, page_size,
  // heads, D] (NHD) or [pages, heads, page_size, D] (HND), k_stride_p / v_stride_p between
  // pages and kv_tokens the page count
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t kv_tokens = 0, k_stride_n = 0, k_stride_h = 0, v_stride_n = 0, v_stride_h = 0;
  int64_t k_stride_p = 0, v_stride_p = 0;
  int32_t page_size = 0;             // paged: tokens a page (16, 32, 64 or 128)
  const int32_t* page_ids = nullptr;  // paged: the page table's indices
  int32_t num_qo_heads = 0, num_kv_heads = 0;
  void* out = nullptr;
  int64_t out_stride_n = 0, out_stride_h = 0;
  float* lse = nullptr;
  const int32_t* work = nullptr;
  int32_t* counters = nullptr;  // the dynamic schedule's two counters, zeros between launches
  float scale_log2 = 1.f, v_scale = 1.f;
  float soft_cap_log2 = 0.f;  // the module's soft cap (a soft-capped spec only), log2 units
  const float* sinks = nullptr;  // one logit a query head (natural units) joining each row's denominator; null: none
  int32_t window_left = -1;   // plan()'s sliding window (-1: none)
  const void* mask = nullptr;  // a custom mask: plan()'s packed bits, 4-byte aligned and padded (sm90.py)
  int32_t grid = 0;
};

}  // namespace fij

// Parameters of the RoPE family (apply_rope*, rope_quantize_fp8 and the fused
// rope + quantize + append into the paged cache). Plain data; see rope.cuh.
#pragma once
#include "common/page_table_params.h"

namespace fij {

// One kind of row (q heads, k heads or v heads) of a token: a rotated part of rope_dim
// elements and a passed-through part of nope_dim elements, each read from its own
// tensor and written to its own tensor, so rotary_dim < head_dim views, MLA's separate
// rope/nope tensors and in-place updates all take the same path.
struct RopeRows {
  const void* rope_in = nullptr;
  const void* nope_in = nullptr;
  void* rope_out = nullptr;
  void* nope_out = nullptr;
  int64_t rope_in_stride_token = 0, rope_in_stride_head = 0;
  int64_t nope_in_stride_token = 0, nope_in_stride_head = 0;
  int64_t rope_out_stride_token = 0, rope_out_stride_head = 0;
  int64_t nope_out_stride_token = 0, nope_out_stride_head = 0;
  int32_t num_heads = 0;
};

struct RopeParams {
  RopeRows q, k;
  int32_t nnz = 0;
  int32_t rope_dim = 0;  // multiple of 16
  int32_t nope_dim = 0;  // multiple of 16 (0 when the whole head is rotated)

  // Positions: pos_ids[token], or offsets[b] + (token - indptr[b]).
  const int32_t* pos_ids = nullptr;
  const int32_t* indptr = nullptr;
  const int32_t* offsets = nullptr;
  int32_t batch_size = 0;

  // Angles: cos_sin_cache[pos] = (cos[rope_dim/2], sin[rope_dim/2]), float32, or computed:
  // freq_i = theta^(-2i/rope_dim), s = clamp(freq_i*smooth_a + smooth_b, 0, 1),
  // freq_i = (1-s)*freq_i/rope_scale + s*freq_i  (Llama 3.1; smooth_a = smooth_b = 0 is
  // plain linear scaling), angle = pos * freq_i.
  const float* cos_sin_cache = nullptr;
  int32_t cos_sin_rows = 0;
  float rcp_scale = 1.f;
  float log2_theta = 13.287712f;  // log2(1e4)
  float smooth_a = 0.f, smooth_b = 0.f;

  // Outputs are x * scale in the output dtype (fp8 quantization scales; 1 otherwise).
  float q_scale = 1.f, kv_scale = 1.f;

  // Append mode: k rows go to the paged cache at (batch_indices, positions) instead of
  // k.rope_out/k.nope_out; v rows (num_v_heads x v_dim, no rotation) likewise.
  const int32_t* batch_indices = nullptr;  // -1: padding token, skipped entirely
  const int32_t* positions = nullptr;
  PagedTensor k_rope_cache, k_nope_cache, v_cache;
  const void* v_in = nullptr;
  int64_t v_in_stride_token = 0, v_in_stride_head = 0;
  int32_t num_v_heads = 0;  // 0 for MLA (no separate V)
  int32_t v_dim = 0;
  int32_t num_pages = 0;
  PageTableParams table;
};

}  // namespace fij

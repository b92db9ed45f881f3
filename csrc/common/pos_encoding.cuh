// Positional encodings applied inside the attention kernels (plan()'s pos_encoding_mode):
// none, RoPE on q and K (csrc/common/rope.cuh has its math), or ALiBi, a bias on the logits.
// Decode's CUDA-core kernel and prefill's kernel take one as a template parameter, so every
// other configuration compiles none of the others' code.
//
// ALiBi, as FlashInfer defines it (include/flashinfer/attention/variants.cuh, DefaultAttention
// with use_alibi; flashinfer/utils.py get_alibi_slopes):
//   logit(i, j) = (q_i . k_j) * sm_scale + slope[h] * (j - i)      (natural units)
// for query head h, key j of the request and query row i of the request (0 for a decode
// query, 0 .. qo_len - 1 in prefill: not the row's position kv_len - qo_len + i), with
//   n' = the largest power of two <= num_qo_heads
//   slope[h] = 2^(-8 (h + 1) / n')            for h < n'
//   slope[h] = 2^(-4 (2 (h - n') + 1) / n')   for h >= n'   (the odd steps of 2n' heads)
// The kernels add slope[h] * (j - pos_i), pos_i = i + kv_len - qo_len the row's position
// (bottom-right aligned, as the causal mask), instead: the same softmax (the two differ by a
// constant a row), but the keys near the query, which carry the weight, get biases near 0,
// not near slope * kv_len, so float32 keeps their logits' precision on long requests. The
// row's constant slope[h] * (kv_len - qo_len) joins its LSE as the row is written (before
// any merge of split chunks, which all carry the same constant), so the LSE is FlashInfer's.
#pragma once
#include "common/common.cuh"

namespace fij {

enum class PosEncoding : int { kNone = 0, kRopeLlama = 1, kAlibi = 2 };

// slope[head] * log2(e) (the kernels' logits are in the log2 domain) for num_heads query heads.
FIJ_DEVICE float alibi_slope_log2(int head, int num_heads) {
  const int pow2 = 1 << (31 - __clz(num_heads));  // n'
  const float exponent = head < pow2 ? -8.f * float(head + 1) : -4.f * float(2 * (head - pow2) + 1);
  return exp2f(exponent / float(pow2)) * 1.4426950408889634f;
}

}  // namespace fij

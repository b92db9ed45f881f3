// Rotary position embedding (RoPE), the math every kernel that rotates shares: the RoPE
// kernels (csrc/kvcache/rope.cuh), decode's CUDA-core kernel (q at its position) and
// prefill's ROPE_LLAMA path (q and K at theirs). Who holds which element differs (a
// lane's 8 dims and its partner lane's, two halves in one thread, interleaved pairs);
// the rotation and the frequencies are these.
//   pair i (of rope_dim / 2) turns by pos x freq_i,  freq_i = theta^(-2 i / rope_dim),
//   (x, y) -> (x cos - y sin, y cos + x sin)   (x: the pair's first element, y: its second)
// NeoX style pairs dim i with i + rope_dim / 2, GPT-J style (interleave) 2i with 2i + 1.
#pragma once
#include "common/common.cuh"

namespace fij {

// theta^(-2 i / rope_dim), with log2_theta = log2(theta)
FIJ_DEVICE float rope_inv_freq(float i, float rope_dim, float log2_theta) {
  return exp2f(-2.f * i / rope_dim * log2_theta);
}

// An element of a rotated pair from itself and its partner: the first element of the pair
// (x cos - y sin) or the second (y cos + x sin).
FIJ_DEVICE float rope_turn(float self, float partner, float c, float s, bool first) {
  return first ? self * c - partner * s : self * c + partner * s;
}

// Both elements of a pair, in place.
FIJ_DEVICE void rope_rotate(float& x, float& y, float c, float s) {
  const float a = x, b = y;
  x = rope_turn(a, b, c, s, true);
  y = rope_turn(b, a, c, s, false);
}

}  // namespace fij

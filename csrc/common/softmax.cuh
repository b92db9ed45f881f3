// The online softmax every attention kernel runs (decode's CUDA-core and tensor-core
// kernels, prefill's), one row at a time: a row is one query (token, head) against the
// keys a block reads tile by tile.
//
// Logits arrive in the log2 domain (x = logit x sm_scale x log2(e), soft cap applied), so
// exponents are exp2. A row keeps
//   m   its running max (a floor at the start, see below),
//   d   sum over the keys seen of 2^(x - m),
//   o   sum over the keys seen of 2^(x - m) v   (held by the caller: its layout is the
//       mma fragment's or the lane's, not this struct's),
// and the result is o / d with LSE = m + log2(d) (base 2, what merges and FlashInfer's
// lse take).
//
// The cases that must not produce NaN, handled here once, for either start:
//   - Floor (prefill): m starts at kNoMax, a finite floor, not -inf. A row that has seen no
//     key yet takes exponents 2^(x - kNoMax), which are 0 for masked keys (x = -inf), and
//     rescales 2^(kNoMax - m_new), which are 0 or 1: never inf - inf, and no select a step
//     (prefill's 64-key steps take one MUFU.EX2 an element and nothing else).
//   - NegInf (decode): m starts at -inf, and the selects keep the empty state: a rescale
//     to the same max is 1 without an exponent, and a row whose max is still -inf gives
//     weights 0. With exp2f (not the flush-to-zero MUFU) this is the arithmetic decode was
//     measured with: on an H200 (2026-11-29) the Floor start in decode's kernels ran bf16
//     b=16 kv=512 3.7% slower (12.81 against 12.35 us), though fp8 rows gained up to 5%
//     (docs/history/decode.md).
//   - masked keys are x = -inf: a weight 0, whatever m (finite, or the -inf start's select).
//   - a row whose every key is masked (or that has no key: padding, a sliding window past
//     the request) ends with d = 0; it finalizes to zeros (norm 0) and LSE -inf.
// Lazy rescale: the max moves only when a tile's max exceeds it by more than kLazy. Below
// that, exponents against the old max stay <= 2^kLazy (exact in the 16-bit P of the mma,
// far from float overflow in o and d), so most tiles rescale nothing. The state stays
// exact: o, d and m move together, and LSE = m + log2(d) whatever m is.
// Merging states (split-KV chunks, warps that split a tile) is merge.cuh's rule.
#pragma once
#include <math_constants.h>

#include "common/common.cuh"

namespace fij {

enum class SoftmaxStart { kFloor, kNegInf };

template <SoftmaxStart Start = SoftmaxStart::kFloor>
struct OnlineSoftmax {
  static constexpr bool kFloor = Start == SoftmaxStart::kFloor;
  static constexpr float kNoMax = -1e30f;  // the Floor start's m of a row that has seen no key
  static constexpr float kLazy = 8.f;      // log2 units the running max may trail a row's true max
  float m, d;

  FIJ_DEVICE void init() {
    m = kFloor ? kNoMax : -CUDART_INF_F;
    d = 0.f;
  }
  // Whether a tile whose largest (log2-domain) logit is tile_max must move the max.
  FIJ_DEVICE bool lags(float tile_max) const { return tile_max > m + kLazy; }
  // Moves the max to new_max (>= m) and returns 2^(m_old - new_max), the factor that d
  // and o scale by (1 when it stays).
  FIJ_DEVICE float move_max(float new_max) {
    float scale;
    if constexpr (kFloor) {
      scale = fast_exp2(m - new_max);
    } else {
      scale = new_max > m ? exp2f(m - new_max) : 1.f;  // the first keys: exp2(-inf) = 0
    }
    m = new_max;
    return scale;
  }
  // The weight of a key whose logit is x (log2 domain): 2^(x - m); 0 for x = -inf.
  FIJ_DEVICE float prob(float x) const {
    if constexpr (kFloor) {
      return fast_exp2(x - m);
    } else {
      return m == -CUDART_INF_F ? 0.f : exp2f(x - m);
    }
  }
  // The same for a logit raw x scale not yet scaled (one FMA fused into the exponent).
  FIJ_DEVICE float prob(float raw, float scale) const {
    static_assert(kFloor, "the fused form is the Floor start's");
    return fast_exp2(fmaf(raw, scale, -m));
  }
  // d after a tile: the old sum rescaled, plus the tile's weights.
  FIJ_DEVICE void accumulate(float scale, float tile_sum) { d = d * scale + tile_sum; }
  // An attention sink (a logit, log2 domain, with no value: it joins the denominator
  // only); returns the factor o scales by.
  FIJ_DEVICE float add_sink(float sink) {
    const float top = fmaxf(m, sink);
    const float scale = exp2f(m - top);  // no key (m = kNoMax): 0
    d = d * scale + exp2f(sink - top);
    m = top;
    return scale;
  }
  // Once d holds the row's whole sum: the factor o is multiplied by (v_scale / d; 0 for a
  // row with no key, so it writes zeros) and the row's LSE (-inf for no key).
  // (MUFU's reciprocal and log2: within 2 ulp, far below a 16-bit output's rounding and
  // the merge's needs.)
  FIJ_DEVICE float norm(float v_scale) const { return d > 0.f ? v_scale * fast_rcp(d) : 0.f; }
  FIJ_DEVICE float lse() const { return d > 0.f ? m + fast_log2(d) : -CUDART_INF_F; }
};

}  // namespace fij

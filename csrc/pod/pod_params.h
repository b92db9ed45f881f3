// Parameters of POD (csrc/pod/pod.cuh): each side's own params, and the scheduling counters.
#pragma once
#include "decode/decode_params.h"
#include "prefill/prefill_params.h"

namespace fij {

// POD's scheduling counters, int32 zeros between launches (pod_claim resets them): one a
// possible SM (indexed by %smid modulo kPodSmSlots), then the prefill and decode slot
// counters and the arrival count.
constexpr int kPodSmSlots = 256;
constexpr int kPodCounters = kPodSmSlots + 3;

struct PodParams {
  PrefillParams prefill;
  DecodeParams decode;
  int32_t* counters = nullptr;  // [kPodCounters], zeros
  int32_t prefill_slots = 0;    // P: the prefill launch's grid
  int32_t decode_slots = 0;     // D: decode items x head blocks
  int32_t decode_head_blocks = 0;
};

}  // namespace fij

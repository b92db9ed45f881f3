// Parameters of POD (csrc/pod/pod.cuh): each side's own params, and the scheduling counters.
#pragma once
#include "decode/decode_params.h"
#include "hopper/prefill_sm90_params.h"
#include "prefill/prefill_params.h"

namespace fij {

// POD's scheduling counters, int32 zeros between launches (pod_leave resets them): the
// decode units running on each possible SM (indexed by %smid modulo kPodSmSlots), then the
// prefill and decode unit counters and the arrival count.
constexpr int kPodSmSlots = 256;
constexpr int kPodCounters = kPodSmSlots + 3;

struct PodParams {
  PrefillParams prefill;
  DecodeParams decode;
  int32_t* counters = nullptr;  // [kPodCounters], zeros
  int32_t prefill_slots = 0;    // the prefill launch's grid (0: no prefill side)
  int32_t decode_slots = 0;     // decode items (the plan's grid) x head blocks (0: no decode side)
  int32_t decode_head_blocks = 0;
  int32_t decode_blocks_per_sm = 1;  // decode units a decode SM runs at a time while prefill work remains
  int32_t decode_sms = 0;            // the SMs that run decode units while prefill work remains (0: all)
  int32_t num_sms = 1;
};

// A POD launch as the op resolved it (both sides' launches, the counters and the schedule),
// which the op copies into run()'s `prepared` bytes and <namespace>_pod_fast relaunches with
// new q, K/V, output and LSE addresses (flashinfer_jit/pod/wrapper.py, its fast path).
struct PodLaunch {
  PrefillLaunch prefill;
  DecodeLaunch decode;
  int32_t* counters = nullptr;
  double decode_share = 0.5;
  int32_t decode_sms = 0;
};

// POD on Hopper's launch as its op resolved it (csrc/pod/pod_sm90.cuh): the Hopper prefill
// side's arguments (its TMA maps are encoded at each launch, from these addresses), the decode
// side's launch, the counters and the split. <namespace>_pod_fast relaunches it with new q,
// K/V, output and LSE addresses (run()'s fast path, as PodLaunch's).
struct PodSm90Launch {
  PrefillSm90Args prefill;
  DecodeLaunch decode;
  int32_t* counters = nullptr;
  int32_t prefill_blocks = 0;
  int32_t device = 0;
  int32_t q_from_decode = 0;  // the prefill side had no rows: its q map on the decode side's q rows
};

}  // namespace fij

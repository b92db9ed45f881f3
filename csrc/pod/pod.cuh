// POD: prefill and decode in one launch (flashinfer_jit/pod/, docs/pod.md).
//
// A mixed serving step holds a chunk of some prompt (prefill: tensor-core bound) next to
// many decodes (decode: DRAM bound). Run one after the other, the tensor cores idle during
// the decode and DRAM idles during the prefill. POD's grid holds the blocks of both; each
// block decides when it starts, on the SM it landed on, which kind of work it takes, so
// that every SM keeps both kinds resident and both units busy (the scheme of POD-Attention,
// ASPLOS 2025, that FlashInfer's POD kernel also follows).
//
// The blocks are the families' own block functions, unchanged: prefill_block
// (csrc/prefill/prefill.cuh) for a prefill work item, decode_mma_block
// (csrc/decode/decode_mma.cuh) for a decode (item, head block). Each side's params, work list
// and split merge are exactly its own launch's (resolve_prefill / resolve_decode); POD only
// chooses, block by block, which of the two a block runs.
//
// The choice (pod_claim): the grid has P + D blocks, P prefill slots (the prefill launch's
// grid: block i takes items i, i + P, ...) and D decode slots (items x head blocks). Thread 0
// of a block counts the blocks that started on its SM so far (k) and takes the prefill side
// for k's share P / (P + D), by a Bresenham step: prefill iff floor((k + 1) P / (P + D)) >
// floor(k P / (P + D)); each SM's started blocks split in the ratio of the sides' slots.
// It then takes the side's next slot from that side's counter; a side whose slots are all
// taken hands the block to the other. Every slot runs exactly once: a block fails to get a
// slot of its first side only when all of them are taken, and then the other side has a free
// one (P + D blocks, one slot each).
//
// The counters are left at zero for the next launch without a memset (a CUDA graph replays
// the kernel alone): the last block to claim (an arrival count) resets them; every block has
// claimed by then.
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "common/common.cuh"
#include "decode/decode_mma.cuh"
#include "pod/pod_params.h"
#include "prefill/prefill.cuh"

namespace fij {

FIJ_DEVICE unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// Thread 0's choice for its block: (side, slot); side 0 = prefill, 1 = decode.
FIJ_DEVICE int2 pod_claim(const PodParams& p) {
  int32_t* const per_sm = p.counters;
  int32_t* const next = p.counters + kPodSmSlots;  // [0] prefill, [1] decode
  int32_t* const arrived = p.counters + kPodSmSlots + 2;
  const int64_t P = p.prefill_slots, D = p.decode_slots, total = P + D;
  const int64_t k = atomicAdd(per_sm + sm_id() % kPodSmSlots, 1);
  int side = ((k + 1) * P / total > k * P / total) ? 0 : 1;
  int slot = atomicAdd(next + side, 1);
  if (slot >= (side == 0 ? P : D)) {  // this side's slots are all taken: the other side's
    side ^= 1;
    slot = atomicAdd(next + side, 1);
  }
  __threadfence();  // the claims above before the arrival below
  if (atomicAdd(arrived, 1) == total - 1) {
    // The last block to claim: every block has claimed. Reset for the next launch.
    for (int i = 0; i < kPodCounters; ++i) atomicExch(p.counters + i, 0);
  }
  return make_int2(side, slot);
}

template <class PrefillT, bool WarpPagesOnly, bool NoWindow, class DecodeT>
__global__ void __launch_bounds__(PrefillT::kThreads, (PrefillT::kMinBlocksPerSM < DecodeT::kMinBlocksPerSM
                                                           ? PrefillT::kMinBlocksPerSM
                                                           : DecodeT::kMinBlocksPerSM))
    pod_kernel(const __grid_constant__ PodParams p) {
  static_assert(PrefillT::kThreads == DecodeT::kThreads, "POD: both sides' blocks have the same threads");
  static_assert(DecodeT::kCluster == 1, "POD: decode blocks without clusters");
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int2 claim;
  // Only after the kernel before (programmatic launch): q, K/V and the outputs, and the
  // counters, which the POD launch before this one (the next layer's, say) resets.
  pdl_wait();
  if (threadIdx.x == 0) claim = pod_claim(p);
  __syncthreads();
  const int2 c = claim;
  if (c.x == 0) {
    const int items = p.prefill.work[0];
    for (int i = c.y; i < items; i += p.prefill_slots) {
      prefill_block<PrefillT, WarpPagesOnly, NoWindow>(p.prefill, i, smem);
      __syncthreads();
    }
  } else {
    decode_mma_block<DecodeT>(p.decode, c.y / p.decode_head_blocks, c.y % p.decode_head_blocks,
                              p.decode_head_blocks, smem, InsideLaunch{});
  }
  pdl_trigger();
}

template <class PrefillT, class DecodeT>
constexpr int pod_smem_bytes() {
  return PrefillT::kSmemBytes > DecodeT::kSmemBytes ? PrefillT::kSmemBytes : DecodeT::kSmemBytes;
}

// One POD launch: the fused kernel, then a side's merge kernel where its split rows are not
// merged in the kernel (merge.num_rows > 0). The prefill grid of 0 items or a decode of no
// blocks leaves the other side alone in the grid.
template <class PrefillT, class DecodeT, class O>
int launch_pod(const PrefillLaunch& lp, const DecodeLaunch& ld, int32_t* counters, cudaStream_t stream, bool pdl) {
  PodParams p;
  p.prefill = lp.params;
  p.decode = ld.params;
  p.decode.dependent_launch = 0;
  p.counters = counters;
  p.prefill_slots = lp.grid > 0 ? lp.grid : 0;
  p.decode_head_blocks = ld.num_kv_heads * (ld.params.group / DecodeT::kTileHeads);
  p.decode_slots = ld.grid_items > 0 ? ld.grid_items * p.decode_head_blocks : 0;
  const int blocks = p.prefill_slots + p.decode_slots;
  if (blocks > 0) {
    constexpr int smem = pod_smem_bytes<PrefillT, DecodeT>();
    const int err = with_prefill_variant<PrefillT>(p.prefill, [&](auto warp_pages, auto no_window) {
      constexpr bool kWarpPages = decltype(warp_pages)::value, kNoWindow = decltype(no_window)::value;
      if (const int e = allow_dynamic_smem<pod_kernel<PrefillT, kWarpPages, kNoWindow, DecodeT>>(smem)) return e;
      return launch_kernel(pod_kernel<PrefillT, kWarpPages, kNoWindow, DecodeT>, dim3(blocks),
                           dim3(PrefillT::kThreads), smem, stream, pdl, p);
    });
    if (err != 0) return err;
  }
  if (lp.merge.num_rows > 0) {
    if (const int err = launch_merge_splits<O>(lp.merge, stream, pdl)) return err;
  }
  if (ld.merge.num_rows > 0) return launch_merge_splits<O>(ld.merge, stream, pdl);
  return 0;
}

}  // namespace fij

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
// The schedule (pod_claim): the grid is persistent, one wave (the blocks an SM holds x the
// SMs, fewer for a small launch), and every block loops: it takes a unit of work, runs it,
// takes the next. Units are prefill work items (the prefill plan's list, heaviest first)
// and decode (item, head block) pairs, each taken once from its side's counter. Which side
// a block takes is decided per SM, at each take: the decode side while this SM runs fewer
// than decode_blocks_per_sm decode units (counted per SM: up at a take, down when the unit
// ends), else the prefill side; a side with nothing left hands the block to the other. So
// each SM holds a fixed number of decode blocks streaming K/V (DRAM bound: a block or two
// an SM keep enough bytes in flight) and its other blocks run prefill tiles (tensor-core
// bound) for as long as both sides have work; the side that runs out first leaves the
// whole GPU to the other. decode_blocks_per_sm is the host's decode share of each launch (from
// the two sides' estimated times: flashinfer_jit/pod/wrapper.py) of the blocks an SM holds.
//
// FlashInfer's POD (and this kernel before) assigned each block, once, a side in the ratio of
// the two sides' block counts; blocks of the two sides last different times, so an SM's mix
// of resident blocks drifted with the batch, and a long prefill could crowd the decodes out.
//
// The counters are left at zero for the next launch without a memset (a CUDA graph replays
// the kernel alone): the last block to find no work left (an arrival count) resets them;
// every block has taken its last unit by then.
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

// Thread 0's next unit: (side, index), side 0 = prefill, 1 = decode, -1 = no work left.
// prev_side: the side of the unit this block just ran (-1 at the start). P and D: the sides'
// unit counts.
FIJ_DEVICE int2 pod_claim(const PodParams& p, int32_t* resident, int cap, int prev_side, int P, int D) {
  int32_t* const next = p.counters + kPodSmSlots;  // [0] prefill, [1] decode
  if (prev_side == 1) atomicSub(resident, 1);
  if (D > 0 && atomicAdd(resident, 1) < cap) {
    const int s = atomicAdd(next + 1, 1);
    if (s < D) return make_int2(1, s);
  }
  if (D > 0) atomicSub(resident, 1);
  if (P > 0) {
    const int s = atomicAdd(next, 1);
    if (s < P) return make_int2(0, s);
  }
  if (D > 0) {  // the prefill side has nothing left: decodes past this SM's share
    const int s = atomicAdd(next + 1, 1);
    if (s < D) {
      atomicAdd(resident, 1);
      return make_int2(1, s);
    }
  }
  return make_int2(-1, 0);
}

// The block found no work left: the last one to (every block has taken its last unit)
// resets the counters for the next launch.
FIJ_DEVICE void pod_leave(const PodParams& p) {
  int32_t* const arrived = p.counters + kPodSmSlots + 2;
  __threadfence();  // this block's claims before its arrival
  if (atomicAdd(arrived, 1) == static_cast<int>(gridDim.x) - 1) {
    for (int i = 0; i < kPodCounters; ++i) atomicExch(p.counters + i, 0);
  }
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
  // Only after the kernel before (programmatic launch): q, K/V and the outputs, the work
  // lists' counts (a CUDA graph's plan writes them before each replay), and the counters,
  // which the POD launch before this one (the next layer's, say) resets.
  pdl_wait();
  // Units of each side, from the plans' work lists (a CUDA graph's grid outlives its plan)
  const int P = p.prefill_slots > 0 ? p.prefill.work[0] : 0;
  const int D = p.decode_slots > 0 ? p.decode.work[0] * p.decode_head_blocks : 0;
  const int sm = static_cast<int>(sm_id());
  int32_t* const resident = p.counters + sm % kPodSmSlots;
  // This SM's decode units at a time: decode_blocks_per_sm on the decode SMs (decode_sms of
  // them, spread over the SM ids by a Bresenham step), none on the others.
  const int64_t k = p.decode_sms, n = p.num_sms;
  const bool decode_sm = k <= 0 || k >= n || ((sm + 1) * k / n > sm * k / n);
  const int cap = decode_sm ? p.decode_blocks_per_sm : 0;
  int side = -1;
  for (;;) {
    if (threadIdx.x == 0) {
      claim = pod_claim(p, resident, cap, side, P, D);
      if (claim.x < 0) pod_leave(p);
    }
    __syncthreads();
    const int2 c = claim;
    if (c.x < 0) break;
    side = c.x;
    // (the shared memory's address through an empty asm: what the units derive from it is
    // computed in the iteration, not hoisted out of the loop to stay live across both)
    unsigned char* unit_smem = smem;
    asm volatile("" : "+l"(unit_smem));
    if (c.x == 0) {
      prefill_block<PrefillT, WarpPagesOnly, NoWindow>(p.prefill, c.y, unit_smem);
    } else {
      decode_mma_block<DecodeT>(p.decode, c.y / p.decode_head_blocks, c.y % p.decode_head_blocks,
                                p.decode_head_blocks, unit_smem, InsideLaunch{});
    }
    __syncthreads();  // the unit's shared memory and `claim` read by every thread before the next
  }
  pdl_trigger();
}

template <class PrefillT, class DecodeT>
constexpr int pod_smem_bytes() {
  return PrefillT::kSmemBytes > DecodeT::kSmemBytes ? PrefillT::kSmemBytes : DecodeT::kSmemBytes;
}

// Blocks of a POD kernel an SM holds (its registers and shared memory), once per device.
template <auto* Kernel>
inline int pod_blocks_per_sm(int threads, int smem) {
  static int cached[64] = {0};
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= 64) device = 0;
  if (cached[device] == 0) {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, threads, smem) != cudaSuccess) {
      (void)cudaGetLastError();
      n = 1;
    }
    cached[device] = n > 0 ? n : 1;
  }
  return cached[device];
}

// One POD launch: the fused kernel, then a side's merge kernel where its split rows are not
// merged in the kernel (merge.num_rows > 0). A prefill of 0 items or a decode of no blocks
// leaves the other side the whole grid. decode_share: the share of an SM's blocks (B) that
// run decode units while both sides have work: round(decode_share B), at least 1 and at most
// B - 1; 0 or less: none (the prefill first, then the decodes), 1 or more: B (decodes first).
// decode_sms > 0: only that many SMs run decode units (their share of blocks each) while the
// prefill has work; the others run prefill tiles only (0: every SM).
template <class PrefillT, class DecodeT, class O>
int launch_pod(const PrefillLaunch& lp, const DecodeLaunch& ld, int32_t* counters, double decode_share,
               int decode_sms, cudaStream_t stream, bool pdl) {
  PodParams p;
  p.prefill = lp.params;
  p.decode = ld.params;
  p.decode.dependent_launch = 0;
  p.counters = counters;
  p.prefill_slots = lp.grid > 0 ? lp.grid : 0;
  p.decode_head_blocks = ld.num_kv_heads * (ld.params.group / DecodeT::kTileHeads);
  p.decode_slots = ld.grid_items > 0 ? ld.grid_items * p.decode_head_blocks : 0;
  p.num_sms = num_sms();
  p.decode_sms = decode_sms;
  const int64_t units = int64_t(p.prefill_slots) + p.decode_slots;  // the most a launch can have
  if (units > 0) {
    constexpr int smem = pod_smem_bytes<PrefillT, DecodeT>();
    const int err = with_prefill_variant<PrefillT>(p.prefill, [&](auto warp_pages, auto no_window) {
      constexpr bool kWarpPages = decltype(warp_pages)::value, kNoWindow = decltype(no_window)::value;
      if (const int e = allow_dynamic_smem<pod_kernel<PrefillT, kWarpPages, kNoWindow, DecodeT>>(smem)) return e;
      const int per_sm =
          pod_blocks_per_sm<pod_kernel<PrefillT, kWarpPages, kNoWindow, DecodeT>>(PrefillT::kThreads, smem);
      const int wave = per_sm * num_sms();
      if (decode_share <= 0.0) {
        p.decode_blocks_per_sm = 0;
      } else if (decode_share >= 1.0) {
        p.decode_blocks_per_sm = per_sm;
      } else {
        const int r = static_cast<int>(decode_share * per_sm + 0.5);
        p.decode_blocks_per_sm = r < 1 ? 1 : (r > per_sm - 1 ? (per_sm > 1 ? per_sm - 1 : 1) : r);
      }
      const int blocks = static_cast<int>(units < wave ? units : wave);
      return launch_kernel(pod_kernel<PrefillT, kWarpPages, kNoWindow, DecodeT>, dim3(blocks), dim3(PrefillT::kThreads), smem, stream, pdl, p);
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

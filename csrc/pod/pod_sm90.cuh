// POD on Hopper: the Hopper prefill kernel's blocks (csrc/hopper/prefill_sm90.cuh) and the
// tensor-core decode blocks (csrc/decode/decode_mma.cuh) in one launch (flashinfer_jit/pod/,
// docs/pod.md).
//
// The Hopper prefill block owns its SM: 384 threads (a producer and two consumer warpgroups)
// at 168 registers each (240 a consumer after setmaxnreg) and most of the shared memory, so no
// decode block can sit beside it, and POD's mma.sync scheme (csrc/pod/pod.cuh: decode and
// prefill blocks resident on every SM at once) does not apply. What does: the decode side is
// DRAM bound and reaches most of the bandwidth from part of the SMs, while the prefill side
// scales with the SMs it gets. So the SMs split, and the split moves:
//   - the grid is one block an SM, all of the same shape (384 threads);
//   - blocks [0, prefill_blocks) start on prefill items (block b on item b, then the prefill
//     counter), exactly as the prefill kernel's blocks do;
//   - the other blocks start on decode units: each warpgroup is a "virtual" decode block of
//     128 threads (WarpgroupLaunch: its own named barrier), so a block runs three decode
//     units at a time, taken from the decode counter one after the other;
//   - a block whose decode units are all taken joins the prefill side (its items from the
//     counter), so the decode side's SMs come back to the prefill as it ends. The blocks that
//     start on prefill do not take decode units afterwards: they would have to hand their
//     setmaxnreg registers back first. plan() therefore gives the decode side at least the
//     SMs it needs (flashinfer_jit/pod/wrapper.py), and the decode side's late blocks catch
//     up with the prefill's tail.
// Counters (int32 zeros between launches, POD's counter buffer): [0] prefill items taken past
// the first ones, [1] blocks done with the prefill side, [2] decode units taken. Every block
// runs the prefill side once, last, so the last block to arrive there resets all three.
#pragma once
#include <cuda_runtime.h>

#include "common/common.cuh"
#include "common/merge.cuh"
#include "decode/decode_mma.cuh"
#include "hopper/prefill_sm90.cuh"

namespace fij {

// Stage bytes of each of a block's three decode units: 64 KB (the decode kernel's blocks take
// 48 KB, four an SM; three units of 48 KB would keep a quarter fewer bytes in flight an SM).
constexpr int kPodSm90DecodeStages = 64 * 1024;

struct PodSm90Params {
  PrefillSm90Params prefill;  // its counters: POD's [0] and [1]
  DecodeParams decode;
  int32_t* decode_next = nullptr;  // POD's counter [2]
  int32_t prefill_blocks = 0;      // blocks that start on prefill items (with decode units; else all)
  int32_t decode_slots = 0;        // decode items (the plan's grid) x head blocks (0: no decode side)
  int32_t decode_head_blocks = 0;
};

template <class DecodeT>
constexpr int pod_sm90_decode_smem() {  // one virtual decode block's shared memory, 1 KB aligned
  return (DecodeT::kSmemBytes + 1023) / 1024 * 1024;
}

template <typename DType, int kD, bool kCausal, int kN, bool kPaged, int kM, class DecodeT>
__global__ void __launch_bounds__(128 * (1 + kM / 64), 1) pod_sm90_kernel(const __grid_constant__ PodSm90Params p) {
  static_assert(DecodeT::kThreads == 128 && DecodeT::kCluster == 1,
                "POD on Hopper: 128-thread decode blocks without clusters, one a warpgroup");
  constexpr int kWarpgroups = 1 + kM / 64;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ int claim[kWarpgroups];
  // (the item count from the plan's list on the device: a CUDA graph's plan rewrites it)
  const int units = p.decode_slots > 0 ? p.decode.work[0] * p.decode_head_blocks : 0;
  const int first_blocks = units > 0 ? p.prefill_blocks : static_cast<int>(gridDim.x);
  const bool decode_first = static_cast<int>(blockIdx.x) >= first_blocks;
  if (decode_first) {
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    // named barriers 8.. (the prefill block's are 1..12, used after this loop)
    const WarpgroupLaunch launch{wg, 8 + wg};
    unsigned char* unit_smem = sm90::align_1024(smem_raw) + wg * pod_sm90_decode_smem<DecodeT>();
    for (;;) {
      if (t == 0) claim[wg] = atomicAdd(p.decode_next, 1);
      launch.sync();
      const int u = claim[wg];
      if (u >= units) break;
      decode_mma_block<DecodeT>(p.decode, u / p.decode_head_blocks, u % p.decode_head_blocks, p.decode_head_blocks,
                                unit_smem, launch);
      launch.sync();  // the unit's shared memory and `claim` read by every thread before the next
    }
    sm90::fence_proxy_async();  // the units' shared-memory writes before the prefill side's TMA writes
    __syncthreads();
  }
  // (no stale row max on this side: Sm90Kernel's kStaleMax)
  prefill_sm90_block<DType, kD, kCausal, kN, kPaged, false, kM, false, false, false>(
      p.prefill, smem_raw, Sm90Schedule{decode_first ? -1 : static_cast<int>(blockIdx.x), first_blocks, p.decode_next});
}

// One launch on every SM (one block each); then the decode side's merge kernel where its split
// rows are not merged in the kernel. prefill: the Hopper prefill params (make_params); its
// counters are replaced by POD's (three int32 zeros). prefill_blocks: the blocks that start on
// prefill items while decode units remain (the planned split).
template <typename DType, int kD, bool kCausal, int kN, bool kPaged, int kM, class DecodeT, class O>
int launch_pod_sm90(const PrefillSm90Params& prefill, const DecodeLaunch& ld, int32_t* counters, int prefill_blocks,
                    cudaStream_t stream) {
  using K = sm90_prefill::Sm90Kernel<DType, kD, kCausal, kN, false, kM, false>;
  constexpr int kDecodeBytes = (1 + kM / 64) * pod_sm90_decode_smem<DecodeT>() + 1024;
  constexpr int kSmem = K::kSmemBytes > kDecodeBytes ? K::kSmemBytes : kDecodeBytes;
  static_assert(kSmem <= 227 * 1024, "POD on Hopper: the prefill block's or the decode blocks' shared memory");
  PodSm90Params p;
  p.prefill = prefill;
  p.prefill.counters = counters;
  p.decode = ld.params;
  p.decode.dependent_launch = 0;
  p.decode_next = counters + 2;
  p.decode_head_blocks = ld.num_kv_heads * (ld.params.group / DecodeT::kTileHeads);
  p.decode_slots = ld.grid_items > 0 ? ld.grid_items * p.decode_head_blocks : 0;
  const int sms = num_sms();
  p.prefill_blocks = prefill_blocks < 0 ? 0 : (prefill_blocks > sms ? sms : prefill_blocks);
  constexpr auto kernel = pod_sm90_kernel<DType, kD, kCausal, kN, kPaged, kM, DecodeT>;
  if (const int err = allow_dynamic_smem<kernel>(kSmem)) return err;
  kernel<<<sms, K::kThreads, kSmem, stream>>>(p);
  if (const int err = static_cast<int>(cudaGetLastError())) return err;
  if (ld.merge.num_rows > 0) return launch_merge_splits<O>(ld.merge, stream, false);
  return 0;
}

}  // namespace fij

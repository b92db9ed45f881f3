// Host side of TMA: a CUtensorMap for a 2-D to 4-D tile of a tensor (16-bit, or 8-bit for FP8), encoded through
// the driver's cuTensorMapEncodeTiled reached from the runtime (cudaGetDriverEntryPointByVersion),
// so a module links no libcuda of its own. The map is passed to the kernel by value as a
// `const __grid_constant__ CUtensorMap` parameter.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fij::sm90 {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                                             &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr)
      throw std::runtime_error("cuTensorMapEncodeTiled: not found in the CUDA driver (needs a 12.0+ driver)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// dims / strides: innermost first; strides in bytes for dims 1.. (dim 0 is contiguous);
// box: the tile's extent per dim (box[0] x the element's bytes = 128 for the 128B swizzle).
// Elements outside the tensor read as zeros.
inline CUtensorMap tensor_map(const void* base, int rank, const uint64_t* dims, const uint64_t* strides_bytes,
                              const uint32_t* box, CUtensorMapDataType type, CUtensorMapSwizzle swizzle) {
  CUtensorMap map{};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, type, static_cast<cuuint32_t>(rank), const_cast<void*>(base), reinterpret_cast<const cuuint64_t*>(dims),
      reinterpret_cast<const cuuint64_t*>(strides_bytes), reinterpret_cast<const cuuint32_t*>(box), element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("cuTensorMapEncodeTiled failed (CUresult " + std::to_string(static_cast<int>(r)) +
                             "): a base not 16-byte aligned, a stride not a multiple of 16, or a box over 256");
  return map;
}
// A 16-bit tensor's map (bf16 or fp16).
inline CUtensorMap tensor_map_16bit(const void* base, int rank, const uint64_t* dims, const uint64_t* strides_bytes,
                                    const uint32_t* box, bool bf16, CUtensorMapSwizzle swizzle) {
  return tensor_map(base, rank, dims, strides_bytes, box,
                    bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, swizzle);
}

}  // namespace fij::sm90

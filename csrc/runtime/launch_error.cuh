// Defines fij::launch_error_string for the binding; included once per module by its
// kernel translation unit (the binding itself includes no CUDA header).
#pragma once
#include <cuda_runtime.h>

namespace fij {
const char* launch_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
}  // namespace fij

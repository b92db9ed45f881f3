// What the standalone Hopper probes share (tests/hopper/*.cu): the CUDA error check of
// their main()s.
#pragma once
#include <cstdio>

#include <cuda_runtime.h>

// Prints the error and returns 2 from the calling function (main or a step of it).
#define CHECK_CUDA(x)                                                                     \
  do {                                                                                    \
    cudaError_t e = (x);                                                                  \
    if (e != cudaSuccess) {                                                               \
      std::printf("cuda_error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      return 2;                                                                           \
    }                                                                                     \
  } while (0)

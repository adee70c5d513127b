// SPDX-License-Identifier: Apache-2.0
// WB_HD marks functions compiled for both the host and CUDA devices: under nvcc they are
// __host__ __device__, under the host compiler plain inline functions. The device kernels
// (core/cuda/kernels.cu) and the host tests (tests/device_kernels_test.cc) run the same code.
#pragma once

#if defined(__CUDACC__)
#define WB_HD __host__ __device__ __forceinline__
#else
#define WB_HD inline
#endif

// Unrolls the loop that follows in device code (its arrays then live in registers).
#if defined(__CUDA_ARCH__)
#define WB_UNROLL _Pragma("unroll")
#else
#define WB_UNROLL
#endif

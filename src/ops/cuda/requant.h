// Load-time FP8 block -> MXFP4 re-quantization on the GPU (issue 18; SYSTEM.md S1): the
// device twin of model/quant.h's requantize_fp8_to_mxfp4, byte for byte. Per group of 32
// values of a row: each value e4m3 * its 128x128 block scale, exact in f64 (4 x 24
// significant bits); the OCP scale exponent floor(log2(amax)) - 2 clamped to [-127, 127] (0
// for an all-zero group); each value times 2^-e to e2m1 by the CPU's threshold comparisons
// (round half to even), the sign kept for -0. A NaN code or a non-finite block scale is an
// error naming the first such element (the group's values are taken as 0 meanwhile).
//
// CudaBackend uses it for CudaRunnerOptions base.experts_to_mxfp4: each routed expert's FP8
// matrix is uploaded, re-quantized and freed before the next, so the device holds at most
// one FP8 matrix beyond the result.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/status.h"
#include "ops/cuda/linear.h"

namespace ml4::cuda {

// fp8 (kFP8Block, K % 32 == 0) -> a new MXFP4 DeviceLinear (its scale buffer as upload_linear
// lays it out). Synchronizes the stream to read the error flag.
Result<DeviceLinear> requantize_fp8_to_mxfp4_device(const DeviceLinear& fp8, cudaStream_t stream);

}  // namespace ml4::cuda

// See linear.h.
#include "ops/cuda/linear.h"

#include "ops/cpu/linear.h"
#include "ops/cuda/act_quant.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemv.h"

#include <algorithm>

namespace ml4::cuda {

Result<DeviceLinear> upload_linear(const LinearWeight& w) {
  ML4_RETURN_IF_ERROR(cpu::validate_linear_weight(w).with_context(w.name));
  DeviceLinear d;
  d.name = w.name;
  d.format = w.format;
  d.N = w.out_features;
  d.K = w.in_features;
  switch (w.format) {
    case LinearFormat::kF32:
    case LinearFormat::kBF16:
      break;
    case LinearFormat::kFP8Block:
      if (d.K % 128 != 0 || d.N % 16 != 0)
        return unimplemented("{}: FP8 block GEMM needs K % 128 == 0 and N % 16 == 0 (N={}, K={})", w.name, d.N, d.K);
      break;
    case LinearFormat::kNVFP4:
    case LinearFormat::kMXFP4:
      return unimplemented("{}: {} weights are not supported by the CUDA backend yet", w.name,
                           linear_format_name(w.format));
  }
  ML4_ASSIGN_OR_RETURN(d.weight, DeviceBuffer::alloc(w.weight.nbytes()));
  ML4_RETURN_IF_ERROR(d.weight.upload(w.weight.data(), w.weight.nbytes()));
  if (w.format == LinearFormat::kFP8Block) {
    ML4_ASSIGN_OR_RETURN(d.scale, DeviceBuffer::alloc(w.scale.nbytes()));
    ML4_RETURN_IF_ERROR(d.scale.upload(w.scale.data(), w.scale.nbytes()));
  }
  return d;
}

Status LinearScratch::reserve(int64_t elems, int64_t groups) {
  const size_t ab = static_cast<size_t>(elems) * 2, sb = static_cast<size_t>(groups) * 4;
  if (act.bytes() < ab) {
    ML4_ASSIGN_OR_RETURN(act, DeviceBuffer::alloc(ab));
  }
  if (scale.bytes() < sb) {
    ML4_ASSIGN_OR_RETURN(scale, DeviceBuffer::alloc(sb));
  }
  if (out.bytes() < ab) {
    ML4_ASSIGN_OR_RETURN(out, DeviceBuffer::alloc(ab));
  }
  return Status::ok();
}

Status linear_f32(LtGemm& lt, const DeviceLinear& w, const float* x, int64_t M, float* y, LinearScratch& scratch,
                  cudaStream_t stream) {
  if (M == 0) return Status::ok();
  switch (w.format) {
    case LinearFormat::kF32:
      return lt.f32({x, w.weight.as<float>(), y, M, w.N, w.K, stream});
    case LinearFormat::kBF16: {
      if (scratch.act.bytes() < static_cast<size_t>(M * w.K) * 2)
        return out_of_range("{}: linear scratch holds {} bytes, needs {}", w.name, scratch.act.bytes(), M * w.K * 2);
      ML4_RETURN_IF_ERROR(cast_f32_bf16(x, M * w.K, scratch.act.data(), stream));
      return lt.bf16({scratch.act.data(), w.weight.data(), y, DType::kF32, M, w.N, w.K, stream});
    }
    case LinearFormat::kFP8Block: {
      // Our GEMV in 8-row chunks (f32 activations; tested exact against cpu::linear). The
      // cuBLASLt FP8 block path (LtGemm::fp8_block) is not used here: on the H200 it
      // returned non-finite output for a small decode shape and refused others (M=5,
      // N=384, K=256), so it stays behind its own failing test until that is understood.
      for (int64_t m0 = 0; m0 < M; m0 += kGemvMaxM) {
        const int64_t m = std::min<int64_t>(kGemvMaxM, M - m0);
        ML4_RETURN_IF_ERROR(gemv({x + m0 * w.K, m, w.N, w.K, w.format, w.weight.data(), w.scale.as<float>(),
                                  y + m0 * w.N, nullptr, stream}));
      }
      return Status::ok();
    }
    case LinearFormat::kNVFP4:
    case LinearFormat::kMXFP4:
      break;
  }
  return unimplemented("{}: format {} on the GPU", w.name, linear_format_name(w.format));
}

}  // namespace ml4::cuda

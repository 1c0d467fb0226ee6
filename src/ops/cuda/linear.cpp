// See linear.h.
#include "ops/cuda/linear.h"

#include "ops/cpu/linear.h"
#include "ops/cuda/act_quant.h"
#include "ops/cuda/elementwise.h"

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
      const int64_t G = w.K / 128;
      if (scratch.act.bytes() < static_cast<size_t>(M * w.K) || scratch.scale.bytes() < static_cast<size_t>(M * G) * 4)
        return out_of_range("{}: linear scratch too small for M={} K={}", w.name, M, w.K);
      ML4_RETURN_IF_ERROR(fp8_act_quant({x, DType::kF32, 0, M, w.K, 128, scratch.act.data(), scratch.scale.as<float>(),
                                         ScaleLayout::kGroupMajor, stream}));
      GemmFp8BlockParams g{scratch.act.data(), scratch.scale.as<float>(), w.weight.data(), w.scale.as<float>(), y,
                           DType::kF32, M, w.N, w.K, stream};
      Status st = lt.fp8_block(g);
      if (st.code() != StatusCode::kUnimplemented) return st;
      // No f32-output kernel for this shape: bf16 output, widened after (one more rounding).
      if (scratch.out.bytes() < static_cast<size_t>(M * w.N) * 2)
        return out_of_range("{}: linear scratch too small for a bf16 output of {}x{}", w.name, M, w.N);
      g.y = scratch.out.data();
      g.y_dtype = DType::kBF16;
      ML4_RETURN_IF_ERROR(lt.fp8_block(g));
      return cast_bf16_f32(scratch.out.data(), M * w.N, y, stream);
    }
    case LinearFormat::kNVFP4:
    case LinearFormat::kMXFP4:
      break;
  }
  return unimplemented("{}: format {} on the GPU", w.name, linear_format_name(w.format));
}

}  // namespace ml4::cuda

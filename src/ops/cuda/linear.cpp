// See linear.h.
#include "ops/cuda/linear.h"

#include "ops/cpu/linear.h"
#include "ops/cuda/act_quant.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/gemv.h"

#include <algorithm>
#include <vector>

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
      if (d.K % 32 != 0) return unimplemented("{}: {} on the GPU needs K % 32 == 0 (K={})", w.name,
                                              linear_format_name(w.format), d.K);
      break;
  }
  ML4_ASSIGN_OR_RETURN(d.weight, DeviceBuffer::alloc(w.weight.nbytes()));
  ML4_RETURN_IF_ERROR(d.weight.upload(w.weight.data(), w.weight.nbytes()));
  if (w.format == LinearFormat::kNVFP4 || w.format == LinearFormat::kMXFP4) {
    // The scale bytes as stored; NVFP4's global scale after them (gemv.h fp4_global_offset).
    const bool nv = w.format == LinearFormat::kNVFP4;
    const size_t sb = w.scale.nbytes(), total = nv ? static_cast<size_t>(fp4_global_offset(d.N, d.K)) + 16 : sb;
    ML4_ASSIGN_OR_RETURN(d.scale, DeviceBuffer::alloc(total));
    ML4_RETURN_IF_ERROR(d.scale.upload(w.scale.data(), sb));
    if (nv) ML4_RETURN_IF_ERROR(d.scale.upload(&w.global_scale, 4, static_cast<size_t>(fp4_global_offset(d.N, d.K))));
    return d;
  }
  if (w.format == LinearFormat::kFP8Block) {
    ML4_ASSIGN_OR_RETURN(d.scale, DeviceBuffer::alloc(w.scale.nbytes()));
    ML4_RETURN_IF_ERROR(d.scale.upload(w.scale.data(), w.scale.nbytes()));
    const int64_t nb = (d.N + 127) / 128, kb = d.K / 128, kb4 = (kb + 3) / 4 * 4;
    if (kb4 != kb) {  // cuBLASLt's BLK128x128 layout pads each row of scales to 4 (gemm.h)
      if (static_cast<int64_t>(w.scale.nbytes()) != nb * kb * 4)
        return invalid_argument("{}: FP8 scales hold {} bytes, expected {}", w.name, w.scale.nbytes(), nb * kb * 4);
      const float* src = static_cast<const float*>(w.scale.data());
      std::vector<float> padded(nb * kb4, 0.0f);
      for (int64_t r = 0; r < nb; ++r) std::copy(src + r * kb, src + (r + 1) * kb, padded.begin() + r * kb4);
      ML4_ASSIGN_OR_RETURN(d.scale_lt, DeviceBuffer::alloc(padded.size() * 4));
      ML4_RETURN_IF_ERROR(d.scale_lt.upload(padded.data(), padded.size() * 4));
    }
  }
  return d;
}

Status LinearScratch::reserve(int64_t elems, int64_t groups) {
  const size_t ab = static_cast<size_t>(elems) * 2, sb = (static_cast<size_t>(groups) * 3 / 2 + 64) * 4;
  if (act.bytes() < ab) {
    ML4_ASSIGN_OR_RETURN(act, DeviceBuffer::alloc(ab));
  }
  if (scale.bytes() < sb) {
    ML4_ASSIGN_OR_RETURN(scale, DeviceBuffer::alloc(sb));
  }
  if (out.bytes() < ab) {
    ML4_ASSIGN_OR_RETURN(out, DeviceBuffer::alloc(ab));
  }
  return ok_status();
}

Status linear_f32(LtGemm& lt, const DeviceLinear& w, const float* x, int64_t M, float* y, LinearScratch& scratch,
                  cudaStream_t stream) {
  if (M == 0) return ok_status();
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
      if (M <= kGemvMaxM) {  // decode: our GEMV on f32 x (exact activations, a pure weight stream)
        return gemv({x, M, w.N, w.K, w.format, w.weight.data(), w.scale.as<float>(), y, nullptr, stream});
      }
      // Prefill: per-1x128 activation quantization, rows padded to a multiple of 4 (zero
      // rows) so that cuBLASLt can take any M (gemm.h), then the FP8 block GEMM.
      const int64_t m_pad = (M + 3) / 4 * 4, kb = w.K / 128;
      if (scratch.act.bytes() < static_cast<size_t>(m_pad * w.K) ||
          scratch.scale.bytes() < static_cast<size_t>(m_pad * kb) * 4)
        return out_of_range("{}: linear scratch holds {} + {} bytes, FP8 needs {} + {}", w.name, scratch.act.bytes(),
                            scratch.scale.bytes(), m_pad * w.K, m_pad * kb * 4);
      Fp8ActQuantParams q;
      q.x = x;
      q.x_dtype = DType::kF32;
      q.M = M;
      q.K = w.K;
      q.group = 128;
      q.q = scratch.act.data();
      q.scale = scratch.scale.as<float>();
      q.scale_layout = ScaleLayout::kGroupMajor;
      q.stream = stream;
      q.rows_out = m_pad;
      ML4_RETURN_IF_ERROR(fp8_act_quant(q));
      GemmFp8BlockParams g{scratch.act.data(), scratch.scale.as<float>(), w.weight.data(), w.gemm_scale(), y,
                           DType::kF32, M, w.N, w.K, stream};
      g.m_pad = m_pad;
      g.w_scale_ld = w.gemm_scale_ld();
      return lt.fp8_block(g);
    }
    case LinearFormat::kNVFP4:
    case LinearFormat::kMXFP4:  // the FP4 weight stream at any M (prefill in passes of 8 tokens for now)
      return gemv({x, M, w.N, w.K, w.format, w.weight.data(), w.scale.as<float>(), y, nullptr, stream});
  }
  return unimplemented("{}: format {} on the GPU", w.name, linear_format_name(w.format));
}

}  // namespace ml4::cuda

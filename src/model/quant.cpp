// Weight formats: validation, quantizers, exact dequantization. See quant.h for the recipes.
//
// MXFP4 quantization works on f64 values so that FP8 -> MXFP4 re-quantization sees each
// FP8 weight's exact value (e4m3 x f32 scale needs 28 significant bits, more than f32
// holds); f32 input converts to f64 exactly, so both paths share one routine.
#include "model/quant.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>

#include <fmt/format.h>

#include "core/threads.h"

namespace ml4 {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string dtypes_str(std::initializer_list<DType> ds) {
  std::string s;
  for (DType d : ds) {
    if (!s.empty()) s += " or ";
    s += dtype_name(d);
  }
  return s;
}

// "tensor <name>[ scale]: expected [a, b] dt, found [c, d] dt".
Status check_tensor(const std::string& name, const char* role, const Tensor& t, const Shape& shape,
                    std::initializer_list<DType> dtypes) {
  bool dtype_ok = std::find(dtypes.begin(), dtypes.end(), t.dtype()) != dtypes.end();
  std::string found = t.empty() ? std::string("no tensor") : t.describe();
  if (t.empty() || !dtype_ok || t.shape() != shape) {
    return invalid_argument("tensor {}{}: expected {} {}, found {}", name, role, shape_str(shape), dtypes_str(dtypes),
                            found);
  }
  return ok_status();
}

// A view of `t`'s bytes under another dtype; the copy of `t` held as keepalive owns them.
Tensor retag(const Tensor& t, DType d) {
  if (t.dtype() == d || t.empty()) return t;
  auto hold = std::make_shared<const Tensor>(t);
  return Tensor::view(d, t.shape(), hold->data(), hold);
}

// e2m1 code of v: round to nearest, ties to the even code (even mantissa), saturating at
// +-6; the same rule as f32_to_e2m1 but on f64 so no double rounding happens first.
// Counting the midpoints passed: '>' where the tie goes down to the even code below,
// '>=' where it goes up (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
// 5 -> 4). Branch-free: the loader runs this on every expert weight.
inline uint8_t e2m1_from_f64(double v) {
  const double a = std::fabs(v);
  const int code = (a > 0.25) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0);
  return static_cast<uint8_t>((std::signbit(v) ? 8 : 0) | code);
}

// One MXFP4 group of kMxfp4GroupSize values: e8m0 scale byte and 16 packed bytes.
void quantize_mx_group(const double* x, uint8_t* packed, uint8_t* scale) {
  double amax = 0;
  for (int i = 0; i < kMxfp4GroupSize; ++i) amax = std::max(amax, std::fabs(x[i]));
  int e = mxfp4_scale_exponent(amax);
  *scale = static_cast<uint8_t>(e + 127);
  // Exact: a power of two in [2^-127, 2^127] times a value of <= 28 significant bits stays
  // a normal f64.
  const double inv = std::ldexp(1.0, -e);
  for (int i = 0; i < kMxfp4GroupSize; i += 2) {
    uint8_t lo = e2m1_from_f64(x[i] * inv);
    uint8_t hi = e2m1_from_f64(x[i + 1] * inv);
    packed[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

Status check_finite(const float* w, int64_t N, int64_t K, const std::string& name) {
  for (int64_t i = 0; i < N * K; ++i) {
    if (!std::isfinite(w[i])) {
      return invalid_argument("tensor {}: element ({}, {}) is {}, cannot quantize", name, i / K, i % K, w[i]);
    }
  }
  return ok_status();
}

// e4m3 code -> value, in f64 (exact); the loader's FP8 -> MXFP4 pass reads every expert
// weight through it, so a table instead of a decode per element.
const std::array<double, 256>& e4m3_f64_table() {
  static const std::array<double, 256> table = [] {
    std::array<double, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = e4m3_to_f32(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

// Value of packed e2m1 element k of a row.
inline double fp4_at(const uint8_t* row, int64_t k) {
  static constexpr double kE2M1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  const uint8_t b = row[k / 2];
  return kE2M1[(k & 1) ? (b >> 4) : (b & 0xf)];
}

}  // namespace

// Declared in model/linear_weight.h (a header without a .cpp); defined here with the formats.
const char* linear_format_name(LinearFormat f) {
  switch (f) {
    case LinearFormat::kF32: return "f32";
    case LinearFormat::kBF16: return "bf16";
    case LinearFormat::kFP8Block: return "fp8_block";
    case LinearFormat::kNVFP4: return "nvfp4";
    case LinearFormat::kMXFP4: return "mxfp4";
  }
  return "?";
}

int mxfp4_scale_exponent(double amax) {
  if (!(amax > 0) || !std::isfinite(amax)) return 0;
  int e2;
  std::frexp(amax, &e2);  // amax = m * 2^e2, m in [0.5, 1): floor(log2(amax)) = e2 - 1
  int e = (e2 - 1) - 2;   // emax of e2m1 is 2 (6 = 1.5 * 2^2)
  return std::clamp(e, -127, 127);
}

Status validate_linear_weight_format(const LinearWeight& w) {
  const int64_t N = w.out_features, K = w.in_features;
  const std::string& name = w.name;
  if (N <= 0 || K <= 0) return invalid_argument("tensor {}: bad layer shape [{}, {}]", name, N, K);
  switch (w.format) {
    case LinearFormat::kF32:
    case LinearFormat::kBF16: {
      DType d = w.format == LinearFormat::kF32 ? DType::kF32 : DType::kBF16;
      ML4_RETURN_IF_ERROR(check_tensor(name, "", w.weight, {N, K}, {d}));
      if (!w.scale.empty()) {
        return invalid_argument("tensor {}: format {} takes no scale, found {}", name, linear_format_name(w.format),
                                w.scale.describe());
      }
      return ok_status();
    }
    case LinearFormat::kFP8Block:
      ML4_RETURN_IF_ERROR(check_tensor(name, "", w.weight, {N, K}, {DType::kF8E4M3}));
      return check_tensor(name, " scale", w.scale, {ceil_div(N, kFp8BlockSize), ceil_div(K, kFp8BlockSize)},
                          {DType::kF32});
    case LinearFormat::kNVFP4:
    case LinearFormat::kMXFP4: {
      const bool nv = w.format == LinearFormat::kNVFP4;
      const int64_t g = nv ? kNvfp4GroupSize : kMxfp4GroupSize;
      if (K % g != 0) {
        return invalid_argument("tensor {}: in_features {} is not a multiple of the {} group size {}", name, K,
                                linear_format_name(w.format), g);
      }
      ML4_RETURN_IF_ERROR(check_tensor(name, "", w.weight, {N, K / 2}, {DType::kF4E2M1x2, DType::kU8}));
      if (nv) {
        ML4_RETURN_IF_ERROR(check_tensor(name, " scale", w.scale, {N, K / g}, {DType::kF8E4M3}));
        if (!std::isfinite(w.global_scale) || !(w.global_scale > 0)) {
          return invalid_argument("tensor {}: NVFP4 global scale {} is not a positive finite number", name,
                                  w.global_scale);
        }
        return ok_status();
      }
      return check_tensor(name, " scale", w.scale, {N, K / g}, {DType::kE8M0, DType::kU8});
    }
  }
  return internal_error("tensor {}: unknown linear format", name);
}

Result<LinearWeight> make_linear_weight(std::string name, LinearFormat fmt, int64_t out_features, int64_t in_features,
                                        Tensor weight, Tensor scale, float global_scale) {
  LinearWeight w;
  w.name = std::move(name);
  w.format = fmt;
  w.out_features = out_features;
  w.in_features = in_features;
  w.global_scale = fmt == LinearFormat::kNVFP4 ? global_scale : 1.0f;
  const bool fp4 = fmt == LinearFormat::kNVFP4 || fmt == LinearFormat::kMXFP4;
  w.weight = std::move(weight);
  w.scale = std::move(scale);
  ML4_RETURN_IF_ERROR(validate_linear_weight_format(w));  // messages show the dtypes as stored
  if (fp4 && w.weight.dtype() == DType::kU8) w.weight = retag(w.weight, DType::kF4E2M1x2);
  if (fmt == LinearFormat::kMXFP4 && w.scale.dtype() == DType::kU8) w.scale = retag(w.scale, DType::kE8M0);
  if (fmt == LinearFormat::kFP8Block) {
    // Block scales are few (1 per 16384 weights); a NaN or inf here would poison a whole block.
    const float* s = w.scale.as<float>();
    for (int64_t i = 0; i < w.scale.numel(); ++i) {
      if (!std::isfinite(s[i])) {
        return invalid_argument("tensor {} scale: block ({}, {}) is {}", w.name, i / w.scale.dim(1), i % w.scale.dim(1),
                                s[i]);
      }
    }
  }
  return w;
}

Result<LinearWeight> quantize_linear(const float* w, int64_t N, int64_t K, LinearFormat fmt, std::string name) {
  if (N <= 0 || K <= 0) return invalid_argument("tensor {}: bad shape [{}, {}] to quantize", name, N, K);
  if (w == nullptr) return invalid_argument("tensor {}: no data to quantize", name);
  ML4_RETURN_IF_ERROR(check_finite(w, N, K, name));
  LinearWeight out;
  out.name = std::move(name);
  out.format = fmt;
  out.out_features = N;
  out.in_features = K;
  switch (fmt) {
    case LinearFormat::kF32: {
      out.weight = Tensor(DType::kF32, {N, K});
      std::memcpy(out.weight.mutable_data(), w, static_cast<size_t>(N * K) * sizeof(float));
      return out;
    }
    case LinearFormat::kBF16: {
      out.weight = Tensor(DType::kBF16, {N, K});
      uint16_t* q = out.weight.mutable_as<uint16_t>();
      for (int64_t i = 0; i < N * K; ++i) q[i] = f32_to_bf16(w[i]);
      return out;
    }
    case LinearFormat::kFP8Block: {
      const int64_t nb = ceil_div(N, kFp8BlockSize), kb = ceil_div(K, kFp8BlockSize);
      out.weight = Tensor(DType::kF8E4M3, {N, K});
      out.scale = Tensor(DType::kF32, {nb, kb});
      uint8_t* q = out.weight.mutable_as<uint8_t>();
      float* sc = out.scale.mutable_as<float>();
      parallel_for(nb, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t bn = b0; bn < b1; ++bn) {
          const int64_t n0 = bn * kFp8BlockSize, n1 = std::min(N, n0 + kFp8BlockSize);
          for (int64_t bk = 0; bk < kb; ++bk) {
            const int64_t k0 = bk * kFp8BlockSize, k1 = std::min(K, k0 + kFp8BlockSize);
            float amax = 0;
            for (int64_t n = n0; n < n1; ++n)
              for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(w[n * K + k]));
            const float s = amax > 0 ? amax / kE4M3Max : 1.0f;  // DeepSeek weight_quant: s = amax / 448
            sc[bn * kb + bk] = s;
            for (int64_t n = n0; n < n1; ++n)
              for (int64_t k = k0; k < k1; ++k) q[n * K + k] = f32_to_e4m3(w[n * K + k] / s);
          }
        }
      });
      return out;
    }
    case LinearFormat::kNVFP4: {
      if (K % kNvfp4GroupSize != 0) {
        return invalid_argument("tensor {}: in_features {} is not a multiple of the nvfp4 group size {}", out.name, K,
                                kNvfp4GroupSize);
      }
      float amax = 0;
      for (int64_t i = 0; i < N * K; ++i) amax = std::max(amax, std::fabs(w[i]));
      // ModelOpt weights_scaling_factor_2 = amax / (6 * 448); an all-zero tensor gets 1.
      const float g = amax > 0 ? amax / (kE2M1Max * kE4M3Max) : 1.0f;
      out.global_scale = g;
      const int64_t groups = K / kNvfp4GroupSize;
      out.weight = Tensor(DType::kF4E2M1x2, {N, K / 2});
      out.scale = Tensor(DType::kF8E4M3, {N, groups});
      uint8_t* q = out.weight.mutable_as<uint8_t>();
      uint8_t* sc = out.scale.mutable_as<uint8_t>();
      parallel_for(N, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t n = r0; n < r1; ++n) {
          for (int64_t j = 0; j < groups; ++j) {
            const float* x = w + n * K + j * kNvfp4GroupSize;
            float bmax = 0;
            for (int i = 0; i < kNvfp4GroupSize; ++i) bmax = std::max(bmax, std::fabs(x[i]));
            // An all-zero block gets scale 1 (as ModelOpt); one whose scale underflows e4m3
            // gets the smallest subnormal instead of 0, which would divide by zero below.
            uint8_t code = bmax > 0 ? f32_to_e4m3(bmax / kE2M1Max / g) : f32_to_e4m3(1.0f);
            if ((code & 0x7f) == 0) code = 0x01;
            sc[n * groups + j] = code;
            const float denom = e4m3_to_f32(code) * g;
            uint8_t* row = q + n * (K / 2) + j * (kNvfp4GroupSize / 2);
            for (int i = 0; i < kNvfp4GroupSize; i += 2) {
              uint8_t lo = f32_to_e2m1(x[i] / denom), hi = f32_to_e2m1(x[i + 1] / denom);
              row[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
            }
          }
        }
      });
      return out;
    }
    case LinearFormat::kMXFP4: {
      if (K % kMxfp4GroupSize != 0) {
        return invalid_argument("tensor {}: in_features {} is not a multiple of the mxfp4 group size {}", out.name, K,
                                kMxfp4GroupSize);
      }
      const int64_t groups = K / kMxfp4GroupSize;
      out.weight = Tensor(DType::kF4E2M1x2, {N, K / 2});
      out.scale = Tensor(DType::kE8M0, {N, groups});
      uint8_t* q = out.weight.mutable_as<uint8_t>();
      uint8_t* sc = out.scale.mutable_as<uint8_t>();
      parallel_for(N, 16, [&](int64_t r0, int64_t r1) {
        double x[kMxfp4GroupSize];
        for (int64_t n = r0; n < r1; ++n) {
          for (int64_t j = 0; j < groups; ++j) {
            for (int i = 0; i < kMxfp4GroupSize; ++i) x[i] = w[n * K + j * kMxfp4GroupSize + i];
            quantize_mx_group(x, q + n * (K / 2) + j * (kMxfp4GroupSize / 2), sc + n * groups + j);
          }
        }
      });
      return out;
    }
  }
  return internal_error("tensor {}: unknown linear format", out.name);
}

std::vector<float> dequantize_linear(const LinearWeight& w) {
  if (!validate_linear_weight_format(w).ok()) return {};
  const int64_t N = w.out_features, K = w.in_features;
  std::vector<float> out(static_cast<size_t>(N * K));
  float* o = out.data();
  switch (w.format) {
    case LinearFormat::kF32:
      std::memcpy(o, w.weight.data(), out.size() * sizeof(float));
      break;
    case LinearFormat::kBF16: {
      const uint16_t* q = w.weight.as<uint16_t>();
      for (int64_t i = 0; i < N * K; ++i) o[i] = bf16_to_f32(q[i]);
      break;
    }
    case LinearFormat::kFP8Block: {
      const uint8_t* q = w.weight.as<uint8_t>();
      const float* sc = w.scale.as<float>();
      const int64_t kb = w.scale.dim(1);
      const auto& e4m3 = e4m3_f64_table();
      parallel_for(N, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t n = r0; n < r1; ++n)
          for (int64_t k = 0; k < K; ++k) {
            // One f32 multiply of two exact factors is the correctly rounded product.
            o[n * K + k] = static_cast<float>(e4m3[q[n * K + k]]) * sc[(n / kFp8BlockSize) * kb + k / kFp8BlockSize];
          }
      });
      break;
    }
    case LinearFormat::kNVFP4:
    case LinearFormat::kMXFP4: {
      const bool nv = w.format == LinearFormat::kNVFP4;
      const int64_t g = nv ? kNvfp4GroupSize : kMxfp4GroupSize, groups = K / g;
      const uint8_t* q = w.weight.as<uint8_t>();
      const uint8_t* sc = w.scale.as<uint8_t>();
      const double gs = w.global_scale;
      const auto& e4m3 = e4m3_f64_table();
      parallel_for(N, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t n = r0; n < r1; ++n) {
          const uint8_t* row = q + n * (K / 2);
          for (int64_t j = 0; j < groups; ++j) {
            const uint8_t s = sc[n * groups + j];
            const double scale = nv ? e4m3[s] : std::ldexp(1.0, s - 127);
            const bool nan_scale = !nv && s == 0xff;  // e8m0 0xFF is NaN
            for (int64_t k = j * g; k < (j + 1) * g; ++k) {
              // e2m1 x e4m3 x f32 is exact in f64 (<= 30 significant bits); rounded once here.
              const double v = nv ? fp4_at(row, k) * scale * gs : fp4_at(row, k) * scale;
              o[n * K + k] = nan_scale ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(v);
            }
          }
        }
      });
      break;
    }
  }
  return out;
}

Result<LinearWeight> requantize_fp8_to_mxfp4(const LinearWeight& fp8) {
  if (fp8.format != LinearFormat::kFP8Block) {
    return invalid_argument("tensor {}: requantize_fp8_to_mxfp4 needs an fp8 block weight, got {}", fp8.name,
                            linear_format_name(fp8.format));
  }
  ML4_RETURN_IF_ERROR(validate_linear_weight_format(fp8));
  const int64_t N = fp8.out_features, K = fp8.in_features;
  if (K % kMxfp4GroupSize != 0) {
    return invalid_argument("tensor {}: in_features {} is not a multiple of the mxfp4 group size {}", fp8.name, K,
                            kMxfp4GroupSize);
  }
  LinearWeight out;
  out.name = fp8.name;
  out.format = LinearFormat::kMXFP4;
  out.out_features = N;
  out.in_features = K;
  const int64_t groups = K / kMxfp4GroupSize, kb = fp8.scale.dim(1);
  out.weight = Tensor(DType::kF4E2M1x2, {N, K / 2});
  out.scale = Tensor(DType::kE8M0, {N, groups});
  const uint8_t* src = fp8.weight.as<uint8_t>();
  const float* ssc = fp8.scale.as<float>();
  uint8_t* q = out.weight.mutable_as<uint8_t>();
  uint8_t* sc = out.scale.mutable_as<uint8_t>();
  const auto& lut = e4m3_f64_table();
  std::atomic<int64_t> first_bad{INT64_MAX};  // a NaN code or a non-finite block scale
  parallel_for(N, 16, [&](int64_t r0, int64_t r1) {
    double x[kMxfp4GroupSize];
    for (int64_t n = r0; n < r1; ++n) {
      for (int64_t j = 0; j < groups; ++j) {
        // A 32-group never straddles a 128-block, so one block scale serves it.
        const double s = ssc[(n / kFp8BlockSize) * kb + (j * kMxfp4GroupSize) / kFp8BlockSize];
        const uint8_t* in = src + n * K + j * kMxfp4GroupSize;
        // Exact: 4 x 24 significant bits fit f64's 53.
        for (int i = 0; i < kMxfp4GroupSize; ++i) {
          x[i] = lut[in[i]] * s;
          if (!std::isfinite(x[i])) {
            int64_t at = n * K + j * kMxfp4GroupSize + i, cur = first_bad.load();
            while (at < cur && !first_bad.compare_exchange_weak(cur, at)) {
            }
            x[i] = 0;
          }
        }
        quantize_mx_group(x, q + n * (K / 2) + j * (kMxfp4GroupSize / 2), sc + n * groups + j);
      }
    }
  });
  if (int64_t at = first_bad.load(); at != INT64_MAX) {
    const int64_t n = at / K, k = at % K;
    return invalid_argument("tensor {}: element ({}, {}) is not finite (e4m3 code 0x{:02x}, block scale {}): corrupt FP8 weight?",
                            fp8.name, n, k, src[at], ssc[(n / kFp8BlockSize) * kb + k / kFp8BlockSize]);
  }
  return out;
}

Tensor to_f32(const Tensor& t) {
  if (t.empty()) return Tensor();
  const int64_t n = t.numel();
  if (t.dtype() == DType::kF4E2M1x2) {
    Shape s = t.shape();
    if (s.empty()) s.push_back(1);
    s.back() *= 2;
    Tensor out(DType::kF32, s);
    const uint8_t* p = t.as<uint8_t>();
    float* o = out.mutable_as<float>();
    for (int64_t i = 0; i < n; ++i) {
      o[2 * i] = e2m1_to_f32(p[i] & 0xf);
      o[2 * i + 1] = e2m1_to_f32(p[i] >> 4);
    }
    return out;
  }
  Tensor out(DType::kF32, t.shape());
  float* o = out.mutable_as<float>();
  for (int64_t i = 0; i < n; ++i) {
    switch (t.dtype()) {
      case DType::kF64: o[i] = static_cast<float>(t.as<double>()[i]); break;
      case DType::kF32: o[i] = t.as<float>()[i]; break;
      case DType::kF16: o[i] = f16_to_f32(t.as<uint16_t>()[i]); break;
      case DType::kBF16: o[i] = bf16_to_f32(t.as<uint16_t>()[i]); break;
      case DType::kF8E4M3: o[i] = e4m3_to_f32(t.as<uint8_t>()[i]); break;
      case DType::kE8M0: o[i] = e8m0_to_f32(t.as<uint8_t>()[i]); break;
      case DType::kU8: o[i] = t.as<uint8_t>()[i]; break;
      case DType::kI8: o[i] = t.as<int8_t>()[i]; break;
      case DType::kI32: o[i] = static_cast<float>(t.as<int32_t>()[i]); break;
      case DType::kI64: o[i] = static_cast<float>(t.as<int64_t>()[i]); break;
      case DType::kBool: o[i] = t.as<uint8_t>()[i] != 0 ? 1.0f : 0.0f; break;
      case DType::kF4E2M1x2: break;  // handled above
    }
  }
  return out;
}

}  // namespace ml4

// linear: see linear.h. Two paths, both ending in one register-tiled kernel (2 rows of
// x by 4 rows of W, 8 f32 lanes, FMA accumulation, all M rows per weight tile):
//   f32 / bf16: stored rows are read directly (bf16 -> f32 is a shift, cheaper than a
//     round trip through a buffer); at M = 1 this is bound by memory bandwidth.
//   FP8 / NVFP4 / MXFP4: tiles of whole rows decoded once into an L2-sized f32 buffer.
// Work is split over N. A K-blocked variant (64 x 256 f32 tiles, y accumulated over K
// blocks) was measured on the 2-core dev machine for M in {17, 64, 512} and was not
// faster than this, so it is not kept; large-M prefill on the CPU is not a goal (S3).
//
// Decoding is exact except one f32 rounding where a block scale multiplies a value
// (FP8: e4m3 * f32 scale; NVFP4: (e2m1 * e4m3) * global; MXFP4 is exact, e2m1 * 2^e).
#include "ops/cpu/linear.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ML4_LINEAR_AVX2 1
#endif

#include "core/log.h"
#include "core/threads.h"

namespace ml4::cpu {
namespace {

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int i = 0; i < 256; ++i) a[i] = e4m3_to_f32(static_cast<uint8_t>(i));
    return a;
  }();
  return t;
}

// Byte -> (low nibble value, high nibble value): element 2j is the low nibble.
const std::array<std::array<float, 2>, 256>& e2m1_pair_table() {
  static const std::array<std::array<float, 2>, 256> t = [] {
    std::array<std::array<float, 2>, 256> a{};
    for (int i = 0; i < 256; ++i) {
      a[i][0] = e2m1_to_f32(static_cast<uint8_t>(i & 0xf));
      a[i][1] = e2m1_to_f32(static_cast<uint8_t>(i >> 4));
    }
    return a;
  }();
  return t;
}

// Local, so this library does not depend on where model/ defines linear_format_name.
const char* format_name(LinearFormat f) {
  switch (f) {
    case LinearFormat::kF32: return "f32";
    case LinearFormat::kBF16: return "bf16";
    case LinearFormat::kFP8Block: return "fp8 block";
    case LinearFormat::kNVFP4: return "nvfp4";
    case LinearFormat::kMXFP4: return "mxfp4";
  }
  return "?";
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }


Status expect(const Tensor& t, const char* what, std::initializer_list<DType> dtypes,
              const Shape& shape) {
  if (t.empty()) return invalid_argument("{} is missing (expected {})", what, shape_str(shape));
  bool dtype_ok = std::find(dtypes.begin(), dtypes.end(), t.dtype()) != dtypes.end();
  if (!dtype_ok || t.shape() != shape) {
    std::string want;
    for (DType d : dtypes) want += std::string(want.empty() ? "" : "|") + dtype_name(d);
    return invalid_argument("{}: expected {} {}, found {}", what, shape_str(shape), want,
                            t.describe());
  }
  return Status::ok();
}

#ifdef ML4_LINEAR_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 e4m3 bytes -> 8 f32 times 2^-8, exactly: e4m3 s.eeee.mmm placed in an f16 as
// s.0eeee.mmm0000000 is 2^-8 times the e4m3 value (also for subnormals, which f16 has
// too), and F16C converts that to an always-normal f32 (an f32-subnormal trick would hit
// the ~100-cycle denormal assist on 1/16 of the codes). The caller folds 2^8 into the
// block scale (exact). Codes 0x7f/0xff become NaN.
inline __m256 e4m3x8_div256(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  const __m256 v = _mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(mag, 7), sign));
  const __m256i nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)));
  return _mm256_or_ps(v, _mm256_castsi256_ps(nan));
}

// 8 bytes of packed e2m1 (16 values, low nibble first) -> out[0..16) = (v * s) * s2.
inline void e2m1x16(const uint8_t* p, __m256 s, __m256 s2, float* out) {
  const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  auto dec = [&](__m256i n) {
    const __m256 v = _mm256_permutevar8x32_ps(table, n);  // uses the low 3 bits
    const __m256i sgn = _mm256_slli_epi32(_mm256_and_si256(n, _mm256_set1_epi32(8)), 28);
    return _mm256_or_ps(v, _mm256_castsi256_ps(sgn));
  };
  const __m256 lo = dec(_mm256_and_si256(b, _mm256_set1_epi32(0xf)));
  const __m256 hi = dec(_mm256_srli_epi32(b, 4));
  const __m256 a = _mm256_unpacklo_ps(lo, hi), c = _mm256_unpackhi_ps(lo, hi);
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_mul_ps(_mm256_permute2f128_ps(a, c, 0x20), s), s2));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_mul_ps(_mm256_permute2f128_ps(a, c, 0x31), s), s2));
}
#endif

inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) { return bf16_to_f32(v); }

// y[m*ldy + j] = sum_k x[m*K + k] * w[j*ldw + k] for m < RM, j < RN.
// The unroll pragmas matter: without them GCC -O2 keeps acc[][] on the stack and every
// FMA goes through a store/load (measured 3x slower at M = 1).
#define ML4_UNROLL _Pragma("GCC unroll 8")
template <int RM, int RN, typename W>
void micro(const float* x, int64_t ldx, int64_t len, const W* w, int64_t ldw, float* y,
           int64_t ldy, bool accumulate) {
  int64_t k = 0;
  float acc_s[RM][RN] = {};
#ifdef ML4_LINEAR_AVX2
  __m256 acc[RM][RN];
  ML4_UNROLL for (int i = 0; i < RM; ++i)
    ML4_UNROLL for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_setzero_ps();
  for (; k + 8 <= len; k += 8) {
    __m256 wv[RN];
    ML4_UNROLL for (int j = 0; j < RN; ++j) wv[j] = load8(w + j * ldw + k);
    ML4_UNROLL for (int i = 0; i < RM; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      ML4_UNROLL for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  ML4_UNROLL for (int i = 0; i < RM; ++i)
    ML4_UNROLL for (int j = 0; j < RN; ++j) acc_s[i][j] = hsum(acc[i][j]);
#endif
  for (; k < len; ++k)
    for (int i = 0; i < RM; ++i)
      for (int j = 0; j < RN; ++j) acc_s[i][j] += x[i * ldx + k] * to_f32(w[j * ldw + k]);
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) y[i * ldy + j] = accumulate ? y[i * ldy + j] + acc_s[i][j] : acc_s[i][j];
}

// y[m, j] (+)= x[m, 0:len] . w[j, 0:len] for m < M, j < nrows; x rows ldx apart, w rows
// ldw apart, y rows ldy apart.
template <typename W>
void tile_kernel(const float* x, int64_t ldx, int64_t M, int64_t len, const W* w, int64_t ldw,
                 int64_t nrows, float* y, int64_t ldy, bool accumulate) {
  int64_t j = 0;
  for (; j + 4 <= nrows; j += 4) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2)
      micro<2, 4>(x + m * ldx, ldx, len, w + j * ldw, ldw, y + m * ldy + j, ldy, accumulate);
    for (; m < M; ++m)
      micro<1, 4>(x + m * ldx, ldx, len, w + j * ldw, ldw, y + m * ldy + j, ldy, accumulate);
  }
  for (; j < nrows; ++j) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2)
      micro<2, 1>(x + m * ldx, ldx, len, w + j * ldw, ldw, y + m * ldy + j, ldy, accumulate);
    for (; m < M; ++m)
      micro<1, 1>(x + m * ldx, ldx, len, w + j * ldw, ldw, y + m * ldy + j, ldy, accumulate);
  }
}

// Weight rows per tile: a multiple of 4 whose decoded f32 copy stays around 256 KiB (L2).
int64_t tile_rows(int64_t K) {
  int64_t rows = (256 * 1024 / 4) / std::max<int64_t>(K, 1);
  return std::clamp<int64_t>(rows / 4 * 4, 4, 64);
}

}  // namespace

Status validate_linear_weight(const LinearWeight& w) {
  const int64_t N = w.out_features, K = w.in_features;
  Status st;
  if (N <= 0 || K <= 0) {
    st = invalid_argument("bad shape N={} K={}", N, K);
  } else {
    switch (w.format) {
      case LinearFormat::kF32:
        st = expect(w.weight, "weight", {DType::kF32}, {N, K});
        break;
      case LinearFormat::kBF16:
        st = expect(w.weight, "weight", {DType::kBF16}, {N, K});
        break;
      case LinearFormat::kFP8Block:
        st = expect(w.weight, "weight", {DType::kF8E4M3, DType::kU8}, {N, K});
        if (st.is_ok())
          st = expect(w.scale, "scale", {DType::kF32},
                      {ceil_div(N, kFp8BlockSize), ceil_div(K, kFp8BlockSize)});
        break;
      case LinearFormat::kNVFP4:
        if (K % kNvfp4GroupSize != 0) {
          st = invalid_argument("NVFP4 needs K % {} == 0, K = {}", kNvfp4GroupSize, K);
          break;
        }
        st = expect(w.weight, "weight", {DType::kF4E2M1x2, DType::kU8}, {N, K / 2});
        if (st.is_ok())
          st = expect(w.scale, "scale", {DType::kF8E4M3, DType::kU8}, {N, K / kNvfp4GroupSize});
        if (st.is_ok() && !std::isfinite(w.global_scale))
          st = invalid_argument("global_scale is {}", w.global_scale);
        break;
      case LinearFormat::kMXFP4:
        if (K % kMxfp4GroupSize != 0) {
          st = invalid_argument("MXFP4 needs K % {} == 0, K = {}", kMxfp4GroupSize, K);
          break;
        }
        st = expect(w.weight, "weight", {DType::kF4E2M1x2, DType::kU8}, {N, K / 2});
        if (st.is_ok())
          st = expect(w.scale, "scale", {DType::kE8M0, DType::kU8}, {N, K / kMxfp4GroupSize});
        break;
    }
  }
  if (st.is_ok()) return st;
  return st.with_context(fmt::format("linear {} ({})", w.name.empty() ? "<unnamed>" : w.name,
                                     format_name(w.format)));
}

namespace {

// Decodes W[n0:n1, k0:k1] into out (rows ldo apart). k0 is a multiple of the format's
// block/group size (128 FP8, 16 NVFP4, 32 MXFP4); k1 is one too, or K.
void decode_block(const LinearWeight& w, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* out,
                  int64_t ldo) {
  const int64_t K = w.in_features;
  switch (w.format) {
    case LinearFormat::kF32:
      for (int64_t n = n0; n < n1; ++n) {
        const float* src = w.weight.as<float>() + n * K;
        std::copy(src + k0, src + k1, out + (n - n0) * ldo);
      }
      break;
    case LinearFormat::kBF16:
      for (int64_t n = n0; n < n1; ++n) {
        const uint16_t* src = w.weight.as<uint16_t>() + n * K;
        float* o = out + (n - n0) * ldo;
        int64_t k = k0;
#ifdef ML4_LINEAR_AVX2
        for (; k + 8 <= k1; k += 8) _mm256_storeu_ps(o + (k - k0), load8(src + k));
#endif
        for (; k < k1; ++k) o[k - k0] = bf16_to_f32(src[k]);
      }
      break;
    case LinearFormat::kFP8Block: {
      const auto& lut = e4m3_table();
      const uint8_t* q = w.weight.as<uint8_t>();
      const float* sc = w.scale.as<float>();
      const int64_t kb = ceil_div(K, kFp8BlockSize);
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = q + n * K;
        float* o = out + (n - n0) * ldo - k0;  // indexed by absolute k
        const float* srow = sc + (n / kFp8BlockSize) * kb;
        for (int64_t b = k0 / kFp8BlockSize; b * kFp8BlockSize < k1; ++b) {
          const float s = srow[b];
          const int64_t e = std::min(k1, (b + 1) * kFp8BlockSize);
          int64_t k = b * kFp8BlockSize;
#ifdef ML4_LINEAR_AVX2
          // (v / 256) * (s * 256) rounds once, exactly like lut[v] * s (2^8 scalings are exact
          // unless s * 256 overflows, which no checkpoint scale comes near).
          const __m256 sv = _mm256_set1_ps(s * 256.0f);
          for (; k + 8 <= e; k += 8) _mm256_storeu_ps(o + k, _mm256_mul_ps(e4m3x8_div256(row + k), sv));
#endif
          for (; k < e; ++k) o[k] = lut[row[k]] * s;
        }
      }
      break;
    }
    case LinearFormat::kNVFP4:
    case LinearFormat::kMXFP4: {
      [[maybe_unused]] const auto& pairs = e2m1_pair_table();
      const auto& e4m3 = e4m3_table();
      const bool nv = w.format == LinearFormat::kNVFP4;
      const int64_t group = nv ? kNvfp4GroupSize : kMxfp4GroupSize;
      const int64_t groups = K / group;
      const uint8_t* q = w.weight.as<uint8_t>();
      const uint8_t* sc = w.scale.as<uint8_t>();
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = q + n * (K / 2);
        float* o = out + (n - n0) * ldo - k0;
        for (int64_t g = k0 / group; g < k1 / group; ++g) {
          const uint8_t code = sc[n * groups + g];
          // NVFP4: e2m1 * e4m3 is exact in f32 (2 + 4 significant bits); the global scale is
          // applied last, so each value is the exact product rounded once. MXFP4: * 1.
          const float s = nv ? e4m3[code] : e8m0_to_f32(code);
          const float s2 = nv ? w.global_scale : 1.0f;
          const uint8_t* b = row + g * group / 2;
          float* og = o + g * group;
#ifdef ML4_LINEAR_AVX2
          const __m256 sv = _mm256_set1_ps(s), s2v = _mm256_set1_ps(s2);
          for (int64_t i = 0; i < group / 2; i += 8) e2m1x16(b + i, sv, s2v, og + 2 * i);  // group % 16 == 0
#else
          for (int64_t i = 0; i < group / 2; ++i) {
            og[2 * i] = pairs[b[i]][0] * s * s2;
            og[2 * i + 1] = pairs[b[i]][1] * s * s2;
          }
#endif
        }
      }
      break;
    }
  }
}

}  // namespace

void decode_weight_rows(const LinearWeight& w, int64_t n0, int64_t n1, float* out) {
  decode_block(w, n0, n1, 0, w.in_features, out, w.in_features);
}

void linear(const float* x, int64_t M, const LinearWeight& w, float* y) {
  const int64_t N = w.out_features, K = w.in_features;
  if (M <= 0) return;
  if (Status st = validate_linear_weight(w); !st.is_ok()) {
    ML4_LOG_ERROR("{}", st.message());
    if (N > 0) std::fill(y, y + M * N, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const bool direct = w.format == LinearFormat::kF32 || w.format == LinearFormat::kBF16;
  if (direct) {
    // Decode: stored rows read directly (bf16 -> f32 is a shift, cheaper than a buffer
    // round trip); chunks of 4 rows so N splits finely across threads.
    const int64_t quads = ceil_div(N, 4);
    parallel_for(quads, std::max<int64_t>(1, 16384 / K), [&](int64_t b, int64_t e) {
      const int64_t n0 = b * 4, n1 = std::min(N, e * 4);
      if (w.format == LinearFormat::kF32)
        tile_kernel(x, K, M, K, w.weight.as<float>() + n0 * K, K, n1 - n0, y + n0, N, false);
      else
        tile_kernel(x, K, M, K, w.weight.as<uint16_t>() + n0 * K, K, n1 - n0, y + n0, N, false);
    });
  } else {
    // Decode with a quantized weight: whole rows decoded once into an L2-sized buffer.
    const int64_t rows = tile_rows(K);
    parallel_for(ceil_div(N, rows), 1, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> buf;
      buf.resize(static_cast<size_t>(rows * K));
      for (int64_t t = b; t < e; ++t) {
        const int64_t n0 = t * rows, n1 = std::min(N, n0 + rows);
        decode_block(w, n0, n1, 0, K, buf.data(), K);
        tile_kernel(x, K, M, K, buf.data(), K, n1 - n0, y + n0, N, false);
      }
    });
  }
}

}  // namespace ml4::cpu

// linear: see linear.h. The kernels and their order contract are in linear_kernels.h.
//
// Two paths, chosen by M and the format; both follow the same per-element summation
// order, so row m of a batched call is bit-identical to the row computed alone:
//   GEMV (bf16 / FP8 with M <= kGemvMaxM, f32 at any M): the stored rows are read once
//     and decoded in registers (bf16: one AND and one shift per 16 values; FP8: e4m3 ->
//     f16 bits -> F16C, times the block scale), one weight row at a time at M = 1 (one
//     sequential stream per thread), else 4 weight rows x up to 2 activation rows (bf16:
//     x 1) per register tile. At M = 1 this is bound by memory bandwidth: nothing but the
//     weight stream touches DRAM (x, a few KiB, stays in L1). FP8 on a CPU with AVX-512
//     (checked at run time, whatever the build's baseline) runs dot_row_fp8_avx512 instead:
//     one weight row at a time for all M, 32 weights per step, the AVX2 tiles' bits.
//   GEMM (bf16 / FP8 with M > kGemvMaxM; NVFP4 / MXFP4 at any M): each worker decodes
//     a group of weight rows once to f32 (bf16: the even halves of the 16-blocks, then the
//     odd halves, so each of its two accumulators streams one half) into a buffer that
//     stays in L1/L2, then runs a 4 x 3 register tile (12 accumulators, 3 weight vectors:
//     12 FMAs per 7 loads) over every activation row. Each weight element is decoded once
//     per call whatever M is, and the whole x (M x K f32, a few MiB at most for a prefill
//     chunk) streams from L2/L3 once per row group.
// Work is split over N with parallel_for (core/threads.h); no allocation per call once a
// thread's buffers have grown to the largest shape (thread_local, reused).
//
// Decoding is exact except one f32 rounding where a block scale multiplies a value
// (FP8: e4m3 * f32 scale; NVFP4: (e2m1 * e4m3) * global; MXFP4 is exact, e2m1 * 2^e).
// Summation: f32 FMAs in the order of linear_kernels.h; tests/ops/linear_test.cpp bounds
// every element by (K + 2) u sum |x w| (Higham 3.1, any order) against an f64 reference.
#include "ops/cpu/linear.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/log.h"
#include "core/threads.h"
#include "ops/cpu/linear_bf16dot.h"
#include "ops/cpu/linear_kernels.h"

namespace ml4::cpu {
namespace {

using kernels::dot_tile_bf16;
using kernels::dot_tile_f32;

// GEMM tile: activation rows x weight rows.
constexpr int kTileM = 4, kTileN = 3;

// core/dtype's compile-time e4m3 table (what e4m3_to_f32 reads).
const std::array<float, 256>& e4m3_table() { return detail::kE4M3Table; }

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
  return ok_status();
}

#ifdef ML4_LINEAR_AVX2
using kernels::e4m3x8_div256;

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
        if (st.ok())
          st = expect(w.scale, "scale", {DType::kF32},
                      {ceil_div(N, kFp8BlockSize), ceil_div(K, kFp8BlockSize)});
        break;
      case LinearFormat::kNVFP4:
        if (K % kNvfp4GroupSize != 0) {
          st = invalid_argument("NVFP4 needs K % {} == 0, K = {}", kNvfp4GroupSize, K);
          break;
        }
        st = expect(w.weight, "weight", {DType::kF4E2M1x2, DType::kU8}, {N, K / 2});
        if (st.ok())
          st = expect(w.scale, "scale", {DType::kF8E4M3, DType::kU8}, {N, K / kNvfp4GroupSize});
        if (st.ok() && !std::isfinite(w.global_scale))
          st = invalid_argument("global_scale is {}", w.global_scale);
        break;
      case LinearFormat::kMXFP4:
        if (K % kMxfp4GroupSize != 0) {
          st = invalid_argument("MXFP4 needs K % {} == 0, K = {}", kMxfp4GroupSize, K);
          break;
        }
        st = expect(w.weight, "weight", {DType::kF4E2M1x2, DType::kU8}, {N, K / 2});
        if (st.ok())
          st = expect(w.scale, "scale", {DType::kE8M0, DType::kU8}, {N, K / kMxfp4GroupSize});
        break;
    }
  }
  if (st.ok()) return st;
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
        for (; k + 8 <= k1; k += 8) {
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
          _mm256_storeu_ps(o + (k - k0), _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        }
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
          // (v / 256) * (s * 256) rounds once, exactly like lut[v] * s (2^8 scalings are exact);
          // a scale so large that s * 256 overflows takes the scalar loop.
          const __m256 sv = _mm256_set1_ps(s * 256.0f);
          if (std::isfinite(s * 256.0f))
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


// ---------------------------------------------------------------------------------------
// GEMV path.

// Dispatches a tile of RM (1..4) x rows by RN (1..4) w rows to the template; 4 x 4 only with
// k44 (the bf16-activation GEMM; the f32 kernels are not instantiated for it). Any other shape
// is a bug: it aborts rather than leave y unwritten.
template <bool k44 = false, typename F>
void tile_dispatch(int64_t rm, int64_t rn, F&& f) {
#define ML4_TILE(A, B) \
  if (rm == A && rn == B) return f(std::integral_constant<int, A>{}, std::integral_constant<int, B>{});
  ML4_TILE(1, 1) ML4_TILE(1, 2) ML4_TILE(1, 3) ML4_TILE(1, 4)
  ML4_TILE(2, 1) ML4_TILE(2, 2) ML4_TILE(2, 3) ML4_TILE(2, 4)
  ML4_TILE(3, 1) ML4_TILE(3, 2) ML4_TILE(3, 3) ML4_TILE(3, 4)
  ML4_TILE(4, 1) ML4_TILE(4, 2) ML4_TILE(4, 3)
  if constexpr (k44) {
    ML4_TILE(4, 4)
  }
#undef ML4_TILE
  ML4_LOG_ERROR("cpu::linear: no register tile for {} x {}", rm, rn);
  std::abort();
}

std::atomic<bool> g_allow_avx512{true};

bool use_avx512() {
#ifdef ML4_LINEAR_AVX512
  return g_allow_avx512.load(std::memory_order_relaxed) && kernels::avx512_usable();
#else
  return false;
#endif
}

// Thread-local scratch that only grows.
std::vector<float>& scratch(int which) {
  thread_local std::vector<float> bufs[5];  // 0 GEMM tile, 1 permuted x, 2 scales, 3-4 NaN path
  return bufs[which];
}
float* scratch_floats(int which, int64_t n) {
  auto& v = scratch(which);
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

// The FP8 GEMV's answer for a tile (rm x rows of x from xm, weight rows [n, n + rn) of one
// scale group whose scale row times 256 is s256) when a weight byte is a NaN code: the rows
// decoded exactly (NaN codes NaN, as e4m3 defines) and summed in the same order.
void fp8_exact_tile(const LinearWeight& w, const float* xm, int64_t rm, int64_t n, int64_t rn, const float* s256,
                    float* ym) {
  const int64_t N = w.out_features, K = w.in_features;
  const float* srow = w.scale.as<float>() + (n / kFp8BlockSize) * ceil_div(K, kFp8BlockSize);
  float* buf = scratch_floats(3, 4 * K);
  float* xh = scratch_floats(4, 4 * K);
  for (int64_t j = 0; j < rn; ++j)
    kernels::decode_fp8_gemm_row(w.weight.as<uint8_t>() + (n + j) * K, K, srow, e4m3_table().data(), buf + j * K);
  for (int64_t i = 0; i < rm; ++i) kernels::permute_fp8_halves(xm + i * K, K, xh + i * K);
  const float* rows_s256[4] = {s256, s256, s256, s256};
  tile_dispatch(rm, rn, [&](auto RM, auto RN) {
    kernels::dot_tile_fp8_decoded<RM, RN>(xh, K, buf, K, rows_s256, K, ym, N);
  });
}

#ifdef ML4_LINEAR_AVX512
// Longest rows the M = 1 FP8 kernel takes 4 at a time (4 x 512 bytes: one short stream).
constexpr int64_t kRows4MaxK = 512;

// FP8 rows [n0, n1) for all M (<= 4) rows of x with the AVX-512 row kernel, one weight row
// at a time (one sequential stream per thread, each row decoded once for all M).
void gemv_rows_fp8_avx512(const LinearWeight& w, const float* x, int64_t M, int64_t n0, int64_t n1, float* y) {
  const int64_t N = w.out_features, K = w.in_features, kb = ceil_div(K, kFp8BlockSize);
  float* s256 = scratch_floats(2, kb);
  int64_t group = -1;
  // M = 1 with short rows: 4 rows of one scale group at a time (dot_rows_fp8_avx512_m1, the
  // same bits per row as dot_row_fp8_avx512<1>).
  const bool rows4 = M == 1 && K % 32 == 0 && K <= kRows4MaxK;
  for (int64_t n = n0; n < n1; ++n) {
    const float* srow = w.scale.as<float>() + (n / kFp8BlockSize) * kb;
    if (n / kFp8BlockSize != group) {
      group = n / kFp8BlockSize;
      for (int64_t b = 0; b < kb; ++b) s256[b] = srow[b] * 256.0f;
    }
    const uint8_t* q = w.weight.as<uint8_t>() + n * K;
    if (rows4 && n + 4 <= n1 && (n + 3) / kFp8BlockSize == group) {
      float yv[4];
      bool ok4[4];
      kernels::dot_rows_fp8_avx512_m1<4>(x, q, s256, K, yv, ok4);
      for (int j = 0; j < 4; ++j) {
        if (ok4[j]) {
          y[n + j] = yv[j];
        } else {
          fp8_exact_tile(w, x, 1, n + j, 1, s256, y + n + j);
        }
      }
      n += 3;
      continue;
    }
    const float* lut = e4m3_table().data();
    bool ok = false;
    switch (M) {
      case 1: ok = kernels::dot_row_fp8_avx512<1>(x, K, q, srow, s256, lut, K, y + n, N); break;
      case 2: ok = kernels::dot_row_fp8_avx512<2>(x, K, q, srow, s256, lut, K, y + n, N); break;
      case 3: ok = kernels::dot_row_fp8_avx512<3>(x, K, q, srow, s256, lut, K, y + n, N); break;
      default: ok = kernels::dot_row_fp8_avx512<4>(x, K, q, srow, s256, lut, K, y + n, N); break;
    }
    if (!ok) fp8_exact_tile(w, x, M, n, 1, s256, y + n);
  }
}
#endif

// f32 / bf16 / FP8 rows [n0, n1) for all M rows of x, reading the stored weight directly.
// xs: x in the format's lane order (bf16: permuted; else x itself).
void gemv_rows(const LinearWeight& w, const float* xs, int64_t M, int64_t n0, int64_t n1, float* y) {
  const int64_t N = w.out_features, K = w.in_features;
#ifdef ML4_LINEAR_AVX512
  if (w.format == LinearFormat::kFP8Block && use_avx512()) return gemv_rows_fp8_avx512(w, xs, M, n0, n1, y);
#endif
  // M = 1 (decode): one weight row at a time, so each thread reads one sequential stream.
  // Four interleaved row streams (the M > 1 tile) measured 15-20% slower for bf16 and up to
  // 2x slower for FP8 on the dev machine (cpu_ops_bench --shape 131072,2048, 2026-12-04): the
  // hardware prefetcher follows one stream per core far better than four, each a row apart.
  // A row is then two FMA chains for bf16 (its even and odd halves) and two per 128-element
  // scale block for FP8 (its even and odd 8-steps, restarted every block, so out-of-order
  // execution overlaps blocks): neither is latency bound below the bandwidth of a 2-core share.
  // M > 1: 4 weight rows x 2 activation rows (bf16: x 1, its tile holding two accumulators
  // per output; the 4 rows stay in L1 for the next activation row. Measured at M = 4 against
  // 2 x 2 and 4 x 2: 14-16 GB/s on the output head vs 12-13 / 15, 84-124 GFLOP/s at
  // 896 x 2048 vs 71-76 / 37-47).
  const bool bf16 = w.format == LinearFormat::kBF16;
  const int64_t tile_n = M == 1 ? 1 : 4;
  const int64_t tile_m = bf16 ? 1 : 2;
  for (int64_t n = n0; n < n1; n += tile_n) {
    const int64_t rn = std::min<int64_t>(tile_n, n1 - n);
    for (int64_t m = 0; m < M; m += tile_m) {
      const int64_t rm = std::min<int64_t>(tile_m, M - m);
      const float* xm = xs + m * K;
      float* ym = y + m * N + n;
      switch (w.format) {
        case LinearFormat::kF32:
          tile_dispatch(rm, rn, [&](auto RM, auto RN) {
            dot_tile_f32<RM, RN>(xm, K, w.weight.as<float>() + n * K, K, K / 8 * 8, K, ym, N);
          });
          break;
        case LinearFormat::kBF16:
          tile_dispatch(rm, rn, [&](auto RM, auto RN) {
            dot_tile_bf16<RM, RN>(xm, K, w.weight.as<uint16_t>() + n * K, K, K / 16 * 16, K, ym, N);
          });
          break;
        case LinearFormat::kFP8Block: {
          const int64_t kb = ceil_div(K, kFp8BlockSize);
          const float* srow = w.scale.as<float>() + (n / kFp8BlockSize) * kb;
          float* s256 = scratch_floats(2, kb);
          for (int64_t b = 0; b < kb; ++b) s256[b] = srow[b] * 256.0f;
          bool ok = true;
          tile_dispatch(rm, rn, [&](auto RM, auto RN) {
            ok = kernels::dot_tile_fp8<RM, RN>(xm, K, w.weight.as<uint8_t>() + n * K, K, srow, s256,
                                               e4m3_table().data(), K, ym, N);
          });
          if (!ok) fp8_exact_tile(w, xm, rm, n, rn, s256, ym);
          break;
        }
        case LinearFormat::kNVFP4:
        case LinearFormat::kMXFP4:
          break;  // not direct (linear() sends them to the GEMM path)
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// GEMM path: weight rows [n0, n1) decoded once (lane order) into the thread's buffer,
// then kTileM x kTileN register tiles over all M rows.
void gemm_rows(const LinearWeight& w, const float* xs, int64_t M, int64_t n0, int64_t n1, float* y) {
  const int64_t N = w.out_features, K = w.in_features;
  const bool bf16 = w.format == LinearFormat::kBF16, fp8 = w.format == LinearFormat::kFP8Block;
  const int64_t kv = bf16 ? K / 16 * 16 : K / 8 * 8;
  const int64_t rows = n1 - n0;
  float* buf = scratch_floats(0, rows * K);
  // FP8: each row's scale row times 256 (rows of one task span at most two scale groups).
  const int64_t kb = ceil_div(K, kFp8BlockSize);
  const int64_t g0 = n0 / kFp8BlockSize;
  float* s256 = fp8 ? scratch_floats(2, 2 * kb) : nullptr;
  if (bf16) {
    for (int64_t n = n0; n < n1; ++n)
      kernels::decode_bf16_halves(w.weight.as<uint16_t>() + n * K, K, buf + (n - n0) * K);
  } else if (fp8) {
    const float* sc = w.scale.as<float>();
    for (int64_t g = g0; g <= (n1 - 1) / kFp8BlockSize; ++g)
      for (int64_t b = 0; b < kb; ++b) s256[(g - g0) * kb + b] = sc[g * kb + b] * 256.0f;
    for (int64_t n = n0; n < n1; ++n)
      kernels::decode_fp8_gemm_row(w.weight.as<uint8_t>() + n * K, K, sc + (n / kFp8BlockSize) * kb,
                                   e4m3_table().data(), buf + (n - n0) * K);
  } else if (w.format == LinearFormat::kF32) {
    std::copy(w.weight.as<float>() + n0 * K, w.weight.as<float>() + n1 * K, buf);
  } else {
    decode_block(w, n0, n1, 0, K, buf, K);
  }
  for (int64_t m = 0; m < M; m += kTileM) {
    const int64_t rm = std::min<int64_t>(kTileM, M - m);
    for (int64_t j = 0; j < rows; j += kTileN) {
      const int64_t rn = std::min<int64_t>(kTileN, rows - j);
      const float* wj = buf + j * K;
      float* yj = y + m * N + n0 + j;
      if (fp8) {
        const float* rs[kTileN];
        for (int64_t r = 0; r < rn; ++r) rs[r] = s256 + ((n0 + j + r) / kFp8BlockSize - g0) * kb;
        tile_dispatch(rm, rn, [&](auto RM, auto RN) {
          kernels::dot_tile_fp8_decoded<RM, RN>(xs + m * K, K, wj, K, rs, K, yj, N);
        });
      } else {
        tile_dispatch(rm, rn, [&](auto RM, auto RN) {
          if (bf16) kernels::dot_tile_f32_pairs<RM, RN>(xs + m * K, K, wj, K, kv, K, yj, N);
          else dot_tile_f32<RM, RN>(xs + m * K, K, wj, K, kv, K, yj, N);
        });
      }
    }
  }
}

// Weight rows per GEMM task: a multiple of kTileN (and of 4 so FP8 scale groups and GEMV
// tiles line up) whose f32 copy stays around 96 KiB (L2 holds it with x streaming by).
int64_t gemm_group_rows(int64_t K) {
  const int64_t rows = (96 * 1024 / 4) / std::max<int64_t>(K, 1);
  return std::clamp<int64_t>(rows / 12 * 12, 12, 96);
}

}  // namespace

void decode_weight_rows(const LinearWeight& w, int64_t n0, int64_t n1, float* out) {
  decode_block(w, n0, n1, 0, w.in_features, out, w.in_features);
}

void decode_weight_block(const LinearWeight& w, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* out,
                         int64_t ldo) {
  decode_block(w, n0, n1, k0, k1, out, ldo);
}

namespace {

bool is_direct(const LinearWeight& w, int64_t M) {
  return w.format == LinearFormat::kF32 ||
         ((w.format == LinearFormat::kBF16 || w.format == LinearFormat::kFP8Block) && M <= kGemvMaxM);
}

// Checks w (false: y is NaN, the message logged) and returns x in the order the path reads
// (bf16: a permuted copy in the calling thread's scratch, lane order for the GEMV and halves
// order for the GEMM; FP8's GEMM: its per-block halves order; else x itself).
const float* prepare(const float* x, int64_t M, const LinearWeight& w, float* y) {
  const int64_t N = w.out_features, K = w.in_features;
  if (Status st = validate_linear_weight(w); !st.ok()) {
    ML4_LOG_ERROR("{}", st.message());
    if (N > 0) std::fill(y, y + M * N, std::numeric_limits<float>::quiet_NaN());
    return nullptr;
  }
  const bool direct = is_direct(w, M);
  const bool fp8_gemm = w.format == LinearFormat::kFP8Block && !direct;
  if (w.format != LinearFormat::kBF16 && !fp8_gemm) return x;
  float* xp = scratch_floats(1, M * K);
  for (int64_t m = 0; m < M; ++m) {
    if (fp8_gemm) kernels::permute_fp8_halves(x + m * K, K, xp + m * K);
    else if (direct) kernels::permute_bf16_order(x + m * K, K, xp + m * K);
    else kernels::permute_bf16_halves(x + m * K, K, xp + m * K);
  }
  return xp;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// bf16-activation mode (ActivationDtype::kBF16; the kernels and their order in
// linear_bf16dot.h). x is converted once per call into the thread's scratch; then the same
// two paths as above: direct rows (M <= kGemvMaxM; one weight row at a time, every
// activation row against it) and, above that, groups of rows with 4 x 4 (bf16, read where
// stored) or 4 x 2 (FP8, decoded once to bf16 words) register tiles. Both give the same
// bits for a row, so a token's result never depends on its batch.
namespace {

bool uses_bf16dot(const LinearWeight& w, ActivationDtype act) {
  return act == ActivationDtype::kBF16 && (w.format == LinearFormat::kBF16 || w.format == LinearFormat::kFP8Block);
}

#ifdef ML4_LINEAR_BF16DOT
uint16_t* scratch_words(int which, int64_t n) {
  return reinterpret_cast<uint16_t*>(scratch_floats(which, (n + 1) / 2));
}

// Words per x row: bf16 weights K rounded up to 32, FP8 to 64.
int64_t bf16dot_ldx(const LinearWeight& w) {
  return w.format == LinearFormat::kFP8Block ? ceil_div(w.in_features, 64) * 64 : ceil_div(w.in_features, 32) * 32;
}

const uint16_t* prepare_bf16dot(const float* x, int64_t M, const LinearWeight& w) {
  const int64_t K = w.in_features, ldx = bf16dot_ldx(w);
  uint16_t* xb = scratch_words(1, M * ldx);
  if (w.format == LinearFormat::kBF16) {
    for (int64_t m = 0; m < M; ++m) kernels::x_to_bf16(x + m * K, K, ldx, xb + m * ldx);
    return xb;
  }
  uint16_t* tmp = scratch_words(4, ldx);
  for (int64_t m = 0; m < M; ++m) {
    kernels::x_to_bf16(x + m * K, K, ldx, tmp);
    kernels::permute_fp8_chunks(tmp, ldx, xb + m * ldx);
  }
  return xb;
}

// Rows [n0, n1) for M <= kGemvMaxM: one weight row at a time against every activation row.
void bf16dot_direct_rows(const LinearWeight& w, const uint16_t* xb, int64_t M, int64_t n0, int64_t n1, float* y) {
  const int64_t N = w.out_features, K = w.in_features, ldx = bf16dot_ldx(w);
  if (w.format == LinearFormat::kBF16) {
    for (int64_t n = n0; n < n1; ++n)
      tile_dispatch(M, 1, [&](auto RM, auto RN) {
        kernels::dot_tile_bf16dot<RM, RN>(xb, ldx, w.weight.as<uint16_t>() + n * K, K, K, y + n, N);
      });
    return;
  }
  const auto& t = kernels::e4m3_bf16_tables();
  const int64_t kb = ceil_div(K, kFp8BlockSize);
  for (int64_t n = n0; n < n1; ++n) {
    const float* srow = w.scale.as<float>() + (n / kFp8BlockSize) * kb;
    const uint8_t* q = w.weight.as<uint8_t>() + n * K;
    switch (M) {
      case 1: kernels::dot_row_fp8_bf16dot<1>(xb, ldx, q, srow, K, t, y + n, N); break;
      case 2: kernels::dot_row_fp8_bf16dot<2>(xb, ldx, q, srow, K, t, y + n, N); break;
      case 3: kernels::dot_row_fp8_bf16dot<3>(xb, ldx, q, srow, K, t, y + n, N); break;
      default: kernels::dot_row_fp8_bf16dot<4>(xb, ldx, q, srow, K, t, y + n, N); break;
    }
  }
}

// Rows [n0, n1) for M > kGemvMaxM: register tiles over all M rows, bf16 rows read where
// stored, FP8 rows decoded once into the thread's buffer.
void bf16dot_gemm_rows(const LinearWeight& w, const uint16_t* xb, int64_t M, int64_t n0, int64_t n1, float* y) {
  const int64_t N = w.out_features, K = w.in_features, ldx = bf16dot_ldx(w), rows = n1 - n0;
  if (w.format == LinearFormat::kBF16) {
    const uint16_t* wr = w.weight.as<uint16_t>() + n0 * K;
    for (int64_t m = 0; m < M; m += 4)
      for (int64_t j = 0; j < rows; j += 4)
        tile_dispatch<true>(std::min<int64_t>(4, M - m), std::min<int64_t>(4, rows - j), [&](auto RM, auto RN) {
          kernels::dot_tile_bf16dot<RM, RN>(xb + m * ldx, ldx, wr + j * K, K, K, y + m * N + n0 + j, N);
        });
    return;
  }
  const auto& t = kernels::e4m3_bf16_tables();
  const int64_t kb = ceil_div(K, kFp8BlockSize);
  uint16_t* buf = scratch_words(0, rows * ldx);
  for (int64_t n = n0; n < n1; ++n)
    kernels::decode_fp8_bf16dot_row(w.weight.as<uint8_t>() + n * K, K, t, buf + (n - n0) * ldx);
  const float* sc = w.scale.as<float>();
  for (int64_t m = 0; m < M; m += 4)
    for (int64_t j = 0; j < rows; j += 2) {
      const float* rs[2] = {sc + ((n0 + j) / kFp8BlockSize) * kb,
                            sc + (std::min(n1 - 1, n0 + j + 1) / kFp8BlockSize) * kb};
      tile_dispatch(std::min<int64_t>(4, M - m), std::min<int64_t>(2, rows - j), [&](auto RM, auto RN) {
        if constexpr (RN <= 2)  // the dispatch instantiates RN up to 4; only 1 and 2 are reached
          kernels::dot_tile_fp8_bf16dot<RM, RN>(xb + m * ldx, ldx, buf + j * ldx, ldx, rs, K, y + m * N + n0 + j, N);
      });
    }
}

// Weight rows per GEMM task: their bf16 words around 128 KiB, a multiple of 4.
int64_t bf16dot_group_rows(const LinearWeight& w) {
  const int64_t rows = (128 * 1024 / 2) / std::max<int64_t>(bf16dot_ldx(w), 1);
  return std::clamp<int64_t>(rows / 4 * 4, 4, 128);
}
#endif

// Checks w and the CPU; false: y is NaN, the reason logged.
bool bf16dot_ready(const LinearWeight& w, int64_t M, float* y) {
  Status st = validate_linear_weight(w);
  if (st.ok()) st = activation_dtype_supported(ActivationDtype::kBF16);
  if (st.ok()) return true;
  ML4_LOG_ERROR("{}", st.message());
  if (w.out_features > 0) std::fill(y, y + M * w.out_features, std::numeric_limits<float>::quiet_NaN());
  return false;
}

void linear_bf16dot(const float* x, int64_t M, const LinearWeight& w, float* y) {
  if (!bf16dot_ready(w, M, y)) return;
#ifdef ML4_LINEAR_BF16DOT
  const int64_t N = w.out_features;
  const uint16_t* xb = prepare_bf16dot(x, M, w);
  if (M <= kGemvMaxM) {
    const int64_t quads = ceil_div(N, 4);
    parallel_for(quads, std::max<int64_t>(1, 4096 / w.in_features), [&](int64_t b, int64_t e) {
      bf16dot_direct_rows(w, xb, M, b * 4, std::min(N, e * 4), y);
    });
    return;
  }
  const int64_t group = bf16dot_group_rows(w);
  parallel_for(ceil_div(N, group), 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) bf16dot_gemm_rows(w, xb, M, g * group, std::min(N, (g + 1) * group), y);
  });
#endif
}

void linear_rows_bf16dot(const float* x, int64_t M, const LinearWeight& w, int64_t n0, int64_t n1, float* y) {
  if (!bf16dot_ready(w, M, y)) return;
#ifdef ML4_LINEAR_BF16DOT
  const uint16_t* xb = prepare_bf16dot(x, M, w);
  if (M <= kGemvMaxM) return bf16dot_direct_rows(w, xb, M, n0, n1, y);
  const int64_t group = bf16dot_group_rows(w);
  for (int64_t n = n0; n < n1; n += group) bf16dot_gemm_rows(w, xb, M, n, std::min(n1, n + group), y);
#endif
}

}  // namespace

#ifdef ML4_LINEAR_BF16DOT
namespace kernels {
const E4m3Bf16Tables& e4m3_bf16_tables() {
  static const E4m3Bf16Tables t = [] {
    E4m3Bf16Tables r{};
    for (int i = 0; i < 128; ++i) {
      const uint16_t h = f32_to_bf16(e4m3_table()[i]);  // exact: e4m3 values have 4 significant bits
      r.lo[i] = static_cast<uint8_t>(h & 0xff);
      r.hi[i] = static_cast<uint8_t>(h >> 8);
    }
    return r;
  }();
  return t;
}
}  // namespace kernels
#endif

Status activation_dtype_supported(ActivationDtype a) {
  if (a == ActivationDtype::kF32) return ok_status();
#ifdef ML4_LINEAR_BF16DOT
  if (kernels::bf16dot_usable()) return ok_status();
#endif
  return invalid_argument(
      "--dtype bfloat16 on the CPU needs AVX512_BF16 and AVX512_VBMI (x86-64 Zen 4, Sapphire Rapids or later); "
      "this CPU or build lacks them: use --dtype float32");
}

Result<ActivationDtype> parse_activation_dtype(const std::string& name) {
  if (name == "auto" || name == "float32" || name == "float" || name == "f32") return ActivationDtype::kF32;
  if (name == "bfloat16" || name == "bf16") return ActivationDtype::kBF16;
  return invalid_argument("--dtype must be auto, float32 or bfloat16, got '{}'", name);
}

const char* activation_dtype_name(ActivationDtype a) { return a == ActivationDtype::kBF16 ? "bfloat16" : "float32"; }

void linear_allow_avx512(bool allow) { g_allow_avx512.store(allow, std::memory_order_relaxed); }
bool linear_uses_avx512() { return use_avx512(); }

void linear_rows(const float* x, int64_t M, const LinearWeight& w, int64_t n0, int64_t n1, float* y,
                 ActivationDtype act) {
  if (M <= 0 || n0 >= n1) return;
  if (uses_bf16dot(w, act)) return linear_rows_bf16dot(x, M, w, n0, n1, y);
  const float* xs = prepare(x, M, w, y);
  if (xs == nullptr) return;
  if (is_direct(w, M)) {
    gemv_rows(w, xs, M, n0, n1, y);
    return;
  }
  const int64_t group = gemm_group_rows(w.in_features);
  for (int64_t n = n0; n < n1; n += group) gemm_rows(w, xs, M, n, std::min(n1, n + group), y);
}

void linear(const float* x, int64_t M, const LinearWeight& w, float* y, ActivationDtype act) {
  const int64_t N = w.out_features, K = w.in_features;
  if (M <= 0) return;
  if (uses_bf16dot(w, act)) return linear_bf16dot(x, M, w, y);
  // x in the format's lane order (bf16 only; the copy is M x K f32, in the caller's thread).
  const float* xs = prepare(x, M, w, y);
  if (xs == nullptr) return;
  if (is_direct(w, M)) {
    // Chunks of 4 rows (one FP8 scale group never splits a tile), grain ~16k weights so N
    // splits finely across threads.
    const int64_t quads = ceil_div(N, 4);
    parallel_for(quads, std::max<int64_t>(1, 4096 / K), [&](int64_t b, int64_t e) {
      gemv_rows(w, xs, M, b * 4, std::min(N, e * 4), y);
    });
    return;
  }
  const int64_t group = gemm_group_rows(K);
  parallel_for(ceil_div(N, group), 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) gemm_rows(w, xs, M, t * group, std::min(N, (t + 1) * group), y);
  });
}

}  // namespace ml4::cpu

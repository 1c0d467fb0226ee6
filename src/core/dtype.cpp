#include "core/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace ml4 {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF64: return 8;
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kF4E2M1x2: return 1;
    case DType::kE8M0: return 1;
    case DType::kU8: return 1;
    case DType::kI8: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kBool: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF64: return "f64";
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kF8E4M3: return "f8_e4m3";
    case DType::kF4E2M1x2: return "e2m1x2";
    case DType::kE8M0: return "e8m0";
    case DType::kU8: return "u8";
    case DType::kI8: return "i8";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kBool: return "bool";
  }
  return "?";
}

std::optional<DType> dtype_from_safetensors(std::string_view s) {
  if (s == "F64") return DType::kF64;
  if (s == "F32") return DType::kF32;
  if (s == "F16") return DType::kF16;
  if (s == "BF16") return DType::kBF16;
  if (s == "F8_E4M3") return DType::kF8E4M3;
  if (s == "F8_E8M0") return DType::kE8M0;
  if (s == "U8") return DType::kU8;
  if (s == "I8") return DType::kI8;
  if (s == "I32") return DType::kI32;
  if (s == "I64") return DType::kI64;
  if (s == "BOOL") return DType::kBool;
  return std::nullopt;
}

const char* dtype_to_safetensors(DType t) {
  switch (t) {
    case DType::kF64: return "F64";
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kF4E2M1x2: return "U8";
    case DType::kE8M0: return "F8_E8M0";
    case DType::kU8: return "U8";
    case DType::kI8: return "I8";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

uint16_t f32_to_f16(float f) {
  uint32_t u = f32_to_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00u;
  if (a >= 65520.0f) return sign | 0x7c00u;  // rounds to inf
  if (a < std::ldexp(1.0f, -14)) {           // subnormal: units of 2^-24
    float q = std::nearbyint(a * 16777216.0f);  // default rounding mode is RNE
    return sign | static_cast<uint16_t>(q);
  }
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  float q = std::nearbyint(std::ldexp(a, 11 - e));  // 11 significant bits
  if (q >= 2048.0f) { q /= 2; e += 1; }
  uint16_t exp = static_cast<uint16_t>(e - 1 + 15);
  if (exp >= 31) return sign | 0x7c00u;
  return sign | static_cast<uint16_t>(exp << 10) | (static_cast<uint16_t>(q) & 0x3ffu);
}


uint8_t f32_to_e4m3(float f) {
  // On the bits (the KV cache and the indexer encode every value they store through this):
  // normals round their 23-bit mantissa to 3 bits, to nearest even, by adding 2^19 - 1 plus
  // the lowest kept bit (a carry moves into the exponent, as rounding up to the next binade
  // should); e4m3's exponent is f32's minus 120. Subnormals (|f| < 2^-6) are multiples of
  // 2^-9: |f| * 512 rounded to an integer, to nearest even (exact: adding and removing 2^23).
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;        // NaN
  if (a >= 0x43e00000u) return sign | 0x7e;  // |f| >= 448 (inf too): saturate
  if (a < 0x3c800000u) {                     // |f| < 2^-6: subnormal, units of 2^-9
    float mag;
    std::memcpy(&mag, &a, 4);
    const float big = mag * 512.0f + 8388608.0f;  // rounds to an integer, ties to even
    const float q = big - 8388608.0f;
    return sign | static_cast<uint8_t>(q);  // 8 is code 0x08, the first normal
  }
  const uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;  // f32 exponent << 3 | 3 bits
  const uint32_t code = r - (120u << 3);
  return sign | static_cast<uint8_t>(code > 0x7e ? 0x7e : code);
}

float e2m1_to_f32(uint8_t nibble) {
  static const float kValues[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float v = kValues[nibble & 7];
  return (nibble & 8) ? -v : v;
}

uint8_t f32_to_e2m1(float f) {
  uint8_t sign = std::signbit(f) ? 8 : 0;
  float a = std::fabs(f);
  if (std::isnan(f)) return 0;
  // Midpoints between representable values; ties go to the even code (even mantissa).
  static const float kValues[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  uint8_t best = 7;
  for (uint8_t i = 0; i < 7; ++i) {
    float mid = 0.5f * (kValues[i] + kValues[i + 1]);
    if (a < mid) { best = i; break; }
    if (a == mid) { best = (i % 2 == 0) ? i : static_cast<uint8_t>(i + 1); break; }
  }
  return sign | best;
}

float e8m0_to_f32(uint8_t v) {
  if (v == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(v) - 127);
}

uint8_t f32_to_e8m0_ceil(float f) {
  if (!(f > 0.0f)) return 0;
  int e;
  float m = std::frexp(f, &e);  // f = m * 2^e, m in [0.5,1)
  int p = (m == 0.5f) ? e - 1 : e;  // smallest power of two >= f is 2^p
  int biased = p + 127;
  if (biased < 0) biased = 0;
  if (biased > 254) biased = 254;
  return static_cast<uint8_t>(biased);
}

}  // namespace ml4

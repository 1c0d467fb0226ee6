// Element types of checkpoints and caches, and exact scalar conversions.
//
// Formats (MODEL.md section 4): bf16, f16, f32, f64, e4m3 (OCP FP8, max 448, no inf),
// e2m1 (OCP FP4, two per byte, low nibble first as in NVIDIA's/vLLM's packing), e8m0
// (power-of-two scale, 2^(x-127), 0xFF = NaN). Decoding is exact; encoding rounds to
// nearest even and saturates e4m3 to +-448 (as torch's float8_e4m3fn cast with clamp).
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace ml4 {

enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8E4M3,
  kF4E2M1x2,  // two e2m1 values per byte (safetensors "U8" holding packed FP4)
  kE8M0,      // safetensors "F8_E8M0" or "U8" scales
  kU8,
  kI8,
  kI32,
  kI64,
  kBool,
};

// Bytes per stored element (kF4E2M1x2: one byte holds two values; size is per byte).
size_t dtype_size(DType t);
const char* dtype_name(DType t);
// safetensors dtype strings: "F64","F32","F16","BF16","F8_E4M3","F8_E8M0","U8","I8","I32","I64","BOOL".
std::optional<DType> dtype_from_safetensors(std::string_view s);
const char* dtype_to_safetensors(DType t);

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// bf16: the top half of an f32; round to nearest even; NaN stays NaN.
inline float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
// Rounds an f32 through bf16 and back.
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// OCP e4m3fn: bias 7, no infinities, 0x7f/0xff NaN, max finite 448.
constexpr float kE4M3Max = 448.0f;
namespace detail {
// The value of code v, (man | 8 or man) * 2^e by exact halvings/doublings, at compile time.
constexpr float e4m3_value(unsigned v) {
  const unsigned exp = (v >> 3) & 0xfu, man = v & 0x7u;
  if (exp == 15 && man == 7) return std::numeric_limits<float>::quiet_NaN();
  float r = static_cast<float>(exp == 0 ? man : (man | 8u));
  for (int e = exp == 0 ? -9 : static_cast<int>(exp) - 10; e != 0; e += e < 0 ? 1 : -1) r = e < 0 ? r * 0.5f : r * 2.0f;
  return (v >> 7) != 0 ? -r : r;
}
inline constexpr std::array<float, 256> kE4M3Table = [] {
  std::array<float, 256> t{};
  for (unsigned v = 0; v < 256; ++v) t[v] = e4m3_value(v);
  return t;
}();
}  // namespace detail
// A table lookup: the KV cache decodes every key row this way (a libm ldexp per value made
// the CPU attention ~10 ns per cached value).
inline float e4m3_to_f32(uint8_t v) { return detail::kE4M3Table[v]; }
uint8_t f32_to_e4m3(float f);  // RNE, saturating to +-448; NaN -> 0x7f
inline float round_e4m3(float f) { return e4m3_to_f32(f32_to_e4m3(f)); }

// OCP e2m1: values {0, 0.5, 1, 1.5, 2, 3, 4, 6} and sign; max 6.
constexpr float kE2M1Max = 6.0f;
float e2m1_to_f32(uint8_t nibble);
uint8_t f32_to_e2m1(float f);  // RNE, saturating to +-6

// e8m0: 2^(v-127); 0xff is NaN.
float e8m0_to_f32(uint8_t v);
// Smallest power of two >= f (f > 0), as e8m0 (the "ue8m0 round-up" of DeepGEMM/vLLM).
uint8_t f32_to_e8m0_ceil(float f);

}  // namespace ml4

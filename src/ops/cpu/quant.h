// The DSA indexer's activation path (MODEL.md 3.5): normalized Walsh-Hadamard transform
// and FP8 e4m3 quantization with one f32 scale per group of values.
#pragma once

#include <cstdint>

namespace ml4::cpu {

// In place on `rows` rows of n floats: x <- H_n x * n^-0.5, with H_n in Sylvester
// (natural) order, i.e. scipy.linalg.hadamard(n) and Dao-AILab fast_hadamard_transform.
// n must be a power of two; otherwise the call logs and leaves x unchanged.
void hadamard_transform(float* x, int64_t rows, int n);

// DeepSeek-V3 `act_quant` per group of `group` values (the last group may be short):
// scale = max(amax, 1e-4) / 448, q = e4m3(x / scale) (RNE, saturating). q: [n] bytes,
// scales: [ceil(n / group)].
void quantize_fp8_groups(const float* x, int64_t n, int group, uint8_t* q, float* scales);

// x = e4m3(q) * scale of its group.
void dequantize_fp8_groups(const uint8_t* q, const float* scales, int64_t n, int group, float* x);

// In place: x = dequantize_fp8_groups(quantize_fp8_groups(x)), bit for bit, without the bytes.
void round_fp8_groups(float* x, int64_t n, int group);

}  // namespace ml4::cpu

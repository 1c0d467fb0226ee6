// fp8_ds_mla / fp8 / bf16 latent rows (layout in latent_layout.h).
#include "kv/latent_layout.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "core/dtype.h"

namespace ml4 {

namespace {

void store_f32(uint8_t* p, float v) { std::memcpy(p, &v, 4); }
float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}
void store_bf16(uint8_t* p, float v) {
  uint16_t h = f32_to_bf16(v);
  std::memcpy(p, &h, 2);
}
float load_bf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return bf16_to_f32(h);
}

}  // namespace

size_t latent_token_bytes(KvCacheDtype dtype, int kv_lora_rank, int rope_dim) {
  const size_t r = static_cast<size_t>(kv_lora_rank), dr = static_cast<size_t>(rope_dim);
  switch (dtype) {
    case KvCacheDtype::kFp8DsMla: return r + 4 * (r / kDsMlaTile) + 2 * dr;
    case KvCacheDtype::kFp8: return r + dr;
    case KvCacheDtype::kBf16: return 2 * (r + dr);
  }
  return 0;
}

void encode_latent(KvCacheDtype dtype, const float* c, const float* kr, int r, int dr,
                   float fp8_scale, uint8_t* dst) {
  switch (dtype) {
    case KvCacheDtype::kFp8DsMla: {
      // vLLM concat_and_cache_ds_mla_kernel: tile_scale = max(amax / 448, FLT_MIN), then
      // e4m3(x / tile_scale) with saturation (scaled_convert, __NV_SATFINITE).
      const int tiles = r / kDsMlaTile;
      uint8_t* scales = dst + r;
      for (int t = 0; t < tiles; ++t) {
        const float* x = c + t * kDsMlaTile;
        float amax = 0.0f;
        for (int i = 0; i < kDsMlaTile; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float scale = std::max(amax / kE4M3Max, FLT_MIN);
        for (int i = 0; i < kDsMlaTile; ++i) dst[t * kDsMlaTile + i] = f32_to_e4m3(x[i] / scale);
        store_f32(scales + 4 * t, scale);
      }
      uint8_t* rope = scales + 4 * tiles;
      for (int i = 0; i < dr; ++i) store_bf16(rope + 2 * i, kr[i]);
      return;
    }
    case KvCacheDtype::kFp8: {
      // vLLM concat_and_cache_mla with kv_cache_dtype fp8: e4m3(x / k_scale).
      for (int i = 0; i < r; ++i) dst[i] = f32_to_e4m3(c[i] / fp8_scale);
      for (int i = 0; i < dr; ++i) dst[r + i] = f32_to_e4m3(kr[i] / fp8_scale);
      return;
    }
    case KvCacheDtype::kBf16: {
      for (int i = 0; i < r; ++i) store_bf16(dst + 2 * i, c[i]);
      for (int i = 0; i < dr; ++i) store_bf16(dst + 2 * (r + i), kr[i]);
      return;
    }
  }
}

void decode_latent(KvCacheDtype dtype, const uint8_t* src, int r, int dr, float fp8_scale,
                   float* c, float* kr) {
  switch (dtype) {
    case KvCacheDtype::kFp8DsMla: {
      const int tiles = r / kDsMlaTile;
      const uint8_t* scales = src + r;
      for (int t = 0; t < tiles; ++t) {
        const float scale = load_f32(scales + 4 * t);
        for (int i = 0; i < kDsMlaTile; ++i) {
          c[t * kDsMlaTile + i] = e4m3_to_f32(src[t * kDsMlaTile + i]) * scale;
        }
      }
      const uint8_t* rope = scales + 4 * tiles;
      for (int i = 0; i < dr; ++i) kr[i] = load_bf16(rope + 2 * i);
      return;
    }
    case KvCacheDtype::kFp8: {
      for (int i = 0; i < r; ++i) c[i] = e4m3_to_f32(src[i]) * fp8_scale;
      for (int i = 0; i < dr; ++i) kr[i] = e4m3_to_f32(src[r + i]) * fp8_scale;
      return;
    }
    case KvCacheDtype::kBf16: {
      for (int i = 0; i < r; ++i) c[i] = load_bf16(src + 2 * i);
      for (int i = 0; i < dr; ++i) kr[i] = load_bf16(src + 2 * (r + i));
      return;
    }
  }
}

}  // namespace ml4

// RoPE of rows inside a kernel that does more than rotate them (the fused indexer paths:
// cache_write.h indexer_key_path, indexer.h indexer_query_quant): NeoX pairs (i, i + dim / 2) of
// each row's first `dim` values at its token's position, as q_path rotates them (rope.cuh).
#pragma once

#include <cstdint>

namespace ml4::cuda {

struct RopeRows {
  int dim = 0;                         // even, at most the row's width
  const int64_t* positions = nullptr;  // [T]: the row's token's position
  const float* inv_freq = nullptr;     // [dim / 2] (cpu::rope_inv_freq)
  float attn_factor = 1.0f;            // cpu::rope_attention_factor
  bool lerope = false;                 // LeRoPE (cpu::lerope_position)
  int64_t lerope_window = 0;
  double lerope_leak = 0.0;
};

}  // namespace ml4::cuda

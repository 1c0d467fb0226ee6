// `ml4 quantize --to fp8|mxfp4|nvfp4 IN OUT` (SYSTEM.md S16): a model directory with its
// linear weights re-stored in another format, everything else copied.
//
// What is quantized follows expected_tensors() for the target WeightFormat, exactly as a
// checkpoint of that format is laid out (docs/MODEL-FORMAT.md section 3): fp8 makes every
// linear FP8 128x128 block-scaled except `output`, the router `gate` and
// `indexer.weights_proj`; nvfp4 / mxfp4 make the routed experts FP4 and the other linears
// FP8 (the NVFP4 checkpoint recipe of MODEL.md section 4); --output-tensor-type fp8 makes
// `output` FP8 too. Each source weight is decoded
// exactly to f32 (whatever its stored format) and quantized with the public recipes of
// model/quant.h (DeepSeek weight_quant, ModelOpt NVFP4, OCP MX). Norms, embeddings, the
// drafter and f32 vectors are copied byte for byte, as are the tokenizer files.
//
// The output has the input's layout (params.json + consolidated*.safetensors, or
// config.json + model*.safetensors) and tokenizer; OUT must not already hold a model.
// llama.cpp's equivalent is `llama-quantize IN.gguf OUT.gguf Q8_0`; vLLM quantizes at load
// (`--quantization fp8`), which ml4 does not do, so this is an offline step.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace ml4 {

struct QuantizeOptions {
  std::string in_dir;
  std::string out_dir;
  std::string to;  // bf16 (decode every linear) | fp8 | mxfp4 | nvfp4
  // The output head's format (llama-quantize's --output-tensor-type): "" keeps the recipe's
  // (bf16, as DeepSeek's and Mistral's FP8 checkpoints store it), "bf16" or "fp8" (128x128
  // block-scaled, half the head's bytes per decoded token; native layout only, since
  // transformers' FP8 loader never quantizes lm_head).
  std::string output_tensor_type = "";
  int64_t max_shard_bytes = int64_t{4} << 30;
};

struct QuantizeReport {
  int64_t tensors = 0;           // tensors written (scales included)
  int64_t quantized_linears = 0; // weights re-quantized
  int64_t bytes_in = 0, bytes_out = 0;  // tensor data
};

Result<QuantizeReport> quantize_checkpoint(const QuantizeOptions& o);

}  // namespace ml4

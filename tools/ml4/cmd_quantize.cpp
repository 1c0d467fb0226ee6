// `ml4 quantize --to fp8|mxfp4|nvfp4 IN OUT`: a model directory re-stored in another weight
// format (src/model/quantize_checkpoint.h).
#include <memory>

#include "command.h"
#include "core/log.h"
#include "model/quantize_checkpoint.h"

namespace ml4::cli {
namespace {

CommandRegistrar reg("quantize", [](CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand("quantize", "re-store a model's linear weights as bf16, fp8 (128x128 block), mxfp4 or nvfp4");
  auto o = std::make_shared<QuantizeOptions>();
  cmd->add_option("--to", o->to, "bf16: every linear decoded and rounded to bf16; fp8: every linear but output/gate/indexer.weights_proj; mxfp4 / nvfp4: routed "
                                 "experts FP4, the other linears fp8")
      ->required();
  cmd->add_option("--output-tensor-type", o->output_tensor_type,
                  "the output head's format, bf16 or fp8 (default: the recipe's, bf16; llama-quantize's flag)")
      ->check(CLI::IsMember({"bf16", "fp8"}));
  cmd->add_option("--max-shard-bytes", o->max_shard_bytes, "split the weights into shards of at most this size");
  cmd->add_option("IN", o->in_dir, "model directory (params.json or config.json + safetensors)")->required();
  cmd->add_option("OUT", o->out_dir, "output directory (created; must not hold a model)")->required();
  cmd->callback([o, exit_code] {
    auto r = quantize_checkpoint(*o);
    if (!r.ok()) {
      ML4_LOG_ERROR("quantize: {}", r.status().message());
      *exit_code = 1;
      return;
    }
    ML4_LOG_INFO("quantize: wrote {} ({}): {} tensors, {} linears re-quantized, {:.3f} GB -> {:.3f} GB", o->out_dir,
                 o->to, r->tensors, r->quantized_linears, r->bytes_in / 1e9, r->bytes_out / 1e9);
  });
});

}  // namespace
}  // namespace ml4::cli

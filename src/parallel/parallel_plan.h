// ParallelPlan: what one rank holds and computes, derived from the LayerSpec and the sizes
// (SYSTEM.md S10). Both backends' runners consume it: the loader reads the rank's WeightShard,
// the model program (runtime/model_forward.h) runs on local_config() and issues the
// collectives the plan implies. The split is Megatron's, as vLLM applies it to DeepSeek-V3:
//
//   TP (tensor_parallel_size t):
//     - attention heads split (H / t per rank): wq or wq_b and wkv_b (so W_UK / W_UV) by head
//       rows, SSMax s_h by head, wo by head columns (row-parallel) + all-reduce;
//     - the query LoRA down-projection wq_a, wkv_a_with_mqa and the MLA latent (one KV head)
//       are replicated: every TP rank writes and reads the whole latent cache (which is why
//       decode context parallelism exists); the DSA indexer is replicated (vLLM's Indexer uses
//       ReplicatedLinear), so every rank selects the same keys;
//     - dense FFN and the shared experts column (w1, w3) / row (w2) split + all-reduce;
//     - without EP, each routed expert's hidden split the same way (vLLM's TP MoE);
//     - FFN hidden sizes are split in whole quantization blocks (128 for FP8-block
//       checkpoints, 1 for bf16), unevenly when the block count does not divide: the
//       all-reduce sums partial products, so ranks may hold different widths (ml4's experts
//       and shared expert, 5632 = 44 x 128, give 6 / 6 / 6 / 6 / 5 / 5 / 5 / 5 blocks at TP 8,
//       where vLLM's even split would refuse the FP8 blocks);
//     - vocabulary-parallel embedding (rows [v0, v0 + V/t), other ids give zeros, all-reduce)
//       and output head (each rank's V/t logits, all-gathered);
//     - the router is replicated.
//   EP (--enable-expert-parallel; ep = dp x t ranks): routed experts split in contiguous
//     ranges (the first E % ep ranks hold one more, vLLM's linear placement); each rank
//     dispatches its tokens to the experts' owners by all-to-all and combines the answers by
//     a second one. Under TP the tokens are replicated, so each TP rank dispatches its 1/t of
//     them and the TP all-reduce that follows the shared expert assembles the rest.
//   DP (data_parallel_size d, with EP): each DP rank runs attention for its own sequences
//     with its own KV cache; the experts are expert-parallel over all ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "kv/context_shard.h"
#include "model/model_config.h"
#include "model/weight_names.h"
#include "model/weight_shard.h"
#include "parallel/rank_layout.h"

namespace ml4 {

// Bytes of the stored weights one rank holds, by part.
struct RankWeightBytes {
  int64_t attention = 0;     // per-layer attention (incl. replicated down-projections, indexer)
  int64_t dense_ffn = 0;     // dense layers' FFN
  int64_t routed_experts = 0;
  int64_t shared_experts = 0;
  int64_t router = 0;
  int64_t embedding = 0;     // tok_embeddings + output (once when tied)
  int64_t norms = 0;         // norms and other small vectors
  int64_t drafter = 0;       // mtp_dspark.*: layers split as the target's, the rest replicated
  int64_t total() const {
    return attention + dense_ffn + routed_experts + shared_experts + router + embedding + norms + drafter;
  }
};

class ParallelPlan {
 public:
  // Checks that the model splits as asked (heads, vocabulary and FFN sizes divisible by t,
  // at least one routed expert per EP rank) and fixes this rank's share.
  static Result<ParallelPlan> make(const ModelConfig& cfg, const RankLayout& layout);

  const RankLayout& layout() const { return layout_; }
  int tp_size() const { return layout_.tp_size; }
  int tp_rank() const { return layout_.tp_rank; }
  int ep_size() const { return layout_.ep_size; }
  int ep_rank() const { return layout_.ep_rank; }
  bool expert_parallel() const { return layout_.config.enable_expert_parallel; }
  // Decode context parallelism: this rank's share of the sharded KV cache (kv/context_shard.h).
  ContextShard context_shard() const {
    return {layout_.dcp_size, layout_.dcp_rank, layout_.config.dcp_kv_cache_interleave_size};
  }
  bool dcp_all_to_all() const { return layout_.config.dcp_comm_backend == "a2a"; }

  // The shapes this rank computes: n_heads, hidden_dim and (TP without EP) the routed
  // experts' expert_hidden_dim are the local ones; everything else (vocab_size, the router's
  // num_experts) stays global.
  const ModelConfig& local_config() const { return local_; }
  const ModelConfig& global_config() const { return global_; }
  const WeightShard& shard() const { return shard_; }

  int64_t heads() const { return heads_; }
  int64_t head_begin() const { return head_begin_; }
  int64_t vocab() const { return vocab_; }              // output rows on this rank (V / t)
  int64_t vocab_begin() const { return vocab_begin_; }
  // Routed experts: owner of expert e, and this rank's contiguous range.
  int expert_owner(int e) const;
  int expert_begin_of(int ep_rank) const;
  int experts_of(int ep_rank) const;
  int expert_begin() const { return expert_begin_of(ep_rank()); }
  int experts() const { return experts_of(ep_rank()); }
  // Tokens [begin, end) of a T-token step this rank dispatches to the experts: all of them
  // without TP, its 1/t share under TP (tokens are replicated over the TP group).
  std::pair<int64_t, int64_t> dispatch_range(int64_t T) const;

  // Bytes of the checkpoint's stored weights this rank loads (expected_tensors of the config:
  // the preset's weight format, each tensor's slice counted exactly, scales included);
  // `drafter` counts mtp_dspark.* too.
  RankWeightBytes weight_bytes(bool drafter = false) const;
  // [begin, begin + count) of an FFN hidden size n this TP rank holds (whole blocks of
  // `unit`, the first ranks one block more when they do not divide).
  static std::pair<int64_t, int64_t> hidden_split(int64_t n, int64_t unit, int t, int q);
  // One line per part and the total, for `ml4 capacity`.
  std::string describe() const;

 private:
  // Stored bytes of the slice of tensor t this rank holds.
  int64_t bytes_on_rank(const ExpectedTensor& t) const;

  ModelConfig global_, local_;
  RankLayout layout_;
  WeightShard shard_;
  int64_t heads_ = 0, head_begin_ = 0, vocab_ = 0, vocab_begin_ = 0;
};

}  // namespace ml4

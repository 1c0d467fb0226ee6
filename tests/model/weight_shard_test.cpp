// Parallel weight shards (model/weight_shard.h): a row or column slice of a stored linear, in
// every format, decodes to exactly that block of the whole weight's decode; slices that would
// cut a quantization block are refused naming the tensor; and load_model_weights with a shard
// binds the rank's heads, FFN hidden slices, vocabulary rows and experts (checked against the
// whole model's weights, value for value).
#include "model/weight_shard.h"

#include <random>

#include <gtest/gtest.h>

#include "model/checkpoint.h"
#include "model/config_loader.h"
#include "model/model_weights.h"
#include "model/quant.h"
#include "model/random_checkpoint.h"
#include "model/temp_dir.h"
#include "model/tiny_rank_shard.h"

namespace ml4 {
namespace {

std::vector<float> block(const std::vector<float>& w, int64_t K, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
  std::vector<float> out;
  for (int64_t r = r0; r < r0 + nr; ++r)
    for (int64_t c = c0; c < c0 + nc; ++c) out.push_back(w[r * K + c]);
  return out;
}

TEST(WeightShard, SlicesDecodeToTheBlocksOfTheWhole) {
  const int64_t N = 384, K = 512;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  std::vector<float> src(N * K);
  for (auto& v : src) v = nd(rng);
  for (LinearFormat f : {LinearFormat::kF32, LinearFormat::kBF16, LinearFormat::kFP8Block, LinearFormat::kNVFP4,
                         LinearFormat::kMXFP4}) {
    SCOPED_TRACE(linear_format_name(f));
    auto w = quantize_linear(src.data(), N, K, f, "layers.0.attention.wo.weight");
    ASSERT_TRUE(w.ok()) << w.status().message();
    const std::vector<float> whole = dequantize_linear(*w);
    // Rows [128, 384) (the slice ends at N) and [0, 128); columns [256, 512) and [128, 256).
    for (auto [r0, nr] : {std::pair<int64_t, int64_t>{128, 256}, {0, 128}}) {
      auto s = slice_linear_rows(*w, r0, nr);
      ASSERT_TRUE(s.ok()) << s.status().message();
      EXPECT_EQ(s->out_features, nr);
      EXPECT_EQ(dequantize_linear(*s), block(whole, K, r0, nr, 0, K));
    }
    for (auto [c0, nc] : {std::pair<int64_t, int64_t>{256, 256}, {128, 128}}) {
      auto s = slice_linear_cols(*w, c0, nc);
      ASSERT_TRUE(s.ok()) << s.status().message();
      EXPECT_EQ(s->in_features, nc);
      EXPECT_EQ(dequantize_linear(*s), block(whole, K, 0, N, c0, nc));
    }
    // A row slice is a view of the whole's bytes; the whole may go away first.
    auto v = slice_linear_rows(*w, 256, 128);
    ASSERT_TRUE(v.ok());
    EXPECT_EQ(static_cast<const uint8_t*>(v->weight.data()),
              static_cast<const uint8_t*>(w->weight.data()) + 256 * (w->weight.nbytes() / N));
    LinearWeight keep = *v;
    w = Result<LinearWeight>(internal_error("gone"));
    EXPECT_EQ(dequantize_linear(keep), block(whole, K, 256, 128, 0, K));
  }
  // Slices that cut a block: FP8 128 x 128, MXFP4 groups of 32.
  auto fp8 = quantize_linear(src.data(), N, K, LinearFormat::kFP8Block, "layers.1.feed_forward.w2.weight");
  ASSERT_TRUE(fp8.ok());
  auto bad = slice_linear_cols(*fp8, 64, 256);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("layers.1.feed_forward.w2.weight"), std::string::npos) << bad.status().message();
  EXPECT_FALSE(slice_linear_rows(*fp8, 0, 200).ok());
  auto mx = quantize_linear(src.data(), N, K, LinearFormat::kMXFP4, "x");
  ASSERT_TRUE(mx.ok());
  EXPECT_FALSE(slice_linear_cols(*mx, 16, 64).ok());
  EXPECT_FALSE(slice_linear_rows(*mx, 300, 100).ok());  // past N
}

// ml4-tiny (H 4, hidden 512, 8 experts of 128, shared 128, vocab 512) as TP rank 1 of 2 with
// experts 4..7 (an EP shard) against the whole model.
TEST(WeightShard, LoaderBindsTheRanksSlices) {
  testing::TempDir dir;
  MakeModelOptions mo;
  mo.preset = "ml4-tiny";
  mo.out_dir = dir.str();
  mo.seed = 5;
  ASSERT_TRUE(make_model(mo).ok());
  auto cfg = load_model_config(dir.str());
  ASSERT_TRUE(cfg.ok());
  auto ck = Checkpoint::open(dir.str());
  ASSERT_TRUE(ck.ok());
  auto whole = load_model_weights(*cfg, *ck);
  ASSERT_TRUE(whole.ok()) << whole.status().message();
  const WeightShard s = testing::tiny_rank_shard();
  WeightLoadOptions wo;
  wo.shard = &s;
  auto part = load_model_weights(*cfg, *ck, wo);
  ASSERT_TRUE(part.ok()) << part.status().message();
  const ModelWeights& W = **whole;
  const ModelWeights& P = **part;
  const int64_t D = cfg->dim, dn = cfg->qk_nope_head_dim, dr = cfg->qk_rope_head_dim, dv = cfg->v_head_dim;
  const int64_t r = cfg->kv_lora_rank;
  EXPECT_EQ(P.tok_embeddings.dim(0), 256);
  EXPECT_EQ(dequantize_linear(P.output), block(dequantize_linear(W.output), D, 256, 256, 0, D));
  // Heads 2..3 of an attention: wq / wq_b rows, wo columns, W_UK / W_UV.
  auto expect_heads = [&](const AttentionWeights& a, const AttentionWeights& b) {
    const LinearWeight& wq = cfg->q_lora_rank > 0 ? a.wq_b : a.wq;
    const LinearWeight& pq = cfg->q_lora_rank > 0 ? b.wq_b : b.wq;
    EXPECT_EQ(dequantize_linear(pq), block(dequantize_linear(wq), wq.in_features, 2 * (dn + dr), 2 * (dn + dr), 0,
                                           wq.in_features));
    EXPECT_EQ(dequantize_linear(b.wo), block(dequantize_linear(a.wo), a.wo.in_features, 0, D, 2 * dv, 2 * dv));
    const WkvbSplit sa = split_wkv_b(a.wkv_b, static_cast<int>(dn), static_cast<int>(dv));
    const WkvbSplit sb = split_wkv_b(b.wkv_b, static_cast<int>(dn), static_cast<int>(dv));
    EXPECT_EQ(sb.w_uk, std::vector<float>(sa.w_uk.begin() + 2 * dn * r, sa.w_uk.end()));
    EXPECT_EQ(sb.w_uv, std::vector<float>(sa.w_uv.begin() + 2 * dv * r, sa.w_uv.end()));
    // add_absorb's shape check: the shard's wkv_b fits the rank's 2 heads, not the whole model.
    ModelConfig rank_cfg = *cfg;
    rank_cfg.n_heads = 2;
    EXPECT_TRUE(check_wkv_b_shape(rank_cfg, b.wkv_b).ok());
    EXPECT_TRUE(check_wkv_b_shape(*cfg, a.wkv_b).ok());
    const Status st = check_wkv_b_shape(*cfg, b.wkv_b);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("wkv_b is ["), std::string::npos) << st.message();
  };
  for (int l : {0, 2, 7}) {  // dense, MoE + SSMax reuser, KV consumer
    SCOPED_TRACE(l);
    const auto& a = W.layers[l].attn;
    const auto& b = P.layers[l].attn;
    expect_heads(a, b);
    if (cfg->layers[l].ssmax) {
      EXPECT_EQ(b.ssmax_s, std::vector<float>(a.ssmax_s.begin() + 2, a.ssmax_s.end()));
    }
    if (cfg->layers[l].owns_kv()) {
      EXPECT_EQ(dequantize_linear(b.wkv_a), dequantize_linear(a.wkv_a));  // replicated
    }
  }
  const auto& d = P.layers[0].ffn.dense;
  EXPECT_EQ(dequantize_linear(d.w1), block(dequantize_linear(W.layers[0].ffn.dense.w1), D, 256, 256, 0, D));
  EXPECT_EQ(dequantize_linear(d.w2), block(dequantize_linear(W.layers[0].ffn.dense.w2), 512, 0, D, 256, 256));
  const auto& F = P.layers[1].ffn;
  ASSERT_EQ(F.experts.size(), 4u);
  for (int e = 0; e < 4; ++e) EXPECT_EQ(dequantize_linear(F.experts[e].w3), dequantize_linear(W.layers[1].ffn.experts[4 + e].w3));
  EXPECT_EQ(dequantize_linear(F.shared->w2), block(dequantize_linear(W.layers[1].ffn.shared->w2), 128, 0, D, 64, 64));
  EXPECT_EQ(dequantize_linear(F.gate), dequantize_linear(W.layers[1].ffn.gate));  // the router is replicated
  // The DSpark drafter's layers split as the target's (heads, FFN hidden); the rest is replicated.
  WeightLoadOptions wd;
  wd.load_drafter = true;
  auto whole_d = load_model_weights(*cfg, *ck, wd);
  ASSERT_TRUE(whole_d.ok()) << whole_d.status().message();
  wd.shard = &s;
  auto part_d = load_model_weights(*cfg, *ck, wd);
  ASSERT_TRUE(part_d.ok()) << part_d.status().message();
  const DrafterWeights& WD = *(*whole_d)->drafter;
  const DrafterWeights& PD = *(*part_d)->drafter;
  ASSERT_EQ(PD.layers.size(), WD.layers.size());
  for (size_t j = 0; j < WD.layers.size(); ++j) {
    const auto& a = WD.layers[j].attn;
    const auto& b = PD.layers[j].attn;
    expect_heads(a, b);
    EXPECT_EQ(dequantize_linear(b.wkv_a), dequantize_linear(a.wkv_a));  // replicated
    const auto& fw = WD.layers[j].ffn;
    const auto& fp = PD.layers[j].ffn;
    EXPECT_EQ(dequantize_linear(fp.w1), block(dequantize_linear(fw.w1), D, 256, 256, 0, D));
    EXPECT_EQ(dequantize_linear(fp.w2), block(dequantize_linear(fw.w2), 512, 0, D, 256, 256));
  }
  EXPECT_EQ(dequantize_linear(PD.fc), dequantize_linear(WD.fc));                  // replicated
  EXPECT_EQ(dequantize_linear(PD.markov_out), dequantize_linear(WD.markov_out));  // replicated
}

}  // namespace
}  // namespace ml4

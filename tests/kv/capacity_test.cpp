// `ml4 capacity` and the presets: the full ml4 shape must give MODEL.md section 1's
// 47,136 / 42,096 / 78,384 B per token. The CLI part runs the built binary ($ML4_BIN, set
// by ctest) and is skipped when it is not there.
#include <array>
#include <cctype>
#include <cstdio>
#include <string>

#include <unistd.h>

#include <gtest/gtest.h>

#include "kv/cache_spec.h"
#include "model/presets.h"

namespace ml4 {
namespace {

TEST(Capacity, Ml4PresetByteCounts) {
  auto cfg = preset_config("ml4");
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  const std::pair<KvCacheDtype, int64_t> cases[] = {
      {KvCacheDtype::kFp8DsMla, 47136}, {KvCacheDtype::kFp8, 42096}, {KvCacheDtype::kBf16, 78384}};
  for (const auto& [dtype, bytes] : cases) {
    auto spec = make_kv_cache_spec(*cfg, dtype);
    ASSERT_TRUE(spec.ok()) << spec.status().message();
    EXPECT_EQ(spec->bytes_per_token(), bytes) << kv_cache_dtype_name(dtype);
    EXPECT_EQ(spec->groups[0].layers.size(), 63u);
    EXPECT_EQ(spec->groups[1].layers.size(), 44u);
  }
}

// Runs a command, returns (exit status, stdout + stderr).
std::pair<int, std::string> run(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return {-1, out};
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string ml4_bin() {
  const char* env = std::getenv("ML4_BIN");
  std::string bin = env ? env : std::string(ML4_BINARY_DIR) + "/ml4";
  return access(bin.c_str(), X_OK) == 0 ? bin : std::string();
}

TEST(Capacity, CliPrintsTheThreeTotals) {
  const std::string bin = ml4_bin();
  if (bin.empty()) GTEST_SKIP() << "ml4 binary not built";
  const std::pair<const char*, const char*> cases[] = {
      {"fp8_ds_mla", "total: 47,136 B/token"}, {"auto", "total: 47,136 B/token"},
      {"fp8", "total: 42,096 B/token"}, {"bf16", "total: 78,384 B/token"}};
  for (const auto& [dtype, want] : cases) {
    auto [rc, out] = run(bin + " capacity --preset ml4 --kv-cache-dtype " + dtype + " --gib 100");
    EXPECT_EQ(rc, 0) << out;
    EXPECT_NE(out.find(want), std::string::npos) << out;
  }
  auto [rc, out] = run(bin + " capacity --preset ml4 --kv-cache-dtype fp16");
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("fp8_ds_mla"), std::string::npos) << out;
  auto [rc2, out2] = run(bin + " capacity --kv-cache-dtype fp8");
  EXPECT_NE(rc2, 0);
}

// Decode context parallelism shards the KV by token: -tp 8 -dcp 8 holds exactly 8x the tokens
// of -tp 8 (the seed: 2.38M -> 18.88M), every rank the same pool.
int64_t tokens_after(const std::string& out, const std::string& label) {
  const size_t at = out.find(label);
  if (at == std::string::npos) return -1;
  std::string digits;
  for (size_t i = at + label.size(); i < out.size() && (std::isdigit(static_cast<unsigned char>(out[i])) || out[i] == ','); ++i)
    if (out[i] != ',') digits += out[i];
  return digits.empty() ? -1 : std::stoll(digits);
}

TEST(Capacity, DcpHoldsExactlyNTimesTheTokens) {
  const std::string bin = ml4_bin();
  if (bin.empty()) GTEST_SKIP() << "ml4 binary not built";
  auto [rc1, tp8] = run(bin + " capacity --preset ml4 -tp 8");
  auto [rc2, dcp8] = run(bin + " capacity --preset ml4 -tp 8 -dcp 8");
  ASSERT_EQ(rc1, 0) << tp8;
  ASSERT_EQ(rc2, 0) << dcp8;
  const int64_t base = tokens_after(tp8, "KV tokens in all: ");
  ASSERT_GT(base, 0) << tp8;
  EXPECT_EQ(tokens_after(dcp8, "KV tokens per rank: "), base) << dcp8;
  EXPECT_EQ(tokens_after(dcp8, "KV tokens in all: "), 8 * base) << dcp8;
  EXPECT_NE(dcp8.find("DSpark x DCP 8"), std::string::npos) << dcp8;
  auto [rc3, bad] = run(bin + " capacity --preset ml4 -tp 4 -dcp 8");
  EXPECT_NE(rc3, 0);
  EXPECT_NE(bad.find("must divide --tensor-parallel-size"), std::string::npos) << bad;
}

}  // namespace
}  // namespace ml4

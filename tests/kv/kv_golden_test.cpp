// fp8_ds_mla rows and an indexer page against golden bytes written by gen_kv_golden.py
// (numpy + ml_dtypes, following vLLM's cache kernels; no ml4 code involved). Inputs are
// regenerated here bit-exactly from the same 64-bit LCG. Bytes must match exactly.
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "kv/indexer_layout.h"
#include "kv/latent_layout.h"

namespace ml4 {
namespace {

// Same generator as gen_kv_golden.py's Lcg.
class Lcg {
 public:
  explicit Lcg(uint64_t seed) : s_(seed) {}
  uint32_t next32() {
    s_ = s_ * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(s_ >> 32);
  }
  float value(int emin, int emax) {
    const uint32_t a = next32(), b = next32();
    const int e = emin + static_cast<int>(a % static_cast<uint32_t>(emax - emin + 1));
    return bits_to_f32(((a >> 31) << 31) | (static_cast<uint32_t>(127 + e) << 23) | (b & 0x7fffffu));
  }
  std::vector<float> values(int n, int emin, int emax) {
    std::vector<float> v(n);
    for (auto& x : v) x = value(emin, emax);
    return v;
  }

 private:
  uint64_t s_;
};

std::vector<uint8_t> read_golden(const std::string& name) {
  std::ifstream f(std::string(ML4_SOURCE_DIR) + "/tests/kv/golden/" + name, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

TEST(KvGolden, DsMlaRowsMatchVllmRule) {
  const auto golden = read_golden("ds_mla_rows.bin");
  ASSERT_EQ(golden.size(), 8u * 656u) << "tests/kv/golden/ds_mla_rows.bin missing or truncated";
  Lcg lcg(20261202);
  std::vector<uint8_t> row(656);
  for (int t = 0; t < 8; ++t) {
    auto c = lcg.values(512, -12, 3);
    auto kr = lcg.values(64, -8, 4);
    encode_latent(KvCacheDtype::kFp8DsMla, c.data(), kr.data(), 512, 64, 1.0f, row.data());
    for (int i = 0; i < 656; ++i) ASSERT_EQ(row[i], golden[t * 656 + i]) << "token " << t << " byte " << i;
  }
}

TEST(KvGolden, IndexerPageMatchesVllmRule) {
  const auto golden = read_golden("indexer_page.bin");
  ASSERT_EQ(golden.size(), indexer_page_bytes(128)) << "tests/kv/golden/indexer_page.bin missing or truncated";
  Lcg lcg(132);
  auto keys = lcg.values(64 * 128, -14, 2);
  std::vector<uint8_t> page(indexer_page_bytes(128));
  for (int t = 63; t >= 0; --t) encode_indexer_key(keys.data() + t * 128, 128, page.data(), t);
  for (size_t i = 0; i < page.size(); ++i) ASSERT_EQ(page[i], golden[i]) << "byte " << i;
}

}  // namespace
}  // namespace ml4

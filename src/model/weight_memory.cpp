#include "model/weight_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <vector>

#include "core/threads.h"

namespace ml4 {
namespace {

constexpr uint64_t kHugePage = 2ull << 20;
constexpr uint64_t kAlign = 64;

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

void for_each_attention_linear(AttentionWeights& a, const std::function<void(LinearWeight&)>& fn) {
  for (LinearWeight* l : {&a.wq, &a.wq_a, &a.wq_b, &a.wkv_a, &a.wkv_b, &a.wo}) fn(*l);
  if (a.indexer) {
    fn(a.indexer->wq);
    fn(a.indexer->wk);
    fn(a.indexer->weights_proj);
  }
}

void for_each_mlp_linear(MlpWeights& m, const std::function<void(LinearWeight&)>& fn) {
  fn(m.w1);
  fn(m.w2);
  fn(m.w3);
}

// An anonymous mapping, unmapped when the last view of it dies.
struct Region {
  void* addr = nullptr;
  size_t len = 0;
  ~Region() {
    if (addr != nullptr) munmap(addr, len);
  }
};

}  // namespace

void for_each_linear(const ModelWeights& w, const std::function<void(const LinearWeight&)>& fn) {
  for_each_linear(const_cast<ModelWeights&>(w), [&](LinearWeight& l) { fn(l); });
}

void for_each_linear(ModelWeights& w, const std::function<void(LinearWeight&)>& fn) {
  fn(w.output);
  for (LayerWeights& l : w.layers) {
    for_each_attention_linear(l.attn, fn);
    for_each_mlp_linear(l.ffn.dense, fn);
    fn(l.ffn.gate);
    for (MlpWeights& e : l.ffn.experts) for_each_mlp_linear(e, fn);
    if (l.ffn.shared) for_each_mlp_linear(*l.ffn.shared, fn);
  }
  if (w.drafter) {
    DrafterWeights& d = *w.drafter;
    fn(d.fc);
    for (DrafterLayerWeights& l : d.layers) {
      for_each_attention_linear(l.attn, fn);
      for_each_mlp_linear(l.ffn, fn);
    }
    for (LinearWeight* l : {&d.markov_ih, &d.markov_hh, &d.markov_out}) fn(*l);
  }
}

Result<WeightCopyReport> copy_linears_to_memory(ModelWeights& w) {
  const auto t0 = std::chrono::steady_clock::now();
  // Distinct source byte ranges, keyed by address (a tied head's rows are the embedding's).
  std::map<const void*, std::pair<uint64_t, uint64_t>> place;  // src -> (bytes, offset)
  uint64_t total = 0;
  auto plan = [&](const Tensor& t) {
    if (t.empty() || t.nbytes() == 0) return;
    auto& bytes = place.try_emplace(t.data(), 0, 0).first->second.first;
    bytes = std::max<uint64_t>(bytes, t.nbytes());  // views sharing a start: the longest wins
  };
  for_each_linear(w, [&](LinearWeight& l) {
    plan(l.weight);
    plan(l.scale);
  });
  for (auto& [src, bo] : place) {
    bo.second = total;
    total += round_up(bo.first, kAlign);
  }
  WeightCopyReport rep;
  if (total == 0) return rep;

  // Map 2 MiB more than needed and start at a 2 MiB boundary, so the region is whole huge pages.
  const size_t len = round_up(total, kHugePage) + kHugePage;
  void* addr = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (addr == MAP_FAILED)
    return resource_exhausted("--no-mmap: cannot map {:.2f} GB of anonymous memory for the linear weights: {}",
                              len / 1e9, std::strerror(errno));
  auto region = std::make_shared<Region>();
  region->addr = addr;
  region->len = len;
  auto* base = reinterpret_cast<uint8_t*>(round_up(reinterpret_cast<uintptr_t>(addr), kHugePage));
#if defined(MADV_HUGEPAGE)
  rep.huge_pages = madvise(base, round_up(total, kHugePage), MADV_HUGEPAGE) == 0;
#endif
  // In 2 MiB pieces over the pool: first-touch faults (a huge page's allocation and zeroing,
  // and in a VM the host's own fault) dominate the copy, and they run per core.
  struct Piece {
    const uint8_t* src;
    uint8_t* dst;
    uint64_t bytes;
  };
  std::vector<Piece> pieces;
  for (const auto& [src, bo] : place)
    for (uint64_t o = 0; o < bo.first; o += kHugePage)
      pieces.push_back({static_cast<const uint8_t*>(src) + o, base + bo.second + o, std::min(kHugePage, bo.first - o)});
  parallel_for(static_cast<int64_t>(pieces.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].bytes);
  });
  if (mprotect(addr, len, PROT_READ) != 0)
    return internal_error("--no-mmap: mprotect of the weight region failed: {}", std::strerror(errno));

  std::shared_ptr<const void> keep(region, region->addr);
  auto repoint = [&](Tensor& t) {
    if (t.empty() || t.nbytes() == 0) return;
    t = Tensor::view(t.dtype(), t.shape(), base + place.at(t.data()).second, keep);
  };
  for_each_linear(w, [&](LinearWeight& l) {
    repoint(l.weight);
    repoint(l.scale);
  });
  rep.bytes = total;
  rep.tensors = static_cast<int>(place.size());
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

bool copy_pays_off(const Checkpoint& ck) {
  uint64_t need = 0;
  for (const auto& f : ck.files()) need += f->data_bytes();
  if (need < kCopyMinBytes) return false;
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream s(line);
    std::string key;
    uint64_t kib = 0;
    s >> key >> kib;
    if (key == "MemAvailable:") return need <= kib * 1024 / 2;
  }
  return false;
}

}  // namespace ml4

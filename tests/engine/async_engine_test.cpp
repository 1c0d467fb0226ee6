// AsyncEngine: streams, bounded admission, abort frees blocks within a step, and a failed
// or hung runner makes health() fail instead of hanging.
#include <gtest/gtest.h>

#include <thread>

#include "engine/async_engine.h"
#include "engine/fake_runner.h"

namespace ml4 {
namespace {

using testing::FakeRunner;
using namespace std::chrono_literals;
constexpr int kVocab = 1300;

GenerateRequest greq(const std::string& id, int max_tokens) {
  GenerateRequest g;
  g.request_id = id;
  g.prompt = {1000 + 'h', 1000 + 'i', 1000 + '!', 5, 6};
  g.params.temperature = 0.0;
  g.params.max_tokens = max_tokens;
  g.params.ignore_eos = true;
  return g;
}

struct Fixture {
  FakeRunner runner{kVocab, FakeRunner::two_groups(256)};
  ByteTextCodec codec{kVocab};
  std::unique_ptr<AsyncEngine> async;
  explicit Fixture(size_t max_live, double hang_s = 60.0) {
    EngineConfig c;
    c.scheduler.max_model_len = 512;
    AsyncEngine::Options o;
    o.max_live = max_live;
    o.hang_timeout_s = hang_s;
    async = std::make_unique<AsyncEngine>(std::make_unique<Engine>(&runner, &codec, c), o);
    async->start();
  }
};

std::vector<StreamItem> collect(OutputStream& s) {
  std::vector<StreamItem> items;
  for (int i = 0; i < 2000 && !s.done(); ++i)
    if (auto it = s.next(10ms)) items.push_back(std::move(*it));
  return items;
}

TEST(AsyncEngine, StreamsEveryChoiceToTheEnd) {
  Fixture f(8);
  auto s = f.async->submit({greq("a-0", 7), greq("a-1", 7)});
  ASSERT_TRUE(s.ok()) << s.status().message();
  auto items = collect(*s.value());
  std::vector<int> tokens(2, 0), finished(2, 0);
  for (auto& it : items) {
    tokens[it.index] += static_cast<int>(it.out.new_tokens.size());
    finished[it.index] += it.out.finished;
  }
  EXPECT_EQ(tokens, (std::vector<int>{7, 7}));
  EXPECT_EQ(finished, (std::vector<int>{1, 1}));
  EXPECT_TRUE(f.async->health().ok);
  for (int i = 0; i < 100 && !f.async->idle(); ++i) std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(f.async->idle());
}

TEST(AsyncEngine, BoundedAdmissionAndAbortFreesBlocks) {
  Fixture f(3);
  f.runner.delay_ms_ = 5;
  auto a = f.async->submit({greq("x", 400), greq("y", 400)});
  ASSERT_TRUE(a.ok());
  auto full = f.async->submit({greq("z0", 4), greq("z1", 4)});
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  auto bad = f.async->submit({greq("w", 100000)});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  std::this_thread::sleep_for(50ms);
  f.async->abort(a.value());
  auto items = collect(*a.value());
  ASSERT_FALSE(items.empty());
  EXPECT_EQ(items.back().out.finish_reason, FinishReason::kAbort);
  for (int i = 0; i < 100 && f.async->snapshot().groups[0].free_blocks != 256; ++i) std::this_thread::sleep_for(5ms);
  auto snap = f.async->snapshot();
  EXPECT_EQ(snap.groups[0].free_blocks, 256);
  EXPECT_EQ(snap.groups[1].free_blocks, 256);
  EXPECT_TRUE(f.async->idle());
}

TEST(AsyncEngine, HungStepFailsHealthAndFailureStopsLoop) {
  Fixture f(8, 0.2);
  f.runner.delay_ms_ = 1200;
  auto s = f.async->submit({greq("slow", 2)});
  ASSERT_TRUE(s.ok());
  std::this_thread::sleep_for(700ms);
  EngineHealth h = f.async->health();
  EXPECT_FALSE(h.ok);
  EXPECT_NE(h.reason.find("running for"), std::string::npos) << h.reason;
  f.runner.delay_ms_ = 0;
  f.runner.fail_ = true;
  auto items = collect(*s.value());
  ASSERT_FALSE(items.empty());
  EXPECT_EQ(items.back().out.finish_reason, FinishReason::kError);
  EXPECT_NE(items.back().out.error.find("injected"), std::string::npos);
  EXPECT_FALSE(f.async->health().ok);
  EXPECT_FALSE(f.async->submit({greq("after", 2)}).ok());
}

}  // namespace
}  // namespace ml4

// OpenAiServer over a real socket with the FakeRunner (tests/engine/fake_runner.h): a hung
// engine step makes /health answer 503 promptly instead of hanging, a failed step stops the
// engine and new generation requests get 503, and drain_and_stop() ends serve().
#include <gtest/gtest.h>

#include <httplib.h>

#include <chrono>
#include <thread>

#include "engine/async_engine.h"
#include "engine/fake_runner.h"
#include "server/http_server.h"

namespace ml4 {
namespace {

using namespace std::chrono_literals;

TEST(HttpServer, HealthFailsFastOnHungOrDeadEngine) {
  testing::FakeRunner runner(1300, testing::FakeRunner::two_groups(128));
  ByteTextCodec codec(1300);
  EngineConfig ec;
  ec.scheduler.max_model_len = 256;
  auto engine = std::make_unique<Engine>(&runner, &codec, ec);
  ServerMetrics metrics("fake");
  engine->set_observer(&metrics);
  AsyncEngine::Options ao;
  ao.hang_timeout_s = 0.3;
  AsyncEngine async(std::move(engine), ao);
  ServerOptions so;
  so.port = 0;
  so.served_model_name = "fake";
  so.http_threads = 8;
  OpenAiServer server(&async, &codec, &metrics, so);
  ASSERT_TRUE(server.bind().ok());
  async.start();
  std::thread serving([&] { EXPECT_TRUE(server.serve().ok()); });

  httplib::Client cli("127.0.0.1", server.bound_port());
  cli.set_read_timeout(5, 0);
  auto h = cli.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto ok = cli.Post("/v1/completions", R"({"prompt":"hi","max_tokens":3,"temperature":0})", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;

  // A step that takes 2 s: /health must say so within the hang timeout, and answer fast.
  runner.delay_ms_ = 2000;
  std::thread slow([&] {
    httplib::Client c2("127.0.0.1", server.bound_port());
    c2.set_read_timeout(10, 0);
    c2.Post("/v1/completions", R"({"prompt":"hi","max_tokens":2})", "application/json");
  });
  std::this_thread::sleep_for(700ms);
  auto t0 = std::chrono::steady_clock::now();
  h = cli.Get("/health");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  EXPECT_NE(h->body.find("running for"), std::string::npos) << h->body;
  EXPECT_LT(took, 1.0);  // the step still has >1 s to go: health did not wait for it
  // Then the step fails: the engine stops, health stays 503, generation answers 503.
  runner.fail_ = true;
  slow.join();
  runner.delay_ms_ = 0;
  h = cli.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  EXPECT_NE(h->body.find("engine loop stopped"), std::string::npos) << h->body;
  auto after = cli.Post("/v1/completions", R"({"prompt":"hi","max_tokens":2})", "application/json");
  ASSERT_TRUE(after);
  EXPECT_EQ(after->status, 503) << after->body;
  auto m = cli.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->body.find("vllm:request_success_total{model_name=\"fake\",finished_reason=\"error\"} 1"),
            std::string::npos);

  server.drain_and_stop(1.0);
  serving.join();
  async.stop();
}

}  // namespace
}  // namespace ml4

// The bounded grid barrier and the sticky fault word (ops/cuda/fault.h, issue 19's fault test):
// the barrier really synchronises every block (each block reads its neighbour's value of the
// round, 2,000 barriers); a block that never arrives makes the others' waits run out within
// the bound, the fault names the wait, the kernel ends and the card keeps working; the record
// is sticky; and a process whose kernel faulted exits cleanly while the card serves the next
// process.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include <unistd.h>

#include "cuda_test_util.h"
#include "ops/cuda/fault.h"

namespace ml4::cuda {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A probe of `rounds` rounds on every multiprocessor that must run clean: no fault, every
// neighbour value right, every block through every round.
void expect_clean_probe(const FaultWord& fw, int rounds) {
  BarrierProbe p;
  p.rounds = rounds;
  auto r = run_barrier_probe(p, fw, nullptr);
  ML4_ASSERT_OK(r.status());
  EXPECT_EQ(r->mismatches, 0);
  EXPECT_EQ(r->min_rounds, rounds);
  EXPECT_FALSE(fw.raised());
}

TEST(CudaFault, GridBarrierSynchronisesEveryBlock) {
  ML4_REQUIRE_GPU();
  auto fw = FaultWord::create();
  ML4_ASSERT_OK(fw.status());
  for (int blocks : {2, 0}) {  // 0: one per multiprocessor
    BarrierProbe p;
    p.blocks = blocks;
    p.rounds = 1000;
    auto r = run_barrier_probe(p, *fw, nullptr);
    ML4_ASSERT_OK(r.status());
    EXPECT_EQ(r->mismatches, 0) << r->blocks << " blocks";
    EXPECT_EQ(r->min_rounds, 1000);
    EXPECT_FALSE(fw->raised());
    EXPECT_TRUE(fw->status("probe").ok());
  }
  // More blocks than can be resident at once: refused before any launch, not a hang.
  BarrierProbe big;
  big.blocks = 1 << 20;
  EXPECT_FALSE(run_barrier_probe(big, *fw, nullptr).ok());
}

TEST(CudaFault, BlockThatNeverArrivesFaultsWithinTheBound) {
  ML4_REQUIRE_GPU();
  auto fw = FaultWord::create();
  ML4_ASSERT_OK(fw.status());
  BarrierProbe p;
  p.rounds = 100;
  p.never_arrive_block = 5;
  p.timeout_ns = 200'000'000;  // 200 ms
  const auto t0 = Clock::now();
  auto r = run_barrier_probe(p, *fw, nullptr);
  const double took = seconds_since(t0);
  ML4_ASSERT_OK(r.status());  // the kernel ended by itself: the stream is fine
  // The waits ran out: not before the bound, and well before a hang (1 s of slack for the
  // launch and the polling of the other blocks).
  EXPECT_GE(took, 0.2);
  EXPECT_LT(took, 1.2);
  const DeviceFault f = fw->read();
  EXPECT_EQ(f.code, kFaultWaitTimeout);
  EXPECT_NE(f.block, 5u);               // a block that was waiting, not the absent one
  EXPECT_EQ(f.site, 2u * (100 / 2));    // the first barrier of round 50
  EXPECT_GE(f.waited_us, 200'000u);
  EXPECT_LT(f.waited_us, 1'200'000u);
  EXPECT_EQ(r->min_rounds, 50);
  EXPECT_EQ(r->mismatches, 0);  // every round before the fault was exact
  const Status st = fw->status("decode step");
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("never arrived"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("decode step"), std::string::npos) << st.message();

  // Sticky: a second fault (another block absent) leaves the first record, and the waiting
  // blocks stop at once because a fault is recorded (well inside this launch's 5 s bound).
  p.never_arrive_block = 9;
  p.timeout_ns = 5'000'000'000;
  const auto t1 = Clock::now();
  auto r2 = run_barrier_probe(p, *fw, nullptr);
  ML4_ASSERT_OK(r2.status());
  EXPECT_LT(seconds_since(t1), 1.0);
  const DeviceFault g = fw->read();
  EXPECT_EQ(g.code, f.code);
  EXPECT_EQ(g.block, f.block);
  EXPECT_EQ(g.waited_us, f.waited_us);

  // The card serves the next launch: cleared, the probe runs clean.
  fw->clear();
  expect_clean_probe(*fw, 200);
  ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "after the fault"));
}

// The process-level half: a child process (this binary, the test above only) faults and must
// exit 0 by itself; then this process, a different CUDA context, runs a clean probe.
TEST(CudaFault, CardServesTheNextProcessAfterAFault) {
  ML4_REQUIRE_GPU();
  const auto t0 = Clock::now();
  char self[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  const std::string cmd = std::string("'") + self +
                          "' --gtest_filter=CudaFault.BlockThatNeverArrivesFaultsWithinTheBound > /dev/null 2>&1";
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(rc, 0) << "the faulting process did not exit cleanly";
  EXPECT_LT(seconds_since(t0), 60.0);
  auto fw = FaultWord::create();
  ML4_ASSERT_OK(fw.status());
  expect_clean_probe(*fw, 200);
}

}  // namespace
}  // namespace ml4::cuda

// The MPI communicator (parallel/mpi_communicator.h) on N ranks: every collective on fresh
// random data against the result computed from all ranks' inputs (each rank regenerates any
// rank's input from its seed), over the world and over TP-like subgroups; all-reduce leaves
// the same bytes on every rank (the forward's routing relies on it); a failed group refuses
// further work with its message.
#include <random>

#include <gtest/gtest.h>

#include "parallel/mpi/harness.h"
#include "parallel/mpi_communicator.h"

namespace ml4 {
namespace {

std::vector<float> data_of(int rank, int64_t n, uint64_t salt) {
  std::mt19937_64 rng(salt * 1000003 + rank);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

std::unique_ptr<MpiCommunicator> split(int color) {
  MpiEnv* env = MpiEnv::get();
  auto c = env->split(color, env->rank());
  EXPECT_TRUE(c.ok());
  return std::make_unique<MpiCommunicator>(env, *c);
}

// Group-rank -> world-rank map of a split by `color_of`.
std::vector<int> members(int world, int color, const std::function<int(int)>& color_of) {
  std::vector<int> m;
  for (int r = 0; r < world; ++r)
    if (color_of(r) == color) m.push_back(r);
  return m;
}

void check_collectives(Communicator& c, const std::vector<int>& world_of, uint64_t salt) {
  const int n = c.size(), me = c.rank();
  ASSERT_EQ(static_cast<int>(world_of.size()), n);
  const int64_t N = 1000 + 17 * salt;  // not a multiple of anything
  // all-reduce, and the same bytes everywhere
  std::vector<float> x = data_of(world_of[me], N, salt);
  ASSERT_TRUE(c.all_reduce_sum(x.data(), N).ok());
  std::vector<double> ref(N, 0.0);
  for (int p = 0; p < n; ++p) {
    auto d = data_of(world_of[p], N, salt);
    for (int64_t i = 0; i < N; ++i) ref[i] += d[i];
  }
  double err = 0.0;
  for (int64_t i = 0; i < N; ++i) err = std::max(err, std::abs(x[i] - ref[i]));
  EXPECT_LT(err, n * 2e-7 * 2.0);  // n - 1 f32 additions of values < 1 in magnitude: < n ulps of n
  std::vector<float> all(static_cast<size_t>(N) * n);
  ASSERT_TRUE(c.all_gather(x.data(), all.data(), N * 4).ok());
  for (int p = 0; p < n; ++p)
    EXPECT_EQ(0, std::memcmp(all.data() + p * N, x.data(), N * 4)) << "rank " << p << " summed to other bytes";
  // all-gather in place
  std::vector<float> g(static_cast<size_t>(N) * n);
  auto mine = data_of(world_of[me], N, salt + 1);
  std::copy(mine.begin(), mine.end(), g.begin() + me * N);
  ASSERT_TRUE(c.all_gather(g.data() + me * N, g.data(), N * 4).ok());
  for (int p = 0; p < n; ++p) EXPECT_EQ(std::vector<float>(g.begin() + p * N, g.begin() + (p + 1) * N), data_of(world_of[p], N, salt + 1));
  // reduce-scatter: recv = sum_p send_p[me]
  auto send = data_of(world_of[me], N * n, salt + 2);
  std::vector<float> rs(N);
  ASSERT_TRUE(c.reduce_scatter_sum(send.data(), rs.data(), N).ok());
  err = 0.0;
  for (int64_t i = 0; i < N; ++i) {
    double s = 0.0;
    for (int p = 0; p < n; ++p) s += data_of(world_of[p], N * n, salt + 2)[me * N + i];
    err = std::max(err, std::abs(rs[i] - s));
  }
  EXPECT_LT(err, n * 4e-7);
  // all-to-all: recv[p] = p's send[me]
  auto a2a = data_of(world_of[me], 8 * n, salt + 3);
  std::vector<float> got(8 * n);
  ASSERT_TRUE(c.all_to_all(a2a.data(), got.data(), 8 * 4).ok());
  for (int p = 0; p < n; ++p) {
    auto theirs = data_of(world_of[p], 8 * n, salt + 3);
    EXPECT_EQ(std::vector<float>(got.begin() + p * 8, got.begin() + (p + 1) * 8),
              std::vector<float>(theirs.begin() + me * 8, theirs.begin() + (me + 1) * 8));
  }
  // all-to-all-v: rank a sends (a + 2b + 1) floats to b (some peers get many, sizes differ
  // both ways); counts through exchange_counts.
  std::vector<int64_t> sn(n), rn;
  for (int b = 0; b < n; ++b) sn[b] = world_of[me] + 2 * world_of[b] + 1;
  ASSERT_TRUE(c.exchange_counts(sn, &rn).ok());
  for (int a = 0; a < n; ++a) EXPECT_EQ(rn[a], world_of[a] + 2 * world_of[me] + 1);
  std::vector<float> sv, rv;
  std::vector<int64_t> sb(n), rb(n);
  for (int b = 0; b < n; ++b) {
    auto d = data_of(world_of[me] * 100 + world_of[b], sn[b], salt + 4);
    sv.insert(sv.end(), d.begin(), d.end());
    sb[b] = sn[b] * 4;
    rb[b] = rn[b] * 4;
  }
  int64_t total = 0;
  for (int a = 0; a < n; ++a) total += rn[a];
  rv.resize(total);
  ASSERT_TRUE(c.all_to_all_v(sv.data(), sb, rv.data(), rb).ok());
  int64_t off = 0;
  for (int a = 0; a < n; ++a) {
    EXPECT_EQ(std::vector<float>(rv.begin() + off, rv.begin() + off + rn[a]),
              data_of(world_of[a] * 100 + world_of[me], rn[a], salt + 4));
    off += rn[a];
  }
  // broadcast from the last rank, send / recv around a ring
  auto b = me == n - 1 ? data_of(world_of[n - 1], 33, salt + 5) : std::vector<float>(33, 0.0f);
  ASSERT_TRUE(c.broadcast(b.data(), 33 * 4, n - 1).ok());
  EXPECT_EQ(b, data_of(world_of[n - 1], 33, salt + 5));
  if (n > 1) {
    auto out = data_of(world_of[me], 21, salt + 6);
    std::vector<float> in(21);
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    // Even ranks send first: no two ranks wait on each other.
    if (me % 2 == 0) {
      ASSERT_TRUE(c.send(out.data(), 21 * 4, next).ok());
      ASSERT_TRUE(c.recv(in.data(), 21 * 4, prev).ok());
    } else {
      ASSERT_TRUE(c.recv(in.data(), 21 * 4, prev).ok());
      ASSERT_TRUE(c.send(out.data(), 21 * 4, next).ok());
    }
    EXPECT_EQ(in, data_of(world_of[prev], 21, salt + 6));
  }
  EXPECT_GT(c.stats().calls, 0);
}

TEST(MpiCommunicator, CollectivesOverTheWorldAndSubgroups) {
  const int W = mpitest::world();
  ASSERT_GE(W, 2) << "run under mpirun -np 2 or more";
  auto world = split(0);
  std::vector<int> all(W);
  for (int r = 0; r < W; ++r) all[r] = r;
  check_collectives(*world, all, 1);
  // TP-like groups of 2 consecutive ranks, and DP-like groups of ranks with the same parity.
  auto pair_of = [](int r) { return r / 2; };
  auto pair = split(pair_of(mpitest::rank()));
  check_collectives(*pair, members(W, pair_of(mpitest::rank()), pair_of), 2);
  auto parity_of = [](int r) { return r % 2; };
  auto parity = split(parity_of(mpitest::rank()));
  check_collectives(*parity, members(W, parity_of(mpitest::rank()), parity_of), 3);
}

TEST(MpiCommunicator, RefusesOversizedMessagesWithAReason) {
  auto world = split(0);
  std::vector<int64_t> counts(world->size(), int64_t{3} << 30), recv;
  Status s = world->all_to_all_v(nullptr, counts, nullptr, counts);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("exceed one MPI message"), std::string::npos) << s.message();
  // The refusal happens before any message, so the group still works.
  float x = 1.0f;
  ASSERT_TRUE(world->all_reduce_sum(&x, 1).ok());
  EXPECT_EQ(x, static_cast<float>(world->size()));
}

}  // namespace
}  // namespace ml4

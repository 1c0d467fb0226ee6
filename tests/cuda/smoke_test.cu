// The first GPU check: the runtime sees a device, a kernel runs and writes every element,
// and the counter-based fill is deterministic and inside its range.
#include <gtest/gtest.h>

#include "cuda_test_util.h"

namespace ml4::cuda {
namespace {

using testing::poisoned;
using testing::to_host;

TEST(CudaSmoke, DeviceAndFill) {
  ML4_REQUIRE_GPU();
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  std::printf("device %s: cc %d.%d, %d SMs\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  EXPECT_GT(sm_count(), 0);
  const int64_t n = 1 << 20;
  auto a = poisoned<float>(n), b = poisoned<float>(n);
  ML4_ASSERT_OK(fill_uniform_f32(a.as<float>(), n, 42, -2.0f, 3.0f, nullptr));
  ML4_ASSERT_OK(fill_uniform_f32(b.as<float>(), n, 42, -2.0f, 3.0f, nullptr));
  ML4_ASSERT_OK(cuda_status(cudaDeviceSynchronize(), "sync"));
  auto ha = to_host<float>(a, n), hb = to_host<float>(b, n);
  double mean = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(ha[i] >= -2.0f && ha[i] < 3.0f) << i << " " << ha[i];
    mean += ha[i];
  }
  EXPECT_EQ(0, std::memcmp(ha.data(), hb.data(), n * 4));
  // Mean of U(-2, 3) is 0.5; with 2^20 samples the standard error is ~1.4e-3.
  EXPECT_NEAR(mean / n, 0.5, 0.01);
}

TEST(CudaSmoke, AllocFailureIsAStatus) {
  ML4_REQUIRE_GPU();
  auto b = DeviceBuffer::alloc(size_t{1} << 50);  // 1 PiB
  EXPECT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  auto ok = DeviceBuffer::alloc(16);
  ASSERT_TRUE(ok.ok());
  char host[32];
  EXPECT_EQ(ok->upload(host, 32).code(), StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace ml4::cuda

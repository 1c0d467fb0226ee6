// A fresh temporary directory per test (tmpfs when there is one), removed at the end.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace ml4::testing {

namespace fs = std::filesystem;

// tmpfs when there is one: the fuzz loop rewrites a file 2,000 times, which on a busy
// disk costs seconds of I/O wait.
inline fs::path temp_base() {
  std::error_code ec;
  if (fs::is_directory("/dev/shm", ec) && access("/dev/shm", W_OK) == 0) return "/dev/shm";
  return fs::temp_directory_path();
}

// A fresh directory per test, removed at the end.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = temp_base() / fmt::format("ml4_{}_{}_{}", getpid(), info->test_suite_name(), info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string str() const { return path_.string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

}  // namespace ml4::testing

#include "core/log.h"

#include <cstdlib>
#include <mutex>

namespace ml4 {
void init_logging() {
  static std::once_flag once;
  std::call_once(once, [] {
    spdlog::set_level(spdlog::level::info);
    if (const char* e = std::getenv("ML4_LOG")) spdlog::set_level(spdlog::level::from_str(e));
    spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
  });
}
}  // namespace ml4

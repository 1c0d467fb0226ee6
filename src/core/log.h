// Logging: spdlog, level from ML4_LOG (trace|debug|info|warn|error|off), read once.
#pragma once

#include <spdlog/spdlog.h>

namespace ml4 {
// Sets the level from ML4_LOG on first call; cheap afterwards.
void init_logging();
}  // namespace ml4

#define ML4_LOG_INFO(...) (::ml4::init_logging(), spdlog::info(__VA_ARGS__))
#define ML4_LOG_WARN(...) (::ml4::init_logging(), spdlog::warn(__VA_ARGS__))
#define ML4_LOG_ERROR(...) (::ml4::init_logging(), spdlog::error(__VA_ARGS__))
#define ML4_LOG_DEBUG(...) (::ml4::init_logging(), spdlog::debug(__VA_ARGS__))

// Subcommand registry for the `ml4` CLI: each tools/ml4/cmd_*.cpp registers itself.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace ml4::cli {

// `setup` adds a subcommand to `app` and sets its callback. The callback returns the
// process exit code through `*exit_code`.
using CommandSetup = std::function<void(CLI::App& app, int* exit_code)>;

struct CommandRegistrar {
  CommandRegistrar(const char* name, CommandSetup setup);
};

std::vector<std::pair<std::string, CommandSetup>>& command_registry();

}  // namespace ml4::cli

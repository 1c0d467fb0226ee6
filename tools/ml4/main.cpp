// ml4: the one CLI. Subcommands live in tools/ml4/cmd_*.cpp and register themselves.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "command.h"
#include "core/log.h"

namespace ml4::cli {

std::vector<std::pair<std::string, CommandSetup>>& command_registry() {
  static std::vector<std::pair<std::string, CommandSetup>> r;
  return r;
}

CommandRegistrar::CommandRegistrar(const char* name, CommandSetup setup) {
  command_registry().emplace_back(name, std::move(setup));
}

}  // namespace ml4::cli

int main(int argc, char** argv) {
  ml4::init_logging();
  // vLLM's two-letter short flags (-tp N, -dp N), which CLI11 cannot declare: spelled long.
  std::vector<std::string> storage(argv, argv + argc);
  std::vector<char*> args;
  for (auto& a : storage) {
    if (a == "-tp") a = "--tensor-parallel-size";
    if (a == "-dp") a = "--data-parallel-size";
    if (a == "-dcp") a = "--decode-context-parallel-size";
    if (a == "-pcp") a = "--prefill-context-parallel-size";
    if (a.rfind("-tp=", 0) == 0) a = "--tensor-parallel-size=" + a.substr(4);
    if (a.rfind("-dp=", 0) == 0) a = "--data-parallel-size=" + a.substr(4);
    args.push_back(a.data());
  }
  argc = static_cast<int>(args.size());
  argv = args.data();
  CLI::App app{"ml4: inference engine for the ML4 model family"};
  app.require_subcommand(1);
  int exit_code = 0;
  auto& reg = ml4::cli::command_registry();
  std::sort(reg.begin(), reg.end(), [](auto& a, auto& b) { return a.first < b.first; });
  for (auto& [name, setup] : reg) setup(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return exit_code;
}

// SPDX-License-Identifier: Apache-2.0
// The subcommands of weightbus-bench. Each declares its flags on `command` (weightbus-bench's
// subcommand of that name; main parses them, tools/weightbus/flags.h) and returns what
// runs it once they are parsed. That takes the arguments after the subcommand's name (run hands
// them on to the runs of a sweep) and returns the process's exit status: 0 success, 1 a
// measurement failed ("# FAILED: ..."), 2 a usage or set-up error.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "weightbus/flags.h"

namespace weightbus::bench {

using Subcommand = std::function<int(const std::vector<std::string>& argv)>;

Subcommand AddRunCommand(tools::Command& command);     // run.cc
Subcommand AddModelCommand(tools::Command& command);   // model_main.cc
Subcommand AddWorkerCommand(tools::Command& command);  // roles.cc: run's child processes

}  // namespace weightbus::bench

// SPDX-License-Identifier: Apache-2.0
// The subcommands of weightbus-bench. Each takes the arguments after its name and returns the
// process's exit status: 0 success, 1 a measurement failed ("# FAILED: ..."), 2 a usage or
// set-up error.
#pragma once

#include <string>
#include <vector>

namespace weightbus::bench {

int RunMain(const std::vector<std::string>& argv);     // run.cc
int ModelMain(const std::vector<std::string>& argv);   // model_main.cc
int WorkerMain(const std::vector<std::string>& argv);  // roles.cc: run's child processes

}  // namespace weightbus::bench

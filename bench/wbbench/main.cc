// SPDX-License-Identifier: Apache-2.0
// weightbus-bench: which transport, and how much of a training step does weight sync eat?
//
//   weightbus-bench run   [flags]   measure every transport built here side by side, with
//                                   baselines in the same run (docs/PERFORMANCE.md)
//   weightbus-bench model [flags]   the analytic cost model for a real cluster
//                                   (docs/COST_MODEL.md)
//
// `weightbus-bench SUBCOMMAND --help` lists a subcommand's flags.
#include <signal.h>

#include <string>
#include <vector>

#include "wbbench/common.h"
#include "wbbench/subcommands.h"
#include "weightbus/flags.h"

int main(int argc, char** argv) {
  using namespace weightbus::bench;
  // A child that died closes its pipe: writing to it must fail with EPIPE (reported as that
  // child's failure), not kill the bench.
  signal(SIGPIPE, SIG_IGN);
  weightbus::tools::SetFatalErrorPolicy({"weightbus-bench", 2, [] {
                                           RunCleanup();
                                           (void)ExitStatus(2);
                                         }});
  weightbus::tools::Command app(
      "weightbus-bench",
      "weightbus-bench: which transport, and how much of a training step does weight sync eat?");
  app.RequireSubcommands(1, 1);
  weightbus::tools::Command& run = app.AddSubcommand(
      "run", "measure every transport built here side by side, with baselines in the same run");
  weightbus::tools::Command& model =
      app.AddSubcommand("model", "the analytic cost model of weight sync for a real cluster");
  weightbus::tools::Command& worker =
      app.AddSubcommand("__worker", "run's child processes").Hidden();
  const Subcommand run_main = AddRunCommand(run);
  const Subcommand model_main = AddModelCommand(model);
  const Subcommand worker_main = AddWorkerCommand(worker);
  if (std::optional<int> exit_status = app.Parse(argc, argv)) {
    return *exit_status;
  }
  // The arguments after the subcommand's name (always the first argument: the bench itself has
  // no flags but --help).
  const std::vector<std::string> rest(argv + 2, argv + argc);
  if (run.given()) return ExitStatus(run_main(rest));
  if (model.given()) return model_main(rest);
  return worker_main(rest);
}

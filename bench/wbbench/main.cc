// SPDX-License-Identifier: Apache-2.0
// weightbus-bench: which transport, and how much of a training step does weight sync eat?
//
//   weightbus-bench run   [flags]   measure every transport built here side by side, with
//                                   baselines in the same run (docs/PERFORMANCE.md)
//   weightbus-bench model [flags]   the analytic cost model for a real cluster
//                                   (docs/COST_MODEL.md)
#include <signal.h>

#include <cstdio>
#include <string>
#include <vector>

#include "wbbench/common.h"
#include "wbbench/subcommands.h"

namespace {

constexpr char kUsage[] = R"(usage: weightbus-bench run|model [flags]

weightbus-bench run: one publisher and N subscriber processes per transport (disk, ucx,
delta+disk, delta+ucx: whichever this build has), the same realistic versions through each, and
the baselines (memcpy, write+fsync/read, ucx_perftest, torch.save/load, gloo broadcast) in the
same run. Output in the style of nccl-tests; ends with "# OK" or "# FAILED: reason".
  --transports LIST      comma-separated subset (default: every one built)
  --subscribers N        replica processes per transport (default 2)
  --versions N           versions to publish (default 6); --warmup N not measured (default 1)
  --model PATH           a llama2.c .bin or safetensors file/directory (the weights to sync)
  --size BYTES           a synthetic model of this size (e.g. 256MiB), shaped like --shapes
                         (default: Qwen2.5-0.5B's tensor shapes, scaled); default 128MiB.
                         A list (--size 64MiB,1GiB) is a sweep, as is
  --min-size A --max-size B [--factor F]   A, A x F, ... up to B (default F 2): one whole run
                         per size, one after the other; output files get the size in their
                         name (run.json -> run-64.0MiB.json); the status is the worst
  --lr X --seed N        the update stream: Adam steps of this learning rate (default 1e-5)
  --dir DIR              where channels and baselines write (in DIR/wbbench-PID; default $TMPDIR)
  --store DIR            the pre-generated versions (in DIR/wbbench-PID; default /dev/shm)
  --set KEY=VALUE        a channel setting (repeatable), given to every transport whose stack
                         has it (core settings to all; `weightbus settings` lists them)
  --timeout SECONDS      per version (default 120)
  --no-baselines --no-torch --no-perftest   leave baselines out
  --python PATH          interpreter with torch for its baselines (default /usr/bin/python3)
  --perftest PATH        ucx_perftest (default /usr/bin/ucx_perftest)
  --perftest-reps N --torch-reps N          repetitions of those baselines (default 3)
  --json FILE --csv FILE every figure; --trace FILE a Chrome/Perfetto trace of every phase;
  --plot FILE.svg        a bar chart of time until the last replica, with the baselines
  --quick                the stories260K checkpoint, 4 versions, 1 rep of each baseline
  --order auto|interleaved|sequential   interleaved: each version through every transport
                         and the baselines in turn (all processes alive at once: noise hits all
                         alike); sequential: one transport after the other; auto (default):
                         interleaved when it fits in memory (about 5 model sizes per process)
  --keep                 keep --dir and --store afterwards
  --corrupt-version N    fault injection: every publisher flips one bit of version N before
                         publishing it, so replicas receive bytes that differ from what the
                         store says was meant (the correctness column must catch it: FAILED)

weightbus-bench model: exposed sync time, idle GPU-hours and dollars per 1,000 steps, and the
bandwidth needed for 90%/99% utilisation, per transport. `weightbus-bench model --help` lists
its flags.
)";

}  // namespace

int main(int argc, char** argv) {
  // A child that died closes its pipe: writing to it must fail with EPIPE (reported as that
  // child's failure), not kill the bench.
  signal(SIGPIPE, SIG_IGN);
  weightbus::tools::SetFatalErrorPolicy({"weightbus-bench", 2, weightbus::bench::RunCleanup});
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string sub = args[0];
  args.erase(args.begin());
  if (sub == "run") {
    for (const std::string& a : args) {
      if (a == "--help" || a == "-h") {
        std::fputs(kUsage, stdout);
        return 0;
      }
    }
    return weightbus::bench::RunMain(args);
  }
  if (sub == "model") return weightbus::bench::ModelMain(args);
  if (sub == "__worker") return weightbus::bench::WorkerMain(args);
  std::fprintf(stderr, "weightbus-bench: unknown subcommand \"%s\"\n\n%s", sub.c_str(), kUsage);
  return 2;
}

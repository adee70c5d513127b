// SPDX-License-Identifier: Apache-2.0
// The outputs of `weightbus-bench run`: the nccl-tests style table, --json, --csv.
#pragma once

#include <cmath>
#include <string>

#include "nlohmann/json.hpp"
#include "wbbench/results.h"

namespace weightbus::bench {

// The table after the banner: header and units rows (starting with '#'), one row per transport
// and baseline, notes for skipped ones, and the final "# OK" / "# FAILED: reason" line.
std::string FormatTable(const RunResult& r);

// Every figure, nested (schema: docs/PERFORMANCE.md, "weightbus-bench run --json").
nlohmann::ordered_json ToJson(const RunResult& r);

// Every figure, one per line: section,name,version,replica,metric,value,unit.
std::string ToCsv(const RunResult& r);

// The ratios each transport row shows, from baselines of the same run (NaN when the baseline
// did not run or the transport has no time to last replica):
//   vs_limit: its median time to last replica / the median time of the baseline that bounds it
//             (disk -> "write+read", ucx -> "ucx_perftest"; delta+X -> X's): 1.0 = at the limit
//   vs_torch: the faster torch baseline's median time to last reader ("torch.save", "gloo
//             bcast") / its median time to last replica: how many times faster than that
struct Ratios {
  double vs_limit = NAN;
  std::string limit;  // the baseline's name
  double vs_torch = NAN;
  std::string torch;
};
Ratios RatiosOf(const RunResult& r, const TransportResult& t);

// "# OK" or "# FAILED: a; b".
std::string FinalLine(const RunResult& r);

}  // namespace weightbus::bench

// SPDX-License-Identifier: Apache-2.0
// The outputs of `weightbus-bench run`: the nccl-tests style table, --json, --csv.
#pragma once

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

// "# OK" or "# FAILED: a; b".
std::string FinalLine(const RunResult& r);

}  // namespace weightbus::bench

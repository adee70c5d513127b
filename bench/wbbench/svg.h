// SPDX-License-Identifier: Apache-2.0
// --plot FILE.svg of `weightbus-bench run`: a horizontal bar chart of the time until the last
// replica held each version (median, with a p99 whisker) per transport, next to the baselines.
#pragma once

#include <string>
#include <vector>

#include "wbbench/results.h"

namespace weightbus::bench {

struct Bar {
  std::string label;
  bool baseline = false;
  double median_s = 0;
  double p99_s = 0;  // 0: no whisker
};

// The bars `run` plots: every transport with a measured time to last replica, then every
// baseline that ran.
std::vector<Bar> BarsOf(const RunResult& r);

// A self-contained SVG document; a log scale when the values span more than 30x.
std::string BarChartSvg(const std::string& title, const std::vector<Bar>& bars);

}  // namespace weightbus::bench

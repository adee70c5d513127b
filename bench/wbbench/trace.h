// SPDX-License-Identifier: Apache-2.0
// --trace FILE of `weightbus-bench run`: a Chrome/Perfetto trace (JSON "traceEvents", complete
// events "ph":"X" with ts/dur in microseconds) of every phase of every version in every process.
#pragma once

#include "nlohmann/json.hpp"
#include "wbbench/results.h"

namespace weightbus::bench {

// Phases as the library reports them (PublishStats, UpdateStats), named as the issue does:
// publisher: snapshot (pack), encode (a codec layer's), transfer (the transport's part), verify
// (checksum wait); subscriber: wait, allocate, transfer (fetch less decode), decode, verify
// (checksum tail), apply (copy into bound parameters). A phase of zero length is left out.
nlohmann::ordered_json ChromeTrace(const RunResult& r);

}  // namespace weightbus::bench

// SPDX-License-Identifier: Apache-2.0
// Comparing what two manifests of one version number hold: a retried publish of the same bytes
// is a no-op, and a subscriber refuses other content under a version number it holds.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "weightbus/manifest.hpp"

namespace weightbus::internal {

// Nullopt when `a` and `b` list the same tensors (names, order, dtypes, shapes, shards and
// XXH3-64 checksums); otherwise the first difference in words, `a` described as `a_label` and
// `b` as `b_label`, e.g. `tensor "w": XXH3 0123... (new) vs 4567... (published)`.
std::optional<std::string> ContentDifference(const std::vector<TensorInfo>& a,
                                             std::string_view a_label,
                                             const std::vector<TensorInfo>& b,
                                             std::string_view b_label);

}  // namespace weightbus::internal

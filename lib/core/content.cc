// SPDX-License-Identifier: Apache-2.0
#include "core/content.h"

#include "absl/strings/str_format.h"

namespace weightbus::internal {

std::optional<std::string> ContentDifference(const std::vector<TensorInfo>& a,
                                             std::string_view a_label,
                                             const std::vector<TensorInfo>& b,
                                             std::string_view b_label) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const TensorInfo &x = a[i], &y = b[i];
    if (x.name != y.name) {
      return absl::StrFormat("tensor %d is \"%s\" (%s) vs \"%s\" (%s)", i, x.name, a_label, y.name,
                             b_label);
    }
    if (x.dtype != y.dtype || x.shape != y.shape) {
      return absl::StrFormat("tensor \"%s\": %s %s (%s) vs %s %s (%s)", x.name, DTypeName(x.dtype),
                             ShapeString(x.shape), a_label, DTypeName(y.dtype),
                             ShapeString(y.shape), b_label);
    }
    if (x.shard != y.shard || x.owner != y.owner) {
      return absl::StrFormat("tensor \"%s\": its shard or owner differs (%s vs %s)", x.name,
                             a_label, b_label);
    }
    if (x.xxh3 != y.xxh3) {
      return absl::StrFormat("tensor \"%s\": XXH3-64 %016x (%s) vs %016x (%s)", x.name, x.xxh3,
                             a_label, y.xxh3, b_label);
    }
  }
  if (a.size() != b.size()) {
    return absl::StrFormat("%d tensors (%s) vs %d (%s)", a.size(), a_label, b.size(), b_label);
  }
  return std::nullopt;
}

}  // namespace weightbus::internal

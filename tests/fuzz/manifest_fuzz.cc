// SPDX-License-Identifier: Apache-2.0
// Fuzz target of the manifest parser (Manifest::FromJson, lib/core/manifest.cc): the text of a
// weightbus.manifest.json as a disk:// subscriber reads it, or as a ucx:// GRANT carries it. Every
// input must be refused with DataLoss naming the source, or parse into a manifest that keeps the
// limits of types.hpp and the format's rules (byte sizes match dtype and shape, unique non-empty
// names, shards inside their global shape) and that round-trips through ToJson unchanged.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include "absl/strings/str_format.h"
#include "fuzz_check.h"
#include "weightbus/manifest.hpp"

namespace {

constexpr char kTarget[] = "manifest_fuzz";
constexpr std::string_view kSource = "fuzz-input.manifest.json";

template <typename... Detail>
void Check(bool ok, const char* what, const Detail&... detail) {
  weightbus::fuzz::Check(ok, kTarget, what, detail...);
}

void CheckValid(const weightbus::Manifest& m) {
  Check(m.tensors.size() <= weightbus::kMaxTensors, "more tensors than the limit");
  std::set<std::string> names;
  uint64_t total = 0;
  for (const weightbus::TensorInfo& t : m.tensors) {
    Check(!t.name.empty() && t.name.size() <= weightbus::kMaxTensorNameBytes,
          "name empty or above the limit", t.name);
    Check(names.insert(t.name).second, "duplicate name accepted", t.name);
    Check(t.shape.size() <= weightbus::kMaxRank, "rank above the limit", t.name);
    absl::StatusOr<uint64_t> n = weightbus::ByteSize(t.dtype, t.shape);
    Check(n.ok() && *n == t.nbytes, "nbytes does not match dtype and shape", t.name);
    Check(!__builtin_add_overflow(total, t.nbytes, &total), "total size overflows", t.name);
    if (t.shard) {
      Check(t.shard->global_shape.size() == t.shape.size() &&
                t.shard->offsets.size() == t.shape.size(),
            "shard rank differs from the shape's", t.name);
      for (size_t d = 0; d < t.shape.size(); ++d) {
        Check(t.shard->offsets[d] >= 0 &&
                  t.shard->offsets[d] + t.shape[d] <= t.shard->global_shape[d],
              "shard outside its global shape", t.name);
      }
    }
  }
  Check(m.total_bytes() == total, "total_bytes() differs from the sum");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<weightbus::Manifest> m = weightbus::Manifest::FromJson(text, kSource);
  if (!m.ok()) {
    weightbus::fuzz::CheckRefusal(m.status(), absl::StatusCode::kDataLoss, kSource, kTarget);
    return 0;
  }
  CheckValid(*m);
  const std::string again = m->ToJson();
  absl::StatusOr<weightbus::Manifest> back = weightbus::Manifest::FromJson(again, "re-encoded");
  Check(back.ok(), "ToJson's output does not parse",
        back.ok() ? std::string() : back.status().ToString());
  Check(*back == *m, "the manifest changed in a ToJson/FromJson round trip", again);
  return 0;
}

// SPDX-License-Identifier: Apache-2.0
#include "wbbench/tp_layout.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"

namespace weightbus::bench {

std::vector<TensorView> RankViews(const StoreIndex& index, const std::byte* base, int rank,
                                  int world) {
  const std::vector<TensorView> whole = index.Views(base);
  if (world == 1) return whole;
  std::vector<TensorView> out;
  for (size_t i = 0; i < whole.size(); ++i) {
    const TensorView& v = whole[i];
    if (v.shape.size() == 2 && v.shape[0] % world == 0 && v.shape[0] >= world) {
      const int64_t rows = v.shape[0] / world;
      TensorView s = v;
      s.shape = {rows, v.shape[1]};
      s.data = static_cast<const std::byte*>(v.data) +
               rows * rank * v.shape[1] * static_cast<int64_t>(DTypeSize(v.dtype));
      s.shard = Shard{v.shape, {rows * rank, 0}};
      out.push_back(std::move(s));
    } else if (static_cast<int>(i % world) == rank) {
      out.push_back(v);
    }
  }
  return out;
}

Placement TpPlacement(const StoredTensor& t, int tp) {
  if (tp == 1 || t.shape.size() != 2) return Placement::Replicate();
  const bool row_parallel =
      absl::StrContains(t.name, "o_proj") || absl::StrContains(t.name, "down_proj");
  const int first = row_parallel ? 1 : 0;
  for (int d : {first, 1 - first}) {
    if (t.shape[d] % tp == 0) return Placement::Shard(d);
  }
  return Placement::Replicate();
}

std::vector<PlacementRule> TpRules(const StoreIndex& index, int tp) {
  std::vector<PlacementRule> rules;
  for (const StoredTensor& t : index.tensors) rules.push_back({t.name, TpPlacement(t, tp)});
  return rules;
}

absl::StatusOr<std::vector<std::byte>> ReadSlice(const std::string& version_path,
                                                 const StoredTensor& t, int rank, int tp) {
  const Placement p = TpPlacement(t, tp);
  const uint64_t elem = DTypeSize(t.dtype);
  // As [rows, cols] row-major; the slice is rows [r0, r1) x columns [c0, c1).
  const int64_t rows = t.shape.size() == 2 ? t.shape[0] : 1;
  const int64_t cols = t.shape.size() == 2 ? t.shape[1] : static_cast<int64_t>(t.nbytes / elem);
  int64_t r0 = 0, r1 = rows, c0 = 0, c1 = cols;
  if (p.kind == Placement::Kind::kShard && p.dim == 0) {
    r0 = rows / tp * rank;
    r1 = r0 + rows / tp;
  } else if (p.kind == Placement::Kind::kShard) {
    c0 = cols / tp * rank;
    c1 = c0 + cols / tp;
  }
  const int fd = ::open(version_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrFormat("open %s: %s", version_path, std::strerror(errno)));
  }
  std::vector<std::byte> out((r1 - r0) * (c1 - c0) * elem);
  const uint64_t run = (c1 - c0) * elem;
  for (int64_t r = r0; r < r1; ++r) {
    const off_t at = static_cast<off_t>(t.offset + (r * cols + c0) * elem);
    if (::pread(fd, out.data() + (r - r0) * run, run, at) != static_cast<ssize_t>(run)) {
      ::close(fd);
      return absl::DataLossError(
          absl::StrFormat("%s: short read of tensor \"%s\" at %d", version_path, t.name, at));
    }
  }
  ::close(fd);
  return out;
}

uint64_t SliceBytes(const StoreIndex& index, int tp) {
  uint64_t n = 0;
  for (const StoredTensor& t : index.tensors) {
    const Placement p = TpPlacement(t, tp);
    n += p.kind == Placement::Kind::kShard ? t.nbytes / tp : t.nbytes;
  }
  return n;
}

}  // namespace weightbus::bench

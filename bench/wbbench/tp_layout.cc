// SPDX-License-Identifier: Apache-2.0
#include "wbbench/tp_layout.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

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

namespace {

// The slice of `t` TP rank `rank` of `tp` takes, as [rows, cols) of its [rows, cols] view (a
// vector: one row).
struct Rect {
  int64_t r0, r1, c0, c1;
};
Rect SliceRect(const StoredTensor& t, int rank, int tp) {
  const Placement p = TpPlacement(t, tp);
  const int64_t rows = t.shape.size() == 2 ? t.shape[0] : 1;
  const int64_t cols =
      t.shape.size() == 2 ? t.shape[1] : static_cast<int64_t>(t.nbytes / DTypeSize(t.dtype));
  Rect s{0, rows, 0, cols};
  if (p.kind == Placement::Kind::kShard && p.dim == 0) {
    s.r0 = rows / tp * rank;
    s.r1 = s.r0 + rows / tp;
  } else if (p.kind == Placement::Kind::kShard) {
    s.c0 = cols / tp * rank;
    s.c1 = s.c0 + cols / tp;
  }
  return s;
}

}  // namespace

uint64_t ExpectedReadBytes(const Manifest& m, const StoreIndex& index, int rank, int tp) {
  uint64_t n = 0;
  for (const StoredTensor& t : index.tensors) {
    const Rect want = SliceRect(t, rank, tp);
    const int64_t es = static_cast<int64_t>(DTypeSize(t.dtype));
    for (const TensorInfo& e : m.tensors) {
      if (e.name != t.name) continue;
      // The part as [rows, cols) of the tensor's view.
      const bool matrix = e.shape.size() == 2;
      const int64_t pr0 = matrix && e.shard ? e.shard->offsets[0] : 0;
      const int64_t pc0 = e.shard ? e.shard->offsets.back() : 0;
      const int64_t prows = matrix ? e.shape[0] : 1;
      const int64_t pcols = static_cast<int64_t>(e.nbytes) / es / prows;
      const int64_t r0 = std::max(want.r0, pr0), r1 = std::min(want.r1, pr0 + prows);
      const int64_t c0 = std::max(want.c0, pc0), c1 = std::min(want.c1, pc0 + pcols);
      if (r0 >= r1 || c0 >= c1) continue;
      const uint64_t row_bytes = static_cast<uint64_t>(pcols * es);
      if (e.block_bytes == 0) {
        n += e.nbytes;
      } else if (e.block_rows == 0) {  // 1-D blocks over the part's bytes
        std::set<uint64_t> blocks;
        for (int64_t r = r0; r < r1; ++r) {
          const uint64_t lo = (r - pr0) * row_bytes + (c0 - pc0) * es;
          const uint64_t hi = (r - pr0) * row_bytes + (c1 - pc0) * es;
          for (uint64_t b = lo / e.block_bytes; b <= (hi - 1) / e.block_bytes; ++b)
            blocks.insert(b);
        }
        for (uint64_t b : blocks) n += std::min(e.block_bytes, e.nbytes - b * e.block_bytes);
      } else {  // tiles: the rectangle meets a rectangle of them
        const uint64_t tr = e.block_rows, tb = e.block_bytes;
        for (uint64_t band = (r0 - pr0) / tr; band <= static_cast<uint64_t>(r1 - 1 - pr0) / tr;
             ++band) {
          for (uint64_t col = (c0 - pc0) * es / tb;
               col <= static_cast<uint64_t>((c1 - pc0) * es - 1) / tb; ++col) {
            n += (std::min<uint64_t>(prows, (band + 1) * tr) - band * tr) *
                 (std::min<uint64_t>(row_bytes, (col + 1) * tb) - col * tb);
          }
        }
      }
    }
  }
  return n;
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

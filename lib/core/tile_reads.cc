// SPDX-License-Identifier: Apache-2.0
#include "core/tile_reads.h"

#include <algorithm>

namespace weightbus::internal {
namespace {

// Marks the tiles that bytes [begin, end) of row `row` touch.
void MarkRow(const TileGrid& g, uint64_t row, uint64_t begin, uint64_t end,
             std::vector<bool>& touched) {
  const uint64_t band = row / g.tile_rows;
  for (uint64_t c = begin / g.tile_bytes; c <= (end - 1) / g.tile_bytes; ++c) {
    touched[g.index(band, c)] = true;
  }
}

// A run of touched columns [c0, c1) of bands [b0, b1) of one part.
struct Unit {
  size_t part;
  uint64_t b0, b1, c0, c1;
};

TileChunk ChunkOf(const TileGrid& g, const Unit& u) {
  TileChunk c;
  c.part = u.part;
  c.row_begin = u.b0 * g.tile_rows;
  c.row_end = std::min(g.rows, u.b1 * g.tile_rows);
  c.byte_begin = u.c0 * g.tile_bytes;
  c.byte_end = std::min(g.row_bytes, u.c1 * g.tile_bytes);
  return c;
}

}  // namespace

TileReadPlan PlanTileReads(absl::Span<const TileGrid> grids, absl::Span<const WantedRange> ranges,
                           uint64_t window_limit) {
  // The tiles each part's ranges touch.
  std::vector<std::vector<bool>> touched(grids.size());
  for (const WantedRange& r : ranges) {
    if (r.length == 0) continue;
    const TileGrid& g = grids[r.part];
    std::vector<bool>& t = touched[r.part];
    if (t.empty()) t.assign(g.count(), false);
    const uint64_t end = r.offset + r.length;
    const uint64_t row0 = r.offset / g.row_bytes, row1 = (end - 1) / g.row_bytes;
    const uint64_t x0 = r.offset % g.row_bytes, x1 = (end - 1) % g.row_bytes + 1;
    if (row0 == row1) {
      MarkRow(g, row0, x0, x1, t);
      continue;
    }
    MarkRow(g, row0, x0, g.row_bytes, t);
    MarkRow(g, row1, 0, x1, t);
    // Whole rows between: every tile of their bands.
    if (row1 > row0 + 1) {
      for (uint64_t b = (row0 + 1) / g.tile_rows; b <= (row1 - 1) / g.tile_rows; ++b) {
        for (uint64_t c = 0; c < g.columns(); ++c) t[g.index(b, c)] = true;
      }
    }
  }
  // Runs of touched columns per band, the same run of consecutive bands joined.
  std::vector<Unit> units;
  for (size_t p = 0; p < grids.size(); ++p) {
    if (touched[p].empty()) continue;
    const TileGrid& g = grids[p];
    std::vector<size_t> open, next;  // units that reach the previous band / this band
    for (uint64_t b = 0; b < g.bands(); ++b) {
      next.clear();
      for (uint64_t c = 0; c < g.columns();) {
        if (!touched[p][g.index(b, c)]) {
          ++c;
          continue;
        }
        uint64_t e = c;
        while (e < g.columns() && touched[p][g.index(b, e)]) ++e;
        auto same = std::find_if(open.begin(), open.end(),
                                 [&](size_t u) { return units[u].c0 == c && units[u].c1 == e; });
        if (same != open.end()) {
          units[*same].b1 = b + 1;
          next.push_back(*same);
        } else {
          next.push_back(units.size());
          units.push_back(Unit{p, b, b + 1, c, e});
        }
        c = e;
      }
      open.swap(next);
    }
  }
  // Windows: each unit whole when it fits the window, else band by band and, for a band larger
  // than the window, column by column (a tile always fits).
  TileReadPlan plan;
  uint64_t fill = 0;
  auto place = [&](TileChunk c) {
    if (plan.windows.empty() || fill + c.size() > window_limit) {
      plan.windows.emplace_back();
      fill = 0;
    }
    c.window_offset = fill;
    fill += c.size();
    plan.read_bytes += c.size();
    plan.window_bytes = std::max(plan.window_bytes, fill);
    plan.windows.back().push_back(c);
  };
  for (const Unit& u : units) {
    const TileGrid& g = grids[u.part];
    const TileChunk whole = ChunkOf(g, u);
    if (whole.size() <= window_limit) {
      place(whole);
      continue;
    }
    // As many whole bands of the run as fit, else a band's columns as many as fit.
    for (uint64_t b = u.b0; b < u.b1;) {
      uint64_t e = b + 1;
      while (e < u.b1 && ChunkOf(g, Unit{u.part, b, e + 1, u.c0, u.c1}).size() <= window_limit) {
        ++e;
      }
      if (ChunkOf(g, Unit{u.part, b, e, u.c0, u.c1}).size() <= window_limit) {
        place(ChunkOf(g, Unit{u.part, b, e, u.c0, u.c1}));
      } else {
        for (uint64_t c = u.c0; c < u.c1;) {
          uint64_t f = c + 1;
          while (f < u.c1 && ChunkOf(g, Unit{u.part, b, b + 1, c, f + 1}).size() <= window_limit) {
            ++f;
          }
          place(ChunkOf(g, Unit{u.part, b, b + 1, c, f}));
          c = f;
        }
      }
      b = e;
    }
  }
  return plan;
}

void ForEachChunkRead(const TileChunk& chunk, const TileGrid& grid,
                      const std::function<void(uint64_t, uint64_t, uint64_t)>& read) {
  if (chunk.width() == grid.row_bytes) {
    read(chunk.row_begin * grid.row_bytes, chunk.size(), chunk.window_offset);
    return;
  }
  for (uint64_t r = chunk.row_begin; r < chunk.row_end; ++r) {
    read(r * grid.row_bytes + chunk.byte_begin, chunk.width(),
         chunk.window_offset + (r - chunk.row_begin) * chunk.width());
  }
}

void ForEachChunkTile(
    const TileChunk& chunk, const TileGrid& grid,
    const std::function<void(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t)>& tile) {
  const uint64_t b0 = chunk.row_begin / grid.tile_rows;
  const uint64_t b1 = (chunk.row_end - 1) / grid.tile_rows + 1;
  const uint64_t c0 = chunk.byte_begin / grid.tile_bytes;
  const uint64_t c1 = (chunk.byte_end - 1) / grid.tile_bytes + 1;
  for (uint64_t b = b0; b < b1; ++b) {
    for (uint64_t c = c0; c < c1; ++c) {
      const uint64_t k = grid.index(b, c);
      const TileGrid::Extent e = grid.tile(k);
      tile(k,
           chunk.window_offset + (e.row_begin - chunk.row_begin) * chunk.width() +
               (e.byte_begin - chunk.byte_begin),
           e.row_end - e.row_begin, e.byte_end - e.byte_begin, chunk.width());
    }
  }
}

RangeCopier::RangeCopier(absl::Span<const TileGrid> grids, absl::Span<const WantedRange> ranges)
    : grids_(grids), ranges_(ranges) {
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].length > 0) order_.push_back(i);
  }
  std::sort(order_.begin(), order_.end(), [&](size_t a, size_t b) {
    return ranges[a].part != ranges[b].part ? ranges[a].part < ranges[b].part
                                            : ranges[a].offset < ranges[b].offset;
  });
  reach_.resize(order_.size());
  part_begin_.assign(grids.size() + 1, order_.size());
  for (size_t i = order_.size(); i-- > 0;) part_begin_[ranges[order_[i]].part] = i;
  for (size_t p = grids.size(); p-- > 0;) {
    part_begin_[p] = std::min(part_begin_[p], part_begin_[p + 1]);
  }
  for (size_t i = 0; i < order_.size(); ++i) {
    const WantedRange& r = ranges[order_[i]];
    const uint64_t end = r.offset + r.length;
    const bool same_part = i > 0 && ranges[order_[i - 1]].part == r.part;
    reach_[i] = same_part ? std::max(reach_[i - 1], end) : end;
  }
}

void RangeCopier::ForEach(
    const TileChunk& chunk,
    const std::function<void(size_t, uint64_t, uint64_t, uint64_t)>& copy) const {
  const TileGrid& g = grids_[chunk.part];
  const uint64_t C = g.row_bytes, W = chunk.width();
  const uint64_t lo = chunk.row_begin * C + chunk.byte_begin;
  const uint64_t hi = (chunk.row_end - 1) * C + chunk.byte_end;
  // The first range of the part that reaches past `lo` (reach_ grows within a part).
  const size_t end = part_begin_[chunk.part + 1];
  size_t i = part_begin_[chunk.part];
  for (size_t n = end - i; n > 0;) {
    const size_t half = n / 2;
    if (reach_[i + half] <= lo) {
      i += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  for (; i < end && ranges_[order_[i]].offset < hi; ++i) {
    const WantedRange& r = ranges_[order_[i]];
    const uint64_t from = std::max(r.offset, lo), to = std::min(r.offset + r.length, hi);
    if (from >= to) continue;
    if (W == C) {  // whole rows: the window holds the part's bytes [lo, hi) as they are
      copy(order_[i], from - r.offset, chunk.window_offset + (from - lo), to - from);
      continue;
    }
    // Row by row: the range's bytes of each row, within the chunk's columns.
    for (uint64_t row = from / C; row <= (to - 1) / C && row < chunk.row_end; ++row) {
      if (row < chunk.row_begin) continue;
      const uint64_t a = std::max({from, row * C + chunk.byte_begin});
      const uint64_t b = std::min({to, row * C + chunk.byte_end});
      if (a >= b) continue;
      copy(order_[i], a - r.offset,
           chunk.window_offset + (row - chunk.row_begin) * W + (a - row * C - chunk.byte_begin),
           b - a);
    }
  }
}

}  // namespace weightbus::internal

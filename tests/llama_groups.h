// SPDX-License-Identifier: Apache-2.0
// The stories260K fixture as publisher groups publish it (wb_test_peer publish-llama: FSDP2 row
// shards or Megatron column slices, norms replicated) and as Llama's tensor-parallel replicas
// receive it: the expectations the group tests of every transport share (disk_group_test,
// ucx_group_test, tp_subscribe_test), written out here independently of the library's planner.
#pragma once

#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "stories260k.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::testing::llama_groups {

// The fixture as the peer converts it: what every assembled version must equal.
inline const std::vector<tools::OwnedTensor>& Model() { return Stories260K(); }

// Llama's tensor-parallel layout as vLLM shards it: column-parallel q/k/v/gate/up, row-parallel
// o/down, the vocabulary split over the embedding and the head; norms replicated.
inline std::vector<PlacementRule> LlamaRules() {
  return {
      {"*.q_proj.weight", Placement::Shard(0)},    {"*.k_proj.weight", Placement::Shard(0)},
      {"*.v_proj.weight", Placement::Shard(0)},    {"*.gate_proj.weight", Placement::Shard(0)},
      {"*.up_proj.weight", Placement::Shard(0)},   {"*.o_proj.weight", Placement::Shard(1)},
      {"*.down_proj.weight", Placement::Shard(1)}, {"*embed_tokens.weight", Placement::Shard(0)},
      {"lm_head.weight", Placement::Shard(0)}};
}

// The dimension LlamaRules splits `name` on, or -1 (replicated); written out again here so
// that the expectation does not go through the library's pattern matching.
inline int SplitDim(const std::string& name) {
  for (const char* col : {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens"}) {
    if (absl::StrContains(name, col)) return 0;
  }
  if (name == "lm_head.weight") return 0;
  for (const char* row : {"o_proj", "down_proj"}) {
    if (absl::StrContains(name, row)) return 1;
  }
  return -1;
}

// A rectangle of a 2-D (or 1-D) tensor: [begin, end) per dimension.
struct Box {
  std::vector<int64_t> begin, end;
};
inline bool Meet(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.begin.size(); ++d) {
    if (a.begin[d] >= b.end[d] || b.begin[d] >= a.end[d]) return false;
  }
  return true;
}
inline int64_t Elements(const Box& b) {
  int64_t n = 1;
  for (size_t d = 0; d < b.begin.size(); ++d) n *= b.end[d] - b.begin[d];
  return n;
}
inline Box Whole(const std::vector<int64_t>& shape) {
  return {std::vector<int64_t>(shape.size(), 0), shape};
}
// Block `r` of `n` of dimension `dim`.
inline Box Block(const std::vector<int64_t>& shape, int dim, int r, int n) {
  Box b = Whole(shape);
  b.begin[dim] = shape[dim] / n * r;
  b.end[dim] = shape[dim] / n * (r + 1);
  return b;
}

// How a publisher splits the model: a single publisher (world 1) or a group of `world` ranks
// with FSDP2 row shards ("rows") or Megatron column slices ("cols", the embedding owned whole by
// the last rank), norms replicated on every rank (as wb_test_peer publish-llama).
struct PublishCase {
  int world = 1;
  std::string layout = "rows";
  bool streamed = false;  // published tensor by tensor (Publisher::BeginPublish)
};

// The parts of `t` published, per rank (one box for a whole or replicated tensor, on every
// rank; replicated ones are read once, from one rank).
inline std::vector<Box> PublishedParts(const tools::OwnedTensor& t, const PublishCase& c) {
  if (c.world == 1 || t.shape.size() != 2) return {Whole(t.shape)};
  if (c.layout == "cols" && t.name == "model.embed_tokens.weight") return {Whole(t.shape)};
  std::vector<Box> parts;
  for (int r = 0; r < c.world; ++r) parts.push_back(Block(t.shape, c.layout == "cols", r, c.world));
  return parts;
}

// Rank `r` of `tp`'s slice of `t`, sliced here from the checkpoint: its box and row-major bytes.
inline Box SliceBox(const tools::OwnedTensor& t, int r, int tp) {
  const int d = SplitDim(t.name);
  return d < 0 ? Whole(t.shape) : Block(t.shape, d, r, tp);
}
inline std::vector<std::byte> SliceBytes(const tools::OwnedTensor& t, const Box& b) {
  if (t.shape.size() != 2) return t.bytes;
  std::vector<std::byte> out;
  for (int64_t row = b.begin[0]; row < b.end[0]; ++row) {
    const std::byte* from = t.bytes.data() + (row * t.shape[1] + b.begin[1]) * 4;
    out.insert(out.end(), from, from + (b.end[1] - b.begin[1]) * 4);
  }
  return out;
}

// Bytes of the published parts that rank `r` of `tp`'s slices meet (a replicated part once).
inline uint64_t BytesMet(const PublishCase& c, int r, int tp) {
  uint64_t n = 0;
  for (const tools::OwnedTensor& t : Model()) {
    const Box want = SliceBox(t, r, tp);
    for (const Box& part : PublishedParts(t, c)) {
      if (Meet(part, want)) n += Elements(part) * 4;
    }
  }
  return n;
}

// The manifest entry of the part of `t` at `part` (its shard starts there; a whole part has no
// shard, or a shard of the whole).
inline const TensorInfo* PartEntry(const Manifest& m, const tools::OwnedTensor& t,
                                   const Box& part) {
  for (const TensorInfo& e : m.tensors) {
    if (e.name != t.name) continue;
    const std::vector<int64_t> at =
        e.shard ? e.shard->offsets : std::vector<int64_t>(t.shape.size(), 0);
    if (at == part.begin && e.shape.size() == part.end.size()) return &e;
  }
  return nullptr;
}

// Bytes of the checksum tiles of the published parts that rank `r` of `tp`'s slices touch,
// computed here from boxes and the tile shape the manifest `m` records for each part: a part
// [rows, cols] of F32 is rows of cols * 4 bytes cut into tiles of block_rows rows by
// block_bytes bytes (a 1-D part: one row); for each row of the slice's intersection with the
// part, the tiles its byte run lies in.
inline uint64_t TileBytesTouched(const Manifest& m, const PublishCase& c, int r, int tp) {
  uint64_t n = 0;
  for (const tools::OwnedTensor& t : Model()) {
    const Box want = SliceBox(t, r, tp);
    for (const Box& part : PublishedParts(t, c)) {
      if (!Meet(part, want)) continue;
      const TensorInfo* e = PartEntry(m, t, part);
      EXPECT_NE(e, nullptr) << t.name;
      if (e == nullptr) continue;
      EXPECT_GT(e->block_rows, 0u) << t.name << ": no tiles";
      const uint64_t tr = e->block_rows, tb = e->block_bytes;
      const bool matrix = t.shape.size() == 2;
      const uint64_t rows = matrix ? part.end[0] - part.begin[0] : 1;
      const uint64_t row_bytes = Elements(part) * 4 / rows;
      std::set<std::pair<uint64_t, uint64_t>> tiles;  // (band, column)
      if (!matrix) {
        for (uint64_t col = 0; col * tb < row_bytes; ++col) tiles.insert({0, col});
      } else {
        const int64_t c0 = std::max(part.begin[1], want.begin[1]) - part.begin[1];
        const int64_t c1 = std::min(part.end[1], want.end[1]) - part.begin[1];
        for (int64_t row = std::max(part.begin[0], want.begin[0]);
             row < std::min(part.end[0], want.end[0]); ++row) {
          const uint64_t local = row - part.begin[0];
          for (uint64_t col = c0 * 4 / tb; col <= (c1 * 4 - 1) / tb; ++col) {
            tiles.insert({local / tr, col});
          }
        }
      }
      for (const auto& [band, col] : tiles) {
        n += (std::min(rows, (band + 1) * tr) - band * tr) *
             (std::min(row_bytes, (col + 1) * tb) - col * tb);
      }
    }
  }
  return n;
}

// Receives exactly `version` and checks every assembled tensor against the fixture, byte for
// byte; `bind` receives them into caller buffers instead (bind_mode direct or staged).
// `options`: the subscriber's settings.
inline void ExpectWholeModel(const std::string& uri, uint64_t version, int world,
                             const std::string& bind_mode = "", Options options = {}) {
  if (!bind_mode.empty()) options["bind_mode"] = bind_mode;
  auto sub = Subscriber::Open(uri, options);
  ASSERT_TRUE(sub.ok()) << sub.status();
  std::vector<std::vector<std::byte>> buffers;
  if (!bind_mode.empty()) {
    buffers.reserve(Model().size());
    for (const tools::OwnedTensor& t : Model()) {
      buffers.emplace_back(t.bytes.size(), std::byte{0xee});
      ASSERT_TRUE((*sub)->Bind(t.name, {t.dtype, t.shape, {}, buffers.back().data()}).ok());
    }
  }
  auto u = (*sub)->ReceiveVersion(version, absl::Seconds(60));
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_TRUE((*u)->manifest().group);
  EXPECT_EQ((*u)->manifest().publisher.world_size, world);
  // Every rank owns parts of it.
  std::vector<int> parts_of(world, 0);
  for (const TensorInfo& t : (*u)->manifest().tensors) ++parts_of.at(t.owner);
  for (int r = 0; r < world; ++r) EXPECT_GT(parts_of[r], 0) << "rank " << r;
  ASSERT_EQ((*u)->tensors().size(), Model().size());
  for (size_t i = 0; i < Model().size(); ++i) {
    const tools::OwnedTensor& t = Model()[i];
    const TensorView* found = (*u)->Find(t.name);
    ASSERT_NE(found, nullptr) << t.name;
    const TensorView& v = *found;
    EXPECT_EQ(v.shape, t.shape) << t.name;
    EXPECT_FALSE(v.shard.has_value()) << t.name;
    EXPECT_EQ(std::memcmp(v.data, t.bytes.data(), t.bytes.size()), 0) << t.name;
    if (!bind_mode.empty()) EXPECT_EQ(v.data, buffers[i].data()) << t.name;
  }
  // Replicated norms were read once; every byte of the model once.
  uint64_t model_bytes = 0;
  for (const tools::OwnedTensor& t : Model()) model_bytes += t.bytes.size();
  EXPECT_EQ((*u)->stats().bytes, model_bytes);
}

}  // namespace weightbus::testing::llama_groups

// SPDX-License-Identifier: Apache-2.0
// Resharded subscribe over disk:// (docs/RESHARDING.md, "Subscribing with placements"): the
// stories260K fixture published by a single publisher and by groups of 2 and 4 ranks (FSDP2
// row shards and Megatron column slices, one thread per rank), received by every rank of TP
// groups of 1, 2 and 4 with Llama's column- and row-parallel placements. Each rank's slices are
// checked bit-exact against slicing the checkpoint here, and the bytes it fetched against the
// published parts its slices meet, computed here independently of the planner.
#include <cstring>
#include <set>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "llama_groups.h"
#include "stories260k.h"
#include "test_support.h"
#include "weightbus/llama2c.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::testing::HasSubstr;
using ::weightbus::testing::ScratchDir;

constexpr absl::Duration kTimeout = absl::Seconds(60);

using namespace ::weightbus::testing::llama_groups;  // NOLINT: the layouts below

uint64_t ModelBytes() {
  uint64_t n = 0;
  for (const tools::OwnedTensor& t : Model()) n += t.bytes.size();
  return n;
}

// Publishes version `version` of `model` (the fixture unless given) as `c` says, with the
// settings `extra`; every rank must succeed.
// Publishes `views` as `version` with Publish, or tensor by tensor when `c.streamed`.
absl::Status PublishViews(Publisher& p, const PublishCase& c, uint64_t version,
                          const std::vector<TensorView>& views) {
  if (!c.streamed) return p.Publish(version, views, {}, kTimeout);
  absl::StatusOr<std::unique_ptr<PublishStream>> stream = p.BeginPublish(version);
  if (!stream.ok()) return stream.status();
  for (const TensorView& v : views) {
    if (absl::Status s = (*stream)->Add(v); !s.ok()) return s;
  }
  return (*stream)->Commit(kTimeout);
}

void Publish(const std::string& uri, const PublishCase& c, uint64_t version,
             const Options& extra = {}, const std::vector<tools::OwnedTensor>& model = Model()) {
  if (c.world == 1) {
    auto p = Publisher::Open(uri, extra);
    ASSERT_TRUE(p.ok()) << p.status();
    std::vector<TensorView> views;
    for (const tools::OwnedTensor& t : model) views.push_back(t.view());
    const absl::Status published = PublishViews(**p, c, version, views);
    ASSERT_TRUE(published.ok()) << published;
    return;
  }
  std::vector<absl::Status> status(c.world);
  std::vector<std::thread> threads;
  for (int r = 0; r < c.world; ++r) {
    threads.emplace_back([&, r] {
      Options options = extra;
      options["rank"] = std::to_string(r);
      options["world_size"] = std::to_string(c.world);
      options["poll_interval"] = "2ms";
      auto p = Publisher::Open(uri, options);
      if (!p.ok()) {
        status[r] = p.status();
        return;
      }
      std::vector<TensorView> views;
      for (const tools::OwnedTensor& t : model) {
        TensorView v = t.view();
        std::vector<Box> parts = PublishedParts(t, c);
        if (parts.size() > 1) {
          const Box& b = parts[r];
          const int d = c.layout == "cols";
          v.shape[d] = b.end[d] - b.begin[d];
          v.data = t.bytes.data() + (d == 0 ? b.begin[0] * t.shape[1] : b.begin[1]) * 4;
          if (d == 1) v.strides = {t.shape[1], 1};
          v.shard = Shard{t.shape, b.begin};
        } else if (c.layout == "cols" && t.name == "model.embed_tokens.weight" &&
                   r != c.world - 1) {
          continue;  // owned whole by the last rank
        }
        views.push_back(std::move(v));
      }
      status[r] = PublishViews(**p, c, version, views);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < c.world; ++r)
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
}

std::unique_ptr<Subscriber> OpenTp(const std::string& uri, int r, int tp,
                                   const Options& options = {}) {
  auto sub = Subscriber::Open(uri, options, SubscribePlacements{LlamaRules(), {tp, r}, {}});
  EXPECT_TRUE(sub.ok()) << sub.status();
  return sub.ok() ? *std::move(sub) : nullptr;
}

class TpSubscribeTest : public ::testing::TestWithParam<PublishCase> {};

std::string CaseName(const ::testing::TestParamInfo<PublishCase>& info) {
  return absl::StrFormat("World%d%s%s", info.param.world,
                         info.param.world == 1 ? "" : info.param.layout,
                         info.param.streamed ? "Streamed" : "");
}

TEST_P(TpSubscribeTest, EveryTpRankReceivesExactlyItsSlicesAndReadsOnlyThePartsTheyMeet) {
  const PublishCase& c = GetParam();
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  ASSERT_NO_FATAL_FAILURE(Publish(uri, c, 1));
  ASSERT_NO_FATAL_FAILURE(Publish(uri, c, 2));
  for (int tp : {1, 2, 4}) {
    for (int r = 0; r < tp; ++r) {
      SCOPED_TRACE(
          absl::StrFormat("publishers %d (%s), TP rank %d of %d", c.world, c.layout, r, tp));
      std::unique_ptr<Subscriber> sub = OpenTp(uri, r, tp);
      ASSERT_NE(sub, nullptr);
      // Version 2 replays the plan computed for version 1 (same layout).
      for (uint64_t version : {1, 2}) {
        auto u = sub->ReceiveVersion(version, kTimeout);
        ASSERT_TRUE(u.ok()) << u.status();
        ASSERT_EQ((*u)->tensors().size(), Model().size());
        for (const tools::OwnedTensor& t : Model()) {
          const TensorView* v = (*u)->Find(t.name);
          ASSERT_NE(v, nullptr) << t.name;
          const Box b = SliceBox(t, r, tp);
          std::vector<int64_t> shape(b.begin.size());
          for (size_t d = 0; d < shape.size(); ++d) shape[d] = b.end[d] - b.begin[d];
          EXPECT_EQ(v->shape, shape) << t.name;
          EXPECT_EQ(v->dtype, t.dtype) << t.name;
          const std::vector<std::byte> want = SliceBytes(t, b);
          ASSERT_EQ(std::memcmp(v->data, want.data(), want.size()), 0) << t.name;
        }
        // With the default tiles (at most 1 MiB, at least 16 KiB) this model's tensors of up to
        // 32 KiB are one tile each, the larger ones 2 to 8: a rank reads the tiles its slices
        // meet, never more than the parts they meet.
        EXPECT_EQ((*u)->stats().bytes, TileBytesTouched((*u)->manifest(), c, r, tp));
        EXPECT_LE((*u)->stats().bytes, BytesMet(c, r, tp));
        if (version == 1) {
          std::printf(
              "[ bytes    ] publishers %d %-4s TP %d rank %d: fetched %llu of %llu model "
              "bytes (%.0f%%)\n",
              c.world, c.world == 1 ? "" : c.layout.c_str(), tp, r,
              static_cast<unsigned long long>((*u)->stats().bytes),
              static_cast<unsigned long long>(ModelBytes()),
              100.0 * (*u)->stats().bytes / ModelBytes());
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Publishers, TpSubscribeTest,
                         ::testing::Values(PublishCase{1, "rows"}, PublishCase{2, "rows"},
                                           PublishCase{2, "cols"}, PublishCase{4, "rows"},
                                           PublishCase{4, "cols"}),
                         CaseName);

// Bound destinations are slice-shaped; a strided one gets the slice scattered into it.
TEST(TpSubscribeBindTest, BoundDestinationsReceiveTheSlice) {
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  const PublishCase c{2, "rows"};
  ASSERT_NO_FATAL_FAILURE(Publish(uri, c, 1));
  std::unique_ptr<Subscriber> sub = OpenTp(uri, 1, 2);
  ASSERT_NE(sub, nullptr);
  const std::string o = "model.layers.0.self_attn.o_proj.weight";  // [64, 64], columns 32..63
  const std::string q = "model.layers.0.self_attn.q_proj.weight";  // [64, 64], rows 32..63
  // o's slice [64, 32] stored column-major (strides {1, 64}); q's [32, 64] contiguous.
  std::vector<float> o_dest(64 * 32, -1), q_dest(32 * 64, -1);
  ASSERT_TRUE(sub->Bind(o, {DType::kF32, {64, 32}, {1, 64}, o_dest.data()}).ok());
  ASSERT_TRUE(sub->Bind(q, {DType::kF32, {32, 64}, {}, q_dest.data()}).ok());
  auto u = sub->ReceiveVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  const tools::OwnedTensor* o_t = nullptr;
  const tools::OwnedTensor* q_t = nullptr;
  for (const tools::OwnedTensor& t : Model()) {
    if (t.name == o) o_t = &t;
    if (t.name == q) q_t = &t;
  }
  ASSERT_NE(o_t, nullptr);
  ASSERT_NE(q_t, nullptr);
  const float* o_whole = reinterpret_cast<const float*>(o_t->bytes.data());
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < 32; ++j) ASSERT_EQ(o_dest[i + 64 * j], o_whole[i * 64 + 32 + j]) << i << j;
  }
  const std::vector<std::byte> q_want = SliceBytes(*q_t, SliceBox(*q_t, 1, 2));
  EXPECT_EQ(std::memcmp(q_dest.data(), q_want.data(), q_want.size()), 0);
  EXPECT_EQ((*u)->Find(q)->data, q_dest.data());
  EXPECT_EQ((*u)->Find(o)->data, o_dest.data());
  EXPECT_EQ((*u)->Find(o)->strides, (std::vector<int64_t>{1, 64}));

  // A destination of the whole tensor's shape is refused before anything is written.
  std::vector<float> whole(64 * 64, -1);
  ASSERT_TRUE(sub->Bind(q, {DType::kF32, {64, 64}, {}, whole.data()}).ok());
  auto again = sub->ReceiveVersion(1, kTimeout);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kInvalidArgument) << again.status();
  EXPECT_THAT(std::string(again.status().message()),
              HasSubstr("\"" + q +
                        "\" of version 1 is F32 [32, 64] but its bound destination "
                        "is F32 [64, 64]"));
  for (float x : whole) ASSERT_EQ(x, -1);
}

// A TP degree that does not divide a dimension is InvalidArgument naming the tensor and the
// degree, before any fetch: with core.before_fetch set to fail, the planner's error comes
// first (a valid degree reaches the fail point).
TEST(TpSubscribeErrorsTest, ADegreeThatDoesNotDivideIsRefusedBeforeAnyFetch) {
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  ASSERT_NO_FATAL_FAILURE(Publish(uri, PublishCase{2, "rows"}, 1));
  const testing::ScopedEnv env("WEIGHTBUS_FAILPOINTS", "core.before_fetch=error");
  std::unique_ptr<Subscriber> three = OpenTp(uri, 0, 3);
  ASSERT_NE(three, nullptr);
  auto u = three->ReceiveVersion(1, kTimeout);
  EXPECT_EQ(u.status().code(), absl::StatusCode::kInvalidArgument) << u.status();
  const std::string message(u.status().message());
  EXPECT_THAT(message, HasSubstr("TP rank 0 of 3"));
  EXPECT_THAT(message, HasSubstr("tensor \"model.embed_tokens.weight\" (Shard(0) at TP rank 0 of "
                                 "3): TP degree 3 does not divide dimension 0 of size 512"));
  EXPECT_THAT(message, HasSubstr("nothing was fetched, version none stays current"));
  EXPECT_FALSE(three->current_version().has_value());

  std::unique_ptr<Subscriber> two = OpenTp(uri, 0, 2);
  ASSERT_NE(two, nullptr);
  auto reached = two->ReceiveVersion(1, kTimeout);
  EXPECT_EQ(reached.status().code(), absl::StatusCode::kInternal) << reached.status();
  EXPECT_THAT(std::string(reached.status().message()), HasSubstr("core.before_fetch"));
}

TEST(TpSubscribeErrorsTest, ARankOutsideTheGroupIsRefusedAtOpen) {
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  for (TensorParallelRank bad :
       {TensorParallelRank{2, 2}, TensorParallelRank{0, 0}, TensorParallelRank{2, -1}}) {
    auto sub = Subscriber::Open(uri, {}, SubscribePlacements{LlamaRules(), bad, {}});
    EXPECT_EQ(sub.status().code(), absl::StatusCode::kInvalidArgument) << sub.status();
    EXPECT_THAT(std::string(sub.status().message()),
                HasSubstr(absl::StrFormat("TP rank %d of a group of size %d", bad.rank, bad.size)));
  }
}

// A listed destination the version lacks is NotFound naming it, before any fetch.
TEST(TpSubscribeErrorsTest, AnUnknownDestinationIsNotFound) {
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  ASSERT_NO_FATAL_FAILURE(Publish(uri, PublishCase{1}, 1));
  auto sub = Subscriber::Open(uri, {},
                              SubscribePlacements{LlamaRules(), {2, 0}, {"model.no_such.weight"}});
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto u = (*sub)->ReceiveVersion(1, kTimeout);
  EXPECT_EQ(u.status().code(), absl::StatusCode::kNotFound) << u.status();
  EXPECT_THAT(std::string(u.status().message()), HasSubstr("model.no_such.weight"));
}

// A corrupt part the plan reads is DataLoss; bound destinations keep what they held and no
// version becomes current.
TEST(TpSubscribeErrorsTest, ACorruptPartLeavesDestinationsUntouched) {
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  ASSERT_NO_FATAL_FAILURE(Publish(uri, PublishCase{2, "rows"}, 1));
  // Rank 1's rows of layer 0's o_proj, which TP rank 0's column slice reads: flip one bit.
  const tools::OwnedTensor* o = nullptr;
  for (const tools::OwnedTensor& t : Model()) {
    if (t.name == "model.layers.0.self_attn.o_proj.weight") o = &t;
  }
  ASSERT_NE(o, nullptr);
  const std::string file = testing::DiskVersionDir(dir, 1) + "/rank-00001/model.safetensors";
  std::string bytes = testing::ReadFileOrDie(file);
  const std::string rows(reinterpret_cast<const char*>(o->bytes.data()) + 32 * 64 * 4, 32 * 64 * 4);
  const size_t at = bytes.find(rows);
  ASSERT_NE(at, std::string::npos);
  bytes[at + 100] ^= 1;
  testing::WriteFileOrDie(file, bytes);

  std::unique_ptr<Subscriber> sub = OpenTp(uri, 0, 2);
  ASSERT_NE(sub, nullptr);
  std::vector<float> dest(64 * 32, -1);
  ASSERT_TRUE(sub->Bind(o->name, {DType::kF32, {64, 32}, {}, dest.data()}).ok());
  auto u = sub->ReceiveVersion(1, kTimeout);
  EXPECT_EQ(u.status().code(), absl::StatusCode::kDataLoss) << u.status();
  EXPECT_THAT(std::string(u.status().message()), HasSubstr("tensor \"" + o->name +
                                                           "\" (the part of source rank 1) fails "
                                                           "verification in tile 0 of 1"));
  EXPECT_THAT(std::string(u.status().message()), HasSubstr("file " + file));
  for (float x : dest) ASSERT_EQ(x, -1);
  EXPECT_FALSE(sub->current_version().has_value());
}

// A version whose layout differs (here: "w" grows from 4 to 8 rows) gets a new plan; a stale
// one would hand over the old slice shape.
TEST(TpSubscribePlanTest, ALayoutChangeBetweenVersionsIsReplanned) {
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  auto pub = Publisher::Open(uri);
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub =
      Subscriber::Open(uri, {}, SubscribePlacements{{{"w", Placement::Shard(0)}}, {2, 1}, {}});
  ASSERT_TRUE(sub.ok()) << sub.status();
  std::vector<float> m(48);
  for (int i = 0; i < 48; ++i) m[i] = static_cast<float>(i);
  for (int64_t rows : {4, 8, 8}) {
    const uint64_t v = (*sub)->current_version().value_or(0) + 1;
    ASSERT_TRUE(
        (*pub)
            ->Publish(v, {TensorView{"w", DType::kF32, {rows, 6}, {}, m.data()}}, {}, kTimeout)
            .ok());
    auto u = (*sub)->ReceiveVersion(v, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    const TensorView& w = (*u)->tensors()[0];
    EXPECT_EQ(w.shape, (std::vector<int64_t>{rows / 2, 6})) << "version " << v;
    EXPECT_EQ(std::memcmp(w.data, m.data() + rows / 2 * 6, rows / 2 * 6 * 4), 0) << "version " << v;
  }
}

// Fused destinations, listed by name: vLLM's gate_up_proj (each rank's gate rows, then its up
// rows) and qkv_proj with grouped-query attention (8 query heads, 4 KV heads of 8 rows; at TP 8
// each KV head is replicated on two ranks), from a group of 2 publishing row shards.
TEST(TpSubscribeFusedTest, GateUpAndQkvAreAssembledFromTheirParts) {
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  ASSERT_NO_FATAL_FAILURE(Publish(uri, PublishCase{2, "rows"}, 1));
  auto find = [](const std::string& name) -> const tools::OwnedTensor& {
    for (const tools::OwnedTensor& t : Model()) {
      if (t.name == name) return t;
    }
    ADD_FAILURE() << name;
    return Model().front();
  };
  const std::string p = "model.layers.1.";
  const tools::OwnedTensor& gate = find(p + "mlp.gate_proj.weight");  // [172, 64]
  const tools::OwnedTensor& up = find(p + "mlp.up_proj.weight");
  const tools::OwnedTensor& q = find(p + "self_attn.q_proj.weight");  // [64, 64]
  const tools::OwnedTensor& k = find(p + "self_attn.k_proj.weight");  // [32, 64]
  const tools::OwnedTensor& v = find(p + "self_attn.v_proj.weight");
  // Rows [begin, end) of `t`, row-major.
  auto rows = [](const tools::OwnedTensor& t, int64_t begin, int64_t end) {
    return SliceBytes(t, Box{{begin, 0}, {end, t.shape[1]}});
  };
  for (int tp : {2, 4, 8}) {
    for (int r = 0; r < tp; ++r) {
      SCOPED_TRACE(absl::StrFormat("TP rank %d of %d", r, tp));
      std::vector<std::string> names = {p + "self_attn.qkv_proj.weight"};
      if (tp != 8) names.push_back(p + "mlp.gate_up_proj.weight");  // 172 rows split 2 or 4 ways
      auto sub =
          Subscriber::Open(uri, {},
                           SubscribePlacements{{{"*.qkv_proj.weight", Placement::Qkv(8, 4, 8)},
                                                {"*.gate_up_proj.weight", Placement::GateUp()}},
                                               {tp, r},
                                               names});
      ASSERT_TRUE(sub.ok()) << sub.status();
      auto u = (*sub)->ReceiveVersion(1, kTimeout);
      ASSERT_TRUE(u.ok()) << u.status();
      ASSERT_EQ((*u)->tensors().size(), names.size());

      std::vector<std::byte> qkv = rows(q, 64 / tp * r, 64 / tp * (r + 1));
      const int64_t kv_begin = tp <= 4 ? 32 / tp * r : 8 * (r / (tp / 4));
      const int64_t kv_rows = tp <= 4 ? 32 / tp : 8;
      for (const tools::OwnedTensor* t : {&k, &v}) {
        const std::vector<std::byte> b = rows(*t, kv_begin, kv_begin + kv_rows);
        qkv.insert(qkv.end(), b.begin(), b.end());
      }
      const TensorView& got_qkv = (*u)->tensors()[0];
      EXPECT_EQ(got_qkv.shape, (std::vector<int64_t>{64 / tp + 2 * kv_rows, 64}));
      EXPECT_EQ(std::memcmp(got_qkv.data, qkv.data(), qkv.size()), 0);
      if (tp == 8) continue;
      const int64_t n = 172 / tp;
      std::vector<std::byte> gate_up = rows(gate, n * r, n * (r + 1));
      const std::vector<std::byte> up_rows = rows(up, n * r, n * (r + 1));
      gate_up.insert(gate_up.end(), up_rows.begin(), up_rows.end());
      const TensorView& got_gu = (*u)->tensors()[1];
      EXPECT_EQ(got_gu.name, p + "mlp.gate_up_proj.weight");
      EXPECT_EQ(got_gu.shape, (std::vector<int64_t>{2 * n, 64}));
      EXPECT_EQ(std::memcmp(got_gu.data, gate_up.data(), gate_up.size()), 0);
    }
  }
}

// Partial reads (docs/RESHARDING.md, "What a rank reads"): with block checksums every rank
// reads the checksum tiles its slices touch and nothing else.
constexpr uint64_t kBlock = 4096;

// The same for a manifest with the 1-D blocks of format 1 (kBlock bytes, the last of a part
// shorter): for each row of a slice's intersection with a part, the blocks of its byte run in
// the part's row-major bytes.
uint64_t BlockBytesTouched(const PublishCase& c, int r, int tp) {
  uint64_t n = 0;
  for (const tools::OwnedTensor& t : Model()) {
    const Box want = SliceBox(t, r, tp);
    for (const Box& part : PublishedParts(t, c)) {
      if (!Meet(part, want)) continue;
      const uint64_t part_bytes = Elements(part) * 4;
      std::set<uint64_t> blocks;
      if (t.shape.size() != 2) {
        for (uint64_t b = 0; b * kBlock < part_bytes; ++b) blocks.insert(b);
      } else {
        const int64_t cols = part.end[1] - part.begin[1];
        const int64_t c0 = std::max(part.begin[1], want.begin[1]);
        const int64_t c1 = std::min(part.end[1], want.end[1]);
        for (int64_t row = std::max(part.begin[0], want.begin[0]);
             row < std::min(part.end[0], want.end[0]); ++row) {
          const uint64_t lo = ((row - part.begin[0]) * cols + (c0 - part.begin[1])) * 4;
          const uint64_t hi = ((row - part.begin[0]) * cols + (c1 - part.begin[1])) * 4;
          for (uint64_t b = lo / kBlock; b <= (hi - 1) / kBlock; ++b) blocks.insert(b);
        }
      }
      for (uint64_t b : blocks) n += std::min(kBlock, part_bytes - b * kBlock);
    }
  }
  return n;
}

// The bytes of rank `r` of `tp`'s slices: what it reads when its slices fall on tile
// boundaries.
uint64_t SliceBytesOf(int r, int tp) {
  uint64_t n = 0;
  for (const tools::OwnedTensor& t : Model()) n += Elements(SliceBox(t, r, tp)) * 4;
  return n;
}

class TpPartialReadTest : public ::testing::TestWithParam<PublishCase> {};

// The bytes a rank reads (UpdateStats::bytes) are exactly the tiles its slices touch, through a
// staging window smaller than most tensors' parts, and the slices are bit-exact. With 4 KiB
// tiles every matrix part of this model is cut into up to 8 x 8 tiles, so that row-parallel
// o_proj/down_proj slices (the same columns of every row) are read as their own tiles, not
// whole.
TEST_P(TpPartialReadTest, EachRankReadsExactlyTheTilesItsSlicesTouch) {
  const PublishCase& c = GetParam();
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  ASSERT_NO_FATAL_FAILURE(Publish(uri, c, 1, {{"checksum_block", "4KiB"}}));
  for (int tp : {1, 2, 4}) {
    for (int r = 0; r < tp; ++r) {
      SCOPED_TRACE(
          absl::StrFormat("publishers %d (%s), TP rank %d of %d", c.world, c.layout, r, tp));
      std::unique_ptr<Subscriber> sub = OpenTp(uri, r, tp, {{"staging_window", "64KiB"}});
      ASSERT_NE(sub, nullptr);
      auto u = sub->ReceiveVersion(1, kTimeout);
      ASSERT_TRUE(u.ok()) << u.status();
      for (const tools::OwnedTensor& t : Model()) {
        const TensorView* v = (*u)->Find(t.name);
        ASSERT_NE(v, nullptr) << t.name;
        const std::vector<std::byte> want = SliceBytes(t, SliceBox(t, r, tp));
        ASSERT_EQ(std::memcmp(v->data, want.data(), want.size()), 0) << t.name;
      }
      const uint64_t touched = TileBytesTouched((*u)->manifest(), c, r, tp);
      EXPECT_EQ((*u)->stats().bytes, touched);
      // Every dimension of this model that TP 2 and 4 split divides into the tiles' equal
      // fractions, in every publisher layout here: each rank reads exactly its slices, row-
      // parallel ones included, and never more than the parts met.
      EXPECT_EQ(touched, SliceBytesOf(r, tp));
      EXPECT_LE(touched, BytesMet(c, r, tp));
      if (c.world == 1 && tp > 1) EXPECT_LT(touched, BytesMet(c, r, tp));
      std::printf(
          "[ bytes    ] publishers %d %-4s TP %d rank %d: read %llu of %llu model bytes "
          "(%.1f%%) in tiles of at most 4 KiB; slices %llu, parts met %llu\n",
          c.world, c.world == 1 ? "" : c.layout.c_str(), tp, r,
          static_cast<unsigned long long>(touched), static_cast<unsigned long long>(ModelBytes()),
          100.0 * touched / ModelBytes(), static_cast<unsigned long long>(SliceBytesOf(r, tp)),
          static_cast<unsigned long long>(BytesMet(c, r, tp)));
    }
  }
}

// Streamed versions carry block checksums too (their spool hashes each block as it writes).
INSTANTIATE_TEST_SUITE_P(Publishers, TpPartialReadTest,
                         ::testing::Values(PublishCase{1, "rows"}, PublishCase{2, "rows"},
                                           PublishCase{4, "cols"},
                                           PublishCase{1, "rows", /*streamed=*/true},
                                           PublishCase{2, "rows", /*streamed=*/true}),
                         CaseName);

// A manifest without block checksums (checksum_block=0, as every manifest written before them)
// is read part by part and verified whole, as before.
TEST(TpPartialReadOldManifestTest, WithoutBlockChecksumsThePartsMetAreReadWhole) {
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  const PublishCase c{2, "rows"};
  ASSERT_NO_FATAL_FAILURE(Publish(uri, c, 1, {{"checksum_block", "0"}}));
  const std::string manifest =
      testing::ReadFileOrDie(testing::DiskVersionDir(dir, 1) + "/weightbus.manifest.json");
  EXPECT_THAT(manifest, ::testing::Not(HasSubstr("block_bytes")));
  std::unique_ptr<Subscriber> sub = OpenTp(uri, 1, 2);
  ASSERT_NE(sub, nullptr);
  auto u = sub->ReceiveVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*u)->stats().bytes, BytesMet(c, 1, 2));
  for (const tools::OwnedTensor& t : Model()) {
    const std::vector<std::byte> want = SliceBytes(t, SliceBox(t, 1, 2));
    ASSERT_EQ(std::memcmp((*u)->Find(t.name)->data, want.data(), want.size()), 0) << t.name;
  }
}

// The model with every float doubled: a version whose bytes differ from the fixture's.
std::vector<tools::OwnedTensor> Doubled() {
  std::vector<tools::OwnedTensor> out = Model();
  for (tools::OwnedTensor& t : out) {
    float* f = reinterpret_cast<float*>(t.bytes.data());
    for (size_t i = 0; i < t.bytes.size() / 4; ++i) f[i] *= 2;
  }
  return out;
}

// Flips one bit of `file` inside the bytes equal to `needle` (found once in it), `at` bytes in.
void FlipInFile(const std::string& file, const std::string& needle, size_t at) {
  std::string bytes = testing::ReadFileOrDie(file);
  const size_t found = bytes.find(needle);
  ASSERT_NE(found, std::string::npos) << file;
  bytes[found + at] ^= 1;
  testing::WriteFileOrDie(file, bytes);
}

// A manifest with the 1-D blocks of format 1 (written before tiles) is still read block by block:
// each rank reads exactly the blocks its slices touch (row-parallel ones: every block of the
// part, as before tiles), bit-exact, and a corrupt block is DataLoss in the words of format 1.
TEST(TpPartialReadOldManifestTest, FormatOneBlocksAreStillReadBlockByBlock) {
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  const PublishCase c{1};
  ASSERT_NO_FATAL_FAILURE(Publish(uri, c, 1, {{"checksum_block", "4KiB"}}));
  // Rewrite the manifest as a publisher of format 1 wrote it: kBlock-byte 1-D blocks.
  const std::string path = testing::DiskVersionDir(dir, 1) + "/weightbus.manifest.json";
  absl::StatusOr<Manifest> m = Manifest::FromJson(testing::ReadFileOrDie(path), path);
  ASSERT_TRUE(m.ok()) << m.status();
  for (TensorInfo& e : m->tensors) {
    const tools::OwnedTensor* t = nullptr;
    for (const tools::OwnedTensor& o : Model()) {
      if (o.name == e.name) t = &o;
    }
    ASSERT_NE(t, nullptr);
    e.block_rows = 0;
    e.block_bytes = kBlock;
    e.block_xxh3.clear();
    for (uint64_t at = 0; at < t->bytes.size(); at += kBlock) {
      e.block_xxh3.push_back(
          testing::Xxh3(t->bytes.data() + at, std::min<uint64_t>(kBlock, t->bytes.size() - at)));
    }
  }
  const std::string json = m->ToJson();
  EXPECT_THAT(json, HasSubstr("\"block_bytes\": 4096"));
  EXPECT_THAT(json, ::testing::Not(HasSubstr("\"tiles\"")));
  testing::WriteFileOrDie(path, json);
  for (int tp : {2, 4}) {
    for (int r = 0; r < tp; ++r) {
      SCOPED_TRACE(absl::StrFormat("TP rank %d of %d", r, tp));
      std::unique_ptr<Subscriber> sub = OpenTp(uri, r, tp, {{"staging_window", "64KiB"}});
      ASSERT_NE(sub, nullptr);
      auto u = sub->ReceiveVersion(1, kTimeout);
      ASSERT_TRUE(u.ok()) << u.status();
      EXPECT_EQ((*u)->stats().bytes, BlockBytesTouched(c, r, tp));
      EXPECT_GT((*u)->stats().bytes, SliceBytesOf(r, tp));  // row-parallel ones read whole
      for (const tools::OwnedTensor& t : Model()) {
        const std::vector<std::byte> want = SliceBytes(t, SliceBox(t, r, tp));
        ASSERT_EQ(std::memcmp((*u)->Find(t.name)->data, want.data(), want.size()), 0) << t.name;
      }
    }
  }
  // gate_proj of layer 0 ([172, 64] f32, 44032 bytes, blocks 0..10): a bit flipped in block 4.
  const std::string gate = "model.layers.0.mlp.gate_proj.weight";
  const tools::OwnedTensor* g = nullptr;
  for (const tools::OwnedTensor& t : Model()) {
    if (t.name == gate) g = &t;
  }
  ASSERT_NE(g, nullptr);
  const std::string file = testing::DiskVersionDir(dir, 1) + "/model.safetensors";
  ASSERT_NO_FATAL_FAILURE(
      FlipInFile(file, std::string(reinterpret_cast<const char*>(g->bytes.data()), g->bytes.size()),
                 4 * kBlock + 10));
  std::unique_ptr<Subscriber> sub = OpenTp(uri, 0, 2, {{"staging_window", "64KiB"}});
  ASSERT_NE(sub, nullptr);
  auto u = sub->ReceiveVersion(1, kTimeout);
  ASSERT_EQ(u.status().code(), absl::StatusCode::kDataLoss) << u.status();
  EXPECT_THAT(std::string(u.status().message()),
              HasSubstr("tensor \"" + gate +
                        "\" (the part of source rank 0) fails verification in block 4 of 11 "
                        "(bytes [16384, 20480) of its 44032, blocks of 4096 bytes; file " +
                        file));
}

// A byte flipped at rest in one tile of a rank's part is DataLoss naming the tensor, the
// tile (its rows and bytes) and the source rank for the TP rank that reads that tile; it keeps its
// previous version (current version, bound destination and the earlier Update's slices untouched).
// A TP rank whose slices do not touch the block receives the version: each verifies exactly what it
// read.
TEST(TpPartialReadCorruptionTest, ACorruptTileIsDataLossAndThePreviousVersionIsKept) {
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  const PublishCase c{2, "rows"};
  const Options block = {{"checksum_block", "4KiB"}};
  ASSERT_NO_FATAL_FAILURE(Publish(uri, c, 1, block));
  const std::vector<tools::OwnedTensor> doubled = Doubled();
  ASSERT_NO_FATAL_FAILURE(Publish(uri, c, 2, block, doubled));
  // gate_proj of layer 0 is [172, 64] f32; rank 1 of the group owns rows 86..171 (22016 bytes:
  // 86 rows of 256 bytes in 2 x 8 tiles of 43 rows x 32 bytes). Flip a bit at byte 16394 of its
  // part: row 64 (global row 150), byte 10, in tile 8 (rows [43, 86), bytes [0, 32)).
  const std::string gate = "model.layers.0.mlp.gate_proj.weight";
  const tools::OwnedTensor* g = nullptr;
  for (const tools::OwnedTensor& t : doubled) {
    if (t.name == gate) g = &t;
  }
  ASSERT_NE(g, nullptr);
  ASSERT_EQ(g->shape, (std::vector<int64_t>{172, 64}));
  const std::string rank1_rows(reinterpret_cast<const char*>(g->bytes.data()) + 86 * 64 * 4,
                               86 * 64 * 4);
  const std::string file = testing::DiskVersionDir(dir, 2) + "/rank-00001/model.safetensors";
  ASSERT_NO_FATAL_FAILURE(FlipInFile(file, rank1_rows, 4 * kBlock + 10));

  // At TP 4, gate_proj rows 129..171 are rank 3's and rows 86..128 rank 2's: rank 3 reads the
  // tiles of the part's rows 43..85 (band 1), rank 2 those of its rows 0..42 (band 0) only.
  for (int r : {2, 3}) {
    SCOPED_TRACE(absl::StrFormat("TP rank %d of 4", r));
    std::unique_ptr<Subscriber> sub = OpenTp(uri, r, 4, {{"staging_window", "64KiB"}});
    ASSERT_NE(sub, nullptr);
    std::vector<float> dest(43 * 64, -1);
    ASSERT_TRUE(sub->Bind(gate, {DType::kF32, {43, 64}, {}, dest.data()}).ok());
    auto v1 = sub->ReceiveVersion(1, kTimeout);
    ASSERT_TRUE(v1.ok()) << v1.status();
    const std::string embed = "model.embed_tokens.weight";
    const std::vector<std::byte> embed_v1(
        static_cast<const std::byte*>((*v1)->Find(embed)->data),
        static_cast<const std::byte*>((*v1)->Find(embed)->data) + 128 * 64 * 4);
    const std::vector<float> dest_v1 = dest;
    auto v2 = sub->ReceiveVersion(2, kTimeout);
    if (r == 2) {
      ASSERT_TRUE(v2.ok()) << v2.status();
      EXPECT_EQ(std::memcmp(dest.data(), g->bytes.data() + 86 * 64 * 4, dest.size() * 4), 0);
      continue;
    }
    ASSERT_EQ(v2.status().code(), absl::StatusCode::kDataLoss) << v2.status();
    const std::string message(v2.status().message());
    EXPECT_THAT(message, HasSubstr("version 2: tensor \"" + gate +
                                   "\" (the part of source rank 1) fails verification in tile 8 "
                                   "of 16 (rows [43, 86) x bytes [0, 32) of its 86 rows of 256 "
                                   "bytes, tiles of 43 rows x 32 bytes; file " +
                                   file));
    EXPECT_THAT(message, HasSubstr("version 1 stays current"));
    EXPECT_EQ(sub->current_version(), 1u);
    EXPECT_EQ(dest, dest_v1);
    EXPECT_EQ(std::memcmp((*v1)->Find(embed)->data, embed_v1.data(), embed_v1.size()), 0);
    // The previous version's slices are version 1's, not half of version 2.
    const std::vector<std::byte> want = SliceBytes(Model()[0], SliceBox(Model()[0], r, 4));
    EXPECT_EQ(std::memcmp((*v1)->Find(Model()[0].name)->data, want.data(), want.size()), 0);
  }
}

}  // namespace
}  // namespace weightbus

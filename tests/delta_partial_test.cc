// SPDX-License-Identifier: Apache-2.0
// Partial reads over the delta layer (lib/transports/delta/README.md, "Partial reads"): TP
// subscribers of delta+disk:// decode only the chunks of each encoded version that their slices
// meet, keep only those as the base of the next delta, and read (and verify) the checksum tiles
// of their slices, which the delta records carry. Checked on the stories260K training steps of
// tests/model_steps.h: every TP rank's slices bit-exact over keyframes, deltas on its partial
// copy and a late joiner's chain; bytes read equal to its slices; a version whose record has no
// tiles after partial ones (received whole, replayed from the keyframe); a corrupt blob
// (DataLoss, the previous version kept); and a publisher group whose rank none of a TP rank's
// slices meet (its blob is not even read).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "llama_groups.h"
#include "model_steps.h"
#include "test_support.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::testing::HasSubstr;
using ::weightbus::testing::ScratchDir;
using namespace ::weightbus::testing::llama_groups;  // NOLINT: slices as tp_subscribe_test

constexpr absl::Duration kTimeout = absl::Seconds(60);

// Version v of the training steps.
std::vector<tools::OwnedTensor> Step(uint64_t v) {
  std::vector<tools::OwnedTensor> m = testing::Stories260K();
  testing::StepLlama(m, v);
  return m;
}

// 4 KiB tiles and 4 KiB chunks (most tensors of this model span several of each), deltas
// always (no plain versions), a keyframe every 4 versions, every version kept.
Options PublisherOptions(const std::string& checksum_block = "4KiB") {
  return {{"checksum_block", checksum_block},
          {"delta_chunk_size", "4KiB"},
          {"delta_send_plain", "false"},
          {"keyframe_interval", "4"},
          {"retention", "100"}};
}

void PublishSteps(const std::string& uri, uint64_t first, uint64_t last,
                  const Options& options = PublisherOptions()) {
  auto p = Publisher::Open(uri, options);
  ASSERT_TRUE(p.ok()) << p.status();
  for (uint64_t v = first; v <= last; ++v) {
    const std::vector<tools::OwnedTensor> m = Step(v);
    std::vector<TensorView> views;
    for (const tools::OwnedTensor& t : m) views.push_back(t.view());
    const absl::Status s = (*p)->Publish(v, views, {}, kTimeout);
    ASSERT_TRUE(s.ok()) << "version " << v << ": " << s;
  }
}

std::unique_ptr<Subscriber> OpenTp(const std::string& uri, int r, int tp) {
  auto sub = Subscriber::Open(uri, {{"staging_window", "64KiB"}},
                              SubscribePlacements{LlamaRules(), {tp, r}, {}});
  EXPECT_TRUE(sub.ok()) << sub.status();
  return sub.ok() ? *std::move(sub) : nullptr;
}

uint64_t SliceBytesOf(int r, int tp) {
  uint64_t n = 0;
  for (const tools::OwnedTensor& t : Model()) n += Elements(SliceBox(t, r, tp)) * 4;
  return n;
}

// `u` holds TP rank r of tp's slices of version v, bit for bit.
void ExpectSlices(const Update& u, uint64_t v, int r, int tp) {
  ASSERT_EQ(u.version(), v);
  for (const tools::OwnedTensor& t : Step(v)) {
    const TensorView* got = u.Find(t.name);
    ASSERT_NE(got, nullptr) << t.name;
    const std::vector<std::byte> want = SliceBytes(t, SliceBox(t, r, tp));
    ASSERT_EQ(std::memcmp(got->data, want.data(), want.size()), 0)
        << t.name << " of version " << v << " at TP rank " << r << " of " << tp;
  }
}

// Keyframes at 1 and 5, deltas between: each TP rank's deltas apply to its own partial copy
// ("delta v on this subscriber's copy"), its slices are bit-exact and it reads exactly them.
TEST(DeltaPartialTest, TpRanksDecodeTheirChunksAndReadExactlyTheirSlices) {
  ScratchDir dir;
  const std::string uri = "delta+disk://" + dir.path() + "/channel";
  ASSERT_NO_FATAL_FAILURE(PublishSteps(uri, 1, 6));
  for (int tp : {2, 4}) {
    for (int r = 0; r < tp; ++r) {
      SCOPED_TRACE(absl::StrFormat("TP rank %d of %d", r, tp));
      std::unique_ptr<Subscriber> sub = OpenTp(uri, r, tp);
      ASSERT_NE(sub, nullptr);
      for (uint64_t v = 1; v <= 6; ++v) {
        auto u = sub->ReceiveVersion(v, kTimeout);
        ASSERT_TRUE(u.ok()) << u.status();
        ASSERT_NO_FATAL_FAILURE(ExpectSlices(**u, v, r, tp));
        EXPECT_EQ((*u)->stats().bytes, SliceBytesOf(r, tp));
        const std::string& how = (*u)->stats().encoding;
        if (v == 1 || v == 5) {
          EXPECT_THAT(how, HasSubstr(absl::StrFormat("keyframe %d", v)));
        } else {
          EXPECT_THAT(how, HasSubstr(absl::StrFormat("delta %d on this subscriber's copy of "
                                                     "version %d",
                                                     v, v - 1)));
        }
      }
    }
  }
  // A late joiner replays the chain from keyframe 1, decoding only its chunks of each version.
  std::unique_ptr<Subscriber> late = OpenTp(uri, 1, 4);
  ASSERT_NE(late, nullptr);
  auto u = late->ReceiveVersion(3, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_NO_FATAL_FAILURE(ExpectSlices(**u, 3, 1, 4));
  EXPECT_THAT((*u)->stats().encoding, HasSubstr("keyframe 1 + 2 deltas up to 3"));
  u = late->ReceiveVersion(4, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_NO_FATAL_FAILURE(ExpectSlices(**u, 4, 1, 4));
  EXPECT_THAT((*u)->stats().encoding, HasSubstr("delta 4 on this subscriber's copy of version 3"));
}

// A version whose record carries no tiles (its publisher had checksum_block=0) is read whole
// by the core; the TP rank's copy holds only its chunks of the version before, so the layer
// replays the version from its keyframe. The next version with tiles is a delta on the copy
// that whole version left.
TEST(DeltaPartialTest, AVersionWithoutTilesAfterPartialOnesIsReplayedFromTheKeyframe) {
  ScratchDir dir;
  const std::string uri = "delta+disk://" + dir.path() + "/channel";
  ASSERT_NO_FATAL_FAILURE(PublishSteps(uri, 1, 2));
  std::unique_ptr<Subscriber> sub = OpenTp(uri, 0, 2);
  ASSERT_NE(sub, nullptr);
  for (uint64_t v : {1, 2}) {
    auto u = sub->ReceiveVersion(v, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    EXPECT_EQ((*u)->stats().bytes, SliceBytesOf(0, 2));
  }
  ASSERT_NO_FATAL_FAILURE(PublishSteps(uri, 3, 3, PublisherOptions("0")));  // resumes the chain
  auto u = sub->ReceiveVersion(3, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_NO_FATAL_FAILURE(ExpectSlices(**u, 3, 0, 2));
  EXPECT_THAT((*u)->stats().encoding, HasSubstr("keyframe 1 + 2 deltas up to 3"));
  EXPECT_EQ((*u)->stats().bytes, BytesMet(PublishCase{1}, 0, 2));  // whole tensors met
  ASSERT_NO_FATAL_FAILURE(PublishSteps(uri, 4, 4));
  u = sub->ReceiveVersion(4, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_NO_FATAL_FAILURE(ExpectSlices(**u, 4, 0, 2));
  EXPECT_THAT((*u)->stats().encoding, HasSubstr("delta 4 on this subscriber's copy of version 3"));
  EXPECT_EQ((*u)->stats().bytes, SliceBytesOf(0, 2));
}

// A blob damaged at rest is DataLoss for the TP rank; it keeps the version it has (current
// version and slices), asks for a keyframe, and receives the keyframe that answers it.
TEST(DeltaPartialTest, ACorruptBlobKeepsThePreviousVersion) {
  ScratchDir dir;
  const std::string uri = "delta+disk://" + dir.path() + "/channel";
  ASSERT_NO_FATAL_FAILURE(PublishSteps(uri, 1, 3));
  const std::string file = testing::DiskVersionDir(dir, 3) + "/model.safetensors";
  std::string bytes = testing::ReadFileOrDie(file);
  bytes[bytes.size() - 100] ^= 1;
  testing::WriteFileOrDie(file, bytes);
  std::unique_ptr<Subscriber> sub = OpenTp(uri, 1, 2);
  ASSERT_NE(sub, nullptr);
  auto v2 = sub->ReceiveVersion(2, kTimeout);
  ASSERT_TRUE(v2.ok()) << v2.status();
  auto v3 = sub->ReceiveVersion(3, kTimeout);
  ASSERT_EQ(v3.status().code(), absl::StatusCode::kDataLoss) << v3.status();
  EXPECT_THAT(std::string(v3.status().message()), HasSubstr("version 2 stays current"));
  EXPECT_EQ(sub->current_version(), 2u);
  ASSERT_NO_FATAL_FAILURE(ExpectSlices(**v2, 2, 1, 2));
  // The publisher answers the subscriber's request with a keyframe.
  ASSERT_NO_FATAL_FAILURE(PublishSteps(uri, 4, 4));
  auto v4 = sub->ReceiveVersion(4, kTimeout);
  ASSERT_TRUE(v4.ok()) << v4.status();
  ASSERT_NO_FATAL_FAILURE(ExpectSlices(**v4, 4, 1, 2));
  EXPECT_THAT((*v4)->stats().encoding, HasSubstr("keyframe 4"));
}

// A group of 2 publishes row shards of column-parallel tensors only: TP rank r of 2 needs rows
// that publisher rank r alone owns, so it decodes rank r's chain only and never reads the other
// rank's blob (its wire bytes are rank r's blob).
TEST(DeltaPartialTest, AGroupRankNoSliceMeetsIsNotRead) {
  ScratchDir dir;
  const std::string uri = "delta+disk://" + dir.path() + "/channel";
  std::vector<tools::OwnedTensor> columns;
  for (const tools::OwnedTensor& t : Model()) {
    if (t.shape.size() == 2 && SplitDim(t.name) == 0) columns.push_back(t);
  }
  ASSERT_GT(columns.size(), 10u);
  auto publish = [&](uint64_t v) {
    std::vector<absl::Status> status(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        Options o = PublisherOptions();
        o["rank"] = std::to_string(r);
        o["world_size"] = "2";
        o["poll_interval"] = "2ms";
        auto p = Publisher::Open(uri, o);
        if (!p.ok()) {
          status[r] = p.status();
          return;
        }
        std::vector<tools::OwnedTensor> m = columns;
        testing::StepLlama(m, v);
        std::vector<TensorView> views;
        std::vector<std::vector<std::byte>> keep;
        for (const tools::OwnedTensor& t : m) {
          const Box b = Block(t.shape, 0, r, 2);
          keep.push_back(SliceBytes(t, b));
          TensorView view = t.view();
          view.shape[0] = b.end[0] - b.begin[0];
          view.data = keep.back().data();
          view.shard = Shard{t.shape, b.begin};
          views.push_back(view);
        }
        status[r] = (*p)->Publish(v, views, {}, kTimeout);
      });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  };
  std::vector<std::unique_ptr<Subscriber>> subs;
  for (int r = 0; r < 2; ++r) {
    auto sub = Subscriber::Open(uri, {{"staging_window", "64KiB"}},
                                SubscribePlacements{{{"*", Placement::Shard(0)}}, {2, r}, {}});
    ASSERT_TRUE(sub.ok()) << sub.status();
    subs.push_back(*std::move(sub));
  }
  for (uint64_t v : {1, 2}) {
    ASSERT_NO_FATAL_FAILURE(publish(v));
    absl::StatusOr<Manifest> group = Manifest::FromJson(
        testing::ReadFileOrDie(testing::DiskVersionDir(dir, v) + "/weightbus.manifest.json"), "v");
    ASSERT_TRUE(group.ok()) << group.status();
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE(absl::StrFormat("version %d, TP rank %d", v, r));
      auto u = subs[r]->ReceiveVersion(v, kTimeout);
      ASSERT_TRUE(u.ok()) << u.status();
      std::vector<tools::OwnedTensor> want = columns;
      testing::StepLlama(want, v);
      uint64_t slices = 0;
      for (const tools::OwnedTensor& t : want) {
        const std::vector<std::byte> bytes = SliceBytes(t, Block(t.shape, 0, r, 2));
        ASSERT_EQ(std::memcmp((*u)->Find(t.name)->data, bytes.data(), bytes.size()), 0) << t.name;
        slices += bytes.size();
      }
      EXPECT_EQ((*u)->stats().bytes, slices);
      const TensorInfo* blob = nullptr;
      for (const TensorInfo& t : group->tensors) {
        if (t.name == absl::StrFormat("weightbus.delta.rank-%d", r)) blob = &t;
      }
      ASSERT_NE(blob, nullptr);
      EXPECT_EQ((*u)->stats().wire_bytes, blob->nbytes) << (*u)->stats().encoding;
    }
  }
}

}  // namespace
}  // namespace weightbus

// SPDX-License-Identifier: Apache-2.0
// The delta layer over a publisher group (delta+disk://, lib/transports/delta/README.md "Over a
// publisher group"): 2 and 4 ranks as separate processes publish training steps of the
// stories260K fixture (tests/model_steps.h) as FSDP2 row shards or Megatron column slices; each
// rank encodes its own parts against its own previous parts. Checked: every version received
// bit-exact whole and by tensor-parallel subscribers (TP 2, resharded), late joiners replaying
// each rank's chain, restarted ranks continuing their chains with deltas, keyframes the whole
// group takes on the same versions (keyframe_interval), and a rank SIGKILLed mid-publish (the
// version never visible; the next version commits with valid deltas against the last committed
// one), and, in one process, a rank missing a version while the other's Publisher goes on (its
// next delta is against the last committed version). Prints the encoded bytes per rank per
// version (BENCHMARKS.md, issue 12).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "group_ranks.h"
#include "model_steps.h"
#include "nlohmann/json.hpp"
#include "stories260k.h"
#include "test_support.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::testing::HasSubstr;
using ::weightbus::testing::Child;
using ::weightbus::testing::ScratchDir;
using ::weightbus::testing::StartRanks;
using ::weightbus::testing::WaitAll;

constexpr absl::Duration kTimeout = absl::Seconds(60);
constexpr int kKeyframeInterval = 5;

std::string ChannelUri(const ScratchDir& dir) { return "delta+disk://" + dir.path() + "/channel"; }

// Version `v` of the steps, as every rank publishes it.
std::vector<tools::OwnedTensor> Step(uint64_t v) {
  std::vector<tools::OwnedTensor> m = testing::Stories260K();
  testing::StepLlama(m, v);
  return m;
}

// Peer flags of every rank: training steps, group keyframes every kKeyframeInterval versions,
// every version kept (the test reads them all back after the ranks are done).
std::vector<std::string> DeltaFlags() {
  return {"--steps", "1",
          "--set",   absl::StrFormat("keyframe_interval=%d", kKeyframeInterval),
          "--set",   "retention=100",
          "--set",   "delta_threads=2"};
}

// Starts a group publishing [start, start + versions) and expects every rank to succeed.
void PublishSteps(const ScratchDir& dir, const std::string& uri, int world,
                  const std::string& layout, uint64_t start, uint64_t versions,
                  const std::string& tag) {
  std::vector<Child> ranks =
      StartRanks(dir, uri, world, layout, start, versions, tag, {}, 60, -1, DeltaFlags());
  const std::vector<int> codes = WaitAll(ranks);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(codes[r], 0) << testing::ReadFileOrDie(dir / absl::StrFormat("%s%d.log", tag, r));
  }
}

// TP: every projection split on dimension 0 (column-parallel), the rest replicated.
SubscribePlacements TpPlacements(int tp, int rank) {
  return SubscribePlacements{{{"*_proj.weight", Placement::Shard(0)}}, {tp, rank}, {}};
}

// `u` holds TP rank `rank` of `tp`'s slices of version `v`: rows [n/tp * rank, n/tp * (rank+1))
// of every projection, the other tensors whole.
void ExpectSlices(const Update& u, uint64_t v, int tp, int rank) {
  const std::vector<tools::OwnedTensor> want = Step(v);
  ASSERT_EQ(u.version(), v);
  ASSERT_EQ(u.tensors().size(), want.size());
  for (const tools::OwnedTensor& t : want) {
    const TensorView* got = u.Find(t.name);
    ASSERT_NE(got, nullptr) << t.name;
    const bool split = absl::EndsWith(t.name, "_proj.weight");
    std::vector<int64_t> shape = t.shape;
    uint64_t offset = 0, bytes = t.bytes.size();
    if (split) {
      shape[0] = t.shape[0] / tp;
      bytes = t.bytes.size() / tp;
      offset = bytes * rank;
    }
    EXPECT_EQ(got->shape, shape) << t.name;
    ASSERT_EQ(std::memcmp(got->data, t.bytes.data() + offset, bytes), 0)
        << t.name << " of version " << v << ", TP rank " << rank << " of " << tp;
  }
}

// Every tensor of `u` equals version `v` of the steps, byte for byte (TP 1).
void ExpectWhole(const Update& u, uint64_t v) { ExpectSlices(u, v, 1, 0); }

// The records of committed version `v`, one per rank, from its group manifest on disk.
std::vector<nlohmann::json> Records(const ScratchDir& dir, uint64_t v, int world) {
  const std::string path = testing::DiskVersionDir(dir, v) + "/weightbus.manifest.json";
  auto m = Manifest::FromJson(testing::ReadFileOrDie(path), path);
  EXPECT_TRUE(m.ok()) << m.status();
  std::vector<nlohmann::json> out;
  if (!m.ok()) return out;
  EXPECT_TRUE(m->group);
  for (int r = 0; r < world; ++r) {
    auto it = m->metadata.find(absl::StrFormat("weightbus.delta.rank-%d", r));
    EXPECT_NE(it, m->metadata.end()) << "rank " << r << " of version " << v;
    out.push_back(it == m->metadata.end() ? nlohmann::json() : nlohmann::json::parse(it->second));
  }
  return out;
}

// The bytes of the parts rank `r` publishes (peer_main.cc publish-llama).
uint64_t PartBytes(int r, int world, const std::string& layout) {
  uint64_t n = 0;
  for (const tools::OwnedTensor& t : testing::Stories260K()) {
    if (t.shape.size() != 2) {
      n += t.bytes.size();  // replicated
    } else if (layout == "cols" && t.name == "model.embed_tokens.weight") {
      n += r == world - 1 ? t.bytes.size() : 0;
    } else {
      n += t.bytes.size() / world;
    }
  }
  return n;
}

struct GroupCase {
  int world;
  std::string layout;
};

class DeltaGroupTest : public ::testing::TestWithParam<GroupCase> {};

TEST_P(DeltaGroupTest, RanksEncodeTheirPartsAndWholeAndTpSubscribersReceiveEveryStepBitExact) {
  if (const std::string why = testing::MissingTransports({"delta", "disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  const auto [world, layout] = GetParam();
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  ASSERT_NO_FATAL_FAILURE(PublishSteps(dir, uri, world, layout, 1, 3, "first"));

  // Late joiners: each rank's chain replayed from its keyframe, whole and resharded.
  auto whole = Subscriber::Open(uri);
  ASSERT_TRUE(whole.ok()) << whole.status();
  auto first = (*whole)->ReceiveVersion(3, kTimeout);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_NO_FATAL_FAILURE(ExpectWhole(**first, 3));
  EXPECT_TRUE((*first)->manifest().group);
  for (int r = 0; r < world; ++r) {
    EXPECT_THAT((*first)->stats().encoding,
                HasSubstr(absl::StrFormat("rank %d: keyframe 1 + 2 deltas up to 3", r)));
  }
  std::vector<std::unique_ptr<Subscriber>> tp;
  for (int r = 0; r < 2; ++r) {
    auto s = Subscriber::Open(uri, {}, TpPlacements(2, r));
    ASSERT_TRUE(s.ok()) << s.status();
    auto u = (*s)->ReceiveVersion(3, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ASSERT_NO_FATAL_FAILURE(ExpectSlices(**u, 3, 2, r));
    tp.push_back(*std::move(s));
  }

  // The ranks restart (new processes): each reads its own chain back, checks it against the
  // channel's checksums and continues it with deltas; the group keyframes version 6 (interval 5
  // from keyframe 1) on every rank.
  ASSERT_NO_FATAL_FAILURE(PublishSteps(dir, uri, world, layout, 4, 4, "second"));
  for (uint64_t v = 4; v <= 7; ++v) {
    auto u = (*whole)->ReceiveVersion(v, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ASSERT_NO_FATAL_FAILURE(ExpectWhole(**u, v));
    for (int r = 0; r < world; ++r) {
      EXPECT_THAT((*u)->stats().encoding,
                  HasSubstr(v == 6 ? absl::StrFormat("rank %d: keyframe 6", r)
                                   : absl::StrFormat("rank %d: delta %d on this subscriber's "
                                                     "copy of version %d",
                                                     r, v, v - 1)));
    }
  }
  for (int r = 0; r < 2; ++r) {
    auto u = tp[r]->ReceiveVersion(7, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ASSERT_NO_FATAL_FAILURE(ExpectSlices(**u, 7, 2, r));
    EXPECT_THAT((*u)->stats().encoding, HasSubstr("rank 0: keyframe 6 + 1 deltas up to 7"));
  }

  // The records: every rank keyframes versions 1 and 6 and sends deltas against the version
  // before in between, each rank its own parts.
  uint64_t delta_bytes = 0, deltas = 0;
  for (uint64_t v = 1; v <= 7; ++v) {
    const std::vector<nlohmann::json> records = Records(dir, v, world);
    ASSERT_EQ(records.size(), static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      const nlohmann::json& rec = records[r];
      const bool keyframe = v == 1 || v == 6;
      EXPECT_EQ(rec.value("kind", ""), keyframe ? "keyframe" : "delta")
          << "rank " << r << " version " << v << ": " << rec.dump();
      EXPECT_EQ(rec.value("keyframe", uint64_t{0}), v < 6 ? 1u : 6u) << rec.dump();
      if (!keyframe) EXPECT_EQ(rec.value("base", uint64_t{0}), v - 1) << rec.dump();
      const uint64_t encoded = rec.value("encoded_bytes", uint64_t{0});
      const uint64_t part = PartBytes(r, world, layout);
      if (!keyframe) {
        delta_bytes += encoded;
        ++deltas;
        EXPECT_LT(encoded, part / 4) << "rank " << r << " version " << v;
      }
      std::printf(
          "[ delta    ] world %d %s version %d rank %d: %s of %llu bytes for %llu bytes "
          "of parts (%.1fx)\n",
          world, layout.c_str(), static_cast<int>(v), r, rec.value("kind", "").c_str(),
          static_cast<unsigned long long>(encoded), static_cast<unsigned long long>(part),
          static_cast<double>(part) / static_cast<double>(std::max<uint64_t>(1, encoded)));
    }
  }
  EXPECT_EQ(deltas, static_cast<uint64_t>(5 * world));
}

INSTANTIATE_TEST_SUITE_P(Layouts, DeltaGroupTest,
                         ::testing::Values(GroupCase{2, "rows"}, GroupCase{4, "cols"}),
                         [](const auto& info) {
                           return absl::StrFormat("%s_world%d", info.param.layout,
                                                  info.param.world);
                         });

// A rank SIGKILLed while it writes its part of version 3: the version never becomes visible
// (the survivors' DeadlineExceeded names the rank), and the next version commits with every
// rank's delta against version 2, the last committed one (the restarted rank read its own chain
// back; the survivors' bases never moved to the version that failed).
TEST(DeltaGroupKillTest, ARankKilledMidPublishLeavesNothingAndTheNextVersionIsValidDeltas) {
  if (const std::string why = testing::MissingTransports({"delta", "disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  constexpr int kWorld = 2, kVictim = 1;
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  ASSERT_NO_FATAL_FAILURE(PublishSteps(dir, uri, kWorld, "rows", 1, 2, "first"));
  auto sub = Subscriber::Open(uri);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto held = (*sub)->ReceiveVersion(2, kTimeout);
  ASSERT_TRUE(held.ok()) << held.status();

  {
    testing::PausePoint paused("disk.after_file");
    std::vector<Child> ranks = StartRanks(dir, uri, kWorld, "rows", 3, 1, "killed",
                                          {{kVictim, paused.Spec()}}, 8, -1, DeltaFlags());
    ASSERT_TRUE(paused.WaitReached(kTimeout))
        << testing::ReadFileOrDie(dir / absl::StrFormat("killed%d.log", kVictim));
    EXPECT_EQ(paused.ReachedBy(), ranks[kVictim].pid());
    ranks[kVictim].Kill(SIGKILL);
    const std::vector<int> codes = WaitAll(ranks);
    const std::string log = testing::ReadFileOrDie(dir / "killed0.log");
    EXPECT_EQ(codes[0], 1) << log;
    EXPECT_THAT(log, HasSubstr("version 3 was not committed: rank 1 of the group of 2 did not "
                               "publish its part by the deadline"));
  }
  EXPECT_EQ(testing::ReadFileOrDie(dir / "channel/LATEST"), "2\n");
  auto none = (*sub)->Poll(3, absl::ZeroDuration());
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);

  ASSERT_NO_FATAL_FAILURE(PublishSteps(dir, uri, kWorld, "rows", 3, 1, "again"));
  const std::vector<nlohmann::json> records = Records(dir, 3, kWorld);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(records[r].value("kind", ""), "delta") << records[r].dump();
    EXPECT_EQ(records[r].value("base", uint64_t{0}), 2u) << records[r].dump();
  }
  auto u = (*sub)->ReceiveVersion(3, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_NO_FATAL_FAILURE(ExpectWhole(**u, 3));
  EXPECT_THAT((*u)->stats().encoding,
              HasSubstr("rank 1: delta 3 on this subscriber's copy of version 2"));
  // A subscriber that joins now replays each rank's chain.
  auto late = Subscriber::Open(uri);
  ASSERT_TRUE(late.ok()) << late.status();
  auto l = (*late)->ReceiveVersion(3, kTimeout);
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_NO_FATAL_FAILURE(ExpectWhole(**l, 3));
}

// A group in this process, a thread per rank, each rank owning whole tensors (tensor i by rank
// i % world) of the steps.
class ThreadGroup {
 public:
  ThreadGroup(const std::string& uri, int world) : world_(world) {
    for (int r = 0; r < world; ++r) {
      auto p = Publisher::Open(uri, {{"rank", std::to_string(r)},
                                     {"world_size", std::to_string(world)},
                                     {"poll_interval", "2ms"},
                                     {"retention", "100"}});
      EXPECT_TRUE(p.ok()) << p.status();
      if (p.ok()) pubs_.push_back(*std::move(p));
    }
  }
  // Rank r's tensors of `model`.
  std::vector<TensorView> Views(const std::vector<tools::OwnedTensor>& model, int r) const {
    std::vector<TensorView> views;
    for (size_t i = 0; i < model.size(); ++i) {
      if (static_cast<int>(i % world_) == r) views.push_back(model[i].view());
    }
    return views;
  }
  // Every rank publishes step `v`, concurrently; each must succeed.
  void PublishAll(uint64_t v) {
    ASSERT_EQ(pubs_.size(), static_cast<size_t>(world_));
    const std::vector<tools::OwnedTensor> model = Step(v);
    std::vector<absl::Status> status(world_);
    std::vector<std::thread> threads;
    for (int r = 0; r < world_; ++r) {
      threads.emplace_back(
          [&, r] { status[r] = pubs_[r]->Publish(v, Views(model, r), {}, kTimeout); });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < world_; ++r) EXPECT_TRUE(status[r].ok()) << "rank " << r << status[r];
  }
  Publisher& rank(int r) { return *pubs_[r]; }

 private:
  int world_;
  std::vector<std::unique_ptr<Publisher>> pubs_;
};

// Two ranks in this process (ThreadGroup) on a fresh delta+disk channel.
class DeltaGroupThreadsTest : public ::testing::Test {
 protected:
  static constexpr int kWorld = 2;
  void SetUp() override {
    if (const std::string why = testing::MissingTransports({"delta", "disk"}); !why.empty()) {
      GTEST_SKIP() << why;
    }
  }
  ScratchDir dir_;
  const std::string uri_ = ChannelUri(dir_);
};

// Rank 1 never publishes version 3, so rank 0's Publish gives up (DeadlineExceeded naming rank
// 1) and nothing of version 3 is visible; the same Publisher objects then publish version 4,
// each rank a delta against version 2, the last committed one (rank 0's base did not move to
// the version that failed).
TEST_F(DeltaGroupThreadsTest, ARankMissingAVersionLeavesTheOthersBasesAtTheLastCommittedOne) {
  ThreadGroup group(uri_, kWorld);
  ASSERT_NO_FATAL_FAILURE(group.PublishAll(1));
  ASSERT_NO_FATAL_FAILURE(group.PublishAll(2));
  {
    const std::vector<tools::OwnedTensor> model = Step(3);
    const absl::Status s =
        group.rank(0).Publish(3, group.Views(model, 0), {}, absl::Milliseconds(300));
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("rank 1 of the group of 2 did not publish its part"));
  }
  EXPECT_EQ(testing::ReadFileOrDie(dir_ / "channel/LATEST"), "2\n");
  ASSERT_NO_FATAL_FAILURE(group.PublishAll(4));
  const std::vector<nlohmann::json> records = Records(dir_, 4, kWorld);
  ASSERT_EQ(records.size(), static_cast<size_t>(kWorld));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(records[r].value("kind", ""), "delta") << records[r].dump();
    EXPECT_EQ(records[r].value("base", uint64_t{0}), 2u) << records[r].dump();
  }
  auto sub = Subscriber::Open(uri_);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto u = (*sub)->ReceiveVersion(4, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_NO_FATAL_FAILURE(ExpectWhole(**u, 4));
  EXPECT_THAT((*u)->stats().encoding, HasSubstr("rank 0: keyframe 1 + 2 deltas up to 4"));
}

// Rank 1's delta of version 2 damaged at rest (after its publisher checked it as a base): a late
// joiner cannot replay rank 1's chain to version 3 (DataLoss naming rank 1) and leaves a
// keyframe request; at version 4 every rank keyframes (the request names a version of every
// rank's chain), the joiner receives it, and the request is removed once every rank has
// answered it.
TEST_F(DeltaGroupThreadsTest, AKeyframeRequestIsAnsweredByEveryRank) {
  ThreadGroup group(uri_, kWorld);
  for (uint64_t v = 1; v <= 3; ++v) ASSERT_NO_FATAL_FAILURE(group.PublishAll(v));
  // The last byte of rank 1's blob of version 2 (its file's data ends the file).
  std::string blob;
  for (const auto& e :
       std::filesystem::directory_iterator(testing::DiskVersionDir(dir_, 2) + "/rank-00001")) {
    if (e.path().extension() == ".safetensors") blob = e.path();
  }
  ASSERT_FALSE(blob.empty());
  {
    std::string bytes = testing::ReadFileOrDie(blob);
    bytes.back() ^= 0x5a;
    testing::WriteFileOrDie(blob, bytes);
  }
  auto sub = Subscriber::Open(uri_);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto broken = (*sub)->ReceiveVersion(3, kTimeout);
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kDataLoss) << broken.status();
  EXPECT_THAT(std::string(broken.status().message()), HasSubstr("(rank 1)"));
  EXPECT_FALSE(std::filesystem::is_empty(dir_ / "channel/delta-requests"));

  ASSERT_NO_FATAL_FAILURE(group.PublishAll(4));
  const std::vector<nlohmann::json> records = Records(dir_, 4, kWorld);
  ASSERT_EQ(records.size(), static_cast<size_t>(kWorld));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(records[r].value("kind", ""), "keyframe") << records[r].dump();
    EXPECT_THAT(records[r].value("reason", ""), HasSubstr("asked for a keyframe"));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir_ / "channel/delta-requests"));
  auto u = (*sub)->ReceiveVersion(4, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_NO_FATAL_FAILURE(ExpectWhole(**u, 4));
}

}  // namespace
}  // namespace weightbus

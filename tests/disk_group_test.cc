// SPDX-License-Identifier: Apache-2.0
// Publisher groups on disk:// (docs/FORMAT.md, "Publisher groups"): world_size 2 and 4 ranks as
// separate processes publishing FSDP2-style row shards and Megatron-style column slices of the
// stories260K fixture plus replicated norms, the subscriber's assembled tensors bit-exact
// against the checkpoint; a rank SIGKILLed mid-publish (the version never visible, the
// survivors' DeadlineExceeded naming it, the restarted rank and the survivors publishing the
// next one); and, in one process with a thread per rank, the cross-rank checks with their codes.
#include <sys/stat.h>

#include <filesystem>
#include <functional>
#include <set>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_format.h"
#include "group_ranks.h"
#include "llama_groups.h"
#include "stories260k.h"
#include "test_support.h"
#include "weightbus/llama2c.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::testing::HasSubstr;
using ::weightbus::testing::Child;
using ::weightbus::testing::ExitCode;
using ::weightbus::testing::ScratchDir;
using ::weightbus::testing::StartRanks;
using ::weightbus::testing::WaitAll;

constexpr absl::Duration kTimeout = absl::Seconds(60);

std::string ChannelUri(const ScratchDir& dir) { return "disk://" + dir.path() + "/channel"; }
bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

using ::weightbus::testing::llama_groups::ExpectWholeModel;
using ::weightbus::testing::llama_groups::Model;

// Starts the ranks publishing version 1 with rank `victim` held at pause point `point`, then
// SIGKILLs the victim there (its Child is reaped); the others go on.
std::vector<Child> StartAndKillAt(const ScratchDir& dir, const std::string& uri, int world,
                                  const std::string& layout, int victim, const std::string& point,
                                  double timeout_s = 60) {
  testing::PausePoint paused(point);
  std::vector<Child> ranks =
      StartRanks(dir, uri, world, layout, 1, 1, "first", {{victim, paused.Spec()}}, timeout_s);
  EXPECT_EQ(ranks.size(), static_cast<size_t>(world));
  EXPECT_TRUE(paused.WaitReached(kTimeout))
      << testing::ReadFileOrDie(dir / absl::StrFormat("first%d.log", victim));
  EXPECT_EQ(paused.ReachedBy(), ranks[victim].pid());
  ranks[victim].Kill(SIGKILL);
  EXPECT_TRUE(ranks[victim].Wait(kTimeout).ok());
  return ranks;
}

// Every rank of a group of `world` publishes `version` (exit 0), which subscribers receive whole.
void ExpectTheGroupPublishes(const ScratchDir& dir, const std::string& uri, int world,
                             uint64_t version) {
  std::vector<Child> again = StartRanks(dir, uri, world, "rows", version, 1, "second");
  const std::vector<int> again_codes = WaitAll(again);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(again_codes[r], 0) << testing::ReadFileOrDie(dir /
                                                           absl::StrFormat("second%d.log", r));
  }
  ExpectWholeModel(uri, version, world);
}

struct GroupCase {
  int world;
  std::string layout;
  friend void PrintTo(const GroupCase& c, std::ostream* os) {
    *os << c.layout << " world_size " << c.world;
  }
};

class GroupProcessTest : public ::testing::TestWithParam<GroupCase> {};

TEST_P(GroupProcessTest, RanksPublishTheirSlicesAndSubscribersReceiveTheWholeModel) {
  const auto [world, layout] = GetParam();
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  std::vector<Child> ranks = StartRanks(dir, uri, world, layout, 1, 2, "rank");
  const std::vector<int> codes = WaitAll(ranks);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(codes[r], 0) << testing::ReadFileOrDie(dir / absl::StrFormat("rank%d.log", r));
  }
  ExpectWholeModel(uri, 2, world);
  ExpectWholeModel(uri, 2, world, "direct");
  ExpectWholeModel(uri, 2, world, "staged");

  // The committed version: one directory per rank, each holding only its own parts, and a
  // manifest naming the owner of every part.
  const std::string v2 = testing::DiskVersionDir(dir, 2);  // dir/channel/versions/v...2
  auto manifest = Manifest::FromJson(testing::ReadFileOrDie(v2 + "/weightbus.manifest.json"), v2);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_TRUE(manifest->group);
  std::vector<int> parts_of(world, 0);
  for (const TensorInfo& t : manifest->tensors) {
    ASSERT_GE(t.owner, 0);
    ASSERT_LT(t.owner, world);
    ++parts_of[t.owner];
    const Manifest part =
        *Manifest::FromJson(testing::ReadFileOrDie(absl::StrFormat(
                                "%s/rank-%05d/weightbus.manifest.json", v2, t.owner)),
                            "part");
    EXPECT_NE(part.Find(t.name), nullptr) << t.name << " of rank " << t.owner;
  }
  for (int r = 0; r < world; ++r) {
    EXPECT_GT(parts_of[r], 0) << "rank " << r;
    // shard_size=100KiB: each rank's part spans several files with an index.
    EXPECT_TRUE(Exists(absl::StrFormat("%s/rank-%05d/model.safetensors.index.json", v2, r)));
  }
  EXPECT_THAT(testing::ReadFileOrDie(v2 + "/weightbus.manifest.json"),
              HasSubstr("\"weightbus.manifest/2\""));
  // Nothing left of the group's staging (version 1 was retired into its own directory).
  for (const auto& e : std::filesystem::directory_iterator(dir / "channel/versions")) {
    EXPECT_FALSE(e.path().filename().string().starts_with(".")) << e.path();
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, GroupProcessTest,
                         ::testing::Values(GroupCase{2, "rows"}, GroupCase{4, "rows"},
                                           GroupCase{2, "cols"}, GroupCase{4, "cols"}),
                         [](const auto& info) {
                           return absl::StrFormat("%s_world%d", info.param.layout,
                                                  info.param.world);
                         });

TEST(GroupProcessTest, RankKilledMidPublishLeavesNothingAndTheNextVersionCommits) {
  constexpr int kWorld = 4, kVictim = 2;
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  // The victim stops after its first data file is durable, before its part is placed.
  std::vector<Child> ranks =
      StartAndKillAt(dir, uri, kWorld, "rows", kVictim, "disk.after_file", /*timeout_s=*/8);
  const std::vector<int> codes = WaitAll(ranks);
  for (int r = 0; r < kWorld; ++r) {
    const std::string log = testing::ReadFileOrDie(dir / absl::StrFormat("first%d.log", r));
    if (r == kVictim) continue;
    EXPECT_EQ(codes[r], 1) << log;
    EXPECT_THAT(log, HasSubstr("DEADLINE_EXCEEDED")) << log;
    EXPECT_THAT(log, HasSubstr("version 1 was not committed: rank 2 of the group of 4 did not "
                               "publish its part by the deadline"))
        << log;
  }
  // Never visible: no LATEST, nothing to receive.
  EXPECT_FALSE(Exists(dir / "channel/LATEST"));
  {
    auto sub = Subscriber::Open(uri);
    ASSERT_TRUE(sub.ok());
    auto none = (*sub)->Poll(1, kTimeout);
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_EQ(*none, nullptr);
  }
  // The restarted rank and the survivors publish the next version, which subscribers receive;
  // version 1's partial parts are gone once version 2 is committed.
  ExpectTheGroupPublishes(dir, uri, kWorld, 2);
  EXPECT_FALSE(Exists(dir / "channel/versions/.group-v00000000000000000001"));
  EXPECT_FALSE(Exists(testing::DiskVersionDir(dir, 1)));
}

TEST(GroupProcessTest, RestartedRankRepublishesTheSameVersionWhileTheOthersWait) {
  constexpr int kWorld = 2, kVictim = 1;
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  std::vector<Child> ranks = StartAndKillAt(dir, uri, kWorld, "cols", kVictim, "disk.after_file");
  // The survivor is still waiting; the restarted rank removes what its predecessor left and
  // publishes the same version, which completes the set.
  std::vector<Child> restarted =
      StartRanks(dir, uri, kWorld, "cols", 1, 1, "restarted", {}, 60, /*only=*/kVictim);
  ASSERT_EQ(WaitAll(restarted), std::vector<int>{0})
      << testing::ReadFileOrDie(dir / absl::StrFormat("restarted%d.log", kVictim));
  absl::StatusOr<int> survivor = ranks[0].Wait(kTimeout);
  ASSERT_TRUE(survivor.ok());
  EXPECT_EQ(ExitCode(*survivor), 0) << testing::ReadFileOrDie(dir / "first0.log");
  ExpectWholeModel(uri, 1, kWorld);
  for (const auto& e : std::filesystem::directory_iterator(testing::DiskVersionDir(dir, 1))) {
    EXPECT_FALSE(e.path().filename().string().starts_with(".tmp-")) << e.path();
  }
}

TEST(GroupProcessTest, ARankKilledAfterItsPartIsPlacedStillCountsAndMayRetry) {
  constexpr int kWorld = 2, kVictim = 0;
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  // The victim's part is durable and placed: the other rank completes the set and commits.
  std::vector<Child> ranks = StartAndKillAt(dir, uri, kWorld, "rows", kVictim, "disk.after_part");
  absl::StatusOr<int> other = ranks[1].Wait(kTimeout);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(ExitCode(*other), 0) << testing::ReadFileOrDie(dir / "first1.log");
  ExpectWholeModel(uri, 1, kWorld);
  // The restarted rank retries the version it was publishing: the same bytes, so a success
  // that writes nothing.
  std::vector<Child> retry =
      StartRanks(dir, uri, kWorld, "rows", 1, 1, "retry", {}, 60, /*only=*/kVictim);
  EXPECT_EQ(WaitAll(retry), std::vector<int>{0}) << testing::ReadFileOrDie(dir / "retry0.log");
}

// The rank that completes the set commits (group manifest written and fsynced, then the rename
// and LATEST); killed there, between the group manifest and the rename, another rank commits
// version 1 in its place: every survivor's Publish returns OK, subscribers receive the whole
// model, and the group (the dead rank restarted) publishes version 2 (issue 17: a group rank
// dying mid-commit).
TEST(GroupProcessTest, TheCommittingRankKilledMidCommitIsReplacedByAnotherRank) {
  constexpr int kWorld = 4;
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  testing::PausePoint commit("disk.before_group_rename");
  // Every rank could be the one to complete the set: each gets the point, one reaches it.
  std::map<int, std::string> failpoints;
  for (int r = 0; r < kWorld; ++r) failpoints[r] = commit.Spec();
  std::vector<Child> ranks =
      StartRanks(dir, uri, kWorld, "rows", 1, 1, "first", failpoints, /*timeout_s=*/8);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(kWorld));
  ASSERT_TRUE(commit.WaitReached(kTimeout)) << testing::ReadFileOrDie(dir / "first0.log");
  int committer = -1;
  for (int r = 0; r < kWorld; ++r) {
    if (ranks[r].pid() == commit.ReachedBy()) committer = r;
  }
  ASSERT_GE(committer, 0) << "pid " << commit.ReachedBy() << " is none of the ranks";
  EXPECT_TRUE(Exists(dir / "channel/versions/.group-v00000000000000000001/weightbus.manifest.json"))
      << "held after the group manifest was written";
  ranks[committer].Kill(SIGKILL);
  ASSERT_TRUE(ranks[committer].Wait(kTimeout).ok());
  // Whichever rank looks at the set next finds it complete and commits it in the dead one's
  // place (the point, released, no longer holds it).
  commit.Release();
  const std::vector<int> codes = WaitAll(ranks);
  for (int r = 0; r < kWorld; ++r) {
    const std::string log = testing::ReadFileOrDie(dir / absl::StrFormat("first%d.log", r));
    EXPECT_EQ(codes[r], r == committer ? 128 + SIGKILL : 0) << "rank " << r << ": " << log;
  }
  ExpectWholeModel(uri, 1, kWorld);
  EXPECT_FALSE(Exists(dir / "channel/versions/.group-v00000000000000000001"));
  ExpectTheGroupPublishes(dir, uri, kWorld, 2);
}

// ---- cross-rank checks, one thread per rank ----------------------------------------------

struct Rank {
  std::unique_ptr<Publisher> publisher;
  std::vector<std::vector<float>> storage;
  std::vector<TensorView> views;
  absl::Status status;
};

std::unique_ptr<Publisher> OpenRank(const std::string& uri, int rank, int world) {
  auto p = Publisher::Open(uri, {{"rank", std::to_string(rank)},
                                 {"world_size", std::to_string(world)},
                                 {"poll_interval", "2ms"}});
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}

// A row slice [begin, begin + rows) of a [8, 4] F32 tensor "w" whose element k is k (+ `bias`).
TensorView RowSlice(Rank& rank, int64_t begin, int64_t rows, float bias = 0,
                    DType dtype = DType::kF32, int64_t global_rows = 8) {
  rank.storage.emplace_back(rows * 4);
  for (int64_t k = 0; k < rows * 4; ++k) rank.storage.back()[k] = begin * 4 + k + bias;
  return TensorView{"w",
                    dtype,
                    {rows, 4},
                    {},
                    rank.storage.back().data(),
                    Device{},
                    Shard{{global_rows, 4}, {begin, 0}}};
}

// Rank 0 publishes rows [0, 4) of "w", rank 1 rows [4, 8): a dim-0 split in two.
void SplitInHalves(std::vector<Rank>& ranks) {
  for (Rank& r : ranks) r.storage.clear();
  ranks[0].views = {RowSlice(ranks[0], 0, 4)};
  ranks[1].views = {RowSlice(ranks[1], 4, 4)};
}

// `u` holds "w" whole, element k equal to k.
void ExpectWholeW(const Update& u) {
  ASSERT_EQ(u.tensors().size(), 1u);
  EXPECT_EQ(u.tensors()[0].shape, (std::vector<int64_t>{8, 4}));
  const float* w = static_cast<const float*>(u.tensors()[0].data);
  for (int k = 0; k < 32; ++k) ASSERT_EQ(w[k], static_cast<float>(k)) << k;
}

// Publishes `version` from every rank at once; fills each rank's status.
void PublishAll(std::vector<Rank>& ranks, uint64_t version,
                absl::Duration timeout = absl::Seconds(30)) {
  std::vector<std::thread> threads;
  for (Rank& r : ranks) {
    threads.emplace_back(
        [&r, version, timeout] { r.status = r.publisher->Publish(version, r.views, {}, timeout); });
  }
  for (std::thread& t : threads) t.join();
}

// Publishes `version` from every rank, expects every rank to succeed and returns the version as
// a subscriber receives it (nullptr, with the failures reported, otherwise).
std::unique_ptr<Update> PublishAllAndReceive(std::vector<Rank>& ranks, const std::string& uri,
                                             uint64_t version) {
  PublishAll(ranks, version);
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_TRUE(ranks[r].status.ok()) << "rank " << r << ": " << ranks[r].status;
  }
  auto sub = Subscriber::Open(uri);
  EXPECT_TRUE(sub.ok()) << sub.status();
  if (!sub.ok()) return nullptr;
  auto u = (*sub)->ReceiveVersion(version, kTimeout);
  EXPECT_TRUE(u.ok()) << u.status();
  return u.ok() ? *std::move(u) : nullptr;
}

std::vector<Rank> Group(const std::string& uri, int world) {
  std::vector<Rank> ranks(world);
  for (int r = 0; r < world; ++r) ranks[r].publisher = OpenRank(uri, r, world);
  return ranks;
}

// Every rank's status has `code` and names `what`; nothing was committed.
void ExpectRefused(const std::vector<Rank>& ranks, const std::string& uri, absl::StatusCode code,
                   const std::vector<std::string>& what) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_EQ(ranks[r].status.code(), code) << "rank " << r << ": " << ranks[r].status;
    for (const std::string& w : what) {
      EXPECT_THAT(std::string(ranks[r].status.message()), HasSubstr(w)) << "rank " << r;
    }
  }
  auto sub = Subscriber::Open(uri);
  ASSERT_TRUE(sub.ok());
  auto none = (*sub)->Poll(0, kTimeout);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);
}

// Two ranks' row slices of "w" [8, 4] that do not fit together, and what the refusal names.
struct Misfit {
  friend void PrintTo(const Misfit& m, std::ostream* os) { *os << m.name; }
  std::string name;
  int64_t begin0, rows0, begin1, rows1;
  DType dtype1 = DType::kF32;
  int64_t global_rows1 = 8;
  float bias1 = 0;
  std::vector<std::string> named;
};

class MisfitTest : public ::testing::TestWithParam<Misfit> {};

TEST_P(MisfitTest, IsRefusedForEveryRankAndACorrectedRetryCommits) {
  const Misfit& c = GetParam();
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  std::vector<Rank> ranks = Group(uri, 2);
  ranks[0].views = {RowSlice(ranks[0], c.begin0, c.rows0)};
  ranks[1].views = {RowSlice(ranks[1], c.begin1, c.rows1, c.bias1, c.dtype1, c.global_rows1)};
  PublishAll(ranks, 1);
  ExpectRefused(ranks, uri, absl::StatusCode::kInvalidArgument, c.named);
  // Both ranks publish the version again, fitting together this time.
  SplitInHalves(ranks);
  std::unique_ptr<Update> u = PublishAllAndReceive(ranks, uri, 1);
  ASSERT_NE(u, nullptr);
  ExpectWholeW(*u);
}

INSTANTIATE_TEST_SUITE_P(
    GroupChecksTest, MisfitTest,
    ::testing::Values(Misfit{"dtype",
                             0,
                             4,
                             4,
                             4,
                             DType::kI32,
                             8,
                             0,
                             {"version 1", "tensor \"w\"",
                              "rank 0 publishes F32 of global shape [8, 4]",
                              "rank 1 I32 of global shape [8, 4]"}},
                      Misfit{"global_shape",
                             0,
                             4,
                             4,
                             4,
                             DType::kF32,
                             9,
                             0,
                             {"tensor \"w\"", "rank 0 publishes F32 of global shape [8, 4]",
                              "rank 1 F32 of global shape [9, 4]"}},
                      Misfit{"overlap",
                             0,
                             5,
                             4,
                             4,
                             DType::kF32,
                             8,
                             0,
                             {"tensor \"w\"", "rank 0 ([5, 4] at [0, 0])",
                              "rank 1 ([4, 4] at [4, 0])", "overlap"}},
                      Misfit{"replicas_differ",
                             0,
                             8,
                             0,
                             8,
                             DType::kF32,
                             8,
                             1,
                             {"tensor \"w\"", "rank 0 ([8, 4] at [0, 0])",
                              "rank 1 ([8, 4] at [0, 0])", "different bytes"}},
                      Misfit{"gap",
                             0,
                             3,
                             4,
                             4,
                             DType::kF32,
                             8,
                             0,
                             {"tensor \"w\" of global shape [8, 4]", "cover 28 of its 32 elements",
                              "rank 0 ([3, 4] at [0, 0])", "rank 1 ([4, 4] at [4, 0])"}}),
    [](const auto& info) { return info.param.name; });

TEST(GroupChecksTest, ReplicasWithTheSameBytesAreReadOnce) {
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  std::vector<Rank> ranks = Group(uri, 2);
  ranks[0].views = {RowSlice(ranks[0], 0, 8)};
  ranks[1].views = {RowSlice(ranks[1], 0, 8)};
  std::unique_ptr<Update> u = PublishAllAndReceive(ranks, uri, 1);
  ASSERT_NE(u, nullptr);
  EXPECT_EQ(u->manifest().tensors.size(), 2u);  // both replicas listed
  EXPECT_EQ(u->manifest().tensors[1].owner, 1);
  EXPECT_EQ(u->stats().bytes, 8u * 4 * 4);  // one read
  ExpectWholeW(*u);
}

TEST(GroupChecksTest, ACorruptPartIsDataLossNamingTheTensorAndTheOwnersFile) {
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  std::vector<Rank> ranks = Group(uri, 2);
  SplitInHalves(ranks);
  ASSERT_NE(PublishAllAndReceive(ranks, uri, 1), nullptr);
  // Flip a bit of the last byte of rank 1's file: the last element of its slice of "w".
  const std::string file = testing::DiskVersionDir(dir, 1) + "/rank-00001/model.safetensors";
  std::string bytes = testing::ReadFileOrDie(file);
  bytes.back() ^= 1;
  testing::WriteFileOrDie(file, bytes);
  auto sub = Subscriber::Open(uri);
  ASSERT_TRUE(sub.ok());
  auto u = (*sub)->ReceiveVersion(1, kTimeout);
  EXPECT_EQ(u.status().code(), absl::StatusCode::kDataLoss) << u.status();
  EXPECT_THAT(std::string(u.status().message()),
              HasSubstr("tensor \"w\" from file " + file + " bytes"));
}

TEST(GroupChecksTest, ARankTimingOutWithdrawsItsPartSoALateRankCannotCommit) {
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  std::vector<Rank> ranks = Group(uri, 2);
  SplitInHalves(ranks);
  // The deadline covers this rank's own write and fsync as well as its wait for rank 1: long
  // enough that a loaded machine still places the part before it ends (50 ms did not).
  constexpr absl::Duration kGroupDeadline = absl::Seconds(2);
  absl::Status first = ranks[0].publisher->Publish(1, ranks[0].views, {}, kGroupDeadline);
  EXPECT_EQ(first.code(), absl::StatusCode::kDeadlineExceeded) << first;
  EXPECT_THAT(std::string(first.message()),
              HasSubstr("version 1 was not committed: rank 1 of the group of 2 did not publish "
                        "its part by the deadline; this rank's (0) part was withdrawn"));
  absl::Status late = ranks[1].publisher->Publish(1, ranks[1].views, {}, kGroupDeadline);
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_THAT(std::string(late.message()), HasSubstr("rank 0 of the group of 2"));
  EXPECT_FALSE(Exists(dir / "channel/LATEST"));
  PublishAll(ranks, 2);
  EXPECT_TRUE(ranks[0].status.ok()) << ranks[0].status;
  EXPECT_TRUE(ranks[1].status.ok()) << ranks[1].status;
  EXPECT_EQ(testing::ReadFileOrDie(dir / "channel/LATEST"), "2\n");
}

TEST(GroupChecksTest, CancelEndsARankWaitingForItsGroupAndWithdrawsItsPart) {
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  testing::PausePoint placed("disk.after_part");
  placed.Release();  // only announces that the part is placed
  Rank rank;
  {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", placed.Spec());
    rank.publisher = OpenRank(uri, 0, 2);
  }
  ASSERT_NE(rank.publisher, nullptr);
  rank.views = {RowSlice(rank, 0, 4)};
  std::thread publishing(
      [&] { rank.status = rank.publisher->Publish(1, rank.views, {}, kTimeout); });
  ASSERT_TRUE(placed.WaitReached(kTimeout));
  rank.publisher->Cancel();
  publishing.join();
  EXPECT_EQ(rank.status.code(), absl::StatusCode::kCancelled) << rank.status;
  EXPECT_THAT(std::string(rank.status.message()), HasSubstr("rank 1 of the group of 2"));
  const std::string group = dir / "channel/versions/.group-v00000000000000000001";
  EXPECT_FALSE(Exists(group + "/rank-00000"));
  EXPECT_TRUE(Exists(group + "/rank-00000.withdrawn"));
}

TEST(GroupChecksTest, RanksDisagreeingOnWorldSizeAreFailedPrecondition) {
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  std::vector<Rank> ranks(2);
  ranks[0].publisher = OpenRank(uri, 0, 2);
  ranks[1].publisher = OpenRank(uri, 3, 4);
  SplitInHalves(ranks);
  PublishAll(ranks, 1, absl::Seconds(2));
  EXPECT_EQ(ranks[0].status.code(), absl::StatusCode::kFailedPrecondition) << ranks[0].status;
  EXPECT_THAT(std::string(ranks[0].status.message()),
              HasSubstr("a part of rank 3, but this group has world_size 2"));
}

TEST(GroupChecksTest, ASinglePublisherAndAGroupRankExcludeEachOther) {
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  {
    auto rank = OpenRank(uri, 0, 2);
    ASSERT_NE(rank, nullptr);
    auto single = Publisher::Open(uri);
    EXPECT_EQ(single.status().code(), absl::StatusCode::kFailedPrecondition) << single.status();
    auto same_rank = Publisher::Open(uri, {{"rank", "0"}, {"world_size", "2"}});
    EXPECT_EQ(same_rank.status().code(), absl::StatusCode::kFailedPrecondition)
        << same_rank.status();
    EXPECT_THAT(std::string(same_rank.status().message()), HasSubstr("rank 0 of its group"));
    auto other_rank = Publisher::Open(uri, {{"rank", "1"}, {"world_size", "2"}});
    EXPECT_TRUE(other_rank.ok()) << other_rank.status();
  }
  auto single = Publisher::Open(uri);
  ASSERT_TRUE(single.ok()) << single.status();
  auto rank = Publisher::Open(uri, {{"rank", "1"}, {"world_size", "2"}});
  EXPECT_EQ(rank.status().code(), absl::StatusCode::kFailedPrecondition) << rank.status();
}

// The delta layer carries a group over disk:// (delta_group_test); over a transport without
// groups (ucx:// until it has them, or without committed group manifests to read back) a rank
// is refused before anything is published, naming the publisher group.
TEST(GroupChecksTest, TheDeltaLayerTakesAGroupOverDiskAndRefusesOneElsewhere) {
  if (const std::string why = testing::MissingTransports({"delta"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ScratchDir dir;
  auto p = Publisher::Open("delta+" + ChannelUri(dir) + "?rank=0&world_size=2");
  EXPECT_TRUE(p.ok()) << p.status();
  if (!testing::MissingTransports({"ucx"}).empty()) return;
  auto u = Publisher::Open("delta+ucx://127.0.0.1:1/channel?rank=1&world_size=2");
  EXPECT_EQ(u.status().code(), absl::StatusCode::kUnimplemented) << u.status();
  EXPECT_THAT(std::string(u.status().message()), HasSubstr("world_size=2 asks"));
  EXPECT_THAT(std::string(u.status().message()), HasSubstr("publisher group (rank 1)"));
}

// -- A publisher group on a channel with a shared secret (docs/SECURITY.md, "Publisher groups") --

constexpr char kSecret[] = "the group's channel secret, 38 bytes\n";

class GroupSecretTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const auto& [path, secret] :
         {std::pair{key_, std::string(kSecret)},
          std::pair{other_key_, std::string("not the group's secret")}}) {
      testing::WriteFileOrDie(path, secret);
      ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
    }
  }
  // Every rank of the group with the channel's secret.
  std::map<int, std::string> AllWithKey(int world) const {
    std::map<int, std::string> out;
    for (int r = 0; r < world; ++r) out[r] = "secret_file=" + key_;
    return out;
  }
  Options WithKey() const { return {{"secret_file", key_}}; }
  std::string Log(const std::string& name) const { return testing::ReadFileOrDie(dir_ / name); }
  // Every rank of a group of `world` publishes `version` with `layout` (exit 0).
  void PublishAll(int world, const std::string& layout, uint64_t version, uint64_t versions = 1) {
    const std::string tag = absl::StrFormat("v%d-", version);
    std::vector<Child> ranks = StartRanks(dir_, uri_, world, layout, version, versions, tag, {}, 60,
                                          -1, {}, AllWithKey(world));
    const std::vector<int> codes = WaitAll(ranks);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(codes[r], 0) << Log(absl::StrFormat("%s%d.log", tag, r));
    }
  }
  // A TP worker's view (rank `r` of 2) of `version`: q_proj split by rows, read by byte ranges
  // (the resharded, partial-read path), everything else whole; bit-exact against the fixture.
  absl::Status ReceiveResharded(uint64_t version, int r, const Options& options) {
    auto sub = Subscriber::Open(
        uri_, options, SubscribePlacements{{{"*.q_proj.weight", Placement::Shard(0)}}, {2, r}, {}});
    if (!sub.ok()) return sub.status();
    auto u = (*sub)->ReceiveVersion(version, kTimeout);
    if (!u.ok()) return u.status();
    for (const tools::OwnedTensor& t : Model()) {
      const TensorView* v = (*u)->Find(t.name);
      EXPECT_NE(v, nullptr) << t.name;
      if (v == nullptr) continue;
      const bool split = t.name.ends_with(".q_proj.weight");
      const size_t n = split ? t.bytes.size() / 2 : t.bytes.size();
      EXPECT_EQ(std::memcmp(v->data, t.bytes.data() + (split ? n * r : 0), n), 0) << t.name;
    }
    return absl::OkStatus();
  }

  ScratchDir dir_;
  const std::string uri_ = ChannelUri(dir_);
  const std::string key_ = dir_ / "key";
  const std::string other_key_ = dir_ / "other_key";
};

// Each rank's part carries its own MAC, the committed group manifest the group's; subscribers
// with the secret receive the whole model and their TP slices bit-exact; one without it is
// told to configure it.
TEST_F(GroupSecretTest, AGroupWithASecretPublishesAndSubscribersReceiveBitExact) {
  for (const auto& [world, layout] : {std::pair{2, "rows"}, std::pair{4, "cols"}}) {
    SCOPED_TRACE(absl::StrFormat("world_size %d, %s", world, layout));
    const uint64_t version = world == 2 ? 1 : 2;
    if (world == 4) {  // a group of another size: its own channel
      std::filesystem::remove_all(dir_ / "channel");
    }
    ASSERT_NO_FATAL_FAILURE(PublishAll(world, layout, version));
    ExpectWholeModel(uri_, version, world, "", WithKey());
    ExpectWholeModel(uri_, version, world, "direct", WithKey());
    for (int r = 0; r < 2; ++r) EXPECT_TRUE(ReceiveResharded(version, r, WithKey()).ok());

    const std::string vdir = testing::DiskVersionDir(dir_, version);
    auto committed =
        Manifest::FromJson(testing::ReadFileOrDie(vdir + "/weightbus.manifest.json"), vdir);
    ASSERT_TRUE(committed.ok()) << committed.status();
    ASSERT_TRUE(committed->group);
    ASSERT_EQ(committed->metadata.count("weightbus.mac"), 1u);
    std::set<std::string> macs = {committed->metadata.at("weightbus.mac")};
    for (int r = 0; r < world; ++r) {
      const std::string path = absl::StrFormat("%s/rank-%05d/weightbus.manifest.json", vdir, r);
      auto part = Manifest::FromJson(testing::ReadFileOrDie(path), path);
      ASSERT_TRUE(part.ok()) << part.status();
      ASSERT_EQ(part->metadata.count("weightbus.mac"), 1u) << path;
      macs.insert(part->metadata.at("weightbus.mac"));
    }
    EXPECT_EQ(macs.size(), static_cast<size_t>(world) + 1);  // each its own

    auto stranger = Subscriber::Open(uri_);
    ASSERT_TRUE(stranger.ok()) << stranger.status();
    auto refused = (*stranger)->ReceiveVersion(version, kTimeout);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()),
                HasSubstr("is authenticated with a shared secret this subscriber does not have"));
  }
}

// The committed group manifest edited by someone who can write the directory but lacks the
// key (another owner for a part, or other metadata) is refused by whole and resharded
// subscribers with the single publisher's error, and they keep their version; restored, it is
// accepted.
TEST_F(GroupSecretTest, ATamperedGroupManifestIsRefusedAndTheSubscriberKeepsItsVersion) {
  constexpr int kWorld = 2;
  ASSERT_NO_FATAL_FAILURE(PublishAll(kWorld, "rows", 1, 2));
  auto sub = Subscriber::Open(uri_, WithKey());
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto u1 = (*sub)->ReceiveVersion(1, kTimeout);
  ASSERT_TRUE(u1.ok()) << u1.status();

  const std::string path = testing::DiskVersionDir(dir_, 2) + "/weightbus.manifest.json";
  const std::string original = testing::ReadFileOrDie(path);
  auto m = Manifest::FromJson(original, path);
  ASSERT_TRUE(m.ok()) << m.status();
  // Two parts of one tensor (rank 0's rows and rank 1's): swapping their owners or their
  // offsets keeps the manifest well-formed, so only the MAC can tell.
  size_t a = m->tensors.size(), b = a;
  for (size_t i = 0; i < m->tensors.size() && b == m->tensors.size(); ++i) {
    for (size_t k = i + 1; k < m->tensors.size(); ++k) {
      if (m->tensors[i].shard && m->tensors[k].name == m->tensors[i].name &&
          m->tensors[k].owner != m->tensors[i].owner) {
        a = i, b = k;
        break;
      }
    }
  }
  ASSERT_LT(b, m->tensors.size());
  const std::vector<std::pair<std::string, std::function<void(Manifest&)>>> edits = {
      {"metadata", [](Manifest& e) { e.metadata["step"] = "999"; }},
      {"the owners of two parts",
       [&](Manifest& e) { std::swap(e.tensors[a].owner, e.tensors[b].owner); }},
      {"the shards of two parts",
       [&](Manifest& e) { std::swap(e.tensors[a].shard, e.tensors[b].shard); }},
      {"a block checksum",
       [&](Manifest& e) {
         ASSERT_FALSE(e.tensors[a].block_xxh3.empty());
         e.tensors[a].block_xxh3[0] ^= 1;
       }},
  };
  for (const auto& [what, edit] : edits) {
    SCOPED_TRACE(what);
    Manifest tampered = *m;
    edit(tampered);
    ASSERT_NE(tampered, *m);
    testing::WriteFileOrDie(path, tampered.ToJson());
    auto u2 = (*sub)->ReceiveVersion(2, kTimeout);
    ASSERT_EQ(u2.status().code(), absl::StatusCode::kPermissionDenied) << u2.status();
    EXPECT_THAT(std::string(u2.status().message()),
                HasSubstr(uri_ + ": version 2 (publisher session "));
    EXPECT_THAT(std::string(u2.status().message()),
                HasSubstr("has a wrong MAC: it was not published with this channel's shared "
                          "secret, or its manifest was altered; refusing it; version 1 stays "
                          "current"));
    EXPECT_EQ((*sub)->current_version(), 1u);
    const absl::Status resharded = ReceiveResharded(2, 1, WithKey());
    EXPECT_EQ(resharded.code(), absl::StatusCode::kPermissionDenied) << resharded;
    EXPECT_THAT(std::string(resharded.message()), HasSubstr("has a wrong MAC"));
  }
  // Without any MAC: unauthenticated.
  Manifest stripped = *m;
  stripped.metadata.erase("weightbus.mac");
  testing::WriteFileOrDie(path, stripped.ToJson());
  auto unauthenticated = (*sub)->ReceiveVersion(2, kTimeout);
  ASSERT_EQ(unauthenticated.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(
      std::string(unauthenticated.status().message()),
      HasSubstr("carries no MAC, but this subscriber requires the channel's shared secret"));
  EXPECT_EQ((*sub)->current_version(), 1u);

  testing::WriteFileOrDie(path, original);
  auto u2 = (*sub)->ReceiveVersion(2, kTimeout);
  ASSERT_TRUE(u2.ok()) << u2.status();
  EXPECT_TRUE(ReceiveResharded(2, 1, WithKey()).ok());
}

// Someone with write access to the channel directory but not the key places rank 1's part of
// version 2 (a rank-1 process without the secret, or with another, stopped by a fail point
// right after placing it, the way a forger would leave it). The real rank 0 completes the set,
// refuses it and commits nothing: every rank of the set gets PermissionDenied naming rank 1,
// subscribers keep version 1, and the real group's next version commits.
TEST_F(GroupSecretTest, AForgedRankPartIsNotCommitted) {
  constexpr int kWorld = 2;
  ASSERT_NO_FATAL_FAILURE(PublishAll(kWorld, "rows", 1));
  auto sub = Subscriber::Open(uri_, WithKey());
  ASSERT_TRUE(sub.ok()) << sub.status();
  ASSERT_TRUE((*sub)->ReceiveVersion(1, kTimeout).ok());

  uint64_t version = 2;
  for (const std::string& forger_setting : {std::string(), "secret_file=" + other_key_}) {
    SCOPED_TRACE(forger_setting.empty() ? "no secret" : "another secret");
    std::map<int, std::string> forger_settings;
    if (!forger_setting.empty()) forger_settings[1] = forger_setting;
    std::vector<Child> forged =
        StartRanks(dir_, uri_, kWorld, "rows", version, 1, absl::StrFormat("forger%d-", version),
                   {{1, "disk.after_part=error"}}, 60, /*only=*/1, {}, forger_settings);
    ASSERT_EQ(WaitAll(forged), std::vector<int>{1});
    ASSERT_TRUE(Exists(
        absl::StrFormat("%s/channel/versions/.group-v%020d/rank-00001", dir_.path(), version)));
    const std::string tag = absl::StrFormat("real%d-", version);
    std::vector<Child> real = StartRanks(dir_, uri_, kWorld, "rows", version, 1, tag, {}, 60,
                                         /*only=*/0, {}, AllWithKey(kWorld));
    ASSERT_EQ(WaitAll(real), std::vector<int>{1});
    const std::string log = Log(tag + "0.log");
    EXPECT_THAT(log, HasSubstr(absl::StrFormat("PERMISSION_DENIED: %s: publish of version %d "
                                               "failed: %s version %d: rank 1's part (publisher "
                                               "session ",
                                               uri_, version, uri_, version)));
    EXPECT_THAT(log, HasSubstr(forger_setting.empty()
                                   ? "carries no MAC, but the channel requires its shared secret: "
                                     "rank 1 publishes without the secret, or its part was forged "
                                     "by someone without the key; the committing rank 0 refuses it"
                                   : "has a wrong MAC under the key of the committing rank 0: "
                                     "ranks 1 and 0 hold different secrets (check secret_file or "
                                     "secret_env on both), or the part was forged or altered"));
    EXPECT_THAT(log, HasSubstr(absl::StrFormat("nothing of version %d was committed", version)));
    // Recorded for every rank of the set: the real rank 1, had it been waiting, gets it too.
    EXPECT_THAT(testing::ReadFileOrDie(absl::StrFormat(
                    "%s/channel/versions/.group-v%020d/rank-00001.failed", dir_.path(), version)),
                HasSubstr("nothing of version"));
    EXPECT_EQ(testing::ReadFileOrDie(dir_ / "channel/LATEST"), "1\n");
    auto none = (*sub)->Poll(2, absl::ZeroDuration());
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_EQ(*none, nullptr);
    EXPECT_EQ((*sub)->current_version(), 1u);
    ++version;
  }
  ASSERT_NO_FATAL_FAILURE(PublishAll(kWorld, "rows", version));
  ExpectWholeModel(uri_, version, kWorld, "", WithKey());
}

// One rank configured with another secret (or none): the set is refused with an error naming
// the odd rank and the committing one, whichever rank commits; nothing becomes visible.
TEST_F(GroupSecretTest, ARankWithAnotherSecretOrNoneIsAClearErrorNamingTheRank) {
  constexpr int kWorld = 2;
  int round = 0;
  for (const std::string& rank1 : {"secret_file=" + other_key_, std::string()}) {
    SCOPED_TRACE(rank1.empty() ? "rank 1 without a secret" : "rank 1 with another secret");
    const std::string tag = absl::StrFormat("mixed%d-", ++round);
    std::filesystem::remove_all(dir_ / "channel");
    std::map<int, std::string> settings = {{0, "secret_file=" + key_}};
    if (!rank1.empty()) settings[1] = rank1;
    std::vector<Child> ranks =
        StartRanks(dir_, uri_, kWorld, "rows", 1, 1, tag, {}, 60, -1, {}, settings);
    EXPECT_EQ(WaitAll(ranks), (std::vector<int>{1, 1}));
    const std::string log0 = Log(tag + "0.log"), log1 = Log(tag + "1.log");
    // Both ranks report the committer's refusal, which names rank 1 and the committing rank.
    ASSERT_NE(log0.find("publish 1:"), std::string::npos) << log0;
    ASSERT_NE(log1.find("publish 1:"), std::string::npos) << log1;
    EXPECT_EQ(log0.substr(log0.find("publish 1:")), log1.substr(log1.find("publish 1:")));
    const std::string prefix =
        absl::StrFormat("%s: publish of version 1 failed: %s version 1: ", uri_, uri_);
    if (rank1.empty()) {
      EXPECT_THAT(
          log0,
          ::testing::AnyOf(
              HasSubstr("PERMISSION_DENIED: " + prefix + "rank 1's part (publisher session"),
              HasSubstr("FAILED_PRECONDITION: " + prefix + "rank 0's part (publisher session")));
      EXPECT_THAT(log0, ::testing::AnyOf(
                            HasSubstr("carries no MAC, but the channel requires its shared "
                                      "secret: rank 1 publishes without the secret"),
                            HasSubstr("is authenticated with a shared secret, but the committing "
                                      "rank 1 has none")));
    } else {
      EXPECT_THAT(log0, HasSubstr("PERMISSION_DENIED: " + prefix + "rank "));
      EXPECT_THAT(log0, ::testing::ContainsRegex(
                            "ranks [01] and [01] hold different secrets \\(check secret_file or "
                            "secret_env on both\\)"));
    }
    EXPECT_FALSE(Exists(dir_ / "channel/LATEST"));
  }
}

}  // namespace
}  // namespace weightbus

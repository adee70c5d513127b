// SPDX-License-Identifier: Apache-2.0
// Publisher groups over ucx:// (lib/transports/ucx/README.md, "Publisher groups"): world_size 2
// and 4 ranks as separate processes (wb_test_peer publish-llama) publishing FSDP2-style row
// shards and Megatron-style column slices of the stories260K fixture plus replicated norms,
// each rank staging and serving its own parts; whole-model subscribers (staged and direct) and
// the ranks of TP groups of 2 and 4 with Llama's placements, bit-exact against the checkpoint,
// each TP rank reading only the published parts its slices meet; and a rank SIGKILLed
// mid-publish (the version never visible, the survivors' DeadlineExceeded naming it, the
// restarted group publishing the next one). Shared memory and tcp (bytes over the control
// connection) both. On a channel with a shared secret (docs/SECURITY.md, "Publisher groups"):
// the group publishes and subscribers with the secret receive it whole and as TP slices; a part
// altered after its rank's MAC (fail point ucx.tamper_part) is refused by rank 0 for every
// rank, nothing committed; a group manifest altered after rank 0's MAC (ucx.tamper_group_manifest)
// is refused by subscribers before any byte, which keep their version; a rank with another
// secret or none cannot join.
#include <signal.h>
#include <sys/stat.h>

#include <filesystem>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "llama_groups.h"
#include "stories260k.h"
#include "test_support.h"
#include "ucx_tls.h"
#include "weightbus/llama2c.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::testing::HasSubstr;
using ::weightbus::testing::Child;
using ::weightbus::testing::ExitCode;
using ::weightbus::testing::FreePort;
using ::weightbus::testing::ScratchDir;
using ::weightbus::testing::Tls;

constexpr absl::Duration kTimeout = absl::Seconds(60);

std::string Peer() { return testing::BinaryPath("tests/wb_test_peer"); }
using namespace ::weightbus::testing::llama_groups;  // NOLINT: the fixture's layouts

// Why UCX cannot run here with this process's UCX environment ("" when it can).
std::string UcxUnusable() {
  auto probe = Subscriber::Open(absl::StrFormat("ucx://127.0.0.1:%d/probe", FreePort()));
  return probe.ok() ? "" : std::string(probe.status().message());
}

// Subscribers wait for ranks that may still be starting.
Options SubscriberOptions() { return {{"connect_timeout", "60s"}}; }

// Starts the ranks of a group publishing the fixture with `layout` (peer_main.cc), versions
// [start, start + versions), then serving them until killed (ucx:// serves from the ranks'
// memory).
// `settings` adds a "name=value" setting per rank (e.g. secret_file=...).
std::vector<Child> StartRanks(const ScratchDir& dir, const std::string& uri, const Tls& tls,
                              int world, const std::string& layout, uint64_t start,
                              uint64_t versions, const std::string& log_tag,
                              const std::map<int, std::string>& failpoints = {},
                              double timeout_s = 60,
                              const std::map<int, std::string>& settings = {}) {
  std::vector<Child> ranks;
  for (int r = 0; r < world; ++r) {
    std::map<std::string, std::string> env = tls.env;
    if (auto it = failpoints.find(r); it != failpoints.end()) {
      env["WEIGHTBUS_FAILPOINTS"] = it->second;
    }
    std::vector<std::string> args = {Peer(),
                                     "publish-llama",
                                     uri,
                                     "--layout",
                                     layout,
                                     "--start",
                                     std::to_string(start),
                                     "--versions",
                                     std::to_string(versions),
                                     "--timeout-s",
                                     absl::StrFormat("%g", timeout_s),
                                     "--serve-ms",
                                     "600000",
                                     "--set",
                                     absl::StrFormat("rank=%d", r),
                                     "--set",
                                     absl::StrFormat("world_size=%d", world),
                                     "--set",
                                     "connect_timeout=60s",
                                     "--set",
                                     "staging_slots=4"};
    if (auto it = settings.find(r); it != settings.end()) {
      args.push_back("--set");
      args.push_back(it->second);
    }
    auto c = Child::Start(args, env, dir / absl::StrFormat("%s%d.log", log_tag, r));
    EXPECT_TRUE(c.ok()) << c.status();
    if (c.ok()) ranks.push_back(*std::move(c));
  }
  return ranks;
}

// Ends ranks that serve until killed, and checks that each published `version`.
void StopRanks(const ScratchDir& dir, std::vector<Child>& ranks, const std::string& log_tag,
               uint64_t version) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    ranks[r].Kill(SIGKILL);
    EXPECT_TRUE(ranks[r].Wait(kTimeout).ok());
    const std::string log = testing::ReadFileOrDie(dir / absl::StrFormat("%s%d.log", log_tag, r));
    EXPECT_THAT(log, HasSubstr(absl::StrFormat("published %d", version))) << log;
  }
}

// ExpectWholeModel (llama_groups.h) with subscribers that wait for ranks still starting.
void ExpectWhole(const std::string& uri, uint64_t version, int world,
                 const std::string& bind_mode = "") {
  ExpectWholeModel(uri, version, world, bind_mode, SubscriberOptions());
}

// Every rank of a TP group of `tp` receives exactly `version`, its slices bit-exact, having read
// only the checksum tiles its slices meet.
void ExpectTpGroup(const std::string& uri, uint64_t version, int world, const std::string& layout,
                   int tp, Options options = SubscriberOptions()) {
  for (int r = 0; r < tp; ++r) {
    auto sub = Subscriber::Open(uri, options, SubscribePlacements{LlamaRules(), {tp, r}, {}});
    ASSERT_TRUE(sub.ok()) << sub.status();
    auto u = (*sub)->ReceiveVersion(version, kTimeout);
    ASSERT_TRUE(u.ok()) << "TP rank " << r << " of " << tp << ": " << u.status();
    ASSERT_EQ((*u)->tensors().size(), Model().size());
    for (const tools::OwnedTensor& t : Model()) {
      const TensorView* v = (*u)->Find(t.name);
      ASSERT_NE(v, nullptr) << t.name;
      const std::vector<std::byte> want = SliceBytes(t, SliceBox(t, r, tp));
      EXPECT_EQ(std::memcmp(v->data, want.data(), want.size()), 0)
          << t.name << " of TP rank " << r << " of " << tp;
    }
    // The checksum tiles its slices meet (llama_groups.h), within the parts they meet.
    EXPECT_EQ((*u)->stats().bytes, TileBytesTouched((*u)->manifest(), {world, layout}, r, tp))
        << "TP rank " << r;
    EXPECT_LE((*u)->stats().bytes, BytesMet({world, layout}, r, tp)) << "TP rank " << r;
  }
}

struct GroupCase {
  Tls tls;
  int world;
  std::string layout;
};

class UcxGroupTest : public ::testing::TestWithParam<GroupCase> {};

TEST_P(UcxGroupTest, RanksServeTheirPartsToWholeAndTensorParallelSubscribers) {
  const auto& [tls, world, layout] = GetParam();
  const testing::ScopedEnvs tls_env(tls.env);
  if (std::string why = UcxUnusable(); !why.empty()) GTEST_SKIP() << "UCX unusable: " << why;
  ScratchDir dir;
  const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/group", FreePort());
  std::vector<Child> ranks = StartRanks(dir, uri, tls, world, layout, 1, 2, "rank");
  ExpectWhole(uri, 2, world);
  ExpectWhole(uri, 2, world, "direct");
  ExpectWhole(uri, 2, world, "staged");
  for (int tp : {2, 4}) ExpectTpGroup(uri, 2, world, layout, tp);
  StopRanks(dir, ranks, "rank", 2);
}

INSTANTIATE_TEST_SUITE_P(Layouts, UcxGroupTest,
                         ::testing::Values(GroupCase{testing::kShm, 2, "rows"},
                                           GroupCase{testing::kShm, 4, "rows"},
                                           GroupCase{testing::kShm, 2, "cols"},
                                           GroupCase{testing::kShm, 4, "cols"},
                                           GroupCase{testing::kTcp, 2, "cols"}),
                         [](const auto& info) {
                           return absl::StrFormat("%s_%s_world%d", info.param.tls.name,
                                                  info.param.layout, info.param.world);
                         });

TEST(UcxGroupKillTest, RankKilledMidPublishLeavesNothingAndTheNextVersionCommits) {
  constexpr int kWorld = 4, kVictim = 2;
  const testing::ScopedEnvs tls_env(testing::kShm.env);
  if (std::string why = UcxUnusable(); !why.empty()) GTEST_SKIP() << "UCX unusable: " << why;
  ScratchDir dir;
  const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/group", FreePort());
  std::vector<Child> ranks;
  {
    // The victim stops with its part staged, before it tells rank 0; killed there.
    testing::PausePoint paused("ucx.after_copy");
    ranks = StartRanks(dir, uri, testing::kShm, kWorld, "rows", 1, 1, "first",
                       {{kVictim, paused.Spec()}}, /*timeout_s=*/8);
    ASSERT_EQ(ranks.size(), static_cast<size_t>(kWorld));
    ASSERT_TRUE(paused.WaitReached(kTimeout))
        << testing::ReadFileOrDie(dir / absl::StrFormat("first%d.log", kVictim));
    EXPECT_EQ(paused.ReachedBy(), ranks[kVictim].pid());
    ranks[kVictim].Kill(SIGKILL);
    EXPECT_TRUE(ranks[kVictim].Wait(kTimeout).ok());
  }
  // Never visible: rank 0 (alive until its deadline, or not up yet) grants nothing.
  {
    auto sub = Subscriber::Open(uri);
    ASSERT_TRUE(sub.ok()) << sub.status();
    auto none = (*sub)->Poll(1, kTimeout);
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_EQ(*none, nullptr);
  }
  for (int r = 0; r < kWorld; ++r) {
    if (r == kVictim) continue;
    absl::StatusOr<int> s = ranks[r].Wait(kTimeout);
    ASSERT_TRUE(s.ok()) << s.status();
    const std::string log = testing::ReadFileOrDie(dir / absl::StrFormat("first%d.log", r));
    EXPECT_EQ(ExitCode(*s), 1) << log;
    EXPECT_THAT(log, HasSubstr("DEADLINE_EXCEEDED")) << log;
    EXPECT_THAT(log, HasSubstr("version 1 was not committed: rank 2 of the group of 4 did not "
                               "stage its part by the deadline"))
        << log;
  }
  // The restarted rank and the others publish the next version, which subscribers receive.
  std::vector<Child> again = StartRanks(dir, uri, testing::kShm, kWorld, "rows", 2, 1, "second");
  ExpectWhole(uri, 2, kWorld);
  StopRanks(dir, again, "second", 2);
}

// ---- A publisher group on a channel with a shared secret (docs/SECURITY.md) ---------------

constexpr char kSecret[] = "the ucx group's channel secret, 40 bytes\n";

class UcxGroupSecretTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const auto& [path, secret] :
         {std::pair{key_, std::string(kSecret)},
          std::pair{other_key_, std::string("not the ucx group's secret")}}) {
      testing::WriteFileOrDie(path, secret);
      ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
    }
  }
  std::map<int, std::string> AllWithKey(int world) const {
    std::map<int, std::string> out;
    for (int r = 0; r < world; ++r) out[r] = "secret_file=" + key_;
    return out;
  }
  Options WithKey() const {
    Options o = SubscriberOptions();
    o["secret_file"] = key_;
    return o;
  }
  std::string Log(const std::string& name) const { return testing::ReadFileOrDie(dir_ / name); }

  ScratchDir dir_;
  const std::string key_ = dir_ / "key";
  const std::string other_key_ = dir_ / "other_key";
};

// Every rank proves the secret to rank 0, whose committed group manifest carries the MAC of the
// whole: subscribers with the secret receive the model whole (both bind modes) and as TP
// slices bit-exact (the core refuses a manifest without a valid MAC, so these receives prove
// it); a subscriber without the secret is refused. Groups of 2 (rows, shared memory) and 4
// (column slices, tcp).
TEST_F(UcxGroupSecretTest, AGroupWithASecretPublishesAndSubscribersReceiveBitExact) {
  for (const auto& [tls, world, layout] :
       {std::tuple{testing::kShm, 2, "rows"}, std::tuple{testing::kTcp, 4, "cols"}}) {
    SCOPED_TRACE(absl::StrFormat("%s, world_size %d, %s", tls.name, world, layout));
    const testing::ScopedEnvs tls_env(tls.env);
    if (std::string why = UcxUnusable(); !why.empty()) GTEST_SKIP() << "UCX unusable: " << why;
    const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/group", FreePort());
    const std::string tag = absl::StrFormat("secret%d-", world);
    std::vector<Child> ranks =
        StartRanks(dir_, uri, tls, world, layout, 1, 1, tag, {}, 60, AllWithKey(world));
    ExpectWholeModel(uri, 1, world, "", WithKey());
    ExpectWholeModel(uri, 1, world, "direct", WithKey());
    ExpectTpGroup(uri, 1, world, layout, 2, WithKey());
    auto stranger = Subscriber::Open(uri, SubscriberOptions());
    ASSERT_TRUE(stranger.ok()) << stranger.status();
    auto refused = (*stranger)->ReceiveVersion(1, kTimeout);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()),
                HasSubstr("requires the channel's shared secret"));
    StopRanks(dir_, ranks, tag, 1);
  }
}

// Rank 1's part of version 1 altered after its MAC on its way to rank 0 (fail point
// ucx.tamper_part): rank 0 checks every part's MAC before merging, refuses the set and commits
// nothing; both ranks' Publish return PermissionDenied naming rank 1 and the committing rank 0;
// no subscriber sees version 1; the group's next version (new processes) commits.
TEST_F(UcxGroupSecretTest, APartAlteredAfterItsMacIsNotCommitted) {
  const testing::ScopedEnvs tls_env(testing::kShm.env);
  if (std::string why = UcxUnusable(); !why.empty()) GTEST_SKIP() << "UCX unusable: " << why;
  constexpr int kWorld = 2;
  const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/group", FreePort());
  std::vector<Child> forged = StartRanks(dir_, uri, testing::kShm, kWorld, "rows", 1, 1, "forged",
                                         {{1, "ucx.tamper_part=error"}}, 60, AllWithKey(kWorld));
  std::vector<int> codes;
  for (Child& c : forged) {
    absl::StatusOr<int> code = c.Wait(kTimeout);
    ASSERT_TRUE(code.ok()) << code.status();
    codes.push_back(ExitCode(*code));
  }
  EXPECT_EQ(codes, (std::vector<int>{1, 1}));
  for (int r = 0; r < kWorld; ++r) {
    const std::string log = Log(absl::StrFormat("forged%d.log", r));
    EXPECT_THAT(log, HasSubstr("PERMISSION_DENIED")) << log;
    EXPECT_THAT(log, HasSubstr("version 1: rank 1's part (publisher session ")) << log;
    EXPECT_THAT(log, HasSubstr("has a wrong MAC under the key of the committing rank 0")) << log;
    EXPECT_THAT(log, HasSubstr("nothing of version 1 was committed")) << log;
  }
  // Nothing of version 1 is served (rank 0 is gone with it; a new group takes the address).
  std::vector<Child> real = StartRanks(dir_, uri, testing::kShm, kWorld, "rows", 2, 1, "real", {},
                                       60, AllWithKey(kWorld));
  auto sub = Subscriber::Open(uri, WithKey());
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto u = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*u)->version(), 2u);
  ExpectWholeModel(uri, 2, kWorld, "", WithKey());
  StopRanks(dir_, real, "real", 2);
}

// The group manifest of version 2 altered after rank 0's MAC (the owners of two parts swapped,
// fail point ucx.tamper_group_manifest@2), as someone between rank 0 and the subscribers
// would: a whole subscriber and a TP rank are refused with PermissionDenied before any byte
// moves and keep version 1; version 3 is received.
TEST_F(UcxGroupSecretTest, AnAlteredGroupManifestIsRefusedAndTheSubscriberKeepsItsVersion) {
  const testing::ScopedEnvs tls_env(testing::kShm.env);
  if (std::string why = UcxUnusable(); !why.empty()) GTEST_SKIP() << "UCX unusable: " << why;
  constexpr int kWorld = 2;
  const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/group", FreePort());
  std::vector<Child> ranks =
      StartRanks(dir_, uri, testing::kShm, kWorld, "rows", 1, 3, "tamper",
                 {{0, "ucx.tamper_group_manifest=error@2"}}, 60, AllWithKey(kWorld));
  auto sub = Subscriber::Open(uri, WithKey());
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto tp = Subscriber::Open(uri, WithKey(), SubscribePlacements{LlamaRules(), {2, 1}, {}});
  ASSERT_TRUE(tp.ok()) << tp.status();
  for (Subscriber* s : {sub->get(), tp->get()}) {
    auto u1 = s->ReceiveVersion(1, kTimeout);
    ASSERT_TRUE(u1.ok()) << u1.status();
    auto u2 = s->ReceiveVersion(2, kTimeout);
    ASSERT_EQ(u2.status().code(), absl::StatusCode::kPermissionDenied) << u2.status();
    EXPECT_THAT(std::string(u2.status().message()),
                HasSubstr("has a wrong MAC: it was not published with this channel's shared "
                          "secret, or its manifest was altered; refusing it; version 1 stays "
                          "current"));
    EXPECT_EQ(s->current_version(), 1u);
    auto u3 = s->ReceiveVersion(3, kTimeout);
    ASSERT_TRUE(u3.ok()) << u3.status();
  }
  ExpectWholeModel(uri, 3, kWorld, "", WithKey());
  StopRanks(dir_, ranks, "tamper", 3);
}

// A rank configured with another secret cannot prove it to rank 0 (nor rank 0 to it), and one
// without a secret is refused by rank 0: the rank's Publish says which, rank 0's names the rank
// that did not stage its part; nothing becomes visible.
TEST_F(UcxGroupSecretTest, ARankWithAnotherSecretOrNoneCannotJoin) {
  const testing::ScopedEnvs tls_env(testing::kShm.env);
  if (std::string why = UcxUnusable(); !why.empty()) GTEST_SKIP() << "UCX unusable: " << why;
  constexpr int kWorld = 2;
  int round = 0;
  for (const std::string& rank1 : {"secret_file=" + other_key_, std::string("lease=1s")}) {
    SCOPED_TRACE(rank1);
    const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/group", FreePort());
    const std::string tag = absl::StrFormat("mixed%d-", ++round);
    std::vector<Child> ranks = StartRanks(dir_, uri, testing::kShm, kWorld, "rows", 1, 1, tag, {},
                                          5, {{0, "secret_file=" + key_}, {1, rank1}});
    std::vector<int> codes;
    for (Child& c : ranks) {
      absl::StatusOr<int> code = c.Wait(kTimeout);
      ASSERT_TRUE(code.ok()) << code.status();
      codes.push_back(ExitCode(*code));
    }
    EXPECT_EQ(codes, (std::vector<int>{1, 1}));
    const std::string log0 = Log(tag + "0.log"), log1 = Log(tag + "1.log");
    EXPECT_THAT(log0, HasSubstr("rank 1 of the group of 2 did not stage its part by the "
                                "deadline"))
        << log0;
    EXPECT_THAT(log1, HasSubstr("PERMISSION_DENIED")) << log1;
    EXPECT_THAT(log1,
                HasSubstr(round == 1 ? "could not prove it holds the channel's shared secret"
                                     : "requires the channel's shared secret of every rank: rank "
                                       "1 joins without it"))
        << log1;
  }
}

// Rank 0 refuses a rank that joins with another world_size, and that rank's Publish says so.
TEST(UcxGroupChecksTest, RanksDisagreeingOnWorldSizeAreFailedPrecondition) {
  const testing::ScopedEnvs tls_env(testing::kShm.env);
  if (std::string why = UcxUnusable(); !why.empty()) GTEST_SKIP() << "UCX unusable: " << why;
  const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/group", FreePort());
  auto r0 = Publisher::Open(uri, {{"rank", "0"}, {"world_size", "2"}});
  ASSERT_TRUE(r0.ok()) << r0.status();
  auto r1 = Publisher::Open(uri, {{"rank", "1"}, {"world_size", "3"}});
  ASSERT_TRUE(r1.ok()) << r1.status();
  std::vector<float> w(16, 1.0f);
  TensorView v;
  v.name = "w";
  v.shape = {4, 4};
  v.data = w.data();
  absl::Status s = (*r1)->Publish(1, {v}, {}, kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 1 publishes with world_size 3, rank 0"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("with 2: the ranks disagree on world_size"));
}

// ---- Ranks as threads of this process (the cross-rank checks, leases) ----------------------

// The bytes of an [8, 4] F32 tensor "w" of `version` (element i is i + 100 * version).
std::vector<float> Weights(uint64_t version) {
  std::vector<float> w(32);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i + 100 * version);
  return w;
}

// Rank `r` of 2's views of `w`: rows [4r, 4r + 4) as a shard of [8, 4], in `dtype` (a rank
// that disagrees publishes another), and a replicated bias.
std::vector<TensorView> RankViews(const std::vector<float>& w, const std::vector<float>& bias,
                                  int r, DType dtype = DType::kF32) {
  TensorView rows;
  rows.name = "w";
  rows.dtype = dtype;
  rows.shape = {4, 4};
  rows.data = w.data() + 16 * r;
  rows.shard = Shard{{8, 4}, {4 * r, 0}};
  TensorView b;
  b.name = "bias";
  b.shape = {4};
  b.data = bias.data();
  return {rows, b};
}

// Publishes `version` on both ranks at once (rank 1 in a thread); their statuses.
std::vector<absl::Status> PublishBoth(std::vector<std::unique_ptr<Publisher>>& ranks,
                                      uint64_t version, const std::vector<float>& w,
                                      const std::vector<float>& bias,
                                      DType rank1_dtype = DType::kF32) {
  std::vector<absl::Status> status(2);
  std::thread one([&] {
    status[1] = ranks[1]->Publish(version, RankViews(w, bias, 1, rank1_dtype), {}, kTimeout);
  });
  status[0] = ranks[0]->Publish(version, RankViews(w, bias, 0), {}, kTimeout);
  one.join();
  return status;
}

std::vector<std::unique_ptr<Publisher>> OpenRanks(const std::string& uri, const Options& extra) {
  std::vector<std::unique_ptr<Publisher>> ranks;
  for (int r = 0; r < 2; ++r) {
    Options o = extra;
    o["rank"] = std::to_string(r);
    o["world_size"] = "2";
    auto p = Publisher::Open(uri, o);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return {};
    ranks.push_back(*std::move(p));
  }
  return ranks;
}

// Ranks that disagree on a tensor's dtype are refused, both of them, naming both sides, and
// nothing becomes visible; a corrected next version commits.
TEST(UcxGroupChecksTest, RanksDisagreeingOnADtypeAreRefusedForEveryRankAndACorrectionCommits) {
  const testing::ScopedEnvs tls_env(testing::kShm.env);
  if (std::string why = UcxUnusable(); !why.empty()) GTEST_SKIP() << "UCX unusable: " << why;
  const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/group", FreePort());
  std::vector<std::unique_ptr<Publisher>> ranks = OpenRanks(uri, {});
  ASSERT_EQ(ranks.size(), 2u);
  const std::vector<float> bias = {1, 2, 3, 4};
  const std::vector<float> w1 = Weights(1);
  const std::vector<absl::Status> refused = PublishBoth(ranks, 1, w1, bias, DType::kI32);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(refused[r].code(), absl::StatusCode::kInvalidArgument) << refused[r];
    EXPECT_THAT(std::string(refused[r].message()),
                HasSubstr("rank 0 publishes F32 of global shape [8, 4], rank 1 I32 of global "
                          "shape [8, 4]"))
        << "rank " << r;
  }
  auto sub = Subscriber::Open(uri);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto none = (*sub)->Poll(1, kTimeout);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);

  const std::vector<float> w2 = Weights(2);
  for (const absl::Status& s : PublishBoth(ranks, 2, w2, bias)) EXPECT_TRUE(s.ok()) << s;
  auto u = (*sub)->ReceiveVersion(2, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  const TensorView* w = (*u)->Find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(std::memcmp(w->data, w2.data(), w2.size() * 4), 0);
}

// A subscriber stalled in the middle of pulling a group version holds rank 0's only staging slot
// no longer than its lease: the group's next Publish gets the slot once the lease has expired,
// and the stalled transfer, resumed, fails instead of handing over bytes that may have been
// overwritten.
TEST(UcxGroupChecksTest, AStalledSubscriberHoldsTheRanksNoLongerThanItsLease) {
  const testing::ScopedEnvs tls_env(testing::kShm.env);
  if (std::string why = UcxUnusable(); !why.empty()) GTEST_SKIP() << "UCX unusable: " << why;
  const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/group", FreePort());
  std::vector<std::unique_ptr<Publisher>> ranks =
      OpenRanks(uri, {{"staging_slots", "1"}, {"lease", "500ms"}});
  ASSERT_EQ(ranks.size(), 2u);
  const std::vector<float> bias = {1, 2, 3, 4};
  const std::vector<float> w1 = Weights(1);
  for (const absl::Status& s : PublishBoth(ranks, 1, w1, bias)) ASSERT_TRUE(s.ok()) << s;

  testing::PausePoint stalled("ucx.during_get");
  absl::StatusOr<std::unique_ptr<Subscriber>> sub = [&] {
    const testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", stalled.Spec());
    return Subscriber::Open(uri);
  }();
  ASSERT_TRUE(sub.ok()) << sub.status();
  absl::Status stalled_receive;
  std::thread subscriber([&] { stalled_receive = (*sub)->ReceiveVersion(1, kTimeout).status(); });
  if (!stalled.WaitReached(kTimeout)) {
    subscriber.join();
    FAIL() << "the subscriber never reached ucx.during_get: " << stalled_receive;
  }
  // Held mid-transfer, renewing nothing: version 2 still gets every rank's slot.
  const std::vector<float> w2 = Weights(2);
  for (const absl::Status& s : PublishBoth(ranks, 2, w2, bias)) EXPECT_TRUE(s.ok()) << s;
  stalled.Release();
  subscriber.join();
  EXPECT_FALSE(stalled_receive.ok());
  auto fresh = Subscriber::Open(uri);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto u = (*fresh)->ReceiveVersion(2, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(std::memcmp((*u)->Find("w")->data, w2.data(), w2.size() * 4), 0);
}

}  // namespace
}  // namespace weightbus

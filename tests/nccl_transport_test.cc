// SPDX-License-Identifier: Apache-2.0
// nccl:// logic that needs no GPU, against fakes of its device interface
// (lib/transports/nccl/device.h) and a fake clock: bucket planning and splitting, the plan's and
// the control messages' encodings and every refusal of a malformed one, the handshake's
// comparison (each setting named with both values), the bucket pipeline (bit-exact packing and
// unpacking, deadlines, aborts) and the root's state machine (rebuilds for late joiners and
// departed replicas; a replica's death, stall or failure at each stage: at init, at the offer,
// at each bucket, after the last one, with the error naming it and the bucket, the
// communicator aborted, the survivors told). Deadlines are checked against the fake clock, so
// no case sleeps. The transport end to end, over real sockets between threads and processes:
// nccl_process_test.cc.
#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "test_support.h"
#include "transports/nccl/device.h"
#include "transports/nccl/handshake.h"
#include "transports/nccl/pipeline.h"
#include "transports/nccl/plan.h"
#include "transports/nccl/protocol.h"
#include "transports/nccl/root.h"

namespace weightbus::internal::nccl {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// ---------------------------------------------------------------------------------------------
// Bucket plans.

Manifest ManifestOf(const std::vector<uint64_t>& nbytes, uint64_t version = 7) {
  Manifest m;
  m.version = version;
  for (size_t i = 0; i < nbytes.size(); ++i) {
    TensorInfo t;
    t.name = absl::StrFormat("t%d", i);
    t.dtype = DType::kU8;
    t.shape = {static_cast<int64_t>(nbytes[i])};
    t.nbytes = nbytes[i];
    m.tensors.push_back(t);
  }
  return m;
}

// Every tensor's bytes, recovered from the plan's pieces: the plan covers each exactly once.
void ExpectCovers(const BucketPlan& plan, const std::vector<uint64_t>& nbytes) {
  std::vector<uint64_t> covered(nbytes.size(), 0);
  for (const Bucket& b : plan.buckets) {
    EXPECT_LE(b.bytes, plan.bucket_size);
    for (const Piece& p : b.pieces) {
      EXPECT_EQ(p.bucket_offset % plan.alignment, 0u);
      EXPECT_EQ(p.tensor_offset, covered[p.tensor]);
      covered[p.tensor] += p.length;
    }
  }
  EXPECT_EQ(covered, nbytes);
  EXPECT_TRUE(CheckPlan(plan, ManifestOf(nbytes)).ok()) << CheckPlan(plan, ManifestOf(nbytes));
}

TEST(NcclPlanTest, NoTensorsAndZeroByteTensorsNeedNoBucket) {
  for (const std::vector<uint64_t>& sizes : {std::vector<uint64_t>{}, {0}, {0, 0, 0}}) {
    absl::StatusOr<BucketPlan> plan = PlanBuckets(sizes, 4096);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->buckets.empty());
    ExpectCovers(*plan, sizes);
  }
  // Zero-byte tensors between others take no room and no piece.
  absl::StatusOr<BucketPlan> plan = PlanBuckets({100, 0, 100}, 4096);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->buckets.size(), 1u);
  EXPECT_THAT(plan->buckets[0].pieces, ElementsAre(Piece{0, 0, 0, 100}, Piece{2, 0, 256, 100}));
  EXPECT_EQ(plan->buckets[0].bytes, 356u);
  ExpectCovers(*plan, {100, 0, 100});
}

TEST(NcclPlanTest, ExactMultiplesFillBucketsWithoutAnEmptyOne) {
  absl::StatusOr<BucketPlan> plan = PlanBuckets({4096, 4096, 2048, 2048}, 4096);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->buckets.size(), 3u);
  EXPECT_THAT(plan->buckets[0].pieces, ElementsAre(Piece{0, 0, 0, 4096}));
  EXPECT_THAT(plan->buckets[1].pieces, ElementsAre(Piece{1, 0, 0, 4096}));
  EXPECT_THAT(plan->buckets[2].pieces, ElementsAre(Piece{2, 0, 0, 2048}, Piece{3, 0, 2048, 2048}));
  for (const Bucket& b : plan->buckets) EXPECT_EQ(b.bytes, 4096u);
  ExpectCovers(*plan, {4096, 4096, 2048, 2048});
}

TEST(NcclPlanTest, ATensorLargerThanABucketIsSplitAndContinuesWhereTheLastEnds) {
  // 1000 bytes, then 10000 over three buckets (3072 of it fills the first bucket's rest).
  const std::vector<uint64_t> sizes = {1000, 10000, 1};
  absl::StatusOr<BucketPlan> plan = PlanBuckets(sizes, 4096);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->buckets.size(), 3u);
  EXPECT_THAT(plan->buckets[0].pieces, ElementsAre(Piece{0, 0, 0, 1000}, Piece{1, 0, 1024, 3072}));
  EXPECT_THAT(plan->buckets[1].pieces, ElementsAre(Piece{1, 3072, 0, 4096}));
  EXPECT_THAT(plan->buckets[2].pieces, ElementsAre(Piece{1, 7168, 0, 2832}, Piece{2, 0, 3072, 1}));
  EXPECT_EQ(plan->buckets[2].bytes, 3073u);
  ExpectCovers(*plan, sizes);
  // Tensor 1 completes in the last bucket, with tensor 2; tensor 0 in the first.
  EXPECT_THAT(TensorsCompletedBy(*plan),
              ElementsAre(ElementsAre(0u), ElementsAre(), ElementsAre(1u, 2u)));
}

TEST(NcclPlanTest, ManyTinyTensorsShareBucketsAtAlignedOffsets) {
  const std::vector<uint64_t> sizes(1000, 3);
  absl::StatusOr<BucketPlan> plan = PlanBuckets(sizes, 4096);
  ASSERT_TRUE(plan.ok());
  // 16 pieces of 256 bytes' room per 4 KiB bucket.
  ASSERT_EQ(plan->buckets.size(), 63u);
  EXPECT_EQ(plan->buckets[0].pieces.size(), 16u);
  EXPECT_EQ(plan->buckets.back().pieces.size(), 1000u - 62 * 16);
  EXPECT_EQ(plan->buckets[0].bytes, 15 * 256u + 3);
  ExpectCovers(*plan, sizes);
  size_t completed = 0;
  for (const auto& c : TensorsCompletedBy(*plan)) completed += c.size();
  EXPECT_EQ(completed, 1000u);
}

TEST(NcclPlanTest, ATensorStartingAtABucketsLastAlignedSlotGoesThere) {
  // The first tensor ends 1 byte before the last 256-byte slot: the next starts in that slot.
  absl::StatusOr<BucketPlan> plan = PlanBuckets({4096 - 257, 600}, 4096);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->buckets.size(), 2u);
  EXPECT_THAT(plan->buckets[0].pieces,
              ElementsAre(Piece{0, 0, 0, 4096 - 257}, Piece{1, 0, 4096 - 256, 256}));
  EXPECT_THAT(plan->buckets[1].pieces, ElementsAre(Piece{1, 256, 0, 344}));
  ExpectCovers(*plan, {4096 - 257, 600});
}

TEST(NcclPlanTest, BucketSizeMustBeAPositiveMultipleOfTheAlignment) {
  EXPECT_TRUE(absl::IsInvalidArgument(PlanBuckets({1}, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(PlanBuckets({1}, 4000).status()));
  EXPECT_THAT(std::string(PlanBuckets({1}, 4000).status().message()), HasSubstr("4000"));
  EXPECT_TRUE(absl::IsInvalidArgument(PlanBuckets({1}, 4096, 100).status()));
}

TEST(NcclPlanTest, EncodingRoundTripsAndRefusesTruncationAndHostileCounts) {
  const std::vector<uint64_t> sizes = {1000, 10000, 0, 1, 70000};
  absl::StatusOr<BucketPlan> plan = PlanBuckets(sizes, 8192);
  ASSERT_TRUE(plan.ok());
  const std::string bytes = EncodePlan(*plan);
  absl::StatusOr<BucketPlan> back = DecodePlan(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, *plan);
  for (size_t cut = 0; cut < bytes.size(); cut += 7) {
    absl::StatusOr<BucketPlan> truncated = DecodePlan(bytes.substr(0, cut));
    ASSERT_TRUE(absl::IsDataLoss(truncated.status())) << cut;
    EXPECT_THAT(std::string(truncated.status().message()), HasSubstr("malformed bucket plan"));
  }
  EXPECT_TRUE(absl::IsDataLoss(DecodePlan(bytes + "x").status()));
  // A count claiming more than the bytes can hold is refused before any allocation.
  std::string hostile = bytes.substr(0, 16);
  hostile += std::string("\xff\xff\xff\x00", 4);
  absl::StatusOr<BucketPlan> h = DecodePlan(hostile);
  ASSERT_TRUE(absl::IsDataLoss(h.status()));
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("claims 16777215 buckets"));
}

// Each way a received plan can contradict its manifest is refused, naming what is wrong.
TEST(NcclPlanTest, CheckPlanRefusesEveryInconsistency) {
  const std::vector<uint64_t> sizes = {1000, 10000, 0, 5};
  const Manifest m = ManifestOf(sizes);
  const BucketPlan good = *PlanBuckets(sizes, 4096);
  ASSERT_TRUE(CheckPlan(good, m).ok());
  struct Case {
    std::string name;
    std::function<void(BucketPlan&)> mutate;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"alignment", [](BucketPlan& p) { p.alignment = 100; }, "alignment 100"},
      {"bucket size", [](BucketPlan& p) { p.bucket_size = 1000; }, "bucket size 1000"},
      {"tensor index", [](BucketPlan& p) { p.buckets[0].pieces[0].tensor = 9; },
       "names tensor 9 of 4"},
      {"outside the bucket", [](BucketPlan& p) { p.buckets[1].pieces[0].bucket_offset = 256; },
       "inside the bucket"},
      {"misaligned", [](BucketPlan& p) { p.buckets[0].pieces[1].bucket_offset = 1000; },
       "aligned to 256"},
      {"overlap", [](BucketPlan& p) { p.buckets[0].pieces[1].bucket_offset = 768; },
       "pieces so far end at 1000"},
      {"empty piece", [](BucketPlan& p) { p.buckets[0].pieces[0].length = 0; }, "non-empty"},
      {"gap in a tensor", [](BucketPlan& p) { p.buckets[1].pieces[0].tensor_offset += 256; },
       "which continues at byte 3072"},
      {"order",
       [](BucketPlan& p) {
         std::swap(p.buckets[0].pieces[0].tensor, p.buckets[0].pieces[1].tensor);
       },
       "but tensor 0 is next"},
      {"bucket bytes", [](BucketPlan& p) { p.buckets[0].bytes = 4000; },
       "says 4000 bytes but its pieces end at 4096"},
      {"missing bytes",
       [](BucketPlan& p) {
         Bucket& last = p.buckets.back();
         last.pieces.pop_back();
         last.bytes = last.pieces.back().bucket_offset + last.pieces.back().length;
       },
       "tensor 3 (\"t3\") is 5 bytes but the plan carries 0"},
      {"empty bucket", [](BucketPlan& p) { p.buckets.push_back(Bucket{}); }, "has no piece"},
      {"missing bucket", [](BucketPlan& p) { p.buckets.pop_back(); }, "tensor 1 (\"t1\")"},
  };
  for (const Case& c : cases) {
    BucketPlan p = good;
    c.mutate(p);
    const absl::Status s = CheckPlan(p, m);
    EXPECT_TRUE(absl::IsDataLoss(s)) << c.name << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.expected)) << c.name;
    EXPECT_THAT(std::string(s.message()), HasSubstr("version 7")) << c.name;
  }
}

// ---------------------------------------------------------------------------------------------
// Control messages.

template <typename Msg, typename Decode>
Msg RoundTrip(const Msg& m, MsgType type, Decode decode) {
  std::string frame = Encode(m);
  absl::StatusOr<std::optional<Frame>> f = control::TakeFrame<MsgType>(frame, kMaxFrame);
  EXPECT_TRUE(f.ok() && f->has_value());
  EXPECT_EQ((*f)->type, type);
  EXPECT_TRUE(frame.empty());
  absl::StatusOr<Msg> back = decode((*f)->payload);
  EXPECT_TRUE(back.ok()) << back.status();
  // Every strict prefix is refused, naming the message.
  const std::string& payload = (*f)->payload;
  for (size_t cut = 0; cut < payload.size(); ++cut) {
    absl::StatusOr<Msg> t = decode(std::string_view(payload).substr(0, cut));
    EXPECT_TRUE(absl::IsDataLoss(t.status())) << MsgTypeName(type) << " cut at " << cut;
    EXPECT_THAT(std::string(t.status().message()),
                HasSubstr(absl::StrFormat("malformed %s message", MsgTypeName(type))));
  }
  return back.ok() ? *back : Msg{};
}

TEST(NcclProtocolTest, EveryMessageRoundTripsAndEveryTruncationIsRefused) {
  HelloMsg hello{kMagic,
                 kProtocolVersion,
                 "policy",
                 0x1234,
                 "pid 1 on h",
                 "GPU 3 (x)",
                 "GPU-abc",
                 22809,
                 {{"NCCL_CUMEM_ENABLE", "0"}, {"NCCL_PROTO", ""}}};
  HelloMsg h = RoundTrip(hello, MsgType::kHello, DecodeHello);
  EXPECT_EQ(h.channel, "policy");
  EXPECT_EQ(h.device_uuid, "GPU-abc");
  EXPECT_EQ(h.nccl_version, 22809u);
  EXPECT_EQ(h.settings, hello.settings);
  WelcomeMsg w =
      RoundTrip(WelcomeMsg{kProtocolVersion, 99, "pub", true, 5}, MsgType::kWelcome, DecodeWelcome);
  EXPECT_EQ(w.session_id, 99u);
  EXPECT_EQ(w.newest, 5u);
  EXPECT_EQ(RoundTrip(ErrorMsg{9, "no"}, MsgType::kError, DecodeError).message, "no");
  GroupMsg g = RoundTrip(GroupMsg{3, 2, 4, std::string(kUniqueIdBytes, '\x7f'), "who"},
                         MsgType::kGroup, DecodeGroup);
  EXPECT_EQ(g.epoch, 3u);
  EXPECT_EQ(g.rank, 2u);
  EXPECT_EQ(g.nranks, 4u);
  EXPECT_EQ(RoundTrip(GroupReadyMsg{3, 14, "init"}, MsgType::kGroupReady, DecodeGroupReady).code,
            14u);
  OfferMsg o = RoundTrip(OfferMsg{3, 8, "{json}", "plan"}, MsgType::kOffer, DecodeOffer);
  EXPECT_EQ(o.version, 8u);
  EXPECT_EQ(o.plan, "plan");
  EXPECT_EQ(RoundTrip(ReadyMsg{8}, MsgType::kReady, DecodeReady).version, 8u);
  EXPECT_EQ(RoundTrip(ReceivedMsg{8, 3}, MsgType::kReceived, DecodeReceived).buckets, 3u);
  EXPECT_EQ(RoundTrip(AbortMsg{3, 8, 14, "why"}, MsgType::kAbort, DecodeAbort).message, "why");
  EXPECT_EQ(RoundTrip(FailedMsg{3, 8, 4, "late"}, MsgType::kFailed, DecodeFailed).code, 4u);
  EXPECT_EQ(RoundTrip(AcceptedMsg{8}, MsgType::kAccepted, DecodeAccepted).version, 8u);
  EXPECT_EQ(RoundTrip(StartMsg{3, 8}, MsgType::kStart, DecodeStart).version, 8u);
  EXPECT_EQ(RoundTrip(CommitMsg{3, 8}, MsgType::kCommit, DecodeCommit).epoch, 3u);
  SlotsMsg slots = RoundTrip(SlotsMsg{3, 4096, {"h1", "h2"}}, MsgType::kSlots, DecodeSlots);
  EXPECT_EQ(slots.handles, (std::vector<std::string>{"h1", "h2"}));
  BucketMsg b = RoundTrip(BucketMsg{8, 5, 1}, MsgType::kBucket, DecodeBucket);
  EXPECT_EQ(b.bucket, 5u);
  EXPECT_EQ(b.slot, 1u);
}

TEST(NcclProtocolTest, DecodersRefuseWhatNoPeerMaySend) {
  auto payload = [](const std::string& frame) { return frame.substr(5); };
  // A unique id of the wrong size; a replica rank past nranks (0 is a replica on rank 0's GPU).
  EXPECT_THAT(
      std::string(DecodeGroup(payload(Encode(GroupMsg{1, 1, 2, "short", ""}))).status().message()),
      HasSubstr("the unique id is 5 bytes, not 128"));
  EXPECT_TRUE(
      DecodeGroup(payload(Encode(GroupMsg{1, 0, 1, std::string(kUniqueIdBytes, 'x'), ""}))).ok());
  for (uint32_t rank : {2u, 3u}) {
    absl::Status s =
        DecodeGroup(payload(Encode(GroupMsg{1, rank, 2, std::string(kUniqueIdBytes, 'x'), ""})))
            .status();
    EXPECT_TRUE(absl::IsDataLoss(s));
    EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrFormat("rank %d of 2", rank)));
  }
  // Trailing bytes after a strict message; an over-long text; a flag other than 0 or 1.
  EXPECT_TRUE(absl::IsDataLoss(DecodeReady(payload(Encode(ReadyMsg{1})) + "x").status()));
  control::FrameWriter long_error(static_cast<uint8_t>(MsgType::kError));
  long_error.U32(2).Str(std::string(kMaxText + 1, 'e'));
  EXPECT_THAT(std::string(DecodeError(payload(long_error.Finish())).status().message()),
              HasSubstr("at most 8192"));
  std::string welcome = payload(Encode(WelcomeMsg{1, 2, "d", true, 3}));
  welcome[4 + 8 + 4 + 1] = 2;
  EXPECT_THAT(std::string(DecodeWelcome(welcome).status().message()), HasSubstr("has_newest is 2"));
  // A HELLO claiming more settings than it carries.
  control::FrameWriter hostile(static_cast<uint8_t>(MsgType::kHello));
  hostile.Str(kMagic).U32(1).Str("c").U64(1).Str("d").Str("g").Str("u").U32(1).U32(1000000);
  EXPECT_THAT(std::string(DecodeHello(payload(hostile.Finish())).status().message()),
              HasSubstr("claims 1000000 settings"));
  // Senders cut free text to what receivers accept.
  absl::StatusOr<ErrorMsg> cut = DecodeError(payload(Encode(ErrorMsg{2, std::string(20000, 'z')})));
  ASSERT_TRUE(cut.ok());
  EXPECT_EQ(cut->message.size(), kMaxText);
  // The publisher reads a replica's frames up to kMaxReplicaFrame only.
  std::string big = Encode(OfferMsg{1, 1, std::string(kMaxReplicaFrame, 'j'), ""});
  EXPECT_TRUE(absl::IsDataLoss(control::TakeFrame<MsgType>(big, kMaxReplicaFrame).status()));
}

// ---------------------------------------------------------------------------------------------
// The handshake.

TEST(NcclHandshakeTest, SettingsComeFromTheEnvironmentThenTheUsersThenTheSystemsFile) {
  testing::ScratchDir home;
  testing::WriteFileOrDie(home / ".nccl.conf",
                          "# comment\nNCCL_P2P_DISABLE = 1\nNCCL_CUMEM_ENABLE=1\nNCCL_PROTO=LL\n"
                          "NCCL_PROTO=Simple\n");
  std::string e1 = "NCCL_CUMEM_ENABLE=0", e2 = "HOME=" + home.path(), e3 = "OTHER=1";
  char* env[] = {e1.data(), e2.data(), e3.data(), nullptr};
  std::map<std::string, std::string> got;
  for (const Setting& s : NcclEnvironmentSettings(env)) got[s.name] = s.value;
  EXPECT_EQ(got.size(), AgreementSettings().size());
  EXPECT_EQ(got["NCCL_CUMEM_ENABLE"], "0");  // the environment beats the file
  EXPECT_EQ(got["NCCL_P2P_DISABLE"], "1");   // from ~/.nccl.conf
  EXPECT_EQ(got["NCCL_PROTO"], "LL");        // its first line for a name
  EXPECT_EQ(got["NCCL_SHM_DISABLE"], "");    // unset
  // NCCL_CONF_FILE replaces ~/.nccl.conf.
  testing::WriteFileOrDie(home / "other.conf", "NCCL_SHM_DISABLE=1\n");
  std::string e4 = "NCCL_CONF_FILE=" + home / "other.conf";
  char* env2[] = {e2.data(), e4.data(), nullptr};
  got.clear();
  for (const Setting& s : NcclEnvironmentSettings(env2)) got[s.name] = s.value;
  EXPECT_EQ(got["NCCL_SHM_DISABLE"], "1");
  EXPECT_EQ(got["NCCL_P2P_DISABLE"], "");
}

TEST(NcclHandshakeTest, AgreementIsOkWhenEqualAndNamesEverySettingThatDiffersWithBothValues) {
  Agreement pub{22809, NcclEnvironmentSettings(nullptr, "/nonexistent")};
  for (Setting& s : pub.settings) s.value = "";
  EXPECT_TRUE(CompareAgreement(pub, "P", pub, "R").ok());
  for (std::string_view name : AgreementSettings()) {
    Agreement rep = pub;
    for (Setting& s : rep.settings) {
      if (s.name == name) s.value = "0";
    }
    const absl::Status s = CompareAgreement(pub, "pid 1 on trainer", rep, "pid 2 on infer");
    ASSERT_TRUE(absl::IsFailedPrecondition(s)) << name;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr(absl::StrFormat("%s is unset on the publisher (pid 1 on trainer) but "
                                          "\"0\" on replica pid 2 on infer",
                                          name)));
    EXPECT_THAT(std::string(s.message()), HasSubstr("before any transfer"));
  }
  Agreement old = pub;
  old.nccl_version = 22703;
  old.settings[0].value = "1";
  const absl::Status both = CompareAgreement(pub, "P", old, "R");
  EXPECT_THAT(std::string(both.message()),
              AllOf(HasSubstr("the NCCL version is 2.28.9 on the publisher (P) but 2.27.3 on "
                              "replica R"),
                    HasSubstr("NCCL_CUMEM_ENABLE is unset on the publisher (P) but \"1\"")));
  // A setting only one side knows counts as unset on the other.
  Agreement extra = pub;
  extra.settings.push_back({"NCCL_FUTURE", "x"});
  EXPECT_THAT(std::string(CompareAgreement(pub, "P", extra, "R").message()),
              HasSubstr("NCCL_FUTURE is unset on the publisher (P) but \"x\" on replica R"));
  EXPECT_EQ(NcclVersionText(22809), "2.28.9");
  EXPECT_EQ(NcclVersionText(2804), "2.8.4");
}

// ---------------------------------------------------------------------------------------------
// Fakes of the device interface.

class FakeClock final : public Clock {
 public:
  absl::Time Now() override { return now; }
  void SleepFor(absl::Duration d) override {
    now += d;
    slept += d;
  }
  absl::Time now = absl::FromUnixSeconds(1'000'000);
  absl::Duration slept;
};

// What every fake communicator of a test shares: the root's broadcasts, in order.
struct FakeWorld {
  std::vector<std::string> broadcasts;  // the bytes of each broadcast posted (root) this version
  int comms = 0;                        // communicators started
  int aborts = 0;
  int init_polls = 3;                 // Poll says "in progress" this many times after init
  std::optional<size_t> error_after;  // Poll fails once this many broadcasts were posted
  // A replica's side: what Broadcast writes into the buffer (bucket k's bytes).
  std::function<void(size_t k, void* buffer, uint64_t bytes)> deliver;
};

class FakeComm final : public Communicator {
 public:
  FakeComm(FakeWorld& world, int nranks, int rank)
      : world_(world), nranks_(nranks), rank_(rank), init_polls_(world.init_polls) {}
  ~FakeComm() override { Abort(); }
  absl::StatusOr<bool> Poll() override {
    if (aborted_) return absl::UnavailableError("fake communicator: aborted");
    if (world_.error_after && world_.broadcasts.size() >= *world_.error_after) {
      return absl::UnavailableError("fake communicator: NCCL error 6 (remote process exited)");
    }
    if (init_polls_ > 0) {
      --init_polls_;
      return false;
    }
    return true;
  }
  absl::Status Broadcast(void* buffer, uint64_t bytes, int root, int stream) override {
    if (aborted_) return absl::UnavailableError("aborted");
    if (rank_ == 0) {
      world_.broadcasts.emplace_back(static_cast<const char*>(buffer), bytes);
    } else if (world_.deliver) {
      world_.deliver(posted_, buffer, bytes);
    }
    ++posted_;
    init_polls_ = 1;  // the call is "being enqueued" once
    return absl::OkStatus();
  }
  void Abort() override {
    if (aborted_) return;
    aborted_ = true;
    ++world_.aborts;
  }
  int rank() const override { return rank_; }
  int nranks() const override { return nranks_; }
  bool aborted() const { return aborted_; }

 private:
  FakeWorld& world_;
  int nranks_;
  int rank_;
  int init_polls_;
  size_t posted_ = 0;
  bool aborted_ = false;
};

// Host memory; copies happen at once; stream `s`'s event is done once Done was asked
// `done_after` times (so waits poll), or never from bucket `stall_from` on.
class FakeDevice final : public Device {
 public:
  explicit FakeDevice(int streams) : streams_(streams), records_(streams, 0) {}
  std::string Describe() const override { return "fake GPU 0"; }
  std::string Uuid() const override { return "GPU-fake"; }
  int streams() const override { return streams_; }
  absl::StatusOr<std::shared_ptr<void>> Allocate(uint64_t bytes) override {
    auto* p = new std::vector<std::byte>(bytes, std::byte{0xee});
    return std::shared_ptr<void>(p->data(), [p](void*) { delete p; });
  }
  absl::Status Copy(void* dst, const void* src, uint64_t bytes, int stream) override {
    std::memcpy(dst, src, bytes);
    ++copies;
    return absl::OkStatus();
  }
  absl::Status Record(int stream) override {
    records_[stream] = ++recorded_;
    polls_[stream] = 0;
    return absl::OkStatus();
  }
  absl::StatusOr<bool> Done(int stream) override {
    if (stall_from && records_[stream] >= *stall_from) return false;
    return ++polls_[stream] > done_after;
  }
  void Synchronize() override { ++synchronized; }
  bool IsDeviceMemory(const void*) const override { return false; }
  absl::StatusOr<std::string> ExportBuffer(const std::shared_ptr<void>& buffer) override {
    return absl::StrFormat("%d", reinterpret_cast<uintptr_t>(buffer.get()));
  }
  absl::StatusOr<std::shared_ptr<void>> ImportBuffer(const std::string& handle) override {
    return std::shared_ptr<void>(reinterpret_cast<void*>(std::stoull(handle)), [](void*) {});
  }

  int done_after = 2;
  std::optional<uint64_t> stall_from;  // events of buckets >= this (1-based record count) never
  int copies = 0;
  int synchronized = 0;

 private:
  int streams_;
  std::vector<uint64_t> records_;
  std::map<int, int> polls_;
  uint64_t recorded_ = 0;
};

class FakeBackend final : public Backend {
 public:
  explicit FakeBackend(FakeWorld& world) : world_(world) {}
  BackendInfo Info() override { return {"fake", 22809}; }
  absl::StatusOr<std::unique_ptr<Device>> OpenDevice(int, int streams) override {
    return std::unique_ptr<Device>(std::make_unique<FakeDevice>(streams));
  }
  absl::StatusOr<UniqueId> NewUniqueId() override {
    UniqueId id{};
    id[0] = static_cast<uint8_t>(++ids_);
    return id;
  }
  absl::StatusOr<std::unique_ptr<Communicator>> StartCommunicator(Device&, const UniqueId&,
                                                                  int nranks, int rank) override {
    ++world_.comms;
    last_nranks = nranks;
    world_.broadcasts.clear();
    return std::unique_ptr<Communicator>(std::make_unique<FakeComm>(world_, nranks, rank));
  }
  int last_nranks = 0;

 private:
  FakeWorld& world_;
  int ids_ = 0;
};

std::vector<std::byte> Bytes(uint64_t n, uint64_t seed) { return testing::RandomBytes(n, seed); }

// The tensors a plan's buckets carry, put back together (what a replica's unpacking yields).
std::vector<std::vector<std::byte>> Unpack(const BucketPlan& plan,
                                           const std::vector<std::string>& buckets,
                                           const std::vector<uint64_t>& sizes) {
  std::vector<std::vector<std::byte>> out;
  for (uint64_t n : sizes) out.emplace_back(n);
  for (size_t k = 0; k < plan.buckets.size() && k < buckets.size(); ++k) {
    for (const Piece& p : plan.buckets[k].pieces) {
      std::memcpy(out[p.tensor].data() + p.tensor_offset, buckets[k].data() + p.bucket_offset,
                  p.length);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The pipeline.

class NeverWatch final : public Watch {
 public:
  absl::Status Check() override { return status; }
  absl::Status status;
};

TEST(NcclPipelineTest, PollUntilPollsOnceMoreAtTheDeadlineThenNamesWhatTimedOut) {
  FakeClock clock;
  const absl::Time deadline = clock.now + absl::Milliseconds(5);
  int polls = 0;
  absl::Status s = PollUntil(
      clock, deadline, nullptr, nullptr,
      [&]() -> absl::StatusOr<bool> { return ++polls > 1000000; }, [] { return "the thing"; });
  EXPECT_TRUE(absl::IsDeadlineExceeded(s));
  EXPECT_EQ(s.message(), "the thing");
  EXPECT_GE(clock.now, deadline);
  EXPECT_LT(clock.now, deadline + kMaxPollSleep);
  // Sleeps grow: a 5 ms wait takes far fewer than 5000 polls of 1 us.
  EXPECT_LT(polls, 100);
  // Work that finished by the deadline is success, even when seen at the deadline.
  polls = 0;
  clock.now = absl::FromUnixSeconds(1'000'000);
  EXPECT_TRUE(PollUntil(
                  clock, clock.now, nullptr, nullptr,
                  [&]() -> absl::StatusOr<bool> { return ++polls == 2; }, [] { return ""; })
                  .ok());
  // A watch's failure ends the wait with it.
  NeverWatch watch;
  watch.status = absl::UnavailableError("peer gone");
  EXPECT_EQ(PollUntil(
                clock, clock.now + absl::Hours(1), nullptr, &watch,
                []() -> absl::StatusOr<bool> { return false; }, [] { return ""; }),
            watch.status);
}

class NcclReceiveTest : public ::testing::TestWithParam<int> {};  // buckets in flight

TEST_P(NcclReceiveTest, UnpacksEveryBucketBitExactReportingEachOnceInOrder) {
  const std::vector<uint64_t> sizes = {1000, 10000, 0, 3, 3, 4096, 20000};
  const BucketPlan plan = *PlanBuckets(sizes, 4096);
  std::vector<std::vector<std::byte>> sources;
  for (size_t i = 0; i < sizes.size(); ++i) sources.push_back(Bytes(sizes[i], i + 1));
  // The root's buckets: what a broadcast delivers to this replica.
  std::vector<std::string> buckets(plan.buckets.size());
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    buckets[k].assign(plan.buckets[k].bytes, '\0');
    for (const Piece& p : plan.buckets[k].pieces) {
      std::memcpy(buckets[k].data() + p.bucket_offset, sources[p.tensor].data() + p.tensor_offset,
                  p.length);
    }
  }
  FakeWorld world;
  world.deliver = [&](size_t k, void* buffer, uint64_t bytes) {
    ASSERT_EQ(bytes, buckets[k].size());
    std::memcpy(buffer, buckets[k].data(), bytes);
  };
  FakeBackend backend(world);
  FakeDevice device(GetParam());
  FakeComm comm(world, 3, 1);
  FakeClock clock;
  std::vector<std::shared_ptr<void>> slots;
  for (int s = 0; s < GetParam(); ++s) slots.push_back(*device.Allocate(4096));
  std::vector<std::vector<std::byte>> targets;
  std::vector<std::byte*> ptrs;
  for (uint64_t n : sizes) targets.emplace_back(n, std::byte{0});
  for (auto& t : targets) ptrs.push_back(t.data());
  ptrs[2] = nullptr;  // a zero-byte tensor's empty buffer
  std::vector<size_t> reported;
  NeverWatch watch;
  absl::Status s = ReceiveBuckets(
      device, comm, clock, watch, plan, ptrs, slots,
      [&](size_t k) {
        reported.push_back(k);
        return absl::OkStatus();
      },
      clock.now + absl::Seconds(10), "ch version 7");
  ASSERT_TRUE(s.ok()) << s;
  std::vector<size_t> expected(plan.buckets.size());
  for (size_t k = 0; k < expected.size(); ++k) expected[k] = k;
  EXPECT_EQ(reported, expected);
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(targets[i], sources[i]) << "tensor " << i;
  EXPECT_FALSE(comm.aborted());
}

TEST_P(NcclReceiveTest, ADrainReceivesEveryBucketAndWritesNothing) {
  const BucketPlan plan = *PlanBuckets({10000, 5000}, 4096);
  FakeWorld world;
  FakeDevice device(GetParam());
  FakeComm comm(world, 2, 1);
  FakeClock clock;
  std::vector<std::shared_ptr<void>> slots;
  for (int s = 0; s < GetParam(); ++s) slots.push_back(*device.Allocate(4096));
  std::vector<std::byte*> none(2, nullptr);
  size_t reported = 0;
  NeverWatch watch;
  ASSERT_TRUE(ReceiveBuckets(
                  device, comm, clock, watch, plan, none, slots,
                  [&](size_t) {
                    ++reported;
                    return absl::OkStatus();
                  },
                  clock.now + absl::Seconds(1), "x")
                  .ok());
  EXPECT_EQ(reported, plan.buckets.size());
  EXPECT_EQ(device.copies, 0);
}

TEST_P(NcclReceiveTest, AStalledBucketAbortsAtTheDeadlineNamingIt) {
  const BucketPlan plan = *PlanBuckets({4096 * 5}, 4096);
  FakeWorld world;
  FakeDevice device(GetParam());
  device.stall_from = 3;  // bucket 3 (1-based) never completes
  FakeComm comm(world, 2, 1);
  FakeClock clock;
  std::vector<std::shared_ptr<void>> slots;
  for (int s = 0; s < GetParam(); ++s) slots.push_back(*device.Allocate(4096));
  std::vector<std::byte> target(4096 * 5);
  std::byte* ptr = target.data();
  size_t reported = 0;
  NeverWatch watch;
  const absl::Time deadline = clock.now + absl::Seconds(2);
  absl::Status s = ReceiveBuckets(
      device, comm, clock, watch, plan, absl::MakeSpan(&ptr, 1), slots,
      [&](size_t) {
        ++reported;
        return absl::OkStatus();
      },
      deadline, "nccl://h:1/ch version 7");
  ASSERT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("nccl://h:1/ch version 7: receiving bucket 3 of 5"),
                    HasSubstr("bucket 3 did not arrive by the deadline")));
  EXPECT_EQ(reported, 2u);
  EXPECT_TRUE(comm.aborted());
  EXPECT_GE(device.synchronized, 1);  // no copy may touch the target after the call returns
  EXPECT_GE(clock.now, deadline);
  EXPECT_LT(clock.now, deadline + absl::Milliseconds(1));
}

TEST_P(NcclReceiveTest, ThePublishersAbortEndsTheReceiveWithItsWords) {
  const BucketPlan plan = *PlanBuckets({4096 * 4}, 4096);
  FakeWorld world;
  FakeDevice device(GetParam());
  device.stall_from = 2;
  FakeComm comm(world, 2, 1);
  FakeClock clock;
  std::vector<std::shared_ptr<void>> slots;
  for (int s = 0; s < GetParam(); ++s) slots.push_back(*device.Allocate(4096));
  std::vector<std::byte*> none(1, nullptr);
  NeverWatch watch;
  int calls = 0;
  absl::Status s = ReceiveBuckets(
      device, comm, clock, watch, plan, none, slots,
      [&](size_t) {
        if (++calls == 1) watch.status = absl::UnavailableError("the publisher gave up version 7");
        return absl::OkStatus();
      },
      clock.now + absl::Hours(1), "v7");
  ASSERT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("the publisher gave up version 7"));
  EXPECT_TRUE(comm.aborted());
  EXPECT_LT(clock.slept, absl::Seconds(1));  // at once, not at the deadline
}

INSTANTIATE_TEST_SUITE_P(Slots, NcclReceiveTest, ::testing::Values(2, 3));

// ---------------------------------------------------------------------------------------------
// The root's state machine.

// Scripted replicas that react at once to what the root sends them.
struct FakeReplica {
  std::string name;
  bool alive = true;
  std::string gone;
  // Behaviour.
  bool answers_group = true;
  std::optional<absl::Status> init_error;
  bool answers_offer = true;
  std::optional<absl::Status> fails_at_start;
  std::optional<size_t> dies_at_group;  // dies when GROUP arrives
  std::optional<size_t> dies_at_offer;  // dies when OFFER arrives
  std::optional<size_t> dies_after;     // dies once the root posted this many buckets
  std::optional<size_t> stalls_after;   // receives no more than this many buckets
  bool colocated = false;  // on the root's GPU: reads buckets from its buffers (BUCKET)
  // State.
  ReplicaState state;
  uint64_t started = 0;  // version START was received for
  std::vector<MsgType> received;
  size_t handles = 0;              // buffers SLOTS gave it
  std::vector<BucketMsg> buckets;  // BUCKETs of the started version, in order
};

class FakeLinks final : public ReplicaLinks {
 public:
  explicit FakeLinks(FakeWorld& world) : world_(world) {}

  uint64_t Add(std::string name, bool colocated = false) {
    const uint64_t id = next_++;
    replicas_[id].name = std::move(name);
    replicas_[id].colocated = colocated;
    replicas_[id].state.colocated = colocated;
    order_.push_back(id);
    return id;
  }
  FakeReplica& operator[](uint64_t id) { return replicas_[id]; }

  std::vector<uint64_t> Alive() override {
    std::vector<uint64_t> out;
    for (uint64_t id : order_) {
      if (Update(replicas_[id]).alive) out.push_back(id);
    }
    return out;
  }
  ReplicaState State(uint64_t id) override {
    auto it = replicas_.find(id);
    if (it == replicas_.end()) return {};
    return Update(it->second).state;
  }
  void Send(uint64_t id, std::string frame) override {
    FakeReplica& r = replicas_[id];
    if (!r.alive) return;
    auto f = control::TakeFrame<MsgType>(frame, kMaxFrame);
    ASSERT_TRUE(f.ok() && f->has_value());
    const Frame& m = **f;
    r.received.push_back(m.type);
    switch (m.type) {
      case MsgType::kGroup: {
        GroupMsg g = *DecodeGroup(m.payload);
        groups.push_back({id, g});
        if (r.dies_at_group) return Kill(r);
        EXPECT_EQ(g.rank == 0, r.colocated) << r.name;
        if (r.init_error) {
          r.state.failed = *r.init_error;
          r.state.failed_epoch = g.epoch;
          r.state.failed_version = 0;
        } else if (r.answers_group && !r.colocated) {
          r.state.group_ready = g.epoch;
        }
        return;
      }
      case MsgType::kSlots: {
        const SlotsMsg slots = *DecodeSlots(m.payload);
        r.handles = slots.handles.size();
        if (r.answers_group) r.state.group_ready = slots.epoch;
        return;
      }
      case MsgType::kBucket: {
        const BucketMsg b = *DecodeBucket(m.payload);
        EXPECT_EQ(b.version, r.started) << r.name;
        EXPECT_EQ(b.bucket, r.buckets.size()) << r.name << ": BUCKETs in order, once each";
        r.buckets.push_back(b);
        return;
      }
      case MsgType::kOffer: {
        OfferMsg o = *DecodeOffer(m.payload);
        offers.push_back({id, o});
        if (r.dies_at_offer) return Kill(r);
        if (r.answers_offer) r.state.ready = o.version;
        return;
      }
      case MsgType::kStart: {
        StartMsg s = *DecodeStart(m.payload);
        world_.broadcasts.clear();  // a new version's broadcasts
        r.started = s.version;
        r.buckets.clear();
        r.state.received_version = s.version;
        if (r.fails_at_start) {
          r.state.failed = *r.fails_at_start;
          r.state.failed_epoch = s.epoch;
          r.state.failed_version = s.version;
        }
        return;
      }
      case MsgType::kAbort:
        aborts.push_back({id, *DecodeAbort(m.payload)});
        return;
      default:
        return;
    }
  }
  absl::Status Cancelled() override { return cancelled; }

  std::vector<std::pair<uint64_t, GroupMsg>> groups;
  std::vector<std::pair<uint64_t, OfferMsg>> offers;
  std::vector<std::pair<uint64_t, AbortMsg>> aborts;
  absl::Status cancelled;

 private:
  void Kill(FakeReplica& r) {
    r.alive = false;
    r.state.alive = false;
    r.state.gone = "its connection closed (the process exited or crashed)";
  }
  FakeReplica& Update(FakeReplica& r) {
    r.state.name = r.name;
    if (!r.alive) return r;
    r.state.alive = true;
    if (r.started != 0) {
      const size_t posted = world_.broadcasts.size();
      if (r.dies_after && posted >= *r.dies_after) {
        Kill(r);
        return r;
      }
      // A replica on the root's GPU has a bucket once told it is in a buffer (and copied it out).
      const size_t got = r.colocated ? r.buckets.size() : posted;
      r.state.received_buckets = std::min(got, r.stalls_after.value_or(got));
    }
    return r;
  }

  FakeWorld& world_;
  std::map<uint64_t, FakeReplica> replicas_;
  std::vector<uint64_t> order_;
  uint64_t next_ = 1;
};

class NcclRootTest : public ::testing::Test {
 protected:
  NcclRootTest()
      : backend_(world_),
        device_(2),
        links_(world_),
        root_(backend_, device_, clock_, links_, RootOptions{4096, "nccl://t:1/ch", "pid 1 on t"}) {
    for (size_t i = 0; i < sizes_.size(); ++i) sources_.push_back(Bytes(sizes_[i], 100 + i));
    for (auto& s : sources_) ptrs_.push_back(s.data());
    plan_ = *PlanBuckets(sizes_, 4096);
  }

  absl::Status Publish(uint64_t version, absl::Duration timeout = absl::Seconds(10)) {
    deadline_ = clock_.now + timeout;
    return root_.Publish(ManifestOf(sizes_, version), ptrs_, deadline_);
  }
  // The root's broadcasts carry every tensor bit-exact.
  void ExpectDelivered() {
    EXPECT_EQ(world_.broadcasts.size(), plan_.buckets.size());
    EXPECT_EQ(Unpack(plan_, world_.broadcasts, sizes_), sources_);
  }
  std::vector<uint64_t> AbortedTo() const {
    std::vector<uint64_t> out;
    for (const auto& [id, a] : links_.aborts) out.push_back(id);
    return out;
  }

  const std::vector<uint64_t> sizes_ = {1000, 10000, 0, 3, 4096 * 2};  // 5 buckets of 4 KiB
  std::vector<std::vector<std::byte>> sources_;
  std::vector<const std::byte*> ptrs_;
  BucketPlan plan_;
  FakeWorld world_;
  FakeClock clock_;
  FakeBackend backend_;
  FakeDevice device_;
  FakeLinks links_;
  Root root_;
  absl::Time deadline_;
};

TEST_F(NcclRootTest, WithNoReplicaItDeliversToNobodyAndBuildsNothing) {
  ASSERT_TRUE(Publish(1).ok());
  EXPECT_EQ(world_.comms, 0);
  EXPECT_EQ(root_.epoch(), 0u);
  EXPECT_EQ(root_.last_stats().replicas, 0u);
}

TEST_F(NcclRootTest, FirstPublishBuildsTheGroupThenEveryVersionReusesIt) {
  const uint64_t a = links_.Add("replica A"), b = links_.Add("replica B");
  ASSERT_EQ(plan_.buckets.size(), 5u);
  absl::Status s = Publish(1);
  ASSERT_TRUE(s.ok()) << s;
  ExpectDelivered();
  EXPECT_EQ(root_.epoch(), 1u);
  EXPECT_EQ(backend_.last_nranks, 3);
  ASSERT_EQ(links_.groups.size(), 2u);
  EXPECT_EQ(links_.groups[0].first, a);
  EXPECT_EQ(links_.groups[0].second.rank, 1u);
  EXPECT_EQ(links_.groups[1].first, b);
  EXPECT_EQ(links_.groups[1].second.rank, 2u);
  EXPECT_EQ(links_.groups[1].second.nranks, 3u);
  EXPECT_THAT(links_.groups[0].second.members,
              AllOf(HasSubstr("rank 1: replica A"), HasSubstr("rank 2: replica B")));
  // The OFFER carries the manifest and the very plan the root broadcast with.
  ASSERT_EQ(links_.offers.size(), 2u);
  EXPECT_EQ(*DecodePlan(links_.offers[0].second.plan), plan_);
  EXPECT_EQ(Manifest::FromJson(links_.offers[0].second.manifest_json, "offer")->version, 1u);
  EXPECT_THAT(links_[a].received,
              ElementsAre(MsgType::kGroup, MsgType::kOffer, MsgType::kStart, MsgType::kCommit));
  EXPECT_TRUE(root_.last_stats().rebuilt);
  EXPECT_EQ(root_.last_stats().broadcast.wire_bytes, plan_.WireBytes());

  for (uint64_t v = 2; v <= 4; ++v) {
    ASSERT_TRUE(Publish(v).ok());
    ExpectDelivered();
  }
  EXPECT_EQ(world_.comms, 1);
  EXPECT_EQ(root_.epoch(), 1u);
  EXPECT_EQ(links_.groups.size(), 2u);
  EXPECT_FALSE(root_.last_stats().rebuilt);
  EXPECT_EQ(world_.aborts, 0);
}

TEST_F(NcclRootTest, ALateJoinerTriggersARebuildAtTheNextPublishNotAStall) {
  const uint64_t a = links_.Add("replica A");
  ASSERT_TRUE(Publish(1).ok());
  const uint64_t b = links_.Add("replica B");
  std::optional<std::string> why =
      RebuildReason(root_.epoch(), root_.usable(), root_.ranks(), links_.Alive(), links_);
  ASSERT_TRUE(why.has_value());
  EXPECT_EQ(*why, "replica B joined");
  ASSERT_TRUE(Publish(2).ok());
  ExpectDelivered();
  EXPECT_EQ(root_.epoch(), 2u);
  EXPECT_EQ(backend_.last_nranks, 3);
  EXPECT_THAT(root_.ranks(), ElementsAre(a, b));
  EXPECT_EQ(world_.aborts, 1);  // the old communicator, given up for the new one
  EXPECT_EQ(RebuildReason(root_.epoch(), true, root_.ranks(), links_.Alive(), links_),
            std::nullopt);
  EXPECT_EQ(*RebuildReason(0, false, {}, {a}, links_), "no communicator exists yet");
  EXPECT_EQ(*RebuildReason(3, false, {a}, {a}, links_), "the communicator of epoch 3 was aborted");
}

// Where a replica dies, the error names it (and, during the broadcast, the bucket), the
// communicator is aborted, the survivor is told, and the next publish rebuilds from the living.
enum class Stage { kGroup, kOffer, kBucket1, kBucket3, kAfterLast };
class NcclRootDeathTest : public NcclRootTest, public ::testing::WithParamInterface<Stage> {};

TEST_P(NcclRootDeathTest, APeerDyingAtEachStageFailsThePublishNamingItAndTheNextRebuilds) {
  const uint64_t a = links_.Add("replica A"), b = links_.Add("replica B");
  std::string expected;
  switch (GetParam()) {
    case Stage::kGroup:
      links_[b].dies_at_group = 0;
      expected = "building the communicator of epoch 1 (3 ranks; no communicator exists yet)";
      break;
    case Stage::kOffer:
      links_[b].dies_at_offer = 0;
      expected = "before any transfer";
      break;
    case Stage::kBucket1:
      links_[b].dies_after = 1;
      expected = "bucket 1 of 5";
      break;
    case Stage::kBucket3:
      links_[b].dies_after = 3;
      expected = "bucket 3 of 5";
      break;
    case Stage::kAfterLast:
      links_[b].stalls_after = 4;
      links_[b].dies_after = 5;
      expected = "bucket 5 of 5";
      break;
  }
  const absl::Status s = Publish(1);
  ASSERT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("nccl://t:1/ch"), HasSubstr("replica B (rank 2) is gone"),
                    HasSubstr("its connection closed"), HasSubstr(expected)));
  EXPECT_FALSE(root_.usable());
  EXPECT_GE(world_.aborts, 1);
  EXPECT_THAT(AbortedTo(), ElementsAre(a));  // the survivor is told; the dead get nothing
  EXPECT_THAT(links_[a].received, Not(::testing::Contains(MsgType::kCommit)));
  EXPECT_LT(clock_.now, deadline_);  // at once, not at the deadline
  // The next publish rebuilds from the one still there.
  ASSERT_TRUE(Publish(2).ok());
  ExpectDelivered();
  EXPECT_EQ(root_.epoch(), 2u);
  EXPECT_EQ(backend_.last_nranks, 2);
  EXPECT_THAT(root_.ranks(), ElementsAre(a));
}

INSTANTIATE_TEST_SUITE_P(Stages, NcclRootDeathTest,
                         ::testing::Values(Stage::kGroup, Stage::kOffer, Stage::kBucket1,
                                           Stage::kBucket3, Stage::kAfterLast));

TEST_F(NcclRootTest, AReplicaThatNeverInitializesTimesOutAtTheDeadlineNamingIt) {
  const uint64_t a = links_.Add("replica A"), b = links_.Add("replica B");
  links_[b].answers_group = false;
  const absl::Status s = Publish(1, absl::Seconds(3));
  ASSERT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(
      std::string(s.message()),
      AllOf(HasSubstr("not every rank was initialized by the deadline"),
            HasSubstr("replica B (rank 2) did not report ready"), Not(HasSubstr("replica A"))));
  EXPECT_GE(clock_.now, deadline_);
  EXPECT_LT(clock_.now, deadline_ + absl::Milliseconds(1));
  EXPECT_FALSE(root_.usable());
  EXPECT_THAT(AbortedTo(), ElementsAre(a, b));
  ASSERT_EQ(links_.aborts[0].second.version, 0u);  // the communicator itself
}

TEST_F(NcclRootTest, AReplicaWhoseRankFailsToInitializeIsNamedWithItsError) {
  links_.Add("replica A");
  const uint64_t b = links_.Add("replica B");
  links_[b].init_error = absl::InternalError("ncclCommInitRankConfig: NCCL error 3 (internal)");
  const absl::Status s = Publish(1);
  ASSERT_TRUE(absl::IsInternal(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("replica B (rank 2) failed"), HasSubstr("NCCL error 3")));
  EXPECT_FALSE(root_.usable());
}

TEST_F(NcclRootTest, AReplicaNotReceivingTimesOutBeforeAnyTransferAndKeepsTheCommunicator) {
  const uint64_t a = links_.Add("replica A"), b = links_.Add("replica B");
  ASSERT_TRUE(Publish(1).ok());
  links_[b].answers_offer = false;
  const absl::Status s = Publish(2, absl::Seconds(5));
  ASSERT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("version 2 was not received by the deadline"),
                    HasSubstr("replica B (rank 2) did not start receiving it"),
                    HasSubstr("nothing was transferred")));
  EXPECT_GE(clock_.now, deadline_);
  // Nobody posted a broadcast: the communicator stays, the replicas are told to drop version 2.
  EXPECT_TRUE(root_.usable());
  EXPECT_EQ(world_.aborts, 0);
  EXPECT_THAT(AbortedTo(), ElementsAre(a, b));
  EXPECT_EQ(links_.aborts[0].second.version, 2u);
  links_[b].answers_offer = true;
  ASSERT_TRUE(Publish(3).ok());
  ExpectDelivered();
  EXPECT_EQ(root_.epoch(), 1u);
}

TEST_F(NcclRootTest, AStalledReplicaTimesOutNamingItAndTheBucketAndAbortsTheCommunicator) {
  const uint64_t a = links_.Add("replica A"), b = links_.Add("replica B");
  links_[b].stalls_after = 2;
  device_.done_after = 0;
  const absl::Status s = Publish(1, absl::Seconds(4));
  ASSERT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("broadcasting bucket 3 of 5"),
                    HasSubstr("bucket 3 was not received by the deadline"),
                    HasSubstr("replica B (rank 2) has received 2 of them"),
                    Not(HasSubstr("replica A (rank 1)"))));
  EXPECT_GE(clock_.now, deadline_);
  EXPECT_LT(clock_.now, deadline_ + absl::Milliseconds(1));
  EXPECT_FALSE(root_.usable());
  EXPECT_THAT(AbortedTo(), ElementsAre(a, b));
  EXPECT_EQ(links_.aborts[0].second.version, 1u);
  EXPECT_GE(device_.synchronized, 1);
}

TEST_F(NcclRootTest, TheCommunicatorsAsynchronousErrorFailsThePublishAndAbortsIt) {
  links_.Add("replica A");
  world_.error_after = 2;
  const absl::Status s = Publish(1);
  ASSERT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("remote process exited"), HasSubstr("bucket 2 of 5")));
  EXPECT_FALSE(root_.usable());
}

TEST_F(NcclRootTest, AReplicasOwnFailureIsNamedWithItsWords) {
  links_.Add("replica A");
  const uint64_t b = links_.Add("replica B");
  links_[b].fails_at_start =
      absl::ResourceExhaustedError("allocating bucket buffer 1 of 2: out of memory");
  const absl::Status s = Publish(1);
  ASSERT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("replica B (rank 2) failed"), HasSubstr("out of memory")));
}

TEST_F(NcclRootTest, ClosingThePublisherEndsAWaitWithCancelled) {
  const uint64_t b = links_.Add("replica B");
  links_[b].answers_offer = false;
  ASSERT_TRUE(Publish(1, absl::Milliseconds(1)).code() == absl::StatusCode::kDeadlineExceeded);
  links_.cancelled = absl::CancelledError("the publisher is being closed");
  const absl::Status s = Publish(2, absl::Hours(1));
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_LT(clock_.slept, absl::Seconds(1));
}

TEST_F(NcclRootTest, AReplicaOnTheRootsGpuReadsEachBucketFromTheRootsBuffers) {
  // Only a replica on the root's GPU: the communicator is the root's one rank.
  const uint64_t a = links_.Add("replica A", /*colocated=*/true);
  absl::Status s = Publish(1);
  ASSERT_TRUE(s.ok()) << s;
  ExpectDelivered();
  EXPECT_EQ(backend_.last_nranks, 1);
  ASSERT_EQ(links_.groups.size(), 1u);
  EXPECT_EQ(links_.groups[0].second.rank, 0u);
  EXPECT_EQ(links_.groups[0].second.nranks, 1u);
  EXPECT_THAT(links_.groups[0].second.members, HasSubstr("on rank 0's GPU: replica A"));
  EXPECT_EQ(links_[a].handles, 2u);  // both bucket buffers
  ASSERT_EQ(links_[a].buckets.size(), plan_.buckets.size());
  for (size_t k = 0; k < plan_.buckets.size(); ++k) {
    EXPECT_EQ(links_[a].buckets[k].slot, k % 2) << "bucket " << k;
  }
  EXPECT_THAT(links_[a].received,
              ElementsAre(MsgType::kGroup, MsgType::kSlots, MsgType::kOffer, MsgType::kStart,
                          MsgType::kBucket, MsgType::kBucket, MsgType::kBucket, MsgType::kBucket,
                          MsgType::kBucket, MsgType::kCommit));
  // With a replica on another GPU too: that one is rank 1 of 2.
  const uint64_t b = links_.Add("replica B");
  ASSERT_TRUE(Publish(2).ok());
  ExpectDelivered();
  EXPECT_EQ(backend_.last_nranks, 2);
  EXPECT_EQ(links_.groups.back().first, b);
  EXPECT_EQ(links_.groups.back().second.rank, 1u);
  EXPECT_EQ(links_[a].buckets.size(), plan_.buckets.size());
}

TEST_F(NcclRootTest, ABufferIsReusedOnlyOnceTheReplicasOnTheRootsGpuTookItsBucket) {
  const uint64_t a = links_.Add("replica A", /*colocated=*/true);
  links_.Add("replica B");
  links_[a].stalls_after = 1;  // takes bucket 1 out of its buffer, then stalls
  device_.done_after = 0;
  const absl::Status s = Publish(1, absl::Seconds(2));
  ASSERT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("bucket 2 was not received by the deadline"),
                    HasSubstr("replica A (on rank 0's GPU) has received 1 of them"),
                    Not(HasSubstr("replica B (rank 1)"))));
  // Buckets 1 and 2 went out in the two buffers; bucket 3 would reuse bucket 1's buffer, which
  // A had taken, so it did; bucket 4 would reuse bucket 2's, which A never took.
  EXPECT_EQ(world_.broadcasts.size(), 3u);
  EXPECT_FALSE(root_.usable());
}

}  // namespace
}  // namespace weightbus::internal::nccl

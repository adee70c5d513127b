// SPDX-License-Identifier: Apache-2.0
// The delta layer seen from the plugin interface (core/transport.h): which path a version takes
// (keyframe, chain, delta on the base, duplicate), and the cases a filesystem channel cannot
// produce, driven through an in-memory inner transport that delivers versions in any order and
// may lack OpenVersion: out-of-order deltas, missed versions, wrong bases.
#include <gtest/gtest.h>

#include <cstring>
#include <deque>
#include <map>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/registry.h"
#include "core/status.h"
#include "nlohmann/json.hpp"
#include "test_model.h"
#include "test_support.h"
#include "transports/delta/delta_transport.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::internal::delta {
namespace {

using ::weightbus::testing::OwnedTensor;
using ::weightbus::testing::ScratchDir;
using ::weightbus::testing::Xxh3;

constexpr absl::Duration kTimeout = absl::Seconds(30);

// Versions of a few bf16 and other tensors where a few elements change each time.
std::vector<OwnedTensor> MakeStreamVersion(uint64_t seed, uint64_t version) {
  std::vector<OwnedTensor> out = testing::MakeVersion(seed, 1, 8192);
  std::mt19937_64 rng(seed);
  for (uint64_t v = 2; v <= version; ++v) {
    for (OwnedTensor& t : out) {
      if (t.bytes.empty()) continue;
      for (int k = 0; k < 3; ++k) {
        std::byte& b = t.bytes[rng() % t.bytes.size()];
        b = t.dtype == DType::kBool ? (b ^ std::byte{1}) : std::byte(uint8_t(b) + 1);
      }
    }
  }
  return out;
}

Manifest ManifestOf(uint64_t version, const std::vector<OwnedTensor>& tensors) {
  Manifest m;
  m.version = version;
  for (const OwnedTensor& t : tensors) {
    m.tensors.push_back(TensorInfo{t.name, t.dtype, t.shape, std::nullopt, t.bytes.size(),
                                   Xxh3(t.bytes.data(), t.bytes.size())});
  }
  return m;
}

// What a subscriber got: the path description and the verified bytes.
struct Received {
  uint64_t version = 0;
  std::string source;
  std::vector<std::vector<std::byte>> tensors;
};

// Does what the core does with an IncomingVersion: fetch, verify every checksum, accept.
absl::StatusOr<Received> Receive(TransportSubscriber& sub, uint64_t min_version,
                                 absl::Duration timeout = kTimeout) {
  WB_ASSIGN_OR_RETURN(std::unique_ptr<IncomingVersion> incoming,
                      sub.WaitForVersion(min_version, absl::Now() + timeout));
  const Manifest& m = incoming->manifest();
  Received r;
  r.version = m.version;
  r.source = incoming->DescribeSource(0);
  std::vector<std::byte*> targets;
  for (const TensorInfo& t : m.tensors) {
    r.tensors.emplace_back(t.nbytes);
    targets.push_back(r.tensors.back().data());
  }
  struct Sink final : public LandingSink {
    void Landed(size_t) override { ++landed; }
    std::atomic<int> landed{0};
  } sink;
  WB_RETURN_IF_ERROR(incoming->Fetch(targets, sink, absl::Now() + timeout));
  if (sink.landed != static_cast<int>(m.tensors.size())) {
    return absl::InternalError("not every tensor landed");
  }
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    if (Xxh3(r.tensors[i].data(), r.tensors[i].size()) != m.tensors[i].xxh3) {
      return absl::DataLossError(
          absl::StrFormat("tensor %s fails verification", m.tensors[i].name));
    }
  }
  incoming->Accepted();
  return r;
}

void ExpectBytes(const Received& r, const std::vector<OwnedTensor>& expected) {
  ASSERT_EQ(r.tensors.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(r.tensors[i] == expected[i].bytes) << expected[i].name;
  }
}

// ---------------------------------------------------------------------------------------------
// Over a real disk channel: which path each version takes.

std::unique_ptr<TransportSubscriber> OpenDeltaDisk(const std::string& uri_text) {
  auto uri = ParseUri(uri_text);
  EXPECT_TRUE(uri.ok());
  auto stack = ResolveStack(*uri);
  EXPECT_TRUE(stack.ok()) << stack.status();
  auto config = ResolveConfig(*stack, *uri, {});
  EXPECT_TRUE(config.ok()) << config.status();
  auto sub = OpenSubscriberStack(*stack, *uri, *config);
  EXPECT_TRUE(sub.ok()) << sub.status();
  return *std::move(sub);
}

TEST(DeltaLayerTest, LateJoinerReplaysTheNewestKeyframeThenTakesDeltas) {
  ScratchDir dir;
  const std::string uri = "delta+disk://" + dir.path() + "/ch?fsync=false&keyframe_interval=20";
  auto pub = Publisher::Open(uri);
  ASSERT_TRUE(pub.ok());
  for (uint64_t v = 1; v <= 50; ++v) {
    auto version = MakeStreamVersion(1, v);
    ASSERT_TRUE((*pub)->Publish(v, testing::Views(version), {}, kTimeout).ok());
  }
  auto sub = OpenDeltaDisk(uri);
  auto first = Receive(*sub, 0);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->version, 50u);
  EXPECT_TRUE(absl::StrContains(first->source, "keyframe 41 + 9 deltas up to 50")) << first->source;
  ExpectBytes(*first, MakeStreamVersion(1, 50));
  for (uint64_t v = 51; v <= 53; ++v) {
    auto version = MakeStreamVersion(1, v);
    ASSERT_TRUE((*pub)->Publish(v, testing::Views(version), {}, kTimeout).ok());
    auto next = Receive(*sub, v);
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_TRUE(absl::StrContains(
        next->source,
        absl::StrFormat("delta %d on this subscriber's copy of version %d", v, v - 1)))
        << next->source;
    ExpectBytes(*next, version);
  }
  // Missing two versions: the two deltas are applied in order on the subscriber's copy.
  for (uint64_t v = 54; v <= 56; ++v) {
    auto version = MakeStreamVersion(1, v);
    ASSERT_TRUE((*pub)->Publish(v, testing::Views(version), {}, kTimeout).ok());
  }
  auto skip = Receive(*sub, 54);
  ASSERT_TRUE(skip.ok()) << skip.status();
  EXPECT_TRUE(
      absl::StrContains(skip->source, "deltas 54..56 on this subscriber's copy of version 53"))
      << skip->source;
  ExpectBytes(*skip, MakeStreamVersion(1, 56));
  // And the same version again is served from the subscriber's copy.
  auto again = Receive(*sub, 0);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->version, 56u);
  EXPECT_TRUE(absl::StrContains(again->source, "delivered again, not applied again"))
      << again->source;
  ExpectBytes(*again, MakeStreamVersion(1, 56));
}

// ---------------------------------------------------------------------------------------------
// An in-memory inner transport with scripted delivery.

struct FakeChannel {
  std::map<uint64_t, std::pair<Manifest, std::vector<std::byte>>> versions;
  std::deque<uint64_t> deliveries;  // WaitForVersion hands these over first, whatever is asked
  bool can_open = true;
};

class FakeIncoming final : public IncomingVersion {
 public:
  FakeIncoming(Manifest m, std::vector<std::byte> bytes)
      : manifest_(std::move(m)), bytes_(std::move(bytes)) {}
  const Manifest& manifest() const override { return manifest_; }
  absl::Status Fetch(absl::Span<std::byte* const> targets, LandingSink& sink, absl::Time) override {
    std::memcpy(targets[0], bytes_.data(), bytes_.size());
    sink.Landed(0);
    return absl::OkStatus();
  }
  std::string DescribeSource(size_t) const override {
    return absl::StrFormat("fake version %d", manifest_.version);
  }

 private:
  Manifest manifest_;
  std::vector<std::byte> bytes_;
};

class FakePublisher final : public TransportPublisher {
 public:
  explicit FakePublisher(FakeChannel* channel) : channel_(channel) {}
  absl::StatusOr<std::optional<uint64_t>> LatestVersion() override {
    if (channel_->versions.empty()) return std::optional<uint64_t>();
    return channel_->versions.rbegin()->first;
  }
  absl::Status Publish(PublishJob& job, absl::Time deadline) override {
    WB_ASSIGN_OR_RETURN(const Manifest* m, job.SealedManifest(deadline));
    const PackedTensor& blob = job.tensors()[0];
    channel_->versions[m->version] = {
        *m, std::vector<std::byte>(blob.data, blob.data + blob.info->nbytes)};
    return absl::OkStatus();
  }

 private:
  FakeChannel* channel_;
};

class FakeSubscriber final : public TransportSubscriber {
 public:
  explicit FakeSubscriber(FakeChannel** channel) : channel_(channel) {}
  absl::StatusOr<std::unique_ptr<IncomingVersion>> WaitForVersion(uint64_t min_version,
                                                                  absl::Time) override {
    FakeChannel& c = **channel_;
    if (!c.deliveries.empty()) {
      const uint64_t v = c.deliveries.front();
      c.deliveries.pop_front();
      return Open(v);
    }
    if (!c.versions.empty() && c.versions.rbegin()->first >= min_version) {
      return Open(c.versions.rbegin()->first);
    }
    return absl::DeadlineExceededError(absl::StrFormat("fake: no version >= %d", min_version));
  }
  absl::StatusOr<std::unique_ptr<IncomingVersion>> OpenVersion(uint64_t version,
                                                               absl::Time) override {
    if (!(*channel_)->can_open) return absl::UnimplementedError("fake: cannot open versions");
    if ((*channel_)->versions.count(version) == 0) return absl::NotFoundError("fake: gone");
    return Open(version);
  }

 private:
  std::unique_ptr<IncomingVersion> Open(uint64_t v) {
    const auto& [m, bytes] = (*channel_)->versions.at(v);
    return std::make_unique<FakeIncoming>(m, bytes);
  }
  FakeChannel** channel_;
};

Config DeltaConfig(const std::map<std::string, std::string>& options = {}) {
  auto c = Config::Resolve({&CoreSettings(), &DeltaSettings()}, {}, options);
  EXPECT_TRUE(c.ok()) << c.status();
  return *std::move(c);
}

// A delta publisher over a fake channel.
class FakeStack {
 public:
  explicit FakeStack(FakeChannel* channel, const std::map<std::string, std::string>& options = {})
      : uri_(*ParseUri("delta+fake:///test")) {
    auto pub = WrapPublisher(uri_, DeltaConfig(options), std::make_unique<FakePublisher>(channel));
    EXPECT_TRUE(pub.ok()) << pub.status();
    pub_ = *std::move(pub);
  }
  void Publish(uint64_t version, const std::vector<OwnedTensor>& tensors) {
    std::vector<const std::byte*> data;
    for (const OwnedTensor& t : tensors) data.push_back(t.bytes.data());
    SealedPublishJob job(ManifestOf(version, tensors), data);
    ASSERT_TRUE(pub_->Publish(job, absl::Now() + kTimeout).ok());
  }
  const Uri& uri() const { return uri_; }

 private:
  Uri uri_;
  std::unique_ptr<TransportPublisher> pub_;
};

std::unique_ptr<TransportSubscriber> FakeSubscriberStack(FakeChannel** channel) {
  auto sub = WrapSubscriber(*ParseUri("delta+fake:///test"), DeltaConfig(),
                            std::make_unique<FakeSubscriber>(channel));
  EXPECT_TRUE(sub.ok()) << sub.status();
  return *std::move(sub);
}

TEST(DeltaLayerTest, OutOfOrderVersionsAreRefusedAndNothingIsAppliedTwice) {
  FakeChannel channel;
  FakeChannel* current = &channel;
  FakeStack pub(&channel);
  for (uint64_t v = 1; v <= 3; ++v) pub.Publish(v, MakeStreamVersion(2, v));
  auto sub = FakeSubscriberStack(&current);
  // Version 2 first: a delta, rebuilt from keyframe 1.
  channel.deliveries = {2};
  auto two = Receive(*sub, 0);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_TRUE(absl::StrContains(two->source, "keyframe 1 + 1 deltas up to 2")) << two->source;
  ExpectBytes(*two, MakeStreamVersion(2, 2));
  // Then version 1, older than what the subscriber holds: refused.
  channel.deliveries = {1};
  auto one = Receive(*sub, 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(one.status())) << one.status();
  EXPECT_TRUE(absl::StrContains(one.status().message(), "out of order")) << one.status();
  // Version 2 again: served from the subscriber's copy, not applied again.
  channel.deliveries = {2};
  auto dup = Receive(*sub, 0);
  ASSERT_TRUE(dup.ok()) << dup.status();
  EXPECT_TRUE(absl::StrContains(dup->source, "delivered again")) << dup->source;
  ExpectBytes(*dup, MakeStreamVersion(2, 2));
  // Then version 3 applies on 2 as usual.
  auto three = Receive(*sub, 3);
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_TRUE(absl::StrContains(three->source, "delta 3 on this subscriber's copy of version 2"))
      << three->source;
  ExpectBytes(*three, MakeStreamVersion(2, 3));
}

TEST(DeltaLayerTest, WithoutOpenVersionAMissedVersionMeansWaitingForAKeyframe) {
  FakeChannel channel;
  channel.can_open = false;
  FakeChannel* current = &channel;
  FakeStack pub(&channel, {{"keyframe_interval", "4"}});
  for (uint64_t v = 1; v <= 4; ++v) pub.Publish(v, MakeStreamVersion(3, v));
  auto sub = FakeSubscriberStack(&current);
  channel.deliveries = {1};
  ASSERT_TRUE(Receive(*sub, 1).ok());
  // Version 3 arrives without 2: it cannot be applied, 4 neither, and no keyframe follows yet.
  channel.deliveries = {3};
  auto missed = Receive(*sub, 2, absl::Milliseconds(200));
  EXPECT_TRUE(absl::IsDeadlineExceeded(missed.status())) << missed.status();
  EXPECT_TRUE(absl::StrContains(missed.status().message(), "waiting for a keyframe"))
      << missed.status();
  // The keyframe 5 brings the subscriber back.
  pub.Publish(5, MakeStreamVersion(3, 5));
  auto five = Receive(*sub, 2);
  ASSERT_TRUE(five.ok()) << five.status();
  EXPECT_EQ(five->version, 5u);
  EXPECT_TRUE(absl::StrContains(five->source, "keyframe 5")) << five->source;
  ExpectBytes(*five, MakeStreamVersion(3, 5));
}

TEST(DeltaLayerTest, ADeltaAgainstAnotherBaseWithTheSameNumberIsNotApplied) {
  FakeChannel a, b;
  a.can_open = b.can_open = false;
  FakeChannel* current = &a;
  FakeStack pub_a(&a), pub_b(&b, {{"keyframe_interval", "4"}});
  for (uint64_t v = 1; v <= 2; ++v) pub_a.Publish(v, MakeStreamVersion(4, v));
  for (uint64_t v = 1; v <= 3; ++v) pub_b.Publish(v, MakeStreamVersion(5, v));
  auto sub = FakeSubscriberStack(&current);
  a.deliveries = {1};
  ASSERT_TRUE(Receive(*sub, 1).ok());
  ASSERT_TRUE(Receive(*sub, 2).ok());  // A's version 2, a delta on 1
  // B's version 3 is a delta against B's version 2: same number, other bytes.
  current = &b;
  auto wrong = Receive(*sub, 3, absl::Milliseconds(200));
  EXPECT_TRUE(absl::IsDeadlineExceeded(wrong.status())) << wrong.status();
  // Still A's version 2.
  current = &a;
  a.deliveries = {2};
  auto kept = Receive(*sub, 0);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(absl::StrContains(kept->source, "delivered again")) << kept->source;
  ExpectBytes(*kept, MakeStreamVersion(4, 2));
  // B's next keyframe is taken.
  current = &b;
  pub_b.Publish(4, MakeStreamVersion(5, 4));
  pub_b.Publish(5, MakeStreamVersion(5, 5));
  auto five = Receive(*sub, 3);
  ASSERT_TRUE(five.ok()) << five.status();
  ExpectBytes(*five, MakeStreamVersion(5, 5));
}

TEST(DeltaLayerTest, CorruptBlobIsDataLossAndTheBaseIsKept) {
  FakeChannel channel;
  FakeChannel* current = &channel;
  FakeStack pub(&channel);
  for (uint64_t v = 1; v <= 2; ++v) pub.Publish(v, MakeStreamVersion(6, v));
  auto sub = FakeSubscriberStack(&current);
  channel.deliveries = {1};
  ASSERT_TRUE(Receive(*sub, 1).ok());
  std::vector<std::byte>& blob = channel.versions[2].second;
  blob[blob.size() / 2] ^= std::byte{0x20};
  auto bad = Receive(*sub, 2);
  EXPECT_TRUE(absl::IsDataLoss(bad.status())) << bad.status();
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "fails verification")) << bad.status();
  blob[blob.size() / 2] ^= std::byte{0x20};
  auto good = Receive(*sub, 2);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE(absl::StrContains(good->source, "delta 2 on this subscriber's copy of version 1"))
      << good->source;
  ExpectBytes(*good, MakeStreamVersion(6, 2));
}

TEST(DeltaLayerTest, MalformedRecordsAreDataLoss) {
  FakeChannel channel;
  FakeChannel* current = &channel;
  FakeStack pub(&channel);
  pub.Publish(1, MakeStreamVersion(7, 1));
  auto sub = FakeSubscriberStack(&current);
  const Manifest good = channel.versions[1].first;
  for (const std::string& record :
       {std::string("not json"), std::string("{}"),
        std::string(R"({"format":"weightbus.delta/1","kind":"delta","keyframe":0,)"
                    R"("encoded_bytes":1,"base":5,"base_fingerprint":"00","xxh3":[]})"),
        std::string(R"({"format":"weightbus.delta/9"})")}) {
    channel.versions[1].first.metadata[std::string(kRecordKey)] = record;
    auto r = Receive(*sub, 1);
    EXPECT_TRUE(absl::IsDataLoss(r.status())) << record << ": " << r.status();
  }
  channel.versions[1].first = good;
  channel.versions[1].first.tensors[0].nbytes += 1;
  EXPECT_TRUE(absl::IsDataLoss(Receive(*sub, 1).status()));
}

namespace record_integers {

// Issue 10, item 16: integer fields of a delta record holding a float, a fraction, a value
// beyond 64 bits, a negative value or a string are DataLoss naming the field (nlohmann's
// get<uint64_t> converted them with undefined behaviour or truncated them).
Manifest InnerWithRecord(const nlohmann::ordered_json& record, uint64_t version = 9) {
  Manifest m;
  m.version = version;
  m.metadata[std::string(kRecordKey)] = record.dump();
  m.tensors.push_back(TensorInfo{std::string(kBlobName), DType::kU8, {100}, std::nullopt, 100, 0});
  return m;
}

nlohmann::ordered_json GoodDelta() {
  return nlohmann::ordered_json::parse(
      R"({"format":"weightbus.delta/1","kind":"delta","base":8,)"
      R"("base_fingerprint":"0123456789abcdef","keyframe":5,"encoded_bytes":100,"xxh3":[]})");
}

nlohmann::ordered_json GoodKeyframe() {
  return nlohmann::ordered_json::parse(
      R"({"format":"weightbus.delta/1","kind":"keyframe","keyframe":9,"encoded_bytes":100,)"
      R"("tensors":[{"name":"w","dtype":"BF16","shape":[2,3],"nbytes":12,)"
      R"("xxh3":"0123456789abcdef"}]})");
}

TEST(DeltaRecordTest, IntegerFieldsRefuseFloatsFractionsOutOfRangeAndStrings) {
  ASSERT_TRUE(ParseRecord(InnerWithRecord(GoodDelta()), "src").ok());
  ASSERT_TRUE(ParseRecord(InnerWithRecord(GoodKeyframe()), "src").ok());
  const std::vector<std::string> values = {"1.5",   "1e30", "-1", "18446744073709551616",
                                           "\"7\"", "2.0"};
  for (const auto& [good, field] : std::vector<std::pair<nlohmann::ordered_json, std::string>>{
           {GoodDelta(), "base"},
           {GoodDelta(), "keyframe"},
           {GoodDelta(), "encoded_bytes"},
           {GoodKeyframe(), "keyframe"},
           {GoodKeyframe(), "encoded_bytes"}}) {
    for (const std::string& value : values) {
      SCOPED_TRACE(
          absl::StrFormat("%s record, %s = %s", good["kind"].get<std::string>(), field, value));
      nlohmann::ordered_json r = good;
      r[field] = nlohmann::ordered_json::parse(value);
      absl::StatusOr<Record> parsed = ParseRecord(InnerWithRecord(r), "src");
      EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss) << parsed.status();
      if (parsed.ok()) continue;
      EXPECT_NE(parsed.status().message().find(absl::StrFormat("field \"%s\"", field)),
                std::string::npos)
          << parsed.status();
    }
  }
  // The tensors of a keyframe record are a manifest's: the same rules, naming the field.
  nlohmann::ordered_json k = GoodKeyframe();
  k["tensors"][0]["nbytes"] = 12.5;
  absl::StatusOr<Record> parsed = ParseRecord(InnerWithRecord(k), "src");
  ASSERT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss) << parsed.status();
  EXPECT_NE(parsed.status().message().find(".tensors[0].nbytes"), std::string::npos)
      << parsed.status();
}

}  // namespace record_integers
}  // namespace
}  // namespace weightbus::internal::delta

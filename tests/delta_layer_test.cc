// SPDX-License-Identifier: Apache-2.0
// The delta layer seen from the plugin interface (core/transport.h): which path a version takes
// (keyframe, chain, delta on the base, duplicate), and the cases a filesystem channel cannot
// produce, driven through mem:// (tests/mem_transport.h), which delivers versions in any order,
// may lack OpenVersion and corrupts bytes or records on request: out-of-order deltas, missed
// versions, wrong bases, corrupt blobs, malformed records.
#include <gmock/gmock.h>
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
#include "mem_transport.h"
#include "nlohmann/json.hpp"
#include "test_model.h"
#include "test_support.h"
#include "transport_stack.h"
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

// Does what the core does with an IncomingVersion: fetch, verify every checksum, accept.
absl::StatusOr<testing::Fetched> Receive(TransportSubscriber& sub, uint64_t min_version,
                                         absl::Duration timeout = kTimeout) {
  WB_ASSIGN_OR_RETURN(std::unique_ptr<IncomingVersion> incoming,
                      sub.WaitForVersion(min_version, absl::Now() + timeout));
  return testing::FetchAndVerify(*incoming, timeout);
}

void ExpectBytes(const testing::Fetched& r, const std::vector<OwnedTensor>& expected) {
  ASSERT_EQ(r.tensors.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(r.tensors[i] == expected[i].bytes) << expected[i].name;
  }
}

// ---------------------------------------------------------------------------------------------
// Over a real disk channel: which path each version takes.

TEST(DeltaLayerTest, LateJoinerReplaysTheNewestKeyframeThenTakesDeltas) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ScratchDir dir;
  const std::string uri = "delta+disk://" + dir.path() + "/ch?fsync=false&keyframe_interval=20";
  auto pub = Publisher::Open(uri);
  ASSERT_TRUE(pub.ok());
  for (uint64_t v = 1; v <= 50; ++v) {
    auto version = MakeStreamVersion(1, v);
    ASSERT_TRUE((*pub)->Publish(v, testing::Views(version), {}, kTimeout).ok());
  }
  auto opened = testing::OpenTransportSubscriber(uri);
  ASSERT_TRUE(opened.ok()) << opened.status();
  auto& sub = *opened;
  auto first = Receive(*sub, 0);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->manifest.version, 50u);
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
  EXPECT_EQ(again->manifest.version, 56u);
  EXPECT_TRUE(absl::StrContains(again->source, "delivered again, not applied again"))
      << again->source;
  ExpectBytes(*again, MakeStreamVersion(1, 56));
}

// ---------------------------------------------------------------------------------------------
// Over mem:// (tests/mem_transport.h): scripted delivery, a transport without OpenVersion,
// corrupted blobs and edited records.

// Transport settings of a mem:// channel without OpenVersion and ListVersions.
constexpr char kCannotOpen[] = "open_version=false&list_versions=false";

// A delta publisher over mem:///NAME, publishing whole versions through the plugin interface.
class MemStack {
 public:
  explicit MemStack(const std::string& name, const std::string& query = "") {
    auto pub = testing::OpenTransportPublisher("delta+mem:///" + name +
                                               (query.empty() ? "" : "?" + query));
    EXPECT_TRUE(pub.ok()) << pub.status();
    pub_ = *std::move(pub);
  }
  void Publish(uint64_t version, const std::vector<OwnedTensor>& tensors) {
    ASSERT_TRUE(testing::PublishSealed(*pub_, testing::ManifestOf(version, tensors), tensors).ok());
  }

 private:
  std::unique_ptr<TransportPublisher> pub_;
};

// A delta subscriber of mem:///NAME.
std::unique_ptr<TransportSubscriber> MemSubscriber(const std::string& name,
                                                   const std::string& query = "") {
  auto sub =
      testing::OpenTransportSubscriber("delta+mem:///" + name + (query.empty() ? "" : "?" + query));
  EXPECT_TRUE(sub.ok()) << sub.status();
  return *std::move(sub);
}

TEST(DeltaLayerTest, OutOfOrderVersionsAreRefusedAndNothingIsAppliedTwice) {
  testing::mem::MemChannel channel("out-of-order");
  MemStack pub("out-of-order");
  for (uint64_t v = 1; v <= 3; ++v) pub.Publish(v, MakeStreamVersion(2, v));
  auto sub = MemSubscriber("out-of-order");
  // Version 2 first: a delta, rebuilt from keyframe 1.
  channel.DeliverNext({2});
  auto two = Receive(*sub, 0);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_TRUE(absl::StrContains(two->source, "keyframe 1 + 1 deltas up to 2")) << two->source;
  ExpectBytes(*two, MakeStreamVersion(2, 2));
  // Then version 1, older than what the subscriber holds: refused.
  channel.DeliverNext({1});
  auto one = Receive(*sub, 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(one.status())) << one.status();
  EXPECT_TRUE(absl::StrContains(one.status().message(), "out of order")) << one.status();
  // Version 2 again: served from the subscriber's copy, not applied again.
  channel.DeliverNext({2});
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
  testing::mem::MemChannel channel("missed");
  MemStack pub("missed", "keyframe_interval=4");
  for (uint64_t v = 1; v <= 4; ++v) pub.Publish(v, MakeStreamVersion(3, v));
  auto sub = MemSubscriber("missed", kCannotOpen);
  channel.DeliverNext({1});
  ASSERT_TRUE(Receive(*sub, 1).ok());
  // Version 3 arrives without 2: it cannot be applied, 4 neither, and no keyframe follows yet.
  channel.DeliverNext({3});
  auto missed = Receive(*sub, 2, absl::Milliseconds(200));
  EXPECT_TRUE(absl::IsDeadlineExceeded(missed.status())) << missed.status();
  EXPECT_TRUE(absl::StrContains(missed.status().message(), "waiting for a keyframe"))
      << missed.status();
  // The keyframe 5 brings the subscriber back.
  pub.Publish(5, MakeStreamVersion(3, 5));
  auto five = Receive(*sub, 2);
  ASSERT_TRUE(five.ok()) << five.status();
  EXPECT_EQ(five->manifest.version, 5u);
  EXPECT_TRUE(absl::StrContains(five->source, "keyframe 5")) << five->source;
  ExpectBytes(*five, MakeStreamVersion(3, 5));
}

TEST(DeltaLayerTest, ADeltaAgainstAnotherBaseWithTheSameNumberIsNotApplied) {
  // Two channels with versions of the same numbers; the subscriber's channel "view" reads one
  // or the other.
  testing::mem::MemChannel a("base-a"), view("view");
  MemStack pub_a("base-a"), pub_b("base-b", "keyframe_interval=4");
  for (uint64_t v = 1; v <= 2; ++v) pub_a.Publish(v, MakeStreamVersion(4, v));
  for (uint64_t v = 1; v <= 3; ++v) pub_b.Publish(v, MakeStreamVersion(5, v));
  view.ReadFrom("base-a");
  auto sub = MemSubscriber("view", kCannotOpen);
  a.DeliverNext({1});
  ASSERT_TRUE(Receive(*sub, 1).ok());
  ASSERT_TRUE(Receive(*sub, 2).ok());  // A's version 2, a delta on 1
  // B's version 3 is a delta against B's version 2: same number, other bytes.
  view.ReadFrom("base-b");
  auto wrong = Receive(*sub, 3, absl::Milliseconds(200));
  EXPECT_TRUE(absl::IsDeadlineExceeded(wrong.status())) << wrong.status();
  // Still A's version 2.
  view.ReadFrom("base-a");
  a.DeliverNext({2});
  auto kept = Receive(*sub, 0);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(absl::StrContains(kept->source, "delivered again")) << kept->source;
  ExpectBytes(*kept, MakeStreamVersion(4, 2));
  // B's next keyframe is taken.
  view.ReadFrom("base-b");
  pub_b.Publish(4, MakeStreamVersion(5, 4));
  pub_b.Publish(5, MakeStreamVersion(5, 5));
  auto five = Receive(*sub, 3);
  ASSERT_TRUE(five.ok()) << five.status();
  ExpectBytes(*five, MakeStreamVersion(5, 5));
}

TEST(DeltaLayerTest, CorruptBlobIsDataLossAndTheBaseIsKept) {
  testing::mem::MemChannel channel("corrupt-blob");
  MemStack pub("corrupt-blob");
  for (uint64_t v = 1; v <= 2; ++v) pub.Publish(v, MakeStreamVersion(6, v));
  auto sub = MemSubscriber("corrupt-blob");
  channel.DeliverNext({1});
  ASSERT_TRUE(Receive(*sub, 1).ok());
  const uint64_t middle = channel.ManifestOf(2).tensors[0].nbytes / 2;
  channel.CorruptByte(2, 0, middle, std::byte{0x20});
  auto bad = Receive(*sub, 2);
  EXPECT_TRUE(absl::IsDataLoss(bad.status())) << bad.status();
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "fails verification")) << bad.status();
  channel.CorruptByte(2, 0, middle, std::byte{0x20});  // undone
  auto good = Receive(*sub, 2);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE(absl::StrContains(good->source, "delta 2 on this subscriber's copy of version 1"))
      << good->source;
  ExpectBytes(*good, MakeStreamVersion(6, 2));
}

// A publish the transport beneath refuses leaves the layer's base where it was: the next
// version is encoded against the last one that was published, and subscribers rebuild it.
TEST(DeltaLayerTest, APublishTheTransportRefusesDoesNotMoveTheBase) {
  testing::mem::MemChannel channel("refused");
  auto pub = testing::OpenTransportPublisher("delta+mem:///refused");
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = MemSubscriber("refused");
  auto publish = [&](uint64_t v) {
    const auto tensors = MakeStreamVersion(8, v);
    return testing::PublishSealed(**pub, testing::ManifestOf(v, tensors), tensors);
  };
  ASSERT_TRUE(publish(1).ok());
  ASSERT_TRUE(Receive(*sub, 1).ok());
  channel.FailNextPublish(absl::UnavailableError("the transport is full"));
  const absl::Status refused = publish(2);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_EQ(channel.Versions(), std::vector<uint64_t>{1});
  ASSERT_TRUE(publish(3).ok());
  auto three = Receive(*sub, 2);
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_TRUE(absl::StrContains(three->source, "delta 3 on this subscriber's copy of version 1"))
      << three->source;
  ExpectBytes(*three, MakeStreamVersion(8, 3));
}

TEST(DeltaLayerTest, MalformedRecordsAreDataLoss) {
  testing::mem::MemChannel channel("malformed");
  MemStack pub("malformed");
  pub.Publish(1, MakeStreamVersion(7, 1));
  auto sub = MemSubscriber("malformed");
  const Manifest good = channel.ManifestOf(1);
  for (const std::string& record :
       {std::string("not json"), std::string("{}"),
        std::string(R"({"format":"weightbus.delta/1","kind":"delta","keyframe":0,)"
                    R"("encoded_bytes":1,"base":5,"base_fingerprint":"00","xxh3":[]})"),
        std::string(R"({"format":"weightbus.delta/9"})")}) {
    channel.EditManifest(1, [&](Manifest& m) { m.metadata[std::string(kRecordKey)] = record; });
    auto r = Receive(*sub, 1);
    EXPECT_TRUE(absl::IsDataLoss(r.status())) << record << ": " << r.status();
  }
  channel.EditManifest(1, [&](Manifest& m) {
    m = good;
    m.tensors[0].nbytes += 1;
  });
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

// Receives version >= v through the public API and checks it byte for byte.
void ExpectReceived(Subscriber& sub, uint64_t v, const std::vector<OwnedTensor>& expected,
                    std::string* encoding) {
  auto u = sub.WaitForVersion(v, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_EQ((*u)->version(), v);
  ASSERT_EQ((*u)->tensors().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_EQ((*u)->manifest().tensors[i].xxh3,
              Xxh3(expected[i].bytes.data(), expected[i].bytes.size()));
    if (!expected[i].bytes.empty()) {
      ASSERT_EQ(
          std::memcmp((*u)->tensors()[i].data, expected[i].bytes.data(), expected[i].bytes.size()),
          0)
          << expected[i].name;
    }
  }
  *encoding = (*u)->stats().encoding;
}

// Issue 16: the layer never makes a sync slower than the transport beneath. Versions of 16 MiB
// whose every byte changes (random tensors) gain nothing from encoding, and mem:// moves them
// by copying, far faster than they encode: once the rates are measured (a keyframe, a delta
// attempt) they go plainly, and the stats and the record say which choice and why. Every
// kProbe-th plain version a delta is tried again: with few changes it pays and goes as a delta
// on the plain version. Subscribers following and late joiners receive every version
// bit-exactly. (The choice follows measured rates; the margins here are 10x and more.)
constexpr uint64_t kPlainBytes = uint64_t{16} << 20;

// Publishes random versions of kPlainBytes (every byte changes) from version *v + 1 on until
// one goes plainly by the measured rates (at most 8), receiving each on `sub`; returns whether
// one did. `current`
// ends as the last version's tensors.
bool PublishUntilPlain(Publisher& pub, Subscriber& sub, uint64_t seed, uint64_t* v,
                       std::vector<OwnedTensor>* current) {
  for (int k = 0; k < 8; ++k) {
    *current = testing::MakeVersion(seed, ++*v, kPlainBytes);
    EXPECT_TRUE(pub.Publish(*v, testing::Views(*current), {}, kTimeout).ok());
    const PublishStats st = pub.last_stats();
    // Before anything is measured, a whole version goes plainly (what the transport costs).
    if (*v == 1) {
      EXPECT_EQ(st.encoding,
                "plain: sent plainly: a whole version before this publisher has measured the "
                "transport beneath (plainly it costs what that transport costs); a keyframe was "
                "due: the channel holds no version yet");
    }
    std::string got;
    ExpectReceived(sub, *v, *current, &got);
    if (absl::StartsWith(st.encoding, "plain: sent plainly: encoding and decoding a ")) {
      EXPECT_EQ(st.wire_bytes, st.bytes);
      EXPECT_EQ(got, absl::StrFormat("plain version %d", *v));
      return true;
    }
  }
  return false;
}

TEST(DeltaLayerTest, VersionsThatDoNotPayForTheirEncodingGoPlainlyAndSaySo) {
  // A link of 50 MB/s (mem:// link_rate): random bytes never pay for their encoding on any link,
  // and a delta of a few changes pays on this one however slow this machine's codec runs (under
  // ThreadSanitizer it runs many times slower: on memcpy's speed the choice then stays plain).
  const std::string uri = "delta+mem:///plain-choice?link_rate=50MB";
  auto pub = Publisher::Open(uri);
  auto sub = Subscriber::Open(uri);
  ASSERT_TRUE(pub.ok() && sub.ok()) << pub.status() << sub.status();
  constexpr uint64_t kBytes = kPlainBytes;
  std::vector<OwnedTensor> current;
  uint64_t v = 0;
  std::string got;
  ASSERT_TRUE(PublishUntilPlain(**pub, **sub, 7, &v, &current))
      << "no version of random bytes went plainly";
  {
    auto late = Subscriber::Open(uri);
    ASSERT_TRUE(late.ok());
    ExpectReceived(**late, v, current, &got);
    EXPECT_EQ(got, absl::StrFormat("plain version %d", v));
  }
  // Now a few elements change per version: the probe encodes a delta, which pays.
  std::optional<uint64_t> delta;
  for (int k = 0; k <= 20 && !delta; ++k) {
    current[0].bytes[static_cast<size_t>(k) * 4099] ^= std::byte{0x10};
    ASSERT_TRUE((*pub)->Publish(++v, testing::Views(current), {}, kTimeout).ok());
    if (absl::StartsWith((*pub)->last_stats().encoding, "delta: delta against version ")) {
      delta = v;
    }
    ExpectReceived(**sub, v, current, &got);
  }
  ASSERT_TRUE(delta.has_value()) << "no delta within 20 versions of few changes";
  EXPECT_EQ(got, absl::StrFormat("delta %d on this subscriber's copy of version %d", v, v - 1));
  auto late = Subscriber::Open(uri);  // replays the plain base and the delta
  ASSERT_TRUE(late.ok());
  ExpectReceived(**late, v, current, &got);
  EXPECT_THAT(got, ::testing::HasSubstr(absl::StrFormat("+ 1 deltas up to %d", v)));

  // delta_send_plain=false: always encoded.
  auto encoded = Publisher::Open("delta+mem:///plain-choice-off?delta_send_plain=false");
  ASSERT_TRUE(encoded.ok());
  for (uint64_t w = 1; w <= 4; ++w) {
    auto t = testing::MakeVersion(8, w, kBytes);
    ASSERT_TRUE((*encoded)->Publish(w, testing::Views(t), {}, kTimeout).ok());
    EXPECT_THAT((*encoded)->last_stats().encoding, ::testing::StartsWith("keyframe: "));
  }
}

// Issue 16: the plain-or-delta choice is made before the first delta is sent, from the first
// version's transfer (sent plainly) and a sample of the delta's chunks encoded and decoded by
// the publisher. On a fast path (mem://, memcpy) versions whose every byte changes never go as
// a delta: version 2 is already plain, by the sample. On a slow one (mem:// with link_rate
// 20MB: 0.4 s per 8 MiB version) versions of a few changed bytes go as deltas from version 2
// on, and the stats say by which rates. (The margins are 100x and more.)
TEST(DeltaLayerTest, ThePlainOrDeltaChoiceIsMadeBeforeTheFirstDelta) {
  constexpr uint64_t kBytes = uint64_t{8} << 20;
  {
    auto pub = Publisher::Open("delta+mem:///choice-fast");
    auto sub = Subscriber::Open("delta+mem:///choice-fast");
    ASSERT_TRUE(pub.ok() && sub.ok()) << pub.status() << sub.status();
    for (uint64_t v = 1; v <= 3; ++v) {
      const std::vector<OwnedTensor> t = testing::MakeVersion(11, v, kBytes);
      ASSERT_TRUE((*pub)->Publish(v, testing::Views(t), {}, kTimeout).ok());
      const PublishStats st = (*pub)->last_stats();
      EXPECT_THAT(st.encoding, ::testing::StartsWith("plain: sent plainly: ")) << v;
      if (v == 2) {
        EXPECT_THAT(st.encoding, ::testing::HasSubstr("decoding"));
        EXPECT_THAT(st.encoding, ::testing::HasSubstr("measured through the transport beneath"));
        EXPECT_THAT(st.encoding, ::testing::EndsWith("(sampled)"));
      }
      std::string got;
      ExpectReceived(**sub, v, t, &got);
    }
  }
  auto pub = Publisher::Open("delta+mem:///choice-slow?link_rate=20MB");
  auto sub = Subscriber::Open("delta+mem:///choice-slow?link_rate=20MB");
  ASSERT_TRUE(pub.ok() && sub.ok()) << pub.status() << sub.status();
  std::vector<OwnedTensor> current = testing::MakeVersion(12, 1, kBytes);
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) current[0].bytes[v * 4099] ^= std::byte{0x10};
    ASSERT_TRUE((*pub)->Publish(v, testing::Views(current), {}, kTimeout).ok());
    const PublishStats st = (*pub)->last_stats();
    if (v == 1) {
      EXPECT_THAT(st.encoding, ::testing::StartsWith("plain: sent plainly: a whole version"));
    } else {
      EXPECT_THAT(st.encoding, ::testing::StartsWith(absl::StrFormat(
                                   "delta: delta against version %d; encoded, by the measured "
                                   "rates: encoding ",
                                   v - 1)))
          << v;
      EXPECT_LT(st.wire_bytes, kBytes / 100) << v;
    }
    std::string got;
    ExpectReceived(**sub, v, current, &got);
  }
}

// A plain version damaged on the channel is checked, like a delta, before the publisher sends a
// delta against it: the version that would have been that delta goes whole (a keyframe, or
// plainly) saying why, and a subscriber that could not receive a damaged version is caught up
// by it.
TEST(DeltaLayerTest, DamagedPlainBaseIsCaughtBeforeADeltaAgainstIt) {
  const std::string name = "plain-damaged";
  auto pub = Publisher::Open("delta+mem:///" + name);
  auto sub = Subscriber::Open("delta+mem:///" + name);
  ASSERT_TRUE(pub.ok() && sub.ok());
  testing::mem::MemChannel channel(name);
  std::vector<OwnedTensor> current;
  uint64_t v = 0;
  ASSERT_TRUE(PublishUntilPlain(**pub, **sub, 9, &v, &current));
  channel.CorruptByte(v, 0, 100);  // damaged on the channel after the subscriber had it
  // Few changes from now on: versions stay plain until the probe tries a delta against the
  // newest one, which is damaged on the channel each time (as the first one is).
  std::string encoding;
  for (int k = 0; k <= 20; ++k) {
    current[0].bytes[static_cast<size_t>(k) * 4099 + 7] ^= std::byte{0x10};
    ASSERT_TRUE((*pub)->Publish(++v, testing::Views(current), {}, kTimeout).ok());
    encoding = (*pub)->last_stats().encoding;
    if (absl::StrContains(encoding, "cannot be read back intact")) break;
    ASSERT_THAT(encoding, ::testing::StartsWith("plain: "));
    channel.CorruptByte(v, 0, 100);
    if (k == 0) {
      auto refused = (*sub)->WaitForVersion(v, absl::Seconds(5));
      ASSERT_TRUE(absl::IsDataLoss(refused.status())) << refused.status();
      ASSERT_EQ((*sub)->current_version(), std::optional<uint64_t>(v - 1));
    }
  }
  // A keyframe was due, sent as a keyframe or plainly (random bytes: plainly, as the rates
  // say), never as a delta against the damaged version.
  EXPECT_THAT(encoding, ::testing::HasSubstr(absl::StrFormat(
                            "the channel's copy of version %d, the base of a delta, cannot be "
                            "read back intact",
                            v - 1)));
  EXPECT_THAT(encoding, ::testing::HasSubstr("fails verification"));
  EXPECT_FALSE(absl::StartsWith(encoding, "delta: ")) << encoding;
  std::string got;
  ExpectReceived(**sub, v, current, &got);
}

}  // namespace
}  // namespace weightbus::internal::delta

// SPDX-License-Identifier: Apache-2.0
// Shared-secret channels (issue 17, docs/SECURITY.md) on disk:// and delta+disk://: where the
// secret may come from (secret_file with mode 0600, secret_env; never a URI or Options entry),
// and the manifest MAC: a process with write access to the channel directory but not the key
// (a publisher process with another secret, or none, and a manifest edited by hand) cannot
// publish a version that subscribers accept; subscribers with the secret receive the real
// publisher's versions bit-exact. The ucx:// handshake: ucx_auth_test.cc.
#include <sys/stat.h>

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "core/secret.h"
#include "expect_tensors.h"
#include "test_model.h"
#include "test_support.h"
#include "transport_stack.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::testing::HasSubstr;
using ::weightbus::testing::Child;
using ::weightbus::testing::ExitCode;
using ::weightbus::testing::ExpectSameTensors;
using ::weightbus::testing::MakeVersion;
using ::weightbus::testing::ScratchDir;
using ::weightbus::testing::Views;

constexpr absl::Duration kTimeout = absl::Seconds(30);

std::string Peer() { return testing::BinaryPath("tests/wb_test_peer"); }

// Writes `secret` to `path` with `mode`.
void WriteSecret(const std::string& path, const std::string& secret, mode_t mode = 0600) {
  testing::WriteFileOrDie(path, secret);
  ASSERT_EQ(::chmod(path.c_str(), mode), 0);
}

class SecretTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
      GTEST_SKIP() << why;
    }
    WriteSecret(key_, "the channel's real secret, 41 bytes long\n");
    WriteSecret(other_key_, "another secret that is long enough");
  }
  std::string Uri() const { return "disk://" + dir_.path() + "/channel"; }
  Options With(const std::string& key) const { return {{"secret_file", key}}; }
  // A wb_test_peer process publishes `version` to the channel with `flags` and exits 0.
  void PublishFromAnotherProcess(uint64_t version, std::vector<std::string> flags) {
    std::vector<std::string> argv = {
        Peer(), "publish", Uri(), "--start", std::to_string(version), "--versions", "1"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const std::string log = dir_ / absl::StrFormat("publisher%d.log", version);
    auto child = Child::Start(argv, {}, log);
    ASSERT_TRUE(child.ok()) << child.status();
    auto exited = child->Wait(kTimeout);
    ASSERT_TRUE(exited.ok());
    ASSERT_EQ(ExitCode(*exited), 0) << testing::ReadFileOrDie(log);
  }

  ScratchDir dir_;
  const std::string key_ = dir_ / "key";
  const std::string other_key_ = dir_ / "other_key";
};

TEST_F(SecretTest, TheSecretIsRefusedInAUriOrOptions) {
  auto in_uri = Publisher::Open(Uri() + "?secret=hunter2hunter2hunter2");
  ASSERT_EQ(in_uri.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(in_uri.status().message(),
              HasSubstr("setting \"secret\" in the URI query is refused: a channel's secret is "
                        "never given in a URI or on a command line"));
  auto in_options = Subscriber::Open(Uri(), {{"secret", "hunter2hunter2hunter2"}});
  ASSERT_EQ(in_options.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(in_options.status().message(), HasSubstr("setting \"secret\" in options is refused"));
}

TEST_F(SecretTest, ASecretFileOthersCanReadIsRefused) {
  for (const mode_t mode : {0644, 0640, 0604, 0620}) {
    WriteSecret(key_, "the channel's real secret, 41 bytes long\n", mode);
    auto pub = Publisher::Open(Uri(), With(key_));
    ASSERT_EQ(pub.status().code(), absl::StatusCode::kPermissionDenied) << mode;
    EXPECT_THAT(pub.status().message(),
                HasSubstr(absl::StrFormat("secret_file \"%s\" has mode %04o: group or others may "
                                          "read or write it",
                                          key_, mode)));
  }
}

TEST_F(SecretTest, MalformedSecretSettingsAreClearErrors) {
  auto both = Publisher::Open(Uri(), {{"secret_file", key_}, {"secret_env", "WB_TEST_SECRET"}});
  ASSERT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(both.status().message(), HasSubstr("are both set; set one"));

  auto missing = Publisher::Open(Uri(), With(dir_ / "no_such_key"));
  ASSERT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("no_such_key"));

  WriteSecret(key_, "short\n");
  auto short_secret = Publisher::Open(Uri(), With(key_));
  ASSERT_EQ(short_secret.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_secret.status().message(), HasSubstr("is 5 bytes; expected 16 to 4096 bytes"));
  EXPECT_THAT(short_secret.status().message(), ::testing::Not(HasSubstr("short")));

  const testing::ScopedEnv unset("WB_TEST_SECRET_UNSET", std::nullopt);
  auto unset_env = Subscriber::Open(Uri(), {{"secret_env", "WB_TEST_SECRET_UNSET"}});
  ASSERT_EQ(unset_env.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unset_env.status().message(),
              HasSubstr("secret_env names the environment variable WB_TEST_SECRET_UNSET"));
}

// The audit's disk case: anyone who can write the channel directory could publish. With a
// secret, versions from a process without the key are refused, naming the channel and the
// version, and the subscriber keeps the version it holds; the real publisher goes on.
TEST_F(SecretTest, OnDiskAProcessWithoutTheKeyCannotPublishAVersionSubscribersAccept) {
  auto pub = Publisher::Open(Uri(), With(key_));
  ASSERT_TRUE(pub.ok()) << pub.status();
  const auto v1 = MakeVersion(5, 1, 1 << 16);
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {{"step", "100"}}, kTimeout).ok());

  // The same secret from an environment variable: the same key.
  const testing::ScopedEnv env("WB_TEST_CHANNEL_SECRET",
                               "the channel's real secret, 41 bytes long");
  auto sub = Subscriber::Open(Uri(), {{"secret_env", "WB_TEST_CHANNEL_SECRET"}});
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto u1 = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u1.ok()) << u1.status();
  ExpectSameTensors(**u1, v1);
  // The MAC is checked and removed: the caller's metadata is what was published.
  EXPECT_EQ((*u1)->manifest().metadata, (Metadata{{"step", "100"}}));

  // A publisher process with another secret writes version 2 into the directory (once the real
  // publisher has let go of the channel's lock: a forger need not respect it anyway).
  pub->reset();
  PublishFromAnotherProcess(2, {"--set", "secret_file=" + other_key_});
  auto u2 = (*sub)->WaitForVersion(2, kTimeout);
  ASSERT_EQ(u2.status().code(), absl::StatusCode::kPermissionDenied) << u2.status();
  EXPECT_THAT(u2.status().message(), HasSubstr(Uri() + ": version 2 (publisher session "));
  EXPECT_THAT(u2.status().message(),
              HasSubstr("has a wrong MAC: it was not published with this channel's shared "
                        "secret, or its manifest was altered; refusing it; version 1 stays "
                        "current"));
  EXPECT_EQ((*sub)->current_version(), 1u);

  // A publisher process without any secret writes version 3.
  PublishFromAnotherProcess(3, {});
  auto u3 = (*sub)->WaitForVersion(2, kTimeout);
  ASSERT_EQ(u3.status().code(), absl::StatusCode::kPermissionDenied) << u3.status();
  EXPECT_THAT(u3.status().message(), HasSubstr(": version 3 (publisher session "));
  EXPECT_THAT(u3.status().message(),
              HasSubstr("carries no MAC, but this subscriber requires the channel's shared "
                        "secret: refusing it as unauthenticated"));
  EXPECT_EQ((*sub)->current_version(), 1u);

  // The real publisher continues above them; its version is accepted bit-exact.
  pub = Publisher::Open(Uri(), With(key_));
  ASSERT_TRUE(pub.ok()) << pub.status();
  const auto v4 = MakeVersion(5, 4, 1 << 16);
  ASSERT_TRUE((*pub)->Publish(4, Views(v4), {}, kTimeout).ok());
  auto u4 = (*sub)->WaitForVersion(2, kTimeout);
  ASSERT_TRUE(u4.ok()) << u4.status();
  ASSERT_EQ((*u4)->version(), 4u);
  ExpectSameTensors(**u4, v4);

  // A subscriber without the secret is told to configure it.
  auto stranger = Subscriber::Open(Uri());
  ASSERT_TRUE(stranger.ok()) << stranger.status();
  auto refused = (*stranger)->WaitForVersion(4, kTimeout);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr(": version 4 (publisher session "));
  EXPECT_THAT(refused.status().message(),
              HasSubstr("is authenticated with a shared secret this subscriber does not have: "
                        "configure the channel's secret with secret_file or secret_env"));
}

// A manifest edited in place (the metadata, then a checksum) no longer matches its MAC.
TEST_F(SecretTest, OnDiskAManifestEditedByHandIsRefused) {
  auto pub = Publisher::Open(Uri(), With(key_));
  ASSERT_TRUE(pub.ok()) << pub.status();
  const auto v1 = MakeVersion(6, 1, 1 << 16);
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {{"step", "100"}}, kTimeout).ok());
  const std::string path = testing::DiskVersionDir(dir_, 1) + "/weightbus.manifest.json";
  const std::string original = testing::ReadFileOrDie(path);
  ASSERT_THAT(original, HasSubstr("\"step\": \"100\""));
  ASSERT_THAT(original, HasSubstr("\"weightbus.mac\""));
  testing::WriteFileOrDie(
      path, absl::StrReplaceAll(original, {{"\"step\": \"100\"", "\"step\": \"999\""}}));
  auto sub = Subscriber::Open(Uri(), With(key_));
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto u = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_EQ(u.status().code(), absl::StatusCode::kPermissionDenied) << u.status();
  EXPECT_THAT(u.status().message(), HasSubstr(": version 1 (publisher session "));
  EXPECT_THAT(u.status().message(), HasSubstr("has a wrong MAC"));
  EXPECT_THAT(u.status().message(), HasSubstr("version none stays current"));
  EXPECT_FALSE((*sub)->current_version().has_value());

  // Restored, the version is accepted: the refusal was the edit's doing.
  testing::WriteFileOrDie(path, original);
  auto restored = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ExpectSameTensors(**restored, v1);
}

TEST_F(SecretTest, AUserMayNotWriteTheMacMetadataKey) {
  auto pub = Publisher::Open(Uri(), With(key_));
  ASSERT_TRUE(pub.ok()) << pub.status();
  const auto v1 = MakeVersion(7, 1, 1 << 12);
  const absl::Status s = (*pub)->Publish(1, Views(v1), {{"weightbus.mac", "00"}}, kTimeout);
  ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("version 1: metadata key \"weightbus.mac\" is reserved for the manifest "
                        "MAC"));
}

// A publisher group on a channel with a secret needs a stack that authenticates group versions
// (capability authenticated_groups: disk://, tests/disk_group_test.cc GroupSecretTest, and
// ucx://, tests/ucx_group_test.cc UcxGroupSecretTest); any other stack refuses a rank at open
// rather than publish a group version without a MAC of the whole: the delta layer over disk (by
// this check) and over ucx (by the publisher_groups check, until it has groups).
TEST_F(SecretTest, AGroupWithASecretIsRefusedWhereTheStackDoesNotAuthenticateGroups) {
  Options options = With(key_);
  options["rank"] = "1";
  options["world_size"] = "2";
  auto disk = Publisher::Open(Uri(), options);
  EXPECT_TRUE(disk.ok()) << disk.status();
  if (testing::MissingTransports({"ucx"}) == "") {
    auto ucx = testing::StackCapabilitiesOf("ucx://127.0.0.1:1/channel");
    ASSERT_TRUE(ucx.ok()) << ucx.status();
    EXPECT_TRUE(ucx->authenticated_groups);
  }
  for (const std::string& uri :
       {"delta+" + Uri(), std::string("delta+ucx://127.0.0.1:1/channel")}) {
    SCOPED_TRACE(uri);
    if (testing::MissingTransports({"delta", uri.starts_with("delta+ucx") ? "ucx" : "disk"}) !=
        "") {
      continue;
    }
    auto caps = testing::StackCapabilitiesOf(uri);
    ASSERT_TRUE(caps.ok()) << caps.status();
    ASSERT_FALSE(caps->authenticated_groups);
    auto pub = Publisher::Open(uri, options);
    ASSERT_EQ(pub.status().code(), absl::StatusCode::kUnimplemented) << pub.status();
    EXPECT_THAT(pub.status().message(),
                HasSubstr(caps->publisher_groups
                              ? "a publisher group (world_size=2, rank 1) on a channel with a "
                                "shared secret needs a transport stack that authenticates group "
                                "versions, which this one does not"
                              : "world_size=2 asks for a publisher group (rank 1), which this "
                                "transport stack does not implement"));
  }
}

// The MAC is the core's: the delta layer carries it through keyframes and deltas unchanged.
TEST_F(SecretTest, DeltaOverDiskWithASecretIsBitExactAndRefusesAForger) {
  if (const std::string why = testing::MissingTransports({"delta", "disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  const std::string uri = "delta+" + Uri() + "?keyframe_interval=3";
  auto pub = Publisher::Open(uri, With(key_));
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = Subscriber::Open(uri, With(key_));
  ASSERT_TRUE(sub.ok()) << sub.status();
  for (uint64_t v = 1; v <= 5; ++v) {  // keyframes 1 and 4, deltas 2, 3 and 5
    const auto tensors = MakeVersion(8, v, 1 << 16);
    ASSERT_TRUE((*pub)->Publish(v, Views(tensors), {}, kTimeout).ok()) << v;
    auto u = (*sub)->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ASSERT_EQ((*u)->version(), v);
    ExpectSameTensors(**u, tensors);
  }
  pub->reset();
  auto forger = Publisher::Open(uri, With(other_key_));
  ASSERT_TRUE(forger.ok()) << forger.status();
  ASSERT_TRUE((*forger)->Publish(6, Views(MakeVersion(8, 6, 1 << 16)), {}, kTimeout).ok());
  auto u6 = (*sub)->WaitForVersion(6, kTimeout);
  ASSERT_EQ(u6.status().code(), absl::StatusCode::kPermissionDenied) << u6.status();
  EXPECT_THAT(u6.status().message(), HasSubstr(": version 6 (publisher session "));
  EXPECT_THAT(u6.status().message(), HasSubstr("has a wrong MAC"));
  EXPECT_EQ((*sub)->current_version(), 5u);
}

// The MAC covers what it says it covers: each field changed gives another MAC.
TEST(ManifestMacTest, CoversVersionSessionTensorsAndMetadata) {
  internal::ChannelKey key;
  key.bytes.fill(7);
  Manifest m;
  m.version = 3;
  m.publisher.session = "0123456789abcdef";
  m.tensors.push_back(TensorInfo{"w", DType::kF32, {2, 2}, std::nullopt, 16, 42});
  m.metadata = {{"step", "1"}};
  const std::string mac = internal::ManifestMac(key, m);
  EXPECT_EQ(mac.size(), 64u);
  auto changed = [&](auto edit) {
    Manifest c = m;
    edit(c);
    return internal::ManifestMac(key, c) != mac;
  };
  EXPECT_TRUE(changed([](Manifest& c) { c.version = 4; }));
  EXPECT_TRUE(changed([](Manifest& c) { c.publisher.session = "fedcba9876543210"; }));
  EXPECT_TRUE(changed([](Manifest& c) { c.tensors[0].name = "v"; }));
  EXPECT_TRUE(changed([](Manifest& c) { c.tensors[0].dtype = DType::kI32; }));
  EXPECT_TRUE(changed([](Manifest& c) { c.tensors[0].shape = {4}; }));
  EXPECT_TRUE(changed([](Manifest& c) { c.tensors[0].shard = Shard{{4, 2}, {0, 0}}; }));
  EXPECT_TRUE(changed([](Manifest& c) { c.tensors[0].xxh3 = 43; }));
  EXPECT_TRUE(changed([](Manifest& c) { c.metadata["step"] = "2"; }));
  EXPECT_TRUE(changed([](Manifest& c) { c.metadata["more"] = ""; }));
  // Not covered: the MAC's own entry, times, host and pid.
  EXPECT_FALSE(changed([&](Manifest& c) { c.metadata["weightbus.mac"] = mac; }));
  EXPECT_FALSE(changed([](Manifest& c) { c.publisher.pid = 99; }));
  internal::ChannelKey other = key;
  other.bytes[0] ^= 1;
  EXPECT_NE(internal::ManifestMac(other, m), mac);

  // A group's manifest (a rank's part, or the committed version) is MACed in its own domain
  // and also covers the rank, world_size and each part's owner.
  EXPECT_TRUE(changed([](Manifest& c) { c.group = true; }));
  m.group = true;
  m.publisher.rank = 1;
  m.publisher.world_size = 2;
  m.tensors[0].owner = 1;
  const std::string group_mac = internal::ManifestMac(key, m);
  auto group_changed = [&](auto edit) {
    Manifest c = m;
    edit(c);
    return internal::ManifestMac(key, c) != group_mac;
  };
  EXPECT_TRUE(group_changed([](Manifest& c) { c.publisher.rank = 0; }));
  EXPECT_TRUE(group_changed([](Manifest& c) { c.publisher.world_size = 4; }));
  EXPECT_TRUE(group_changed([](Manifest& c) { c.tensors[0].owner = 0; }));
  EXPECT_TRUE(group_changed([](Manifest& c) { c.tensors[0].block_bytes = 4096; }));
  EXPECT_FALSE(group_changed([](Manifest& c) { c.publisher.pid = 99; }));
}

// The committing rank's check of a part (CheckPartMac): each case's code, naming the rank.
TEST(ManifestMacTest, APartIsCheckedUnderTheCommittersKey) {
  internal::ChannelKey key;
  key.bytes.fill(7);
  Manifest part;
  part.version = 5;
  part.group = true;
  part.publisher.rank = 1;
  part.publisher.world_size = 2;
  part.publisher.session = "0123456789abcdef";
  part.tensors.push_back(TensorInfo{"w", DType::kF32, {2, 2}, std::nullopt, 16, 42, 1});
  const std::string where = "disk:///c version 5";
  // An open channel: no MAC, none expected.
  EXPECT_TRUE(internal::CheckPartMac(nullptr, part, 0, where).ok());
  const absl::Status none = internal::CheckPartMac(&key, part, 0, where);
  EXPECT_EQ(none.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(none.message(), HasSubstr("disk:///c version 5: rank 1's part (publisher session "
                                        "0123456789abcdef, pid 0 on ) carries no MAC"));
  part.metadata[std::string(internal::kMacMetadataKey)] = internal::ManifestMac(key, part);
  EXPECT_TRUE(internal::CheckPartMac(&key, part, 0, where).ok());
  const absl::Status keyless = internal::CheckPartMac(nullptr, part, 0, where);
  EXPECT_EQ(keyless.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(keyless.message(), HasSubstr("but the committing rank 0 has none"));
  internal::ChannelKey other = key;
  other.bytes[0] ^= 1;
  const absl::Status wrong = internal::CheckPartMac(&other, part, 0, where);
  EXPECT_EQ(wrong.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(wrong.message(), HasSubstr("has a wrong MAC under the key of the committing rank 0: "
                                         "ranks 1 and 0 hold different secrets"));
  // Moved to another rank's place, the part no longer verifies.
  part.publisher.rank = 0;
  EXPECT_EQ(internal::CheckPartMac(&key, part, 1, where).code(),
            absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace weightbus

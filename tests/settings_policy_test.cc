// SPDX-License-Identifier: Apache-2.0
// The rules every setting follows, checked over every table this build registers: ranges and
// units declared in the table and enforced in one place (Config::Resolve), and the policy for
// unknown names (an unknown WEIGHTBUS_* variable is a warning naming the closest setting; an
// unknown URI query or Options key is an error).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "core/config.h"
#include "core/registry.h"
#include "core/worker_pool.h"
#include "test_support.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::internal {
namespace {

using ::testing::HasSubstr;

std::vector<const SettingTable*> AllTables() {
  std::vector<const SettingTable*> tables = {&CoreSettings()};
  for (const TransportDescriptor* t : RegisteredTransports()) {
    if (t->settings != nullptr) tables.push_back(t->settings);
  }
  return tables;
}

const SettingSpec& Spec(std::string_view name) {
  for (const SettingTable* t : AllTables()) {
    for (const SettingSpec& s : t->specs) {
      if (s.name == name) return s;
    }
  }
  ADD_FAILURE() << "no setting " << name;
  static const SettingSpec none{"none", SettingType::kString, "", ""};
  return none;
}

Config::EnvLookup NoEnv() {
  return [](const char*) -> const char* { return nullptr; };
}

TEST(SettingRangesTest, EveryDeclaredBoundParsesAndHoldsItsDefault) {
  int bounded = 0;
  for (const SettingTable* table : AllTables()) {
    for (const SettingSpec& spec : table->specs) {
      SCOPED_TRACE(std::string(table->scope) + "." + std::string(spec.name));
      // ParseSettingValue checks the default against the range, and fails with Internal when
      // a bound is not a value of the type (or the type has no order).
      absl::StatusOr<Config::Value> v = ParseSettingValue(spec, spec.default_value);
      EXPECT_TRUE(v.ok()) << v.status();
      if (!spec.min.empty() || !spec.max.empty()) {
        ++bounded;
        EXPECT_TRUE(spec.type == SettingType::kInt || spec.type == SettingType::kBytes ||
                    spec.type == SettingType::kDuration);
      }
      if (!spec.unit.empty()) EXPECT_EQ(spec.type, SettingType::kInt);
    }
  }
  EXPECT_GE(bounded, 8);
  // The thread counts are bounded by what a WorkerPool accepts.
  EXPECT_EQ(Spec("hash_threads").max, std::to_string(WorkerPool::kMaxThreads));
  if (FindTransport("delta") != nullptr) {
    EXPECT_EQ(Spec("delta_threads").max, std::to_string(WorkerPool::kMaxThreads));
  }
}

TEST(SettingRangesTest, TypeNameRangeTextAndDumpShowRangeAndUnit) {
  const SettingSpec slots{.name = "slots",
                          .type = SettingType::kInt,
                          .default_value = "2",
                          .doc = "",
                          .min = "1",
                          .max = "64",
                          .unit = "versions"};
  const SettingSpec chunk{.name = "chunk",
                          .type = SettingType::kBytes,
                          .default_value = "4MiB",
                          .doc = "",
                          .min = "4KiB"};
  const SettingSpec cap{
      .name = "cap", .type = SettingType::kInt, .default_value = "1", .doc = "", .max = "8"};
  const SettingSpec lease{.name = "lease",
                          .type = SettingType::kDuration,
                          .default_value = "10s",
                          .doc = "",
                          .min = "10ms"};
  const SettingSpec mode{"mode", SettingType::kEnum, "a", "", {"a", "b"}};
  EXPECT_EQ(TypeName(slots), "int 1..64 versions");
  EXPECT_EQ(TypeName(chunk), "bytes >= 4KiB");
  EXPECT_EQ(TypeName(cap), "int <= 8");
  EXPECT_EQ(TypeName(lease), "duration >= 10ms");
  EXPECT_EQ(TypeName(mode), "enum(a|b)");
  EXPECT_EQ(RangeText(mode), "");
  const SettingTable table{"test", {slots, chunk, mode}};
  absl::StatusOr<Config> c = Config::Resolve({&table}, {{"slots", "64"}}, {}, NoEnv());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->Dump(),
            "chunk=4MiB (default) [>= 4KiB]\n"
            "mode=a (default)\n"
            "slots=64 (URI query) [1..64 versions]\n");
  // What the CLI's `weightbus settings` lists.
  bool listed = false;
  for (const SettingInfo& s : DescribeSettings()) {
    if (s.name == "queue_depth") {
      listed = true;
      EXPECT_EQ(s.type, "int 1..4096 operations");
    }
  }
  EXPECT_EQ(listed, FindTransport("disk") != nullptr);
}

// The declared ranges of the disk:// and ucx:// tables, resolved directly.
TEST(SettingRangesTest, ResolveRefusesValuesOutsideNamingSettingSourceValueAndRange) {
  if (const std::string why = testing::MissingTransports({"disk", "ucx"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  const std::vector<const SettingTable*> tables = {FindTransport("disk")->settings,
                                                   FindTransport("ucx")->settings};
  // Bounds are inclusive.
  for (const auto& [k, v] :
       std::vector<std::pair<std::string, std::string>>{{"queue_depth", "1"},
                                                        {"queue_depth", "4096"},
                                                        {"chunk_size", "4096"},
                                                        {"lease", "10ms"}}) {
    EXPECT_TRUE(Config::Resolve(tables, {}, {{k, v}}, NoEnv()).ok()) << k << "=" << v;
  }
  auto env = [](const char* n) -> const char* {
    return std::string_view(n) == "WEIGHTBUS_DISK_QUEUE_DEPTH" ? "0" : nullptr;
  };
  absl::StatusOr<Config> low = Config::Resolve(tables, {}, {}, env);
  EXPECT_EQ(low.status(),
            absl::InvalidArgumentError("setting queue_depth=\"0\" is out of range: expected "
                                       "1..4096 operations (from environment "
                                       "WEIGHTBUS_DISK_QUEUE_DEPTH)"));
  EXPECT_EQ(Config::Resolve(tables, {{"queue_depth", "4097"}}, {}, NoEnv()).status(),
            absl::InvalidArgumentError("setting queue_depth=\"4097\" is out of range: expected "
                                       "1..4096 operations (from URI query)"));
  EXPECT_EQ(Config::Resolve(tables, {}, {{"chunk_size", "4095"}}, NoEnv()).status(),
            absl::InvalidArgumentError("setting chunk_size=\"4095\" is out of range: expected "
                                       ">= 4KiB (from options)"));
  EXPECT_EQ(Config::Resolve(tables, {}, {{"lease", "9ms"}}, NoEnv()).status(),
            absl::InvalidArgumentError(
                "setting lease=\"9ms\" is out of range: expected >= 10ms (from options)"));
  // A bound that is not a value of its type is the table's mistake, not the caller's.
  const SettingTable broken{
      "x",
      {{.name = "n", .type = SettingType::kInt, .default_value = "1", .doc = "", .min = "one"}}};
  EXPECT_EQ(Config::Resolve({&broken}, {}, {}, NoEnv()).status().code(),
            absl::StatusCode::kInternal);
}

// Through Open: the transports no longer check ranges themselves; the one check names the URI.
TEST(SettingRangesTest, OpenRefusesOutOfRangeSettingsOfEveryScope) {
  testing::ScratchDir dir;
  const std::string base = "disk://" + dir.path();
  struct Case {
    std::string query;
    std::string expect;
  };
  std::vector<Case> cases = {
      {"hash_threads=257", "setting hash_threads=\"257\" is out of range: expected 0..256 threads"},
      {"world_size=0", "setting world_size=\"0\" is out of range: expected 1..65536 ranks"},
      {"world_size=65537", "setting world_size=\"65537\" is out of range: expected 1..65536 ranks"},
      {"rank=-1", "setting rank=\"-1\" is out of range: expected >= 0"},
      {"queue_depth=0", "setting queue_depth=\"0\" is out of range: expected 1..4096 operations"},
      {"chunk_size=1KiB", "setting chunk_size=\"1KiB\" is out of range: expected >= 4KiB"},
      {"retention=0", "setting retention=\"0\" is out of range: expected >= 1 versions"},
  };
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.query);
    const absl::Status s = Publisher::Open(base + "?" + c.query).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(base + ": " + c.expect + " (from URI query)"));
  }
  if (FindTransport("delta") != nullptr) {
    const absl::Status s = Subscriber::Open("delta+" + base + "?delta_groups=5").status();
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("setting delta_groups=\"5\" is out of range: expected 1..4 groups"));
    const absl::Status odd = Subscriber::Open("delta+" + base + "?delta_chunk_size=100").status();
    EXPECT_THAT(std::string(odd.message()),
                HasSubstr("setting delta_chunk_size=100 is not a multiple of 64"));
  }
  // rank below world_size is a rule between two settings, checked by the publisher.
  const absl::Status pair = Publisher::Open(base + "?rank=2&world_size=2").status();
  EXPECT_THAT(std::string(pair.message()), HasSubstr("rank 2 is not in [0, world_size=2)"));
  // publisher_name goes into every manifest's JSON text, which cannot hold bytes that are not
  // UTF-8 (serialising them threw on each Publish): refused at Open.
  const absl::Status name = Publisher::Open(base, {{"publisher_name", "trainer\xff"}}).status();
  EXPECT_EQ(name.code(), absl::StatusCode::kInvalidArgument) << name;
  EXPECT_EQ(std::string(name.message()),
            base + ": publisher_name \"trainer\\xff\" is not valid UTF-8 (bad byte at offset 7)");
}

TEST(ClosestNameTest, EditDistanceAndClosest) {
  EXPECT_EQ(EditDistance("", ""), 0u);
  EXPECT_EQ(EditDistance("abc", ""), 3u);
  EXPECT_EQ(EditDistance("kitten", "sitting"), 3u);
  EXPECT_EQ(EditDistance("retenton", "retention"), 1u);
  EXPECT_EQ(EditDistance("flaw", "lawn"), 2u);
  EXPECT_EQ(ClosestName("WEIGHTBUS_DISK_RETENTON",
                        {"WEIGHTBUS_BIND_MODE", "WEIGHTBUS_DISK_RETENTION", "WEIGHTBUS_RANK"}),
            "WEIGHTBUS_DISK_RETENTION");
  EXPECT_EQ(ClosestName("ab", {"xy", "ay", "ab2"}), "ay");  // the first of the closest
  EXPECT_EQ(ClosestName("x", {}), "");
}

// An unknown WEIGHTBUS_* variable (a typo, or a setting of a newer build or another transport)
// does not fail the open; it is reported once per process, naming the closest setting.
TEST(UnknownEnvironmentTest, IsAWarningOncePerProcessNamingTheClosestSetting) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  testing::ScratchDir dir;
  ASSERT_EQ(::setenv("WEIGHTBUS_DISK_RETENTON", "1", 1), 0);
  absl::Cleanup unset = [] { ::unsetenv("WEIGHTBUS_DISK_RETENTON"); };
  ::testing::internal::CaptureStderr();
  auto first = Subscriber::Open("disk://" + dir.path());
  auto second = Subscriber::Open("disk://" + dir.path());
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_THAT(log, HasSubstr("environment variable WEIGHTBUS_DISK_RETENTON names no setting of "
                             "this weightbus build"));
  EXPECT_THAT(log, HasSubstr("is ignored; the closest setting is WEIGHTBUS_DISK_RETENTION"));
  // Once: the second open said nothing more about it.
  EXPECT_EQ(log.find("WEIGHTBUS_DISK_RETENTON"), log.rfind("WEIGHTBUS_DISK_RETENTON")) << log;
}

TEST(UnknownEnvironmentTest, KnownAndForeignVariablesAreNotWarnedAbout) {
  std::vector<std::string> vars = {"WEIGHTBUS_BIND_MODE=direct",
                                   "WEIGHTBUS_LOG_LEVEL=warn",
                                   "WEIGHTBUS_FAILPOINTS=",
                                   "LIBWEIGHTBUS_PATH=/x.so",
                                   "WB_TEST_CLI=/x",
                                   "PATH=/bin",
                                   "WEIGHTBUS_FUTURE_SETTING_XYZ=1",
                                   "WEIGHTBUS_FUTURE_SETTING_XYZ=2"};
  std::vector<char*> env;
  for (std::string& v : vars) env.push_back(v.data());
  env.push_back(nullptr);
  ::testing::internal::CaptureStderr();
  const std::vector<std::string> warned = WarnUnknownEnvironment(env.data());
  const std::vector<std::string> again = WarnUnknownEnvironment(env.data());
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(warned, std::vector<std::string>{"WEIGHTBUS_FUTURE_SETTING_XYZ"});
  EXPECT_TRUE(again.empty());
  EXPECT_THAT(log, HasSubstr("WEIGHTBUS_FUTURE_SETTING_XYZ names no setting"));
}

// Unknown names at the call site stay errors: the caller wrote them there.
TEST(UnknownEnvironmentTest, UnknownUriQueryAndOptionsKeysStayErrors) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  testing::ScratchDir dir;
  const absl::Status uri = Subscriber::Open("disk://" + dir.path() + "?retenton=1").status();
  EXPECT_EQ(uri.code(), absl::StatusCode::kInvalidArgument) << uri;
  EXPECT_THAT(std::string(uri.message()),
              HasSubstr("unknown setting \"retenton\" in the URI query (the closest is "
                        "\"retention\"; known: "));
  const absl::Status opt =
      Subscriber::Open("disk://" + dir.path(), Options{{"fsynk", "false"}}).status();
  EXPECT_EQ(opt.code(), absl::StatusCode::kInvalidArgument) << opt;
  EXPECT_THAT(std::string(opt.message()),
              HasSubstr("unknown setting \"fsynk\" in options (the closest is \"fsync\""));
}

}  // namespace
}  // namespace weightbus::internal

// SPDX-License-Identifier: Apache-2.0
// The settings registry (core/config.h): precedence of defaults, environment, URI query and
// Options; malformed and unknown settings; byte suffixes and environment names.
#include <map>
#include <string>
#include <variant>

#include <gtest/gtest.h>

#include "core/config.h"

namespace weightbus::internal {
namespace {

const SettingTable& TestTable() {
  static const SettingTable* t =
      new SettingTable{"disk",
                       {{"retention", SettingType::kInt, "3", "doc"},
                        {"chunk_size", SettingType::kBytes, "4MiB", "doc"},
                        {"poll_interval", SettingType::kDuration, "100ms", "doc"},
                        {"fsync", SettingType::kBool, "true", "doc"},
                        {"io_engine", SettingType::kEnum, "uring", "doc", {"uring", "psync"}}}};
  return *t;
}

TEST(ConfigTest, DefaultsEnvUriAndOptionsInIncreasingPrecedence) {
  std::map<std::string, std::string> env = {{"WEIGHTBUS_DISK_RETENTION", "5"},
                                            {"WEIGHTBUS_DISK_CHUNK_SIZE", "1MiB"},
                                            {"WEIGHTBUS_DISK_FSYNC", "false"}};
  auto lookup = [&](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  auto c = Config::Resolve({&TestTable()}, {{"retention", "7"}, {"chunk_size", "5GB"}},
                           {{"retention", "9"}}, lookup);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->Int("retention"), 9);               // options beat the URI and env
  EXPECT_EQ(c->Bytes("chunk_size"), 5000000000u);  // URI beats env
  EXPECT_FALSE(c->Bool("fsync"));                  // env beats default
  EXPECT_EQ(c->Duration("poll_interval"), absl::Milliseconds(100));
  EXPECT_EQ(c->String("io_engine"), "uring");
  EXPECT_NE(c->Dump().find("retention=9 (options)"), std::string::npos) << c->Dump();
  EXPECT_NE(c->Dump().find("fsync=false (environment WEIGHTBUS_DISK_FSYNC)"), std::string::npos);
}

TEST(ConfigTest, MalformedAndUnknownSettingsAreErrorsNamingTheSource) {
  auto none = [](const char*) -> const char* { return nullptr; };
  auto bad_int = Config::Resolve({&TestTable()}, {{"retention", "three"}}, {}, none);
  ASSERT_EQ(bad_int.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_int.status().message().find("retention=\"three\""), absl::string_view::npos);
  EXPECT_NE(bad_int.status().message().find("URI query"), absl::string_view::npos);
  auto bad_enum = Config::Resolve({&TestTable()}, {}, {{"io_engine", "aio"}}, none);
  ASSERT_EQ(bad_enum.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_enum.status().message().find("enum(uring|psync)"), absl::string_view::npos);
  auto unknown = Config::Resolve({&TestTable()}, {}, {{"retension", "1"}}, none);
  ASSERT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("known: retention"), absl::string_view::npos);
  auto env = [](const char* n) -> const char* {
    return std::string(n) == "WEIGHTBUS_DISK_POLL_INTERVAL" ? "fast" : nullptr;
  };
  auto bad_env = Config::Resolve({&TestTable()}, {}, {}, env);
  ASSERT_EQ(bad_env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_env.status().message().find("WEIGHTBUS_DISK_POLL_INTERVAL"),
            absl::string_view::npos);
}

TEST(ConfigTest, ByteSuffixes) {
  const SettingSpec spec{"b", SettingType::kBytes, "0", ""};
  auto bytes = [&](const char* t) { return std::get<uint64_t>(*ParseSettingValue(spec, t)); };
  EXPECT_EQ(bytes("4096"), 4096u);
  EXPECT_EQ(bytes("64KiB"), 65536u);
  EXPECT_EQ(bytes("4mib"), 4u << 20);
  EXPECT_EQ(bytes("2G"), 2ull << 30);
  EXPECT_EQ(bytes("5GB"), 5000000000u);
  EXPECT_FALSE(ParseSettingValue(spec, "lots").ok());
  EXPECT_FALSE(ParseSettingValue(spec, "-1").ok());
  EXPECT_FALSE(ParseSettingValue(spec, "99999999999TiB").ok());
  EXPECT_EQ(EnvName("core", "bind_mode"), "WEIGHTBUS_BIND_MODE");
  EXPECT_EQ(EnvName("disk", "queue_depth"), "WEIGHTBUS_DISK_QUEUE_DEPTH");
  EXPECT_EQ(EnvName("delta", "delta_threads"), "WEIGHTBUS_DELTA_THREADS");
  EXPECT_EQ(EnvName("delta", "keyframe_interval"), "WEIGHTBUS_DELTA_KEYFRAME_INTERVAL");
}

}  // namespace
}  // namespace weightbus::internal

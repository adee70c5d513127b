// SPDX-License-Identifier: Apache-2.0
// The settings registry: every tunable of the core and of each transport is declared once, with
// its type, default and a doc line (in the style of UCX config tables and NCCL_PARAM). Values
// come, lowest precedence first, from the default, the environment (WEIGHTBUS_<SCOPE>_<NAME>, or
// WEIGHTBUS_<NAME> for core settings), the URI query and the Options map. A missing setting takes
// its default; a malformed or unknown one is an InvalidArgument error naming its source.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace weightbus::internal {

enum class SettingType {
  kBool,      // true/false/1/0/yes/no/on/off
  kInt,       // signed decimal
  kBytes,     // 4096, 64KiB, 4MiB, 1GiB, 5GB (SI), case-insensitive suffix
  kDuration,  // absl duration: 100ms, 2.5s, 1m
  kString,
  kEnum,  // one of `choices`
};

struct SettingSpec {
  std::string_view name;  // e.g. "retention"
  SettingType type;
  std::string_view default_value;  // parsed like any other value
  std::string_view doc;
  std::vector<std::string_view> choices = {};  // for kEnum
};

// The settings of one scope ("core" or a transport scheme).
struct SettingTable {
  std::string_view scope;
  std::vector<SettingSpec> specs;
};

// Environment variable for a setting, e.g. ("disk", "retention") -> WEIGHTBUS_DISK_RETENTION and
// ("core", "bind_mode") -> WEIGHTBUS_BIND_MODE.
std::string EnvName(std::string_view scope, std::string_view name);

// Text of a type, e.g. "bytes" or "enum(staged|direct)".
std::string TypeName(const SettingSpec& spec);

// Resolved, typed values of a set of tables. Getters abort on a name that no table declares or
// a type mismatch (a programming error, not a user error).
class Config {
 public:
  using Value = std::variant<bool, int64_t, uint64_t, absl::Duration, std::string>;
  using EnvLookup = std::function<const char*(const char*)>;

  // Resolves `tables`. `query` holds URI query parameters, `options` the caller's map; both may
  // only name settings of the tables. `env` defaults to getenv.
  static absl::StatusOr<Config> Resolve(const std::vector<const SettingTable*>& tables,
                                        const std::map<std::string, std::string>& query,
                                        const std::map<std::string, std::string>& options,
                                        EnvLookup env = nullptr);

  bool Bool(std::string_view name) const;
  int64_t Int(std::string_view name) const;
  uint64_t Bytes(std::string_view name) const;
  absl::Duration Duration(std::string_view name) const;
  const std::string& String(std::string_view name) const;  // kString and kEnum

  // "name=value (source)" lines, one per setting, for logs and the CLI.
  std::string Dump() const;

 private:
  struct Entry {
    const SettingSpec* spec;
    Value value;
    std::string text;
    std::string source;  // "default", "env WEIGHTBUS_X", "uri", "options"
  };
  const Entry& Get(std::string_view name) const;
  std::map<std::string, Entry, std::less<>> entries_;
};

// Parses `text` as a value of `spec`'s type. Errors: InvalidArgument naming the setting.
absl::StatusOr<Config::Value> ParseSettingValue(const SettingSpec& spec, std::string_view text);

}  // namespace weightbus::internal

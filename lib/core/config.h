// SPDX-License-Identifier: Apache-2.0
// The settings registry: every tunable of the core and of each transport is declared once, with
// its type, default, range, unit and a doc line (in the style of UCX config tables and
// NCCL_PARAM). Values come, lowest precedence first, from the default, the environment
// (WEIGHTBUS_<SCOPE>_<NAME>, or WEIGHTBUS_<NAME> for core settings), the URI query and the
// Options map. A missing setting takes its default; a malformed one, or one outside its declared
// range, is an InvalidArgument error naming the setting, its source, the value and what was
// expected (checked here, in Config::Resolve, and nowhere else).
//
// Unknown names: an unknown key in a URI query or an Options map is an InvalidArgument error
// (the caller wrote it at that call). An unknown WEIGHTBUS_* environment variable is not an
// error: the environment is shared with other builds (a newer library, a build without some
// transport) and other tools, so it is logged once per process as a warning naming the closest
// known setting (WarnUnknownEnvironment in core/registry.h). Names that other parts of weightbus
// read from the environment are reserved and never warned about (ReservedEnvironmentNames).
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
  // Inclusive bounds for kInt, kBytes and kDuration, written as values of the type ("1",
  // "4KiB", "10ms"); empty: unbounded on that side. Config::Resolve refuses values outside.
  std::string_view min = {};
  std::string_view max = {};
  // What a kInt counts, for listings and messages ("versions", "threads"); bytes and durations
  // carry their unit in their values.
  std::string_view unit = {};
};

// The settings of one scope ("core" or a transport scheme).
struct SettingTable {
  std::string_view scope;
  std::vector<SettingSpec> specs;
};

// Environment variable for a setting, e.g. ("disk", "retention") -> WEIGHTBUS_DISK_RETENTION and
// ("core", "bind_mode") -> WEIGHTBUS_BIND_MODE.
std::string EnvName(std::string_view scope, std::string_view name);

// Text of a type with its range and unit, e.g. "bytes", "enum(staged|direct)",
// "int 1..64 versions", "bytes >= 4KiB" or "duration >= 10ms".
std::string TypeName(const SettingSpec& spec);

// The declared range of `spec` as text ("1..64", ">= 4KiB", "<= 8"), with its unit when it has
// one ("1..64 versions"); empty when unbounded and without a unit.
std::string RangeText(const SettingSpec& spec);

// The Levenshtein distance of `a` and `b`: the fewest byte insertions, deletions and
// substitutions that turn one into the other.
size_t EditDistance(std::string_view a, std::string_view b);

// The entry of `candidates` closest to `name` by EditDistance (the first of equally close ones);
// empty when there are none. For "did you mean" hints.
std::string ClosestName(std::string_view name, const std::vector<std::string>& candidates);

// Resolved, typed values of a set of tables. Getters abort on a name that no table declares or
// a type mismatch (a programming error, not a user error).
class Config {
 public:
  using Value = std::variant<bool, int64_t, uint64_t, absl::Duration, std::string>;
  using EnvLookup = std::function<const char*(const char*)>;

  // Resolves `tables`. `query` holds URI query parameters, `options` the caller's map; both may
  // only name settings of the tables (otherwise InvalidArgument naming the closest one). `env`
  // defaults to getenv; it is only asked for the tables' variables (unknown WEIGHTBUS_*
  // variables are the registry's concern: WarnUnknownEnvironment in core/registry.h).
  // Errors: InvalidArgument naming the setting, the source, the value and the expected type or
  // range (see ParseSettingValue).
  static absl::StatusOr<Config> Resolve(const std::vector<const SettingTable*>& tables,
                                        const std::map<std::string, std::string>& query,
                                        const std::map<std::string, std::string>& options,
                                        EnvLookup env = nullptr);

  bool Bool(std::string_view name) const;
  int64_t Int(std::string_view name) const;
  uint64_t Bytes(std::string_view name) const;
  absl::Duration Duration(std::string_view name) const;
  const std::string& String(std::string_view name) const;  // kString and kEnum

  // "name=value (source)" lines, one per setting, for logs and the CLI; a setting with a range
  // or unit adds it in brackets: "retention=3 (default) [>= 1 versions]".
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

// Parses `text` as a value of `spec`'s type and checks it against the declared range.
// Errors: InvalidArgument naming the setting, the value and what was expected; Internal when
// the spec's own bounds do not parse (a mistake in a settings table).
absl::StatusOr<Config::Value> ParseSettingValue(const SettingSpec& spec, std::string_view text);

}  // namespace weightbus::internal

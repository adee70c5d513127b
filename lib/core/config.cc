// SPDX-License-Identifier: Apache-2.0
#include "core/config.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include <cstring>
#include <type_traits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"

namespace weightbus::internal {
namespace {

absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::Status Malformed(const SettingSpec& spec, std::string_view text, std::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrFormat("setting %s=\"%s\" is malformed: expected %s", spec.name, text, expected));
}

absl::StatusOr<uint64_t> ParseBytes(const SettingSpec& spec, std::string_view text) {
  std::string t = absl::AsciiStrToLower(AV(text));
  struct Suffix {
    const char* s;
    uint64_t mult;
  };
  static constexpr Suffix kSuffixes[] = {
      {"kib", 1ULL << 10}, {"mib", 1ULL << 20}, {"gib", 1ULL << 30},   {"tib", 1ULL << 40},
      {"kb", 1000ULL},     {"mb", 1000000ULL},  {"gb", 1000000000ULL}, {"tb", 1000000000000ULL},
      {"k", 1ULL << 10},   {"m", 1ULL << 20},   {"g", 1ULL << 30},     {"b", 1}};
  uint64_t mult = 1;
  for (const Suffix& s : kSuffixes) {
    if (absl::EndsWith(t, s.s)) {
      mult = s.mult;
      t.resize(t.size() - std::strlen(s.s));
      break;
    }
  }
  uint64_t n = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(t), &n) || (n != 0 && mult > UINT64_MAX / n)) {
    return Malformed(spec, text, "a byte count such as 4096, 64KiB, 4MiB or 5GB");
  }
  return n * mult;
}

}  // namespace

std::string EnvName(std::string_view scope, std::string_view name) {
  std::string out = "WEIGHTBUS_";
  // A name that already starts with its scope ("delta_threads" in scope "delta") is not
  // prefixed twice: WEIGHTBUS_DELTA_THREADS.
  const bool prefixed = name.size() > scope.size() && name.substr(0, scope.size()) == scope &&
                        name[scope.size()] == '_';
  if (scope != "core" && !prefixed) absl::StrAppend(&out, absl::AsciiStrToUpper(AV(scope)), "_");
  absl::StrAppend(&out, absl::AsciiStrToUpper(AV(name)));
  return out;
}

std::string TypeName(const SettingSpec& spec) {
  std::string out;
  switch (spec.type) {
    case SettingType::kBool:
      out = "bool";
      break;
    case SettingType::kInt:
      out = "int";
      break;
    case SettingType::kBytes:
      out = "bytes";
      break;
    case SettingType::kDuration:
      out = "duration";
      break;
    case SettingType::kString:
      out = "string";
      break;
    case SettingType::kEnum: {
      std::vector<std::string> c(spec.choices.begin(), spec.choices.end());
      out = absl::StrCat("enum(", absl::StrJoin(c, "|"), ")");
      break;
    }
  }
  if (std::string range = RangeText(spec); !range.empty()) absl::StrAppend(&out, " ", range);
  return out;
}

std::string RangeText(const SettingSpec& spec) {
  std::string out;
  if (!spec.min.empty() && !spec.max.empty()) {
    out = absl::StrCat(AV(spec.min), "..", AV(spec.max));
  } else if (!spec.min.empty()) {
    out = absl::StrCat(">= ", AV(spec.min));
  } else if (!spec.max.empty()) {
    out = absl::StrCat("<= ", AV(spec.max));
  }
  if (!spec.unit.empty()) absl::StrAppend(&out, out.empty() ? "" : " ", AV(spec.unit));
  return out;
}

namespace {

// `text` as a value of `spec`'s type, without the range check.
absl::StatusOr<Config::Value> ParseTyped(const SettingSpec& spec, std::string_view text) {
  switch (spec.type) {
    case SettingType::kBool: {
      bool b = false;
      if (!absl::SimpleAtob(AV(text), &b)) return Malformed(spec, text, "true or false");
      return Config::Value(b);
    }
    case SettingType::kInt: {
      int64_t i = 0;
      if (!absl::SimpleAtoi(AV(text), &i)) return Malformed(spec, text, "an integer");
      return Config::Value(i);
    }
    case SettingType::kBytes: {
      absl::StatusOr<uint64_t> b = ParseBytes(spec, text);
      if (!b.ok()) return b.status();
      return Config::Value(*b);
    }
    case SettingType::kDuration: {
      absl::Duration d;
      if (!absl::ParseDuration(AV(text), &d) || d < absl::ZeroDuration()) {
        return Malformed(spec, text, "a non-negative duration such as 100ms, 2.5s or 1m");
      }
      return Config::Value(d);
    }
    case SettingType::kString:
      return Config::Value(std::string(text));
    case SettingType::kEnum:
      for (std::string_view c : spec.choices) {
        if (c == text) return Config::Value(std::string(text));
      }
      return Malformed(spec, text, absl::StrCat("one of ", TypeName(spec)));
  }
  return absl::InternalError("unknown setting type");
}

// -1, 0 or 1 as a < b, a == b or a > b, for two values of one numeric setting type.
int Compare(const Config::Value& a, const Config::Value& b) {
  return std::visit(
      [&](const auto& x) -> int {
        using T = std::decay_t<decltype(x)>;
        const T& y = std::get<T>(b);
        if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, std::string>) {
          return 0;  // no ranges for these types
        } else {
          return x < y ? -1 : (y < x ? 1 : 0);
        }
      },
      a);
}

}  // namespace

absl::StatusOr<Config::Value> ParseSettingValue(const SettingSpec& spec, std::string_view text) {
  absl::StatusOr<Config::Value> value = ParseTyped(spec, text);
  if (!value.ok() || (spec.min.empty() && spec.max.empty())) return value;
  // Refuses `*value` when comparing it with `bound` gives `refused` (-1: below min, 1: above max).
  auto check = [&](std::string_view bound, int refused) -> absl::Status {
    if (bound.empty()) return absl::OkStatus();
    absl::StatusOr<Config::Value> limit = ParseTyped(spec, bound);
    if (!limit.ok() || spec.type == SettingType::kBool || spec.type == SettingType::kString ||
        spec.type == SettingType::kEnum) {
      return absl::InternalError(
          absl::StrFormat("setting %s declares the bound \"%s\", which is not a value of its type",
                          spec.name, bound));
    }
    if (Compare(*value, *limit) == refused) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "setting %s=\"%s\" is out of range: expected %s", spec.name, text, RangeText(spec)));
    }
    return absl::OkStatus();
  };
  WB_RETURN_IF_ERROR(check(spec.min, -1));
  WB_RETURN_IF_ERROR(check(spec.max, 1));
  return value;
}

absl::StatusOr<Config> Config::Resolve(const std::vector<const SettingTable*>& tables,
                                       const std::map<std::string, std::string>& query,
                                       const std::map<std::string, std::string>& options,
                                       EnvLookup env) {
  if (!env) env = [](const char* n) -> const char* { return std::getenv(n); };
  Config config;
  std::vector<std::string> known;
  for (const SettingTable* table : tables) {
    for (const SettingSpec& spec : table->specs) {
      known.emplace_back(spec.name);
      std::string text(spec.default_value);
      std::string source = "default";
      std::string env_name = EnvName(table->scope, spec.name);
      if (const char* e = env(env_name.c_str()); e != nullptr) {
        text = e;
        source = absl::StrCat("environment ", env_name);
      }
      if (auto it = query.find(std::string(spec.name)); it != query.end()) {
        text = it->second;
        source = "URI query";
      }
      if (auto it = options.find(std::string(spec.name)); it != options.end()) {
        text = it->second;
        source = "options";
      }
      absl::StatusOr<Value> value = ParseSettingValue(spec, text);
      if (!value.ok()) {
        return absl::Status(value.status().code(),
                            absl::StrCat(value.status().message(), " (from ", source, ")"));
      }
      if (config.entries_.count(spec.name)) {
        return absl::InternalError(absl::StrFormat(
            "setting \"%s\" is declared by two tables (scope %s and an earlier one)", spec.name,
            table->scope));
      }
      config.entries_[std::string(spec.name)] = Entry{&spec, *std::move(value), text, source};
    }
  }
  auto check_known = [&](const std::map<std::string, std::string>& m,
                         std::string_view where) -> absl::Status {
    for (const auto& [k, v] : m) {
      if (!config.entries_.count(k)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("unknown setting \"%s\" in %s (the closest is \"%s\"; known: %s)", k,
                            where, ClosestName(k, known), absl::StrJoin(known, ", ")));
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status s = check_known(query, "the URI query"); !s.ok()) return s;
  if (absl::Status s = check_known(options, "options"); !s.ok()) return s;
  return config;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  // One row of the Wagner-Fischer table at a time.
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];  // row[i-1][j-1]
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({above + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string ClosestName(std::string_view name, const std::vector<std::string>& candidates) {
  const std::string* best = nullptr;
  size_t best_distance = 0;
  for (const std::string& c : candidates) {
    const size_t d = EditDistance(name, c);
    if (best == nullptr || d < best_distance) {
      best = &c;
      best_distance = d;
    }
  }
  return best == nullptr ? std::string() : *best;
}

const Config::Entry& Config::Get(std::string_view name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    std::fprintf(stderr, "weightbus: internal error: setting \"%.*s\" is not declared\n",
                 static_cast<int>(name.size()), name.data());
    std::abort();
  }
  return it->second;
}

template <typename T>
static const T& As(const Config::Value& v, std::string_view name) {
  if (const T* p = std::get_if<T>(&v)) return *p;
  std::fprintf(stderr, "weightbus: internal error: setting \"%.*s\" read with the wrong type\n",
               static_cast<int>(name.size()), name.data());
  std::abort();
}

bool Config::Bool(std::string_view name) const { return As<bool>(Get(name).value, name); }
int64_t Config::Int(std::string_view name) const { return As<int64_t>(Get(name).value, name); }
uint64_t Config::Bytes(std::string_view name) const { return As<uint64_t>(Get(name).value, name); }
absl::Duration Config::Duration(std::string_view name) const {
  return As<absl::Duration>(Get(name).value, name);
}
const std::string& Config::String(std::string_view name) const {
  return As<std::string>(Get(name).value, name);
}

std::string Config::Dump() const {
  std::string out;
  for (const auto& [name, e] : entries_) {
    absl::StrAppend(&out, name, "=", e.text, " (", e.source, ")");
    if (std::string range = RangeText(*e.spec); !range.empty()) {
      absl::StrAppend(&out, " [", range, "]");
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

}  // namespace weightbus::internal

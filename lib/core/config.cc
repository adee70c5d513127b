// SPDX-License-Identifier: Apache-2.0
#include "core/config.h"

#include <cstdio>
#include <cstdlib>

#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

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
  switch (spec.type) {
    case SettingType::kBool:
      return "bool";
    case SettingType::kInt:
      return "int";
    case SettingType::kBytes:
      return "bytes";
    case SettingType::kDuration:
      return "duration";
    case SettingType::kString:
      return "string";
    case SettingType::kEnum: {
      std::vector<std::string> c(spec.choices.begin(), spec.choices.end());
      return absl::StrCat("enum(", absl::StrJoin(c, "|"), ")");
    }
  }
  return "?";
}

absl::StatusOr<Config::Value> ParseSettingValue(const SettingSpec& spec, std::string_view text) {
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
        return absl::InvalidArgumentError(
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
        return absl::InvalidArgumentError(absl::StrFormat(
            "unknown setting \"%s\" in %s (known: %s)", k, where, absl::StrJoin(known, ", ")));
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status s = check_known(query, "the URI query"); !s.ok()) return s;
  if (absl::Status s = check_known(options, "options"); !s.ok()) return s;
  return config;
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
    absl::StrAppend(&out, name, "=", e.text, " (", e.source, ")\n");
  }
  return out;
}

}  // namespace weightbus::internal

// SPDX-License-Identifier: Apache-2.0
#include "weightbus/args.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"

namespace weightbus::tools {

absl::StatusOr<Args> Args::Parse(const std::vector<std::string>& argv,
                                 const std::vector<FlagSpec>& specs) {
  Args args;
  bool only_positional = false;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (only_positional || a.size() < 3 || a.rfind("--", 0) != 0) {
      if (a == "--") {
        only_positional = true;
        continue;
      }
      args.positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2);
    std::optional<std::string> value;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    const FlagSpec* spec = nullptr;
    for (const FlagSpec& s : specs) {
      if (s.name == name) spec = &s;
    }
    if (spec == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("unknown flag --%s", name));
    }
    if (spec->takes_value && !value) {
      if (i + 1 >= argv.size()) {
        return absl::InvalidArgumentError(absl::StrFormat("flag --%s needs a value", name));
      }
      value = argv[++i];
    }
    if (!spec->takes_value && value) {
      return absl::InvalidArgumentError(absl::StrFormat("flag --%s takes no value", name));
    }
    auto& slot = args.values_[name];
    if (!slot.empty() && !spec->repeatable) {
      return absl::InvalidArgumentError(absl::StrFormat("flag --%s given twice", name));
    }
    slot.push_back(value.value_or("true"));
  }
  return args;
}

std::optional<std::string> Args::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second.back();
}

std::vector<std::string> Args::GetAll(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>() : it->second;
}

absl::StatusOr<uint64_t> Args::GetUint(const std::string& name, uint64_t default_value) const {
  std::optional<std::string> v = Get(name);
  if (!v) return default_value;
  uint64_t out = 0;
  if (!absl::SimpleAtoi(*v, &out)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--%s=\"%s\" is not a non-negative integer", name, *v));
  }
  return out;
}

absl::StatusOr<absl::Duration> Args::GetSeconds(const std::string& name,
                                                absl::Duration default_value) const {
  std::optional<std::string> v = Get(name);
  if (!v) return default_value;
  double s = 0;
  if (!absl::SimpleAtod(*v, &s) || !std::isfinite(s) || s < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--%s=\"%s\" is not a number of seconds", name, *v));
  }
  return absl::Seconds(s);
}

}  // namespace weightbus::tools

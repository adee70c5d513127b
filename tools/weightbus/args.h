// SPDX-License-Identifier: Apache-2.0
// A small command-line parser for the weightbus tool's subcommands. (Abseil's flags library
// reserves --version as a global usage flag, which the CLI needs as `publish --version N`.)
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace weightbus::tools {

struct FlagSpec {
  std::string name;  // without dashes
  bool takes_value = true;
  bool repeatable = false;
  std::string help;
};

class Args {
 public:
  // Parses argv (after the subcommand) against `specs`: --name value, --name=value, boolean
  // --name, and positionals. Errors: InvalidArgument for an unknown flag, a missing value or a
  // non-repeatable flag given twice.
  static absl::StatusOr<Args> Parse(const std::vector<std::string>& argv,
                                    const std::vector<FlagSpec>& specs);

  const std::vector<std::string>& positional() const { return positional_; }
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::optional<std::string> Get(const std::string& name) const;
  std::vector<std::string> GetAll(const std::string& name) const;
  // Typed getters: the default when absent, InvalidArgument naming the flag when malformed.
  absl::StatusOr<uint64_t> GetUint(const std::string& name, uint64_t default_value) const;
  absl::StatusOr<absl::Duration> GetSeconds(const std::string& name,
                                            absl::Duration default_value) const;

 private:
  std::vector<std::string> positional_;
  std::map<std::string, std::vector<std::string>> values_;
};

}  // namespace weightbus::tools

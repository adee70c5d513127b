// SPDX-License-Identifier: Apache-2.0
#include "weightbus/fatal.h"

#include <cstdio>
#include <cstdlib>

namespace weightbus::tools {
namespace {

FatalErrorPolicy& Policy() {
  static auto* policy = new FatalErrorPolicy;
  return *policy;
}

}  // namespace

void SetFatalErrorPolicy(FatalErrorPolicy policy) { Policy() = std::move(policy); }

void Die(const std::string& message) {
  const FatalErrorPolicy& p = Policy();
  std::fflush(stdout);
  std::fprintf(stderr, "%s: error: %s\n", p.program.c_str(), message.c_str());
  if (p.cleanup) p.cleanup();
  std::exit(p.exit_status);
}

}  // namespace weightbus::tools

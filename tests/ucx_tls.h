// SPDX-License-Identifier: Apache-2.0
// The UCX transport settings the ucx:// suites run each case under (UCX reads them from the
// environment when a publisher or subscriber opens).
#pragma once

#include <map>
#include <ostream>
#include <string>

namespace weightbus::testing {

struct Tls {
  std::string name;
  std::map<std::string, std::string> env;  // an empty value unsets the variable
};
// Test names and messages show "shm" or "tcp", not the struct's bytes.
inline void PrintTo(const Tls& tls, std::ostream* os) { *os << tls.name; }

inline const Tls kShm{"shm", {{"UCX_TLS", "posix,sysv,cma,self"}}};
inline const Tls kTcp{"tcp", {{"UCX_TLS", "tcp"}, {"UCX_NET_DEVICES", "lo"}}};
// UCX's own defaults (UCX_TLS unset: the transport leaves TCP out for a loopback channel).
inline const Tls kDefault{"default", {{"UCX_TLS", ""}, {"UCX_NET_DEVICES", ""}}};

// Set them for a scope with `const testing::ScopedEnvs env(tls.env);` (test_support.h), which
// restores them on every exit of the scope, a failed ASSERT_* included.

}  // namespace weightbus::testing

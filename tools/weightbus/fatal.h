// SPDX-License-Identifier: Apache-2.0
// How the project's executables (weightbus-demo, the benchmarks) end on an error they cannot
// go on from: one line "<program>: error: <message>" on stderr, the program's cleanup (stopping
// child processes, removing temporary directories), and its exit status.
#pragma once

#include <functional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace weightbus::tools {

struct FatalErrorPolicy {
  std::string program = "weightbus";  // the prefix of the message
  int exit_status = 1;
  std::function<void()> cleanup;  // run before exiting, if set
};

// Sets what Die does in this process. Call at the start of main, before any thread starts.
void SetFatalErrorPolicy(FatalErrorPolicy policy);

// Flushes stdout, prints "<program>: error: <message>", runs the cleanup and exits.
[[noreturn]] void Die(const std::string& message);

// The value, or Die with the status's message.
template <typename T>
T OrDie(absl::StatusOr<T> v) {
  if (!v.ok()) Die(std::string(v.status().message()));
  return *std::move(v);
}
inline void OrDie(const absl::Status& s) {
  if (!s.ok()) Die(std::string(s.message()));
}

}  // namespace weightbus::tools

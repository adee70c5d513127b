// SPDX-License-Identifier: Apache-2.0
#include "core/call_gate.h"

#include <unistd.h>

#include "absl/strings/str_format.h"

namespace weightbus::internal {

CallGate::CallGate(std::string what) : what_(std::move(what)), pid_(getpid()) {}

bool CallGate::Forked() const { return getpid() != pid_; }

absl::Status CallGate::Enter(std::string_view call) {
  if (Forked()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: %s called in process %d, a child forked from process %d that opened this handle; "
        "a handle cannot be used across fork(): open a new one in the child",
        what_, call, getpid(), pid_));
  }
  absl::MutexLock lock(&mu_);
  if (closing_) return Closed(call);
  ++inside_;
  return absl::OkStatus();
}

absl::Status CallGate::Closed(std::string_view call) const {
  return absl::CancelledError(
      absl::StrFormat("%s: %s cancelled: the handle is being closed", what_, call));
}

absl::Status CallGate::CheckNotClosing(std::string_view call) {
  absl::MutexLock lock(&mu_);
  return closing_ ? Closed(call) : absl::OkStatus();
}

void CallGate::Exit() {
  absl::MutexLock lock(&mu_);
  --inside_;
}

void CallGate::MarkClosing() {
  absl::MutexLock lock(&mu_);
  closing_ = true;
}

void CallGate::CloseAndWait() {
  absl::MutexLock lock(&mu_);
  closing_ = true;
  mu_.Await(absl::Condition(
      +[](int* inside) { return *inside == 0; }, &inside_));
}

}  // namespace weightbus::internal

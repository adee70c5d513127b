// SPDX-License-Identifier: Apache-2.0
// Admission of calls on one Publisher or Subscriber, so that closing a handle while another
// thread is inside a call on it, or using a handle inherited across fork(), never crashes.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace weightbus::internal {

// Counts the calls inside a handle. Enter() admits a call unless the handle is closing (then
// Cancelled) or this process is not the one that opened it (a forked child: FailedPrecondition);
// Close() refuses new calls and returns once every admitted call has left. Thread-safe.
//
// Fork: the pid check comes before any lock, so a child never touches a mutex that another
// thread of the parent may have held at fork() time.
class CallGate {
 public:
  // `what` names the handle in messages, e.g. "disk:///ch subscriber".
  explicit CallGate(std::string what);

  // True in a process forked from the one that created the gate.
  bool Forked() const;

  absl::Status Enter(std::string_view call);
  void Exit();

  // Cancelled once the handle is closing (for calls admitted earlier that reach a wait).
  absl::Status CheckNotClosing(std::string_view call);

  // Marks the handle closing: calls admitted later fail with Cancelled. Returns at once.
  void MarkClosing();
  // MarkClosing(), then waits until no admitted call is inside (calls in flight end when their
  // transport honours Cancel, or at their own deadline).
  void CloseAndWait();

 private:
  absl::Status Closed(std::string_view call) const;

  const std::string what_;
  const pid_t pid_;
  absl::Mutex mu_;
  int inside_ ABSL_GUARDED_BY(mu_) = 0;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
};

// Enter() on construction, Exit() on destruction if it was admitted.
class CallScope {
 public:
  CallScope(CallGate& gate, std::string_view call) : gate_(gate), status_(gate.Enter(call)) {}
  ~CallScope() {
    if (status_.ok()) gate_.Exit();
  }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  CallGate& gate_;
  absl::Status status_;
};

}  // namespace weightbus::internal

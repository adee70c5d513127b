// SPDX-License-Identifier: Apache-2.0
// Acting while a call is in flight on another thread, without sleeping: InFlight starts the call
// and returns once the thread is blocked inside it.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <functional>
#include <thread>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "test_support.h"

namespace weightbus::testing {

// Runs `call` on a new thread and returns once that thread is blocked inside it (asleep in the
// kernel after announcing the call: nothing else between the announcement and the call
// blocks), so the caller can close a handle, publish or cancel while the call is in flight; or
// once the call returned, for a call with a short deadline that may end first (Returned()).
class InFlight {
 public:
  explicit InFlight(std::function<absl::Status()> call, absl::Duration timeout = absl::Seconds(30))
      : thread_([this, call = std::move(call)] {
          tid_ = gettid();
          started_.Notify();
          result_ = call();
          done_.Notify();
        }) {
    started_.WaitForNotification();
    EXPECT_TRUE(
        WaitUntil([&] { return ProcessState(tid_) == 'S' || done_.HasBeenNotified(); }, timeout));
  }
  ~InFlight() { thread_.join(); }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

  // Whether the call has returned.
  bool Returned() const { return done_.HasBeenNotified(); }
  // The call's status once it returned (waits up to `timeout`).
  absl::Status Result(absl::Duration timeout) {
    if (!done_.WaitForNotificationWithTimeout(timeout)) {
      return absl::InternalError("the call in flight did not return");
    }
    return result_;
  }

 private:
  absl::Notification started_, done_;
  pid_t tid_ = 0;
  absl::Status result_;
  std::thread thread_;
};

}  // namespace weightbus::testing

// SPDX-License-Identifier: Apache-2.0
// Small operating-system helpers shared by the core and the transports.
#pragma once

#include <cstdint>
#include <string>

namespace weightbus::internal {

// An owned file descriptor, closed on destruction. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  ~UniqueFd();
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// gethostname(), or "unknown".
std::string HostName();

// "pid N on HOST", how processes describe themselves to peers and in lock files.
std::string ProcessDescription();

// A 64-bit identifier that differs between processes and calls (time, pid and an address mixed
// by splitmix64); for session and subscriber ids, not for security.
uint64_t RandomId();

}  // namespace weightbus::internal

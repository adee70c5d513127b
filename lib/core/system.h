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
  UniqueFd(UniqueFd&& o) noexcept : close_in_children_(o.close_in_children_), fd_(o.fd_) {
    o.fd_ = -1;
    o.close_in_children_ = false;
  }
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  ~UniqueFd();
  int get() const { return fd_; }
  int release();
  explicit operator bool() const { return fd_ >= 0; }

  // Makes every child forked from now on close its copy of this descriptor at fork() time
  // (pthread_atfork), until this object lets go of it. For what a long-lived child (a DataLoader
  // worker, a forked server) must not keep alive for the parent: a listening socket (the port),
  // a control connection (a peer would never see it close), a lock (flock is per open file, so
  // a child's copy would hold it after the parent closed). Returns *this.
  UniqueFd& CloseInForkedChildren();

 private:
  bool close_in_children_ = false;
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

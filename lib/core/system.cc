// SPDX-License-Identifier: Apache-2.0
#include "core/system.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <set>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace weightbus::internal {

namespace {

// The descriptors children close at fork(). The lock is held across fork() (prepare/parent
// handlers), so the child's copy of the set is consistent; the child handler runs in the child's
// only thread.
struct ForkCloseSet {
  std::mutex mu;
  std::set<int> fds;
};

ForkCloseSet& ForkClose() {
  static ForkCloseSet* set = [] {
    auto* s = new ForkCloseSet;  // never destroyed: fork() may come during static destruction
    pthread_atfork([] { ForkClose().mu.lock(); }, [] { ForkClose().mu.unlock(); },
                   [] {
                     ForkCloseSet& c = ForkClose();
                     for (int fd : c.fds) ::close(fd);
                     c.fds.clear();
                     c.mu.unlock();
                   });
    return s;
  }();
  return *set;
}

void Forget(int fd) {
  ForkCloseSet& c = ForkClose();
  std::lock_guard<std::mutex> lock(c.mu);
  c.fds.erase(fd);
}

}  // namespace

UniqueFd& UniqueFd::CloseInForkedChildren() {
  if (fd_ >= 0 && !close_in_children_) {
    ForkCloseSet& c = ForkClose();
    std::lock_guard<std::mutex> lock(c.mu);
    c.fds.insert(fd_);
    close_in_children_ = true;
  }
  return *this;
}

int UniqueFd::release() {
  if (close_in_children_) {
    Forget(fd_);
    close_in_children_ = false;
  }
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(release());
    const bool mark = o.close_in_children_;
    fd_ = o.fd_;
    close_in_children_ = mark;
    o.fd_ = -1;
    o.close_in_children_ = false;
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(release());
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

std::string ProcessDescription() { return absl::StrFormat("pid %d on %s", getpid(), HostName()); }

uint64_t RandomId() {
  static std::atomic<uint64_t> counter{0};
  uint64_t x = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())) ^
               (static_cast<uint64_t>(getpid()) << 32) ^ reinterpret_cast<uintptr_t>(&counter) ^
               (counter.fetch_add(1) << 48);
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace weightbus::internal

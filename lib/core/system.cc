// SPDX-License-Identifier: Apache-2.0
#include "core/system.h"

#include <unistd.h>

#include <atomic>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace weightbus::internal {

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
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

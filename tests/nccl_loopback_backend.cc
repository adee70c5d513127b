// SPDX-License-Identifier: Apache-2.0
#include "nccl_loopback_backend.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/bytes.h"
#include "core/system.h"

namespace weightbus::testing {
namespace {

using internal::nccl::Communicator;
using internal::nccl::Device;
using internal::nccl::UniqueId;

constexpr char kIdMagic[] = "WBLB";

// One in-order queue of work, run by its own thread: the device's streams.
class Queue {
 public:
  Queue() : thread_([this] { Run(); }) {}
  ~Queue() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  uint64_t Enqueue(std::function<void()> op) {
    std::lock_guard<std::mutex> lock(mu_);
    ops_.push_back({++last_, std::move(op)});
    cv_.notify_all();
    return last_;
  }
  bool Passed(uint64_t seq) const { return done_.load() >= seq; }
  void WaitIdle() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_.load() == last_; });
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !ops_.empty(); });
      if (ops_.empty()) return;
      auto [seq, op] = std::move(ops_.front());
      ops_.pop_front();
      lock.unlock();
      op();
      lock.lock();
      done_ = seq;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<uint64_t, std::function<void()>>> ops_;
  uint64_t last_ = 0;
  std::atomic<uint64_t> done_{0};
  bool stop_ = false;
  std::thread thread_;
};

class LoopbackDevice final : public Device {
 public:
  LoopbackDevice(int ordinal, int streams, std::string uuid)
      : ordinal_(ordinal), uuid_(std::move(uuid)), events_(streams, 0) {}
  ~LoopbackDevice() override { queue_.WaitIdle(); }

  std::string Describe() const override {
    return absl::StrFormat("loopback GPU %d (host memory, pid %d)", ordinal_, getpid());
  }
  std::string Uuid() const override { return uuid_; }
  int streams() const override { return static_cast<int>(events_.size()); }

  absl::StatusOr<std::shared_ptr<void>> Allocate(uint64_t bytes) override {
    const uint64_t rounded = (bytes + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, rounded == 0 ? 256 : rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrFormat("%d bytes", bytes));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ranges_[reinterpret_cast<uintptr_t>(p)] = rounded;
    }
    return std::shared_ptr<void>(p, [this](void* q) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ranges_.erase(reinterpret_cast<uintptr_t>(q));
      }
      std::free(q);
    });
  }

  absl::Status Copy(void* dst, const void* src, uint64_t bytes, int stream) override {
    queue_.Enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); });
    return absl::OkStatus();
  }
  absl::Status Record(int stream) override {
    events_[stream] = queue_.Enqueue([] {});
    return absl::OkStatus();
  }
  absl::StatusOr<bool> Done(int stream) override { return queue_.Passed(events_[stream]); }
  void Synchronize() override { queue_.WaitIdle(); }
  bool IsDeviceMemory(const void* p) const override {
    std::lock_guard<std::mutex> lock(mu_);
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) return false;
    --it;
    return a < it->first + it->second;
  }

  // Within one process only: the handle is the pid and the pointer (host memory is not
  // shareable between processes the way cudaIpcGetMemHandle shares device memory).
  absl::StatusOr<std::string> ExportBuffer(const std::shared_ptr<void>& buffer) override {
    return absl::StrFormat("%d:%d", getpid(), reinterpret_cast<uintptr_t>(buffer.get()));
  }
  absl::StatusOr<std::shared_ptr<void>> ImportBuffer(const std::string& handle) override {
    int pid = 0;
    unsigned long long ptr = 0;
    if (std::sscanf(handle.c_str(), "%d:%llu", &pid, &ptr) != 2) {
      return absl::InvalidArgumentError("not a loopback buffer handle");
    }
    if (pid != getpid()) {
      return absl::UnimplementedError(
          "the loopback stand-in shares bucket buffers only within one process");
    }
    return std::shared_ptr<void>(reinterpret_cast<void*>(static_cast<uintptr_t>(ptr)),
                                 [](void*) {});
  }

  Queue& queue() { return queue_; }

 private:
  int ordinal_;
  std::string uuid_;
  std::vector<uint64_t> events_;
  mutable std::mutex mu_;
  std::map<uintptr_t, uint64_t> ranges_;
  Queue queue_;  // last: its thread stops first
};

// Listeners made by NewUniqueId, by nonce, until the root's communicator takes its own.
std::mutex& ListenersMu() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::map<uint64_t, int>& Listeners() {
  static auto* m = new std::map<uint64_t, int>;
  return *m;
}

bool SendAll(int fd, const void* p, uint64_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::send(fd, c, std::min<uint64_t>(n, 1 << 20), MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<uint64_t>(w);
  }
  return true;
}

bool RecvAll(int fd, void* p, uint64_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::recv(fd, c, std::min<uint64_t>(n, 1 << 20), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<uint64_t>(r);
  }
  return true;
}

class LoopbackComm final : public Communicator {
 public:
  LoopbackComm(LoopbackDevice& device, uint16_t port, uint64_t nonce, int nranks, int rank)
      : device_(device),
        port_(port),
        nonce_(nonce),
        nranks_(nranks),
        rank_(rank),
        peers_(nranks, -1) {
    init_ = std::thread([this] { Init(); });
  }
  ~LoopbackComm() override {
    Abort();
    // Queued broadcasts of this communicator hold `this`: let them run out (they return at
    // once now).
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return pending_ == 0; });
    for (int fd : peers_) {
      if (fd >= 0) ::close(fd);
    }
  }

  absl::StatusOr<bool> Poll() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.ok()) return error_;
    if (aborted_) return absl::UnavailableError("loopback communicator: aborted");
    return ready_;
  }

  absl::Status Broadcast(void* buffer, uint64_t bytes, int root, int stream) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) return absl::UnavailableError("loopback communicator: aborted");
      if (!ready_) return absl::InternalError("loopback communicator: broadcast before ready");
      if (root != 0) return absl::UnimplementedError("loopback communicator: root must be 0");
      ++pending_;
    }
    device_.queue().Enqueue([this, buffer, bytes] {
      bool skip;
      {
        std::lock_guard<std::mutex> lock(mu_);
        skip = aborted_ || !error_.ok();
      }
      if (!skip) {
        std::string failure;
        if (rank_ == 0) {
          for (int r = 1; r < nranks_ && failure.empty(); ++r) {
            if (!SendAll(peers_[r], buffer, bytes)) {
              failure = absl::StrFormat("rank %d is gone (send: %s)", r, strerror(errno));
            }
          }
        } else if (!RecvAll(peers_[0], buffer, bytes)) {
          failure = absl::StrFormat("rank 0 is gone (recv: %s)", errno ? strerror(errno) : "EOF");
        }
        if (!failure.empty()) {
          std::lock_guard<std::mutex> lock(mu_);
          if (error_.ok() && !aborted_) {
            error_ = absl::UnavailableError(
                absl::StrFormat("loopback communicator rank %d of %d: %s (NCCL would report "
                                "ncclRemoteError)",
                                rank_, nranks_, failure));
          }
        }
      }
      std::lock_guard<std::mutex> lock(mu_);
      --pending_;
      cv_.notify_all();
    });
    return absl::OkStatus();
  }

  void Abort() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) return;
      aborted_ = true;
      for (int fd : peers_) {
        if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
      }
    }
    if (init_.joinable()) init_.join();
    std::lock_guard<std::mutex> lock(mu_);
    for (int& fd : peers_) {
      // Closed once no queued broadcast can use them (the destructor waits for those; until
      // then the shut-down sockets fail at once).
      if (fd >= 0 && pending_ == 0) {
        ::close(fd);
        fd = -1;
      }
    }
    if (listener_ >= 0) {
      ::close(listener_);
      listener_ = -1;
    }
  }

  int rank() const override { return rank_; }
  int nranks() const override { return nranks_; }

 private:
  bool Aborted() {
    std::lock_guard<std::mutex> lock(mu_);
    return aborted_;
  }

  void Fail(std::string why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.ok() && !aborted_) {
      error_ = absl::UnavailableError(absl::StrFormat(
          "loopback communicator rank %d of %d: initialization failed: %s", rank_, nranks_, why));
    }
  }

  void Init() {
    if (rank_ == 0) {
      {
        std::lock_guard<std::mutex> lock(ListenersMu());
        auto it = Listeners().find(nonce_);
        if (it == Listeners().end()) return Fail("no unique id made here for this communicator");
        listener_ = it->second;
        Listeners().erase(it);
      }
      int joined = 0;
      while (joined < nranks_ - 1) {
        if (Aborted()) return;
        pollfd p{listener_, POLLIN, 0};
        if (::poll(&p, 1, 50) <= 0) continue;
        const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) continue;
        uint8_t hello[12];
        if (!RecvAll(fd, hello, sizeof(hello)) || internal::LoadLe<uint64_t>(hello + 4) != nonce_) {
          ::close(fd);
          continue;
        }
        const uint32_t r = internal::LoadLe<uint32_t>(hello);
        std::lock_guard<std::mutex> lock(mu_);
        if (r == 0 || r >= static_cast<uint32_t>(nranks_) || peers_[r] >= 0 || aborted_) {
          ::close(fd);
          continue;
        }
        peers_[r] = fd;
        ++joined;
      }
    } else {
      const absl::Time give_up = absl::Now() + absl::Seconds(30);
      int fd = -1;
      while (fd < 0) {
        if (Aborted()) return;
        if (absl::Now() > give_up) return Fail("the root did not accept within 30 s");
        fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(port_);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
          ::close(fd);
          fd = -1;
          absl::SleepFor(absl::Milliseconds(10));
        }
      }
      uint8_t hello[12];
      internal::StoreLe(static_cast<uint32_t>(rank_), hello);
      internal::StoreLe(nonce_, hello + 4);
      if (!SendAll(fd, hello, sizeof(hello))) {
        ::close(fd);
        return Fail("the root closed the connection");
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) {
        ::close(fd);
        return;
      }
      peers_[0] = fd;
    }
    int one = 1;
    for (int fd : peers_) {
      if (fd >= 0) (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
    std::lock_guard<std::mutex> lock(mu_);
    ready_ = true;
  }

  LoopbackDevice& device_;
  const uint16_t port_;
  const uint64_t nonce_;
  const int nranks_;
  const int rank_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> peers_;
  int listener_ = -1;
  bool ready_ = false;
  bool aborted_ = false;
  int pending_ = 0;
  absl::Status error_;
  std::thread init_;
};

}  // namespace

internal::nccl::BackendInfo LoopbackBackend::Info() {
  return {absl::StrFormat("loopback stand-in (reporting NCCL %d)", options_.nccl_version),
          options_.nccl_version};
}

absl::StatusOr<std::unique_ptr<Device>> LoopbackBackend::OpenDevice(int ordinal, int streams) {
  const int n = devices_.fetch_add(1);
  std::string uuid =
      n < static_cast<int>(options_.uuids.size())
          ? options_.uuids[n]
          : absl::StrFormat("LOOPBACK-%d-%d-%016x", getpid(), n, internal::RandomId());
  return std::unique_ptr<Device>(
      std::make_unique<LoopbackDevice>(ordinal < 0 ? n : ordinal, streams, std::move(uuid)));
}

absl::StatusOr<UniqueId> LoopbackBackend::NewUniqueId() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::listen(fd, 128) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return absl::InternalError(absl::StrFormat("loopback unique id: %s", strerror(errno)));
  }
  const uint64_t nonce = internal::RandomId();
  {
    std::lock_guard<std::mutex> lock(ListenersMu());
    Listeners()[nonce] = fd;
  }
  UniqueId id{};
  std::memcpy(id.data(), kIdMagic, 4);
  internal::StoreLe(static_cast<uint16_t>(ntohs(a.sin_port)), id.data() + 4);
  internal::StoreLe(nonce, id.data() + 6);
  return id;
}

absl::StatusOr<std::unique_ptr<Communicator>> LoopbackBackend::StartCommunicator(Device& device,
                                                                                 const UniqueId& id,
                                                                                 int nranks,
                                                                                 int rank) {
  if (std::memcmp(id.data(), kIdMagic, 4) != 0) {
    return absl::InvalidArgumentError("not a loopback communicator's unique id");
  }
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return absl::InvalidArgumentError(absl::StrFormat("rank %d of %d", rank, nranks));
  }
  started_.fetch_add(1);
  return std::unique_ptr<Communicator>(std::make_unique<LoopbackComm>(
      static_cast<LoopbackDevice&>(device), internal::LoadLe<uint16_t>(id.data() + 4),
      internal::LoadLe<uint64_t>(id.data() + 6), nranks, rank));
}

}  // namespace weightbus::testing

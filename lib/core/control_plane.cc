// SPDX-License-Identifier: Apache-2.0
#include "core/control_plane.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace weightbus::internal::control {
namespace {

// Milliseconds until `deadline` for poll(2), rounded up, at least 0.
int PollMs(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
}

bool IsUnspecified(const sockaddr* a) {
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr == htonl(INADDR_ANY);
  }
  if (a->sa_family == AF_INET6) {
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr);
  }
  return false;
}

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { freeaddrinfo(a); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

// getaddrinfo for a stream socket. `error` gets gai_strerror text on failure.
AddrInfoPtr Resolve(const std::string& host, int port, bool passive, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
  if (rc != 0) {
    *error = rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc);
    return nullptr;
  }
  return AddrInfoPtr(result);
}

bool SameAddress(const sockaddr* a, const sockaddr* b) {
  if (a == nullptr || b == nullptr || a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                       &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

bool IsLoopbackAddress(const sockaddr* a) {
  if (a->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr) >> 24) == 127;
  }
  if (a->sa_family == AF_INET6) {
    return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr);
  }
  return false;
}

struct IfAddrsDeleter {
  void operator()(ifaddrs* a) const { freeifaddrs(a); }
};
using IfAddrsPtr = std::unique_ptr<ifaddrs, IfAddrsDeleter>;

IfAddrsPtr Interfaces() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return nullptr;
  return IfAddrsPtr(list);
}

}  // namespace

absl::Time MonotonicNow() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return absl::UnixEpoch() + absl::Seconds(ts.tv_sec) + absl::Nanoseconds(ts.tv_nsec);
}

std::string DescribeSockaddr(const sockaddr* addr, socklen_t len) {
  char host[NI_MAXHOST] = {}, serv[NI_MAXSERV] = {};
  if (getnameinfo(addr, len, host, sizeof(host), serv, sizeof(serv),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "an unprintable address";
  }
  const char* family = addr->sa_family == AF_INET    ? "IPv4"
                       : addr->sa_family == AF_INET6 ? "IPv6"
                                                     : "unknown family";
  return absl::StrFormat("%s port %s (%s)", host, serv, family);
}

bool PeerIsLocal(int fd) {
  sockaddr_storage self{}, peer{};
  socklen_t self_len = sizeof(self), peer_len = sizeof(peer);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &self_len) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
    return false;
  }
  const auto* a = reinterpret_cast<const sockaddr*>(&self);
  const auto* b = reinterpret_cast<const sockaddr*>(&peer);
  return a->sa_family == b->sa_family && (IsLoopbackAddress(b) || SameAddress(a, b));
}

std::string SocketHost(int fd, bool local) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  auto* a = reinterpret_cast<sockaddr*>(&addr);
  if ((local ? ::getsockname(fd, a, &len) : ::getpeername(fd, a, &len)) != 0) return "";
  char host[NI_MAXHOST] = {};
  if (getnameinfo(a, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return "";
  return host;
}

int LocalPort(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return 0;
}

std::string LoopbackInterface() {
  IfAddrsPtr list = Interfaces();
  for (ifaddrs* i = list.get(); i != nullptr; i = i->ifa_next) {
    if ((i->ifa_flags & IFF_LOOPBACK) != 0 && i->ifa_name != nullptr) return i->ifa_name;
  }
  return "lo";
}

std::vector<std::string> TcpInterfacesFor(const std::string& host, int port, bool listening) {
  std::vector<std::string> out;
  auto add = [&](std::string name) {
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(std::move(name));
  };
  std::string error;
  AddrInfoPtr addrs = Resolve(host, port, /*passive=*/listening, &error);
  IfAddrsPtr interfaces = Interfaces();
  for (addrinfo* a = addrs.get(); a != nullptr; a = a->ai_next) {
    sockaddr_storage local{};
    const sockaddr* mine = a->ai_addr;
    if (!listening) {
      // The local address the kernel would send from (a UDP connect sends nothing).
      Fd probe(::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
      socklen_t len = sizeof(local);
      if (!probe || ::connect(probe.get(), a->ai_addr, a->ai_addrlen) != 0 ||
          ::getsockname(probe.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0) {
        continue;
      }
      mine = reinterpret_cast<const sockaddr*>(&local);
    }
    if (IsUnspecified(mine) || IsLoopbackAddress(mine)) {
      add(LoopbackInterface());
      continue;
    }
    for (ifaddrs* i = interfaces.get(); i != nullptr; i = i->ifa_next) {
      if (i->ifa_name != nullptr && SameAddress(i->ifa_addr, mine)) add(i->ifa_name);
    }
  }
  if (out.empty()) add(LoopbackInterface());
  return out;
}

absl::StatusOr<Fd> Listen(const std::string& host, int port, std::string_view uri) {
  std::string error;
  AddrInfoPtr addrs = Resolve(host, port, /*passive=*/true, &error);
  if (addrs == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: cannot listen on host \"%s\" port %d: the name does not resolve (%s)",
                        uri, host, port, error));
  }
  std::vector<std::string> failures;
  absl::StatusCode code = absl::StatusCode::kInternal;
  for (addrinfo* a = addrs.get(); a != nullptr; a = a->ai_next) {
    const std::string where = DescribeSockaddr(a->ai_addr, a->ai_addrlen);
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
    if (!fd) {
      failures.push_back(absl::StrFormat("%s: socket: %s", where, strerror(errno)));
      continue;
    }
    int one = 1;
    (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      const int err = errno;
      if (err == EADDRINUSE) {
        code = absl::StatusCode::kFailedPrecondition;
        failures.push_back(absl::StrFormat("%s: %s (another publisher or program holds this port)",
                                           where, strerror(err)));
      } else if (err == EADDRNOTAVAIL) {
        code = absl::StatusCode::kInvalidArgument;
        failures.push_back(
            absl::StrFormat("%s: %s (not an address of this machine)", where, strerror(err)));
      } else {
        failures.push_back(absl::StrFormat("%s: bind: %s", where, strerror(err)));
      }
      continue;
    }
    if (::listen(fd.get(), 128) != 0) {
      failures.push_back(absl::StrFormat("%s: listen: %s", where, strerror(errno)));
      continue;
    }
    fd.CloseInForkedChildren();  // a forked child must not keep the port
    return fd;
  }
  return absl::Status(
      code, absl::StrFormat("%s: cannot listen on %s", uri, absl::StrJoin(failures, "; ")));
}

absl::StatusOr<Fd> Connect(const std::string& host, int port, absl::Time deadline,
                           std::string_view uri, bool once, const std::atomic<bool>* cancelled) {
  const absl::Time start = absl::Now();
  absl::Duration backoff = absl::Milliseconds(10);
  int attempts = 0;
  std::vector<std::string> last;  // the last round's error per address
  while (true) {
    ++attempts;
    last.clear();
    std::string error;
    AddrInfoPtr addrs = Resolve(host, port, /*passive=*/false, &error);
    if (addrs == nullptr) {
      last.push_back(absl::StrFormat("host \"%s\" does not resolve: %s", host, error));
    }
    for (addrinfo* a = addrs.get(); a != nullptr; a = a->ai_next) {
      const std::string where = DescribeSockaddr(a->ai_addr, a->ai_addrlen);
      if (IsUnspecified(a->ai_addr)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: host \"%s\" resolves to the wildcard address %s, which cannot be connected to; "
            "name the publisher's host or address",
            uri, host, where));
      }
      Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
      if (!fd) {
        last.push_back(absl::StrFormat("%s: socket: %s", where, strerror(errno)));
        continue;
      }
      int err = 0;
      if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          pollfd p{fd.get(), POLLOUT, 0};
          int rc;
          do {
            rc = ::poll(&p, 1, PollMs(deadline));
          } while (rc < 0 && errno == EINTR);
          if (rc == 0) {
            err = ETIMEDOUT;
          } else {
            socklen_t len = sizeof(err);
            if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
          }
        }
      }
      if (err == 0) {
        int one = 1;
        (void)::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        fd.CloseInForkedChildren();  // the publisher sees the connection close with us
        return fd;
      }
      last.push_back(absl::StrFormat(
          "%s: %s", where, err == ETIMEDOUT ? "no answer (connection timed out)" : strerror(err)));
    }
    if (once || absl::Now() >= deadline) break;
    const absl::Time wake = std::min(absl::Now() + backoff, deadline);
    while (absl::Now() < wake && (cancelled == nullptr || !cancelled->load())) {
      absl::SleepFor(std::min(absl::Milliseconds(50), wake - absl::Now()));
    }
    if (cancelled != nullptr && cancelled->load()) {
      return absl::CancelledError(
          absl::StrFormat("%s: cancelled while connecting to the publisher", uri));
    }
    backoff = std::min(backoff * 2, absl::Milliseconds(250));
  }
  return absl::UnavailableError(absl::StrFormat(
      "%s: cannot reach the publisher's rendezvous endpoint: %s (%d attempt(s) over %s, the "
      "connect timeout)",
      uri, absl::StrJoin(last, "; "), attempts, absl::FormatDuration(absl::Now() - start)));
}

bool IsWildcardHost(const std::string& host) {
  in_addr v4;
  in6_addr v6;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return v4.s_addr == htonl(INADDR_ANY);
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_UNSPECIFIED(&v6);
  return host == "*";
}

bool IsLoopbackHost(const std::string& host) {
  in_addr v4;
  in6_addr v6;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return host == "localhost";
}

absl::StatusOr<std::optional<Accepted>> AcceptOne(int listener) {
  while (true) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    const int fd =
        ::accept4(listener, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return std::nullopt;
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        return absl::ResourceExhaustedError(absl::StrFormat("accept: %s", strerror(err)));
      }
      return absl::InternalError(absl::StrFormat("accept: %s", strerror(err)));
    }
    int one = 1;
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    Accepted a{Fd(fd), DescribeSockaddr(reinterpret_cast<sockaddr*>(&addr), len)};
    a.fd.CloseInForkedChildren();  // the peer sees the connection close with us
    return a;
  }
}

FrameWriter::FrameWriter(uint8_t type) {
  buf_.resize(4);  // the length, written by Finish
  ByteWriter(&buf_).U8(type);
}

FrameWriter& FrameWriter::U8(uint8_t v) {
  ByteWriter(&buf_).U8(v);
  return *this;
}

FrameWriter& FrameWriter::U32(uint32_t v) {
  ByteWriter(&buf_).U32(v);
  return *this;
}

FrameWriter& FrameWriter::U64(uint64_t v) {
  ByteWriter(&buf_).U64(v);
  return *this;
}

FrameWriter& FrameWriter::Str(std::string_view s) {
  ByteWriter(&buf_).U32(static_cast<uint32_t>(s.size())).Bytes(s);
  return *this;
}

FrameWriter& FrameWriter::Raw(std::string_view bytes) {
  ByteWriter(&buf_).Bytes(bytes);
  return *this;
}

std::string FrameWriter::Body() { return buf_.substr(5); }

std::string FrameWriter::Finish() {
  StoreLe(static_cast<uint32_t>(buf_.size() - 4), buf_.data());
  return std::move(buf_);
}

std::string Reader::Str() {
  const uint32_t n = U32();
  absl::StatusOr<std::string_view> s = r_.View(n, "a string");
  return s.ok() ? std::string(*s) : std::string();
}

bool MessageFields::Flag(std::string_view what) {
  const uint8_t v = U8(what);
  if (v > 1 && status_.ok()) {
    status_ = absl::DataLossError(absl::StrFormat("%s is %d, expected 0 or 1", what, v));
  }
  return v == 1;
}

std::string_view MessageFields::View(std::string_view what) {
  const uint32_t n = U32(absl::StrFormat("%s's length", what));
  if (!status_.ok()) return {};
  return Keep(r_.View(n, what));
}

uint32_t MessageFields::Count(std::string_view what, size_t min_bytes) {
  const uint32_t n = U32(absl::StrFormat("the number of %s", what));
  if (status_.ok() && uint64_t{n} * min_bytes > r_.remaining()) {
    status_ = absl::DataLossError(
        absl::StrFormat("claims %d %s of at least %d bytes each but only %d bytes remain", n, what,
                        min_bytes, r_.remaining()));
    return 0;
  }
  return n;
}

std::vector<uint64_t> MessageFields::U64s(std::string_view what) {
  const uint32_t n = Count(what, 8);
  std::vector<uint64_t> out;
  out.reserve(n);
  for (uint32_t k = 0; k < n && ok(); ++k) out.push_back(U64(what));
  return out;
}

void MessageFields::Fail(std::string message) {
  if (status_.ok()) status_ = absl::DataLossError(std::move(message));
}

FrameWriter& WriteU64s(FrameWriter& w, const std::vector<uint64_t>& values) {
  w.U32(static_cast<uint32_t>(values.size()));
  for (uint64_t v : values) w.U64(v);
  return w;
}

absl::StatusCode StatusCodeFromWire(uint32_t code, absl::StatusCode fallback) {
  if (code == 0 || code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return fallback;
  }
  return static_cast<absl::StatusCode>(code);
}

std::optional<uint64_t> LeadingId(std::string_view payload) {
  if (payload.size() < 8) return std::nullopt;
  return LoadLe<uint64_t>(payload.data());
}

absl::StatusOr<std::optional<RawFrame>> TakeRawFrame(std::string& buffer, uint32_t max_frame) {
  if (buffer.size() < 4) return std::nullopt;
  const uint32_t n = LoadLe<uint32_t>(buffer.data());
  if (n == 0 || n > max_frame) {
    return absl::DataLossError(absl::StrFormat(
        "malformed control frame: payload length %d (must be 1..%d)", n, max_frame));
  }
  if (buffer.size() < 4 + size_t{n}) return std::nullopt;
  RawFrame f{static_cast<uint8_t>(buffer[4]), buffer.substr(5, n - 1)};
  buffer.erase(0, 4 + size_t{n});
  return f;
}

absl::StatusOr<bool> ReadAvailable(int fd, std::string& buffer, size_t max_buffer) {
  char chunk[64 * 1024];
  while (buffer.size() < max_buffer) {
    const size_t room = std::min(sizeof(chunk), max_buffer - buffer.size());
    const ssize_t n = ::recv(fd, chunk, room, MSG_DONTWAIT);
    if (n > 0) {
      buffer.append(chunk, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) return false;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
    return absl::UnavailableError(absl::StrFormat("connection broke: %s", strerror(errno)));
  }
  return true;
}

absl::Status WriteAvailable(int fd, std::string& buffer) {
  size_t done = 0;
  while (done < buffer.size()) {
    const ssize_t n =
        ::send(fd, buffer.data() + done, buffer.size() - done, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    buffer.erase(0, done);
    return absl::UnavailableError(absl::StrFormat("connection broke: %s", strerror(errno)));
  }
  buffer.erase(0, done);
  return absl::OkStatus();
}

absl::Status FrameStream::Send(std::string frame, absl::Time deadline) {
  if (!fd_) return absl::UnavailableError(absl::StrFormat("%s: not connected", peer_));
  bytes_sent_ += frame.size();
  while (true) {
    absl::Status s = WriteAvailable(fd_.get(), frame);
    if (!s.ok()) {
      return absl::UnavailableError(absl::StrFormat("%s: %s", peer_, s.message()));
    }
    if (frame.empty()) return absl::OkStatus();
    pollfd p{fd_.get(), POLLOUT, 0};
    const int rc = ::poll(&p, 1, PollMs(deadline));
    if (rc == 0 && absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrFormat("%s: could not send a control message by the deadline", peer_));
    }
  }
}

absl::StatusOr<std::optional<RawFrame>> FrameStream::Poll() {
  if (!fd_) return absl::UnavailableError(absl::StrFormat("%s: not connected", peer_));
  absl::StatusOr<std::optional<RawFrame>> f = TakeRawFrame(in_, max_frame_);
  if (!f.ok() || f->has_value()) return f;
  const size_t before = in_.size();
  absl::StatusOr<bool> open = ReadAvailable(fd_.get(), in_);
  bytes_received_ += in_.size() - before;
  if (!open.ok()) {
    return absl::UnavailableError(absl::StrFormat("%s: %s", peer_, open.status().message()));
  }
  f = TakeRawFrame(in_, max_frame_);
  if (!f.ok() || f->has_value()) return f;
  if (!*open) {
    return absl::UnavailableError(absl::StrFormat(
        "%s closed the control connection (the publisher exited or crashed)", peer_));
  }
  return std::nullopt;
}

absl::StatusOr<RawFrame> FrameStream::Receive(absl::Time deadline) {
  while (true) {
    absl::StatusOr<std::optional<RawFrame>> f = Poll();
    if (!f.ok()) return f.status();
    if (f->has_value()) return **std::move(f);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrFormat("%s: no answer by the deadline", peer_));
    }
    pollfd p{fd_.get(), POLLIN, 0};
    (void)::poll(&p, 1, PollMs(deadline));
  }
}

}  // namespace weightbus::internal::control

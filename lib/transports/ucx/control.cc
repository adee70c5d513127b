// SPDX-License-Identifier: Apache-2.0
#include "transports/ucx/control.h"

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

namespace weightbus::internal::ucx {
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

std::string_view MsgTypeName(MsgType type) {
  switch (type) {
    case MsgType::kHello:
      return "HELLO";
    case MsgType::kWelcome:
      return "WELCOME";
    case MsgType::kChallenge:
      return "CHALLENGE";
    case MsgType::kProof:
      return "PROOF";
    case MsgType::kAborted:
      return "ABORTED";
    case MsgType::kError:
      return "ERROR";
    case MsgType::kWait:
      return "WAIT";
    case MsgType::kGrant:
      return "GRANT";
    case MsgType::kRefused:
      return "REFUSED";
    case MsgType::kCancel:
      return "CANCEL";
    case MsgType::kRenew:
      return "RENEW";
    case MsgType::kRelease:
      return "RELEASE";
    case MsgType::kReleased:
      return "RELEASED";
    case MsgType::kAccepted:
      return "ACCEPTED";
    case MsgType::kList:
      return "LIST";
    case MsgType::kVersions:
      return "VERSIONS";
    case MsgType::kRenewed:
      return "RENEWED";
    case MsgType::kRead:
      return "READ";
    case MsgType::kData:
      return "DATA";
    case MsgType::kKeyframeRequest:
      return "KEYFRAME_REQUEST";
    case MsgType::kJoin:
      return "JOIN";
    case MsgType::kJoined:
      return "JOINED";
    case MsgType::kPart:
      return "PART";
    case MsgType::kWithdraw:
      return "WITHDRAW";
    case MsgType::kOutcome:
      return "OUTCOME";
  }
  return "UNKNOWN";
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

Writer::Writer(MsgType type) {
  buf_.resize(4);  // the length, written by Finish
  ByteWriter(&buf_).U8(static_cast<uint8_t>(type));
}

Writer& Writer::U8(uint8_t v) {
  ByteWriter(&buf_).U8(v);
  return *this;
}

Writer& Writer::U32(uint32_t v) {
  ByteWriter(&buf_).U32(v);
  return *this;
}

Writer& Writer::U64(uint64_t v) {
  ByteWriter(&buf_).U64(v);
  return *this;
}

Writer& Writer::Str(std::string_view s) {
  ByteWriter(&buf_).U32(static_cast<uint32_t>(s.size())).Bytes(s);
  return *this;
}

Writer& Writer::Raw(std::string_view bytes) {
  ByteWriter(&buf_).Bytes(bytes);
  return *this;
}

std::string Writer::Body() { return buf_.substr(5); }

std::string Writer::Finish() {
  StoreLe(static_cast<uint32_t>(buf_.size() - 4), buf_.data());
  return std::move(buf_);
}

std::string Reader::Str() {
  const uint32_t n = U32();
  absl::StatusOr<std::string_view> s = r_.View(n, "a string");
  return s.ok() ? std::string(*s) : std::string();
}

namespace {

// Reads one message's fields in order; the first failure is kept (later reads return 0 or empty)
// and reported by Done, worded with the message's name and size.
class Fields {
 public:
  Fields(MsgType type, std::string_view payload)
      : type_(type), size_(payload.size()), r_(payload) {}

  uint64_t U64(std::string_view what) { return Keep(r_.U64(what)); }
  uint32_t U32(std::string_view what) { return Keep(r_.U32(what)); }
  uint8_t U8(std::string_view what) { return Keep(r_.U8(what)); }
  bool Flag(std::string_view what) {
    const uint8_t v = U8(what);
    if (v > 1 && status_.ok()) {
      status_ = absl::DataLossError(absl::StrFormat("%s is %d, expected 0 or 1", what, v));
    }
    return v == 1;
  }
  std::string Str(std::string_view what) { return std::string(View(what)); }
  // A string in place (a view of the payload).
  std::string_view View(std::string_view what) {
    const uint32_t n = U32(absl::StrFormat("%s's length", what));
    if (!status_.ok()) return {};
    return Keep(r_.View(n, what));
  }
  // A count of elements of at least `min_bytes` each: more than the rest of the message can
  // hold is refused before anything is allocated for them.
  uint32_t Count(std::string_view what, size_t min_bytes) {
    const uint32_t n = U32(absl::StrFormat("the number of %s", what));
    if (status_.ok() && uint64_t{n} * min_bytes > r_.remaining()) {
      status_ = absl::DataLossError(
          absl::StrFormat("claims %d %s of at least %d bytes each but only %d bytes remain", n,
                          what, min_bytes, r_.remaining()));
      return 0;
    }
    return n;
  }
  bool ok() const { return status_.ok(); }
  size_t remaining() const { return r_.remaining(); }

  // The message, or the first failure; with `exact`, bytes after the last field are one too.
  template <typename T>
  absl::StatusOr<T> Done(T message, bool exact = true) {
    if (status_.ok() && exact && !r_.at_end()) {
      status_ =
          absl::DataLossError(absl::StrFormat("%d bytes follow the last field", r_.remaining()));
    }
    if (!status_.ok()) {
      return absl::DataLossError(absl::StrFormat("malformed %s message (%d bytes): %s",
                                                 MsgTypeName(type_), size_, status_.message()));
    }
    return message;
  }

 private:
  // The value read, or T{} once anything failed (a count read after a failure must not be used
  // to size anything).
  template <typename T>
  T Keep(absl::StatusOr<T> v) {
    if (!status_.ok()) return T{};
    if (v.ok()) return *v;
    if (status_.ok()) status_ = v.status();
    return T{};
  }

  MsgType type_;
  size_t size_;
  ByteReader r_;
  absl::Status status_;
};

Writer& U64s(Writer& w, const std::vector<uint64_t>& values) {
  w.U32(static_cast<uint32_t>(values.size()));
  for (uint64_t v : values) w.U64(v);
  return w;
}

std::vector<uint64_t> U64s(Fields& f, std::string_view what) {
  const uint32_t n = f.Count(what, 8);
  std::vector<uint64_t> out;
  out.reserve(n);
  for (uint32_t k = 0; k < n && f.ok(); ++k) out.push_back(f.U64(what));
  return out;
}

}  // namespace

std::string Encode(const HelloMsg& m) {
  Writer w(MsgType::kHello);
  w.Str(m.magic).U32(m.protocol).Str(m.channel).U64(m.subscriber_id).Str(m.description);
  if (!m.nonce.empty()) w.Str(m.nonce);
  return w.Finish();
}

std::string Encode(const ChallengeMsg& m) {
  return Writer(MsgType::kChallenge).Str(m.publisher_nonce).Str(m.proof).Finish();
}

std::string Encode(const ProofMsg& m) { return Writer(MsgType::kProof).Str(m.proof).Finish(); }

std::string Encode(const WelcomeMsg& m) {
  return Writer(MsgType::kWelcome)
      .U32(m.protocol)
      .U64(m.session_id)
      .Str(m.worker_address)
      .U64(m.lease_ns)
      .U8(m.has_newest)
      .U64(m.newest)
      .Str(m.description)
      .U8(m.bytes_over_control)
      .Finish();
}

std::string Encode(const ErrorMsg& m) {
  return Writer(MsgType::kError).U32(m.code).Str(m.message).Finish();
}

std::string Encode(const WaitMsg& m) {
  return Writer(MsgType::kWait).U64(m.request).U64(m.version).U8(m.mode).Finish();
}

std::string Encode(const GrantMsg& m) {
  const GrantRegion& d = m.descriptor;
  return Writer(MsgType::kGrant)
      .U64(m.request)
      .U64(m.lease)
      .U64(m.lease_ns)
      .U64(m.version)
      .U64(d.id)
      .U64(d.base)
      .U64(d.address)
      .U64(d.length)
      .Str(d.rkey)
      .U64(m.prefix)
      .Finish();
}

std::string Encode(const AbortedMsg& m) {
  return Writer(MsgType::kAborted).U64(m.lease).U32(m.code).Str(m.message).Finish();
}

std::string Encode(const RefusedMsg& m) {
  return Writer(MsgType::kRefused).U64(m.request).U32(m.code).Str(m.message).Finish();
}

std::string Encode(const CancelMsg& m) { return Writer(MsgType::kCancel).U64(m.request).Finish(); }

std::string Encode(const RenewMsg& m) { return Writer(MsgType::kRenew).U64(m.lease).Finish(); }

std::string Encode(const ReleaseMsg& m) {
  return Writer(MsgType::kRelease).U64(m.lease).U8(m.ack).Finish();
}

std::string Encode(const ReleasedMsg& m) {
  return Writer(MsgType::kReleased).U64(m.lease).U8(m.valid).Finish();
}

std::string Encode(const AcceptedMsg& m) {
  return Writer(MsgType::kAccepted).U64(m.version).Finish();
}

std::string Encode(const ListMsg& m) { return Writer(MsgType::kList).U64(m.request).Finish(); }

std::string Encode(const VersionsMsg& m) {
  Writer w(MsgType::kVersions);
  w.U64(m.request);
  return U64s(w, m.versions).Finish();
}

std::string Encode(const RenewedMsg& m) {
  return Writer(MsgType::kRenewed).U64(m.lease).U8(m.valid).Finish();
}

std::string Encode(const ReadMsg& m) {
  return Writer(MsgType::kRead).U64(m.request).U64(m.lease).U64(m.offset).U64(m.length).Finish();
}

std::string Encode(const DataMsg& m) {
  return Writer(MsgType::kData).U64(m.request).U8(m.ok).Str(m.bytes).Finish();
}

std::string Encode(const KeyframeRequestMsg& m) {
  return Writer(MsgType::kKeyframeRequest)
      .U64(m.version)
      .U8(m.has_holds)
      .U64(m.holds)
      .Str(std::string_view(m.reason).substr(0, kMaxKeyframeReason))
      .Finish();
}

std::string Encode(const JoinMsg& m) {
  return Writer(MsgType::kJoin)
      .Str(m.magic)
      .U32(m.protocol)
      .Str(m.channel)
      .U32(m.rank)
      .U32(m.world_size)
      .U32(m.port)
      .Str(m.description)
      .Finish();
}

std::string Encode(const JoinedMsg& m) {
  return Writer(MsgType::kJoined).U32(m.world_size).Str(m.description).Finish();
}

std::string Encode(const PartMsg& m) {
  return Writer(MsgType::kPart).U64(m.version).Str(m.manifest_json).Finish();
}

std::string Encode(const WithdrawMsg& m) {
  return Writer(MsgType::kWithdraw).U64(m.version).Finish();
}

std::string Encode(const OutcomeMsg& m) {
  return Writer(MsgType::kOutcome).U64(m.version).U32(m.code).Str(m.message).Finish();
}

absl::StatusOr<JoinMsg> DecodeJoin(std::string_view payload) {
  Fields f(MsgType::kJoin, payload);
  JoinMsg m;
  m.magic = f.Str("the magic");
  m.protocol = f.U32("the protocol");
  m.channel = f.Str("the channel");
  m.rank = f.U32("the rank");
  m.world_size = f.U32("the world size");
  m.port = f.U32("the port");
  m.description = f.Str("the description");
  return f.Done(std::move(m), /*exact=*/false);
}

absl::StatusOr<JoinedMsg> DecodeJoined(std::string_view payload) {
  Fields f(MsgType::kJoined, payload);
  JoinedMsg m;
  m.world_size = f.U32("the world size");
  m.description = f.Str("the description");
  return f.Done(std::move(m), /*exact=*/false);
}

absl::StatusOr<PartMsg> DecodePart(std::string_view payload) {
  Fields f(MsgType::kPart, payload);
  PartMsg m;
  m.version = f.U64("the version");
  m.manifest_json = f.Str("the manifest");
  return f.Done(std::move(m));
}

absl::StatusOr<WithdrawMsg> DecodeWithdraw(std::string_view payload) {
  Fields f(MsgType::kWithdraw, payload);
  WithdrawMsg m;
  m.version = f.U64("the version");
  return f.Done(m);
}

absl::StatusOr<OutcomeMsg> DecodeOutcome(std::string_view payload) {
  Fields f(MsgType::kOutcome, payload);
  OutcomeMsg m;
  m.version = f.U64("the version");
  m.code = f.U32("the status code");
  m.message = f.Str("the message");
  return f.Done(std::move(m));
}

absl::StatusOr<HelloMsg> DecodeHello(std::string_view payload) {
  Fields f(MsgType::kHello, payload);
  HelloMsg m;
  m.magic = f.Str("the magic");
  m.protocol = f.U32("the protocol");
  m.channel = f.Str("the channel");
  m.subscriber_id = f.U64("the subscriber id");
  m.description = f.Str("the description");
  // The nonce of a shared-secret channel: a string that ends the message exactly. Other trailing
  // bytes (a later protocol version's fields) are left alone.
  const size_t fields = payload.size() - f.remaining();
  if (f.ok() && f.remaining() >= 4) {
    ByteReader rest(payload.substr(fields));
    const absl::StatusOr<uint32_t> n = rest.U32("the nonce's length");
    if (n.ok() && *n == rest.remaining()) m.nonce = std::string(payload.substr(fields + 4));
  }
  return f.Done(std::move(m), /*exact=*/false);
}

absl::StatusOr<ChallengeMsg> DecodeChallenge(std::string_view payload) {
  Fields f(MsgType::kChallenge, payload);
  ChallengeMsg m;
  m.publisher_nonce = f.Str("the publisher nonce");
  m.proof = f.Str("the proof");
  return f.Done(std::move(m));
}

absl::StatusOr<ProofMsg> DecodeProof(std::string_view payload) {
  Fields f(MsgType::kProof, payload);
  ProofMsg m;
  m.proof = f.Str("the proof");
  return f.Done(std::move(m));
}

absl::StatusOr<WelcomeMsg> DecodeWelcome(std::string_view payload) {
  Fields f(MsgType::kWelcome, payload);
  WelcomeMsg m;
  m.protocol = f.U32("the protocol");
  m.session_id = f.U64("the session id");
  m.worker_address = f.Str("the worker address");
  m.lease_ns = f.U64("the lease");
  m.has_newest = f.Flag("has_newest");
  m.newest = f.U64("the newest version");
  m.description = f.Str("the description");
  m.bytes_over_control = f.Flag("bytes_over_control");
  return f.Done(std::move(m), /*exact=*/false);
}

absl::StatusOr<ErrorMsg> DecodeError(std::string_view payload) {
  Fields f(MsgType::kError, payload);
  ErrorMsg m;
  m.code = f.U32("the status code");
  m.message = f.Str("the message");
  return f.Done(std::move(m), /*exact=*/false);
}

absl::StatusOr<WaitMsg> DecodeWait(std::string_view payload) {
  Fields f(MsgType::kWait, payload);
  WaitMsg m;
  m.request = f.U64("the request id");
  m.version = f.U64("the version");
  m.mode = f.U8("the mode");
  absl::StatusOr<WaitMsg> out = f.Done(m);
  if (out.ok() && m.mode > kWaitNewestNow) {
    return absl::DataLossError(absl::StrFormat(
        "malformed WAIT message (%d bytes): mode %d, expected 0 (newest), 1 (exact) or 2 (newest "
        "now)",
        payload.size(), m.mode));
  }
  return out;
}

absl::StatusOr<GrantMsg> DecodeGrant(std::string_view payload) {
  Fields f(MsgType::kGrant, payload);
  GrantMsg m;
  m.request = f.U64("the request id");
  m.lease = f.U64("the lease id");
  m.lease_ns = f.U64("the lease");
  m.version = f.U64("the version");
  m.descriptor.id = f.U64("the descriptor region id");
  m.descriptor.base = f.U64("the descriptor base");
  m.descriptor.address = f.U64("the descriptor address");
  m.descriptor.length = f.U64("the descriptor length");
  m.descriptor.rkey = f.Str("the descriptor rkey");
  m.prefix = f.U64("the descriptor prefix");
  return f.Done(std::move(m));
}

absl::StatusOr<AbortedMsg> DecodeAborted(std::string_view payload) {
  Fields f(MsgType::kAborted, payload);
  AbortedMsg m;
  m.lease = f.U64("the lease id");
  m.code = f.U32("the status code");
  m.message = f.Str("the message");
  return f.Done(std::move(m));
}

absl::StatusOr<RefusedMsg> DecodeRefused(std::string_view payload) {
  Fields f(MsgType::kRefused, payload);
  RefusedMsg m;
  m.request = f.U64("the request id");
  m.code = f.U32("the status code");
  m.message = f.Str("the message");
  return f.Done(std::move(m));
}

absl::StatusOr<CancelMsg> DecodeCancel(std::string_view payload) {
  Fields f(MsgType::kCancel, payload);
  CancelMsg m;
  m.request = f.U64("the request id");
  return f.Done(m);
}

absl::StatusOr<RenewMsg> DecodeRenew(std::string_view payload) {
  Fields f(MsgType::kRenew, payload);
  RenewMsg m;
  m.lease = f.U64("the lease id");
  return f.Done(m);
}

absl::StatusOr<ReleaseMsg> DecodeRelease(std::string_view payload) {
  Fields f(MsgType::kRelease, payload);
  ReleaseMsg m;
  m.lease = f.U64("the lease id");
  m.ack = f.Flag("ack");
  return f.Done(m);
}

absl::StatusOr<ReleasedMsg> DecodeReleased(std::string_view payload) {
  Fields f(MsgType::kReleased, payload);
  ReleasedMsg m;
  m.lease = f.U64("the lease id");
  m.valid = f.Flag("valid");
  return f.Done(m);
}

absl::StatusOr<AcceptedMsg> DecodeAccepted(std::string_view payload) {
  Fields f(MsgType::kAccepted, payload);
  AcceptedMsg m;
  m.version = f.U64("the version");
  return f.Done(m);
}

absl::StatusOr<ListMsg> DecodeList(std::string_view payload) {
  Fields f(MsgType::kList, payload);
  ListMsg m;
  m.request = f.U64("the request id");
  return f.Done(m);
}

absl::StatusOr<VersionsMsg> DecodeVersions(std::string_view payload) {
  Fields f(MsgType::kVersions, payload);
  VersionsMsg m;
  m.request = f.U64("the request id");
  m.versions = U64s(f, "versions");
  return f.Done(std::move(m));
}

absl::StatusOr<RenewedMsg> DecodeRenewed(std::string_view payload) {
  Fields f(MsgType::kRenewed, payload);
  RenewedMsg m;
  m.lease = f.U64("the lease id");
  m.valid = f.Flag("valid");
  return f.Done(m);
}

absl::StatusOr<ReadMsg> DecodeRead(std::string_view payload) {
  Fields f(MsgType::kRead, payload);
  ReadMsg m;
  m.request = f.U64("the request id");
  m.lease = f.U64("the lease id");
  m.offset = f.U64("the offset");
  m.length = f.U64("the length");
  return f.Done(m);
}

absl::StatusOr<DataMsg> DecodeData(std::string_view payload) {
  Fields f(MsgType::kData, payload);
  DataMsg m;
  m.request = f.U64("the request id");
  m.ok = f.Flag("ok");
  m.bytes = f.View("the bytes");
  return f.Done(std::move(m));
}

absl::StatusOr<KeyframeRequestMsg> DecodeKeyframeRequest(std::string_view payload) {
  Fields f(MsgType::kKeyframeRequest, payload);
  KeyframeRequestMsg m;
  m.version = f.U64("the version");
  m.has_holds = f.Flag("has_holds");
  m.holds = f.U64("the version held");
  const std::string_view reason = f.View("the reason");
  if (f.ok() && reason.size() > kMaxKeyframeReason) {
    return absl::DataLossError(
        absl::StrFormat("malformed KEYFRAME_REQUEST message (%d bytes): the reason is %d bytes, "
                        "at most %d",
                        payload.size(), reason.size(), kMaxKeyframeReason));
  }
  m.reason = std::string(reason);
  return f.Done(std::move(m));
}

absl::StatusCode StatusCodeFromWire(uint32_t code, absl::StatusCode fallback) {
  if (code == 0 || code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return fallback;
  }
  return static_cast<absl::StatusCode>(code);
}

absl::Status ErrorStatus(std::string_view payload, std::string_view prefix) {
  absl::StatusOr<ErrorMsg> e = DecodeError(payload);
  if (!e.ok()) {
    return absl::UnavailableError(
        absl::StrFormat("%sthe publisher sent a %s", prefix, e.status().message()));
  }
  return absl::Status(StatusCodeFromWire(e->code, absl::StatusCode::kUnavailable),
                      absl::StrFormat("%s%s", prefix, e->message));
}

std::optional<uint64_t> LeadingId(std::string_view payload) {
  if (payload.size() < 8) return std::nullopt;
  return LoadLe<uint64_t>(payload.data());
}

absl::StatusOr<std::optional<Frame>> TakeFrame(std::string& buffer, uint32_t max_frame) {
  if (buffer.size() < 4) return std::nullopt;
  const uint32_t n = LoadLe<uint32_t>(buffer.data());
  if (n == 0 || n > max_frame) {
    return absl::DataLossError(absl::StrFormat(
        "malformed control frame: payload length %d (must be 1..%d)", n, max_frame));
  }
  if (buffer.size() < 4 + size_t{n}) return std::nullopt;
  Frame f{static_cast<MsgType>(static_cast<uint8_t>(buffer[4])), buffer.substr(5, n - 1)};
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

absl::Status ControlStream::Send(std::string frame, absl::Time deadline) {
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

absl::StatusOr<std::optional<Frame>> ControlStream::Poll() {
  if (!fd_) return absl::UnavailableError(absl::StrFormat("%s: not connected", peer_));
  absl::StatusOr<std::optional<Frame>> f = TakeFrame(in_);
  if (!f.ok() || f->has_value()) return f;
  const size_t before = in_.size();
  absl::StatusOr<bool> open = ReadAvailable(fd_.get(), in_);
  bytes_received_ += in_.size() - before;
  if (!open.ok()) {
    return absl::UnavailableError(absl::StrFormat("%s: %s", peer_, open.status().message()));
  }
  f = TakeFrame(in_);
  if (!f.ok() || f->has_value()) return f;
  if (!*open) {
    return absl::UnavailableError(absl::StrFormat(
        "%s closed the control connection (the publisher exited or crashed)", peer_));
  }
  return std::nullopt;
}

absl::StatusOr<Frame> ControlStream::Receive(absl::Time deadline) {
  while (true) {
    absl::StatusOr<std::optional<Frame>> f = Poll();
    if (!f.ok()) return f.status();
    if (f->has_value()) return **std::move(f);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrFormat("%s: no answer by the deadline", peer_));
    }
    pollfd p{fd_.get(), POLLIN, 0};
    (void)::poll(&p, 1, PollMs(deadline));
  }
}

}  // namespace weightbus::internal::ucx

// SPDX-License-Identifier: Apache-2.0
// The rendezvous (control) protocol of ucx://: small framed messages over one TCP connection per
// subscriber, to HOST:PORT of the URI. It carries the greeting, requests for versions, grants
// (manifest, staging-slot addresses and packed rkeys), lease renewals and releases. No tensor
// byte travels here: those move with one-sided UCP gets. Wire format: docs/FORMAT.md, "ucx://".
//
// Every integer is little-endian. A frame is a u32 payload length followed by the payload, whose
// first byte is the message type. Strings and byte blobs are a u32 length and the bytes.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/bytes.h"
#include "core/system.h"

namespace weightbus::internal::ucx {

inline constexpr char kMagic[] = "weightbus-ucx";
inline constexpr uint32_t kProtocolVersion = 2;
// Largest frame accepted (a manifest of a very large model fits many times over).
inline constexpr uint32_t kMaxFrame = uint32_t{1} << 30;
// Largest frame a publisher accepts from a subscriber: every message a subscriber sends is a
// few integers, or HELLO's channel name (<= 1024 bytes) and description. A frame header that
// declares more is DataLoss before any of its bytes is buffered.
inline constexpr uint32_t kMaxRequestFrame = uint32_t{64} << 10;

enum class MsgType : uint8_t {
  kHello = 1,      // sub -> pub: magic, protocol, channel, subscriber id, description
  kWelcome = 2,    // pub -> sub: protocol, session id, worker address, lease, newest, description
  kError = 3,      // pub -> sub: status code and message; the publisher then closes
  kWait = 4,       // sub -> pub: request id, version, mode (0 newest >=, 1 exact, 2 newest >= now)
  kGrant = 5,      // pub -> sub: the version, its manifest and where its bytes are
  kRefused = 6,    // pub -> sub: request id, status code, message (e.g. exact version not held)
  kCancel = 7,     // sub -> pub: request id (a WAIT whose caller gave up)
  kRenew = 8,      // sub -> pub: lease id
  kRelease = 9,    // sub -> pub: lease id, whether an acknowledgement is wanted
  kReleased = 10,  // pub -> sub: lease id, whether the lease was still valid when released
  kAccepted = 11,  // sub -> pub: a version the subscriber verified and handed over
  kList = 12,      // sub -> pub: request id
  kVersions = 13,  // pub -> sub: request id, versions held, ascending
  kRenewed = 14,   // pub -> sub: lease id, whether the lease was still valid (and now extended)
  kRead = 15,      // sub -> pub: request id, lease id, offset in the slot, length (bytes over
                   // the control connection, when WELCOME said so)
  kData = 16,      // pub -> sub: request id, ok flag, the bytes (or, not ok, why not)
  // Shared-secret channels (core/secret.h): HELLO then ends with the subscriber's nonce; the
  // publisher answers CHALLENGE instead of WELCOME, and WELCOME follows a valid PROOF.
  kChallenge = 17,  // pub -> sub: the publisher's nonce and its proof over both nonces
  kProof = 18,      // sub -> pub: the subscriber's proof over both nonces
};

std::string_view MsgTypeName(MsgType type);

// A monotonic clock as absl::Time (CLOCK_MONOTONIC since boot), for leases: wall-clock steps
// must neither expire a lease early nor extend it.
absl::Time MonotonicNow();

using Fd = ::weightbus::internal::UniqueFd;

// "127.0.0.1 port 5555 (IPv4)" or "::1 port 5555 (IPv6)".
std::string DescribeSockaddr(const sockaddr* addr, socklen_t len);

// Whether the peer of connected socket `fd` is on this host: its address is a loopback one or
// the socket's own local address.
bool PeerIsLocal(int fd);

// The name of this host's loopback network interface ("lo" on Linux).
std::string LoopbackInterface();

// The network interfaces ("eth0", "lo") that carry a channel's traffic on this host, to which
// Context::Create confines the TCP listeners UCX's own tcp transport opens: for a publisher
// (`listening`) the interfaces that own `host`'s addresses, and the loopback interface for a
// loopback or wildcard host (weightbus moves no byte over UCX's tcp: where only tcp links two
// processes, the bytes go over the control connection); for a subscriber the interfaces the
// kernel routes to `host`'s addresses through. Never empty: the loopback interface when nothing
// matches (a host that does not resolve fails in Listen or Connect, naming it).
std::vector<std::string> TcpInterfacesFor(const std::string& host, int port, bool listening);

// Listens on host:port (a name, an address or a wildcard). Errors name the address, family and
// port: FailedPrecondition when the port is in use, InvalidArgument when the host does not
// resolve, Internal otherwise.
absl::StatusOr<Fd> Listen(const std::string& host, int port, std::string_view uri);

// Connects to host:port, trying every address the name resolves to, retrying refused and
// unreachable attempts until `deadline` (a publisher may be starting). Refuses wildcard
// addresses. Errors: Unavailable naming each address, family and port with the last error;
// InvalidArgument for a wildcard or a name that does not resolve.
// With `once`, a single round of attempts is made (a refused one fails at once; one in progress
// may take until `deadline`). When `*cancelled` becomes true, retrying stops within about 50 ms
// (Cancelled).
absl::StatusOr<Fd> Connect(const std::string& host, int port, absl::Time deadline,
                           std::string_view uri, bool once = false,
                           const std::atomic<bool>* cancelled = nullptr);

// Builds one frame.
class Writer {
 public:
  explicit Writer(MsgType type);
  Writer& U8(uint8_t v);
  Writer& U32(uint32_t v);
  Writer& U64(uint64_t v);
  Writer& Str(std::string_view s);
  // Appends bytes as they are (a part of a message built earlier by another Writer's Body()).
  Writer& Raw(std::string_view bytes);
  // What was written after the type byte (no length prefix), for Raw.
  std::string Body();
  // The complete frame (length prefix included).
  std::string Finish();

 private:
  std::string buf_;
};

// Parses one frame's payload (after the type byte), over the core's ByteReader. Reads past the
// end or oversized lengths make ok() false (and read as 0 or empty); callers check once at the
// end.
class Reader {
 public:
  explicit Reader(std::string_view payload) : r_(payload) {}
  uint8_t U8() { return r_.U8("a u8").value_or(0); }
  uint32_t U32() { return r_.U32("a u32").value_or(0); }
  uint64_t U64() { return r_.U64("a u64").value_or(0); }
  std::string Str();
  bool ok() const { return r_.status().ok(); }
  bool at_end() const { return r_.at_end(); }

 private:
  ByteReader r_;
};

struct Frame {
  MsgType type;
  std::string payload;  // without the type byte
};

// Removes one complete frame from the front of `buffer`, if there is one.
// Errors: DataLoss for a frame whose header declares more than `max_frame` payload bytes (known
// from its first 4 bytes) or no type byte.
absl::StatusOr<std::optional<Frame>> TakeFrame(std::string& buffer, uint32_t max_frame = kMaxFrame);

// Reads what is available on non-blocking `fd` into `buffer`, until the socket has no more or
// `buffer` holds at least `max_buffer` bytes (the rest stays in the socket: the peer is slowed
// down, not buffered without bound). Returns false on EOF.
// Errors: Unavailable with the errno text (connection reset).
absl::StatusOr<bool> ReadAvailable(int fd, std::string& buffer,
                                   size_t max_buffer = std::numeric_limits<size_t>::max());

// Writes as much of `buffer` as the socket takes now and erases it from the front.
// Errors: Unavailable with the errno text.
absl::Status WriteAvailable(int fd, std::string& buffer);

// A blocking, deadline-bounded conversation over a connected socket (the subscriber's side).
class ControlStream {
 public:
  ControlStream() = default;
  ControlStream(Fd fd, std::string peer) : fd_(std::move(fd)), peer_(std::move(peer)) {}
  bool connected() const { return static_cast<bool>(fd_); }
  const std::string& peer() const { return peer_; }
  void set_peer(std::string peer) { peer_ = std::move(peer); }
  int fd() const { return fd_.get(); }

  // Sends a frame completely. Errors: DeadlineExceeded, Unavailable (peer gone).
  absl::Status Send(std::string frame, absl::Time deadline);
  // The next frame. Errors: DeadlineExceeded when none arrived by `deadline`; Unavailable when
  // the peer closed the connection or it broke; DataLoss for a malformed frame.
  absl::StatusOr<Frame> Receive(absl::Time deadline);
  // A frame if one is complete now (never blocks). Errors as Receive.
  absl::StatusOr<std::optional<Frame>> Poll();
  void Close() { fd_ = Fd(); }

 private:
  Fd fd_;
  std::string peer_;
  std::string in_;
};

}  // namespace weightbus::internal::ucx

// SPDX-License-Identifier: Apache-2.0
// The rendezvous (control-plane) pieces every networked transport shares: listening and
// connecting TCP sockets with deadlines, length-prefixed frames, bounded non-blocking reads and
// writes, a deadline-bounded framed stream, and the field reader every message decoder is built
// on. A transport defines its own message types, their encoders and decoders, and its protocol
// (ucx://: lib/transports/ucx/control.h; nccl://: lib/transports/nccl/protocol.h).
//
// Framing: every integer is little-endian. A frame is a u32 payload length followed by the
// payload, whose first byte is the message type. Strings and byte blobs are a u32 length and
// the bytes. A decoder refuses a message that claims more than it carries (DataLoss naming the
// message, the field, the claim and what is left) before allocating anything for it.
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
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "core/bytes.h"
#include "core/system.h"

namespace weightbus::internal::control {

// A monotonic clock as absl::Time (CLOCK_MONOTONIC since boot), for leases and waits that
// wall-clock steps must neither shorten nor extend.
absl::Time MonotonicNow();

using Fd = ::weightbus::internal::UniqueFd;

// "127.0.0.1 port 5555 (IPv4)" or "::1 port 5555 (IPv6)".
std::string DescribeSockaddr(const sockaddr* addr, socklen_t len);

// Whether the peer of connected socket `fd` is on this host: its address is a loopback one or
// the socket's own local address.
bool PeerIsLocal(int fd);

// The numeric address (no port, IPv6 without brackets) of connected socket `fd`'s peer, or of
// the socket itself with `local`; empty when the system cannot tell.
std::string SocketHost(int fd, bool local = false);
// The port socket `fd` is bound to (0 when the system cannot tell).
int LocalPort(int fd);

// Whether `host` (a name, or an address as written in a URI without brackets) is a wildcard
// address (0.0.0.0, ::, "*"): a listener may bind it, nobody can connect to it.
bool IsWildcardHost(const std::string& host);
// Whether `host` names this machine's loopback interface (127.0.0.0/8, ::1, "localhost").
bool IsLoopbackHost(const std::string& host);

// The name of this host's loopback network interface ("lo" on Linux).
std::string LoopbackInterface();

// The network interfaces ("eth0", "lo") that carry traffic of `host` on this host: for a
// listener (`listening`) the interfaces that own `host`'s addresses, and the loopback interface
// for a loopback or wildcard host; for a connecting side the interfaces the kernel routes to
// `host`'s addresses through. Never empty: the loopback interface when nothing matches (a host
// that does not resolve fails in Listen or Connect, naming it).
std::vector<std::string> TcpInterfacesFor(const std::string& host, int port, bool listening);

// Listens on host:port (a name, an address or a wildcard; port 0: an ephemeral port, LocalPort
// tells which), non-blocking, closed in forked children. Errors name `uri`, the address, family
// and port: FailedPrecondition when the port is in use, InvalidArgument when the host does not
// resolve or is not an address of this machine, Internal otherwise.
absl::StatusOr<Fd> Listen(const std::string& host, int port, std::string_view uri);

// Connects to host:port, trying every address the name resolves to, retrying refused and
// unreachable attempts until `deadline` (a publisher may be starting). Refuses wildcard
// addresses. The socket is non-blocking, TCP_NODELAY, closed in forked children.
// Errors: Unavailable naming each address, family and port with the last error;
// InvalidArgument for a wildcard or a name that does not resolve.
// With `once`, a single round of attempts is made (a refused one fails at once; one in progress
// may take until `deadline`). When `*cancelled` becomes true, retrying stops within about 50 ms
// (Cancelled).
absl::StatusOr<Fd> Connect(const std::string& host, int port, absl::Time deadline,
                           std::string_view uri, bool once = false,
                           const std::atomic<bool>* cancelled = nullptr);

// Accepts one pending connection on non-blocking listener `listener` (accept4, non-blocking,
// close-on-exec, TCP_NODELAY, closed in forked children). nullopt when none is pending.
// Errors: ResourceExhausted when the process or system is out of descriptors or memory (EMFILE,
// ENFILE, ENOBUFS, ENOMEM: the caller should stop accepting for a while and serve the
// connections it has; the new ones wait in the listen queue), Internal otherwise, with the errno
// text.
struct Accepted {
  Fd fd;
  std::string peer;  // DescribeSockaddr of the peer
};
absl::StatusOr<std::optional<Accepted>> AcceptOne(int listener);

// Builds one frame.
class FrameWriter {
 public:
  explicit FrameWriter(uint8_t type);
  FrameWriter& U8(uint8_t v);
  FrameWriter& U32(uint32_t v);
  FrameWriter& U64(uint64_t v);
  FrameWriter& Str(std::string_view s);
  // Appends bytes as they are (a part of a message built earlier by another writer's Body()).
  FrameWriter& Raw(std::string_view bytes);
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

// Reads one message's fields in order, for a message decoder; the first failure is kept (later
// reads return 0 or empty) and reported by Done, worded with the message's name and size:
// "malformed GRANT message (61 bytes): region 1 rkey needs 300 bytes but only 12 remain".
class MessageFields {
 public:
  MessageFields(std::string_view message, std::string_view payload)
      : message_(message), size_(payload.size()), r_(payload) {}

  uint64_t U64(std::string_view what) { return Keep(r_.U64(what)); }
  uint32_t U32(std::string_view what) { return Keep(r_.U32(what)); }
  uint8_t U8(std::string_view what) { return Keep(r_.U8(what)); }
  // One byte, 0 or 1 (anything else is DataLoss).
  bool Flag(std::string_view what);
  std::string Str(std::string_view what) { return std::string(View(what)); }
  // A string in place (a view of the payload).
  std::string_view View(std::string_view what);
  // A count of elements of at least `min_bytes` each: more than the rest of the message can
  // hold is refused before anything is allocated for them.
  uint32_t Count(std::string_view what, size_t min_bytes);
  // A u32 count then that many u64.
  std::vector<uint64_t> U64s(std::string_view what);
  // Records a failure of the caller's own check (the first failure is kept).
  void Fail(std::string message);
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
      return absl::DataLossError(absl::StrFormat("malformed %s message (%d bytes): %s", message_,
                                                 size_, status_.message()));
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
    status_ = v.status();
    return T{};
  }

  std::string message_;
  size_t size_;
  ByteReader r_;
  absl::Status status_;
};

// A u32 count then the values, as MessageFields::U64s reads them.
FrameWriter& WriteU64s(FrameWriter& w, const std::vector<uint64_t>& values);

// A status code received from a peer: a known non-OK absl::StatusCode as it is, anything else
// (0 included: a peer must never make a failure read as success) `fallback`.
absl::StatusCode StatusCodeFromWire(uint32_t code, absl::StatusCode fallback);

// The first field of a payload (the request or lease id an answer starts with), to match an
// answer to its request before decoding it; nullopt when the payload is shorter than 8 bytes.
std::optional<uint64_t> LeadingId(std::string_view payload);

// One frame, its type byte as sent (a transport casts it to its own message type).
struct RawFrame {
  uint8_t type = 0;
  std::string payload;  // without the type byte
};

// Removes one complete frame from the front of `buffer`, if there is one.
// Errors: DataLoss for a frame whose header declares more than `max_frame` payload bytes (known
// from its first 4 bytes) or no type byte.
absl::StatusOr<std::optional<RawFrame>> TakeRawFrame(std::string& buffer, uint32_t max_frame);

// Reads what is available on non-blocking `fd` into `buffer`, until the socket has no more or
// `buffer` holds at least `max_buffer` bytes (the rest stays in the socket: the peer is slowed
// down, not buffered without bound). Returns false on EOF.
// Errors: Unavailable with the errno text (connection reset).
absl::StatusOr<bool> ReadAvailable(int fd, std::string& buffer,
                                   size_t max_buffer = std::numeric_limits<size_t>::max());

// Writes as much of `buffer` as the socket takes now and erases it from the front.
// Errors: Unavailable with the errno text.
absl::Status WriteAvailable(int fd, std::string& buffer);

// A blocking, deadline-bounded conversation over a connected socket (the connecting side:
// a subscriber, a rank joining rank 0).
class FrameStream {
 public:
  FrameStream() = default;
  // `max_frame`: the largest payload accepted from the peer.
  FrameStream(Fd fd, std::string peer, uint32_t max_frame)
      : fd_(std::move(fd)), peer_(std::move(peer)), max_frame_(max_frame) {}
  bool connected() const { return static_cast<bool>(fd_); }
  const std::string& peer() const { return peer_; }
  void set_peer(std::string peer) { peer_ = std::move(peer); }
  int fd() const { return fd_.get(); }

  // Sends a frame completely. Errors: DeadlineExceeded, Unavailable (peer gone).
  absl::Status Send(std::string frame, absl::Time deadline);
  // The next frame. Errors: DeadlineExceeded when none arrived by `deadline`; Unavailable when
  // the peer closed the connection or it broke; DataLoss for a malformed frame.
  absl::StatusOr<RawFrame> Receive(absl::Time deadline);
  // A frame if one is complete now (never blocks). Errors as Receive.
  absl::StatusOr<std::optional<RawFrame>> Poll();
  void Close() { fd_ = Fd(); }
  // Bytes sent and received on this stream so far (frames whole), for counters.
  uint64_t bytes_sent() const { return bytes_sent_; }
  uint64_t bytes_received() const { return bytes_received_; }

 private:
  Fd fd_;
  std::string peer_;
  uint32_t max_frame_ = 0;
  std::string in_;
  uint64_t bytes_sent_ = 0;
  uint64_t bytes_received_ = 0;
};

// A frame typed with a transport's own message enum (`Type` is an enum class over uint8_t).
template <typename Type>
struct TypedFrame {
  Type type;
  std::string payload;  // without the type byte
  static TypedFrame From(RawFrame f) { return {static_cast<Type>(f.type), std::move(f.payload)}; }
};

// FrameStream with frames typed as `Type`.
template <typename Type>
class TypedFrameStream {
 public:
  TypedFrameStream() = default;
  TypedFrameStream(Fd fd, std::string peer, uint32_t max_frame)
      : s_(std::move(fd), std::move(peer), max_frame) {}
  bool connected() const { return s_.connected(); }
  const std::string& peer() const { return s_.peer(); }
  void set_peer(std::string peer) { s_.set_peer(std::move(peer)); }
  int fd() const { return s_.fd(); }
  absl::Status Send(std::string frame, absl::Time deadline) {
    return s_.Send(std::move(frame), deadline);
  }
  absl::StatusOr<TypedFrame<Type>> Receive(absl::Time deadline) {
    absl::StatusOr<RawFrame> f = s_.Receive(deadline);
    if (!f.ok()) return f.status();
    return TypedFrame<Type>::From(*std::move(f));
  }
  absl::StatusOr<std::optional<TypedFrame<Type>>> Poll() {
    absl::StatusOr<std::optional<RawFrame>> f = s_.Poll();
    if (!f.ok()) return f.status();
    if (!f->has_value()) return std::nullopt;
    return TypedFrame<Type>::From(**std::move(f));
  }
  void Close() { s_.Close(); }
  uint64_t bytes_sent() const { return s_.bytes_sent(); }
  uint64_t bytes_received() const { return s_.bytes_received(); }

 private:
  FrameStream s_;
};

// TakeRawFrame with the frame typed as `Type`.
template <typename Type>
absl::StatusOr<std::optional<TypedFrame<Type>>> TakeFrame(std::string& buffer, uint32_t max_frame) {
  absl::StatusOr<std::optional<RawFrame>> f = TakeRawFrame(buffer, max_frame);
  if (!f.ok()) return f.status();
  if (!f->has_value()) return std::nullopt;
  return TypedFrame<Type>::From(**std::move(f));
}

}  // namespace weightbus::internal::control

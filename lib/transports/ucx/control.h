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
inline constexpr uint32_t kProtocolVersion = 4;  // 4: GRANT points at the version descriptor
// Largest frame accepted (a manifest of a very large model fits many times over).
inline constexpr uint32_t kMaxFrame = uint32_t{1} << 30;
// Largest frame a publisher accepts from a subscriber: every message a subscriber sends is a
// few integers, or HELLO's channel name (<= 1024 bytes) and description. A frame header that
// declares more is DataLoss before any of its bytes is buffered.
inline constexpr uint32_t kMaxRequestFrame = uint32_t{64} << 10;
// Largest frame rank 0 of a publisher group accepts from a rank that joined it (PART carries the
// rank's part manifest, which grows with the model's tensor count).
inline constexpr uint32_t kMaxMemberFrame = uint32_t{64} << 20;

enum class MsgType : uint8_t {
  kHello = 1,      // sub -> pub: magic, protocol, channel, subscriber id, description
  kWelcome = 2,    // pub -> sub: protocol, session id, worker address, lease, newest, description
  kError = 3,      // pub -> sub: status code and message; the publisher then closes
  kWait = 4,       // sub -> pub: request id, version, mode (0 newest >=, 1 exact, 2 newest >= now)
  kGrant = 5,      // pub -> sub: the version, its lease and where its descriptor is
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
  // A lease on a version that will never be complete (its Publish failed, or a zero-copy
  // Publish returned before the holder finished): nothing of it may be used.
  kAborted = 19,  // pub -> sub: lease id, status code, message
  // Publisher groups (world_size > 1): rank r > 0 connects to rank 0 at the URI's address and
  // joins the group; rank 0 commits a version once every rank's PART is in (docs/FORMAT.md).
  kJoin = 32,      // rank -> rank 0: magic, protocol, channel, rank, world_size, its port, who
  kJoined = 33,    // rank 0 -> rank: the group's world_size, rank 0's description
  kPart = 34,      // rank -> rank 0: version, the rank's part manifest (staged, servable)
  kWithdraw = 35,  // rank -> rank 0: version (the rank gave up waiting; its part no longer counts)
  kOutcome = 36,   // rank 0 -> rank: version, status code (0: committed), message
  // The delta layer's back channel (TransportSubscriber::RequestKeyframe). Numbered apart from
  // the message families above.
  kKeyframeRequest = 40,  // sub -> pub: the version it cannot reconstruct, the one it holds, why
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

// The numeric address (no port, IPv6 without brackets) of connected socket `fd`'s peer, or of
// the socket itself with `local`; empty when the system cannot tell.
std::string SocketHost(int fd, bool local = false);
// The port socket `fd` is bound to (0 when the system cannot tell).
int LocalPort(int fd);

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

// ---- The messages: one struct each, fields in wire order ------------------------------------
// Encode(m) builds a message's complete frame; DecodeX(payload) parses a frame's payload (after
// the type byte) and is the only place each message is parsed (fuzzed by
// tests/fuzz/ucx_control_fuzz.cc). Flags are one byte, 0 or 1. Decode errors are DataLoss
// naming the message and the field, with what the message claims and what it carries
// ("malformed GRANT message (61 bytes): region 1 rkey needs 300 bytes but only 12 remain",
// "... claims 4000000 offsets of 8 bytes but only 16 bytes remain"). HELLO, WELCOME and ERROR
// may carry more bytes after their fields (a later protocol version must still be told apart);
// every other message must end where its fields do.

struct HelloMsg {     // sub -> pub
  std::string magic;  // kMagic
  uint32_t protocol = 0;
  std::string channel;
  uint64_t subscriber_id = 0;
  std::string description;
  // On a shared-secret channel (docs/SECURITY.md): the subscriber's nonce, after the fields above
  // (absent, i.e. empty, otherwise; a publisher without a secret ignores it).
  std::string nonce;
};
struct ChallengeMsg {  // pub -> sub, on a shared-secret channel: answers HELLO
  std::string publisher_nonce;
  std::string proof;  // the publisher's proof over both nonces
};
struct ProofMsg {     // sub -> pub: answers CHALLENGE
  std::string proof;  // the subscriber's proof over both nonces
};
struct WelcomeMsg {  // pub -> sub
  uint32_t protocol = 0;
  uint64_t session_id = 0;
  std::string worker_address;  // packed ucp address
  uint64_t lease_ns = 0;
  bool has_newest = false;
  uint64_t newest = 0;
  std::string description;
  bool bytes_over_control = false;  // READ/DATA instead of gets
};
struct ErrorMsg {     // pub -> sub
  uint32_t code = 0;  // absl::StatusCode
  std::string message;
};
// WAIT modes.
inline constexpr uint8_t kWaitNewest = 0;     // the newest version >= `version`, waiting for one
inline constexpr uint8_t kWaitExact = 1;      // exactly `version`
inline constexpr uint8_t kWaitNewestNow = 2;  // the newest >= `version` now, else REFUSED
struct WaitMsg {                              // sub -> pub
  uint64_t request = 0;
  uint64_t version = 0;
  uint8_t mode = kWaitNewest;  // 0..2
};
// Where a rank of a publisher group serves its parts (GRANT of a group version).
struct GroupMember {
  std::string host;  // as rank 0 sees the rank's address; empty for rank 0 itself
  uint32_t port = 0;
  friend bool operator==(const GroupMember&, const GroupMember&) = default;
};
// The version descriptor's registered memory (descriptor.h), as a GRANT points at it.
struct GrantRegion {
  uint64_t id = 0;
  uint64_t base = 0;     // offset in the slot's byte range (for READs over the control connection)
  uint64_t address = 0;  // in the publisher's address space
  uint64_t length = 0;
  std::string rkey;  // packed
  friend bool operator==(const GrantRegion&, const GrantRegion&) = default;
};
// A lease on a version and where its version descriptor is: the descriptor has everything
// else (the manifest, the regions of its bytes, readiness, the seal), so a GRANT is the same
// few dozen bytes whatever the version's size, tensor count or number of subscribers.
struct GrantMsg {  // pub -> sub
  uint64_t request = 0;
  uint64_t lease = 0;
  uint64_t lease_ns = 0;
  uint64_t version = 0;
  GrantRegion descriptor;
  // Descriptor bytes [0, prefix) hold the header, readiness words and layout: what a subscriber
  // reads first, in one get.
  uint64_t prefix = 0;
};
struct RefusedMsg {  // pub -> sub
  uint64_t request = 0;
  uint32_t code = 0;  // absl::StatusCode
  std::string message;
};
struct AbortedMsg {  // pub -> sub
  uint64_t lease = 0;
  uint32_t code = 0;  // absl::StatusCode of the publish's failure
  std::string message;
};
struct CancelMsg {  // sub -> pub
  uint64_t request = 0;
};
struct RenewMsg {  // sub -> pub
  uint64_t lease = 0;
};
struct ReleaseMsg {  // sub -> pub
  uint64_t lease = 0;
  bool ack = false;  // answer with RELEASED
};
struct ReleasedMsg {  // pub -> sub
  uint64_t lease = 0;
  bool valid = false;  // the lease was still held when released
};
struct AcceptedMsg {  // sub -> pub
  uint64_t version = 0;
};
struct ListMsg {  // sub -> pub
  uint64_t request = 0;
};
// Longest reason a KEYFRAME_REQUEST carries (a longer one is cut by the sender, refused by the
// receiver).
inline constexpr uint32_t kMaxKeyframeReason = 2048;
struct KeyframeRequestMsg {  // sub -> pub; no answer (the next version is a keyframe)
  uint64_t version = 0;      // the version the subscriber cannot reconstruct
  bool has_holds = false;    // the subscriber holds a version...
  uint64_t holds = 0;        // ...this one
  std::string reason;        // at most kMaxKeyframeReason bytes
};
struct VersionsMsg {  // pub -> sub
  uint64_t request = 0;
  std::vector<uint64_t> versions;  // ascending
};
struct RenewedMsg {  // pub -> sub
  uint64_t lease = 0;
  bool valid = false;  // the lease was still held (and is now extended)
};
struct ReadMsg {  // sub -> pub
  uint64_t request = 0;
  uint64_t lease = 0;
  uint64_t offset = 0;  // in the slot
  uint64_t length = 0;
};
struct JoinMsg {      // rank -> rank 0
  std::string magic;  // kMagic
  uint32_t protocol = 0;
  std::string channel;
  uint32_t rank = 0;
  uint32_t world_size = 0;
  uint32_t port = 0;  // where the rank serves its parts (on the interface it reaches rank 0 from)
  std::string description;
};
struct JoinedMsg {  // rank 0 -> rank
  uint32_t world_size = 0;
  std::string description;
};
struct PartMsg {  // rank -> rank 0
  uint64_t version = 0;
  std::string manifest_json;  // the rank's part (Manifest::group, owner = rank)
};
struct WithdrawMsg {  // rank -> rank 0
  uint64_t version = 0;
};
struct OutcomeMsg {  // rank 0 -> rank
  uint64_t version = 0;
  uint32_t code = 0;  // absl::StatusCode; 0: the version is committed
  std::string message;
};
struct DataMsg {  // pub -> sub
  uint64_t request = 0;
  bool ok = false;
  // The bytes read, or (not ok) why not. A view: of what the encoder was given, of the payload
  // the decoder was given (which must outlive it).
  std::string_view bytes;
};

std::string Encode(const HelloMsg& m);
std::string Encode(const ChallengeMsg& m);
std::string Encode(const ProofMsg& m);
std::string Encode(const WelcomeMsg& m);
std::string Encode(const ErrorMsg& m);
std::string Encode(const WaitMsg& m);
std::string Encode(const GrantMsg& m);
std::string Encode(const RefusedMsg& m);
std::string Encode(const AbortedMsg& m);
std::string Encode(const CancelMsg& m);
std::string Encode(const RenewMsg& m);
std::string Encode(const ReleaseMsg& m);
std::string Encode(const ReleasedMsg& m);
std::string Encode(const AcceptedMsg& m);
std::string Encode(const ListMsg& m);
std::string Encode(const VersionsMsg& m);
std::string Encode(const RenewedMsg& m);
std::string Encode(const ReadMsg& m);
std::string Encode(const DataMsg& m);
std::string Encode(const KeyframeRequestMsg& m);
std::string Encode(const JoinMsg& m);
std::string Encode(const JoinedMsg& m);
std::string Encode(const PartMsg& m);
std::string Encode(const WithdrawMsg& m);
std::string Encode(const OutcomeMsg& m);

absl::StatusOr<HelloMsg> DecodeHello(std::string_view payload);
absl::StatusOr<ChallengeMsg> DecodeChallenge(std::string_view payload);
absl::StatusOr<ProofMsg> DecodeProof(std::string_view payload);
absl::StatusOr<WelcomeMsg> DecodeWelcome(std::string_view payload);
absl::StatusOr<ErrorMsg> DecodeError(std::string_view payload);
absl::StatusOr<WaitMsg> DecodeWait(std::string_view payload);
absl::StatusOr<GrantMsg> DecodeGrant(std::string_view payload);
absl::StatusOr<RefusedMsg> DecodeRefused(std::string_view payload);
absl::StatusOr<AbortedMsg> DecodeAborted(std::string_view payload);
absl::StatusOr<CancelMsg> DecodeCancel(std::string_view payload);
absl::StatusOr<RenewMsg> DecodeRenew(std::string_view payload);
absl::StatusOr<ReleaseMsg> DecodeRelease(std::string_view payload);
absl::StatusOr<ReleasedMsg> DecodeReleased(std::string_view payload);
absl::StatusOr<AcceptedMsg> DecodeAccepted(std::string_view payload);
absl::StatusOr<ListMsg> DecodeList(std::string_view payload);
absl::StatusOr<VersionsMsg> DecodeVersions(std::string_view payload);
absl::StatusOr<RenewedMsg> DecodeRenewed(std::string_view payload);
absl::StatusOr<ReadMsg> DecodeRead(std::string_view payload);
absl::StatusOr<DataMsg> DecodeData(std::string_view payload);
absl::StatusOr<KeyframeRequestMsg> DecodeKeyframeRequest(std::string_view payload);
absl::StatusOr<JoinMsg> DecodeJoin(std::string_view payload);
absl::StatusOr<JoinedMsg> DecodeJoined(std::string_view payload);
absl::StatusOr<PartMsg> DecodePart(std::string_view payload);
absl::StatusOr<WithdrawMsg> DecodeWithdraw(std::string_view payload);
absl::StatusOr<OutcomeMsg> DecodeOutcome(std::string_view payload);

// A status code received in an ERROR or REFUSED message: a known non-OK absl::StatusCode as it
// is, anything else (0 included: a peer must never make a failure read as success) `fallback`.
absl::StatusCode StatusCodeFromWire(uint32_t code, absl::StatusCode fallback);
// The status an ERROR payload carries, its message prefixed with `prefix`; a malformed one is
// Unavailable saying so.
absl::Status ErrorStatus(std::string_view payload, std::string_view prefix);

// The first field of a payload (the request or lease id every answer starts with), to match an
// answer to its request before decoding it; nullopt when the payload is shorter than 8 bytes.
std::optional<uint64_t> LeadingId(std::string_view payload);

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
  // Bytes sent and received on this stream so far (frames whole), for counters.
  uint64_t bytes_sent() const { return bytes_sent_; }
  uint64_t bytes_received() const { return bytes_received_; }

 private:
  Fd fd_;
  std::string peer_;
  std::string in_;
  uint64_t bytes_sent_ = 0;
  uint64_t bytes_received_ = 0;
};

}  // namespace weightbus::internal::ucx

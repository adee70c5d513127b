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
#include "core/control_plane.h"

namespace weightbus::internal::ucx {

inline constexpr char kMagic[] = "weightbus-ucx";
// 4: GRANT points at the version descriptor; 5: relays (RELAY_OFFER, GRANT's relay fields)
inline constexpr uint32_t kProtocolVersion = 5;
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
  // Relays (fan-out): a subscriber that can serve what it receives to other subscribers says
  // where; a GRANT may then name a relay to pull from and say whether the grantee may be one.
  kRelayOffer = 20,  // sub -> pub: worker address, relay descriptor (address, length, rkey), pid
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
  kReport = 41,  // sub -> pub: a layer's report about a version (TransportSubscriber::Report)
};

std::string_view MsgTypeName(MsgType type);

// The transport-neutral pieces (sockets, framing, bounded reads, the framed stream) live in
// core/control_plane.h, shared with nccl://.
using control::Connect;
using control::DescribeSockaddr;
using control::Fd;
using control::LeadingId;
using control::Listen;
using control::LocalPort;
using control::LoopbackInterface;
using control::MonotonicNow;
using control::PeerIsLocal;
using control::ReadAvailable;
using control::Reader;
using control::SocketHost;
using control::StatusCodeFromWire;
using control::TcpInterfacesFor;
using control::WriteAvailable;

// Builds one frame of a ucx message.
class Writer : public control::FrameWriter {
 public:
  explicit Writer(MsgType type) : FrameWriter(static_cast<uint8_t>(type)) {}
};

using Frame = control::TypedFrame<MsgType>;

// Removes one complete frame from the front of `buffer`, if there is one (TakeRawFrame).
inline absl::StatusOr<std::optional<Frame>> TakeFrame(std::string& buffer,
                                                      uint32_t max_frame = kMaxFrame) {
  return control::TakeFrame<MsgType>(buffer, max_frame);
}

// A blocking, deadline-bounded conversation with the publisher (the subscriber's side), frames
// up to kMaxFrame.
class ControlStream : public control::TypedFrameStream<MsgType> {
 public:
  ControlStream() = default;
  ControlStream(Fd fd, std::string peer)
      : TypedFrameStream(std::move(fd), std::move(peer), kMaxFrame) {}
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
// A subscriber that pulls a version from another subscriber (a relay) first: where the relay's
// relay descriptor is (descriptor.h, "Relays") and which child slot in it is the grantee's.
struct RelaySource {
  uint64_t relay = 0;          // the relay's subscriber id
  std::string worker_address;  // its UCP worker
  uint64_t address = 0;        // its relay descriptor (registered, UCX-allocated)
  uint64_t length = 0;
  std::string rkey;
  uint64_t pid = 0;    // the relay process (cross-memory attach on its host)
  uint32_t child = 0;  // the grantee's child slot
  friend bool operator==(const RelaySource&, const RelaySource&) = default;
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
  // The grantee may be asked to relay this version to others (it offered to): it keeps its
  // relay descriptor for the version and serves its chunks as they land.
  bool relay = false;
  // Pull from this relay first (falling back to the publisher when it stalls or goes away).
  std::optional<RelaySource> source;
};
struct RelayOfferMsg {  // sub -> pub
  std::string worker_address;
  uint64_t address = 0;  // the relay descriptor
  uint64_t length = 0;
  std::string rkey;
  uint64_t pid = 0;
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
// Longest REPORT text (core/transport.h kMaxReportText).
inline constexpr uint32_t kMaxReport = 1024;
struct KeyframeRequestMsg {  // sub -> pub; no answer (the next version is a keyframe)
  uint64_t version = 0;      // the version the subscriber cannot reconstruct
  bool has_holds = false;    // the subscriber holds a version...
  uint64_t holds = 0;        // ...this one
  std::string reason;        // at most kMaxKeyframeReason bytes
};
struct ReportMsg {       // sub -> pub; no answer
  uint64_t version = 0;  // the version the report is about
  std::string text;      // at most kMaxReport bytes
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
  // On a shared-secret channel (docs/SECURITY.md, "Publisher groups"): the joining rank's nonce,
  // after the fields above (absent otherwise). Rank 0 answers with CHALLENGE (its nonce and
  // proof, role "group rank 0"), the rank with PROOF (role "group rank"), and only then JOINED.
  std::string nonce;
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
std::string Encode(const RelayOfferMsg& m);
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
std::string Encode(const ReportMsg& m);
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
absl::StatusOr<RelayOfferMsg> DecodeRelayOffer(std::string_view payload);
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
absl::StatusOr<ReportMsg> DecodeReport(std::string_view payload);
absl::StatusOr<JoinMsg> DecodeJoin(std::string_view payload);
absl::StatusOr<JoinedMsg> DecodeJoined(std::string_view payload);
absl::StatusOr<PartMsg> DecodePart(std::string_view payload);
absl::StatusOr<WithdrawMsg> DecodeWithdraw(std::string_view payload);
absl::StatusOr<OutcomeMsg> DecodeOutcome(std::string_view payload);

// The status an ERROR payload carries, its message prefixed with `prefix`; a malformed one is
// Unavailable saying so.
absl::Status ErrorStatus(std::string_view payload, std::string_view prefix);

}  // namespace weightbus::internal::ucx

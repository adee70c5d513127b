// SPDX-License-Identifier: Apache-2.0
// The rendezvous (control) protocol of nccl://: small framed messages over one TCP connection
// per replica, to HOST:PORT of the URI, where the publisher listens (framing and sockets:
// core/control_plane.h). It carries the handshake, the communicator's membership (the
// ncclUniqueId and each replica's rank), each version's manifest and bucket plan, and per-bucket
// progress; tensor bytes travel only in NCCL broadcasts. Wire format: docs/FORMAT.md, "nccl://".
//
//   replica                                   publisher (rank 0, the root)
//   HELLO (settings that must agree)  ->
//                                     <-  WELCOME, or ERROR naming a mismatched setting
//                                     <-  GROUP (epoch, unique id, rank, nranks) at a publish
//   [ncclCommInitRankConfig, non-blocking; a replica on the publisher's GPU, GROUP rank 0, is no
//    rank: SLOTS follows, the root's bucket buffers it then reads through CUDA IPC]
//   GROUP_READY (epoch, status)       ->
//                                     <-  OFFER (version, manifest, bucket plan)
//   READY (version: receiving now)    ->
//                                     <-  START (every member is ready)
//                  [ncclBroadcast of each bucket, root 0]
//                                     <-  BUCKET (co-located replicas: bucket k is in buffer s)
//   RECEIVED (version, buckets done)  ->  after each bucket
//                                     <-  COMMIT (every member has every bucket): only now
//                                         does a replica hand the version to its core
//   ACCEPTED (version)                ->  verified and handed over by the replica's core
//                                     <-  ABORT (epoch, version, why): the version, or the
//                                         communicator, is given up
//   FAILED (epoch, version, why)      ->  the replica's side failed
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/control_plane.h"

namespace weightbus::internal::nccl {

inline constexpr char kMagic[] = "weightbus-nccl";
inline constexpr uint32_t kProtocolVersion = 1;
// Largest frame a replica accepts from the publisher (an OFFER carries a manifest and a plan).
inline constexpr uint32_t kMaxFrame = uint32_t{1} << 30;
// Largest frame the publisher accepts from a replica (HELLO with its settings is the largest).
inline constexpr uint32_t kMaxReplicaFrame = uint32_t{64} << 10;
// Longest free text (a description, an error message) a message may carry.
inline constexpr uint32_t kMaxText = 8192;

enum class MsgType : uint8_t {
  kHello = 1,       // rep -> pub: magic, protocol, channel, replica id, who, GPU, settings
  kWelcome = 2,     // pub -> rep: protocol, session id, who, newest version
  kError = 3,       // either way: status code and message; the sender then closes
  kGroup = 4,       // pub -> rep: epoch, rank, nranks, unique id, the members
  kGroupReady = 5,  // rep -> pub: epoch, status code (0: its rank is initialized), message
  kOffer = 6,       // pub -> rep: epoch, version, manifest, bucket plan
  kReady = 7,       // rep -> pub: version (it is receiving: posting its broadcasts)
  kReceived = 8,    // rep -> pub: version, buckets received so far
  kAbort = 9,       // pub -> rep: epoch, version (0: the communicator), status code, message
  kFailed = 10,     // rep -> pub: epoch, version, status code, message
  kAccepted = 11,   // rep -> pub: version (verified and handed over)
  kStart = 12,      // pub -> rep: epoch, version (every member is READY: post the broadcasts)
  kCommit = 13,     // pub -> rep: epoch, version (every member received every bucket: keep it)
  // A replica on the publisher's own GPU (co-located) is no rank of the communicator: it reads
  // each bucket from the root's bucket buffer (CUDA IPC) once told it is there.
  kSlots = 14,   // pub -> co-located rep: epoch, bucket size, a handle per bucket buffer
  kBucket = 15,  // pub -> co-located rep: version, bucket index, the buffer holding it
};

std::string_view MsgTypeName(MsgType type);

using Frame = control::TypedFrame<MsgType>;
using Stream = control::TypedFrameStream<MsgType>;

// One setting the two sides must agree on, as a name and its value ("" when unset).
struct Setting {
  std::string name;
  std::string value;
  friend bool operator==(const Setting&, const Setting&) = default;
};

// ---- The messages: one struct each, fields in wire order ------------------------------------
// Encode(m) builds a message's complete frame; DecodeX(payload) parses a frame's payload (after
// the type byte) and is the only place each message is parsed (fuzzed by
// tests/fuzz/nccl_control_fuzz.cc). Decode errors are DataLoss naming the message and the field
// (control::MessageFields). HELLO, WELCOME and ERROR may carry more bytes after their fields (a
// later protocol version must still be told apart); every other message must end where its
// fields do.

struct HelloMsg {  // rep -> pub
  std::string magic;
  uint32_t protocol = 0;
  std::string channel;
  uint64_t replica_id = 0;  // random per subscriber object
  std::string description;  // "pid 123 on host"
  std::string device;       // Device::Describe()
  std::string device_uuid;  // Device::Uuid()
  uint32_t nccl_version = 0;
  std::vector<Setting> settings;  // the NCCL settings that must agree (handshake.h)
};
struct WelcomeMsg {  // pub -> rep
  uint32_t protocol = 0;
  uint64_t session_id = 0;
  std::string description;
  bool has_newest = false;
  uint64_t newest = 0;
};
struct ErrorMsg {
  uint32_t code = 0;  // absl::StatusCode
  std::string message;
};
struct GroupMsg {  // pub -> rep
  uint64_t epoch = 0;
  uint32_t rank = 0;      // this replica's rank, 1..nranks-1
  uint32_t nranks = 0;    // publisher + replicas
  std::string unique_id;  // kUniqueIdBytes bytes
  std::string members;    // who the ranks are, for messages
};
struct GroupReadyMsg {  // rep -> pub
  uint64_t epoch = 0;
  uint32_t code = 0;  // 0: initialized
  std::string message;
};
struct OfferMsg {  // pub -> rep
  uint64_t epoch = 0;
  uint64_t version = 0;
  std::string manifest_json;
  std::string plan;  // EncodePlan (plan.h)
};
struct ReadyMsg {  // rep -> pub
  uint64_t version = 0;
};
struct ReceivedMsg {  // rep -> pub
  uint64_t version = 0;
  uint64_t buckets = 0;  // buckets of the version complete on the replica
};
struct AbortMsg {  // pub -> rep
  uint64_t epoch = 0;
  uint64_t version = 0;  // 0: the communicator itself (its init) is given up
  uint32_t code = 0;
  std::string message;
};
struct FailedMsg {  // rep -> pub
  uint64_t epoch = 0;
  uint64_t version = 0;  // 0: the communicator's init
  uint32_t code = 0;
  std::string message;
};
struct AcceptedMsg {  // rep -> pub
  uint64_t version = 0;
};
struct StartMsg {  // pub -> rep
  uint64_t epoch = 0;
  uint64_t version = 0;
};
struct CommitMsg {  // pub -> rep
  uint64_t epoch = 0;
  uint64_t version = 0;
};
struct SlotsMsg {  // pub -> co-located rep
  uint64_t epoch = 0;
  uint64_t bucket_size = 0;
  std::vector<std::string> handles;  // Device::ExportBuffer of each bucket buffer
};
struct BucketMsg {  // pub -> co-located rep
  uint64_t version = 0;
  uint64_t bucket = 0;  // 0-based
  uint32_t slot = 0;    // index into SLOTS' handles
};

std::string Encode(const HelloMsg& m);
std::string Encode(const WelcomeMsg& m);
std::string Encode(const ErrorMsg& m);
std::string Encode(const GroupMsg& m);
std::string Encode(const GroupReadyMsg& m);
std::string Encode(const OfferMsg& m);
std::string Encode(const ReadyMsg& m);
std::string Encode(const ReceivedMsg& m);
std::string Encode(const AbortMsg& m);
std::string Encode(const FailedMsg& m);
std::string Encode(const AcceptedMsg& m);
std::string Encode(const StartMsg& m);
std::string Encode(const CommitMsg& m);
std::string Encode(const SlotsMsg& m);
std::string Encode(const BucketMsg& m);

absl::StatusOr<HelloMsg> DecodeHello(std::string_view payload);
absl::StatusOr<WelcomeMsg> DecodeWelcome(std::string_view payload);
absl::StatusOr<ErrorMsg> DecodeError(std::string_view payload);
absl::StatusOr<GroupMsg> DecodeGroup(std::string_view payload);
absl::StatusOr<GroupReadyMsg> DecodeGroupReady(std::string_view payload);
absl::StatusOr<OfferMsg> DecodeOffer(std::string_view payload);
absl::StatusOr<ReadyMsg> DecodeReady(std::string_view payload);
absl::StatusOr<ReceivedMsg> DecodeReceived(std::string_view payload);
absl::StatusOr<AbortMsg> DecodeAbort(std::string_view payload);
absl::StatusOr<FailedMsg> DecodeFailed(std::string_view payload);
absl::StatusOr<AcceptedMsg> DecodeAccepted(std::string_view payload);
absl::StatusOr<StartMsg> DecodeStart(std::string_view payload);
absl::StatusOr<CommitMsg> DecodeCommit(std::string_view payload);
absl::StatusOr<SlotsMsg> DecodeSlots(std::string_view payload);
absl::StatusOr<BucketMsg> DecodeBucket(std::string_view payload);

// The status a peer's ERROR, ABORT or FAILED carries (a known non-OK code as it is, anything
// else `fallback`), its message prefixed with `prefix`.
absl::Status WireStatus(uint32_t code, std::string_view message, absl::StatusCode fallback,
                        std::string_view prefix);

}  // namespace weightbus::internal::nccl

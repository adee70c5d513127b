// SPDX-License-Identifier: Apache-2.0
#include "transports/nccl/protocol.h"

#include "absl/strings/str_format.h"
#include "transports/nccl/device.h"

namespace weightbus::internal::nccl {
namespace {

using control::FrameWriter;

class Writer : public FrameWriter {
 public:
  explicit Writer(MsgType type) : FrameWriter(static_cast<uint8_t>(type)) {}
};

class Fields : public control::MessageFields {
 public:
  Fields(MsgType type, std::string_view payload) : MessageFields(MsgTypeName(type), payload) {}
  // Free text of at most kMaxText bytes.
  std::string Text(std::string_view what) {
    std::string_view v = View(what);
    if (ok() && v.size() > kMaxText) {
      Fail(absl::StrFormat("%s is %d bytes, at most %d", what, v.size(), kMaxText));
      return {};
    }
    return std::string(v);
  }
};

// Free text cut to what a receiver accepts.
std::string_view Cut(std::string_view s) { return s.substr(0, kMaxText); }

}  // namespace

std::string_view MsgTypeName(MsgType type) {
  switch (type) {
    case MsgType::kHello:
      return "HELLO";
    case MsgType::kWelcome:
      return "WELCOME";
    case MsgType::kError:
      return "ERROR";
    case MsgType::kGroup:
      return "GROUP";
    case MsgType::kGroupReady:
      return "GROUP_READY";
    case MsgType::kOffer:
      return "OFFER";
    case MsgType::kReady:
      return "READY";
    case MsgType::kReceived:
      return "RECEIVED";
    case MsgType::kAbort:
      return "ABORT";
    case MsgType::kFailed:
      return "FAILED";
    case MsgType::kAccepted:
      return "ACCEPTED";
    case MsgType::kStart:
      return "START";
    case MsgType::kCommit:
      return "COMMIT";
    case MsgType::kSlots:
      return "SLOTS";
    case MsgType::kBucket:
      return "BUCKET";
  }
  return "UNKNOWN";
}

std::string Encode(const HelloMsg& m) {
  Writer w(MsgType::kHello);
  w.Str(m.magic)
      .U32(m.protocol)
      .Str(m.channel)
      .U64(m.replica_id)
      .Str(Cut(m.description))
      .Str(Cut(m.device))
      .Str(Cut(m.device_uuid))
      .U32(m.nccl_version)
      .U32(static_cast<uint32_t>(m.settings.size()));
  for (const Setting& s : m.settings) w.Str(Cut(s.name)).Str(Cut(s.value));
  return w.Finish();
}

std::string Encode(const WelcomeMsg& m) {
  return Writer(MsgType::kWelcome)
      .U32(m.protocol)
      .U64(m.session_id)
      .Str(Cut(m.description))
      .U8(m.has_newest)
      .U64(m.newest)
      .Finish();
}

std::string Encode(const ErrorMsg& m) {
  return Writer(MsgType::kError).U32(m.code).Str(Cut(m.message)).Finish();
}

std::string Encode(const GroupMsg& m) {
  return Writer(MsgType::kGroup)
      .U64(m.epoch)
      .U32(m.rank)
      .U32(m.nranks)
      .Str(m.unique_id)
      .Str(Cut(m.members))
      .Finish();
}

std::string Encode(const GroupReadyMsg& m) {
  return Writer(MsgType::kGroupReady).U64(m.epoch).U32(m.code).Str(Cut(m.message)).Finish();
}

std::string Encode(const OfferMsg& m) {
  return Writer(MsgType::kOffer)
      .U64(m.epoch)
      .U64(m.version)
      .Str(m.manifest_json)
      .Str(m.plan)
      .Finish();
}

std::string Encode(const ReadyMsg& m) { return Writer(MsgType::kReady).U64(m.version).Finish(); }

std::string Encode(const ReceivedMsg& m) {
  return Writer(MsgType::kReceived).U64(m.version).U64(m.buckets).Finish();
}

std::string Encode(const AbortMsg& m) {
  return Writer(MsgType::kAbort)
      .U64(m.epoch)
      .U64(m.version)
      .U32(m.code)
      .Str(Cut(m.message))
      .Finish();
}

std::string Encode(const FailedMsg& m) {
  return Writer(MsgType::kFailed)
      .U64(m.epoch)
      .U64(m.version)
      .U32(m.code)
      .Str(Cut(m.message))
      .Finish();
}

std::string Encode(const AcceptedMsg& m) {
  return Writer(MsgType::kAccepted).U64(m.version).Finish();
}

std::string Encode(const StartMsg& m) {
  return Writer(MsgType::kStart).U64(m.epoch).U64(m.version).Finish();
}

std::string Encode(const CommitMsg& m) {
  return Writer(MsgType::kCommit).U64(m.epoch).U64(m.version).Finish();
}

std::string Encode(const SlotsMsg& m) {
  Writer w(MsgType::kSlots);
  w.U64(m.epoch).U64(m.bucket_size).U32(static_cast<uint32_t>(m.handles.size()));
  for (const std::string& h : m.handles) w.Str(h);
  return w.Finish();
}

std::string Encode(const BucketMsg& m) {
  return Writer(MsgType::kBucket).U64(m.version).U64(m.bucket).U32(m.slot).Finish();
}

absl::StatusOr<HelloMsg> DecodeHello(std::string_view payload) {
  Fields f(MsgType::kHello, payload);
  HelloMsg m;
  m.magic = f.Text("the magic");
  m.protocol = f.U32("the protocol");
  m.channel = f.Text("the channel");
  m.replica_id = f.U64("the replica id");
  m.description = f.Text("the description");
  m.device = f.Text("the device");
  m.device_uuid = f.Text("the device UUID");
  m.nccl_version = f.U32("the NCCL version");
  // A setting is at least its name's and value's lengths.
  const uint32_t n = f.Count("settings", 8);
  for (uint32_t k = 0; k < n && f.ok(); ++k) {
    Setting s;
    s.name = f.Text(absl::StrFormat("setting %d's name", k));
    s.value = f.Text(absl::StrFormat("setting %d's value", k));
    m.settings.push_back(std::move(s));
  }
  return f.Done(std::move(m), /*exact=*/false);
}

absl::StatusOr<WelcomeMsg> DecodeWelcome(std::string_view payload) {
  Fields f(MsgType::kWelcome, payload);
  WelcomeMsg m;
  m.protocol = f.U32("the protocol");
  m.session_id = f.U64("the session id");
  m.description = f.Text("the description");
  m.has_newest = f.Flag("has_newest");
  m.newest = f.U64("the newest version");
  return f.Done(std::move(m), /*exact=*/false);
}

absl::StatusOr<ErrorMsg> DecodeError(std::string_view payload) {
  Fields f(MsgType::kError, payload);
  ErrorMsg m;
  m.code = f.U32("the status code");
  m.message = f.Text("the message");
  return f.Done(std::move(m), /*exact=*/false);
}

absl::StatusOr<GroupMsg> DecodeGroup(std::string_view payload) {
  Fields f(MsgType::kGroup, payload);
  GroupMsg m;
  m.epoch = f.U64("the epoch");
  m.rank = f.U32("the rank");
  m.nranks = f.U32("the number of ranks");
  m.unique_id = f.Str("the unique id");
  m.members = f.Text("the members");
  if (f.ok() && m.unique_id.size() != kUniqueIdBytes) {
    f.Fail(
        absl::StrFormat("the unique id is %d bytes, not %d", m.unique_id.size(), kUniqueIdBytes));
  }
  if (f.ok() && m.rank >= m.nranks) {
    f.Fail(
        absl::StrFormat("rank %d of %d (a replica's rank is 1..nranks-1, or 0 on the "
                        "publisher's GPU)",
                        m.rank, m.nranks));
  }
  return f.Done(std::move(m));
}

absl::StatusOr<GroupReadyMsg> DecodeGroupReady(std::string_view payload) {
  Fields f(MsgType::kGroupReady, payload);
  GroupReadyMsg m;
  m.epoch = f.U64("the epoch");
  m.code = f.U32("the status code");
  m.message = f.Text("the message");
  return f.Done(std::move(m));
}

absl::StatusOr<OfferMsg> DecodeOffer(std::string_view payload) {
  Fields f(MsgType::kOffer, payload);
  OfferMsg m;
  m.epoch = f.U64("the epoch");
  m.version = f.U64("the version");
  m.manifest_json = f.Str("the manifest");
  m.plan = f.Str("the bucket plan");
  return f.Done(std::move(m));
}

absl::StatusOr<ReadyMsg> DecodeReady(std::string_view payload) {
  Fields f(MsgType::kReady, payload);
  ReadyMsg m;
  m.version = f.U64("the version");
  return f.Done(m);
}

absl::StatusOr<ReceivedMsg> DecodeReceived(std::string_view payload) {
  Fields f(MsgType::kReceived, payload);
  ReceivedMsg m;
  m.version = f.U64("the version");
  m.buckets = f.U64("the buckets received");
  return f.Done(m);
}

absl::StatusOr<AbortMsg> DecodeAbort(std::string_view payload) {
  Fields f(MsgType::kAbort, payload);
  AbortMsg m;
  m.epoch = f.U64("the epoch");
  m.version = f.U64("the version");
  m.code = f.U32("the status code");
  m.message = f.Text("the message");
  return f.Done(std::move(m));
}

absl::StatusOr<FailedMsg> DecodeFailed(std::string_view payload) {
  Fields f(MsgType::kFailed, payload);
  FailedMsg m;
  m.epoch = f.U64("the epoch");
  m.version = f.U64("the version");
  m.code = f.U32("the status code");
  m.message = f.Text("the message");
  return f.Done(std::move(m));
}

absl::StatusOr<AcceptedMsg> DecodeAccepted(std::string_view payload) {
  Fields f(MsgType::kAccepted, payload);
  AcceptedMsg m;
  m.version = f.U64("the version");
  return f.Done(m);
}

absl::StatusOr<StartMsg> DecodeStart(std::string_view payload) {
  Fields f(MsgType::kStart, payload);
  StartMsg m;
  m.epoch = f.U64("the epoch");
  m.version = f.U64("the version");
  return f.Done(m);
}

absl::StatusOr<CommitMsg> DecodeCommit(std::string_view payload) {
  Fields f(MsgType::kCommit, payload);
  CommitMsg m;
  m.epoch = f.U64("the epoch");
  m.version = f.U64("the version");
  return f.Done(m);
}

absl::StatusOr<SlotsMsg> DecodeSlots(std::string_view payload) {
  Fields f(MsgType::kSlots, payload);
  SlotsMsg m;
  m.epoch = f.U64("the epoch");
  m.bucket_size = f.U64("the bucket size");
  const uint32_t n = f.Count("buffer handles", 4);
  if (f.ok() && n > 64) f.Fail(absl::StrFormat("%d buffer handles, at most 64", n));
  for (uint32_t k = 0; k < n && f.ok(); ++k) {
    m.handles.push_back(f.Text(absl::StrFormat("buffer handle %d", k)));
  }
  return f.Done(std::move(m));
}

absl::StatusOr<BucketMsg> DecodeBucket(std::string_view payload) {
  Fields f(MsgType::kBucket, payload);
  BucketMsg m;
  m.version = f.U64("the version");
  m.bucket = f.U64("the bucket");
  m.slot = f.U32("the buffer");
  return f.Done(m);
}

absl::Status WireStatus(uint32_t code, std::string_view message, absl::StatusCode fallback,
                        std::string_view prefix) {
  return absl::Status(control::StatusCodeFromWire(code, fallback),
                      absl::StrFormat("%s%s", prefix, message));
}

}  // namespace weightbus::internal::nccl

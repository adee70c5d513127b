// SPDX-License-Identifier: Apache-2.0
#include "transports/ucx/control.h"

#include <cstring>

#include "absl/strings/str_format.h"

namespace weightbus::internal::ucx {

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
    case MsgType::kRelayOffer:
      return "RELAY_OFFER";
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
    case MsgType::kReport:
      return "REPORT";
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

namespace {

// Reads one message's fields in order (control::MessageFields), worded with the message's name.
class Fields : public control::MessageFields {
 public:
  Fields(MsgType type, std::string_view payload) : MessageFields(MsgTypeName(type), payload) {}
};

control::FrameWriter& U64s(control::FrameWriter& w, const std::vector<uint64_t>& values) {
  return control::WriteU64s(w, values);
}

std::vector<uint64_t> U64s(Fields& f, std::string_view what) { return f.U64s(what); }

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
  Writer w(MsgType::kGrant);
  w.U64(m.request)
      .U64(m.lease)
      .U64(m.lease_ns)
      .U64(m.version)
      .U64(d.id)
      .U64(d.base)
      .U64(d.address)
      .U64(d.length)
      .Str(d.rkey)
      .U64(m.prefix)
      .U8(m.relay)
      .U8(m.source.has_value());
  if (m.source) {
    const RelaySource& r = *m.source;
    w.U64(r.relay).Str(r.worker_address).U64(r.address).U64(r.length).Str(r.rkey).U64(r.pid);
    w.U32(r.child);
  }
  return w.Finish();
}

std::string Encode(const RelayOfferMsg& m) {
  return Writer(MsgType::kRelayOffer)
      .Str(m.worker_address)
      .U64(m.address)
      .U64(m.length)
      .Str(m.rkey)
      .U64(m.pid)
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

std::string Encode(const ReportMsg& m) {
  return Writer(MsgType::kReport)
      .U64(m.version)
      .Str(std::string_view(m.text).substr(0, kMaxReport))
      .Finish();
}

std::string Encode(const JoinMsg& m) {
  Writer w(MsgType::kJoin);
  w.Str(m.magic)
      .U32(m.protocol)
      .Str(m.channel)
      .U32(m.rank)
      .U32(m.world_size)
      .U32(m.port)
      .Str(m.description);
  if (!m.nonce.empty()) w.Str(m.nonce);
  return w.Finish();
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
  // The nonce of a shared-secret channel, as HELLO's: a string that ends the message exactly.
  const size_t fields = payload.size() - f.remaining();
  if (f.ok() && f.remaining() >= 4) {
    ByteReader rest(payload.substr(fields));
    const absl::StatusOr<uint32_t> n = rest.U32("the nonce's length");
    if (n.ok() && *n == rest.remaining()) m.nonce = std::string(payload.substr(fields + 4));
  }
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
  m.relay = f.Flag("relay");
  if (f.Flag("has a relay source")) {
    RelaySource r;
    r.relay = f.U64("the relay's id");
    r.worker_address = f.Str("the relay's worker address");
    r.address = f.U64("the relay descriptor's address");
    r.length = f.U64("the relay descriptor's length");
    r.rkey = f.Str("the relay descriptor's rkey");
    r.pid = f.U64("the relay's pid");
    r.child = f.U32("the child slot");
    m.source = std::move(r);
  }
  return f.Done(std::move(m));
}

absl::StatusOr<RelayOfferMsg> DecodeRelayOffer(std::string_view payload) {
  Fields f(MsgType::kRelayOffer, payload);
  RelayOfferMsg m;
  m.worker_address = f.Str("the worker address");
  m.address = f.U64("the relay descriptor's address");
  m.length = f.U64("the relay descriptor's length");
  m.rkey = f.Str("the relay descriptor's rkey");
  m.pid = f.U64("the pid");
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

absl::StatusOr<ReportMsg> DecodeReport(std::string_view payload) {
  Fields f(MsgType::kReport, payload);
  ReportMsg m;
  m.version = f.U64("the version");
  const std::string_view text = f.View("the report");
  if (f.ok() && text.size() > kMaxReport) {
    return absl::DataLossError(
        absl::StrFormat("malformed REPORT message (%d bytes): the report is %d bytes, at most %d",
                        payload.size(), text.size(), kMaxReport));
  }
  m.text = std::string(text);
  return f.Done(std::move(m));
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

}  // namespace weightbus::internal::ucx

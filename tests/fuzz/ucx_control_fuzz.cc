// SPDX-License-Identifier: Apache-2.0
// Fuzz target of the ucx:// control plane (lib/transports/ucx/control.h): the bytes a peer
// sends on a control connection. The input is cut into frames with TakeFrame, as both sides do,
// and each frame's payload is decoded with its message's decoder (a frame of an unknown type
// with every decoder). Every frame must be taken whole or refused with DataLoss; every decoder
// must refuse with DataLoss naming the message ("malformed GRANT message ...") or return a
// message that Encode writes back byte for byte (HELLO, WELCOME and ERROR: as a prefix, since they
// may carry fields of a later protocol). A status code from the wire never reads as OK. The
// version descriptor's records (layout, seal, header), which subscribers read from registered
// memory, come as frames of types 0xf0-0xf2 and are held to the same rules.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/strings/str_format.h"
#include "core/bytes.h"
#include "fuzz_check.h"
#include "transports/ucx/control.h"
#include "transports/ucx/descriptor.h"

namespace {

namespace ucx = weightbus::internal::ucx;
using ucx::MsgType;

constexpr char kTarget[] = "ucx_control_fuzz";

template <typename... Detail>
void Check(bool ok, const char* what, const Detail&... detail) {
  weightbus::fuzz::Check(ok, kTarget, what, detail...);
}

// Decodes `payload` as a `type` message and checks the result; `exact`: the message must end
// where its fields do.
template <typename Decode>
void Try(MsgType type, const std::string& payload, Decode decode, bool exact) {
  weightbus::fuzz::CheckMessageRoundTrip(
      kTarget, type, payload, decode, exact, [](MsgType t) { return ucx::MsgTypeName(t); },
      [](const auto& m) { return ucx::Encode(m); });
}

// Frame types of this target's input that carry a version descriptor record, not a message.
constexpr uint8_t kLayoutFrame = 0xf0;
constexpr uint8_t kSealFrame = 0xf1;
constexpr uint8_t kHeaderFrame = 0xf2;

// Decodes `bytes` as a descriptor record: refused with DataLoss naming it, or encoded back byte
// for byte.
template <typename Decode, typename EncodeFn>
void TryRecord(const char* name, const std::string& bytes, Decode decode, EncodeFn encode) {
  auto r = decode(bytes);
  if (!r.ok()) {
    weightbus::fuzz::CheckRefusal(r.status(), absl::StatusCode::kDataLoss,
                                  absl::StrFormat("malformed %s", name), kTarget);
    return;
  }
  Check(encode(*r) == bytes, "decode/encode round trip changed the record", name);
}

void DecodeAs(MsgType type, const std::string& p) {
  switch (type) {
    case MsgType::kHello:
      return Try(type, p, ucx::DecodeHello, false);
    case MsgType::kWelcome:
      return Try(type, p, ucx::DecodeWelcome, false);
    case MsgType::kError: {
      Try(type, p, ucx::DecodeError, false);
      Check(!ucx::ErrorStatus(p, "").ok(), "an ERROR message read as OK");
      return;
    }
    case MsgType::kWait:
      return Try(type, p, ucx::DecodeWait, true);
    case MsgType::kGrant:
      return Try(type, p, ucx::DecodeGrant, true);
    case MsgType::kAborted:
      return Try(type, p, ucx::DecodeAborted, true);
    case MsgType::kRelayOffer:
      return Try(type, p, ucx::DecodeRelayOffer, true);
    case MsgType::kRefused:
      return Try(type, p, ucx::DecodeRefused, true);
    case MsgType::kCancel:
      return Try(type, p, ucx::DecodeCancel, true);
    case MsgType::kRenew:
      return Try(type, p, ucx::DecodeRenew, true);
    case MsgType::kRelease:
      return Try(type, p, ucx::DecodeRelease, true);
    case MsgType::kReleased:
      return Try(type, p, ucx::DecodeReleased, true);
    case MsgType::kAccepted:
      return Try(type, p, ucx::DecodeAccepted, true);
    case MsgType::kList:
      return Try(type, p, ucx::DecodeList, true);
    case MsgType::kVersions:
      return Try(type, p, ucx::DecodeVersions, true);
    case MsgType::kRenewed:
      return Try(type, p, ucx::DecodeRenewed, true);
    case MsgType::kRead:
      return Try(type, p, ucx::DecodeRead, true);
    case MsgType::kData:
      return Try(type, p, ucx::DecodeData, true);
    case MsgType::kChallenge:
      return Try(type, p, ucx::DecodeChallenge, true);
    case MsgType::kProof:
      return Try(type, p, ucx::DecodeProof, true);
    case MsgType::kKeyframeRequest: {
      Try(type, p, ucx::DecodeKeyframeRequest, true);
      if (auto k = ucx::DecodeKeyframeRequest(p); k.ok()) {
        Check(k->reason.size() <= ucx::kMaxKeyframeReason,
              "a KEYFRAME_REQUEST reason longer than kMaxKeyframeReason was accepted");
      }
      return;
    }
    case MsgType::kReport: {
      Try(type, p, ucx::DecodeReport, true);
      if (auto r = ucx::DecodeReport(p); r.ok()) {
        Check(r->text.size() <= ucx::kMaxReport, "a REPORT longer than kMaxReport was accepted");
      }
      return;
    }
  }
  // The version descriptor's records (descriptor.h), which subscribers read from a publisher's
  // registered memory: in this target's input, frames of types the protocol does not use.
  switch (static_cast<uint8_t>(type)) {
    case kLayoutFrame:
      return TryRecord("version layout", p, ucx::DecodeLayout, ucx::EncodeLayout);
    case kSealFrame: {
      TryRecord("version seal", p, ucx::DecodeSeal, ucx::EncodeSeal);
      if (auto s = ucx::DecodeSeal(p); s.ok()) {
        // Applying a seal to a manifest it does not fit is refused, never trusted.
        weightbus::Manifest m;
        m.version = s->version;
        m.tensors.resize(s->tensors.size());
        for (size_t i = 0; i < m.tensors.size(); ++i) m.tensors[i].nbytes = i * 4096 + 1;
        auto sealed = ucx::ApplySeal(m, *s);
        if (!sealed.ok()) {
          weightbus::fuzz::CheckRefusal(sealed.status(), absl::StatusCode::kDataLoss,
                                        "the seal of version", kTarget);
        }
      }
      return;
    }
    case kHeaderFrame: {
      auto h = ucx::DecodeHeader(p);
      if (!h.ok()) {
        weightbus::fuzz::CheckRefusal(h.status(), absl::StatusCode::kDataLoss,
                                      "malformed version descriptor header", kTarget);
        return;
      }
      Check(ucx::EncodeHeader(*h) == p, "descriptor header round trip changed it");
      return;
    }
  }
  // An unknown type: no decoder may crash on it either.
  for (uint8_t t = 1; t <= 20; ++t) DecodeAs(static_cast<MsgType>(t), p);
  DecodeAs(MsgType::kKeyframeRequest, p);
  DecodeAs(MsgType::kReport, p);
  for (uint8_t t : {kLayoutFrame, kSealFrame, kHeaderFrame}) DecodeAs(static_cast<MsgType>(t), p);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string buffer(reinterpret_cast<const char*>(data), size);
  while (true) {
    const size_t before = buffer.size();
    absl::StatusOr<std::optional<ucx::Frame>> f = ucx::TakeFrame(buffer);
    if (!f.ok()) {
      weightbus::fuzz::CheckRefusal(f.status(), absl::StatusCode::kDataLoss,
                                    "malformed control frame", kTarget);
      return 0;
    }
    if (!f->has_value()) {
      Check(buffer.size() == before, "TakeFrame consumed bytes without a frame");
      return 0;
    }
    const ucx::Frame& frame = **f;
    Check(buffer.size() + 5 + frame.payload.size() == before, "TakeFrame lost or kept bytes");
    const std::optional<uint64_t> id = ucx::LeadingId(frame.payload);
    Check(id.has_value() == (frame.payload.size() >= 8), "LeadingId on a short payload");
    Check(ucx::StatusCodeFromWire(static_cast<uint32_t>(before), absl::StatusCode::kInternal) !=
              absl::StatusCode::kOk,
          "a wire status code read as OK");
    DecodeAs(frame.type, frame.payload);
  }
}

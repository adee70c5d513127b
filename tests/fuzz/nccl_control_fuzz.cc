// SPDX-License-Identifier: Apache-2.0
// Fuzz target of the nccl:// control plane (lib/transports/nccl/protocol.h) and of the bucket
// plan an OFFER carries (plan.h): the bytes a peer sends on a control connection. The input is
// cut into frames with TakeFrame, as both sides do (at the replica's larger limit), and each
// frame's payload is decoded with its message's decoder (a frame of an unknown type with every
// decoder). Every frame must be taken whole or refused with DataLoss; every decoder must refuse
// with DataLoss naming the message ("malformed OFFER message ...") or return a message that
// Encode writes back byte for byte (HELLO, WELCOME and ERROR: as a prefix, since they may carry
// fields of a later protocol). An OFFER's plan is decoded too and, when it decodes, re-encoded
// byte for byte and checked against a manifest of as many tensors as it names (CheckPlan must
// accept or refuse with DataLoss, never crash); a plan CheckPlan accepts covers every byte once.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/strings/str_format.h"
#include "core/bytes.h"
#include "fuzz_check.h"
#include "transports/nccl/plan.h"
#include "transports/nccl/protocol.h"

namespace {

namespace nccl = weightbus::internal::nccl;
using nccl::MsgType;

constexpr char kTarget[] = "nccl_control_fuzz";

template <typename... Detail>
void Check(bool ok, const char* what, const Detail&... detail) {
  weightbus::fuzz::Check(ok, kTarget, what, detail...);
}

template <typename Decode>
void Try(MsgType type, const std::string& payload, Decode decode, bool exact) {
  weightbus::fuzz::CheckMessageRoundTrip(
      kTarget, type, payload, decode, exact, [](MsgType t) { return nccl::MsgTypeName(t); },
      [](const auto& m) { return nccl::Encode(m); });
}

// The plan of an OFFER: decoded, re-encoded, checked against a manifest of matching size.
void TryPlan(std::string_view bytes) {
  absl::StatusOr<nccl::BucketPlan> plan = nccl::DecodePlan(bytes);
  if (!plan.ok()) {
    weightbus::fuzz::CheckRefusal(plan.status(), absl::StatusCode::kDataLoss,
                                  "malformed bucket plan", kTarget);
    return;
  }
  Check(nccl::EncodePlan(*plan) == bytes, "plan decode/encode round trip changed it");
  // A manifest whose tensors are exactly what the plan carries of each (bounded: a plan can name
  // tensor 4 billion in a few bytes).
  uint32_t max_tensor = 0;
  for (const nccl::Bucket& b : plan->buckets) {
    for (const nccl::Piece& p : b.pieces) max_tensor = std::max(max_tensor, p.tensor);
  }
  if (max_tensor > 4096) return;
  weightbus::Manifest m;
  m.version = 1;
  m.tensors.resize(max_tensor + 1);
  for (const nccl::Bucket& b : plan->buckets) {
    for (const nccl::Piece& p : b.pieces) m.tensors[p.tensor].nbytes += p.length;
  }
  const absl::Status checked = nccl::CheckPlan(*plan, m);
  if (!checked.ok()) {
    weightbus::fuzz::CheckRefusal(checked, absl::StatusCode::kDataLoss, "does not fit its manifest",
                                  kTarget);
    return;
  }
  uint64_t covered = 0;
  for (const nccl::Bucket& b : plan->buckets) {
    Check(b.bytes <= plan->bucket_size, "CheckPlan accepted a bucket larger than bucket_size");
    for (const nccl::Piece& p : b.pieces) covered += p.length;
  }
  Check(covered == m.total_bytes(), "CheckPlan accepted a plan that does not cover its tensors");
  const auto completed = nccl::TensorsCompletedBy(*plan);
  Check(completed.size() == plan->buckets.size(), "TensorsCompletedBy lost buckets");
}

void DecodeAs(MsgType type, const std::string& p) {
  switch (type) {
    case MsgType::kHello:
      return Try(type, p, nccl::DecodeHello, false);
    case MsgType::kWelcome:
      return Try(type, p, nccl::DecodeWelcome, false);
    case MsgType::kError: {
      Try(type, p, nccl::DecodeError, false);
      if (auto e = nccl::DecodeError(p); e.ok()) {
        Check(!nccl::WireStatus(e->code, e->message, absl::StatusCode::kUnavailable, "").ok(),
              "an ERROR message read as OK");
      }
      return;
    }
    case MsgType::kGroup:
      return Try(type, p, nccl::DecodeGroup, true);
    case MsgType::kGroupReady:
      return Try(type, p, nccl::DecodeGroupReady, true);
    case MsgType::kOffer: {
      Try(type, p, nccl::DecodeOffer, true);
      if (auto o = nccl::DecodeOffer(p); o.ok()) TryPlan(o->plan);
      return;
    }
    case MsgType::kReady:
      return Try(type, p, nccl::DecodeReady, true);
    case MsgType::kReceived:
      return Try(type, p, nccl::DecodeReceived, true);
    case MsgType::kAbort:
      return Try(type, p, nccl::DecodeAbort, true);
    case MsgType::kFailed:
      return Try(type, p, nccl::DecodeFailed, true);
    case MsgType::kAccepted:
      return Try(type, p, nccl::DecodeAccepted, true);
    case MsgType::kStart:
      return Try(type, p, nccl::DecodeStart, true);
    case MsgType::kCommit:
      return Try(type, p, nccl::DecodeCommit, true);
    case MsgType::kSlots:
      return Try(type, p, nccl::DecodeSlots, true);
    case MsgType::kBucket:
      return Try(type, p, nccl::DecodeBucket, true);
  }
  // An unknown type: no decoder may crash on it either; nor the plan decoder.
  for (uint8_t t = 1; t <= 15; ++t) DecodeAs(static_cast<MsgType>(t), p);
  TryPlan(p);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string buffer(reinterpret_cast<const char*>(data), size);
  while (true) {
    const size_t before = buffer.size();
    absl::StatusOr<std::optional<nccl::Frame>> f =
        weightbus::internal::control::TakeFrame<MsgType>(buffer, nccl::kMaxFrame);
    if (!f.ok()) {
      weightbus::fuzz::CheckRefusal(f.status(), absl::StatusCode::kDataLoss,
                                    "malformed control frame", kTarget);
      return 0;
    }
    if (!f->has_value()) {
      Check(buffer.size() == before, "TakeFrame consumed bytes without a frame");
      return 0;
    }
    const nccl::Frame& frame = **f;
    Check(buffer.size() + 5 + frame.payload.size() == before, "TakeFrame lost or kept bytes");
    DecodeAs(frame.type, frame.payload);
  }
}

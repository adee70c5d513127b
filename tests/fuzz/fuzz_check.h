// SPDX-License-Identifier: Apache-2.0
// What the fuzz targets share: an invariant check that aborts with a message (libFuzzer and the
// replay drivers both report an abort as a failure, with the input), and the check that a
// refusal is the documented status naming its source.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/bytes.h"

namespace weightbus::fuzz {

inline void CheckBytes(bool ok, const char* target, const char* what, const char* detail,
                       size_t size) {
  if (ok) return;
  std::fprintf(stderr, "%s: invariant violated: %s %.*s\n", target, what, static_cast<int>(size),
               detail);
  std::fflush(stderr);
  std::abort();
}
inline void Check(bool ok, const char* target, const char* what, const char* detail = "") {
  CheckBytes(ok, target, what, detail, std::strlen(detail));
}
inline void Check(bool ok, const char* target, const char* what, const std::string& detail) {
  CheckBytes(ok, target, what, detail.data(), detail.size());
}
inline void Check(bool ok, const char* target, const char* what, std::string_view detail) {
  CheckBytes(ok, target, what, detail.data(), detail.size());
}
// (Debian's Abseil has a string_view type of its own: the messages of absl::Status are one.)
inline void Check(bool ok, const char* target, const char* what, absl::string_view detail) {
  CheckBytes(ok, target, what, detail.data(), detail.size());
}

// `s` is not OK, has code `code` and a message containing `needle` (the source it names, or
// the message kind).
inline void CheckRefusal(const absl::Status& s, absl::StatusCode code, std::string_view needle,
                         const char* target) {
  const std::string text = s.ToString();
  Check(!s.ok() && s.code() == code, target, "refused with an unexpected code:", text);
  Check(text.find(needle) != std::string::npos, target, "refusal does not name", text);
}

// A control-plane message (ucx's and nccl's framing: u32 length, u8 type, fields) decoded from
// `payload` as a `type` message: either refused with DataLoss naming "malformed NAME message",
// or re-encoded into a frame of the same type and length prefix whose fields are the payload's
// (`exact`: the whole payload; else a prefix, for messages that may carry trailing bytes).
// `name_of(type)` names the type; `encode(message)` frames a decoded message.
template <typename MsgType, typename Decode, typename NameOf, typename EncodeFn>
void CheckMessageRoundTrip(const char* target, MsgType type, const std::string& payload,
                           Decode decode, bool exact, NameOf name_of, EncodeFn encode) {
  auto m = decode(payload);
  const std::string name(name_of(type));
  if (!m.ok()) {
    CheckRefusal(m.status(), absl::StatusCode::kDataLoss,
                 absl::StrFormat("malformed %s message", name), target);
    return;
  }
  const std::string frame = encode(*m);
  Check(frame.size() >= 5 && static_cast<uint8_t>(frame[4]) == static_cast<uint8_t>(type), target,
        "Encode wrote another type", name);
  Check(weightbus::internal::LoadLe<uint32_t>(frame.data()) == frame.size() - 4, target,
        "Encode wrote a wrong length prefix", name);
  const std::string_view body = std::string_view(frame).substr(5);
  if (exact) {
    Check(body == payload, target, "decode/encode round trip changed the message", name);
  } else {
    Check(std::string_view(payload).substr(0, body.size()) == body, target,
          "decode/encode round trip changed the message's fields", name);
  }
}

}  // namespace weightbus::fuzz

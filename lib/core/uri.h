// SPDX-License-Identifier: Apache-2.0
// Channel URIs: scheme://authority/path?key=value&key=value
//   disk:///abs/path/to/channel        (authority empty or "localhost")
//   ucx://host:port/channel, ucx://[::1]:port/channel
//   ucx://:port/channel                 (no host: kDefaultHost, this machine's loopback)
//   delta+disk:///path                  (layered scheme)
// Path and query are percent-decoded. The path may not contain an encoded '/' or NUL
// (%2F, %00) nor a "." or ".." segment (written or encoded): a channel name never climbs out
// of the directory it is written under.
#pragma once

#include <map>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace weightbus::internal {

// The host of a URI whose authority gives a port but no host ("ucx://:13337/policy"): this
// machine's loopback, as "localhost" resolves. A network listener binds to loopback unless its
// URI names another address (docs/SECURITY.md, "Where a publisher listens"); a peer connecting
// with such a URI reaches a publisher on this machine.
inline constexpr char kDefaultHost[] = "localhost";

struct Uri {
  std::string text;                          // as given
  std::string scheme;                        // lower-case, e.g. "disk" or "delta+ucx"
  std::string authority;                     // raw, e.g. "host:1234" or "[::1]:1234"; may be empty
  std::string host;                          // without brackets; empty when no authority,
                                             // kDefaultHost for ":port"
  int port = -1;                             // -1 when absent
  std::string path;                          // decoded, starts with '/' when present
  std::map<std::string, std::string> query;  // decoded

  // The URI without its query, for messages.
  std::string Display() const;
};

// Errors: InvalidArgument naming the URI and what is wrong (missing "://", bad port, bad
// percent-escape, unterminated '[', duplicate query key, a path segment "." or "..", an encoded
// '/', '\\' or NUL in the path).
absl::StatusOr<Uri> ParseUri(std::string_view text);

// Decodes the %XX escapes (RFC 3986, hex digits of either case) of `in`, a part of URI `uri`
// (for messages); every other byte is kept as it is ('+' stays '+'). The one decoder of the
// library: ParseUri uses it for the path and the query, ucx:// for an IPv6 zone in the host
// (fe80::1%25eth0). Errors: InvalidArgument naming the URI and the escape, for a '%' not followed
// by two hex digits.
absl::StatusOr<std::string> PercentDecode(std::string_view uri, std::string_view in);

}  // namespace weightbus::internal

// SPDX-License-Identifier: Apache-2.0
#include "core/uri.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/status.h"

namespace weightbus::internal {
namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The path names a directory (disk) or a channel (ucx) exactly as written: segments are
// separated by literal '/' only, and none may climb or stay put ("." or ".."), so that a name
// never leaves the base it appears to be under. `raw` is the path before decoding.
absl::Status CheckPath(std::string_view uri, std::string_view raw, std::string_view decoded) {
  for (size_t i = 0; i + 2 < raw.size(); ++i) {
    if (raw[i] != '%') continue;
    const char hi = raw[i + 1], lo = static_cast<char>(absl::ascii_tolower(raw[i + 2]));
    if ((hi == '2' && lo == 'f') || (hi == '0' && lo == '0')) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "URI \"%s\": the path may not contain an encoded '/' or NUL (\"%s\"); write "
          "path separators as '/'",
          uri, raw.substr(i, 3)));
    }
  }
  for (absl::string_view segment :
       absl::StrSplit(absl::string_view(decoded.data(), decoded.size()), '/')) {
    if (segment == "." || segment == "..") {
      return absl::InvalidArgumentError(absl::StrFormat(
          "URI \"%s\": the path may not have a \"%s\" segment; name the channel directory "
          "directly",
          uri, std::string(segment)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> PercentDecode(std::string_view uri, std::string_view in) {
  std::string out;
  out.reserve(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out.push_back(in[i]);
      continue;
    }
    if (i + 2 >= in.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("URI \"%s\": truncated percent-escape at the end", uri));
    }
    const int hi = HexDigit(in[i + 1]), lo = HexDigit(in[i + 2]);
    if (hi < 0 || lo < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("URI \"%s\": bad percent-escape \"%s\"", uri, in.substr(i, 3)));
    }
    out.push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return out;
}

std::string Uri::Display() const { return absl::StrFormat("%s://%s%s", scheme, authority, path); }

absl::StatusOr<Uri> ParseUri(std::string_view text) {
  Uri uri;
  uri.text = std::string(text);
  size_t sep = text.find("://");
  if (sep == std::string_view::npos || sep == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "URI \"%s\" has no scheme: expected scheme://..., e.g. disk:///path/to/channel", text));
  }
  uri.scheme = absl::AsciiStrToLower(absl::string_view(text.data(), sep));
  for (char c : uri.scheme) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '+' && c != '-' && c != '.') {
      return absl::InvalidArgumentError(
          absl::StrFormat("URI \"%s\": scheme \"%s\" has an invalid character", text, uri.scheme));
    }
  }
  std::string_view rest = text.substr(sep + 3);
  std::string_view query;
  if (size_t q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  size_t slash = rest.find('/');
  std::string_view authority = rest.substr(0, slash);
  std::string_view path = slash == std::string_view::npos ? std::string_view() : rest.substr(slash);
  uri.authority = std::string(authority);

  if (!authority.empty()) {
    std::string_view host_port = authority;
    std::string_view port_text;
    if (host_port.front() == '[') {
      size_t close = host_port.find(']');
      if (close == std::string_view::npos) {
        return absl::InvalidArgumentError(
            absl::StrFormat("URI \"%s\": unterminated '[' in the host", text));
      }
      uri.host = std::string(host_port.substr(1, close - 1));
      std::string_view after = host_port.substr(close + 1);
      if (!after.empty()) {
        if (after.front() != ':') {
          return absl::InvalidArgumentError(
              absl::StrFormat("URI \"%s\": expected ':' after ']'", text));
        }
        port_text = after.substr(1);
      }
    } else {
      size_t colon = host_port.rfind(':');
      if (colon != std::string_view::npos && host_port.find(':') != colon) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "URI \"%s\": an IPv6 address must be in brackets, e.g. [::1]:9000", text));
      }
      uri.host = std::string(host_port.substr(0, colon));
      if (colon != std::string_view::npos) port_text = host_port.substr(colon + 1);
      // ":port" names no host: loopback, never every interface (issue 17).
      if (uri.host.empty()) uri.host = kDefaultHost;
    }
    if (!port_text.empty() || authority.back() == ':') {
      int port = 0;
      if (!absl::SimpleAtoi(absl::string_view(port_text.data(), port_text.size()), &port) ||
          port < 0 || port > 65535) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "URI \"%s\": port \"%s\" is not a number in 0..65535", text, port_text));
      }
      uri.port = port;
    }
  }

  absl::StatusOr<std::string> decoded_path = PercentDecode(text, path);
  if (!decoded_path.ok()) return decoded_path.status();
  uri.path = *std::move(decoded_path);
  WB_RETURN_IF_ERROR(CheckPath(text, path, uri.path));

  if (!query.empty()) {
    for (absl::string_view pair :
         absl::StrSplit(absl::string_view(query.data(), query.size()), '&', absl::SkipEmpty())) {
      size_t eq = pair.find('=');
      absl::StatusOr<std::string> key =
          PercentDecode(text, std::string_view(pair.data(), std::min(eq, pair.size())));
      if (!key.ok()) return key.status();
      std::string value_text =
          eq == absl::string_view::npos ? "true" : std::string(pair.substr(eq + 1));
      absl::StatusOr<std::string> value = PercentDecode(text, value_text);
      if (!value.ok()) return value.status();
      if (!uri.query.emplace(*key, *value).second) {
        return absl::InvalidArgumentError(
            absl::StrFormat("URI \"%s\": query key \"%s\" appears twice", text, *key));
      }
    }
  }
  return uri;
}

}  // namespace weightbus::internal

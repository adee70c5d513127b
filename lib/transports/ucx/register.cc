// SPDX-License-Identifier: Apache-2.0
#include <arpa/inet.h>

#include <cstdio>

#include "absl/strings/str_format.h"
#include "core/registry.h"
#include "transports/ucx/ucx_transport.h"

namespace weightbus::internal::ucx {

const SettingTable& UcxSettings() {
  static const SettingTable* table = new SettingTable{
      "ucx",
      {
          {"staging_slots", SettingType::kInt, "2",
           "versions the publisher keeps in registered staging memory (1..64); Publish reuses a "
           "slot only when no subscriber holds its version (or their leases expired)"},
          {"lease", SettingType::kDuration, "10s",
           "how long a subscriber's hold on a version lasts without renewal; a stalled "
           "subscriber blocks slot reuse at most this long (a disconnected one not at all)"},
          {"connect_timeout", SettingType::kDuration, "5s",
           "how long a subscriber keeps trying to reach the rendezvous endpoint (refused, "
           "unreachable) before failing with Unavailable; also the publisher's wait for a "
           "subscriber's greeting"},
          {"get_chunk_size", SettingType::kBytes, "4MiB",
           "bytes per one-sided get (ucp_get_nbx) when a subscriber pulls a version (>= 4KiB)"},
          {"gets_in_flight", SettingType::kInt, "8",
           "gets a subscriber keeps outstanding while pulling a version (1..1024)"},
          {"max_region", SettingType::kBytes, "1GiB",
           "largest single memory registration (ucp_mem_map); staging slots and receive "
           "buffers above it are registered in pieces (>= 1MiB); set it to the device's "
           "maximum region size when that is smaller"},
          {"copy_threads", SettingType::kInt, "2",
           "threads copying a version into its staging slot during Publish (1..16)"},
          {"staging_memory",
           SettingType::kEnum,
           "host",
           "where staging slots live: host memory, or cuda (GPU memory, served with cuda_ipc or "
           "GPUDirect RDMA; needs a build with CUDA)",
           {"host", "cuda"}},
      }};
  return *table;
}

namespace {

// Decodes %XX escapes in a host (an IPv6 zone is written fe80::1%25eth0 in URIs).
absl::StatusOr<std::string> DecodeHost(const Uri& uri) {
  std::string out;
  const std::string& in = uri.host;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out.push_back(in[i]);
      continue;
    }
    unsigned value = 0;
    if (i + 2 >= in.size() || std::sscanf(in.substr(i + 1, 2).c_str(), "%2x", &value) != 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("URI \"%s\": bad percent-escape in host \"%s\"", uri.text, in));
    }
    out.push_back(static_cast<char>(value));
    i += 2;
  }
  return out;
}

bool IsWildcard(const std::string& host) {
  in_addr v4;
  in6_addr v6;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return v4.s_addr == htonl(INADDR_ANY);
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_UNSPECIFIED(&v6);
  }
  return host == "*";
}

}  // namespace

bool IsLoopback(const std::string& host) {
  in_addr v4;
  in6_addr v6;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return host == "localhost";
}

absl::StatusOr<Endpoint> ParseEndpoint(const Uri& uri, bool for_subscriber) {
  Endpoint e;
  e.display = uri.Display();
  if (uri.authority.empty() || uri.host.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "URI \"%s\": ucx:// needs the publisher's host and port, e.g. ucx://trainer-0:13337/policy",
        uri.text));
  }
  if (uri.port <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("URI \"%s\": ucx:// needs a port in 1..65535, e.g. ucx://%s:13337%s",
                        uri.text, uri.authority.front() == '[' ? "[" + uri.host + "]" : uri.host,
                        uri.path.empty() ? "/policy" : uri.path));
  }
  e.port = uri.port;
  absl::StatusOr<std::string> host = DecodeHost(uri);
  if (!host.ok()) return host.status();
  e.host = *std::move(host);
  if (for_subscriber && IsWildcard(e.host)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "URI \"%s\": \"%s\" is a wildcard address; a publisher may listen on it, but a "
        "subscriber must name the publisher's host name or address",
        uri.text, uri.host));
  }
  if (uri.path.size() < 2 || uri.path.front() != '/') {
    return absl::InvalidArgumentError(absl::StrFormat(
        "URI \"%s\": ucx:// needs a channel name after the port, e.g. ucx://%s/policy", uri.text,
        uri.authority));
  }
  e.channel = uri.path.substr(1);
  if (e.channel.size() > 1024 || e.channel.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "URI \"%s\": the channel name must be 1..1024 bytes without NUL", uri.text));
  }
  return e;
}

absl::StatusOr<UcxOptions> ReadOptions(const Endpoint& endpoint, const Config& config) {
  UcxOptions o;
  auto bad = [&](std::string_view name, const std::string& value, std::string_view range) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: setting %s=%s is outside %s", endpoint.display, name, value, range));
  };
  o.staging_slots = config.Int("staging_slots");
  if (o.staging_slots < 1 || o.staging_slots > 64) {
    return bad("staging_slots", std::to_string(o.staging_slots), "1..64");
  }
  o.lease = config.Duration("lease");
  if (o.lease < absl::Milliseconds(10)) {
    return bad("lease", absl::FormatDuration(o.lease), "10ms or more");
  }
  o.connect_timeout = config.Duration("connect_timeout");
  if (o.connect_timeout < absl::Milliseconds(1)) {
    return bad("connect_timeout", absl::FormatDuration(o.connect_timeout), "1ms or more");
  }
  o.get_chunk_size = config.Bytes("get_chunk_size");
  if (o.get_chunk_size < 4096) {
    return bad("get_chunk_size", std::to_string(o.get_chunk_size), "4KiB or more");
  }
  o.gets_in_flight = config.Int("gets_in_flight");
  if (o.gets_in_flight < 1 || o.gets_in_flight > 1024) {
    return bad("gets_in_flight", std::to_string(o.gets_in_flight), "1..1024");
  }
  o.max_region = config.Bytes("max_region");
  if (o.max_region < (uint64_t{1} << 20)) {
    return bad("max_region", std::to_string(o.max_region), "1MiB or more");
  }
  o.max_region &= ~uint64_t{4095};  // whole pages, so pieces stay page-aligned
  o.copy_threads = config.Int("copy_threads");
  if (o.copy_threads < 1 || o.copy_threads > 16) {
    return bad("copy_threads", std::to_string(o.copy_threads), "1..16");
  }
  o.cuda_staging = config.String("staging_memory") == "cuda";
  return o;
}

TransportCapabilities UcxCapabilities(const Config& config, const TransportCapabilities&) {
  TransportCapabilities c;
  // Host staging copies every tensor into its slot with PublishJob::CopyWithChecksum (strided
  // views gathered straight into place, checksummed as they pass); CUDA staging does neither.
  const bool host_staging = config.String("staging_memory") != "cuda";
  c.reads_strided_views = host_staging;
  c.copies_with_checksums = host_staging;
  c.keep_versions_from = true;  // staging slots beyond staging_slots
  c.wait_for_receivers = true;
  c.open_version = true;
  c.list_versions = true;
  c.cancel = true;
  c.cross_process = true;
  c.durable = false;  // versions live in the publisher's staging memory
  c.late_joiners = true;
  return c;
}

}  // namespace weightbus::internal::ucx

WEIGHTBUS_REGISTER_TRANSPORT(
    ucx,
    (::weightbus::internal::TransportDescriptor{
        "ucx",
        "UCX (UCP) one-sided RDMA: subscribers pull each version from the publisher's "
        "registered staging memory (InfiniBand, RoCE, shared memory, TCP)",
        &::weightbus::internal::ucx::UcxSettings(), ::weightbus::internal::ucx::OpenUcxPublisher,
        ::weightbus::internal::ucx::OpenUcxSubscriber, /*wrap_publisher=*/nullptr,
        /*wrap_subscriber=*/nullptr, ::weightbus::internal::ucx::UcxCapabilities}))

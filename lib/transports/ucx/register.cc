// SPDX-License-Identifier: Apache-2.0
#include "absl/strings/str_format.h"
#include "core/control_plane.h"
#include "core/registry.h"
#include "core/status.h"
#include "transports/ucx/ucp_util.h"
#include "transports/ucx/ucx_transport.h"

namespace weightbus::internal::ucx {

const SettingTable& UcxSettings() {
  static const SettingTable* table = new SettingTable{
      "ucx",
      {
          {.name = "staging_slots",
           .type = SettingType::kInt,
           .default_value = "2",
           .doc = "versions the publisher keeps in registered staging memory; Publish reuses a "
                  "slot only when no subscriber holds its version (or their leases expired)",
           .min = "1",
           .max = "64",
           .unit = "versions"},
          {.name = "lease",
           .type = SettingType::kDuration,
           .default_value = "10s",
           .doc = "how long a subscriber's hold on a version lasts without renewal; a stalled "
                  "subscriber blocks slot reuse at most this long (a disconnected one not at all)",
           .min = "10ms"},
          {.name = "lease_max_hold",
           .type = SettingType::kDuration,
           .default_value = "5m",
           .doc = "longest a lease lasts, renewals included (at least lease): a renewal that "
                  "would go past it is refused, and while a Publish waits for a staging slot no "
                  "new lease is granted on it, so clients that renew for ever block a slot at "
                  "most this long; a transfer must finish within it",
           .min = "10ms"},
          {.name = "max_connections",
           .type = SettingType::kInt,
           .default_value = "1024",
           .doc = "subscriber control connections a publisher serves at once; one more is "
                  "answered ResourceExhausted (and closed), so that one peer cannot take every "
                  "file descriptor",
           .min = "1",
           .max = "65536",
           .unit = "connections"},
          {.name = "connect_timeout",
           .type = SettingType::kDuration,
           .default_value = "5s",
           .doc = "how long a subscriber keeps trying to reach the rendezvous endpoint (refused, "
                  "unreachable) before failing with Unavailable; also the publisher's wait for a "
                  "subscriber's greeting",
           .min = "1ms"},
          {.name = "get_chunk_size",
           .type = SettingType::kBytes,
           .default_value = "4MiB",
           .doc = "bytes per one-sided get (ucp_get_nbx) when a subscriber pulls a version",
           .min = "4KiB"},
          {.name = "gets_in_flight",
           .type = SettingType::kInt,
           .default_value = "8",
           .doc = "gets a subscriber keeps outstanding while pulling a version",
           .min = "1",
           .max = "1024",
           .unit = "gets"},
          {.name = "max_region",
           .type = SettingType::kBytes,
           .default_value = "1GiB",
           .doc = "largest single memory registration (ucp_mem_map); staging slots and receive "
                  "buffers above it are registered in pieces; set it to the device's maximum "
                  "region size when that is smaller (rounded down to whole 4KiB pages)",
           .min = "1MiB"},
          {.name = "copy_threads",
           .type = SettingType::kInt,
           .default_value = "2",
           .doc = "threads copying a version into its staging slot during Publish",
           .min = "1",
           .max = "16",
           .unit = "threads"},
          {.name = "pipeline",
           .type = SettingType::kBool,
           .default_value = "true",
           .doc = "publisher: announce each version before staging it, so that subscribers "
                  "pull each chunk of ready_chunk bytes as soon as it is staged (verified against "
                  "the sealed manifest afterwards; a failed Publish fails their transfer with "
                  "Aborted); false: announce a version once it is staged and sealed"},
          {.name = "ready_chunk",
           .type = SettingType::kBytes,
           .default_value = "4MiB",
           .doc = "publisher: the granularity at which staged bytes are announced ready "
                  "(pipeline=true): a subscriber trails the staging copy by about this much",
           .min = "64KiB"},
          {.name = "publish_mode",
           .type = SettingType::kEnum,
           .default_value = "staged",
           .doc = "publisher: staged copies each version into registered staging memory and "
                  "returns (the trainer's stall: one copy); zero_copy registers the caller's "
                  "tensors (cached across versions) and serves them in place: Publish returns "
                  "once the subscribers connected when it began have pulled the version (each "
                  "given at most one lease to ask; the stall is the transfer), after which the "
                  "version is no longer served (no late joiners)",
           .choices = {"staged", "zero_copy"}},
          {.name = "relay_fanout",
           .type = SettingType::kInt,
           .default_value = "0",
           .doc = "publisher: fan-out through subscribers (README.md, \"Fan-out\"): the "
                  "publisher serves at most this many subscribers of a version directly and each "
                  "subscriber that offers to relay serves at most this many others the chunks it "
                  "received (1: a chain, 2: a binary tree), so that the publisher sends each byte "
                  "about once; 0: every subscriber pulls from the publisher",
           .min = "0",
           .max = "64",
           .unit = "subscribers"},
          {.name = "relay",
           .type = SettingType::kBool,
           .default_value = "true",
           .doc = "subscriber: offer to relay the versions this subscriber receives to others "
                  "(used when the publisher sets relay_fanout); its receive buffers are then "
                  "readable by the channel's other subscribers while it receives"},
          {.name = "relay_stall",
           .type = SettingType::kDuration,
           .default_value = "500ms",
           .doc = "how long a subscriber waits for its relay to make progress before it pulls the "
                  "rest from the publisher, and how long a relay waits for a child that stopped "
                  "reading before it hands its own version over",
           .min = "1ms"},
          {.name = "staging_memory",
           .type = SettingType::kEnum,
           .default_value = "host",
           .doc = "where staging slots live: host memory, or cuda (GPU memory, served with "
                  "cuda_ipc or GPUDirect RDMA; needs a build with CUDA)",
           .choices = {"host", "cuda"}},
      }};
  return *table;
}

namespace {

bool IsWildcard(const std::string& host) { return control::IsWildcardHost(host); }

}  // namespace

bool IsLoopback(const std::string& host) { return control::IsLoopbackHost(host); }

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
  // The host as written (an IPv6 zone is written fe80::1%25eth0 in URIs), decoded.
  absl::StatusOr<std::string> host = PercentDecode(uri.text, uri.host);
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
  // Ranges are declared in UcxSettings and checked by Config::Resolve.
  UcxOptions o;
  o.staging_slots = config.Int("staging_slots");
  o.lease = config.Duration("lease");
  o.lease_max_hold = config.Duration("lease_max_hold");
  if (o.lease_max_hold < o.lease) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: lease_max_hold=%s is shorter than lease=%s (a version is held for one lease at "
        "least)",
        endpoint.display, absl::FormatDuration(o.lease_max_hold), absl::FormatDuration(o.lease)));
  }
  o.max_connections = config.Int("max_connections");
  o.connect_timeout = config.Duration("connect_timeout");
  o.get_chunk_size = config.Bytes("get_chunk_size");
  o.gets_in_flight = config.Int("gets_in_flight");
  o.max_region = config.Bytes("max_region") & ~uint64_t{4095};  // whole pages: pieces stay
                                                                // page-aligned
  o.copy_threads = config.Int("copy_threads");
  o.cuda_staging = config.String("staging_memory") == "cuda";
  o.pipeline = config.Bool("pipeline");
  o.zero_copy = config.String("publish_mode") == "zero_copy";
  o.relay_fanout = config.Int("relay_fanout");
  o.relay = config.Bool("relay");
  o.relay_stall = config.Duration("relay_stall");
  if (o.zero_copy && o.cuda_staging) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: publish_mode=zero_copy serves the caller's tensors in place: it has no staging "
        "memory, so staging_memory=cuda does not apply (leave it host)",
        endpoint.display));
  }
  o.ready_chunk = config.Bytes("ready_chunk") & ~uint64_t{4095};
  WB_ASSIGN_OR_RETURN(o.key, LoadChannelKey(config, endpoint.display));
  return o;
}

TransportCapabilities UcxCapabilities(const Config& config, const TransportCapabilities&) {
  TransportCapabilities c;
  // Host staging copies every tensor into its slot with PublishJob::CopyWithChecksum (strided
  // views gathered straight into place, checksummed as they pass); CUDA staging does neither.
  const bool host_staging = config.String("staging_memory") != "cuda";
  // Zero-copy publish serves the caller's memory as it is: the core packs strided views (into a
  // buffer that lives as long as Publish) and checksums the tensors while subscribers pull them;
  // a version is served only while its Publish runs.
  const bool zero_copy = config.String("publish_mode") == "zero_copy";
  c.reads_strided_views = host_staging && !zero_copy;
  c.copies_with_checksums = host_staging && !zero_copy;
  c.keep_versions_from = true;  // staging slots beyond staging_slots
  c.wait_for_receivers = true;
  c.open_version = true;
  c.list_versions = true;
  c.cancel = true;
  c.keyframe_requests = true;   // KEYFRAME_REQUEST over the control connection
  c.subscriber_reports = true;  // REPORT over the control connection
  c.cross_process = true;
  c.durable = false;  // versions live in the publisher's staging memory
  c.late_joiners = !zero_copy;
  if (zero_copy) {
    c.keep_versions_from = false;
    c.open_version = false;
  }
  // Any byte range of a tensor, pulled straight from the staging slot that holds it.
  c.partial_reads = true;
  // Each rank stages and serves its own parts; rank 0, at the URI's address, commits a version
  // once every rank's part is staged (README.md, "Publisher groups").
  c.publisher_groups = true;
  // On a shared-secret channel every rank proves the secret when it joins rank 0, rank 0 checks
  // each part's MAC before it commits, and the group's manifest carries the MAC of the whole
  // (docs/SECURITY.md, "Publisher groups").
  c.authenticated_groups = true;
  // Device memory (README.md, "CUDA memory"): subscribers get straight into CUDA targets where
  // UCX moves CUDA memory (its gets and READ copies handle device memory); GPU staging slots
  // are filled from CUDA tensors device to device (host staging copies on the CPU: the core
  // stages CUDA tensors through pinned memory for it).
  if (UcxMovesCudaMemory()) c.fetch_memory |= TransportCapabilities::kCudaMemory;
  if (!host_staging && CudaSupported()) c.publish_memory |= TransportCapabilities::kCudaMemory;
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

// SPDX-License-Identifier: Apache-2.0
#include "absl/strings/str_format.h"
#include "core/control_plane.h"
#include "core/registry.h"
#include "core/status.h"
#include "transports/nccl/nccl_transport.h"
#include "transports/nccl/plan.h"

namespace weightbus::internal::nccl {

const SettingTable& NcclSettings() {
  static const SettingTable* table = new SettingTable{
      "nccl",
      {
          {.name = "bucket_size",
           .type = SettingType::kBytes,
           .default_value = "256MiB",
           .doc = "size of each GPU bucket a version is packed into and broadcast in (a multiple "
                  "of 256 bytes; a tensor larger than a bucket is split over several); decided "
                  "by the publisher and sent with each version, a replica's own value is unused",
           .min = "4KiB",
           .max = "16GiB"},
          {.name = "buckets_in_flight",
           .type = SettingType::kInt,
           .default_value = "2",
           .doc = "buckets in flight per side, each with its own CUDA stream and buffer of "
                  "bucket_size bytes: packing (unpacking) one overlaps the broadcast of another",
           .min = "2",
           .max = "8",
           .unit = "buckets"},
          {.name = "cuda_device",
           .type = SettingType::kInt,
           .default_value = "-1",
           .doc = "the GPU (CUDA device ordinal) this side's rank uses; -1: the current device "
                  "of the thread that opens the channel",
           .min = "-1",
           .max = "1023"},
          {.name = "connect_timeout",
           .type = SettingType::kDuration,
           .default_value = "5s",
           .doc = "how long a replica keeps trying to reach the publisher's rendezvous "
                  "endpoint before failing with Unavailable; also how long the publisher waits "
                  "for a replica's greeting",
           .min = "1ms"},
          {.name = "max_replicas",
           .type = SettingType::kInt,
           .default_value = "1024",
           .doc = "replica connections a publisher accepts at once; one more is refused with "
                  "ResourceExhausted",
           .min = "1",
           .max = "65536",
           .unit = "replicas"},
          {.name = "min_replicas",
           .type = SettingType::kInt,
           .default_value = "0",
           .doc = "a Publish first waits (up to its timeout) until this many replicas are "
                  "connected; 0: it delivers to whoever is connected, possibly nobody",
           .min = "0",
           .max = "65536",
           .unit = "replicas"},
      }};
  return *table;
}

absl::StatusOr<Endpoint> ParseEndpoint(const Uri& uri, bool for_subscriber) {
  Endpoint e;
  e.display = uri.Display();
  if (uri.authority.empty() || uri.host.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("URI \"%s\": nccl:// needs the publisher's host and port, e.g. "
                        "nccl://trainer-0:29600/policy",
                        uri.text));
  }
  if (uri.port <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("URI \"%s\": nccl:// needs a port in 1..65535, e.g. nccl://%s:29600%s",
                        uri.text, uri.authority.front() == '[' ? "[" + uri.host + "]" : uri.host,
                        uri.path.empty() ? "/policy" : uri.path));
  }
  e.port = uri.port;
  WB_ASSIGN_OR_RETURN(e.host, PercentDecode(uri.text, uri.host));
  if (for_subscriber && control::IsWildcardHost(e.host)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "URI \"%s\": \"%s\" is a wildcard address; a publisher may listen on it, but a replica "
        "must name the publisher's host name or address",
        uri.text, uri.host));
  }
  if (uri.path.size() < 2 || uri.path.front() != '/') {
    return absl::InvalidArgumentError(absl::StrFormat(
        "URI \"%s\": nccl:// needs a channel name after the port, e.g. nccl://%s/policy", uri.text,
        uri.authority));
  }
  e.channel = uri.path.substr(1);
  if (e.channel.size() > 1024 || e.channel.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "URI \"%s\": the channel name must be 1..1024 bytes without NUL", uri.text));
  }
  return e;
}

absl::StatusOr<NcclOptions> ReadOptions(const Endpoint& endpoint, const Config& config) {
  NcclOptions o;
  o.bucket_size = config.Bytes("bucket_size");
  if (o.bucket_size % kPieceAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: bucket_size=%d is not a multiple of %d bytes (where each tensor's piece of a bucket "
        "starts)",
        endpoint.display, o.bucket_size, kPieceAlignment));
  }
  o.buckets_in_flight = static_cast<int>(config.Int("buckets_in_flight"));
  o.cuda_device = static_cast<int>(config.Int("cuda_device"));
  o.connect_timeout = config.Duration("connect_timeout");
  o.max_replicas = config.Int("max_replicas");
  o.min_replicas = config.Int("min_replicas");
  if (o.min_replicas > o.max_replicas) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: min_replicas=%d is more than max_replicas=%d", endpoint.display,
                        o.min_replicas, o.max_replicas));
  }
  return o;
}

TransportCapabilities NcclCapabilities(const Config&, const TransportCapabilities&) {
  TransportCapabilities c;
  // The publisher pushes every version to every replica connected at the time, in one
  // collective: each replica takes part in each version, and one that joins later receives the
  // versions published after it joined.
  c.delivery = TransportCapabilities::Delivery::kPush;
  c.all_subscribers_take_part = true;
  c.late_joiners = false;
  c.durable = false;
  c.cross_process = true;
  c.cancel = true;
  c.wait_for_receivers = true;  // ACCEPTED over the control connection
  // Buckets are device memory: CUDA tensors are packed from, and CUDA destinations unpacked into,
  // with device-to-device copies (cudaMemcpyAsync, cudaMemcpyDefault), host ones across PCIe.
  c.publish_memory = TransportCapabilities::kHostMemory | TransportCapabilities::kCudaMemory;
  c.fetch_memory = TransportCapabilities::kHostMemory | TransportCapabilities::kCudaMemory;
  return c;
}

}  // namespace weightbus::internal::nccl

WEIGHTBUS_REGISTER_TRANSPORT(
    nccl, (::weightbus::internal::TransportDescriptor{
              "nccl",
              "NCCL broadcast: the publisher (rank 0) pushes each version, packed into GPU "
              "buckets, to every replica GPU of one communicator; aborts instead of hanging",
              &::weightbus::internal::nccl::NcclSettings(),
              ::weightbus::internal::nccl::OpenNcclPublisher,
              ::weightbus::internal::nccl::OpenNcclSubscriber, /*wrap_publisher=*/nullptr,
              /*wrap_subscriber=*/nullptr, ::weightbus::internal::nccl::NcclCapabilities}))

// SPDX-License-Identifier: Apache-2.0
// The nccl:// transport: the publisher (rank 0) broadcasts each version, packed into fixed-size
// GPU buckets, to every replica over one NCCL communicator; the publisher hosts the rendezvous
// on HOST:PORT of the URI (protocol.h) that hands out the ncclUniqueId and the ranks. How it
// works, what it costs and how it fails: README.md; the publisher's state machine: root.h; the
// bucket pipeline: pipeline.h; what NCCL and CUDA calls go through: device.h.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/config.h"
#include "core/transport.h"
#include "core/uri.h"

namespace weightbus::internal::nccl {

const SettingTable& NcclSettings();

// Where a channel is served: nccl://HOST:PORT/CHANNEL.
struct Endpoint {
  std::string host;     // a name, an IPv4 address or an IPv6 address without brackets
  int port = 0;         // 1..65535
  std::string channel;  // the URI path without its leading '/', non-empty
  std::string display;  // the URI without its query, for messages
};

// Parses and checks an nccl:// URI. `for_subscriber` also refuses wildcard hosts.
// Errors: InvalidArgument naming the URI and what is wrong, with an example of the right form.
absl::StatusOr<Endpoint> ParseEndpoint(const Uri& uri, bool for_subscriber);

// The transport's settings, read once (ranges are checked by Config::Resolve).
struct NcclOptions {
  uint64_t bucket_size = 0;   // a multiple of kPieceAlignment (plan.h)
  int buckets_in_flight = 2;  // streams and bucket buffers per side, >= 2
  int cuda_device = -1;       // -1: the calling thread's current device
  absl::Duration connect_timeout;
  int64_t max_replicas = 0;
  int64_t min_replicas = 0;
};
// Errors: InvalidArgument naming the URI and the setting (bucket_size not a multiple of 256).
absl::StatusOr<NcclOptions> ReadOptions(const Endpoint& endpoint, const Config& config);

TransportCapabilities NcclCapabilities(const Config& config, const TransportCapabilities&);

absl::StatusOr<std::unique_ptr<TransportPublisher>> OpenNcclPublisher(const Uri& uri,
                                                                      const Config& config);
absl::StatusOr<std::unique_ptr<TransportSubscriber>> OpenNcclSubscriber(const Uri& uri,
                                                                        const Config& config);

// What an nccl:// publisher has done so far, for tests, benchmarks and diagnostics.
struct NcclPublisherCounters {
  uint64_t epochs = 0;            // communicators built (each a rebuild after the first)
  size_t replicas = 0;            // replicas connected and greeted now
  size_t last_replicas = 0;       // members of the last successful Publish
  absl::Duration last_rebuild;    // of the last successful Publish (0 without a rebuild)
  absl::Duration last_offer;      // OFFER until every READY
  absl::Duration last_pack;       // enqueuing the copies into buckets
  absl::Duration last_broadcast;  // first pack until every replica had every bucket
  uint64_t last_wire_bytes = 0;   // bytes broadcast, padding included
  size_t last_buckets = 0;
};
// The counters of `publisher` when it is an nccl:// publisher made by OpenNcclPublisher (not
// wrapped by a layer); nullopt otherwise. Thread-safe.
std::optional<NcclPublisherCounters> PublisherCounters(const TransportPublisher& publisher);
// The counters of this process's open nccl:// publisher of the channel `display` (the URI
// without its query, e.g. "nccl://127.0.0.1:29600/policy"), if there is one: for tests and
// benchmarks of publishers opened through the public API, whose transport they cannot reach.
// Thread-safe.
std::optional<NcclPublisherCounters> ChannelCounters(std::string_view display);

}  // namespace weightbus::internal::nccl

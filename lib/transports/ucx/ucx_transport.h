// SPDX-License-Identifier: Apache-2.0
// The ucx:// transport: the publisher stages each version in registered memory and serves a
// rendezvous endpoint on HOST:PORT (control.h); subscribers connect, receive the manifest of the
// newest version with the memory keys of its staging slot, and pull the bytes with one-sided
// ucp_get_nbx straight into their destination buffers. Protocol: docs/FORMAT.md, "ucx://".
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/config.h"
#include "core/secret.h"
#include "core/transport.h"
#include "core/uri.h"

namespace weightbus::internal::ucx {

const SettingTable& UcxSettings();

// Where a channel is served: ucx://HOST:PORT/CHANNEL.
struct Endpoint {
  std::string host;     // a name, an IPv4 address or an IPv6 address without brackets
  int port = 0;         // 1..65535
  std::string channel;  // the URI path without its leading '/', non-empty
  std::string display;  // the URI without its query, for messages
};

// Parses and checks a ucx:// URI. `for_subscriber` also refuses wildcard hosts (0.0.0.0, ::),
// which a publisher may listen on but nobody can connect to.
// Errors: InvalidArgument naming the URI and what is wrong.
absl::StatusOr<Endpoint> ParseEndpoint(const Uri& uri, bool for_subscriber);

// Whether `host` names this machine's loopback interface (127.0.0.0/8, ::1, "localhost"): a
// publisher listening there can only be reached from its own host.
bool IsLoopback(const std::string& host);

// The transport's settings, checked once (InvalidArgument naming the URI and the setting).
struct UcxOptions {
  int64_t staging_slots = 2;
  absl::Duration lease;
  absl::Duration lease_max_hold;  // >= lease
  int64_t max_connections = 0;
  absl::Duration connect_timeout;
  uint64_t get_chunk_size = 0;
  int64_t gets_in_flight = 0;
  uint64_t max_region = 0;
  int64_t copy_threads = 0;
  bool cuda_staging = false;
  // Announce each version before staging it and let subscribers pull each chunk of
  // `ready_chunk` bytes as soon as it is staged (README.md, "Pipelining").
  bool pipeline = true;
  uint64_t ready_chunk = 0;
  // publish_mode=zero_copy: serve the caller's tensors in place, Publish returning once the
  // subscribers pulled them (README.md, "Zero-copy publish").
  bool zero_copy = false;
  // Fan-out through relays (README.md, "Fan-out").
  int64_t relay_fanout = 0;  // publisher
  bool relay = true;         // subscriber: offer to relay
  absl::Duration relay_stall;
  // The channel's key (core settings secret_file / secret_env): peers prove it to each other
  // before the publisher sends any manifest or memory key (docs/SECURITY.md).
  std::optional<ChannelKey> key;
};
absl::StatusOr<UcxOptions> ReadOptions(const Endpoint& endpoint, const Config& config);

absl::StatusOr<std::unique_ptr<TransportPublisher>> OpenUcxPublisher(const Uri& uri,
                                                                     const Config& config);
absl::StatusOr<std::unique_ptr<TransportSubscriber>> OpenUcxSubscriber(const Uri& uri,
                                                                       const Config& config);

// What a ucx:// publisher's progress thread has done so far (monotonic counts since it opened),
// for tests and diagnostics. Safe to read from any thread while it serves.
struct UcxPublisherCounters {
  // DATA frames sent with bytes, answering subscribers' READs (bytes over the control
  // connection; README.md). 0 where every subscriber pulls with UCP gets.
  uint64_t reads_served = 0;
  // Times the progress thread went to sleep in poll() (a timeout above 0 ms) while a connection
  // had READs queued that it could have answered (nothing left to send on that connection): a
  // lost wake-up, each costing up to the 1 s poll timeout. Always 0.
  uint64_t sleeps_with_reads_ready = 0;
  uint64_t grants = 0;  // GRANT messages sent
  // READs that waited for their chunk to be staged (a version announced before it was staged).
  uint64_t reads_held = 0;
  uint64_t control_bytes_sent = 0;  // bytes written to control connections (frames, DATA too)
  // Zero-copy publishes: runs of the caller's tensors served from memory of AllocateHost (its
  // own registration), and runs served by registering the caller's memory (cached).
  uint64_t lent_runs_allocated = 0;
  uint64_t lent_runs_registered = 0;
};

// The counters of `publisher` when it is a ucx:// publisher made by OpenUcxPublisher (not
// wrapped by a layer); nullopt otherwise. `publisher` must be alive for the call only.
std::optional<UcxPublisherCounters> PublisherCounters(const TransportPublisher& publisher);

// What a ucx:// subscriber has done so far (monotonic counts since it opened), for tests and
// diagnostics: both grow with a version's bytes, not with its tensor count (receive buffers are
// registered per contiguous run, and neighbouring tensors contiguous on both sides share gets).
struct UcxSubscriberCounters {
  uint64_t registrations = 0;  // receive-buffer registrations made (ucp_mem_map)
  uint64_t gets = 0;           // ucp_get_nbx calls, or READs over the control connection
  // Control-connection bytes this subscriber sent and received (frames; DATA included).
  uint64_t control_bytes_sent = 0;
  uint64_t control_bytes_received = 0;
  // Version-descriptor bytes read (layouts, readiness words, seals), by gets or READs.
  uint64_t descriptor_bytes = 0;
  // Bytes read from relays (other subscribers) instead of the publisher (relay_fanout).
  uint64_t bytes_from_relays = 0;
  // Bytes pulled, by the rank of the publisher group that served them ([0] only for a single
  // publisher): a subscriber with placements pulls its slices, rounded out to checksum blocks.
  std::vector<uint64_t> bytes_by_rank;
};

// The counters of `subscriber` when it is a ucx:// subscriber made by OpenUcxSubscriber (not
// wrapped by a layer); nullopt otherwise. Waits for a call in flight on it to return.
std::optional<UcxSubscriberCounters> SubscriberCounters(TransportSubscriber& subscriber);

// The bytes every ucx:// subscriber of this process has pulled so far, by the rank of the
// publisher group that served them (a single publisher's count as rank 0; ranks >= 255 share
// the last entry), trailing zeros left out: for tests of subscribers opened through the public
// API, whose transport they cannot reach. Safe from any thread.
std::vector<uint64_t> ProcessBytesByRank();

}  // namespace weightbus::internal::ucx

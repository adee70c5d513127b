// SPDX-License-Identifier: Apache-2.0
// Opening a URI's transport stack (layers and transport) the way Publisher::Open and
// Subscriber::Open do, for internal tests that drive the plugin interface (lib/core/transport.h)
// directly; publishing and receiving through it as the core does.
#pragma once

#include <atomic>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/channel_setup.h"
#include "core/registry.h"
#include "core/status.h"
#include "core/uri.h"
#include "test_model.h"
#include "test_support.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::testing {

// What the stack `uri_text` names can do with its settings (TransportDescriptor::capabilities).
inline absl::StatusOr<internal::TransportCapabilities> StackCapabilitiesOf(
    std::string_view uri_text, const Options& options = {}) {
  WB_ASSIGN_OR_RETURN(internal::ChannelSetup s, internal::SetUpChannel(uri_text, options));
  return s.capabilities;
}

// The manifest the core would seal for `tensors` as `version` (checksums from libxxhash).
inline Manifest ManifestOf(uint64_t version, const std::vector<OwnedTensor>& tensors) {
  Manifest m;
  m.version = version;
  for (const OwnedTensor& t : tensors) {
    m.tensors.push_back(TensorInfo{t.name, t.dtype, t.shape, std::nullopt, t.bytes.size(),
                                   Xxh3(t.bytes.data(), t.bytes.size())});
  }
  return m;
}

// Publishes `tensors` under `manifest` (which may lie about them) through the plugin interface.
inline absl::Status PublishSealed(internal::TransportPublisher& pub, Manifest manifest,
                                  const std::vector<OwnedTensor>& tensors,
                                  absl::Duration timeout = absl::Seconds(30)) {
  std::vector<const std::byte*> data;
  for (const OwnedTensor& t : tensors) data.push_back(t.bytes.data());
  internal::SealedPublishJob job(std::move(manifest), std::move(data));
  return pub.Publish(job, absl::Now() + timeout);
}

// What the core does with an IncomingVersion, short of bindings: fetches every tensor into new
// buffers, checks each landed once and matches its manifest checksum (DataLoss naming it
// otherwise), then accepts the version.
struct Fetched {
  Manifest manifest;
  std::string source;  // DescribeSource(0), or "" for a version without tensors
  std::vector<std::vector<std::byte>> tensors;
};
inline absl::StatusOr<Fetched> FetchAndVerify(internal::IncomingVersion& incoming,
                                              absl::Duration timeout = absl::Seconds(30)) {
  Fetched f;
  f.manifest = incoming.manifest();
  if (!f.manifest.tensors.empty()) f.source = incoming.DescribeSource(0);
  std::vector<std::byte*> targets;
  for (const TensorInfo& t : f.manifest.tensors) f.tensors.emplace_back(t.nbytes);
  for (auto& t : f.tensors) targets.push_back(t.data());
  struct Sink final : public internal::LandingSink {
    void Landed(size_t) override { ++landed; }
    std::atomic<size_t> landed{0};
  } sink;
  WB_RETURN_IF_ERROR(incoming.Fetch(targets, sink, absl::Now() + timeout));
  if (sink.landed != f.manifest.tensors.size()) {
    return absl::InternalError(
        absl::StrFormat("%d of %d tensors landed", sink.landed.load(), f.manifest.tensors.size()));
  }
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    if (Xxh3(f.tensors[i].data(), f.tensors[i].size()) != f.manifest.tensors[i].xxh3) {
      return absl::DataLossError(
          absl::StrFormat("tensor %s fails verification", f.manifest.tensors[i].name));
    }
  }
  incoming.Accepted();
  return f;
}

// The stack `uri_text` names, resolved as Publisher::Open and Subscriber::Open resolve it
// (SetUpChannel); `options` override the URI's settings, as Options do for Open.
inline absl::StatusOr<std::unique_ptr<internal::TransportPublisher>> OpenTransportPublisher(
    std::string_view uri_text, const Options& options = {}) {
  WB_ASSIGN_OR_RETURN(internal::ChannelSetup s, internal::SetUpChannel(uri_text, options));
  return internal::OpenPublisherStack(s.stack, s.uri, *s.config);
}

inline absl::StatusOr<std::unique_ptr<internal::TransportSubscriber>> OpenTransportSubscriber(
    std::string_view uri_text, const Options& options = {}) {
  WB_ASSIGN_OR_RETURN(internal::ChannelSetup s, internal::SetUpChannel(uri_text, options));
  return internal::OpenSubscriberStack(s.stack, s.uri, *s.config);
}

}  // namespace weightbus::testing

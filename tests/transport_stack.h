// SPDX-License-Identifier: Apache-2.0
// Opening a URI's transport stack (layers and transport) the way Publisher::Open and
// Subscriber::Open do, for internal tests that drive the plugin interface (lib/core/transport.h)
// directly; publishing and receiving through it as the core does.
#pragma once

#include <atomic>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/channel_setup.h"
#include "core/registry.h"
#include "core/status.h"
#include "core/uri.h"
#include "test_model.h"
#include "test_support.h"
#include "ucx_tls.h"
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

// One transport stack the conformance suite (tests/conformance_test.cc) and the fault-injection
// suite (tests/fault/) run over. `uri` is a template: {dir} becomes a fresh directory,
// {port} a free loopback port, {name} a fresh channel name; `env` is set for the test (UCX_TLS).
// `kept`: the setting that bounds how many versions the channel holds (KeepOnly below).
struct Stack {
  std::string name;
  std::string uri;
  Tls env = {};
  std::string kept;
  // Whether processes other than the publisher's reach the channel (mem:// lives in one process).
  bool cross_process = true;
};
inline void PrintTo(const Stack& s, std::ostream* os) { *os << s.name; }

// mem:// with every optional capability switched off: the core's and the layers' paths for a
// transport that has none of them.
inline constexpr char kBareMem[] =
    "mem:///{name}?cancel=false&committed_manifest=false&reads_strided_views=false&"
    "copies_with_checksums=false&keep_versions_from=false&wait_for_receivers=false&"
    "open_version=false&list_versions=false&durable=false";

// Every stack; one line per stack (a new transport adds its own and delta over it, e.g.
// {"nccl", "nccl://127.0.0.1:{port}/channel"}). Those whose transport this build lacks are
// skipped.
inline const std::vector<Stack>& Stacks() {
  static const auto* stacks = new std::vector<Stack>{
      {"disk", "disk://{dir}/channel", {}, "retention"},
      {"ucx_shm", "ucx://127.0.0.1:{port}/channel", testing::kShm, "staging_slots"},
      {"ucx_tcp", "ucx://127.0.0.1:{port}/channel", testing::kTcp, "staging_slots"},
      {"delta_disk", "delta+disk://{dir}/channel", {}, "retention"},
      {"delta_ucx", "delta+ucx://127.0.0.1:{port}/channel", testing::kShm, "staging_slots"},
      {"mem", "mem:///{name}", {}, "retention", false},
      {"mem_bare", kBareMem, {}, "retention", false},
      {"delta_mem_bare", std::string("delta+") + kBareMem, {}, "retention", false},
  };
  return *stacks;
}

// Why this build cannot run `stack` (its transport or a layer over it left out), or "".
inline std::string MissingStackTransports(const Stack& stack) {
  const std::string scheme = stack.uri.substr(0, stack.uri.find("://"));
  return MissingTransports(absl::StrSplit(scheme, '+'));
}

// `stack`'s URI with {dir}, {port} and {name} filled in and `query` appended to its own.
inline std::string StackUri(const Stack& stack, const std::string& dir, int port,
                            const std::string& name, const std::string& query = "") {
  std::string uri = absl::StrReplaceAll(
      stack.uri, {{"{dir}", dir}, {"{port}", std::to_string(port)}, {"{name}", name}});
  if (!query.empty()) uri += (absl::StrContains(uri, "?") ? "&" : "?") + query;
  return uri;
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

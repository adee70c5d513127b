// SPDX-License-Identifier: Apache-2.0
// Transports register themselves by URI scheme (as UCX components do with
// UCT_COMPONENT_REGISTER); the core looks them up by the scheme of the URI it is given.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/config.h"
#include "core/transport.h"
#include "core/uri.h"

namespace weightbus::internal {

// Settings every channel has, whatever its transport (scope "core").
const SettingTable& CoreSettings();

// A transport (open_* set) or a layer (wrap_* set). A URI scheme names a stack: a transport
// alone ("disk"), or layers over one ("delta+disk": delta wraps disk). Setting names must be
// unique across the tables of a stack, since URI queries and Options name them without scope.
struct TransportDescriptor {
  std::string scheme;                      // e.g. "disk", or "delta" for a layer
  std::string summary;                     // one line for `weightbus --version` and docs
  const SettingTable* settings = nullptr;  // its own settings (scope == scheme)
  std::function<absl::StatusOr<std::unique_ptr<TransportPublisher>>(const Uri&, const Config&)>
      open_publisher;
  std::function<absl::StatusOr<std::unique_ptr<TransportSubscriber>>(const Uri&, const Config&)>
      open_subscriber;
  std::function<absl::StatusOr<std::unique_ptr<TransportPublisher>>(
      const Uri&, const Config&, std::unique_ptr<TransportPublisher> inner)>
      wrap_publisher;
  std::function<absl::StatusOr<std::unique_ptr<TransportSubscriber>>(
      const Uri&, const Config&, std::unique_ptr<TransportSubscriber> inner)>
      wrap_subscriber;
  // What the publishers and subscribers it opens can do with the channel's settings `config`
  // (transport.h). A transport ignores `beneath`; a layer derives its own from the capabilities
  // of the stack beneath it, and must decide publisher_groups and partial_reads itself (what
  // lies beneath is its encoding: neither carries over by itself). Must agree with what the
  // objects do: the conformance suite checks.
  std::function<TransportCapabilities(const Config& config, const TransportCapabilities& beneath)>
      capabilities;

  bool is_layer() const { return wrap_publisher != nullptr; }
};

// Adds `descriptor` to the process-wide registry. Registering a scheme twice aborts.
void RegisterTransport(TransportDescriptor descriptor);

// The transport for `scheme`, or nullptr.
const TransportDescriptor* FindTransport(std::string_view scheme);

// All registered transports, sorted by scheme.
std::vector<const TransportDescriptor*> RegisteredTransports();

// The descriptors a URI's scheme names, outermost first: layers, then one transport.
// Errors: Unimplemented listing what this build has; InvalidArgument for a layer used alone or a
// transport used as a layer.
absl::StatusOr<std::vector<const TransportDescriptor*>> ResolveStack(const Uri& uri);

// Resolves the settings of `uri` for `stack` (core table + every descriptor's table). Unknown
// WEIGHTBUS_* environment variables do not fail it (WarnUnknownEnvironment); unknown names in
// the URI query or `options` do (InvalidArgument, Config::Resolve).
absl::StatusOr<Config> ResolveConfig(const std::vector<const TransportDescriptor*>& stack,
                                     const Uri& uri,
                                     const std::map<std::string, std::string>& options);

// The unknown-variable policy (docs/CONVENTIONS.md, "Settings"). The environment is shared with
// other builds of weightbus (a newer one with more settings, one without some transport) and
// with other programs, so a WEIGHTBUS_* variable of `environment` (NULL-terminated, as environ)
// that names no setting of the core or of a compiled transport is not an error: it is logged as
// a warning, once per process for each name, that names the closest known variable by edit
// distance, e.g. "environment variable WEIGHTBUS_DISK_RETENTON names no setting of this
// weightbus build (transports: delta, disk, ucx) and is ignored; the closest setting is
// WEIGHTBUS_DISK_RETENTION". Returns the names this call warned about. Thread-safe.
std::vector<std::string> WarnUnknownEnvironment(char** environment);

// What `stack` (outermost first, as ResolveStack returns it) can do with `config`: the transport's
// declaration, passed up through each layer's.
TransportCapabilities StackCapabilities(const std::vector<const TransportDescriptor*>& stack,
                                        const Config& config);

// Opens the stack: the transport at the bottom gets `uri` with its own scheme, then each layer
// wraps what is beneath it.
absl::StatusOr<std::unique_ptr<TransportPublisher>> OpenPublisherStack(
    const std::vector<const TransportDescriptor*>& stack, const Uri& uri, const Config& config);
absl::StatusOr<std::unique_ptr<TransportSubscriber>> OpenSubscriberStack(
    const std::vector<const TransportDescriptor*>& stack, const Uri& uri, const Config& config);

}  // namespace weightbus::internal

// Registers a transport at load time: WEIGHTBUS_REGISTER_TRANSPORT(disk, MakeDiskDescriptor())
#define WEIGHTBUS_REGISTER_TRANSPORT(tag, descriptor_expr)                \
  namespace {                                                             \
  [[maybe_unused]] const bool weightbus_transport_registered_##tag = [] { \
    ::weightbus::internal::RegisterTransport(descriptor_expr);            \
    return true;                                                          \
  }();                                                                    \
  }

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

struct TransportDescriptor {
  std::string scheme;                 // e.g. "disk"
  std::string summary;                // one line for `weightbus --version` and docs
  const SettingTable* settings = nullptr;  // the transport's own settings (scope == scheme)
  std::function<absl::StatusOr<std::unique_ptr<TransportPublisher>>(const Uri&, const Config&)>
      open_publisher;
  std::function<absl::StatusOr<std::unique_ptr<TransportSubscriber>>(const Uri&, const Config&)>
      open_subscriber;
};

// Adds `descriptor` to the process-wide registry. Registering a scheme twice aborts.
void RegisterTransport(TransportDescriptor descriptor);

// The transport for `scheme`, or nullptr.
const TransportDescriptor* FindTransport(std::string_view scheme);

// All registered transports, sorted by scheme.
std::vector<const TransportDescriptor*> RegisteredTransports();

// Resolves the settings of `uri` for `transport` (core table + the transport's table).
absl::StatusOr<Config> ResolveConfig(const TransportDescriptor& transport, const Uri& uri,
                                     const std::map<std::string, std::string>& options);

// Looks up the transport for `uri`'s scheme. Errors: Unimplemented listing compiled schemes.
absl::StatusOr<const TransportDescriptor*> TransportFor(const Uri& uri);

}  // namespace weightbus::internal

// Registers a transport at load time: WEIGHTBUS_REGISTER_TRANSPORT(disk, MakeDiskDescriptor())
#define WEIGHTBUS_REGISTER_TRANSPORT(tag, descriptor_expr)                       \
  namespace {                                                                    \
  [[maybe_unused]] const bool weightbus_transport_registered_##tag = [] {        \
    ::weightbus::internal::RegisterTransport(descriptor_expr);                   \
    return true;                                                                 \
  }();                                                                           \
  }

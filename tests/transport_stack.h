// SPDX-License-Identifier: Apache-2.0
// Opening a URI's transport stack (layers and transport) the way Publisher::Open and
// Subscriber::Open do, for internal tests that drive the plugin interface (lib/core/transport.h)
// directly.
#pragma once

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "core/registry.h"
#include "core/status.h"
#include "core/uri.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::testing {

// `options` override the URI's settings, as Options do for Open.
inline absl::StatusOr<std::unique_ptr<internal::TransportPublisher>> OpenTransportPublisher(
    std::string_view uri_text, const Options& options = {}) {
  WB_ASSIGN_OR_RETURN(internal::Uri uri, internal::ParseUri(uri_text));
  WB_ASSIGN_OR_RETURN(auto stack, internal::ResolveStack(uri));
  WB_ASSIGN_OR_RETURN(internal::Config config, internal::ResolveConfig(stack, uri, options));
  return internal::OpenPublisherStack(stack, uri, config);
}

inline absl::StatusOr<std::unique_ptr<internal::TransportSubscriber>> OpenTransportSubscriber(
    std::string_view uri_text, const Options& options = {}) {
  WB_ASSIGN_OR_RETURN(internal::Uri uri, internal::ParseUri(uri_text));
  WB_ASSIGN_OR_RETURN(auto stack, internal::ResolveStack(uri));
  WB_ASSIGN_OR_RETURN(internal::Config config, internal::ResolveConfig(stack, uri, options));
  return internal::OpenSubscriberStack(stack, uri, config);
}

}  // namespace weightbus::testing

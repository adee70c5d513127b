// SPDX-License-Identifier: Apache-2.0
// What Publisher::Open and Subscriber::Open both resolve before opening a transport: the URI, the
// stack of layers and transport its scheme names, every setting, what the stack can do, fail
// points and the checksum workers.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/config.h"
#include "core/failpoint.h"
#include "core/registry.h"
#include "core/secret.h"
#include "core/uri.h"
#include "core/worker_pool.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::internal {

struct ChannelSetup {
  std::string uri_text;
  Uri uri;
  std::vector<const TransportDescriptor*> stack;
  std::unique_ptr<Config> config;
  TransportCapabilities capabilities;  // of the whole stack (StackCapabilities)
  FailPoints failpoints;
  std::unique_ptr<WorkerPool> hashers;  // XXH3 checksums, overlapped with transfers
  // The channel's key (settings secret_file / secret_env), when it has a shared secret.
  std::optional<ChannelKey> key;
};

// Errors: InvalidArgument for a malformed URI or setting (naming it); Unimplemented for a scheme
// this build lacks; ResourceExhausted when threads cannot be started; LoadChannelKey's errors
// for a shared secret that cannot be read, and RefuseInlineSecret's for one given inline.
absl::StatusOr<ChannelSetup> SetUpChannel(std::string_view uri_text, const Options& options);

}  // namespace weightbus::internal

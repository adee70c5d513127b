// SPDX-License-Identifier: Apache-2.0
#include "core/channel_setup.h"

#include "absl/strings/str_format.h"
#include "core/status.h"

namespace weightbus::internal {

absl::StatusOr<ChannelSetup> SetUpChannel(std::string_view uri_text, const Options& options) {
  ChannelSetup s;
  s.uri_text = std::string(uri_text);
  WB_ASSIGN_OR_RETURN(s.uri, ParseUri(uri_text));
  WB_ASSIGN_OR_RETURN(s.stack, ResolveStack(s.uri));
  WB_ASSIGN_OR_RETURN(Config config, ResolveConfig(s.stack, s.uri, options));
  s.config = std::make_unique<Config>(std::move(config));
  WB_ASSIGN_OR_RETURN(s.failpoints, FailPoints::Parse(s.config->String("failpoints")));
  const int64_t hash_threads = s.config->Int("hash_threads");
  if (hash_threads < 0 || hash_threads > WorkerPool::kMaxThreads) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: setting hash_threads=%d is outside 0..%d", s.uri.Display(),
                        hash_threads, WorkerPool::kMaxThreads));
  }
  WB_ASSIGN_OR_RETURN(
      s.hashers, WorkerPool::Create(WorkerPool::DefaultThreads(static_cast<int>(hash_threads))));
  return s;
}

}  // namespace weightbus::internal

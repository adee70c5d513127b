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
  // Fail points kill, stall or fail the process: they are a test hook that only the process's
  // own environment may switch on, never a URI (which may come from a config file or a peer) or
  // an Options map (docs/TESTING.md).
  for (const auto& [where, map] :
       {std::pair<const char*, const std::map<std::string, std::string>*>{"the URI query",
                                                                          &s.uri.query},
        {"options", &options}}) {
    if (map->count("failpoints") != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: setting \"failpoints\" in %s is refused: fail points are a test hook taken only "
          "from the environment variable WEIGHTBUS_FAILPOINTS",
          s.uri.Display(), where));
    }
    WB_RETURN_IF_ERROR(RefuseInlineSecret(*map, where, s.uri.Display()));
  }
  WB_ASSIGN_OR_RETURN(Config config, ResolveConfig(s.stack, s.uri, options));
  s.config = std::make_unique<Config>(std::move(config));
  s.capabilities = StackCapabilities(s.stack, *s.config);
  WB_ASSIGN_OR_RETURN(s.key, LoadChannelKey(*s.config, s.uri.Display()));
  WB_ASSIGN_OR_RETURN(s.failpoints, FailPoints::Parse(s.config->String("failpoints")));
  const int64_t hash_threads = s.config->Int("hash_threads");  // 0..kMaxThreads (CoreSettings)
  WB_ASSIGN_OR_RETURN(
      s.hashers, WorkerPool::Create(WorkerPool::DefaultThreads(static_cast<int>(hash_threads))));
  return s;
}

}  // namespace weightbus::internal

// SPDX-License-Identifier: Apache-2.0
#include "core/registry.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "core/status.h"

namespace weightbus::internal {
namespace {

struct Registry {
  absl::Mutex mu;
  std::vector<std::unique_ptr<TransportDescriptor>> transports ABSL_GUARDED_BY(mu);
};

Registry& GlobalRegistry() {
  static Registry* registry = new Registry();  // never destroyed: used by static initializers
  return *registry;
}

}  // namespace

const SettingTable& CoreSettings() {
  static const SettingTable* table = new SettingTable{
      "core",
      {
          {"bind_mode", SettingType::kEnum, "staged",
           "staged: receive and verify in library memory, then copy into bound destinations "
           "(a failed update never touches them); direct: receive straight into bound "
           "destinations (one copy fewer; contents unspecified after a failed verification)",
           {"staged", "direct"}},
          {"hash_threads", SettingType::kInt, "0",
           "threads computing XXH3-64 checksums concurrently with the transfer (0: one per core, "
           "at most 8)"},
          {"rank", SettingType::kInt, "0", "trainer rank recorded as the publisher's identity"},
          {"world_size", SettingType::kInt, "1", "number of trainer ranks, recorded likewise"},
          {"publisher_name", SettingType::kString, "",
           "free-form label recorded in each manifest's publisher identity"},
          {"log_level", SettingType::kEnum, "warn",
           "what goes to stderr: error|warn|info|debug; process-wide, read once from "
           "WEIGHTBUS_LOG_LEVEL (a URI or Options value only validates)",
           {"error", "warn", "info", "debug"}},
          {"failpoints", SettingType::kString, "",
           "test hook: comma-separated name=action[@n], action kill|error|delay:<ms>, fired at "
           "the n-th (default first) pass through the named point (docs/TESTING.md)"},
      }};
  return *table;
}

void RegisterTransport(TransportDescriptor descriptor) {
  Registry& r = GlobalRegistry();
  absl::MutexLock lock(&r.mu);
  for (const auto& t : r.transports) {
    if (t->scheme == descriptor.scheme) {
      std::fprintf(stderr, "weightbus: transport \"%s\" registered twice\n",
                   descriptor.scheme.c_str());
      std::abort();
    }
  }
  r.transports.push_back(std::make_unique<TransportDescriptor>(std::move(descriptor)));
}

const TransportDescriptor* FindTransport(std::string_view scheme) {
  Registry& r = GlobalRegistry();
  absl::MutexLock lock(&r.mu);
  for (const auto& t : r.transports) {
    if (t->scheme == scheme) return t.get();
  }
  return nullptr;
}

std::vector<const TransportDescriptor*> RegisteredTransports() {
  Registry& r = GlobalRegistry();
  absl::MutexLock lock(&r.mu);
  std::vector<const TransportDescriptor*> out;
  for (const auto& t : r.transports) out.push_back(t.get());
  std::sort(out.begin(), out.end(),
            [](const auto* a, const auto* b) { return a->scheme < b->scheme; });
  return out;
}

absl::StatusOr<const TransportDescriptor*> TransportFor(const Uri& uri) {
  if (const TransportDescriptor* t = FindTransport(uri.scheme)) return t;
  std::vector<std::string> schemes;
  for (const TransportDescriptor* t : RegisteredTransports()) schemes.push_back(t->scheme);
  return absl::UnimplementedError(absl::StrFormat(
      "no transport for scheme \"%s\" in URI \"%s\" (this build has: %s)", uri.scheme, uri.text,
      schemes.empty() ? "none" : absl::StrJoin(schemes, ", ")));
}

// A WEIGHTBUS_* environment variable that no setting of any compiled transport uses is almost
// always a typo; it is an error rather than silently ignored.
static absl::Status CheckEnvironment() {
  std::vector<const SettingTable*> tables = {&CoreSettings()};
  for (const TransportDescriptor* t : RegisteredTransports()) {
    if (t->settings != nullptr) tables.push_back(t->settings);
  }
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view kv(*e);
    if (kv.substr(0, 10) != "WEIGHTBUS_") continue;
    std::string_view name = kv.substr(0, kv.find('='));
    bool known = false;
    std::vector<std::string> all;
    for (const SettingTable* table : tables) {
      for (const SettingSpec& spec : table->specs) {
        all.push_back(EnvName(table->scope, spec.name));
        known |= all.back() == name;
      }
    }
    if (!known) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "environment variable %s is not a weightbus setting (known: %s)", name,
          absl::StrJoin(all, ", ")));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Config> ResolveConfig(const TransportDescriptor& transport, const Uri& uri,
                                     const std::map<std::string, std::string>& options) {
  WB_RETURN_IF_ERROR(CheckEnvironment());
  std::vector<const SettingTable*> tables = {&CoreSettings()};
  if (transport.settings != nullptr) tables.push_back(transport.settings);
  absl::StatusOr<Config> config = Config::Resolve(tables, uri.query, options);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrFormat("%s: %s", uri.Display(), config.status().message()));
  }
  return config;
}

}  // namespace weightbus::internal

// SPDX-License-Identifier: Apache-2.0
#include "core/registry.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "core/logging.h"
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
          {.name = "bind_mode",
           .type = SettingType::kEnum,
           .default_value = "staged",
           .doc = "staged: receive and verify in library memory, then copy into bound "
                  "destinations (a failed update never touches them); direct: receive straight "
                  "into bound destinations (one copy fewer; contents unspecified after a failed "
                  "verification)",
           .choices = {"staged", "direct"}},
          {.name = "hash_threads",
           .type = SettingType::kInt,
           .default_value = "0",
           .doc = "threads computing XXH3-64 checksums concurrently with the transfer (0: one "
                  "per core, at most 8)",
           .min = "0",
           .max = "256",  // WorkerPool::kMaxThreads
           .unit = "threads"},
          {.name = "checksum_block",
           .type = SettingType::kBytes,
           .default_value = "1MiB",
           .doc = "publishers: besides each tensor's XXH3-64, record one per tile of it of at "
                  "most this many bytes in the manifest (each matrix cut into up to 8 x 8 equal "
                  "fractions of its rows and row bytes, further while a tile is larger), so that "
                  "a subscriber reading only some byte ranges (a TP worker's slices, row-"
                  "parallel ones included) verifies exactly the tiles it read (0: none; each "
                  "tile costs 16 bytes of manifest)",
           .min = "0",
           .max = "1GiB"},
          {.name = "staging_window",
           .type = SettingType::kBytes,
           .default_value = "64MiB",
           .doc = "subscribers with placements, on transports with partial_reads: bytes of "
                  "staging for reading and verifying checksum tiles before they are copied "
                  "into the slices, in two halves (one read while the other is verified; each "
                  "at least one tile); the extra memory beyond the slices",
           .min = "64KiB",
           .max = "64GiB"},
          {.name = "rank",
           .type = SettingType::kInt,
           .default_value = "0",
           .doc = "trainer rank recorded as the publisher's identity (below world_size)",
           .min = "0"},
          {.name = "world_size",
           .type = SettingType::kInt,
           .default_value = "1",
           .doc = "number of trainer ranks, recorded likewise",
           .min = "1",
           .max = "65536",  // kMaxWorldSize
           .unit = "ranks"},
          {.name = "publisher_name",
           .type = SettingType::kString,
           .default_value = "",
           .doc = "free-form label recorded in each manifest's publisher identity"},
          {.name = "secret_file",
           .type = SettingType::kString,
           .default_value = "",
           .doc = "path of a file (mode 0600: group and others may not read it) holding the "
                  "channel's shared secret (16..4096 bytes): publishers MAC every manifest and "
                  "subscribers refuse versions without a valid MAC; ucx:// peers authenticate "
                  "each other (docs/SECURITY.md). Never the secret itself"},
          {.name = "secret_env",
           .type = SettingType::kString,
           .default_value = "",
           .doc = "name of an environment variable holding the channel's shared secret, as "
                  "secret_file (set one of them). Never the secret itself"},
          {.name = "stream_bucket",
           .type = SettingType::kBytes,
           .default_value = "64MiB",
           .doc = "host memory a streaming publish (Publisher::BeginPublish) stages added "
                  "tensors through, in two halves (one filled while the other is written to "
                  "the spool file); pinned for CUDA tensors",
           .min = "8KiB",
           .max = "64GiB"},
          {.name = "stream_spill_dir",
           .type = SettingType::kString,
           .default_value = "",
           .doc = "directory of a streaming publish's spool file (unlinked: nothing is left "
                  "behind), which holds the version's bytes until Commit; empty: $TMPDIR, else "
                  "/tmp"},
          {.name = "log_level",
           .type = SettingType::kEnum,
           .default_value = "warn",
           .doc = "what goes to stderr: error|warn|info|debug; process-wide, read once from "
                  "WEIGHTBUS_LOG_LEVEL (a URI or Options value only validates)",
           .choices = {"error", "warn", "info", "debug"}},
          {.name = "failpoints",
           .type = SettingType::kString,
           .default_value = "",
           .doc = "test hook, only from the environment (WEIGHTBUS_FAILPOINTS; a URI query or "
                  "Options entry is refused): comma-separated name=action[@n], action "
                  "kill|error|delay:<ms>, fired at the n-th (default first) pass through the "
                  "named point (docs/TESTING.md)"},
      }};
  return *table;
}

void RegisterTransport(TransportDescriptor descriptor) {
  if (!descriptor.capabilities) {
    std::fprintf(stderr, "weightbus: transport \"%s\" declares no capabilities\n",
                 descriptor.scheme.c_str());
    std::abort();
  }
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

absl::StatusOr<std::vector<const TransportDescriptor*>> ResolveStack(const Uri& uri) {
  auto compiled = [] {
    std::vector<std::string> schemes;
    for (const TransportDescriptor* t : RegisteredTransports()) {
      schemes.push_back(t->is_layer() ? t->scheme + "+<transport>" : t->scheme);
    }
    return schemes.empty() ? std::string("none") : absl::StrJoin(schemes, ", ");
  };
  std::vector<const TransportDescriptor*> stack;
  std::vector<std::string> parts = absl::StrSplit(uri.scheme, '+');
  for (size_t i = 0; i < parts.size(); ++i) {
    const TransportDescriptor* t = FindTransport(parts[i]);
    if (t == nullptr) {
      return absl::UnimplementedError(
          absl::StrFormat("no transport or layer \"%s\" for URI \"%s\" (this build has: %s)",
                          parts[i], uri.text, compiled()));
    }
    const bool last = i + 1 == parts.size();
    if (last && t->is_layer()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "URI \"%s\": \"%s\" is a layer and needs a transport beneath it, e.g. %s+disk://...",
          uri.text, parts[i], parts[i]));
    }
    if (!last && !t->is_layer()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "URI \"%s\": \"%s\" is a transport, not a layer; only the last scheme part may be "
          "a transport",
          uri.text, parts[i]));
    }
    if (std::find(stack.begin(), stack.end(), t) != stack.end()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "URI \"%s\": the \"%s\" layer appears twice; a layer can be stacked only once", uri.text,
          parts[i]));
    }
    stack.push_back(t);
  }
  return stack;
}

TransportCapabilities StackCapabilities(const std::vector<const TransportDescriptor*>& stack,
                                        const Config& config) {
  TransportCapabilities caps;
  for (size_t i = stack.size(); i-- > 0;) {
    // A layer sees the whole capabilities of the stack beneath and declares its own: it carries
    // a publisher group only if it splits its encoding by rank (delta does), and reads byte
    // ranges only if it says so (what lies beneath is its encoding, not the tensors' bytes).
    caps = stack[i]->capabilities(config, caps);
  }
  return caps;
}

std::string DescribeCapabilities(const TransportCapabilities& c) {
  std::vector<std::string> out;
  for (const auto& [flag, name] : std::initializer_list<std::pair<bool, const char*>>{
           {c.reads_strided_views, "reads_strided_views"},
           {c.copies_with_checksums, "copies_with_checksums"},
           {c.committed_manifest, "committed_manifest"},
           {c.keep_versions_from, "keep_versions_from"},
           {c.wait_for_receivers, "wait_for_receivers"},
           {c.all_subscribers_take_part, "all_subscribers_take_part"},
           {c.publisher_groups, "publisher_groups"},
           {c.authenticated_groups, "authenticated_groups"},
           {c.open_version, "open_version"},
           {c.list_versions, "list_versions"},
           {c.partial_reads, "partial_reads"},
           {c.cancel, "cancel"},
           {c.keyframe_requests, "keyframe_requests"},
           {c.subscriber_reports, "subscriber_reports"},
           {c.cross_process, "cross_process"},
           {c.durable, "durable"},
           {c.late_joiners, "late_joiners"},
           {(c.publish_memory & TransportCapabilities::kCudaMemory) != 0, "cuda_publish"},
           {(c.fetch_memory & TransportCapabilities::kCudaMemory) != 0, "cuda_fetch"},
           {c.delivery == TransportCapabilities::Delivery::kPush, "push"},
       }) {
    if (flag) out.push_back(name);
  }
  return out.empty() ? std::string("none") : absl::StrJoin(out, ", ");
}

absl::StatusOr<std::unique_ptr<TransportPublisher>> OpenPublisherStack(
    const std::vector<const TransportDescriptor*>& stack, const Uri& uri, const Config& config) {
  Uri inner_uri = uri;
  inner_uri.scheme = stack.back()->scheme;
  absl::StatusOr<std::unique_ptr<TransportPublisher>> p =
      stack.back()->open_publisher(inner_uri, config);
  for (size_t i = stack.size() - 1; p.ok() && i-- > 0;) {
    p = stack[i]->wrap_publisher(uri, config, *std::move(p));
  }
  return p;
}

absl::StatusOr<std::unique_ptr<TransportSubscriber>> OpenSubscriberStack(
    const std::vector<const TransportDescriptor*>& stack, const Uri& uri, const Config& config) {
  Uri inner_uri = uri;
  inner_uri.scheme = stack.back()->scheme;
  absl::StatusOr<std::unique_ptr<TransportSubscriber>> s =
      stack.back()->open_subscriber(inner_uri, config);
  for (size_t i = stack.size() - 1; s.ok() && i-- > 0;) {
    s = stack[i]->wrap_subscriber(uri, config, *std::move(s));
  }
  return s;
}

SealedPublishJob::SealedPublishJob(Manifest manifest, std::vector<const std::byte*> data)
    : manifest_(std::move(manifest)) {
  packed_.reserve(manifest_.tensors.size());
  for (size_t i = 0; i < manifest_.tensors.size(); ++i) {
    packed_.push_back(
        PackedTensor{&manifest_.tensors[i], i < data.size() ? data[i] : nullptr, Device{}});
  }
}

void PublishJob::CopyWithChecksum(size_t i, absl::Span<const CopyTarget> pieces) {
  const std::byte* src = tensors()[i].data;
  for (const CopyTarget& p : pieces) {
    if (p.size == 0) continue;
    std::memcpy(p.data, src, p.size);
    src += p.size;
  }
}

void PublishJob::StageWithChecksum(size_t i, absl::Span<const CopyTarget> pieces,
                                   absl::FunctionRef<void(size_t)> copied) {
  CopyWithChecksum(i, pieces);
  for (size_t k = 0; k < pieces.size(); ++k) copied(k);
}

void PublishJob::CopyRange(size_t i, uint64_t offset, uint64_t size, std::byte* dst) const {
  if (size > 0) std::memcpy(dst, tensors()[i].data + offset, size);
}

absl::Status IncomingVersion::FetchRanges(absl::Span<const RangeRead> reads, absl::Time) {
  return absl::UnimplementedError(absl::StrFormat(
      "this transport cannot read byte ranges of a version (%d ranges asked for)", reads.size()));
}

absl::StatusOr<std::unique_ptr<IncomingVersion>> TransportSubscriber::OpenVersion(uint64_t version,
                                                                                  absl::Time) {
  return absl::UnimplementedError(
      absl::StrFormat("this transport cannot open a specific version (%d)", version));
}

absl::StatusOr<int> TransportPublisher::WaitForReceivers(uint64_t version, int, absl::Time) {
  return absl::UnimplementedError(
      absl::StrFormat("this transport cannot tell which subscribers received version %d", version));
}

absl::StatusOr<Manifest> TransportPublisher::CommittedManifest(uint64_t version) {
  return absl::UnimplementedError(
      absl::StrFormat("this transport cannot read back the manifest of version %d", version));
}

absl::Status TransportSubscriber::RequestKeyframe(uint64_t version, std::optional<uint64_t>,
                                                  std::string_view) {
  return absl::UnimplementedError(absl::StrFormat(
      "this transport has no back channel for a keyframe request (version %d)", version));
}

absl::Status TransportSubscriber::Report(uint64_t version, std::string_view) {
  return absl::UnimplementedError(absl::StrFormat(
      "this transport has no back channel for a subscriber's report (version %d)", version));
}

absl::StatusOr<std::vector<uint64_t>> TransportSubscriber::ListVersions() {
  return absl::UnimplementedError("this transport cannot list its versions");
}

std::vector<std::string> WarnUnknownEnvironment(char** environment) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* warned = new absl::flat_hash_set<std::string>();
  std::vector<std::string> known;
  std::vector<std::string> schemes;
  for (const TransportDescriptor* t : RegisteredTransports()) schemes.push_back(t->scheme);
  std::vector<const SettingTable*> tables = {&CoreSettings()};
  for (const TransportDescriptor* t : RegisteredTransports()) {
    if (t->settings != nullptr) tables.push_back(t->settings);
  }
  for (const SettingTable* table : tables) {
    for (const SettingSpec& spec : table->specs) known.push_back(EnvName(table->scope, spec.name));
  }
  std::vector<std::string> out;
  for (char** e = environment; e != nullptr && *e != nullptr; ++e) {
    const std::string_view kv(*e);
    if (kv.substr(0, 10) != "WEIGHTBUS_") continue;
    const std::string name(kv.substr(0, kv.find('=')));
    if (std::find(known.begin(), known.end(), name) != known.end()) continue;
    {
      absl::MutexLock lock(&mu);
      if (!warned->insert(name).second) continue;
    }
    Log(LogLevel::kWarn,
        "environment variable %s names no setting of this weightbus build (transports: %s) and "
        "is ignored; the closest setting is %s (`weightbus settings` lists them)",
        name, absl::StrJoin(schemes, ", "), ClosestName(name, known));
    out.push_back(name);
  }
  return out;
}

absl::StatusOr<Config> ResolveConfig(const std::vector<const TransportDescriptor*>& stack,
                                     const Uri& uri,
                                     const std::map<std::string, std::string>& options) {
  WarnUnknownEnvironment(environ);
  std::vector<const SettingTable*> tables = {&CoreSettings()};
  for (const TransportDescriptor* t : stack) {
    if (t->settings != nullptr) tables.push_back(t->settings);
  }
  absl::StatusOr<Config> config = Config::Resolve(tables, uri.query, options);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrFormat("%s: %s", uri.Display(), config.status().message()));
  }
  return config;
}

}  // namespace weightbus::internal

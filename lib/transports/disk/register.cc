// SPDX-License-Identifier: Apache-2.0
#include "absl/strings/str_format.h"
#include "core/registry.h"
#include "io/file_io.h"
#include "transports/disk/disk_transport.h"

namespace weightbus::internal::disk {

const SettingTable& DiskSettings() {
  static const SettingTable* table = new SettingTable{
      "disk",
      {
          {.name = "retention",
           .type = SettingType::kInt,
           .default_value = "3",
           .doc = "committed versions kept on disk; older ones are deleted unless a reader holds "
                  "them",
           .min = "1",
           .unit = "versions"},
          {.name = "shard_size",
           .type = SettingType::kBytes,
           .default_value = "5GB",
           .doc = "largest safetensors file; bigger versions are split into "
                  "model-0000K-of-0000N.safetensors with an index (a tensor is never split)",
           .min = "1"},
          {.name = "io_engine",
           .type = SettingType::kEnum,
           .default_value = "uring",
           .doc = "uring: io_uring at depth (falls back to psync when unavailable); psync: "
                  "pread/pwrite",
           .choices = {"uring", "psync"}},
          {.name = "queue_depth",
           .type = SettingType::kInt,
           .default_value = "16",
           .doc = "I/O operations in flight",
           .min = "1",
           .max = "4096",
           .unit = "operations"},
          {.name = "chunk_size",
           .type = SettingType::kBytes,
           .default_value = "4MiB",
           .doc = "bytes per I/O operation",
           .min = "4KiB"},
          {.name = "poll_interval",
           .type = SettingType::kDuration,
           .default_value = "100ms",
           .doc = "how often subscribers re-read LATEST; inotify wakes them sooner on a local "
                  "filesystem, polling covers network filesystems"},
          {.name = "group_access",
           .type = SettingType::kBool,
           .default_value = "false",
           .doc = "false: a channel the publisher creates is its user's only (directories 0700, "
                  "files 0600); true: its group may read it too (0750, 0640), for subscribers "
                  "run by other users of that group"},
          {.name = "fsync",
           .type = SettingType::kBool,
           .default_value = "true",
           .doc = "fsync files and directories before committing (false: not durable across a "
                  "power loss; for tmpfs and benchmarks)"},
      }};
  return *table;
}

absl::StatusOr<std::unique_ptr<FileIo>> MakeFileIo(const Uri& uri, const Config& config) {
  // queue_depth and chunk_size are range-checked by Config::Resolve (DiskSettings).
  return FileIo::Create(config.String("io_engine"),
                        static_cast<unsigned>(config.Int("queue_depth")),
                        config.Bytes("chunk_size"));
}

absl::StatusOr<std::string> ChannelRoot(const Uri& uri) {
  if (!uri.authority.empty() && uri.authority != "localhost") {
    return absl::InvalidArgumentError(
        absl::StrFormat("URI \"%s\": disk:// takes no host (\"%s\"); write disk:///absolute/path",
                        uri.text, uri.authority));
  }
  if (uri.path.empty() || uri.path == "/") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "URI \"%s\": disk:// needs a channel directory, e.g. disk:///mnt/shared/policy", uri.text));
  }
  std::string root = uri.path;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  return root;
}

TransportCapabilities DiskCapabilities(const Config&, const TransportCapabilities&) {
  TransportCapabilities c;
  c.reads_strided_views = true;  // gathered through a bounce window as files are written
  c.committed_manifest = true;   // read back from the version's weightbus.manifest.json
  c.keep_versions_from = true;
  c.open_version = true;
  c.list_versions = true;
  c.partial_reads = true;  // any byte range of a tensor's file, with io_uring at depth
  c.cancel = true;         // a waiting subscriber wakes through its eventfd; publishing never waits
  c.cross_process = true;
  c.durable = true;
  c.late_joiners = true;
  c.publisher_groups = true;      // versions/.group-vN/rank-R parts, committed by the last rank
  c.authenticated_groups = true;  // each part's MAC checked at commit; the group's MAC added
  return c;
}

}  // namespace weightbus::internal::disk

WEIGHTBUS_REGISTER_TRANSPORT(
    disk,
    (::weightbus::internal::TransportDescriptor{
        "disk", "shared filesystem; each version a safetensors checkpoint written with io_uring",
        &::weightbus::internal::disk::DiskSettings(),
        ::weightbus::internal::disk::OpenDiskPublisher,
        ::weightbus::internal::disk::OpenDiskSubscriber, /*wrap_publisher=*/nullptr,
        /*wrap_subscriber=*/nullptr, ::weightbus::internal::disk::DiskCapabilities}))

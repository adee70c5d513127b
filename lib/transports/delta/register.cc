// SPDX-License-Identifier: Apache-2.0
#include "absl/strings/str_format.h"
#include "core/registry.h"
#include "core/worker_pool.h"
#include "transports/delta/delta_transport.h"

namespace weightbus::internal::delta {

const SettingTable& DeltaSettings() {
  static const SettingTable* table = new SettingTable{
      "delta",
      {
          {"keyframe_interval", SettingType::kInt, "50",
           "a keyframe (the whole version, compressed) every N versions and deltas in between; "
           "0: keyframes only when needed (first version, new tensor layout, delta_max_chain "
           "reached). A late joiner replays the newest keyframe and the deltas after it"},
          {"delta_max_chain", SettingType::kInt, "1000",
           "most deltas after a keyframe (1..): the next version is a keyframe whatever "
           "keyframe_interval says. Bounds what a late joiner replays and what the channel "
           "keeps: at most max(retention, delta_max_chain + 2) versions"},
          {"delta_chunk_size", SettingType::kBytes, "4MiB",
           "bytes per independently encoded chunk (a multiple of 64 from 64 to 1GiB): the unit "
           "of parallel encoding and decoding"},
          {"delta_zstd_level", SettingType::kInt, "0",
           "0: zstd tuned for entropy-bound byte planes (fastest strategy, minimum match 7, "
           "hash log 6); 1..22: that plain zstd level"},
          {"delta_threads", SettingType::kInt, "0",
           "threads encoding and decoding chunks, the caller's included (0: one per core, at "
           "most 8)"},
          {"delta_groups", SettingType::kInt, "1",
           "magnitude groups of the sparse form (1..4). 1: plain positions, fastest to decode; "
           "2..4: changes located within groups of weights of similar magnitude, 15-30% fewer "
           "bytes on training deltas, decoding about 3x slower"},
      }};
  return *table;
}

absl::StatusOr<LayerOptions> ReadLayerOptions(const Uri& uri, const Config& config) {
  LayerOptions o;
  o.keyframe_interval = config.Int("keyframe_interval");
  o.encode.chunk_size = config.Bytes("delta_chunk_size");
  const int64_t level = config.Int("delta_zstd_level");
  const int64_t threads = config.Int("delta_threads");
  const int64_t groups = config.Int("delta_groups");
  auto bad = [&](std::string_view name, int64_t value, std::string_view range) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: setting %s=%d is outside %s", uri.Display(), name, value, range));
  };
  if (o.keyframe_interval < 0) return bad("keyframe_interval", o.keyframe_interval, "0..");
  o.max_chain = config.Int("delta_max_chain");
  if (o.max_chain < 1) return bad("delta_max_chain", o.max_chain, "1..");
  if (o.encode.chunk_size < kMinChunkSize || o.encode.chunk_size > kMaxChunkSize ||
      o.encode.chunk_size % 64 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: setting delta_chunk_size=%d is not a multiple of 64 from 64 to 1GiB",
                        uri.Display(), o.encode.chunk_size));
  }
  if (level < 0 || level > 22) return bad("delta_zstd_level", level, "0..22");
  if (threads < 0 || threads > WorkerPool::kMaxThreads) {
    return bad("delta_threads", threads, absl::StrFormat("0..%d", WorkerPool::kMaxThreads));
  }
  if (groups < 1 || groups > 4) return bad("delta_groups", groups, "1..4");
  o.encode.zstd_level = static_cast<int>(level);
  o.encode.max_groups = static_cast<int>(groups);
  o.threads = static_cast<int>(threads);
  return o;
}

TransportCapabilities LayerCapabilities(const Config&, const TransportCapabilities& beneath) {
  TransportCapabilities c = beneath;
  // The layer encodes from contiguous bytes (the core packs strided views for it), computes no
  // checksums as it copies and keeps no manifest of its own to read back.
  c.reads_strided_views = false;
  c.copies_with_checksums = false;
  c.committed_manifest = false;
  // A late joiner replays the newest keyframe and the deltas after it with OpenVersion; without
  // it the joiner waits for the next keyframe.
  c.late_joiners = beneath.late_joiners && beneath.open_version;
  c.memory_kinds = TransportCapabilities::kHostMemory;  // encoded and decoded on the CPU
  return c;
}

}  // namespace weightbus::internal::delta

WEIGHTBUS_REGISTER_TRANSPORT(
    delta,
    (::weightbus::internal::TransportDescriptor{
        "delta",
        "layer: sends keyframes and deltas against the previous version, losslessly "
        "compressed (delta+<transport>://...)",
        &::weightbus::internal::delta::DeltaSettings(), nullptr, nullptr,
        ::weightbus::internal::delta::WrapPublisher, ::weightbus::internal::delta::WrapSubscriber,
        ::weightbus::internal::delta::LayerCapabilities}))

// SPDX-License-Identifier: Apache-2.0
#include "absl/strings/str_format.h"
#include "core/registry.h"
#include "transports/delta/delta_transport.h"

namespace weightbus::internal::delta {

const SettingTable& DeltaSettings() {
  static const SettingTable* table = new SettingTable{
      "delta",
      {
          {.name = "keyframe_interval",
           .type = SettingType::kInt,
           .default_value = "0",
           .doc = "a keyframe (the whole version, compressed) every N versions and deltas in "
                  "between; 0 (default): keyframes only when needed (first version, new tensor "
                  "layout, a damaged base on the channel, delta_max_chain reached), which over a "
                  "run costs 3x fewer bytes than every 50 (BENCHMARKS.md). A late joiner replays "
                  "the newest keyframe and the deltas after it",
           .min = "0",
           .unit = "versions"},
          {.name = "delta_max_chain",
           .type = SettingType::kInt,
           .default_value = "1000",
           .doc = "most deltas after a keyframe: the next version is a keyframe whatever "
                  "keyframe_interval says. Bounds what a late joiner replays and what the channel "
                  "keeps: at most max(retention, delta_max_chain + 2) versions",
           .min = "1",
           .unit = "versions"},
          {.name = "delta_chunk_size",
           .type = SettingType::kBytes,
           .default_value = "4MiB",
           .doc = "bytes per independently encoded chunk, a multiple of 64: the unit of "
                  "parallel encoding and decoding",
           .min = "64",
           .max = "1GiB"},
          {.name = "delta_zstd_level",
           .type = SettingType::kInt,
           .default_value = "0",
           .doc = "0: zstd tuned for entropy-bound byte planes (fastest strategy, minimum match "
                  "7, hash log 6); 1..22: that plain zstd level",
           .min = "0",
           .max = "22"},
          {.name = "delta_threads",
           .type = SettingType::kInt,
           .default_value = "0",
           .doc = "threads encoding and decoding chunks, the caller's included (0: one per "
                  "core, at most 8)",
           .min = "0",
           .max = "256",  // WorkerPool::kMaxThreads
           .unit = "threads"},
          {.name = "delta_model",
           .type = SettingType::kEnum,
           .default_value = "context",
           .doc =
               "how a delta codes its changes. context: an adaptive range coder in contexts "
               "of each weight's magnitude (the smallest deltas: measured 1.23-1.36x smaller "
               "than sparse on the real-gradient stream, BENCHMARKS.md issue 16); sparse: "
               "positions and changes as zstd-coded byte planes (the fastest: measured 10-15x "
               "faster to decode on that stream: 22-24 against 2.1-2.4 GB/s per core at lr 1e-6)",
           .choices = {"context", "sparse"}},
          {.name = "delta_groups",
           .type = SettingType::kInt,
           .default_value = "1",
           .doc = "magnitude groups of delta_model=sparse. 1: plain positions, fastest to "
                  "decode; 2..4: changes located within groups of weights of similar magnitude, "
                  "15-30% fewer bytes on training deltas, decoding about 3x slower",
           .min = "1",
           .max = "4",
           .unit = "groups"},
          {.name = "delta_resume",
           .type = SettingType::kBool,
           .default_value = "true",
           .doc = "a new publisher (a restarted trainer, each `weightbus publish`) continues the "
                  "chain of the channel's newest version: it reads that version back, checks it "
                  "against the version's checksums and sends its first version as a delta "
                  "against it (a keyframe, saying why, when that fails); false: its first "
                  "version is a keyframe"},
          {.name = "delta_send_plain",
           .type = SettingType::kBool,
           .default_value = "true",
           .doc = "send a version of at least 1 MiB plainly (its tensors as they are, through the "
                  "transport beneath) when this publisher's measured encoding rate and transfer "
                  "rate predict that encoding and decoding it would take longer than sending the "
                  "bytes it saves; the stats and the record say which and why. false: always "
                  "encode"},
      }};
  return *table;
}

absl::StatusOr<LayerOptions> ReadLayerOptions(const Uri& uri, const Config& config) {
  // Ranges are declared in DeltaSettings and checked by Config::Resolve; what is left is the
  // one rule that is not a range.
  LayerOptions o;
  o.keyframe_interval = config.Int("keyframe_interval");
  o.max_chain = config.Int("delta_max_chain");
  o.encode.chunk_size = config.Bytes("delta_chunk_size");
  if (o.encode.chunk_size % 64 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: setting delta_chunk_size=%d is not a multiple of 64", uri.Display(),
                        o.encode.chunk_size));
  }
  o.encode.zstd_level = static_cast<int>(config.Int("delta_zstd_level"));
  o.encode.max_groups = static_cast<int>(config.Int("delta_groups"));
  o.encode.context_model = config.String("delta_model") == "context";
  o.threads = static_cast<int>(config.Int("delta_threads"));
  o.resume = config.Bool("delta_resume");
  o.choose_plain = config.Bool("delta_send_plain");
  return o;
}

TransportCapabilities LayerCapabilities(const Config&, const TransportCapabilities& beneath) {
  TransportCapabilities c = beneath;
  // The layer encodes from contiguous bytes (the core packs strided views for it), computes no
  // checksums as it copies and keeps no manifest of its own to read back.
  c.reads_strided_views = false;
  c.copies_with_checksums = false;
  c.committed_manifest = false;
  // The back channel carries this layer's own keyframe requests; a layer above has none to send.
  c.keyframe_requests = false;
  // A late joiner replays the newest keyframe and the deltas after it with OpenVersion; without
  // it the joiner waits for the next keyframe.
  c.late_joiners = beneath.late_joiners && beneath.open_version;
  // Encoded and decoded on the CPU.
  c.publish_memory = c.fetch_memory = TransportCapabilities::kHostMemory;
  // Each rank of a group encodes its own parts into its part of the group version beneath
  // (README.md, "Over a publisher group") and reads the committed group manifest back after
  // each version (the group's keyframe floor, what its check at rest compares): a group beneath
  // without committed_manifest (ucx://) is not carried. Subscribers decode whole parts: no byte
  // ranges.
  c.publisher_groups = beneath.publisher_groups && beneath.committed_manifest;
  c.partial_reads = false;
  // Never inherited: a group beneath authenticates the parts it is handed, which under the
  // layer are encodings, not the manifests the core MACs (docs/SECURITY.md, "Publisher groups").
  c.authenticated_groups = false;
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

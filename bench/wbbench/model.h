// SPDX-License-Identifier: Apache-2.0
// The analytic cost model of `weightbus-bench model`: what syncing weights from a trainer to its
// inference replicas costs a cluster, per transport. Every formula and assumption is documented
// in docs/COST_MODEL.md; the functions here are pure (apart from reading files where they say
// so) so that tests check them against hand-computed cases.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace weightbus::bench {

// A network preset: `links_per_node` links of `link_gbs` GB/s (10^9 bytes/s, one direction) each.
struct FabricPreset {
  std::string name;
  double link_gbs = 0;
  int links_per_node = 1;
  std::string what;    // one line
  std::string source;  // where the figure comes from
};

// A storage preset for disk://: per-client write and read rates, the whole system's total, and
// the delay from a commit until subscribers notice it.
struct StoragePreset {
  std::string name;
  double write_gbs = 0;      // one client (node) writing, fsync included
  double read_gbs = 0;       // one client (node) reading
  double aggregate_gbs = 0;  // all clients together, reading or writing
  double latency_s = 0;      // commit -> subscribers start reading
  std::string what;
  std::string source;
};

const std::vector<FabricPreset>& FabricPresets();
const std::vector<StoragePreset>& StoragePresets();
const FabricPreset* FindFabric(const std::string& name);
const StoragePreset* FindStorage(const std::string& name);

// Bytes per parameter of a dtype name (fp32, bf16, fp16, fp8, int8, int4, ...); nullopt if
// unknown.
std::optional<double> BytesPerParam(const std::string& dtype);

// "7B", "70e9", "1.5T", "260K", "8e9" -> a parameter count (K, M, B or G, T: powers of 1000).
// Errors: InvalidArgument naming the text (not a number, an unknown suffix, not positive).
absl::StatusOr<double> ParseParamCount(const std::string& text);

// The size of a checkpoint on disk, from its headers only.
struct CheckpointSize {
  double parameters = 0;
  double bytes = 0;   // sum of the tensors' bytes as stored
  std::string dtype;  // "BF16", "F32", or "mixed"
  std::string what;   // "3 tensors in 1 safetensors file", ...
};
// `path`: a .safetensors file, a directory with model.safetensors or
// model.safetensors.index.json and its shards, or a llama2.c .bin (float32; the RoPE tables it
// carries are not parameters and not counted). Errors: as the readers (NotFound, DataLoss, ...).
absl::StatusOr<CheckpointSize> MeasureCheckpoint(const std::string& path);

struct ModelInputs {
  double model_bytes = 0;    // S: bytes of one version as sent (parameters x wire dtype)
  int trainer_gpus = 8;      // T
  int replica_gpus = 8;      // R: all inference GPUs together
  int gpus_per_node = 8;     // g
  int gpus_per_replica = 8;  // p: GPUs of one inference instance (TP x PP x EP)
  int broadcast_roots = 1;   // nccl: trainer GPUs that broadcast (each its 1/roots share)
  // disk, ucx and delta+: trainer GPUs that publish, each its 1/publishers of the version (a
  // publisher group); 0 means every trainer GPU (sharded publish), 1 a single source, which
  // first gathers the trainer's shards (docs/COST_MODEL.md, "Sources").
  int publishers = 0;
  double node_gbs = 400;  // B: network bandwidth of one node, one direction
  int nics_per_node = 8;  // NICs B is spread over; a broadcast root has B / min(nics, g)
  double storage_write_gbs = 10;
  double storage_read_gbs = 10;
  double storage_aggregate_gbs = 100;
  // Copies around the network. Rates may be +inf: no cost (e.g. tensors already in host memory).
  double d2h_gbs = 50;           // per trainer GPU: its shard to host memory (PCIe)
  double stage_gbs = 100;        // ucx, per trainer node: host copy into registered staging memory
  double apply_gbs = 50;         // per replica GPU: received host bytes to its parameters (PCIe)
  double net_latency_s = 0.002;  // ucx, nccl: Publish returned -> the bytes start moving
  double storage_latency_s = 0.05;  // disk: commit -> subscribers start reading
  double step_s = 60;               // training step without sync
  double overlap = 0;               // fraction of the step a transfer may hide behind (0: lockstep)
  double gpu_price = 2.0;           // dollars per GPU-hour
  double delta_ratio = 100;         // full bytes / bytes of a delta (measured: BENCHMARKS.md)
  int keyframe_interval = 50;       // a keyframe every K versions (0: only the first)
  double keyframe_ratio = 1.5;      // full bytes / bytes of a keyframe
  double encode_gbs = 20;           // delta encoding, per trainer node
  double decode_gbs = 40;           // delta decoding, per replica node
};

// Derived counts (ceil divisions).
struct Shape {
  int trainer_nodes = 1;          // Nt = ceil(T / g)
  int publishers = 1;             // P = publishers, or T when 0
  int publisher_nodes = 1;        // Np = ceil(P / g): the nodes the sources are on
  int replica_nodes = 1;          // Nr = ceil(R / g)
  int instances = 1;              // n = R / p
  int nodes_per_instance = 1;     // m = ceil(p / g)
  int gpus_per_replica_node = 1;  // Gr = min(g, R)
};
Shape ShapeOf(const ModelInputs& in);

// Fraction of the full bytes a delta layer sends per version, averaged over a keyframe period:
// 1 / (K * keyframe_ratio) + (K - 1) / (K * delta_ratio), or 1 / delta_ratio when K == 0.
double DeltaFraction(const ModelInputs& in);

// The transports the model knows (whether or not this build has them).
const std::vector<std::string>& ModelTransports();  // disk, ucx, nccl, delta+disk, delta+ucx

// One term of a transport's time, in seconds, in the order it happens.
struct Term {
  std::string name;  // "gather", "d2h", "stage", "encode", "write", "broadcast", "latency",
                     // "pull", "read", "decode", "apply"
  double seconds = 0;
  bool stalls_trainer = false;  // part of the trainer's stall
};

struct Estimate {
  std::string transport;
  int publishers = 0;     // the sources it was computed for (ShapeOf(in).publishers)
  double wire_bytes = 0;  // bytes per version each instance receives (delta: averaged)
  std::vector<Term> terms;
  double stall_s = 0;             // trainer blocked: the sum of the terms that stall it
  double transfer_s = 0;          // publish start -> the last replica holds the version
  double exposed_s = 0;           // max(stall, transfer - overlap * step)
  double utilisation = 0;         // step / (step + exposed)
  double trainer_idle_gpu_h = 0;  // per 1,000 steps: exposed * T
  double fleet_idle_gpu_h = 0;    // per 1,000 steps: exposed * (T + R)
  double trainer_idle_dollars = 0;
  double fleet_idle_dollars = 0;
  // Bandwidth (GB/s per node of the network; per client read of the storage for disk, with
  // write and aggregate scaled alike) needed for 90% and 99% utilisation with everything else
  // fixed; +inf when no bandwidth is enough.
  double gbs_for_90 = 0;
  double gbs_for_99 = 0;
  std::string bandwidth_of;  // "network" or "storage"
};

// Errors: InvalidArgument naming a bad input (non-positive sizes or rates, overlap outside
// [0, 1], replica GPUs not a multiple of GPUs per replica, ...) or an unknown transport.
absl::Status ValidateInputs(const ModelInputs& in);
absl::StatusOr<Estimate> EstimateTransport(const ModelInputs& in, const std::string& transport);

// The smallest bandwidth (as `bandwidth_of` says) for which utilisation >= target, by bisection
// (utilisation never decreases with bandwidth): +inf when even 10^6 times the current one is
// not enough; NaN for invalid inputs or an unknown transport.
double BandwidthFor(const ModelInputs& in, const std::string& transport, double target);

// The figures `weightbus-bench run --json` measured, mapped to model inputs
// (docs/COST_MODEL.md, "Calibration").
struct Calibration {
  struct Figure {
    double value = 0;
    std::string how;  // one line: what was measured and how it maps
  };
  std::string file;
  double model_bytes = 0;
  int subscribers = 0;
  std::string host;  // "Linux 6.1 x86_64, 2 cores"
  // Keyed by the model flag each replaces: "network-gbs", "storage-write-gbs",
  // "storage-read-gbs", "storage-aggregate-gbs", "stage-gbs", "apply-gbs", "latency-s",
  // "storage-latency-s", "delta-ratio", "keyframe-ratio", "keyframe-interval", "encode-gbs",
  // "decode-gbs". Absent: the run did not measure it.
  std::map<std::string, Figure> figures;
  // The same keys from the run's baselines only (memcpy, write+read, ucx_perftest), latencies
  // zero: what the machine allows, for the comparison's "bound" column.
  std::map<std::string, Figure> bound;
  // Per transport the run measured: medians over its measured versions.
  struct Measured {
    std::string name;
    double stall_s = 0;
    double last_s = 0;
    int count = 0;
  };
  std::vector<Measured> measured;
};
// `run`: the parsed JSON; `file` names it in messages and origins.
// Errors: InvalidArgument when it is not a run's JSON (no model_bytes, no transports).
absl::StatusOr<Calibration> CalibrateFromRun(const nlohmann::json& run, const std::string& file);
// Reads and parses `path`, then as above. Errors: NotFound, InvalidArgument (not JSON).
absl::StatusOr<Calibration> ReadCalibration(const std::string& path);

// Sets the input named by its flag (without dashes: "network-gbs", "trainer-gpus",
// "model-bytes", ...; every key of Calibration::figures among them); false for an unknown key.
bool SetInput(ModelInputs& in, const std::string& key, double value);

// "This machine as the run measured it": one trainer (GPU-equivalent: the publisher process),
// the run's subscribers as one-GPU instances on the same node, nothing to copy to or from a GPU,
// lockstep, and every measured version a delta (the run's only keyframe is its warm-up).
ModelInputs ThisMachine(ModelInputs in, const Calibration& c);

// The nccl-tests style table (header, units, one row per estimate; no banner, no final line).
// With `label_publishers`, each row's transport is followed by its sources ("ucx/256").
std::string FormatModelTable(const std::vector<Estimate>& estimates, bool label_publishers = false);

// Where the time goes: one row per estimate (transport and sources), one column per term any
// of them has, in the order they happen, then the stall and the time to the last replica;
// seconds per version. No banner, no final line.
std::string FormatTermsTable(const std::vector<Estimate>& estimates);

// Prediction next to measurement for each transport the run measured: `predicted` with the
// calibrated inputs, `bound` with the baselines' (either may lack a transport).
std::string FormatComparison(const std::vector<Calibration::Measured>& measured,
                             const std::vector<Estimate>& predicted,
                             const std::vector<Estimate>& bound);

}  // namespace weightbus::bench

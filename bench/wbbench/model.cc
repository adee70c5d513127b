// SPDX-License-Identifier: Apache-2.0
#include "wbbench/model.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "wbbench/common.h"
#include "weightbus/llama2c.h"
#include "weightbus/safetensors.hpp"
#include "weightbus/types.hpp"

namespace weightbus::bench {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ----- presets -----

const std::vector<FabricPreset>& FabricPresets() {
  static const auto* presets = new std::vector<FabricPreset>{
      {"nvlink4", 450, 8, "NVLink 4 (H100/H200 SXM) within one NVLink domain, per GPU",
       "NVIDIA H100 SXM datasheet: NVLink 900 GB/s per GPU, both directions together"},
      {"nvlink5", 900, 8, "NVLink 5 (B200/GB200) within one NVLink domain (e.g. NVL72), per GPU",
       "NVIDIA Blackwell datasheets: NVLink 1.8 TB/s per GPU, both directions together"},
      {"ib-xdr", 100, 8, "InfiniBand XDR 800 Gb/s per NIC, 8 NICs per node",
       "XDR line rate 800 Gb/s (ConnectX-8); one NIC per GPU"},
      {"ib-ndr", 50, 8, "InfiniBand NDR 400 Gb/s per NIC, 8 NICs per node",
       "NDR line rate 400 Gb/s (ConnectX-7); DGX H100: 8 x 400 Gb/s compute NICs"},
      {"ib-hdr", 25, 8, "InfiniBand HDR 200 Gb/s per NIC, 8 NICs per node",
       "HDR line rate 200 Gb/s (ConnectX-6); DGX A100: 8 x 200 Gb/s compute NICs"},
      {"roce-400", 50, 8, "RoCE 400 GbE per NIC, 8 NICs per node", "Ethernet line rate"},
      {"roce-200", 25, 8, "RoCE 200 GbE per NIC, 8 NICs per node", "Ethernet line rate"},
      {"roce-100", 12.5, 8, "RoCE 100 GbE per NIC, 8 NICs per node", "Ethernet line rate"},
      {"efa-p5", 12.5, 32, "AWS EFA on p5.48xlarge: 32 x 100 Gb/s per node",
       "AWS p5 instance: 3,200 Gb/s of EFA networking"},
      {"eth-100g", 12.5, 1, "100 GbE, one NIC per node (TCP)", "Ethernet line rate"},
      {"eth-10g", 1.25, 1, "10 GbE, one NIC per node (TCP)", "Ethernet line rate"},
      {"eth-1g", 0.125, 1, "1 GbE, one NIC per node (TCP)", "Ethernet line rate"},
  };
  return *presets;
}

const std::vector<StoragePreset>& StoragePresets() {
  static const auto* presets = new std::vector<StoragePreset>{
      {"nvme", 5, 7, 7, 0.002, "one local NVMe SSD, PCIe 4.0 x4 (trainer and replicas on one node)",
       "PCIe 4.0 x4 carries 7.9 GB/s; datacenter Gen4 drives specify ~7 GB/s read, ~5 GB/s "
       "write (sequential); inotify wakes subscribers at once"},
      {"nvme-gen5", 10, 14, 14, 0.002, "one local NVMe SSD, PCIe 5.0 x4",
       "PCIe 5.0 x4 carries 15.8 GB/s; Gen5 drives specify ~14 GB/s read, ~10 GB/s write"},
      {"nfs", 1.25, 1.25, 2.5, 0.05, "NFS over 10 GbE (one server)",
       "assumption: 10 GbE line rate per client, two server links; subscribers poll every "
       "100 ms (disk poll_interval), 50 ms on average"},
      {"shared-fs", 10, 10, 100, 0.05, "a parallel filesystem (Lustre, GPFS, Weka)",
       "assumption: 10 GB/s per client, 100 GB/s in total, 100 ms polling; replace with your "
       "system's figures"},
  };
  return *presets;
}

const FabricPreset* FindFabric(const std::string& name) {
  for (const FabricPreset& p : FabricPresets()) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

const StoragePreset* FindStorage(const std::string& name) {
  for (const StoragePreset& p : StoragePresets()) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::optional<double> BytesPerParam(const std::string& name) {
  const std::string d = absl::AsciiStrToLower(name);
  if (d == "fp64" || d == "f64" || d == "float64") return 8;
  if (d == "fp32" || d == "f32" || d == "float32") return 4;
  if (d == "bf16" || d == "bfloat16" || d == "fp16" || d == "f16" || d == "float16") return 2;
  if (d == "fp8" || d == "f8" || d == "f8_e4m3" || d == "f8_e5m2" || d == "int8" || d == "i8") {
    return 1;
  }
  if (d == "int4" || d == "fp4" || d == "nvfp4" || d == "mxfp4") return 0.5;
  return std::nullopt;
}

absl::StatusOr<double> ParseParamCount(const std::string& text) {
  std::string t(absl::StripAsciiWhitespace(text));
  double scale = 1;
  if (!t.empty() && std::isalpha(static_cast<unsigned char>(t.back()))) {
    switch (std::toupper(static_cast<unsigned char>(t.back()))) {
      case 'K':
        scale = 1e3;
        break;
      case 'M':
        scale = 1e6;
        break;
      case 'B':
      case 'G':
        scale = 1e9;
        break;
      case 'T':
        scale = 1e12;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrFormat(
            "parameter count \"%s\": unknown suffix (K, M, B, T, or a plain number)", text));
    }
    t.pop_back();
  }
  double v = 0;
  if (!absl::SimpleAtod(t, &v) || !(v * scale > 0) || !std::isfinite(v * scale)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "parameter count \"%s\" is not a positive number (e.g. 7B, 70e9, 1T)", text));
  }
  return v * scale;
}

// ----- checkpoints -----

namespace {

namespace fs = std::filesystem;

absl::Status AddSafetensors(const std::string& path, CheckpointSize& size,
                            std::set<std::string>& dtypes) {
  absl::StatusOr<safetensors::Header> h = safetensors::ReadHeader(path);
  if (!h.ok()) return h.status();
  for (const safetensors::Entry& e : h->tensors) {
    double n = 1;
    for (int64_t d : e.shape) n *= static_cast<double>(d);
    size.parameters += n;
    size.bytes += static_cast<double>(e.nbytes());
    dtypes.insert(std::string(DTypeName(e.dtype)));
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointSize> MeasureLlama2c(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError("cannot open " + path);
  std::string header(28, '\0');
  f.read(header.data(), static_cast<std::streamsize>(header.size()));
  header.resize(static_cast<size_t>(f.gcount()));
  absl::StatusOr<tools::Llama2cConfig> c = tools::ParseLlama2cHeader(header, path);
  if (!c.ok()) return c.status();
  std::error_code ec;
  const uint64_t file_size = fs::file_size(path, ec);
  if (ec || file_size != tools::Llama2cFileSize(*c)) {
    return absl::DataLossError(
        absl::StrFormat("%s: %d bytes, a llama2.c checkpoint of this "
                        "header has %d",
                        path, file_size, tools::Llama2cFileSize(*c)));
  }
  const double dim = c->dim, hidden = c->hidden_dim, layers = c->n_layers, vocab = c->vocab_size,
               kv = c->kv_dim();
  const double per_layer = 2 * dim + 2 * dim * dim + 2 * kv * dim + 3 * hidden * dim;
  CheckpointSize s;
  s.parameters = vocab * dim + layers * per_layer + dim + (c->shared_classifier ? 0 : vocab * dim);
  s.bytes = 4 * s.parameters;
  s.dtype = "F32";
  s.what = absl::StrFormat("llama2.c checkpoint (dim %d, %d layers, vocab %d)", c->dim, c->n_layers,
                           c->vocab_size);
  return s;
}

}  // namespace

absl::StatusOr<CheckpointSize> MeasureCheckpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return absl::NotFoundError("no such file or directory: " + path);
  if (!fs::is_directory(path, ec) && absl::EndsWith(path, ".bin")) return MeasureLlama2c(path);
  std::vector<std::string> files;
  if (fs::is_directory(path, ec)) {
    const std::string index = path + "/model.safetensors.index.json";
    if (fs::exists(index, ec)) {
      std::ifstream in(index);
      nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
      if (j.is_discarded() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
        return absl::DataLossError(index + ": not a safetensors index (no weight_map object)");
      }
      std::set<std::string> shards;
      for (const auto& [name, file] : j["weight_map"].items()) {
        if (!file.is_string())
          return absl::DataLossError(index + ": \"" + name +
                                     "\" maps to "
                                     "a non-string");
        shards.insert(file.get<std::string>());
      }
      for (const std::string& s : shards) files.push_back(path + "/" + s);
    } else if (fs::exists(path + "/model.safetensors", ec)) {
      files.push_back(path + "/model.safetensors");
    } else {
      return absl::InvalidArgumentError(
          path + ": no model.safetensors or model.safetensors.index.json in this directory");
    }
  } else {
    files.push_back(path);
  }
  CheckpointSize size;
  std::set<std::string> dtypes;
  for (const std::string& f : files) {
    if (absl::Status st = AddSafetensors(f, size, dtypes); !st.ok()) return st;
  }
  size.dtype = dtypes.size() == 1 ? *dtypes.begin() : dtypes.empty() ? "none" : "mixed";
  size.what = absl::StrFormat("safetensors checkpoint, %d file%s", files.size(),
                              files.size() == 1 ? "" : "s");
  return size;
}

// ----- the model -----

Shape ShapeOf(const ModelInputs& in) {
  auto ceil_div = [](int a, int b) { return (a + b - 1) / b; };
  Shape s;
  s.trainer_nodes = ceil_div(in.trainer_gpus, in.gpus_per_node);
  s.replica_nodes = ceil_div(in.replica_gpus, in.gpus_per_node);
  s.instances = ceil_div(in.replica_gpus, in.gpus_per_replica);
  s.nodes_per_instance = ceil_div(in.gpus_per_replica, in.gpus_per_node);
  s.gpus_per_replica_node = std::min(in.gpus_per_node, in.replica_gpus);
  s.publishers = in.publishers > 0 ? in.publishers : in.trainer_gpus;
  s.publisher_nodes = ceil_div(s.publishers, in.gpus_per_node);
  return s;
}

double DeltaFraction(const ModelInputs& in) {
  if (in.keyframe_interval <= 0) return 1.0 / in.delta_ratio;
  const double k = in.keyframe_interval;
  return 1.0 / (k * in.keyframe_ratio) + (k - 1) / (k * in.delta_ratio);
}

const std::vector<std::string>& ModelTransports() {
  static const auto* t =
      new std::vector<std::string>{"disk", "ucx", "nccl", "delta+disk", "delta+ucx"};
  return *t;
}

absl::Status ValidateInputs(const ModelInputs& in) {
  // Rates may be +inf ("no cost"); sizes, counts and the step must be finite.
  struct Check {
    double v;
    const char* name;
    bool may_be_inf;
  };
  for (const Check& c :
       std::vector<Check>{{in.model_bytes, "model bytes", false},
                          {double(in.trainer_gpus), "trainer GPUs", false},
                          {double(in.replica_gpus), "replica GPUs", false},
                          {double(in.gpus_per_node), "GPUs per node", false},
                          {double(in.gpus_per_replica), "GPUs per replica", false},
                          {double(in.broadcast_roots), "broadcast roots", false},
                          {double(in.nics_per_node), "NICs per node", false},
                          {in.node_gbs, "network GB/s per node", true},
                          {in.storage_write_gbs, "storage write GB/s", true},
                          {in.storage_read_gbs, "storage read GB/s", true},
                          {in.storage_aggregate_gbs, "storage aggregate GB/s", true},
                          {in.d2h_gbs, "trainer GPU-to-host GB/s", true},
                          {in.stage_gbs, "staging GB/s", true},
                          {in.apply_gbs, "apply GB/s", true},
                          {in.step_s, "step time", false},
                          {in.delta_ratio, "delta ratio", true},
                          {in.keyframe_ratio, "keyframe ratio", true},
                          {in.encode_gbs, "encode GB/s", true},
                          {in.decode_gbs, "decode GB/s", true}}) {
    if (!(c.v > 0) || (!c.may_be_inf && !std::isfinite(c.v))) {
      return absl::InvalidArgumentError(absl::StrFormat("%s must be positive%s (got %g)", c.name,
                                                        c.may_be_inf ? "" : " and finite", c.v));
    }
  }
  if (!(in.overlap >= 0 && in.overlap <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("overlap must be in [0, 1] (got %g)", in.overlap));
  }
  for (auto [v, name] :
       {std::pair{in.net_latency_s, "network latency"},
        std::pair{in.storage_latency_s, "storage latency"}, std::pair{in.gpu_price, "GPU price"}}) {
    if (!(v >= 0) || !std::isfinite(v)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s must be zero or positive (got %g)", name, v));
    }
  }
  if (in.keyframe_interval < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("keyframe interval must be >= 0 (got %d)", in.keyframe_interval));
  }
  if (in.replica_gpus % in.gpus_per_replica != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("replica GPUs (%d) must be a multiple of GPUs per replica (%d)",
                        in.replica_gpus, in.gpus_per_replica));
  }
  if (in.publishers < 0 || in.publishers > in.trainer_gpus) {
    return absl::InvalidArgumentError(
        absl::StrFormat("publishers (%d) must be in [1, trainer GPUs = %d] (0: every trainer GPU)",
                        in.publishers, in.trainer_gpus));
  }
  if (in.broadcast_roots > in.trainer_gpus) {
    return absl::InvalidArgumentError(
        absl::StrFormat("broadcast roots (%d) cannot exceed trainer GPUs (%d)", in.broadcast_roots,
                        in.trainer_gpus));
  }
  return absl::OkStatus();
}

namespace {

// Splits "delta+ucx" into (delta, "ucx"); false for names the model does not know.
bool ParseTransport(const std::string& transport, bool* delta, std::string* base) {
  std::vector<std::string> parts = absl::StrSplit(transport, '+');
  *delta = parts.size() == 2 && parts[0] == "delta";
  *base = *delta ? parts[1] : transport;
  if ((parts.size() == 2 && !*delta) || parts.size() > 2) return false;
  return *base == "disk" || *base == "ucx" || *base == "nccl";
}

// The terms of one version, in order (inputs validated, transport known). docs/COST_MODEL.md
// derives each.
std::vector<Term> Terms(const ModelInputs& in, bool delta, const std::string& base,
                        double* wire_out) {
  const Shape s = ShapeOf(in);
  const double full = in.model_bytes;
  const double wire = delta ? full * DeltaFraction(in) : full;
  const double node = in.node_gbs * 1e9;
  // What one replica node holds of every instance on it: its GPUs' shares (Gr / p of a version).
  const double node_share = static_cast<double>(s.gpus_per_replica_node) / in.gpus_per_replica;
  // weightbus moves host memory: the trainer copies its shards off the GPUs, the replicas copy
  // what they received onto theirs. nccl works on GPU memory, unless a delta codec (CPU) is on top.
  const bool through_host = delta || base != "nccl";
  std::vector<Term> t;
  auto add = [&t](const char* name, double seconds, bool stalls) {
    t.push_back({name, seconds, stalls});
  };
  // The sources: P publishing GPUs on Np nodes, each its 1/P of the version (P = T: every
  // trainer GPU publishes its own shard). Fewer sources than trainer nodes first gather the
  // trainer's shards: each source node receives its 1/Np of the version, less the 1/Nt its own
  // GPUs hold, through its ingress (the trainer waits; nccl's roots are broadcast_roots).
  const double sources = s.publishers, source_nodes = s.publisher_nodes;
  if (through_host && s.publisher_nodes < s.trainer_nodes) {
    add("gather", (full / source_nodes - full / s.trainer_nodes) / node, true);
  }
  if (through_host) add("d2h", full / sources / (in.d2h_gbs * 1e9), true);
  if (delta) add("encode", full / source_nodes / (in.encode_gbs * 1e9), true);
  if (base == "ucx") {
    // Each source node copies its shards into registered memory; then every replica node pulls
    // its GPUs' shares with one-sided reads, limited by its ingress and by the source nodes'
    // egress, which serves every instance.
    add("stage", wire / source_nodes / (in.stage_gbs * 1e9), true);
    add("latency", in.net_latency_s, false);
    add("pull", std::max(wire * node_share / node, s.instances * wire / source_nodes / node),
        false);
  } else if (base == "disk") {
    // The source nodes write their shards in parallel (per client and in total), commit; every
    // replica node reads its GPUs' shares (all instances together limited by the total).
    const double write_gbs =
        std::min(source_nodes * in.storage_write_gbs, in.storage_aggregate_gbs);
    add("write", wire / (write_gbs * 1e9), true);
    add("latency", in.storage_latency_s, false);
    add("read",
        std::max(wire * node_share / (in.storage_read_gbs * 1e9),
                 s.instances * wire / (in.storage_aggregate_gbs * 1e9)),
        false);
  } else {
    // A pipelined broadcast of the whole version to every replica GPU: each root sends through
    // its share of its node's NICs (B / min(nics, g): its own NIC, or the node's one NIC), the
    // receiving nodes take at most B. The trainer's roots take part until their last chunk left.
    const double per_root = node / std::min(in.nics_per_node, in.gpus_per_node);
    const double rate = std::min(in.broadcast_roots * per_root, node);
    add("latency", in.net_latency_s, true);
    add("broadcast", wire / rate, true);
  }
  if (delta) add("decode", full * node_share / (in.decode_gbs * 1e9), false);
  if (through_host) add("apply", full / in.gpus_per_replica / (in.apply_gbs * 1e9), false);
  if (wire_out != nullptr) *wire_out = wire;
  return t;
}

struct Times {
  double stall = 0;
  double transfer = 0;
};

Times Sum(const std::vector<Term>& terms) {
  Times x;
  for (const Term& t : terms) {
    x.transfer += t.seconds;
    if (t.stalls_trainer) x.stall += t.seconds;
  }
  return x;
}

double Exposed(const ModelInputs& in, const Times& x) {
  return std::max(x.stall, x.transfer - in.overlap * in.step_s);
}

}  // namespace

absl::StatusOr<Estimate> EstimateTransport(const ModelInputs& in, const std::string& transport) {
  if (absl::Status st = ValidateInputs(in); !st.ok()) return st;
  bool delta = false;
  std::string base;
  if (!ParseTransport(transport, &delta, &base)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the model knows disk, ucx, nccl and delta+ over each of them, not \"%s\"", transport));
  }
  Estimate e;
  e.transport = transport;
  e.publishers = ShapeOf(in).publishers;
  e.terms = Terms(in, delta, base, &e.wire_bytes);
  const Times x = Sum(e.terms);
  e.stall_s = x.stall;
  e.transfer_s = x.transfer;
  e.exposed_s = Exposed(in, x);
  e.utilisation = in.step_s / (in.step_s + e.exposed_s);
  e.trainer_idle_gpu_h = e.exposed_s * in.trainer_gpus * 1000 / 3600;
  e.fleet_idle_gpu_h = e.exposed_s * (in.trainer_gpus + in.replica_gpus) * 1000 / 3600;
  e.trainer_idle_dollars = e.trainer_idle_gpu_h * in.gpu_price;
  e.fleet_idle_dollars = e.fleet_idle_gpu_h * in.gpu_price;
  e.bandwidth_of = base == "disk" ? "storage" : "network";
  e.gbs_for_90 = BandwidthFor(in, transport, 0.90);
  e.gbs_for_99 = BandwidthFor(in, transport, 0.99);
  return e;
}

double BandwidthFor(const ModelInputs& in, const std::string& transport, double target) {
  bool delta = false;
  std::string base;
  if (!ValidateInputs(in).ok() || !ParseTransport(transport, &delta, &base)) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  const bool storage = base == "disk";
  // An infinite bandwidth (--network-gbs inf) is searched from 10^6 GB/s down instead: the
  // answer is still the smallest finite bandwidth that reaches the target.
  ModelInputs finite = in;
  for (double* v : {&finite.node_gbs, &finite.storage_write_gbs, &finite.storage_read_gbs,
                    &finite.storage_aggregate_gbs}) {
    if (!std::isfinite(*v)) *v = 1e6;
  }
  const double current = storage ? finite.storage_read_gbs : finite.node_gbs;
  // Utilisation with the relevant bandwidths set to x times the current ones (storage: write,
  // read and aggregate alike).
  auto utilisation = [&](double x) {
    ModelInputs m = finite;
    if (storage) {
      m.storage_write_gbs *= x;
      m.storage_read_gbs *= x;
      m.storage_aggregate_gbs *= x;
    } else {
      m.node_gbs *= x;
    }
    return m.step_s / (m.step_s + Exposed(m, Sum(Terms(m, delta, base, nullptr))));
  };
  double lo = 1e-9, hi = 1e6;
  if (utilisation(hi) < target) return kInf;
  if (utilisation(lo) >= target) return lo * current;
  // Bisection on a log scale to a relative precision of 1e-9.
  for (int i = 0; i < 200 && hi / lo > 1 + 1e-9; ++i) {
    const double mid = std::sqrt(lo * hi);
    (utilisation(mid) >= target ? hi : lo) = mid;
  }
  return hi * current;
}

// ----- calibration -----

namespace {

std::optional<double> Num(const nlohmann::json& j, const char* key) {
  if (!j.is_object() || !j.contains(key) || !j[key].is_number()) return std::nullopt;
  return j[key].get<double>();
}

std::optional<double> MedianOf(const std::vector<double>& v) {
  if (v.empty()) return std::nullopt;
  return Median(v);
}

const nlohmann::json* FindNamed(const nlohmann::json& list, const std::string& name) {
  if (!list.is_array()) return nullptr;
  for (const nlohmann::json& t : list) {
    if (t.is_object() && t.value("name", "") == name) return &t;
  }
  return nullptr;
}

// Visits every measured, published version of `t` with its ok replicas.
template <typename F>
void ForMeasured(const nlohmann::json& t, F f) {
  if (!t.contains("versions") || !t["versions"].is_array()) return;
  for (const nlohmann::json& v : t["versions"]) {
    if (!v.value("measured", false) || !v.value("published", false)) continue;
    std::vector<const nlohmann::json*> ok;
    if (v.contains("replicas") && v["replicas"].is_array()) {
      for (const nlohmann::json& r : v["replicas"]) {
        if (r.value("ok", false)) ok.push_back(&r);
      }
    }
    f(v, ok);
  }
}

double ReceiveS(const nlohmann::json& r) {
  return r.value("allocate_s", 0.0) + r.value("fetch_s", 0.0) + r.value("verify_s", 0.0) +
         r.value("apply_s", 0.0);
}

// Median over the measured versions of the slowest replica's `field` (replicas receive at the
// same time, and the model predicts the last of them); versions where it is 0 are left out.
std::optional<double> SlowestMedian(const nlohmann::json& t, const char* field) {
  std::vector<double> v;
  ForMeasured(t, [&](const nlohmann::json&, const std::vector<const nlohmann::json*>& ok) {
    double slowest = 0;
    for (const nlohmann::json* r : ok) slowest = std::max(slowest, r->value(field, 0.0));
    if (slowest > 0) v.push_back(slowest);
  });
  return MedianOf(v);
}

// Time from Publish returning to the slowest replica starting to receive: its ready time less
// the stall and its own receive; one value per measured version.
void Residuals(const nlohmann::json& t, std::vector<double>& out) {
  ForMeasured(t, [&](const nlohmann::json& v, const std::vector<const nlohmann::json*>& ok) {
    const nlohmann::json* slowest = nullptr;
    for (const nlohmann::json* r : ok) {
      if (slowest == nullptr || r->value("ready_s", 0.0) > slowest->value("ready_s", 0.0)) {
        slowest = r;
      }
    }
    if (slowest == nullptr) return;
    out.push_back(slowest->value("ready_s", 0.0) - v.value("stall_s", 0.0) - ReceiveS(*slowest));
  });
}

double WireOf(const nlohmann::json& t, double model_bytes) {
  const double w = t.value("wire_bytes_per_version", 0.0);
  return w > 0 ? w : model_bytes;
}

absl::StatusOr<Calibration> CalibrateFromRunImpl(const nlohmann::json& run,
                                                 const std::string& file) {
  if (!run.is_object() || !Num(run, "model_bytes") || !run.contains("transports") ||
      !run["transports"].is_array()) {
    return absl::InvalidArgumentError(
        file + ": not the JSON of `weightbus-bench run --json` (no model_bytes or transports)");
  }
  Calibration c;
  c.file = file;
  c.model_bytes = *Num(run, "model_bytes");
  c.subscribers = static_cast<int>(Num(run, "subscribers").value_or(1));
  if (!(c.model_bytes > 0) || c.subscribers < 1) {
    return absl::InvalidArgumentError(file + ": model_bytes and subscribers must be positive");
  }
  if (run.contains("config") && run["config"].contains("host")) {
    const nlohmann::json& h = run["config"]["host"];
    c.host = absl::StrFormat("%s %s %s, %d cores", h.value("system", "?"), h.value("release", "?"),
                             h.value("machine", "?"), h.value("cores", 0));
  }
  const double S = c.model_bytes;
  const int subs = c.subscribers;
  const nlohmann::json& ts = run["transports"];
  const nlohmann::json empty = nlohmann::json::array();
  const nlohmann::json& bs = run.contains("baselines") ? run["baselines"] : empty;
  auto set = [&c](const char* key, double value, std::string how) {
    if (value > 0 && std::isfinite(value)) c.figures[key] = {value, std::move(how)};
  };
  auto bound = [&c](const char* key, double value, std::string how) {
    if (value >= 0 && std::isfinite(value)) c.bound[key] = {value, std::move(how)};
  };

  for (const nlohmann::json& t : ts) {
    if (!t.is_object() || !t.contains("last_replica_s") || !t["last_replica_s"].is_object()) {
      continue;
    }
    Calibration::Measured m;
    m.name = t.value("name", "?");
    m.last_s = Num(t["last_replica_s"], "median").value_or(0);
    m.count = static_cast<int>(Num(t["last_replica_s"], "count").value_or(0));
    if (t.contains("stall_s") && t["stall_s"].is_object()) {
      m.stall_s = Num(t["stall_s"], "median").value_or(0);
    }
    if (m.count > 0) c.measured.push_back(m);
  }

  // Baselines.
  const nlohmann::json* memcpy_b = FindNamed(bs, "memcpy");
  const nlohmann::json* file_b = FindNamed(bs, "write+read");
  const nlohmann::json* perf_b = FindNamed(bs, "ucx_perftest");
  auto ran = [](const nlohmann::json* b) { return b != nullptr && b->value("ran", false); };
  const double memcpy_gbs = ran(memcpy_b) ? memcpy_b->value("rate_gbs", 0.0) : 0;
  double file_write_gbs = 0, file_read_gbs = 0;
  if (ran(file_b) && file_b->contains("raw")) {
    file_write_gbs = (*file_b)["raw"].value("write_gbs", 0.0);
    file_read_gbs = (*file_b)["raw"].value("read_gbs", 0.0);
  }
  const double perf_gbs = ran(perf_b) ? perf_b->value("rate_gbs", 0.0) : 0;

  const nlohmann::json* ucx = FindNamed(ts, "ucx");
  const nlohmann::json* disk = FindNamed(ts, "disk");

  // Network: the ucx transport's fetch, every subscriber pulling at once from the one host.
  if (std::optional<double> fetch = ucx ? SlowestMedian(*ucx, "fetch_s") : std::nullopt) {
    const double w = WireOf(*ucx, S);
    set("network-gbs", subs * w / *fetch / 1e9,
        absl::StrFormat("ucx: %d subscribers x %.1f MB / median slowest fetch %.1f ms "
                        "(concurrent pulls on one host)",
                        subs, w / 1e6, *fetch * 1e3));
  } else if (perf_gbs > 0) {
    set("network-gbs", perf_gbs, "ucx_perftest -t ucp_get, one pair on 127.0.0.1");
  }
  if (perf_gbs > 0) {
    bound("network-gbs", subs * perf_gbs,
          absl::StrFormat("%d subscribers x ucx_perftest's one-pair %.2f GB/s", subs, perf_gbs));
  }

  // Storage: write+fsync from the baseline, reads from the disk transport's subscribers.
  if (file_write_gbs > 0) {
    set("storage-write-gbs", file_write_gbs, "baseline write(2)+fsync of the model's bytes");
  } else if (disk != nullptr && c.figures.count("storage-write-gbs") == 0) {
    for (const Calibration::Measured& m : c.measured) {
      if (m.name == "disk" && m.stall_s > 0) {
        set("storage-write-gbs", WireOf(*disk, S) / m.stall_s / 1e9,
            "disk: bytes / median stall (write, fsync, commit)");
      }
    }
  }
  if (std::optional<double> fetch = disk ? SlowestMedian(*disk, "fetch_s") : std::nullopt) {
    const double w = WireOf(*disk, S);
    set("storage-read-gbs", subs * w / *fetch / 1e9,
        absl::StrFormat("disk: %d subscribers x %.1f MB / median slowest fetch %.1f ms "
                        "(concurrent reads)",
                        subs, w / 1e6, *fetch * 1e3));
  } else if (file_read_gbs > 0) {
    set("storage-read-gbs", file_read_gbs, "baseline pread of the file just written");
  }
  if (file_write_gbs > 0) bound("storage-write-gbs", file_write_gbs, "baseline write+fsync");
  if (file_read_gbs > 0) {
    bound("storage-read-gbs", subs * file_read_gbs,
          absl::StrFormat("%d subscribers x the baseline's one-reader pread rate", subs));
  }
  for (auto* figures : {&c.figures, &c.bound}) {
    auto w = figures->find("storage-write-gbs"), r = figures->find("storage-read-gbs");
    if (w != figures->end() && r != figures->end()) {
      (*figures)["storage-aggregate-gbs"] = {std::max(w->second.value, r->second.value),
                                             "one device on one host: the larger of write "
                                             "and read"};
    }
  }

  // Copies.
  if (memcpy_gbs > 0) {
    set("stage-gbs", memcpy_gbs, "baseline memcpy (the ucx staging copy is one)");
    bound("stage-gbs", memcpy_gbs, "baseline memcpy");
    bound("apply-gbs", memcpy_gbs, "baseline memcpy");
  } else if (ucx != nullptr) {
    for (const Calibration::Measured& m : c.measured) {
      if (m.name == "ucx" && m.stall_s > 0) {
        set("stage-gbs", WireOf(*ucx, S) / m.stall_s / 1e9, "ucx: bytes / median stall");
      }
    }
  }
  {
    std::vector<double> apply;
    for (const nlohmann::json& t : ts) {
      if (std::optional<double> a = SlowestMedian(t, "apply_s")) apply.push_back(*a);
    }
    if (std::optional<double> a = MedianOf(apply)) {
      set("apply-gbs", S / *a / 1e9,
          absl::StrFormat("model bytes / slowest replica's copy-out %.1f ms (median over "
                          "versions and transports)",
                          *a * 1e3));
    }
  }

  // Latencies: what is left of the slowest replica's time once the stall and its receive are
  // subtracted (median over versions; never below zero).
  for (auto [key, names] :
       {std::pair{"latency-s", std::vector<std::string>{"ucx", "delta+ucx"}},
        std::pair{"storage-latency-s", std::vector<std::string>{"disk", "delta+disk"}}}) {
    std::vector<double> residual;
    for (const std::string& n : names) {
      if (const nlohmann::json* t = FindNamed(ts, n)) Residuals(*t, residual);
    }
    if (residual.empty()) continue;
    const double r = Median(residual);
    c.figures[key] = {std::max(0.0, r),
                      absl::StrFormat("%s: median over %d versions of last-replica time - "
                                      "stall - its receive (%.2f ms%s)",
                                      absl::StrJoin(names, ", "), residual.size(), r * 1e3,
                                      r < 0 ? ", counted as 0" : "")};
    bound(key, 0, "none");
  }

  // The delta layer.
  for (const char* name : {"delta+ucx", "delta+disk"}) {
    const nlohmann::json* t = FindNamed(ts, name);
    if (t == nullptr) continue;
    const double w = t->value("wire_bytes_per_version", 0.0);
    if (w > 0 && c.figures.count("delta-ratio") == 0) {
      set("delta-ratio", S / w,
          absl::StrFormat("%s: model bytes / median wire bytes %.3f MB of the measured (delta) "
                          "versions",
                          name, w / 1e6));
    }
    if (c.figures.count("keyframe-ratio") == 0 && t->contains("versions")) {
      for (const nlohmann::json& v : (*t)["versions"]) {
        if (v.value("version", 0) == 1 && v.value("published", false) &&
            v.value("wire_bytes", 0.0) > 0) {
          set("keyframe-ratio", S / v.value("wire_bytes", 0.0),
              absl::StrFormat("%s: model bytes / wire bytes of version 1 (a keyframe)", name));
        }
      }
    }
  }
  {
    std::vector<double> enc, dec;
    for (const char* name : {"delta+ucx", "delta+disk"}) {
      const nlohmann::json* t = FindNamed(ts, name);
      if (t == nullptr) continue;
      ForMeasured(*t, [&](const nlohmann::json& v, const std::vector<const nlohmann::json*>& ok) {
        if (v.value("encode_s", 0.0) > 0) enc.push_back(v.value("encode_s", 0.0));
        double slowest = 0;
        for (const nlohmann::json* r : ok) slowest = std::max(slowest, r->value("decode_s", 0.0));
        if (slowest > 0) dec.push_back(slowest);
      });
    }
    if (std::optional<double> e = MedianOf(enc)) {
      set("encode-gbs", S / *e / 1e9,
          absl::StrFormat("delta publishers: model bytes / median encode %.1f ms", *e * 1e3));
    }
    if (std::optional<double> d = MedianOf(dec)) {
      set("decode-gbs", subs * S / *d / 1e9,
          absl::StrFormat("delta subscribers: %d x model bytes / slowest replica's decode %.1f ms "
                          "(median; concurrent on one host)",
                          subs, *d * 1e3));
    }
  }
  if (run.contains("config") && run["config"].contains("settings") &&
      run["config"]["settings"].is_array()) {
    for (const nlohmann::json& s : run["config"]["settings"]) {
      int k = 0;
      if (s.is_string() && absl::StartsWith(s.get<std::string>(), "keyframe_interval=") &&
          absl::SimpleAtoi(s.get<std::string>().substr(18), &k) && k >= 0) {
        c.figures["keyframe-interval"] = {double(k), "the run's --set keyframe_interval"};
      }
    }
  }
  for (const char* key :
       {"delta-ratio", "keyframe-ratio", "keyframe-interval", "encode-gbs", "decode-gbs"}) {
    if (auto it = c.figures.find(key); it != c.figures.end()) c.bound[key] = it->second;
  }
  return c;
}

}  // namespace

absl::StatusOr<Calibration> CalibrateFromRun(const nlohmann::json& run, const std::string& file) {
  try {
    return CalibrateFromRunImpl(run, file);
  } catch (const nlohmann::json::exception& e) {
    // A field of the wrong type (the reader asks for numbers, strings and arrays where the
    // run writes them).
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: not the JSON `weightbus-bench run --json` writes: %s", file, e.what()));
  }
}

absl::StatusOr<Calibration> ReadCalibration(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError("cannot read " + path);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded()) return absl::InvalidArgumentError(path + ": not valid JSON");
  return CalibrateFromRun(j, path);
}

bool SetInput(ModelInputs& in, const std::string& key, double value) {
  static const auto* doubles = new std::map<std::string, double ModelInputs::*>{
      {"model-bytes", &ModelInputs::model_bytes},
      {"network-gbs", &ModelInputs::node_gbs},
      {"storage-write-gbs", &ModelInputs::storage_write_gbs},
      {"storage-read-gbs", &ModelInputs::storage_read_gbs},
      {"storage-aggregate-gbs", &ModelInputs::storage_aggregate_gbs},
      {"d2h-gbs", &ModelInputs::d2h_gbs},
      {"stage-gbs", &ModelInputs::stage_gbs},
      {"apply-gbs", &ModelInputs::apply_gbs},
      {"latency-s", &ModelInputs::net_latency_s},
      {"storage-latency-s", &ModelInputs::storage_latency_s},
      {"step-s", &ModelInputs::step_s},
      {"overlap", &ModelInputs::overlap},
      {"gpu-price", &ModelInputs::gpu_price},
      {"delta-ratio", &ModelInputs::delta_ratio},
      {"keyframe-ratio", &ModelInputs::keyframe_ratio},
      {"encode-gbs", &ModelInputs::encode_gbs},
      {"decode-gbs", &ModelInputs::decode_gbs},
  };
  static const auto* ints = new std::map<std::string, int ModelInputs::*>{
      {"trainer-gpus", &ModelInputs::trainer_gpus},
      {"replica-gpus", &ModelInputs::replica_gpus},
      {"gpus-per-node", &ModelInputs::gpus_per_node},
      {"gpus-per-replica", &ModelInputs::gpus_per_replica},
      {"broadcast-roots", &ModelInputs::broadcast_roots},
      {"publishers", &ModelInputs::publishers},
      {"nics-per-node", &ModelInputs::nics_per_node},
      {"keyframe-interval", &ModelInputs::keyframe_interval},
  };
  if (auto it = doubles->find(key); it != doubles->end()) {
    in.*(it->second) = value;
    return true;
  }
  if (auto it = ints->find(key); it != ints->end()) {
    in.*(it->second) = static_cast<int>(value);
    return true;
  }
  return false;
}

ModelInputs ThisMachine(ModelInputs in, const Calibration& c) {
  in.model_bytes = c.model_bytes;
  in.trainer_gpus = 1;
  in.replica_gpus = c.subscribers;
  in.gpus_per_node = c.subscribers;
  in.gpus_per_replica = 1;
  in.broadcast_roots = 1;
  in.publishers = 0;
  in.nics_per_node = 1;  // loopback: one path
  in.d2h_gbs = kInf;
  in.overlap = 0;
  in.keyframe_interval = 0;
  return in;
}

// ----- tables -----

namespace {

// Removes the spaces that empty cells leave at the ends of lines.
std::string StripLineEnds(const std::string& text) {
  std::string out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    absl::StrAppend(&out, absl::StripTrailingAsciiWhitespace(line), "\n");
  }
  out.pop_back();  // the split's last, empty piece
  return out;
}

std::string Gbs(double v, int width) {
  if (std::isinf(v)) return absl::StrFormat("%*s", width, "never");
  if (std::isnan(v)) return absl::StrFormat("%*s", width, "-");
  return absl::StrFormat("%*.*f", width, v < 10 ? 2 : 1, v);
}

}  // namespace

std::string FormatModelTable(const std::vector<Estimate>& estimates, bool label_publishers) {
  std::string out;
  // "delta+disk/256" needs 15 characters; the plain names 11.
  const int w = label_publishers ? 15 : 11;
  constexpr char kHead[] = "# %-*s %10s %9s %9s %9s %7s %9s %9s %10s %9s %9s  %s\n";
  absl::StrAppendFormat(&out, kHead, w, label_publishers ? "transport/src" : "transport", "wire",
                        "stall", "transfer", "exposed", "util", "trainer", "fleet", "fleet",
                        "need for", "need for", "bandwidth");
  absl::StrAppendFormat(&out, kHead, w, "", "per ver", "", "", "per step", "", "idle/1k", "idle/1k",
                        "cost/1k", "90%", "99%", "of");
  absl::StrAppendFormat(&out, kHead, w, "", "(MB)", "(s)", "(s)", "(s)", "(%)", "(GPU-h)",
                        "(GPU-h)", "($)", "(GB/s)", "(GB/s)", "");
  for (const Estimate& e : estimates) {
    const std::string name =
        label_publishers ? absl::StrFormat("%s/%d", e.transport, e.publishers) : e.transport;
    absl::StrAppendFormat(
        &out, "  %-*s %10.1f %9.3f %9.3f %9.3f %7.2f %9.2f %9.2f %10.2f %s %s  %s\n", w, name,
        e.wire_bytes / 1e6, e.stall_s, e.transfer_s, e.exposed_s, 100 * e.utilisation,
        e.trainer_idle_gpu_h, e.fleet_idle_gpu_h, e.fleet_idle_dollars, Gbs(e.gbs_for_90, 9),
        Gbs(e.gbs_for_99, 9), e.bandwidth_of == "storage" ? "storage" : "net");
  }
  return StripLineEnds(out);
}

std::string FormatTermsTable(const std::vector<Estimate>& estimates) {
  // Columns: every term some estimate has, in the order terms happen.
  static const char* const kOrder[] = {"gather",    "d2h",  "encode", "stage",  "write", "latency",
                                       "broadcast", "pull", "read",   "decode", "apply"};
  std::vector<std::string> columns;
  for (const char* name : kOrder) {
    for (const Estimate& e : estimates) {
      if (std::any_of(e.terms.begin(), e.terms.end(),
                      [&](const Term& t) { return t.name == name; })) {
        columns.push_back(name);
        break;
      }
    }
  }
  std::string out = absl::StrFormat("# %-15s", "transport/src");
  for (const std::string& c : columns) absl::StrAppendFormat(&out, " %9s", c);
  absl::StrAppendFormat(&out, " %9s %9s\n", "stall", "last");
  out += absl::StrFormat("# %-15s", "");
  for (size_t i = 0; i < columns.size() + 2; ++i) absl::StrAppendFormat(&out, " %9s", "(s)");
  out += "\n";
  for (const Estimate& e : estimates) {
    absl::StrAppendFormat(&out, "  %-15s", absl::StrFormat("%s/%d", e.transport, e.publishers));
    for (const std::string& c : columns) {
      std::string cell = "-";
      for (const Term& t : e.terms) {
        if (t.name == c) cell = absl::StrFormat("%.3f%s", t.seconds, t.stalls_trainer ? "*" : "");
      }
      absl::StrAppendFormat(&out, " %9s", cell);
    }
    absl::StrAppendFormat(&out, " %9.3f %9.3f\n", e.stall_s, e.transfer_s);
  }
  return StripLineEnds(out);
}

std::string FormatComparison(const std::vector<Calibration::Measured>& measured,
                             const std::vector<Estimate>& predicted,
                             const std::vector<Estimate>& bound) {
  auto find = [](const std::vector<Estimate>& v, const std::string& name) -> const Estimate* {
    for (const Estimate& e : v) {
      if (e.transport == name) return &e;
    }
    return nullptr;
  };
  auto err = [](double pred, double meas) {
    return meas > 0 ? absl::StrFormat("%+8.1f", 100 * (pred - meas) / meas)
                    : absl::StrFormat("%8s", "-");
  };
  std::string out;
  constexpr char kHead[] = "# %-11s %9s %9s %8s %9s %9s %8s %9s %5s\n";
  absl::StrAppendFormat(&out, kHead, "transport", "stall", "stall", "stall", "last", "last", "last",
                        "bound", "vers");
  absl::StrAppendFormat(&out, kHead, "", "measured", "model", "error", "measured", "model", "error",
                        "last", "");
  absl::StrAppendFormat(&out, kHead, "", "(ms)", "(ms)", "(%)", "(ms)", "(ms)", "(%)", "(ms)", "");
  for (const Calibration::Measured& m : measured) {
    const Estimate* p = find(predicted, m.name);
    const Estimate* b = find(bound, m.name);
    if (p == nullptr) continue;
    absl::StrAppendFormat(
        &out, "  %-11s %9.2f %9.2f %s %9.2f %9.2f %s %s %5d\n", m.name, m.stall_s * 1e3,
        p->stall_s * 1e3, err(p->stall_s, m.stall_s), m.last_s * 1e3, p->transfer_s * 1e3,
        err(p->transfer_s, m.last_s),
        b != nullptr ? absl::StrFormat("%9.2f", b->transfer_s * 1e3) : absl::StrFormat("%9s", "-"),
        m.count);
  }
  return StripLineEnds(out);
}

}  // namespace weightbus::bench

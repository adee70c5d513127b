// SPDX-License-Identifier: Apache-2.0
// `weightbus-bench model`: the analytic cost model (wbbench/model.h) as a command: inputs from
// flags, presets, a checkpoint's headers or a run's JSON; a banner saying where each came from,
// then one row per transport in the style of nccl-tests. docs/COST_MODEL.md explains it.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "wbbench/common.h"
#include "wbbench/model.h"
#include "wbbench/subcommands.h"
#include "weightbus/flags.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::bench {
namespace {

constexpr char kFooter[] = R"(
The analytic cost of syncing weights from a trainer to its inference replicas once per training
step, per transport (disk, ucx, nccl, delta+disk, delta+ucx): trainer stall, time until the last
replica holds the version, exposed time per step, utilisation, idle GPU-hours and dollars per
1,000 steps, and the bandwidth needed for 90% and 99% utilisation. Formulas and assumptions:
docs/COST_MODEL.md. Ends with "# OK"; exit status 2 for a usage error. A flag not given takes the
calibration's figure (--calibrate), else the default in parentheses.)";

// Every flag: name, value name ("" for a switch), group, help. Numbers are checked as they are
// parsed (kNumber: a number, "inf" for no copy; kCount: a non-negative integer).
enum class FlagKind { kText, kNumber, kCount, kSwitch };
struct FlagDef {
  const char* name;
  FlagKind kind;
  const char* value_name;
  const char* group;
  const char* help;
};
constexpr const char* kSize = "model size (default 7B bf16)";
constexpr const char* kCluster = "cluster";
constexpr const char* kNet = "network and storage (presets: --list-presets)";
constexpr const char* kCopies = "copies through host memory (weightbus transports; inf: no copy)";
constexpr const char* kTraining = "training";
constexpr const char* kDelta = "delta layer";
constexpr const char* kMeasured = "measured figures";
constexpr const char* kOutput = "output";
constexpr FlagDef kFlags[] = {
    {"params", FlagKind::kText, "N", kSize, "parameter count: 7B, 70e9, 1T, 1.5M"},
    {"dtype", FlagKind::kText, "NAME", kSize,
     "bytes per parameter as sent: fp32, bf16, fp16, fp8, int8, int4 (bf16)"},
    {"checkpoint", FlagKind::kText, "PATH", kSize,
     "sum the tensor bytes of a safetensors file or directory, or a llama2.c .bin (with --dtype: "
     "its parameter count x that dtype)"},
    {"trainer-gpus", FlagKind::kCount, "N", kCluster, "GPUs of the trainer (8)"},
    {"replica-gpus", FlagKind::kCount, "N", kCluster, "inference GPUs, all instances together (8)"},
    {"gpus-per-node", FlagKind::kCount, "N", kCluster, "(8)"},
    {"gpus-per-replica", FlagKind::kCount, "N", kCluster,
     "GPUs of one inference instance, TP x PP x EP (8)"},
    {"broadcast-roots", FlagKind::kCount, "N", kCluster,
     "nccl: trainer GPUs that broadcast, each its share (1)"},
    {"publishers", FlagKind::kText, "LIST", kCluster,
     "disk, ucx, delta+: trainer GPUs that publish, each its share (every trainer GPU; 1: one "
     "source, which first gathers the shards); several, comma-separated, side by side with where "
     "the time goes"},
    {"fabric", FlagKind::kText, "NAME", kNet,
     "network preset (ib-ndr); --nics-per-node, --nic-gbs override parts"},
    {"nics-per-node", FlagKind::kCount, "N", kNet, "NICs per node (1 to 1024; the preset's)"},
    {"nic-gbs", FlagKind::kNumber, "X", kNet, "GB/s per NIC and direction (the preset's)"},
    {"network-gbs", FlagKind::kNumber, "X", kNet,
     "network GB/s per node and direction, instead of a preset (a broadcast root sends through "
     "one of --nics-per-node NICs)"},
    {"latency-s", FlagKind::kNumber, "X", kNet,
     "ucx/nccl: from Publish returning to the bytes moving (0.002)"},
    {"storage", FlagKind::kText, "NAME", kNet, "storage preset for disk:// (shared-fs)"},
    {"storage-gbs", FlagKind::kNumber, "X", kNet,
     "per-client write and read GB/s, instead of the preset's"},
    {"storage-write-gbs", FlagKind::kNumber, "X", kNet, "per-client write GB/s"},
    {"storage-read-gbs", FlagKind::kNumber, "X", kNet, "per-client read GB/s"},
    {"storage-aggregate-gbs", FlagKind::kNumber, "X", kNet, "GB/s of all clients together"},
    {"storage-latency-s", FlagKind::kNumber, "X", kNet, "from commit to readable"},
    {"d2h-gbs", FlagKind::kNumber, "X", kCopies, "per trainer GPU, its shard to host memory (50)"},
    {"stage-gbs", FlagKind::kNumber, "X", kCopies,
     "ucx, per trainer node, into registered staging memory (100)"},
    {"apply-gbs", FlagKind::kNumber, "X", kCopies,
     "per replica GPU, received bytes into its parameters (50)"},
    {"step-s", FlagKind::kNumber, "X", kTraining, "training step without sync, seconds (60)"},
    {"overlap", FlagKind::kNumber, "X", kTraining,
     "fraction of a step the transfer may hide behind, 0..1 (0: lockstep)"},
    {"gpu-price", FlagKind::kNumber, "X", kTraining, "dollars per GPU-hour (2.0)"},
    {"delta-ratio", FlagKind::kNumber, "X", kDelta, "full bytes / bytes of a delta (100)"},
    {"keyframe-interval", FlagKind::kCount, "K", kDelta,
     "a keyframe every K versions, 0: only the first (50)"},
    {"keyframe-ratio", FlagKind::kNumber, "X", kDelta, "full bytes / bytes of a keyframe (1.5)"},
    {"encode-gbs", FlagKind::kNumber, "X", kDelta, "per trainer node (20)"},
    {"decode-gbs", FlagKind::kNumber, "X", kDelta, "per replica node (40)"},
    {"calibrate", FlagKind::kText, "FILE", kMeasured,
     "take what `weightbus-bench run --json FILE` measured (model size, network, storage, "
     "copies, latencies, delta ratio, codec rates); flags and named presets still win"},
    {"compare", FlagKind::kSwitch, "", kMeasured,
     "with --calibrate: model this machine as the run measured it (1 trainer, the run's "
     "subscribers as 1-GPU replicas on one host) and print the prediction next to the "
     "measurement, with the relative error"},
    {"transports", FlagKind::kText, "LIST", kOutput,
     "comma-separated (default: the five above; delta+nccl is known too)"},
    {"json", FlagKind::kText, "FILE", kOutput, "every input (with its origin) and figure"},
    {"list-presets", FlagKind::kSwitch, "", kOutput,
     "the fabric and storage presets with their sources"},
};

// The flags as parsed: each one's text and whether it was given.
class ModelFlags {
 public:
  void AddTo(tools::Command& app) {
    for (const FlagDef& f : kFlags) {
      if (f.kind == FlagKind::kSwitch) {
        flags_.emplace(f.name, app.AddSwitch(f.name, &switches_[f.name], f.help).Group(f.group));
        continue;
      }
      tools::Flag o = app.Add(f.name, &text_[f.name], f.help).TypeName(f.value_name).Group(f.group);
      if (f.kind == FlagKind::kNumber) o.Check(NumberText);
      if (f.kind == FlagKind::kCount) {
        o.Check([](const std::string& text) {
          return tools::UnsignedCheck(text, std::numeric_limits<uint64_t>::max());
        });
      }
      flags_.emplace(f.name, o);
    }
  }
  bool Has(const std::string& name) const { return flags_.at(name).given(); }
  std::optional<std::string> Get(const std::string& name) const {
    if (!Has(name)) return std::nullopt;
    return text_.at(name);
  }
  // A kCount flag (digits only: checked when parsed).
  uint64_t Count(const std::string& name) const {
    uint64_t v = 0;
    if (!absl::SimpleAtoi(text_.at(name), &v)) Die("--" + name + ": " + text_.at(name));
    return v;
  }

 private:
  // A number (also "inf"), not NaN.
  static std::string NumberText(const std::string& text) {
    double v = 0;
    if (absl::SimpleAtod(text, &v) && !std::isnan(v)) return "";
    return absl::StrFormat("\"%s\" is not a number", text);
  }

  std::map<std::string, std::string> text_;
  std::map<std::string, bool> switches_;  // the switches' values (given() says the same)
  std::map<std::string, tools::Flag> flags_;
};

[[noreturn]] void Usage(const std::string& message) { Die(message + " (see --help)"); }

double ParseDouble(const std::string& flag, const std::string& text) {
  double v = 0;
  if (!absl::SimpleAtod(text, &v) || std::isnan(v)) {
    Usage(absl::StrFormat("--%s: \"%s\" is not a number", flag, text));
  }
  return v;
}

// The inputs and where each came from.
class Inputs {
 public:
  ModelInputs in;
  std::map<std::string, std::string> origin;

  // Sets an input by its flag name (SetInput's keys).
  void Set(const std::string& key, double v, const std::string& from) {
    if (!SetInput(in, key, v)) Die("internal: unknown model input " + key);
    origin[key] = from;
  }
  std::string From(const std::string& key) const {
    auto it = origin.find(key);
    return it == origin.end() ? "default" : it->second;
  }
};

// 1.4e10 -> "14.00 GB" (decimal units, as the table's).
std::string DecimalBytes(double b) {
  if (b >= 1e12) return absl::StrFormat("%.2f TB", b / 1e12);
  if (b >= 1e9) return absl::StrFormat("%.2f GB", b / 1e9);
  if (b >= 1e6) return absl::StrFormat("%.2f MB", b / 1e6);
  return absl::StrFormat("%.2f kB", b / 1e3);
}

std::string Num(double v) {
  if (std::isinf(v)) return "inf";
  return absl::StrFormat("%.4g", v);
}

std::string ListPresets() {
  std::string out = "# fabrics (--fabric): GB/s per link and direction x links per node\n";
  absl::StrAppendFormat(&out, "# %-10s %8s %6s %9s  %s\n", "name", "link", "links", "per node",
                        "what; source");
  for (const FabricPreset& f : FabricPresets()) {
    absl::StrAppendFormat(&out, "  %-10s %8.3g %6d %9.4g  %s; %s\n", f.name, f.link_gbs,
                          f.links_per_node, f.link_gbs * f.links_per_node, f.what, f.source);
  }
  out +=
      "#\n# storage (--storage): GB/s per client (write, read), in total; commit-to-read "
      "latency\n";
  absl::StrAppendFormat(&out, "# %-10s %6s %6s %7s %8s  %s\n", "name", "write", "read", "total",
                        "latency", "what; source");
  for (const StoragePreset& s : StoragePresets()) {
    absl::StrAppendFormat(&out, "  %-10s %6.3g %6.3g %7.4g %7.3fs  %s; %s\n", s.name, s.write_gbs,
                          s.read_gbs, s.aggregate_gbs, s.latency_s, s.what, s.source);
  }
  return out;
}

nlohmann::ordered_json EstimateJson(const Estimate& e) {
  nlohmann::ordered_json terms = nlohmann::ordered_json::object();
  for (const Term& t : e.terms) terms[t.name] = t.seconds;
  auto finite = [](double v) -> nlohmann::ordered_json {
    if (std::isfinite(v)) return v;
    return nullptr;  // no bandwidth is enough
  };
  return {{"transport", e.transport},
          {"publishers", e.publishers},
          {"wire_bytes_per_version", e.wire_bytes},
          {"terms_s", terms},
          {"stall_s", e.stall_s},
          {"transfer_s", e.transfer_s},
          {"exposed_s", e.exposed_s},
          {"utilisation", e.utilisation},
          {"trainer_idle_gpu_hours_per_1k_steps", e.trainer_idle_gpu_h},
          {"fleet_idle_gpu_hours_per_1k_steps", e.fleet_idle_gpu_h},
          {"trainer_idle_dollars_per_1k_steps", e.trainer_idle_dollars},
          {"fleet_idle_dollars_per_1k_steps", e.fleet_idle_dollars},
          {"gbs_for_90", finite(e.gbs_for_90)},
          {"gbs_for_99", finite(e.gbs_for_99)},
          {"bandwidth_of", e.bandwidth_of}};
}

int Model(const ModelFlags& args) {
  std::vector<std::string> doubles, ints;
  for (const FlagDef& f : kFlags) {
    if (f.kind == FlagKind::kNumber) doubles.push_back(f.name);
    if (f.kind == FlagKind::kCount) ints.push_back(f.name);
  }
  if (args.Has("list-presets")) {
    std::fputs(ListPresets().c_str(), stdout);
    std::fputs("# OK\n", stdout);
    return 0;
  }

  Inputs x;
  std::optional<Calibration> cal;
  const bool compare = args.Has("compare");
  if (compare && !args.Has("calibrate")) Usage("--compare needs --calibrate FILE (a run's JSON)");

  // 1. Calibration (lowest precedence after the defaults).
  if (std::optional<std::string> file = args.Get("calibrate")) {
    cal = OrDie(ReadCalibration(*file));
    for (const auto& [key, f] : cal->figures) x.Set(key, f.value, "calibrated");
  }

  // 2. The model's size.
  std::string model_what;
  std::optional<double> bpp;
  if (auto d = args.Get("dtype")) {
    bpp = BytesPerParam(*d);
    if (!bpp) Usage("--dtype: unknown dtype \"" + *d + "\" (fp32, bf16, fp16, fp8, int8, int4)");
  }
  const std::string dtype = args.Get("dtype").value_or("bf16");
  if (args.Has("params") && args.Has("checkpoint")) {
    Usage("give --params or --checkpoint, not both");
  }
  if (auto p = args.Get("params")) {
    const double n = OrDie(ParseParamCount(*p));
    const double b = bpp.value_or(2);
    x.Set("model-bytes", n * b,
          absl::StrFormat("--params %s, %s %s", *p, args.Has("dtype") ? "--dtype" : "default dtype",
                          dtype));
    model_what = absl::StrFormat("%.4g parameters x %g B (%s)", n, b, dtype);
  } else if (auto path = args.Get("checkpoint")) {
    const CheckpointSize s = OrDie(MeasureCheckpoint(*path));
    if (bpp) {
      x.Set("model-bytes", s.parameters * *bpp, "--checkpoint, --dtype " + dtype);
      model_what =
          absl::StrFormat("%.4g parameters (%s) x %g B (%s)", s.parameters, s.what, *bpp, dtype);
    } else {
      x.Set("model-bytes", s.bytes, "--checkpoint");
      model_what =
          absl::StrFormat("%.4g parameters, %s as stored (%s)", s.parameters, s.dtype, s.what);
    }
  } else if (cal) {
    x.Set("model-bytes", cal->model_bytes, "calibrated");
    model_what = "the run's model (bf16)";
    if (bpp) Usage("--dtype needs --params or --checkpoint (the run's model is bf16)");
  } else {
    x.Set("model-bytes", 7e9 * bpp.value_or(2),
          args.Has("dtype") ? "default 7B, --dtype" : "default");
    model_what = absl::StrFormat("7e+09 parameters x %g B (%s)", bpp.value_or(2), dtype);
  }

  // 3. Presets: named ones beat calibration; the defaults only fill what calibration left.
  std::vector<std::string> presets;  // what each preset used is, for the banner
  const bool fabric_named = args.Has("fabric");
  if (fabric_named || !cal || cal->figures.count("network-gbs") == 0 || args.Has("nics-per-node") ||
      args.Has("nic-gbs")) {
    const std::string name = args.Get("fabric").value_or("ib-ndr");
    const FabricPreset* f = FindFabric(name);
    if (f == nullptr) Usage("--fabric: no preset \"" + name + "\" (--list-presets)");
    double link = f->link_gbs;
    int links = f->links_per_node;
    std::string from = (fabric_named ? "preset " : "default preset ") + name;
    if (auto v = args.Get("nic-gbs")) {
      link = ParseDouble("nic-gbs", *v);
      from += ", --nic-gbs";
    }
    std::string nics_from = from;
    if (args.Has("nics-per-node")) {
      links = static_cast<int>(std::min<uint64_t>(args.Count("nics-per-node"), 1u << 20));
      if (links < 1 || links > 1024) Usage("--nics-per-node must be in 1..1024");
      from += ", --nics-per-node";
      nics_from = "--nics-per-node";
    }
    x.Set("network-gbs", link * links, from);
    presets.push_back(absl::StrFormat("%s = %d x %g GB/s, %s", name, links, link, f->what));
    x.Set("nics-per-node", links, nics_from);
  }
  const bool storage_named = args.Has("storage");
  if (storage_named || !cal || cal->figures.count("storage-read-gbs") == 0) {
    const std::string name = args.Get("storage").value_or("shared-fs");
    const StoragePreset* s = FindStorage(name);
    if (s == nullptr) Usage("--storage: no preset \"" + name + "\" (--list-presets)");
    const std::string from = (storage_named ? "preset " : "default preset ") + name;
    presets.push_back(absl::StrFormat("%s = %s", name, s->what));
    x.Set("storage-write-gbs", s->write_gbs, from);
    x.Set("storage-read-gbs", s->read_gbs, from);
    x.Set("storage-aggregate-gbs", s->aggregate_gbs, from);
    if (storage_named || !cal || cal->figures.count("storage-latency-s") == 0) {
      x.Set("storage-latency-s", s->latency_s, from);
    }
  }

  // 4. Explicit flags win.
  if (auto v = args.Get("storage-gbs")) {
    const double g = ParseDouble("storage-gbs", *v);
    x.Set("storage-write-gbs", g, "--storage-gbs");
    x.Set("storage-read-gbs", g, "--storage-gbs");
  }
  for (const std::string& d : doubles) {
    if (d == "nic-gbs" || d == "storage-gbs") continue;
    if (auto v = args.Get(d)) {
      x.Set(d, ParseDouble(d, *v), "--" + d);
    }
  }
  for (const std::string& i : ints) {
    if (i == "nics-per-node" || !args.Has(i)) continue;
    const uint64_t v = args.Count(i);
    if (v > 1'000'000) Usage(absl::StrFormat("--%s: %d is too large", i, v));
    x.Set(i, static_cast<int>(v), "--" + i);
  }

  // 5. This machine as the run measured it.
  ModelInputs bound_inputs;
  if (compare) {
    for (const char* shape : {"trainer-gpus", "replica-gpus", "gpus-per-node", "gpus-per-replica",
                              "broadcast-roots", "nics-per-node", "fabric", "params", "checkpoint",
                              "dtype", "overlap", "d2h-gbs", "keyframe-interval"}) {
      if (args.Has(shape)) {
        Usage(
            absl::StrFormat("--compare models this machine as the run measured it; it takes "
                            "no --%s",
                            shape));
      }
    }
    x.in = ThisMachine(x.in, *cal);
    for (const char* key :
         {"trainer-gpus", "replica-gpus", "gpus-per-node", "gpus-per-replica", "broadcast-roots",
          "nics-per-node", "d2h-gbs", "overlap", "keyframe-interval"}) {
      x.origin[key] = "--compare";
    }
    bound_inputs = x.in;
    for (const auto& [key, f] : cal->bound) SetInput(bound_inputs, key, f.value);
  }
  OrDie(ValidateInputs(x.in));

  std::vector<std::string> transports = ModelTransports();
  if (compare) {
    // This machine: the transports the run measured.
    transports.clear();
    for (const Calibration::Measured& m : cal->measured) {
      for (const std::string& k : ModelTransports()) {
        if (k == m.name) transports.push_back(k);
      }
    }
    if (transports.empty()) Die(cal->file + ": the run measured no transport the model knows");
  }
  if (auto list = args.Get("transports")) {
    // EstimateTransport refuses unknown names.
    transports = std::vector<std::string>(absl::StrSplit(*list, ','));
  }
  // Sources: one model per --publishers value (0: every trainer GPU).
  std::vector<int> publishers = {x.in.publishers};
  if (auto list = args.Get("publishers")) {
    if (compare)
      Usage("--compare models this machine as the run measured it; it takes no --publishers");
    publishers.clear();
    for (absl::string_view item : absl::StrSplit(*list, ',')) {
      int v = 0;
      if (!absl::SimpleAtoi(item, &v) || v < 1 || v > x.in.trainer_gpus) {
        Usage(absl::StrFormat("--publishers: \"%s\" is not a count in [1, %d] (the trainer GPUs)",
                              std::string(item), x.in.trainer_gpus));
      }
      publishers.push_back(v);
    }
    x.origin["publishers"] = "--publishers";
  }
  std::vector<Estimate> estimates, bound;
  for (size_t i = 0; i < publishers.size(); ++i) {
    ModelInputs with = x.in;
    with.publishers = publishers[i];
    for (const std::string& t : transports) {
      if (i > 0 && t == "nccl") continue;  // its sources are its broadcast roots: one row
      estimates.push_back(OrDie(EstimateTransport(with, t)));
      if (compare) bound.push_back(OrDie(EstimateTransport(bound_inputs, t)));
    }
  }
  const bool side_by_side = args.Has("publishers");

  // Banner: every input with where it came from.
  const ModelInputs& in = x.in;
  const Shape s = ShapeOf(in);
  auto kv = [&x](const std::string& key, const std::string& text) {
    return absl::StrFormat("%s [%s]", text, x.From(key));
  };
  auto plural = [](int n, const char* what) {
    return absl::StrFormat("%d %s%s", n, what, n == 1 ? "" : "s");
  };
  std::string out;
  absl::StrAppendFormat(&out,
                        "# weightbus-bench model (weightbus %s): the cost of syncing weights "
                        "each training step, per transport (docs/COST_MODEL.md)\n",
                        std::string(LibraryVersion()));
  if (compare) {
    absl::StrAppendFormat(&out,
                          "# this machine as %s measured it (%s): 1 trainer process, %d "
                          "subscriber processes as 1-GPU replicas on the same host\n",
                          cal->file, cal->host, cal->subscribers);
  }
  absl::StrAppendFormat(
      &out, "# model: %s\n",
      kv("model-bytes",
         absl::StrFormat("%s per version = %s", DecimalBytes(in.model_bytes), model_what)));
  absl::StrAppendFormat(
      &out, "# cluster: %s, %s, %s, %s, %s\n",
      kv("trainer-gpus", plural(in.trainer_gpus, "trainer GPU")),
      kv("replica-gpus", plural(in.replica_gpus, "replica GPU")),
      kv("gpus-per-node", absl::StrFormat("%d GPUs per node", in.gpus_per_node)),
      kv("gpus-per-replica", absl::StrFormat("%d GPU%s per replica", in.gpus_per_replica,
                                             in.gpus_per_replica == 1 ? "" : "s")),
      kv("broadcast-roots", plural(in.broadcast_roots, "nccl broadcast root")));
  absl::StrAppendFormat(&out, "#   -> %s, %s, %s of %s\n", plural(s.trainer_nodes, "trainer node"),
                        plural(s.replica_nodes, "replica node"), plural(s.instances, "instance"),
                        plural(s.nodes_per_instance, "node"));
  {
    std::vector<std::string> sources;
    for (int p : publishers) {
      ModelInputs with = in;
      with.publishers = p;
      const Shape ps = ShapeOf(with);
      sources.push_back(ps.publishers == in.trainer_gpus
                            ? absl::StrFormat("every trainer GPU (%d on %s)", ps.publishers,
                                              plural(ps.publisher_nodes, "node"))
                            : absl::StrFormat("%s on %s", plural(ps.publishers, "GPU"),
                                              plural(ps.publisher_nodes, "node")));
    }
    absl::StrAppendFormat(&out, "# sources (disk, ucx, delta+): %s\n",
                          kv("publishers", absl::StrJoin(sources, "; ")));
  }
  absl::StrAppendFormat(&out, "# network: %s, %s, %s\n",
                        kv("network-gbs", Num(in.node_gbs) + " GB/s per node"),
                        kv("nics-per-node", plural(in.nics_per_node, "NIC") + " per node"),
                        kv("latency-s", "latency " + Num(in.net_latency_s) + " s"));
  absl::StrAppendFormat(
      &out, "# storage: %s, %s, %s, %s\n",
      kv("storage-write-gbs", "write " + Num(in.storage_write_gbs) + " GB/s per client"),
      kv("storage-read-gbs", "read " + Num(in.storage_read_gbs) + " GB/s per client"),
      kv("storage-aggregate-gbs", Num(in.storage_aggregate_gbs) + " GB/s in total"),
      kv("storage-latency-s", "latency " + Num(in.storage_latency_s) + " s"));
  if (!presets.empty())
    absl::StrAppendFormat(&out, "# presets: %s\n", absl::StrJoin(presets, "; "));
  absl::StrAppendFormat(
      &out, "# copies: %s, %s, %s\n",
      kv("d2h-gbs", "trainer GPU to host " + Num(in.d2h_gbs) + " GB/s per GPU"),
      kv("stage-gbs", "ucx staging " + Num(in.stage_gbs) + " GB/s per trainer node"),
      kv("apply-gbs", "replica host to GPU " + Num(in.apply_gbs) + " GB/s per GPU"));
  absl::StrAppendFormat(&out, "# training: %s, %s, %s\n",
                        kv("step-s", "step " + Num(in.step_s) + " s"),
                        kv("overlap", "overlap " + Num(in.overlap)),
                        kv("gpu-price", absl::StrFormat("$%.2f per GPU-hour", in.gpu_price)));
  absl::StrAppendFormat(
      &out, "# delta: %s, %s, %s -> %.3f%% of the full bytes per version; %s, %s\n",
      kv("delta-ratio", Num(in.delta_ratio) + "x per delta"),
      kv("keyframe-interval",
         in.keyframe_interval > 0
             ? absl::StrFormat("a keyframe every %d versions", in.keyframe_interval)
             : std::string("no keyframe after the first")),
      kv("keyframe-ratio", Num(in.keyframe_ratio) + "x per keyframe"), 100 * DeltaFraction(in),
      kv("encode-gbs", "encode " + Num(in.encode_gbs) + " GB/s per trainer node"),
      kv("decode-gbs", "decode " + Num(in.decode_gbs) + " GB/s per replica node"));
  if (cal) {
    absl::StrAppendFormat(&out, "# calibrated from %s (%s, %d subscribers, %.1f MB model):\n",
                          cal->file, cal->host, cal->subscribers, cal->model_bytes / 1e6);
    for (const auto& [key, f] : cal->figures) {
      const std::string from = x.From(key);
      absl::StrAppendFormat(&out, "#   --%s %s: %s%s\n", key, Num(f.value), f.how,
                            from == "calibrated" ? "" : " (not used: " + from + ")");
    }
  }
  out += "#\n";
  out += FormatModelTable(estimates, side_by_side);
  if (side_by_side) {
    out +=
        "#\n# where the time goes (seconds per version; * the trainer waits; last: until the last "
        "replica holds it)\n";
    out += FormatTermsTable(estimates);
  }
  if (compare) {
    out +=
        "#\n# prediction vs measurement (medians over the run's measured versions; error = "
        "(model - measured) / measured; bound: the model with the baselines' rates and no "
        "latency)\n";
    out += FormatComparison(cal->measured, estimates, bound);
  }
  out += "# OK\n";
  std::fputs(out.c_str(), stdout);

  if (std::optional<std::string> file = args.Get("json")) {
    nlohmann::ordered_json j;
    j["tool"] = "weightbus-bench model";
    j["inputs"] = nlohmann::ordered_json::object();
    auto input = [&](const std::string& key, double v) {
      j["inputs"][key] = {{"value", std::isfinite(v) ? nlohmann::ordered_json(v) : "inf"},
                          {"from", x.From(key)}};
    };
    input("model-bytes", in.model_bytes);
    for (const std::string& i : ints) {
      const int v = i == "trainer-gpus"       ? in.trainer_gpus
                    : i == "replica-gpus"     ? in.replica_gpus
                    : i == "gpus-per-node"    ? in.gpus_per_node
                    : i == "gpus-per-replica" ? in.gpus_per_replica
                    : i == "broadcast-roots"  ? in.broadcast_roots
                    : i == "nics-per-node"    ? in.nics_per_node
                                              : in.keyframe_interval;
      input(i, v);
    }
    input("network-gbs", in.node_gbs);
    input("latency-s", in.net_latency_s);
    input("storage-write-gbs", in.storage_write_gbs);
    input("storage-read-gbs", in.storage_read_gbs);
    input("storage-aggregate-gbs", in.storage_aggregate_gbs);
    input("storage-latency-s", in.storage_latency_s);
    input("d2h-gbs", in.d2h_gbs);
    input("stage-gbs", in.stage_gbs);
    input("apply-gbs", in.apply_gbs);
    input("step-s", in.step_s);
    input("overlap", in.overlap);
    input("gpu-price", in.gpu_price);
    input("delta-ratio", in.delta_ratio);
    input("keyframe-ratio", in.keyframe_ratio);
    input("encode-gbs", in.encode_gbs);
    input("decode-gbs", in.decode_gbs);
    input("publishers", in.publishers);
    j["shape"] = {{"trainer_nodes", s.trainer_nodes},
                  {"replica_nodes", s.replica_nodes},
                  {"instances", s.instances},
                  {"nodes_per_instance", s.nodes_per_instance},
                  {"gpus_per_replica_node", s.gpus_per_replica_node}};
    j["delta_fraction"] = DeltaFraction(in);
    j["transports"] = nlohmann::ordered_json::array();
    for (const Estimate& e : estimates) j["transports"].push_back(EstimateJson(e));
    if (cal) {
      j["calibration"] = {{"file", cal->file},
                          {"host", cal->host},
                          {"subscribers", cal->subscribers},
                          {"model_bytes", cal->model_bytes}};
      for (const auto& [key, f] : cal->figures) {
        j["calibration"]["figures"][key] = {{"value", f.value}, {"how", f.how}};
      }
    }
    if (compare) {
      j["comparison"] = nlohmann::ordered_json::array();
      for (const Calibration::Measured& m : cal->measured) {
        for (size_t i = 0; i < estimates.size(); ++i) {
          if (estimates[i].transport != m.name) continue;
          j["comparison"].push_back(
              {{"transport", m.name},
               {"measured_stall_s", m.stall_s},
               {"model_stall_s", estimates[i].stall_s},
               {"measured_last_replica_s", m.last_s},
               {"model_last_replica_s", estimates[i].transfer_s},
               {"last_replica_error",
                m.last_s > 0 ? (estimates[i].transfer_s - m.last_s) / m.last_s : 0.0},
               {"bound_last_replica_s", bound[i].transfer_s},
               {"versions", m.count}});
        }
      }
    }
    std::ofstream f(*file);
    f << j.dump(2) << "\n";
    if (!f) Die("cannot write " + *file);
  }
  return 0;
}

}  // namespace

Subcommand AddModelCommand(tools::Command& command) {
  command.Footer(kFooter);
  auto flags = std::make_shared<ModelFlags>();
  flags->AddTo(command);
  return [flags](const std::vector<std::string>&) { return Model(*flags); };
}

}  // namespace weightbus::bench

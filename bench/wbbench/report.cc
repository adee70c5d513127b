// SPDX-License-Identifier: Apache-2.0
#include "wbbench/report.h"

#include <cmath>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "wbbench/common.h"

namespace weightbus::bench {
namespace {}  // namespace

Summary SummaryOf(const std::vector<double>& v) {
  Summary s;
  s.count = static_cast<int>(v.size());
  if (!v.empty()) {
    s.median = Median(v);
    s.p99 = Percentile(v, 99);
  }
  return s;
}

namespace {

// A cell: the value with `precision` decimals, or "-" for "not measured" (NaN or count 0).
std::string Cell(double v, int width, int precision, bool present = true) {
  if (!present || std::isnan(v)) return absl::StrFormat("%*s", width, "-");
  return absl::StrFormat("%*.*f", width, precision, v);
}

nlohmann::ordered_json SummaryJson(const Summary& s) {
  if (s.count == 0) return nullptr;
  return {{"median", s.median}, {"p99", s.p99}, {"count", s.count}};
}

}  // namespace

void Summarize(TransportResult& t, uint64_t model_bytes, int versions) {
  std::vector<double> stall, first, last, receive, wire_reported, stored, encode, decode;
  bool wire_known = true;
  t.wrong_versions = 0;
  t.wrong_deliveries = 0;
  for (const VersionRecord& v : t.versions) {
    // A replica that never reported (its process failed: the run's failure says so) counts
    // neither as right nor as wrong; the version's times need every replica.
    bool all_ok = v.published && !v.replicas.empty() && v.replicas.size() == v.expected_replicas;
    bool any_wrong = false;
    double lo = INFINITY, hi = 0;
    for (const ReplicaRecord& r : v.replicas) {
      if (!r.ok) {
        all_ok = false;
        if (!r.timed_out) {  // a timeout is the run's failure, not a wrong version
          any_wrong = true;
          ++t.wrong_deliveries;
        }
        continue;
      }
      lo = std::min(lo, r.ready_s);
      hi = std::max(hi, r.ready_s);
      if (v.measured) {
        receive.push_back(r.receive_s());
        if (r.wire_bytes > 0) {
          wire_reported.push_back(static_cast<double>(r.wire_bytes));
        } else {
          wire_known = false;
        }
        if (r.decode_s > 0) decode.push_back(r.decode_s);
      }
    }
    if (any_wrong) ++t.wrong_versions;
    if (!v.measured || !v.published) continue;
    stall.push_back(v.stall_s);
    if (v.encode_s > 0) encode.push_back(v.encode_s);
    if (v.stored_bytes > 0) stored.push_back(static_cast<double>(v.stored_bytes));
    if (all_ok) {
      first.push_back(lo);
      last.push_back(hi);
    }
  }
  t.stall = SummaryOf(stall);
  t.first = SummaryOf(first);
  t.last = SummaryOf(last);
  t.receive_gbs = receive.empty() ? 0 : model_bytes / 1e9 / Median(receive);
  if (wire_known && !wire_reported.empty()) {
    t.wire_bytes = Median(wire_reported);
    t.wire_source = "reported";
  } else if (!stored.empty()) {
    t.wire_bytes = Median(stored);
    t.wire_source = "stored";
  } else {
    t.wire_bytes = 0;
    t.wire_source = "unknown";
  }
  t.encode_s = encode.empty() ? 0 : Median(encode);
  t.decode_s = decode.empty() ? 0 : Median(decode);
  t.cpu_s = 0;
  t.peak_rss_bytes = 0;
  for (const ProcessRecord& p : t.processes) {
    t.cpu_s += std::max(0.0, p.cpu_s - p.overhead_cpu_s);
    t.peak_rss_bytes = std::max(t.peak_rss_bytes, p.peak_rss_bytes);
    if (p.role == "publisher") t.publisher_peak_rss_bytes = p.peak_rss_bytes;
  }
  t.cpu_s_per_version = versions > 0 ? t.cpu_s / versions : 0;
}

Ratios RatiosOf(const RunResult& r, const TransportResult& t) {
  Ratios out;
  if (t.last.count == 0) return out;
  auto last_of = [&](const std::string& name) -> double {
    for (const BaselineResult& b : r.baselines) {
      if (b.name == name && b.ran && b.last.count > 0 && b.last.median > 0) return b.last.median;
    }
    return NAN;
  };
  const std::string base = t.name.substr(t.name.find('+') + 1);  // "delta+ucx" -> "ucx"
  out.limit = base == "disk" ? "write+read" : base == "ucx" ? "ucx_perftest" : "";
  if (!out.limit.empty()) out.vs_limit = t.last.median / last_of(out.limit);
  for (const char* name : {"torch.save", "gloo bcast"}) {
    const double x = last_of(name);
    if (!std::isnan(x) && (std::isnan(out.vs_torch) || x / t.last.median < out.vs_torch)) {
      out.vs_torch = x / t.last.median;
      out.torch = name;
    }
  }
  return out;
}

std::string FinalLine(const RunResult& r) {
  if (r.failures.empty()) return "# OK";
  return "# FAILED: " + absl::StrJoin(r.failures, "; ");
}

std::string FormatTable(const RunResult& r) {
  std::string out;
  absl::StrAppendFormat(
      &out, "# %-12s %-9s %4s %4s %9s %9s %9s %9s %9s %9s %8s %10s %8s %8s %6s %7s %7s\n",
      "transport", "kind", "subs", "vers", "stall", "stall", "first", "first", "last", "last",
      "receive", "wire", "cpu", "peak", "#wrong", "last/", "torch/");
  absl::StrAppendFormat(
      &out, "# %-12s %-9s %4s %4s %9s %9s %9s %9s %9s %9s %8s %10s %8s %8s %6s %7s %7s\n", "", "",
      "", "", "median", "p99", "median", "p99", "median", "p99", "rate", "per ver", "per ver",
      "RSS", "", "limit", "last");
  absl::StrAppendFormat(
      &out, "# %-12s %-9s %4s %4s %9s %9s %9s %9s %9s %9s %8s %10s %8s %8s %6s %7s %7s\n", "", "",
      "", "", "(ms)", "(ms)", "(ms)", "(ms)", "(ms)", "(ms)", "(GB/s)", "(MB)", "(s)", "(MiB)", "",
      "(x)", "(x)");
  for (const TransportResult& t : r.transports) {
    const Ratios ratios = RatiosOf(r, t);
    absl::StrAppendFormat(
        &out, "  %-12s %-9s %4d %4d %s %s %s %s %s %s %s %s %s %s %6d %s %s\n", t.name, "weightbus",
        r.subscribers, t.stall.count, Cell(t.stall.median * 1e3, 9, 2, t.stall.count > 0),
        Cell(t.stall.p99 * 1e3, 9, 2, t.stall.count > 0),
        Cell(t.first.median * 1e3, 9, 2, t.first.count > 0),
        Cell(t.first.p99 * 1e3, 9, 2, t.first.count > 0),
        Cell(t.last.median * 1e3, 9, 2, t.last.count > 0),
        Cell(t.last.p99 * 1e3, 9, 2, t.last.count > 0),
        Cell(t.receive_gbs, 8, 2, t.receive_gbs > 0),
        Cell(t.wire_bytes / 1e6, 10, 3, t.wire_bytes > 0), Cell(t.cpu_s_per_version, 8, 3),
        Cell(t.peak_rss_bytes / 1048576.0, 8, 1), t.wrong_versions, Cell(ratios.vs_limit, 7, 2),
        Cell(ratios.vs_torch, 7, 1));
  }
  for (const BaselineResult& b : r.baselines) {
    if (!b.ran) continue;
    absl::StrAppendFormat(
        &out, "  %-12s %-9s %4s %4d %s %s %s %s %s %s %s %10s %8s %8s %6s %7s %7s\n", b.name,
        "baseline", b.readers > 0 ? std::to_string(b.readers) : "-", b.last.count,
        Cell(b.stall.median * 1e3, 9, 2, b.stall.count > 0),
        Cell(b.stall.p99 * 1e3, 9, 2, b.stall.count > 0),
        Cell(b.first.median * 1e3, 9, 2, b.first.count > 0),
        Cell(b.first.p99 * 1e3, 9, 2, b.first.count > 0),
        Cell(b.last.median * 1e3, 9, 2, b.last.count > 0),
        Cell(b.last.p99 * 1e3, 9, 2, b.last.count > 0), Cell(b.rate_gbs, 8, 2, b.rate_gbs > 0), "-",
        "-", "-", b.readers > 0 ? std::to_string(b.wrong) : "-", "-", "-");
  }
  out +=
      "# last/limit: time to last replica / the baseline bounding the transport (disk: "
      "write+read, ucx: ucx_perftest); torch/last: the faster torch baseline / time to last "
      "replica\n";
  for (const BaselineResult& b : r.baselines) {
    if (!b.ran) absl::StrAppendFormat(&out, "# baseline %s skipped: %s\n", b.name, b.note);
  }
  for (const Skipped& s : r.skipped) {
    absl::StrAppendFormat(&out, "# %s skipped: %s\n", s.name, s.reason);
  }
  for (const TransportResult& t : r.transports) {
    if (!t.failure.empty()) absl::StrAppendFormat(&out, "# %s: %s\n", t.name, t.failure);
  }
  // A layer's choice per version (delta, keyframe or plain, and why: PublishStats::encoding),
  // with the time to the last replica, so that a reader sees what each version cost.
  for (const TransportResult& t : r.transports) {
    for (const VersionRecord& v : t.versions) {
      if (v.encoding.empty()) continue;
      double last = 0;
      bool all = !v.replicas.empty();
      for (const ReplicaRecord& p : v.replicas) {
        all = all && p.ok;
        last = std::max(last, p.ready_s);
      }
      absl::StrAppendFormat(&out, "# %s version %d%s: last replica %s ms, %s\n", t.name, v.version,
                            v.measured ? "" : " (warm-up)",
                            all ? absl::StrFormat("%.1f", last * 1e3) : std::string("-"),
                            v.encoding);
    }
  }
  out += FinalLine(r) + "\n";
  return out;
}

nlohmann::ordered_json ToJson(const RunResult& r) {
  nlohmann::ordered_json j;
  j["tool"] = "weightbus-bench run";
  j["config"] = r.config;
  j["model_bytes"] = r.model_bytes;
  j["tensors"] = r.tensors;
  j["subscribers"] = r.subscribers;
  j["versions"] = r.versions;
  j["warmup"] = r.warmup;
  j["changed_fraction"] = r.changed_fraction;
  j["transports"] = nlohmann::ordered_json::array();
  for (const TransportResult& t : r.transports) {
    nlohmann::ordered_json tj;
    tj["name"] = t.name;
    tj["kind"] = "weightbus";
    tj["uri"] = t.uri;
    tj["completed"] = t.completed;
    tj["failure"] = t.failure;
    tj["stall_s"] = SummaryJson(t.stall);
    tj["first_replica_s"] = SummaryJson(t.first);
    tj["last_replica_s"] = SummaryJson(t.last);
    tj["receive_gbs"] = t.receive_gbs;
    tj["wire_bytes_per_version"] = t.wire_bytes;
    tj["wire_source"] = t.wire_source;
    tj["encode_s"] = t.encode_s;
    tj["decode_s"] = t.decode_s;
    tj["cpu_s"] = t.cpu_s;
    tj["cpu_s_per_version"] = t.cpu_s_per_version;
    tj["peak_rss_bytes"] = t.peak_rss_bytes;
    tj["publisher_peak_rss_bytes"] = t.publisher_peak_rss_bytes;
    tj["wrong_versions"] = t.wrong_versions;
    tj["wrong_deliveries"] = t.wrong_deliveries;
    const Ratios ratios = RatiosOf(r, t);
    auto number = [](double x) {
      return std::isnan(x) ? nlohmann::ordered_json() : nlohmann::ordered_json(x);
    };
    tj["last_vs_limit"] = nlohmann::ordered_json::object();
    tj["last_vs_limit"]["baseline"] = ratios.limit;
    tj["last_vs_limit"]["ratio"] = number(ratios.vs_limit);
    tj["torch_vs_last"] = nlohmann::ordered_json::object();
    tj["torch_vs_last"]["baseline"] = ratios.torch;
    tj["torch_vs_last"]["ratio"] = number(ratios.vs_torch);
    tj["processes"] = nlohmann::ordered_json::array();
    for (const ProcessRecord& p : t.processes) {
      tj["processes"].push_back({{"role", p.role},
                                 {"pid", p.pid},
                                 {"exit", p.exit},
                                 {"cpu_s", p.cpu_s},
                                 {"overhead_cpu_s", p.overhead_cpu_s},
                                 {"peak_rss_bytes", p.peak_rss_bytes}});
    }
    tj["versions"] = nlohmann::ordered_json::array();
    for (const VersionRecord& v : t.versions) {
      nlohmann::ordered_json vj = {{"version", v.version},
                                   {"measured", v.measured},
                                   {"published", v.published},
                                   {"error", v.error},
                                   {"publish_start_unix_ns", v.publish_start_unix_ns},
                                   {"stall_s", v.stall_s},
                                   {"pack_s", v.pack_s},
                                   {"transport_s", v.transport_s},
                                   {"checksum_wait_s", v.checksum_wait_s},
                                   {"encode_s", v.encode_s},
                                   {"wire_bytes", v.wire_bytes},
                                   {"encoding", v.encoding},
                                   {"stored_bytes", v.stored_bytes}};
      vj["replicas"] = nlohmann::ordered_json::array();
      for (const ReplicaRecord& p : v.replicas) {
        vj["replicas"].push_back({{"index", p.index},
                                  {"ok", p.ok},
                                  {"error", p.error},
                                  {"ready_s", p.ready_s},
                                  {"call_start_unix_ns", p.call_start_unix_ns},
                                  {"wait_s", p.wait_s},
                                  {"allocate_s", p.allocate_s},
                                  {"fetch_s", p.fetch_s},
                                  {"decode_s", p.decode_s},
                                  {"verify_s", p.verify_s},
                                  {"apply_s", p.apply_s},
                                  {"receive_s", p.receive_s()},
                                  {"wire_bytes", p.wire_bytes}});
      }
      tj["versions"].push_back(std::move(vj));
    }
    j["transports"].push_back(std::move(tj));
  }
  j["baselines"] = nlohmann::ordered_json::array();
  for (const BaselineResult& b : r.baselines) {
    j["baselines"].push_back({{"name", b.name},
                              {"kind", "baseline"},
                              {"what", b.what},
                              {"ran", b.ran},
                              {"note", b.note},
                              {"readers", b.readers},
                              {"stall_s", SummaryJson(b.stall)},
                              {"first_replica_s", SummaryJson(b.first)},
                              {"last_replica_s", SummaryJson(b.last)},
                              {"rate_gbs", b.rate_gbs},
                              {"wrong", b.wrong},
                              {"raw", b.raw}});
  }
  j["skipped"] = nlohmann::ordered_json::array();
  for (const Skipped& s : r.skipped)
    j["skipped"].push_back({{"name", s.name}, {"reason", s.reason}});
  j["ok"] = r.failures.empty();
  j["failures"] = r.failures;
  return j;
}

namespace {

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

}  // namespace

std::string ToCsv(const RunResult& r) {
  std::string out = "section,name,version,replica,metric,value,unit\n";
  auto row = [&](const std::string& section, const std::string& name, const std::string& version,
                 const std::string& replica, const std::string& metric, double value,
                 const std::string& unit) {
    absl::StrAppendFormat(&out, "%s,%s,%s,%s,%s,%.9g,%s\n", section, CsvField(name), version,
                          replica, metric, value, unit);
  };
  auto summary = [&](const std::string& section, const std::string& name, const char* metric,
                     const Summary& s) {
    if (s.count == 0) return;
    row(section, name, "", "", std::string(metric) + "_median", s.median, "s");
    row(section, name, "", "", std::string(metric) + "_p99", s.p99, "s");
  };
  row("model", "model", "", "", "bytes", static_cast<double>(r.model_bytes), "B");
  row("model", "model", "", "", "tensors", r.tensors, "");
  for (size_t i = 0; i < r.changed_fraction.size(); ++i) {
    row("model", "stream", std::to_string(i + 1), "", "changed_fraction", r.changed_fraction[i],
        "");
  }
  for (const TransportResult& t : r.transports) {
    summary("transport", t.name, "stall", t.stall);
    summary("transport", t.name, "first_replica", t.first);
    summary("transport", t.name, "last_replica", t.last);
    row("transport", t.name, "", "", "receive_rate", t.receive_gbs, "GB/s");
    row("transport", t.name, "", "", "wire_bytes_per_version", t.wire_bytes, "B");
    row("transport", t.name, "", "", "encode_median", t.encode_s, "s");
    row("transport", t.name, "", "", "decode_median", t.decode_s, "s");
    row("transport", t.name, "", "", "cpu", t.cpu_s, "s");
    row("transport", t.name, "", "", "cpu_per_version", t.cpu_s_per_version, "s");
    row("transport", t.name, "", "", "peak_rss", static_cast<double>(t.peak_rss_bytes), "B");
    row("transport", t.name, "", "", "wrong_versions", t.wrong_versions, "");
    const Ratios ratios = RatiosOf(r, t);
    if (!std::isnan(ratios.vs_limit)) {
      row("transport", t.name, "", "", "last_vs_" + ratios.limit, ratios.vs_limit, "x");
    }
    if (!std::isnan(ratios.vs_torch)) {
      row("transport", t.name, "", "", ratios.torch + "_vs_last", ratios.vs_torch, "x");
    }
    for (const ProcessRecord& p : t.processes) {
      row("process", t.name, "", p.role, "cpu", p.cpu_s, "s");
      row("process", t.name, "", p.role, "overhead_cpu", p.overhead_cpu_s, "s");
      row("process", t.name, "", p.role, "peak_rss", static_cast<double>(p.peak_rss_bytes), "B");
    }
    for (const VersionRecord& v : t.versions) {
      const std::string ver = std::to_string(v.version);
      row("version", t.name, ver, "", "measured", v.measured ? 1 : 0, "");
      row("version", t.name, ver, "", "stall", v.stall_s, "s");
      row("version", t.name, ver, "", "pack", v.pack_s, "s");
      row("version", t.name, ver, "", "transport", v.transport_s, "s");
      row("version", t.name, ver, "", "checksum_wait", v.checksum_wait_s, "s");
      row("version", t.name, ver, "", "encode", v.encode_s, "s");
      row("version", t.name, ver, "", "wire_bytes", static_cast<double>(v.wire_bytes), "B");
      row("version", t.name, ver, "", "stored_bytes", static_cast<double>(v.stored_bytes), "B");
      for (const ReplicaRecord& p : v.replicas) {
        const std::string rep = std::to_string(p.index);
        row("replica", t.name, ver, rep, "ok", p.ok ? 1 : 0, "");
        row("replica", t.name, ver, rep, "ready", p.ready_s, "s");
        row("replica", t.name, ver, rep, "wait", p.wait_s, "s");
        row("replica", t.name, ver, rep, "allocate", p.allocate_s, "s");
        row("replica", t.name, ver, rep, "fetch", p.fetch_s, "s");
        row("replica", t.name, ver, rep, "decode", p.decode_s, "s");
        row("replica", t.name, ver, rep, "verify", p.verify_s, "s");
        row("replica", t.name, ver, rep, "apply", p.apply_s, "s");
        row("replica", t.name, ver, rep, "wire_bytes", static_cast<double>(p.wire_bytes), "B");
      }
    }
  }
  for (const BaselineResult& b : r.baselines) {
    if (!b.ran) continue;
    summary("baseline", b.name, "stall", b.stall);
    summary("baseline", b.name, "first_replica", b.first);
    summary("baseline", b.name, "last_replica", b.last);
    row("baseline", b.name, "", "", "rate", b.rate_gbs, "GB/s");
    row("baseline", b.name, "", "", "wrong", b.wrong, "");
    if (b.raw.is_object()) {
      for (const auto& [k, v] : b.raw.items()) {
        if (v.is_number()) row("baseline", b.name, "", "", k, v.get<double>(), "");
        if (!v.is_array()) continue;
        for (size_t i = 0; i < v.size(); ++i) {
          if (v[i].is_number()) {
            row("baseline", b.name, std::to_string(i + 1), "", k, v[i].get<double>(), "s");
          }
        }
      }
    }
  }
  return out;
}

}  // namespace weightbus::bench

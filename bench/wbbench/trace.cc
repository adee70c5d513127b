// SPDX-License-Identifier: Apache-2.0
#include "wbbench/trace.h"

#include <algorithm>
#include <climits>
#include <string>

#include "absl/strings/str_format.h"

namespace weightbus::bench {
namespace {

struct Span {
  const char* name;
  double seconds;
};

int PidOf(const TransportResult& t, const std::string& role, int fallback) {
  for (const ProcessRecord& p : t.processes) {
    if (p.role == role && p.pid > 0) return p.pid;
  }
  return fallback;
}

}  // namespace

nlohmann::ordered_json ChromeTrace(const RunResult& r) {
  // Time zero: the earliest start of anything traced.
  int64_t origin = INT64_MAX;
  for (const TransportResult& t : r.transports) {
    for (const VersionRecord& v : t.versions) {
      if (v.published) origin = std::min(origin, v.publish_start_unix_ns);
      for (const ReplicaRecord& p : v.replicas) {
        if (p.call_start_unix_ns > 0) origin = std::min(origin, p.call_start_unix_ns);
      }
    }
  }
  if (origin == INT64_MAX) origin = 0;
  auto us = [&](int64_t unix_ns) { return static_cast<double>(unix_ns - origin) / 1e3; };

  nlohmann::ordered_json events = nlohmann::ordered_json::array();
  int sort_index = 0;
  int synthetic_pid = 1;  // for processes whose pid is unknown (they failed to start)
  for (const TransportResult& t : r.transports) {
    const int pub_pid = PidOf(t, "publisher", synthetic_pid++);
    std::vector<int> sub_pids;
    for (int i = 0; i < r.subscribers; ++i) {
      sub_pids.push_back(PidOf(t, absl::StrFormat("subscriber %d", i), synthetic_pid++));
    }
    auto name_process = [&](int pid, const std::string& name) {
      events.push_back({{"name", "process_name"},
                        {"ph", "M"},
                        {"pid", pid},
                        {"tid", 1},
                        {"args", {{"name", name}}}});
      events.push_back({{"name", "process_sort_index"},
                        {"ph", "M"},
                        {"pid", pid},
                        {"tid", 1},
                        {"args", {{"sort_index", sort_index++}}}});
    };
    name_process(pub_pid, absl::StrFormat("%s publisher (pid %d)", t.name, pub_pid));
    for (int i = 0; i < r.subscribers; ++i) {
      name_process(sub_pids[i],
                   absl::StrFormat("%s subscriber %d (pid %d)", t.name, i, sub_pids[i]));
    }
    // Lays out `spans` one after another from `start_us`, inside an enclosing span.
    auto emit = [&](int pid, const std::string& outer, double start_us, double total_s,
                    const std::vector<Span>& spans, const nlohmann::ordered_json& args) {
      events.push_back({{"name", outer},
                        {"cat", t.name},
                        {"ph", "X"},
                        {"ts", start_us},
                        {"dur", total_s * 1e6},
                        {"pid", pid},
                        {"tid", 1},
                        {"args", args}});
      double at = start_us;
      for (const Span& s : spans) {
        if (s.seconds <= 0) continue;
        events.push_back({{"name", s.name},
                          {"cat", t.name},
                          {"ph", "X"},
                          {"ts", at},
                          {"dur", s.seconds * 1e6},
                          {"pid", pid},
                          {"tid", 1},
                          {"args", args}});
        at += s.seconds * 1e6;
      }
    };
    for (const VersionRecord& v : t.versions) {
      if (!v.published) continue;
      const nlohmann::ordered_json args = {{"version", v.version}, {"transport", t.name}};
      emit(pub_pid, absl::StrFormat("publish v%d", v.version), us(v.publish_start_unix_ns),
           v.stall_s,
           {{"snapshot", v.pack_s},
            {"encode", v.encode_s},
            {"transfer", v.transport_s - v.encode_s},
            {"verify", v.checksum_wait_s}},
           args);
      for (const ReplicaRecord& p : v.replicas) {
        if (p.call_start_unix_ns <= 0 || p.index >= static_cast<int>(sub_pids.size())) continue;
        const double total = p.wait_s + p.receive_s();
        nlohmann::ordered_json a = args;
        a["ok"] = p.ok;
        emit(sub_pids[p.index], absl::StrFormat("receive v%d", v.version), us(p.call_start_unix_ns),
             total,
             {{"wait", p.wait_s},
              {"allocate", p.allocate_s},
              {"transfer", p.fetch_s - p.decode_s},
              {"decode", p.decode_s},
              {"verify", p.verify_s},
              {"apply", p.apply_s}},
             a);
      }
    }
  }
  nlohmann::ordered_json trace;
  trace["traceEvents"] = std::move(events);
  trace["displayTimeUnit"] = "ms";
  trace["otherData"] = {{"tool", "weightbus-bench run"}};
  return trace;
}

}  // namespace weightbus::bench

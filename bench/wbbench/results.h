// SPDX-License-Identifier: Apache-2.0
// What `weightbus-bench run` measured: per transport and version, per replica, per process, and
// the baselines; with the summaries the table, the JSON, the CSV, the trace and the plot show.
// Metric definitions: docs/PERFORMANCE.md ("weightbus-bench").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace weightbus::bench {

// One replica's receipt of one version.
struct ReplicaRecord {
  int index = 0;
  bool ok = false;                 // received and bit-identical to what was published
  std::string error;               // why not (library error or the independent check's finding)
  double ready_s = 0;              // publish start -> verified version in the replica's buffers
  int64_t call_start_unix_ns = 0;  // when its WaitForVersion began
  double wait_s = 0, allocate_s = 0, fetch_s = 0, decode_s = 0, verify_s = 0, apply_s = 0;
  uint64_t wire_bytes = 0;  // as UpdateStats reports (0: unknown)
  bool timed_out = false;   // WaitForVersion's deadline passed: not delivered, not wrong
  double receive_s() const { return allocate_s + fetch_s + verify_s + apply_s; }
};

// One version through one transport.
struct VersionRecord {
  uint64_t version = 0;
  bool measured = false;  // false for warm-up versions
  bool published = false;
  std::string error;  // the publisher's, if Publish failed
  int64_t publish_start_unix_ns = 0;
  double stall_s = 0, pack_s = 0, transport_s = 0, checksum_wait_s = 0, encode_s = 0;
  uint64_t wire_bytes = 0;       // PublishStats::wire_bytes (0: unknown)
  std::string encoding;          // PublishStats::encoding: a layer's choice and why ("" without)
  uint64_t stored_bytes = 0;     // disk-backed channels: bytes of the version's directory
  size_t expected_replicas = 0;  // the run's subscribers; fewer records: some never reported
  std::vector<ReplicaRecord> replicas;
};

struct ProcessRecord {
  std::string role;  // "publisher" or "subscriber N"
  int pid = 0;
  std::string exit;           // "exit 0", "killed by signal 9", ...
  double cpu_s = 0;           // wait4: user + system
  double overhead_cpu_s = 0;  // the bench's own work inside it (loading versions, checking them)
  int64_t peak_rss_bytes = 0;
};

// A median and a 99th percentile over the measured versions.
struct Summary {
  double median = 0;
  double p99 = 0;
  int count = 0;
};

struct TransportResult {
  std::string name;  // "disk", "ucx", "delta+disk", ...
  std::string uri;
  bool completed = false;  // every version went through (right or wrong)
  std::string failure;     // why the run of this transport stopped, if it did
  std::vector<VersionRecord> versions;
  std::vector<ProcessRecord> processes;

  // Summaries (filled by Summarize).
  Summary stall, first, last;
  double receive_gbs = 0;   // model bytes / median receive time (allocate+fetch+verify+apply)
  double wire_bytes = 0;    // median per version and replica; 0 when unknown
  std::string wire_source;  // "reported", "stored" (directory size), "unknown"
  double encode_s = 0, decode_s = 0;  // medians (0 without a codec layer)
  double cpu_s = 0;                   // all processes, less the bench's own work
  double cpu_s_per_version = 0;
  int64_t peak_rss_bytes = 0;  // the largest of its processes
  int64_t publisher_peak_rss_bytes = 0;
  int wrong_versions = 0;    // versions at least one replica did not get right
  int wrong_deliveries = 0;  // (version, replica) pairs that failed
};

// A baseline: the same bytes moved without weightbus.
struct BaselineResult {
  std::string name;  // "memcpy", "write+fsync, read", "ucx_perftest", ...
  std::string what;  // one line
  bool ran = false;
  std::string note;     // why skipped, or a remark
  Summary stall;        // where the baseline has a writer's share (count 0: none)
  Summary first, last;  // time until one / every reader has the bytes
  double rate_gbs = 0;  // its characteristic rate (see docs)
  int readers = 0;
  int wrong = 0;               // reps whose bytes differed (torch baselines check them)
  nlohmann::ordered_json raw;  // every figure it produced
};

struct Skipped {
  std::string name;
  std::string reason;
};

struct RunResult {
  nlohmann::ordered_json config;  // banner facts: host, model, stream, options
  uint64_t model_bytes = 0;
  int tensors = 0;
  int subscribers = 0;
  int versions = 0;
  int warmup = 0;
  std::vector<double> changed_fraction;  // per version (version 1: 1.0)
  std::vector<TransportResult> transports;
  std::vector<BaselineResult> baselines;
  std::vector<Skipped> skipped;
  std::vector<std::string> failures;  // the "# FAILED:" reasons; empty means OK
};

// The median and p99 of `v` (count 0 when empty).
Summary SummaryOf(const std::vector<double>& v);

// Fills the summaries of `t` from its records.
void Summarize(TransportResult& t, uint64_t model_bytes, int versions);

}  // namespace weightbus::bench

// SPDX-License-Identifier: Apache-2.0
// The cost model of `weightbus-bench model` (bench/wbbench/model.h) against hand-computed cases,
// its calibration from a run's JSON, and the subcommand itself (the built binary).
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "test_support.h"
#include "wbbench/model.h"
#include "weightbus/llama2c.h"
#include "weightbus/safetensors.hpp"

namespace weightbus::bench {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

constexpr double kInf = std::numeric_limits<double>::infinity();

// 7B parameters in bf16 on one node of 8 trainer GPUs and one 8-GPU instance over IB NDR
// (8 x 50 GB/s), with the defaults of every copy rate spelled out.
ModelInputs SevenB() {
  ModelInputs in;
  in.model_bytes = 14e9;  // 7e9 x 2 B
  in.trainer_gpus = 8;
  in.replica_gpus = 8;
  in.gpus_per_node = 8;
  in.gpus_per_replica = 8;
  in.node_gbs = 400;
  in.d2h_gbs = 50;
  in.stage_gbs = 100;
  in.apply_gbs = 50;
  in.net_latency_s = 0.002;
  in.storage_write_gbs = 10;
  in.storage_read_gbs = 10;
  in.storage_aggregate_gbs = 100;
  in.storage_latency_s = 0.05;
  in.step_s = 60;
  in.overlap = 0;
  in.gpu_price = 2;
  in.delta_ratio = 100;
  in.keyframe_interval = 0;
  in.keyframe_ratio = 1.5;
  in.encode_gbs = 20;
  in.decode_gbs = 40;
  return in;
}

Estimate MustEstimate(const ModelInputs& in, const std::string& transport) {
  absl::StatusOr<Estimate> e = EstimateTransport(in, transport);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *e : Estimate{};
}

double TermOf(const Estimate& e, const std::string& name) {
  for (const Term& t : e.terms) {
    if (t.name == name) return t.seconds;
  }
  ADD_FAILURE() << e.transport << " has no term " << name;
  return -1;
}

std::vector<std::string> TermNames(const Estimate& e) {
  std::vector<std::string> names;
  for (const Term& t : e.terms) names.push_back(t.name);
  return names;
}

double Utilisation(const ModelInputs& in, const std::string& transport) {
  return MustEstimate(in, transport).utilisation;
}

// ----- shape and delta fraction -----

TEST(BenchModelTest, ShapeCountsNodesAndInstances) {
  ModelInputs in = SevenB();
  in.trainer_gpus = 16;      // 2 nodes of 8
  in.replica_gpus = 24;      // 3 nodes
  in.gpus_per_replica = 12;  // 2 instances, each over ceil(12 / 8) = 2 nodes
  const Shape s = ShapeOf(in);
  EXPECT_EQ(s.trainer_nodes, 2);
  EXPECT_EQ(s.replica_nodes, 3);
  EXPECT_EQ(s.instances, 2);
  EXPECT_EQ(s.nodes_per_instance, 2);
  EXPECT_EQ(s.gpus_per_replica_node, 8);
  in.replica_gpus = 4;
  in.gpus_per_replica = 1;  // 4 one-GPU instances on one node holding 4 GPUs
  EXPECT_EQ(ShapeOf(in).gpus_per_replica_node, 4);
  EXPECT_EQ(ShapeOf(in).instances, 4);
}

TEST(BenchModelTest, DeltaFractionAveragesKeyframesOverThePeriod) {
  ModelInputs in = SevenB();
  in.keyframe_interval = 0;  // only the first version is a keyframe: 1 / 100
  EXPECT_DOUBLE_EQ(DeltaFraction(in), 0.01);
  in.keyframe_interval = 50;  // 1 / (50 x 1.5) + 49 / (50 x 100) = 0.013333 + 0.0098
  EXPECT_NEAR(DeltaFraction(in), 1.0 / 75 + 0.0098, 1e-15);
  in.keyframe_interval = 1;  // every version a keyframe
  EXPECT_DOUBLE_EQ(DeltaFraction(in), 1 / 1.5);
}

// ----- each transport by hand -----

TEST(BenchModelTest, UcxPullOneInstance) {
  // d2h 14e9 / 8 GPUs / 50 GB/s = 0.035; stage 14e9 / 1 node / 100 GB/s = 0.14 (both stall);
  // latency 0.002; pull max(14e9 x 8/8 / 400 GB/s, 1 x 14e9 / 1 / 400 GB/s) = 0.035;
  // apply 14e9 / 8 / 50 GB/s = 0.035.
  const Estimate e = MustEstimate(SevenB(), "ucx");
  EXPECT_THAT(TermNames(e), ::testing::ElementsAre("d2h", "stage", "latency", "pull", "apply"));
  EXPECT_DOUBLE_EQ(TermOf(e, "d2h"), 0.035);
  EXPECT_DOUBLE_EQ(TermOf(e, "stage"), 0.14);
  EXPECT_DOUBLE_EQ(TermOf(e, "pull"), 0.035);
  EXPECT_DOUBLE_EQ(TermOf(e, "apply"), 0.035);
  EXPECT_NEAR(e.stall_s, 0.175, 1e-12);
  EXPECT_NEAR(e.transfer_s, 0.247, 1e-12);
  EXPECT_NEAR(e.exposed_s, 0.247, 1e-12);  // lockstep: everything is exposed
  EXPECT_NEAR(e.utilisation, 60 / 60.247, 1e-12);
  // Per 1,000 steps: 0.247 s x 8 trainer GPUs = 0.5489 GPU-h; x 16 GPUs = 1.0978; x $2.
  EXPECT_NEAR(e.trainer_idle_gpu_h, 0.247 * 8 * 1000 / 3600, 1e-12);
  EXPECT_NEAR(e.fleet_idle_gpu_h, 0.247 * 16 * 1000 / 3600, 1e-12);
  EXPECT_NEAR(e.fleet_idle_dollars, 2 * 0.247 * 16 * 1000 / 3600, 1e-12);
  EXPECT_NEAR(e.trainer_idle_dollars, 2 * 0.247 * 8 * 1000 / 3600, 1e-12);
  EXPECT_EQ(e.wire_bytes, 14e9);
  EXPECT_EQ(e.bandwidth_of, "network");
}

TEST(BenchModelTest, UcxPullIsBoundByTrainerEgressWithManyInstances) {
  ModelInputs in = SevenB();
  in.replica_gpus = 512;  // 64 instances of 8 GPUs, all pulling from one trainer node
  // pull = max(14e9 / 400e9 = 0.035, 64 x 14e9 / 1 / 400e9 = 2.24)
  EXPECT_DOUBLE_EQ(TermOf(MustEstimate(in, "ucx"), "pull"), 2.24);
  in.trainer_gpus = 64;  // 8 trainer nodes share the egress: 64 x 14e9 / 8 / 400e9 = 0.28
  EXPECT_DOUBLE_EQ(TermOf(MustEstimate(in, "ucx"), "pull"), 0.28);
}

TEST(BenchModelTest, UcxSmallInstancesShareTheirNodesIngress) {
  ModelInputs in = SevenB();
  in.gpus_per_replica = 1;  // 8 one-GPU instances on one node, each pulling the whole 14 GB
  // pull = max(14e9 x 8/1 / 400e9, 8 x 14e9 / 400e9) = 0.28; apply 14e9 / 1 / 50e9 = 0.28
  const Estimate e = MustEstimate(in, "ucx");
  EXPECT_DOUBLE_EQ(TermOf(e, "pull"), 0.28);
  EXPECT_DOUBLE_EQ(TermOf(e, "apply"), 0.28);
}

TEST(BenchModelTest, UcxWithGpuDirectLikePerplexitysOneTrillion) {
  // 1T fp8 (1e12 B), 256 trainer GPUs (32 nodes), 128 inference GPUs as 8 instances of 16 (two
  // nodes each), no copies through host memory: pull = max(1e12 x 8/16 / 400e9 = 1.25,
  // 8 x 1e12 / 32 / 400e9 = 0.625) = 1.25 s, plus 2 ms of latency.
  ModelInputs in = SevenB();
  in.model_bytes = 1e12;
  in.trainer_gpus = 256;
  in.replica_gpus = 128;
  in.gpus_per_replica = 16;
  in.d2h_gbs = in.stage_gbs = in.apply_gbs = kInf;
  const Estimate e = MustEstimate(in, "ucx");
  EXPECT_DOUBLE_EQ(TermOf(e, "pull"), 1.25);
  EXPECT_DOUBLE_EQ(e.stall_s, 0);
  EXPECT_NEAR(e.transfer_s, 1.252, 1e-12);
}

TEST(BenchModelTest, ASingleSourceGathersThenServesEveryInstanceFromOneNode) {
  // The issue-12 setting: 1T fp8, 256 trainer GPUs (32 nodes), 8 instances of 16 GPUs, IB NDR
  // (8 x 50 GB/s per node), weightbus's host copies. Sharded publish (every trainer GPU its own
  // shard, the default) against one source:
  //   sharded: d2h 1e12/256/50e9 = 0.078, stage 1e12/32/100e9 = 0.3125, latency 0.002,
  //            pull max(1e12 x 8/16 / 400e9 = 1.25, 8 x 1e12/32/400e9 = 0.625) = 1.25,
  //            apply 1e12/16/50e9 = 1.25: 2.8926 s, stall 0.3906;
  //   one source: gather (1e12/1 - 1e12/32)/400e9 = 2.421875, d2h 1e12/50e9 = 20,
  //            stage 1e12/100e9 = 10, latency, pull 8 x 1e12/400e9 = 20 (the source node's egress
  //            serves all 8 instances), apply 1.25: 53.67 s, stall 32.42 s.
  ModelInputs in = SevenB();
  in.model_bytes = 1e12;
  in.trainer_gpus = 256;
  in.replica_gpus = 128;
  in.gpus_per_replica = 16;
  const Estimate sharded = MustEstimate(in, "ucx");
  EXPECT_EQ(sharded.publishers, 256);
  EXPECT_EQ(TermNames(sharded),
            (std::vector<std::string>{"d2h", "stage", "latency", "pull", "apply"}));
  EXPECT_NEAR(sharded.transfer_s, 2.892625, 1e-9);
  in.publishers = 256;  // the same, said explicitly
  EXPECT_DOUBLE_EQ(MustEstimate(in, "ucx").transfer_s, sharded.transfer_s);
  in.publishers = 1;
  EXPECT_EQ(ShapeOf(in).publisher_nodes, 1);
  const Estimate one = MustEstimate(in, "ucx");
  EXPECT_EQ(one.publishers, 1);
  EXPECT_EQ(TermNames(one),
            (std::vector<std::string>{"gather", "d2h", "stage", "latency", "pull", "apply"}));
  EXPECT_DOUBLE_EQ(TermOf(one, "gather"), (1e12 - 1e12 / 32) / 400e9);
  EXPECT_DOUBLE_EQ(TermOf(one, "d2h"), 20);
  EXPECT_DOUBLE_EQ(TermOf(one, "stage"), 10);
  EXPECT_DOUBLE_EQ(TermOf(one, "pull"), 20);
  EXPECT_NEAR(one.stall_s, 2.421875 + 30, 1e-9);
  EXPECT_NEAR(one.transfer_s, 2.421875 + 30 + 0.002 + 20 + 1.25, 1e-9);
  // The whole trainer idles either way: trainer GPU-hours count all 256.
  EXPECT_NEAR(one.trainer_idle_gpu_h, one.exposed_s * 256 * 1000 / 3600, 1e-6);
  // One source per node (32): no gather across nodes, the pull's source spread as sharded.
  in.publishers = 32;
  EXPECT_EQ(ShapeOf(in).publisher_nodes, 4);  // 32 GPUs on the first 4 nodes of 8
  const Estimate node_each = MustEstimate(in, "ucx");
  EXPECT_DOUBLE_EQ(TermOf(node_each, "gather"), (1e12 / 4 - 1e12 / 32) / 400e9);
  // disk writes from the sources' nodes only; nccl is unchanged (its roots are its sources).
  in.publishers = 1;
  EXPECT_DOUBLE_EQ(TermOf(MustEstimate(in, "disk"), "write"), 1e12 / 10e9);
  in.publishers = 0;
  EXPECT_DOUBLE_EQ(TermOf(MustEstimate(in, "disk"), "write"), 1e12 / 100e9);
  ModelInputs nccl1 = in;
  nccl1.publishers = 1;
  EXPECT_DOUBLE_EQ(MustEstimate(nccl1, "nccl").transfer_s, MustEstimate(in, "nccl").transfer_s);
  // delta+ucx encodes on the sources' nodes.
  EXPECT_DOUBLE_EQ(TermOf(MustEstimate(nccl1, "delta+ucx"), "encode"), 1e12 / 20e9);
}

TEST(BenchModelTest, NcclBroadcastIsLimitedByItsRootsNics) {
  // One root: one GPU's share of the node's 8 NICs, 400 / 8 = 50 GB/s: 14e9 / 50e9 = 0.28 s plus
  // 2 ms; the trainer takes part throughout, and nothing goes through host memory.
  ModelInputs in = SevenB();
  Estimate e = MustEstimate(in, "nccl");
  EXPECT_THAT(TermNames(e), ::testing::ElementsAre("latency", "broadcast"));
  EXPECT_DOUBLE_EQ(TermOf(e, "broadcast"), 0.28);
  EXPECT_NEAR(e.stall_s, 0.282, 1e-12);
  EXPECT_NEAR(e.transfer_s, 0.282, 1e-12);
  // Independent of the number of receivers.
  in.replica_gpus = 512;
  EXPECT_DOUBLE_EQ(TermOf(MustEstimate(in, "nccl"), "broadcast"), 0.28);
  // 8 roots: 8 x 50 = 400 GB/s, the receiving node's links: 0.035 s; 16 roots cannot beat it.
  in.broadcast_roots = 8;
  EXPECT_DOUBLE_EQ(TermOf(MustEstimate(in, "nccl"), "broadcast"), 0.035);
  in.trainer_gpus = 16;
  in.broadcast_roots = 16;
  EXPECT_DOUBLE_EQ(TermOf(MustEstimate(in, "nccl"), "broadcast"), 0.035);
  // One 100 GbE NIC per node: a single root has all of it, 14e9 / 12.5e9 = 1.12 s.
  in.broadcast_roots = 1;
  in.node_gbs = 12.5;
  in.nics_per_node = 1;
  EXPECT_DOUBLE_EQ(TermOf(MustEstimate(in, "nccl"), "broadcast"), 1.12);
  // AWS p5: 32 EFA NICs of 12.5 GB/s over 8 GPUs: a root has 4 of them, 400 / 8 = 50 GB/s.
  in.node_gbs = 400;
  in.nics_per_node = 32;
  EXPECT_DOUBLE_EQ(TermOf(MustEstimate(in, "nccl"), "broadcast"), 0.28);
}

TEST(BenchModelTest, DiskWritesThenReads) {
  // 16 trainer GPUs (2 nodes), 64 replica GPUs in 8 instances of 8, shared FS 10/10/100 GB/s.
  // d2h 14e9 / 16 / 50e9 = 0.0175; write 14e9 / min(2 x 10, 100) GB/s = 0.7 (stall);
  // latency 0.05; read max(14e9 x 8/8 / 10e9 = 1.4, 8 x 14e9 / 100e9 = 1.12) = 1.4;
  // apply 14e9 / 8 / 50e9 = 0.035.
  ModelInputs in = SevenB();
  in.trainer_gpus = 16;
  in.replica_gpus = 64;
  Estimate e = MustEstimate(in, "disk");
  EXPECT_THAT(TermNames(e), ::testing::ElementsAre("d2h", "write", "latency", "read", "apply"));
  EXPECT_DOUBLE_EQ(TermOf(e, "write"), 0.7);
  EXPECT_DOUBLE_EQ(TermOf(e, "read"), 1.4);
  EXPECT_NEAR(e.stall_s, 0.7175, 1e-12);
  EXPECT_NEAR(e.transfer_s, 0.0175 + 0.7 + 0.05 + 1.4 + 0.035, 1e-12);
  EXPECT_EQ(e.bandwidth_of, "storage");
  // 16 instances: the aggregate binds, 16 x 14e9 / 100e9 = 2.24.
  in.replica_gpus = 128;
  EXPECT_DOUBLE_EQ(TermOf(MustEstimate(in, "disk"), "read"), 2.24);
  // 20 trainer nodes would write at 200 GB/s but the system takes 100: 14e9 / 100e9.
  in.trainer_gpus = 160;
  EXPECT_DOUBLE_EQ(TermOf(MustEstimate(in, "disk"), "write"), 0.14);
}

TEST(BenchModelTest, DeltaUcxEncodesSendsTheDeltaAndDecodes) {
  // K = 0, ratio 100: 0.14 GB on the wire. d2h 0.035 and encode 14e9 / 1 node / 20e9 = 0.7 and
  // stage 0.14e9 / 100e9 = 0.0014 stall; latency 0.002; pull 0.14e9 / 400e9 = 0.00035;
  // decode 14e9 x 8/8 / 40e9 = 0.35; apply 0.035.
  const Estimate e = MustEstimate(SevenB(), "delta+ucx");
  EXPECT_THAT(TermNames(e), ::testing::ElementsAre("d2h", "encode", "stage", "latency", "pull",
                                                   "decode", "apply"));
  EXPECT_DOUBLE_EQ(e.wire_bytes, 0.14e9);
  EXPECT_DOUBLE_EQ(TermOf(e, "encode"), 0.7);
  EXPECT_DOUBLE_EQ(TermOf(e, "decode"), 0.35);
  EXPECT_NEAR(e.stall_s, 0.035 + 0.7 + 0.0014, 1e-12);
  EXPECT_NEAR(e.transfer_s, 0.035 + 0.7 + 0.0014 + 0.002 + 0.00035 + 0.35 + 0.035, 1e-12);
}

TEST(BenchModelTest, DeltaDiskAndDeltaNccl) {
  ModelInputs in = SevenB();
  in.keyframe_interval = 50;  // 2.3133% of 14 GB = 323.87 MB on the wire
  const Estimate disk = MustEstimate(in, "delta+disk");
  EXPECT_NEAR(disk.wire_bytes, 14e9 * (1.0 / 75 + 0.0098), 1e-3);
  EXPECT_NEAR(TermOf(disk, "write"), disk.wire_bytes / 10e9, 1e-12);
  // A codec on top of nccl goes through host memory: d2h, encode, broadcast, decode, apply.
  const Estimate nccl = MustEstimate(in, "delta+nccl");
  EXPECT_THAT(TermNames(nccl),
              ::testing::ElementsAre("d2h", "encode", "latency", "broadcast", "decode", "apply"));
  EXPECT_NEAR(TermOf(nccl, "broadcast"), nccl.wire_bytes / 50e9, 1e-12);
}

TEST(BenchModelTest, OverlapHidesTransferButNeverTheStall) {
  ModelInputs in = SevenB();  // ucx: stall 0.175, transfer 0.247
  in.step_s = 0.1;
  in.overlap = 0.5;  // max(0.175, 0.247 - 0.05) = 0.197
  EXPECT_NEAR(MustEstimate(in, "ucx").exposed_s, 0.197, 1e-12);
  in.overlap = 1;  // max(0.175, 0.147) = 0.175
  EXPECT_NEAR(MustEstimate(in, "ucx").exposed_s, 0.175, 1e-12);
  EXPECT_NEAR(MustEstimate(in, "ucx").utilisation, 0.1 / 0.275, 1e-12);
  // nccl stalls the trainer for the whole broadcast: overlap changes nothing.
  EXPECT_NEAR(MustEstimate(in, "nccl").exposed_s, 0.282, 1e-12);
}

// ----- bandwidth for a target utilisation -----

TEST(BenchModelTest, BandwidthForMatchesTheClosedForm) {
  // No copies, no latency: ucx time = 14e9 / B. 99% of a 60 s step leaves 60/99 s, so
  // B >= 14 x 99 / 60 = 23.1 GB/s; for 90%: 14 x 9 / 60 = 2.1 GB/s.
  ModelInputs in = SevenB();
  in.d2h_gbs = in.stage_gbs = in.apply_gbs = kInf;
  in.net_latency_s = 0;
  EXPECT_NEAR(BandwidthFor(in, "ucx", 0.99), 23.1, 23.1 * 1e-8);
  EXPECT_NEAR(BandwidthFor(in, "ucx", 0.90), 2.1, 2.1 * 1e-8);
}

TEST(BenchModelTest, BandwidthForIsTheSmallestThatReachesTheTarget) {
  for (const std::string& t : ModelTransports()) {
    for (double target : {0.9, 0.99}) {
      ModelInputs in = SevenB();
      in.step_s = 200;
      const double gbs = BandwidthFor(in, t, target);
      ASSERT_TRUE(std::isfinite(gbs)) << t << " " << target;
      ModelInputs at = in, below = in;
      if (t == "disk" || t == "delta+disk") {
        const double x = gbs / in.storage_read_gbs;
        at.storage_read_gbs *= x, at.storage_write_gbs *= x, at.storage_aggregate_gbs *= x;
        const double y = x * (1 - 1e-6);
        below.storage_read_gbs *= y, below.storage_write_gbs *= y;
        below.storage_aggregate_gbs *= y;
      } else {
        at.node_gbs = gbs;
        below.node_gbs = gbs * (1 - 1e-6);
      }
      EXPECT_GE(Utilisation(at, t), target - 1e-12) << t;
      EXPECT_LT(Utilisation(below, t), target) << t;
    }
  }
}

TEST(BenchModelTest, BandwidthForIsFiniteWhenTheGivenBandwidthIsInfinite) {
  // With --network-gbs inf (or infinite storage) the target is met, and the answer is the same
  // finite bandwidth as when starting from any finite one.
  ModelInputs finite = SevenB(), infinite = SevenB();
  infinite.node_gbs = kInf;
  infinite.storage_write_gbs = infinite.storage_read_gbs = infinite.storage_aggregate_gbs = kInf;
  int finite_answers = 0;
  for (const std::string t : {"ucx", "nccl", "disk", "delta+ucx"}) {
    for (double target : {0.9, 0.99}) {
      const double want = BandwidthFor(finite, t, target);
      finite_answers += std::isfinite(want);
      const double got = BandwidthFor(infinite, t, target);
      if (std::isinf(want)) {  // the other terms alone miss the target: no bandwidth helps
        EXPECT_TRUE(std::isinf(got)) << t << " " << target;
        continue;
      }
      ASSERT_TRUE(std::isfinite(got)) << t << " " << target;
      if (t != "disk") {
        EXPECT_NEAR(got, want, want * 1e-6) << t << " " << target;
      } else {  // disk scales write, read and total together: from equal ones here
        EXPECT_GT(got, 0) << t;
      }
    }
  }
  EXPECT_GE(finite_answers, 6);
}

TEST(BenchModelTest, BandwidthForIsInfiniteWhenTheStallAloneIsTooLong) {
  // Encoding 14 GB at 0.1 GB/s takes 140 s: no network makes a 60 s step 90% busy.
  ModelInputs in = SevenB();
  in.encode_gbs = 0.1;
  EXPECT_TRUE(std::isinf(BandwidthFor(in, "delta+ucx", 0.9)));
  EXPECT_TRUE(std::isinf(MustEstimate(in, "delta+ucx").gbs_for_90));
  EXPECT_TRUE(std::isnan(BandwidthFor(in, "carrier-pigeon", 0.9)));
}

// ----- validation -----

TEST(BenchModelTest, InvalidInputsAreInvalidArgument) {
  auto code = [](ModelInputs in, const std::string& t = "ucx") {
    return EstimateTransport(in, t).status().code();
  };
  ModelInputs in = SevenB();
  EXPECT_EQ(code(in), absl::StatusCode::kOk);
  for (auto mutate : std::vector<void (*)(ModelInputs&)>{
           [](ModelInputs& m) { m.model_bytes = 0; }, [](ModelInputs& m) { m.model_bytes = kInf; },
           [](ModelInputs& m) { m.trainer_gpus = 0; }, [](ModelInputs& m) { m.gpus_per_node = -1; },
           [](ModelInputs& m) { m.replica_gpus = 12; },    // not a multiple of 8 per replica
           [](ModelInputs& m) { m.broadcast_roots = 9; },  // more than 8 trainer GPUs
           [](ModelInputs& m) { m.publishers = 9; }, [](ModelInputs& m) { m.publishers = -1; },
           [](ModelInputs& m) { m.nics_per_node = 0; }, [](ModelInputs& m) { m.node_gbs = 0; },
           [](ModelInputs& m) { m.node_gbs = std::nan(""); },
           [](ModelInputs& m) { m.apply_gbs = -5; }, [](ModelInputs& m) { m.step_s = 0; },
           [](ModelInputs& m) { m.overlap = 1.5; }, [](ModelInputs& m) { m.overlap = -0.1; },
           [](ModelInputs& m) { m.net_latency_s = -1; }, [](ModelInputs& m) { m.gpu_price = -1; },
           [](ModelInputs& m) { m.keyframe_interval = -1; },
           [](ModelInputs& m) { m.delta_ratio = 0; }}) {
    ModelInputs bad = in;
    mutate(bad);
    EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ValidateInputs(bad).code(), absl::StatusCode::kInvalidArgument);
  }
  for (const char* t : {"foo", "delta+foo", "nccl+delta", "delta+delta+ucx", "delta", ""}) {
    EXPECT_EQ(code(in, t), absl::StatusCode::kInvalidArgument) << t;
  }
  EXPECT_THAT(std::string(EstimateTransport(in, "foo").status().message()), HasSubstr("\"foo\""));
  ModelInputs bad = in;
  bad.overlap = 2;
  EXPECT_THAT(std::string(ValidateInputs(bad).message()), HasSubstr("overlap"));
  // Rates may be infinite ("no copy"); that is valid.
  in.d2h_gbs = in.stage_gbs = in.apply_gbs = kInf;
  EXPECT_EQ(code(in), absl::StatusCode::kOk);
}

// ----- presets, dtypes, parameter counts, checkpoints -----

TEST(BenchModelTest, PresetsAreSane) {
  std::set<std::string> names;
  for (const FabricPreset& f : FabricPresets()) {
    EXPECT_TRUE(names.insert(f.name).second) << f.name;
    EXPECT_GT(f.link_gbs, 0) << f.name;
    EXPECT_GE(f.links_per_node, 1) << f.name;
    EXPECT_FALSE(f.what.empty() || f.source.empty()) << f.name;
    EXPECT_EQ(FindFabric(f.name), &f);
  }
  for (const StoragePreset& s : StoragePresets()) {
    EXPECT_TRUE(names.insert(s.name).second) << s.name;
    EXPECT_GT(s.write_gbs, 0) << s.name;
    EXPECT_GT(s.read_gbs, 0) << s.name;
    EXPECT_GE(s.aggregate_gbs, std::max(s.write_gbs, s.read_gbs)) << s.name;
    EXPECT_GE(s.latency_s, 0) << s.name;
    EXPECT_FALSE(s.what.empty() || s.source.empty()) << s.name;
    EXPECT_EQ(FindStorage(s.name), &s);
  }
  // Line rates: NDR 400 Gb/s = 50 GB/s per NIC, 8 per node; HDR half; 100 GbE 12.5 GB/s.
  ASSERT_NE(FindFabric("ib-ndr"), nullptr);
  EXPECT_EQ(FindFabric("ib-ndr")->link_gbs * FindFabric("ib-ndr")->links_per_node, 400);
  EXPECT_EQ(FindFabric("ib-hdr")->link_gbs, 25);
  EXPECT_EQ(FindFabric("eth-100g")->link_gbs, 12.5);
  EXPECT_EQ(FindFabric("eth-1g")->link_gbs, 0.125);
  EXPECT_EQ(FindFabric("nope"), nullptr);
  EXPECT_EQ(FindStorage("nope"), nullptr);
  for (const char* name : {"nvme", "shared-fs", "nfs"}) EXPECT_NE(FindStorage(name), nullptr);
}

TEST(BenchModelTest, DtypesAndParameterCounts) {
  EXPECT_EQ(BytesPerParam("bf16"), 2);
  EXPECT_EQ(BytesPerParam("BF16"), 2);
  EXPECT_EQ(BytesPerParam("fp32"), 4);
  EXPECT_EQ(BytesPerParam("fp8"), 1);
  EXPECT_EQ(BytesPerParam("int4"), 0.5);
  EXPECT_EQ(BytesPerParam("fp12"), std::nullopt);
  EXPECT_EQ(*ParseParamCount("7B"), 7e9);
  EXPECT_EQ(*ParseParamCount("70e9"), 70e9);
  EXPECT_EQ(*ParseParamCount("1T"), 1e12);
  EXPECT_EQ(*ParseParamCount("1.5m"), 1.5e6);
  EXPECT_EQ(*ParseParamCount("260K"), 260e3);
  EXPECT_EQ(*ParseParamCount("8G"), 8e9);
  for (const char* bad : {"", "B", "abc", "7X", "-1B", "0", "inf", "1e400"}) {
    EXPECT_EQ(ParseParamCount(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(BenchModelTest, MeasuresSafetensorsCheckpointsFromTheirHeaders) {
  testing::ScratchDir dir;
  std::vector<std::byte> a(4 * 8 * 2), b(3 * 4), c(10 * 2);
  const std::vector<TensorView> one = {{"a", DType::kBF16, {4, 8}, {}, a.data()},
                                       {"b", DType::kF32, {3}, {}, b.data()}};
  const std::vector<TensorView> two = {{"c", DType::kBF16, {10}, {}, c.data()}};
  ASSERT_TRUE(safetensors::WriteFile(dir / "one.safetensors", one, {}).ok());
  // A file: 32 + 3 = 35 parameters, 64 + 12 = 76 bytes, two dtypes.
  absl::StatusOr<CheckpointSize> s = MeasureCheckpoint(dir / "one.safetensors");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->parameters, 35);
  EXPECT_EQ(s->bytes, 76);
  EXPECT_EQ(s->dtype, "mixed");
  // A sharded directory: the index names both files (one twice).
  ASSERT_TRUE(safetensors::WriteFile(dir / "two.safetensors", two, {}).ok());
  testing::WriteFileOrDie(
      dir / "model.safetensors.index.json",
      R"({"metadata": {}, "weight_map": {"a": "one.safetensors", "b": "one.safetensors",
          "c": "two.safetensors"}})");
  s = MeasureCheckpoint(dir.path());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->parameters, 45);
  EXPECT_EQ(s->bytes, 96);
  // A directory with model.safetensors.
  testing::ScratchDir single;
  ASSERT_TRUE(safetensors::WriteFile(single / "model.safetensors", two, {}).ok());
  s = MeasureCheckpoint(single.path());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->bytes, 20);
  EXPECT_EQ(s->dtype, "BF16");
  // Errors.
  EXPECT_EQ(MeasureCheckpoint(dir / "missing").status().code(), absl::StatusCode::kNotFound);
  testing::ScratchDir none;
  EXPECT_EQ(MeasureCheckpoint(none.path()).status().code(), absl::StatusCode::kInvalidArgument);
  testing::WriteFileOrDie(none / "junk.safetensors", "not a safetensors file");
  EXPECT_EQ(MeasureCheckpoint(none / "junk.safetensors").status().code(),
            absl::StatusCode::kDataLoss);
}

TEST(BenchModelTest, MeasuresLlama2cCheckpointsWithoutTheirRopeTables) {
  // stories260K: 260,032 parameters (BENCHMARKS.md), the same count as its Hugging Face tensors.
  const std::string path = testing::FixturePath("stories260K.bin");
  absl::StatusOr<CheckpointSize> s = MeasureCheckpoint(path);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->parameters, 260032);
  EXPECT_EQ(s->bytes, 4 * 260032);
  EXPECT_EQ(s->dtype, "F32");
  absl::StatusOr<tools::Llama2cCheckpoint> ckpt = tools::ReadLlama2c(path);
  ASSERT_TRUE(ckpt.ok());
  absl::StatusOr<std::vector<tools::OwnedTensor>> hf = tools::ConvertToHf(*ckpt, DType::kF32);
  ASSERT_TRUE(hf.ok());
  double n = 0;
  for (const tools::OwnedTensor& t : *hf) n += t.bytes.size() / 4.0;
  EXPECT_EQ(s->parameters, n);
  // A truncated file is refused.
  testing::ScratchDir dir;
  const std::string whole = testing::ReadFileOrDie(path);
  testing::WriteFileOrDie(dir / "short.bin", whole.substr(0, whole.size() - 4));
  EXPECT_EQ(MeasureCheckpoint(dir / "short.bin").status().code(), absl::StatusCode::kDataLoss);
}

// ----- calibration -----

// A run of a 1 GB model with 2 subscribers, as `weightbus-bench run --json` writes it (only the
// fields the calibration reads, plus a warm-up version that must be ignored).
//   ucx: fetch (slowest per version) 0.5, 0.3 -> median 0.4 -> 2 x 1 GB / 0.4 s = 5 GB/s;
//        residual per version: ready - stall - receive of the slowest replica:
//        v2: 0.62 - 0.1 - (0.5 + 0.01) = 0.01; v3: 0.43 - 0.1 - (0.3 + 0.01) = 0.02.
//   disk: fetch 0.25, 0.15 -> 0.2 -> 10 GB/s read; residuals 0.5-0.2-0.26 = 0.04,
//        0.4-0.2-0.16 = 0.04 -> 0.04.
//   delta+ucx: wire 20 MB -> ratio 50; version 1 wire 0.5 GB -> keyframe 2x; encode 0.25 s
//        -> 4 GB/s; decode (slowest) 0.4, 0.6 -> 0.5 -> 2 x 1 GB / 0.5 s = 4 GB/s.
//   apply (slowest per version) 0.01 everywhere but delta+ucx's 0.02 -> median of the
//        transports' medians (0.01, 0.01, 0.02) = 0.01 -> 100 GB/s.
//   baselines: memcpy 10 GB/s, write+fsync 2 GB/s, pread 4 GB/s, ucx_perftest 8 GB/s.
nlohmann::json RunJson() {
  auto replica = [](double ready, double fetch, double apply, double decode = 0) {
    return nlohmann::json{{"ok", true},       {"ready_s", ready},   {"allocate_s", 0.0},
                          {"fetch_s", fetch}, {"decode_s", decode}, {"verify_s", 0.0},
                          {"apply_s", apply}, {"wire_bytes", 0}};
  };
  auto version = [](int v, bool measured, double stall, double encode, double wire,
                    std::vector<nlohmann::json> replicas) {
    return nlohmann::json{{"version", v},        {"measured", measured}, {"published", true},
                          {"stall_s", stall},    {"encode_s", encode},   {"wire_bytes", wire},
                          {"replicas", replicas}};
  };
  auto summary = [](double median) {
    return nlohmann::json{{"median", median}, {"p99", median}, {"count", 2}};
  };
  nlohmann::json j;
  j["tool"] = "weightbus-bench run";
  j["config"] = {
      {"host", {{"system", "Linux"}, {"release", "6.1"}, {"machine", "x86_64"}, {"cores", 2}}},
      {"settings", {"keyframe_interval=7"}}};
  j["model_bytes"] = 1e9;
  j["subscribers"] = 2;
  j["transports"] = {
      {{"name", "ucx"},
       {"stall_s", summary(0.1)},
       {"last_replica_s", summary(0.525)},
       {"wire_bytes_per_version", 1e9},
       {"versions",
        {version(1, false, 9, 0, 1e9, {replica(9, 9, 9), replica(9, 9, 9)}),
         version(2, true, 0.1, 0, 1e9, {replica(0.60, 0.45, 0.01), replica(0.62, 0.5, 0.01)}),
         version(3, true, 0.1, 0, 1e9, {replica(0.43, 0.3, 0.01), replica(0.40, 0.2, 0.01)})}}},
      {{"name", "disk"},
       {"stall_s", summary(0.2)},
       {"last_replica_s", summary(0.45)},
       {"wire_bytes_per_version", 1e9},
       {"versions",
        {version(2, true, 0.2, 0, 1e9, {replica(0.5, 0.25, 0.01), replica(0.3, 0.1, 0.01)}),
         version(3, true, 0.2, 0, 1e9, {replica(0.4, 0.15, 0.01), replica(0.3, 0.1, 0.01)})}}},
      {{"name", "delta+ucx"},
       {"stall_s", summary(0.3)},
       {"last_replica_s", summary(0.8)},
       {"wire_bytes_per_version", 20e6},
       {"versions",
        {version(1, false, 1, 0.5, 0.5e9, {replica(2, 1, 0.02, 0.9)}),
         version(2, true, 0.3, 0.25, 20e6,
                 {replica(0.8, 0.45, 0.02, 0.4), replica(0.7, 0.4, 0.02, 0.3)}),
         version(3, true, 0.3, 0.25, 20e6,
                 {replica(0.9, 0.65, 0.02, 0.6), replica(0.8, 0.5, 0.02, 0.5)})}}}};
  j["baselines"] = {
      {{"name", "memcpy"}, {"ran", true}, {"rate_gbs", 10.0}, {"raw", nlohmann::json::object()}},
      {{"name", "write+read"},
       {"ran", true},
       {"rate_gbs", 4.0},
       {"raw", {{"write_gbs", 2.0}, {"read_gbs", 4.0}}}},
      {{"name", "ucx_perftest"}, {"ran", true}, {"rate_gbs", 8.0}, {"raw", nullptr}},
      {{"name", "torch.save"}, {"ran", false}, {"rate_gbs", 0.0}, {"raw", nullptr}}};
  return j;
}

double Figure(const Calibration& c, const std::string& key) {
  auto it = c.figures.find(key);
  if (it == c.figures.end()) {
    ADD_FAILURE() << "no calibrated " << key;
    return -1;
  }
  EXPECT_FALSE(it->second.how.empty()) << key;
  return it->second.value;
}

TEST(BenchModelTest, CalibrationMapsEveryMeasuredFigure) {
  absl::StatusOr<Calibration> c = CalibrateFromRun(RunJson(), "run.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_bytes, 1e9);
  EXPECT_EQ(c->subscribers, 2);
  EXPECT_EQ(c->host, "Linux 6.1 x86_64, 2 cores");
  EXPECT_NEAR(Figure(*c, "network-gbs"), 5, 1e-12);
  EXPECT_NEAR(Figure(*c, "storage-read-gbs"), 10, 1e-12);
  EXPECT_NEAR(Figure(*c, "storage-write-gbs"), 2, 1e-12);
  EXPECT_NEAR(Figure(*c, "storage-aggregate-gbs"), 10, 1e-12);
  EXPECT_NEAR(Figure(*c, "stage-gbs"), 10, 1e-12);
  EXPECT_NEAR(Figure(*c, "apply-gbs"), 100, 1e-9);
  // ucx residuals 0.01 and 0.02; delta+ucx: v2 0.8 - 0.3 - 0.47 = 0.03, v3 0.9 - 0.3 - 0.67 =
  // -0.07: median of (0.01, 0.02, 0.03, -0.07) = 0.015.
  EXPECT_NEAR(Figure(*c, "latency-s"), 0.015, 1e-12);
  EXPECT_NEAR(Figure(*c, "storage-latency-s"), 0.04, 1e-12);
  EXPECT_NEAR(Figure(*c, "delta-ratio"), 50, 1e-12);
  EXPECT_NEAR(Figure(*c, "keyframe-ratio"), 2, 1e-12);
  EXPECT_EQ(Figure(*c, "keyframe-interval"), 7);
  EXPECT_NEAR(Figure(*c, "encode-gbs"), 4, 1e-12);
  EXPECT_NEAR(Figure(*c, "decode-gbs"), 4, 1e-12);
  // The bound: every subscriber at ucx_perftest's and pread's one-pair rates, memcpy copies, no
  // latency.
  EXPECT_NEAR(c->bound.at("network-gbs").value, 16, 1e-12);
  EXPECT_NEAR(c->bound.at("storage-read-gbs").value, 8, 1e-12);
  EXPECT_NEAR(c->bound.at("apply-gbs").value, 10, 1e-12);
  EXPECT_EQ(c->bound.at("latency-s").value, 0);
  ASSERT_EQ(c->measured.size(), 3u);
  EXPECT_EQ(c->measured[0].name, "ucx");
  EXPECT_EQ(c->measured[0].stall_s, 0.1);
  EXPECT_EQ(c->measured[0].last_s, 0.525);
}

TEST(BenchModelTest, ThisMachinePredictionAddsTheCalibratedPhases) {
  absl::StatusOr<Calibration> c = CalibrateFromRun(RunJson(), "run.json");
  ASSERT_TRUE(c.ok()) << c.status();
  ModelInputs in = SevenB();
  for (const auto& [key, f] : c->figures) ASSERT_TRUE(SetInput(in, key, f.value)) << key;
  in = ThisMachine(in, *c);
  EXPECT_EQ(in.model_bytes, 1e9);
  EXPECT_EQ(in.keyframe_interval, 0);  // the measured versions are all deltas
  // ucx: stage 1e9 / 10e9 = 0.1; latency 0.015; pull 2 x 1e9 / 5e9 = 0.4 (both replicas on one
  // node); apply 1e9 / 100e9 = 0.01: 0.525, the measured median.
  const Estimate ucx = MustEstimate(in, "ucx");
  EXPECT_NEAR(ucx.stall_s, 0.1, 1e-12);
  EXPECT_NEAR(ucx.transfer_s, 0.525, 1e-12);
  // disk: write 1e9 / 2e9 = 0.5 stall; latency 0.04; read 2 x 1e9 / 10e9 = 0.2; apply 0.01.
  const Estimate disk = MustEstimate(in, "disk");
  EXPECT_NEAR(disk.stall_s, 0.5, 1e-12);
  EXPECT_NEAR(disk.transfer_s, 0.75, 1e-12);
  EXPECT_FALSE(SetInput(in, "no-such-input", 1));
}

TEST(BenchModelTest, CalibrationRefusesWhatIsNotARun) {
  EXPECT_EQ(CalibrateFromRun(nlohmann::json::array(), "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CalibrateFromRun({{"model_bytes", 5}}, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  nlohmann::json zero = RunJson();
  zero["model_bytes"] = 0;
  EXPECT_EQ(CalibrateFromRun(zero, "x").status().code(), absl::StatusCode::kInvalidArgument);
  nlohmann::json wrong_type = RunJson();
  wrong_type["transports"][0]["versions"][1]["replicas"][0]["fetch_s"] = "fast";
  EXPECT_EQ(CalibrateFromRun(wrong_type, "x").status().code(), absl::StatusCode::kInvalidArgument);
  testing::ScratchDir dir;
  EXPECT_EQ(ReadCalibration(dir / "missing.json").status().code(), absl::StatusCode::kNotFound);
  testing::WriteFileOrDie(dir / "bad.json", "{not json");
  EXPECT_EQ(ReadCalibration(dir / "bad.json").status().code(), absl::StatusCode::kInvalidArgument);
  // A run without baselines or delta transports calibrates what it has.
  nlohmann::json plain = RunJson();
  plain.erase("baselines");
  plain["transports"].erase(2);
  absl::StatusOr<Calibration> c = CalibrateFromRun(plain, "plain.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->figures.count("delta-ratio"), 0u);
  EXPECT_EQ(c->figures.count("encode-gbs"), 0u);
  EXPECT_NEAR(Figure(*c, "stage-gbs"), 10, 1e-12);         // ucx: 1 GB / 0.1 s stall
  EXPECT_NEAR(Figure(*c, "storage-write-gbs"), 5, 1e-12);  // disk: 1 GB / 0.2 s stall
}

// ----- tables -----

TEST(BenchModelTest, TableHasHeaderUnitsAndOneRowPerTransport) {
  ModelInputs in = SevenB();
  in.encode_gbs = 0.1;  // delta+ucx can never reach 90%
  std::vector<Estimate> es;
  for (const std::string& t : ModelTransports()) es.push_back(MustEstimate(in, t));
  const std::string table = FormatModelTable(es);
  std::vector<std::string> lines = absl::StrSplit(table, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3 + ModelTransports().size());
  for (int i = 0; i < 3; ++i) EXPECT_THAT(lines[i], StartsWith("#"));
  EXPECT_THAT(lines[2], HasSubstr("(GB/s)"));
  for (size_t i = 0; i < ModelTransports().size(); ++i) {
    EXPECT_THAT(lines[3 + i], StartsWith("  " + ModelTransports()[i] + " "));
  }
  EXPECT_THAT(lines[3], HasSubstr("storage"));
  EXPECT_THAT(lines[4], HasSubstr(" 14000.0 "));  // ucx: 14 GB in MB
  EXPECT_THAT(lines[4], HasSubstr(" 0.247 "));    // its transfer
  EXPECT_THAT(lines.back(), HasSubstr("never"));
  for (const std::string& l : lines) EXPECT_NE(l.back(), ' ') << l;
}

TEST(BenchModelTest, TermsTableShowsWhereTheTimeGoesSideBySide) {
  ModelInputs in = SevenB();
  in.model_bytes = 1e12;
  in.trainer_gpus = 256;
  in.replica_gpus = 128;
  in.gpus_per_replica = 16;
  std::vector<Estimate> es = {MustEstimate(in, "ucx")};
  in.publishers = 1;
  es.push_back(MustEstimate(in, "ucx"));
  const std::string table = FormatTermsTable(es);
  std::vector<std::string> lines = absl::StrSplit(table, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_THAT(lines[0], ::testing::ContainsRegex(
                            "^# transport/src +gather +d2h +stage +latency +pull +apply +stall "
                            "+last$"));
  EXPECT_THAT(lines[2],
              ::testing::ContainsRegex("^  ucx/256 +- +0.078\\* +0.31[23]\\* +0.002 +1.250 "
                                       "+1.250 +0.391 +2.893$"));
  EXPECT_THAT(lines[3], ::testing::ContainsRegex("^  ucx/1 +2.422\\* +20.000\\* +10.000\\* "
                                                 "+0.002 +20.000 +1.250 +32.422 +53.674$"));
  const std::string labelled = FormatModelTable(es, /*label_publishers=*/true);
  EXPECT_THAT(labelled, HasSubstr("\n  ucx/256 "));
  EXPECT_THAT(labelled, HasSubstr("\n  ucx/1 "));
}

TEST(BenchModelTest, ComparisonShowsTheRelativeError) {
  Estimate ucx;
  ucx.transport = "ucx";
  ucx.stall_s = 0.1;
  ucx.transfer_s = 0.6;
  Estimate bound = ucx;
  bound.transfer_s = 0.05;
  const std::string table =
      FormatComparison({{"ucx", 0.08, 0.5, 5}, {"disk", 0.2, 0.3, 5}}, {ucx}, {bound});
  std::vector<std::string> lines = absl::StrSplit(table, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u);  // disk has no prediction: no row
  EXPECT_THAT(lines[3], StartsWith("  ucx "));
  EXPECT_THAT(lines[3], HasSubstr("+25.0"));    // stall (0.1 - 0.08) / 0.08
  EXPECT_THAT(lines[3], HasSubstr("+20.0"));    // last (0.6 - 0.5) / 0.5
  EXPECT_THAT(lines[3], HasSubstr(" 50.00 "));  // bound, ms
}

// ----- the subcommand -----

testing::RunResult Model(std::vector<std::string> args) {
  args.insert(args.begin(), {testing::BinaryPath("bench/weightbus-bench"), "model"});
  absl::StatusOr<testing::RunResult> r = testing::RunCommand(args, absl::Seconds(60));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : testing::RunResult{};
}

TEST(BenchModelTest, SubcommandPrintsBannerTableAndOk) {
  testing::ScratchDir dir;
  const testing::RunResult r =
      Model({"--params", "70B", "--dtype", "bf16", "--trainer-gpus", "64", "--replica-gpus", "128",
             "--fabric", "roce-200", "--step-s", "30", "--json", dir / "m.json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("# model: 140.00 GB per version"));
  EXPECT_THAT(r.output, HasSubstr("[--params 70B, --dtype bf16]"));
  EXPECT_THAT(r.output, HasSubstr("200 GB/s per node [preset roce-200"));
  EXPECT_THAT(r.output, HasSubstr("8 NICs per node [preset roce-200"));
  EXPECT_THAT(r.output, HasSubstr("step 30 s [--step-s]"));
  EXPECT_THAT(r.output, HasSubstr("[default preset shared-fs"));
  EXPECT_TRUE(absl::EndsWith(r.output, "# OK\n")) << r.output;
  for (const std::string& t : ModelTransports()) EXPECT_THAT(r.output, HasSubstr("\n  " + t + " "));
  nlohmann::json j = nlohmann::json::parse(testing::ReadFileOrDie(dir / "m.json"));
  EXPECT_EQ(j["inputs"]["model-bytes"]["value"], 140e9);
  EXPECT_EQ(j["inputs"]["trainer-gpus"]["from"], "--trainer-gpus");
  ASSERT_EQ(j["transports"].size(), 5u);
  // The JSON and the model agree: ucx over RoCE 200, 64 trainer GPUs, 16 instances.
  ModelInputs in;
  in.model_bytes = 140e9;
  in.trainer_gpus = 64;
  in.replica_gpus = 128;
  in.node_gbs = 200;
  in.step_s = 30;
  EXPECT_NEAR(j["transports"][1]["transfer_s"].get<double>(), MustEstimate(in, "ucx").transfer_s,
              1e-9);
}

TEST(BenchModelTest, SubcommandComparesSourcesSideBySide) {
  testing::ScratchDir dir;
  const testing::RunResult r =
      Model({"--params",           "1T",     "--dtype",        "fp8",
             "--trainer-gpus",     "256",    "--replica-gpus", "128",
             "--gpus-per-replica", "16",     "--step-s",       "300",
             "--fabric",           "ib-ndr", "--transports",   "ucx,disk",
             "--publishers",       "256,1",  "--json",         dir / "m.json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("# sources (disk, ucx, delta+): every trainer GPU (256 on 32 "
                                  "nodes); 1 GPU on 1 node [--publishers]"));
  for (const char* row : {"\n  ucx/256 ", "\n  disk/256 ", "\n  ucx/1 ", "\n  disk/1 "}) {
    EXPECT_THAT(r.output, HasSubstr(row));
  }
  EXPECT_THAT(r.output, HasSubstr("# where the time goes"));
  EXPECT_THAT(r.output, ::testing::ContainsRegex("\n  ucx/1 +2.422\\* +20.000\\*"));
  EXPECT_TRUE(absl::EndsWith(r.output, "# OK\n")) << r.output;
  nlohmann::json j = nlohmann::json::parse(testing::ReadFileOrDie(dir / "m.json"));
  ASSERT_EQ(j["transports"].size(), 4u);
  EXPECT_EQ(j["transports"][0]["publishers"], 256);
  EXPECT_EQ(j["transports"][2]["publishers"], 1);
  EXPECT_NEAR(j["transports"][2]["transfer_s"].get<double>(), 53.673875, 1e-6);
  EXPECT_EQ(j["inputs"]["publishers"]["from"], "--publishers");
  // Not a count of trainer GPUs: a usage error.
  for (const char* bad : {"0", "257", "one", "2,,3"}) {
    const testing::RunResult u = Model({"--trainer-gpus", "256", "--publishers", bad});
    EXPECT_EQ(u.exit_code, 2) << bad << ": " << u.output;
    EXPECT_THAT(u.output, HasSubstr("--publishers")) << bad;
  }
}

TEST(BenchModelTest, SubcommandCalibratesAndCompares) {
  testing::ScratchDir dir;
  testing::WriteFileOrDie(dir / "run.json", RunJson().dump());
  const testing::RunResult r = Model({"--calibrate", dir / "run.json", "--compare"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--network-gbs 5: ucx: 2 subscribers"));
  EXPECT_THAT(r.output, HasSubstr("5 GB/s per node [calibrated]"));
  EXPECT_THAT(r.output, HasSubstr("# prediction vs measurement"));
  // ucx is predicted at 525 ms, as measured (see ThisMachinePredictionAddsTheCalibratedPhases).
  EXPECT_THAT(r.output, ::testing::ContainsRegex("\n  ucx +100.00 +100.00 +[-+]0.0 +525.00 "
                                                 "+525.00 +[-+]0.0 "));
  EXPECT_THAT(r.output, Not(HasSubstr("\n  nccl ")));  // not measured: not modelled here
  EXPECT_TRUE(absl::EndsWith(r.output, "# OK\n")) << r.output;
  // A named preset wins over the calibration.
  const testing::RunResult p =
      Model({"--calibrate", dir / "run.json", "--fabric", "ib-hdr", "--params", "7B"});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_THAT(p.output, HasSubstr("200 GB/s per node [preset ib-hdr"));
  EXPECT_THAT(p.output, HasSubstr("(not used: preset ib-hdr"));
  EXPECT_THAT(p.output, HasSubstr("14.00 GB per version"));
  EXPECT_THAT(p.output, HasSubstr("50x per delta [calibrated]"));
}

TEST(BenchModelTest, SubcommandUsageErrorsExitTwo) {
  testing::ScratchDir dir;
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--fabric", "carrier-pigeon"},
                                             {"--storage", "tape"},
                                             {"--params", "seven"},
                                             {"--dtype", "fp12"},
                                             {"--overlap", "2"},
                                             {"--replica-gpus", "12"},
                                             {"--step-s", "abc"},
                                             {"--transports", "ucx,smoke-signals"},
                                             {"--compare"},
                                             {"--calibrate", dir / "missing.json"},
                                             {"--params", "7B", "--checkpoint", "x.safetensors"},
                                             {"--checkpoint", dir / "missing"},
                                             {"--no-such-flag"},
                                             {"stray"}}) {
    const testing::RunResult r = Model(args);
    EXPECT_EQ(r.exit_code, 2) << args[0] << ": " << r.output;
    // "error:" for what the model refuses, "usage error:" for what the flags do (CLI11).
    EXPECT_THAT(r.output, AnyOf(HasSubstr("weightbus-bench: error: "),
                                HasSubstr("weightbus-bench: usage error: ")))
        << args[0];
  }
  const testing::RunResult help = Model({"--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.output, HasSubstr("--calibrate FILE"));
  const testing::RunResult presets = Model({"--list-presets"});
  EXPECT_EQ(presets.exit_code, 0);
  EXPECT_THAT(presets.output, HasSubstr("ib-ndr"));
  EXPECT_THAT(presets.output, HasSubstr("shared-fs"));
}

TEST(BenchModelTest, SubcommandMeasuresACheckpoint) {
  const testing::RunResult r =
      Model({"--checkpoint", testing::FixturePath("stories260K.bin"), "--dtype", "bf16"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 260,032 parameters x 2 B = 520,064 bytes.
  EXPECT_THAT(r.output, HasSubstr("2.6e+05 parameters"));
  EXPECT_THAT(r.output, ::testing::ContainsRegex("\n  ucx +0.5 "));
}

}  // namespace
}  // namespace weightbus::bench

// SPDX-License-Identifier: Apache-2.0
// Resharding (core/reshard.h): plans for publisher groups of 1, 2 and 4 ranks (FSDP2 row
// shards on dimension 0; Megatron column and row shards with replicated norms) and TP degrees
// 1, 2 and 4, executed on real buffers and compared with a reference slicing written here
// element by element from vLLM's loaders; GQA with fewer KV heads than ranks, gate_up, MoE
// experts (linear and round robin, fused w13); wrong layouts that must differ; range counts;
// every error with its code and message; fingerprints and the plan cache; and a
// tensor-parallel MLP forward pass on the resharded slices against the unsliced one.
#include "core/reshard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checksum.h"
#include "tp_forward.h"

namespace weightbus::internal {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Dims = std::vector<int64_t>;

int64_t Count(const Dims& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Row-major linear index of `idx` in `shape`.
int64_t Linear(const Dims& shape, const Dims& idx) {
  int64_t i = 0;
  for (size_t d = 0; d < shape.size(); ++d) i = i * shape[d] + idx[d];
  return i;
}

// Calls f(idx) for every index of `shape`, in row-major order.
template <typename F>
void ForEachIndex(const Dims& shape, F f) {
  if (Count(shape) == 0) return;
  Dims idx(shape.size(), 0);
  while (true) {
    f(idx);
    size_t d = shape.size();
    while (d > 0) {
      --d;
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
      if (d == 0) return;
    }
    if (shape.empty()) return;
  }
}

// A global tensor of U32 elements, each distinct across the model (tag << 20 | index), so any
// misplaced element shows.
struct Global {
  Dims shape;
  std::vector<uint32_t> values;
  uint32_t At(const Dims& idx) const { return values[Linear(shape, idx)]; }
};

using Model = std::map<std::string, Global>;

void Add(Model& m, const std::string& name, Dims shape) {
  Global g;
  g.shape = std::move(shape);
  const uint32_t tag = static_cast<uint32_t>(m.size() + 1);
  for (int64_t i = 0; i < Count(g.shape); ++i) g.values.push_back(tag << 20 | uint32_t(i));
  m[name] = std::move(g);
}

// The small model every grid test uses: hidden 16; 4 query heads and 2 KV heads of size 4;
// intermediate 24; 6 experts of intermediate 8; vocab 12; a 10-row replicated head.
Model TestModel() {
  Model m;
  Add(m, "embed_tokens.weight", {12, 16});
  Add(m, "layers.0.self_attn.q_proj.weight", {16, 16});
  Add(m, "layers.0.self_attn.k_proj.weight", {8, 16});
  Add(m, "layers.0.self_attn.v_proj.weight", {8, 16});
  Add(m, "layers.0.self_attn.q_proj.bias", {16});
  Add(m, "layers.0.self_attn.k_proj.bias", {8});
  Add(m, "layers.0.self_attn.v_proj.bias", {8});
  Add(m, "layers.0.self_attn.o_proj.weight", {16, 16});
  Add(m, "layers.0.mlp.gate_proj.weight", {24, 16});
  Add(m, "layers.0.mlp.up_proj.weight", {24, 16});
  Add(m, "layers.0.mlp.down_proj.weight", {16, 24});
  Add(m, "layers.0.input_layernorm.weight", {16});
  Add(m, "layers.1.mlp.experts.w1", {6, 8, 16});
  Add(m, "layers.1.mlp.experts.w3", {6, 8, 16});
  Add(m, "layers.1.mlp.experts.w2", {6, 16, 8});
  Add(m, "lm_head.weight", {10, 16});
  return m;
}

constexpr int64_t kHeads = 4, kKvHeads = 2, kHeadSize = 4;

std::vector<PlacementRule> TestRules(ExpertOrder order = ExpertOrder::kLinear) {
  return {
      {"*.qkv_proj.*", Placement::Qkv(kHeads, kKvHeads, kHeadSize)},
      {"*.gate_up_proj.*", Placement::GateUp()},
      {"*.o_proj.*", Placement::Shard(1)},
      {"*.down_proj.*", Placement::Shard(1)},
      {"embed_tokens.*", Placement::Shard(0)},
      {"*.experts.w13", Placement::ExpertsMerged("w13", {"w1", "w3"}, order)},
      {"*.experts.w2", Placement::Experts(order)},
  };
}

// The destination tensors of the test model, as an engine (vLLM) names its parameters.
std::vector<std::string> TestDestinations() {
  return {"embed_tokens.weight",
          "layers.0.self_attn.qkv_proj.weight",
          "layers.0.self_attn.qkv_proj.bias",
          "layers.0.self_attn.o_proj.weight",
          "layers.0.mlp.gate_up_proj.weight",
          "layers.0.mlp.down_proj.weight",
          "layers.0.input_layernorm.weight",
          "layers.1.mlp.experts.w13",
          "layers.1.mlp.experts.w2",
          "lm_head.weight"};
}

// How a publisher group holds one tensor.
enum class Split {
  kWhole,       // rank 0 only
  kReplicated,  // whole on every rank
  kChunk0,      // FSDP2: torch.chunk on dimension 0 (ceil-sized, trailing ranks may hold less
                // or nothing)
  kEven0,       // Megatron column-parallel: equal blocks of dimension 0
  kEven1,       // Megatron row-parallel: equal blocks of dimension 1
};

// A publisher group's data: each rank's bytes (its parts one after another) and the layout
// describing them.
struct Group {
  SourceLayout layout;
  std::vector<std::vector<std::byte>> data;
  std::vector<absl::Span<const std::byte>> Spans() const {
    std::vector<absl::Span<const std::byte>> s;
    for (const auto& d : data) s.emplace_back(d.data(), d.size());
    return s;
  }
};

void AddPart(Group& g, SourceTensor& t, const Global& global, int rank, Dims offsets, Dims shape) {
  SourcePart p;
  p.owner_rank = rank;
  p.dtype = DType::kU32;
  p.global_shape = global.shape;
  p.offsets = offsets;
  p.shape = shape;
  std::vector<std::byte>& bytes = g.data[rank];
  p.byte_offset = bytes.size();
  p.byte_size = static_cast<uint64_t>(Count(shape)) * 4;
  ForEachIndex(shape, [&](const Dims& idx) {
    Dims at = idx;
    for (size_t d = 0; d < at.size(); ++d) at[d] += offsets[d];
    const uint32_t v = global.At(at);
    const auto* b = reinterpret_cast<const std::byte*>(&v);
    bytes.insert(bytes.end(), b, b + 4);
  });
  t.parts.push_back(std::move(p));
}

Group Publish(const Model& model, int world, const std::map<std::string, Split>& splits) {
  Group g;
  g.layout.world_size = world;
  g.data.resize(world);
  for (const auto& [name, global] : model) {
    SourceTensor t;
    t.name = name;
    const Split split = splits.count(name) ? splits.at(name) : Split::kWhole;
    const Dims& s = global.shape;
    const Dims zero(s.size(), 0);
    switch (split) {
      case Split::kWhole:
        AddPart(g, t, global, 0, zero, s);
        break;
      case Split::kReplicated:
        for (int r = 0; r < world; ++r) AddPart(g, t, global, r, zero, s);
        break;
      case Split::kChunk0:
      case Split::kEven0:
      case Split::kEven1: {
        const int d = split == Split::kEven1 ? 1 : 0;
        const int64_t chunk = split == Split::kChunk0 ? (s[d] + world - 1) / world : s[d] / world;
        if (split != Split::kChunk0) EXPECT_EQ(s[d] % world, 0) << name;
        for (int r = 0; r < world; ++r) {
          const int64_t lo = std::min(s[d], r * chunk), hi = std::min(s[d], (r + 1) * chunk);
          if (hi == lo) continue;  // FSDP2 ranks past the end hold an empty shard
          Dims off = zero, shape = s;
          off[d] = lo;
          shape[d] = hi - lo;
          AddPart(g, t, global, r, off, shape);
        }
        break;
      }
    }
    g.layout.tensors.push_back(std::move(t));
  }
  return g;
}

std::map<std::string, Split> FsdpSplits(const Model& model) {
  std::map<std::string, Split> s;
  for (const auto& [name, g] : model) s[name] = Split::kChunk0;
  return s;
}

std::map<std::string, Split> MegatronSplits(const Model& model) {
  std::map<std::string, Split> s;
  for (const auto& [name, g] : model) {
    if (name.find("o_proj") != std::string::npos || name.find("down_proj") != std::string::npos) {
      s[name] = Split::kEven1;
    } else if (name.find("norm") != std::string::npos ||
               name.find("lm_head") != std::string::npos) {
      s[name] = Split::kReplicated;
    } else if (name.find("experts") != std::string::npos) {
      s[name] = Split::kChunk0;  // expert parallel, uneven for 6 experts on 4 ranks
    } else {
      s[name] = Split::kEven0;
    }
  }
  return s;
}

// --- The reference: each destination element's source, from vLLM's loaders, by hand. ---

// vLLM determine_expert_map for one rank: local index -> global expert.
std::vector<int64_t> ReferenceExperts(int64_t experts, int ep, int rank, ExpertOrder order) {
  std::vector<int64_t> map(experts, -1);  // global -> local, -1 elsewhere
  const int64_t base = experts / ep, rem = experts % ep;
  const int64_t local = rank < rem ? base + 1 : base;
  if (order == ExpertOrder::kLinear) {
    const int64_t start = rank * base + std::min<int64_t>(rank, rem);
    for (int64_t i = 0; i < local; ++i) map[start + i] = i;
  } else {
    int64_t i = 0;
    for (int64_t e = rank; e < experts; e += ep) map[e] = i++;
  }
  std::vector<int64_t> out(local);
  for (int64_t e = 0; e < experts; ++e) {
    if (map[e] >= 0) out[map[e]] = e;
  }
  return out;
}

// Layout mistakes the reference can make on purpose, to show the comparison catches them.
enum class Mistake { kNone, kQkvContiguous, kGateUpSwapped };

struct Expected {
  Dims shape;
  std::vector<uint32_t> values;
};

std::string Replace(std::string name, const std::string& from, const std::string& to) {
  return name.replace(name.rfind(from), from.size(), to);
}

Expected Reference(const Model& m, const TensorRequest& req, TensorParallelRank tp,
                   Mistake mistake = Mistake::kNone) {
  const Placement& p = req.placement;
  const int r = tp.rank, n = tp.size;
  Expected e;
  switch (p.kind) {
    case Placement::Kind::kReplicate: {
      const Global& g = m.at(req.name);
      e.shape = g.shape;
      e.values = g.values;
      break;
    }
    case Placement::Kind::kShard: {
      const Global& g = m.at(req.name);
      e.shape = g.shape;
      e.shape[p.dim] /= n;
      ForEachIndex(e.shape, [&](const Dims& idx) {
        Dims src = idx;
        src[p.dim] += r * e.shape[p.dim];
        e.values.push_back(g.At(src));
      });
      break;
    }
    case Placement::Kind::kQkv: {
      const Global& q = m.at(Replace(req.name, "qkv_proj", "q_proj"));
      const Global& k = m.at(Replace(req.name, "qkv_proj", "k_proj"));
      const Global& v = m.at(Replace(req.name, "qkv_proj", "v_proj"));
      const int64_t q_rows = p.num_heads / n * p.head_size;
      const bool replicate_kv = n >= p.num_kv_heads;
      const int64_t kv_rows = (replicate_kv ? 1 : p.num_kv_heads / n) * p.head_size;
      const int64_t kv_rank = replicate_kv ? r / (n / p.num_kv_heads) : r;
      e.shape = q.shape;
      e.shape[0] = q_rows + 2 * kv_rows;
      ForEachIndex(e.shape, [&](const Dims& idx) {
        Dims src = idx;
        const int64_t row = idx[0];
        if (mistake == Mistake::kQkvContiguous) {  // rows of [q; k; v] cut into n blocks
          const int64_t global_row = r * e.shape[0] + row;
          const Global* g = &q;
          src[0] = global_row;
          if (src[0] >= q.shape[0]) src[0] -= q.shape[0], g = &k;
          if (g == &k && src[0] >= k.shape[0]) src[0] -= k.shape[0], g = &v;
          e.values.push_back(g->At(src));
          return;
        }
        if (row < q_rows) {
          src[0] = r * q_rows + row;
          e.values.push_back(q.At(src));
        } else if (row < q_rows + kv_rows) {
          src[0] = kv_rank * kv_rows + row - q_rows;
          e.values.push_back(k.At(src));
        } else {
          src[0] = kv_rank * kv_rows + row - q_rows - kv_rows;
          e.values.push_back(v.At(src));
        }
      });
      break;
    }
    case Placement::Kind::kMerged: {
      const Global* gate = &m.at(Replace(req.name, "gate_up_proj", "gate_proj"));
      const Global* up = &m.at(Replace(req.name, "gate_up_proj", "up_proj"));
      if (mistake == Mistake::kGateUpSwapped) std::swap(gate, up);
      const int64_t half = gate->shape[0] / n;
      e.shape = gate->shape;
      e.shape[0] = 2 * half;
      ForEachIndex(e.shape, [&](const Dims& idx) {
        Dims src = idx;
        const bool is_up = idx[0] >= half;
        src[0] = r * half + idx[0] - (is_up ? half : 0);
        e.values.push_back((is_up ? up : gate)->At(src));
      });
      break;
    }
    case Placement::Kind::kExperts: {
      const bool fused = !p.parts.empty();
      const Global* w1 = &m.at(fused ? Replace(req.name, "w13", "w1") : req.name);
      const Global* w3 = fused ? &m.at(Replace(req.name, "w13", "w3")) : nullptr;
      const std::vector<int64_t> local = ReferenceExperts(w1->shape[0], n, r, p.expert_order);
      e.shape = w1->shape;
      e.shape[0] = static_cast<int64_t>(local.size());
      if (fused) e.shape[1] *= 2;
      ForEachIndex(e.shape, [&](const Dims& idx) {
        Dims src = idx;
        src[0] = local[idx[0]];
        const Global* g = w1;
        if (fused && idx[1] >= w1->shape[1]) src[1] -= w1->shape[1], g = w3;
        e.values.push_back(g->At(src));
      });
      break;
    }
  }
  return e;
}

// The destination bytes `plan` assembles from `group`.
absl::StatusOr<std::vector<uint32_t>> Execute(const TensorPlan& plan, const Group& group) {
  std::vector<uint32_t> out(plan.nbytes / 4, 0xdeadbeef);
  const auto spans = group.Spans();
  absl::Status s = ApplyPlan(
      plan, spans, absl::Span<std::byte>(reinterpret_cast<std::byte*>(out.data()), plan.nbytes));
  if (!s.ok()) return s;
  return out;
}

::testing::AssertionResult SameAs(const TensorPlan& plan, const std::vector<uint32_t>& got,
                                  const Expected& want) {
  if (plan.shape != want.shape) {
    return ::testing::AssertionFailure() << plan.name << ": shape " << ShapeString(plan.shape)
                                         << ", reference " << ShapeString(want.shape);
  }
  for (size_t i = 0; i < want.values.size(); ++i) {
    if (got[i] != want.values[i]) {
      return ::testing::AssertionFailure() << plan.name << ": element " << i << " is " << std::hex
                                           << got[i] << ", reference " << want.values[i];
    }
  }
  return ::testing::AssertionSuccess();
}

uint64_t RangesChecksum(const std::vector<std::byte>& data,
                        const std::vector<Overlap::Range>& ranges, bool side_a) {
  Xxh3Stream h;
  for (const Overlap::Range& r : ranges)
    h.Update(data.data() + (side_a ? r.offset_a : r.offset_b), r.length);
  return h.Digest();
}

const TensorPlan& Find(const ReshardPlan& plan, std::string_view name) {
  for (const TensorPlan& t : plan.tensors) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no plan for " << name;
  return plan.tensors.front();
}

// A failed plan with `code` whose message contains every one of `parts`.
void ExpectError(const absl::StatusOr<ReshardPlan>& plan, absl::StatusCode code,
                 const std::vector<std::string>& parts) {
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), code) << plan.status();
  for (const std::string& p : parts) EXPECT_THAT(plan.status().message(), HasSubstr(p));
}

// --- The grid: publisher world sizes x layouts x TP degrees, every rank, every tensor. ---

enum class Scheme { kFsdp, kMegatron };

void PrintTo(Scheme s, std::ostream* os) { *os << (s == Scheme::kFsdp ? "FSDP2" : "Megatron"); }

class ReshardGridTest : public ::testing::TestWithParam<std::tuple<int, Scheme, int>> {};

TEST_P(ReshardGridTest, EveryRankReceivesExactlyItsReferenceSlices) {
  const auto [world, scheme, tp_size] = GetParam();
  const Model model = TestModel();
  const Group group =
      Publish(model, world, scheme == Scheme::kFsdp ? FsdpSplits(model) : MegatronSplits(model));
  for (ExpertOrder order : {ExpertOrder::kLinear, ExpertOrder::kRoundRobin}) {
    auto requests = ResolvePlacements(TestRules(order), TestDestinations());
    ASSERT_TRUE(requests.ok()) << requests.status();
    uint64_t model_bytes = 0;
    for (const auto& [name, g] : model) model_bytes += g.values.size() * 4;
    uint64_t received = 0;
    for (int rank = 0; rank < tp_size; ++rank) {
      const TensorParallelRank tp{tp_size, rank};
      auto plan = ComputePlan(group.layout, *requests, tp, {OverlapPolicy::kReport});
      ASSERT_TRUE(plan.ok()) << plan.status();
      ASSERT_EQ(plan->tensors.size(), requests->size());
      uint64_t expected_bytes = 0;
      for (size_t i = 0; i < requests->size(); ++i) {
        const TensorPlan& t = plan->tensors[i];
        const Expected want = Reference(model, (*requests)[i], tp);
        auto got = Execute(t, group);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_TRUE(SameAs(t, *got, want)) << "rank " << rank << " of " << tp_size;
        expected_bytes += want.values.size() * 4;
        // Ranges are sorted, disjoint and never adjacent on both sides (fully merged).
        for (size_t j = 1; j < t.ranges.size(); ++j) {
          const ByteRange& a = t.ranges[j - 1];
          const ByteRange& b = t.ranges[j];
          EXPECT_EQ(a.dest_offset + a.length, b.dest_offset);
          EXPECT_FALSE(a.source_tensor == b.source_tensor && a.source_part == b.source_part &&
                       a.source_offset + a.length == b.source_offset)
              << t.name << " ranges " << j - 1 << " and " << j << " should have been merged";
        }
      }
      // The rank receives its slices and nothing else, from the ranks that own them.
      EXPECT_EQ(plan->total_bytes(), expected_bytes);
      uint64_t from_owners = 0;
      for (int owner = 0; owner < world; ++owner) from_owners += plan->BytesFrom(owner);
      EXPECT_EQ(from_owners, expected_bytes);
      received += expected_bytes;
      // Replicated parts (Megatron norms) are read from one owner, and every other owner's
      // copy is listed for verification; here they agree.
      if (scheme == Scheme::kMegatron && world > 1) {
        EXPECT_FALSE(plan->overlaps.empty());
      } else {
        EXPECT_TRUE(plan->overlaps.empty());
      }
      for (const Overlap& o : plan->overlaps) {
        EXPECT_TRUE(CheckOverlapAgrees(o, RangesChecksum(group.data[o.rank_a], o.ranges, true),
                                       RangesChecksum(group.data[o.rank_b], o.ranges, false))
                        .ok());
      }
    }
    // A TP group receives at least the model (replicated tensors once per rank), and at TP 1
    // exactly the model.
    if (tp_size == 1) {
      EXPECT_EQ(received, model_bytes);
    } else {
      EXPECT_GE(received, model_bytes);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsLayoutsDegrees, ReshardGridTest,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(Scheme::kFsdp, Scheme::kMegatron),
                                            ::testing::Values(1, 2, 4)),
                         [](const auto& info) {
                           return absl::StrCat(
                               "world", std::get<0>(info.param),
                               std::get<1>(info.param) == Scheme::kFsdp ? "_fsdp" : "_megatron",
                               "_tp", std::get<2>(info.param));
                         });

// --- The layouts one by one: what each rank gets, and wrong layouts that must differ. ---

absl::StatusOr<std::vector<uint32_t>> PlanAndRun(const Group& group, const TensorRequest& req,
                                                 TensorParallelRank tp,
                                                 TensorPlan* plan_out = nullptr) {
  auto plan = ComputePlan(group.layout, {req}, tp, {OverlapPolicy::kReport});
  if (!plan.ok()) return plan.status();
  if (plan_out != nullptr) *plan_out = plan->tensors[0];
  return Execute(plan->tensors[0], group);
}

TEST(ReshardLayoutTest, QkvWithFewerKvHeadsThanRanksReplicatesKvHeadsAsVllm) {
  // 8 query heads, 2 KV heads of size 2, TP 4: each rank has 2 query heads and one KV head,
  // KV head 0 on ranks 0 and 1, KV head 1 on ranks 2 and 3 (QKVParallelLinear's
  // num_kv_head_replicas = 2, shard_rank = tp_rank // 2).
  Model m;
  Add(m, "a.q_proj.weight", {16, 3});
  Add(m, "a.k_proj.weight", {4, 3});
  Add(m, "a.v_proj.weight", {4, 3});
  const Group group = Publish(m, 1, {});
  const TensorRequest req{"a.qkv_proj.weight", Placement::Qkv(8, 2, 2)};
  for (int r = 0; r < 4; ++r) {
    TensorPlan plan;
    auto got = PlanAndRun(group, req, {4, r}, &plan);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(plan.shape, (Dims{4 + 2 + 2, 3}));
    EXPECT_TRUE(SameAs(plan, *got, Reference(m, req, {4, r})));
    // Spelled out: rank r's k rows are KV head r / 2.
    const Global& k = m.at("a.k_proj.weight");
    EXPECT_EQ((*got)[4 * 3], k.At({(r / 2) * 2, 0})) << "rank " << r;
    // Three sources, each one contiguous block: three ranges.
    EXPECT_EQ(plan.ranges.size(), 3u);
  }
  // The same with one KV head (multi-query attention) at TP 4: every rank has KV head 0.
  Model mqa;
  Add(mqa, "a.q_proj.weight", {8, 3});
  Add(mqa, "a.k_proj.weight", {2, 3});
  Add(mqa, "a.v_proj.weight", {2, 3});
  const Group mqa_group = Publish(mqa, 2, FsdpSplits(mqa));
  const TensorRequest mqa_req{"a.qkv_proj.weight", Placement::Qkv(4, 1, 2)};
  for (int r = 0; r < 4; ++r) {
    TensorPlan plan;
    auto got = PlanAndRun(mqa_group, mqa_req, {4, r}, &plan);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(SameAs(plan, *got, Reference(mqa, mqa_req, {4, r})));
  }
}

TEST(ReshardLayoutTest, QkvWithALargerValueHeadFollowsVHeadSize) {
  Model m;
  Add(m, "x.q_proj.weight", {8, 2});  // 4 heads of 2
  Add(m, "x.k_proj.weight", {4, 2});  // 2 KV heads of 2
  Add(m, "x.v_proj.weight", {6, 2});  // 2 KV heads of value size 3
  const Group group = Publish(m, 1, {});
  Placement p = Placement::Qkv(4, 2, 2);
  p.v_head_size = 3;
  for (int r = 0; r < 2; ++r) {
    TensorPlan plan;
    auto got = PlanAndRun(group, {"x.qkv_proj.weight", p}, {2, r}, &plan);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(plan.shape, (Dims{4 + 2 + 3, 2}));
    const Global& v = m.at("x.v_proj.weight");
    EXPECT_EQ((*got)[6 * 2], v.At({3 * r, 0}));  // v rows start after q (4) and k (2) rows
    EXPECT_EQ((*got)[8 * 2 + 1], v.At({3 * r + 2, 1}));
  }
}

TEST(ReshardLayoutTest, AFusedQkvSourceGivesTheSameSlicesAsSeparateOnes) {
  // Phi-3 style: the publisher holds qkv_proj already fused ([q; k; v] rows).
  const Model m = TestModel();
  Model fused;
  Global qkv;
  const Global& q = m.at("layers.0.self_attn.q_proj.weight");
  const Global& k = m.at("layers.0.self_attn.k_proj.weight");
  const Global& v = m.at("layers.0.self_attn.v_proj.weight");
  qkv.shape = {32, 16};
  for (const Global* g : {&q, &k, &v})
    qkv.values.insert(qkv.values.end(), g->values.begin(), g->values.end());
  fused["layers.0.self_attn.qkv_proj.weight"] = qkv;
  const TensorRequest req{"layers.0.self_attn.qkv_proj.weight",
                          Placement::Qkv(kHeads, kKvHeads, kHeadSize)};
  for (int world : {1, 2, 4}) {
    const Group separate_group = Publish(m, world, FsdpSplits(m));
    const Group fused_group = Publish(fused, world, FsdpSplits(fused));
    for (int n : {1, 2, 4}) {
      for (int r = 0; r < n; ++r) {
        TensorPlan plan;
        auto a = PlanAndRun(separate_group, req, {n, r});
        auto b = PlanAndRun(fused_group, req, {n, r}, &plan);
        ASSERT_TRUE(a.ok()) << a.status();
        ASSERT_TRUE(b.ok()) << b.status();
        EXPECT_EQ(*a, *b) << "world " << world << ", rank " << r << " of " << n;
        EXPECT_TRUE(SameAs(plan, *b, Reference(m, req, {n, r})));
        // At TP 1 from one whole fused tensor, q, k and v are one range.
        if (world == 1 && n == 1) EXPECT_EQ(plan.ranges.size(), 1u);
      }
    }
  }
}

TEST(ReshardLayoutTest, WrongLayoutsGiveDifferentBytes) {
  // The comparison can fail: a qkv cut contiguously, and gate and up swapped, are caught, both
  // as reference mistakes and as real plans with a wrong placement.
  const Model m = TestModel();
  const Group group = Publish(m, 2, FsdpSplits(m));
  const TensorRequest qkv{"layers.0.self_attn.qkv_proj.weight",
                          Placement::Qkv(kHeads, kKvHeads, kHeadSize)};
  const TensorRequest gate_up{"layers.0.mlp.gate_up_proj.weight", Placement::GateUp()};
  // Every rank's plan matches the reference, and not the reference making `mistake`.
  auto check = [&](const TensorRequest& req, Mistake mistake, std::vector<int> degrees) {
    for (int n : degrees) {
      for (int r = 0; r < n; ++r) {
        TensorPlan plan;
        auto got = PlanAndRun(group, req, {n, r}, &plan);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_TRUE(SameAs(plan, *got, Reference(m, req, {n, r})));
        EXPECT_FALSE(SameAs(plan, *got, Reference(m, req, {n, r}, mistake)));
      }
    }
  };
  check(qkv, Mistake::kQkvContiguous, {2});  // at TP 4 the two cuts differ in shape already
  check(gate_up, Mistake::kGateUpSwapped, {1, 2, 4});
  // A plan with the parts in the wrong order is caught by the reference.
  for (int n : {1, 2, 4}) {
    for (int r = 0; r < n; ++r) {
      TensorPlan wrong_plan;
      auto wrong = PlanAndRun(
          group, {gate_up.name, Placement::Merged("gate_up_proj", {"up_proj", "gate_proj"})},
          {n, r}, &wrong_plan);
      ASSERT_TRUE(wrong.ok()) << wrong.status();
      EXPECT_FALSE(SameAs(wrong_plan, *wrong, Reference(m, gate_up, {n, r})));
    }
  }
  // A fused qkv source sliced as a plain column-parallel tensor is the contiguous mistake.
  Model fused;
  Add(fused, "f.qkv_proj.weight", {32, 16});
  const Group fused_group = Publish(fused, 1, {});
  for (int r = 0; r < 2; ++r) {
    TensorPlan right_plan, wrong_plan;
    auto right = PlanAndRun(fused_group, {"f.qkv_proj.weight", Placement::Qkv(4, 2, 4)}, {2, r},
                            &right_plan);
    auto wrong =
        PlanAndRun(fused_group, {"f.qkv_proj.weight", Placement::Shard(0)}, {2, r}, &wrong_plan);
    ASSERT_TRUE(right.ok() && wrong.ok());
    EXPECT_EQ(right_plan.shape, wrong_plan.shape);
    EXPECT_NE(*right, *wrong) << "rank " << r << " of 2";
  }
}

TEST(ReshardLayoutTest, ExpertsFollowDetermineExpertMap) {
  // 6 experts over 4 ranks, linear: 2, 2, 1, 1 starting at 0, 2, 4, 5 (the first E % size
  // ranks take one more, as vLLM's code does); round robin: {0, 4}, {1, 5}, {2}, {3}.
  Model m;
  Add(m, "e.w2", {6, 3, 2});
  const Group group = Publish(m, 1, {});
  const std::vector<std::vector<int64_t>> linear = {{0, 1}, {2, 3}, {4}, {5}};
  const std::vector<std::vector<int64_t>> rr = {{0, 4}, {1, 5}, {2}, {3}};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(ReferenceExperts(6, 4, r, ExpertOrder::kLinear), linear[r]);
    EXPECT_EQ(ReferenceExperts(6, 4, r, ExpertOrder::kRoundRobin), rr[r]);
    for (ExpertOrder order : {ExpertOrder::kLinear, ExpertOrder::kRoundRobin}) {
      const TensorRequest req{"e.w2", Placement::Experts(order)};
      TensorPlan plan;
      auto got = PlanAndRun(group, req, {4, r}, &plan);
      ASSERT_TRUE(got.ok()) << got.status();
      const auto& experts = order == ExpertOrder::kLinear ? linear[r] : rr[r];
      EXPECT_EQ(plan.shape, (Dims{static_cast<int64_t>(experts.size()), 3, 2}));
      EXPECT_TRUE(SameAs(plan, *got, Reference(m, req, {4, r})));
      for (size_t l = 0; l < experts.size(); ++l) {
        EXPECT_EQ((*got)[l * 6], m.at("e.w2").At({experts[l], 0, 0}));
      }
      // Linear experts are one block; round-robin ones one range per expert.
      EXPECT_EQ(plan.ranges.size(), order == ExpertOrder::kLinear ? 1u : experts.size());
    }
  }
  // More ranks than experts: the last ranks hold none and read nothing.
  Model few;
  Add(few, "e.w2", {2, 3, 2});
  const Group few_group = Publish(few, 1, {});
  TensorPlan plan;
  auto got = PlanAndRun(few_group, {"e.w2", Placement::Experts()}, {4, 3}, &plan);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(plan.shape, (Dims{0, 3, 2}));
  EXPECT_EQ(plan.nbytes, 0u);
  EXPECT_TRUE(plan.ranges.empty());
}

TEST(ReshardLayoutTest, TensorParallelExpertsSplitTheIntermediateDimensionOfEveryExpert) {
  // vLLM FusedMoE without expert parallelism: every rank holds every expert, w13_weight
  // [E, 2 * I / n, H] with each expert's gate block r then its up block r (_load_w13 narrows
  // dimension 0 of the expert's w1 and w3), w2_weight [E, H, I / n] with block r of the
  // expert's input dimension (_load_w2). On stacked sources: Merged on dimension 1, Shard(2).
  Model m;
  Add(m, "moe.w1", {3, 8, 4});
  Add(m, "moe.w3", {3, 8, 4});
  Add(m, "moe.w2", {3, 4, 8});
  const Group group = Publish(m, 2, FsdpSplits(m));  // FSDP2 rows: experts 0-1 and 2
  Placement w13 = Placement::Merged("w13", {"w1", "w3"});
  w13.dim = 1;
  for (int n : {1, 2, 4}) {
    const int64_t local = 8 / n;
    for (int r = 0; r < n; ++r) {
      TensorPlan plan;
      auto got = PlanAndRun(group, {"moe.w13", w13}, {n, r}, &plan);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(plan.shape, (Dims{3, 2 * local, 4}));
      size_t i = 0;
      ForEachIndex(plan.shape, [&](const Dims& idx) {
        const bool up = idx[1] >= local;
        const Global& src = m.at(up ? "moe.w3" : "moe.w1");
        const uint32_t want = src.At({idx[0], r * local + idx[1] - (up ? local : 0), idx[2]});
        EXPECT_EQ((*got)[i++], want) << "w13 " << ShapeString(idx) << " rank " << r << "/" << n;
      });
      auto down = PlanAndRun(group, {"moe.w2", Placement::Shard(2)}, {n, r}, &plan);
      ASSERT_TRUE(down.ok()) << down.status();
      ASSERT_EQ(plan.shape, (Dims{3, 4, local}));
      i = 0;
      ForEachIndex(plan.shape, [&](const Dims& idx) {
        const uint32_t want = m.at("moe.w2").At({idx[0], idx[1], r * local + idx[2]});
        EXPECT_EQ((*down)[i++], want) << "w2 " << ShapeString(idx) << " rank " << r << "/" << n;
      });
    }
  }
}

TEST(ReshardLayoutTest, ExpertsFromOneTensorEachStackLikeStackedExperts) {
  // A Hugging Face checkpoint's experts.{e}.gate_proj/up_proj/down_proj, one tensor each, give
  // vLLM's w13_weight and w2_weight the bytes the stacked sources give.
  const Model stacked = TestModel();
  Model each;
  const std::string prefix = "layers.1.mlp.experts.";
  for (int64_t e = 0; e < 6; ++e) {
    for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
             {"w1", "gate_proj"}, {"w3", "up_proj"}, {"w2", "down_proj"}}) {
      const Global& g = stacked.at(prefix + from);
      Global one;
      one.shape = Dims(g.shape.begin() + 1, g.shape.end());
      const int64_t n = Count(one.shape);
      one.values.assign(g.values.begin() + e * n, g.values.begin() + (e + 1) * n);
      each[absl::StrCat(prefix, e, ".", to, ".weight")] = std::move(one);
    }
  }
  for (int world : {1, 2, 4}) {
    const Group group = Publish(each, world, FsdpSplits(each));
    for (ExpertOrder order : {ExpertOrder::kLinear, ExpertOrder::kRoundRobin}) {
      const std::vector<TensorRequest> requests = {
          {prefix + "w13_weight",
           Placement::ExpertsFromEach(6, "w13_weight",
                                      {"{e}.gate_proj.weight", "{e}.up_proj.weight"}, order)},
          {prefix + "w2_weight",
           Placement::ExpertsFromEach(6, "w2_weight", {"{e}.down_proj.weight"}, order)}};
      const std::vector<TensorRequest> references = {
          {prefix + "w13", Placement::ExpertsMerged("w13", {"w1", "w3"}, order)},
          {prefix + "w2", Placement::Experts(order)}};
      for (int n : {1, 2, 4}) {
        for (int r = 0; r < n; ++r) {
          auto plan = ComputePlan(group.layout, requests, {n, r});
          ASSERT_TRUE(plan.ok()) << plan.status();
          for (size_t i = 0; i < 2; ++i) {
            auto got = Execute(plan->tensors[i], group);
            ASSERT_TRUE(got.ok()) << got.status();
            EXPECT_TRUE(SameAs(plan->tensors[i], *got, Reference(stacked, references[i], {n, r})))
                << "world " << world << ", rank " << r << " of " << n;
          }
        }
      }
    }
  }
  // Errors: an expert missing, a template without {e}, an expert of another shape.
  const Group group = Publish(each, 1, {});
  const std::string w13 = prefix + "w13_weight";
  auto plan_one = [&](int64_t experts, std::string part) {
    return ComputePlan(group.layout,
                       {{w13, Placement::ExpertsFromEach(experts, "w13_weight", {part})}}, {1, 0});
  };
  ExpectError(plan_one(7, "{e}.gate_proj.weight"), absl::StatusCode::kNotFound,
              {"source tensor \"layers.1.mlp.experts.6.gate_proj.weight\" is not in the layout"});
  ExpectError(plan_one(6, "gate_proj.weight"), absl::StatusCode::kInvalidArgument,
              {"part \"gate_proj.weight\" has no \"{e}\" for the expert number"});
  Model odd = each;
  Add(odd, prefix + "3.up_proj.weight", {8, 15});
  ExpectError(
      ComputePlan(Publish(odd, 1, {}).layout,
                  {{w13, Placement::ExpertsFromEach(
                             6, "w13_weight", {"{e}.gate_proj.weight", "{e}.up_proj.weight"})}},
                  {2, 1}),
      absl::StatusCode::kInvalidArgument,
      {"tensor \"layers.1.mlp.experts.w13_weight\" (ExpertsFromEach(6 experts, "
       "{e}.gate_proj.weight + {e}.up_proj.weight -> w13_weight, linear) at TP rank 1 of 2)",
       "its sources must agree on dtype and on every dimension: "
       "\"layers.1.mlp.experts.0.up_proj.weight\" is U32 [8, 16], "
       "\"layers.1.mlp.experts.3.up_proj.weight\" is U32 [8, 15]"});
}

// The checkpoint of TestModel's experts as a Hugging Face checkpoint has them, one tensor per
// expert: "<prefix><e>.gate_proj.weight" [8, 16], up_proj [8, 16], down_proj [16, 8].
Model PerExpertModel(const std::string& prefix) {
  const Model stacked = TestModel();
  Model each;
  for (int64_t e = 0; e < 6; ++e) {
    for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
             {"w1", "gate_proj"}, {"w3", "up_proj"}, {"w2", "down_proj"}}) {
      const Global& g = stacked.at("layers.1.mlp.experts." + from);
      Global one;
      one.shape = Dims(g.shape.begin() + 1, g.shape.end());
      const int64_t n = Count(one.shape);
      one.values.assign(g.values.begin() + e * n, g.values.begin() + (e + 1) * n);
      each[absl::StrCat(prefix, e, ".", to, ".weight")] = std::move(one);
    }
  }
  return each;
}

TEST(ReshardLayoutTest, FusedMoeGroupsFollowVllmsLoadersExpertByExpert) {
  // vLLM's FusedMoE from a Hugging Face checkpoint (vllm/model_executor/layers/fused_moe/
  // layer.py): FusedMoEParallelConfig gives each worker an expert-parallel group (ep_size,
  // ep_rank; determine_expert_map deals the experts) and a tensor-parallel group inside the
  // experts (tp_size, tp_rank; intermediate_size_per_partition). weight_loader(param, w,
  // name, shard_id, expert_id) skips an expert not in expert_map, and at its local index
  // _load_w13 narrows dimension 0 (SHARD_ID_TO_SHARDED_DIM w1/w3) of the expert's gate_proj and
  // up_proj to block tp_rank and writes them to the first and second half of w13_weight's rows;
  // _load_w2 narrows dimension 1 of down_proj. The reference below is those loaders, written
  // element by element; the placement is ExpertsFromEach(...).InGroups(ep, tp, dim).
  const std::string prefix = "layers.1.mlp.experts.";
  const Model each = PerExpertModel(prefix);
  const int64_t experts = 6, inter = 8, hidden = 16;
  struct Groups {
    TensorParallelRank ep, tp;
  };
  // vLLM's two modes at 2 and 4 workers (experts whole over EP, or every expert split over
  // TP), EP with data parallelism (a group wider than the subscriber's), and both at once.
  std::vector<Groups> cases;
  for (int n : {1, 2, 4}) {
    for (int r = 0; r < n; ++r) {
      cases.push_back({{n, r}, {1, 0}});
      cases.push_back({{1, 0}, {n, r}});
    }
  }
  for (int r = 0; r < 4; ++r) cases.push_back({{2, r / 2}, {2, r % 2}});
  cases.push_back({{8, 5}, {1, 0}});  // DP 2 x TP 4 with expert parallelism: EP rank 5 of 8
  for (int world : {1, 2, 4}) {
    const Group group = Publish(each, world, FsdpSplits(each));
    for (ExpertOrder order : {ExpertOrder::kLinear, ExpertOrder::kRoundRobin}) {
      for (const Groups& g : cases) {
        const std::vector<int64_t> local = ReferenceExperts(experts, g.ep.size, g.ep.rank, order);
        const int64_t part = inter / g.tp.size, q = g.tp.rank;
        const std::vector<TensorRequest> requests = {
            {prefix + "w13_weight",
             Placement::ExpertsFromEach(experts, "experts.w13_",
                                        {"experts.{e}.gate_proj.", "experts.{e}.up_proj."}, order)
                 .InGroups(g.ep, g.tp, 0)},
            {prefix + "w2_weight",
             Placement::ExpertsFromEach(experts, "experts.w2_", {"experts.{e}.down_proj."}, order)
                 .InGroups(g.ep, g.tp, 1)}};
        // The subscriber's TP group plays no part once both groups are given.
        auto plan = ComputePlan(group.layout, requests, {3, 2});
        ASSERT_TRUE(plan.ok()) << plan.status();
        const std::string where = absl::StrCat("world ", world, ", EP ", g.ep.rank, "/", g.ep.size,
                                               ", TP ", q, "/", g.tp.size);
        auto w13 = Execute(plan->tensors[0], group);
        ASSERT_TRUE(w13.ok()) << w13.status();
        const Dims w13_shape{static_cast<int64_t>(local.size()), 2 * part, hidden};
        ASSERT_EQ(plan->tensors[0].shape, w13_shape) << where;
        size_t i = 0;
        ForEachIndex(w13_shape, [&](const Dims& idx) {
          const bool up = idx[1] >= part;  // _load_w13: w3 into the second half
          const Global& src = each.at(
              absl::StrCat(prefix, local[idx[0]], up ? ".up_proj" : ".gate_proj", ".weight"));
          const uint32_t want = src.At({q * part + idx[1] - (up ? part : 0), idx[2]});
          EXPECT_EQ((*w13)[i++], want) << where << " w13 " << ShapeString(idx);
        });
        auto w2 = Execute(plan->tensors[1], group);
        ASSERT_TRUE(w2.ok()) << w2.status();
        const Dims w2_shape{static_cast<int64_t>(local.size()), hidden, part};
        ASSERT_EQ(plan->tensors[1].shape, w2_shape) << where;
        i = 0;
        ForEachIndex(w2_shape, [&](const Dims& idx) {
          const Global& src = each.at(absl::StrCat(prefix, local[idx[0]], ".down_proj.weight"));
          EXPECT_EQ((*w2)[i++], src.At({idx[1], q * part + idx[2]}))
              << where << " w2 " << ShapeString(idx);
        });
      }
    }
  }
  // Stacked sources with the same groups give the same bytes (ExpertsMerged, Experts).
  const Model stacked = TestModel();
  const Group stacked_group = Publish(stacked, 2, MegatronSplits(stacked));
  const Group each_group = Publish(each, 1, {});
  for (const Groups& g : cases) {
    const auto from_each =
        ComputePlan(each_group.layout,
                    {{prefix + "w13_weight",
                      Placement::ExpertsFromEach(experts, "experts.w13_",
                                                 {"experts.{e}.gate_proj.", "experts.{e}.up_proj."})
                          .InGroups(g.ep, g.tp, 0)},
                     {prefix + "w2_weight",
                      Placement::ExpertsFromEach(experts, "experts.w2_", {"experts.{e}.down_proj."})
                          .InGroups(g.ep, g.tp, 1)}},
                    {1, 0});
    const auto from_stacked = ComputePlan(
        stacked_group.layout,
        {{prefix + "w13", Placement::ExpertsMerged("w13", {"w1", "w3"}).InGroups(g.ep, g.tp, 0)},
         {prefix + "w2", Placement::Experts().InGroups(g.ep, g.tp, 1)}},
        {1, 0}, {OverlapPolicy::kReport});
    ASSERT_TRUE(from_each.ok() && from_stacked.ok()) << from_each.status() << from_stacked.status();
    for (size_t t = 0; t < 2; ++t) {
      auto a = Execute(from_each->tensors[t], each_group);
      auto b = Execute(from_stacked->tensors[t], stacked_group);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(from_each->tensors[t].shape, from_stacked->tensors[t].shape);
      EXPECT_EQ(*a, *b) << "EP " << g.ep.rank << "/" << g.ep.size << " TP " << g.tp.rank << "/"
                        << g.tp.size << " tensor " << t;
    }
  }
  // The groups are in the plan's fingerprint (a plan kept for one group is not reused for
  // another).
  const TensorRequest a{prefix + "w2_weight", Placement::ExpertsFromEach(experts, "experts.w2_",
                                                                         {"experts.{e}.down_proj."})
                                                  .InGroups({2, 0}, {1, 0}, 0)};
  TensorRequest b = a;
  b.placement.ep_rank = 1;
  EXPECT_NE(ComputePlan(each_group.layout, {a}, {1, 0})->fingerprint,
            ComputePlan(each_group.layout, {b}, {1, 0})->fingerprint);
  // Errors, before any byte moves.
  auto plan_w2 = [&](TensorParallelRank ep, TensorParallelRank tp, int dim) {
    return ComputePlan(
        each_group.layout,
        {{prefix + "w2_weight",
          Placement::ExpertsFromEach(experts, "experts.w2_", {"experts.{e}.down_proj."})
              .InGroups(ep, tp, dim)}},
        {1, 0});
  };
  ExpectError(plan_w2({1, 0}, {3, 1}, 1), absl::StatusCode::kInvalidArgument,
              {"the TP degree 3 inside the experts does not divide dimension 1 of an expert of "
               "\"layers.1.mlp.experts.0.down_proj.weight\" (size 8, global shape [16, 8])"});
  ExpectError(plan_w2({1, 0}, {2, 1}, 2), absl::StatusCode::kInvalidArgument,
              {"dimension 2 inside the experts is outside an expert's 2 dimensions"});
  ExpectError(plan_w2({2, 2}, {1, 0}, 0), absl::StatusCode::kInvalidArgument,
              {"expert-parallel rank 2 of 2"});
  ExpectError(plan_w2({1, 0}, {2, -1}, 1), absl::StatusCode::kInvalidArgument,
              {"tensor-parallel rank -1 of 2 inside the experts"});
  ExpectError(plan_w2({1, 0}, {2, 1}, -1), absl::StatusCode::kInvalidArgument,
              {"dimension -1 inside the experts"});
}

TEST(ReshardPlanTest, DestinationsWithoutAnySourceAreSkippedOnlyWhenAsked) {
  // vLLM's load_weights loads what the checkpoint names and leaves other parameters as they
  // are: AbsentPolicy::kSkip leaves a destination none of whose sources the layout has out of
  // the plan; one with only some of its sources, or a plan with nothing left, is NotFound.
  Model m;
  Add(m, "a.q_proj.weight", {4, 2});
  Add(m, "a.k_proj.weight", {2, 2});
  Add(m, "a.v_proj.weight", {2, 2});
  Add(m, "b.q_proj.weight", {4, 2});
  Add(m, "b.k_proj.weight", {2, 2});
  Add(m, "norm.weight", {2});
  Add(m, "e.experts.1.down_proj.weight", {2, 4});
  const SourceLayout layout = Publish(m, 1, {}).layout;
  const PlanOptions skip{OverlapPolicy::kReject, AbsentPolicy::kSkip};
  const TensorRequest qkv_a{"a.qkv_proj.weight", Placement::Qkv(2, 1, 2)};
  const TensorRequest norm{"norm.weight", Placement::Replicate()};
  const TensorRequest absent[] = {
      {"c.qkv_proj.weight", Placement::Qkv(2, 1, 2)},
      {"lm_head.weight", Placement::Shard(0)},
      {"rotary.inv_freq", Placement::Replicate()},
      {"f.experts.w2_weight",
       Placement::ExpertsFromEach(2, "experts.w2_", {"experts.{e}.down_proj."})},
      {"f.experts.w2", Placement::Experts()}};
  std::vector<TensorRequest> requests = {qkv_a};
  for (const TensorRequest& r : absent) requests.push_back(r);
  requests.push_back(norm);
  auto plan = ComputePlan(layout, requests, {2, 1}, skip);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->tensors.size(), 2u);
  EXPECT_EQ(plan->tensors[0].name, "a.qkv_proj.weight");
  EXPECT_EQ(plan->tensors[1].name, "norm.weight");
  EXPECT_EQ(plan->skipped,
            (std::vector<std::string>{"c.qkv_proj.weight", "lm_head.weight", "rotary.inv_freq",
                                      "f.experts.w2_weight", "f.experts.w2"}));
  // The plan of what is kept is the plan without the skipped destinations.
  auto kept = ComputePlan(layout, {qkv_a, norm}, {2, 1});
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(plan->tensors[0].ranges, kept->tensors[0].ranges);
  EXPECT_NE(plan->fingerprint, ComputePlan(layout, {qkv_a, norm}, {2, 1}, skip)->fingerprint);
  // Without kSkip, the first absent destination is NotFound as before.
  ExpectError(ComputePlan(layout, requests, {2, 1}), absl::StatusCode::kNotFound,
              {"\"c.v_proj.weight\" are not in the layout"});
  // Some sources but not all: q and k of b, not v; expert 1 of 2, not expert 0.
  ExpectError(
      ComputePlan(layout, {qkv_a, {"b.qkv_proj.weight", Placement::Qkv(2, 1, 2)}}, {2, 1}, skip),
      absl::StatusCode::kNotFound, {"\"b.v_proj.weight\" is not in the layout"});
  ExpectError(
      ComputePlan(layout,
                  {{"e.experts.w2_weight",
                    Placement::ExpertsFromEach(2, "experts.w2_", {"experts.{e}.down_proj."})}},
                  {1, 0}, skip),
      absl::StatusCode::kNotFound,
      {"source tensor \"e.experts.0.down_proj.weight\" is not in the layout"});
  // Nothing left to receive.
  ExpectError(ComputePlan(layout, {absent[1], absent[2]}, {2, 1}, skip),
              absl::StatusCode::kNotFound,
              {"none of the 2 destination tensors has a source in the layout (7 tensors), e.g. "
               "\"lm_head.weight\""});
}

// --- Range counts: the fewest contiguous ranges. ---

size_t RangesFor(const Group& group, const TensorRequest& req, TensorParallelRank tp) {
  auto plan = ComputePlan(group.layout, {req}, tp, {OverlapPolicy::kReport});
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? plan->tensors[0].ranges.size() : 0;
}

TEST(ReshardPlanTest, RangesAreMergedWhereverBothSidesAreContiguous) {
  const Model m = TestModel();
  const TensorRequest embed{"embed_tokens.weight", Placement::Shard(0)};           // [12, 16]
  const TensorRequest down{"layers.0.mlp.down_proj.weight", Placement::Shard(1)};  // [16, 24]
  const TensorRequest norm{"layers.0.input_layernorm.weight", Placement::Replicate()};
  const Group whole = Publish(m, 1, {});
  const Group fsdp2 = Publish(m, 2, FsdpSplits(m));
  const Group fsdp4 = Publish(m, 4, FsdpSplits(m));
  const Group mega2 = Publish(m, 2, MegatronSplits(m));
  const Group mega4 = Publish(m, 4, MegatronSplits(m));
  // A dim-0 slice: one range per source part it meets.
  EXPECT_EQ(RangesFor(whole, embed, {2, 1}), 1u);
  EXPECT_EQ(RangesFor(fsdp2, embed, {2, 1}), 1u);  // rows 6..11 are rank 1's part exactly
  EXPECT_EQ(RangesFor(fsdp4, embed, {2, 0}), 2u);  // rows 0..5 from parts of 3 rows
  EXPECT_EQ(RangesFor(fsdp4, embed, {1, 0}), 4u);
  EXPECT_EQ(RangesFor(fsdp4, embed, {4, 1}), 1u);  // rows 3..5 are rank 1's part exactly
  // A dim-1 slice: one range per row, unless it is a whole part on both sides.
  EXPECT_EQ(RangesFor(whole, down, {1, 0}), 1u);
  EXPECT_EQ(RangesFor(whole, down, {2, 1}), 16u);
  EXPECT_EQ(RangesFor(mega2, down, {2, 1}), 1u);   // rank 1's column block is its part
  EXPECT_EQ(RangesFor(mega4, down, {2, 0}), 32u);  // two column parts of 6 per row
  EXPECT_EQ(RangesFor(fsdp4, down, {1, 0}), 4u);   // whole rows from each row part
  EXPECT_EQ(RangesFor(fsdp4, down, {4, 2}), 16u);
  // Replicated and whole tensors: one range.
  EXPECT_EQ(RangesFor(whole, norm, {4, 3}), 1u);
  EXPECT_EQ(RangesFor(mega4, norm, {4, 3}), 1u);
  EXPECT_EQ(RangesFor(fsdp4, norm, {2, 0}), 4u);
}

TEST(ReshardPlanTest, ScalarsAndEmptyTensorsNeedNoSpecialCase) {
  Model m;
  Add(m, "scale", {});
  Add(m, "empty", {0, 4});
  const Group group = Publish(m, 2, {{"scale", Split::kReplicated}});
  for (int r = 0; r < 2; ++r) {
    auto plan = ComputePlan(group.layout,
                            {{"scale", Placement::Replicate()}, {"empty", Placement::Shard(1)}},
                            {2, r}, {OverlapPolicy::kReport});
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto scale = Execute(plan->tensors[0], group);
    ASSERT_TRUE(scale.ok()) << scale.status();
    EXPECT_EQ(*scale, m.at("scale").values);
    ASSERT_EQ(plan->tensors[0].ranges.size(), 1u);
    EXPECT_EQ(plan->tensors[0].ranges[0].owner_rank, r);
    EXPECT_EQ(plan->tensors[1].shape, (Dims{0, 2}));
    EXPECT_TRUE(plan->tensors[1].ranges.empty());
  }
  auto bad = ComputePlan(group.layout, {{"scale", Placement::Shard(0)}}, {2, 0});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(),
              HasSubstr("dimension 0 is outside the tensor's 0 dimensions"));
}

TEST(ReshardPlanTest, ReplicatedPartsAreReadFromOwnersInTurn) {
  // Each TP rank reads a replicated tensor from a different owner, spreading the load.
  const Model m = TestModel();
  const Group group = Publish(m, 4, MegatronSplits(m));
  const TensorRequest norm{"layers.0.input_layernorm.weight", Placement::Replicate()};
  for (int r = 0; r < 4; ++r) {
    auto plan = ComputePlan(group.layout, {norm}, {4, r}, {OverlapPolicy::kReport});
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->tensors[0].ranges.size(), 1u);
    EXPECT_EQ(plan->tensors[0].ranges[0].owner_rank, r);
    // The three other owners' copies are listed against the one read.
    ASSERT_EQ(plan->overlaps.size(), 3u);
    for (const Overlap& o : plan->overlaps) {
      EXPECT_EQ(o.rank_a, r);
      EXPECT_NE(o.rank_b, r);
      EXPECT_EQ(o.shape, (Dims{16}));
      ASSERT_EQ(o.ranges.size(), 1u);
      EXPECT_EQ(o.ranges[0].length, 64u);
    }
  }
}

// --- Errors: before any byte moves, with the exact code and what the message names. ---

SourceLayout OneTensor(Dims global, std::vector<std::pair<int, std::pair<Dims, Dims>>> parts,
                       int world = 4, DType dtype = DType::kF32) {
  SourceLayout l;
  l.world_size = world;
  SourceTensor t;
  t.name = "w";
  uint64_t offset = 0;
  for (auto& [rank, box] : parts) {
    SourcePart p;
    p.owner_rank = rank;
    p.dtype = dtype;
    p.global_shape = global;
    p.offsets = box.first;
    p.shape = box.second;
    p.byte_offset = offset;
    p.byte_size = *ByteSize(dtype, p.shape);
    offset += p.byte_size;
    t.parts.push_back(p);
  }
  l.tensors.push_back(t);
  return l;
}

TEST(ReshardErrorTest, ASliceNoRankOwnsIsAGap) {
  // Rows 4..5 of 8 are nobody's.
  const SourceLayout l = OneTensor({8, 4}, {{0, {{0, 0}, {4, 4}}}, {1, {{6, 0}, {2, 4}}}});
  ExpectError(ComputePlan(l, {{"w", Placement::Shard(0)}}, {2, 1}),
              absl::StatusCode::kFailedPrecondition,
              {"tensor \"w\" (Shard(0) at TP rank 1 of 2)",
               "no rank owns elements offsets [4, 0] "
               "shape [2, 4] of source \"w\" (global shape [8, 4])",
               "rank 0: offsets [0, 0] shape [4, 4]; rank 1: offsets [6, 0] shape [2, 4]"});
  // Rank 0 of 2 needs rows 0..3 only, which rank 0 owns: no error there.
  EXPECT_TRUE(ComputePlan(l, {{"w", Placement::Shard(0)}}, {2, 0}).ok());
  // A column gap inside a row part.
  const SourceLayout cols = OneTensor({2, 6}, {{0, {{0, 0}, {2, 2}}}, {1, {{0, 3}, {2, 3}}}});
  ExpectError(ComputePlan(cols, {{"w", Placement::Replicate()}}, {1, 0}),
              absl::StatusCode::kFailedPrecondition,
              {"no rank owns elements offsets [0, 2] shape [2, 1]"});
}

TEST(ReshardErrorTest, OverlappingOwnersAreRejectedOrReportedForVerification) {
  // Rows 2..3 are on both ranks.
  const SourceLayout l = OneTensor({6, 2}, {{0, {{0, 0}, {4, 2}}}, {1, {{2, 0}, {4, 2}}}}, 2);
  ExpectError(ComputePlan(l, {{"w", Placement::Replicate()}}, {1, 0}),
              absl::StatusCode::kFailedPrecondition,
              {"tensor \"w\": ranks 0 and 1 both own elements offsets [2, 0] shape [2, 2] of its "
               "global shape [6, 2] (parts 0 and 1)",
               "accepted only with OverlapPolicy::kReport and checksums that agree"});
  auto plan = ComputePlan(l, {{"w", Placement::Replicate()}}, {1, 0}, {OverlapPolicy::kReport});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->overlaps.size(), 1u);
  const Overlap& o = plan->overlaps[0];
  EXPECT_EQ(o.tensor, "w");
  EXPECT_EQ(o.rank_a, 0);
  EXPECT_EQ(o.rank_b, 1);
  EXPECT_EQ(o.offsets, (Dims{2, 0}));
  EXPECT_EQ(o.shape, (Dims{2, 2}));
  // Rows 2..3 are bytes 16..31 of rank 0's part and bytes 0..15 of rank 1's (at 32).
  ASSERT_EQ(o.ranges.size(), 1u);
  EXPECT_EQ(o.ranges[0], (Overlap::Range{16, 32, 16}));
  // Rows 0..3 come from rank 0, rows 4..5 from rank 1: each byte read once.
  ASSERT_EQ(plan->tensors[0].ranges.size(), 2u);
  EXPECT_EQ(plan->tensors[0].ranges[0], (ByteRange{0, 0, 0, 0, 32, 0}));
  EXPECT_EQ(plan->tensors[0].ranges[1], (ByteRange{1, 0, 1, 32 + 16, 16, 32}));
  EXPECT_TRUE(CheckOverlapAgrees(o, 7, 7).ok());
  const absl::Status bad = CheckOverlapAgrees(o, 0x1234, 0xabcd);
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(bad.message(),
              AllOf(HasSubstr("tensor \"w\": ranks 0 and 1 both own elements offsets [2, 0] "
                              "shape [2, 2] but their bytes differ"),
                    HasSubstr("checksum 0000000000001234 on rank 0, 000000000000abcd on rank 1")));
}

TEST(ReshardErrorTest, DegreesThatDoNotDivideADimensionOrAHeadCount) {
  const SourceLayout l = OneTensor({6, 8}, {{0, {{0, 0}, {6, 8}}}});
  ExpectError(ComputePlan(l, {{"w", Placement::Shard(0)}}, {4, 1}),
              absl::StatusCode::kInvalidArgument,
              {"tensor \"w\" (Shard(0) at TP rank 1 of 4)",
               "TP degree 4 does not divide dimension 0 of size 6 (global shape [6, 8])"});
  ExpectError(ComputePlan(l, {{"w", Placement::Shard(1)}}, {3, 0}),
              absl::StatusCode::kInvalidArgument,
              {"TP degree 3 does not divide dimension 1 of size 8"});
  ExpectError(ComputePlan(l, {{"w", Placement::Shard(2)}}, {2, 0}),
              absl::StatusCode::kInvalidArgument,
              {"dimension 2 is outside the tensor's 2 dimensions (global shape [6, 8])"});

  auto qkv = [](int64_t heads, int64_t kv, int64_t hs) {
    Model m;
    Add(m, "a.q_proj.weight", {heads * hs, 2});
    Add(m, "a.k_proj.weight", {kv * hs, 2});
    Add(m, "a.v_proj.weight", {kv * hs, 2});
    return Publish(m, 1, {}).layout;
  };
  // 6 query heads over 4 ranks.
  ExpectError(ComputePlan(qkv(6, 2, 2), {{"a.qkv_proj.weight", Placement::Qkv(6, 2, 2)}}, {4, 0}),
              absl::StatusCode::kInvalidArgument,
              {"tensor \"a.qkv_proj.weight\" (Qkv(6 heads, 2 KV heads, head size 2",
               "TP degree 4 does not divide the 6 query heads"});
  // 4 KV heads over 3 ranks (3 < 4, and 3 does not divide 4).
  ExpectError(ComputePlan(qkv(12, 4, 1), {{"a.qkv_proj.weight", Placement::Qkv(12, 4, 1)}}, {3, 0}),
              absl::StatusCode::kInvalidArgument, {"TP degree 3 does not divide the 4 KV heads"});
  // 3 KV heads under TP 6... 12 query heads, TP 4 >= 3 KV heads but 4 % 3 != 0.
  ExpectError(ComputePlan(qkv(12, 3, 1), {{"a.qkv_proj.weight", Placement::Qkv(12, 3, 1)}}, {4, 0}),
              absl::StatusCode::kInvalidArgument,
              {"TP degree 4 is not a multiple of the 3 KV heads"});
  // Heads that do not match the source's rows.
  ExpectError(ComputePlan(qkv(4, 2, 2), {{"a.qkv_proj.weight", Placement::Qkv(4, 2, 3)}}, {2, 0}),
              absl::StatusCode::kInvalidArgument,
              {"source \"a.q_proj.weight\" has 8 rows along dimension 0 (global shape [8, 2]), "
               "but 4 query heads of size 3 need 12"});
  // gate_up whose intermediate size the degree does not divide.
  auto gate_up = [](Dims gate, Dims up) {
    Model m;
    Add(m, "m.gate_proj.weight", std::move(gate));
    Add(m, "m.up_proj.weight", std::move(up));
    return Publish(m, 1, {}).layout;
  };
  const std::vector<TensorRequest> gate_up_request = {
      {"m.gate_up_proj.weight", Placement::GateUp()}};
  ExpectError(ComputePlan(gate_up({6, 2}, {6, 2}), gate_up_request, {4, 2}),
              absl::StatusCode::kInvalidArgument,
              {"tensor \"m.gate_up_proj.weight\" (Merged(gate_proj + up_proj -> gate_up_proj) at "
               "TP rank 2 of 4)",
               "TP degree 4 does not divide part \"gate_proj\" of 6 rows along dimension 0"});
  // Sources of a fused placement that disagree.
  ExpectError(ComputePlan(gate_up({4, 2}, {4, 3}), gate_up_request, {2, 0}),
              absl::StatusCode::kInvalidArgument,
              {"its sources must agree on dtype and on every dimension but 0: "
               "\"m.gate_proj.weight\" is U32 [4, 2], \"m.up_proj.weight\" is U32 [4, 3]"});
  // An invalid TP rank.
  ExpectError(ComputePlan(l, {{"w", Placement::Replicate()}}, {2, 2}),
              absl::StatusCode::kInvalidArgument, {"TP rank 2 of TP degree 2"});
  ExpectError(ComputePlan(l, {{"w", Placement::Replicate()}}, {0, 0}),
              absl::StatusCode::kInvalidArgument, {"TP rank 0 of TP degree 0"});
}

TEST(ReshardErrorTest, RanksThatDisagreeOrPartsOutsideTheTensorAreDataLoss) {
  SourceLayout dtype = OneTensor({4, 2}, {{0, {{0, 0}, {2, 2}}}, {1, {{2, 0}, {2, 2}}}});
  dtype.tensors[0].parts[1].dtype = DType::kBF16;
  dtype.tensors[0].parts[1].byte_size = 8;
  ExpectError(ComputePlan(dtype, {{"w", Placement::Replicate()}}, {1, 0}),
              absl::StatusCode::kDataLoss,
              {"tensor \"w\": ranks disagree on its dtype or global shape: rank 0 says F32 [4, 2], "
               "rank 1 says BF16 [4, 2]"});
  SourceLayout shape = OneTensor({4, 2}, {{0, {{0, 0}, {2, 2}}}, {1, {{2, 0}, {2, 2}}}});
  shape.tensors[0].parts[1].global_shape = {5, 2};
  ExpectError(ComputePlan(shape, {{"w", Placement::Replicate()}}, {1, 0}),
              absl::StatusCode::kDataLoss, {"rank 0 says F32 [4, 2], rank 1 says F32 [5, 2]"});
  const SourceLayout outside = OneTensor({4, 2}, {{0, {{0, 0}, {2, 2}}}, {1, {{3, 0}, {2, 2}}}});
  ExpectError(ComputePlan(outside, {{"w", Placement::Replicate()}}, {1, 0}),
              absl::StatusCode::kDataLoss,
              {"tensor \"w\": rank 1's part (offsets [3, 0] shape [2, 2]) lies outside the global "
               "shape [4, 2] in dimension 0"});
  const SourceLayout negative = OneTensor({4, 2}, {{0, {{0, -1}, {4, 2}}}});
  ExpectError(ComputePlan(negative, {{"w", Placement::Replicate()}}, {1, 0}),
              absl::StatusCode::kDataLoss, {"lies outside the global shape [4, 2] in dimension 1"});
  const SourceLayout rank = OneTensor({4, 2}, {{0, {{0}, {4, 2}}}});
  ExpectError(ComputePlan(rank, {{"w", Placement::Replicate()}}, {1, 0}),
              absl::StatusCode::kDataLoss,
              {"rank 0's part has offsets [0] and shape [4, 2], but the global shape [4, 2] has 2 "
               "dimensions"});
  SourceLayout size = OneTensor({4, 2}, {{0, {{0, 0}, {4, 2}}}});
  size.tensors[0].parts[0].byte_size = 30;
  ExpectError(ComputePlan(size, {{"w", Placement::Replicate()}}, {1, 0}),
              absl::StatusCode::kDataLoss,
              {"rank 0's part of F32 [4, 2] says it has 30 bytes at byte 0 of the rank's data, but "
               "that shape has 32 bytes"});
  const SourceLayout owner = OneTensor({4, 2}, {{5, {{0, 0}, {4, 2}}}}, 4);
  ExpectError(
      ComputePlan(owner, {{"w", Placement::Replicate()}}, {1, 0}), absl::StatusCode::kDataLoss,
      {"tensor \"w\": part 0 is owned by rank 5, outside the publisher group of world size 4"});
  SourceLayout twice = OneTensor({4, 2}, {{0, {{0, 0}, {4, 2}}}});
  twice.tensors.push_back(twice.tensors[0]);
  ExpectError(ComputePlan(twice, {{"w", Placement::Replicate()}}, {1, 0}),
              absl::StatusCode::kDataLoss, {"tensor \"w\" appears twice in the layout"});
  // A malformed tensor nobody asks for does not stop the others.
  SourceLayout other = OneTensor({4, 2}, {{0, {{0, 0}, {4, 2}}}});
  SourceTensor broken = other.tensors[0];
  broken.name = "unused";
  broken.parts[0].byte_size = 1;
  other.tensors.push_back(broken);
  EXPECT_TRUE(ComputePlan(other, {{"w", Placement::Replicate()}}, {1, 0}).ok());
}

TEST(ReshardErrorTest, MissingSourcesAndBadRequests) {
  const SourceLayout l = OneTensor({4, 2}, {{0, {{0, 0}, {4, 2}}}});
  ExpectError(
      ComputePlan(l, {{"nope", Placement::Replicate()}}, {1, 0}), absl::StatusCode::kNotFound,
      {"tensor \"nope\" (Replicate at TP rank 0 of 1): source tensor \"nope\" is not in the "
       "layout (1 tensors)"});
  Model m;
  Add(m, "a.q_proj.weight", {4, 2});
  Add(m, "a.k_proj.weight", {2, 2});
  const SourceLayout qk = Publish(m, 1, {}).layout;
  ExpectError(ComputePlan(qk, {{"a.qkv_proj.weight", Placement::Qkv(2, 1, 2)}}, {1, 0}),
              absl::StatusCode::kNotFound,
              {"source tensor \"a.v_proj.weight\" is not in the layout, nor is a fused "
               "\"a.qkv_proj.weight\""});
  ExpectError(ComputePlan(qk, {{"a.weight", Placement::Qkv(2, 1, 2)}}, {1, 0}),
              absl::StatusCode::kInvalidArgument,
              {"a fused placement needs its fused token (\"qkv_proj\") in the name"});
  ExpectError(ComputePlan(l, {{"w", Placement::Replicate()}, {"w", Placement::Shard(0)}}, {1, 0}),
              absl::StatusCode::kInvalidArgument, {"destination tensor \"w\" is requested twice"});
  // A sub-byte tensor cut inside a byte: F4 [2, 3] by rows is 12 bits a row.
  const SourceLayout f4 = OneTensor({2, 4}, {{0, {{0, 0}, {2, 4}}}}, 1, DType::kF4);
  EXPECT_TRUE(ComputePlan(f4, {{"w", Placement::Shard(0)}}, {2, 1}).ok());  // whole bytes
  const SourceLayout f4_odd = OneTensor({2, 6}, {{0, {{0, 0}, {2, 6}}}}, 1, DType::kF4);
  ExpectError(ComputePlan(f4_odd, {{"w", Placement::Shard(1)}}, {2, 1}),
              absl::StatusCode::kInvalidArgument,
              {"tensor \"w\" is F4 (4 bits per element)",
               "sub-byte tensors split only at whole "
               "bytes"});
}

TEST(ReshardExecutorTest, RangesOutsideTheBuffersCopyNothing) {
  const Model m = TestModel();
  const Group group = Publish(m, 2, FsdpSplits(m));
  auto plan =
      ComputePlan(group.layout, {{"layers.0.mlp.down_proj.weight", Placement::Shard(1)}}, {2, 0});
  ASSERT_TRUE(plan.ok()) << plan.status();
  const TensorPlan& t = plan->tensors[0];
  std::vector<std::byte> dest(t.nbytes, std::byte{0x5a});
  auto spans = group.Spans();
  uint64_t end = 0;  // rank 1's data ends one byte before the last byte the plan reads there
  for (const ByteRange& r : t.ranges) {
    if (r.owner_rank == 1) end = std::max(end, r.source_offset + r.length);
  }
  ASSERT_GT(end, 0u);
  spans[1] = spans[1].subspan(0, end - 1);
  absl::Status s = ApplyPlan(t, spans, absl::MakeSpan(dest));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tensor \"layers.0.mlp.down_proj.weight\": range"),
                                 HasSubstr("of rank 1's data, which has")));
  EXPECT_TRUE(std::all_of(dest.begin(), dest.end(), [](std::byte b) {
    return b == std::byte{0x5a};
  })) << "bytes were copied before the check";
  s = ApplyPlan(t, absl::MakeSpan(spans).subspan(0, 1), absl::MakeSpan(dest));
  EXPECT_THAT(s.message(), HasSubstr("reads rank 1, but data of 1 ranks was given"));
  std::vector<std::byte> small(t.nbytes - 4);
  s = ApplyPlan(t, group.Spans(), absl::MakeSpan(small));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("the destination has 764 bytes, but its slice U32 [16, 12] "
                                     "has 768"));
}

// --- Reuse: fingerprints and the plan cache. ---

TEST(ReshardPlanTest, TheFingerprintFollowsTheLayoutAndThePlanIsReused) {
  const Model m = TestModel();
  const Group a = Publish(m, 2, FsdpSplits(m));
  const Group b = Publish(m, 2, FsdpSplits(m));
  const Group c = Publish(m, 4, FsdpSplits(m));
  EXPECT_EQ(LayoutFingerprint(a.layout), LayoutFingerprint(b.layout));
  EXPECT_NE(LayoutFingerprint(a.layout), LayoutFingerprint(c.layout));
  SourceLayout moved = a.layout;
  moved.tensors[3].parts[1].byte_offset += 64;
  EXPECT_NE(LayoutFingerprint(a.layout), LayoutFingerprint(moved));
  SourceLayout owner = a.layout;
  owner.tensors[3].parts[1].owner_rank = 0;
  EXPECT_NE(LayoutFingerprint(a.layout), LayoutFingerprint(owner));

  auto requests = ResolvePlacements(TestRules(), TestDestinations());
  ASSERT_TRUE(requests.ok());
  PlanCache cache;
  auto p1 = cache.Get(a.layout, *requests, {2, 0});
  ASSERT_TRUE(p1.ok()) << p1.status();
  auto p2 = cache.Get(b.layout, *requests, {2, 0});  // the next version, same layout
  ASSERT_TRUE(p2.ok());
  EXPECT_EQ(cache.computations(), 1);
  EXPECT_EQ(*p1, *p2);
  EXPECT_EQ((*p2)->layout_fingerprint, LayoutFingerprint(b.layout));
  ASSERT_TRUE(cache.Get(c.layout, *requests, {2, 0}).ok());  // the layout changed
  EXPECT_EQ(cache.computations(), 2);
  ASSERT_TRUE(cache.Get(c.layout, *requests, {2, 1}).ok());  // another rank
  EXPECT_EQ(cache.computations(), 3);
  std::vector<TensorRequest> fewer(requests->begin(), requests->end() - 1);
  ASSERT_TRUE(cache.Get(c.layout, fewer, {2, 1}).ok());  // other requests
  EXPECT_EQ(cache.computations(), 4);
  ASSERT_TRUE(cache.Get(c.layout, fewer, {2, 1}).ok());
  EXPECT_EQ(cache.computations(), 4);
  // A failed computation keeps nothing, and the next good one is computed again.
  EXPECT_FALSE(cache.Get(c.layout, fewer, {3, 1}).ok());
  EXPECT_EQ(cache.computations(), 5);
  ASSERT_TRUE(cache.Get(c.layout, fewer, {2, 1}).ok());
  EXPECT_EQ(cache.computations(), 6);
}

TEST(ReshardPlanTest, ResolvePlacementsTakesTheFirstMatchingGlob) {
  const std::vector<PlacementRule> rules = {
      {"layers.*.mlp.down_proj.weight", Placement::Shard(1)},
      {"layers.*.mlp.*", Placement::Shard(0)},
      {"*.expert[s].w2", Placement::Experts()},
  };
  auto r = ResolvePlacements(rules, {"layers.3.mlp.down_proj.weight", "layers.3.mlp.up.weight",
                                     "norm.weight", "x.experts.w2"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].placement, Placement::Shard(1));
  EXPECT_EQ((*r)[1].placement, Placement::Shard(0));
  EXPECT_EQ((*r)[2].placement, Placement::Replicate());
  EXPECT_EQ((*r)[3].placement, Placement::Experts());
  auto dup = ResolvePlacements(rules, {"a", "a"});
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dup.status().message(), HasSubstr("destination tensor \"a\" is named twice"));
}

// --- The layout, not just the bytes: a tensor-parallel MLP on the resharded slices. ---

// The MLP is vLLM's on one rank's slices (tests/tp_forward.h, whose whole-model TP forward pass
// tests/tp_logits_test.cc runs on subscribed slices): gate_up_proj split in halves, SiluAndMul,
// down_proj.
using ::weightbus::testing::Mlp;
using ::weightbus::testing::SumOrder;

TEST(ReshardForwardTest, TensorParallelMlpOnTheSlicesMatchesTheUnslicedOne) {
  constexpr int64_t kHidden = 16, kInter = 24;
  std::mt19937 rng(12);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  auto random = [&](int64_t n) {
    std::vector<float> v(n);
    for (float& f : v) f = dist(rng);
    return v;
  };
  const std::vector<float> gate = random(kInter * kHidden), up = random(kInter * kHidden),
                           down = random(kHidden * kInter), x = random(kHidden);
  // The publisher group: FSDP2 row shards over 2 ranks (F32 bytes).
  Group group;
  group.layout.world_size = 2;
  group.data.resize(2);
  auto publish = [&](const std::string& name, const std::vector<float>& v, Dims shape) {
    SourceTensor t;
    t.name = name;
    const int64_t rows = shape[0] / 2, cols = shape[1];
    for (int r = 0; r < 2; ++r) {
      SourcePart p;
      p.owner_rank = r;
      p.dtype = DType::kF32;
      p.global_shape = shape;
      p.offsets = {r * rows, 0};
      p.shape = {rows, cols};
      p.byte_offset = group.data[r].size();
      p.byte_size = rows * cols * 4;
      const auto* b = reinterpret_cast<const std::byte*>(v.data() + r * rows * cols);
      group.data[r].insert(group.data[r].end(), b, b + p.byte_size);
      t.parts.push_back(p);
    }
    group.layout.tensors.push_back(t);
  };
  publish("mlp.gate_proj.weight", gate, {kInter, kHidden});
  publish("mlp.up_proj.weight", up, {kInter, kHidden});
  publish("mlp.down_proj.weight", down, {kHidden, kInter});

  // The tolerance: the float noise of reordering the reduction, measured.
  const std::vector<float> ref =
      Mlp(gate.data(), up.data(), down.data(), x.data(), kHidden, kInter);
  const std::vector<float> rev =
      Mlp(gate.data(), up.data(), down.data(), x.data(), kHidden, kInter, SumOrder::kReverse);
  float noise = 0, scale = 0;
  for (int64_t o = 0; o < kHidden; ++o) {
    noise = std::max(noise, std::abs(ref[o] - rev[o]));
    scale = std::max(scale, std::abs(ref[o]));
  }
  const float tolerance = std::max(4 * noise, 8 * FLT_EPSILON * scale * kInter);

  auto forward = [&](int tp, const Placement& gate_up) -> float {
    std::vector<float> y(kHidden, 0.0f);  // the all-reduce: a sum over ranks
    for (int r = 0; r < tp; ++r) {
      auto plan = ComputePlan(
          group.layout,
          {{"mlp.gate_up_proj.weight", gate_up}, {"mlp.down_proj.weight", Placement::Shard(1)}},
          {tp, r});
      EXPECT_TRUE(plan.ok()) << plan.status();
      if (!plan.ok()) return INFINITY;
      std::vector<float> gu(plan->tensors[0].nbytes / 4), dn(plan->tensors[1].nbytes / 4);
      EXPECT_TRUE(ApplyPlan(plan->tensors[0], group.Spans(),
                            absl::MakeSpan(reinterpret_cast<std::byte*>(gu.data()), gu.size() * 4))
                      .ok());
      EXPECT_TRUE(ApplyPlan(plan->tensors[1], group.Spans(),
                            absl::MakeSpan(reinterpret_cast<std::byte*>(dn.data()), dn.size() * 4))
                      .ok());
      const int64_t local = kInter / tp;
      EXPECT_EQ(plan->tensors[0].shape, (Dims{2 * local, kHidden}));
      EXPECT_EQ(plan->tensors[1].shape, (Dims{kHidden, local}));
      // vLLM's MLP: gate_up_proj output split in halves, SiluAndMul, then down_proj.
      const std::vector<float> part =
          Mlp(gu.data(), gu.data() + local * kHidden, dn.data(), x.data(), kHidden, local);
      for (int64_t o = 0; o < kHidden; ++o) y[o] += part[o];
    }
    float err = 0;
    for (int64_t o = 0; o < kHidden; ++o) err = std::max(err, std::abs(y[o] - ref[o]));
    return err;
  };
  for (int tp : {1, 2, 4}) {
    EXPECT_LE(forward(tp, Placement::GateUp()), tolerance) << "TP " << tp;
    // gate and up swapped: the bytes move, the layout is wrong, and the forward pass shows it.
    EXPECT_GT(forward(tp, Placement::Merged("gate_up_proj", {"up_proj", "gate_proj"})),
              100 * tolerance)
        << "TP " << tp;
  }
}

}  // namespace
}  // namespace weightbus::internal

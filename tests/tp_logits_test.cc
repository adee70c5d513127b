// SPDX-License-Identifier: Apache-2.0
// Resharded slices checked as a consumer uses them (docs/RESHARDING.md, "How layouts are
// tested"): publisher groups of N ranks publish a small Llama through a transport stack; each
// of the M ranks of a tensor-parallel (TP) replica subscribes with vLLM's placements (fused
// qkv_proj with grouped-query attention, gate_up_proj, row-parallel o_proj/down_proj, the
// vocabulary split, experts split on the expert dimension or inside each expert) and the TP
// forward pass over the slices (tests/tp_forward.h) must give the unsharded model's logits
// within the float reduction-order noise, measured here. Wrong layouts that round-trip byte for
// byte (qkv sliced contiguously, gate and up swapped, a row-parallel tensor sliced on the wrong
// dimension) must be caught by the logits.
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "stories260k.h"
#include "test_support.h"
#include "tp_forward.h"
#include "ucx_tls.h"
#include "weightbus/llama_forward.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::weightbus::testing::ExpertSplit;
using ::weightbus::testing::LlamaShape;
using ::weightbus::testing::OwnedTensor;
using ::weightbus::testing::ScratchDir;
using ::weightbus::testing::SumOrder;

constexpr absl::Duration kTimeout = absl::Seconds(60);

// BOS, then ids spread over the smaller vocabulary (256).
constexpr int32_t kTokens[] = {1, 200, 31, 255, 77, 128, 3, 164};

// --- The models. ---

enum class ModelKind : uint8_t { kStories260K, kWideGqa, kMoeExpertParallel, kMoeTensorParallel };

struct ModelCase {
  ModelKind kind;
  std::string name;
  LlamaShape shape;
  ExpertSplit split = ExpertSplit::kExpertParallel;
};

// stories260K as converted (tests/stories260k.h): 8 query heads and 4 KV heads of 8, tied.
LlamaShape Stories260KShape() {
  return {.hidden = 64,
          .intermediate = 172,
          .layers = 5,
          .heads = 8,
          .kv_heads = 4,
          .vocab = 512,
          .rms_eps = 1e-5f,
          .tied = true};
}

// Wider, with 2 KV heads (so TP 4 replicates each on two ranks), q/k/v biases and an untied
// head; the MoE variant's second layer has 6 experts, top 2 (6 does not divide by 4: expert
// parallel ranks hold 2, 2, 1 and 1).
LlamaShape WideShape(bool moe) {
  LlamaShape s{.hidden = 128,
               .intermediate = 256,
               .layers = 2,
               .heads = 8,
               .kv_heads = 2,
               .vocab = 256,
               .rms_eps = 1e-6f,
               .qkv_bias = true};
  if (moe) {
    s.experts = 6;
    s.top_k = 2;
    s.expert_intermediate = 64;
    s.first_moe_layer = 1;
  }
  return s;
}

const ModelCase& Case(ModelKind kind) {
  static const auto* cases = new std::map<ModelKind, ModelCase>{
      {ModelKind::kStories260K, {ModelKind::kStories260K, "Stories260K", Stories260KShape()}},
      {ModelKind::kWideGqa, {ModelKind::kWideGqa, "WideGqa", WideShape(false)}},
      {ModelKind::kMoeExpertParallel,
       {ModelKind::kMoeExpertParallel, "MoeExpertParallel", WideShape(true),
        ExpertSplit::kExpertParallel}},
      {ModelKind::kMoeTensorParallel,
       {ModelKind::kMoeTensorParallel, "MoeTensorParallel", WideShape(true),
        ExpertSplit::kTensorParallel}},
  };
  return cases->at(kind);
}

// Version 2 is version 1 after a small step: each weight scaled by 1 + U(-0.05, 0.05).
std::vector<OwnedTensor> Stepped(std::vector<OwnedTensor> model) {
  std::mt19937_64 rng(2);
  std::uniform_real_distribution<float> step(-0.05f, 0.05f);
  for (OwnedTensor& t : model) {
    for (size_t i = 0; i < t.bytes.size(); i += 4) {
      float f;
      std::memcpy(&f, t.bytes.data() + i, 4);
      f *= 1.0f + step(rng);
      std::memcpy(t.bytes.data() + i, &f, 4);
    }
  }
  return model;
}

// The published tensors of `kind`'s version 1 or 2, made once.
const std::vector<OwnedTensor>& Tensors(ModelKind kind, uint64_t version) {
  static auto* made = new std::map<std::pair<ModelKind, uint64_t>, std::vector<OwnedTensor>>();
  auto it = made->find({kind, version});
  if (it != made->end()) return it->second;
  std::vector<OwnedTensor> model;
  if (version == 2) {
    model = Stepped(Tensors(kind, 1));
  } else if (kind == ModelKind::kStories260K) {
    for (const tools::OwnedTensor& t : testing::Stories260K()) {
      model.push_back(OwnedTensor{t.name, t.dtype, t.shape, t.bytes});
    }
  } else {
    model = testing::RandomLlama(Case(kind).shape, /*seed=*/kind == ModelKind::kWideGqa ? 7 : 8);
  }
  return made->emplace(std::make_pair(kind, version), std::move(model)).first->second;
}

// --- The reference and its tolerance. ---

// The unsharded model's logits, and how far apart two runs of it in different summation
// orders are: every reduction forwards, then every reduction backwards (tests/tp_forward.h).
// A TP run changes only the order of some of those sums (the row-parallel o_proj and down_proj
// dot products become M partial sums added by the all-reduce; expert outputs are added per
// rank), so its distance from the reference is reduction-order noise of the same kind.
// The tolerance is kNoiseFactor times the measured noise (per model and version; the test
// prints it as "[ noise    ]" and each cell's distance as "[ logits   ]"). Measured here: the
// noise is 2.0e-5 to 4.9e-5 on stories260K (max |logit| 12.8) and 2.4e-6 to 3.0e-6 on the wide
// models (max |logit| 3.5 to 4.0); TP 2 and 4 runs land at 0.45x to 1.13x the noise (TP 1 at
// exactly 0: the same sums in the same order), the injected wrong layouts at about 1e5 times the
// tolerance. 4x leaves room for another compiler's rounding without letting any layout error
// through: a wrong layout moves logits by whole units, not by float rounding.
constexpr float kNoiseFactor = 4;

struct Reference {
  std::vector<float> logits;
  float noise = 0;
  float tolerance = 0;
  float max_logit = 0;
};

std::vector<TensorView> ViewsOf(const std::vector<OwnedTensor>& tensors) {
  std::vector<TensorView> views;
  for (const OwnedTensor& t : tensors) views.push_back(t.View());
  return views;
}

const Reference& ReferenceOf(ModelKind kind, uint64_t version) {
  static auto* refs = new std::map<std::pair<ModelKind, uint64_t>, Reference>();
  auto it = refs->find({kind, version});
  if (it != refs->end()) return it->second;
  const ModelCase& c = Case(kind);
  const std::vector<std::vector<TensorView>> whole = {ViewsOf(Tensors(kind, version))};
  Reference ref;
  auto forward = testing::TpLogits(c.shape, whole, kTokens, c.split, SumOrder::kForward);
  auto reverse = testing::TpLogits(c.shape, whole, kTokens, c.split, SumOrder::kReverse);
  EXPECT_TRUE(forward.ok()) << forward.status();
  EXPECT_TRUE(reverse.ok()) << reverse.status();
  if (forward.ok() && reverse.ok()) {
    ref.logits = *forward;
    ref.noise = testing::MaxAbsDiff(*forward, *reverse);
    for (float l : ref.logits) ref.max_logit = std::max(ref.max_logit, std::abs(l));
    ref.tolerance = kNoiseFactor * ref.noise;
    std::printf(
        "[ noise    ] %s v%llu: max |logit| %.3g, reduction-order noise %.3g, "
        "tolerance %.3g\n",
        c.name.c_str(), static_cast<unsigned long long>(version), ref.max_logit, ref.noise,
        ref.tolerance);
  }
  return refs->emplace(std::make_pair(kind, version), std::move(ref)).first->second;
}

// The measured noise is float rounding: above zero (the orders do differ) and far below the
// logits (no discrete flip such as a MoE routing decision changed by the order).
void ExpectPlausibleNoise(const Reference& ref) {
  EXPECT_GT(ref.noise, 0.0f);
  EXPECT_LT(ref.noise, 1e-4f * ref.max_logit);
}

// --- Publishing as a group. ---

// What rank `rank` of a group of `world` publishes of the tensor at `index`: with one rank, the
// tensor whole. In a group, a deterministic mix by index covering every kind of part: 1-D
// tensors replicated on every rank (even index) or split in dimension 0 (odd); others owned
// whole by one rank (every fifth) or split in dimension index % ndim (FSDP2 row shards,
// Megatron column slices as strided views, the experts' inner dimensions), rank r holding
// [r * n / world, (r + 1) * n / world). nullopt: the rank publishes none of it.
std::optional<TensorView> GroupPart(const OwnedTensor& t, size_t index, int world, int rank) {
  TensorView v = t.View();
  if (world == 1) return v;
  const int ndim = static_cast<int>(t.shape.size());
  if (ndim == 1 && index % 2 == 0) return v;  // replicated
  if (ndim >= 2 && index % 5 == 4) {
    if (rank != static_cast<int>(index % world)) return std::nullopt;
    return v;
  }
  const int d = ndim == 1 ? 0 : static_cast<int>(index % ndim);
  std::vector<int64_t> strides(ndim, 1);
  for (int i = ndim - 2; i >= 0; --i) strides[i] = strides[i + 1] * t.shape[i + 1];
  const int64_t begin = t.shape[d] * rank / world, end = t.shape[d] * (rank + 1) / world;
  std::vector<int64_t> offsets(ndim, 0);
  offsets[d] = begin;
  v.shard = Shard{t.shape, offsets};
  v.shape[d] = end - begin;
  v.data = t.bytes.data() + begin * strides[d] * 4;
  if (d > 0) v.strides = strides;
  return v;
}

// One publisher per rank of a group (or a single publisher), publishing each version from one
// thread per rank.
class PublisherGroup {
 public:
  // Opens `world` ranks on `uri` with `options`, each rank of a group with `group_options` too;
  // the status of the first rank that fails.
  absl::Status Open(const std::string& uri, int world, const Options& options_for_all = {},
                    const Options& group_options = {}) {
    for (int r = 0; r < world; ++r) {
      Options options = options_for_all;
      if (world > 1) {
        options.insert(group_options.begin(), group_options.end());
        options["rank"] = std::to_string(r);
        options["world_size"] = std::to_string(world);
      }
      auto p = Publisher::Open(uri, options);
      if (!p.ok()) return p.status();
      ranks_.push_back(*std::move(p));
    }
    return absl::OkStatus();
  }

  // Every rank publishes its parts of `tensors` as `version`; the first failure.
  absl::Status Publish(uint64_t version, const std::vector<OwnedTensor>& tensors) {
    const int world = static_cast<int>(ranks_.size());
    std::vector<absl::Status> status(world);
    auto publish = [&](int r) {
      std::vector<TensorView> views;
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (std::optional<TensorView> v = GroupPart(tensors[i], i, world, r)) views.push_back(*v);
      }
      status[r] = ranks_[r]->Publish(version, views, {}, kTimeout);
    };
    std::vector<std::thread> threads;
    for (int r = 1; r < world; ++r) threads.emplace_back(publish, r);
    publish(0);
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < world; ++r) {
      if (!status[r].ok()) {
        return absl::Status(status[r].code(),
                            absl::StrFormat("rank %d of %d: %s", r, world, status[r].message()));
      }
    }
    return absl::OkStatus();
  }

 private:
  std::vector<std::unique_ptr<Publisher>> ranks_;
};

// The M ranks of a TP replica, each with its own subscriber and placements.
struct Replica {
  std::vector<std::unique_ptr<Subscriber>> ranks;
  std::vector<std::unique_ptr<Update>> updates;

  static absl::StatusOr<Replica> Open(const std::string& uri, int tp,
                                      const std::vector<PlacementRule>& rules,
                                      const std::vector<std::string>& destinations,
                                      const Options& options = {}) {
    Replica replica;
    for (int r = 0; r < tp; ++r) {
      auto sub = Subscriber::Open(uri, options, SubscribePlacements{rules, {tp, r}, destinations});
      if (!sub.ok()) return sub.status();
      replica.ranks.push_back(*std::move(sub));
    }
    return replica;
  }

  // Every rank receives exactly `version`; then the slices each holds.
  absl::StatusOr<std::vector<std::vector<TensorView>>> Receive(uint64_t version) {
    updates.clear();
    std::vector<std::vector<TensorView>> slices;
    for (size_t r = 0; r < ranks.size(); ++r) {
      auto u = ranks[r]->ReceiveVersion(version, kTimeout);
      if (!u.ok()) {
        return absl::Status(u.status().code(),
                            absl::StrFormat("TP rank %d: %s", r, u.status().message()));
      }
      updates.push_back(*std::move(u));
      slices.emplace_back(updates.back()->tensors().begin(), updates.back()->tensors().end());
    }
    return slices;
  }
};

// --- The grid: stacks x publisher world sizes x TP degrees x models. ---

struct StackCase {
  std::string name;
  std::string uri;  // {dir}: a fresh directory; {port}: a free loopback port
  testing::Tls env;
  std::vector<int> worlds;     // the publisher world sizes this stack runs
  Options publisher_options;   // every publisher rank's settings
  Options group_options;       // what each rank of a group sets besides rank and world_size
  Options subscriber_options;  // every TP rank's settings
  bool partial_reads = false;  // a TP rank of a degree > 1 reads less than the model
};

// The publisher world sizes per stack. A stack that refuses world_size > 1 at open (a build or
// stack without publisher groups) skips the cell, naming the capability, rather than failing.
const std::vector<StackCase>& StackCases() {
  static const auto* stacks = new std::vector<StackCase>{
      // Partial reads: checksum tiles of at most 4 KiB (every matrix cut into up to 8 x 8, so
      // each TP rank reads and verifies only the tiles its slices touch, row-parallel o_proj and
      // down_proj included) through a 64 KiB staging window.
      {"disk",
       "disk://{dir}/channel",
       {},
       {1, 2, 4},
       {{"checksum_block", "4KiB"}},
       {{"poll_interval", "2ms"}},
       {{"staging_window", "64KiB"}},
       /*partial_reads=*/true},
      // delta_send_plain=false: a single publisher encodes too (its plain-or-delta choice would
      // send these small versions plainly); the subject here is the layout of decoded deltas.
      // The records carry 4 KiB tiles: each TP rank decodes only the chunks its slices meet
      // (4 KiB chunks: most tensors span several) and reads its tiles.
      {"delta_disk",
       "delta+disk://{dir}/channel",
       {},
       {1, 2, 4},
       {{"delta_send_plain", "false"}, {"checksum_block", "4KiB"}, {"delta_chunk_size", "4KiB"}},
       {{"poll_interval", "2ms"}},
       {{"staging_window", "64KiB"}},
       /*partial_reads=*/true},
      {"ucx",
       "ucx://127.0.0.1:{port}/channel",
       testing::kShm,
       {1, 2, 4},
       {{"checksum_block", "4KiB"}},
       {},
       {{"staging_window", "64KiB"}},
       /*partial_reads=*/true},
  };
  return *stacks;
}

struct Cell {
  StackCase stack;
  int publishers;
  int tp;
  ModelKind model;
};

std::vector<Cell> Grid() {
  std::vector<Cell> cells;
  for (const StackCase& stack : StackCases()) {
    for (int n : stack.worlds) {
      for (int m : {1, 2, 4}) {
        for (ModelKind k : {ModelKind::kStories260K, ModelKind::kWideGqa,
                            ModelKind::kMoeExpertParallel, ModelKind::kMoeTensorParallel}) {
          cells.push_back({stack, n, m, k});
        }
      }
    }
  }
  return cells;
}

void PrintTo(const Cell& c, std::ostream* os) {
  *os << c.stack.name << ", " << c.publishers << " publishers, TP " << c.tp << ", "
      << Case(c.model).name;
}

std::string CellName(const ::testing::TestParamInfo<Cell>& info) {
  return absl::StrFormat("%s_N%d_TP%d_%s", info.param.stack.name, info.param.publishers,
                         info.param.tp, Case(info.param.model).name);
}

// The transports `stack` needs that this build lacks, or "".
std::string MissingFor(const StackCase& stack) {
  const std::string scheme = stack.uri.substr(0, stack.uri.find("://"));
  std::vector<std::string> schemes;
  for (absl::string_view s : absl::StrSplit(scheme, '+')) schemes.emplace_back(s);
  return testing::MissingTransports(schemes);
}

class TpLogitsGridTest : public ::testing::TestWithParam<Cell> {};

TEST_P(TpLogitsGridTest, TensorParallelLogitsOnTheSlicesMatchTheUnshardedModel) {
  const Cell& cell = GetParam();
  const ModelCase& model = Case(cell.model);
  if (const std::string why = MissingFor(cell.stack); !why.empty()) GTEST_SKIP() << why;
  const testing::ScopedEnvs env(cell.stack.env.env);
  ScratchDir dir;
  const std::string uri = absl::StrReplaceAll(
      cell.stack.uri, {{"{dir}", dir.path()}, {"{port}", std::to_string(testing::FreePort())}});

  PublisherGroup group;
  if (absl::Status open =
          group.Open(uri, cell.publishers, cell.stack.publisher_options, cell.stack.group_options);
      !open.ok()) {
    if (cell.publishers > 1 && open.code() == absl::StatusCode::kUnimplemented) {
      GTEST_SKIP() << cell.stack.name
                   << " does not implement publisher groups yet (world_size=" << cell.publishers
                   << " refused at open: " << open << ")";
    }
    FAIL() << open;
  }
  auto replica = Replica::Open(uri, cell.tp, testing::TpRules(model.shape, model.split),
                               testing::TpDestinations(model.shape), cell.stack.subscriber_options);
  ASSERT_TRUE(replica.ok()) << replica.status();
  // Two versions: the second replays the first's plan (and is a delta on delta+disk).
  for (uint64_t version : {1, 2}) {
    SCOPED_TRACE(absl::StrFormat("version %d", version));
    const Reference& ref = ReferenceOf(cell.model, version);
    ExpectPlausibleNoise(ref);
    ASSERT_TRUE(group.Publish(version, Tensors(cell.model, version)).ok());
    auto slices = replica->Receive(version);
    ASSERT_TRUE(slices.ok()) << slices.status();
    auto logits = testing::TpLogits(model.shape, *slices, kTokens, model.split);
    ASSERT_TRUE(logits.ok()) << logits.status();
    const float err = testing::MaxAbsDiff(*logits, ref.logits);
    uint64_t model_bytes = 0, most_read = 0;
    for (const OwnedTensor& t : Tensors(cell.model, version)) model_bytes += t.bytes.size();
    for (const auto& u : replica->updates) most_read = std::max(most_read, u->stats().bytes);
    if (cell.stack.partial_reads && cell.tp > 1) EXPECT_LT(most_read, model_bytes);
    // With partial reads a rank reads its slices, rounded out to tiles: exactly its slices for
    // the dense models, whose split dimensions all divide into the tiles' fractions (the
    // row-parallel o_proj and down_proj not read whole); MoE experts dealt 2, 2, 1, 1 over 4
    // ranks start inside tiles.
    for (size_t r = 0; cell.stack.partial_reads && r < replica->updates.size(); ++r) {
      uint64_t slices = 0;
      for (const TensorView& v : replica->updates[r]->tensors()) {
        slices += ByteSize(v.dtype, v.shape).value();
      }
      const uint64_t read = replica->updates[r]->stats().bytes;
      EXPECT_GE(read, slices) << "TP rank " << r;
      if (cell.model == ModelKind::kStories260K || cell.model == ModelKind::kWideGqa) {
        EXPECT_EQ(read, slices) << "TP rank " << r;
      }
    }
    // Over the delta layer, every TP rank's version 2 is a delta on its copy of version 1 (from
    // a group: each publisher rank's part is, "rank R: delta 2 ...; ...").
    if (version == 2 && absl::StartsWith(cell.stack.uri, "delta+")) {
      for (const auto& u : replica->updates) {
        const std::vector<std::string> parts = absl::StrSplit(u->stats().encoding, "; ");
        EXPECT_EQ(parts.size(), static_cast<size_t>(cell.publishers)) << u->stats().encoding;
        for (int r = 0; r < static_cast<int>(parts.size()); ++r) {
          const std::string want =
              cell.publishers == 1 ? "delta 2 " : absl::StrFormat("rank %d: delta 2 ", r);
          EXPECT_TRUE(absl::StartsWith(parts[r], want)) << u->stats().encoding;
        }
      }
    }
    std::printf(
        "[ logits   ] %s N=%d TP=%d %s v%llu: max |dlogit| %.3g = %.2f x noise; a rank read at "
        "most %.0f%% of the model%s%s\n",
        cell.stack.name.c_str(), cell.publishers, cell.tp, model.name.c_str(),
        static_cast<unsigned long long>(version), err, err / ref.noise,
        100.0 * most_read / model_bytes, replica->updates[0]->stats().encoding.empty() ? "" : "; ",
        replica->updates[0]->stats().encoding.c_str());
    EXPECT_LE(err, ref.tolerance) << "noise " << ref.noise;
  }
}

INSTANTIATE_TEST_SUITE_P(Cells, TpLogitsGridTest, ::testing::ValuesIn(Grid()), CellName);

// The reference forward pass itself is right: on stories260K it gives the logits of
// tools' HfLlamaForward (written separately, double accumulation; proven against llama2.c's
// math in llama2c_test) within the noise.
TEST(TpLogitsReferenceTest, TheUnshardedForwardPassIsHuggingFaceLlama) {
  const LlamaShape s = Stories260KShape();
  const Reference& ref = ReferenceOf(ModelKind::kStories260K, 1);
  ExpectPlausibleNoise(ref);
  const tools::HfLlamaConfig config{.hidden_size = s.hidden,
                                    .intermediate_size = s.intermediate,
                                    .num_hidden_layers = s.layers,
                                    .num_attention_heads = s.heads,
                                    .num_key_value_heads = s.kv_heads,
                                    .vocab_size = s.vocab,
                                    .max_position_embeddings = 512,
                                    .rms_norm_eps = s.rms_eps,
                                    .tie_word_embeddings = true};
  const std::vector<TensorView> views = ViewsOf(Tensors(ModelKind::kStories260K, 1));
  auto hf = tools::HfLlamaForward(config, views, kTokens);
  ASSERT_TRUE(hf.ok()) << hf.status();
  const float err = testing::MaxAbsDiff(hf->values, ref.logits);
  std::printf("[ anchor   ] float forward vs HfLlamaForward: max |dlogit| %.3g = %.2f x noise\n",
              err, err / ref.noise);
  EXPECT_LE(err, ref.tolerance);
}

// --- Wrong layouts: bytes that round-trip, logits that do not. ---

// stories260K with each layer's q, k and v published already fused as qkv_proj (Phi-3 style),
// so that slicing it contiguously is a placement a subscriber can declare.
std::vector<OwnedTensor> FusedQkv(const std::vector<OwnedTensor>& model) {
  std::vector<OwnedTensor> out;
  for (const OwnedTensor& t : model) {
    const size_t at = t.name.find("self_attn.q_proj.");
    if (at != std::string::npos) {
      OwnedTensor fused = t;
      fused.name = absl::StrReplaceAll(t.name, {{"q_proj", "qkv_proj"}});
      for (const char* part : {"k_proj", "v_proj"}) {
        const std::string name = absl::StrReplaceAll(t.name, {{"q_proj", part}});
        for (const OwnedTensor& other : model) {
          if (other.name != name) continue;
          fused.shape[0] += other.shape[0];
          fused.bytes.insert(fused.bytes.end(), other.bytes.begin(), other.bytes.end());
        }
      }
      out.push_back(std::move(fused));
    } else if (t.name.find("self_attn.k_proj.") == std::string::npos &&
               t.name.find("self_attn.v_proj.") == std::string::npos) {
      out.push_back(t);
    }
  }
  return out;
}

struct Fault {
  std::string name;
  bool fused_qkv;                    // publish qkv_proj fused (FusedQkv) instead of q, k, v
  PlacementRule wrong;               // put before the right rules (the first match wins)
  std::string tensor;                // the tensor the round trip checks (layer 0's)
  std::vector<std::string> sources;  // what concatenating its slices gives back, in order
};

void PrintTo(const Fault& f, std::ostream* os) { *os << f.name; }

const std::string kL0 = "model.layers.0.";

class TpLogitsWrongLayoutTest : public ::testing::TestWithParam<Fault> {};

// Over disk://, a group of 2 publishing stories260K to a TP 2 replica: with the fault, every
// rank's slices have the right sizes and concatenating them (on dimension 0, halves for the
// merged one) gives the published tensors back byte for byte, so a byte-level round trip
// passes; the logits are outside the tolerance. Without it, the same setup is within.
TEST_P(TpLogitsWrongLayoutTest, ARoundTripPassesButTheLogitsCatchIt) {
  const Fault& fault = GetParam();
  constexpr int kTp = 2;
  const LlamaShape shape = Stories260KShape();
  const Reference& ref = ReferenceOf(ModelKind::kStories260K, 1);
  std::vector<OwnedTensor> tensors = Tensors(ModelKind::kStories260K, 1);
  if (fault.fused_qkv) tensors = FusedQkv(tensors);
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  PublisherGroup group;
  ASSERT_TRUE(group.Open(uri, 2, {}, {{"poll_interval", "2ms"}}).ok());
  ASSERT_TRUE(group.Publish(1, tensors).ok());

  for (bool inject : {false, true}) {
    SCOPED_TRACE(inject ? "wrong layout" : "right layout");
    std::vector<PlacementRule> rules = testing::TpRules(shape, ExpertSplit::kExpertParallel);
    if (inject) rules.insert(rules.begin(), fault.wrong);
    auto replica = Replica::Open(uri, kTp, rules, testing::TpDestinations(shape));
    ASSERT_TRUE(replica.ok()) << replica.status();
    auto slices = replica->Receive(1);
    ASSERT_TRUE(slices.ok()) << slices.status();
    auto logits = testing::TpLogits(shape, *slices, kTokens, ExpertSplit::kExpertParallel);
    ASSERT_TRUE(logits.ok()) << logits.status();
    const float err = testing::MaxAbsDiff(*logits, ref.logits);
    std::printf("[ fault    ] %s %s: max |dlogit| %.3g = %.3g x tolerance\n", fault.name.c_str(),
                inject ? "injected" : "absent", err, err / ref.tolerance);
    if (!inject) {
      EXPECT_LE(err, ref.tolerance);
      continue;
    }
    EXPECT_GT(err, ref.tolerance);
    // The byte-level round trip: the ranks' slices of the tensor, each cut into as many pieces
    // as there are sources and gathered piece by piece, are the sources' bytes.
    std::vector<std::byte> gathered, published;
    const size_t pieces = fault.sources.size();
    for (size_t piece = 0; piece < pieces; ++piece) {
      for (int r = 0; r < kTp; ++r) {
        const TensorView* v = replica->updates[r]->Find(kL0 + fault.tensor);
        ASSERT_NE(v, nullptr);
        int64_t n = 4;
        for (int64_t d : v->shape) n *= d;
        const auto* b = static_cast<const std::byte*>(v->data) + n / pieces * piece;
        gathered.insert(gathered.end(), b, b + n / pieces);
      }
      for (const OwnedTensor& t : tensors) {
        if (t.name == kL0 + fault.sources[piece]) {
          published.insert(published.end(), t.bytes.begin(), t.bytes.end());
        }
      }
    }
    ASSERT_FALSE(published.empty());
    EXPECT_EQ(gathered, published) << "the round trip of " << fault.tensor;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Faults, TpLogitsWrongLayoutTest,
    ::testing::Values(
        // q, k and v cut in M contiguous row blocks of [q; k; v] instead of per head.
        Fault{"QkvSlicedContiguously",
              true,
              {"*.self_attn.qkv_proj.weight", Placement::Shard(0)},
              "self_attn.qkv_proj.weight",
              {"self_attn.qkv_proj.weight"}},
        // gate_up_proj holding each rank's up rows first.
        Fault{"GateAndUpSwapped",
              false,
              {"*.mlp.gate_up_proj.weight",
               Placement::Merged("gate_up_proj", {"up_proj", "gate_proj"})},
              "mlp.gate_up_proj.weight",
              {"mlp.up_proj.weight", "mlp.gate_proj.weight"}},
        // o_proj (row-parallel, Shard(1)) sliced on its output dimension: [H / M, H] where the
        // forward pass wants [H, H / M], the same number of elements.
        Fault{"RowParallelSlicedOnTheWrongDimension",
              false,
              {"*.self_attn.o_proj.weight", Placement::Shard(0)},
              "self_attn.o_proj.weight",
              {"self_attn.o_proj.weight"}}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace weightbus

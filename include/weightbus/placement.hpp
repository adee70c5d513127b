// SPDX-License-Identifier: Apache-2.0
// Placements: the slice of each tensor that one rank of a tensor-parallel (TP) inference group
// wants, in the layouts inference engines use. The library turns placements plus a version's
// layout (which publisher rank owns which bytes) into a transfer plan of byte ranges
// (docs/RESHARDING.md). Value types; no I/O, no locks.
//
// Tensors are row-major. A weight of an nn.Linear is [out_features, in_features], so
// "column-parallel" (vLLM ColumnParallelLinear, output_dim=0) is Shard(0) and "row-parallel"
// (RowParallelLinear, input_dim=1) is Shard(1); the fused layouts below follow vLLM's weight
// loaders, named in each factory's comment, and slice along `dim` (their output_dim, 0 for
// weights and biases).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace weightbus {

// One rank of the subscribing tensor-parallel group: `size` ranks (the TP degree, >= 1), this
// one `rank` (0 <= rank < size). Expert-parallel placements split experts over the same group
// (vLLM with enable_expert_parallel and data parallel size 1: EP size = TP size).
struct TensorParallelRank {
  int size = 1;
  int rank = 0;
  friend bool operator==(const TensorParallelRank&, const TensorParallelRank&) = default;
};

// How experts are dealt to expert-parallel ranks, as vLLM's determine_expert_map
// (vllm/model_executor/layers/fused_moe/layer.py): kLinear gives rank r the contiguous block
// starting at r * (E / size) + min(r, E % size), with one extra expert on each of the first
// E % size ranks; kRoundRobin gives rank r experts r, r + size, r + 2 * size, ...
enum class ExpertOrder : uint8_t { kLinear, kRoundRobin };

// The slice of one destination tensor that a TP rank receives.
//
// kReplicate   the whole tensor.
// kShard       1/size of dimension `dim`, rank r's block [r * n / size, (r + 1) * n / size).
// kQkv         vLLM's fused qkv_proj with grouped-query attention, from three sources.
// kMerged      vLLM's MergedColumnParallelLinear (gate_up_proj), from `parts.size()` sources.
// kExperts     stacked experts [E, ...] split on dimension 0 (expert parallel); with `parts`,
//              each local expert's parts are also fused along dimension 1 (vLLM's w13); with
//              `num_experts`, from one source tensor per expert and part (ExpertsFromEach);
//              with expert_tp_size > 1, each expert also split inside (tensor parallel MoE).
//
// Fused placements (kQkv, kMerged, kExperts with parts) name their sources by substitution in
// the destination's name: the last occurrence of `fused` is replaced by each entry of `parts`
// (as vLLM's load_weights maps checkpoint names through stacked_params_mapping, e.g.
// vllm/model_executor/models/llama.py). When those sources are absent but a source of the
// destination's own name exists, that tensor is taken as already fused (Phi-3 style): its
// `dim` holds the parts one after another, as vLLM's _load_fused_module_from_checkpoint reads
// them.
struct Placement {
  enum class Kind : uint8_t { kReplicate, kShard, kQkv, kMerged, kExperts };
  Kind kind = Kind::kReplicate;
  // kShard: the dimension split. kQkv, kMerged: the output dimension the parts are stacked and
  // sliced along (0 for weights and biases). kExperts: unused (experts are dimension 0).
  int dim = 0;
  // kQkv: total query heads, total KV heads, and the head sizes in rows (v_head_size 0 means
  // head_size), as QKVParallelLinear's total_num_heads, total_num_kv_heads, head_size and
  // v_head_size.
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_size = 0;
  int64_t v_head_size = 0;
  // kQkv, kMerged, kExperts: the token of the destination's name that names the fused tensor,
  // and the tokens naming its sources in order (q, k, v; gate, up). Empty for kExperts without
  // fusion (the source is the destination's name).
  std::string fused;
  std::vector<std::string> parts;
  // kExperts: how experts are dealt to ranks.
  ExpertOrder expert_order = ExpertOrder::kLinear;
  // kExperts from one tensor per expert (ExpertsFromEach): how many experts; 0 for stacked
  // sources.
  int64_t num_experts = 0;
  // kExperts: the expert-parallel group that deals the experts (ep_size ranks, this one
  // ep_rank). ep_size 0: the subscriber's TP group (vLLM with enable_expert_parallel and data
  // parallel size 1); 1: every expert on every rank (vLLM's FusedMoE without expert
  // parallelism). vLLM's layer says which: FusedMoE.ep_size / ep_rank (FusedMoEParallelConfig:
  // with data parallelism the group spans dp_size * tp_size ranks).
  int ep_size = 0;
  int ep_rank = 0;
  // kExperts: tensor parallelism inside each expert, as vLLM's FusedMoE without expert
  // parallelism (FusedMoE.tp_size / tp_rank, intermediate_size_per_partition): dimension
  // `expert_tp_dim` of each part of one expert (the expert's own tensor, without the expert
  // dimension: vLLM's SHARD_ID_TO_SHARDED_DIM, 0 for w1/w3 gate and up, 1 for w2 down) is split
  // in expert_tp_size equal blocks and block expert_tp_rank is taken; the parts are then
  // fused as before (w13: the expert's gate block, then its up block, as FusedMoE._load_w13).
  // expert_tp_size 0 or 1: experts whole.
  int expert_tp_size = 0;
  int expert_tp_rank = 0;
  int expert_tp_dim = 0;

  friend bool operator==(const Placement&, const Placement&) = default;

  // The whole tensor on every rank (vLLM ReplicatedLinear, norms, any parameter without
  // output_dim/input_dim).
  static Placement Replicate() { return Placement{}; }

  // 1/size of dimension `dim` per rank, as vLLM's ColumnParallelLinear.weight_loader (dim =
  // output_dim = 0) and RowParallelLinear.weight_loader (dim = input_dim = 1) narrow the loaded
  // weight to tp_rank's block. The dimension must be divisible by the TP degree.
  // VocabParallelEmbedding and ParallelLMHead (vllm/model_executor/layers/
  // vocab_parallel_embedding.py) pad the vocabulary to a multiple of 64 and give each rank
  // padded / size rows: Shard(0) is that slice when the vocabulary is a multiple of 64 * size;
  // other vocabularies are not a placement yet (the padding rows have no source bytes).
  static Placement Shard(int dim) {
    Placement p;
    p.kind = Kind::kShard;
    p.dim = dim;
    return p;
  }

  // vLLM QKVParallelLinear (vllm/model_executor/layers/linear.py, __init__ and weight_loader):
  // rank r's rows are [q_r | k_r | v_r] along `dim`, q_r being its num_heads / size query heads
  // (block r), and k_r, v_r its KV heads: num_kv_heads / size of them (block r) when size <
  // num_kv_heads, else one head, number r / (size / num_kv_heads), replicated on size /
  // num_kv_heads ranks. num_heads must be divisible by size, and num_kv_heads by size or size
  // by num_kv_heads. The q source has num_heads * head_size rows, k num_kv_heads * head_size,
  // v num_kv_heads * v_head_size.
  static Placement Qkv(int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                       std::string fused = "qkv_proj",
                       std::vector<std::string> parts = {"q_proj", "k_proj", "v_proj"}) {
    Placement p;
    p.kind = Kind::kQkv;
    p.num_heads = num_heads;
    p.num_kv_heads = num_kv_heads;
    p.head_size = head_size;
    p.fused = std::move(fused);
    p.parts = std::move(parts);
    return p;
  }

  // vLLM MergedColumnParallelLinear.weight_loader (vllm/model_executor/layers/linear.py):
  // rank r's rows are [part0_r | part1_r | ...] along `dim`, part i's block r of size
  // output_sizes[i] / size (each part's size must be divisible by the TP degree).
  static Placement Merged(std::string fused, std::vector<std::string> parts) {
    Placement p;
    p.kind = Kind::kMerged;
    p.fused = std::move(fused);
    p.parts = std::move(parts);
    return p;
  }
  // gate_up_proj from gate_proj and up_proj: each rank's gate half then its up half.
  static Placement GateUp() { return Merged("gate_up_proj", {"gate_proj", "up_proj"}); }

  // Stacked experts [E, ...] of the destination's own name, split on dimension 0 over the
  // group as vLLM's FusedMoE with expert parallelism (determine_expert_map in
  // vllm/model_executor/layers/fused_moe/layer.py): rank r receives [E_r, ...], its experts in
  // increasing order. E need not be divisible by the TP degree.
  static Placement Experts(ExpertOrder order = ExpertOrder::kLinear) {
    Placement p;
    p.kind = Kind::kExperts;
    p.expert_order = order;
    return p;
  }
  // Stacked experts fused as vLLM's w13_weight [E_r, 2 * I, H] from stacked gate (w1) and up
  // (w3) sources [E, I, H]: each local expert's gate rows then its up rows (FusedMoE._load_w13
  // with tp_size 1, as expert parallelism runs experts whole).
  static Placement ExpertsMerged(std::string fused, std::vector<std::string> parts,
                                 ExpertOrder order = ExpertOrder::kLinear) {
    Placement p = Experts(order);
    p.fused = std::move(fused);
    p.parts = std::move(parts);
    return p;
  }
  // Experts stored one tensor per expert, as Hugging Face checkpoints name them: each part is a
  // template in which "{e}" stands for the expert number, replacing `fused` in the
  // destination's name as vLLM's FusedMoE.make_expert_params_mapping maps
  // "experts.{e}.gate_proj." to "experts.w13_". Rank r receives [E_r, rows, ...], each local
  // expert's parts one after another along dimension 1 (FusedMoE.weight_loader at the expert's
  // local index, tp_size 1 under expert parallelism), e.g. vLLM's w13_weight from
  // ExpertsFromEach(E, "w13_weight", {"{e}.gate_proj.weight", "{e}.up_proj.weight"}) and
  // w2_weight from ExpertsFromEach(E, "w2_weight", {"{e}.down_proj.weight"}).
  static Placement ExpertsFromEach(int64_t num_experts, std::string fused,
                                   std::vector<std::string> parts,
                                   ExpertOrder order = ExpertOrder::kLinear) {
    Placement p = ExpertsMerged(std::move(fused), std::move(parts), order);
    p.num_experts = num_experts;
    return p;
  }

  // This experts placement with its groups given (see ep_size, expert_tp_size above) rather
  // than the subscriber's TP group: experts dealt over `ep` (size 0: the TP group) and each
  // expert's parts split on `expert_tp_dim` over `expert_tp` (size 0 or 1: whole). vLLM's
  // FusedMoE w13_weight at TP 4 without expert parallelism, rank r:
  //   ExpertsFromEach(E, "experts.w13_", {"experts.{e}.gate_proj.", "experts.{e}.up_proj."})
  //       .InGroups({.size = 1, .rank = 0}, {.size = 4, .rank = r}, 0)
  // and w2_weight the same with {"experts.{e}.down_proj."} and dimension 1; with expert
  // parallelism over the TP group, InGroups({4, r}, {1, 0}, 0) (or no InGroups at all).
  Placement InGroups(TensorParallelRank ep, TensorParallelRank expert_tp, int dim) const {
    Placement p = *this;
    p.ep_size = ep.size;
    p.ep_rank = ep.rank;
    p.expert_tp_size = expert_tp.size;
    p.expert_tp_rank = expert_tp.rank;
    p.expert_tp_dim = dim;
    return p;
  }
};

// A placement for every destination tensor whose name matches `pattern`, an fnmatch(3) glob
// without flags ('*' and '?' match any characters, '.' and '/' included; [...] sets), e.g.
// "*.qkv_proj.weight". The first matching rule wins; a name no rule matches is replicated.
struct PlacementRule {
  std::string pattern;
  Placement placement;
  friend bool operator==(const PlacementRule&, const PlacementRule&) = default;
};

}  // namespace weightbus

// SPDX-License-Identifier: Apache-2.0
// A tensor-parallel (TP) forward pass of a small Llama, as a consumer of resharded slices runs
// it: each of M ranks computes its part with the slices it received, in the layouts vLLM uses
// (column-parallel qkv_proj and gate_up_proj fused as QKVParallelLinear and
// MergedColumnParallelLinear fuse them, row-parallel o_proj and down_proj, the vocabulary split
// over embed_tokens and lm_head, experts split on the expert dimension or inside each expert),
// and the partial outputs are summed (the all-reduce, emulated in this process: rank 0's part
// plus rank 1's, ...). Byte equality alone does not prove a layout right; logits do
// (tests/tp_logits_test.cc, docs/RESHARDING.md "How layouts are tested").
//
// Arithmetic is float32 throughout, every reduction (dot products, the attention's weighted
// sum, RMSNorm's mean of squares, the all-reduce) through one summation whose order is
// selectable, so two runs of the unsharded model in different orders measure the float
// reduction-order noise a TP run is compared within.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "test_model.h"
#include "weightbus/placement.hpp"
#include "weightbus/types.hpp"

namespace weightbus::testing {

// The shape of a Hugging Face LlamaForCausalLM (names as transformers writes them), optionally
// with q/k/v biases (Qwen2) and mixture-of-experts layers with stacked experts
// (`model.layers.{l}.mlp.gate.weight` [E, H] the router; `mlp.experts.gate_proj.weight` and
// `up_proj.weight` [E, I_e, H], `down_proj.weight` [E, H, I_e]), Mixtral's routing: top-k of the
// router logits, softmax over the k chosen.
struct LlamaShape {
  int64_t hidden = 0;
  int64_t intermediate = 0;  // of the dense MLP layers
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t vocab = 0;
  float rms_eps = 1e-5f;
  double rope_theta = 10000.0;
  bool tied = false;  // lm_head is model.embed_tokens.weight
  bool qkv_bias = false;
  int64_t experts = 0;  // 0: no MoE layers
  int64_t top_k = 0;
  int64_t expert_intermediate = 0;
  int64_t first_moe_layer = 0;  // layers from this one on are MoE (when experts > 0)

  int64_t head_dim() const { return hidden / heads; }
  bool moe(int64_t layer) const { return experts > 0 && layer >= first_moe_layer; }
};

// A model of `shape` with weights drawn from `seed` (uniform, scaled by 1/sqrt(fan-in) so that
// activations and logits stay of order one; norms near 1), F32, in the order above.
std::vector<OwnedTensor> RandomLlama(const LlamaShape& shape, uint64_t seed);

// How the experts of a MoE layer are split over the TP group: whole experts dealt to ranks as
// vLLM's determine_expert_map (linear) with expert parallelism, or every expert's intermediate
// dimension split (tensor-parallel MoE).
enum class ExpertSplit : uint8_t { kExpertParallel, kTensorParallel };

// The placements a TP rank subscribes with (vLLM's layouts) and the destination tensors it
// receives: embed_tokens and lm_head Shard(0); per layer qkv_proj (weight, and bias with
// qkv_bias) Qkv, o_proj Shard(1), gate_up_proj GateUp, down_proj Shard(1); MoE layers the router
// whole, experts.gate_up_proj.weight and experts.down_proj.weight by `split`; norms whole.
std::vector<PlacementRule> TpRules(const LlamaShape& shape, ExpertSplit split);
std::vector<std::string> TpDestinations(const LlamaShape& shape);

// The order every reduction sums its terms in.
enum class SumOrder : uint8_t { kForward, kReverse };

// The logits [tokens.size(), vocab] (row-major) of the model whose TP ranks hold `ranks`
// (ranks.size() is the TP degree M; ranks[r] the tensors rank r received, by name). Each
// tensor is looked up under its fused name (qkv_proj, gate_up_proj, experts.gate_up_proj) and,
// failing that, under its parts' names (q_proj, k_proj, v_proj; gate_proj, up_proj), so the
// unsharded model (M = 1, the tensors as published) runs through the same code. A tensor is
// taken when it has the number of elements rank r's slice has and read as that slice's shape,
// as a flat copy into a preallocated parameter reads it: a slice of the wrong dimension with the
// right size goes through and shows in the logits. Rotary embeddings are Hugging Face's
// half-split ones; attention is causal over the whole sequence.
// Errors: NotFound naming a missing tensor and its rank; InvalidArgument for a tensor that is
// not F32, not contiguous, or of the wrong size (both sizes named), a degree that does not
// divide the heads, the vocabulary or an intermediate size, or a token outside the vocabulary.
absl::StatusOr<std::vector<float>> TpLogits(const LlamaShape& shape,
                                            const std::vector<std::vector<TensorView>>& ranks,
                                            absl::Span<const int32_t> tokens, ExpertSplit split,
                                            SumOrder order = SumOrder::kForward);

// The max |a - b| over two equally long arrays (+inf if they differ in length or hold a NaN).
float MaxAbsDiff(absl::Span<const float> a, absl::Span<const float> b);

// vLLM's MLP on one rank's slices: y = down @ (silu(gate @ x) * (up @ x)) for row-major gate,
// up [inter, hidden] and down [hidden, inter], float, every reduction in `order`.
std::vector<float> Mlp(const float* gate, const float* up, const float* down, const float* x,
                       int64_t hidden, int64_t inter, SumOrder order = SumOrder::kForward);

}  // namespace weightbus::testing

// SPDX-License-Identifier: Apache-2.0
// Two independent Llama forward passes, used to prove a llama2.c -> Hugging Face conversion
// correct by comparing their logits on the same tokens:
//
//  * Llama2cForward, the reference: a faithful port of `forward()` in llama2.c's run.c
//    (https://github.com/karpathy/llama2.c), token by token with a KV cache, float32
//    arithmetic, operating directly on the llama2.c arrays (interleaved RoPE pairs).
//  * HfLlamaForward: written separately over Hugging Face LlamaForCausalLM tensors by name,
//    following transformers/models/llama/modeling_llama.py (half-split RoPE with rotate_half,
//    repeat_kv GQA, whole-sequence causal attention), with double-precision accumulation.
//
// Both take token ids at positions 0..T-1 (no batch) and return float logits [T, vocab].
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "weightbus/llama2c.h"
#include "weightbus/types.hpp"

namespace weightbus::tools {

// Logits of one sequence: values[t * vocab_size + v] is the logit of token v at position t.
struct Logits {
  int64_t num_tokens = 0;
  int64_t vocab_size = 0;
  std::vector<float> values;  // [num_tokens, vocab_size], row-major

  // Position t's row, vocab_size values. Requires 0 <= t < num_tokens.
  absl::Span<const float> Row(int64_t t) const;
  // Index of the largest logit at position t (the lowest index among equal maxima, as run.c's
  // sample_argmax). Requires 0 <= t < num_tokens and vocab_size > 0.
  int64_t Argmax(int64_t t) const;
};

// The llama2.c reference forward pass: logits after feeding `tokens[0..T-1]` at positions
// 0..T-1, one run.c `forward(transformer, token, pos)` call per position. Mathematics (run.c):
// x = token_embedding[token]; per layer: RMSNorm (eps 1e-5) with rms_att; q, k, v = wq/wk/wv
// matmuls; RoPE on adjacent pairs (i, i+1) of each head with freq = 1 / 10000^(i % head_size /
// head_size), angle = pos * freq; causal softmax attention scaled by 1/sqrt(head_size), query
// head h reading kv head h / (n_heads / n_kv_heads); x += wo * att; RMSNorm with rms_ffn;
// x += w2 (silu(w1 x) * (w3 x)); finally RMSNorm with rms_final and the classifier (wcls, or
// token_embedding when shared). The stored freq_cis tables are not used (run.c ignores them).
// Errors: InvalidArgument when T > max_seq_len or a token is outside [0, vocab); as
// ValidateLlama2cCheckpoint.
absl::StatusOr<Logits> Llama2cForward(const Llama2cCheckpoint& checkpoint,
                                      absl::Span<const int32_t> tokens);

// The fields of a Hugging Face LlamaConfig that the forward pass needs.
struct HfLlamaConfig {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // defaults to num_attention_heads when absent from JSON
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;  // LlamaConfig defaults
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
};

// Parses a config.json (LlamaConfig). `source` names it in messages.
// Errors: InvalidArgument naming `source` for invalid JSON, a missing or ill-typed required field
// (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size,
// max_position_embeddings), model_type other than "llama", hidden_act other than "silu",
// rope_scaling set, or sizes that do not divide (heads, kv heads, odd head_dim).
absl::StatusOr<HfLlamaConfig> ParseHfLlamaConfig(std::string_view json, std::string_view source);

// The values of a contiguous CPU tensor of dtype F32 or BF16 as float32 (exact).
// Errors: InvalidArgument naming the tensor for another dtype, a non-contiguous or non-CPU
// view, a null data pointer with elements, or a bad shape.
absl::StatusOr<std::vector<float>> TensorToFloats(const TensorView& tensor);

// The Hugging Face Llama forward pass: logits of LlamaForCausalLM for `tokens` at positions
// 0..T-1, computed from `tensors` (looked up by HF name, F32 or BF16, contiguous CPU views; other
// tensors are ignored). Mathematics (modeling_llama.py): h = embed_tokens[token]; per layer:
// LlamaRMSNorm (rms_norm_eps); q/k/v projections; RoPE with inv_freq[i] = 1 / rope_theta^(2i /
// head_dim), cos/sin = cat(freqs, freqs), x * cos + rotate_half(x) * sin where rotate_half(x) =
// cat(-x2, x1) over the two halves of each head; causal softmax(q k^T / sqrt(head_dim)) v with
// repeat_kv; o_proj residual; post_attention_layernorm; down(silu(gate(x)) * up(x)) residual;
// model.norm; lm_head.weight, or model.embed_tokens.weight when tie_word_embeddings is set (as
// HF ties them; lm_head.weight, if present, is then ignored). Arithmetic: float32 storage,
// double accumulation; BF16 weights are widened exactly, not computed in bf16.
// Errors: NotFound naming a missing tensor (lm_head.weight when not tied); InvalidArgument for a
// tensor of the wrong shape or dtype (naming it, with expected and actual shapes), T >
// max_position_embeddings, or a token outside [0, vocab_size).
absl::StatusOr<Logits> HfLlamaForward(const HfLlamaConfig& config,
                                      absl::Span<const TensorView> tensors,
                                      absl::Span<const int32_t> tokens);

// How close two logits arrays are.
struct LogitsComparison {
  int64_t positions = 0;     // T
  double max_abs_diff = 0;   // max |a - b| over all elements
  double mean_abs_diff = 0;  // mean |a - b| over all elements (0 when there are none)
  // max over elements of |a - b| / max(|a|, |b|) (0 where a == b), in [0, 2]. Large for logits
  // near zero; max_abs_diff is the primary criterion. All three are +inf if either side has a NaN.
  double max_rel_diff = 0;
  int64_t argmax_matches = 0;  // positions whose Argmax agrees

  // argmax_matches / positions (1 for T = 0).
  double argmax_agreement() const;
  // One line, e.g. "T=16 max_abs_diff=1.2e-06 mean_abs_diff=2e-07 max_rel_diff=3e-05
  // argmax 16/16".
  std::string ToString() const;
};

// Compares `a` and `b` element by element.
// Errors: InvalidArgument when their shapes differ.
absl::StatusOr<LogitsComparison> CompareLogits(const Logits& a, const Logits& b);

}  // namespace weightbus::tools

// SPDX-License-Identifier: Apache-2.0
// Reading llama2.c checkpoints and converting them to Hugging Face LlamaForCausalLM tensors.
//
// Input format: the legacy "version 0" export of llama2.c (https://github.com/karpathy/llama2.c,
// export.py `legacy_export`, read by run.c `read_checkpoint` / `memory_map_weights`):
//
//   7 x int32 (little-endian): dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
//                              max_seq_len
//   float32 (little-endian) arrays, row-major, each matrix [out_features, in_features]:
//     token_embedding [vocab, dim]
//     rms_att [L, dim]   wq [L, dim, dim]   wk [L, kv_dim, dim]   wv [L, kv_dim, dim]
//     wo [L, dim, dim]   rms_ffn [L, dim]   w1 [L, hidden, dim]   w2 [L, dim, hidden]
//     w3 [L, hidden, dim]   rms_final [dim]
//     freq_cis_real [max_seq_len, head_size / 2]   freq_cis_imag [max_seq_len, head_size / 2]
//     wcls [vocab, dim]   only when the header's vocab_size is negative (unshared classifier)
//
// with kv_dim = dim * n_kv_heads / n_heads, head_size = dim / n_heads, vocab = |vocab_size|.
// The two RoPE tables are not parameters (run.c skips them and recomputes the rotation).
//
// Output: the state dict of transformers' LlamaForCausalLM, as produced by
// transformers/models/llama/convert_llama_weights_to_hf.py, including its `permute` of the q/k
// projections (see PermuteRotaryRows).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "weightbus/types.hpp"

namespace weightbus::tools {

// Size in bytes of the llama2.c header (seven int32).
inline constexpr size_t kLlama2cHeaderBytes = 28;

// Hyperparameters of a llama2.c checkpoint, from its header.
struct Llama2cConfig {
  int32_t dim = 0;         // model width (HF hidden_size)
  int32_t hidden_dim = 0;  // FFN width (HF intermediate_size)
  int32_t n_layers = 0;
  int32_t n_heads = 0;            // query heads
  int32_t n_kv_heads = 0;         // key/value heads (n_heads for MHA, fewer for GQA)
  int32_t vocab_size = 0;         // always positive here: |header vocab_size|
  int32_t max_seq_len = 0;        // rows of the RoPE tables; longest sequence run.c accepts
  bool shared_classifier = true;  // header vocab_size > 0: logits use token_embedding

  int32_t head_size() const { return dim / n_heads; }
  int32_t kv_dim() const { return dim / n_heads * n_kv_heads; }

  friend bool operator==(const Llama2cConfig&, const Llama2cConfig&) = default;
};

// A loaded llama2.c checkpoint: the config and every float32 array of the file, in the file's
// layout (shapes as in the file comment above; per-layer arrays stacked over layers).
struct Llama2cCheckpoint {
  Llama2cConfig config;
  std::vector<float> token_embedding;  // [vocab, dim]
  std::vector<float> rms_att;          // [L, dim]
  std::vector<float> wq;               // [L, dim, dim]
  std::vector<float> wk;               // [L, kv_dim, dim]
  std::vector<float> wv;               // [L, kv_dim, dim]
  std::vector<float> wo;               // [L, dim, dim]
  std::vector<float> rms_ffn;          // [L, dim]
  std::vector<float> w1;               // [L, hidden, dim]  gate
  std::vector<float> w2;               // [L, dim, hidden]  down
  std::vector<float> w3;               // [L, hidden, dim]  up
  std::vector<float> rms_final;        // [dim]
  std::vector<float> freq_cis_real;    // [max_seq_len, head_size / 2]  cos(pos * freq)
  std::vector<float> freq_cis_imag;    // [max_seq_len, head_size / 2]  sin(pos * freq)
  std::vector<float> wcls;             // [vocab, dim]; empty when config.shared_classifier

  // The output classifier, [vocab, dim]: wcls, or token_embedding when shared.
  const std::vector<float>& classifier() const {
    return config.shared_classifier ? token_embedding : wcls;
  }
};

// Parses and validates the 28-byte header at the start of `bytes` (which may be the whole
// file). `source` names the file in messages.
// Errors (DataLoss, naming `source`): fewer than 28 bytes; a llama2.c version 1/2 export (magic
// "ak42"), which is not this format; a non-positive dimension; vocab_size 0; dim not divisible
// by n_heads; n_heads not divisible by n_kv_heads; an odd head_size.
absl::StatusOr<Llama2cConfig> ParseLlama2cHeader(std::string_view bytes, std::string_view source);

// Exact size in bytes of a checkpoint file with a valid `config` (header + every array above,
// wcls included when the classifier is not shared). Saturates at UINT64_MAX.
uint64_t Llama2cFileSize(const Llama2cConfig& config);

// Parses a whole checkpoint held in memory (`bytes` is the complete file).
// Errors: as ParseLlama2cHeader; DataLoss naming `source`, the expected byte count and the actual
// one when the size is not exactly Llama2cFileSize (truncated or trailing bytes).
absl::StatusOr<Llama2cCheckpoint> ParseLlama2c(std::string_view bytes, std::string_view source);

// Reads and parses the checkpoint at `path`.
// Errors: NotFound for a missing file, PermissionDenied, Internal for other I/O errors (each with
// the path and the errno text); otherwise as ParseLlama2c.
absl::StatusOr<Llama2cCheckpoint> ReadLlama2c(const std::string& path);

// Checks that `checkpoint`'s config is valid (the rules of ParseLlama2cHeader) and that every
// array has the size the config implies (wcls empty when the classifier is shared).
// Errors: InvalidArgument naming the problem (the config, or the array with both sizes).
absl::Status ValidateLlama2cCheckpoint(const Llama2cCheckpoint& checkpoint);

// Serializes `checkpoint` in the format above (the inverse of ParseLlama2c; used by tests to
// build variants, e.g. an unshared classifier). Errors: as ValidateLlama2cCheckpoint.
absl::StatusOr<std::string> SerializeLlama2c(const Llama2cCheckpoint& checkpoint);

// A tensor that owns its bytes (contiguous, row-major, little-endian).
struct OwnedTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;  // DTypeSize(dtype) * NumElements(shape) bytes

  // A view of this tensor (CPU, contiguous), valid while this object is alive and unmodified.
  TensorView view() const;
};

// Reorders the rows of a q or k projection `w` ([rows, cols] row-major float32, rows =
// n_heads * head_size) from llama2.c's interleaved rotary convention (RoPE rotates the adjacent
// pairs (2i, 2i+1) of each head) to Hugging Face's half-split convention (pairs (i, i +
// head_size/2), see rotate_half in modeling_llama.py). This is `permute` of
// convert_llama_weights_to_hf.py:
//   w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
// i.e. output row h*head_size + j*head_size/2 + i = input row h*head_size + 2*i + j.
// Errors: InvalidArgument when n_heads <= 0, rows or cols < 0, rows is not a multiple of
// 2 * n_heads, or w.size() != rows * cols.
absl::StatusOr<std::vector<float>> PermuteRotaryRows(absl::Span<const float> w, int64_t n_heads,
                                                     int64_t rows, int64_t cols);

// The inverse of PermuteRotaryRows (HF half-split back to llama2.c interleaved). Same errors.
absl::StatusOr<std::vector<float>> UnpermuteRotaryRows(absl::Span<const float> w, int64_t n_heads,
                                                       int64_t rows, int64_t cols);

// Converts float32 values to `dtype` bytes (little-endian): F32 copies, BF16 rounds to nearest
// even (FloatToBf16). Errors: InvalidArgument for any other dtype.
absl::StatusOr<std::vector<std::byte>> EncodeFloats(absl::Span<const float> values, DType dtype);

// The tensors of LlamaForCausalLM for `checkpoint`, in `state_dict()` order:
//   model.embed_tokens.weight                               [vocab, dim]   token_embedding
//   for i in 0..L-1, prefix model.layers.{i}.:
//     self_attn.q_proj.weight   [dim, dim]      wq, PermuteRotaryRows with n_heads
//     self_attn.k_proj.weight   [kv_dim, dim]   wk, PermuteRotaryRows with n_kv_heads
//     self_attn.v_proj.weight   [kv_dim, dim]   wv
//     self_attn.o_proj.weight   [dim, dim]      wo
//     mlp.gate_proj.weight      [hidden, dim]   w1
//     mlp.up_proj.weight        [hidden, dim]   w3
//     mlp.down_proj.weight      [dim, hidden]   w2
//     input_layernorm.weight    [dim]           rms_att
//     post_attention_layernorm.weight [dim]     rms_ffn
//   model.norm.weight                                       [dim]          rms_final
//   lm_head.weight [vocab, dim] (wcls) only when the classifier is not shared; a shared one is
//   expressed by "tie_word_embeddings": true in config.json instead, as HF and vLLM expect.
// Values are stored as `dtype`: F32 (bit-exact copies) or BF16 (round to nearest even).
// Errors: InvalidArgument for another dtype, or as ValidateLlama2cCheckpoint.
absl::StatusOr<std::vector<OwnedTensor>> ConvertToHf(const Llama2cCheckpoint& checkpoint,
                                                     DType dtype);

// The Hugging Face config.json (LlamaConfig) for `config` with weights stored as `dtype`
// (torch_dtype "float32" or "bfloat16"): architectures ["LlamaForCausalLM"], model_type "llama",
// sizes from the header, rms_norm_eps 1e-5 and rope_theta 10000.0 (llama2.c's constants),
// hidden_act "silu", tie_word_embeddings = shared_classifier, bos_token_id 1, eos_token_id 2
// (llama2.c's sentencepiece ids). Pretty-printed with a trailing newline.
// Errors: InvalidArgument for a dtype other than F32 or BF16.
absl::StatusOr<std::string> HfConfigJson(const Llama2cConfig& config, DType dtype);

// Converts the llama2.c checkpoint at `in_path` into a Hugging Face model directory: creates
// `out_dir` (and parents) if needed and writes out_dir/model.safetensors (ConvertToHf's tensors,
// metadata {"format": "pt"}, via safetensors::WriteFile) and out_dir/config.json (HfConfigJson).
// Errors: InvalidArgument for a dtype other than F32 or BF16 (before touching any file); as
// ReadLlama2c; the errno text of a failed mkdir or write naming the path; as
// safetensors::WriteFile.
absl::Status ConvertLlama2c(const std::string& in_path, const std::string& out_dir, DType dtype);

}  // namespace weightbus::tools

// SPDX-License-Identifier: Apache-2.0
#include "weightbus/llama_forward.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "weightbus/bf16.h"

namespace weightbus::tools {

absl::Span<const float> Logits::Row(int64_t t) const {
  return absl::MakeConstSpan(values).subspan(static_cast<size_t>(t * vocab_size),
                                             static_cast<size_t>(vocab_size));
}

int64_t Logits::Argmax(int64_t t) const {
  absl::Span<const float> row = Row(t);
  int64_t best = 0;
  for (int64_t v = 1; v < vocab_size; ++v) {
    if (row[v] > row[best]) best = v;
  }
  return best;
}

// ---------------------------------------------------------------------------------------------
// Reference: llama2.c run.c, ported function by function (rmsnorm, softmax, matmul, forward).

namespace {

void RunRmsnorm(float* o, const float* x, const float* weight, int size) {
  float ss = 0.0f;
  for (int j = 0; j < size; j++) ss += x[j] * x[j];
  ss /= size;
  ss += 1e-5f;
  ss = 1.0f / std::sqrt(ss);
  for (int j = 0; j < size; j++) o[j] = weight[j] * (ss * x[j]);
}

void RunSoftmax(float* x, int size) {
  float max_val = x[0];
  for (int i = 1; i < size; i++) max_val = std::max(max_val, x[i]);
  float sum = 0.0f;
  for (int i = 0; i < size; i++) {
    x[i] = std::exp(x[i] - max_val);
    sum += x[i];
  }
  for (int i = 0; i < size; i++) x[i] /= sum;
}

// W (d,n) @ x (n,) -> xout (d,)
void RunMatmul(float* xout, const float* x, const float* w, int n, int d) {
  for (int i = 0; i < d; i++) {
    float val = 0.0f;
    for (int j = 0; j < n; j++) val += w[static_cast<size_t>(i) * n + j] * x[j];
    xout[i] = val;
  }
}

absl::Status CheckTokens(absl::Span<const int32_t> tokens, int64_t vocab, int64_t max_len,
                         std::string_view max_len_name) {
  if (static_cast<int64_t>(tokens.size()) > max_len) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d tokens exceed %s = %d", tokens.size(), max_len_name, max_len));
  }
  for (size_t t = 0; t < tokens.size(); ++t) {
    if (tokens[t] < 0 || tokens[t] >= vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "token %d at position %d is outside the vocabulary [0, %d)", tokens[t], t, vocab));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Logits> Llama2cForward(const Llama2cCheckpoint& ckpt,
                                      absl::Span<const int32_t> tokens) {
  if (absl::Status s = ValidateLlama2cCheckpoint(ckpt); !s.ok()) return s;
  const Llama2cConfig& p = ckpt.config;
  const int dim = p.dim;
  const int kv_dim = p.kv_dim();
  const int kv_mul = p.n_heads / p.n_kv_heads;
  const int hidden_dim = p.hidden_dim;
  const int head_size = p.head_size();
  const int n_layers = p.n_layers;
  const int vocab = p.vocab_size;
  const size_t L = static_cast<size_t>(n_layers);
  if (absl::Status s = CheckTokens(tokens, vocab, p.max_seq_len, "max_seq_len"); !s.ok()) {
    return s;
  }

  const int seq_len = static_cast<int>(tokens.size());  // KV cache rows (run.c: p->seq_len)
  // RunState buffers.
  std::vector<float> x(dim), xb(dim), xb2(dim), hb(hidden_dim), hb2(hidden_dim), q(dim),
      att(static_cast<size_t>(p.n_heads) * std::max(seq_len, 1)), logits(vocab);
  std::vector<float> key_cache(L * seq_len * kv_dim), value_cache(L * seq_len * kv_dim);

  Logits out;
  out.num_tokens = seq_len;
  out.vocab_size = vocab;
  out.values.resize(static_cast<size_t>(seq_len) * vocab);

  for (int pos = 0; pos < seq_len; ++pos) {
    const int token = tokens[pos];
    // forward(transformer, token, pos):
    std::memcpy(x.data(), ckpt.token_embedding.data() + static_cast<size_t>(token) * dim,
                dim * sizeof(float));
    for (size_t l = 0; l < L; l++) {
      RunRmsnorm(xb.data(), x.data(), ckpt.rms_att.data() + l * dim, dim);
      const size_t loff = l * seq_len * kv_dim;
      float* k = key_cache.data() + loff + static_cast<size_t>(pos) * kv_dim;
      float* v = value_cache.data() + loff + static_cast<size_t>(pos) * kv_dim;
      RunMatmul(q.data(), xb.data(), ckpt.wq.data() + l * dim * dim, dim, dim);
      RunMatmul(k, xb.data(), ckpt.wk.data() + l * dim * kv_dim, dim, kv_dim);
      RunMatmul(v, xb.data(), ckpt.wv.data() + l * dim * kv_dim, dim, kv_dim);

      // RoPE relative positional encoding: complex-valued rotate q and k in each head.
      for (int i = 0; i < dim; i += 2) {
        const int head_dim = i % head_size;
        const float freq = 1.0f / std::pow(10000.0f, head_dim / static_cast<float>(head_size));
        const float val = pos * freq;
        const float fcr = std::cos(val);
        const float fci = std::sin(val);
        const int rotn = i < kv_dim ? 2 : 1;  // 2 = q and k, 1 = q only
        for (int r = 0; r < rotn; r++) {
          float* vec = r == 0 ? q.data() : k;
          const float v0 = vec[i];
          const float v1 = vec[i + 1];
          vec[i] = v0 * fcr - v1 * fci;
          vec[i + 1] = v0 * fci + v1 * fcr;
        }
      }

      // Multihead attention over all heads.
      for (int h = 0; h < p.n_heads; h++) {
        const float* qh = q.data() + h * head_size;
        float* atth = att.data() + static_cast<size_t>(h) * seq_len;
        for (int t = 0; t <= pos; t++) {
          const float* kt =
              key_cache.data() + loff + static_cast<size_t>(t) * kv_dim + (h / kv_mul) * head_size;
          float score = 0.0f;
          for (int i = 0; i < head_size; i++) score += qh[i] * kt[i];
          score /= std::sqrt(static_cast<float>(head_size));
          atth[t] = score;
        }
        RunSoftmax(atth, pos + 1);
        float* xbh = xb.data() + h * head_size;
        std::memset(xbh, 0, head_size * sizeof(float));
        for (int t = 0; t <= pos; t++) {
          const float* vt = value_cache.data() + loff + static_cast<size_t>(t) * kv_dim +
                            (h / kv_mul) * head_size;
          const float a = atth[t];
          for (int i = 0; i < head_size; i++) xbh[i] += a * vt[i];
        }
      }

      RunMatmul(xb2.data(), xb.data(), ckpt.wo.data() + l * dim * dim, dim, dim);
      for (int i = 0; i < dim; i++) x[i] += xb2[i];

      RunRmsnorm(xb.data(), x.data(), ckpt.rms_ffn.data() + l * dim, dim);
      RunMatmul(hb.data(), xb.data(), ckpt.w1.data() + l * dim * hidden_dim, dim, hidden_dim);
      RunMatmul(hb2.data(), xb.data(), ckpt.w3.data() + l * dim * hidden_dim, dim, hidden_dim);
      // SwiGLU: silu(x) = x * sigmoid(x), times w3(x).
      for (int i = 0; i < hidden_dim; i++) {
        float val = hb[i];
        val *= (1.0f / (1.0f + std::exp(-val)));
        val *= hb2[i];
        hb[i] = val;
      }
      RunMatmul(xb.data(), hb.data(), ckpt.w2.data() + l * dim * hidden_dim, hidden_dim, dim);
      for (int i = 0; i < dim; i++) x[i] += xb[i];
    }
    RunRmsnorm(x.data(), x.data(), ckpt.rms_final.data(), dim);
    RunMatmul(logits.data(), x.data(), ckpt.classifier().data(), dim, vocab);
    std::copy(logits.begin(), logits.end(), out.values.begin() + static_cast<size_t>(pos) * vocab);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Hugging Face layout: modeling_llama.py, over whole [T, features] activations.

namespace {

// A row-major float matrix.
struct Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float> data;

  Matrix() = default;
  Matrix(int64_t r, int64_t c) : rows(r), cols(c), data(static_cast<size_t>(r * c), 0.0f) {}
  float* row(int64_t r) { return data.data() + r * cols; }
  const float* row(int64_t r) const { return data.data() + r * cols; }
};

// nn.Linear without bias: y = x @ weight^T, weight [out, in].
Matrix Linear(const Matrix& x, const Matrix& weight) {
  Matrix y(x.rows, weight.rows);
  for (int64_t t = 0; t < x.rows; ++t) {
    const float* xt = x.row(t);
    float* yt = y.row(t);
    for (int64_t o = 0; o < weight.rows; ++o) {
      const float* wo = weight.row(o);
      double acc = 0.0;
      for (int64_t i = 0; i < x.cols; ++i) acc += static_cast<double>(wo[i]) * xt[i];
      yt[o] = static_cast<float>(acc);
    }
  }
  return y;
}

// LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)), per row.
Matrix RmsNorm(const Matrix& x, const Matrix& weight, double eps) {
  Matrix y(x.rows, x.cols);
  for (int64_t t = 0; t < x.rows; ++t) {
    double sum_sq = 0.0;
    for (int64_t i = 0; i < x.cols; ++i) sum_sq += static_cast<double>(x.row(t)[i]) * x.row(t)[i];
    const double inv_rms = 1.0 / std::sqrt(sum_sq / static_cast<double>(x.cols) + eps);
    for (int64_t i = 0; i < x.cols; ++i) {
      y.row(t)[i] = static_cast<float>(weight.data[i] * (x.row(t)[i] * inv_rms));
    }
  }
  return y;
}

void AddInPlace(Matrix& x, const Matrix& delta) {
  for (size_t i = 0; i < x.data.size(); ++i) x.data[i] += delta.data[i];
}

// LlamaRotaryEmbedding + apply_rotary_pos_emb on `x` [T, n_heads * head_dim], position = row.
void ApplyRotary(Matrix& x, int64_t n_heads, int64_t head_dim, double theta) {
  const int64_t half = head_dim / 2;
  std::vector<double> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[i] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / head_dim);
  }
  std::vector<double> cos(head_dim), sin(head_dim), rotated(head_dim);
  for (int64_t pos = 0; pos < x.rows; ++pos) {
    // emb = cat(freqs, freqs)
    for (int64_t i = 0; i < head_dim; ++i) {
      const double angle = static_cast<double>(pos) * inv_freq[i % half];
      cos[i] = std::cos(angle);
      sin[i] = std::sin(angle);
    }
    for (int64_t h = 0; h < n_heads; ++h) {
      float* head = x.row(pos) + h * head_dim;
      // rotate_half(x) = cat(-x[half:], x[:half])
      for (int64_t i = 0; i < half; ++i) {
        rotated[i] = -static_cast<double>(head[half + i]);
        rotated[half + i] = head[i];
      }
      for (int64_t i = 0; i < head_dim; ++i) {
        head[i] = static_cast<float>(head[i] * cos[i] + rotated[i] * sin[i]);
      }
    }
  }
}

// eager_attention_forward with a causal mask and repeat_kv: q [T, H*D], k/v [T, KV*D].
Matrix CausalAttention(const Matrix& q, const Matrix& k, const Matrix& v, int64_t n_heads,
                       int64_t n_kv_heads, int64_t head_dim) {
  const int64_t n_rep = n_heads / n_kv_heads;
  const double scaling = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const int64_t T = q.rows;
  Matrix out(T, n_heads * head_dim);
  std::vector<double> probs(static_cast<size_t>(T));
  for (int64_t h = 0; h < n_heads; ++h) {
    const int64_t kvh = h / n_rep;  // repeat_kv: kv head j serves query heads j*n_rep..+n_rep-1
    for (int64_t t = 0; t < T; ++t) {
      const float* qt = q.row(t) + h * head_dim;
      double max_score = -INFINITY;
      for (int64_t s = 0; s <= t; ++s) {  // positions s > t are masked (-inf)
        const float* ks = k.row(s) + kvh * head_dim;
        double dot = 0.0;
        for (int64_t i = 0; i < head_dim; ++i) dot += static_cast<double>(qt[i]) * ks[i];
        probs[s] = dot * scaling;
        max_score = std::max(max_score, probs[s]);
      }
      double denom = 0.0;
      for (int64_t s = 0; s <= t; ++s) {
        probs[s] = std::exp(probs[s] - max_score);
        denom += probs[s];
      }
      float* ot = out.row(t) + h * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) {
        double acc = 0.0;
        for (int64_t s = 0; s <= t; ++s) acc += probs[s] * v.row(s)[kvh * head_dim + i];
        ot[i] = static_cast<float>(acc / denom);
      }
    }
  }
  return out;
}

// Looks tensors up by name and checks their shapes.
class TensorTable {
 public:
  explicit TensorTable(absl::Span<const TensorView> tensors) {
    for (const TensorView& t : tensors) by_name_.emplace(t.name, &t);
  }

  absl::StatusOr<Matrix> Get(const std::string& name, std::vector<int64_t> shape) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) {
      return absl::NotFoundError(absl::StrFormat("Llama forward: tensor %s is missing", name));
    }
    const TensorView& t = *it->second;
    if (t.shape != shape) {
      return absl::InvalidArgumentError(
          absl::StrFormat("Llama forward: tensor %s has shape %s, expected %s", name,
                          ShapeString(t.shape), ShapeString(shape)));
    }
    absl::StatusOr<std::vector<float>> values = TensorToFloats(t);
    if (!values.ok()) return values.status();
    Matrix m;
    m.rows = shape[0];
    m.cols = shape.size() > 1 ? shape[1] : 1;
    m.data = std::move(*values);
    return m;
  }

 private:
  std::map<std::string, const TensorView*> by_name_;
};

#define WBT_ASSIGN_OR_RETURN(lhs, expr)                       \
  auto WBT_CONCAT(wbt_or_, __LINE__) = (expr);                \
  if (!WBT_CONCAT(wbt_or_, __LINE__).ok())                    \
    return std::move(WBT_CONCAT(wbt_or_, __LINE__)).status(); \
  lhs = std::move(*WBT_CONCAT(wbt_or_, __LINE__))
#define WBT_CONCAT(a, b) WBT_CONCAT_INNER(a, b)
#define WBT_CONCAT_INNER(a, b) a##b

absl::StatusOr<int64_t> GetInt(const nlohmann::json& j, const char* key, std::string_view source,
                               std::optional<int64_t> fallback = std::nullopt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (fallback.has_value()) return *fallback;
    return absl::InvalidArgumentError(absl::StrFormat("%s: missing \"%s\"", source, key));
  }
  if (!it->is_number_integer() || it->get<int64_t>() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: \"%s\" must be a positive integer, got %s", source, key, it->dump()));
  }
  return it->get<int64_t>();
}

absl::StatusOr<double> GetNumber(const nlohmann::json& j, const char* key, std::string_view source,
                                 double fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number() || !(it->get<double>() > 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: \"%s\" must be a positive number, got %s", source, key, it->dump()));
  }
  return it->get<double>();
}

}  // namespace

absl::StatusOr<HfLlamaConfig> ParseHfLlamaConfig(std::string_view json, std::string_view source) {
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: not a JSON object (config.json expected)", source));
  }
  if (auto it = j.find("model_type"); it != j.end() && *it != "llama") {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: model_type is %s, expected \"llama\"", source, it->dump()));
  }
  if (auto it = j.find("hidden_act"); it != j.end() && *it != "silu") {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: hidden_act is %s, only \"silu\" is supported", source, it->dump()));
  }
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: rope_scaling %s is not supported", source, it->dump()));
  }
  HfLlamaConfig c;
  WBT_ASSIGN_OR_RETURN(c.hidden_size, GetInt(j, "hidden_size", source));
  WBT_ASSIGN_OR_RETURN(c.intermediate_size, GetInt(j, "intermediate_size", source));
  WBT_ASSIGN_OR_RETURN(c.num_hidden_layers, GetInt(j, "num_hidden_layers", source));
  WBT_ASSIGN_OR_RETURN(c.num_attention_heads, GetInt(j, "num_attention_heads", source));
  WBT_ASSIGN_OR_RETURN(c.num_key_value_heads,
                       GetInt(j, "num_key_value_heads", source, c.num_attention_heads));
  WBT_ASSIGN_OR_RETURN(c.vocab_size, GetInt(j, "vocab_size", source));
  WBT_ASSIGN_OR_RETURN(c.max_position_embeddings, GetInt(j, "max_position_embeddings", source));
  WBT_ASSIGN_OR_RETURN(c.rms_norm_eps, GetNumber(j, "rms_norm_eps", source, 1e-6));
  WBT_ASSIGN_OR_RETURN(c.rope_theta, GetNumber(j, "rope_theta", source, 10000.0));
  if (auto it = j.find("tie_word_embeddings"); it != j.end()) {
    if (!it->is_boolean()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: \"tie_word_embeddings\" must be a boolean, got %s", source, it->dump()));
    }
    c.tie_word_embeddings = it->get<bool>();
  }
  if (c.hidden_size % c.num_attention_heads != 0 ||
      c.num_attention_heads % c.num_key_value_heads != 0 || c.head_dim() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: hidden_size %d, num_attention_heads %d and num_key_value_heads %d do not divide "
        "into even-sized heads",
        source, c.hidden_size, c.num_attention_heads, c.num_key_value_heads));
  }
  if (auto it = j.find("head_dim"); it != j.end() && !it->is_null() && *it != c.head_dim()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: head_dim %s differs from hidden_size / num_attention_heads = %d (not supported)",
        source, it->dump(), c.head_dim()));
  }
  return c;
}

absl::StatusOr<std::vector<float>> TensorToFloats(const TensorView& t) {
  absl::StatusOr<int64_t> count = NumElements(t.shape);
  if (!count.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", t.name, ": ", std::string(count.status().message())));
  }
  if (t.device.type != DeviceType::kCpu) {
    return absl::InvalidArgumentError(absl::StrFormat("tensor %s is not on the CPU", t.name));
  }
  if (!IsContiguous(t.shape, t.strides)) {
    return absl::InvalidArgumentError(absl::StrFormat("tensor %s is not contiguous", t.name));
  }
  if (t.data == nullptr && *count > 0) {
    return absl::InvalidArgumentError(absl::StrFormat("tensor %s has no data", t.name));
  }
  std::vector<float> out(static_cast<size_t>(*count));
  const auto* bytes = static_cast<const unsigned char*>(t.data);
  if (t.dtype == DType::kF32) {
    for (size_t i = 0; i < out.size(); ++i) {
      const unsigned char* b = bytes + 4 * i;
      out[i] = std::bit_cast<float>(static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 |
                                    static_cast<uint32_t>(b[2]) << 16 |
                                    static_cast<uint32_t>(b[3]) << 24);
    }
  } else if (t.dtype == DType::kBF16) {
    for (size_t i = 0; i < out.size(); ++i) {
      const unsigned char* b = bytes + 2 * i;
      out[i] = Bf16ToFloat(static_cast<uint16_t>(b[0] | b[1] << 8));
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor %s has dtype %s; only F32 and BF16 are supported", t.name,
                        std::string(DTypeName(t.dtype))));
  }
  return out;
}

absl::StatusOr<Logits> HfLlamaForward(const HfLlamaConfig& config,
                                      absl::Span<const TensorView> tensors,
                                      absl::Span<const int32_t> tokens) {
  const int64_t D = config.hidden_size, F = config.intermediate_size,
                H = config.num_attention_heads, KV = config.num_key_value_heads,
                V = config.vocab_size;
  if (D <= 0 || F <= 0 || H <= 0 || KV <= 0 || V <= 0 || config.num_hidden_layers < 0 ||
      D % H != 0 || H % KV != 0 || (D / H) % 2 != 0) {
    return absl::InvalidArgumentError("Llama forward: invalid config");
  }
  const int64_t head_dim = config.head_dim();
  if (absl::Status s =
          CheckTokens(tokens, V, config.max_position_embeddings, "max_position_embeddings");
      !s.ok()) {
    return s;
  }
  const TensorTable table(tensors);
  const int64_t T = static_cast<int64_t>(tokens.size());

  WBT_ASSIGN_OR_RETURN(const Matrix embed, table.Get("model.embed_tokens.weight", {V, D}));
  Matrix hidden(T, D);
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(embed.row(tokens[t]), D, hidden.row(t));
  }

  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    WBT_ASSIGN_OR_RETURN(const Matrix ln1, table.Get(p + "input_layernorm.weight", {D}));
    WBT_ASSIGN_OR_RETURN(const Matrix wq,
                         table.Get(p + "self_attn.q_proj.weight", {H * head_dim, D}));
    WBT_ASSIGN_OR_RETURN(const Matrix wk,
                         table.Get(p + "self_attn.k_proj.weight", {KV * head_dim, D}));
    WBT_ASSIGN_OR_RETURN(const Matrix wv,
                         table.Get(p + "self_attn.v_proj.weight", {KV * head_dim, D}));
    WBT_ASSIGN_OR_RETURN(const Matrix wo,
                         table.Get(p + "self_attn.o_proj.weight", {D, H * head_dim}));
    WBT_ASSIGN_OR_RETURN(const Matrix ln2, table.Get(p + "post_attention_layernorm.weight", {D}));
    WBT_ASSIGN_OR_RETURN(const Matrix gate, table.Get(p + "mlp.gate_proj.weight", {F, D}));
    WBT_ASSIGN_OR_RETURN(const Matrix up, table.Get(p + "mlp.up_proj.weight", {F, D}));
    WBT_ASSIGN_OR_RETURN(const Matrix down, table.Get(p + "mlp.down_proj.weight", {D, F}));

    // Self-attention block.
    const Matrix normed = RmsNorm(hidden, ln1, config.rms_norm_eps);
    Matrix q = Linear(normed, wq);
    Matrix k = Linear(normed, wk);
    const Matrix v = Linear(normed, wv);
    ApplyRotary(q, H, head_dim, config.rope_theta);
    ApplyRotary(k, KV, head_dim, config.rope_theta);
    AddInPlace(hidden, Linear(CausalAttention(q, k, v, H, KV, head_dim), wo));

    // MLP block: down(act(gate(x)) * up(x)), act = SiLU.
    const Matrix normed2 = RmsNorm(hidden, ln2, config.rms_norm_eps);
    Matrix act = Linear(normed2, gate);
    const Matrix up_out = Linear(normed2, up);
    for (size_t i = 0; i < act.data.size(); ++i) {
      const double g = act.data[i];
      act.data[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up_out.data[i]);
    }
    AddInPlace(hidden, Linear(act, down));
  }

  WBT_ASSIGN_OR_RETURN(const Matrix norm, table.Get("model.norm.weight", {D}));
  const Matrix final_hidden = RmsNorm(hidden, norm, config.rms_norm_eps);
  Matrix logits;
  if (config.tie_word_embeddings) {
    logits = Linear(final_hidden, embed);
  } else {
    WBT_ASSIGN_OR_RETURN(const Matrix lm_head, table.Get("lm_head.weight", {V, D}));
    logits = Linear(final_hidden, lm_head);
  }
  Logits out;
  out.num_tokens = T;
  out.vocab_size = V;
  out.values = std::move(logits.data);
  return out;
}

double LogitsComparison::argmax_agreement() const {
  return positions == 0 ? 1.0 : static_cast<double>(argmax_matches) / positions;
}

std::string LogitsComparison::ToString() const {
  return absl::StrFormat("T=%d max_abs_diff=%.3g mean_abs_diff=%.3g max_rel_diff=%.3g argmax %d/%d",
                         positions, max_abs_diff, mean_abs_diff, max_rel_diff, argmax_matches,
                         positions);
}

absl::StatusOr<LogitsComparison> CompareLogits(const Logits& a, const Logits& b) {
  if (a.num_tokens != b.num_tokens || a.vocab_size != b.vocab_size ||
      a.values.size() != b.values.size() ||
      a.values.size() != static_cast<size_t>(a.num_tokens * a.vocab_size)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cannot compare logits of shape [%d, %d] (%d values) with [%d, %d] (%d values)",
        a.num_tokens, a.vocab_size, a.values.size(), b.num_tokens, b.vocab_size, b.values.size()));
  }
  LogitsComparison c;
  c.positions = a.num_tokens;
  double sum_abs_diff = 0;
  for (size_t i = 0; i < a.values.size(); ++i) {
    const double x = a.values[i], y = b.values[i];
    const double diff = std::abs(x - y);
    if (std::isnan(diff)) {  // any NaN makes the arrays incomparable: report it as infinite
      c.max_abs_diff = c.max_rel_diff = sum_abs_diff = INFINITY;
      continue;
    }
    sum_abs_diff += diff;
    c.max_abs_diff = std::max(c.max_abs_diff, diff);
    if (diff > 0)
      c.max_rel_diff = std::max(c.max_rel_diff, diff / std::max(std::abs(x), std::abs(y)));
  }
  if (!a.values.empty()) c.mean_abs_diff = sum_abs_diff / static_cast<double>(a.values.size());
  for (int64_t t = 0; t < a.num_tokens && a.vocab_size > 0; ++t) {
    if (a.Argmax(t) == b.Argmax(t)) ++c.argmax_matches;
  }
  return c;
}

}  // namespace weightbus::tools

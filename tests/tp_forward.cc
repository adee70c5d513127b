// SPDX-License-Identifier: Apache-2.0
#include "tp_forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace weightbus::testing {
namespace {

std::string Layer(int64_t l) { return absl::StrCat("model.layers.", l, "."); }

// The sum of term(i) for i in [0, n), in float, in `order`.
template <typename F>
float Sum(int64_t n, SumOrder order, F term) {
  float s = 0.0f;
  for (int64_t k = 0; k < n; ++k) s += term(order == SumOrder::kForward ? k : n - 1 - k);
  return s;
}

float Dot(const float* a, const float* b, int64_t n, SumOrder order) {
  return Sum(n, order, [&](int64_t i) { return a[i] * b[i]; });
}

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// out[i] = parts[0][i] + parts[1][i] + ... (the all-reduce over the TP ranks, in `order`).
std::vector<float> AllReduce(const std::vector<std::vector<float>>& parts, SumOrder order) {
  std::vector<float> out(parts[0].size());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = Sum(static_cast<int64_t>(parts.size()), order, [&](int64_t r) { return parts[r][i]; });
  }
  return out;
}

// y[t] = RMSNorm(x[t]) * w for x [T, hidden].
std::vector<float> RmsNorm(const std::vector<float>& x, const float* w, int64_t hidden, float eps,
                           SumOrder order) {
  std::vector<float> y(x.size());
  for (size_t t = 0; t < x.size() / hidden; ++t) {
    const float* row = x.data() + t * hidden;
    const float ms = Sum(hidden, order, [&](int64_t i) { return row[i] * row[i]; }) / hidden;
    const float inv = 1.0f / std::sqrt(ms + eps);
    for (int64_t i = 0; i < hidden; ++i) y[t * hidden + i] = row[i] * inv * w[i];
  }
  return y;
}

// y [T, rows] = x [T, cols] @ w^T for w [rows, cols] (+ bias [rows] if given).
std::vector<float> Linear(const std::vector<float>& x, const float* w, const float* bias,
                          int64_t rows, int64_t cols, SumOrder order) {
  const size_t tokens = x.size() / cols;
  std::vector<float> y(tokens * rows);
  for (size_t t = 0; t < tokens; ++t) {
    for (int64_t o = 0; o < rows; ++o) {
      y[t * rows + o] =
          Dot(w + o * cols, x.data() + t * cols, cols, order) + (bias != nullptr ? bias[o] : 0.0f);
    }
  }
  return y;
}

// Hugging Face rotary embedding (rotate_half) on `heads` heads of `dim` in x [T, heads * dim].
void Rope(std::vector<float>& x, int64_t heads, int64_t dim, double theta) {
  const size_t tokens = x.size() / (heads * dim);
  for (size_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x.data() + (t * heads + h) * dim;
      for (int64_t i = 0; i < dim / 2; ++i) {
        const double angle = static_cast<double>(t) / std::pow(theta, 2.0 * i / dim);
        const float c = static_cast<float>(std::cos(angle)),
                    s = static_cast<float>(std::sin(angle));
        const float x1 = v[i], x2 = v[i + dim / 2];
        v[i] = x1 * c - x2 * s;
        v[i + dim / 2] = x2 * c + x1 * s;
      }
    }
  }
}

// What TP rank r of m holds of a model of `shape` (vLLM's partitioning, written out here
// independently of the library's planner).
struct RankGeometry {
  int64_t q_heads = 0;  // query heads of this rank, heads q_first .. q_first + q_heads - 1
  int64_t q_first = 0;
  int64_t kv_heads = 0;  // KV heads of this rank (one, replicated, when m > kv_heads)
  int64_t kv_first = 0;
  int64_t vocab = 0;  // vocabulary rows, from vocab_first
  int64_t vocab_first = 0;
  int64_t inter = 0;             // dense intermediate columns
  int64_t expert_inter = 0;      // intermediate of each expert it computes
  std::vector<int64_t> experts;  // the experts it computes, global numbers
};

absl::StatusOr<RankGeometry> Geometry(const LlamaShape& s, int r, int m, ExpertSplit split) {
  auto need = [&](bool ok, std::string_view what, int64_t n) -> absl::Status {
    if (ok) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrFormat("TP degree %d does not fit %s %d", m, what, n));
  };
  RankGeometry g;
  if (absl::Status st = need(s.heads % m == 0, "the query heads", s.heads); !st.ok()) return st;
  if (absl::Status st = need(m <= s.kv_heads ? s.kv_heads % m == 0 : m % s.kv_heads == 0,
                             "the KV heads", s.kv_heads);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = need(s.vocab % m == 0, "the vocabulary", s.vocab); !st.ok()) return st;
  if (absl::Status st = need(s.intermediate % m == 0, "the intermediate size", s.intermediate);
      !st.ok()) {
    return st;
  }
  g.q_heads = s.heads / m;
  g.q_first = r * g.q_heads;
  if (m <= s.kv_heads) {
    g.kv_heads = s.kv_heads / m;
    g.kv_first = r * g.kv_heads;
  } else {
    g.kv_heads = 1;
    g.kv_first = r / (m / s.kv_heads);
  }
  g.vocab = s.vocab / m;
  g.vocab_first = r * g.vocab;
  g.inter = s.intermediate / m;
  if (s.experts > 0) {
    if (split == ExpertSplit::kExpertParallel) {
      // determine_expert_map, linear: the first E % m ranks take one expert more.
      const int64_t base = s.experts / m, extra = s.experts % m;
      const int64_t first = r * base + std::min<int64_t>(r, extra);
      for (int64_t e = 0; e < base + (r < extra ? 1 : 0); ++e) g.experts.push_back(first + e);
      g.expert_inter = s.expert_intermediate;
    } else {
      if (absl::Status st = need(s.expert_intermediate % m == 0, "the experts' intermediate size",
                                 s.expert_intermediate);
          !st.ok()) {
        return st;
      }
      g.experts.resize(s.experts);
      std::iota(g.experts.begin(), g.experts.end(), 0);
      g.expert_inter = s.expert_intermediate / m;
    }
  }
  return g;
}

// One rank's tensors by name.
class RankTensors {
 public:
  RankTensors(const std::vector<TensorView>& views, int rank) : rank_(rank) {
    for (const TensorView& v : views) by_name_[v.name] = &v;
  }

  bool Has(const std::string& name) const { return by_name_.contains(name); }

  // The data of `name`, which must hold `elements` F32 values, contiguous.
  absl::StatusOr<const float*> Get(const std::string& name, int64_t elements) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) {
      return absl::NotFoundError(absl::StrFormat("TP rank %d has no tensor \"%s\"", rank_, name));
    }
    const TensorView& v = *it->second;
    int64_t n = 1;
    for (int64_t d : v.shape) n *= d;
    if (v.dtype != DType::kF32 || !v.strides.empty() || n != elements) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "TP rank %d: tensor \"%s\" is %s with %d elements%s; its slice is F32 with %d", rank_,
          name, DTypeName(v.dtype), n, v.strides.empty() ? "" : " (strided)", elements));
    }
    return reinterpret_cast<const float*>(v.data);
  }

  // Two or three parts of one fused tensor: under `fused` one after another (each `sizes[i]`
  // elements, per `outer` block of a leading dimension), else under each of `parts`.
  // Returns, per part, its base and the stride between its `outer` blocks.
  struct Piece {
    const float* data;
    int64_t stride;  // elements between consecutive outer blocks
  };
  absl::StatusOr<std::vector<Piece>> GetFused(const std::string& fused,
                                              const std::vector<std::string>& parts,
                                              const std::vector<int64_t>& sizes,
                                              int64_t outer = 1) const {
    std::vector<Piece> out;
    if (Has(fused) || !Has(parts[0])) {
      const int64_t block = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
      auto base = Get(fused, block * outer);
      if (!base.ok()) return base.status();
      int64_t at = 0;
      for (int64_t size : sizes) {
        out.push_back({*base + at, block});
        at += size;
      }
      return out;
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      auto base = Get(parts[i], sizes[i] * outer);
      if (!base.ok()) return base.status();
      out.push_back({*base, sizes[i]});
    }
    return out;
  }

 private:
  std::map<std::string, const TensorView*> by_name_;
  int rank_;
};

}  // namespace

std::vector<float> Mlp(const float* gate, const float* up, const float* down, const float* x,
                       int64_t hidden, int64_t inter, SumOrder order) {
  std::vector<float> h(inter), y(hidden);
  for (int64_t i = 0; i < inter; ++i) {
    h[i] = Silu(Dot(gate + i * hidden, x, hidden, order)) * Dot(up + i * hidden, x, hidden, order);
  }
  for (int64_t o = 0; o < hidden; ++o) y[o] = Dot(down + o * inter, h.data(), inter, order);
  return y;
}

float MaxAbsDiff(absl::Span<const float> a, absl::Span<const float> b) {
  if (a.size() != b.size()) return std::numeric_limits<float>::infinity();
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const float d = std::abs(a[i] - b[i]);
    if (std::isnan(d)) return std::numeric_limits<float>::infinity();
    m = std::max(m, d);
  }
  return m;
}

std::vector<OwnedTensor> RandomLlama(const LlamaShape& s, uint64_t seed) {
  std::vector<OwnedTensor> out;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float center,
                 float half_width) {
    OwnedTensor t;
    t.name = name;
    t.dtype = DType::kF32;
    t.shape = std::move(shape);
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    std::mt19937_64 rng(seed * 1000003 + out.size());
    std::uniform_real_distribution<float> dist(center - half_width, center + half_width);
    std::vector<float> values(n);
    for (float& v : values) v = dist(rng);
    t.bytes.resize(n * 4);
    std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
    out.push_back(std::move(t));
  };
  // Uniform on [-a, a] with a = sqrt(3 / fan_in): unit variance out of unit variance in.
  auto fan = [](int64_t fan_in) { return std::sqrt(3.0f / static_cast<float>(fan_in)); };
  const int64_t h = s.hidden, d = s.head_dim(), q_rows = s.heads * d, kv_rows = s.kv_heads * d;
  add("model.embed_tokens.weight", {s.vocab, h}, 0, 1);
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = Layer(l);
    add(p + "input_layernorm.weight", {h}, 1, 0.1f);
    add(p + "self_attn.q_proj.weight", {q_rows, h}, 0, fan(h));
    add(p + "self_attn.k_proj.weight", {kv_rows, h}, 0, fan(h));
    add(p + "self_attn.v_proj.weight", {kv_rows, h}, 0, fan(h));
    if (s.qkv_bias) {
      add(p + "self_attn.q_proj.bias", {q_rows}, 0, 0.1f);
      add(p + "self_attn.k_proj.bias", {kv_rows}, 0, 0.1f);
      add(p + "self_attn.v_proj.bias", {kv_rows}, 0, 0.1f);
    }
    add(p + "self_attn.o_proj.weight", {h, q_rows}, 0, fan(q_rows));
    add(p + "post_attention_layernorm.weight", {h}, 1, 0.1f);
    if (s.moe(l)) {
      const int64_t e = s.experts, i = s.expert_intermediate;
      add(p + "mlp.gate.weight", {e, h}, 0, fan(h));
      add(p + "mlp.experts.gate_proj.weight", {e, i, h}, 0, fan(h));
      add(p + "mlp.experts.up_proj.weight", {e, i, h}, 0, fan(h));
      add(p + "mlp.experts.down_proj.weight", {e, h, i}, 0, fan(i));
    } else {
      add(p + "mlp.gate_proj.weight", {s.intermediate, h}, 0, fan(h));
      add(p + "mlp.up_proj.weight", {s.intermediate, h}, 0, fan(h));
      add(p + "mlp.down_proj.weight", {h, s.intermediate}, 0, fan(s.intermediate));
    }
  }
  add("model.norm.weight", {h}, 1, 0.1f);
  if (!s.tied) add("lm_head.weight", {s.vocab, h}, 0, fan(h));
  return out;
}

std::vector<PlacementRule> TpRules(const LlamaShape& s, ExpertSplit split) {
  std::vector<PlacementRule> rules = {
      {"*.self_attn.qkv_proj.weight", Placement::Qkv(s.heads, s.kv_heads, s.head_dim())},
      {"*.self_attn.qkv_proj.bias", Placement::Qkv(s.heads, s.kv_heads, s.head_dim())},
      {"*.self_attn.o_proj.weight", Placement::Shard(1)},
      {"*.mlp.gate_up_proj.weight", Placement::GateUp()},
      {"*.mlp.down_proj.weight", Placement::Shard(1)},
      {"model.embed_tokens.weight", Placement::Shard(0)},
      {"lm_head.weight", Placement::Shard(0)},
  };
  if (split == ExpertSplit::kExpertParallel) {
    rules.push_back({"*.mlp.experts.gate_up_proj.weight",
                     Placement::ExpertsMerged("gate_up_proj", {"gate_proj", "up_proj"})});
    rules.push_back({"*.mlp.experts.down_proj.weight", Placement::Experts()});
  } else {
    Placement w13 = Placement::GateUp();
    w13.dim = 1;  // [E, I, H] sources: each expert's gate block r, then its up block r
    rules.push_back({"*.mlp.experts.gate_up_proj.weight", w13});
    rules.push_back({"*.mlp.experts.down_proj.weight", Placement::Shard(2)});
  }
  return rules;
}

std::vector<std::string> TpDestinations(const LlamaShape& s) {
  std::vector<std::string> names = {"model.embed_tokens.weight"};
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = Layer(l);
    names.push_back(p + "input_layernorm.weight");
    names.push_back(p + "self_attn.qkv_proj.weight");
    if (s.qkv_bias) names.push_back(p + "self_attn.qkv_proj.bias");
    names.push_back(p + "self_attn.o_proj.weight");
    names.push_back(p + "post_attention_layernorm.weight");
    if (s.moe(l)) {
      names.push_back(p + "mlp.gate.weight");
      names.push_back(p + "mlp.experts.gate_up_proj.weight");
      names.push_back(p + "mlp.experts.down_proj.weight");
    } else {
      names.push_back(p + "mlp.gate_up_proj.weight");
      names.push_back(p + "mlp.down_proj.weight");
    }
  }
  names.push_back("model.norm.weight");
  if (!s.tied) names.push_back("lm_head.weight");
  return names;
}

absl::StatusOr<std::vector<float>> TpLogits(const LlamaShape& s,
                                            const std::vector<std::vector<TensorView>>& ranks,
                                            absl::Span<const int32_t> tokens, ExpertSplit split,
                                            SumOrder order) {
  const int m = static_cast<int>(ranks.size());
  const int64_t tn = static_cast<int64_t>(tokens.size()), h = s.hidden, d = s.head_dim();
  std::vector<RankTensors> tensors;
  std::vector<RankGeometry> geo;
  for (int r = 0; r < m; ++r) {
    tensors.emplace_back(ranks[r], r);
    absl::StatusOr<RankGeometry> g = Geometry(s, r, m, split);
    if (!g.ok()) return g.status();
    geo.push_back(*std::move(g));
  }
  for (int32_t token : tokens) {
    if (token < 0 || token >= s.vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("token %d is outside the vocabulary of %d", token, s.vocab));
    }
  }
#define WB_TP_ASSIGN(lhs, expr)                 \
  auto lhs##_or = (expr);                       \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  auto lhs = *std::move(lhs##_or)

  // VocabParallelEmbedding: each rank looks up the tokens in its rows, zeros elsewhere; summed.
  std::vector<std::vector<float>> parts(m, std::vector<float>(tn * h, 0.0f));
  for (int r = 0; r < m; ++r) {
    WB_TP_ASSIGN(embed, tensors[r].Get("model.embed_tokens.weight", geo[r].vocab * h));
    for (int64_t t = 0; t < tn; ++t) {
      const int64_t row = tokens[t] - geo[r].vocab_first;
      if (row < 0 || row >= geo[r].vocab) continue;
      std::memcpy(parts[r].data() + t * h, embed + row * h, h * 4);
    }
  }
  std::vector<float> x = AllReduce(parts, order);

  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = Layer(l);
    // Attention: each rank its heads, o_proj row-parallel; the partial outputs all-reduced.
    for (int r = 0; r < m; ++r) {
      const RankGeometry& g = geo[r];
      const RankTensors& w = tensors[r];
      WB_TP_ASSIGN(norm, w.Get(p + "input_layernorm.weight", h));
      const std::vector<float> xn = RmsNorm(x, norm, h, s.rms_eps, order);
      const int64_t qr = g.q_heads * d, kvr = g.kv_heads * d;
      const std::string qkv = p + "self_attn.qkv_proj.";
      const std::vector<std::string> qkv_parts = {"q_proj.", "k_proj.", "v_proj."};
      auto names = [&](const std::string& suffix) {
        std::vector<std::string> n;
        for (const std::string& part : qkv_parts) n.push_back(p + "self_attn." + part + suffix);
        return n;
      };
      WB_TP_ASSIGN(wqkv, w.GetFused(qkv + "weight", names("weight"), {qr * h, kvr * h, kvr * h}));
      std::vector<RankTensors::Piece> bqkv = {{nullptr, 0}, {nullptr, 0}, {nullptr, 0}};
      if (s.qkv_bias) {
        WB_TP_ASSIGN(b, w.GetFused(qkv + "bias", names("bias"), {qr, kvr, kvr}));
        bqkv = b;
      }
      std::vector<float> q = Linear(xn, wqkv[0].data, bqkv[0].data, qr, h, order);
      std::vector<float> k = Linear(xn, wqkv[1].data, bqkv[1].data, kvr, h, order);
      const std::vector<float> v = Linear(xn, wqkv[2].data, bqkv[2].data, kvr, h, order);
      Rope(q, g.q_heads, d, s.rope_theta);
      Rope(k, g.kv_heads, d, s.rope_theta);
      std::vector<float> att(tn * qr);
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      for (int64_t hq = 0; hq < g.q_heads; ++hq) {
        const int64_t kv = (g.q_first + hq) / (s.heads / s.kv_heads) - g.kv_first;
        if (kv < 0 || kv >= g.kv_heads) {
          return absl::InternalError(absl::StrFormat(
              "query head %d of TP rank %d has no KV head here", g.q_first + hq, r));
        }
        for (int64_t t = 0; t < tn; ++t) {
          const float* qt = q.data() + t * qr + hq * d;
          std::vector<float> score(t + 1);
          for (int64_t j = 0; j <= t; ++j)
            score[j] = Dot(qt, k.data() + j * kvr + kv * d, d, order) * scale;
          const float top = *std::max_element(score.begin(), score.end());
          for (float& e : score) e = std::exp(e - top);
          const float z = Sum(t + 1, order, [&](int64_t j) { return score[j]; });
          for (int64_t i = 0; i < d; ++i) {
            att[t * qr + hq * d + i] =
                Sum(t + 1, order, [&](int64_t j) { return score[j] * v[j * kvr + kv * d + i]; }) /
                z;
          }
        }
      }
      WB_TP_ASSIGN(wo, w.Get(p + "self_attn.o_proj.weight", h * qr));
      parts[r] = Linear(att, wo, nullptr, h, qr, order);
    }
    std::vector<float> attn = AllReduce(parts, order);
    for (size_t i = 0; i < x.size(); ++i) x[i] += attn[i];

    // The MLP (or the experts), column- then row-parallel; all-reduced.
    for (int r = 0; r < m; ++r) {
      const RankGeometry& g = geo[r];
      const RankTensors& w = tensors[r];
      WB_TP_ASSIGN(norm, w.Get(p + "post_attention_layernorm.weight", h));
      const std::vector<float> xn = RmsNorm(x, norm, h, s.rms_eps, order);
      std::vector<float>& out = parts[r];
      std::fill(out.begin(), out.end(), 0.0f);
      if (!s.moe(l)) {
        const int64_t i = g.inter;
        WB_TP_ASSIGN(
            gu, w.GetFused(p + "mlp.gate_up_proj.weight",
                           {p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}, {i * h, i * h}));
        WB_TP_ASSIGN(down, w.Get(p + "mlp.down_proj.weight", h * i));
        for (int64_t t = 0; t < tn; ++t) {
          const std::vector<float> y =
              Mlp(gu[0].data, gu[1].data, down, xn.data() + t * h, h, i, order);
          std::copy(y.begin(), y.end(), out.begin() + t * h);
        }
        continue;
      }
      const int64_t e_here = static_cast<int64_t>(g.experts.size()), i = g.expert_inter;
      WB_TP_ASSIGN(router, w.Get(p + "mlp.gate.weight", s.experts * h));
      const std::string ex = p + "mlp.experts.";
      WB_TP_ASSIGN(
          gu, w.GetFused(ex + "gate_up_proj.weight",
                         {ex + "gate_proj.weight", ex + "up_proj.weight"}, {i * h, i * h}, e_here));
      WB_TP_ASSIGN(down, w.Get(ex + "down_proj.weight", e_here * h * i));
      for (int64_t t = 0; t < tn; ++t) {
        const float* xt = xn.data() + t * h;
        // Mixtral routing: the top-k router logits (ties: the lower expert), softmax over them.
        std::vector<float> logit(s.experts);
        for (int64_t e = 0; e < s.experts; ++e) logit[e] = Dot(router + e * h, xt, h, order);
        std::vector<int64_t> chosen(s.experts);
        std::iota(chosen.begin(), chosen.end(), 0);
        std::stable_sort(chosen.begin(), chosen.end(),
                         [&](int64_t a, int64_t b) { return logit[a] > logit[b]; });
        chosen.resize(s.top_k);
        std::vector<float> weight(s.top_k);
        for (int64_t c = 0; c < s.top_k; ++c)
          weight[c] = std::exp(logit[chosen[c]] - logit[chosen[0]]);
        const float z = Sum(s.top_k, order, [&](int64_t c) { return weight[c]; });
        std::vector<std::vector<float>> ys(s.top_k, std::vector<float>(h, 0.0f));
        for (int64_t c = 0; c < s.top_k; ++c) {
          auto local = std::find(g.experts.begin(), g.experts.end(), chosen[c]);
          if (local == g.experts.end()) continue;  // another rank's expert
          const int64_t li = local - g.experts.begin();
          ys[c] = Mlp(gu[0].data + li * gu[0].stride, gu[1].data + li * gu[1].stride,
                      down + li * h * i, xt, h, i, order);
          for (float& y : ys[c]) y *= weight[c] / z;
        }
        for (int64_t o = 0; o < h; ++o) {
          out[t * h + o] = Sum(s.top_k, order, [&](int64_t c) { return ys[c][o]; });
        }
      }
    }
    std::vector<float> mlp = AllReduce(parts, order);
    for (size_t i = 0; i < x.size(); ++i) x[i] += mlp[i];
  }

  // The final norm, then ParallelLMHead: each rank its vocabulary rows (gathered, not summed).
  std::vector<float> logits(tn * s.vocab);
  for (int r = 0; r < m; ++r) {
    const RankGeometry& g = geo[r];
    WB_TP_ASSIGN(norm, tensors[r].Get("model.norm.weight", h));
    const std::vector<float> xn = RmsNorm(x, norm, h, s.rms_eps, order);
    WB_TP_ASSIGN(
        head, tensors[r].Get(s.tied ? "model.embed_tokens.weight" : "lm_head.weight", g.vocab * h));
    const std::vector<float> y = Linear(xn, head, nullptr, g.vocab, h, order);
    for (int64_t t = 0; t < tn; ++t) {
      std::copy(y.begin() + t * g.vocab, y.begin() + (t + 1) * g.vocab,
                logits.begin() + t * s.vocab + g.vocab_first);
    }
  }
#undef WB_TP_ASSIGN
  return logits;
}

}  // namespace weightbus::testing

// SPDX-License-Identifier: Apache-2.0
// weightbus-tiles-bench: what checksum tiles (docs/FORMAT.md, "Block checksums") cost, to choose
// the default `checksum_block` (BENCHMARKS.md, "Tiles"):
//   - manifest: tiles per model and the manifest's JSON size (bytes, % of the model), and the CPU
//     time to parse it, for Qwen2.5-0.5B (the fixture's shapes), Llama-2-7B, Llama-3-70B and
//     Qwen3-30B-A3B (per-expert tensors) at several settings, next to the 1-D blocks of format 1;
//   - hashing: CPU time per byte of the publisher's checksums (the whole XXH3-64 plus tiles)
//     over one transformer layer of each model's shapes (random bytes), as a ratio to the whole
//     XXH3-64 alone (the baseline, measured interleaved in the same run) and to 1-D blocks.
// Usage: weightbus-tiles-bench [--repeat N] (tools/weightbus/flags.h). Times are thread CPU seconds
// (the machine may be shared); the load average is printed.
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/checksum.h"
#include "core/tiles.h"
#include "nlohmann/json.hpp"
#include "weightbus/flags.h"
#include "weightbus/manifest.hpp"

namespace {

using weightbus::DType;
using weightbus::internal::TileGrid;

struct Shape {
  std::string name;
  std::vector<int64_t> dims;
};
struct Model {
  std::string name;
  std::vector<Shape> tensors;  // all of them
  std::vector<Shape> layer;    // one transformer layer's, for hashing
};

double CpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

uint64_t Bytes(const Shape& s) {
  uint64_t n = 2;  // BF16
  for (int64_t d : s.dims) n *= static_cast<uint64_t>(d);
  return n;
}

// A Llama-style decoder: q/k/v/o, gate/up/down (or `experts` per-expert MLPs and a router),
// norms, the embedding and an untied head.
Model Llama(const std::string& name, int64_t hidden, int64_t inter, int layers, int64_t heads,
            int64_t kv_heads, int64_t head_dim, int64_t vocab, int experts = 0,
            int64_t expert_inter = 0) {
  Model m{name, {}, {}};
  m.tensors.push_back({"model.embed_tokens.weight", {vocab, hidden}});
  for (int l = 0; l < layers; ++l) {
    const std::string p = absl::StrFormat("model.layers.%d.", l);
    std::vector<Shape> layer = {{p + "self_attn.q_proj.weight", {heads * head_dim, hidden}},
                                {p + "self_attn.k_proj.weight", {kv_heads * head_dim, hidden}},
                                {p + "self_attn.v_proj.weight", {kv_heads * head_dim, hidden}},
                                {p + "self_attn.o_proj.weight", {hidden, heads * head_dim}},
                                {p + "input_layernorm.weight", {hidden}},
                                {p + "post_attention_layernorm.weight", {hidden}}};
    if (experts == 0) {
      layer.push_back({p + "mlp.gate_proj.weight", {inter, hidden}});
      layer.push_back({p + "mlp.up_proj.weight", {inter, hidden}});
      layer.push_back({p + "mlp.down_proj.weight", {hidden, inter}});
    } else {
      layer.push_back({p + "mlp.gate.weight", {experts, hidden}});
      for (int e = 0; e < experts; ++e) {
        const std::string q = absl::StrFormat("%smlp.experts.%d.", p, e);
        layer.push_back({q + "gate_proj.weight", {expert_inter, hidden}});
        layer.push_back({q + "up_proj.weight", {expert_inter, hidden}});
        layer.push_back({q + "down_proj.weight", {hidden, expert_inter}});
      }
    }
    if (l == 0) m.layer = layer;
    m.tensors.insert(m.tensors.end(), layer.begin(), layer.end());
  }
  m.tensors.push_back({"model.norm.weight", {hidden}});
  m.tensors.push_back({"lm_head.weight", {vocab, hidden}});
  return m;
}

// Qwen2.5-0.5B from the fixture's shapes (tied embeddings: no lm_head).
Model Qwen05(const char* path) {
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  Model m{"Qwen2.5-0.5B", {}, {}};
  for (const auto& [name, dims] : j.at("tensors").items()) {
    Shape s{name, dims.get<std::vector<int64_t>>()};
    if (name.find("layers.0.") != std::string::npos) m.layer.push_back(s);
    m.tensors.push_back(std::move(s));
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  int repeat = 5;
  weightbus::tools::Command app(
      "weightbus-tiles-bench",
      "weightbus-tiles-bench: manifest size and hashing cost of checksum tiles at several "
      "checksum_block settings, against 1-D blocks and the whole XXH3-64 alone (BENCHMARKS.md, "
      "\"Tiles\").");
  app.Add("repeat", &repeat, "repetitions of each measurement (the best is kept)").InRange(1, 1000);
  if (std::optional<int> exit_status = app.Parse(argc, argv)) return *exit_status;
  double load[3] = {0, 0, 0};
  (void)getloadavg(load, 3);
  std::printf("# weightbus-tiles-bench: XXH3 %s, load average %.2f %.2f %.2f\n",
              weightbus::internal::Xxh3Implementation(), load[0], load[1], load[2]);
  const std::vector<Model> models = {
      Qwen05(WEIGHTBUS_SHAPES_FILE), Llama("Llama-2-7B", 4096, 11008, 32, 32, 32, 128, 32000),
      Llama("Llama-3-70B", 8192, 28672, 80, 64, 8, 128, 128256),
      Llama("Qwen3-30B-A3B", 2048, 0, 48, 32, 4, 128, 151936, 128, 768)};
  constexpr uint64_t KiB = 1024, MiB = KiB * KiB;

  std::printf(
      "\n# manifest: tiles (format 2) against 1-D blocks (format 1) at each checksum_block\n");
  std::printf("# %-14s %8s %10s %12s %10s %9s %12s %10s\n", "model", "block", "tensors",
              "model (B)", "tiles", "1-D", "json (B)", "parse (s)");
  for (const Model& model : models) {
    uint64_t model_bytes = 0;
    for (const Shape& s : model.tensors) model_bytes += Bytes(s);
    for (uint64_t target : {64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB}) {
      weightbus::Manifest m;
      m.version = 1;
      uint64_t tiles = 0, blocks = 0;
      for (const Shape& s : model.tensors) {
        weightbus::TensorInfo t;
        t.name = s.name;
        t.dtype = DType::kBF16;
        t.shape = s.dims;
        t.nbytes = Bytes(s);
        const TileGrid g = weightbus::internal::ChooseTiles(t.dtype, t.shape, t.nbytes, target);
        t.block_rows = g.tile_rows;
        t.block_bytes = g.tile_bytes;
        t.block_xxh3.assign(g.count(), 0x0123456789abcdefULL);
        tiles += g.count();
        blocks += weightbus::internal::BlockCount(t.nbytes, target);
        m.tensors.push_back(std::move(t));
      }
      const std::string json = m.ToJson();
      double best = 1e9;
      for (int r = 0; r < std::max(1, repeat / 2); ++r) {
        const double t0 = CpuSeconds();
        absl::StatusOr<weightbus::Manifest> back = weightbus::Manifest::FromJson(json, "bench");
        best = std::min(best, CpuSeconds() - t0);
        if (!back.ok()) {
          std::fprintf(stderr, "%s\n", std::string(back.status().message()).c_str());
          return 1;
        }
      }
      std::printf("  %-14s %7lluK %10zu %12llu %10llu %9llu %12zu %10.4f  (%.3f%% of the model)\n",
                  model.name.c_str(), static_cast<unsigned long long>(target / KiB),
                  model.tensors.size(), static_cast<unsigned long long>(model_bytes),
                  static_cast<unsigned long long>(tiles), static_cast<unsigned long long>(blocks),
                  json.size(), best, 100.0 * json.size() / model_bytes);
    }
  }

  std::printf(
      "\n# hashing one layer (random bytes, in memory): CPU s per GB; ratios to the whole XXH3-64 "
      "alone (baseline, same run) and to 1-D blocks of the same size\n");
  std::printf("# %-14s %8s %10s %10s %10s %10s %10s\n", "model", "block", "whole", "1-D", "tiles",
              "tiles/whole", "tiles/1-D");
  for (const Model& model : models) {
    std::vector<std::vector<std::byte>> data;
    uint64_t layer_bytes = 0;
    for (const Shape& s : model.layer) {
      if (layer_bytes > 512 * MiB) break;  // enough for a figure (the MoE layer's experts)
      std::vector<std::byte> b(Bytes(s));
      uint64_t x = 0x9e3779b97f4a7c15ULL * (data.size() + 1);
      for (size_t i = 0; i + 8 <= b.size(); i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::memcpy(b.data() + i, &x, 8);
      }
      layer_bytes += b.size();
      data.push_back(std::move(b));
    }
    for (uint64_t target : {64 * KiB, 1 * MiB}) {
      double whole = 1e9, linear = 1e9, tiled = 1e9;
      volatile uint64_t sink = 0;
      for (int r = 0; r < repeat; ++r) {  // interleaved, best of each
        double t0 = CpuSeconds();
        for (size_t i = 0; i < data.size(); ++i) {
          sink = sink + weightbus::internal::Xxh3(data[i].data(), data[i].size());
        }
        whole = std::min(whole, CpuSeconds() - t0);
        t0 = CpuSeconds();
        for (size_t i = 0; i < data.size(); ++i) {
          sink = sink + weightbus::internal::ChecksumTensor(
                            data[i].data(), data[i].size(),
                            weightbus::internal::LinearBlocks(data[i].size(), target))
                            .xxh3;
        }
        linear = std::min(linear, CpuSeconds() - t0);
        t0 = CpuSeconds();
        for (size_t i = 0; i < data.size(); ++i) {
          const Shape& s = model.layer[i];
          sink = sink +
                 weightbus::internal::ChecksumTensor(
                     data[i].data(), data[i].size(),
                     weightbus::internal::ChooseTiles(DType::kBF16, s.dims, data[i].size(), target))
                     .xxh3;
        }
        tiled = std::min(tiled, CpuSeconds() - t0);
      }
      const double gb = layer_bytes / 1e9;
      std::printf("  %-14s %7lluK %10.4f %10.4f %10.4f %10.2f %10.2f\n", model.name.c_str(),
                  static_cast<unsigned long long>(target / KiB), whole / gb, linear / gb,
                  tiled / gb, tiled / whole, tiled / linear);
    }
  }
  std::printf("# OK\n");
  return 0;
}

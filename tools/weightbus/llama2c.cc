// SPDX-License-Identifier: Apache-2.0
#include "weightbus/llama2c.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "weightbus/bf16.h"
#include "weightbus/manifest.hpp"
#include "weightbus/safetensors.hpp"

namespace weightbus::tools {
namespace {

#define WBT_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status wbt_status_ = (expr);       \
    if (!wbt_status_.ok()) return wbt_status_; \
  } while (0)

// The magic number that starts llama2.c's version 1 and 2 exports ("ak42" as uint32 LE).
constexpr uint32_t kLlama2cVersionedMagic = 0x616b3432;

uint32_t LoadU32(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 |
         static_cast<uint32_t>(b[2]) << 16 | static_cast<uint32_t>(b[3]) << 24;
}

void StoreU32(uint32_t v, std::string& out) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Number of float32 elements of each array, in file order.
struct ArraySizes {
  uint64_t token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, freq_cis, wcls;
};

ArraySizes SizesOf(const Llama2cConfig& c) {
  const uint64_t dim = c.dim, hidden = c.hidden_dim, layers = c.n_layers, vocab = c.vocab_size,
                 kv_dim = static_cast<uint64_t>(c.kv_dim()), seq = c.max_seq_len,
                 half_head = static_cast<uint64_t>(c.head_size() / 2);
  // Only called on validated configs whose Llama2cFileSize fits in memory, so no overflow.
  return ArraySizes{
      .token_embedding = vocab * dim,
      .rms_att = layers * dim,
      .wq = layers * dim * dim,
      .wk = layers * kv_dim * dim,
      .wv = layers * kv_dim * dim,
      .wo = layers * dim * dim,
      .rms_ffn = layers * dim,
      .w1 = layers * hidden * dim,
      .w2 = layers * dim * hidden,
      .w3 = layers * hidden * dim,
      .rms_final = dim,
      .freq_cis = seq * half_head,
      .wcls = c.shared_classifier ? 0 : vocab * dim,
  };
}

std::string ConfigString(const Llama2cConfig& c) {
  return absl::StrFormat(
      "dim=%d hidden_dim=%d n_layers=%d n_heads=%d n_kv_heads=%d vocab_size=%d max_seq_len=%d",
      c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
      c.shared_classifier ? c.vocab_size : -c.vocab_size, c.max_seq_len);
}

absl::Status ErrnoStatus(int err, std::string_view what) {
  std::string message = absl::StrFormat("%s: %s", what, std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrFormat("open %s", path));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(err, absl::StrFormat("fstat %s", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrFormat("%s is not a regular file", path));
  }
  std::string data(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::read(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return ErrnoStatus(err, absl::StrFormat("read %s", path));
    }
    if (n == 0) break;  // shrank while reading; the size check below reports it
    done += static_cast<size_t>(n);
  }
  data.resize(done);
  ::close(fd);
  return data;
}

// Writes `contents` to `path` through `path`.tmp, fsynced and renamed into place.
absl::Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, absl::StrFormat("open %s", tmp));
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return ErrnoStatus(err, absl::StrFormat("write %s", tmp));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, absl::StrFormat("fsync %s", tmp));
  }
  if (::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, absl::StrFormat("close %s", tmp));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, absl::StrFormat("rename %s to %s", tmp, path));
  }
  return absl::OkStatus();
}

// What makes `c` invalid, or "" when it is valid.
std::string ConfigProblem(const Llama2cConfig& c) {
  if (c.dim <= 0 || c.hidden_dim <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
      c.vocab_size <= 0 || c.max_seq_len <= 0) {
    return "a size is non-positive";
  }
  if (c.dim % c.n_heads != 0) return "dim is not a multiple of n_heads";
  if (c.n_heads % c.n_kv_heads != 0) return "n_heads is not a multiple of n_kv_heads";
  if (c.head_size() % 2 != 0) {
    return absl::StrFormat("head_size dim/n_heads = %d is odd, RoPE needs pairs", c.head_size());
  }
  return "";
}

// Output dtypes a conversion supports.
absl::Status CheckOutputDType(DType dtype) {
  if (dtype == DType::kF32 || dtype == DType::kBF16) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("cannot store float32 weights as %s: only F32 and BF16 are supported",
                      std::string(DTypeName(dtype))));
}

// Shared implementation of PermuteRotaryRows (forward = true) and its inverse.
absl::StatusOr<std::vector<float>> RotaryRows(absl::Span<const float> w, int64_t n_heads,
                                              int64_t rows, int64_t cols, bool forward) {
  if (n_heads <= 0 || rows < 0 || cols < 0 || rows % n_heads != 0 || (rows / n_heads) % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rotary permutation: %d rows cannot be split into %d heads of an even size",
                        rows, n_heads));
  }
  const bool size_matches =
      cols == 0 ? w.empty()
                : static_cast<uint64_t>(rows) <= w.size() / static_cast<uint64_t>(cols) &&
                      static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols) == w.size();
  if (!size_matches) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rotary permutation: %d values, expected a [%d, %d] matrix", w.size(), rows, cols));
  }
  const int64_t head_size = rows / n_heads;
  const int64_t half = head_size / 2;
  std::vector<float> out(w.size());
  for (int64_t h = 0; h < n_heads; ++h) {
    for (int64_t i = 0; i < half; ++i) {
      for (int64_t j = 0; j < 2; ++j) {
        const int64_t interleaved = h * head_size + 2 * i + j;  // llama2.c row
        const int64_t split = h * head_size + j * half + i;     // HF row
        const int64_t src = forward ? interleaved : split;
        const int64_t dst = forward ? split : interleaved;
        std::memcpy(out.data() + dst * cols, w.data() + src * cols, sizeof(float) * cols);
      }
    }
  }
  return out;
}

}  // namespace

absl::Status ValidateLlama2cCheckpoint(const Llama2cCheckpoint& ckpt) {
  if (std::string problem = ConfigProblem(ckpt.config); !problem.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("invalid llama2.c config (%s): %s", ConfigString(ckpt.config), problem));
  }
  if (Llama2cFileSize(ckpt.config) == std::numeric_limits<uint64_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("llama2.c config (%s) is too large to address", ConfigString(ckpt.config)));
  }
  const ArraySizes s = SizesOf(ckpt.config);
  const std::pair<const char*, std::pair<const std::vector<float>*, uint64_t>> arrays[] = {
      {"token_embedding", {&ckpt.token_embedding, s.token_embedding}},
      {"rms_att", {&ckpt.rms_att, s.rms_att}},
      {"wq", {&ckpt.wq, s.wq}},
      {"wk", {&ckpt.wk, s.wk}},
      {"wv", {&ckpt.wv, s.wv}},
      {"wo", {&ckpt.wo, s.wo}},
      {"rms_ffn", {&ckpt.rms_ffn, s.rms_ffn}},
      {"w1", {&ckpt.w1, s.w1}},
      {"w2", {&ckpt.w2, s.w2}},
      {"w3", {&ckpt.w3, s.w3}},
      {"rms_final", {&ckpt.rms_final, s.rms_final}},
      {"freq_cis_real", {&ckpt.freq_cis_real, s.freq_cis}},
      {"freq_cis_imag", {&ckpt.freq_cis_imag, s.freq_cis}},
      {"wcls", {&ckpt.wcls, s.wcls}},
  };
  for (const auto& [name, array] : arrays) {
    if (array.first->size() != array.second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "llama2.c checkpoint array %s has %d floats, but the config (%s) needs %d", name,
          array.first->size(), ConfigString(ckpt.config), array.second));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Llama2cConfig> ParseLlama2cHeader(std::string_view bytes, std::string_view source) {
  if (bytes.size() < kLlama2cHeaderBytes) {
    return absl::DataLossError(absl::StrFormat(
        "%s: %d bytes is too short for a llama2.c checkpoint (the header alone is %d bytes)",
        source, bytes.size(), kLlama2cHeaderBytes));
  }
  int32_t h[7];
  for (int i = 0; i < 7; ++i) h[i] = static_cast<int32_t>(LoadU32(bytes.data() + 4 * i));
  if (static_cast<uint32_t>(h[0]) == kLlama2cVersionedMagic) {
    return absl::DataLossError(absl::StrFormat(
        "%s: starts with the magic \"ak42\" of a versioned llama2.c export (version %d); only "
        "the legacy version-0 format (export.py --version 0) is supported",
        source, h[1]));
  }
  Llama2cConfig c;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.max_seq_len = h[6];
  c.shared_classifier = h[5] > 0;
  // INT32_MIN has no positive counterpart: treat it as invalid (0).
  c.vocab_size = h[5] == std::numeric_limits<int32_t>::min() ? 0 : (h[5] > 0 ? h[5] : -h[5]);
  if (std::string problem = ConfigProblem(c); !problem.empty()) {
    return absl::DataLossError(absl::StrFormat(
        "%s: invalid llama2.c header (dim=%d hidden_dim=%d n_layers=%d n_heads=%d n_kv_heads=%d "
        "vocab_size=%d max_seq_len=%d): %s",
        source, h[0], h[1], h[2], h[3], h[4], h[5], h[6], problem));
  }
  return c;
}

uint64_t Llama2cFileSize(const Llama2cConfig& c) {
  using U = unsigned __int128;
  const U dim = static_cast<uint32_t>(c.dim), hidden = static_cast<uint32_t>(c.hidden_dim),
          layers = static_cast<uint32_t>(c.n_layers), vocab = static_cast<uint32_t>(c.vocab_size),
          seq = static_cast<uint32_t>(c.max_seq_len);
  const U kv_dim =
      c.n_heads > 0 ? dim / static_cast<uint32_t>(c.n_heads) * static_cast<uint32_t>(c.n_kv_heads)
                    : 0;
  const U half_head = c.n_heads > 0 ? dim / static_cast<uint32_t>(c.n_heads) / 2 : 0;
  U floats = vocab * dim                            // token_embedding
             + layers * dim * 2                     // rms_att, rms_ffn
             + layers * dim * dim * 2               // wq, wo
             + layers * kv_dim * dim * 2            // wk, wv
             + layers * hidden * dim * 3            // w1, w2, w3
             + dim                                  // rms_final
             + seq * half_head * 2;                 // freq_cis_real, freq_cis_imag
  if (!c.shared_classifier) floats += vocab * dim;  // wcls
  const U total = U{kLlama2cHeaderBytes} + floats * 4;
  return total > std::numeric_limits<uint64_t>::max() ? std::numeric_limits<uint64_t>::max()
                                                      : static_cast<uint64_t>(total);
}

absl::StatusOr<Llama2cCheckpoint> ParseLlama2c(std::string_view bytes, std::string_view source) {
  absl::StatusOr<Llama2cConfig> config = ParseLlama2cHeader(bytes, source);
  if (!config.ok()) return config.status();
  const uint64_t expected = Llama2cFileSize(*config);
  if (bytes.size() != expected) {
    return absl::DataLossError(absl::StrFormat(
        "%s: llama2.c checkpoint has %d bytes but its header (%s) implies exactly %d bytes (%s)",
        source, bytes.size(), ConfigString(*config), expected,
        bytes.size() < expected ? "truncated" : "unexpected trailing data"));
  }
  Llama2cCheckpoint ckpt;
  ckpt.config = *config;
  const ArraySizes s = SizesOf(*config);
  size_t offset = kLlama2cHeaderBytes;
  auto take = [&](std::vector<float>& out, uint64_t count) {
    out.resize(count);
    for (uint64_t i = 0; i < count; ++i) {
      out[i] = std::bit_cast<float>(LoadU32(bytes.data() + offset + 4 * i));
    }
    offset += 4 * count;
  };
  take(ckpt.token_embedding, s.token_embedding);
  take(ckpt.rms_att, s.rms_att);
  take(ckpt.wq, s.wq);
  take(ckpt.wk, s.wk);
  take(ckpt.wv, s.wv);
  take(ckpt.wo, s.wo);
  take(ckpt.rms_ffn, s.rms_ffn);
  take(ckpt.w1, s.w1);
  take(ckpt.w2, s.w2);
  take(ckpt.w3, s.w3);
  take(ckpt.rms_final, s.rms_final);
  take(ckpt.freq_cis_real, s.freq_cis);
  take(ckpt.freq_cis_imag, s.freq_cis);
  take(ckpt.wcls, s.wcls);
  return ckpt;
}

absl::StatusOr<Llama2cCheckpoint> ReadLlama2c(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadWholeFile(path);
  if (!bytes.ok()) return bytes.status();
  return ParseLlama2c(*bytes, path);
}

absl::StatusOr<std::string> SerializeLlama2c(const Llama2cCheckpoint& ckpt) {
  WBT_RETURN_IF_ERROR(ValidateLlama2cCheckpoint(ckpt));
  const Llama2cConfig& c = ckpt.config;
  std::string out;
  out.reserve(Llama2cFileSize(c));
  const int32_t header[7] = {c.dim,        c.hidden_dim,
                             c.n_layers,   c.n_heads,
                             c.n_kv_heads, c.shared_classifier ? c.vocab_size : -c.vocab_size,
                             c.max_seq_len};
  for (int32_t v : header) StoreU32(static_cast<uint32_t>(v), out);
  for (const std::vector<float>* array :
       {&ckpt.token_embedding, &ckpt.rms_att, &ckpt.wq, &ckpt.wk, &ckpt.wv, &ckpt.wo, &ckpt.rms_ffn,
        &ckpt.w1, &ckpt.w2, &ckpt.w3, &ckpt.rms_final, &ckpt.freq_cis_real, &ckpt.freq_cis_imag,
        &ckpt.wcls}) {
    for (float v : *array) StoreU32(std::bit_cast<uint32_t>(v), out);
  }
  return out;
}

TensorView OwnedTensor::view() const {
  TensorView v;
  v.name = name;
  v.dtype = dtype;
  v.shape = shape;
  v.data = bytes.data();
  return v;
}

absl::StatusOr<std::vector<float>> PermuteRotaryRows(absl::Span<const float> w, int64_t n_heads,
                                                     int64_t rows, int64_t cols) {
  return RotaryRows(w, n_heads, rows, cols, /*forward=*/true);
}

absl::StatusOr<std::vector<float>> UnpermuteRotaryRows(absl::Span<const float> w, int64_t n_heads,
                                                       int64_t rows, int64_t cols) {
  return RotaryRows(w, n_heads, rows, cols, /*forward=*/false);
}

absl::StatusOr<std::vector<std::byte>> EncodeFloats(absl::Span<const float> values, DType dtype) {
  std::vector<std::byte> out;
  if (dtype == DType::kF32) {
    out.resize(values.size() * 4);
    for (size_t i = 0; i < values.size(); ++i) {
      const uint32_t bits = std::bit_cast<uint32_t>(values[i]);
      for (int b = 0; b < 4; ++b) out[4 * i + b] = static_cast<std::byte>(bits >> (8 * b));
    }
  } else if (dtype == DType::kBF16) {
    out.resize(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t bits = FloatToBf16(values[i]);
      out[2 * i] = static_cast<std::byte>(bits & 0xff);
      out[2 * i + 1] = static_cast<std::byte>(bits >> 8);
    }
  } else {
    return CheckOutputDType(dtype);
  }
  return out;
}

absl::StatusOr<std::vector<OwnedTensor>> ConvertToHf(const Llama2cCheckpoint& ckpt, DType dtype) {
  WBT_RETURN_IF_ERROR(CheckOutputDType(dtype));
  WBT_RETURN_IF_ERROR(ValidateLlama2cCheckpoint(ckpt));
  const Llama2cConfig& c = ckpt.config;
  const int64_t dim = c.dim, hidden = c.hidden_dim, kv_dim = c.kv_dim(), vocab = c.vocab_size;

  std::vector<OwnedTensor> out;
  auto add = [&](std::string name, std::vector<int64_t> shape,
                 absl::Span<const float> values) -> absl::Status {
    absl::StatusOr<std::vector<std::byte>> bytes = EncodeFloats(values, dtype);
    if (!bytes.ok()) return bytes.status();
    out.push_back(OwnedTensor{std::move(name), dtype, std::move(shape), std::move(*bytes)});
    return absl::OkStatus();
  };
  // Layer `l`'s slice of a stacked [L, rows, cols] array.
  auto layer = [](const std::vector<float>& stacked, int64_t l, int64_t per_layer) {
    return absl::MakeConstSpan(stacked).subspan(static_cast<size_t>(l * per_layer),
                                                static_cast<size_t>(per_layer));
  };

  WBT_RETURN_IF_ERROR(add("model.embed_tokens.weight", {vocab, dim}, ckpt.token_embedding));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    absl::StatusOr<std::vector<float>> q =
        PermuteRotaryRows(layer(ckpt.wq, l, dim * dim), c.n_heads, dim, dim);
    if (!q.ok()) return q.status();
    absl::StatusOr<std::vector<float>> k =
        PermuteRotaryRows(layer(ckpt.wk, l, kv_dim * dim), c.n_kv_heads, kv_dim, dim);
    if (!k.ok()) return k.status();
    WBT_RETURN_IF_ERROR(add(p + "self_attn.q_proj.weight", {dim, dim}, *q));
    WBT_RETURN_IF_ERROR(add(p + "self_attn.k_proj.weight", {kv_dim, dim}, *k));
    WBT_RETURN_IF_ERROR(
        add(p + "self_attn.v_proj.weight", {kv_dim, dim}, layer(ckpt.wv, l, kv_dim * dim)));
    WBT_RETURN_IF_ERROR(
        add(p + "self_attn.o_proj.weight", {dim, dim}, layer(ckpt.wo, l, dim * dim)));
    WBT_RETURN_IF_ERROR(
        add(p + "mlp.gate_proj.weight", {hidden, dim}, layer(ckpt.w1, l, hidden * dim)));
    WBT_RETURN_IF_ERROR(
        add(p + "mlp.up_proj.weight", {hidden, dim}, layer(ckpt.w3, l, hidden * dim)));
    WBT_RETURN_IF_ERROR(
        add(p + "mlp.down_proj.weight", {dim, hidden}, layer(ckpt.w2, l, dim * hidden)));
    WBT_RETURN_IF_ERROR(add(p + "input_layernorm.weight", {dim}, layer(ckpt.rms_att, l, dim)));
    WBT_RETURN_IF_ERROR(
        add(p + "post_attention_layernorm.weight", {dim}, layer(ckpt.rms_ffn, l, dim)));
  }
  WBT_RETURN_IF_ERROR(add("model.norm.weight", {dim}, ckpt.rms_final));
  if (!c.shared_classifier) {
    WBT_RETURN_IF_ERROR(add("lm_head.weight", {vocab, dim}, ckpt.wcls));
  }
  return out;
}

absl::StatusOr<std::string> HfConfigJson(const Llama2cConfig& c, DType dtype) {
  WBT_RETURN_IF_ERROR(CheckOutputDType(dtype));
  const char* torch_dtype = dtype == DType::kBF16 ? "bfloat16" : "float32";
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["hidden_size"] = c.dim;
  j["intermediate_size"] = c.hidden_dim;
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.n_kv_heads;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_seq_len;
  j["rms_norm_eps"] = 1e-5;
  j["rope_theta"] = 10000.0;
  j["tie_word_embeddings"] = c.shared_classifier;
  j["torch_dtype"] = torch_dtype;
  j["hidden_act"] = "silu";
  j["bos_token_id"] = 1;
  j["eos_token_id"] = 2;
  return j.dump(2) + "\n";
}

absl::Status ConvertLlama2c(const std::string& in_path, const std::string& out_dir, DType dtype) {
  WBT_RETURN_IF_ERROR(CheckOutputDType(dtype));  // fail before any I/O

  absl::StatusOr<Llama2cCheckpoint> ckpt = ReadLlama2c(in_path);
  if (!ckpt.ok()) return ckpt.status();
  absl::StatusOr<std::vector<OwnedTensor>> tensors = ConvertToHf(*ckpt, dtype);
  if (!tensors.ok()) return tensors.status();
  absl::StatusOr<std::string> config_json = HfConfigJson(ckpt->config, dtype);
  if (!config_json.ok()) return config_json.status();

  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) {
    return ErrnoStatus(ec.value(), absl::StrFormat("create directory %s", out_dir));
  }
  std::vector<TensorView> views;
  views.reserve(tensors->size());
  for (const OwnedTensor& t : *tensors) views.push_back(t.view());
  WBT_RETURN_IF_ERROR(
      safetensors::WriteFile(out_dir + "/model.safetensors", views, Metadata{{"format", "pt"}}));
  // config.json last: a directory with a config.json has its weights.
  return WriteFileAtomically(out_dir + "/config.json", *config_json);
}

}  // namespace weightbus::tools

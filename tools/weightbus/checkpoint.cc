// SPDX-License-Identifier: Apache-2.0
#include "weightbus/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "xxhash.h"

namespace weightbus::tools {
namespace {

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrFormat("cannot open %s", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) {
    return absl::NotFoundError(absl::StrFormat("%s does not exist", path));
  }
  Checkpoint ckpt;
  if (std::filesystem::is_directory(status)) {
    const std::string index = path + "/model.safetensors.index.json";
    const std::string single = path + "/model.safetensors";
    if (std::filesystem::exists(index, ec)) {
      absl::StatusOr<std::string> text = ReadText(index);
      if (!text.ok()) return text.status();
      nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
      if (j.is_discarded() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
        return absl::DataLossError(absl::StrFormat("%s has no weight_map object", index));
      }
      std::set<std::string> names;
      for (const auto& [name, file] : j["weight_map"].items()) {
        if (!file.is_string()) {
          return absl::DataLossError(
              absl::StrFormat("%s: weight_map[\"%s\"] is not a string", index, name));
        }
        const std::string f = file.get<std::string>();
        // Shards are files of this directory: no path, nothing hidden ("..", ".x").
        if (f.empty() || f[0] == '.' || f.find('/') != std::string::npos) {
          return absl::DataLossError(absl::StrFormat(
              "%s: weight_map[\"%s\"] names \"%s\", which is not a file of %s (a shard name may "
              "not contain '/' or start with '.')",
              index, name, f, path));
        }
        names.insert(f);
      }
      for (const std::string& n : names) ckpt.file_paths.push_back(path + "/" + n);
    } else if (std::filesystem::exists(single, ec)) {
      ckpt.file_paths.push_back(single);
    } else {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s holds neither model.safetensors nor model.safetensors.index.json", path));
    }
  } else {
    ckpt.file_paths.push_back(path);
  }
  ckpt.files.reserve(ckpt.file_paths.size());
  for (const std::string& p : ckpt.file_paths) {
    absl::StatusOr<safetensors::File> f = safetensors::ReadFile(p);
    if (!f.ok()) return f.status();
    ckpt.files.push_back(*std::move(f));
  }
  std::set<std::string> seen;
  for (size_t k = 0; k < ckpt.files.size(); ++k) {
    const safetensors::File& f = ckpt.files[k];
    for (const safetensors::Entry& e : f.header.tensors) {
      if (!seen.insert(e.name).second) {
        return absl::DataLossError(
            absl::StrFormat("tensor \"%s\" appears in more than one file "
                            "of %s",
                            e.name, path));
      }
      TensorView v;
      v.name = e.name;
      v.dtype = e.dtype;
      v.shape = e.shape;
      v.data = f.Bytes(e).data();
      ckpt.tensors.push_back(std::move(v));
    }
  }
  return ckpt;
}

absl::Status SaveCheckpoint(const std::string& dir, absl::Span<const TensorView> tensors,
                            const Manifest* manifest) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrFormat("create directory %s: %s", dir, ec.message()));
  }
  Metadata metadata = {{"format", "pt"}};
  std::string manifest_json;
  if (manifest != nullptr) {
    // The model names the manifest it belongs to (docs: subscribe --to), so that a pair left
    // by a write interrupted between the two renames is detected (VerifyCheckpointPair).
    manifest_json = manifest->ToJson();
    metadata[kVersionKey] = std::to_string(manifest->version);
    metadata[kManifestHashKey] =
        absl::StrFormat("%016x", XXH3_64bits(manifest_json.data(), manifest_json.size()));
  }
  absl::Status s = safetensors::WriteFile(dir + "/model.safetensors", tensors, metadata);
  if (!s.ok() || manifest == nullptr) return s;
  const std::string path = dir + "/weightbus.manifest.json";
  const std::string tmp = absl::StrFormat("%s.tmp-%d", path, getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << manifest_json;
    out.flush();
    if (!out) return absl::InternalError(absl::StrFormat("write %s failed", tmp));
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::InternalError(absl::StrFormat("rename %s: %s", tmp, ec.message()));
  return absl::OkStatus();
}

absl::Status VerifyCheckpointPair(const safetensors::Header& model, const std::string& model_path,
                                  const std::string& manifest_json,
                                  const std::string& manifest_path, uint64_t manifest_version) {
  auto hash = model.metadata.find(kManifestHashKey);
  if (hash == model.metadata.end()) return absl::OkStatus();  // not written by subscribe --to
  const std::string actual =
      absl::StrFormat("%016x", XXH3_64bits(manifest_json.data(), manifest_json.size()));
  if (hash->second == actual) return absl::OkStatus();
  auto version = model.metadata.find(kVersionKey);
  return absl::DataLossError(absl::StrFormat(
      "%s holds version %s (manifest xxh3 %s) but %s is the manifest of version %d (xxh3 %s): "
      "the two do not belong together (a write interrupted between them?); receive the "
      "version again",
      model_path, version == model.metadata.end() ? "?" : version->second, hash->second,
      manifest_path, manifest_version, actual));
}

}  // namespace weightbus::tools

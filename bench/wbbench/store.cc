// SPDX-License-Identifier: Apache-2.0
#include "wbbench/store.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace weightbus::bench {

std::string StoreIndex::VersionPath(const std::string& dir, uint64_t version) const {
  return absl::StrFormat("%s/v%d.bin", dir, version);
}

std::vector<TensorView> StoreIndex::Views(const std::byte* base) const {
  std::vector<TensorView> views;
  views.reserve(tensors.size());
  for (const StoredTensor& t : tensors) {
    views.push_back(TensorView{t.name, t.dtype, t.shape, {}, base + t.offset});
  }
  return views;
}

absl::Status WriteIndex(const std::string& dir, const StoreIndex& index) {
  nlohmann::ordered_json j;
  j["file_bytes"] = index.file_bytes;
  j["tensor_bytes"] = index.tensor_bytes;
  for (const StoredTensor& t : index.tensors) {
    j["tensors"].push_back({{"name", t.name},
                            {"dtype", std::string(DTypeName(t.dtype))},
                            {"shape", t.shape},
                            {"offset", t.offset},
                            {"nbytes", t.nbytes}});
  }
  for (size_t v = 0; v < index.xxh3.size(); ++v) {
    std::vector<std::string> hex;
    for (uint64_t h : index.xxh3[v]) hex.push_back(absl::StrFormat("%016x", h));
    j["versions"].push_back(
        {{"version", v + 1}, {"xxh3", hex}, {"changed_fraction", index.changed_fraction[v]}});
  }
  std::ofstream out(dir + "/index.json");
  out << j.dump(1);
  if (!out) return absl::InternalError("cannot write " + dir + "/index.json");
  return absl::OkStatus();
}

absl::StatusOr<StoreIndex> ReadIndex(const std::string& dir) {
  std::ifstream in(dir + "/index.json");
  if (!in) return absl::NotFoundError("cannot open " + dir + "/index.json");
  std::stringstream ss;
  ss << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, false);
  if (j.is_discarded()) return absl::DataLossError(dir + "/index.json is not JSON");
  StoreIndex index;
  try {
    index.file_bytes = j.at("file_bytes");
    index.tensor_bytes = j.at("tensor_bytes");
    for (const auto& t : j.at("tensors")) {
      StoredTensor s;
      s.name = t.at("name");
      absl::StatusOr<DType> d = DTypeFromName(t.at("dtype").get<std::string>());
      if (!d.ok()) return absl::DataLossError("unknown dtype in " + dir + "/index.json");
      s.dtype = *d;
      s.shape = t.at("shape").get<std::vector<int64_t>>();
      s.offset = t.at("offset");
      s.nbytes = t.at("nbytes");
      index.tensors.push_back(std::move(s));
    }
    for (const auto& v : j.at("versions")) {
      std::vector<uint64_t> hashes;
      for (const auto& h : v.at("xxh3")) hashes.push_back(std::stoull(h.get<std::string>(), 0, 16));
      index.xxh3.push_back(std::move(hashes));
      index.changed_fraction.push_back(v.at("changed_fraction"));
    }
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrFormat("%s/index.json: %s", dir, e.what()));
  }
  return index;
}

uint64_t Hash(const void* data, size_t n) { return XXH3_64bits(data, n); }

absl::Status ReadWhole(const std::string& path, std::byte* out, uint64_t size) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrFormat("open %s: %s", path, strerror(errno)));
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n = pread(fd, out + done, std::min<uint64_t>(size - done, 8 << 20), done);
    if (n <= 0) {
      close(fd);
      return absl::DataLossError(
          absl::StrFormat("read %s: %s", path, n == 0 ? "file too short" : strerror(errno)));
    }
    done += static_cast<uint64_t>(n);
  }
  close(fd);
  return absl::OkStatus();
}

}  // namespace weightbus::bench

// SPDX-License-Identifier: Apache-2.0
#include "weightbus/manifest.hpp"

#include <charconv>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/tiles.h"
#include "nlohmann/json.hpp"

namespace weightbus {
namespace {

using nlohmann::ordered_json;

// Format 1: one publisher. Format 2: a publisher group; tensors carry "owner" (the rank that
// holds their bytes). A reader takes both; a writer writes 1 unless the version is a group's,
// so a single publisher's manifests stay readable by older libraries.
constexpr std::string_view kFormat = "weightbus.manifest/1";
constexpr std::string_view kGroupFormat = "weightbus.manifest/2";

std::string Hex64(uint64_t v) { return absl::StrFormat("%016x", v); }

// 16 characters of [0-9a-f] at `p` (from_chars also takes a sign and upper case).
bool IsLowerHex(const char* p) {
  for (int i = 0; i < 16; ++i) {
    if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f'))) return false;
  }
  return true;
}

ordered_json ShapeJson(const std::vector<int64_t>& shape) {
  ordered_json a = ordered_json::array();
  for (int64_t d : shape) a.push_back(d);
  return a;
}

// Typed field access that reports the path of a bad field.
class Reader {
 public:
  explicit Reader(std::string_view source) : source_(source) {}

  absl::Status Error(std::string_view path, std::string_view what) const {
    return absl::DataLossError(absl::StrFormat("manifest %s: field %s %s", source_, path, what));
  }

  template <typename T>
  absl::StatusOr<T> Get(const ordered_json& obj, const char* key, std::string_view path) const {
    auto it = obj.find(key);
    std::string full = absl::StrFormat("%s.%s", path, key);
    if (it == obj.end()) return Error(full, "is missing");
    if constexpr (std::is_integral_v<T>) {
      return Integer<T>(*it, full, IntegerMin<T>());
    } else {
      try {
        return it->template get<T>();
      } catch (const std::exception& e) {
        return Error(full, absl::StrFormat("has the wrong type (%s)", it->type_name()));
      }
    }
  }

  // An integer field: a JSON integer (not a float such as 1.5, 2.0 or 1e30; integers beyond 64
  // bits are floats to the parser) in [min, max of T]. Converting anything else would be
  // undefined behaviour or silent truncation.
  template <typename T>
  absl::StatusOr<T> Integer(const ordered_json& v, std::string_view path, T min) const {
    if (v.is_number_float()) {
      return Error(path, absl::StrFormat("is %s, not an integer of at most 64 bits", v.dump()));
    }
    if (!v.is_number_integer()) {
      return Error(path,
                   absl::StrFormat("has the wrong type (%s), expected an integer", v.type_name()));
    }
    bool fits;
    if (v.is_number_unsigned()) {
      fits = v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max()) &&
             (min <= 0 || v.get<uint64_t>() >= static_cast<uint64_t>(min));
    } else {  // negative
      const int64_t i = v.get<int64_t>();
      fits = min < 0 && i >= static_cast<int64_t>(min);
    }
    if (!fits) {
      return Error(path, absl::StrFormat("is %s, outside [%d, %d]", v.dump(), min,
                                         std::numeric_limits<T>::max()));
    }
    return v.is_number_unsigned() ? static_cast<T>(v.get<uint64_t>())
                                  : static_cast<T>(v.get<int64_t>());
  }

  // The least value of an integer field of type T: counts (`int`: rank, world_size) and
  // unsigned fields are non-negative; int64 fields (pid, times) take any int64.
  template <typename T>
  static constexpr T IntegerMin() {
    if constexpr (std::is_same_v<T, int64_t>) {
      return std::numeric_limits<T>::min();
    } else {
      return 0;
    }
  }

  absl::StatusOr<std::vector<int64_t>> Shape(const ordered_json& v, std::string_view path) const {
    if (!v.is_array()) return Error(path, "is not an array");
    if (v.size() > kMaxRank) {
      return Error(path, absl::StrFormat("has %d dimensions, more than the limit of %d", v.size(),
                                         kMaxRank));
    }
    std::vector<int64_t> out;
    for (size_t i = 0; i < v.size(); ++i) {
      absl::StatusOr<int64_t> d = Integer<int64_t>(v[i], absl::StrFormat("%s[%d]", path, i), 0);
      if (!d.ok()) return d.status();
      out.push_back(*d);
    }
    return out;
  }

 private:
  std::string_view source_;
};

}  // namespace

uint64_t Manifest::total_bytes() const {
  uint64_t total = 0;
  for (const TensorInfo& t : tensors) total += t.nbytes;
  return total;
}

const TensorInfo* Manifest::Find(std::string_view name) const {
  for (const TensorInfo& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::string Manifest::ToJson() const {
  ordered_json j;
  j["format"] = group ? kGroupFormat : kFormat;
  j["version"] = version;
  ordered_json pub;
  pub["host"] = publisher.host;
  pub["pid"] = publisher.pid;
  pub["rank"] = publisher.rank;
  pub["world_size"] = publisher.world_size;
  pub["name"] = publisher.name;
  pub["session"] = publisher.session;
  j["publisher"] = std::move(pub);
  j["publish_start_unix_ns"] = publish_start_unix_ns;
  j["sealed_unix_ns"] = sealed_unix_ns;
  j["total_bytes"] = total_bytes();
  ordered_json md = ordered_json::object();
  for (const auto& [k, v] : metadata) md[k] = v;
  j["metadata"] = std::move(md);
  ordered_json ts = ordered_json::array();
  for (const TensorInfo& t : tensors) {
    ordered_json e;
    e["name"] = t.name;
    e["dtype"] = DTypeName(t.dtype);
    e["shape"] = ShapeJson(t.shape);
    e["nbytes"] = t.nbytes;
    e["xxh3"] = Hex64(t.xxh3);
    if (t.block_bytes > 0) {
      std::string blocks;
      blocks.reserve(16 * t.block_xxh3.size());
      for (uint64_t b : t.block_xxh3) blocks += Hex64(b);
      if (t.block_rows > 0) {  // tiles (checksum format 2): keys older readers ignore
        e["tile"] = ordered_json::array({t.block_rows, t.block_bytes});
        e["tiles"] = std::move(blocks);
      } else {  // 1-D blocks (format 1)
        e["block_bytes"] = t.block_bytes;
        e["blocks"] = std::move(blocks);
      }
    }
    if (t.shard) {
      ordered_json s;
      s["global_shape"] = ShapeJson(t.shard->global_shape);
      s["offsets"] = ShapeJson(t.shard->offsets);
      e["shard"] = std::move(s);
    }
    if (group) e["owner"] = t.owner;
    ts.push_back(std::move(e));
  }
  j["tensors"] = std::move(ts);
  return j.dump(1);
}

absl::StatusOr<Manifest> Manifest::FromJson(std::string_view json, std::string_view source) {
  // nlohmann's lexer takes a NUL byte for the end of input and would ignore what follows.
  if (size_t nul = json.find('\0'); nul != std::string_view::npos) {
    return absl::DataLossError(
        absl::StrFormat("manifest %s has a NUL byte at offset %d", source, nul));
  }
  ordered_json j =
      ordered_json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::DataLossError(
        absl::StrFormat("manifest %s is not a valid JSON object (%d bytes)", source, json.size()));
  }
  Reader r(source);
  Manifest m;
  absl::StatusOr<std::string> format = r.Get<std::string>(j, "format", "");
  if (!format.ok()) return format.status();
  if (*format != kFormat && *format != kGroupFormat) {
    return r.Error(".format", absl::StrFormat("is \"%s\", expected \"%s\" or \"%s\"", *format,
                                              kFormat, kGroupFormat));
  }
  m.group = *format == kGroupFormat;
  absl::StatusOr<uint64_t> version = r.Get<uint64_t>(j, "version", "");
  if (!version.ok()) return version.status();
  m.version = *version;

  auto pub_it = j.find("publisher");
  if (pub_it == j.end() || !pub_it->is_object()) return r.Error(".publisher", "is missing");
  const ordered_json& pub = *pub_it;
  auto host = r.Get<std::string>(pub, "host", ".publisher");
  auto pid = r.Get<int64_t>(pub, "pid", ".publisher");
  auto rank = r.Get<int>(pub, "rank", ".publisher");
  auto world = r.Get<int>(pub, "world_size", ".publisher");
  auto name = r.Get<std::string>(pub, "name", ".publisher");
  for (const absl::Status& s :
       {host.status(), pid.status(), rank.status(), world.status(), name.status()}) {
    if (!s.ok()) return s;
  }
  // A reader sizes per-rank state by world_size: bounded like every other count here.
  if (*world < 1 || *world > kMaxWorldSize) {
    return r.Error(".publisher.world_size",
                   absl::StrFormat("is %d, outside [1, %d]", *world, kMaxWorldSize));
  }
  if (*rank >= *world) {
    return r.Error(".publisher.rank",
                   absl::StrFormat("is %d, not a rank below world_size %d", *rank, *world));
  }
  m.publisher = PublisherIdentity{*host, *pid, *rank, *world, *name, ""};
  if (pub.contains("session")) {  // absent in manifests written before sessions existed
    auto session = r.Get<std::string>(pub, "session", ".publisher");
    if (!session.ok()) return session.status();
    m.publisher.session = *session;
  }

  auto start = r.Get<int64_t>(j, "publish_start_unix_ns", "");
  if (!start.ok()) return start.status();
  m.publish_start_unix_ns = *start;
  auto sealed = r.Get<int64_t>(j, "sealed_unix_ns", "");
  if (!sealed.ok()) return sealed.status();
  m.sealed_unix_ns = *sealed;

  auto md_it = j.find("metadata");
  if (md_it != j.end()) {
    if (!md_it->is_object()) return r.Error(".metadata", "is not an object");
    for (auto it = md_it->begin(); it != md_it->end(); ++it) {
      if (!it.value().is_string()) {
        return r.Error(absl::StrFormat(".metadata[\"%s\"]", it.key()), "is not a string");
      }
      m.metadata[it.key()] = it.value().get<std::string>();
    }
  }

  auto ts_it = j.find("tensors");
  if (ts_it == j.end() || !ts_it->is_array()) return r.Error(".tensors", "is not an array");
  if (ts_it->size() > kMaxTensors) {
    return r.Error(".tensors", absl::StrFormat("has %d entries, more than the limit of %d",
                                               ts_it->size(), kMaxTensors));
  }
  m.tensors.reserve(ts_it->size());
  absl::flat_hash_map<std::string, size_t> seen;  // name -> index
  uint64_t total = 0;
  for (size_t i = 0; i < ts_it->size(); ++i) {
    const ordered_json& e = (*ts_it)[i];
    std::string path = absl::StrFormat(".tensors[%d]", i);
    if (!e.is_object()) return r.Error(path, "is not an object");
    TensorInfo t;
    auto tname = r.Get<std::string>(e, "name", path);
    if (!tname.ok()) return tname.status();
    t.name = *tname;
    if (t.name.empty()) return r.Error(path + ".name", "is empty");
    if (t.name.size() > kMaxTensorNameBytes) {
      return r.Error(path + ".name",
                     absl::StrFormat("is %d bytes long, more than the limit of %d (it starts "
                                     "\"%s\")",
                                     t.name.size(), kMaxTensorNameBytes,
                                     absl::CHexEscape(t.name.substr(0, 64))));
    }
    auto dtype_name = r.Get<std::string>(e, "dtype", path);
    if (!dtype_name.ok()) return dtype_name.status();
    absl::StatusOr<DType> dtype = DTypeFromName(*dtype_name);
    if (!dtype.ok()) return r.Error(path + ".dtype", std::string(dtype.status().message()));
    t.dtype = *dtype;
    auto shape_it = e.find("shape");
    if (shape_it == e.end()) return r.Error(path + ".shape", "is missing");
    auto shape = r.Shape(*shape_it, path + ".shape");
    if (!shape.ok()) return shape.status();
    t.shape = *std::move(shape);
    auto nbytes = r.Get<uint64_t>(e, "nbytes", path);
    if (!nbytes.ok()) return nbytes.status();
    t.nbytes = *nbytes;
    absl::StatusOr<uint64_t> expected = ByteSize(t.dtype, t.shape);
    if (!expected.ok() || *expected != t.nbytes) {
      return r.Error(path + ".nbytes",
                     absl::StrFormat("is %d but tensor \"%s\" of %s %s needs %s", t.nbytes, t.name,
                                     DTypeName(t.dtype), ShapeString(t.shape),
                                     expected.ok() ? std::to_string(*expected)
                                                   : std::string(expected.status().message())));
    }
    if (__builtin_add_overflow(total, t.nbytes, &total)) {
      return r.Error(path + ".nbytes",
                     absl::StrFormat("is %d: the tensors' total size overflows 64 bits", t.nbytes));
    }
    auto xxh = r.Get<std::string>(e, "xxh3", path);
    if (!xxh.ok()) return xxh.status();
    uint64_t h = 0;
    auto [ptr, ec] = std::from_chars(xxh->data(), xxh->data() + xxh->size(), h, 16);
    if (ec != std::errc() || ptr != xxh->data() + xxh->size() || xxh->size() != 16) {
      return r.Error(path + ".xxh3", absl::StrFormat("\"%s\" is not 16 hex digits", *xxh));
    }
    t.xxh3 = h;
    // Block checksums (docs/FORMAT.md, "Block checksums"): tiles (format 2), 1-D blocks (format
    // 1), or none (manifests written before either).
    const bool has_tiles = e.contains("tile"), has_blocks = e.contains("block_bytes");
    if (has_tiles && has_blocks) {
      return r.Error(path, "has both \"tile\" and \"block_bytes\" (one kind of block checksums)");
    }
    if (has_tiles || has_blocks) {
      const char* list = has_tiles ? "tiles" : "blocks";
      if (has_tiles) {
        const ordered_json& tile = e["tile"];
        if (!tile.is_array() || tile.size() != 2) {
          return r.Error(path + ".tile", "is not [rows, bytes]");
        }
        for (int k = 0; k < 2; ++k) {
          auto v = r.Integer<uint64_t>(tile[k], absl::StrFormat("%s.tile[%d]", path, k), 0);
          if (!v.ok()) return v.status();
          if (*v == 0)
            return r.Error(absl::StrFormat("%s.tile[%d]", path, k), "is 0, expected at least 1");
          (k == 0 ? t.block_rows : t.block_bytes) = *v;
        }
      } else {
        auto block_bytes = r.Get<uint64_t>(e, "block_bytes", path);
        if (!block_bytes.ok()) return block_bytes.status();
        if (*block_bytes == 0) return r.Error(path + ".block_bytes", "is 0, expected at least 1");
        t.block_bytes = *block_bytes;
      }
      auto blocks = r.Get<std::string>(e, list, path);
      if (!blocks.ok()) return blocks.status();
      const internal::TileGrid grid = internal::GridOf(t);
      const uint64_t count = grid.count();
      if (blocks->size() / 16 != count || blocks->size() % 16 != 0) {
        return r.Error(
            absl::StrCat(path, ".", list),
            has_tiles
                ? absl::StrFormat("has %d characters, but tensor \"%s\" of %d rows of %d bytes in "
                                  "tiles of %d rows x %d bytes needs %d checksums of 16 hex digits",
                                  blocks->size(), t.name, grid.rows, grid.row_bytes, t.block_rows,
                                  t.block_bytes, count)
                : absl::StrFormat("has %d characters, but tensor \"%s\" of %d bytes in "
                                  "blocks of %d bytes needs %d checksums of 16 hex digits",
                                  blocks->size(), t.name, t.nbytes, t.block_bytes, count));
      }
      t.block_xxh3.reserve(count);
      for (uint64_t k = 0; k < count; ++k) {
        const char* first = blocks->data() + 16 * k;
        uint64_t b = 0;
        auto [end, err] = std::from_chars(first, first + 16, b, 16);
        if (err != std::errc() || end != first + 16 || !IsLowerHex(first)) {
          return r.Error(absl::StrCat(path, ".", list),
                         absl::StrFormat("checksum %d \"%s\" is not 16 hex digits", k,
                                         std::string_view(first, 16)));
        }
        t.block_xxh3.push_back(b);
      }
    }
    auto shard_it = e.find("shard");
    if (shard_it != e.end() && !shard_it->is_null()) {
      if (!shard_it->is_object()) return r.Error(path + ".shard", "is not an object");
      Shard s;
      auto gs_it = shard_it->find("global_shape");
      auto off_it = shard_it->find("offsets");
      if (gs_it == shard_it->end()) return r.Error(path + ".shard.global_shape", "is missing");
      if (off_it == shard_it->end()) return r.Error(path + ".shard.offsets", "is missing");
      auto gs = r.Shape(*gs_it, path + ".shard.global_shape");
      if (!gs.ok()) return gs.status();
      auto off = r.Shape(*off_it, path + ".shard.offsets");
      if (!off.ok()) return off.status();
      s.global_shape = *std::move(gs);
      s.offsets = *std::move(off);
      if (s.global_shape.size() != t.shape.size() || s.offsets.size() != t.shape.size()) {
        return r.Error(path + ".shard",
                       absl::StrFormat("has global_shape %s and offsets %s, which must have the "
                                       "rank of shape %s",
                                       ShapeString(s.global_shape), ShapeString(s.offsets),
                                       ShapeString(t.shape)));
      }
      for (size_t d = 0; d < t.shape.size(); ++d) {
        // Every value is >= 0 (Shape): the difference cannot overflow.
        if (s.offsets[d] > s.global_shape[d] - t.shape[d]) {
          return r.Error(path + ".shard",
                         absl::StrFormat("places shape %s at offsets %s, outside global_shape %s "
                                         "(dimension %d)",
                                         ShapeString(t.shape), ShapeString(s.offsets),
                                         ShapeString(s.global_shape), d));
        }
      }
      t.shard = std::move(s);
    }
    if (m.group) {
      auto owner = r.Get<int>(e, "owner", path);
      if (!owner.ok()) return owner.status();
      if (*owner < 0 || *owner >= m.publisher.world_size) {
        return r.Error(path + ".owner", absl::StrFormat("is %d, not a rank below world_size %d",
                                                        *owner, m.publisher.world_size));
      }
      t.owner = *owner;
    }
    // A name appears once, or in a group version once per owner (each rank's part).
    const std::string key = m.group ? absl::StrCat(t.name, std::string(1, '\0'), t.owner) : t.name;
    if (auto [it, inserted] = seen.emplace(key, i); !inserted) {
      return r.Error(
          path + ".name",
          absl::StrFormat(
              "\"%s\" is also the name of .tensors[%d]%s", absl::CHexEscape(t.name), it->second,
              m.group ? absl::StrFormat(" (both owned by rank %d)", t.owner) : std::string()));
    }
    m.tensors.push_back(std::move(t));
  }
  return m;
}

}  // namespace weightbus

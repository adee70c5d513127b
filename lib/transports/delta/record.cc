// SPDX-License-Identifier: Apache-2.0
// The delta record: the JSON text under the inner manifest's "weightbus.delta" metadata key that
// says what an encoded version is (docs/FORMAT.md), and the target manifests it implies.
#include <algorithm>
#include <charconv>
#include <cstring>

#include "absl/strings/str_format.h"
#include "core/bytes.h"
#include "core/checksum.h"
#include "core/status.h"
#include "core/tiles.h"
#include "nlohmann/json.hpp"
#include "transports/delta/delta_transport.h"

namespace weightbus::internal::delta {
namespace {

using nlohmann::ordered_json;

std::string Hex64(uint64_t v) { return absl::StrFormat("%016x", v); }

bool ParseHex64(const std::string& s, uint64_t* v) {
  if (s.size() != 16) return false;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), *v, 16);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

}  // namespace

uint64_t Fingerprint(const Manifest& manifest) {
  std::string text;
  ByteWriter w(&text);
  w.U64(manifest.tensors.size());
  for (const TensorInfo& t : manifest.tensors) {
    w.Bytes(t.name).U8(0).Bytes(DTypeName(t.dtype)).U8(0).U64(t.shape.size());
    for (int64_t d : t.shape) w.U64(static_cast<uint64_t>(d));
    w.U64(t.xxh3);
  }
  return Xxh3(text.data(), text.size());
}

std::vector<TensorLayout> LayoutOf(const std::vector<TensorInfo>& tensors) {
  std::vector<TensorLayout> out;
  out.reserve(tensors.size());
  for (const TensorInfo& t : tensors) out.push_back(TensorLayout{t.dtype, t.nbytes});
  return out;
}

bool SameLayout(const std::vector<TensorInfo>& a, const std::vector<TensorInfo>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].dtype != b[i].dtype || a[i].shape != b[i].shape ||
        a[i].shard != b[i].shard) {
      return false;
    }
  }
  return true;
}

std::string RecordToJson(const Record& r) {
  ordered_json j;
  j["format"] = kRecordFormat;
  j["kind"] = r.plain ? "plain" : r.keyframe ? "keyframe" : "delta";
  if (!r.keyframe) {
    j["base"] = r.base;
    j["base_fingerprint"] = Hex64(r.base_fingerprint);
  }
  j["keyframe"] = r.keyframe_version;
  j["encoded_bytes"] = r.encoded_bytes;
  if (!r.reason.empty()) j["reason"] = r.reason;
  if (r.plain) {
    j["keep"] = r.keep;  // the tensors are the inner manifest's own
  } else if (r.keyframe) {
    Manifest m;
    m.version = r.version;
    m.tensors = r.tensors;
    ordered_json tensors = ordered_json::parse(m.ToJson())["tensors"];
    j["tensors"] = std::move(tensors);
  } else {
    ordered_json sums = ordered_json::array();
    for (uint64_t x : r.xxh3) sums.push_back(Hex64(x));
    j["xxh3"] = std::move(sums);
    if (!r.tiles.empty()) {
      // Each tensor's tiles as a manifest entry writes them ({"tile": [rows, bytes], "tiles":
      // "..."}; {} for none): optional, older readers ignore the field and verify whole tensors.
      ordered_json tiles = ordered_json::array();
      for (const TensorInfo& t : r.tiles) {
        ordered_json e = ordered_json::object();
        if (t.block_bytes > 0 && t.block_rows > 0) {
          std::string hex;
          hex.reserve(16 * t.block_xxh3.size());
          for (uint64_t b : t.block_xxh3) hex += Hex64(b);
          e["tile"] = ordered_json::array({t.block_rows, t.block_bytes});
          e["tiles"] = std::move(hex);
        }
        tiles.push_back(std::move(e));
      }
      j["tiles"] = std::move(tiles);
    }
  }
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

absl::StatusOr<Record> ParseRecord(const Manifest& inner, std::string_view source) {
  auto it = inner.metadata.find(std::string(kRecordKey));
  if (it == inner.metadata.end()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: version %d was not published through the delta layer (its manifest has no \"%s\" "
        "record); subscribe to it without \"delta+\", or publish with \"delta+\"",
        source, inner.version, kRecordKey));
  }
  auto bad = [&](std::string_view what) {
    return absl::DataLossError(
        absl::StrFormat("%s: the delta record of version %d %s", source, inner.version, what));
  };
  const ordered_json j = ordered_json::parse(it->second, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return bad("is not a JSON object");
  // An unsigned 64-bit field: a JSON integer >= 0 (not a float such as 1.5, 2.0 or 1e30;
  // integers beyond 64 bits are floats to the parser), which get<uint64_t> would convert with
  // undefined behaviour or truncate.
  auto u64 = [&](std::string_view key, uint64_t* out) -> absl::Status {
    auto f = j.find(key);
    if (f == j.end()) return bad(absl::StrFormat("lacks field \"%s\"", key));
    if (!f->is_number_unsigned()) {
      return bad(
          absl::StrFormat("has field \"%s\" = %s, not an integer in [0, 2^64)", key, f->dump()));
    }
    *out = f->get<uint64_t>();
    return absl::OkStatus();
  };
  Record r;
  r.version = inner.version;
  try {
    if (j.value("format", "") != kRecordFormat) {
      return bad(absl::StrFormat("has format \"%s\", expected \"%s\"", j.value("format", ""),
                                 kRecordFormat));
    }
    const std::string kind = j.at("kind").get<std::string>();
    if (kind != "keyframe" && kind != "delta" && kind != "plain") {
      return bad("has an unknown kind");
    }
    r.plain = kind == "plain";
    r.keyframe = kind != "delta";
    WB_RETURN_IF_ERROR(u64("keyframe", &r.keyframe_version));
    WB_RETURN_IF_ERROR(u64("encoded_bytes", &r.encoded_bytes));
    if (auto f = j.find("reason"); f != j.end()) {
      if (!f->is_string()) return bad("has a field \"reason\" that is not a string");
      r.reason = f->get<std::string>();
    }
    if (r.plain) {
      if (r.keyframe_version != r.version) return bad("is a keyframe naming another keyframe");
      r.tensors = inner.tensors;
      if (auto f = j.find("keep"); f != j.end()) {
        if (!f->is_boolean()) return bad("has a field \"keep\" that is not a boolean");
        r.keep = f->get<bool>();
      }
    } else if (r.keyframe) {
      if (r.keyframe_version != r.version) return bad("is a keyframe naming another keyframe");
      Manifest m;
      ordered_json wrapper;
      wrapper["format"] = "weightbus.manifest/1";
      wrapper["version"] = r.version;
      wrapper["publisher"] = {
          {"host", ""}, {"pid", 0}, {"rank", 0}, {"world_size", 1}, {"name", ""}};
      wrapper["publish_start_unix_ns"] = 0;
      wrapper["sealed_unix_ns"] = 0;
      wrapper["total_bytes"] = 0;
      wrapper["metadata"] = ordered_json::object();
      wrapper["tensors"] = j.at("tensors");
      absl::StatusOr<Manifest> parsed =
          Manifest::FromJson(wrapper.dump(), absl::StrFormat("%s (delta record)", source));
      if (!parsed.ok()) return parsed.status();
      r.tensors = std::move(parsed->tensors);
    } else {
      WB_RETURN_IF_ERROR(u64("base", &r.base));
      if (!ParseHex64(j.at("base_fingerprint").get<std::string>(), &r.base_fingerprint)) {
        return bad("has a malformed base_fingerprint");
      }
      if (r.base >= r.version || r.keyframe_version > r.base) {
        return bad(absl::StrFormat("names base %d and keyframe %d, which are not below it", r.base,
                                   r.keyframe_version));
      }
      const ordered_json& sums = j.at("xxh3");
      if (!sums.is_array() || sums.size() > kMaxTensors) {
        return bad(
            absl::StrFormat("has field \"xxh3\" that is %s, not an array of at most %d "
                            "checksums",
                            sums.is_array() ? absl::StrFormat("%d checksums", sums.size())
                                            : std::string(sums.type_name()),
                            kMaxTensors));
      }
      for (const auto& x : sums) {
        uint64_t v = 0;
        if (!x.is_string() || !ParseHex64(x.get<std::string>(), &v)) {
          return bad("has a malformed checksum");
        }
        r.xxh3.push_back(v);
      }
      if (auto f = j.find("tiles"); f != j.end()) {
        if (!f->is_array() || f->size() != sums.size()) {
          return bad(absl::StrFormat("has field \"tiles\" that is not an array of %d entries",
                                     sums.size()));
        }
        for (const auto& e : *f) {
          if (!e.is_object()) return bad("has an entry of \"tiles\" that is not an object");
          TensorInfo t;
          if (e.contains("tile")) {
            const ordered_json& tile = e.at("tile");
            if (!tile.is_array() || tile.size() != 2 || !tile[0].is_number_unsigned() ||
                !tile[1].is_number_unsigned() || tile[0].get<uint64_t>() == 0 ||
                tile[1].get<uint64_t>() == 0) {
              return bad("has an entry of \"tiles\" whose \"tile\" is not [rows, bytes]");
            }
            t.block_rows = tile[0].get<uint64_t>();
            t.block_bytes = tile[1].get<uint64_t>();
            const std::string hex = e.at("tiles").get<std::string>();
            if (hex.size() % 16 != 0) return bad("has a malformed tile checksum");
            for (size_t k = 0; k < hex.size(); k += 16) {
              uint64_t v = 0;
              if (!ParseHex64(hex.substr(k, 16), &v)) return bad("has a malformed tile checksum");
              t.block_xxh3.push_back(v);
            }
          }
          r.tiles.push_back(std::move(t));
        }
      }
    }
  } catch (const std::exception& e) {
    return bad(absl::StrFormat("is malformed (%s)", e.what()));
  }
  if (r.plain) {
    if (inner.total_bytes() != r.encoded_bytes) {
      return bad(absl::StrFormat("says %d bytes, but its tensors hold %d", r.encoded_bytes,
                                 inner.total_bytes()));
    }
    return r;
  }
  if (inner.tensors.size() != 1 || inner.tensors[0].name != kBlobName ||
      inner.tensors[0].dtype != DType::kU8 || inner.tensors[0].nbytes != r.encoded_bytes) {
    return bad(
        absl::StrFormat("does not match its tensors (expected one U8 tensor \"%s\" of "
                        "%d bytes)",
                        kBlobName, r.encoded_bytes));
  }
  return r;
}

namespace {
constexpr std::string_view kRankPrefix = "weightbus.delta.rank-";
}  // namespace

std::string RankRecordKey(int rank) { return std::string(kRankPrefix) + std::to_string(rank); }
std::string RankBlobName(int rank) { return RankRecordKey(rank); }
bool IsRankRecordKey(std::string_view key) { return key.starts_with(kRankPrefix); }

absl::StatusOr<Manifest> RankPart(const Manifest& group, int rank, std::string_view source) {
  bool any_record = false;
  Manifest m;
  m.version = group.version;
  m.publisher = group.publisher;
  m.publish_start_unix_ns = group.publish_start_unix_ns;
  m.sealed_unix_ns = group.sealed_unix_ns;
  for (const auto& [key, value] : group.metadata) {
    if (IsRankRecordKey(key)) {
      any_record = true;
    } else {
      m.metadata.emplace(key, value);
    }
  }
  if (!any_record) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: version %d was not published through the delta layer (its group manifest has no "
        "\"%s<rank>\" records); subscribe to it without \"delta+\", or publish with \"delta+\"",
        source, group.version, kRankPrefix));
  }
  auto record = group.metadata.find(RankRecordKey(rank));
  const std::string blob = RankBlobName(rank);
  auto t = std::find_if(group.tensors.begin(), group.tensors.end(),
                        [&](const TensorInfo& t) { return t.name == blob && t.owner == rank; });
  if (record == group.metadata.end() || t == group.tensors.end()) {
    return absl::DataLossError(absl::StrFormat(
        "%s: group version %d (world_size %d) lacks the delta %s of rank %d (\"%s\")", source,
        group.version, group.publisher.world_size,
        record == group.metadata.end() ? "record" : "blob", rank, blob));
  }
  m.metadata[std::string(kRecordKey)] = record->second;
  TensorInfo part = *t;
  part.name = std::string(kBlobName);
  part.owner = 0;
  m.tensors.push_back(std::move(part));
  return m;
}

absl::StatusOr<Manifest> TargetManifest(const Manifest& inner, const Record& record,
                                        const Manifest* base) {
  Manifest m;
  m.version = inner.version;
  m.publisher = inner.publisher;
  m.publish_start_unix_ns = inner.publish_start_unix_ns;
  m.sealed_unix_ns = inner.sealed_unix_ns;
  m.metadata = inner.metadata;
  m.metadata.erase(std::string(kRecordKey));
  m.metadata.erase(std::string(kLayerMetadataKey));
  if (record.keyframe) {
    m.tensors = record.tensors;
    return m;
  }
  if (base == nullptr || record.xxh3.size() != base->tensors.size()) {
    return absl::DataLossError(absl::StrFormat(
        "the delta record of version %d lists %d checksums, but its base version %d has %d "
        "tensors",
        record.version, record.xxh3.size(), record.base,
        base == nullptr ? 0 : base->tensors.size()));
  }
  m.tensors = base->tensors;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    TensorInfo& t = m.tensors[i];
    t.xxh3 = record.xxh3[i];
    // The base's block checksums are not the target's: the record's, or none.
    t.block_rows = record.tiles.empty() ? 0 : record.tiles[i].block_rows;
    t.block_bytes = record.tiles.empty() ? 0 : record.tiles[i].block_bytes;
    t.block_xxh3 = record.tiles.empty() ? std::vector<uint64_t>{} : record.tiles[i].block_xxh3;
    if (t.block_xxh3.size() != GridOf(t).count()) {
      return absl::DataLossError(absl::StrFormat(
          "the delta record of version %d gives tensor \"%s\" (%s) %d tile checksums for tiles "
          "of %d rows x %d bytes, which make %d",
          record.version, t.name, ShapeString(t.shape), t.block_xxh3.size(), t.block_rows,
          t.block_bytes, GridOf(t).count()));
    }
  }
  return m;
}

}  // namespace weightbus::internal::delta

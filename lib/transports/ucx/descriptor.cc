// SPDX-License-Identifier: Apache-2.0
#include "transports/ucx/descriptor.h"

#include "absl/strings/str_format.h"
#include "core/bytes.h"
#include "core/checksum.h"
#include "core/secret.h"

namespace weightbus::internal::ucx {
namespace {

// Reads one record's fields in order; the first failure is kept (later reads return 0 or empty)
// and reported by Done, worded with the record's name and size (as the control messages').
class Fields {
 public:
  Fields(std::string_view record, std::string_view bytes)
      : record_(record), size_(bytes.size()), r_(bytes) {}

  uint64_t U64(std::string_view what) { return Keep(r_.U64(what)); }
  uint32_t U32(std::string_view what) { return Keep(r_.U32(what)); }
  std::string Str(std::string_view what) {
    const uint32_t n = U32(absl::StrFormat("%s's length", what));
    if (!status_.ok()) return {};
    return std::string(Keep(r_.View(n, what)));
  }
  // A count of elements of at least `min_bytes` each: more than the rest can hold is refused
  // before anything is allocated for them.
  uint32_t Count(std::string_view what, size_t min_bytes) {
    const uint32_t n = U32(absl::StrFormat("the number of %s", what));
    if (status_.ok() && uint64_t{n} * min_bytes > r_.remaining()) {
      status_ = absl::DataLossError(
          absl::StrFormat("claims %d %s of at least %d bytes each but only %d bytes remain", n,
                          what, min_bytes, r_.remaining()));
      return 0;
    }
    return n;
  }
  std::vector<uint64_t> U64s(std::string_view what) {
    const uint32_t n = Count(what, 8);
    std::vector<uint64_t> out;
    out.reserve(n);
    for (uint32_t k = 0; k < n && ok(); ++k) out.push_back(U64(what));
    return out;
  }
  bool ok() const { return status_.ok(); }
  void Fail(std::string why) {
    if (status_.ok()) status_ = absl::DataLossError(std::move(why));
  }

  template <typename T>
  absl::StatusOr<T> Done(T record) {
    if (status_.ok() && !r_.at_end()) {
      status_ =
          absl::DataLossError(absl::StrFormat("%d bytes follow the last field", r_.remaining()));
    }
    if (!status_.ok()) {
      return absl::DataLossError(
          absl::StrFormat("malformed %s (%d bytes): %s", record_, size_, status_.message()));
    }
    return record;
  }

 private:
  template <typename T>
  T Keep(absl::StatusOr<T> v) {
    if (!status_.ok()) return T{};
    if (v.ok()) return *v;
    status_ = v.status();
    return T{};
  }

  std::string_view record_;
  size_t size_;
  ByteReader r_;
  absl::Status status_;
};

using Out = BasicByteWriter<std::string>;

void U64s(Out& w, const std::vector<uint64_t>& values) {
  w.U32(static_cast<uint32_t>(values.size()));
  for (uint64_t v : values) w.U64(v);
}

void Str(Out& w, std::string_view s) { w.U32(static_cast<uint32_t>(s.size())).Bytes(s); }

}  // namespace

std::string EncodeHeader(const DescriptorHeader& h) {
  std::string out;
  Out w(&out);
  w.U64(h.magic).U64(h.version).U64(h.state).U64(h.nchunks);
  w.U64(h.layout_offset).U64(h.layout_bytes).U64(h.seal_offset).U64(h.seal_bytes);
  return out;
}

absl::StatusOr<DescriptorHeader> DecodeHeader(std::string_view bytes, uint64_t magic) {
  if (bytes.size() != kDescriptorHeaderBytes) {
    return absl::DataLossError(
        absl::StrFormat("malformed version descriptor header: %d bytes, expected %d", bytes.size(),
                        kDescriptorHeaderBytes));
  }
  DescriptorHeader h;
  const char* p = bytes.data();
  h.magic = LoadLe<uint64_t>(p);
  h.version = LoadLe<uint64_t>(p + 8);
  h.state = LoadLe<uint64_t>(p + 16);
  h.nchunks = LoadLe<uint64_t>(p + 24);
  h.layout_offset = LoadLe<uint64_t>(p + 32);
  h.layout_bytes = LoadLe<uint64_t>(p + 40);
  h.seal_offset = LoadLe<uint64_t>(p + 48);
  h.seal_bytes = LoadLe<uint64_t>(p + 56);
  if (h.magic != magic) {
    return absl::DataLossError(absl::StrFormat(
        "malformed version descriptor header: magic %016x, expected %016x", h.magic, magic));
  }
  return h;
}

std::string EncodeLayout(const VersionLayout& l) {
  std::string out;
  Out w(&out);
  w.U64(l.version).U64(l.chunk_bytes).U64(l.data_bytes);
  w.U32(static_cast<uint32_t>(l.regions.size()));
  for (const LayoutRegion& r : l.regions) {
    w.U64(r.id).U64(r.base).U64(r.address).U64(r.length);
    Str(w, r.rkey);
    w.U64(r.flags);
  }
  U64s(w, l.offsets);
  w.U32(static_cast<uint32_t>(l.members.size()));
  for (const GroupMember& g : l.members) {
    Str(w, g.host);
    w.U32(g.port);
  }
  U64s(w, l.live);
  Str(w, l.manifest_json);
  w.U64(l.pid);
  return out;
}

absl::StatusOr<VersionLayout> DecodeLayout(std::string_view bytes) {
  Fields f("version layout", bytes);
  VersionLayout l;
  l.version = f.U64("the version");
  l.chunk_bytes = f.U64("the chunk size");
  l.data_bytes = f.U64("the data size");
  // A region is at least its five u64 and the rkey's length.
  const uint32_t nregions = f.Count("regions", 5 * 8 + 4);
  l.regions.reserve(nregions);
  for (uint32_t k = 0; k < nregions && f.ok(); ++k) {
    LayoutRegion r;
    const std::string at = absl::StrFormat("region %d", k);
    r.id = f.U64(at + " id");
    r.base = f.U64(at + " base");
    r.address = f.U64(at + " address");
    r.length = f.U64(at + " length");
    r.rkey = f.Str(at + " rkey");
    r.flags = f.U64(at + " flags");
    l.regions.push_back(std::move(r));
  }
  l.offsets = f.U64s("tensor offsets");
  const uint32_t nmembers = f.Count("group members", 4 + 4);
  for (uint32_t k = 0; k < nmembers && f.ok(); ++k) {
    GroupMember g;
    g.host = f.Str(absl::StrFormat("member %d host", k));
    g.port = f.U32(absl::StrFormat("member %d port", k));
    l.members.push_back(std::move(g));
  }
  l.live = f.U64s("live region ids");
  l.manifest_json = f.Str("the manifest");
  l.pid = f.U64("the pid");
  if (f.ok() && l.chunk_bytes < 4096) {
    f.Fail(absl::StrFormat("chunk size %d is below 4096", l.chunk_bytes));
  }
  return f.Done(std::move(l));
}

std::string EncodeSeal(const VersionSeal& s) {
  std::string out;
  Out w(&out);
  w.U64(s.version).U64(static_cast<uint64_t>(s.sealed_unix_ns));
  Str(w, s.mac);
  w.U32(static_cast<uint32_t>(s.tensors.size()));
  for (const TensorSeal& t : s.tensors) {
    w.U64(t.xxh3).U64(t.block_bytes).U64(t.block_rows);
    U64s(w, t.blocks);
  }
  return out;
}

absl::StatusOr<VersionSeal> DecodeSeal(std::string_view bytes) {
  Fields f("version seal", bytes);
  VersionSeal s;
  s.version = f.U64("the version");
  s.sealed_unix_ns = static_cast<int64_t>(f.U64("the sealed time"));
  s.mac = f.Str("the MAC");
  const uint32_t n = f.Count("tensors", 8 + 8 + 8 + 4);
  s.tensors.reserve(n);
  for (uint32_t k = 0; k < n && f.ok(); ++k) {
    TensorSeal t;
    t.xxh3 = f.U64(absl::StrFormat("tensor %d checksum", k));
    t.block_bytes = f.U64(absl::StrFormat("tensor %d block size", k));
    t.block_rows = f.U64(absl::StrFormat("tensor %d tile rows", k));
    t.blocks = f.U64s(absl::StrFormat("tensor %d block checksums", k));
    s.tensors.push_back(std::move(t));
  }
  return f.Done(std::move(s));
}

Manifest Unsealed(Manifest m) {
  for (TensorInfo& t : m.tensors) {
    t.xxh3 = 0;
    t.block_bytes = 0;
    t.block_rows = 0;
    t.block_xxh3.clear();
  }
  m.sealed_unix_ns = 0;
  m.metadata.erase(std::string(kMacMetadataKey));
  return m;
}

VersionSeal SealOf(const Manifest& m) {
  VersionSeal s;
  s.version = m.version;
  s.sealed_unix_ns = m.sealed_unix_ns;
  if (auto mac = m.metadata.find(std::string(kMacMetadataKey)); mac != m.metadata.end()) {
    s.mac = mac->second;
  }
  s.tensors.reserve(m.tensors.size());
  for (const TensorInfo& t : m.tensors)
    s.tensors.push_back({t.xxh3, t.block_bytes, t.block_rows, t.block_xxh3});
  return s;
}

absl::StatusOr<Manifest> ApplySeal(Manifest m, const VersionSeal& seal) {
  if (seal.version != m.version || seal.tensors.size() != m.tensors.size()) {
    return absl::DataLossError(absl::StrFormat(
        "the seal of version %d with %d tensors does not fit version %d's manifest of %d "
        "tensors",
        seal.version, seal.tensors.size(), m.version, m.tensors.size()));
  }
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    TensorInfo& t = m.tensors[i];
    const TensorSeal& s = seal.tensors[i];
    TensorInfo cut = t;
    cut.block_bytes = s.block_bytes;
    cut.block_rows = s.block_rows;
    if ((s.block_rows > 0 && s.block_bytes == 0) ||
        s.blocks.size() != (s.block_bytes == 0 ? 0 : GridOf(cut).count())) {
      return absl::DataLossError(absl::StrFormat(
          "the seal of version %d gives tensor \"%s\" of %d bytes %d block checksums for tiles "
          "of %d rows x %d bytes (0 rows: 1-D blocks)",
          m.version, t.name, t.nbytes, s.blocks.size(), s.block_rows, s.block_bytes));
    }
    t.xxh3 = s.xxh3;
    t.block_bytes = s.block_bytes;
    t.block_rows = s.block_rows;
    t.block_xxh3 = s.blocks;
  }
  m.sealed_unix_ns = seal.sealed_unix_ns;
  if (!seal.mac.empty()) m.metadata[std::string(kMacMetadataKey)] = seal.mac;
  return m;
}

uint64_t SealCapacity(const Manifest& m, absl::Span<const TileGrid> grids) {
  uint64_t n = 8 + 8 + 4 + 128 + 4;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    n += 8 + 8 + 8 + 4 + 8 * (i < grids.size() ? grids[i].count() : 0);
  }
  return n;
}

}  // namespace weightbus::internal::ucx

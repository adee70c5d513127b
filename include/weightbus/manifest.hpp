// SPDX-License-Identifier: Apache-2.0
// The manifest: what one published version contains, transport-neutral.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "weightbus/export.h"
#include "weightbus/types.hpp"

namespace weightbus {

// User metadata attached to a version: UTF-8 string keys and values, carried verbatim.
using Metadata = std::map<std::string, std::string>;

// One tensor of a version as described by its manifest.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // elements; empty for 0-d
  std::optional<Shard> shard;  // set when the publisher described a shard
  uint64_t nbytes = 0;         // = DTypeSize(dtype) * NumElements(shape), contiguous row-major
  uint64_t xxh3 = 0;           // XXH3-64 (seed 0) of the nbytes contiguous bytes
  // The rank of the publisher group that owns (published, stores and serves) these bytes
  // (setting `rank`); 0 for a single publisher. In a group version (Manifest::group)
  // the manifest lists every rank's parts: a name appears once per owner, each entry a whole
  // tensor or a Shard of it, and replicated parts (the same slice from several ranks) carry
  // equal checksums. Format weightbus.manifest/2 (docs/FORMAT.md).
  int owner = 0;
  // Block checksums, so that a reader of some byte ranges (a TP worker reading its slices)
  // verifies exactly the bytes it read (docs/FORMAT.md, "Block checksums"):
  //  - tiles (block_rows > 0, checksum format 2, what publishers write): the tensor seen as the
  //    rows of its last dimension (one row of all its bytes for 0-d, 1-D and sub-byte-row
  //    tensors) is cut into tiles of block_rows rows by block_bytes bytes of each row, the last
  //    band and column shorter; block_xxh3 is the XXH3-64 of each tile's bytes in row-major
  //    order, band by band, column by column within a band. A row-parallel slice (the same
  //    columns of every row) then reads only its tiles;
  //  - 1-D blocks (block_rows 0, block_bytes > 0, format 1, manifests written before tiles):
  //    XXH3-64 of each run of block_bytes bytes of the contiguous image, in order, the last one
  //    shorter (ceil(nbytes / block_bytes) entries);
  //  - none (block_bytes 0 and no entries: a manifest written before block checksums, or by a
  //    publisher with checksum_block=0): the tensor is read and verified whole.
  // Setting `checksum_block` (the largest tile, in bytes).
  uint64_t block_bytes = 0;
  uint64_t block_rows = 0;
  std::vector<uint64_t> block_xxh3 = {};
  friend bool operator==(const TensorInfo&, const TensorInfo&) = default;
};

// Who published a version.
struct PublisherIdentity {
  std::string host;  // gethostname()
  int64_t pid = 0;
  int rank = 0;        // trainer rank that published (setting `rank`)
  int world_size = 1;  // number of trainer ranks (setting `world_size`)
  std::string name;    // free-form label (setting `publisher_name`), may be empty
  // The publishing session: 16 lowercase hex digits, random per Publisher::Open. Within one
  // channel a version number names one content; a subscriber offered a version number it holds
  // with other content (a restarted publisher reusing numbers) refuses it naming both sessions.
  // Empty in manifests written before sessions existed.
  std::string session;
  friend bool operator==(const PublisherIdentity&, const PublisherIdentity&) = default;
};

// Everything a subscriber needs to know about a version before receiving its bytes.
//
// A group version (`group`, published by a publisher group: every rank opens
// with the settings `rank` and `world_size` and publishes the parts it owns) lists in `tensors`
// the parts of every rank, each with its `owner`; `publisher` is the rank that committed the
// group. Subscribers receive each tensor assembled from its parts (Update::tensors()).
// Value type; copying is cheap relative to the weights it describes.
struct WB_EXPORT Manifest {
  uint64_t version = 0;
  std::vector<TensorInfo> tensors;  // in publish order
  PublisherIdentity publisher;
  int64_t publish_start_unix_ns = 0;  // when Publish was called (CLOCK_REALTIME, ns)
  int64_t sealed_unix_ns = 0;         // when every checksum was known (CLOCK_REALTIME, ns)
  Metadata metadata;
  // True for a version of a publisher group (and for one rank's part of it): its tensors are
  // parts with owners, and a name may appear once per owner. Format weightbus.manifest/2.
  bool group = false;

  // Sum of every tensor's nbytes (of a group version: of every part, replicas included).
  uint64_t total_bytes() const;
  // The tensor named `name`, or nullptr. Linear in the number of tensors.
  const TensorInfo* Find(std::string_view name) const;

  // JSON encoding (format "weightbus.manifest/1", or "weightbus.manifest/2" for a group
  // version, whose tensors carry "owner"; documented in docs/FORMAT.md). Checksums are
  // 16 lowercase hex digits so that no JSON reader loses precision.
  std::string ToJson() const;
  // Parses ToJson's output (either format). `source` names where the text came from, for
  // error messages.
  // Errors: DataLoss naming `source` and the offending field: a missing or ill-typed field, a
  // byte size that does not match dtype and shape (or overflows 64 bits, alone or summed over
  // the tensors), an empty name, a name given twice (in a group version: twice by one owner), a
  // shard whose ranks differ from the shape's or that lies outside its global shape, and the
  // limits of types.hpp (kMaxTensors, kMaxTensorNameBytes, kMaxRank), with the value found and
  // the limit.
  static absl::StatusOr<Manifest> FromJson(std::string_view json, std::string_view source);

  friend bool operator==(const Manifest&, const Manifest&) = default;
};

}  // namespace weightbus

// SPDX-License-Identifier: Apache-2.0
#include "core/parts.h"

#include <algorithm>
#include <map>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/secret.h"
#include "core/status.h"

namespace weightbus::internal {
namespace {

// "rank 1 ([4, 8] at [0, 8])", for messages.
std::string Slice(const TensorInfo& p) {
  return absl::StrFormat("rank %d (%s at %s)", p.owner, ShapeString(p.shape),
                         ShapeString(Offsets(p)));
}

bool Overlap(const TensorInfo& a, const TensorInfo& b) {
  const std::vector<int64_t> oa = Offsets(a), ob = Offsets(b);
  for (size_t d = 0; d < a.shape.size(); ++d) {
    if (oa[d] >= ob[d] + b.shape[d] || ob[d] >= oa[d] + a.shape[d]) return false;
  }
  return true;
}

}  // namespace

const std::vector<int64_t>& GlobalShape(const TensorInfo& part) {
  return part.shard ? part.shard->global_shape : part.shape;
}

std::vector<int64_t> Offsets(const TensorInfo& part) {
  return part.shard ? part.shard->offsets : std::vector<int64_t>(part.shape.size(), 0);
}

std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

std::optional<uint64_t> ContiguousOffset(const TensorInfo& part) {
  const std::vector<int64_t>& global = GlobalShape(part);
  const std::vector<int64_t> offsets = Offsets(part);
  // Dimensions of size 1 lead; after the first larger one, every dimension is whole.
  size_t d = 0;
  while (d < part.shape.size() && part.shape[d] == 1) ++d;
  for (size_t k = d + 1; k < part.shape.size(); ++k) {
    if (part.shape[k] != global[k]) return std::nullopt;
  }
  const std::vector<int64_t> strides = RowMajorStrides(global);
  uint64_t element = 0;
  for (size_t k = 0; k < offsets.size(); ++k) element += offsets[k] * strides[k];
  const uint64_t bits = element * DTypeBits(part.dtype);
  if (bits % 8 != 0) return std::nullopt;
  return bits / 8;
}

absl::StatusOr<std::vector<AssembledTensor>> AssembleParts(const std::vector<TensorInfo>& parts,
                                                           int world_size) {
  std::vector<AssembledTensor> out;
  absl::flat_hash_map<std::string, size_t> index;
  std::vector<std::vector<size_t>> all;  // every part of each tensor, replicas included
  for (size_t i = 0; i < parts.size(); ++i) {
    const TensorInfo& p = parts[i];
    if (p.owner < 0 || p.owner >= world_size) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor \"%s\": owner rank %d is not in [0, world_size=%d)", p.name,
                          p.owner, world_size));
    }
    const std::vector<int64_t>& global = GlobalShape(p);
    const std::vector<int64_t> offsets = Offsets(p);
    if (global.size() != p.shape.size() || offsets.size() != p.shape.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor \"%s\" of rank %d: slice %s, global shape %s and offsets %s differ in rank",
          p.name, p.owner, ShapeString(p.shape), ShapeString(global), ShapeString(offsets)));
    }
    for (size_t d = 0; d < p.shape.size(); ++d) {
      if (offsets[d] < 0 || p.shape[d] < 0 || offsets[d] > global[d] - p.shape[d]) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "tensor \"%s\": the slice of %s does not fit in global shape %s (dimension %d)", p.name,
            Slice(p), ShapeString(global), d));
      }
    }
    auto [it, inserted] = index.emplace(p.name, out.size());
    if (inserted) {
      absl::StatusOr<uint64_t> nbytes = ByteSize(p.dtype, global);
      if (!nbytes.ok()) {
        return absl::InvalidArgumentError(absl::StrFormat("tensor \"%s\" of global shape %s: %s",
                                                          p.name, ShapeString(global),
                                                          nbytes.status().message()));
      }
      out.push_back(AssembledTensor{p.name, p.dtype, global, *nbytes, {}});
      all.emplace_back();
    }
    AssembledTensor& t = out[it->second];
    const TensorInfo& first = parts[all[it->second].empty() ? i : all[it->second].front()];
    if (p.dtype != t.dtype || global != t.shape) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor \"%s\": ranks disagree on it: rank %d publishes %s of global shape %s, rank %d "
          "%s of global shape %s",
          p.name, first.owner, DTypeName(t.dtype), ShapeString(t.shape), p.owner,
          DTypeName(p.dtype), ShapeString(global)));
    }
    all[it->second].push_back(i);
  }

  for (size_t k = 0; k < out.size(); ++k) {
    AssembledTensor& t = out[k];
    uint64_t covered = 0;
    for (size_t i : all[k]) {
      const TensorInfo& p = parts[i];
      if (NumElements(p.shape).value_or(0) == 0) continue;  // no elements: nothing to place
      bool replica = false;
      for (size_t j : t.parts) {
        const TensorInfo& q = parts[j];
        if (!Overlap(p, q)) continue;
        if (p.shape == q.shape && Offsets(p) == Offsets(q)) {
          if (p.xxh3 != q.xxh3) {
            return absl::InvalidArgumentError(absl::StrFormat(
                "tensor \"%s\": %s and %s publish the same slice with different bytes (XXH3-64 "
                "%016x vs %016x); replicated parts must be identical",
                t.name, Slice(q), Slice(p), q.xxh3, p.xxh3));
          }
          replica = true;
          break;
        }
        return absl::InvalidArgumentError(absl::StrFormat(
            "tensor \"%s\" of global shape %s: the slices of %s and %s overlap; ranks may "
            "share only whole replicated slices",
            t.name, ShapeString(t.shape), Slice(q), Slice(p)));
      }
      if (replica) continue;
      if (IsSubByte(t.dtype) && !ContiguousOffset(p)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "tensor \"%s\" (%s): the slice of %s is not a byte-aligned run of whole rows; "
            "sub-byte tensors are split only into such runs",
            t.name, DTypeName(t.dtype), Slice(p)));
      }
      t.parts.push_back(i);
      covered += static_cast<uint64_t>(NumElements(p.shape).value_or(0));
    }
    const uint64_t total = static_cast<uint64_t>(NumElements(t.shape).value_or(0));
    if (covered != total) {
      std::vector<std::string> slices;
      for (size_t i : all[k]) slices.push_back(Slice(parts[i]));
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor \"%s\" of global shape %s: its parts cover %d of its %d elements (a gap): %s; "
          "every element must be published by some rank",
          t.name, ShapeString(t.shape), covered, total, absl::StrJoin(slices, ", ")));
    }
  }
  return out;
}

absl::StatusOr<Manifest> MergeGroupParts(uint64_t version, const std::vector<Manifest>& parts,
                                         int committer) {
  Manifest m;
  m.version = version;
  m.group = true;
  m.publisher = parts[committer].publisher;
  m.publish_start_unix_ns = parts[0].publish_start_unix_ns;
  std::map<std::string, int> metadata_from;  // key -> the rank that gave its value first
  for (const Manifest& part : parts) {
    m.publish_start_unix_ns = std::min(m.publish_start_unix_ns, part.publish_start_unix_ns);
    m.sealed_unix_ns = std::max(m.sealed_unix_ns, part.sealed_unix_ns);
    m.tensors.insert(m.tensors.end(), part.tensors.begin(), part.tensors.end());
    for (const auto& [key, value] : part.metadata) {
      if (key == kMacMetadataKey) continue;  // each rank's own; a committer MACs the whole
      auto [it, inserted] = m.metadata.emplace(key, value);
      if (inserted) {
        metadata_from[key] = part.publisher.rank;
      } else if (it->second != value) {
        return absl::InvalidArgumentError(
            absl::StrFormat("metadata \"%s\" is \"%s\" from rank %d but \"%s\" from rank %d", key,
                            it->second, metadata_from[key], value, part.publisher.rank));
      }
    }
  }
  WB_RETURN_IF_ERROR(AssembleParts(m.tensors, static_cast<int>(parts.size())).status());
  return m;
}

}  // namespace weightbus::internal

// SPDX-License-Identifier: Apache-2.0
#include "transports/delta/chunk_store.h"

#include <algorithm>
#include <cstring>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "core/status.h"

namespace weightbus::internal::delta {

absl::StatusOr<ChunkStore> ChunkStore::Create(absl::Span<const TensorLayout> layout,
                                              uint64_t chunk_size, std::vector<bool> wanted) {
  ChunkStore s;
  s.layout_.assign(layout.begin(), layout.end());
  s.chunk_size_ = chunk_size;
  s.chunks_ = PlanChunks(layout, chunk_size);
  wanted.resize(s.chunks_.size(), false);
  s.held_ = std::move(wanted);
  s.offsets_.assign(s.chunks_.size(), 0);
  uint64_t total = 0;
  for (size_t c = 0; c < s.chunks_.size(); ++c) {
    if (!s.held_[c]) continue;
    s.offsets_[c] = total;
    total += (s.chunks_[c].bytes + 63) & ~uint64_t{63};
  }
  WB_ASSIGN_OR_RETURN(s.buffer_, HostBuffer::Allocate(total));
  s.index_.resize(layout.size());
  for (size_t c = 0; c < s.chunks_.size(); ++c) {
    uint64_t in_chunk = 0;
    for (const Piece& p : s.chunks_[c].pieces) {
      s.index_[p.tensor].push_back(At{p.offset, c, in_chunk, p.bytes});
      in_chunk += p.bytes;
    }
  }
  for (std::vector<At>& pieces : s.index_) {
    std::sort(pieces.begin(), pieces.end(),
              [](const At& a, const At& b) { return a.offset < b.offset; });
  }
  return s;
}

bool ChunkStore::HasAll(const std::vector<bool>& wanted) const {
  if (wanted.size() != held_.size()) return false;
  for (size_t c = 0; c < wanted.size(); ++c) {
    if (wanted[c] && !held_[c]) return false;
  }
  return true;
}

absl::Status ChunkStore::CopyOut(const TensorRange& r, std::byte* dst) const {
  if (r.length == 0) return absl::OkStatus();
  const std::vector<At>& pieces = index_.at(r.tensor);
  // The last piece starting at or before r.offset.
  auto it = std::upper_bound(pieces.begin(), pieces.end(), r.offset,
                             [](uint64_t o, const At& a) { return o < a.offset; });
  if (it == pieces.begin()) {
    return absl::InternalError(
        absl::StrFormat("tensor %d has no chunk at byte %d", r.tensor, r.offset));
  }
  --it;
  uint64_t at = r.offset, left = r.length;
  for (; left > 0 && it != pieces.end(); ++it) {
    if (!held_[it->chunk]) {
      return absl::InternalError(absl::StrFormat(
          "bytes [%d, %d) of tensor %d lie in chunk %d, which this subscriber did not decode", at,
          at + left, r.tensor, it->chunk));
    }
    const uint64_t skip = at - it->offset;
    const uint64_t n = std::min(left, it->bytes - skip);
    std::memcpy(dst, chunk(it->chunk) + it->in_chunk + skip, n);
    dst += n;
    at += n;
    left -= n;
  }
  if (left > 0) {
    return absl::InternalError(absl::StrFormat("bytes [%d, %d) of tensor %d are beyond its chunks",
                                               at, at + left, r.tensor));
  }
  return absl::OkStatus();
}

std::vector<bool> ChunksMeeting(absl::Span<const TensorLayout> layout, uint64_t chunk_size,
                                absl::Span<const TensorRange> ranges) {
  const std::vector<Chunk> chunks = PlanChunks(layout, chunk_size);
  // Per tensor, its pieces' (offset, end, chunk).
  struct At {
    uint64_t offset, end;
    size_t chunk;
  };
  std::vector<std::vector<At>> index(layout.size());
  for (size_t c = 0; c < chunks.size(); ++c) {
    for (const Piece& p : chunks[c].pieces)
      index[p.tensor].push_back({p.offset, p.offset + p.bytes, c});
  }
  std::vector<bool> meets(chunks.size(), false);
  for (const TensorRange& r : ranges) {
    if (r.length == 0 || r.tensor >= index.size()) continue;
    for (const At& a : index[r.tensor]) {  // a tensor's pieces are few (its bytes / chunk_size)
      if (a.offset < r.offset + r.length && r.offset < a.end) meets[a.chunk] = true;
    }
  }
  return meets;
}

absl::Status DecodeChunks(absl::Span<const std::byte> bytes, const VersionIds& expected,
                          const ChunkStore* base, ChunkStore& out, Parallel& parallel) {
  WB_ASSIGN_OR_RETURN(VersionHeader h, ParseHeader(bytes));
  if (h.ids != expected) {
    return absl::DataLossError(absl::StrFormat(
        "encoded version says %s %d (base %d, keyframe %d) but %s %d (base %d, keyframe %d) was "
        "expected",
        h.ids.keyframe ? "keyframe" : "delta", h.ids.target, h.ids.base, h.ids.keyframe_version,
        expected.keyframe ? "keyframe" : "delta", expected.target, expected.base,
        expected.keyframe_version));
  }
  const std::vector<TensorLayout>& layout = out.layout();
  if (h.tensor_count != layout.size()) {
    return absl::DataLossError(absl::StrFormat(
        "encoded version has %d tensors but its manifest lists %d", h.tensor_count, layout.size()));
  }
  if (h.layout_checksum != LayoutChecksum(layout)) {
    return absl::DataLossError(absl::StrFormat(
        "encoded version was made for other tensor dtypes or sizes than its manifest's (layout "
        "checksum %016x, manifest's %016x)",
        h.layout_checksum, LayoutChecksum(layout)));
  }
  if (h.chunk_size != out.chunk_size() || out.chunks().size() != h.record_sizes.size()) {
    return absl::DataLossError(absl::StrFormat(
        "encoded version has %d chunks of %d bytes but its manifest's tensors make %d chunks of "
        "%d bytes",
        h.record_sizes.size(), h.chunk_size, out.chunks().size(), out.chunk_size()));
  }
  if (!h.ids.keyframe && (base == nullptr || base->chunk_size() != out.chunk_size() ||
                          base->layout() != out.layout())) {
    return absl::InternalError("a delta decoded partially without a base of the same chunks");
  }
  std::vector<uint64_t> offsets(h.record_sizes.size());
  uint64_t at = h.header_bytes;
  for (size_t c = 0; c < offsets.size(); ++c) {
    offsets[c] = at;
    at += h.record_sizes[c];
  }
  std::vector<size_t> todo;
  for (size_t c = 0; c < out.chunks().size(); ++c) {
    if (!out.Has(c)) continue;
    if (!h.ids.keyframe && !base->Has(c)) {
      return absl::InternalError(absl::StrFormat(
          "chunk %d of a delta is decoded partially but its base does not hold it", c));
    }
    todo.push_back(c);
  }
  absl::Mutex mu;
  size_t first_bad = todo.size();
  absl::Status first_error;
  parallel.For(todo.size(), [&](size_t k) {
    const size_t c = todo[k];
    const Chunk& chunk = out.chunks()[c];
    absl::InlinedVector<ChunkOutput, 4> spans;
    uint64_t in_chunk = 0;
    for (const Piece& p : chunk.pieces) {
      spans.push_back(ChunkOutput{h.ids.keyframe ? nullptr : base->chunk(c) + in_chunk,
                                  out.chunk(c) + in_chunk, p.bytes});
      in_chunk += p.bytes;
    }
    absl::Status s = DecodeChunk(chunk.dtype, spans, h.ids.keyframe,
                                 bytes.subspan(offsets[c], h.record_sizes[c]));
    if (!s.ok()) {
      absl::MutexLock lock(&mu);
      if (k < first_bad) {
        first_bad = k;
        first_error = absl::DataLossError(absl::StrFormat(
            "chunk %d (%s, %d bytes): %s", c, DTypeName(chunk.dtype), chunk.bytes, s.message()));
      }
    }
  });
  return first_error;
}

}  // namespace weightbus::internal::delta

// SPDX-License-Identifier: Apache-2.0
// The transfer planner and executor of core/reshard.h. A request becomes a destination tensor
// and a list of pieces (a rectangular box of one source tensor and where it lands in the
// destination); each piece is covered by the source's parts, box by box (what one part does
// not cover is carried to the next; what no part covers is a gap); each part's share becomes
// row-major byte ranges, merged wherever both sides are contiguous.
#include "core/reshard.h"

#include <fnmatch.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/checksum.h"
#include "core/status.h"

namespace weightbus::internal {
namespace {

using Dims = std::vector<int64_t>;

// A rectangular region of a tensor: elements [lo[d], lo[d] + ext[d]) in each dimension. A 0-d
// tensor's box has no dimensions and one element.
struct Box {
  Dims lo, ext;
};

bool IsEmpty(const Box& b) {
  return std::any_of(b.ext.begin(), b.ext.end(), [](int64_t e) { return e <= 0; });
}

Box Intersect(const Box& a, const Box& b) {
  Box r;
  r.lo.resize(a.lo.size());
  r.ext.resize(a.lo.size());
  for (size_t d = 0; d < a.lo.size(); ++d) {
    r.lo[d] = std::max(a.lo[d], b.lo[d]);
    const int64_t hi = std::min(a.lo[d] + a.ext[d], b.lo[d] + b.ext[d]);
    r.ext[d] = std::max<int64_t>(0, hi - r.lo[d]);
  }
  return r;
}

// Appends the pieces of `a` outside `b` (at most two per dimension) to `out`.
void Subtract(Box a, const Box& b, std::vector<Box>* out) {
  for (size_t d = 0; d < a.lo.size(); ++d) {
    const int64_t a_hi = a.lo[d] + a.ext[d], b_hi = b.lo[d] + b.ext[d];
    if (a.lo[d] < b.lo[d]) {
      Box below = a;
      below.ext[d] = std::min(a_hi, b.lo[d]) - a.lo[d];
      out->push_back(below);
      a.ext[d] = a_hi - b.lo[d];
      a.lo[d] = b.lo[d];
    }
    if (a_hi > b_hi) {
      Box above = a;
      above.lo[d] = std::max(a.lo[d], b_hi);
      above.ext[d] = a_hi - above.lo[d];
      out->push_back(above);
      a.ext[d] = b_hi - a.lo[d];
    }
    if (a.ext[d] <= 0) return;  // disjoint: everything already went out
  }
}

std::string BoxString(const Box& b) {
  return absl::StrFormat("offsets %s shape %s", ShapeString(b.lo), ShapeString(b.ext));
}

Box PartBox(const SourcePart& p) {
  Box b;
  b.lo = p.offsets.empty() ? Dims(p.global_shape.size(), 0) : p.offsets;
  b.ext = p.shape;
  return b;
}

Dims RowMajorStrides(const Dims& shape) {
  Dims s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

std::string PlacementString(const Placement& p) {
  const char* order = p.expert_order == ExpertOrder::kLinear ? "linear" : "round robin";
  switch (p.kind) {
    case Placement::Kind::kReplicate:
      return "Replicate";
    case Placement::Kind::kShard:
      return absl::StrFormat("Shard(%d)", p.dim);
    case Placement::Kind::kQkv:
      return absl::StrFormat(
          "Qkv(%d heads, %d KV heads, head size %d%s, %s -> %s)", p.num_heads, p.num_kv_heads,
          p.head_size,
          p.v_head_size > 0 ? absl::StrCat(", v head size ", p.v_head_size) : std::string(),
          absl::StrJoin(p.parts, " + "), p.fused);
    case Placement::Kind::kMerged:
      return absl::StrFormat("Merged(%s -> %s)", absl::StrJoin(p.parts, " + "), p.fused);
    case Placement::Kind::kExperts: {
      std::string groups;
      if (p.ep_size != 0)
        absl::StrAppendFormat(&groups, ", EP rank %d of %d", p.ep_rank, p.ep_size);
      if (p.expert_tp_size > 1) {
        absl::StrAppendFormat(&groups, ", expert TP rank %d of %d on dimension %d",
                              p.expert_tp_rank, p.expert_tp_size, p.expert_tp_dim);
      }
      if (p.num_experts > 0) {
        return absl::StrFormat("ExpertsFromEach(%d experts, %s -> %s, %s%s)", p.num_experts,
                               absl::StrJoin(p.parts, " + "), p.fused, order, groups);
      }
      if (p.parts.empty()) return absl::StrFormat("Experts(%s%s)", order, groups);
      return absl::StrFormat("ExpertsMerged(%s -> %s, %s%s)", absl::StrJoin(p.parts, " + "),
                             p.fused, order, groups);
    }
  }
  return "?";
}

// Every layout field a plan depends on, in a canonical byte stream.
class Hasher {
 public:
  void Int(int64_t v) { h_.Update(&v, sizeof v); }
  void Str(std::string_view s) {
    Int(static_cast<int64_t>(s.size()));
    h_.Update(s.data(), s.size());
  }
  void Vec(const Dims& v) {
    Int(static_cast<int64_t>(v.size()));
    for (int64_t x : v) Int(x);
  }
  uint64_t Digest() const { return h_.Digest(); }

 private:
  Xxh3Stream h_;
};

uint64_t PlanFingerprint(uint64_t layout_fingerprint, absl::Span<const TensorRequest> requests,
                         TensorParallelRank rank, PlanOptions options) {
  Hasher h;
  h.Int(static_cast<int64_t>(layout_fingerprint));
  h.Int(rank.size);
  h.Int(rank.rank);
  h.Int(static_cast<int64_t>(options.overlaps));
  h.Int(static_cast<int64_t>(options.absent));
  h.Int(static_cast<int64_t>(requests.size()));
  for (const TensorRequest& r : requests) {
    const Placement& p = r.placement;
    h.Str(r.name);
    for (int64_t v :
         {int64_t{static_cast<uint8_t>(p.kind)}, int64_t{p.dim}, p.num_heads, p.num_kv_heads,
          p.head_size, p.v_head_size, p.num_experts, int64_t{static_cast<uint8_t>(p.expert_order)},
          int64_t{p.ep_size}, int64_t{p.ep_rank}, int64_t{p.expert_tp_size},
          int64_t{p.expert_tp_rank}, int64_t{p.expert_tp_dim}}) {
      h.Int(v);
    }
    h.Str(p.fused);
    h.Int(static_cast<int64_t>(p.parts.size()));
    for (const std::string& part : p.parts) h.Str(part);
  }
  return h.Digest();
}

// Where a destination's bytes come from: `box` of source tensor `source` lands at `dest_at`
// (which has the destination's dimensions, as many as the source's or more; see EmitBox).
struct Piece {
  int source = 0;
  Box box;
  Dims dest_at;
};

struct DestTensor {
  DType dtype = DType::kF32;
  Dims shape;
  std::vector<Piece> pieces;
};

// Appends the byte ranges that copy `box` (global coordinates) from `part` (part `part_index`
// of source `source`) into a row-major destination of `dest_shape`, the box's first element
// landing at `dest_at`. The destination may have more dimensions than the source (a
// per-expert tensor in a stacked one): the box fills its trailing dimensions, and the leading
// ones stay at `dest_at`. Runs are as long as both sides are contiguous; consecutive runs that
// continue each other are merged.
absl::Status EmitBox(std::string_view tensor, const Box& box, const SourcePart& part, int source,
                     int part_index, const Dims& dest_shape, const Dims& dest_at,
                     std::vector<ByteRange>* out) {
  const size_t k = box.lo.size(), lead = dest_shape.size() - k;
  const Box pbox = PartBox(part);
  const Dims pstride = RowMajorStrides(part.shape), dstride = RowMajorStrides(dest_shape);
  // Dimensions [j, k) form one contiguous run: every dimension after j is covered whole on
  // both sides.
  size_t j = k == 0 ? 0 : k - 1;
  while (j > 0 && box.ext[j] == part.shape[j] && box.ext[j] == dest_shape[lead + j]) --j;
  int64_t run = 1;
  for (size_t d = j; d < k; ++d) run *= box.ext[d];
  const unsigned __int128 bits = DTypeBits(part.dtype);
  auto bytes = [&](int64_t elements, const char* what) -> absl::StatusOr<uint64_t> {
    const unsigned __int128 b = static_cast<unsigned __int128>(elements) * bits;
    if (b % 8 != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor \"%s\" is %s (%d bits per element): its slice needs a %s at bit %d of a byte; "
          "sub-byte tensors split only at whole bytes",
          tensor, DTypeName(part.dtype), DTypeBits(part.dtype), what, static_cast<int>(b % 8)));
    }
    return static_cast<uint64_t>(b / 8);
  };
  WB_ASSIGN_OR_RETURN(const uint64_t length, bytes(run, "range length"));
  Dims idx(j, 0);  // odometer over dimensions [0, j)
  while (true) {
    int64_t src = 0, dst = 0;
    for (size_t d = 0; d < lead; ++d) dst += dest_at[d] * dstride[d];
    for (size_t d = 0; d < k; ++d) {
      const int64_t i = d < j ? idx[d] : 0;
      src += (box.lo[d] + i - pbox.lo[d]) * pstride[d];
      dst += (dest_at[lead + d] + i) * dstride[lead + d];
    }
    WB_ASSIGN_OR_RETURN(const uint64_t src_byte, bytes(src, "range start"));
    WB_ASSIGN_OR_RETURN(const uint64_t dst_byte, bytes(dst, "range start"));
    ByteRange r{part.owner_rank, source, part_index, part.byte_offset + src_byte, length, dst_byte};
    if (!out->empty()) {
      ByteRange& last = out->back();
      if (last.source_tensor == source && last.source_part == part_index &&
          last.source_offset + last.length == r.source_offset &&
          last.dest_offset + last.length == r.dest_offset) {
        last.length += r.length;
        r.length = 0;
      }
    }
    if (r.length > 0) out->push_back(r);
    size_t d = j;
    while (d > 0) {
      --d;
      if (++idx[d] < box.ext[d]) break;
      idx[d] = 0;
      if (d == 0) return absl::OkStatus();
    }
    if (j == 0) return absl::OkStatus();
  }
}

class Planner {
 public:
  Planner(const SourceLayout& layout, TensorParallelRank rank, PlanOptions options)
      : layout_(layout), rank_(rank), options_(options) {}

  absl::Status Init() {
    if (rank_.size < 1 || rank_.rank < 0 || rank_.rank >= rank_.size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "TP rank %d of TP degree %d: the degree must be >= 1 and the rank in [0, %d)", rank_.rank,
          rank_.size, rank_.size));
    }
    if (layout_.world_size < 1) {
      return absl::DataLossError(absl::StrFormat(
          "the layout's publisher group has world size %d; it must be >= 1", layout_.world_size));
    }
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      if (!index_.emplace(layout_.tensors[i].name, static_cast<int>(i)).second) {
        return absl::DataLossError(
            absl::StrFormat("tensor \"%s\" appears twice in the layout", layout_.tensors[i].name));
      }
    }
    return absl::OkStatus();
  }

  bool Has(const std::string& name) const { return index_.contains(name); }

  // The validated source tensor `name`, or NotFound naming `who` wanted it.
  absl::StatusOr<int> Source(const std::string& name, std::string_view who) {
    auto it = index_.find(name);
    if (it == index_.end()) {
      return absl::NotFoundError(
          absl::StrFormat("%s: source tensor \"%s\" is not in the layout (%d tensors)", who, name,
                          layout_.tensors.size()));
    }
    if (validated_.insert(it->second).second) WB_RETURN_IF_ERROR(Validate(it->second));
    return it->second;
  }

  const SourcePart& First(int source) const { return layout_.tensors[source].parts[0]; }

  // Whether the layout has any source tensor `request` reads (its own name; a fused part; an
  // expert's part). A placement whose sources cannot even be named (a fused placement without
  // its token) counts as present, so that planning it reports why.
  bool AnySource(const TensorRequest& request) const {
    const Placement& p = request.placement;
    if (Has(request.name)) return true;
    if (p.kind == Placement::Kind::kReplicate || p.kind == Placement::Kind::kShard ||
        (p.kind == Placement::Kind::kExperts && p.parts.empty())) {
      return false;
    }
    const size_t at = p.fused.empty() ? std::string::npos : request.name.rfind(p.fused);
    if (p.parts.empty() || at == std::string::npos) return true;
    const int64_t experts = p.kind == Placement::Kind::kExperts ? p.num_experts : 0;
    for (int64_t e = 0; e < std::max<int64_t>(experts, 1); ++e) {
      for (const std::string& part : p.parts) {
        std::string name = request.name;
        name.replace(at, p.fused.size(),
                     experts > 0 ? absl::StrReplaceAll(part, {{"{e}", absl::StrCat(e)}}) : part);
        if (Has(name)) return true;
      }
    }
    return false;
  }

  absl::StatusOr<TensorPlan> Plan(const TensorRequest& request) {
    const std::string who =
        absl::StrFormat("tensor \"%s\" (%s at TP rank %d of %d)", request.name,
                        PlacementString(request.placement), rank_.rank, rank_.size);
    WB_ASSIGN_OR_RETURN(DestTensor dest, Build(request, who));
    TensorPlan plan;
    plan.name = request.name;
    plan.dtype = dest.dtype;
    plan.shape = dest.shape;
    WB_ASSIGN_OR_RETURN(plan.nbytes, ByteSize(dest.dtype, dest.shape));
    for (const Piece& piece : dest.pieces) WB_RETURN_IF_ERROR(Cover(who, dest, piece, &plan));
    std::sort(plan.ranges.begin(), plan.ranges.end(),
              [](const ByteRange& a, const ByteRange& b) { return a.dest_offset < b.dest_offset; });
    std::vector<ByteRange> merged;
    uint64_t end = 0;
    for (const ByteRange& r : plan.ranges) {
      if (r.dest_offset != end) {
        return absl::InternalError(absl::StrFormat(
            "%s: the plan's ranges leave or overlap destination bytes at %d (next range at %d)",
            who, end, r.dest_offset));
      }
      end += r.length;
      if (!merged.empty()) {
        ByteRange& last = merged.back();
        if (last.source_tensor == r.source_tensor && last.source_part == r.source_part &&
            last.source_offset + last.length == r.source_offset) {
          last.length += r.length;
          continue;
        }
      }
      merged.push_back(r);
    }
    if (end != plan.nbytes) {
      return absl::InternalError(
          absl::StrFormat("%s: the plan's ranges cover %d of %d bytes", who, end, plan.nbytes));
    }
    plan.ranges = std::move(merged);
    return plan;
  }

  std::vector<Overlap> TakeOverlaps() { return std::move(overlaps_); }

 private:
  absl::Status Validate(int source) const {
    const SourceTensor& t = layout_.tensors[source];
    if (t.parts.empty()) {
      return absl::DataLossError(
          absl::StrFormat("tensor \"%s\" has no parts in the layout", t.name));
    }
    const SourcePart& first = t.parts[0];
    for (size_t i = 0; i < t.parts.size(); ++i) {
      const SourcePart& p = t.parts[i];
      if (p.owner_rank < 0 || p.owner_rank >= layout_.world_size) {
        return absl::DataLossError(absl::StrFormat(
            "tensor \"%s\": part %d is owned by rank %d, outside the publisher group of world "
            "size %d",
            t.name, i, p.owner_rank, layout_.world_size));
      }
      if (p.dtype != first.dtype || p.global_shape != first.global_shape) {
        return absl::DataLossError(absl::StrFormat(
            "tensor \"%s\": ranks disagree on its dtype or global shape: rank %d says %s %s, rank "
            "%d says %s %s",
            t.name, first.owner_rank, DTypeName(first.dtype), ShapeString(first.global_shape),
            p.owner_rank, DTypeName(p.dtype), ShapeString(p.global_shape)));
      }
      const absl::StatusOr<uint64_t> global_bytes = ByteSize(p.dtype, p.global_shape);
      if (!global_bytes.ok()) {
        return absl::DataLossError(absl::StrFormat("tensor \"%s\": global shape %s: %s", t.name,
                                                   ShapeString(p.global_shape),
                                                   global_bytes.status().message()));
      }
      const size_t k = p.global_shape.size();
      if ((!p.offsets.empty() && p.offsets.size() != k) || p.shape.size() != k) {
        return absl::DataLossError(absl::StrFormat(
            "tensor \"%s\": rank %d's part has offsets %s and shape %s, but the global shape %s "
            "has %d dimensions",
            t.name, p.owner_rank, ShapeString(p.offsets), ShapeString(p.shape),
            ShapeString(p.global_shape), k));
      }
      const Box b = PartBox(p);
      for (size_t d = 0; d < k; ++d) {
        if (b.lo[d] < 0 || b.ext[d] < 0 || b.ext[d] > p.global_shape[d] ||
            b.lo[d] > p.global_shape[d] - b.ext[d]) {
          return absl::DataLossError(absl::StrFormat(
              "tensor \"%s\": rank %d's part (%s) lies outside the global shape %s in dimension "
              "%d",
              t.name, p.owner_rank, BoxString(b), ShapeString(p.global_shape), d));
        }
      }
      const absl::StatusOr<uint64_t> bytes = ByteSize(p.dtype, p.shape);
      if (!bytes.ok() || *bytes != p.byte_size ||
          p.byte_offset > std::numeric_limits<uint64_t>::max() - p.byte_size) {
        return absl::DataLossError(absl::StrFormat(
            "tensor \"%s\": rank %d's part of %s %s says it has %d bytes at byte %d of the "
            "rank's data, but that shape has %s",
            t.name, p.owner_rank, DTypeName(p.dtype), ShapeString(p.shape), p.byte_size,
            p.byte_offset,
            bytes.ok() ? absl::StrCat(*bytes, " bytes") : std::string(bytes.status().message())));
      }
    }
    return absl::OkStatus();
  }

  // The sources of a fused placement: one per part (the destination's name with its last
  // `fused` replaced by the part), or the destination's own tensor when it is stored fused.
  struct FusedSources {
    std::vector<int> sources;  // one per part, or a single fused one
    bool fused = false;
  };
  // Where the last `fused` token is in the destination's name (the part tokens replace it).
  static absl::StatusOr<size_t> FusedTokenAt(const TensorRequest& req, const std::string& who) {
    const Placement& p = req.placement;
    const size_t at = p.fused.empty() ? std::string::npos : req.name.rfind(p.fused);
    if (p.parts.empty() || at == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: a fused placement needs its fused token (\"%s\") in the name and at least one "
          "part token (%d given)",
          who, p.fused, p.parts.size()));
    }
    return at;
  }

  absl::StatusOr<FusedSources> ResolveFused(const TensorRequest& req, const std::string& who) {
    const Placement& p = req.placement;
    WB_ASSIGN_OR_RETURN(const size_t at, FusedTokenAt(req, who));
    std::vector<std::string> names, missing;
    for (const std::string& part : p.parts) {
      std::string name = req.name;
      name.replace(at, p.fused.size(), part);
      if (!Has(name)) missing.push_back(absl::StrCat("\"", name, "\""));
      names.push_back(std::move(name));
    }
    FusedSources out;
    if (missing.size() == names.size() && Has(req.name)) {
      WB_ASSIGN_OR_RETURN(const int s, Source(req.name, who));
      out.sources.push_back(s);
      out.fused = true;
      return out;
    }
    if (!missing.empty()) {
      return absl::NotFoundError(
          absl::StrFormat("%s: source tensor%s %s %s not in the layout, nor is a fused \"%s\"", who,
                          missing.size() > 1 ? "s" : "", absl::StrJoin(missing, ", "),
                          missing.size() > 1 ? "are" : "is", req.name));
    }
    for (const std::string& name : names) {
      WB_ASSIGN_OR_RETURN(const int s, Source(name, who));
      out.sources.push_back(s);
    }
    for (size_t i = 1; i < out.sources.size(); ++i) {
      WB_RETURN_IF_ERROR(Agree(who, CatDim(p), out.sources[0], out.sources[i]));
    }
    return out;
  }

  // OK when sources `a` and `b` of one destination have the same dtype and the same size in
  // every dimension but `except` (-1: in every dimension).
  absl::Status Agree(const std::string& who, int except, int a, int b) const {
    const SourcePart& pa = First(a);
    const SourcePart& pb = First(b);
    bool same = pa.dtype == pb.dtype && pa.global_shape.size() == pb.global_shape.size();
    for (size_t d = 0; same && d < pa.global_shape.size(); ++d) {
      same = static_cast<int>(d) == except || pa.global_shape[d] == pb.global_shape[d];
    }
    if (same) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: its sources must agree on dtype and on every dimension%s: \"%s\" is %s %s, \"%s\" "
        "is %s %s",
        who, except < 0 ? std::string() : absl::StrCat(" but ", except), layout_.tensors[a].name,
        DTypeName(pa.dtype), ShapeString(pa.global_shape), layout_.tensors[b].name,
        DTypeName(pb.dtype), ShapeString(pb.global_shape)));
  }

  // Experts stored one tensor per expert and part: the destination's name with its last `fused`
  // replaced by the part, "{e}" in it by the expert number. Rank r's local experts (as
  // LocalExperts) each get their parts one after another along dimension 1 of [E_r, ...].
  absl::StatusOr<DestTensor> BuildPerExpert(const TensorRequest& req, const std::string& who) {
    const Placement& p = req.placement;
    WB_ASSIGN_OR_RETURN(const size_t at, FusedTokenAt(req, who));
    for (const std::string& part : p.parts) {
      if (part.find("{e}") == std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: part \"%s\" has no \"{e}\" for the expert number", who, part));
      }
    }
    auto source = [&](int64_t e, size_t i) {
      std::string name = req.name;
      name.replace(at, p.fused.size(), absl::StrReplaceAll(p.parts[i], {{"{e}", absl::StrCat(e)}}));
      return Source(name, who);
    };
    // Expert 0's parts give the shape: [rows_i, rest...], rest and dtype the same for all.
    WB_ASSIGN_OR_RETURN(const TensorParallelRank ep, ExpertGroup(p, who));
    std::vector<int> first;
    int64_t rows = 0;
    InnerSplit in;
    for (size_t i = 0; i < p.parts.size(); ++i) {
      WB_ASSIGN_OR_RETURN(const int s, source(0, i));
      const Dims& g = First(s).global_shape;
      if (g.empty()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: source \"%s\" is 0-d; per-expert parts need a dimension 0 to stack along "
            "dimension 1",
            who, layout_.tensors[s].name));
      }
      if (i > 0) WB_RETURN_IF_ERROR(Agree(who, 0, first[0], s));
      WB_ASSIGN_OR_RETURN(in, ExpertInnerSplit(p, who, s, 0));
      rows += in.dim == 0 ? g[0] / in.size : g[0];
      first.push_back(s);
    }
    DestTensor dest;
    dest.dtype = First(first[0]).dtype;
    dest.shape = First(first[0]).global_shape;
    dest.shape[0] = rows;
    if (in.dim > 0) dest.shape[in.dim] /= in.size;
    dest.shape.insert(dest.shape.begin(), 0);
    for (const auto& [start, count] : LocalExperts(p.num_experts, p.expert_order, ep)) {
      for (int64_t e = start; e < start + count; ++e) {
        int64_t row = 0;
        for (size_t i = 0; i < p.parts.size(); ++i) {
          WB_ASSIGN_OR_RETURN(const int s, source(e, i));
          WB_RETURN_IF_ERROR(Agree(who, -1, first[i], s));
          const Dims& g = First(s).global_shape;
          Piece piece{s, Box{Dims(g.size(), 0), g}, Dims(dest.shape.size(), 0)};
          const int64_t n = g[in.dim] / in.size;
          piece.box.lo[in.dim] = in.rank * n;
          piece.box.ext[in.dim] = n;
          piece.dest_at[0] = dest.shape[0];
          piece.dest_at[1] = row;
          row += piece.box.ext[0];
          dest.pieces.push_back(std::move(piece));
        }
        ++dest.shape[0];
      }
    }
    return dest;
  }

  // The expert-parallel group of an experts placement: its own (ep_size > 0), else the
  // subscriber's TP group.
  absl::StatusOr<TensorParallelRank> ExpertGroup(const Placement& p, const std::string& who) const {
    if (p.ep_size == 0) return rank_;
    if (p.ep_size < 0 || p.ep_rank < 0 || p.ep_rank >= p.ep_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: expert-parallel rank %d of %d: the size must be >= 1 (0: the TP group) and the "
          "rank in [0, size)",
          who, p.ep_rank, p.ep_size));
    }
    return TensorParallelRank{p.ep_size, p.ep_rank};
  }

  // Tensor parallelism inside each expert: block `rank` of `size` of dimension `dim` of one
  // expert's part (size 1: whole).
  struct InnerSplit {
    int64_t size = 1, rank = 0;
    int dim = 0;
  };
  // The inner split of `p` for source `source`, whose dimension `lead` is the first of one
  // expert's part (0 for a per-expert source, 1 for a stacked [E, ...] one), checking that it
  // divides that part's dimension.
  absl::StatusOr<InnerSplit> ExpertInnerSplit(const Placement& p, const std::string& who,
                                              int source, size_t lead) const {
    InnerSplit in;
    if (p.expert_tp_size == 0 || (p.expert_tp_size == 1 && p.expert_tp_rank == 0)) return in;
    const Dims& g = First(source).global_shape;
    const size_t dims = g.size() - std::min(lead, g.size());
    if (p.expert_tp_size < 0 || p.expert_tp_rank < 0 || p.expert_tp_rank >= p.expert_tp_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor-parallel rank %d of %d inside the experts: the size must be >= 1 and the "
          "rank in [0, size)",
          who, p.expert_tp_rank, p.expert_tp_size));
    }
    if (p.expert_tp_dim < 0 || static_cast<size_t>(p.expert_tp_dim) >= dims) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: dimension %d inside the experts is outside an expert's %d dimensions (source "
          "\"%s\", global shape %s)",
          who, p.expert_tp_dim, dims, layout_.tensors[source].name, ShapeString(g)));
    }
    const int64_t extent = g[lead + p.expert_tp_dim];
    if (extent % p.expert_tp_size != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: the TP degree %d inside the experts does not divide dimension %d of an expert of "
          "\"%s\" (size %d, global shape %s), as vLLM's FusedMoE requires of the intermediate "
          "size",
          who, p.expert_tp_size, p.expert_tp_dim, layout_.tensors[source].name, extent,
          ShapeString(g)));
    }
    in.size = p.expert_tp_size;
    in.rank = p.expert_tp_rank;
    in.dim = p.expert_tp_dim;
    return in;
  }

  static int CatDim(const Placement& p) { return p.kind == Placement::Kind::kExperts ? 1 : p.dim; }

  // A part of a fused destination: rows [base, base + size) of `source` along the fused
  // dimension, of which this rank takes [base + start, base + start + len).
  struct Segment {
    int source = 0;
    int64_t base = 0, size = 0, start = 0, len = 0;
  };

  absl::StatusOr<std::vector<Segment>> Segments(const TensorRequest& req, const std::string& who) {
    const Placement& p = req.placement;
    if (p.kind == Placement::Kind::kQkv && p.parts.size() != 3) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: Qkv needs three part tokens (q, k, v), %d given", who, p.parts.size()));
    }
    WB_ASSIGN_OR_RETURN(const FusedSources src, ResolveFused(req, who));
    const Dims& g0 = First(src.sources[0]).global_shape;
    const int cat = CatDim(p);
    if (cat < 0 || cat >= static_cast<int>(g0.size())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: the fused dimension %d is outside the source's %d dimensions (global shape %s)", who,
          cat, g0.size(), ShapeString(g0)));
    }
    // Each part's rows along the fused dimension.
    std::vector<int64_t> sizes;
    const size_t n = p.parts.size();
    if (p.kind == Placement::Kind::kQkv) {
      const int64_t v_head = p.v_head_size > 0 ? p.v_head_size : p.head_size;
      if (p.num_heads < 1 || p.num_kv_heads < 1 || p.head_size < 1 || p.v_head_size < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: head counts and head sizes must be positive", who));
      }
      sizes = {p.num_heads * p.head_size, p.num_kv_heads * p.head_size, p.num_kv_heads * v_head};
      const char* what[] = {"query heads", "KV heads", "KV heads"};
      const int64_t heads[] = {p.num_heads, p.num_kv_heads, p.num_kv_heads};
      const int64_t head_sizes[] = {p.head_size, p.head_size, v_head};
      if (src.fused) {
        if (g0[cat] != sizes[0] + sizes[1] + sizes[2]) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s: the fused source \"%s\" has %d rows along dimension %d, but %d query and 2 x "
              "%d KV heads need %d + %d + %d",
              who, req.name, g0[cat], cat, p.num_heads, p.num_kv_heads, sizes[0], sizes[1],
              sizes[2]));
        }
      } else {
        for (size_t i = 0; i < 3; ++i) {
          const SourcePart& s = First(src.sources[i]);
          if (s.global_shape[cat] != sizes[i]) {
            return absl::InvalidArgumentError(absl::StrFormat(
                "%s: source \"%s\" has %d rows along dimension %d (global shape %s), but %d %s "
                "of size %d need %d",
                who, layout_.tensors[src.sources[i]].name, s.global_shape[cat], cat,
                ShapeString(s.global_shape), heads[i], what[i], head_sizes[i], sizes[i]));
          }
        }
      }
    } else if (src.fused) {
      if (g0[cat] % static_cast<int64_t>(n) != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: the fused source \"%s\" has %d rows along dimension %d, which do not split into "
            "%d equal parts",
            who, req.name, g0[cat], cat, n));
      }
      sizes.assign(n, g0[cat] / static_cast<int64_t>(n));
    } else {
      for (int s : src.sources) sizes.push_back(First(s).global_shape[cat]);
    }

    std::vector<Segment> segs;
    int64_t base = 0;
    for (size_t i = 0; i < n; ++i) {
      Segment seg;
      seg.source = src.fused ? src.sources[0] : src.sources[i];
      seg.base = src.fused ? base : 0;
      seg.size = sizes[i];
      base += sizes[i];
      seg.len = sizes[i];
      segs.push_back(seg);
    }
    if (p.kind == Placement::Kind::kExperts) return segs;  // experts run whole

    const int64_t tp = rank_.size, r = rank_.rank;
    if (p.kind == Placement::Kind::kQkv) {
      // vLLM QKVParallelLinear: num_heads = divide(total_num_heads, tp); KV heads divided when
      // tp < total_num_kv_heads, else one per rank, replicated divide(tp, total) times.
      if (p.num_heads % tp != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: TP degree %d does not divide the %d query heads", who, tp, p.num_heads));
      }
      int64_t kv_local = 0, kv_rank = 0;
      if (tp >= p.num_kv_heads) {
        if (tp % p.num_kv_heads != 0) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s: TP degree %d is not a multiple of the %d KV heads (KV heads are replicated "
              "over TP degree / KV heads ranks)",
              who, tp, p.num_kv_heads));
        }
        kv_local = 1;
        kv_rank = r / (tp / p.num_kv_heads);
      } else {
        if (p.num_kv_heads % tp != 0) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s: TP degree %d does not divide the %d KV heads", who, tp, p.num_kv_heads));
        }
        kv_local = p.num_kv_heads / tp;
        kv_rank = r;
      }
      const int64_t q_local = p.num_heads / tp;
      const int64_t v_head = p.v_head_size > 0 ? p.v_head_size : p.head_size;
      segs[0].len = q_local * p.head_size;
      segs[0].start = r * segs[0].len;
      segs[1].len = kv_local * p.head_size;
      segs[1].start = kv_rank * segs[1].len;
      segs[2].len = kv_local * v_head;
      segs[2].start = kv_rank * segs[2].len;
      return segs;
    }
    // kMerged: vLLM MergedColumnParallelLinear: each output size divided by tp, block tp_rank.
    for (size_t i = 0; i < n; ++i) {
      if (segs[i].size % tp != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: TP degree %d does not divide part \"%s\" of %d rows along dimension %d", who, tp,
            p.parts[i], segs[i].size, cat));
      }
      segs[i].len = segs[i].size / tp;
      segs[i].start = r * segs[i].len;
    }
    return segs;
  }

  // vLLM determine_expert_map: the experts of rank `group.rank` of `group.size` as runs (first
  // global expert, count), in local order.
  static std::vector<std::pair<int64_t, int64_t>> LocalExperts(int64_t experts, ExpertOrder order,
                                                               TensorParallelRank group) {
    const int64_t ep = group.size, r = group.rank;
    const int64_t base = experts / ep, rem = experts % ep;
    const int64_t local = base + (r < rem ? 1 : 0);
    std::vector<std::pair<int64_t, int64_t>> runs;
    if (local == 0) return runs;
    if (order == ExpertOrder::kLinear || ep == 1) {
      runs.emplace_back(r * base + std::min(r, rem), local);
    } else {
      for (int64_t e = r; e < experts; e += ep) runs.emplace_back(e, 1);
    }
    return runs;
  }

  absl::StatusOr<DestTensor> Build(const TensorRequest& req, const std::string& who) {
    const Placement& p = req.placement;
    DestTensor dest;
    switch (p.kind) {
      case Placement::Kind::kReplicate:
      case Placement::Kind::kShard: {
        WB_ASSIGN_OR_RETURN(const int s, Source(req.name, who));
        const SourcePart& part = First(s);
        const Dims& g = part.global_shape;
        dest.dtype = part.dtype;
        dest.shape = g;
        Piece piece{s, Box{Dims(g.size(), 0), g}, Dims(g.size(), 0)};
        if (p.kind == Placement::Kind::kShard) {
          if (p.dim < 0 || p.dim >= static_cast<int>(g.size())) {
            return absl::InvalidArgumentError(absl::StrFormat(
                "%s: dimension %d is outside the tensor's %d dimensions (global shape %s)", who,
                p.dim, g.size(), ShapeString(g)));
          }
          if (g[p.dim] % rank_.size != 0) {
            return absl::InvalidArgumentError(absl::StrFormat(
                "%s: TP degree %d does not divide dimension %d of size %d (global shape %s)", who,
                rank_.size, p.dim, g[p.dim], ShapeString(g)));
          }
          const int64_t n = g[p.dim] / rank_.size;
          dest.shape[p.dim] = n;
          piece.box.lo[p.dim] = rank_.rank * n;
          piece.box.ext[p.dim] = n;
        }
        dest.pieces.push_back(std::move(piece));
        return dest;
      }
      case Placement::Kind::kQkv:
      case Placement::Kind::kMerged: {
        WB_ASSIGN_OR_RETURN(const std::vector<Segment> segs, Segments(req, who));
        const SourcePart& part = First(segs[0].source);
        dest.dtype = part.dtype;
        dest.shape = part.global_shape;
        const int cat = CatDim(p);
        int64_t at = 0;
        for (const Segment& seg : segs) {
          Piece piece{seg.source, Box{Dims(dest.shape.size(), 0), First(seg.source).global_shape},
                      Dims(dest.shape.size(), 0)};
          piece.box.lo[cat] = seg.base + seg.start;
          piece.box.ext[cat] = seg.len;
          piece.dest_at[cat] = at;
          at += seg.len;
          dest.pieces.push_back(std::move(piece));
        }
        dest.shape[cat] = at;
        return dest;
      }
      case Placement::Kind::kExperts: {
        if (p.num_experts < 0) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s: %d experts; the count must be >= 0 (0: stacked sources)", who, p.num_experts));
        }
        if (p.num_experts > 0) return BuildPerExpert(req, who);
        std::vector<Segment> segs;
        if (p.parts.empty()) {
          WB_ASSIGN_OR_RETURN(const int s, Source(req.name, who));
          segs.push_back(Segment{s, 0, 0, 0, 0});
          if (First(s).global_shape.empty()) {
            return absl::InvalidArgumentError(
                absl::StrFormat("%s: a 0-d tensor has no expert dimension", who));
          }
        } else {
          WB_ASSIGN_OR_RETURN(segs, Segments(req, who));
        }
        const SourcePart& part = First(segs[0].source);
        dest.dtype = part.dtype;
        dest.shape = part.global_shape;
        WB_ASSIGN_OR_RETURN(const TensorParallelRank ep, ExpertGroup(p, who));
        // Tensor parallelism inside the experts: on the fused dimension (1), each part's block;
        // on another, the same block of every part.
        InnerSplit in;
        for (Segment& seg : segs) {
          WB_ASSIGN_OR_RETURN(in, ExpertInnerSplit(p, who, seg.source, 1));
          if (in.dim == 0 && !p.parts.empty()) {
            if (seg.size % in.size != 0) {
              return absl::InvalidArgumentError(absl::StrFormat(
                  "%s: the TP degree %d inside the experts does not divide the %d rows of each "
                  "expert's part of \"%s\"",
                  who, in.size, seg.size, layout_.tensors[seg.source].name));
            }
            seg.len = seg.size / in.size;
            seg.start = in.rank * seg.len;
          }
        }
        const bool split_rest = in.size > 1 && (in.dim > 0 || p.parts.empty());
        const size_t sd = static_cast<size_t>(in.dim) + 1;
        const auto runs = LocalExperts(part.global_shape[0], p.expert_order, ep);
        int64_t local = 0;
        for (const auto& [first, count] : runs) {
          int64_t at = 0;
          for (const Segment& seg : segs) {
            Piece piece{seg.source, Box{Dims(dest.shape.size(), 0), First(seg.source).global_shape},
                        Dims(dest.shape.size(), 0)};
            piece.box.lo[0] = first;
            piece.box.ext[0] = count;
            piece.dest_at[0] = local;
            if (!p.parts.empty()) {
              piece.box.lo[1] = seg.base + seg.start;
              piece.box.ext[1] = seg.len;
              piece.dest_at[1] = at;
              at += seg.len;
            }
            if (split_rest) {
              const int64_t n = piece.box.ext[sd] / in.size;
              piece.box.lo[sd] = in.rank * n;
              piece.box.ext[sd] = n;
            }
            dest.pieces.push_back(std::move(piece));
          }
          local += count;
        }
        if (split_rest) dest.shape[sd] /= in.size;
        dest.shape[0] = local;
        if (!p.parts.empty()) {
          int64_t rows = 0;
          for (const Segment& seg : segs) rows += seg.len;
          dest.shape[1] = rows;
        }
        return dest;
      }
    }
    return absl::InternalError(absl::StrFormat("%s: unknown placement kind", who));
  }

  // Reads `piece` from the parts of its source: each part in turn (starting at one that
  // rotates with the TP rank, to spread reads of replicated tensors) takes what it holds of
  // what is still uncovered.
  absl::Status Cover(const std::string& who, const DestTensor& dest, const Piece& piece,
                     TensorPlan* plan) {
    const SourceTensor& t = layout_.tensors[piece.source];
    const size_t n = t.parts.size();
    std::vector<Box> remaining;
    if (!IsEmpty(piece.box)) remaining.push_back(piece.box);
    const size_t first = static_cast<size_t>(rank_.rank) % n;
    for (size_t step = 0; step < n && !remaining.empty(); ++step) {
      const size_t pi = (first + step) % n;
      const SourcePart& part = t.parts[pi];
      const Box pbox = PartBox(part);
      std::vector<Box> next;
      for (const Box& r : remaining) {
        const Box inter = Intersect(r, pbox);
        if (IsEmpty(inter)) {
          next.push_back(r);
          continue;
        }
        Dims at = piece.dest_at;
        const size_t lead = at.size() - inter.lo.size();
        for (size_t d = 0; d < inter.lo.size(); ++d) at[lead + d] += inter.lo[d] - piece.box.lo[d];
        WB_RETURN_IF_ERROR(EmitBox(t.name, inter, part, piece.source, static_cast<int>(pi),
                                   dest.shape, at, &plan->ranges));
        for (size_t qi = 0; qi < n; ++qi) {
          if (qi == pi) continue;
          const Box shared = Intersect(inter, PartBox(t.parts[qi]));
          if (!IsEmpty(shared)) {
            WB_RETURN_IF_ERROR(
                AddOverlap(piece.source, static_cast<int>(pi), static_cast<int>(qi), shared));
          }
        }
        Subtract(r, pbox, &next);
      }
      remaining = std::move(next);
    }
    if (!remaining.empty()) {
      std::vector<std::string> owners;
      for (const SourcePart& part : t.parts) {
        owners.push_back(absl::StrFormat("rank %d: %s", part.owner_rank, BoxString(PartBox(part))));
      }
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: no rank owns elements %s of source \"%s\" (global shape %s), which this slice "
          "needs; the parts are %s",
          who, BoxString(remaining.front()), t.name, ShapeString(t.parts[0].global_shape),
          absl::StrJoin(owners, "; ")));
    }
    return absl::OkStatus();
  }

  absl::Status AddOverlap(int source, int pa, int pb, const Box& shared) {
    const SourceTensor& t = layout_.tensors[source];
    const SourcePart& a = t.parts[pa];
    const SourcePart& b = t.parts[pb];
    if (options_.overlaps == OverlapPolicy::kReject) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "tensor \"%s\": ranks %d and %d both own elements %s of its global shape %s (parts %d "
          "and %d); overlapping owners are accepted only with OverlapPolicy::kReport and "
          "checksums that agree",
          t.name, a.owner_rank, b.owner_rank, BoxString(shared), ShapeString(a.global_shape), pa,
          pb));
    }
    std::string key = absl::StrCat(source, "/", pa, "/", pb, "/", absl::StrJoin(shared.lo, ","),
                                   "/", absl::StrJoin(shared.ext, ","));
    if (!overlap_keys_.insert(std::move(key)).second) return absl::OkStatus();
    Overlap o;
    o.tensor = t.name;
    o.source_tensor = source;
    o.part_a = pa;
    o.part_b = pb;
    o.rank_a = a.owner_rank;
    o.rank_b = b.owner_rank;
    o.offsets = shared.lo;
    o.shape = shared.ext;
    // Ranges from a into b's byte space: b's part is the "destination".
    const Box bbox = PartBox(b);
    Dims at = shared.lo;
    for (size_t d = 0; d < at.size(); ++d) at[d] -= bbox.lo[d];
    std::vector<ByteRange> ranges;
    WB_RETURN_IF_ERROR(EmitBox(t.name, shared, a, source, pa, b.shape, at, &ranges));
    for (const ByteRange& r : ranges) {
      o.ranges.push_back(Overlap::Range{r.source_offset, b.byte_offset + r.dest_offset, r.length});
    }
    overlaps_.push_back(std::move(o));
    return absl::OkStatus();
  }

  const SourceLayout& layout_;
  const TensorParallelRank rank_;
  const PlanOptions options_;
  absl::flat_hash_map<std::string, int> index_;
  absl::flat_hash_set<int> validated_;
  absl::flat_hash_set<std::string> overlap_keys_;
  std::vector<Overlap> overlaps_;
};

}  // namespace

absl::StatusOr<std::vector<TensorRequest>> ResolvePlacements(absl::Span<const PlacementRule> rules,
                                                             absl::Span<const std::string> names) {
  std::vector<TensorRequest> out;
  absl::flat_hash_set<std::string_view> seen;
  for (const std::string& name : names) {
    if (name.empty()) return absl::InvalidArgumentError("a destination tensor name is empty");
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("destination tensor \"%s\" is named twice", name));
    }
    TensorRequest req{name, Placement::Replicate()};
    for (const PlacementRule& rule : rules) {
      if (fnmatch(rule.pattern.c_str(), name.c_str(), 0) == 0) {
        req.placement = rule.placement;
        break;
      }
    }
    out.push_back(std::move(req));
  }
  return out;
}

uint64_t ReshardPlan::total_bytes() const {
  uint64_t n = 0;
  for (const TensorPlan& t : tensors) n += t.nbytes;
  return n;
}

uint64_t ReshardPlan::BytesFrom(int owner_rank) const {
  uint64_t n = 0;
  for (const TensorPlan& t : tensors) {
    for (const ByteRange& r : t.ranges) n += r.owner_rank == owner_rank ? r.length : 0;
  }
  return n;
}

size_t ReshardPlan::total_ranges() const {
  size_t n = 0;
  for (const TensorPlan& t : tensors) n += t.ranges.size();
  return n;
}

uint64_t LayoutFingerprint(const SourceLayout& layout) {
  Hasher h;
  h.Int(layout.world_size);
  h.Int(static_cast<int64_t>(layout.tensors.size()));
  for (const SourceTensor& t : layout.tensors) {
    h.Str(t.name);
    h.Int(static_cast<int64_t>(t.parts.size()));
    for (const SourcePart& p : t.parts) {
      h.Int(p.owner_rank);
      h.Int(static_cast<int64_t>(p.dtype));
      h.Vec(p.global_shape);
      h.Vec(p.offsets);
      h.Vec(p.shape);
      h.Int(static_cast<int64_t>(p.byte_offset));
      h.Int(static_cast<int64_t>(p.byte_size));
    }
  }
  return h.Digest();
}

absl::StatusOr<ReshardPlan> ComputePlan(const SourceLayout& layout,
                                        absl::Span<const TensorRequest> requests,
                                        TensorParallelRank rank, PlanOptions options) {
  Planner planner(layout, rank, options);
  WB_RETURN_IF_ERROR(planner.Init());
  ReshardPlan plan;
  absl::flat_hash_set<std::string_view> seen;
  for (const TensorRequest& req : requests) {
    if (!seen.insert(req.name).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("destination tensor \"%s\" is requested twice", req.name));
    }
    if (options.absent == AbsentPolicy::kSkip && !planner.AnySource(req)) {
      plan.skipped.push_back(req.name);
      continue;
    }
    WB_ASSIGN_OR_RETURN(TensorPlan t, planner.Plan(req));
    plan.tensors.push_back(std::move(t));
  }
  if (!requests.empty() && plan.tensors.empty()) {
    return absl::NotFoundError(absl::StrFormat(
        "none of the %d destination tensors has a source in the layout (%d tensors), e.g. "
        "\"%s\"; a plan that receives nothing is refused",
        requests.size(), layout.tensors.size(), requests.front().name));
  }
  plan.overlaps = planner.TakeOverlaps();
  plan.layout_fingerprint = LayoutFingerprint(layout);
  plan.fingerprint = PlanFingerprint(plan.layout_fingerprint, requests, rank, options);
  return plan;
}

absl::Status ApplyPlan(const TensorPlan& plan,
                       absl::Span<const absl::Span<const std::byte>> rank_data,
                       absl::Span<std::byte> dest) {
  if (dest.size() != plan.nbytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor \"%s\": the destination has %d bytes, but its slice %s %s has %d", plan.name,
        dest.size(), DTypeName(plan.dtype), ShapeString(plan.shape), plan.nbytes));
  }
  for (size_t i = 0; i < plan.ranges.size(); ++i) {
    const ByteRange& r = plan.ranges[i];
    if (r.owner_rank < 0 || static_cast<size_t>(r.owner_rank) >= rank_data.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor \"%s\": range %d reads rank %d, but data of %d ranks was given",
                          plan.name, i, r.owner_rank, rank_data.size()));
    }
    const size_t have = rank_data[r.owner_rank].size();
    if (r.source_offset > have || r.length > have - r.source_offset) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor \"%s\": range %d reads bytes [%d, %d) of rank %d's data, which has %d bytes",
          plan.name, i, r.source_offset, r.source_offset + r.length, r.owner_rank, have));
    }
    if (r.dest_offset > dest.size() || r.length > dest.size() - r.dest_offset) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor \"%s\": range %d writes bytes [%d, %d) of a destination of %d bytes", plan.name,
          i, r.dest_offset, r.dest_offset + r.length, dest.size()));
    }
  }
  for (const ByteRange& r : plan.ranges) {
    if (r.length == 0) continue;
    std::memcpy(dest.data() + r.dest_offset, rank_data[r.owner_rank].data() + r.source_offset,
                r.length);
  }
  return absl::OkStatus();
}

absl::Status CheckOverlapAgrees(const Overlap& overlap, uint64_t checksum_a, uint64_t checksum_b) {
  if (checksum_a == checksum_b) return absl::OkStatus();
  return absl::DataLossError(absl::StrFormat(
      "tensor \"%s\": ranks %d and %d both own elements offsets %s shape %s but their bytes "
      "differ (checksum %016x on rank %d, %016x on rank %d)",
      overlap.tensor, overlap.rank_a, overlap.rank_b, ShapeString(overlap.offsets),
      ShapeString(overlap.shape), checksum_a, overlap.rank_a, checksum_b, overlap.rank_b));
}

absl::StatusOr<const ReshardPlan*> PlanCache::Get(const SourceLayout& layout,
                                                  absl::Span<const TensorRequest> requests,
                                                  TensorParallelRank rank, PlanOptions options) {
  const uint64_t fp = PlanFingerprint(LayoutFingerprint(layout), requests, rank, options);
  if (have_ && plan_.fingerprint == fp) return &plan_;
  have_ = false;
  ++computations_;
  WB_ASSIGN_OR_RETURN(plan_, ComputePlan(layout, requests, rank, options));
  have_ = true;
  return &plan_;
}

}  // namespace weightbus::internal

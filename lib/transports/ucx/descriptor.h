// SPDX-License-Identifier: Apache-2.0
// The version descriptor of ucx:// (docs/FORMAT.md, "The version descriptor"): what a
// subscriber needs to know about a version besides its bytes, kept in registered memory next to
// them, one copy per version, and pulled by every subscriber with one-sided gets (or READs over
// the control connection). A GRANT only points at it, so the control bytes of a version do not
// grow with its tensor count, its manifest or its number of subscribers. The descriptor also
// carries the per-chunk readiness words of a version announced before its bytes are staged
// (pipelining) and, once they are known, its checksums and MAC (the seal).
//
//   [0, 64)                 the header (DescriptorHeader): magic, version, state, ...
//   [64, 64 + 8 nchunks)    ready[k]: the version whose bytes chunk k of the slot holds (chunk k
//                           is slot bytes [k chunk_bytes, (k + 1) chunk_bytes)); a subscriber
//                           gets a chunk once its word equals the version
//   [layout_offset, +layout_bytes)  the VersionLayout: regions, tensor offsets, the manifest
//                           without checksums; written before the version is granted and never
//                           changed while a lease is held on it
//   [seal_offset, +seal_bytes)      the VersionSeal, written before the state becomes sealed
//
// Every integer is little-endian. Writers store a readiness word or the state only after the
// bytes it vouches for (store fences after streaming stores); readers that see it may then read
// those bytes. A word that reads as anything but the version (torn, stale, another version in a
// reused slot) means "not yet" or, for the header, "not this version".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/tiles.h"
#include "transports/ucx/control.h"
#include "weightbus/manifest.hpp"

namespace weightbus::internal::ucx {

inline constexpr uint64_t kDescriptorMagic = 0x3176637862776477ull;  // "wdwbxcv1"
inline constexpr uint64_t kDescriptorHeaderBytes = 64;

// DescriptorHeader::state.
enum class VersionState : uint64_t {
  kStaging = 1,  // announced; chunks become ready as they are staged; not sealed yet
  kSealed = 2,   // every chunk is staged and the seal is in place
  kAborted = 3,  // the Publish failed: nothing of the version may be used
};

struct DescriptorHeader {
  uint64_t magic = kDescriptorMagic;
  uint64_t version = 0;
  uint64_t state = 0;  // VersionState
  uint64_t nchunks = 0;
  uint64_t layout_offset = 0;
  uint64_t layout_bytes = 0;
  uint64_t seal_offset = 0;
  uint64_t seal_bytes = 0;  // 0 until sealed
};
// The header as its 64 bytes, and back. DecodeHeader: DataLoss for a wrong size or magic
// (`magic`: kDescriptorMagic, or kRelayMagic for a relay descriptor).
std::string EncodeHeader(const DescriptorHeader& h);
absl::StatusOr<DescriptorHeader> DecodeHeader(std::string_view bytes,
                                              uint64_t magic = kDescriptorMagic);

// ---- Relays (README.md, "Fan-out") ----
// A subscriber that may relay a version keeps a relay descriptor in registered memory UCX
// allocated (so that its children can write into it on any transport):
//
//   [0, 64)        header (DescriptorHeader with magic kRelayMagic): version, state
//                  (RelayState), nchunks, layout_offset, layout_bytes
//   [64, 64 + 24 kMaxRelayChildren)  per child slot: attach (the version the child reads from
//                  this relay), done (the version it no longer reads), heartbeat (grows while
//                  it reads); written by the child
//   [kRelayReadyOffset, + 8 nchunks)  ready[k]: the version whose chunk k (of the publisher's
//                  chunk grid) this relay holds
//   [layout_offset, + layout_bytes)   a VersionLayout of the relay's own memory: regions mapping
//                  slot offsets to the relay's receive buffers (no manifest, no offsets)
//
// Closing (a relay's Fetch returning) is a handshake: the relay stores kClosing, fences, then
// waits for every child whose attach is the version and whose done is not (or whose heartbeat
// stopped for relay_stall), and stores kClosed; a child stores attach, then reads the header,
// and reads nothing from a relay it saw closing; bytes it read count only once a later read of
// the header still shows the relay open (else they are read again from the publisher).
inline constexpr uint64_t kRelayMagic = 0x31796c6572627777ull;  // "wwbrely1"
inline constexpr uint64_t kMaxRelayChildren = 64;
inline constexpr uint64_t kRelayChildBytes = 24;
inline constexpr uint64_t kRelayReadyOffset =
    kDescriptorHeaderBytes + kMaxRelayChildren * kRelayChildBytes;
enum class RelayState : uint64_t { kReceiving = 1, kComplete = 2, kClosing = 3, kClosed = 4 };
inline uint64_t RelayChildOffset(uint64_t child) {
  return kDescriptorHeaderBytes + child * kRelayChildBytes;
}

// Offset of readiness word `k` in the descriptor.
inline uint64_t ReadyOffset(uint64_t k) { return kDescriptorHeaderBytes + 8 * k; }

// One piece of a version's bytes as a subscriber reaches it: registered memory holding slot
// bytes [base, base + length) at `address` in the publisher's address space.
struct LayoutRegion {
  uint64_t id = 0;  // unique within the publisher process; rkeys are cached by it
  uint64_t base = 0;
  uint64_t address = 0;
  uint64_t length = 0;
  std::string rkey;  // packed
  // kCrossMemoryAttach: memory UCX did not allocate (a zero-copy publisher's tensors outside
  // Publisher::AllocateHost memory, a relay's receive buffers). UCX 1.13 reaches such memory on one
  // host only with software-emulated gets (its cma transport serves rendezvous, not RMA): a
  // subscriber on the owner's host reads it with process_vm_readv from VersionLayout::pid instead,
  // when it can.
  uint64_t flags = 0;
  friend bool operator==(const LayoutRegion&, const LayoutRegion&) = default;
};
inline constexpr uint64_t kCrossMemoryAttach = 1;

struct VersionLayout {
  uint64_t version = 0;
  uint64_t chunk_bytes = 0;  // readiness granularity, >= 4096
  uint64_t data_bytes = 0;   // the regions tile slot bytes [0, data_bytes)
  std::vector<LayoutRegion> regions;
  std::vector<uint64_t> offsets;  // per manifest tensor: its offset in the slot (a group
                                  // version: rank 0's parts only; others 0)
  // A publisher group's version (granted by rank 0): where each rank serves its parts, indexed
  // by rank; empty for a single publisher.
  std::vector<GroupMember> members;
  std::vector<uint64_t> live;  // ids of every region the publisher still holds
  std::string manifest_json;   // the manifest without checksums, sealed time and MAC
  uint64_t pid = 0;            // the process that owns the regions, in its host's pid namespace
  friend bool operator==(const VersionLayout&, const VersionLayout&) = default;
};
std::string EncodeLayout(const VersionLayout& l);
// DataLoss naming the field, as the control messages' decoders.
absl::StatusOr<VersionLayout> DecodeLayout(std::string_view bytes);

struct TensorSeal {
  uint64_t xxh3 = 0;
  // The manifest's block_bytes, block_rows and block_xxh3 (docs/FORMAT.md, "Block checksums":
  // tiles, block_rows > 0, or format 1's 1-D blocks).
  uint64_t block_bytes = 0;
  uint64_t block_rows = 0;
  std::vector<uint64_t> blocks;
  friend bool operator==(const TensorSeal&, const TensorSeal&) = default;
};
struct VersionSeal {
  uint64_t version = 0;
  int64_t sealed_unix_ns = 0;
  std::string mac;  // the manifest's MAC entry; empty without a shared secret
  std::vector<TensorSeal> tensors;
  friend bool operator==(const VersionSeal&, const VersionSeal&) = default;
};
std::string EncodeSeal(const VersionSeal& s);
absl::StatusOr<VersionSeal> DecodeSeal(std::string_view bytes);

// `sealed` without what sealing adds: checksums (0, no blocks), sealed_unix_ns and the MAC.
Manifest Unsealed(Manifest sealed);
// What sealing added to `sealed`.
VersionSeal SealOf(const Manifest& sealed);
// The sealed manifest: `unsealed` with `seal` applied. DataLoss when they do not fit (another
// version, another tensor count, a block count that does not match the tensor's grid, tile rows
// without tile bytes).
absl::StatusOr<Manifest> ApplySeal(Manifest unsealed, const VersionSeal& seal);
// The most bytes the seal of a version of `manifest`'s tensors can take, with the block checksums
// of `grids` (one per tensor, as the publisher cuts them: PublishJob::ChecksumGrid; missing
// ones: none) and a MAC entry of at most 128 bytes.
uint64_t SealCapacity(const Manifest& manifest, absl::Span<const TileGrid> grids);

}  // namespace weightbus::internal::ucx

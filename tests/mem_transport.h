// SPDX-License-Identifier: Apache-2.0
// mem:///NAME: an in-process transport for tests. It registers itself like disk and ucx
// (lib/core/registry.h) but is built only into test executables (weightbus_mem_transport in
// tests/CMakeLists.txt, linked whole), so every test that needs a fake transport uses this one,
// through the public API or the plugin interface (lib/core/transport.h) alike.
//
// Channels live in the process: a process-wide map by NAME, so a publisher and the subscribers
// of one name share versions (copies of the published bytes). One live publisher per channel.
//
// Every optional capability can be switched off with a setting (URI query, Options or
// WEIGHTBUS_MEM_*), so tests exercise the core's and the layers' paths for transports without it:
//   mem:///policy?cancel=false&open_version=false
// The declared TransportCapabilities follow the settings. MemChannel below injects faults and
// scripts deliveries from the test's side. With cuda_memory=true (off by default) it declares
// kCudaMemory on both sides: Publish copies device tensors out of device memory and Fetch writes
// device targets with CUDA copies, and the channel records what pointers it was handed
// (MemChannel::PublishedFrom, FetchedInto) for the core's routing tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/config.h"
#include "core/transport.h"
#include "weightbus/manifest.hpp"

namespace weightbus::testing::mem {

// The settings of scope "mem" (all capabilities on by default).
const internal::SettingTable& MemSettings();

struct ChannelState;

// A tensor as the transport was handed it: where its bytes were (Publish) or went (Fetch).
struct Seen {
  std::string tensor;
  const void* data = nullptr;
  Device device;
};

// The test's handle on channel NAME (created if no publisher or subscriber opened it yet).
// Thread-safe; every method takes effect for calls that start after it returns.
class MemChannel {
 public:
  explicit MemChannel(const std::string& name);

  // The committed versions the channel holds, ascending.
  std::vector<uint64_t> Versions() const;
  // The manifest of committed `version` (which must be held).
  Manifest ManifestOf(uint64_t version) const;
  // XORs byte `offset` of tensor `tensor` of committed `version` with `mask` (again to undo), as
  // a bit flipped in transit would: subscribers then receive bytes that fail verification.
  void CorruptByte(uint64_t version, size_t tensor, uint64_t offset,
                   std::byte mask = std::byte{0x01});
  // Edits the manifest of committed `version` as subscribers will receive it.
  void EditManifest(uint64_t version, const std::function<void(Manifest&)>& edit);
  // The next Publish on the channel fails with `status` and leaves nothing visible.
  void FailNextPublish(absl::Status status);
  // The next Publish on the channel throws std::bad_alloc (as an allocation failing in a
  // transport would) and leaves nothing visible.
  void ThrowNextPublish();
  // The next WaitForVersion calls hand over these committed versions first, one per call and in
  // this order, whatever they ask for: a transport that delivers out of order or again.
  void DeliverNext(std::vector<uint64_t> versions);
  // Publishers of the channel report `publish` from LastCodecStats and its versions report
  // `fetch` from FetchCodecStats, as a layer would.
  void ReportCodecStats(internal::CodecStats publish, internal::CodecStats fetch);
  // Subscribers of this channel receive channel `target`'s versions from now on (an empty
  // `target`: their own again); its publishers still publish here.
  void ReadFrom(const std::string& target);
  // What the channel's last Publish read each tensor from, and its last Fetch wrote each into
  // (in manifest order; a skipped target is not listed).
  std::vector<Seen> PublishedFrom() const;
  std::vector<Seen> FetchedInto() const;

 private:
  std::shared_ptr<ChannelState> state_;
};

}  // namespace weightbus::testing::mem

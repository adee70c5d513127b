// SPDX-License-Identifier: Apache-2.0
// Registrations of a subscriber's receive buffers, made once (ucp_mem_map) and reused across
// versions: the core recycles its library buffers and bound destinations stay put, and on
// RDMA devices registering (pinning) costs far more than a small transfer. A registration is
// dropped when its memory is unmapped: UCX's memory hooks (UCM_EVENT_VM_UNMAPPED) mark it stale
// the moment munmap runs, so a new buffer at the same address is never written through a stale
// registration. Where UCX memory events are off (UCX_MEM_EVENTS=no), registrations last one
// Fetch only.
#pragma once

#include <ucm/api/ucm.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

#include "transports/ucx/ucp_util.h"

namespace weightbus::internal::ucx {

// Not thread-safe: one owner thread (the subscriber's serialized calls). The unmap hook runs on
// any thread and touches only atomics, never locks or allocates.
class RegistrationCache {
 public:
  static constexpr size_t kMaxEntries = 1024;

  explicit RegistrationCache(std::shared_ptr<Context> context, uint64_t first_id = 1);
  ~RegistrationCache();
  RegistrationCache(const RegistrationCache&) = delete;
  RegistrationCache& operator=(const RegistrationCache&) = delete;

  // The registration of exactly [p, p + n), made now on a miss or when the memory was unmapped
  // since; nullptr when UCX refuses to register it (the get then goes without a memory handle
  // and UCX registers internally as it needs).
  ucp_mem_h Get(std::byte* p, uint64_t n);
  // Get, for memory served to peers (a zero-copy publish): the registration, an id that names
  // it as long as it lives (a new registration of the same range gets a new id, from
  // `first_id` up), and its packed rkey. nullopt with the reason when UCX refuses to register
  // it. The region lives until evicted by a later call or the cache's destruction.
  struct Served {
    const MemRegion* region = nullptr;
    uint64_t id = 0;
    const std::string* rkey = nullptr;
  };
  absl::StatusOr<Served> Serve(std::byte* p, uint64_t n);
  // Called after each Fetch: without memory events, forgets everything.
  void EndFetch();

  bool persistent() const { return events_; }
  size_t size() const { return entries_.size(); }
  // Registrations made so far (for tests: a recycled buffer must not be registered again).
  uint64_t registrations() const { return registrations_; }

 private:
  // Ranges the unmap hook checks; begin == 0 marks a free watch.
  struct Watch {
    std::atomic<uintptr_t> begin{0};
    std::atomic<uintptr_t> end{0};
    std::atomic<bool> stale{false};
  };
  struct Entry {
    uintptr_t end = 0;
    size_t watch = 0;
    uint64_t last_use = 0;
    uint64_t id = 0;
    std::string rkey;  // packed on the first Serve
    std::unique_ptr<MemRegion> region;
  };
  // The entry of exactly [p, p + n), registered now on a miss; nullptr with `*error` set when UCX
  // refuses.
  Entry* Find(std::byte* p, uint64_t n, absl::Status* error);

  static void OnUnmap(ucm_event_type_t type, ucm_event_t* event, void* arg);
  void Evict(std::map<uintptr_t, Entry>::iterator it);

  std::shared_ptr<Context> context_;
  bool events_ = false;
  std::array<Watch, kMaxEntries> watches_;
  std::atomic<size_t> high_water_{0};   // watches_[0, high_water_) may be in use
  std::map<uintptr_t, Entry> entries_;  // by begin address; owner thread only
  uint64_t clock_ = 0;
  uint64_t registrations_ = 0;
  uint64_t next_id_;
};

}  // namespace weightbus::internal::ucx

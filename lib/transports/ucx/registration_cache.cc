// SPDX-License-Identifier: Apache-2.0
#include "transports/ucx/registration_cache.h"

#include "core/logging.h"
#include "core/status.h"

namespace weightbus::internal::ucx {

RegistrationCache::RegistrationCache(std::shared_ptr<Context> context, uint64_t first_id)
    : context_(std::move(context)), next_id_(first_id) {
  const ucs_status_t s = ucm_set_event_handler(UCM_EVENT_VM_UNMAPPED, 0, &OnUnmap, this);
  events_ = s == UCS_OK;
  if (!events_) {
    Log(LogLevel::kInfo,
        "UCX memory events unavailable (%s); receive buffers are registered per version",
        ucs_status_string(s));
  }
}

RegistrationCache::~RegistrationCache() {
  // After this returns no hook call is running or will run (UCM holds its event lock).
  if (events_) ucm_unset_event_handler(UCM_EVENT_VM_UNMAPPED, &OnUnmap, this);
  while (!entries_.empty()) Evict(entries_.begin());
}

void RegistrationCache::OnUnmap(ucm_event_type_t type, ucm_event_t* event, void* arg) {
  auto* self = static_cast<RegistrationCache*>(arg);
  const uintptr_t begin = reinterpret_cast<uintptr_t>(event->vm_unmapped.address);
  const uintptr_t end = begin + event->vm_unmapped.size;
  const size_t n = self->high_water_.load(std::memory_order_acquire);
  for (size_t k = 0; k < n; ++k) {
    Watch& w = self->watches_[k];
    const uintptr_t b = w.begin.load(std::memory_order_acquire);
    if (b == 0) continue;
    if (b < end && begin < w.end.load(std::memory_order_acquire)) {
      w.stale.store(true, std::memory_order_release);
    }
  }
}

void RegistrationCache::Evict(std::map<uintptr_t, Entry>::iterator it) {
  watches_[it->second.watch].begin.store(0, std::memory_order_release);
  entries_.erase(it);  // unregisters
}

ucp_mem_h RegistrationCache::Get(std::byte* p, uint64_t n) {
  absl::Status error;
  Entry* e = Find(p, n, &error);
  if (e == nullptr) {
    Log(LogLevel::kDebug, "not registering a receive buffer: %s", std::string(error.message()));
    return nullptr;
  }
  return e->region->memh();
}

absl::StatusOr<RegistrationCache::Served> RegistrationCache::Serve(std::byte* p, uint64_t n) {
  absl::Status error;
  Entry* e = Find(p, n, &error);
  if (e == nullptr) return error;
  if (e->rkey.empty()) {
    WB_ASSIGN_OR_RETURN(e->rkey, e->region->PackRkey());
  }
  return Served{e->region.get(), e->id, &e->rkey};
}

RegistrationCache::Entry* RegistrationCache::Find(std::byte* p, uint64_t n, absl::Status* error) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  ++clock_;
  if (auto it = entries_.find(begin); it != entries_.end()) {
    Entry& e = it->second;
    if (e.end == begin + n && !watches_[e.watch].stale.load(std::memory_order_acquire)) {
      e.last_use = clock_;
      return &e;
    }
    Evict(it);  // unmapped since, or a different buffer at the same address
  }
  if (entries_.size() >= kMaxEntries) {
    auto oldest = entries_.begin();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->second.last_use < oldest->second.last_use) oldest = it;
    }
    Evict(oldest);
  }
  size_t watch = 0;
  while (watch < kMaxEntries && watches_[watch].begin.load(std::memory_order_acquire) != 0) {
    ++watch;
  }
  // Watch the range before registering, so an unmap racing with the registration is seen.
  Watch& w = watches_[watch];
  w.stale.store(false, std::memory_order_relaxed);
  w.end.store(begin + n, std::memory_order_relaxed);
  w.begin.store(begin, std::memory_order_release);
  if (watch + 1 > high_water_.load(std::memory_order_relaxed)) {
    high_water_.store(watch + 1, std::memory_order_release);
  }
  absl::StatusOr<std::unique_ptr<MemRegion>> region =
      MemRegion::Register(context_, p, n, DetectMemoryType(p));
  if (!region.ok()) {
    w.begin.store(0, std::memory_order_release);
    *error = region.status();
    return nullptr;
  }
  ++registrations_;
  Entry& e = entries_[begin];
  e.end = begin + n;
  e.watch = watch;
  e.last_use = clock_;
  e.id = next_id_++;
  e.region = *std::move(region);
  return &e;
}

void RegistrationCache::EndFetch() {
  if (events_) return;
  while (!entries_.empty()) Evict(entries_.begin());
}

}  // namespace weightbus::internal::ucx

// SPDX-License-Identifier: Apache-2.0
// Owning wrappers of UCP handles (context, worker, memory registrations, rkeys), the mapping of
// ucs_status_t to absl::Status, and memory-type helpers (CUDA when built with it). Every handle
// is released by its destructor, so error paths cannot leak one.
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace weightbus::internal::ucx {

// A status for a failed UCX call: `what` followed by UCX's text. UCS_ERR_NO_MEMORY ->
// ResourceExhausted; unreachable, reset, rejected, timed-out endpoints and cancellations ->
// Unavailable; UCS_ERR_UNSUPPORTED -> Unimplemented; UCS_ERR_INVALID_PARAM -> InvalidArgument;
// others -> Internal.
absl::Status UcsError(ucs_status_t status, std::string_view what);

// A UCP context with the RMA feature (and WAKEUP when asked), configured from UCX_* environment
// variables (UCX_TLS, UCX_NET_DEVICES, ...) as every UCX program is.
class Context {
 public:
  // `one_host`: every peer is on this host (the channel's address is a loopback one). Then,
  // unless UCX_TLS is set, TCP is left out (UCX_TLS=^tcp): with UCX's defaults (UCX 1.13) a
  // one-sided get between two processes of one host goes over TCP on lo at ~0.6 GB/s instead of
  // shared memory or CMA at 3-6 GB/s (BENCHMARKS.md, "weightbus-bench").
  // `tcp_interfaces`: where UCX's tcp transport, when UCX_TLS selects it, may open its own
  // listening sockets (one per interface; network interface names such as "lo" or "eth0", from
  // TcpInterfacesFor in control.h): unless UCX_NET_DEVICES is set, UCX_NET_DEVICES becomes every
  // other network device (InfiniBand/RoCE ports, as UCX's default "all" would take) plus these,
  // instead of every interface of the host (issue 17). Empty: the loopback interface.
  // Errors: Unavailable when UCX cannot initialize (no usable transport), naming `uri`.
  static absl::StatusOr<std::shared_ptr<Context>> Create(
      bool wakeup, std::string_view uri, bool one_host,
      const std::vector<std::string>& tcp_interfaces = {});
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ucp_context_h get() const { return context_; }

 private:
  explicit Context(ucp_context_h c) : context_(c) {}
  ucp_context_h context_;
};

// A UCP worker of `context`. Thread mode SERIALIZED: callers serialize access themselves.
class Worker {
 public:
  static absl::StatusOr<std::unique_ptr<Worker>> Create(std::shared_ptr<Context> context,
                                                        std::string_view uri);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ucp_worker_h get() const { return worker_; }
  const std::shared_ptr<Context>& context() const { return context_; }
  // The worker's address, as packed by ucp_worker_get_address (what a peer connects to).
  absl::StatusOr<std::string> Address() const;
  // The event file descriptor (needs a context created with wakeup).
  absl::StatusOr<int> EventFd() const;

 private:
  Worker(std::shared_ptr<Context> c, ucp_worker_h w) : context_(std::move(c)), worker_(w) {}
  std::shared_ptr<Context> context_;
  ucp_worker_h worker_;
};

// One memory registration (ucp_mem_map), unmapped (and freed, when UCX allocated it) on
// destruction.
class MemRegion {
 public:
  // `length` bytes allocated and registered by UCX (UCP_MEM_MAP_ALLOCATE), so that shared-memory
  // transports can map them into a peer directly; of `type` (host or CUDA).
  static absl::StatusOr<std::unique_ptr<MemRegion>> Allocate(std::shared_ptr<Context> context,
                                                             size_t length, ucs_memory_type_t type);
  // Registers existing memory of `type`.
  static absl::StatusOr<std::unique_ptr<MemRegion>> Register(std::shared_ptr<Context> context,
                                                             void* address, size_t length,
                                                             ucs_memory_type_t type);
  ~MemRegion();
  MemRegion(const MemRegion&) = delete;
  MemRegion& operator=(const MemRegion&) = delete;

  std::byte* data() const { return static_cast<std::byte*>(address_); }
  size_t size() const { return length_; }
  ucp_mem_h memh() const { return memh_; }
  ucs_memory_type_t type() const { return type_; }
  // The packed remote key a peer unpacks with ucp_ep_rkey_unpack.
  absl::StatusOr<std::string> PackRkey() const;

 private:
  MemRegion(std::shared_ptr<Context> c, ucp_mem_h m, void* a, size_t n, ucs_memory_type_t t)
      : context_(std::move(c)), memh_(m), address_(a), length_(n), type_(t) {}
  std::shared_ptr<Context> context_;
  ucp_mem_h memh_;
  void* address_;
  size_t length_;
  ucs_memory_type_t type_;
};

// An unpacked remote key, destroyed with its owner (it must go before its endpoint).
class RemoteKey {
 public:
  // Errors: Unavailable/Internal from ucp_ep_rkey_unpack, naming `what`.
  static absl::StatusOr<std::unique_ptr<RemoteKey>> Unpack(ucp_ep_h ep, const std::string& packed,
                                                           std::string_view what);
  ~RemoteKey();
  RemoteKey(const RemoteKey&) = delete;
  RemoteKey& operator=(const RemoteKey&) = delete;
  ucp_rkey_h get() const { return rkey_; }

 private:
  explicit RemoteKey(ucp_rkey_h r) : rkey_(r) {}
  ucp_rkey_h rkey_;
};

// The kinds of one-sided (RMA) transports a context has, from its resources
// (ucp_context_print_info). Transports that lack RMA (tcp, ud) make UCP emulate gets with
// active messages that the peer's worker answers (software RMA).
struct RmaTransports {
  bool one_host = false;  // shared memory or cross-memory attach: posix, sysv, cma, knem, xpmem,
                          // cuda_ipc, rocm_ipc
  bool network = false;   // hardware RMA between hosts (rc, dc, ...): any other transport
};
RmaTransports ContextRmaTransports(const Context& context);

// Whether this build can stage in and receive into CUDA memory.
bool CudaSupported();
// Whether UCX here moves CUDA memory (its context's memory types include CUDA: UCX built with
// cuda_copy / cuda_ipc, GPUDirect RDMA where present) and this build and process can use a CUDA
// device. Probed once per process with a UCP context of its own (configured from UCX_*), only
// where CudaSupported(); false otherwise (Debian's UCX has no CUDA support).
bool UcxMovesCudaMemory();
// UCS_MEMORY_TYPE_CUDA for CUDA device memory (when built with CUDA and a device exists),
// UCS_MEMORY_TYPE_HOST otherwise.
ucs_memory_type_t DetectMemoryType(const void* p);
// Copies `n` bytes between any two of host and CUDA memory (memcpy when both are host).
// Errors: Internal with the CUDA error text.
absl::Status CopyBytes(void* dst, const void* src, size_t n);

// While alive, UCX log lines of this thread at ERROR level or below are not printed but logged
// by weightbus at debug level: for probes whose failure is expected and handled (an endpoint
// with peer failure handling over transports that lack it makes UCX print an error).
class QuietUcxErrors {
 public:
  QuietUcxErrors();
  ~QuietUcxErrors();
  QuietUcxErrors(const QuietUcxErrors&) = delete;
  QuietUcxErrors& operator=(const QuietUcxErrors&) = delete;
};

// Waits until `request` (from a *_nbx call) completes, progressing `worker`, and frees it.
// UCS_OK for a null request (completed at once). At `deadline` it gives up: the request is
// handed to UCX to free when it completes, and UCS_ERR_TIMED_OUT is returned. Used for short
// control operations such as closing an endpoint.
ucs_status_t WaitRequest(ucp_worker_h worker, ucs_status_ptr_t request, absl::Time deadline);

}  // namespace weightbus::internal::ucx

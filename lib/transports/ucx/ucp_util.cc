// SPDX-License-Identifier: Apache-2.0
#include "transports/ucx/ucp_util.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <ucs/debug/log_def.h>
#include <uct/api/uct.h>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/logging.h"
#include "transports/ucx/control.h"

#ifdef WEIGHTBUS_UCX_CUDA
#include <cuda_runtime_api.h>
#endif

namespace weightbus::internal::ucx {

absl::Status UcsError(ucs_status_t status, std::string_view what) {
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (status) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_IO_ERROR:
      code = absl::StatusCode::kUnavailable;
      break;
    case UCS_ERR_TIMED_OUT:
      code = absl::StatusCode::kDeadlineExceeded;
      break;
    case UCS_ERR_UNSUPPORTED:
      code = absl::StatusCode::kUnimplemented;
      break;
    case UCS_ERR_INVALID_PARAM:
      code = absl::StatusCode::kInvalidArgument;
      break;
    default:
      break;
  }
  return absl::Status(code, absl::StrFormat("%s: %s", what, ucs_status_string(status)));
}

namespace {

void RouteUcxLogs();

// Whether a UCX_TLS value (nullptr: unset, UCX's "all") selects the tcp transport.
bool TlsSelectsTcp(const char* tls) {
  if (tls == nullptr || *tls == '\0') return true;
  absl::string_view list(tls);
  const bool negated = absl::ConsumePrefix(&list, "^");
  bool named = false;
  for (absl::string_view t : absl::StrSplit(list, ',')) named |= t == "tcp" || t == "all";
  return named != negated;
}

// The network devices of this host's transports other than tcp (InfiniBand/RoCE ports such as
// "mlx5_0:1"), from UCT's resource lists; looked up once per process.
const std::vector<std::string>& NonTcpNetworkDevices() {
  static const std::vector<std::string>* devices = [] {
    auto* out = new std::vector<std::string>;
    uct_component_h* components = nullptr;
    unsigned count = 0;
    if (uct_query_components(&components, &count) != UCS_OK) return out;
    for (unsigned c = 0; c < count; ++c) {
      uct_component_attr_t attr{};
      attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
      if (uct_component_query(components[c], &attr) != UCS_OK || attr.md_resource_count == 0) {
        continue;
      }
      std::vector<uct_md_resource_desc_t> mds(attr.md_resource_count);
      attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
      attr.md_resources = mds.data();
      if (uct_component_query(components[c], &attr) != UCS_OK) continue;
      for (const uct_md_resource_desc_t& md_resource : mds) {
        uct_md_config_t* config = nullptr;
        if (uct_md_config_read(components[c], nullptr, nullptr, &config) != UCS_OK) continue;
        uct_md_h md = nullptr;
        const ucs_status_t opened = uct_md_open(components[c], md_resource.md_name, config, &md);
        uct_config_release(config);
        if (opened != UCS_OK) continue;
        uct_tl_resource_desc_t* tls = nullptr;
        unsigned tl_count = 0;
        if (uct_md_query_tl_resources(md, &tls, &tl_count) == UCS_OK) {
          for (unsigned t = 0; t < tl_count; ++t) {
            const std::string dev = tls[t].dev_name;
            if (tls[t].dev_type == UCT_DEVICE_TYPE_NET && std::strcmp(tls[t].tl_name, "tcp") != 0 &&
                std::find(out->begin(), out->end(), dev) == out->end()) {
              out->push_back(dev);
            }
          }
          uct_release_tl_resource_list(tls);
        }
        uct_md_close(md);
      }
    }
    uct_release_component_list(components);
    return out;
  }();
  return *devices;
}

}  // namespace

absl::StatusOr<std::shared_ptr<Context>> Context::Create(
    bool wakeup, std::string_view uri, bool one_host,
    const std::vector<std::string>& tcp_interfaces) {
  RouteUcxLogs();  // before UCX reads its configuration (it warns about unknown UCX_* there)
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) {
    return UcsError(s, absl::StrFormat("%s: reading the UCX configuration (UCX_* variables)", uri));
  }
  const char* tls = std::getenv("UCX_TLS");
  if (!(one_host && tls == nullptr) && std::getenv("UCX_NET_DEVICES") == nullptr &&
      TlsSelectsTcp(tls)) {
    // UCX's tcp opens a listening socket on every interface it uses (UCX_NET_DEVICES=all):
    // confine it to the channel's interfaces, keeping every other network device.
    std::vector<std::string> devices = NonTcpNetworkDevices();
    for (const std::string& i :
         tcp_interfaces.empty() ? std::vector<std::string>{LoopbackInterface()} : tcp_interfaces) {
      if (std::find(devices.begin(), devices.end(), i) == devices.end()) devices.push_back(i);
    }
    const std::string list = absl::StrJoin(devices, ",");
    s = ucp_config_modify(config, "NET_DEVICES", list.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      return UcsError(s, absl::StrFormat("%s: setting UCX_NET_DEVICES=%s", uri, list));
    }
    Log(LogLevel::kDebug, "%s: UCX_NET_DEVICES unset: using UCX_NET_DEVICES=%s", uri, list);
  }
  if (one_host && tls == nullptr) {
    s = ucp_config_modify(config, "TLS", "^tcp");
    if (s != UCS_OK) {
      ucp_config_release(config);
      return UcsError(s, absl::StrFormat("%s: setting UCX_TLS=^tcp for a one-host channel", uri));
    }
    Log(LogLevel::kDebug, "%s: one host (loopback address), UCX_TLS unset: using UCX_TLS=^tcp",
        uri);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | (wakeup ? UCP_FEATURE_WAKEUP : 0);
  params.mt_workers_shared = 1;  // registrations happen on callers' threads, progress on another
  ucp_context_h context = nullptr;
  s = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (s != UCS_OK) {
    absl::Status e = UcsError(s, absl::StrFormat("%s: initializing UCX (ucp_init; check UCX_TLS "
                                                 "and UCX_NET_DEVICES)",
                                                 uri));
    return absl::Status(s == UCS_ERR_NO_MEMORY ? e.code() : absl::StatusCode::kUnavailable,
                        e.message());
  }
  return std::shared_ptr<Context>(new Context(context));
}

Context::~Context() { ucp_cleanup(context_); }

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(std::shared_ptr<Context> context,
                                                       std::string_view uri) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h worker = nullptr;
  ucs_status_t s = ucp_worker_create(context->get(), &params, &worker);
  if (s != UCS_OK) {
    absl::Status e = UcsError(s, absl::StrFormat("%s: creating a UCX worker", uri));
    return absl::Status(s == UCS_ERR_NO_MEMORY ? e.code() : absl::StatusCode::kUnavailable,
                        e.message());
  }
  return std::unique_ptr<Worker>(new Worker(std::move(context), worker));
}

Worker::~Worker() { ucp_worker_destroy(worker_); }

absl::StatusOr<std::string> Worker::Address() const {
  ucp_address_t* address = nullptr;
  size_t length = 0;
  ucs_status_t s = ucp_worker_get_address(worker_, &address, &length);
  if (s != UCS_OK) return UcsError(s, "ucp_worker_get_address");
  std::string out(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(worker_, address);
  return out;
}

absl::StatusOr<int> Worker::EventFd() const {
  int fd = -1;
  ucs_status_t s = ucp_worker_get_efd(worker_, &fd);
  if (s != UCS_OK) return UcsError(s, "ucp_worker_get_efd");
  return fd;
}

namespace {

absl::StatusOr<std::unique_ptr<MemRegion>> Map(
    std::shared_ptr<Context> context, void* address, size_t length, ucs_memory_type_t type,
    bool allocate,
    std::unique_ptr<MemRegion> (*make)(std::shared_ptr<Context>, ucp_mem_h, void*, size_t,
                                       ucs_memory_type_t)) {
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = address;
  params.length = length;
  params.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
  params.memory_type = type;
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context->get(), &params, &memh);
  if (s != UCS_OK) {
    return UcsError(s, absl::StrFormat("%s %d bytes of %s memory (ucp_mem_map)",
                                       allocate ? "allocating and registering" : "registering",
                                       length, ucs_memory_type_names[type]));
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  s = ucp_mem_query(memh, &attr);
  if (s != UCS_OK) {
    ucp_mem_unmap(context->get(), memh);
    return UcsError(s, "ucp_mem_query");
  }
  return make(std::move(context), memh, attr.address, length, type);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MemRegion>> MemRegion::Allocate(std::shared_ptr<Context> context,
                                                               size_t length,
                                                               ucs_memory_type_t type) {
  return Map(std::move(context), nullptr, length, type, /*allocate=*/true,
             [](std::shared_ptr<Context> c, ucp_mem_h m, void* a, size_t n, ucs_memory_type_t t) {
               return std::unique_ptr<MemRegion>(new MemRegion(std::move(c), m, a, n, t));
             });
}

absl::StatusOr<std::unique_ptr<MemRegion>> MemRegion::Register(std::shared_ptr<Context> context,
                                                               void* address, size_t length,
                                                               ucs_memory_type_t type) {
  return Map(std::move(context), address, length, type, /*allocate=*/false,
             [](std::shared_ptr<Context> c, ucp_mem_h m, void* a, size_t n, ucs_memory_type_t t) {
               return std::unique_ptr<MemRegion>(new MemRegion(std::move(c), m, a, n, t));
             });
}

MemRegion::~MemRegion() { ucp_mem_unmap(context_->get(), memh_); }

absl::StatusOr<std::string> MemRegion::PackRkey() const {
  void* buffer = nullptr;
  size_t size = 0;
  ucs_status_t s = ucp_rkey_pack(context_->get(), memh_, &buffer, &size);
  if (s != UCS_OK) return UcsError(s, "packing a remote key (ucp_rkey_pack)");
  std::string out(static_cast<const char*>(buffer), size);
  ucp_rkey_buffer_release(buffer);
  return out;
}

absl::StatusOr<std::unique_ptr<RemoteKey>> RemoteKey::Unpack(ucp_ep_h ep, const std::string& packed,
                                                             std::string_view what) {
  ucp_rkey_h rkey = nullptr;
  ucs_status_t s = ucp_ep_rkey_unpack(ep, packed.data(), &rkey);
  if (s != UCS_OK) {
    absl::Status e = UcsError(s, absl::StrFormat("unpacking the remote key of %s", what));
    // A key that cannot be used from here (its memory cannot be reached, or the peer that
    // owns it is gone) is a peer problem, not a local bug.
    return absl::Status(s == UCS_ERR_NO_MEMORY ? e.code() : absl::StatusCode::kUnavailable,
                        e.message());
  }
  return std::unique_ptr<RemoteKey>(new RemoteKey(rkey));
}

RemoteKey::~RemoteKey() { ucp_rkey_destroy(rkey_); }

RmaTransports ContextRmaTransports(const Context& context) {
  RmaTransports out;
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (f == nullptr) return out;
  ucp_context_print_info(context.get(), f);
  std::fclose(f);
  // Lines such as "#      resource 2  :  md 1  dev 2  flags -- tcp/lo".
  for (absl::string_view line : absl::StrSplit(absl::string_view(text, size), '\n')) {
    if (!absl::StrContains(line, "resource")) continue;
    const size_t at = line.find("-- ");
    if (at == absl::string_view::npos) continue;
    absl::string_view tl = line.substr(at + 3);
    tl = tl.substr(0, tl.find('/'));
    if (tl == "self" || tl == "tcp" || absl::StartsWith(tl, "ud") || absl::EndsWith(tl, "_copy")) {
      continue;  // no RMA to a peer (self: this worker only; cuda_copy, gdr_copy: local memory)
    }
    if (tl == "posix" || tl == "sysv" || tl == "cma" || tl == "knem" || tl == "xpmem" ||
        tl == "cuda_ipc" || tl == "rocm_ipc") {
      out.one_host = true;
    } else {
      out.network = true;
    }
  }
  std::free(text);
  return out;
}

#ifdef WEIGHTBUS_UCX_CUDA

bool CudaSupported() {
  static const bool supported = [] {
    int n = 0;
    const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
    if (!ok) (void)cudaGetLastError();
    return ok;
  }();
  return supported;
}

bool UcxMovesCudaMemory() {
  static const bool moves = [] {
    if (!CudaSupported()) return false;
    RouteUcxLogs();
    ucp_config_t* config = nullptr;
    if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return false;
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA;
    ucp_context_h context = nullptr;
    const ucs_status_t s = ucp_init(&params, config, &context);
    ucp_config_release(config);
    if (s != UCS_OK) return false;
    ucp_context_attr_t attr{};
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    const bool cuda = ucp_context_query(context, &attr) == UCS_OK &&
                      (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
    ucp_cleanup(context);
    Log(LogLevel::kDebug, "ucx: UCX %s CUDA memory", cuda ? "moves" : "does not move");
    return cuda;
  }();
  return moves;
}

ucs_memory_type_t DetectMemoryType(const void* p) {
  if (p == nullptr || !CudaSupported()) return UCS_MEMORY_TYPE_HOST;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return UCS_MEMORY_TYPE_HOST;
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      return UCS_MEMORY_TYPE_CUDA;
    case cudaMemoryTypeManaged:
      return UCS_MEMORY_TYPE_CUDA_MANAGED;
    default:
      return UCS_MEMORY_TYPE_HOST;
  }
}

absl::Status CopyBytes(void* dst, const void* src, size_t n) {
  if (n == 0) return absl::OkStatus();
  if (DetectMemoryType(dst) == UCS_MEMORY_TYPE_HOST &&
      DetectMemoryType(src) == UCS_MEMORY_TYPE_HOST) {
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  }
  const cudaError_t e = cudaMemcpy(dst, src, n, cudaMemcpyDefault);
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrFormat("cudaMemcpy of %d bytes: %s", n, cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

#else

bool CudaSupported() { return false; }
bool UcxMovesCudaMemory() { return false; }
ucs_memory_type_t DetectMemoryType(const void*) { return UCS_MEMORY_TYPE_HOST; }
absl::Status CopyBytes(void* dst, const void* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
  return absl::OkStatus();
}

#endif

namespace {

thread_local bool quiet_ucx_errors = false;

// UCX's own handler prints to stdout (UCX_LOG_FILE's default), which is the host program's:
// warnings and errors go to weightbus's log (stderr) instead, and errors of a QuietUcxErrors
// scope to its debug level. Other levels (UCX_LOG_LEVEL=info and up) go on to UCX's handler.
ucs_log_func_rc_t FilterUcxLog(const char* file, unsigned line, const char* function,
                               ucs_log_level_t level, const ucs_log_component_config_t* comp_conf,
                               const char* message, va_list ap) {
  if (level > UCS_LOG_LEVEL_WARN) return UCS_LOG_FUNC_RC_CONTINUE;
  if (!quiet_ucx_errors || level > UCS_LOG_LEVEL_ERROR) {
    const LogLevel ours = level == UCS_LOG_LEVEL_WARN ? LogLevel::kWarn : LogLevel::kError;
    if (LogEnabled(ours)) {
      char text[1024];
      std::vsnprintf(text, sizeof(text), message, ap);
      Log(ours, "UCX (%s:%d): %s", file, line, text);
    }
    return UCS_LOG_FUNC_RC_STOP;
  }
  if (LogEnabled(LogLevel::kDebug)) {
    char text[1024];
    std::vsnprintf(text, sizeof(text), message, ap);
    Log(LogLevel::kDebug, "UCX (expected, %s:%d): %s", file, line, text);
  }
  return UCS_LOG_FUNC_RC_STOP;
}

void RouteUcxLogs() {
  static std::once_flag pushed;
  // UCX calls the most recently pushed handler first; this one passes the rest on.
  std::call_once(pushed, [] { ucs_log_push_handler(&FilterUcxLog); });
}

}  // namespace

QuietUcxErrors::QuietUcxErrors() {
  RouteUcxLogs();
  quiet_ucx_errors = true;
}

QuietUcxErrors::~QuietUcxErrors() { quiet_ucx_errors = false; }

ucs_status_t WaitRequest(ucp_worker_h worker, ucs_status_ptr_t request, absl::Time deadline) {
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  ucs_status_t s;
  while ((s = ucp_request_check_status(request)) == UCS_INPROGRESS) {
    ucp_worker_progress(worker);
    if (absl::Now() > deadline) {
      ucp_request_free(request);
      return UCS_ERR_TIMED_OUT;
    }
  }
  ucp_request_free(request);
  return s;
}

}  // namespace weightbus::internal::ucx

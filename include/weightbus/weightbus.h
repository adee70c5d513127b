/* SPDX-License-Identifier: Apache-2.0 */
/*
 * weightbus C API: the stable ABI of libweightbus (C11, usable from C and any FFI).
 *
 * A trainer publishes versions of a set of named tensors to a channel named by a URI; inference
 * replicas subscribe and receive each version whole and verified, or not at all:
 *
 *   disk:///path/to/channel   a shared filesystem; each version is a safetensors checkpoint
 *   ucx://host:port/channel   UCX one-sided RDMA; the publisher serves versions on host:port
 *                             (shared memory or TCP on one host, InfiniBand/RoCE between hosts)
 *   delta+disk:///path/...    the delta layer over a transport (delta+ucx://host:port/ch too):
 *                             keyframes and deltas against the previous version, compressed
 *
 * Which schemes this build has: wb_transport_count and wb_transport_scheme (a scheme that is
 * not built in fails wb_*_create with WB_UNIMPLEMENTED listing those that are). Settings
 * (wb_setting_count, wb_setting_info) come from their defaults, WEIGHTBUS_* environment
 * variables, the URI's query (disk:///x?retention=4) and wb_open_params_t.options, lowest
 * precedence first.
 *
 * Conventions (docs/CONVENTIONS.md, "The C API"):
 *   - Every symbol starts with wb_ (WB_ for macros and enumerators); handles are typed and
 *     opaque; every create has a destroy that accepts NULL.
 *   - Every function that can fail returns wb_status_t. Outputs are the last parameters and are
 *     written only when the call returns WB_OK. The full message of the last failed call on the
 *     calling thread is wb_last_error_message().
 *   - No C++ exception crosses this API; a bad_alloc becomes WB_RESOURCE_EXHAUSTED and any other
 *     exception WB_INTERNAL.
 *   - Parameter structs start with `struct_size`; initialize them with their WB_*_INIT macro.
 *     A library reads only the first struct_size bytes (fields an older caller does not know
 *     take their defaults) and rejects non-zero bytes beyond the fields it knows
 *     (WB_UNIMPLEMENTED), so structs grow without breaking the ABI. A NULL params pointer means
 *     every default.
 *   - Tensors cross as DLPack 0.6 DLTensor (dlpack/dlpack.h) with their names alongside.
 *     DLPack 0.6 has no code for BOOL and the F8 types: pass such tensors as 8-bit unsigned
 *     integers and name the real type in a wb_dtype_t override; received ones are exposed as
 *     uint8 DLTensors whose wb_dtype_t says what they are. An override also lets a caller
 *     publish, e.g., a uint16 array as BF16 (the element sizes must agree).
 *   - Timeouts are in milliseconds; WB_TIMEOUT_INFINITE (any negative value) waits forever.
 *
 * Thread safety: every function may be called from any thread. Calls on one publisher or one
 * subscriber are serialized internally; destroy and cancel may come from another thread while a
 * call is in flight (see wb_subscriber_destroy). A wb_update_t is immutable and may be read from
 * several threads at once.
 *
 * fork(): a handle belongs to the process that created it. In a forked child every call on an
 * inherited publisher or subscriber fails at once with WB_FAILED_PRECONDITION (create a new
 * handle in the child); destroy there frees nothing. The parent is never affected.
 */
#pragma once

#include <dlpack/dlpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "weightbus/export.h"
#include "weightbus/version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------ */
/* Status                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/*
 * Result of every fallible call, in three ranges:
 *   0         success
 *   1..99     transient: the same call may succeed later (WB_STATUS_IS_RETRYABLE)
 *   100..199  the call is wrong, conflicts with the channel's state, or the data is bad:
 *             repeating the same call fails the same way
 *   200..255  unexpected failure inside the library or the system; read the message
 */
typedef enum wb_status {
  WB_OK = 0,

  WB_DEADLINE_EXCEEDED = 1,  /* the timeout passed first */
  WB_UNAVAILABLE = 2,        /* a peer is gone or not reachable yet */
  WB_RESOURCE_EXHAUSTED = 3, /* out of disk space or memory: retry after freeing some */
  WB_ABORTED = 4,            /* interrupted by a concurrent operation */

  WB_INVALID_ARGUMENT = 100,    /* the caller's input: tensor, URI, setting, binding */
  WB_FAILED_PRECONDITION = 101, /* channel state: version not above the latest, channel held */
  WB_NOT_FOUND = 102,           /* a named file, tensor or channel does not exist */
  WB_ALREADY_EXISTS = 103,      /* something to be created exists already */
  WB_PERMISSION_DENIED = 104,   /* access refused: by the system (the message names the path) or
                                   by a shared-secret channel (an unauthenticated peer or version,
                                   docs/SECURITY.md) */
  WB_OUT_OF_RANGE = 105,        /* an index or value past the valid range */
  WB_UNIMPLEMENTED = 106,       /* a feature, transport, device or struct field not built in */
  WB_DATA_LOSS = 107,           /* stored or received bytes are malformed or fail a checksum */
  WB_CANCELLED = 108,           /* the operation was cancelled */

  WB_INTERNAL = 200, /* unexpected system error; the message carries the errno text */
  WB_UNKNOWN = 201   /* an error the library could not classify */
} wb_status_t;

/* True for the transient range: the same call may succeed if repeated later. */
#define WB_STATUS_IS_RETRYABLE(status) ((status) >= 1 && (status) <= 99)

/* The enumerator's name and meaning, e.g. "WB_DEADLINE_EXCEEDED: the timeout passed first
 * (retryable)". A static string, never NULL (also for values outside the enum). */
WB_EXPORT const char* wb_status_string(wb_status_t status);

/* The full message of the last wb_ call on this thread that returned a status: "" after a
 * success, the error text (naming URI, tensor, version and both sides of a mismatch) after a
 * failure. Valid until the next such call on this thread. Never NULL. */
WB_EXPORT const char* wb_last_error_message(void);

/* ------------------------------------------------------------------------------------------ */
/* Library version                                                                             */
/* ------------------------------------------------------------------------------------------ */

/* The library's version, "MAJOR.MINOR.PATCH" (WEIGHTBUS_VERSION_STRING when it was built). */
WB_EXPORT const char* wb_version(void);

/* The library's WEIGHTBUS_VERSION (major * 10000 + minor * 100 + patch). */
WB_EXPORT uint32_t wb_version_number(void);

/* WB_OK when this library can serve a program compiled against `compiled_version` (the
 * program's WEIGHTBUS_VERSION): same major version, and a library at least as new. Otherwise
 * WB_FAILED_PRECONDITION naming both versions. Call it as WB_CHECK_VERSION(). */
WB_EXPORT wb_status_t wb_check_version(uint32_t compiled_version);
#define WB_CHECK_VERSION() wb_check_version(WEIGHTBUS_VERSION)

/* ------------------------------------------------------------------------------------------ */
/* Transports and settings compiled into this library                                         */
/* ------------------------------------------------------------------------------------------ */

/*
 * Both lists are fixed when the library is loaded (transports register themselves then) and
 * are the same on every call and thread. The strings they hand out are owned by the library,
 * immutable, NUL-terminated and valid until the library is unloaded; never free them. Every
 * function here is thread-safe. Errors: WB_INVALID_ARGUMENT for a NULL output pointer,
 * WB_OUT_OF_RANGE for an index at or past the count (the message names both).
 */

/* The number of URI schemes of the transports and layers compiled in (e.g. 3: delta, disk,
 * ucx). The C++ API's weightbus::Transports(). */
WB_EXPORT wb_status_t wb_transport_count(size_t* count);

/* Scheme `index` (0 <= index < wb_transport_count), in sorted order, e.g. "disk". A layer
 * ("delta") is used stacked over a transport: "delta+disk". */
WB_EXPORT wb_status_t wb_transport_scheme(size_t index, const char** scheme);

/* One setting as the settings registry declares it (weightbus::SettingInfo; the CLI's
 * `weightbus settings` prints the same). An output struct: set struct_size
 * (WB_SETTING_INFO_INIT); the library fills the fields that fit in it. Strings as above. */
typedef struct wb_setting_info {
  size_t struct_size;
  const char* scope;         /* "core" or a transport or layer scheme, e.g. "disk" */
  const char* name;          /* the key in URI queries and options, e.g. "retention" */
  const char* type;          /* "bool", "int", "bytes", "duration", "string" or "enum(a|b)",
                                then the range and unit if declared: "int 1..64 versions" */
  const char* default_value; /* as text, parsed like any other value */
  const char* env;           /* the environment variable, e.g. "WEIGHTBUS_DISK_RETENTION" */
  const char* doc;           /* one line */
} wb_setting_info_t;
#define WB_SETTING_INFO_INIT \
  { sizeof(wb_setting_info_t), NULL, NULL, NULL, NULL, NULL, NULL }

/* The number of settings of the core and of every compiled transport and layer. */
WB_EXPORT wb_status_t wb_setting_count(size_t* count);

/* Setting `index` (0 <= index < wb_setting_count): the core's first, then each transport's in
 * scheme order. Also WB_INVALID_ARGUMENT for an info->struct_size smaller than the first
 * layout (initialize it with WB_SETTING_INFO_INIT). */
WB_EXPORT wb_status_t wb_setting_info(size_t index, wb_setting_info_t* info);

/* ------------------------------------------------------------------------------------------ */
/* Element types                                                                               */
/* ------------------------------------------------------------------------------------------ */

/* The safetensors element types. WB_DTYPE_FROM_DLPACK (0) means "as the DLTensor says". */
typedef enum wb_dtype {
  WB_DTYPE_FROM_DLPACK = 0,
  WB_DTYPE_BOOL = 1,
  WB_DTYPE_U8 = 2,
  WB_DTYPE_I8 = 3,
  WB_DTYPE_U16 = 4,
  WB_DTYPE_I16 = 5,
  WB_DTYPE_F16 = 6,
  WB_DTYPE_BF16 = 7,
  WB_DTYPE_U32 = 8,
  WB_DTYPE_I32 = 9,
  WB_DTYPE_F32 = 10,
  WB_DTYPE_U64 = 11,
  WB_DTYPE_I64 = 12,
  WB_DTYPE_F64 = 13,
  WB_DTYPE_F8_E4M3 = 14,
  WB_DTYPE_F8_E5M2 = 15,
  WB_DTYPE_F8_E8M0 = 16,
  WB_DTYPE_F8_E4M3FNUZ = 17,
  WB_DTYPE_F8_E5M2FNUZ = 18,
  WB_DTYPE_C64 = 19, /* complex of two F32: DLPack kDLComplex, 64 bits */
  /* Sub-byte types (4 and 6 bits per element, packed): channels carry them (C++ API), but a
   * DLPack 0.6 tensor cannot describe them, so the C API refuses them with WB_UNIMPLEMENTED
   * naming the tensor and dtype, both as overrides and when a received tensor is asked for. */
  WB_DTYPE_F4 = 20,
  WB_DTYPE_F6_E2M3 = 21,
  WB_DTYPE_F6_E3M2 = 22
} wb_dtype_t;

/* The safetensors name of `dtype` ("BF16", "F8_E4M3", ...); "FROM_DLPACK" for 0 and "?" for a
 * value outside the enum. A static string, never NULL. */
WB_EXPORT const char* wb_dtype_name(wb_dtype_t dtype);

/* ------------------------------------------------------------------------------------------ */
/* Parameters                                                                                  */
/* ------------------------------------------------------------------------------------------ */

#define WB_TIMEOUT_INFINITE ((int64_t)-1)

/* A setting or metadata entry: NUL-terminated UTF-8 key and value, both non-NULL. */
typedef struct wb_option {
  const char* key;
  const char* value;
} wb_option_t;

/* Parameters of wb_publisher_create and wb_subscriber_create. */
typedef struct wb_open_params {
  size_t struct_size;         /* sizeof(wb_open_params_t) */
  const wb_option_t* options; /* settings by name (as the URI query; these win), or NULL */
  size_t num_options;         /* a key given twice is WB_INVALID_ARGUMENT */
} wb_open_params_t;
#define WB_OPEN_PARAMS_INIT \
  { sizeof(wb_open_params_t), NULL, 0 }

/* This rank's slice of a larger (tensor-parallel or FSDP-sharded) tensor, recorded in the
 * manifest so that a consumer can reassemble or re-shard (weightbus::Shard). The slice is the
 * published tensor itself (its shape) and starts at `offsets` (elements, one per dimension)
 * inside a tensor of `global_shape`. `ndim` must be the tensor's ndim; both arrays have ndim
 * entries (and may be NULL when ndim is 0) and are read during the publish call only. Checked
 * at publish: 0 <= offsets[d] and offsets[d] + shape[d] <= global_shape[d], else
 * WB_INVALID_ARGUMENT naming the tensor. An array element type: it never grows. */
typedef struct wb_shard {
  int ndim;
  const int64_t* global_shape;
  const int64_t* offsets;
} wb_shard_t;

/* Parameters of wb_publisher_publish. */
typedef struct wb_publish_params {
  size_t struct_size;          /* sizeof(wb_publish_params_t) */
  const wb_option_t* metadata; /* user metadata stored with the version, or NULL */
  size_t num_metadata;
  const wb_dtype_t* dtypes; /* NULL, or one per tensor: FROM_DLPACK or an override */
  /* NULL, or one pointer per tensor: shards[i] describes tensors[i] as a shard, NULL there
   * publishes it whole. Appended in 0.1 (a caller's older, shorter struct means no shards). */
  const wb_shard_t* const* shards;
  /* A cudaStream_t whose queued work produces the kDLCUDA tensors: the publish waits for it
   * before reading them (NULL: each device's legacy default stream); ignored for host tensors
   * and by wb_publisher_begin_publish. Appended later in 0.1. */
  void* cuda_stream;
} wb_publish_params_t;
#define WB_PUBLISH_PARAMS_INIT \
  { sizeof(wb_publish_params_t), NULL, 0, NULL, NULL, NULL }

/* Parameters of wb_subscriber_bind. */
typedef struct wb_bind_params {
  size_t struct_size; /* sizeof(wb_bind_params_t) */
  wb_dtype_t dtype;   /* FROM_DLPACK or an override of the destination's element type */
} wb_bind_params_t;
#define WB_BIND_PARAMS_INIT \
  { sizeof(wb_bind_params_t), WB_DTYPE_FROM_DLPACK }

/* Figures of the last successful publish (durations in nanoseconds). An output struct: set
 * struct_size (WB_PUBLISH_STATS_INIT); the library fills the fields that fit in it. */
typedef struct wb_publish_stats {
  size_t struct_size;
  uint64_t version;
  uint64_t bytes;           /* tensor bytes published */
  int64_t stall_ns;         /* wall time the publish call blocked its caller */
  int64_t pack_ns;          /* packing non-contiguous tensors */
  int64_t checksum_wait_ns; /* waiting for checksums after the transport was done */
  int64_t transport_ns;     /* the transport's part (disk: write, fsync, commit) */
  uint64_t flags;           /* WB_PUBLISH_UNCHANGED: the call re-published the channel's latest
                               version with the same bytes (a retry); nothing was written */
  /* Appended in 0.1 (a caller's shorter struct does not receive them): */
  int64_t encode_ns;   /* part of transport_ns a layer (delta) spent encoding; 0 without one */
  uint64_t wire_bytes; /* bytes the transport carried for the tensors: `bytes`, or what a layer
                          encoded them to; 0 when a layer does not report it */
  /* Appended later in 0.1 (a caller's shorter struct does not receive it): */
  const char* encoding; /* a layer's choice for this version and why, UTF-8 (e.g. "delta: delta
                           against version 7", "plain: sent plainly: ..."); "" without a layer.
                           Owned by the library: valid until this thread's next call of
                           wb_publisher_last_stats */
} wb_publish_stats_t;
#define WB_PUBLISH_STATS_INIT \
  { sizeof(wb_publish_stats_t), 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL }
#define WB_PUBLISH_UNCHANGED ((uint64_t)1)

/* Timing of one received version (durations in nanoseconds). Output struct as above. */
typedef struct wb_update_stats {
  size_t struct_size;
  uint64_t bytes;         /* tensor bytes received */
  int64_t wait_ns;        /* until a new enough version was found */
  int64_t allocate_ns;    /* mapping library buffers */
  int64_t fetch_ns;       /* receiving the bytes (checksums overlap with it) */
  int64_t verify_wait_ns; /* waiting for checksums after the last byte arrived */
  int64_t copy_out_ns;    /* copying staged bytes into bound destinations */
  int64_t ready_unix_ns;  /* when the version was complete and verified (CLOCK_REALTIME) */
  /* Appended in 0.1 (a caller's shorter struct does not receive them): */
  int64_t decode_ns;   /* part of fetch_ns a layer (delta) spent decoding; 0 without one */
  uint64_t wire_bytes; /* bytes received for the tensors: `bytes`, or their encoded size under
                          a layer; 0 when a layer does not report it */
  /* Appended later in 0.1 (a caller's shorter struct does not receive it): */
  const char* encoding; /* how a layer reconstructed it, UTF-8 (e.g. "delta 8 on this
                           subscriber's copy of version 7"); "" without a layer. Owned by the
                           update: valid until wb_update_destroy */
} wb_update_stats_t;
#define WB_UPDATE_STATS_INIT \
  { sizeof(wb_update_stats_t), 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL }

/* One tensor of a version as its manifest describes it (weightbus::TensorInfo): also for
 * sub-byte dtypes, which have no DLTensor. An output struct: set struct_size
 * (WB_TENSOR_INFO_INIT); the library fills the fields that fit in it. The pointers are owned by
 * the update and valid until wb_update_destroy. */
typedef struct wb_tensor_info {
  size_t struct_size;
  const char* name;     /* NUL-terminated UTF-8 */
  wb_dtype_t dtype;     /* the safetensors type (never WB_DTYPE_FROM_DLPACK) */
  int ndim;             /* 0 for a scalar */
  const int64_t* shape; /* ndim elements (NULL when ndim is 0) */
  uint64_t nbytes;      /* bytes of the contiguous row-major tensor */
  uint64_t xxh3;        /* XXH3-64 (seed 0) of those bytes, as verified on receipt */
  bool has_shard;       /* the publisher described the tensor as a shard (wb_shard_t) */
  /* With has_shard, ndim elements each (NULL when ndim is 0); NULL without: */
  const int64_t* shard_global_shape;
  const int64_t* shard_offsets;
} wb_tensor_info_t;
#define WB_TENSOR_INFO_INIT \
  { sizeof(wb_tensor_info_t), NULL, WB_DTYPE_FROM_DLPACK, 0, NULL, 0, 0, false, NULL, NULL }

/* ------------------------------------------------------------------------------------------ */
/* Publisher                                                                                   */
/* ------------------------------------------------------------------------------------------ */

typedef struct wb_publisher wb_publisher_t;

/* Opens `uri` for publishing. Errors: WB_INVALID_ARGUMENT (malformed URI or setting),
 * WB_UNIMPLEMENTED (scheme not built in; the message lists those that are),
 * WB_FAILED_PRECONDITION (another live publisher holds the channel), transport errors. */
WB_EXPORT wb_status_t wb_publisher_create(const char* uri, const wb_open_params_t* params,
                                          wb_publisher_t** publisher);

/* Releases the channel (versions already published stay available). NULL is a no-op.
 * May be called while other threads are inside calls on `publisher`: it first cancels as
 * wb_publisher_cancel does, then waits for those calls to return (a wait for staging slots or
 * receivers ends promptly with WB_CANCELLED; bytes already being written finish first, bounded
 * by that call's timeout), then frees. No call may start on `publisher` once destroy returned.
 * In a process forked from the one that created it, frees nothing (the parent's handle is
 * unaffected). */
WB_EXPORT void wb_publisher_destroy(wb_publisher_t* publisher);

/* Makes calls in flight on `publisher` in other threads return WB_CANCELLED promptly where they
 * wait, and every later call fail with WB_CANCELLED; the handle stays valid until destroyed.
 * Returns at once. For a host that must stop other threads' calls before destroying. */
WB_EXPORT wb_status_t wb_publisher_cancel(wb_publisher_t* publisher);

/* Publishes `num_tensors` tensors as `version`, all or nothing. names[i] names tensors[i]
 * (unique, non-empty UTF-8). The bytes are read during the call only (non-contiguous tensors,
 * i.e. with strides, are gathered as they are sent, with at most a bounded window of extra
 * memory; byte_offset is honoured). `version` must be above every version on the channel, or
 * equal to the latest with the same bytes (a retry: WB_OK, nothing written). kDLCUDA tensors
 * (builds with CUDA, wb_supports_cuda_tensors; any strides) are read after the work queued on
 * params->cuda_stream, in place by a transport that moves device memory and through pinned host
 * memory by any other (Publisher::Publish in weightbus.hpp). Errors: WB_FAILED_PRECONDITION
 * (version not above the latest; a CUDA device this process cannot use), WB_INVALID_ARGUMENT (a
 * bad name, dtype, shape, strides or override, naming the tensor; kDLCUDA data that is not that
 * device's memory), WB_UNIMPLEMENTED (a device this build does not accept: kDLCUDA without CUDA
 * support, kDLOpenCL, ...), WB_DEADLINE_EXCEEDED, WB_RESOURCE_EXHAUSTED (disk, device or pinned
 * memory full), WB_INTERNAL. */
WB_EXPORT wb_status_t wb_publisher_publish(wb_publisher_t* publisher, uint64_t version,
                                           const char* const* names, const DLTensor* tensors,
                                           size_t num_tensors, const wb_publish_params_t* params,
                                           int64_t timeout_ms);

/* The newest version on the channel (published by anyone): *has_version = false when there is
 * none yet (then *version is 0). */
WB_EXPORT wb_status_t wb_publisher_latest_version(wb_publisher_t* publisher, bool* has_version,
                                                  uint64_t* version);

/* Figures of the last successful publish (all zero before the first). */
WB_EXPORT wb_status_t wb_publisher_last_stats(wb_publisher_t* publisher, wb_publish_stats_t* stats);

/* Waits up to `timeout_ms` until at least `count` distinct subscribers have received and
 * verified `version` (or a newer version), e.g. to keep a one-shot publisher serving until its
 * replicas have the weights (Publisher::WaitForReceivers). A subscriber counts once however
 * often it reconnects while the same subscriber handle lives; one that received the version and
 * left still counts. Thread-safe like every call on the handle; wb_publisher_cancel (or destroy)
 * from another thread ends the wait promptly with WB_CANCELLED. Errors: WB_DEADLINE_EXCEEDED
 * naming how many had it; WB_INVALID_ARGUMENT for count < 1; WB_UNIMPLEMENTED for transports
 * that cannot tell (disk://: subscribers never talk to the publisher); WB_CANCELLED. */
WB_EXPORT wb_status_t wb_publisher_wait_for_receivers(wb_publisher_t* publisher, uint64_t version,
                                                      int count, int64_t timeout_ms);

/* The URI the publisher was created with, as given. Owned by the handle: valid until
 * wb_publisher_destroy. */
WB_EXPORT wb_status_t wb_publisher_uri(wb_publisher_t* publisher, const char** uri);

/* Host memory for the tensors a publisher publishes (Publisher::AllocateHost in weightbus.hpp):
 * `bytes` bytes at *data, 4096-byte aligned and zero-filled, that the publisher's transport
 * serves fastest when a publish's tensors lie in it (ucx:// with publish_mode=zero_copy: memory
 * UCX allocated and registered, which subscribers on the same host map and copy at memory speed;
 * other transports: plain anonymous memory). Keep the tensors of one publish in one allocation.
 * Owned by the caller: free it with wb_host_memory_free, before or after destroying the
 * publisher, never while a publish reads it. In a child forked after the allocation, freeing it
 * releases only the handle (the mapping stays in the child until it exits). UCX's shared-memory
 * pages are shared with the parent, not copied at fork: a child must not write them. Errors:
 * WB_INVALID_ARGUMENT (0 bytes or more than 2^62), WB_RESOURCE_EXHAUSTED (naming the size),
 * WB_CANCELLED. *memory and *data are written only on WB_OK. */
typedef struct wb_host_memory wb_host_memory_t;
WB_EXPORT wb_status_t wb_publisher_allocate_host(wb_publisher_t* publisher, uint64_t bytes,
                                                 wb_host_memory_t** memory, void** data);
/* Frees memory from wb_publisher_allocate_host. NULL is a no-op. */
WB_EXPORT void wb_host_memory_free(wb_host_memory_t* memory);

/* ------------------------------------------------------------------------------------------ */
/* Streaming publish: one version tensor by tensor (weightbus::PublishStream)                 */
/* ------------------------------------------------------------------------------------------ */

/* A version being published tensor by tensor: begin it, add each tensor as it is produced (the
 * caller may free a host tensor as soon as its add returns), then commit or abort. All or
 * nothing like wb_publisher_publish: nothing of the version is visible to any subscriber before
 * commit returns WB_OK; abort, destroying the stream uncommitted, a failed commit or the process
 * dying leaves nothing a subscriber sees. Added bytes go through a host bucket (setting
 * stream_bucket, pinned for CUDA tensors) into an unlinked temporary file in stream_spill_dir,
 * so the process holds the bucket, not the model. One thread drives a stream (not thread-safe);
 * a publisher has at most one open stream. Once its publisher is cancelled or destroyed, every
 * call on the stream returns WB_CANCELLED (destroy it still). */
typedef struct wb_publish_stream wb_publish_stream_t;

/* Parameters of wb_publish_stream_add. */
typedef struct wb_stream_add_params {
  size_t struct_size;      /* sizeof(wb_stream_add_params_t) */
  wb_dtype_t dtype;        /* FROM_DLPACK or an override of the tensor's element type */
  const wb_shard_t* shard; /* NULL, or the tensor as a shard of a larger one (wb_shard_t) */
  void* cuda_stream;       /* a cudaStream_t for kDLCUDA tensors (NULL: the legacy default
                              stream); ignored for host tensors */
} wb_stream_add_params_t;
#define WB_STREAM_ADD_PARAMS_INIT \
  { sizeof(wb_stream_add_params_t), WB_DTYPE_FROM_DLPACK, NULL, NULL }

/* Begins publishing `version` tensor by tensor. `params` gives its metadata (dtypes and shards
 * must be NULL: they are per tensor, in wb_stream_add_params_t); NULL for none. Errors:
 * WB_FAILED_PRECONDITION (the channel has a higher version, naming both; or this publisher
 * already has an open stream, naming its version), WB_INVALID_ARGUMENT (reserved or non-UTF-8
 * metadata, dtypes or shards given), creating the spool file in stream_spill_dir: WB_NOT_FOUND
 * (no such directory), WB_PERMISSION_DENIED (not writable), WB_RESOURCE_EXHAUSTED (no space or
 * memory), WB_INTERNAL (other system errors); WB_CANCELLED. *stream is written only on WB_OK. */
WB_EXPORT wb_status_t wb_publisher_begin_publish(wb_publisher_t* publisher, uint64_t version,
                                                 const wb_publish_params_t* params,
                                                 wb_publish_stream_t** stream);

/* Adds `tensor` named `name` (unique, non-empty UTF-8) as the version's next tensor. Host
 * tensors (kDLCPU, kDLCUDAHost, kDLCUDAManaged; strided ones gathered) are copied before this
 * returns. A kDLCUDA tensor (contiguous; builds with CUDA only, wb_supports_cuda_tensors) is
 * copied asynchronously to the pinned bucket on params->cuda_stream, overlapping whatever the
 * caller does next; its memory must stay valid until the next call on this stream returns.
 * Errors, naming the tensor and the version: WB_INVALID_ARGUMENT (a bad name, dtype, shape,
 * strides, shard or override, a name already added: the stream stays open, the tensor was not
 * added), WB_UNIMPLEMENTED (kDLCUDA without CUDA support: likewise), WB_FAILED_PRECONDITION
 * (after commit or abort), WB_CANCELLED, WB_INTERNAL / WB_RESOURCE_EXHAUSTED (spool file: the
 * version is dropped; abort or destroy). */
WB_EXPORT wb_status_t wb_publish_stream_add(wb_publish_stream_t* stream, const char* name,
                                            const DLTensor* tensor,
                                            const wb_stream_add_params_t* params);

/* Publishes the tensors added as the stream's version, with wb_publisher_publish's guarantee and
 * errors; afterwards the stream is finished either way (wb_publisher_last_stats describes a
 * successful commit). */
WB_EXPORT wb_status_t wb_publish_stream_commit(wb_publish_stream_t* stream, int64_t timeout_ms);

/* Drops the version (nothing of it is visible) and frees the spool. No effect after commit or a
 * previous abort. */
WB_EXPORT wb_status_t wb_publish_stream_abort(wb_publish_stream_t* stream);

/* Aborts the version unless committed and frees the handle. NULL is a no-op. */
WB_EXPORT void wb_publish_stream_destroy(wb_publish_stream_t* stream);

/* Whether this build accepts kDLCUDA tensors in wb_publish_stream_add (built with CUDA). */
WB_EXPORT bool wb_supports_cuda_tensors(void);

/* ------------------------------------------------------------------------------------------ */
/* Subscriber                                                                                  */
/* ------------------------------------------------------------------------------------------ */

typedef struct wb_subscriber wb_subscriber_t;
typedef struct wb_update wb_update_t;

/* Opens `uri` for subscribing; the channel need not exist yet. Errors as wb_publisher_create. */
WB_EXPORT wb_status_t wb_subscriber_create(const char* uri, const wb_open_params_t* params,
                                           wb_subscriber_t** subscriber);

/* Placements (weightbus/placement.hpp, docs/RESHARDING.md "Subscribing with placements"): the
 * slice of each tensor one worker of a tensor-parallel (TP) group receives. */
typedef enum wb_placement_kind {
  WB_PLACEMENT_REPLICATE = 0, /* the whole tensor */
  WB_PLACEMENT_SHARD = 1,     /* 1/tp_size of dimension `dim` (0 column-, 1 row-parallel) */
  WB_PLACEMENT_QKV = 2,       /* vLLM qkv_proj from q/k/v with grouped-query attention */
  WB_PLACEMENT_MERGED = 3,    /* vLLM MergedColumnParallelLinear (gate_up_proj) */
  WB_PLACEMENT_EXPERTS = 4    /* stacked experts split on dimension 0 (expert parallel) */
} wb_placement_kind_t;

/* One rule: tensors whose name matches `pattern` (fnmatch(3) glob, '*' also matches '.' and
 * '/') get this placement; the first matching rule wins, a name none matches is received whole.
 * QKV: num_heads, num_kv_heads, head_size (rows), and optionally `fused` and `parts` (NULL:
 * "qkv_proj" from "q_proj", "k_proj", "v_proj"). MERGED: `fused` and its `parts` in order
 * (e.g. "gate_up_proj" from "gate_proj", "up_proj"). EXPERTS: `expert_order` 0 linear, 1 round
 * robin. Strings are read during the call only. An array element type: it never grows. */
typedef struct wb_placement_rule {
  const char* pattern;
  wb_placement_kind_t kind;
  int dim;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  const char* fused;
  const char* const* parts;
  size_t num_parts;
  int expert_order;
} wb_placement_rule_t;

/* The expert fields of a WB_PLACEMENT_EXPERTS rule (weightbus/placement.hpp: Placement's
 * num_experts, ep_size, ep_rank, expert_tp_size, expert_tp_rank, expert_tp_dim):
 * num_experts > 0: one source tensor per expert and part, "{e}" in each part standing for the
 * expert number (vLLM's FusedMoE w13_weight from "experts.{e}.gate_proj." and
 * "experts.{e}.up_proj." replacing "experts.w13_"); 0: stacked [E, ...] sources.
 * ep_size/ep_rank: the expert-parallel group that deals the experts (ep_size 0: the TP group).
 * expert_tp_size/expert_tp_rank/expert_tp_dim: tensor parallelism inside each expert, that
 * dimension of each expert's part split (0 or 1: experts whole). All zero: as the rule alone. */
typedef struct wb_placement_experts {
  int64_t num_experts;
  int ep_size;
  int ep_rank;
  int expert_tp_size;
  int expert_tp_rank;
  int expert_tp_dim;
} wb_placement_experts_t;

/* Parameters of wb_subscriber_create_tp: this worker's rank among tp_size, its rules, and
 * optionally the destination tensors to receive (NULL: every tensor of the version; needed
 * for fused destinations such as qkv_proj, which the version does not have).
 * `experts` (NULL: none) has num_rules entries, entry i read for rules[i] when it is
 * WB_PLACEMENT_EXPERTS. `skip_absent` nonzero: a destination none of whose sources a version
 * has is left out of that update instead of failing it with WB_NOT_FOUND (vLLM's load_weights
 * leaves a parameter the checkpoint does not name as it is); a destination with only some of
 * its sources, or a version with a source for none of them, is still WB_NOT_FOUND. */
typedef struct wb_placements {
  size_t struct_size; /* sizeof(wb_placements_t) */
  const wb_placement_rule_t* rules;
  size_t num_rules;
  int tp_size;
  int tp_rank;
  const char* const* tensors;
  size_t num_tensors;
  const wb_placement_experts_t* experts;
  int skip_absent;
} wb_placements_t;
#define WB_PLACEMENTS_INIT \
  { sizeof(wb_placements_t), NULL, 0, 1, 0, NULL, 0, NULL, 0 }

/* As wb_subscriber_create, for one worker of a TP group: every update holds only this worker's
 * slices (slice-shaped, row-major; bound destinations must be slice-shaped), and only the
 * published parts those slices meet are fetched. Errors here: WB_INVALID_ARGUMENT for a rank
 * outside [0, tp_size), an unknown kind or a NULL pattern. On receive, before any byte is
 * fetched: WB_INVALID_ARGUMENT naming the tensor, dimension and degree when tp_size does not
 * divide a dimension or head count, WB_NOT_FOUND for a destination or source the version
 * lacks; the previous version stays current. */
WB_EXPORT wb_status_t wb_subscriber_create_tp(const char* uri, const wb_open_params_t* params,
                                              const wb_placements_t* placements,
                                              wb_subscriber_t** subscriber);

/* Closes the subscriber. Updates it returned stay valid. NULL is a no-op. May be called while
 * other threads are inside calls on `subscriber`: it first cancels as wb_subscriber_cancel does
 * (a wait for a version returns WB_CANCELLED promptly), then waits for those calls to return (a
 * receive already under way finishes or fails by its own deadline), then frees. No call may
 * start on `subscriber` once destroy returned. In a forked child, frees nothing. */
WB_EXPORT void wb_subscriber_destroy(wb_subscriber_t* subscriber);

/* Makes a wait in flight on `subscriber` in another thread return WB_CANCELLED promptly, and
 * every later call fail with WB_CANCELLED; the handle stays valid until destroyed. Returns at
 * once. */
WB_EXPORT wb_status_t wb_subscriber_cancel(wb_subscriber_t* subscriber);

/* Makes later updates write tensor `name` into `destination` (any non-overlapping strides)
 * instead of library memory, replacing an earlier binding. The memory must stay valid while
 * bound. Before any byte is written, each bound destination is checked against the manifest
 * (dtype, shape): a mismatch fails the wait with WB_INVALID_ARGUMENT naming both sides, and
 * nothing is written. A kDLCUDA destination (builds with CUDA; any strides) is written on the
 * library's own CUDA streams, which it waits for before a receive returns: in place or through
 * device staging by a transport that moves device memory, else copied from verified host memory
 * (Subscriber::Bind in weightbus.hpp); work the caller queued on it must be complete before the
 * receive begins. Received tensors of such a binding are exposed as kDLCUDA. Errors here:
 * WB_INVALID_ARGUMENT (NULL data with a non-zero size, bad shape, strides or override; kDLCUDA
 * data that is not that device's memory), WB_UNIMPLEMENTED (a device this build does not
 * accept), WB_FAILED_PRECONDITION (a CUDA device this process cannot use). */
WB_EXPORT wb_status_t wb_subscriber_bind(wb_subscriber_t* subscriber, const char* name,
                                         const DLTensor* destination,
                                         const wb_bind_params_t* params);

/* Removes the binding of `name` (no error when there is none). */
WB_EXPORT wb_status_t wb_subscriber_unbind(wb_subscriber_t* subscriber, const char* name);

/* Removes every binding. */
WB_EXPORT wb_status_t wb_subscriber_unbind_all(wb_subscriber_t* subscriber);

/* Waits up to `timeout_ms` for a version v >= max(min_version, current version), receives and
 * verifies it (the newest such version when several are available), and returns it.
 * Errors: WB_DEADLINE_EXCEEDED (naming the version waited
 * for and the newest seen), WB_INVALID_ARGUMENT (a bound destination does not match; nothing
 * written), WB_DATA_LOSS (a malformed or corrupted version). The previous version stays
 * current on every error. Destroy the update with wb_update_destroy. */
WB_EXPORT wb_status_t wb_subscriber_wait(wb_subscriber_t* subscriber, uint64_t min_version,
                                         int64_t timeout_ms, wb_update_t** update);

/* As wb_subscriber_wait with two bounds: up to `find_timeout_ms` for a new enough version to
 * appear (WB_DEADLINE_EXCEEDED if none did; nothing is lost), then `receive_timeout_ms` more
 * (from the end of `find_timeout_ms` at the latest) to receive and verify it. For bindings that
 * wait in short slices to stay interruptible. Added in 0.1 (ABI: a new symbol). */
WB_EXPORT wb_status_t wb_subscriber_wait_then_receive(wb_subscriber_t* subscriber,
                                                      uint64_t min_version, int64_t find_timeout_ms,
                                                      int64_t receive_timeout_ms,
                                                      wb_update_t** update);

/* Does not wait for a version to appear: if a version v >= max(min_version, current version)
 * is available now, receives and verifies it (the newest) within `receive_timeout_ms` and
 * returns it in *update; if none is, returns WB_OK with *update = NULL. What a replica calls
 * between rollouts (pass the current version + 1 to ask for a newer one). Errors as
 * wb_subscriber_wait; WB_DEADLINE_EXCEEDED means the receive took longer than allowed. */
WB_EXPORT wb_status_t wb_subscriber_poll(wb_subscriber_t* subscriber, uint64_t min_version,
                                         int64_t receive_timeout_ms, wb_update_t** update);

/* Receives exactly `version`, never another (Subscriber::ReceiveVersion in weightbus.hpp): if
 * the channel holds it, also when newer versions exist, opens, receives and verifies it; if it
 * is not committed yet, waits up to `find_timeout_ms` for it, then has `receive_timeout_ms`
 * more (from the end of `find_timeout_ms` at the latest) to receive it. `receive_timeout_ms` 0
 * makes `find_timeout_ms` the bound of the whole call. What each worker of a tensor-parallel
 * group calls with the one version the engine picked for the group, so that no replica mixes
 * versions (README, "One version per tensor-parallel group"). `version` equal to the current
 * version receives it again. Errors: WB_NOT_FOUND when the channel no longer holds `version`
 * (the message names the versions it holds: pick a newer one for every worker);
 * WB_FAILED_PRECONDITION for a version below the current one (versions handed over never
 * decrease); WB_DEADLINE_EXCEEDED when it was not committed in time (nothing is lost); the
 * rest as wb_subscriber_wait. The previous version stays current on every error. */
WB_EXPORT wb_status_t wb_subscriber_receive_version(wb_subscriber_t* subscriber, uint64_t version,
                                                    int64_t find_timeout_ms,
                                                    int64_t receive_timeout_ms,
                                                    wb_update_t** update);

/* The version of the last update handed over: *has_version = false before the first. */
WB_EXPORT wb_status_t wb_subscriber_current_version(wb_subscriber_t* subscriber, bool* has_version,
                                                    uint64_t* version);

/* The URI the subscriber was created with, as given. Owned by the handle: valid until
 * wb_subscriber_destroy. */
WB_EXPORT wb_status_t wb_subscriber_uri(wb_subscriber_t* subscriber, const char** uri);

/* ------------------------------------------------------------------------------------------ */
/* Update: one received, verified version                                                      */
/* ------------------------------------------------------------------------------------------ */

/* Releases the caller's reference. Tensors exported with wb_update_export_dlpack keep the
 * update's memory alive until their deleters run. NULL is a no-op. */
WB_EXPORT void wb_update_destroy(wb_update_t* update);

/* The version number of the update. */
WB_EXPORT wb_status_t wb_update_version(const wb_update_t* update, uint64_t* version);

/* Number of tensors, in manifest (publish) order. */
WB_EXPORT wb_status_t wb_update_num_tensors(const wb_update_t* update, size_t* num_tensors);

/* Tensor `index` (WB_OUT_OF_RANGE past the end): its name, its element type, and a DLTensor
 * view. Library-owned tensors are contiguous CPU memory (strides NULL); a bound tensor's view
 * is the caller's destination. All three stay valid until wb_update_destroy. Any output
 * pointer may be NULL when not wanted. A sub-byte tensor (F4, F6_*) has a name and dtype but no
 * DLTensor: asking for `tensor` is WB_UNIMPLEMENTED naming it (the C++ API carries its bytes). */
WB_EXPORT wb_status_t wb_update_tensor(const wb_update_t* update, size_t index, const char** name,
                                       wb_dtype_t* dtype, const DLTensor** tensor);

/* Tensor `index` as the manifest describes it: name, dtype, shape, size, checksum and shard
 * (see wb_tensor_info_t). Of a group version (published by ranks with world_size > 1), the
 * tensor assembled from its parts: its global shape, no shard, and xxh3 0 (each part was
 * verified against its own checksum; the parts and their owner ranks are in the manifest JSON).
 * Of a subscriber created by wb_subscriber_create_tp, likewise this worker's slice: its shape,
 * no shard, xxh3 0.
 * Errors: WB_OUT_OF_RANGE past the end; WB_INVALID_ARGUMENT for a NULL argument or an
 * info->struct_size smaller than the first layout (use WB_TENSOR_INFO_INIT). */
WB_EXPORT wb_status_t wb_update_tensor_info(const wb_update_t* update, size_t index,
                                            wb_tensor_info_t* info);

/* The index of the tensor named `name`; WB_NOT_FOUND when the version has none. */
WB_EXPORT wb_status_t wb_update_find(const wb_update_t* update, const char* name, size_t* index);

/* The version's manifest as JSON (format "weightbus.manifest/1", or "/2" for a group version,
 * whose tensors are the ranks' parts with their "owner"; docs/FORMAT.md): metadata,
 * publisher identity, checksums, shards. NUL-terminated; valid until wb_update_destroy. */
WB_EXPORT wb_status_t wb_update_manifest_json(const wb_update_t* update, const char** json,
                                              size_t* length);

/* Timing of this version's receipt (see wb_update_stats_t; set its struct_size). */
WB_EXPORT wb_status_t wb_update_stats(const wb_update_t* update, wb_update_stats_t* stats);

/* Tensor `index` as a DLManagedTensor for a framework to adopt (torch.utils.dlpack.from_dlpack,
 * numpy.from_dlpack): zero-copy, holding its own reference to the update's memory, which its
 * deleter releases (from any thread). The consumer must call the deleter exactly once. A bound
 * tensor's DLManagedTensor points at the caller's destination, which the caller keeps alive. */
WB_EXPORT wb_status_t wb_update_export_dlpack(const wb_update_t* update, size_t index,
                                              DLManagedTensor** managed);

#ifdef __cplusplus
} /* extern "C" */
#endif

// SPDX-License-Identifier: Apache-2.0
// weightbus C++ API: publish versioned weights from a trainer, subscribe to them from inference
// replicas. A transport is chosen by the URI scheme:
//
//   disk:///path/to/channel   a shared filesystem; each version is a safetensors checkpoint
//   ucx://host:port/channel   UCX one-sided RDMA; the publisher serves versions on host:port
//   delta+disk:///path/...    the delta layer over disk: keyframes and deltas against the
//                             previous version, losslessly compressed (any transport after +)
//
// Settings (`weightbus settings` lists them) come, lowest precedence first, from their
// defaults, WEIGHTBUS_* environment variables, the URI's query (`disk:///x?retention=4`) and the
// `options` map passed to Open. An unknown or malformed setting is an InvalidArgument error.
//
// Error codes (absl::StatusCode) mean the same everywhere (docs/CONVENTIONS.md):
//   InvalidArgument     the caller's input is wrong (tensor, URI, setting, binding)
//   FailedPrecondition  the call conflicts with the channel's state (version not above latest,
//                       channel held by another publisher)
//   DeadlineExceeded    the timeout passed first
//   DataLoss            stored or received bytes are malformed or fail their checksum
//   NotFound            a named file, tensor or channel does not exist
//   ResourceExhausted   out of disk space or memory
//   Unavailable         a peer is gone or not reachable yet (retryable)
//   Unimplemented       the feature or transport is not built in
//   Internal            an unexpected system error (message carries the errno text)
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "weightbus/export.h"
#include "weightbus/manifest.hpp"
#include "weightbus/placement.hpp"
#include "weightbus/types.hpp"
#include "weightbus/version.h"

namespace weightbus {

// Settings by name (e.g. {"retention", "4"}); see the header comment for precedence.
using Options = std::map<std::string, std::string>;

// The library's version, "MAJOR.MINOR.PATCH" (WEIGHTBUS_VERSION_STRING of the built library).
WB_EXPORT std::string_view LibraryVersion();

// URI schemes of the transports compiled into this library, sorted (e.g. {"disk"}).
WB_EXPORT std::vector<std::string> Transports();

// A setting as documented in the registry.
struct SettingInfo {
  std::string scope;          // "core" or a transport scheme such as "disk"
  std::string name;           // key in URI queries and Options, e.g. "retention"
  std::string type;           // "bool", "int", "bytes", "duration", "string" or "enum(a|b)",
                              // then the range and unit if declared: "int 1..64 versions"
  std::string default_value;  // as text
  std::string env;            // environment variable, e.g. "WEIGHTBUS_DISK_RETENTION"
  std::string doc;            // one line
};

// Every setting of the core and of each compiled transport.
WB_EXPORT std::vector<SettingInfo> DescribeSettings();

// Timing and size of the last Publish call, for reporting.
struct PublishStats {
  uint64_t version = 0;
  uint64_t bytes = 0;            // tensor bytes published
  absl::Duration stall;          // wall time Publish blocked the caller
  absl::Duration pack;           // packing non-contiguous tensors
  absl::Duration checksum_wait;  // time spent waiting for checksums after the transport was done
  absl::Duration transport;      // the transport's part (for disk: write, fsync, commit)
  absl::Duration encode;         // part of `transport` a layer (delta) spent encoding; 0 if none
  uint64_t wire_bytes = 0;       // bytes the transport carried for the tensors: `bytes`, or what
                                 // a layer encoded them to; 0 when a layer does not report it
  bool unchanged = false;        // the call re-published the latest version with the same
                                 // tensors (a retry): nothing was written
  std::string encoding;          // a layer's choice for this version and why, e.g. "delta: delta
                                 // against version 7", "plain: sent plainly: encoding ...",
                                 // "keyframe: keyframe_interval=50"; empty without a layer
};

class Publisher;

// One version published tensor by tensor (Publisher::BeginPublish): a trainer adds each tensor
// as it produces it (e.g. gathers it from its shards) and may free it right after, so that the
// whole model never has to be alive at once. The guarantee is Publish's: nothing of the version
// is visible to any subscriber before Commit returns OK; Abort, destroying the stream
// uncommitted, a failed Commit or the process dying leaves nothing a subscriber or a later
// publisher sees.
//
// Memory: added bytes go through a host bucket of the setting `stream_bucket` (two halves: one
// filled by Add while the other is written in the background) into an unlinked temporary file
// in `stream_spill_dir`; Commit hands them to the transport from there (read back through the
// transport's own window where it reads views piecewise, disk:// and ucx://; mapped read-only,
// as reclaimable file-backed pages, for layers such as delta). The process's memory is thus
// the bucket plus what the transport itself keeps (a ucx:// publisher serves versions from
// registered staging memory), not the model. Disk space: the version's bytes, until the stream
// ends.
//
// CUDA tensors (builds with CUDA, SupportsCudaTensors()): Add queues a copy into the pinned
// bucket on the given stream and returns; the copy overlaps the caller producing the next
// tensor. Their device memory must stay valid until the next call on this stream returns
// (every call first waits for the previous copy).
//
// Thread safety: not thread-safe; one thread drives a stream. A Publisher has at most one open
// stream. The stream must not outlive its Publisher's destruction in use: once the Publisher
// is destroyed (or cancelled) every call returns Cancelled and the version is dropped.
class WB_EXPORT PublishStream {
 public:
  ~PublishStream();  // aborts the version unless committed
  PublishStream(const PublishStream&) = delete;
  PublishStream& operator=(const PublishStream&) = delete;

  // Adds `tensor` (validated as Publish validates each tensor) as the version's next tensor.
  // Host tensors are copied before this returns (strided views gathered), so the caller may
  // free or modify them at once; CUDA tensors as described above, `cuda_stream` being a
  // cudaStream_t (nullptr: the legacy default stream; ignored for host tensors). Errors, naming
  // the tensor and the version: InvalidArgument for a tensor Publish would refuse, a name
  // already added, more than the tensor limit (the stream stays open: the tensor was not
  // added); Unimplemented for a CUDA tensor without CUDA support; FailedPrecondition after
  // Commit or Abort; Cancelled once the Publisher is cancelled or destroyed; Internal or
  // ResourceExhausted (full disk) from the spool, after which only Abort is left.
  absl::Status Add(const TensorView& tensor, void* cuda_stream = nullptr);

  // Publishes the tensors added so far as the version, as Publish(version, tensors, metadata,
  // timeout) would, with its errors (FailedPrecondition when another Publish took the version
  // or a higher one meanwhile; a group rank's Commit is its part of the group version), after
  // which the stream is finished either way (a failed Commit publishes nothing; add everything
  // again under a new stream to retry). last_stats() of the Publisher describes it (`stall`:
  // the Commit call, `pack`: 0).
  absl::Status Commit(absl::Duration timeout);

  // Drops the version: nothing of it was or will be visible; the spool is freed. No effect
  // after Commit or a previous Abort.
  void Abort();

  uint64_t version() const;
  size_t tensor_count() const;
  uint64_t bytes() const;  // tensor bytes added

  class Impl;
  explicit PublishStream(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

// Whether this build accepts CUDA tensors (TensorView::device / Destination::device kCuda) in
// Publish, PublishStream::Add and Subscriber::Bind (built with CUDA support). Without it they
// are Unimplemented.
WB_EXPORT bool SupportsCudaTensors();

// Host memory from Publisher::AllocateHost: `size()` bytes at `data()`, 4096-byte aligned and
// zero-filled, for a trainer to keep the tensors it publishes in (e.g. its host copy of the
// weights, viewed as torch tensors through DLPack). Publish accepts tensors anywhere; tensors in
// this memory are served at the transport's best speed (ucx:// with publish_mode=zero_copy: UCX
// allocated and registered it, so a subscriber on the same host maps it and copies at memory
// speed, and an RDMA NIC reads it without a registration per Publish).
//
// Lifetime: freed by the destructor, which may run before or after the Publisher's (the memory
// keeps what it needs of the transport alive). As for any tensor, it must not be freed or
// modified while a Publish that reads it is in flight. Destroyed in a child forked after the
// allocation, it releases nothing of the transport's (a UCX registration, a lock another thread
// of the parent may have held at fork): the mapping stays in the child until it exits. UCX's
// shared-memory pages are shared with the parent, not copied at fork, so a child must not write
// them (the parent's tensors would change under it). Thread safety: data() and size() are
// immutable; the bytes are the caller's to synchronize.
class WB_EXPORT HostMemory {
 public:
  ~HostMemory();
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;

  std::byte* data() const;
  uint64_t size() const;

  class Impl;
  explicit HostMemory(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

// Publishes versions of a set of named tensors to one channel.
//
// Thread safety: Publish calls are serialized internally; the object may be shared between
// threads. Lifetime: destroying the Publisher releases the channel (other publishers may then
// open it); versions already published stay available on disk://, while ucx:// serves them
// from this object only (its subscribers then get Unavailable and keep what they have).
//
// Closing while a call is in flight (docs/CONVENTIONS.md, "Closing and fork"): the destructor
// first cancels (Cancel()), then waits for the calls in flight on other threads to return. A
// call waiting (for staging slots, for receivers) returns Cancelled promptly; bytes already
// being written or staged finish first, bounded by that call's timeout. A Publish that returns
// Cancelled published nothing unless the version is on the channel when it returns.
//
// fork(): a Publisher belongs to the process that opened it. In a forked child every call on
// the inherited object fails at once with FailedPrecondition (open a new one in the child), its
// accessors return empty values, and its destructor frees nothing (the parent's object is
// unaffected).
class WB_EXPORT Publisher {
 public:
  // Opens `uri` for publishing. Errors: InvalidArgument for a malformed URI or setting (also
  // rank >= world_size); Unimplemented for a scheme not compiled in (the message lists those
  // that are), and for world_size > 1 on a stack without publisher groups (ucx://, layers);
  // FailedPrecondition if another live publisher holds the channel (for a group rank: a single
  // publisher, or another process of the same rank); transport errors.
  static absl::StatusOr<std::unique_ptr<Publisher>> Open(std::string_view uri,
                                                         const Options& options = {});

  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  // Publishes `tensors` as `version`, all or nothing: when this returns OK every subscriber can
  // receive the version (for disk: it is durable on the filesystem; for ucx: it is staged in
  // registered memory and served); on any error no subscriber ever sees any part of it and the
  // channel's previous versions are untouched.
  //
  // `version` must be above every version already on the channel, or equal to the latest with
  // the same tensors (names, dtypes, shapes, shards, bytes): such a retry, e.g. after a timeout
  // whose publish did commit or by a restarted trainer, returns OK and writes nothing
  // (last_stats().unchanged; the version keeps its first metadata). Other bytes under the
  // latest number are FailedPrecondition naming the first tensor that differs. The comparison
  // needs the version's manifest: from this object, or read back from the channel (disk://);
  // where neither is there (a new ucx:// publisher) the retry is refused. The tensors' bytes are
  // read during the call only (non-contiguous views are gathered as the transport reads them:
  // disk:// through a 16 MiB window, ucx:// straight into its staging slot; a layer such as delta
  // packs them into a buffer freed before Publish returns); the caller may modify them as soon
  // as Publish returns. Checksums (XXH3-64) are computed here, concurrently with the
  // transport's work.
  //
  // Publisher groups: a publisher opened with the settings `rank` and `world_size` > 1 (one
  // process per rank, on a transport that declares publisher groups: disk://) is one rank of a
  // group. It publishes the tensors it owns: whole tensors, or slices (TensorView::shard: the
  // global shape and the slice's offsets, e.g. an FSDP2 DTensor's local shard or a Megatron
  // tensor-parallel slice), a tensor replicated on several ranks published by each with the
  // same bytes. Every rank calls Publish with the same version; it returns OK once the version
  // is committed with every rank's part (whichever rank completes the set commits it), all or
  // nothing across ranks. Subscribers receive every tensor whole (Update::tensors()).
  //
  // Errors: FailedPrecondition (version not above the latest, naming both); InvalidArgument for
  // an empty/duplicate/non-UTF-8 name, a bad shape, strides, shard or null data (naming the
  // tensor); (CUDA tensors: below); DeadlineExceeded after `timeout` (for ucx:
  // also when every staging slot is still read by subscribers, naming them; for a group rank:
  // when other ranks' parts are not there by then, naming the version and the missing ranks;
  // this rank's part is withdrawn, so the version never becomes visible); for a group rank
  // also InvalidArgument when the ranks' parts do not fit together (ranks disagreeing on a
  // tensor's dtype or global shape, overlapping slices other than replicas with equal bytes, a
  // gap), naming the tensor, the ranks and their shapes, returned to every rank of the set, and
  // FailedPrecondition when ranks disagree on world_size; ResourceExhausted when the disk or
  // memory is full; Internal for other system errors.
  //
  // CUDA tensors (TensorView::device kCuda; builds with CUDA, SupportsCudaTensors()): any
  // strides. Publish first waits for the work queued on the legacy default stream of each of
  // their devices (the overload below takes the caller's stream instead), then moves them as the
  // transport can: a transport that moves device memory (nccl) gets them in place, checksummed
  // on the device (a strided view packed there first, into device memory freed before Publish
  // returns); any other copies them into pinned host memory (kept for the next publish, so a
  // trainer pins once) and proceeds as with host tensors (docs/TRANSPORTS.md, "Device memory").
  // Their memory is read during the call only. Errors, naming the tensor: Unimplemented in a
  // build without CUDA; FailedPrecondition for a device this process cannot use (no driver or
  // GPU, CUDA_VISIBLE_DEVICES); InvalidArgument for data that is not that device's memory;
  // ResourceExhausted when device or pinned memory runs out; Internal with CUDA's error.
  absl::Status Publish(uint64_t version, absl::Span<const TensorView> tensors,
                       const Metadata& metadata, absl::Duration timeout);
  // As above, reading CUDA tensors after the work queued on `cuda_stream` (a cudaStream_t,
  // e.g. torch.cuda.current_stream().cuda_stream; nullptr: each device's legacy default stream)
  // when the call began: Publish synchronizes that stream, once. Tensors on other devices than
  // the stream's must be complete when Publish is called.
  absl::Status Publish(uint64_t version, absl::Span<const TensorView> tensors,
                       const Metadata& metadata, absl::Duration timeout, void* cuda_stream);

  // Begins publishing `version` tensor by tensor (PublishStream): Add each tensor, then Commit
  // (or Abort). `metadata` is the version's, as for Publish. Errors: FailedPrecondition when the
  // channel already has a version above `version` (naming both) or this Publisher already has an
  // open stream (naming its version); InvalidArgument for reserved or non-UTF-8 metadata;
  // creating the spool in `stream_spill_dir`: NotFound (no such directory), PermissionDenied
  // (not writable), ResourceExhausted (no space or memory), Internal (other system errors);
  // Cancelled.
  absl::StatusOr<std::unique_ptr<PublishStream>> BeginPublish(uint64_t version,
                                                              const Metadata& metadata = {});

  // `bytes` bytes of host memory (HostMemory) that this publisher's transport serves fastest
  // when a Publish's tensors lie in it: on ucx:// with publish_mode=zero_copy, memory UCX
  // allocates and registers (UCP_MEM_MAP_ALLOCATE: POSIX or SysV shared memory on one host),
  // which the publish serves without registering the caller's memory, to subscribers on its
  // host at the speed of a memcpy instead of process_vm_readv's; otherwise (other transports, a
  // staged ucx:// publisher, UCX unable to allocate) plain anonymous memory. Tensors of one
  // Publish are best kept in one allocation. Errors: InvalidArgument for 0 bytes or more than
  // 2^62; ResourceExhausted when the memory cannot be had (naming the size); Cancelled.
  absl::StatusOr<std::unique_ptr<HostMemory>> AllocateHost(uint64_t bytes);

  // Waits up to `timeout` until at least `count` distinct subscribers have received and
  // verified `version` (or a newer version), e.g. to keep a one-shot publisher serving until its
  // replicas have the weights. A subscriber counts once however often it reconnects while the
  // same Subscriber object lives; one that received the version and left still counts.
  // Errors: DeadlineExceeded naming how many had it; InvalidArgument for count < 1;
  // Unimplemented for transports that cannot tell (disk://: subscribers never talk to the
  // publisher).
  absl::Status WaitForReceivers(uint64_t version, int count, absl::Duration timeout);

  // Makes calls in flight on other threads return Cancelled promptly where they wait, and
  // every later call fail with Cancelled; the object stays valid until destroyed. Thread-safe;
  // returns at once. What a host calls before destroying a Publisher other threads still use.
  void Cancel();

  // The newest version on the channel (published by anyone), if any.
  std::optional<uint64_t> latest_version() const;
  // Figures of the last successful Publish.
  PublishStats last_stats() const;
  const std::string& uri() const;

  class Impl;

 private:
  explicit Publisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Timing of one received version.
struct UpdateStats {
  uint64_t bytes = 0;          // tensor bytes received; a subscriber with placements on a
                               // transport with partial reads: the bytes it read, its slices
                               // rounded out to checksum blocks (docs/RESHARDING.md)
  absl::Duration wait;         // until a new enough version was found
  absl::Duration allocate;     // mapping library buffers (0 when recycled from earlier updates)
  absl::Duration fetch;        // receiving the bytes (checksums overlap with it)
  absl::Duration verify_wait;  // waiting for checksums after the last byte arrived
  absl::Duration copy_out;     // copying staged bytes into bound destinations (bind_mode=staged)
  int64_t ready_unix_ns = 0;   // when the version was complete and verified (CLOCK_REALTIME)
  absl::Duration decode;       // part of `fetch` a layer (delta) spent decoding; 0 if none
  uint64_t wire_bytes = 0;     // bytes received for the tensors: `bytes`, or their encoded size
                               // under a layer; 0 when a layer does not report it
  std::string encoding;        // how a layer reconstructed it, e.g. "delta 8 on this
                               // subscriber's copy of version 7"; empty without a layer
};

// One received, verified version. Immutable. Views into library-owned buffers stay valid for
// the Update's lifetime; views of bound tensors point at the caller's destinations.
class WB_EXPORT Update {
 public:
  ~Update();
  Update(const Update&) = delete;
  Update& operator=(const Update&) = delete;

  uint64_t version() const;
  const Manifest& manifest() const;
  // One view per manifest tensor, in manifest order. Of a group version (Manifest::group), one
  // per tensor assembled from its parts (each rank's slice copied to its place in the tensor of
  // the global shape; a replicated part read from one rank), in order of first appearance, with
  // no shard; manifest() lists the parts as published. Of a subscriber opened with placements,
  // one per destination tensor (SubscribePlacements::tensors, or the version's tensors), each
  // this worker's slice, row-major, with no shard.
  absl::Span<const TensorView> tensors() const;
  // The view named `name`, or nullptr.
  const TensorView* Find(std::string_view name) const;
  const UpdateStats& stats() const;

  class Impl;
  explicit Update(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

// What one worker of a tensor-parallel (TP) group receives (docs/RESHARDING.md, "Subscribing
// with placements"): of each tensor, the slice `rules` give worker `rank` (weightbus/
// placement.hpp; the first rule whose pattern matches a tensor's name wins, a name no rule
// matches is received whole).
struct SubscribePlacements {
  std::vector<PlacementRule> rules;
  TensorParallelRank rank;
  // The destination tensors to receive, in order. Empty: every tensor of the version under its
  // own name. Fused placements (Qkv, GateUp, ExpertsMerged) name destinations that are not in
  // the version (e.g. "model.layers.0.self_attn.qkv_proj.weight" from q_proj, k_proj, v_proj),
  // so they are listed here.
  std::vector<std::string> tensors;
  // A destination none of whose sources a version has (its own name, its fused parts, its
  // experts' parts) is left out of that version's Update instead of failing the receive with
  // NotFound, as vLLM's load_weights leaves a parameter the checkpoint does not name as it is
  // (a trainer that publishes only the tensors it trains; a parameter of the engine's model
  // with no checkpoint tensor). Still NotFound: a destination with some of its sources but not
  // all, and a version that has a source for none of the destinations.
  bool skip_absent = false;
};

// Receives versions from one channel.
//
// Guarantees: an Update is handed over only when every tensor is complete and matches the
// manifest's checksum; version numbers handed over never decrease.
//
// Bound destinations: Bind(name, dest) makes later updates write tensor `name` into `dest`
// instead of a library buffer. Before any byte is written, every bound destination is checked
// against the manifest (dtype, shape, device) and a mismatch fails naming the tensor and both
// sides. With the setting bind_mode=staged (default) bytes are received and verified in library
// memory first, so a failed update never touches a destination; bind_mode=direct receives
// straight into contiguous destinations (one copy fewer). Its contract when a receive fails
// (transfer error, timeout, failed verification): the version is not handed over and
// current_version() stays; bound destinations hold unspecified bytes, a mix of the previous
// version's and the failed one's (the error says so); ReceiveVersion(current_version())
// re-fetches the previous version while the channel still holds it (disk: `retention`; ucx:
// `staging_slots` >= 2), and any successful receive writes every byte of every bound tensor.
//
// Thread safety: calls are serialized internally. Lifetime: destinations must stay valid while
// bound; Updates may outlive the Subscriber.
//
// Closing while a call is in flight: the destructor first cancels (Cancel()), then waits for
// the calls in flight on other threads to return. A call still waiting for a version returns
// Cancelled promptly; a receive already under way finishes or fails by its own deadline (bound
// destinations then hold what bind_mode promises for a failed update). fork(): as for Publisher,
// an inherited Subscriber fails every call in the child with FailedPrecondition.
class WB_EXPORT Subscriber {
 public:
  // Opens `uri` for subscribing; the channel need not exist yet. Errors as Publisher::Open.
  static absl::StatusOr<std::unique_ptr<Subscriber>> Open(std::string_view uri,
                                                          const Options& options = {});
  // Opens `uri` for one worker of a TP group: every Update holds only this worker's slices
  // (Update::tensors() are slice-shaped, row-major, and bound destinations must have the
  // slice's dtype and shape). The transfer plan (which published parts to read and where each
  // byte goes) is computed for the first version and again only when a version's layout (its
  // parts, owners, shapes) differs; only the parts the plan reads are fetched and verified.
  // Errors at Open: InvalidArgument for a rank outside [0, size) or size < 1. On receive,
  // before any byte is fetched (the previous version stays current): InvalidArgument naming
  // the tensor, dimension and degree when the TP degree does not divide a dimension or a head
  // count, NotFound for a listed destination or a fused source the version lacks; the rest as
  // WaitForVersion.
  static absl::StatusOr<std::unique_ptr<Subscriber>> Open(std::string_view uri,
                                                          const Options& options,
                                                          SubscribePlacements placements);
  ~Subscriber();
  Subscriber(const Subscriber&) = delete;
  Subscriber& operator=(const Subscriber&) = delete;

  // Binds tensor `name` of future versions to `dest`, replacing an earlier binding.
  //
  // A CUDA destination (Destination::device kCuda; builds with CUDA), any strides, e.g. a model
  // parameter (also one that requires grad: the library writes its memory, autograd is not
  // involved): a transport that moves device memory writes it in place (bind_mode=direct) or
  // into device staging on its device, verified on the device and then copied
  // (bind_mode=staged); any other receives it into host memory, verifies it there and copies
  // it to the device (docs/TRANSPORTS.md, "Device memory"). The library writes it on streams of
  // its own and waits for them before a receive returns; work the caller queued that reads or
  // writes it must be complete before the receive begins (e.g. between inference steps).
  // Errors: InvalidArgument for a null pointer with a non-zero size, a bad shape or strides, a
  // CUDA destination whose memory is not that device's; Unimplemented for a CUDA destination in
  // a build without CUDA; FailedPrecondition for a CUDA device this process cannot use.
  absl::Status Bind(std::string name, Destination dest);
  void Unbind(std::string_view name);
  void UnbindAll();

  // Waits up to `timeout` for a version v >= max(min_version, current_version()), receives and
  // verifies it, and returns it (the newest such version when several are available).
  // Errors: DeadlineExceeded naming the channel, the version waited for and the newest one seen;
  // InvalidArgument for a bound destination that does not match the manifest (nothing written);
  // DataLoss for a malformed or corrupted version (naming the tensor and its source); the
  // previous version stays current on every error.
  absl::StatusOr<std::unique_ptr<Update>> WaitForVersion(uint64_t min_version,
                                                         absl::Duration timeout);

  // As above with two bounds: up to `find_timeout` for a new enough version to appear, then
  // `receive_timeout` more (counted from the end of `find_timeout` at the latest) to receive and
  // verify it. DeadlineExceeded when none appeared within `find_timeout`; nothing is lost then.
  // Bindings that wait in short slices to stay interruptible (Python's Ctrl-C) use it so that a
  // version found late in a slice still gets its whole receive time.
  absl::StatusOr<std::unique_ptr<Update>> WaitForVersion(uint64_t min_version,
                                                         absl::Duration find_timeout,
                                                         absl::Duration receive_timeout);

  // Does not wait for a version to appear: if a version v >= max(min_version,
  // current_version()) is available now, receives and verifies it (the newest) within
  // `receive_timeout` and returns it; if none is, returns nullptr. What a replica calls between
  // rollouts (pass current_version() + 1 to ask for a newer one). Errors as WaitForVersion,
  // DeadlineExceeded meaning the receive did not finish within `receive_timeout`.
  absl::StatusOr<std::unique_ptr<Update>> Poll(uint64_t min_version,
                                               absl::Duration receive_timeout);

  // Receives exactly `version`, never another: if the channel holds it (also when newer
  // versions exist), opens, receives and verifies it; if it is not committed yet, waits up to
  // `timeout` for it to be. Every guarantee of WaitForVersion holds (verified, all or nothing,
  // bound destinations untouched on failure with bind_mode=staged, Cancel ends the wait).
  //
  // What the workers of one tensor-parallel group call so that a replica never mixes versions:
  // the engine (or the group's leader) picks `version` once, e.g. the newest committed one or
  // the version its leader just received, and passes the same number to every worker. The
  // version must still be on the channel when the slowest worker asks: disk:// keeps the last
  // `retention` versions (and any version a reader has open), ucx:// the last `staging_slots`
  // (a slot being read is reused only once its reader is done), the delta layer the chain back
  // to the keyframe. Set them to cover the publishes that can land while a group receives; a
  // worker that asks too late gets NotFound, and the group then picks a newer version for
  // every worker (README, "One version per tensor-parallel group").
  //
  // `version` == current_version() receives that version again (an engine reloading what it
  // holds gets the same verified bytes); a version below current_version() is refused, since
  // versions handed over never decrease.
  //
  // Errors: NotFound when the channel no longer holds `version` (a newer one is there),
  // naming it and the versions it holds; FailedPrecondition for `version` below
  // current_version() (naming both: open a new Subscriber to go back); DeadlineExceeded naming
  // the version and the newest one seen when it was not committed in time; the rest as
  // WaitForVersion. The previous version stays current on every error.
  absl::StatusOr<std::unique_ptr<Update>> ReceiveVersion(uint64_t version, absl::Duration timeout);

  // As above with two bounds, as WaitForVersion's: up to `find_timeout` for `version` to be
  // committed (DeadlineExceeded if it was not; nothing is lost), then `receive_timeout` more to
  // receive and verify it. For bindings that wait in short slices.
  absl::StatusOr<std::unique_ptr<Update>> ReceiveVersion(uint64_t version,
                                                         absl::Duration find_timeout,
                                                         absl::Duration receive_timeout);

  // Makes a wait in flight on another thread return Cancelled promptly, and every later call
  // fail with Cancelled; the object stays valid until destroyed. Thread-safe; returns at once.
  void Cancel();

  // The version of the last Update handed over, if any.
  std::optional<uint64_t> current_version() const;
  const std::string& uri() const;

  class Impl;

 private:
  explicit Subscriber(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightbus

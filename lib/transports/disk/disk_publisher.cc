// SPDX-License-Identifier: Apache-2.0
// Publishing side of disk://: write a version into a temporary directory with io_uring, make it
// durable, rename it into place, then commit it by replacing LATEST; apply retention.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>
#include <algorithm>
#include <cerrno>

#include <cstring>
#include <future>
#include <map>
#include <system_error>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/buffer.h"
#include "core/checksum.h"
#include "core/failpoint.h"
#include "core/logging.h"
#include "core/parts.h"
#include "core/secret.h"
#include "core/status.h"
#include "io/file_io.h"
#include "nlohmann/json.hpp"
#include "transports/disk/channel.h"
#include "transports/disk/disk_transport.h"
#include "weightbus/safetensors.hpp"

namespace weightbus::internal::disk {
namespace {

// Bytes of a strided view gathered and written at a time; two such windows are the extra memory
// strided views cost.
// A thread when one can be started, else inline at get() (libstdc++ falls back to deferred).
constexpr std::launch kGatherLaunch = std::launch::async | std::launch::deferred;
constexpr uint64_t kStridedWindow = uint64_t{8} << 20;  // two of them in use

// One safetensors file of a version and the tensors (manifest indices) it holds.
struct FilePlan {
  std::string name;
  std::vector<size_t> tensors;
  safetensors::Layout layout;
};

// Splits the tensors into files of at most `shard_size` bytes (a tensor is never split), in
// the writer's data order (element size descending, stable), so each file is one contiguous
// run of that order.
absl::StatusOr<std::vector<FilePlan>> PlanFiles(absl::Span<const PackedTensor> tensors,
                                                uint64_t shard_size) {
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return DTypeSize(tensors[a].info->dtype) > DTypeSize(tensors[b].info->dtype);
  });
  std::vector<FilePlan> files;
  uint64_t current = 0;
  for (size_t i : order) {
    const uint64_t n = tensors[i].info->nbytes;
    if (files.empty() || (current > 0 && current + n > shard_size)) {
      files.emplace_back();
      current = 0;
    }
    files.back().tensors.push_back(i);
    current += n;
  }
  if (files.empty()) files.emplace_back();  // a version with no tensors is one empty file
  for (size_t k = 0; k < files.size(); ++k) {
    FilePlan& f = files[k];
    f.name = ShardFileName(k + 1, files.size());
    std::vector<safetensors::TensorSpec> specs;
    specs.reserve(f.tensors.size());
    for (size_t i : f.tensors) {
      const TensorInfo& t = *tensors[i].info;
      specs.push_back(safetensors::TensorSpec{t.name, t.dtype, t.shape});
    }
    WB_ASSIGN_OR_RETURN(f.layout, safetensors::PlanFile(specs, {{"format", "pt"}}));
  }
  return files;
}

// An exclusive flock, released when this object goes.
class FlockHeld {
 public:
  explicit FlockHeld(int fd) : fd_(fd) {}
  ~FlockHeld() { (void)::flock(fd_, LOCK_UN); }
  FlockHeld(const FlockHeld&) = delete;
  FlockHeld& operator=(const FlockHeld&) = delete;

 private:
  int fd_;
};

// This publisher's place in a publisher group (world_size > 1), with the locks it holds.
struct GroupRole {
  int rank = 0;
  int world_size = 1;
  UniqueFd rank_lock;   // publisher-r<rank>.lock, LOCK_EX
  UniqueFd group_lock;  // group.lock, taken LOCK_EX around each step of the commit
  absl::Duration poll;  // how often a rank waiting for the others looks again
  // The channel's key when it has a shared secret: the committing rank checks every part's MAC
  // with it and MACs the group manifest (docs/SECURITY.md, "Publisher groups").
  std::optional<ChannelKey> key;
  bool grouped() const { return world_size > 1; }
};

class DiskPublisher final : public TransportPublisher {
 public:
  DiskPublisher(Channel channel, UniqueFd versions, UniqueFd lock, std::unique_ptr<FileIo> io,
                FailPoints failpoints, int64_t retention, uint64_t shard_size, bool sync,
                GroupRole group)
      : channel_(std::move(channel)),
        versions_(std::move(versions)),
        lock_(std::move(lock)),
        io_(std::move(io)),
        failpoints_(std::move(failpoints)),
        retention_(retention),
        shard_size_(shard_size),
        sync_(sync),
        group_(std::move(group)),
        retention_thread_([this] { RetentionLoop(); }) {}

  // Finishes pending retention work before the channel lock is released.
  ~DiskPublisher() override {
    {
      absl::MutexLock lock(&retention_mu_);
      stopping_ = true;
    }
    retention_thread_.join();
    // Explicitly, so that no other copy of the descriptor (a child forked before
    // CloseInForkedChildren could apply, an exec'd helper) keeps the channel locked.
    (void)::flock(lock_.get(), LOCK_UN);
    if (group_.rank_lock) (void)::flock(group_.rank_lock.get(), LOCK_UN);
  }

  // A rank waiting for the rest of its group returns Cancelled promptly.
  void Cancel() override {
    absl::MutexLock lock(&cancel_mu_);
    cancelled_ = true;
  }

  absl::StatusOr<std::optional<uint64_t>> LatestVersion() override {
    WB_ASSIGN_OR_RETURN(std::optional<uint64_t> latest, channel_.ReadLatest());
    if (floor_ && (!latest || *latest < *floor_)) return floor_;
    return latest;
  }

  absl::Status Publish(PublishJob& job, absl::Time deadline) override;

  // The committed version's weightbus.manifest.json (a retried publish is compared with it).
  // Read relative to the held versions/ directory, following no link (as everything else).
  absl::StatusOr<Manifest> CommittedManifest(uint64_t version) override {
    const std::string dir_path = channel_.VersionDir(version);
    WB_ASSIGN_OR_RETURN(UniqueFd dir,
                        OpenDirAt(versions_.get(), VersionDirName(version), dir_path));
    const std::string path = absl::StrFormat("%s/%s", dir_path, kManifestFile);
    WB_ASSIGN_OR_RETURN(std::string text,
                        ReadSmallFileAt(dir.get(), kManifestFile, kMaxMetadataFile, path));
    return Manifest::FromJson(text, path);
  }

  void KeepVersionsFrom(uint64_t version) override {
    absl::MutexLock lock(&retention_mu_);
    keep_from_ = version;
  }

  // Removes what crashed publishers left: temporary and trash directories, and version
  // directories above LATEST (renamed into place but never committed). A rank of a group
  // removes only its own leftovers and group versions at or below LATEST (which can never
  // commit), and completes a commit its group's committer left half done.
  absl::Status CleanLeftovers();

 private:
  // Writes the version's data files, manifest and index into the directory `dir_fd` (path
  // `dir`); returns the sealed manifest.
  absl::StatusOr<const Manifest*> WriteCheckpoint(int dir_fd, const std::string& dir,
                                                  PublishJob& job, absl::Time deadline,
                                                  size_t* files_written);
  // Publish of one rank of a group: its part, then the group commit (docs/FORMAT.md).
  absl::Status PublishPart(PublishJob& job, absl::Time deadline);
  // A single publisher's version (Publish without a group).
  absl::Status PublishWhole(PublishJob& job, absl::Time deadline);
  // `s` (ResourceExhausted: the filesystem is full) with what the channel holds and what frees
  // space, so that a channel kept full by its own retention says so.
  absl::Status ExplainFull(absl::Status s);
  // One look at the group version held open as `gfd` (`.group-vN`, or `vN` once renamed),
  // under group.lock: nullopt while other ranks' parts are missing, else the outcome for this
  // rank: OK when the version is committed (by this rank if it completes the set), the
  // failure recorded for this rank's part, or, with `final` (the deadline passed or the
  // publisher was cancelled), this rank's part withdrawn and DeadlineExceeded (Cancelled)
  // naming the missing ranks.
  std::optional<absl::Status> GroupStep(uint64_t version, int gfd, bool final);
  // Takes this rank's part of `version` back (rank-<r>/ removed, rank-<r>.withdrawn written),
  // under group.lock: the version cannot commit without it.
  absl::Status Withdraw(uint64_t version, int gfd);
  // Commits the complete set of parts `parts` (their manifests, by rank), or records why not.
  absl::Status CommitGroup(uint64_t version, int gfd, const std::vector<Manifest>& parts);
  // Makes LATEST name `version`, whose directory is complete: the commit point.
  absl::Status CommitLatest(uint64_t version);
  // Takes group.lock (LOCK_EX) until the returned object goes; waits at most until `until`.
  absl::StatusOr<std::unique_ptr<FlockHeld>> LockGroup(absl::Time until);
  std::string Display() const { return "disk://" + channel_.root(); }
  // Fsyncs (if durable) and closes a written data file.
  absl::Status FinishFile(UniqueFd& fd, const std::string& path, absl::Time deadline);
  absl::Status WriteFile(int dir_fd, const std::string& dir, const FilePlan& plan, PublishJob& job,
                         absl::Time deadline);
  // FailedPrecondition unless the channel path still names the directory (and the
  // publisher.lock) this publisher locked, and LATEST is below `version`: checked before each
  // commit, so a publisher whose directory was deleted and recreated under it never writes into
  // the new one, and LATEST never moves backwards.
  absl::Status CheckStillOwner(uint64_t version) const;
  absl::Status CheckDeadline(absl::Time deadline, uint64_t version, std::string_view step) const;
  void ApplyRetention(uint64_t latest);
  // Deleting old versions is off the publish path: unlinking can take milliseconds (more with
  // `discard` mounts) and no subscriber needs it.
  void RetentionLoop();

  Channel channel_;
  UniqueFd versions_;  // channel_/versions
  UniqueFd lock_;
  std::unique_ptr<FileIo> io_;
  FailPoints failpoints_;
  int64_t retention_;
  uint64_t shard_size_;
  bool sync_;
  GroupRole group_;
  absl::Mutex cancel_mu_;
  bool cancelled_ ABSL_GUARDED_BY(cancel_mu_) = false;
  std::optional<uint64_t> floor_;  // versions must go above this even without LATEST
  absl::Mutex retention_mu_;
  std::optional<uint64_t> retention_due_ ABSL_GUARDED_BY(retention_mu_);
  std::optional<uint64_t> keep_from_ ABSL_GUARDED_BY(retention_mu_);
  bool stopping_ ABSL_GUARDED_BY(retention_mu_) = false;
  std::thread retention_thread_;
};

void DiskPublisher::RetentionLoop() {
  while (true) {
    uint64_t latest;
    {
      absl::MutexLock lock(&retention_mu_);
      retention_mu_.Await(absl::Condition(
          +[](DiskPublisher* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->retention_mu_) {
            return p->stopping_ || p->retention_due_.has_value();
          },
          this));
      if (!retention_due_) return;  // stopping with nothing left to do
      latest = *retention_due_;
      retention_due_.reset();
    }
    ApplyRetention(latest);
    // Tests wait for "a retention pass ran" here instead of sleeping (`error` has no effect).
    failpoints_.Hit("disk.after_retention").IgnoreError();
  }
}

absl::Status DiskPublisher::CheckDeadline(absl::Time deadline, uint64_t version,
                                          std::string_view step) const {
  if (absl::Now() <= deadline) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrFormat("deadline passed before %s", step));
}

absl::Status DiskPublisher::CheckStillOwner(uint64_t version) const {
  WB_RETURN_IF_ERROR(channel_.CheckStillAt(lock_.get(), kPublisherLock));
  WB_RETURN_IF_ERROR(channel_.CheckStillAt(versions_.get(), kVersionsDir));
  WB_ASSIGN_OR_RETURN(std::optional<uint64_t> latest, channel_.ReadLatest());
  if (latest && *latest >= version) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "disk://%s: LATEST already names version %d, not below version %d: another writer moved "
        "it while this publisher held the channel; nothing was committed",
        channel_.root(), *latest, version));
  }
  return absl::OkStatus();
}

absl::Status DiskPublisher::WriteFile(int dir_fd, const std::string& dir, const FilePlan& plan,
                                      PublishJob& job, absl::Time deadline) {
  const std::string path = absl::StrFormat("%s/%s", dir, plan.name);
  WB_ASSIGN_OR_RETURN(UniqueFd fd, OpenAt(dir_fd, plan.name, O_WRONLY | O_CREAT | O_EXCL, path,
                                          channel_.modes().file));
  const uint64_t size = plan.layout.file_size();
  // Reserve every block first: a full disk fails here, before any data moves.
  if (size > 0) {
    if (::fallocate(fd.get(), 0, 0, static_cast<off_t>(size)) != 0 && errno != EOPNOTSUPP &&
        errno != ENOSYS) {
      return ErrnoStatus(errno, absl::StrFormat("reserving %d bytes for %s (version %d)", size,
                                                path, job.version()));
    }
  }
  absl::Span<const PackedTensor> tensors = job.tensors();
  std::vector<IoRequest> requests;
  requests.reserve(plan.tensors.size() + 1);
  requests.push_back(IoRequest{
      fd.get(), 0, reinterpret_cast<std::byte*>(const_cast<char*>(plan.layout.prefix.data())),
      plan.layout.prefix.size()});
  std::vector<size_t> request_tensor = {0};  // plan.tensors index + 1 of each request; 0: header
  std::vector<size_t> strided;               // plan.tensors indices of strided views
  for (size_t k = 0; k < plan.tensors.size(); ++k) {
    const PackedTensor& t = tensors[plan.tensors[k]];
    if (t.data == nullptr && t.info->nbytes > 0) {
      strided.push_back(k);
      continue;
    }
    requests.push_back(IoRequest{fd.get(), plan.layout.data_start + plan.layout.begin[k],
                                 const_cast<std::byte*>(t.data), t.info->nbytes});
    request_tensor.push_back(k + 1);
  }
  auto describe_tensor = [&](size_t k) {
    return absl::StrFormat("%s (tensor \"%s\", version %d)", path,
                           tensors[plan.tensors[k]].info->name, job.version());
  };
  auto describe = [&](size_t r) {
    if (request_tensor[r] == 0) {
      return absl::StrFormat("%s (header, version %d)", path, job.version());
    }
    return describe_tensor(request_tensor[r] - 1);
  };
  WB_RETURN_IF_ERROR(io_->Write(
      requests, deadline, [](size_t) {}, describe));
  // Strided views: gathered window by window into two bounce buffers, never packed whole; the
  // next window is gathered (and checksummed, in order) on another thread while this one is
  // written.
  std::vector<std::pair<size_t, uint64_t>> windows;  // (k, offset) of every window, in order
  for (size_t k : strided) {
    const uint64_t n = tensors[plan.tensors[k]].info->nbytes;
    for (uint64_t at = 0; at < n; at += kStridedWindow) windows.emplace_back(k, at);
  }
  if (windows.empty()) return FinishFile(fd, path, deadline);
  uint64_t bounce_size = 0;
  for (size_t w = 0; w < windows.size(); ++w) {
    const auto [k, at] = windows[w];
    bounce_size =
        std::max(bounce_size, std::min(kStridedWindow, tensors[plan.tensors[k]].info->nbytes - at));
  }
  std::unique_ptr<HostBuffer> bounce[2];
  for (auto& b : bounce) {
    WB_ASSIGN_OR_RETURN(b, HostBuffer::Allocate(bounce_size));
  }
  std::vector<std::optional<TensorHasher>> checksums(plan.tensors.size());
  for (size_t k : strided) {
    if (job.ClaimChecksum(plan.tensors[k])) {
      checksums[k].emplace(tensors[plan.tensors[k]].info->nbytes,
                           job.ChecksumGrid(plan.tensors[k]));
    }
  }
  auto window_size = [&](size_t w) {
    const auto [k, at] = windows[w];
    return std::min(kStridedWindow, tensors[plan.tensors[k]].info->nbytes - at);
  };
  auto gather = [&](size_t w) {
    const auto [k, at] = windows[w];
    std::byte* dst = bounce[w % 2]->data();
    job.CopyRange(plan.tensors[k], at, window_size(w), dst);
    if (checksums[k]) checksums[k]->Update(dst, window_size(w));
  };
  std::future<void> gathering = std::async(kGatherLaunch, gather, 0);
  // Never leave with a gather still writing into a bounce buffer.
  absl::Cleanup wait_gather = [&] {
    if (gathering.valid()) gathering.wait();
  };
  for (size_t w = 0; w < windows.size(); ++w) {
    gathering.get();
    if (w + 1 < windows.size()) gathering = std::async(kGatherLaunch, gather, w + 1);
    const auto [k, at] = windows[w];
    const IoRequest window{fd.get(), plan.layout.data_start + plan.layout.begin[k] + at,
                           bounce[w % 2]->data(), window_size(w)};
    WB_RETURN_IF_ERROR(io_->Write(
        absl::MakeConstSpan(&window, 1), deadline, [](size_t) {},
        [&](size_t) { return describe_tensor(k); }));
  }
  for (size_t k : strided) {
    if (checksums[k]) job.SetChecksum(plan.tensors[k], checksums[k]->Finish());
  }
  return FinishFile(fd, path, deadline);
}

absl::Status DiskPublisher::FinishFile(UniqueFd& fd, const std::string& path, absl::Time deadline) {
  if (sync_) {
    WB_RETURN_IF_ERROR(io_->Fsync(fd.get(), deadline, path));
  }
  if (::close(fd.release()) != 0) {
    return ErrnoStatus(errno, absl::StrFormat("close %s", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<const Manifest*> DiskPublisher::WriteCheckpoint(int dir_fd, const std::string& dir,
                                                               PublishJob& job, absl::Time deadline,
                                                               size_t* files_written) {
  const uint64_t version = job.version();
  WB_ASSIGN_OR_RETURN(std::vector<FilePlan> files, PlanFiles(job.tensors(), shard_size_));
  for (const FilePlan& plan : files) {
    WB_RETURN_IF_ERROR(CheckDeadline(deadline, version, "writing " + plan.name));
    WB_RETURN_IF_ERROR(WriteFile(dir_fd, dir, plan, job, deadline));
    WB_RETURN_IF_ERROR(failpoints_.Hit("disk.after_file"));
  }
  WB_ASSIGN_OR_RETURN(const Manifest* manifest, job.SealedManifest(deadline));
  WB_RETURN_IF_ERROR(WriteSmallFileAt(dir_fd, kManifestFile, manifest->ToJson(), sync_,
                                      absl::StrFormat("%s/%s", dir, kManifestFile),
                                      channel_.modes().file));
  if (files.size() > 1) {
    nlohmann::ordered_json index;
    index["metadata"]["total_size"] = manifest->total_bytes();
    nlohmann::ordered_json& map = index["weight_map"];
    map = nlohmann::ordered_json::object();
    for (const FilePlan& plan : files) {
      for (size_t i : plan.tensors) map[manifest->tensors[i].name] = plan.name;
    }
    WB_RETURN_IF_ERROR(WriteSmallFileAt(
        dir_fd, kIndexFile, index.dump(2, ' ', false, nlohmann::json::error_handler_t::replace),
        sync_, absl::StrFormat("%s/%s", dir, kIndexFile), channel_.modes().file));
  }
  *files_written = files.size();
  return manifest;
}

absl::Status DiskPublisher::CommitLatest(uint64_t version) {
  WB_RETURN_IF_ERROR(channel_.WriteLatest(
      version, sync_, group_.grouped() ? absl::StrFormat("r%05d-", group_.rank) : ""));
  // Committed: subscribers can see it now, so no later failure may undo it or report it failed.
  if (sync_) {
    absl::Status s = failpoints_.Hit("disk.commit_fsync");
    if (s.ok()) s = FsyncFd(channel_.fd(), channel_.root());
    if (!s.ok()) {
      Log(LogLevel::kError,
          "disk://%s: version %d is committed, but making the commit durable failed (%s); it "
          "may not survive a power loss",
          channel_.root(), version, std::string(s.message()));
    }
  }
  absl::MutexLock lock(&retention_mu_);
  retention_due_ = version;
  return absl::OkStatus();
}

absl::Status DiskPublisher::Publish(PublishJob& job, absl::Time deadline) {
  absl::Status s = group_.grouped() ? PublishPart(job, deadline) : PublishWhole(job, deadline);
  if (s.code() == absl::StatusCode::kResourceExhausted) s = ExplainFull(std::move(s));
  return s;
}

absl::Status DiskPublisher::ExplainFull(absl::Status s) {
  absl::StatusOr<std::vector<uint64_t>> dirs = channel_.ListVersionDirs();
  const size_t held = dirs.ok() ? dirs->size() : 0;
  return absl::Status(
      s.code(),
      absl::StrFormat("%s; the channel holds %d version director%s (retention=%d keeps the newest "
                      "%d committed ones, and versions a reader pins): free space on the "
                      "filesystem of %s or lower retention; a filesystem that fits only "
                      "retention - 1 versions never publishes again until space is freed",
                      s.message(), held, held == 1 ? "y" : "ies", retention_, retention_,
                      channel_.root()));
}

absl::Status DiskPublisher::PublishWhole(PublishJob& job, absl::Time deadline) {
  const uint64_t version = job.version();
  const std::string versions = channel_.VersionsDir();
  const std::string tmp_name =
      absl::StrFormat("%s%s-%d", kTmpPrefix, VersionDirName(version), getpid());
  const std::string tmp = absl::StrFormat("%s/%s", versions, tmp_name);
  const std::string final_name = VersionDirName(version);
  const std::string final_dir = channel_.VersionDir(version);
  const int vfd = versions_.get();
  // Checked first (a deleted directory cannot even hold the temporary) and again before the
  // rename and the commit.
  WB_RETURN_IF_ERROR(CheckStillOwner(version));
  WB_RETURN_IF_ERROR(RemoveTreeAt(vfd, tmp_name, tmp));
  WB_RETURN_IF_ERROR(MakeDirAt(vfd, tmp_name, channel_.modes().dir, /*exist_ok=*/false, tmp));
  bool renamed = false, committed = false;
  absl::Cleanup cleanup = [&] {
    if (committed) return;
    (void)RemoveTreeAt(vfd, tmp_name, tmp);
    if (renamed) (void)RemoveTreeAt(vfd, final_name, final_dir);
  };
  WB_ASSIGN_OR_RETURN(UniqueFd tmp_fd, OpenDirAt(vfd, tmp_name, tmp));

  const absl::Time start = absl::Now();
  size_t files = 0;
  WB_ASSIGN_OR_RETURN(const Manifest* manifest,
                      WriteCheckpoint(tmp_fd.get(), tmp, job, deadline, &files));
  (void)manifest;
  const absl::Time written = absl::Now();
  const mode_t file_mode = channel_.modes().file;
  WB_RETURN_IF_ERROR(WriteSmallFileAt(tmp_fd.get(), kReaderLock, "", false,
                                      absl::StrFormat("%s/%s", tmp, kReaderLock), file_mode));
  if (sync_) WB_RETURN_IF_ERROR(FsyncFd(tmp_fd.get(), tmp));
  const absl::Time sealed = absl::Now();
  WB_RETURN_IF_ERROR(failpoints_.Hit("disk.before_rename"));
  WB_RETURN_IF_ERROR(CheckDeadline(deadline, version, "renaming it into place"));
  WB_RETURN_IF_ERROR(CheckStillOwner(version));

  // A directory of this number can only be an uncommitted leftover (versions only increase).
  WB_RETURN_IF_ERROR(RemoveTreeAt(vfd, final_name, final_dir));
  if (::renameat(vfd, tmp_name.c_str(), vfd, final_name.c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrFormat("rename %s -> %s", tmp, final_dir));
  }
  renamed = true;
  if (sync_) WB_RETURN_IF_ERROR(FsyncFd(vfd, versions));
  WB_RETURN_IF_ERROR(failpoints_.Hit("disk.before_commit"));
  WB_RETURN_IF_ERROR(CheckDeadline(deadline, version, "committing"));
  WB_RETURN_IF_ERROR(CheckStillOwner(version));
  const absl::Time renamed_at = absl::Now();
  WB_RETURN_IF_ERROR(CommitLatest(version));
  committed = true;
  Log(LogLevel::kDebug,
      "disk://%s version %d: %d files written %s, manifest %s, rename %s, commit %s",
      channel_.root(), version, files, absl::FormatDuration(written - start),
      absl::FormatDuration(sealed - written), absl::FormatDuration(renamed_at - sealed),
      absl::FormatDuration(absl::Now() - renamed_at));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<FlockHeld>> DiskPublisher::LockGroup(absl::Time until) {
  const int fd = group_.group_lock.get();
  // Held only for short steps (a few small files and renames), and released by the kernel
  // when a holder dies.
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) {
      return ErrnoStatus(errno, absl::StrFormat("lock %s", channel_.Path(kGroupLock)));
    }
    if (absl::Now() > until) {
      return absl::DeadlineExceededError(
          absl::StrFormat("%s: %s stayed locked by another rank", Display(), kGroupLock));
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  return std::make_unique<FlockHeld>(fd);
}

absl::Status DiskPublisher::PublishPart(PublishJob& job, absl::Time deadline) {
  const uint64_t version = job.version();
  const int vfd = versions_.get();
  const std::string group_name = GroupDirName(version);
  const std::string group_path = absl::StrFormat("%s/%s", channel_.VersionsDir(), group_name);
  const std::string rank_name = RankDirName(group_.rank);
  const std::string failed_name = rank_name + kFailedSuffix;
  const std::string withdrawn_name = rank_name + kWithdrawnSuffix;
  const std::string tmp_name = absl::StrFormat("%s%s-%d", kTmpPrefix, rank_name, getpid());
  const std::string tmp = absl::StrFormat("%s/%s", group_path, tmp_name);
  WB_RETURN_IF_ERROR(CheckStillOwner(version));
  WB_RETURN_IF_ERROR(
      MakeDirAt(vfd, group_name, channel_.modes().dir, /*exist_ok=*/true, group_path));
  // Held open: once the set is complete the directory is renamed to vN, and this descriptor
  // follows it.
  WB_ASSIGN_OR_RETURN(UniqueFd group_fd, OpenDirAt(vfd, group_name, group_path));
  const int gfd = group_fd.get();
  WB_RETURN_IF_ERROR(RemoveTreeAt(gfd, tmp_name, tmp));
  WB_RETURN_IF_ERROR(MakeDirAt(gfd, tmp_name, channel_.modes().dir, /*exist_ok=*/false, tmp));
  bool placed = false;
  absl::Cleanup cleanup = [&] {
    if (!placed) (void)RemoveTreeAt(gfd, tmp_name, tmp);
  };
  {
    WB_ASSIGN_OR_RETURN(UniqueFd tmp_fd, OpenDirAt(gfd, tmp_name, tmp));
    size_t files = 0;
    WB_RETURN_IF_ERROR(WriteCheckpoint(tmp_fd.get(), tmp, job, deadline, &files).status());
    if (sync_) WB_RETURN_IF_ERROR(FsyncFd(tmp_fd.get(), tmp));
  }
  WB_RETURN_IF_ERROR(failpoints_.Hit("disk.before_rename"));
  WB_RETURN_IF_ERROR(CheckDeadline(deadline, version, "placing this rank's part"));
  {
    // The part marker: this rank's durable part renamed into the group directory, replacing
    // what an earlier attempt of this rank left (and the record of its refusal).
    WB_ASSIGN_OR_RETURN(auto locked, LockGroup(deadline));
    WB_RETURN_IF_ERROR(CheckStillOwner(version));
    WB_RETURN_IF_ERROR(RemoveTreeAt(gfd, failed_name, group_path + "/" + failed_name));
    WB_RETURN_IF_ERROR(RemoveTreeAt(gfd, withdrawn_name, group_path + "/" + withdrawn_name));
    WB_RETURN_IF_ERROR(RemoveTreeAt(gfd, rank_name, group_path + "/" + rank_name));
    if (::renameat(gfd, tmp_name.c_str(), gfd, rank_name.c_str()) != 0) {
      return ErrnoStatus(errno, absl::StrFormat("rename %s -> %s/%s", tmp, group_path, rank_name));
    }
    placed = true;
    if (sync_) WB_RETURN_IF_ERROR(FsyncFd(gfd, group_path));
  }
  WB_RETURN_IF_ERROR(failpoints_.Hit("disk.after_part"));
  while (true) {
    bool cancelled;
    {
      absl::MutexLock lock(&cancel_mu_);
      cancelled = cancelled_;
    }
    const bool final = cancelled || absl::Now() > deadline;
    std::optional<absl::Status> outcome;
    {
      // The last step (withdrawing this rank's part) must run even past the deadline; an
      // earlier one that cannot have the lock by the deadline becomes the last.
      absl::StatusOr<std::unique_ptr<FlockHeld>> locked =
          LockGroup(final ? absl::Now() + absl::Seconds(10) : deadline);
      if (!final && absl::IsDeadlineExceeded(locked.status())) continue;
      if (!locked.ok()) return locked.status();
      outcome = GroupStep(version, gfd, final);
      if (outcome && !outcome->ok() && !absl::IsDeadlineExceeded(*outcome)) {
        // Whatever went wrong, this rank reports it failed: its part must not count in a
        // later set (a refused part carries its .failed marker already).
        if (absl::Status s = Withdraw(version, gfd); !s.ok()) {
          Log(LogLevel::kWarn, "%s: withdrawing the part of rank %d of version %d: %s", Display(),
              group_.rank, version, std::string(s.message()));
        }
      }
    }
    if (outcome) {
      if (outcome->ok()) return *outcome;
      if (absl::IsDeadlineExceeded(*outcome) && cancelled) {
        return absl::CancelledError(
            absl::StrFormat("%s: the publisher was cancelled while waiting for its group: %s",
                            Display(), outcome->message()));
      }
      return *outcome;
    }
    absl::MutexLock lock(&cancel_mu_);
    cancel_mu_.AwaitWithDeadline(absl::Condition(&cancelled_),
                                 std::min(deadline, absl::Now() + group_.poll));
  }
}

std::optional<absl::Status> DiskPublisher::GroupStep(uint64_t version, int gfd, bool final) {
  const int vfd = versions_.get();
  const std::string group_path =
      absl::StrFormat("%s/%s", channel_.VersionsDir(), GroupDirName(version));
  absl::StatusOr<std::optional<uint64_t>> latest = channel_.ReadLatest();
  if (!latest.ok()) return latest.status();
  // Is the directory held open already renamed to vN?
  struct stat held, named;
  const std::string final_name = VersionDirName(version);
  const bool renamed = ::fstat(gfd, &held) == 0 &&
                       ::fstatat(vfd, final_name.c_str(), &named, AT_SYMLINK_NOFOLLOW) == 0 &&
                       held.st_ino == named.st_ino && held.st_dev == named.st_dev;
  if (*latest && **latest >= version) {
    if (renamed) return absl::OkStatus();  // committed, with this rank's part
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: LATEST names version %d, at or above version %d, which was not committed with this "
        "rank's part; nothing of it is visible",
        Display(), **latest, version));
  }
  if (renamed) {
    // The committer renamed the complete set into place and stopped before LATEST: finish.
    if (absl::Status s = CheckStillOwner(version); !s.ok()) return s;
    return CommitLatest(version);
  }
  const std::string failed_name = RankDirName(group_.rank) + kFailedSuffix;
  absl::StatusOr<std::string> failed =
      ReadSmallFileAt(gfd, failed_name, 1 << 20, group_path + "/" + failed_name);
  if (failed.ok()) {
    nlohmann::json j = nlohmann::json::parse(*failed, nullptr, false);
    if (j.is_object() && j.contains("code") && j["code"].is_number_integer() &&
        j.contains("message") && j["message"].is_string()) {
      return absl::Status(static_cast<absl::StatusCode>(j["code"].get<int>()),
                          j["message"].get<std::string>());
    }
    return absl::DataLossError(absl::StrFormat("%s/%s is malformed", group_path, failed_name));
  }
  if (!absl::IsNotFound(failed.status())) return failed.status();

  // The parts present: rank-<r>/ with its manifest, not refused (rank-<r>.failed) nor withdrawn
  // (rank-<r>.withdrawn: the rank gave up waiting).
  std::vector<Manifest> parts(group_.world_size);
  std::vector<int> missing, gave_up;
  absl::StatusOr<std::vector<std::string>> names = ListDirAt(gfd, group_path);
  if (!names.ok()) return names.status();
  std::vector<bool> present(group_.world_size, false), refused(group_.world_size, false),
      withdrawn(group_.world_size, false);
  for (const std::string& name : *names) {
    int r = -1;
    absl::string_view base = name;
    std::vector<bool>* mark = &present;
    for (auto [suffix, kind] :
         {std::pair{kFailedSuffix, &refused}, std::pair{kWithdrawnSuffix, &withdrawn}}) {
      if (absl::ConsumeSuffix(&base, suffix)) mark = kind;
    }
    if (!absl::ConsumePrefix(&base, "rank-") || !absl::SimpleAtoi(base, &r) || r < 0) continue;
    if (r >= group_.world_size) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s version %d: %s holds a part of rank %d, but this group has world_size %d: the "
          "ranks disagree on world_size",
          Display(), version, group_path, r, group_.world_size));
    }
    (*mark)[r] = true;
  }
  for (int r = 0; r < group_.world_size; ++r) {
    if (withdrawn[r]) {
      gave_up.push_back(r);
      continue;
    }
    if (!present[r] || refused[r]) {
      missing.push_back(r);
      continue;
    }
    const std::string dir = absl::StrFormat("%s/%s", group_path, RankDirName(r));
    absl::StatusOr<UniqueFd> rank_fd = OpenDirAt(gfd, RankDirName(r), dir);
    if (!rank_fd.ok()) return rank_fd.status();
    const std::string path = dir + "/" + kManifestFile;
    absl::StatusOr<std::string> text =
        ReadSmallFileAt(rank_fd->get(), kManifestFile, kMaxMetadataFile, path);
    if (!text.ok()) return text.status();
    absl::StatusOr<Manifest> m = Manifest::FromJson(*text, path);
    if (!m.ok()) return m.status();
    if (m->version != version || m->publisher.rank != r) {
      return absl::DataLossError(absl::StrFormat("%s is the part of rank %d for version %d", path,
                                                 m->publisher.rank, m->version));
    }
    if (m->publisher.world_size != group_.world_size) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s version %d: rank %d publishes with world_size %d, this rank (%d) with %d: the "
          "ranks disagree on world_size",
          Display(), version, r, m->publisher.world_size, group_.rank, group_.world_size));
    }
    parts[r] = *std::move(m);
  }
  if (missing.empty() && gave_up.empty()) return CommitGroup(version, gfd, parts);
  if (!final) return std::nullopt;
  // Withdraw: without this rank's part the version can never commit, so an error here means
  // the version never becomes visible, also if the missing ranks come later. The marker tells
  // the ranks still waiting that this one gave up (it is not one of the missing).
  if (absl::Status s = Withdraw(version, gfd); !s.ok()) return s;
  auto ranks = [&](const std::vector<int>& rs, std::string_view what) {
    return absl::StrFormat("rank%s %s of the group of %d %s %s part", rs.size() > 1 ? "s" : "",
                           absl::StrJoin(rs, ", "), group_.world_size, what,
                           rs.size() > 1 ? "their" : "its");
  };
  std::vector<std::string> why;
  if (!missing.empty()) why.push_back(ranks(missing, "did not publish") + " by the deadline");
  if (!gave_up.empty()) why.push_back(ranks(gave_up, "gave up waiting and withdrew"));
  return absl::DeadlineExceededError(absl::StrFormat(
      "%s: version %d was not committed: %s; this rank's (%d) part was withdrawn and nothing of "
      "version %d is visible",
      Display(), version, absl::StrJoin(why, "; "), group_.rank, version));
}

absl::Status DiskPublisher::Withdraw(uint64_t version, int gfd) {
  const std::string group_path =
      absl::StrFormat("%s/%s", channel_.VersionsDir(), GroupDirName(version));
  const std::string rank_name = RankDirName(group_.rank);
  const std::string marker = rank_name + kWithdrawnSuffix;
  for (const std::string& name : {rank_name, marker}) {
    WB_RETURN_IF_ERROR(RemoveTreeAt(gfd, name, group_path + "/" + name));
  }
  return WriteSmallFileAt(gfd, marker, "", false, group_path + "/" + marker, channel_.modes().file);
}

absl::Status DiskPublisher::CommitGroup(uint64_t version, int gfd,
                                        const std::vector<Manifest>& parts) {
  const std::string group_path =
      absl::StrFormat("%s/%s", channel_.VersionsDir(), GroupDirName(version));
  // On a channel with a secret no part counts unless its rank MACed it with the channel's key
  // (a forged or altered part, or a rank with another secret or none, refuses the whole set).
  const ChannelKey* channel_key = group_.key ? &*group_.key : nullptr;
  absl::Status refused;
  for (const Manifest& part : parts) {
    refused = CheckPartMac(channel_key, part, group_.rank,
                           absl::StrFormat("%s version %d", Display(), version));
    if (!refused.ok()) break;
  }
  const bool unauthenticated = !refused.ok();
  // The committing rank's publisher identity; every rank's tensors and metadata.
  absl::StatusOr<Manifest> merged = unauthenticated
                                        ? absl::StatusOr<Manifest>(refused)
                                        : internal::MergeGroupParts(version, parts, group_.rank);
  refused = merged.status();
  if (!refused.ok()) {
    // Refused for every rank of the set: each gets this error, and none of these parts counts
    // again (a rank publishes the version anew to replace its part).
    const absl::Status error(
        refused.code(),
        unauthenticated
            ? absl::StrFormat("%s; nothing of version %d was committed", refused.message(), version)
            : absl::StrFormat("%s version %d: the group's parts do not fit together, nothing was "
                              "committed: %s",
                              Display(), version, refused.message()));
    // The message may quote bytes of a part (a name that is not UTF-8): replaced, not thrown.
    nlohmann::json j;
    j["code"] = static_cast<int>(error.code());
    j["message"] = std::string(error.message());
    for (int r = 0; r < group_.world_size; ++r) {
      const std::string name = RankDirName(r) + kFailedSuffix;
      WB_RETURN_IF_ERROR(RemoveTreeAt(gfd, name, group_path + "/" + name));
      WB_RETURN_IF_ERROR(WriteSmallFileAt(
          gfd, name, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), sync_,
          group_path + "/" + name, channel_.modes().file));
    }
    if (sync_) WB_RETURN_IF_ERROR(FsyncFd(gfd, group_path));
    return error;
  }
  // The MAC of the whole (every rank's tensors, shards, owners and checksums, under this
  // committing rank's session), which subscribers check before accepting any byte.
  if (channel_key != nullptr) {
    merged->metadata[std::string(kMacMetadataKey)] = ManifestMac(*channel_key, *merged);
  }
  // Leftovers of crashed attempts inside the group directory go before it becomes visible.
  WB_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDirAt(gfd, group_path));
  for (const std::string& name : names) {
    if (absl::StartsWith(name, kTmpPrefix)) {
      WB_RETURN_IF_ERROR(RemoveTreeAt(gfd, name, group_path + "/" + name));
    }
  }
  for (const char* name : {kManifestFile, kReaderLock}) {
    WB_RETURN_IF_ERROR(RemoveTreeAt(gfd, name, group_path + "/" + name));
  }
  WB_RETURN_IF_ERROR(WriteSmallFileAt(gfd, kManifestFile, merged->ToJson(), sync_,
                                      group_path + "/" + kManifestFile, channel_.modes().file));
  WB_RETURN_IF_ERROR(WriteSmallFileAt(gfd, kReaderLock, "", false, group_path + "/" + kReaderLock,
                                      channel_.modes().file));
  if (sync_) WB_RETURN_IF_ERROR(FsyncFd(gfd, group_path));
  WB_RETURN_IF_ERROR(failpoints_.Hit("disk.before_group_rename"));
  WB_RETURN_IF_ERROR(CheckStillOwner(version));
  const int vfd = versions_.get();
  const std::string final_name = VersionDirName(version);
  WB_RETURN_IF_ERROR(RemoveTreeAt(vfd, final_name, channel_.VersionDir(version)));
  if (::renameat(vfd, GroupDirName(version).c_str(), vfd, final_name.c_str()) != 0) {
    return ErrnoStatus(
        errno, absl::StrFormat("rename %s -> %s", group_path, channel_.VersionDir(version)));
  }
  absl::Status s = sync_ ? FsyncFd(vfd, channel_.VersionsDir()) : absl::OkStatus();
  if (s.ok()) s = failpoints_.Hit("disk.before_commit");
  if (s.ok()) s = CheckStillOwner(version);
  if (s.ok()) s = CommitLatest(version);
  if (!s.ok() && !absl::IsFailedPrecondition(s)) {
    // Not committed: back to where the other ranks look for it, so that none of them
    // completes a commit this rank reports failed (they go on waiting, then withdraw).
    (void)::renameat(vfd, final_name.c_str(), vfd, GroupDirName(version).c_str());
  }
  return s;
}

void DiskPublisher::ApplyRetention(uint64_t latest) {
  // Group versions at or below the newest committed one can never commit (a crashed rank's
  // partial version, or a set that was refused): their parts go.
  if (absl::StatusOr<std::vector<std::string>> names =
          ListDirAt(versions_.get(), channel_.VersionsDir());
      names.ok()) {
    for (const std::string& name : *names) {
      if (!absl::StartsWith(name, kGroupPrefix)) continue;
      std::optional<uint64_t> v = ParseVersionDirName(name.substr(strlen(kGroupPrefix)));
      if (!v || *v > latest) continue;
      const std::string trash_name = absl::StrFormat("%s%s-%d", kTrashPrefix, name, getpid());
      if (::renameat(versions_.get(), name.c_str(), versions_.get(), trash_name.c_str()) != 0) {
        continue;  // another rank's retention took it first
      }
      (void)RemoveTreeAt(versions_.get(), trash_name,
                         absl::StrFormat("%s/%s", channel_.VersionsDir(), trash_name));
    }
  }
  absl::StatusOr<std::vector<uint64_t>> dirs = channel_.ListVersionDirs();
  if (!dirs.ok()) {
    Log(LogLevel::kWarn, "retention: %s", std::string(dirs.status().message()));
    return;
  }
  std::optional<uint64_t> keep_from;
  {
    absl::MutexLock lock(&retention_mu_);
    keep_from = keep_from_;
  }
  std::vector<uint64_t> committed;
  for (uint64_t v : *dirs) {
    if (v <= latest) committed.push_back(v);
  }
  if (committed.size() <= static_cast<size_t>(retention_)) return;
  committed.resize(committed.size() - static_cast<size_t>(retention_));  // the oldest ones
  for (uint64_t v : committed) {
    if (keep_from && v >= *keep_from) continue;  // a layer still needs it
    const std::string name = VersionDirName(v);
    const std::string dir = channel_.VersionDir(v);
    absl::StatusOr<UniqueFd> vdir = OpenDirAt(versions_.get(), name, dir);
    absl::StatusOr<UniqueFd> lock = vdir.ok() ? OpenAt(vdir->get(), kReaderLock, O_RDONLY,
                                                       absl::StrFormat("%s/%s", dir, kReaderLock))
                                              : absl::StatusOr<UniqueFd>(vdir.status());
    if (lock.ok() && ::flock(lock->get(), LOCK_EX | LOCK_NB) != 0) {
      Log(LogLevel::kDebug, "retention: version %d is being read; keeping it for now", v);
      continue;
    }
    const std::string trash_name =
        absl::StrFormat("%s%s-%d", kTrashPrefix, VersionDirName(v), getpid());
    const std::string trash = absl::StrFormat("%s/%s", channel_.VersionsDir(), trash_name);
    if (::renameat(versions_.get(), name.c_str(), versions_.get(), trash_name.c_str()) != 0) {
      // Another rank of a group retires the same versions: the first one's rename wins.
      if (errno != ENOENT) Log(LogLevel::kWarn, "retention: rename %s: %s", dir, strerror(errno));
      continue;
    }
    lock = absl::StatusOr<UniqueFd>(UniqueFd());  // release the lock before deleting
    if (absl::Status s = RemoveTreeAt(versions_.get(), trash_name, trash); !s.ok()) {
      Log(LogLevel::kWarn, "retention: %s", std::string(s.message()));
    }
  }
}

absl::Status DiskPublisher::CleanLeftovers() {
  WB_ASSIGN_OR_RETURN(std::optional<uint64_t> latest, channel_.ReadLatest());
  WB_ASSIGN_OR_RETURN(std::vector<uint64_t> dirs, channel_.ListVersionDirs());
  if (group_.grouped()) {
    // The other ranks may be publishing: only what no live rank can be using goes.
    WB_ASSIGN_OR_RETURN(auto locked, LockGroup(absl::Now() + absl::Seconds(10)));
    for (uint64_t v : dirs) {
      // A set renamed into place whose committer died before LATEST: complete, so commit it.
      if (latest && v <= *latest) continue;
      const std::string dir = channel_.VersionDir(v);
      WB_ASSIGN_OR_RETURN(UniqueFd fd, OpenDirAt(versions_.get(), VersionDirName(v), dir));
      absl::StatusOr<std::string> text = ReadSmallFileAt(
          fd.get(), kManifestFile, kMaxMetadataFile, absl::StrFormat("%s/%s", dir, kManifestFile));
      absl::StatusOr<Manifest> m =
          text.ok() ? Manifest::FromJson(*text, dir) : absl::StatusOr<Manifest>(text.status());
      if (!m.ok() || !m->group || m->publisher.world_size != group_.world_size) continue;
      if (group_.key && !CheckManifestMac(&*group_.key, *m, Display(), "").ok()) {
        // Not what a rank of this group committed (a committer MACs the group manifest under
        // the channel's key): never made visible by this rank.
        Log(LogLevel::kWarn,
            "%s: not completing the commit of version %d: its group manifest carries no valid MAC "
            "under the channel's key",
            Display(), v);
        continue;
      }
      Log(LogLevel::kInfo, "%s: completing the commit of version %d, left by rank %d", Display(), v,
          m->publisher.rank);
      WB_RETURN_IF_ERROR(CommitLatest(v));
      latest = v;
    }
    WB_ASSIGN_OR_RETURN(std::vector<std::string> in_versions,
                        ListDirAt(versions_.get(), channel_.VersionsDir()));
    const std::string own_tmp = absl::StrFormat("%s%s-", kTmpPrefix, RankDirName(group_.rank));
    for (const std::string& name : in_versions) {
      if (!absl::StartsWith(name, kGroupPrefix)) continue;
      const std::string path = absl::StrFormat("%s/%s", channel_.VersionsDir(), name);
      std::optional<uint64_t> v = ParseVersionDirName(name.substr(strlen(kGroupPrefix)));
      if (v && latest && *v <= *latest) {
        Log(LogLevel::kInfo, "removing %s, a group version that can no longer commit", path);
        WB_RETURN_IF_ERROR(RemoveTreeAt(versions_.get(), name, path));
        continue;
      }
      absl::StatusOr<UniqueFd> gfd = OpenDirAt(versions_.get(), name, path);
      if (!gfd.ok()) continue;
      WB_ASSIGN_OR_RETURN(std::vector<std::string> inside, ListDirAt(gfd->get(), path));
      for (const std::string& entry : inside) {
        if (!absl::StartsWith(entry, own_tmp)) continue;
        Log(LogLevel::kInfo, "removing %s/%s, left by an earlier process of rank %d", path, entry,
            group_.rank);
        WB_RETURN_IF_ERROR(RemoveTreeAt(gfd->get(), entry, path + "/" + entry));
      }
    }
    return absl::OkStatus();
  }
  if (!latest && !dirs.empty()) {
    // Without LATEST (lost in a power cut with fsync=false, or deleted by hand) committed and
    // uncommitted versions cannot be told apart: keep them all, and publish above them.
    Log(LogLevel::kWarn,
        "disk://%s has version directories up to %d but no LATEST; keeping them, new versions "
        "must be above %d",
        channel_.root(), dirs.back(), dirs.back());
    floor_ = dirs.back();
  }
  WB_ASSIGN_OR_RETURN(std::vector<std::string> in_versions,
                      ListDirAt(versions_.get(), channel_.VersionsDir()));
  for (const std::string& name : in_versions) {
    std::optional<uint64_t> v = ParseVersionDirName(name);
    if (absl::StartsWith(name, kTmpPrefix) || absl::StartsWith(name, kTrashPrefix) ||
        absl::StartsWith(name, kGroupPrefix) || (v && latest && *v > *latest)) {
      const std::string path = absl::StrFormat("%s/%s", channel_.VersionsDir(), name);
      Log(LogLevel::kInfo, "removing %s, left by an earlier publisher", path);
      WB_RETURN_IF_ERROR(RemoveTreeAt(versions_.get(), name, path));
    }
  }
  WB_ASSIGN_OR_RETURN(std::vector<std::string> in_root, ListDirAt(channel_.fd(), channel_.root()));
  for (const std::string& name : in_root) {
    if (!absl::StartsWith(name, kLatestTmpPrefix)) continue;
    const std::string path = channel_.Path(name);
    Log(LogLevel::kInfo, "removing %s, left by an earlier publisher", path);
    WB_RETURN_IF_ERROR(RemoveTreeAt(channel_.fd(), name, path));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TransportPublisher>> OpenDiskPublisher(const Uri& uri,
                                                                      const Config& config) {
  WB_ASSIGN_OR_RETURN(std::string root, ChannelRoot(uri));
  const int64_t retention = config.Int("retention");  // >= 1 (DiskSettings)
  // The root's own path is the user's to name (links in it are followed); inside it nothing is.
  const Modes modes = ChannelModes(config.Bool("group_access"));
  WB_RETURN_IF_ERROR(MakeDirs(root, modes.dir));
  WB_ASSIGN_OR_RETURN(Channel channel, Channel::Open(root, modes));
  WB_RETURN_IF_ERROR(
      MakeDirAt(channel.fd(), kVersionsDir, modes.dir, /*exist_ok=*/true, channel.VersionsDir()));
  WB_ASSIGN_OR_RETURN(UniqueFd versions, channel.OpenVersionsDir());
  const std::string lock_path = channel.Path(kPublisherLock);
  WB_ASSIGN_OR_RETURN(
      UniqueFd lock, OpenAt(channel.fd(), kPublisherLock, O_RDWR | O_CREAT, lock_path, modes.file));
  struct stat lock_stat;
  if (::fstat(lock.get(), &lock_stat) != 0 || !S_ISREG(lock_stat.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s is not a regular file; remove it", lock_path));
  }
  // The lock holds the holder's description: it gets the channel's file mode like the rest
  // (whether just created or left by an earlier publisher of this user).
  if (lock_stat.st_uid == ::geteuid() && (lock_stat.st_mode & 07777) != modes.file &&
      ::fchmod(lock.get(), modes.file) != 0) {
    return ErrnoStatus(errno, absl::StrFormat("chmod %s to %o", lock_path, modes.file));
  }
  lock.CloseInForkedChildren();  // a forked child's copy would hold the lock after we let go
  GroupRole group;
  group.rank = static_cast<int>(config.Int("rank"));  // below world_size: checked by the core
  group.world_size = static_cast<int>(config.Int("world_size"));
  group.poll = std::max(config.Duration("poll_interval"), absl::Milliseconds(1));
  // A single publisher holds publisher.lock alone; every rank of a group shares it (so neither
  // kind can join the other) and holds its own rank's lock alone.
  const std::string holder = ProcessDescription();
  auto take = [&](UniqueFd& fd, const std::string& path, int how) -> absl::Status {
    if (::flock(fd.get(), how | LOCK_NB) == 0) return absl::OkStatus();
    const int err = errno;
    if (err != EWOULDBLOCK) return ErrnoStatus(err, absl::StrFormat("lock %s", path));
    std::string who = "holder unknown";
    struct stat st;
    if (::fstat(fd.get(), &st) == 0 && st.st_size > 0 && st.st_size < 4096) {
      std::string text(static_cast<size_t>(st.st_size), '\0');
      if (::pread(fd.get(), text.data(), text.size(), 0) > 0) who = text;
    }
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: another publisher holds the channel%s (%s)", uri.Display(),
        group.grouped() ? absl::StrFormat(" or rank %d of its group", group.rank) : "", who));
  };
  auto record = [&](UniqueFd& fd, const std::string& path) {
    if (::ftruncate(fd.get(), 0) != 0 || ::pwrite(fd.get(), holder.data(), holder.size(), 0) < 0) {
      Log(LogLevel::kWarn, "could not record the holder in %s", path);
    }
  };
  if (!group.grouped()) {
    WB_RETURN_IF_ERROR(take(lock, lock_path, LOCK_EX));
    record(lock, lock_path);
  } else {
    WB_RETURN_IF_ERROR(take(lock, lock_path, LOCK_SH));
    const std::string rank_path = channel.Path(RankLockName(group.rank));
    WB_ASSIGN_OR_RETURN(group.rank_lock, OpenAt(channel.fd(), RankLockName(group.rank),
                                                O_RDWR | O_CREAT, rank_path));
    group.rank_lock.CloseInForkedChildren();
    WB_RETURN_IF_ERROR(take(group.rank_lock, rank_path, LOCK_EX));
    record(group.rank_lock, rank_path);
    WB_ASSIGN_OR_RETURN(group.group_lock, OpenAt(channel.fd(), kGroupLock, O_RDWR | O_CREAT,
                                                 channel.Path(kGroupLock)));
    group.group_lock.CloseInForkedChildren();
    WB_ASSIGN_OR_RETURN(group.key, LoadChannelKey(config, uri.Display()));
  }
  WB_ASSIGN_OR_RETURN(FailPoints failpoints, FailPoints::Parse(config.String("failpoints")));
  WB_ASSIGN_OR_RETURN(std::unique_ptr<FileIo> io, MakeFileIo(uri, config));
  std::unique_ptr<DiskPublisher> publisher;
  try {  // starts the retention thread
    publisher = std::make_unique<DiskPublisher>(
        std::move(channel), std::move(versions), std::move(lock), std::move(io),
        std::move(failpoints), retention, std::max<uint64_t>(config.Bytes("shard_size"), 1),
        config.Bool("fsync"), std::move(group));
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%s: cannot start the retention thread: %s", uri.Display(), e.what()));
  }
  WB_RETURN_IF_ERROR(publisher->CleanLeftovers());
  return std::unique_ptr<TransportPublisher>(std::move(publisher));
}

}  // namespace weightbus::internal::disk

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

#include <future>
#include <system_error>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/buffer.h"
#include "core/checksum.h"
#include "core/failpoint.h"
#include "core/logging.h"
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

class DiskPublisher final : public TransportPublisher {
 public:
  DiskPublisher(Channel channel, UniqueFd versions, UniqueFd lock, std::unique_ptr<FileIo> io,
                FailPoints failpoints, int64_t retention, uint64_t shard_size, bool sync)
      : channel_(std::move(channel)),
        versions_(std::move(versions)),
        lock_(std::move(lock)),
        io_(std::move(io)),
        failpoints_(std::move(failpoints)),
        retention_(retention),
        shard_size_(shard_size),
        sync_(sync),
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
  // directories above LATEST (renamed into place but never committed).
  absl::Status CleanLeftovers();

 private:
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
  std::vector<std::optional<Xxh3Stream>> checksums(plan.tensors.size());
  for (size_t k : strided) {
    if (job.ClaimChecksum(plan.tensors[k])) checksums[k].emplace();
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
    if (checksums[k]) job.SetChecksum(plan.tensors[k], checksums[k]->Digest());
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

absl::Status DiskPublisher::Publish(PublishJob& job, absl::Time deadline) {
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
  WB_ASSIGN_OR_RETURN(std::vector<FilePlan> files, PlanFiles(job.tensors(), shard_size_));
  for (const FilePlan& plan : files) {
    WB_RETURN_IF_ERROR(CheckDeadline(deadline, version, "writing " + plan.name));
    WB_RETURN_IF_ERROR(WriteFile(tmp_fd.get(), tmp, plan, job, deadline));
    WB_RETURN_IF_ERROR(failpoints_.Hit("disk.after_file"));
  }

  const absl::Time written = absl::Now();
  WB_ASSIGN_OR_RETURN(const Manifest* manifest, job.SealedManifest(deadline));
  const mode_t file_mode = channel_.modes().file;
  WB_RETURN_IF_ERROR(WriteSmallFileAt(tmp_fd.get(), kManifestFile, manifest->ToJson(), sync_,
                                      absl::StrFormat("%s/%s", tmp, kManifestFile), file_mode));
  if (files.size() > 1) {
    nlohmann::ordered_json index;
    index["metadata"]["total_size"] = manifest->total_bytes();
    nlohmann::ordered_json& map = index["weight_map"];
    map = nlohmann::ordered_json::object();
    for (const FilePlan& plan : files) {
      for (size_t i : plan.tensors) map[manifest->tensors[i].name] = plan.name;
    }
    WB_RETURN_IF_ERROR(WriteSmallFileAt(tmp_fd.get(), kIndexFile, index.dump(2), sync_,
                                        absl::StrFormat("%s/%s", tmp, kIndexFile), file_mode));
  }
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
  WB_RETURN_IF_ERROR(channel_.WriteLatest(version, sync_));
  // Committed: subscribers can see it now, so no later failure may undo it or report it failed.
  committed = true;
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
  {
    absl::MutexLock lock(&retention_mu_);
    retention_due_ = version;
  }
  Log(LogLevel::kDebug,
      "disk://%s version %d: %d files written %s, manifest %s, rename %s, commit %s",
      channel_.root(), version, files.size(), absl::FormatDuration(written - start),
      absl::FormatDuration(sealed - written), absl::FormatDuration(renamed_at - sealed),
      absl::FormatDuration(absl::Now() - renamed_at));
  return absl::OkStatus();
}

void DiskPublisher::ApplyRetention(uint64_t latest) {
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
      Log(LogLevel::kWarn, "retention: rename %s: %s", dir, strerror(errno));
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
        (v && latest && *v > *latest)) {
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
  if (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    absl::StatusOr<std::string> holder =
        ReadSmallFileAt(channel.fd(), kPublisherLock, 4096, lock_path);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(
          absl::StrFormat("%s: another publisher holds the channel (%s)", uri.Display(),
                          holder.ok() && !holder->empty() ? *holder : "holder unknown"));
    }
    return ErrnoStatus(err, absl::StrFormat("lock %s", lock_path));
  }
  const std::string holder = ProcessDescription();
  if (::ftruncate(lock.get(), 0) != 0 ||
      ::pwrite(lock.get(), holder.data(), holder.size(), 0) < 0) {
    Log(LogLevel::kWarn, "could not record the holder in %s", lock_path);
  }
  WB_ASSIGN_OR_RETURN(FailPoints failpoints, FailPoints::Parse(config.String("failpoints")));
  WB_ASSIGN_OR_RETURN(std::unique_ptr<FileIo> io, MakeFileIo(uri, config));
  std::unique_ptr<DiskPublisher> publisher;
  try {  // starts the retention thread
    publisher = std::make_unique<DiskPublisher>(
        std::move(channel), std::move(versions), std::move(lock), std::move(io),
        std::move(failpoints), retention, std::max<uint64_t>(config.Bytes("shard_size"), 1),
        config.Bool("fsync"));
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%s: cannot start the retention thread: %s", uri.Display(), e.what()));
  }
  WB_RETURN_IF_ERROR(publisher->CleanLeftovers());
  return std::unique_ptr<TransportPublisher>(std::move(publisher));
}

}  // namespace weightbus::internal::disk

// SPDX-License-Identifier: Apache-2.0
// Subscribing side of disk://: wait for LATEST to reach a version (inotify, with polling for
// network filesystems), pin the version against retention with a shared flock, cross-check its
// safetensors headers with its manifest, and read the bytes with io_uring at depth.
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
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

// A data file of a version; opened only while it is being read, so versions with thousands of
// shards do not need thousands of descriptors.
struct DataFile {
  size_t dir = 0;    // the directory holding it: the version's, or a group rank's part
  std::string name;  // in that directory
  std::string path;  // for messages
  safetensors::Header header;
};

// Where one manifest tensor lives.
struct Location {
  size_t file = 0;
  uint64_t offset = 0;  // absolute file offset
};

class DiskVersion final : public IncomingVersion {
 public:
  DiskVersion(Manifest manifest, std::vector<UniqueFd> dirs, std::vector<DataFile> files,
              std::vector<Location> locations, UniqueFd pin, FileIo* io, FailPoints* failpoints)
      : manifest_(std::move(manifest)),
        dirs_(std::move(dirs)),
        files_(std::move(files)),
        locations_(std::move(locations)),
        pin_(std::move(pin)),
        io_(io),
        failpoints_(failpoints) {}

  const Manifest& manifest() const override { return manifest_; }

  std::string DescribeSource(size_t i) const override {
    const Location& l = locations_[i];
    return absl::StrFormat("file %s bytes [%d, %d)", files_[l.file].path, l.offset,
                           l.offset + manifest_.tensors[i].nbytes);
  }

  absl::Status Fetch(absl::Span<std::byte* const> targets, LandingSink& sink,
                     absl::Time deadline) override {
    WB_RETURN_IF_ERROR(failpoints_->Hit("disk.before_read"));
    // File by file, sequentially within each file.
    std::vector<size_t> order;  // the tensors wanted (a group's replicas may be skipped)
    for (size_t i = 0; i < manifest_.tensors.size(); ++i) {
      if (targets[i] != nullptr || manifest_.tensors[i].nbytes == 0) order.push_back(i);
    }
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const Location &la = locations_[a], &lb = locations_[b];
      return la.file != lb.file ? la.file < lb.file : la.offset < lb.offset;
    });
    for (size_t begin = 0; begin < order.size();) {
      const size_t file = locations_[order[begin]].file;
      size_t end = begin;
      while (end < order.size() && locations_[order[end]].file == file) ++end;
      WB_ASSIGN_OR_RETURN(UniqueFd fd, OpenAt(dirs_[files_[file].dir].get(), files_[file].name,
                                              O_RDONLY, files_[file].path));
      // Whole-file sequential reads: let the kernel read ahead further on a cold cache.
      (void)::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
      std::vector<IoRequest> requests;
      requests.reserve(end - begin);
      for (size_t k = begin; k < end; ++k) {
        const size_t i = order[k];
        requests.push_back(
            IoRequest{fd.get(), locations_[i].offset, targets[i], manifest_.tensors[i].nbytes});
      }
      WB_RETURN_IF_ERROR(io_->Read(
          requests, deadline, [&](size_t r) { sink.Landed(order[begin + r]); },
          [&](size_t r) {
            return absl::StrFormat("%s (tensor \"%s\", version %d)", files_[file].path,
                                   manifest_.tensors[order[begin + r]].name, manifest_.version);
          }));
      begin = end;
    }
    return absl::OkStatus();
  }

  absl::Status FetchRanges(absl::Span<const RangeRead> reads, absl::Time deadline) override {
    WB_RETURN_IF_ERROR(failpoints_->Hit("disk.before_read"));
    // File by file, in file order: the kernel sees ascending offsets within each file.
    std::vector<size_t> order(reads.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    auto at = [&](size_t k) { return locations_[reads[k].tensor].offset + reads[k].offset; };
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const size_t fa = locations_[reads[a].tensor].file, fb = locations_[reads[b].tensor].file;
      return fa != fb ? fa < fb : at(a) < at(b);
    });
    for (size_t begin = 0; begin < order.size();) {
      const size_t file = locations_[reads[order[begin]].tensor].file;
      size_t end = begin;
      while (end < order.size() && locations_[reads[order[end]].tensor].file == file) ++end;
      WB_ASSIGN_OR_RETURN(UniqueFd fd, OpenAt(dirs_[files_[file].dir].get(), files_[file].name,
                                              O_RDONLY, files_[file].path));
      std::vector<IoRequest> requests;
      requests.reserve(end - begin);
      for (size_t k = begin; k < end; ++k) {
        const RangeRead& r = reads[order[k]];
        if (r.offset > manifest_.tensors[r.tensor].nbytes ||
            r.length > manifest_.tensors[r.tensor].nbytes - r.offset) {
          return absl::InternalError(absl::StrFormat(
              "disk: range [%d, %d) asked of tensor \"%s\" of %d bytes (version %d)", r.offset,
              r.offset + r.length, manifest_.tensors[r.tensor].name,
              manifest_.tensors[r.tensor].nbytes, manifest_.version));
        }
        requests.push_back(IoRequest{fd.get(), at(order[k]), r.target, r.length});
      }
      WB_RETURN_IF_ERROR(io_->Read(
          requests, deadline, [](size_t) {},
          [&](size_t q) {
            const RangeRead& r = reads[order[begin + q]];
            return absl::StrFormat("%s (tensor \"%s\" bytes [%d, %d), version %d)",
                                   files_[file].path, manifest_.tensors[r.tensor].name, r.offset,
                                   r.offset + r.length, manifest_.version);
          }));
      begin = end;
    }
    return absl::OkStatus();
  }

 private:
  Manifest manifest_;
  // The version directory (and a group version's rank directories), held open: files are
  // opened relative to them.
  std::vector<UniqueFd> dirs_;
  std::vector<DataFile> files_;
  std::vector<Location> locations_;
  UniqueFd pin_;  // shared flock on .readers.lock: retention leaves this version alone
  FileIo* io_;
  FailPoints* failpoints_;
};

class DiskSubscriber final : public TransportSubscriber {
 public:
  DiskSubscriber(std::string root, std::unique_ptr<FileIo> io, FailPoints failpoints,
                 absl::Duration poll_interval, UniqueFd cancel)
      : root_(std::move(root)),
        io_(std::move(io)),
        failpoints_(std::move(failpoints)),
        poll_interval_(poll_interval),
        cancel_(std::move(cancel)) {
    inotify_ = UniqueFd(inotify_init1(IN_NONBLOCK | IN_CLOEXEC));
    if (!inotify_) {
      Log(LogLevel::kInfo, "inotify unavailable (%s); polling %s every %s", strerror(errno), root_,
          absl::FormatDuration(poll_interval_));
    }
  }

  // Wakes a WaitForVersion sleeping in poll(2) through the eventfd in its poll set; this and
  // every later call then return Cancelled.
  void Cancel() override {
    cancelled_.store(true);
    const uint64_t one = 1;
    (void)!::write(cancel_.get(), &one, sizeof(one));
  }

  absl::StatusOr<std::unique_ptr<IncomingVersion>> WaitForVersion(uint64_t min_version,
                                                                  absl::Time deadline) override;

  absl::StatusOr<std::unique_ptr<IncomingVersion>> OpenVersion(uint64_t version,
                                                               absl::Time deadline) override {
    WB_RETURN_IF_ERROR(CheckCancelled());
    WB_ASSIGN_OR_RETURN(Channel channel, Channel::Open(root_));
    WB_ASSIGN_OR_RETURN(std::optional<uint64_t> latest, channel.ReadLatest());
    if (!latest || version > *latest) {
      return absl::NotFoundError(
          absl::StrFormat("disk://%s: version %d is not committed (newest committed: %s)", root_,
                          version, latest ? std::to_string(*latest) : "none"));
    }
    absl::StatusOr<std::unique_ptr<IncomingVersion>> v = OpenCommitted(channel, version, deadline);
    if (absl::IsAborted(v.status())) {
      return absl::NotFoundError(
          absl::StrFormat("disk://%s: version %d is no longer kept (retention)", root_, version));
    }
    return v;
  }

  absl::StatusOr<std::vector<uint64_t>> ListVersions() override {
    WB_RETURN_IF_ERROR(CheckCancelled());
    absl::StatusOr<Channel> channel = Channel::Open(root_);
    if (absl::IsNotFound(channel.status())) return std::vector<uint64_t>();
    if (!channel.ok()) return channel.status();
    WB_ASSIGN_OR_RETURN(std::optional<uint64_t> latest, channel->ReadLatest());
    WB_ASSIGN_OR_RETURN(std::vector<uint64_t> dirs, channel->ListVersionDirs());
    std::vector<uint64_t> out;
    for (uint64_t v : dirs) {
      if (latest && v <= *latest) out.push_back(v);
    }
    return out;
  }

 private:
  // Opens and validates committed version `v`. NotFound means it was retired meanwhile.
  // Opens committed version `v`; Aborted means retention retired it before it could be pinned.
  absl::StatusOr<std::unique_ptr<IncomingVersion>> OpenCommitted(const Channel& channel, uint64_t v,
                                                                 absl::Time deadline);
  // OpenCommitted's work, before missing files are turned into DataLoss.
  absl::StatusOr<std::unique_ptr<IncomingVersion>> PinAndOpen(const Channel& channel, uint64_t v,
                                                              absl::Time deadline);
  // Where each tensor of one checkpoint directory is: its file (index into `files`) and entry.
  using Where = absl::flat_hash_map<std::string, std::pair<size_t, const safetensors::Entry*>>;
  // Reads the safetensors headers of the checkpoint in directory `dfd` (path `dir`, index
  // `dir_index` among the version's directories), appending its files to `files`.
  absl::Status ReadCheckpoint(int dfd, const std::string& dir, uint64_t v, size_t dir_index,
                              std::vector<DataFile>& files, Where& where);
  void WatchIfPossible();
  void Sleep(absl::Time deadline);
  absl::Status CheckCancelled() const {
    if (!cancelled_.load()) return absl::OkStatus();
    return absl::CancelledError(
        absl::StrFormat("disk://%s: the subscriber was cancelled (it is being destroyed)", root_));
  }

  std::string root_;
  std::unique_ptr<FileIo> io_;
  FailPoints failpoints_;
  absl::Duration poll_interval_;
  UniqueFd cancel_;  // eventfd: Cancel() makes it readable
  std::atomic<bool> cancelled_{false};
  UniqueFd inotify_;
  bool watching_ = false;
};

void DiskSubscriber::WatchIfPossible() {
  if (watching_ || !inotify_) return;
  // LATEST is replaced by rename: IN_MOVED_TO on the root directory announces each commit.
  if (inotify_add_watch(inotify_.get(), root_.c_str(), IN_MOVED_TO | IN_CREATE | IN_CLOSE_WRITE) >=
      0) {
    watching_ = true;
  }
}

void DiskSubscriber::Sleep(absl::Time deadline) {
  const absl::Duration wait =
      std::max(std::min(deadline - absl::Now(), poll_interval_), absl::ZeroDuration());
  // The cancel eventfd is always in the set; inotify when the channel is watched.
  pollfd p[2] = {{cancel_.get(), POLLIN, 0}, {watching_ ? inotify_.get() : -1, POLLIN, 0}};
  int ms = static_cast<int>(absl::ToInt64Milliseconds(wait + absl::Milliseconds(1)) - 1);
  if (::poll(p, 2, std::max(ms, 0)) > 0 && (p[1].revents & POLLIN) != 0) {
    char buf[4096];
    while (::read(inotify_.get(), buf, sizeof(buf)) > 0) {
    }
  }
}

absl::StatusOr<std::unique_ptr<IncomingVersion>> DiskSubscriber::WaitForVersion(
    uint64_t min_version, absl::Time deadline) {
  std::optional<uint64_t> newest;
  while (true) {
    WB_RETURN_IF_ERROR(CheckCancelled());
    WatchIfPossible();
    // Opened afresh each time: the path may come to name a new directory (deleted and
    // recreated), or exist only later.
    absl::StatusOr<Channel> channel = Channel::Open(root_);
    if (channel.ok()) {
      WB_ASSIGN_OR_RETURN(newest, channel->ReadLatest());
    } else if (absl::IsNotFound(channel.status())) {
      newest.reset();
    } else {
      return channel.status();
    }
    if (newest && *newest >= min_version) {
      absl::StatusOr<std::unique_ptr<IncomingVersion>> v =
          OpenCommitted(*channel, *newest, deadline);
      if (!absl::IsAborted(v.status())) return v;
      // Retired between reading LATEST and pinning it, which retention only does to versions
      // older than the newest: LATEST must have moved on. If it has not, the channel is broken.
      WB_ASSIGN_OR_RETURN(std::optional<uint64_t> now, channel->ReadLatest());
      if (now == newest) {
        return absl::DataLossError(
            absl::StrFormat("disk://%s: LATEST names version %d but its directory %s is missing",
                            root_, *newest, channel->VersionDir(*newest)));
      }
      Log(LogLevel::kDebug, "version %d retired while opening it; re-reading LATEST", *newest);
    }
    if (absl::Now() >= deadline) {
      // A mistyped path looks like an idle publisher: say when the channel does not exist.
      return absl::DeadlineExceededError(absl::StrFormat(
          "disk://%s: no version >= %d was committed by the deadline (newest committed: %s)%s",
          root_, min_version, newest ? std::to_string(*newest) : "none",
          channel.ok() ? "" : "; the channel directory does not exist (yet): is the path right?"));
    }
    if (!newest || *newest < min_version) Sleep(deadline);
  }
}

absl::StatusOr<std::unique_ptr<IncomingVersion>> DiskSubscriber::OpenCommitted(
    const Channel& channel, uint64_t v, absl::Time deadline) {
  absl::StatusOr<std::unique_ptr<IncomingVersion>> opened = PinAndOpen(channel, v, deadline);
  // A file missing from a pinned, committed version is corruption, not absence; so is a link
  // planted where a file of the version belongs.
  if (absl::IsNotFound(opened.status()) || absl::IsFailedPrecondition(opened.status())) {
    return absl::DataLossError(absl::StrFormat("disk://%s: committed version %d is incomplete: %s",
                                               root_, v, opened.status().message()));
  }
  return opened;
}

absl::StatusOr<std::unique_ptr<IncomingVersion>> DiskSubscriber::PinAndOpen(const Channel& channel,
                                                                            uint64_t v,
                                                                            absl::Time deadline) {
  const std::string name = VersionDirName(v);
  const std::string dir = channel.VersionDir(v);
  const std::string lock_path = absl::StrFormat("%s/%s", dir, kReaderLock);
  absl::StatusOr<UniqueFd> versions = channel.OpenVersionsDir();
  if (absl::IsNotFound(versions.status())) {
    return absl::AbortedError(absl::StrFormat("version %d was retired", v));
  }
  if (!versions.ok()) return versions.status();
  absl::StatusOr<UniqueFd> dir_fd = OpenDirAt(versions->get(), name, dir);
  // Committed versions always have the lock file; a missing directory means retired.
  if (absl::IsNotFound(dir_fd.status())) {
    return absl::AbortedError(absl::StrFormat("version %d was retired", v));
  }
  if (!dir_fd.ok()) return dir_fd.status();
  const int dfd = dir_fd->get();
  absl::StatusOr<UniqueFd> pin = OpenAt(dfd, kReaderLock, O_RDONLY, lock_path);
  if (absl::IsNotFound(pin.status())) {
    return absl::DataLossError(
        absl::StrFormat("version %d in %s has no %s file", v, dir, kReaderLock));
  }
  if (!pin.ok()) return pin.status();
  struct stat pin_stat;
  if (::fstat(pin->get(), &pin_stat) != 0 || !S_ISREG(pin_stat.st_mode)) {
    return absl::DataLossError(
        absl::StrFormat("version %d: %s is not a regular file", v, lock_path));
  }
  // Retention holds LOCK_EX only while renaming a version away; wait that out.
  while (::flock(pin->get(), LOCK_SH | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) {
      return ErrnoStatus(errno, absl::StrFormat("lock %s", lock_path));
    }
    WB_RETURN_IF_ERROR(CheckCancelled());
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrFormat("disk://%s: could not pin version %d by the deadline", root_, v));
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  // If retention renamed the directory before we locked, the name no longer leads to ours.
  struct stat ours, now;
  if (::fstat(dfd, &ours) != 0 ||
      ::fstatat(versions->get(), name.c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0 ||
      ours.st_ino != now.st_ino || ours.st_dev != now.st_dev) {
    return absl::AbortedError(absl::StrFormat("version %d was retired", v));
  }

  const std::string manifest_path = absl::StrFormat("%s/%s", dir, kManifestFile);
  WB_ASSIGN_OR_RETURN(std::string manifest_text,
                      ReadSmallFileAt(dfd, kManifestFile, kMaxMetadataFile, manifest_path));
  WB_ASSIGN_OR_RETURN(Manifest manifest, Manifest::FromJson(manifest_text, manifest_path));
  if (manifest.version != v) {
    return absl::DataLossError(
        absl::StrFormat("%s says version %d but lies in the directory of "
                        "version %d",
                        manifest_path, manifest.version, v));
  }

  // Which files hold which tensors: the version directory's checkpoint, or, for a group
  // version, each rank's (rank-<r>/), where its parts are found by their owner.
  std::vector<UniqueFd> dirs;
  std::vector<DataFile> files;
  std::vector<Where> where;  // per directory
  if (!manifest.group) {
    dirs.push_back(*std::move(dir_fd));
    where.emplace_back();
    WB_RETURN_IF_ERROR(ReadCheckpoint(dirs[0].get(), dir, v, 0, files, where[0]));
  } else {
    for (int r = 0; r < manifest.publisher.world_size; ++r) {
      const std::string rank_dir = absl::StrFormat("%s/%s", dir, RankDirName(r));
      WB_ASSIGN_OR_RETURN(UniqueFd fd, OpenDirAt(dfd, RankDirName(r), rank_dir));
      dirs.push_back(std::move(fd));
      where.emplace_back();
      WB_RETURN_IF_ERROR(
          ReadCheckpoint(dirs.back().get(), rank_dir, v, dirs.size() - 1, files, where.back()));
    }
    dirs.insert(dirs.begin(), *std::move(dir_fd));  // kept open with the version's pin
    for (DataFile& f : files) ++f.dir;
    where.insert(where.begin(), Where());
  }
  // Every tensor a file holds is in the manifest, and every manifest tensor in its files.
  std::vector<size_t> listed(where.size(), 0);
  for (const TensorInfo& t : manifest.tensors) ++listed[manifest.group ? t.owner + 1 : 0];
  for (size_t d = 0; d < where.size(); ++d) {
    if (where[d].size() == listed[d]) continue;
    for (const auto& [name, loc] : where[d]) {
      bool found = false;
      for (const TensorInfo& t : manifest.tensors) {
        found |= t.name == name && (!manifest.group || static_cast<size_t>(t.owner) + 1 == d);
      }
      if (!found) {
        return absl::DataLossError(absl::StrFormat(
            "version %d: %s holds tensor \"%s\", which the manifest %s does not list", v,
            files[loc.first].path, name, manifest_path));
      }
    }
  }
  std::vector<Location> locations;
  locations.reserve(manifest.tensors.size());
  for (const TensorInfo& t : manifest.tensors) {
    const Where& w = where[manifest.group ? t.owner + 1 : 0];
    auto it = w.find(t.name);
    if (it == w.end()) {
      return absl::DataLossError(absl::StrFormat(
          "version %d: manifest tensor \"%s\"%s is in none of the files (%d files)", v, t.name,
          manifest.group ? absl::StrFormat(" of rank %d", t.owner) : "", files.size()));
    }
    const auto& [k, e] = it->second;
    if (e->dtype != t.dtype || e->shape != t.shape || e->nbytes() != t.nbytes) {
      return absl::DataLossError(absl::StrFormat(
          "version %d: tensor \"%s\" is %s %s (%d bytes) in %s but %s %s (%d bytes) in the "
          "manifest",
          v, t.name, DTypeName(e->dtype), ShapeString(e->shape), e->nbytes(), files[k].path,
          DTypeName(t.dtype), ShapeString(t.shape), t.nbytes));
    }
    locations.push_back(Location{k, files[k].header.data_start + e->begin});
  }
  return std::unique_ptr<IncomingVersion>(
      new DiskVersion(std::move(manifest), std::move(dirs), std::move(files), std::move(locations),
                      *std::move(pin), io_.get(), &failpoints_));
}

absl::Status DiskSubscriber::ReadCheckpoint(int dfd, const std::string& dir, uint64_t v,
                                            size_t dir_index, std::vector<DataFile>& files,
                                            Where& where) {
  // Which files: the index's weight_map when sharded, else the single file.
  std::vector<std::string> names;
  const std::string index_path = absl::StrFormat("%s/%s", dir, kIndexFile);
  absl::StatusOr<std::string> index_read =
      ReadSmallFileAt(dfd, kIndexFile, kMaxMetadataFile, index_path);
  if (!index_read.ok() && !absl::IsNotFound(index_read.status())) return index_read.status();
  if (index_read.ok()) {
    const std::string& index_text = *index_read;
    nlohmann::json index = nlohmann::json::parse(index_text, nullptr, false);
    if (index_text.find('\0') != std::string::npos || index.is_discarded() || !index.is_object() ||
        !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return absl::DataLossError(absl::StrFormat("%s has no weight_map object", index_path));
    }
    for (const auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string()) {
        return absl::DataLossError(
            absl::StrFormat("%s: weight_map[\"%s\"] is not a file name", index_path, name));
      }
      const std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos || f.empty() || f[0] == '.') {
        return absl::DataLossError(absl::StrFormat(
            "%s: weight_map names \"%s\", not a file of the version", index_path, f));
      }
      if (std::find(names.begin(), names.end(), f) == names.end()) names.push_back(f);
    }
    std::sort(names.begin(), names.end());
  } else {
    names.push_back(kSingleFile);
  }

  const size_t first = files.size();
  for (const std::string& name : names) {
    DataFile f;
    f.dir = dir_index;
    f.name = name;
    f.path = absl::StrFormat("%s/%s", dir, name);
    WB_ASSIGN_OR_RETURN(UniqueFd fd, OpenAt(dfd, name, O_RDONLY, f.path));
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, absl::StrFormat("stat %s", f.path));
    if (!S_ISREG(st.st_mode)) {
      return absl::DataLossError(
          absl::StrFormat("version %d: %s is not a regular file", v, f.path));
    }
    absl::StatusOr<safetensors::Header> header =
        safetensors::ReadHeader(fd.get(), static_cast<uint64_t>(st.st_size), f.path);
    if (!header.ok()) {
      return absl::Status(header.status().code(),
                          absl::StrFormat("version %d: %s", v, header.status().message()));
    }
    f.header = *std::move(header);
    files.push_back(std::move(f));
  }
  for (size_t k = first; k < files.size(); ++k) {
    for (const safetensors::Entry& e : files[k].header.tensors) {
      if (!where.emplace(e.name, std::make_pair(k, &e)).second) {
        return absl::DataLossError(absl::StrFormat("version %d: tensor \"%s\" is in both %s and %s",
                                                   v, e.name, files[where[e.name].first].path,
                                                   files[k].path));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TransportSubscriber>> OpenDiskSubscriber(const Uri& uri,
                                                                        const Config& config) {
  WB_ASSIGN_OR_RETURN(std::string root, ChannelRoot(uri));
  WB_ASSIGN_OR_RETURN(FailPoints failpoints, FailPoints::Parse(config.String("failpoints")));
  WB_ASSIGN_OR_RETURN(std::unique_ptr<FileIo> io, MakeFileIo(uri, config));
  absl::Duration poll = config.Duration("poll_interval");
  if (poll <= absl::ZeroDuration()) poll = absl::Milliseconds(1);
  UniqueFd cancel(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!cancel) {
    return ErrnoStatus(errno, absl::StrFormat("%s: eventfd for cancellation", uri.Display()));
  }
  return std::unique_ptr<TransportSubscriber>(new DiskSubscriber(
      std::move(root), std::move(io), std::move(failpoints), poll, std::move(cancel)));
}

}  // namespace weightbus::internal::disk

// SPDX-License-Identifier: Apache-2.0
// On-disk layout of a disk:// channel (documented in docs/FORMAT.md):
//
//   <root>/LATEST                      decimal number of the newest committed version + '\n';
//                                      replaced by rename(2): the commit point
//   <root>/.LATEST.tmp-<pid>          LATEST being replaced (never read)
//   <root>/publisher.lock              flock(LOCK_EX) by the one live publisher; holds its pid
//   <root>/versions/v<20 digits>/      one committed version, a Hugging Face checkpoint:
//       model.safetensors              or model-0000K-of-0000N.safetensors + index.json
//       model.safetensors.index.json   (only when sharded into several files)
//       weightbus.manifest.json        the version's Manifest
//       .readers.lock                  flock(LOCK_SH) by readers; retention needs LOCK_EX
//   <root>/versions/.tmp-*/            a version being written (never read)
//   <root>/versions/.trash-*/          a version being deleted (never read)
// A publisher group (world_size > 1; docs/FORMAT.md, "Publisher groups"):
//   <root>/publisher.lock              flock(LOCK_SH) by every rank (keeps a single publisher out)
//   <root>/publisher-r<5 digits>.lock  flock(LOCK_EX) by the one live process of that rank
//   <root>/group.lock                  flock(LOCK_EX) while a rank adds, withdraws or commits
//   <root>/versions/.group-v<20 digits>/  a group version being assembled (never read):
//       rank-<5 digits>/               one rank's part, renamed in once durable (the marker): its
//                                      safetensors files, index and part manifest
//       .tmp-rank-<5 digits>-<pid>/    a rank's part being written
//       rank-<5 digits>.failed         the set was refused ({"code", "message"}); the part no
//                                      longer counts
//       rank-<5 digits>.withdrawn      the rank gave up waiting and took its part back
//   <root>/versions/v<20 digits>/      a committed group version: the rank-*/ parts, the group's
//                                      weightbus.manifest.json and .readers.lock
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/system.h"

namespace weightbus::internal::disk {

inline constexpr char kLatestFile[] = "LATEST";
inline constexpr char kPublisherLock[] = "publisher.lock";
inline constexpr char kVersionsDir[] = "versions";
inline constexpr char kManifestFile[] = "weightbus.manifest.json";
inline constexpr char kReaderLock[] = ".readers.lock";
inline constexpr char kIndexFile[] = "model.safetensors.index.json";
inline constexpr char kSingleFile[] = "model.safetensors";
inline constexpr char kTmpPrefix[] = ".tmp-";
inline constexpr char kTrashPrefix[] = ".trash-";
inline constexpr char kLatestTmpPrefix[] = ".LATEST.tmp-";
inline constexpr char kGroupPrefix[] = ".group-";
inline constexpr char kGroupLock[] = "group.lock";
inline constexpr char kFailedSuffix[] = ".failed";
inline constexpr char kWithdrawnSuffix[] = ".withdrawn";
// Largest manifest or index file read (a million tensors fit comfortably).
inline constexpr size_t kMaxMetadataFile = size_t{512} << 20;

// "v00000000000000000042" for 42: fixed width, so names sort like numbers.
std::string VersionDirName(uint64_t version);
std::optional<uint64_t> ParseVersionDirName(std::string_view name);
// ".group-v00000000000000000042": a group version being assembled.
std::string GroupDirName(uint64_t version);
// "rank-00003": a rank's part of a group version.
std::string RankDirName(int rank);
// "publisher-r00003.lock": the lock of one rank of a publisher group.
std::string RankLockName(int rank);
// "model.safetensors" when n == 1, else "model-0000K-of-0000N.safetensors" (k is 1-based).
std::string ShardFileName(size_t k, size_t n);

// The modes of what a publisher creates in a channel (docs/TRANSPORTS.md, "disk://": who can
// read a channel): by default its user's only, directories 0700 and files 0600; with the setting
// `group_access` its group may read too, 0750 and 0640. They are applied exactly (fchmod after
// each creation), so the process umask neither widens nor narrows them. What exists already (a
// channel directory the user made, `versions` of an earlier publisher) keeps its mode.
struct Modes {
  mode_t dir = 0700;
  mode_t file = 0600;
};
Modes ChannelModes(bool group_access);

// Every file and directory inside a channel is reached with the *at() calls relative to a
// descriptor of the directory holding it, and opened with O_NOFOLLOW (O_CLOEXEC too): a symbolic
// link planted in a channel (publisher.lock, a LATEST temporary, `versions`, a version directory
// or a file in one) is never followed, so it cannot make the library write, truncate or read
// anything outside the channel. Such a link is FailedPrecondition naming it. Only the channel
// root's own path, which the user names, is resolved like any path. Errors name `path`, the
// file's path for messages.

// openat(dirfd, name, flags | O_NOFOLLOW | O_CLOEXEC, mode); opened with O_NONBLOCK (cleared
// once open) so that a FIFO planted in the channel cannot block. A file it creates (O_CREAT |
// O_EXCL) gets exactly `mode` (fchmod). Callers that read check the file is regular.
absl::StatusOr<UniqueFd> OpenAt(int dirfd, const std::string& name, int flags,
                                const std::string& path, mode_t mode = 0600);
// A directory below `dirfd` (O_DIRECTORY | O_NOFOLLOW).
absl::StatusOr<UniqueFd> OpenDirAt(int dirfd, const std::string& name, const std::string& path);
// fsync of an open file or directory (so a rename or create in it is durable).
absl::Status FsyncFd(int fd, const std::string& path);
// mkdir -p of a path the user names (the channel root; links in it are followed). Missing
// parents are made as mkdir -p makes them; `path` itself, when this call creates it, gets exactly
// `mode` (an existing one keeps its own).
absl::Status MakeDirs(const std::string& path, mode_t mode);
// mkdirat(dirfd, name) with exactly `mode`; an existing directory is fine (and keeps its mode)
// when `exist_ok`.
absl::Status MakeDirAt(int dirfd, const std::string& name, mode_t mode, bool exist_ok,
                       const std::string& path);
// Removes `name` below `dirfd`, a file, link or directory tree (never following a link); a
// missing name is fine.
absl::Status RemoveTreeAt(int dirfd, const std::string& name, const std::string& path);
// Creates `name` below `dirfd` (O_EXCL: it must not exist) with exactly `mode`, writes
// `contents` and, if `sync`, fsyncs it.
absl::Status WriteSmallFileAt(int dirfd, const std::string& name, std::string_view contents,
                              bool sync, const std::string& path, mode_t mode);
// Reads a whole small file of at most `max_bytes`. Errors: NotFound, DataLoss if larger.
absl::StatusOr<std::string> ReadSmallFileAt(int dirfd, const std::string& name, size_t max_bytes,
                                            const std::string& path);
// Names of the entries of directory `dirfd` (without "." and "..").
absl::StatusOr<std::vector<std::string>> ListDirAt(int dirfd, const std::string& path);

// One channel directory, held open: every operation is relative to this descriptor, so a
// publisher keeps working on the directory it locked even if the path comes to name another.
class Channel {
 public:
  // Opens the directory `root` (it must exist); what this object creates in it gets `modes`.
  // Errors: NotFound when it does not.
  static absl::StatusOr<Channel> Open(std::string root, Modes modes = {});
  const std::string& root() const { return root_; }
  const Modes& modes() const { return modes_; }
  int fd() const { return fd_.get(); }
  // Paths for messages.
  std::string Path(std::string_view rel) const;
  std::string VersionsDir() const { return Path(kVersionsDir); }
  std::string VersionDir(uint64_t version) const;

  // The `versions` directory. Errors: NotFound when it does not exist (yet).
  absl::StatusOr<UniqueFd> OpenVersionsDir() const;
  // The committed version named by LATEST, or nullopt when there is none yet.
  // Errors: DataLoss when LATEST does not hold a number.
  absl::StatusOr<std::optional<uint64_t>> ReadLatest() const;
  // Points LATEST at `version`: write a temporary file, fsync it (if `sync`) and rename it over
  // LATEST. Once this returns OK the version is committed (visible); the caller then fsyncs the
  // root directory to make the commit durable.
  // `tag` (non-empty for a rank of a group, which shares the channel with its other ranks)
  // names the temporary file along with the pid.
  absl::Status WriteLatest(uint64_t version, bool sync, std::string_view tag = "") const;
  // Numbers of the version directories present (committed or not), ascending.
  absl::StatusOr<std::vector<uint64_t>> ListVersionDirs() const;
  // OK while the path root() still names the directory this object holds and `name` in it is
  // still the file `fd` (when fd >= 0). FailedPrecondition otherwise: the channel directory (or
  // the file) was deleted or replaced since it was opened.
  absl::Status CheckStillAt(int fd, const std::string& name) const;

 private:
  Channel(std::string root, UniqueFd fd, Modes modes)
      : root_(std::move(root)), fd_(std::move(fd)), modes_(modes) {}
  std::string root_;
  UniqueFd fd_;
  Modes modes_;
};

}  // namespace weightbus::internal::disk

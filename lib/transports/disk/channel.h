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
#pragma once

#include <sys/types.h>

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

// "v00000000000000000042" for 42: fixed width, so names sort like numbers.
std::string VersionDirName(uint64_t version);
std::optional<uint64_t> ParseVersionDirName(std::string_view name);
// "model.safetensors" when n == 1, else "model-0000K-of-0000N.safetensors" (k is 1-based).
std::string ShardFileName(size_t k, size_t n);

// open(2) with O_CLOEXEC; errors name `path`.
absl::StatusOr<UniqueFd> OpenFile(const std::string& path, int flags, mode_t mode = 0644);
// fsync of a directory (so a rename or create in it is durable).
absl::Status FsyncDir(const std::string& path);
// mkdir -p. Errors name the path.
absl::Status MakeDirs(const std::string& path);
// Removes a file or a directory tree; a missing path is fine.
absl::Status RemoveTree(const std::string& path);
// Writes a small file with write(2) and, if `sync`, fsyncs it. Creates or truncates.
absl::Status WriteSmallFile(const std::string& path, std::string_view contents, bool sync);
// Reads a whole small file of at most `max_bytes`. Errors: NotFound, DataLoss if larger.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes);

// Paths and the commit pointer of one channel.
class Channel {
 public:
  explicit Channel(std::string root) : root_(std::move(root)) {}
  const std::string& root() const { return root_; }
  std::string Path(std::string_view rel) const;
  std::string VersionsDir() const { return Path(kVersionsDir); }
  std::string VersionDir(uint64_t version) const;

  // The committed version named by LATEST, or nullopt when there is none yet.
  // Errors: DataLoss when LATEST does not hold a number.
  absl::StatusOr<std::optional<uint64_t>> ReadLatest() const;
  // Points LATEST at `version`: write a temporary file, fsync it (if `sync`) and rename it over
  // LATEST. Once this returns OK the version is committed (visible); the caller then fsyncs the
  // root directory to make the commit durable.
  absl::Status WriteLatest(uint64_t version, bool sync) const;
  // Numbers of the version directories present (committed or not), ascending.
  absl::StatusOr<std::vector<uint64_t>> ListVersionDirs() const;

 private:
  std::string root_;
};

}  // namespace weightbus::internal::disk

// SPDX-License-Identifier: Apache-2.0
#include "transports/disk/channel.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace weightbus::internal::disk {

std::string VersionDirName(uint64_t version) { return absl::StrFormat("v%020d", version); }

std::optional<uint64_t> ParseVersionDirName(std::string_view name) {
  if (name.size() != 21 || name[0] != 'v') return std::nullopt;
  uint64_t v = 0;
  auto [ptr, ec] = std::from_chars(name.data() + 1, name.data() + name.size(), v);
  if (ec != std::errc() || ptr != name.data() + name.size()) return std::nullopt;
  return v;
}

std::string ShardFileName(size_t k, size_t n) {
  if (n == 1) return kSingleFile;
  return absl::StrFormat("model-%05d-of-%05d.safetensors", k, n);
}

absl::StatusOr<UniqueFd> OpenFile(const std::string& path, int flags, mode_t mode) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  if (fd < 0) return ErrnoStatus(errno, absl::StrFormat("open %s", path));
  return UniqueFd(fd);
}

absl::Status FsyncDir(const std::string& path) {
  WB_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY | O_DIRECTORY));
  if (::fsync(fd.get()) != 0) return ErrnoStatus(errno, absl::StrFormat("fsync %s", path));
  return absl::OkStatus();
}

absl::Status MakeDirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrFormat("create directory %s", path));
  return absl::OkStatus();
}

absl::Status RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec && ec.value() != ENOENT) {
    return ErrnoStatus(ec.value(), absl::StrFormat("remove %s", path));
  }
  return absl::OkStatus();
}

absl::Status WriteSmallFile(const std::string& path, std::string_view contents, bool sync) {
  WB_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_WRONLY | O_CREAT | O_TRUNC));
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t n = ::write(fd.get(), contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrFormat("write %s", path));
    }
    done += static_cast<size_t>(n);
  }
  if (sync && ::fsync(fd.get()) != 0) return ErrnoStatus(errno, absl::StrFormat("fsync %s", path));
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes) {
  WB_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, absl::StrFormat("stat %s", path));
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return absl::DataLossError(
        absl::StrFormat("%s has %d bytes, more than the %d allowed", path, st.st_size, max_bytes));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n = ::pread(fd.get(), out.data() + done, out.size() - done, done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrFormat("read %s", path));
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  out.resize(done);
  return out;
}

std::string Channel::Path(std::string_view rel) const {
  return absl::StrFormat("%s/%s", root_, rel);
}

std::string Channel::VersionDir(uint64_t version) const {
  return absl::StrFormat("%s/%s/%s", root_, kVersionsDir, VersionDirName(version));
}

absl::StatusOr<std::optional<uint64_t>> Channel::ReadLatest() const {
  const std::string path = Path(kLatestFile);
  absl::StatusOr<std::string> text = ReadSmallFile(path, 64);
  if (absl::IsNotFound(text.status())) return std::optional<uint64_t>();
  if (!text.ok()) return text.status();
  uint64_t v = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &v)) {
    return absl::DataLossError(absl::StrFormat("%s holds \"%s\", which is not a version number",
                                               path, absl::CHexEscape(*text)));
  }
  return std::optional<uint64_t>(v);
}

absl::Status Channel::WriteLatest(uint64_t version, bool sync) const {
  const std::string tmp = Path(absl::StrFormat("%s%d", kLatestTmpPrefix, getpid()));
  absl::Status written = WriteSmallFile(tmp, absl::StrFormat("%d\n", version), sync);
  if (!written.ok()) {
    ::unlink(tmp.c_str());
    return written;
  }
  if (::rename(tmp.c_str(), Path(kLatestFile).c_str()) != 0) {
    absl::Status s = ErrnoStatus(errno, absl::StrFormat("rename %s -> LATEST", tmp));
    ::unlink(tmp.c_str());
    return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint64_t>> Channel::ListVersionDirs() const {
  const std::string dir = VersionsDir();
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return std::vector<uint64_t>();
    return ErrnoStatus(errno, absl::StrFormat("list %s", dir));
  }
  std::vector<uint64_t> out;
  while (dirent* e = ::readdir(d)) {
    if (std::optional<uint64_t> v = ParseVersionDirName(e->d_name)) out.push_back(*v);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace weightbus::internal::disk

// SPDX-License-Identifier: Apache-2.0
#include "transports/disk/channel.h"

#include <dirent.h>
#include <fcntl.h>
#include <string.h>
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

std::string GroupDirName(uint64_t version) {
  return absl::StrFormat("%s%s", kGroupPrefix, VersionDirName(version));
}
std::string RankDirName(int rank) { return absl::StrFormat("rank-%05d", rank); }
std::string RankLockName(int rank) { return absl::StrFormat("publisher-r%05d.lock", rank); }

std::string ShardFileName(size_t k, size_t n) {
  if (n == 1) return kSingleFile;
  return absl::StrFormat("model-%05d-of-%05d.safetensors", k, n);
}

Modes ChannelModes(bool group_access) {
  return group_access ? Modes{0750, 0640} : Modes{0700, 0600};
}

namespace {

absl::Status OpenError(int err, const std::string& path) {
  if (err == ELOOP) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s is a symbolic link; weightbus never follows links inside a channel directory (remove "
        "it)",
        path));
  }
  return ErrnoStatus(err, absl::StrFormat("open %s", path));
}

}  // namespace

absl::StatusOr<UniqueFd> OpenAt(int dirfd, const std::string& name, int flags,
                                const std::string& path, mode_t mode) {
  // O_NONBLOCK so that a FIFO planted in the channel cannot block the open; cleared right
  // after (io_uring would otherwise answer EAGAIN on this file).
  int fd = ::openat(dirfd, name.c_str(), flags | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, mode);
  if (fd < 0) {
    const int err = errno;
    // O_DIRECTORY|O_NOFOLLOW on a link to a directory fails with ENOTDIR on some kernels.
    struct stat st;
    if ((err == ENOTDIR || err == ELOOP) &&
        ::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) {
      return OpenError(ELOOP, path);
    }
    return OpenError(err, path);
  }
  UniqueFd out(fd);
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    return ErrnoStatus(errno, absl::StrFormat("fcntl %s", path));
  }
  // Created here: exactly `mode`, whatever the umask.
  if ((flags & O_CREAT) && (flags & O_EXCL) && ::fchmod(fd, mode) != 0) {
    return ErrnoStatus(errno, absl::StrFormat("chmod %s to %o", path, mode));
  }
  return out;
}

absl::StatusOr<UniqueFd> OpenDirAt(int dirfd, const std::string& name, const std::string& path) {
  return OpenAt(dirfd, name, O_RDONLY | O_DIRECTORY, path);
}

absl::Status FsyncFd(int fd, const std::string& path) {
  if (::fsync(fd) != 0) return ErrnoStatus(errno, absl::StrFormat("fsync %s", path));
  return absl::OkStatus();
}

absl::Status MakeDirs(const std::string& path, mode_t mode) {
  std::error_code ec;
  const std::filesystem::path p(path);
  if (std::filesystem::is_directory(p, ec)) return absl::OkStatus();
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrFormat("create directory %s", p.parent_path()));
  if (::mkdir(path.c_str(), mode) != 0) {
    if (errno == EEXIST) return absl::OkStatus();  // made meanwhile by someone else: theirs
    return ErrnoStatus(errno, absl::StrFormat("create directory %s", path));
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrFormat("open directory %s", path));
  const UniqueFd dir(fd);
  if (::fchmod(fd, mode) != 0) {
    return ErrnoStatus(errno, absl::StrFormat("chmod %s to %o", path, mode));
  }
  return absl::OkStatus();
}

absl::Status MakeDirAt(int dirfd, const std::string& name, mode_t mode, bool exist_ok,
                       const std::string& path) {
  if (::mkdirat(dirfd, name.c_str(), mode) != 0) {
    if (errno == EEXIST && exist_ok) return absl::OkStatus();
    return ErrnoStatus(errno, absl::StrFormat("create directory %s", path));
  }
  WB_ASSIGN_OR_RETURN(UniqueFd dir, OpenDirAt(dirfd, name, path));
  if (::fchmod(dir.get(), mode) != 0) {
    return ErrnoStatus(errno, absl::StrFormat("chmod %s to %o", path, mode));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ListDirAt(int dirfd, const std::string& path) {
  // fdopendir takes ownership of its descriptor: give it a fresh one of the same directory.
  int fd = ::openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrFormat("list %s", path));
  DIR* d = ::fdopendir(fd);
  if (d == nullptr) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(err, absl::StrFormat("list %s", path));
  }
  std::vector<std::string> out;
  while (dirent* e = ::readdir(d)) {
    const std::string_view name(e->d_name);
    if (name != "." && name != "..") out.emplace_back(name);
  }
  ::closedir(d);
  return out;
}

absl::Status RemoveTreeAt(int dirfd, const std::string& name, const std::string& path) {
  struct stat st;
  if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoStatus(errno, absl::StrFormat("stat %s", path));
  }
  if (S_ISDIR(st.st_mode)) {
    absl::StatusOr<UniqueFd> dir = OpenDirAt(dirfd, name, path);
    if (absl::IsNotFound(dir.status())) return absl::OkStatus();
    if (!dir.ok()) return dir.status();
    WB_ASSIGN_OR_RETURN(std::vector<std::string> entries, ListDirAt(dir->get(), path));
    for (const std::string& e : entries) {
      WB_RETURN_IF_ERROR(RemoveTreeAt(dir->get(), e, absl::StrFormat("%s/%s", path, e)));
    }
    if (::unlinkat(dirfd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
      return ErrnoStatus(errno, absl::StrFormat("remove %s", path));
    }
    return absl::OkStatus();
  }
  if (::unlinkat(dirfd, name.c_str(), 0) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, absl::StrFormat("remove %s", path));
  }
  return absl::OkStatus();
}

absl::Status WriteSmallFileAt(int dirfd, const std::string& name, std::string_view contents,
                              bool sync, const std::string& path, mode_t mode) {
  WB_ASSIGN_OR_RETURN(UniqueFd fd, OpenAt(dirfd, name, O_WRONLY | O_CREAT | O_EXCL, path, mode));
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t n = ::write(fd.get(), contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrFormat("write %s", path));
    }
    done += static_cast<size_t>(n);
  }
  if (sync) WB_RETURN_IF_ERROR(FsyncFd(fd.get(), path));
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSmallFileAt(int dirfd, const std::string& name, size_t max_bytes,
                                            const std::string& path) {
  WB_ASSIGN_OR_RETURN(UniqueFd fd, OpenAt(dirfd, name, O_RDONLY, path));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, absl::StrFormat("stat %s", path));
  if (!S_ISREG(st.st_mode)) {
    return absl::DataLossError(absl::StrFormat("%s is not a regular file", path));
  }
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

absl::StatusOr<Channel> Channel::Open(std::string root, Modes modes) {
  int fd = ::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 && errno == EACCES) {
    return ErrnoStatus(
        errno, absl::StrFormat("open channel directory %s (a channel is readable by its "
                               "publisher's user only, or also by its group when published with "
                               "group_access=true)",
                               root));
  }
  if (fd < 0) return ErrnoStatus(errno, absl::StrFormat("open channel directory %s", root));
  return Channel(std::move(root), UniqueFd(fd), modes);
}

std::string Channel::Path(std::string_view rel) const {
  return absl::StrFormat("%s/%s", root_, rel);
}

std::string Channel::VersionDir(uint64_t version) const {
  return absl::StrFormat("%s/%s/%s", root_, kVersionsDir, VersionDirName(version));
}

absl::StatusOr<UniqueFd> Channel::OpenVersionsDir() const {
  return OpenDirAt(fd(), kVersionsDir, VersionsDir());
}

absl::StatusOr<std::optional<uint64_t>> Channel::ReadLatest() const {
  const std::string path = Path(kLatestFile);
  absl::StatusOr<std::string> text = ReadSmallFileAt(fd(), kLatestFile, 64, path);
  if (absl::IsNotFound(text.status())) return std::optional<uint64_t>();
  if (!text.ok()) return text.status();
  uint64_t v = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &v)) {
    return absl::DataLossError(absl::StrFormat("%s holds \"%s\", which is not a version number",
                                               path, absl::CHexEscape(*text)));
  }
  return std::optional<uint64_t>(v);
}

absl::Status Channel::WriteLatest(uint64_t version, bool sync, std::string_view tag) const {
  const std::string tmp = absl::StrFormat("%s%s%d", kLatestTmpPrefix, tag, getpid());
  const std::string tmp_path = Path(tmp);
  // The name is this process's: whatever is there (a stale file, or a planted link) goes first,
  // and the new file is created exclusively.
  WB_RETURN_IF_ERROR(RemoveTreeAt(fd(), tmp, tmp_path));
  absl::Status written =
      WriteSmallFileAt(fd(), tmp, absl::StrFormat("%d\n", version), sync, tmp_path, modes_.file);
  if (!written.ok()) {
    ::unlinkat(fd(), tmp.c_str(), 0);
    return written;
  }
  if (::renameat(fd(), tmp.c_str(), fd(), kLatestFile) != 0) {
    absl::Status s = ErrnoStatus(errno, absl::StrFormat("rename %s -> LATEST", tmp_path));
    ::unlinkat(fd(), tmp.c_str(), 0);
    return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint64_t>> Channel::ListVersionDirs() const {
  absl::StatusOr<UniqueFd> dir = OpenVersionsDir();
  if (absl::IsNotFound(dir.status())) return std::vector<uint64_t>();
  if (!dir.ok()) return dir.status();
  WB_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDirAt(dir->get(), VersionsDir()));
  std::vector<uint64_t> out;
  for (const std::string& name : names) {
    if (std::optional<uint64_t> v = ParseVersionDirName(name)) out.push_back(*v);
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::Status Channel::CheckStillAt(int file_fd, const std::string& name) const {
  struct stat held, now;
  if (::fstat(fd(), &held) != 0) return ErrnoStatus(errno, absl::StrFormat("stat %s", root_));
  if (::stat(root_.c_str(), &now) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "disk://%s: the channel directory was deleted while this publisher held it (%s); its "
        "lock no longer guards the channel at this path: open a new publisher",
        root_, strerror(errno)));
  }
  if (held.st_dev != now.st_dev || held.st_ino != now.st_ino) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "disk://%s: the channel directory was deleted and recreated while this publisher held it "
        "(inode %d, now %d); its lock no longer guards the channel at this path, where another "
        "publisher may write: open a new publisher",
        root_, held.st_ino, now.st_ino));
  }
  if (file_fd >= 0) {
    struct stat file_held, file_now;
    if (::fstat(file_fd, &file_held) != 0) {
      return ErrnoStatus(errno, absl::StrFormat("stat %s", Path(name)));
    }
    if (::fstatat(fd(), name.c_str(), &file_now, AT_SYMLINK_NOFOLLOW) != 0 ||
        file_held.st_dev != file_now.st_dev || file_held.st_ino != file_now.st_ino) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "disk://%s: %s was deleted or replaced while this publisher held it; its lock no "
          "longer keeps other publishers out: open a new publisher",
          root_, Path(name)));
    }
  }
  return absl::OkStatus();
}

}  // namespace weightbus::internal::disk

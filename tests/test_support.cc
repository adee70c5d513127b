// SPDX-License-Identifier: Apache-2.0
#include "test_support.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "weightbus/weightbus.hpp"
#include "xxhash.h"

namespace weightbus::testing {

ScratchDir::ScratchDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl = absl::StrCat(tmp && *tmp ? tmp : "/tmp", "/weightbus-test-XXXXXX");
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = buf.data();
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string DiskVersionDir(const ScratchDir& dir, uint64_t version) {
  return absl::StrFormat("%s/channel/versions/v%020d", dir.path(), version);
}

std::string MissingTransports(const std::vector<std::string>& schemes) {
  const std::vector<std::string> built = Transports();
  std::vector<std::string> missing, options;
  for (const std::string& scheme : schemes) {
    if (std::find(built.begin(), built.end(), scheme) != built.end()) continue;
    missing.push_back(scheme);
    options.push_back(absl::StrCat("WEIGHTBUS_WITH_", absl::AsciiStrToUpper(scheme)));
  }
  if (missing.empty()) return "";
  return absl::StrCat("this build has no ", absl::StrJoin(missing, ", "),
                      " (left out at configure time: ", absl::StrJoin(options, ", "), ")");
}

PausePoint::PausePoint(std::string point, int pass) : point_(std::move(point)), pass_(pass) {}

PausePoint::~PausePoint() { Release(); }

std::string PausePoint::Spec() const {
  return absl::StrFormat("%s=pause:%s@%d", point_, dir_.path(), pass_);
}

bool PausePoint::WaitReached(absl::Duration timeout) {
  return WaitUntil([&] { return Reached(); }, timeout);
}

bool PausePoint::Reached() const { return std::filesystem::exists(dir_ / (point_ + ".reached")); }

pid_t PausePoint::ReachedBy() const {
  if (!Reached()) return -1;
  int pid = -1;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFileOrDie(dir_ / (point_ + ".reached"))),
                          &pid)
             ? pid
             : -1;
}

void PausePoint::Release() {
  const std::string release = dir_ / (point_ + ".release");
  if (!std::filesystem::exists(release)) WriteFileOrDie(release, "");
}

std::string FixturePath(const std::string& rel) {
  return absl::StrCat(WEIGHTBUS_FIXTURES_DIR, "/", rel);
}

std::string BinaryPath(const std::string& rel) {
  return absl::StrCat(WEIGHTBUS_BINARY_DIR, "/", rel);
}

std::vector<std::string> PathLikeTensorNames() {
  const std::string tag = absl::StrFormat("wb-escape-%d", ::getpid());
  std::vector<std::string> names = {
      "../../etc/passwd",
      "../../../../../../" + tag + "-1",
      "/etc/passwd",
      "/tmp/" + tag + "-2",
      "model/../../" + tag + "-3",
      "./" + tag + "-4",
      ".",
      "..",
      "LATEST",
      "versions",
      "model.safetensors",
      "weightbus.manifest.json",
      std::string("nul\0/../") + tag + "-5",
  };
  std::string long_name;
  const char* pieces[] = {"a", "\xc3\xa9", "\xe8\xaa\x9e", "\xf0\x9f\x98\x80"};  // 1-4 bytes
  for (int i = 0; i < 300; ++i) long_name += pieces[i % 4];
  names.push_back(long_name);
  return names;
}

std::vector<std::string> ListTree(const std::string& root) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(root, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    out.push_back(std::filesystem::relative(it->path(), root).string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::vector<std::byte> out(n);
  uint64_t x = seed;
  for (size_t i = 0; i < n; i += 8) {
    x += 0x9e3779b97f4a7c15ULL;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    std::memcpy(out.data() + i, &z, std::min<size_t>(8, n - i));
  }
  return out;
}

uint64_t Xxh3(const void* data, size_t n) { return XXH3_64bits(data, n); }

char ProcessState(pid_t pid) {
  // read(2), not an ifstream: the thread may exit between open and read (ESRCH), and
  // libstdc++'s filebuf throws std::ios_base::failure on a read error through
  // istreambuf_iterator (it once ended InFlight's constructor in std::terminate).
  const int fd = ::open(absl::StrFormat("/proc/%d/stat", pid).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return '?';
  char buf[1024];
  const ssize_t n = ::read(fd, buf, sizeof(buf));
  ::close(fd);
  if (n <= 0) return '?';
  const std::string text(buf, static_cast<size_t>(n));
  const size_t paren = text.rfind(')');  // the command name may contain spaces and parentheses
  return paren != std::string::npos && paren + 2 < text.size() ? text[paren + 2] : '?';
}

bool WaitUntil(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

std::string ReadFileOrDie(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFileOrDie(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << contents;
}

}  // namespace weightbus::testing

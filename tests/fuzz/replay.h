// SPDX-License-Identifier: Apache-2.0
// What the fuzz replay drivers share: running one input through LLVMFuzzerTestOneInput with a
// crash handler that names the input and saves it to a file, so a crash in CTest is
// reproducible with the libFuzzer binary.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace weightbus::fuzz {

// What is running, for the crash handler (which may only use async-signal-safe calls).
struct ReplayState {
  const char* tool = "";        // e.g. "delta_fuzz_replay"
  const char* crash_file = "";  // where a crashing input is saved, in the working directory
  const char* data = nullptr;
  size_t size = 0;
  char name[512] = "";
};
inline ReplayState g_replay;

inline void OnReplayCrash(int sig) {
  const ReplayState& r = g_replay;
  (void)!::write(2, "\n", 1);
  (void)!::write(2, r.tool, ::strlen(r.tool));
  const char prefix[] = ": crashed on input: ";
  (void)!::write(2, prefix, sizeof(prefix) - 1);
  (void)!::write(2, r.name, ::strlen(r.name));
  const int fd = ::open(r.crash_file, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    if (r.data != nullptr) (void)!::write(fd, r.data, r.size);
    ::close(fd);
    const char saved[] = "\n(saved as ./";
    (void)!::write(2, saved, sizeof(saved) - 1);
    (void)!::write(2, r.crash_file, ::strlen(r.crash_file));
    (void)!::write(2, ")\n", 2);
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// Installs the crash handler for SIGSEGV, SIGABRT, SIGBUS, SIGFPE and SIGILL.
inline void InstallReplayCrashHandler(const char* tool, const char* crash_file) {
  g_replay.tool = tool;
  g_replay.crash_file = crash_file;
  for (int sig : {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL}) ::signal(sig, OnReplayCrash);
}

// Runs one input, named for the crash handler.
inline void ReplayOne(const std::string& name, const std::string& bytes) {
  g_replay.data = bytes.data();
  g_replay.size = bytes.size();
  std::snprintf(g_replay.name, sizeof(g_replay.name), "%s", name.c_str());
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

// The mutations' random numbers: splitmix64 of a fixed seed, so every run replays the same inputs.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  size_t Below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(Next() % n); }

 private:
  uint64_t state_;
};

// One input: a name for messages and its bytes.
using Input = std::pair<std::string, std::string>;

// Appends the inputs of `path` to `out`: the file, or the regular files directly inside the
// directory in name order. A missing path adds nothing when `optional` (a target's
// tests/fuzz/regressions/<target>/, absent while it has no findings) and is an error otherwise.
// Returns false, with a message naming `tool` and the path on stderr, on an error.
inline bool ReadInputs(const std::string& path, bool optional, const char* tool,
                       std::vector<Input>* out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    if (optional) return true;
    std::fprintf(stderr, "%s: %s does not exist\n", tool, path.c_str());
    return false;
  }
  std::vector<fs::path> files;
  if (fs::is_directory(path, ec)) {
    for (const auto& entry : fs::directory_iterator(path)) {
      if (entry.is_regular_file()) files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "%s: cannot read %s\n", tool, file.c_str());
      return false;
    }
    std::ostringstream ss;
    ss << in.rdbuf();
    out->emplace_back(file.string(), ss.str());
  }
  return true;
}

}  // namespace weightbus::fuzz

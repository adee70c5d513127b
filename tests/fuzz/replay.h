// SPDX-License-Identifier: Apache-2.0
// What the fuzz replay drivers share: running one input through LLVMFuzzerTestOneInput with a
// crash handler that names the input and saves it to a file, so a crash in CTest is
// reproducible with the libFuzzer binary.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

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

}  // namespace weightbus::fuzz

// SPDX-License-Identifier: Apache-2.0
// Internal pieces of the disk:// transport that the public API cannot reach: the transport-level
// Cancel() of the disk subscriber, and the io_uring engine under a forked child and with many
// small ranges. Real files, real threads, a real fork.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <sys/syscall.h>
#include <algorithm>
#include <atomic>
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/config.h"
#include "core/registry.h"
#include "core/uri.h"
#include "io/file_io.h"
#include "test_model.h"
#include "test_support.h"
#include "transport_stack.h"

namespace weightbus::internal {
namespace {

// The system call thread `tid` of this process is blocked in, from /proc (-1 when running).
long SyscallOf(pid_t tid) {
  std::ifstream in(absl::StrFormat("/proc/self/task/%d/syscall", tid));
  std::string first;
  in >> first;
  long nr = -1;
  if (!absl::SimpleAtoi(first, &nr)) return -1;
  return nr;
}

// A thread blocked in the disk subscriber's wait (poll(2) on inotify) returns Cancelled once
// Cancel() is called from another thread, long before its deadline; later calls are Cancelled
// at once.
TEST(DiskCancelTest, WaitInFlightReturnsCancelledAndSoDoLaterCalls) {
  testing::ScratchDir dir;
  auto sub =
      testing::OpenTransportSubscriber("disk://" + dir.path() + "/ch", {{"poll_interval", "1h"}});
  ASSERT_TRUE(sub.ok()) << sub.status();

  std::atomic<pid_t> tid{0};
  absl::StatusOr<std::unique_ptr<IncomingVersion>> got = absl::UnknownError("not run");
  const absl::Duration timeout = absl::Seconds(20);
  std::thread waiter([&] {
    tid = ::gettid();
    got = (*sub)->WaitForVersion(1, absl::Now() + timeout);
  });
  // Synchronise on the waiter being blocked in poll/ppoll (not on time).
  while (tid.load() == 0) std::this_thread::yield();
  auto in_poll = [&] {
    const long nr = SyscallOf(tid.load());
#ifdef SYS_poll
    if (nr == SYS_poll) return true;
#endif
    return nr == SYS_ppoll;
  };
  while (!in_poll()) std::this_thread::yield();
  const absl::Time cancelled_at = absl::Now();
  (*sub)->Cancel();
  waiter.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kCancelled) << got.status();
  EXPECT_NE(got.status().message().find("cancelled"), absl::string_view::npos) << got.status();
  EXPECT_LT(absl::Now() - cancelled_at, timeout) << "the wait ran to its deadline";

  auto again = (*sub)->WaitForVersion(0, absl::Now() + timeout);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kCancelled) << again.status();
  EXPECT_EQ((*sub)->OpenVersion(1, absl::Now() + timeout).status().code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ((*sub)->ListVersions().status().code(), absl::StatusCode::kCancelled);
  (*sub)->Cancel();  // more than once is fine
}

std::string ReadAll(int fd, size_t n) {
  std::string out(n, '\0');
  EXPECT_EQ(::pread(fd, out.data(), n, 0), static_cast<ssize_t>(n));
  return out;
}

// Writes `count` ranges of `size` bytes, contiguous from offset 0 of `fd`, filled with `fill`.
absl::Status WriteRanges(FileIo& io, int fd, size_t count, size_t size, char fill,
                         std::vector<std::byte>& storage) {
  storage.assign(count * size, std::byte(fill));
  std::vector<IoRequest> requests;
  for (size_t i = 0; i < count; ++i) {
    requests.push_back(IoRequest{fd, i * size, storage.data() + i * size, size});
  }
  return io.Write(
      requests, absl::Now() + absl::Seconds(30), [](size_t) {},
      [](size_t i) { return absl::StrFormat("range %d", i); });
}

// Issue 10, item 2: a forked child that uses the parent's ring moves the submission queue's
// shared head past the parent's tail, so io_uring_get_sqe returns NULL in the parent, which
// used to dereference it (SIGSEGV). Now the parent's next call works on a fresh ring.
TEST(UringForkTest, ParentKeepsWorkingAfterAForkedChildUsedTheRing) {
  auto io = FileIo::Create("uring", 4, 4096);
  ASSERT_TRUE(io.ok()) << io.status();
  if ((*io)->name() != "uring") GTEST_SKIP() << "io_uring is not available here";
  testing::ScratchDir dir;
  const std::string path = dir / "f";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  std::vector<std::byte> storage;
  ASSERT_TRUE(WriteRanges(**io, fd, 8, 4096, 'a', storage).ok());  // the ring is in use

  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child submits several operations through the inherited ring (one chunk each: they
    // are 4096 bytes, the chunk size, so none is batched).
    std::vector<std::byte> mine;
    absl::Status s = WriteRanges(**io, fd, 8, 4096, 'c', mine);
    ::_exit(s.ok() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "child status " << status;

  absl::Status s = WriteRanges(**io, fd, 8, 4096, 'p', storage);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(ReadAll(fd, 8 * 4096), std::string(8 * 4096, 'p'));
  // Reads work too.
  std::string back(4096, '\0');
  std::vector<IoRequest> read{IoRequest{fd, 4096, reinterpret_cast<std::byte*>(back.data()), 4096}};
  ASSERT_TRUE((*io)
                  ->Read(
                      read, absl::Now() + absl::Seconds(30), [](size_t) {},
                      [](size_t) { return std::string("read"); })
                  .ok());
  EXPECT_EQ(back, std::string(4096, 'p'));
  ::close(fd);
}

// The same fault in the middle of a call: a child forked while the parent's Write is under way
// (from its completion callback, with nothing of the parent's in flight) submits through the
// shared ring, so the parent's next io_uring_get_sqe returns NULL even after submitting. That
// is an Internal error naming the range, not a dereference; the child's completions are not
// taken for the parent's (tags carry the pid); the next call works on a fresh ring.
TEST(UringForkTest, NullSubmissionEntryInTheMiddleOfACallIsAnError) {
  auto io = FileIo::Create("uring", 1, 4096);
  ASSERT_TRUE(io.ok()) << io.status();
  if ((*io)->name() != "uring") GTEST_SKIP() << "io_uring is not available here";
  testing::ScratchDir dir;
  int fd = ::open((dir / "parent").c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  int child_fd = ::open((dir / "child").c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_GE(child_fd, 0);
  std::vector<std::byte> bytes(4096, std::byte{'p'});
  // Gaps between the ranges: three operations, one at a time (depth 1).
  std::vector<IoRequest> requests;
  for (uint64_t i = 0; i < 3; ++i) requests.push_back(IoRequest{fd, i * 8192, bytes.data(), 4096});
  int child_status = -1;
  auto on_complete = [&](size_t i) {
    if (i != 0 || child_status != -1) return;
    const pid_t child = ::fork();
    if (child == 0) {
      std::vector<std::byte> mine(4096, std::byte{'c'});
      std::vector<IoRequest> theirs;
      for (uint64_t k = 0; k < 3; ++k) {
        theirs.push_back(IoRequest{child_fd, k * 8192, mine.data(), 4096});
      }
      absl::Status s = (*io)->Write(
          theirs, absl::Now() + absl::Seconds(30), [](size_t) {},
          [](size_t) { return std::string("child"); });
      ::_exit(s.ok() ? 0 : 1);
    }
    ::waitpid(child, &child_status, 0);
  };
  absl::Status s = (*io)->Write(requests, absl::Now() + absl::Seconds(30), on_complete,
                                [](size_t i) { return absl::StrFormat("range %d", i); });
  ASSERT_TRUE(WIFEXITED(child_status) && WEXITSTATUS(child_status) == 0) << child_status;
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("range 1"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("no free entry"), absl::string_view::npos) << s;
  EXPECT_EQ(ReadAll(child_fd, 3 * 8192 - 4096).substr(16384, 4096), std::string(4096, 'c'));

  // The parent's next call works, on a fresh ring.
  std::vector<std::byte> storage;
  ASSERT_TRUE(WriteRanges(**io, fd, 6, 4096, 'q', storage).ok());
  EXPECT_EQ(ReadAll(fd, 6 * 4096), std::string(6 * 4096, 'q'));
  ::close(fd);
  ::close(child_fd);
}

// Issue 10, item 11: many small contiguous ranges are written and read in batches: operations
// and submissions follow the bytes (about bytes / chunk), not the number of ranges, on both
// engines, and every range is complete and bit-exact.
class SmallRangesTest : public ::testing::TestWithParam<const char*> {};

TEST_P(SmallRangesTest, AreBatchedSoOperationsFollowBytesNotCount) {
  constexpr uint64_t kChunk = 1 << 20;
  auto io = FileIo::Create(GetParam(), 8, kChunk);
  ASSERT_TRUE(io.ok()) << io.status();
  testing::ScratchDir dir;
  int fd = ::open((dir / "f").c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  // 3,000 ranges of 1..8 KiB (about 13 MiB), two large ones in between, one of them empty.
  std::vector<uint64_t> sizes;
  for (int i = 0; i < 3000; ++i) sizes.push_back(1024 * (1 + i % 8) + (i % 3));
  sizes.insert(sizes.begin() + 1000, 3 * kChunk + 17);
  sizes.insert(sizes.begin() + 2000, 0);
  uint64_t total = 0;
  for (uint64_t n : sizes) total += n;
  std::vector<std::byte> src = testing::RandomBytes(total, 42);
  std::vector<IoRequest> requests;
  uint64_t at = 0;
  for (uint64_t n : sizes) {
    requests.push_back(IoRequest{fd, at, src.data() + at, n});
    at += n;
  }
  std::vector<int> completed(requests.size(), 0);
  const FileIoCounters before = (*io)->counters();
  ASSERT_TRUE((*io)
                  ->Write(
                      requests, absl::Now() + absl::Seconds(60), [&](size_t i) { ++completed[i]; },
                      [](size_t i) { return absl::StrFormat("range %d", i); })
                  .ok());
  const FileIoCounters after = (*io)->counters();
  EXPECT_EQ(std::count(completed.begin(), completed.end(), 1),
            static_cast<ptrdiff_t>(requests.size()));
  const uint64_t bound = total / kChunk + 8;  // full chunks plus the ends of runs
  EXPECT_LE(after.operations - before.operations, bound)
      << "operations for " << sizes.size() << " ranges of " << total << " bytes";
  EXPECT_LE(after.submissions - before.submissions, bound);
  std::string file = ReadAll(fd, total);
  ASSERT_EQ(std::memcmp(file.data(), src.data(), total), 0);

  // Read back into fresh memory the same way.
  std::vector<std::byte> dst(total);
  for (size_t i = 0; i < requests.size(); ++i)
    requests[i].buffer = dst.data() + requests[i].file_offset;
  std::fill(completed.begin(), completed.end(), 0);
  const FileIoCounters before_read = (*io)->counters();
  ASSERT_TRUE((*io)
                  ->Read(
                      requests, absl::Now() + absl::Seconds(60), [&](size_t i) { ++completed[i]; },
                      [](size_t i) { return absl::StrFormat("range %d", i); })
                  .ok());
  EXPECT_LE((*io)->counters().operations - before_read.operations, bound);
  EXPECT_EQ(std::count(completed.begin(), completed.end(), 1),
            static_cast<ptrdiff_t>(requests.size()));
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), total), 0);

  // A truncated file is still DataLoss naming the range that is short.
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(total - 5000)), 0);
  absl::Status s = (*io)->Read(
      requests, absl::Now() + absl::Seconds(60), [](size_t) {},
      [](size_t i) { return absl::StrFormat("range %d", i); });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("truncated"), absl::string_view::npos) << s;
  ::close(fd);
}

INSTANTIATE_TEST_SUITE_P(Engines, SmallRangesTest, ::testing::Values("uring", "psync"));

// KeepVersionsFrom keeps a floor of versions beyond the retention setting (a delta chain needs
// its keyframe and every delta after it); a later call replaces the floor. Retention runs in the
// background; destroying the publisher finishes the pass due before it returns, so what is
// listed afterwards is what retention left.
TEST(DiskKeepVersionsFromTest, KeepsAFloorBeyondRetentionUntilItMoves) {
  testing::ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/ch?retention=1";
  auto sub = testing::OpenTransportSubscriber(uri);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto listed = [&] {
    auto l = (*sub)->ListVersions();
    EXPECT_TRUE(l.ok()) << l.status();
    return l.ok() ? *l : std::vector<uint64_t>{};
  };
  auto publish_all = [&](std::optional<uint64_t> floor, std::vector<uint64_t> versions) {
    auto pub = testing::OpenTransportPublisher(uri);
    ASSERT_TRUE(pub.ok()) << pub.status();
    if (floor) (*pub)->KeepVersionsFrom(*floor);
    for (uint64_t v : versions) {
      auto tensors = testing::MakeVersion(1, v, 4096);
      ASSERT_TRUE(testing::PublishSealed(**pub, testing::ManifestOf(v, tensors), tensors).ok());
    }
  };
  publish_all(1, {1, 2, 3});  // retention=1 would otherwise drop 1 and 2
  EXPECT_EQ(listed(), (std::vector<uint64_t>{1, 2, 3}));
  publish_all(3, {4});
  EXPECT_EQ(listed(), (std::vector<uint64_t>{3, 4}));
  publish_all(std::nullopt, {5});
  EXPECT_EQ(listed(), (std::vector<uint64_t>{5}));
}

}  // namespace
}  // namespace weightbus::internal

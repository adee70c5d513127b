// SPDX-License-Identifier: Apache-2.0
// The I/O engines (io/file_io.h), io_uring and psync: many ranges at depth, truncation and bad
// descriptors as errors naming the range, bad parameters.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "io/file_io.h"
#include "test_support.h"

namespace weightbus::internal {
namespace {

class FileIoTest : public ::testing::TestWithParam<std::string> {};

TEST_P(FileIoTest, WritesAndReadsManyRangesAtDepth) {
  testing::ScratchDir dir;
  const std::string path = dir / "data";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  auto io = FileIo::Create(GetParam(), 8, 4096);
  ASSERT_TRUE(io.ok()) << io.status();
  // Ranges of odd sizes, some larger than a chunk, one empty, written out of order.
  std::vector<std::vector<std::byte>> data;
  std::vector<IoRequest> reqs;
  uint64_t offset = 0;
  for (size_t i = 0; i < 40; ++i) {
    const size_t n = (i == 7) ? 0 : 1 + (i * 7919) % 50000;
    data.push_back(testing::RandomBytes(n, i));
    reqs.push_back(IoRequest{fd, offset, data.back().data(), n});
    offset += n;
  }
  std::reverse(reqs.begin(), reqs.end());
  std::vector<int> done(reqs.size(), 0);
  auto describe = [](size_t i) { return "range " + std::to_string(i); };
  ASSERT_TRUE((*io)
                  ->Write(
                      reqs, absl::Now() + absl::Seconds(30), [&](size_t i) { ++done[i]; }, describe)
                  .ok());
  EXPECT_EQ(done, std::vector<int>(reqs.size(), 1));
  ASSERT_TRUE((*io)->Fsync(fd, absl::Now() + absl::Seconds(30), path).ok());
  std::vector<std::vector<std::byte>> back;
  std::vector<IoRequest> reads = reqs;
  for (IoRequest& r : reads) {
    back.emplace_back(r.length);
    r.buffer = back.back().data();
  }
  ASSERT_TRUE((*io)
                  ->Read(
                      reads, absl::Now() + absl::Seconds(30), [](size_t) {}, describe)
                  .ok());
  for (size_t i = 0; i < reqs.size(); ++i) {
    // An empty range's buffer may be null, which memcmp may not be given even for 0 bytes.
    if (reqs[i].length == 0) continue;
    ASSERT_EQ(std::memcmp(back[i].data(), reqs[i].buffer, reqs[i].length), 0) << i;
  }
  // Reading past the end of the file is DataLoss naming the range.
  std::vector<std::byte> over(100);
  IoRequest past{fd, offset - 50, over.data(), 100};
  absl::Status s = (*io)->Read(
      {past}, absl::Now() + absl::Seconds(30), [](size_t) {}, describe);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("range 0 is truncated"), absl::string_view::npos) << s;
  // A bad descriptor is an errno error naming the range.
  IoRequest bad{-1, 0, over.data(), 100};
  s = (*io)->Read(
      {bad}, absl::Now() + absl::Seconds(30), [](size_t) {}, describe);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("range 0"), absl::string_view::npos) << s;
  ::close(fd);
}

INSTANTIATE_TEST_SUITE_P(Engines, FileIoTest, ::testing::Values("uring", "psync"));

TEST(FileIoTest, RejectsBadParameters) {
  EXPECT_EQ(FileIo::Create("aio", 8, 4096).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FileIo::Create("uring", 0, 4096).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FileIo::Create("uring", 8, 100).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace weightbus::internal

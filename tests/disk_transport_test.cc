// SPDX-License-Identifier: Apache-2.0
// What is particular to the disk:// transport, through the public API: the channel as a Hugging
// Face checkpoint directory, shards, one publisher per channel, retention and pinned readers,
// corrupted files, symlinks and FIFOs planted in the channel, a restarted publisher's retry.
// The contract every transport keeps (round trips, bindings, Poll/Wait, timeouts, restarts) is
// tests/conformance_test.cc. Real files in a scratch directory.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "expect_tensors.h"
#include "test_model.h"
#include "test_support.h"
#include "weightbus/safetensors.hpp"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::weightbus::testing::MakeVersion;
using ::weightbus::testing::OwnedTensor;
using ::weightbus::testing::ScratchDir;
using ::weightbus::testing::Views;
using ::weightbus::testing::Xxh3;

constexpr absl::Duration kTimeout = absl::Seconds(30);

std::string Uri(const ScratchDir& dir, const std::string& query = "") {
  return "disk://" + dir.path() + "/channel" + (query.empty() ? "" : "?" + query);
}

using ::weightbus::testing::ExpectSameTensors;

TEST(DiskTransportTest, VersionDirectoryIsAHuggingFaceCheckpoint) {
  ScratchDir dir;
  auto tensors = MakeVersion(3, 1, 4096);
  auto pub = Publisher::Open(Uri(dir));
  ASSERT_TRUE(pub.ok());
  ASSERT_TRUE((*pub)->Publish(1, Views(tensors), {}, kTimeout).ok());
  // Any safetensors reader sees the tensors; the metadata marks the PyTorch format.
  auto file = safetensors::ReadFile(testing::DiskVersionDir(dir, 1) + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->header.metadata.at("format"), "pt");
  ASSERT_EQ(file->header.tensors.size(), tensors.size());
  for (const OwnedTensor& t : tensors) {
    const safetensors::Entry* e = file->header.Find(t.name);
    ASSERT_NE(e, nullptr) << t.name;
    std::span<const std::byte> b = file->Bytes(*e);
    EXPECT_EQ(Xxh3(b.data(), b.size()), Xxh3(t.bytes.data(), t.bytes.size())) << t.name;
    EXPECT_EQ(file->header.data_start % 8, 0u);
    EXPECT_EQ(e->begin % DTypeSize(e->dtype), 0u) << "misaligned " << t.name;
  }
  EXPECT_EQ(testing::ReadFileOrDie(dir.path() + "/channel/LATEST"), "1\n");
  EXPECT_TRUE(
      std::filesystem::exists(testing::DiskVersionDir(dir, 1) + "/weightbus.manifest.json"));
}

// Every directory and file a publisher creates in a channel has exactly the channel's mode (stat
// of the whole tree, lstat: nothing is a link), whatever the umask: owner-only by default,
// group-readable with group_access=true. A channel directory that exists keeps its own mode. A
// subscriber of the same user receives every version either way.
TEST(DiskModesTest, ChannelIsOwnerOnlyByDefaultAndGroupReadableWithGroupAccess) {
  struct Case {
    std::string query;
    mode_t umask;
    mode_t dir, file;
  };
  for (const Case& c : {Case{"", 0, 0700, 0600}, Case{"group_access=true", 077, 0750, 0640},
                        Case{"group_access=true", 0, 0750, 0640}}) {
    SCOPED_TRACE(absl::StrFormat("%s umask %03o", c.query, c.umask));
    ScratchDir dir;
    const mode_t old_umask = ::umask(c.umask);
    const std::string query = c.query.empty() ? "shard_size=5000" : c.query + "&shard_size=5000";
    {
      auto pub = Publisher::Open(Uri(dir, query));
      ASSERT_TRUE(pub.ok()) << pub.status();
      auto sub = Subscriber::Open(Uri(dir));
      ASSERT_TRUE(sub.ok()) << sub.status();
      for (uint64_t v = 1; v <= 2; ++v) {
        auto tensors = MakeVersion(5, v, 16384);  // several shards: an index file too
        ASSERT_TRUE((*pub)->Publish(v, Views(tensors), {}, kTimeout).ok());
        auto u = (*sub)->WaitForVersion(v, kTimeout);
        ASSERT_TRUE(u.ok()) << u.status();
        ExpectSameTensors(**u, tensors);
      }
    }
    ::umask(old_umask);
    const std::string root = dir.path() + "/channel";
    ASSERT_TRUE(
        std::filesystem::exists(testing::DiskVersionDir(dir, 2) + "/model.safetensors.index.json"));
    size_t dirs = 0, files = 0;
    auto expect_mode = [&](const std::string& path) {
      struct stat st;
      ASSERT_EQ(::lstat(path.c_str(), &st), 0) << path;
      ASSERT_TRUE(S_ISDIR(st.st_mode) || S_ISREG(st.st_mode)) << path;
      EXPECT_EQ(st.st_mode & 07777, S_ISDIR(st.st_mode) ? c.dir : c.file)
          << absl::StrFormat("%s is %03o", path, st.st_mode & 07777);
      ++(S_ISDIR(st.st_mode) ? dirs : files);
    };
    expect_mode(root);
    for (const auto& e : std::filesystem::recursive_directory_iterator(root)) {
      expect_mode(e.path().string());
    }
    // root, versions, 2 versions; LATEST, publisher.lock, per version manifest, index, reader
    // lock and at least two shards.
    EXPECT_EQ(dirs, 4u);
    EXPECT_GE(files, 2u + 2 * 5);
  }

  // An existing channel directory keeps the mode its user gave it.
  ScratchDir dir;
  const std::string root = dir.path() + "/channel";
  ASSERT_EQ(::mkdir(root.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(root.c_str(), 0755), 0);
  auto pub = Publisher::Open(Uri(dir));
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto tensors = MakeVersion(5, 1, 1024);
  ASSERT_TRUE((*pub)->Publish(1, Views(tensors), {}, kTimeout).ok());
  struct stat st;
  ASSERT_EQ(::stat(root.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0755u);
  ASSERT_EQ(::stat((root + "/versions").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  ASSERT_EQ(::stat((testing::DiskVersionDir(dir, 1) + "/model.safetensors").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
}

// Tensor names reach the disk only inside files (the safetensors header, the manifest), never as
// paths: after a version of path-like names (testing::PathLikeTensorNames, the conformance suite
// round-trips them on every stack) the only new entries of the test's directory are the
// channel's own, no file named like the escaping names' last components exists where those
// paths would lead from any directory of the channel, /etc/passwd is untouched, and any
// safetensors reader finds every name in the file. Sharded, so several files and an index.
TEST(DiskNamesTest, PathLikeTensorNamesLiveInsideFilesAndCreateNothingOutsideTheChannel) {
  ScratchDir dir;
  const std::vector<std::string> names = testing::PathLikeTensorNames();
  struct stat passwd_before {};
  const bool have_passwd = ::stat("/etc/passwd", &passwd_before) == 0;
  const std::vector<std::string> before = testing::ListTree(dir.path());
  std::vector<std::vector<std::byte>> bytes;
  std::vector<TensorView> views;
  for (size_t i = 0; i < names.size(); ++i) bytes.push_back(testing::RandomBytes(4096, i));
  for (size_t i = 0; i < names.size(); ++i) {
    views.push_back(TensorView{names[i], DType::kU8, {4096}, {}, bytes[i].data()});
  }
  {
    auto pub = Publisher::Open(Uri(dir, "shard_size=10000"));
    ASSERT_TRUE(pub.ok()) << pub.status();
    ASSERT_TRUE((*pub)->Publish(1, views, {}, kTimeout).ok());
  }
  const std::vector<std::string> after = testing::ListTree(dir.path());
  std::vector<std::string> dirs = {dir.path()};
  for (const std::string& path : after) {
    if (std::find(before.begin(), before.end(), path) != before.end()) continue;
    EXPECT_TRUE(path == "channel" || absl::StartsWith(path, "channel/"))
        << absl::CHexEscape(path) << " appeared outside the channel";
    EXPECT_EQ(path.find("wb-escape"), std::string::npos) << absl::CHexEscape(path);
    if (std::filesystem::is_directory(dir / path)) dirs.push_back(dir / path);
  }
  // Where each name would lead, taken as a path from each directory of the channel (and the
  // scratch directory): nothing named like an escaping name's last component is there.
  for (const std::string& name : names) {
    const std::string plain = name.substr(0, name.find('\0'));
    if (plain.find("wb-escape") == std::string::npos) continue;
    for (const std::string& d : dirs) {
      const std::filesystem::path target = std::filesystem::path(d) / plain;
      EXPECT_FALSE(std::filesystem::exists(target.lexically_normal())) << target.lexically_normal();
    }
  }
  if (have_passwd) {
    struct stat passwd_after {};
    ASSERT_EQ(::stat("/etc/passwd", &passwd_after), 0);
    EXPECT_EQ(passwd_after.st_mtim.tv_sec, passwd_before.st_mtim.tv_sec);
    EXPECT_EQ(passwd_after.st_mtim.tv_nsec, passwd_before.st_mtim.tv_nsec);
    EXPECT_EQ(passwd_after.st_size, passwd_before.st_size);
  }
  // Inside the files: every name, byte for byte, in one of the version's safetensors files.
  std::map<std::string, std::vector<std::byte>> found;
  for (const auto& e : std::filesystem::directory_iterator(testing::DiskVersionDir(dir, 1))) {
    if (e.path().extension() != ".safetensors") continue;
    auto file = safetensors::ReadFile(e.path().string());
    ASSERT_TRUE(file.ok()) << file.status();
    for (const safetensors::Entry& t : file->header.tensors) {
      std::span<const std::byte> b = file->Bytes(t);
      found[t.name] = std::vector<std::byte>(b.begin(), b.end());
    }
  }
  ASSERT_EQ(found.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    ASSERT_EQ(found.count(names[i]), 1u) << absl::CHexEscape(names[i]);
    EXPECT_TRUE(found[names[i]] == bytes[i]) << absl::CHexEscape(names[i]);
  }
  // A channel path with ".." segments is refused before anything is created.
  auto escaping = Publisher::Open("disk://" + dir.path() + "/channel/../../escape");
  EXPECT_EQ(escaping.status().code(), absl::StatusCode::kInvalidArgument) << escaping.status();
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(dir.path()).parent_path() / "escape"));
}

TEST(DiskTransportTest, ShardsLargeVersionsIntoIndexedFiles) {
  ScratchDir dir;
  auto tensors = MakeVersion(5, 1, 1 << 20);
  auto pub = Publisher::Open(Uri(dir, "shard_size=64KiB"));
  ASSERT_TRUE(pub.ok()) << pub.status();
  ASSERT_TRUE((*pub)->Publish(1, Views(tensors), {}, kTimeout).ok());
  const std::string index = testing::DiskVersionDir(dir, 1) + "/model.safetensors.index.json";
  ASSERT_TRUE(std::filesystem::exists(index));
  EXPECT_FALSE(std::filesystem::exists(testing::DiskVersionDir(dir, 1) + "/model.safetensors"));
  int shards = 0;
  for (const auto& e : std::filesystem::directory_iterator(testing::DiskVersionDir(dir, 1))) {
    if (absl::StartsWith(e.path().filename().string(), "model-")) ++shards;
  }
  EXPECT_GE(shards, 2);
  EXPECT_TRUE(std::filesystem::exists(testing::DiskVersionDir(dir, 1) +
                                      absl::StrFormat("/model-00001-of-%05d.safetensors", shards)));
  std::string text = testing::ReadFileOrDie(index);
  EXPECT_NE(text.find("\"weight_map\""), std::string::npos);
  EXPECT_NE(text.find("\"total_size\""), std::string::npos);
  auto sub = Subscriber::Open(Uri(dir));
  ASSERT_TRUE(sub.ok());
  auto update = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(update.ok()) << update.status();
  ExpectSameTensors(**update, tensors);
}

TEST(DiskTransportTest, OneLivePublisherPerChannel) {
  ScratchDir dir;
  auto first = Publisher::Open(Uri(dir));
  ASSERT_TRUE(first.ok());
  auto second = Publisher::Open(Uri(dir));
  ASSERT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find(absl::StrFormat("pid %d", getpid())),
            absl::string_view::npos)
      << second.status();
  first->reset();
  EXPECT_TRUE(Publisher::Open(Uri(dir)).ok());
}

TEST(DiskTransportTest, InvalidTensorsAreRejectedByName) {
  ScratchDir dir;
  auto pub = Publisher::Open(Uri(dir));
  float x = 1;
  struct Case {
    TensorView view;
    absl::StatusCode code;
    std::string needle;
  };
  std::vector<Case> cases = {
      {{"", DType::kF32, {1}, {}, &x}, absl::StatusCode::kInvalidArgument, "empty name"},
      {{"bad\xff", DType::kF32, {1}, {}, &x}, absl::StatusCode::kInvalidArgument, "UTF-8"},
      {{"neg", DType::kF32, {-1}, {}, &x}, absl::StatusCode::kInvalidArgument, "negative"},
      {{"null", DType::kF32, {4}, {}, nullptr}, absl::StatusCode::kInvalidArgument, "null"},
      {{"strides", DType::kF32, {2, 2}, {1}, &x}, absl::StatusCode::kInvalidArgument, "strides"},
      {{"gpu", DType::kF32, {1}, {}, &x, Device{DeviceType::kCuda, 0}},
       absl::StatusCode::kUnimplemented,
       "CUDA"},
      {{"shard", DType::kF32, {1}, {}, &x, {}, Shard{{4}, {4}}},
       absl::StatusCode::kInvalidArgument,
       "global shape"},
  };
  for (const Case& c : cases) {
    absl::Status s = (*pub)->Publish(1, {c.view}, {}, kTimeout);
    if (c.view.device.type == DeviceType::kCuda && SupportsCudaTensors()) {
      // Host memory that says CUDA: a device this process cannot use (no GPU), or, with a GPU,
      // memory that is not the device's. A build without CUDA: Unimplemented (below).
      EXPECT_TRUE(s.code() == absl::StatusCode::kFailedPrecondition ||
                  s.code() == absl::StatusCode::kInvalidArgument)
          << s;
      EXPECT_NE(s.message().find(c.needle), absl::string_view::npos) << s;
      continue;
    }
    EXPECT_EQ(s.code(), c.code) << c.view.name << ": " << s;
    EXPECT_NE(s.message().find(c.needle), absl::string_view::npos) << s;
  }
  absl::Status dup = (*pub)->Publish(
      1, {TensorView{"a", DType::kF32, {1}, {}, &x}, TensorView{"a", DType::kF32, {1}, {}, &x}}, {},
      kTimeout);
  EXPECT_EQ(dup.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dup.message().find("\"a\" appears twice"), absl::string_view::npos);
  // Nothing was committed by any of them.
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/channel/LATEST"));
  // A shard that fits is recorded in the manifest.
  TensorView sharded{"w", DType::kF32, {1}, {}, &x, {}, Shard{{4}, {2}}};
  ASSERT_TRUE((*pub)->Publish(1, {sharded}, {}, kTimeout).ok());
  auto sub = Subscriber::Open(Uri(dir));
  auto u = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok());
  ASSERT_TRUE((*u)->manifest().tensors[0].shard.has_value());
  EXPECT_EQ((*u)->manifest().tensors[0].shard->offsets, std::vector<int64_t>{2});
}

// More tensors than a version may hold (kMaxTensors) is refused before anything is written.
TEST(DiskTransportTest, MoreTensorsThanTheLimitIsInvalidArgument) {
  ScratchDir dir;
  auto pub = Publisher::Open(Uri(dir));
  ASSERT_TRUE(pub.ok()) << pub.status();
  std::vector<TensorView> views(kMaxTensors + 1, TensorView{"t", DType::kU8, {0}});
  const absl::Status s = (*pub)->Publish(1, views, {}, kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(std::string(s.message()),
            absl::StrFormat("disk://%s/channel version 1 has 1048577 tensors, more than the limit "
                            "of 1048576",
                            dir.path()));
  EXPECT_EQ(testing::ListTree(dir.path() + "/channel/versions"), std::vector<std::string>{});
}

TEST(DiskTransportTest, WaitTimesOutNamingWhatItWaitedFor) {
  ScratchDir dir;
  auto sub = Subscriber::Open(Uri(dir));
  ASSERT_TRUE(sub.ok());
  const absl::Time start = absl::Now();
  auto update = (*sub)->WaitForVersion(1, absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  ASSERT_EQ(update.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(update.status().message().find("no version >= 1"), absl::string_view::npos);
  EXPECT_NE(update.status().message().find("newest committed: none"), absl::string_view::npos);
  EXPECT_NE(update.status().message().find("the channel directory does not exist"),
            absl::string_view::npos)
      << update.status();
  EXPECT_GE(took, absl::Milliseconds(300));
  EXPECT_LT(took, absl::Seconds(10));  // bounded: never hangs

  auto pub = Publisher::Open(Uri(dir));
  auto tensors = MakeVersion(1, 1, 4096);
  ASSERT_TRUE((*pub)->Publish(1, Views(tensors), {}, kTimeout).ok());
  ASSERT_TRUE((*sub)->WaitForVersion(1, kTimeout).ok());
  update = (*sub)->WaitForVersion(2, absl::Milliseconds(100));
  ASSERT_EQ(update.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(update.status().message().find("newest committed: 1"), absl::string_view::npos);
  EXPECT_EQ(update.status().message().find("does not exist"), absl::string_view::npos);
}

TEST(DiskTransportTest, NeverHandsOverALowerVersionAfterAHigherOne) {
  ScratchDir dir;
  auto pub = Publisher::Open(Uri(dir, "retention=10"));
  for (uint64_t v = 1; v <= 3; ++v) {
    auto tensors = MakeVersion(1, v, 4096);
    ASSERT_TRUE((*pub)->Publish(v, Views(tensors), {}, kTimeout).ok());
  }
  auto sub = Subscriber::Open(Uri(dir));
  auto u = (*sub)->WaitForVersion(0, kTimeout);
  ASSERT_TRUE(u.ok());
  EXPECT_EQ((*u)->version(), 3u);
  // The pointer goes back (an operator restoring an old LATEST): the subscriber refuses.
  testing::WriteFileOrDie(dir.path() + "/channel/LATEST", "2\n");
  auto again = (*sub)->WaitForVersion(0, absl::Milliseconds(200));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kDeadlineExceeded) << again.status();
  EXPECT_EQ((*sub)->current_version(), std::optional<uint64_t>(3));
}

TEST(DiskTransportTest, RetentionKeepsNewestVersionsAndThoseBeingRead) {
  ScratchDir dir;
  auto pub = Publisher::Open(Uri(dir, "retention=2"));
  ASSERT_TRUE(pub.ok());
  auto publish = [&](uint64_t v) {
    auto tensors = MakeVersion(1, v, 4096);
    ASSERT_TRUE((*pub)->Publish(v, Views(tensors), {}, kTimeout).ok());
  };
  publish(1);
  // A reader pins version 1 exactly as subscribers do: a shared flock on .readers.lock.
  int pin = ::open((testing::DiskVersionDir(dir, 1) + "/.readers.lock").c_str(), O_RDONLY);
  ASSERT_GE(pin, 0);
  ASSERT_EQ(::flock(pin, LOCK_SH), 0);
  for (uint64_t v = 2; v <= 5; ++v) publish(v);
  auto gone = [&](std::vector<uint64_t> versions) {
    return testing::WaitUntil([&] {
      for (uint64_t v : versions) {
        if (std::filesystem::exists(testing::DiskVersionDir(dir, v))) return false;
      }
      return true;
    });
  };
  // Retention runs in the background: wait for it to delete 2 and 3, then check it spared 1.
  ASSERT_TRUE(gone({2, 3}));
  EXPECT_TRUE(std::filesystem::exists(testing::DiskVersionDir(dir, 1)))
      << "pinned version was deleted";
  EXPECT_TRUE(std::filesystem::exists(testing::DiskVersionDir(dir, 4)));
  EXPECT_TRUE(std::filesystem::exists(testing::DiskVersionDir(dir, 5)));
  ::close(pin);
  publish(6);
  EXPECT_TRUE(gone({1, 4}));
  EXPECT_TRUE(std::filesystem::exists(testing::DiskVersionDir(dir, 5)));
  // No temporary or trash directories are left behind.
  EXPECT_TRUE(testing::WaitUntil([&] {
    for (const auto& e : std::filesystem::directory_iterator(dir.path() + "/channel/versions")) {
      if (e.path().filename().string()[0] != 'v') return false;
    }
    return true;
  }));
}

// A reader held between pinning version 1 and reading it (a pause at disk.before_read) while
// the publisher moves on with retention=1: the retention pass after the new versions leaves
// version 1 alone, and the reader then receives it bit-exact.
TEST(DiskTransportTest, SlowReaderKeepsItsVersionWhilePublisherMovesOn) {
  ScratchDir dir;
  auto first = MakeVersion(9, 1, 1 << 18);
  {
    auto pub = Publisher::Open(Uri(dir, "retention=1"));
    ASSERT_TRUE(pub.ok()) << pub.status();
    ASSERT_TRUE((*pub)->Publish(1, Views(first), {}, kTimeout).ok());
  }
  testing::PausePoint read("disk.before_read");
  auto sub = [&] {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", read.Spec());
    return Subscriber::Open(Uri(dir));
  }();
  ASSERT_TRUE(sub.ok()) << sub.status();
  absl::StatusOr<std::unique_ptr<Update>> got;
  std::thread reader([&] { got = (*sub)->WaitForVersion(1, kTimeout); });
  ASSERT_TRUE(read.WaitReached(kTimeout));  // version 1 is pinned
  // This publisher's first retention pass comes after version 2 (and maybe 3 and 4); it only
  // announces itself.
  testing::PausePoint retained("disk.after_retention");
  retained.Release();
  auto pub = [&] {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", retained.Spec());
    return Publisher::Open(Uri(dir, "retention=1"));
  }();
  ASSERT_TRUE(pub.ok()) << pub.status();
  for (uint64_t v = 2; v <= 4; ++v) {
    auto tensors = MakeVersion(9, v, 1 << 18);
    ASSERT_TRUE((*pub)->Publish(v, Views(tensors), {}, kTimeout).ok());
  }
  ASSERT_TRUE(retained.WaitReached(kTimeout));
  EXPECT_TRUE(std::filesystem::exists(testing::DiskVersionDir(dir, 1)))
      << "the pinned version was deleted";
  read.Release();
  reader.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)->version(), 1u);
  ExpectSameTensors(**got, first);
}

// A restarted trainer retrying its last publish with the same bytes succeeds (conformance_test)
// without rewriting the committed version: its directory is the same one.
TEST(DiskTransportTest, ARetryByANewPublisherLeavesTheVersionDirectoryAlone) {
  ScratchDir dir;
  auto v7 = MakeVersion(9, 7, 1 << 16);
  {
    auto pub = Publisher::Open(Uri(dir));
    ASSERT_TRUE(pub.ok()) << pub.status();
    ASSERT_TRUE((*pub)->Publish(7, Views(v7), {}, kTimeout).ok());
  }
  struct stat before {};
  ASSERT_EQ(stat(testing::DiskVersionDir(dir, 7).c_str(), &before), 0);
  auto pub = Publisher::Open(Uri(dir));
  ASSERT_TRUE(pub.ok()) << pub.status();
  const absl::Status retried = (*pub)->Publish(7, Views(v7), {}, kTimeout);
  EXPECT_TRUE(retried.ok()) << retried;
  EXPECT_TRUE((*pub)->last_stats().unchanged);
  struct stat after {};
  ASSERT_EQ(stat(testing::DiskVersionDir(dir, 7).c_str(), &after), 0);
  EXPECT_EQ(before.st_ino, after.st_ino) << "the version directory was rewritten";
}

// Corrupts the newest version in place and checks the subscriber refuses it and keeps the
// previous one, with its bound destinations untouched (bind_mode=staged).
class CorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pub_ = *Publisher::Open(Uri(dir_));
    v1_ = MakeVersion(4, 1, 1 << 18);
    v2_ = MakeVersion(4, 2, 1 << 18);
    ASSERT_TRUE(pub_->Publish(1, Views(v1_), {}, kTimeout).ok());
    sub_ = *Subscriber::Open(Uri(dir_));
    dest_.resize(v1_[0].bytes.size());
    ASSERT_TRUE(
        sub_->Bind(v1_[0].name, Destination{v1_[0].dtype, v1_[0].shape, {}, dest_.data()}).ok());
    auto u = sub_->WaitForVersion(1, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    held_ = *std::move(u);
    ASSERT_TRUE(pub_->Publish(2, Views(v2_), {}, kTimeout).ok());
    file_ = testing::DiskVersionDir(dir_, 2) + "/model.safetensors";
  }

  void ExpectPreviousVersionKept() {
    EXPECT_EQ(sub_->current_version(), std::optional<uint64_t>(1));
    EXPECT_EQ(std::memcmp(dest_.data(), v1_[0].bytes.data(), dest_.size()), 0);
    ExpectSameTensors(*held_, v1_);
  }

  ScratchDir dir_;
  std::unique_ptr<Publisher> pub_;
  std::unique_ptr<Subscriber> sub_;
  std::vector<OwnedTensor> v1_, v2_;
  std::vector<std::byte> dest_;
  std::unique_ptr<Update> held_;
  std::string file_;
};

TEST_F(CorruptionTest, TruncatedFileIsRefusedNamingFileAndTensor) {
  auto file = safetensors::ReadFile(file_);
  ASSERT_TRUE(file.ok());
  ASSERT_EQ(::truncate(file_.c_str(),
                       static_cast<off_t>(file->header.data_start + file->header.data_size - 1000)),
            0);
  auto update = sub_->WaitForVersion(2, absl::Seconds(5));
  ASSERT_EQ(update.status().code(), absl::StatusCode::kDataLoss) << update.status();
  const std::string msg(update.status().message());
  EXPECT_NE(msg.find(file_), std::string::npos) << msg;
  EXPECT_NE(msg.find("version 2"), std::string::npos) << msg;
  ExpectPreviousVersionKept();
}

TEST_F(CorruptionTest, FlippedBitIsCaughtByTheChecksum) {
  auto file = safetensors::ReadFile(file_);
  ASSERT_TRUE(file.ok());
  const safetensors::Entry* e = file->header.Find(v2_[0].name);
  ASSERT_NE(e, nullptr);
  const off_t at = static_cast<off_t>(file->header.data_start + e->begin + 12345);
  int fd = ::open(file_.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, at), 1);
  b ^= 0x10;
  ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
  ::close(fd);
  auto update = sub_->WaitForVersion(2, absl::Seconds(5));
  ASSERT_EQ(update.status().code(), absl::StatusCode::kDataLoss) << update.status();
  const std::string msg(update.status().message());
  EXPECT_NE(msg.find(v2_[0].name), std::string::npos) << msg;
  EXPECT_NE(msg.find(file_), std::string::npos) << msg;
  EXPECT_NE(msg.find("fails verification"), std::string::npos) << msg;
  ExpectPreviousVersionKept();
  // Repairing the file (a re-publish would do the same) lets the subscriber move on.
  fd = ::open(file_.c_str(), O_RDWR);
  b ^= 0x10;
  ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
  ::close(fd);
  auto repaired = sub_->WaitForVersion(2, absl::Seconds(5));
  ASSERT_TRUE(repaired.ok()) << repaired.status();
  EXPECT_EQ(std::memcmp(dest_.data(), v2_[0].bytes.data(), dest_.size()), 0);
}

TEST_F(CorruptionTest, CorruptManifestIsRefused) {
  const std::string path = testing::DiskVersionDir(dir_, 2) + "/weightbus.manifest.json";
  const std::string good = testing::ReadFileOrDie(path);
  for (const std::string& bad : {std::string("{\"format\": 1"), good + std::string("\0junk", 5),
                                 std::string("{\"format\":\"weightbus.manifest/1\"}")}) {
    testing::WriteFileOrDie(path, bad);
    auto update = sub_->WaitForVersion(2, absl::Seconds(5));
    ASSERT_EQ(update.status().code(), absl::StatusCode::kDataLoss) << update.status();
    EXPECT_NE(update.status().message().find("weightbus.manifest.json"), absl::string_view::npos)
        << update.status();
    ExpectPreviousVersionKept();
  }
  testing::WriteFileOrDie(path, good);
  EXPECT_TRUE(sub_->WaitForVersion(2, absl::Seconds(5)).ok());
}

TEST(DiskTransportTest, FailedPublishLeavesNothingVisible) {
  ScratchDir dir;
  auto good = MakeVersion(6, 1, 1 << 16);
  {
    auto pub = Publisher::Open(Uri(dir));
    ASSERT_TRUE((*pub)->Publish(1, Views(good), {}, kTimeout).ok());
  }
  for (const char* point : {"disk.after_file", "disk.before_rename", "disk.before_commit"}) {
    auto pub = [&] {
      testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", absl::StrFormat("%s=error", point));
      return Publisher::Open(Uri(dir));
    }();
    ASSERT_TRUE(pub.ok()) << pub.status();
    auto bad = MakeVersion(6, 2, 1 << 16);
    absl::Status s = (*pub)->Publish(2, Views(bad), {}, kTimeout);
    ASSERT_EQ(s.code(), absl::StatusCode::kInternal) << point << ": " << s;
    EXPECT_EQ(testing::ReadFileOrDie(dir.path() + "/channel/LATEST"), "1\n") << point;
    EXPECT_FALSE(std::filesystem::exists(testing::DiskVersionDir(dir, 2))) << point;
    auto sub = Subscriber::Open(Uri(dir));
    auto u = (*sub)->WaitForVersion(0, kTimeout);
    ASSERT_TRUE(u.ok());
    EXPECT_EQ((*u)->version(), 1u);
    ExpectSameTensors(**u, good);
  }
}

TEST(DiskTransportTest, PublishTimeoutIsEnforced) {
  ScratchDir dir;
  auto pub = [&] {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", "disk.after_file=delay:400");
    return Publisher::Open(Uri(dir));
  }();
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto tensors = MakeVersion(1, 1, 4096);
  absl::Status s = (*pub)->Publish(1, Views(tensors), {}, absl::Milliseconds(100));
  ASSERT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/channel/LATEST"));
}

TEST(DiskTransportTest, UnknownSettingsAndBadUrisAreClearErrors) {
  ScratchDir dir;
  auto typo = Publisher::Open(Uri(dir, "retenton=3"));
  ASSERT_EQ(typo.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(typo.status().message().find("unknown setting \"retenton\""), absl::string_view::npos);
  EXPECT_NE(typo.status().message().find("retention"), absl::string_view::npos);
  auto malformed = Subscriber::Open(Uri(dir), {{"poll_interval", "soon"}});
  ASSERT_EQ(malformed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(malformed.status().message().find("poll_interval=\"soon\""), absl::string_view::npos);
  auto scheme = Publisher::Open("nfs:///x");
  ASSERT_EQ(scheme.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(scheme.status().message().find("disk"), absl::string_view::npos);
  EXPECT_EQ(Publisher::Open("disk://host/x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Publisher::Open("/just/a/path").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DiskTransportTest, PsyncEngineRoundTrips) {
  ScratchDir dir;
  auto tensors = MakeVersion(8, 1, 1 << 18);
  auto pub = Publisher::Open(Uri(dir, "io_engine=psync&chunk_size=64KiB"));
  ASSERT_TRUE(pub.ok()) << pub.status();
  ASSERT_TRUE((*pub)->Publish(1, Views(tensors), {}, kTimeout).ok());
  auto sub = Subscriber::Open(Uri(dir, "io_engine=psync"));
  auto u = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ExpectSameTensors(**u, tensors);
}

}  // namespace
}  // namespace weightbus

namespace weightbus {
namespace {

// Regressions found by review: each of these once hung, crashed or lost a version.
class DiskRobustnessTest : public ::testing::Test {
 protected:
  void Publish(uint64_t v, const std::string& query = "") {
    auto pub = Publisher::Open(Uri(dir_, query));
    ASSERT_TRUE(pub.ok()) << pub.status();
    auto tensors = MakeVersion(1, v, 1 << 16);
    ASSERT_TRUE((*pub)->Publish(v, Views(tensors), {}, kTimeout).ok());
  }
  absl::Status Receive(uint64_t min_version, absl::Duration timeout = absl::Seconds(5)) {
    auto sub = Subscriber::Open(Uri(dir_));
    if (!sub.ok()) return sub.status();
    return (*sub)->WaitForVersion(min_version, timeout).status();
  }
  ScratchDir dir_;
};

TEST_F(DiskRobustnessTest, MissingPiecesOfTheCommittedVersionAreDataLossNotAHang) {
  Publish(1, "retention=10");
  Publish(2, "retention=10");
  const std::string v2 = testing::DiskVersionDir(dir_, 2);
  struct Case {
    std::string what;
    std::function<void()> damage;
    std::string needle;
  };
  std::vector<Case> cases = {
      {"LATEST names a version that does not exist",
       [&] { testing::WriteFileOrDie(dir_.path() + "/channel/LATEST", "7\n"); }, "version 7"},
      {"manifest deleted", [&] { std::filesystem::remove(v2 + "/weightbus.manifest.json"); },
       "weightbus.manifest.json"},
      {"data file deleted", [&] { std::filesystem::remove(v2 + "/model.safetensors"); },
       "model.safetensors"},
      {"version directory deleted", [&] { std::filesystem::remove_all(v2); }, "is missing"},
  };
  for (const Case& c : cases) {
    std::filesystem::remove_all(dir_.path() + "/channel");
    Publish(1, "retention=10");
    Publish(2, "retention=10");
    c.damage();
    const absl::Time start = absl::Now();
    absl::Status s = Receive(0);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << c.what << ": " << s;
    EXPECT_NE(s.message().find(c.needle), absl::string_view::npos) << c.what << ": " << s;
    EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << c.what;
  }
}

TEST_F(DiskRobustnessTest, MissingShardNamedByTheIndexIsDataLoss) {
  Publish(1, "shard_size=8KiB");
  std::string second;
  for (const auto& e : std::filesystem::directory_iterator(testing::DiskVersionDir(dir_, 1))) {
    const std::string n = e.path().filename().string();
    if (absl::StartsWith(n, "model-00002-of-")) second = e.path().string();
  }
  ASSERT_FALSE(second.empty()) << "expected several shards";
  ASSERT_TRUE(std::filesystem::remove(second));
  absl::Status s = Receive(0);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find(second), absl::string_view::npos) << s;
}

TEST_F(DiskRobustnessTest, VersionsWhoseTensorsAreAllEmpty) {
  auto pub = Publisher::Open(Uri(dir_));
  TensorView empty{"empty", DType::kF32, {0, 4}, {}, nullptr};
  ASSERT_TRUE((*pub)->Publish(1, {empty}, {}, kTimeout).ok());
  auto sub = Subscriber::Open(Uri(dir_));
  auto u = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*u)->tensors()[0].shape, (std::vector<int64_t>{0, 4}));
  // An empty tensor bound to a null destination, next to a non-empty one, in both bind modes.
  float w[4] = {1, 2, 3, 4};
  TensorView weights{"w", DType::kF32, {4}, {}, w};
  TensorView bias{"bias", DType::kF32, {0}, {}, nullptr};
  ASSERT_TRUE((*pub)->Publish(2, {weights, bias}, {}, kTimeout).ok());
  for (const char* mode : {"staged", "direct"}) {
    auto s2 = Subscriber::Open(Uri(dir_, std::string("bind_mode=") + mode));
    ASSERT_TRUE((*s2)->Bind("bias", Destination{DType::kF32, {0}, {}, nullptr}).ok());
    auto u2 = (*s2)->WaitForVersion(2, kTimeout);
    ASSERT_TRUE(u2.ok()) << mode << ": " << u2.status();
    EXPECT_EQ(std::memcmp((*u2)->Find("w")->data, w, sizeof(w)), 0);
  }
}

TEST_F(DiskRobustnessTest, FailedDurabilityStepAfterCommitDoesNotUndoTheVersion) {
  Publish(1);
  auto pub = [&] {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", "disk.commit_fsync=error");
    return Publisher::Open(Uri(dir_));
  }();
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto v2 = MakeVersion(1, 2, 1 << 16);
  // The version became visible when LATEST moved, so Publish reports success and keeps it.
  ASSERT_TRUE((*pub)->Publish(2, Views(v2), {}, kTimeout).ok());
  EXPECT_EQ(testing::ReadFileOrDie(dir_.path() + "/channel/LATEST"), "2\n");
  EXPECT_TRUE(std::filesystem::exists(testing::DiskVersionDir(dir_, 2)));
  auto sub = Subscriber::Open(Uri(dir_));
  auto u = (*sub)->WaitForVersion(2, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ExpectSameTensors(**u, v2);
}

TEST_F(DiskRobustnessTest, MissingLatestKeepsVersionsAndVersionsNeverGoBack) {
  for (uint64_t v = 1; v <= 3; ++v) Publish(v, "retention=10");
  std::filesystem::remove(dir_.path() + "/channel/LATEST");
  testing::WriteFileOrDie(dir_.path() + "/channel/.LATEST.tmp-99999", "4\n");
  auto pub = Publisher::Open(Uri(dir_, "retention=10"));
  ASSERT_TRUE(pub.ok()) << pub.status();
  for (uint64_t v = 1; v <= 3; ++v)
    EXPECT_TRUE(std::filesystem::exists(testing::DiskVersionDir(dir_, v)));
  EXPECT_FALSE(std::filesystem::exists(dir_.path() + "/channel/.LATEST.tmp-99999"));
  EXPECT_EQ((*pub)->latest_version(), std::optional<uint64_t>(3));
  auto tensors = MakeVersion(1, 1, 4096);
  EXPECT_EQ((*pub)->Publish(1, Views(tensors), {}, kTimeout).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*pub)->Publish(4, Views(tensors), {}, kTimeout).ok());
}

TEST_F(DiskRobustnessTest, ThousandsOfShardsNeedFewFileDescriptors) {
  std::vector<testing::OwnedTensor> many;
  for (int i = 0; i < 300; ++i) {
    testing::OwnedTensor t;
    t.name = "t" + std::to_string(i);
    t.dtype = DType::kU8;
    t.shape = {16};
    t.bytes = testing::RandomBytes(16, i);
    many.push_back(std::move(t));
  }
  auto pub = Publisher::Open(Uri(dir_, "shard_size=1"));  // one file per tensor
  ASSERT_TRUE((*pub)->Publish(1, Views(many), {}, kTimeout).ok());
  rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit low = old;
  low.rlim_cur = 64;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  auto sub = Subscriber::Open(Uri(dir_));
  auto u = (*sub)->WaitForVersion(1, kTimeout);
  setrlimit(RLIMIT_NOFILE, &old);
  ASSERT_TRUE(u.ok()) << u.status();
  ExpectSameTensors(**u, many);
}

// Out-of-range settings are errors; an unknown WEIGHTBUS_* variable is only a warning (the
// policy in docs/CONVENTIONS.md, "Settings"; the warning itself: settings_policy_test).
TEST_F(DiskRobustnessTest, SettingsOutOfRangeAreErrorsAndEnvironmentTyposAreNot) {
  EXPECT_EQ(Subscriber::Open(Uri(dir_, "hash_threads=100000")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Subscriber::Open(Uri(dir_, "hash_threads=-3")).status().code(),
            absl::StatusCode::kInvalidArgument);
  const auto no_files = Publisher::Open(Uri(dir_, "shard_size=0"));  // would make no file
  EXPECT_EQ(no_files.status().code(), absl::StatusCode::kInvalidArgument) << no_files.status();
  EXPECT_NE(no_files.status().message().find("shard_size"), absl::string_view::npos);
  auto chunk = Subscriber::Open(Uri(dir_, "chunk_size=1KiB"));
  EXPECT_EQ(chunk.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(chunk.status().message().find("chunk_size"), absl::string_view::npos);
  auto typo = [&] {
    const testing::ScopedEnv env("WEIGHTBUS_DISK_RETENTON", "1");
    return Subscriber::Open(Uri(dir_));
  }();
  EXPECT_TRUE(typo.ok()) << typo.status();
  EXPECT_TRUE(Subscriber::Open(Uri(dir_)).ok());
}

TEST_F(DiskRobustnessTest, OverlappingDestinationsAreRefused) {
  auto sub = Subscriber::Open(Uri(dir_));
  float x[4];
  absl::Status s = (*sub)->Bind("w", Destination{DType::kF32, {4, 4}, {0, 1}, x});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("overlap"), absl::string_view::npos) << s;
}

}  // namespace
}  // namespace weightbus

namespace weightbus {
namespace {

// Issue 10, item 18: deleting the channel directory while a publisher runs let a second
// publisher open the recreated directory and both wrote it. A publisher checks, before each
// commit, that the path still names the directory (and publisher.lock) it locked.
TEST(DiskOwnershipTest, PublisherWhoseDirectoryWasReplacedFailsAndLatestNeverGoesBack) {
  ScratchDir dir;
  const std::string channel = dir.path() + "/channel";
  // retention=10: no background deletion races with the test's own.
  auto first = Publisher::Open(Uri(dir, "retention=10"));
  ASSERT_TRUE(first.ok()) << first.status();
  for (uint64_t v = 1; v <= 5; ++v) {
    auto t = MakeVersion(11, v, 1 << 14);
    ASSERT_TRUE((*first)->Publish(v, Views(t), {}, kTimeout).ok()) << v;
  }
  std::filesystem::remove_all(channel);
  // Deleted: the first publisher's next publish fails, and writes nothing anywhere.
  auto v6 = MakeVersion(11, 6, 1 << 14);
  absl::Status deleted = (*first)->Publish(6, Views(v6), {}, kTimeout);
  EXPECT_EQ(deleted.code(), absl::StatusCode::kFailedPrecondition) << deleted;
  EXPECT_NE(deleted.message().find("deleted"), absl::string_view::npos) << deleted;
  EXPECT_FALSE(std::filesystem::exists(channel));

  // Recreated by a second publisher, which publishes 1 and 2 there.
  auto second = Publisher::Open(Uri(dir));
  ASSERT_TRUE(second.ok()) << second.status();
  for (uint64_t v = 1; v <= 2; ++v) {
    auto t = MakeVersion(12, v, 1 << 14);
    ASSERT_TRUE((*second)->Publish(v, Views(t), {}, kTimeout).ok()) << v;
  }
  absl::Status replaced = (*first)->Publish(6, Views(v6), {}, kTimeout);
  EXPECT_EQ(replaced.code(), absl::StatusCode::kFailedPrecondition) << replaced;
  EXPECT_NE(replaced.message().find("deleted and recreated"), absl::string_view::npos) << replaced;
  EXPECT_EQ(testing::ReadFileOrDie(channel + "/LATEST"), "2\n");
  EXPECT_FALSE(std::filesystem::exists(testing::DiskVersionDir(dir, 6)));

  // The second publisher carries on; a subscriber sees its versions only.
  auto v3 = MakeVersion(12, 3, 1 << 14);
  ASSERT_TRUE((*second)->Publish(3, Views(v3), {}, kTimeout).ok());
  EXPECT_EQ(testing::ReadFileOrDie(channel + "/LATEST"), "3\n");
  auto sub = Subscriber::Open(Uri(dir));
  ASSERT_TRUE(sub.ok());
  auto u = (*sub)->WaitForVersion(0, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*u)->version(), 3u);
  ExpectSameTensors(**u, v3);
}

// The same when only publisher.lock is deleted: a second publisher can then lock a new file, so
// the first one must stop.
TEST(DiskOwnershipTest, PublisherWhoseLockFileWasDeletedFails) {
  ScratchDir dir;
  auto first = Publisher::Open(Uri(dir));
  ASSERT_TRUE(first.ok());
  auto v1 = MakeVersion(13, 1, 1 << 12);
  ASSERT_TRUE((*first)->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_EQ(::unlink((dir.path() + "/channel/publisher.lock").c_str()), 0);
  auto second = Publisher::Open(Uri(dir));
  ASSERT_TRUE(second.ok()) << second.status();
  auto v2 = MakeVersion(13, 2, 1 << 12);
  absl::Status s = (*first)->Publish(2, Views(v2), {}, kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("publisher.lock"), absl::string_view::npos) << s;
  EXPECT_EQ(testing::ReadFileOrDie(dir.path() + "/channel/LATEST"), "1\n");
  ASSERT_TRUE((*second)->Publish(2, Views(v2), {}, kTimeout).ok());
}

// Issue 10, item 19: links planted in a channel are never followed; what they point at is left
// exactly as it was.
class DiskSymlinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::create_directories(channel_);
    testing::WriteFileOrDie(victim_, "precious\n");
    std::filesystem::create_directories(victim_dir_);
    testing::WriteFileOrDie(victim_dir_ + "/keep", "precious\n");
  }
  void ExpectVictimsUntouched() {
    EXPECT_EQ(testing::ReadFileOrDie(victim_), "precious\n");
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(victim_dir_)) {
      names.push_back(e.path().filename().string());
    }
    EXPECT_EQ(names, std::vector<std::string>{"keep"});
    EXPECT_EQ(testing::ReadFileOrDie(victim_dir_ + "/keep"), "precious\n");
  }
  void Plant(const std::string& target, const std::string& rel) {
    ASSERT_EQ(::symlink(target.c_str(), (channel_ + "/" + rel).c_str()), 0) << rel;
  }
  ScratchDir dir_;
  const std::string channel_ = dir_.path() + "/channel";
  const std::string victim_ = dir_.path() + "/victim.txt";
  const std::string victim_dir_ = dir_.path() + "/victim_dir";
};

TEST_F(DiskSymlinkTest, PublisherLockLinkIsRefused) {
  Plant(victim_, "publisher.lock");
  auto pub = Publisher::Open(Uri(dir_));
  ASSERT_EQ(pub.status().code(), absl::StatusCode::kFailedPrecondition) << pub.status();
  EXPECT_NE(pub.status().message().find("publisher.lock is a symbolic link"),
            absl::string_view::npos)
      << pub.status();
  ExpectVictimsUntouched();
}

TEST_F(DiskSymlinkTest, VersionsDirectoryLinkIsRefused) {
  Plant(victim_dir_, "versions");
  auto pub = Publisher::Open(Uri(dir_));
  ASSERT_EQ(pub.status().code(), absl::StatusCode::kFailedPrecondition) << pub.status();
  EXPECT_NE(pub.status().message().find("versions is a symbolic link"), absl::string_view::npos)
      << pub.status();
  ExpectVictimsUntouched();
}

TEST_F(DiskSymlinkTest, LatestTemporaryAndUncommittedVersionLinksAreReplacedNotFollowed) {
  auto pub = Publisher::Open(Uri(dir_));
  ASSERT_TRUE(pub.ok()) << pub.status();
  // Planted behind the live publisher's back: the LATEST temporary it will write next, and the
  // directory its next version will be renamed to.
  Plant(victim_, absl::StrFormat(".LATEST.tmp-%d", getpid()));
  Plant(victim_dir_, absl::StrFormat("versions/v%020d", 1));
  auto v1 = MakeVersion(14, 1, 1 << 12);
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  ExpectVictimsUntouched();
  struct stat st;
  ASSERT_EQ(::lstat((channel_ + "/LATEST").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "LATEST must be a file, not the planted link";
  EXPECT_EQ(testing::ReadFileOrDie(channel_ + "/LATEST"), "1\n");
  ASSERT_EQ(::lstat(testing::DiskVersionDir(dir_, 1).c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  auto sub = Subscriber::Open(Uri(dir_));
  auto u = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ExpectSameTensors(**u, v1);
}

TEST_F(DiskSymlinkTest, SubscriberRefusesAVersionDirectoryOrFileThatIsALink) {
  {
    auto pub = Publisher::Open(Uri(dir_, "retention=10"));
    ASSERT_TRUE(pub.ok());
    for (uint64_t v = 1; v <= 2; ++v) {
      auto t = MakeVersion(15, v, 1 << 12);
      ASSERT_TRUE((*pub)->Publish(v, Views(t), {}, kTimeout).ok());
    }
  }
  // A forged, complete checkpoint outside the channel, linked in place of version 2.
  const std::string forged = dir_.path() + "/forged";
  std::filesystem::rename(testing::DiskVersionDir(dir_, 2), forged);
  ASSERT_EQ(::symlink(forged.c_str(), testing::DiskVersionDir(dir_, 2).c_str()), 0);
  auto sub = Subscriber::Open(Uri(dir_));
  auto u = (*sub)->WaitForVersion(0, absl::Seconds(5));
  ASSERT_EQ(u.status().code(), absl::StatusCode::kDataLoss) << u.status();
  EXPECT_NE(u.status().message().find("symbolic link"), absl::string_view::npos) << u.status();

  // A data file of a real version directory replaced by a link.
  ASSERT_EQ(::unlink(testing::DiskVersionDir(dir_, 2).c_str()), 0);
  std::filesystem::rename(forged, testing::DiskVersionDir(dir_, 2));
  const std::string file = testing::DiskVersionDir(dir_, 2) + "/model.safetensors";
  std::filesystem::rename(file, dir_.path() + "/outside.safetensors");
  ASSERT_EQ(::symlink((dir_.path() + "/outside.safetensors").c_str(), file.c_str()), 0);
  auto sub2 = Subscriber::Open(Uri(dir_));
  auto u2 = (*sub2)->WaitForVersion(0, absl::Seconds(5));
  ASSERT_EQ(u2.status().code(), absl::StatusCode::kDataLoss) << u2.status();
  EXPECT_NE(u2.status().message().find("model.safetensors is a symbolic link"),
            absl::string_view::npos)
      << u2.status();
}

// Not links, but as hostile: a FIFO planted as LATEST or as a version's file would block an
// open(2) for ever; the subscriber refuses it at once.
TEST_F(DiskSymlinkTest, PlantedFifosAreRefusedNotWaitedOn) {
  {
    auto pub = Publisher::Open(Uri(dir_));
    ASSERT_TRUE(pub.ok());
    auto t = MakeVersion(16, 1, 1 << 12);
    ASSERT_TRUE((*pub)->Publish(1, Views(t), {}, kTimeout).ok());
  }
  const std::string lock = testing::DiskVersionDir(dir_, 1) + "/.readers.lock";
  ASSERT_EQ(::unlink(lock.c_str()), 0);
  ASSERT_EQ(::mkfifo(lock.c_str(), 0644), 0);
  auto sub = Subscriber::Open(Uri(dir_));
  auto u = (*sub)->WaitForVersion(0, kTimeout);
  EXPECT_EQ(u.status().code(), absl::StatusCode::kDataLoss) << u.status();
  ASSERT_EQ(::unlink(lock.c_str()), 0);
  testing::WriteFileOrDie(lock, "");
  const std::string latest = channel_ + "/LATEST";
  ASSERT_EQ(::unlink(latest.c_str()), 0);
  ASSERT_EQ(::mkfifo(latest.c_str(), 0644), 0);
  auto u2 = (*sub)->WaitForVersion(0, kTimeout);
  EXPECT_EQ(u2.status().code(), absl::StatusCode::kDataLoss) << u2.status();
  EXPECT_NE(u2.status().message().find("not a regular file"), absl::string_view::npos)
      << u2.status();
}

}  // namespace
}  // namespace weightbus

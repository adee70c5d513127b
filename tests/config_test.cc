// SPDX-License-Identifier: Apache-2.0
// Internal pieces of the core: settings registry, URIs, fail points, strided packing, UTF-8
// checks, the I/O engines, the buffer pool and the codec figures layers report.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <numeric>

#include <gtest/gtest.h>

#include "core/buffer.h"
#include "core/checksum.h"
#include "core/config.h"
#include "core/failpoint.h"
#include "core/registry.h"
#include "core/tensor_pack.h"
#include "core/uri.h"
#include "io/file_io.h"
#include "test_support.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::internal {
namespace {

TEST(ChecksumTest, VectorizedXxh3MatchesLibxxhashInOneGoAndInPieces) {
  const std::vector<std::byte> bytes = testing::RandomBytes(3 << 20, 99);
  for (size_t n : {size_t{0}, size_t{1}, size_t{16}, size_t{129}, size_t{240}, size_t{241},
                   size_t{1024}, size_t{65537}, bytes.size()}) {
    const uint64_t want = testing::Xxh3(bytes.data(), n);
    EXPECT_EQ(Xxh3(bytes.data(), n), want) << n << " bytes, " << Xxh3Implementation();
    // Streamed in uneven pieces, as transfers land.
    Xxh3Stream stream;
    size_t done = 0, step = 1;
    while (done < n) {
      const size_t take = std::min(step, n - done);
      stream.Update(bytes.data() + done, take);
      done += take;
      step = step * 3 + 7;
    }
    EXPECT_EQ(stream.Digest(), want) << n << " bytes streamed";
  }
}

const SettingTable& TestTable() {
  static const SettingTable* t =
      new SettingTable{"disk",
                       {{"retention", SettingType::kInt, "3", "doc"},
                        {"chunk_size", SettingType::kBytes, "4MiB", "doc"},
                        {"poll_interval", SettingType::kDuration, "100ms", "doc"},
                        {"fsync", SettingType::kBool, "true", "doc"},
                        {"io_engine", SettingType::kEnum, "uring", "doc", {"uring", "psync"}}}};
  return *t;
}

TEST(ConfigTest, DefaultsEnvUriAndOptionsInIncreasingPrecedence) {
  std::map<std::string, std::string> env = {{"WEIGHTBUS_DISK_RETENTION", "5"},
                                            {"WEIGHTBUS_DISK_CHUNK_SIZE", "1MiB"},
                                            {"WEIGHTBUS_DISK_FSYNC", "false"}};
  auto lookup = [&](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  auto c = Config::Resolve({&TestTable()}, {{"retention", "7"}, {"chunk_size", "5GB"}},
                           {{"retention", "9"}}, lookup);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->Int("retention"), 9);               // options beat the URI and env
  EXPECT_EQ(c->Bytes("chunk_size"), 5000000000u);  // URI beats env
  EXPECT_FALSE(c->Bool("fsync"));                  // env beats default
  EXPECT_EQ(c->Duration("poll_interval"), absl::Milliseconds(100));
  EXPECT_EQ(c->String("io_engine"), "uring");
  EXPECT_NE(c->Dump().find("retention=9 (options)"), std::string::npos) << c->Dump();
  EXPECT_NE(c->Dump().find("fsync=false (environment WEIGHTBUS_DISK_FSYNC)"), std::string::npos);
}

TEST(ConfigTest, MalformedAndUnknownSettingsAreErrorsNamingTheSource) {
  auto none = [](const char*) -> const char* { return nullptr; };
  auto bad_int = Config::Resolve({&TestTable()}, {{"retention", "three"}}, {}, none);
  ASSERT_EQ(bad_int.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_int.status().message().find("retention=\"three\""), absl::string_view::npos);
  EXPECT_NE(bad_int.status().message().find("URI query"), absl::string_view::npos);
  auto bad_enum = Config::Resolve({&TestTable()}, {}, {{"io_engine", "aio"}}, none);
  ASSERT_EQ(bad_enum.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_enum.status().message().find("enum(uring|psync)"), absl::string_view::npos);
  auto unknown = Config::Resolve({&TestTable()}, {}, {{"retension", "1"}}, none);
  ASSERT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("known: retention"), absl::string_view::npos);
  auto env = [](const char* n) -> const char* {
    return std::string(n) == "WEIGHTBUS_DISK_POLL_INTERVAL" ? "fast" : nullptr;
  };
  auto bad_env = Config::Resolve({&TestTable()}, {}, {}, env);
  ASSERT_EQ(bad_env.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_env.status().message().find("WEIGHTBUS_DISK_POLL_INTERVAL"),
            absl::string_view::npos);
}

TEST(ConfigTest, ByteSuffixes) {
  const SettingSpec spec{"b", SettingType::kBytes, "0", ""};
  auto bytes = [&](const char* t) { return std::get<uint64_t>(*ParseSettingValue(spec, t)); };
  EXPECT_EQ(bytes("4096"), 4096u);
  EXPECT_EQ(bytes("64KiB"), 65536u);
  EXPECT_EQ(bytes("4mib"), 4u << 20);
  EXPECT_EQ(bytes("2G"), 2ull << 30);
  EXPECT_EQ(bytes("5GB"), 5000000000u);
  EXPECT_FALSE(ParseSettingValue(spec, "lots").ok());
  EXPECT_FALSE(ParseSettingValue(spec, "-1").ok());
  EXPECT_FALSE(ParseSettingValue(spec, "99999999999TiB").ok());
  EXPECT_EQ(EnvName("core", "bind_mode"), "WEIGHTBUS_BIND_MODE");
  EXPECT_EQ(EnvName("disk", "queue_depth"), "WEIGHTBUS_DISK_QUEUE_DEPTH");
  EXPECT_EQ(EnvName("delta", "delta_threads"), "WEIGHTBUS_DELTA_THREADS");
  EXPECT_EQ(EnvName("delta", "keyframe_interval"), "WEIGHTBUS_DELTA_KEYFRAME_INTERVAL");
}

TEST(UriTest, Forms) {
  auto disk = ParseUri("disk:///mnt/shared/my%20policy?retention=4&fsync=false");
  ASSERT_TRUE(disk.ok()) << disk.status();
  EXPECT_EQ(disk->scheme, "disk");
  EXPECT_EQ(disk->authority, "");
  EXPECT_EQ(disk->path, "/mnt/shared/my policy");
  EXPECT_EQ(disk->query.at("retention"), "4");
  EXPECT_EQ(disk->query.at("fsync"), "false");
  EXPECT_EQ(disk->Display(), "disk:///mnt/shared/my policy");

  auto ucx = ParseUri("ucx://10.0.0.1:13337/policy");
  ASSERT_TRUE(ucx.ok());
  EXPECT_EQ(ucx->host, "10.0.0.1");
  EXPECT_EQ(ucx->port, 13337);
  EXPECT_EQ(ucx->path, "/policy");
  auto v6 = ParseUri("delta+ucx://[fe80::1%25eth0]:9000/p");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(v6->scheme, "delta+ucx");
  EXPECT_EQ(v6->host, "fe80::1%25eth0");
  EXPECT_EQ(v6->port, 9000);

  for (const char* bad : {"/no/scheme", "disk:/x", "ucx://h:99999/c", "ucx://::1:9/c",
                          "ucx://[::1/c", "disk:///x%zz", "disk:///x%2", "disk:///x?a=1&a=2"}) {
    auto u = ParseUri(bad);
    EXPECT_EQ(u.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(u.status().message().find(bad), absl::string_view::npos) << u.status();
  }
}

// Decoded path segments are checked: an encoded '/' or NUL, or a "." or ".." segment (encoded or
// not), would let a channel name leave the directory it names (issue 10, item 20).
TEST(UriTest, PathsThatClimbOutOfTheirBaseAreRefused) {
  for (const char* bad :
       {"disk:///base/ch%2F..%2F..%2Fetc", "disk:///base/ch%2f..%2fx", "disk:///base/%2E%2E/x",
        "disk:///base/../x", "disk:///base/./x", "disk:///base/..", "disk:///base/x%00y",
        "ucx://h:9/%2E%2E%2Fetc", "delta+disk:///base/..%2Fx"}) {
    auto u = ParseUri(bad);
    EXPECT_EQ(u.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(u.status().message().find(bad), absl::string_view::npos) << u.status();
  }
  // Dots inside a name and percent-encoded ordinary characters stay fine.
  for (const char* good :
       {"disk:///base/a..b/.hidden/v1.2", "disk:///base/my%20ch%2Dx", "ucx://h:9/policy.v2"}) {
    EXPECT_TRUE(ParseUri(good).ok()) << good << ": " << ParseUri(good).status();
  }
}

// Fail points come only from the environment (WEIGHTBUS_FAILPOINTS): a URI query or an Options
// entry that names them is refused before anything is opened, so a URI can never make a process
// kill itself (issue 10, item 20).
TEST(FailPointsTest, ComeOnlyFromTheEnvironmentNeverFromAUriOrOptions) {
  testing::ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/ch";
  auto from_uri = Publisher::Open(uri + "?failpoints=core.before_transport%3Dkill");
  ASSERT_EQ(from_uri.status().code(), absl::StatusCode::kInvalidArgument) << from_uri.status();
  EXPECT_NE(from_uri.status().message().find("WEIGHTBUS_FAILPOINTS"), absl::string_view::npos)
      << from_uri.status();
  auto sub_from_uri = Subscriber::Open(uri + "?failpoints=disk.before_read%3Dkill");
  EXPECT_EQ(sub_from_uri.status().code(), absl::StatusCode::kInvalidArgument);
  auto from_options = Publisher::Open(uri, {{"failpoints", "core.before_transport=kill"}});
  ASSERT_EQ(from_options.status().code(), absl::StatusCode::kInvalidArgument)
      << from_options.status();
  EXPECT_NE(from_options.status().message().find("WEIGHTBUS_FAILPOINTS"), absl::string_view::npos);

  // From the environment they fire.
  ASSERT_EQ(::setenv("WEIGHTBUS_FAILPOINTS", "core.before_transport=error", 1), 0);
  auto pub = Publisher::Open(uri);
  ::unsetenv("WEIGHTBUS_FAILPOINTS");
  ASSERT_TRUE(pub.ok()) << pub.status();
  std::vector<std::byte> bytes = testing::RandomBytes(64, 3);
  TensorView t{"t", DType::kU8, {64}, {}, bytes.data()};
  absl::Status s = (*pub)->Publish(1, {t}, {}, absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("failpoint core.before_transport fired"), absl::string_view::npos)
      << s;
}

TEST(FailPointsTest, FiresOnTheNthPassOnly) {
  auto fp = FailPoints::Parse("a=error@2,b=delay:1");
  ASSERT_TRUE(fp.ok());
  EXPECT_TRUE(fp->Hit("a").ok());
  EXPECT_EQ(fp->Hit("a").code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(fp->Hit("a").ok());
  EXPECT_TRUE(fp->Hit("b").ok());
  EXPECT_TRUE(fp->Hit("unlisted").ok());
  EXPECT_FALSE(FailPoints::Parse("a=explode").ok());
  EXPECT_FALSE(FailPoints::Parse("a=error@0").ok());
  EXPECT_FALSE(FailPoints::Parse("=kill").ok());
}

TEST(TensorPackTest, PackAndUnpackAreInverseForAnyStrides) {
  // A 2x3x4 int32 tensor viewed with permuted axes and a reversed middle axis.
  std::vector<int32_t> base(24);
  std::iota(base.begin(), base.end(), 0);
  const std::vector<int64_t> shape = {4, 3, 2};      // permute (2, 1, 0)
  const std::vector<int64_t> strides = {1, -4, 12};  // middle axis reversed
  const int32_t* origin = base.data() + 8;           // element [0, 0, 0] = base[0*1 + 2*4]
  std::vector<int32_t> packed(24);
  PackStrided(origin, 4, shape, strides, reinterpret_cast<std::byte*>(packed.data()));
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 3; ++j) {
      for (int64_t k = 0; k < 2; ++k) {
        EXPECT_EQ(packed[(i * 3 + j) * 2 + k], origin[i * 1 + j * -4 + k * 12]);
      }
    }
  }
  std::vector<int32_t> back(24, -1);
  UnpackStrided(reinterpret_cast<const std::byte*>(packed.data()), 4, shape, strides,
                back.data() + 8);
  EXPECT_EQ(back, base);
  // 0-d and zero-size shapes.
  int64_t scalar = 42, out = 0;
  PackStrided(&scalar, 8, {}, {}, reinterpret_cast<std::byte*>(&out));
  EXPECT_EQ(out, 42);
  PackStrided(nullptr, 4, {0, 3}, {3, 1}, nullptr);  // nothing to touch
}

TEST(TensorPackTest, Utf8Validation) {
  size_t at = 0;
  EXPECT_TRUE(IsValidUtf8("plain.ascii/name with spaces"));
  EXPECT_TRUE(IsValidUtf8("ünïcödé ✓ 😀"));
  EXPECT_FALSE(IsValidUtf8("a\xff", &at));
  EXPECT_EQ(at, 1u);
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));          // overlong '/'
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));      // surrogate
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // > U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xe2\x9c"));          // truncated
}

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

TEST(BufferPoolTest, RecyclesBuffersAfterTheLastUserLetsGo) {
  auto pool = BufferPool::Create(2);
  std::byte* first = nullptr;
  {
    auto a = pool->Get(1 << 20);
    ASSERT_TRUE(a.ok());
    first = (*a)->data();
    first[0] = std::byte{1};
  }
  auto b = pool->Get(1000);  // fits in the returned buffer
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->data(), first);
  auto c = pool->Get(2 << 20);  // does not fit: fresh
  ASSERT_TRUE(c.ok());
  EXPECT_NE((*c)->data(), first);
  EXPECT_EQ((*c)->size(), 2u << 20);
  // Buffers outliving the pool are freed, not returned.
  pool.reset();
  b->reset();
}

TEST(RegistryTest, DiskIsRegisteredWithItsSettings) {
  const TransportDescriptor* disk = FindTransport("disk");
  ASSERT_NE(disk, nullptr);
  ASSERT_NE(disk->settings, nullptr);
  EXPECT_EQ(disk->settings->scope, "disk");
  auto uri = ParseUri("nope:///x");
  EXPECT_EQ(ResolveStack(*uri).status().code(), absl::StatusCode::kUnimplemented);
  auto layered = ParseUri("disk+disk:///x");
  EXPECT_EQ(ResolveStack(*layered).status().code(), absl::StatusCode::kInvalidArgument);
  auto plain = ParseUri("disk:///x");
  auto stack = ResolveStack(*plain);
  ASSERT_TRUE(stack.ok());
  ASSERT_EQ(stack->size(), 1u);
  EXPECT_EQ((*stack)[0], disk);
}

}  // namespace
}  // namespace weightbus::internal

namespace weightbus::internal {
namespace {

// The optional capabilities layers build on, on the disk transport.
TEST(DiskCapabilitiesTest, OpenExactVersionsListThemAndKeepAFloor) {
  testing::ScratchDir dir;
  auto uri = ParseUri("disk://" + dir.path() + "/ch?retention=1");
  auto stack = ResolveStack(*uri);
  ASSERT_TRUE(stack.ok());
  auto config = ResolveConfig(*stack, *uri, {});
  ASSERT_TRUE(config.ok()) << config.status();
  auto pub = OpenPublisherStack(*stack, *uri, *config);
  auto sub = OpenSubscriberStack(*stack, *uri, *config);
  ASSERT_TRUE(pub.ok() && sub.ok());
  std::vector<std::byte> bytes = testing::RandomBytes(64, 1);
  auto publish = [&](uint64_t v) {
    Manifest m;
    m.version = v;
    m.tensors.push_back(
        TensorInfo{"t", DType::kU8, {64}, std::nullopt, 64, testing::Xxh3(bytes.data(), 64)});
    SealedPublishJob job(m, {bytes.data()});
    ASSERT_TRUE((*pub)->Publish(job, absl::Now() + absl::Seconds(10)).ok());
  };
  publish(1);
  (*pub)->KeepVersionsFrom(1);  // retention=1 would otherwise drop 1 and 2
  publish(2);
  publish(3);
  auto listed = [&] {
    auto l = (*sub)->ListVersions();
    return l.ok() ? *l : std::vector<uint64_t>{};
  };
  absl::SleepFor(absl::Milliseconds(200));  // retention runs in the background
  EXPECT_EQ(listed(), (std::vector<uint64_t>{1, 2, 3}));
  auto v1 = (*sub)->OpenVersion(1, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(v1.ok()) << v1.status();
  EXPECT_EQ((*v1)->manifest().version, 1u);
  v1->reset();
  EXPECT_EQ((*sub)->OpenVersion(4, absl::Now() + absl::Seconds(1)).status().code(),
            absl::StatusCode::kNotFound);
  (*pub)->KeepVersionsFrom(3);
  publish(4);
  EXPECT_TRUE(testing::WaitUntil([&] { return listed() == std::vector<uint64_t>{3, 4}; }));
  EXPECT_EQ((*sub)->OpenVersion(1, absl::Now() + absl::Seconds(1)).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace weightbus::internal

namespace weightbus::internal {
namespace {

// A layer that passes versions through unchanged but reports codec figures, as the delta layer
// does: the core must surface them in PublishStats/UpdateStats.
class CodecReportingPublisher : public TransportPublisher {
 public:
  explicit CodecReportingPublisher(std::unique_ptr<TransportPublisher> inner)
      : inner_(std::move(inner)) {}
  absl::StatusOr<std::optional<uint64_t>> LatestVersion() override {
    return inner_->LatestVersion();
  }
  absl::Status Publish(PublishJob& job, absl::Time deadline) override {
    return inner_->Publish(job, deadline);
  }
  std::optional<CodecStats> LastCodecStats() const override {
    return CodecStats{absl::Milliseconds(7), 42};
  }

 private:
  std::unique_ptr<TransportPublisher> inner_;
};

class CodecReportingIncoming : public IncomingVersion {
 public:
  explicit CodecReportingIncoming(std::unique_ptr<IncomingVersion> inner)
      : inner_(std::move(inner)) {}
  const Manifest& manifest() const override { return inner_->manifest(); }
  absl::Status Fetch(absl::Span<std::byte* const> targets, LandingSink& sink,
                     absl::Time deadline) override {
    return inner_->Fetch(targets, sink, deadline);
  }
  std::string DescribeSource(size_t i) const override { return inner_->DescribeSource(i); }
  std::optional<CodecStats> FetchCodecStats() const override {
    return CodecStats{absl::Milliseconds(3), 43};
  }

 private:
  std::unique_ptr<IncomingVersion> inner_;
};

class CodecReportingSubscriber : public TransportSubscriber {
 public:
  explicit CodecReportingSubscriber(std::unique_ptr<TransportSubscriber> inner)
      : inner_(std::move(inner)) {}
  absl::StatusOr<std::unique_ptr<IncomingVersion>> WaitForVersion(uint64_t min_version,
                                                                  absl::Time deadline) override {
    auto v = inner_->WaitForVersion(min_version, deadline);
    if (!v.ok()) return v.status();
    return std::make_unique<CodecReportingIncoming>(*std::move(v));
  }

 private:
  std::unique_ptr<TransportSubscriber> inner_;
};

TEST(CodecStatsTest, LayersReportEncodeDecodeAndWireBytesPlainTransportsTheirBytes) {
  static const bool registered = [] {
    TransportDescriptor d;
    d.scheme = "testcodec";
    d.summary = "test layer reporting codec figures";
    d.wrap_publisher = [](const Uri&, const Config&, std::unique_ptr<TransportPublisher> inner)
        -> absl::StatusOr<std::unique_ptr<TransportPublisher>> {
      return std::make_unique<CodecReportingPublisher>(std::move(inner));
    };
    d.wrap_subscriber = [](const Uri&, const Config&, std::unique_ptr<TransportSubscriber> inner)
        -> absl::StatusOr<std::unique_ptr<TransportSubscriber>> {
      return std::make_unique<CodecReportingSubscriber>(std::move(inner));
    };
    RegisterTransport(std::move(d));
    return true;
  }();
  ASSERT_TRUE(registered);
  testing::ScratchDir dir;
  std::vector<std::byte> bytes = testing::RandomBytes(256, 3);
  const TensorView t{"w", DType::kU8, {256}, {}, bytes.data()};
  for (const std::string scheme : {"disk", "testcodec+disk"}) {
    SCOPED_TRACE(scheme);
    const std::string uri = scheme + "://" + dir.path() + "/" + scheme;
    auto pub = Publisher::Open(uri);
    auto sub = Subscriber::Open(uri);
    ASSERT_TRUE(pub.ok() && sub.ok());
    ASSERT_TRUE((*pub)->Publish(1, {t}, {}, absl::Seconds(10)).ok());
    auto u = (*sub)->WaitForVersion(1, absl::Seconds(10));
    ASSERT_TRUE(u.ok()) << u.status();
    const PublishStats p = (*pub)->last_stats();
    const UpdateStats& s = (*u)->stats();
    EXPECT_EQ(p.bytes, 256u);
    EXPECT_EQ(s.bytes, 256u);
    if (scheme == "disk") {
      EXPECT_EQ(p.wire_bytes, 256u);
      EXPECT_EQ(p.encode, absl::ZeroDuration());
      EXPECT_EQ(s.wire_bytes, 256u);
      EXPECT_EQ(s.decode, absl::ZeroDuration());
    } else {
      EXPECT_EQ(p.wire_bytes, 42u);
      EXPECT_EQ(p.encode, absl::Milliseconds(7));
      EXPECT_EQ(s.wire_bytes, 43u);
      EXPECT_EQ(s.decode, absl::Milliseconds(3));
    }
  }
}

}  // namespace
}  // namespace weightbus::internal

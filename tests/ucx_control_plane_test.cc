// SPDX-License-Identifier: Apache-2.0
// The ucx:// control plane against one hostile peer (issue 17): a client written here speaks the
// rendezvous protocol over a real loopback socket and does what no subscriber does (renews a
// lease for ever, sends partial frames that claim a gigabyte, floods WAITs without reading,
// takes every file descriptor, takes every connection). Each case checks the outcome: the
// publisher's RSS (this process's, read from /proc/self/status) stays bounded, the hostile
// connection is closed, publishes do not time out, an honest subscriber still receives a
// bit-exact version, and errors carry their exact codes. Also: where UCX's own tcp transport
// listens, and shared-secret channels (docs/SECURITY.md): a stranger gets no manifest and no
// rkey, its receipts do not count, and a squatter on the port is refused by subscribers.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/secret.h"
#include "expect_tensors.h"
#include "test_model.h"
#include "test_support.h"
#include "transports/ucx/control.h"
#include "ucx_tls.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::testing::HasSubstr;
using ::weightbus::internal::ucx::ControlStream;
using ::weightbus::internal::ucx::Frame;
using ::weightbus::internal::ucx::kMagic;
using ::weightbus::internal::ucx::kMaxFrame;
using ::weightbus::internal::ucx::kMaxRequestFrame;
using ::weightbus::internal::ucx::kProtocolVersion;
using ::weightbus::internal::ucx::MsgType;
using ::weightbus::internal::ucx::Reader;
using ::weightbus::internal::ucx::Writer;
using ::weightbus::testing::ExpectSameTensors;
using ::weightbus::testing::MakeVersion;
using ::weightbus::testing::Views;

constexpr absl::Duration kTimeout = absl::Seconds(30);
constexpr uint64_t kMiB = uint64_t{1} << 20;

// This process's resident set (VmRSS), in bytes.
uint64_t Rss() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      return std::stoull(line.substr(6)) * 1024;  // "VmRSS:   123456 kB"
    }
  }
  ADD_FAILURE() << "no VmRSS in /proc/self/status";
  return 0;
}

// A client of the rendezvous written by hand, able to send what no subscriber sends.
class HostileClient {
 public:
  explicit HostileClient(int port) {
    auto fd = internal::ucx::Connect("127.0.0.1", port, absl::Now() + kTimeout, "hostile");
    EXPECT_TRUE(fd.ok()) << fd.status();
    if (fd.ok()) stream_ = ControlStream(*std::move(fd), "the publisher");
  }
  bool connected() const { return stream_.connected(); }

  // Sends HELLO and receives WELCOME.
  bool Greet(const std::string& channel) {
    Writer hello(MsgType::kHello);
    hello.Str(kMagic).U32(kProtocolVersion).Str(channel).U64(0xbad).Str("a hostile client");
    if (!Send(std::move(hello).Finish())) return false;
    absl::StatusOr<Frame> f = stream_.Receive(absl::Now() + kTimeout);
    return f.ok() && f->type == MsgType::kWelcome;
  }
  // False once the publisher has closed the connection.
  bool Send(std::string bytes) {
    return stream_.Send(std::move(bytes), absl::Now() + kTimeout).ok();
  }
  absl::StatusOr<Frame> Receive() { return stream_.Receive(absl::Now() + kTimeout); }
  // Reads (and discards) frames until the publisher closes the connection: OK then, or the
  // error that ended the reading (DeadlineExceeded: still open after kTimeout).
  absl::Status ReadUntilClosed(int* frames = nullptr) {
    while (true) {
      absl::StatusOr<Frame> f = Receive();
      if (absl::IsUnavailable(f.status())) return absl::OkStatus();
      if (!f.ok()) return f.status();
      if (frames != nullptr) ++*frames;
    }
  }

 private:
  ControlStream stream_;
};

std::string Wait(uint64_t request, uint64_t version, uint8_t mode = 0) {
  return Writer(MsgType::kWait).U64(request).U64(version).U8(mode).Finish();
}

class UcxControlPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    env_.emplace(testing::kTcp.env);
    port_ = testing::FreePort();
    ASSERT_GT(port_, 0);
  }

  std::string Uri(const std::string& query = "") const {
    return absl::StrFormat("ucx://127.0.0.1:%d/policy%s", port_, query.empty() ? "" : "?" + query);
  }

  // Opens the publisher (skipping the case where UCX cannot run here) and publishes version 1.
  void OpenPublisher(const std::string& query = "") {
    auto pub = Publisher::Open(Uri(query));
    if (absl::IsUnavailable(pub.status())) GTEST_SKIP() << "UCX cannot run here: " << pub.status();
    ASSERT_TRUE(pub.ok()) << pub.status();
    pub_ = *std::move(pub);
    Publish(1);
  }

  void Publish(uint64_t v) {
    versions_.resize(std::max<size_t>(versions_.size(), v + 1));
    versions_[v] = MakeVersion(17, v, 1 << 16);
    ASSERT_TRUE(pub_->Publish(v, Views(versions_[v]), {}, kTimeout).ok()) << v;
  }

  // A new honest subscriber (with the settings `query`) receives version `v` (or newer)
  // bit-exact within kTimeout.
  void ExpectHonestSubscriberReceives(uint64_t v, const std::string& query = "") {
    auto sub = Subscriber::Open(Uri(query));
    ASSERT_TRUE(sub.ok()) << sub.status();
    auto u = (*sub)->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ASSERT_EQ((*u)->version(), v);
    ExpectSameTensors(**u, versions_[v]);
  }

  std::optional<testing::ScopedEnvs> env_;
  int port_ = -1;
  std::unique_ptr<Publisher> pub_;
  std::vector<std::vector<testing::OwnedTensor>> versions_;
};

// Audit: "a client that keeps renewing its leases makes every later publish time out". A lease
// is renewed only within lease_max_hold of its grant: the renewal after that is refused
// (RENEWED, not valid), the lease expires, and the Publish that waited for the only staging
// slot goes through.
TEST_F(UcxControlPlaneTest, ALeaseRenewedForEverBlocksTheSlotNoLongerThanLeaseMaxHold) {
  OpenPublisher("staging_slots=1&lease=100ms&lease_max_hold=1s");
  if (IsSkipped()) return;
  HostileClient hostile(port_);
  ASSERT_TRUE(hostile.Greet("policy"));
  ASSERT_TRUE(hostile.Send(Wait(1, 1)));
  absl::StatusOr<Frame> grant = hostile.Receive();
  ASSERT_TRUE(grant.ok()) << grant.status();
  ASSERT_EQ(grant->type, MsgType::kGrant);
  Reader g(grant->payload);
  g.U64();
  const uint64_t lease = g.U64();
  ASSERT_TRUE(g.ok());
  std::atomic<bool> stop{false};
  std::atomic<int> renewed{0};
  std::atomic<bool> refused{false};
  std::thread renewer([&] {
    // Renews back to back, each after the previous answer, until refused or told to stop.
    while (!stop.load() && !refused.load()) {
      if (!hostile.Send(Writer(MsgType::kRenew).U64(lease).Finish())) return;
      absl::StatusOr<Frame> f = hostile.Receive();
      if (!f.ok()) return;
      if (f->type != MsgType::kRenewed) continue;
      Reader r(f->payload);
      EXPECT_EQ(r.U64(), lease);
      if (r.U8() != 0) {
        ++renewed;
      } else {
        refused = true;
      }
    }
  });
  const std::vector<testing::OwnedTensor> v2 = MakeVersion(17, 2, 1 << 16);
  const absl::Status published = pub_->Publish(2, Views(v2), {}, kTimeout);
  stop = true;
  renewer.join();
  ASSERT_TRUE(published.ok()) << published;
  EXPECT_TRUE(refused.load()) << "renewed " << renewed.load() << " times, never refused";
  EXPECT_GT(renewed.load(), 0);
  versions_.resize(3);
  versions_[2] = v2;
  ExpectHonestSubscriberReceives(2);
}

// The same with many connections taking turns: each asks for the exact version of a staging
// slot before the previous one's hold ran out, and renews its lease for ever, so that every slot
// stays leased however long each lease's hold is bounded. While a Publish waits for a slot, no
// new lease goes to a slot it could take (with two slots every one but the newest's; with one,
// that one): the slot drains, the Publish goes through, and the turn-taker waiting on that
// slot's version is answered NotFound.
TEST_F(UcxControlPlaneTest, ConnectionsTakingTurnsRenewingForEverDoNotStopPublishes) {
  for (const int slots : {1, 2}) {
    SCOPED_TRACE(absl::StrFormat("staging_slots=%d", slots));
    port_ = testing::FreePort();
    versions_.clear();
    OpenPublisher(absl::StrFormat("staging_slots=%d&lease=50ms&lease_max_hold=200ms", slots));
    if (IsSkipped()) return;
    Publish(2);
    // One attacker per version held (version 2 alone in one slot, versions 1 and 2 in two), each
    // up to 400 connections (80 s of holds), one after the other.
    struct Attacker {
      uint64_t version;
      absl::Notification holding;  // its first grant
      absl::StatusCode ended = absl::StatusCode::kOk;
      std::thread thread;
    };
    std::vector<std::unique_ptr<Attacker>> attackers;
    for (uint64_t v = slots == 1 ? 2 : 1; v <= 2; ++v) {
      attackers.push_back(std::make_unique<Attacker>());
      attackers.back()->version = v;
    }
    std::atomic<bool> stop{false};
    auto take_turns = [&](Attacker& a) {
      // The previous turn's connection stays open (its lease not yet expired) until this turn
      // holds, so that the slot is never free in between.
      std::unique_ptr<HostileClient> previous;
      for (int turn = 0; turn < 400 && !stop.load(); ++turn) {
        auto next = std::make_unique<HostileClient>(port_);
        HostileClient& c = *next;
        if (!c.Greet("policy") || !c.Send(Wait(1, a.version, /*mode=*/1))) return;
        absl::StatusOr<Frame> f = c.Receive();
        if (!f.ok()) return;
        if (f->type == MsgType::kRefused) {
          Reader r(f->payload);
          r.U64();
          a.ended = static_cast<absl::StatusCode>(r.U32());
          return;
        }
        if (f->type != MsgType::kGrant) return;
        Reader g(f->payload);
        g.U64();
        const uint64_t lease = g.U64();
        if (!a.holding.HasBeenNotified()) a.holding.Notify();
        previous = std::move(next);
        while (!stop.load()) {  // renew until refused
          if (!c.Send(Writer(MsgType::kRenew).U64(lease).Finish())) return;
          absl::StatusOr<Frame> renewed = c.Receive();
          if (!renewed.ok()) return;
          Reader r(renewed->payload);
          r.U64();
          if (renewed->type == MsgType::kRenewed && r.U8() == 0) break;
        }
      }
    };
    for (auto& a : attackers) a->thread = std::thread([&, p = a.get()] { take_turns(*p); });
    bool all_hold = true;
    for (auto& a : attackers) all_hold &= a->holding.WaitForNotificationWithTimeout(kTimeout);
    const std::vector<testing::OwnedTensor> v3 = MakeVersion(17, 3, 1 << 16);
    const absl::Status published = pub_->Publish(3, Views(v3), {}, absl::Seconds(20));
    stop = true;
    for (auto& a : attackers) a->thread.join();
    ASSERT_TRUE(all_hold);
    ASSERT_TRUE(published.ok()) << published;
    // The oldest version's slot took version 3; its turn-taker learned that it is gone.
    EXPECT_EQ(attackers.front()->ended, absl::StatusCode::kNotFound);
    versions_.resize(4);
    versions_[3] = v3;
    ExpectHonestSubscriberReceives(3);
    pub_.reset();
  }
}

// Audit: "two connections sending partial frames grew the publisher by 1.4 GiB". A publisher
// accepts frames of at most kMaxRequestFrame from a subscriber and reads at most 1 MiB ahead:
// a header that claims more closes the connection before any of it is buffered.
TEST_F(UcxControlPlaneTest, PartialFramesClaimingAGigabyteAreRefusedUnbuffered) {
  OpenPublisher();
  if (IsSkipped()) return;
  const uint64_t before = Rss();
  const std::string chunk(kMiB, 'x');
  struct Case {
    bool greet;
    uint32_t declared;
  };
  // Each connection stays open (on this side) until RSS is read.
  std::vector<std::unique_ptr<HostileClient>> hostiles;
  for (const Case& c :
       {Case{false, kMaxFrame}, Case{true, kMaxFrame}, Case{true, kMaxRequestFrame + 1}}) {
    SCOPED_TRACE(absl::StrFormat("greeted %d, declared %d", c.greet, c.declared));
    auto& hostile = *hostiles.emplace_back(std::make_unique<HostileClient>(port_));
    ASSERT_TRUE(hostile.connected());
    if (c.greet) ASSERT_TRUE(hostile.Greet("policy"));
    std::string header(4, '\0');
    internal::StoreLe(c.declared, header.data());
    bool sent_all = hostile.Send(header);
    // Up to 256 MiB of the frame's body, until the publisher closes the connection.
    uint64_t sent = 0;
    while (sent_all && sent < 256 * kMiB) {
      sent_all = hostile.Send(chunk);
      if (sent_all) sent += chunk.size();
    }
    EXPECT_LT(sent, 256 * kMiB) << "the publisher took the whole partial frame";
  }
  const uint64_t after = Rss();
  std::printf("[ measured ] RSS %.1f MiB before, %.1f MiB after 3 partial-frame attacks\n",
              before / double(kMiB), after / double(kMiB));
  EXPECT_LT(after, before + 64 * kMiB);
  for (auto& hostile : hostiles) EXPECT_TRUE(hostile->ReadUntilClosed().ok());
  ExpectHonestSubscriberReceives(1);
}

// Audit: "1.3 MB of WAIT messages grew it by 460 MiB". A connection may keep 64 WAITs out and
// hold 64 leases; one asking for more is closed. Here 2 MiB of WAITs each for a version that
// exists (every one would be granted: a lease and a GRANT queued for a client that never reads)
// and 2 MiB of WAITs for a version that does not exist yet.
TEST_F(UcxControlPlaneTest, WaitFloodsAreBoundedAndTheirSenderIsClosed) {
  OpenPublisher();
  if (IsSkipped()) return;
  const uint64_t before = Rss();
  std::vector<std::unique_ptr<HostileClient>> hostiles;
  for (uint64_t version : {uint64_t{1}, uint64_t{1000}}) {
    SCOPED_TRACE(version);
    auto& hostile = *hostiles.emplace_back(std::make_unique<HostileClient>(port_));
    ASSERT_TRUE(hostile.Greet("policy"));
    std::string flood;
    for (uint64_t request = 1; flood.size() < 2 * kMiB; ++request) flood += Wait(request, version);
    (void)hostile.Send(flood);  // may fail part way: the publisher closes the connection
  }
  // A version published now would answer every pending WAIT of the second connection.
  Publish(1000);
  const uint64_t after = Rss();
  std::printf("[ measured ] RSS %.1f MiB before, %.1f MiB after 2 x 2 MiB of WAITs\n",
              before / double(kMiB), after / double(kMiB));
  EXPECT_LT(after, before + 64 * kMiB);
  for (auto& hostile : hostiles) {
    int frames = 0;
    EXPECT_TRUE(hostile->ReadUntilClosed(&frames).ok());
    EXPECT_LE(frames, 64) << "answers before the connection was closed";
  }
  ExpectHonestSubscriberReceives(1000);
}

// More than max_connections: the next subscriber is answered ResourceExhausted naming the
// setting, and served once a connection is gone.
TEST_F(UcxControlPlaneTest, OneConnectionTooManyIsResourceExhaustedNamingMaxConnections) {
  OpenPublisher("max_connections=2");
  if (IsSkipped()) return;
  auto first = Subscriber::Open(Uri());
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE((*first)->WaitForVersion(1, kTimeout).ok());
  std::optional<HostileClient> hostile(port_);
  ASSERT_TRUE(hostile->Greet("policy"));
  auto third = Subscriber::Open(Uri());
  ASSERT_TRUE(third.ok());
  auto refused = (*third)->WaitForVersion(1, kTimeout);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("max_connections"));
  EXPECT_THAT(refused.status().message(), HasSubstr("2 subscriber connections"));
  hostile.reset();
  // ResourceExhausted is retryable: once the publisher has seen the hostile connection close,
  // the retry is served.
  absl::StatusOr<std::unique_ptr<Update>> u = refused.status();
  for (const absl::Time end = absl::Now() + kTimeout;
       absl::IsResourceExhausted(u.status()) && absl::Now() < end;) {
    u = (*third)->WaitForVersion(1, kTimeout);
  }
  ASSERT_TRUE(u.ok()) << u.status();
  ExpectSameTensors(**u, versions_[1]);
}

// While this process's stderr goes to a file: the file's contents.
class CapturedStderr {
 public:
  CapturedStderr() : path_(dir_.path() + "/stderr") {
    std::fflush(stderr);
    saved_ = ::dup(STDERR_FILENO);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ::dup2(fd, STDERR_FILENO);
    ::close(fd);
  }
  ~CapturedStderr() { Restore(); }
  std::string Restore() {
    if (saved_ >= 0) {
      std::fflush(stderr);
      ::dup2(saved_, STDERR_FILENO);
      ::close(saved_);
      saved_ = -1;
    }
    return testing::ReadFileOrDie(path_);
  }

 private:
  testing::ScratchDir dir_;
  std::string path_;
  int saved_ = -1;
};

// Audit: "at the fd limit the publisher logs 'accept: Too many open files' at 2.2 MB/s". With
// every descriptor of this process taken and a connection waiting in the listen queue, the
// publisher backs off accept (its connected subscriber is served on: 20 versions bit-exact) and
// logs the failure once per 10 s; once descriptors are free again, it accepts the waiting
// connection and serves new subscribers.
TEST_F(UcxControlPlaneTest, AcceptAtTheFdLimitBacksOffLogsRateLimitedAndServesOn) {
  OpenPublisher();
  if (IsSkipped()) return;
  Publish(2);  // both staging slots exist before descriptors run out
  auto sub = Subscriber::Open(Uri());
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE((*sub)->WaitForVersion(2, kTimeout).ok());

  CapturedStderr captured;
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit low = old;
  low.rlim_cur = std::min<rlim_t>(old.rlim_cur, 4096);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> taken;
  for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) taken.push_back(fd);
  ASSERT_FALSE(taken.empty());
  ::close(taken.back());  // one for the connection that will wait in the listen queue
  taken.pop_back();
  const int waiting = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(waiting, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port_));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(waiting, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);

  const absl::Time start = absl::Now();
  for (uint64_t v = 3; v <= 22; ++v) {
    Publish(v);
    auto u = (*sub)->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ExpectSameTensors(**u, versions_[v]);
  }
  const absl::Duration held = absl::Now() - start;
  for (int fd : taken) ::close(fd);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  // The waiting connection is accepted once descriptors are back: the publisher greets it.
  Writer hello(MsgType::kHello);
  hello.Str(kMagic).U32(kProtocolVersion).Str("policy").U64(1).Str("waited in the queue");
  ControlStream late(internal::ucx::Fd(waiting), "the publisher");
  ASSERT_TRUE(late.Send(std::move(hello).Finish(), absl::Now() + kTimeout).ok());
  absl::StatusOr<Frame> welcome = late.Receive(absl::Now() + kTimeout);
  ASSERT_TRUE(welcome.ok()) << welcome.status();
  EXPECT_EQ(welcome->type, MsgType::kWelcome);
  ExpectHonestSubscriberReceives(22);

  const std::string log = captured.Restore();
  int lines = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    lines += absl::StrContains(line, "accept: Too many open files");
  }
  std::printf("[ measured ] %d accept-failure lines in %s at the fd limit (%d log bytes)\n", lines,
              absl::FormatDuration(held).c_str(), static_cast<int>(log.size()));
  EXPECT_GE(lines, 1) << log;
  // At most one line per 10 s (RateLimitedLog::kDefaultInterval), the first at once.
  EXPECT_LE(lines, 1 + absl::ToInt64Seconds(absl::Now() - start) / 10) << log.substr(0, 4000);
}

// The addresses ("192.0.2.2 port 40000") of the TCP sockets this process listens on, from
// /proc/self/net/tcp{,6} (the network namespace's sockets) and /proc/self/fd (this process's).
struct Listening {
  std::string address;
  bool loopback = false;
  int port = 0;
};
std::vector<Listening> ListeningSockets() {
  std::set<std::string> inodes;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d)) {
      char target[256] = {};
      const std::string link = std::string("/proc/self/fd/") + e->d_name;
      const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
      absl::string_view t(target, n > 0 ? n : 0);
      if (absl::ConsumePrefix(&t, "socket:[") && absl::ConsumeSuffix(&t, "]")) {
        inodes.emplace(t);
      }
    }
    ::closedir(d);
  }
  std::vector<Listening> out;
  for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
      if (f.size() < 10 || f[3] != "0A" || inodes.count(f[9]) == 0) continue;
      const std::vector<std::string> hostport = absl::StrSplit(f[1], ':');
      Listening l;
      l.port = std::stoi(hostport[1], nullptr, 16);
      char text[INET6_ADDRSTRLEN] = {};
      if (hostport[0].size() == 8) {
        in_addr a{static_cast<uint32_t>(std::stoul(hostport[0], nullptr, 16))};
        ::inet_ntop(AF_INET, &a, text, sizeof(text));
        l.loopback = (ntohl(a.s_addr) >> 24) == 127;
      } else {
        in6_addr a{};
        for (int w = 0; w < 4; ++w) {
          const uint32_t word =
              static_cast<uint32_t>(std::stoul(hostport[0].substr(w * 8, 8), nullptr, 16));
          std::memcpy(reinterpret_cast<char*>(&a) + w * 4, &word, 4);
        }
        ::inet_ntop(AF_INET6, &a, text, sizeof(text));
        l.loopback = IN6_IS_ADDR_LOOPBACK(&a);
      }
      l.address = text;
      out.push_back(l);
    }
  }
  return out;
}

// The non-loopback IPv4 addresses of this host's interfaces that are up ("192.0.2.2").
std::vector<std::string> ExternalIPv4Addresses() {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET ||
        (i->ifa_flags & IFF_LOOPBACK) != 0 || (i->ifa_flags & IFF_UP) == 0) {
      continue;
    }
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text,
                sizeof(text));
    out.emplace_back(text);
  }
  ::freeifaddrs(list);
  return out;
}

// Issue 17: "There is no default bind address". A URI that names no host (ucx://:PORT/p) is this
// machine's loopback: the rendezvous and UCX's own tcp listeners listen on loopback only, a
// connection to the port at any other address of this host is refused, and a subscriber given
// the same URI receives bit-exact.
TEST(UcxListenersTest, AUriWithoutAHostListensOnLoopbackOnly) {
  const testing::ScopedEnvs env({{"UCX_TLS", "tcp"}, {"UCX_NET_DEVICES", ""}});
  const int port = testing::FreePort();
  const std::string uri = absl::StrFormat("ucx://:%d/p", port);
  auto pub = Publisher::Open(uri);
  if (absl::IsUnavailable(pub.status())) GTEST_SKIP() << "UCX cannot run here: " << pub.status();
  ASSERT_TRUE(pub.ok()) << pub.status();
  const auto v1 = MakeVersion(3, 1, 1 << 14);
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  auto sub = Subscriber::Open(uri);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto u = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ExpectSameTensors(**u, v1);

  int rendezvous = 0, ucx_listeners = 0;
  for (const Listening& l : ListeningSockets()) {
    std::printf("[ measured ] %s: listening on %s port %d\n", uri.c_str(), l.address.c_str(),
                l.port);
    EXPECT_TRUE(l.loopback) << uri << " listens on " << l.address << " port " << l.port;
    if (l.port == port) {
      ++rendezvous;
    } else {
      ++ucx_listeners;
    }
  }
  EXPECT_EQ(rendezvous, 1) << "no listening socket on port " << port << ": nothing was checked";
  EXPECT_GT(ucx_listeners, 0) << "UCX's tcp opened no listener: nothing was checked";
  for (const std::string& external : ExternalIPv4Addresses()) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    ASSERT_EQ(::inet_pton(AF_INET, external.c_str(), &addr.sin_addr), 1) << external;
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    const int err = errno;
    ::close(fd);
    EXPECT_EQ(rc, -1) << "a connection to " << external << " port " << port << " was accepted";
    EXPECT_EQ(err, ECONNREFUSED) << external << ": " << std::strerror(err);
  }
}

// Issue 17: "a 0.0.0.0 publisher also opens UCX TCP listeners on every interface". With
// UCX_TLS=tcp and UCX_NET_DEVICES unset, UCX's tcp transport listens only on the channel's
// interfaces: loopback for a wildcard or loopback publisher, the address's own interface for a
// publisher on one address (and, for its subscriber, the interface it reaches that address
// from); the rendezvous listens where the URI says. Every listening socket of this process is
// checked while a version has just been received bit-exact.
TEST(UcxListenersTest, UcxTcpListensOnlyOnTheChannelsInterfaces) {
  const std::vector<std::string> externals = ExternalIPv4Addresses();
  const std::string external = externals.empty() ? "" : externals.front();
  if (external.empty()) {
    GTEST_SKIP() << "this host has no non-loopback IPv4 address: every listener is on loopback";
  }
  const testing::ScopedEnvs env({{"UCX_TLS", "tcp"}, {"UCX_NET_DEVICES", ""}});
  for (const std::string& host : {std::string("0.0.0.0"), std::string("127.0.0.1"), external}) {
    SCOPED_TRACE(host);
    const int port = testing::FreePort();
    auto pub = Publisher::Open(absl::StrFormat("ucx://%s:%d/p", host, port));
    if (absl::IsUnavailable(pub.status())) GTEST_SKIP() << "UCX cannot run here: " << pub.status();
    ASSERT_TRUE(pub.ok()) << pub.status();
    const auto v1 = MakeVersion(3, 1, 1 << 14);
    ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
    auto sub = Subscriber::Open(
        absl::StrFormat("ucx://%s:%d/p", host == "0.0.0.0" ? "127.0.0.1" : host, port));
    ASSERT_TRUE(sub.ok()) << sub.status();
    auto u = (*sub)->WaitForVersion(1, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ExpectSameTensors(**u, v1);
    int ucx_listeners = 0;
    for (const Listening& l : ListeningSockets()) {
      std::printf("[ measured ] %s: listening on %s port %d\n", host.c_str(), l.address.c_str(),
                  l.port);
      if (l.port == port) continue;  // the rendezvous
      ++ucx_listeners;
      EXPECT_TRUE(l.loopback || (host == external && l.address == external))
          << "UCX listens on " << l.address << " port " << l.port;
    }
    EXPECT_GT(ucx_listeners, 0) << "UCX's tcp opened no listener: nothing was checked";
  }
}

// Shared-secret channels. Secret files (mode 0600) in a scratch directory, named in the URI
// query (a path, never the secret).
class UcxSecretTest : public UcxControlPlaneTest {
 protected:
  void SetUp() override {
    UcxControlPlaneTest::SetUp();
    for (const auto& [path, secret] : {std::pair{key_, "the channel's real secret, 41 bytes long"},
                                       std::pair{other_key_, "another secret, long enough"}}) {
      testing::WriteFileOrDie(path, secret);
      ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
    }
  }
  std::string Secret(const std::string& key) const { return "secret_file=" + key; }

  // Frames the publisher sends `hostile` until it closes the connection, by type.
  static std::vector<MsgType> FramesUntilClosed(HostileClient& hostile) {
    std::vector<MsgType> types;
    while (true) {
      absl::StatusOr<Frame> f = hostile.Receive();
      if (!f.ok()) {
        EXPECT_TRUE(absl::IsUnavailable(f.status())) << f.status();  // closed, not timed out
        return types;
      }
      types.push_back(f->type);
    }
  }
  // The next frame is ERROR with `code`: its message.
  static std::string ExpectError(HostileClient& hostile, absl::StatusCode code) {
    absl::StatusOr<Frame> f = hostile.Receive();
    EXPECT_TRUE(f.ok()) << f.status();
    if (!f.ok()) return "";
    EXPECT_EQ(f->type, MsgType::kError);
    Reader r(f->payload);
    EXPECT_EQ(static_cast<absl::StatusCode>(r.U32()), code);
    return r.Str();
  }
  // Sends HELLO with a nonce; the publisher answers CHALLENGE.
  static void ExpectChallenged(HostileClient& hostile) {
    ASSERT_TRUE(hostile.Send(Hello(/*with_nonce=*/true)));
    absl::StatusOr<Frame> challenge = hostile.Receive();
    ASSERT_TRUE(challenge.ok()) << challenge.status();
    ASSERT_EQ(challenge->type, MsgType::kChallenge);
  }
  // A subscriber with the settings `query` is refused version 1 with PermissionDenied, its
  // message containing `why`, and holds nothing.
  void ExpectSubscriberRefused(const std::string& query, const std::string& why) {
    auto sub = Subscriber::Open(Uri(query));
    ASSERT_TRUE(sub.ok()) << sub.status();
    auto u = (*sub)->WaitForVersion(1, kTimeout);
    ASSERT_EQ(u.status().code(), absl::StatusCode::kPermissionDenied) << u.status();
    EXPECT_THAT(u.status().message(), HasSubstr(why));
    EXPECT_FALSE((*sub)->current_version().has_value());
  }
  static std::string Hello(bool with_nonce) {
    Writer hello(MsgType::kHello);
    hello.Str(kMagic).U32(kProtocolVersion).Str("policy").U64(0xbad).Str("a stranger");
    if (with_nonce) hello.Str(internal::AsText(internal::RandomNonce()));
    return std::move(hello).Finish();
  }

  testing::ScratchDir dir_;
  const std::string key_ = dir_ / "key";
  const std::string other_key_ = dir_ / "other_key";
};

TEST_F(UcxSecretTest, AuthenticatedPeersExchangeVersionsBitExact) {
  OpenPublisher(Secret(key_));
  if (IsSkipped()) return;
  auto sub = Subscriber::Open(Uri(Secret(key_)));
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto u = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ExpectSameTensors(**u, versions_[1]);
  EXPECT_TRUE(pub_->WaitForReceivers(1, 1, kTimeout).ok());
  Publish(2);
  auto u2 = (*sub)->WaitForVersion(2, kTimeout);
  ASSERT_TRUE(u2.ok()) << u2.status();
  ExpectSameTensors(**u2, versions_[2]);
}

// Over shared memory the grant carries rkeys: the same handshake guards them.
TEST_F(UcxSecretTest, AuthenticatedPeersExchangeVersionsBitExactOverSharedMemory) {
  env_.reset();
  env_.emplace(testing::kShm.env);
  OpenPublisher(Secret(key_));
  if (IsSkipped()) return;
  ExpectHonestSubscriberReceives(1, Secret(key_));
}

// The delta layer over ucx://: the handshake beneath, the MAC carried through keyframes and
// deltas.
TEST_F(UcxSecretTest, DeltaOverUcxWithASecretIsBitExact) {
  if (const std::string why = testing::MissingTransports({"delta", "ucx"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  const std::string uri = "delta+" + Uri(Secret(key_) + "&keyframe_interval=2");
  auto pub = Publisher::Open(uri);
  if (absl::IsUnavailable(pub.status())) GTEST_SKIP() << "UCX cannot run here: " << pub.status();
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = Subscriber::Open(uri);
  ASSERT_TRUE(sub.ok()) << sub.status();
  for (uint64_t v = 1; v <= 3; ++v) {  // keyframes and a delta
    const auto tensors = MakeVersion(9, v, 1 << 16);
    ASSERT_TRUE((*pub)->Publish(v, Views(tensors), {}, kTimeout).ok()) << v;
    auto u = (*sub)->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ASSERT_EQ((*u)->version(), v);
    ExpectSameTensors(**u, tensors);
  }
}

// The audit: "any process that reaches the rendezvous gets the manifest and the memory keys".
TEST_F(UcxSecretTest, AStrangerGetsNoManifestAndNoRkey) {
  OpenPublisher(Secret(key_));
  if (IsSkipped()) return;
  {  // No authentication at all: ERROR PermissionDenied, then the connection closes.
    HostileClient stranger(port_);
    ASSERT_TRUE(stranger.Send(Hello(/*with_nonce=*/false) + Wait(1, 1)));
    const std::string message = ExpectError(stranger, absl::StatusCode::kPermissionDenied);
    EXPECT_THAT(message, HasSubstr(absl::StrFormat("the publisher at port %d (", port_)));
    EXPECT_THAT(message, HasSubstr(") of channel \"policy\" requires the channel's shared "
                                   "secret: configure secret_file or secret_env"));
    EXPECT_THAT(FramesUntilClosed(stranger), ::testing::IsEmpty());
  }
  {  // A nonce, then a WAIT instead of the proof: closed, with no GRANT.
    HostileClient stranger(port_);
    ExpectChallenged(stranger);
    (void)stranger.Send(Wait(1, 1));
    EXPECT_THAT(FramesUntilClosed(stranger), ::testing::IsEmpty());
  }
  {  // A wrong proof: ERROR PermissionDenied, closed, with no WELCOME and no GRANT.
    HostileClient stranger(port_);
    ExpectChallenged(stranger);
    ASSERT_TRUE(
        stranger.Send(Writer(MsgType::kProof).Str(std::string(32, 'x')).Finish() + Wait(1, 1)));
    EXPECT_THAT(ExpectError(stranger, absl::StatusCode::kPermissionDenied),
                HasSubstr("refused this subscriber: its proof of the channel's shared "
                          "secret is wrong"));
    EXPECT_THAT(FramesUntilClosed(stranger), ::testing::IsEmpty());
  }
  // A subscriber without the secret hears why; honest subscribers are still served.
  ExpectSubscriberRefused("",
                          "of channel \"policy\" requires the channel's shared secret: "
                          "configure secret_file or secret_env");
  ExpectHonestSubscriberReceives(1, Secret(key_));
}

// The audit: "forged receipts satisfy --until-subscribers with no real subscriber".
TEST_F(UcxSecretTest, ReceiptsFromUnauthenticatedPeersDoNotCount) {
  OpenPublisher(Secret(key_));
  if (IsSkipped()) return;
  const std::string receipt = Writer(MsgType::kAccepted).U64(1).Finish();
  for (const bool with_nonce : {false, true}) {
    HostileClient stranger(port_);
    ASSERT_TRUE(stranger.Send(Hello(with_nonce) + receipt));
    (void)FramesUntilClosed(stranger);  // the publisher has handled both frames
  }
  const absl::Status none = pub_->WaitForReceivers(1, 1, absl::Milliseconds(300));
  ASSERT_EQ(none.code(), absl::StatusCode::kDeadlineExceeded) << none;
  EXPECT_THAT(none.message(), HasSubstr("0 of the 1 subscribers waited for had received "
                                        "version 1"));
  auto sub = Subscriber::Open(Uri(Secret(key_)));
  ASSERT_TRUE(sub.ok()) << sub.status();
  ASSERT_TRUE((*sub)->WaitForVersion(1, kTimeout).ok());
  EXPECT_TRUE(pub_->WaitForReceivers(1, 1, kTimeout).ok());
}

// The audit: "a process that binds the port first serves version 1,000,000". Subscribers with
// the secret refuse a publisher that cannot prove it, before any manifest.
TEST_F(UcxSecretTest, ASquatterOnThePortIsRefusedBySubscribers) {
  OpenPublisher();  // no secret
  if (IsSkipped()) return;
  ExpectSubscriberRefused(Secret(key_),
                          "did not authenticate itself with the channel's shared secret (WELCOME "
                          "without CHALLENGE: a publisher without the secret, or another process "
                          "on its port); refusing it");
  pub_.reset();
  OpenPublisher(Secret(other_key_));  // another secret
  if (IsSkipped()) return;
  ExpectSubscriberRefused(Secret(key_),
                          "failed to prove the channel's shared secret (a publisher with another "
                          "secret, or another process on its port); refusing it");
}

}  // namespace
}  // namespace weightbus

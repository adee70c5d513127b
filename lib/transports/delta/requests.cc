// SPDX-License-Identifier: Apache-2.0
// Keyframe requests: the delta layer's back channel (README.md, "A delta that cannot be
// applied"). A subscriber that cannot reconstruct a version (a damaged delta of the chain, a
// base the channel no longer holds) asks for a keyframe; the publisher looks for requests
// before each version and, finding one about its current chain, sends that version as a
// keyframe. Over disk:// a request is a small JSON file in the channel's delta-requests/
// directory (RequestBox), removed once answered; over a transport with a back channel of its
// own (ucx://: the KEYFRAME_REQUEST control message) it goes through that (BackChannel).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/logging.h"
#include "nlohmann/json.hpp"
#include "transports/delta/delta_transport.h"

namespace weightbus::internal::delta {
namespace {

constexpr char kRequestFormat[] = "weightbus.delta-request/1";
constexpr char kReportFormat[] = "weightbus.delta-report/1";
constexpr char kTmpPrefix[] = ".tmp-";
// Largest request file read (a request is a few hundred bytes; the reason is cut to fit).
constexpr size_t kMaxRequestFile = 16 << 10;
constexpr size_t kMaxReason = 2000;

// j[key] when it is a string, else `otherwise`. Not json::value(key, default), which throws
// type_error.302 when the key holds another type: these files and messages come from other
// processes, and a number where a string belongs must not end the publisher's process.
std::string StringField(const nlohmann::json& j, const char* key, const std::string& otherwise) {
  if (!j.is_object()) return otherwise;
  const auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : otherwise;
}

std::string HostName() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) return "unknown-host";
  return host;
}

// Calls fn(path, text) for each finished entry of the box `dir`: a `.json` regular file, not a
// temporary, with at most `max_bytes` of its text. symlink_status (not followed): a FIFO, whose
// open would block for ever, is passed over. No directory: no call.
template <typename Fn>
void ForEachBoxFile(const std::filesystem::path& dir, size_t max_bytes, Fn fn) {
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  // increment(ec), not a range-for: its operator++ throws on a read error, in the host process.
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::filesystem::directory_entry& e = *it;
    const std::string name = e.path().filename().string();
    if (absl::StartsWith(name, kTmpPrefix) || !absl::EndsWith(name, ".json")) continue;
    std::error_code type_ec;
    if (!std::filesystem::is_regular_file(e.symlink_status(type_ec))) continue;
    std::ifstream f(e.path(), std::ios::binary);
    std::string text(max_bytes, '\0');
    f.read(text.data(), static_cast<std::streamsize>(text.size()));
    text.resize(static_cast<size_t>(f.gcount()));
    fn(e.path(), std::move(text));
  }
}

}  // namespace

std::optional<RequestBox> RequestBox::ForUri(const Uri& uri) {
  const std::vector<std::string> schemes = absl::StrSplit(uri.scheme, '+');
  if (schemes.empty() || schemes.back() != "disk" || uri.path.empty() || uri.path == "/") {
    return std::nullopt;
  }
  std::string root = uri.path;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  return RequestBox(root);
}

RequestBox::RequestBox(std::string root)
    : root_(std::move(root)),
      dir_(root_ + "/" + std::string(kRequestDir)),
      report_dir_(root_ + "/" + std::string(kReportDir)) {
  std::random_device random;
  name_ = absl::StrFormat("%s-%d-%016x.json", HostName(), ::getpid(),
                          (uint64_t{random()} << 32) | random());
}

absl::Status RequestBox::Write(const std::string& dir, const std::string& text,
                               const char* what) const {
  struct stat root_stat;
  if (::stat(root_.c_str(), &root_stat) != 0) {
    return absl::NotFoundError(
        absl::StrFormat("%s: cannot stat the channel %s: %s", what, root_, std::strerror(errno)));
  }
  // The directory gets the channel's own permissions (owner-only, or group_access).
  if (::mkdir(dir.c_str(), root_stat.st_mode & 07777) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(
        absl::StrFormat("%s: cannot create %s: %s", what, dir, std::strerror(errno)));
  }
  const std::string tmp = absl::StrFormat("%s/%s%s", dir, kTmpPrefix, name_);
  const std::string path = absl::StrFormat("%s/%s", dir, name_);
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, root_stat.st_mode & 0666);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrFormat("%s: cannot write %s: %s", what, tmp, std::strerror(errno)));
  }
  const ssize_t wrote = ::write(fd, text.data(), text.size());
  ::close(fd);
  if (wrote != static_cast<ssize_t>(text.size()) || ::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return absl::InternalError(
        absl::StrFormat("%s: cannot write %s: %s", what, path, std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status RequestBox::Leave(uint64_t version, std::optional<uint64_t> holds,
                               std::string_view why) const {
  nlohmann::ordered_json j;
  j["format"] = kRequestFormat;
  j["version"] = version;
  if (holds) j["holds"] = *holds;
  j["host"] = HostName();
  j["pid"] = ::getpid();
  j["reason"] = std::string(why.substr(0, kMaxReason));
  return Write(dir_, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
               "keyframe request");
}

absl::Status RequestBox::Report(uint64_t version, std::string_view text) const {
  if (text.size() > kMaxReportText) {
    return absl::InvalidArgumentError(absl::StrFormat("report on version %d: %d bytes (at most %d)",
                                                      version, text.size(), kMaxReportText));
  }
  return Write(report_dir_, std::string(text), "report");
}

std::vector<SubscriberReport> RequestBox::Reports(uint64_t stale_before) const {
  std::vector<SubscriberReport> out;
  ForEachBoxFile(report_dir_, kMaxReportText,
                 [&](const std::filesystem::path& path, std::string text) {
                   absl::StatusOr<DecodingReport> report = DecodingReport::FromText(text);
                   if (!report.ok()) return;
                   if (report->version < stale_before) {
                     ::unlink(path.c_str());  // a subscriber gone (or silent) for that long
                     return;
                   }
                   out.push_back(SubscriberReport{path.string(), report->version, std::move(text)});
                 });
  return out;
}

std::vector<KeyframeRequest> RequestBox::Pending() const {
  std::vector<KeyframeRequest> out;
  ForEachBoxFile(dir_, kMaxRequestFile, [&](const std::filesystem::path& path, std::string text) {
    KeyframeRequest r;
    r.id = path.string();
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (StringField(j, "format", "") == kRequestFormat && j.contains("version") &&
        j["version"].is_number_unsigned()) {
      r.version = j["version"].get<uint64_t>();
      r.text = absl::StrFormat("%s (pid %s) cannot reconstruct version %d: %s",
                               StringField(j, "host", "?"),
                               j.contains("pid") ? j["pid"].dump() : std::string("?"), r.version,
                               StringField(j, "reason", ""));
    } else {
      // Not a request this library wrote: answered like any (a keyframe is never wrong).
      r.text = absl::StrFormat("%s (not a request of format %s)", r.id, kRequestFormat);
    }
    out.push_back(std::move(r));
  });
  return out;
}

void RequestBox::Remove(const std::vector<KeyframeRequest>& served) const {
  for (const KeyframeRequest& r : served) {
    if (::unlink(r.id.c_str()) != 0 && errno != ENOENT) {
      Log(LogLevel::kWarn, "cannot remove the answered keyframe request %s: %s", r.id,
          std::strerror(errno));
    }
  }
}

absl::Status BackChannel::Ask(TransportSubscriber& inner, uint64_t version,
                              std::optional<uint64_t> holds, std::string_view why) const {
  if (!enabled_) return absl::UnimplementedError("this reader asks for no keyframe");
  if (box_) return box_->Leave(version, holds, why);
  return inner.RequestKeyframe(version, holds, why);
}

std::vector<KeyframeRequest> BackChannel::Pending(TransportPublisher& inner) {
  if (!enabled_) return {};
  if (box_) return box_->Pending();
  for (KeyframeRequest& r : inner.TakeKeyframeRequests()) {
    auto same = std::find_if(held_.begin(), held_.end(),
                             [&](const KeyframeRequest& h) { return h.id == r.id; });
    if (same != held_.end()) {
      *same = std::move(r);  // the subscriber's newer request replaces its older one
    } else {
      held_.push_back(std::move(r));
    }
  }
  return held_;
}

void BackChannel::Answered(const std::vector<KeyframeRequest>& served) {
  if (box_) return box_->Remove(served);
  std::erase_if(held_, [&](const KeyframeRequest& h) {
    return std::any_of(served.begin(), served.end(), [&](const KeyframeRequest& s) {
      return s.id == h.id && s.version == h.version;
    });
  });
}

absl::Status BackChannel::Report(TransportSubscriber& inner, uint64_t version,
                                 std::string_view text) const {
  if (!enabled_) return absl::UnimplementedError("this reader reports nothing");
  if (box_) return box_->Report(version, text);
  return inner.Report(version, text);
}

std::vector<SubscriberReport> BackChannel::Reports(TransportPublisher& inner,
                                                   uint64_t stale_before) const {
  if (!enabled_) return {};
  if (box_) return box_->Reports(stale_before);
  return inner.TakeReports();
}

std::string DecodingReport::ToText() const {
  nlohmann::ordered_json j;
  j["format"] = kReportFormat;
  j["version"] = version;
  j["bytes"] = bytes;
  j["decode_s"] = decode_s;
  j["apply_s"] = apply_s;
  j["threads"] = threads;
  j["who"] = who.empty() ? absl::StrFormat("%s (pid %d)", HostName(), ::getpid()).substr(0, 200)
                         : who.substr(0, 200);
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

absl::StatusOr<DecodingReport> DecodingReport::FromText(std::string_view text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  const auto number = [&](const char* key) {
    return j.contains(key) && j[key].is_number() && j[key].get<double>() >= 0;
  };
  if (StringField(j, "format", "") != kReportFormat || !j.contains("version") ||
      !j["version"].is_number_unsigned() || !j.contains("bytes") ||
      !j["bytes"].is_number_unsigned() || !number("decode_s") || !number("apply_s")) {
    return absl::InvalidArgumentError(
        absl::StrFormat("not a report of format %s: %s", kReportFormat, text.substr(0, 200)));
  }
  DecodingReport r;
  r.version = j["version"].get<uint64_t>();
  r.bytes = j["bytes"].get<uint64_t>();
  r.decode_s = j["decode_s"].get<double>();
  r.apply_s = j["apply_s"].get<double>();
  if (j.contains("threads") && j["threads"].is_number_integer()) {
    r.threads = j["threads"].get<int>();
  }
  if (j.contains("who") && j["who"].is_string()) r.who = j["who"].get<std::string>();
  return r;
}

std::string BackChannel::Where() const {
  return box_ ? absl::StrCat("in ", box_->dir()) : std::string("over the transport beneath");
}

}  // namespace weightbus::internal::delta

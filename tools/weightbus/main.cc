// SPDX-License-Identifier: Apache-2.0
// The weightbus command-line tool: convert, publish, subscribe, inspect.
// Errors print one line ("weightbus: error: ...") and exit 1; usage errors (flags, CLI11 through
// weightbus/flags.h) print one line ("weightbus: usage error: ...") and exit 2.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "weightbus/checkpoint.h"
#include "weightbus/flags.h"
#include "weightbus/llama2c.h"
#include "weightbus/weightbus.hpp"
#include "xxhash.h"

namespace weightbus::tools {
namespace {

constexpr char kFooter[] = R"(
URIs: disk:///path/to/channel (settings as query parameters: disk:///x?retention=4)
      ucx://HOST:PORT/CHANNEL (the publisher serves the channel on HOST:PORT; [::1] for IPv6)
      delta+<transport>://... (the delta layer over a transport)
Durations: a number of seconds (0.5) or 500ms, 2s, 1m. `weightbus COMMAND --help` lists a
command's flags.)";

// "1.23 GB/s", or "-" when the time is too short to give a meaningful rate.
std::string Rate(uint64_t bytes, double seconds) {
  if (seconds < 1e-3) return "-";
  return absl::StrFormat("%.2f GB/s", bytes / 1e9 / seconds);
}

std::string HumanBytes(uint64_t b) {
  if (b >= (uint64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / double(1 << 30));
  if (b >= (uint64_t{1} << 20)) return absl::StrFormat("%.2f MiB", b / double(1 << 20));
  if (b >= 1024) return absl::StrFormat("%.1f KiB", b / 1024.0);
  return absl::StrFormat("%d B", b);
}

absl::StatusOr<std::map<std::string, std::string>> KeyValues(const std::vector<std::string>& kvs,
                                                             const char* flag) {
  std::map<std::string, std::string> out;
  for (const std::string& kv : kvs) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrFormat("--%s \"%s\" is not KEY=VALUE", flag, kv));
    }
    out[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return out;
}

struct ConvertFlags {
  std::string in, out;
  std::string dtype = "bf16";
};

absl::Status ConvertCommand(const ConvertFlags& flags) {
  const DType dtype = flags.dtype == "f32" ? DType::kF32 : DType::kBF16;  // checked by the flag
  const std::string& in = flags.in;
  const std::string& out = flags.out;
  absl::Status s = ConvertLlama2c(in, out, dtype);
  if (s.ok())
    std::printf("wrote %s/model.safetensors and %s/config.json\n", out.c_str(), out.c_str());
  return s;
}

struct PublishFlags {
  std::string uri, from;
  uint64_t version = 0;
  absl::Duration timeout = absl::Seconds(300);
  absl::Duration serve = absl::ZeroDuration();
  uint64_t until_subscribers = 0;
  std::vector<std::string> metadata, set;
};

absl::Status PublishCommand(const PublishFlags& flags) {
  absl::StatusOr<std::map<std::string, std::string>> options = KeyValues(flags.set, "set");
  if (!options.ok()) return options.status();
  absl::StatusOr<std::map<std::string, std::string>> metadata =
      KeyValues(flags.metadata, "metadata");
  if (!metadata.ok()) return metadata.status();

  absl::StatusOr<Checkpoint> ckpt = LoadCheckpoint(flags.from);
  if (!ckpt.ok()) return ckpt.status();
  const std::string& uri = flags.uri;
  absl::StatusOr<std::unique_ptr<Publisher>> publisher = Publisher::Open(uri, *options);
  if (!publisher.ok()) return publisher.status();
  absl::Status s = (*publisher)->Publish(flags.version, ckpt->tensors, *metadata, flags.timeout);
  if (!s.ok()) return s;
  const PublishStats st = (*publisher)->last_stats();
  if (st.unchanged) {
    std::printf("version %llu of %s already holds these %zu tensors (%s): nothing written\n",
                static_cast<unsigned long long>(flags.version), uri.c_str(), ckpt->tensors.size(),
                HumanBytes(st.bytes).c_str());
  } else {
    std::printf("published version %llu to %s: %zu tensors, %s in %.3f s (%s)\n",
                static_cast<unsigned long long>(flags.version), uri.c_str(), ckpt->tensors.size(),
                HumanBytes(st.bytes).c_str(), absl::ToDoubleSeconds(st.stall),
                Rate(st.bytes, absl::ToDoubleSeconds(st.stall)).c_str());
  }
  std::fflush(stdout);
  if (flags.until_subscribers > 0) {
    const absl::Time start = absl::Now();
    s = (*publisher)
            ->WaitForReceivers(flags.version, static_cast<int>(flags.until_subscribers),
                               flags.timeout);
    if (!s.ok()) return s;
    std::printf("%llu subscriber(s) hold version %llu (after %.3f s)\n",
                static_cast<unsigned long long>(flags.until_subscribers),
                static_cast<unsigned long long>(flags.version),
                absl::ToDoubleSeconds(absl::Now() - start));
    std::fflush(stdout);
  }
  if (flags.serve > absl::ZeroDuration()) {
    std::printf("serving version %llu for %s\n", static_cast<unsigned long long>(flags.version),
                absl::FormatDuration(flags.serve).c_str());
    std::fflush(stdout);
    absl::SleepFor(flags.serve);
  }
  return absl::OkStatus();
}

struct SubscribeFlags {
  std::string uri, to;
  uint64_t min_version = 0;
  absl::Duration timeout = absl::Seconds(60);
  bool follow = false;
  uint64_t count = 0;
  std::vector<std::string> set;
};

// The manifest of what `u` holds: its tensors as received (a group version's parts assembled
// into whole tensors, each with the XXH3-64 of its assembled bytes, owned by rank 0), with the
// version's number, publisher, times and metadata. For a single publisher's version, its own
// manifest (block checksums included).
absl::StatusOr<Manifest> AssembledManifest(const Update& u) {
  Manifest m = u.manifest();
  if (!m.group) return m;
  m.group = false;
  m.tensors.clear();
  for (const TensorView& t : u.tensors()) {
    absl::StatusOr<uint64_t> nbytes = ByteSize(t.dtype, t.shape);
    if (!nbytes.ok()) return nbytes.status();
    m.tensors.push_back(TensorInfo{t.name, t.dtype, t.shape, std::nullopt, *nbytes,
                                   XXH3_64bits(t.data, *nbytes), /*owner=*/0});
  }
  return m;
}

absl::Status SubscribeCommand(const SubscribeFlags& flags) {
  absl::StatusOr<std::map<std::string, std::string>> options = KeyValues(flags.set, "set");
  if (!options.ok()) return options.status();
  const bool follow = flags.follow;
  const std::string& dir = flags.to;
  const std::string& uri = flags.uri;

  absl::StatusOr<std::unique_ptr<Subscriber>> sub = Subscriber::Open(uri, *options);
  if (!sub.ok()) return sub.status();
  uint64_t received = 0;
  uint64_t want = flags.min_version;
  while (true) {
    absl::StatusOr<std::unique_ptr<Update>> update = (*sub)->WaitForVersion(want, flags.timeout);
    if (!update.ok()) {
      if (follow && received > 0 && absl::IsDeadlineExceeded(update.status())) {
        std::printf("no newer version within %s; stopping after %llu version(s)\n",
                    absl::FormatDuration(flags.timeout).c_str(),
                    static_cast<unsigned long long>(received));
        return absl::OkStatus();
      }
      return update.status();
    }
    const Update& u = **update;
    absl::StatusOr<Manifest> manifest = AssembledManifest(u);  // what the directory holds
    if (!manifest.ok()) return manifest.status();
    absl::Status s = SaveCheckpoint(dir, u.tensors(), &*manifest);
    if (!s.ok()) return s;
    const UpdateStats& st = u.stats();
    const double fetch_s =
        absl::ToDoubleSeconds(st.allocate + st.fetch + st.verify_wait + st.copy_out);
    std::printf(
        "version %llu: %zu tensors, %s, waited %.3f s, received and verified in %.3f s "
        "(%s); wrote %s/model.safetensors\n",
        static_cast<unsigned long long>(u.version()), u.tensors().size(),
        HumanBytes(st.bytes).c_str(), absl::ToDoubleSeconds(st.wait), fetch_s,
        Rate(st.bytes, fetch_s).c_str(), dir.c_str());
    std::fflush(stdout);
    ++received;
    if (!follow || (flags.count > 0 && received >= flags.count)) return absl::OkStatus();
    if (u.version() == std::numeric_limits<uint64_t>::max()) {
      std::printf("version %llu is the last possible one; stopping\n",
                  static_cast<unsigned long long>(u.version()));
      return absl::OkStatus();
    }
    want = u.version() + 1;
  }
}

// One tensor row for `inspect`.
struct Row {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes;
  uint64_t xxh3;
  std::string note;  // e.g. a checksum that differs from the manifest's
};

void PrintRows(const std::string& title, const std::vector<Row>& rows, const Metadata& metadata,
               nlohmann::ordered_json* json) {
  uint64_t total = 0;
  for (const Row& r : rows) total += r.nbytes;
  if (json != nullptr) {
    nlohmann::ordered_json j;
    j["source"] = title;
    j["total_bytes"] = total;
    j["metadata"] = metadata;
    j["tensors"] = nlohmann::ordered_json::array();
    for (const Row& r : rows) {
      nlohmann::ordered_json t = {{"name", r.name},
                                  {"dtype", std::string(DTypeName(r.dtype))},
                                  {"shape", r.shape},
                                  {"nbytes", r.nbytes},
                                  {"xxh3", absl::StrFormat("%016x", r.xxh3)}};
      if (!r.note.empty()) t["problem"] = r.note;
      j["tensors"].push_back(std::move(t));
    }
    json->push_back(std::move(j));
    return;
  }
  std::printf("# %s: %zu tensors, %llu bytes (%s)\n", title.c_str(), rows.size(),
              static_cast<unsigned long long>(total), HumanBytes(total).c_str());
  for (const auto& [k, v] : metadata) std::printf("#   metadata %s = %s\n", k.c_str(), v.c_str());
  std::printf("%-16s  %-8s  %-20s  %14s  %s\n", "# xxh3", "dtype", "shape", "bytes", "name");
  for (const Row& r : rows) {
    std::printf("%016llx  %-8s  %-20s  %14llu  %s%s\n", static_cast<unsigned long long>(r.xxh3),
                std::string(DTypeName(r.dtype)).c_str(), ShapeString(r.shape).c_str(),
                static_cast<unsigned long long>(r.nbytes), r.name.c_str(),
                r.note.empty() ? "" : ("  <-- " + r.note).c_str());
  }
}

// Inspects a safetensors file or checkpoint directory, computing every checksum. When the
// directory holds a weightbus manifest, its metadata is shown and every tensor is checked
// against it; a mismatch is reported in the row and makes the command fail.
absl::Status InspectCheckpoint(const std::string& path, const std::string& title,
                               nlohmann::ordered_json* json) {
  absl::StatusOr<Checkpoint> ckpt = LoadCheckpoint(path);
  if (!ckpt.ok()) return ckpt.status();
  std::optional<Manifest> manifest;
  absl::Status pairing;
  const std::string manifest_path = path + "/weightbus.manifest.json";
  std::error_code ec;  // the error_code overloads: a path the OS refuses is "not there", no throw
  if (std::filesystem::is_directory(path, ec) && std::filesystem::exists(manifest_path, ec)) {
    std::ifstream in(manifest_path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    absl::StatusOr<Manifest> m = Manifest::FromJson(text.str(), manifest_path);
    if (!m.ok()) return m.status();
    manifest = *std::move(m);
    // A model written by `subscribe --to` names the manifest it belongs to.
    for (size_t k = 0; k < ckpt->files.size(); ++k) {
      absl::Status s = VerifyCheckpointPair(ckpt->files[k].header, ckpt->file_paths[k], text.str(),
                                            manifest_path, manifest->version);
      if (!s.ok() && pairing.ok()) pairing = s;
    }
  }
  std::vector<Row> rows;
  int problems = 0;
  for (const safetensors::File& f : ckpt->files) {
    for (const safetensors::Entry& e : f.header.tensors) {
      std::span<const std::byte> b = f.Bytes(e);
      Row row{e.name, e.dtype, e.shape, e.nbytes(), XXH3_64bits(b.data(), b.size()), ""};
      if (manifest) {
        const TensorInfo* t = manifest->Find(e.name);
        if (t == nullptr) {
          row.note = "not in the manifest";
        } else if (t->xxh3 != row.xxh3) {
          row.note = absl::StrFormat("manifest says xxh3 %016x", t->xxh3);
        }
        problems += !row.note.empty();
      }
      rows.push_back(std::move(row));
    }
  }
  Metadata md = manifest ? manifest->metadata
                         : (ckpt->files.empty() ? Metadata() : ckpt->files[0].header.metadata);
  PrintRows(title.empty() ? absl::StrJoin(ckpt->file_paths, ", ") : title, rows, md, json);
  if (!pairing.ok()) return pairing;
  if (problems > 0) {
    return absl::DataLossError(absl::StrFormat("%s: %d tensor(s) do not match the manifest %s",
                                               path, problems, manifest_path));
  }
  return absl::OkStatus();
}

struct InspectFlags {
  std::string target;
  bool json = false;
  absl::Duration timeout = absl::Seconds(10);
};

absl::Status InspectCommand(const InspectFlags& flags) {
  const std::string& target = flags.target;
  nlohmann::ordered_json json = nlohmann::ordered_json::array();
  nlohmann::ordered_json* out = flags.json ? &json : nullptr;

  if (target.find("://") != std::string::npos) {
    absl::StatusOr<std::unique_ptr<Subscriber>> sub = Subscriber::Open(target);
    if (!sub.ok()) return sub.status();
    absl::StatusOr<std::unique_ptr<Update>> u = (*sub)->WaitForVersion(0, flags.timeout);
    if (!u.ok()) return u.status();
    // A group version's tensors as subscribers receive them (assembled), not its parts.
    absl::StatusOr<Manifest> manifest = AssembledManifest(**u);
    if (!manifest.ok()) return manifest.status();
    std::vector<Row> rows;
    for (const TensorInfo& t : manifest->tensors) {
      rows.push_back(Row{t.name, t.dtype, t.shape, t.nbytes, t.xxh3, ""});
    }
    PrintRows(absl::StrFormat("%s version %d (newest, verified)", target, (*u)->version()), rows,
              (*u)->manifest().metadata, out);
  } else if (std::error_code ec; std::filesystem::exists(target + "/LATEST", ec) &&
                                 std::filesystem::is_directory(target + "/versions", ec)) {
    // A disk channel directory (docs/FORMAT.md): its committed versions, newest last.
    // LATEST must be a regular file (a directory opens, but reading it fails). Read through the
    // stream, which turns a read error into its state (istreambuf_iterator would let
    // std::ios_base::failure escape); an empty or unreadable LATEST then fails the number check.
    if (!std::filesystem::is_regular_file(target + "/LATEST", ec)) {
      return absl::DataLossError(absl::StrFormat(
          "%s/LATEST is not a regular file (a disk channel's LATEST holds its newest version "
          "number)",
          target));
    }
    std::ifstream in(target + "/LATEST");
    std::ostringstream read;
    read << in.rdbuf();
    const std::string text = read.str();
    uint64_t latest = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &latest)) {
      return absl::DataLossError(absl::StrFormat(
          "%s/LATEST holds \"%s\", which is not a version number", target, absl::CHexEscape(text)));
    }
    std::vector<std::pair<uint64_t, std::string>> versions;
    std::filesystem::directory_iterator it(target + "/versions", ec);
    for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
      const std::string name = it->path().filename().string();
      uint64_t v = 0;
      if (name.size() == 21 && name[0] == 'v' && absl::SimpleAtoi(name.substr(1), &v)) {
        versions.emplace_back(v, name);
      }
    }
    if (ec) {
      return absl::UnavailableError(
          absl::StrFormat("%s/versions cannot be listed: %s", target, ec.message()));
    }
    std::sort(versions.begin(), versions.end());
    if (out == nullptr) {
      std::printf("# channel %s: latest committed version %llu\n", target.c_str(),
                  static_cast<unsigned long long>(latest));
    }
    absl::Status worst;
    // What subscribers require of committed versions (docs/FORMAT.md): the newest exists, and
    // each has its manifest and reader lock; otherwise they fail with DataLoss, and so does this.
    if (std::none_of(versions.begin(), versions.end(),
                     [&](const auto& e) { return e.first == latest; })) {
      worst = absl::DataLossError(
          absl::StrFormat("%s: LATEST names version %d but its directory %s/versions/v%020d is "
                          "missing",
                          target, latest, target, latest));
    }
    for (const auto& [v, name] : versions) {
      const std::string dir = target + "/versions/" + name;
      if (v > latest) {
        if (out == nullptr) {
          std::printf("# %s: not committed (above LATEST; left by a crashed publisher)\n",
                      dir.c_str());
        }
        continue;
      }
      absl::Status s;
      for (const char* required : {"weightbus.manifest.json", ".readers.lock"}) {
        const std::string file = dir + "/" + required;
        std::error_code missing;
        if (s.ok() && !std::filesystem::exists(std::filesystem::symlink_status(file, missing))) {
          s = absl::DataLossError(absl::StrFormat(
              "committed version %d is incomplete: %s is missing (subscribers refuse it)", v,
              file));
        }
      }
      if (s.ok()) s = InspectCheckpoint(dir, absl::StrFormat("version %d (%s)", v, dir), out);
      if (!s.ok() && worst.ok()) worst = s;
    }
    if (out != nullptr) std::printf("%s\n", json.dump(1).c_str());
    return worst;
  } else {
    absl::Status s = InspectCheckpoint(target, "", out);
    if (out != nullptr) std::printf("%s\n", json.dump(1).c_str());
    return s;
  }
  if (out != nullptr) std::printf("%s\n", json.dump(1).c_str());
  return absl::OkStatus();
}

absl::Status SettingsCommand() {
  std::printf("%-6s %-16s %-22s %-8s %-30s %s\n", "# scope", "name", "type", "default", "env",
              "meaning");
  for (const SettingInfo& s : DescribeSettings()) {
    std::printf("%-7s %-16s %-22s %-8s %-30s %s\n", s.scope.c_str(), s.name.c_str(), s.type.c_str(),
                s.default_value.c_str(), s.env.c_str(), s.doc.c_str());
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  Command app("weightbus", "weightbus: convert, publish, subscribe and inspect model weights.");
  app.Footer(kFooter);
  app.RequireSubcommands(0, 1);
  bool show_version = false;
  app.AddSwitch("version", &show_version,
                "print the library version and the transports compiled in, one per line");

  ConvertFlags convert;
  Command& convert_cmd =
      app.AddSubcommand("convert-llama2c", "llama2.c checkpoint -> Hugging Face safetensors");
  convert_cmd.Footer(
      "\nWrites OUT_DIR/model.safetensors and OUT_DIR/config.json (Hugging Face Llama names and\n"
      "layout).");
  convert_cmd.AddPositional("IN", &convert.in, "llama2.c checkpoint (.bin)").Required();
  convert_cmd.AddPositional("OUT_DIR", &convert.out, "directory to write").Required();
  convert_cmd.Add("dtype", &convert.dtype, "dtype of the written tensors").OneOf({"bf16", "f32"});

  PublishFlags publish;
  Command& publish_cmd = app.AddSubcommand("publish", "publish a checkpoint as version N");
  publish_cmd.Footer(
      "\nPublishes a safetensors file or Hugging Face directory as version N. Transports that\n"
      "serve versions from the publisher's process (ucx://) keep serving until --serve elapses\n"
      "or, with --until-subscribers K, until K subscribers hold the version (at most --timeout).");
  publish_cmd.AddPositional("URI", &publish.uri, "channel URI").Required();
  publish_cmd.Add("from", &publish.from, "safetensors file or checkpoint directory").Required();
  publish_cmd.Add("version", &publish.version, "the version number to publish").Required();
  publish_cmd.AddDuration("timeout", &publish.timeout,
                          "how long publishing (and --until-subscribers) may take");
  publish_cmd.AddRepeated("metadata", &publish.metadata, "metadata of the version (repeatable)")
      .TypeName("K=V")
      .KeyValue();
  publish_cmd
      .AddRepeated("set", &publish.set,
                   "a channel setting (repeatable; `weightbus settings` lists them)")
      .TypeName("K=V")
      .KeyValue();
  publish_cmd.AddDuration("serve", &publish.serve,
                          "keep serving the version this long after publishing");
  publish_cmd
      .Add("until-subscribers", &publish.until_subscribers,
           "wait until this many subscribers hold the version (0: do not wait; at most 1000000)")
      .InRange(0, 1000000);

  SubscribeFlags subscribe;
  Command& subscribe_cmd =
      app.AddSubcommand("subscribe", "receive the newest version into a directory");
  subscribe_cmd.Footer(
      "\nReceives the newest version >= --min-version and writes it to DIR/model.safetensors\n"
      "(with DIR/weightbus.manifest.json); --follow keeps receiving newer versions until none\n"
      "comes within the timeout or --count versions were received. Each file is replaced\n"
      "atomically, the model first; the model's metadata names its manifest (weightbus.version,\n"
      "weightbus.manifest_xxh3), so `inspect DIR` detects a pair left by an interrupted write.");
  subscribe_cmd.AddPositional("URI", &subscribe.uri, "channel URI").Required();
  subscribe_cmd.Add("to", &subscribe.to, "directory to write the model to").Required();
  subscribe_cmd.Add("min-version", &subscribe.min_version, "the oldest version to accept");
  subscribe_cmd.AddDuration("timeout", &subscribe.timeout, "how long to wait per version");
  subscribe_cmd.AddSwitch("follow", &subscribe.follow, "keep receiving newer versions");
  subscribe_cmd.Add("count", &subscribe.count,
                    "with --follow: stop after this many versions (0: no limit)");
  subscribe_cmd.AddRepeated("set", &subscribe.set, "a channel setting (repeatable)")
      .TypeName("K=V")
      .KeyValue();

  InspectFlags inspect;
  Command& inspect_cmd =
      app.AddSubcommand("inspect", "list the tensors and checksums of a checkpoint or channel");
  inspect_cmd.Footer(
      "\nLists versions, tensors, dtypes, shapes, bytes and XXH3-64 checksums of a safetensors\n"
      "file, a checkpoint directory, a disk channel directory, or a channel URI.");
  inspect_cmd.AddPositional("PATH_OR_URI", &inspect.target, "what to inspect").Required();
  inspect_cmd.AddSwitch("json", &inspect.json, "print JSON instead of a table");
  inspect_cmd.AddDuration("timeout", &inspect.timeout, "for a URI: how long to wait for a version");

  Command& settings_cmd = app.AddSubcommand(
      "settings", "every setting with its type, default, environment variable and meaning");

  if (std::optional<int> exit_status = app.Parse(argc, argv)) return *exit_status;
  absl::Status status;
  if (convert_cmd.given()) {
    status = ConvertCommand(convert);
  } else if (publish_cmd.given()) {
    status = PublishCommand(publish);
  } else if (subscribe_cmd.given()) {
    status = SubscribeCommand(subscribe);
  } else if (inspect_cmd.given()) {
    status = InspectCommand(inspect);
  } else if (settings_cmd.given()) {
    status = SettingsCommand();
  } else if (show_version) {
    std::printf("weightbus %s\n", std::string(LibraryVersion()).c_str());
    for (const std::string& t : Transports()) std::printf("%s\n", t.c_str());
    return 0;
  } else {
    std::fputs(app.Help().c_str(), stderr);
    return kUsageExitStatus;
  }
  if (!status.ok()) {
    std::string message(status.message());
    for (char& c : message) {
      if (c == '\n') c = ' ';
    }
    std::fprintf(stderr, "weightbus: error: %s [%s]\n", message.c_str(),
                 absl::StatusCodeToString(status.code()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace weightbus::tools

int main(int argc, char** argv) { return weightbus::tools::Main(argc, argv); }

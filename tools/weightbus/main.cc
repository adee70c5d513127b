// SPDX-License-Identifier: Apache-2.0
// The weightbus command-line tool: convert, publish, subscribe, inspect.
// Errors print one line ("weightbus: error: ...") and exit 1; usage errors exit 2.
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
#include "weightbus/args.h"
#include "weightbus/checkpoint.h"
#include "weightbus/llama2c.h"
#include "weightbus/weightbus.hpp"
#include "xxhash.h"

namespace weightbus::tools {
namespace {

constexpr char kUsage[] = R"(usage: weightbus <command> [args]

commands:
  convert-llama2c IN.bin OUT_DIR [--dtype bf16|f32]
      Convert a llama2.c checkpoint to OUT_DIR/model.safetensors + config.json
      (Hugging Face Llama names and layout).
  publish URI --from PATH --version N [--timeout SECONDS] [--metadata K=V]... [--set K=V]...
          [--serve SECONDS] [--until-subscribers K]
      Publish a safetensors file or Hugging Face directory as version N. Transports that serve
      versions from the publisher's process (ucx://) keep serving until --serve SECONDS elapse
      or, with --until-subscribers K, until K subscribers hold the version (at most --timeout).
  subscribe URI --to DIR [--min-version N] [--timeout SECONDS] [--follow] [--count N]
            [--set K=V]...
      Receive the newest version >= N and write it to DIR/model.safetensors (with
      DIR/weightbus.manifest.json); --follow keeps receiving newer versions until none comes
      within the timeout or --count versions were received. Each file is replaced atomically,
      the model first; the model's metadata names its manifest (weightbus.version,
      weightbus.manifest_xxh3), so `inspect DIR` detects a pair left by an interrupted write.
  inspect PATH_OR_URI [--json] [--timeout SECONDS]
      List versions, tensors, dtypes, shapes, bytes and XXH3-64 checksums of a safetensors
      file, a checkpoint directory, a disk channel directory, or a channel URI.
  settings
      Every setting with its type, default, environment variable and meaning.
  --version
      The library version and the transports compiled in, one per line.

URIs: disk:///path/to/channel (settings as query parameters: disk:///x?retention=4)
      ucx://HOST:PORT/CHANNEL (the publisher serves the channel on HOST:PORT; [::1] for IPv6)
)";

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

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

// Parses a subcommand's arguments; throws UsageError (exit 2) when they do not fit.
Args ParseOrUsage(const std::vector<std::string>& argv, const std::vector<FlagSpec>& specs,
                  size_t positionals, const char* command) {
  absl::StatusOr<Args> args = Args::Parse(argv, specs);
  if (!args.ok()) throw UsageError(absl::StrFormat("%s: %s", command, args.status().message()));
  if (args->positional().size() != positionals) {
    throw UsageError(absl::StrFormat("%s takes %d argument(s), got %d", command, positionals,
                                     args->positional().size()));
  }
  return *std::move(args);
}

absl::Status ConvertCommand(const std::vector<std::string>& argv) {
  const Args args =
      ParseOrUsage(argv, {{"dtype", true, false, "bf16 or f32"}}, 2, "convert-llama2c");
  const std::string dtype_name = args.Get("dtype").value_or("bf16");
  DType dtype;
  if (dtype_name == "bf16") {
    dtype = DType::kBF16;
  } else if (dtype_name == "f32") {
    dtype = DType::kF32;
  } else {
    return absl::InvalidArgumentError(
        absl::StrFormat("--dtype \"%s\" is not bf16 or f32", dtype_name));
  }
  const std::string& in = args.positional()[0];
  const std::string& out = args.positional()[1];
  absl::Status s = ConvertLlama2c(in, out, dtype);
  if (s.ok())
    std::printf("wrote %s/model.safetensors and %s/config.json\n", out.c_str(), out.c_str());
  return s;
}

absl::Status PublishCommand(const std::vector<std::string>& argv) {
  const Args args = ParseOrUsage(argv,
                                 {{"from", true, false, ""},
                                  {"version", true, false, ""},
                                  {"timeout", true, false, ""},
                                  {"metadata", true, true, ""},
                                  {"set", true, true, ""},
                                  {"serve", true, false, ""},
                                  {"until-subscribers", true, false, ""}},
                                 1, "publish");
  if (!args.Has("from") || !args.Has("version")) {
    throw UsageError("publish needs --from PATH and --version N");
  }
  absl::StatusOr<uint64_t> version = args.GetUint("version", 0);
  if (!version.ok()) return version.status();
  absl::StatusOr<absl::Duration> timeout = args.GetSeconds("timeout", absl::Seconds(300));
  if (!timeout.ok()) return timeout.status();
  absl::StatusOr<absl::Duration> serve = args.GetSeconds("serve", absl::ZeroDuration());
  if (!serve.ok()) return serve.status();
  absl::StatusOr<uint64_t> until = args.GetUint("until-subscribers", 0);
  if (!until.ok()) return until.status();
  if (*until > 1000000) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--until-subscribers %d is not a plausible number of subscribers", *until));
  }
  absl::StatusOr<std::map<std::string, std::string>> options = KeyValues(args.GetAll("set"), "set");
  if (!options.ok()) return options.status();
  absl::StatusOr<std::map<std::string, std::string>> metadata =
      KeyValues(args.GetAll("metadata"), "metadata");
  if (!metadata.ok()) return metadata.status();

  absl::StatusOr<Checkpoint> ckpt = LoadCheckpoint(*args.Get("from"));
  if (!ckpt.ok()) return ckpt.status();
  const std::string& uri = args.positional()[0];
  absl::StatusOr<std::unique_ptr<Publisher>> publisher = Publisher::Open(uri, *options);
  if (!publisher.ok()) return publisher.status();
  absl::Status s = (*publisher)->Publish(*version, ckpt->tensors, *metadata, *timeout);
  if (!s.ok()) return s;
  const PublishStats st = (*publisher)->last_stats();
  if (st.unchanged) {
    std::printf("version %llu of %s already holds these %zu tensors (%s): nothing written\n",
                static_cast<unsigned long long>(*version), uri.c_str(), ckpt->tensors.size(),
                HumanBytes(st.bytes).c_str());
  } else {
    std::printf("published version %llu to %s: %zu tensors, %s in %.3f s (%s)\n",
                static_cast<unsigned long long>(*version), uri.c_str(), ckpt->tensors.size(),
                HumanBytes(st.bytes).c_str(), absl::ToDoubleSeconds(st.stall),
                Rate(st.bytes, absl::ToDoubleSeconds(st.stall)).c_str());
  }
  std::fflush(stdout);
  if (*until > 0) {
    const absl::Time start = absl::Now();
    s = (*publisher)->WaitForReceivers(*version, static_cast<int>(*until), *timeout);
    if (!s.ok()) return s;
    std::printf("%llu subscriber(s) hold version %llu (after %.3f s)\n",
                static_cast<unsigned long long>(*until), static_cast<unsigned long long>(*version),
                absl::ToDoubleSeconds(absl::Now() - start));
    std::fflush(stdout);
  }
  if (*serve > absl::ZeroDuration()) {
    std::printf("serving version %llu for %s\n", static_cast<unsigned long long>(*version),
                absl::FormatDuration(*serve).c_str());
    std::fflush(stdout);
    absl::SleepFor(*serve);
  }
  return absl::OkStatus();
}

absl::Status SubscribeCommand(const std::vector<std::string>& argv) {
  const Args args = ParseOrUsage(argv,
                                 {{"to", true, false, ""},
                                  {"min-version", true, false, ""},
                                  {"timeout", true, false, ""},
                                  {"follow", false, false, ""},
                                  {"count", true, false, ""},
                                  {"set", true, true, ""}},
                                 1, "subscribe");
  if (!args.Has("to")) throw UsageError("subscribe needs --to DIR");
  absl::StatusOr<uint64_t> min_version = args.GetUint("min-version", 0);
  if (!min_version.ok()) return min_version.status();
  absl::StatusOr<uint64_t> count = args.GetUint("count", 0);
  if (!count.ok()) return count.status();
  absl::StatusOr<absl::Duration> timeout = args.GetSeconds("timeout", absl::Seconds(60));
  if (!timeout.ok()) return timeout.status();
  absl::StatusOr<std::map<std::string, std::string>> options = KeyValues(args.GetAll("set"), "set");
  if (!options.ok()) return options.status();
  const bool follow = args.Has("follow");
  const std::string dir = *args.Get("to");
  const std::string& uri = args.positional()[0];

  absl::StatusOr<std::unique_ptr<Subscriber>> sub = Subscriber::Open(uri, *options);
  if (!sub.ok()) return sub.status();
  uint64_t received = 0;
  uint64_t want = *min_version;
  while (true) {
    absl::StatusOr<std::unique_ptr<Update>> update = (*sub)->WaitForVersion(want, *timeout);
    if (!update.ok()) {
      if (follow && received > 0 && absl::IsDeadlineExceeded(update.status())) {
        std::printf("no newer version within %s; stopping after %llu version(s)\n",
                    absl::FormatDuration(*timeout).c_str(),
                    static_cast<unsigned long long>(received));
        return absl::OkStatus();
      }
      return update.status();
    }
    const Update& u = **update;
    absl::Status s = SaveCheckpoint(dir, u.tensors(), &u.manifest());
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
    if (!follow || (*count > 0 && received >= *count)) return absl::OkStatus();
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
  if (std::filesystem::is_directory(path) && std::filesystem::exists(manifest_path)) {
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

absl::Status InspectCommand(const std::vector<std::string>& argv) {
  const Args args =
      ParseOrUsage(argv, {{"json", false, false, ""}, {"timeout", true, false, ""}}, 1, "inspect");
  absl::StatusOr<absl::Duration> timeout = args.GetSeconds("timeout", absl::Seconds(10));
  if (!timeout.ok()) return timeout.status();
  const std::string target = args.positional()[0];
  nlohmann::ordered_json json = nlohmann::ordered_json::array();
  nlohmann::ordered_json* out = args.Has("json") ? &json : nullptr;

  if (target.find("://") != std::string::npos) {
    absl::StatusOr<std::unique_ptr<Subscriber>> sub = Subscriber::Open(target);
    if (!sub.ok()) return sub.status();
    absl::StatusOr<std::unique_ptr<Update>> u = (*sub)->WaitForVersion(0, *timeout);
    if (!u.ok()) return u.status();
    std::vector<Row> rows;
    for (const TensorInfo& t : (*u)->manifest().tensors) {
      rows.push_back(Row{t.name, t.dtype, t.shape, t.nbytes, t.xxh3, ""});
    }
    PrintRows(absl::StrFormat("%s version %d (newest, verified)", target, (*u)->version()), rows,
              (*u)->manifest().metadata, out);
  } else if (std::filesystem::exists(target + "/LATEST") &&
             std::filesystem::is_directory(target + "/versions")) {
    // A disk channel directory (docs/FORMAT.md): its committed versions, newest last.
    std::ifstream in(target + "/LATEST");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    uint64_t latest = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &latest)) {
      return absl::DataLossError(absl::StrFormat(
          "%s/LATEST holds \"%s\", which is not a version number", target, absl::CHexEscape(text)));
    }
    std::vector<std::pair<uint64_t, std::string>> versions;
    for (const auto& e : std::filesystem::directory_iterator(target + "/versions")) {
      const std::string name = e.path().filename().string();
      uint64_t v = 0;
      if (name.size() == 21 && name[0] == 'v' && absl::SimpleAtoi(name.substr(1), &v)) {
        versions.emplace_back(v, name);
      }
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
        if (s.ok() && !std::filesystem::exists(std::filesystem::symlink_status(file))) {
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

absl::Status SettingsCommand(const std::vector<std::string>& argv) {
  ParseOrUsage(argv, {}, 0, "settings");
  std::printf("%-6s %-16s %-22s %-8s %-30s %s\n", "# scope", "name", "type", "default", "env",
              "meaning");
  for (const SettingInfo& s : DescribeSettings()) {
    std::printf("%-7s %-16s %-22s %-8s %-30s %s\n", s.scope.c_str(), s.name.c_str(), s.type.c_str(),
                s.default_value.c_str(), s.env.c_str(), s.doc.c_str());
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--version") {
    std::printf("weightbus %s\n", std::string(LibraryVersion()).c_str());
    for (const std::string& t : Transports()) std::printf("%s\n", t.c_str());
    return 0;
  }
  const std::string command = args[0];
  std::vector<std::string> rest(args.begin() + 1, args.end());
  absl::Status status;
  try {
    if (command == "convert-llama2c") {
      status = ConvertCommand(rest);
    } else if (command == "publish") {
      status = PublishCommand(rest);
    } else if (command == "subscribe") {
      status = SubscribeCommand(rest);
    } else if (command == "inspect") {
      status = InspectCommand(rest);
    } else if (command == "settings") {
      status = SettingsCommand(rest);
    } else {
      throw UsageError(absl::StrFormat("unknown command \"%s\"", command));
    }
  } catch (const UsageError& e) {
    std::fprintf(stderr, "weightbus: usage error: %s (see weightbus --help)\n", e.what());
    return 2;
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

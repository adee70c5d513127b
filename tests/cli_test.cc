// SPDX-License-Identifier: Apache-2.0
// The weightbus command-line tool, run as a user would: real processes, real files.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "test_support.h"
#include "weightbus/flags.h"
#include "weightbus/safetensors.hpp"

namespace weightbus {
namespace {

using ::weightbus::testing::RunCommand;
using ::weightbus::testing::ScratchDir;

std::string CliPath() { return testing::BinaryPath("tools/weightbus"); }

// Runs the CLI and returns {exit code, output}; fails the test if it hangs.
testing::RunResult Cli(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {CliPath()};
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = RunCommand(argv, absl::Seconds(60));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : testing::RunResult{};
}

int Lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

TEST(CliTest, VersionListsTheLibraryAndTransports) {
  auto r = Cli({"--version"});
  EXPECT_EQ(r.exit_code, 0);
  std::vector<std::string> lines = absl::StrSplit(r.output, '\n', absl::SkipEmpty());
  ASSERT_GE(lines.size(), 2u) << r.output;
  EXPECT_EQ(lines[0], "weightbus " WEIGHTBUS_VERSION_STRING_FOR_TESTS);
  // Exactly the transports this build was configured with (WEIGHTBUS_WITH_*).
  std::vector<std::string> transports(lines.begin() + 1, lines.end());
  std::vector<std::string> configured =
      absl::StrSplit(WB_TRANSPORTS_FOR_TESTS, ':', absl::SkipEmpty());
  std::sort(transports.begin(), transports.end());
  std::sort(configured.begin(), configured.end());
  EXPECT_EQ(transports, configured) << r.output;
}

TEST(CliTest, ConvertPublishSubscribeInspect) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ScratchDir dir;
  const std::string model = dir / "hf";
  auto conv =
      Cli({"convert-llama2c", testing::FixturePath("stories260K.bin"), model, "--dtype", "bf16"});
  ASSERT_EQ(conv.exit_code, 0) << conv.output;
  EXPECT_TRUE(std::filesystem::exists(model + "/config.json"));

  auto inspect = Cli({"inspect", model + "/model.safetensors", "--json"});
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  nlohmann::json j = nlohmann::json::parse(inspect.output, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << inspect.output;
  ASSERT_EQ(j.size(), 1u);
  EXPECT_EQ(j[0]["tensors"].size(), 47u);  // embed + 5 x 9 per layer + final norm (tied head)
  EXPECT_EQ(j[0]["total_bytes"], 520064u);
  EXPECT_EQ(j[0]["tensors"][0]["dtype"], "BF16");

  const std::string uri = "disk://" + dir.path() + "/channel";
  auto pub = Cli({"publish", uri, "--from", model, "--version", "1", "--metadata", "step=1"});
  ASSERT_EQ(pub.exit_code, 0) << pub.output;
  EXPECT_NE(pub.output.find("published version 1"), std::string::npos) << pub.output;

  auto sub = Cli({"subscribe", uri, "--to", dir / "replica", "--timeout", "10"});
  ASSERT_EQ(sub.exit_code, 0) << sub.output;
  EXPECT_NE(sub.output.find("version 1: 47 tensors"), std::string::npos) << sub.output;
  auto original = safetensors::ReadFile(model + "/model.safetensors");
  auto received = safetensors::ReadFile(dir / "replica/model.safetensors");
  ASSERT_TRUE(original.ok() && received.ok());
  ASSERT_EQ(received->header.tensors.size(), original->header.tensors.size());
  for (const safetensors::Entry& e : original->header.tensors) {
    const safetensors::Entry* r = received->header.Find(e.name);
    ASSERT_NE(r, nullptr) << e.name;
    auto a = original->Bytes(e);
    auto b = received->Bytes(*r);
    ASSERT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end())) << e.name;
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "replica/weightbus.manifest.json"));

  // The channel directory and the URI can both be inspected.
  auto channel = Cli({"inspect", dir / "channel"});
  EXPECT_EQ(channel.exit_code, 0) << channel.output;
  EXPECT_NE(channel.output.find("latest committed version 1"), std::string::npos) << channel.output;
  auto via_uri = Cli({"inspect", uri});
  EXPECT_EQ(via_uri.exit_code, 0) << via_uri.output;
  EXPECT_NE(via_uri.output.find("version 1 (newest, verified)"), std::string::npos);
  EXPECT_NE(via_uri.output.find("model.layers.4.mlp.down_proj.weight"), std::string::npos);
}

// A publisher group's version (two `publish` processes, ranks 0 and 1 of 2, each publishing
// the whole checkpoint: every tensor replicated) is what subscribers assemble: `subscribe --to`
// writes a manifest of the whole tensors it wrote, so `inspect` of that directory verifies, and
// `inspect` of the channel lists each tensor once, not once per rank.
TEST(CliTest, AGroupVersionIsSavedAndInspectedAsTheAssembledTensors) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ScratchDir dir;
  const std::string model = dir / "hf";
  ASSERT_EQ(Cli({"convert-llama2c", testing::FixturePath("stories260K.bin"), model}).exit_code, 0);
  const std::string uri = "disk://" + dir.path() + "/channel";
  auto publish = [&](int rank) {
    return Cli({"publish", uri, "--from", model, "--version", "1", "--set",
                "rank=" + std::to_string(rank), "--set", "world_size=2"});
  };
  testing::RunResult rank1;
  std::thread other([&] { rank1 = publish(1); });
  testing::RunResult rank0 = publish(0);
  other.join();
  ASSERT_EQ(rank0.exit_code, 0) << rank0.output;
  ASSERT_EQ(rank1.exit_code, 0) << rank1.output;

  auto sub = Cli({"subscribe", uri, "--to", dir / "replica", "--timeout", "10"});
  ASSERT_EQ(sub.exit_code, 0) << sub.output;
  EXPECT_NE(sub.output.find("version 1: 47 tensors"), std::string::npos) << sub.output;
  auto saved = Cli({"inspect", dir / "replica", "--json"});
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  auto channel = Cli({"inspect", uri, "--json"});
  ASSERT_EQ(channel.exit_code, 0) << channel.output;
  for (const std::string& out : {saved.output, channel.output}) {
    nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << out;
    ASSERT_EQ(j.size(), 1u) << out;
    EXPECT_EQ(j[0]["tensors"].size(), 47u) << out;   // each tensor once
    EXPECT_EQ(j[0]["total_bytes"], 520064u) << out;  // bf16 stories260K, counted once
  }
}

TEST(CliTest, FollowReceivesEachNewVersion) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ScratchDir dir;
  const std::string model = dir / "hf";
  ASSERT_EQ(Cli({"convert-llama2c", testing::FixturePath("stories260K.bin"), model}).exit_code, 0);
  const std::string uri = "disk://" + dir.path() + "/channel";
  auto follower = testing::Child::Start({CliPath(), "subscribe", uri, "--to", dir / "replica",
                                         "--follow", "--count", "3", "--timeout", "30"},
                                        {}, dir / "follow.log");
  ASSERT_TRUE(follower.ok());
  for (int v = 1; v <= 3; ++v) {
    ASSERT_EQ(Cli({"publish", uri, "--from", model, "--version", std::to_string(v)}).exit_code, 0);
    // Wait until the follower has it, so it sees every version rather than only the newest.
    ASSERT_TRUE(testing::WaitUntil(
        [&] {
          return testing::ReadFileOrDie(dir / "follow.log")
                     .find("version " + std::to_string(v) + ":") != std::string::npos;
        },
        absl::Seconds(30)));
  }
  auto status = follower->Wait(absl::Seconds(30));
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(*status, 0) << testing::ReadFileOrDie(dir / "follow.log");
}

TEST(CliTest, ErrorsAreOneLineAndNonZero) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  struct Case {
    std::vector<std::string> args;
    int code;
    std::vector<std::string> needles;
  };
  const std::string model = dir / "hf";
  ASSERT_EQ(Cli({"convert-llama2c", testing::FixturePath("stories260K.bin"), model}).exit_code, 0);
  ASSERT_EQ(Cli({"publish", uri, "--from", model, "--version", "5"}).exit_code, 0);
  testing::WriteFileOrDie(dir / "bad.safetensors", std::string("\x10\0\0\0\0\0\0\0{\"a\":1}", 15));
  std::vector<Case> cases = {
      {{"publish", uri, "--from", model, "--version", "4"},
       1,
       {"version 4", "already has version 5", "FAILED_PRECONDITION"}},
      {{"publish", uri, "--from", dir / "missing", "--version", "6"},
       1,
       {dir / "missing", "does not exist"}},
      {{"subscribe", uri, "--to", dir / "out", "--min-version", "6", "--timeout", "0.2"},
       1,
       {"no version >= 6", "newest committed: 5", "DEADLINE_EXCEEDED"}},
      {{"inspect", dir / "bad.safetensors"}, 1, {dir / "bad.safetensors", "DATA_LOSS"}},
      {{"convert-llama2c", dir / "bad.safetensors", dir / "x"}, 1, {dir / "bad.safetensors"}},
      {{"publish", uri + "?retention=zero", "--from", model, "--version", "6"},
       1,
       {"retention=\"zero\"", "INVALID_ARGUMENT"}},
      {{"publish", uri, "--from", model}, 2, {"usage error", "--version"}},
      {{"subscribe", uri, "--bogus"}, 2, {"unknown flag --bogus"}},
      {{"frobnicate"}, 2, {"unknown command"}},
  };
  for (const Case& c : cases) {
    auto r = Cli(c.args);
    EXPECT_EQ(r.exit_code, c.code) << absl::StrJoin(c.args, " ") << "\n" << r.output;
    EXPECT_EQ(Lines(r.output), 1) << absl::StrJoin(c.args, " ") << "\n" << r.output;
    for (const std::string& n : c.needles) {
      EXPECT_NE(r.output.find(n), std::string::npos) << "missing \"" << n << "\" in: " << r.output;
    }
  }
}

// A trainer (or a script) retrying its last publish: the same bytes are a success that writes
// nothing; other bytes under the same number are refused, naming the tensor.
TEST(CliTest, RepublishingTheLatestVersionIsANoOpOnlyWithTheSameBytes) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  const std::string model = dir / "hf";
  ASSERT_EQ(Cli({"convert-llama2c", testing::FixturePath("stories260K.bin"), model}).exit_code, 0);
  ASSERT_EQ(Cli({"publish", uri, "--from", model, "--version", "5"}).exit_code, 0);
  auto again = Cli({"publish", uri, "--from", model, "--version", "5"});
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("nothing written"), std::string::npos) << again.output;

  // The last byte of the file is the last byte of some tensor's data: flip it.
  std::string bytes = testing::ReadFileOrDie(model + "/model.safetensors");
  bytes.back() = static_cast<char>(bytes.back() ^ 0x01);
  testing::WriteFileOrDie(model + "/model.safetensors", bytes);
  auto other = Cli({"publish", uri, "--from", model, "--version", "5"});
  EXPECT_EQ(other.exit_code, 1) << other.output;
  EXPECT_NE(other.output.find("with other content: tensor \""), std::string::npos) << other.output;
  EXPECT_NE(other.output.find("FAILED_PRECONDITION"), std::string::npos) << other.output;
}

// Issue 10, item 21: `inspect` of a channel directory fails, as every subscriber does, when a
// committed version lacks its manifest or its reader lock, or LATEST names a missing version.
TEST(CliTest, InspectOfAChannelFailsWhenACommittedVersionIsIncomplete) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ScratchDir dir;
  const std::string model = dir / "hf";
  ASSERT_EQ(Cli({"convert-llama2c", testing::FixturePath("stories260K.bin"), model}).exit_code, 0);
  const std::string uri = "disk://" + dir.path() + "/channel?retention=5";
  for (const char* v : {"1", "2"}) {
    ASSERT_EQ(Cli({"publish", uri, "--from", model, "--version", v}).exit_code, 0);
  }
  const std::string v2 = dir.path() + "/channel/versions/v00000000000000000002";
  ASSERT_EQ(Cli({"inspect", dir / "channel"}).exit_code, 0);
  struct Case {
    std::string file;
    std::string needle;
  };
  for (const Case& c : {Case{"weightbus.manifest.json", "weightbus.manifest.json"},
                        Case{".readers.lock", ".readers.lock"}}) {
    const std::string path = v2 + "/" + c.file;
    const std::string saved = testing::ReadFileOrDie(path);
    ASSERT_EQ(::unlink(path.c_str()), 0);
    auto r = Cli({"inspect", dir / "channel"});
    EXPECT_EQ(r.exit_code, 1) << c.file << "\n" << r.output;
    EXPECT_NE(r.output.find(path), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("DATA_LOSS"), std::string::npos) << r.output;
    // A subscriber agrees.
    auto sub = Cli({"subscribe", uri, "--to", dir / "replica", "--timeout", "5"});
    EXPECT_EQ(sub.exit_code, 1) << sub.output;
    EXPECT_NE(sub.output.find("DATA_LOSS"), std::string::npos) << sub.output;
    testing::WriteFileOrDie(path, saved);
  }
  std::filesystem::rename(v2, dir / "moved");
  auto missing = Cli({"inspect", dir / "channel"});
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find("LATEST names version 2"), std::string::npos) << missing.output;
  EXPECT_NE(missing.output.find("DATA_LOSS"), std::string::npos) << missing.output;
  // Hostile paths are errors, not crashes: LATEST a directory (it opens, and reading it fails
  // with EISDIR, which libstdc++'s filebuf throws through istreambuf_iterator), and a path
  // component longer than NAME_MAX (std::filesystem's throwing overloads).
  const std::string latest = dir.path() + "/channel/LATEST";
  ASSERT_EQ(::unlink(latest.c_str()), 0);
  ASSERT_TRUE(std::filesystem::create_directory(latest));
  auto latest_dir = Cli({"inspect", dir / "channel"});
  EXPECT_EQ(latest_dir.exit_code, 1) << latest_dir.output;
  EXPECT_EQ(Lines(latest_dir.output), 1) << latest_dir.output;
  EXPECT_NE(latest_dir.output.find(latest + " is not a regular file"), std::string::npos)
      << latest_dir.output;
  EXPECT_NE(latest_dir.output.find("DATA_LOSS"), std::string::npos) << latest_dir.output;
  const std::string long_name = dir.path() + "/" + std::string(300, 'a');
  for (const std::string& target : {long_name, long_name + "/model.safetensors"}) {
    auto r = Cli({"inspect", target});
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_EQ(Lines(r.output), 1) << r.output;
    EXPECT_NE(r.output.find("NOT_FOUND"), std::string::npos) << r.output;
  }
}

// Issue 10, item 21: a checkpoint index whose weight_map names a file outside the checkpoint
// directory ("../x.safetensors") is refused, naming it, by every command that loads one.
TEST(CliTest, CheckpointIndexNamingFilesOutsideItsDirectoryIsRefused) {
  ScratchDir dir;
  const std::string model = dir / "hf";
  ASSERT_EQ(Cli({"convert-llama2c", testing::FixturePath("stories260K.bin"), model}).exit_code, 0);
  // A perfectly valid file, outside the checkpoint directory that the index points into.
  std::filesystem::rename(model + "/model.safetensors", dir / "outside.safetensors");
  auto file = safetensors::ReadFile(dir / "outside.safetensors");
  ASSERT_TRUE(file.ok());
  nlohmann::json index;
  for (const safetensors::Entry& e : file->header.tensors) {
    index["weight_map"][e.name] = "../outside.safetensors";
  }
  testing::WriteFileOrDie(model + "/model.safetensors.index.json", index.dump());
  const std::string uri = "disk://" + dir.path() + "/channel";
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"inspect", model},
        std::vector<std::string>{"publish", uri, "--from", model, "--version", "1"}}) {
    auto r = Cli(args);
    EXPECT_EQ(r.exit_code, 1) << absl::StrJoin(args, " ") << "\n" << r.output;
    EXPECT_NE(r.output.find("\"../outside.safetensors\""), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("DATA_LOSS"), std::string::npos) << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "channel/LATEST"));
}

// Issue 10, item 21: `subscribe --to` writes model.safetensors and weightbus.manifest.json with
// two renames; the model records which manifest it belongs to (weightbus.version and
// weightbus.manifest_xxh3 in its __metadata__), so the pair a kill between the renames leaves
// (new model, previous manifest) is detected by `inspect`. The test builds exactly that state.
TEST(CliTest, SubscribeToPairLeftByAnInterruptedWriteIsDetected) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ScratchDir dir;
  const std::string model = dir / "hf";
  ASSERT_EQ(Cli({"convert-llama2c", testing::FixturePath("stories260K.bin"), model}).exit_code, 0);
  const std::string uri = "disk://" + dir.path() + "/channel";
  const std::string replica = dir / "replica";
  // Same bytes in both versions, so only the pairing, not a checksum, can tell them apart.
  ASSERT_EQ(
      Cli({"publish", uri, "--from", model, "--version", "1", "--metadata", "step=1"}).exit_code,
      0);
  ASSERT_EQ(Cli({"subscribe", uri, "--to", replica, "--timeout", "10"}).exit_code, 0);
  const std::string manifest_v1 = testing::ReadFileOrDie(replica + "/weightbus.manifest.json");
  ASSERT_EQ(
      Cli({"publish", uri, "--from", model, "--version", "2", "--metadata", "step=2"}).exit_code,
      0);
  ASSERT_EQ(Cli({"subscribe", uri, "--to", replica, "--timeout", "10"}).exit_code, 0);
  auto good = Cli({"inspect", replica});
  EXPECT_EQ(good.exit_code, 0) << good.output;
  auto written = safetensors::ReadFile(replica + "/model.safetensors");
  ASSERT_TRUE(written.ok());
  ASSERT_EQ(written->header.metadata.count("weightbus.version"), 1u);
  EXPECT_EQ(written->header.metadata.at("weightbus.version"), "2");

  // Killed after renaming the new model into place, before renaming the new manifest.
  testing::WriteFileOrDie(replica + "/weightbus.manifest.json", manifest_v1);
  auto r = Cli({"inspect", replica});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("version 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("version 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("DATA_LOSS"), std::string::npos) << r.output;
}

TEST(CliTest, SettingsListsEveryKnobWithItsEnvironmentVariable) {
  auto r = Cli({"settings"});
  ASSERT_EQ(r.exit_code, 0);
  std::vector<std::string> needles = {"bind_mode", "WEIGHTBUS_BIND_MODE"};  // the core's
  if (testing::MissingTransports({"disk"}).empty()) {
    needles.insert(needles.end(),
                   {"retention", "WEIGHTBUS_DISK_RETENTION", "poll_interval", "enum(uring|psync)"});
  } else {
    EXPECT_EQ(r.output.find("WEIGHTBUS_DISK_"), std::string::npos) << r.output;
  }
  for (const std::string& needle : needles) {
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  }
}

// The subcommands a program's --help lists (the lines under "Subcommands:").
std::vector<std::string> SubcommandsIn(const std::string& help) {
  std::vector<std::string> out;
  bool in_list = false;
  for (absl::string_view line : absl::StrSplit(help, '\n')) {
    if (line == "Subcommands:") {
      in_list = true;
    } else if (in_list && absl::StartsWith(line, "  ")) {
      std::vector<std::string> words =
          absl::StrSplit(absl::StripLeadingAsciiWhitespace(line), ' ', absl::SkipEmpty());
      out.push_back(words.at(0));
    } else if (in_list) {
      break;
    }
  }
  return out;
}

// Every program of the project (the CLI, weightbus-demo, every benchmark built) and each of its
// subcommands: --help lists the flags and exits 0; an unknown flag is a one-line usage error
// that names it, exit status 2.
TEST(CliTest, EveryProgramHasHelpAndNamesAnUnknownFlag) {
  const std::vector<std::string> programs =
      absl::StrSplit(WB_PROGRAMS_FOR_TESTS, ':', absl::SkipEmpty());
  ASSERT_GE(programs.size(), 2u) << WB_PROGRAMS_FOR_TESTS;  // at least the CLI and the demo
  int checked = 0, subcommands = 0;
  for (const std::string& program : programs) {
    const std::string name = std::filesystem::path(program).filename();
    auto top = RunCommand({program, "--help"}, absl::Seconds(30));
    ASSERT_TRUE(top.ok()) << top.status();
    std::vector<std::vector<std::string>> commands = {{program}};
    for (const std::string& sub : SubcommandsIn(top->output)) {
      commands.push_back({program, sub});
      ++subcommands;
    }
    for (const std::vector<std::string>& command : commands) {
      const std::string what = absl::StrJoin(command, " ");
      std::vector<std::string> help = command;
      help.push_back("--help");
      auto h = RunCommand(help, absl::Seconds(30));
      ASSERT_TRUE(h.ok()) << h.status();
      EXPECT_EQ(h->exit_code, 0) << what << "\n" << h->output;
      EXPECT_TRUE(absl::StrContains(h->output, "Usage: " + name)) << what << "\n" << h->output;
      EXPECT_TRUE(absl::StrContains(h->output, "--help")) << what << "\n" << h->output;

      std::vector<std::string> bad = command;
      bad.push_back("--no-such-flag=1");
      auto r = RunCommand(bad, absl::Seconds(30));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->exit_code, tools::kUsageExitStatus) << what << "\n" << r->output;
      EXPECT_EQ(Lines(r->output), 1) << what << "\n" << r->output;
      EXPECT_TRUE(absl::StartsWith(r->output, name + ": usage error: unknown flag --no-such-flag"))
          << what << "\n"
          << r->output;
      ++checked;
    }
  }
  EXPECT_GE(subcommands, 7) << "weightbus has 5 subcommands, weightbus-bench 2";
  EXPECT_EQ(checked, static_cast<int>(programs.size()) + subcommands);
}

// The tools' one parser of sizes and durations (tools/weightbus/flags.h).
TEST(FlagsTest, SizesAndDurations) {
  struct SizeCase {
    const char* text;
    uint64_t bytes;
  };
  for (const SizeCase& c : std::vector<SizeCase>{{"4096", 4096},
                                                 {"64KiB", 64 << 10},
                                                 {"256MiB", 256 << 20},
                                                 {"1.5GiB", uint64_t{3} << 29},
                                                 {"2GB", 2000000000},
                                                 {"512m", 512 << 20},
                                                 {" 1mib ", 1 << 20},
                                                 {"18446744073709551615", UINT64_MAX}}) {
    absl::StatusOr<uint64_t> b = tools::ParseSize(c.text);
    ASSERT_TRUE(b.ok()) << c.text << ": " << b.status();
    EXPECT_EQ(*b, c.bytes) << c.text;
    EXPECT_EQ(tools::ParseSize(tools::FormatSize(*b)).value_or(0), *b) << c.text;
  }
  for (const char* bad : {"", "abc", "-1", "1.5XiB", "16EiB", "20000000TiB", "nan", "MiB"}) {
    absl::StatusOr<uint64_t> b = tools::ParseSize(bad);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(b.status().message(), std::string("\"") + bad + "\""))
        << b.status();
  }
  EXPECT_EQ(tools::FormatSize(256 << 20), "256MiB");
  EXPECT_EQ(tools::FormatSize(1000), "1000");

  EXPECT_EQ(tools::ParseDuration("0.2").value_or(absl::ZeroDuration()), absl::Milliseconds(200));
  EXPECT_EQ(tools::ParseDuration("300").value_or(absl::ZeroDuration()), absl::Seconds(300));
  EXPECT_EQ(tools::ParseDuration("500ms").value_or(absl::ZeroDuration()), absl::Milliseconds(500));
  EXPECT_EQ(tools::ParseDuration("1m30s").value_or(absl::ZeroDuration()), absl::Seconds(90));
  for (const char* bad : {"", "2x", "-1", "-2s", "inf", "nan"}) {
    EXPECT_EQ(tools::ParseDuration(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

// A flag's bad value is a usage error naming the flag, the value and what was expected.
TEST(CliTest, BadFlagValuesAreUsageErrorsNamingTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> needles;
  };
  for (const Case& c : std::vector<Case>{
           {{"subscribe", "disk:///x", "--to", "d", "--timeout", "2x"}, {"--timeout", "\"2x\""}},
           {{"publish", "disk:///x", "--from", "m", "--version", "-1"}, {"--version", "\"-1\""}},
           // A number past 2^64 - 1 is refused, not clamped to the largest version.
           {{"publish", "disk:///x", "--from", "m", "--version", "18446744073709551616"},
            {"--version", "out of range", "18446744073709551615"}},
           {{"subscribe", "disk:///x", "--to", "d", "--min-version", "99999999999999999999"},
            {"--min-version", "out of range"}},
           {{"publish", "disk:///x", "--from", "m", "--version", "1", "--until-subscribers",
             "2000000"},
            {"--until-subscribers", "2000000"}},
           {{"convert-llama2c", "a", "b", "--dtype", "f16"}, {"--dtype", "f16"}},
           {{"publish", "disk:///x", "--from", "m", "--version", "1", "--metadata", "foo"},
            {"--metadata", "\"foo\" is not KEY=VALUE"}},
           {{"subscribe", "disk:///x", "--to", "d", "--set", "=x"},
            {"--set", "\"=x\" is not KEY=VALUE"}},
           {{"publish", "disk:///x", "disk:///y", "--from", "m", "--version", "1"},
            {"unexpected argument \"disk:///y\""}}}) {
    auto r = Cli(c.args);
    const std::string what = absl::StrJoin(c.args, " ");
    EXPECT_EQ(r.exit_code, 2) << what << "\n" << r.output;
    EXPECT_EQ(Lines(r.output), 1) << what << "\n" << r.output;
    EXPECT_TRUE(absl::StartsWith(r.output, "weightbus: usage error: ")) << r.output;
    for (const std::string& n : c.needles) {
      EXPECT_TRUE(absl::StrContains(r.output, n)) << "missing " << n << " in: " << r.output;
    }
  }
}

}  // namespace
}  // namespace weightbus

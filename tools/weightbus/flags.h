// SPDX-License-Identifier: Apache-2.0
// Command-line flags for every program of the project (the weightbus CLI, weightbus-demo, the
// benchmarks), through CLI11: the one home of the tools' flag conventions. CLI11 is header-only and
// costs seconds of compile time per file that includes it: only flags.cc does; programs declare
// their flags through Command and Flag.
//
//   --help (-h)      the program's (or subcommand's) flags with units and defaults; exit 0
//   a usage error    one line "<program>: usage error: <what> (see <program> --help)" on stderr,
//                    naming the flag; exit status 2 (kUsageExitStatus)
//   sizes            bytes: 4096, 64KiB, 1.5GiB, 2GB, 512M (binary K/M/G, SI KB/MB/GB; the
//                    suffix in any case) -- ParseSize
//   durations        a number of seconds (0.2, 300) or an Abseil duration (500ms, 2s, 1m) --
//                    ParseDuration
//
// The tools link only the public API, so they do not use the library's settings parser
// (lib/core/config.*); these parsers accept what it accepts for byte and duration settings, and
// also fractions of a unit (1.5GiB) and plain numbers of seconds, which flags have always taken.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace weightbus::tools {

// The exit status of a usage error (unknown flag, bad value, missing argument).
inline constexpr int kUsageExitStatus = 2;

// "4096", "64KiB", "1.5GiB", "2GB", "512m" -> bytes (rounded to the nearest byte). Errors:
// InvalidArgument naming the text, for anything else, a negative size or one above 2^64.
absl::StatusOr<uint64_t> ParseSize(std::string_view text);
// 268435456 -> "256MiB", 1000 -> "1000" (exact: ParseSize reads it back to the same bytes).
std::string FormatSize(uint64_t bytes);
// "0.2", "300" (seconds), "500ms", "2s", "1m30s" -> a duration. Errors: InvalidArgument naming
// the text, for anything else or a negative or infinite duration.
absl::StatusOr<absl::Duration> ParseDuration(std::string_view text);

// "" when `text` is digits only and at most `max`, else the reason ("-1" is not 2^64 - 1; a value
// that does not fit is refused, never clamped): the check on unsigned flags (Command::Add).
std::string UnsignedCheck(const std::string& text, uint64_t max);

// One flag (an option, a switch or a positional argument) of a Command: refinements chain, e.g.
// `cmd.Add("replicas", &n, "replica processes").InRange(1, 1000)`. A Flag is a handle into its
// Command, valid as long as the Command; copying it is cheap.
class Flag {
 public:
  Flag& Required();                            // a usage error when absent
  Flag& TypeName(const std::string& name);     // the value's name in --help ("PATH", "N,...")
  Flag& DefaultText(const std::string& text);  // the default shown in --help ("" shows none)
  Flag& Group(const std::string& heading);     // listed under this heading in --help
  Flag& Hidden();                              // left out of --help (a program's own child flags)
  Flag& OneOf(const std::vector<std::string>& names);  // each value one of these
  Flag& InRange(int64_t lo, int64_t hi);               // each value an integer in [lo, hi]
  Flag& Positive();                                    // each value a finite number above 0
  Flag& KeyValue();                                    // each value KEY=VALUE (a non-empty key)
  // Each value checked by `check`: "" accepts it, anything else is the usage error's reason.
  Flag& Check(std::function<std::string(const std::string& value)> check);
  // Whether the command line gave it (after parsing).
  bool given() const;

 private:
  friend class Command;
  explicit Flag(CLI::Option* option) : option_(option) {}
  CLI::Option* option_;
};

// A program, or one subcommand of a program, and its flags, parsed by CLI11 (compiled once in
// this library: programs include only this header). Not thread-safe; built, parsed and read by
// one thread. Each Add* stores the parsed value into *out (which must outlive the Command) and
// shows *out's value at the call as the default in --help, unless said otherwise.
class Command {
 public:
  // A program named `name` (as in usage errors and --help).
  Command(const std::string& name, const std::string& description);
  ~Command();
  Command(const Command&) = delete;
  Command& operator=(const Command&) = delete;

  // A subcommand, owned by this command. Hidden ones are left out of --help.
  Command& AddSubcommand(const std::string& name, const std::string& description);
  Command& Hidden();
  Command& Footer(const std::string& text);  // after the flags in --help
  // Between min and max subcommands must be given (max 0: any number).
  Command& RequireSubcommands(size_t min, size_t max);
  // Whether this subcommand was given (after parsing).
  bool given() const;
  // The --help text.
  std::string Help() const;

  // --NAME VALUE. Unsigned numbers refuse a sign ("-1" is not 2^64 - 1) and anything above the
  // type's largest value (never clamped).
  Flag Add(const std::string& name, std::string* out, const std::string& help);
  // Left as is unless given (no default shown).
  Flag Add(const std::string& name, std::optional<std::string>* out, const std::string& help);
  Flag Add(const std::string& name, int* out, const std::string& help);
  Flag Add(const std::string& name, unsigned* out, const std::string& help);
  Flag Add(const std::string& name, uint64_t* out, const std::string& help);
  Flag Add(const std::string& name, double* out, const std::string& help);
  // --NAME A,B,C (comma-separated values of one occurrence) into *out.
  Flag AddList(const std::string& name, std::vector<std::string>* out, const std::string& help);
  Flag AddList(const std::string& name, std::vector<int>* out, const std::string& help);
  Flag AddList(const std::string& name, std::vector<double>* out, const std::string& help);
  // --NAME: *out becomes true.
  Flag AddSwitch(const std::string& name, bool* out, const std::string& help);
  // The positional argument NAME (in the order added).
  Flag AddPositional(const std::string& name, std::string* out, const std::string& help);
  // --NAME SIZE into *out (bytes, ParseSize).
  Flag AddSize(const std::string& name, uint64_t* out, const std::string& help);
  // --NAME SIZE,SIZE,... into *out (each as AddSize).
  Flag AddSizeList(const std::string& name, std::vector<uint64_t>* out, const std::string& help);
  // --NAME DURATION into *out (ParseDuration).
  Flag AddDuration(const std::string& name, absl::Duration* out, const std::string& help);
  // --NAME VALUE, repeatable (one value per occurrence, so a positional after it stays one),
  // into *out in the order given.
  Flag AddRepeated(const std::string& name, std::vector<std::string>* out, const std::string& help);

  // Parses `args` (the arguments after the program name). Returns the exit status to end with:
  // 0 after printing help (--help, -h, `help` as the first argument) on stdout;
  // kUsageExitStatus after printing a usage error as described at the top; or nullopt when the
  // program goes on. A program with subcommands gets "unknown command" for a first argument that
  // is none of them, and its bare name prints the help on stderr (status 2). Call once, on the
  // program's Command.
  std::optional<int> Parse(const std::vector<std::string>& args);
  std::optional<int> Parse(int argc, const char* const* argv);

 private:
  explicit Command(CLI::App* app);  // a subcommand
  Flag AddUnsigned(const std::string& name, uint64_t* out, uint64_t max, const std::string& help);

  std::unique_ptr<CLI::App> owned_;  // the program's; subcommands' Apps belong to it
  CLI::App* app_;
  std::vector<std::unique_ptr<Command>> subcommands_;
};

}  // namespace weightbus::tools

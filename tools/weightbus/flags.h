// SPDX-License-Identifier: Apache-2.0
// Command-line flags for every program of the project (the weightbus CLI, weightbus-demo, the
// benchmarks), through CLI11: the one home of the tools' flag conventions.
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
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

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

// The check AddFlag puts on unsigned numbers: digits only, at most `max` (a value that does not
// fit is refused, never clamped to the largest one).
CLI::Validator UnsignedText(uint64_t max);

// A check for a flag taking KEY=VALUE (a non-empty key, then '=', then any value).
CLI::Validator KeyValueText();

// A check for a floating-point flag: a finite number above 0.
CLI::Validator PositiveNumber();

// --NAME VALUE into *out (a number, a string, an enum name checked by the caller), with *out's
// value at the call shown as the default. Unsigned numbers refuse a sign ("-1" is not 2^64 - 1).
template <typename T>
CLI::Option* AddFlag(CLI::App& app, const std::string& name, T* out, const std::string& help) {
  CLI::Option* option = app.add_option("--" + name, *out, help)->capture_default_str();
  if constexpr (std::is_unsigned_v<T>) option->check(UnsignedText(std::numeric_limits<T>::max()));
  return option;
}
// --NAME SIZE into *out (bytes); the default shown in --help is *out's value at the call.
CLI::Option* AddSizeFlag(CLI::App& app, const std::string& name, uint64_t* out,
                         const std::string& help);
// --NAME SIZE,SIZE,... into *out (each as AddSizeFlag).
CLI::Option* AddSizeListFlag(CLI::App& app, const std::string& name, std::vector<uint64_t>* out,
                             const std::string& help);
// --NAME DURATION into *out; the default shown in --help is *out's value at the call.
CLI::Option* AddDurationFlag(CLI::App& app, const std::string& name, absl::Duration* out,
                             const std::string& help);
// --NAME VALUE, repeatable (one value per occurrence, so a positional after it stays one), into
// *out in the order given.
CLI::Option* AddRepeatedFlag(CLI::App& app, const std::string& name, std::vector<std::string>* out,
                             const std::string& help);

// Parses `args` (the arguments after the program name) into `app`, whose name is the program's.
// Returns the exit status to end with: 0 after printing help (--help, -h, `help` as the first
// argument) on stdout; kUsageExitStatus after printing a usage error as described above; or
// nullopt when the program goes on. A program with subcommands gets "unknown command" for a
// first argument that is none of them, and its bare name prints the help on stderr (status 2).
std::optional<int> ParseFlags(CLI::App& app, const std::vector<std::string>& args);
std::optional<int> ParseFlags(CLI::App& app, int argc, const char* const* argv);

}  // namespace weightbus::tools

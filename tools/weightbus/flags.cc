// SPDX-License-Identifier: Apache-2.0
#include "weightbus/flags.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace weightbus::tools {
namespace {

absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr double kTwoTo64 = 18446744073709551616.0;

// A CLI11 transform: the text as ParseSize reads it, replaced by its number of bytes.
CLI::Validator SizeTransform() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        absl::StatusOr<uint64_t> bytes = ParseSize(text);
        if (!bytes.ok()) return std::string(bytes.status().message());
        text = std::to_string(*bytes);
        return "";
      },
      "", "SIZE");
}

// The flag's name and its subcommand path, for "(see weightbus publish --help)".
std::string CommandPath(const CLI::App& app) {
  std::string path = app.get_name();
  const CLI::App* at = &app;
  while (true) {
    std::vector<CLI::App*> selected = at->get_subcommands();
    if (selected.empty()) return path;
    at = selected.front();
    path += " " + at->get_name();
  }
}

// CLI11's "The following arguments were not expected: ..." in this project's words.
std::string DescribeExtras(const CLI::App& app) {
  const std::vector<std::string> extras = app.remaining(/*recurse=*/true);
  std::vector<std::string> flags, others;
  for (const std::string& e : extras) {
    if (e.size() > 1 && e[0] == '-') {
      flags.push_back(e.substr(0, e.find('=')));
    } else {
      others.push_back("\"" + e + "\"");
    }
  }
  if (!flags.empty()) {
    return absl::StrFormat("unknown flag%s %s", flags.size() > 1 ? "s" : "",
                           absl::StrJoin(flags, " "));
  }
  const bool subcommand_chosen = !app.get_subcommands().empty();
  if (!app.get_subcommands({}).empty() && !subcommand_chosen && !others.empty()) {
    return absl::StrFormat("unknown command %s", others.front());
  }
  return absl::StrFormat("unexpected argument%s %s", others.size() > 1 ? "s" : "",
                         absl::StrJoin(others, " "));
}

}  // namespace

absl::StatusOr<uint64_t> ParseSize(std::string_view text) {
  struct Suffix {
    const char* name;
    uint64_t multiplier;
  };
  // Longest first: "kib" before "b".
  static constexpr Suffix kSuffixes[] = {{"kib", 1ULL << 10},
                                         {"mib", 1ULL << 20},
                                         {"gib", 1ULL << 30},
                                         {"tib", 1ULL << 40},
                                         {"kb", 1000ULL},
                                         {"mb", 1000000ULL},
                                         {"gb", 1000000000ULL},
                                         {"tb", 1000000000000ULL},
                                         {"k", 1ULL << 10},
                                         {"m", 1ULL << 20},
                                         {"g", 1ULL << 30},
                                         {"t", 1ULL << 40},
                                         {"b", 1}};
  std::string number = absl::AsciiStrToLower(absl::StripAsciiWhitespace(AV(text)));
  uint64_t multiplier = 1;
  for (const Suffix& s : kSuffixes) {
    if (number.size() > std::strlen(s.name) && absl::EndsWith(number, s.name)) {
      multiplier = s.multiplier;
      number.resize(number.size() - std::strlen(s.name));
      break;
    }
  }
  auto malformed = [&] {
    return absl::InvalidArgumentError(absl::StrFormat(
        "\"%s\" is not a size in bytes (e.g. 4096, 64KiB, 1.5GiB, 2GB)", std::string(text)));
  };
  uint64_t whole = 0;
  if (absl::SimpleAtoi(number, &whole)) {  // exact for every integer count
    if (whole != 0 && multiplier > UINT64_MAX / whole) return malformed();
    return whole * multiplier;
  }
  double v = 0;
  if (!absl::SimpleAtod(number, &v) || !(v >= 0) || !(v * multiplier < kTwoTo64)) {
    return malformed();
  }
  return static_cast<uint64_t>(std::llround(v * static_cast<double>(multiplier)));
}

std::string FormatSize(uint64_t bytes) {
  static constexpr std::pair<const char*, uint64_t> kUnits[] = {
      {"TiB", 1ULL << 40}, {"GiB", 1ULL << 30}, {"MiB", 1ULL << 20}, {"KiB", 1ULL << 10}};
  for (const auto& [unit, size] : kUnits) {
    if (bytes != 0 && bytes % size == 0) return absl::StrFormat("%d%s", bytes / size, unit);
  }
  return absl::StrFormat("%d", bytes);
}

absl::StatusOr<absl::Duration> ParseDuration(std::string_view text) {
  const std::string t(absl::StripAsciiWhitespace(AV(text)));
  double seconds = 0;
  absl::Duration d;
  if (absl::SimpleAtod(t, &seconds)) {
    if (std::isfinite(seconds) && seconds >= 0) return absl::Seconds(seconds);
  } else if (absl::ParseDuration(t, &d) && d >= absl::ZeroDuration() &&
             d != absl::InfiniteDuration()) {
    return d;
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "\"%s\" is not a duration (a number of seconds, or e.g. 500ms, 2s, 1m)", std::string(text)));
}

// ---- Flag

std::string UnsignedCheck(const std::string& text, uint64_t max) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) {
    return absl::StrFormat("\"%s\" is not a non-negative integer", text);
  }
  uint64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value > max) {
    return absl::StrFormat("%s is out of range: at most %d", text, max);
  }
  return "";
}

namespace {

// A CLI11 check from a function returning "" (accepted) or the reason.
CLI::Validator MakeCheck(std::function<std::string(const std::string&)> check) {
  return CLI::Validator([check = std::move(check)](std::string& text) { return check(text); }, "",
                        "");
}

}  // namespace

Flag& Flag::Required() {
  option_->required();
  return *this;
}
Flag& Flag::TypeName(const std::string& name) {
  option_->type_name(name);
  return *this;
}
Flag& Flag::DefaultText(const std::string& text) {
  option_->default_str(text);
  return *this;
}
Flag& Flag::Group(const std::string& heading) {
  option_->group(heading);
  return *this;
}
Flag& Flag::Hidden() { return Group(""); }
Flag& Flag::OneOf(const std::vector<std::string>& names) {
  option_->check(CLI::IsMember(names));
  return *this;
}
Flag& Flag::InRange(int64_t lo, int64_t hi) {
  return Check([lo, hi](const std::string& text) -> std::string {
    int64_t v = 0;
    if (!absl::SimpleAtoi(text, &v)) return absl::StrFormat("\"%s\" is not an integer", text);
    if (v < lo || v > hi) return absl::StrFormat("%d is out of range: %d to %d", v, lo, hi);
    return "";
  });
}
Flag& Flag::Positive() {
  return Check([](const std::string& text) -> std::string {
    double v = 0;
    if (absl::SimpleAtod(text, &v) && std::isfinite(v) && v > 0) return "";
    return absl::StrFormat("\"%s\" is not a number above 0", text);
  });
}
Flag& Flag::KeyValue() {
  return Check([](const std::string& text) -> std::string {
    const size_t eq = text.find('=');
    if (eq == std::string::npos || eq == 0) return absl::StrFormat("\"%s\" is not KEY=VALUE", text);
    return "";
  });
}
Flag& Flag::Check(std::function<std::string(const std::string& value)> check) {
  option_->check(MakeCheck(std::move(check)));
  return *this;
}
bool Flag::given() const { return option_->count() > 0; }

// ---- Command

Command::Command(const std::string& name, const std::string& description)
    : owned_(std::make_unique<CLI::App>(description, name)), app_(owned_.get()) {}

Command::Command(CLI::App* app) : app_(app) {}

Command::~Command() = default;

Command& Command::AddSubcommand(const std::string& name, const std::string& description) {
  subcommands_.push_back(
      std::unique_ptr<Command>(new Command(app_->add_subcommand(name, description))));
  return *subcommands_.back();
}
Command& Command::Hidden() {
  app_->group("");
  return *this;
}
Command& Command::Footer(const std::string& text) {
  app_->footer(text);
  return *this;
}
Command& Command::RequireSubcommands(size_t min, size_t max) {
  app_->require_subcommand(min, max);
  return *this;
}
bool Command::given() const { return static_cast<bool>(*app_); }
std::string Command::Help() const { return app_->help(); }

Flag Command::Add(const std::string& name, std::string* out, const std::string& help) {
  return Flag(app_->add_option("--" + name, *out, help)->capture_default_str());
}
Flag Command::Add(const std::string& name, std::optional<std::string>* out,
                  const std::string& help) {
  return Flag(app_->add_option_function<std::string>(
      "--" + name, [out](const std::string& text) { *out = text; }, help));
}
Flag Command::Add(const std::string& name, int* out, const std::string& help) {
  return Flag(app_->add_option("--" + name, *out, help)->capture_default_str());
}
Flag Command::Add(const std::string& name, double* out, const std::string& help) {
  return Flag(app_->add_option("--" + name, *out, help)->capture_default_str());
}
Flag Command::Add(const std::string& name, unsigned* out, const std::string& help) {
  Flag flag(app_->add_option("--" + name, *out, help)->capture_default_str());
  return flag.Check([](const std::string& text) {
    return UnsignedCheck(text, std::numeric_limits<unsigned>::max());
  });
}
Flag Command::Add(const std::string& name, uint64_t* out, const std::string& help) {
  Flag flag(app_->add_option("--" + name, *out, help)->capture_default_str());
  return flag.Check([](const std::string& text) {
    return UnsignedCheck(text, std::numeric_limits<uint64_t>::max());
  });
}

namespace {
template <typename T>
CLI::Option* ListOption(CLI::App& app, const std::string& name, std::vector<T>* out,
                        const std::string& help) {
  return app.add_option("--" + name, *out, help)->delimiter(',')->allow_extra_args(false);
}
}  // namespace

Flag Command::AddList(const std::string& name, std::vector<std::string>* out,
                      const std::string& help) {
  return Flag(ListOption(*app_, name, out, help)->default_str(absl::StrJoin(*out, ",")));
}
Flag Command::AddList(const std::string& name, std::vector<int>* out, const std::string& help) {
  return Flag(ListOption(*app_, name, out, help)->default_str(absl::StrJoin(*out, ",")));
}
Flag Command::AddList(const std::string& name, std::vector<double>* out, const std::string& help) {
  return Flag(ListOption(*app_, name, out, help)->default_str(absl::StrJoin(*out, ",")));
}

Flag Command::AddSwitch(const std::string& name, bool* out, const std::string& help) {
  return Flag(app_->add_flag("--" + name, *out, help));
}

Flag Command::AddPositional(const std::string& name, std::string* out, const std::string& help) {
  return Flag(app_->add_option(name, *out, help));
}

Flag Command::AddSize(const std::string& name, uint64_t* out, const std::string& help) {
  return Flag(app_->add_option("--" + name, *out, help)
                  ->transform(SizeTransform())
                  ->type_name("SIZE")
                  ->default_str(FormatSize(*out)));
}

Flag Command::AddSizeList(const std::string& name, std::vector<uint64_t>* out,
                          const std::string& help) {
  std::vector<std::string> shown;
  for (uint64_t b : *out) shown.push_back(FormatSize(b));
  return Flag(ListOption(*app_, name, out, help)
                  ->transform(SizeTransform())
                  ->type_name("SIZE,...")
                  ->default_str(absl::StrJoin(shown, ",")));
}

Flag Command::AddDuration(const std::string& name, absl::Duration* out, const std::string& help) {
  return Flag(
      app_->add_option_function<std::string>(
              "--" + name, [out](const std::string& text) { *out = *ParseDuration(text); }, help)
          ->check(CLI::Validator(
              [](std::string& text) -> std::string {
                absl::StatusOr<absl::Duration> d = ParseDuration(text);
                return d.ok() ? "" : std::string(d.status().message());
              },
              "", "DURATION"))
          ->type_name("DURATION")
          ->default_str(absl::FormatDuration(*out)));
}

Flag Command::AddRepeated(const std::string& name, std::vector<std::string>* out,
                          const std::string& help) {
  return Flag(app_->add_option("--" + name, *out, help)->allow_extra_args(false));
}

std::optional<int> Command::Parse(const std::vector<std::string>& args) {
  CLI::App& app = *app_;
  const bool has_subcommands = !app.get_subcommands({}).empty();
  app.get_formatter()->column_width(34);
  if (has_subcommands && args.empty()) {
    std::fputs(app.help().c_str(), stderr);
    return kUsageExitStatus;
  }
  if (has_subcommands && args.front() == "help") {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  }
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 parses from the back
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const CLI::CallForAllHelp&) {
    std::fputs(app.help("", CLI::AppFormatMode::All).c_str(), stdout);
    return 0;
  } catch (const CLI::ParseError& e) {
    // An unknown flag is named first, also when CLI11 found something else (a required flag
    // missing) before it looked at what was left over.
    const bool extras = dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr ||
                        (dynamic_cast<const CLI::RequiredError*>(&e) != nullptr &&
                         !app.remaining(/*recurse=*/true).empty());
    std::string what = extras ? DescribeExtras(app) : e.what();
    for (char& c : what) {
      if (c == '\n') c = ' ';
    }
    std::fflush(stdout);
    std::fprintf(stderr, "%s: usage error: %s (see %s --help)\n", app.get_name().c_str(),
                 what.c_str(), CommandPath(app).c_str());
    return kUsageExitStatus;
  }
  return std::nullopt;
}

std::optional<int> Command::Parse(int argc, const char* const* argv) {
  return Parse(std::vector<std::string>(argv + 1, argv + argc));
}

}  // namespace weightbus::tools

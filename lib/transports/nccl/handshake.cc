// SPDX-License-Identifier: Apache-2.0
#include "transports/nccl/handshake.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

extern char** environ;

namespace weightbus::internal::nccl {
namespace {

// NAME's value in `environment`, if set.
const char* Lookup(char** environment, std::string_view name) {
  for (char** e = environment; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    if (entry.size() > name.size() && entry.substr(0, name.size()) == name &&
        entry[name.size()] == '=') {
      return *e + name.size() + 1;
    }
  }
  return nullptr;
}

// NAME=value lines of an NCCL configuration file (NCCL's own parser: '#' starts a comment,
// blanks around the name and value are ignored).
std::map<std::string, std::string> ReadConfFile(const std::string& path) {
  std::map<std::string, std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const absl::string_view l = absl::StripAsciiWhitespace(line);
    if (l.empty() || l.front() == '#') continue;
    const size_t eq = l.find('=');
    if (eq == absl::string_view::npos) continue;
    std::string name(absl::StripAsciiWhitespace(l.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(l.substr(eq + 1)));
    out.emplace(std::move(name), std::move(value));  // the first line for a name wins
  }
  return out;
}

}  // namespace

const std::vector<std::string_view>& AgreementSettings() {
  // Each changes which transport (P2P, SHM, NET, NVLS, CollNet), protocol or algorithm NCCL picks
  // between two ranks, or how its buffers are allocated and shared (cuMem).
  static const auto* names = new std::vector<std::string_view>{
      "NCCL_CUMEM_ENABLE", "NCCL_P2P_DISABLE",  "NCCL_P2P_LEVEL",      "NCCL_SHM_DISABLE",
      "NCCL_NET",          "NCCL_NET_PLUGIN",   "NCCL_IB_DISABLE",     "NCCL_NET_GDR_LEVEL",
      "NCCL_NVLS_ENABLE",  "NCCL_MNNVL_ENABLE", "NCCL_COLLNET_ENABLE", "NCCL_PXN_DISABLE",
      "NCCL_PROTO",        "NCCL_ALGO",         "NCCL_BUFFSIZE",       "NCCL_CROSS_NIC",
  };
  return *names;
}

std::vector<Setting> NcclEnvironmentSettings(char** environment, const char* home) {
  if (environment == nullptr) environment = environ;
  // NCCL loads the user's file (NCCL_CONF_FILE, else ~/.nccl.conf) and then /etc/nccl.conf,
  // neither overriding a variable already set.
  std::string user_file;
  if (const char* conf = Lookup(environment, "NCCL_CONF_FILE"); conf != nullptr && *conf != 0) {
    user_file = conf;
  } else {
    const char* h = home != nullptr ? home : Lookup(environment, "HOME");
    if (h != nullptr && *h != 0) user_file = std::string(h) + "/.nccl.conf";
  }
  const std::map<std::string, std::string> user =
      user_file.empty() ? std::map<std::string, std::string>{} : ReadConfFile(user_file);
  const std::map<std::string, std::string> system = ReadConfFile("/etc/nccl.conf");
  std::vector<Setting> out;
  for (std::string_view name : AgreementSettings()) {
    Setting s{std::string(name), ""};
    if (const char* v = Lookup(environment, name); v != nullptr) {
      s.value = v;
    } else if (auto it = user.find(s.name); it != user.end()) {
      s.value = it->second;
    } else if (auto it = system.find(s.name); it != system.end()) {
      s.value = it->second;
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::string NcclVersionText(uint32_t code) {
  if (code >= 10000) {
    return absl::StrFormat("%d.%d.%d", code / 10000, code / 100 % 100, code % 100);
  }
  return absl::StrFormat("%d.%d.%d", code / 1000, code / 100 % 10, code % 100);
}

absl::Status CompareAgreement(const Agreement& publisher, std::string_view publisher_name,
                              const Agreement& replica, std::string_view replica_name) {
  std::vector<std::string> differences;
  if (publisher.nccl_version != replica.nccl_version) {
    differences.push_back(
        absl::StrFormat("the NCCL version is %s on the publisher (%s) but %s on replica %s",
                        NcclVersionText(publisher.nccl_version), publisher_name,
                        NcclVersionText(replica.nccl_version), replica_name));
  }
  std::map<std::string, std::string> theirs;
  for (const Setting& s : replica.settings) theirs.emplace(s.name, s.value);
  std::map<std::string, std::string> ours;
  for (const Setting& s : publisher.settings) ours.emplace(s.name, s.value);
  auto shown = [](const std::string& v) {
    return v.empty() ? std::string("unset") : absl::StrFormat("\"%s\"", v);
  };
  // In the publisher's order, then names only the replica sent.
  std::vector<std::string> names;
  for (const Setting& s : publisher.settings) names.push_back(s.name);
  for (const Setting& s : replica.settings) {
    if (ours.count(s.name) == 0) names.push_back(s.name);
  }
  for (const std::string& name : names) {
    const std::string a = ours.count(name) ? ours[name] : "";
    const std::string b = theirs.count(name) ? theirs[name] : "";
    if (a == b) continue;
    differences.push_back(absl::StrFormat("%s is %s on the publisher (%s) but %s on replica %s",
                                          name, shown(a), publisher_name, shown(b), replica_name));
  }
  if (differences.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "the publisher and the replica disagree on what NCCL needs both sides of a communicator to "
      "share: %s. NCCL would pick incompatible transports and fail or hang mid-transfer, so the "
      "replica is refused before any transfer; set the same values on both sides (environment or "
      "nccl.conf; unset means NCCL's default)",
      absl::StrJoin(differences, "; ")));
}

}  // namespace weightbus::internal::nccl

// SPDX-License-Identifier: Apache-2.0
// Library-wide queries: version, compiled transports, the settings registry.
#include "core/registry.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {

std::string_view LibraryVersion() { return WEIGHTBUS_VERSION_STRING; }

std::vector<std::string> Transports() {
  std::vector<std::string> out;
  for (const internal::TransportDescriptor* t : internal::RegisteredTransports()) {
    out.push_back(t->scheme);
  }
  return out;
}

std::vector<SettingInfo> DescribeSettings() {
  std::vector<const internal::SettingTable*> tables = {&internal::CoreSettings()};
  for (const internal::TransportDescriptor* t : internal::RegisteredTransports()) {
    if (t->settings != nullptr) tables.push_back(t->settings);
  }
  std::vector<SettingInfo> out;
  for (const internal::SettingTable* table : tables) {
    for (const internal::SettingSpec& spec : table->specs) {
      out.push_back(SettingInfo{std::string(table->scope), std::string(spec.name),
                                internal::TypeName(spec), std::string(spec.default_value),
                                internal::EnvName(table->scope, spec.name), std::string(spec.doc)});
    }
  }
  return out;
}

}  // namespace weightbus

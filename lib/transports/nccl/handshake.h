// SPDX-License-Identifier: Apache-2.0
// What the publisher and a replica must agree on before they build a communicator, compared
// when the replica says HELLO: a mismatch is refused at once, naming the setting and both
// values, instead of failing (or hanging) in the middle of a transfer.
//
// * The NCCL version: NCCL does not promise that ranks of different versions interoperate.
// * NCCL's settings that change which transport, protocol or algorithm it picks between two
//   ranks (AgreementSettings): when the two sides pick differently (one side with
//   NCCL_CUMEM_ENABLE=0 and cuMem-backed buffers on the other; P2P on one side and SHM on the
//   other) the connection fails or hangs at the first broadcast, long after setup.
// The tensors themselves (dtype and byte count of each) are checked per version: the replica's
// core compares the OFFER's manifest with its bound destinations before any byte moves, and the
// bucket plan with the manifest (plan.h CheckPlan).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "transports/nccl/protocol.h"

namespace weightbus::internal::nccl {

// The NCCL settings compared, in the order they are reported.
const std::vector<std::string_view>& AgreementSettings();

// This process's value of each of AgreementSettings() as NCCL itself reads it: the environment
// variable, else the line `NAME=value` of NCCL's configuration files (NCCL_CONF_FILE, or
// ~/.nccl.conf, then /etc/nccl.conf; the first that sets it), else "" (unset). NCCL's variables
// are NCCL's own configuration, not weightbus settings: this is the one place weightbus reads
// them (docs/CONVENTIONS.md). `environment` (NULL-terminated, as environ) and `home` are
// parameters for tests; nullptr: the process's.
std::vector<Setting> NcclEnvironmentSettings(char** environment = nullptr,
                                             const char* home = nullptr);

// What one side brings to the handshake.
struct Agreement {
  uint32_t nccl_version = 0;  // ncclGetVersion
  std::vector<Setting> settings;
};

// "2.28.9" from 22809 (NCCL_VERSION_CODE since 2.9: major*10000 + minor*100 + patch), or
// "2.8.4" from 2804 (before 2.9: major*1000 + minor*100 + patch).
std::string NcclVersionText(uint32_t code);

// OK when `replica` agrees with `publisher`. Errors: FailedPrecondition naming every setting
// that differs with both values and both sides, e.g. `NCCL_CUMEM_ENABLE is "0" on the publisher
// (pid 12 on trainer-0) but "1" on replica pid 40 on infer-3 (unset means NCCL's default)`; the
// message says how to fix it. A setting missing from one side's list counts as unset there.
absl::Status CompareAgreement(const Agreement& publisher, std::string_view publisher_name,
                              const Agreement& replica, std::string_view replica_name);

}  // namespace weightbus::internal::nccl

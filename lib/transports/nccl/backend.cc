// SPDX-License-Identifier: Apache-2.0
// Which Backend nccl:// uses, and the real clock.
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "transports/nccl/device.h"

namespace weightbus::internal::nccl {
namespace {

absl::Mutex& BackendMu() {
  static auto* mu = new absl::Mutex;
  return *mu;
}

std::shared_ptr<Backend>& TestBackend() {
  static auto* backend = new std::shared_ptr<Backend>;
  return *backend;
}

class AbslClock final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
  void SleepFor(absl::Duration d) override { absl::SleepFor(d); }
};

}  // namespace

std::shared_ptr<Backend> CurrentBackend() {
  absl::MutexLock lock(&BackendMu());
  if (TestBackend() != nullptr) return TestBackend();
  return CudaBackend();
}

void SetBackendForTesting(std::shared_ptr<Backend> backend) {
  absl::MutexLock lock(&BackendMu());
  TestBackend() = std::move(backend);
}

Clock& RealClock() {
  static auto* clock = new AbslClock;
  return *clock;
}

}  // namespace weightbus::internal::nccl

// SPDX-License-Identifier: Apache-2.0
// A stand-in for NCCL and CUDA behind nccl://'s device interface
// (lib/transports/nccl/device.h), for machines without a GPU (CI): "device memory" is host
// memory, a device's streams are one worker thread that runs what was enqueued in order, and a
// communicator is TCP over loopback between the ranks' processes (or threads), bootstrapped
// from its unique id as NCCL's is (the id carries the root's address). It keeps the semantics
// the transport relies on: initialization completes in the background (Poll says "in
// progress" until every rank has connected), a broadcast completes on a rank only when the
// root's bytes arrived there (a rank that never posts stalls the others), a peer that dies
// fails the communicator asynchronously (Poll returns the error), and Abort ends what is in
// flight. It is not fast and not a model of NCCL's algorithms.
//
// Install it with nccl::SetBackendForTesting(std::make_shared<LoopbackBackend>()); a forked
// child installs its own.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "transports/nccl/device.h"

namespace weightbus::testing {

class LoopbackBackend final : public internal::nccl::Backend {
 public:
  struct Options {
    uint32_t nccl_version = 22809;
    // The UUIDs of the devices this backend opens, in the order it opens them (two on "one
    // GPU": the same UUID twice); past the list, each device its own.
    std::vector<std::string> uuids;
  };
  LoopbackBackend() : LoopbackBackend(Options{}) {}
  explicit LoopbackBackend(Options options) : options_(std::move(options)) {}

  internal::nccl::BackendInfo Info() override;
  absl::StatusOr<std::unique_ptr<internal::nccl::Device>> OpenDevice(int ordinal,
                                                                     int streams) override;
  absl::StatusOr<internal::nccl::UniqueId> NewUniqueId() override;
  absl::StatusOr<std::unique_ptr<internal::nccl::Communicator>> StartCommunicator(
      internal::nccl::Device& device, const internal::nccl::UniqueId& id, int nranks,
      int rank) override;

  // Communicators started so far (all ranks, this process), for tests.
  int communicators_started() const { return started_.load(); }

 private:
  Options options_;
  std::atomic<int> devices_{0};
  std::atomic<int> started_{0};
};

}  // namespace weightbus::testing

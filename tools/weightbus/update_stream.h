// SPDX-License-Identifier: Apache-2.0
// A realistic stream of weight versions, the way RL post-training produces them: an fp32 master
// copy updated by Adam (Kingma & Ba 2015, with bias correction) every step and cast to bf16 for
// publishing. Gradients are synthetic: per element, fresh Gaussian noise plus a persistent
// component fixed for the whole stream (signal-to-noise ratio `snr`), which gives Adam the
// mostly-small, occasionally-correlated steps of real fine-tuning.
//
// Deterministic: the same master, seed and options give bit-identical versions on any machine
// (a counter-based generator, splitmix64 + Box-Muller, no library distribution whose output
// differs between standard libraries). Each tensor draws from its own stream keyed by
// (seed, tensor index, step), so tensors can be processed in parallel.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "weightbus/llama2c.h"

namespace weightbus::tools {

struct AdamOptions {
  double lr = 1e-5;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_scale = 1e-3;  // standard deviation of the noise part of each gradient element
  double snr = 0.1;          // std(persistent part) / std(noise part)
  uint64_t seed = 1;
};

class UpdateStream {
 public:
  // `master` holds F32 tensors (copied). Errors: InvalidArgument for a non-F32 tensor.
  static absl::StatusOr<UpdateStream> Create(const std::vector<OwnedTensor>& master,
                                             const AdamOptions& options);

  // Applies one Adam step to the master copy.
  void Step();
  // Steps taken so far (0 after Create).
  uint64_t step() const { return step_; }

  // The current weights cast to BF16 (round to nearest even), in the master's order and names.
  std::vector<OwnedTensor> Bf16() const;
  // The fp32 master copy.
  const std::vector<OwnedTensor>& master() const { return master_; }

 private:
  std::vector<OwnedTensor> master_;
  std::vector<std::vector<float>> m_, v_;
  AdamOptions options_;
  uint64_t step_ = 0;
};

// Fraction of elements whose bit pattern differs between two versions with the same tensors
// (0 when they have no elements).
double ChangedFraction(const std::vector<OwnedTensor>& a, const std::vector<OwnedTensor>& b);

}  // namespace weightbus::tools

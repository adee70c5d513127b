// SPDX-License-Identifier: Apache-2.0
// A realistic stream of weight versions, the way RL post-training produces them: an fp32 master
// copy updated by Adam (Kingma & Ba 2015, with bias correction) every step and cast to bf16 for
// publishing. Gradients are synthetic: per element, fresh Gaussian noise plus a persistent
// component fixed for the whole stream (signal-to-noise ratio `snr`), which gives Adam the
// mostly-small, occasionally-correlated steps of real fine-tuning.
//
// Deterministic: the same master, seed and options give bit-identical versions for any number of
// threads (a counter-based generator: element i of tensor t at step s draws from splitmix64 of
// (seed, t, s) and i, then Box-Muller in float with polynomial log, sine and cosine, so no
// library function or distribution whose output differs between platforms is involved). The
// work is split into blocks of elements processed in parallel; 494M parameters take about a
// second per step per core.
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
  int threads = 0;  // 0: one per hardware thread; the output does not depend on it
};

class UpdateStream {
 public:
  // `master` holds F32 tensors (copied). Errors: InvalidArgument for a non-F32 tensor.
  static absl::StatusOr<UpdateStream> Create(const std::vector<OwnedTensor>& master,
                                             const AdamOptions& options);
  // The same, taking the master over (no copy: for models of several GiB).
  static absl::StatusOr<UpdateStream> Create(std::vector<OwnedTensor>&& master,
                                             const AdamOptions& options);

  // Applies one Adam step to the master copy.
  void Step();
  // Steps taken so far (0 after Create).
  uint64_t step() const { return step_; }

  // The current weights cast to BF16 (round to nearest even), in the master's order and names.
  std::vector<OwnedTensor> Bf16() const;
  // The same into `out`, reusing its buffers (parallel).
  void Bf16Into(std::vector<OwnedTensor>* out) const;
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

// How a version differs from the previous one, and the entropy floor of that difference: zero-
// order empirical entropies over all elements of the model, in bits per element
// (docs/PERFORMANCE.md, "entropy floor"). With p = changed / elements:
//   mask_bits   = H(p) = -p log2 p - (1 - p) log2 (1 - p): which elements changed
//   value_bits  = entropy of the changed elements' new bit patterns
//   change_bits = entropy of their changes, (new - old) as wrapping integers of the element
//                 width (what a decoder that has the old value needs)
struct StepStatistics {
  uint64_t elements = 0;
  uint64_t changed = 0;
  double mask_bits = 0;
  double value_bits = 0;
  double change_bits = 0;

  double changed_fraction() const {
    return elements == 0 ? 0 : static_cast<double>(changed) / static_cast<double>(elements);
  }
  // The floor as the issue defines it: mask plus the new values of the changed elements.
  double floor_bits() const { return mask_bits + changed_fraction() * value_bits; }
  // With the changes instead of the new values: lower, and the one a delta coder competes with.
  double change_floor_bits() const { return mask_bits + changed_fraction() * change_bits; }
};

// Standard normal samples for elements [begin, begin + n) of the stream `key` (begin and n even):
// Box-Muller on pairs of 24-bit uniforms from splitmix64 of (key, pair index), in float with
// polynomial log, sine and cosine (absolute error below 1e-6 against libm, tails to 5.9
// sigma). Element i depends only on (key, i): any split of the work gives the same values.
void StandardNormals(uint64_t key, uint64_t begin, size_t n, float* out);

// Compares two versions with the same tensors (element by element, all dtypes pooled).
StepStatistics CompareVersions(const std::vector<OwnedTensor>& before,
                               const std::vector<OwnedTensor>& after);

}  // namespace weightbus::tools

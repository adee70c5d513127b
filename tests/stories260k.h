// SPDX-License-Identifier: Apache-2.0
// The stories260K fixture (../shared/fixtures) converted to Hugging Face Llama tensors in F32,
// as wb_test_peer publish-llama publishes it: loaded once per test binary, then shared
// read-only. For tests that link the tools library (weightbus_test).
#pragma once

#include <vector>

#include <gtest/gtest.h>

#include "test_support.h"
#include "weightbus/llama2c.h"

namespace weightbus::testing {

// The converted fixture; a read or conversion error fails the calling test (and yields an
// empty model).
inline const std::vector<tools::OwnedTensor>& Stories260K() {
  static const auto* model = [] {
    auto ckpt = tools::ReadLlama2c(FixturePath("stories260K.bin"));
    EXPECT_TRUE(ckpt.ok()) << ckpt.status();
    if (!ckpt.ok()) return new std::vector<tools::OwnedTensor>();
    auto m = tools::ConvertToHf(*ckpt, DType::kF32);
    EXPECT_TRUE(m.ok()) << m.status();
    return new std::vector<tools::OwnedTensor>(m.ok() ? *std::move(m)
                                                      : std::vector<tools::OwnedTensor>());
  }();
  return *model;
}

}  // namespace weightbus::testing

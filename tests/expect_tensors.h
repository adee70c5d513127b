// SPDX-License-Identifier: Apache-2.0
// Assertions on received updates, shared by the suites of the public API.
#pragma once

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "test_model.h"
#include "test_support.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::testing {

// Asserts that `update` holds exactly `expected`, in order, byte for byte: names, dtypes,
// shapes, the manifest's XXH3 against the expected bytes, and the bytes behind each view
// (contiguous views; a strided bound destination is checked by its test).
inline void ExpectSameTensors(const Update& update, const std::vector<OwnedTensor>& expected) {
  ASSERT_EQ(update.tensors().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const TensorView& got = update.tensors()[i];
    const OwnedTensor& want = expected[i];
    ASSERT_EQ(got.name, want.name);
    ASSERT_EQ(got.dtype, want.dtype) << want.name;
    ASSERT_EQ(got.shape, want.shape) << want.name;
    ASSERT_EQ(update.manifest().tensors[i].xxh3, Xxh3(want.bytes.data(), want.bytes.size()))
        << want.name;
    if (!want.bytes.empty() && got.strides.empty()) {
      ASSERT_EQ(std::memcmp(got.data, want.bytes.data(), want.bytes.size()), 0) << want.name;
    }
  }
}

}  // namespace weightbus::testing

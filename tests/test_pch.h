// SPDX-License-Identifier: Apache-2.0
// The headers nearly every test file includes (GoogleTest, GoogleMock, Abseil's status, strings
// and time, the standard library's containers and files), compiled once into a precompiled
// header that every test target reuses (tests/CMakeLists.txt: WEIGHTBUS_TEST_PCH) instead of being
// parsed again in each of the ~35 test files. Each test file still includes what it uses.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

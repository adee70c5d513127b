# SPDX-License-Identifier: Apache-2.0
# Sanitizer builds (scripts/sanitize.sh; docs/TESTING.md, "Sanitizers").
#
# WEIGHTBUS_SANITIZE: the sanitizers every target of this project is compiled and linked with,
# as -fsanitize takes them: "address,undefined" (AddressSanitizer + UndefinedBehaviorSanitizer, a
# UB report aborts the test) or "thread" (ThreadSanitizer). Empty (the default): none.
#
# WEIGHTBUS_ABSL_SOURCE_DIR: an Abseil source tree built inside this build, with the same flags,
# instead of the installed Abseil (find_package). ThreadSanitizer needs it: Debian's libabsl is
# not compiled with -fsanitize=thread, so TSan cannot see absl::Mutex's lock and unlock and reports
# every access it guards as a race. scripts/sanitize.sh --tsan fetches the source of the Debian
# package this system has installed (apt-get source abseil=<installed version>), so the headers and
# options (ABSL_OPTION_*, the inline namespace) are Debian's; only the libraries we link are built.
set(WEIGHTBUS_SANITIZE "" CACHE STRING
    "Sanitizers for every target (-fsanitize=...): address,undefined or thread; empty: none")
set(WEIGHTBUS_ABSL_SOURCE_DIR "" CACHE PATH
    "Build Abseil from this source tree with this build's flags instead of find_package(absl)")

if(WEIGHTBUS_SANITIZE)
  string(REPLACE "," ";" _wb_sanitizers "${WEIGHTBUS_SANITIZE}")
  foreach(_wb_s IN LISTS _wb_sanitizers)
    if(NOT _wb_s MATCHES "^(address|undefined|thread)$")
      message(FATAL_ERROR "WEIGHTBUS_SANITIZE=${WEIGHTBUS_SANITIZE}: \"${_wb_s}\" is not one of "
                          "address, undefined, thread")
    endif()
  endforeach()
  if("thread" IN_LIST _wb_sanitizers AND "address" IN_LIST _wb_sanitizers)
    message(FATAL_ERROR "WEIGHTBUS_SANITIZE=${WEIGHTBUS_SANITIZE}: thread and address cannot be "
                        "combined (two builds: address,undefined and thread)")
  endif()
  set(_wb_sanitize_flags -fsanitize=${WEIGHTBUS_SANITIZE} -fno-omit-frame-pointer)
  if("undefined" IN_LIST _wb_sanitizers)
    # Every UB report is an error (a test fails), not a line in a log.
    list(APPEND _wb_sanitize_flags -fno-sanitize-recover=undefined)
  endif()
  # Directory-wide: every target defined after this (ours, and Abseil's when built in-tree); C
  # and C++ only (nvcc takes none of these; the device kernels are not instrumented).
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${_wb_sanitize_flags}>")
  add_link_options(${_wb_sanitize_flags})
  message(STATUS "weightbus: sanitizers ${WEIGHTBUS_SANITIZE}")
endif()

# Abseil from source, as shared libraries (one copy of its globals for libweightbus.so and the
# test executables, as with Debian's libabsl), with default visibility (Abseil marks no exports),
# only the libraries something links (EXCLUDE_FROM_ALL). Called by WeightbusDependencies.
function(weightbus_add_absl_from_source)
  if(NOT EXISTS "${WEIGHTBUS_ABSL_SOURCE_DIR}/CMakeLists.txt")
    message(FATAL_ERROR "WEIGHTBUS_ABSL_SOURCE_DIR=${WEIGHTBUS_ABSL_SOURCE_DIR} is not an Abseil "
                        "source tree (no CMakeLists.txt)")
  endif()
  set(BUILD_SHARED_LIBS ON)
  set(CMAKE_CXX_VISIBILITY_PRESET default)
  set(CMAKE_VISIBILITY_INLINES_HIDDEN OFF)
  set(ABSL_PROPAGATE_CXX_STD ON)
  set(ABSL_BUILD_TESTING OFF)
  # Our install(EXPORT) names the absl targets weightbus links: they need an export set of their
  # own (nothing of a sanitizer build is meant to be installed).
  set(ABSL_ENABLE_INSTALL ON)
  add_subdirectory(${WEIGHTBUS_ABSL_SOURCE_DIR} ${PROJECT_BINARY_DIR}/_deps/absl EXCLUDE_FROM_ALL)
endfunction()

# SPDX-License-Identifier: Apache-2.0
# Every dependency comes from a Debian package; none is vendored.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(absl REQUIRED)
find_package(dlpack REQUIRED)  # libdlpack-dev: DLTensor in the C API
find_package(nlohmann_json 3.10 REQUIRED)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
pkg_check_modules(ZSTD REQUIRED IMPORTED_TARGET libzstd)
pkg_check_modules(LIBURING REQUIRED IMPORTED_TARGET liburing)

set(WEIGHTBUS_TRANSPORTS "")

# Resolves an AUTO/ON/OFF option against whether the dependency was found.
function(weightbus_resolve_option option found what)
  if("${${option}}" STREQUAL "AUTO")
    set(${option} ${found} PARENT_SCOPE)
  elseif(${option} AND NOT ${found})
    message(FATAL_ERROR "${option}=ON but ${what} was not found")
  endif()
endfunction()

if(WEIGHTBUS_WITH_DISK)
  list(APPEND WEIGHTBUS_TRANSPORTS disk)
endif()
if(WEIGHTBUS_WITH_DELTA)
  list(APPEND WEIGHTBUS_TRANSPORTS delta)
endif()

pkg_check_modules(UCX QUIET IMPORTED_TARGET ucx)
set(_ucx_found ${UCX_FOUND})
if(NOT _ucx_found)
  set(_ucx_found OFF)
endif()
weightbus_resolve_option(WEIGHTBUS_WITH_UCX _ucx_found "UCX (libucx-dev)")
if(WEIGHTBUS_WITH_UCX)
  list(APPEND WEIGHTBUS_TRANSPORTS ucx)
endif()

find_package(CUDAToolkit QUIET)
set(_cuda_found ${CUDAToolkit_FOUND})
if(NOT _cuda_found)
  set(_cuda_found OFF)
endif()
weightbus_resolve_option(WEIGHTBUS_WITH_CUDA _cuda_found "the CUDA toolkit")

find_library(NCCL_LIBRARY nccl HINTS /usr/local/cuda/lib64 ${CUDAToolkit_LIBRARY_DIR})
find_path(NCCL_INCLUDE_DIR nccl.h HINTS /usr/local/cuda/include ${CUDAToolkit_INCLUDE_DIRS})
if(NCCL_LIBRARY AND NCCL_INCLUDE_DIR AND WEIGHTBUS_WITH_CUDA)
  set(_nccl_found ON)
else()
  set(_nccl_found OFF)
endif()
weightbus_resolve_option(WEIGHTBUS_WITH_NCCL _nccl_found "NCCL with CUDA")


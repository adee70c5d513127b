# SPDX-License-Identifier: Apache-2.0
# Every dependency comes from a Debian package; none is vendored.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
if(WEIGHTBUS_ABSL_SOURCE_DIR)
  weightbus_add_absl_from_source()  # WeightbusSanitize.cmake (the ThreadSanitizer build)
else()
  find_package(absl REQUIRED)
endif()
find_package(dlpack REQUIRED)  # libdlpack-dev: DLTensor in the C API
find_package(nlohmann_json 3.10 REQUIRED)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
# libsodium-dev: the manifest MAC and the ucx peer handshake of channels with a shared secret
# (lib/core/secret.*). Required, so that no build can silently ignore a configured secret.
pkg_check_modules(SODIUM REQUIRED IMPORTED_TARGET libsodium)
# Each transport's dependency is looked for only when it is built. WEIGHTBUS_PKG_MODULES: the
# pkg-config modules libweightbus links (for weightbus.pc's Libs.private, WeightbusInstall).
set(WEIGHTBUS_PKG_MODULES XXHASH SODIUM)
if(WEIGHTBUS_WITH_DELTA)
  pkg_check_modules(ZSTD REQUIRED IMPORTED_TARGET libzstd)
  list(APPEND WEIGHTBUS_PKG_MODULES ZSTD)
endif()
if(WEIGHTBUS_WITH_DISK)
  pkg_check_modules(LIBURING REQUIRED IMPORTED_TARGET liburing)
  list(APPEND WEIGHTBUS_PKG_MODULES LIBURING)
endif()

set(WEIGHTBUS_TRANSPORTS "")

# Resolves an AUTO/ON/OFF option against whether the dependency was found.
function(weightbus_resolve_option option found what)
  if("${${option}}" STREQUAL "AUTO")
    set(${option} ${${found}} PARENT_SCOPE)
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
  list(APPEND WEIGHTBUS_PKG_MODULES UCX)
endif()

# CUDA: the runtime (CUDA::cudart) and nvcc for the core's kernels (lib/core/cuda/kernels.cu:
# device checksums, packing strided views). AUTO builds with CUDA when both are there.
find_package(CUDAToolkit QUIET)
set(_cuda_found ${CUDAToolkit_FOUND})
if(_cuda_found AND NOT "${WEIGHTBUS_WITH_CUDA}" STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND CUDAToolkit_NVCC_EXECUTABLE)
    set(CMAKE_CUDA_COMPILER ${CUDAToolkit_NVCC_EXECUTABLE})
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    message(STATUS "weightbus: the CUDA runtime is there but no usable CUDA compiler (nvcc)")
    set(_cuda_found OFF)
  endif()
endif()
if(NOT _cuda_found)
  set(_cuda_found OFF)
endif()
weightbus_resolve_option(WEIGHTBUS_WITH_CUDA _cuda_found "the CUDA toolkit with nvcc")
if(WEIGHTBUS_WITH_CUDA)
  # Hopper (sm_90) and Ampere (sm_80) code, and PTX of sm_90 that the driver compiles for newer
  # GPUs (Blackwell); a cache entry, so a build for other GPUs sets its own.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "80-real;90-real;90-virtual" CACHE STRING
        "CUDA architectures of the core's kernels")
  endif()
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)  # the one CUDA::cudart the library links
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  enable_language(CUDA)
  message(STATUS "weightbus: CUDA ${CUDAToolkit_VERSION}, kernels for ${CMAKE_CUDA_ARCHITECTURES}")
endif()

# nccl:// needs a build with CUDA (WEIGHTBUS_WITH_CUDA: CUDA=OFF means no CUDA at all) and NCCL
# (nccl.h and libnccl, looked for next to the CUDA toolkit, under NCCL_ROOT, and in the system's
# paths).
set(_nccl_found OFF)
if(WEIGHTBUS_WITH_CUDA)
  find_path(WEIGHTBUS_NCCL_INCLUDE_DIR nccl.h
            HINTS ${NCCL_ROOT} ENV NCCL_ROOT ${CUDAToolkit_INCLUDE_DIRS}
            PATH_SUFFIXES include)
  find_library(WEIGHTBUS_NCCL_LIBRARY nccl
               HINTS ${NCCL_ROOT} ENV NCCL_ROOT ${CUDAToolkit_LIBRARY_DIR}
               PATH_SUFFIXES lib lib64)
  if(WEIGHTBUS_NCCL_INCLUDE_DIR AND WEIGHTBUS_NCCL_LIBRARY)
    set(_nccl_found ON)
    if(NOT TARGET Weightbus::nccl)
      add_library(Weightbus::nccl UNKNOWN IMPORTED)
      set_target_properties(Weightbus::nccl PROPERTIES
        IMPORTED_LOCATION "${WEIGHTBUS_NCCL_LIBRARY}"
        INTERFACE_INCLUDE_DIRECTORIES "${WEIGHTBUS_NCCL_INCLUDE_DIR}")
    endif()
  endif()
endif()
weightbus_resolve_option(WEIGHTBUS_WITH_NCCL _nccl_found
                         "NCCL with a CUDA build (WEIGHTBUS_WITH_CUDA; nccl.h, libnccl)")
if(WEIGHTBUS_WITH_NCCL)
  list(APPEND WEIGHTBUS_TRANSPORTS nccl)
endif()

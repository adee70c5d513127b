/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The C API from plain C (compiled as C11, linking libweightbus.so as users do): a publisher in
 * this process and a subscriber in a forked child process exchange versions over disk://; the
 * library lists, shards, layer figures (delta+disk), exact-version receive and WaitForReceivers
 * (ucx:// over loopback, when built) in this process. Every byte, dtype, error code and message is
 * checked. Uses nothing but weightbus.h (and POSIX sockets to find a free port).
 *
 * WB_TEST_TRANSPORTS (from CMake) is the comma-separated, sorted list of the schemes this build
 * compiles in: wb_transport_* must report exactly these.
 */
#define _XOPEN_SOURCE 700
#include <arpa/inet.h>
#include <dlpack/dlpack.h>
#include <ftw.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "weightbus/weightbus.h"

#ifndef WB_TEST_TRANSPORTS
#error "define WB_TEST_TRANSPORTS, the comma-separated schemes of this build (tests/CMakeLists.txt)"
#endif

static int failures = 0;

#define CHECK(cond)                                                                            \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      fprintf(stderr, "%s:%d: [pid %d] CHECK failed: %s\n", __FILE__, __LINE__, (int)getpid(), \
              #cond);                                                                          \
      ++failures;                                                                              \
    }                                                                                          \
  } while (0)

/* Checks that `call` returned `expected` and that the thread's message contains `needle`. */
#define CHECK_STATUS(call, expected, needle)                                         \
  do {                                                                               \
    wb_status_t s_ = (call);                                                         \
    const char* m_ = wb_last_error_message();                                        \
    if (s_ != (expected) || strstr(m_, (needle)) == NULL) {                          \
      fprintf(stderr,                                                                \
              "%s:%d: [pid %d] %s\n  returned %s\n  expected %s\n  message \"%s\"\n" \
              "  should contain \"%s\"\n",                                           \
              __FILE__, __LINE__, (int)getpid(), #call, wb_status_string(s_),        \
              wb_status_string(expected), m_, (needle));                             \
      ++failures;                                                                    \
    }                                                                                \
  } while (0)

#define CHECK_OK(call) CHECK_STATUS(call, WB_OK, "")

/* A DLTensor on the CPU. */
static DLTensor Tensor(void* data, int ndim, int64_t* shape, int64_t* strides, uint8_t code,
                       uint8_t bits) {
  DLTensor t;
  memset(&t, 0, sizeof(t));
  t.data = data;
  t.device.device_type = kDLCPU;
  t.device.device_id = 0;
  t.ndim = ndim;
  t.dtype.code = code;
  t.dtype.bits = bits;
  t.dtype.lanes = 1;
  t.shape = shape;
  t.strides = strides;
  t.byte_offset = 0;
  return t;
}

/* ---- What version 1 holds (the child recomputes it to compare) ---- */
static float w_f32[2][3];     /* "w": F32 [2, 3] */
static uint16_t e_bf16[4];    /* "e": BF16 [4] via kDLBfloat */
static uint16_t u_bf16[2][2]; /* "u": BF16 [2, 2] as uint16 with a dtype override */
static float big[3][4];       /* "t": F32 [4, 2]: the transpose of big[1..2][*] (strided) */
static uint8_t flags[5];      /* "flags": BOOL [5] as uint8 with an override */
static uint8_t fp8[3];        /* "fp8": F8_E4M3 [3] as uint8 with an override */
static double scalar = 2.5;   /* "scalar": F64, 0-d */
static int32_t empty_data[1]; /* "empty": I32 [0, 4] */

static void Fill(uint32_t seed) {
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) w_f32[i][j] = (float)(seed * 100 + i * 3 + j) + 0.25f;
  for (int i = 0; i < 4; ++i) e_bf16[i] = (uint16_t)(0x3f80 + seed + i);
  for (int i = 0; i < 4; ++i) u_bf16[i / 2][i % 2] = (uint16_t)(0x4000 + seed * 7 + i);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) big[i][j] = (float)(seed * 1000 + i * 10 + j);
  for (int i = 0; i < 5; ++i) flags[i] = (uint8_t)((i + seed) % 2);
  for (int i = 0; i < 3; ++i) fp8[i] = (uint8_t)(0x38 + seed + i);
  scalar = 2.5 + seed;
}

static int64_t shape_w[] = {2, 3}, shape_e[] = {4}, shape_u[] = {2, 2}, shape_t[] = {4, 2},
               strides_t[] = {1, 4}, shape_flags[] = {5}, shape_fp8[] = {3}, shape_empty[] = {0, 4};
static const char* const names[] = {"w", "e", "u", "t", "flags", "fp8", "scalar", "empty"};
enum { kNumTensors = 8 };

/* The version's tensors over the buffers above, and their dtype overrides. */
static const wb_dtype_t dtypes[kNumTensors] = {
    WB_DTYPE_FROM_DLPACK, WB_DTYPE_FROM_DLPACK, WB_DTYPE_BF16,        WB_DTYPE_FROM_DLPACK,
    WB_DTYPE_BOOL,        WB_DTYPE_F8_E4M3,     WB_DTYPE_FROM_DLPACK, WB_DTYPE_FROM_DLPACK};
static void MakeTensors(DLTensor tensors[kNumTensors]) {
  tensors[0] = Tensor(w_f32, 2, shape_w, NULL, kDLFloat, 32);
  tensors[1] = Tensor(e_bf16, 1, shape_e, NULL, kDLBfloat, 16);
  tensors[2] = Tensor(u_bf16, 2, shape_u, NULL, kDLUInt, 16);
  /* t[i][j] = big[1 + j][i]: base pointer big, byte_offset one row, transposed strides. */
  tensors[3] = Tensor(big, 2, shape_t, strides_t, kDLFloat, 32);
  tensors[3].byte_offset = 4 * sizeof(float);
  tensors[4] = Tensor(flags, 1, shape_flags, NULL, kDLUInt, 8);
  tensors[5] = Tensor(fp8, 1, shape_fp8, NULL, kDLUInt, 8);
  tensors[6] = Tensor(&scalar, 0, NULL, NULL, kDLFloat, 64);
  tensors[7] = Tensor(empty_data, 2, shape_empty, NULL, kDLInt, 32);
}

static wb_status_t PublishVersion(wb_publisher_t* publisher, uint64_t version) {
  Fill((uint32_t)version);
  DLTensor tensors[kNumTensors];
  MakeTensors(tensors);
  char step[32];
  snprintf(step, sizeof(step), "%llu", (unsigned long long)version);
  const wb_option_t metadata[] = {{"step", step}, {"origin", "capi_test.c"}};
  wb_publish_params_t params = WB_PUBLISH_PARAMS_INIT;
  params.metadata = metadata;
  params.num_metadata = 2;
  params.dtypes = dtypes;
  return wb_publisher_publish(publisher, version, names, tensors, kNumTensors, &params, 30000);
}

/* Checks every tensor of `update` against what PublishVersion(version) published. */
static void CheckUpdate(const wb_update_t* update, uint64_t version) {
  Fill((uint32_t)version);
  uint64_t v = 0;
  CHECK_OK(wb_update_version(update, &v));
  CHECK(v == version);
  size_t n = 0;
  CHECK_OK(wb_update_num_tensors(update, &n));
  CHECK(n == kNumTensors);
  const wb_dtype_t expected_dtypes[kNumTensors] = {WB_DTYPE_F32, WB_DTYPE_BF16, WB_DTYPE_BF16,
                                                   WB_DTYPE_F32, WB_DTYPE_BOOL, WB_DTYPE_F8_E4M3,
                                                   WB_DTYPE_F64, WB_DTYPE_I32};
  for (size_t i = 0; i < n && i < kNumTensors; ++i) {
    const char* name = NULL;
    wb_dtype_t dtype = WB_DTYPE_FROM_DLPACK;
    const DLTensor* t = NULL;
    CHECK_OK(wb_update_tensor(update, i, &name, &dtype, &t));
    CHECK(strcmp(name, names[i]) == 0);
    CHECK(dtype == expected_dtypes[i]);
    CHECK(t->device.device_type == kDLCPU);
    size_t index = 99;
    CHECK_OK(wb_update_find(update, names[i], &index));
    CHECK(index == i);
  }
  const DLTensor* t = NULL;
  /* w */
  CHECK_OK(wb_update_tensor(update, 0, NULL, NULL, &t));
  CHECK(t->ndim == 2 && t->shape[0] == 2 && t->shape[1] == 3);
  CHECK(t->dtype.code == kDLFloat && t->dtype.bits == 32 && t->dtype.lanes == 1);
  for (int i = 0; i < 2; ++i) { /* strided when bound to a strided destination */
    for (int j = 0; j < 3; ++j) {
      const int64_t at = t->strides ? i * t->strides[0] + j * t->strides[1] : i * 3 + j;
      CHECK(((const float*)t->data)[at] == w_f32[i][j]);
    }
  }
  /* e: kDLBfloat both ways */
  CHECK_OK(wb_update_tensor(update, 1, NULL, NULL, &t));
  CHECK(t->dtype.code == kDLBfloat && t->dtype.bits == 16);
  CHECK(memcmp(t->data, e_bf16, sizeof(e_bf16)) == 0);
  /* u: published as uint16 + BF16 override, received as bfloat16 */
  CHECK_OK(wb_update_tensor(update, 2, NULL, NULL, &t));
  CHECK(t->dtype.code == kDLBfloat && t->dtype.bits == 16);
  CHECK(memcmp(t->data, u_bf16, sizeof(u_bf16)) == 0);
  /* t: the strided view arrives packed row-major */
  CHECK_OK(wb_update_tensor(update, 3, NULL, NULL, &t));
  CHECK(t->ndim == 2 && t->shape[0] == 4 && t->shape[1] == 2 && t->strides == NULL);
  const float* packed = (const float*)t->data;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j) CHECK(packed[i * 2 + j] == big[1 + j][i]);
  /* flags and fp8: uint8 on the wire of DLPack 0.6, the real type in the wb_dtype_t */
  CHECK_OK(wb_update_tensor(update, 4, NULL, NULL, &t));
  CHECK(t->dtype.code == kDLUInt && t->dtype.bits == 8);
  CHECK(memcmp(t->data, flags, sizeof(flags)) == 0);
  CHECK_OK(wb_update_tensor(update, 5, NULL, NULL, &t));
  CHECK(t->dtype.code == kDLUInt && t->dtype.bits == 8);
  CHECK(memcmp(t->data, fp8, sizeof(fp8)) == 0);
  /* scalar: 0-d */
  CHECK_OK(wb_update_tensor(update, 6, NULL, NULL, &t));
  CHECK(t->ndim == 0 && *(const double*)t->data == scalar);
  /* empty */
  CHECK_OK(wb_update_tensor(update, 7, NULL, NULL, &t));
  CHECK(t->ndim == 2 && t->shape[0] == 0 && t->shape[1] == 4);

  const char* json = NULL;
  size_t length = 0;
  CHECK_OK(wb_update_manifest_json(update, &json, &length));
  CHECK(strlen(json) == length);
  CHECK(strstr(json, "\"origin\": \"capi_test.c\"") != NULL ||
        strstr(json, "\"origin\":\"capi_test.c\"") != NULL);
  CHECK(strstr(json, "F8_E4M3") != NULL);

  wb_update_stats_t stats = WB_UPDATE_STATS_INIT;
  CHECK_OK(wb_update_stats(update, &stats));
  CHECK(stats.bytes == sizeof(w_f32) + sizeof(e_bf16) + sizeof(u_bf16) + 8 * sizeof(float) +
                           sizeof(flags) + sizeof(fp8) + sizeof(double));
  CHECK(stats.ready_unix_ns > 0);
  CHECK(stats.wire_bytes == stats.bytes && stats.decode_ns == 0); /* no layer */
  /* A caller compiled before decode_ns existed gets the fields it has, nothing beyond. */
  wb_update_stats_t before_decode = WB_UPDATE_STATS_INIT;
  before_decode.struct_size = offsetof(wb_update_stats_t, decode_ns);
  before_decode.wire_bytes = 42;
  CHECK_OK(wb_update_stats(update, &before_decode));
  CHECK(before_decode.bytes == stats.bytes && before_decode.wire_bytes == 42);

  CHECK_STATUS(wb_update_tensor(update, kNumTensors, NULL, NULL, &t), WB_OUT_OF_RANGE,
               "tensor index 8 is past the end");
  size_t index = 0;
  CHECK_STATUS(wb_update_find(update, "nope", &index), WB_NOT_FOUND, "no tensor named \"nope\"");
}

/* The subscriber process: receives version 1, then binds and blocks for version 2, which the
 * parent publishes only after the child said (through `ready_fd`) that it is waiting. */
static int Child(const char* uri, int ready_fd) {
  failures = 0; /* the exit status reports this process's checks only */
  wb_subscriber_t* sub = NULL;
  CHECK_OK(wb_subscriber_create(uri, NULL, &sub));
  if (sub == NULL) return 1;
  bool has = true;
  uint64_t current = 7;
  CHECK_OK(wb_subscriber_current_version(sub, &has, &current));
  CHECK(!has && current == 0);

  wb_update_t* update = NULL;
  CHECK_OK(wb_subscriber_wait(sub, 1, 30000, &update));
  if (update != NULL) CheckUpdate(update, 1);
  CHECK_OK(wb_subscriber_current_version(sub, &has, &current));
  CHECK(has && current == 1);

  /* A binding that does not match version 1's "w" (F32 [2, 3]) fails the wait, naming both
   * sides, and writes nothing. */
  float wrong[3][2];
  memset(wrong, 0x7f, sizeof(wrong));
  int64_t wrong_shape[] = {3, 2};
  DLTensor wrong_dest = Tensor(wrong, 2, wrong_shape, NULL, kDLFloat, 32);
  CHECK_OK(wb_subscriber_bind(sub, "w", &wrong_dest, NULL));
  wb_update_t* bad = NULL;
  CHECK_STATUS(wb_subscriber_wait(sub, 1, 30000, &bad), WB_INVALID_ARGUMENT,
               "is F32 [2, 3] but its bound destination is F32 [3, 2]; nothing was written");
  CHECK(bad == NULL);
  CHECK(((const uint8_t*)wrong)[0] == 0x7f);

  /* Now bind "w" to a column-major (strided) buffer and "t" to a contiguous one. */
  float w_colmajor[3][2];
  int64_t w_shape[] = {2, 3}, w_strides[] = {1, 2};
  DLTensor w_dest = Tensor(w_colmajor, 2, w_shape, w_strides, kDLFloat, 32);
  CHECK_OK(wb_subscriber_bind(sub, "w", &w_dest, NULL));
  float t_dest_data[4][2];
  DLTensor t_dest = Tensor(t_dest_data, 2, shape_t, NULL, kDLFloat, 32);
  CHECK_OK(wb_subscriber_bind(sub, "t", &t_dest, NULL));
  /* Binding with a bf16 override over uint16 memory, then unbinding it again. */
  uint16_t u_dest_data[2][2];
  DLTensor u_dest = Tensor(u_dest_data, 2, shape_u, NULL, kDLUInt, 16);
  wb_bind_params_t bind_params = WB_BIND_PARAMS_INIT;
  bind_params.dtype = WB_DTYPE_BF16;
  CHECK_OK(wb_subscriber_bind(sub, "u", &u_dest, &bind_params));
  CHECK_OK(wb_subscriber_unbind(sub, "u"));

  /* Nothing newer than 1 yet: a short wait times out (retryable). */
  wb_update_t* none = NULL;
  wb_status_t s = wb_subscriber_wait(sub, 2, 50, &none);
  CHECK(s == WB_DEADLINE_EXCEEDED && WB_STATUS_IS_RETRYABLE(s) && none == NULL);
  CHECK(strstr(wb_last_error_message(), "2") != NULL);
  /* The same with separate find and receive bounds. */
  s = wb_subscriber_wait_then_receive(sub, 2, 50, 10000, &none);
  CHECK(s == WB_DEADLINE_EXCEEDED && none == NULL);

  /* Polling does not wait: nothing newer than 1 gives WB_OK and no update. */
  wb_update_t* polled = (wb_update_t*)0x1;
  CHECK_OK(wb_subscriber_poll(sub, 2, 30000, &polled));
  CHECK(polled == NULL);

  char go = 'w';
  CHECK(write(ready_fd, &go, 1) == 1);
  wb_update_t* second = NULL;
  CHECK_OK(wb_subscriber_wait(sub, 2, 30000, &second));
  if (second != NULL) {
    Fill(2);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) CHECK(w_colmajor[j][i] == w_f32[i][j]);
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 2; ++j) CHECK(t_dest_data[i][j] == big[1 + j][i]);
    /* The update's views of bound tensors are the destinations themselves. */
    const DLTensor* t = NULL;
    CHECK_OK(wb_update_tensor(second, 0, NULL, NULL, &t));
    CHECK(t->data == (void*)w_colmajor && t->strides != NULL && t->strides[1] == 2);
    CheckUpdate(second, 2);
  }
  wb_update_destroy(second);
  wb_update_destroy(update);
  wb_subscriber_destroy(sub);
  return failures == 0 ? 0 : 1;
}

/* wb_subscriber_receive_version: exactly the version asked for, never the newest instead; a
 * retired one is WB_NOT_FOUND naming what the channel holds; below the current one is
 * WB_FAILED_PRECONDITION; a future one times out (retryable). */
static void TestReceiveVersion(const char* dir) {
  char uri[512];
  snprintf(uri, sizeof(uri), "disk://%s/exact?fsync=false&retention=2", dir);
  wb_publisher_t* pub = NULL;
  CHECK_OK(wb_publisher_create(uri, NULL, &pub));
  if (pub == NULL) return;
  for (uint64_t v = 1; v <= 3; ++v) CHECK_OK(PublishVersion(pub, v));
  wb_publisher_destroy(pub); /* finishes its retention pass: versions 2 and 3 stay */

  wb_subscriber_t* sub = NULL;
  CHECK_OK(wb_subscriber_create(uri, NULL, &sub));
  if (sub == NULL) return;
  wb_update_t* update = (wb_update_t*)0x1;
  CHECK_STATUS(wb_subscriber_receive_version(sub, 1, 30000, 0, &update), WB_NOT_FOUND,
               "version 1 is no longer on the channel (it holds 2, 3; newest seen: 3)");
  CHECK(update == (wb_update_t*)0x1); /* outputs are written only on WB_OK */
  update = NULL;
  CHECK_OK(wb_subscriber_receive_version(sub, 2, 30000, 0, &update));
  if (update != NULL) CheckUpdate(update, 2); /* version 2's bytes although 3 is there */
  wb_update_destroy(update);
  bool has = false;
  uint64_t current = 0;
  CHECK_OK(wb_subscriber_current_version(sub, &has, &current));
  CHECK(has && current == 2);
  CHECK_STATUS(wb_subscriber_receive_version(sub, 1, 30000, 0, &update), WB_FAILED_PRECONDITION,
               "holds version 2 already");
  update = NULL;
  CHECK_OK(wb_subscriber_receive_version(sub, 2, 30000, 10000, &update)); /* again: reload */
  if (update != NULL) CheckUpdate(update, 2);
  wb_update_destroy(update);
  wb_update_t* none = NULL;
  wb_status_t s = wb_subscriber_receive_version(sub, 4, 50, 10000, &none);
  CHECK(s == WB_DEADLINE_EXCEEDED && WB_STATUS_IS_RETRYABLE(s) && none == NULL);
  CHECK(strstr(wb_last_error_message(), "version 4 was not committed by the deadline") != NULL);
  CHECK_STATUS(wb_subscriber_receive_version(sub, 3, 30000, 0, NULL), WB_INVALID_ARGUMENT,
               "update");
  CHECK_STATUS(wb_subscriber_receive_version(NULL, 3, 30000, 0, &none), WB_INVALID_ARGUMENT,
               "subscriber");
  wb_subscriber_destroy(sub);
}

/* wb_publisher_allocate_host: zero-filled, 4096-byte aligned memory a tensor of a publish can
 * live in (plain memory on disk://), received bit-exact; freed after its publisher is destroyed;
 * bad arguments are errors that write nothing. */
static void TestAllocateHost(const char* dir) {
  char uri[512];
  snprintf(uri, sizeof(uri), "disk://%s/alloc?fsync=false", dir);
  wb_publisher_t* pub = NULL;
  CHECK_OK(wb_publisher_create(uri, NULL, &pub));
  if (pub == NULL) return;
  wb_host_memory_t* memory = (wb_host_memory_t*)0x1;
  void* data = (void*)0x1;
  CHECK_STATUS(wb_publisher_allocate_host(pub, 0, &memory, &data), WB_INVALID_ARGUMENT,
               "AllocateHost needs between 1 and 2^62 bytes, got 0");
  CHECK(memory == (wb_host_memory_t*)0x1 && data == (void*)0x1);
  CHECK_STATUS(wb_publisher_allocate_host(pub, 64, NULL, &data), WB_INVALID_ARGUMENT, "memory");
  CHECK_STATUS(wb_publisher_allocate_host(pub, 64, &memory, NULL), WB_INVALID_ARGUMENT, "data");
  CHECK_STATUS(wb_publisher_allocate_host(NULL, 64, &memory, &data), WB_INVALID_ARGUMENT,
               "publisher");
  enum { kFloats = 3000 };
  CHECK_OK(wb_publisher_allocate_host(pub, kFloats * sizeof(float), &memory, &data));
  if (data == (void*)0x1) {
    wb_publisher_destroy(pub);
    return;
  }
  CHECK(((uintptr_t)data) % 4096 == 0);
  float* w = (float*)data;
  bool zero = true;
  for (int i = 0; i < kFloats; ++i) zero = zero && w[i] == 0.0f;
  CHECK(zero);
  for (int i = 0; i < kFloats; ++i) w[i] = (float)i * 0.5f;
  int64_t shape[1] = {kFloats};
  DLTensor t = {0};
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = 1;
  t.dtype.code = kDLFloat;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  const char* names[1] = {"w"};
  CHECK_OK(wb_publisher_publish(pub, 1, names, &t, 1, NULL, 30000));
  wb_publisher_destroy(pub);
  w[0] = 7.0f; /* still the caller's after the publisher is gone */
  wb_host_memory_free(memory);
  wb_host_memory_free(NULL);

  wb_subscriber_t* sub = NULL;
  CHECK_OK(wb_subscriber_create(uri, NULL, &sub));
  if (sub == NULL) return;
  wb_update_t* update = NULL;
  CHECK_OK(wb_subscriber_wait(sub, 1, 30000, &update));
  if (update != NULL) {
    const DLTensor* got = NULL;
    CHECK_OK(wb_update_tensor(update, 0, NULL, NULL, &got));
    bool same = got != NULL && got->shape[0] == kFloats;
    for (int i = 0; same && i < kFloats; ++i)
      same = ((const float*)got->data)[i] == (float)i * 0.5f;
    CHECK(same);
  }
  wb_update_destroy(update);
  wb_subscriber_destroy(sub);
}

static int RemoveEntry(const char* path, const struct stat* sb, int flag, struct FTW* ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(path);
}

/* The streaming publish: PublishVersion's tensors added one at a time (each from a buffer
 * overwritten right after its add returns), committed as a version CheckUpdate accepts; an
 * aborted or destroyed stream leaves nothing; errors name the tensor and the version. */
static void TestStreamingPublish(const char* dir) {
  char uri[512];
  snprintf(uri, sizeof(uri), "disk://%s/stream?fsync=false&stream_bucket=8KiB", dir);
  wb_publisher_t* pub = NULL;
  CHECK_OK(wb_publisher_create(uri, NULL, &pub));
  wb_subscriber_t* sub = NULL;
  CHECK_OK(wb_subscriber_create(uri, NULL, &sub));
  if (pub == NULL || sub == NULL) return;
  CHECK(wb_supports_cuda_tensors() == true || wb_supports_cuda_tensors() == false);

  /* Aborted, then destroyed uncommitted: nothing is visible. */
  wb_publish_stream_t* stream = NULL;
  CHECK_OK(wb_publisher_begin_publish(pub, 3, NULL, &stream));
  uint8_t bytes[16] = {1};
  int64_t shape16[] = {16};
  DLTensor one = Tensor(bytes, 1, shape16, NULL, kDLUInt, 8);
  CHECK_OK(wb_publish_stream_add(stream, "x", &one, NULL));
  wb_publish_stream_t* second = (wb_publish_stream_t*)0x1;
  CHECK_STATUS(wb_publisher_begin_publish(pub, 4, NULL, &second), WB_FAILED_PRECONDITION,
               "version 3 is still being streamed");
  CHECK(second == (wb_publish_stream_t*)0x1); /* outputs written only on success */
  CHECK_STATUS(wb_publish_stream_add(stream, "x", &one, NULL), WB_INVALID_ARGUMENT,
               "version 3: tensor name \"x\" appears twice");
  CHECK_OK(wb_publish_stream_abort(stream));
  CHECK_STATUS(wb_publish_stream_commit(stream, 1000), WB_FAILED_PRECONDITION,
               "after the stream was aborted");
  wb_publish_stream_destroy(stream);
  wb_publish_stream_destroy(NULL);
  stream = NULL;
  CHECK_OK(wb_publisher_begin_publish(pub, 3, NULL, &stream));
  CHECK_OK(wb_publish_stream_add(stream, "x", &one, NULL));
  wb_publish_stream_destroy(stream);
  wb_update_t* update = NULL;
  CHECK_OK(wb_subscriber_poll(sub, 0, 30000, &update));
  CHECK(update == NULL);

  /* Dtypes in the params are per tensor: refused at begin. */
  wb_publish_params_t bad = WB_PUBLISH_PARAMS_INIT;
  bad.dtypes = dtypes;
  CHECK_STATUS(wb_publisher_begin_publish(pub, 3, &bad, &stream), WB_INVALID_ARGUMENT,
               "params.dtypes and params.shards must be NULL");

  /* PublishVersion(3)'s tensors, streamed. */
  DLTensor tensors[kNumTensors];
  MakeTensors(tensors);
  const wb_option_t metadata[] = {{"step", "3"}, {"origin", "capi_test.c"}};
  wb_publish_params_t params = WB_PUBLISH_PARAMS_INIT;
  params.metadata = metadata;
  params.num_metadata = 2;
  CHECK_OK(wb_publisher_begin_publish(pub, 3, &params, &stream));
  for (int i = 0; i < kNumTensors; ++i) {
    wb_stream_add_params_t add = WB_STREAM_ADD_PARAMS_INIT;
    add.dtype = dtypes[i];
    Fill(3);
    CHECK_OK(wb_publish_stream_add(stream, names[i], &tensors[i], &add));
    Fill(99); /* the add copied the bytes: overwriting them now changes nothing published */
  }
  CHECK_OK(wb_publish_stream_commit(stream, 30000));
  wb_publish_stream_destroy(stream);
  wb_publish_stats_t stats = WB_PUBLISH_STATS_INIT;
  CHECK_OK(wb_publisher_last_stats(pub, &stats));
  CHECK(stats.version == 3 && stats.bytes > 0);
  CHECK_OK(wb_subscriber_poll(sub, 3, 30000, &update));
  CHECK(update != NULL);
  if (update != NULL) {
    CheckUpdate(update, 3);
    wb_update_destroy(update);
  }
  wb_subscriber_destroy(sub);
  wb_publisher_destroy(pub);
}

static void TestVersionAndStatus(void) {
  CHECK(strcmp(wb_version(), WEIGHTBUS_VERSION_STRING) == 0);
  CHECK(wb_version_number() == WEIGHTBUS_VERSION);
  CHECK_OK(WB_CHECK_VERSION());
  CHECK_STATUS(wb_check_version(WEIGHTBUS_VERSION + 10000), WB_FAILED_PRECONDITION,
               "major versions differ");
  CHECK_STATUS(wb_check_version(WEIGHTBUS_VERSION + 1), WB_FAILED_PRECONDITION,
               "older than the headers");

  const wb_status_t all[] = {WB_OK,
                             WB_DEADLINE_EXCEEDED,
                             WB_UNAVAILABLE,
                             WB_RESOURCE_EXHAUSTED,
                             WB_ABORTED,
                             WB_INVALID_ARGUMENT,
                             WB_FAILED_PRECONDITION,
                             WB_NOT_FOUND,
                             WB_ALREADY_EXISTS,
                             WB_PERMISSION_DENIED,
                             WB_OUT_OF_RANGE,
                             WB_UNIMPLEMENTED,
                             WB_DATA_LOSS,
                             WB_CANCELLED,
                             WB_INTERNAL,
                             WB_UNKNOWN};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); ++i) {
    CHECK(strncmp(wb_status_string(all[i]), "WB_", 3) == 0);
    const bool retryable = all[i] == WB_DEADLINE_EXCEEDED || all[i] == WB_UNAVAILABLE ||
                           all[i] == WB_RESOURCE_EXHAUSTED || all[i] == WB_ABORTED;
    CHECK(WB_STATUS_IS_RETRYABLE(all[i]) == retryable);
  }
  CHECK(strstr(wb_status_string(WB_DEADLINE_EXCEEDED), "retryable") != NULL);
  CHECK(strcmp(wb_status_string((wb_status_t)77), "not a wb_status_t value") == 0);
  CHECK(strcmp(wb_dtype_name(WB_DTYPE_BF16), "BF16") == 0);
  CHECK(strcmp(wb_dtype_name(WB_DTYPE_F8_E5M2), "F8_E5M2") == 0);
  CHECK(strcmp(wb_dtype_name((wb_dtype_t)99), "?") == 0);

  /* Destroying NULL is a no-op. */
  wb_publisher_destroy(NULL);
  wb_subscriber_destroy(NULL);
  wb_update_destroy(NULL);
}

static void TestOpenErrors(const char* dir) {
  char uri[512];
  snprintf(uri, sizeof(uri), "disk://%s/errors", dir);
  wb_publisher_t* p = (wb_publisher_t*)0x1;
  CHECK_STATUS(wb_publisher_create(NULL, NULL, &p), WB_INVALID_ARGUMENT,
               "wb_publisher_create: uri is NULL");
  CHECK(p == (wb_publisher_t*)0x1); /* outputs are written only on success */
  CHECK_STATUS(wb_publisher_create(uri, NULL, NULL), WB_INVALID_ARGUMENT, "publisher is NULL");
  CHECK_STATUS(wb_publisher_create("nope:///x", NULL, &p), WB_UNIMPLEMENTED, "disk");
  CHECK(p == (wb_publisher_t*)0x1);

  const wb_option_t bad[] = {{"retentionn", "3"}};
  wb_open_params_t params = WB_OPEN_PARAMS_INIT;
  params.options = bad;
  params.num_options = 1;
  wb_subscriber_t* s = NULL;
  CHECK_STATUS(wb_subscriber_create(uri, &params, &s), WB_INVALID_ARGUMENT, "retentionn");
  CHECK(s == NULL);
  const wb_option_t twice[] = {{"retention", "3"}, {"retention", "4"}};
  params.options = twice;
  params.num_options = 2;
  CHECK_STATUS(wb_publisher_create(uri, &params, &p), WB_INVALID_ARGUMENT,
               "names \"retention\" twice");
  params.options = NULL;
  CHECK_STATUS(wb_publisher_create(uri, &params, &p), WB_INVALID_ARGUMENT,
               "params.options is NULL but its count is 2");

  /* struct_size: too small is an error; larger than this library knows is fine while the
   * unknown bytes are zero, and WB_UNIMPLEMENTED when a field this library lacks is set. */
  params = (wb_open_params_t)WB_OPEN_PARAMS_INIT;
  params.struct_size = sizeof(size_t);
  CHECK_STATUS(wb_publisher_create(uri, &params, &p), WB_INVALID_ARGUMENT,
               "params.struct_size is 8");
  struct {
    wb_open_params_t known;
    uint64_t future_field;
  } newer;
  memset(&newer, 0, sizeof(newer));
  newer.known.struct_size = sizeof(newer);
  newer.future_field = 1;
  CHECK_STATUS(wb_publisher_create(uri, &newer.known, &p), WB_UNIMPLEMENTED,
               "uses a field this library lacks");
  newer.future_field = 0;
  wb_publisher_t* ok = NULL;
  CHECK_OK(wb_publisher_create(uri, &newer.known, &ok));
  CHECK(ok != NULL);
  CHECK(strcmp(wb_last_error_message(), "") == 0);
  /* A second live publisher on the same channel is refused. */
  wb_publisher_t* second = NULL;
  CHECK_STATUS(wb_publisher_create(uri, NULL, &second), WB_FAILED_PRECONDITION,
               "another publisher holds the channel");
  CHECK(second == NULL);
  wb_publisher_destroy(ok);
}

static void TestPublishErrors(wb_publisher_t* publisher) {
  uint8_t bytes[4] = {0};
  int64_t shape[] = {4};
  DLTensor t = Tensor(bytes, 1, shape, NULL, kDLUInt, 8);
  const char* name[] = {"x"};

  wb_publish_params_t params = WB_PUBLISH_PARAMS_INIT;
  const wb_dtype_t f32[] = {WB_DTYPE_F32};
  params.dtypes = f32;
  CHECK_STATUS(wb_publisher_publish(publisher, 100, name, &t, 1, &params, 1000),
               WB_INVALID_ARGUMENT,
               "tensor \"x\": dtype override F32 (4-byte elements) does not match the "
               "DLTensor's element type uint8");
  const wb_dtype_t junk[] = {(wb_dtype_t)42};
  params.dtypes = junk;
  CHECK_STATUS(wb_publisher_publish(publisher, 100, name, &t, 1, &params, 1000),
               WB_INVALID_ARGUMENT, "42 is not a wb_dtype_t element type");

  /* complex64 is C64; complex128 has no safetensors type. */
  DLTensor complex = Tensor(bytes, 1, shape, NULL, kDLComplex, 128);
  CHECK_STATUS(wb_publisher_publish(publisher, 100, name, &complex, 1, NULL, 1000),
               WB_INVALID_ARGUMENT, "DLPack type complex128");
  /* Sub-byte dtypes cannot be described by a DLPack 0.6 tensor. */
  const wb_dtype_t f4[] = {WB_DTYPE_F4};
  params.dtypes = f4;
  CHECK_STATUS(wb_publisher_publish(publisher, 100, name, &t, 1, &params, 1000), WB_UNIMPLEMENTED,
               "tensor \"x\" has dtype F4 (4-bit elements, packed)");
  DLTensor lanes = Tensor(bytes, 1, shape, NULL, kDLFloat, 32);
  lanes.dtype.lanes = 4;
  CHECK_STATUS(wb_publisher_publish(publisher, 100, name, &lanes, 1, NULL, 1000),
               WB_INVALID_ARGUMENT, "float32x4");
  /* kDLCUDA over host memory: a build without CUDA refuses the device (naming the capability);
   * one with CUDA refuses it as a device this process cannot use (no GPU: this CI) or as host
   * memory that says CUDA (a GPU machine). Nothing is published either way. */
  DLTensor cuda = Tensor(bytes, 1, shape, NULL, kDLUInt, 8);
  cuda.device.device_type = kDLCUDA;
  {
    const wb_status_t s = wb_publisher_publish(publisher, 100, name, &cuda, 1, NULL, 1000);
    const char* m = wb_last_error_message();
    const int ok = wb_supports_cuda_tensors()
                       ? (s == WB_FAILED_PRECONDITION && strstr(m, "CUDA device 0") != NULL) ||
                             (s == WB_INVALID_ARGUMENT && strstr(m, "host memory") != NULL)
                       : s == WB_UNIMPLEMENTED && strstr(m, "cuda_tensors") != NULL;
    if (!ok || strstr(m, "\"x\"") == NULL) {
      fprintf(stderr, "%s:%d: a kDLCUDA tensor over host memory returned %s: \"%s\"\n", __FILE__,
              __LINE__, wb_status_string(s), m);
      ++failures;
    }
  }
  DLTensor opencl = Tensor(bytes, 1, shape, NULL, kDLUInt, 8);
  opencl.device.device_type = kDLOpenCL;
  CHECK_STATUS(wb_publisher_publish(publisher, 100, name, &opencl, 1, NULL, 1000), WB_UNIMPLEMENTED,
               "DLPack device type 4 is not supported");
  DLTensor null_data = Tensor(NULL, 1, shape, NULL, kDLUInt, 8);
  CHECK_STATUS(wb_publisher_publish(publisher, 100, name, &null_data, 1, NULL, 1000),
               WB_INVALID_ARGUMENT, "\"x\"");
  const char* null_name[] = {NULL};
  CHECK_STATUS(wb_publisher_publish(publisher, 100, null_name, &t, 1, NULL, 1000),
               WB_INVALID_ARGUMENT, "names[0] is NULL");
  CHECK_STATUS(wb_publisher_publish(publisher, 100, NULL, &t, 1, NULL, 1000), WB_INVALID_ARGUMENT,
               "names is NULL");
  CHECK_STATUS(wb_publisher_publish(NULL, 100, name, &t, 1, NULL, 1000), WB_INVALID_ARGUMENT,
               "publisher is NULL");
  DLTensor two[2] = {t, t};
  const char* same[] = {"x", "x"};
  CHECK_STATUS(wb_publisher_publish(publisher, 100, same, two, 2, NULL, 1000), WB_INVALID_ARGUMENT,
               "tensor name \"x\" appears twice");
}

/* ---- Library lists: transports and settings ---- */

static void TestLibraryLists(void) {
  size_t count = 0;
  CHECK_OK(wb_transport_count(&count));
  char joined[256] = "";
  for (size_t i = 0; i < count; ++i) {
    const char* scheme = NULL;
    CHECK_OK(wb_transport_scheme(i, &scheme));
    if (scheme == NULL) continue;
    if (i > 0) strncat(joined, ",", sizeof(joined) - strlen(joined) - 1);
    strncat(joined, scheme, sizeof(joined) - strlen(joined) - 1);
  }
  if (strcmp(joined, WB_TEST_TRANSPORTS) != 0) {
    fprintf(stderr, "wb_transport_scheme lists \"%s\", this build has \"%s\"\n", joined,
            WB_TEST_TRANSPORTS);
    ++failures;
  }
  const char* scheme = "unchanged";
  char needle[96];
  snprintf(needle, sizeof(needle),
           "wb_transport_scheme: index %zu is past the end of the %zu "
           "transports",
           count, count);
  CHECK_STATUS(wb_transport_scheme(count, &scheme), WB_OUT_OF_RANGE, needle);
  CHECK(strcmp(scheme, "unchanged") == 0); /* outputs are written only on success */
  CHECK_STATUS(wb_transport_count(NULL), WB_INVALID_ARGUMENT, "wb_transport_count: count is NULL");
  CHECK_STATUS(wb_transport_scheme(0, NULL), WB_INVALID_ARGUMENT, "scheme is NULL");

  size_t settings = 0;
  CHECK_OK(wb_setting_count(&settings));
  CHECK(settings > 0);
  bool found_retention = false, found_bind_mode = false;
  for (size_t i = 0; i < settings; ++i) {
    wb_setting_info_t info = WB_SETTING_INFO_INIT;
    CHECK_OK(wb_setting_info(i, &info));
    CHECK(info.scope && info.name && info.type && info.default_value && info.env && info.doc);
    if (info.name == NULL || info.scope == NULL) continue;
    if (i == 0) CHECK(strcmp(info.scope, "core") == 0); /* the core's settings come first */
    if (strcmp(info.scope, "disk") == 0 && strcmp(info.name, "retention") == 0) {
      found_retention = true;
      CHECK(strcmp(info.type, "int >= 1 versions") == 0 && strcmp(info.default_value, "3") == 0);
      CHECK(strcmp(info.env, "WEIGHTBUS_DISK_RETENTION") == 0 && strlen(info.doc) > 0);
    }
    if (strcmp(info.scope, "core") == 0 && strcmp(info.name, "bind_mode") == 0) {
      found_bind_mode = true;
      CHECK(strcmp(info.type, "enum(staged|direct)") == 0);
      CHECK(strcmp(info.default_value, "staged") == 0);
      CHECK(strcmp(info.env, "WEIGHTBUS_BIND_MODE") == 0);
    }
  }
  CHECK(found_retention && found_bind_mode);
  /* A newer caller's longer struct gets the fields this library knows, nothing beyond; a
   * struct smaller than the first layout and a past-the-end index are refused. */
  struct {
    wb_setting_info_t known;
    const char* future_field;
  } newer = {WB_SETTING_INFO_INIT, "untouched"};
  newer.known.struct_size = sizeof(newer);
  CHECK_OK(wb_setting_info(0, &newer.known));
  CHECK(newer.known.doc != NULL && strcmp(newer.future_field, "untouched") == 0);
  wb_setting_info_t tiny = WB_SETTING_INFO_INIT;
  tiny.struct_size = sizeof(size_t);
  CHECK_STATUS(wb_setting_info(0, &tiny), WB_INVALID_ARGUMENT,
               "wb_setting_info: info.struct_size is 8, smaller than any version of the struct");
  CHECK(tiny.name == NULL);
  wb_setting_info_t past = WB_SETTING_INFO_INIT;
  snprintf(needle, sizeof(needle), "index %zu is past the end of the %zu settings", settings,
           settings);
  CHECK_STATUS(wb_setting_info(settings, &past), WB_OUT_OF_RANGE, needle);
  CHECK_STATUS(wb_setting_info(0, NULL), WB_INVALID_ARGUMENT, "info is NULL");
  CHECK_STATUS(wb_setting_count(NULL), WB_INVALID_ARGUMENT, "count is NULL");
}

/* ---- Handles' URIs, and WaitForReceivers where the transport cannot tell (disk) ---- */

static void TestUrisAndDiskReceivers(wb_publisher_t* publisher, const char* uri) {
  const char* got = NULL;
  CHECK_OK(wb_publisher_uri(publisher, &got));
  CHECK(got != NULL && strcmp(got, uri) == 0);
  CHECK_STATUS(wb_publisher_uri(publisher, NULL), WB_INVALID_ARGUMENT,
               "wb_publisher_uri: uri is NULL");
  CHECK_STATUS(wb_publisher_uri(NULL, &got), WB_INVALID_ARGUMENT, "publisher is NULL");
  wb_subscriber_t* sub = NULL;
  CHECK_OK(wb_subscriber_create(uri, NULL, &sub));
  got = NULL;
  CHECK_OK(wb_subscriber_uri(sub, &got));
  CHECK(got != NULL && strcmp(got, uri) == 0);
  CHECK_STATUS(wb_subscriber_uri(sub, NULL), WB_INVALID_ARGUMENT, "wb_subscriber_uri: uri is NULL");
  CHECK_STATUS(wb_subscriber_uri(NULL, &got), WB_INVALID_ARGUMENT, "subscriber is NULL");
  wb_subscriber_destroy(sub);

  /* disk:// subscribers never talk to the publisher. */
  CHECK_STATUS(wb_publisher_wait_for_receivers(publisher, 1, 1, 1000), WB_UNIMPLEMENTED,
               "this transport cannot tell which subscribers received version 1");
  CHECK_STATUS(wb_publisher_wait_for_receivers(publisher, 1, 0, 1000), WB_INVALID_ARGUMENT,
               "WaitForReceivers needs a count of at least 1, got 0");
  CHECK_STATUS(wb_publisher_wait_for_receivers(NULL, 1, 1, 1000), WB_INVALID_ARGUMENT,
               "wb_publisher_wait_for_receivers: publisher is NULL");
}

/* ---- Shards: published through wb_publish_params_t.shards, read back with tensor_info ---- */

/* Receives `version` of TestShards' channel: "a" F32 [2, 3], a shard at [2, 3] of [4, 6] in
 * version 1 and whole in version 2, and "b" I32 [4], always whole. */
static void CheckShardInfo(wb_subscriber_t* sub, uint64_t version, size_t a_bytes, size_t b_bytes) {
  wb_update_t* update = NULL;
  CHECK_OK(wb_subscriber_wait(sub, version, 30000, &update));
  if (update == NULL) return;
  uint64_t v = 0;
  CHECK_OK(wb_update_version(update, &v));
  CHECK(v == version);
  const char* json = NULL;
  CHECK_OK(wb_update_manifest_json(update, &json, NULL));
  wb_tensor_info_t info = WB_TENSOR_INFO_INIT;
  CHECK_OK(wb_update_tensor_info(update, 0, &info));
  CHECK(strcmp(info.name, "a") == 0 && info.dtype == WB_DTYPE_F32 && info.ndim == 2);
  CHECK(info.shape[0] == 2 && info.shape[1] == 3 && info.nbytes == a_bytes);
  char hex[40];
  snprintf(hex, sizeof(hex), "\"%016llx\"", (unsigned long long)info.xxh3);
  CHECK(strstr(json, hex) != NULL); /* the checksum the manifest records */
  if (version == 1) {
    CHECK(info.has_shard);
    CHECK(info.shard_global_shape && info.shard_global_shape[0] == 4 &&
          info.shard_global_shape[1] == 6);
    CHECK(info.shard_offsets && info.shard_offsets[0] == 2 && info.shard_offsets[1] == 3);
  } else {
    CHECK(!info.has_shard && info.shard_global_shape == NULL && info.shard_offsets == NULL);
  }
  wb_tensor_info_t info_b = WB_TENSOR_INFO_INIT;
  CHECK_OK(wb_update_tensor_info(update, 1, &info_b));
  CHECK(strcmp(info_b.name, "b") == 0 && info_b.dtype == WB_DTYPE_I32 && info_b.ndim == 1);
  CHECK(info_b.shape[0] == 4 && info_b.nbytes == b_bytes && !info_b.has_shard);
  CHECK(info_b.shard_global_shape == NULL && info_b.shard_offsets == NULL);
  /* A newer caller's longer struct: the bytes beyond what this library knows stay untouched. */
  struct {
    wb_tensor_info_t known;
    uint64_t future_field;
  } newer = {WB_TENSOR_INFO_INIT, 42};
  newer.known.struct_size = sizeof(newer);
  CHECK_OK(wb_update_tensor_info(update, 0, &newer.known));
  CHECK(newer.known.xxh3 == info.xxh3 && newer.future_field == 42);
  wb_tensor_info_t past = WB_TENSOR_INFO_INIT;
  CHECK_STATUS(wb_update_tensor_info(update, 2, &past), WB_OUT_OF_RANGE,
               "wb_update_tensor_info: tensor index 2 is past the end of version");
  CHECK(past.name == NULL);
  wb_tensor_info_t tiny = WB_TENSOR_INFO_INIT;
  tiny.struct_size = 4;
  CHECK_STATUS(wb_update_tensor_info(update, 0, &tiny), WB_INVALID_ARGUMENT,
               "info.struct_size is 4");
  CHECK_STATUS(wb_update_tensor_info(update, 0, NULL), WB_INVALID_ARGUMENT, "info is NULL");
  CHECK_STATUS(wb_update_tensor_info(NULL, 0, &info), WB_INVALID_ARGUMENT, "update is NULL");
  wb_update_destroy(update);
}

static void TestShards(const char* dir) {
  char uri[512];
  snprintf(uri, sizeof(uri), "disk://%s/shards?fsync=false", dir);
  wb_publisher_t* pub = NULL;
  CHECK_OK(wb_publisher_create(uri, NULL, &pub));
  if (pub == NULL) return;
  float a[2][3] = {{1, 2, 3}, {4, 5, 6}};
  int32_t b[4] = {7, 8, 9, 10};
  int64_t shape_a[] = {2, 3}, shape_b[] = {4};
  DLTensor tensors[2] = {Tensor(a, 2, shape_a, NULL, kDLFloat, 32),
                         Tensor(b, 1, shape_b, NULL, kDLInt, 32)};
  const char* tensor_names[] = {"a", "b"};
  int64_t global[] = {4, 6}, offsets[] = {2, 3};
  const wb_shard_t shard_a = {2, global, offsets};
  const wb_shard_t* shards[] = {&shard_a, NULL}; /* "b" is whole */
  wb_publish_params_t params = WB_PUBLISH_PARAMS_INIT;
  params.shards = shards;
  CHECK_OK(wb_publisher_publish(pub, 1, tensor_names, tensors, 2, &params, 30000));
  wb_subscriber_t* sub = NULL;
  CHECK_OK(wb_subscriber_create(uri, NULL, &sub));
  if (sub == NULL) {
    wb_publisher_destroy(pub);
    return;
  }
  CheckShardInfo(sub, 1, sizeof(a), sizeof(b));

  /* Failure paths: each names the tensor; nothing is published. */
  int64_t too_far[] = {3, 3};
  const struct {
    size_t tensor; /* the index of the tensor described as a shard */
    wb_shard_t shard;
    const char* message;
  } refused[] = {
      {0,
       {2, global, too_far},
       "tensor \"a\": slice of shape [2, 3] at offsets [3, 3] does not fit in global shape "
       "[4, 6] (dimension 0)"},
      {0,
       {1, global, offsets},
       "tensor \"a\": shard global_shape [4] and offsets [2] must have the rank of shape [2, 3]"},
      {1,
       {1, shape_b, NULL},
       "version 2: tensor \"b\": params.shards[1] has ndim 1 and a global_shape and NULL "
       "offsets"},
      {0, {-1, NULL, NULL}, "params.shards[0] has ndim -1"},
  };
  for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); ++i) {
    const wb_shard_t* per_tensor[2] = {NULL, NULL};
    per_tensor[refused[i].tensor] = &refused[i].shard;
    params.shards = per_tensor;
    CHECK_STATUS(wb_publisher_publish(pub, 2, tensor_names, tensors, 2, &params, 30000),
                 WB_INVALID_ARGUMENT, refused[i].message);
  }
  bool has = false;
  uint64_t latest = 0;
  CHECK_OK(wb_publisher_latest_version(pub, &has, &latest));
  CHECK(has && latest == 1);
  /* A caller compiled before `shards` existed: the bytes beyond its struct_size are not read,
   * so version 2 is published whole whatever they hold. */
  const wb_shard_t* bad[] = {&refused[0].shard, NULL};
  params.shards = bad;
  params.struct_size = offsetof(wb_publish_params_t, shards);
  CHECK_OK(wb_publisher_publish(pub, 2, tensor_names, tensors, 2, &params, 30000));
  CheckShardInfo(sub, 2, sizeof(a), sizeof(b));
  wb_subscriber_destroy(sub);
  wb_publisher_destroy(pub);
}

/* ---- A layer's figures: delta+disk reports encode/decode time and encoded bytes ---- */

static void TestLayerStats(const char* dir) {
  if (strstr(WB_TEST_TRANSPORTS, "delta") == NULL) {
    printf("capi_test: SKIPPED layer figures: delta is not built\n");
    return;
  }
  char uri[512];
  snprintf(uri, sizeof(uri), "delta+disk://%s/delta?fsync=false", dir);
  wb_publisher_t* pub = NULL;
  CHECK_OK(wb_publisher_create(uri, NULL, &pub));
  if (pub == NULL) return;
  static uint32_t zeros[16384]; /* 64 KiB that compress to far less */
  int64_t shape[] = {16384};
  DLTensor t = Tensor(zeros, 1, shape, NULL, kDLUInt, 32);
  const char* name[] = {"zeros"};
  CHECK_OK(wb_publisher_publish(pub, 1, name, &t, 1, NULL, 30000));
  wb_publish_stats_t ps = WB_PUBLISH_STATS_INIT;
  CHECK_OK(wb_publisher_last_stats(pub, &ps));
  CHECK(ps.version == 1 && ps.bytes == sizeof(zeros));
  CHECK(ps.wire_bytes > 0 && ps.wire_bytes < ps.bytes);
  CHECK(ps.encode_ns > 0 && ps.encode_ns <= ps.transport_ns);
  /* A caller compiled before encode_ns existed gets the fields it has, nothing beyond. */
  wb_publish_stats_t before_encode = WB_PUBLISH_STATS_INIT;
  before_encode.struct_size = offsetof(wb_publish_stats_t, encode_ns);
  before_encode.wire_bytes = 42;
  CHECK_OK(wb_publisher_last_stats(pub, &before_encode));
  CHECK(before_encode.version == 1 && before_encode.encode_ns == 0 &&
        before_encode.wire_bytes == 42);
  /* Which encoding the layer chose, and why (the first version of a channel: a keyframe). */
  CHECK(ps.encoding && strcmp(ps.encoding, "keyframe: the channel holds no version yet") == 0);
  const char* mark = "untouched";
  wb_publish_stats_t before_encoding = WB_PUBLISH_STATS_INIT;
  before_encoding.struct_size = offsetof(wb_publish_stats_t, encoding);
  before_encoding.encoding = mark;
  CHECK_OK(wb_publisher_last_stats(pub, &before_encoding));
  CHECK(before_encoding.wire_bytes == ps.wire_bytes && before_encoding.encoding == mark);

  wb_subscriber_t* sub = NULL;
  CHECK_OK(wb_subscriber_create(uri, NULL, &sub));
  wb_update_t* update = NULL;
  if (sub != NULL) CHECK_OK(wb_subscriber_wait(sub, 1, 30000, &update));
  if (update != NULL) {
    wb_update_stats_t us = WB_UPDATE_STATS_INIT;
    CHECK_OK(wb_update_stats(update, &us));
    CHECK(us.bytes == sizeof(zeros) && us.wire_bytes == ps.wire_bytes);
    CHECK(us.decode_ns > 0 && us.decode_ns <= us.fetch_ns);
    CHECK(us.encoding && strcmp(us.encoding, "keyframe 1") == 0);
    const DLTensor* received = NULL;
    CHECK_OK(wb_update_tensor(update, 0, NULL, NULL, &received));
    CHECK(received && memcmp(received->data, zeros, sizeof(zeros)) == 0);
  }
  wb_update_destroy(update);
  wb_subscriber_destroy(sub);
  wb_publisher_destroy(pub);
}

/* ---- WaitForReceivers over ucx:// on loopback ---- */

/* A loopback port nobody listens on right now (another process may take it before the
 * publisher binds it: the caller retries on WB_FAILED_PRECONDITION, "in use"). */
static int FreePort(void) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a;
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const int ok = bind(fd, (struct sockaddr*)&a, sizeof(a)) == 0 &&
                 getsockname(fd, (struct sockaddr*)&a, &len) == 0;
  close(fd);
  return ok ? ntohs(a.sin_port) : -1;
}

struct ReceiversWait {
  wb_publisher_t* publisher;
  wb_status_t status;
};

static void* WaitForManyReceivers(void* arg) {
  struct ReceiversWait* w = (struct ReceiversWait*)arg;
  w->status = wb_publisher_wait_for_receivers(w->publisher, 1, 1000, WB_TIMEOUT_INFINITE);
  return NULL;
}

static void TestUcxReceivers(void) {
  if (strstr(WB_TEST_TRANSPORTS, "ucx") == NULL) {
    printf("capi_test: SKIPPED WaitForReceivers over ucx://: ucx is not built\n");
    return;
  }
  char uri[128] = "";
  wb_publisher_t* pub = NULL;
  wb_status_t created = WB_UNKNOWN;
  for (int attempt = 0; attempt < 20 && pub == NULL; ++attempt) {
    snprintf(uri, sizeof(uri), "ucx://127.0.0.1:%d/capi", FreePort());
    created = wb_publisher_create(uri, NULL, &pub);
    if (created != WB_FAILED_PRECONDITION) break; /* anything but "port in use" */
  }
  CHECK(created == WB_OK);
  if (pub == NULL) {
    fprintf(stderr, "capi_test: %s: %s\n", uri, wb_last_error_message());
    return;
  }
  CHECK_OK(PublishVersion(pub, 1));
  wb_publish_stats_t ps = WB_PUBLISH_STATS_INIT;
  CHECK_OK(wb_publisher_last_stats(pub, &ps));
  CHECK(ps.wire_bytes == ps.bytes && ps.encode_ns == 0); /* no layer */
  /* Nobody has it yet. */
  CHECK_STATUS(wb_publisher_wait_for_receivers(pub, 1, 1, 0), WB_DEADLINE_EXCEEDED,
               "0 of the 1 subscribers waited for had received version 1");

  wb_subscriber_t* sub = NULL;
  CHECK_OK(wb_subscriber_create(uri, NULL, &sub));
  wb_update_t* update = NULL;
  if (sub != NULL) CHECK_OK(wb_subscriber_wait(sub, 1, 30000, &update));
  if (update != NULL) CheckUpdate(update, 1);
  wb_update_destroy(update);
  /* The subscriber's receipt is counted; it still counts after the subscriber left. */
  CHECK_OK(wb_publisher_wait_for_receivers(pub, 1, 1, 30000));
  wb_subscriber_destroy(sub);
  CHECK_OK(wb_publisher_wait_for_receivers(pub, 1, 1, 30000));
  CHECK_STATUS(wb_publisher_wait_for_receivers(pub, 1, 2, 0), WB_DEADLINE_EXCEEDED,
               "1 of the 2 subscribers waited for had received version 1");
  CHECK_STATUS(wb_publisher_wait_for_receivers(pub, 2, 1, 0), WB_DEADLINE_EXCEEDED,
               "0 of the 1 subscribers waited for had received version 2");
  CHECK_STATUS(wb_publisher_wait_for_receivers(pub, 1, -3, 1000), WB_INVALID_ARGUMENT,
               "needs a count of at least 1, got -3");

  /* A wait that no subscriber could end (forever, for 1000 receivers) ends with WB_CANCELLED
   * when another thread cancels the publisher, whether it was already waiting or not. */
  struct ReceiversWait w = {pub, WB_UNKNOWN};
  pthread_t thread;
  CHECK(pthread_create(&thread, NULL, WaitForManyReceivers, &w) == 0);
  CHECK_OK(wb_publisher_cancel(pub));
  CHECK(pthread_join(thread, NULL) == 0);
  CHECK(w.status == WB_CANCELLED);
  CHECK_STATUS(wb_publisher_wait_for_receivers(pub, 1, 1, 0), WB_CANCELLED, "");
  wb_publisher_destroy(pub);
}

/* wb_subscriber_create_tp: each worker of a TP group of 2 receives its slices (a row-parallel
 * [2, 4] matrix cut on its columns, a column-parallel one on its rows); a rank outside the
 * group and a degree that does not divide are refused naming them. */
static void TestPlacements(const char* dir) {
  char uri[512];
  snprintf(uri, sizeof(uri), "disk://%s/tp?fsync=false", dir);
  wb_publisher_t* pub = NULL;
  CHECK_OK(wb_publisher_create(uri, NULL, &pub));
  if (pub == NULL) return;
  float m[2][4] = {{0, 1, 2, 3}, {4, 5, 6, 7}};
  int64_t shape[] = {2, 4};
  DLTensor tensors[2] = {Tensor(m, 2, shape, NULL, kDLFloat, 32),
                         Tensor(m, 2, shape, NULL, kDLFloat, 32)};
  const char* tensor_names[] = {"row", "col"};
  CHECK_OK(wb_publisher_publish(pub, 1, tensor_names, tensors, 2, NULL, 30000));
  wb_placement_rule_t rules[2];
  memset(rules, 0, sizeof(rules));
  rules[0].pattern = "row";
  rules[0].kind = WB_PLACEMENT_SHARD;
  rules[0].dim = 1;
  rules[1].pattern = "c*";
  rules[1].kind = WB_PLACEMENT_SHARD;
  rules[1].dim = 0;
  wb_placements_t placements = WB_PLACEMENTS_INIT;
  placements.rules = rules;
  placements.num_rules = 2;
  placements.tp_size = 2;
  for (int r = 0; r < 2; ++r) {
    placements.tp_rank = r;
    wb_subscriber_t* sub = NULL;
    CHECK_OK(wb_subscriber_create_tp(uri, NULL, &placements, &sub));
    if (sub == NULL) continue;
    wb_update_t* update = NULL;
    CHECK_OK(wb_subscriber_poll(sub, 1, 30000, &update));
    CHECK(update != NULL);
    if (update != NULL) {
      const DLTensor* row = NULL;
      const DLTensor* col = NULL;
      CHECK_OK(wb_update_tensor(update, 0, NULL, NULL, &row));
      CHECK_OK(wb_update_tensor(update, 1, NULL, NULL, &col));
      if (row != NULL && col != NULL) {
        CHECK(row->ndim == 2 && row->shape[0] == 2 && row->shape[1] == 2);
        CHECK(col->ndim == 2 && col->shape[0] == 1 && col->shape[1] == 4);
        const float* rv = (const float*)row->data;
        CHECK(rv[0] == m[0][2 * r] && rv[1] == m[0][2 * r + 1] && rv[2] == m[1][2 * r] &&
              rv[3] == m[1][2 * r + 1]);
        CHECK(memcmp(col->data, m[r], sizeof(m[r])) == 0);
      }
      wb_tensor_info_t info = WB_TENSOR_INFO_INIT;
      CHECK_OK(wb_update_tensor_info(update, 0, &info));
      CHECK(info.ndim == 2 && info.shape[0] == 2 && info.shape[1] == 2 && info.nbytes == 16);
      wb_update_destroy(update);
    }
    wb_subscriber_destroy(sub);
  }
  wb_subscriber_t* sub = NULL;
  placements.tp_rank = 2;
  CHECK_STATUS(wb_subscriber_create_tp(uri, NULL, &placements, &sub), WB_INVALID_ARGUMENT,
               "TP rank 2 of a group of size 2");
  placements.tp_size = 3;
  placements.tp_rank = 0;
  CHECK_OK(wb_subscriber_create_tp(uri, NULL, &placements, &sub));
  if (sub != NULL) {
    wb_update_t* update = NULL;
    CHECK_STATUS(wb_subscriber_poll(sub, 1, 30000, &update), WB_INVALID_ARGUMENT,
                 "TP degree 3 does not divide dimension 1 of size 4");
    wb_subscriber_destroy(sub);
  }
  wb_publisher_destroy(pub);
}

int main(void) {
  char dir[] = "/tmp/wb_capi_test_XXXXXX";
  if (mkdtemp(dir) == NULL) {
    perror("mkdtemp");
    return 1;
  }
  char uri[512];
  snprintf(uri, sizeof(uri), "disk://%s/channel?fsync=false", dir);

  TestVersionAndStatus();
  TestLibraryLists();
  TestOpenErrors(dir);
  TestShards(dir);
  TestLayerStats(dir);
  TestUcxReceivers();
  TestReceiveVersion(dir);
  TestAllocateHost(dir);
  TestPlacements(dir);
  TestStreamingPublish(dir);

  wb_publisher_t* publisher = NULL;
  CHECK_OK(wb_publisher_create(uri, NULL, &publisher));
  if (publisher == NULL) return 1;
  bool has = true;
  uint64_t latest = 9;
  CHECK_OK(wb_publisher_latest_version(publisher, &has, &latest));
  CHECK(!has && latest == 0);
  CHECK_OK(PublishVersion(publisher, 1));
  CHECK_OK(wb_publisher_latest_version(publisher, &has, &latest));
  CHECK(has && latest == 1);
  wb_publish_stats_t stats = WB_PUBLISH_STATS_INIT;
  CHECK_OK(wb_publisher_last_stats(publisher, &stats));
  CHECK(stats.version == 1 && stats.bytes > 0 && stats.stall_ns > 0);
  CHECK(stats.wire_bytes == stats.bytes && stats.encode_ns == 0); /* no layer */
  /* An older caller's smaller stats struct gets only the fields it has. */
  struct {
    size_t struct_size;
    uint64_t version;
  } old_stats = {sizeof(size_t) + sizeof(uint64_t), 0};
  CHECK_STATUS(wb_publisher_last_stats(publisher, (wb_publish_stats_t*)&old_stats),
               WB_INVALID_ARGUMENT, "stats.struct_size is 16");
  /* A caller compiled before `flags` existed gets every field it has. */
  wb_publish_stats_t before_flags = WB_PUBLISH_STATS_INIT;
  before_flags.struct_size = offsetof(wb_publish_stats_t, flags);
  before_flags.flags = 42; /* beyond its struct_size: must stay untouched */
  CHECK_OK(wb_publisher_last_stats(publisher, &before_flags));
  CHECK(before_flags.version == 1 && before_flags.flags == 42);

  /* Versions must increase; the message says which version the channel has. Publishing the
   * latest version again with the same bytes is a retry: a success that writes nothing. */
  CHECK_OK(PublishVersion(publisher, 1));
  CHECK_OK(wb_publisher_last_stats(publisher, &stats));
  CHECK(stats.version == 1 && (stats.flags & WB_PUBLISH_UNCHANGED) != 0);
  CHECK_STATUS(PublishVersion(publisher, 0), WB_FAILED_PRECONDITION,
               "cannot publish version 0: the channel already has version 1");
  Fill(1); /* PublishVersion(0) refilled the buffers with version 0's values */
  CHECK(!WB_STATUS_IS_RETRYABLE(WB_FAILED_PRECONDITION));
  TestPublishErrors(publisher);
  TestUrisAndDiskReceivers(publisher, uri);

  /* In-process subscriber: an exported DLManagedTensor outlives its wb_update_t. Version 1
   * is committed, so a poll receives it without waiting. */
  wb_subscriber_t* local = NULL;
  CHECK_OK(wb_subscriber_create(uri, NULL, &local));
  wb_update_t* update = NULL;
  CHECK_OK(wb_subscriber_poll(local, 1, 30000, &update));
  CHECK(update != NULL);
  if (update != NULL) {
    DLManagedTensor* managed = NULL;
    CHECK_OK(wb_update_export_dlpack(update, 0, &managed));
    CHECK_STATUS(wb_update_export_dlpack(update, 42, &managed), WB_OUT_OF_RANGE, "index 42");
    wb_update_destroy(update);
    wb_subscriber_destroy(local);
    local = NULL;
    if (managed != NULL) {
      CHECK(managed->dl_tensor.ndim == 2 && managed->dl_tensor.shape[1] == 3);
      CHECK(memcmp(managed->dl_tensor.data, w_f32, sizeof(w_f32)) == 0);
      managed->deleter(managed);
    }
  }
  wb_subscriber_destroy(local);

  /* Cancel: later calls fail with WB_CANCELLED; the handle stays valid until destroyed. */
  wb_subscriber_t* cancelled = NULL;
  CHECK_OK(wb_subscriber_create(uri, NULL, &cancelled));
  CHECK_OK(wb_subscriber_cancel(cancelled));
  CHECK_STATUS(wb_subscriber_poll(cancelled, 1, 30000, &update), WB_CANCELLED, "being closed");
  wb_subscriber_destroy(cancelled);

  /* The subscriber process. */
  int pipe_fds[2];
  CHECK(pipe(pipe_fds) == 0);
  fflush(NULL);
  const pid_t pid = fork();
  if (pid == 0) {
    close(pipe_fds[0]);
    /* A handle inherited across fork() fails at once in the child (the parent's is fine). */
    bool inherited_has = false;
    uint64_t inherited_latest = 0;
    if (wb_publisher_latest_version(publisher, &inherited_has, &inherited_latest) !=
            WB_FAILED_PRECONDITION ||
        strstr(wb_last_error_message(), "fork") == NULL) {
      _exit(3);
    }
    _exit(Child(uri, pipe_fds[1]));
  }
  close(pipe_fds[1]);
  char go = 0;
  CHECK(read(pipe_fds[0], &go, 1) == 1 && go == 'w');
  close(pipe_fds[0]);
  CHECK_OK(PublishVersion(publisher, 2));
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);

  wb_publisher_destroy(publisher);
  nftw(dir, RemoveEntry, 16, FTW_DEPTH | FTW_PHYS);
  if (failures != 0) {
    fprintf(stderr, "capi_test: %d check(s) failed\n", failures);
    return 1;
  }
  printf("capi_test: OK\n");
  return 0;
}

/* SPDX-License-Identifier: Apache-2.0 */
/* Installed-package consumer (C API): checks the version and publishes + receives one tensor
 * over disk:// in the directory given as argv[1]. */
#include <stdio.h>
#include <string.h>

#include "weightbus/weightbus.h"

#define TRY(call)                                                                            \
  do {                                                                                       \
    wb_status_t s_ = (call);                                                                 \
    if (s_ != WB_OK) {                                                                       \
      fprintf(stderr, "%s: %s: %s\n", #call, wb_status_string(s_), wb_last_error_message()); \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  TRY(WB_CHECK_VERSION());
  char uri[4096];
  snprintf(uri, sizeof(uri), "disk://%s?fsync=false", argv[1]);
  float data[3] = {1.0f, 2.0f, 3.0f};
  int64_t shape[1] = {3};
  DLTensor t;
  memset(&t, 0, sizeof(t));
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = 1;
  t.dtype.code = kDLFloat;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  const char* names[1] = {"w"};
  wb_publisher_t* pub = NULL;
  TRY(wb_publisher_create(uri, NULL, &pub));
  TRY(wb_publisher_publish(pub, 1, names, &t, 1, NULL, 10000));
  wb_subscriber_t* sub = NULL;
  TRY(wb_subscriber_create(uri, NULL, &sub));
  wb_update_t* update = NULL;
  TRY(wb_subscriber_wait(sub, 1, 10000, &update));
  const DLTensor* got = NULL;
  TRY(wb_update_tensor(update, 0, NULL, NULL, &got));
  const int ok = memcmp(got->data, data, sizeof(data)) == 0;
  wb_update_destroy(update);
  wb_subscriber_destroy(sub);
  wb_publisher_destroy(pub);
  printf("consumer_c: weightbus %s %s\n", wb_version(), ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}

// SPDX-License-Identifier: Apache-2.0
// Installed-package consumer (C++ API): publishes and receives one tensor over disk:// in the
// directory given as argv[1].
#include <cstdio>
#include <cstring>
#include <string>

#include "weightbus/weightbus.hpp"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string uri = std::string("disk://") + argv[1] + "?fsync=false";
  const float data[3] = {4.0f, 5.0f, 6.0f};
  auto pub = weightbus::Publisher::Open(uri);
  if (!pub.ok()) return std::fprintf(stderr, "%s\n", pub.status().ToString().c_str()), 1;
  weightbus::TensorView view{
      .name = "w", .dtype = weightbus::DType::kF32, .shape = {3}, .data = data};
  absl::Status s = (*pub)->Publish(1, {view}, {}, absl::Seconds(10));
  if (!s.ok()) return std::fprintf(stderr, "%s\n", s.ToString().c_str()), 1;
  auto sub = weightbus::Subscriber::Open(uri);
  if (!sub.ok()) return 1;
  auto update = (*sub)->WaitForVersion(1, absl::Seconds(10));
  if (!update.ok()) return std::fprintf(stderr, "%s\n", update.status().ToString().c_str()), 1;
  const bool ok = std::memcmp((*update)->tensors()[0].data, data, sizeof(data)) == 0;
  std::printf("consumer_cxx: weightbus %s %s\n", std::string(weightbus::LibraryVersion()).c_str(),
              ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}

// SPDX-License-Identifier: Apache-2.0
// The disk:// transport: each version is a Hugging Face safetensors checkpoint in a directory of
// a shared filesystem, written with io_uring into a temporary directory, fsynced, renamed into
// place, and committed by atomically replacing the channel's LATEST pointer (channel.h).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "core/config.h"
#include "core/transport.h"
#include "core/uri.h"
#include "io/file_io.h"

namespace weightbus::internal::disk {

const SettingTable& DiskSettings();

// The channel root of a disk:// URI (authority empty or "localhost", absolute path).
// Errors: InvalidArgument naming the URI.
absl::StatusOr<std::string> ChannelRoot(const Uri& uri);

// The I/O engine the settings ask for (io_engine, queue_depth, chunk_size; their ranges are
// declared in DiskSettings). Errors: as FileIo::Create.
absl::StatusOr<std::unique_ptr<FileIo>> MakeFileIo(const Uri& uri, const Config& config);

absl::StatusOr<std::unique_ptr<TransportPublisher>> OpenDiskPublisher(const Uri& uri,
                                                                      const Config& config);
absl::StatusOr<std::unique_ptr<TransportSubscriber>> OpenDiskSubscriber(const Uri& uri,
                                                                        const Config& config);

}  // namespace weightbus::internal::disk

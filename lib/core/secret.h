// SPDX-License-Identifier: Apache-2.0
// Shared-secret channels: where a channel's secret comes from (settings secret_file and
// secret_env), the key derived from it, the MAC every manifest of such a channel carries, and
// the proofs of the ucx control plane's handshake. One home for everything keyed by the secret;
// libsodium does the cryptography (HMAC-SHA-512-256 via crypto_auth, BLAKE2b for the key).
// Threat model and what the secret does and does not protect: docs/SECURITY.md.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/config.h"
#include "weightbus/manifest.hpp"

namespace weightbus::internal {

// Metadata key under which a manifest of a shared-secret channel carries its MAC (64 lowercase
// hex digits). Reserved: Publish refuses it in users' metadata; the core subscriber checks and
// removes it before handing the manifest over.
inline constexpr std::string_view kMacMetadataKey = "weightbus.mac";

// Shortest and longest secret accepted, in bytes (after one trailing newline is dropped).
inline constexpr size_t kMinSecretBytes = 16;
inline constexpr size_t kMaxSecretBytes = 4096;

// The 32-byte key of a channel, derived from its secret with BLAKE2b. Never logged.
struct ChannelKey {
  std::array<uint8_t, 32> bytes{};
};

// A 32-byte random nonce (libsodium's randombytes) for the handshake.
using Nonce = std::array<uint8_t, 32>;
Nonce RandomNonce();

// The channel's key from settings secret_file / secret_env, or nullopt when neither is set.
// secret_file names a regular file, not readable or writable by group or others (mode & 077 ==
// 0), holding the secret; secret_env names an environment variable holding it. `where` names
// the channel in messages. Errors (never quoting the secret): InvalidArgument when both are
// set or the secret is shorter than kMinSecretBytes or longer than kMaxSecretBytes;
// PermissionDenied for a file that group or others may read, naming the path and its mode;
// NotFound for a missing file or an unset (or empty) variable; Internal when libsodium cannot
// start.
absl::StatusOr<std::optional<ChannelKey>> LoadChannelKey(const Config& config,
                                                         std::string_view where);

// Refuses a secret put where it does not belong: a "secret" entry in the URI query or the
// Options map (a URI or a command line is seen by other users: ps, logs, shell history).
// `where` is "the URI query" or "options". Errors: InvalidArgument naming the settings to use.
absl::Status RefuseInlineSecret(const std::map<std::string, std::string>& map,
                                std::string_view where, std::string_view uri);

// The MAC of `m` under `key` (64 lowercase hex digits): HMAC-SHA-512-256 over the version, the
// publisher's session (the channel epoch), every tensor's name, dtype, shape, shard, nbytes and
// XXH3-64, in order, and the metadata except kMacMetadataKey. Times, host and pid are not
// covered.
std::string ManifestMac(const ChannelKey& key, const Manifest& m);

// Checks the MAC of a manifest offered to a subscriber, before any of its bytes is accepted.
// With a key: PermissionDenied naming `uri`, the version and session when the manifest carries
// no MAC or a wrong one. Without one: FailedPrecondition when it carries a MAC (the channel
// needs a secret this subscriber lacks: configure secret_file or secret_env). `current` is the
// version the subscriber holds, for the messages ("none" when it holds none).
absl::Status CheckManifestMac(const ChannelKey* key, const Manifest& m, std::string_view uri,
                              std::string_view current);

// A handshake proof: HMAC-SHA-512-256 under `key` of `role` ("publisher" or "subscriber"),
// then `first` and `second`. Each side proves itself over the nonce the other side chose (and
// its own), so a proof cannot be replayed to another connection or reflected back.
std::array<uint8_t, 32> HandshakeProof(const ChannelKey& key, std::string_view role,
                                       const Nonce& first, const Nonce& second);
// The bytes of a nonce or proof, to send as a string.
inline std::string_view AsText(const std::array<uint8_t, 32>& bytes) {
  return std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}
// Constant-time check of a proof received as bytes (any length; wrong lengths are false).
bool ProofMatches(const std::array<uint8_t, 32>& expected, std::string_view received);

}  // namespace weightbus::internal

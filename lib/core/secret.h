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
// XXH3-64 (and block checksums where recorded), in order, and the metadata except
// kMacMetadataKey. A group manifest (Manifest::group: one rank's part, or the committed version
// of a publisher group) is MACed in a domain of its own and also covers the publisher's rank
// (the part's, or the committing rank's), the group's world_size and every tensor's owner rank,
// so that no part can pass for another rank's and no single publisher's MAC for a group's.
// Times, host and pid are not covered.
std::string ManifestMac(const ChannelKey& key, const Manifest& m);

// Checks the MAC of a manifest offered to a subscriber, before any of its bytes is accepted.
// With a key: PermissionDenied naming `uri`, the version and session when the manifest carries
// no MAC or a wrong one. Without one: FailedPrecondition when it carries a MAC (the channel
// needs a secret this subscriber lacks: configure secret_file or secret_env). `current` is the
// version the subscriber holds, for the messages ("none" when it holds none).
absl::Status CheckManifestMac(const ChannelKey* key, const Manifest& m, std::string_view uri,
                              std::string_view current);

// Checks one rank's part of a group version before the committing rank `committer` assembles
// it (docs/SECURITY.md, "Publisher groups"): the part of rank `part.publisher.rank` must carry
// a valid MAC under the committer's key `key`, or, on a channel without a secret (`key`
// nullptr), none. `where` names the channel and version in messages. Errors:
// PermissionDenied naming the rank when the part carries no MAC or a wrong one (a rank
// configured without the secret or with another one, or a part forged or altered by someone
// who can write the channel directory but lacks the key); FailedPrecondition naming the rank
// when the part carries a MAC but the committer has no secret.
absl::Status CheckPartMac(const ChannelKey* key, const Manifest& part, int committer,
                          std::string_view where);

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

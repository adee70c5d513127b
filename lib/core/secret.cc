// SPDX-License-Identifier: Apache-2.0
#include "core/secret.h"

#include <fcntl.h>
#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "core/system.h"

namespace weightbus::internal {
namespace {

absl::Status InitSodium() {
  if (sodium_init() < 0) return absl::InternalError("libsodium failed to initialise");
  return absl::OkStatus();
}

// Reads the secret file `path` after checking its type and mode.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path, std::string_view where) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) {
    return ErrnoStatus(errno, absl::StrFormat("%s: secret_file \"%s\"", where, path));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    return ErrnoStatus(errno, absl::StrFormat("%s: secret_file \"%s\"", where, path));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: secret_file \"%s\" is not a regular file", where, path));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: secret_file \"%s\" has mode %04o: group or others may read or write it; refusing a "
        "secret others can read (chmod 600 \"%s\")",
        where, path, st.st_mode & 07777, path));
  }
  if (st.st_size > static_cast<off_t>(kMaxSecretBytes) + 2) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: secret_file \"%s\" holds %d bytes; a secret is at most %d bytes",
                        where, path, st.st_size, kMaxSecretBytes));
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(errno, absl::StrFormat("%s: secret_file \"%s\"", where, path));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);
  return text;
}

// Feeds a length-prefixed field to the MAC state, so that no two manifests share an encoding.
void Field(crypto_auth_hmacsha512256_state& state, std::string_view bytes) {
  const uint64_t n = bytes.size();
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  crypto_auth_hmacsha512256_update(&state, len, sizeof len);
  crypto_auth_hmacsha512256_update(&state, reinterpret_cast<const uint8_t*>(bytes.data()), n);
}

void Int(crypto_auth_hmacsha512256_state& state, uint64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(v >> (8 * i));
  crypto_auth_hmacsha512256_update(&state, b, sizeof b);
}

void Ints(crypto_auth_hmacsha512256_state& state, const std::vector<int64_t>& v) {
  Int(state, v.size());
  for (int64_t x : v) Int(state, static_cast<uint64_t>(x));
}

std::string Hex(const uint8_t* bytes, size_t n) {
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), n));
}

}  // namespace

Nonce RandomNonce() {
  (void)InitSodium();  // idempotent; randombytes works (from the kernel) even if it failed
  Nonce n;
  randombytes_buf(n.data(), n.size());
  return n;
}

absl::Status RefuseInlineSecret(const std::map<std::string, std::string>& map,
                                std::string_view where, std::string_view uri) {
  for (const char* name : {"secret"}) {
    if (map.count(name) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: setting \"%s\" in %s is refused: a channel's secret is never given in a URI or "
          "on a command line (others can read those); name a file with secret_file (mode 0600) "
          "or an environment variable with secret_env",
          uri, name, where));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<ChannelKey>> LoadChannelKey(const Config& config,
                                                         std::string_view where) {
  const std::string& file = config.String("secret_file");
  const std::string& env = config.String("secret_env");
  if (file.empty() && env.empty()) return std::nullopt;
  if (!file.empty() && !env.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: settings secret_file=\"%s\" and secret_env=\"%s\" are both set; set one", where, file,
        env));
  }
  WB_RETURN_IF_ERROR(InitSodium());
  std::string secret;
  std::string source;
  if (!file.empty()) {
    WB_ASSIGN_OR_RETURN(secret, ReadSecretFile(file, where));
    source = absl::StrFormat("secret_file \"%s\"", file);
  } else {
    const char* value = std::getenv(env.c_str());
    if (value == nullptr || *value == '\0') {
      return absl::NotFoundError(
          absl::StrFormat("%s: secret_env names the environment variable %s, which is %s", where,
                          env, value == nullptr ? "not set" : "empty"));
    }
    secret = value;
    source = absl::StrFormat("environment variable %s (secret_env)", env);
  }
  if (!secret.empty() && secret.back() == '\n') secret.pop_back();
  if (!secret.empty() && secret.back() == '\r') secret.pop_back();
  if (secret.size() < kMinSecretBytes || secret.size() > kMaxSecretBytes) {
    sodium_memzero(secret.data(), secret.size());
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the secret from %s is %d bytes; expected %d to %d bytes (e.g. `head -c 32 "
        "/dev/urandom | base64`)",
        where, source, secret.size(), kMinSecretBytes, kMaxSecretBytes));
  }
  ChannelKey key;
  static constexpr char kContext[] = "weightbus.channel-key/1";
  crypto_generichash_state state;
  crypto_generichash_init(&state, nullptr, 0, key.bytes.size());
  crypto_generichash_update(&state, reinterpret_cast<const uint8_t*>(kContext), sizeof kContext);
  crypto_generichash_update(&state, reinterpret_cast<const uint8_t*>(secret.data()), secret.size());
  crypto_generichash_final(&state, key.bytes.data(), key.bytes.size());
  sodium_memzero(secret.data(), secret.size());
  return key;
}

std::string ManifestMac(const ChannelKey& key, const Manifest& m) {
  crypto_auth_hmacsha512256_state state;
  crypto_auth_hmacsha512256_init(&state, key.bytes.data(), key.bytes.size());
  // A group's manifests in a domain of their own (a single publisher's fields are as before).
  Field(state, m.group ? "weightbus.group-manifest-mac/1" : "weightbus.manifest-mac/1");
  Int(state, m.version);
  Field(state, m.publisher.session);
  if (m.group) {
    Int(state, static_cast<uint64_t>(m.publisher.rank));
    Int(state, static_cast<uint64_t>(m.publisher.world_size));
  }
  Int(state, m.tensors.size());
  for (const TensorInfo& t : m.tensors) {
    if (m.group) Int(state, static_cast<uint64_t>(t.owner));
    Field(state, t.name);
    Field(state, DTypeName(t.dtype));
    Ints(state, t.shape);
    Int(state, t.shard.has_value());
    if (t.shard) {
      Ints(state, t.shard->global_shape);
      Ints(state, t.shard->offsets);
    }
    Int(state, t.nbytes);
    Int(state, t.xxh3);
    // Partial readers trust the block checksums alone; absent ones leave the MAC as it was.
    // Tiles (format 2) start with a 0, which no block size of format 1 is.
    if (t.block_bytes > 0) {
      if (t.block_rows > 0) {
        Int(state, 0);
        Int(state, t.block_rows);
      }
      Int(state, t.block_bytes);
      Int(state, t.block_xxh3.size());
      for (uint64_t b : t.block_xxh3) Int(state, b);
    }
  }
  uint64_t entries = 0;
  for (const auto& [k, v] : m.metadata) entries += k != kMacMetadataKey;
  Int(state, entries);
  for (const auto& [k, v] : m.metadata) {
    if (k == kMacMetadataKey) continue;
    Field(state, k);
    Field(state, v);
  }
  uint8_t mac[crypto_auth_hmacsha512256_BYTES];
  crypto_auth_hmacsha512256_final(&state, mac);
  return Hex(mac, sizeof mac);
}

namespace {
// What a manifest's MAC entry says under `key`: absent, valid or wrong.
enum class MacIs { kAbsent, kValid, kWrong };
MacIs MacOf(const ChannelKey& key, const Manifest& m) {
  auto it = m.metadata.find(std::string(kMacMetadataKey));
  if (it == m.metadata.end()) return MacIs::kAbsent;
  const std::string expected = ManifestMac(key, m);
  return it->second.size() == expected.size() &&
                 sodium_memcmp(it->second.data(), expected.data(), expected.size()) == 0
             ? MacIs::kValid
             : MacIs::kWrong;
}
}  // namespace

absl::Status CheckManifestMac(const ChannelKey* key, const Manifest& m, std::string_view uri,
                              std::string_view current) {
  const std::string session = m.publisher.session.empty() ? "(unnamed)" : m.publisher.session;
  if (key == nullptr) {
    if (m.metadata.count(std::string(kMacMetadataKey)) == 0) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: version %d (publisher session %s) is authenticated with a shared secret this "
        "subscriber does not have: configure the channel's secret with secret_file or secret_env "
        "to receive it; version %s stays current",
        uri, m.version, session, current));
  }
  const MacIs mac = MacOf(*key, m);
  if (mac == MacIs::kAbsent) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: version %d (publisher session %s, pid %d on %s) carries no MAC, but this subscriber "
        "requires the channel's shared secret: refusing it as unauthenticated (a publisher "
        "without the secret, or a forged version); version %s stays current",
        uri, m.version, session, m.publisher.pid, m.publisher.host, current));
  }
  if (mac == MacIs::kWrong) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: version %d (publisher session %s, pid %d on %s) has a wrong MAC: it was not "
        "published with this channel's shared secret, or its manifest was altered; refusing it; "
        "version %s stays current",
        uri, m.version, session, m.publisher.pid, m.publisher.host, current));
  }
  return absl::OkStatus();
}

absl::Status CheckPartMac(const ChannelKey* key, const Manifest& part, int committer,
                          std::string_view where) {
  const int rank = part.publisher.rank;
  const std::string who =
      absl::StrFormat("rank %d's part (publisher session %s, pid %d on %s)", rank,
                      part.publisher.session.empty() ? "(unnamed)" : part.publisher.session,
                      part.publisher.pid, part.publisher.host);
  if (key == nullptr) {
    if (part.metadata.count(std::string(kMacMetadataKey)) == 0) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: %s is authenticated with a shared secret, but the committing rank %d has none: "
        "every rank of a group needs the channel's secret (secret_file or secret_env)",
        where, who, committer));
  }
  const MacIs mac = MacOf(*key, part);
  if (mac == MacIs::kAbsent) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: %s carries no MAC, but the channel requires its shared secret: rank %d publishes "
        "without the secret, or its part was forged by someone without the key; the committing "
        "rank %d refuses it",
        where, who, rank, committer));
  }
  if (mac == MacIs::kWrong) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: %s has a wrong MAC under the key of the committing rank %d: ranks %d and %d hold "
        "different secrets (check secret_file or secret_env on both), or the part was forged or "
        "altered; refusing it",
        where, who, committer, rank, committer));
  }
  return absl::OkStatus();
}

std::array<uint8_t, 32> HandshakeProof(const ChannelKey& key, std::string_view role,
                                       const Nonce& first, const Nonce& second) {
  crypto_auth_hmacsha512256_state state;
  crypto_auth_hmacsha512256_init(&state, key.bytes.data(), key.bytes.size());
  Field(state, "weightbus.ucx-handshake/1");
  Field(state, role);
  crypto_auth_hmacsha512256_update(&state, first.data(), first.size());
  crypto_auth_hmacsha512256_update(&state, second.data(), second.size());
  std::array<uint8_t, 32> out;
  crypto_auth_hmacsha512256_final(&state, out.data());
  return out;
}

bool ProofMatches(const std::array<uint8_t, 32>& expected, std::string_view received) {
  return received.size() == expected.size() &&
         sodium_memcmp(received.data(), expected.data(), expected.size()) == 0;
}

}  // namespace weightbus::internal

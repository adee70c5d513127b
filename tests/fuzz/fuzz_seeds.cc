// SPDX-License-Identifier: Apache-2.0
// Writes the seed corpora of the fuzz targets from real inputs, produced by the library itself:
//
//   fuzz_seeds OUTDIR STORIES260K_BIN
//
// It converts the real trained Llama checkpoint stories260K.bin (../shared/fixtures) to Hugging
// Face layout in BF16 and publishes it, then one Adam-like step of it, over disk:// and
// delta+disk:// channels in OUTDIR/.work (removed afterwards), together with a small version that
// has every dtype, a 0-d scalar, a zero-size tensor, shards and metadata. From what the library
// wrote it keeps:
//   OUTDIR/manifest_fuzz/ the versions' weightbus.manifest.json files (plain and delta-inner)
//   OUTDIR/delta_record_fuzz/ the delta layer's inner manifests (keyframe and delta records)
//   OUTDIR/safetensors_fuzz/ the versions' model.safetensors files
//   OUTDIR/ucx_control_fuzz/ one frame of every control message, encoded by control.h with
//                         realistic contents (GRANTs carry the real manifests)
//   OUTDIR/nccl_control_fuzz/ the same for nccl:// (OFFERs carry the real manifests and the
//                         bucket plans a publisher makes for them)
// Each directory is written only when this build has what produces it (disk, delta, ucx, nccl).
// Exit status 0 on success; 1 with a message naming the step otherwise.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "weightbus/llama2c.h"
#include "weightbus/manifest.hpp"
#include "weightbus/weightbus.hpp"
#ifdef WB_FUZZ_SEEDS_NCCL
#include "transports/nccl/device.h"
#include "transports/nccl/plan.h"
#include "transports/nccl/protocol.h"
#endif
#ifdef WB_FUZZ_SEEDS_UCX
#include "transports/ucx/control.h"
#include "transports/ucx/descriptor.h"
#endif

namespace {

namespace fs = std::filesystem;
using weightbus::DType;
using weightbus::TensorView;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_seeds: %s\n", what.c_str());
  std::exit(1);
}

void Ok(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Fail(absl::StrFormat("%s: %s", what, s.ToString()));
}

std::string ReadWhole(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) Fail("cannot read " + path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
  if (!out) Fail("cannot write " + path.string());
}

// The small version: every dtype (sizes valid for the sub-byte ones), a scalar, a zero-size
// tensor, a shard and names with characters a path would not take.
struct Small {
  std::vector<std::vector<std::byte>> bytes;
  std::vector<TensorView> views;
};

Small SmallVersion() {
  Small s;
  int i = 0;
  for (DType dtype : weightbus::kAllDTypes) {
    TensorView v;
    v.name = absl::StrFormat("model.layers.%d.%s", i++, weightbus::DTypeName(dtype));
    v.dtype = dtype;
    v.shape = {2, 4};
    s.bytes.emplace_back(*weightbus::ByteSize(dtype, v.shape));
    for (size_t k = 0; k < s.bytes.back().size(); ++k) s.bytes.back()[k] = std::byte(k * 37 + i);
    s.views.push_back(v);
  }
  s.views.push_back(TensorView{.name = "scalar", .dtype = DType::kF32, .shape = {}});
  s.bytes.emplace_back(4, std::byte{0x3f});
  s.views.push_back(
      TensorView{.name = "empty/../x \xc3\xa9", .dtype = DType::kBF16, .shape = {0, 3}});
  s.bytes.emplace_back();
  TensorView shard{.name = "lm_head.weight", .dtype = DType::kBF16, .shape = {4, 8}};
  shard.shard = weightbus::Shard{{16, 8}, {4, 0}};
  s.views.push_back(shard);
  s.bytes.emplace_back(64, std::byte{0x41});
  for (size_t k = 0; k < s.views.size(); ++k) {
    s.views[k].data = s.bytes[k].empty() ? nullptr : s.bytes[k].data();
  }
  return s;
}

// Publishes `versions` (each a list of views) to `uri` and returns the channel's version
// directories' paths, newest last.
std::vector<fs::path> PublishAll(const std::string& uri, const fs::path& root,
                                 const std::vector<std::vector<TensorView>>& versions,
                                 const weightbus::Metadata& metadata) {
  auto pub = weightbus::Publisher::Open(uri);
  Ok(pub.status(), "open " + uri);
  std::vector<fs::path> dirs;
  for (size_t v = 0; v < versions.size(); ++v) {
    Ok((*pub)->Publish(v + 1, versions[v], metadata, absl::Seconds(60)),
       absl::StrFormat("publish version %d to %s", v + 1, uri));
    dirs.push_back(root / "versions" / absl::StrFormat("v%020d", v + 1));
  }
  return dirs;
}

#ifdef WB_FUZZ_SEEDS_UCX
// One frame of every control message, with the contents a real session has: the GRANTs carry
// `manifests` (the versions published above).
void WriteUcxSeeds(const fs::path& dir, const std::vector<std::string>& manifests) {
  namespace ucx = weightbus::internal::ucx;
  fs::create_directories(dir);
  std::string address(164, '\0'), rkey(58, '\0');  // typical packed sizes (shm + tcp)
  for (size_t i = 0; i < address.size(); ++i) address[i] = static_cast<char>(i * 131 + 7);
  for (size_t i = 0; i < rkey.size(); ++i) rkey[i] = static_cast<char>(i * 61 + 3);
  const std::vector<std::pair<std::string, std::string>> frames = {
      {"hello", ucx::Encode(ucx::HelloMsg{ucx::kMagic, ucx::kProtocolVersion, "policy",
                                          0x1234abcd5678ef00, "replica-0 pid 4242 on host-a"})},
      {"hello-nonce",
       ucx::Encode(ucx::HelloMsg{ucx::kMagic, ucx::kProtocolVersion, "policy", 0x1234abcd5678ef00,
                                 "replica-0 pid 4242 on host-a", std::string(32, '\x5a')})},
      {"challenge", ucx::Encode(ucx::ChallengeMsg{std::string(32, '\x3c'), std::string(32, 'p')})},
      {"proof", ucx::Encode(ucx::ProofMsg{std::string(32, 's')})},
      {"welcome",
       ucx::Encode(ucx::WelcomeMsg{ucx::kProtocolVersion, 0x0f1e2d3c4b5a6978, address,
                                   30'000'000'000, true, 7, "trainer pid 17 on host-b", false})},
      {"error", ucx::Encode(ucx::ErrorMsg{5,
                                          "the publisher at port 5555 serves channel "
                                          "\"policy\", not \"other\""})},
      {"wait", ucx::Encode(ucx::WaitMsg{3, 8, ucx::kWaitNewest})},
      {"wait-exact", ucx::Encode(ucx::WaitMsg{4, 6, ucx::kWaitExact})},
      {"refused", ucx::Encode(ucx::RefusedMsg{4, 5,
                                              "the publisher no longer holds version 6 "
                                              "(it holds: 7, 8)"})},
      {"cancel", ucx::Encode(ucx::CancelMsg{3})},
      {"renew", ucx::Encode(ucx::RenewMsg{11})},
      {"release", ucx::Encode(ucx::ReleaseMsg{11, true})},
      {"released", ucx::Encode(ucx::ReleasedMsg{11, true})},
      {"accepted", ucx::Encode(ucx::AcceptedMsg{8})},
      {"list", ucx::Encode(ucx::ListMsg{5})},
      {"versions", ucx::Encode(ucx::VersionsMsg{5, {6, 7, 8}})},
      {"renewed", ucx::Encode(ucx::RenewedMsg{11, false})},
      {"read", ucx::Encode(ucx::ReadMsg{100, 11, 65536, 65536})},
      {"data", ucx::Encode(ucx::DataMsg{100, true, std::string_view(rkey)})},
      {"keyframe-request",
       ucx::Encode(ucx::KeyframeRequestMsg{9, true, 7,
                                           "version 9 fails verification: the blob's XXH3-64 is "
                                           "0123456789abcdef, its record says fedcba9876543210"})},
      {"report",
       ucx::Encode(ucx::ReportMsg{9, R"({"format":"weightbus.delta-report/1","version":9,)"
                                     R"("bytes":268435456,"decode_s":0.12,"apply_s":0.02})"})},
  };
  for (const auto& [name, frame] : frames) WriteFile(dir / (name + ".bin"), frame);
  // A session as a subscriber sees it: WELCOME, then a GRANT per version, then a RENEWED. Each
  // version's descriptor records (layout, seal, header) go in frames of the fuzz target's own
  // types (kLayoutFrame, kSealFrame, kHeaderFrame in ucx_control_fuzz.cc).
  std::string session = frames[4].second;
  for (size_t v = 0; v < manifests.size(); ++v) {
    auto m = weightbus::Manifest::FromJson(manifests[v], "seed manifest");
    Ok(m.status(), "parse a seed manifest");
    ucx::VersionLayout layout;
    layout.version = m->version;
    layout.chunk_bytes = 4 << 20;
    layout.manifest_json = ucx::Unsealed(*m).ToJson();
    uint64_t offset = 0;
    for (const weightbus::TensorInfo& t : m->tensors) {
      layout.offsets.push_back(offset);
      offset += (t.nbytes + 63) / 64 * 64;
    }
    // The slot in two regions, as a publisher with max_region below the slot size has.
    const uint64_t half = (offset / 2 + 4095) / 4096 * 4096;
    layout.regions.push_back({2 * v + 1, 0, 0x7f0000000000 + v * 0x10000000, half, rkey});
    layout.regions.push_back(
        {2 * v + 2, half, 0x7f0000800000 + v * 0x10000000, offset - half + 4096, rkey});
    layout.data_bytes = offset + 4096;
    layout.live = {1, 2, 3, 4, 100 + v};
    const std::string encoded_layout = ucx::EncodeLayout(layout);
    const uint64_t nchunks = (offset + layout.chunk_bytes - 1) / layout.chunk_bytes;
    const uint64_t layout_offset = ucx::ReadyOffset(nchunks);
    const std::string encoded_seal = ucx::EncodeSeal(ucx::SealOf(*m));
    ucx::DescriptorHeader h;
    h.version = m->version;
    h.state = static_cast<uint64_t>(ucx::VersionState::kSealed);
    h.nchunks = nchunks;
    h.layout_offset = layout_offset;
    h.layout_bytes = encoded_layout.size();
    h.seal_offset = (layout_offset + encoded_layout.size() + 63) / 64 * 64;
    h.seal_bytes = encoded_seal.size();
    auto record = [](uint8_t type, const std::string& bytes) {
      return ucx::Writer(static_cast<ucx::MsgType>(type)).Raw(bytes).Finish();
    };
    WriteFile(dir / absl::StrFormat("layout-%d.bin", v + 1), record(0xf0, encoded_layout));
    WriteFile(dir / absl::StrFormat("seal-%d.bin", v + 1), record(0xf1, encoded_seal));
    WriteFile(dir / absl::StrFormat("header-%d.bin", v + 1), record(0xf2, ucx::EncodeHeader(h)));
    const std::string grant = ucx::Encode(
        ucx::GrantMsg{v + 1, 10 + v, 30'000'000'000, m->version,
                      ucx::GrantRegion{100 + v, offset + 4096, 0x7f00f0000000 + v * 0x100000,
                                       h.seal_offset + 4096, rkey},
                      layout_offset + encoded_layout.size()});
    WriteFile(dir / absl::StrFormat("grant-%d.bin", v + 1), grant);
    session += grant;
  }
  WriteFile(dir / "relay-offer.bin",
            ucx::Encode(ucx::RelayOfferMsg{address, 0x7f00e0000000, 1 << 20, rkey, 4243}));
  ucx::GrantMsg relayed{
      9,
      19,
      30'000'000'000,
      3,
      {7, 1 << 20, 0x7f00f0000000, 8192, rkey},
      4096,
      true,
      ucx::RelaySource{0x1234abcd5678ef00, address, 0x7f00e0000000, 1 << 20, rkey, 4243, 1}};
  WriteFile(dir / "grant-relayed.bin", ucx::Encode(relayed));
  WriteFile(dir / "aborted.bin",
            ucx::Encode(ucx::AbortedMsg{11, 4,
                                        "the publish of version 9 failed before it was sealed "
                                        "(deadline exceeded); nothing of it may be used"}));
  session += frames[16].second;  // RENEWED
  WriteFile(dir / "session.bin", session);
}
#endif

#ifdef WB_FUZZ_SEEDS_NCCL
// One frame of every nccl:// control message, and a replica's session: WELCOME, GROUP, then an
// OFFER per version (its manifest from `manifests`, its plan made as the publisher makes it,
// with buckets small enough to split tensors), START, ABORT.
void WriteNcclSeeds(const fs::path& dir, const std::vector<std::string>& manifests) {
  namespace nccl = weightbus::internal::nccl;
  fs::create_directories(dir);
  std::string id(nccl::kUniqueIdBytes, '\0');
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<char>(i * 37 + 11);
  const std::vector<std::pair<std::string, std::string>> frames = {
      {"hello", nccl::Encode(nccl::HelloMsg{nccl::kMagic,
                                            nccl::kProtocolVersion,
                                            "policy",
                                            0x1234abcd5678ef00,
                                            "pid 4242 on infer-3",
                                            "GPU 1 (NVIDIA H200, PCI 0000:1b:00.0)",
                                            "GPU-5f3c2a10-88e1-4b1e-9d0c-1a2b3c4d5e6f",
                                            22809,
                                            {{"NCCL_CUMEM_ENABLE", "0"}, {"NCCL_PROTO", ""}}})},
      {"welcome",
       nccl::Encode(nccl::WelcomeMsg{nccl::kProtocolVersion, 0x0f1e2d3c4b5a6978,
                                     "pid 12 on trainer-0, GPU 0 (NVIDIA H200)", true, 7})},
      {"error", nccl::Encode(nccl::ErrorMsg{9,
                                            "NCCL_CUMEM_ENABLE is \"1\" on the publisher but "
                                            "\"0\" on replica pid 4242 on infer-3"})},
      {"group", nccl::Encode(nccl::GroupMsg{3, 2, 4, id, "rank 0: the publisher; rank 1: ..."})},
      {"group-ready", nccl::Encode(nccl::GroupReadyMsg{3, 0, ""})},
      {"ready", nccl::Encode(nccl::ReadyMsg{8})},
      {"start", nccl::Encode(nccl::StartMsg{3, 8})},
      {"received", nccl::Encode(nccl::ReceivedMsg{8, 5})},
      {"commit", nccl::Encode(nccl::CommitMsg{3, 8})},
      {"abort", nccl::Encode(nccl::AbortMsg{3, 8, 14, "replica pid 4242 (rank 2) is gone"})},
      {"failed", nccl::Encode(nccl::FailedMsg{3, 8, 4, "bucket 3 did not arrive"})},
      {"accepted", nccl::Encode(nccl::AcceptedMsg{8})},
      {"slots", nccl::Encode(nccl::SlotsMsg{
                    3, 256 << 20, {std::string(76, '\x42'), std::string(76, '\x43')}})},
      {"bucket", nccl::Encode(nccl::BucketMsg{8, 4, 0})},
  };
  for (const auto& [name, frame] : frames) WriteFile(dir / (name + ".bin"), frame);
  std::string session = frames[1].second + frames[3].second;
  for (size_t v = 0; v < manifests.size(); ++v) {
    auto m = weightbus::Manifest::FromJson(manifests[v], "seed manifest");
    Ok(m.status(), "parse a seed manifest");
    auto plan = nccl::PlanBucketsFor(*m, 64 << 10);
    Ok(plan.status(), "plan a seed version's buckets");
    const std::string offer =
        nccl::Encode(nccl::OfferMsg{3, m->version, manifests[v], nccl::EncodePlan(*plan)});
    WriteFile(dir / absl::StrFormat("offer-%d.bin", v + 1), offer);
    session += offer + nccl::Encode(nccl::StartMsg{3, m->version}) +
               nccl::Encode(nccl::CommitMsg{3, m->version});
  }
  session += frames[9].second;
  WriteFile(dir / "session.bin", session);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) Fail("usage: fuzz_seeds OUTDIR STORIES260K_BIN");
  const fs::path out = fs::absolute(argv[1]);
  const fs::path work = out / ".work";
  std::error_code ec;
  fs::remove_all(work, ec);
  fs::create_directories(work);
  for (const char* sub : {"manifest_fuzz", "delta_record_fuzz", "safetensors_fuzz"}) {
    fs::create_directories(out / sub);
  }

  auto checkpoint = weightbus::tools::ReadLlama2c(argv[2]);
  Ok(checkpoint.status(), "read the llama2.c checkpoint");
  auto model = weightbus::tools::ConvertToHf(*checkpoint, DType::kBF16);
  Ok(model.status(), "convert it to Hugging Face layout");
  std::vector<TensorView> v1, v2;
  std::vector<weightbus::tools::OwnedTensor> stepped = *model;
  for (auto& t : stepped) {
    // One step of an update: every 50th BF16 element's low mantissa bit flips.
    for (size_t k = 0; k < t.bytes.size(); k += 100) t.bytes[k] ^= std::byte{1};
  }
  for (const auto& t : *model) v1.push_back(t.view());
  for (const auto& t : stepped) v2.push_back(t.view());
  const Small small = SmallVersion();
  const weightbus::Metadata metadata = {{"step", "1"}, {"run", "fuzz seeds \xe2\x9c\x93"}};

  std::vector<std::string> manifests;
  const fs::path plain = work / "plain";
  auto dirs = PublishAll("disk://" + plain.string() + "?retention=10&fsync=false", plain,
                         {v1, v2, small.views}, metadata);
  {
    for (size_t v = 0; v < dirs.size(); ++v) {
      const std::string m = ReadWhole(dirs[v] / "weightbus.manifest.json");
      manifests.push_back(m);
      WriteFile(out / "manifest_fuzz" / absl::StrFormat("disk-v%d.json", v + 1), m);
    }
    // stories260K (520 KB) and the small version.
    fs::copy_file(dirs[0] / "model.safetensors",
                  out / "safetensors_fuzz" / "stories260K-bf16.safetensors",
                  fs::copy_options::overwrite_existing);
    fs::copy_file(dirs[2] / "model.safetensors",
                  out / "safetensors_fuzz" / "every-dtype.safetensors",
                  fs::copy_options::overwrite_existing);
  }

#ifdef WB_FUZZ_SEEDS_DELTA
  const fs::path delta = work / "delta";
  auto delta_dirs = PublishAll("delta+disk://" + delta.string() + "?retention=10&fsync=false",
                               delta, {v1, v2, v1, small.views}, metadata);
  for (size_t v = 0; v < delta_dirs.size(); ++v) {
    const std::string m = ReadWhole(delta_dirs[v] / "weightbus.manifest.json");
    WriteFile(out / "delta_record_fuzz" / absl::StrFormat("delta-disk-v%d.json", v + 1), m);
    WriteFile(out / "manifest_fuzz" / absl::StrFormat("delta-disk-inner-v%d.json", v + 1), m);
  }
#endif
#ifdef WB_FUZZ_SEEDS_UCX
  WriteUcxSeeds(out / "ucx_control_fuzz", manifests);
#endif
#ifdef WB_FUZZ_SEEDS_NCCL
  WriteNcclSeeds(out / "nccl_control_fuzz", manifests);
#endif
  fs::remove_all(work, ec);
  std::printf("fuzz_seeds: wrote the seed corpora to %s\n", out.c_str());
  return 0;
}

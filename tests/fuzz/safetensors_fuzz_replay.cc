// SPDX-License-Identifier: Apache-2.0
// Replay driver for the safetensors fuzz target, for compilers without libFuzzer (and for CTest).
//
//   safetensors_fuzz_replay [--mutations=N] [--write-seeds=DIR] [--regressions=DIR] PATH...
//
// Runs LLVMFuzzerTestOneInput on built-in seeds, on every file given (a directory stands for the
// regular files directly inside it), and on N deterministic mutations (fixed seed) of each of
// them: bit flips, byte substitutions, truncations, insertions, deletions, duplicated ranges and
// edits of digits, mostly inside the JSON header with the length prefix kept consistent so that
// the mutants get past the first checks. A violated invariant aborts; the signal handler names
// the input and saves it as ./safetensors-fuzz-crash.bin for reproduction.
// --write-seeds=DIR writes the built-in seeds to DIR (a starting corpus for libFuzzer).
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "replay.h"

namespace {

namespace fs = std::filesystem;

struct Stats {
  size_t runs = 0;
};

void Run(const std::string& name, const std::string& bytes, Stats& stats) {
  weightbus::fuzz::ReplayOne(name, bytes);
  ++stats.runs;
}

std::string Le64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

std::string MakeFile(const std::string& header, const std::string& data = "") {
  return Le64(header.size()) + header + data;
}

std::vector<std::pair<std::string, std::string>> BuiltinSeeds() {
  const std::string t4 = R"("dtype":"U8","shape":[4])";
  return {
      {"empty", MakeFile("{}")},
      {"empty-padded", MakeFile("{}      ")},
      {"metadata-only", MakeFile(R"({"__metadata__":{"a":"b","":"\u00e9\n"}})")},
      {"one", MakeFile(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})",
                       std::string(16, '\x3f'))},
      {"zero-size", MakeFile(R"({"z":{"dtype":"F64","shape":[0,3],"data_offsets":[0,0]},)"
                             R"("a":{)" +
                                 t4 +
                                 R"(,"data_offsets":[0,4]},)"
                                 R"("y":{"dtype":"BOOL","shape":[0],"data_offsets":[4,4]}})",
                             "abcd")},
      {"scalars", MakeFile(R"({"__metadata__":{"k":"v"},"s":{"dtype":"I64","shape":[],)"
                           R"("data_offsets":[0,8]},"t":{"dtype":"F8_E4M3","shape":[],)"
                           R"("data_offsets":[8,9]},"u":{"dtype":"BF16","shape":[1,1],)"
                           R"("data_offsets":[9,11]}})",
                           std::string(11, '\x01'))},
      {"weird-names", MakeFile(R"({"a.b/c d\"e\\f\n\u0001\ud83d\ude00":{)" + t4 +
                                   R"(,"data_offsets":[0,4]},"\u0000":{"dtype":"I8","shape":[1],)"
                                   R"("data_offsets":[4,5]}})",
                               "12345")},
      {"unknown-fields",
       MakeFile(R"({"w":{"x":[1,{"y":null}],)" + t4 + R"(,"data_offsets":[0,4],"z":true}})",
                "wxyz")},
      {"duplicate", MakeFile(R"({"w":{)" + t4 + R"(,"data_offsets":[0,4]},"w":{)" + t4 +
                                 R"(,"data_offsets":[4,8]}})",
                             "12345678")},
      {"overlap", MakeFile(R"({"a":{)" + t4 + R"(,"data_offsets":[0,4]},"b":{)" + t4 +
                               R"(,"data_offsets":[2,6]}})",
                           "123456")},
      {"hole", MakeFile(R"({"a":{)" + t4 + R"(,"data_offsets":[0,4]},"b":{)" + t4 +
                            R"(,"data_offsets":[6,10]}})",
                        "1234567890")},
      {"trailing", MakeFile(R"({"a":{)" + t4 + R"(,"data_offsets":[0,4]}})", "123456")},
      {"bad-size", MakeFile(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,4]}})", "1234")},
      {"huge-dims", MakeFile(R"({"a":{"dtype":"F64","shape":[4611686018427387904,4],)"
                             R"("data_offsets":[0,0]}})")},
      {"huge-offsets", MakeFile(R"({"a":{"dtype":"U8","shape":[0],)"
                                R"("data_offsets":[18446744073709551615,18446744073709551615]}})")},
      {"bad-utf8", MakeFile("{\"\xed\xa0\x80\":{}}")},
      {"nul", MakeFile(std::string("{}\0{}", 5))},
      {"short", std::string("\x02\0\0", 3)},
      {"huge-length", Le64(~uint64_t{0}) + "{}"},
  };
}

using weightbus::fuzz::Rng;

// Bytes that matter to the parser: JSON syntax, digits, signs, and UTF-8 edge bytes.
constexpr char kInteresting[] =
    "{}[]\":,0123456789-+.eE \\ntuf\x00\x7f\x80\xbf\xc0\xc3\xe0\xed\xf0\xf4\xff";

char InterestingByte(Rng& rng) { return kInteresting[rng.Below(sizeof(kInteresting) - 1)]; }

void MutateOnce(std::string& s, Rng& rng) {
  switch (rng.Below(7)) {
    case 0:  // flip a bit
      if (!s.empty()) s[rng.Below(s.size())] ^= static_cast<char>(1u << rng.Below(8));
      break;
    case 1:  // substitute an interesting byte
      if (!s.empty()) s[rng.Below(s.size())] = InterestingByte(rng);
      break;
    case 2:  // truncate
      s.resize(rng.Below(s.size() + 1));
      break;
    case 3: {  // insert 1-8 bytes
      std::string ins;
      const size_t n = 1 + rng.Below(8);
      for (size_t i = 0; i < n; ++i) {
        ins.push_back(rng.Below(2) ? InterestingByte(rng) : static_cast<char>(rng.Next()));
      }
      s.insert(rng.Below(s.size() + 1), ins);
      break;
    }
    case 4:  // delete 1-16 bytes
      if (!s.empty()) {
        const size_t at = rng.Below(s.size());
        s.erase(at, 1 + rng.Below(16));
      }
      break;
    case 5:  // copy a range elsewhere (duplicated keys, repeated entries)
      if (!s.empty()) {
        const size_t from = rng.Below(s.size());
        const std::string piece = s.substr(from, 1 + rng.Below(64));
        s.insert(rng.Below(s.size() + 1), piece);
      }
      break;
    case 6: {  // change a digit (offsets, shapes)
      std::vector<size_t> digits;
      for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] >= '0' && s[i] <= '9') digits.push_back(i);
      }
      if (!digits.empty()) {
        s[digits[rng.Below(digits.size())]] = static_cast<char>('0' + rng.Below(10));
      }
      break;
    }
  }
}

std::string Mutate(const std::string& input, Rng& rng) {
  uint64_t n = 0;
  bool framed = input.size() >= 8;
  if (framed) {
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(input[i]);
    framed = n <= input.size() - 8;
  }
  const size_t ops = 1 + rng.Below(3);
  const uint64_t choice = rng.Below(10);
  if (!framed || choice < 2) {
    // Raw bytes, length prefix included.
    std::string s = input;
    for (size_t i = 0; i < ops; ++i) MutateOnce(s, rng);
    return s;
  }
  std::string header = input.substr(8, n);
  std::string data = input.substr(8 + n);
  if (choice < 8) {
    for (size_t i = 0; i < ops; ++i) MutateOnce(header, rng);
  } else {
    for (size_t i = 0; i < ops; ++i) MutateOnce(data, rng);
  }
  std::string out = MakeFile(header, data);
  if (rng.Below(8) == 0) {
    // An inconsistent length prefix, near the right one or extreme.
    const uint64_t len = rng.Below(2) ? header.size() + rng.Below(33) - 16 : rng.Next();
    std::memcpy(out.data(), Le64(len).data(), 8);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  size_t mutations = 64;
  std::vector<std::pair<std::string, std::string>> inputs = BuiltinSeeds();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--mutations=", 0) == 0) {
      mutations = std::strtoul(arg.c_str() + 12, nullptr, 10);
      continue;
    }
    if (arg.rfind("--write-seeds=", 0) == 0) {
      const fs::path dir = arg.substr(14);
      fs::create_directories(dir);
      for (const auto& [name, bytes] : BuiltinSeeds()) {
        std::ofstream(dir / (name + ".safetensors"), std::ios::binary) << bytes;
      }
      continue;
    }
    const bool optional = arg.rfind("--regressions=", 0) == 0;
    if (!weightbus::fuzz::ReadInputs(optional ? arg.substr(14) : arg, optional,
                                     "safetensors_fuzz_replay", &inputs)) {
      return 2;
    }
  }

  weightbus::fuzz::InstallReplayCrashHandler("safetensors_fuzz_replay",
                                             "safetensors-fuzz-crash.bin");

  Stats stats;
  Rng rng(0x5afe7e45023);
  for (const auto& [name, bytes] : inputs) {
    Run(name, bytes, stats);
    for (size_t m = 0; m < mutations; ++m) {
      Run(name + " (mutation " + std::to_string(m) + ")", Mutate(bytes, rng), stats);
    }
  }
  std::printf("safetensors_fuzz_replay: %zu inputs (%zu seeds, %zu mutations each), no failure\n",
              stats.runs, inputs.size(), mutations);
  return 0;
}

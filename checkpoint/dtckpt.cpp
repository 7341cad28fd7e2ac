// dtckpt: checkpoints of checkpoint/checkpoint_dir.h from the shell.
//
//   dtckpt list DIR                              the checkpoints in DIR, oldest first
//   dtckpt info DIR [--step N]                   one checkpoint: step, world size, metadata,
//                                                files, every tensor with its pieces
//   dtckpt verify DIR [--step N]                 every file against the manifest's size and CRC-32
//   dtckpt consolidate DIR --out FILE [--step N] [--prefix model]
//                                                the tensors under the prefix, whole, in one
//                                                ordinary safetensors file (for inference)
//
// Without --step: the newest checkpoint. Exit status 0 on success, 1 with a one-line error
// on stderr otherwise (a corrupt file, a missing checkpoint), 2 for bad usage.
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_dir.h"
#include "common/errors.h"
#include "common/strings.h"
#include "tensor/nn/safetensors.h"

namespace {

using dt::str;

constexpr const char* kUsage = R"(usage: dtckpt list DIR
       dtckpt info DIR [--step N]
       dtckpt verify DIR [--step N]
       dtckpt consolidate DIR --out FILE [--step N] [--prefix model]
)";

struct Args {
  std::string command, dir, out, prefix = "model";
  std::optional<int64_t> step;
};

bool parse(int argc, char** argv, Args& a) {
  if (argc < 3) return false;
  a.command = argv[1];
  a.dir = argv[2];
  for (int i = 3; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return false;
    const std::string value = argv[++i];
    if (flag == "--step") a.step = std::stoll(value);
    else if (flag == "--out") a.out = value;
    else if (flag == "--prefix") a.prefix = value;
    else return false;
  }
  return a.command == "list" || a.command == "info" || a.command == "verify" ||
         (a.command == "consolidate" && !a.out.empty());
}

dt::CheckpointRef chosen(const dt::CheckpointDir& dir, const Args& a) {
  if (a.step) return dir.refFor(*a.step);
  auto latest = dir.latest();
  if (!latest) throw dt::InvalidArgument(str("dtckpt: no checkpoint in ", dir.path().string()));
  return *latest;
}

int run(const Args& a) {
  const dt::CheckpointDir dir(a.dir);
  if (a.command == "list") {
    for (const auto& ref : dir.list()) std::printf("%lld  %s\n", static_cast<long long>(ref.step), ref.manifest.string().c_str());
    return 0;
  }
  const dt::CheckpointRef ref = chosen(dir, a);
  if (a.command == "info") {
    const dt::CheckpointManifest m = dir.readManifest(ref);
    std::printf("checkpoint %s: step %lld, written by %d rank(s)\n", ref.manifest.string().c_str(),
                static_cast<long long>(m.step), m.worldSize);
    for (const auto& [k, v] : m.metadata) std::printf("  metadata %s = %s\n", k.c_str(), v.c_str());
    for (const auto& f : m.files) {
      std::printf("  file %s (rank %d, %llu bytes, CRC-32 %08x)\n", f.name.c_str(), f.rank,
                  static_cast<unsigned long long>(f.bytes), f.crc32);
    }
    for (const auto& t : m.tensors) {
      std::printf("  %s %s %s%s: %zu piece(s)\n", t.info.name.c_str(), dt::placementName(t.info.placement),
                  std::string(dt::toString(t.info.dtype)).c_str(), dt::describeShape(t.info.shape).c_str(), t.pieces.size());
    }
    return 0;
  }
  if (a.command == "verify") {
    const dt::CheckpointManifest m = dir.verify(ref);
    std::printf("checkpoint %s: %zu file(s) and %zu tensor(s) are intact\n", ref.manifest.string().c_str(), m.files.size(),
                m.tensors.size());
    return 0;
  }
  const size_t n = dt::consolidateCheckpoint(dir, ref, a.out, a.prefix);
  std::printf("wrote %zu tensor(s) under \"%s\" of step %lld to %s\n", n, a.prefix.c_str(), static_cast<long long>(ref.step),
              a.out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  bool ok = false;
  try {
    ok = parse(argc, argv, args);
  } catch (const std::exception&) {
    ok = false;
  }
  if (!ok) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtckpt: %s\n", dt::describe(e).c_str());
    return 1;
  }
}

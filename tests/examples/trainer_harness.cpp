#include "tests/examples/trainer_harness.h"

#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "common/strings.h"
#include "data/idx.h"
#include "tensor/nn/safetensors.h"

namespace dt::testing {

const std::string kDtrunPath = DTRUN_PATH;
const std::string kTrainerPath = TRAINER_PATH;
const std::string kFashionMnist = "/usr/share/datasets/fashion-mnist";

namespace {

void writeSlice(const std::filesystem::path& from, const std::filesystem::path& to, int64_t count) {
  const data::IdxArray a = data::readIdx(from);
  ASSERT_LE(count, a.count()) << from;
  std::vector<int64_t> dims = a.dims;
  dims[0] = count;
  const size_t bytes = static_cast<size_t>(count * a.itemBytes());
  data::writeIdx(to, dims, std::span<const uint8_t>(a.data.data(), bytes), true);
}

std::string readAll(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

void writeFashionSlice(const std::filesystem::path& dir, int64_t train, int64_t test) {
  ASSERT_TRUE(std::filesystem::exists(std::filesystem::path(kFashionMnist) / "train-images-idx3-ubyte.gz"))
      << "Fashion-MNIST is not installed in " << kFashionMnist << ": run scripts/setup.sh (package dataset-fashion-mnist)";
  std::filesystem::create_directories(dir);
  const std::filesystem::path src(kFashionMnist);
  for (const char* kind : {"images-idx3", "labels-idx1"}) {
    writeSlice(src / str("train-", kind, "-ubyte.gz"), dir / str("train-", kind, "-ubyte.gz"), train);
    writeSlice(src / str("t10k-", kind, "-ubyte.gz"), dir / str("t10k-", kind, "-ubyte.gz"), test);
  }
}

std::vector<std::string> dtrunProgram(int nproc, const std::vector<std::string>& dtrunArgs, const std::string& program,
                                      const std::vector<std::string>& args) {
  std::vector<std::string> argv{kDtrunPath, "--standalone", "--nproc", std::to_string(nproc)};
  argv.insert(argv.end(), dtrunArgs.begin(), dtrunArgs.end());
  argv.push_back(program);
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

std::vector<std::string> dtrunTrainer(int nproc, const std::vector<std::string>& trainerArgs,
                                      const std::vector<std::string>& dtrunArgs) {
  return dtrunProgram(nproc, dtrunArgs, kTrainerPath, trainerArgs);
}

std::map<int, std::string> fingerprints(const std::string& output) {
  std::map<int, std::string> out;
  static const std::regex line(R"(trainer: rank (\d+)/\d+ final parameters fingerprint ([0-9a-f]{16}))");
  for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it) {
    out[std::stoi((*it)[1])] = (*it)[2];
  }
  return out;
}

std::string commonFingerprint(const std::string& output, int world) {
  const auto all = fingerprints(output);
  EXPECT_EQ(all.size(), static_cast<size_t>(world)) << "every rank prints its fingerprint\n" << output;
  std::set<std::string> distinct;
  for (const auto& [rank, f] : all) distinct.insert(f);
  EXPECT_EQ(distinct.size(), 1u) << "all ranks end with identical parameters\n" << output;
  return distinct.size() == 1 && all.size() == static_cast<size_t>(world) ? *distinct.begin() : "";
}

std::optional<double> finalValue(const std::string& output, const std::string& name) {
  const std::regex pattern("trainer: done: .*" + name + " ([0-9.]+)");
  std::smatch m;
  if (!std::regex_search(output, m, pattern)) return std::nullopt;
  return std::stod(m[1]);
}

std::optional<int> workerPid(const std::string& output, int rank, int attempt) {
  const std::regex pattern(str("trainer: rank ", rank, "/\\d+ pid (\\d+) attempt ", attempt));
  std::smatch m;
  if (!std::regex_search(output, m, pattern)) return std::nullopt;
  return std::stoi(m[1]);
}

std::map<std::string, std::string> tensorBytes(const std::filesystem::path& file) {
  std::map<std::string, std::string> out;
  for (const auto& [name, t] : loadSafetensors(file).tensors) {
    out[name] = std::string(static_cast<const char*>(t.dataPtr()), t.nbytes());
  }
  return out;
}

std::map<std::string, std::string> folderSnapshot(const std::filesystem::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    out[entry.path().filename().string()] = readAll(entry.path());
  }
  return out;
}

std::string checkpointName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::map<int64_t, std::vector<int64_t>> examplesByEpoch(const std::filesystem::path& prefix, int members) {
  struct Attempt {
    uint64_t membership = 0;
    int64_t dataEpoch = 0;
    std::vector<int64_t> ids;
  };
  std::map<int64_t, std::vector<Attempt>> byStep;
  for (int m = 0; m < members; ++m) {
    std::ifstream in(str(prefix.string(), ".", m));
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      Attempt a;
      int64_t step = 0, id = 0;
      fields >> a.membership >> step >> a.dataEpoch;
      while (fields >> id) a.ids.push_back(id);
      byStep[step].push_back(std::move(a));
    }
  }
  std::map<int64_t, std::vector<int64_t>> out;
  for (const auto& [step, attempts] : byStep) {
    uint64_t last = 0;
    for (const auto& a : attempts) last = std::max(last, a.membership);
    for (const auto& a : attempts) {
      if (a.membership == last) out[a.dataEpoch].insert(out[a.dataEpoch].end(), a.ids.begin(), a.ids.end());
    }
  }
  return out;
}

}  // namespace dt::testing

// Helpers for the trainer's end-to-end tests: run it under dtrun, make small Fashion-MNIST
// slices, read what it printed (fingerprints, loss, accuracy) and the checkpoints it wrote.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tests/launcher/dtrun_process.h"

namespace dt::testing {

extern const std::string kDtrunPath;
extern const std::string kTrainerPath;
// Where Debian's dataset-fashion-mnist installs the files.
extern const std::string kFashionMnist;

// Writes the first `train` training and `test` test examples of the real Fashion-MNIST into
// dir as gzip'd IDX files under the usual names, so `--data dir` reads them.
void writeFashionSlice(const std::filesystem::path& dir, int64_t train, int64_t test);

// dtrun --standalone --nproc N [dtrunArgs] program [args]
std::vector<std::string> dtrunProgram(int nproc, const std::vector<std::string>& dtrunArgs, const std::string& program,
                                      const std::vector<std::string>& args);
// dtrun --standalone --nproc N [dtrunArgs] trainer [trainerArgs]
std::vector<std::string> dtrunTrainer(int nproc, const std::vector<std::string>& trainerArgs,
                                      const std::vector<std::string>& dtrunArgs = {});

// "trainer: rank R/W final parameters fingerprint F" lines: rank -> F.
std::map<int, std::string> fingerprints(const std::string& output);
// The one fingerprint every rank printed; a test failure (and "") when ranks differ or are missing.
std::string commonFingerprint(const std::string& output, int world);
// From the final line: "train loss X" and "test accuracy Y".
std::optional<double> finalValue(const std::string& output, const std::string& name);
// pid printed by "trainer: rank R/W pid P attempt A".
std::optional<int> workerPid(const std::string& output, int rank, int attempt = 1);

// The raw bytes of every tensor of a safetensors file, by name.
std::map<std::string, std::string> tensorBytes(const std::filesystem::path& file);
// Every file in a folder with its bytes (for "nothing was overwritten").
std::map<std::string, std::string> folderSnapshot(const std::filesystem::path& dir);
std::string checkpointName(int64_t step);

// Every (data epoch, example) of the committed steps, from the records of members [0, members)
// (--record-samples / DT_TEST_RECORD_SAMPLES PREFIX: PREFIX.<member>): a step appears once per
// attempt (membership epoch); the last attempt is the committed one.
std::map<int64_t, std::vector<int64_t>> examplesByEpoch(const std::filesystem::path& prefix, int members);  // "step-00000100"

}  // namespace dt::testing

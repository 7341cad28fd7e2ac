// Text for language models: a corpus split into train and validation text, byte-level tokens,
// random context windows, and which windows each rank trains on at each step.
//
//   auto corpus = dt::data::loadFortunes(dt::data::kFortunesDir);      // Debian's `fortunes`
//   auto train = std::make_shared<dt::data::TextWindows>(corpus.train, 128, "fortunes train");
//   dt::data::RandomWindowSampler sampler(train->size(), world, rank, {.batchSize = 8, .seed = 0});
//   dt::data::Batch b = train->get(sampler.batchIndices(step));        // int64 [8, 128] twice
//
// Contract:
//  * Tokens are bytes (vocabulary 256): nothing to download or train, any text works, and a
//    model's output is text again byte by byte.
//  * splitDocuments assigns each document to validation when the FNV-1a hash of its bytes
//    falls in the validation share, else to training; the split depends only on the
//    documents' text (not on their order or on which files hold them), and the same document
//    appearing twice lands on the same side, so no validation text is seen in training. Each
//    side is its documents joined in input order.
//  * loadFortunes reads every fortune file of a folder (the "%"-separated files of Debian's
//    fortunes packages; .dat indexes and symlinks are skipped) in file-name order; a fortune
//    is one document, kept with its closing "%" line. Errors name the folder or file.
//  * TextWindows is a Dataset whose example i is the window starting at byte i: inputs are
//    tokens [i, i + T) and targets [i + 1, i + T + 1) (the next byte of each), as int64 [B, T].
//    size() = bytes - T windows.
//  * RandomWindowSampler: at step s, global batch slot j (0 <= j < world x batch) is the window
//    starting at draw number s x G + j of a counter-based random stream seeded by `seed`, modulo
//    the window count. Rank r takes slots r, r + W, r + 2W, ... (DistributedSampler's
//    interleaving). So a step's windows depend only on (seed, step, global batch): 1, 2 or 4
//    ranks with the same global batch train on the same windows, and a job resumed at step s
//    continues exactly, with nothing to save but s.
//  * Everything is immutable after construction; get() and batchIndices() are const and
//    thread-safe. Bad arguments throw InvalidArgument naming the value.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace dt::data {

// Where Debian's `fortunes` (and fortunes-min) package installs its files.
inline constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

struct TextSplit {
  std::string train;
  std::string validation;
  int64_t trainDocuments = 0;
  int64_t validationDocuments = 0;
  std::string source;  // for logs: where the text came from
};

// validationShare in (0, 1): the expected fraction of documents held out.
TextSplit splitDocuments(const std::vector<std::string>& documents, double validationShare, std::string source);

// The fortunes of every file in dir, split with splitDocuments.
TextSplit loadFortunes(const std::filesystem::path& dir, double validationShare = 0.05);

class TextWindows : public Dataset {
 public:
  TextWindows(std::string text, int64_t contextLength, std::string name);
  int64_t size() const override { return static_cast<int64_t>(text_.size()) - contextLength_; }
  // inputs and targets int64 [indices.size(), contextLength].
  Batch get(std::span<const int64_t> indices) const override;
  std::string describe() const override;
  int64_t contextLength() const { return contextLength_; }
  const std::string& text() const { return text_; }

 private:
  std::string text_;
  int64_t contextLength_;
  std::string name_;
};

struct RandomWindowSamplerOptions {
  int64_t batchSize = 1;  // windows per rank per step
  uint64_t seed = 0;      // the same on every rank
};

class RandomWindowSampler {
 public:
  RandomWindowSampler(int64_t windowCount, int worldSize, int rank, RandomWindowSamplerOptions options = {});
  int64_t globalBatch() const { return options_.batchSize * worldSize_; }
  int worldSize() const { return worldSize_; }
  int rank() const { return rank_; }
  const RandomWindowSamplerOptions& options() const { return options_; }
  // This rank's window starts for step `step` (batchSize of them).
  std::vector<int64_t> batchIndices(int64_t step) const;

 private:
  int64_t windowCount_;
  int worldSize_;
  int rank_;
  RandomWindowSamplerOptions options_;
};

}  // namespace dt::data

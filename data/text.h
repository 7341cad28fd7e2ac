// Text for language models: a corpus split into train and validation text, byte-level tokens,
// and context windows as a dataset (drawn at random by DistributedSampler's replacement mode:
// data/sampler.h).
//
//   auto corpus = dt::data::loadFortunes(dt::data::kFortunesDir);      // Debian's `fortunes`
//   auto train = std::make_shared<dt::data::TextWindows>(corpus.train, 128, "fortunes train");
//   dt::data::DistributedSampler sampler(train->size(), world, rank, {.batchSize = 8, .replacement = true});
//   dt::data::Batch b = train->get(sampler.batchIndices(0, step));     // int64 [8, 128] twice
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
//  * Everything is immutable after construction; get() is const and
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

}  // namespace dt::data

// Datasets: numbered examples a loader gathers into batches.
//
// Contract:
//  * A Dataset is immutable after construction; get() is const and may be called from any
//    thread concurrently (the prefetching loader calls it from its own thread).
//  * get(indices) returns one Batch: inputs [B, F] and targets [B] (for text windows,
//    data/text.h: int64 tokens [B, T] and their next tokens [B, T]), fresh CPU tensors the
//    caller owns. An index outside [0, size()) throws InvalidArgument naming it.
//  * ImageClassificationDataset keeps the images as bytes (a quarter of float32's memory) and
//    converts each batch to float32: (pixel / 255 - mean) / std. Targets are int64 class ids.
//  * loadFashionMnist reads the four gzip'd IDX files of Fashion-MNIST (Debian's
//    dataset-fashion-mnist puts them in kFashionMnistDir) and checks them against each other:
//    images [N, H, W], labels [N], every label below 10. Errors name the file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>

#include "data/idx.h"
#include "tensor/tensor.h"

namespace dt::data {

struct Batch {
  Tensor inputs;   // float32 [B, F] (images flattened); int64 tokens [B, T] for text
  Tensor targets;  // int64 [B]; int64 next tokens [B, T] for text
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual Batch get(std::span<const int64_t> indices) const = 0;
  // One line for logs: what it is and where it came from.
  virtual std::string describe() const = 0;
};

struct Normalization {
  double mean = 0.0;
  double std = 1.0;
};

class ImageClassificationDataset : public Dataset {
 public:
  // images: [N, H, W] (or [N, F]) bytes; labels: [N] bytes below numClasses.
  ImageClassificationDataset(IdxArray images, IdxArray labels, int64_t numClasses, Normalization normalization,
                             std::string name);
  int64_t size() const override { return images_.count(); }
  Batch get(std::span<const int64_t> indices) const override;
  std::string describe() const override;
  // Features per example (H * W).
  int64_t features() const { return images_.itemBytes(); }
  int64_t numClasses() const { return numClasses_; }
  uint8_t label(int64_t index) const;

 private:
  IdxArray images_;
  IdxArray labels_;
  int64_t numClasses_;
  Normalization normalization_;
  std::string name_;
};

enum class Split { Train, Test };

// Where Debian's dataset-fashion-mnist package installs the files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
// Pixel mean and standard deviation of Fashion-MNIST's training images (scaled to [0, 1]).
inline constexpr Normalization kFashionMnistNormalization{0.2860, 0.3530};

// dir/train-images-idx3-ubyte.gz + dir/train-labels-idx1-ubyte.gz (Train), t10k-* (Test).
std::shared_ptr<ImageClassificationDataset> loadFashionMnist(const std::filesystem::path& dir, Split split);

}  // namespace dt::data

#include "data/dataset.h"

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/ops.h"

namespace dt::data {

ImageClassificationDataset::ImageClassificationDataset(IdxArray images, IdxArray labels, int64_t numClasses,
                                                       Normalization normalization, std::string name)
    : images_(std::move(images)),
      labels_(std::move(labels)),
      numClasses_(numClasses),
      normalization_(normalization),
      name_(std::move(name)) {
  if (images_.dims.size() < 2) {
    throw InvalidArgument(str("dataset ", name_, ": images in ", images_.path, " have dimensions [",
                              join(images_.dims, ", "), "]; expected [count, height, width] or [count, features]"));
  }
  if (labels_.dims.size() != 1) {
    throw InvalidArgument(str("dataset ", name_, ": labels in ", labels_.path, " have dimensions [",
                              join(labels_.dims, ", "), "]; expected [count]"));
  }
  if (images_.count() != labels_.count()) {
    throw InvalidArgument(str("dataset ", name_, ": ", images_.path, " holds ", images_.count(), " images but ",
                              labels_.path, " holds ", labels_.count(), " labels"));
  }
  if (numClasses_ < 1 || numClasses_ > 256) {
    throw InvalidArgument(str("dataset ", name_, ": numClasses ", numClasses_, " must be within 1..256"));
  }
  if (!(normalization_.std > 0)) {
    throw InvalidArgument(str("dataset ", name_, ": normalization std ", normalization_.std, " must be positive"));
  }
  for (size_t i = 0; i < labels_.data.size(); ++i) {
    if (labels_.data[i] >= numClasses_) {
      throw InvalidArgument(str("dataset ", name_, ": label #", i, " in ", labels_.path, " is ",
                                static_cast<int>(labels_.data[i]), "; expected below ", numClasses_));
    }
  }
}

uint8_t ImageClassificationDataset::label(int64_t index) const {
  if (index < 0 || index >= size()) {
    throw InvalidArgument(str("dataset ", name_, ": index ", index, " outside [0, ", size(), ")"));
  }
  return labels_.data[static_cast<size_t>(index)];
}

Batch ImageClassificationDataset::get(std::span<const int64_t> indices) const {
  const int64_t n = static_cast<int64_t>(indices.size());
  const int64_t f = features();
  Batch batch;
  batch.inputs = empty({n, f}, DType::Float32);  // images are fed flattened
  batch.targets = empty({n}, DType::Int64);
  float* x = batch.inputs.data<float>();
  int64_t* y = batch.targets.data<int64_t>();
  // (p / 255 - mean) / std as one multiply-add per pixel, through a 256-entry table.
  float table[256];
  for (int p = 0; p < 256; ++p) {
    table[p] = static_cast<float>((p / 255.0 - normalization_.mean) / normalization_.std);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t index = indices[static_cast<size_t>(i)];
    if (index < 0 || index >= size()) {
      throw InvalidArgument(str("dataset ", name_, ": index ", index, " outside [0, ", size(), ")"));
    }
    const uint8_t* src = images_.data.data() + index * f;
    float* dst = x + i * f;
    for (int64_t j = 0; j < f; ++j) dst[j] = table[src[j]];
    y[i] = labels_.data[static_cast<size_t>(index)];
  }
  return batch;
}

std::string ImageClassificationDataset::describe() const {
  return str(name_, ": ", size(), " examples of [", join(std::vector<int64_t>(images_.dims.begin() + 1, images_.dims.end()), "x"),
             "] bytes, ", numClasses_, " classes (", images_.path, ")");
}

std::shared_ptr<ImageClassificationDataset> loadFashionMnist(const std::filesystem::path& dir, Split split) {
  const std::string prefix = split == Split::Train ? "train" : "t10k";
  const std::string name = split == Split::Train ? "Fashion-MNIST train" : "Fashion-MNIST test";
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    throw InvalidArgument(str(name, ": data folder ", dir.string(),
                              " does not exist (install Debian's dataset-fashion-mnist package, which puts the files in ",
                              kFashionMnistDir, ", or pass the folder that holds ", prefix, "-images-idx3-ubyte.gz)"));
  }
  IdxArray images = readIdx(dir / (prefix + "-images-idx3-ubyte.gz"));
  IdxArray labels = readIdx(dir / (prefix + "-labels-idx1-ubyte.gz"));
  if (images.dims.size() != 3) {
    throw InvalidArgument(str(name, ": ", images.path, " has dimensions [", join(images.dims, ", "),
                              "]; expected [count, 28, 28]"));
  }
  return std::make_shared<ImageClassificationDataset>(std::move(images), std::move(labels), 10,
                                                      kFashionMnistNormalization, name);
}

}  // namespace dt::data

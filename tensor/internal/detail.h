// Internal helpers shared by tensor/*.cpp (not part of the public API).
#pragma once

#include <optional>

#include "tensor/tensor.h"

namespace dt::detail {

Tensor viewNoGrad(const Tensor& t, Shape sizes);
bool canView(const Tensor& t, const Shape& sizes);
Tensor asStridedNoGrad(const Tensor& t, Shape sizes, Shape strides, int64_t offset);
Tensor sliceNoGrad(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step);
Tensor narrowNoGrad(const Tensor& t, int64_t dim, int64_t start, int64_t length);
Tensor selectNoGrad(const Tensor& t, int64_t dim, int64_t index);
Tensor permuteNoGrad(const Tensor& t, const Shape& dims);
Tensor expandNoGrad(const Tensor& t, const Shape& target);
Tensor squeezeNoGrad(const Tensor& t, std::optional<int64_t> dim);
Tensor unsqueezeNoGrad(const Tensor& t, int64_t dim);
// Same data and geometry, new TensorImpl without autograd metadata.
Tensor shallowCopy(const Tensor& t);

}  // namespace dt::detail

#include "tensor/autograd/autograd.h"

namespace dt {

void AutogradMetaDeleter::operator()(AutogradMeta* meta) const { delete meta; }

}  // namespace dt

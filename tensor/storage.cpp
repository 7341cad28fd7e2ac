#include "tensor/storage.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <new>

#include "common/errors.h"
#include "common/strings.h"

namespace dt {

DataPtr& DataPtr::operator=(DataPtr&& other) noexcept {
  if (this != &other) {
    reset();
    ptr_ = other.ptr_;
    context_ = other.context_;
    deleter_ = other.deleter_;
    device_ = other.device_;
    other.ptr_ = nullptr;
    other.context_ = nullptr;
    other.deleter_ = nullptr;
  }
  return *this;
}

void DataPtr::reset() {
  if (deleter_ != nullptr) deleter_(context_, ptr_);
  ptr_ = nullptr;
  context_ = nullptr;
  deleter_ = nullptr;
}

namespace {

constexpr size_t kCpuAlignment = 64;

class CpuAllocator final : public Allocator {
 public:
  DataPtr allocate(size_t bytes) override {
    // Round up so aligned_alloc's size rule holds; never hand out null, even for 0 bytes.
    const size_t rounded = (bytes + kCpuAlignment - 1) / kCpuAlignment * kCpuAlignment;
    void* p = std::aligned_alloc(kCpuAlignment, rounded == 0 ? kCpuAlignment : rounded);
    if (p == nullptr) {
      throw Error(str("cpu allocator: out of memory allocating ", bytes, " bytes"));
    }
    return DataPtr(p, nullptr, [](void*, void* ptr) { std::free(ptr); }, Device::cpu());
  }
  DeviceType deviceType() const override { return DeviceType::CPU; }
};

CpuAllocator& cpuAllocator() {
  static CpuAllocator instance;
  return instance;
}

std::array<std::atomic<Allocator*>, 2>& registry() {
  static std::array<std::atomic<Allocator*>, 2> table{&cpuAllocator(), nullptr};
  return table;
}

}  // namespace

Allocator& allocatorFor(Device device) {
  Allocator* a = registry()[static_cast<size_t>(device.type)].load(std::memory_order_acquire);
  if (a == nullptr) {
    throw NotSupportedError(str("no allocator for device ", device.str(),
                                ": this build of dtrain has no GPU support (tensor/cuda); use Device::cpu()"));
  }
  return *a;
}

void registerAllocator(DeviceType type, Allocator* allocator) {
  registry()[static_cast<size_t>(type)].store(allocator, std::memory_order_release);
}

Storage::Storage(size_t nbytes, Device device) : impl_(std::make_shared<Impl>()) {
  impl_->data = allocatorFor(device).allocate(nbytes);
  impl_->nbytes = nbytes;
}

Storage::Storage(DataPtr data, size_t nbytes) : impl_(std::make_shared<Impl>()) {
  impl_->data = std::move(data);
  impl_->nbytes = nbytes;
}

}  // namespace dt

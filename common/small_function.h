// SmallFunction<R(Args...)>: a move-only callable wrapper that keeps callables of up to
// kInlineBytes in place, without the heap allocation std::function makes for anything
// larger than two pointers. For closures made once per operation on hot paths (a queued
// collective's body); a larger callable still works, from the heap.
//
// Contract: like a move-only std::function. Calling an empty one is a programming error
// (checked: std::bad_function_call). A moved-from SmallFunction is empty. Not thread-safe.
#pragma once

#include <cstddef>
#include <functional>
#include <new>
#include <type_traits>
#include <utility>

namespace dt {

template <typename Signature>
class SmallFunction;

template <typename R, typename... Args>
class SmallFunction<R(Args...)> {
 public:
  static constexpr size_t kInlineBytes = 64;

  SmallFunction() = default;
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, SmallFunction>>>
  SmallFunction(F&& f) {  // NOLINT: implicit, as std::function's
    using Fn = std::decay_t<F>;
    if constexpr (sizeof(Fn) <= kInlineBytes && alignof(Fn) <= alignof(std::max_align_t) &&
                  std::is_nothrow_move_constructible_v<Fn>) {
      ::new (static_cast<void*>(storage_)) Fn(std::forward<F>(f));
      ops_ = &inlineOps<Fn>;
    } else {
      *reinterpret_cast<Fn**>(storage_) = new Fn(std::forward<F>(f));
      ops_ = &heapOps<Fn>;
    }
  }
  SmallFunction(SmallFunction&& other) noexcept { take(other); }
  SmallFunction& operator=(SmallFunction&& other) noexcept {
    if (this != &other) {
      reset();
      take(other);
    }
    return *this;
  }
  SmallFunction(const SmallFunction&) = delete;
  SmallFunction& operator=(const SmallFunction&) = delete;
  ~SmallFunction() { reset(); }

  explicit operator bool() const { return ops_ != nullptr; }
  R operator()(Args... args) {
    if (ops_ == nullptr) throw std::bad_function_call();
    return ops_->call(storage_, std::forward<Args>(args)...);
  }

 private:
  struct Ops {
    R (*call)(void* self, Args&&... args);
    void (*move)(void* to, void* from);  // leaves `from` destroyed
    void (*destroy)(void* self);
  };
  template <typename Fn>
  static constexpr Ops inlineOps = {
      [](void* self, Args&&... args) -> R { return (*static_cast<Fn*>(self))(std::forward<Args>(args)...); },
      [](void* to, void* from) {
        ::new (to) Fn(std::move(*static_cast<Fn*>(from)));
        static_cast<Fn*>(from)->~Fn();
      },
      [](void* self) { static_cast<Fn*>(self)->~Fn(); }};
  template <typename Fn>
  static constexpr Ops heapOps = {
      [](void* self, Args&&... args) -> R { return (**static_cast<Fn**>(self))(std::forward<Args>(args)...); },
      [](void* to, void* from) { *static_cast<Fn**>(to) = *static_cast<Fn**>(from); },
      [](void* self) { delete *static_cast<Fn**>(self); }};

  void take(SmallFunction& other) noexcept {
    if (other.ops_ == nullptr) return;
    other.ops_->move(storage_, other.storage_);
    ops_ = other.ops_;
    other.ops_ = nullptr;
  }
  void reset() noexcept {
    if (ops_ == nullptr) return;
    ops_->destroy(storage_);
    ops_ = nullptr;
  }

  alignas(std::max_align_t) unsigned char storage_[kInlineBytes];
  const Ops* ops_ = nullptr;
};

}  // namespace dt

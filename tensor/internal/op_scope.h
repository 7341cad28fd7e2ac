// Internal: the profiler's scope at the top of every public tensor op and
// around every autograd node's apply() (tensor/profiler.h has the contract).
//
// While no profiler records, a scope costs a relaxed load and a predictable
// branch on entry and a branch on a local flag on exit: nothing is formatted,
// allocated or timed. Scopes live on the stack of one thread; not copyable.
#pragma once

#include <vector>

#include "tensor/profiler.h"
#include "tensor/tensor.h"

namespace dt::detail {

class OpScope {
 public:
  explicit OpScope(const char* name) {
    if (profiler::recording()) [[unlikely]] begin(name, nullptr, 0);
  }
  template <class... Inputs>
  OpScope(const char* name, const Tensor& first, const Inputs&... rest) {
    if (profiler::recording()) [[unlikely]] {
      const Tensor* inputs[] = {&first, &rest...};
      begin(name, inputs, 1 + sizeof...(rest));
    }
  }
  OpScope(const char* name, const std::vector<Tensor>& inputs);
  ~OpScope() {
    if (startNs_ >= 0) [[unlikely]] end();
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  void begin(const char* name, const Tensor* const* inputs, size_t count);
  void end();

  const char* name_ = nullptr;
  const char* outerOp_ = nullptr;  // restored as the thread's current op on exit
  int64_t startNs_ = -1;
  std::string shapes_;
};

// Around Node::apply in the backward engine: a "backward" event named by the node.
class BackwardScope {
 public:
  explicit BackwardScope(const Node& node) {
    if (profiler::recording()) [[unlikely]] begin(node);
  }
  ~BackwardScope() {
    if (startNs_ >= 0) [[unlikely]] end();
  }
  BackwardScope(const BackwardScope&) = delete;
  BackwardScope& operator=(const BackwardScope&) = delete;

 private:
  void begin(const Node& node);
  void end();

  const char* name_ = nullptr;  // interned: outlives the node
  const char* outerOp_ = nullptr;
  int64_t startNs_ = -1;
};

}  // namespace dt::detail

// GlooStoreAdapter: lets Gloo's rendezvous (connectFullMesh) run over a dtrain
// Store. Private to the Gloo backend (includes a Gloo header).
//
// Contract: set/get/wait forward to the wrapped store (which the backend has
// already prefixed with the group's key space). get waits like Store::get;
// wait(keys, timeout) honours Gloo's timeout; dtrain errors (TimeoutError,
// NetworkError) pass through unchanged so rendezvous failures read as ours.
// Thread safety: that of the wrapped store.
#pragma once

#include <gloo/rendezvous/store.h>

#include "store/store.h"

namespace dt {

class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(StorePtr store, std::chrono::milliseconds timeout)
      : store_(std::move(store)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const auto value = store_->get(key, timeout_);
    return std::vector<char>(value.begin(), value.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  StorePtr store_;
  std::chrono::milliseconds timeout_;
};

}  // namespace dt

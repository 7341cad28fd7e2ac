#include "store/prefix_store.h"

#include "common/check.h"
#include "common/strings.h"

namespace dt {

PrefixStore::PrefixStore(std::string prefix, StorePtr store) : prefix_(std::move(prefix)), store_(std::move(store)) {
  DT_CHECK(store_ != nullptr, "PrefixStore(\"", prefix_, "\"): the wrapped store is null");
  setTimeout(store_->timeout());
}

std::vector<std::string> PrefixStore::prefixed(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& key : keys) out.push_back(prefixed(key));
  return out;
}

void PrefixStore::set(const std::string& key, const Bytes& value) { store_->set(prefixed(key), value); }
Bytes PrefixStore::get(const std::string& key, Duration timeout) { return store_->get(prefixed(key), timeout); }
int64_t PrefixStore::add(const std::string& key, int64_t delta) { return store_->add(prefixed(key), delta); }
Bytes PrefixStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  return store_->compareSet(prefixed(key), expected, desired);
}
void PrefixStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  store_->wait(prefixed(keys), timeout);
}
bool PrefixStore::check(const std::vector<std::string>& keys) { return store_->check(prefixed(keys)); }
bool PrefixStore::deleteKey(const std::string& key) { return store_->deleteKey(prefixed(key)); }
int64_t PrefixStore::numKeys() { return store_->numKeys(); }
void PrefixStore::append(const std::string& key, const Bytes& value) { store_->append(prefixed(key), value); }

std::vector<Bytes> PrefixStore::multiGet(const std::vector<std::string>& keys, Duration timeout) {
  return store_->multiGet(prefixed(keys), timeout);
}

void PrefixStore::multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  store_->multiSet(prefixed(keys), values);
}
void PrefixStore::queuePush(const std::string& key, const Bytes& value) { store_->queuePush(prefixed(key), value); }
std::optional<Bytes> PrefixStore::queuePop(const std::string& key, bool block, Duration timeout) {
  return store_->queuePop(prefixed(key), block, timeout);
}
int64_t PrefixStore::queueLen(const std::string& key) { return store_->queueLen(prefixed(key)); }

std::shared_ptr<Store> PrefixStore::clone() {
  auto copy = std::make_shared<PrefixStore>(prefix_, store_->clone());
  copy->setTimeout(timeout());
  return copy;
}

std::string PrefixStore::describe() const { return str(store_->describe(), " (prefix \"", prefix_, "/\")"); }

}  // namespace dt

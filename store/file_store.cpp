#include "store/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "common/check.h"
#include "common/errors.h"
#include "common/strings.h"
#include "store/internal/kv_state.h"

namespace dt {
namespace {

using Clock = std::chrono::steady_clock;
using Ms = std::chrono::milliseconds;

enum Op : uint8_t { kSet = 1, kDelete = 2, kAppend = 3, kQueuePush = 4, kQueuePop = 5 };

void putU32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }

// Holds flock() for one scope; EINTR (a signal) just retries.
class FileLock {
 public:
  FileLock(int fd, bool exclusive, const std::string& path) : fd_(fd) {
    while (::flock(fd_, exclusive ? LOCK_EX : LOCK_SH) != 0) {
      if (errno != EINTR) throw Error(str("FileStore ", path, ": flock failed: ", std::strerror(errno)));
    }
  }
  ~FileLock() { ::flock(fd_, LOCK_UN); }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_;
};

}  // namespace

FileStore::FileStore(std::string path) : path_(std::move(path)), state_(std::make_unique<detail::KvState>()) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd_ < 0) {
    throw InvalidArgument(str("FileStore cannot open ", path_, ": ", std::strerror(errno),
                              ". The folder must exist and be writable by every process of the job"));
  }
}

FileStore::~FileStore() {
  if (fd_ >= 0) ::close(fd_);
}

void FileStore::catchUp() {
  struct stat st{};
  if (::fstat(fd_, &st) != 0) throw Error(str("FileStore ", path_, ": fstat failed: ", std::strerror(errno)));
  if (st.st_size < offset_) {
    throw Error(str("FileStore ", path_, " shrank from ", offset_, " to ", st.st_size,
                    " bytes: someone truncated or replaced the store file during the job"));
  }
  if (st.st_size == offset_) return;
  std::string data(static_cast<size_t>(st.st_size - offset_), '\0');
  size_t got = 0;
  while (got < data.size()) {
    const ssize_t n = ::pread(fd_, data.data() + got, data.size() - got, offset_ + static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw Error(str("FileStore ", path_, ": read failed: ", n == 0 ? "early end" : std::strerror(errno)));
    got += static_cast<size_t>(n);
  }
  size_t pos = 0;
  auto readString = [&](std::string& out) {
    if (data.size() - pos < 4) return false;
    uint32_t length;
    std::memcpy(&length, data.data() + pos, 4);
    if (data.size() - pos - 4 < length) return false;
    out.assign(data.data() + pos + 4, length);
    pos += 4 + length;
    return true;
  };
  while (pos < data.size()) {
    const size_t start = pos;
    const uint8_t op = static_cast<uint8_t>(data[pos++]);
    std::string key, value;
    if (!readString(key) || !readString(value)) {
      // Writers append whole records under the exclusive lock, so a partial
      // one means a writer died mid-write: stop here, it never completed.
      pos = start;
      break;
    }
    switch (op) {
      case kSet: state_->set(key, std::move(value)); break;
      case kDelete: state_->erase(key); break;
      case kAppend: state_->append(key, value); break;
      case kQueuePush: state_->queuePush(key, std::move(value)); break;
      case kQueuePop: state_->queuePop(key); break;
      default:
        throw Error(str("FileStore ", path_, ": unknown record type ", int(op), " at offset ", offset_ + start,
                        "; is this file a dtrain FileStore?"));
    }
  }
  offset_ += static_cast<int64_t>(pos);
}

void FileStore::logRecord(uint8_t op, const std::string& key, const Bytes& value) {
  pending_.push_back(static_cast<char>(op));
  putU32(pending_, static_cast<uint32_t>(key.size()));
  pending_ += key;
  putU32(pending_, static_cast<uint32_t>(value.size()));
  pending_ += value;
}

// Appends the records of one operation in one write (O_APPEND), so that a
// reader under the shared lock never sees half of them.
void FileStore::flushPending() {
  size_t written = 0;
  while (written < pending_.size()) {
    const ssize_t n = ::write(fd_, pending_.data() + written, pending_.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      pending_.clear();
      throw Error(str("FileStore ", path_, ": write failed: ", std::strerror(errno)));
    }
    written += static_cast<size_t>(n);
  }
  offset_ += static_cast<int64_t>(pending_.size());
  pending_.clear();
}

template <typename Fn>
auto FileStore::locked(bool write, Fn&& fn) {
  std::lock_guard guard(mutex_);
  FileLock lock(fd_, write, path_);
  catchUp();
  if constexpr (std::is_void_v<decltype(fn(*state_))>) {
    fn(*state_);
    if (write) flushPending();
  } else {
    auto result = fn(*state_);
    if (write) flushPending();
    return result;
  }
}

namespace {

// Polls `probe` (true when done) with backoff until the deadline.
template <typename Probe>
bool pollUntil(Clock::time_point deadline, Probe&& probe) {
  Ms backoff{1};
  while (true) {
    if (probe()) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, Ms(50));
  }
}

}  // namespace

void FileStore::set(const std::string& key, const Bytes& value) {
  locked(true, [&](detail::KvState& s) {
    s.set(key, value);
    logRecord(kSet, key, value);
  });
}

Bytes FileStore::get(const std::string& key, Duration timeout) {
  Bytes value;
  const bool found = pollUntil(detail::deadlineAfter(timeout), [&] {
    return locked(false, [&](detail::KvState& s) {
      const Bytes* v = s.find(key);
      if (v) value = *v;
      return v != nullptr;
    });
  });
  if (!found) detail::throwWaitTimeout("get", {key}, {key}, timeout, describe());
  return value;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  return locked(true, [&](detail::KvState& s) {
    const int64_t value = s.add(key, delta);
    logRecord(kSet, key, *s.find(key));
    return value;
  });
}

Bytes FileStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  return locked(true, [&](detail::KvState& s) {
    bool wrote = false;
    Bytes result = s.compareSet(key, expected, desired, wrote);
    if (wrote) logRecord(kSet, key, desired);
    return result;
  });
}

void FileStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  std::vector<std::string> missing;
  const bool ok = pollUntil(detail::deadlineAfter(timeout), [&] {
    return locked(false, [&](detail::KvState& s) {
      missing = s.missing(keys);
      return missing.empty();
    });
  });
  if (!ok) detail::throwWaitTimeout("wait", keys, missing, timeout, describe());
}

bool FileStore::check(const std::vector<std::string>& keys) {
  return locked(false, [&](detail::KvState& s) { return s.hasAll(keys); });
}

bool FileStore::deleteKey(const std::string& key) {
  return locked(true, [&](detail::KvState& s) {
    const bool removed = s.erase(key);
    if (removed) logRecord(kDelete, key, "");
    return removed;
  });
}

int64_t FileStore::numKeys() {
  return locked(false, [&](detail::KvState& s) { return s.size(); });
}

void FileStore::append(const std::string& key, const Bytes& value) {
  locked(true, [&](detail::KvState& s) {
    s.append(key, value);
    logRecord(kAppend, key, value);
  });
}

std::vector<Bytes> FileStore::multiGet(const std::vector<std::string>& keys, Duration limit) {
  std::vector<Bytes> values;
  std::vector<std::string> missing;
  const bool ok = pollUntil(detail::deadlineAfter(limit), [&] {
    return locked(false, [&](detail::KvState& s) {
      missing = s.missing(keys);
      if (!missing.empty()) return false;
      values.clear();
      for (const auto& key : keys) values.push_back(*s.find(key));
      return true;
    });
  });
  if (!ok) detail::throwWaitTimeout("multiGet", keys, missing, limit, describe());
  return values;
}

void FileStore::multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  DT_CHECK_EQ(keys.size(), values.size(), "store multiSet: one value per key");
  locked(true, [&](detail::KvState& s) {
    for (size_t i = 0; i < keys.size(); ++i) {
      s.set(keys[i], values[i]);
      logRecord(kSet, keys[i], values[i]);
    }
  });
}

void FileStore::queuePush(const std::string& key, const Bytes& value) {
  locked(true, [&](detail::KvState& s) {
    s.queuePush(key, value);
    logRecord(kQueuePush, key, value);
  });
}

std::optional<Bytes> FileStore::queuePop(const std::string& key, bool block, Duration timeout) {
  auto tryPop = [&]() -> std::optional<Bytes> {
    return locked(true, [&](detail::KvState& s) {
      auto item = s.queuePop(key);
      if (item) logRecord(kQueuePop, key, "");
      return item;
    });
  };
  if (!block) return tryPop();
  std::optional<Bytes> item;
  const bool ok = pollUntil(detail::deadlineAfter(timeout), [&] {
    // Peek under the shared lock first so idle consumers do not serialise writers.
    if (locked(false, [&](detail::KvState& s) { return s.queueLen(key); }) == 0) return false;
    item = tryPop();
    return item.has_value();
  });
  if (!ok) {
    throw TimeoutError(str("store queuePop(\"", key, "\") timed out after ", timeout.count(), " ms (", describe(),
                           "): the queue stayed empty. Is the producer running?"));
  }
  return item;
}

int64_t FileStore::queueLen(const std::string& key) {
  return locked(false, [&](detail::KvState& s) { return s.queueLen(key); });
}

std::shared_ptr<Store> FileStore::clone() {
  auto copy = std::make_shared<FileStore>(path_);
  copy->setTimeout(timeout());
  return copy;
}

std::string FileStore::describe() const { return str("FileStore ", path_); }

}  // namespace dt

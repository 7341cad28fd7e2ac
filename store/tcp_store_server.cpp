#include "store/tcp_store_server.h"

#include <sys/resource.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <asio.hpp>

#include "common/env.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"
#include "store/internal/kv_state.h"
#include "store/internal/protocol.h"

namespace dt {
namespace {

namespace proto = store_proto;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using proto::Command;
using proto::Status;

// Replies a connection may have queued before the server stops reading its
// requests (a client that never reads must not grow our memory).
constexpr size_t kMaxQueuedReplyBytes = 4 << 20;
// Largest timeout a request may ask for (keeps timer arithmetic finite).
constexpr int64_t kMaxTimeoutMs = int64_t{10} * 365 * 24 * 3600 * 1000;

bool constantTimeEquals(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

void raiseFileLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
}

struct Session;

// A request parked until its keys exist (get, wait, multiGet) or its queue
// has an item (queuePop), or its timeout passes.
struct Waiter {
  explicit Waiter(asio::io_context& io) : timer(io) {}
  std::shared_ptr<Session> session;  // cleared when answered
  Command command{};
  std::vector<std::string> keys;
  Clock::time_point start;
  asio::steady_timer timer;
  bool done = false;
};
using WaiterPtr = std::shared_ptr<Waiter>;

}  // namespace

struct TcpStoreServer::Impl {
  // io first: everything below that holds sockets or timers dies before it.
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer acceptRetry{io};
  TcpStoreServerOptions options;
  size_t maxFrame = 0;
  std::string addressText;
  uint16_t boundPort = 0;
  Logger log = logger("store");
  std::thread thread;

  detail::KvState state;
  std::unordered_map<std::string, std::vector<WaiterPtr>> keyWaiters;
  std::unordered_map<std::string, std::deque<WaiterPtr>> queueWaiters;
  std::unordered_set<std::shared_ptr<Session>> sessions;

  mutable std::mutex joinMutex;
  std::condition_variable joinChanged;
  int joined = 0;
  int joinedWithoutRank = 0;
  std::set<int> joinedRanks;

  void accept();
  void notifyKey(const std::string& key);
  void serveQueue(const std::string& key);
  void park(Session& session, Command command, std::vector<std::string> keys, int64_t timeoutMs);
  void answer(const WaiterPtr& waiter);
  void expire(const WaiterPtr& waiter);
  void forget(const WaiterPtr& waiter);
  void closeAll();
};

namespace {

struct Session : std::enable_shared_from_this<Session> {
  Session(TcpStoreServer::Impl& server, tcp::socket socket)
      : server(server), socket(std::move(socket)), stallTimer(server.io) {}

  TcpStoreServer::Impl& server;
  tcp::socket socket;
  std::string peer = "?";
  std::vector<char> in = std::vector<char>(4096);
  size_t begin = 0, end = 0;
  std::string out, writing;
  bool writeInFlight = false, closed = false, closeAfterWrite = false, handshaken = false;
  bool processPosted = false;
  WaiterPtr pending;
  asio::steady_timer stallTimer;
  bool stallArmed = false;
  bool progressed = false;  // bytes arrived since the stall clock was last set
  uint64_t stallGeneration = 0;

  void start() {
    std::error_code ec;
    socket.set_option(tcp::no_delay(true), ec);
    auto remote = socket.remote_endpoint(ec);
    if (!ec) peer = str(remote.address().to_string(), ":", remote.port());
    updateStall();
    read();
  }

  void read() {
    if (closed) return;
    if (in.size() - end < 1024) {
      if (begin > 0) {
        std::memmove(in.data(), in.data() + begin, end - begin);
        end -= begin;
        begin = 0;
      }
      if (in.size() - end < 1024) in.resize(in.size() * 2);
    }
    socket.async_read_some(asio::buffer(in.data() + end, in.size() - end),
                           [self = shared_from_this()](std::error_code ec, size_t n) { self->onRead(ec, n); });
  }

  void onRead(std::error_code ec, size_t n) {
    if (closed) return;
    if (ec) {
      if (ec == asio::error::eof || ec == asio::error::connection_reset) {
        if (end > begin) {
          close(str("disconnected in the middle of a request (", end - begin, " bytes buffered)"), true);
        } else {
          close("disconnected", false);
        }
      } else if (ec != asio::error::operation_aborted) {
        close(str("read failed: ", ec.message()), true);
      }
      return;
    }
    end += n;
    progressed = true;
    process();
    read();
  }

  // Handles every complete frame in the buffer, unless a request is parked.
  void process() {
    processPosted = false;
    while (!closed && !pending && !closeAfterWrite && out.size() + writing.size() < kMaxQueuedReplyBytes) {
      const size_t available = end - begin;
      if (available < proto::kHeaderBytes) break;
      const uint32_t length = proto::readLength(in.data() + begin);
      if (length == 0 || length > server.maxFrame) {
        fail(str("frame length ", length, " is outside 1..", server.maxFrame,
                 " (DT_STORE_MAX_VALUE_BYTES + framing)"));
        return;
      }
      if (available < proto::kHeaderBytes + length) {
        // Make room for the whole frame so the next reads complete it.
        const size_t need = proto::kHeaderBytes + length;
        if (in.size() - begin < need + 1024) {
          std::memmove(in.data(), in.data() + begin, available);
          begin = 0;
          end = available;
          if (in.size() < need + 1024) in.resize(need + 1024);
        }
        break;
      }
      std::string_view body(in.data() + begin + proto::kHeaderBytes, length);
      begin += proto::kHeaderBytes + length;
      handle(body);
    }
    if (!closed && pending && end - begin > server.maxFrame + proto::kHeaderBytes) {
      fail("sent more than a frame's worth of requests while one was still waiting");
      return;
    }
    if (begin == end) begin = end = 0;
    updateStall(progressed);
    progressed = false;
    flush();
  }

  void continueLater() {
    if (processPosted || closed) return;
    processPosted = true;
    asio::post(server.io, [self = shared_from_this()] { self->process(); });
  }

  // A client stalls when it has sent part of a request (or not yet its
  // handshake) and nothing more for stallTimeout.
  // Bytes arriving restart the clock: a large value on a slow link is fine.
  void updateStall(bool gotBytes = false) {
    const bool stalled = !closed && !pending && (!handshaken || end > begin);
    if (stalled == stallArmed && !(stalled && gotBytes)) return;
    stallArmed = stalled;
    ++stallGeneration;
    if (!stalled) {
      stallTimer.cancel();
      return;
    }
    stallTimer.expires_after(server.options.stallTimeout);
    stallTimer.async_wait([self = shared_from_this(), generation = stallGeneration](std::error_code ec) {
      if (ec || self->closed || generation != self->stallGeneration) return;
      self->fail(str(self->handshaken ? "stalled in the middle of a request" : "sent no complete handshake",
                     ": nothing received for ",
                     self->server.options.stallTimeout.count(), " ms (", self->end - self->begin,
                     " bytes buffered; DT_STORE_STALL_TIMEOUT)"));
    });
  }

  void flush() {
    if (writeInFlight || closed) return;
    if (out.empty()) {
      if (closeAfterWrite) close("handshake refused", false);
      return;
    }
    writing.swap(out);
    out.clear();
    writeInFlight = true;
    asio::async_write(socket, asio::buffer(writing), [self = shared_from_this()](std::error_code ec, size_t) {
      self->writeInFlight = false;
      self->writing.clear();
      if (self->closed) return;
      if (ec) {
        self->close(str("write failed: ", ec.message()), false);
        return;
      }
      self->flush();
      // Reading may have paused on a full reply queue.
      if (!self->pending && self->end > self->begin) self->continueLater();
    });
  }

  // Bad input from the network: log why, drop this connection, keep the data.
  void fail(const std::string& reason) { close(reason, true); }

  void close(const std::string& reason, bool warn) {
    if (closed) return;
    closed = true;
    if (warn) {
      server.log->warn("store server {}: closing connection from {}: {}", server.addressText, peer, reason);
    } else {
      server.log->debug("store server {}: connection from {} closed: {}", server.addressText, peer, reason);
    }
    if (pending) {
      server.forget(pending);
      pending.reset();
    }
    stallTimer.cancel();
    std::error_code ignored;
    socket.shutdown(tcp::socket::shutdown_both, ignored);
    socket.close(ignored);
    server.sessions.erase(shared_from_this());
  }

  // --- replies ---------------------------------------------------------------
  proto::FrameWriter reply(Status status) {
    proto::FrameWriter w(out);
    w.u8(static_cast<uint8_t>(status));
    return w;
  }
  void replyOk() { reply(Status::Ok).finish(); }
  void replyError(Status status, const std::string& message) { reply(status).bytes(message).finish(); }

  void handle(std::string_view body);
  void handleHello(proto::FrameReader& r);
};

void Session::handleHello(proto::FrameReader& r) {
  const uint32_t magic = r.u32();
  if (magic != proto::kMagic) {
    fail(str("bad handshake magic 0x", std::hex, magic, " (not a dtrain store client?)"));
    return;
  }
  const uint16_t version = r.u16();
  if (version != proto::kVersion) {
    const std::string message = str("client speaks store protocol version ", version, ", this server (",
                                    server.addressText, ") speaks version ", proto::kVersion,
                                    "; run the same dtrain build on every host");
    server.log->warn("store server {}: refusing {}: {}", server.addressText, peer, message);
    reply(Status::VersionMismatch).u16(proto::kVersion).bytes(message).finish();
    closeAfterWrite = true;
    return;
  }
  const std::string token = r.bytes(4096, "token");
  const int32_t rank = r.i32();
  const uint8_t flags = r.u8();
  r.expectEnd();
  if (!constantTimeEquals(token, server.options.token)) {
    const std::string message = str("the store at ", server.addressText, " refused the connection: ",
                                    token.empty() ? "no token given" : "wrong token",
                                    ". Every process of a job must use the same DT_STORE_TOKEN (dtrun sets it)");
    server.log->warn("store server {}: refusing {} (rank {}): {}", server.addressText, peer, rank,
                     token.empty() ? "missing token" : "wrong token");
    reply(Status::AuthFailed).u16(proto::kVersion).bytes(message).finish();
    closeAfterWrite = true;
    return;
  }
  handshaken = true;
  reply(Status::Ok).u16(proto::kVersion).finish();
  if (flags & proto::kHelloWorker) {
    {
      std::lock_guard lock(server.joinMutex);
      ++server.joined;
      if (rank >= 0) server.joinedRanks.insert(rank);
      else ++server.joinedWithoutRank;
    }
    server.joinChanged.notify_all();
  }
}

void Session::handle(std::string_view body) {
  uint8_t command = 0;
  try {
    proto::FrameReader r(body);
    command = r.u8();
    if (!handshaken) {
      if (command != static_cast<uint8_t>(Command::Hello)) {
        fail(str("first request was command ", int(command), " (", proto::commandName(command),
                 ") instead of the handshake"));
        return;
      }
      handleHello(r);
      return;
    }
    const size_t maxKey = server.options.maxKeyBytes;
    const size_t maxValue = server.options.maxValueBytes;
    auto& state = server.state;
    switch (static_cast<Command>(command)) {
      case Command::Set: {
        std::string key = r.bytes(maxKey, "key");
        std::string value = r.bytes(maxValue, "value");
        r.expectEnd();
        state.set(key, std::move(value));
        replyOk();
        server.notifyKey(key);
        return;
      }
      case Command::Get: {
        std::string key = r.bytes(maxKey, "key");
        const int64_t timeoutMs = r.i64();
        r.expectEnd();
        if (const Bytes* value = state.find(key)) {
          reply(Status::Ok).bytes(*value).finish();
        } else {
          server.park(*this, Command::Get, {std::move(key)}, timeoutMs);
        }
        return;
      }
      case Command::Add: {
        std::string key = r.bytes(maxKey, "key");
        const int64_t delta = r.i64();
        r.expectEnd();
        const int64_t value = state.add(key, delta);
        reply(Status::Ok).i64(value).finish();
        server.notifyKey(key);
        return;
      }
      case Command::CompareSet: {
        std::string key = r.bytes(maxKey, "key");
        std::string expected = r.bytes(maxValue, "expected value");
        std::string desired = r.bytes(maxValue, "desired value");
        r.expectEnd();
        bool wrote = false;
        const Bytes result = state.compareSet(key, expected, desired, wrote);
        reply(Status::Ok).bytes(result).finish();
        if (wrote) server.notifyKey(key);
        return;
      }
      case Command::Wait:
      case Command::MultiGet: {
        std::vector<std::string> keys = r.keys(maxKey);
        const int64_t timeoutMs = r.i64();
        r.expectEnd();
        if (!state.hasAll(keys)) {
          server.park(*this, static_cast<Command>(command), std::move(keys), timeoutMs);
        } else if (static_cast<Command>(command) == Command::Wait) {
          replyOk();
        } else {
          auto w = reply(Status::Ok);
          w.u32(static_cast<uint32_t>(keys.size()));
          for (const auto& key : keys) w.bytes(*state.find(key));
          w.finish();
        }
        return;
      }
      case Command::Check: {
        std::vector<std::string> keys = r.keys(maxKey);
        r.expectEnd();
        reply(Status::Ok).u8(state.hasAll(keys) ? 1 : 0).finish();
        return;
      }
      case Command::Delete: {
        std::string key = r.bytes(maxKey, "key");
        r.expectEnd();
        reply(Status::Ok).u8(state.erase(key) ? 1 : 0).finish();
        return;
      }
      case Command::NumKeys:
        r.expectEnd();
        reply(Status::Ok).i64(state.size()).finish();
        return;
      case Command::Append: {
        std::string key = r.bytes(maxKey, "key");
        std::string value = r.bytes(maxValue, "value");
        r.expectEnd();
        const Bytes* current = state.find(key);
        if (current && current->size() + value.size() > maxValue) {
          replyError(Status::InvalidArgument,
                     str("store append(\"", key, "\"): the value would grow to ", current->size() + value.size(),
                         " bytes, over DT_STORE_MAX_VALUE_BYTES=", maxValue));
          return;
        }
        state.append(key, value);
        replyOk();
        server.notifyKey(key);
        return;
      }
      case Command::MultiSet: {
        const uint32_t count = r.u32();
        if (count > r.remaining() / 8) throw proto::ProtocolError(str("multiSet count ", count, " does not fit"));
        std::vector<std::pair<std::string, std::string>> items;
        items.reserve(count);
        for (uint32_t i = 0; i < count; ++i) {
          std::string key = r.bytes(maxKey, "key");
          std::string value = r.bytes(maxValue, "value");
          items.emplace_back(std::move(key), std::move(value));
        }
        r.expectEnd();
        for (auto& [key, value] : items) state.set(key, std::move(value));
        replyOk();
        for (auto& item : items) server.notifyKey(item.first);
        return;
      }
      case Command::QueuePush: {
        std::string key = r.bytes(maxKey, "key");
        std::string value = r.bytes(maxValue, "value");
        r.expectEnd();
        state.queuePush(key, std::move(value));
        replyOk();
        server.serveQueue(key);
        return;
      }
      case Command::QueuePop: {
        std::string key = r.bytes(maxKey, "key");
        const bool block = r.u8() != 0;
        const int64_t timeoutMs = r.i64();
        r.expectEnd();
        if (auto item = state.queuePop(key)) {
          reply(Status::Ok).u8(1).bytes(*item).finish();
        } else if (!block) {
          reply(Status::Ok).u8(0).finish();
        } else {
          server.park(*this, Command::QueuePop, {std::move(key)}, timeoutMs);
        }
        return;
      }
      case Command::QueueLen: {
        std::string key = r.bytes(maxKey, "key");
        r.expectEnd();
        reply(Status::Ok).i64(state.queueLen(key)).finish();
        return;
      }
      case Command::Ping:
        r.expectEnd();
        replyOk();
        return;
      case Command::Hello:
        fail("sent a second handshake");
        return;
    }
    fail(str("unknown command ", int(command)));
  } catch (const proto::LimitError& e) {
    if (!handshaken) {
      fail(str("malformed handshake: ", e.what()));
      return;
    }
    replyError(Status::InvalidArgument,
               str("store ", proto::commandName(command), " refused by the server ", server.addressText, ": ",
                   e.what(), " (its DT_STORE_MAX_KEY_BYTES / DT_STORE_MAX_VALUE_BYTES)"));
  } catch (const proto::ProtocolError& e) {
    fail(str("malformed ", proto::commandName(command), " request: ", e.what()));
  } catch (const InvalidArgument& e) {
    replyError(Status::InvalidArgument, e.what());
  }
}

}  // namespace

void TcpStoreServer::Impl::accept() {
  acceptor.async_accept([this](std::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
    if (ec) {
      // Typically out of file descriptors: back off instead of spinning.
      log->warn("store server {}: accept failed: {}; retrying in 50 ms", addressText, ec.message());
      acceptRetry.expires_after(std::chrono::milliseconds(50));
      acceptRetry.async_wait([this](std::error_code e) {
        if (!e) accept();
      });
      return;
    }
    auto session = std::make_shared<Session>(*this, std::move(socket));
    sessions.insert(session);
    session->start();
    accept();
  });
}

void TcpStoreServer::Impl::park(Session& session, Command command, std::vector<std::string> keys,
                                int64_t timeoutMs) {
  auto waiter = std::make_shared<Waiter>(io);
  waiter->session = session.shared_from_this();
  waiter->command = command;
  waiter->keys = std::move(keys);
  waiter->start = Clock::now();
  session.pending = waiter;
  if (command == Command::QueuePop) {
    queueWaiters[waiter->keys[0]].push_back(waiter);
  } else {
    for (const auto& key : state.missing(waiter->keys)) keyWaiters[key].push_back(waiter);
  }
  waiter->timer.expires_after(std::chrono::milliseconds(std::clamp<int64_t>(timeoutMs, 0, kMaxTimeoutMs)));
  waiter->timer.async_wait([this, waiter](std::error_code ec) {
    if (!ec && !waiter->done) expire(waiter);
  });
}

void TcpStoreServer::Impl::notifyKey(const std::string& key) {
  auto it = keyWaiters.find(key);
  if (it == keyWaiters.end()) return;
  std::vector<WaiterPtr> waiters = std::move(it->second);
  keyWaiters.erase(it);
  for (auto& waiter : waiters) {
    if (waiter->done) continue;
    auto missing = state.missing(waiter->keys);
    if (missing.empty()) {
      answer(waiter);
    } else if (std::find(missing.begin(), missing.end(), key) != missing.end()) {
      keyWaiters[key].push_back(waiter);  // deleted again meanwhile
    }
  }
}

void TcpStoreServer::Impl::serveQueue(const std::string& key) {
  auto it = queueWaiters.find(key);
  if (it == queueWaiters.end()) return;
  auto& waiters = it->second;
  while (!waiters.empty() && state.queueLen(key) > 0) {
    WaiterPtr waiter = std::move(waiters.front());
    waiters.pop_front();
    if (!waiter->done) answer(waiter);
  }
  if (waiters.empty()) queueWaiters.erase(key);
}

void TcpStoreServer::Impl::answer(const WaiterPtr& waiter) {
  waiter->done = true;
  waiter->timer.cancel();
  auto session = std::move(waiter->session);
  session->pending.reset();
  switch (waiter->command) {
    case Command::Get:
      session->reply(Status::Ok).bytes(*state.find(waiter->keys[0])).finish();
      break;
    case Command::Wait:
      session->replyOk();
      break;
    case Command::MultiGet: {
      auto w = session->reply(Status::Ok);
      w.u32(static_cast<uint32_t>(waiter->keys.size()));
      for (const auto& key : waiter->keys) w.bytes(*state.find(key));
      w.finish();
      break;
    }
    case Command::QueuePop:
      session->reply(Status::Ok).u8(1).bytes(*state.queuePop(waiter->keys[0])).finish();
      break;
    default:
      break;
  }
  session->flush();
  session->continueLater();
}

void TcpStoreServer::Impl::expire(const WaiterPtr& waiter) {
  forget(waiter);
  auto session = std::move(waiter->session);
  if (!session) return;
  session->pending.reset();
  std::vector<std::string> missing =
      waiter->command == Command::QueuePop ? waiter->keys : state.missing(waiter->keys);
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - waiter->start);
  auto w = session->reply(Status::Timeout);
  w.u32(static_cast<uint32_t>(missing.size()));
  for (const auto& key : missing) w.bytes(key);
  w.i64(waited.count());
  w.finish();
  session->flush();
  session->continueLater();
}

// Takes a waiter out of every list (timeout or disconnect).
void TcpStoreServer::Impl::forget(const WaiterPtr& waiter) {
  waiter->done = true;
  waiter->timer.cancel();
  auto drop = [&](auto& container, const std::string& key) {
    auto it = container.find(key);
    if (it == container.end()) return;
    auto& list = it->second;
    list.erase(std::remove(list.begin(), list.end(), waiter), list.end());
    if (list.empty()) container.erase(it);
  };
  for (const auto& key : waiter->keys) {
    if (waiter->command == Command::QueuePop) drop(queueWaiters, key);
    else drop(keyWaiters, key);
  }
}

void TcpStoreServer::Impl::closeAll() {
  std::error_code ignored;
  acceptor.close(ignored);
  acceptRetry.cancel();
  auto all = sessions;
  for (auto& session : all) session->close("server shutting down", false);
  sessions.clear();
  keyWaiters.clear();
  queueWaiters.clear();
}

std::shared_ptr<TcpStoreServer> TcpStoreServer::start(TcpStoreServerOptions options) {
  if (options.maxKeyBytes == 0) options.maxKeyBytes = static_cast<size_t>(env::getInt("DT_STORE_MAX_KEY_BYTES"));
  if (options.maxValueBytes == 0) {
    options.maxValueBytes = static_cast<size_t>(env::getInt("DT_STORE_MAX_VALUE_BYTES"));
  }
  if (options.stallTimeout.count() <= 0) options.stallTimeout = env::getDuration("DT_STORE_STALL_TIMEOUT");
  raiseFileLimit();

  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->maxFrame = options.maxValueBytes + proto::kFrameSlack;
  const std::string wanted = str(options.bindAddress, ":", options.port);
  std::error_code ec;
  tcp::resolver resolver(impl->io);
  auto endpoints = resolver.resolve(options.bindAddress, std::to_string(options.port),
                                    tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || endpoints.empty()) {
    throw NetworkError(str("TcpStore server cannot resolve its bind address ", wanted, ": ", ec.message()));
  }
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  auto& acceptor = impl->acceptor;
  if (acceptor.open(endpoint.protocol(), ec); !ec) {
    acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    if (acceptor.bind(endpoint, ec); !ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  }
  if (ec) {
    throw NetworkError(str("TcpStore server cannot listen on ", wanted, ": ", ec.message(),
                           ec == asio::error::address_in_use
                               ? ". Another process (or an earlier run of this job) holds the port; pick another "
                                 "port, or port 0 for a free one"
                               : ""));
  }
  impl->boundPort = acceptor.local_endpoint().port();
  impl->addressText = str(options.bindAddress, ":", impl->boundPort);
  impl->accept();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] {
    while (true) {
      try {
        raw->io.run();
        return;
      } catch (const std::exception& e) {
        // A bug in a handler must not take the store down with it.
        raw->log->error("store server {}: event loop error: {}", raw->addressText, e.what());
      }
    }
  });
  raw->log->info("store server listening on {}", raw->addressText);
  return std::shared_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl)));
}

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TcpStoreServer::~TcpStoreServer() {
  Impl* impl = impl_.get();
  asio::post(impl->io, [impl] {
    impl->closeAll();
    impl->io.stop();
  });
  impl->thread.join();
}

uint16_t TcpStoreServer::port() const { return impl_->boundPort; }
std::string TcpStoreServer::address() const { return impl_->addressText; }

int TcpStoreServer::joinedWorkers() const {
  std::lock_guard lock(impl_->joinMutex);
  return impl_->joined;
}

void TcpStoreServer::waitForWorkers(int numWorkers, std::chrono::milliseconds timeout) {
  std::unique_lock lock(impl_->joinMutex);
  if (impl_->joinChanged.wait_for(lock, timeout, [&] { return impl_->joined >= numWorkers; })) return;
  std::vector<int> missing;
  for (int r = 0; r < numWorkers; ++r) {
    if (!impl_->joinedRanks.count(r)) missing.push_back(r);
  }
  std::string who;
  if (impl_->joinedWithoutRank == 0) {
    who = str("; missing: rank", missing.size() == 1 ? " " : "s ", formatRanges(missing));
  } else {
    who = str(" (", impl_->joinedWithoutRank, " joined without saying their rank)");
  }
  throw TimeoutError(str("TcpStore server at ", impl_->addressText, ": waitForWorkers timed out after ",
                         timeout.count(), " ms: ", impl_->joined, "/", numWorkers, " joined", who,
                         ". Are all workers started, with the same store address and token?"));
}

}  // namespace dt

#include "store/tcp_store_server.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <asio.hpp>

#include "common/env.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"
#include "common/thread_name.h"
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

// Input buffers: every connection starts with a small one and returns to it
// when idle, so thousands of connections cost little.
constexpr size_t kInitialBufferBytes = 4096;
// A read asks for at least this much room when the buffer may grow.
constexpr size_t kMinReadBytes = 1024;
// Before the handshake a buffer never exceeds this (a whole Hello fits).
constexpr size_t kPreAuthBufferBytes = 16 * 1024;
// After it, frames up to this size arrive without a share of maxBufferedBytes.
constexpr size_t kUnreservedBufferBytes = 64 * 1024;

// Remembered replies for exactly-once retries (see the header's contract).
constexpr size_t kRememberedClients = 65536;
constexpr size_t kRememberedReplyBytes = size_t{64} << 20;
constexpr std::chrono::hours kRememberedReplyIdle{1};

// Rate limit of the warnings an unauthenticated peer can cause.
constexpr int kWarningsPerWindow = 10;
constexpr std::chrono::seconds kWarningWindow{10};

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

// Lets a burst of warnings through per window and counts the rest, so that a
// peer opening thousands of bad connections cannot flood the log.
class WarningBudget {
 public:
  // True when this warning may be logged; then `suppressed` says how many
  // were swallowed since the last one that was.
  bool allow(Clock::time_point now, uint64_t& suppressed) {
    if (now - windowStart_ >= kWarningWindow) {
      windowStart_ = now;
      usedInWindow_ = 0;
    }
    if (usedInWindow_ >= kWarningsPerWindow) {
      ++suppressed_;
      return false;
    }
    ++usedInWindow_;
    suppressed = std::exchange(suppressed_, 0);
    return true;
  }

 private:
  Clock::time_point windowStart_{};
  int usedInWindow_ = 0;
  uint64_t suppressed_ = 0;
};

// Which client sent a mutating request, and its number (store_proto).
struct RequestId {
  uint64_t client = 0;  // 0: not remembered
  uint64_t number = 0;
};

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
  RequestId id;  // of a parked queuePop, whose answer is remembered
};
using WaiterPtr = std::shared_ptr<Waiter>;

// The reply to each client's latest mutating request, so that a repeat of it
// (after a lost connection or a timeout) is answered instead of applied again.
// Bounded by kRememberedClients, kRememberedReplyBytes and kRememberedReplyIdle,
// least recently used out first.
class ReplyMemory {
 public:
  struct Entry {
    uint64_t number = 0;
    std::string reply;  // the framed reply; empty while the request is parked
    WaiterPtr parked;   // the parked request (queuePop) with this number
    Clock::time_point lastUsed;
    std::list<uint64_t>::iterator age;  // in ages_, most recently used first
  };

  // The entry of a client, marked as used now; nullptr when none is remembered.
  Entry* find(uint64_t client, Clock::time_point now) {
    auto it = entries_.find(client);
    if (it == entries_.end()) return nullptr;
    touch(it->second, now);
    return &it->second;
  }

  void rememberReply(RequestId id, std::string reply, Clock::time_point now) {
    Entry& entry = slot(id, now);
    entry.parked.reset();
    bytes_ += reply.size();
    entry.reply = std::move(reply);
    evict(now);
  }

  void rememberParked(RequestId id, WaiterPtr waiter, Clock::time_point now) {
    Entry& entry = slot(id, now);
    entry.parked = std::move(waiter);
    evict(now);
  }

  // The answer to a parked request, if its client has not moved on since.
  void rememberAnswer(RequestId id, std::string reply, Clock::time_point now) {
    auto it = entries_.find(id.client);
    if (it == entries_.end() || it->second.number != id.number) return;
    rememberReply(id, std::move(reply), now);
  }

  size_t clients() const { return entries_.size(); }

  // fn(client, number, framed reply) for every remembered reply.
  template <class Fn>
  void forEachReply(Fn&& fn) const {
    for (const auto& [client, entry] : entries_) {
      if (!entry.reply.empty()) fn(client, entry.number, entry.reply);
    }
  }

 private:
  void touch(Entry& entry, Clock::time_point now) {
    entry.lastUsed = now;
    ages_.splice(ages_.begin(), ages_, entry.age);
  }

  // The entry for id's client, set to id's number with nothing remembered yet.
  Entry& slot(RequestId id, Clock::time_point now) {
    auto [it, inserted] = entries_.try_emplace(id.client);
    Entry& entry = it->second;
    if (inserted) {
      ages_.push_front(id.client);
      entry.age = ages_.begin();
    }
    touch(entry, now);
    bytes_ -= entry.reply.size();
    entry.reply.clear();
    entry.number = id.number;
    return entry;
  }

  // Drops the least recently used entries while over a bound; the most
  // recent one always stays.
  void evict(Clock::time_point now) {
    while (ages_.size() > 1) {
      auto it = entries_.find(ages_.back());
      const bool over = entries_.size() > kRememberedClients || bytes_ > kRememberedReplyBytes ||
                        now - it->second.lastUsed > kRememberedReplyIdle;
      if (!over) return;
      bytes_ -= it->second.reply.size();
      entries_.erase(it);
      ages_.pop_back();
    }
  }

  std::unordered_map<uint64_t, Entry> entries_;
  std::list<uint64_t> ages_;
  size_t bytes_ = 0;
};

// The primary's side of its replication connection to a hot standby.
struct StandbyLink {
  explicit StandbyLink(asio::io_context& io) : socket(io), timer(io) {}
  tcp::socket socket;
  asio::steady_timer timer;
  std::string address;  // "host:port" of the standby, as clients should dial it
  std::string out, writing;
  bool writeInFlight = false;
  bool active = false;   // the standby accepted the handshake; writes are forwarded
  bool retiring = false;  // Retire is queued: close once it is written
  std::vector<char> in = std::vector<char>(64 * 1024);
  size_t inEnd = 0;
  // Frames sent that expect an answer, and answers received (in order).
  uint64_t forwarded = 0, acked = 0;
  uint64_t syncedAt = 0;  // forwarded count once the copy of the state was queued
  Clock::time_point lastProgress = Clock::now();
  std::shared_ptr<Session> requester;  // the AttachStandby request, answered once synced
};
using StandbyLinkPtr = std::shared_ptr<StandbyLink>;

enum class Role { Primary, Standby, Retired };

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
  ReplyMemory replies;

  uint64_t sessionsOpened = 0;
  // Connections waiting for their handshake, oldest first.
  std::list<Session*> unauthenticated;
  // Bytes of maxBufferedBytes held by connections receiving a large request,
  // and the connections waiting (unread) for a share, first come first served.
  size_t reservedBytes = 0;
  std::deque<std::shared_ptr<Session>> waitingForRoom;
  WarningBudget preAuthWarnings, capWarnings;

  mutable std::mutex joinMutex;
  std::condition_variable joinChanged;
  int joined = 0;
  int joinedWithoutRank = 0;
  std::set<int> joinedRanks;

  // Replication (see the header). role is written on the loop's thread only;
  // atomic for role() from others.
  std::atomic<Role> role{Role::Primary};
  bool standbySynced = false;  // standby: the primary's copy of its state is complete
  bool standbyLinked = false;  // standby: a primary connected (it follows one, once)
  StandbyLinkPtr link;         // primary: the standby it feeds
  // Forward numbers continue from one standby to the next, so that a reply
  // numbered under an earlier one is never held for a later one's count.
  uint64_t forwardedBefore = 0;
  bool shuttingDown = false;
  // Sessions whose replies wait for the standby's acknowledgement.
  std::vector<std::shared_ptr<Session>> heldSessions;

  // Primary: connect to a standby at host:port for `requester` (answered once synced).
  void attachStandby(Session& requester, const asio::ip::address& host, uint16_t port);
  // Sends a frame body to the standby (when one is attached and active); true when sent.
  bool forward(std::string_view body);
  // A blocking or non-blocking queuePop that takes an item now, as the standby must apply it.
  void forwardPop(RequestId id, const std::string& key);
  void linkWrite(const StandbyLinkPtr& l);
  void linkRead(const StandbyLinkPtr& l);
  void linkFrame(const StandbyLinkPtr& l, std::string_view body);
  void linkWatch(const StandbyLinkPtr& l);
  void sendCopyOfState(const StandbyLinkPtr& l);
  // Ends replication: `retire` tells the standby it must never serve. `standbyEnded`: its
  // process closed the connection, which a standby that finished its job does too (so it is
  // logged at info level: the owner of the standby reports a loss in its own words).
  void dropLink(const std::string& reason, bool retire, bool standbyEnded = false);
  void releaseHeld();
  // Standby: its primary's replication connection closed (promotion when proven).
  void standbyLinkClosed(bool closedByPeer, const std::string& reason);
  uint64_t forwardedNow() const { return link && link->active ? link->forwarded : 0; }

  void accept();
  void admitUnauthenticated(Session& session);
  // A share of maxBufferedBytes for a request of `need` bytes; false when the
  // session has to wait for one (it is queued and resumed by releaseRoom).
  bool reserveRoom(Session& session, size_t need);
  void releaseRoom(Session& session);
  // A rate-limited warning (one budget per kind of trouble).
  void warnLimited(WarningBudget& budget, const std::string& message);
  // A mutating request seen before: answered from memory, moved over from a
  // lost connection, or refused as stale (true), or to be applied (false).
  bool replay(Session& session, RequestId id, uint8_t command);
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
      : server(server), socket(std::move(socket)), serial(++server.sessionsOpened), stallTimer(server.io),
        handshakeTimer(server.io) {}

  TcpStoreServer::Impl& server;
  tcp::socket socket;
  const uint64_t serial;  // connections opened later have larger ones
  std::string peer = "?";
  // Input: bytes [begin, end) of `in` are received and not yet handled. While
  // a read is in flight it writes after `end`, so nothing may move or resize
  // the buffer then.
  std::vector<char> in = std::vector<char>(kInitialBufferBytes);
  size_t begin = 0, end = 0;
  bool readInFlight = false;
  size_t reserved = 0;        // share of maxBufferedBytes for the frame at `begin`
  size_t roomWanted = 0;      // the share it waits for, while in server.waitingForRoom
  bool waitingForRoom = false;
  std::string out, writing;
  bool writeInFlight = false, closed = false, closeAfterWrite = false, handshaken = false;
  bool processPosted = false;
  WaiterPtr pending;
  asio::steady_timer stallTimer;
  bool stallArmed = false;
  bool progressed = false;  // bytes arrived since the stall clock was last set
  uint64_t stallGeneration = 0;
  asio::steady_timer handshakeTimer;
  Clock::time_point connectedAt = Clock::now();
  std::list<Session*>::iterator unauthenticatedEntry;
  bool listedUnauthenticated = false;
  // Replication: this is a primary's connection to this standby server.
  bool replicaLink = false;
  bool peerClosed = false;  // the peer's kernel closed it (end-of-file or reset)
  // Primary with a standby: `out` may reveal writes up to forward number
  // outSeq, so it waits (held, in server.heldSessions) until the standby
  // acknowledged that many.
  uint64_t outSeq = 0;
  bool held = false;

  void start() {
    std::error_code ec;
    socket.set_option(tcp::no_delay(true), ec);
    auto remote = socket.remote_endpoint(ec);
    if (!ec) peer = str(remote.address().to_string(), ":", remote.port());
    server.admitUnauthenticated(*this);
    const auto limit = std::min(server.options.handshakeTimeout, server.options.stallTimeout);
    handshakeTimer.expires_after(limit);
    handshakeTimer.async_wait([self = shared_from_this(), limit](std::error_code e) {
      if (e || self->closed || self->handshaken) return;
      self->fail(str("sent no complete handshake within ", limit.count(), " ms of connecting (", self->end - self->begin,
                     " bytes buffered; DT_STORE_HANDSHAKE_TIMEOUT)"));
    });
    read();
  }

  // The largest the buffer may grow without a share of maxBufferedBytes.
  size_t unreservedLimit() const { return handshaken ? kUnreservedBufferBytes : kPreAuthBufferBytes; }

  // Starts a read unless one is in flight, the connection waits for room, or
  // the buffer is full and may not grow: it grows only towards the frame
  // being received (beyond unreservedLimit only with a reserved share), so
  // memory follows the bytes that arrive, not the lengths peers claim.
  void read() {
    if (closed || readInFlight || waitingForRoom) return;
    if (in.size() - end < kMinReadBytes && begin > 0) {
      std::memmove(in.data(), in.data() + begin, end - begin);
      end -= begin;
      begin = 0;
    }
    const size_t limit = std::max(unreservedLimit(), reserved);
    if (in.size() - end < kMinReadBytes && in.size() < limit) {
      in.resize(std::min(limit, std::max(in.size() * 2, end + kMinReadBytes)));
    }
    if (in.size() == end) return;  // resumed once handled frames make room
    readInFlight = true;
    socket.async_read_some(asio::buffer(in.data() + end, in.size() - end),
                           [self = shared_from_this()](std::error_code ec, size_t n) {
                             self->readInFlight = false;
                             self->onRead(ec, n);
                           });
  }

  void onRead(std::error_code ec, size_t n) {
    if (closed) return;
    if (ec) {
      if (ec == asio::error::eof || ec == asio::error::connection_reset) {
        peerClosed = true;
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
  }

  // Handles every complete frame in the buffer, unless a request is parked,
  // then reads on.
  void process() {
    processPosted = false;
    while (!closed && !pending && !closeAfterWrite && out.size() + writing.size() < kMaxQueuedReplyBytes) {
      const size_t available = end - begin;
      if (available < proto::kHeaderBytes) break;
      const uint32_t length = proto::readLength(in.data() + begin);
      if (!handshaken && length > proto::kMaxHandshakeBytes) {
        fail(str("claimed a frame of ", length, " bytes before completing the handshake (at most ",
                 proto::kMaxHandshakeBytes, " allowed)"));
        return;
      }
      if (length == 0 || length > server.maxFrame) {
        fail(str("frame length ", length, " is outside 1..", server.maxFrame,
                 " (DT_STORE_MAX_VALUE_BYTES + framing)"));
        return;
      }
      const size_t need = proto::kHeaderBytes + length;
      if (available < need) {
        if (need > unreservedLimit() && reserved == 0) server.reserveRoom(*this, need);
        break;
      }
      std::string_view body(in.data() + begin + proto::kHeaderBytes, length);
      begin += need;
      if (reserved > 0) server.releaseRoom(*this);
      handle(body);
    }
    if (closed) return;
    if (begin == end && !readInFlight) {
      begin = end = 0;
      // A large request is done: give its memory back.
      if (in.size() > kUnreservedBufferBytes) std::vector<char>(kInitialBufferBytes).swap(in);
    }
    updateStall(progressed);
    progressed = false;
    flush();
    read();
  }

  void continueLater() {
    if (processPosted || closed) return;
    processPosted = true;
    asio::post(server.io, [self = shared_from_this()] { self->process(); });
  }

  // A client stalls when it has sent part of a request and nothing more for
  // stallTimeout (the handshake has its own deadline, set in start()).
  // Bytes arriving restart the clock: a large value on a slow link is fine.
  void updateStall(bool gotBytes = false) {
    const bool stalled = !closed && !pending && !waitingForRoom && handshaken && end > begin;
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
      self->fail(str("stalled in the middle of a request: nothing received for ",
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
    if (server.link && server.link->active && server.link->acked < outSeq) {
      if (!held) {
        held = true;
        server.heldSessions.push_back(shared_from_this());
      }
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
        // A reset (or a pipe its peer closed) comes from the peer's kernel: as good as end-of-file.
        self->peerClosed = ec == asio::error::connection_reset || ec == asio::error::broken_pipe;
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
    const std::string message =
        str("store server ", server.addressText, ": closing connection from ", peer, ": ", reason);
    if (warn && !handshaken) {
      server.warnLimited(server.preAuthWarnings, message);
    } else if (warn) {
      server.log->warn("{}", message);
    } else {
      server.log->debug("{}", message);
    }
    if (pending) {
      server.forget(pending);
      pending.reset();
    }
    leaveUnauthenticated();
    server.releaseRoom(*this);
    stallTimer.cancel();
    handshakeTimer.cancel();
    std::error_code ignored;
    socket.shutdown(tcp::socket::shutdown_both, ignored);
    socket.close(ignored);
    auto self = shared_from_this();
    server.sessions.erase(self);
    if (replicaLink) server.standbyLinkClosed(peerClosed, reason);
  }

  void leaveUnauthenticated() {
    if (!listedUnauthenticated) return;
    server.unauthenticated.erase(unauthenticatedEntry);
    listedUnauthenticated = false;
  }

  // --- replies ---------------------------------------------------------------
  proto::FrameWriter reply(Status status) {
    outSeq = server.forwardedNow();
    proto::FrameWriter w(out);
    w.u8(static_cast<uint8_t>(status));
    return w;
  }
  void replyOk() { reply(Status::Ok).finish(); }
  void replyError(Status status, const std::string& message) { reply(status).bytes(message).finish(); }

  void handle(std::string_view body);
  void handleHello(proto::FrameReader& r);
  // `body` is the whole request, forwarded to a standby as it is.
  void execute(Command command, proto::FrameReader& r, std::string_view body);
  void executeReplication(Command command, proto::FrameReader& r);
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
    server.warnLimited(server.preAuthWarnings,
                       str("store server ", server.addressText, ": refusing ", peer, ": ", message));
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
    server.warnLimited(server.preAuthWarnings, str("store server ", server.addressText, ": refusing ", peer,
                                                   " (rank ", rank, "): ",
                                                   token.empty() ? "missing token" : "wrong token"));
    reply(Status::AuthFailed).u16(proto::kVersion).bytes(message).finish();
    closeAfterWrite = true;
    return;
  }
  const Role role = server.role.load();
  if (flags & proto::kHelloReplica) {
    if (role != Role::Standby || server.standbyLinked) {
      const std::string message = str("the store server ", server.addressText, " is ",
                                      role == Role::Standby ? "already the standby of another primary"
                                                            : role == Role::Primary ? "a primary, not a standby"
                                                                                    : "a retired standby",
                                      ": it cannot follow ", peer);
      server.log->warn("store server {}: refusing a replication connection from {}: {}", server.addressText, peer,
                       message);
      reply(Status::Error).bytes(message).finish();
      closeAfterWrite = true;
      return;
    }
    server.standbyLinked = true;
    replicaLink = true;
    server.log->info("standby store server {}: following the primary at {}", server.addressText, peer);
  } else if (role != Role::Primary) {
    const std::string message =
        str("the store at ", server.addressText, " is ",
            role == Role::Standby ? "a standby that serves only once its primary is gone"
                                  : "a retired standby (its primary gave up on it, or it lost its primary before "
                                    "holding a full copy)",
            "; use the primary");
    reply(Status::NotPrimary).u16(proto::kVersion).bytes(message).finish();
    closeAfterWrite = true;
    return;
  }
  handshaken = true;
  leaveUnauthenticated();
  handshakeTimer.cancel();
  reply(Status::Ok).u16(proto::kVersion).finish();
  outSeq = 0;  // the first reply on a connection reveals no write: never held for the standby
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
  RequestId id;
  const size_t replyStart = out.size();
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
    if (proto::isMutating(static_cast<Command>(command))) {
      id.client = r.u64();
      id.number = r.u64();
      if (id.client != 0 && server.replay(*this, id, command)) return;
    }
    execute(static_cast<Command>(command), r, body);
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
  if (id.client == 0 || closed) return;
  if (pending) {
    pending->id = id;
    server.replies.rememberParked(id, pending, Clock::now());
  } else {
    server.replies.rememberReply(id, out.substr(replyStart), Clock::now());
  }
}

void Session::execute(Command command, proto::FrameReader& r, std::string_view body) {
  const size_t maxKey = server.options.maxKeyBytes;
  const size_t maxValue = server.options.maxValueBytes;
  auto& state = server.state;
  switch (command) {
    case Command::Set: {
      std::string key = r.bytes(maxKey, "key");
      std::string value = r.bytes(maxValue, "value");
      r.expectEnd();
      server.forward(body);
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
      server.forward(body);
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
      server.forward(body);
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
        server.park(*this, command, std::move(keys), timeoutMs);
      } else if (command == Command::Wait) {
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
      server.forward(body);
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
      server.forward(body);
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
      server.forward(body);
      for (auto& [key, value] : items) state.set(key, std::move(value));
      replyOk();
      for (auto& item : items) server.notifyKey(item.first);
      return;
    }
    case Command::QueuePush: {
      std::string key = r.bytes(maxKey, "key");
      std::string value = r.bytes(maxValue, "value");
      r.expectEnd();
      server.forward(body);
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
      // Only a pop that takes an item changes the state; a parked one is
      // forwarded when it does (answer()).
      if (state.queueLen(key) > 0) {
        proto::FrameReader id(body.substr(1));
        const uint64_t client = id.u64();
        server.forwardPop({client, id.u64()}, key);
      }
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
    case Command::AttachStandby: {
      const uint16_t port = r.u16();
      r.expectEnd();
      std::error_code ec;
      const auto remote = socket.remote_endpoint(ec);
      if (ec) {
        replyError(Status::Error, str("store attachStandby: the server cannot tell this connection's address: ",
                                      ec.message()));
        return;
      }
      server.attachStandby(*this, remote.address(), port);
      return;
    }
    case Command::Remember:
    case Command::Synced:
    case Command::Retire:
      executeReplication(command, r);
      return;
    case Command::Hello:
      fail("sent a second handshake");
      return;
  }
  fail(str("unknown command ", int(command)));
}

void Session::executeReplication(Command command, proto::FrameReader& r) {
  if (!replicaLink) {
    fail(str("sent ", proto::commandName(static_cast<uint8_t>(command)),
             ", which only a primary's replication connection may send"));
    return;
  }
  switch (command) {
    case Command::Remember: {
      RequestId id;
      id.client = r.u64();
      id.number = r.u64();
      std::string remembered = r.bytes(server.maxFrame, "remembered reply");
      r.expectEnd();
      server.replies.rememberReply(id, std::move(remembered), Clock::now());
      replyOk();
      return;
    }
    case Command::Synced:
      r.expectEnd();
      server.standbySynced = true;
      server.log->info("standby store server {}: holds a full copy of the primary at {} ({} keys)", server.addressText,
                       peer, server.state.size());
      replyOk();
      return;
    case Command::Retire:
      r.expectEnd();
      server.role = Role::Retired;
      server.log->warn("standby store server {}: the primary at {} retired it (it was too slow to acknowledge); it "
                       "will never serve",
                       server.addressText, peer);
      return;
    default:
      fail(str("unexpected replication command ", int(command)));
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

void TcpStoreServer::Impl::warnLimited(WarningBudget& budget, const std::string& message) {
  uint64_t suppressed = 0;
  if (!budget.allow(Clock::now(), suppressed)) return;
  if (suppressed == 0) {
    log->warn("{}", message);
  } else {
    log->warn("{} ({} more like this were not logged)", message, suppressed);
  }
}

void TcpStoreServer::Impl::admitUnauthenticated(Session& session) {
  if (unauthenticated.size() >= options.maxUnauthenticated && !unauthenticated.empty()) {
    // Dropping the oldest rather than refusing the newest keeps real clients
    // in: they send their handshake at once, so a flood of silent connections
    // cannot keep them out for longer than it takes to open the cap's worth.
    Session& oldest = *unauthenticated.front();
    const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - oldest.connectedAt);
    warnLimited(capWarnings, str("store server ", addressText, ": ", unauthenticated.size(),
                                 " connections are waiting for their handshake, the cap "
                                 "(DT_STORE_MAX_UNAUTHENTICATED=", options.maxUnauthenticated,
                                 "); closing the oldest, from ", oldest.peer, " (connected ", age.count(),
                                 " ms ago), to admit ", session.peer));
    oldest.close("dropped for a newer connection: too many connections waiting for their handshake", false);
  }
  unauthenticated.push_back(&session);
  session.unauthenticatedEntry = std::prev(unauthenticated.end());
  session.listedUnauthenticated = true;
}

bool TcpStoreServer::Impl::reserveRoom(Session& session, size_t need) {
  const bool fits = reservedBytes == 0 || reservedBytes + need <= options.maxBufferedBytes;
  if (waitingForRoom.empty() && fits) {
    reservedBytes += need;
    session.reserved = need;
    return true;
  }
  warnLimited(capWarnings, str("store server ", addressText, ": requests in progress hold ", reservedBytes,
                               " bytes of input, the cap (DT_STORE_MAX_BUFFERED_BYTES=", options.maxBufferedBytes,
                               "); not reading the ", need, "-byte request from ", session.peer,
                               " until they complete (", waitingForRoom.size() + 1, " connections waiting)"));
  session.waitingForRoom = true;
  session.roomWanted = need;
  waitingForRoom.push_back(session.shared_from_this());
  session.updateStall();
  return false;
}

void TcpStoreServer::Impl::releaseRoom(Session& session) {
  if (session.waitingForRoom) {
    session.waitingForRoom = false;
    auto self = session.shared_from_this();
    waitingForRoom.erase(std::remove(waitingForRoom.begin(), waitingForRoom.end(), self), waitingForRoom.end());
  }
  reservedBytes -= session.reserved;
  session.reserved = 0;
  // First come first served: the head waits until it fits, nobody overtakes it.
  while (!waitingForRoom.empty()) {
    Session& next = *waitingForRoom.front();
    if (reservedBytes != 0 && reservedBytes + next.roomWanted > options.maxBufferedBytes) break;
    auto admitted = std::move(waitingForRoom.front());
    waitingForRoom.pop_front();
    reservedBytes += next.roomWanted;
    next.reserved = next.roomWanted;
    next.waitingForRoom = false;
    next.updateStall(true);
    next.read();
  }
}

bool TcpStoreServer::Impl::replay(Session& session, RequestId id, uint8_t command) {
  ReplyMemory::Entry* entry = replies.find(id.client, Clock::now());
  if (!entry) return false;
  WaiterPtr parked = entry->parked && !entry->parked->done ? entry->parked : nullptr;
  if (id.number > entry->number) {
    // The client has moved on, so its parked request was abandoned with the
    // connection it came on: it must not take a queue item nobody will get.
    if (parked) {
      auto abandoned = parked->session;
      forget(parked);
      entry->parked.reset();
      if (abandoned && abandoned.get() != &session) {
        abandoned->pending.reset();
        abandoned->close("its client sent newer requests on another connection", false);
      }
    }
    return false;
  }
  if (id.number < entry->number) {
    session.replyError(Status::Error,
                       str("store ", proto::commandName(command), " request #", id.number, " of client ", std::hex,
                           id.client, std::dec, " is older than its latest request #", entry->number,
                           ": a stale repeat, not applied"));
    return true;
  }
  if (!entry->reply.empty()) {
    log->debug("store server {}: {} request #{} from {} repeated; answered from memory", addressText,
               proto::commandName(command), id.number, session.peer);
    session.outSeq = forwardedNow();
    session.out += entry->reply;
    return true;
  }
  if (parked) {
    auto previous = parked->session;
    if (previous && previous->serial > session.serial) {
      // A late copy of a request its client already sent again on a newer
      // connection: this older one is dead to the client.
      session.close("a late copy of a request its client repeated on a newer connection", false);
      return true;
    }
    // Still waiting on the connection the request first came on, which its
    // client has given up: the request moves over to this one.
    parked->session = session.shared_from_this();
    session.pending = parked;
    if (previous && previous.get() != &session) {
      previous->pending.reset();
      previous->close("its client repeated the waiting request on another connection", false);
    }
    return true;
  }
  return false;  // it never completed (its connection closed while it waited): apply it now
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
  const size_t replyStart = session->out.size();
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
      forwardPop(waiter->id, waiter->keys[0]);
      session->reply(Status::Ok).u8(1).bytes(*state.queuePop(waiter->keys[0])).finish();
      break;
    default:
      break;
  }
  if (waiter->id.client != 0) replies.rememberAnswer(waiter->id, session->out.substr(replyStart), Clock::now());
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
  const size_t replyStart = session->out.size();
  auto w = session->reply(Status::Timeout);
  w.u32(static_cast<uint32_t>(missing.size()));
  for (const auto& key : missing) w.bytes(key);
  w.i64(waited.count());
  w.finish();
  if (waiter->id.client != 0) replies.rememberAnswer(waiter->id, session->out.substr(replyStart), Clock::now());
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

// ---- replication, the primary's side ------------------------------------------

void TcpStoreServer::Impl::attachStandby(Session& requester, const asio::ip::address& host, uint16_t port) {
  const std::string address = host.is_v6() ? str("[", host.to_string(), "]:", port) : str(host.to_string(), ":", port);
  if (role.load() != Role::Primary) {
    requester.replyError(Status::Error, str("store attachStandby(", address, "): ", addressText,
                                            " is a standby itself; ask the primary"));
    return;
  }
  if (link) {
    requester.replyError(Status::Error, str("store attachStandby(", address, "): the store at ", addressText,
                                            " already replicates to the standby at ", link->address));
    return;
  }
  auto l = std::make_shared<StandbyLink>(io);
  l->address = address;
  l->forwarded = l->acked = forwardedBefore;
  l->requester = requester.shared_from_this();
  // Parked like a waiting request (no keys): the requester's next frames wait.
  auto waiter = std::make_shared<Waiter>(io);
  waiter->session = l->requester;
  waiter->command = Command::AttachStandby;
  requester.pending = waiter;
  link = l;
  log->info("store server {}: connecting to the standby at {}", addressText, address);
  linkWatch(l);
  l->socket.async_connect(tcp::endpoint(host, port), [this, l](std::error_code ec) {
    if (link != l) return;
    if (ec) {
      dropLink(str("cannot connect to it: ", ec.message()), false);
      return;
    }
    std::error_code ignored;
    l->socket.set_option(tcp::no_delay(true), ignored);
    proto::FrameWriter w(l->out);
    w.u8(static_cast<uint8_t>(Command::Hello)).u32(proto::kMagic).u16(proto::kVersion).bytes(options.token);
    w.i32(-1).u8(proto::kHelloReplica);
    w.finish();
    linkWrite(l);
    linkRead(l);
  });
}

bool TcpStoreServer::Impl::forward(std::string_view body) {
  if (!link || !link->active) return false;
  const auto length = static_cast<uint32_t>(body.size());
  link->out.append(reinterpret_cast<const char*>(&length), 4);
  link->out.append(body.data(), body.size());
  ++link->forwarded;
  linkWrite(link);
  return true;
}

void TcpStoreServer::Impl::forwardPop(RequestId id, const std::string& key) {
  if (!link || !link->active) return;
  std::string frame;
  proto::FrameWriter w(frame);
  w.u8(static_cast<uint8_t>(Command::QueuePop)).u64(id.client).u64(id.number).bytes(key).u8(0).i64(0);
  w.finish();
  forward(std::string_view(frame).substr(proto::kHeaderBytes));
}

void TcpStoreServer::Impl::linkWrite(const StandbyLinkPtr& l) {
  if (l->writeInFlight || l->out.empty() || !l->socket.is_open()) return;
  l->writing.swap(l->out);
  l->out.clear();
  l->writeInFlight = true;
  asio::async_write(l->socket, asio::buffer(l->writing), [this, l](std::error_code ec, size_t) {
    l->writeInFlight = false;
    l->writing.clear();
    if (l->retiring) {  // no longer the current link: write out Retire, then close
      std::error_code ignored;
      if (ec || l->out.empty()) {
        l->socket.shutdown(tcp::socket::shutdown_both, ignored);
        l->socket.close(ignored);
      } else {
        linkWrite(l);
      }
      return;
    }
    if (link != l) return;
    if (ec) {
      dropLink(str("writing to it failed: ", ec.message()), false);
      return;
    }
    linkWrite(l);
  });
}

void TcpStoreServer::Impl::linkRead(const StandbyLinkPtr& l) {
  if (l->in.size() - l->inEnd < kMinReadBytes) l->in.resize(l->in.size() * 2);
  l->socket.async_read_some(asio::buffer(l->in.data() + l->inEnd, l->in.size() - l->inEnd),
                            [this, l](std::error_code ec, size_t n) {
                              if (link != l) return;
                              if (ec) {
                                const bool ended = ec == asio::error::eof || ec == asio::error::connection_reset;
                                dropLink(ended ? "it closed the replication connection (its process ended)"
                                               : str("reading from it failed: ", ec.message()),
                                         false, ended);
                                return;
                              }
                              l->inEnd += n;
                              size_t at = 0;
                              while (l->inEnd - at >= proto::kHeaderBytes && link == l) {
                                const uint32_t length = proto::readLength(l->in.data() + at);
                                if (length == 0 || length > maxFrame) {
                                  dropLink(str("it sent a frame of ", length, " bytes"), true);
                                  return;
                                }
                                if (l->inEnd - at < proto::kHeaderBytes + length) break;
                                linkFrame(l, std::string_view(l->in.data() + at + proto::kHeaderBytes, length));
                                at += proto::kHeaderBytes + length;
                              }
                              if (link != l) return;
                              std::memmove(l->in.data(), l->in.data() + at, l->inEnd - at);
                              l->inEnd -= at;
                              // A large answer (a popped item, a compareSet's value) gets room to arrive whole.
                              if (l->inEnd >= proto::kHeaderBytes) {
                                const size_t need = proto::kHeaderBytes + proto::readLength(l->in.data());
                                if (l->in.size() < need) l->in.resize(need);
                              }
                              releaseHeld();
                              linkRead(l);
                            });
}

void TcpStoreServer::Impl::linkFrame(const StandbyLinkPtr& l, std::string_view body) {
  l->lastProgress = Clock::now();
  if (!l->active) {  // the handshake's answer
    proto::FrameReader r(body);
    const auto status = static_cast<Status>(r.u8());
    if (status != Status::Ok) {
      std::string message = "(no reason given)";
      try {
        if (status == Status::VersionMismatch || status == Status::AuthFailed || status == Status::NotPrimary) r.u16();
        message = r.bytes(SIZE_MAX, "message");
      } catch (const proto::ProtocolError&) {
      }
      dropLink(str("it refused the replication connection: ", message), false);
      return;
    }
    l->active = true;
    sendCopyOfState(l);
    return;
  }
  ++l->acked;
  if (l->requester && l->acked >= l->syncedAt) {
    auto requester = std::move(l->requester);
    if (requester->closed) return;
    requester->pending.reset();
    requester->reply(Status::Ok).bytes(l->address).finish();
    requester->flush();
    requester->continueLater();
    log->info("store server {}: the standby at {} holds a full copy; every write is now acknowledged by it first",
              addressText, l->address);
  }
}

void TcpStoreServer::Impl::sendCopyOfState(const StandbyLinkPtr& l) {
  std::string frame;
  auto send = [&](auto&& fill) {
    frame.clear();
    proto::FrameWriter w(frame);
    fill(w);
    w.finish();
    forward(std::string_view(frame).substr(proto::kHeaderBytes));
  };
  for (const auto& entry : state.keys()) {
    send([&](proto::FrameWriter& w) {
      w.u8(static_cast<uint8_t>(Command::Set)).u64(0).u64(0).bytes(entry.first).bytes(entry.second);
    });
  }
  for (const auto& queue : state.queues()) {
    for (const auto& item : queue.second) {
      send([&](proto::FrameWriter& w) {
        w.u8(static_cast<uint8_t>(Command::QueuePush)).u64(0).u64(0).bytes(queue.first).bytes(item);
      });
    }
  }
  replies.forEachReply([&](uint64_t client, uint64_t number, const std::string& reply) {
    send([&](proto::FrameWriter& w) { w.u8(static_cast<uint8_t>(Command::Remember)).u64(client).u64(number).bytes(reply); });
  });
  send([](proto::FrameWriter& w) { w.u8(static_cast<uint8_t>(Command::Synced)); });
  l->syncedAt = l->forwarded;
}

// A standby that stops acknowledging (frozen, or its network cut) must not
// stall every write for ever: after standbyTimeout the primary retires it.
void TcpStoreServer::Impl::linkWatch(const StandbyLinkPtr& l) {
  const auto interval = std::max(std::chrono::milliseconds(10), options.standbyTimeout / 4);
  l->timer.expires_after(interval);
  l->timer.async_wait([this, l](std::error_code ec) {
    if (ec || link != l) return;
    const bool waiting = !l->active || l->acked < l->forwarded;
    if (!waiting) l->lastProgress = Clock::now();
    const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - l->lastProgress);
    if (waiting && silent >= options.standbyTimeout) {
      dropLink(str(l->active ? "no acknowledgement" : "no answer to the replication handshake", " for ", silent.count(),
                   " ms (standbyTimeout ", options.standbyTimeout.count(), " ms)"),
               true);
      return;
    }
    linkWatch(l);
  });
}

void TcpStoreServer::Impl::dropLink(const std::string& reason, bool retire, bool standbyEnded) {
  StandbyLinkPtr l = link;
  if (!l) return;
  forwardedBefore = l->forwarded;
  log->log(standbyEnded ? spdlog::level::info : spdlog::level::warn,
           "store server {}: replication to the standby at {} ends: {}; this server goes on alone{}", addressText,
           l->address, reason, retire ? " (the standby is told to retire)" : "");
  if (l->requester) {
    auto requester = std::move(l->requester);
    if (!requester->closed) {
      requester->pending.reset();
      requester->replyError(Status::Error, str("store attachStandby: the standby at ", l->address,
                                               " could not be attached: ", reason));
      requester->flush();
      requester->continueLater();
    }
  }
  l->timer.cancel();
  std::error_code ignored;
  if (retire && l->active && l->socket.is_open() && !l->retiring) {
    // Retire goes after every frame already queued; the socket closes once it is written.
    std::string frame;
    proto::FrameWriter w(frame);
    w.u8(static_cast<uint8_t>(Command::Retire));
    w.finish();
    l->out += frame;
    l->retiring = true;
    link.reset();
    releaseHeld();
    linkWrite(l);  // closes the socket once Retire is written
    return;
  }
  l->socket.shutdown(tcp::socket::shutdown_both, ignored);
  l->socket.close(ignored);
  link.reset();
  releaseHeld();
}

void TcpStoreServer::Impl::releaseHeld() {
  if (heldSessions.empty()) return;
  const uint64_t acked = link && link->active ? link->acked : UINT64_MAX;
  std::vector<std::shared_ptr<Session>> still;
  std::vector<std::shared_ptr<Session>> ready;
  for (auto& session : heldSessions) {
    if (session->closed) continue;
    if (session->outSeq <= acked) {
      session->held = false;
      ready.push_back(std::move(session));
    } else {
      still.push_back(std::move(session));
    }
  }
  heldSessions.swap(still);
  for (auto& session : ready) session->flush();
}

// ---- replication, the standby's side -----------------------------------------

void TcpStoreServer::Impl::standbyLinkClosed(bool closedByPeer, const std::string& reason) {
  if (role.load() != Role::Standby || shuttingDown) return;
  if (closedByPeer && standbySynced) {
    role = Role::Primary;
    log->warn("standby store server {}: promoted to primary, serving {} keys: the primary's replication connection "
              "was closed by its peer ({}), which proves that the primary's process is gone",
              addressText, state.size(), reason);
    return;
  }
  role = Role::Retired;
  log->warn("standby store server {}: retired, it will never serve: its replication connection ended ({}){}",
            addressText, reason,
            standbySynced ? " without proof that the primary is gone" : " before it held a full copy of the primary");
}

void TcpStoreServer::Impl::closeAll() {
  shuttingDown = true;
  std::error_code ignored;
  if (link) {
    link->timer.cancel();
    link->socket.close(ignored);
    link.reset();
  }
  heldSessions.clear();
  acceptor.close(ignored);
  acceptRetry.cancel();
  auto all = sessions;
  for (auto& session : all) session->close("server shutting down", false);
  sessions.clear();
  waitingForRoom.clear();
  keyWaiters.clear();
  queueWaiters.clear();
}

std::shared_ptr<TcpStoreServer> TcpStoreServer::start(TcpStoreServerOptions options) {
  if (options.maxKeyBytes == 0) options.maxKeyBytes = static_cast<size_t>(env::getInt("DT_STORE_MAX_KEY_BYTES"));
  if (options.maxValueBytes == 0) {
    options.maxValueBytes = static_cast<size_t>(env::getInt("DT_STORE_MAX_VALUE_BYTES"));
  }
  if (options.stallTimeout.count() <= 0) options.stallTimeout = env::getDuration("DT_STORE_STALL_TIMEOUT");
  if (options.handshakeTimeout.count() <= 0) {
    options.handshakeTimeout = env::getDuration("DT_STORE_HANDSHAKE_TIMEOUT");
  }
  if (options.maxUnauthenticated == 0) {
    options.maxUnauthenticated = static_cast<size_t>(std::max<int64_t>(1, env::getInt("DT_STORE_MAX_UNAUTHENTICATED")));
  }
  if (options.maxBufferedBytes == 0) {
    options.maxBufferedBytes = static_cast<size_t>(std::max<int64_t>(1, env::getInt("DT_STORE_MAX_BUFFERED_BYTES")));
  }
  raiseFileLimit();

  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (options.standby) impl->role = Role::Standby;
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
    setThreadName("dt-store-server");
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

std::string TcpStoreServer::role() const {
  switch (impl_->role.load()) {
    case Role::Primary: return "primary";
    case Role::Standby: return "standby";
    case Role::Retired: return "retired";
  }
  return "?";
}

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

// TcpStore specifics with the server in a separate process (forked before
// the test process starts any thread), clients as forked ranks
// (dt::testing::spawn), and raw sockets that speak the wire
// format of store/internal/protocol.h to split, corrupt and fuzz requests.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <thread>

#include "common/errors.h"
#include "common/strings.h"
#include "store/file_store.h"
#include "store/internal/protocol.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"
#include "testing/spawn.h"
#include "testing/spawn_gtest.h"
#include "tests/store/tcp_test_support.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
namespace proto = store_proto;
using dt::testing::expectThrowsWith;
using dt::testing::PortReservation;
using Clock = std::chrono::steady_clock;

using namespace store_testing;

// --- tests ---------------------------------------------------------------------

TEST(TcpStoreProcess, AddressAlreadyInUseNamesTheAddress) {
  ServerProcess server;
  TcpStoreOptions options;
  options.isServer = true;
  options.waitForWorkers = false;
  expectThrowsWith<NetworkError>([&] { TcpStore second("127.0.0.1", server.port(), options); },
                                 {str("127.0.0.1:", server.port()), "in use", "port 0"});
}

TEST(TcpStoreProcess, ManyProcessesHammeringAddGetExactCount) {
  ServerProcess server;
  constexpr int kProcs = 6, kThreads = 3, kAdds = 200;
  const auto result = dt::testing::spawn(kProcs, [&](dt::testing::RankContext&) {
    std::vector<std::thread> threads;
    std::vector<std::string> errors(kThreads);
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        try {
          auto store = client(server.port());
          for (int i = 0; i < kAdds; ++i) store->add("hammer", 1);
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(t)] = describe(e);
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& error : errors) {
      if (!error.empty()) throw std::runtime_error("a client failed: " + error);
    }
  });
  EXPECT_TRUE(dt::testing::everyRankReturned(result));
  EXPECT_EQ(client(server.port())->get("hammer"), std::to_string(kProcs * kThreads * kAdds));
}

TEST(TcpStoreProcess, BlockedGetFailsFastWhenTheServerDies) {
  ServerProcess server;
  auto store = client(server.port());
  store->set("alive", "1");
  std::thread killer([&] {
    std::this_thread::sleep_for(300ms);
    server.child().kill();
  });
  const auto start = Clock::now();
  expectThrowsWith<NetworkError>([&] { store->get("never-set", 300s); },
                                 {"closed the connection", "get", str("127.0.0.1:", server.port())});
  const auto took = Clock::now() - start;
  killer.join();
  EXPECT_LT(took, 20s) << "the client should notice the server is gone long before its 300 s timeout";
  // Later calls fail at once with the reason.
  expectThrowsWith<NetworkError>([&] { store->get("alive"); }, {"lost earlier"});
}

TEST(TcpStoreProcess, RequestSplitAcrossManyWritesIsServed) {
  ServerProcess server;
  const int fd = rawConnect(server.port());
  ASSERT_GE(fd, 0);
  const std::string bytes = helloFrame() + setFrame("split/key", "split value");
  // Byte by byte for the first 12 bytes, then chunks, with pauses between writes.
  size_t pos = 0;
  while (pos < bytes.size()) {
    const size_t n = pos < 12 ? 1 : std::min<size_t>(7, bytes.size() - pos);
    rawSend(fd, std::string_view(bytes).substr(pos, n));
    pos += n;
    std::this_thread::sleep_for(pos < 12 ? 2ms : 30ms);
  }
  auto hello = rawReadFrame(fd);
  ASSERT_TRUE(hello.has_value());
  EXPECT_EQ(statusOf(*hello), static_cast<uint8_t>(proto::Status::Ok));
  auto setReply = rawReadFrame(fd);
  ASSERT_TRUE(setReply.has_value());
  EXPECT_EQ(statusOf(*setReply), static_cast<uint8_t>(proto::Status::Ok));
  ::close(fd);
  EXPECT_EQ(client(server.port())->get("split/key"), "split value");
}

TEST(TcpStoreProcess, WrongTokenIsRefusedAndLogged) {
  dt::testing::TempDir dir;
  const std::string log = (dir.path() / "server.log").string();
  ServerProcess server({}, log);
  expectThrowsWith<NetworkError>([&] { client(server.port(), "not-the-token"); },
                                 {"refused", "wrong token", "DT_STORE_TOKEN"});
  expectThrowsWith<NetworkError>([&] { client(server.port(), ""); }, {"no token"});
  // The server logged both with the peer address, and still serves good clients.
  auto good = client(server.port());
  good->set("k", "v");
  EXPECT_EQ(good->get("k"), "v");
  const std::string text = readFile(log);
  EXPECT_NE(text.find("refusing 127.0.0.1:"), std::string::npos) << text;
  EXPECT_NE(text.find("wrong token"), std::string::npos) << text;
  EXPECT_NE(text.find("missing token"), std::string::npos) << text;
}

TEST(TcpStoreProcess, VersionMismatchIsClearOnTheServerSide) {
  ServerProcess server;
  const int fd = rawConnect(server.port());
  rawSend(fd, helloFrame(kToken, 99));
  auto reply = rawReadFrame(fd);
  ASSERT_TRUE(reply.has_value());
  proto::FrameReader r(*reply);
  EXPECT_EQ(r.u8(), static_cast<uint8_t>(proto::Status::VersionMismatch));
  EXPECT_EQ(r.u16(), proto::kVersion);
  const std::string message = r.bytes(1 << 16, "message");
  EXPECT_NE(message.find("version 99"), std::string::npos) << message;
  EXPECT_NE(message.find(str("version ", proto::kVersion)), std::string::npos) << message;
  EXPECT_TRUE(closedByPeer(fd));
  ::close(fd);
}

TEST(TcpStoreProcess, VersionMismatchIsClearOnTheClientSide) {
  // A fake server from the future: answers every handshake with VersionMismatch.
  uint16_t port = 0;
  const int listener = loopbackListener(port);
  ASSERT_GE(listener, 0);
  std::thread fake([&] {
    const int fd = ::accept(listener, nullptr, nullptr);
    rawReadFrame(fd);
    std::string out;
    proto::FrameWriter w(out);
    w.u8(static_cast<uint8_t>(proto::Status::VersionMismatch)).u16(7).bytes("client speaks an older version, server 7");
    w.finish();
    rawSend(fd, out);
    ::close(fd);
  });
  expectThrowsWith<NetworkError>([&] { client(port); },
                                 {"version mismatch", str("this client speaks version ", proto::kVersion),
                                  "server version 7"});
  fake.join();
  ::close(listener);
}

TEST(TcpStoreProcess, SilentServerTimesOutAndTheClientReconnects) {
  // A fake server: answers both handshakes, ignores every request on the first
  // connection, answers check() on the second.
  uint16_t port = 0;
  const int listener = loopbackListener(port);
  ASSERT_GE(listener, 0);
  auto okFrame = [](auto&& fill) {
    std::string out;
    proto::FrameWriter w(out);
    w.u8(static_cast<uint8_t>(proto::Status::Ok));
    fill(w);
    w.finish();
    return out;
  };
  std::atomic<int> ignored{0};
  std::thread fake([&] {
    const int first = ::accept(listener, nullptr, nullptr);
    rawReadFrame(first);
    rawSend(first, okFrame([](proto::FrameWriter& w) { w.u16(proto::kVersion); }));
    if (rawReadFrame(first)) ++ignored;  // the check that never gets an answer
    const int second = ::accept(listener, nullptr, nullptr);
    rawReadFrame(second);
    rawSend(second, okFrame([](proto::FrameWriter& w) { w.u16(proto::kVersion); }));
    // The request itself, not another handshake, on the new connection.
    auto request = rawReadFrame(second);
    if (request && request->at(0) == static_cast<char>(proto::Command::Check)) {
      rawSend(second, okFrame([](proto::FrameWriter& w) { w.u8(1); }));
    }
    rawReadFrame(second, 2s);
    ::close(first);
    ::close(second);
  });
  auto store = client(port);
  store->setTimeout(300ms);
  const auto start = Clock::now();
  expectThrowsWith<TimeoutError>([&] { store->check({"k"}); }, {"no reply", "re-established"});
  EXPECT_LT(Clock::now() - start, 10s);
  store->setTimeout(10s);
  EXPECT_TRUE(store->check({"k"}));  // on a fresh connection, in step again
  EXPECT_EQ(ignored.load(), 1);
  store.reset();
  fake.join();
  ::close(listener);
}

TEST(TcpStoreProcess, StalledClientIsDisconnectedWithoutBlockingOthers) {
  dt::testing::TempDir dir;
  const std::string log = (dir.path() / "server.log").string();
  ServerProcess server({{"DT_STORE_STALL_TIMEOUT", "400ms"}}, log);
  const int fd = rawConnect(server.port());
  rawSend(fd, helloFrame());
  ASSERT_TRUE(rawReadFrame(fd).has_value());
  const std::string frame = setFrame("half", std::string(1000, 'x'));
  rawSend(fd, frame.substr(0, 100));  // and then nothing
  // Meanwhile others are served.
  auto other = client(server.port());
  other->set("meanwhile", "ok");
  EXPECT_EQ(other->get("meanwhile"), "ok");
  EXPECT_TRUE(closedByPeer(fd, 10s));
  ::close(fd);
  EXPECT_FALSE(other->check({"half"}));
  EXPECT_NE(readFile(log).find("stalled in the middle of a request"), std::string::npos) << readFile(log);
}

TEST(TcpStoreProcess, SlowButSteadyClientIsNotCutOff) {
  ServerProcess server({{"DT_STORE_STALL_TIMEOUT", "500ms"}}, "");
  const int fd = rawConnect(server.port());
  rawSend(fd, helloFrame());
  ASSERT_TRUE(rawReadFrame(fd).has_value());
  // 40 bytes every 150 ms: the whole request takes ~2 s, each gap is well
  // under the stall timeout.
  const std::string frame = setFrame("slow", std::string(560, 's'));
  for (size_t pos = 0; pos < frame.size(); pos += 40) {
    rawSend(fd, std::string_view(frame).substr(pos, 40));
    std::this_thread::sleep_for(150ms);
  }
  auto reply = rawReadFrame(fd);
  ASSERT_TRUE(reply.has_value()) << "the server cut off a client that kept sending";
  EXPECT_EQ(statusOf(*reply), static_cast<uint8_t>(proto::Status::Ok));
  ::close(fd);
  EXPECT_EQ(client(server.port())->get("slow"), std::string(560, 's'));
}

TEST(TcpStoreProcess, OversizedLengthAndUnknownCommandCloseOnlyThatConnection) {
  dt::testing::TempDir dir;
  const std::string log = (dir.path() / "server.log").string();
  ServerProcess server({{"DT_STORE_MAX_VALUE_BYTES", "1024"}}, log);
  auto good = client(server.port());
  good->set("precious", "data");

  const int big = rawConnect(server.port());
  rawSend(big, helloFrame());
  ASSERT_TRUE(rawReadFrame(big).has_value());
  const uint32_t huge = 0x7fffffff;
  rawSend(big, std::string(reinterpret_cast<const char*>(&huge), 4));
  EXPECT_TRUE(closedByPeer(big));
  ::close(big);

  const int unknown = rawConnect(server.port());
  rawSend(unknown, helloFrame());
  ASSERT_TRUE(rawReadFrame(unknown).has_value());
  std::string out;
  proto::FrameWriter(out).u8(200).finish();
  rawSend(unknown, out);
  EXPECT_TRUE(closedByPeer(unknown));
  ::close(unknown);

  // A value over the server's limit (this client's own limit is the default)
  // is refused with InvalidArgument, and the connection stays usable.
  expectThrowsWith<InvalidArgument>([&] { good->set("big", std::string(5000, 'x')); },
                                    {"value of 5000 bytes exceeds", "DT_STORE_MAX_VALUE_BYTES"});
  {
    dt::testing::ScopedEnv limit("DT_STORE_MAX_VALUE_BYTES", "1024");
    auto limited = client(server.port());
    expectThrowsWith<InvalidArgument>([&] { limited->set("big", std::string(5000, 'x')); },
                                      {"DT_STORE_MAX_VALUE_BYTES=1024"});
  }
  EXPECT_EQ(good->get("precious"), "data");
  const std::string text = readFile(log);
  EXPECT_NE(text.find("frame length 2147483647"), std::string::npos) << text;
  EXPECT_NE(text.find("unknown command 200"), std::string::npos) << text;
}

TEST(TcpStoreProcess, FuzzedFramesNeverCrashTheServerOrLoseData) {
  dt::testing::TempDir dir;
  ServerProcess server({{"DT_STORE_STALL_TIMEOUT", "300ms"}, {"DT_STORE_MAX_VALUE_BYTES", "65536"}},
                       (dir.path() / "server.log").string());
  auto good = client(server.port());
  good->set("precious", "data");
  good->add("counter", 41);
  const uint32_t seed = std::random_device{}();
  std::mt19937 rng(seed);
  SCOPED_TRACE(str("fuzz seed ", seed));
  auto randomBytes = [&](size_t n) {
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng());
    return s;
  };
  const auto deadline = Clock::now() + 3s;
  int connections = 0;
  while (Clock::now() < deadline) {
    const int fd = rawConnect(server.port());
    ASSERT_GE(fd, 0) << "the server stopped accepting";
    ++connections;
    const int mode = static_cast<int>(rng() % 5);
    if (mode != 0) rawSend(fd, helloFrame());
    for (int i = 0; i < 4; ++i) {
      std::string frame;
      switch (mode) {
        case 0:  // garbage instead of a handshake
        case 1:  // garbage after it
          frame = randomBytes(rng() % 64);
          break;
        case 2: {  // a valid header with a random command and random body
          proto::FrameWriter w(frame);
          w.u8(static_cast<uint8_t>(rng() % 20));
          frame += randomBytes(rng() % 40);
          w.finish();
          break;
        }
        case 3: {  // well-formed command, lying string lengths
          proto::FrameWriter w(frame);
          w.u8(static_cast<uint8_t>(1 + rng() % proto::kMaxCommand)).u32(static_cast<uint32_t>(rng()));
          frame += randomBytes(rng() % 16);
          w.finish();
          break;
        }
        default: {  // a valid set of an unrelated key, then a truncated frame
          frame = setFrame(str("fuzz/", rng() % 8), randomBytes(rng() % 32));
          std::string truncated = setFrame("fuzz/t", randomBytes(64));
          frame += truncated.substr(0, rng() % truncated.size());
          break;
        }
      }
      rawSend(fd, frame);
    }
    ::close(fd);
  }
  EXPECT_TRUE(server.child().alive());
  auto after = client(server.port());
  EXPECT_EQ(after->get("precious"), "data");
  EXPECT_EQ(after->add("counter", 1), 42);
  EXPECT_EQ(good->get("precious"), "data") << "an established client keeps working";
  std::printf("fuzz: %d connections, seed %u\n", connections, seed);
}

TEST(TcpStoreProcess, ClientWaitsForALateServer) {
  // Reserved, not just free: the server binds it 3 s from now (CI once lost it
  // to another test in that window).
  const PortReservation reservation;
  const uint16_t port = reservation.port();
  // Attempts are at most 1.5 s apart, so some attempt fails between 1 s (when
  // the client starts to log) and the server's start.
  ServerProcess late({}, "", port, 3000ms);
  // Capture this process's stderr (the store logger's sink) while connecting.
  dt::testing::TempDir dir;
  const std::string logPath = (dir.path() / "client.log").string();
  std::fflush(stderr);
  const int savedStderr = ::dup(2);
  const int logFd = ::open(logPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ::dup2(logFd, 2);
  const auto start = Clock::now();
  std::shared_ptr<TcpStore> store;
  try {
    store = client(port);
  } catch (...) {
    ::dup2(savedStderr, 2);
    throw;
  }
  std::fflush(stderr);
  ::dup2(savedStderr, 2);
  ::close(savedStderr);
  ::close(logFd);
  EXPECT_GE(Clock::now() - start, 1000ms);
  store->set("k", "v");
  EXPECT_EQ(store->get("k"), "v");
  const std::string log = readFile(logPath);
  EXPECT_NE(log.find(str("waiting for the store at 127.0.0.1:", port)), std::string::npos) << log;
  EXPECT_EQ(log.find("waiting for the store", log.find("waiting for the store") + 1), std::string::npos)
      << "logged more than once within 30 s: " << log;
}

TEST(TcpStoreProcess, ConnectTimeoutNamesTheAddress) {
  const PortReservation reservation;
  const uint16_t port = reservation.port();
  TcpStoreOptions options;
  options.connectTimeout = 300ms;
  const auto start = Clock::now();
  expectThrowsWith<TimeoutError>([&] { TcpStore s("127.0.0.1", port, options); },
                                 {"could not connect to the store at", str("127.0.0.1:", port), "300 ms",
                                  "refused"});
  EXPECT_LT(Clock::now() - start, 10s);
  expectThrowsWith<TimeoutError>([&] { TcpStore s("no-such-host.invalid", port, options); },
                                 {"no-such-host.invalid", "resolve"});
}

TEST(TcpStoreProcess, WaitForWorkersTimeoutNamesMissingRanks) {
  const PortReservation reservation;
  const uint16_t port = reservation.port();
  std::vector<std::unique_ptr<Child>> workers;
  for (int rank : {1, 3}) {
    workers.push_back(std::make_unique<Child>([port, rank] {
      auto store = client(port, kToken, rank);
      std::this_thread::sleep_for(5s);
    }));
  }
  TcpStoreOptions options;
  options.isServer = true;
  options.numWorkers = 4;
  options.rank = 0;
  options.token = kToken;
  options.timeout = 1500ms;
  expectThrowsWith<TimeoutError>([&] { TcpStore server("127.0.0.1", port, options); },
                                 {"waitForWorkers", "3/4 joined; missing: rank 2", str("127.0.0.1:", port)});
}

TEST(TcpStoreProcess, WaitForWorkersReturnsWhenAllJoined) {
  const PortReservation reservation;
  const uint16_t port = reservation.port();
  std::vector<std::unique_ptr<Child>> workers;
  for (int rank = 1; rank < 4; ++rank) {
    workers.push_back(std::make_unique<Child>([port, rank] {
      auto store = client(port, kToken, rank);
      store->add("joined", 1);
      store->get("release", 30s);
    }));
  }
  TcpStoreOptions options;
  options.isServer = true;
  options.numWorkers = 4;
  options.rank = 0;
  options.token = kToken;
  options.timeout = 30s;
  TcpStore server("127.0.0.1", port, options);
  server.set("release", "1");
  for (auto& w : workers) EXPECT_EQ(w->join(), 0);
}

void ignoreSignal(int) {}

TEST(TcpStoreProcess, SignalsDoNotBreakABlockingWait) {
  ServerProcess server;
  struct sigaction action{};
  action.sa_handler = ignoreSignal;  // no SA_RESTART: syscalls see EINTR
  ::sigaction(SIGUSR1, &action, nullptr);
  auto store = client(server.port());
  auto writer = client(server.port());
  std::atomic<bool> done{false};
  std::string value;
  std::thread waiter([&] {
    value = store->get("eventually", 30s);
    done = true;
  });
  const pthread_t handle = waiter.native_handle();
  for (int i = 0; i < 20 && !done; ++i) {
    ::pthread_kill(handle, SIGUSR1);
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_FALSE(done.load());
  writer->set("eventually", "arrived");
  waiter.join();
  EXPECT_EQ(value, "arrived");
}

TEST(TcpStoreProcess, ThousandConcurrentClientsRendezvous) {
  ServerProcess server;
  constexpr int kClients = 1000, kThreads = 20;
  std::vector<std::shared_ptr<TcpStore>> clients(kClients);
  dt::testing::runRanks(kThreads, [&](int t) {
    for (int i = t; i < kClients; i += kThreads) {
      clients[i] = client(server.port());
      clients[i]->add("arrived", 1);
    }
  }, 120s);
  // All 1000 connections are open at once; now all of them wait on one key.
  std::atomic<int> released{0};
  dt::testing::runRanks(kThreads, [&](int t) {
    if (t == 0) {
      clients[0]->wait({"arrived"});
      EXPECT_EQ(clients[0]->get("arrived"), std::to_string(kClients));
      clients[0]->set("go", "1");
    }
    for (int i = t; i < kClients; i += kThreads) {
      EXPECT_EQ(clients[i]->get("go", 60s), "1");
      ++released;
    }
  }, 120s);
  EXPECT_EQ(released.load(), kClients);
}

// The address a listener on `port` is bound to, from /proc/net/tcp ("0100007F"
// for 127.0.0.1, "00000000" for all interfaces); "" when not found.
std::string listeningAddress(uint16_t port) {
  std::ifstream tcp("/proc/net/tcp");
  char portHex[8];
  std::snprintf(portHex, sizeof(portHex), "%04X", port);
  std::string line;
  while (std::getline(tcp, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state;
    fields >> slot >> local >> remote >> state;
    if (state == "0A" && local.size() == 13 && local.substr(9) == portHex) return local.substr(0, 8);
  }
  return "";
}

TEST(TcpStoreProcess, LoopbackHostBindsLoopbackOnly) {
  if (!std::ifstream("/proc/net/tcp")) GTEST_SKIP() << "no /proc/net/tcp to inspect the listening address";
  TcpStoreOptions options;
  options.isServer = true;
  options.waitForWorkers = false;
  TcpStore server("127.0.0.1", 0, options);
  EXPECT_EQ(listeningAddress(server.port()), "0100007F") << "the server should listen on 127.0.0.1 only";
  // An explicit bind address wins.
  options.bindAddress = "0.0.0.0";
  TcpStore everywhere("127.0.0.1", 0, options);
  EXPECT_EQ(listeningAddress(everywhere.port()), "00000000");
}

TEST(TcpStoreProcess, ClonesDoNotCountAsWorkers) {
  TcpStoreServerOptions serverOptions;
  serverOptions.token = kToken;
  auto server = TcpStoreServer::start(serverOptions);
  auto worker = client(server->port(), kToken, 0);
  auto extra = worker->clone();
  extra->set("k", "v");
  EXPECT_EQ(server->joinedWorkers(), 1);
  auto second = client(server->port(), kToken, 1);
  EXPECT_EQ(server->joinedWorkers(), 2);
  server->waitForWorkers(2, 1s);
  expectThrowsWith<TimeoutError>([&] { server->waitForWorkers(3, 100ms); },
                                 {"2/3 joined; missing: rank 2", server->address()});
}

TEST(FileStoreProcess, ProcessesShareCountersAndBarriers) {
  dt::testing::TempDir dir;
  const std::string path = (dir.path() / "rendezvous").string();
  constexpr int kProcs = 4, kAdds = 50;
  const auto result = dt::testing::spawn(kProcs, [&](dt::testing::RankContext& ctx) {
    const int rank = ctx.rank;
    FileStore store(path);
    for (int i = 0; i < kAdds; ++i) store.add("count", 1);
    store.set(str("rank/", rank), std::to_string(rank * 10));
    storeBarrier(store, "after-adds", rank, kProcs, 30s);
    // After the barrier every rank sees every add and every rank's key.
    if (store.get("count") != std::to_string(kProcs * kAdds)) throw std::runtime_error("count mismatch");
    for (int r = 0; r < kProcs; ++r) {
      if (store.get(str("rank/", r)) != std::to_string(r * 10)) throw std::runtime_error("value mismatch");
    }
  });
  EXPECT_TRUE(dt::testing::everyRankReturned(result));
  EXPECT_EQ(FileStore(path).get("count"), std::to_string(kProcs * kAdds));
}

}  // namespace
}  // namespace dt

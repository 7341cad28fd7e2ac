// What a peer without the token can make a TcpStore server hold, and the
// server's caps: the server runs in a child process, so that its resident
// memory (/proc/<pid>/status) is its own, while this process plays attacker
// with raw sockets and, at the same time, a real client that must keep working.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "common/errors.h"
#include "common/strings.h"
#include "store/internal/protocol.h"
#include "tests/store/tcp_test_support.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using namespace store_testing;
namespace proto = store_proto;

// The first five bytes of a handshake frame that claims `length` bytes.
std::string claimHeader(uint32_t length) {
  std::string out(reinterpret_cast<const char*>(&length), 4);
  out.push_back(static_cast<char>(proto::Command::Hello));
  return out;
}

size_t countOccurrences(const std::string& text, const std::string& needle) {
  size_t count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++count;
  return count;
}

// Connections, each closed when the test ends.
struct Sockets {
  std::vector<int> fds;
  ~Sockets() {
    for (int fd : fds) ::close(fd);
  }
  int open(uint16_t port) {
    const int fd = rawConnect(port);
    if (fd >= 0) fds.push_back(fd);
    return fd;
  }
};

TEST(TcpStoreHardening, UnauthenticatedFloodKeepsServerMemoryBounded) {
  dt::testing::TempDir dir;
  const std::string log = (dir.path() / "server.log").string();
  ServerProcess server({}, log);  // every limit at its default
  const pid_t pid = server.child().pid();
  auto good = client(server.port());
  good->set("warm", std::string(4096, 'w'));
  ASSERT_EQ(good->get("warm").size(), 4096u);
  const int64_t baselinePeak = rssKiB(pid, "VmHWM");
  const int64_t baseline = rssKiB(pid, "VmRSS");
  ASSERT_GT(baselinePeak, 0) << "cannot read /proc/" << pid << "/status";

  // 200 peers claim 64 MiB frames before any handshake (five bytes each),
  // 200 more claim a 4000-byte handshake, send ten bytes of it and go quiet.
  constexpr int kLiars = 200, kStallers = 200;
  constexpr uint32_t kClaim = 64u << 20;
  Sockets liars, stallers;
  int served = 0;
  for (int i = 0; i < kLiars + kStallers; ++i) {
    if (i < kLiars) {
      const int fd = liars.open(server.port());
      ASSERT_GE(fd, 0) << "the server stopped accepting after " << i << " connections";
      rawSend(fd, claimHeader(kClaim));
    } else {
      const int fd = stallers.open(server.port());
      ASSERT_GE(fd, 0) << "the server stopped accepting after " << i << " connections";
      rawSend(fd, claimHeader(4000) + std::string(5, 'x'));
    }
    // The real client keeps working in the middle of it, and so does one
    // that has to get through the handshake now.
    if (i % 50 == 49) {
      EXPECT_EQ(good->add("progress", 1), ++served);
      good->set(str("during/", i), "ok");
      EXPECT_EQ(good->get(str("during/", i)), "ok");
      auto late = client(server.port());
      EXPECT_EQ(late->add("late", 1), served);
    }
  }
  for (int fd : liars.fds) EXPECT_TRUE(closedByPeer(fd, 10s)) << "a 64 MiB claim before the handshake stayed open";

  const int64_t peak = rssKiB(pid, "VmHWM");
  const int64_t now = rssKiB(pid, "VmRSS");
  std::printf("server RSS: %lld KiB before; after %d unauthenticated connections (%d claiming %u bytes, %d stalled): "
              "peak %lld KiB (+%lld KiB), now %lld KiB (+%lld KiB)\n",
              static_cast<long long>(baseline), kLiars + kStallers, kLiars, kClaim, kStallers,
              static_cast<long long>(peak), static_cast<long long>(peak - baselinePeak),
              static_cast<long long>(now), static_cast<long long>(now - baseline));
  constexpr int64_t kBoundKiB = 64 * 1024;
  EXPECT_LT(peak - baselinePeak, kBoundKiB) << "the server's peak RSS grew by more than 64 MiB";
  EXPECT_EQ(good->get("progress"), std::to_string(served));

  const std::string text = readFile(log);
  EXPECT_NE(text.find(str("claimed a frame of ", kClaim, " bytes before completing the handshake")),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("closing connection from 127.0.0.1:"), std::string::npos) << text;
  EXPECT_NE(text.find("DT_STORE_MAX_UNAUTHENTICATED=64"), std::string::npos) << text;
  // Hundreds of bad peers, a bounded number of lines (10 per 10 s per kind).
  EXPECT_LT(countOccurrences(text, "[warning]"), 100u) << text;
}

TEST(TcpStoreHardening, OversizedClaimBeforeHandshakeIsClosedAtOnce) {
  dt::testing::TempDir dir;
  const std::string log = (dir.path() / "server.log").string();
  // Long deadlines, so that only the claim itself can close the connection in time.
  ServerProcess server({{"DT_STORE_HANDSHAKE_TIMEOUT", "120s"}, {"DT_STORE_STALL_TIMEOUT", "120s"}}, log);
  Sockets sockets;
  const int fd = sockets.open(server.port());
  ASSERT_GE(fd, 0);
  rawSend(fd, claimHeader(proto::kMaxHandshakeBytes + 1));
  EXPECT_TRUE(closedByPeer(fd, 30s));
  // A claim within the limit is a handshake like any other.
  const int honest = sockets.open(server.port());
  rawSend(honest, helloFrame());
  auto reply = rawReadFrame(honest);
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(statusOf(*reply), static_cast<uint8_t>(proto::Status::Ok));
  const std::string text = readFile(log);
  EXPECT_NE(text.find(str("closing connection from 127.0.0.1:")), std::string::npos) << text;
  EXPECT_NE(text.find(str("claimed a frame of ", proto::kMaxHandshakeBytes + 1, " bytes")), std::string::npos)
      << text;
}

TEST(TcpStoreHardening, SilentConnectionMeetsTheHandshakeDeadline) {
  dt::testing::TempDir dir;
  const std::string log = (dir.path() / "server.log").string();
  ServerProcess server({{"DT_STORE_HANDSHAKE_TIMEOUT", "300ms"}, {"DT_STORE_STALL_TIMEOUT", "120s"}}, log);
  Sockets sockets;
  const int silent = sockets.open(server.port());
  const int partial = sockets.open(server.port());
  rawSend(partial, helloFrame().substr(0, 7));
  EXPECT_TRUE(closedByPeer(silent, 30s));
  EXPECT_TRUE(closedByPeer(partial, 30s));
  const std::string text = readFile(log);
  EXPECT_NE(text.find("sent no complete handshake within 300 ms"), std::string::npos) << text;
  EXPECT_NE(text.find("DT_STORE_HANDSHAKE_TIMEOUT"), std::string::npos) << text;
}

TEST(TcpStoreHardening, UnauthenticatedCapDropsTheOldestAndLetsRealClientsIn) {
  dt::testing::TempDir dir;
  const std::string log = (dir.path() / "server.log").string();
  ServerProcess server({{"DT_STORE_MAX_UNAUTHENTICATED", "4"},
                        {"DT_STORE_HANDSHAKE_TIMEOUT", "120s"},
                        {"DT_STORE_STALL_TIMEOUT", "120s"}},
                       log);
  auto before = client(server.port());  // authenticated: never counted, never dropped
  Sockets silent;
  const int oldest = silent.open(server.port());
  ASSERT_GE(oldest, 0);
  // Far more silent peers than the cap, then real clients: each gets in.
  for (int i = 0; i < 63; ++i) silent.open(server.port());
  EXPECT_TRUE(closedByPeer(oldest, 30s)) << "the oldest unauthenticated connection was not dropped";
  for (int i = 0; i < 5; ++i) {
    auto store = client(server.port());
    EXPECT_EQ(store->add("joined", 1), i + 1);
  }
  before->set("still", "here");
  EXPECT_EQ(before->get("still"), "here");
  const std::string text = readFile(log);
  EXPECT_NE(text.find("the cap (DT_STORE_MAX_UNAUTHENTICATED=4); closing the oldest"), std::string::npos) << text;
  // 60+ drops, a bounded number of lines.
  EXPECT_LE(countOccurrences(text, "DT_STORE_MAX_UNAUTHENTICATED=4"), 20u) << text;
}

TEST(TcpStoreHardening, BufferedInputCapQueuesLargeRequestsAndServesThemAll) {
  dt::testing::TempDir dir;
  const std::string log = (dir.path() / "server.log").string();
  // Room for one 600 KiB request at a time.
  ServerProcess server({{"DT_STORE_MAX_BUFFERED_BYTES", "1048576"}}, log);
  constexpr int kWriters = 4;
  constexpr size_t kValueBytes = 600 * 1024;
  Sockets sockets;
  std::vector<std::string> frames;
  for (int i = 0; i < kWriters; ++i) {
    const int fd = sockets.open(server.port());
    ASSERT_GE(fd, 0);
    rawSend(fd, helloFrame());
    ASSERT_TRUE(rawReadFrame(fd).has_value());
    frames.push_back(setFrame(str("big/", i), std::string(kValueBytes, static_cast<char>('a' + i))));
    // Every request has begun before any completes, so they compete for room.
    rawSend(fd, std::string_view(frames.back()).substr(0, 1000));
  }
  std::vector<uint8_t> statuses(kWriters, 0xff);
  dt::testing::runRanks(kWriters, [&](int i) {
    rawSend(sockets.fds[i], std::string_view(frames[i]).substr(1000));
    auto reply = rawReadFrame(sockets.fds[i], 60s);
    if (reply) statuses[i] = statusOf(*reply);
  }, 90s);
  auto reader = client(server.port());
  for (int i = 0; i < kWriters; ++i) {
    EXPECT_EQ(statuses[i], static_cast<uint8_t>(proto::Status::Ok)) << "writer " << i;
    EXPECT_EQ(reader->get(str("big/", i)), std::string(kValueBytes, static_cast<char>('a' + i)));
  }
  const std::string text = readFile(log);
  EXPECT_NE(text.find("the cap (DT_STORE_MAX_BUFFERED_BYTES=1048576)"), std::string::npos) << text;
}

}  // namespace
}  // namespace dt

// store_bench: TcpStore throughput and rendezvous latency, measured exactly
// like bench/peers/libtorch_store.cpp so that its RESULT lines pair with
// LibTorch's TCPStore (impl=libtorch-tcpstore) and Redis (impl=redis).
//
// kv: one server on 127.0.0.1 port 0; K client threads, each with its own
// TcpStore client (own connection), M = max(total/K, 200) ops per phase on its
// own key: set (32-byte value, acknowledged by the server), get, add. All
// threads start on a barrier; a phase ends when the last one finishes.
//   RESULT kv impl=dtrain op=set|get|add clients=K ops= time_s= ops_per_s= lat_us=
// Our set is acknowledged (one round trip each), so unlike TCPStore's one-way
// set no closing check() is needed; get is one round trip (TCPStore: two).
//
// rdzv: a fresh server; N threads parked and released together at t0; each
// constructs a client (connect + handshake), add("rdzv", 1); the one that sees
// N sets "done"; all wait({"done"}). total_ms = t0 -> last released,
// connect_ms = t0 -> last connected, release_ms = "done" set -> last released;
// median of --reps.
//   RESULT rdzv impl=dtrain n=N reps= total_ms= connect_ms= release_ms= min_total_ms=
//
// Usage: store_bench [--clients 1,16,64] [--total 40000] [--rdzv 256,1024,4096] [--reps 3]
//                    [--skip-kv] [--skip-rdzv]
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "store/tcp_store.h"

namespace {

using Clock = std::chrono::steady_clock;
using dt::TcpStore;
using dt::TcpStoreOptions;

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<int> parseList(const char* s) {
  std::vector<int> out;
  for (const char* p = s; *p;) {
    out.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return out;
}

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock lock(mutex_);
    const int generation = generation_;
    if (++count_ == n_) {
      count_ = 0;
      ++generation_;
      changed_.notify_all();
    } else {
      changed_.wait(lock, [&] { return generation != generation_; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int n_, count_ = 0, generation_ = 0;
};

std::unique_ptr<TcpStore> makeServer() {
  TcpStoreOptions o;
  o.isServer = true;
  o.waitForWorkers = false;
  o.timeout = std::chrono::seconds(120);
  o.token = "bench";
  return std::make_unique<TcpStore>("127.0.0.1", 0, o);
}

std::unique_ptr<TcpStore> makeClient(uint16_t port) {
  TcpStoreOptions o;
  o.timeout = std::chrono::seconds(120);
  o.connectTimeout = std::chrono::seconds(120);
  o.token = "bench";
  return std::make_unique<TcpStore>("127.0.0.1", port, o);
}

std::string sanitize(std::string s) {
  for (auto& c : s) {
    if (c == ' ' || c == '\n' || c == '\t' || c == '=') c = '_';
  }
  return s.substr(0, 160);
}

struct Row {
  std::string what;
  std::string value;
};
std::vector<Row> table;

void benchKv(int K, int total) {
  auto server = makeServer();
  const uint16_t port = server->port();
  std::vector<std::unique_ptr<TcpStore>> clients;
  for (int i = 0; i < K; ++i) clients.push_back(makeClient(port));
  const int M = std::max(total / K, 200);
  const char* ops[] = {"set", "get", "add"};
  Barrier barrier(K + 1);
  std::atomic<int> errors{0};
  std::string firstError;
  std::mutex errorMutex;
  std::vector<std::thread> threads;
  for (int t = 0; t < K; ++t) {
    threads.emplace_back([&, t] {
      TcpStore& s = *clients[t];
      char keys[2][32];
      std::snprintf(keys[0], sizeof(keys[0]), "s%d", t);
      std::snprintf(keys[1], sizeof(keys[1]), "a%d", t);
      const std::string skey = keys[0], akey = keys[1];
      const std::string value(32, 'x');
      for (int op = 0; op < 3; ++op) {
        barrier.wait();
        try {
          for (int i = 0; i < M; ++i) {
            if (op == 0) s.set(skey, value);
            else if (op == 1) s.get(skey);
            else s.add(akey, 1);
          }
        } catch (const std::exception& e) {
          if (errors++ == 0) {
            std::lock_guard lock(errorMutex);
            firstError = e.what();
          }
        }
        barrier.wait();
      }
    });
  }
  for (int op = 0; op < 3; ++op) {
    barrier.wait();
    const auto t0 = Clock::now();
    barrier.wait();
    const double sec = ms(Clock::now() - t0) / 1e3;
    const double opsTotal = double(K) * M;
    if (errors.load()) {
      std::printf("RESULT kv impl=dtrain op=%s clients=%d status=fail error=%s\n", ops[op], K,
                  sanitize(firstError).c_str());
    } else {
      std::printf("RESULT kv impl=dtrain op=%s clients=%d ops=%.0f time_s=%.3f ops_per_s=%.0f lat_us=%.1f\n", ops[op],
                  K, opsTotal, sec, opsTotal / sec, K / (opsTotal / sec) * 1e6);
      char value[96];
      std::snprintf(value, sizeof(value), "%9.0f ops/s  %7.1f us/op", opsTotal / sec, K / (opsTotal / sec) * 1e6);
      char what[64];
      std::snprintf(what, sizeof(what), "%s x%d clients", ops[op], K);
      table.push_back({what, value});
    }
    std::fflush(stdout);
  }
  for (auto& t : threads) t.join();
}

struct RdzvResult {
  bool ok = true;
  std::string error;
  double totalMs = 0, connectMs = 0, releaseMs = 0;
};

RdzvResult rdzvOnce(int N) {
  RdzvResult r;
  auto server = makeServer();
  const uint16_t port = server->port();
  std::vector<std::unique_ptr<TcpStore>> clients(N);
  std::vector<Clock::time_point> tConnected(N), tReleased(N);
  Clock::time_point t0, tDone;
  std::mutex mutex;
  std::condition_variable cv;
  int parked = 0;
  bool go = false;
  std::atomic<int> errors{0};
  std::string firstError;
  std::vector<std::thread> threads;
  threads.reserve(N);
  try {
    for (int i = 0; i < N; ++i) {
      threads.emplace_back([&, i] {
        {
          std::unique_lock lock(mutex);
          ++parked;
          cv.notify_all();
          cv.wait(lock, [&] { return go; });
        }
        try {
          auto c = makeClient(port);
          tConnected[i] = Clock::now();
          if (c->add("rdzv", 1) == N) {
            tDone = Clock::now();
            c->set("done", "1");
          }
          c->wait({"done"});
          tReleased[i] = Clock::now();
          clients[i] = std::move(c);
        } catch (const std::exception& e) {
          std::lock_guard lock(mutex);
          if (errors++ == 0) firstError = e.what();
        }
      });
    }
  } catch (const std::exception& e) {
    r.ok = false;
    r.error = "thread creation failed after " + std::to_string(threads.size()) + ": " + e.what();
  }
  {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return parked == static_cast<int>(threads.size()); });
    t0 = Clock::now();
    go = true;
  }
  cv.notify_all();
  for (auto& t : threads) t.join();
  if (!r.ok) return r;
  if (errors.load()) {
    r.ok = false;
    r.error = std::to_string(errors.load()) + " of " + std::to_string(N) + " clients failed: " + firstError;
    return r;
  }
  r.totalMs = ms(*std::max_element(tReleased.begin(), tReleased.end()) - t0);
  r.connectMs = ms(*std::max_element(tConnected.begin(), tConnected.end()) - t0);
  r.releaseMs = ms(*std::max_element(tReleased.begin(), tReleased.end()) - tDone);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> kvClients = {1, 16, 64}, rdzvN = {256, 1024, 4096};
  int total = 40000, reps = 3;
  bool doKv = true, doRdzv = true;
  for (int i = 1; i < argc; ++i) {
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    if (!std::strcmp(argv[i], "--clients")) kvClients = parseList(next());
    else if (!std::strcmp(argv[i], "--total")) total = std::atoi(next());
    else if (!std::strcmp(argv[i], "--rdzv")) rdzvN = parseList(next());
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(next());
    else if (!std::strcmp(argv[i], "--skip-kv")) doKv = false;
    else if (!std::strcmp(argv[i], "--skip-rdzv")) doRdzv = false;
    else {
      std::fprintf(stderr,
                   "usage: store_bench [--clients 1,16,64] [--total 40000] [--rdzv 256,1024,4096] [--reps 3] "
                   "[--skip-kv] [--skip-rdzv]\n");
      return 2;
    }
  }
  rlimit limit{};
  getrlimit(RLIMIT_NOFILE, &limit);
  limit.rlim_cur = limit.rlim_max;
  setrlimit(RLIMIT_NOFILE, &limit);

  if (doKv) {
    for (int K : kvClients) benchKv(K, total);
  }
  if (doRdzv) {
    int largestOk = 0;
    for (int N : rdzvN) {
      std::vector<double> tot, con, rel;
      std::string error;
      for (int r = 0; r < reps && error.empty(); ++r) {
        auto res = rdzvOnce(N);
        if (!res.ok) error = res.error;
        else {
          tot.push_back(res.totalMs);
          con.push_back(res.connectMs);
          rel.push_back(res.releaseMs);
        }
      }
      if (!error.empty()) {
        std::printf("RESULT rdzv impl=dtrain n=%d status=fail largest_ok=%d error=%s\n", N, largestOk,
                    sanitize(error).c_str());
      } else {
        largestOk = N;
        std::printf("RESULT rdzv impl=dtrain n=%d reps=%d total_ms=%.2f connect_ms=%.2f release_ms=%.2f "
                    "min_total_ms=%.2f\n",
                    N, reps, median(tot), median(con), median(rel), *std::min_element(tot.begin(), tot.end()));
        char value[96];
        std::snprintf(value, sizeof(value), "%9.1f ms total (connect %.1f, release %.1f)", median(tot), median(con),
                      median(rel));
        char what[64];
        std::snprintf(what, sizeof(what), "rendezvous n=%d", N);
        table.push_back({what, value});
      }
      std::fflush(stdout);
    }
  }
  std::printf("\n# dtrain TcpStore (127.0.0.1, 32-byte values, one connection per client)\n");
  for (const auto& row : table) std::printf("#   %-24s %s\n", row.what.c_str(), row.value.c_str());
  return 0;
}

// etcd_bench: the etcd rendezvous and EtcdStore's operations against TcpStore,
// in the same run (bench/run_etcd_bench.sh starts the etcd members).
//
// rdzv: N simulated nodes (threads), released together at t0, each running
// what its dtrun does to meet the others:
//   tcpstore: node 0 hosts a TcpStore server (started at t0, like node 0's
//     dtrun); every node connects, bumps its heartbeat, claims
//     dtrun/a0/node/<i> with compareSet and polls check() of all claims every
//     50 ms (dtrun's static loop), then multiGet()s them;
//   etcd: every node opens an EtcdStore, grants its lease, enters the round,
//     claims its slot bound to the lease, marks the attempt full if its claim
//     was the last and waits for "full" by watch, then multiGet()s the claims
//     (launcher/etcd_rendezvous.h, as dtrun --rdzv-backend etcd).
//   total_ms = t0 -> the last node has everyone's claims; median of --reps.
//   RESULT rdzv impl=tcpstore|etcd n=N reps= total_ms= min_total_ms=
// kv: one client, --ops sequential set (32-byte value), get, add on its own key.
//   RESULT kv impl=tcpstore|etcd op=set|get|add clients=1 ops= lat_us=
// Then RATIO lines etcd / tcpstore (above 1: etcd slower).
//
// Usage: etcd_bench --etcd host:port[,...] [--rdzv 8,64,256] [--reps 3] [--ops 2000]
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"
#include "launcher/etcd_rendezvous.h"
#include "store/etcd_store.h"
#include "store/tcp_store.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

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

// Releases N threads together; returns t0.
struct StartLine {
  std::mutex mutex;
  std::condition_variable cv;
  bool go = false;
  Clock::time_point t0;
  void wait() {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return go; });
  }
  void release() {
    {
      std::lock_guard lock(mutex);
      t0 = Clock::now();
      go = true;
    }
    cv.notify_all();
  }
};

std::string claimValue(int node) { return dt::str(1, "\t", "host", node, "\t", node); }

double rdzvTcp(int n) {
  StartLine start;
  std::atomic<uint16_t> port{0};
  std::vector<Clock::time_point> done(static_cast<size_t>(n));
  std::vector<std::thread> nodes;
  std::shared_ptr<dt::TcpStore> server;
  for (int node = 0; node < n; ++node) {
    nodes.emplace_back([&, node] {
      start.wait();
      dt::TcpStoreOptions o;
      o.token = "bench";
      o.rank = node;
      std::shared_ptr<dt::TcpStore> store;
      if (node == 0) {
        o.isServer = true;
        o.waitForWorkers = false;
        store = std::make_shared<dt::TcpStore>("127.0.0.1", 0, o);
        port = store->port();
        server = store;
      } else {
        while (port.load() == 0) std::this_thread::sleep_for(1ms);  // node 0's address is known in advance in dtrun
        store = std::make_shared<dt::TcpStore>("127.0.0.1", port.load(), o);
      }
      store->add(dt::str("dtrun/hb/", node), 1);
      store->compareSet(dt::str("dtrun/a0/node/", node), "", claimValue(node));
      std::vector<std::string> keys;
      for (int i = 0; i < n; ++i) keys.push_back(dt::str("dtrun/a0/node/", i));
      while (!store->check(keys)) std::this_thread::sleep_for(50ms);
      store->multiGet(keys);
      done[static_cast<size_t>(node)] = Clock::now();
    });
  }
  std::this_thread::sleep_for(20ms);
  start.release();
  for (auto& t : nodes) t.join();
  return ms(*std::max_element(done.begin(), done.end()) - start.t0);
}

double rdzvEtcd(const std::string& endpoints, int n, int rep) {
  StartLine start;
  std::vector<Clock::time_point> done(static_cast<size_t>(n));
  // Every node keeps its lease (and so its claim) until all are done, as a running dtrun does.
  std::vector<std::unique_ptr<dt::launcher::EtcdRendezvous>> keep(static_cast<size_t>(n));
  std::vector<std::thread> nodes;
  const std::string job = dt::str("/dtrain/bench-", ::getpid(), "-", n, "-", rep);
  std::atomic<int> failures{0};
  for (int node = 0; node < n; ++node) {
    nodes.emplace_back([&, node] {
      start.wait();
      try {
        dt::EtcdStoreOptions o;
        o.endpoints = endpoints;
        o.prefix = job;
        auto store = std::make_shared<dt::EtcdStore>(o);
        auto& slot = keep[static_cast<size_t>(node)];
        slot = std::make_unique<dt::launcher::EtcdRendezvous>(store, store->grantLease(10s));
        auto& rdzv = *slot;
        auto round = rdzv.enterRound();
        std::string holder;
        rdzv.claim(0, node, n, claimValue(node), holder);
        rdzv.markIfFull(0, n);
        while (true) {
          try {
            round->wait({dt::launcher::EtcdRendezvous::fullKey(0)}, 500ms);
            break;
          } catch (const dt::TimeoutError&) {
          }
        }
        std::vector<std::string> keys;
        for (int i = 0; i < n; ++i) keys.push_back(dt::launcher::EtcdRendezvous::nodeKey(0, i));
        round->multiGet(keys);
        done[static_cast<size_t>(node)] = Clock::now();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "etcd node %d: %s\n", node, e.what());
        ++failures;
      }
    });
  }
  std::this_thread::sleep_for(20ms);
  start.release();
  for (auto& t : nodes) t.join();
  if (failures) return -1;
  return ms(*std::max_element(done.begin(), done.end()) - start.t0);
}

template <typename Fn>
double latencyUs(int ops, Fn&& fn) {
  const auto t0 = Clock::now();
  for (int i = 0; i < ops; ++i) fn(i);
  return ms(Clock::now() - t0) * 1000.0 / ops;
}

std::map<std::string, double> kvOps(dt::Store& store, int ops) {
  const std::string value(32, 'v');
  std::map<std::string, double> out;
  out["set"] = latencyUs(ops, [&](int) { store.set("bench/key", value); });
  out["get"] = latencyUs(ops, [&](int) { store.get("bench/key"); });
  out["add"] = latencyUs(ops, [&](int) { store.add("bench/counter", 1); });
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string endpoints;
  std::vector<int> rdzvN = {8, 64, 256};
  int reps = 3, ops = 2000;
  for (int i = 1; i < argc; ++i) {
    auto next = [&] {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    if (!std::strcmp(argv[i], "--etcd")) endpoints = next();
    else if (!std::strcmp(argv[i], "--rdzv")) rdzvN = parseList(next());
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(next());
    else if (!std::strcmp(argv[i], "--ops")) ops = std::atoi(next());
    else {
      std::fprintf(stderr, "usage: etcd_bench --etcd host:port[,...] [--rdzv 8,64,256] [--reps 3] [--ops 2000]\n");
      return 2;
    }
  }
  if (endpoints.empty()) {
    std::fprintf(stderr, "etcd_bench: --etcd host:port is required (bench/run_etcd_bench.sh starts members)\n");
    return 2;
  }
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
  std::map<std::string, double> ratios;
  std::printf("%-10s %6s %14s %14s %8s\n", "rdzv", "nodes", "tcpstore ms", "etcd ms", "ratio");
  for (int n : rdzvN) {
    std::vector<double> tcp, etcd;
    for (int rep = 0; rep < reps; ++rep) {  // interleaved: machine noise hits both
      tcp.push_back(rdzvTcp(n));
      etcd.push_back(rdzvEtcd(endpoints, n, rep));
    }
    const double t = median(tcp), e = median(etcd);
    std::printf("%-10s %6d %14.1f %14.1f %8.2f\n", "", n, t, e, e / t);
    std::printf("RESULT rdzv impl=tcpstore n=%d reps=%d total_ms=%.2f min_total_ms=%.2f\n", n, reps, t,
                *std::min_element(tcp.begin(), tcp.end()));
    std::printf("RESULT rdzv impl=etcd n=%d reps=%d total_ms=%.2f min_total_ms=%.2f\n", n, reps, e,
                *std::min_element(etcd.begin(), etcd.end()));
    ratios[dt::str("rdzv n=", n, " total_ms")] = e / t;
  }
  dt::TcpStoreOptions server;
  server.isServer = true;
  server.waitForWorkers = false;
  server.token = "bench";
  dt::TcpStore tcpServer("127.0.0.1", 0, server);
  dt::TcpStoreOptions client;
  client.token = "bench";
  dt::TcpStore tcp("127.0.0.1", tcpServer.port(), client);
  dt::EtcdStoreOptions eo;
  eo.endpoints = endpoints;
  eo.prefix = dt::str("/dtrain/bench-kv-", ::getpid());
  dt::EtcdStore etcd(eo);
  std::vector<std::map<std::string, double>> tcpRuns, etcdRuns;
  for (int rep = 0; rep < reps; ++rep) {
    tcpRuns.push_back(kvOps(tcp, ops));
    etcdRuns.push_back(kvOps(etcd, ops));
  }
  std::printf("\n%-10s %14s %14s %8s\n", "op", "tcpstore us", "etcd us", "ratio");
  for (const char* op : {"set", "get", "add"}) {
    std::vector<double> t, e;
    for (auto& r : tcpRuns) t.push_back(r[op]);
    for (auto& r : etcdRuns) e.push_back(r[op]);
    const double tm = median(t), em = median(e);
    std::printf("%-10s %14.1f %14.1f %8.1f\n", op, tm, em, em / tm);
    std::printf("RESULT kv impl=tcpstore op=%s clients=1 ops=%d lat_us=%.2f\n", op, ops, tm);
    std::printf("RESULT kv impl=etcd op=%s clients=1 ops=%d lat_us=%.2f\n", op, ops, em);
    ratios[dt::str("kv op=", op, " lat_us")] = em / tm;
  }
  std::printf("\n");
  for (const auto& [what, ratio] : ratios) std::printf("RATIO %s etcd/tcpstore=%.2f\n", what.c_str(), ratio);
  return 0;
}

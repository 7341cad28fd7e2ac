// LibTorch peer for bench/store_bench: c10d::TCPStore, the store torchrun and
// init_method="env://" rendezvous through, measured the way store_bench measures dtrain.
//
// kv: one server on 127.0.0.1, port 0 (read back with getPort()); K client threads
// (--clients, default 1,16,64), each with its own TCPStore client and so its own
// connection, all made before timing. Three phases, set (32-byte value), get, add; in each
// every thread does M = max(total / K, 200) ops on a key of its own. The threads start on
// a barrier; the phase lasts until the last one is done.
//   RESULT kv impl=libtorch-tcpstore op=set|get|add clients=K ops=K*M time_s=.. ops_per_s=.. lat_us=K/ops_per_s
// Two protocol facts to read the numbers by: TCPStore's SET gets no reply, so set()
// returns once the request is written and a client's sets pipeline; each thread ends its
// set phase with one check() on the same connection (answered after the server has
// applied every earlier set), so the phase covers the server's work. get() is a WAIT and
// a GET, two round trips.
//
// rdzv: for each N (--rdzv, default 64,256,1024) and each of --reps repetitions: a fresh
// server; N threads are started and parked; at t0 all are released. Each one constructs
// its client (a store connection, plus a callback connection with its own thread),
// add("rdzv", 1); the one that reads N sets "done"; all wait({"done"}).
//   total_ms   t0 -> the last thread released from its wait
//   connect_ms t0 -> the last client constructed
//   release_ms "done" set -> the last thread released
//   RESULT rdzv impl=libtorch-tcpstore n=N reps=R total_ms=.. connect_ms=.. release_ms=.. min_total_ms=..
// (medians over the repetitions; min_total_ms the smallest total). When a size cannot be
// done (fd limit, thread creation, timeouts) it prints
//   RESULT rdzv impl=libtorch-tcpstore n=N status=fail largest_ok=<last N that worked> error=<reason>
// and goes on. A client costs 2 sockets, 2 pipe fds and a thread here, and 2 sockets in the
// server, so the soft RLIMIT_NOFILE is raised to the hard limit first.
//
// usage: libtorch_store [--clients 1,16,64] [--total 40000] [--rdzv 64,256,1024] [--reps 3]
//                       [--skip-kv] [--skip-rdzv]
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using Store = c10d::TCPStore;

double millis(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

double medianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t mid = v.size() / 2;
  return v.size() % 2 == 1 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
}

std::vector<int> intList(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(std::stoi(item));
  return out;
}

// A RESULT value is one token: no blanks, no '='.
std::string token(const std::string& text) {
  std::string out = text.substr(0, 160);
  std::replace_if(out.begin(), out.end(), [](char c) { return c == ' ' || c == '=' || c == '\t' || c == '\n'; }, '_');
  return out;
}

std::unique_ptr<Store> openStore(bool server, uint16_t port) {
  c10d::TCPStoreOptions opts;
  opts.port = port;
  opts.isServer = server;
  opts.waitWorkers = false;  // no worker count: nothing waits for "init/" arrivals
  opts.timeout = std::chrono::seconds(120);
  return std::make_unique<Store>("127.0.0.1", opts);
}

// Threads that meet here wait until `parties` of them have arrived; reusable.
class Meeting {
 public:
  explicit Meeting(int parties) : parties_(parties) {}
  void arriveAndWait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const long round = round_;
    if (++arrived_ == parties_) {
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return round_ != round; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  const int parties_;
  int arrived_ = 0;
  long round_ = 0;
};

void kvBench(int clients, int total) {
  const std::unique_ptr<Store> server = openStore(true, 0);
  std::vector<std::unique_ptr<Store>> conns;
  for (int c = 0; c < clients; ++c) conns.push_back(openStore(false, server->getPort()));
  const int perClient = std::max(total / clients, 200);
  const char* const opNames[3] = {"set", "get", "add"};

  Meeting meeting(clients + 1);  // the client threads and the timing thread
  std::mutex errorMutex;
  std::string errors[3];
  std::vector<std::thread> workers;
  for (int c = 0; c < clients; ++c) {
    workers.emplace_back([&, c] {
      Store& store = *conns[c];
      const std::string key = "k" + std::to_string(c), counter = "n" + std::to_string(c);
      const std::vector<uint8_t> value(32, 'v');
      for (int op = 0; op < 3; ++op) {
        meeting.arriveAndWait();
        try {
          for (int i = 0; i < perClient; ++i) {
            if (op == 0) store.set(key, value);
            else if (op == 1) (void)store.get(key);
            else (void)store.add(counter, 1);
          }
          if (op == 0) (void)store.check({key});  // the round trip that closes the pipelined sets
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(errorMutex);
          if (errors[op].empty()) errors[op] = e.what();
        }
        meeting.arriveAndWait();
      }
    });
  }
  for (int op = 0; op < 3; ++op) {
    meeting.arriveAndWait();
    const Clock::time_point start = Clock::now();
    meeting.arriveAndWait();
    const double secs = millis(start, Clock::now()) / 1e3;
    const double ops = static_cast<double>(clients) * perClient;
    std::string error;
    {
      std::lock_guard<std::mutex> lock(errorMutex);
      error = errors[op];
    }
    if (!error.empty()) {
      std::printf("RESULT kv impl=libtorch-tcpstore op=%s clients=%d status=fail error=%s\n", opNames[op], clients,
                  token(error).c_str());
    } else {
      const double rate = ops / secs;
      std::printf("RESULT kv impl=libtorch-tcpstore op=%s clients=%d ops=%.0f time_s=%.3f ops_per_s=%.0f lat_us=%.1f\n",
                  opNames[op], clients, ops, secs, rate, clients / rate * 1e6);
    }
    std::fflush(stdout);
  }
  for (std::thread& w : workers) w.join();
}

struct RdzvTimes {
  std::string error;  // empty: it worked
  double total = 0, connect = 0, release = 0;
};

RdzvTimes rdzvOnce(int n) {
  RdzvTimes out;
  const std::unique_ptr<Store> server = openStore(true, 0);
  const uint16_t port = server->getPort();
  std::vector<std::unique_ptr<Store>> kept(n);  // closed after the measurement
  std::vector<Clock::time_point> connected(n), released(n);
  Clock::time_point t0, doneAt;

  std::mutex mutex;
  std::condition_variable cv;
  int parked = 0, failures = 0;
  bool go = false;
  std::string firstError;

  std::vector<std::thread> threads;
  threads.reserve(n);
  try {
    for (int i = 0; i < n; ++i) {
      threads.emplace_back([&, i] {
        {
          std::unique_lock<std::mutex> lock(mutex);
          ++parked;
          cv.notify_all();
          cv.wait(lock, [&] { return go; });
        }
        try {
          std::unique_ptr<Store> client = openStore(false, port);
          connected[i] = Clock::now();
          if (client->add("rdzv", 1) == n) {
            doneAt = Clock::now();
            client->set("done", {'1'});
          }
          client->wait({"done"});
          released[i] = Clock::now();
          kept[i] = std::move(client);
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mutex);
          if (failures++ == 0) firstError = e.what();
        }
      });
    }
  } catch (const std::exception& e) {
    out.error = "could not start thread " + std::to_string(threads.size() + 1) + ": " + e.what();
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return parked == static_cast<int>(threads.size()); });
    t0 = Clock::now();
    go = true;
  }
  cv.notify_all();
  for (std::thread& t : threads) t.join();
  if (!out.error.empty()) return out;
  if (failures > 0) {
    out.error = std::to_string(failures) + "/" + std::to_string(n) + " clients failed: " + firstError;
    return out;
  }
  out.connect = millis(t0, *std::max_element(connected.begin(), connected.end()));
  const Clock::time_point lastRelease = *std::max_element(released.begin(), released.end());
  out.total = millis(t0, lastRelease);
  out.release = millis(doneAt, lastRelease);
  return out;
}

void rdzvBench(const std::vector<int>& sizes, int reps) {
  int largestOk = 0;
  for (int n : sizes) {
    std::vector<double> total, connect, release;
    std::string error;
    for (int r = 0; r < reps && error.empty(); ++r) {
      const RdzvTimes t = rdzvOnce(n);
      error = t.error;
      if (error.empty()) {
        total.push_back(t.total);
        connect.push_back(t.connect);
        release.push_back(t.release);
      }
    }
    if (!error.empty()) {
      std::printf("RESULT rdzv impl=libtorch-tcpstore n=%d status=fail largest_ok=%d error=%s\n", n, largestOk,
                  token(error).c_str());
    } else {
      largestOk = n;
      std::printf("RESULT rdzv impl=libtorch-tcpstore n=%d reps=%d total_ms=%.2f connect_ms=%.2f release_ms=%.2f "
                  "min_total_ms=%.2f\n",
                  n, reps, medianOf(total), medianOf(connect), medianOf(release),
                  *std::min_element(total.begin(), total.end()));
    }
    std::fflush(stdout);
  }
}

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: libtorch_store [--clients 1,16,64] [--total 40000] [--rdzv 64,256,1024] [--reps 3] "
               "[--skip-kv] [--skip-rdzv]\n");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> clientCounts{1, 16, 64}, rdzvSizes{64, 256, 1024};
  int total = 40000, reps = 3;
  bool kv = true, rdzv = true;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    if (arg == "--clients") clientCounts = intList(value());
    else if (arg == "--total") total = std::stoi(value());
    else if (arg == "--rdzv") rdzvSizes = intList(value());
    else if (arg == "--reps") reps = std::max(1, std::stoi(value()));
    else if (arg == "--skip-kv") kv = false;
    else if (arg == "--skip-rdzv") rdzv = false;
    else usage();
  }

  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0) {
    files.rlim_cur = files.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &files);
    (void)getrlimit(RLIMIT_NOFILE, &files);
  }
  std::fprintf(stderr, "libtorch_store: open-file limit %llu\n", static_cast<unsigned long long>(files.rlim_cur));

  if (kv)
    for (int k : clientCounts) kvBench(k, total);
  if (rdzv) rdzvBench(rdzvSizes, reps);
  return 0;
}

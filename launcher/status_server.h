// The HTTP side of dtrun's live status page (`dtrun --status-port`, docs/debugging.md "The live
// status page"): a small HTTP/1.1 server on a thread of its own.
//
// Routes (GET or HEAD; anything else 405, an unknown path 404):
//   /             the page (launcher/status_page/index.html, built into dtrun)
//   /chart.js     Chart.js as Debian's libjs-chart.js installs it (read once, at construction)
//   /status.json  Config::json()
//   /metrics      Config::metrics(), as Prometheus' text format (version 0.0.4)
//
// Contract:
//  * The constructor binds and listens before it returns, so the port it reports is ready; a
//    port in use, an address that is not this machine's or a missing Chart.js throw dt::Error
//    with one line naming the port, the address or the file (and the package that installs it).
//  * Config::token non-empty: every request must carry it, as `?token=<token>` or
//    `Authorization: Bearer <token>` (what a Prometheus scrape config can send); others get 403.
//  * One thread serves every connection (poll(), non-blocking sockets; each response closes its
//    connection). A request's head is limited to 16 KiB and a connection to 10 s; a client
//    that breaks either is dropped with nothing but its own connection lost. At most 64
//    connections at once: more are closed as they come.
//  * The json/metrics callbacks run on the server's thread and must be thread-safe with the
//    caller's (StatusCollector::view() is).
//  * The destructor stops the thread and closes every socket.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace dt::launcher {

// Where Debian's libjs-chart.js puts Chart.js (scripts/setup.sh installs it).
constexpr const char* kChartJsPath = "/usr/share/javascript/chart.js/chart.min.js";

// Whether `address` is a loopback address ("127.x.y.z", "::1", "localhost").
bool isLoopbackAddress(const std::string& address);

// "/status.json?token=abc" -> path "/status.json", the token's value "abc" ("" when absent).
struct RequestTarget {
  std::string path;
  std::string token;
};
RequestTarget parseTarget(const std::string& target);

class StatusServer {
 public:
  struct Config {
    std::string bind = "127.0.0.1";
    int port = 0;                 // 0: any free port
    std::string token;            // "": none required
    std::string chartJsPath = kChartJsPath;
    std::function<std::string()> json;
    std::function<std::string()> metrics;
  };
  explicit StatusServer(Config config);
  ~StatusServer();
  StatusServer(const StatusServer&) = delete;
  StatusServer& operator=(const StatusServer&) = delete;

  uint16_t port() const;
  // "http://127.0.0.1:8080/" (with "?token=..." when one is required).
  std::string url() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The page's HTML as built into dtrun (launcher/status_page/index.html).
std::string_view statusPageHtml();

}  // namespace dt::launcher

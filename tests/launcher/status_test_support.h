// Test helpers for dtrun's status page (launcher/status.h, launcher/status_server.h): a plain
// HTTP GET over a socket, and a strict reader of Prometheus' text format, so that a test
// checks what a scraper would accept rather than a few substrings.
//
// Contract: httpGet blocks for at most `timeout` (connect, send, read to the end) and reports
// a failure as status -1 with the reason in `body`; parsePrometheusText throws
// std::runtime_error naming the line and what is wrong with it. Header-only, thread-compatible.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <regex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace dt::testing {

struct HttpReply {
  int status = -1;
  std::string headers;
  std::string body;
};

inline HttpReply httpGet(uint16_t port, const std::string& target, const std::string& extraHeaders = "",
                         std::chrono::milliseconds timeout = std::chrono::seconds(30), const std::string& method = "GET") {
  HttpReply reply;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    reply.body = std::string("connect: ") + std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return reply;
  }
  const std::string request = method + " " + target + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extraHeaders + "\r\n";
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(request.size())) {
    reply.body = std::string("send: ") + std::strerror(errno);
    ::close(fd);
    return reply;
  }
  std::string raw;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) {
      reply.body = "timed out reading the reply; read so far: " + raw;
      ::close(fd);
      return reply;
    }
    char buf[65536];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    raw.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  const auto end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.1 ", 0) != 0 || end == std::string::npos) {
    reply.body = "not an HTTP reply: " + raw.substr(0, 200);
    return reply;
  }
  reply.status = std::atoi(raw.c_str() + 9);
  reply.headers = raw.substr(0, end);
  reply.body = raw.substr(end + 4);
  return reply;
}

struct PrometheusSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Every line is a "# HELP name text", a "# TYPE name type" (before the family's first sample,
// once), another comment, or a sample `name{label="value",...} value [timestamp]` whose name
// has a TYPE.
inline std::vector<PrometheusSample> parsePrometheusText(const std::string& text) {
  static const std::regex name(R"([a-zA-Z_:][a-zA-Z0-9_:]*)");
  static const std::regex help(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .*)");
  static const std::regex type(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped))");
  static const std::regex label(R"(([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)\"(,|$))");
  std::set<std::string> typed;
  std::vector<PrometheusSample> samples;
  if (!text.empty() && text.back() != '\n') throw std::runtime_error("the text does not end with a newline");
  size_t lineNo = 0, start = 0;
  while (start < text.size()) {
    const size_t end = text.find('\n', start);
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    ++lineNo;
    auto bad = [&](const std::string& why) { return std::runtime_error("line " + std::to_string(lineNo) + " (" + line + "): " + why); };
    std::smatch m;
    if (line.empty()) continue;
    if (line.rfind("# TYPE ", 0) == 0) {
      if (!std::regex_match(line, m, type)) throw bad("a malformed TYPE line");
      if (!typed.insert(m[1]).second) throw bad("a second TYPE for the same metric");
      continue;
    }
    if (line.rfind("# HELP ", 0) == 0) {
      if (!std::regex_match(line, m, help)) throw bad("a malformed HELP line");
      continue;
    }
    if (line[0] == '#') continue;
    PrometheusSample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = line.substr(0, i);
    if (!std::regex_match(s.name, name)) throw bad("a malformed metric name");
    if (!typed.count(s.name)) throw bad("a sample of a metric without a TYPE line before it");
    if (i < line.size() && line[i] == '{') {
      const size_t close = line.find("} ", i);
      if (close == std::string::npos) throw bad("labels without a closing brace and a value");
      std::string labels = line.substr(i + 1, close - i - 1);
      while (!labels.empty()) {
        if (!std::regex_search(labels, m, label) || m.position(0) != 0) throw bad("a malformed label in {" + labels + "}");
        if (!s.labels.emplace(m[1], m[2]).second) throw bad("a label given twice");
        labels = m.suffix();
      }
      i = close + 1;
    }
    if (i >= line.size() || line[i] != ' ') throw bad("no value after the name");
    const std::string rest = line.substr(i + 1);
    const std::string valueText = rest.substr(0, rest.find(' '));
    char* stop = nullptr;
    s.value = std::strtod(valueText.c_str(), &stop);
    if (valueText.empty() || *stop != '\0') throw bad("the value " + valueText + " is not a number");
    if (rest.find(' ') != std::string::npos) {
      const std::string stamp = rest.substr(rest.find(' ') + 1);
      if (stamp.empty() || stamp.find_first_not_of("-0123456789") != std::string::npos) throw bad("a malformed timestamp");
    }
    samples.push_back(std::move(s));
  }
  return samples;
}

}  // namespace dt::testing

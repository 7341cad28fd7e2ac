#include "tests/store/etcd_test_support.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "common/strings.h"
#include "store/internal/etcd_client.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

// n distinct free loopback ports (all bound at once, then released).
std::vector<int> freePorts(int n) {
  std::vector<int> fds, ports;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(addr);
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
      throw Error("etcd test: cannot bind a loopback socket to find a free port");
    }
    fds.push_back(fd);
    ports.push_back(ntohs(addr.sin_port));
  }
  for (int fd : fds) ::close(fd);
  return ports;
}

int run(const std::string& command) { return std::system((command + " >/dev/null 2>&1").c_str()); }

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

[[noreturn]] void fail(const std::string& message) {
  ADD_FAILURE() << message;
  throw Error(message);
}

}  // namespace

std::string findEtcd(std::string& why) {
  for (const char* path : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
    if (::access(path, X_OK) == 0) return path;
  }
  why = "etcd is not installed (no /usr/bin/etcd): run scripts/setup.sh, which installs Debian's etcd-server";
  return "";
}

EtcdCluster::EtcdCluster(EtcdClusterOptions options) : options_(options) {
  std::string pattern = (fs::temp_directory_path() / "dtrain-etcd-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) fail("etcd test: mkdtemp failed");
  dir_ = pattern;
  // tmpfs: etcd fsyncs every write, which on a disk would dominate the tests' time.
  dataRoot_ = fs::exists("/dev/shm") ? str("/dev/shm/dtrain-etcd-", getpid(), "-", dir_.filename().string())
                                     : (dir_ / "data").string();
  if (options_.tls) makeCertificates();
  std::string why;
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (start(why)) {
      if (options_.auth) enableAuth();
      return;
    }
    stopAll();  // a port taken between finding and binding it: try others
  }
  fail("could not start etcd: " + why);
}

EtcdCluster::~EtcdCluster() {
  stopAll();
  std::error_code ec;
  fs::remove_all(dataRoot_, ec);
  fs::remove_all(dir_, ec);
}

void EtcdCluster::stopAll() {
  for (auto& m : members_) {
    if (m.pid > 0) {
      ::kill(m.pid, SIGKILL);
      ::waitpid(m.pid, nullptr, 0);
      m.pid = -1;
    }
  }
}

void EtcdCluster::kill(int member) {
  Member& m = members_.at(static_cast<size_t>(member));
  if (m.pid <= 0) return;
  ::kill(m.pid, SIGKILL);
  ::waitpid(m.pid, nullptr, 0);
  m.pid = -1;
}

std::string EtcdCluster::endpoint(int member) const {
  return str(options_.tls ? "https" : "http", "://127.0.0.1:", members_.at(static_cast<size_t>(member)).clientPort);
}

std::string EtcdCluster::endpoints() const {
  std::vector<std::string> urls;
  for (int i = 0; i < size(); ++i) urls.push_back(endpoint(i));
  return join(urls, ",");
}

std::string EtcdCluster::logTail(int member) const {
  const std::string text = readFile(members_.at(static_cast<size_t>(member)).log);
  return text.size() > 3000 ? text.substr(text.size() - 3000) : text;
}

EtcdStoreOptions EtcdCluster::storeOptions(const std::string& prefix) const {
  EtcdStoreOptions o;
  o.endpoints = endpoints();
  o.prefix = prefix;
  o.connectTimeout = 20s;
  if (options_.tls) {
    o.caFile = certs_.ca;
    o.certFile = certs_.clientCert;
    o.keyFile = certs_.clientKey;
  }
  if (options_.auth) {
    o.user = kUser;
    o.password = kPassword;
  }
  return o;
}

void EtcdCluster::makeCertificates() {
  if (::access("/usr/bin/openssl", X_OK) != 0) fail("openssl is not installed: run scripts/setup.sh");
  const fs::path d = dir_ / "certs";
  fs::create_directories(d);
  auto p = [&](const char* name) { return (d / name).string(); };
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  std::ofstream(p("server.ext")) << "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n";
  std::ofstream(p("client.ext")) << "extendedKeyUsage=clientAuth\n";
  const std::vector<std::string> commands = {
      str("openssl req -x509 ", ec, " -keyout ", p("ca.key"), " -out ", p("ca.crt"), " -days 2 -subj /CN=dtrain-test-ca"),
      str("openssl req -x509 ", ec, " -keyout ", p("other-ca.key"), " -out ", p("other-ca.crt"),
          " -days 2 -subj /CN=dtrain-other-ca"),
      str("openssl req ", ec, " -keyout ", p("server.key"), " -out ", p("server.csr"), " -subj /CN=127.0.0.1"),
      str("openssl x509 -req -in ", p("server.csr"), " -CA ", p("ca.crt"), " -CAkey ", p("ca.key"),
          " -CAcreateserial -days 2 -extfile ", p("server.ext"), " -out ", p("server.crt")),
      str("openssl req ", ec, " -keyout ", p("client.key"), " -out ", p("client.csr"), " -subj /O=dtrain-test-client"),
      str("openssl x509 -req -in ", p("client.csr"), " -CA ", p("ca.crt"), " -CAkey ", p("ca.key"),
          " -CAcreateserial -days 2 -extfile ", p("client.ext"), " -out ", p("client.crt")),
      str("openssl req ", ec, " -keyout ", p("other-client.key"), " -out ", p("other-client.csr"), " -subj /CN=intruder"),
      str("openssl x509 -req -in ", p("other-client.csr"), " -CA ", p("other-ca.crt"), " -CAkey ", p("other-ca.key"),
          " -CAcreateserial -days 2 -extfile ", p("client.ext"), " -out ", p("other-client.crt")),
  };
  for (const auto& command : commands) {
    if (run(command) != 0) fail("making test certificates failed: " + command);
  }
  certs_ = {p("ca.crt"), p("server.crt"), p("server.key"), p("client.crt"), p("client.key"),
            p("other-ca.crt"), p("other-client.crt"), p("other-client.key")};
}

bool EtcdCluster::start(std::string& why) {
  const std::string binary = findEtcd(why);
  if (binary.empty()) fail(why);
  members_.clear();
  const std::vector<int> ports = freePorts(2 * options_.members);
  std::string initialCluster;
  for (int i = 0; i < options_.members; ++i) {
    Member m;
    m.name = str("m", i);
    m.clientPort = ports[static_cast<size_t>(2 * i)];
    m.peerPort = ports[static_cast<size_t>(2 * i + 1)];
    m.dataDir = str(dataRoot_, "/", m.name, "-", m.clientPort);
    m.log = (dir_ / str(m.name, ".log")).string();
    if (!initialCluster.empty()) initialCluster += ",";
    initialCluster += str(m.name, "=http://127.0.0.1:", m.peerPort);
    members_.push_back(m);
  }
  const std::string scheme = options_.tls ? "https" : "http";
  for (auto& m : members_) {
    const std::string clientUrl = str(scheme, "://127.0.0.1:", m.clientPort);
    const std::string peerUrl = str("http://127.0.0.1:", m.peerPort);
    std::vector<std::string> args = {
        binary, "--name", m.name, "--data-dir", m.dataDir, "--listen-client-urls", clientUrl,
        "--advertise-client-urls", clientUrl, "--listen-peer-urls", peerUrl, "--initial-advertise-peer-urls", peerUrl,
        "--initial-cluster", initialCluster, "--initial-cluster-state", "new", "--initial-cluster-token",
        str("dtrain-test-", getpid(), "-", ports[0]),
        // Fast elections: a killed leader is replaced within about a second.
        "--heartbeat-interval", "50", "--election-timeout", "500", "--logger", "zap", "--log-level", "warn",
        "--log-outputs", "stderr", "--bcrypt-cost", "4"};
    if (options_.tls) {
      for (const auto& extra : {"--cert-file", certs_.serverCert.c_str(), "--key-file", certs_.serverKey.c_str(),
                                "--trusted-ca-file", certs_.ca.c_str()}) {
        args.emplace_back(extra);
      }
      if (options_.clientCertAuth) args.emplace_back("--client-cert-auth");
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) fail("fork failed while starting etcd");
    if (pid == 0) {
      // Only async-signal-safe calls from here to exec.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      const int log = ::open(m.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int null = ::open("/dev/null", O_RDONLY);
      if (log >= 0) {
        dup2(log, 1);
        dup2(log, 2);
      }
      if (null >= 0) dup2(null, 0);
      execv(argv[0], argv.data());
      _exit(127);
    }
    m.pid = pid;
  }
  // Ready when a linearizable read succeeds (the cluster has a leader).
  detail::EtcdConfig config;
  config.urls = detail::parseEtcdEndpoints(endpoints(), options_.tls, "test");
  if (options_.tls) {
    config.caFile = certs_.ca;
    config.certFile = certs_.clientCert;
    config.keyFile = certs_.clientKey;
  }
  auto session = std::make_shared<detail::EtcdSession>(config);
  detail::EtcdClient client(session);
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (true) {
    for (size_t i = 0; i < members_.size(); ++i) {
      int status = 0;
      if (members_[i].pid > 0 && ::waitpid(members_[i].pid, &status, WNOHANG) == members_[i].pid) {
        members_[i].pid = -1;
        why = str("member ", members_[i].name, " exited at start (status ", status, "); its log:\n", logTail(static_cast<int>(i)));
        return false;
      }
    }
    try {
      client.call("/v3/kv/range", detail::Json{{"key", detail::base64Encode("/ready")}},
                  std::chrono::steady_clock::now() + 200ms, "ready?");
      return true;
    } catch (const TimeoutError&) {
    }
    if (std::chrono::steady_clock::now() > deadline) {
      why = str("no member answered within 20 s; log of m0:\n", logTail(0));
      return false;
    }
  }
}

void EtcdCluster::enableAuth() {
  detail::EtcdConfig config;
  config.urls = detail::parseEtcdEndpoints(endpoints(), options_.tls, "test");
  if (options_.tls) {
    config.caFile = certs_.ca;
    config.certFile = certs_.clientCert;
    config.keyFile = certs_.clientKey;
  }
  detail::EtcdClient client(std::make_shared<detail::EtcdSession>(config));
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  const std::string prefix = options_.authPrefix + "/";
  using detail::Json;
  client.call("/v3/auth/user/add", Json{{"name", "root"}, {"password", "root-secret"}}, deadline, "user add");
  client.call("/v3/auth/user/grant", Json{{"user", "root"}, {"role", "root"}}, deadline, "grant root");
  client.call("/v3/auth/role/add", Json{{"name", "job"}}, deadline, "role add");
  client.call("/v3/auth/role/grant",
              Json{{"name", "job"},
                   {"perm", {{"permType", "READWRITE"}, {"key", detail::base64Encode(prefix)},
                             {"range_end", detail::base64Encode(detail::prefixRangeEnd(prefix))}}}},
              deadline, "role grant");
  client.call("/v3/auth/user/add", Json{{"name", kUser}, {"password", kPassword}}, deadline, "user add");
  client.call("/v3/auth/user/grant", Json{{"user", kUser}, {"role", "job"}}, deadline, "grant job");
  client.call("/v3/auth/enable", Json::object(), deadline, "auth enable");
}

int EtcdCluster::leader() const {
  detail::EtcdConfig config;
  config.caFile = certs_.ca;
  config.certFile = certs_.clientCert;
  config.keyFile = certs_.clientKey;
  for (int i = 0; i < size(); ++i) {
    if (members_[static_cast<size_t>(i)].pid <= 0) continue;
    config.urls = {endpoint(i)};
    detail::EtcdClient client(std::make_shared<detail::EtcdSession>(config));
    try {
      const auto reply = client.call("/v3/maintenance/status", detail::Json::object(),
                                     std::chrono::steady_clock::now() + 1s, "status");
      // Member ids are unsigned 64-bit: compare them as the strings the gateway writes.
      const std::string leaderId = reply.value("leader", "");
      if (!leaderId.empty() && leaderId == reply["header"].value("member_id", "")) {
        return i;
      }
    } catch (const std::exception&) {
    }
  }
  return -1;
}

}  // namespace dt::testing

// Real etcd members for the tests: Debian's etcd-server binary, started on
// free loopback ports with their data on tmpfs, and stopped (SIGKILL) when
// the EtcdCluster goes away. One member starts in about 0.2 s, three (with a
// leader elected) in under a second.
//
//  * EtcdCluster({.members = 3}) starts a cluster; kill(i) SIGKILLs member i
//    (the real process, as a crash would); endpoints() lists the client URLs.
//  * tls: https client URLs with certificates made by openssl (an EC CA, a
//    server certificate for 127.0.0.1, a client certificate without a
//    CommonName (etcd 3.4's gateway refuses one with a CN when authentication
//    is on), and a second CA
//    with its own client certificate for the "wrong certificate" cases);
//    clientCertAuth makes the members require a client certificate.
//  * auth: users root and "alice" (password "alice-secret"), alice with
//    read-write permission on the key prefix authPrefix ("/dtrain-auth") only, and
//    authentication enabled.
//  * When etcd or openssl is missing, the constructor fails the test
//    (ADD_FAILURE + throw) saying to run scripts/setup.sh: these tests never
//    skip.
// Members are forked from the calling thread with PR_SET_PDEATHSIG, so they
// die with the test process even when it crashes; construct clusters on the
// test's main thread.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

#include "store/etcd_store.h"

namespace dt::testing {

struct EtcdClusterOptions {
  int members = 1;
  bool tls = false;
  bool clientCertAuth = false;
  bool auth = false;
  // With auth: the key prefix alice may read and write.
  std::string authPrefix = "/dtrain-auth";
};

struct EtcdCertificates {
  std::string ca, serverCert, serverKey, clientCert, clientKey;
  // Signed by another CA: what a member must refuse.
  std::string otherCa, otherClientCert, otherClientKey;
};

class EtcdCluster {
 public:
  static constexpr const char* kAuthPrefix = "/dtrain-auth";
  static constexpr const char* kUser = "alice";
  static constexpr const char* kPassword = "alice-secret";

  explicit EtcdCluster(EtcdClusterOptions options = {});
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  // "http://127.0.0.1:p1,http://127.0.0.1:p2,..." (https with tls).
  std::string endpoints() const;
  std::string endpoint(int member) const;
  int size() const { return static_cast<int>(members_.size()); }
  pid_t pid(int member) const { return members_[static_cast<size_t>(member)].pid; }
  int peerPort(int member) const { return members_[static_cast<size_t>(member)].peerPort; }
  // SIGKILLs member i and reaps it.
  void kill(int member);
  // The member that is the leader now (asks the members; -1 when none answers).
  int leader() const;
  const EtcdCertificates& certificates() const { return certs_; }
  // Options for an EtcdStore on this cluster (TLS files and, with auth,
  // alice's credentials and the prefix she may use) under `prefix`.
  EtcdStoreOptions storeOptions(const std::string& prefix) const;
  // The last lines of member i's log, for failure messages.
  std::string logTail(int member) const;
  const std::filesystem::path& dir() const { return dir_; }

 private:
  struct Member {
    std::string name;
    int clientPort = 0, peerPort = 0;
    pid_t pid = -1;
    std::string dataDir, log;
  };
  bool start(std::string& why);
  void makeCertificates();
  void enableAuth();
  void stopAll();

  EtcdClusterOptions options_;
  std::filesystem::path dir_;  // certificates and logs; removed with the cluster
  std::string dataRoot_;
  EtcdCertificates certs_;
  std::vector<Member> members_;
};

// The etcd binary, or "" (with the reason in `why`).
std::string findEtcd(std::string& why);

}  // namespace dt::testing

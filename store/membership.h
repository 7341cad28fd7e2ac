// The membership records an elastic job keeps in its store (under "elastic/"),
// shared by the launcher (dtrun --elastic), which reports which members died
// and why, and the members themselves (elastic/elastic_group.h), which beat
// and react. Members are numbered by their launch rank ("member ids").
//
//   elastic/claim/<member>  who posts its death (the first to add 1)
//   elastic/dead/<member>   why it ended ("exited: signal SIGKILL"), once
//   elastic/deaths          how many deaths were posted (a counter)
//   elastic/death/<n>       the member of the n-th death (1, 2, ...)
//   elastic/alive/<member>  its heartbeat counter
//   elastic/new_members     member ids handed out beyond the initial world (a counter)
//   elastic/joiners         how many joiners registered (a counter)
//   elastic/joiner/<n>      the member id of the n-th joiner (1, 2, ...)
//   elastic/node_members/<node>  the member ids running on node <node> ("4,1"; dtrun, so that
//                           a lost node's members are posted dead)
//   elastic/left/<member>   why a live member left the job (its replica lost a member): its
//                           exit 0 is not the job finishing, and dtrun may replace it
//   elastic/finished        a worker finished the job (a joiner not admitted yet gives up)
//   elastic/stopped         why the job stops (fell below --min-nproc), once; the launcher
//                           stops every worker and names it as the cause
//
// A replacement process (dtrun --elastic --max-restarts) gets a fresh member
// id from newMemberId(), so that the death of the process it replaces stays
// recorded, and registers as a joiner; the members admit it at a step
// boundary (elastic/elastic_group.h).
//
// Contract:
//  * postDeath() records a member's death once: the first reason wins, a
//    second post (the launcher saw the exit, its heartbeat monitor the silence)
//    changes nothing and returns false. Then the n-th death key appears, which
//    waitForDeath(n) waits for.
//  * Every function is one or a few store calls; thread safety and blocking
//    are the store's (a blocking TcpStore call from several threads needs
//    their own clones). Store errors propagate.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "store/store.h"

namespace dt::membership {

struct Death {
  int member = -1;
  std::string reason;
};

bool postDeath(Store& store, int member, const std::string& reason);
// The reason a member died, or nullopt while it lives.
std::optional<std::string> deathOf(Store& store, int member);
int64_t deathCount(Store& store);
// The n-th death (n >= 1), waiting up to `timeout` for it; nullopt on timeout.
std::optional<Death> waitForDeath(Store& store, int64_t n, std::chrono::milliseconds timeout);

// A member id no process has had: initialWorld, initialWorld + 1, ... (each call a new one).
int newMemberId(Store& store, int initialWorld);
// Registers `member` as a joiner; returns its registration number n (1, 2, ...).
int64_t registerJoiner(Store& store, int member);
void markFinished(Store& store);
// A live member dropped from the job (elastic/elastic_group.h: ElasticOptions::replicaSize)
// records why before it exits; leftOf reads it (nullopt: it did not leave that way).
void postLeft(Store& store, int member, const std::string& why);
std::optional<std::string> leftOf(Store& store, int member);
bool finished(Store& store);
// Records why the whole job stops; the first reason wins (false: one was recorded already).
bool postJobStop(Store& store, const std::string& why);
// Why the job stops, or nullopt while it goes on.
std::optional<std::string> jobStopOf(Store& store);
int64_t joinerCount(Store& store);
// The member id of the n-th joiner (n <= joinerCount()).
int joinerAt(Store& store, int64_t n);

void beat(Store& store, int member, uint64_t counter);
// The member's last heartbeat counter; nullopt if it never beat.
std::optional<uint64_t> heartbeatOf(Store& store, int member);

}  // namespace dt::membership

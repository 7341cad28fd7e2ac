#include "store/membership.h"

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"

namespace dt::membership {
namespace {

std::string deadKey(int member) { return str("elastic/dead/", member); }
std::string deathKey(int64_t n) { return str("elastic/death/", n); }
std::string aliveKey(int member) { return str("elastic/alive/", member); }
std::string joinerKey(int64_t n) { return str("elastic/joiner/", n); }
const char* const kDeaths = "elastic/deaths";
const char* const kJoiners = "elastic/joiners";

}  // namespace

bool postDeath(Store& store, int member, const std::string& reason) {
  // The first poster wins the claim; the reason is written before the death
  // is counted, so whoever sees the count finds the reason.
  if (store.add(str("elastic/claim/", member), 1) != 1) return false;
  store.set(deadKey(member), reason.empty() ? std::string("ended") : reason);
  const int64_t n = store.add(kDeaths, 1);
  store.set(deathKey(n), std::to_string(member));
  return true;
}

std::optional<std::string> deathOf(Store& store, int member) {
  if (!store.check({deadKey(member)})) return std::nullopt;
  return store.get(deadKey(member));
}

int64_t deathCount(Store& store) { return store.add(kDeaths, 0); }

std::optional<Death> waitForDeath(Store& store, int64_t n, std::chrono::milliseconds timeout) {
  try {
    store.wait({deathKey(n)}, timeout);
  } catch (const TimeoutError&) {
    return std::nullopt;
  }
  Death d;
  d.member = static_cast<int>(env::parseInt(store.get(deathKey(n)), "membership death record"));
  d.reason = deathOf(store, d.member).value_or("ended");
  return d;
}

int newMemberId(Store& store, int initialWorld) {
  return initialWorld + static_cast<int>(store.add("elastic/new_members", 1)) - 1;
}

int64_t registerJoiner(Store& store, int member) {
  // The counter orders racing joiners; the record follows it (joinerAt waits for it).
  const int64_t n = store.add(kJoiners, 1);
  store.set(joinerKey(n), std::to_string(member));
  return n;
}

void markFinished(Store& store) { store.set("elastic/finished", "1"); }

void postLeft(Store& store, int member, const std::string& why) { store.set(str("elastic/left/", member), why); }

std::optional<std::string> leftOf(Store& store, int member) {
  const std::string key = str("elastic/left/", member);
  if (!store.check({key})) return std::nullopt;
  return store.get(key);
}

bool finished(Store& store) { return store.check({"elastic/finished"}); }

bool postJobStop(Store& store, const std::string& why) {
  return store.compareSet("elastic/stopped", "", why) == why;
}

std::optional<std::string> jobStopOf(Store& store) {
  if (!store.check({"elastic/stopped"})) return std::nullopt;
  return store.get("elastic/stopped");
}

int64_t joinerCount(Store& store) { return store.add(kJoiners, 0); }

int joinerAt(Store& store, int64_t n) {
  // The count moves before the record is written: wait briefly for it.
  store.wait({joinerKey(n)}, std::chrono::seconds(10));
  return static_cast<int>(env::parseInt(store.get(joinerKey(n)), "membership joiner record"));
}

void beat(Store& store, int member, uint64_t counter) { store.set(aliveKey(member), std::to_string(counter)); }

std::optional<uint64_t> heartbeatOf(Store& store, int member) {
  if (!store.check({aliveKey(member)})) return std::nullopt;
  return static_cast<uint64_t>(env::parseInt(store.get(aliveKey(member)), "membership heartbeat"));
}

}  // namespace dt::membership

#include "elastic/elastic_group.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "common/check.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"
#include "common/thread_name.h"
#include "elastic/internal/loss_aware_store.h"
#include "process_group/init.h"
#include "store/membership.h"
#include "store/prefix_store.h"
#include "testing/point.h"

namespace dt::elastic {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// A rank that lost a peer learns from the launcher who died and why: it need
// not wait for the others' failure reports.
constexpr Millis kFailureReportWindow{200};
// How often a survivor looks at the agreement's keys while it waits.
constexpr Millis kAgreementPoll{2};
// How often a joiner waiting for its admission looks whether the job finished meanwhile.
constexpr Millis kJoinPoll{200};

std::string epochPrefix(uint64_t epoch) { return str("elastic/e", epoch, "/"); }
std::string reportKey(uint64_t epoch, int member) { return str(epochPrefix(epoch), "report/", member); }
std::string decisionKey(uint64_t epoch) { return str(epochPrefix(epoch), "decision"); }

int rankOf(const std::vector<int>& members, int member) {
  const auto it = std::find(members.begin(), members.end(), member);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

std::string memberName(const std::vector<int>& members, int member) {
  const int rank = rankOf(members, member);
  return rank == member ? str("rank ", rank) : str("rank ", rank, " (member ", member, ")");
}

std::vector<int> parseIds(const std::string& value) {
  std::vector<int> ids;
  for (const auto& m : split(value, ',')) {
    if (!m.empty()) ids.push_back(static_cast<int>(env::parseInt(m, "elastic decision")));
  }
  return ids;
}

std::string listIds(const std::vector<int>& ids) {
  std::vector<std::string> parts;
  for (int m : ids) parts.push_back(std::to_string(m));
  return join(parts, ",");
}

bool contains(const std::vector<int>& ids, int id) { return std::find(ids.begin(), ids.end(), id) != ids.end(); }

}  // namespace

// "members=0,1,3,4;resume=120;lost=2;joined=4;joiners=1": the next epoch's members (in rank
// order), the step they continue from, the members lost, the joiners admitted, and how many
// joiner registrations the decisions have settled so far.
struct ElasticGroup::Decision {
  std::vector<int> members;
  int64_t resume = 0;
  std::vector<int> lost;
  std::vector<int> joined;
  std::vector<int> left;  // live members dropped with their replica (ElasticOptions::replicaSize)
  int64_t joiners = 0;

  std::string encode() const {
    return str("members=", listIds(members), ";resume=", resume, ";lost=", listIds(lost), ";joined=", listIds(joined),
               ";left=", listIds(left), ";joiners=", joiners);
  }
  static Decision decode(const std::string& text) {
    Decision d;
    for (const auto& field : split(text, ';')) {
      const auto eq = field.find('=');
      if (eq == std::string::npos) continue;
      const std::string key = field.substr(0, eq), value = field.substr(eq + 1);
      if (key == "resume") d.resume = env::parseInt(value, "elastic decision");
      if (key == "joiners") d.joiners = env::parseInt(value, "elastic decision");
      if (key == "members") d.members = parseIds(value);
      if (key == "lost") d.lost = parseIds(value);
      if (key == "joined") d.joined = parseIds(value);
      if (key == "left") d.left = parseIds(value);
    }
    return d;
  }
};

// Beats, and aborts the current group when one of its members dies.
//
// The beating thread never calls into a group: it hands each abort to a
// thread of its own. An abort can take a while (a transport's abort such as
// ncclCommAbort, the flight recorder's dump), and a beat late by that long
// would get this live member posted dead by the launcher's liveness check;
// every new epoch would then lose one more member.
struct ElasticGroup::Watcher {
  struct Abort {
    std::shared_ptr<ProcessGroup> group;
    std::exception_ptr cause;
  };

  StorePtr store;
  int member;
  Millis interval;
  Logger log;
  std::mutex mutex;  // guards the fields below; never held while a group is called
  std::condition_variable wake;
  bool stopping = false;
  std::shared_ptr<ProcessGroup> group;
  std::vector<int> members;
  int64_t seen = 0;  // deaths handled
  std::deque<Abort> aborts;  // for the abort thread, in the order the deaths were seen
  std::condition_variable abortWake;
  std::atomic<int64_t> joinersRegistered{0};
  std::thread thread;
  std::thread aborter;

  Watcher(StorePtr s, int m, Millis i, Logger l) : store(std::move(s)), member(m), interval(i), log(std::move(l)) {
    seen = membership::deathCount(*store);
    aborter = std::thread([this] {
      setThreadName("dt-elastic-abrt");
      runAborts();
    });
    thread = std::thread([this] {
      setThreadName("dt-elastic");
      run();
    });
  }
  ~Watcher() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    wake.notify_all();
    abortWake.notify_all();
    if (thread.joinable()) thread.join();
    if (aborter.joinable()) aborter.join();
  }

  // The group to abort when one of `ms` dies (nullptr: none). A member that
  // died before the group was handed over is acted on now, on the calling
  // thread (looked up through `lookup`: this thread's own client may be
  // blocked in a wait).
  void watch(std::shared_ptr<ProcessGroup> g, std::vector<int> ms, Store& lookup) {
    std::vector<int> watched;
    {
      std::lock_guard<std::mutex> lock(mutex);
      group = g;
      members = std::move(ms);
      watched = members;
    }
    if (!g) return;
    for (int m : watched) {
      if (auto reason = membership::deathOf(lookup, m)) g->abort(lostError(watched, m, *reason));
    }
  }

  static std::exception_ptr lostError(const std::vector<int>& ms, int dead, const std::string& reason) {
    return std::make_exception_ptr(MemberLostError(str(memberName(ms, dead), " ", reason)));
  }

  // Queues the abort of the watched group for the abort thread. Mutex held.
  void abortFor(int dead, const std::string& reason) {
    if (!group || std::find(members.begin(), members.end(), dead) == members.end()) return;
    aborts.push_back(Abort{group, lostError(members, dead, reason)});
    abortWake.notify_one();
  }

  void runAborts() {
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      abortWake.wait(lock, [this] { return stopping || !aborts.empty(); });
      if (stopping) return;  // the owner destroys the group next
      Abort next = std::move(aborts.front());
      aborts.pop_front();
      lock.unlock();
      next.group->abort(next.cause);
      next = Abort{};  // the last reference may be this one: the group goes here, unlocked
      lock.lock();
    }
  }

  void run() {
    uint64_t beats = 0;
    bool logged = false;
    std::unique_lock<std::mutex> lock(mutex);
    while (!stopping) {
      lock.unlock();
      std::optional<membership::Death> death;
      try {
        membership::beat(*store, member, ++beats);
        joinersRegistered.store(membership::joinerCount(*store), std::memory_order_relaxed);
        death = membership::waitForDeath(*store, seen + 1, interval);
        logged = false;
      } catch (const std::exception& e) {
        if (!logged) log->warn("member {}: cannot reach the job's store for heartbeats and deaths: {}", member, e.what());
        logged = true;
      }
      lock.lock();
      if (death) {
        ++seen;
        abortFor(death->member, death->reason);
      } else if (logged && !stopping) {
        wake.wait_for(lock, interval);  // the store is unreachable: do not spin
      }
    }
  }
};

std::unique_ptr<ElasticGroup> ElasticGroup::fromEnvironment(ElasticOptions options) {
  // A joiner's RANK is no rank of the job yet (a node that joined gives its workers their
  // member ids): it connects as a client like any rank, and gets its rank when admitted.
  const bool joining = env::getBool("DT_ELASTIC_JOIN");
  InitOptions init;
  if (joining) init.rank = 0;
  JobConnection job = connectJob(init);
  ProcessGroupOptions group = std::move(job.group);
  // The caller's name and backend win over the environment's defaults.
  if (options.group.name != "default") group.name = options.group.name;
  if (!options.group.backend.empty()) group.backend = options.group.backend;
  if (options.group.timeout) group.timeout = options.group.timeout;
  options.group = std::move(group);
  if (joining) {
    const int64_t member = env::getInt("DT_ELASTIC_MEMBER");
    DT_REQUIRE(member >= job.worldSize, "ElasticGroup: DT_ELASTIC_JOIN=1 needs DT_ELASTIC_MEMBER, a member id of at least "
               "the initial world size ", job.worldSize, " (dtrun sets both for a replacement), got ", member);
    options.group.watchdogKey = str("dt/progress/", member);  // not rank 0's
    return std::unique_ptr<ElasticGroup>(
        new ElasticGroup(job.store, static_cast<int>(member), std::move(options), JoinTag{job.worldSize}));
  }
  return std::make_unique<ElasticGroup>(job.store, job.rank, job.worldSize, std::move(options));
}

ElasticGroup::ElasticGroup(StorePtr store, int memberId, int initialWorld, ElasticOptions options)
    : store_(std::move(store)), memberId_(memberId), options_(std::move(options)) {
  DT_REQUIRE(store_ != nullptr, "ElasticGroup: store is null");
  DT_REQUIRE(initialWorld >= 1, "ElasticGroup: initial world size must be >= 1, got ", initialWorld);
  DT_REQUIRE(memberId_ >= 0 && memberId_ < initialWorld, "ElasticGroup: member id ", memberId_, " is outside [0, ",
             initialWorld, ")");
  membership_.epoch = 0;
  for (int m = 0; m < initialWorld; ++m) membership_.members.push_back(m);
  membership_.rank = memberId_;
  startWatcher();
  group_ = makeGroup(0, membership_.rank, membership_.size());
  watcher_->watch(group_, membership_.members, *store_);
}

std::unique_ptr<ElasticGroup> ElasticGroup::join(StorePtr store, int memberId, ElasticOptions options) {
  return std::unique_ptr<ElasticGroup>(new ElasticGroup(std::move(store), memberId, std::move(options), JoinTag{}));
}

ElasticGroup::ElasticGroup(StorePtr store, int memberId, ElasticOptions options, JoinTag tag)
    : store_(std::move(store)), memberId_(memberId), options_(std::move(options)) {
  DT_REQUIRE(store_ != nullptr, "ElasticGroup: store is null");
  DT_REQUIRE(memberId_ >= 0, "ElasticGroup: member id must be >= 0, got ", memberId_);
  startWatcher();  // it beats: the launcher counts a joiner alive while it waits
  const int64_t registration = membership::registerJoiner(*store_, memberId_);
  testing::point("elastic-joiner-registered");
  // The decisions made before this registration cannot admit it: wait for the ones after the newest.
  uint64_t epoch = 0;
  while (store_->check({decisionKey(epoch + 1)})) ++epoch;
  const auto deadline = Clock::now() + options_.joinTimeout;
  while (true) {
    // Short waits: the job may finish instead (dtrun marks it when a worker exits 0).
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    try {
      if (left.count() <= 0) throw TimeoutError("join deadline");
      store_->wait({decisionKey(epoch + 1)}, std::min(left, kJoinPoll));
    } catch (const TimeoutError&) {
      if (membership::finished(*store_)) {
        throw JobFinishedError(str("[member ", memberId_, ", joining] the job finished before this process was admitted"));
      }
      if (const std::string gone = everyMemberGone(epoch, tag.initialWorld); !gone.empty()) {
        throw MembershipError(str("[member ", memberId_, ", joining] nobody is left to admit this process: every member of ",
                                  "epoch ", epoch, " is gone (", gone, ")"));
      }
      if (Clock::now() < deadline) continue;
      throw TimeoutError(str("[member ", memberId_, ", joining] the members did not admit this process within ",
                             formatDuration(options_.joinTimeout), " (it waited for the decision on epoch ", epoch + 1,
                             "). They admit joiners at a step boundary once they see them: are they training, and does ",
                             "their loop call admit() when joinersWaiting() (docs/elastic.md)?"));
    }
    ++epoch;
    const Decision d = Decision::decode(store_->get(decisionKey(epoch)));
    if (contains(d.joined, memberId_)) {
      enter(epoch, d, {}, d.resume);
      logger("elastic")->info("[{}] joined the job at step {}", who(), d.resume);
      return;
    }
    if (d.joiners >= registration) {
      throw MembershipError(str("[member ", memberId_, ", joining] the members decided on epoch ", epoch,
                                " without admitting this process: it was posted dead before the decision (",
                                membership::deathOf(*store_, memberId_).value_or("no reason recorded"), ")"));
    }
  }
}

// What ended every member of `epoch` ("member 0 exited: exit code 1, and 3 more"), or "" while
// one lives or the members are not known (epoch 0 of a joiner made without the initial world).
std::string ElasticGroup::everyMemberGone(uint64_t epoch, int initialWorld) {
  std::vector<int> members;
  if (epoch > 0) {
    members = Decision::decode(store_->get(decisionKey(epoch))).members;
  } else {
    for (int m = 0; m < initialWorld; ++m) members.push_back(m);
  }
  // One store call while fewer deaths than members were posted (the usual case).
  if (members.empty() || membership::deathCount(*store_) < static_cast<int64_t>(members.size())) return "";
  std::string first;
  for (int m : members) {
    const std::optional<std::string> death = membership::deathOf(*store_, m);
    if (!death) return "";
    if (first.empty()) first = str("member ", m, " ", *death);
  }
  return members.size() == 1 ? first : str(first, ", and ", members.size() - 1, " more");
}

void ElasticGroup::startWatcher() {
  if (options_.minSize <= 0) options_.minSize = std::max<int>(1, static_cast<int>(env::getInt("DT_MIN_NPROC")));
  options_.group.failureReportWindow = std::min(options_.group.failureReportWindow, kFailureReportWindow);
  watcher_ = std::make_unique<Watcher>(store_->clone(), memberId_, options_.heartbeatInterval,
                                       makeLogger("elastic", str("member ", memberId_)));
}

ElasticGroup::~ElasticGroup() {
  watcher_.reset();
  if (group_) group_->destroy();
}

std::string ElasticGroup::who() const {
  return str("member ", memberId_, ", rank ", membership_.rank, "/", membership_.size(), " of epoch ", membership_.epoch);
}

std::shared_ptr<ProcessGroup> ElasticGroup::makeGroup(uint64_t epoch, int rank, int size) {
  // Its waits (making the group, monitored barriers) end as soon as a member of the epoch dies.
  auto scoped = std::make_shared<PrefixStore>(epochPrefix(epoch) + "pg", store_);
  return ProcessGroup::create(std::make_shared<LossAwareStore>(scoped, store_, membership_.members), rank, size, options_.group);
}

bool ElasticGroup::joinersWaiting() const {
  // Replicas come back whole: fewer joiners than one replica's worth keep waiting.
  return watcher_->joinersRegistered.load(std::memory_order_relaxed) - joinersDecided_ >= std::max(options_.replicaSize, 1);
}

bool ElasticGroup::joinedNow() const { return contains(membership_.joined, memberId_); }

bool ElasticGroup::hasLeft() const { return membership_.rank < 0 && contains(membership_.left, memberId_); }

void ElasticGroup::dropBrokenReplicas(const Membership& before, Decision& d) const {
  const int size = std::max(options_.replicaSize, 1);
  if (size == 1 || d.lost.empty()) return;
  for (size_t first = 0; first < before.members.size(); first += static_cast<size_t>(size)) {
    const size_t last = std::min(before.members.size(), first + static_cast<size_t>(size));
    bool broken = false;
    for (size_t r = first; r < last; ++r) broken = broken || contains(d.lost, before.members[r]);
    if (!broken) continue;
    for (size_t r = first; r < last; ++r) {
      const int m = before.members[r];
      if (!contains(d.members, m)) continue;
      d.left.push_back(m);
      d.members.erase(std::find(d.members.begin(), d.members.end(), m));
    }
  }
  std::erase_if(d.joined, [&](int m) { return contains(d.left, m); });
}

std::vector<std::vector<int>> ElasticGroup::brokenReplicas(const std::vector<int>& before, const Decision& d) const {
  std::vector<std::vector<int>> out;
  const size_t size = static_cast<size_t>(std::max(options_.replicaSize, 1));
  if (size == 1) return out;
  for (size_t first = 0; first < before.size(); first += size) {
    std::vector<int> replica(before.begin() + static_cast<std::ptrdiff_t>(first),
                             before.begin() + static_cast<std::ptrdiff_t>(std::min(before.size(), first + size)));
    if (std::any_of(replica.begin(), replica.end(), [&](int m) { return contains(d.lost, m); })) out.push_back(std::move(replica));
  }
  return out;
}

void ElasticGroup::requireMinimum(const Decision& d, const std::vector<std::string>& lost) {
  if (d.members.size() >= static_cast<size_t>(options_.minSize)) return;
  std::vector<std::string> left;
  for (int m : d.members) left.push_back(str("member ", m));
  const std::string dropped = d.left.empty() ? std::string() : str(" (and member(s) ", listIds(d.left), " with their replica)");
  // The launcher stops every worker on seeing this and names it (and the deaths that
  // brought the job below) as the cause, rather than the survivors' exits.
  try {
    membership::postJobStop(*store_, str(d.members.size(), " member(s) left (", dt::join(left, ", "),
                                         "), below --min-nproc ", options_.minSize, "; brought below by: ",
                                         dt::join(lost, "; "), dropped));
  } catch (const Error&) {
    // The store is gone too: the error below still says it all to this process.
  }
  throw MembershipError(str("[", who(), "] the elastic job stops: ", d.members.size(), " member(s) left (",
                            dt::join(left, ", "), "), fewer than the minimum of ", options_.minSize, " (--min-nproc); lost: ",
                            dt::join(lost, "; "), dropped));
}

const Membership& ElasticGroup::leave(uint64_t epoch, const Decision& d, std::vector<std::string> lost) {
  // No replica left whole (or too few ranks): the job stops, as for the others; an exit 0
  // here would tell dtrun the job finished.
  requireMinimum(d, lost);
  const Membership before = membership_;
  membership_.epoch = epoch;
  membership_.members = d.members;
  membership_.rank = -1;
  membership_.resumeStep = d.resume;
  membership_.lost = std::move(lost);
  membership_.joined.clear();
  membership_.left = d.left;
  membership_.brokenReplicas = brokenReplicas(before.members, d);
  joinersDecided_ = std::max(joinersDecided_, d.joiners);
  // Before this process exits: dtrun must not take its exit 0 for the job finishing.
  try {
    membership::postLeft(*store_, memberId_, str("its replica lost a member at step ", d.resume, " (",
                                                dt::join(membership_.lost, "; "), ")"));
  } catch (const Error& e) {
    // Without the store dtrun is gone too: leaving is all that is left to do.
    logger("elastic")->warn("[member {}] cannot record its leaving in the job's store: {}", memberId_, e.what());
  }
  logger("elastic")->info("[member {}] leaves the job at step {}: its replica lost a member ({})", memberId_, d.resume,
                          dt::join(membership_.lost, "; "));
  return membership_;
}

ElasticGroup::Decision ElasticGroup::agree(const Membership& before, int64_t stepsApplied, bool admitting) {
  store_->set(reportKey(before.epoch, memberId_), std::to_string(stepsApplied));
  testing::point("elastic-agreement");  // where tests kill a member mid-agreement (testing/point.h)

  // One decision per epoch: the lowest-numbered surviving member makes it
  // once every member has reported or is dead, and publishes it with a
  // compare-and-set (a second decider, after the first died, cannot replace it).
  const std::string key = decisionKey(before.epoch + 1);
  const auto deadline = Clock::now() + options_.agreementTimeout;
  std::vector<int> waitingFor;
  while (!store_->check({key})) {
    int leader = -1;
    for (int m : before.members) {
      if (!membership::deathOf(*store_, m)) {
        leader = m;
        break;
      }
    }
    if (leader == memberId_) {
      Decision d;
      d.resume = stepsApplied;
      waitingFor.clear();
      for (int m : before.members) {
        if (membership::deathOf(*store_, m)) {
          d.lost.push_back(m);
        } else if (store_->check({reportKey(before.epoch, m)})) {
          d.members.push_back(m);
          d.resume = std::max<int64_t>(d.resume, env::parseInt(store_->get(reportKey(before.epoch, m)), "elastic report"));
        } else {
          waitingFor.push_back(m);
        }
      }
      if (waitingFor.empty()) {
        dropBrokenReplicas(before, d);
        d.joiners = joinersDecided_;
        // Joiners admitted into `before` whose epoch committed no step may not have the
        // state yet (its transfer may be what failed): they are sent it again.
        if (d.resume == before.resumeStep) {
          for (int m : before.joined) {
            if (contains(d.members, m)) d.joined.push_back(m);
          }
        }
        if (admitting) {
          const int64_t registered = membership::joinerCount(*store_);
          std::vector<std::pair<int64_t, int>> live;  // (registration, member id)
          for (int64_t n = joinersDecided_ + 1; n <= registered; ++n) {
            const int joiner = membership::joinerAt(*store_, n);
            if (membership::deathOf(*store_, joiner) || contains(d.members, joiner)) continue;
            live.emplace_back(n, joiner);
          }
          // Whole replicas only: the rest stay registered and undecided, for a later admission.
          const size_t replica = static_cast<size_t>(std::max(options_.replicaSize, 1));
          const size_t admitted = live.size() / replica * replica;
          for (size_t k = 0; k < admitted; ++k) {
            d.members.push_back(live[k].second);
            d.joined.push_back(live[k].second);
          }
          d.joiners = admitted < live.size() ? live[admitted].first - 1 : registered;
          std::sort(d.members.begin(), d.members.end());
        }
        store_->compareSet(key, "", d.encode());
        break;
      }
    }
    if (Clock::now() >= deadline) {
      std::vector<std::string> names;
      for (int m : waitingFor) names.push_back(memberName(before.members, m));
      throw TimeoutError(str("[", who(), "] elastic ", admitting ? "admission" : "recovery", ": no decision on epoch ",
                             before.epoch + 1, " within ", formatDuration(options_.agreementTimeout),
                             waitingFor.empty() ? str("; member ", leader, " decides and has not")
                                                : str("; ", dt::join(names, ", "), " neither reported nor died"),
                             ". Are they running? Is the launcher posting deaths (dtrun --elastic)?"));
    }
    std::this_thread::sleep_for(kAgreementPoll);
  }
  return Decision::decode(store_->get(key));
}

const Membership& ElasticGroup::enter(uint64_t epoch, const Decision& d, std::vector<std::string> lost, int64_t stepsApplied) {
  if (!contains(d.members, memberId_)) {
    throw MembershipError(str("[", who(), "] this process is no longer a member of the job: the others went on to epoch ",
                              epoch, " without it (", dt::join(lost, "; "), ")"));
  }
  requireMinimum(d, lost);
  membership_.brokenReplicas = brokenReplicas(membership_.members, d);
  membership_.epoch = epoch;
  membership_.members = d.members;
  membership_.rank = rankOf(d.members, memberId_);
  membership_.resumeStep = d.resume;
  membership_.lost = std::move(lost);
  membership_.joined = d.joined;
  membership_.left = d.left;
  joinersDecided_ = std::max(joinersDecided_, d.joiners);
  try {
    group_ = makeGroup(membership_.epoch, membership_.rank, membership_.size());
  } catch (const Error&) {
    // A member of the new epoch died while the group was being made: one more round.
    return recover(std::current_exception(), stepsApplied);
  }
  watcher_->watch(group_, membership_.members, *store_);
  return membership_;
}

std::vector<std::string> ElasticGroup::describeLost(const std::vector<int>& members, const std::vector<int>& lost) {
  std::vector<std::string> out;
  for (int m : lost) out.push_back(str(memberName(members, m), " ", membership::deathOf(*store_, m).value_or("ended")));
  return out;
}

void ElasticGroup::leaveGroup(std::exception_ptr cause) {
  watcher_->watch(nullptr, {}, *store_);
  if (!group_) return;
  if (cause) group_->abort(cause);
  group_->destroy();
  group_.reset();
}

const Membership& ElasticGroup::recover(std::exception_ptr cause, int64_t stepsApplied) {
  if (!cause) cause = std::make_exception_ptr(Error("ElasticGroup::recover: called without a failure"));
  const Membership before = membership_;
  // Stop the epoch's group at once (its ops on other threads fail) and release it.
  leaveGroup(cause);
  const Decision d = agree(before, stepsApplied, /*admitting=*/false);
  if (d.lost.empty()) std::rethrow_exception(cause);  // nobody died: a failure of another kind
  std::vector<std::string> lost = describeLost(before.members, d.lost);
  const std::string said = dt::join(lost, "; ");
  if (contains(d.left, memberId_)) return leave(before.epoch + 1, d, std::move(lost));
  const Membership& now = enter(before.epoch + 1, d, std::move(lost), stepsApplied);
  logger("elastic")->info("[{}] continues from step {} without {}", who(), d.resume, said);
  return now;
}

const Membership& ElasticGroup::admit(int64_t stepsApplied) {
  const Membership before = membership_;
  // Every member is past its last op on this group (the commit vote that led here); the
  // group goes once all have reported, so that none is still using it.
  const Decision d = agree(before, stepsApplied, /*admitting=*/true);
  leaveGroup(nullptr);
  if (contains(d.left, memberId_)) return leave(before.epoch + 1, d, describeLost(before.members, d.lost));
  const Membership& now = enter(before.epoch + 1, d, describeLost(before.members, d.lost), stepsApplied);
  logger("elastic")->info("[{}] admitted {} joiner(s) at step {}", who(), d.joined.size(), d.resume);
  return now;
}

}  // namespace dt::elastic

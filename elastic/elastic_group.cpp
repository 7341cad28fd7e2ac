#include "elastic/elastic_group.h"

#include <algorithm>
#include <condition_variable>
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

std::string epochPrefix(uint64_t epoch) { return str("elastic/e", epoch, "/"); }
std::string reportKey(uint64_t epoch, int member) { return str(epochPrefix(epoch), "report/", member); }
std::string decisionKey(uint64_t epoch) { return str(epochPrefix(epoch), "decision"); }

// "members=0,1,3;resume=120;lost=2"
struct Decision {
  std::vector<int> members;
  int64_t resume = 0;
  std::vector<int> lost;

  std::string encode() const {
    auto list = [](const std::vector<int>& v) {
      std::vector<std::string> parts;
      for (int m : v) parts.push_back(std::to_string(m));
      return join(parts, ",");
    };
    return str("members=", list(members), ";resume=", resume, ";lost=", list(lost));
  }
  static Decision decode(const std::string& text) {
    Decision d;
    for (const auto& field : split(text, ';')) {
      const auto eq = field.find('=');
      if (eq == std::string::npos) continue;
      const std::string key = field.substr(0, eq), value = field.substr(eq + 1);
      if (key == "resume") d.resume = env::parseInt(value, "elastic decision");
      if (key != "members" && key != "lost") continue;
      for (const auto& m : split(value, ',')) {
        if (!m.empty()) (key == "members" ? d.members : d.lost).push_back(static_cast<int>(env::parseInt(m, "elastic decision")));
      }
    }
    return d;
  }
};

int rankOf(const std::vector<int>& members, int member) {
  const auto it = std::find(members.begin(), members.end(), member);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

std::string memberName(const std::vector<int>& members, int member) {
  const int rank = rankOf(members, member);
  return rank == member ? str("rank ", rank) : str("rank ", rank, " (member ", member, ")");
}

}  // namespace

// Beats, and aborts the current group when one of its members dies.
struct ElasticGroup::Watcher {
  StorePtr store;
  int member;
  Millis interval;
  Logger log;
  std::mutex mutex;  // guards the fields below
  std::condition_variable wake;
  bool stopping = false;
  std::shared_ptr<ProcessGroup> group;
  std::vector<int> members;
  int64_t seen = 0;  // deaths handled
  std::thread thread;

  Watcher(StorePtr s, int m, Millis i, Logger l) : store(std::move(s)), member(m), interval(i), log(std::move(l)) {
    seen = membership::deathCount(*store);
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
    if (thread.joinable()) thread.join();
  }

  // The group to abort when one of `ms` dies (nullptr: none). A member that
  // died before the group was handed over is acted on now (looked up through
  // `lookup`: this thread's own client may be blocked in a wait).
  void watch(std::shared_ptr<ProcessGroup> g, std::vector<int> ms, Store& lookup) {
    std::lock_guard<std::mutex> lock(mutex);
    group = std::move(g);
    members = std::move(ms);
    if (!group) return;
    for (int m : members) {
      if (auto reason = membership::deathOf(lookup, m)) abortFor(m, *reason);
    }
  }

  void abortFor(int dead, const std::string& reason) {  // mutex held
    if (!group || std::find(members.begin(), members.end(), dead) == members.end()) return;
    group->abort(std::make_exception_ptr(MemberLostError(str(memberName(members, dead), " ", reason))));
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
  JobConnection job = connectJob();
  ProcessGroupOptions group = std::move(job.group);
  // The caller's name and backend win over the environment's defaults.
  if (options.group.name != "default") group.name = options.group.name;
  if (!options.group.backend.empty()) group.backend = options.group.backend;
  if (options.group.timeout) group.timeout = options.group.timeout;
  options.group = std::move(group);
  return std::make_unique<ElasticGroup>(job.store, job.rank, job.worldSize, std::move(options));
}

ElasticGroup::ElasticGroup(StorePtr store, int memberId, int initialWorld, ElasticOptions options)
    : store_(std::move(store)), memberId_(memberId), options_(std::move(options)) {
  DT_REQUIRE(store_ != nullptr, "ElasticGroup: store is null");
  DT_REQUIRE(initialWorld >= 1, "ElasticGroup: initial world size must be >= 1, got ", initialWorld);
  DT_REQUIRE(memberId_ >= 0 && memberId_ < initialWorld, "ElasticGroup: member id ", memberId_, " is outside [0, ",
             initialWorld, ")");
  if (options_.minSize <= 0) options_.minSize = std::max<int>(1, static_cast<int>(env::getInt("DT_MIN_NPROC")));
  options_.group.failureReportWindow = std::min(options_.group.failureReportWindow, kFailureReportWindow);
  membership_.epoch = 0;
  for (int m = 0; m < initialWorld; ++m) membership_.members.push_back(m);
  membership_.rank = memberId_;
  watcher_ = std::make_unique<Watcher>(store_->clone(), memberId_, options_.heartbeatInterval,
                                       makeLogger("elastic", str("member ", memberId_)));
  group_ = makeGroup(0, membership_.rank, membership_.size());
  watcher_->watch(group_, membership_.members, *store_);
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

const Membership& ElasticGroup::recover(std::exception_ptr cause, int64_t stepsApplied) {
  if (!cause) cause = std::make_exception_ptr(Error("ElasticGroup::recover: called without a failure"));
  const Membership before = membership_;
  // Stop the epoch's group at once (its ops on other threads fail) and release it.
  watcher_->watch(nullptr, {}, *store_);
  if (group_) {
    group_->abort(cause);
    group_->destroy();
    group_.reset();
  }
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
        store_->compareSet(key, "", d.encode());
        break;
      }
    }
    if (Clock::now() >= deadline) {
      std::vector<std::string> names;
      for (int m : waitingFor) names.push_back(memberName(before.members, m));
      throw TimeoutError(str("[", who(), "] elastic recovery: no decision on epoch ", before.epoch + 1, " within ",
                             formatDuration(options_.agreementTimeout),
                             waitingFor.empty() ? str("; member ", leader, " decides and has not")
                                                : str("; ", join(names, ", "), " neither reported nor died"),
                             ". Are they running? Is the launcher posting deaths (dtrun --elastic)?"));
    }
    std::this_thread::sleep_for(kAgreementPoll);
  }
  const Decision d = Decision::decode(store_->get(key));

  std::vector<std::string> lost;
  for (int m : d.lost) lost.push_back(str(memberName(before.members, m), " ", membership::deathOf(*store_, m).value_or("ended")));
  if (d.lost.empty()) std::rethrow_exception(cause);  // nobody died: a failure of another kind
  if (rankOf(d.members, memberId_) < 0) {
    throw MembershipError(str("[", who(), "] this process is no longer a member of the job: the others went on to epoch ",
                              before.epoch + 1, " without it (", join(lost, "; "), ")"));
  }
  if (d.members.size() < static_cast<size_t>(options_.minSize)) {
    std::vector<std::string> left;
    for (int m : d.members) left.push_back(str("member ", m));
    throw MembershipError(str("[", who(), "] the elastic job stops: ", d.members.size(), " member(s) left (",
                              join(left, ", "), "), fewer than the minimum of ", options_.minSize, " (--min-nproc); lost: ",
                              join(lost, "; ")));
  }
  membership_.epoch = before.epoch + 1;
  membership_.members = d.members;
  membership_.rank = rankOf(d.members, memberId_);
  membership_.resumeStep = d.resume;
  membership_.lost = lost;
  try {
    group_ = makeGroup(membership_.epoch, membership_.rank, membership_.size());
  } catch (const Error&) {
    // A member of the new epoch died while the group was being made: one more round.
    return recover(std::current_exception(), stepsApplied);
  }
  watcher_->watch(group_, membership_.members, *store_);
  logger("elastic")->info("[{}] continues from step {} without {}", who(), d.resume, join(lost, "; "));
  return membership_;
}

}  // namespace dt::elastic

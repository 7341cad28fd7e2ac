#include "launcher/status.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <map>
#include <optional>

#include "common/json.h"
#include "common/strings.h"
#include "launcher/machine.h"
#include "store/membership.h"

namespace dt::launcher {
namespace {

json::Value number(double v) {
  if (!std::isfinite(v)) return {};
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return json::Value::numberText(buf);
}

std::string promNumber(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

// Prometheus label values escape backslash, quote and newline.
std::string promLabel(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

// A counter the reader must not create: a missing one is 0.
int64_t counter(Store& store, const std::string& key) {
  if (!store.check({key})) return 0;
  try {
    return std::stoll(store.get(key));
  } catch (const std::invalid_argument&) {
    return 0;
  } catch (const std::out_of_range&) {
    return 0;
  }
}

struct Tracked {
  MemberView view;
  std::string lastSeen;  // the heartbeat or record last read: a change is a sign of life
  int64_t changedMs = -1;
  bool settled = false;  // dead or left, and read since
  bool known[3] = {false, false, false};  // its record, progress and heartbeat keys exist
};

}  // namespace

struct StatusCollector::State {
  // Under mu_: what the agent says, and the published view.
  int attempt = -1;
  int world = 0;
  std::string outcome;
  bool finished = false;
  std::deque<JobEvent> pendingEvents;  // the agent's, merged by the next poll
  JobView view;
  // Only the poll (one at a time, under pollMu) touches these.
  std::mutex pollMu;
  StorePtr pollStore;  // the thread's clone (start()), else the store itself
  std::map<int, Tracked> members;
  int polledAttempt = -1;  // the attempt the counters below are of
  int64_t deaths = 0, joiners = 0, loopEvents = 0, stragglers = 0, curvePoints = 0;
  std::deque<JobEvent> events;
  std::deque<status::CurvePoint> curve;
  std::map<std::string, int64_t> counts;
  std::string unit = "samples";
  int64_t steps = 0;

  void addEvent(JobEvent e) {
    ++counts[e.kind];
    events.push_back(std::move(e));
    while (events.size() > kEventLimit) events.pop_front();
  }
};

StatusCollector::StatusCollector(StorePtr store, Config config)
    : store_(std::move(store)), config_(std::move(config)), state_(std::make_unique<State>()) {
  state_->pollStore = store_;
  state_->view.runId = config_.runId;
  state_->view.elastic = config_.elastic;
  state_->view.startMs = wallMs();
  state_->view.nowMs = state_->view.startMs;
}

StatusCollector::~StatusCollector() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void StatusCollector::start() {
  {
    std::lock_guard<std::mutex> poll(state_->pollMu);
    state_->pollStore = store_->clone();
    // A store that stopped answering shows on the page within a second instead of holding the
    // poll for the store's default timeout.
    state_->pollStore->setTimeout(std::chrono::milliseconds(std::clamp<int64_t>(config_.interval.count(), 200, 1000)));
  }
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      poll();
      lock.lock();
      cv_.wait_for(lock, config_.interval, [this] { return stop_; });
    }
  });
}

void StatusCollector::beginAttempt(int attempt, int world) {
  std::lock_guard<std::mutex> lock(mu_);
  state_->attempt = attempt;
  state_->world = world;
  state_->pendingEvents.push_back(
      {wallMs(), "start", attempt == 0 ? str(world, " worker(s) started") : str("restart ", attempt, ": ", world, " worker(s) started")});
}

void StatusCollector::finish(const std::string& outcome) {
  std::lock_guard<std::mutex> lock(mu_);
  state_->finished = true;
  state_->outcome = outcome;
  state_->pendingEvents.push_back({wallMs(), "finish", outcome});
}

JobView StatusCollector::view() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_->view;
}

void StatusCollector::poll() {
  State& s = *state_;
  std::lock_guard<std::mutex> pollLock(s.pollMu);
  int attempt = -1, world = 0;
  bool finished = false;
  std::string outcome;
  {
    std::lock_guard<std::mutex> lock(mu_);
    attempt = s.attempt;
    world = s.world;
    finished = s.finished;
    outcome = s.outcome;
    while (!s.pendingEvents.empty()) {
      s.addEvent(std::move(s.pendingEvents.front()));
      s.pendingEvents.pop_front();
    }
  }
  const int64_t now = wallMs();
  std::string error;
  // A restarted worker group (--max-restarts without --elastic) writes under "restart<k>/"
  // (process_group/init.h): its counters start again, and its members are new processes.
  const std::string px = config_.elastic || attempt <= 0 ? std::string() : str("restart", attempt, "/");
  if (attempt != s.polledAttempt) {
    s.polledAttempt = attempt;
    s.members.clear();
    s.loopEvents = s.stragglers = s.curvePoints = 0;
  }
  if (world > 0) {
    Store& store = *s.pollStore;
    try {
      // Member ids: the start's ranks, then every fresh id handed to a replacement or a late node.
      const int64_t fresh = config_.elastic ? counter(store, "elastic/new_members") : 0;
      for (int m = 0; m < world + fresh; ++m) {
        Tracked& t = s.members[m];
        if (t.view.member < 0) {
          t.view.member = m;
          t.view.rank = m < world ? m : -1;
          t.view.state = m < world ? "starting" : "joining";
          t.view.loss = t.view.rate = std::nan("");
        }
      }
      if (config_.elastic) {
        for (int64_t n = s.deaths + 1, total = membership::deathCount(store); n <= total; ++n) {
          const int member = std::stoi(store.get(str("elastic/death/", n)));
          const std::string reason = membership::deathOf(store, member).value_or("ended");
          Tracked& t = s.members[member];
          t.view.member = member;
          t.view.state = "dead";
          t.view.reason = reason;
          const std::string who = t.view.rank >= 0 && t.view.rank != member ? str("rank ", t.view.rank, " (member ", member, ")")
                                  : t.view.rank >= 0                         ? str("rank ", member)
                                                                             : str("member ", member);
          s.addEvent({now, "death", str(who, " died: ", reason)});
          s.deaths = n;
        }
        for (int64_t n = s.joiners + 1, total = membership::joinerCount(store); n <= total; ++n) {
          s.addEvent({now, "join", str("member ", membership::joinerAt(store, n), " registered to join the running job")});
          s.joiners = n;
        }
      }
      for (int64_t n = s.loopEvents + 1, total = counter(store, px + status::kEventCount); n <= total; ++n) {
        if (const auto e = status::decodeEvent(store.get(px + status::eventKey(n)))) s.addEvent({e->timeMs, e->kind, e->text});
        s.loopEvents = n;
      }
      for (int64_t n = s.stragglers + 1, total = counter(store, px + "dt/straggler/count"); n <= total; ++n) {
        const auto fields = split(store.get(str(px, "dt/straggler/", n)), '\t');  // "<member>\t<rank>\t<line>"
        if (fields.size() >= 3) {
          s.addEvent({now, "straggler", join(std::vector<std::string>(fields.begin() + 2, fields.end()), "\t")});
        }
        s.stragglers = n;
      }
      for (int64_t n = s.curvePoints + 1, total = counter(store, px + status::kCurveCount); n <= total; ++n) {
        if (auto p = status::decodeCurvePoint(store.get(px + status::curveKey(n)))) {
          // A restart or a recovery may log a step again: the newer point replaces the older.
          while (!s.curve.empty() && s.curve.back().step >= p->step) s.curve.pop_back();
          s.curve.push_back(std::move(*p));
          while (s.curve.size() > kCurveLimit) s.curve.pop_front();
        }
        s.curvePoints = n;
      }
      // Per member: its status record, its last collective and (elastic) its heartbeat. A key
      // once written stays, so the keys seen before are read in one multiGet and only the
      // others are checked, one by one, until they appear: a poll of a running job is a few
      // round trips, not a few per member.
      const int kinds = config_.elastic ? 3 : 2;
      auto keyOf = [&](int member, int kind) {
        return kind == 0 ? px + status::rankKey(member) : kind == 1 ? str("dt/progress/", member) : str("elastic/alive/", member);
      };
      std::vector<std::string> keys;
      std::vector<std::pair<int, int>> slots;  // (member, kind) of each key
      std::vector<std::pair<int, bool>> polled;  // (member, gone)
      for (auto& [member, t] : s.members) {
        const bool gone = t.view.state == "dead" || t.view.state == "left";
        if (gone && t.settled) {  // its last figures stay; nothing of it changes any more
          t.view.heartbeatAgeS = t.changedMs < 0 ? -1.0 : static_cast<double>(now - t.changedMs) / 1000.0;
          continue;
        }
        t.settled = gone;  // read once more after its end: what it wrote last
        polled.emplace_back(member, gone);
        for (int kind = 0; kind < kinds; ++kind) {
          const std::string key = keyOf(member, kind);
          if (!t.known[kind] && !store.check({key})) continue;
          t.known[kind] = true;
          keys.push_back(key);
          slots.emplace_back(member, kind);
        }
      }
      const std::vector<Bytes> values = keys.empty() ? std::vector<Bytes>() : store.multiGet(keys);
      // A sign of life: its record or its last collective moved, or (elastic) its heartbeat.
      std::map<int, std::string> seen;
      for (size_t i = 0; i < values.size(); ++i) {
        const auto [member, kind] = slots[i];
        MemberView& v = s.members[member].view;
        const std::string& value = values[i];
        if (kind == 0) {
          seen[member] = value;
          if (const auto r = status::decodeRankRecord(value)) {
            v.rank = r->rank;
            v.host = r->host;
            v.step = r->step;
            v.loss = r->loss;
            v.rate = r->rate;
            v.rssBytes = r->rssBytes;
            if (!r->unit.empty()) s.unit = r->unit;
            s.steps = std::max(s.steps, r->steps);
          }
        } else if (kind == 1) {
          const auto space = value.find(' ');
          v.lastOp = space == std::string::npos ? value : str("#", value.substr(0, space), " ", value.substr(space + 1));
          seen[member] += "\n" + value;
        } else {
          seen[member] = "beat " + value;  // the heartbeat alone says whether it lives
        }
      }
      for (const auto& [member, gone] : polled) {
        Tracked& t = s.members[member];
        MemberView& v = t.view;
        const std::string& sign = seen[member];
        if (!gone && !sign.empty() && sign != t.lastSeen) {
          t.lastSeen = sign;
          t.changedMs = now;
          if (v.state == "starting" || v.state == "joining") v.state = "running";
        } else if (config_.elastic && !gone) {
          // Only a member that stopped beating can have left with its replica.
          if (const auto why = membership::leftOf(store, member)) {
            v.state = "left";
            v.reason = *why;
          }
        }
        v.heartbeatAgeS = t.changedMs < 0 ? -1.0 : static_cast<double>(now - t.changedMs) / 1000.0;
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  JobView view;
  view.runId = config_.runId;
  view.elastic = config_.elastic;
  view.attempt = attempt;
  view.initialWorld = world;
  view.nowMs = now;
  view.state = finished ? "finished" : attempt < 0 ? "starting" : "running";
  view.outcome = outcome;
  view.storeError = error;
  view.unit = s.unit;
  view.steps = s.steps;
  view.loss = view.rate = std::nan("");
  if (!s.curve.empty()) {
    view.loss = s.curve.back().loss;
    view.rate = s.curve.back().rate;
  }
  for (const auto& [member, t] : s.members) {
    MemberView v = t.view;
    if (finished && (v.state == "running" || v.state == "starting" || v.state == "joining")) v.state = "finished";
    if (v.state != "dead" && v.state != "left") view.step = std::max(view.step, v.step);
    view.members.push_back(std::move(v));
  }
  view.events.assign(s.events.begin(), s.events.end());
  view.curve.assign(s.curve.begin(), s.curve.end());
  view.eventCounts.assign(s.counts.begin(), s.counts.end());
  std::lock_guard<std::mutex> lock(mu_);
  view.startMs = s.view.startMs;
  s.view = std::move(view);
}

std::string statusJson(const JobView& v) {
  json::Value root = json::Value::object();
  root.set("run_id", v.runId);
  root.set("elastic", v.elastic);
  root.set("attempt", v.attempt);
  root.set("state", v.state);
  root.set("outcome", v.outcome);
  root.set("store_error", v.storeError);
  root.set("start_ms", v.startMs);
  root.set("now_ms", v.nowMs);
  root.set("step", v.step);
  root.set("steps", v.steps);
  root.set("loss", number(v.loss));
  root.set("rate", number(v.rate));
  root.set("unit", v.unit);
  json::Value members = json::Value::array();
  for (const MemberView& m : v.members) {
    json::Value o = json::Value::object();
    o.set("member", m.member);
    o.set("rank", m.rank);
    o.set("host", m.host);
    o.set("state", m.state);
    o.set("reason", m.reason);
    o.set("step", m.step);
    o.set("loss", number(m.loss));
    o.set("rate", number(m.rate));
    o.set("rss_bytes", m.rssBytes);
    o.set("last_op", m.lastOp);
    o.set("heartbeat_age_s", m.heartbeatAgeS < 0 ? json::Value() : number(m.heartbeatAgeS));
    members.push(std::move(o));
  }
  root.set("members", std::move(members));
  json::Value events = json::Value::array();
  for (const JobEvent& e : v.events) {
    json::Value o = json::Value::object();
    o.set("time_ms", e.timeMs);
    o.set("kind", e.kind);
    o.set("text", e.text);
    events.push(std::move(o));
  }
  root.set("events", std::move(events));
  json::Value curve = json::Value::array();
  for (const status::CurvePoint& p : v.curve) {
    json::Value o = json::Value::object();
    o.set("step", p.step);
    o.set("loss", number(p.loss));
    o.set("rate", number(p.rate));
    json::Value metrics = json::Value::object();
    for (const auto& [name, value] : p.metrics) metrics.set(name, number(value));
    o.set("metrics", std::move(metrics));
    curve.push(std::move(o));
  }
  root.set("curve", std::move(curve));
  return root.dump();
}

std::string prometheusText(const JobView& v) {
  std::string out;
  auto family = [&](const char* name, const char* type, const std::string& help) {
    out += str("# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  };
  auto sample = [&](const char* name, const std::string& labels, double value) {
    if (!std::isfinite(value)) return;  // unknown: no sample rather than NaN
    out += str(name, labels.empty() ? std::string() : str("{", labels, "}"), " ", promNumber(value), "\n");
  };
  auto memberLabels = [](const MemberView& m) {
    return str("member=\"", m.member, "\",rank=\"", m.rank, "\",host=\"", promLabel(m.host), "\"");
  };
  family("dtrain_job_step", "gauge", "Steps applied by the job (the furthest live member's at its last logged step).");
  if (v.step >= 0) sample("dtrain_job_step", "", static_cast<double>(v.step));
  family("dtrain_job_steps", "gauge", "Steps the job is to run.");
  if (v.steps > 0) sample("dtrain_job_steps", "", static_cast<double>(v.steps));
  family("dtrain_job_loss", "gauge", "Training loss at the newest logged step (mean over the ranks and the window).");
  sample("dtrain_job_loss", "", v.loss);
  family("dtrain_job_throughput", "gauge", "Units (samples, tokens) per second of the whole job over the newest log window.");
  sample("dtrain_job_throughput", str("unit=\"", promLabel(v.unit), "\""), v.rate);
  family("dtrain_job_metric", "gauge", "The newest value of each figure the step function or the evaluation reported (validation loss, accuracy).");
  std::map<std::string, double> newest;
  for (const auto& p : v.curve) {
    for (const auto& [name, value] : p.metrics) newest[name] = value;
  }
  for (const auto& [name, value] : newest) sample("dtrain_job_metric", str("name=\"", promLabel(name), "\""), value);
  family("dtrain_job_members", "gauge", "Members by state (starting, joining, running, dead, left, finished).");
  std::map<std::string, int> states;
  for (const auto& m : v.members) ++states[m.state];
  for (const auto& [state, n] : states) sample("dtrain_job_members", str("state=\"", state, "\""), n);
  family("dtrain_job_events_total", "counter", "Events seen since dtrun started, by kind (death, join, recovery, admission, straggler, checkpoint, start, finish).");
  for (const auto& [kind, n] : v.eventCounts) sample("dtrain_job_events_total", str("kind=\"", promLabel(kind), "\""), static_cast<double>(n));
  family("dtrain_member_up", "gauge", "1 while the member runs, else 0 (the state label says why).");
  for (const auto& m : v.members) {
    sample("dtrain_member_up", str(memberLabels(m), ",state=\"", m.state, "\""), m.state == "running" ? 1 : 0);
  }
  family("dtrain_member_step", "gauge", "Steps the member had applied at its last logged step.");
  for (const auto& m : v.members) {
    if (m.step >= 0) sample("dtrain_member_step", memberLabels(m), static_cast<double>(m.step));
  }
  family("dtrain_member_rss_bytes", "gauge", "The member's resident set at its last logged step.");
  for (const auto& m : v.members) {
    if (m.rssBytes >= 0) sample("dtrain_member_rss_bytes", memberLabels(m), static_cast<double>(m.rssBytes));
  }
  family("dtrain_member_heartbeat_age_seconds", "gauge", "Seconds since the member's heartbeat (elastic) or its status record last changed.");
  for (const auto& m : v.members) {
    if (m.heartbeatAgeS >= 0) sample("dtrain_member_heartbeat_age_seconds", memberLabels(m), m.heartbeatAgeS);
  }
  return out;
}

}  // namespace dt::launcher

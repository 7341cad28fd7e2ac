#include "process_group/shm/core_placement.h"

#include <dirent.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

namespace dt::shm {

std::vector<uint8_t> CoreIdleSampler::sample() {
  std::vector<Times> now;
  FILE* f = std::fopen("/proc/stat", "r");
  if (f == nullptr) return {};
  char line[512];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    // "cpu3 user nice system idle iowait irq softirq steal ..." (the aggregate "cpu " line is skipped)
    unsigned core = 0;
    unsigned long long v[8] = {};
    if (std::strncmp(line, "cpu", 3) != 0 || line[3] < '0' || line[3] > '9') continue;
    if (std::sscanf(line + 3, "%u %llu %llu %llu %llu %llu %llu %llu %llu", &core, &v[0], &v[1], &v[2], &v[3], &v[4],
                    &v[5], &v[6], &v[7]) < 5) {
      continue;
    }
    if (core >= now.size()) now.resize(core + 1);
    now[core].idle = v[3] + v[4];
    now[core].total = v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
  }
  std::fclose(f);
  std::vector<uint8_t> idle;
  if (!last_.empty()) {
    idle.assign(now.size(), 0);
    for (size_t c = 0; c < now.size() && c < last_.size(); ++c) {
      const uint64_t total = now[c].total - last_[c].total;
      const uint64_t quiet = now[c].idle - last_[c].idle;
      // An offline core (no ticks counted) is not idle: nothing can run there.
      idle[c] = total == 0 ? 0 : static_cast<uint8_t>(std::min<uint64_t>(100, quiet * 100 / total));
    }
  }
  last_ = std::move(now);
  return idle;
}

int runnableThreads() {
  FILE* f = std::fopen("/proc/stat", "r");
  if (f == nullptr) return -1;
  char line[512];
  int runnable = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "procs_running %d", &runnable) == 1) break;
  }
  std::fclose(f);
  return runnable;
}

namespace {

bool isNumber(const char* name) {
  if (*name == '\0') return false;
  for (; *name != '\0'; ++name) {
    if (*name < '0' || *name > '9') return false;
  }
  return true;
}

// 'R', 'S', ... from "<tid> (<comm>) <state> ...": comm may hold ')' and spaces, so the last ')'.
char taskState(const std::string& statPath) {
  FILE* f = std::fopen(statPath.c_str(), "r");
  if (f == nullptr) return '\0';  // the task exited meanwhile
  char line[512];
  const size_t n = std::fread(line, 1, sizeof line - 1, f);
  std::fclose(f);
  line[n] = '\0';
  const char* close = std::strrchr(line, ')');
  return close != nullptr && close[1] == ' ' ? close[2] : '\0';
}

}  // namespace

int runnableThreadsListed(const char* procRoot) {
  DIR* processes = ::opendir(procRoot);
  if (processes == nullptr) return -1;
  int runnable = 0;
  while (const dirent* process = ::readdir(processes)) {
    if (!isNumber(process->d_name)) continue;
    const std::string tasksPath = std::string(procRoot) + "/" + process->d_name + "/task";
    DIR* tasks = ::opendir(tasksPath.c_str());
    if (tasks == nullptr) continue;  // the process exited meanwhile
    while (const dirent* task = ::readdir(tasks)) {
      if (isNumber(task->d_name) && taskState(tasksPath + "/" + task->d_name + "/stat") == 'R') ++runnable;
    }
    ::closedir(tasks);
  }
  ::closedir(processes);
  return runnable;
}

int chooseIdleCore(const cpu_set_t& allowed, int here, const std::vector<int>& taken, int runnable,
                   const std::vector<uint8_t>& idlePercent, int minIdlePercent, bool acceptBusyCore) {
  if (runnable < 0) return -1;
  const auto ranksOn = [&](int core) { return static_cast<int>(std::count(taken.begin(), taken.end(), core)); };
  const int others = CPU_COUNT(&allowed) - (CPU_ISSET(here, &allowed) ? 1 : 0);
  int best = -1;
  // Every other allowed core may be busy (with acceptBusyCore: may run four threads, see the header).
  if (runnable - 2 < (acceptBusyCore ? 4 : 1) * others) {
    if (acceptBusyCore) minIdlePercent = 0;
    int bestScore = -1;
    for (int core = 0; core < CPU_SETSIZE; ++core) {
      if (core == here || !CPU_ISSET(core, &allowed) || ranksOn(core) > 0) continue;
      const int idle = core < static_cast<int>(idlePercent.size()) ? idlePercent[core] : kIdleUnknown;
      if (idle != kIdleUnknown && idle < minIdlePercent) continue;
      const int score = idle == kIdleUnknown ? 0 : idle + 1;  // a known idle core before an unknown one
      if (score > bestScore) {
        best = core;
        bestScore = score;
      }
    }
  }
  if (best >= 0) return best;
  // More ranks than cores: even out the group's own ranks (see the header).
  const int crowd = ranksOn(here) + 1;
  int fewest = crowd - 1;
  for (int core = 0; core < CPU_SETSIZE; ++core) {
    if (core == here || !CPU_ISSET(core, &allowed)) continue;
    const int ranks = ranksOn(core);
    if (ranks > 0 && ranks < fewest) {
      best = core;
      fewest = ranks;
    }
  }
  return best;
}

int chooseStepAsideCore(const cpu_set_t& allowed, int here, const std::vector<int>& taken,
                        const std::vector<uint8_t>& idlePercent, int minIdlePercent, bool acceptBusyCore,
                        const std::function<int()>& procsRunning, const std::function<int()>& listed) {
  const int runnable = procsRunning();
  const int core = chooseIdleCore(allowed, here, taken, runnable, idlePercent, minIdlePercent, acceptBusyCore);
  if (core >= 0 || !acceptBusyCore) return core;
  const int listedRunnable = listed();
  if (listedRunnable < 0 || listedRunnable >= runnable) return core;
  return chooseIdleCore(allowed, here, taken, listedRunnable, idlePercent, minIdlePercent, acceptBusyCore);
}

void forgetSharesOfGroupCores(std::vector<uint8_t>& idlePercent, const std::vector<int>& groupCoresAtStart,
                              const std::vector<int>& groupCoresAtEnd) {
  for (const auto* cores : {&groupCoresAtStart, &groupCoresAtEnd}) {
    for (int core : *cores) {
      if (core >= 0 && core < static_cast<int>(idlePercent.size())) idlePercent[core] = kIdleUnknown;
    }
  }
}

void StepAsideBackoff::refused(Clock::time_point now) {
  next_ = now + pause_;
  pause_ = std::min(pause_ * 2, kLongestPause);
}

void StepAsideBackoff::moved(Clock::time_point now) {
  pause_ = kFirstPause;
  next_ = now + pause_;
}

bool moveCallingThreadTo(int core) {
  if (core < 0 || core >= CPU_SETSIZE) return false;
  cpu_set_t previous;
  if (::sched_getaffinity(0, sizeof previous, &previous) != 0 || !CPU_ISSET(core, &previous)) return false;
  cpu_set_t only;
  CPU_ZERO(&only);
  CPU_SET(core, &only);
  if (::sched_setaffinity(0, sizeof only, &only) != 0) return false;
  (void)::sched_setaffinity(0, sizeof previous, &previous);
  return true;
}

}  // namespace dt::shm

#include "tests/elastic/supervise.h"

#include <optional>
#include <thread>
#include <vector>

#include "common/strings.h"
#include "store/membership.h"

namespace dt::testing {

using namespace std::chrono_literals;

void superviseUntilDone(SpawnedRanks& ranks, std::chrono::milliseconds liveness) {
  const int world = ranks.worldSize();
  std::vector<bool> posted(static_cast<size_t>(world), false);
  std::vector<std::optional<uint64_t>> lastBeat(static_cast<size_t>(world));
  std::vector<std::chrono::steady_clock::time_point> beatSeen(static_cast<size_t>(world), std::chrono::steady_clock::now());
  while (true) {
    bool running = false;
    for (int r = 0; r < world; ++r) {
      const auto s = ranks.state(r);
      running |= s != RankState::Ended;
      if (posted[static_cast<size_t>(r)]) continue;
      if (s == RankState::Ended) {
        membership::postDeath(ranks.store(), r, "exited: signal SIGKILL");
        posted[static_cast<size_t>(r)] = true;
        continue;
      }
      const auto beat = membership::heartbeatOf(ranks.store(), r);
      const auto now = std::chrono::steady_clock::now();
      if (beat != lastBeat[static_cast<size_t>(r)]) {
        lastBeat[static_cast<size_t>(r)] = beat;
        beatSeen[static_cast<size_t>(r)] = now;
      } else if (beat && now - beatSeen[static_cast<size_t>(r)] > liveness) {
        membership::postDeath(ranks.store(), r, str("stopped responding: no heartbeat for ",
                                                    formatDuration(liveness), " (frozen or hung)"));
        posted[static_cast<size_t>(r)] = true;
        ranks.kill(r);
      }
    }
    if (!running) return;
    std::this_thread::sleep_for(20ms);
  }
}

}  // namespace dt::testing

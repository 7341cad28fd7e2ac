// The launcher's part in tests of elastic jobs on forked ranks (testing/spawn.h), as dtrun
// --elastic plays it: a rank that ended is posted dead at once (store/membership.h); a rank
// whose heartbeat stopped for `liveness` is posted dead and killed. Returns once every rank
// has ended. Shared by the elastic and the sharded-wrapper tests.
#pragma once

#include <chrono>

#include "testing/spawn.h"

namespace dt::testing {

void superviseUntilDone(SpawnedRanks& ranks, std::chrono::milliseconds liveness = std::chrono::seconds(2));

}  // namespace dt::testing

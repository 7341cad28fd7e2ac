// SLURM hostlist expressions and the SLURM-derived rendezvous port.
//
// Contract: pure functions, thread-safe, no I/O. Used by initProcessGroup
// (first host of SLURM_JOB_NODELIST) and by the launcher, so both sides agree.
//
// Grammar (what SLURM prints in SLURM_JOB_NODELIST / SLURM_NODELIST):
//   list   := item ("," item)*
//   item   := (text | "[" ranges "]")+          e.g. gpu-a[01-04,07]-ib, rack[1-2]n[3-4]
//   ranges := range ("," range)*,  range := N | N "-" M
// Commas inside brackets separate ranges, outside they separate hosts. A range
// keeps the zero padding of its lower bound ("01-10" -> 01, 02, ..., 10).
// Several bracket groups in one item expand as a cartesian product, leftmost
// group varying slowest (SLURM's order). Malformed input throws
// dt::InvalidArgument quoting the expression and the position.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dt {

// "gpu-a[01-02],gpu-b3" -> {"gpu-a01", "gpu-a02", "gpu-b3"}. Throws
// InvalidArgument for malformed input or more than `maxHosts` hosts (a guard
// against "n[0-999999999]").
std::vector<std::string> expandHostlist(std::string_view expression, size_t maxHosts = 1 << 20);

// The first host of a hostlist without expanding the rest.
std::string firstHostInHostlist(std::string_view expression);

// The rendezvous port dtrain derives from SLURM_JOB_ID when MASTER_PORT is not
// set, identical in initProcessGroup and in dtrun:
//     port = 20000 + (jobId mod 10000)
// i.e. in [20000, 29999], below Linux's default ephemeral range (32768+), so
// concurrent jobs on one node get different ports unless their ids collide
// mod 10000. Throws InvalidArgument when jobId is not a non-negative integer.
uint16_t slurmDerivedPort(std::string_view jobId);

}  // namespace dt

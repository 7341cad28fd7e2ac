// SLURM mode: one dtrun per node inside an srun step
// (`srun --ntasks-per-node=1 dtrun --nproc 4 ./trainer`).
//
// Contract: applySlurm is pure (reads only `lookup`). It fills --nnodes,
// --node-rank, --master-addr and --master-port from SLURM_NNODES,
// SLURM_NODEID, the first host of SLURM_JOB_NODELIST and
// slurmDerivedPort(SLURM_JOB_ID), each only where the user did not set the
// option. Mode "auto" applies only inside an srun step that runs one task per
// node (SLURM_STEP_ID set and SLURM_STEP_NUM_TASKS == SLURM_STEP_NUM_NODES), so
// a dtrun started directly in a batch script, or once per task, is left
// alone; "on" requires the variables and throws InvalidArgument naming the
// missing one; "off" never applies. Returns whether SLURM values were used.
#pragma once

#include "launcher/options.h"

namespace dt::launcher {

bool applySlurm(LaunchOptions& options, const EnvLookup& lookup);

}  // namespace dt::launcher

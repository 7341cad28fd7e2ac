#!/usr/bin/env bash
# ctest fixture for dtrun's SLURM tests: a private two-node SLURM cluster (tests/slurm/cluster.sh)
# in its own state folder and ports, so that it never meets another suite's cluster.
#   slurm_fixture.sh up|down
# SLURM tests never skip: when the cluster cannot be started this fails, with the reason and the
# daemons' logs, and so do the tests that need it.
set -euo pipefail
CLUSTER=$(cd "$(dirname "${BASH_SOURCE[0]}")/../slurm" && pwd)/cluster.sh
STATE=/tmp/slurm-dtrun-launcher
PORT=6917

case ${1:-} in
  up)
    # A cluster left in this folder by an interrupted run may still hold its jobs: start afresh.
    # --timeout 30: even two failed tries (cgroup, then linuxproc) end within ctest's 180 s, so
    # the logs below get printed.
    "$CLUSTER" down --dir "$STATE"
    if ! "$CLUSTER" up --nodes 2 --dir "$STATE" --port "$PORT" --timeout 30; then
      # cluster.sh said what failed; the logs' tails say why (less a fresh controller's notes
      # about its missing saved state).
      for log in "$STATE"/log/*.log; do
        [[ -e $log ]] || continue
        echo "----- tail of $log"
        grep -vE 'state file|backup state save file' "$log" | tail -n 30
      done
      echo "slurm_fixture: FAILED to start the SLURM cluster (reason above); the DtrunSlurm tests fail too." >&2
      echo "slurm_fixture: is SLURM installed (scripts/setup.sh) and is this run as root?" >&2
      exit 1
    fi
    ;;
  down)
    "$CLUSTER" down --dir "$STATE"
    ;;
  *)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac

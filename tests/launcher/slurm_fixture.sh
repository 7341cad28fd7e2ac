#!/usr/bin/env bash
# ctest fixture for dtrun's SLURM tests: a private two-node SLURM cluster
# (../shared/slurm/up --nodes 2) in its own state folder and ports, so that it
# never collides with another suite's cluster.
#   slurm_fixture.sh SLURM_DIR up|down
# Never fails the suite: when SLURM cannot be started, the tests skip and say why.
set -uo pipefail
SLURM_DIR=$1
ACTION=$2
STATE=/tmp/slurm-dtrun-launcher
PORT=6917
if [ ! -x "$SLURM_DIR/up" ]; then
  echo "slurm_fixture: $SLURM_DIR/up not found; the SLURM tests will skip"
  exit 0
fi
case "$ACTION" in
  up)
    # `up` points /etc/slurm/slurm.conf at the newest cluster; keep another
    # cluster's link where it was (our tests set SLURM_CONF themselves).
    prev=$(readlink /etc/slurm/slurm.conf 2>/dev/null || true)
    if ! "$SLURM_DIR/up" --nodes 2 --dir "$STATE" --port "$PORT"; then
      echo "slurm_fixture: up failed; the SLURM tests will skip"
      exit 0
    fi
    if [ -n "$prev" ] && [ "$prev" != "$STATE/slurm.conf" ]; then ln -sfn "$prev" /etc/slurm/slurm.conf; fi
    ;;
  down)
    "$SLURM_DIR/down" --dir "$STATE" || true
    ;;
esac
exit 0

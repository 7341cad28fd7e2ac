#!/usr/bin/env bash
# A private SLURM cluster on this machine, reachable on 127.0.0.1 only, for dtrain's tests
# (and for trying dtrun under srun/sbatch by hand). See README.md beside this script.
#
#   tests/slurm/cluster.sh up   [--nodes N] [--cpus C] [--dir DIR] [--port P] [--timeout S]
#   tests/slurm/cluster.sh down [--dir DIR]
#
#   --nodes N    1 (default): one node named "localhost"; N > 1: emulated nodes node1..nodeN,
#                one slurmd each (the node names go into a marked line of /etc/hosts)
#   --cpus C     CPUs each node advertises (default: twice the real cores, at least 8)
#   --dir DIR    folder holding all of the cluster's state (default /tmp/dtrain-slurm)
#   --port P     slurmctld's port (default 6817); node i's slurmd listens on P+i
#   --timeout S  how long `up` waits for the controller and for the nodes (default 60)
#
# Environment: DT_SLURM_PROCTRACK=auto|cgroup|linuxproc, DT_SLURM_AUTH=auto|none|munge.
# Both subcommands are idempotent. Needs root (the daemons run as root) and the Debian
# packages slurmctld, slurmd, slurm-client (scripts/setup.sh installs them).
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
CMD=${1:-}
[[ $CMD == up || $CMD == down ]] || { sed -n '2,/^set -euo/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; exit 2; }
shift

say() { echo "cluster.sh $CMD: $*"; }
die() { echo "cluster.sh $CMD: error: $*" >&2; exit 1; }

NODES=1
CPUS=$(( $(nproc) * 2 > 8 ? $(nproc) * 2 : 8 ))
STATE=/tmp/dtrain-slurm
PORT=6817
TIMEOUT=60
PROCTRACK=${DT_SLURM_PROCTRACK:-auto}
AUTH=${DT_SLURM_AUTH:-auto}
while (($#)); do
  case $1 in
    --nodes | --cpus | --dir | --port | --timeout)
      (($# >= 2)) || die "$1 needs a value"
      case $1 in
        --nodes) NODES=$2 ;; --cpus) CPUS=$2 ;; --dir) STATE=$2 ;; --port) PORT=$2 ;; --timeout) TIMEOUT=$2 ;;
      esac
      shift 2 ;;
    *) die "unknown argument '$1' (run without arguments for help)" ;;
  esac
done

# Everything below is rm -rf'd by down and spliced into slurm.conf, so keep the folder's name
# plain and away from folders that hold other things.
STATE=${STATE%/}
[[ $STATE =~ ^/[A-Za-z0-9._/-]+$ ]] || die "--dir must be an absolute path of plain characters, got '$STATE'"
case $STATE in / | /tmp | /var | /var/tmp | /root | /home | /etc | /usr) die "refusing --dir $STATE" ;; esac
[[ $(id -u) == 0 ]] || die "must run as root (slurmctld and slurmd run as root here)"

CONF=$STATE/slurm.conf
MARK=$STATE/.dtrain-slurm        # says "made by cluster.sh" and what was asked for
HOSTS_TAG="# dtrain-slurm $STATE" # ends the /etc/hosts line of this cluster's node names

# Prints the pid in pid file $1 if that process is the daemon $2 started on this cluster's
# config; a stale pid file may name a pid that now belongs to anything else.
daemon_pid() {
  local pid
  pid=$(tr -dc 0-9 2>/dev/null <"$1") || return 1
  [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1
  if [[ $2 == munged ]]; then
    tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -qxF -- "--socket=$STATE/munge/socket" || return 1
  else
    tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -qxF -- "$CONF" || return 1
  fi
  echo "$pid"
}

alive() { [[ -d /proc/$1 && $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) != Z ]]; }

# SIGTERM, then SIGKILL whatever is still there after 10 s. Returns 1 if something survives.
stop_pids() {
  local what=$1 p left=()
  shift
  (($#)) || return 0
  say "stopping $what ($*)"
  kill -TERM "$@" 2>/dev/null || true
  for _ in $(seq 50); do
    left=()
    for p in "$@"; do alive "$p" && left+=("$p"); done
    ((${#left[@]})) || return 0
    sleep 0.2
  done
  say "$what still running after 10 s, killing ${left[*]}"
  kill -KILL "${left[@]}" 2>/dev/null || true
  sleep 0.5
  for p in "${left[@]}"; do alive "$p" && { echo "cluster.sh $CMD: error: pid $p does not die" >&2; return 1; }; done
  return 0
}

# slurmstepd rewrites its command line ("slurmstepd: [12.0]") and outlives slurmd, so it is
# recognised by what it holds open: its node's log and spool files in this state folder.
stepd_pids() {
  local d link
  for d in /proc/[0-9]*; do
    [[ $(cat "$d/comm" 2>/dev/null) == slurmstepd ]] || continue
    for link in "$d/cwd" "$d"/fd/*; do
      if [[ $(readlink "$link" 2>/dev/null) == "$STATE/"* ]]; then
        echo "${d#/proc/}"
        break
      fi
    done
  done
}

# Job processes that outlived their step (proctrack/linuxproc loses those that setsid or
# daemonize): their environment names this cluster's config and a job. Never this script
# or a process it runs under (down may be called from a shell inside a job).
job_pids() {
  local keep=" " p=$$ f
  while [[ -n $p && $p != 0 && $p != 1 ]]; do
    keep+="$p "
    p=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null) || break
  done
  grep -lzxF -- "SLURM_CONF=$CONF" /proc/[0-9]*/environ 2>/dev/null | while read -r f; do
    p=${f#/proc/}
    p=${p%/environ}
    [[ $keep == *" $p "* ]] && continue
    grep -qz '^SLURM_JOB_ID=' "$f" 2>/dev/null && echo "$p"
  done || true
}

node_names() {
  if [[ $1 == 1 ]]; then echo localhost; else seq -f 'node%g' 1 "$1"; fi
}

# shellcheck disable=SC2094 # /etc/hosts is read whole before it is rewritten
remove_hosts_line() {
  grep -qF -- "$HOSTS_TAG" /etc/hosts 2>/dev/null || return 0
  # Clusters starting or stopping side by side take turns on /etc/hosts (locked through a
  # read-only descriptor of the file itself).
  (
    flock -w 30 9 || true
    local kept
    kept=$(grep -vF -- "$HOSTS_TAG" /etc/hosts || true)
    # Rewritten in place, not replaced: in a container /etc/hosts is often a bind mount.
    printf '%s\n' "$kept" >/etc/hosts
  ) 9</etc/hosts
}

# ------------------------------------------------------------------------------------- down
cluster_down() {
  if [[ ! -e $STATE ]]; then
    remove_hosts_line
    say "no cluster in $STATE"
    return 0
  fi
  [[ -e $MARK ]] || die "$STATE was not made by cluster.sh; leaving it alone"
  export SLURM_CONF=$CONF
  local failed=0 ctld jobs f p pids=() nodes

  ctld=$(daemon_pid "$STATE/run/slurmctld.pid" slurmctld) || ctld=
  if [[ -n $ctld ]]; then
    # Cancelled through the controller first, so that slurmd ends the steps the normal way.
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null | tr '\n' ' ') || jobs=
    if [[ -n ${jobs// /} ]]; then
      say "cancelling jobs $jobs"
      # shellcheck disable=SC2086
      timeout 10 scancel $jobs 2>/dev/null || true
      for _ in $(seq 75); do
        [[ -z $(timeout 10 squeue -h -o %i 2>/dev/null) ]] && break
        sleep 0.2
      done
    fi
  fi

  for f in "$STATE"/run/slurmd-*.pid; do
    if p=$(daemon_pid "$f" slurmd); then pids+=("$p"); fi
  done
  stop_pids slurmd "${pids[@]}" || failed=1
  [[ -z $ctld ]] || stop_pids slurmctld "$ctld" || failed=1
  if p=$(daemon_pid "$STATE/run/munged.pid" munged); then stop_pids munged "$p" || failed=1; fi

  mapfile -t pids < <(job_pids)
  stop_pids "leftover job processes" "${pids[@]}" || failed=1
  # A step daemon whose slurmd is gone ignores SIGTERM and has nobody left to report to.
  mapfile -t pids < <(stepd_pids)
  if ((${#pids[@]})); then
    say "killing leftover slurmstepd (${pids[*]})"
    kill -KILL "${pids[@]}" 2>/dev/null || true
    stop_pids slurmstepd "${pids[@]}" || failed=1
  fi

  # proctrack/cgroup leaves a slurm_<node> folder in each cgroup v1 hierarchy; only empty
  # ones are removed (rmdir refuses the others).
  if grep -q 'proctrack/cgroup' "$MARK"; then
    nodes=$(sed -n 's/^nodes=\([0-9]*\).*/\1/p' "$MARK")
    for p in $(node_names "${nodes:-1}"); do
      for f in /sys/fs/cgroup/*/slurm_"$p"; do
        if [[ -d $f ]]; then find "$f" -depth -type d -exec rmdir {} + 2>/dev/null || true; fi
      done
    done
  fi

  remove_hosts_line
  ((failed == 0)) || die "some processes of the cluster in $STATE did not stop; its state folder is kept"
  rm -rf "$STATE"
  say "cluster in $STATE is down"
}

# --------------------------------------------------------------------------------------- up
[[ $CMD == down ]] && { cluster_down; exit 0; }

[[ $NODES =~ ^[1-9][0-9]?$ ]] || die "--nodes must be 1..99, got '$NODES'"
[[ $CPUS =~ ^[1-9][0-9]{0,3}$ ]] || die "--cpus must be a positive number, got '$CPUS'"
[[ $TIMEOUT =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive number of seconds, got '$TIMEOUT'"
if ! [[ $PORT =~ ^[1-9][0-9]{3,4}$ ]] || ((PORT < 1024 || PORT + NODES > 65535)); then
  die "--port must leave room for ports P..P+$NODES within 1024..65535, got '$PORT'"
fi
case $PROCTRACK in auto | cgroup | linuxproc) ;; *) die "DT_SLURM_PROCTRACK must be auto, cgroup or linuxproc" ;; esac
case $AUTH in auto | none | munge) ;; *) die "DT_SLURM_AUTH must be auto, none or munge" ;; esac
for c in slurmctld slurmd srun sbatch sinfo squeue scontrol scancel flock; do
  command -v "$c" >/dev/null || die "'$c' not found; install slurmctld slurmd slurm-client (scripts/setup.sh)"
done

START=$(date +%s.%N)
mapfile -t NODE_NAMES < <(node_names "$NODES")
if ((NODES == 1)); then NODELIST=localhost; else NODELIST="node[1-$NODES]"; fi
WANT="nodes=$NODES cpus=$CPUS port=$PORT proctrack=$PROCTRACK auth=$AUTH"
export SLURM_CONF=$CONF

nodes_idle() {
  local states
  states=$(timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
  [[ $(awk '$2 == "idle" {print $1}' <<<"$states" | sort -u | wc -l) == "$NODES" ]]
}

# wait_for ALIVE CHECK: until CHECK passes, for at most --timeout seconds; gives up early when
# ALIVE says a daemon is gone (after a second's grace for it to write its pid file).
wait_for() {
  local deadline=$(($(date +%s) + TIMEOUT)) t=0
  until $2; do
    ((t++ < 5)) || $1 || { echo "a daemon exited"; return 1; }
    (($(date +%s) < deadline)) || { echo "no answer after ${TIMEOUT}s"; return 1; }
    sleep 0.2
  done
}
ctld_alive() { daemon_pid "$STATE/run/slurmctld.pid" slurmctld >/dev/null; }
ctld_up() { timeout 10 scontrol ping 2>/dev/null | grep -q UP; }
slurmds_alive() {
  local n
  for n in "${NODE_NAMES[@]}"; do daemon_pid "$STATE/run/slurmd-$n.pid" slurmd >/dev/null || return 1; done
}

cluster_running() { ctld_alive && slurmds_alive && ctld_up; }

usage_lines() {
  local elapsed
  elapsed=$(awk -v a="$START" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  say "$1 (${elapsed}s): $NODES node(s) $NODELIST, $CPUS CPUs each, $(sed -n 's/^using //p' "$MARK")"
  echo "  export SLURM_CONF=$CONF      # or: . $STATE/env"
  echo "  srun -N $NODES --ntasks-per-node=2 bash -c 'echo \$SLURM_NODEID \$SLURM_PROCID'"
  echo "  logs: $STATE/log/    stop: $SELF down --dir $STATE"
}

if [[ -e $MARK ]]; then
  if [[ $(sed -n 1p "$MARK") == "$WANT" ]] && cluster_running && nodes_idle; then
    usage_lines "already up"
    exit 0
  fi
  say "the cluster in $STATE is stopped, broken or set up differently; restarting it"
  "$SELF" down --dir "$STATE" >/dev/null || die "could not take down the old cluster in $STATE (run: $SELF down --dir $STATE)"
elif [[ -e $STATE ]]; then
  die "$STATE exists and was not made by cluster.sh; choose another --dir"
fi

for ((p = PORT; p <= PORT + NODES; p++)); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
    die "port $p on 127.0.0.1 is taken (another cluster?); choose another --port"
  fi
done

PLUGINS=$(dirname "$(find /usr/lib /usr/lib64 /usr/local/lib -name proctrack_linuxproc.so -print -quit 2>/dev/null)")
[[ -e $PLUGINS/proctrack_linuxproc.so ]] || die "SLURM's plugin folder not found"
if [[ $AUTH == auto ]]; then
  # auth/none needs no munged; Debian 12's SLURM 22.05 still ships it.
  if [[ -e $PLUGINS/auth_none.so && -e $PLUGINS/cred_none.so ]]; then AUTH=none; else AUTH=munge; fi
fi
if [[ $AUTH == munge ]]; then command -v munged >/dev/null || die "auth/munge needs munged (package munge)"; fi

# proctrack/cgroup ends every process of a step, even one that setsid()s; it needs the cgroup v1
# freezer. Where that is missing or read-only (most containers), linuxproc tracks by parentage.
freezer_writable() {
  local probe=/sys/fs/cgroup/freezer/dtrain-slurm-probe-$$
  grep -qE '^\S+ /sys/fs/cgroup/freezer cgroup \S*freezer' /proc/mounts && mkdir "$probe" 2>/dev/null || return 1
  rmdir "$probe"
}
case $PROCTRACK in
  auto) if freezer_writable; then TRIES=(cgroup linuxproc); else TRIES=(linuxproc); fi ;;
  cgroup) freezer_writable || die "proctrack/cgroup needs a writable cgroup v1 freezer at /sys/fs/cgroup/freezer"; TRIES=(cgroup) ;;
  *) TRIES=(linuxproc) ;;
esac

write_config() {
  local proctrack=$1 i mem
  mem=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
  {
    echo "# Written by tests/slurm/cluster.sh up; removed by cluster.sh down."
    echo "ClusterName=dtrain"
    echo "SlurmctldHost=localhost(127.0.0.1)"
    echo "SlurmctldPort=$PORT"
    # Nothing listens beyond loopback: not the daemons, not srun.
    echo "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny"
    if [[ $AUTH == none ]]; then
      echo "AuthType=auth/none"
      echo "CredType=cred/none"
    else
      echo "AuthType=auth/munge"
      echo "CredType=cred/munge"
      echo "AuthInfo=socket=$STATE/munge/socket"
    fi
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "StateSaveLocation=$STATE/ctld"
    echo "SlurmdSpoolDir=$STATE/spool/%n"
    echo "SlurmctldPidFile=$STATE/run/slurmctld.pid"
    echo "SlurmdPidFile=$STATE/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$STATE/log/slurmctld.log"
    echo "SlurmdLogFile=$STATE/log/slurmd-%n.log"
    echo "ProctrackType=proctrack/$proctrack"
    # No CPU binding: the nodes advertise more CPUs than the machine has (config_overrides).
    echo "TaskPlugin=task/none"
    echo "SlurmdParameters=config_overrides"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SchedulerType=sched/builtin"
    echo "MpiDefault=none"
    # Finished jobs vanish after 5 s (sbatch --wait polls faster than that); cancelled steps
    # get 5 s between SIGTERM and SIGKILL; a node that was down comes back by itself.
    echo "MinJobAge=5"
    echo "KillWait=5"
    echo "ReturnToService=2"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "JobCompType=jobcomp/none"
    echo "MailProg=/bin/true"
    for ((i = 1; i <= NODES; i++)); do
      echo "NodeName=${NODE_NAMES[i - 1]} NodeAddr=127.0.0.1 NodeHostname=${NODE_NAMES[i - 1]} Port=$((PORT + i))" \
        "CPUs=$CPUS RealMemory=$mem State=UNKNOWN"
    done
    echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
  } >"$CONF"
  # Read by proctrack/cgroup only; no resource is constrained.
  printf '%s\n' CgroupPlugin=cgroup/v1 CgroupMountpoint=/sys/fs/cgroup ConstrainCores=no \
    ConstrainRAMSpace=no ConstrainSwapSpace=no ConstrainDevices=no >"$STATE/cgroup.conf"
  echo "export SLURM_CONF=$CONF" >"$STATE/env"
}

# The last lines of log $1, less the complaints every fresh controller makes about its missing
# saved state.
show_log() {
  echo "--- last lines of $1:"
  if [[ -e $1 ]]; then
    grep -vE 'state file|backup state save file' "$1" | tail -n 15 | sed 's/^/    /'
  else
    echo "    (no log)"
  fi
}

# Starts every daemon with proctrack/$1; prints what failed and returns 1 if the cluster does
# not answer with all nodes idle in time.
start_cluster() {
  local proctrack=$1 n why
  rm -rf "$STATE"
  mkdir -p "$STATE"/{ctld,log,run}
  for n in "${NODE_NAMES[@]}"; do mkdir -p "$STATE/spool/$n"; done
  printf '%s\nusing proctrack/%s, auth/%s\n' "$WANT" "$proctrack" "$AUTH" >"$MARK"
  write_config "$proctrack"

  if [[ $AUTH == munge ]]; then
    # A private munged with its own key and socket: the machine's munge is left alone.
    mkdir -m 700 "$STATE/munge"
    head -c 1024 /dev/urandom >"$STATE/munge/key" && chmod 400 "$STATE/munge/key"
    munged --force --key-file="$STATE/munge/key" --socket="$STATE/munge/socket" \
      --pid-file="$STATE/run/munged.pid" --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/seed" ||
      { echo "munged did not start; see $STATE/log/munged.log"; show_log "$STATE/log/munged.log"; return 1; }
  fi

  slurmctld -f "$CONF" || { echo "slurmctld did not start"; show_log "$STATE/log/slurmctld.log"; return 1; }
  if ! why=$(wait_for ctld_alive ctld_up); then
    echo "slurmctld is not up ($why); see $STATE/log/slurmctld.log"
    show_log "$STATE/log/slurmctld.log"
    return 1
  fi
  for n in "${NODE_NAMES[@]}"; do
    slurmd -f "$CONF" -N "$n" || { echo "slurmd for $n did not start"; show_log "$STATE/log/slurmd-$n.log"; return 1; }
  done
  if ! why=$(wait_for slurmds_alive nodes_idle); then
    echo "the nodes are not all idle ($why): $(timeout 10 sinfo -h -N -o '%N=%T' 2>/dev/null | tr '\n' ' ')"
    for n in "${NODE_NAMES[@]}"; do
      if ! daemon_pid "$STATE/run/slurmd-$n.pid" slurmd >/dev/null; then echo "slurmd for $n is not running"; fi
      show_log "$STATE/log/slurmd-$n.log"
    done
    show_log "$STATE/log/slurmctld.log"
    return 1
  fi
  cluster_running || { echo "a daemon exited after the nodes came up"; return 1; }
}

# dtrun (and anything else in a job) resolves the emulated node names; they all mean this
# machine. Added before slurmd starts, and checked: an older line for the same name would win.
# shellcheck disable=SC2094 # the lock's descriptor only reads
add_hosts_line() {
  local n addr
  ((NODES > 1)) || return 0
  (
    flock -w 30 9 || die "could not lock /etc/hosts"
    grep -qF -- "$HOSTS_TAG" /etc/hosts || echo "127.0.0.1 ${NODE_NAMES[*]} $HOSTS_TAG" >>/etc/hosts
  ) 9</etc/hosts
  for n in "${NODE_NAMES[@]}"; do
    addr=$(getent hosts "$n" | awk '{print $1; exit}')
    [[ $addr == 127.* ]] || { remove_hosts_line; die "$n resolves to '$addr', not 127.0.0.1: an earlier line of /etc/hosts names it"; }
  done
}

for proctrack in "${TRIES[@]}"; do
  add_hosts_line
  if report=$(start_cluster "$proctrack" 2>&1); then
    usage_lines up
    exit 0
  fi
  # Stop what this attempt started (the state folder goes too) before the next try or the end.
  mv "$STATE/log" "$STATE.log.$$" 2>/dev/null || true
  "$SELF" down --dir "$STATE" >/dev/null 2>&1 || true
  if [[ $proctrack != "${TRIES[-1]}" ]]; then
    rm -rf "$STATE.log.$$"
    say "proctrack/$proctrack did not come up, trying the next one:"
    # shellcheck disable=SC2001
    sed 's/^/  /' <<<"$report"
  fi
done
# Keep the logs of the last try in the state folder (down removes them) and say where they are.
mkdir -p "$STATE"
echo "failed attempt; no daemon running" >"$MARK"
rm -rf "$STATE/log"
mv "$STATE.log.$$" "$STATE/log" 2>/dev/null || true
echo "$report" >&2
die "the SLURM cluster did not come up; logs kept in $STATE/log/ ($SELF down --dir $STATE removes them)"

#!/usr/bin/env bash
# What a rank's death costs, one run: examples/trainer under `dtrun --elastic` at world 4, one
# member SIGKILLed during step KILL_STEP (trainer --fail-at M:STEP:forward; the others go on in
# place at world 3), against the same job in PyTorch 1.13 under `torchrun --max_restarts 1`
# with a checkpoint every CHECKPOINT_EVERY steps (bench/peers/torch_trainer.py --fail-at: the
# same rank killed at the same step, first attempt only; torchrun restarts every rank and they
# resume from the newest checkpoint). The job is run_trainer_bench.sh's: Fashion-MNIST, MLP
# 784-256-128-10, AdamW, global batch 128, DDP over gloo, one thread per rank, no evaluation.
#
# Each repetition runs, interleaved so that machine load hits all alike:
#   dtrain  elastic world 4 undisturbed, plain world 4 (no --elastic), elastic world 4 with the
#           kill, elastic world 3 undisturbed (the global batch split over 3, as after the kill),
#           elastic world 4 with the kill and --max-restarts 1 (the regrow: dtrun starts a
#           replacement, which the others admit and send the training state; --measure-transfer)
#   torch   world 4 undisturbed, world 4 with the kill (both checkpoint every CHECKPOINT_EVERY)
# Every number comes from the runs' step logs (trainer/peer --step-log: one line per committed
# step with its CLOCK_REALTIME time, "kill" written by the killed rank just before SIGKILL):
#   job_s         last step's commit - step 0's commit (start-up left out; wall_s has it)
#   step_ms       job_s / (steps - 1); step_p50_ms: the median of the steps' commit-to-commit times
#   recovery_ms   kill -> the first step committed after it in the new membership epoch (dtrain)
#                 or by the restarted attempt (torch)
#   back_ms       kill -> step KILL_STEP committed (progress back where the kill found it)
#   restart_ms    torch only: kill -> the restarted rank 0's process start (torchrun's detection,
#                 teardown and respawn; what is left of recovery_ms is import, data, rendezvous,
#                 checkpoint load and one step)
#   steps_lost    KILL_STEP - the first step committed after the kill (torch: steps since the
#                 checkpoint); steps_redone: step numbers committed in two epochs/attempts
#   cost_s        dtrain: kill job_s - (steps [0, KILL_STEP) of the undisturbed world-4 run +
#                 steps [KILL_STEP, end) of the undisturbed world-3 run), the same repetition's
#                 runs, from their commit times (step 0 left out everywhere, as in job_s);
#                 torch: kill job_s - undisturbed job_s
#   elastic cost  median step_ms of dtrain elastic world 4 / plain world 4 - 1
#   regrow: join_ms       the replacement's start -> the first step committed at world 4 after it
#                         joined (its start: when its main() began, from its "join" log line)
#           admitted_ms   its start -> its admission (the state received)
#           transfer_mb_s the state's bytes / the transfer's time (broadcastState, all of it)
#           bcast_mb_s    the same bytes in one plain broadcast on the same group, timed right after
#                         (busbw = algbw for a broadcast); transfer_vs_bcast = their ratio
# Prints the RESULT lines, their medians, RATIO lines (dtrain / torch), a table and the goals:
# recovery < 1 s and >= 10x faster than torch's, zero steps lost, cost < 1 s, elastic < 1 %.
#
# usage: bench/run_recovery_bench.sh   (env: REPS=3 STEPS=600 KILL_STEP=350 KILL_MEMBER=2
#                                       CHECKPOINT_EVERY=100 BATCH=128 RUN_TIMEOUT=600
#                                       DATA=/usr/share/datasets/fashion-mnist
#                                       DT_BUILD_DIR=build-bench OUT=file KEEP_LOGS=0)
#   REPS=3: about 6 minutes on 2 cores, most of it torch's start-ups and its restart
#
# Then, in the same run: a joiner's state transfer against one broadcast of the same bytes and
# its time to a first step (bench/state_transfer_bench.cpp: shm and gloo, the MLP and the 38M
# GPT, TRANSFER_REPS=5), and a whole node's loss (bench/run_node_loss_bench.sh: etcd and the
# TCP store, kill -> next commit, NODE_LOSS_REPS=5). SKIP_EXTRA=1 leaves both out.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
build=${DT_BUILD_DIR:-build-bench}
reps=${REPS:-3}
steps=${STEPS:-600}
kill_step=${KILL_STEP:-350}
kill_member=${KILL_MEMBER:-2}
ckpt_every=${CHECKPOINT_EVERY:-100}
batch=${BATCH:-128}
limit=${RUN_TIMEOUT:-600}
data=${DATA:-/usr/share/datasets/fashion-mnist}
peers=$repo/bench/peers
out=${OUT:-$(mktemp /tmp/recovery-bench.XXXXXX.txt)}
py=/usr/bin/python3

# Same BLAS for both: OpenBLAS (pthread build), one thread (see bench/peers/README.md).
openblas_dir=/usr/lib/x86_64-linux-gnu/openblas-pthread
if [ -d "$openblas_dir" ]; then export LD_LIBRARY_PATH="$openblas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 DT_NUM_THREADS=1

if [ ! -f "$data/train-images-idx3-ubyte.gz" ]; then
  echo "run_recovery_bench: no Fashion-MNIST in $data (scripts/setup.sh installs dataset-fashion-mnist)" >&2
  exit 2
fi
if ((kill_step < 1 || kill_step >= steps - 1)); then
  echo "run_recovery_bench: KILL_STEP=$kill_step must lie in [1, STEPS-1) (STEPS=$steps)" >&2
  exit 2
fi

echo "== building trainer and dtrun in $build" >&2
# Tests on for one target of theirs: the node-loss bench's elastic worker.
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TESTS=ON -DDT_BUILD_BENCH=ON -DDT_BUILD_EXAMPLES=ON >/dev/null &&
  cmake --build "$build" -j "${DT_JOBS:-2}" --target trainer dtrun state_transfer_bench dtrun_elastic_worker >/dev/null ||
  { echo "run_recovery_bench: building trainer failed" >&2; exit 2; }
dtrun="$build/launcher/dtrun"
trainer="$build/examples/trainer"

have_torch=1
"$py" -c "import torch, numpy" 2>/dev/null || { have_torch=0; echo "# torch peer skipped: $py cannot import torch and numpy (scripts/setup.sh --peers)" >&2; }

work=$(mktemp -d /tmp/recovery-bench.XXXXXX)
if [ "${KEEP_LOGS:-0}" = 1 ]; then echo "# step logs kept in $work" >&2; else trap 'rm -rf "$work"' EXIT; fi

# run NAME COMMAND...: one job under `timeout`, its output to $out.log; "NAME rc wall_ns" to runs.txt.
run() {
  local name=$1 t0 t1 rc
  shift
  echo "## $name: $*" >>"$out.log"
  t0=$(date +%s%N)
  timeout "$limit" "$@" >>"$out.log" 2>&1
  rc=$?
  t1=$(date +%s%N)
  echo "$name $rc $((t1 - t0))" >>"$work/runs.txt"
  [ $rc = 0 ] || echo "# $name exited with $rc (timeout $limit s: 124); see $out.log" >&2
}

dtrain_job() {  # NAME WORLD elastic|plain|regrow [FAIL]
  local name=$1 world=$2 mode=$3 fail=${4:-} elastic=() extra=()
  [ "$mode" != plain ] && elastic=(--elastic --min-nproc 2)
  [ "$mode" = regrow ] && elastic+=(--max-restarts 1) && extra=(--measure-transfer)
  run "$name" "$dtrun" --standalone --nproc "$world" "${elastic[@]}" --prefix none \
    "$trainer" --quiet --no-eval --checkpoint-dir none --data "$data" --global-batch "$batch" --steps "$steps" \
    --step-log "$work/$name.steps" ${fail:+--fail-at "$fail"} "${extra[@]}"
}

torch_job() {  # NAME [FAIL]
  local name=$1 fail=${2:-}
  run "$name" "$py" "$peers/torchrun_py311.py" --nproc_per_node 4 --standalone --max_restarts 1 \
    "$peers/torch_trainer.py" --data "$data" --global-batch "$batch" --warmup 0 --steps "$steps" \
    --checkpoint-every "$ckpt_every" --checkpoint-dir "$work/$name.ckpt" --step-log "$work/$name.steps" ${fail:+--fail-at "$fail"}
  rm -rf "$work/$name.ckpt"
}

echo "# run_recovery_bench: reps=$reps steps=$steps kill_step=$kill_step kill_member=$kill_member checkpoint_every=$ckpt_every global_batch=$batch $(date -u +%FT%TZ) $(getconf _NPROCESSORS_ONLN) cpus" | tee "$out"
: >"$out.log"
for ((rep = 1; rep <= reps; rep++)); do
  echo "## repetition $rep of $reps" >&2
  dtrain_job "r$rep-dtrain-elastic-w4" 4 elastic
  dtrain_job "r$rep-dtrain-plain-w4" 4 plain
  dtrain_job "r$rep-dtrain-kill-w4" 4 elastic "$kill_member:$kill_step:forward"
  dtrain_job "r$rep-dtrain-elastic-w3" 3 elastic
  dtrain_job "r$rep-dtrain-regrow-w4" 4 regrow "$kill_member:$kill_step:forward"
  [ $have_torch = 1 ] || continue
  torch_job "r$rep-torch-w4"
  torch_job "r$rep-torch-kill-w4" "$kill_member:$kill_step"
done

echo "# stderr and stdout of the runs in $out.log" | tee -a "$out"
"$py" - "$work" "$reps" "$steps" "$kill_step" <<'EOF' | tee -a "$out"
import os, statistics, sys

work, reps, steps, kill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
runs = {}
for line in open(os.path.join(work, "runs.txt")):
    name, rc, wall = line.split()
    runs[name] = (int(rc), int(wall) / 1e9)


def read_log(name):
    """{'steps': [(step, epoch, world, ns), ...] in commit order, 'kill': ns or None, 'starts': {attempt: ns}}"""
    log = {"steps": [], "kill": None, "starts": {}, "join": None}
    path = os.path.join(work, name + ".steps")
    if not os.path.exists(path):
        return log
    for line in open(path):
        f = line.split()
        if f[0] == "kill":
            log["kill"] = int(f[-1])
        elif f[0] == "join":  # join MEMBER START_NS STEP BYTES TRANSFER_NS BROADCAST_NS NS
            log["join"] = tuple(int(v) for v in f[1:])
        elif f[0] == "start":
            log["starts"][int(f[1])] = int(f[-1])
        else:
            log["steps"].append(tuple(int(v) for v in f))
    log["steps"].sort(key=lambda s: s[3])
    return log


def last_commits(log):
    """step -> ns of its last commit (the one that counted)."""
    return {s: ns for s, _, _, ns in log["steps"]}


def complete(name, log, killed):
    rc, _ = runs.get(name, (None, 0))
    why = None
    if rc != 0:
        why = f"exit status {rc}"
    elif set(last_commits(log)) != set(range(steps)):
        why = "not every step committed"
    elif killed and log["kill"] is None:
        why = "no kill logged"
    if why:
        print(f"# {name}: left out ({why})")
    return why is None


results = []  # (impl, run, world, {metrics})


def emit(impl, run, world, metrics):
    results.append((impl, run, world, metrics))
    extra = f" kill_step={kill}" if run == "kill" else ""
    fields = " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
    print(f"RESULT recovery impl={impl} run={run} world={world} steps={steps}{extra} {fields}")


def job(log):
    c = last_commits(log)
    return (c[steps - 1] - c[0]) / 1e9


def recovery(log):
    """recovery_ms, back_ms, steps_lost, steps_redone, first epoch after the kill."""
    first_epoch = log["steps"][0][1]
    after = [s for s in log["steps"] if s[1] != first_epoch]
    resumed = after[0]
    back = next(s for s in after if s[0] == kill)
    epochs_of = {}
    for s, e, _, _ in log["steps"]:
        epochs_of.setdefault(s, set()).add(e)
    redone = sum(1 for e in epochs_of.values() if len(e) > 1)
    return ((resumed[3] - log["kill"]) / 1e6, (back[3] - log["kill"]) / 1e6, kill - resumed[0], redone, resumed[1])


KINDS = ("dtrain-elastic-w4", "dtrain-plain-w4", "dtrain-kill-w4", "dtrain-elastic-w3", "dtrain-regrow-w4", "torch-w4", "torch-kill-w4")
for rep in range(1, reps + 1):
    logs, ok = {}, {}
    for kind in KINDS:
        name = f"r{rep}-{kind}"
        if name in runs:
            logs[kind] = read_log(name)
            ok[kind] = complete(name, logs[kind], "kill" in kind or "regrow" in kind)
    for kind in KINDS:
        if not ok.get(kind):
            continue
        log, wall = logs[kind], runs[f"r{rep}-{kind}"][1]
        impl = kind.split("-")[0]
        if "kill" not in kind and "regrow" not in kind:
            run = "undisturbed-plain" if "plain" in kind else "undisturbed"
            c = last_commits(log)
            p50 = statistics.median(c[s] - c[s - 1] for s in range(1, steps)) / 1e6
            emit(impl, run, log["steps"][0][2], {"job_s": job(log), "step_ms": 1e3 * job(log) / (steps - 1), "step_p50_ms": p50, "wall_s": wall})
            continue
        rec, back, lost, redone, epoch = recovery(log)
        m = {"recovery_ms": rec, "back_ms": back}
        if "regrow" in kind:
            if log["join"] is None:
                print(f"# r{rep}-{kind}: left out (no join logged: the replacement was not admitted before the end)")
                continue
            member, start, at, nbytes, transfer_ns, bcast_ns, done = log["join"]
            first = next((s for s in log["steps"] if s[0] >= at and s[2] == 4), None)
            m = {"recovery_ms": rec, "join_ms": (first[3] - start) / 1e6 if first else float("nan"),
                 "admitted_ms": (done - start) / 1e6, "state_mb": nbytes / 1e6,
                 "transfer_mb_s": nbytes / (transfer_ns / 1e9) / 1e6,
                 "bcast_mb_s": nbytes / (bcast_ns / 1e9) / 1e6 if bcast_ns else float("nan"),
                 "transfer_vs_bcast": bcast_ns / transfer_ns if bcast_ns else float("nan"),
                 "steps_lost": lost, "steps_redone": redone, "job_s": job(log), "wall_s": wall}
            emit(impl, "regrow", 4, m)
            continue
        if impl == "torch" and epoch in log["starts"]:
            m["restart_ms"] = (log["starts"][epoch] - log["kill"]) / 1e6
        m.update(steps_lost=lost, steps_redone=redone, job_s=job(log), wall_s=wall)
        if impl == "dtrain" and ok.get("dtrain-elastic-w4") and ok.get("dtrain-elastic-w3"):
            w4, w3 = last_commits(logs["dtrain-elastic-w4"]), last_commits(logs["dtrain-elastic-w3"])
            reference = (w4[kill - 1] - w4[0] + w3[steps - 1] - w3[kill - 1]) / 1e9
            m["cost_s"] = job(log) - reference
        if impl == "torch" and ok.get("torch-w4"):
            m["cost_s"] = job(log) - job(logs["torch-w4"])
        emit(impl, "kill", 4, m)

# Medians per configuration and dtrain / torch ratios.
print()
print("# medians")
groups = {}
for impl, run, world, m in results:
    groups.setdefault((impl, run, world), []).append(m)
med = {}
for (impl, run, world), ms in groups.items():
    keys = [k for k in ms[0]]
    med[(impl, run, world)] = {k: statistics.median(m[k] for m in ms if k in m) for k in keys}
    fields = " ".join(f"{k}={v:.6g}" for k, v in med[(impl, run, world)].items())
    extra = f" kill_step={kill}" if run == "kill" else ""
    print(f"RESULT recovery impl={impl} run={run} world={world} steps={steps}{extra} runs={len(ms)} {fields}")
for run, world in (("undisturbed", 4), ("kill", 4)):
    a, b = med.get(("dtrain", run, world)), med.get(("torch", run, world))
    if a and b:
        ratios = " ".join(f"ratio_{k}={a[k] / b[k]:.4g}" for k in a if k in b and b[k] and not k.startswith("steps_"))
        extra = f" kill_step={kill}" if run == "kill" else ""
        print(f"RATIO recovery a=dtrain b=torch run={run} world={world} steps={steps}{extra} {ratios}")

# The table.
print()
print("| run | job s | step ms | recovery ms (kill -> next commit) | back at the kill step ms | steps lost | steps redone | failure cost s | wall s |")
print("|---|---|---|---|---|---|---|---|---|")
labels = [(("dtrain", "undisturbed-plain", 4), "dtrain world 4, plain"),
          (("dtrain", "undisturbed", 4), "dtrain world 4, --elastic"),
          (("dtrain", "undisturbed", 3), "dtrain world 3, --elastic"),
          (("dtrain", "kill", 4), f"dtrain world 4 -> 3, member killed in step {kill}"),
          (("dtrain", "regrow", 4), f"dtrain world 4 -> 3 -> 4, killed in step {kill}, replaced (--max-restarts 1)"),
          (("torch", "undisturbed", 4), "torch world 4, torchrun"),
          (("torch", "kill", 4), f"torch world 4, rank killed in step {kill}, torchrun restart")]
cell = lambda m, k, f: (f % m[k]) if k in m else "-"
for key, label in labels:
    m = med.get(key)
    if not m:
        continue
    rec = cell(m, "recovery_ms", "%.0f")
    if "restart_ms" in m:
        rec += f" ({m['restart_ms']:.0f} until the restarted process began)"
    print(f"| {label} | {m['job_s']:.2f} | {m.get('step_ms', m['job_s'] * 1e3 / (steps - 1)):.2f} | {rec} | {cell(m, 'back_ms', '%.0f')} | "
          f"{cell(m, 'steps_lost', '%d')} | {cell(m, 'steps_redone', '%d')} | {cell(m, 'cost_s', '%.3f')} | {m['wall_s']:.1f} |")

# The regrow.
g = med.get(("dtrain", "regrow", 4))
if g:
    print()
    print("| regrow (medians) | value |")
    print("|---|---|")
    print(f"| replacement start -> admitted (state received) | {g['admitted_ms']:.0f} ms |")
    print(f"| replacement start -> first committed step at world 4 | {g['join_ms']:.0f} ms |")
    print(f"| training state sent | {g['state_mb']:.2f} MB |")
    print(f"| state transfer (broadcastState) | {g['transfer_mb_s']:.0f} MB/s |")
    print(f"| one plain broadcast of the same bytes, same group | {g['bcast_mb_s']:.0f} MB/s |")
    print(f"| transfer / broadcast throughput | {g['transfer_vs_bcast']:.2f} |")

# The goals.
print()
d, t = med.get(("dtrain", "kill", 4)), med.get(("torch", "kill", 4))
el, pl = med.get(("dtrain", "undisturbed", 4)), med.get(("dtrain", "undisturbed-plain", 4))
dk = [m for impl, run, _, m in results if impl == "dtrain" and run == "kill"]


def goal(text, value, met):
    print(f"GOAL {text}: {value} -> {'met' if met else 'MISSED'}")


if d:
    goal("recovery (kill -> survivors' next committed step) < 1000 ms in every run", f"median {d['recovery_ms']:.0f} ms, worst {max(m['recovery_ms'] for m in dk):.0f} ms",
         max(m["recovery_ms"] for m in dk) < 1000)
    if t:
        goal("recovery >= 10x faster than torchrun's (kill -> next completed step, medians)",
             f"{t['recovery_ms']:.0f} / {d['recovery_ms']:.0f} ms = {t['recovery_ms'] / d['recovery_ms']:.1f}x", t["recovery_ms"] >= 10 * d["recovery_ms"])
    lost = max(max(m["steps_lost"], m["steps_redone"]) for m in dk)
    goal("zero steps lost", f"most lost or redone in a run: {lost}", lost == 0)
    if "cost_s" in d:
        goal("the failure's whole cost < 1 s (median)", f"median {d['cost_s']:.3f} s, worst {max(m.get('cost_s', 0) for m in dk):.3f} s", d["cost_s"] < 1)
if el and pl:
    over = 100 * (el["step_ms"] / pl["step_ms"] - 1)
    over50 = 100 * (el["step_p50_ms"] / pl["step_p50_ms"] - 1)
    goal("elastic mode without failures < 1 % of step time (medians of step_ms)",
         f"{el['step_ms']:.3f} vs {pl['step_ms']:.3f} ms = {over:+.2f} % (median step: {el['step_p50_ms']:.3f} vs {pl['step_p50_ms']:.3f} ms = {over50:+.2f} %)",
         over < 1)
EOF

[ "${SKIP_EXTRA:-0}" = 1 ] && exit 0
echo | tee -a "$out"
echo "# a joiner's state transfer (bench/state_transfer_bench)" | tee -a "$out"
for backend in shm gloo; do
  for model in mlp gpt; do
    "$build/bench/state_transfer_bench" --backend "$backend" --model "$model" --reps "${TRANSFER_REPS:-5}" 2>>"$out.log" |
      tee -a "$out"
  done
done
echo | tee -a "$out"
echo "# a whole node's loss (bench/run_node_loss_bench.sh)" | tee -a "$out"
REPS=${NODE_LOSS_REPS:-5} DT_BUILD_DIR="$build" OUT="$out.node-loss" bash bench/run_node_loss_bench.sh 2>&1 | tee -a "$out"

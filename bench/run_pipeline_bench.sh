#!/usr/bin/env bash
# Pipeline parallelism's schedules on real ranks (issue 39), one run; bench/run_parallel_bench.sh
# runs it as its pipeline part. bench/pipeline_bench.cpp does the work, one launch per row (forked
# ranks over shm, one thread each), every timed step after a barrier:
#   fixed  stages of a fixed synthetic cost (F, I, W sleep UNIT_MS each, B twice that): the
#          measured bubble is the schedule's and the transport's, whatever the cores, against
#          the simulator's formula (GPipe and 1F1B (p-1)/m, interleaved (p-1)/(vm), ZB-H1
#          (p-1)/(3m), ZBV (p-1)/(6m));
#   gpt    the 38M GPT (L12-H8-C512-T128, AdamW, clipping at 1.0) split into p stages, and DDP
#          and the fully sharded wrapper over the same p ranks at the same global batch (m
#          micro-batches of MICRO rows); WIDTH=768 HEADS=12 is the issue's wider 12-layer model;
#   loop   the same model through the training loop at world LOOP_WORLD (4): examples/gpt under
#          dtrun with --pp p (PP=p x DP=4/p, DDP over the replicas) for each schedule and m,
#          against DDP and the fully sharded wrapper (--sharding fsdp) over the 4 ranks, all at
#          the global batch LOOP_BATCH (32) x CONTEXT tokens.
# Per row: step ms (the slowest rank's median), tokens/s, the bubble per rank (idle to the end of
# the step's slowest rank over the rank's compute, median over steps; max and mean over ranks),
# peak RSS per rank (VmHWM after the warm-up step; max over ranks).
# With more ranks than cores (p = 4 on this 2-core machine) a real model's stages share cores:
# a rank's compute then stretches while another computes, and its bubble is not the schedule's
# alone; the fixed workload is the measure of the schedules.
#
# RATIO lines with goals (met / MISSED):
#   bubble: |measured - formula| <= 0.03 per rank (max over ranks), every fixed row, and the gpt rows;
#   ZB-H1 step / 1F1B step <= 0.9 at p=4, m=8 (fixed and gpt; the gpt step needs a core per rank), with
#   peak RSS ZB-H1 / 1F1B <= 1.1 (gpt) (and the same
#   for the ZB_PENDING rows, zb1kK: ZB-H1 with at most K pending weight gradients per rank);
#   tokens/s of each schedule against DDP's and the fully sharded wrapper's (no goal);
#   where ZB-H1's memory goes (gpt, rank 0): the allocator's peak against 1F1B's, and what a micro-batch
#   keeps from its I to its W against what its forward keeps (pipeline_bench's f_mb and pending_w_mb).
#
# usage: bench/run_pipeline_bench.sh  (env: PS="2 4" MS="4 8 16" SCHEDULES="gpipe 1f1b interleaved zb1 zbv"
#          WORKLOADS="fixed gpt loop" LOOP_WORLD=4 LOOP_BATCH=32 UNIT_MS=20 STEPS=3 WARMUP=1 MICRO=2 LAYERS=12 WIDTH=512 HEADS=8 CONTEXT=128
#          ZB_PENDING="1 2" (extra zb1 rows at p=4 m=8 with at most K pending W per rank: zb1k1, zb1k2)
#          DT_BUILD_DIR=build-bench DT_JOBS=2 OUT=file; NO_BUILD=1 runs the build directory's
#          pipeline_bench as it is, without configuring it)
#   full run about 45 minutes on 2 idle cores (the gpt rows: 42 launches of the 38M model over p ranks;
#   the loop rows: 32 launches at world 4)
#   QUICK=1: L8-H4-C64-T64, UNIT_MS=5, MS="4 8", STEPS=2 (checks the script: about a minute)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${DT_BUILD_DIR:-build-bench}
quick=${QUICK:-0}
if [ "$quick" = 1 ]; then q_layers=8 q_width=64 q_heads=4 q_context=64 q_unit=5 q_ms="4 8" q_steps=2
else q_layers=12 q_width=512 q_heads=8 q_context=128 q_unit=20 q_ms="4 8 16" q_steps=3; fi
ps=${PS:-"2 4"}
ms=${MS:-$q_ms}
schedules=${SCHEDULES:-"gpipe 1f1b interleaved zb1 zbv"}
workloads=${WORKLOADS:-"fixed gpt loop"}
loop_world=${LOOP_WORLD:-4}
loop_batch=${LOOP_BATCH:-32}
unit=${UNIT_MS:-$q_unit}
steps=${STEPS:-$q_steps}
warmup=${WARMUP:-1}
micro=${MICRO:-2}
shape=(--layers "${LAYERS:-$q_layers}" --width "${WIDTH:-$q_width}" --heads "${HEADS:-$q_heads}"
       --context "${CONTEXT:-$q_context}")
model=("${shape[@]}" --micro-batch "$micro")
out=${OUT:-$(mktemp /tmp/pipeline-bench.XXXXXX.txt)}

openblas_dir=/usr/lib/x86_64-linux-gnu/openblas-pthread
if [ -d "$openblas_dir" ]; then export LD_LIBRARY_PATH="$openblas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 DT_NUM_THREADS=1

if [ "${NO_BUILD:-0}" != 1 ]; then
  echo "== building pipeline_bench in $build" >&2
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF >/dev/null &&
    cmake --build "$build" -j "${DT_JOBS:-2}" --target pipeline_bench gpt dtrun >/dev/null ||
    { echo "run_pipeline_bench: building failed" >&2; exit 2; }
fi
bench="$build/bench/pipeline_bench"
dtrun="$build/launcher/dtrun"
gpt="$build/examples/gpt"

echo "# run_pipeline_bench: workloads=[$workloads] p=[$ps] m=[$ms] schedules=[$schedules] unit_ms=$unit steps=$steps" \
  "warmup=$warmup micro_batch=$micro model=${model[*]} $(date -u +%FT%TZ) $(getconf _NPROCESSORS_ONLN) cpus" | tee "$out"

run_row() {  # workload p m schedule [zb-pending]
  local args=(--nproc "$2" --workload "$1" --schedule "$4" --m "$3" --steps "$steps" --warmup "$warmup")
  if [ -n "${5:-}" ]; then args+=(--zb-pending "$5"); fi
  if [ "$1" = fixed ]; then args+=(--unit-ms "$unit"); else args+=("${model[@]}"); fi
  echo "## $*" >&2
  local line
  line=$(timeout 900 "$bench" "${args[@]}" 2>>"$out.log" | grep '^RESULT')
  if [ -z "$line" ]; then echo "# FAILED: $* (no RESULT line; see $out.log)" | tee -a "$out"; return; fi
  echo "$line" | tee -a "$out"
}
schedule_fits() {  # p m schedule: the schedules' own limits (pipeline_schedule.h)
  case $3 in
    interleaved|zb1) (($2 >= $1)) ;;  # m >= p for the split ones
    zbv) (($2 >= $1 && $2 % $1 == 0)) ;;
  esac
}
run_loop_row() {  # pp m schedule (ddp and fsdp: the whole model over the world, no pipeline)
  local args=(--bench --quiet --checkpoint-dir none --bench-warmup "$warmup" --eval-every 0 --sample-tokens 0
              --steps $((steps + warmup)) --warmup 1 --global-batch "$loop_batch" "${shape[@]}")
  case $3 in
    ddp) ;;
    fsdp) args+=(--sharding fsdp) ;;
    *) args+=(--pp "$1" --schedule "$3" --micro-batches "$2") ;;
  esac
  echo "## loop world $loop_world pp $1 m $2 $3" >&2
  local line
  line=$(timeout 900 "$dtrun" --standalone --nproc "$loop_world" --prefix none "$gpt" "${args[@]}" 2>>"$out.log" | grep '^RESULT gpt ')
  if [ -z "$line" ]; then echo "# FAILED: loop pp $1 m $2 $3 (no RESULT line; see $out.log)" | tee -a "$out"; return; fi
  local stages=$(($1 > 0 ? $1 : 1))
  echo "RESULT pipeline_loop pp=$1 dp=$((loop_world / stages)) m=$2 schedule=$3 ${line#RESULT gpt }" | tee -a "$out"
}
for workload in $workloads; do
  if [ "$workload" = loop ]; then
    run_loop_row 0 1 ddp
    run_loop_row 0 1 fsdp
    for p in $ps; do
      for m in $ms; do
        ((loop_batch % (loop_world / p * m) == 0)) || { echo "# loop pp $p m $m skipped: global batch $loop_batch does not split into dp $((loop_world / p)) x m $m" | tee -a "$out"; continue; }
        for schedule in $schedules; do
          schedule_fits "$p" "$m" "$schedule" || continue
          run_loop_row "$p" "$m" "$schedule"
        done
      done
    done
    continue
  fi
  for p in $ps; do
    for m in $ms; do
      for schedule in $schedules; do
        schedule_fits "$p" "$m" "$schedule" || continue
        run_row "$workload" "$p" "$m" "$schedule"
      done
      if [ "$workload" = gpt ] && ((m % p == 0)); then run_row gpt "$p" "$m" ddp; run_row gpt "$p" "$m" fsdp; fi
      if ((p == 4 && m == 8)); then
        for k in ${ZB_PENDING:-}; do run_row "$workload" "$p" "$m" zb1 "$k"; done
      fi
    done
  done
done

echo
echo "# $out (stderr of the runs in $out.log)"
/usr/bin/python3 - "$out" <<'PYEOF'
import os, sys
rows = []
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) > 2 and f[0] == "RESULT" and f[1] == "pipeline":
        rows.append(dict(x.split("=", 1) for x in f[2:] if "=" in x))
def find(workload, p, m, schedule):
    for r in rows:
        if (r["workload"], r["p"], r["m"], r["schedule"]) == (workload, p, m, schedule):
            return r
    return None
order = ["gpipe", "1f1b", "interleaved", "zb1k1", "zb1k2", "zb1k3", "zb1", "zbv", "ddp", "fsdp"]
baselines = ("ddp", "fsdp")
ratios = []
print("| workload | p | m | schedule | v | step ms | x 1F1B | tokens/s | x DDP | x FSDP | bubble formula | bubble max | bubble mean | per rank | peak RSS MiB (max) | x 1F1B | per rank |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in sorted(rows, key=lambda r: (r["workload"], int(r["p"]), int(r["m"]), order.index(r["schedule"]) if r["schedule"] in order else 9)):
    w, p, m, s = r["workload"], r["p"], r["m"], r["schedule"]
    ref, ddp, fsdp = find(w, p, m, "1f1b"), find(w, p, m, "ddp"), find(w, p, m, "fsdp")
    ms = float(r["step_ms"])
    x1 = f"{ms / float(ref['step_ms']):.3f}" if ref else "-"
    xd = f"{float(r['tokens_per_s']) / float(ddp['tokens_per_s']):.3f}" if ddp and s != "ddp" else "-"
    xf = f"{float(r['tokens_per_s']) / float(fsdp['tokens_per_s']):.3f}" if fsdp and s not in baselines else "-"
    rss = float(r["peak_rss_mb_max"])
    xr = f"{rss / float(ref['peak_rss_mb_max']):.3f}" if ref else "-"
    formula = r.get("formula", "-")
    print(f"| {w} | {p} | {m} | {s} | {r['v']} | {ms:.1f} | {x1} | {float(r['tokens_per_s']):.0f} | {xd} | {xf} | {formula} | "
          f"{r.get('bubble_max', '-')} | {r.get('bubble_mean', '-')} | {r.get('bubble_ranks', '-')} | {rss:.0f} | {xr} | {r['peak_rss_mb_ranks']} |")
    if s not in baselines:
        worst = max(abs(float(b) - float(formula)) for b in r["bubble_ranks"].split(","))
        ratios.append(f"RATIO pipeline_bubble |measured-formula| workload={w} schedule={s} p={p} m={m} value={worst:.4f} "
                      f"formula={formula} goal<=0.03 {'met' if worst <= 0.03 else 'MISSED'}")
    for name, base in (("ddp", ddp), ("fsdp", fsdp)):
        if base and s not in baselines:
            ratios.append(f"RATIO pipeline_tokens_per_s {s}/{name} workload={w} p={p} m={m} value={float(r['tokens_per_s']) / float(base['tokens_per_s']):.3f}")
for w, label in [(w, label) for w in ("gpt", "fixed") for label in ("zb1", "zb1k1", "zb1k2", "zb1k3")]:
    zb, one = find(w, "4", "8", label), find(w, "4", "8", "1f1b")
    if zb and one:
        step = float(zb["step_ms"]) / float(one["step_ms"])
        rss = float(zb["peak_rss_mb_max"]) / float(one["peak_rss_mb_max"])
        goal = w == "gpt"
        # With fewer cores than ranks one rank's idle time is another's compute: the cores stay
        # busy whatever the schedule, and the gpt step cannot show a smaller bubble.
        shared = f" (4 ranks on {os.cpu_count()} cores)" if w == "gpt" and os.cpu_count() < 4 else ""
        ratios.append(f"RATIO pipeline_step {label}/1f1b workload={w} p=4 m=8 value={step:.3f}"
                      f" goal<=0.9 {'met' if step <= 0.9 else 'MISSED'}{shared}")
        ratios.append(f"RATIO pipeline_peak_rss {label}/1f1b workload={w} p=4 m=8 value={rss:.3f}" +
                      (f" goal<=1.1 {'met' if rss <= 1.1 else 'MISSED'}" if goal else ""))
        if "peak_alloc_mb_ranks" in zb and "peak_alloc_mb_ranks" in one:
            # Where ZB-H1's extra memory lives (rank 0, the peak): the allocator's live bytes over the
            # state, and what one micro-batch keeps after its I until its W against its forward's graph.
            first = lambda r, k: float(r[k].split(",")[0])
            acts = [first(r, "peak_alloc_mb_ranks") - first(r, "state_mb_ranks") for r in (zb, one)]
            ratios.append(f"RATIO pipeline_peak_alloc {label}/1f1b workload={w} p=4 m=8 rank=0 value={first(zb, 'peak_alloc_mb_ranks') / first(one, 'peak_alloc_mb_ranks'):.3f} "
                          f"above_state={acts[0] / acts[1]:.3f} ({acts[0]:.1f} / {acts[1]:.1f} MiB)")
            ratios.append(f"RATIO pipeline_pending_w/forward schedule={label} workload={w} p=4 m=8 rank=0 value={first(zb, 'pending_w_mb_ranks') / first(zb, 'f_mb_ranks'):.3f} "
                          f"({first(zb, 'pending_w_mb_ranks'):.2f} / {first(zb, 'f_mb_ranks'):.2f} MiB per micro-batch; pending W peak {zb['pending_w_ranks'].split(',')[0]}, in flight {zb['in_flight_ranks'].split(',')[0]})")
loops = [dict(x.split("=", 1) for x in line.split()[2:] if "=" in x)
         for line in open(sys.argv[1]) if line.startswith("RESULT pipeline_loop ")]
if loops:
    print()
    print("| loop: model | world | pp | dp | m | schedule | step ms | x 1F1B | tokens/s | x DDP | x FSDP | peak RSS MiB (rank 0) | x DDP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = {r["schedule"]: r for r in loops if r["pp"] == "0"}
    for r in loops:
        one = next((o for o in loops if (o["pp"], o["m"], o["schedule"]) == (r["pp"], r["m"], "1f1b")), None)
        tps = float(r["tokens_per_s"])
        x = lambda b: f"{tps / float(base[b]['tokens_per_s']):.3f}" if b in base and r["pp"] != "0" else "-"
        x1 = f"{float(r['step_ms']) / float(one['step_ms']):.3f}" if one else "-"
        xr = f"{float(r['peak_rss_mb']) / float(base['ddp']['peak_rss_mb']):.3f}" if "ddp" in base else "-"
        print(f"| {r['model']} | {r['world']} | {r['pp']} | {r['dp']} | {r['m']} | {r['schedule']} | {float(r['step_ms']):.1f} | {x1} | "
              f"{tps:.0f} | {x('ddp')} | {x('fsdp')} | {float(r['peak_rss_mb']):.0f} | {xr} |")
        for b in ("ddp", "fsdp"):
            if b in base and r["pp"] != "0":
                ratios.append(f"RATIO pipeline_loop_tokens_per_s {r['schedule']}/{b} model={r['model']} world={r['world']} pp={r['pp']} m={r['m']} value={x(b)}")
print()
print("\n".join(ratios))
PYEOF

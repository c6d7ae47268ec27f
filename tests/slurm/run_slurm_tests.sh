#!/bin/bash
# The Slurm tests (`make test-slurm`): a real single-node Slurm on this machine runs the scripts in
# slurm/ and the checks below; ends with the line `N passed, N failed, N skipped`, exit 1 on failure.
#
#   tests/slurm/run_slurm_tests.sh [--build DIR]     (as root; installs slurm-wlm + munge if missing)
#
# It starts its own munged, slurmctld and slurmd (tests/slurm/local_slurm.sh) with all state in a
# private temporary directory, and always cancels its jobs, stops its daemons and removes that
# directory on exit (SLURM_TEST_KEEP=1 keeps the directory for a look at the logs).
#
# Checks (every wait is bounded):
#  single      slurm/train.sbatch, tiny config: COMPLETED, exit 0, the log shows the final step
#  failure     slurm/train.sbatch with a bad option: the job FAILS with the program's exit code 2
#  multinode   slurm/train-multinode.sbatch on 1 node with LAUNCHER=mpirun: COMPLETED
#  cancel      `scancel` of a running preemptible job: it saves, ends CANCELLED and is NOT requeued
#  preempt-*   slurm/train-preemptible.sbatch (400 steps), LAUNCHER=srun and LAUNCHER=mpirun:
#              `scancel -b --signal=USR1` once step SIGNAL_AT is in the metrics; the job checkpoints
#              (STOPPED marker + ckpt file), is requeued (Restarts=1, SLURM_RESTART_COUNT=1 in the
#              appended output), resumes ("resumed from") and completes; its per-step losses equal
#              (==) those of an uninterrupted `mpirun -np 2` run of the same config outside Slurm.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=build
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --build=*) BUILD=${1#*=}; shift ;;
    *) echo "usage: $0 [--build DIR]" >&2; exit 2 ;;
  esac
done
case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
EXE=$BUILD/shardtrain
STEPS=400          # the preemptible runs: long enough to signal them in the middle
SIGNAL_AT=50       # send the signal once this step is in the metrics
JOB_TIMEOUT=240    # seconds any one job may take

# shellcheck source=local_slurm.sh
. "$HERE/local_slurm.sh"

# shellcheck source=../support/shell_report.sh
. "$HERE/../support/shell_report.sh"

if [ "$(id -u)" != 0 ]; then
  echo "== Slurm tests need root (a private slurmctld/slurmd as SlurmUser=root, munged as the munge user)"
  skip "slurm tests" "not root"
  echo "0 passed, 0 failed, 1 skipped"
  exit 0
fi
if [ ! -x "$EXE" ]; then
  echo "no $EXE: build it first (make)" >&2
  echo "0 passed, 1 failed, 0 skipped"
  exit 1
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

TMP=$(mktemp -d /tmp/shardtrain-slurm.XXXXXX) || exit 1
chmod 0755 "$TMP"    # munged runs as the munge user and keeps its socket in here
SD=$TMP/slurm        # Slurm's config, state, logs, munge
W=$TMP/jobs          # the jobs' working directory: outputs, logs/, checkpoints/
mkdir -p "$W" "$TMP/ref"
REF_PID=

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$REF_PID" ] && kill -0 "$REF_PID" 2>/dev/null; then kill -TERM "$REF_PID" 2>/dev/null; wait "$REF_PID" 2>/dev/null; fi
  slurm_local_stop "$SD"
  if [ "${SLURM_TEST_KEEP:-0}" = 1 ]; then echo "(kept $TMP)"; else rm -rf "$TMP"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'echo "interrupted"; exit 130' INT
trap 'echo "terminated"; exit 143' TERM

# ---- helpers --------------------------------------------------------------------------------------
# wait_for SECONDS COMMAND...: polls COMMAND every 0.2 s; 0 once it succeeds, 1 after SECONDS.
wait_for() {
  local limit=$1; shift
  local end; end=$(awk -v n="$(now)" -v l="$limit" 'BEGIN { printf "%d", n + l }')
  while :; do
    "$@" && return 0
    [ "$(date +%s)" -lt "$end" ] || return 1
    sleep 0.2
  done
}
# job_field ID KEY: a KEY=value field of `scontrol show job` (kept MinJobAge=600 s after the end).
job_field() { scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -1; }
job_finished() {
  case "$(job_field "$1" JobState)" in
    COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE | PREEMPTED) return 0 ;;
    *) return 1 ;;
  esac
}
job_running() { [ "$(job_field "$1" JobState)" = RUNNING ]; }
running_or_end() { job_running "$1" || job_finished "$1"; }
job_restarted() { [ "$(job_field "$1" Restarts)" -ge 1 ] 2>/dev/null; }
# The jobcomp/filetxt record of the job's last end (without slurmdbd there is no sacct).
jobcomp_state() { grep "^JobId=$1 " "$SD/log/jobcomp.log" 2>/dev/null | tail -1 | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
# submit NAME SCRIPT [sbatch options...]: prints the job id; the environment carries the overrides.
submit() {
  local name=$1 script=$2; shift 2
  sbatch --parsable --job-name="$name" --chdir="$W" "$@" "$ROOT/$script" 2>"$TMP/sbatch.err" | cut -d';' -f1
}
show_output() { # the tail of a job's output file, on failure
  echo "     --- tail of $1"; tail -n "${2:-25}" "$1" 2>/dev/null | sed 's/^/     | /'
}
metrics_steps() { grep -c '"kind":"step"' "$1" 2>/dev/null || true; }
has_steps() { [ "$(metrics_steps "$1")" -ge "$2" ] 2>/dev/null; }
# steps_or_end METRICS N ID: N steps in METRICS, or the job ended (then has_steps tells which)
steps_or_end() { has_steps "$1" "$2" || job_finished "$3"; }
# compare_losses A B: step records 1..STEPS in A, each loss == B's (the JSON text, so bit-for-bit).
compare_losses() {
  /usr/bin/python3 - "$1" "$2" "$STEPS" <<'PY'
import json, sys
def steps(path):
    return [r for r in (json.loads(l) for l in open(path) if l.strip()) if r["kind"] == "step"]
got, ref, n = steps(sys.argv[1]), steps(sys.argv[2]), int(sys.argv[3])
if [r["step"] for r in got] != list(range(1, n + 1)):
    sys.exit(f"steps in the job's metrics are not 1..{n}: {[r['step'] for r in got][:5]}... ({len(got)} records)")
if [r["step"] for r in ref] != list(range(1, n + 1)):
    sys.exit(f"the reference run has {len(ref)} step records, not {n}")
diff = [(a["step"], a["loss"], b["loss"]) for a, b in zip(got, ref) if a["loss"] != b["loss"]]
if diff:
    sys.exit(f"{len(diff)} losses differ, first: step {diff[0][0]}: {diff[0][1]!r} != {diff[0][2]!r}")
print(f"{n} losses identical, final {got[-1]['loss']}")
PY
}

# ---- Slurm up -------------------------------------------------------------------------------------
phase "start Slurm (munged, slurmctld, slurmd) in $SD"
if ! slurm_local_start "$SD"; then
  fail "start a local Slurm"
  tail -20 "$SD"/log/*.log "$SD/munge/munged.log" 2>/dev/null
  echo "$PASSED passed, $FAILED failed, $SKIPPED skipped"
  exit 1
fi
export SLURM_CONF=$SD/slurm.conf
pass "Slurm up" "$(sinfo -h -o '%n %T %c CPUs %m MB') | $(sinfo -V)"
if srun --mpi=list 2>&1 | grep -q pmix; then pass "srun --mpi=list offers pmix"; else fail "srun --mpi=list offers pmix"; fi

phase "test data"
"$EXE" data synth --out-dir "$TMP/data" >/dev/null || { fail "shardtrain data synth"; exit 1; }
export SHARDTRAIN=$EXE
export CONFIG=$ROOT/inputs/tiny.ini
COMMON="--data.train_file=$TMP/data/synth_train.bin --data.val_file=$TMP/data/synth_val.bin --train.peak_gflops=100"
unset LAUNCHER EXTRA RUN_NAME CKPT_DIR LOG_DIR METRICS_FILE MAX_REQUEUES SRUN_ARGS MPIRUN_ARGS THREADS

# ---- single: slurm/train.sbatch -------------------------------------------------------------------
phase "single: slurm/train.sbatch (srun --mpi=pmix, 2 tasks, tiny config)"
id=$(EXTRA="$COMMON" submit st-single slurm/train.sbatch)
if [ -z "$id" ]; then
  fail "single: sbatch" "$(cat "$TMP/sbatch.err")"
elif ! wait_for "$JOB_TIMEOUT" job_finished "$id"; then
  fail "single: job $id finished within $JOB_TIMEOUT s" "state $(job_field "$id" JobState)"; show_output "$W/st-single-$id.out"
else
  st=$(job_field "$id" JobState) ec=$(job_field "$id" ExitCode)
  log=$W/logs/st-single-$id-r0.log
  if [ "$st" = COMPLETED ] && [ "$ec" = 0:0 ] && [ "$(jobcomp_state "$id")" = COMPLETED ] \
      && grep -q '^step    20/20 ' "$log" && grep -q '^done: 20 steps' "$W/st-single-$id.out" \
      && [ -f "$W/checkpoints/st-single-$id/ckpt-00000020.h5" ]; then
    pass "single: job $id COMPLETED, exit $ec, step 20/20 in $(basename "$log"), ckpt-00000020.h5"
  else
    fail "single: job $id" "state $st, exit $ec, jobcomp $(jobcomp_state "$id")"; show_output "$W/st-single-$id.out"
  fi
fi

# ---- failure: a failed step fails the job -------------------------------------------------------------
phase "failure: slurm/train.sbatch with a bad option"
id=$(EXTRA="$COMMON --model.n_embd=41" submit st-fail slurm/train.sbatch)
if [ -z "$id" ]; then
  fail "failure: sbatch" "$(cat "$TMP/sbatch.err")"
elif ! wait_for "$JOB_TIMEOUT" job_finished "$id"; then
  fail "failure: job $id finished within $JOB_TIMEOUT s" "state $(job_field "$id" JobState)"
else
  st=$(job_field "$id" JobState) ec=$(job_field "$id" ExitCode)
  if [ "$st" = FAILED ] && [ "$ec" = 2:0 ] && grep -q 'n_embd' "$W/st-fail-$id.out"; then
    pass "failure: job $id FAILED with exit code $ec and the program's message"
  else
    fail "failure: job $id" "state $st, exit $ec (want FAILED, 2:0)"; show_output "$W/st-fail-$id.out"
  fi
fi

# ---- multinode script on one node, through mpirun ----------------------------------------------------
phase "multinode: slurm/train-multinode.sbatch on 1 node, LAUNCHER=mpirun"
id=$(LAUNCHER=mpirun EXTRA="$COMMON" submit st-multi slurm/train-multinode.sbatch \
       --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --time=00:10:00)
if [ -z "$id" ]; then
  fail "multinode: sbatch" "$(cat "$TMP/sbatch.err")"
elif ! wait_for "$JOB_TIMEOUT" job_finished "$id"; then
  fail "multinode: job $id finished within $JOB_TIMEOUT s" "state $(job_field "$id" JobState)"; show_output "$W/st-multi-$id.out"
else
  st=$(job_field "$id" JobState) ec=$(job_field "$id" ExitCode)
  if [ "$st" = COMPLETED ] && [ "$ec" = 0:0 ] && grep -q '^+ mpirun ' "$W/st-multi-$id.out" \
      && grep -q "run 'st-multi-$id-r0' on 2 ranks" "$W/st-multi-$id.out" && grep -q '^done: 20 steps' "$W/st-multi-$id.out"; then
    pass "multinode: job $id COMPLETED on 2 ranks through mpirun, exit $ec"
  else
    fail "multinode: job $id" "state $st, exit $ec"; show_output "$W/st-multi-$id.out"
  fi
fi

# ---- cancel: scancel ends a preemptible job (it saves, but is not requeued) -------------------------
phase "cancel: scancel a running slurm/train-preemptible.sbatch job"
id=$(METRICS_FILE=$W/st-cancel.metrics.jsonl EXTRA="$COMMON --train.steps=20000" submit st-cancel slurm/train-preemptible.sbatch)
if [ -z "$id" ]; then
  fail "cancel: sbatch" "$(cat "$TMP/sbatch.err")"
elif ! { wait_for 120 steps_or_end "$W/st-cancel.metrics.jsonl" 5 "$id" && has_steps "$W/st-cancel.metrics.jsonl" 5; }; then
  fail "cancel: job $id reached step 5" "state $(job_field "$id" JobState)"; show_output "$W/st-cancel-$id.out"
else
  scancel "$id"
  if ! wait_for 60 job_finished "$id"; then
    fail "cancel: job $id ended within 60 s of scancel" "state $(job_field "$id" JobState)"
  else
    sleep 3   # a wrong requeue would show up as Restarts=1 / PENDING by now
    st=$(job_field "$id" JobState) rs=$(job_field "$id" Restarts)
    if [ "$st" = CANCELLED ] && [ "$rs" = 0 ] && grep -q '^not requeueing: the job is ending' "$W/st-cancel-$id.out" \
        && ls "$W/checkpoints/st-cancel-$id"/ckpt-*.h5 >/dev/null 2>&1; then
      pass "cancel: job $id CANCELLED, checkpoint saved, not requeued (Restarts=$rs)"
    else
      fail "cancel: job $id" "state $st, Restarts=$rs"; show_output "$W/st-cancel-$id.out"
    fi
  fi
fi

# ---- preemption: signal, checkpoint, requeue, resume, identical losses ---------------------------------
# The uninterrupted reference, outside Slurm; started when the first preemptible job is requeued
# (the node idles then), awaited before the first comparison.
start_reference() {
  [ -z "$REF_PID" ] || return 0
  # shellcheck disable=SC2086
  timeout -k 5 "$JOB_TIMEOUT" mpirun --oversubscribe --bind-to none -np 2 "$EXE" train --config "$CONFIG" \
      --train.steps=$STEPS $COMMON --train.threads=1 --checkpoint.save=false --train.run_name=reference \
      --train.metrics_file="$TMP/ref/metrics.jsonl" >"$TMP/ref/log" 2>&1 &
  REF_PID=$!
  REF_T=$(now)
}
REF_RC=
wait_reference() {
  [ -z "$REF_RC" ] || return "$REF_RC"
  start_reference
  REF_RC=0; wait "$REF_PID" || REF_RC=$?
  echo "   (reference: mpirun -np 2, $STEPS steps outside Slurm, exit $REF_RC, $(since "$REF_T") s since its start)"
  [ "$REF_RC" = 0 ] || show_output "$TMP/ref/log" 10
  return "$REF_RC"
}

preempt() { # preempt LAUNCHER
  local launcher=$1 name=st-pre-$1 id out ck marker stopped st ec t0
  phase "preempt-$launcher: slurm/train-preemptible.sbatch, LAUNCHER=$launcher, $STEPS steps, USR1 after step $SIGNAL_AT"
  local metrics=$W/$name.metrics.jsonl
  id=$(LAUNCHER=$launcher METRICS_FILE=$metrics EXTRA="$COMMON --train.steps=$STEPS" submit "$name" slurm/train-preemptible.sbatch)
  if [ -z "$id" ]; then fail "preempt-$launcher: sbatch" "$(cat "$TMP/sbatch.err")"; return; fi
  out=$W/$name-$id.out ck=$W/checkpoints/$name-$id
  if ! { wait_for 120 steps_or_end "$metrics" "$SIGNAL_AT" "$id" && has_steps "$metrics" "$SIGNAL_AT"; }; then
    fail "preempt-$launcher: job $id reached step $SIGNAL_AT" "state $(job_field "$id" JobState), $(metrics_steps "$metrics") steps"
    show_output "$out"; scancel "$id"; return
  fi
  t0=$(now)
  scancel -b --signal=USR1 "$id"
  echo "   scancel -b --signal=USR1 $id at step $(metrics_steps "$metrics")"
  # The marker lives until the requeued run has resumed (about cred_expire = 10 s).
  if ! wait_for 60 test -f "$ck/STOPPED"; then
    fail "preempt-$launcher: STOPPED marker in $ck within 60 s" "state $(job_field "$id" JobState)"
    show_output "$out"; scancel "$id"; return
  fi
  marker=$(tr '\n' ' ' <"$ck/STOPPED" 2>/dev/null)
  stopped=$(sed -n 's/^step \([0-9]*\) signal .*/\1/p' <<<"$marker")
  if [ -n "$stopped" ] && [ "$stopped" -ge "$SIGNAL_AT" ] && [ "$stopped" -lt "$STEPS" ] \
      && [ -f "$(printf '%s/ckpt-%08d.h5' "$ck" "$stopped")" ] && [[ "$marker" == *SIGUSR1* ]]; then
    pass "preempt-$launcher: checkpointed on SIGUSR1 after step $stopped ($(printf 'ckpt-%08d.h5' "$stopped"), STOPPED) in $(since "$t0") s"
  else
    fail "preempt-$launcher: checkpoint on the signal" "marker '$marker', files: $(ls "$ck" 2>/dev/null | tr '\n' ' ')"
    show_output "$out"
  fi
  start_reference
  if wait_for 90 job_restarted "$id" && wait_for 90 running_or_end "$id" && job_field "$id" Restarts | grep -qx 1 \
      && ! [ "$(job_field "$id" JobState)" = FAILED ]; then
    pass "preempt-$launcher: requeued (Restarts=$(job_field "$id" Restarts)) and running again $(since "$t0") s after the signal"
  else
    fail "preempt-$launcher: requeued and running again" "state $(job_field "$id" JobState), Restarts=$(job_field "$id" Restarts)"
    show_output "$out"; scancel "$id"; return
  fi
  if ! wait_for "$JOB_TIMEOUT" job_finished "$id"; then
    fail "preempt-$launcher: job $id finished" "state $(job_field "$id" JobState)"; show_output "$out"; scancel "$id"; return
  fi
  st=$(job_field "$id" JobState) ec=$(job_field "$id" ExitCode)
  if [ "$st" = COMPLETED ] && [ "$ec" = 0:0 ] && [ "$(jobcomp_state "$id")" = COMPLETED ] \
      && grep -q "SLURM_RESTART_COUNT=0 " "$out" && grep -q "SLURM_RESTART_COUNT=1 " "$out" \
      && grep -q "^requeueing job $id" "$out" \
      && grep -q "^resumed from checkpoints/$name-$id/$(printf 'ckpt-%08d.h5' "${stopped:-0}") at step ${stopped:-0} " "$out" \
      && grep -q "^done: $((STEPS - ${stopped:-0})) steps" "$W/logs/$name-$id-r1.log" && [ -f "$W/logs/$name-$id-r0.log" ] \
      && [ ! -e "$ck/STOPPED" ]; then
    pass "preempt-$launcher: job $id resumed at step $stopped and COMPLETED (exit $ec; logs $name-$id-r0.log, -r1.log)"
  else
    fail "preempt-$launcher: job $id resumed and completed" "state $st, exit $ec, jobcomp $(jobcomp_state "$id")"
    show_output "$out" 40
  fi
  if wait_reference; then
    local msg
    if msg=$(compare_losses "$metrics" "$TMP/ref/metrics.jsonl" 2>&1); then
      pass "preempt-$launcher: losses == the uninterrupted run" "$msg"
    else
      fail "preempt-$launcher: losses == the uninterrupted run" "$msg"
    fi
  else
    fail "preempt-$launcher: the uninterrupted reference run" "exit $REF_RC"
  fi
}

preempt srun
preempt mpirun

summary
[ "$FAILED" = 0 ]

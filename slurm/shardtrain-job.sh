# The body the sbatch scripts in this folder share: sourced by them, never run by itself. sbatch
# runs a spooled copy of a script, so the scripts find this file through SHARDTRAIN_HOME or the
# submit directory (SLURM_SUBMIT_DIR), not through $0. The variables and the `#SBATCH` lines are
# documented in the scripts.
#
#   shardtrain_prepare "$@"   defaults, the `train` arguments, per-attempt logging, checks, the
#                             launcher; removes an earlier run's STOPPED marker
#   shardtrain_run            runs the launcher, forwarding SIGUSR1/TERM/INT to it as SIGUSR1;
#                             sets rc (its exit code) and stop_signal (TERM or INT when one came)

shardtrain_prepare() {
  : "${SLURM_JOB_ID:?submit this script with sbatch}"
  : "${SHARDTRAIN:=build/shardtrain}"
  : "${CONFIG:=inputs/default.ini}"
  : "${EXTRA:=}"
  : "${LAUNCHER:=srun}"
  : "${SRUN_ARGS:=--mpi=pmix --kill-on-bad-exit=1}"
  : "${MPIRUN_ARGS:=--bind-to none}"
  JOB_NAME=${SLURM_JOB_NAME:-shardtrain}
  RESTART=${SLURM_RESTART_COUNT:-0}
  : "${RUN_NAME:=${JOB_NAME}-${SLURM_JOB_ID}-r${RESTART}}"
  : "${CKPT_DIR:=checkpoints/${JOB_NAME}-${SLURM_JOB_ID}}"
  : "${LOG_DIR:=logs}"
  : "${METRICS_FILE:=${LOG_DIR}/${JOB_NAME}-${SLURM_JOB_ID}.metrics.jsonl}"

  # `train` arguments: EXTRA, then the script's own arguments. A user value for a key this script
  # sets itself replaces the script's value, also for the folders and the log file it makes (for
  # other keys given twice the program takes the last value).
  read -r -a user_args <<<"$EXTRA"
  user_args+=("$@")
  args=()
  for a in ${user_args[@]+"${user_args[@]}"}; do
    case "$a" in
      --checkpoint.dir=*) CKPT_DIR=${a#*=} ;;
      --train.run_name=*) RUN_NAME=${a#*=} ;;
      --train.metrics_file=*) METRICS_FILE=${a#*=} ;;
      --train.threads=*) THREADS=${a#*=} ;;
      *) args+=("$a") ;;
    esac
  done
  THREADS=${THREADS:-${SLURM_CPUS_PER_TASK:-}}

  mkdir -p "$LOG_DIR" "$CKPT_DIR"
  [ -z "$METRICS_FILE" ] || mkdir -p "$(dirname "$METRICS_FILE")"
  LOG_FILE=$LOG_DIR/$RUN_NAME.log
  touch "$LOG_FILE"   # now: tee below opens it asynchronously
  # Everything below goes to the job's output file and to the per-attempt log. tee ignores the
  # signals so that it keeps logging while the ranks save.
  exec > >(trap '' INT TERM USR1; exec tee -a "$LOG_FILE") 2>&1
  TEE_PID=$!
  finish() {
    local rc=$?
    exec >&- 2>&-
    for _ in $(seq 100); do kill -0 "$TEE_PID" 2>/dev/null || break; sleep 0.05; done
    exit "$rc"
  }
  trap finish EXIT

  echo "== $(date '+%F %T') job $SLURM_JOB_ID ($JOB_NAME) SLURM_RESTART_COUNT=$RESTART on ${SLURM_JOB_NODELIST:-?}:" \
       "${SLURM_NTASKS:-?} tasks, ${SLURM_CPUS_PER_TASK:-?} cpus per task, launcher $LAUNCHER"
  if ! command -v "$SHARDTRAIN" >/dev/null; then
    echo "error: SHARDTRAIN=$SHARDTRAIN is not an executable; build it with 'make' before submitting" >&2
    exit 2
  fi
  [ -f "$CONFIG" ] || { echo "error: CONFIG=$CONFIG does not exist" >&2; exit 2; }

  train=("$SHARDTRAIN" train --config "$CONFIG" "--train.run_name=$RUN_NAME" "--checkpoint.dir=$CKPT_DIR")
  [ -z "$METRICS_FILE" ] || train+=("--train.metrics_file=$METRICS_FILE")
  [ -z "$THREADS" ] || train+=("--train.threads=$THREADS")
  train+=(${args[@]+"${args[@]}"})

  if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK
    export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK   # Slurm 22.05's srun no longer inherits --cpus-per-task
  fi
  case "$LAUNCHER" in
    srun) read -r -a launch_args <<<"$SRUN_ARGS"; launch=(srun ${launch_args[@]+"${launch_args[@]}"}) ;;
    mpirun)
      if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
      # Open MPI reads the allocation (nodes, SLURM_NTASKS) from the environment.
      read -r -a launch_args <<<"$MPIRUN_ARGS"; launch=(mpirun ${launch_args[@]+"${launch_args[@]}"}) ;;
    *) echo "error: LAUNCHER=$LAUNCHER: use srun or mpirun" >&2; exit 2 ;;
  esac

  # A marker left by an earlier stop in CKPT_DIR belongs to that run, not to this one.
  rm -f "$CKPT_DIR/STOPPED"
  echo "run $RUN_NAME | checkpoints $CKPT_DIR | log $LOG_FILE | metrics ${METRICS_FILE:-none}"
  echo "+ ${launch[*]} ${train[*]}"
}

shardtrain_run() {
  # The launcher runs in the background so that a signal (time limit: SIGTERM) is logged and
  # forwarded at once: bash runs a trap only between commands or inside `wait`.
  got_signal=0
  stop_signal=
  launcher_pid=
  # A launcher signalled before it has started the ranks drops the signal (mpirun in its first
  # ~0.1 s forwards it to nobody), and a signal before the launcher starts has nobody to reach. So
  # once a stop is asked for, it is sent again every 2 s until the launcher exits: a rank that has
  # its stop already takes more signals as nothing.
  stop_flag=$(mktemp "${TMPDIR:-/tmp}/shardtrain-stop.XXXXXX") && rm -f "$stop_flag"
  forward() {
    got_signal=1
    [ "$1" = USR1 ] || stop_signal=$1
    # Always SIGUSR1: the ranks treat USR1, TERM and INT alike (save, exit 3), but srun answers a
    # SIGTERM with SIGKILL to every task ("forcing job termination"), and mpirun exits 1 after one.
    echo "== $(date '+%F %T') batch shell got SIG$1: sending SIGUSR1 to the launcher${launcher_pid:+ (pid $launcher_pid)}"
    : >"$stop_flag"
    [ -z "$launcher_pid" ] || kill -s USR1 "$launcher_pid" 2>/dev/null || true
  }
  trap 'forward USR1' USR1
  trap 'forward TERM' TERM
  trap 'forward INT' INT
  log_lines=$(wc -l <"$LOG_FILE" || echo 0)
  "${launch[@]}" "${train[@]}" &
  launcher_pid=$!
  (
    trap '' INT TERM USR1
    while kill -0 "$launcher_pid" 2>/dev/null; do
      sleep 2
      [ ! -e "$stop_flag" ] || kill -s USR1 "$launcher_pid" 2>/dev/null || true
    done
  ) &
  resender_pid=$!
  while :; do
    got_signal=0
    rc=0
    wait "$launcher_pid" || rc=$?
    # A trapped signal interrupts `wait` (status > 128) while the launcher still runs: wait again.
    [ "$got_signal" = 1 ] || break
  done
  kill "$resender_pid" 2>/dev/null || true
  rm -f "$stop_flag"
  echo "== $(date '+%F %T') launcher exited with code $rc"
  if [ "$rc" = 0 ] && [ "$LAUNCHER" = srun ]; then
    sleep 0.3   # tee writes srun's last lines
    if tail -n "+$((log_lines + 1))" "$LOG_FILE" | grep -q '^srun: error: .*launch failed'; then
      echo "error: srun reported a failed step launch but exited 0 (Slurm 22.05 does that); failing the job" >&2
      rc=1
    fi
  fi
}

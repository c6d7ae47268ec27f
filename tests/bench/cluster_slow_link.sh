#!/bin/bash
# FULL_SHARD against HYBRID_SHARD step time across slow links: a 2-host Slurm cluster in network
# namespaces (tests/cluster/netns_cluster.sh), slurm/train-multinode.sbatch on 2 hosts x 2 ranks
# (srun --mpi=pmix), every host's link shaped with tc tbf (plus a netem delay where the kernel has
# sch_netem). The table in docs/performance.md ("Slow links between hosts") comes from this script.
#
#   tests/bench/cluster_slow_link.sh [--build DIR] [--config FILE] [--steps N] [--repeats N]
#                                    [--rates "none 1gbit 100mbit"] [--delay 1ms] [--out FILE.md]
#
# Every repeat runs every rate, and for each rate FULL_SHARD then HYBRID_SHARD: interleaved, so a
# load change on the machine hits both strategies alike. A run's step time is the median of its
# steps' step_seconds after the first 2 (start-up, first touches); the table gives the min and the
# median of that over the repeats, the bytes that crossed between the hosts per step (veth
# counters: the hosts' tx less what the head node received) and the predicted time of those bytes
# on one host's link. Needs root; tears the cluster down on every exit.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=build CONFIG=inputs/default.ini STEPS=20 REPEATS=3 RATES="none 1gbit 100mbit" DELAY=1ms OUTMD=
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --rates) RATES=$2; shift 2 ;;
    --delay) DELAY=$2; shift 2 ;;
    --out) OUTMD=$2; shift 2 ;;
    *) sed -n '2,16p' "$0" >&2; exit 2 ;;
  esac
done
case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
case "$CONFIG" in /*) ;; *) CONFIG=$ROOT/$CONFIG ;; esac
EXE=$BUILD/shardtrain
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces, a private Slurm)" >&2; exit 2; }
[ -x "$EXE" ] || { echo "no $EXE: build it first (make BUILD=...)" >&2; exit 2; }

# shellcheck source=../cluster/netns_cluster.sh
. "$ROOT/tests/cluster/netns_cluster.sh"
TMP=$(mktemp -d /tmp/shardtrain-slowlink.XXXXXX) || exit 1
chmod 0755 "$TMP"
CD=$TMP/cluster W=$TMP/jobs
mkdir -p "$W"
cleanup() { trap - EXIT INT TERM; cluster_stop "$CD"; rm -rf "$TMP"; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

CLUSTER_QUIET=1 cluster_start "$CD" 2 || { echo "cluster start failed" >&2; exit 1; }
on() { cluster_exec "$@"; }
"$EXE" data synth --out-dir "$TMP/data" >/dev/null || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_tcp_if_include=$CLUSTER_NET.0/24 OMPI_MCA_oob_tcp_if_include=$CLUSTER_NET.0/24
export OMPI_MCA_mpi_yield_when_idle=1
export SHARDTRAIN=$EXE CONFIG SHARDTRAIN_HOME=$ROOT
unset LAUNCHER EXTRA RUN_NAME CKPT_DIR LOG_DIR METRICS_FILE SRUN_ARGS MPIRUN_ARGS THREADS
COMMON="--data.train_file=$TMP/data/synth_train.bin --data.val_file=$TMP/data/synth_val.bin --train.steps=$STEPS
  --train.eval_every=0 --checkpoint.save=false --train.log_every=1000"
has_netem=0; cluster_has_netem && has_netem=1

job_field() { on ctl scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -1; }
counters() { local h; for h in ctl h1 h2; do echo "$h $(cluster_counters "$h")"; done; }
between_hosts() { # bytes the hosts sent each other: sum of the hosts' tx less ctl's rx
  paste <(echo "$1") <(echo "$2") | awk '$1 == "ctl" { c = $8 - $3; next } { t += $7 - $2 } END { printf "%d\n", t - c }'
}
# run STRATEGY RATE REPEAT: one job; appends "rate strategy repeat median_step_s bytes_per_step" to $TMP/runs
run() {
  local s=$1 rate=$2 rep=$3 name=sl-$1-$2-$3 before after id st m
  before=$(counters)
  # shellcheck disable=SC2086
  id=$(METRICS_FILE=$W/$name.jsonl EXTRA="$(echo $COMMON) --fsdp.sharding_strategy=$s" \
    on ctl sbatch --parsable --job-name="$name" --chdir="$W" --time=00:10:00 --nodes=2 --ntasks-per-node=2 \
      --cpus-per-task=1 "$ROOT/slurm/train-multinode.sbatch" | cut -d';' -f1)
  [ -n "$id" ] || { echo "sbatch failed" >&2; return 1; }
  for _ in $(seq 3000); do
    st=$(job_field "$id" JobState)
    case "$st" in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL) break ;; esac
    sleep 0.2
  done
  after=$(counters)
  [ "$st" = COMPLETED ] || { echo "job $id ($name): $st" >&2; tail -5 "$W/$name-$id.out" >&2; return 1; }
  m=$(/usr/bin/python3 -c '
import json, statistics, sys
t = [json.loads(l)["step_seconds"] for l in open(sys.argv[1]) if "\"kind\":\"step\"" in l]
print("%.4f" % statistics.median(t[2:]))' "$W/$name.jsonl")
  echo "$rate $s $rep $m $(( $(between_hosts "$before" "$after") / STEPS ))" >>"$TMP/runs"
  printf '  repeat %d  %-8s %-13s %7.3f s/step  %9d bytes/step between the hosts\n' "$rep" "$rate" "$s" "$m" \
    "$(( $(between_hosts "$before" "$after") / STEPS ))"
}

echo "== $(basename "$CONFIG"), $STEPS steps, 2 hosts x 2 ranks (srun --mpi=pmix), rates: $RATES," \
     "netem delay: $([ $has_netem = 1 ] && echo "$DELAY" || echo "none (no sch_netem in this kernel)")"
echo "   $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $(on ctl sinfo -V)"
t0=$(date +%s)
for rep in $(seq "$REPEATS"); do
  for rate in $RATES; do
    if [ "$rate" = none ]; then cluster_shape none; else cluster_shape "$rate" "$([ $has_netem = 1 ] && echo "$DELAY")"; fi
    for s in FULL_SHARD HYBRID_SHARD; do run "$s" "$rate" "$rep" || exit 1; done
  done
done
cluster_shape none
echo "== $(( $(date +%s) - t0 )) s; load afterwards $(cut -d' ' -f1-3 /proc/loadavg)"

/usr/bin/python3 - "$TMP/runs" "$RATES" <<'PY' | tee ${OUTMD:+"$OUTMD"}
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
bits = {"none": None}
def rate_bits(r):
    for u, m in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if r.endswith(u): return float(r[:-len(u)]) * m
    return None
print("| link (each host's egress) | strategy | s/step min | s/step median | between the hosts per step | those bytes on one link |")
print("| --- | --- | --- | --- | --- | --- |")
for rate in sys.argv[2].split():
    for s in ("FULL_SHARD", "HYBRID_SHARD"):
        r = [x for x in rows if x[0] == rate and x[1] == s]
        t = [float(x[3]) for x in r]
        b = statistics.median(int(x[4]) for x in r)
        rb = rate_bits(rate)
        link = "-" if rb is None else "%.3f s" % (b / 2 * 8 / rb)   # 2 hosts send in parallel
        print(f"| {'unlimited' if rate == 'none' else rate} | {s} | {min(t):.3f} | {statistics.median(t):.3f} | {b / 1e6:.2f} MB | {link} |")
PY

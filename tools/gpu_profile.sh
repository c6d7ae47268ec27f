#!/usr/bin/env bash
# Where a training step's GPU time goes, kernel by kernel: Nsight Compute (ncu) times a window of
# kernel launches of a short training run on one GPU (gpu__time_duration, the clocks left alone),
# and the kernels are summed by name into a table (docs/gpu.md, "Profiling").
#
#   bash tools/gpu_profile.sh [--bin DIR] [--out DIR] [--skip N] [--count N] [-- TRAIN OPTIONS...]
#
#   --bin DIR    where shardtrain is (default: bundle/bin, whose env.sh is sourced; else build-cuda)
#   --out DIR    the CSV (ncu.csv) and the table (kernels.md) (default: $OUT when set, else .)
#   --skip N     kernel launches to leave out first: start-up and the first steps (default 3000)
#   --count N    launches to time (default 1500: more than one step of gpt-300M)
#   TRAIN OPTIONS  shardtrain train options (default: gpt-300M, bf16, cuDNN attention, micro-batch 8)
#
# PROFILE_LIMIT_S (default 240) bounds the ncu run; what it timed by then is summed.
# ncu serializes and replays each timed kernel, so the run is slower than training; its per-kernel
# times are those of each kernel alone on an otherwise idle GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="" OUTDIR=${OUT:-.} SKIP=3000 COUNT=1500
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN=$2; shift 2 ;;
    --out) OUTDIR=$2; shift 2 ;;
    --skip) SKIP=$2; shift 2 ;;
    --count) COUNT=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_profile: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
if [ -z "$BIN" ]; then
  if [ -f bundle/env.sh ]; then BIN=bundle/bin; else BIN=build-cuda; fi
fi
if [ "$BIN" = bundle/bin ]; then
  # shellcheck source=/dev/null
  source bundle/env.sh || exit 2
fi
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "gpu_profile: ncu (Nsight Compute) not found"; exit 2; }
TRAIN=("$@")
[ ${#TRAIN[@]} -gt 0 ] || TRAIN=(--config inputs/gpt-300M.ini --train.micro_batch=8 --train.global_batch=8
                                  --fsdp.param_dtype=bf16 --train.attention=cudnn --train.steps=4)
WORK=$(mktemp -d /tmp/shardtrain-profile.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUTDIR"
"$BIN/shardtrain" data synth --out-dir "$WORK/data" >/dev/null || exit 1
timeout "${PROFILE_LIMIT_S:-240}" "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip "$SKIP" --launch-count "$COUNT" \
  --log-file "$OUTDIR/ncu.csv" \
  "$BIN/shardtrain" train --train.device=cuda --data.train_file="$WORK/data/synth_train.bin" --data.val_file= \
  --checkpoint.dir="$WORK/ckpt" --checkpoint.save=false --checkpoint.resume=none "${TRAIN[@]}" >"$OUTDIR/train.log" 2>&1
echo "ncu exit $?; $(grep -c '"gpu__time_duration.sum"' "$OUTDIR/ncu.csv" 2>/dev/null) kernels timed"
python3 tools/ncu_summary.py "$OUTDIR/ncu.csv" | tee "$OUTDIR/kernels.md"

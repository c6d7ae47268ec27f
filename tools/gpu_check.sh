#!/usr/bin/env bash
# Every GPU test and measurement in one command, with every number in one report file, so that a
# short lease of a GPU machine is spent measuring (docs/gpu.md).
#
#   bash tools/gpu_check.sh [--bin DIR] [--report FILE] [--tests-only]
#
#   --bin DIR      where shardtrain and gpu_tests are (default: bundle/bin when bundle/env.sh
#                  exists, which is then sourced; else build-cuda)
#   --report FILE  the report (default: $OUT/gpu-report.md when OUT is set, else gpu-report.md)
#   --tests-only   the kernel tests and the GPU-vs-CPU training checks (1 rank on the GPU with NCCL's
#                  settings; 2 and 4 ranks sharing it with fsdp.comm_backend=mpi), no benchmarks (make test-gpu)
#   --only LIST    only these sections, comma-separated: kernels (gpu_tests), train (fp32 and bf16
#                  against the CPU, one host wait per step), memory (reserved against the plan),
#                  shared (ranks sharing the GPU), inference (generation and distillation against
#                  the CPU), bench (throughput), flux (FLUX in bf16 with
#                  cuDNN against the CPU, then its throughput), documents (packed documents in
#                  bf16 with cuDNN against the CPU); for a short second run
#
# Without a GPU it says so and exits 0. With one, it exits 1 when any test failed. It stays within
# a deadline (GPU_CHECK_DEADLINE_S, default 480 s): each step has its own time limit (STEP_LIMIT_S,
# default 150 s, cut to what is left of the deadline), and the steps the deadline leaves no time for
# are reported as skipped. The report is written as it goes, and the logs and metrics of every step
# go to gpu-logs.tar.gz beside it, so a run cut off from outside still returns what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."

BIN="" REPORT="" TESTS_ONLY=0 ONLY=kernels,train,memory,shared,inference,bench,flux,documents
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN=$2; shift 2 ;;
    --report) REPORT=$2; shift 2 ;;
    --tests-only) TESTS_ONLY=1; shift ;;
    --only) ONLY=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
if [ -z "$BIN" ]; then
  if [ -f bundle/env.sh ]; then BIN=bundle/bin; else BIN=build-cuda; fi
fi
if [ "$BIN" = bundle/bin ]; then
  # shellcheck source=/dev/null
  source bundle/env.sh || { echo "gpu_check: bundle/env.sh refused this machine (see above)"; exit 2; }
fi
[ -n "$REPORT" ] || REPORT=${OUT:+$OUT/}gpu-report.md
STEP_LIMIT_S=${STEP_LIMIT_S:-150}
DEADLINE_S=${GPU_CHECK_DEADLINE_S:-480}
PY=$(command -v python3 || true)
for f in shardtrain gpu_tests; do
  [ -x "$BIN/$f" ] || { echo "gpu_check: $BIN/$f is missing; build with 'make CUDA=1' (or make the bundle)"; exit 2; }
done

WORK=$(mktemp -d /tmp/shardtrain-gpu.XXXXXX)
LOGS_TAR=$(dirname "$REPORT")/gpu-logs.tar.gz
SAVE_LOGS=0  # once a GPU is found
save_logs() { [ "$SAVE_LOGS" = 0 ] || tar -czf "$LOGS_TAR" -C "$WORK" --exclude=data --exclude='ckpt-*' . 2>/dev/null; }
trap 'save_logs; rm -rf "$WORK"' EXIT
FAILED=0
T0=$(date +%s)
# limit: the seconds the next step may take (STEP_LIMIT_S, or what is left of the deadline); fails
# (and the step is skipped) when under 15 s are left.
limit() {
  local left=$(( DEADLINE_S - ($(date +%s) - T0) ))
  [ "$left" -ge 15 ] || return 1
  echo $(( left < STEP_LIMIT_S ? left : STEP_LIMIT_S ))
}
report() { printf '%s\n' "$*" | tee -a "$REPORT"; }
section() { report ""; report "## $*"; report ""; }
want() { [[ ",$ONLY," == *",$1,"* ]] && { [ "$1" != bench ] || [ "$TESTS_ONLY" = 0 ]; }; }
: >"$REPORT"

report "# ShardTrain GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
report ""
report "- host: $(hostname), $(nproc) CPUs, glibc $(getconf GNU_LIBC_VERSION 2>/dev/null | cut -d' ' -f2)"
if [ -f "$BIN/../COMMIT" ]; then  # the bundle's: the tree it was built from
  report "- commit: $(cat "$BIN/../COMMIT") (the bundle's)"
else
  report "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
fi
if command -v nvidia-smi >/dev/null; then
  report "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | head -1)"
else
  report "- GPU: nvidia-smi not found"
fi

section "Kernel and communicator tests (gpu_tests, one process per suite)"
"$BIN/gpu_tests" --gtest_filter='NoSuchTest' >"$WORK/gpu_probe.log" 2>&1
if grep -q "no GPU" "$WORK/gpu_probe.log"; then
  report "$(cat "$WORK/gpu_probe.log")"
  report ""
  report "No GPU here: nothing else to check."
  exit 0
fi
SAVE_LOGS=1
# One process per suite: an abort (a fatal CUDA or cuBLASLt error) costs one suite, not the rest.
if want kernels; then
report "| suite | tests | failed | exit | seconds |"
report "|---|---:|---:|---:|---:|"
for suite in $("$BIN/gpu_tests" --gtest_list_tests 2>/dev/null | grep -v '^ ' | tr -d '.'); do
  log=$WORK/gpu_tests-${suite//\//_}.log
  t=$(date +%s)
  lim=$(limit) || { FAILED=1; report "| $suite | skipped: deadline | | | |"; continue; }
  timeout "$lim" "$BIN/gpu_tests" --gtest_brief=1 --gtest_filter="$suite.*" >"$log" 2>&1
  rc=$?
  ran=$(grep -oE '^\[==========\] [0-9]+ tests? from' "$log" | tail -1 | grep -oE '[0-9]+' | head -1)
  failed=$(grep -cE '^\[  FAILED  \] [A-Za-z]' "$log")
  report "| $suite | ${ran:-?} | $failed | $rc | $(( $(date +%s) - t )) |"
  if [ $rc -ne 0 ]; then
    FAILED=1
    report ""; report "<details><summary>$suite: exit $rc</summary>"; report ""; report '```'
    report "$(grep -vE '^\[( +OK|==========|----------| RUN  )' "$log" | tail -60)"; report '```'; report "</details>"; report ""
  fi
done
fi

# One training run: run NAME DEVICE NP CONFIG [OPTIONS...]; its metrics land in $WORK/NAME.jsonl.
"$BIN/shardtrain" data synth --out-dir "$WORK/data" >/dev/null || { report "data synth failed"; exit 1; }
run() {
  local name=$1 device=$2 np=$3 config=$4 lim; shift 4
  lim=$(limit) || { echo "skipped: the check's deadline (GPU_CHECK_DEADLINE_S=$DEADLINE_S) left no time" >"$WORK/$name.log"; return 124; }
  timeout "$lim" mpirun --oversubscribe --bind-to none -np "$np" "$BIN/shardtrain" train --config "$config" \
    --train.device="$device" --train.run_name="$name" --train.metrics_file="$WORK/$name.jsonl" \
    --checkpoint.dir="$WORK/ckpt-$name" --checkpoint.every=0 --checkpoint.resume=none \
    --data.train_file="${TRAIN_FILE:-$WORK/data/synth_train.bin}" --data.val_file= "$@" >"$WORK/$name.log" 2>&1
}
# compare_losses A B [BOUND [STEPS]]: the largest relative difference of the step losses of two
# metrics files (of their first STEPS steps when given), ok when at most BOUND (default 1e-3).
compare_losses() {
  "$PY" - "$1" "$2" "${3:-1e-3}" "${4:-0}" <<'PY'
import json, sys
def losses(path):
    found = [json.loads(l)["loss"] for l in open(path) if '"kind":"step"' in l]
    return found[:int(sys.argv[4])] if int(sys.argv[4]) > 0 else found
a, b, bound = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
if not a or len(a) != len(b):
    print(f"step counts differ: {len(a)} vs {len(b)}"); sys.exit(1)
worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
print(f"{len(a)} steps, max relative difference {worst:.2e} (first {a[0]:.6f} vs {b[0]:.6f}, last {a[-1]:.6f} vs {b[-1]:.6f})")
sys.exit(0 if worst <= bound else 1)
PY
}

# write_flux_data DIR: flux-tiny's latents (DIR/flux_train.h5, 48 records of 4 x 4 tokens) and two
# prompts (DIR/flux_prompts.h5), random, as tools/encode_images.py writes them.
write_flux_data() {
  "$PY" - "$1" <<'PY'
import sys, h5py, numpy as np
rng = np.random.default_rng(1)
with h5py.File(sys.argv[1] + "/flux_train.h5", "w") as f:
    f["latents"] = rng.standard_normal((48, 16, 16)).astype(np.float32)
    f["encoder_hidden_states"] = rng.standard_normal((48, 8, 32)).astype(np.float32)
    f["pooled_projections"] = rng.standard_normal((48, 24)).astype(np.float32)
    f.attrs["grid_rows"], f.attrs["grid_cols"] = np.int64(4), np.int64(4)
with h5py.File(sys.argv[1] + "/flux_prompts.h5", "w") as f:
    f["encoder_hidden_states"] = rng.standard_normal((2, 8, 32)).astype(np.float32)
    f["pooled_projections"] = rng.standard_normal((2, 24)).astype(np.float32)
PY
}

# against_cpu LABEL NAME CPU_RANKS GPU_RANKS OPTIONS...: the same training on the CPU and on the GPU
# (runs cmp-cpu-NAME and cmp-gpu-NAME) of CONFIG (default inputs/tiny.ini), reported ok when their
# losses agree (compare_losses).
against_cpu() {
  local label=$1 name=$2 cpu_np=$3 gpu_np=$4 config=${CONFIG:-inputs/tiny.ini}; shift 4
  if run "cmp-cpu-$name" cpu "$cpu_np" "$config" "$@" && run "cmp-gpu-$name" cuda "$gpu_np" "$config" "$@"; then
    if out=$(compare_losses "$WORK/cmp-gpu-$name.jsonl" "$WORK/cmp-cpu-$name.jsonl"); then
      report "- ok   $label: GPU ($gpu_np rank$([ "$gpu_np" = 1 ] || echo s)) vs CPU ($cpu_np ranks): $out"
    else
      FAILED=1; report "- FAIL $label: GPU vs CPU: $out"
    fi
  else
    FAILED=1; report "- FAIL $label: a run failed:"; report '```'
    report "$(tail -15 "$WORK/cmp-cpu-$name.log" 2>/dev/null; tail -15 "$WORK/cmp-gpu-$name.log" 2>/dev/null)"; report '```'
  fi
}

# bf16_cudnn_against_cpu LABEL NAME CONFIG OPTIONS...: CONFIG's run in bf16 on the GPU with cuDNN's
# attention against the CPU's fp32 run (losses within 2e-2; the CPU's own bf16 drift beside it);
# a GPU run that fell back to the tiled kernels fails.
bf16_cudnn_against_cpu() {
  local label=$1 name=$2 config=$3; shift 3
  if run "$name-cpu-fp32" cpu 2 "$config" "$@" && run "$name-cpu-bf16" cpu 2 "$config" "$@" --fsdp.param_dtype=bf16 &&
     run "$name-gpu-bf16" cuda 1 "$config" "$@" --fsdp.param_dtype=bf16 --train.attention=cudnn; then
    local cpu_drift out
    cpu_drift=$(compare_losses "$WORK/$name-cpu-bf16.jsonl" "$WORK/$name-cpu-fp32.jsonl" 1)
    if ! grep -q "attention cudnn" "$WORK/$name-gpu-bf16.log" || grep -q "no cuDNN" "$WORK/$name-gpu-bf16.log"; then
      FAILED=1; report "- FAIL $label: the GPU did not run cuDNN's attention:"; report '```'
      report "$(grep -E 'compute:|cuDNN' "$WORK/$name-gpu-bf16.log" | head -5)"; report '```'
    elif out=$(compare_losses "$WORK/$name-gpu-bf16.jsonl" "$WORK/$name-cpu-fp32.jsonl" 2e-2); then
      report "- ok   $label: GPU bf16 vs CPU fp32: $out; CPU bf16 vs CPU fp32: $cpu_drift"
    else
      FAILED=1; report "- FAIL $label: GPU bf16 vs CPU fp32: $out; CPU bf16 vs CPU fp32: $cpu_drift"
    fi
  else
    FAILED=1; report "- FAIL $label: a run failed:"; report '```'
    report "$(tail -8 "$WORK/$name-cpu-fp32.log"; tail -8 "$WORK/$name-cpu-bf16.log"; tail -8 "$WORK/$name-gpu-bf16.log")"
    report '```'
  fi
}

if want train; then
section "20 training steps on the GPU against the CPU (fp32, losses within 1e-3 relative)"
CMP_MODEL=(--train.steps=20 --train.threads=4 --model.n_layer=4 --model.n_embd=256 --model.n_head=4 --model.max_seq_len=128 --train.seq_len=128)
for strategy in FULL_SHARD NO_SHARD; do
  against_cpu "$strategy" "$strategy" 2 1 "${CMP_MODEL[@]}" --train.micro_batch=4 --train.global_batch=8 --fsdp.sharding_strategy=$strategy
done
# A quantized frozen base (docs/quantization.md): the GPU's dequantization kernel in the gathers.
against_cpu "LoRA on an NF4 base" qlora 2 1 "${CMP_MODEL[@]}" --train.micro_batch=4 --train.global_batch=8 \
  --adapter.type=lora --adapter.targets=attn.c_attn,mlp.c_fc --fsdp.frozen_dtype=nf4
# ... and in bf16, where the quantized weights live in the gathered 16-bit copies alone (their fp32
# place reserved but not mapped: the driver's virtual memory) and DoRA reads them through the copy;
# double-quantized, so the kernel decodes each absmax through the unit's nested table on the device.
bf16_cudnn_against_cpu "DoRA on a double-quantized NF4 base in bf16 (dequantized into the 16-bit copy alone)" qdora-bf16 \
  inputs/llama-tiny.ini --train.steps=20 --train.threads=4 --train.micro_batch=4 --train.global_batch=8 \
  --model.n_embd=64 --model.n_head=4 --adapter.type=dora --adapter.targets=q_proj,v_proj,down_proj \
  --fsdp.frozen_dtype=nf4 --fsdp.quant_block=32 --fsdp.double_quant=true

# The Llama family (grouped-query attention, rotary, RMSNorm, SwiGLU, untied head) and packed
# documents (attention within each document, positions restarting: the kernels' document starts).
LLAMA_CMP=(--train.steps=20 --train.threads=4 --train.micro_batch=4 --train.global_batch=8)
DOCUMENTS=(--data.documents=true --data.document_start=10 --data.restart_positions=true)
CONFIG=inputs/llama-tiny.ini against_cpu "Llama (GQA, rotary, SwiGLU)" llama 2 1 "${LLAMA_CMP[@]}"
CONFIG=inputs/llama-tiny.ini against_cpu "Llama, packed documents" llama-documents 2 1 "${LLAMA_CMP[@]}" "${DOCUMENTS[@]}"
# Qwen3: each query and key head RMSNorm-ed (strided row copies around the norm kernels), heads of 12 on a width of 40.
CONFIG=inputs/llama-tiny.ini against_cpu "Qwen3 (q/k norms, heads of their own size)" qwen3 2 1 "${LLAMA_CMP[@]}" \
  --model.arch=qwen3 --model.head_dim=12
# Mistral's sliding window (5 of the 32 positions): each row's first key, as packed documents give them.
CONFIG=inputs/llama-tiny.ini against_cpu "Llama with a sliding window of 5" llama-window 2 1 "${LLAMA_CMP[@]}" \
  --model.sliding_window=5
against_cpu "GPT-2, packed documents" documents 2 1 "${CMP_MODEL[@]}" --train.micro_batch=4 --train.global_batch=8 "${DOCUMENTS[@]}"

# The FLUX family (joint attention without the causal mask, interleaved rotary pairs, adaptive
# LayerNorm, gated residuals, flow matching) on random latents as tools/encode_images.py writes
# them; then `sample` from the GPU run's checkpoint on the GPU against the CPU.
write_flux_data "$WORK/data"
TRAIN_FILE=$WORK/data/flux_train.h5 CONFIG=inputs/flux-tiny.ini against_cpu "FLUX (double and single stream, flow matching)" \
  flux 2 1 --train.steps=10 --train.micro_batch=2 --train.global_batch=4 --train.threads=4
TRAIN_FILE=$WORK/data/flux_train.h5 CONFIG=inputs/flux2-tiny.ini against_cpu \
  "FLUX.2 (shared modulations, SwiGLU, fused single blocks; the same latents, their pooled vector unread)" \
  flux2 2 1 --train.steps=10 --train.micro_batch=2 --train.global_batch=4 --train.threads=4
# Recomputing only the first 3 of FLUX.2's 4 blocks (fsdp.checkpoint_blocks) on the GPU against
# keeping every activation, in fp32 (its run above) and with bf16 parameters and activations: the
# same kernels on the same inputs, so the losses within 1e-6.
FLUX2_GPU=(--train.steps=10 --train.micro_batch=2 --train.global_batch=4)
RECOMPUTE=(--fsdp.activation_checkpointing=true --fsdp.checkpoint_blocks=3)
for dtype in fp32 bf16; do
  out="" kept="cmp-gpu-flux2"
  if [ "$dtype" = bf16 ]; then
    kept="flux2-keep-gpu-bf16"
    TRAIN_FILE=$WORK/data/flux_train.h5 run "$kept" cuda 1 inputs/flux2-tiny.ini "${FLUX2_GPU[@]}" --fsdp.param_dtype=bf16
  fi
  if TRAIN_FILE=$WORK/data/flux_train.h5 run "flux2-recompute-gpu-$dtype" cuda 1 inputs/flux2-tiny.ini "${FLUX2_GPU[@]}" \
       --fsdp.param_dtype=$dtype "${RECOMPUTE[@]}" &&
     out=$(compare_losses "$WORK/flux2-recompute-gpu-$dtype.jsonl" "$WORK/$kept.jsonl" 1e-6); then
    report "- ok   FLUX.2 $dtype recomputing 3 of 4 blocks vs keeping all, on the GPU: $out"
  else
    FAILED=1; report "- FAIL FLUX.2 $dtype recomputing 3 of 4 blocks on the GPU: ${out:-a run failed}"; report '```'
    report "$(tail -8 "$WORK/flux2-recompute-gpu-$dtype.log" 2>/dev/null; tail -8 "$WORK/$kept.log" 2>/dev/null)"
    report '```'
  fi
done
flux_ckpt=$(ls "$WORK"/ckpt-cmp-gpu-flux/ckpt-*.h5 2>/dev/null | tail -1)
for device in cuda cpu; do
  lim=$(limit) || break
  timeout "$lim" mpirun --oversubscribe --bind-to none -np 1 "$BIN/shardtrain" sample --checkpoint "$flux_ckpt" \
    --prompts "$WORK/data/flux_prompts.h5" --output "$WORK/flux-sample-$device.h5" --grid 4x4 --steps 4 --seed 3 \
    --device $device >"$WORK/flux-sample-$device.log" 2>&1
done
if out=$("$PY" - "$WORK/flux-sample-cuda.h5" "$WORK/flux-sample-cpu.h5" <<'PY'
import sys, h5py, numpy as np
a, b = (h5py.File(p, "r")["latents"][()] for p in sys.argv[1:3])
error = np.abs(a - b).max() / np.abs(b).max()
print(f"latents {a.shape}, max difference {error:.2e} of the largest")
sys.exit(0 if a.shape == b.shape and error < 1e-4 else 1)
PY
); then report "- ok   FLUX sample on the GPU vs the CPU: $out"; else
  FAILED=1; report "- FAIL FLUX sample on the GPU vs the CPU: ${out:-no output}"; report '```'
  report "$(tail -8 "$WORK/flux-sample-cuda.log" 2>/dev/null)"; report '```'
fi

section "One host synchronization per step on the GPU (host_syncs of the GPU runs above)"
for strategy in FULL_SHARD NO_SHARD; do
  if out=$("$PY" - "$WORK/cmp-gpu-$strategy.jsonl" <<'PY'
import json, sys
counts = [json.loads(l)["host_syncs"] for l in open(sys.argv[1]) if '"kind":"step"' in l]
print(f"{len(counts)} steps, host waits per step: {sorted(set(counts))}")
sys.exit(0 if counts and set(counts) == {1} else 1)
PY
  ); then report "- ok   $strategy: $out"; else FAILED=1; report "- FAIL $strategy: $out"; fi
done

section "bf16 on the GPU against the CPU (fsdp.param_dtype=bf16: step 1 within 1e-4 of the CPU's bf16 run, every step within 2e-2 of the CPU's fp32 run)"
# fsdp.activation_dtype fp32 rounds only the GEMM operands; bf16 (the default with bf16
# parameters) also stores every saved activation in bf16. Step 1 holds the GPU's roundings to the
# CPU's (the same rounding points, different summation orders); over 20 steps bf16 training drifts
# from fp32 by its own precision: the CPU's bf16 runs of this model differ from its fp32 run by
# 1.4-1.5% (measured 2026-11-26), so the GPU's are held to 2e-2 and the CPU's drift is shown beside.
for acts in fp32 bf16; do
  BF16_OPTS=("${CMP_MODEL[@]}" --train.micro_batch=4 --train.global_batch=8 --fsdp.param_dtype=bf16 --fsdp.activation_dtype=$acts)
  if run "act-cpu-$acts" cpu 2 inputs/tiny.ini "${BF16_OPTS[@]}" && run "act-gpu-$acts" cuda 1 inputs/tiny.ini "${BF16_OPTS[@]}"; then
    cpu_drift=$(compare_losses "$WORK/act-cpu-$acts.jsonl" "$WORK/cmp-cpu-FULL_SHARD.jsonl" 1)
    if first=$(compare_losses "$WORK/act-gpu-$acts.jsonl" "$WORK/act-cpu-$acts.jsonl" 1e-4 1) &&
       out=$(compare_losses "$WORK/act-gpu-$acts.jsonl" "$WORK/cmp-cpu-FULL_SHARD.jsonl" 2e-2); then
      report "- ok   activations $acts: GPU bf16 vs CPU bf16, step 1: $first; GPU bf16 vs CPU fp32: $out; CPU bf16 vs CPU fp32: $cpu_drift"
    else
      FAILED=1; report "- FAIL activations $acts: GPU bf16 vs CPU bf16, step 1: $first; GPU bf16 vs CPU fp32: ${out:-not compared}; CPU bf16 vs CPU fp32: $cpu_drift"
    fi
  else
    FAILED=1; report "- FAIL activations $acts: a run failed:"; report '```'
    report "$(tail -15 "$WORK/act-cpu-$acts.log"; tail -15 "$WORK/act-gpu-$acts.log")"; report '```'
  fi
done
# fsdp.keep_half_shard=true (off by default on a GPU): the shard's bf16 copy kept on the card, rounded
# once per optimizer step, gives the losses of rounding at every gather (1e-6: a stale copy would be
# a learning-rate step away).
if run "keep-gpu-bf16" cuda 1 inputs/tiny.ini "${BF16_OPTS[@]}" --fsdp.keep_half_shard=true &&
   out=$(compare_losses "$WORK/keep-gpu-bf16.jsonl" "$WORK/act-gpu-bf16.jsonl" 1e-6); then
  report "- ok   keep_half_shard=true on the GPU: $out"
else
  FAILED=1; report "- FAIL keep_half_shard=true on the GPU: ${out:-the run failed}"; report '```'
  report "$(tail -15 "$WORK/keep-gpu-bf16.log")"; report '```'
fi

fi

if want memory; then
section "GPU memory against the plan (tests/e2e/test_gpu_memory.py: reserved within 5% + 16 MiB)"
if lim=$(limit) && timeout "$lim" "$PY" tests/run_tests.py --build "$BIN" --suite e2e -k test_gpu_memory >"$WORK/gpu_memory.log" 2>&1; then
  report "- ok   $(tail -1 "$WORK/gpu_memory.log")"
else
  FAILED=1; report "- FAIL GPU memory against the plan:"; report '```'; report "$(tail -20 "$WORK/gpu_memory.log")"; report '```'
fi

fi

if want shared; then
section "2 and 4 ranks sharing the GPU (fsdp.comm_backend=mpi) against the CPU on as many ranks (fp32, losses within 1e-3 relative)"
# Host MPI through page-locked staging buffers: the only multi-rank GPU run one GPU allows (NCCL
# refuses two ranks on one GPU). Micro-batches of 2 make the same 8 sequences a step on 2 and 4
# ranks. One visible GPU (the first of CUDA_VISIBLE_DEVICES, else 0), so the ranks share it.
ONE_GPU=${CUDA_VISIBLE_DEVICES:-0}
ONE_GPU=${ONE_GPU%%,*}
SHARED_OPTS=("${CMP_MODEL[@]}" --train.micro_batch=2 --train.global_batch=8 --fsdp.sharding_strategy=FULL_SHARD)
for np in 2 4; do
  CUDA_VISIBLE_DEVICES=$ONE_GPU against_cpu "FULL_SHARD, $np ranks on one GPU" "shared-$np" "$np" "$np" \
    "${SHARED_OPTS[@]}" --fsdp.comm_backend=mpi
done
# With NCCL (the default on cuda) the same start is refused before NCCL starts: exit 2, one line.
CUDA_VISIBLE_DEVICES=$ONE_GPU run shared-nccl-2 cuda 2 inputs/tiny.ini "${SHARED_OPTS[@]}"
rc=$?
if [ $rc = 2 ] && grep -q "fsdp.comm_backend=mpi to share GPUs" "$WORK/shared-nccl-2.log"; then
  report "- ok   2 ranks on one GPU with NCCL: refused at start-up (exit 2, naming fsdp.comm_backend=mpi)"
else
  FAILED=1; report "- FAIL 2 ranks on one GPU with NCCL: exit $rc, expected 2 and the same-GPU message:"
  report '```'; report "$(tail -5 "$WORK/shared-nccl-2.log")"; report '```'
fi

fi

if want inference; then
section "Generation and distillation on the GPU against the CPU (the same text; distilled losses within 1e-3 relative)"
# A Llama trained on the CPU, with a sliding window of 12 that its 32-token sequences and the 48
# generated tokens pass, is the checkpoint to generate from (greedy, then sampled with a seed: the
# KV cache's decode attention over the window, top-k/top-p and the sampler on the GPU's logits) and
# the teacher of a distillation run (its forward on the student's buffers), in fp32 and as an NF4
# teacher.
INF_OPTS=(--train.steps=20 --train.threads=4 --train.micro_batch=4 --train.global_batch=8)
run inf-teacher cpu 2 inputs/llama-tiny.ini "${INF_OPTS[@]}" --train.steps=300 --model.sliding_window=12
teacher=$(ls "$WORK"/ckpt-inf-teacher/ckpt-*.h5 2>/dev/null | tail -1)
if [ -z "$teacher" ]; then
  FAILED=1; report "- FAIL the teacher's training run wrote no checkpoint:"; report '```'
  report "$(tail -8 "$WORK/inf-teacher.log")"; report '```'
else
  for mode in greedy sampled; do
    case $mode in
      greedy) opts=(--max-tokens 48 --temperature 0) ;;
      sampled) opts=(--max-tokens 48 --temperature 1 --top-k 40 --top-p 0.95 --seed 7) ;;
    esac
    for device in cuda cpu; do
      lim=$(limit) || break
      timeout "$lim" mpirun --oversubscribe --bind-to none -np 1 "$BIN/shardtrain" generate --checkpoint "$teacher" \
        --prompt "The " --ignore-eos --threads 4 --device $device "${opts[@]}" \
        >"$WORK/generate-$mode-$device.txt" 2>"$WORK/generate-$mode-$device.log"
    done
    if [ -s "$WORK/generate-$mode-cuda.txt" ] && cmp -s "$WORK/generate-$mode-cuda.txt" "$WORK/generate-$mode-cpu.txt"; then
      report "- ok   generate, $mode: the same $(wc -c <"$WORK/generate-$mode-cuda.txt") bytes on the GPU as on the CPU ($(grep -oE 'generate: [0-9]+ tokens? in [^|]*' "$WORK/generate-$mode-cuda.log" | head -1) on the GPU)"
    else
      FAILED=1; report "- FAIL generate, $mode: the GPU's text differs from the CPU's (or is empty):"; report '```'
      report "$(head -c 300 "$WORK/generate-$mode-cuda.txt"; echo; head -c 300 "$WORK/generate-$mode-cpu.txt"; echo; tail -5 "$WORK/generate-$mode-cuda.log")"
      report '```'
    fi
  done
  CONFIG=inputs/llama-tiny.ini against_cpu "distillation from a Llama teacher (alpha 0.5, temperature 2)" distill 2 1 \
    "${INF_OPTS[@]}" --distill.teacher="$teacher" --distill.alpha=0.5 --distill.temperature=2
  CONFIG=inputs/llama-tiny.ini against_cpu "distillation from the same teacher quantized to NF4" distill-nf4 2 1 \
    "${INF_OPTS[@]}" --distill.teacher="$teacher" --distill.alpha=0.5 --distill.temperature=2 \
    --distill.teacher_dtype=nf4 --fsdp.quant_block=32
fi
fi

# The disabled attention benchmark of gpu_tests: cuDNN against the tiled kernels.
attention_bench() {
  if lim=$(limit) && timeout "$lim" "$BIN/gpu_tests" --gtest_also_run_disabled_tests \
      --gtest_filter='CudnnAttentionBench.*' >"$WORK/attention_bench.log" 2>&1; then
    report "$(grep '^attention' "$WORK/attention_bench.log" | sed 's/^/- /')"
  else
    FAILED=1; report "- FAIL the attention benchmark:"; report '```'; report "$(tail -20 "$WORK/attention_bench.log")"; report '```'
  fi
}
throughput_header() {
  report "| config | dtype | attention | offload | micro-batch | tokens/s | MFU | forward | backward | grad sync | optimizer | GPU reserved | plan | reserved/plan | log |"
  report "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
}
bench() { # bench CONFIG MICRO PARAM_DTYPE STEPS OFFLOAD ATTENTION [NAME_SUFFIX OPTIONS...]
  local config=$1 micro=$2 dtype=$3 steps=$4 offload=$5 attention=$6 name plan
  name=bench-$(basename "$config" .ini)-$dtype-$attention-b$micro$([ "$offload" = true ] && echo -offload)${7:-}
  local opts=(--train.micro_batch="$micro" --train.global_batch="$micro" --fsdp.param_dtype="$dtype"
              --fsdp.reduce_dtype=fp32 --fsdp.cpu_offload="$offload" --train.attention="$attention" "${@:8}")
  # The planner's peak for this run (the GPU's own buffers and the allocator's rounding included).
  plan=$("$BIN/shardtrain" plan --world-size=1 --format=lines --config "$config" --train.device=cuda "${opts[@]}" 2>/dev/null |
         grep "^PLAN .*checkpointing=no offload=$([ "$offload" = true ] && echo yes || echo no) " |
         grep -oE 'peak_bytes=[0-9]+' | head -1 | cut -d= -f2)
  if run "$name" cuda 1 "$config" --train.steps="$steps" --train.warmup_steps=0 "${opts[@]}" --checkpoint.save=false; then
    "$PY" - "$WORK/$name.jsonl" "$config" "$dtype" "$attention" "$offload" "$micro" "$name" "${plan:-0}" <<'PY' | tee -a "$REPORT"
import json, statistics, sys
path, config, dtype, attention, offload, micro, name, plan = sys.argv[1:]
steps = [json.loads(l) for l in open(path) if '"kind":"step"' in l][2:]
tps = statistics.median(s["tokens_per_s"] for s in steps)
mfu = statistics.median(s["mfu"] for s in steps)
step_s = statistics.median(s["step_seconds"] for s in steps)
phase = lambda p: statistics.median(s["phase_seconds"][p] for s in steps)
split = " | ".join(f"{1e3 * phase(p):.0f} ms ({phase(p) / step_s:.0%})" for p in ("forward", "backward", "grad_sync", "optimizer"))
reserved = max(s["device_reserved_bytes"] for s in steps)
ratio = f"{reserved / int(plan):.3f}" if int(plan) else "no plan"
print(f"| {config} | {dtype} | {attention} | {offload} | {micro} | {tps:,.0f} | {mfu:.3f} | {split} "
      f"| {reserved / 2**30:.2f} GiB | {int(plan) / 2**30:.2f} GiB | {ratio} | {name} |")
PY
  else
    FAILED=1; report "| $config | $dtype | $attention | $offload | $micro | failed: $(tail -1 "$WORK/$name.log") | | | | | | | | | $name |"
  fi
}
# ops_table NAME CONFIG OPTIONS...: five steps with train.op_times, rank 0's table into the report.
ops_table() {
  local name=$1 config=$2; shift 2
  if run "$name" cuda 1 "$config" --train.steps=5 --train.op_times=true --checkpoint.save=false "$@"; then
    report '```'; report "$(sed -n '/^op times/,/^timed in all/p' "$WORK/$name.log")"; report '```'
  else
    FAILED=1; report "- FAIL the op-timed run $name:"; report '```'; report "$(tail -15 "$WORK/$name.log")"; report '```'
  fi
}

if want bench; then
  section "Attention kernels: cuDNN against the tiled fp32 kernels (forward + backward; GPT-2 small's heads, FLUX.1's unmasked joint attention)"
  attention_bench
  section "Training throughput on one GPU (median of steps 3..N; MFU against the card's dense bf16 peak; the step's phases on the GPU's clock)"
  throughput_header
  # bf16 first (the targets), with both attention kernels, at 8 sequences and at 32 (far more of
  # the card); then fp32 and offload.
  for attention in cudnn tiled; do
    for micro in 8 32; do bench inputs/gpt-300M.ini "$micro" bf16 10 false $attention; done
  done
  for attention in cudnn tiled; do bench inputs/gpt2-124M.ini 32 bf16 12 false $attention; done
  bench inputs/gpt2-124M.ini 8 fp32 12 false tiled
  bench inputs/gpt-300M.ini 8 fp32 10 false tiled
  bench inputs/gpt-300M.ini 8 bf16 10 true cudnn  # cpu_offload: the GPU memory it saves, the time it costs
  bench inputs/llama-135M.ini 8 bf16 10 false cudnn  # the Llama shape (GQA, 49,152-row tied head)

  section "Where the step's time goes: every layer op on the GPU's clock (train.op_times, gpt-300M, bf16, cuDNN, micro-batch 8)"
  ops_table ops-gpt-300M inputs/gpt-300M.ini --train.micro_batch=8 --train.global_batch=8 --fsdp.param_dtype=bf16 \
    --train.attention=cudnn
fi

if want flux; then
  section "FLUX in bf16 on the GPU (cuDNN's unmasked attention) against the CPU (fp32 and bf16; 10 steps within 2e-2 of fp32)"
  [ -f "$WORK/data/flux_train.h5" ] || write_flux_data "$WORK/data"
  TRAIN_FILE=$WORK/data/flux_train.h5 bf16_cudnn_against_cpu "FLUX bf16, cuDNN attention" flux inputs/flux-tiny.ini \
    --train.steps=10 --train.micro_batch=2 --train.global_batch=4 --train.threads=4

fi
if want documents; then
  section "Packed documents in bf16 on the GPU (cuDNN's graph with the documents' score bias) against the CPU (fp32 and bf16; 20 steps within 2e-2 of fp32)"
  bf16_cudnn_against_cpu "Llama, packed documents, cuDNN attention" llama-documents inputs/llama-tiny.ini \
    --train.steps=20 --train.threads=4 --train.micro_batch=4 --train.global_batch=8 --model.n_embd=64 --model.n_head=4 \
    --data.documents=true --data.document_start=10 --data.restart_positions=true
  if [ "$TESTS_ONLY" = 0 ]; then
    section "Packed documents' throughput on one GPU (llama-135M, bf16, T = 1024, documents from every newline; median of steps 3..N)"
    throughput_header
    for attention in cudnn tiled; do
      bench inputs/llama-135M.ini 8 bf16 10 false $attention -documents --data.documents=true --data.document_start=10
    done
  fi
fi
# FLUX's speed: the attention benchmark (unless the bench section ran it) and a FLUX.1-wide model.
if want flux && [ "$TESTS_ONLY" = 0 ]; then
  want bench || { section "Attention kernels: cuDNN against the tiled fp32 kernels (forward + backward)"; attention_bench; }

  section "FLUX throughput on one GPU (inputs/flux-1B.ini: FLUX.1's width and heads, 512x512 images; median of steps 3..N)"
  "$PY" - "$WORK/data/flux_1b.h5" <<'PY'
import sys, h5py, numpy as np
rng = np.random.default_rng(2)
with h5py.File(sys.argv[1], "w") as f:  # 8 records: 32 x 32 latent tokens of 64, 512 text tokens of 4096
    f["latents"] = rng.standard_normal((8, 1024, 64)).astype(np.float32)
    f["encoder_hidden_states"] = rng.standard_normal((8, 512, 4096)).astype(np.float32)
    f["pooled_projections"] = rng.standard_normal((8, 768)).astype(np.float32)
    f.attrs["grid_rows"], f.attrs["grid_cols"] = np.int64(32), np.int64(32)
PY
  throughput_header
  for attention in cudnn tiled; do TRAIN_FILE=$WORK/data/flux_1b.h5 bench inputs/flux-1B.ini 2 bf16 8 false $attention; done
  section "Where FLUX's step goes (train.op_times, flux-1B, bf16, cuDNN, micro-batch 2)"
  TRAIN_FILE=$WORK/data/flux_1b.h5 ops_table ops-flux-1B inputs/flux-1B.ini --train.micro_batch=2 --train.global_batch=2 \
    --fsdp.param_dtype=bf16 --train.attention=cudnn
fi

section "Logs"
for f in "$WORK"/*.log; do
  case $(basename "$f") in gpu_tests-*|gpu_probe.log) continue ;; esac  # failures are shown above
  report "<details><summary>$(basename "$f")</summary>"; report ""; report '```'
  report "$(grep -v '^step ' "$f" | head -40; grep '^step ' "$f" | tail -3)"; report '```'; report "</details>"
done
report ""
report "$( [ $FAILED = 0 ] && echo 'ALL PASSED' || echo 'SOME CHECKS FAILED' ) in $(( $(date +%s) - T0 )) s"
exit $FAILED

"""Memory: the planner predicts what the trainer tracks (exactly, by construction: both use the
same sizing functions; the bar is 2%), tracking covers the process's real resident growth, the
planner sizes any model without allocating it, and fsdp.memory_limit reproduces the FSDP headline:
a model that does not fit under NO_SHARD on 4 ranks trains under FULL_SHARD."""
import os
import re
import subprocess
import time

from harness import EXE, ROOT, ensure_data, read_metrics, run, run_measured, run_single, tempdir, tiny_args

GPT2_AT_64 = ["--model.n_layer=12", "--model.n_embd=768", "--model.n_head=12", "--model.vocab_size=50257",
              "--model.max_seq_len=1024", "--train.seq_len=64", "--train.micro_batch=1", "--train.global_batch=2",
              "--train.steps=1", "--data.val_file="]


def trained_peak(np_, *overrides):
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = run(np_, tiny_args("--train.steps=1", "--checkpoint.save=false", f"--train.metrics_file={metrics}",
                              *overrides), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return read_metrics(metrics)[-1]


def planned_peak(np_, strategy, reduce, checkpointing, *overrides):
    args = tiny_args(*overrides)[1:]  # drop "train": the same config and overrides
    proc = run_single(["plan", f"--world-size={np_}", "--format=lines", *args])
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.splitlines():
        m = re.match(rf"PLAN strategy={strategy} reduce={reduce} checkpointing={checkpointing} offload=no peak_bytes=(\d+)", line)
        if m:
            return int(m.group(1))
    raise AssertionError(f"no PLAN line for {strategy}/{reduce}/{checkpointing}:\n{proc.stdout}")


def test_planner_predicts_the_tracked_peak():
    cases = [
        (2, "FULL_SHARD", "micro", "no", []),
        (3, "SHARD_GRAD_OP", "step", "no", ["--fsdp.sharding_strategy=SHARD_GRAD_OP",
                                             "--fsdp.reduce_every_microbatch=false"]),
        (2, "NO_SHARD", "step", "yes", ["--fsdp.sharding_strategy=NO_SHARD", "--fsdp.activation_checkpointing=true"]),
        (2, "FULL_SHARD", "micro", "no", ["--model.n_layer=4", "--model.n_embd=128", "--model.max_seq_len=128",
                                          "--train.seq_len=128", "--train.global_batch=16", "--train.micro_batch=4"]),
    ]
    for np_, strategy, reduce, ckpt, overrides in cases:
        # held: what the arrays and the ring's buffers hold, counted by the device at allocation
        # (peak_mem_bytes would be the trainer's own plan: comparing with it proves nothing).
        held = trained_peak(np_, *overrides)["held_mem_bytes"]
        planned = planned_peak(np_, strategy, reduce, ckpt, *overrides)
        assert planned == held, (strategy, overrides, planned, held)


def test_tracking_covers_resident_growth_on_gpt2_small():
    record = trained_peak(2, *GPT2_AT_64)
    tracked, resident = record["held_mem_bytes"], record["rss_growth_bytes"]
    print(f"      gpt2-124M seq 64, 2 ranks: tracked {tracked / 2**20:.0f} MiB, resident growth "
          f"{resident / 2**20:.0f} MiB ({tracked / resident:.2f})")
    assert tracked >= 0.9 * resident
    planned = planned_peak(2, "FULL_SHARD", "micro", "no", *GPT2_AT_64)
    assert abs(planned - tracked) <= 0.02 * tracked


def test_plans_gpt_300m_on_64_ranks_without_allocating_it():
    start = time.time()
    proc, peak = run_measured(["plan", "--config", os.path.join(ROOT, "inputs", "gpt-300M.ini"), "--world-size", "64", "--format", "lines",
                               "--ranks-per-node", "8", "--memory-limit", "24GiB", "--train.global_batch=256"],
                              timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.time() - start < 10
    assert peak < 300 * 2**20, peak  # far below 1.2 GB of weights
    assert "recommended: fsdp.sharding_strategy=" in proc.stdout
    assert proc.stdout.count("PLAN strategy=") == 18


def test_headline_no_shard_does_not_fit_full_shard_does():
    train, _ = ensure_data()
    config = ["train", "--config", os.path.join(ROOT, "inputs", "fsdp-headline.ini"), f"--data.train_file={train}",
              f"--checkpoint.dir={tempdir()}", "--train.peak_gflops=100"]
    ddp = run(4, [*config, "--fsdp.sharding_strategy=NO_SHARD"], timeout=120)
    assert ddp.returncode == 2, ddp.stderr[-2000:]
    assert "out of memory" in ddp.stderr and "fsdp.memory_limit=256MiB" in ddp.stderr
    metrics = os.path.join(tempdir(), "m.jsonl")
    fsdp = run(4, [*config, f"--train.metrics_file={metrics}"], timeout=300)
    assert fsdp.returncode == 0, fsdp.stderr[-2000:]
    steps = read_metrics(metrics)
    assert len(steps) == 3 and steps[-1]["held_mem_bytes"] <= 256 * 2**20


def plan_lines(*extra):
    proc = run_single(["plan", "--world-size=2", "--format=lines", *tiny_args(*extra)[1:]])
    assert proc.returncode == 0, proc.stderr
    lines = {}
    for line in proc.stdout.splitlines():
        if line.startswith("PLAN "):
            fields = dict(kv.split("=", 1) for kv in line.split()[1:])
            lines[(fields["strategy"], fields["reduce"], fields["checkpointing"], fields["offload"])] = fields
    return proc.stdout, lines


def test_plan_on_cuda_adds_the_gpu_backends_memory():
    # Planning needs no GPU: the cuda plan is the cpu plan plus the backend's own bytes, which the
    # output lists (cuBLASLt's 32 MiB, the kernels' workspace, the rounding) and marks NCCL's as an
    # estimate; NCCL_BUFFSIZE moves that estimate as NCCL's own variable would.
    cpu_text, cpu = plan_lines("--fsdp.param_dtype=bf16")
    gpu_text, gpu = plan_lines("--fsdp.param_dtype=bf16", "--train.device=cuda")
    assert "GPU backend" not in cpu_text and "gpu_workspace_bytes" not in cpu_text
    assert "cuBLASLt 32.0 MiB" in gpu_text and "16-bit GEMM operands" in gpu_text
    assert "ESTIMATE" in gpu_text and "NCCL_BUFFSIZE" in gpu_text
    assert set(cpu) == set(gpu)
    for key, g in gpu.items():
        backend = int(g["gpu_workspace_bytes"]) + int(g["nccl_bytes"]) + int(g["rounding_bytes"])
        assert int(g["gpu_workspace_bytes"]) > 32 << 20, key  # cuBLASLt's alone is 32 MiB
        assert int(g["nccl_bytes"]) > 0, key                   # two ranks: NCCL communicators
        # The tracked categories are the same arrays, except the CPU's own bf16 GEMM workspace (its
        # size depends on the CPU's bf16 arithmetic), the communicators' buffers (MPI's ring, NCCL's),
        # the shards' 16-bit copies (fsdp.keep_half_shard's default is the CPU's) and the second
        # block gradient buffer NCCL's overlapped reduce-scatters add.
        for category in ("activations_bytes", "gathered_units_bytes", "optimizer_state_bytes"):
            assert g[category] == cpu[key][category], (key, category)
        extra_gradients = max(0, int(g["gradients_bytes"]) - int(cpu[key]["gradients_bytes"]))
        cpu_peak = int(cpu[key]["peak_bytes"])
        gpu_peak = int(g["peak_bytes"])
        assert gpu_peak - backend <= cpu_peak + extra_gradients, key
        assert gpu_peak > cpu_peak, key
    # train.attention=cudnn adds cuDNN attention's buffers to the workspace, exactly the cudnn_attention_bytes
    # the PLAN line gives: at C=64 (HS 16), B=2, T=32 bf16 qkv and dqkv 2*32*12*16*2 B each, out and dout
    # 2*32*64*2 each, row sums 2*4*32*4, and the workspace estimate (T' = 64): dP 2*4*64*64*2 + fp32 dQ
    # 2*4*64*16*4 + 1 MiB. With tiny's own head size (10, not a multiple of 8) cuDNN would not run: 0.
    cudnn_text, cudnn = plan_lines("--model.n_embd=64", "--train.device=cuda", "--train.attention=cudnn")
    _, tiled = plan_lines("--model.n_embd=64", "--train.device=cuda")
    attention = 2 * 24576 + 2 * 8192 + 1024 + 65536 + 32768 + (1 << 20)
    assert "cuDNN attention" in cudnn_text and "cuDNN's own workspace" in cudnn_text and "ESTIMATE" in cudnn_text
    for key, g in cudnn.items():
        assert int(g["cudnn_attention_bytes"]) == attention and int(tiled[key]["cudnn_attention_bytes"]) == 0, key
        assert int(g["gpu_workspace_bytes"]) - int(tiled[key]["gpu_workspace_bytes"]) == attention, key
    refused = plan_lines("--train.device=cuda", "--train.attention=cudnn")[1]
    assert {int(g["cudnn_attention_bytes"]) for g in refused.values()} == {0}
    env = dict(os.environ, NCCL_BUFFSIZE=str(1 << 20), NCCL_MAX_NCHANNELS="2")
    proc = subprocess.run(["timeout", "60", EXE, "plan", "--world-size=2", "--format=lines", *tiny_args("--train.device=cuda")[1:]],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    nccl = {int(m) for m in re.findall(r"nccl_bytes=(\d+)", proc.stdout)}
    per_communicator = 2 * ((1 << 20) + (512 << 10) + 120 * 640 * 8 * 8)  # 2 channels x (Simple + LL + LL128)
    # Two ranks: the shard (or replica) group and the world communicator of the step's sums; with
    # cpu_offload the sums are summed on the host, so the first alone.
    assert nccl == {per_communicator, 2 * per_communicator}, nccl

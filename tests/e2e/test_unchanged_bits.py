"""Refactors move no bits: a matrix of short runs (GPT-2 and Llama, 1-4 ranks, every sharding strategy,
bf16/fp16, activation checkpointing, CPU offload, adapters, freezing, a distillation teacher) each hashed
-- the SHA-256 of every dataset of its final checkpoint (parameters and AdamW moments) -- against
values recorded before a change (tests/fixtures/unchanged_bits.json).

Bits depend on the BLAS kernels (the start line names OpenBLAS's core: Haswell, SkylakeX, Zen ...) and
on the CPU the program was compiled for (-march: x86-64-v3 by default, native with NATIVE=1: the
compiler's vector code rounds differently), so the file holds one record per core and build target.
Where the record exists every hash must match; elsewhere the per-step losses must match a recorded run's
to 1e-4 relative (another core's kernels round differently), which still catches any change of
arithmetic.

To record after a change that is meant to move bits (say why in the commit):
  SHARDTRAIN_RECORD_BITS=1 build/test-venv/bin/python tests/run_tests.py --build build --suite e2e -k unchanged_bits
"""
import hashlib
import json
import os
import re

import h5py

from harness import ROOT, read_metrics, rel_diff, run, tempdir, tiny_args

RECORD = os.path.join(ROOT, "tests", "fixtures", "unchanged_bits.json")
LLAMA = os.path.join(ROOT, "inputs", "llama-tiny.ini")
STEPS = 4

# name: (config, ranks, options); "TEACHER" is replaced by a llama-tiny checkpoint made here.
CASES = {
    "gpt2_1rank": ("gpt2", 1, []),
    "gpt2_2ranks_bf16": ("gpt2", 2, ["--fsdp.param_dtype=bf16"]),
    "gpt2_3ranks_shard_grad_op_checkpointing": ("gpt2", 3, ["--fsdp.sharding_strategy=SHARD_GRAD_OP",
                                                              "--fsdp.activation_checkpointing=true"]),
    "gpt2_4ranks_hybrid_fp16": ("gpt2", 4, ["--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2",
                                             "--fsdp.param_dtype=fp16"]),
    "gpt2_2ranks_no_shard_offload": ("gpt2", 2, ["--fsdp.sharding_strategy=NO_SHARD", "--fsdp.cpu_offload=true"]),
    "gpt2_2ranks_lora_dropout": ("gpt2", 2, ["--adapter.type=lora", "--adapter.targets=attn.c_attn,mlp.c_proj",
                                              "--adapter.rank=4", "--adapter.alpha=8", "--adapter.dropout=0.1"]),
    "gpt2_2ranks_dora_bf16": ("gpt2", 2, ["--adapter.type=dora", "--adapter.targets=attn.c_attn,mlp.c_fc",
                                           "--adapter.rank=4", "--fsdp.param_dtype=bf16"]),
    "gpt2_2ranks_freeze": ("gpt2", 2, ["--train.freeze=wte,h.0.*"]),
    "gpt2_2ranks_llama_teacher": ("gpt2", 2, ["--distill.teacher=TEACHER", "--distill.alpha=0.25",
                                               "--distill.temperature=1.5"]),
    "llama_1rank": ("llama", 1, []),
    "llama_3ranks_bf16_checkpointing": ("llama", 3, ["--fsdp.param_dtype=bf16", "--fsdp.activation_checkpointing=true"]),
    "llama_2ranks_prefetch_reduce_once": ("llama", 2, ["--fsdp.forward_prefetch=true",
                                                           "--fsdp.reduce_every_microbatch=false"]),
    "llama_2ranks_loha": ("llama", 2, ["--adapter.type=loha", "--adapter.targets=q_proj,v_proj,down_proj",
                                        "--adapter.rank=4", "--adapter.alpha=8"]),
    "llama_2ranks_lokr": ("llama", 2, ["--adapter.type=lokr", "--adapter.targets=o_proj,gate_proj,up_proj",
                                                 "--adapter.rank=2", "--adapter.alpha=4"]),
    "llama_4ranks_oft": ("llama", 4, ["--adapter.type=oft", "--adapter.targets=k_proj,up_proj",
                                       "--adapter.block_size=8"]),
}


def teacher():
    d = tempdir()
    args = tiny_args("--train.steps=2", f"--checkpoint.dir={d}")
    args[args.index("--config") + 1] = LLAMA
    proc = run(2, args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return os.path.join(d, "ckpt-00000002.h5")


def run_case(config, ranks, options, teacher_path):
    d = tempdir()
    metrics = os.path.join(d, "metrics.jsonl")
    options = [o.replace("TEACHER", teacher_path) for o in options]
    args = tiny_args(f"--train.steps={STEPS}", f"--checkpoint.dir={d}", f"--train.metrics_file={metrics}",
                     "--checkpoint.every=0", *options)
    if config == "llama":
        args[args.index("--config") + 1] = LLAMA
    proc = run(ranks, args)
    assert proc.returncode == 0, f"{config} {ranks} {options}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    core = re.search(r"OpenBLAS (\S+) \(.*\| built for (\S+) \|", proc.stdout)
    assert core, proc.stdout[-2000:]
    digest = hashlib.sha256()
    with h5py.File(os.path.join(d, f"ckpt-{STEPS:08d}.h5"), "r") as f:
        names = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        for name in sorted(names):
            digest.update(name.encode())
            digest.update(f[name][()].tobytes())
    return f"{core.group(1)} {core.group(2)}", {"sha256": digest.hexdigest(),
                                                "losses": [r["loss"] for r in read_metrics(metrics)]}


def test_refactors_move_no_bits():
    teacher_path = teacher()
    results, cores = {}, set()
    for name, (config, ranks, options) in CASES.items():
        core, results[name] = run_case(config, ranks, options, teacher_path)
        cores.add(core)
    assert len(cores) == 1, cores
    core = cores.pop()
    with open(RECORD) as f:
        recorded = json.load(f)
    if os.environ.get("SHARDTRAIN_RECORD_BITS"):
        recorded[core] = results
        with open(RECORD, "w") as f:
            json.dump(recorded, f, indent=1, sort_keys=True)
            f.write("\n")
        return
    assert set(CASES) <= set(next(iter(recorded.values()))), "a case without a record: record it (see the docstring)"
    if core in recorded:
        moved = [n for n in CASES if recorded[core][n]["sha256"] != results[n]["sha256"]]
        assert not moved, f"bits moved on OpenBLAS {core}: {moved}"
    else:  # another core: the arithmetic, to rounding
        reference = next(iter(recorded.values()))
        for name in CASES:
            want, got = reference[name]["losses"], results[name]["losses"]
            assert len(want) == len(got) and all(rel_diff(a, b) < 1e-4 for a, b in zip(want, got)), (name, want, got)

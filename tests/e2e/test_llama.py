"""model.arch=llama end to end (inputs/llama-tiny.ini: 4 query heads on 2 key/value heads, an MLP of
104, an untied head; unit sizes that do not divide by 3). What the gpt2 tests establish holds for
llama too, each against an independent oracle:

- the losses do not depend on the rank count (1, 2, 3, 4) nor on the sharding strategy, to 1e-5
  relative of the 1-rank run; bf16/fp16 stay within 1% of fp32 and send the bytes that the
  parameter count, computed here from Hugging Face's Llama shapes, makes; activation
  checkpointing and CPU offload give the same bits;
- checkpoints of both layouts: h5py reads the architecture attributes, the datasets with Hugging
  Face's names and shapes and their checksums; resume is exact on the same rank count and within
  1e-5 on 3 ranks; a checkpoint of the other architecture (or another n_kv_head) is refused; a
  version-1 file (written here from a gpt2 checkpoint) still loads, as gpt2;
- inspect and plan print the llama model; memory held equals the plan byte for byte, and the plan
  command's peak is the trainer's;
- llama's options are checked (gpt2 refuses them; n_kv_head must divide n_head; even head size).

Every training run takes about a second; runs shared between tests are cached."""
import functools
import os
import re
import shutil

import h5py
import numpy as np

from harness import ROOT, read_metrics, rel_diff, run, run_single, tempdir, tiny_args
from test_bad_input import expect_usage_error
from test_checkpoint import checksum, read_datasets, reassemble, text
from test_checkpoint_edges import meta_checksum

LLAMA_INI = os.path.join(ROOT, "inputs", "llama-tiny.ini")
GPT2_INI = os.path.join(ROOT, "inputs", "tiny.ini")
SUMMARY = "Llama L=2 C=40 H=4 KV=2 MLP=104 V=256 max_seq_len=64 rope_theta=10000 norm_eps=1e-05 untied"
STEPS = 8
RANKS = 2      # the checkpoint runs
RESUME_AT = 4  # the checkpoint the resume tests start from


def llama_args(*overrides, config=LLAMA_INI):
    """tiny_args on inputs/llama-tiny.ini (or `config`)."""
    args = tiny_args(*overrides)
    args[args.index("--config") + 1] = config
    return args


def llama_shapes(L=2, C=40, H=4, KV=2, I=104, V=256, tied=False):
    """Hugging Face's LlamaForCausalLM parameter shapes, less the 'model.' prefix."""
    kv = KV * (C // H)
    shapes = {"embed_tokens.weight": (V, C), "norm.weight": (C,)}
    if not tied:
        shapes["lm_head.weight"] = (V, C)
    for l in range(L):
        h = f"layers.{l}"
        shapes.update({f"{h}.input_layernorm.weight": (C,), f"{h}.self_attn.q_proj.weight": (C, C),
                       f"{h}.self_attn.k_proj.weight": (kv, C), f"{h}.self_attn.v_proj.weight": (kv, C),
                       f"{h}.self_attn.o_proj.weight": (C, C), f"{h}.post_attention_layernorm.weight": (C,),
                       f"{h}.mlp.gate_proj.weight": (I, C), f"{h}.mlp.up_proj.weight": (I, C),
                       f"{h}.mlp.down_proj.weight": (C, I)})
    return shapes


def unit_sizes():
    """(root, block) elements of llama-tiny: the FSDP units the shapes above make."""
    shapes = llama_shapes()
    root = sum(int(np.prod(s)) for n, s in shapes.items() if not n.startswith("layers."))
    block = sum(int(np.prod(s)) for n, s in shapes.items() if n.startswith("layers.0."))
    return root, block


def ok(proc, what=""):
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


@functools.lru_cache(maxsize=None)
def steps_of(np_, *options):
    """(step records, stdout) of an 8-step llama-tiny run on np_ ranks without checkpoints."""
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = ok(run(np_, llama_args(f"--train.steps={STEPS}", f"--train.metrics_file={metrics}",
                                  "--checkpoint.save=false", *options)), f"np={np_} {options}")
    assert SUMMARY in proc.stdout, f"not the llama model:\n{proc.stdout[:2000]}"
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return records, proc.stdout


def losses(np_, *options):
    return [r["loss"] for r in steps_of(np_, *options)[0]]


def worst_diff(a, b):
    assert len(a) == len(b) == STEPS
    return max(rel_diff(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------- the math: ranks, strategies, precision


def test_llama_losses_do_not_depend_on_ranks_or_strategy():
    reference = losses(1)
    assert reference[-1] < reference[0] - 0.5, f"llama-tiny does not train: {reference}"
    reference_norms = [r["grad_norm"] for r in steps_of(1)[0]]
    cases = [(2,), (3,), (2, "--fsdp.sharding_strategy=SHARD_GRAD_OP"), (3, "--fsdp.sharding_strategy=SHARD_GRAD_OP"),
             (3, "--fsdp.sharding_strategy=NO_SHARD"),
             (4, "--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2"),
             (3, "--fsdp.reduce_every_microbatch=false")]
    for np_, *options in cases:
        worst = worst_diff(reference, losses(np_, *options))
        assert worst <= 1e-5, f"np={np_} {options}: worst relative loss difference {worst:.2e}"
        norms = [r["grad_norm"] for r in steps_of(np_, *options)[0]]
        assert worst_diff(reference_norms, norms) <= 1e-4, (np_, options, reference_norms, norms)
    assert "HYBRID_SHARD (shard group 2, replicas 2)" in steps_of(4, *cases[5][1:])[1]


def test_llama_half_precision_stays_close_to_fp32_and_halves_the_bytes():
    reference = losses(1)
    for np_, param, reduce in [(2, "bf16", "bf16"), (3, "fp16", "fp32"), (2, "fp32", "fp16")]:
        other = losses(np_, f"--fsdp.param_dtype={param}", f"--fsdp.reduce_dtype={reduce}")
        worst = worst_diff(reference, other)
        # Rounding happened (not fp32 under another name), and moved the loss by less than 1%.
        assert 1e-7 < worst < 1e-2, (np_, param, reduce, worst)
    # Bytes each of 2 ranks sends per step: 6 micro-batches, each gathering all units once (the
    # 2 block buffers keep both blocks for the backward) and reduce-scattering them once.
    root, block = unit_sizes()
    psi = root + 2 * block
    fp32_bytes = 24 // (2 * 2) * (psi * 4 + psi * 4) / 2
    assert steps_of(2)[0][-1]["comm_bytes"] == fp32_bytes, (steps_of(2)[0][-1]["comm_bytes"], fp32_bytes)
    half = steps_of(2, "--fsdp.param_dtype=bf16", "--fsdp.reduce_dtype=bf16")[0][-1]["comm_bytes"]
    assert half == fp32_bytes / 2, (half, fp32_bytes)


def test_llama_activation_checkpointing_and_offload_keep_the_bits():
    plain, plain_out = steps_of(2)
    recomputed, recomputed_out = steps_of(2, "--fsdp.activation_checkpointing=true")
    assert [r["loss"] for r in recomputed] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in recomputed] == [r["grad_norm"] for r in plain]
    assert recomputed[-1]["peak_mem"]["activations"] < 0.8 * plain[-1]["peak_mem"]["activations"]
    for np_, options in ((2, ()), (3, ("--fsdp.param_dtype=fp16", "--fsdp.reduce_dtype=fp32"))):
        offloaded, out = steps_of(np_, "--fsdp.cpu_offload=true", *options)
        assert [r["loss"] for r in offloaded] == losses(np_, *options), (np_, options)
        assert offloaded[-1]["peak_mem"]["optimizer_state"] == 0 and plain[-1]["peak_mem"]["optimizer_state"] > 0


# ---------------------------------------------------------------- memory and the planner


def planned(np_, *options):
    """The plan command's PLAN lines for llama-tiny on np_ ranks: {(strategy, reduce, ckpt, offload): bytes}."""
    proc = ok(run_single(["plan", f"--world-size={np_}", "--format=lines", *llama_args(*options)[1:]]), "plan")
    assert SUMMARY in proc.stdout, proc.stdout[:2000]
    lines = re.findall(r"^PLAN strategy=(\S+) reduce=(\S+) checkpointing=(\S+) offload=(\S+) peak_bytes=(\d+)",
                       proc.stdout, re.M)
    return {tuple(line[:4]): int(line[4]) for line in lines}


def test_llama_memory_held_equals_the_plan():
    """What the arrays and the MPI ring's buffers hold (counted at allocation) equals the trainer's
    plan byte for byte, and the plan command predicts the same peak without training."""
    cases = [((2,), ("FULL_SHARD", "micro", "no", "no")),
             ((3,), ("FULL_SHARD", "micro", "no", "no")),
             ((2, "--fsdp.activation_checkpointing=true"), ("FULL_SHARD", "micro", "yes", "no")),
             ((3, "--fsdp.sharding_strategy=SHARD_GRAD_OP"), ("SHARD_GRAD_OP", "micro", "no", "no")),
             ((3, "--fsdp.reduce_every_microbatch=false"), ("FULL_SHARD", "step", "no", "no")),
             ((3, "--fsdp.sharding_strategy=NO_SHARD"), ("NO_SHARD", "step", "no", "no")),
             ((2, "--fsdp.param_dtype=bf16", "--fsdp.reduce_dtype=bf16"), None),
             ((2, "--fsdp.cpu_offload=true"), None),
             ((4, "--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2"), None)]
    plans = {np_: planned(np_) for np_ in (2, 3)}
    for (np_, *options), key in cases:
        last = steps_of(np_, *options)[0][-1]
        assert last["held_mem_bytes"] == last["peak_mem_bytes"], (np_, options, last["held_mem_bytes"],
                                                                   last["peak_mem_bytes"])
        if key:
            assert plans[np_][key] == last["peak_mem_bytes"], (np_, options, plans[np_][key], last["peak_mem_bytes"])


def test_llama_plan_command():
    proc = ok(run_single(["plan", "--config", "inputs/llama-tiny.ini", "--world-size", "4"]), "plan")
    assert SUMMARY in proc.stdout, proc.stdout
    assert "recommended: fsdp.sharding_strategy=" in proc.stdout, proc.stdout
    assert "PLAN " not in proc.stdout, proc.stdout  # the table alone for people; the lines when asked
    lines = ok(run_single(["plan", "--config", "inputs/llama-tiny.ini", "--world-size", "4", "--format=lines"]), "plan")
    assert lines.stdout.startswith(proc.stdout.split("\nrecommended:")[0]), lines.stdout
    assert lines.stdout.count("PLAN strategy=") >= 3, lines.stdout
    usage_error_single(["plan", "--config", "inputs/llama-tiny.ini", "--world-size", "4", "--format=json"],
                       "--format='json' is not allowed; allowed: table, lines")


# ---------------------------------------------------------------- checkpoints


def ckpt_name(step):
    return f"ckpt-{step:08d}.h5"


def train(np_, ckdir, *options, config=LLAMA_INI, expect=0):
    proc = run(np_, llama_args(f"--checkpoint.dir={ckdir}", *options, config=config))
    assert expect is None or proc.returncode == expect, (f"np={np_} {options}: exit {proc.returncode}, expected "
                                                         f"{expect}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


@functools.lru_cache(maxsize=None)
def baseline(fmt, config=LLAMA_INI):
    """The uninterrupted 2-rank run with a checkpoint every 2 steps: (folder, step records, metrics)."""
    d = tempdir()
    metrics = os.path.join(d, "metrics.jsonl")
    train(RANKS, d, f"--train.steps={STEPS}", "--checkpoint.every=2", "--checkpoint.keep=100",
          f"--checkpoint.format={fmt}", f"--train.metrics_file={metrics}", config=config)
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return d, records, metrics


def interrupted_copy(fmt, config=LLAMA_INI):
    """The folder of a run stopped after committing step RESUME_AT (see test_checkpoint.interrupted_copy)."""
    src, _, metrics = baseline(fmt, config)
    d = tempdir()
    for s in range(2, RESUME_AT + 1, 2):
        shutil.copy(os.path.join(src, ckpt_name(s)), d)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write(ckpt_name(RESUME_AT) + "\n")
    shutil.copy(metrics, os.path.join(d, "metrics.jsonl"))
    return d


def test_llama_checkpoint_records_the_architecture():
    gathered = os.path.join(baseline("gathered")[0], ckpt_name(STEPS))
    shapes = llama_shapes()
    with h5py.File(gathered, "r") as f:
        a = f.attrs
        assert int(a["version"]) == 10 and text(a["layout"]) == "gathered"
        assert text(a["model.arch"]) == "llama"
        assert [int(a[k]) for k in ("model.n_layer", "model.n_embd", "model.n_head", "model.vocab_size",
                                    "model.max_seq_len")] == [2, 40, 4, 256, 64]
        assert int(a["model.n_kv_head"]) == 2 and int(a["model.intermediate_size"]) == 104
        assert int(a["model.tie_embeddings"]) == 0
        assert float(a["model.rope_theta"]) == 10000.0 and float(a["model.norm_eps"]) == 1e-5
        assert int(a["meta_checksum"]) == meta_checksum(a)  # the definition includes the architecture
        for prefix in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
            assert set(f[prefix].keys()) == set(shapes), (prefix, sorted(f[prefix].keys()))
            for name, shape in shapes.items():
                ds = f[f"{prefix}/{name}"]
                assert ds.shape == shape and ds.dtype == np.float32, (prefix, name, ds.shape)
                assert int(ds.attrs["checksum"]) == checksum(ds[()]), f"{prefix}/{name}: checksum"
    # The sharded layout of the same run holds the same arrays (bit for bit: same rank count),
    # reassembled through each unit's index (which checks padding and checksums).
    sharded = reassemble(os.path.join(baseline("sharded")[0], ckpt_name(STEPS)))
    plain = read_datasets(gathered)
    assert sharded.keys() == plain.keys()
    for key in plain:
        assert np.array_equal(sharded[key], plain[key]), key


def test_llama_exact_resume_and_resharding():
    """Resumed at step 4 on the same 2 ranks: the uninterrupted run's losses and final arrays, bit
    for bit; on 3 ranks (units re-padded): its losses to 1e-5."""
    for fmt in ("sharded", "gathered"):
        src, base, _ = baseline(fmt)
        for np_ in (RANKS, 3):
            d = interrupted_copy(fmt)
            metrics = os.path.join(d, "metrics.jsonl")
            proc = train(np_, d, f"--train.steps={STEPS}", "--checkpoint.every=2", "--checkpoint.keep=100",
                         f"--checkpoint.format={fmt}", f"--train.metrics_file={metrics}")
            assert f"resumed from {os.path.join(d, ckpt_name(RESUME_AT))} at step {RESUME_AT}" in proc.stdout
            assert f"saved on {RANKS} ranks, {fmt} layout" in proc.stdout
            resumed = read_metrics(metrics)
            assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
            got, want = [r["loss"] for r in resumed[RESUME_AT:]], [r["loss"] for r in base[RESUME_AT:]]
            if np_ == RANKS:
                assert got == want, (fmt, got, want)
                assert [r["grad_norm"] for r in resumed[RESUME_AT:]] == [r["grad_norm"] for r in base[RESUME_AT:]]
                a, b = read_datasets(os.path.join(d, ckpt_name(STEPS))), read_datasets(os.path.join(src, ckpt_name(STEPS)))
                assert a.keys() == b.keys()
                for name in a:
                    assert np.array_equal(a[name], b[name]), f"{fmt}: {name} differs after resume"
            else:
                drift = max(rel_diff(x, y) for x, y in zip(got, want))
                assert drift <= 1e-5, (fmt, np_, drift)


def one_error(proc, *needles):
    errors = [l for l in proc.stderr.splitlines() if "error" in l.lower()]
    assert len(errors) == 1, f"expected one error line:\n{proc.stderr[-3000:]}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    assert not re.search(r"^step ", proc.stdout, re.M), "training started"


def test_llama_checkpoint_refuses_another_architecture():
    path = os.path.join(baseline("sharded")[0], ckpt_name(RESUME_AT))
    common = (f"--checkpoint.resume={path}", f"--train.steps={STEPS}")
    proc = train(RANKS, tempdir(), *common, config=GPT2_INI, expect=2)
    one_error(proc, path, "model.arch=llama (configured gpt2)")
    proc = train(RANKS, tempdir(), *common, "--model.n_kv_head=4", expect=2)
    one_error(proc, path, "model.n_kv_head=2 (configured 4)")


def test_llama_inspect():
    """inspect prints the llama summary and each parameter with its shape and norm (h5py's norm)."""
    for fmt in ("gathered", "sharded"):
        path = os.path.join(baseline(fmt)[0], ckpt_name(STEPS))
        proc = ok(run_single(["inspect", path]), "inspect")
        assert SUMMARY in proc.stdout and "version 10" in proc.stdout, proc.stdout[:2000]
        arrays = read_datasets(path) if fmt == "gathered" else reassemble(path)
        rows = {l.split()[0]: l.split() for l in proc.stdout.splitlines() if l.split() and l.split()[0] in
                llama_shapes()}
        assert set(rows) == set(llama_shapes())
        for name, shape in llama_shapes().items():
            row = rows[name]
            assert row[1] == "x".join(map(str, shape)) and int(row[2]) == int(np.prod(shape)), row
            norm = float(np.linalg.norm(arrays[f"model/{name}"].astype(np.float64)))
            assert rel_diff(float(row[3]), norm) < 1e-4, (fmt, name, row[3], norm)


def version_1_copy(path, reseal):
    """`path` (a gpt2 checkpoint of version 4) as the older format wrote it: version 1, no
    architecture, adapter or base-checksum attributes; with reseal, the metadata checksum of
    version 1 (which covers no architecture), recomputed here; else none (files from before the
    checksum)."""
    out = os.path.join(tempdir(), os.path.basename(path))
    shutil.copy(path, out)
    with h5py.File(out, "r+") as f:
        assert text(f.attrs["model.arch"]) == "gpt2"
        f.attrs["version"] = np.int64(1)
        for key in ("model.arch", "model.n_kv_head", "model.intermediate_size", "model.tie_embeddings",
                    "model.rope_theta", "model.norm_eps", "adapter.type", "adapter.targets", "adapter.rank",
                    "adapter.alpha", "adapter.dropout", "adapters_only", "base_checksum"):
            del f.attrs[key]
        if reseal:
            f.attrs["meta_checksum"] = np.uint64(meta_checksum(f.attrs))
        else:
            del f.attrs["meta_checksum"]
    return out


def test_version_1_checkpoint_loads_as_gpt2():
    src, base, _ = baseline("gathered", GPT2_INI)
    for reseal in (True, False):
        path = version_1_copy(os.path.join(src, ckpt_name(RESUME_AT)), reseal)
        metrics = os.path.join(tempdir(), "m.jsonl")
        proc = train(RANKS, tempdir(), f"--checkpoint.resume={path}", f"--train.steps={STEPS}",
                     "--checkpoint.format=gathered", f"--train.metrics_file={metrics}", config=GPT2_INI)
        assert f"resumed from {path} at step {RESUME_AT}" in proc.stdout, proc.stdout[-2000:]
        assert ("no metadata checksum" in proc.stderr) == (not reseal), proc.stderr
        assert [r["loss"] for r in read_metrics(metrics)] == [r["loss"] for r in base[RESUME_AT:]], reseal
    inspected = ok(run_single(["inspect", path]), "inspect")
    assert "GPT-2 L=2 C=40 H=4 V=256 max_seq_len=64" in inspected.stdout, inspected.stdout[:2000]
    assert "version 1, layout gathered" in inspected.stdout, inspected.stdout[:2000]  # the file's, not the build's
    proc = train(RANKS, tempdir(), f"--checkpoint.resume={path}", f"--train.steps={STEPS}", expect=2)
    one_error(proc, path, "model.arch=gpt2 (configured llama)")


# ---------------------------------------------------------------- options


def usage_error_single(args, *needles):
    """expect_usage_error as one process without mpirun: the same validation, without the second
    or so that mpirun takes to take down a job that exits 2."""
    proc = run_single(args)
    assert proc.returncode == 2, f"exit {proc.returncode}, expected 2\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    errors = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(errors) == 1, f"expected one error line, got:\n{proc.stderr}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"


def test_llama_options_are_checked():
    # gpt2 refuses llama's options: agreed by 2 ranks once, the other keys on one process.
    expect_usage_error(tiny_args("--model.n_kv_head=2"), "model.n_kv_head", "model.arch=llama")
    for key, value in (("intermediate_size", "104"), ("tie_embeddings", "false"), ("rope_theta", "500000"),
                       ("norm_eps", "1e-6")):
        usage_error_single(tiny_args(f"--model.{key}={value}"), f"model.{key}", "model.arch=llama")
    usage_error_single(llama_args("--model.n_kv_head=3"), "model.n_kv_head=3", "model.n_head=4")
    usage_error_single(llama_args("--model.n_kv_head=8"), "model.n_kv_head=8", "model.n_head=4")
    usage_error_single(llama_args("--model.n_head=8"), "model.n_embd / model.n_head) = 5", "even")
    usage_error_single(llama_args("--model.arch=mamba"), "model.arch", "gpt2, llama")
    # The same checks in the planner, which takes the same options.
    usage_error_single(["plan", "--world-size=2", *llama_args("--model.n_kv_head=3")[1:]], "model.n_kv_head=3")

"""Bad input: every case must end all ranks with exit code 2 and one line on stderr that names
the option or file, quickly (no hang) -- on 2 ranks, so a rank-local failure must be agreed."""
import os
import struct

from harness import ROOT, ensure_data, read_metrics, run, run_single, tempdir, tiny_args

RANKS = 2


def expect_usage_error(args, *needles, np_=RANKS, timeout=60):
    proc = run(np_, args, timeout=timeout)
    assert proc.returncode == 2, f"exit {proc.returncode}, expected 2\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    errors = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(errors) == 1, f"expected one error line, got:\n{proc.stderr}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


def write_config(content, name="bad.ini"):
    """A config file holding `content` (str as UTF-8, or bytes)."""
    path = os.path.join(tempdir(), name)
    with open(path, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)
    return path


def tiny_args_with_config(path, *overrides):
    """tiny_args with another config file in place of inputs/tiny.ini."""
    args = tiny_args(*overrides)
    args[args.index("--config") + 1] = path
    return args


def write_tokens(path, tokens, magic=20240520, version=1, count=None, extra=b""):
    header = [0] * 256
    header[0], header[1], header[2] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))
        f.write(extra)
    return path


def test_unknown_option():
    expect_usage_error(tiny_args("--train.stepz=3"), "train.stepz")


def test_malformed_value():
    expect_usage_error(tiny_args("--model.n_layer=two"), "model.n_layer")


def test_heads_must_divide_width():
    expect_usage_error(tiny_args("--model.n_head=3"), "model.n_embd", "model.n_head")


def test_global_batch_must_split_into_micro_batches():
    expect_usage_error(tiny_args("--train.global_batch=10"), "train.global_batch", "micro_batch")


def test_seq_len_beyond_position_table():
    expect_usage_error(tiny_args("--train.seq_len=65"), "train.seq_len", "max_seq_len")


def test_unknown_sharding_strategy():
    expect_usage_error(tiny_args("--fsdp.sharding_strategy=ZERO9"), "fsdp.sharding_strategy", "FULL_SHARD")
    expect_usage_error(tiny_args("--fsdp.param_dtype=fp8"), "fsdp.param_dtype='fp8'", "fp32, bf16, fp16")
    expect_usage_error(tiny_args("--fsdp.backward_prefetch=EARLY"), "'EARLY'", "NONE, BACKWARD_PRE, BACKWARD_POST")


def test_unknown_device():
    expect_usage_error(tiny_args("--train.device=tpu"), "train.device", "cpu, cuda")


def test_cuda_device_needs_a_cuda_build():
    # The tests run the CPU build (make test), which has no CUDA backend.
    expect_usage_error(tiny_args("--train.device=cuda"), "train.device=cuda", "make CUDA=1")


def test_missing_config_file():
    expect_usage_error(["train", "--config", "/nonexistent/x.ini"], "/nonexistent/x.ini")


def test_unknown_key_in_config_file():
    path = write_config("[model]\nn_layers = 2\n")
    expect_usage_error(["train", "--config", path], "model.n_layers")


def test_missing_data_file():
    expect_usage_error(tiny_args("--data.train_file=/nonexistent/tokens.bin"), "/nonexistent/tokens.bin")


def test_wrong_magic():
    path = write_tokens(os.path.join(tempdir(), "magic.bin"), [1] * 5000, magic=1234)
    expect_usage_error(tiny_args(f"--data.train_file={path}"), path, "magic")


def test_truncated_file():
    path = write_tokens(os.path.join(tempdir(), "short.bin"), [1] * 5000, count=6000)
    expect_usage_error(tiny_args(f"--data.train_file={path}"), path)


def test_token_beyond_vocabulary():
    tokens = [7] * 5000
    tokens[4321] = 300  # vocab_size is 256; index in the second rank's half of the scan
    path = write_tokens(os.path.join(tempdir(), "vocab.bin"), tokens)
    expect_usage_error(tiny_args(f"--data.train_file={path}"), path, "300")


def test_file_too_short_for_one_batch():
    path = write_tokens(os.path.join(tempdir(), "tiny.bin"), [5] * 200)  # 6 windows of 33 < 24 sequences
    expect_usage_error(tiny_args(f"--data.train_file={path}"), path)


def test_unwritable_metrics_file():
    expect_usage_error(tiny_args("--train.metrics_file=/nonexistent/dir/m.jsonl"), "train.metrics_file")


def test_unknown_command():
    proc = run_single(["trian"])
    assert proc.returncode == 2 and "trian" in proc.stderr


def test_help_lists_every_option_with_default():
    proc = run_single(["train", "--help"])
    assert proc.returncode == 0
    for key in ("model.n_layer", "train.global_batch", "data.train_file", "fsdp.comm_timeout"):
        assert key in proc.stdout, key
    assert "(=FULL_SHARD)" in proc.stdout


# Boost.Program_options formats its messages by substituting %placeholders% until none is left: a
# value or option name holding one hung every rank at 100% CPU. A short timeout, so a hang fails fast.
def test_placeholder_in_value_does_not_hang():
    expect_usage_error(tiny_args("--model.n_layer=%value%x"), "model.n_layer", "'%value%x'", timeout=20)


def test_placeholder_in_option_name_does_not_hang():
    expect_usage_error(tiny_args("--%canonical_option%=1"), "--%canonical_option%=1", timeout=20)


def test_placeholder_in_config_value_does_not_hang():
    path = write_config("[model]\nn_layer = %value%\n")
    expect_usage_error(["train", "--config", path], "model.n_layer", "'%value%'", path, timeout=20)


def test_micro_batch_times_ranks_beyond_int():
    # 2^30 x 4 ranks wrapped to 0 in an int product: SIGFPE in the divisibility check.
    expect_usage_error(tiny_args("--train.micro_batch=1073741824"), "train.global_batch", "4294967296", np_=4)


def test_non_finite_values():
    # inf learning rates used to train into "the run diverged"; eps=inf and nan were accepted.
    for option in ("train.lr=inf", "train.weight_decay=inf", "train.eps=inf", "train.beta1=nan",
                   "fsdp.comm_timeout=inf"):
        expect_usage_error(tiny_args(f"--{option}"), option, "finite")


def test_negative_seed():
    # Boost read -1 into the unsigned seed as 2^64-1.
    expect_usage_error(tiny_args("--train.seed=-1"), "train.seed", "'-1'")


def test_memory_limit_without_unit():
    # 0.5 (bytes) parsed as a limit of 0 = no limit at all.
    expect_usage_error(tiny_args("--fsdp.memory_limit=0.5"), "fsdp.memory_limit", "'0.5'", "512MiB")


def test_huge_run_name():
    # 1 MiB (in a file: one command-line argument is at most 128 KiB) was an internal error at save time.
    path = write_config("[train]\nrun_name = " + "r" * (1 << 20) + "\n")
    expect_usage_error(["train", "--config", path], "train.run_name", "1048576 bytes", "200")


def test_run_name_must_be_a_folder_name():
    expect_usage_error(tiny_args("--train.run_name=a/b"), "train.run_name", "'a/b'", "checkpoint.dir")


def test_config_is_a_directory():
    folder = tempdir()
    expect_usage_error(["train", "--config", folder], folder, "is a directory")


def test_config_with_byte_order_mark_is_read():
    # Saved by some Windows editors: the mark used to turn the first line into an invalid one.
    with open(os.path.join(ROOT, "inputs", "tiny.ini")) as f:
        path = write_config("\ufeff" + f.read(), "bom.ini")
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = run(RANKS, tiny_args_with_config(path, "--train.steps=2", "--checkpoint.save=false",
                                            f"--train.metrics_file={metrics}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(metrics)][-1] == 2


def test_invisible_character_in_config_key():
    path = write_config("[model]\nn_\u200blayer = 2\n")
    expect_usage_error(["train", "--config", path], path, "line 2", "U+200B")


def test_nul_byte_in_config():
    # Boost cut the option name at the NUL and complained about a different key.
    path = write_config(b"[model]\nn_la\0yer = 2\n")
    expect_usage_error(["train", "--config", path], path, "line 2", "NUL")


def test_distillation_settings_without_a_teacher():
    # They were ignored without a word, as adapter.* without adapter.type is not.
    expect_usage_error(tiny_args("--distill.alpha=0.2"), "distill.alpha", "distill.teacher")
    expect_usage_error(tiny_args("--distill.temperature=4"), "distill.temperature", "distill.teacher")


def test_neumann_terms_are_bounded():
    # 1,000,000 terms ran past 120 s without a step; 1000 took a minute a step.
    oft = ["--adapter.type=oft", "--adapter.targets=attn.c_attn", "--adapter.block_size=8"]
    expect_usage_error(tiny_args(*oft, "--adapter.neumann_terms=1000000"), "adapter.neumann_terms", "[1, 50]")
    expect_usage_error(tiny_args(*oft, "--adapter.neumann_terms=51"), "adapter.neumann_terms")


def test_shapes_no_table_can_hold_are_refused_by_plan_too():
    # `plan` printed wrapped numbers ("356482.3M parameters") for n_embd 2^30 and worked a minute
    # (3.2 GB) on 10^9 layers; both are now one line and exit 2 at once, as in `train`.
    base = ["plan", "--world-size", "2", "--config", os.path.join(ROOT, "inputs", "tiny.ini")]
    for option, needle in (("--model.n_embd=1073741824", "model.n_embd=1073741824"),
                           ("--model.n_layer=1000000000", "model.n_layer=1000000000"),
                           ("--model.intermediate_size=33554432", "model.intermediate_size")):
        extra = ["--model.n_head=1"] if "n_embd" in option else []
        extra += ["--model.arch=llama"] if "intermediate" in option else []
        proc = run_single([*base, option, *extra], timeout=20)
        assert proc.returncode == 2, (option, proc.returncode, proc.stdout[-500:], proc.stderr[-500:])
        assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, (option, proc.stderr)

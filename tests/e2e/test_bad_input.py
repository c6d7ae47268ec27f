"""Bad input: every case must end all ranks with exit code 2 and one line on stderr that names
the option or file, quickly (no hang) -- on 2 ranks, so a rank-local failure must be agreed."""
import os
import struct

from harness import ROOT, ensure_data, run, run_single, tempdir, tiny_args

RANKS = 2


def expect_usage_error(args, *needles, np_=RANKS):
    proc = run(np_, args, timeout=60)
    assert proc.returncode == 2, f"exit {proc.returncode}, expected 2\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    errors = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(errors) == 1, f"expected one error line, got:\n{proc.stderr}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


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


def test_unknown_device():
    expect_usage_error(tiny_args("--train.device=tpu"), "train.device", "cpu, cuda")


def test_cuda_device_needs_a_cuda_build():
    # The tests run the CPU build (make test), which has no CUDA backend.
    expect_usage_error(tiny_args("--train.device=cuda"), "train.device=cuda", "make CUDA=1")


def test_missing_config_file():
    expect_usage_error(["train", "--config", "/nonexistent/x.ini"], "/nonexistent/x.ini")


def test_unknown_key_in_config_file():
    path = os.path.join(tempdir(), "bad.ini")
    with open(path, "w") as f:
        f.write("[model]\nn_layers = 2\n")
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

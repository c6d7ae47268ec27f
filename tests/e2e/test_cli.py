"""The command line around the commands: --version, --help texts, repeated keys, stray words, and the
own options of plan, data synth, inspect and export (strict numbers, named missing arguments)."""
import os
import re

from harness import read_metrics, run, run_single, tempdir, tiny_args
from test_bad_input import expect_usage_error

HELP_COMMANDS = (["train"], ["plan"], ["data", "synth"], ["data", "encode"], ["data", "decode"], ["inspect"], ["export"])


def test_version():
    for word in ("--version", "version"):
        proc = run_single([word])
        assert proc.returncode == 0, proc.stderr
        assert re.match(r"shardtrain \d+\.\d+\.\d+.*, built for \S+\n", proc.stdout), proc.stdout


def test_help_defaults_are_readable():
    for command in HELP_COMMANDS:
        proc = run_single([*command, "--help"])
        assert proc.returncode == 0, (command, proc.stderr)
        # Floating-point defaults as written (0.05), not as the nearest double (0.050000000000000003).
        noise = re.findall(r"\d\.\d*(?:0000000|9999999)\d*", proc.stdout)
        assert not noise, (command, noise)
    assert "(=0.05)" in run_single(["data", "encode", "--help"]).stdout


def test_last_value_of_a_repeated_key_wins():
    # Scripts append overrides to their own arguments; Boost rejected the second value.
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = run(2, [*tiny_args("--train.steps=5", "--checkpoint.save=false", f"--train.metrics_file={metrics}"),
                   "--train.steps=2"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(metrics)][-1] == 2


def test_stray_word_is_rejected():
    # Boost ignored words that are no option.
    expect_usage_error([*tiny_args(), "foo"], "unexpected argument 'foo'")


def test_key_value_without_dashes_suggests_them():
    expect_usage_error([*tiny_args(), "train.steps=100"], "'train.steps=100'", "--train.steps=100")


def test_inspect_without_file_names_it():
    expect_usage_error(["inspect"], "missing argument FILE")


def test_inspect_extra_word_is_named():
    expect_usage_error(["inspect", "a.h5", "b.h5"], "'b.h5'")


def test_plan_world_size_is_parsed_strictly():
    # atoi read "3x" as 3 and 99999999999 as a negative rank count.
    for value in ("3x", "99999999999", "-2"):
        expect_usage_error(["plan", "--config", "inputs/tiny.ini", "--world-size", value], "--world-size", value)


def test_plan_options_need_values():
    # A trailing --world-size went to the train options as an unknown option; 0.5 meant no limit.
    plan = ["plan", "--config", "inputs/tiny.ini"]
    expect_usage_error([*plan, "--world-size"], "--world-size needs a value")
    expect_usage_error([*plan, "--world-size", "2", "--memory-limit", "0.5"], "--memory-limit", "'0.5'", "512MiB")
    # 1e30 bytes overflowed the conversion to size_t (undefined behaviour; a limit of 0 or garbage).
    expect_usage_error([*plan, "--world-size", "2", "--memory-limit", "1e30GiB"], "--memory-limit", "8 EiB")
    expect_usage_error([*tiny_args(), "--fsdp.memory_limit=1e30GB"], "fsdp.memory_limit", "8 EiB")
    # The units up to EiB exist: 1EiB is a size (it was "not a size" while larger numbers were told
    # to stay below 8 EiB), 9EiB is too large.
    for size, shown in (("1EiB", "1.0 EiB"), ("3PiB", "3.0 PiB"), ("2PB", "1.8 PiB")):
        proc = run_single([*plan, "--world-size", "2", "--memory-limit", size])
        assert proc.returncode == 0 and f"memory limit {shown}" in proc.stdout, (size, proc.stdout[:300], proc.stderr)
    expect_usage_error([*plan, "--world-size", "2", "--memory-limit", "9EiB"], "--memory-limit", "below 8 EiB")


def test_plan_option_errors_point_at_plan_help():
    error = expect_usage_error(["plan", "--config", "inputs/tiny.ini", "--world-size", "2", "--train.nope=1"],
                               "train.nope")
    assert "'shardtrain plan --help'" in error, error


def test_plan_micro_batch_times_ranks_beyond_int():
    # 65536 x 65536 wrapped to 0 in an int product: SIGFPE.
    expect_usage_error(["plan", "--config", "inputs/tiny.ini", "--world-size", "65536", "--train.micro_batch=65536"],
                       "train.global_batch", "4294967296")


def test_data_synth_byte_counts():
    out = tempdir()
    # -1 wrapped to 2^64-1; 5e9 was refused only after building 15 GB in memory.
    expect_usage_error(["data", "synth", "--out-dir", out, "--train-bytes=-1"], "--train-bytes", "'-1'")
    expect_usage_error(["data", "synth", "--out-dir", out, "--train-bytes=5000000000"], "--train-bytes",
                       "1073741824", timeout=20)
    assert os.listdir(out) == []


def test_counts_of_one_are_singular():
    proc = run(1, tiny_args("--train.steps=1", "--checkpoint.save=false", "--model.n_layer=1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for phrase in ("on 1 rank x", "(root + 1 block)", "done: 1 step in"):
        assert phrase in proc.stdout, (phrase, proc.stdout)

"""Sharded datasets and 32-bit token files, end to end (docs/data.md).

Oracles: shards that overlap by one token hold exactly the windows of the one file they were cut
from, in the same order, so training on them must give the losses of training on that file, bit for
bit on the same rank count (and, as ever, to 1e-5 on 1, 2 and 3 ranks); a 32-bit file of ids below
65,536 must train bit for bit as the 16-bit file of the same ids. Token files are written here in
llm.c's layout (dev/data/data_common.py), not by the program. Checkpoint attributes are read with
h5py, and `inspect` must list the same files and sizes as the file system; the metadata checksum is
recomputed by test_checkpoint_edges's definition."""
import json
import os
import random
import shutil
import struct

import h5py
import numpy as np

from harness import ensure_data, read_metrics, rel_diff, run, run_single, tempdir, tiny_args
from test_bad_input import expect_usage_error
from test_checkpoint_edges import meta_checksum

T = 32  # tiny.ini's train.seq_len


def write_tokens(path, tokens, wide=False):
    """An llm.c token file: 256 int32 (magic, version, count), then uint16 or (wide) uint32 tokens."""
    header = [0] * 256
    header[0], header[1], header[2] = (20240801, 7, len(tokens)) if wide else (20240520, 1, len(tokens))
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(np.asarray(tokens, dtype="<u4" if wide else "<u2").tobytes())
    return path


def read_tokens(path):
    with open(path, "rb") as f:
        magic, _, count = struct.unpack("<3i", f.read(12))
        f.seek(1024)
        return np.frombuffer(f.read(), dtype="<u4" if magic == 20240801 else "<u2")[:count]


def cut_shards(folder, tokens, windows_per_shard):
    """Shards of `tokens` holding these many windows each, each starting with the last token of the
    one before; returns (the shard paths, the file their windows come from: their union)."""
    paths, begin = [], 0
    for i, windows in enumerate(windows_per_shard):
        paths.append(write_tokens(os.path.join(folder, f"shard_{i}.bin"), tokens[begin:begin + windows * T + 1]))
        begin += windows * T
    return paths, write_tokens(os.path.join(folder, "whole.bin"), tokens[:begin + 1])


def train(np_, *overrides, ok=True):
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = run(np_, tiny_args(f"--train.metrics_file={metrics}", *overrides), timeout=120)
    if ok:
        assert proc.returncode == 0, f"np={np_} exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc, (read_metrics(metrics), read_metrics(metrics, "eval")) if proc.returncode == 0 else None


def losses(metrics):
    steps, evals = metrics
    return [r["loss"] for r in steps], [r["val_loss"] for r in evals]


def inspect_lines(checkpoint):
    proc = run_single(["inspect", checkpoint])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def warnings(proc):
    return [l for l in proc.stderr.splitlines() if l.startswith("warning")]


def test_shards_train_as_the_file_they_hold_on_any_rank_count():
    train_file, val_file = ensure_data()
    folder = tempdir()
    tokens, val = read_tokens(train_file), read_tokens(val_file)
    # Unequal shards (223 windows: a 24-sequence step runs 9.3 steps an epoch, so 12 steps cross one);
    # shard_2 is shorter than a window: skipped with a warning, it changes nothing.
    shards, whole = cut_shards(folder, tokens, [37, 5, 0, 120, 61])
    write_tokens(shards[2], tokens[:T])
    os.mkdir(os.path.join(folder, "val"))
    val_shards, val_whole = cut_shards(os.path.join(folder, "val"), val, [3, 2])
    common = ("--train.steps=12", "--train.eval_every=6", "--train.eval_batches=1")
    _, one = train(1, f"--data.train_file={whole}", f"--data.val_file={val_whole}", *common)
    glob = os.path.join(folder, "shard_*.bin")
    listed = ",".join(shards)
    runs = {}
    for np_, train_spec, val_spec in ((1, glob, ",".join(val_shards)), (2, listed, os.path.join(folder, "val", "*.bin")),
                                      (3, glob, ",".join(val_shards))):
        proc, runs[np_] = train(np_, f"--data.train_file={train_spec}", f"--data.val_file={val_spec}", *common)
        skipped = [l for l in warnings(proc) if "skipping" in l]
        assert len(skipped) == 1 and "shard_2.bin' (32 tokens)" in skipped[0] and "data.train_file" in skipped[0], \
            proc.stderr
        assert f"data: 5 files of '{train_spec}' ({sum(len(read_tokens(s)) for s in shards)} tokens, 223 windows)" \
            in proc.stdout, proc.stdout
    assert losses(runs[1]) == losses(one), (losses(runs[1]), losses(one))
    base_steps, base_evals = losses(runs[1])
    assert len(base_steps) == 12 and len(base_evals) == 2
    for np_ in (2, 3):
        steps, evals = losses(runs[np_])
        assert max(rel_diff(a, b) for a, b in zip(base_steps + base_evals, steps + evals)) <= 1e-5, (np_, steps, evals)


def test_shards_too_short_or_missing_exit_2():
    folder = tempdir()
    for i, n in enumerate((10, 32, 0)):  # none holds a window of 33 tokens
        write_tokens(os.path.join(folder, f"short_{i}.bin"), [7] * n)
    pattern = os.path.join(folder, "short_*.bin")
    expect_usage_error(tiny_args(f"--data.train_file={pattern}"), f"data.train_file='{pattern}'",
                       "42 tokens make 0 windows", "in 3 files", "too short for one batch")
    expect_usage_error(tiny_args(f"--data.val_file={pattern}"), f"data.val_file='{pattern}'", "too short for one sequence")
    missing = os.path.join(folder, "nothing_*.bin")
    expect_usage_error(tiny_args(f"--data.train_file={ensure_data()[0]},{missing}"), "data.train_file", missing,
                       "matches no file")


def test_resume_on_other_data_is_refused_naming_the_difference():
    train_file, _ = ensure_data()
    tokens = read_tokens(train_file)
    folder, ckdir = tempdir(), tempdir()
    a = write_tokens(os.path.join(folder, "a.bin"), tokens[:40000])
    b = write_tokens(os.path.join(folder, "b.bin"), tokens[40000:90000])
    c = write_tokens(os.path.join(folder, "c.bin"), tokens[90000:100000])
    first, _ = train(2, f"--checkpoint.dir={ckdir}", f"--data.train_file={a},{b}", "--train.steps=2")
    ckpt = os.path.join(ckdir, "ckpt-00000002.h5")
    with h5py.File(ckpt, "r") as f:
        assert bytes(f.attrs["dataset.train"]).decode() == f"{1024 + 2 * 40000} {a}\n{1024 + 2 * 50000} {b}\n"
        val = os.path.realpath(ensure_data()[1])
        assert bytes(f.attrs["dataset.val"]).decode() == f"{os.path.getsize(val)} {ensure_data()[1]}\n"
        assert int(f.attrs["meta_checksum"]) == meta_checksum(f.attrs)
    # inspect shows that identity, file by file, with the sizes on disk.
    shown = inspect_lines(ckpt)
    sizes = [os.path.getsize(p) for p in (a, b)]
    start = shown.index(f"data.train_file: 2 files, {sum(sizes)} bytes")
    assert [l.split() for l in shown[start + 1:start + 3]] == [[str(sizes[0]), a], [str(sizes[1]), b]], shown
    assert shown[start + 3] == f"data.val_file: 1 file, {os.path.getsize(val)} bytes", shown
    assert shown[start + 4].split() == [str(os.path.getsize(val)), ensure_data()[1]], shown
    # Another file list: one more file, a file of another size (the same name), the same files moved.
    expect_usage_error(tiny_args(f"--checkpoint.dir={ckdir}", f"--data.train_file={a},{b},{c}", "--train.steps=4"),
                       ckpt, "data.train_file: file 3 of 3", "c.bin' (21024 bytes) is new", "checkpoint.allow_data_change")
    resized = os.path.join(tempdir(), "b.bin")
    write_tokens(resized, tokens[40000:90001])
    expect_usage_error(tiny_args(f"--checkpoint.dir={ckdir}", f"--data.train_file={a},{resized}", "--train.steps=4"),
                       "data.train_file: file 2 of 2 was", "(101024 bytes), now", "(101026 bytes)")
    allowed, _ = train(2, f"--checkpoint.dir={ckdir}", f"--data.train_file={a},{b},{c}", "--train.steps=3",
                       "--checkpoint.allow_data_change=true")
    assert "resumed from" in allowed.stdout and "at step 2" in allowed.stdout, allowed.stdout
    moved = tempdir()
    for path in (a, b):
        shutil.copy(path, moved)
    again, _ = train(2, f"--checkpoint.dir={tempdir()}", f"--checkpoint.resume={ckpt}",
                     f"--data.train_file={os.path.join(moved, '*.bin')}", "--train.steps=3")
    assert "at step 2" in again.stdout, again.stdout
    # A checkpoint of an older build (no identity, resealed): loads with a warning, paths compared.
    with h5py.File(ckpt, "r+") as f:
        for name in ("dataset.train", "dataset.val"):
            del f.attrs[name]
        f.attrs["meta_checksum"] = np.uint64(meta_checksum(f.attrs))
    assert "data files: not recorded (a checkpoint of an older build)" in inspect_lines(ckpt)
    old, _ = train(2, f"--checkpoint.dir={tempdir()}", f"--checkpoint.resume={ckpt}", f"--data.train_file={a},{b}",
                   "--train.steps=3")
    assert "at step 2" in old.stdout and any("records no dataset identity" in l for l in warnings(old)), old.stderr
    expect_usage_error(tiny_args(f"--checkpoint.dir={tempdir()}", f"--checkpoint.resume={ckpt}",
                                 f"--data.train_file={a}", "--train.steps=3"), "data.train_file was")


def test_32_bit_token_files():
    train_file, val_file = ensure_data()
    folder = tempdir()
    tokens, val = read_tokens(train_file)[:60000], read_tokens(val_file)[:5000]
    # Ids below 65,536 in either format: the same training, bit for bit.
    narrow = write_tokens(os.path.join(folder, "narrow.bin"), tokens)
    wide = write_tokens(os.path.join(folder, "wide.bin"), tokens, wide=True)
    steps = ("--train.steps=3", "--train.eval_every=3")
    _, a = train(2, f"--data.train_file={narrow}", *steps)
    _, b = train(2, f"--data.train_file={wide}", *steps)
    assert losses(a) == losses(b)
    decoded = run_single(["data", "decode", "--input", wide, "--count", "200"])
    assert decoded.returncode == 0 and decoded.stdout == bytes(tokens[:200].astype(np.uint8)).decode(), decoded.stderr
    # A vocabulary beyond 65,536: ids up to 69,999, a tiny model (its head is 70000 x 16).
    V = 70000
    big = write_tokens(os.path.join(folder, "big.bin"), np.where(np.arange(len(tokens)) % 3 == 0, tokens + 69800,
                                                                 tokens), wide=True)
    big_val = write_tokens(os.path.join(folder, "big_val.bin"), val + 69800, wide=True)
    ckdir = tempdir()
    shape = (f"--model.vocab_size={V}", "--model.n_embd=16", "--train.global_batch=4", f"--checkpoint.dir={ckdir}",
             f"--data.train_file={big}", f"--data.val_file={big_val}")
    _, c = train(2, *shape, "--train.steps=8", "--train.eval_every=8", "--train.lr=1e-2")
    first, last = c[0][0]["loss"], c[0][-1]["loss"]
    assert abs(first - np.log(V)) < 0.3 and last < first - 1.0, (first, last)
    with h5py.File(os.path.join(ckdir, "ckpt-00000008.h5"), "r") as f:
        assert int(f.attrs["model.vocab_size"]) == V
    proc, _ = train(2, *shape, "--train.steps=9")  # resumes: the checkpoint's vocabulary is valid
    assert "resumed from" in proc.stdout and "at step 8" in proc.stdout, proc.stdout
    # An id >= model.vocab_size: exit 2 naming the file, the token and its index (in rank 1's half,
    # in the second file of a list).
    bad_ids = np.array(tokens[:6000], dtype=np.int64)
    bad_ids[4321] = V
    bad = write_tokens(os.path.join(folder, "bad.bin"), bad_ids, wide=True)
    expect_usage_error(tiny_args(f"--model.vocab_size={V}", "--model.n_embd=16", f"--data.train_file={big},{bad}"),
                       bad, f"token {V} at index 4321", f"model.vocab_size={V}")
    expect_usage_error(tiny_args("--model.vocab_size=16777217"), "model.vocab_size=16777217", "[2, 16777216]")


TINY_TOKENIZER = {  # byte-level BPE over a, b and the space byte, with <|endoftext|> (id 9) between documents
    "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
    "decoder": None, "added_tokens": [{"id": 9, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                                       "rstrip": False, "normalized": False, "special": True}],
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
              "vocab": {"a": 0, "b": 1, "\u0120": 2, "ab": 3, "ba": 4}, "merges": ["a b", "b a"]}}


def test_encode_writes_shards_that_train():
    folder = tempdir()
    tokenizer, docs = os.path.join(folder, "tok.json"), os.path.join(folder, "docs.jsonl")
    with open(tokenizer, "w") as f:
        json.dump(TINY_TOKENIZER, f)
    rng = random.Random(5)
    with open(docs, "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(("ab", "ba", "a", "bab")) for _ in range(rng.randint(1, 30)))})
                    + "\n")
    whole = os.path.join(folder, "whole.bin")
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", docs, "--output", whole,
                       "--val-fraction", "0"])
    assert proc.returncode == 0, proc.stderr
    out = os.path.join(folder, "c_train.bin")
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", docs, "--output", out,
                       "--shard-tokens", "1000", "--val-shard"])
    assert proc.returncode == 0, proc.stderr
    shards = sorted(p for p in os.listdir(folder) if p.startswith("c_train_"))
    assert shards == [f"c_train_{i:06d}.bin" for i in range(len(shards))] and len(shards) >= 4, shards
    parts = [read_tokens(os.path.join(folder, p)) for p in shards] + [read_tokens(os.path.join(folder, "c_val.bin"))]
    assert all(len(p) == 1000 for p in parts[:-1]) and 0 < len(parts[-1]) <= 1000
    assert np.array_equal(np.concatenate(parts), read_tokens(whole))  # sharding cuts the stream, nothing else
    _, metrics = train(2, f"--data.train_file={os.path.join(folder, 'c_train_*.bin')}",
                       f"--data.val_file={os.path.join(folder, 'c_val.bin')}", "--train.steps=4", "--train.eval_every=4")
    assert len(metrics[0]) == 4 and len(metrics[1]) == 1
    expect_usage_error(["data", "encode", "--tokenizer", tokenizer, "--input", docs, "--output", out, "--val-shard"],
                       "--val-shard needs --shard-tokens", np_=1)

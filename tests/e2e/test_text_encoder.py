"""A frozen text encoder in the same job as the FLUX model it conditions (text_encoder.*,
docs/images.md): a Llama folder sharded beside the denoiser turns the synthetic world's captions
into its context during training, evaluation and sampling. Oracles: the context transformers would
compute (hf_reference.py: the tokenizers package, each caption's own forward in float64 numpy, no
padding) written into the data files as cached embeddings and trained on without the encoder; the
same run on another rank count; the recorded encoder's checksum; bad settings refused with one line."""
import json
import os

import h5py
import numpy as np

from harness import read_metrics, run, tempdir
from test_bad_input import expect_usage_error
from test_checkpoint_edges import meta_checksum
from test_hf import reference
from test_images import losses, ok, shape_args, world

EC, EH, EKV, EI, EV, EL = 32, 4, 2, 64, 400, 2  # the encoder: a Llama of 2 layers, n_embd 32
TOKENS = 12  # model.context_len: captions of 8 words are 8 tokens, with a circle 13 (cut at 12)


def bytes_to_unicode():
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b), cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def world_tokenizer(bos=False):
    """A byte-level BPE whose merges make each word of the world one token -- except "circle", left
    as its 7 bytes so that captions differ in length (padding) and some exceed TOKENS (cut); with
    `bos`, a template that puts <s> before every text, as Llama's tokenizers do."""
    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    merges = []
    words = ["red", "green", "blue", "yellow", "magenta", "cyan", "square", "triangle", "small", "large", "at", "the",
             "top", "middle", "bottom", "left", "centre", "right"]
    for word in words:
        piece = alphabet[ord(" ")] + word
        for i in range(2, len(piece) + 1):
            left, right, whole = piece[:i - 1], piece[i - 1], piece[:i]
            if whole not in vocab:
                merges.append(f"{left} {right}")
                vocab[whole] = len(vocab)
    assert len(vocab) < EV
    post = None
    if bos:
        post = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                         {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [EV - 1], "tokens": ["<s>"]}}}
    return {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": post,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "added_tokens": [{"id": EV - 1, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True}] if bos else [],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}


ENCODER = {}


def encoder():
    """A random Llama folder with the world's tokenizer, made once."""
    if not ENCODER:
        folder = os.path.join(tempdir(), "encoder")
        reference("make-llama", folder, EL, EC, EH, EKV, EI, EV, 64, "untied", "F32", 3, "model.")
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            json.dump(world_tokenizer(), f)
        ENCODER["folder"] = folder
    return ENCODER["folder"]


def encoder_args(layers="-1", *overrides):
    width = EC * len(layers.split(","))
    return shape_args(f"--text_encoder.source={encoder()}", f"--text_encoder.layers={layers}",
                      f"--model.context_len={TOKENS}", f"--model.context_dim={width}", f"--model.pooled_dim={width}",
                      *overrides)


def cached(path, layers, folder=None):
    """The world's file with the reference context of its captions as cached embeddings."""
    out = os.path.join(tempdir(), "cached-" + os.path.basename(path))
    got = reference("caption-context", folder or encoder(), layers, TOKENS, path, out)
    return out, got


def qwen_encoder(kind="qwen2"):
    """A random Qwen2 folder (q/k/v biases, rope_theta 1e6) or Qwen3 folder (q/k norms, as Z-Image's
    text encoder) whose tokenizer puts <s> first."""
    if kind not in ENCODER:
        folder = os.path.join(tempdir(), kind + "-encoder")
        reference("make-llama", folder, EL, EC, EH, EKV, EI, EV, 64, "untied", "F32", 5, "model.", kind)
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            json.dump(world_tokenizer(bos=True), f)
        ENCODER[kind] = folder
    return ENCODER[kind]


def gpt2_encoder():
    """A random GPT-2 folder (learned positions, LayerNorm, Conv1D weights) with the world's tokenizer."""
    if "gpt2" not in ENCODER:
        folder = os.path.join(tempdir(), "gpt2-encoder")
        reference("make", folder, EL, EC, EH, EV, 64, "F32", 6, "transformer.")
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            json.dump(world_tokenizer(), f)
        ENCODER["gpt2"] = folder
    return ENCODER["gpt2"]


def encode_text(ranks, source, layers, batch=5, folder=None):
    out = os.path.join(tempdir(), "encoded.h5")
    ok(run(ranks, ["encode-text", "--text-encoder", folder or encoder(), "--layers", layers, "--tokens", str(TOKENS),
                   "--input", source, "--output", out, "--batch", str(batch), "--threads", "1"]))
    return out


def datasets(path):
    with h5py.File(path, "r") as f:
        return {name: f[name][()] for name in f}, dict(f.attrs)


def test_the_sharded_encoder_computes_what_transformers_computes_on_any_rank_count():
    """encode-text's embeddings of the world's captions: the context transformers computes for each
    caption alone (its tokenizer, its forward without padding, hidden states side by side, zeros
    after the caption, their mean as the pooled vector) to float32 rounding, for the last hidden
    state and for an embedding, a block's output and the final norm's side by side; the same bits on
    1, 2 and 3 ranks (uneven slices of 96 captions, forwards of 5); every other dataset and
    attribute of the file copied. Captions of 8 and of 13 tokens (cut at 12) take both the padded
    and the cut path. And Qwen2 and Qwen3 encoders (biases, q/k norms, another rotary base) whose
    tokenizer adds a BOS token (9 and 12 tokens), and a GPT-2 encoder (learned positions, LayerNorm)."""
    w = world()
    for layers, hf_layers, folder, lengths in (("-1", "2", encoder(), [8, TOKENS]),
                                               ("0,1,-1", "0,1,2", encoder(), [8, TOKENS]),
                                               ("-2", "1", qwen_encoder(), [9, TOKENS]),
                                               ("-1", "2", qwen_encoder("qwen3"), [9, TOKENS]),
                                               ("1,2", "1,2", gpt2_encoder(), [8, TOKENS])):
        want_file, got = cached(w["train"], hf_layers, folder)
        assert got["lengths"] == lengths, got  # padded and cut captions both present
        want, want_attrs = datasets(want_file)
        files = [encode_text(ranks, w["train"], layers, folder=folder) for ranks in (1, 2, 3)]
        first, attrs = datasets(files[0])
        assert sorted(first) == sorted(want) and attrs.keys() == want_attrs.keys(), (sorted(first), sorted(want))
        for name, value in want_attrs.items():
            np.testing.assert_array_equal(attrs[name], value, err_msg=name)
        for name in want:
            if name in ("encoder_hidden_states", "pooled_projections"):
                scale = np.abs(want[name]).max()
                assert first[name].shape == want[name].shape and first[name].dtype == np.float32, name
                assert np.abs(first[name] - want[name]).max() < 2e-6 * scale, (layers, name)
            else:
                np.testing.assert_array_equal(first[name], want[name], err_msg=name)
        for other in files[1:]:
            got_other, _ = datasets(other)
            for name in first:
                np.testing.assert_array_equal(got_other[name], first[name], err_msg=name)
    # Captions stored as h5py's variable-length strings read as the fixed-length ones.
    variable = os.path.join(tempdir(), "variable.h5")
    with h5py.File(w["train"], "r") as f, h5py.File(variable, "w") as g:
        for name in f:
            if name != "captions":
                g[name] = f[name][()]
        g.create_dataset("captions", data=[c.decode() for c in f["captions"][()]], dtype=h5py.string_dtype())
        for name, value in f.attrs.items():
            g.attrs[name] = value
    fixed, _ = datasets(encode_text(1, w["train"], "-1"))
    np.testing.assert_array_equal(datasets(encode_text(1, variable, "-1"))[0]["encoder_hidden_states"],
                                  fixed["encoder_hidden_states"])


def test_training_with_the_encoder_in_the_job_is_training_on_its_cached_embeddings():
    """The encoder in the job gives the model, micro-batch by micro-batch, what encode-text caches:
    the same losses, training and validation, as training on the cached files (the context moves
    the first steps' losses by parts per million only, so the comparison is to 1e-9); the same
    losses on 1 and 3 ranks; its line in the log."""
    w = world()
    files = {k: encode_text(2, w[k], "0,-1", batch=4) for k in ("train", "val")}
    m = [os.path.join(tempdir(), f"m{i}.jsonl") for i in range(4)]
    width = 2 * EC
    cached_run = losses(run(2, shape_args(f"--data.train_file={files['train']}", f"--data.val_file={files['val']}",
                                          f"--model.context_len={TOKENS}", f"--model.context_dim={width}",
                                          f"--model.pooled_dim={width}", f"--train.metrics_file={m[0]}")), m[0])
    proc = run(2, encoder_args("0,-1", f"--train.metrics_file={m[1]}"))
    in_job = losses(proc, m[1])
    assert max(abs(a - b) / abs(b) for a, b in zip(in_job, cached_run)) < 1e-9, (in_job, cached_run)
    val = [[r["val_loss"] for r in read_metrics(path, "eval")] for path in m[:2]]
    assert val[0] and max(abs(a - b) / abs(b) for a, b in zip(*val)) < 1e-9, val
    assert "text encoder: " in proc.stdout and "frozen and sharded beside the model" in proc.stdout, proc.stdout
    # Its own strategy: whole on every rank beside the FULL_SHARD model, sharded beside a NO_SHARD one.
    for i, strategy in enumerate(("--fsdp.sharding_strategy=FULL_SHARD", "--fsdp.sharding_strategy=NO_SHARD")):
        path = os.path.join(tempdir(), f"own{i}.jsonl")
        own = ("NO_SHARD", "FULL_SHARD")[i]
        proc = run(2, encoder_args("0,-1", f"--train.metrics_file={path}", strategy,
                                   f"--text_encoder.sharding_strategy={own}"))
        assert max(abs(a - b) / abs(b) for a, b in zip(losses(proc, path), cached_run)) < 1e-9, own
    one = losses(run(1, encoder_args("-1", f"--train.metrics_file={m[2]}", "--train.global_batch=12")), m[2])
    three = losses(run(3, encoder_args("-1", f"--train.metrics_file={m[3]}", "--train.global_batch=12")), m[3])
    assert max(abs(a - b) / abs(b) for a, b in zip(one, three)) < 1e-6, (one, three)


def test_the_encoder_is_planned_recorded_and_samples_with_its_captions():
    """Its memory is in the plan the trainer checks against what it allocated (the run would stop
    otherwise) and in the planner's table; the checkpoint records it, so that `sample` encodes the
    prompts' captions with it -- the same PNG bytes on 1 and 2 ranks, and cfg against the empty
    caption -- and refuses an encoder with other weights."""
    d = tempdir()
    ok(run(2, encoder_args("-1", f"--checkpoint.dir={d}", "--text_encoder.dtype=bf16")))
    plan = run(1, ["plan", "--world-size", "2", *encoder_args("-1")[1:]])
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "text encoder (text_encoder.source, frozen, in peak/rank)" in plan.stdout, plan.stdout[-3000:]
    ckpt = os.path.join(d, "ckpt-00000004.h5")
    with h5py.File(ckpt, "r") as f:
        assert f.attrs["text_encoder.source"].decode() == encoder(), dict(f.attrs)
        assert f.attrs["text_encoder.layers"].decode() == "-1"
        assert f.attrs["text_encoder.dtype"].decode() == "bf16" and f.attrs["text_encoder.quant_block"] == 64
        assert f.attrs["text_encoder.checksum"] != 0
        assert int(f.attrs["meta_checksum"]) == meta_checksum(f.attrs), "the metadata checksum's definition"
    shown = ok(run(1, ["inspect", ckpt])).stdout
    assert f"text encoder in the job: {encoder()}, hidden states -1, held in bf16" in shown, shown[:2000]
    # A resume takes the same conditioning: hidden state 1 has the width of -1 but is other values.
    expect_usage_error(encoder_args("1", f"--checkpoint.dir={d}", "--text_encoder.dtype=bf16", "--train.steps=6"),
                       "resume with text_encoder.layers=-1")
    w = world()
    outs = []
    for ranks in (1, 2):
        out = os.path.join(tempdir(), "s.h5")
        ok(run(ranks, ["sample", "--checkpoint", ckpt, "--prompts", w["prompts"], "--output", out, "--grid", "4x4",
                       "--steps", "3", "--batch", "5", "--cfg", "2", "--threads", "1"]))
        outs.append(open(out[:-3] + ".png", "rb").read())
    assert outs[0] == outs[1]
    other = os.path.join(tempdir(), "other")
    reference("make-llama", other, EL, EC, EH, EKV, EI, EV, 64, "untied", "F32", 4, "model.")
    with open(os.path.join(other, "tokenizer.json"), "w") as f:
        json.dump(world_tokenizer(), f)
    expect_usage_error(["sample", "--checkpoint", ckpt, "--prompts", w["prompts"], "--output",
                        os.path.join(tempdir(), "x.h5"), "--grid", "4x4", "--text-encoder", other],
                       "has checksum", "give that encoder (--text-encoder)")


def test_bad_text_encoder_settings_are_refused_with_one_line():
    w = world()
    expect_usage_error(encoder_args("-1", "--model.context_dim=48"), "model.context_dim=48", "set both to 32")
    expect_usage_error(encoder_args("3"), "text_encoder.layers='3'", "out of range", "-1 to -3")
    expect_usage_error(encoder_args("x"), "'x' is not an integer")
    expect_usage_error(encoder_args("-1", "--text_encoder.sharding_strategy=HYBRID_SHARD"),
                       "text_encoder.sharding_strategy='HYBRID_SHARD'", "FULL_SHARD, NO_SHARD")
    expect_usage_error(encoder_args("-1", "--text_encoder.sharding_strategy=NO_SHARD",
                                    "--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2",
                                    "--train.global_batch=16"), "leave it empty under HYBRID_SHARD", np_=4)
    expect_usage_error(shape_args("--text_encoder.layers=-2"), "text_encoder.source is empty")
    expect_usage_error(encoder_args("-1", f"--data.train_file={w['empty']}"), "no dataset 'latents'")
    no_captions = os.path.join(tempdir(), "no-captions.h5")
    with h5py.File(w["train"], "r") as f, h5py.File(no_captions, "w") as g:
        for name in f:
            if name != "captions":
                g[name] = f[name][()]
        for name, value in f.attrs.items():
            g.attrs[name] = value
    expect_usage_error(encoder_args("-1", f"--data.train_file={no_captions}"), "has no dataset 'captions'")
    bad_utf8 = os.path.join(tempdir(), "bad-utf8.h5")
    with h5py.File(w["train"], "r") as f, h5py.File(bad_utf8, "w") as g:
        for name in f:
            g[name] = f[name][()]
        captions = g["captions"][()]
        captions[3] = b"a \xff red"
        g["captions"][...] = captions
        for name, value in f.attrs.items():
            g.attrs[name] = value
    expect_usage_error(encoder_args("-1", f"--data.train_file={bad_utf8}"), "caption 3", "not valid UTF-8")
    gpt2 = os.path.join(tempdir(), "nowhere")
    expect_usage_error(shape_args(f"--text_encoder.source={gpt2}", "--model.context_dim=32"),
                       "is neither a ShardTrain checkpoint")
    folder = os.path.join(tempdir(), "untokenized")
    reference("make-llama", folder, EL, EC, EH, EKV, EI, EV, 64, "untied", "F32", 3, "model.")
    expect_usage_error(shape_args(f"--text_encoder.source={folder}", f"--model.context_len={TOKENS}",
                                  "--model.context_dim=32", "--model.pooled_dim=32"),
                       "comes with no tokenizer", "text_encoder.tokenizer")

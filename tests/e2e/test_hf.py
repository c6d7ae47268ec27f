"""Hugging Face GPT-2 folders in and out. The oracle is Hugging Face's side, independent of ours:
folders written and read by the `safetensors` package, and GPT-2's loss computed by a float64 numpy
transcription of transformers' GPT2LMHeadModel (tests/e2e/hf_reference.py). The data file repeats one
random sequence with period seq_len, so every training sequence is that sequence whatever the
sampler picks, and the first step's loss is the reference's loss on it."""
import json
import os
import shutil
import subprocess

import numpy as np

import harness
from harness import read_metrics, rel_diff, run, tempdir, tiny_args
from hf_reference import gpt2_shapes
from test_bad_input import expect_usage_error, write_tokens

L, C, H, V, MAXT, SEQ = 2, 40, 4, 256, 64, 32  # inputs/tiny.ini's model and seq_len
HERE = os.path.dirname(os.path.abspath(__file__))


def reference(*args):
    proc = subprocess.run(["timeout", "300", harness.venv_python(), os.path.join(HERE, "hf_reference.py"),
                           *map(str, args)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def hf_folder(dtype="F32", seed=1, prefix="transformer."):
    folder = os.path.join(tempdir(), "gpt2-hf")
    reference("make", folder, L, C, H, V, MAXT, dtype, seed, prefix or "-")
    return folder


def periodic_data(seed=7):
    """A token file holding one random sequence of SEQ tokens over and over; returns (path, the
    SEQ + 1 tokens of every training window)."""
    pattern = np.random.default_rng(seed).integers(0, V, SEQ)
    path = os.path.join(tempdir(), "periodic.bin")
    write_tokens(path, np.tile(pattern, 400).tolist() + [int(pattern[0])])
    return path, pattern.tolist() + [int(pattern[0])]


def first_loss(folder, data, *extra, np_=2):
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = run(np_, tiny_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                              "--train.steps=1", "--train.lr=1e-30", f"--train.metrics_file={metrics}", *extra))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "initialised the weights from Hugging Face folder" in proc.stdout, proc.stdout
    return read_metrics(metrics)[0]["loss"], proc


def test_import_gives_transformers_loss_on_any_rank_count_and_strategy():
    data, window = periodic_data()
    for dtype, prefix in (("F32", "transformer."), ("F16", "")):
        folder = hf_folder(dtype, prefix=prefix)
        expected = reference("loss", folder, *window)["loss"]
        for np_, strategy in ((1, "FULL_SHARD"), (2, "FULL_SHARD"), (3, "SHARD_GRAD_OP"), (4, "NO_SHARD")):
            loss, _ = first_loss(folder, data, f"--fsdp.sharding_strategy={strategy}", np_=np_)
            assert rel_diff(loss, expected) < 2e-6, (dtype, np_, strategy, loss, expected)


def test_export_round_trips_bit_for_bit_and_loads_in_the_reference():
    data, window = periodic_data()
    folder = hf_folder("F32")
    ckdir = tempdir()
    metrics = os.path.join(tempdir(), "m.jsonl")
    # lr 1e-30: the saved weights are the imported ones, bit for bit (lr must be > 0; the update and the
    # decoupled weight decay, both scaled by lr, round away in fp32).
    proc = run(3, tiny_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                            "--train.steps=1", "--train.lr=1e-30", f"--checkpoint.dir={ckdir}",
                            f"--train.metrics_file={metrics}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = os.path.join(ckdir, "ckpt-00000001.h5")
    out = os.path.join(tempdir(), "exported")
    proc = run(2, ["export", "--format", "hf", "--checkpoint", ckpt, "--output", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"], os.listdir(out)
    exported = os.path.join(out, "model.safetensors")
    assert reference("equal", exported, os.path.join(folder, "model.safetensors"))["equal"]
    view = reference("tensors", exported)
    assert view["metadata"] == {"format": "pt"}, view["metadata"]
    assert view["tensors"]["transformer.h.1.attn.c_attn.weight"][:2] == ["float32", [C, 3 * C]]
    # The exported folder is itself a model: the same loss, in the reference and imported again.
    expected = reference("loss", folder, *window)["loss"]
    assert reference("loss", out, *window)["loss"] == expected
    again, _ = first_loss(out, data)
    assert rel_diff(again, expected) < 2e-6, (again, expected)
    # Split at a size limit, as save_pretrained does: files of whole tensors and an index.
    split = os.path.join(tempdir(), "exported-split")
    proc = run(3, ["export", "--format", "hf", "--max-file-size", "20KiB", "--checkpoint", ckpt, "--output", split])
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.load(open(os.path.join(split, "model.safetensors.index.json")))
    weight_files = sorted(set(index["weight_map"].values()))
    assert len(weight_files) > 1 and sorted(os.listdir(split)) == sorted(
        weight_files + ["config.json", "model.safetensors.index.json"]), os.listdir(split)
    assert weight_files == [f"model-{k:05d}-of-{len(weight_files):05d}.safetensors" for k in range(1, len(weight_files) + 1)]
    total = sum(4 * np.prod(shape) for shape in gpt2_shapes(L, C, V, MAXT).values())
    assert index["metadata"]["total_size"] == total, index["metadata"]
    for name in weight_files:  # at most 20 KiB of tensors, or one tensor larger than that
        held = reference("tensors", os.path.join(split, name))["tensors"]
        nbytes = sum(4 * int(np.prod(shape)) for _, shape, _ in held.values())
        assert nbytes <= 20 * 1024 or len(held) == 1, (name, nbytes, len(held))
    assert reference("equal", split, folder)["equal"]
    again, _ = first_loss(split, data)
    assert rel_diff(again, expected) < 2e-6, (again, expected)
    # fp16 export: each weight rounded to nearest even, as numpy's float16 does.
    half = os.path.join(tempdir(), "exported-f16")
    proc = run(1, ["export", "--format", "hf", "--dtype", "fp16", "--checkpoint", ckpt, "--output", half])
    assert proc.returncode == 0, proc.stderr[-3000:]
    f32 = reference("tensors", os.path.join(folder, "model.safetensors"))["tensors"]
    f16 = reference("tensors", os.path.join(half, "model.safetensors"))["tensors"]
    assert sorted(f16) == sorted(f32) and all(v[0] == "float16" for v in f16.values())
    check = os.path.join(tempdir(), "check.py")
    with open(check, "w") as f:
        f.write("import sys, numpy as np\nfrom safetensors.numpy import load_file\n"
                "a, b = load_file(sys.argv[1]), load_file(sys.argv[2])\n"
                "sys.exit(0 if all(np.array_equal(a[k].astype(np.float16), b[k]) for k in a) else 1)\n")
    assert subprocess.run([harness.venv_python(), check, os.path.join(folder, "model.safetensors"),
                           os.path.join(half, "model.safetensors")]).returncode == 0


def test_shape_comes_from_config_json():
    data, _ = periodic_data()
    folder = hf_folder("F32")
    # A configuration without [model]: the folder's config.json gives L, C, H, V and max_seq_len.
    ini = os.path.join(tempdir(), "no-model.ini")
    with open(ini, "w") as f:
        f.write("[train]\nsteps = 1\nglobal_batch = 8\nmicro_batch = 2\nseq_len = 32\nlr = 1e-30\n")
    proc = run(2, ["train", "--config", ini, f"--checkpoint.init_from={folder}", f"--data.train_file={data}",
                   f"--checkpoint.dir={tempdir()}", "--train.peak_gflops=100"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "L=2 C=40 H=4 V=256 max_seq_len=64" in proc.stdout, proc.stdout
    # A configured shape that disagrees is named, with the fix.
    expect_usage_error(tiny_args(f"--checkpoint.init_from={folder}", "--model.n_layer=3"), "model.n_layer=3",
                       "config.json says 2", "remove")


def test_bad_folders_are_refused_naming_file_and_tensor():
    good = hf_folder("F32")
    weights = os.path.join(good, "model.safetensors")
    raw = open(weights, "rb").read()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])

    def variant(name, data=None, config=None):
        folder = os.path.join(tempdir(), name)
        shutil.copytree(good, folder)
        if data is not None:
            open(os.path.join(folder, "model.safetensors"), "wb").write(data)
        if config is not None:
            c = json.load(open(os.path.join(good, "config.json")))
            c.update(config)
            json.dump(c, open(os.path.join(folder, "config.json"), "w"))
        return folder

    def with_header(h):
        text = json.dumps(h).encode()
        data_start = 8 + header_len
        return len(text).to_bytes(8, "little") + text + raw[data_start:]

    cases = [
        (variant("truncated", raw[:-100]), ["model.safetensors", "outside the", "truncated"]),
        (variant("length", (10 ** 12).to_bytes(8, "little") + raw[8:]), ["header length", "not a safetensors file"]),
        (variant("json", raw[:8] + b"{" + b"x" * (header_len - 1) + raw[8 + header_len:]), ["malformed JSON"]),
    ]
    gap = dict(header)
    gap.pop("transformer.h.1.mlp.c_fc.bias")
    cases.append((variant("gap", with_header(gap)), ["model.safetensors", "transformer.h.1.mlp.c_fc.weight", "gap"]))
    missing = dict(header)  # its bytes now belong to a buffer that older GPT-2 files carry and we ignore
    missing["transformer.h.1.attn.masked_bias"] = missing.pop("transformer.h.1.mlp.c_fc.bias")
    cases.append((variant("missing", with_header(missing)), ["transformer.h.1.mlp.c_fc.bias", "missing"]))
    wrong = json.loads(json.dumps(header))
    wrong["transformer.wpe.weight"]["shape"] = [MAXT // 2, 2 * C]
    cases.append((variant("shape", with_header(wrong)), ["transformer.wpe.weight", "shape [32, 80]", "[64, 40]"]))
    extra = json.loads(json.dumps(header))
    end = len(raw) - 8 - header_len  # an empty tensor after the last one keeps the data area tiled
    extra["transformer.h.9.ln_1.weight"] = {"dtype": "F32", "shape": [0], "data_offsets": [end, end]}
    cases.append((variant("unexpected", with_header(extra)), ["unexpected tensor 'transformer.h.9.ln_1.weight'"]))
    ints = json.loads(json.dumps(header))
    ints["transformer.ln_f.bias"]["dtype"] = "I32"
    cases.append((variant("dtype", with_header(ints)), ["transformer.ln_f.bias", "I32"]))
    for key, value, needle in (("activation_function", "relu", "activation_function 'relu'"),
                               ("n_inner", 7, "n_inner 7"), ("model_type", "bert", "model_type 'bert'"),
                               ("tie_word_embeddings", False, "tie_word_embeddings"),
                               ("n_head", "four", "n_head")):
        cases.append((variant(f"config-{key}", config={key: value}), ["config.json", needle]))
    for folder, needles in cases:
        expect_usage_error(tiny_args(f"--checkpoint.init_from={folder}", "--train.steps=1"), *needles)


def test_export_options_are_checked():
    expect_usage_error(["export", "--format", "onnx", "--checkpoint", "x.h5", "--output", "y"], "--format='onnx'",
                       "llmc, hf")
    expect_usage_error(["export", "--format", "hf", "--dtype", "fp8", "--checkpoint", "x.h5", "--output", "y"],
                       "--dtype='fp8'")

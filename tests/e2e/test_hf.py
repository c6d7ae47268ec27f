"""Hugging Face GPT-2 and Llama folders in and out. The oracle is Hugging Face's side, independent of
ours: folders written and read by the `safetensors` package, and the loss computed by float64 numpy
transcriptions of transformers' GPT2LMHeadModel and LlamaForCausalLM (tests/e2e/hf_reference.py).
The data file repeats one random sequence with period seq_len, so every training sequence is that
sequence whatever the sampler picks, and the first step's loss is the reference's loss on it."""
import hashlib
import json
import math
import os
import shutil
import subprocess

import numpy as np

import h5py

import harness
from harness import read_metrics, rel_diff, run, tempdir, tiny_args
from hf_reference import gpt2_shapes, llama_shapes
from test_bad_input import expect_usage_error, tiny_args_with_config, write_tokens

L, C, H, V, MAXT, SEQ = 2, 40, 4, 256, 64, 32  # inputs/tiny.ini's model and seq_len
KV, I = 2, 104  # and inputs/llama-tiny.ini's grouped-query attention and MLP width
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


DROP = object()


def llama_folder(dtype="F32", tied=False, kv=KV, seed=1, prefix="model.", extras=(), config=None):
    """A random Llama folder (kv 0: num_key_value_heads left out); `config` updates config.json, a
    value of DROP removing the key."""
    folder = os.path.join(tempdir(), "llama-hf")
    reference("make-llama", folder, L, C, H, kv, I, V, MAXT, "tied" if tied else "untied", dtype, seed,
              prefix or "-", ",".join(extras))
    if config:
        path = os.path.join(folder, "config.json")
        c = json.load(open(path))
        for key, value in config.items():
            c.pop(key) if value is DROP else c.update({key: value})
        json.dump(c, open(path, "w"))
    return folder


def no_model_ini():
    """inputs/tiny.ini without its [model] section: the shape then comes from the folder alone."""
    path = os.path.join(tempdir(), "no-model.ini")
    keep, lines = True, []
    for line in open(os.path.join(harness.ROOT, "inputs", "tiny.ini")):
        if line.startswith("["):
            keep = line.strip() != "[model]"
        lines.append(line) if keep else None
    open(path, "w").write("".join(lines))
    return path


def llama_args(*overrides):
    return tiny_args_with_config(no_model_ini(), *overrides)


def first_loss(folder, data, *extra, np_=2, args=tiny_args):
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = run(np_, args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
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
    nul = json.loads(json.dumps(header))
    nul["transformer.h.9\u0000.ln_1.weight"] = {"dtype": "F32", "shape": [0], "data_offsets": [end, end]}
    cases.append((variant("nul", with_header(nul)), ["unexpected tensor 'transformer.h.9<U+0000>.ln_1.weight'"]))
    ints = json.loads(json.dumps(header))
    ints["transformer.ln_f.bias"]["dtype"] = "I32"
    cases.append((variant("dtype", with_header(ints)), ["transformer.ln_f.bias", "I32"]))
    # The battery's messages that lost their point: reversed offsets read as a truncated file, a
    # tensor name with a NUL byte cut the line short, a folder where a file belongs read as "shorter
    # than the 8-byte header".
    reversed_ = json.loads(json.dumps(header))
    begin, end_ = reversed_["transformer.ln_f.bias"]["data_offsets"]
    reversed_["transformer.ln_f.bias"]["data_offsets"] = [end_, begin]
    cases.append((variant("reversed", with_header(reversed_)), ["transformer.ln_f.bias", "end before they begin"]))
    folder_named = variant("folder-named-weights")
    os.remove(os.path.join(folder_named, "model.safetensors"))
    os.mkdir(os.path.join(folder_named, "model.safetensors"))
    cases.append((folder_named, ["model.safetensors", "is a folder, not a file"]))
    for entry in ("..", ".", ""):
        dots = variant(f"index-{entry or 'empty'}")
        os.remove(os.path.join(dots, "model.safetensors"))
        with open(os.path.join(dots, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {name: entry for name in header if name != "__metadata__"}}, f)
        cases.append((dots, ["model.safetensors.index.json", "names no file of the folder"]))
    for key, value, needle in (("activation_function", "relu", "activation_function 'relu'"),
                               ("n_inner", 7, "n_inner 7"), ("model_type", "bert", "model_type 'bert'"),
                               ("tie_word_embeddings", False, "tie_word_embeddings"),
                               ("n_head", "four", "n_head"),
                               # shapes no table can hold: refused before anything is sized (were bad_alloc)
                               ("vocab_size", 2 ** 30, "model.vocab_size=1073741824"),
                               ("n_layer", 1000000, "model.n_layer=1000000"),
                               ("n_embd", 2 ** 20, "more than 10^13 parameters")):
        cases.append((variant(f"config-{key}", config={key: value}), ["config.json", needle]))
    for folder, needles in cases:
        expect_usage_error(tiny_args(f"--checkpoint.init_from={folder}", "--train.steps=1"), *needles)


def test_export_options_are_checked():
    expect_usage_error(["export", "--format", "onnx", "--checkpoint", "x.h5", "--output", "y"], "--format='onnx'",
                       "llmc, hf")
    expect_usage_error(["export", "--format", "hf", "--dtype", "fp8", "--checkpoint", "x.h5", "--output", "y"],
                       "--dtype='fp8'")


# ---------------------------------------------------------------- Llama


def test_llama_import_gives_transformers_loss():
    """Grouped-query and plain multi-head attention, untied and tied heads, F32, BF16 and F16 files,
    with and without the "model." prefix, mistral folders without a sliding window, with one that
    slides within the sequence (every query seeing itself and the 4 keys before it, as transformers'
    masking_utils has it) and with MistralConfig's default window (beyond the model's 64 positions:
    read as none), LlamaConfig's defaults for
    left-out keys, and the non-parameter tensors real files carry, on 1-3 ranks."""
    data, window = periodic_data()
    cases = [
        (llama_folder("F32", extras=["inv_freq"]), (1, 2, 3), "KV=2 MLP=104 V=256 max_seq_len=64 rope_theta=10000 "
         "norm_eps=1e-05 untied"),
        # LlamaConfig's defaults: num_key_value_heads = num_attention_heads, rope_theta 10000, rms_norm_eps 1e-6.
        (llama_folder("BF16", tied=True, kv=0, seed=2, extras=["lm_head"],
                      config={"rope_theta": DROP, "rms_norm_eps": DROP}), (2,), "KV=4 MLP=104 V=256 "
         "max_seq_len=64 rope_theta=10000 norm_eps=1e-06 tied"),
        (llama_folder("F16", kv=1, seed=3, prefix="", config={"model_type": "mistral", "sliding_window": None,
                                                              "rope_theta": 500000.0}), (1,), "KV=1 MLP=104 V=256 "
         "max_seq_len=64 rope_theta=500000 norm_eps=1e-05 untied"),
        (llama_folder(seed=5, config={"model_type": "mistral", "sliding_window": 5}), (1, 2, 3),
         "KV=2 MLP=104 V=256 max_seq_len=64 rope_theta=10000 norm_eps=1e-05 untied sliding_window=5"),
        # MistralConfig's default window, 4096, which no sequence of this model (64) reaches: none.
        (llama_folder(seed=6, config={"model_type": "mistral"}), (2,),
         "KV=2 MLP=104 V=256 max_seq_len=64 rope_theta=10000 norm_eps=1e-05 untied | "),
    ]
    for folder, ranks, summary in cases:
        expected = reference("loss", folder, *window)["loss"]
        for np_ in ranks:
            loss, proc = first_loss(folder, data, np_=np_, args=llama_args)
            assert f"Llama L=2 C=40 H=4 {summary}" in proc.stdout, proc.stdout
            assert rel_diff(loss, expected) < 2e-6, (folder, np_, loss, expected)


def test_a_mistral_window_trains_exports_and_generates_as_transformers_has_it():
    """A mistral folder whose window (5) the sequences reach: its loss is the reference's and not the
    unwindowed model's; import -> checkpoint -> export writes MistralForCausalLM with the window and
    the same file; after training the export imports with the reference's loss; the checkpoint
    records model.sliding_window and a run with another window is refused; greedy generation past
    the window (the cache attended over its last 5 rows) is the same on 1 and 2 ranks; the shipped
    Mistral-7B-v0.1 config plans."""
    from llama_variants import check_export_round_trip
    data, window = periodic_data()
    folder = llama_folder(seed=8, config={"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                          "sliding_window": 5})
    unwindowed = llama_folder(seed=8)
    assert rel_diff(reference("loss", folder, *window)["loss"], reference("loss", unwindowed, *window)["loss"]) > 1e-3
    check_export_round_trip(folder, "MistralForCausalLM", {"architectures": ["MistralForCausalLM"],
                                                           "model_type": "mistral", "sliding_window": 5},
                            ["model.layers.0.self_attn.q_proj.weight"])
    ckdir = tempdir()
    ok_proc = run(2, llama_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                                "--train.steps=2", f"--checkpoint.dir={ckdir}"))
    assert ok_proc.returncode == 0, ok_proc.stderr[-3000:]
    ckpt = os.path.join(ckdir, "ckpt-00000002.h5")
    with h5py.File(ckpt, "r") as f:
        assert int(f.attrs["model.sliding_window"]) == 5 and int(f.attrs["version"]) == 10
    expect_usage_error(llama_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                                  "--train.steps=3", f"--checkpoint.dir={ckdir}", "--model.sliding_window=6"),
                       "model.sliding_window")
    outputs = []
    for np_ in (1, 2):
        proc = run(np_, ["generate", "--checkpoint", ckpt, "--prompt", "ab", "--max-tokens", "20", "--temperature",
                         "0", "--ignore-eos", "--tokenizer="])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "sliding_window=5" in proc.stderr, proc.stderr
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1] and len(outputs[0].encode("latin-1", "replace")) >= 20, outputs
    # A family without the key refuses it, as any key it does not read; a window at least
    # model.max_seq_len is no window.
    expect_usage_error(tiny_args("--model.sliding_window=4"), "model.sliding_window is not a gpt2 option")
    expect_usage_error(llama_args("--model.arch=llama", "--model.sliding_window=-3"),
                       "model.sliding_window=-3 is not in [0, 2^24]")
    proc = run(1, ["plan", "--config", os.path.join(harness.ROOT, "inputs", "llama-tiny.ini"), "--world-size=1",
                   "--model.sliding_window=64"])
    assert proc.returncode == 0 and "sliding_window" not in proc.stdout, proc.stdout[:2000] + proc.stderr[-2000:]
    # The shipped Mistral-7B-v0.1 shape plans with its window and published parameter count.
    proc = run(1, ["plan", "--config", os.path.join(harness.ROOT, "inputs", "mistral-7b.ini"), "--world-size=8"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "untied sliding_window=4096 (7241.7M parameters)" in proc.stdout, proc.stdout[:2000]


def test_llama_export_round_trips_and_matches_the_checkpoint():
    data, window = periodic_data()
    # Import -> checkpoint (lr 1e-30: the imported weights) -> export: the same file, bit for bit.
    folder = llama_folder("F32")
    ckdir = tempdir()
    proc = run(2, llama_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                             "--train.steps=1", "--train.lr=1e-30", f"--checkpoint.dir={ckdir}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = os.path.join(tempdir(), "exported")
    ckpt = os.path.join(ckdir, "ckpt-00000001.h5")
    proc = run(3, ["export", "--format", "hf", "--checkpoint", ckpt, "--output", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LlamaForCausalLM" in proc.stdout, proc.stdout
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"], os.listdir(out)
    assert reference("equal", out, folder)["equal"]
    config = json.load(open(os.path.join(out, "config.json")))
    expected_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": C, "intermediate_size": I,
        "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": C // H,
        "vocab_size": V, "max_position_embeddings": MAXT, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None}
    assert {k: config.get(k, "absent") for k in expected_config} == expected_config, config
    assert reference("loss", out, *window) == reference("loss", folder, *window)

    # Trained (a tied model, so the head's gradient is the embedding's too), gathered checkpoint ->
    # export: every tensor is the checkpoint's, named as transformers names it.
    folder = llama_folder("BF16", tied=True, seed=4)
    ckdir = tempdir()
    proc = run(2, llama_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                             "--train.steps=3", "--train.lr=1e-2", "--train.warmup_steps=0",
                             "--checkpoint.format=gathered", f"--checkpoint.dir={ckdir}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = os.path.join(ckdir, "ckpt-00000003.h5")
    out = os.path.join(tempdir(), "exported-trained")
    proc = run(2, ["export", "--format", "hf", "--checkpoint", ckpt, "--output", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    view = reference("tensors", os.path.join(out, "model.safetensors"))
    assert view["metadata"] == {"format": "pt"}, view["metadata"]
    shapes = llama_shapes(L, C, H, KV, I, V, tied=True)
    assert sorted(view["tensors"]) == sorted(shapes) and "lm_head.weight" not in shapes
    with h5py.File(ckpt, "r") as f:
        for name, (dtype, shape, digest) in view["tensors"].items():
            values = f["model"][name[len("model."):]][...]
            assert (dtype, tuple(shape)) == ("float32", shapes[name]) and values.dtype == np.float32, name
            assert digest == hashlib.sha256(values.astype("<f4").tobytes()).hexdigest(), name
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == KV, config
    # The exported model, imported again, gives the reference's loss on it.
    expected = reference("loss", out, *window)["loss"]
    again, _ = first_loss(out, data, args=llama_args)
    assert rel_diff(again, expected) < 2e-6, (again, expected)
    # bf16: each weight rounded to nearest even.
    half = os.path.join(tempdir(), "exported-bf16")
    proc = run(1, ["export", "--format", "hf", "--dtype", "bf16", "--checkpoint", ckpt, "--output", half])
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = "model.safetensors"
    assert reference("rounded", os.path.join(out, weights), os.path.join(half, weights))["rounded"]
    assert json.load(open(os.path.join(half, "config.json")))["torch_dtype"] == "bfloat16"


def imported_then_exported(folder, data):
    """The folder imported on 2 ranks into a checkpoint (one step at lr 1e-30: its weights), and that
    checkpoint exported as a Hugging Face folder: (checkpoint, exported folder)."""
    ckdir = tempdir()
    proc = run(2, llama_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                             "--train.steps=1", "--train.lr=1e-30", f"--checkpoint.dir={ckdir}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt, out = os.path.join(ckdir, "ckpt-00000001.h5"), os.path.join(tempdir(), "exported")
    proc = run(1, ["export", "--format", "hf", "--checkpoint", ckpt, "--output", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ckpt, out


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}
LLAMA3_TEXT = "llama3:factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=256"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}  # Qwen's form, scaled down
YARN_TEXT = ("yarn:factor=4,original_max_position_embeddings=16,attention_factor=%.17g,beta_fast=32,beta_slow=1,"
             "truncate=1" % (0.1 * math.log(4) + 1))


def test_scaled_rotary_embeddings_give_transformers_loss_and_travel_with_the_model():
    """Llama 3.1's rope_scaling (llama3: head size 10 over 256 original positions keeps two
    frequencies, blends one and divides two), linear scaling (transformers 5's rope_parameters) and
    yarn (its ramp over 16 original positions, cos and sin times its attention factor) give the
    reference's loss -- whose inverse frequencies are transformers' bit for bit
    (tests/unit/test_rope_scaling.cpp) -- and not the unscaled model's; the setting goes into the
    checkpoint and back out to config.json."""
    data, window = periodic_data()
    cases = [(llama_folder("F32", config={"rope_scaling": LLAMA3}), LLAMA3_TEXT, (1, 2)),
             (llama_folder("BF16", seed=2, config={"rope_scaling": DROP, "rope_theta": DROP, "rope_parameters": {
                 "rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}}), "linear:factor=4", (3,)),
             (llama_folder("F32", seed=3, config={"rope_scaling": YARN}), YARN_TEXT, (2,))]
    for folder, text, ranks in cases:
        expected = reference("loss", folder, *window)["loss"]
        plain = json.load(open(os.path.join(folder, "config.json")))
        plain["rope_theta"] = (plain.pop("rope_parameters", None) or {}).get("rope_theta", 10000.0)
        plain.pop("rope_scaling", None)
        unscaled_folder = os.path.join(tempdir(), "unscaled")
        shutil.copytree(folder, unscaled_folder)
        json.dump(plain, open(os.path.join(unscaled_folder, "config.json"), "w"))
        unscaled = reference("loss", unscaled_folder, *window)["loss"]
        assert rel_diff(unscaled, expected) > 1e-3, (unscaled, expected)  # the scaling is in play
        for np_ in ranks:
            loss, proc = first_loss(folder, data, np_=np_, args=llama_args)
            assert f"rope_scaling={text}" in proc.stdout, proc.stdout
            assert rel_diff(loss, expected) < 2e-6, (folder, np_, loss, expected)

    # Import -> checkpoint -> export: config.json's rope_scaling comes back, and the model's loss.
    folder = cases[0][0]
    ckpt, out = imported_then_exported(folder, data)
    with h5py.File(ckpt, "r") as f:
        assert int(f.attrs["version"]) == 10
        assert f.attrs["model.rope_scaling"] in (LLAMA3_TEXT, LLAMA3_TEXT.encode())
    assert json.load(open(os.path.join(out, "config.json")))["rope_scaling"] == LLAMA3
    assert reference("loss", out, *window) == reference("loss", folder, *window)
    # yarn's too, its defaults written out: transformers reads the same model from them.
    _, out = imported_then_exported(cases[2][0], data)
    assert json.load(open(os.path.join(out, "config.json")))["rope_scaling"] == dict(
        YARN, attention_factor=0.1 * math.log(4) + 1, beta_fast=32.0, beta_slow=1.0, truncate=True)
    assert rel_diff(reference("loss", out, *window)["loss"], reference("loss", cases[2][0], *window)["loss"]) < 1e-12
    # Dynamic NTK (transformers 4's "type" key) raises theta only past max_position_embeddings, which
    # no sequence reaches: the plain model's loss, and the setting back in the export.
    dynamic = llama_folder("F32", seed=4, config={"rope_scaling": {"type": "dynamic", "factor": 2.0}})
    plain = llama_folder("F32", seed=4)
    loss, proc = first_loss(dynamic, data, np_=2, args=llama_args)
    assert "rope_scaling=dynamic:factor=2" in proc.stdout, proc.stdout
    assert rel_diff(loss, reference("loss", plain, *window)["loss"]) < 2e-6
    _, out = imported_then_exported(dynamic, data)
    assert json.load(open(os.path.join(out, "config.json")))["rope_scaling"] == {"rope_type": "dynamic", "factor": 2.0}
    # Nulls read as transformers reads them: factor max_position_embeddings / original (64 / 16),
    # truncate none, the others their defaults -- the model of the explicit settings.
    nulls = llama_folder("F32", seed=3, config={"rope_scaling": dict(YARN, factor=None, truncate=None, beta_fast=None,
                                                                      attention_factor=None)})
    explicit = llama_folder("F32", seed=3, config={"rope_scaling": dict(YARN, truncate=False)})
    loss, proc = first_loss(nulls, data, np_=1, args=llama_args)
    assert "rope_scaling=" + YARN_TEXT.replace("truncate=1", "truncate=0") in proc.stdout, proc.stdout
    assert rel_diff(loss, reference("loss", explicit, *window)["loss"]) < 2e-6
    # A configuration that says otherwise is refused, naming both; one that says the same (in any
    # spelling of the numbers) is the same model.
    expect_usage_error(llama_args(f"--checkpoint.init_from={folder}", "--model.rope_scaling=linear:factor=8"),
                       f"model.rope_scaling=linear:factor=8 but config.json says {LLAMA3_TEXT}")
    expect_usage_error(llama_args(f"--checkpoint.init_from={unscaled_folder}", "--model.rope_scaling=linear:factor=8"),
                       "but config.json says none")
    loss, _ = first_loss(folder, data, "--model.rope_scaling=" + LLAMA3_TEXT.replace("=8,", "=8.0,"), np_=1,
                         args=llama_args)
    assert rel_diff(loss, reference("loss", folder, *window)["loss"]) < 2e-6
    expect_usage_error(tiny_args("--model.rope_scaling=linear:factor=2"), "model.rope_scaling is not a gpt2 option")
    expect_usage_error(llama_args("--model.arch=llama", "--model.rope_scaling=longrope:factor=2"),
                       "unknown type 'longrope'")
    expect_usage_error(llama_args("--model.arch=llama", "--model.rope_scaling=yarn:factor=2"),
                       "yarn needs 'original_max_position_embeddings'")
    both = llama_folder("F32", config={"rope_scaling": LLAMA3, "rope_parameters": {"rope_type": "linear",
                                                                                     "factor": 2.0}})
    expect_usage_error(llama_args(f"--checkpoint.init_from={both}"), "rope_scaling and rope_parameters disagree")
    thetas = llama_folder("F32", config={"rope_scaling": dict(LLAMA3, rope_theta=77.0),
                                          "rope_parameters": dict(LLAMA3, rope_theta=10000.0)})
    expect_usage_error(llama_args(f"--checkpoint.init_from={thetas}"),
                       "rope_scaling and rope_parameters disagree on rope_theta")


def test_heads_of_their_own_size_give_transformers_loss_and_travel_with_the_model():
    """config.json's head_dim apart from hidden_size / num_attention_heads (Mistral-Nemo's 128 heads on
    5120 / 32; here 4 heads of 12 on a width of 40): q_proj (48, 40), o_proj (40, 48), the reference's
    loss on 1 and 2 ranks, Qwen2 (biases of 48 and 24) on 3, LoRA on q_proj and o_proj; the size goes
    into the checkpoint and back out to config.json."""
    data, window = periodic_data()
    for extras, ranks, lora in ((["head_dim=12"], (1, 2), False), (["head_dim=12", "qwen2"], (3,), False),
                                (["head_dim=12"], (2,), True)):
        folder = llama_folder("F32", extras=extras)
        expected = reference("loss", folder, *window)["loss"]
        adapters = ["--adapter.type=lora", "--adapter.targets=q_proj,o_proj", "--adapter.rank=4"] if lora else []
        for np_ in ranks:
            loss, proc = first_loss(folder, data, *adapters, np_=np_, args=llama_args)
            assert " head_dim=12" in proc.stdout, proc.stdout
            assert rel_diff(loss, expected) < 2e-6, (extras, np_, loss, expected)
    folder = llama_folder("F32", extras=["head_dim=12"])
    ckpt, out = imported_then_exported(folder, data)
    with h5py.File(ckpt, "r") as f:
        assert int(f.attrs["model.head_dim"]) == 12
    assert json.load(open(os.path.join(out, "config.json")))["head_dim"] == 12
    assert reference("equal", out, folder)["equal"]
    expect_usage_error(llama_args(f"--checkpoint.init_from={folder}", "--model.head_dim=16"),
                       "model.head_dim=16 but config.json says 12")
    expect_usage_error(llama_args("--model.arch=llama", "--model.head_dim=7"), "head size", "= 7 must be even")
    expect_usage_error(tiny_args("--model.head_dim=16"), "model.head_dim is not a gpt2 option")
    # The usual head size given explicitly is the same model (kept as 0: checkpoints compare equal).
    plain = llama_folder("F32")
    expected = reference("loss", plain, *window)["loss"]
    loss, proc = first_loss(plain, data, f"--model.head_dim={C // H}", np_=1, args=llama_args)
    assert rel_diff(loss, expected) < 2e-6 and " head_dim=" not in proc.stdout, proc.stdout


def test_llama_shape_comes_from_config_json():
    folder = llama_folder("F32")
    # Keys the configuration sets must agree with config.json; each disagreement is named.
    expect_usage_error(llama_args(f"--checkpoint.init_from={folder}", "--model.n_kv_head=4"), "model.n_kv_head=4",
                       "config.json says 2", "remove")
    expect_usage_error(tiny_args(f"--checkpoint.init_from={folder}", "--model.arch=gpt2",
                                 "--model.tie_embeddings=true", "--model.norm_eps=1e-6"),
                       "model.arch=gpt2 but config.json says llama", "model.norm_eps=1e-06 but config.json says 1e-05",
                       "model.tie_embeddings=true but config.json says false")


def test_llama_bad_folders_are_refused_naming_file_and_key():
    good = llama_folder("F32")
    weights = os.path.join(good, "model.safetensors")
    raw = open(weights, "rb").read()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])

    def variant(name, tensors=None, config=None):
        folder = os.path.join(tempdir(), name)
        shutil.copytree(good, folder)
        if tensors is not None:
            text = json.dumps(tensors).encode()
            open(os.path.join(folder, "model.safetensors"), "wb").write(
                len(text).to_bytes(8, "little") + text + raw[8 + header_len:])
        if config is not None:
            c = json.load(open(os.path.join(good, "config.json")))
            c.update(config)
            json.dump(c, open(os.path.join(folder, "config.json"), "w"))
        return folder

    cases = []
    for key, value, needle in (
            ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "rope_type 'longrope' is not implemented"),
            ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
             "needs 'original_max_position_embeddings'"),
            ("rope_scaling", {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0},
             "'low_freq_factor' is not implemented for rope_type linear"),
            ("rope_scaling", {"rope_type": "linear", "factor": -2.0}, "rope_scaling.factor -2.0 is not a positive"),
            ("rope_scaling", {"rope_type": "linear", "factor": 1e-40}, "factor='1e-40' is not a number"),
            ("rope_scaling", {"rope_type": "linear", "type": "dynamic", "factor": 2.0}, "type and rope_type differ"),
            ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}, "rope_parameters {"),
            ("head_dim", 7, "head size 7"), ("attention_bias", True, "attention_bias true"),
            ("mlp_bias", True, "mlp_bias true"), ("hidden_act", "gelu", "hidden_act 'gelu'"),
            ("num_key_value_heads", 3, "num_key_value_heads")):
        cases.append((variant(f"config-{key}", config={key: value}), ["config.json", needle, "error"]))
    missing = dict(header)  # its bytes now belong to an older file's rotary buffer, which is ignored
    missing["model.layers.0.self_attn.rotary_emb.inv_freq"] = missing.pop("lm_head.weight")
    cases.append((variant("missing", tensors=missing), ["'lm_head.weight' is missing"]))
    wrong = json.loads(json.dumps(header))
    wrong["model.layers.1.self_attn.k_proj.weight"]["shape"] = [KV * C // H * 2, C // 2]
    cases.append((variant("shape", tensors=wrong), ["model.safetensors", "model.layers.1.self_attn.k_proj.weight",
                                                    "shape [40, 20]", "[20, 40]"]))
    extra = json.loads(json.dumps(header))
    end = len(raw) - 8 - header_len  # an empty tensor after the last one keeps the data area tiled
    extra["model.layers.0.self_attn.q_proj.bias"] = {"dtype": "F32", "shape": [0], "data_offsets": [end, end]}
    cases.append((variant("unexpected", tensors=extra), ["unexpected tensor 'model.layers.0.self_attn.q_proj.bias'",
                                                         "LlamaForCausalLM"]))
    for folder, needles in cases:
        expect_usage_error(llama_args(f"--checkpoint.init_from={folder}", "--train.steps=1"), *needles)


def test_the_folders_tokenizer_goes_with_the_model_through_training_and_export():
    """A Hugging Face folder with a tokenizer.json: a run started from it takes that tokenizer as
    data.tokenizer (nothing to repeat), and `export --format hf` and `convert` put it back beside
    the model with what transformers reads: tokenizer_config.json (PreTrainedTokenizerFast),
    generation_config.json and config.json's bos/eos ids, the ids `generate` stops at, and the
    folder's chat template. The
    tokenizers package loads the exported tokenizer.json and encodes as the original does."""
    from test_datasets import TINY_TOKENIZER
    folder = hf_folder()
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(TINY_TOKENIZER, f)
    template = "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}"
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:  # transformers' own file for it
        f.write(template)
    eos = TINY_TOKENIZER["added_tokens"][0]["id"]
    d = tempdir()
    proc = run(2, tiny_args(f"--checkpoint.init_from={folder}", "--train.steps=2", f"--checkpoint.dir={d}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(os.path.join(d, "config.ini")) as f:
        assert f"tokenizer = {os.path.join(folder, 'tokenizer.json')}\n" in f.read()
    exported, converted = os.path.join(tempdir(), "out"), os.path.join(tempdir(), "conv")
    for args in (["export", os.path.join(d, "ckpt-00000002.h5"), "--format", "hf", "--output", exported],
                 ["convert", "--input", os.path.join(d, "ckpt-00000002.h5"), "--output", converted]):
        proc = run(2, args)
        assert proc.returncode == 0, proc.stderr[-2000:]
    for out in (exported, converted):
        assert sorted(os.listdir(out)) == ["chat_template.jinja", "config.json", "generation_config.json",
                                           "model.safetensors", "tokenizer.json", "tokenizer_config.json"], os.listdir(out)
        assert open(os.path.join(out, "chat_template.jinja")).read() == template
        assert open(os.path.join(out, "tokenizer.json")).read() == open(os.path.join(folder, "tokenizer.json")).read()
        config = json.load(open(os.path.join(out, "config.json")))
        assert config["eos_token_id"] == eos and config["bos_token_id"] == eos, config
        assert json.load(open(os.path.join(out, "generation_config.json"))) == {"bos_token_id": eos,
                                                                                 "eos_token_id": eos}
        tokenizer_config = json.load(open(os.path.join(out, "tokenizer_config.json")))
        assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast", tokenizer_config
        assert tokenizer_config["eos_token"] == "<|endoftext|>" and tokenizer_config["model_max_length"] == MAXT
    probe = ("import sys; from tokenizers import Tokenizer\n"
             "a, b = (Tokenizer.from_file(p) for p in sys.argv[1:])\n"
             "text = 'ab ab!<|endoftext|>ba'\n"
             "assert a.encode(text).ids == b.encode(text).ids, (a.encode(text).ids, b.encode(text).ids)\n")
    proc = subprocess.run([harness.venv_python(), "-c", probe, os.path.join(exported, "tokenizer.json"),
                           os.path.join(folder, "tokenizer.json")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_generate_warns_when_a_large_vocabulary_has_no_tokenizer():
    """A model of more than 256 ids trained without data.tokenizer: generate reads and writes bytes,
    and says so instead of printing them silently."""
    d = tempdir()
    proc = run(1, tiny_args("--model.vocab_size=512", "--train.steps=1", f"--checkpoint.dir={d}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run(1, ["generate", "--checkpoint", d, "--prompt", "ab", "--max-tokens", "2"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: the run recorded no tokenizer (data.tokenizer) and its model has 512 token ids" in proc.stderr
    d = tempdir()
    proc = run(1, tiny_args("--train.steps=1", f"--checkpoint.dir={d}"))  # bytes: 256 ids, nothing to say
    proc = run(1, ["generate", "--checkpoint", d, "--prompt", "ab", "--max-tokens", "2"])
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr

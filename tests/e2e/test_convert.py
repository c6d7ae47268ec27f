"""`shardtrain convert`: Hugging Face folders to checkpoints and back on 1, 2 and 3 ranks. Oracles
independent of the conversion: folders written by the `safetensors` package (hf_reference.py) and
compared tensor by tensor on their stored bytes (its reader; BF16 bit for bit); files compared byte
for byte with `cmp`'s semantics; checkpoints read with h5py; training losses against a run that
imports the folder itself (checkpoint.init_from=FOLDER, tested against transformers' loss in
test_hf.py); and `export --format hf`, the existing path from a checkpoint to a folder."""
import filecmp
import os

import h5py
import numpy as np

from harness import ROOT, read_metrics, run, tempdir, tiny_args
from test_bad_input import expect_usage_error, tiny_args_with_config, write_tokens
from test_hf import L, hf_folder, llama_args, llama_folder, periodic_data, reference


def convert(np_, *args):
    proc = run(np_, ["convert", *args])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "converted" in proc.stdout, proc.stdout
    return proc


def stored_tensors(folder):
    """name -> [dtype, shape, sha256 of the stored bytes] of every tensor of the folder's model.safetensors."""
    return reference("tensors", os.path.join(folder, "model.safetensors"))["tensors"]


def same_files(a, b, names=("model.safetensors", "config.json")):
    return all(filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names)


def test_folder_to_checkpoint_and_back_is_bit_identical():
    # F32 and BF16 folders the safetensors package wrote, GPT-2 (Conv1D weights, transposed on the
    # way in and out) and Llama; each on 1, 2 and 3 ranks (3 splits rows unevenly), both layouts.
    cases = [("gpt2 F32", hf_folder("F32"), "fp32"), ("llama F32", llama_folder("F32"), "fp32"),
             ("llama BF16", llama_folder("BF16", tied=True), "bf16")]
    for name, folder, dtype in cases:
        original = stored_tensors(folder)
        for np_, layout in ((1, "sharded"), (2, "gathered"), (3, "sharded")):
            ckpt = os.path.join(tempdir(), "model.h5")
            proc = convert(np_, "--input", folder, "--output", ckpt, "--layout", layout)
            assert f"{layout} layout, step 0" in proc.stdout, proc.stdout
            back = os.path.join(tempdir(), "back")
            convert(np_, "--input", ckpt, "--output", back, "--dtype", dtype)
            assert stored_tensors(back) == original, (name, np_, layout)
            # A folder this build wrote comes back byte for byte, header and config.json included.
            again_ckpt, again = os.path.join(tempdir(), "again.h5"), os.path.join(tempdir(), "again")
            convert(4 - np_, "--input", back, "--output", again_ckpt, "--layout", layout)
            convert(np_, "--input", again_ckpt, "--output", again, "--dtype", dtype)
            assert same_files(back, again), (name, np_, layout)


def test_converted_checkpoint_is_step_0_with_zero_moments():
    folder = llama_folder("F32")
    for layout in ("sharded", "gathered"):
        ckpt = os.path.join(tempdir(), "model.h5")
        convert(2, "--input", folder, "--output", ckpt, "--layout", layout)
        with h5py.File(ckpt, "r") as f:
            assert f.attrs["step"] == 0 and f.attrs["layout"].decode() == layout, dict(f.attrs)
            names = []
            f.visit(lambda n: names.append(n) if isinstance(f[n], h5py.Dataset) else None)
            moments = [n for n in names if "exp_avg" in n]
            params = [n for n in names if "exp_avg" not in n]
            assert moments and len(moments) == 2 * len(params), names
            assert all(not np.any(f[n][...]) for n in moments), "moments are not zero"
        # inspect validates every dataset's checksum, the moments' included.
        proc = run(1, ["inspect", ckpt])
        assert proc.returncode == 0 and "step 0" in proc.stdout, proc.stdout + proc.stderr


def test_training_from_the_converted_checkpoint_equals_training_from_the_folder():
    data, _ = periodic_data()
    folder = llama_folder("F32")

    def losses(np_, *extra):
        metrics = os.path.join(tempdir(), "m.jsonl")
        # inputs/llama-tiny.ini: the folder's shape (a checkpoint in init_from does not bring its shape).
        proc = run(np_, tiny_args_with_config(os.path.join(ROOT, "inputs", "llama-tiny.ini"),
                                              f"--data.train_file={data}", "--data.val_file=", "--train.steps=4",
                                              f"--train.metrics_file={metrics}", *extra))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return [r["loss"] for r in read_metrics(metrics)], proc

    for np_ in (1, 2, 3):
        ckpt = os.path.join(tempdir(), "model.h5")
        convert(np_, "--input", folder, "--output", ckpt)
        expected, _ = losses(np_, f"--checkpoint.init_from={folder}")
        got, proc = losses(np_, f"--checkpoint.init_from={ckpt}")
        assert "initialised the weights from ShardTrain checkpoint" in proc.stdout, proc.stdout
        assert got == expected, (np_, got, expected)
        if np_ == 2:  # resumed as a run's own checkpoint (it records no data, hence allow_data_change)
            got, proc = losses(np_, f"--checkpoint.resume={ckpt}", "--checkpoint.allow_data_change=true")
            assert "resumed from" in proc.stdout and "at step 0" in proc.stdout, proc.stdout
            assert got == expected, (np_, got, expected)


def test_sharded_checkpoint_of_4_ranks_converts_on_2_as_export_writes_it():
    data, _ = periodic_data()
    cases = [("gpt2", tiny_args, hf_folder("F32")), ("llama", llama_args, llama_folder("F32", tied=True))]
    for name, args, folder in cases:
        ckdir = tempdir()
        proc = run(4, args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                           "--train.steps=2", f"--checkpoint.dir={ckdir}", "--checkpoint.format=sharded"))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        ckpt = os.path.join(ckdir, "ckpt-00000002.h5")
        for np_, options in ((2, []), (3, ["--dtype", "bf16"]), (2, ["--dtype", "fp16", "--max-file-size", "20KB"])):
            converted, exported = os.path.join(tempdir(), "converted"), os.path.join(tempdir(), "exported")
            convert(np_, "--input", ckpt, "--output", converted, *options)
            proc = run(2, ["export", "--format", "hf", "--checkpoint", ckpt, "--output", exported, *options])
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert sorted(os.listdir(converted)) == sorted(os.listdir(exported)), (os.listdir(converted),
                                                                                   os.listdir(exported))
            assert same_files(converted, exported, os.listdir(exported)), (name, np_, options)
            if "--max-file-size" in options:
                assert "model.safetensors.index.json" in os.listdir(exported), os.listdir(exported)


def test_bad_input_exits_2_on_every_rank():
    folder = llama_folder("F32")
    ckpt = os.path.join(tempdir(), "model.h5")
    convert(2, "--input", folder, "--output", ckpt)
    missing = os.path.join(tempdir(), "nothing-here")
    expect_usage_error(["convert", "--input", missing, "--output", os.path.join(tempdir(), "x.h5")],
                       "--input=", "no such file or folder")
    expect_usage_error(["convert", "--input", tempdir(), "--output", os.path.join(tempdir(), "x.h5")],
                       "a folder without config.json")
    plain = os.path.join(tempdir(), "plain.bin")
    write_tokens(plain, [1, 2, 3])
    expect_usage_error(["convert", "--input", plain, "--output", os.path.join(tempdir(), "x")],
                       "not a ShardTrain checkpoint")
    expect_usage_error(["convert", "--input", folder, "--output", ckpt], "exists", "--overwrite")
    expect_usage_error(["convert", "--input", ckpt, "--output", folder], "exists", "--overwrite")
    expect_usage_error(["convert", "--input", folder, "--output", tempdir(), "--overwrite"], "is a folder")
    expect_usage_error(["convert", "--input", ckpt, "--output", ckpt, "--overwrite"], "is a file")
    out = os.path.join(tempdir(), "x.h5")
    expect_usage_error(["convert", "--input", folder, "--output", out, "--dtype", "bf16"], "--dtype applies")
    expect_usage_error(["convert", "--input", folder, "--output", out, "--layout", "flat"], "--layout='flat'")
    expect_usage_error(["convert", "--input", ckpt, "--output", out, "--layout", "gathered"], "--layout applies")
    expect_usage_error(["convert", "--input", ckpt, "--output", out, "--dtype", "fp8"], "--dtype")
    expect_usage_error(["convert", "--input", folder], "--output")
    # What the architecture does not implement, named as config.json names it.
    scaled = llama_folder("F32", config={"rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    expect_usage_error(["convert", "--input", scaled, "--output", out], "rope_scaling", "rope_type 'longrope'")
    # An INI whose model disagrees with config.json.
    ini = os.path.join(tempdir(), "model.ini")
    open(ini, "w").write(f"[model]\narch = llama\nn_layer = {L + 1}\n")
    expect_usage_error(["convert", "--input", folder, "--output", out, "--config", ini],
                       f"model.n_layer={L + 1} but config.json says {L}")
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")
    # A checkpoint with adapters: convert writes plain models.
    ckdir = tempdir()
    proc = run(2, llama_args(f"--checkpoint.init_from={folder}", "--train.steps=1", f"--checkpoint.dir={ckdir}",
                             "--adapter.type=lora", "--adapter.targets=q_proj"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    expect_usage_error(["convert", "--input", os.path.join(ckdir, "ckpt-00000001.h5"), "--output", out],
                       "lora adapters", "--merge")
    # --overwrite replaces the output.
    convert(2, "--input", folder, "--output", ckpt, "--overwrite", "--layout", "gathered")
    with h5py.File(ckpt, "r") as f:
        assert f.attrs["layout"].decode() == "gathered"


def test_a_re_export_killed_at_its_commit_leaves_one_whole_model():
    """A folder is committed whole (written as <out>.partial, then renamed or atomically exchanged):
    killed just before or just after the commit, the folder holds the old model or the new one,
    every file of one of them, never a mix; the files that are not the model's (a tokenizer) stay."""
    import subprocess
    from harness import EXE
    old, new = llama_folder("F32", seed=1), llama_folder("F32", seed=2)
    ckpt_old, ckpt_new = os.path.join(tempdir(), "old.h5"), os.path.join(tempdir(), "new.h5")
    convert(1, "--input", old, "--output", ckpt_old)
    convert(1, "--input", new, "--output", ckpt_new)
    out = os.path.join(tempdir(), "model")
    sharded = ["--max-file-size", "20KB"]  # several weight files and an index: several renames before
    export = lambda ckpt: ["export", "--format", "hf", "--checkpoint", ckpt, "--output", out, *sharded]
    assert run(1, export(ckpt_old)).returncode == 0
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write("{}")
    files = lambda: sorted(n for n in os.listdir(out) if n != "tokenizer.json")
    old_files = files()
    assert len(old_files) > 3, old_files  # config.json, the index and at least two weight files
    model_of = lambda: (reference("equal", out, old)["equal"], reference("equal", out, new)["equal"])
    assert model_of() == (True, False)
    for when, expected in (("before", (True, False)), ("after", (False, True))):
        if when == "after":  # back to the old model first
            assert run(1, export(ckpt_old)).returncode == 0
        proc = subprocess.run([EXE, *export(ckpt_new)], env={**os.environ, "SHARDTRAIN_TEST_KILL_AT_COMMIT": when},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == -9, (when, proc.returncode, proc.stderr[-2000:])
        assert model_of() == expected, when
        assert os.path.exists(os.path.join(out, "tokenizer.json")), when
    # A clean re-export commits and leaves nothing beside the folder.
    assert run(1, export(ckpt_new)).returncode == 0
    assert model_of() == (False, True) and files() == old_files
    assert open(os.path.join(out, "tokenizer.json")).read() == "{}"
    assert not os.path.exists(out + ".partial")

"""The checks every decoder built on Llama's block passes with its Hugging Face folders (Qwen2, Qwen3:
tests/e2e/test_qwen2.py, test_qwen3.py), against the reference of tests/e2e/hf_reference.py."""
import json
import os

from harness import rel_diff, run, tempdir
from test_hf import first_loss, llama_args, periodic_data, reference


def ok(proc, what=""):
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def update_config(folder, changes):
    """config.json updated with `changes`, a value of None removing the key."""
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    json.dump(config, open(path, "w"))


def train(folder, data, steps, *extra):
    """`steps` steps from the folder on 2 ranks (lr 1e-30 for one: the import alone); the last checkpoint."""
    ckdir = tempdir()
    lr = ["--train.lr=1e-30"] if steps == 1 else ["--train.lr=1e-2", "--train.warmup_steps=0"]
    ok(run(2, llama_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                         f"--train.steps={steps}", *lr, f"--checkpoint.dir={ckdir}", *extra)), "train")
    return os.path.join(ckdir, f"ckpt-{steps:08d}.h5")


def check_export_round_trip(folder, hf_class, expected_config, trained_tensors):
    """Import -> checkpoint -> export (3 ranks) gives the folder's file bit for bit and config.json's
    `expected_config` keys; after 3 steps of training the `trained_tensors` keep their dtype and shape
    and move, and the export imports again with the reference's loss."""
    data, window = periodic_data()
    out = os.path.join(tempdir(), "exported")
    proc = ok(run(3, ["export", "--format", "hf", "--checkpoint", train(folder, data, 1), "--output", out]), "export")
    assert hf_class in proc.stdout, proc.stdout
    assert reference("equal", out, folder)["equal"]
    config = json.load(open(os.path.join(out, "config.json")))
    assert {k: config.get(k, "absent") for k in expected_config} == expected_config, config
    trained = os.path.join(tempdir(), "trained")
    ok(run(2, ["export", "--format", "hf", "--checkpoint", train(folder, data, 3), "--output", trained]), "export")
    before, after = (reference("tensors", os.path.join(f, "model.safetensors"))["tensors"] for f in (folder, trained))
    for name in trained_tensors:
        assert before[name][:2] == after[name][:2], name
        assert before[name][2] != after[name][2], f"{name} did not train"
    expected_loss = reference("loss", trained, *window)["loss"]
    again, _ = first_loss(trained, data, args=llama_args)
    assert rel_diff(again, expected_loss) < 2e-6, (again, expected_loss)


def check_lora_exports_for_peft_and_merges(folder, hf_class):
    """LoRA on q/k/v for 3 steps: a PEFT folder for `hf_class`, and a merged export that is the adapted
    model -- its reference loss is not the base's, and it imports with that loss."""
    data, window = periodic_data()
    ckpt = train(folder, data, 3, "--adapter.type=lora", "--adapter.targets=q_proj,k_proj,v_proj", "--adapter.rank=4",
                 "--adapter.alpha=8")
    peft = os.path.join(tempdir(), "peft")
    ok(run(2, ["export", "--adapter", "--checkpoint", ckpt, "--output", peft]), "export --adapter")
    config = json.load(open(os.path.join(peft, "adapter_config.json")))
    assert config["auto_mapping"]["base_model_class"] == hf_class, config
    assert config["fan_in_fan_out"] is False and sorted(config["target_modules"]) == ["k_proj", "q_proj", "v_proj"]
    check_merged_export(folder, ckpt)


def check_merged_export(folder, ckpt):
    """The merged export of an adapted checkpoint trained from `folder` is the adapted model: its
    reference loss is not the base's, and it imports with that loss."""
    data, window = periodic_data()
    merged = os.path.join(tempdir(), "merged")
    ok(run(2, ["export", "--format", "hf", "--merge", "--checkpoint", ckpt, "--output", merged]), "merge")
    expected = reference("loss", merged, *window)["loss"]
    assert rel_diff(expected, reference("loss", folder, *window)["loss"]) > 1e-4
    again, _ = first_loss(merged, data, args=llama_args)
    assert rel_diff(again, expected) < 2e-6, (again, expected)

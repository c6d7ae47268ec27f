"""model.arch=qwen2 (Qwen2 / Qwen2.5 decoders: Llama's block with q/k/v biases), the family added as
its own folder plus a registry line. What the Llama tests establish holds for it, each against an
independent oracle:

- a Qwen2ForCausalLM folder imports with the loss of modeling_qwen2 computed in float64 numpy
  (hf_reference.py) on 1-3 ranks, tied and untied, F32 and BF16; Qwen2Config's defaults apply;
- import -> checkpoint -> export gives the same file bit for bit and transformers' config.json keys;
  a trained model's export (biases trained too) imports again with the reference's loss;
- training's losses do not depend on the rank count or strategy; LoRA on q/k/v trains, exports as
  a PEFT folder for Qwen2ForCausalLM and merges; greedy generation is the same on 1 and 2 ranks; a
  qwen2 teacher distils into a gpt2 student; convert turns the folder into a checkpoint and back;
- the shipped Qwen2.5-0.5B config plans.
"""
import json
import os

import numpy as np

from harness import ROOT, read_metrics, rel_diff, run, tempdir, tiny_args
from test_bad_input import expect_usage_error
from test_hf import C, H, I, KV, L, MAXT, SEQ, V, first_loss, llama_args, periodic_data, reference

QWEN_INI = os.path.join(ROOT, "inputs", "qwen2.5-0.5b.ini")


def qwen2_folder(dtype="F32", tied=False, kv=KV, seed=1, prefix="model."):
    folder = os.path.join(tempdir(), "qwen2-hf")
    reference("make-llama", folder, L, C, H, kv, I, V, MAXT, "tied" if tied else "untied", dtype, seed,
              prefix or "-", "qwen2")
    return folder


def ok(proc, what=""):
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_qwen2_import_gives_the_reference_loss():
    data, window = periodic_data()
    cases = [(qwen2_folder("F32"), (1, 2, 3), "KV=2 MLP=104 V=256 max_seq_len=64 rope_theta=1e+06 norm_eps=1e-05 "
              "untied"),
             (qwen2_folder("BF16", tied=True, seed=2, prefix=""), (2,), "KV=2 MLP=104 V=256 max_seq_len=64 "
              "rope_theta=1e+06 norm_eps=1e-05 tied")]
    for folder, ranks, summary in cases:
        expected = reference("loss", folder, *window)["loss"]
        for np_ in ranks:
            loss, proc = first_loss(folder, data, np_=np_, args=llama_args)
            assert f"Qwen2 L=2 C=40 H=4 {summary}" in proc.stdout, proc.stdout
            assert rel_diff(loss, expected) < 2e-6, (folder, np_, loss, expected)
    # Qwen2Config has no attention_bias key: q/k/v always have biases (the files hold them).
    config = json.load(open(os.path.join(cases[0][0], "config.json")))
    assert "attention_bias" not in config and config["model_type"] == "qwen2"


def test_qwen2_export_round_trips_and_trained_biases_come_back():
    data, window = periodic_data()
    folder = qwen2_folder("F32")
    ckdir = tempdir()
    ok(run(2, llama_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                         "--train.steps=1", "--train.lr=1e-30", f"--checkpoint.dir={ckdir}")), "import")
    out = os.path.join(tempdir(), "exported")
    proc = ok(run(3, ["export", "--format", "hf", "--checkpoint", os.path.join(ckdir, "ckpt-00000001.h5"),
                      "--output", out]), "export")
    assert "Qwen2ForCausalLM" in proc.stdout, proc.stdout
    assert reference("equal", out, folder)["equal"]
    config = json.load(open(os.path.join(out, "config.json")))
    expected = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": C,
                "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
                "vocab_size": V, "max_position_embeddings": MAXT, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                "rope_theta": 1e6, "use_sliding_window": False, "tie_word_embeddings": False}
    assert {k: config.get(k, "absent") for k in expected} == expected, config
    # Trained for 3 steps: the biases move, and the export imports again with the reference's loss.
    ckdir = tempdir()
    ok(run(2, llama_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                         "--train.steps=3", "--train.lr=1e-2", "--train.warmup_steps=0",
                         f"--checkpoint.dir={ckdir}")), "train")
    trained = os.path.join(tempdir(), "trained")
    ok(run(2, ["export", "--format", "hf", "--checkpoint", os.path.join(ckdir, "ckpt-00000003.h5"),
               "--output", trained]), "export trained")
    before, after = reference("tensors", os.path.join(folder, "model.safetensors")), \
        reference("tensors", os.path.join(trained, "model.safetensors"))
    for l in range(L):
        for n in "qkv":
            name = f"model.layers.{l}.self_attn.{n}_proj.bias"
            assert before["tensors"][name][:2] == after["tensors"][name][:2], name
            assert before["tensors"][name][2] != after["tensors"][name][2], f"{name} did not train"
    expected_loss = reference("loss", trained, *window)["loss"]
    again, _ = first_loss(trained, data, args=llama_args)
    assert rel_diff(again, expected_loss) < 2e-6, (again, expected_loss)


def qwen2_train_args(*overrides):
    args = tiny_args("--model.arch=qwen2", *overrides)
    args[args.index("--config") + 1] = os.path.join(ROOT, "inputs", "llama-tiny.ini")
    return args


def losses(np_, *options):
    metrics = os.path.join(tempdir(), "m.jsonl")
    ok(run(np_, qwen2_train_args("--train.steps=4", f"--train.metrics_file={metrics}", *options)), str(options))
    return [r["loss"] for r in read_metrics(metrics)]


def test_qwen2_losses_do_not_depend_on_ranks_or_strategy():
    one = losses(1)
    assert one[-1] < one[0], one
    for np_, strategy in ((2, "FULL_SHARD"), (3, "SHARD_GRAD_OP"), (4, "HYBRID_SHARD")):
        extra = ["--fsdp.shard_group_size=2"] if strategy == "HYBRID_SHARD" else []
        other = losses(np_, f"--fsdp.sharding_strategy={strategy}", *extra)
        assert all(rel_diff(a, b) < 1e-5 for a, b in zip(one, other)), (np_, strategy, one, other)
    # Freezing part of the fused q|k|v bias is refused like the fused weights.
    expect_usage_error(qwen2_train_args("--train.freeze=layers.0.self_attn.k_proj.bias"),
                       "q_proj|k_proj|v_proj biases", "all of the group or none")


def test_qwen2_lora_exports_for_peft_and_merges():
    data, window = periodic_data()
    folder = qwen2_folder("F32", seed=5)
    ckdir = tempdir()
    lora = ["--adapter.type=lora", "--adapter.targets=q_proj,k_proj,v_proj", "--adapter.rank=4", "--adapter.alpha=8"]
    ok(run(2, llama_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                         "--train.steps=3", "--train.lr=1e-2", "--train.warmup_steps=0", f"--checkpoint.dir={ckdir}",
                         *lora)), "lora")
    ckpt = os.path.join(ckdir, "ckpt-00000003.h5")
    peft = os.path.join(tempdir(), "peft")
    ok(run(2, ["export", "--adapter", "--checkpoint", ckpt, "--output", peft]), "export --adapter")
    config = json.load(open(os.path.join(peft, "adapter_config.json")))
    assert config["auto_mapping"]["base_model_class"] == "Qwen2ForCausalLM", config
    assert config["fan_in_fan_out"] is False and sorted(config["target_modules"]) == ["k_proj", "q_proj", "v_proj"]
    merged = os.path.join(tempdir(), "merged")
    ok(run(2, ["export", "--format", "hf", "--merge", "--checkpoint", ckpt, "--output", merged]), "merge")
    # The merged model is the adapted one: its reference loss differs from the base's, and it
    # imports with that loss.
    expected = reference("loss", merged, *window)["loss"]
    assert rel_diff(expected, reference("loss", folder, *window)["loss"]) > 1e-4
    again, _ = first_loss(merged, data, args=llama_args)
    assert rel_diff(again, expected) < 2e-6, (again, expected)


def test_qwen2_generates_distils_and_converts():
    ckdir = tempdir()
    ok(run(2, qwen2_train_args("--train.steps=6", f"--checkpoint.dir={ckdir}")), "train")
    ckpt = os.path.join(ckdir, "ckpt-00000006.h5")
    texts = [ok(run(np_, ["generate", "--checkpoint", ckpt, "--prompt", "Once upon", "--max-tokens", "12",
                          "--temperature", "0"]), "generate").stdout for np_ in (1, 2)]
    assert texts[0] == texts[1] and texts[0].startswith("Once upon") and len(texts[0]) > len("Once upon"), texts
    # A qwen2 teacher for a gpt2 student: the same losses on 1 and 2 ranks.
    student = []
    for np_ in (1, 2):
        metrics = os.path.join(tempdir(), "m.jsonl")
        ok(run(np_, tiny_args("--train.steps=2", f"--train.metrics_file={metrics}", f"--distill.teacher={ckpt}",
                              "--distill.alpha=0.5")), "distill")
        student.append([r["loss"] for r in read_metrics(metrics)])
    assert all(rel_diff(a, b) < 1e-5 for a, b in zip(*student)), student
    # convert: folder -> checkpoint -> folder, bit for bit.
    folder = qwen2_folder("BF16", tied=True, seed=3)
    converted, back = os.path.join(tempdir(), "model.h5"), os.path.join(tempdir(), "back")
    ok(run(2, ["convert", "--input", folder, "--output", converted]), "convert in")
    ok(run(3, ["convert", "--input", converted, "--output", back, "--dtype", "bf16"]), "convert out")
    assert reference("equal", back, folder)["equal"]


def test_qwen25_05b_config_plans_the_real_parameter_count():
    proc = ok(run(1, ["plan", "--config", QWEN_INI, "--world-size=4"]), "plan")
    # Qwen2.5-0.5B: 494,032,768 parameters (tied embeddings; exact in the unit tests).
    assert "Qwen2 L=24 C=896 H=14 KV=2 MLP=4864 V=151936 max_seq_len=32768 rope_theta=1e+06 norm_eps=1e-06 tied " \
           "(494.0M parameters)" in proc.stdout, proc.stdout

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

from harness import ROOT, read_metrics, rel_diff, run, tempdir, tiny_args
from llama_variants import check_export_round_trip, check_lora_exports_for_peft_and_merges, ok
from test_bad_input import expect_usage_error
from test_hf import C, H, I, KV, L, MAXT, V, first_loss, llama_args, periodic_data, reference

QWEN_INI = os.path.join(ROOT, "inputs", "qwen2.5-0.5b.ini")


def qwen2_folder(dtype="F32", tied=False, kv=KV, seed=1, prefix="model."):
    folder = os.path.join(tempdir(), "qwen2-hf")
    reference("make-llama", folder, L, C, H, kv, I, V, MAXT, "tied" if tied else "untied", dtype, seed,
              prefix or "-", "qwen2")
    return folder



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
    expected = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": C,
                "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
                "vocab_size": V, "max_position_embeddings": MAXT, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                "rope_theta": 1e6, "use_sliding_window": False, "tie_word_embeddings": False}
    check_export_round_trip(qwen2_folder("F32"), "Qwen2ForCausalLM", expected,
                            [f"model.layers.{l}.self_attn.{n}_proj.bias" for l in range(L) for n in "qkv"])


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
    check_lora_exports_for_peft_and_merges(qwen2_folder("F32", seed=5), "Qwen2ForCausalLM")


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

"""model.arch=qwen3 (dense Qwen3 decoders: Llama's block with an RMSNorm over each query and key head
before the rotary turn, heads of their own size), the family added as its own folder plus a registry
line on the Llama model. Each property against an independent oracle:

- a Qwen3ForCausalLM folder imports with the loss of modeling_qwen3 computed in float64 numpy
  (hf_reference.py) on 1-3 ranks, untied F32 and tied BF16, heads of their own size or the usual;
- import -> checkpoint -> export gives the same file bit for bit and transformers' config.json keys;
  a trained model's export (the q/k norms trained too) imports again with the reference's loss;
- training's losses do not depend on the rank count; LoRA on q/k/v trains, exports as a PEFT folder
  for Qwen3ForCausalLM and merges; greedy generation is the same on 1 and 2 ranks;
- what Qwen3's attention has and ShardTrain does not (biases, a sliding window on some layers only) is
  refused, exit 2; a window on every layer gives the reference's loss and exports back;
- the shipped Qwen3-0.6B config plans its published parameter count.
"""
import json
import os

from harness import ROOT, read_metrics, rel_diff, run, tempdir, tiny_args
from llama_variants import check_export_round_trip, check_lora_exports_for_peft_and_merges, ok, update_config
from test_bad_input import expect_usage_error
from test_hf import C, H, I, KV, L, MAXT, first_loss, llama_args, periodic_data, reference

QWEN3_INI = os.path.join(ROOT, "inputs", "qwen3-0.6b.ini")


def qwen3_folder(dtype="F32", tied=False, seed=1, head_dim=12, config=None):
    """A random Qwen3 folder (head_dim written, as Qwen3's files do); `config` updates config.json,
    a value of None removing the key."""
    folder = os.path.join(tempdir(), "qwen3-hf")
    extras = ["qwen3"] + ([f"head_dim={head_dim}"] if head_dim else [])
    reference("make-llama", folder, L, C, H, KV, I, 256, MAXT, "tied" if tied else "untied", dtype, seed, "model.",
              ",".join(extras))
    update_config(folder, config or {})
    return folder



def test_qwen3_import_gives_the_reference_loss():
    data, window = periodic_data()
    cases = [(qwen3_folder("F32"), (1, 2, 3), "KV=2 MLP=104 V=256 max_seq_len=64 rope_theta=1e+06 norm_eps=1e-05 "
              "untied head_dim=12"),
             (qwen3_folder("BF16", tied=True, seed=2, head_dim=None), (2,), "KV=2 MLP=104 V=256 max_seq_len=64 "
              "rope_theta=1e+06 norm_eps=1e-05 tied")]
    for folder, ranks, summary in cases:
        expected = reference("loss", folder, *window)["loss"]
        for np_ in ranks:
            loss, proc = first_loss(folder, data, np_=np_, args=llama_args)
            assert f"Qwen3 L=2 C=40 H=4 {summary}" in proc.stdout, proc.stdout
            assert rel_diff(loss, expected) < 2e-6, (folder, np_, loss, expected)
    # Qwen3Config's head size, when config.json has no head_dim, is 128 -- not hidden_size / heads.
    folder = qwen3_folder("F32", seed=3, head_dim=128, config={"head_dim": None})
    loss, proc = first_loss(folder, data, np_=2, args=llama_args)
    assert "head_dim=128" in proc.stdout, proc.stdout
    assert rel_diff(loss, reference("loss", folder, *window)["loss"]) < 2e-6


def test_qwen3_export_round_trips_and_trained_norms_come_back():
    expected = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": C,
                "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
                "head_dim": 12, "vocab_size": 256, "max_position_embeddings": MAXT, "hidden_act": "silu",
                "rms_norm_eps": 1e-5, "rope_theta": 1e6, "attention_bias": False, "use_sliding_window": False,
                "tie_word_embeddings": False}
    check_export_round_trip(qwen3_folder("F32"), "Qwen3ForCausalLM", expected,
                            [f"model.layers.{l}.self_attn.{n}_norm.weight" for l in range(L) for n in "qk"])


def qwen3_train_args(*overrides):
    args = tiny_args("--model.arch=qwen3", "--model.head_dim=12", *overrides)
    args[args.index("--config") + 1] = os.path.join(ROOT, "inputs", "llama-tiny.ini")
    return args


def test_qwen3_losses_do_not_depend_on_ranks_and_it_generates():
    runs = []
    for np_, extra in ((1, []), (2, []), (3, ["--fsdp.sharding_strategy=SHARD_GRAD_OP"])):
        metrics, ckdir = os.path.join(tempdir(), "m.jsonl"), tempdir()
        ok(run(np_, qwen3_train_args("--train.steps=4", f"--train.metrics_file={metrics}",
                                     f"--checkpoint.dir={ckdir}", *extra)), str(np_))
        runs.append([r["loss"] for r in read_metrics(metrics)])
    assert len(runs[0]) == 4 and runs[0][-1] < runs[0][0], runs[0]
    for other in runs[1:]:
        assert len(other) == len(runs[0]), runs
        assert all(rel_diff(a, b) < 1e-5 for a, b in zip(runs[0], other)), runs
    ckpt = os.path.join(ckdir, "ckpt-00000004.h5")
    texts = [ok(run(np_, ["generate", "--checkpoint", ckpt, "--prompt", "Once upon", "--max-tokens", "12",
                          "--temperature", "0"]), "generate").stdout for np_ in (1, 2)]
    assert texts[0] == texts[1] and texts[0].startswith("Once upon") and len(texts[0]) > len("Once upon"), texts


def test_qwen3_lora_exports_for_peft_and_merges():
    check_lora_exports_for_peft_and_merges(qwen3_folder("F32", seed=5), "Qwen3ForCausalLM")


def test_qwen3_refuses_what_it_does_not_implement():
    """Biases, and a sliding window that some layers use and others not and some sequence reaches
    (Qwen3Config's: sliding_window 4096 when absent, on the layers from max_window_layers, 28 when
    absent, or those layer_types names); a window no layer uses reads as the model it is, and one
    on every layer as model.sliding_window, giving the reference's loss."""
    data, window = periodic_data()
    for config, needle in (
            ({"attention_bias": True}, "attention_bias true is not implemented"),
            ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "16 positions on 1 of the 2"),
            ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": None,
              "layer_types": ["full_attention", "sliding_attention"]}, "16 positions on 1 of the 2")):
        folder = qwen3_folder("F32", config=config)
        expect_usage_error(llama_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}",
                                      "--data.val_file=", "--train.steps=1"), needle, "config.json")
    # max_window_layers null (not absent) with no layer_types: transformers' TypeError, our one line.
    folder = qwen3_folder("F32", config={"use_sliding_window": True, "sliding_window": 16, "layer_types": None})
    with open(os.path.join(folder, "config.json")) as f:
        written = json.load(f)
    written["max_window_layers"] = None  # JSON null
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(written, f)
    expect_usage_error(llama_args(f"--checkpoint.init_from={folder}", f"--data.train_file={data}", "--data.val_file=",
                                  "--train.steps=1"), "max_window_layers null is not a whole number >= 0", "config.json")
    # The window on no layer (max_window_layers = num_hidden_layers, as Qwen's released files say):
    # the reference's loss, which has none.
    folder = qwen3_folder("F32", config={"use_sliding_window": True, "sliding_window": 16, "max_window_layers": L})
    loss, _ = first_loss(folder, data, args=llama_args)
    assert rel_diff(loss, reference("loss", folder, *window)["loss"]) < 2e-6
    # On every layer (max_window_layers 0, or layer_types): a window of 5 that the sequence reaches.
    for config in ({"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0},
                   {"use_sliding_window": True, "sliding_window": 5, "layer_types": ["sliding_attention"] * L}):
        folder = qwen3_folder("F32", config=config)
        loss, proc = first_loss(folder, data, args=llama_args)
        assert "sliding_window=5" in proc.stdout, proc.stdout
        assert rel_diff(loss, reference("loss", folder, *window)["loss"]) < 2e-6
    # ... and exported back as Qwen3Config reads it: every layer's type written out.
    check_export_round_trip(folder, "Qwen3ForCausalLM",
                            {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0,
                             "layer_types": ["sliding_attention"] * L}, ["model.layers.0.self_attn.q_proj.weight"])


def test_qwen3_06b_config_plans_the_real_parameter_count():
    proc = ok(run(1, ["plan", "--config", QWEN3_INI, "--world-size=4"]), "plan")
    # Qwen3-0.6B: 596,049,920 parameters (tied embeddings; exact in the unit tests).
    assert "Qwen3 L=28 C=1024 H=16 KV=8 MLP=3072 V=151936 max_seq_len=40960 rope_theta=1e+06 norm_eps=1e-06 tied " \
           "head_dim=128 (596.0M parameters)" in proc.stdout, proc.stdout

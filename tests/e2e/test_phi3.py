"""model.arch=phi3 (Phi-3 and Phi-4 decoders: Llama's block, whose Hugging Face files fuse q|k|v into
qkv_proj and gate|up into gate_up_proj), the family added as its own folder plus a registry line on
the Llama model. Each property against an independent oracle:

- a Phi3ForCausalLM folder imports with the loss computed in float64 numpy (hf_reference.py, which
  splits the fused tensors as Phi3Attention and Phi3MLP slice them; checked against transformers 5.24's
  Phi3ForCausalLM to 7e-9) on 1-3 ranks, F32 and BF16;
- import -> checkpoint -> export gives the same fused tensors bit for bit and Phi3Config's keys; a
  trained model's export imports again with the reference's loss;
- LoRA on q/k/v merges into the fused tensors (the merged folder's reference loss); their adapters
  have no PEFT form (PEFT adapts qkv_proj as one layer) and are refused with one line, while LoRA on
  o_proj and down_proj exports as a PEFT folder;
- training's losses do not depend on the rank count, and greedy generation is the same on 1 and 2 ranks;
- a window on every layer gives the reference's loss and exports back; what Phi-3.5 and Phi-4-mini
  add (a partial rotary factor, LongRoPE) is refused, exit 2;
- the shipped Phi-3-mini-4k shape plans its published parameter count.
"""
import json
import os

from harness import ROOT, read_metrics, rel_diff, run, tempdir, tiny_args
from llama_variants import check_export_round_trip, check_merged_export, ok, train, update_config
from test_bad_input import expect_usage_error
from test_hf import C, H, I, KV, L, MAXT, first_loss, llama_args, periodic_data, reference


def phi3_folder(dtype="F32", seed=1, config=None):
    """A random Phi-3 folder; `config` updates config.json, a value of None removing the key."""
    folder = os.path.join(tempdir(), "phi3-hf")
    reference("make-llama", folder, L, C, H, KV, I, 256, MAXT, "untied", dtype, seed, "model.", "phi3")
    update_config(folder, config or {})
    return folder


def test_phi3_import_gives_the_reference_loss():
    data, window = periodic_data()
    for folder, ranks in ((phi3_folder("F32"), (1, 2, 3)), (phi3_folder("BF16", seed=2), (2,))):
        expected = reference("loss", folder, *window)["loss"]
        for np_ in ranks:
            loss, proc = first_loss(folder, data, np_=np_, args=llama_args)
            assert "Phi-3 L=2 C=40 H=4 KV=2 MLP=104 V=256 max_seq_len=64" in proc.stdout, proc.stdout
            assert rel_diff(loss, expected) < 2e-6, (folder, np_, loss, expected)


def test_phi3_export_round_trips_its_fused_tensors():
    expected = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": C, "intermediate_size": I,
                "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV, "vocab_size": 256,
                "max_position_embeddings": MAXT, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "partial_rotary_factor": 1.0, "resid_pdrop": 0.0, "sliding_window": None, "tie_word_embeddings": False}
    check_export_round_trip(phi3_folder("F32"), "Phi3ForCausalLM", expected,
                            [f"model.layers.{l}.{n}" for l in range(L)
                             for n in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")])


def test_phi3_lora_merges_into_the_fused_tensors_and_peft_takes_the_unfused_layers():
    data, _ = periodic_data()
    folder = phi3_folder("F32", seed=5)
    lora = ("--adapter.type=lora", "--adapter.rank=4", "--adapter.alpha=8")
    ckpt = train(folder, data, 3, *lora, "--adapter.targets=q_proj,k_proj,v_proj,gate_proj")
    check_merged_export(folder, ckpt)
    expect_usage_error(["export", "--adapter", "--checkpoint", ckpt, "--output", os.path.join(tempdir(), "peft")],
                       "stores self_attn.q_proj as rows of 'model.layers.0.self_attn.qkv_proj.weight'", "--merge")
    ckpt = train(folder, data, 3, *lora, "--adapter.targets=o_proj,down_proj")
    peft = os.path.join(tempdir(), "peft")
    ok(run(2, ["export", "--adapter", "--checkpoint", ckpt, "--output", peft]), "export --adapter")
    config = json.load(open(os.path.join(peft, "adapter_config.json")))
    assert config["auto_mapping"]["base_model_class"] == "Phi3ForCausalLM", config
    assert sorted(config["target_modules"]) == ["down_proj", "o_proj"], config


def test_phi3_window_and_what_it_refuses():
    data, window = periodic_data()
    folder = phi3_folder("F32", seed=3, config={"sliding_window": 5})
    loss, proc = first_loss(folder, data, args=llama_args)
    assert "sliding_window=5" in proc.stdout, proc.stdout
    assert rel_diff(loss, reference("loss", folder, *window)["loss"]) < 2e-6
    assert rel_diff(loss, reference("loss", phi3_folder("F32", seed=3), *window)["loss"]) > 1e-4
    check_export_round_trip(folder, "Phi3ForCausalLM", {"sliding_window": 5}, ["model.layers.0.mlp.down_proj.weight"])
    for config, needle in (({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75 is not implemented"),
                           ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 5,
                                              "long_factor": [1.0] * 5}}, "longrope")):
        bad = phi3_folder("F32", config=config)
        expect_usage_error(llama_args(f"--checkpoint.init_from={bad}", f"--data.train_file={data}", "--data.val_file=",
                                      "--train.steps=1"), needle, "config.json")


def test_phi3_trains_the_same_on_any_rank_count_and_generates():
    runs = []
    for np_ in (1, 2):
        metrics, ckdir = os.path.join(tempdir(), "m.jsonl"), tempdir()
        args = tiny_args("--model.arch=phi3", "--train.steps=4", f"--train.metrics_file={metrics}",
                         f"--checkpoint.dir={ckdir}")
        args[args.index("--config") + 1] = os.path.join(ROOT, "inputs", "llama-tiny.ini")
        ok(run(np_, args), str(np_))
        runs.append([r["loss"] for r in read_metrics(metrics)])
    assert len(runs[0]) == 4 and runs[0][-1] < runs[0][0], runs[0]
    assert all(rel_diff(a, b) < 1e-5 for a, b in zip(*runs)), runs
    ckpt = os.path.join(ckdir, "ckpt-00000004.h5")
    texts = [ok(run(np_, ["generate", "--checkpoint", ckpt, "--prompt", "Once upon", "--max-tokens", "12",
                          "--temperature", "0"]), "generate").stdout for np_ in (1, 2)]
    assert texts[0] == texts[1] and texts[0].startswith("Once upon") and len(texts[0]) > len("Once upon"), texts


def test_phi3_mini_config_plans_the_real_parameter_count():
    proc = ok(run(1, ["plan", "--config", os.path.join(ROOT, "inputs", "phi3-mini-4k.ini"), "--world-size=4"]))
    assert "Phi-3 L=32 C=3072 H=32 KV=32 MLP=8192 V=32064" in proc.stdout, proc.stdout
    assert "(3821.1M parameters)" in proc.stdout, proc.stdout

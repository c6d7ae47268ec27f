"""model.arch=smollm3 (SmolLM3: Llama's block with no rotary embeddings in some blocks, NoPE), the family
added as its own folder plus a registry line on the Llama model. Each property against an independent
oracle, modeling_smollm3's forward in float64 numpy (hf_reference.py):

- a SmolLM3ForCausalLM folder imports with the reference's loss on 1 and 2 ranks, with no_rope_layers
  listed or left to no_rope_layer_interval, and that loss is not the all-rotary model's;
- import -> checkpoint -> export gives the same file bit for bit and transformers' config.json keys;
  a trained model's export imports again with the reference's loss; LoRA exports for PEFT and merges;
- a sliding window over the NoPE blocks only is refused, exit 2, one over every block gives the
  reference's loss; model.nope_layers is checked and kept;
- the shipped SmolLM3-3B config plans its published parameter count.
"""
import os

from harness import ROOT, rel_diff, run, tempdir
from llama_variants import check_export_round_trip, check_lora_exports_for_peft_and_merges, ok, update_config
from test_bad_input import expect_usage_error
from test_hf import C, H, I, KV, L, MAXT, first_loss, llama_args, periodic_data, reference

SMOLLM3_INI = os.path.join(ROOT, "inputs", "smollm3-3b.ini")


def smollm3_folder(seed=1, config=None):
    """A random SmolLM3 folder (tied; block L-1 without rotary embeddings); `config` updates
    config.json, a value of None removing the key."""
    folder = os.path.join(tempdir(), "smollm3-hf")
    reference("make-llama", folder, L, C, H, KV, I, 256, MAXT, "tied", "F32", seed, "model.", "smollm3")
    update_config(folder, config or {})
    return folder


def test_smollm3_import_gives_the_reference_loss():
    data, window = periodic_data()
    listed = smollm3_folder()
    by_interval = smollm3_folder(config={"no_rope_layers": None, "no_rope_layer_interval": L})  # the same blocks
    expected = reference("loss", listed, *window)["loss"]
    assert reference("loss", by_interval, *window)["loss"] == expected
    rotary = smollm3_folder(config={"no_rope_layers": [1] * L})
    assert rel_diff(reference("loss", rotary, *window)["loss"], expected) > 1e-4  # the NoPE block is in play
    for folder, ranks in ((listed, (1, 2)), (by_interval, (2,))):
        for np_ in ranks:
            loss, proc = first_loss(folder, data, np_=np_, args=llama_args)
            assert f"SmolLM3 L=2 C=40 H=4 KV=2 MLP=104 V=256 max_seq_len=64 rope_theta=5e+06 norm_eps=1e-05 tied " \
                   f"nope_layers={L - 1}" in proc.stdout, proc.stdout
            assert rel_diff(loss, expected) < 2e-6, (folder, np_, loss, expected)
    loss, _ = first_loss(rotary, data, args=llama_args)
    assert rel_diff(loss, reference("loss", rotary, *window)["loss"]) < 2e-6
    # Without rope_theta, SmolLM3Config's default_theta (2e6), not Llama's 10000.
    default_theta = smollm3_folder(config={"rope_theta": None})
    loss, proc = first_loss(default_theta, data, args=llama_args)
    assert "rope_theta=2e+06" in proc.stdout, proc.stdout
    assert rel_diff(loss, reference("loss", default_theta, *window)["loss"]) < 2e-6


def test_smollm3_export_round_trips_lora_merges_and_the_setting_is_kept():
    expected = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": C,
                "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
                "no_rope_layers": [1] * (L - 1) + [0], "rope_theta": 5e6, "use_sliding_window": False,
                "tie_word_embeddings": True, "pad_token_id": None}
    check_export_round_trip(smollm3_folder(), "SmolLM3ForCausalLM", expected,
                            [f"model.layers.{l}.self_attn.o_proj.weight" for l in range(L)])
    check_lora_exports_for_peft_and_merges(smollm3_folder(seed=5), "SmolLM3ForCausalLM")
    # The folder's NoPE blocks against a configuration that says otherwise: refused, naming both.
    data, _ = periodic_data()
    expect_usage_error(llama_args(f"--checkpoint.init_from={smollm3_folder()}", f"--data.train_file={data}",
                                  "--model.nope_layers=0"), "model.nope_layers=0 but config.json says 1")
    expect_usage_error(llama_args("--model.arch=smollm3", "--model.nope_layers=1,"), "ends with a comma")
    expect_usage_error(llama_args("--model.arch=smollm3", "--model.nope_layers=0,2"),
                       "model.nope_layers='0,2': '2' is not a block index in [0, 2)")
    expect_usage_error(llama_args("--model.arch=llama", "--model.nope_layers=1"),
                       "model.nope_layers is not a llama option")


def test_smollm3_reads_a_sliding_window_and_plans_the_real_model():
    data, window = periodic_data()
    # transformers slides it over the NoPE blocks, or those layer_types names: some blocks only is
    # refused; a window on none is read, and one on every block as model.sliding_window.
    expect_usage_error(llama_args(f"--checkpoint.init_from={smollm3_folder(config={'use_sliding_window': True, 'sliding_window': 16})}",
                                  f"--data.train_file={data}", "--data.val_file=", "--train.steps=1"),
                       "16 positions on 1 of the 2", "config.json")
    first_loss(smollm3_folder(config={"use_sliding_window": True, "sliding_window": 16,
                                      "layer_types": ["full_attention"] * L}), data, args=llama_args)
    folder = smollm3_folder(config={"use_sliding_window": True, "sliding_window": 5,
                                    "layer_types": ["sliding_attention"] * L})
    loss, proc = first_loss(folder, data, args=llama_args)
    assert "sliding_window=5" in proc.stdout, proc.stdout
    assert rel_diff(loss, reference("loss", folder, *window)["loss"]) < 2e-6
    proc = ok(run(1, ["plan", "--config", SMOLLM3_INI, "--world-size=8"]), "plan")
    # SmolLM3-3B: 3,075,098,624 parameters (tied; exact in the unit tests).
    assert "SmolLM3 L=36 C=2048 H=16 KV=4 MLP=11008 V=128256 max_seq_len=65536 rope_theta=5e+06 norm_eps=1e-06 tied " \
           "nope_layers=3,7,11,15,19,23,27,31,35 (3075.1M parameters)" in proc.stdout, proc.stdout

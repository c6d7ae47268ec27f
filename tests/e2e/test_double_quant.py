"""Double quantization held in memory (fsdp.double_quant, docs/quantization.md): each NF4/FP4 block's
absmax as an 8-bit code of absmax - offset over bitsandbytes' dynamic map, per weight an offset and
per 256 blocks a scale. The oracles:

- bitsandbytes itself: quant_reference.py's numpy double quantization decodes the fixture that
  bitsandbytes wrote bit for bit, and codes its absmax as bitsandbytes does (or nearer);
- the same training on the dequantized base in full precision: LoRA on a double-quantized base gives,
  bit for bit, the losses of LoRA on the base whose linear weights numpy replaced by their
  double-quantized dequantization -- on 1 to 4 ranks, including weights of several groups of 256
  blocks that the ranks' shards cut through, and partial blocks;
- the uninterrupted run: a resume from a full checkpoint is bit for bit;
- the formula: 33 bytes per block of 64 plus the replicated table, and the plan is what was allocated;
- h5py: the checkpoint's records and nested tables are the numpy reference's codes, offsets and scales."""
import functools
import os
import shutil

import numpy as np

from harness import read_metrics, run, run_single, tempdir, tiny_args
from quant_reference import (dequantize_4bit, dequantize_bnb_tensor, double_dequantize, double_quantize, pack_4bit,
                             quantize_4bit, quantize_dequantize)
from test_bad_input import expect_usage_error
from test_checkpoint_edges import meta_checksum
from test_freeze import latest
from test_llama import ok
from test_quantization import (BASE, BASE_MODEL, BNB_FOLDERS, SAVE_AT, fixture_tensors, folder_tensors, load_file,
                               qlora_args, quantized_names, save_file, training)

DQ = ("--fsdp.frozen_dtype=nf4", "--fsdp.double_quant=true")


@functools.lru_cache(maxsize=None)
def dynamic_map():
    """bitsandbytes' signed dynamic map, as it wrote it into the fixture."""
    return fixture_tensors()["nf4.nested.nested_quant_map"]


def test_the_numpy_double_quantization_is_bitsandbytes():
    f = fixture_tensors()
    for quant_type in ("nf4", "fp4"):
        key = quant_type + ".nested"
        codes, absmax = quantize_4bit(f[key + ".input"], quant_type, 64)
        # bitsandbytes' own codes decode to its own dequantized values through our formula.
        theirs = double_dequantize(f[key + ".absmax"].astype(np.int64), f[key + ".nested_absmax"],
                                   f[key + ".offset"][0], dynamic_map())
        got = dequantize_4bit(codes, theirs, quant_type, 64)
        assert np.array_equal(got.view(np.uint32), f[key + ".dequant"].view(np.uint32)), key
        # Our coding: the offset within one unit in the last place of torch's fp32 mean; each code
        # as near as bitsandbytes' or nearer (its CPU search sometimes takes the one below).
        ours, scales, offset = double_quantize(absmax, dynamic_map())
        assert abs(int(offset.view(np.int32)) - int(f[key + ".offset"].view(np.int32)[0])) <= 1, key
        assert scales.size == 2 and np.allclose(scales, f[key + ".nested_absmax"], rtol=1e-6), key
        scaled = (absmax - offset) / np.repeat(scales, 256)[:absmax.size]
        near_ours = np.abs(scaled - dynamic_map()[ours])
        near_theirs = np.abs(scaled - dynamic_map()[f[key + ".absmax"].astype(np.int64)])
        assert np.all(near_ours <= near_theirs) and np.sum(ours != f[key + ".absmax"]) <= 2, key


@functools.lru_cache(maxsize=None)
def dq_base(quant_type="nf4", block=64):
    """The fixture base with each linear weight replaced by its double-quantized dequantization."""
    d = tempdir()
    shutil.copy(os.path.join(BASE, "config.json"), d)
    tensors = load_file(os.path.join(BASE, "model.safetensors"))
    for name in quantized_names(tensors):
        tensors[name] = quantize_dequantize(tensors[name], quant_type, block, dynamic_map())
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    return d


def test_a_double_quantized_base_trains_as_its_dequantized_weights_bit_for_bit():
    for np_, extra in ((1, ()), (2, ()), (3, ()), (2, ("--fsdp.param_dtype=bf16",))):
        got = training(np_, BASE, *DQ, *extra)[0]
        assert got == training(np_, dq_base(), *extra)[0], (np_, extra)
    plain = training(2, BASE, "--fsdp.frozen_dtype=nf4")[0]
    assert training(2, BASE, *DQ)[0] != plain  # the coded absmax matter
    assert training(2, BASE, "--fsdp.frozen_dtype=fp4", "--fsdp.double_quant=true")[0] == training(2, dq_base("fp4"))[0]
    assert (training(2, BASE, *DQ, "--fsdp.quant_block=32")[0] == training(2, dq_base("nf4", 32))[0])
    for np_, options in ((2, ("--fsdp.sharding_strategy=SHARD_GRAD_OP",)), (3, ("--fsdp.cpu_offload=true",)),
                         (4, ("--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2",
                              "--train.global_batch=8"))):
        assert training(np_, BASE, *DQ, *options)[0] == training(np_, dq_base(), *options)[0], options


@functools.lru_cache(maxsize=None)
def wide_gpt2_folders():
    """A GPT-2 of width 100 as a Hugging Face folder, and the same with each block's linear weights
    double-quantized and dequantized by numpy: c_fc (400 x 100) is 625 blocks in 3 groups of 256,
    c_attn ends in a partial block, and the shards of 2, 3 and 4 ranks cut through groups."""
    d = tempdir()
    ok(run(1, tiny_args("--model.n_embd=100", "--train.steps=1", f"--checkpoint.dir={d}")), "gpt2-100")
    folder = os.path.join(tempdir(), "gpt2-100")
    ok(run(1, ["export", "--format", "hf", "--checkpoint", latest(d), "--output", folder]), "export")
    reference = os.path.join(tempdir(), "gpt2-100-dq")
    shutil.copytree(folder, reference)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    names = [n for n in tensors if n.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight"))]
    assert len(names) == 2 * 4, names
    for name in names:  # GPT-2's Conv1D weights are stored transposed; ours, which are quantized, are (out, in)
        tensors[name] = np.ascontiguousarray(quantize_dequantize(tensors[name].T, "nf4", 64, dynamic_map()).T)
    save_file(tensors, os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
    return folder, reference


def test_weights_of_several_groups_cut_by_the_shards_train_as_their_dequantized_values():
    folder, reference = wide_gpt2_folders()
    lora = ("--model.n_embd=100", "--adapter.type=lora", "--adapter.targets=attn.c_attn,mlp.c_proj", "--adapter.rank=4",
            "--train.steps=3", "--checkpoint.save=false")
    for np_ in (1, 2, 3, 4):
        metrics = [os.path.join(tempdir(), f"{k}.jsonl") for k in range(2)]
        ok(run(np_, tiny_args(f"--checkpoint.init_from={folder}", *lora, *DQ, f"--train.metrics_file={metrics[0]}")))
        ok(run(np_, tiny_args(f"--checkpoint.init_from={reference}", *lora, f"--train.metrics_file={metrics[1]}")))
        got, want = ([r["loss"] for r in read_metrics(m)] for m in metrics)
        assert got == want and len(got) == 3, (np_, got, want)


def test_the_double_quantized_base_holds_its_formats_bytes():
    tensors = load_file(os.path.join(BASE, "model.safetensors"))
    quantized = sum(tensors[n].size for n in quantized_names(tensors))
    plain = training(1, BASE)[1]["peak_mem"]["sharded_params"]
    step = training(1, BASE, *DQ)[1]
    # Per block unit: 144 records of 33 bytes (16-byte aligned: 4752), then the table: the map's 256
    # floats, 7 weights of 32 bytes and 7 group scales.
    table = 256 * 4 + 7 * 32 + 7 * 4
    assert step["peak_mem"]["sharded_params"] == plain - 4 * quantized + 2 * (144 * 33 + table)
    assert step["held_mem_bytes"] == step["planned_mem_bytes"]
    # The gathers move 33-byte records (the table is each rank's own); `plan` predicts the bytes.
    expected = 3 * (3104 * 4 + 2 * (896 * 4 + 144 * 33) + 2 * 832 * 4) // 2
    assert training(2, BASE, *DQ)[1]["comm_bytes"] == expected
    proc = run_single(["plan", "--world-size=2", "--format=lines", *qlora_args(BASE, *DQ)[1:]])
    line = next(l for l in proc.stdout.splitlines()
                if l.startswith("PLAN strategy=FULL_SHARD reduce=micro checkpointing=no offload=no"))
    assert f"traffic_bytes={expected}" in line, (line, expected)


def dq_record_oracle():
    """{name: (packed codes, absmax codes, [offset, group scales])} of the fixture base's linear
    weights, double-quantized by the numpy reference."""
    tensors = load_file(os.path.join(BASE, "model.safetensors"))
    out = {}
    for name in quantized_names(tensors):
        codes, absmax = quantize_4bit(tensors[name], "nf4", 64)
        absmax_codes, scales, offset = double_quantize(absmax, dynamic_map())
        out[name[len("model."):]] = (pack_4bit(codes, "nf4"), absmax_codes, np.concatenate([[offset], scales]))
    return out


def test_checkpoints_hold_the_codes_and_tables_and_resume_exactly():
    """A full checkpoint holds each weight's records (32 bytes of codes, one absmax code) and its
    nested table ([offset, scales], float32) -- h5py shows the numpy reference's -- in both layouts.
    Resuming continues the uninterrupted run bit for bit on the same rank count, to the summation
    order on another; a run of another format starting from the file computes with the same values."""
    import h5py
    oracle = dq_record_oracle()
    for layout in ("sharded", "gathered"):
        options = (*DQ, f"--checkpoint.format={layout}", f"--checkpoint.every={SAVE_AT}")
        straight, _, d = training(2, BASE, *options)
        saved = os.path.join(d, f"ckpt-{SAVE_AT:08d}.h5")
        with h5py.File(saved, "r") as f:
            assert f.attrs["version"] == 10 and f.attrs["quantized.double_quant"] == 1
            assert f.attrs["meta_checksum"] == meta_checksum(f.attrs)
            assert sorted(f["quantized"]) == sorted(oracle) == sorted(f["quantized_nested"]), layout
            for name, (packed, absmax_codes, table) in oracle.items():
                records = f["quantized"][name][...]
                assert records.shape == (absmax_codes.size, 33), (layout, name)
                assert np.array_equal(records[:, :32].reshape(-1)[:packed.size], packed), (layout, name)
                assert np.array_equal(records[:, 32], absmax_codes), (layout, name)
                nested = f["quantized_nested"][name][...]
                assert nested.dtype == np.float32 and np.array_equal(nested, table.astype(np.float32)), (layout, name)
        assert training(2, BASE, *options, f"--checkpoint.resume={saved}")[0] == straight[SAVE_AT:], layout
        resumed = training(3, BASE, *options, f"--checkpoint.resume={saved}")[0]
        assert max(abs(a - b) / abs(b) for a, b in zip(resumed, straight[SAVE_AT:])) < 1e-5, (layout, resumed)


def test_convert_double_quantizes_and_any_run_loads_the_values():
    """convert --frozen-dtype nf4 --double-quant writes the numpy reference's codes and tables (3 ranks);
    LoRA runs starting from that checkpoint train bit for bit as from the numpy-dequantized base: into
    an fp32 base, a plain NF4 base (those values quantize back to themselves) and a double-quantized
    one (which codes the file's absmax under the file's tables); inspect names the format."""
    import h5py
    ckpt = os.path.join(tempdir(), "dq.h5")
    ok(run(3, ["convert", "--input", BASE, "--output", ckpt, "--frozen-dtype=nf4", "--double-quant"]), "convert")
    with h5py.File(ckpt, "r") as f:
        for name, (packed, absmax_codes, table) in dq_record_oracle().items():
            assert np.array_equal(f["quantized"][name][:, 32], absmax_codes), name
            assert np.array_equal(f["quantized_nested"][name][...], table.astype(np.float32)), name
    want = training(2, dq_base())[0]
    assert training(2, ckpt, *BASE_MODEL)[0] == want
    assert training(2, ckpt, *BASE_MODEL, "--fsdp.frozen_dtype=nf4")[0] == want
    assert training(2, ckpt, *BASE_MODEL, *DQ)[0] == want
    proc = run(1, ["inspect", ckpt])
    ok(proc, "inspect")
    assert ("quantized frozen base: 14 weights in nf4 with double quantization (64-element blocks, 0.5159 bytes per "
            "element)") in proc.stdout, proc.stdout


def test_bad_double_quantization_settings_are_refused():
    args = qlora_args(BASE, f"--checkpoint.dir={tempdir()}")
    expect_usage_error(args + ["--fsdp.frozen_dtype=fp8", "--fsdp.double_quant=true"],
                       "fsdp.double_quant=true", "fsdp.frozen_dtype=fp8")
    expect_usage_error(args + ["--fsdp.double_quant=true"], "fsdp.double_quant=true", "neither")
    convert = ["convert", "--input", BASE, "--output", os.path.join(tempdir(), "out.h5")]
    expect_usage_error(convert + ["--double-quant"], "add --frozen-dtype")
    expect_usage_error(convert + ["--frozen-dtype=bf16", "--double-quant"], "--double-quant", "bf16")


def test_a_double_quantized_teacher_distills_as_its_dequantized_weights():
    student = ("--distill.alpha=0.25", "--distill.temperature=1.5")
    got = training(2, BASE, f"--distill.teacher={BASE}", "--distill.teacher_dtype=nf4", "--fsdp.double_quant=true",
                   *student)
    assert got[0] == training(2, BASE, f"--distill.teacher={dq_base()}", *student)[0]
    assert got[1]["held_mem_bytes"] == got[1]["planned_mem_bytes"]


def test_a_folder_bitsandbytes_double_quantized_keeps_its_values_in_a_double_quantized_run():
    """transformers' save_pretrained of the base under load_in_4bit with bnb_4bit_use_double_quant:
    into a double-quantizing NF4 run of its block, each absmax is coded under the folder's own offset
    and group scales, so the run computes with bitsandbytes' dequantization of the folder (the
    dequant-nf4 folder), bit for bit, on 1 to 3 ranks."""
    folder, dequantized = (os.path.join(BNB_FOLDERS, name) for name in ("nf4", "dequant-nf4"))
    for np_ in (1, 2, 3):
        assert training(np_, folder, *DQ)[0] == training(np_, dequantized)[0], np_


def test_export_of_a_double_quantized_checkpoint_writes_its_own_codes_and_tables():
    """export --quantize nf4 --double-quant of a checkpoint that convert --double-quant wrote: every
    linear weight's absmax codes, nested absmax and offset are the checkpoint's (h5py), so bitsandbytes'
    dequantization of the folder (the numpy transcription) is the numpy-dequantized base, bit for bit;
    a LoRA run from the folder in a double-quantized base trains as from that base."""
    import h5py
    ckpt, out = os.path.join(tempdir(), "dq.h5"), os.path.join(tempdir(), "nf4-dq")
    ok(run(2, ["convert", "--input", BASE, "--output", ckpt, "--frozen-dtype=nf4", "--double-quant"]), "convert")
    ok(run(2, ["export", ckpt, "--format", "hf", "--output", out, "--quantize=nf4", "--double-quant"]), "export")
    tensors = folder_tensors(out)
    reference = load_file(os.path.join(dq_base(), "model.safetensors"))
    with h5py.File(ckpt, "r") as f:
        for name in quantized_names(reference):
            key = name[len("model."):]
            assert np.array_equal(tensors[name + ".absmax"], f["quantized"][key][:, 32]), name
            nested = f["quantized_nested"][key][...]
            assert np.array_equal(tensors[name + ".nested_absmax"], nested[1:]), name
            got = dequantize_bnb_tensor(tensors, name)
            assert np.array_equal(got.view(np.uint32), reference[name].view(np.uint32)), name
    assert training(2, out, *DQ)[0] == training(2, dq_base())[0]


def test_a_bad_value_one_rank_reads_stops_every_rank_with_one_line():
    """Loading is collective under double quantization (the absmax are all-gathered unit by unit):
    a NaN in the part of a weight that only the last rank reads still ends the run on every rank
    with one line naming the tensor and exit 2, never a hang."""
    d = tempdir()
    shutil.copy(os.path.join(BASE, "config.json"), d)
    tensors = load_file(os.path.join(BASE, "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name].reshape(-1)[-1] = np.nan
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    expect_usage_error(qlora_args(d, *DQ, f"--checkpoint.dir={tempdir()}"), "layers.0.mlp.down_proj.weight",
                       "holds nan", np_=3)


def test_a_block_decoded_below_zero_keeps_its_values():
    """bitsandbytes decodes the absmax of a block that is tiny beside its group's (here a 1e-4-scaled
    first block of q_proj, with a large second block) below zero: 4.4e-6 becomes -0.0019, and the
    block's values flip sign as bitsandbytes' do. A double-quantized run starting from such a
    checkpoint holds those values exactly, as an fp32 run from it does."""
    d = tempdir()
    shutil.copy(os.path.join(BASE, "config.json"), d)
    tensors = load_file(os.path.join(BASE, "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].copy()
    flat = tensors[name].reshape(-1)
    flat[:64] *= 1e-4
    flat[64:128] *= 8
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    codes, absmax = quantize_4bit(tensors[name], "nf4", 64)
    assert double_dequantize(*double_quantize(absmax, dynamic_map()), dynamic_map())[0] < 0
    ckpt = os.path.join(tempdir(), "negative.h5")
    ok(run(2, ["convert", "--input", d, "--output", ckpt, "--frozen-dtype=nf4", "--double-quant"]), "convert")
    want = training(2, ckpt, *BASE_MODEL)[0]
    assert training(2, ckpt, *BASE_MODEL, *DQ)[0] == want
    reference = tempdir()
    shutil.copy(os.path.join(BASE, "config.json"), reference)
    for key in quantized_names(tensors):
        tensors[key] = quantize_dequantize(tensors[key], "nf4", 64, dynamic_map())
    save_file(tensors, os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
    assert want == training(2, reference)[0]

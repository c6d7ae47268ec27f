"""A quantized frozen base (fsdp.frozen_dtype, docs/quantization.md). The oracles are independent of
our code:

- bitsandbytes and torch themselves: quant_reference.py's numpy NF4 and FP4 give bitsandbytes 0.50's
  codes, absmax and dequantized values, and its FP8 torch's float8_e4m3fn codes, on the fixture they
  wrote (tests/fixtures/bnb; tests/unit/test_quant.cpp holds the C++ kernels to the same file);
- the same training on the dequantized base in full precision: LoRA on an NF4, FP4 or FP8 base gives,
  bit for bit, the losses of LoRA on the base whose linear weights numpy replaced by their
  quantize-dequantize, on 1, 2 and 3 ranks, with an fp32 and a bf16 fsdp.param_dtype;
- the uninterrupted run: a resume is bit for bit (adapter-only and full checkpoints);
- the formula: the frozen base's held bytes are the format's 0.5625 B (NF4) or 1.0625 B (FP8, blocks
  of 64) per quantized element, and the plan is what was allocated;
- one error line and exit 2 for each bad setting."""
import functools
import json
import os
import shutil

import numpy as np

from harness import ROOT, read_metrics, run, run_single, tempdir, tiny_args
from quant_reference import dequantize_4bit, dequantize_bnb_tensor, float_to_e4m3, pack_4bit, quantize_4bit, quantize_dequantize
from safetensors_io import read_safetensors, write_safetensors
from test_bad_input import expect_usage_error, write_tokens
from test_checkpoint_edges import meta_checksum
from test_freeze import latest
from test_llama import llama_args, ok

BASE = os.path.join(ROOT, "tests", "fixtures", "peft", "llama", "base")  # LlamaForCausalLM, C = 32, V = 96
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "bnb", "quant.safetensors")
# The layers a quantized base holds in its format: every linear layer of the blocks.
LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj")
STEPS, SAVE_AT = 4, 2


def load_file(path):
    return read_safetensors(path)[0]


def save_file(tensors, path, metadata=None):
    write_safetensors(tensors, path, metadata)


def fixture_tensors():
    """The bitsandbytes fixture, flattened."""
    return {name: value.reshape(-1) for name, value in load_file(FIXTURE).items()}


def test_numpy_reference_is_bitsandbytes_and_torch():
    f = fixture_tensors()
    cases = 0
    for quant_type in ("nf4", "fp4"):
        for block in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            for label in ("odd", "tiny", "ties"):
                key = f"{quant_type}.{block}.{label}"
                codes, absmax = quantize_4bit(f[key + ".input"], quant_type, block)
                assert np.array_equal(pack_4bit(codes, quant_type), f[key + ".packed"]), key
                assert np.array_equal(absmax.view(np.uint32), f[key + ".absmax"].view(np.uint32)), key
                got = dequantize_4bit(codes, absmax, quant_type, block)
                assert np.array_equal(got.view(np.uint32), f[key + ".dequant"].view(np.uint32)), key
                cases += 1
    assert cases == 48
    assert np.array_equal(float_to_e4m3(f["fp8.input"]), f["fp8.bytes"])


def quantized_names(tensors):
    return [n for n in tensors if any(f".{layer}.weight" in n for layer in LINEAR)]


@functools.lru_cache(maxsize=None)
def dequantized_base(fmt, block=64):
    """The fixture's base folder with each linear weight replaced by what `fmt` computes with."""
    d = tempdir()
    shutil.copy(os.path.join(BASE, "config.json"), d)
    tensors = load_file(os.path.join(BASE, "model.safetensors"))
    for name in quantized_names(tensors):
        tensors[name] = quantize_dequantize(tensors[name], fmt, block)
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    return d


@functools.lru_cache(maxsize=None)
def tokens():
    rng = np.random.default_rng(7)
    return write_tokens(os.path.join(tempdir(), "tokens.bin"), [int(t) for t in rng.integers(0, 96, size=4000)])


def qlora_args(base, *extra):
    ini = os.path.join(tempdir(), "threads.ini")
    with open(ini, "w") as f:
        f.write("[train]\nthreads = 1\n")
    return ["train", "--config", ini, f"--checkpoint.init_from={base}", f"--data.train_file={tokens()}",
            "--data.val_file=", "--train.seq_len=16", "--train.micro_batch=1", "--train.global_batch=6",
            f"--train.steps={STEPS}", "--train.lr=2e-2", "--train.peak_gflops=100", "--adapter.type=lora",
            "--adapter.targets=q_proj,v_proj,down_proj", "--adapter.rank=4", "--adapter.alpha=8", *extra]


@functools.lru_cache(maxsize=None)
def training(np_, base, *extra):
    """(losses, first step's metrics, run folder) of a run on np_ ranks."""
    d = tempdir()
    metrics = os.path.join(d, "m.jsonl")
    ok(run(np_, qlora_args(base, f"--checkpoint.dir={d}", f"--train.metrics_file={metrics}", *extra)), str(extra))
    steps = read_metrics(metrics)
    return [s["loss"] for s in steps], steps[0], d


def test_a_quantized_base_trains_as_its_dequantized_weights_bit_for_bit():
    plain = training(2, BASE)[0]
    for fmt, np_ in (("nf4", 1), ("nf4", 2), ("nf4", 3), ("fp4", 2), ("fp8", 3), ("bf16", 2)):
        quantized = training(np_, BASE, f"--fsdp.frozen_dtype={fmt}")[0]
        assert quantized == training(np_, dequantized_base(fmt), "--fsdp.frozen_dtype=fp32")[0], (fmt, np_)
        assert abs(quantized[0] - plain[0]) > 1e-6, (fmt, quantized, plain)  # the format matters
    # Rank counts agree as every run does (summation order alone differs).
    runs = [training(np_, BASE, "--fsdp.frozen_dtype=nf4")[0] for np_ in (1, 2, 3)]
    for other in runs[1:]:
        assert max(abs(a - b) / abs(b) for a, b in zip(other, runs[0])) < 1e-5, runs
    # 16-bit gathers: the dequantized weights rounded to bf16 once, as the bf16 base's are.
    bf16 = ("--fsdp.param_dtype=bf16",)
    assert training(2, BASE, "--fsdp.frozen_dtype=nf4", *bf16)[0] == training(2, dequantized_base("nf4"), *bf16)[0]
    # Another block size (the fused q|k|v and gate|up stay whole blocks of 32).
    assert (training(2, BASE, "--fsdp.frozen_dtype=nf4", "--fsdp.quant_block=32")[0] ==
            training(2, dequantized_base("nf4", 32))[0])
    # The other strategies, offload and prefetching gather and hold the records the same way; DoRA's
    # magnitudes start from the dequantized weights' row norms.
    for np_, options in ((2, ("--fsdp.sharding_strategy=SHARD_GRAD_OP",)), (3, ("--fsdp.cpu_offload=true",)),
                         (2, ("--fsdp.sharding_strategy=NO_SHARD",)),
                         (4, ("--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2",
                              "--train.global_batch=8")),
                         (2, ("--fsdp.forward_prefetch=true", "--fsdp.limit_all_gathers=3")),
                         (2, ("--adapter.type=dora",))):
        assert (training(np_, BASE, "--fsdp.frozen_dtype=nf4", *options)[0] ==
                training(np_, dequantized_base("nf4"), *options)[0]), options


@functools.lru_cache(maxsize=None)
def odd_gpt2_folders(fmt):
    """A GPT-2 of width 36 (tests/e2e's tiny model otherwise) as a Hugging Face folder, and the
    same with each block's linear weights quantize-dequantized: its weights are not whole blocks
    (c_attn 108 x 36, attn.c_proj 36 x 36), so blocks end early and weights are padded apart.
    GPT-2's files hold Conv1D weights transposed; ours, which the format quantizes, are (out, in)."""
    d = tempdir()
    ok(run(1, tiny_args("--model.n_embd=36", "--train.steps=1", f"--checkpoint.dir={d}")), "gpt2-36")
    folder = os.path.join(tempdir(), "gpt2-36")
    ok(run(1, ["export", "--format", "hf", "--checkpoint", latest(d), "--output", folder]), "export")
    reference = os.path.join(tempdir(), "gpt2-36-" + fmt)
    shutil.copytree(folder, reference)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    names = [n for n in tensors if n.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight"))]
    assert len(names) == 2 * 4, names
    for name in names:
        tensors[name] = np.ascontiguousarray(quantize_dequantize(tensors[name].T, fmt, 64).T)
    save_file(tensors, os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
    return folder, reference


def test_weights_that_are_not_whole_blocks_train_as_their_dequantized_values():
    for fmt, ranks in (("nf4", (1, 2, 3)), ("fp8", (3,))):
        folder, reference = odd_gpt2_folders(fmt)
        lora = ("--model.n_embd=36", "--adapter.type=lora", "--adapter.targets=attn.c_attn,mlp.c_proj", "--adapter.rank=4",
                "--train.steps=4", "--checkpoint.save=false")
        for np_ in ranks:
            metrics = [os.path.join(tempdir(), f"{k}.jsonl") for k in range(2)]
            ok(run(np_, tiny_args(f"--checkpoint.init_from={folder}", *lora, f"--fsdp.frozen_dtype={fmt}",
                                  f"--train.metrics_file={metrics[0]}")), f"{fmt} {np_}")
            ok(run(np_, tiny_args(f"--checkpoint.init_from={reference}", *lora, f"--train.metrics_file={metrics[1]}")))
            got, want = ([r["loss"] for r in read_metrics(m)] for m in metrics)
            assert got == want and len(got) == 4, (fmt, np_, got, want)


def test_resume_is_exact_from_adapter_only_and_full_checkpoints():
    for fmt in ("nf4", "fp8"):
        for adapters_only in ("true", "false"):
            options = (f"--fsdp.frozen_dtype={fmt}", f"--checkpoint.adapters_only={adapters_only}",
                       f"--checkpoint.every={SAVE_AT}")
            straight, _, d = training(2, BASE, *options)
            saved = os.path.join(d, f"ckpt-{SAVE_AT:08d}.h5")
            resumed = training(3 if adapters_only == "true" else 2, BASE, *options, f"--checkpoint.resume={saved}")[0]
            if adapters_only == "false":
                assert resumed == straight[SAVE_AT:], (fmt, resumed, straight)
            else:  # another rank count: to its summation order
                assert max(abs(a - b) / abs(b) for a, b in zip(resumed, straight[SAVE_AT:])) < 1e-5, (fmt, resumed)


def test_the_frozen_base_holds_its_formats_bytes():
    tensors = load_file(os.path.join(BASE, "model.safetensors"))
    quantized = sum(tensors[n].size for n in quantized_names(tensors))
    assert quantized == 2 * (2 * 32 * 32 + 2 * 16 * 32 + 3 * 64 * 32)
    plain = training(1, BASE)[1]["peak_mem"]["sharded_params"]
    for fmt, record in (("nf4", 36), ("fp4", 36), ("fp8", 68), ("bf16", 128)):  # bytes per block of 64
        step = training(1, BASE, f"--fsdp.frozen_dtype={fmt}")[1]
        assert step["peak_mem"]["sharded_params"] == plain - 4 * quantized + quantized // 64 * record, fmt
        assert step["held_mem_bytes"] == step["planned_mem_bytes"]
    # Gathers move the records. Bytes sent per step on 2 ranks, exactly: per micro-batch (3 per
    # rank) the root (3104 fp32, all frozen) and both blocks (LoRA's 832 trainable and the norms' 64
    # fp32; 144 NF4 records of 36 bytes) are gathered, and the 2 x 832 trainable reduce-scattered;
    # each collective sends half its volume. `plan` predicts the same bytes.
    expected = 3 * (3104 * 4 + 2 * (896 * 4 + 144 * 36) + 2 * 832 * 4) // 2
    nf4, bf16 = (training(2, BASE, *o)[1]["comm_bytes"] for o in (("--fsdp.frozen_dtype=nf4",),
                                                                   ("--fsdp.param_dtype=bf16",)))
    assert nf4 == expected and nf4 < bf16, (nf4, expected, bf16)
    proc = run_single(["plan", "--world-size=2", "--format=lines", *qlora_args(BASE, "--fsdp.frozen_dtype=nf4")[1:]])
    line = next(l for l in proc.stdout.splitlines()
                if l.startswith("PLAN strategy=FULL_SHARD reduce=micro checkpointing=no offload=no"))
    assert f"traffic_bytes={expected}" in line, (line, expected)


def cpu_has_bf16_dot_products():
    """Whether oneDNN runs bf16 GEMMs natively here (its avx512_core_bf16 level, AMX CPUs above it)."""
    with open("/proc/cpuinfo") as f:
        flags = next((l.split(":", 1)[1].split() for l in f if l.startswith("flags")), [])
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"))


def test_a_16_bit_gather_dequantizes_into_the_16_bit_copy_alone():
    """With bf16 GEMM operands the quantized weights exist only in the gathered 16-bit copy: their
    place in the fp32 gathered buffer has no memory (reading it would fault), so every product on
    them -- the GEMMs, DoRA's norms, OFT's rotation -- must take the copy, and gives the losses of the
    dequantized base in bf16 bit for bit."""
    bf16 = ("--fsdp.param_dtype=bf16",)
    for np_, options in ((2, ()), (1, ()), (2, ("--adapter.type=dora",)),
                         (2, ("--adapter.type=oft", "--adapter.block_size=8")),
                         (2, ("--fsdp.sharding_strategy=SHARD_GRAD_OP", "--adapter.type=dora")),
                         (3, ("--fsdp.cpu_offload=true",))):
        got = training(np_, BASE, "--fsdp.frozen_dtype=nf4", *bf16, *options)[0]
        assert got == training(np_, dequantized_base("nf4"), *bf16, *options)[0], options
    # Timing every op (train.op_times wraps the layer ops) changes nothing: DoRA still reads the copy.
    dora = ("--fsdp.frozen_dtype=nf4", *bf16, "--adapter.type=dora")
    assert training(2, BASE, *dora, "--train.op_times=true")[0] == training(2, BASE, *dora)[0]
    # Each of the two block buffers lacks the fp32 copy of a block's 9216 quantized weights where the
    # GEMMs take the 16-bit copy itself (oneDNN's bf16 kernels; CPUs without them multiply fp32).
    dequantized = training(2, dequantized_base("nf4"), *bf16)[1]["peak_mem"]["gathered_units"]
    quantized = training(2, BASE, "--fsdp.frozen_dtype=nf4", *bf16)[1]["peak_mem"]["gathered_units"]
    assert dequantized - quantized == (2 * 9216 * 4 if cpu_has_bf16_dot_products() else 0), (quantized, dequantized)
    # A GPU plan takes the 16-bit copies on any host.
    def gpu_plan(*extra):
        proc = run_single(["plan", "--world-size=2", "--format=lines", "--train.device=cuda",
                           *qlora_args(BASE, *bf16, *extra)[1:]])
        line = next(l for l in proc.stdout.splitlines()
                    if l.startswith("PLAN strategy=FULL_SHARD reduce=micro checkpointing=no offload=no"))
        return {k: int(v) for k, v in (kv.split("=", 1) for kv in line.split()[1:]) if v.isdigit()}
    nf4 = "--fsdp.frozen_dtype=nf4"
    assert gpu_plan()["gathered_units_bytes"] - gpu_plan(nf4)["gathered_units_bytes"] == 2 * 9216 * 4
    # CUDA maps a block buffer's fp32 head in the driver's 2 MiB granules, not the allocator's 512 B
    # classes: one more block buffer adds its head to gathered_units and 2 MiB minus the head to the
    # rounding, beside its 16-bit copy's and records' 512 B classes.
    two, three = gpu_plan(nf4, "--fsdp.limit_all_gathers=2"), gpu_plan(nf4, "--fsdp.limit_all_gathers=3")
    head = three["gathered_units_bytes"] - two["gathered_units_bytes"]
    assert 0 < head < 1 << 20, head
    classes = three["rounding_bytes"] - two["rounding_bytes"] - ((2 << 20) - head)
    assert 0 <= classes < 2 * 512, (head, two["rounding_bytes"], three["rounding_bytes"])


def test_bad_quantization_settings_are_refused():
    expect_usage_error(qlora_args(BASE, "--fsdp.frozen_dtype=nf3"), "fsdp.frozen_dtype")
    expect_usage_error(qlora_args(BASE, "--fsdp.frozen_dtype=nf4", "--fsdp.quant_block=48"), "fsdp.quant_block=48")
    # k_proj's 512 elements are not whole blocks of 1024, and q|k|v is one matrix.
    expect_usage_error(qlora_args(BASE, "--fsdp.frozen_dtype=nf4", "--fsdp.quant_block=1024"),
                       "does not tile layers.0.self_attn.k_proj.weight (512 elements)")
    expect_usage_error(qlora_args(BASE, "--fsdp.quant_block=32"), "nothing is quantized")
    # Nothing frozen, nothing to quantize.
    expect_usage_error(["train", "--config", os.path.join(ROOT, "inputs", "llama-tiny.ini"), "--fsdp.frozen_dtype=fp4"],
                       "freezes none")


def test_flux_quantizes_its_linear_layers_and_keeps_the_modulation_unless_asked():
    """LoRA on a FLUX diffusers folder (tests/e2e/flux_reference.py's shapes) with an NF4 base:
    the losses of the base whose block linear weights numpy dequantized, bit for bit -- the
    modulation (norm*.linear) left alone unless fsdp.quantize_all_linear."""
    from flux_reference import make_diffusers_folder
    from test_flux import CFG, LORA_TARGETS, flux_args, losses
    folder = os.path.join(tempdir(), "flux")
    params = make_diffusers_folder(folder, CFG, seed=5)
    lora = ("--adapter.type=lora", f"--adapter.targets={LORA_TARGETS}", "--adapter.rank=4", "--adapter.alpha=4",
            "--train.lr=1e-2")
    blocks = [n for n in params if n.startswith(("transformer_blocks.", "single_transformer_blocks."))
              and n.endswith(".weight") and params[n].ndim == 2]
    for all_linear in (False, True):
        names = [n for n in blocks if all_linear or ".norm" not in n]
        assert len(names) == 2 * (12 + 2 * all_linear) + 2 * (5 + all_linear), names  # 12 + 2 per double, 5 + 1 per single
        reference = os.path.join(tempdir(), "flux-dequantized")
        shutil.copytree(folder, reference)
        tensors = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
        for name in names:
            tensors[name] = quantize_dequantize(tensors[name], "nf4", 32)
        save_file(tensors, os.path.join(reference, "diffusion_pytorch_model.safetensors"))
        quantized = losses(2, f"--checkpoint.init_from={folder}", *lora, "--fsdp.frozen_dtype=nf4",
                           "--fsdp.quant_block=32", f"--fsdp.quantize_all_linear={str(all_linear).lower()}")
        assert quantized == losses(2, f"--checkpoint.init_from={reference}", *lora), all_linear
        if all_linear:  # bf16 gathers: every quantized weight, modulation too, read from the 16-bit copy alone
            bf16 = ("--fsdp.param_dtype=bf16",)
            assert losses(2, f"--checkpoint.init_from={folder}", *lora, *bf16, "--fsdp.frozen_dtype=nf4",
                          "--fsdp.quant_block=32", "--fsdp.quantize_all_linear=true") == \
                losses(2, f"--checkpoint.init_from={reference}", *lora, *bf16)


BNB_FOLDERS = os.path.join(ROOT, "tests", "fixtures", "bnb", "llama")


def test_folders_quantized_by_bitsandbytes_load_as_bitsandbytes_dequantizes_them():
    """transformers' save_pretrained of the base under load_in_4bit (NF4 with double quantization,
    FP4 without): read as bitsandbytes' own dequantize_4bit of each weight (the dequant-* folders),
    bit for bit -- into an fp32 base, and into an NF4/FP4 base of the same block size, whose records
    are then the folder's own."""
    for fmt in ("nf4", "fp4"):
        folder, dequantized = os.path.join(BNB_FOLDERS, fmt), os.path.join(BNB_FOLDERS, "dequant-" + fmt)
        want = training(2, dequantized)[0]
        assert training(2, folder)[0] == want, fmt
        assert training(3, folder, f"--fsdp.frozen_dtype={fmt}")[0] == training(3, dequantized)[0], fmt
        assert training(1, folder, f"--fsdp.frozen_dtype={fmt}")[0] == training(1, dequantized)[0], fmt
        assert training(2, folder)[0] != training(2, BASE)[0]


def test_damaged_bitsandbytes_folders_are_refused_naming_the_tensor():
    def damaged(change):
        d = tempdir()
        shutil.copy(os.path.join(BNB_FOLDERS, "nf4", "config.json"), d)
        tensors = load_file(os.path.join(BNB_FOLDERS, "nf4", "model.safetensors"))
        change(tensors)
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        return d

    q = "model.layers.0.self_attn.q_proj.weight"
    state_key = q + ".quant_state.bitsandbytes__nf4"

    def set_state(**fields):
        def change(tensors):
            state = json.loads(bytes(tensors[state_key]).decode())
            state.update(fields)
            tensors[state_key] = np.frombuffer(json.dumps(state).encode(), dtype=np.uint8).copy()
        return change

    cases = [(set_state(shape=[32, 16]), "quant_state says shape [32, 16], config.json's model needs [32, 32]"),
             (set_state(quant_type="nf5"), "quant_type is not the 'nf4'"),
             (set_state(blocksize=48), "blocksize 48"),
             (lambda t: t.pop(q + ".absmax"), f"'{q}.absmax' is missing"),
             (lambda t: t.update({q + ".quant_map": np.zeros(8, dtype=np.float32)}), f"'{q}.quant_map' is F32 with 8"),
             (lambda t: t.update({state_key: np.frombuffer(b"{not json", dtype=np.uint8).copy()}), "not JSON")]
    for change, needle in cases:
        expect_usage_error(qlora_args(damaged(change), "--fsdp.frozen_dtype=nf4", f"--checkpoint.dir={tempdir()}"),
                           f"bitsandbytes 4-bit tensor '{q}'", needle)


def test_a_quantized_teacher_distills_as_its_dequantized_weights():
    """distill.teacher_dtype: the fixture's base as the teacher of a LoRA student on the same base;
    an NF4 teacher gives the losses of the teacher whose linear weights numpy dequantized, bit for
    bit, and the teacher's held bytes shrink by the formula (its plan still what was allocated)."""
    student = ("--distill.alpha=0.25", "--distill.temperature=1.5")
    quantized, first, _ = training(2, BASE, f"--distill.teacher={BASE}", "--distill.teacher_dtype=nf4", *student)
    assert quantized == training(2, BASE, f"--distill.teacher={dequantized_base('nf4')}", *student)[0]
    assert quantized != training(2, BASE, f"--distill.teacher={BASE}", *student)[0]
    bf16 = "--fsdp.param_dtype=bf16"  # where bf16 GEMMs are native, the teacher's weights live in its 16-bit copies alone
    assert training(2, BASE, f"--distill.teacher={BASE}", "--distill.teacher_dtype=nf4", *student, bf16)[0] == \
        training(2, BASE, f"--distill.teacher={dequantized_base('nf4')}", *student, bf16)[0]
    # On 2 ranks the teacher's 18432 quantized elements take 36 bytes a block of 64 instead of 4 a
    # piece, halved by the sharding, and its two block buffers hold their blocks' records (9216
    # elements each): the plan (what was allocated, held == planned) shrinks by the difference.
    plain = training(2, BASE, f"--distill.teacher={BASE}", *student)[1]
    assert plain["planned_mem_bytes"] - first["planned_mem_bytes"] == (4 * 18432 - 18432 // 64 * 36) // 2 - 2 * 9216 // 64 * 36
    assert first["held_mem_bytes"] == first["planned_mem_bytes"]
    expect_usage_error(qlora_args(BASE, "--distill.teacher_dtype=nf4"), "distill.teacher_dtype is set")


def test_convert_dequantizes_a_bitsandbytes_folder_both_ways():
    """convert of a bitsandbytes-quantized folder to a checkpoint and back out to a Hugging Face
    folder: the weights bitsandbytes' dequantization gives, bit for bit (3 ranks, then 2)."""
    ckpt, out = os.path.join(tempdir(), "nf4.h5"), os.path.join(tempdir(), "hf")
    ok(run(3, ["convert", "--input", os.path.join(BNB_FOLDERS, "nf4"), "--output", ckpt]), "convert in")
    ok(run(2, ["convert", "--input", ckpt, "--output", out]), "convert out")
    got = load_file(os.path.join(out, "model.safetensors"))
    want = load_file(os.path.join(BNB_FOLDERS, "dequant-nf4", "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert np.array_equal(got[name].view(np.uint32), want[name].view(np.uint32)), name


@functools.lru_cache(maxsize=None)
def exported_4bit(quant_type, *extra):
    """The fixture's base, converted to a checkpoint and exported by 2 ranks with --quantize."""
    ckpt, out = os.path.join(tempdir(), "base.h5"), os.path.join(tempdir(), quant_type)
    ok(run(1, ["convert", "--input", BASE, "--output", ckpt]), "convert")
    ok(run(2, ["export", ckpt, "--format", "hf", "--output", out, f"--quantize={quant_type}", *extra]), "export")
    return out


def folder_tensors(folder):
    tensors = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def test_export_quantize_writes_what_transformers_saves_under_load_in_4bit():
    """export --quantize of the fixture's base against transformers' save_pretrained of the same base
    loaded with load_in_4bit (tests/fixtures/bnb/llama): FP4 byte for byte; NF4 with double
    quantization the same 4-bit codes, 8-bit absmax codes and maps, and the offset within one unit in
    the last place (torch's fp32 mean; ours is the mean correctly rounded); config.json's
    quantization_config the same. The numpy dequantization that reads such folders is first held to
    bitsandbytes' own dequantization of transformers' folders."""
    for quant_type, extra in (("fp4", ()), ("nf4", ("--double-quant",))):
        theirs = load_file(os.path.join(BNB_FOLDERS, quant_type, "model.safetensors"))
        want = load_file(os.path.join(BNB_FOLDERS, "dequant-" + quant_type, "model.safetensors"))
        for name in quantized_names(want):
            assert np.array_equal(dequantize_bnb_tensor(theirs, name).view(np.uint32), want[name].view(np.uint32))
        folder = exported_4bit(quant_type, *extra)
        ours = load_file(os.path.join(folder, "model.safetensors"))
        assert sorted(ours) == sorted(theirs), quant_type
        for name in theirs:
            if ".quant_state." in name:
                mine, bnb = (json.loads(bytes(t[name]).decode()) for t in (ours, theirs))
                if "nested_offset" in bnb:
                    a, b = np.float32(mine.pop("nested_offset")), np.float32(bnb.pop("nested_offset"))
                    assert abs(int(a.view(np.int32)) - int(b.view(np.int32))) <= 1, name
                assert mine == bnb, name
            elif name.endswith(".nested_absmax"):  # max |absmax - offset|: moves with the offset
                assert np.allclose(ours[name], theirs[name], rtol=1e-6, atol=0), name
            else:
                assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
                assert np.array_equal(ours[name].view(np.uint8), theirs[name].view(np.uint8)), name
        with open(os.path.join(folder, "config.json")) as f, \
                open(os.path.join(BNB_FOLDERS, quant_type, "config.json")) as g:
            assert json.load(f)["quantization_config"] == json.load(g)["quantization_config"]


def data_offsets(path):
    """{name: (dtype, first byte)} of a safetensors file's tensors, from its header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: (v["dtype"], 8 + n + v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}


def test_an_exported_4bit_folder_keeps_every_tensor_aligned_and_names_its_dtype():
    """Each tensor starts at a multiple of its element size (safetensors' own writer orders a file
    so; loaders that view the bytes in place need it), whatever the 4-bit parts' odd lengths --
    llama-tiny's 40-wide weights have 25 blocks of absmax codes; with --dtype bf16 the quant_state
    names the weights' dtype as transformers writes it."""
    d = tempdir()
    ok(run(1, llama_args("--train.steps=1", f"--checkpoint.dir={d}")), "llama-tiny")
    for extra in (("--double-quant",), ("--double-quant", "--dtype=bf16"), ("--dtype=fp16", "--max-file-size=8KB")):
        folder = os.path.join(tempdir(), "out")
        ok(run(2, ["export", latest(d), "--format", "hf", "--output", folder, "--quantize=nf4", *extra]), "export")
        files = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
        for name in files:
            for tensor, (dtype, first) in data_offsets(os.path.join(folder, name)).items():
                assert first % {"F32": 4, "BF16": 2, "F16": 2, "U8": 1}[dtype] == 0, (extra, tensor, first)
        tensors = folder_tensors(folder)
        want = "bfloat16" if "--dtype=bf16" in extra else "float16" if "--dtype=fp16" in extra else "float32"
        states = [json.loads(bytes(v).decode()) for k, v in tensors.items() if ".quant_state." in k]
        assert len(states) == 14 and all(st["dtype"] == want for st in states), extra


def test_an_exported_4bit_folder_trains_as_its_dequantized_weights():
    """The exported folders read back (checkpoint.init_from) train, bit for bit, as numpy's
    dequantization of their tensors -- into an fp32 base, and into an NF4 base whose records are the
    folder's own; split into several files (--max-file-size), each weight's tensors stay together
    and it reads the same. Other block sizes are whole bitsandbytes tensors too."""
    for quant_type, extra in (("nf4", ("--double-quant",)), ("nf4", ("--quant-block=32", "--double-quant")),
                              ("fp4", ("--quant-block=128",))):
        folder = exported_4bit(quant_type, *extra)
        tensors = folder_tensors(folder)
        reference = tempdir()
        shutil.copy(os.path.join(BASE, "config.json"), reference)
        plain = load_file(os.path.join(BASE, "model.safetensors"))
        for name in quantized_names(plain):
            plain[name] = dequantize_bnb_tensor(tensors, name)
        save_file(plain, os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
        want = training(2, reference)[0]
        assert training(2, folder)[0] == want, extra
        if extra == ("--double-quant",):
            assert training(3, folder, "--fsdp.frozen_dtype=nf4")[0] == training(3, reference)[0]
            split = exported_4bit(quant_type, "--double-quant", "--max-file-size=8KB")
            assert len([n for n in os.listdir(split) if n.endswith(".safetensors")]) > 2
            assert training(2, split)[0] == want


def test_bad_export_quantize_options_are_refused():
    ckpt = os.path.join(tempdir(), "base.h5")
    ok(run(1, ["convert", "--input", BASE, "--output", ckpt]), "convert")
    out = os.path.join(tempdir(), "out")
    export = ["export", ckpt, "--output", out]
    expect_usage_error(export + ["--format=hf", "--quantize=fp8"], "--quantize='fp8' is not allowed")
    expect_usage_error(export + ["--format=hf", "--quantize=nf4", "--quant-block=48"], "--quant-block=48")
    expect_usage_error(export + ["--format=hf", "--double-quant"], "add --quantize=nf4 or fp4")
    expect_usage_error(export + ["--quantize=nf4"], "apply to --format=hf")
    expect_usage_error(export + ["--adapter", "--quantize=nf4"], "not to --adapter")
    d = tempdir()
    ok(run(1, tiny_args("--train.steps=1", f"--checkpoint.dir={d}")), "gpt2")
    expect_usage_error(["export", latest(d), "--output", out, "--format=hf", "--quantize=nf4"], "holds a gpt2 model")
    assert not os.path.exists(out)


def base_record_oracle(quant_type, block=64):
    """{name: (codes packed as bitsandbytes packs them, absmax)} of the fixture base's linear weights,
    quantized by the numpy reference."""
    tensors = load_file(os.path.join(BASE, "model.safetensors"))
    out = {}
    for name in quantized_names(tensors):
        codes, absmax = quantize_4bit(tensors[name], quant_type, block)
        out[name[len("model."):]] = (pack_4bit(codes, quant_type), absmax)
    return out


def test_checkpoints_store_a_quantized_base_as_its_records():
    """A full checkpoint of LoRA on an NF4 base holds each frozen linear weight as /quantized/<name>,
    uint8 [blocks, 36]: per block its 32 bytes of codes then its absmax (fp32), which h5py shows to be
    bitsandbytes' codes and absmax of the base (the numpy reference) -- in both layouts, with neither
    fp32 values nor moments of those weights anywhere else in the file. Resuming on another rank count
    continues the uninterrupted run (to the summation order's 1e-5)."""
    import h5py
    oracle = base_record_oracle("nf4")
    for layout in ("sharded", "gathered"):
        options = ("--fsdp.frozen_dtype=nf4", f"--checkpoint.format={layout}", f"--checkpoint.every={SAVE_AT}")
        straight, _, d = training(2, BASE, *options)
        saved = os.path.join(d, f"ckpt-{SAVE_AT:08d}.h5")
        with h5py.File(saved, "r") as f:
            assert f.attrs["version"] == 10 and f.attrs["quantized.dtype"] in ("nf4", b"nf4")
            assert f.attrs["quantized.block"] == 64 and f.attrs["meta_checksum"] == meta_checksum(f.attrs)
            assert sorted(f["quantized"]) == sorted(oracle), layout
            for name, (packed, absmax) in oracle.items():
                records = f["quantized"][name][...]
                assert records.dtype == np.uint8 and records.shape == (absmax.size, 36), (layout, name)
                assert np.array_equal(records[:, :32].reshape(-1)[:packed.size], packed), (layout, name)
                assert np.array_equal(records[:, 32:].copy().view("<f4").reshape(-1), absmax), (layout, name)
            names = []
            f.visit(names.append)
            for name in oracle:  # nowhere else: no fp32 copy, no zero moments
                assert not any(n != "quantized/" + name and n.endswith(name) for n in names), (layout, name)
            if layout == "sharded":
                for unit in f["shards"]:
                    index = f["shards"][unit].attrs["index"]
                    index = index.decode() if isinstance(index, bytes) else index
                    assert not any(line.split()[0] in oracle for line in index.splitlines() if line), unit
        resumed = training(3, BASE, *options, f"--checkpoint.resume={saved}")[0]
        assert max(abs(a - b) / abs(b) for a, b in zip(resumed, straight[SAVE_AT:])) < 1e-5, (layout, resumed)


# The fixture base's shape, which a run starting from a checkpoint of it (not its folder) configures.
BASE_MODEL = ("--model.arch=llama", "--model.n_layer=2", "--model.n_embd=32", "--model.n_head=4", "--model.n_kv_head=2",
              "--model.intermediate_size=64", "--model.vocab_size=96", "--model.max_seq_len=32",
              "--model.tie_embeddings=true", "--model.norm_eps=1e-5")


def test_convert_quantizes_and_any_run_loads_the_records():
    """convert --frozen-dtype of the fixture base writes its linear weights as records (3 ranks), the
    numpy reference's; a LoRA run starting from that checkpoint trains, bit for bit, as one from the
    base that numpy quantized and dequantized -- into an fp32 base, and into an NF4 base of the same
    block; exported (2 ranks) the weights are those dequantized values; inspect names the format."""
    ckpt = os.path.join(tempdir(), "nf4.h5")
    ok(run(3, ["convert", "--input", BASE, "--output", ckpt, "--frozen-dtype=nf4"]), "convert")
    import h5py
    with h5py.File(ckpt, "r") as f:
        for name, (packed, absmax) in base_record_oracle("nf4").items():
            assert np.array_equal(f["quantized"][name][:, :32].reshape(-1)[:packed.size], packed), name
    reference = dequantized_base("nf4")
    want = training(2, reference)[0]
    assert training(2, ckpt, *BASE_MODEL)[0] == want
    assert training(3, ckpt, *BASE_MODEL, "--fsdp.frozen_dtype=nf4")[0] == training(3, reference)[0]
    out = os.path.join(tempdir(), "hf")
    ok(run(2, ["convert", "--input", ckpt, "--output", out]), "convert out")
    got, expected = load_file(os.path.join(out, "model.safetensors")), load_file(os.path.join(reference, "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert np.array_equal(got[name].view(np.uint32), expected[name].view(np.uint32)), name
    proc = run(1, ["inspect", ckpt])
    ok(proc, "inspect")
    assert "quantized frozen base: 14 weights in nf4 (64-element blocks, 0.5625 bytes per element)" in proc.stdout


def test_damaged_records_and_bad_convert_quantization_are_refused():
    import h5py
    ckpt = os.path.join(tempdir(), "nf4.h5")
    ok(run(1, ["convert", "--input", BASE, "--output", ckpt, "--frozen-dtype=nf4"]), "convert")
    flipped, extra = os.path.join(tempdir(), "flipped.h5"), os.path.join(tempdir(), "extra.h5")
    shutil.copy(ckpt, flipped)
    shutil.copy(ckpt, extra)
    name = "layers.1.mlp.up_proj.weight"
    with h5py.File(flipped, "r+") as f:
        f["quantized"][name][3, 5] ^= 1
    with h5py.File(extra, "r+") as f:
        f["quantized"].create_dataset("layers.9.mlp.up_proj.weight", data=np.zeros((2, 36), dtype=np.uint8))
    expect_usage_error(qlora_args(flipped, *BASE_MODEL, f"--checkpoint.dir={tempdir()}"),
                       f"/quantized/{name} fails its checksum")
    expect_usage_error(["inspect", flipped], f"/quantized/{name} fails its checksum", np_=1)
    expect_usage_error(qlora_args(extra, *BASE_MODEL, f"--checkpoint.dir={tempdir()}"),
                       "unexpected object /quantized/layers.9")
    out = os.path.join(tempdir(), "out.h5")
    convert = ["convert", "--input", BASE, "--output", out]
    expect_usage_error(convert + ["--frozen-dtype=nf5"], "--frozen-dtype='nf5' is not allowed")
    expect_usage_error(convert + ["--frozen-dtype=nf4", "--quant-block=48"], "--quant-block=48")
    expect_usage_error(convert + ["--quant-block=128"], "add --frozen-dtype")
    expect_usage_error(["convert", "--input", ckpt, "--output", os.path.join(tempdir(), "hf"), "--frozen-dtype=nf4"],
                       "apply to a checkpoint written from a Hugging Face folder")
    assert not os.path.exists(out)

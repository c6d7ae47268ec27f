"""Mixed precision and communication volume. bf16/fp16 are storage and wire formats: they round
what is gathered or reduced, so losses move by about the formats' precision (bf16: 8 significant
bits), and the bytes each rank sends fall accordingly. With bf16 the CPU also multiplies in it:
the linear layers' GEMMs take bf16 operands with fp32 accumulation (oneDNN where the CPU has bf16
dot products, SGEMMs on the rounded operands elsewhere -- both kernels run here, the second by
capping oneDNN's ISA with DNNL_MAX_CPU_ISA), and world-size invariance and exact resume hold. The byte counts are checked
exactly against the volume of our collectives: per micro-batch, all-gathers of (2 Psi - root)
and a reduce-scatter of Psi, each sending (N-1)/N of it. The forward gathers Psi; the backward
re-gathers only the blocks no longer held in the fsdp.limit_all_gathers (K) block buffers, the
L - K first ones."""
import json
import os
import subprocess

import harness
from harness import EXE, mpirun_command, read_metrics, rel_diff, run, tempdir, tiny_args

STEPS = 6
# tiny.ini: root unit 256*40 + 64*40 + 2*40 = 12880 elements, blocks 12*40^2 + 13*40 = 19720.
ROOT, BLOCK, LAYERS = 12880, 19720, 2
PSI = ROOT + LAYERS * BLOCK


def steps_of(np_, *overrides, ckdir=None, env=None):
    metrics = os.path.join(tempdir(), "m.jsonl")
    extra = [f"--checkpoint.dir={ckdir}"] if ckdir else ["--checkpoint.save=false"]
    args = tiny_args(f"--train.steps={STEPS}", f"--train.metrics_file={metrics}", *extra, *overrides)
    proc = subprocess.run(mpirun_command(np_, [EXE, *args]), cwd=harness.ROOT, capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, f"{overrides}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    return read_metrics(metrics), proc.stdout


def test_bytes_sent_match_the_collectives_volume_and_halve_in_bf16():
    accumulation, n = 24 // (2 * 2), 2  # global_batch / (micro_batch * ranks)

    def expected(regathered_blocks, param_bytes=4, reduce_bytes=4):
        gathers = PSI + regathered_blocks * BLOCK
        return accumulation * (gathers * param_bytes + PSI * reduce_bytes) * (n - 1) / n

    fp32, _ = steps_of(2)  # K = 2 = L: both blocks are still held for the backward
    assert fp32[-1]["comm_bytes"] == expected(0), (fp32[-1]["comm_bytes"], expected(0))
    one_buffer, _ = steps_of(2, "--fsdp.limit_all_gathers=1")
    assert one_buffer[-1]["comm_bytes"] == expected(1)
    half, _ = steps_of(2, "--fsdp.param_dtype=bf16", "--fsdp.reduce_dtype=bf16")
    assert half[-1]["comm_bytes"] == expected(0) / 2
    gathers_only, _ = steps_of(2, "--fsdp.param_dtype=bf16")
    assert gathers_only[-1]["comm_bytes"] == expected(0, param_bytes=2)


def test_half_precision_losses_stay_close_to_fp32():
    reference, _ = steps_of(1)
    for np_, dtypes in [(2, ("bf16", "bf16")), (3, ("fp16", "fp32")), (2, ("fp32", "fp16")), (1, ("bf16", "fp32"))]:
        other, _ = steps_of(np_, f"--fsdp.param_dtype={dtypes[0]}", f"--fsdp.reduce_dtype={dtypes[1]}")
        worst = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(reference, other))
        # bf16 rounds each parameter by up to 2^-9 relative; over 6 steps the loss moves < 1%.
        assert worst < 1e-2, (np_, dtypes, worst)


def test_16_bit_activations_stay_close_to_fp32_and_are_invariant_in_the_rank_count():
    # fsdp.activation_dtype=auto follows param_dtype: bf16 parameters store bf16 activations, which
    # round every saved tensor where it is produced -- the losses move (it is not a no-op) by about
    # bf16's precision; other rank counts differ only by the gradient sums' order, as in fp32.
    reference, _ = steps_of(1)
    fp32_activations, _ = steps_of(2, "--fsdp.param_dtype=bf16", "--fsdp.activation_dtype=fp32")
    bf16, out = steps_of(2, "--fsdp.param_dtype=bf16")
    assert "activations bf16" in compute_line(out)
    assert [s["loss"] for s in bf16] != [s["loss"] for s in fp32_activations]
    on_3, _ = steps_of(3, "--fsdp.param_dtype=bf16", "--fsdp.activation_dtype=bf16")
    assert max(rel_diff(a["loss"], b["loss"]) for a, b in zip(bf16, on_3)) < 1e-4
    fp16, out = steps_of(2, "--fsdp.activation_dtype=fp16")  # fp32 parameters, fp16 activations
    assert "activations fp16" in compute_line(out)
    for other in (fp32_activations, bf16, fp16):
        worst = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(reference, other))
        assert 0 < worst < 1e-2, worst


def test_fp16_skips_an_overflowing_step_and_resumes_with_its_loss_scale():
    ckdir = tempdir()
    steps, stdout = steps_of(2, "--fsdp.param_dtype=fp16", "--debug.inject_inf_step=2", "--checkpoint.every=3",
                             ckdir=ckdir)
    assert "update skipped, loss scale halved to 32768" in stdout
    assert [s["skipped"] for s in steps] == [False, True, False, False, False, False]
    assert steps[0]["loss_scale"] == 65536 and steps[2]["loss_scale"] == 32768
    # Resume from step 3: the halved scale comes back from the checkpoint, the losses bit for bit.
    resumed, out = steps_of(2, "--fsdp.param_dtype=fp16", f"--checkpoint.resume={ckdir}/ckpt-00000003.h5",
                            ckdir=tempdir())
    assert [s["loss"] for s in resumed] == [s["loss"] for s in steps[3:]]
    assert resumed[0]["loss_scale"] == 32768


def test_bad_dtypes_are_rejected():
    for option in ("--fsdp.param_dtype=fp8", "--fsdp.reduce_dtype=int8"):
        proc = run(2, tiny_args(option), timeout=60)
        assert proc.returncode == 2 and option.split("=")[0][2:] in proc.stderr, proc.stderr[-1000:]


BF16_COMPUTE = "GEMMs bf16 operands, fp32 accumulation"
ONEDNN, ROUNDED_SGEMM = "oneDNN", "OpenBLAS SGEMM on bf16-rounded operands"
NO_BF16_DOT_PRODUCTS = {"DNNL_MAX_CPU_ISA": "AVX512_CORE"}  # oneDNN then has no bf16 kernel


def compute_line(stdout):
    return next(l for l in stdout.splitlines() if l.startswith("compute: "))


def test_cpu_bf16_compute_is_named_and_invariant_in_the_rank_count():
    fp32, out32 = steps_of(1)
    assert "GEMMs fp32 (OpenBLAS)" in compute_line(out32)
    one, out = steps_of(1, "--fsdp.param_dtype=bf16")
    assert BF16_COMPUTE in compute_line(out), compute_line(out)
    assert "workspace" in next(l for l in out.splitlines() if l.startswith("memory per rank"))
    # Against fp32: the rounding of both operands of every product, about 2^-9 each; over 6 steps
    # the loss moves < 1% (docs/performance.md has the same on gpt2-124M).
    assert max(rel_diff(a["loss"], b["loss"]) for a, b in zip(fp32, one)) < 1e-2
    assert max(rel_diff(a["loss"], b["loss"]) for a, b in zip(fp32, one)) > 0, "bf16 compute changed nothing"
    # Other rank counts multiply the same micro-batches; only the gradient sums' order differs, as in fp32.
    for np_ in (2, 3):
        other, _ = steps_of(np_, "--fsdp.param_dtype=bf16")
        worst = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(one, other))
        assert worst < 1e-4, (np_, worst)


def test_cpu_bf16_compute_resumes_bit_for_bit():
    ckdir = tempdir()
    full, _ = steps_of(2, "--fsdp.param_dtype=bf16", "--checkpoint.every=3", ckdir=ckdir)
    resumed, _ = steps_of(2, "--fsdp.param_dtype=bf16", f"--checkpoint.resume={ckdir}/ckpt-00000003.h5",
                          ckdir=tempdir())
    assert [s["loss"] for s in resumed] == [s["loss"] for s in full[3:]]


def test_cpu_bf16_compute_without_bf16_dot_products_is_the_same_arithmetic():
    native, out = steps_of(1, "--fsdp.param_dtype=bf16")
    capped, capped_out = steps_of(1, "--fsdp.param_dtype=bf16", env=NO_BF16_DOT_PRODUCTS)
    assert ROUNDED_SGEMM in compute_line(capped_out), compute_line(capped_out)
    assert ONEDNN in compute_line(out) or ROUNDED_SGEMM in compute_line(out)
    # The same products of bf16 values, summed in fp32 in another order.
    worst = max(rel_diff(a["loss"], b["loss"]) for a, b in zip(native, capped))
    assert worst < 1e-4, worst


def test_mfu_against_the_same_run_gemm_and_the_hardware_peak():
    for dtype, gemm in (("fp32", "SGEMM peak"), ("bf16", "bf16 GEMM peak")):
        metrics = os.path.join(tempdir(), "m.jsonl")
        args = [a for a in tiny_args("--train.steps=2", f"--fsdp.param_dtype={dtype}", "--checkpoint.save=false",
                                     f"--train.metrics_file={metrics}") if not a.startswith("--train.peak_gflops")]
        proc = run(1, args)
        assert proc.returncode == 0, proc.stderr[-2000:]
        line = compute_line(proc.stdout)
        assert gemm in line and "hardware peak" in line, line
        last = read_metrics(metrics)[-1]
        assert 0 < last["mfu"] < 1 and 0 < last["hardware_mfu"] < 1, last
        assert last["hardware_peak_gflops"] > 0

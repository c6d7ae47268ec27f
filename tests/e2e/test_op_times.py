"""train.op_times: every layer op timed on the device's clock (backend/op_timer.hpp) and a table
printed at the end. Timing forwards each call unchanged, so the run's numbers are the same bits;
the table names the ops a GPT-2 and a Llama step run, GEMMs by shape; and on one rank the ops'
time per step cannot exceed the forward and backward phases that hold them."""
import os
import re
import statistics

from harness import read_metrics, run, tempdir, tiny_args

LLAMA = ["--model.arch=llama", "--model.n_kv_head=2", "--model.n_head=4", "--model.n_embd=32",
         "--model.intermediate_size=64"]


def trained(np_, *overrides):
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = run(np_, tiny_args("--train.steps=4", "--checkpoint.save=false", f"--train.metrics_file={metrics}",
                              *overrides))
    assert proc.returncode == 0, f"{overrides}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    return proc.stdout, read_metrics(metrics)


def op_table(stdout):
    """{op: (calls per step, ms per step)} and the total ms per step, from the printed table."""
    head = stdout.index("op times on rank 0")
    rows, total = {}, None
    for line in stdout[head:].splitlines()[2:]:
        if line.startswith("timed in all"):
            total = float(line.split()[-1])
            break
        m = re.match(r"(.+?)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+%$", line)
        assert m, line
        rows[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    assert total is not None, stdout[head:]
    return rows, total


def test_timing_changes_no_bits_and_names_every_op():
    for arch, expected in (([], {"attention_forward", "attention_backward", "layernorm_forward", "gelu_backward",
                                 "softmax_crossentropy_forward"}),
                           (LLAMA, {"attention_forward", "rmsnorm_forward", "rope_backward", "swiglu_forward"})):
        plain_out, plain = trained(2, *arch)
        timed_out, timed = trained(2, *arch, "--train.op_times=true")
        assert "op times" not in plain_out
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in timed] == [r[key] for r in plain], (arch, key)
        rows, total = op_table(timed_out)
        assert expected <= set(rows), (arch, sorted(rows))
        assert any(name.startswith("matmul_forward ") and "->" in name for name in rows), sorted(rows)
        assert all(calls > 0 and ms >= 0 for calls, ms in rows.values()), rows
        assert total > 0


def test_the_ops_fit_in_the_phases_that_run_them():
    out, steps = trained(1, "--train.op_times=true", "--train.micro_batch=2")
    _, total_ms = op_table(out)
    counted = steps[1:]  # the table starts at step 2
    inside = statistics.mean(s["phase_seconds"]["forward"] + s["phase_seconds"]["backward"] for s in counted)
    assert 0 < total_ms / 1e3 <= inside, (total_ms, inside)

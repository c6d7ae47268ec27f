"""`shardtrain eval`: a checkpoint's loss, perplexity and token accuracy on token files without
training. With the run's own settings it prints the validation loss the trainer recorded, on any
rank count; its loss and accuracy on chosen windows are the float64 numpy GPT-2's of the exported
Hugging Face folder (hf_reference.py, transformers' equations) over those windows."""
import json
import math
import os
import re
import subprocess

import harness
from harness import read_metrics, run, tempdir, tiny_args
from test_bad_input import expect_usage_error
from test_datasets import read_tokens

HERE = os.path.dirname(os.path.abspath(__file__))


def trained():
    d = tempdir()
    metrics = os.path.join(d, "m.jsonl")
    proc = run(2, tiny_args("--train.steps=6", "--train.eval_every=6", f"--checkpoint.dir={d}",
                            f"--train.metrics_file={metrics}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return d, read_metrics(metrics, kind="eval")[-1]["val_loss"]


def eval_loss(np_, *args):
    proc = run(np_, ["eval", *args])
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("eval: ")]
    assert len(lines) == 1, proc.stdout
    loss = float(re.search(r"\| loss ([0-9.]+) \|", lines[0]).group(1))
    perplexity = float(re.search(r"\| perplexity ([0-9.]+) \|", lines[0]).group(1))
    assert abs(perplexity - math.exp(loss)) <= 1e-4 * perplexity, lines[0]
    return loss, lines[0]


def test_eval_prints_the_trainers_validation_loss_on_any_rank_count():
    d, val_loss = trained()
    for np_ in (1, 2, 3):
        loss, line = eval_loss(np_, "--checkpoint", d, "--global-batch", "24", "--micro-batch", "4"
                               if np_ != 3 else "8")
        assert abs(loss - val_loss) <= 2e-6 * val_loss, (np_, loss, val_loss, line)
    loss, _ = eval_loss(2, "--checkpoint", d)  # the run's own global and micro batch
    assert abs(loss - val_loss) <= 2e-6 * val_loss


def test_eval_on_chosen_windows_is_the_reference_models_loss():
    d, _ = trained()
    folder = os.path.join(tempdir(), "hf")
    proc = run(1, ["export", d + "/ckpt-00000006.h5", "--output", folder, "--format", "hf"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, val = harness.ensure_data()
    T = 32  # tiny.ini's train.seq_len
    loss, line = eval_loss(2, "--checkpoint", d, "--data", val, "--batches", "1", "--global-batch", "4",
                           "--micro-batch", "1", "--seq-len", str(T))
    tokens = read_tokens(val)
    want, correct = [], 0
    for w in range(4):
        window = [int(t) for t in tokens[w * T:w * T + T + 1]]
        proc = subprocess.run(["timeout", "300", harness.venv_python(), os.path.join(HERE, "hf_reference.py"), "loss",
                               folder, *map(str, window)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        want.append(json.loads(proc.stdout)["loss"])
        correct += json.loads(proc.stdout)["correct"]
    assert abs(loss - sum(want) / 4) <= 1e-5 * loss, (loss, want, line)
    # Token accuracy: the positions whose most likely token is the target. float32 against float64
    # may break one near tie.
    accuracy = float(re.search(r"\| token accuracy ([0-9.]+) \|", line).group(1))
    assert correct >= 8 and abs(accuracy * 4 * T - correct) <= 1.001, (accuracy, correct, line)


def test_eval_input_errors():
    d, _ = trained()
    expect_usage_error(["eval", "--checkpoint", d, "--global-batch", "5", "--micro-batch", "2"],
                       "does not split into micro-batches")
    expect_usage_error(["eval", "--checkpoint", d, "--batches", "x"], "--batches")
    expect_usage_error(["eval", "--checkpoint", d, "--data", "/nonexistent/x.bin"], "/nonexistent/x.bin")
    expect_usage_error(["eval", "--checkpoint", d, "--seq-len", "65"], "--seq-len")

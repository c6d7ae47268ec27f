"""Runtime behaviour: the watchdog turns a stalled rank into an abort with a message instead of a
hang; the data commands make trainable files from any text."""
import os
import time

from harness import ROOT, read_metrics, run, run_single, tempdir, tiny_args


def test_watchdog_aborts_a_stalled_rank():
    start = time.time()
    proc = run(2, tiny_args("--fsdp.comm_timeout=3", "--debug.stall_rank=1", "--debug.stall_step=1",
                            "--debug.stall_seconds=60"), timeout=50)
    elapsed = time.time() - start
    assert proc.returncode not in (0, 124, 137), f"exit {proc.returncode}: the run should abort, not finish or hang"
    assert "fsdp.comm_timeout" in proc.stderr, proc.stderr[-2000:]
    assert elapsed < 40, f"abort took {elapsed:.0f} s"


def test_watchdog_covers_start_up():
    """A rank stuck before the start-up agreements (opening the data files): the others wait in the
    Runtime's own collective, which is timed too."""
    start = time.time()
    proc = run(2, tiny_args("--fsdp.comm_timeout=3", "--debug.stall_rank=1", "--debug.stall_step=-1",
                            "--debug.stall_seconds=60"), timeout=50)
    elapsed = time.time() - start
    assert proc.returncode not in (0, 124, 137), f"exit {proc.returncode}: the run should abort, not finish or hang"
    assert "agreement on the inputs" in proc.stderr and "fsdp.comm_timeout=3" in proc.stderr, proc.stderr[-2000:]
    assert elapsed < 40, f"abort took {elapsed:.0f} s"


def test_encode_own_text_and_train_on_it():
    tmp = tempdir()
    text = os.path.join(tmp, "text.txt")
    with open(text, "w") as f:
        for i in range(400):
            f.write(f"line {i}: the quick brown fox jumps over the lazy dog.\n")
    out = os.path.join(tmp, "text_train.bin")
    proc = run_single(["data", "encode", "--input", text, "--output", out, "--val-fraction", "0.1"])
    assert proc.returncode == 0, proc.stderr
    assert os.path.getsize(out) > 1024
    metrics = os.path.join(tmp, "m.jsonl")
    proc = run(2, tiny_args(f"--data.train_file={out}", "--data.val_file=", "--train.steps=3",
                            f"--train.metrics_file={metrics}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(read_metrics(metrics)) == 3

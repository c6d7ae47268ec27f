"""Training does not depend on the OpenMP thread count: a run on 1 and on 2 threads per rank writes
the same losses and gradient norms (the metrics' 9 significant digits; every reduction sums in an
order fixed by the data, not by the threads). The bits of the norm itself, which feeds clipping,
are checked by the unit test CpuReductions.SumSquaresIsTheSameBitsForAnyThreadCount."""
import os

from harness import read_metrics, run, tempdir, tiny_args


def metrics_with_threads(np_, threads, *overrides):
    out = os.path.join(tempdir(), f"metrics-{np_}-{threads}.jsonl")
    proc = run(np_, tiny_args(f"--train.metrics_file={out}", f"--train.threads={threads}", "--train.steps=8",
                              "--train.grad_clip=0.05", *overrides), timeout=240)
    assert proc.returncode == 0, f"threads={threads} exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return read_metrics(out)


def test_thread_count_does_not_change_the_bits():
    # One rank: each gradient shard is a whole unit (the longest sums); two ranks: the ring too.
    for np_ in (1, 2):
        one, two = metrics_with_threads(np_, 1), metrics_with_threads(np_, 2)
        assert len(one) == len(two) == 8
        assert all(r["grad_norm"] > 0.05 for r in one), "clipping must act in every step"
        assert [r["grad_norm"] for r in one] == [r["grad_norm"] for r in two], (np_, one, two)
        assert [r["loss"] for r in one] == [r["loss"] for r in two], (np_, one, two)

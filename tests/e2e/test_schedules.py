"""The training loop's knobs: learning-rate schedules (each step's lr in the metrics against the
formula written here again), epochs as the run's length (counted from the data), and the effective
configuration written to the run folder, which reproduces the run bit for bit."""
import math
import os

from harness import read_metrics, run, tempdir, tiny_args
from test_bad_input import expect_usage_error

STEPS, WARMUP, LR, MIN_RATIO = 12, 2, 1e-3, 0.2


def expected_lr(schedule, step, decay_steps=0):
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    if schedule == "constant":
        return LR
    after = STEPS - WARMUP
    decay = after if schedule != "wsd" else min(after, decay_steps or max(1, after // 5))
    start = STEPS - decay
    if step < start:
        return LR
    progress = (step - start) / (decay - 1)
    low = LR * MIN_RATIO
    if schedule == "linear":
        return LR + (low - LR) * progress
    return low + 0.5 * (LR - low) * (1 + math.cos(math.pi * progress))


def lrs(*options):
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = run(2, tiny_args(f"--train.steps={STEPS}", f"--train.warmup_steps={WARMUP}", f"--train.lr={LR}",
                            f"--train.min_lr_ratio={MIN_RATIO}", f"--train.metrics_file={metrics}", *options))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [r["lr"] for r in read_metrics(metrics)]


def test_each_schedule_gives_its_learning_rates():
    for schedule, extra, decay in (("cosine", (), 0), ("linear", (), 0), ("constant", (), 0),
                                   ("wsd", (), 0), ("wsd", ("--train.decay_steps=4",), 4)):
        got = lrs(f"--train.lr_schedule={schedule}", *extra)
        want = [expected_lr(schedule, s, decay) for s in range(STEPS)]
        assert len(got) == STEPS
        for s, (g, w) in enumerate(zip(got, want)):
            assert abs(g - w) <= 1e-9 * LR, (schedule, decay, s, got, want)


def test_schedule_options_are_checked():
    expect_usage_error(tiny_args("--train.lr_schedule=step"), "train.lr_schedule='step'", "cosine, linear")
    expect_usage_error(tiny_args("--train.decay_steps=3"), "train.decay_steps applies to train.lr_schedule=wsd")
    expect_usage_error(tiny_args("--train.lr_schedule=wsd", "--train.steps=10", "--train.decay_steps=11"),
                       "train.decay_steps=11 is more than the 8 steps after the warmup")
    expect_usage_error(tiny_args("--train.steps=10", "--train.epochs=1"),
                       "train.steps and train.epochs both set the length of the run on the command line")
    expect_usage_error(tiny_args("--train.epochs=-1"), "train.epochs must be in [0, 1e6]")


def test_epochs_count_the_steps_from_the_data():
    """tiny.ini's data has W windows of train.seq_len; epochs E make ceil(E * W / global_batch) steps,
    and the last one ends inside epoch ceil(E) - 1 of the sampler."""
    d = tempdir()
    metrics = os.path.join(d, "m.jsonl")
    proc = run(2, tiny_args("--train.epochs=0.01", f"--checkpoint.dir={d}", f"--train.metrics_file={metrics}",
                            "--train.log_every=1000"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("train.epochs=0.01: "))
    steps, windows, global_batch = (int(line.split()[1]), int(line.split("(")[1].split()[0]),
                                    int(line.split("train.global_batch=")[1].split()[0]))
    assert steps == math.ceil(0.01 * windows / global_batch), line
    assert len(read_metrics(metrics)) == steps
    with open(os.path.join(d, "config.ini")) as f:
        text = f.read()
    assert text.startswith(f"# train.epochs=0.01 makes {steps} steps"), text[:200]
    assert "epochs = 0.01" in text and "\nsteps = " not in text, text  # reads back as the same run


def test_the_effective_config_reproduces_the_run():
    """The run folder's config.ini holds every setting the run used (defaults, the INI file and the
    command line resolved): training from it alone gives the same losses bit for bit."""
    d = tempdir()
    first = os.path.join(tempdir(), "m.jsonl")
    proc = run(2, tiny_args("--train.steps=5", f"--checkpoint.dir={d}", f"--train.metrics_file={first}",
                            "--train.lr_schedule=linear", "--train.weight_decay=0.05"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = os.path.join(d, "config.ini")
    text = open(config).read()
    assert "lr_schedule = linear" in text and "weight_decay = 0.05" in text, text[:2000]
    again = os.path.join(tempdir(), "m.jsonl")
    proc = run(2, ["train", "--config", config, f"--checkpoint.dir={tempdir()}", f"--train.metrics_file={again}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["loss"] for r in read_metrics(again)] == [r["loss"] for r in read_metrics(first)]


def evals(metrics):
    return [(r["step"], r["val_loss"]) for r in read_metrics(metrics, kind="eval")]


def test_keep_best_keeps_the_checkpoint_of_the_lowest_validation_loss():
    """checkpoint.keep_best with checkpoint.keep=1: after a run whose validation loss falls and then
    rises for a while (a learning rate too high), the run folder holds the newest checkpoint and the
    one of the lowest validation loss of all evaluations, which `best` names with that loss; a
    resumed run goes on comparing against it."""
    d = tempdir()
    metrics = os.path.join(d, "metrics.jsonl")
    common = ("--train.eval_every=1", "--checkpoint.keep=1", "--checkpoint.keep_best=true", "--train.lr=0.05",
              "--train.lr_schedule=constant", f"--checkpoint.dir={d}", f"--train.metrics_file={metrics}")
    seen, exercised = [], False
    for steps in (6, 12):
        proc = run(2, tiny_args(f"--train.steps={steps}", *common))
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen += [e for e in evals(metrics) if e not in seen]
        best_step, best_loss = min(seen, key=lambda e: (e[1], e[0]))
        with open(os.path.join(d, "best")) as f:
            name, loss = f.read().split()
        assert name == f"ckpt-{best_step:08d}.h5" and float(loss) == best_loss, (name, loss, seen)
        kept = sorted(n for n in os.listdir(d) if n.endswith(".h5"))
        assert kept == sorted({name, f"ckpt-{steps:08d}.h5"}), (kept, seen)
        exercised = exercised or best_step != steps
    assert exercised, f"the best was always the newest checkpoint, the test shows nothing: {seen}"


def test_keep_best_needs_validation():
    expect_usage_error(tiny_args("--checkpoint.keep_best=true", "--train.eval_every=0"),
                       "checkpoint.keep_best needs validation and saves")

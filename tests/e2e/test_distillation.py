"""Knowledge distillation (distill.*: a frozen teacher sharded beside the student) end to end, each
property against an independent oracle:

- a teacher identical to the student (the checkpoint the student starts from) gives zero KL and
  zero KL gradient: the first step's loss and gradient norm are alpha times those of the same run
  without distillation;
- the losses do not depend on the rank count (1, 2 and 3 ranks, to 1e-5 of the 1-rank run), with
  a teacher of another architecture and size (llama-tiny teaching gpt2-tiny) and FULL_SHARD's
  uneven padding on 3 ranks;
- a resume is exact (the steps after a saved step 2 are the straight run's, bit for bit), and a
  resume with another teacher exits 2 naming both checksums;
- the teacher's memory is reported per rank by category (the trainer checks it against its plan at
  start-up), and `plan` adds it to every candidate's peak;
- bad settings exit 2 on every rank naming the problem: another vocabulary, a path that is no
  model, alpha outside [0, 1]."""
import functools
import os

from harness import read_metrics, rel_diff, run, run_single, tempdir, tiny_args
from test_bad_input import expect_usage_error
from test_checkpoint import ckpt_name
from test_freeze import latest
from test_llama import llama_args, ok

STEPS = 4


@functools.lru_cache(maxsize=None)
def start_checkpoint(arch="gpt2"):
    """Two steps of the tiny model (gpt2) or llama-tiny on 2 ranks: the student's start and the teachers."""
    d = tempdir()
    args = (tiny_args if arch == "gpt2" else llama_args)("--train.steps=2", f"--checkpoint.dir={d}")
    ok(run(2, args), f"{arch} start run")
    return latest(d)


def distill_run(np_, *options, steps=STEPS, folder=None):
    """(step records, stdout) of a student run from the gpt2 start checkpoint."""
    d = folder or tempdir()
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = ok(run(np_, tiny_args(f"--train.steps={steps}", f"--checkpoint.dir={d}", "--train.eval_every=0",
                                 f"--checkpoint.init_from={start_checkpoint()}", f"--train.metrics_file={metrics}",
                                 *options)), f"np={np_} {options}")
    return read_metrics(metrics), proc.stdout


def test_a_teacher_identical_to_the_student_adds_no_kl_and_no_gradient():
    alpha = 0.3
    plain, _ = distill_run(2, steps=1)
    distilled, out = distill_run(2, f"--distill.teacher={start_checkpoint()}", f"--distill.alpha={alpha}",
                                 "--distill.temperature=2", steps=1)
    assert rel_diff(distilled[0]["loss"], alpha * plain[0]["loss"]) < 1e-6, (distilled[0], plain[0])
    assert rel_diff(distilled[0]["grad_norm"], alpha * plain[0]["grad_norm"]) < 1e-5, (distilled[0], plain[0])
    assert "distillation: teacher" in out and "teacher memory per rank: sharded_params" in out, out


@functools.lru_cache(maxsize=None)
def llama_teacher_losses(np_):
    rows, _ = distill_run(np_, f"--distill.teacher={start_checkpoint('llama')}", "--distill.alpha=0.25",
                          "--distill.temperature=1.5")
    return [r["loss"] for r in rows]


def test_losses_do_not_depend_on_the_rank_count_with_a_teacher_of_another_architecture():
    reference = llama_teacher_losses(1)
    plain = [r["loss"] for r in distill_run(1)[0]]
    assert max(rel_diff(a, b) for a, b in zip(reference, plain)) > 1e-2  # the teacher matters
    for np_ in (2, 3):
        losses = llama_teacher_losses(np_)
        assert len(losses) == STEPS
        assert max(rel_diff(a, b) for a, b in zip(losses, reference)) < 1e-5, (np_, losses, reference)


def test_resume_is_exact_and_refuses_another_teacher():
    options = (f"--distill.teacher={start_checkpoint('llama')}", "--distill.alpha=0.25", "--distill.temperature=1.5")
    d = tempdir()
    straight = [r["loss"] for r in distill_run(2, *options, "--checkpoint.every=2", "--checkpoint.keep=100",
                                               folder=d)[0]]
    saved = os.path.join(d, ckpt_name(2))
    resumed, _ = distill_run(2, *options, f"--checkpoint.resume={saved}")
    assert [r["step"] for r in resumed] == list(range(3, STEPS + 1))
    assert [r["loss"] for r in resumed] == straight[2:], (resumed, straight)  # same ranks: the same bits
    expect_usage_error(tiny_args(f"--train.steps={STEPS}", f"--checkpoint.resume={saved}",
                                 f"--checkpoint.init_from={start_checkpoint()}", f"--distill.teacher={start_checkpoint()}"),
                       "was distilled from a teacher with checksum", "resume with the same teacher")


def test_bad_teachers_and_settings_exit_2():
    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "peft", "llama", "base")  # vocabulary 96
    expect_usage_error(tiny_args(f"--distill.teacher={fixture}"), "has a vocabulary of 96 tokens, the student",
                       "256")
    expect_usage_error(tiny_args(f"--distill.teacher={tempdir()}"), "is neither a ShardTrain checkpoint")
    expect_usage_error(tiny_args(f"--distill.teacher={start_checkpoint()}", "--distill.alpha=1.5"),
                       "distill.alpha must be in [0, 1]")
    expect_usage_error(tiny_args(f"--distill.teacher={start_checkpoint()}", "--distill.temperature=0"),
                       "distill.temperature must be > 0")


def test_plan_counts_the_teacher():
    def peaks(*extra):
        proc = run_single(["plan", "--world-size=2", "--format=lines", *tiny_args(*extra)[1:]])
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, [int(l.split("peak_bytes=")[1].split()[0]) for l in proc.stdout.splitlines()
                             if l.startswith("PLAN ")]
    _, alone = peaks()
    out, with_teacher = peaks(f"--distill.teacher={start_checkpoint('llama')}")
    assert len(alone) == len(with_teacher) > 0
    assert all(t > a for a, t in zip(alone, with_teacher)), (alone, with_teacher)
    assert "teacher (distill.teacher, frozen, in peak/rank) with a shard group of 2: sharded_params" in out, out

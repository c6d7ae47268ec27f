"""The README's commands, as written, in order, in a scratch copy of the project folder: every
`build/shardtrain` and `mpirun` line of its sh blocks runs and succeeds, and its python blocks (the
recipe's tokenizer training, outside ShardTrain) run in the test virtual environment's python. Only
what a test must change is changed: training runs are cut to a few steps (a later --train.steps
wins), mpirun gets --oversubscribe (4 ranks on 2 cores), the README's placeholder step number in
checkpoint names becomes the one the runs reached, and its example inputs are written first: the
text file `mybook.txt` and the Hugging Face folder `models/gpt2` (a small random GPT-2); the
recipe's `stories.jsonl` is the README's own `data synth --jsonl` command's. GPU lines (build-cuda/)
and make targets are left to their own tests.

The recipe's output, shown in text blocks after its commands, is held to what the commands print
here where it does not depend on the step count or the machine: the lines of `data encode` (the
same documents and tokenizer give the same shards; the speed masked) and the model and data lines
of `train`; and `generate` must name the recorded tokenizer and stop at its end-of-text token."""
import os
import re
import shlex
import shutil
import subprocess

from harness import BUILD, ROOT, Skip, ensure_data, mpirun_command, tempdir, venv_python

STEPS = 3


def readme_text():
    return open(os.path.join(ROOT, "README.md")).read()


def readme_steps():
    """In the README's order: ("sh", words) for each command of its ```sh blocks (continuation
    lines joined, comments dropped) and ("python", code) for each ```python block."""
    steps = []
    for language, block in re.findall(r"```(sh|python)\n(.*?)```", readme_text(), re.S):
        if language == "python":
            steps.append(("python", block))
            continue
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                steps.append(("sh", words))
    return steps


def shown_output(command_part):
    """The lines of the ```text block that follows the ```sh block holding `command_part`."""
    for block, shown in re.findall(r"```sh\n(.*?)```\n\n```text\n(.*?)```", readme_text(), re.S):
        if command_part in block:
            return shown.splitlines()
    raise AssertionError(f"README.md: no ```text block after the command with {command_part!r}")


def scratch_project():
    """A folder laid out like the project after `make run` made its data: build/, inputs/*.ini and
    inputs/data/synth_*.bin, so the README's relative paths resolve, and its runs write here."""
    train, val = ensure_data()
    top = tempdir()
    os.symlink(BUILD, os.path.join(top, "build"))
    os.makedirs(os.path.join(top, "inputs", "data"))
    for name in os.listdir(os.path.join(ROOT, "inputs")):
        if name.endswith(".ini"):
            shutil.copy(os.path.join(ROOT, "inputs", name), os.path.join(top, "inputs"))
    for path in (train, val):
        os.symlink(path, os.path.join(top, "inputs", "data", os.path.basename(path)))
    with open(os.path.join(top, "mybook.txt"), "w") as f:
        f.write("It was the best of times, it was the worst of times, it was the age of wisdom.\n" * 400)
    # The README's Hugging Face folder: a small random GPT-2, written by the safetensors package.
    reference = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_reference.py")
    proc = subprocess.run([venv_python(), reference, "make", os.path.join(top, "models", "gpt2"), "2", "64", "4",
                           "256", "128", "F32", "1", "transformer."], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return top


def as_test_command(words):
    """The README command, runnable here; None for lines this test leaves to others."""
    if words[0] in ("make",) or any(w.startswith("build-cuda/") for w in words):
        return None
    words = [re.sub(r"ckpt-\d{8}", f"ckpt-{STEPS:08d}", w) for w in words]
    if "train" in words and "--help" not in words:
        words += [f"--train.steps={STEPS}", "--train.eval_every=0"]
    if words[0] == "mpirun":
        np_ = int(words[words.index("-np") + 1])
        rest = words[words.index("-np") + 2:]
        return mpirun_command(np_, rest, timeout=120)
    return ["timeout", "-k", "5", "120", *words]


def test_readme_commands_run_as_written():
    if shutil.which("h5dump") is None:
        raise Skip("h5dump is not installed")
    top = scratch_project()
    ran, printed = 0, []
    for kind, step in readme_steps():
        if kind == "python":
            proc = subprocess.run([venv_python(), "-c", step], cwd=top, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, f"README python block failed:\n{step}\n{proc.stderr[-2000:]}"
            continue
        command = as_test_command(step)
        if command is None:
            continue
        proc = subprocess.run(command, cwd=top, capture_output=True, text=True)
        assert proc.returncode == 0, f"README command failed (exit {proc.returncode}): {' '.join(step)}\n" \
                                     f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        printed.append((step, proc))
        ran += 1
    # help, three trainings, two encodes, generate, plan, inspect, export, h5dump at least
    assert ran >= 11, ran
    check_recipe_output(top, printed)
    assert os.path.getsize(os.path.join(top, "model.bin")) > 0
    assert os.path.getsize(os.path.join(top, "gpt2-mybook", "model.safetensors")) > 0
    assert os.path.getsize(os.path.join(top, "gpt2-lora", "adapter_model.safetensors")) > 0


def check_recipe_output(top, printed):
    def run_of(command_part):
        """(the README's words, the finished process) of the one command holding command_part."""
        runs = [(words, proc) for words, proc in printed if command_part in " ".join(words)]
        assert len(runs) == 1, (command_part, [" ".join(words) for words, _ in printed])
        return runs[0]

    def output_of(command_part):
        proc = run_of(command_part)[1]
        return proc.stdout + proc.stderr

    def mask_speed(line):
        return re.sub(r"in [\d.]+ s \([\d.]+ MB/s\)", "in T s (S MB/s)", line)

    encoded = [mask_speed(l) for l in output_of("data encode --tokenizer").splitlines()]
    shown = [l for l in shown_output("data encode --tokenizer") if l != "..."]
    assert len(shown) >= 3 and all(mask_speed(l) in encoded for l in shown), (shown, encoded)
    shards = sorted(n for n in os.listdir(os.path.join(top, "inputs", "data")) if n.startswith("stories_"))
    assert shards == [f"stories_train_{i:06d}.bin" for i in range(len(shards) - 1)] + ["stories_val.bin"], shards
    trained = output_of("--train.run_name=stories").splitlines()
    shown = [l for l in shown_output("--train.run_name=stories") if l.startswith(("model:", "data:"))]
    assert len(shown) == 2 and all(l in trained for l in shown), (shown, trained)
    words, generated = run_of("generate --checkpoint checkpoints/stories")
    assert "| tokenizer tokenizer.json |" in generated.stderr, generated.stderr
    assert "| stops at <|endoftext|> (id 0) |" in generated.stderr, generated.stderr
    assert generated.stdout.startswith(words[words.index("--prompt") + 1]), generated.stdout

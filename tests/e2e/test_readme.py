"""The README's commands, as written, in order, in a scratch copy of the project folder: every
`build/shardtrain` and `mpirun` line of its sh blocks runs and succeeds. Only what a test must change
is changed: training runs are cut to a few steps (a later --train.steps wins), mpirun gets
--oversubscribe (4 ranks on 2 cores), the README's placeholder step number in checkpoint names becomes
the one the runs reached, and its example text file `mybook.txt` and Hugging Face folder
`models/gpt2` (a small random GPT-2) are written first. GPU lines
(build-cuda/) and make targets are left to their own tests."""
import os
import re
import shlex
import shutil
import subprocess

from harness import BUILD, ROOT, Skip, ensure_data, mpirun_command, tempdir, venv_python

STEPS = 3


def readme_commands():
    """Each command of the README's ```sh blocks: continuation lines joined, comments dropped."""
    text = open(os.path.join(ROOT, "README.md")).read()
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


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
    ran = 0
    for words in readme_commands():
        command = as_test_command(words)
        if command is None:
            continue
        proc = subprocess.run(command, cwd=top, capture_output=True, text=True)
        assert proc.returncode == 0, f"README command failed (exit {proc.returncode}): {' '.join(words)}\n" \
                                     f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        ran += 1
    # help, two trainings, encode + own-data training, plan, inspect, export, h5dump at least
    assert ran >= 8, ran
    assert os.path.getsize(os.path.join(top, "model.bin")) > 0
    assert os.path.getsize(os.path.join(top, "gpt2-mybook", "model.safetensors")) > 0
    assert os.path.getsize(os.path.join(top, "gpt2-lora", "adapter_model.safetensors")) > 0

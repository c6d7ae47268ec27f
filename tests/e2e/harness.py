"""Helpers for the end-to-end tests: run build/shardtrain under a real mpirun (always inside
`timeout`), create test data with the program itself, and read the JSON Lines metrics."""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("SHARDTRAIN_BUILD", os.path.join(ROOT, "build"))
EXE = os.path.join(BUILD, "shardtrain")
DATA_DIR = os.path.join(BUILD, "test-data")

if os.geteuid() == 0:  # Open MPI refuses root without explicit consent
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


class Skip(Exception):
    """Raised by a test that cannot run here; counted as skipped."""


def mpirun_command(np_, argv, timeout=120, mpirun_args=()):
    # --bind-to none: ranks must not be pinned to one core each when they use 2 threads.
    return ["timeout", "-k", "5", str(timeout), "mpirun", *mpirun_args, "--oversubscribe", "--bind-to", "none",
            "-np", str(np_), *argv]


def run(np_, args, timeout=120, cwd=ROOT, env=None):
    """Runs `shardtrain ARGS` on np_ ranks; returns the CompletedProcess (text output). `env`: extra
    environment variables of the ranks."""
    return subprocess.run(mpirun_command(np_, [EXE, *args], timeout), cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **env} if env else None)


def run_single(args, timeout=60, cwd=ROOT):
    """Runs `shardtrain ARGS` as one process without mpirun (singleton MPI)."""
    return subprocess.run(["timeout", "-k", "5", str(timeout), EXE, *args], cwd=cwd, capture_output=True, text=True)


def run_measured(args, timeout=120, cwd=ROOT):
    """Runs `shardtrain ARGS` as the only child of a fresh python, so that its peak resident memory is
    its own (a test process's RUSAGE_CHILDREN holds every earlier test's children); returns the
    CompletedProcess and that peak in bytes."""
    probe = ("import json, resource, subprocess, sys\n"
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
             "print(json.dumps({'rc': p.returncode, 'out': p.stdout, 'err': p.stderr,\n"
             "                  'rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))")
    proc = subprocess.run(["timeout", "-k", "5", str(timeout), sys.executable, "-c", probe, EXE, *args], cwd=cwd,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    return subprocess.CompletedProcess(args, r["rc"], r["out"], r["err"]), r["rss"]


def ensure_data():
    """The synthetic corpus, written once per build by the program itself."""
    train = os.path.join(DATA_DIR, "synth_train.bin")
    if not os.path.exists(train):
        proc = run_single(["data", "synth", "--out-dir", DATA_DIR])
        assert proc.returncode == 0, proc.stderr
    return train, os.path.join(DATA_DIR, "synth_val.bin")


def tiny_args(*overrides):
    """`train` arguments for inputs/tiny.ini on the test data, plus --section.key=value overrides."""
    train, val = ensure_data()
    # A given SGEMM peak skips the start-up measurement (0.3 s per run); MFU is not tested here.
    # Each run gets its own checkpoint folder unless the test names one (auto-resume is the default).
    options = {"--data.train_file": train, "--data.val_file": val, "--train.peak_gflops": "100",
               "--checkpoint.dir": tempdir()}
    for item in overrides:  # a later value for the same key replaces the earlier one
        key, _, value = item.partition("=")
        options[key] = value
    return ["train", "--config", os.path.join(ROOT, "inputs", "tiny.ini"),
            *(f"{key}={value}" for key, value in options.items())]


def read_metrics(path, kind="step"):
    with open(path) as f:
        return [r for r in (json.loads(line) for line in f if line.strip()) if r["kind"] == kind]


_TEMPDIRS = []


def tempdir():
    """A fresh folder, removed when the test process exits (a test leaves nothing in /tmp)."""
    path = tempfile.mkdtemp(prefix="shardtrain-test-")
    _TEMPDIRS.append(path)
    return path


@atexit.register
def _remove_tempdirs():
    for path in _TEMPDIRS:
        shutil.rmtree(path, ignore_errors=True)


def rel_diff(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def venv_python():
    """The python of the test virtual environment that tests/run_tests.py makes (the tensorboard
    package); raises Skip, with the reason, where it could not be made."""
    python = os.environ.get("SHARDTRAIN_TEST_PYTHON")
    if not python:
        raise Skip(os.environ.get("SHARDTRAIN_TEST_VENV_MISSING", "no test virtual environment: run the test "
                                  "through tests/run_tests.py, which makes it"))
    return python

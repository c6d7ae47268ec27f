#!/usr/bin/env python3
"""Runs every ShardTrain test suite and ends with the line `N passed, N failed, N skipped`.

Suites, in order: the GoogleTest unit tests (one process), the GoogleTest multi-rank tests under
`mpirun -np 1..4`, and the end-to-end tests in tests/e2e/test_*.py (plain functions named test_*,
which drive build/shardtrain through mpirun). Every mpirun is wrapped in `timeout`. The exit code
is 0 only when nothing failed.
"""
import argparse
import fnmatch
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))


class Tally:
    def __init__(self):
        self.passed = self.failed = self.skipped = 0
        self.failures = []
        self.skips = []  # (name, why)

    def record(self, name, outcome, detail=""):
        setattr(self, outcome, getattr(self, outcome) + 1)
        mark = {"passed": "ok  ", "failed": "FAIL", "skipped": "skip"}[outcome]
        print(f"  {mark} {name}{'  (' + detail + ')' if detail else ''}", flush=True)
        if outcome == "failed":
            self.failures.append(name)
        if outcome == "skipped":
            self.skips.append((name, detail))


def read_expected_skips(path):
    """The fnmatch patterns of tests that may skip (one a line, `# why` after it)."""
    patterns = []
    with open(path) as f:
        for line in f:
            pattern = line.split("#", 1)[0].strip()
            if pattern:
                patterns.append(pattern)
    return patterns


def run_unit_tests(build, tally, pattern):
    print("== unit tests (GoogleTest)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "unit.json")
        cmd = [os.path.join(build, "unit_tests"), f"--gtest_output=json:{report}"]
        if pattern:
            cmd.append(f"--gtest_filter=*{pattern}*")
        proc = subprocess.run(["timeout", "600", *cmd], cwd=ROOT, capture_output=True, text=True)
        if not os.path.exists(report):
            tally.record("unit_tests", "failed", f"no report, exit {proc.returncode}")
            print(proc.stdout[-4000:], proc.stderr[-4000:])
            return
        for suite in json.load(open(report))["testsuites"]:
            for case in suite["testsuite"]:
                name = f"{suite['name']}.{case['name']}"
                if case.get("result") == "SKIPPED" or case.get("status") == "NOTRUN":
                    tally.record(name, "skipped")
                elif case.get("failures"):
                    tally.record(name, "failed")
                    for f in case["failures"]:
                        print("      " + f["failure"].replace("\n", "\n      ")[:2000])
                else:
                    tally.record(name, "passed", f"{case.get('time', '')}")


def run_mpi_tests(build, tally, pattern):
    print("== multi-rank tests (GoogleTest under mpirun -np 1..4)", flush=True)
    from harness import mpirun_command
    for np_ in (1, 2, 3, 4):
        cmd = mpirun_command(np_, [os.path.join(build, "mpi_tests"), "--gtest_color=no"], timeout=300)
        if pattern:
            cmd.append(f"--gtest_filter=*{pattern}*")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=os.environ)
        seen = False
        for line in proc.stdout.splitlines():
            m = re.match(r"\[\s+(OK|FAILED)\s+\] (\S+) \(", line)
            if m:
                seen = True
                tally.record(f"{m.group(2)} [np={np_}]", "passed" if m.group(1) == "OK" else "failed")
        # Without a filter, a run that reports no test at all is a failure (a crash at start-up).
        if proc.returncode != 0 or (not seen and not pattern):
            tally.record(f"mpi_tests [np={np_}] exit status", "failed", f"exit {proc.returncode}")
            print(proc.stdout[-4000:], proc.stderr[-4000:])


# What some e2e tests need beyond Debian's packages (the tensorboard package's event reader, Hugging
# Face's safetensors reader and writer, its tokenizers package as the tokenizer's oracle), pinned with
# their dependencies (tokenizers needs huggingface_hub and its tree). Installed once per build
# folder by ensure_test_venv, never at run time.
TEST_VENV_REQUIREMENTS = [
    "tensorboard==2.20.0", "safetensors==0.7.0", "tensorboard-data-server==0.7.2", "protobuf==7.36.2", "grpcio==1.85.1",
    "absl-py==2.5.1", "Markdown==3.11.3", "MarkupSafe==3.0.4", "Werkzeug==3.1.9", "packaging==26.3",
    "pillow==13.0.0", "typing_extensions==4.16.0",
    "tokenizers==0.22.1", "huggingface-hub==1.33.0", "click==8.5.1", "filelock==4.2.12", "fsspec==2026.9.0",
    "hf-xet==1.8.0", "httpx==0.28.1", "httpcore==1.0.9", "h11==0.16.0", "anyio==4.16.0", "idna==3.20",
    "certifi==2026.10.18", "pyyaml==6.0.3", "tqdm==4.70.1", "Jinja2==3.1.6",
]


def ensure_test_venv(build):
    """Creates <build>/test-venv with TEST_VENV_REQUIREMENTS once (a stamp file names their hash);
    --system-site-packages keeps Debian's numpy, h5py and matplotlib visible. Returns (python, None),
    or (None, why not) when it cannot be made (PyPI unreachable): the tests that need it skip."""
    venv = os.path.join(build, "test-venv")
    python = os.path.join(venv, "bin", "python")
    digest = hashlib.sha256("\n".join(TEST_VENV_REQUIREMENTS).encode()).hexdigest()[:12]
    stamp = os.path.join(venv, f".installed-{digest}")
    os.makedirs(build, exist_ok=True)
    with open(os.path.join(build, ".test-venv.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs on one build folder: one installs
        if os.path.exists(stamp):
            return python, None
        print(f"== test virtual environment {venv}: installing {TEST_VENV_REQUIREMENTS[0]} (once)", flush=True)
        steps = [["/usr/bin/python3", "-m", "venv", "--system-site-packages", "--clear", venv],
                 [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--retries", "1",
                  "--timeout", "20", *TEST_VENV_REQUIREMENTS]]
        for cmd in steps:
            proc = subprocess.run(["timeout", "900", *cmd], capture_output=True, text=True)
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit {proc.returncode}"]
                why = f"{' '.join(cmd[:4])} failed: {lines[-1][:300]}"
                return None, f"no test virtual environment (is PyPI reachable?): {why}"
        open(stamp, "w").close()
    return python, None


def run_e2e_tests(tally, pattern):
    print("== end-to-end tests (build/shardtrain under mpirun)", flush=True)
    import harness
    e2e_dir = os.path.join(ROOT, "tests", "e2e")
    for file in sorted(os.listdir(e2e_dir)):
        if not (file.startswith("test_") and file.endswith(".py")):
            continue
        spec = importlib.util.spec_from_file_location(file[:-3], os.path.join(e2e_dir, file))
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception:
            tally.record(f"{file[:-3]} (import)", "failed")
            print("      " + traceback.format_exc().replace("\n", "\n      "))
            continue
        for name in sorted(n for n in dir(module) if n.startswith("test_")):
            full = f"{file[:-3]}.{name}"
            if pattern and pattern not in full:
                continue
            start = time.time()
            try:
                getattr(module, name)()
                tally.record(full, "passed", f"{time.time() - start:.1f}s")
            except harness.Skip as e:
                tally.record(full, "skipped", str(e))
            except Exception:
                tally.record(full, "failed", f"{time.time() - start:.1f}s")
                print("      " + traceback.format_exc().replace("\n", "\n      "))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default="build")
    parser.add_argument("-k", dest="pattern", default="", help="run only tests whose name contains this")
    parser.add_argument("--suite", choices=["all", "unit", "mpi", "e2e"], default="all")
    parser.add_argument("--expected-skips", default="",
                        help="a file of the tests that may skip (fnmatch patterns); any other skip fails the run "
                             "(CI: a test it expected to run must not pass by skipping)")
    args = parser.parse_args()
    build = os.path.abspath(os.path.join(ROOT, args.build))
    os.environ["SHARDTRAIN_BUILD"] = build
    tally = Tally()
    start = time.time()
    if args.suite in ("all", "unit"):
        run_unit_tests(build, tally, args.pattern)
    if args.suite in ("all", "mpi"):
        run_mpi_tests(build, tally, args.pattern)
    if args.suite in ("all", "e2e"):
        python, why_not = ensure_test_venv(build)
        os.environ["SHARDTRAIN_TEST_PYTHON" if python else "SHARDTRAIN_TEST_VENV_MISSING"] = python or why_not
        run_e2e_tests(tally, args.pattern)
    print(f"== {time.time() - start:.0f} s")
    for f in tally.failures:
        print(f"FAILED: {f}")
    unexpected = []
    if args.expected_skips:
        allowed = read_expected_skips(os.path.join(ROOT, args.expected_skips))
        unexpected = [(n, why) for n, why in tally.skips if not any(fnmatch.fnmatchcase(n, p) for p in allowed)]
        for name, why in unexpected:
            print(f"UNEXPECTED SKIP: {name} ({why}); a test this machine should run did not (see {args.expected_skips})")
    print(f"{tally.passed} passed, {tally.failed} failed, {tally.skipped} skipped"
          + (f" ({len(unexpected)} unexpected)" if args.expected_skips else ""))
    sys.exit(1 if tally.failed or unexpected else 0)


if __name__ == "__main__":
    main()

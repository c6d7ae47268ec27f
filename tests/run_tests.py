#!/usr/bin/env python3
"""Runs every ShardTrain test suite and ends with the line `N passed, N failed, N skipped`.

Suites, in order: the GoogleTest unit tests (one process), the GoogleTest multi-rank tests under
`mpirun -np 1..4`, and the end-to-end tests in tests/e2e/test_*.py (plain functions named test_*,
which drive build/shardtrain through mpirun). Every mpirun is wrapped in `timeout`. The exit code
is 0 only when nothing failed.
"""
import argparse
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

    def record(self, name, outcome, detail=""):
        setattr(self, outcome, getattr(self, outcome) + 1)
        mark = {"passed": "ok  ", "failed": "FAIL", "skipped": "skip"}[outcome]
        print(f"  {mark} {name}{'  (' + detail + ')' if detail else ''}", flush=True)
        if outcome == "failed":
            self.failures.append(name)


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
        run_e2e_tests(tally, args.pattern)
    print(f"== {time.time() - start:.0f} s")
    for f in tally.failures:
        print(f"FAILED: {f}")
    print(f"{tally.passed} passed, {tally.failed} failed, {tally.skipped} skipped")
    sys.exit(1 if tally.failed else 0)


if __name__ == "__main__":
    main()

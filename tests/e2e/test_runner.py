"""The test runner itself: under --expected-skips (make test CI=1) a skip that the file does not
list fails the run, naming the test and its reason; a listed one does not. The probe is
test_gpu_memory, which skips on a machine without a GPU."""
import os
import subprocess
import sys

from harness import ROOT, Skip, tempdir


def runner(expected_skips):
    path = os.path.join(tempdir(), "skips.txt")
    with open(path, "w") as f:
        f.write(expected_skips)
    build = os.environ.get("SHARDTRAIN_BUILD", os.path.join(ROOT, "build"))
    return subprocess.run([sys.executable, os.path.join(ROOT, "tests", "run_tests.py"), "--build", build,
                           "--suite", "e2e", "-k", "test_gpu_memory", "--expected-skips", path],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_an_unlisted_skip_fails_the_run():
    unlisted = runner("# nothing may skip\nsome_other_test.*  # listed, but not the probe\n")
    if " skip " not in unlisted.stdout:
        raise Skip("test_gpu_memory ran here (a GPU and a CUDA build): nothing skipped to probe with")
    assert unlisted.returncode == 1, unlisted.stdout[-2000:]
    assert "UNEXPECTED SKIP: test_gpu_memory.test_reserved_gpu_memory_is_within_tolerance_of_the_plan (no GPU" \
        in unlisted.stdout, unlisted.stdout[-2000:]
    assert unlisted.stdout.rstrip().endswith("0 passed, 0 failed, 1 skipped (1 unexpected)"), unlisted.stdout[-500:]
    listed = runner("test_gpu_memory.*  # no GPU here\n")
    assert listed.returncode == 0, listed.stdout[-2000:]
    assert listed.stdout.rstrip().endswith("0 passed, 0 failed, 1 skipped (0 unexpected)"), listed.stdout[-500:]

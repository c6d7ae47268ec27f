"""Runtime behaviour: the watchdog turns a stalled rank into an abort with a message instead of a
hang; the data commands make trainable files from any text."""
import os
import signal
import subprocess
import time

from harness import EXE, ROOT, mpirun_command, read_metrics, run, run_single, tempdir, tiny_args


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


def checkpoint_for_tools():
    ckdir = tempdir()
    proc = run(2, tiny_args("--train.steps=2", f"--checkpoint.dir={ckdir}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return os.path.join(ckdir, "ckpt-00000002.h5")


def stalled(np_, args, point, rank=1, timeout=60):
    """Runs ARGS with rank `rank` asleep for 60 s at `point` (Runtime::debug_stall); returns the
    CompletedProcess and the seconds it took."""
    start = time.time()
    proc = run(np_, args, timeout=timeout, env={"SHARDTRAIN_DEBUG_STALL": f"{rank}:{point}:60"})
    return proc, time.time() - start


def test_every_command_times_start_up_and_finalize_with_its_own_option():
    """A rank that never reaches MPI_Init, or never leaves for MPI_Finalize, ends the job within the
    command's timeout, and the message names the option the command has (the battery: convert
    ignored --comm-timeout for a stopped rank, and generate's message named fsdp.comm_timeout)."""
    ckpt = checkpoint_for_tools()
    commands = {
        "convert": ["convert", "--input", ckpt, "--output", os.path.join(tempdir(), "hf"), "--comm-timeout", "3"],
        "export": ["export", ckpt, "--output", os.path.join(tempdir(), "hf"), "--format", "hf", "--comm-timeout=3"],
        "generate": ["generate", "--checkpoint", ckpt, "--prompt", "ab", "--max-tokens", "2",
                     "--comm-timeout", "3"],
        "data synth": ["data", "synth", "--out-dir", tempdir(), "--train-bytes", "4096", "--comm-timeout", "3"],
    }
    for name, args in commands.items():
        for point, collective in (("init", "MPI_Init"), ("finalize", "MPI_Finalize")):
            proc, elapsed = stalled(2, args, point)
            case = f"{name}, rank 1 stalled at {point}"
            assert proc.returncode not in (0, 124, 137), f"{case}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
            assert f"collective {collective} did not complete within --comm-timeout=3 s" in proc.stderr, \
                f"{case}:\n{proc.stderr[-2000:]}"
            assert "fsdp.comm_timeout" not in proc.stderr, f"{case}:\n{proc.stderr[-2000:]}"
            assert elapsed < 30, f"{case}: the job ended after {elapsed:.0f} s"


def test_train_times_start_up_with_fsdp_comm_timeout():
    proc, elapsed = stalled(2, tiny_args("--fsdp.comm_timeout=3"), "init")
    assert proc.returncode not in (0, 124, 137), proc.stderr[-2000:]
    assert "collective MPI_Init did not complete within fsdp.comm_timeout=3 s" in proc.stderr, proc.stderr[-2000:]
    assert elapsed < 30, f"the job ended after {elapsed:.0f} s"


def test_serial_work_on_rank_0_may_outlast_the_timeout():
    """data commands run on rank 0 alone; the others wait for its heartbeat, not for a collective, so
    work longer than --comm-timeout (a large corpus) finishes."""
    out = tempdir()
    start = time.time()
    proc = run(3, ["data", "synth", "--out-dir", out, "--train-bytes", "4096", "--comm-timeout", "1"],
               env={"SHARDTRAIN_DEBUG_STALL": "0:root-work:4"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.time() - start > 4
    assert os.path.getsize(os.path.join(out, "synth_train.bin")) > 4096


def rank_pid(rank, marker):
    """The pid of the shardtrain rank `rank` whose command line contains `marker`."""
    for pid in os.listdir("/proc"):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if cmdline[0].endswith(b"shardtrain") and marker.encode() in cmdline and \
                f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(pid)
    return None


def test_a_stopped_rank_0_ends_the_serial_wait():
    out = tempdir()
    args = ["data", "synth", "--out-dir", out, "--train-bytes", "4096", "--comm-timeout", "2"]
    env = {**os.environ, "SHARDTRAIN_DEBUG_STALL": "0:root-work:60"}
    proc = subprocess.Popen(mpirun_command(2, [EXE, *args], timeout=60), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = None
    deadline = time.time() + 20
    while pid is None and time.time() < deadline:
        time.sleep(0.2)
        pid = rank_pid(0, out)
    assert pid is not None, "rank 0 never started"
    time.sleep(1)  # inside its work by now (the heartbeat is running)
    start = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode not in (0, 124, 137), stderr[-2000:]
    assert "rank 0 sent no heartbeat for 2 s while it ran data synth alone (--comm-timeout=2 s)" in stderr, \
        stderr[-2000:]
    assert time.time() - start < 30


def test_openmp_threads_spin_briefly_unless_the_user_chose():
    """The program runs with GOMP_SPINCOUNT=30000 (libgomp's 300,000 spins halve a 2-thread rank's
    speed when other processes share the cores: docs/performance.md), set by re-executing itself
    before MPI_Init; a GOMP_SPINCOUNT or OMP_WAIT_POLICY of the user's is kept."""
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    for extra, want in (({}, "GOMP_SPINCOUNT=30000"), ({"GOMP_SPINCOUNT": "1234"}, "GOMP_SPINCOUNT=1234"),
                        ({"OMP_WAIT_POLICY": "passive"}, None)):
        env = {**base, **extra, "SHARDTRAIN_DEBUG_STALL": "0:init:3"}  # asleep before MPI_Init: look then
        proc = subprocess.Popen([EXE, "data", "synth", "--out-dir", tempdir(), "--train-bytes", "4096"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.5)
        environ = open(f"/proc/{proc.pid}/environ", "rb").read().decode().split("\0")
        name = open(f"/proc/{proc.pid}/comm").read().strip()  # its own name still (pgrep, ps, Slurm)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        spins = [e for e in environ if e.startswith("GOMP_SPINCOUNT=")]
        assert spins == ([want] if want else []), (extra, spins)
        assert name == "shardtrain", name


def test_a_crash_names_where_it_happened():
    """A rank that calls a null function pointer after MPI_Init (Runtime::debug_stall's `segv`)
    prints the caller as module+offset, which addr2line resolves to the function that made the
    call; the process still dies of SIGSEGV. Open MPI's own handler stopped its backtrace at the
    signal frame when this happened in a cluster test, and named nothing."""
    proc = run(2, ["version"], timeout=60, env={"SHARDTRAIN_DEBUG_STALL": "1:finalize:segv"})
    assert proc.returncode not in (0, 124, 137), proc.stderr[-2000:]
    assert "rank 1] internal error: SIGSEGV" in proc.stderr, proc.stderr[-2000:]
    caller = [line for line in proc.stderr.splitlines() if "a call through a null function pointer" in line]
    assert caller, proc.stderr[-2000:]
    module, offset = caller[0].rsplit(" ", 1)[1].split("+")
    assert os.path.samefile(module, EXE), caller[0]
    named = subprocess.run(["addr2line", "-f", "-C", "-e", module, offset], capture_output=True, text=True)
    assert "Runtime::debug_stall" in named.stdout, (caller[0], named.stdout)
    single = subprocess.run([EXE, "version"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "SHARDTRAIN_DEBUG_STALL": "0:init:segv"})
    assert single.returncode == -signal.SIGSEGV, (single.returncode, single.stderr[-2000:])
    assert "internal error: SIGSEGV" in single.stderr, single.stderr[-2000:]

"""The edges of running, stopping and reading a run: the run folder, a second start, resumes on other
inputs, signals at awkward moments and through mpirun, failed metric writes, MFU and measured memory."""
import os
import shutil
import signal
import subprocess
import time

from harness import EXE, ROOT, ensure_data, mpirun_command, read_metrics, run, tempdir, tiny_args
from test_signals import STEPS, rank_pids, uninterrupted, wait_for_steps


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


def test_metrics_go_to_the_run_folder_and_a_finished_run_trains_nothing():
    ckdir = os.path.join(tempdir(), "run")
    first = ok(run(2, tiny_args(f"--checkpoint.dir={ckdir}", "--train.steps=4")))
    metrics = os.path.join(ckdir, "metrics.jsonl")
    assert f"metrics: {metrics}" in first.stdout
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4]
    before = open(metrics).read()
    again = ok(run(2, tiny_args(f"--checkpoint.dir={ckdir}", "--train.steps=4")))
    assert "already finished" in again.stdout and "step     1/" not in again.stdout
    assert open(metrics).read() == before
    more = ok(run(2, tiny_args(f"--checkpoint.dir={ckdir}", "--train.steps=6")))  # raising steps continues
    assert "at step 4" in more.stdout
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4, 5, 6]


def test_resume_on_other_data_is_refused_unless_allowed():
    ckdir = os.path.join(tempdir(), "run")
    train, _ = ensure_data()
    other = os.path.join(tempdir(), "other_train.bin")
    shutil.copy(train, other)
    ok(run(2, tiny_args(f"--checkpoint.dir={ckdir}", "--train.steps=2")))
    proc = run(2, tiny_args(f"--checkpoint.dir={ckdir}", "--train.steps=4", f"--data.train_file={other}"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(errors) == 1 and "data.train_file" in errors[0] and "checkpoint.allow_data_change" in errors[0], errors
    allowed = ok(run(2, tiny_args(f"--checkpoint.dir={ckdir}", "--train.steps=4", f"--data.train_file={other}",
                                  "--checkpoint.allow_data_change=true")))
    assert "at step 2" in allowed.stdout
    # Steps, run name and metrics path may change on a resume (requeued jobs rename runs).
    ok(run(2, tiny_args(f"--checkpoint.dir={ckdir}", "--train.steps=5", f"--data.train_file={other}",
                        "--train.run_name=renamed", f"--train.metrics_file={os.path.join(tempdir(), 'm.jsonl')}")))


def test_resume_names_each_changed_option():
    ckdir = os.path.join(tempdir(), "run")
    ok(run(2, tiny_args(f"--checkpoint.dir={ckdir}", "--train.steps=2", "--fsdp.memory_limit=64MiB")))
    proc = ok(run(2, tiny_args(f"--checkpoint.dir={ckdir}", "--train.steps=3", "--train.lr=0.002",
                               "--fsdp.param_dtype=bf16", "--fsdp.memory_limit=32MiB")))
    warning = [l for l in proc.stderr.splitlines() if "changed configuration" in l]
    assert len(warning) == 1, proc.stderr
    for change in ("train.steps: 2 -> 3", "train.lr: 0.003 -> 0.002", "fsdp.param_dtype: fp32 -> bf16",
                   "fsdp.memory_limit: 64MiB -> 32MiB"):
        assert change in warning[0], (change, warning[0])
    assert "checkpoint.resume" not in warning[0] and "checkpoint.dir" not in warning[0], warning[0]


def test_failed_metrics_write_stops_every_rank():
    proc = run(2, tiny_args("--train.metrics_file=/dev/full"))  # opens, but every write fails with ENOSPC
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cannot write train.metrics_file '/dev/full'" in proc.stderr and "No space left" in proc.stderr


def test_mfu_is_never_above_one():
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = ok(run(2, tiny_args("--train.peak_gflops=0.001", f"--train.metrics_file={metrics}", "--train.steps=4")))
    assert "above the given (train.peak_gflops) peak" in proc.stderr
    mfus = [r["mfu"] for r in read_metrics(metrics)]
    assert all(0 < m <= 1.0 for m in mfus) and max(mfus) == 1.0, mfus


def test_log_every_prints_every_nth_step_and_a_final_line():
    proc = ok(run(2, tiny_args("--train.log_every=4", "--train.steps=10", "--train.eval_every=0")))
    printed = [int(l.split()[1].split("/")[0]) for l in proc.stdout.splitlines() if l.startswith("step ")]
    assert printed == [1, 4, 8, 10], printed
    final = [l for l in proc.stdout.splitlines() if l.startswith("done:")]
    assert len(final) == 1 and "final loss" in final[0] and "tok/s" in final[0], final


def test_memory_held_matches_the_plan():
    """What the DeviceArrays and the MPI ring's buffers really hold (counted at allocation) equals the
    plan, byte for byte, on 2 and 3 ranks (3: units padded, shards of unequal use)."""
    cases = [(), ("--fsdp.sharding_strategy=SHARD_GRAD_OP",), ("--fsdp.sharding_strategy=NO_SHARD",),
             ("--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=1"),
             ("--fsdp.activation_checkpointing=true",), ("--fsdp.param_dtype=bf16",), ("--fsdp.reduce_dtype=bf16",),
             ("--fsdp.reduce_every_microbatch=false",), ("--fsdp.limit_all_gathers=3",),
             ("--fsdp.cpu_offload=true",), ("--train.micro_batch=4", "--train.seq_len=64"),
             # The root unit larger than a block, reduced after them: the ring's buffers must grow
             # to its size exactly, not geometrically (test_llama.py: llama's untied head does this).
             ("--model.vocab_size=512",)]
    for case in cases:
        metrics = os.path.join(tempdir(), "m.jsonl")
        np_ = 3 if case == () else 2
        proc = ok(run(np_, tiny_args(f"--train.metrics_file={metrics}", "--train.steps=2", *case)))
        r = read_metrics(metrics)[-1]
        held, planned = r["held_mem_bytes"], r["peak_mem_bytes"]
        assert held == planned, f"{case}: held {held} vs planned {planned}"
        if "--fsdp.cpu_offload=true" in case:
            assert "saves nothing" in proc.stdout


def signalled_run(ckdir, metrics, *extra, mpirun_args=()):
    args = tiny_args(f"--train.steps={STEPS}", f"--checkpoint.dir={ckdir}", f"--train.metrics_file={metrics}",
                     "--checkpoint.every=0", "--train.eval_every=0", *extra)
    cmd = mpirun_command(2, [EXE, *args], timeout=120, mpirun_args=mpirun_args)
    # A session of its own: the signal goes to mpirun alone, as a terminal's Ctrl-C would reach it.
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def mpirun_of(proc):
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    return int(children[0])


def test_save_false_saves_nothing_on_a_signal():
    ckdir, metrics = tempdir(), os.path.join(tempdir(), "m.jsonl")
    proc = signalled_run(ckdir, metrics, "--checkpoint.save=false")
    wait_for_steps(metrics, 2, proc)
    os.kill(mpirun_of(proc), signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, out[-2000:] + err[-2000:]
    assert "nothing was saved" in out and os.listdir(ckdir) == [], os.listdir(ckdir)


def catches(pid, signum):
    """Whether process `pid` has a handler for `signum` (the SigCgt mask in /proc)."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


def test_signal_during_start_up_stops_cleanly():
    """SIGTERM to the ranks as soon as they catch it (main's first line, before MPI_Init): exit 3,
    no kill. Before that line the kernel's default action applies; no program can catch earlier."""
    ckdir, metrics = tempdir(), os.path.join(tempdir(), "m.jsonl")
    proc = signalled_run(ckdir, metrics)
    deadline = time.time() + 20
    while time.time() < deadline:
        pids = rank_pids(ckdir)
        if len(pids) == 2 and all(catches(pid, signal.SIGTERM) for pid in pids):
            break
        time.sleep(0.001)
    for pid in rank_pids(ckdir):
        os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-2000:]}"
    assert "stopped at step" in out and os.path.exists(os.path.join(ckdir, "STOPPED"))


def test_sigint_to_mpirun_with_time_to_save_resumes_exactly():
    """One Ctrl-C to mpirun: with odls_base_sigkill_timeout the ranks get SIGTERM that many seconds
    later and as long again to save (docs/cluster.md); the run resumes bit for bit."""
    ckdir, metrics = tempdir(), os.path.join(tempdir(), "m.jsonl")
    proc = signalled_run(ckdir, metrics, mpirun_args=("--mca", "odls_base_sigkill_timeout", "5"))
    wait_for_steps(metrics, 3, proc)
    os.kill(mpirun_of(proc), signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    stopped_at = int(open(os.path.join(ckdir, "STOPPED")).read().split()[1])
    assert os.path.exists(os.path.join(ckdir, f"ckpt-{stopped_at:08d}.h5")), os.listdir(ckdir)
    again = ok(run(2, tiny_args(f"--train.steps={STEPS}", f"--checkpoint.dir={ckdir}",
                                f"--train.metrics_file={metrics}", "--train.eval_every=0")))
    assert f"at step {stopped_at}" in again.stdout
    assert [r["loss"] for r in read_metrics(metrics)] == uninterrupted()


def test_ctrl_c_under_mpirun_tells_the_terminal_what_happened():
    """mpirun relays no output after its Ctrl-C and exits 1 after its kill sequence, so rank 0 writes
    the stop line to the terminal itself: here mpirun's controlling terminal is a pty, as under an
    interactive shell, and the line must appear on it with the saved step. The grace is 5 s, not
    mpirun's default 1 s: under a loaded CI machine a step plus a save can take longer than 1 s, and
    then the ranks are killed before they save (what docs/cluster.md says for large models)."""
    import fcntl
    import pty
    import termios
    import threading
    ckdir, metrics = tempdir(), os.path.join(tempdir(), "m.jsonl")
    cmd = mpirun_command(2, [EXE, *tiny_args(f"--train.steps={STEPS}", f"--checkpoint.dir={ckdir}",
                                             f"--train.metrics_file={metrics}", "--checkpoint.every=0",
                                             "--train.eval_every=0")], timeout=120,
                         mpirun_args=("--mca", "odls_base_sigkill_timeout", "5"))
    master, slave = pty.openpty()

    def own_terminal():  # a session whose controlling terminal is the pty
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, preexec_fn=own_terminal)
    os.close(slave)
    seen = []

    def read_terminal():
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # every writer gone
                return
            if not chunk:
                return
            seen.append(chunk)
    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    wait_for_steps(metrics, 3, proc)
    os.kill(mpirun_of(proc), signal.SIGINT)
    proc.wait(timeout=60)
    reader.join(timeout=10)
    os.close(master)
    text = b"".join(seen).decode(errors="replace")
    assert os.path.exists(os.path.join(ckdir, "STOPPED")), text[-3000:]
    stopped_at = int(open(os.path.join(ckdir, "STOPPED")).read().split()[1])
    line = next((l for l in text.splitlines() if l.startswith("shardtrain: stopped at step")), None)
    assert line is not None, text[-3000:]
    assert f"step {stopped_at} is saved in {ckdir}" in line and "exits with code 1" in line, line


def test_repeated_signals_to_mpirun_never_lose_the_previous_checkpoint():
    ckdir, metrics = tempdir(), os.path.join(tempdir(), "m.jsonl")
    proc = signalled_run(ckdir, metrics, "--checkpoint.every=2")
    wait_for_steps(metrics, 5, proc)
    pid = mpirun_of(proc)
    for _ in range(3):  # the second and third end the job at once, perhaps mid-save
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:  # mpirun already gone
            break
        time.sleep(0.05)
    proc.communicate(timeout=60)
    again = ok(run(2, tiny_args(f"--train.steps={STEPS}", f"--checkpoint.dir={ckdir}",
                                f"--train.metrics_file={metrics}", "--train.eval_every=0")))
    assert "resumed from" in again.stdout and "skipping unusable" not in again.stderr
    assert [r["loss"] for r in read_metrics(metrics)] == uninterrupted()


def test_model_beyond_the_node_memory_is_refused_before_allocating():
    proc = run(2, tiny_args("--model.n_layer=48", "--model.n_embd=4096", "--model.n_head=32"), timeout=60)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(errors) == 1 and "out of memory" in errors[0] and "available" in errors[0], errors


def plan(*args):
    from harness import run_single
    return run_single(["plan", "--config", os.path.join(ROOT, "inputs", "gpt2-124M.ini"), *args])


def test_plan_says_what_would_fit_and_it_does():
    proc = plan("--world-size", "2", "--memory-limit", "1500MiB")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = [l for l in proc.stderr.splitlines() if "error" in l][0]
    assert "nothing fits" in line and "what would:" in line, line
    ways = line.split("what would: ")[1].split("; ")
    assert ways and all("per rank with" in w for w in ways), ways
    for way in ways:  # each suggestion, applied, must make the plan recommend something within the limit
        change = way.split(" (")[0]
        if change.endswith(" ranks"):
            extra = ["--world-size", change.split()[0], f"--train.global_batch={int(change.split()[0]) * 4}"]
        else:
            extra = ["--world-size", "2", f"--{change}"]
        again = plan(*extra, "--memory-limit", "1500MiB")
        assert again.returncode == 0 and "recommended:" in again.stdout, (way, again.stderr[-2000:])


def test_plan_recommendation_agrees_with_its_table():
    from harness import run_single
    proc = run_single(["plan", "--config", os.path.join(ROOT, "inputs", "tiny.ini"), "--world-size", "2", "--format", "lines"])
    assert proc.returncode == 0, proc.stderr
    rec = [l for l in proc.stdout.splitlines() if l.startswith("recommended:")][0]
    opts = dict(kv.split("=") for kv in rec.split()[1:])
    rows = [dict(kv.split("=") for kv in l.split()[1:]) for l in proc.stdout.splitlines() if l.startswith("PLAN ")]
    match = [r for r in rows if r["strategy"] == opts["fsdp.sharding_strategy"]
             and r["reduce"] == ("micro" if opts["fsdp.reduce_every_microbatch"] == "true" else "step")
             and r["checkpointing"] == ("yes" if opts["fsdp.activation_checkpointing"] == "true" else "no")
             and r["offload"] == ("yes" if opts["fsdp.cpu_offload"] == "true" else "no")]
    assert len(match) == 1 and match[0]["fits"] == "1", (rec, rows)

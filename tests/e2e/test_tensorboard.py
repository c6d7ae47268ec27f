"""TensorBoard event files (train.tensorboard_dir) read back by the tensorboard package itself, from
the test virtual environment (harness.venv_python): its EventAccumulator (what the legacy loader
shows), its raw event-file loader (what the files hold: no stale points for any reader) and a real
`tensorboard` server on its default Rust data server (what a user sees in the browser)."""
import glob
import json
import os
import re
import signal
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request

import harness

# Prints {"files": [{"name", "first"}], "accumulator": {tag: [[step, value]]}, "raw": {...}} for a folder.
READER = r"""
import json, os, sys
from tensorboard.backend.event_processing import event_accumulator, event_file_loader
d = sys.argv[1]
files, raw = [], {}
for name in sorted(n for n in os.listdir(d) if "tfevents" in n):
    events = list(event_file_loader.LegacyEventFileLoader(os.path.join(d, name)).Load())
    first = events[0] if events else None
    files.append({"name": name, "first": first.WhichOneof("what") if first else None,
                  "file_version": first.file_version if first else None,
                  "wall_times": [e.wall_time for e in events]})
    for e in events:
        for v in e.summary.value:
            raw.setdefault(v.tag, []).append([e.step, v.simple_value])
acc = event_accumulator.EventAccumulator(d, size_guidance={event_accumulator.SCALARS: 0})
acc.Reload()
scalars = {t: [[s.step, s.value] for s in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
print(json.dumps({"files": files, "accumulator": scalars, "raw": raw}))
"""


def read_events(folder):
    assert glob.glob(os.path.join(folder, "*tfevents*")), f"no event files in {folder}"
    proc = subprocess.run(["timeout", "120", harness.venv_python(), "-c", READER, folder], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    for f in got["files"]:
        assert f["first"] == "file_version" and f["file_version"] == "brain.Event:2", f
        assert re.fullmatch(r"events\.out\.tfevents\.\d{10}\.\S+", f["name"]), f["name"]
    assert got["raw"] == got["accumulator"], "the files hold points the accumulator hides"
    return got["accumulator"]


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def points(pairs):
    return {step: value for step, value in pairs}


def writer_scenario():
    """The files of TensorBoardWriterTest.RewoundRunShowsOnlyKeptPoints: steps 1..7 (val every 3),
    a torn record, then a run resumed at step 3 writing 4..5 with values offset by 100."""
    folder = os.path.join(harness.tempdir(), "tb")
    env = dict(os.environ, SHARDTRAIN_TB_SCENARIO_DIR=folder)
    proc = subprocess.run(["timeout", "60", os.path.join(harness.BUILD, "unit_tests"),
                           "--gtest_filter=TensorBoardWriterTest.RewoundRunShowsOnlyKeptPoints"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return folder, {"train/loss": [[1, 0.5], [2, 1.0], [3, 1.5], [4, 102.0], [5, 102.5]], "val/loss": [[3, 0.75]]}


def test_writer_files_read_by_tensorboard():
    harness.venv_python()
    folder, expected = writer_scenario()
    assert read_events(folder) == expected


def test_tensorboard_server_shows_rewound_run():
    """`tensorboard --logdir` with its default loader on Linux (the Rust data server, which ignores
    SessionLog.START purges) serves exactly the kept points."""
    python = harness.venv_python()
    folder, expected = writer_scenario()
    server = subprocess.Popen([python, "-m", "tensorboard.main", "--logdir", folder, "--port", "0",
                               "--host", "127.0.0.1", "--load_fast=true"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = []  # a thread reads the output: a silent server must not block the test
        threading.Thread(target=lambda: log.extend(server.stdout), daemon=True).start()
        deadline = time.time() + 60
        url, got = None, {}
        while got != expected and time.time() < deadline:
            time.sleep(1)
            if url is None:
                m = re.search(r"(http://\S+?)/? \(Press CTRL", "".join(log))
                url = m and m.group(1)
            for tag in expected if url else []:  # the data server loads the folder in the background
                try:
                    with urllib.request.urlopen(f"{url}/data/plugin/scalars/scalars?run=.&tag={tag}", timeout=10) as r:
                        got[tag] = [[step, value] for _, step, value in json.load(r)]
                except urllib.error.URLError:
                    got[tag] = None
        assert url, "tensorboard did not start:\n" + "".join(log)
        assert got == expected, got
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # tensorboard and the data server it started
        server.wait(timeout=30)


# ---- a real training (the trainer writes train/*, val/*, perf/*, memory/* scalars) --------------

def train(*overrides, np_=2, expect=0):
    proc = harness.run(np_, harness.tiny_args(*overrides))
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def expected_scalars(metrics_path):
    """The scalars the trainer should write, from its metrics file."""
    want = {}
    for r in harness.read_metrics(metrics_path):
        for tag, value in [("train/loss", r["loss"]), ("train/lr", r["lr"]), ("train/grad_norm", r["grad_norm"]),
                           ("perf/tokens_per_s", r["tokens_per_s"]), ("perf/mfu", r["mfu"]),
                           *((f"memory/{c}_bytes", b) for c, b in r["peak_mem"].items())]:
            want.setdefault(tag, {})[r["step"]] = value
    for r in harness.read_metrics(metrics_path, kind="eval"):
        want.setdefault("val/loss", {})[r["step"]] = r["val_loss"]
    return want


def assert_scalars_match(got, want):
    assert set(want) <= set(got), f"missing tags {sorted(set(want) - set(got))}; got {sorted(got)}"
    for tag, by_step in want.items():
        have = points(got[tag])
        assert sorted(have) == sorted(by_step), f"{tag}: steps {sorted(have)} != {sorted(by_step)}"
        for step, value in by_step.items():  # float32 in the events, 6 digits for some metrics
            assert harness.rel_diff(have[step], f32(value)) < 1e-5, f"{tag} step {step}: {have[step]} != {value}"


def test_training_writes_tensorboard():
    d = harness.tempdir()
    tb, metrics = os.path.join(d, "tb"), os.path.join(d, "metrics.jsonl")
    train(f"--train.tensorboard_dir={tb}", f"--train.metrics_file={metrics}", "--train.steps=6",
          "--train.eval_every=3")
    got = read_events(tb)
    want = expected_scalars(metrics)
    assert sorted(want["val/loss"]) == [3, 6] and "memory/activations_bytes" in want
    assert_scalars_match(got, want)


def test_resumed_training_rewinds_tensorboard():
    """Run to step 6, then resume from the step-3 checkpoint to step 5: TensorBoard shows steps 1..5,
    4 and 5 from the second run, as the metrics file does."""
    d = harness.tempdir()
    tb, metrics, ckpt = os.path.join(d, "tb"), os.path.join(d, "metrics.jsonl"), os.path.join(d, "ckpt")
    common = (f"--train.tensorboard_dir={tb}", f"--train.metrics_file={metrics}", f"--checkpoint.dir={ckpt}",
              "--checkpoint.every=3", "--checkpoint.keep=5", "--train.eval_every=3")
    train(*common, "--train.steps=6")
    first = expected_scalars(metrics)
    train(*common, "--train.steps=5", f"--checkpoint.resume={os.path.join(ckpt, 'ckpt-00000003.h5')}")
    want = expected_scalars(metrics)
    assert sorted(want["train/loss"]) == [1, 2, 3, 4, 5], "the metrics file was not rewound"
    assert want["train/loss"][2] == first["train/loss"][2]
    assert_scalars_match(read_events(tb), want)


def test_tensorboard_dir_naming_a_file():
    d = harness.tempdir()
    path = os.path.join(d, "file")
    open(path, "w").close()
    proc = train(f"--train.tensorboard_dir={path}", "--train.steps=1", np_=1, expect=2)
    assert f"cannot write train.tensorboard_dir '{path}': Not a directory" in proc.stdout + proc.stderr

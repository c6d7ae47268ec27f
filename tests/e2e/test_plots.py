"""tools/plot_metrics.py on metrics files of real tiny trainings: the PNGs exist, are whole PNGs of
plausible size (chunk CRCs, image data that inflates to the header's size), and the loss curve
drawn depends on the data: two runs with different learning rates give different pixels, the same
file under another path the same pixels."""
import os
import shutil
import struct
import subprocess
import zlib

import harness

PLOT = os.path.join(harness.ROOT, "tools", "plot_metrics.py")
PNGS = ("loss.png", "throughput.png", "memory.png", "optimizer.png")


def need_matplotlib():
    if subprocess.run(["/usr/bin/python3", "-c", "import matplotlib"], capture_output=True).returncode != 0:
        raise harness.Skip("Debian's python3-matplotlib is missing (make deps installs it)")


def metrics_file(lr):
    path = os.path.join(harness.tempdir(), f"lr-{lr}.jsonl")
    proc = harness.run(2, harness.tiny_args(f"--train.metrics_file={path}", "--train.steps=6", "--train.eval_every=3",
                                            f"--train.lr={lr}", "--checkpoint.save=false"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return path


def plot(*args, expect=0):
    proc = subprocess.run(["timeout", "120", "/usr/bin/python3", PLOT, *args], capture_output=True, text=True)
    assert proc.returncode == expect, proc.stdout + proc.stderr
    return proc


def read_png(path):
    """(width, height, inflated image data) of a PNG, checking its structure."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"
    at, kind, idat = 8, None, b""
    while at < len(data):
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + size]
        assert struct.unpack(">I", data[at + 8 + size:at + 12 + size])[0] == zlib.crc32(kind + body), f"{path}: {kind}"
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
        idat += body if kind == b"IDAT" else b""
        at += 12 + size
    assert kind == b"IEND", f"{path}: truncated"
    pixels = zlib.decompress(idat)
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    assert len(pixels) == height * (1 + width * channels * depth // 8), f"{path}: image data of the wrong size"
    return width, height, pixels


def test_plots_of_two_runs():
    need_matplotlib()
    a, b = metrics_file("3e-3"), metrics_file("1e-2")
    out = harness.tempdir()
    proc = plot(a, b, "--out", out)
    assert not os.path.exists(os.path.join(out, "loss_by_sigma.png")), "a language model has no noise levels"
    for name in PNGS:
        width, height, _ = read_png(os.path.join(out, name))
        assert width >= 400 and height >= 300 and os.path.getsize(os.path.join(out, name)) > 5000, name
        assert os.path.join(out, name) in proc.stdout
    # The same label everywhere: only the data can change the pixels.
    same = os.path.join(harness.tempdir(), "copy.jsonl")
    shutil.copy(a, same)
    loss = {}
    for key, path in (("a", a), ("b", b), ("a again", same)):
        plot(path, "--label", "run", "--out", os.path.join(out, key))
        loss[key] = read_png(os.path.join(out, key, "loss.png"))[2]
    assert loss["a"] == loss["a again"], "the same data drew different pixels"
    assert loss["a"] != loss["b"], "different loss curves drew the same pixels"


def test_plot_rejects_bad_input():
    need_matplotlib()
    d = harness.tempdir()
    bad = os.path.join(d, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"kind":"step","step":1,"loss":5.0}\n{"kind":"step", "st\n')
    assert f"{bad}:2: not a metrics record" in plot(bad, "--out", d, expect=2).stderr
    assert "cannot read" in plot(os.path.join(d, "missing.jsonl"), "--out", d, expect=2).stderr
    assert "no step or eval records" in plot(os.devnull, "--out", d, expect=2).stderr
    assert not [n for n in os.listdir(d) if n.endswith(".png")]

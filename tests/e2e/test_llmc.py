"""Weights to and from llm.c: `shardtrain export` writes llm.c's GPT-2 fp32 checkpoint layout
(checked here against h5py's view of a gathered checkpoint, decoding the llm.c file with numpy
from llm.c's own definition of the layout), and `checkpoint.init_from` reads it back on another
rank count."""
import os

import h5py
import numpy as np

from harness import run, run_single, tempdir, tiny_args

L, C, H, V, MAXT = 2, 40, 4, 256, 64


def llmc_tensors(path):
    """Decodes an llm.c fp32 GPT-2 checkpoint the way llm.c's train_gpt2.c lays it out."""
    raw = open(path, "rb").read()
    header = np.frombuffer(raw[:1024], dtype=np.int32)
    data = np.frombuffer(raw[1024:], dtype=np.float32)
    maxt, v, l, nh, c, vp = (int(x) for x in header[2:8])
    shapes = [("wte", (vp, c)), ("wpe", (maxt, c)), ("ln1w", (l, c)), ("ln1b", (l, c)), ("qkvw", (l, 3 * c, c)),
              ("qkvb", (l, 3 * c)), ("attprojw", (l, c, c)), ("attprojb", (l, c)), ("ln2w", (l, c)),
              ("ln2b", (l, c)), ("fcw", (l, 4 * c, c)), ("fcb", (l, 4 * c)), ("fcprojw", (l, c, 4 * c)),
              ("fcprojb", (l, c)), ("lnfw", (c,)), ("lnfb", (c,))]
    tensors, at = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        tensors[name] = data[at:at + n].reshape(shape)
        at += n
    assert at == data.size, f"{data.size - at} trailing floats"
    return header, tensors


def test_export_matches_llmc_layout_and_init_from_round_trips():
    ckdir = tempdir()
    proc = run(2, tiny_args("--train.steps=4", "--checkpoint.format=gathered", f"--checkpoint.dir={ckdir}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt = os.path.join(ckdir, "ckpt-00000004.h5")
    out = os.path.join(tempdir(), "model.bin")
    proc = run_single(["export", "--checkpoint", ckpt, "--output", out])
    assert proc.returncode == 0, proc.stderr
    header, t = llmc_tensors(out)
    assert list(header[:8]) == [20240326, 3, MAXT, V, L, H, C, 256]
    with h5py.File(ckpt, "r") as f:
        m = f["model"]
        assert np.array_equal(t["wte"][:V], m["wte"][...]) and not t["wte"][V:].any()
        assert np.array_equal(t["wpe"], m["wpe"][...])
        for layer in range(L):
            h = f"h.{layer}."
            assert np.array_equal(t["qkvw"][layer], m[h + "attn.qkv.weight"][...])
            assert np.array_equal(t["fcprojw"][layer], m[h + "mlp.proj.weight"][...])
            assert np.array_equal(t["ln2b"][layer], m[h + "ln_2.bias"][...])
        assert np.array_equal(t["lnfw"], m["ln_f.weight"][...])

    # Start a 3-rank run from the llm.c file; with lr ~ 0 its first checkpoint holds the same weights.
    ckdir2 = tempdir()
    proc = run(3, tiny_args(f"--checkpoint.init_from={out}", "--train.steps=1", "--train.lr=1e-30",
                            "--train.weight_decay=0", "--checkpoint.format=gathered", f"--checkpoint.dir={ckdir2}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "initialised the weights from llm.c checkpoint" in proc.stdout
    with h5py.File(ckpt, "r") as a, h5py.File(os.path.join(ckdir2, "ckpt-00000001.h5"), "r") as b:
        for name in ("wte", "h.1.attn.qkv.weight", "h.0.mlp.fc.bias", "ln_f.bias"):
            assert np.allclose(a["model"][name][...], b["model"][name][...], rtol=0, atol=1e-12), name


def test_init_from_rejects_another_model():
    ckdir = tempdir()
    proc = run(1, tiny_args("--train.steps=1", f"--checkpoint.dir={ckdir}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = os.path.join(tempdir(), "model.bin")
    assert run_single(["export", os.path.join(ckdir, "ckpt-00000001.h5"), "--output", out]).returncode == 0
    proc = run(2, tiny_args(f"--checkpoint.init_from={out}", "--model.n_layer=3"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.n_layer" in proc.stderr and out in proc.stderr


def test_init_from_rejects_non_finite_weights():
    """A NaN or inf weight in the llm.c file is named (file and tensor) at load, exit 2 on every
    rank before training -- not steps later as "the run diverged". ln_f.bias is the file's last
    tensor and lies in rank 1's slice only (the root unit is wte, wpe, ln_f): the verdict of one
    rank must reach the other."""
    ckdir = tempdir()
    proc = run(1, tiny_args("--train.steps=1", f"--checkpoint.dir={ckdir}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    good = os.path.join(tempdir(), "model.bin")
    assert run_single(["export", os.path.join(ckdir, "ckpt-00000001.h5"), "--output", good]).returncode == 0
    size = os.path.getsize(good)
    qkv = 1024 + 4 * (256 * C + MAXT * C + 2 * L * C + 5)  # element 5 of h.0's qkv weight (llm.c order)
    for offset, value, tensor in ((size - 4, np.nan, "ln_f.bias"), (qkv, np.inf, "h.0.attn.qkv.weight")):
        bad = os.path.join(tempdir(), "bad.bin")
        with open(good, "rb") as f:
            raw = bytearray(f.read())
        raw[offset:offset + 4] = np.float32(value).tobytes()
        with open(bad, "wb") as f:
            f.write(raw)
        proc = run(2, tiny_args(f"--checkpoint.init_from={bad}", "--train.steps=2", f"--checkpoint.dir={tempdir()}"),
                   timeout=60)
        assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-2000:]}"
        errors = [l for l in proc.stderr.splitlines() if "error" in l.lower()]
        assert len(errors) == 1 and bad in errors[0] and tensor in errors[0], proc.stderr
        assert "diverged, lower" not in proc.stderr and "step     1" not in proc.stdout, proc.stdout[-2000:]

"""Checkpoints end to end, for both layouts (checkpoint.format = sharded | gathered): exact resume,
resume on another rank count, the file format as h5py and h5dump read it, rejection of bad files,
auto-resume past corrupt files, retention, failed saves and a job killed while saving.

One 2-rank baseline run per layout (BASE_STEPS steps, a checkpoint every 2 steps, all kept) is
made once and cached; every test copies the files it needs into a folder of its own.

Oracles: the losses of an uninterrupted run (bit-identical on the same rank count, 1e-5 relative
on another -- only the order of the gradient sums changes, see test_train.py), h5py + numpy (the
checksum is recomputed independently here from its definition in checkpoint_io.hpp), h5dump."""
import functools
import os
import re
import shutil
import signal
import subprocess
import time

import h5py
import numpy as np

from harness import EXE, mpirun_command, read_metrics, rel_diff, run, run_single, tempdir, tiny_args

FORMATS = ("sharded", "gathered")
RANKS = 2
BASE_STEPS = 10   # baseline length; checkpoints at 2, 4, ..., 10
RESUME_AT = 4     # the checkpoint the resume tests start from


def ckpt_name(step):
    return f"ckpt-{step:08d}.h5"


def train(np_, ckpt_dir, *overrides, metrics=None, expect=0, timeout=120):
    """Runs the tiny model on np_ ranks with checkpoint.dir = ckpt_dir; checks the exit code
    (unless expect is None)."""
    extra = [f"--train.metrics_file={metrics}"] if metrics else []
    proc = run(np_, tiny_args(f"--checkpoint.dir={ckpt_dir}", *extra, *overrides), timeout=timeout)
    assert expect is None or proc.returncode == expect, (f"np={np_} exit {proc.returncode}, expected {expect}\n"
                                                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def error_line(proc, *needles):
    """The single error line on stderr (rank 0's); it must contain every needle."""
    assert "HDF5-DIAG" not in proc.stderr, f"HDF5 error stack leaked to stderr:\n{proc.stderr[-3000:]}"
    errors = [l for l in proc.stderr.splitlines() if "error" in l.lower()]
    assert len(errors) == 1, f"expected one error line, got:\n{proc.stderr}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


@functools.lru_cache(maxsize=None)
def baseline(fmt):
    """The uninterrupted 2-rank run: (folder with ckpt-2..ckpt-10, step records, metrics path)."""
    d = tempdir()
    metrics = os.path.join(d, "metrics.jsonl")
    train(RANKS, d, f"--train.steps={BASE_STEPS}", "--checkpoint.every=2", "--checkpoint.keep=100",
          f"--checkpoint.format={fmt}", metrics=metrics)
    steps = read_metrics(metrics)
    assert [r["step"] for r in steps] == list(range(1, BASE_STEPS + 1))
    expected = {ckpt_name(s) for s in range(2, BASE_STEPS + 1, 2)} | {"latest", "metrics.jsonl", "config.ini"}
    assert set(os.listdir(d)) == expected, sorted(os.listdir(d))
    return d, steps, metrics


def interrupted_copy(fmt, step=RESUME_AT):
    """A folder as a run stopped after committing `step` leaves it: checkpoints up to `step`,
    `latest` naming it, and a metrics file that also holds the later steps (which the resumed run
    must replace). The "interrupted" run is the baseline itself, cut at a mid-run checkpoint: a
    separate run with train.steps=step would follow another cosine schedule (its length is
    train.steps), so its state could not match the uninterrupted run's."""
    src, _, metrics = baseline(fmt)
    d = tempdir()
    for s in range(2, step + 1, 2):
        shutil.copy(os.path.join(src, ckpt_name(s)), d)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write(ckpt_name(step) + "\n")
    shutil.copy(metrics, os.path.join(d, "metrics.jsonl"))
    return d


def copy_checkpoint(fmt, step=RESUME_AT, name=None):
    src, _, _ = baseline(fmt)
    path = os.path.join(tempdir(), name or ckpt_name(step))
    shutil.copy(os.path.join(src, ckpt_name(step)), path)
    return path


def assert_resumed(proc, path, step):
    line = f"resumed from {path} at step {step}"
    assert line in proc.stdout, f"{line!r} not in stdout:\n{proc.stdout[-3000:]}"


# ---------------------------------------------------------------- 1, 2: resume


def test_exact_resume_on_same_rank_count():
    for fmt in FORMATS:
        src, base, _ = baseline(fmt)
        d = interrupted_copy(fmt)
        metrics = os.path.join(d, "metrics.jsonl")
        proc = train(RANKS, d, f"--train.steps={BASE_STEPS}", "--checkpoint.every=2", "--checkpoint.keep=100",
                     f"--checkpoint.format={fmt}", metrics=metrics)
        assert_resumed(proc, os.path.join(d, ckpt_name(RESUME_AT)), RESUME_AT)
        assert f"saved on {RANKS} ranks, {fmt} layout" in proc.stdout
        resumed = read_metrics(metrics)
        assert [r["step"] for r in resumed] == list(range(1, BASE_STEPS + 1)), (fmt, [r["step"] for r in resumed])
        for key in ("loss", "grad_norm", "lr"):
            got = [r[key] for r in resumed[RESUME_AT:]]
            want = [r[key] for r in base[RESUME_AT:]]
            assert got == want, f"{fmt}: {key} after resume differs\n got  {got}\n want {want}"
        assert resumed[:RESUME_AT] == base[:RESUME_AT], "records before the checkpoint must be kept as they were"
        assert [e["step"] for e in read_metrics(metrics, "eval")] == [BASE_STEPS]
        # The final state is bit-identical too: every dataset of the last checkpoint.
        a = read_datasets(os.path.join(d, ckpt_name(BASE_STEPS)))
        b = read_datasets(os.path.join(src, ckpt_name(BASE_STEPS)))
        assert a.keys() == b.keys()
        for name in a:
            assert np.array_equal(a[name], b[name]), f"{fmt}: {name} differs after resume"


def test_resume_on_other_rank_counts():
    """Saved on 2 ranks, resumed on 3 and on 1; then the 3-rank run's own checkpoint (units padded
    for 3 ranks) resumed on 2 ranks. Losses follow the uninterrupted 2-rank run."""
    for fmt in FORMATS:
        _, base, _ = baseline(fmt)
        chain = [(3, interrupted_copy(fmt), RESUME_AT, 2), (1, interrupted_copy(fmt), RESUME_AT, 2)]
        for np_, d, start, saved_on in chain:
            metrics = os.path.join(d, "metrics.jsonl")
            proc = train(np_, d, f"--train.steps={BASE_STEPS}", f"--checkpoint.format={fmt}", "--checkpoint.every=2",
                         "--checkpoint.keep=100", metrics=metrics)
            assert_resumed(proc, os.path.join(d, ckpt_name(start)), start)
            assert f"saved on {saved_on} ranks" in proc.stdout
            resumed = read_metrics(metrics)
            assert [r["step"] for r in resumed] == list(range(1, BASE_STEPS + 1))
            drift = [rel_diff(a["loss"], b["loss"]) for a, b in zip(base[start:], resumed[start:])]
            print(f"      {fmt} {saved_on} -> {np_} ranks from step {start}: loss drift " +
                  " ".join(f"{x:.1e}" for x in drift))
            assert max(drift) <= 1e-5, (fmt, saved_on, np_, drift)
            if np_ == 3:  # next: the step-6 checkpoint this 3-rank run wrote, on 2 ranks
                nxt = tempdir()
                shutil.copy(os.path.join(d, ckpt_name(6)), nxt)
                shutil.copy(metrics, os.path.join(nxt, "metrics.jsonl"))
                chain.append((2, nxt, 6, 3))


# ---------------------------------------------------------------- 3: the format, read by h5py and h5dump

GOLDEN = 0x9E3779B97F4A7C15


def mix64(z):
    """SplitMix64's finaliser (core/random.hpp) on a uint64 array; arithmetic wraps mod 2^64."""
    z = z + np.uint64(GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def checksum(values, first_index=0):
    """sum over elements of mix64(flat_index * GOLDEN + float32 bits), mod 2^64."""
    bits = np.ascontiguousarray(values, dtype="<f4").reshape(-1).view("<u4").astype(np.uint64)
    index = np.arange(first_index, first_index + bits.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int(np.sum(mix64(index * np.uint64(GOLDEN) + bits), dtype=np.uint64))


def read_datasets(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


def text(value):
    return value.decode() if isinstance(value, bytes) else str(value)


def param_shapes(n_layer=2, C=40, V=256, P=64):
    shapes = {"wte": (V, C), "wpe": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for l in range(n_layer):
        h = f"h.{l}"
        shapes.update({f"{h}.ln_1.weight": (C,), f"{h}.ln_1.bias": (C,), f"{h}.attn.qkv.weight": (3 * C, C),
                       f"{h}.attn.qkv.bias": (3 * C,), f"{h}.attn.proj.weight": (C, C), f"{h}.attn.proj.bias": (C,),
                       f"{h}.ln_2.weight": (C,), f"{h}.ln_2.bias": (C,), f"{h}.mlp.fc.weight": (4 * C, C),
                       f"{h}.mlp.fc.bias": (4 * C,), f"{h}.mlp.proj.weight": (C, 4 * C), f"{h}.mlp.proj.bias": (C,)})
    return shapes


PARTS = (("params", "model/"), ("exp_avg", "optim/exp_avg/"), ("exp_avg_sq", "optim/exp_avg_sq/"))


def reassemble(path):
    """A sharded checkpoint as gathered-style {'model/<p>', 'optim/exp_avg/<p>', ...} arrays, via
    each unit's `index` attribute ("name offset numel shape" lines); checks padding and numel."""
    out = {}
    with h5py.File(path, "r") as f:
        assert text(f.attrs["layout"]) == "sharded"
        world = int(f.attrs["world_size"])
        for unit, group in f["shards"].items():
            rows = [line.split() for line in text(group.attrs["index"]).splitlines() if line.strip()]
            numel = sum(int(r[2]) for r in rows)
            for part, prefix in PARTS:
                flat = group[part][()]
                assert flat.ndim == 1 and flat.dtype == np.float32
                assert int(group[part].attrs["numel"]) == numel, (unit, part)
                assert flat.size >= numel and flat.size % world == 0, (unit, part, flat.size, numel, world)
                assert not flat[numel:].any(), f"{unit}/{part}: padding is not zero"
                assert int(group[part].attrs["checksum"]) == checksum(flat[:numel]), f"{unit}/{part}: checksum"
                for name, offset, count, shape in rows:
                    offset, count = int(offset), int(count)
                    dims = tuple(int(x) for x in shape.split("x"))
                    assert int(np.prod(dims)) == count
                    out[prefix + name] = flat[offset:offset + count].reshape(dims)
    return out


def test_gathered_checkpoint_reads_with_h5py():
    src, _, _ = baseline("gathered")
    path = os.path.join(src, ckpt_name(BASE_STEPS))
    shapes = param_shapes()
    with h5py.File(path, "r") as f:
        attrs = f.attrs
        assert text(attrs["format"]) == "shardtrain-checkpoint"
        # 4: adapter-only files and the base checksum; 3: the adapter's attributes; 2: the
        # architecture's (test_llama.py: version 1 still loads)
        assert int(attrs["version"]) == 10
        assert int(attrs["adapters_only"]) == 0
        assert text(attrs["adapter.type"]) == "none" and text(attrs["adapter.targets"]) == ""
        assert text(attrs["model.arch"]) == "gpt2"
        assert int(attrs["model.n_kv_head"]) == 4 and int(attrs["model.intermediate_size"]) == 160
        assert int(attrs["model.tie_embeddings"]) == 1
        assert int(attrs["step"]) == BASE_STEPS
        assert text(attrs["layout"]) == "gathered"
        assert int(attrs["world_size"]) == RANKS
        assert int(attrs["tokens_seen"]) == BASE_STEPS * 24 * 32
        config = text(attrs["config"])
        assert "[model]" in config and "n_layer = 2" in config and "n_embd = 40" in config, config
        assert int(attrs["model.n_layer"]) == 2 and int(attrs["model.n_embd"]) == 40
        assert f["model/wte"].shape == (256, 40)
        assert f["model/h.0.attn.qkv.weight"].shape == (120, 40)
        assert f["model/ln_f.weight"].shape == (40,)
        for prefix in ("model/", "optim/exp_avg/", "optim/exp_avg_sq/"):
            group = f[prefix.rstrip("/")]
            assert set(group.keys()) == set(shapes), (prefix, sorted(group.keys()))
            for name, shape in shapes.items():
                ds = group[name]
                assert ds.shape == shape and ds.dtype == np.float32, (prefix + name, ds.shape, ds.dtype)
                values = ds[()]
                assert np.isfinite(values).all(), prefix + name
                assert int(ds.attrs["numel"]) == values.size
                stored = int(ds.attrs["checksum"])
                assert stored == checksum(values), f"{prefix}{name}: stored checksum {stored} != {checksum(values)}"
        assert (f["optim/exp_avg_sq/wte"][()] >= 0).all()
        assert not np.array_equal(f["optim/exp_avg/wte"][()], f["optim/exp_avg_sq/wte"][()])
    # The checksum oracle itself: a change of one bit changes it.
    values = read_datasets(path)["model/wte"]
    flipped = values.copy()
    flipped.view(np.uint32)[3, 7] ^= 1
    assert checksum(flipped) != checksum(values)


def test_sharded_checkpoint_checksums_and_index():
    src, _, _ = baseline("sharded")
    shapes = param_shapes()
    arrays = reassemble(os.path.join(src, ckpt_name(BASE_STEPS)))  # checks every checksum on the way
    assert {k for k in arrays if k.startswith("model/")} == {"model/" + n for n in shapes}
    for key, value in arrays.items():
        assert value.shape == shapes[key.split("/")[-1]], key


def test_layouts_and_rank_counts_store_identical_arrays():
    """One optimizer step with a learning rate that is 0 in float32 (lr > 0 is required): the
    parameters stay exactly at their initialisation, which does not depend on the rank count. So
    gathered files from 2 and 3 ranks must hold identical /model arrays (and checksums), and a
    sharded file from either rank count, reassembled through its index, the same arrays."""
    files = {}
    for fmt in FORMATS:
        for np_ in (2, 3):
            d = tempdir()
            train(np_, d, "--train.steps=1", "--train.lr=1e-50", f"--checkpoint.format={fmt}")
            files[fmt, np_] = os.path.join(d, ckpt_name(1))
    g2, g3 = read_datasets(files["gathered", 2]), read_datasets(files["gathered", 3])
    assert g2.keys() == g3.keys()
    model = [k for k in g2 if k.startswith("model/")]
    assert len(model) == len(param_shapes())
    with h5py.File(files["gathered", 2], "r") as f2, h5py.File(files["gathered", 3], "r") as f3:
        for k in model:
            assert np.array_equal(g2[k], g3[k]), f"{k} differs between 2 and 3 ranks"
            assert f2[k].attrs["checksum"] == f3[k].attrs["checksum"], k
        assert int(f3.attrs["world_size"]) == 3
    for k in g2:  # the moments hold one step's gradients: equal up to the order of the sums
        if not k.startswith("model/"):
            np.testing.assert_allclose(g3[k], g2[k], rtol=1e-4, atol=1e-6 * float(np.abs(g2[k]).max()), err_msg=k)
    s2, s3 = reassemble(files["sharded", 2]), reassemble(files["sharded", 3])
    assert s2.keys() == g2.keys() == s3.keys()
    for k in g2:  # same rank count: bit-identical runs, so even the moments agree exactly
        assert np.array_equal(s2[k], g2[k]), f"{k}: sharded (2 ranks) != gathered (2 ranks)"
    for k in model:
        assert np.array_equal(s3[k], g2[k]), f"{k}: sharded (3 ranks) != gathered (2 ranks)"
    with h5py.File(files["sharded", 3], "r") as f:  # 3 ranks pad the units (their sizes do not divide by 3)
        assert any(f[f"shards/{u}/params"].shape[0] > int(f[f"shards/{u}/params"].attrs["numel"]) for u in f["shards"])


def test_h5dump_lists_datasets():
    for fmt in FORMATS:
        src, _, _ = baseline(fmt)
        path = os.path.join(src, ckpt_name(BASE_STEPS))
        proc = subprocess.run(["timeout", "60", "h5dump", "-H", path], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        for attr in ("format", "version", "step", "layout", "world_size", "config"):
            assert f'ATTRIBUTE "{attr}"' in out, attr
        if fmt == "gathered":
            for group in ("model", "optim", "exp_avg", "exp_avg_sq"):
                assert f'GROUP "{group}"' in out, group
            for name in param_shapes():
                assert out.count(f'DATASET "{name}"') == 3, name  # model, exp_avg, exp_avg_sq
            assert "SIMPLE { ( 256, 40 ) / ( 256, 40 ) }" in out
        else:
            for unit in ("root", "h.0", "h.1"):
                assert f'GROUP "{unit}"' in out, unit
            for part in ("params", "exp_avg", "exp_avg_sq"):
                assert out.count(f'DATASET "{part}"') == 3, part
            assert 'ATTRIBUTE "index"' in out
        assert out.count('ATTRIBUTE "checksum"') == out.count("DATASET ")


# ---------------------------------------------------------------- 4: bad files


def expect_bad_checkpoint(path, *needles, overrides=()):
    proc = train(RANKS, tempdir(), f"--checkpoint.resume={path}", f"--train.steps={BASE_STEPS}", *overrides,
                 expect=2, timeout=60)
    line = error_line(proc, path, *needles)
    assert not re.search(r"^step ", proc.stdout, re.M), f"training started:\n{proc.stdout[-2000:]}"
    return line


def truncate_half(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def corrupt_value(path, dataset):
    """Flips one mantissa bit of the last element of `dataset` (for a sharded unit: the last
    rank's part), keeping the stored checksum."""
    with h5py.File(path, "r+") as f:
        ds = f[dataset]
        n = int(ds.attrs["numel"])
        values = ds[()]
        flat = values.reshape(-1)
        flat.view(np.uint32)[n - 1] ^= 1 << 12
        ds[...] = values


def reshape_dataset(path, dataset, new_values):
    with h5py.File(path, "r+") as f:
        attrs = dict(f[dataset].attrs)
        del f[dataset]
        ds = f.create_dataset(dataset, data=new_values)
        for k, v in attrs.items():
            ds.attrs[k] = v


def test_bad_files_rejected_before_reading_data():
    """Defects found in the file's header and root attributes, which no layout changes: each is
    checked once, on alternating layouts."""
    d = tempdir()
    not_hdf5 = os.path.join(d, "notes.h5")
    with open(not_hdf5, "w") as f:
        f.write("this is not an HDF5 file\n" * 200)
    expect_bad_checkpoint(not_hdf5)
    other = os.path.join(d, "weights.h5")
    with h5py.File(other, "w") as f:  # a plain HDF5 weights file, no format attribute
        f.create_dataset("model/wte", data=np.zeros((256, 40), np.float32))
        f.attrs["version"] = 1
    expect_bad_checkpoint(other, "format")
    other_named = os.path.join(d, "other-format.h5")
    with h5py.File(other_named, "w") as f:  # a format attribute naming another format
        f.create_dataset("model/wte", data=np.zeros((256, 40), np.float32))
        f.attrs.create("format", np.bytes_("pytorch-checkpoint"))
        f.attrs["version"] = 1
    expect_bad_checkpoint(other_named, "format")

    path = copy_checkpoint("sharded", name="truncated.h5")
    truncate_half(path)
    expect_bad_checkpoint(path)

    path = copy_checkpoint("gathered", name="version.h5")
    with h5py.File(path, "r+") as f:
        f.attrs["version"] = np.int64(99)
    expect_bad_checkpoint(path, "version")

    path = copy_checkpoint("sharded", name="other-model.h5")
    expect_bad_checkpoint(path, "model.n_layer", overrides=("--model.n_layer=3",))


def test_bad_datasets_rejected():
    """Defects in the datasets, whose names and checks differ per layout: a missing dataset, a
    mis-shaped one and a changed value under the old checksum."""
    for fmt in FORMATS:
        some = "shards/h.1/params" if fmt == "sharded" else "model/h.1.attn.qkv.weight"
        path = copy_checkpoint(fmt, name="missing-dataset.h5")
        gone = "shards/root/exp_avg_sq" if fmt == "sharded" else "optim/exp_avg_sq/ln_f.bias"
        with h5py.File(path, "r+") as f:
            del f[gone]
        expect_bad_checkpoint(path, gone)

        path = copy_checkpoint(fmt, name="misshaped.h5")
        with h5py.File(path, "r+") as f:
            values = f[some][()]
        if fmt == "sharded":  # shorter than the unit
            reshape_dataset(path, some, values[:values.size // 2])
        else:  # same elements, transposed shape
            reshape_dataset(path, some, values.reshape(values.shape[::-1]))
        expect_bad_checkpoint(path, some)

        path = copy_checkpoint(fmt, name="corrupt.h5")
        corrupt_value(path, some)
        expect_bad_checkpoint(path, some, "checksum")


def test_read_error_on_one_rank_fails_cleanly():
    """A valid HDF5 variant of a checkpoint (what `h5repack -f GZIP` makes: /model/wpe chunked and
    compressed; it loads) with one compressed chunk damaged. The chunk lies in rank 1's part (the
    root unit is wte, wpe, ln_f: wpe starts at flat 10240 of 12880, rank 1 holds [6440, 12880)),
    so only rank 1's read fails. Expected: exit 2 and one error line, like on 1 rank -- not a hang
    (the timeout here is ~10x what a clean failure takes)."""
    path = copy_checkpoint("gathered", name="repacked.h5")
    name = "model/wpe"
    with h5py.File(path, "r+") as f:
        values, attrs = f[name][()], dict(f[name].attrs)
        del f[name]
        ds = f.create_dataset(name, data=values, chunks=(8, 40), compression="gzip")
        for k, v in attrs.items():
            ds.attrs[k] = v
        chunk = ds.id.get_chunk_info(4)  # rows 32..39
    with open(path, "r+b") as f:
        f.seek(chunk.byte_offset + chunk.size // 2)
        f.write(b"\xff" * 8)
    proc = train(RANKS, tempdir(), f"--checkpoint.resume={path}", f"--train.steps={BASE_STEPS}", expect=None,
                 timeout=20)
    assert proc.returncode != 124, ("hang: rank 1's H5Dread failed and it left the collective read loop "
                                    "(H5Fclose -> MPI_File_close) while rank 0 went on to the next collective "
                                    "H5Dread; fsdp.comm_timeout does not cover MPI-IO")
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-2000:]}"
    error_line(proc, path, name)


# ---------------------------------------------------------------- 5, 6: auto-resume and retention


def test_auto_resume_skips_corrupt_newest():
    """Newest (10) truncated, next (8) with a corrupted value: resume from 6, bit-exactly."""
    for fmt in FORMATS:
        _, base, _ = baseline(fmt)
        d = interrupted_copy(fmt, BASE_STEPS)
        truncate_half(os.path.join(d, ckpt_name(10)))
        corrupt_value(os.path.join(d, ckpt_name(8)), "shards/h.0/exp_avg" if fmt == "sharded" else "optim/exp_avg/wpe")
        metrics = os.path.join(d, "metrics.jsonl")
        proc = train(RANKS, d, f"--train.steps={BASE_STEPS}", f"--checkpoint.format={fmt}", "--checkpoint.keep=100",
                     metrics=metrics)
        warnings = [l for l in proc.stderr.splitlines() if l.startswith("warning")]
        for bad in (ckpt_name(10), ckpt_name(8)):
            assert any(bad in w for w in warnings), f"{fmt}: no warning about {bad}:\n{proc.stderr}"
        assert not any("error" in l.lower() for l in proc.stderr.splitlines() if not l.startswith("warning"))
        assert_resumed(proc, os.path.join(d, ckpt_name(6)), 6)
        resumed = read_metrics(metrics)
        assert [r["step"] for r in resumed] == list(range(1, BASE_STEPS + 1))
        assert [r["loss"] for r in resumed[6:]] == [r["loss"] for r in base[6:]], fmt
        # The run saved a good step-10 checkpoint over the truncated one; `latest` names it.
        with open(os.path.join(d, "latest")) as f:
            assert f.read().strip() == ckpt_name(10)
        assert reassemble_or_read(os.path.join(d, ckpt_name(10)))


def test_auto_resume_without_usable_checkpoint_starts_fresh():
    """The only checkpoint fails its checksum after its data was read into the shards: the run
    warns, re-initialises and must train exactly like a fresh run."""
    for fmt in FORMATS:
        _, base, _ = baseline(fmt)
        d = tempdir()
        shutil.copy(copy_checkpoint(fmt), d)
        corrupt_value(os.path.join(d, ckpt_name(RESUME_AT)), "shards/root/params" if fmt == "sharded" else "model/wte")
        metrics = os.path.join(d, "metrics.jsonl")
        proc = train(RANKS, d, f"--train.steps={BASE_STEPS}", "--checkpoint.every=2", "--checkpoint.keep=100",
                     f"--checkpoint.format={fmt}", metrics=metrics)
        assert ckpt_name(RESUME_AT) in proc.stderr and "starting from scratch" in proc.stderr, proc.stderr
        assert "resumed from" not in proc.stdout
        assert [r["loss"] for r in read_metrics(metrics)] == [r["loss"] for r in base], fmt


def reassemble_or_read(path):
    with h5py.File(path, "r") as f:
        layout = text(f.attrs["layout"])
    return reassemble(path) if layout == "sharded" else read_datasets(path)


def test_retention_keeps_newest_two():
    for fmt in FORMATS:
        d = tempdir()
        train(RANKS, d, "--train.steps=8", "--checkpoint.every=2", "--checkpoint.keep=2", f"--checkpoint.format={fmt}")
        names = sorted(n for n in os.listdir(d) if n not in ("metrics.jsonl", "config.ini"))  # the run's records
        assert names == [ckpt_name(6), ckpt_name(8), "latest"], (fmt, names)
        with open(os.path.join(d, "latest")) as f:
            assert f.read().strip() == ckpt_name(8)


# ---------------------------------------------------------------- 7, 8: failed and interrupted saves


def test_failed_save_keeps_previous_checkpoint():
    """A directory where a file of the save must go (root ignores permissions, not this): for one
    layout the temporary file (the HDF5 create fails), for the other the final name (the rename
    fails). The obstacle holds a file, so that removing it is not an option."""
    for fmt, obstacle in zip(FORMATS, (ckpt_name(8) + ".tmp", ckpt_name(8))):
        d = tempdir()
        os.makedirs(os.path.join(d, obstacle, "keep-me"))
        metrics = os.path.join(d, "metrics.jsonl")
        proc = train(RANKS, d, "--train.steps=8", "--checkpoint.every=4", f"--checkpoint.format={fmt}",
                     metrics=metrics, expect=2)
        error_line(proc, ckpt_name(8))
        first = read_metrics(metrics)
        assert [r["step"] for r in first] == list(range(1, 9))
        names = sorted(os.listdir(d))
        assert ckpt_name(4) in names and "latest" in names, names
        assert not [n for n in names if n.endswith(".tmp") and n != obstacle], names
        with open(os.path.join(d, "latest")) as f:
            assert f.read().strip() == ckpt_name(4)
        assert os.path.isdir(os.path.join(d, obstacle, "keep-me")), "the obstacle was removed"
        shutil.rmtree(os.path.join(d, obstacle))
        proc = train(RANKS, d, "--train.steps=8", "--checkpoint.every=4", f"--checkpoint.format={fmt}",
                     metrics=metrics)
        assert_resumed(proc, os.path.join(d, ckpt_name(4)), 4)
        second = read_metrics(metrics)
        assert [r["step"] for r in second] == list(range(1, 9))
        assert [r["loss"] for r in second[4:]] == [r["loss"] for r in first[4:]], (fmt, obstacle)
        assert sorted(os.listdir(d)) == [ckpt_name(4), ckpt_name(8), "config.ini", "latest", "metrics.jsonl"]


def rank_pids(marker):
    """Pids of shardtrain processes whose command line contains `marker` (our unique folder)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].decode(errors="replace") == EXE and any(marker.encode() in a for a in argv):
            pids.append(int(entry))
    return pids


def kill_job(proc, marker):
    """SIGKILL to the ranks and to the launcher's process group at once, as a scheduler would
    (Open MPI gives the ranks process groups of their own, so killing mpirun alone is not
    enough: orphaned ranks would go on writing)."""
    pids = rank_pids(marker)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, stderr = proc.communicate()
    deadline = time.time() + 10
    while rank_pids(marker) and time.time() < deadline:
        time.sleep(0.05)
    assert not rank_pids(marker), "ranks survived SIGKILL"
    return pids, stderr


def test_killed_during_save_resumes_from_last_complete():
    big = ("--model.n_layer=4", "--model.n_embd=256")
    for fmt in FORMATS:
        d = tempdir()
        args = tiny_args(f"--checkpoint.dir={d}", *big, "--train.steps=200", "--checkpoint.every=1",
                         f"--checkpoint.format={fmt}")
        proc = subprocess.Popen(mpirun_command(RANKS, [EXE, *args], timeout=120), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        caught, start = False, time.time()
        try:
            while time.time() - start < 60 and proc.poll() is None:
                names = os.listdir(d)
                done = [n for n in names if n.startswith("ckpt-") and n.endswith(".h5")]
                if len(done) >= 2 and any(n.startswith("ckpt-") and n.endswith(".h5.tmp") for n in names):
                    caught = True  # a save is in progress
                    break
                time.sleep(0.002)
        finally:
            killed, stderr = kill_job(proc, d)
        assert caught, (f"no save in progress seen within 60 s; files {sorted(os.listdir(d))}, "
                        f"exit {proc.returncode}\n{stderr[-3000:]}")
        assert len(killed) == RANKS, f"killed rank pids {killed}"
        names = sorted(os.listdir(d))
        complete = sorted(n for n in names if n.startswith("ckpt-") and n.endswith(".h5"))
        leftovers = [n for n in names if n.endswith(".tmp")]
        print(f"      {fmt}: killed with {names}")
        with open(os.path.join(d, "latest")) as f:
            target = f.read().strip()
        # `latest` leads auto-resume. It names the newest complete file, or -- if the kill fell
        # between a rename and the update of `latest` (a window of one fsync) -- the one before.
        assert target in complete[-2:], names
        newest = int(target[5:13])
        # Run one more step (train.steps may not be below the checkpoint's step).
        proc = train(RANKS, d, *big, f"--train.steps={newest + 1}", f"--checkpoint.format={fmt}")
        assert_resumed(proc, os.path.join(d, target), newest)
        assert f"step {newest + 1:5d}/{newest + 1}" in proc.stdout
        after = sorted(os.listdir(d))
        assert ckpt_name(newest + 1) in after, after
        assert not [n for n in after if n.endswith(".tmp") and n not in leftovers], (leftovers, after)
        assert ckpt_name(newest + 1) + ".tmp" not in after, after  # the same save, redone, was committed


def test_long_checkpoint_paths_save_and_resume():
    """A checkpoint path of about 230 bytes or more aborted every rank inside Open MPI's shared-file
    locking under HDF5's MPI_File_open (a 256-byte buffer in the `lockedfile` component), after the
    training and before any save. Paths of 250 and of 620 bytes (components up to 255, the file
    system's limit) save on 2 ranks and on one rank without mpirun, and the run resumes from them."""
    for lengths in ((100, 100, 20), (200, 200, 200)):
        d = os.path.join(tempdir(), *("abc"[i] * n for i, n in enumerate(lengths)))
        assert len(os.path.join(d, ckpt_name(2))) >= 250
        for np_ in (2, 1):
            launch = functools.partial(run, 2) if np_ == 2 else run_single
            first = launch(tiny_args("--train.steps=2", f"--checkpoint.dir={d}", "--checkpoint.resume=none"))
            assert first.returncode == 0, (len(d), np_, first.stderr[-1500:])
            assert os.path.exists(os.path.join(d, ckpt_name(2))), (len(d), np_)
            resumed = launch(tiny_args("--train.steps=3", f"--checkpoint.dir={d}"))
            assert resumed.returncode == 0, (len(d), np_, resumed.stderr[-1500:])
            assert_resumed(resumed, os.path.join(d, ckpt_name(2)), 2)

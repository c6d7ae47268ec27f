"""Checkpoints at their edges: a disk that fills up during a save, a `latest` that cannot be
written, a checkpoint.dir that is a file, edited metadata (the metadata checksum), and `inspect`
and `export` refusing every file that training refuses.

Every failure must be exit 2 with one error line naming the file and the problem, on every rank,
within a bounded time (never the watchdog, never a hang), and must keep the previous checkpoint
and `latest`. Oracles: h5py (the metadata checksum is recomputed here from its definition in
docs/checkpoint-format.md), `shardtrain inspect` of the surviving files."""
import functools
import os
import re
import shutil
import subprocess

import h5py
import numpy as np

from harness import EXE, Skip, mpirun_command, run_single, tempdir, tiny_args

FORMATS = ("sharded", "gathered")


def ckpt_name(step):
    return f"ckpt-{step:08d}.h5"


def error_lines(proc):
    """stderr lines that report an error. Open MPI's ompio prints one line of its own per failed
    write ("mca_fbtl_posix_pwritev: error in ..."), which no setting of ours silences."""
    assert "HDF5-DIAG" not in proc.stderr, f"HDF5 error stack leaked to stderr:\n{proc.stderr[-3000:]}"
    return [l for l in proc.stderr.splitlines() if "error" in l.lower() and not l.startswith("mca_fbtl_posix")]


def one_error(proc, *needles, code=2):
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    errors = error_lines(proc)
    assert len(errors) == 1, f"expected one error line, got:\n{proc.stderr}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


def train(np_, ckpt_dir, *overrides, timeout=60, env=None):
    args = tiny_args(f"--checkpoint.dir={ckpt_dir}", f"--train.metrics_file={os.path.join(tempdir(), 'm.jsonl')}",
                     *overrides)
    return subprocess.run(mpirun_command(np_, [EXE, *args], timeout), capture_output=True, text=True,
                          env=env or os.environ)


@functools.lru_cache(maxsize=None)
def saved(fmt):
    """A 2-rank run's checkpoints at steps 2 and 4 (folder)."""
    d = tempdir()
    proc = train(2, d, "--train.steps=4", "--checkpoint.every=2", "--checkpoint.keep=10", f"--checkpoint.format={fmt}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d


def copy_of(fmt, step=4, name=None):
    path = os.path.join(tempdir(), name or ckpt_name(step))
    shutil.copy(os.path.join(saved(fmt), ckpt_name(step)), path)
    return path


def assert_valid(path):
    proc = run_single(["inspect", path])
    assert proc.returncode == 0, f"{path} does not inspect cleanly:\n{proc.stderr[-2000:]}"


# ---------------------------------------------------------------- the metadata checksum

META_ORDER = ("format", "version", "layout", "step", "tokens_seen", "seed", "sampler_step", "world_size", "strategy",
              "config", "loss_scale_log2", "loss_scale_good_steps", "model.n_layer", "model.n_embd", "model.n_head",
              "model.vocab_size", "model.max_seq_len")
# Version 2 appends the architecture (reals as C's %.17g); version 1 files have none of these.
META_ORDER_V2 = ("model.arch", "model.n_kv_head", "model.intermediate_size", "model.tie_embeddings",
                 "model.rope_theta", "model.norm_eps")
# Then, in files that have them, the data's identity (older files do not).
META_ORDER_DATASET = ("dataset.train", "dataset.val")
# Version 3 appends the adapter's settings.
META_ORDER_V3 = ("adapter.type", "adapter.targets", "adapter.rank", "adapter.alpha", "adapter.dropout")
# Version 4 appends whether the file holds the adapters alone, and the base model's checksum.
META_ORDER_V4 = ("adapters_only", "base_checksum")
# Version 5 appends LoKr's and OFT's settings and the distillation teacher's checksum.
META_ORDER_V5 = ("adapter.decompose_both", "adapter.decompose_factor", "adapter.block_size", "adapter.cayley_neumann",
                 "adapter.neumann_terms", "adapter.block_share", "distill.teacher_checksum")
# Version 6 appends the model keys of the families beyond the decoders, those the file's family
# reads (flux: these; gpt2, llama and qwen2: none).
META_ORDER_V6 = {"flux": ("model.n_single_layer", "model.in_channels", "model.context_dim", "model.context_len",
                          "model.condition_len", "model.pooled_dim", "model.pixel_patch", "model.guidance_embeds",
                          "model.rope_axes")}
# Version 8 appends the decoders' scaled rotary embedding and head size.
META_ORDER_V8 = {"llama": ("model.rope_scaling", "model.head_dim"), "qwen2": ("model.rope_scaling", "model.head_dim"),
                 "qwen3": ("model.rope_scaling", "model.head_dim"),
                 "smollm3": ("model.rope_scaling", "model.head_dim", "model.nope_layers")}
# Written only when not 0 or empty (a pixel-space model's patch, a scaled rotary embedding, a head
# size of its own).
META_OPTIONAL = ("model.pixel_patch", "model.rope_scaling", "model.head_dim", "model.nope_layers",
                 "quantized.double_quant")
# Then, in a file of a run with a text encoder in the job (any version), its record.
META_ORDER_TEXT_ENCODER = ("text_encoder.source", "text_encoder.layers", "text_encoder.tokenizer", "text_encoder.dtype",
                           "text_encoder.quant_block", "text_encoder.quantize_all_linear", "text_encoder.checksum")
# Then, from version 7 in a file holding a quantized base's records, their format (from version 9
# whether their absmax are double-quantized, written when they are).
META_ORDER_QUANTIZED = ("quantized.dtype", "quantized.block", "quantized.double_quant")


def text_of(value):
    return value.decode() if isinstance(value, bytes) else str(value)


def meta_checksum(attrs):
    """FNV-1a 64 over name NUL value NUL of each attribute in META_ORDER (and, from version 2,
    META_ORDER_V2; then META_ORDER_DATASET where present; from version 3 META_ORDER_V3; from version 4
    META_ORDER_V4; from version 5 META_ORDER_V5; from version 6 its family's META_ORDER_V6, from
    version 8 its META_ORDER_V8, the META_OPTIONAL ones where present; then META_ORDER_TEXT_ENCODER and
    META_ORDER_QUANTIZED where present), integers in decimal, reals as %.17g."""
    h = 0xCBF29CE484222325
    for name in (META_ORDER + (META_ORDER_V2 if int(attrs["version"]) >= 2 else ()) +
                 (META_ORDER_DATASET if "dataset.train" in attrs else ()) +
                 (META_ORDER_V3 if int(attrs["version"]) >= 3 else ()) +
                 (META_ORDER_V4 if int(attrs["version"]) >= 4 else ()) +
                 (META_ORDER_V5 if int(attrs["version"]) >= 5 else ()) +
                 (META_ORDER_V6.get(text_of(attrs["model.arch"]), ()) if int(attrs["version"]) >= 6 else ()) +
                 (META_ORDER_V8.get(text_of(attrs["model.arch"]), ()) if int(attrs["version"]) >= 8 else ()) +
                 (META_ORDER_TEXT_ENCODER if "text_encoder.source" in attrs else ()) +
                 (META_ORDER_QUANTIZED if "quantized.dtype" in attrs else ())):
        if name in META_OPTIONAL and name not in attrs:
            continue
        value = attrs[name]
        if isinstance(value, (bytes, str)):
            text = value if isinstance(value, bytes) else value.encode()
        elif isinstance(value, (float, np.floating)):
            text = ("%.17g" % float(value)).encode()
        else:
            text = str(int(value)).encode()
        for byte in name.encode() + b"\0" + text + b"\0":
            h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def set_attrs(path, reseal=True, **values):
    """Sets root attributes (model_n_head=... for model.n_head); with reseal, stores a matching
    metadata checksum, so that the check behind it is the one that must catch the value."""
    with h5py.File(path, "r+") as f:
        for key, value in values.items():
            f.attrs[key.replace("model_", "model.")] = np.int64(value)
        if reseal:
            f.attrs["meta_checksum"] = np.uint64(meta_checksum(f.attrs))


def test_metadata_checksum_matches_its_definition():
    for fmt in FORMATS:
        with h5py.File(os.path.join(saved(fmt), ckpt_name(4)), "r") as f:
            assert f.attrs["meta_checksum"].dtype == np.uint64
            assert int(f.attrs["meta_checksum"]) == meta_checksum(f.attrs), fmt


def test_edited_step_is_refused_and_skipped():
    """A changed `step` (or config) under the old metadata checksum: an explicit resume exits 2
    naming the file; resume=auto warns and falls back to the previous checkpoint."""
    path = copy_of("sharded")
    set_attrs(path, reseal=False, step=3)
    proc = train(2, tempdir(), f"--checkpoint.resume={path}", "--train.steps=6")
    one_error(proc, path, "metadata")
    assert not re.search(r"^step ", proc.stdout, re.M), "training started"

    d = tempdir()
    for step in (2, 4):
        shutil.copy(os.path.join(saved("gathered"), ckpt_name(step)), d)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write(ckpt_name(4) + "\n")
    with h5py.File(os.path.join(d, ckpt_name(4)), "r+") as f:
        f.attrs["config"] = np.bytes_(bytes(f.attrs["config"]).replace(b"lr = ", b"lr = 1"))
    proc = train(2, d, "--train.steps=6", "--checkpoint.format=gathered")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(ckpt_name(4) in l and "metadata" in l for l in proc.stderr.splitlines() if l.startswith("warning")), \
        proc.stderr
    assert f"resumed from {os.path.join(d, ckpt_name(2))} at step 2" in proc.stdout, proc.stdout[-2000:]


def test_checkpoint_without_metadata_checksum_loads_with_a_warning():
    """Files of earlier builds have no meta_checksum: accepted (documented), with a warning."""
    path = copy_of("gathered")
    with h5py.File(path, "r+") as f:
        del f.attrs["meta_checksum"]
    proc = train(2, tempdir(), f"--checkpoint.resume={path}", "--train.steps=5", "--checkpoint.format=gathered")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {path} at step 4" in proc.stdout
    assert [l for l in proc.stderr.splitlines() if "no metadata checksum" in l and l.startswith("warning")]
    proc = run_single(["inspect", path])
    assert proc.returncode == 0 and "no metadata checksum" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- inspect and export validate


def damage(fmt, kind):
    """A copy of the step-4 checkpoint with one defect; returns (path, what the message must name)."""
    path = copy_of(fmt, name=f"{kind}.h5")
    some = "shards/h.1/params" if fmt == "sharded" else "model/h.1.attn.qkv.weight"
    with h5py.File(path, "r+") as f:
        if kind == "checksum":
            values = f[some][()]
            values.reshape(-1).view(np.uint32)[5] ^= 1 << 12
            f[some][...] = values
        elif kind == "missing":
            del f[some]
        elif kind == "extra":
            f.create_dataset("model/notes" if fmt == "gathered" else "shards/h.0/notes", data=np.zeros(3, np.float32))
            some = "notes"
        elif kind == "shape":
            values, attrs = f[some][()], dict(f[some].attrs)
            del f[some]
            ds = f.create_dataset(some, data=values.reshape(-1)[:values.size // 2])
            for k, v in attrs.items():
                ds.attrs[k] = v
    if kind == "n_head":
        set_attrs(path, model_n_head=0)
        some = "model.n_head=0"
    elif kind == "n_layer":
        set_attrs(path, model_n_layer=2 ** 40)
        some = "model.n_layer=1099511627776"
    elif kind == "step":
        set_attrs(path, reseal=False, step=2)
        some = "metadata"
    return path, some


KINDS = ("checksum", "missing", "extra", "shape", "n_head", "n_layer", "step")


def test_inspect_and_export_refuse_what_training_refuses():
    for fmt in FORMATS:
        for kind in KINDS:
            path, needle = damage(fmt, kind)
            proc = run_single(["inspect", path], timeout=30)
            one_error(proc, path, needle)
            assert "parameter" not in proc.stdout, f"{fmt}/{kind}: inspect printed the table"
            out = os.path.join(tempdir(), "model.bin")
            proc = run_single(["export", "--checkpoint", path, "--output", out], timeout=30)
            one_error(proc, path, needle)
            assert not os.path.exists(out) and not os.path.exists(out + ".tmp"), f"{fmt}/{kind}: export wrote"
            if kind in ("extra", "n_head", "n_layer"):  # the same validation in the training load
                proc = train(2, tempdir(), f"--checkpoint.resume={path}", "--train.steps=6",
                             f"--checkpoint.format={fmt}")
                one_error(proc, path, needle)
    assert_valid(os.path.join(saved("sharded"), ckpt_name(4)))


# ---------------------------------------------------------------- checkpoint.dir


def test_checkpoint_dir_that_is_a_file():
    d = tempdir()
    a_file = os.path.join(d, "not-a-folder")
    with open(a_file, "w") as f:
        f.write("x\n")
    for target, needle in ((a_file, f"checkpoint.dir '{a_file}' is a file"),
                           (os.path.join(a_file, "run"), f"'{a_file}' is a file")):
        proc = train(2, target, "--train.steps=2", timeout=30)
        one_error(proc, needle)
        assert not re.search(r"^step ", proc.stdout, re.M), "training started"
    with open(a_file) as f:
        assert f.read() == "x\n"


# ---------------------------------------------------------------- a full disk


def mount_tmpfs(size_kib):
    if os.geteuid() != 0:
        raise Skip("mounting a small tmpfs needs root")
    d = tempdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", d], capture_output=True,
                          text=True, timeout=30)
    if proc.returncode != 0:
        raise Skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    return d


def unmount(d):
    subprocess.run(["umount", "-l", d], capture_output=True, timeout=30)


def test_disk_full_during_save():
    """A tmpfs that holds the step-2 checkpoint but not the step-4 one. With the space reserved
    first (the default) and without (SHARDTRAIN_CHECKPOINT_PREALLOCATE=0: the collective HDF5
    writes then fail, on the aggregating rank only), with and without the watchdog
    (fsdp.comm_timeout=0: a hang would run into this test's timeout). Before the fix the ranks
    waited in different barriers while HDF5 closed the file."""
    cases = (("sharded", "1", "0"), ("gathered", "0", "0"), ("sharded", "0", "60"))
    for fmt, preallocate, comm_timeout in cases:
        size = os.path.getsize(os.path.join(saved(fmt), ckpt_name(2)))
        mnt = mount_tmpfs(int(size * 1.5) // 1024)
        try:
            d = os.path.join(mnt, "run")
            os.mkdir(d)
            env = dict(os.environ, SHARDTRAIN_CHECKPOINT_PREALLOCATE=preallocate)
            proc = train(2, d, "--train.steps=4", "--checkpoint.every=2", f"--checkpoint.format={fmt}",
                         f"--fsdp.comm_timeout={comm_timeout}", env=env, timeout=40)
            case = f"{fmt} preallocate={preallocate} comm_timeout={comm_timeout}"
            assert proc.returncode != 124, f"{case}: hang\n{proc.stderr[-3000:]}"
            assert "stalled" not in proc.stderr, f"{case}: the watchdog ended it\n{proc.stderr[-3000:]}"
            one_error(proc, "checkpoint save failed: No space left on device", d)
            names = sorted(os.listdir(d))
            assert names == [ckpt_name(2), "config.ini", "latest"], (case, names)
            with open(os.path.join(d, "latest")) as f:
                assert f.read().strip() == ckpt_name(2), case
            assert_valid(os.path.join(d, ckpt_name(2)))
        finally:
            unmount(mnt)


def tool(np_, *args):
    return subprocess.run(mpirun_command(np_, [EXE, *args], 60), capture_output=True, text=True)


def test_disk_full_in_export_and_convert():
    """The other writers on a full disk: a split Hugging Face export (its first files fit, a later
    one does not), convert to a checkpoint, and the llm.c export each exit 2 with one line, leave
    nothing behind on the disk (the battery found a split export's leftovers filling it), and
    convert names its own --output, not train's checkpoint.dir."""
    ckpt = os.path.join(saved("sharded"), ckpt_name(2))
    folder = os.path.join(tempdir(), "hf")
    proc = tool(2, "export", ckpt, "--output", folder, "--format", "hf")
    assert proc.returncode == 0, proc.stderr[-2000:]
    size = os.path.getsize(os.path.join(folder, "model.safetensors"))
    cases = {
        "split export": (["export", ckpt, "--output", "MNT/hf", "--format", "hf", "--max-file-size",
                          f"{size // 3 // 1024}KB"], ("No space left on device",)),
        "convert": (["convert", "--input", folder, "--output", "MNT/c.h5"], ("No space left on device", "--output")),
        "llm.c export": (["export", ckpt, "--output", "MNT/m.bin"], ("No space left on device",)),
    }
    for case, (args, needles) in cases.items():
        mnt = mount_tmpfs(size // 2 // 1024)
        try:
            proc = tool(2, *(a.replace("MNT", mnt) for a in args))
            line = one_error(proc, *needles)
            assert "checkpoint.dir" not in line, (case, line)
            assert os.listdir(mnt) == [], (case, os.listdir(mnt))
        finally:
            unmount(mnt)


def test_latest_that_cannot_be_written():
    """`latest` is written through latest.tmp; here that name leads to /dev/full (every write:
    ENOSPC), the smallest full disk there is. The save fails with exit 2 naming the cause, and
    `latest` still names the previous checkpoint. (Before the fix the ofstream's failure went
    unnoticed and fsync's EINVAL was reported.)"""
    d = tempdir()
    proc = train(2, d, "--train.steps=2", "--checkpoint.every=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    os.symlink("/dev/full", os.path.join(d, "latest.tmp"))
    proc = train(2, d, "--train.steps=4", "--checkpoint.every=2")
    one_error(proc, "checkpoint save failed", "latest.tmp", "No space left on device")
    with open(os.path.join(d, "latest")) as f:
        assert f.read().strip() == ckpt_name(2)
    assert not os.path.lexists(os.path.join(d, "latest.tmp"))
    assert_valid(os.path.join(d, ckpt_name(2)))

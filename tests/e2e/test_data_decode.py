"""`shardtrain data decode`: token files back to text. Byte-level files against the text they were
encoded from; tokenizer.json files against the `tokenizers` package's decode(ids,
skip_special_tokens=False) of the same ids (tokenizers trained by tests/e2e/tokenizer_reference.py),
including random ids whose bytes are not valid UTF-8 (replaced by U+FFFD as the reference does)."""
import json
import os
import random

from harness import run_single, tempdir
from test_bad_input import write_tokens
from test_tokenizer import corpus_folder, encode, reference, trained


def decode(*args):
    out = os.path.join(tempdir(), "decoded.txt")
    proc = run_single(["data", "decode", *args, "--output", out], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out, "rb") as f:
        return f.read().decode("utf-8")  # must be valid UTF-8


def reference_decode(tokenizer, ids):
    path = os.path.join(tempdir(), "ids.json")
    with open(path, "w") as f:
        json.dump(ids, f)
    return json.loads(reference("decode", tokenizer, path))["text"]


def test_byte_level_round_trip_and_invalid_bytes():
    text = "naïve café, 中文 and 😀\n" * 50
    path = write_tokens(os.path.join(tempdir(), "bytes.bin"), list(text.encode()))
    assert decode("--input", path) == text
    assert decode("--input", path, "--first", "7", "--count", "6") == "café,"  # bytes, not characters
    broken = write_tokens(os.path.join(tempdir(), "broken.bin"), list(b"a\xff\xc3b\xe4\xb8"))
    assert decode("--input", broken) == b"a\xff\xc3b\xe4\xb8".decode("utf-8", errors="replace")


def test_tokenizer_decode_matches_the_reference():
    folder = corpus_folder()
    for style in ("gpt2", "llama3", "qwen2-nfc", "llama2", "metaspace"):
        tokenizer = trained(style)
        ids, _ = encode(tokenizer, folder)
        path = write_tokens(os.path.join(tempdir(), f"{style}.bin"), ids)
        assert decode("--input", path, "--tokenizer", tokenizer) == reference_decode(tokenizer, ids), style
        # Any ids, in any order: pieces of multi-byte characters decode to U+FFFD as the reference's do.
        vocab = max(json.load(open(tokenizer))["model"]["vocab"].values()) + 1
        rng = random.Random(style)
        noise = [rng.randrange(vocab) for _ in range(3000)]
        path = write_tokens(os.path.join(tempdir(), f"{style}-noise.bin"), noise)
        got, want = decode("--input", path, "--tokenizer", tokenizer), reference_decode(tokenizer, noise)
        assert got == want and "\ufffd" in want, style


def test_decode_errors_exit_2():
    path = write_tokens(os.path.join(tempdir(), "big.bin"), [65, 300])
    proc = run_single(["data", "decode", "--input", path])
    assert proc.returncode == 2 and "token 300 at index 1 is not a byte" in proc.stderr, proc.stderr
    proc = run_single(["data", "decode", "--input", path, "--tokenizer", trained("roberta")])
    assert proc.returncode == 2 and "decoder" in proc.stderr, proc.stderr
    gpt2 = trained("gpt2")
    vocab = max(json.load(open(gpt2))["model"]["vocab"].values()) + 1
    path = write_tokens(os.path.join(tempdir(), "far.bin"), [1, vocab + 7])
    proc = run_single(["data", "decode", "--input", path, "--tokenizer", gpt2])
    assert proc.returncode == 2 and f"token id {vocab + 7} is not in tokenizer file" in proc.stderr, proc.stderr

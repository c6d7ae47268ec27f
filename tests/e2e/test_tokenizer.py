"""`data encode --tokenizer`: token for token the Python `tokenizers` package (the oracle, pinned in
the test virtual environment) on tokenizer.json files that package trains here (GPT-2, RoBERTa-like,
Llama-3 and Qwen-2 styles, one with NFC) over a corpus of Unicode, whitespace runs, digits,
contractions, code, emoji, special tokens inside text and invalid UTF-8; unsupported components and
malformed files exit 2 with one line naming the file and the position."""
import copy
import json
import os
import random
import struct
import subprocess
import unicodedata

import harness
import tokenizer_reference as ref
from harness import run_single, tempdir

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer_reference.py")
STYLES = ("gpt2", "roberta", "llama3", "qwen2-nfc", "llama2", "metaspace")
# Styles whose post-processor template marks each document itself: no separator.
TEMPLATED = ("roberta", "llama3", "llama2", "metaspace")
_trained = {}

# Documents aimed at the edges, beside the random corpus: as bytes, some not UTF-8.
EDGE_DOCS = [
    b"", b" ", b"<|endoftext|>", b"\xff\xfe bad \xe0\x80 \xed\xa0\x80 trunc \xf0\x9f\x98 end \xc3",
    b"e\xcc\x81 A\xcc\x8a \xe1\x84\x80\xe1\x85\xa1 NFC changes these", (" " * 300 + "x" + "\n" * 50).encode(),
    "IT'S 'S 's 'LL we'D I'M ſ'S".encode(), "1234567890123 ١٢٣ ½".encode(), "!\u180e! a\u180eb \u0085x\u2028y".encode(),
    "x<|end_of_text|>y<|begin_of_text|><|begin_of_text|>".encode(), "a <mask>  b   <mask>c [CUSTOM] [CUSTOM]x".encode(),
    "e\u0301[CUSTOM] ½[CUSTOM] \u200d[CUSTOM] ²[CUSTOM]_ [CUSTOM]\u3000 x".encode(),  # single_word's \w
]
# Characters for random short documents: where the classes of the split patterns and of the added
# tokens' options meet (marks, joiners, odd spaces, digits of other scripts, parts of added tokens).
FUZZ_POOL = list("abcxyzABC  \t\n\r'sStTrRlLdDmMvVeE0123456789.,!?-_()[]{}<>|/\\\"#$%&*+=:;@^`~") + [
    "\u00e9", "e\u0301", "\u0301", "A\u030a", "\u1100", "\u1161", "中", "の", "한", "Ω", "ſ", "\u212a", "ﬁ",
    "\u00a0", "\u3000", "\u2028", "\u0085", "\u180e", "\u200b", "\u200d", "\ufeff", "😀", "🏽", "🇫", "٣", "½", "²",
    "\U00010400", "\ufffd", "\x00", "\x7f", "\u0900", "\u093f", "\u0e31", "\u2019", "<|endoftext|>",
    "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<mask>", "[CUSTOM]", "<s>", "</s>", "<|", "|>", "<R>",
    "cafe\u0301", "caf\u00e9"]


def reference(*args, env=None):
    proc = subprocess.run(["timeout", "600", harness.venv_python(), HELPER, *args], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def trained(style):
    """tokenizer.json of a style, trained once per test run by the reference."""
    if style not in _trained:
        path = os.path.join(tempdir(), f"{style}.json")
        reference("train", style, path)
        _trained[style] = path
    return _trained[style]


def corpus_folder():
    folder = os.path.join(tempdir(), "docs")
    os.makedirs(folder)
    for i, doc in enumerate(ref.make_corpus(7, 40, 150)):
        with open(os.path.join(folder, f"doc{i:03d}.txt"), "w", encoding="utf-8") as f:
            f.write(doc)
    for i, doc in enumerate(EDGE_DOCS):
        with open(os.path.join(folder, f"edge{i:03d}.txt"), "wb") as f:
            f.write(doc)
    return folder


def read_tokens(path):
    with open(path, "rb") as f:
        data = f.read()
    count = struct.unpack("<i", data[8:12])[0]
    return list(struct.unpack(f"<{count}H", data[1024:1024 + 2 * count]))


def token_id(tokenizer, content):
    with open(tokenizer) as f:
        return next(t["id"] for t in json.load(f)["added_tokens"] if t["content"] == content)


def encode(tokenizer, source, *extra):
    out = os.path.join(tempdir(), "out.bin")
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", source, "--output", out,
                       "--val-fraction", "0", *extra], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_tokens(out), proc.stdout


def expected(tokenizer, source, separator):
    docs = json.loads(reference("encode", tokenizer, source))["docs"]
    return docs, [t for d in docs for t in ([separator] if separator is not None else []) + d]


def assert_same(got, want, docs, separator):
    if got == want:
        return
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    # Name the document the first difference falls in.
    start = 0
    for n, d in enumerate(docs):
        end = start + len(d) + (separator is not None)
        if at < end:
            break
        start = end
    raise AssertionError(f"{len(got)} tokens, the reference {len(want)}; first difference at token {at} "
                         f"(document {n}): got {got[at:at + 8]}, want {want[at:at + 8]}")


def test_styles_match_the_reference_token_for_token():
    folder = corpus_folder()
    for style in STYLES:
        tokenizer = trained(style)
        separator = None if style in TEMPLATED else token_id(tokenizer, "<|endoftext|>")
        got, stdout = encode(tokenizer, folder)
        docs, want = expected(tokenizer, folder, separator)
        assert len(docs) == 40 + len(EDGE_DOCS)
        assert_same(got, want, docs, separator)
        assert "before each" in stdout if separator is not None else "template marks each" in stdout, stdout


def test_random_short_documents_match_the_reference():
    folder = os.path.join(tempdir(), "fuzz")
    os.makedirs(folder)
    rng = random.Random(5)
    for i in range(1500):
        with open(os.path.join(folder, f"d{i:05d}.txt"), "w", encoding="utf-8", newline="") as f:
            f.write("".join(rng.choice(FUZZ_POOL) for _ in range(rng.randint(0, 30))))
    for style in STYLES:
        tokenizer = trained(style)
        separator = None if style in TEMPLATED else token_id(tokenizer, "<|endoftext|>")
        docs, want = expected(tokenizer, folder, separator)
        assert_same(encode(tokenizer, folder)[0], want, docs, separator)


# Patterns whose classes and anchors mean other things in PCRE2 than in the reference's Oniguruma.
PROBE_PATTERNS = [r"\w+", r"[\w]+", r"\W+", r"\s+", r"[^\s]+", r"\d+", r"\h+", r"[\h_]+", r"\b\w", r"\B.",
                  r"^\w+", r"\w+$", r"(?m).+", r"(?i:k|s|ǆ)", r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"]


def test_split_patterns_mean_what_they_mean_in_oniguruma():
    # Every character Unicode 3.2 already had (older than both libraries' tables, so their versions
    # do not matter), each between two snowmen, and lines for the anchors.
    chars = (chr(c) for c in range(1, 0x20000) if unicodedata.ucd_3_2_0.category(chr(c)) not in ("Cn", "Cs"))
    text = os.path.join(tempdir(), "chars.txt")
    with open(text, "w", encoding="utf-8", newline="") as f:
        f.write("\u2603".join(chars) + "\nab cd\nef Gh\n\n")
    for pattern in PROBE_PATTERNS:
        tokenizer = os.path.join(tempdir(), "probe.json")
        reference("probe", pattern, tokenizer)
        docs, want = expected(tokenizer, text, None)
        got, _ = encode(tokenizer, text, "--separator", "none")
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise AssertionError(f"pattern {pattern!r}: cuts differ from token {at}: got {got[at - 4:at + 4]}, "
                                 f"want {want[at - 4:at + 4]}")


def test_split_string_patterns_are_literal():
    """Split's {"String": ...} pattern cuts at the text itself, metacharacters included (it was
    refused always: PCRE2_LITERAL does not take PCRE2_UCP)."""
    text = os.path.join(tempdir(), "literal.txt")
    with open(text, "w", encoding="utf-8") as f:
        f.write("a.b.c a b\\w \\w+ ww (x) é.é e\u0301 ..\n")
    for pattern in (".", "\\w", "(x)", "é", " ", ".."):
        tokenizer = os.path.join(tempdir(), "probe.json")
        reference("probe-string", pattern, tokenizer)
        assert '"String"' in open(tokenizer).read()
        docs, want = expected(tokenizer, text, None)
        got, _ = encode(tokenizer, text, "--separator", "none")
        assert got == want, (pattern, got, want)


def test_a_regex_that_cannot_finish_names_the_file_and_the_pattern():
    """Catastrophic backtracking ends in PCRE2's match limit: one line with the tokenizer file, the
    JSON position and the pattern (the battery's "match limit exceeded" named neither)."""
    tokenizer = os.path.join(tempdir(), "backtracks.json")
    reference("probe", "(a|a)+$", tokenizer)
    text = os.path.join(tempdir(), "a.txt")
    with open(text, "w") as f:
        f.write("a" * 30 + "c\n")
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", text, "--output",
                       os.path.join(tempdir(), "out.bin"), "--separator", "none"])
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(lines) == 1, proc.stderr
    for needle in (tokenizer, "/pre_tokenizer/pretokenizers/0/pattern/Regex", "'(a|a)+$'", "match limit"):
        assert needle in lines[0], (needle, lines[0])


def test_characters_missing_from_the_vocabulary():
    """unk_token, fuse_unk, byte_fallback, or dropped: on a GPT-2 file without the ByteLevel characters
    of bytes 0-3 (no merge uses them)."""
    with open(trained("gpt2")) as f:
        spec = json.load(f)
    model = spec["model"]
    used = {t for pair in model["merges"] for t in pair}
    for c in ["Ā", "ā", "Ă", "ă"]:
        assert c not in used
        del model["vocab"][c]
    tmp = tempdir()
    text = os.path.join(tmp, "text.txt")
    with open(text, "w") as f:
        f.write("a\x00\x00\x01b \x02\x03x\x00 \x01")
    top = max(model["vocab"].values())
    variants = {"dropped": {}, "unk": {"unk_token": "<|endoftext|>"},
                "fused": {"unk_token": "<|endoftext|>", "fuse_unk": True},
                "fallback": {"unk_token": "<|endoftext|>", "byte_fallback": True,  # U+0100, U+0101: C4 80, C4 81
                             "vocab": dict(model["vocab"], **{"<0xC4>": top + 1, "<0x80>": top + 2,
                                                              "<0x81>": top + 3})}}
    for name, change in variants.items():
        path = os.path.join(tmp, f"{name}.json")
        with open(path, "w") as f:
            json.dump(dict(spec, model=dict(model, **change)), f)
        docs, want = expected(path, text, None)
        got, _ = encode(path, text, "--separator", "none")
        assert got == want, f"{name}: got {got}, want {want}"


def test_jsonl_input_with_invalid_bytes():
    tokenizer = trained("qwen2-nfc")
    path = os.path.join(tempdir(), "docs.jsonl")
    with open(path, "wb") as f:
        for doc in ref.make_corpus(3, 30, 80):
            f.write(json.dumps({"text": doc, "id": 1}, ensure_ascii=False).encode() + b"\n")
            f.write(b"\n")  # blank lines hold no document
        f.write(b'{"text": "raw \xff\xc3 bytes in a JSON string e\xcc\x81"}\n')
        f.write(json.dumps({"text": "escaped \u00e9 \ud83d\ude00 <|endoftext|>"}).encode() + b"\n")
    separator = token_id(tokenizer, "<|endoftext|>")
    got, _ = encode(tokenizer, path)
    docs, want = expected(tokenizer, path, separator)
    assert len(docs) == 32
    assert_same(got, want, docs, separator)


def test_merges_stored_as_strings_give_the_same_tokens():
    tokenizer = trained("gpt2")
    with open(tokenizer) as f:
        spec = json.load(f)
    assert isinstance(spec["model"]["merges"][0], list), "the package now stores merges as pairs"
    spec["model"]["merges"] = [f"{a} {b}" for a, b in spec["model"]["merges"]]
    legacy = os.path.join(tempdir(), "legacy.json")
    with open(legacy, "w") as f:
        json.dump(spec, f)
    folder = corpus_folder()
    separator = token_id(tokenizer, "<|endoftext|>")
    got, _ = encode(legacy, folder)
    docs, want = expected(legacy, folder, separator)
    assert_same(got, want, docs, separator)
    assert got == encode(tokenizer, folder)[0]


def test_separator_option_and_validation_split():
    tokenizer = trained("llama3")
    folder = corpus_folder()
    docs, plain = expected(tokenizer, folder, None)
    assert encode(tokenizer, folder)[0] == plain  # the template's <|begin_of_text|> marks each document
    end = token_id(tokenizer, "<|end_of_text|>")
    got, stdout = encode(tokenizer, folder, "--separator", "<|end_of_text|>")
    assert got == [t for d in docs for t in [end] + d], stdout
    # The last floor(documents * fraction) whole documents go to the validation file.
    tmp = tempdir()
    out = os.path.join(tmp, "corpus_train.bin")
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", folder, "--output", out,
                       "--val-fraction", "0.1"])
    assert proc.returncode == 0, proc.stderr
    train, val = read_tokens(out), read_tokens(os.path.join(tmp, "corpus_val.bin"))
    assert train + val == plain and val == [t for d in docs[len(docs) - int(len(docs) * 0.1):] for t in d]
    assert "needs model.vocab_size >= 1500" in proc.stdout, proc.stdout
    # Without --tokenizer the byte-level encoder is unchanged; --separator alone is a usage error.
    proc = run_single(["data", "encode", "--input", os.path.join(folder, "doc000.txt"), "--output", out,
                       "--val-fraction", "0", "--separator", "x"])
    assert proc.returncode == 2 and "--separator needs --tokenizer" in proc.stderr, proc.stderr


def test_training_reads_the_tokens():
    tokenizer = trained("gpt2")
    tmp = tempdir()
    text = os.path.join(tmp, "corpus.jsonl")
    with open(text, "w") as f:
        for doc in ref.make_corpus(11, 60, 200):
            f.write(json.dumps({"text": doc}) + "\n")
    out = os.path.join(tmp, "corpus_train.bin")
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", text, "--output", out])
    assert proc.returncode == 0, proc.stderr
    metrics = os.path.join(tmp, "m.jsonl")
    proc = harness.run(2, harness.tiny_args(f"--data.train_file={out}", f"--data.val_file={tmp}/corpus_val.bin",
                                            "--model.vocab_size=1500", "--train.steps=3",
                                            f"--train.metrics_file={metrics}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(harness.read_metrics(metrics)) == 3


def expect_exit_2(spec_or_text, *needles, source=None):
    """Writes a tokenizer file (a dict as JSON, or raw text), encodes with it: exit 2, one error line."""
    path = os.path.join(tempdir(), "tok.json")
    with open(path, "w") as f:
        f.write(spec_or_text if isinstance(spec_or_text, str) else json.dumps(spec_or_text))
    if source is None:
        source = os.path.join(tempdir(), "a.txt")
        with open(source, "w") as f:
            f.write("hello world")
    proc = run_single(["data", "encode", "--tokenizer", path, "--input", source, "--output",
                       os.path.join(tempdir(), "o.bin")])
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], proc.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


def test_unsupported_components_exit_2():
    with open(trained("gpt2")) as f:
        base = json.load(f)

    def variant(pointer, value):
        spec = copy.deepcopy(base)
        *parents, last = pointer.strip("/").split("/")
        node = spec
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value
        return spec

    expect_exit_2(variant("/pre_tokenizer", {"type": "WhitespaceSplit"}), "pre-tokenizer \"WhitespaceSplit\"",
                  "/pre_tokenizer/type")
    expect_exit_2(variant("/model/type", "WordPiece"), "model \"WordPiece\"", "not supported")
    expect_exit_2(variant("/model", {"type": "Unigram", "unk_id": 0, "vocab": [["a", 0.0]]}), "model \"Unigram\"")
    expect_exit_2(variant("/normalizer", {"type": "NFD"}), "normalizer \"NFD\"", "/normalizer/type")
    expect_exit_2(variant("/normalizer", {"type": "Replace", "pattern": {"Regex": " +"}, "content": "_"}),
                  "a Replace normalizer with a regex pattern", "/normalizer/pattern")
    expect_exit_2(variant("/normalizer", {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}),
                  "normalizer \"Lowercase\"", "/normalizer/normalizers/1/type")
    split = {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Removed", "invert": False}
    expect_exit_2(variant("/pre_tokenizer", {"type": "Sequence", "pretokenizers": [split, base["pre_tokenizer"]]}),
                  "Split behavior \"Removed\"", "/pre_tokenizer/pretokenizers/0/behavior")
    expect_exit_2(variant("/post_processor", {"type": "BertPostProcessor?"}), "post-processor")
    # The reference ignores a second template of a Sequence: one that adds tokens is supported.
    template = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                                         {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [], "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                  "tokens": ["<|endoftext|>"]}}}
    expect_exit_2(variant("/post_processor", {"type": "Sequence", "processors": [template, {"type": "ByteLevel"},
                                                                                 template]}),
                  "/post_processor/processors/2", "second post-processor that adds tokens")
    expect_exit_2(variant("/model/dropout", 0.1), "dropout")
    expect_exit_2(variant("/truncation", {"max_length": 8, "strategy": "LongestFirst", "stride": 0,
                                          "direction": "Right"}), "truncation")
    # Ids beyond 16 bits: llm.c's 32-bit files (magic 20240801, version 7), the same ids.
    big = copy.deepcopy(base)
    big["added_tokens"].append({"id": 70000, "content": "<big>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    big_path, source = os.path.join(tempdir(), "big.json"), os.path.join(tempdir(), "a.txt")
    with open(big_path, "w") as f:
        json.dump(big, f)
    with open(source, "w") as f:
        f.write("hello world<big>")
    out = os.path.join(tempdir(), "big.bin")
    proc = run_single(["data", "encode", "--tokenizer", big_path, "--input", source, "--output", out,
                       "--val-fraction", "0"])
    assert proc.returncode == 0 and "needs model.vocab_size >= 70001; 32-bit tokens" in proc.stdout, proc.stderr
    with open(out, "rb") as f:
        magic, version, count = struct.unpack("<3i", f.read(12))
        f.seek(1024)
        ids = list(struct.unpack(f"<{count}I", f.read()))
    assert (magic, version) == (20240801, 7) and ids[-1] == 70000, (magic, version, ids)
    with open(source, "w") as f:
        f.write("hello world")
    assert ids[:-1] == encode(trained("gpt2"), source)[0], ids


def test_malformed_files_exit_2():
    with open(trained("gpt2")) as f:
        text = f.read()
    base = json.loads(text)
    expect_exit_2(text[:5000], "malformed JSON", "line", "column")
    expect_exit_2("[1, 2]", "expected a JSON object")
    # A number beyond double's range, found by fuzzing: "internal error ... number overflow", exit 1.
    expect_exit_2(text.replace('"version": "1.0"', '"version": 1e999', 1) if '"version": "1.0"' in text
                  else '{"version": 1e999}', "malformed JSON", "number overflow")
    # A folder given as the tokenizer: "internal error ... Is a directory", exit 1.
    folder = os.path.join(tempdir(), "a-folder")
    os.makedirs(folder)
    source = os.path.join(tempdir(), "a.txt")
    with open(source, "w") as f:
        f.write("hello world")
    proc = run_single(["data", "encode", "--tokenizer", folder, "--input", source, "--output",
                       os.path.join(tempdir(), "o.bin")])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "is a folder; give the tokenizer.json file in it" in proc.stderr, proc.stderr
    spec = copy.deepcopy(base)
    spec["model"]["merges"][7] = ["Ġnot-a-token", "x"]
    expect_exit_2(spec, "/model/merges/7", "not in the vocabulary")
    spec = copy.deepcopy(base)
    spec["model"]["merges"][3] = "one two three"
    expect_exit_2(spec, "/model/merges/3", "one space")
    spec = copy.deepcopy(base)
    spec["model"]["vocab"]["Ġthe"] = "five"
    expect_exit_2(spec, "/model/vocab/Ġthe", "token id")
    # Ids beyond the largest vocabulary a model takes (2^24 - 1) are refused before any table is
    # sized by them (one id of 50,000,000 allocated 1.98 GB; 2^31 ended in bad_alloc, exit 1).
    for where, value in (("added", 50_000_000), ("added", 2**31), ("vocab", 2**31), ("vocab", 2**24)):
        spec = copy.deepcopy(base)
        if where == "added":
            spec["added_tokens"][0]["id"] = value
            pointer = "/added_tokens/0/id"
        else:
            spec["model"]["vocab"]["Ġthe"] = value
            pointer = "/model/vocab/Ġthe"
        expect_exit_2(spec, pointer, f"token id {value} is beyond 16777215")
    # Two tokens with one id, an added token taking another token's id, no vocabulary at all.
    spec = copy.deepcopy(base)
    spec["model"]["vocab"]["Ġthe"] = spec["model"]["vocab"]["Ġand"]
    expect_exit_2(spec, "two tokens cannot share an id")
    spec = copy.deepcopy(base)
    spec["added_tokens"][0]["id"] = spec["model"]["vocab"]["Ġand"]
    expect_exit_2(spec, "/added_tokens/0/id", "is already 'Ġand'")
    spec = copy.deepcopy(base)
    spec["model"]["vocab"] = {}
    spec["model"]["merges"] = []
    expect_exit_2(spec, "/model/vocab", "the vocabulary is empty")
    spec = copy.deepcopy(base)
    del spec["model"]["vocab"]
    expect_exit_2(spec, "/model", "missing \"vocab\"")
    spec = copy.deepcopy(base)
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated", "invert": False},
        base["pre_tokenizer"]]}
    expect_exit_2(spec, "/pre_tokenizer/pretokenizers/0/pattern/Regex", "does not compile")
    # A malformed JSON Lines input names its line.
    source = os.path.join(tempdir(), "bad.jsonl")
    with open(source, "w") as f:
        f.write('{"text": "fine"}\n{"text": 3}\n')
    expect_exit_2(text, "bad.jsonl", "line 2", "\"text\"", source=source)
    with open(source, "w") as f:
        f.write('{"text": "fine"}\n\n{"text": "unclosed}\n')
    expect_exit_2(text, "bad.jsonl", "line 3", "malformed JSON", "column", source=source)


def test_train_checks_data_tokenizer():
    """data.tokenizer is recorded for generate: train refuses one that does not load, or whose ids the
    model could not take, with exit 2 at start (not generate, later)."""
    from test_bad_input import expect_usage_error
    from test_datasets import TINY_TOKENIZER
    from harness import tiny_args
    missing = os.path.join(tempdir(), "missing.json")
    expect_usage_error(tiny_args(f"--data.tokenizer={missing}"), missing)
    expect_usage_error(tiny_args(f"--data.tokenizer={tempdir()}"), "is a folder")
    malformed = os.path.join(tempdir(), "bad.json")
    with open(malformed, "w") as f:
        f.write("{")
    expect_usage_error(tiny_args(f"--data.tokenizer={malformed}"), malformed, "malformed JSON")
    wide = copy.deepcopy(TINY_TOKENIZER)
    wide["added_tokens"][0]["id"] = 300  # ids up to 300: the tiny model takes 256
    path = os.path.join(tempdir(), "wide.json")
    with open(path, "w") as f:
        json.dump(wide, f)
    expect_usage_error(tiny_args(f"--data.tokenizer={path}"), "has ids up to 300, beyond model.vocab_size=256")
    # One the model takes trains.
    ok = os.path.join(tempdir(), "ok.json")
    with open(ok, "w") as f:
        json.dump(TINY_TOKENIZER, f)
    proc = harness.run(1, tiny_args(f"--data.tokenizer={ok}", "--train.steps=1"))
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_relative_data_tokenizer_serves_generate_from_another_folder():
    """A run started in its own folder with data.tokenizer=tok.json records the tokenizer's absolute
    path: generate from elsewhere finds it (it looked for tok.json in its own working folder)."""
    from test_datasets import TINY_TOKENIZER
    from harness import tiny_args
    top = tempdir()
    tokenizer = copy.deepcopy(TINY_TOKENIZER)
    tokenizer["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    with open(os.path.join(top, "tok.json"), "w") as f:
        json.dump(tokenizer, f)
    ckdir = os.path.join(top, "run")
    proc = harness.run(1, tiny_args("--data.tokenizer=tok.json", "--train.steps=1", f"--checkpoint.dir={ckdir}"),
                       cwd=top)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = harness.run(1, ["generate", "--checkpoint", ckdir, "--prompt", "ab", "--max-tokens", "2"],
                       cwd=tempdir())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"| tokenizer {os.path.join(top, 'tok.json')} |" in proc.stderr, proc.stderr

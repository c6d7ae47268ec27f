"""`shardtrain generate` end to end: tiny GPT-2 and Llama models trained for a few seconds, then
text from their checkpoints. Greedy output is the same on 1, 2 and 3 ranks (3 pads the shards
unevenly), and so is sampled output for a seed, which another seed changes; generation stops at
model.max_seq_len with a message, at the tokenizer's end-of-text token (a model trained on
documents that data encode separated with it) and at --stop texts, each time with exactly the text
of the same greedy run not stopped (--ignore-eos) cut there; the output streams (under strace: one
write per generated character, none of a character's bytes written before its last); the tokenizer
the run recorded (data.tokenizer) encodes the prompt and decodes the output unless --tokenizer
overrides it; bad options and inputs exit 2 with one line. The decode path itself is held to a full
recompute in tests/unit/test_generation.cpp."""
import json
import os
import random
import re
import shutil
import subprocess

from harness import EXE, ROOT, Skip, ensure_data, run, run_measured, run_single, tempdir

PROMPT = "Dora has eight wolves. Dora gives"
_trained = {}


def trained(config, *overrides, key=None):
    """A checkpoint folder of `config` (inputs/<config>.ini) after 30 steps on 2 ranks, made once."""
    key = key or config
    if key not in _trained:
        train, val = ensure_data()
        folder = tempdir()
        options = {"--data.train_file": train, "--data.val_file": val, "--train.peak_gflops": "100",
                   "--checkpoint.dir": folder, "--train.steps": "30", "--train.eval_every": "0"}
        for item in overrides:
            name, _, value = item.partition("=")
            options[name] = value
        proc = run(2, ["train", "--config", os.path.join(ROOT, "inputs", f"{config}.ini"),
                       *(f"{k}={v}" for k, v in options.items())])
        assert proc.returncode == 0, proc.stderr[-3000:]
        _trained[key] = folder
    return _trained[key]


def generate(np_, checkpoint, *args):
    proc = run(np_, ["generate", "--checkpoint", checkpoint, *args])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def generated_count(proc):
    m = re.search(r"generate: (\d+) tokens? in ", proc.stderr)
    assert m, proc.stderr
    return int(m.group(1))


def prompt_tokens(proc):
    m = re.search(r"\| prompt (\d+) tokens? \|", proc.stderr)
    assert m, proc.stderr
    return int(m.group(1))


def test_greedy_output_is_the_same_on_1_2_3_ranks():
    for config in ("tiny", "llama-tiny"):
        folder = trained(config)
        outputs = [generate(np_, folder, "--prompt", PROMPT, "--max-tokens", "24", "--temperature", "0")
                   for np_ in (1, 2, 3)]
        first = outputs[0].stdout
        assert first.startswith(PROMPT) and len(first) > len(PROMPT), (config, first)
        for proc in outputs:
            assert proc.stdout == first, (config, proc.stdout, first)
            assert generated_count(proc) == 24, proc.stderr
            assert "stopped after" not in proc.stderr  # max_seq_len not reached
        # The checkpoint file itself, named directly, gives the same text.
        checkpoint = os.path.join(folder, "ckpt-00000030.h5")
        assert generate(1, checkpoint, "--prompt", PROMPT, "--max-tokens", "24", "--temperature", "0").stdout == first


def test_sampled_output_depends_on_the_seed_not_on_the_rank_count():
    for config in ("tiny", "llama-tiny"):
        folder = trained(config)
        sample = ["--prompt", PROMPT, "--max-tokens", "30", "--temperature", "1.2", "--top-k", "40", "--top-p", "0.95"]
        one = generate(1, folder, *sample, "--seed", "5").stdout
        three = generate(3, folder, *sample, "--seed", "5").stdout
        other = generate(2, folder, *sample, "--seed", "6").stdout
        assert one == three, (config, one, three)
        assert other != one, (config, one, other)
        greedy = generate(1, folder, "--prompt", PROMPT, "--max-tokens", "30", "--temperature", "0").stdout
        assert one != greedy, config


def test_stops_at_max_seq_len_with_a_message():
    folder = trained("tiny")  # max_seq_len 64
    proc = generate(2, folder, "--prompt", "Dora has", "--max-tokens", "500", "--temperature", "0")
    assert generated_count(proc) == 64 - len("Dora has"), proc.stderr
    assert "stopped after 56 tokens: the prompt's 8 tokens and the output reached model.max_seq_len=64" in proc.stderr
    assert proc.stdout.startswith("Dora has")
    # One token short of the limit: no message.
    proc = generate(1, folder, "--prompt", "Dora has", "--max-tokens", "55", "--temperature", "0")
    assert generated_count(proc) == 55 and "stopped after" not in proc.stderr, proc.stderr


def write_bpe_tokenizer(path, end_of_text=False):
    """A byte-level BPE tokenizer.json by hand: GPT-2's byte alphabet and seven merges (vocabulary
    263), and with end_of_text the special token <|endoftext|> as id 263."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {chars[b]: b for b in range(256)}
    merges = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("Ġ", "a"), ("e", "r"), ("Ġ", "s"), ("a", "s")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    added = [{"id": len(vocab), "content": "<|endoftext|>", "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}] if end_of_text else []
    with open(path, "w") as f:
        json.dump({"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                   "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
                   "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                             "ignore_merges": False, "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]}}, f)
    return len(vocab) + len(added)


def test_the_tokenizer_recorded_in_the_checkpoint():
    top = tempdir()
    tokenizer = os.path.join(top, "tokenizer.json")
    vocab = write_bpe_tokenizer(tokenizer)
    text = os.path.join(top, "text.txt")
    with open(text, "w") as f:
        f.write("the cat sat on the mat as the rat ran after her. " * 400)
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", text, "--output",
                       os.path.join(top, "cat.bin"), "--separator", "none"])
    assert proc.returncode == 0, proc.stderr
    folder = trained("tiny", f"--data.train_file={os.path.join(top, 'cat.bin')}",
                     f"--data.val_file={os.path.join(top, 'cat_val.bin')}", f"--data.tokenizer={tokenizer}",
                     "--model.vocab_size=272", key="bpe")
    prompt = "the cat sat on"
    proc = generate(2, folder, "--prompt", prompt, "--max-tokens", "12", "--temperature", "0")
    assert f"tokenizer {tokenizer}" in proc.stderr and prompt_tokens(proc) < len(prompt), proc.stderr
    assert proc.stdout.startswith(prompt) and generated_count(proc) == 12, proc.stdout
    # The same file given explicitly; then bytes (a byte prompt is 14 tokens, the output other text).
    assert generate(1, folder, "--prompt", prompt, "--max-tokens", "12", "--temperature", "0",
                    "--tokenizer", tokenizer).stdout == proc.stdout
    as_bytes = generate(1, folder, "--prompt", prompt, "--max-tokens", "12", "--temperature", "0", "--tokenizer=")
    assert "tokenizer bytes" in as_bytes.stderr and prompt_tokens(as_bytes) == len(prompt), as_bytes.stderr
    # Only ids the tokenizer can write are sampled, though the model has 272.
    for seed in ("1", "2"):
        sampled = generate(1, folder, "--prompt", prompt, "--max-tokens", "40", "--temperature", "3", "--seed", seed)
        assert sampled.stdout.startswith(prompt), sampled.stdout
    # A recorded tokenizer that is gone: exit 2, naming it and the way out.
    os.rename(tokenizer, tokenizer + ".moved")
    proc = run_single(["generate", "--checkpoint", folder, "--prompt", prompt])
    assert proc.returncode == 2, proc.stderr
    assert "the run's data.tokenizer, recorded in the checkpoint" in proc.stderr and "--tokenizer" in proc.stderr
    # A tokenizer whose ids the model does not have (tiny's 256 tokens, the BPE's 263).
    os.rename(tokenizer + ".moved", tokenizer)
    proc = run_single(["generate", "--checkpoint", trained("tiny"), "--prompt", prompt, "--tokenizer", tokenizer])
    assert proc.returncode == 2 and "past the model's model.vocab_size=256" in proc.stderr, proc.stderr
    assert vocab == 263


def test_bad_options_exit_2_with_one_line():
    folder = trained("tiny")
    empty = tempdir()
    cases = [
        (["--prompt", "x"], "'--checkpoint' is required"),
        (["--checkpoint", folder], "'--prompt' is required"),
        (["--checkpoint", folder, "--prompt", ""], "--prompt is empty"),
        (["--checkpoint", folder, "--prompt", "x", "--max-tokens", "0"], "--max-tokens='0' must be a whole number"),
        (["--checkpoint", folder, "--prompt", "x", "--temperature", "-1"], "--temperature='-1' is not allowed"),
        (["--checkpoint", folder, "--prompt", "x", "--top-p", "0"], "--top-p='0' is not allowed"),
        (["--checkpoint", folder, "--prompt", "x", "--top-k", "-3"], "--top-k='-3' must be a whole number"),
        (["--checkpoint", folder, "--prompt", "x", "--device", "gpu"], "--device='gpu' is not allowed"),
        (["--checkpoint", os.path.join(empty, "none.h5"), "--prompt", "x"], "no such file or folder"),
        (["--checkpoint", empty, "--prompt", "x"], "a folder without a complete checkpoint"),
        (["--checkpoint", folder, "--prompt", "y" * 64], "--prompt is 64 tokens, and model.max_seq_len=64 leaves no room"),
        (["--checkpoint", folder, "--prompt", "x", "--stop="], "--stop is empty"),
    ]
    for args, message in cases:
        proc = run_single(["generate", *args])
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("shardtrain: error: ") and message in lines[0], (args, lines)
    # Every rank exits 2; rank 0 alone says why.
    proc = run(3, ["generate", "--checkpoint", folder, "--prompt", "x", "--top-p", "2"])
    assert proc.returncode == 2 and proc.stderr.count("shardtrain: error:") == 1, proc.stderr


def sentence_model():
    """(checkpoint folder, tokenizer): tiny trained 80 steps on one-sentence documents, each
    preceded by <|endoftext|> (data encode's separator), so that greedy output writes it after a
    sentence's full stop."""
    if "sentences" not in _trained:
        top = tempdir()
        tokenizer = os.path.join(top, "tokenizer.json")
        assert write_bpe_tokenizer(tokenizer, end_of_text=True) == 264
        rng = random.Random(3)
        docs = os.path.join(top, "docs.jsonl")
        with open(docs, "w") as f:
            for _ in range(3000):
                sentence = f"{rng.choice(NAMES)} has {rng.choice(NUMBERS)} {rng.choice(ANIMALS)}."
                f.write(json.dumps({"text": sentence}) + "\n")
        proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", docs, "--output",
                           os.path.join(top, "s.bin")])
        assert proc.returncode == 0 and "<|endoftext|> (id 263) before each" in proc.stdout + proc.stderr, \
            proc.stdout + proc.stderr
        folder = trained("tiny", f"--data.train_file={os.path.join(top, 's.bin')}",
                         f"--data.val_file={os.path.join(top, 's_val.bin')}", f"--data.tokenizer={tokenizer}",
                         "--model.vocab_size=264", "--train.steps=80", "--train.lr=1e-2", key="sentences")
        _trained["sentences"] = (folder, tokenizer)
    return _trained["sentences"]


NAMES, NUMBERS, ANIMALS = ("Dora", "Noah", "Gus", "Leo"), ("two", "five", "seven"), ("wolves", "birds", "cats")


def test_stops_at_the_end_of_text_token_and_at_stop_texts():
    folder, _ = sentence_model()
    prompt = "Dora has"
    greedy = ["--prompt", prompt, "--max-tokens", "40", "--temperature", "0"]
    # The reference: the same greedy run, not stopped (its decode is held to a full recompute in
    # tests/unit/test_generation.cpp); the end-of-text token is written as its text.
    whole = generate(1, folder, *greedy, "--ignore-eos")
    assert generated_count(whole) == 40 and "stopped after" not in whole.stderr, whole.stderr
    output = whole.stdout[len(prompt):]
    assert whole.stdout.startswith(prompt) and "<|endoftext|>" in output, whole.stdout
    assert "stops at --max-tokens or model.max_seq_len only" in whole.stderr, whole.stderr
    before = output[:output.index("<|endoftext|>")]
    # Stopped: the text before the token, on any rank count, the token counted as generated.
    for np_ in (1, 3):
        stopped = generate(np_, folder, *greedy)
        assert "| stops at <|endoftext|> (id 263) |" in stopped.stderr, stopped.stderr
        assert stopped.stdout == prompt + before + ("" if before.endswith("\n") else "\n"), (stopped.stdout, before)
        tokens = generated_count(stopped)
        assert tokens < 40 and f"stopped after {tokens} tokens at the end-of-text token <|endoftext|> (id 263)" \
            in stopped.stderr, stopped.stderr
    # --stop texts: the first place any of them occurs in the output ends it (the prompt does not
    # count); texts spanning tokens, and beyond the end-of-text token with --ignore-eos.
    assert output.count("<|endoftext|>") >= 2, output
    for stops in (["."], ["s.", " has"], [output[-7:-3]], [prompt], ["<|endoftext|>"], ["no such text"]):
        args = [a for stop in stops for a in ("--stop", stop)]
        proc = generate(2, folder, *greedy, "--ignore-eos", *args)
        found = [(output.index(stop), stop) for stop in stops if stop in output]
        if found:
            end, matched = min(found)
            assert proc.stdout == prompt + output[:end] + "\n", (stops, proc.stdout, output)
            assert f"at --stop '{matched}', not written" in proc.stderr, proc.stderr
        else:
            assert proc.stdout == whole.stdout and generated_count(proc) == 40, (stops, proc.stdout)


def test_output_streams_token_by_token():
    """Under strace, the process's writes to standard output: the prompt, then each generated
    character as soon as its last byte is generated (a byte-level model writes é, € and 😀 as 2, 3
    and 4 tokens: nothing is written until the character is whole), then the final newline. The
    model: tiny trained 80 steps on a French line with those characters."""
    if shutil.which("strace") is None:
        raise Skip("strace is not installed")
    top = tempdir()
    text = os.path.join(top, "text.txt")
    with open(text, "w") as f:
        f.write("Le café coûte 5 € 😀 et le thé 3 € 😀.\n" * 600)
    proc = run_single(["data", "encode", "--input", text, "--output", os.path.join(top, "u.bin")])
    assert proc.returncode == 0, proc.stderr
    folder = trained("tiny", f"--data.train_file={os.path.join(top, 'u.bin')}",
                     f"--data.val_file={os.path.join(top, 'u_val.bin')}", "--train.steps=80", "--train.lr=1e-2",
                     key="unicode")
    prompt = "Le café"
    log = os.path.join(top, "writes.log")
    args = ["--checkpoint", folder, "--prompt", prompt, "--max-tokens", "50", "--temperature", "0"]
    traced = subprocess.run(["timeout", "-k", "5", "60", "strace", "-f", "-qq", "-e", "trace=write", "-xx",
                             "-s", "100000", "-o", log, EXE, "generate", *args], capture_output=True)
    assert traced.returncode == 0, traced.stderr[-3000:]
    writes = []
    with open(log) as f:
        for line in f:
            m = re.search(r'write\(1, "((?:\\x[0-9a-f]{2})*)"', line)
            if m:
                writes.append(bytes.fromhex(m.group(1).replace("\\x", "")))
    assert b"".join(writes) == traced.stdout
    stdout = traced.stdout.decode()
    output = stdout[len(prompt):-1]
    # (The last character may be cut by --max-tokens: one U+FFFD, written with what was held.)
    assert stdout.startswith(prompt) and stdout.endswith("\n") and "\ufffd" not in output[:-1], stdout
    assert any(len(c.encode()) > 1 for c in output) and any(len(c.encode()) == 4 for c in output), output
    assert [w.decode() for w in writes] == [prompt, *output, "\n"], writes
    # The same text as the untraced run on 2 ranks.
    assert generate(2, folder, *args[2:]).stdout == stdout


def test_generate_holds_no_optimizer_moments():
    # A 28M-parameter model (113 MB of fp32 weights; its AdamW moments would be 226 MB more): the
    # weights are loaded without an optimizer, so generate's peak exceeds the tiny model's by about
    # the weights and a gathered block, never by the moments (measured: 110 MiB; 326 MiB before).
    train, _ = ensure_data()
    shape = ["--model.n_layer=4", "--model.n_embd=768", "--model.n_head=12"]
    peaks = {}
    for name, options in (("tiny", []), ("big", shape)):
        folder = tempdir()
        proc = run_single(["train", "--config", os.path.join(ROOT, "inputs", "tiny.ini"), *options,
                           "--train.steps=1", "--train.global_batch=2", "--train.micro_batch=2", "--train.seq_len=8",
                           "--train.peak_gflops=100", "--train.eval_every=0", f"--checkpoint.dir={folder}",
                           f"--data.train_file={train}", "--data.val_file="], timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        proc, peaks[name] = run_measured(["generate", "--checkpoint", os.path.join(folder, "ckpt-00000001.h5"),
                                          "--prompt", "hello", "--max-tokens", "4", "--temperature", "0"])
        assert proc.returncode == 0, proc.stderr[-3000:]
    L, C, V, T = 4, 768, 256, 64
    params = V * C + T * C + 2 * C + L * (12 * C * C + 13 * C)
    assert peaks["big"] - peaks["tiny"] < 1.5 * 4 * params, (peaks, 4 * params)

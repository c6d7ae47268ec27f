"""Chat and instruction data (docs/data.md, "Chat and instruction data"): tools/chat_template.py
renders records with a model folder's Jinja chat template into segments (checked against the text
the template must give, written out by hand), `data encode` stores their tokens (the `tokenizers`
package's ids for each segment, the oracle) with a loss mask, and the trainer averages the loss over
the trained targets only: a mask and its complement add up to the unmasked loss, and the masked loss
does not depend on the rank count or the micro-batch split."""
import json
import os
import random
import re
import struct
import subprocess

import harness
from harness import ROOT, read_metrics, rel_diff, run, run_single, tempdir, tiny_args
from test_tokenizer import reference, trained

TOOL = os.path.join(ROOT, "tools", "chat_template.py")
# Qwen 2 / SmolLM's ChatML template, with its default system turn ('\n' escapes as in their JSON).
CHATML = (r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          r"{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
RECORDS = [
    {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
                  {"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "2 + 3 = 5."}]},
    {"prompt": [{"role": "user", "content": "Name a colour."}],
     "completion": [{"role": "assistant", "content": "Blue."}]},
    {"prompt": "Q: capital of France?\nA:", "completion": " Paris"},
]
EXPECTED = [
    [(SYSTEM + "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", False),
     ("Hello! How can I help?<|im_end|>\n", True),
     ("<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n", False),
     ("2 + 3 = 5.<|im_end|>\n", True)],
    [(SYSTEM + "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n", False),
     ("Blue.<|im_end|>\n", True)],
    [("Q: capital of France?\nA:", False), (" Paris<|im_end|>", True)],
]


def model_folder():
    folder = tempdir()
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None,
                   "pad_token": {"content": "<|endoftext|>", "special": True}}, f)
    return folder


def render(folder, records):
    source, out = os.path.join(tempdir(), "chats.jsonl"), os.path.join(tempdir(), "segments.jsonl")
    with open(source, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    proc = subprocess.run([harness.venv_python(), TOOL, "--model", folder, "--input", source, "--output", out],
                          capture_output=True, text=True, timeout=120)
    return proc, out


def read_token_file(path):
    """Tokens and the loss mask (None without one) of a token file, read by this test's own code."""
    with open(path, "rb") as f:
        data = f.read()
    magic, _, count, flags = struct.unpack("<4i", data[:16])
    width = 2 if magic == 20240520 else 4
    tokens = list(struct.unpack(f"<{count}{'H' if width == 2 else 'I'}", data[1024:1024 + width * count]))
    if not flags & 1:
        assert len(data) == 1024 + width * count
        return tokens, None
    bits = data[1024 + width * count:]
    assert len(bits) == (count + 7) // 8
    return tokens, [bits[i // 8] >> (i % 8) & 1 for i in range(count)]


def write_token_file(path, tokens, mask=None):
    """A 16-bit token file with an optional loss mask, written by this test's own code."""
    header = [20240520, 1, len(tokens), 1 if mask is not None else 0] + [0] * 252
    bits = bytearray((len(tokens) + 7) // 8)
    for i, m in enumerate(mask or []):
        bits[i // 8] |= m << (i % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header) + struct.pack(f"<{len(tokens)}H", *tokens))
        if mask is not None:
            f.write(bytes(bits))


def test_the_template_renders_and_the_mask_keeps_the_assistant_tokens():
    folder = model_folder()
    proc, segments_file = render(folder, RECORDS)
    assert proc.returncode == 0, proc.stderr
    assert read_segments(segments_file) == EXPECTED

    tokenizer = trained("chatml")
    (tokens, mask), proc = encoded(tokenizer, segments_file)
    separator = json.loads(reference("encode", tokenizer, _text_file("<|endoftext|>")))["docs"][0]
    assert len(separator) == 1
    want_tokens, want_mask = expected_tokens(tokenizer, segments_file, EXPECTED, separator)
    assert tokens == want_tokens
    assert mask == want_mask
    assert "trained (loss mask)" in proc.stdout, proc.stdout

    out_all = os.path.join(tempdir(), "chat-all.bin")
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", segments_file, "--output", out_all,
                       "--val-fraction", "0", "--loss-on", "all"])
    assert proc.returncode == 0, proc.stderr
    assert read_token_file(out_all) == (want_tokens, None)


def read_segments(path):
    with open(path) as f:
        return [[(s["text"], s["train"]) for s in json.loads(line)["segments"]] for line in f]


def encoded(tokenizer, segments_file):
    """The tokens and mask `data encode` writes for a segments file, and its CompletedProcess."""
    out = os.path.join(tempdir(), "chat.bin")
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", segments_file, "--output", out,
                       "--val-fraction", "0"])
    assert proc.returncode == 0, proc.stderr
    return read_token_file(out), proc


def expected_tokens(tokenizer, segments_file, records, separator):
    """The reference's tokens of each record's whole text after the separator, and the mask: a token
    is trained when the segment holding its last character is."""
    tokens, mask = [], []
    for record, doc in zip(records, json.loads(reference("encode-segments", tokenizer, segments_file))["docs"]):
        tokens += separator
        mask += [0] * len(separator)  # the boundary between records is not trained
        tokens += doc["ids"]
        mask += [int(record[s][1]) for s in doc["segment"]]
    return tokens, mask


# Llama 2's chat format on a SentencePiece-style tokenizer, whose Prepend normalizer would put a
# "▁" at the start of every segment encoded on its own: the record is encoded whole.
LLAMA2_CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
               "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}"
               "{% endif %}{% endfor %}")


def test_a_sentencepiece_tokenizer_encodes_each_record_whole():
    folder = tempdir()
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": LLAMA2_CHAT, "bos_token": "<s>", "eos_token": "</s>"}, f)
    proc, segments_file = render(folder, RECORDS[:2])
    assert proc.returncode == 0, proc.stderr
    records = read_segments(segments_file)
    assert records[0][1] == (" Hello! How can I help? </s>", True), records[0]
    tokenizer = trained("llama2")
    (tokens, mask), _ = encoded(tokenizer, segments_file)
    want_tokens, want_mask = expected_tokens(tokenizer, segments_file, records, [])  # the template's <s> marks records
    assert tokens == want_tokens
    assert mask == want_mask
    assert 0 < sum(mask) < len(mask)


def _text_file(text):
    path = os.path.join(tempdir(), "one.txt")
    with open(path, "w") as f:
        f.write(text)
    return path


def test_chat_records_and_bad_segments_exit_2_with_the_fix():
    source = os.path.join(tempdir(), "chats.jsonl")
    with open(source, "w") as f:
        f.write(json.dumps(RECORDS[0]) + "\n")
    tokenizer = trained("chatml")
    out = os.path.join(tempdir(), "x.bin")
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", source, "--output", out])
    assert proc.returncode == 2, proc.stderr
    assert "tools/chat_template.py" in proc.stderr and "line 1" in proc.stderr, proc.stderr
    with open(source, "w") as f:
        f.write(json.dumps({"segments": [{"text": "a", "train": "yes"}]}) + "\n")
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", source, "--output", out])
    assert proc.returncode == 2 and "segment 0" in proc.stderr, proc.stderr
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", source, "--output", out,
                       "--loss-on", "prompts"])
    assert proc.returncode == 2 and "--loss-on" in proc.stderr, proc.stderr
    # A template that rewrites earlier turns cannot be split into prompt and answer.
    folder = tempdir()
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                    "{% if add_generation_prompt %}{{ 'A:' }}{% else %}{{ '.' }}{% endif %}"}, f)
    proc, _ = render(folder, [RECORDS[0]])
    assert proc.returncode != 0 and "line 1" in proc.stderr and "differently" in proc.stderr, proc.stderr


# One step of tiny.ini reads 24 windows of 32 tokens: a file of exactly that many (+1) is read whole.
WINDOW_TOKENS = 24 * 32 + 1


def masked_runs(*cases, steps=1, np_=1, extra=()):
    """The step and eval metrics of a run on each (tokens, mask) case, the same file as training and
    validation data, and the run's checkpoint folder."""
    results = []
    for tokens, mask in cases:
        path = os.path.join(tempdir(), "data.bin")
        write_token_file(path, tokens, mask)
        metrics, checkpoints = os.path.join(tempdir(), "m.jsonl"), tempdir()
        proc = run(np_, tiny_args(f"--data.train_file={path}", f"--data.val_file={path}", f"--train.steps={steps}",
                                  f"--train.metrics_file={metrics}", "--train.eval_every=1",
                                  f"--checkpoint.dir={checkpoints}", *extra), timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append((read_metrics(metrics), read_metrics(metrics, "eval"), checkpoints))
    return results


def evaluated_loss(checkpoints, tokens, mask):
    path = os.path.join(tempdir(), "val.bin")
    write_token_file(path, tokens, mask)
    proc = run(2, ["eval", "--checkpoint", checkpoints, "--data", path, "--batches", "all"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(re.search(r"\| loss ([0-9.]+) \|", proc.stdout).group(1))


def test_the_loss_averages_over_the_trained_targets():
    """A mask's loss times its trained targets plus its complement's equals the unmasked loss times
    all targets: the first step's loss (before any update), and `shardtrain eval` of one checkpoint on
    the three files; a mask that trains everything gives the unmasked run's bits."""
    rng = random.Random(5)
    tokens = [rng.randrange(256) for _ in range(WINDOW_TOKENS)]
    mask = [rng.randrange(2) for _ in tokens]
    complement = [1 - m for m in mask]
    plain, first, second, ones = masked_runs((tokens, None), (tokens, mask), (tokens, complement),
                                             (tokens, [1] * len(tokens)), steps=2)
    targets = len(tokens) - 1  # token 0 is no window's target
    n1, n2 = sum(mask[1:]), sum(complement[1:])
    assert n1 + n2 == targets and 0 < n1 < targets
    losses = [[run_metrics[0][0]["loss"] for run_metrics in (plain, first, second)],
              [evaluated_loss(plain[2], tokens, m) for m in (None, mask, complement)]]
    for whole, l1, l2 in losses:
        assert rel_diff(whole * targets, l1 * n1 + l2 * n2) <= 1e-5, (whole, l1, l2, n1, n2)
        assert abs(l1 - l2) > 1e-3  # the masks do select different tokens

    def numbers(run_metrics):
        return [[r.get(k) for k in ("loss", "grad_norm", "val_loss")] for kind in run_metrics[:2] for r in kind]
    assert numbers(ones) == numbers(plain)


def test_the_masked_loss_does_not_depend_on_ranks_or_micro_batches():
    rng = random.Random(6)
    tokens = [rng.randrange(256) for _ in range(4 * WINDOW_TOKENS)]
    mask = [1 if rng.random() < 0.3 else 0 for _ in tokens]
    base = masked_runs((tokens, mask), steps=3)[0]
    for np_, micro in ((2, 2), (3, 2), (1, 4)):
        other = masked_runs((tokens, mask), steps=3, np_=np_, extra=(f"--train.micro_batch={micro}",))[0]
        for a, b in zip(base[0], other[0]):
            assert rel_diff(a["loss"], b["loss"]) <= 1e-5, (np_, micro, a, b)
        assert rel_diff(base[1][-1]["val_loss"], other[1][-1]["val_loss"]) <= 1e-5, (np_, micro)

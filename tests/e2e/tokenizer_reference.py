"""The Python `tokenizers` package's side of the tokenizer tests and benchmark, run by the test virtual
environment's python. The corpus functions need only the standard library (the e2e tests, which run
under Debian's python, import them); the commands import `tokenizers`.

  tokenizer_reference.py train STYLE OUT.json          train a tokenizer.json of a style (see STYLES)
  tokenizer_reference.py probe PATTERN OUT.json        a tokenizer that shows where Split(PATTERN) cuts:
                                                       no merges, and ByteLevel puts "Ġ" before each piece
  tokenizer_reference.py probe-string TEXT OUT.json    the same with Split's String pattern (literal TEXT)
  tokenizer_reference.py encode TOKENIZER INPUT        {"docs": [ids per document]} as the reference
                                                       reads INPUT (a text file, a .jsonl file, a folder)
  tokenizer_reference.py bench TOKENIZER INPUT         {"bytes", "seconds"} of encode_batch over INPUT
  tokenizer_reference.py decode TOKENIZER IDS.json     {"text": decode(ids, skip_special_tokens=False)}
  tokenizer_reference.py encode-segments TOKENIZER SEGMENTS.jsonl
                                                       {"docs": [[ids per segment] per record]}, each
                                                       segment's encode(text, add_special_tokens=False)
"""
import json
import os
import random
import sys
import time

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

WORDS = ("the of and to in is was for that with as on by he at from his it an were are which this be or had not "
         "but first one their its new after who they have her she two been other when there all during into school "
         "time may years more most only over city some world would where later up such used many can state about "
         "national out known university united then made").split()
PIECES = [
    "it's", "don't", "they're", "we've", "I'm", "you'll", "she'd", "IT'S", "DON'T", "They'RE", "o'clock", "'tis",
    "café", "naïve", "résumé", "cafe\u0301", "A\u030angstro\u0308m", "\u1100\u1161\u11a8", "Ω Ω", "ﬁne ﬀ",
    "中文字符测试", "日本語のテキスト", "한국어 문장", "Ελληνικά", "русский текст", "עברית", "العربية", "हिन्दी",
    "12345678", "3.14159", "2024-05-20", "1,000,000", "٣٤٥", "x²+y³", "½", "Ⅻ",
    "def f(x):\n    return x**2  # square\n", "if (a && b) { c++; }\n", "\tindent\t\ttabs", "a->b != c",
    "printf(\"%d\\n\", n);", "<div class=\"x\">", "foo_bar_baz", "$HOME/.bashrc", "https://example.com/a?b=c",
    "😀", "👨\u200d👩\u200d👧", "🇫🇷🇩🇪", "👍🏽", "✨ sparkle", "♥", "\U0001F600\U0001F601",
    "   ", "\t\t", "\n\n\n", "  \n  ", " \r\n", "\u00a0", "\u3000", "\u2028", "\u0085", "\u180e", "!\u180e!",
    "                    ", " \u00a0 ", "end.", "...", "!!!", "?!", "—", "«quote»", "“smart”",
    "Hello<|endoftext|>World", "<|endoftext|>", " <|endoftext|> ", "<|begin_of_text|>x", "x<|end_of_text|>",
    "<|im_start|>user", "<mask>", " <mask> ", "a<mask>b", "[CUSTOM]", "the[CUSTOM]x", " [CUSTOM] ", "<R>  x", "a<R>",
]


def make_corpus(seed, documents, words_per_document):
    """Documents of words and the PIECES above in random order, reproducible from the seed."""
    rng = random.Random(seed)
    docs = []
    for _ in range(documents):
        parts = []
        for _ in range(words_per_document):
            r = rng.random()
            token = rng.choice(PIECES) if r < 0.25 else rng.choice(WORDS)
            if r > 0.9:
                token = token.capitalize()
            parts.append(token)
            parts.append(rng.choice([" ", " ", " ", " ", "  ", "\n", ", ", ". ", ""]))
        docs.append("".join(parts))
    return docs


# Styles the tests train; each returns (tokenizer, trainer).
def build(style):
    from tokenizers import AddedToken, Tokenizer, Regex, decoders, models, normalizers, pre_tokenizers, trainers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if style == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        specials = ["<|endoftext|>"]
    elif style == "roberta":  # prefix space, post-processor, added tokens with options
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
        specials = ["<s>", "</s>", AddedToken("<mask>", lstrip=True, special=True)]
    elif style in ("llama3", "qwen2-nfc", "chatml"):
        llama = style == "llama3"
        tok = Tokenizer(models.BPE(ignore_merges=llama))
        if style == "qwen2-nfc":
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN if llama else QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        specials = ["<|begin_of_text|>", "<|end_of_text|>"] if llama else ["<|endoftext|>", "<|im_start|>"]
        if style == "chatml":  # Qwen 2's chat tokens
            specials.append("<|im_end|>")
    elif style in ("llama2", "metaspace"):  # SentencePiece-style: BPE on characters, bytes as <0xXX>
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        if style == "llama2":  # as Llama 2's and TinyLlama's files: Prepend + Replace, no pre-tokenizer
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
        else:  # as Mistral's newer files: Metaspace, here with NFKC
            tok.normalizer = normalizers.NFKC()
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
            tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                                split=True), decoders.ByteFallback(), decoders.Fuse()])
        # The 256 byte tokens get ids after <unk>, <s>, </s>, as in Llama 2's vocabulary; train() takes
        # them out of the added tokens again. A small alphabet leaves rare characters to them.
        specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        return tok, trainers.BpeTrainer(vocab_size=1500, min_frequency=2, special_tokens=specials, limit_alphabet=80,
                                        show_progress=False)
    else:
        raise SystemExit(f"unknown style {style}")
    trainer = trainers.BpeTrainer(vocab_size=1500, min_frequency=2, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    return tok, trainer


def probe(pattern, out, literal=False):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern if literal else Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)])
    tok.save(out)


def train(style, out):
    from tokenizers import AddedToken, Tokenizer, processors
    tok, trainer = build(style)
    tok.train_from_iterator(make_corpus(1, 400, 120), trainer)
    if style == "roberta":
        tok.add_tokens([AddedToken("[CUSTOM]", single_word=True, rstrip=True, normalized=True)])
        tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                          ("<s>", tok.token_to_id("<s>")))
    if style == "qwen2-nfc":  # an added token matched after NFC, one that eats the spaces after it
        tok.add_tokens([AddedToken("cafe\u0301", normalized=True), AddedToken("<R>", rstrip=True, normalized=False)])
    if style == "llama3":  # as Meta's files: ByteLevel offsets, then the BOS template
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                          special_tokens=[(bos, tok.token_to_id(bos))])])
    if style in ("llama2", "metaspace"):  # the BOS template; the byte tokens only in the vocabulary
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
        spec = json.loads(tok.to_str())
        spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
        tok = Tokenizer.from_str(json.dumps(spec))
    tok.save(out)


def read_documents(path):
    """Documents as ShardTrain reads them: bytes decoded with errors="replace"; .jsonl: one {"text"}
    per non-blank line; a folder: its files sorted by path, names starting with '.' skipped."""
    if os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files += [os.path.join(root, n) for n in names if not n.startswith(".")]
        return [doc for f in sorted(files) for doc in read_documents(f)]
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    if not path.endswith(".jsonl"):
        return [text]
    return [json.loads(line)["text"] for line in text.split("\n") if line.strip(" \t\r")]


def main():
    command = sys.argv[1]
    if command in ("train", "probe", "probe-string"):
        if command == "train":
            train(sys.argv[2], sys.argv[3])
        else:
            probe(sys.argv[2], sys.argv[3], literal=command == "probe-string")
        return
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(sys.argv[2])
    if command == "encode-segments":
        # Each record's whole text, as apply_chat_template encodes it, and each token's segment: the
        # one holding the token's last character (a token across a boundary is the later segment's).
        with open(sys.argv[3], encoding="utf-8") as f:
            records = [json.loads(line)["segments"] for line in f if line.strip()]
        docs = []
        for segments in records:
            encoding = tok.encode("".join(s["text"] for s in segments), add_special_tokens=False)
            ends, total = [], 0
            for s in segments:
                total += len(s["text"])
                ends.append(total)
            owner = [next(i for i, end in enumerate(ends) if max(stop - 1, start) < end)
                     for start, stop in encoding.offsets]
            docs.append({"ids": encoding.ids, "segment": owner})
        print(json.dumps({"docs": docs}))
        return
    if command == "decode":
        with open(sys.argv[3]) as f:
            print(json.dumps({"text": tok.decode(json.load(f), skip_special_tokens=False)}))
        return
    docs = read_documents(sys.argv[3])
    if command == "encode":
        print(json.dumps({"docs": [tok.encode(d).ids for d in docs]}))
    elif command == "bench":  # RAYON_NUM_THREADS=1 in the environment makes encode_batch one core
        start = time.perf_counter()
        tok.encode_batch(docs)
        seconds = time.perf_counter() - start
        print(json.dumps({"bytes": sum(len(d.encode()) for d in docs), "seconds": seconds}))
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Tokenizer speed, MB/s on one core: `shardtrain data encode --tokenizer` against the Python
`tokenizers` package (encode_batch with RAYON_NUM_THREADS=1) on the same JSON Lines input and the
same tokenizer.json. Run by hand:

  /usr/bin/python3 tests/bench/tokenizer_bench.py [--build build] [--style gpt2] [--mb 20]
                                                  [--tokenizer FILE] [--input FILE.jsonl|FOLDER] [--repeat 3]

Without --tokenizer it trains one of tests/e2e/tokenizer_reference.py's styles (gpt2, roberta,
llama3, qwen2-nfc, llama2, metaspace, or "all"); without --input it writes --mb MB of that file's
generated corpus (--input takes what `data encode` takes: a text or .jsonl file, a folder).
The reference runs in the test virtual environment (made by tests/run_tests.py's ensure_test_venv).
MB/s is input bytes (UTF-8, 10^6 per MB) over the encoding time: ours as the command reports it
(reading the documents and encoding, not loading the tokenizer or writing the file) and as the whole
command's wall time; the reference's is its encode_batch call alone. Best of --repeat runs each.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import tokenizer_reference  # noqa: E402  (standard library only on this side)

HELPER = os.path.join(ROOT, "tests", "e2e", "tokenizer_reference.py")


def venv_python(build):
    import run_tests
    python, why = run_tests.ensure_test_venv(build)
    if python is None:
        sys.exit(f"tokenizer_bench: {why}")
    return python


def write_corpus(path, megabytes):
    written, seed = 0, 100
    with open(path, "w", encoding="utf-8") as f:
        while written < megabytes * 1e6:
            for doc in tokenizer_reference.make_corpus(seed, 200, 1000):
                line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
                f.write(line)
                written += len(line.encode())
            seed += 1


def ours(exe, tokenizer, source, scratch):
    out = os.path.join(scratch, "bench.bin")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.run([exe, "data", "encode", "--tokenizer", tokenizer, "--input", source, "--output", out,
                           "--val-fraction", "0"], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"tokenizer_bench: shardtrain failed: {proc.stderr.strip()}")
    m = re.search(r"encoded \d+ documents? \((\d+) bytes\) in ([\d.]+) s", proc.stdout)
    return int(m.group(1)), float(m.group(2)), wall


def reference(python, tokenizer, source):
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([python, HELPER, "bench", tokenizer, source], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"tokenizer_bench: reference failed: {proc.stderr.strip()[-2000:]}")
    got = json.loads(proc.stdout)
    return got["bytes"], got["seconds"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--style", default="gpt2")
    parser.add_argument("--tokenizer")
    parser.add_argument("--input")
    parser.add_argument("--mb", type=float, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    exe = os.path.join(args.build, "shardtrain")
    python = venv_python(args.build)
    scratch = tempfile.mkdtemp(prefix="tokenizer-bench-")
    source = args.input
    if source is None:
        source = os.path.join(scratch, "corpus.jsonl")
        write_corpus(source, args.mb)
    styles = ["given"] if args.tokenizer else (
        ["gpt2", "roberta", "llama3", "qwen2-nfc", "llama2", "metaspace"] if args.style == "all" else [args.style])
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(source) for n in names) \
        if os.path.isdir(source) else os.path.getsize(source)
    print(f"input {source}: {size / 1e6:.1f} MB; one core each (RAYON_NUM_THREADS=1 for the "
          f"reference, OMP_NUM_THREADS=1 for shardtrain), best of {args.repeat}")
    for style in styles:
        tokenizer = args.tokenizer
        if tokenizer is None:
            tokenizer = os.path.join(scratch, f"{style}.json")
            subprocess.run([python, HELPER, "train", style, tokenizer], check=True)
        runs = [ours(exe, tokenizer, source, scratch) for _ in range(args.repeat)]
        size = runs[0][0]
        encode_s, wall_s = min(r[1] for r in runs), min(r[2] for r in runs)
        ref_runs = [reference(python, tokenizer, source) for _ in range(args.repeat)]
        if ref_runs[0][0] != size:
            sys.exit(f"tokenizer_bench: the two read different text ({size} and {ref_runs[0][0]} bytes)")
        ref_s = min(r[1] for r in ref_runs)
        mine, whole, theirs = size / encode_s / 1e6, size / wall_s / 1e6, size / ref_s / 1e6
        print(f"{style:10s} shardtrain {mine:6.1f} MB/s ({whole:.1f} MB/s whole command)   tokenizers {theirs:6.1f} "
              f"MB/s   ratio {mine / theirs:.1f}x ({whole / theirs:.1f}x whole command)")


if __name__ == "__main__":
    main()

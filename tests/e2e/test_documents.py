"""Packed documents (docs/data.md, "Packed documents"): with data.documents each position attends
only within its own document. The unit tests hold the attention and the models to each document
run alone; here the whole run: the option changes the losses, they do not depend on the rank
count, data.tokenizer supplies the start token, and bad settings exit 2 with one line."""
import json
import os
import re

from harness import rel_diff, read_metrics, run, run_single, tempdir, tiny_args
from test_chat_data import write_token_file
from test_tokenizer import trained


def losses(np_, *overrides):
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = run(np_, tiny_args(f"--train.metrics_file={metrics}", "--train.steps=4", *overrides), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r["loss"] for r in read_metrics(metrics)], [r["val_loss"] for r in read_metrics(metrics, "eval")], proc


def assert_eval_scores_as_the_run_trained(proc, val_loss):
    """`shardtrain eval` of the run's checkpoint prints its last validation loss: it reads the
    documents (and positions) as the run did."""
    checkpoints = re.search(r"saved (\S+)/ckpt-\d+\.h5", proc.stdout).group(1)
    scored = run(1, ["eval", "--checkpoint", checkpoints])
    assert scored.returncode == 0, scored.stderr[-2000:]
    loss = float(re.search(r"\| loss ([0-9.]+) \|", scored.stdout).group(1))
    assert abs(loss - val_loss) <= 1e-6, (loss, val_loss)


def test_documents_change_the_loss_and_not_with_the_rank_count():
    # The synthetic corpus is one story per line: documents start after each newline (byte 10).
    plain, _, _ = losses(1)
    one, val_one, proc = losses(1, "--data.documents=true", "--data.document_start=10")
    assert "each starting at token 10" in proc.stdout, proc.stdout
    assert all(rel_diff(a, b) > 1e-6 for a, b in zip(plain, one)), (plain, one)
    for np_ in (2, 3):
        other, val_other, _ = losses(np_, "--data.documents=true", "--data.document_start=10")
        assert all(rel_diff(a, b) <= 1e-5 for a, b in zip(one, other)), (np_, one, other)
        assert rel_diff(val_one[-1], val_other[-1]) <= 1e-5, (np_, val_one, val_other)
    # (Across documents the loss differs by a relative 4e-6 here, four steps from uniform.)
    assert_eval_scores_as_the_run_trained(proc, val_one[-1])


def test_restarted_positions_change_the_loss_and_not_with_the_rank_count():
    documents = ("--data.documents=true", "--data.document_start=10")
    counted, _, _ = losses(1, *documents)
    one, val_one, proc = losses(1, *documents, "--data.restart_positions=true")
    assert "positions restart with each" in proc.stdout, proc.stdout
    assert all(rel_diff(a, b) > 1e-6 for a, b in zip(counted, one)), (counted, one)
    other, val_other, _ = losses(2, *documents, "--data.restart_positions=true")
    assert all(rel_diff(a, b) <= 1e-5 for a, b in zip(one, other)), (one, other)
    assert_eval_scores_as_the_run_trained(proc, val_one[-1])


def test_the_tokenizer_gives_the_document_start():
    tokenizer = trained("chatml")
    source, data = os.path.join(tempdir(), "docs.jsonl"), os.path.join(tempdir(), "docs.bin")
    with open(source, "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"document {i}: the first line of it, then another one."}) + "\n")
    proc = run_single(["data", "encode", "--tokenizer", tokenizer, "--input", source, "--output", data,
                       "--val-fraction", "0"])
    assert proc.returncode == 0, proc.stderr
    separator = re.search(r"<\|endoftext\|> \(id (\d+)\) before each", proc.stdout).group(1)
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = run(2, tiny_args(f"--data.train_file={data}", "--data.val_file=", f"--data.tokenizer={tokenizer}",
                            "--model.vocab_size=1500", "--data.documents=true", "--train.steps=2",
                            f"--train.metrics_file={metrics}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"each starting at token {separator}" in proc.stdout, proc.stdout


def test_bad_document_settings_exit_2():
    data = os.path.join(tempdir(), "d.bin")
    write_token_file(data, [1] * 800)
    for extra, needle in (
            (["--data.documents=true"], "data.documents needs the token documents start with"),
            (["--data.documents=true", "--data.document_start=256"], "data.document_start=256 must be a token id"),
            (["--data.document_start=-2"], "data.document_start=-2"),
            (["--data.restart_positions=true"], "data.restart_positions counts positions within packed documents")):
        proc = run(2, tiny_args(f"--data.train_file={data}", "--data.val_file=", *extra))
        assert proc.returncode == 2, (extra, proc.stderr[-2000:])
        assert needle in proc.stderr and proc.stderr.count("error:") == 1, (extra, proc.stderr[-2000:])

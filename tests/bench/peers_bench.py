"""ShardTrain beside its peers on the CPU (`make bench-peers`): the same training step -- shape, batch,
AdamW, 1 rank x 2 threads -- in ShardTrain and in PyTorch (transformers' GPT2LMHeadModel and
LlamaForCausalLM, diffusers' FluxTransformer2DModel; eager and under torch.compile), rounds
interleaved, tokens/s min / median / max over every measured step of every round (each run's first
step, or under torch.compile its first two, dropped), and ShardTrain / peer of the medians.

  gpt2-124M   T = 64, batch 4 (micro-batch 4); T = 1024, batch 1
  llama-135M  T = 256, batch 4 (SmolLM-135M's shape); T = 1024, batch 1
  qwen2       llama-135M's shape with Qwen2's q/k/v biases, T = 256, batch 4
  FLUX        run_bench.py's FLUX_BENCH shape: 256 image + 64 text tokens, 4 samples per step as
              4 micro-batches of 1 (image tokens per second)

The peers run in <build>/encode-venv, the Python with torch, transformers and diffusers that
`make test-encode` uses (built the first time: several GB, minutes), or under ENCODE_PYTHON.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
sys.path.insert(0, os.path.join(ROOT, "tests", "tools"))

import run_bench  # noqa: E402  (its ShardTrain runs and FLUX shape)
from test_encode_images import environment  # noqa: E402  (the torch environment)

CASES = {  # name: (ShardTrain config, seq_len, micro_batch, accumulation, peer model, ShardTrain's extra options)
    "gpt2-124M, T = 64, batch 4": ("gpt2-124M.ini", 64, 4, 1, "gpt2", []),
    "gpt2-124M, T = 1024, batch 1": ("gpt2-124M.ini", 1024, 1, 1, "gpt2", []),
    "llama-135M, T = 256, batch 4": ("llama-135M.ini", 256, 4, 1, "llama", []),
    "llama-135M, T = 1024, batch 1": ("llama-135M.ini", 1024, 1, 1, "llama", []),
    "qwen2 at llama-135M's shape, T = 256, batch 4": ("llama-135M.ini", 256, 4, 1, "qwen2", ["--model.arch=qwen2"]),
    "FLUX-shaped C = 768, 4 x 256 image tokens": ("flux", 256, 1, 4, "flux", []),
}


def peer_rates(peer, model, compiled, steps, seq, micro_batch, accumulation):
    python, env = peer
    args = [python, os.path.join(HERE, "peer_worker.py"), "--model", model, "--steps", str(steps),
            "--warmup", "2" if compiled else "1", "--threads", "2", "--seq", str(seq),
            "--micro-batch", str(micro_batch), "--accumulation", str(accumulation)]
    if compiled:
        args.append("--compile")
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"peer {model} (compile={compiled}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["tokens_per_s"]


def shardtrain_rates(build, config, seq, micro_batch, accumulation, steps, latents, extra):
    if config == "flux":
        rows, _, _ = run_bench.flux_run(build, steps + 1, latents, micro_batch, micro_batch * accumulation)
        return [r["tokens_per_s"] for r in rows]
    rows, _, _ = run_bench.train_run(build, 1, 2, steps + 1, config=config, seq_len=seq, micro_batch=micro_batch,
                                     global_batch=micro_batch * accumulation, extra=extra)
    return [r["tokens_per_s"] for r in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default="build")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="measured steps per run")
    parser.add_argument("--only", default="", help="comma-separated peer models: gpt2, llama, qwen2, flux")
    parser.add_argument("--seq", type=int, default=0, help="only the cases of this sequence length")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers")
    args = parser.parse_args()
    build = os.path.abspath(os.path.join(ROOT, args.build))
    peer = environment(build)
    os.environ["SHARDTRAIN_BUILD"] = build
    if os.geteuid() == 0:
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    only = [m for m in args.only.split(",") if m]
    print(f"== ShardTrain beside its peers: 1 rank x 2 threads, AdamW, {args.rounds} rounds of {args.steps} "
          f"measured steps, interleaved", flush=True)
    print("case | runner | tokens/s min / median / max | ShardTrain / runner (medians)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        latents = run_bench.flux_latents(tmp)
        for case, (config, seq, micro_batch, accumulation, model, extra) in CASES.items():
            if (only and model not in only) or (args.seq and seq != args.seq):
                continue
            runners = {"ShardTrain": [], "PyTorch eager": []}
            if not args.no_compile:
                runners["torch.compile"] = []
            for _ in range(args.rounds):
                runners["ShardTrain"] += shardtrain_rates(build, config, seq, micro_batch, accumulation, args.steps,
                                                          latents, extra)
                runners["PyTorch eager"] += peer_rates(peer, model, False, args.steps, seq, micro_batch,
                                                       accumulation)
                if not args.no_compile:
                    runners["torch.compile"] += peer_rates(peer, model, True, args.steps, seq, micro_batch,
                                                           accumulation)
            ours = statistics.median(runners["ShardTrain"])
            for runner, rates in runners.items():
                median = statistics.median(rates)
                print(f"{case} | {runner} | {min(rates):.1f} / {median:.1f} / {max(rates):.1f} | "
                      f"{'' if runner == 'ShardTrain' else f'{ours / median:.2f}'}", flush=True)


if __name__ == "__main__":
    main()

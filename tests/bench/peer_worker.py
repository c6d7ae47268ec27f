"""One peer's training steps, run by peers_bench.py under a Python with torch, transformers and
diffusers: the same shape, batch, optimizer (AdamW, fused) and thread count as the ShardTrain run it
is set beside. Prints {"tokens_per_s": [...]} for the steps after the warm-up (compilation included
in the warm-up under torch.compile).

  gpt2   transformers' GPT2LMHeadModel of gpt2-124M's shape (SDPA attention), random tokens
  llama  LlamaForCausalLM of llama-135M's shape (SmolLM-135M: 30 x 576, 9 heads on 3 key/value
         heads, SwiGLU 1536, vocabulary 49152, tied head), SDPA
  qwen2  Qwen2ForCausalLM of the same shape (Qwen2's q/k/v biases), SDPA
  flux   diffusers' FluxTransformer2DModel of run_bench.py's FLUX_BENCH shape (C = 768, 2 double and
         4 single blocks, 256 image and 64 text tokens), flow-matching MSE against a random target;
         tokens are image tokens, as ShardTrain counts them
"""
import argparse
import json
import time

import torch


def causal_lm(model, batch, seq):
    """A transformers causal LM with SDPA attention, on random tokens: (model, loss, tokens per call)."""
    model.config._attn_implementation = "sdpa"
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    return model, lambda m: m(input_ids=tokens, labels=tokens).loss, batch * seq


def gpt2(batch, seq):
    from transformers import GPT2Config, GPT2LMHeadModel
    return causal_lm(GPT2LMHeadModel(GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                                                n_positions=1024)), batch, seq)


# llama-135M's shape (inputs/llama-135M.ini), for Llama and its variants.
SMOLLM_SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
                    rope_theta=10000.0, rms_norm_eps=1e-5)


def llama(batch, seq):
    from transformers import LlamaConfig, LlamaForCausalLM
    return causal_lm(LlamaForCausalLM(LlamaConfig(**SMOLLM_SHAPE)), batch, seq)


def qwen2(batch, seq):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return causal_lm(Qwen2ForCausalLM(Qwen2Config(**SMOLLM_SHAPE)), batch, seq)


def flux(batch, seq):
    from diffusers import FluxTransformer2DModel
    model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4,
                                   attention_head_dim=128, num_attention_heads=6, joint_attention_dim=768,
                                   pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    rows = cols = 16
    latents = torch.randn(batch, rows * cols, 64)
    text = torch.randn(batch, 64, 768)
    pooled = torch.randn(batch, 768)
    sigma = torch.rand(batch)
    target = torch.randn(batch, rows * cols, 64)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(rows).float(), torch.arange(cols).float(),
                                         indexing="ij"), -1).reshape(-1, 3)
    txt_ids = torch.zeros(64, 3)

    def loss(m):
        out = m(hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled, timestep=sigma,
                img_ids=img_ids, txt_ids=txt_ids, guidance=torch.full((batch,), 3.5), return_dict=False)[0]
        return torch.nn.functional.mse_loss(out, target)
    return model, loss, batch * rows * cols


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("gpt2", "llama", "qwen2", "flux"), required=True)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    peers = {"gpt2": gpt2, "llama": llama, "qwen2": qwen2, "flux": flux}
    model, loss_of, tokens = peers[args.model](args.micro_batch, args.seq)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_model = torch.compile(model) if args.compile else model
    rates = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for _ in range(args.accumulation):
            (loss_of(step_model) / args.accumulation).backward()
        optimizer.step()
        if step >= args.warmup:
            rates.append(tokens * args.accumulation / (time.perf_counter() - start))
    print(json.dumps({"tokens_per_s": rates}))


if __name__ == "__main__":
    main()

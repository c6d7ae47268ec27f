#!/usr/bin/env python3
"""Images and captions -> FLUX latent shards for `shardtrain train` (docs/flux.md, "Latent
datasets"), and sampled latents -> PNG files. Outside the C++ program, as tokenizer training is:
it needs PyTorch, diffusers and transformers (`make test-encode` builds such an environment; on a
cluster, any environment with them).

encode: every image of --images (png, jpg, jpeg, webp) with a caption beside it (same name, .txt)
is resized to cover --resolution (width x height, multiples of 16), center-cropped, and encoded:
  latents                the VAE's latent mean (or a sample, --sample), (z - shift_factor) *
                         scaling_factor as the VAE's config says (FLUX.1: 0.1159, 0.3611), packed
                         2 x 2 as diffusers' FluxPipeline packs them: (H/16 * W/16, 16 * 4), the
                         channel order (c, ph, pw);
  encoder_hidden_states  T5's last hidden state of the caption padded to --max-sequence-length
                         (FLUX.1-dev 512, schnell 256): text_encoder_2 with tokenizer_2;
  pooled_projections     CLIP's pooled output of the caption (77 tokens): text_encoder with tokenizer;
  condition_latents      with --condition-images DIR (Kontext): the image of the same name there,
                         encoded like the target at --condition-resolution (default: the same);
                         FLUX.2's reference images: DIR1,DIR2,... (and one resolution each, or
                         one for all), their tokens one after the other, condition_grid_rows and
                         condition_grid_cols then one per image.
--model is a FLUX.1 repository folder (vae/, text_encoder/, tokenizer/, text_encoder_2/,
tokenizer_2/), as diffusers' from_pretrained reads it. Records go to --output-dir in shards of
--shard-records: train-00000.h5, ... (and val-00000.h5 for --val-fraction of them).

A FLUX.2 repository (vae/ an AutoencoderKLFlux2; text_encoder/ FLUX.2-dev's Mistral 3 with Pixtral's
processor in tokenizer/, which needs torchvision, or FLUX.2 [klein]'s Qwen3 with its tokenizer) is
encoded as Flux2Pipeline and Flux2KleinPipeline do: the latents the VAE's mode packed 2 x 2 (4 x 32
channels) and normalised by the VAE's batch-norm statistics, (z - running_mean) / sqrt(running_var +
batch_norm_eps); encoder_hidden_states the text encoder's hidden states after layers 10, 20 and 30
(Klein: 9, 18, 27) side by side (3 x its width) for every token of the chat-formatted caption (dev:
the pipeline's system message and a user turn; Klein: a user turn, thinking off) padded to
--max-sequence-length; no pooled_projections.

prompts: each line of --prompts (a text file) -> its T5 embeddings and CLIP pooled vector, the
datasets encoder_hidden_states and pooled_projections of an HDF5 file, for `shardtrain sample`.

decode: latents (N, 64; FLUX.2 128) of a grid -- a file with datasets `latents` and attributes
grid_rows, grid_cols, as `encode` writes them -- unpacked, unscaled and decoded by the VAE into PNG files.
"""
import argparse
import json
import os
import sys

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def fail(message):
    sys.exit(f"encode_images: error: {message}")


def repository_kind(model):
    """"flux1" (AutoencoderKL, CLIP and T5), or a FLUX.2 repository's text encoder model_type:
    "mistral3" (FLUX.2-dev) or "qwen3" (FLUX.2 [klein]), from the folder's vae/ and text_encoder/
    configs."""
    def config(sub):
        path = os.path.join(model, sub, "config.json")
        if not os.path.exists(path):
            fail(f"--model {model!r} has no {sub}/config.json: give a FLUX.1 or FLUX.2 repository folder (as "
                 "from_pretrained reads it)")
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    if config("vae").get("_class_name") != "AutoencoderKLFlux2":
        return "flux1"
    model_type = config("text_encoder").get("model_type")
    if model_type not in FLUX2_TEXT_ENCODERS:
        fail(f"--model {model!r}: a FLUX.2 VAE with a text encoder of model_type {model_type!r}; FLUX.2's are "
             f"{', '.join(FLUX2_TEXT_ENCODERS)}")
    return model_type


# FLUX.2's text encoders: the hidden states their pipelines stack (Flux2Pipeline, Flux2KleinPipeline).
FLUX2_TEXT_ENCODERS = {"mistral3": (10, 20, 30), "qwen3": (9, 18, 27)}


def vae_latents(vae, pixels, sample, generator):
    """The VAE's latent mode (or a sample) of (1, 3, H, W) pixels in [-1, 1]."""
    dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
    return dist.sample(generator) if sample else dist.mode()


class Flux1Stack:
    """FLUX.1: AutoencoderKL latents shifted and scaled, T5's last hidden state, CLIP's pooled output."""

    def __init__(self, model, device, dtype, text=True):
        import torch
        from diffusers import AutoencoderKL
        for sub in ("vae",) + (("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2") if text else ()):
            if not os.path.isdir(os.path.join(model, sub)):
                fail(f"--model {model!r} has no {sub}/ folder: give a FLUX.1 repository folder (as from_pretrained "
                     "reads it)")
        self.vae = AutoencoderKL.from_pretrained(model, subfolder="vae", torch_dtype=dtype).to(device).eval()
        if text:
            from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
            self.clip = CLIPTextModel.from_pretrained(model, subfolder="text_encoder", torch_dtype=dtype).to(device)
            self.t5 = T5EncoderModel.from_pretrained(model, subfolder="text_encoder_2", torch_dtype=dtype).to(device)
            self.clip_tok = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer")
            self.t5_tok = T5TokenizerFast.from_pretrained(model, subfolder="tokenizer_2")
        torch.set_grad_enabled(False)

    def latents(self, pixels, sample, generator):
        """(1, 3, H, W) in [-1, 1] -> packed (H/16 * W/16, 64), rows, cols."""
        shift = getattr(self.vae.config, "shift_factor", None) or 0.0
        z = (vae_latents(self.vae, pixels, sample, generator) - shift) * self.vae.config.scaling_factor
        return pack(z)[0].float().cpu().numpy(), z.shape[2] // 2, z.shape[3] // 2

    def pixels(self, packed, rows, cols):
        z = unpack(packed.to(self.vae.device), rows, cols)
        shift = getattr(self.vae.config, "shift_factor", None) or 0.0
        return self.vae.decode((z / self.vae.config.scaling_factor + shift).to(self.vae.dtype)).sample

    def text(self, captions, max_length):
        """T5's embeddings (B, max_length, 4096) and CLIP's pooled vectors (B, 768)."""
        ids = self.clip_tok(captions, padding="max_length", max_length=self.clip_tok.model_max_length,
                            truncation=True, return_tensors="pt").input_ids.to(self.clip.device)
        pooled = self.clip(ids, output_hidden_states=False).pooler_output
        ids = self.t5_tok(captions, padding="max_length", max_length=max_length, truncation=True,
                          return_tensors="pt").input_ids.to(self.t5.device)
        embeds = self.t5(ids, output_hidden_states=False)[0]
        return embeds.float().cpu().numpy(), pooled.float().cpu().numpy()


class Flux2Stack:
    """FLUX.2: AutoencoderKLFlux2's latent mode packed 2 x 2 and normalised by the VAE's batch-norm
    statistics, (z - running_mean) / sqrt(running_var + batch_norm_eps) per packed channel; the text
    encoder's hidden states after the layers its pipeline names, stacked along the features (3 x
    hidden) for every token of the chat-formatted caption padded to max_length; no pooled vector."""

    def __init__(self, model, device, dtype, text_encoder, text=True):
        import torch
        from diffusers import AutoencoderKLFlux2
        self.vae = AutoencoderKLFlux2.from_pretrained(model, subfolder="vae", torch_dtype=dtype).to(device).eval()
        bn = self.vae.bn
        self.mean = bn.running_mean.float().cpu()
        self.std = torch.sqrt(bn.running_var.float().cpu() + self.vae.config.batch_norm_eps)
        self.mistral = text_encoder == "mistral3"  # FLUX.2-dev's; else FLUX.2 [klein]'s Qwen3
        if text:
            from transformers import AutoProcessor, AutoTokenizer, Mistral3ForConditionalGeneration, Qwen3ForCausalLM
            for sub in ("text_encoder", "tokenizer"):
                if not os.path.isdir(os.path.join(model, sub)):
                    fail(f"--model {model!r} has no {sub}/ folder: give a FLUX.2 repository folder")
            if self.mistral:
                self.encoder = Mistral3ForConditionalGeneration.from_pretrained(model, subfolder="text_encoder",
                                                                                 torch_dtype=dtype).to(device).eval()
                self.tokenizer = AutoProcessor.from_pretrained(model, subfolder="tokenizer")
                from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
                self.system = SYSTEM_MESSAGE
            else:
                self.encoder = Qwen3ForCausalLM.from_pretrained(model, subfolder="text_encoder",
                                                                torch_dtype=dtype).to(device).eval()
                self.tokenizer = AutoTokenizer.from_pretrained(model, subfolder="tokenizer")
            self.layers = FLUX2_TEXT_ENCODERS[text_encoder]
        torch.set_grad_enabled(False)

    def latents(self, pixels, sample, generator):
        """(1, 3, H, W) in [-1, 1] -> packed (H/16 * W/16, 4 latent channels), rows, cols."""
        z = vae_latents(self.vae, pixels, sample, generator)
        packed = (pack(z)[0].float().cpu() - self.mean) / self.std
        return packed.numpy(), z.shape[2] // 2, z.shape[3] // 2

    def pixels(self, packed, rows, cols):
        z = unpack(packed.float() * self.std + self.mean, rows, cols).to(self.vae.device, self.vae.dtype)
        return self.vae.decode(z).sample

    def text(self, captions, max_length):
        import torch
        if self.mistral:  # a system and a user turn, [IMG] markers removed (Flux2Pipeline's format_input)
            chats = [[{"role": "system", "content": [{"type": "text", "text": self.system}]},
                      {"role": "user", "content": [{"type": "text", "text": c.replace("[IMG]", "")}]}]
                     for c in captions]
            inputs = self.tokenizer.apply_chat_template(chats, add_generation_prompt=False, tokenize=True,
                                                        return_dict=True, return_tensors="pt", padding="max_length",
                                                        truncation=True, max_length=max_length)
        else:  # a user turn, the assistant's turn opened, thinking off (Flux2KleinPipeline)
            texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                        add_generation_prompt=True, enable_thinking=False)
                     for c in captions]
            inputs = self.tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True,
                                    max_length=max_length)
        out = self.encoder(input_ids=inputs["input_ids"].to(self.encoder.device),
                           attention_mask=inputs["attention_mask"].to(self.encoder.device), output_hidden_states=True,
                           use_cache=False)
        if max(self.layers) >= len(out.hidden_states):
            fail(f"the text encoder has {len(out.hidden_states) - 1} layers; FLUX.2 stacks the hidden states after "
                 f"layers {self.layers}")
        stacked = torch.cat([out.hidden_states[k] for k in self.layers], dim=-1)  # (B, L, 3 hidden)
        return stacked.float().cpu().numpy(), None


def load_stack(model, device, dtype, text=True):
    kind = repository_kind(model)
    return Flux1Stack(model, device, dtype, text) if kind == "flux1" else Flux2Stack(model, device, dtype, kind, text)


def pack(latents):
    """(B, C, H, W) -> (B, H/2 * W/2, C * 4), diffusers' FluxPipeline._pack_latents."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(packed, rows, cols):
    """(B, rows * cols, C * 4) -> (B, C, 2 rows, 2 cols): pack's inverse."""
    b, n, c4 = packed.shape
    latents = packed.view(b, rows, cols, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, c4 // 4, rows * 2, cols * 2)


def image_tensor(path, width, height):
    """The image resized to cover width x height, center-cropped, as (1, 3, H, W) in [-1, 1]."""
    import torch
    from PIL import Image
    with Image.open(path) as img:
        img = img.convert("RGB")
        scale = max(width / img.width, height / img.height)
        size = (max(width, round(img.width * scale)), max(height, round(img.height * scale)))
        img = img.resize(size, Image.BICUBIC)
        left, top = (img.width - width) // 2, (img.height - height) // 2
        img = img.crop((left, top, left + width, top + height))
        pixels = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(pixels).permute(2, 0, 1)[None]


def parse_resolution(text, option):
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        fail(f"{option}={text!r} is not WIDTHxHEIGHT")
    if w < 16 or h < 16 or w % 16 or h % 16:
        fail(f"{option}={text!r}: width and height must be multiples of 16 (8 for the VAE, 2 for the packing)")
    return w, h


def write_shard(path, records, rows, cols, condition_grids):
    import h5py
    with h5py.File(path + ".tmp", "w") as f:
        f["latents"] = np.stack([r["latents"] for r in records]).astype(np.float32)
        f["encoder_hidden_states"] = np.stack([r["text"] for r in records]).astype(np.float32)
        if records[0]["pooled"] is not None:  # FLUX.2 has none
            f["pooled_projections"] = np.stack([r["pooled"] for r in records]).astype(np.float32)
        f.attrs["grid_rows"], f.attrs["grid_cols"] = np.int64(rows), np.int64(cols)
        if condition_grids:
            f["condition_latents"] = np.stack([r["condition"] for r in records]).astype(np.float32)
            rows_, cols_ = (np.array([g[k] for g in condition_grids], np.int64) for k in (0, 1))
            # One image: scalars, as FLUX.1 Kontext's files have them; several: one per image.
            f.attrs["condition_grid_rows"] = rows_[0] if len(rows_) == 1 else rows_
            f.attrs["condition_grid_cols"] = cols_[0] if len(cols_) == 1 else cols_
        f.attrs["captions"] = json.dumps([r["caption"] for r in records])
    os.replace(path + ".tmp", path)


def encode(args):
    import torch
    width, height = parse_resolution(args.resolution, "--resolution")
    folders = [d for d in args.condition_images.split(",") if d]
    sizes = [parse_resolution(r, "--condition-resolution")
             for r in (args.condition_resolution or args.resolution).split(",")]
    if len(sizes) not in (1, len(folders) or 1):
        fail(f"--condition-resolution={args.condition_resolution!r}: give one WIDTHxHEIGHT, or one per "
             f"--condition-images folder ({len(folders)})")
    sizes = sizes * len(folders) if len(sizes) == 1 else sizes
    names = sorted(n for n in os.listdir(args.images) if n.lower().endswith(IMAGE_SUFFIXES))
    if not names:
        fail(f"--images {args.images!r} holds no image ({', '.join(IMAGE_SUFFIXES)})")
    items = []
    for name in names:
        caption_path = os.path.join(args.images, os.path.splitext(name)[0] + ".txt")
        if not os.path.exists(caption_path):
            fail(f"{os.path.join(args.images, name)!r} has no caption file {caption_path!r}")
        with open(caption_path, encoding="utf-8") as f:
            items.append((name, f.read().strip()))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    stack = load_stack(args.model, args.device, dtype)
    if len(folders) > 1 and isinstance(stack, Flux1Stack):
        fail(f"--condition-images names {len(folders)} folders: several reference images are FLUX.2's; FLUX.1 "
             "Kontext edits one")
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    records, grid, condition_grids = [], None, []
    for start in range(0, len(items), args.batch):
        chunk = items[start:start + args.batch]
        text, pooled = stack.text([c for _, c in chunk], args.max_sequence_length)
        for k, (name, caption) in enumerate(chunk):
            latents, rows, cols = stack.latents(image_tensor(os.path.join(args.images, name), width, height),
                                                args.sample, generator)
            grid = (rows, cols)
            record = {"latents": latents, "text": text[k], "pooled": None if pooled is None else pooled[k],
                      "caption": caption}
            parts, condition_grids = [], []
            for folder, (cond_w, cond_h) in zip(folders, sizes):
                path = os.path.join(folder, name)
                if not os.path.exists(path):
                    fail(f"--condition-images: no {path!r} for {name!r}")
                latents_c, c_rows, c_cols = stack.latents(image_tensor(path, cond_w, cond_h), args.sample, generator)
                parts.append(latents_c)
                condition_grids.append((c_rows, c_cols))
            if parts:
                record["condition"] = np.concatenate(parts)
            records.append(record)
        print(f"encoded {len(records)}/{len(items)} images", file=sys.stderr)
    os.makedirs(args.output_dir, exist_ok=True)
    val = int(round(len(records) * args.val_fraction))
    splits = (("train", records[val:]), ("val", records[:val]))
    for split, chosen in splits:
        for s, first in enumerate(range(0, len(chosen), args.shard_records)):
            path = os.path.join(args.output_dir, f"{split}-{s:05d}.h5")
            write_shard(path, chosen[first:first + args.shard_records], grid[0], grid[1], condition_grids)
            print(f"wrote {path}: {len(chosen[first:first + args.shard_records])} records", file=sys.stderr)
    n = grid[0] * grid[1]
    print(f"FLUX settings: train.seq_len={n} model.max_seq_len>={n} model.in_channels={records[0]['latents'].shape[1]} "
          f"model.context_len={records[0]['text'].shape[0]} model.context_dim={records[0]['text'].shape[1]} "
          f"model.pooled_dim={0 if records[0]['pooled'] is None else records[0]['pooled'].shape[0]}"
          + (f" model.condition_len={sum(r * c for r, c in condition_grids)}" if condition_grids else ""))


def prompts(args):
    import h5py
    import torch
    with open(args.prompts, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    if not lines:
        fail(f"--prompts {args.prompts!r} holds no prompt (one per line)")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    text, pooled = load_stack(args.model, args.device, dtype).text(lines, args.max_sequence_length)
    with h5py.File(args.output + ".tmp", "w") as f:
        f["encoder_hidden_states"] = text.astype(np.float32)
        if pooled is not None:
            f["pooled_projections"] = pooled.astype(np.float32)
        f.attrs["prompts"] = json.dumps(lines)
    os.replace(args.output + ".tmp", args.output)
    print(f"wrote {args.output}: {len(lines)} prompts of {text.shape[1]} tokens", file=sys.stderr)


def decode(args):
    import h5py
    import torch
    from PIL import Image
    with h5py.File(args.latents, "r") as f:
        if "latents" not in f or "grid_rows" not in f.attrs or "grid_cols" not in f.attrs:
            fail(f"{args.latents!r}: needs a dataset 'latents' and attributes grid_rows, grid_cols")
        packed = f["latents"][()]
        rows, cols = int(f.attrs["grid_rows"]), int(f.attrs["grid_cols"])
    stack = load_stack(args.model, args.device, torch.float32, text=False)
    os.makedirs(args.output_dir, exist_ok=True)
    for i in range(packed.shape[0]):
        pixels = stack.pixels(torch.from_numpy(packed[i:i + 1]), rows, cols)[0].float().clamp(-1, 1)
        image = ((pixels.permute(1, 2, 0).cpu().numpy() + 1) * 127.5).round().astype(np.uint8)
        path = os.path.join(args.output_dir, f"{i:05d}.png")
        Image.fromarray(image).save(path)
        print(f"wrote {path}", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("encode", help="images and captions -> latent shards")
    e.add_argument("--model", required=True, help="a FLUX.1 or FLUX.2 repository folder (vae/, text_encoder*/, tokenizer*/)")
    e.add_argument("--images", required=True, help="a folder of images, each with a caption file NAME.txt")
    e.add_argument("--output-dir", required=True)
    e.add_argument("--resolution", default="1024x1024", help="WIDTHxHEIGHT, multiples of 16")
    e.add_argument("--condition-images", default="",
                   help="Kontext: a folder of condition images of the same names; FLUX.2: DIR1,DIR2,... of its "
                        "reference images")
    e.add_argument("--condition-resolution", default="",
                   help="WIDTHxHEIGHT of the condition images, or one per folder (default: --resolution)")
    e.add_argument("--max-sequence-length", type=int, default=512, help="text tokens (FLUX.1-dev 512, schnell 256; FLUX.2 512)")
    e.add_argument("--shard-records", type=int, default=1000)
    e.add_argument("--val-fraction", type=float, default=0.0)
    e.add_argument("--batch", type=int, default=8, help="captions encoded together")
    e.add_argument("--sample", action="store_true", help="sample the VAE's latent distribution instead of its mean")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--device", default="cpu")
    e.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p = sub.add_parser("prompts", help="prompts (one per line) -> text embeddings for shardtrain sample")
    p.add_argument("--model", required=True, help="a FLUX.1 or FLUX.2 repository folder (text_encoder*/, tokenizer*/)")
    p.add_argument("--prompts", required=True, help="a text file, one prompt per line")
    p.add_argument("--output", required=True, help="the HDF5 file to write")
    p.add_argument("--max-sequence-length", type=int, default=512, help="text tokens (FLUX.1-dev 512, schnell 256; FLUX.2 512)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    d = sub.add_parser("decode", help="packed latents -> PNG files")
    d.add_argument("--model", required=True, help="a FLUX.1 or FLUX.2 repository folder (its vae/)")
    d.add_argument("--latents", required=True, help="an HDF5 file with 'latents' (N, C*4) and grid_rows, grid_cols")
    d.add_argument("--output-dir", required=True)
    d.add_argument("--device", default="cpu")
    args = parser.parse_args()
    {"encode": encode, "prompts": prompts, "decode": decode}[args.command](args)


if __name__ == "__main__":
    main()

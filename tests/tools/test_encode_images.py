#!/usr/bin/env python3
"""`make test-encode`: tools/encode_images.py against diffusers and transformers themselves, on a
tiny random FLUX.1-style repository made here (no download): an AutoencoderKL of 16 latent
channels with FLUX's scaling and shift factors, a CLIP text encoder and tokenizer, a T5 encoder and
tokenizer. Checked: the shards' layout; a record's latents equal the VAE's mean of that image,
shifted, scaled and packed as FluxPipeline packs them; its text embeddings and pooled vector equal
the encoders' own; Kontext's condition latents; decode gives back the images' size; and
`shardtrain train` trains two steps on the shards. Then the same for tiny FLUX.2-dev and FLUX.2
[klein] repositories (AutoencoderKLFlux2, Mistral 3 with Pixtral's processor, Qwen3), held to
Flux2Pipeline's and Flux2KleinPipeline's own functions, FLUX.2-dev with two reference images per
record; shardtrain trains, samples and decodes on them. Not part of `make test`: it needs PyTorch,
diffusers and transformers, which this target installs into <build>/encode-venv (several GB,
minutes; shared/notes' recipe for these CPU machines) unless ENCODE_PYTHON names a python that
has them."""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCH_PACKAGES = ["torch==2.15.0", "numpy", "nvidia-cusparselt-cu13==0.8.1", "nvidia-nvshmem-cu13==3.7.2",
                  "cuda-toolkit[cufile]==13.2.2", "nvidia-cufile", "nvidia-nccl-cu13==2.30.7"]
# FLUX.2-dev's tokenizer is Pixtral's processor, which needs torchvision (the release beside torch 2.15).
NO_DEPS_PACKAGES = ["torchvision==0.29.2"]
OTHER_PACKAGES = ["typing_extensions", "sympy", "networkx", "jinja2", "fsspec", "filelock", "diffusers",
                  "transformers", "safetensors", "tokenizers", "pillow", "h5py"]


def environment(build):
    """A python with torch, diffusers and transformers, and the environment it needs."""
    python = os.environ.get("ENCODE_PYTHON")
    venv = os.path.join(build, "encode-venv")
    if not python:
        python = os.path.join(venv, "bin", "python")
        if not os.path.exists(os.path.join(venv, ".ready")):
            subprocess.run([sys.executable, "-m", "venv", venv], check=True)
            subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", *TORCH_PACKAGES, *NO_DEPS_PACKAGES],
                           check=True)
            subprocess.run([python, "-m", "pip", "install", "-q", *OTHER_PACKAGES], check=True)
            open(os.path.join(venv, ".ready"), "w").close()
    # A venv made before FLUX.2's check: torchvision added to it once.
    if subprocess.run([python, "-c", "import torchvision"], capture_output=True).returncode != 0:
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", *NO_DEPS_PACKAGES], check=True)
    env = dict(os.environ)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    nvidia = os.path.join(site, "nvidia")
    libs = [os.path.join(nvidia, d) for d in ("nccl/lib", "cusparselt/lib", "cu13/lib", "nvshmem/lib")]
    env["LD_LIBRARY_PATH"] = ":".join(libs + ["/usr/local/cuda/lib64", env.get("LD_LIBRARY_PATH", "")])
    return python, env


MAKE_REPOSITORY = r'''
import json, os, sys
import numpy as np, torch
from diffusers import AutoencoderKL
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers
from PIL import Image
top = sys.argv[1]
torch.manual_seed(0)
AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
              norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
              scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False
              ).save_pretrained(os.path.join(top, "vae"))
words = ["a", "red", "blue", "green", "circle", "square", "on", "the", "left", "right", "small", "big"]
# CLIP's BPE: a word-level vocabulary (every word ends in </w>) and no merges beyond the letters'.
vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
for ch in "abcdefghijklmnopqrstuvwxyz":
    vocab.setdefault(ch, len(vocab)); vocab.setdefault(ch + "</w>", len(vocab))
merges = []
for w in words:
    parts = list(w[:-1]) + [w[-1] + "</w>"]
    while len(parts) > 1:
        merged = parts[0] + parts[1]
        merges.append(parts[0] + " " + parts[1]); vocab.setdefault(merged, len(vocab)); parts = [merged] + parts[2:]
tok_dir = os.path.join(top, "tokenizer"); os.makedirs(tok_dir)
json.dump(vocab, open(os.path.join(tok_dir, "vocab.json"), "w"))
open(os.path.join(tok_dir, "merges.txt"), "w").write("#version: 0.2\n" + "\n".join(dict.fromkeys(merges)) + "\n")
clip_tok = CLIPTokenizer(os.path.join(tok_dir, "vocab.json"), os.path.join(tok_dir, "merges.txt"), model_max_length=77)
clip_tok.save_pretrained(tok_dir)
CLIPTextModel(CLIPTextConfig(vocab_size=len(vocab), hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                             num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                             pad_token_id=1)).save_pretrained(os.path.join(top, "text_encoder"))
# T5's SentencePiece Unigram: the words with the word-start mark, and the letters.
pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("▁" + w, -1.0) for w in words] + \
         [(ch, -5.0) for ch in "abcdefghijklmnopqrstuvwxyz▁"]
t5_vocab = dict((p, i) for i, (p, _) in enumerate(pieces))
t = Tokenizer(models.Unigram(pieces, unk_id=2)); t.pre_tokenizer = pre_tokenizers.Metaspace()
from tokenizers import processors
t.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
t5_dir = os.path.join(top, "tokenizer_2"); os.makedirs(t5_dir); t.save(os.path.join(t5_dir, "tokenizer.json"))
T5TokenizerFast(tokenizer_file=os.path.join(t5_dir, "tokenizer.json"), eos_token="</s>", pad_token="<pad>",
                unk_token="<unk>", extra_ids=0).save_pretrained(t5_dir)
T5EncoderModel(T5Config(vocab_size=len(t5_vocab), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                        decoder_start_token_id=0)).save_pretrained(os.path.join(top, "text_encoder_2"))
rng = np.random.default_rng(1)
for folder in ("images", "conditions"):
    os.makedirs(os.path.join(top, folder))
captions = ["a red circle on the left", "a big blue square", "a small green circle on the right"]
for i, caption in enumerate(captions):
    for folder, size in (("images", (64, 48)), ("conditions", (32, 32))):
        Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)).save(
            os.path.join(top, folder, f"img{i}.png"))
    open(os.path.join(top, "images", f"img{i}.txt"), "w").write(caption)
'''

# A tiny random FLUX.2 repository (sys.argv[2]: "flux2", FLUX.2-dev's Mistral 3 text encoder with
# Pixtral's processor, or "flux2-klein", Qwen3's): an AutoencoderKLFlux2 of 8 latent channels with
# random batch-norm statistics, a word-level tokenizer with a chat template, a text encoder deep
# enough for the hidden states its pipeline stacks (after layers 10, 20, 30; Klein's 9, 18, 27).
MAKE_FLUX2_REPOSITORY = r'''
import json, os, sys
import numpy as np, torch
from diffusers import AutoencoderKLFlux2
from transformers import PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers
top, kind = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
vae = AutoencoderKLFlux2(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
                         layers_per_block=1, norm_num_groups=4, mid_block_add_attention=False)
vae.bn.running_mean.copy_(0.3 * torch.randn(32)); vae.bn.running_var.copy_(0.5 + torch.rand(32))
vae.save_pretrained(os.path.join(top, "vae"))
words = ["a", "red", "blue", "green", "circle", "square", "on", "the", "left", "right", "small", "big", "You", "are",
         "an", "AI", "that", "reasons", "about", "image", "descriptions"]
if kind == "flux2":
    from transformers import (Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralImageProcessor,
                              PixtralProcessor, PixtralVisionConfig)
    specials = ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                "[IMG_BREAK]", "[IMG_END]"]
    template = ("{{ bos_token }}{%- for m in messages %}{%- if m.role == 'system' %}[SYSTEM_PROMPT]{{ m.content[0].text }}"
                "[/SYSTEM_PROMPT]{%- elif m.role == 'user' %}[INST]{{ m.content[0].text }}[/INST]{%- endif %}{%- endfor %}")
else:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    template = ("{%- for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{%- endfor %}"
                "{%- if add_generation_prompt %}<|im_start|>assistant{%- if enable_thinking is defined and "
                "enable_thinking is false %} <think> </think>{%- endif %}{%- endif %}")
    words += ["user", "assistant"]
vocab = {t: i for i, t in enumerate(["<unk>"] + specials + words)}
t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>")); t.pre_tokenizer = pre_tokenizers.Whitespace()
tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token=specials[0], unk_token="<unk>",
                              eos_token=specials[2], bos_token=specials[1])
tok.add_special_tokens({"additional_special_tokens": specials[3:]})
if kind == "flux2":
    PixtralProcessor(image_processor=PixtralImageProcessor(), tokenizer=tok, chat_template=template, patch_size=16,
                     image_token="[IMG]", image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]"
                     ).save_pretrained(os.path.join(top, "tokenizer"))
    text = MistralConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=30,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=32, patch_size=16, head_dim=8)
    Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision,
                                                    image_token_index=vocab["[IMG]"], spatial_merge_size=1)
                                     ).save_pretrained(os.path.join(top, "text_encoder"))
else:
    tok.chat_template = template
    tok.save_pretrained(os.path.join(top, "tokenizer"))
    Qwen3ForCausalLM(Qwen3Config(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=27,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                                 tie_word_embeddings=True)).save_pretrained(os.path.join(top, "text_encoder"))
'''

# The FLUX.2 shards against Flux2Pipeline's (or Flux2KleinPipeline's) own code: _encode_vae_image
# (the VAE's latent mode, patchified, normalised by its batch-norm statistics) then _pack_latents,
# and the prompt embeddings of _get_mistral_3_small_prompt_embeds (_get_qwen3_prompt_embeds).
CHECK_FLUX2 = r'''
import json, os, sys, types
import h5py, numpy as np, torch
from diffusers import AutoencoderKLFlux2
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
sys.path.insert(0, sys.argv[4])
from encode_images import image_tensor
top, out, kind, pictures = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5]
references = [int(s) for s in sys.argv[6].split(",")]  # the condition images' sizes, one per reference image
torch.set_grad_enabled(False)
with h5py.File(os.path.join(out, "train-00000.h5"), "r") as f:
    captions = json.loads(f.attrs["captions"])
    latents, text, cond = f["latents"][()], f["encoder_hidden_states"][()], f["condition_latents"][()]
    assert "pooled_projections" not in f, "FLUX.2 has no pooled vector"
    assert (int(f.attrs["grid_rows"]), int(f.attrs["grid_cols"])) == (2, 2), dict(f.attrs)
    grids = [s // 16 for s in references]
    assert list(np.atleast_1d(f.attrs["condition_grid_rows"])) == grids, dict(f.attrs)
    assert list(np.atleast_1d(f.attrs["condition_grid_cols"])) == grids, dict(f.attrs)
    assert np.ndim(f.attrs["condition_grid_rows"]) == (len(grids) > 1)  # one image: scalars
tokens = sum(g * g for g in grids)
assert latents.shape == (2, 4, 32) and text.shape == (2, 16, 48) and cond.shape == (2, tokens, 32), (latents.shape,
                                                                                                    cond.shape)
vae = AutoencoderKLFlux2.from_pretrained(os.path.join(top, "vae"))
pipe = types.SimpleNamespace(vae=vae, _patchify_latents=Flux2Pipeline._patchify_latents)
for k, name in enumerate(["img1", "img2"]):  # img0 went to val
    def encoded(folder, size):
        image = image_tensor(os.path.join(pictures, folder, name + ".png"), size, size)
        return Flux2Pipeline._pack_latents(Flux2Pipeline._encode_vae_image(pipe, image, None))[0].numpy()
    # The reference images' tokens one after the other, as Flux2Pipeline.prepare_image_latents concatenates them.
    for got, want in ((latents[k], encoded("images", 32)),
                      (cond[k], np.concatenate([encoded("conditions", s) for s in references]))):
        assert np.allclose(got, want, atol=1e-5), (name, np.abs(got - want).max())
if kind == "flux2":
    from transformers import AutoProcessor, Mistral3ForConditionalGeneration
    encoder = Mistral3ForConditionalGeneration.from_pretrained(os.path.join(top, "text_encoder"))
    want = Flux2Pipeline._get_mistral_3_small_prompt_embeds(
        encoder, AutoProcessor.from_pretrained(os.path.join(top, "tokenizer")), captions, max_sequence_length=16)
else:
    from transformers import AutoTokenizer, Qwen3ForCausalLM
    encoder = Qwen3ForCausalLM.from_pretrained(os.path.join(top, "text_encoder"))
    want = Flux2KleinPipeline._get_qwen3_prompt_embeds(
        encoder, AutoTokenizer.from_pretrained(os.path.join(top, "tokenizer")), captions, max_sequence_length=16)
assert np.allclose(text, want.numpy(), atol=1e-5), np.abs(text - want.numpy()).max()
assert np.abs(text).max() > 0.1
print(f"{kind} shards match the pipeline's VAE latents and prompt embeddings")
'''


CHECK = r'''
import json, os, sys
import h5py, numpy as np, torch
from diffusers import AutoencoderKL
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
sys.path.insert(0, sys.argv[3])
from encode_images import image_tensor, pack
top, out = sys.argv[1], sys.argv[2]
torch.set_grad_enabled(False)
with h5py.File(os.path.join(out, "train-00000.h5"), "r") as f:
    captions = json.loads(f.attrs["captions"])
    latents, text, pooled = f["latents"][()], f["encoder_hidden_states"][()], f["pooled_projections"][()]
    cond = f["condition_latents"][()]
    assert (int(f.attrs["grid_rows"]), int(f.attrs["grid_cols"])) == (2, 2), dict(f.attrs)
    assert (int(f.attrs["condition_grid_rows"]), int(f.attrs["condition_grid_cols"])) == (1, 1), dict(f.attrs)
assert latents.shape == (2, 4, 64) and text.shape == (2, 16, 32) and pooled.shape == (2, 24) and cond.shape == (2, 1, 64)
vae = AutoencoderKL.from_pretrained(os.path.join(top, "vae"))
# Record k holds the k-th image after the validation split (img0 went to val).
names = ["img1", "img2"]
for k, name in enumerate(names):
    z = vae.encode(image_tensor(os.path.join(top, "images", name + ".png"), 32, 32)).latent_dist.mode()
    expected = pack((z - 0.1159) * 0.3611)[0].numpy()
    assert np.allclose(latents[k], expected, atol=1e-6), (name, np.abs(latents[k] - expected).max())
    # The packing is FluxPipeline's: token (r, c), channel (c, ph, pw).
    assert np.isclose(latents[k][1, 5 * 4 + 1 * 2 + 1], ((z - 0.1159) * 0.3611)[0, 5, 1, 3].item(), atol=1e-6)
    zc = vae.encode(image_tensor(os.path.join(top, "conditions", name + ".png"), 16, 16)).latent_dist.mode()
    assert np.allclose(cond[k], pack((zc - 0.1159) * 0.3611)[0].numpy(), atol=1e-6)
clip = CLIPTextModel.from_pretrained(os.path.join(top, "text_encoder"))
clip_tok = CLIPTokenizer.from_pretrained(os.path.join(top, "tokenizer"))
t5 = T5EncoderModel.from_pretrained(os.path.join(top, "text_encoder_2"))
t5_tok = T5TokenizerFast.from_pretrained(os.path.join(top, "tokenizer_2"))
for k, caption in enumerate(captions):
    ids = clip_tok([caption], padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    assert np.allclose(pooled[k], clip(ids).pooler_output[0].numpy(), atol=1e-5), caption
    ids = t5_tok([caption], padding="max_length", max_length=16, truncation=True, return_tensors="pt").input_ids
    assert np.allclose(text[k], t5(ids)[0][0].numpy(), atol=1e-5), caption
print("shards match diffusers and transformers")
'''


CHECK_PROMPTS = r'''
import json, os, sys
import h5py, numpy as np, torch
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
top = sys.argv[1]
torch.set_grad_enabled(False)
with h5py.File(os.path.join(top, "prompts.h5"), "r") as f:
    prompts, text, pooled = json.loads(f.attrs["prompts"]), f["encoder_hidden_states"][()], f["pooled_projections"][()]
assert prompts == ["a red circle", "a big blue square on the left"] and text.shape == (2, 16, 32), text.shape
clip = CLIPTextModel.from_pretrained(os.path.join(top, "text_encoder"))
ids = CLIPTokenizer.from_pretrained(os.path.join(top, "tokenizer"))(prompts, padding="max_length", max_length=77,
                                                                     truncation=True, return_tensors="pt").input_ids
assert np.allclose(pooled, clip(ids).pooler_output.numpy(), atol=1e-5)
t5 = T5EncoderModel.from_pretrained(os.path.join(top, "text_encoder_2"))
ids = T5TokenizerFast.from_pretrained(os.path.join(top, "tokenizer_2"))(prompts, padding="max_length", max_length=16,
                                                                         truncation=True, return_tensors="pt").input_ids
assert np.allclose(text, t5(ids)[0].numpy(), atol=1e-5)
print("prompts match the encoders")
'''


def run(cmd, env=None, cwd=None):
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def check_flux2(python, env, tool, exe, top, kind):
    """FLUX.2's encode against its pipeline, then training, prompts, sampling and decoding end to end."""
    repo = os.path.join(top, kind)
    os.makedirs(repo)
    run([python, "-c", MAKE_FLUX2_REPOSITORY, repo, kind], env)
    out = os.path.join(repo, "latents")
    # FLUX.2-dev with two reference images (1 x 1 and 2 x 2 tokens), Klein with one.
    sizes = [16, 32] if kind == "flux2" else [16]
    run([python, tool, "encode", "--model", repo, "--images", os.path.join(top, "images"), "--output-dir", out,
         "--resolution", "32x32", "--condition-images", ",".join([os.path.join(top, "conditions")] * len(sizes)),
         "--condition-resolution", ",".join(f"{s}x{s}" for s in sizes), "--max-sequence-length", "16",
         "--val-fraction", "0.34"], env)
    print(run([python, "-c", CHECK_FLUX2, repo, out, kind, os.path.join(ROOT, "tools"), top,
               ",".join(map(str, sizes))], env).stdout.strip())
    mpi = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    shape = ["--model.in_channels=32", "--model.context_dim=48", "--model.context_len=16", "--train.seq_len=4",
             "--train.global_batch=2", "--train.steps=2", "--train.eval_every=0"]
    condition_len = sum((s // 16) ** 2 for s in sizes)
    for name, extra in (("kontext", [f"--model.condition_len={condition_len}"]), ("t2i", [])):
        run(["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2", exe, "train", "--config",
             os.path.join(ROOT, "inputs", "flux2-tiny.ini"), f"--data.train_file={out}/train-*.h5",
             f"--data.val_file={out}/val-*.h5", *shape, *extra, f"--checkpoint.dir={repo}/{name}"], env=mpi)
    with open(os.path.join(repo, "prompts.txt"), "w") as f:
        f.write("a red circle\na big blue square on the left\n")
    prompts = os.path.join(repo, "prompts.h5")
    run([python, tool, "prompts", "--model", repo, "--prompts", os.path.join(repo, "prompts.txt"), "--output", prompts,
         "--max-sequence-length", "16"], env)
    run(["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2", exe, "sample", "--checkpoint", f"{repo}/t2i",
         "--prompts", prompts, "--output", os.path.join(repo, "samples.h5"), "--grid", "2x2", "--steps", "2"], env=mpi)
    pngs = os.path.join(repo, "samples")
    run([python, tool, "decode", "--model", repo, "--latents", os.path.join(repo, "samples.h5"), "--output-dir", pngs],
        env)
    decoded = run([python, "-c", "import sys; from PIL import Image; print([Image.open(p).size for p in sys.argv[1:]])",
                   *sorted(os.path.join(pngs, n) for n in os.listdir(pngs))], env).stdout.strip()
    assert decoded == "[(32, 32), (32, 32)]", decoded
    print(f"{kind}: shardtrain trains on the shards (with and without the {len(sizes)} reference image(s)), samples "
          "the prompts, and they decode to PNG files")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build")
    args = parser.parse_args()
    python, env = environment(os.path.abspath(args.build))
    tool = os.path.join(ROOT, "tools", "encode_images.py")
    top = tempfile.mkdtemp(prefix="shardtrain-encode-")
    try:
        run([python, "-c", MAKE_REPOSITORY, top], env)
        out = os.path.join(top, "latents")
        run([python, tool, "encode", "--model", top, "--images", os.path.join(top, "images"), "--output-dir", out,
             "--resolution", "32x32", "--condition-images", os.path.join(top, "conditions"),
             "--condition-resolution", "16x16", "--max-sequence-length", "16", "--val-fraction", "0.34"], env)
        assert sorted(os.listdir(out)) == ["train-00000.h5", "val-00000.h5"], os.listdir(out)
        print(run([python, "-c", CHECK, top, out, os.path.join(ROOT, "tools")], env).stdout.strip())
        pngs = os.path.join(top, "decoded")
        run([python, tool, "decode", "--model", top, "--latents", os.path.join(out, "train-00000.h5"),
             "--output-dir", pngs], env)
        sizes = run([python, "-c", "import sys; from PIL import Image; "
                     "print([Image.open(p).size for p in sys.argv[1:]])",
                     *sorted(os.path.join(pngs, n) for n in os.listdir(pngs))], env).stdout.strip()
        assert sizes == "[(32, 32), (32, 32)]", sizes
        print("decode writes the images' size")
        # ShardTrain trains on the shards (Kontext's shape: 4 target tokens, 1 condition token).
        exe = os.path.join(os.path.abspath(args.build), "shardtrain")
        run(["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2", exe, "train", "--config",
             os.path.join(ROOT, "inputs", "flux-tiny.ini"), f"--data.train_file={out}/train-*.h5",
             f"--data.val_file={out}/val-*.h5", "--model.in_channels=64", "--model.context_dim=32",
             "--model.context_len=16", "--model.pooled_dim=24", "--model.condition_len=1", "--train.seq_len=4",
             "--train.global_batch=2", "--train.steps=2", "--train.eval_every=0", f"--checkpoint.dir={top}/ck"],
            env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
        print("shardtrain trains on them")
        # Prompts for `shardtrain sample` on a text-to-image model trained on the same shards (their
        # condition latents unused), the samples decoded to PNG files.
        run(["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2", exe, "train", "--config",
             os.path.join(ROOT, "inputs", "flux-tiny.ini"), f"--data.train_file={out}/train-*.h5",
             f"--data.val_file={out}/val-*.h5", "--model.in_channels=64", "--model.context_dim=32",
             "--model.context_len=16", "--model.pooled_dim=24", "--train.seq_len=4", "--train.global_batch=2",
             "--train.steps=2", "--train.eval_every=0", f"--checkpoint.dir={top}/t2i"],
            env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
        with open(os.path.join(top, "prompts.txt"), "w") as f:
            f.write("a red circle\na big blue square on the left\n")
        run([python, tool, "prompts", "--model", top, "--prompts", os.path.join(top, "prompts.txt"), "--output",
             os.path.join(top, "prompts.h5"), "--max-sequence-length", "16"], env)
        print(run([python, "-c", CHECK_PROMPTS, top], env).stdout.strip())
        run(["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2", exe, "sample", "--checkpoint",
             f"{top}/t2i", "--prompts", os.path.join(top, "prompts.h5"), "--output", os.path.join(top, "samples.h5"),
             "--grid", "2x2", "--steps", "2"], env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
                                                       OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
        run([python, tool, "decode", "--model", top, "--latents", os.path.join(top, "samples.h5"), "--output-dir",
             os.path.join(top, "samples")], env)
        assert sorted(os.listdir(os.path.join(top, "samples"))) == ["00000.png", "00001.png"]
        print("sample's latents decode to PNG files")
        for kind in ("flux2", "flux2-klein"):
            check_flux2(python, env, tool, exe, top, kind)
        print("test-encode passed")
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`make test-encode`: tools/encode_images.py against diffusers and transformers themselves, on a
tiny random FLUX.1-style repository made here (no download): an AutoencoderKL of 16 latent
channels with FLUX's scaling and shift factors, a CLIP text encoder and tokenizer, a T5 encoder and
tokenizer. Checked: the shards' layout; a record's latents equal the VAE's mean of that image,
shifted, scaled and packed as FluxPipeline packs them; its text embeddings and pooled vector equal
the encoders' own; Kontext's condition latents; decode gives back the images' size; and
`shardtrain train` trains two steps on the shards. Not part of `make test`: it needs PyTorch,
diffusers and transformers, which this target installs into <build>/encode-venv (several GB,
minutes; shared/notes' recipe for these CPU machines) unless ENCODE_PYTHON names a python that
has them."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCH_PACKAGES = ["torch==2.15.0", "numpy", "nvidia-cusparselt-cu13==0.8.1", "nvidia-nvshmem-cu13==3.7.2",
                  "cuda-toolkit[cufile]==13.2.2", "nvidia-cufile", "nvidia-nccl-cu13==2.30.7"]
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
            subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", *TORCH_PACKAGES], check=True)
            subprocess.run([python, "-m", "pip", "install", "-q", *OTHER_PACKAGES], check=True)
            open(os.path.join(venv, ".ready"), "w").close()
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
        print("sample's latents decode to PNG files: test-encode passed")
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()

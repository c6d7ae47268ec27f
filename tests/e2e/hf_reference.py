"""Hugging Face's side of the interop tests, run by the test virtual environment's python (it has the
`safetensors` package): write GPT-2 folders as transformers lays them out, read safetensors files
back, and compute GPT-2's loss the way transformers' GPT2LMHeadModel does (Conv1D weights (in, out),
tanh GELU, LayerNorm eps 1e-5, tied head), in float64 numpy. Commands print JSON. gpt2_shapes needs
only numpy (the e2e tests, under Debian's python, import it); the commands import `safetensors`.

  hf_reference.py make FOLDER L C H V T DTYPE SEED PREFIX   random GPT-2 weights + config.json
  hf_reference.py loss FOLDER TOKENS...                     mean next-token cross-entropy
  hf_reference.py tensors FILE                              {name: [dtype, shape, sha256 of bytes]}, metadata
  hf_reference.py equal A B                                 whether every tensor is bit-identical (files or folders)
"""
import hashlib
import json
import os
import sys

import numpy as np


def gpt2_shapes(L, C, V, T):
    shapes = {"wte.weight": (V, C), "wpe.weight": (T, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for l in range(L):
        h = f"h.{l}."
        shapes.update({h + "ln_1.weight": (C,), h + "ln_1.bias": (C,), h + "attn.c_attn.weight": (C, 3 * C),
                       h + "attn.c_attn.bias": (3 * C,), h + "attn.c_proj.weight": (C, C),
                       h + "attn.c_proj.bias": (C,), h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
                       h + "mlp.c_fc.weight": (C, 4 * C), h + "mlp.c_fc.bias": (4 * C,),
                       h + "mlp.c_proj.weight": (4 * C, C), h + "mlp.c_proj.bias": (C,)})
    return shapes


def make(folder, L, C, H, V, T, dtype, seed, prefix):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in gpt2_shapes(L, C, V, T).items():
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            values = 0.05 * rng.standard_normal(shape)
        tensors[prefix + name] = values.astype(dtype)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": L, "n_embd": C, "n_head": H,
              "vocab_size": V, "n_positions": T, "n_ctx": T, "n_inner": None, "activation_function": "gelu_new",
              "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def load_folder(folder):
    """Every tensor of a model folder: model.safetensors, or the files its index names."""
    from safetensors.numpy import load_file
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(folder, "model.safetensors"))
    weight_map = json.load(open(index))["weight_map"]
    tensors = {}
    for file in sorted(set(weight_map.values())):
        part = load_file(os.path.join(folder, file))
        assert all(weight_map[name] == file for name in part), f"{file} holds tensors its index puts elsewhere"
        tensors.update(part)
    assert sorted(tensors) == sorted(weight_map), "the index and the files disagree"
    return tensors


def layer_norm(x, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * w + b


def gelu_new(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def loss(folder, tokens):
    config = json.load(open(os.path.join(folder, "config.json")))
    L, C, H = config["n_layer"], config["n_embd"], config["n_head"]
    raw = load_folder(folder)
    w = {k[len("transformer."):] if k.startswith("transformer.") else k: v.astype(np.float64) for k, v in raw.items()}
    inputs, targets = np.array(tokens[:-1]), np.array(tokens[1:])
    T, hd = len(inputs), C // H
    x = w["wte.weight"][inputs] + w["wpe.weight"][:T]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(L):
        p = f"h.{l}."
        h = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"])
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (qkv[:, i * C:(i + 1) * C].reshape(T, H, hd).transpose(1, 0, 2) for i in range(3))
        att = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(1, 0, 2).reshape(T, C)
        x = x + y @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"])
        x = x + gelu_new(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"]) @ w[p + "mlp.c_proj.weight"] \
            + w[p + "mlp.c_proj.bias"]
    x = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"])
    logits = x @ w["wte.weight"].T
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-log_probs[np.arange(T), targets].mean())


def tensors(path):
    from safetensors import safe_open
    out = {}
    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata()
        for name in f.keys():
            array = f.get_tensor(name)
            out[name] = [str(array.dtype), list(array.shape), hashlib.sha256(array.tobytes()).hexdigest()]
    return {"tensors": out, "metadata": metadata}


def equal(path_a, path_b):
    """Files or folders: the same tensors, bit for bit."""
    from safetensors.numpy import load_file
    a, b = ((load_folder(p) if os.path.isdir(p) else load_file(p)) for p in (path_a, path_b))
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "make":
        folder, L, C, H, V, T, dtype, seed, prefix = args
        make(folder, int(L), int(C), int(H), int(V), int(T), {"F32": np.float32, "F16": np.float16}[dtype], int(seed),
             "" if prefix == "-" else prefix)
        print(json.dumps({"ok": True}))
    elif command == "loss":
        print(json.dumps({"loss": loss(args[0], [int(t) for t in args[1:]])}))
    elif command == "tensors":
        print(json.dumps(tensors(args[0])))
    elif command == "equal":
        print(json.dumps({"equal": equal(args[0], args[1])}))
    else:
        sys.exit(f"unknown command {command}")

"""Hugging Face's side of the interop tests, run by the test virtual environment's python (it has the
`safetensors` package): write GPT-2 and Llama folders as transformers lays them out, read safetensors
files back, and compute the loss the way transformers computes it, in float64 numpy: GPT2LMHeadModel
(Conv1D weights (in, out), tanh GELU, LayerNorm eps 1e-5, tied head) and LlamaForCausalLM
(modeling_llama: RMSNorm, rotary embeddings with rotate_half, repeat_kv for grouped-query attention,
SwiGLU, final norm, tied or untied head), Qwen2ForCausalLM (modeling_qwen2: Llama's with biases on
q_proj, k_proj and v_proj), Qwen3ForCausalLM (modeling_qwen3: Llama's with an RMSNorm over each query
and key head before the rotary turn, heads of 128 unless head_dim says) and SmolLM3ForCausalLM
(modeling_smollm3: Llama's with no rotary turn in the blocks no_rope_layers marks 0). Commands print JSON. gpt2_shapes and llama_shapes need only
numpy (the e2e tests, under Debian's python, import them); the commands import `safetensors`.
numpy has no bfloat16: BF16 files are written and read here byte by byte (the package checks the
layout: every file written is opened with safe_open).

  hf_reference.py make FOLDER L C H V T DTYPE SEED PREFIX      random GPT-2 weights + config.json
  hf_reference.py make-llama FOLDER L C H KV I V T TIED DTYPE SEED PREFIX [EXTRAS]
                                                               random Llama weights + config.json (KV 0: the
                                                               key left out; PREFIX "-": none; EXTRAS, comma-
                                                               separated: lm_head (written although tied),
                                                               inv_freq (older files' rotary buffers), qwen2
                                                               (a Qwen2 model: q/k/v biases, rope_theta 1e6),
                                                               qwen3 (a Qwen3 model: q/k norms, rope_theta 1e6,
                                                               head_dim written), smollm3 (a SmolLM3 model: the
                                                               last block without rotary embeddings), phi3 (a
                                                               Phi-3 model: fused qkv_proj and gate_up_proj),
                                                               head_dim=N
  hf_reference.py loss FOLDER TOKENS...                        mean next-token cross-entropy (config.json's model_type)
  hf_reference.py caption-context FOLDER LAYERS LEN IN OUT     a text encoder's context for IN's captions
                                                               (LAYERS comma-separated, non-negative), into a copy
  hf_reference.py tensors FILE                                 {name: [dtype, shape, sha256 of bytes]}, metadata
  hf_reference.py equal A B                                    whether every tensor is bit-identical (files or folders)
  hf_reference.py rounded F32 OTHER                            whether OTHER's tensors are F32's rounded to nearest
                                                               even (F16 or BF16), names and shapes alike
"""
import hashlib
import json
import math
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


def llama_shapes(L, C, H, KV, I, V, tied, head_dim=None):
    """LlamaForCausalLM's tensors, as transformers names them ("model." prefix, lm_head.weight without);
    head_dim: a head size other than C // H."""
    d = head_dim or C // H
    KVD, A = KV * d, H * d
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    if not tied:
        shapes["lm_head.weight"] = (V, C)
    for l in range(L):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (C,), p + "self_attn.q_proj.weight": (A, C),
                       p + "self_attn.k_proj.weight": (KVD, C), p + "self_attn.v_proj.weight": (KVD, C),
                       p + "self_attn.o_proj.weight": (C, A), p + "post_attention_layernorm.weight": (C,),
                       p + "mlp.gate_proj.weight": (I, C), p + "mlp.up_proj.weight": (I, C),
                       p + "mlp.down_proj.weight": (C, I)})
    return shapes


def bf16_bits(values):
    """float32 -> bfloat16 bits, rounded to nearest even (finite values)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def save_tensors(tensors, path):
    """{name: float array} -> a safetensors file: F32/F16 arrays through the package, a file with
    bfloat16 (given as ("BF16", float32 values)) written here and opened with the package as a check."""
    from safetensors import safe_open
    from safetensors.numpy import save_file
    if not any(isinstance(v, tuple) for v in tensors.values()):
        save_file(tensors, path, metadata={"format": "pt"})
        return
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        value = tensors[name]
        if isinstance(value, tuple):
            dtype, shape, data = "BF16", list(value[1].shape), bf16_bits(value[1]).astype("<u2").tobytes()
        else:
            dtype = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}[value.dtype]
            shape, data = list(value.shape), value.astype(value.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(chunks))
    with safe_open(path, framework="numpy") as f:
        assert sorted(f.keys()) == sorted(tensors), "the package reads other tensors than were written"
        for name in f.keys():
            assert f.get_slice(name).get_shape() == header[name]["shape"], name


def read_tensors(path):
    """Every tensor of one file as numpy arrays: the package's load_file, or for a file holding
    BF16 (which numpy lacks) the raw bytes, widened to float32 exactly."""
    from safetensors import safe_open
    from safetensors.numpy import load_file
    with safe_open(path, framework="numpy") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    if "BF16" not in dtypes.values():
        return load_file(path)
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = (8 + n + o for o in info["data_offsets"])
        np_type = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}[info["dtype"]]
        array = np.frombuffer(raw[begin:end], dtype=np_type).reshape(info["shape"])
        out[name] = (array.astype(np.uint32) << 16).view(np.float32) if info["dtype"] == "BF16" else array
    return out


def make_llama(folder, L, C, H, KV, I, V, T, tied, dtype, seed, prefix, extras=()):
    """Random weights, scaled so attention is far from uniform (q and k large: the rotary angles
    matter) and every layer moves the residual stream. Extras are tensors real files may hold that
    are not parameters: a tied model's lm_head.weight, the inv_freq buffers of transformers < 4.31;
    "head_dim=N" gives the heads a size of their own (config.json's head_dim)."""
    rng = np.random.default_rng(seed)
    scale = {"embed_tokens": 0.4, "q_proj": 0.3, "k_proj": 0.3, "v_proj": 0.15, "o_proj": 0.15, "gate_proj": 0.15,
             "up_proj": 0.15, "down_proj": 0.1, "lm_head": 0.1}
    tensors = {}
    head_dim = next((int(e.split("=")[1]) for e in extras if e.startswith("head_dim=")), None)
    shapes = llama_shapes(L, C, H, KV or H, I, V, tied, head_dim)
    if "lm_head" in extras:
        shapes["lm_head.weight"] = (V, C)
    if "inv_freq" in extras:
        shapes.update({f"model.layers.{l}.self_attn.rotary_emb.inv_freq": ((head_dim or C // H) // 2,)
                       for l in range(L)})
    qwen2, qwen3 = "qwen2" in extras, "qwen3" in extras
    d = head_dim or C // H
    if qwen2:
        shapes.update({f"model.layers.{l}.self_attn.{n}_proj.bias": (H * d if n == "q" else (KV or H) * d,)
                       for l in range(L) for n in "qkv"})
    if qwen3:
        shapes.update({f"model.layers.{l}.self_attn.{n}_norm.weight": (d,) for l in range(L) for n in "qk"})
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("inv_freq"):
            d = head_dim or C // H
            values = 10000.0 ** -(np.arange(0, d, 2) / d)
        elif name.endswith(".bias"):
            values = 0.5 * rng.standard_normal(shape)
        else:
            values = scale[name.split(".")[-2]] * rng.standard_normal(shape)
        name = name[len("model."):] if name.startswith("model.") else name
        tensors[(prefix if name != "lm_head.weight" else "") + name] = values.astype(np.float32)
    if "phi3" in extras:  # Phi-3's files: q|k|v as one qkv_proj, gate|up as one gate_up_proj
        for l in range(L):
            at = f"{prefix}layers.{l}."
            tensors[at + "self_attn.qkv_proj.weight"] = np.concatenate(
                [tensors.pop(at + f"self_attn.{n}_proj.weight") for n in "qkv"])
            tensors[at + "mlp.gate_up_proj.weight"] = np.concatenate(
                [tensors.pop(at + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    tensors = {name: ("BF16", v) if dtype == "BF16" else v.astype({"F32": np.float32, "F16": np.float16}[dtype])
               for name, v in tensors.items()}
    os.makedirs(folder, exist_ok=True)
    save_tensors(tensors, os.path.join(folder, "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": C, "intermediate_size": I,
              "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV, "vocab_size": V,
              "max_position_embeddings": T, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": tied,
              "torch_dtype": {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype]}
    if not KV:
        del config["num_key_value_heads"]
    if head_dim:
        config["head_dim"] = head_dim
    if qwen2 or qwen3:  # Qwen2Config's keys: no attention_bias or mlp_bias (q/k/v always have biases)
        del config["attention_bias"], config["mlp_bias"]
        name = "qwen2" if qwen2 else "qwen3"
        config.update({"architectures": [name.capitalize() + "ForCausalLM"], "model_type": name,
                       "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": None,
                       "max_window_layers": L})
    if qwen3:  # Qwen3Config's: attention_bias, and head_dim always (its default is 128)
        config.update({"attention_bias": False, "head_dim": d})
    if "phi3" in extras:  # Phi3Config's keys: no attention_bias or mlp_bias; dropouts, a window (none)
        del config["attention_bias"], config["mlp_bias"]
        config.update({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "resid_pdrop": 0.0,
                       "embd_pdrop": 0.0, "attention_dropout": 0.0, "sliding_window": None,
                       "original_max_position_embeddings": T, "pad_token_id": None})  # its 32000 is past V
    if "smollm3" in extras:  # SmolLM3Config's: 1 where the block turns q and k
        config.update({"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "rope_theta": 5000000.0,
                       "no_rope_layers": [1] * (L - 1) + [0], "use_sliding_window": False, "sliding_window": None,
                       "pad_token_id": None})  # its default, 128004, is past this vocabulary
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


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
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_tensors(os.path.join(folder, "model.safetensors"))
    weight_map = json.load(open(index))["weight_map"]
    tensors = {}
    for file in sorted(set(weight_map.values())):
        part = read_tensors(os.path.join(folder, file))
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


# The positions whose most likely token (the first of equals, as numpy's and torch's argmax) is the
# target, of the last logits cross_entropy saw.
LAST_CORRECT = [0]


def cross_entropy(logits, targets):
    LAST_CORRECT[0] = int((logits.argmax(-1) == targets).sum())
    logits = logits - logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-log_probs[np.arange(len(targets)), targets].mean())


def rms_norm(x, w, eps):
    """LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight (fp32 there, float64 here)."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope_inverse_frequencies(d, theta, scaling=None):
    """LlamaRotaryEmbedding's inv_freq (modeling_rope_utils), each step in float32 as transformers
    computes it (the same bits, but where torch's pow is not correctly rounded): 1 / theta^(arange(0, d, 2) / d); rope_type linear divides it by factor; llama3
    (_compute_llama3_parameters) divides the frequencies whose wavelength exceeds
    original_max_position_embeddings / low_freq_factor by factor, keeps those below
    original_max_position_embeddings / high_freq_factor, and blends the ones between; yarn
    (_compute_yarn_parameters) ramps from the kept to the divided frequencies between the dimensions
    that turn beta_fast and beta_slow times over the original context."""
    f32 = np.float32
    exponents = np.arange(0, d, 2).astype(f32) / f32(d)
    # torch's pow of a float32 base: the correctly rounded power (numpy's float32 ** is off by one
    # unit in the last place for some exponents)
    powers = np.array([math.pow(float(f32(theta)), float(e)) for e in exponents]).astype(f32)
    inv_freq = f32(1.0) / powers
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / f32(scaling["factor"])
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = f32(old / low), f32(old / high)
        # torch divides a number by a tensor as the tensor's reciprocal times the number
        wavelen = (f32(1.0) / inv_freq) * f32(2 * np.pi)
        kept = np.where(wavelen > low_wavelen, inv_freq / f32(factor), inv_freq)
        smooth = ((f32(1.0) / wavelen) * f32(old) - f32(low)) / f32(high - low)
        smoothed = (f32(1.0) - smooth) * kept / f32(factor) + smooth * kept
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, kept).astype(f32)
    elif kind == "yarn":
        # _compute_yarn_parameters: the correction range in Python floats, the ramp and blend in float32
        factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def correction_dim(turns):
            return d * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))
        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        high = high + 0.001 if low == high else high
        ramp = np.clip((np.arange(d // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
        kept = f32(1) - ramp
        interpolated = f32(1.0) / (f32(factor) * powers)
        inv_freq = (interpolated * (f32(1) - kept) + inv_freq * kept).astype(f32)
    else:  # dynamic: LlamaRotaryEmbedding raises theta only for a sequence past max_position_embeddings
        assert kind in ("default", "dynamic"), scaling
    return inv_freq


def yarn_attention_factor(scaling):
    """_compute_yarn_parameters' attention_factor: given, or get_mscale's 0.1 ln(factor) + 1 (the
    ratio of two when mscale and mscale_all_dim are given)."""
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return get_mscale(factor, m) / get_mscale(factor, m_all) if m and m_all else get_mscale(factor)


def rotary_cos_sin(T, d, theta, scaling=None):
    """LlamaRotaryEmbedding: the angles position * inv_freq, computed in float32 as transformers
    does; emb = cat(freqs, freqs); cos and sin of it held in float32 (times yarn's attention factor)."""
    inv_freq = rope_inverse_frequencies(d, theta, scaling)
    freqs = np.arange(T, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], -1).astype(np.float64)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    m = np.float32(yarn_attention_factor(scaling) if kind == "yarn" else 1.0)
    return (np.cos(emb).astype(np.float32) * m).astype(np.float64), (np.sin(emb).astype(np.float32) * m).astype(np.float64)


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


def sliding_layers(config, use_rope):
    """The sliding window and which blocks slide, as the config classes decide: MistralConfig over
    every block (4096 when absent, null for none); Qwen2Config, Qwen3Config and SmolLM3Config only with
    use_sliding_window, over the blocks layer_types marks sliding_attention (without it: Qwen's from
    max_window_layers, 28 when absent, on; SmolLM3's NoPE blocks)."""
    L, kind = config["num_hidden_layers"], config["model_type"]
    if kind in ("mistral", "phi3"):  # Phi3Config: over every block, none by default
        window = config.get("sliding_window", 4096 if kind == "mistral" else None)
        return window, [bool(window)] * L
    if kind not in ("qwen2", "qwen3", "smollm3") or not config.get("use_sliding_window", False):
        return None, [False] * L
    window = config.get("sliding_window", 4096)
    if config.get("layer_types"):
        return window, [t == "sliding_attention" and bool(window) for t in config["layer_types"]]
    if kind == "smollm3":
        return window, [not r and bool(window) for r in use_rope]
    return window, [l >= config.get("max_window_layers", 28) and bool(window) for l in range(L)]


def llama_hidden_states(config, w, inputs):
    """LlamaModel's forward (modeling_llama), Qwen2Model's (q/k/v biases) or Qwen3Model's (q/k norms),
    over one sequence: its output_hidden_states -- the embeddings, each block's output, the last one
    through the final norm."""
    L, C, H = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    KV = config.get("num_key_value_heads") or H
    d = config.get("head_dim", 128 if config["model_type"] == "qwen3" else None) or C // H
    if config["model_type"] == "smollm3":  # SmolLM3Config: without the list, every no_rope_layer_interval-th block
        interval = config.get("no_rope_layer_interval", 4)
        use_rope = config.get("no_rope_layers") or [int((l + 1) % interval != 0) for l in range(L)]
    else:
        use_rope = [1] * L
    # transformers 5's rope_parameters, or rope_theta and (transformers 4) rope_scaling
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    default_theta = 2000000.0 if config["model_type"] == "smollm3" else 10000.0  # the config class's default_theta
    eps, theta = config.get("rms_norm_eps", 1e-6), (rope or {}).get("rope_theta", config.get("rope_theta", default_theta))
    T = len(inputs)
    cos, sin = rotary_cos_sin(T, d, theta, rope)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    window, sliding = sliding_layers(config, use_rope)
    # masking_utils' sliding_window_overlay: key j is seen by query i when j > i - window
    window_mask = mask + np.tril(np.full((T, T), -np.inf), -window) if window else mask
    x = w["embed_tokens.weight"][inputs]
    states = [x]
    for l in range(L):
        p = f"layers.{l}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        bias = {n: w.get(p + f"self_attn.{n}_proj.bias", 0.0) for n in "qkv"}
        q, k, v = ((h @ w[p + f"self_attn.{n}_proj.weight"].T + bias[n]).reshape(T, -1, d).transpose(1, 0, 2)
                   for n in "qkv")
        if p + "self_attn.q_norm.weight" in w:  # Qwen3: each head's q and k normed over its d
            q, k = (rms_norm(t, w[p + f"self_attn.{n}_norm.weight"], eps) for t, n in ((q, "q"), (k, "k")))
        if use_rope[l]:
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin  # apply_rotary_pos_emb
        k, v = np.repeat(k, H // KV, axis=0), np.repeat(v, H // KV, axis=0)  # repeat_kv: head j serves H/KV queries
        att = q @ k.transpose(0, 2, 1) / np.sqrt(d) + (window_mask if sliding[l] else mask)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + (att @ v).transpose(1, 0, 2).reshape(T, H * d) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        states.append(x)
    states[-1] = rms_norm(x, w["norm.weight"], eps)
    return states


def llama_weights(raw, config=None):
    """The tensors by LlamaModel's names, float64; Phi-3's fused qkv_proj and gate_up_proj split as
    Phi3Attention and Phi3MLP slice them (q, k, v rows; gate, then up)."""
    w = {k[len("model."):] if k.startswith("model.") else k: v.astype(np.float64) for k, v in raw.items()}
    if config and config["model_type"] == "phi3":
        H, C = config["num_attention_heads"], config["hidden_size"]
        d, KV = C // H, config.get("num_key_value_heads") or H
        for name in [n for n in w if n.endswith("qkv_proj.weight")]:
            qkv, at = w.pop(name), name[:-len("qkv_proj.weight")]
            w[at + "q_proj.weight"], w[at + "k_proj.weight"], w[at + "v_proj.weight"] = np.split(
                qkv, [H * d, H * d + KV * d])
        for name in [n for n in w if n.endswith("gate_up_proj.weight")]:
            at = name[:-len("gate_up_proj.weight")]
            w[at + "gate_proj.weight"], w[at + "up_proj.weight"] = np.split(w.pop(name), 2)
    return w


def llama_loss(config, raw, tokens):
    """LlamaForCausalLM's forward and its shifted cross-entropy."""
    w = llama_weights(raw, config)
    inputs, targets = np.array(tokens[:-1]), np.array(tokens[1:])
    x = llama_hidden_states(config, w, inputs)[-1]
    # Tied: the head is the embedding (tie_weights), whatever lm_head.weight a file may hold.
    head = w["embed_tokens.weight"] if config.get("tie_word_embeddings", False) else w["lm_head.weight"]
    return cross_entropy(x @ head.T, targets)


def caption_context(folder, layers, length, source, out):
    """A text encoder's (Llama, Qwen2 or GPT-2) conditioning as transformers and diffusers pipelines compute it, for every
    caption of `source` (an HDF5 latent file's `captions`): the folder's tokenizer.json through the
    tokenizers package, cut at `length` ids; each caption's forward alone (no padding); the hidden
    states `layers` (output_hidden_states indices) side by side, zero after the caption; their mean
    over the caption as the pooled vector. Writes `out`: `source` with those in place of
    encoder_hidden_states and pooled_projections."""
    import h5py
    from tokenizers import Tokenizer
    config = json.load(open(os.path.join(folder, "config.json")))
    gpt2 = config["model_type"] == "gpt2"
    w = (gpt2_weights if gpt2 else llama_weights)(load_folder(folder))
    hidden_states = gpt2_hidden_states if gpt2 else llama_hidden_states
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    with h5py.File(source, "r") as f:
        captions = [c.decode() if isinstance(c, bytes) else c for c in f["captions"][()]]
        data = {name: f[name][()] for name in f}
        attrs = dict(f.attrs)
    C = config["n_embd" if gpt2 else "hidden_size"]
    context, pooled = np.zeros((len(captions), length, C * len(layers))), np.zeros((len(captions), C * len(layers)))
    lengths = []
    for i, caption in enumerate(captions):
        ids = tokenizer.encode(caption).ids[:length]
        lengths.append(len(ids))
        if ids:
            states = hidden_states(config, w, np.array(ids))
            context[i, :len(ids)] = np.concatenate([states[k] for k in layers], -1)
            pooled[i] = context[i, :len(ids)].mean(0)
    data["encoder_hidden_states"], data["pooled_projections"] = context.astype(np.float32), pooled.astype(np.float32)
    with h5py.File(out, "w") as g:
        for name, value in data.items():
            g[name] = value
        for name, value in attrs.items():
            g.attrs[name] = value
    return {"captions": len(captions), "lengths": sorted(set(lengths))}


def loss(folder, tokens):
    config = json.load(open(os.path.join(folder, "config.json")))
    if config["model_type"] in ("llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3"):
        return llama_loss(config, load_folder(folder), tokens)
    w = gpt2_weights(load_folder(folder))
    inputs, targets = np.array(tokens[:-1]), np.array(tokens[1:])
    x = gpt2_hidden_states(config, w, inputs)[-1]
    return cross_entropy(x @ w["wte.weight"].T, targets)


def gpt2_weights(raw):
    return {k[len("transformer."):] if k.startswith("transformer.") else k: v.astype(np.float64) for k, v in raw.items()}


def gpt2_hidden_states(config, w, inputs):
    """GPT2Model's output_hidden_states over one sequence: the embeddings (token and position),
    each block's output, the last one through ln_f."""
    L, C, H = config["n_layer"], config["n_embd"], config["n_head"]
    T, hd = len(inputs), C // H
    x = w["wte.weight"][inputs] + w["wpe.weight"][:T]
    states = [x]
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
        states.append(x)
    states[-1] = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"])
    return states


def tensors(path):
    """numpy's dtype name (bfloat16 for BF16), shape and the sha256 of the stored bytes of each tensor."""
    from safetensors import safe_open
    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata()
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    out = {}
    for name, array in read_tensors(path).items():
        stored, dtype = (bf16_bits(array), "bfloat16") if dtypes[name] == "BF16" else (array, str(array.dtype))
        out[name] = [dtype, list(array.shape), hashlib.sha256(stored.tobytes()).hexdigest()]
    return {"tensors": out, "metadata": metadata}


def equal(path_a, path_b):
    """Files or folders: the same tensors, bit for bit."""
    a, b = ((load_folder(p) if os.path.isdir(p) else read_tensors(p)) for p in (path_a, path_b))
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def rounded(path_f32, path_other):
    """OTHER holds F32's tensors rounded to nearest even: F16 as numpy rounds, BF16 by the bits."""
    from safetensors import safe_open
    a = read_tensors(path_f32)
    with safe_open(path_other, framework="numpy") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    if sorted(dtypes) != sorted(a):
        return False
    b = read_tensors(path_other)
    for name, dtype in dtypes.items():
        want = bf16_bits(a[name]) if dtype == "BF16" else a[name].astype(np.float16).view(np.uint16)
        got = bf16_bits(b[name]) if dtype == "BF16" else b[name].view(np.uint16)  # BF16 widened exactly: same bits
        if dtype not in ("BF16", "F16") or b[name].shape != a[name].shape or not np.array_equal(want, got):
            return False
    return True


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "make":
        folder, L, C, H, V, T, dtype, seed, prefix = args
        make(folder, int(L), int(C), int(H), int(V), int(T), {"F32": np.float32, "F16": np.float16}[dtype], int(seed),
             "" if prefix == "-" else prefix)
        print(json.dumps({"ok": True}))
    elif command == "make-llama":
        folder, L, C, H, KV, I, V, T, tied, dtype, seed, prefix = args[:12]
        make_llama(folder, int(L), int(C), int(H), int(KV), int(I), int(V), int(T), tied == "tied", dtype, int(seed),
                   "" if prefix == "-" else prefix, args[12].split(",") if len(args) > 12 else ())
        print(json.dumps({"ok": True}))
    elif command == "loss":
        value = loss(args[0], [int(t) for t in args[1:]])
        print(json.dumps({"loss": value, "correct": LAST_CORRECT[0]}))
    elif command == "caption-context":
        folder, layers, length, source, out = args
        print(json.dumps(caption_context(folder, [int(k) for k in layers.split(",")], int(length), source, out)))
    elif command == "tensors":
        print(json.dumps(tensors(args[0])))
    elif command == "equal":
        print(json.dumps({"equal": equal(args[0], args[1])}))
    elif command == "rounded":
        print(json.dumps({"rounded": rounded(args[0], args[1])}))
    else:
        sys.exit(f"unknown command {command}")

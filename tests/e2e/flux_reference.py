"""An independent float64 numpy reference of model.arch=flux and flux2, written from the equations
of diffusers' FluxTransformer2DModel and Flux2Transformer2DModel (docs/flux.md), and of the flow-matching samples ShardTrain draws
(data/flow_matching.hpp, data/sampler.hpp, core/random.hpp): for the e2e tests' oracle."""
import numpy as np

from safetensors_io import write_safetensors

U64 = np.uint64
MASK = (1 << 64) - 1


def mix64(z):
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def mix64_array(z):
    with np.errstate(over="ignore"):
        z = z + U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> U64(30))) * U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> U64(27))) * U64(0x94D049BB133111EB)
        return z ^ (z >> U64(31))


def counter_uniform(key, counters):
    bits = mix64_array(U64(key) ^ mix64_array(np.asarray(counters, dtype=U64)))
    return ((bits >> U64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)


def counter_normal(key, index):
    index = np.asarray(index, dtype=U64)
    u1 = counter_uniform(key, U64(2) * index)
    u2 = counter_uniform(key, U64(2) * index + U64(1))
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(6.283185307179586 * u2)


SAMPLER_DOMAIN = 0x73616D706C657273


def window(seed, windows, global_batch, step, j):
    """data/sampler.cpp: the record sequence j of `step` reads (a keyed Feistel permutation per epoch)."""
    g = step * global_batch + j
    epoch, position = g // windows, g % windows
    key = mix64(mix64(seed ^ SAMPLER_DOMAIN) ^ mix64(epoch))
    bits = 2
    while (1 << bits) < windows:
        bits += 1
    half = (bits + 1) // 2
    round_keys = [mix64(key ^ mix64(r + 1)) for r in range(4)]
    mask = (1 << half) - 1
    x = position
    while True:
        left, right = x >> half, x & mask
        for rk in round_keys:
            left, right = right, left ^ (mix64(right ^ rk) & mask)
        x = (left << half) | right
        if x < windows:
            return x


FLOW_DOMAIN, VALIDATION_SALT, NOISE_SALT = 0x666C6F776D617463, 0x76616C6964617465, 0x6E6F697365


def flow_sample(seed, sample, x0, sampling="uniform", logit_mean=0.0, logit_std=1.0, shift=1.0):
    """(sigma, x_sigma, target) of a training sample, in float32 as ShardTrain draws them."""
    key = mix64(mix64(seed ^ FLOW_DOMAIN) ^ mix64(sample))
    if sampling == "uniform":
        sigma = float(counter_uniform(key, [0])[0])
    else:
        sigma = 1.0 / (1.0 + np.exp(-(logit_mean + logit_std * float(counter_normal(key, [1])[0]))))
    sigma = shift * sigma / (1 + (shift - 1) * sigma)
    s = np.float32(sigma)
    e = counter_normal(mix64(key ^ NOISE_SALT), np.arange(x0.size)).astype(np.float32).reshape(x0.shape)
    return s, (np.float32(1) - s) * x0 + s * e, e - x0


# ------------------------------------------------------------------------------------ the model

def linear(p, name, x):
    """x W^T + b; FLUX.2's layers have no bias."""
    y = x @ p[name + ".weight"].T
    return y + p[name + ".bias"] if name + ".bias" in p else y


def silu(x):
    return x / (1 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x, eps):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps)


def rms_norm(x, w, eps):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w


def sinusoid(values):
    """diffusers' Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0) of 1000 x value, each
    step correctly rounded to float32 as ShardTrain computes it: [cos, sin]."""
    half = 128
    freq = np.exp(-np.log(10000.0) * np.arange(half) / half).astype(np.float32)
    t = (np.asarray(values, np.float32) * np.float32(1000))[:, None]
    angle = (t * freq[None, :]).astype(np.float64)  # the float32 product
    return np.concatenate([np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)], -1).astype(np.float64)


def rope_tables(ids, axes, theta):
    """cos, sin (S, D/2) for position ids (S, len(axes)): axis a's pair k turns by id_a theta^(-2k/axes[a])."""
    cols = []
    for a, width in enumerate(axes):
        freq = 1.0 / theta ** (np.arange(0, width, 2, dtype=np.float64) / width)
        cols.append(np.outer(ids[:, a].astype(np.float64), freq))
    angle = np.concatenate(cols, -1)
    return np.cos(angle), np.sin(angle)


def rope(x, cos, sin, halves=False):
    """x (B, S, H, D): interleaved pairs (x[2i], x[2i+1]) turned; halves=True pairs x[i] with
    x[i + D/2] instead (Llama's rotate_half: a negative control, not FLUX)."""
    if halves:
        D = x.shape[-1]
        a, b = x[..., :D // 2], x[..., D // 2:]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = b * c + a * s
    return out


def attention(q, k, v):
    """Joint attention, no mask: (B, S, H, D) each."""
    D = q.shape[-1]
    scores = np.einsum("bshd,bthd->bhst", q, k) / np.sqrt(D)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhst,bthd->bshd", p, v)


def heads(x, H):
    B, S, C = x.shape
    return x.reshape(B, S, H, C // H)


def bf16_round(x):
    """x rounded to bfloat16 (to fp32, then to nearest even in its top 16 bits), as float64."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32).astype(np.float64)


def flux_forward(p, cfg, hidden, text, pooled, timestep, guidance, img_ids, txt_ids, rope_halves=False,
                 final_shift_first=False, keep=lambda v: v):
    """The image tokens' prediction (B, N, in_channels) of FluxTransformer2DModel, float64. The two
    flags are negative controls (what FLUX does not do): Llama's half-split rotary, and the final
    layer's modulation read as (shift, scale) as Black Forest Labs' files store it. keep: what
    becomes of each activation the backward reads, where it is made -- the residual streams the
    embedders and each block but the last make, and inside the blocks the normed inputs, q and k
    before their norms and [q; k; v] after the rotary turn, the attention output, the output
    products, the gated sums and the MLP's products (bf16_round: fsdp.activation_dtype=bf16)."""
    H, eps = cfg["n_head"], cfg["norm_eps"]
    x = keep(linear(p, "x_embedder", hidden))
    c = keep(linear(p, "context_embedder", text))

    def mlp(prefix, v):
        return linear(p, prefix + ".linear_2", silu(linear(p, prefix + ".linear_1", v)))

    temb = mlp("time_text_embed.timestep_embedder", sinusoid(timestep))
    if cfg["guidance_embeds"]:
        temb = temb + mlp("time_text_embed.guidance_embedder", sinusoid(guidance))
    temb = temb + mlp("time_text_embed.text_embedder", pooled)
    e = silu(temb)
    ids = np.concatenate([txt_ids, img_ids], 0)
    cos, sin = rope_tables(ids, cfg["rope_axes"], cfg["rope_theta"])
    L = text.shape[1]

    def mlp_out(prefix, v):  # the block's GELU MLP, its three products kept
        return keep(linear(p, prefix + ".2", keep(gelu_tanh(keep(linear(p, prefix + ".0.proj", v))))))

    def mod(name, chunks):
        return np.split(linear(p, name, e)[:, None, :], chunks, -1)

    def qk(prefix, x, q, k, v, nq, nk):
        return (rms_norm(heads(keep(linear(p, prefix + q, x)), H), p[prefix + nq + ".weight"], eps),
                rms_norm(heads(keep(linear(p, prefix + k, x)), H), p[prefix + nk + ".weight"], eps),
                heads(linear(p, prefix + v, x), H))

    for l in range(cfg["n_layer"]):
        b = f"transformer_blocks.{l}."
        sh1, sc1, g1, sh2, sc2, g2 = mod(b + "norm1.linear", 6)
        csh1, csc1, cg1, csh2, csc2, cg2 = mod(b + "norm1_context.linear", 6)
        xn = keep(layer_norm(x, eps) * (1 + sc1) + sh1)
        cn = keep(layer_norm(c, eps) * (1 + csc1) + csh1)
        qi, ki, vi = qk(b, xn, "attn.to_q", "attn.to_k", "attn.to_v", "attn.norm_q", "attn.norm_k")
        qt, kt, vt = qk(b, cn, "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.norm_added_q",
                        "attn.norm_added_k")
        q = keep(rope(np.concatenate([qt, qi], 1), cos, sin, rope_halves))
        k = keep(rope(np.concatenate([kt, ki], 1), cos, sin, rope_halves))
        y = keep(attention(q, k, keep(np.concatenate([vt, vi], 1))))
        y = y.reshape(y.shape[0], y.shape[1], -1)
        x = keep(x + g1 * keep(linear(p, b + "attn.to_out.0", y[:, L:])))
        c = keep(c + cg1 * keep(linear(p, b + "attn.to_add_out", y[:, :L])))
        x = x + g2 * mlp_out(b + "ff.net", keep(layer_norm(x, eps) * (1 + sc2) + sh2))
        c = c + cg2 * mlp_out(b + "ff_context.net", keep(layer_norm(c, eps) * (1 + csc2) + csh2))
        if l < cfg["n_layer"] - 1 or cfg["n_single_layer"]:  # the model's output is no block's input
            x, c = keep(x), keep(c)
    h = np.concatenate([c, x], 1)
    for l in range(cfg["n_single_layer"]):
        b = f"single_transformer_blocks.{l}."
        sh, sc, g = mod(b + "norm.linear", 3)
        hn = keep(layer_norm(h, eps) * (1 + sc) + sh)
        q, k, v = qk(b, hn, "attn.to_q", "attn.to_k", "attn.to_v", "attn.norm_q", "attn.norm_k")
        y = attention(keep(rope(q, cos, sin, rope_halves)), keep(rope(k, cos, sin, rope_halves)), keep(v))
        y = y.reshape(y.shape[0], y.shape[1], -1)
        cat = keep(np.concatenate([y, gelu_tanh(keep(linear(p, b + "proj_mlp", hn)))], -1))
        h = h + g * keep(linear(p, b + "proj_out", cat))
        h = keep(h) if l < cfg["n_single_layer"] - 1 else h
    x = h[:, L:]
    scale, shift = mod("norm_out.linear", 2)  # AdaLayerNormContinuous: scale first
    if final_shift_first:
        scale, shift = shift, scale
    return linear(p, "proj_out", layer_norm(x, eps) * (1 + scale) + shift)


def swiglu(x):
    """FLUX.2's Flux2SwiGLU: silu(first half) * second half."""
    half = x.shape[-1] // 2
    return silu(x[..., :half]) * x[..., half:]


def flux2_forward(p, cfg, hidden, text, timestep, guidance, img_ids, txt_ids, activation=swiglu, shared_mod=True,
                  keep=lambda v: v):
    """The image tokens' prediction (B, N, in_channels) of Flux2Transformer2DModel, float64: no
    biases, no pooled vector, the three modulations computed once from temb and shared by every block
    of their kind, SwiGLU MLPs, the single blocks' fused q|k|v|MLP product. Negative controls:
    activation=gelu_tanh-of-the-first-half (FLUX.1's MLP), shared_mod=False (each double block's text
    stream modulated by the image stream's parameters, a wrong wiring). keep: as flux_forward's."""
    H, eps, C = cfg["n_head"], cfg["norm_eps"], cfg["n_head"] * cfg["head_dim"]
    F = cfg["mlp_width"]
    x = keep(linear(p, "x_embedder", hidden))
    c = keep(linear(p, "context_embedder", text))

    def mlp(prefix, v):
        return linear(p, prefix + ".linear_2", silu(linear(p, prefix + ".linear_1", v)))

    temb = mlp("time_guidance_embed.timestep_embedder", sinusoid(timestep))
    if cfg["guidance_embeds"]:
        temb = temb + mlp("time_guidance_embed.guidance_embedder", sinusoid(guidance))
    e = silu(temb)
    mod_img = np.split(linear(p, "double_stream_modulation_img.linear", e)[:, None, :], 6, -1)
    mod_txt = np.split(linear(p, "double_stream_modulation_txt.linear", e)[:, None, :], 6, -1)
    if not shared_mod:
        mod_txt = mod_img
    sh, sc, g = np.split(linear(p, "single_stream_modulation.linear", e)[:, None, :], 3, -1)
    ids = np.concatenate([txt_ids, img_ids], 0)
    cos, sin = rope_tables(ids, cfg["rope_axes"], cfg["rope_theta"])
    L = text.shape[1]

    def qk_norm(prefix, q, k, nq, nk):
        return (rms_norm(heads(keep(q), H), p[prefix + nq + ".weight"], eps),
                rms_norm(heads(keep(k), H), p[prefix + nk + ".weight"], eps))

    def mlp_out(prefix, v):  # the block's MLP, its three products kept
        return keep(linear(p, prefix + "_out", keep(activation(keep(linear(p, prefix + "_in", v))))))

    for l in range(cfg["n_layer"]):
        b = f"transformer_blocks.{l}."
        sh1, sc1, g1, sh2, sc2, g2 = mod_img
        csh1, csc1, cg1, csh2, csc2, cg2 = mod_txt
        xn = keep(layer_norm(x, eps) * (1 + sc1) + sh1)
        cn = keep(layer_norm(c, eps) * (1 + csc1) + csh1)
        qi, ki = qk_norm(b, linear(p, b + "attn.to_q", xn), linear(p, b + "attn.to_k", xn), "attn.norm_q",
                         "attn.norm_k")
        qt, kt = qk_norm(b, linear(p, b + "attn.add_q_proj", cn), linear(p, b + "attn.add_k_proj", cn),
                         "attn.norm_added_q", "attn.norm_added_k")
        vi, vt = heads(linear(p, b + "attn.to_v", xn), H), heads(linear(p, b + "attn.add_v_proj", cn), H)
        q = keep(rope(np.concatenate([qt, qi], 1), cos, sin))
        k = keep(rope(np.concatenate([kt, ki], 1), cos, sin))
        y = keep(attention(q, k, keep(np.concatenate([vt, vi], 1))))
        y = y.reshape(y.shape[0], y.shape[1], -1)
        x = keep(x + g1 * keep(linear(p, b + "attn.to_out.0", y[:, L:])))
        c = keep(c + cg1 * keep(linear(p, b + "attn.to_add_out", y[:, :L])))
        x = x + g2 * mlp_out(b + "ff.linear", keep(layer_norm(x, eps) * (1 + sc2) + sh2))
        c = c + cg2 * mlp_out(b + "ff_context.linear", keep(layer_norm(c, eps) * (1 + csc2) + csh2))
        if l < cfg["n_layer"] - 1 or cfg["n_single_layer"]:
            x, c = keep(x), keep(c)
    h = np.concatenate([c, x], 1)
    for l in range(cfg["n_single_layer"]):
        b = f"single_transformer_blocks.{l}."
        hn = keep(layer_norm(h, eps) * (1 + sc) + sh)
        fused = linear(p, b + "attn.to_qkv_mlp_proj", hn)
        q, k = qk_norm(b, fused[..., :C], fused[..., C:2 * C], "attn.norm_q", "attn.norm_k")
        v = heads(fused[..., 2 * C:3 * C], H)
        y = attention(keep(rope(q, cos, sin)), keep(rope(k, cos, sin)), keep(v))
        y = y.reshape(y.shape[0], y.shape[1], -1)
        cat = keep(np.concatenate([y, activation(keep(fused[..., 3 * C:]))], -1))
        h = h + g * keep(linear(p, b + "attn.to_out", cat))
        h = keep(h) if l < cfg["n_single_layer"] - 1 else h
    x = h[:, L:]
    scale, shift = np.split(linear(p, "norm_out.linear", e)[:, None, :], 2, -1)
    return linear(p, "proj_out", layer_norm(x, eps) * (1 + scale) + shift)


# ------------------------------------------------------------------------------------ files

def flux2_shapes(cfg):
    """diffusers' parameter names and shapes of Flux2Transformer2DModel for the config."""
    C = cfg["n_head"] * cfg["head_dim"]
    D, F, IN = cfg["head_dim"], cfg["mlp_width"], cfg["in_channels"]
    shapes = {"x_embedder.weight": (C, IN), "context_embedder.weight": (C, cfg["context_dim"]),
              "time_guidance_embed.timestep_embedder.linear_1.weight": (C, 256),
              "time_guidance_embed.timestep_embedder.linear_2.weight": (C, C),
              "double_stream_modulation_img.linear.weight": (6 * C, C),
              "double_stream_modulation_txt.linear.weight": (6 * C, C),
              "single_stream_modulation.linear.weight": (3 * C, C),
              "norm_out.linear.weight": (2 * C, C), "proj_out.weight": (IN, C)}
    if cfg["guidance_embeds"]:
        shapes["time_guidance_embed.guidance_embedder.linear_1.weight"] = (C, 256)
        shapes["time_guidance_embed.guidance_embedder.linear_2.weight"] = (C, C)
    for l in range(cfg["n_layer"]):
        b = f"transformer_blocks.{l}."
        for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            shapes[b + "attn." + n + ".weight"] = (C, C)
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            shapes[b + "attn." + n + ".weight"] = (D,)
        for ff in ("ff", "ff_context"):
            shapes[b + ff + ".linear_in.weight"] = (2 * F, C)
            shapes[b + ff + ".linear_out.weight"] = (C, F)
    for l in range(cfg["n_single_layer"]):
        b = f"single_transformer_blocks.{l}."
        shapes[b + "attn.to_qkv_mlp_proj.weight"] = (3 * C + 2 * F, C)
        shapes[b + "attn.norm_q.weight"] = shapes[b + "attn.norm_k.weight"] = (D,)
        shapes[b + "attn.to_out.weight"] = (C, C + F)
    return shapes


def flux_shapes(cfg):
    """diffusers' parameter names and shapes of FluxTransformer2DModel for the config."""
    C = cfg["n_head"] * cfg["head_dim"]
    D, F, IN = cfg["head_dim"], 4 * C, cfg["in_channels"]
    shapes = {}

    def linear(name, out, inp):
        shapes[name + ".weight"], shapes[name + ".bias"] = (out, inp), (out,)
    linear("x_embedder", C, IN)
    linear("context_embedder", C, cfg["context_dim"])
    linear("time_text_embed.timestep_embedder.linear_1", C, 256)
    linear("time_text_embed.timestep_embedder.linear_2", C, C)
    if cfg["guidance_embeds"]:
        linear("time_text_embed.guidance_embedder.linear_1", C, 256)
        linear("time_text_embed.guidance_embedder.linear_2", C, C)
    linear("time_text_embed.text_embedder.linear_1", C, cfg["pooled_dim"])
    linear("time_text_embed.text_embedder.linear_2", C, C)
    for l in range(cfg["n_layer"]):
        b = f"transformer_blocks.{l}."
        linear(b + "norm1.linear", 6 * C, C)
        linear(b + "norm1_context.linear", 6 * C, C)
        for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            linear(b + "attn." + n, C, C)
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            shapes[b + "attn." + n + ".weight"] = (D,)
        for ff in ("ff", "ff_context"):
            linear(b + ff + ".net.0.proj", F, C)
            linear(b + ff + ".net.2", C, F)
    for l in range(cfg["n_single_layer"]):
        b = f"single_transformer_blocks.{l}."
        linear(b + "norm.linear", 3 * C, C)
        for n in ("to_q", "to_k", "to_v"):
            linear(b + "attn." + n, C, C)
        shapes[b + "attn.norm_q.weight"] = shapes[b + "attn.norm_k.weight"] = (D,)
        linear(b + "proj_mlp", F, C)
        linear(b + "proj_out", C, C + F)
    linear("norm_out.linear", 2 * C, C)
    linear("proj_out", IN, C)
    return shapes


def make_diffusers_folder(folder, cfg, seed, scale=0.3):
    """A FluxTransformer2DModel (cfg["arch"] == "flux2": Flux2Transformer2DModel) folder as diffusers
    saves it (config.json, diffusion_pytorch_model.safetensors) with random float32 weights (norm
    weights near 1)."""
    import json
    import os
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    flux2 = cfg.get("arch") == "flux2"
    for name, shape in (flux2_shapes(cfg) if flux2 else flux_shapes(cfg)).items():
        values = scale * rng.standard_normal(shape)
        tensors[name] = (1 + values if "norm_" in name and "linear" not in name else values).astype(np.float32)
    write_safetensors(tensors, os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    if flux2:
        config = {"_class_name": "Flux2Transformer2DModel", "_diffusers_version": "0.42.1", "patch_size": 1,
                  "in_channels": cfg["in_channels"], "out_channels": None, "num_layers": cfg["n_layer"],
                  "num_single_layers": cfg["n_single_layer"], "attention_head_dim": cfg["head_dim"],
                  "num_attention_heads": cfg["n_head"], "joint_attention_dim": cfg["context_dim"],
                  "timestep_guidance_channels": 256, "mlp_ratio": cfg["mlp_width"] / (cfg["n_head"] * cfg["head_dim"]),
                  "axes_dims_rope": list(cfg["rope_axes"]), "rope_theta": cfg["rope_theta"], "eps": cfg["norm_eps"],
                  "guidance_embeds": cfg["guidance_embeds"]}
    else:
        config = {"_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.42.1", "patch_size": 1,
                  "in_channels": cfg["in_channels"], "out_channels": None, "num_layers": cfg["n_layer"],
                  "num_single_layers": cfg["n_single_layer"], "attention_head_dim": cfg["head_dim"],
                  "num_attention_heads": cfg["n_head"], "joint_attention_dim": cfg["context_dim"],
                  "pooled_projection_dim": cfg["pooled_dim"], "guidance_embeds": cfg["guidance_embeds"],
                  "axes_dims_rope": list(cfg["rope_axes"])}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return {k: v.astype(np.float64) for k, v in tensors.items()}

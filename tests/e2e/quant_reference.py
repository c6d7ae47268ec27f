"""numpy references of the quantized formats, written from bitsandbytes 0.50's quantize_4bit and
dequantize_4bit (the default kernels its CPU backend runs) and from torch's float8_e4m3fn rounding;
test_quantization.py holds them to those libraries' own output (tests/fixtures/bnb/quant.safetensors)
before using them as the oracle of a quantized run."""
import json

import numpy as np

F32 = np.float32

# bitsandbytes' NF4 table (functional.get_4bit_type("nf4")), and FP4: e2m1's values over 12 in its
# code order, the sign in bit 3.
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], dtype=F32)
_E2M1 = np.array([0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0], dtype=np.float64)
FP4 = np.concatenate([_E2M1, -_E2M1]).astype(F32) / F32(12)
FP4[8] = 0.0  # bitsandbytes' table holds +0 there, not -0
TABLES = {"nf4": NF4, "fp4": FP4}


def quantize_4bit(x, quant_type, block):
    """(codes, absmax): one code per element (0..15, unpacked) and one absmax per block of the
    row-major flattening, the last block partial."""
    table = TABLES[quant_type]
    order = np.argsort(table, kind="stable")  # FP4's two zeros: code 0 before code 8, as torch sorts them
    ordered = table[order]
    midpoints = ((ordered[:-1] + ordered[1:]) / F32(2)).astype(F32)
    flat = np.asarray(x, dtype=F32).reshape(-1)
    codes = np.empty(flat.size, dtype=np.int64)
    absmax = []
    for start in range(0, flat.size, block):
        seg = flat[start:start + block]
        top = np.abs(seg).max()
        clamped = max(top, F32(1e-38))
        if seg.size == block:  # bitsandbytes multiplies a full block by the reciprocal...
            scaled = seg * (F32(1) / clamped)
            absmax.append(top)
        else:  # ...and divides a partial one, storing the clamped absmax
            scaled = seg / clamped
            absmax.append(clamped)
        scaled = np.clip(scaled, F32(-1), F32(1))
        codes[start:start + seg.size] = order[np.searchsorted(midpoints, scaled, side="left")]
    return codes, np.array(absmax, dtype=F32)


def dequantize_4bit(codes, absmax, quant_type, block):
    table = TABLES[quant_type]
    scales = np.repeat(absmax, block)[:codes.size]
    return (table[codes] * scales).astype(F32)


def pack_4bit(codes, quant_type):
    """bitsandbytes' bytes: element 2j in the high nibble, 2j + 1 in the low one; an odd count is
    padded with the code zero quantizes to (NF4 7, FP4 0)."""
    if codes.size % 2:
        codes = np.append(codes, 7 if quant_type == "nf4" else 0)
    return ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)


# float8 e4m3fn: every non-negative finite value, in code order (0..126, ascending).
_E4M3 = np.array([(m / 8.0) * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
                  for e in range(16) for m in range(8)][:127], dtype=np.float64)


def float_to_e4m3(x):
    """Codes of float32 values in [-448, 448], rounded to nearest, ties to the even code."""
    x = np.asarray(x, dtype=F32).astype(np.float64)
    mag = np.abs(x)
    hi = np.clip(np.searchsorted(_E4M3, mag, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_hi, d_lo = _E4M3[hi] - mag, mag - _E4M3[lo]
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def e4m3_to_float(codes):
    codes = np.asarray(codes, dtype=np.int64)
    return np.where(codes & 0x80, -1.0, 1.0) * _E4M3[codes & 0x7F]


def round_to_bf16(x):
    """float32 values rounded to bfloat16 (nearest, ties to even), as float32."""
    u = np.asarray(x, dtype=F32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(F32)


def double_quantize(absmax, dynamic_map, nested=256):
    """bitsandbytes' compress_statistics of one weight's absmax: (codes, group scales, offset). The
    offset is their mean summed in order in float64 and rounded once; each group of `nested` takes
    max |absmax - offset| as its scale and each absmax the nearest map value of (absmax - offset) /
    scale (the lower of two as near)."""
    offset = F32(np.cumsum(absmax.astype(np.float64))[-1] / absmax.size)
    shifted = (absmax - offset).astype(F32)
    scales = np.array([np.abs(shifted[g:g + nested]).max() for g in range(0, absmax.size, nested)], dtype=F32)
    per_block = np.repeat(scales, nested)[:absmax.size]
    scaled = np.where(per_block > 0, np.clip(shifted / np.where(per_block > 0, per_block, F32(1)), F32(-1), F32(1)),
                      F32(0)).astype(F32)
    above = np.searchsorted(dynamic_map, scaled, side="left")
    codes = np.minimum(above, 255)
    lower = np.maximum(above - 1, 0)
    nearer_below = (above > 0) & ((above == 256) | (scaled - dynamic_map[lower] <= dynamic_map[codes] - scaled))
    codes = np.where(nearer_below, lower, codes)
    return codes, scales, offset


def double_dequantize(codes, scales, offset, dynamic_map, nested=256):
    """The absmax bitsandbytes decodes: map[code] x scale, rounded, plus the offset."""
    return ((dynamic_map[codes] * np.repeat(scales, nested)[:codes.size]).astype(F32) + offset).astype(F32)


def quantize_dequantize(x, fmt, block, dynamic_map=None):
    """What a run with fsdp.frozen_dtype=fmt computes with in place of the weight x (fp32); with
    bitsandbytes' dynamic map (nf4 and fp4), what it computes with under fsdp.double_quant."""
    x = np.asarray(x, dtype=F32)
    if fmt == "bf16":
        return round_to_bf16(x)
    if fmt in TABLES:
        codes, absmax = quantize_4bit(x, fmt, block)
        if dynamic_map is not None:
            absmax = double_dequantize(*double_quantize(absmax, dynamic_map), dynamic_map)
        return dequantize_4bit(codes, absmax, fmt, block).reshape(x.shape)
    assert fmt == "fp8", fmt
    flat = x.reshape(-1)
    out = np.empty_like(flat)
    for start in range(0, flat.size, block):
        seg = flat[start:start + block]
        scale = np.abs(seg).max() / F32(448)
        if scale == 0:
            out[start:start + seg.size] = 0
            continue
        codes = float_to_e4m3(np.clip(seg / scale, F32(-448), F32(448)))
        out[start:start + seg.size] = e4m3_to_float(codes).astype(F32) * scale
    return out.reshape(x.shape)


def dequantize_bnb_tensor(tensors, name):
    """A weight of a bitsandbytes 4-bit folder (its packed codes, absmax -- 8-bit codes of
    absmax - offset under double quantization -- maps and JSON quant_state) as bitsandbytes'
    dequantize_4bit computes it in float32: quant_map[code] x absmax, the absmax itself
    nested_quant_map[q] x nested_absmax + offset (rounded after each step)."""
    states = [k for k in tensors if k.startswith(name + ".quant_state.bitsandbytes__")]
    assert len(states) == 1, name
    state = json.loads(bytes(tensors[states[0]]).decode())
    block, shape = state["blocksize"], state["shape"]
    numel = int(np.prod(shape))
    packed = tensors[name].reshape(-1)
    codes = np.empty(2 * packed.size, dtype=np.int64)
    codes[0::2], codes[1::2] = packed >> 4, packed & 15
    absmax = tensors[name + ".absmax"]
    if "nested_blocksize" in state:
        nested = state["nested_blocksize"]
        scales = np.repeat(tensors[name + ".nested_absmax"], nested)[:absmax.size]
        absmax = (tensors[name + ".nested_quant_map"][absmax] * scales).astype(F32) + F32(state["nested_offset"])
    values = tensors[name + ".quant_map"][codes[:numel]] * np.repeat(absmax.astype(F32), block)[:numel]
    return values.astype(F32).reshape(shape)

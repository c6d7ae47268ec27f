"""safetensors files read and written with numpy alone (the test runner's Python has no safetensors
package): an 8-byte little-endian header length, the JSON header (padded with spaces to 8 bytes),
then the tensors' bytes, row-major, at their data_offsets."""
import json

import numpy as np

# BF16 is read as its raw bits: numpy has no bfloat16.
DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "U8": "u1"}


def read_safetensors(path):
    """(name -> array of its shape, the __metadata__ dict or None)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        data = f.read()
    tensors = {name: np.frombuffer(data[t["data_offsets"][0]:t["data_offsets"][1]],
                                   dtype=DTYPES[t["dtype"]]).reshape(t["shape"]).copy()
               for name, t in header.items() if name != "__metadata__"}
    return tensors, header.get("__metadata__")


def write_safetensors(tensors, path, metadata=None):
    """uint8 arrays as U8, everything else as F32, in name order."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        value = np.asarray(tensors[name])
        dtype = "U8" if value.dtype == np.uint8 else "F32"
        raw = np.ascontiguousarray(value, dtype=DTYPES[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = metadata or {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))

"""Minimal safetensors writer/reader (BF16/F32) written for pdserve.

File layout: 8-byte little-endian header length N, N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
padded with spaces to a multiple of 8, then the raw little-endian tensor data.
"""
import json
import struct

import numpy as np
import torch


def _bf16_bits(t):
    """float tensor -> uint16 numpy array of bfloat16 bits (round to nearest even)."""
    return t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def write_bf16(path, tensors, metadata=None):
    header = {}
    blobs = []
    off = 0
    for name in sorted(tensors):
        arr = _bf16_bits(tensors[name]).astype("<u2")
        data = arr.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    header["__metadata__"] = metadata or {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((-len(h)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read(path):
    """Returns {name: float32 torch tensor}, upcasting BF16."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        buf = raw[base + b:base + e]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif info["dtype"] == "F32":
            arr = np.frombuffer(buf, dtype="<f4").astype(np.float32)
        else:
            raise ValueError(info["dtype"])
        out[name] = torch.from_numpy(arr.reshape(info["shape"]).copy())
    return out

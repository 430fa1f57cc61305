#!/usr/bin/python3
"""Regenerates the seed corpora of the fuzz targets.

    /usr/bin/python3 tests/fuzz/make_corpus.py

Writes tests/fuzz/corpus/safetensors/ (small valid files and one file per
malformed case the parser must refuse), tests/fuzz/corpus/config/ (the
fixture configs, valid variants and malformed ones) and
tests/fuzz/corpus/grant/ (KV handoff grants minted with the replay's key,
32 bytes of 'k', and broken ones). Seed names state the
expected outcome, which tests/fuzz/replay_test.cc checks: valid_* are
accepted, bad_* refused, gen_* are generation_config.json files. Files of
other names (crash inputs a fuzzer found) are left untouched.

Only the standard library is used; the output is deterministic.
"""

import hashlib
import hmac
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CORPUS = os.path.join(HERE, "corpus")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "models")

MAX_SEED_BYTES = 8 * 1024


def raw(header, data=b"", header_len=None):
    """[u64 little-endian header length][header][data]."""
    if isinstance(header, str):
        header = header.encode()
    n = len(header) if header_len is None else header_len
    return struct.pack("<Q", n) + header + data


def image(tensors, metadata=True):
    """A well-formed file: tensors = [(name, dtype, shape, bytes)]."""
    header = {}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    if metadata:
        header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    return raw(text, b"".join(t[3] for t in tensors))


def one_tensor(entry, data):
    return raw(json.dumps({"w": entry}, separators=(",", ":")), data)


def f32(*values):
    return struct.pack("<%df" % len(values), *values)


def safetensors_seeds():
    two = image([("first", "F32", [2, 3], f32(*range(6))),
                 ("second", "F32", [4], f32(1, 2, 3, 4))])
    eight = bytes(range(8))
    return {
        "valid_minimal_f32": image([("w", "F32", [2], f32(1.0, -2.0))]),
        "valid_two_tensors": two,
        "valid_all_dtypes": image([
            ("a.f32", "F32", [2, 2], f32(1, 2, 3, 4)),
            ("b.f16", "F16", [3], struct.pack("<3H", 0x3C00, 0xC000, 0x7C00)),
            ("c.bf16", "BF16", [1, 2], struct.pack("<2H", 0x3F80, 0xFF80)),
        ]),
        "valid_scalar_and_empty": image([("scalar", "F32", [], f32(3.5)),
                                         ("empty", "BF16", [0, 7], b"")]),
        "valid_empty_header": raw("{}"),
        "valid_metadata_only": raw('{"__metadata__":{"format":"pt"}}'),
        "bad_empty": b"",
        "bad_shorter_than_length": b"\x10\x00\x00",
        "bad_header_len_past_end": raw("{}", b"", 3),
        "bad_header_len_huge": raw("{}", b"", 2**64 - 1),
        "bad_header_not_json": raw("{not json"),
        "bad_header_not_object": raw("[1,2]"),
        "bad_entry_not_object": one_tensor([1], b""),
        "bad_missing_dtype": one_tensor({"shape": [2], "data_offsets": [0, 8]}, eight),
        "bad_missing_shape": one_tensor({"dtype": "F32", "data_offsets": [0, 8]}, eight),
        "bad_missing_offsets": one_tensor({"dtype": "F32", "shape": [2]}, eight),
        "bad_negative_shape": one_tensor(
            {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, eight),
        "bad_float_shape": one_tensor(
            {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, eight),
        "bad_offsets_reversed": one_tensor(
            {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}, eight),
        "bad_truncated": two[:-4],
        "bad_span_mismatch": one_tensor(
            {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, eight),
        "bad_huge_dims": one_tensor(
            {"dtype": "F32", "shape": [2**32, 2**32, 2**32], "data_offsets": [0, 4]}, eight),
        "bad_dtype_f64": one_tensor(
            {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}, eight),
        "bad_dtype_i8": one_tensor(
            {"dtype": "I8", "shape": [8], "data_offsets": [0, 8]}, eight),
        "bad_overlap": raw(json.dumps({
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        }, separators=(",", ":")), bytes(12)),
    }


LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def config(drop=(), **overrides):
    c = {k: v for k, v in LLAMA.items() if k not in drop}
    c.update(overrides)
    return (json.dumps(c, indent=2) + "\n").encode()


def config_seeds():
    mistral = dict(architectures=["MistralForCausalLM"], max_position_embeddings=32768)
    qwen2 = dict(architectures=["Qwen2ForCausalLM"])
    llama3_no_factor = {k: v for k, v in LLAMA3_SCALING.items() if k != "factor"}
    return {
        "valid_llama": config(),
        "valid_llama3_rope": config(rope_scaling=LLAMA3_SCALING),
        "valid_mistral_window_null": config(sliding_window=None, **mistral),
        "valid_mistral_window_max": config(sliding_window=32768, **mistral),
        "valid_qwen2_window_off": config(use_sliding_window=False, sliding_window=64, **qwen2),
        "valid_eos_list": config(eos_token_id=[2, 9]),
        "bad_not_json": b'{"architectures": ["LlamaForCausalLM"],',
        "bad_not_object": b"[1, 2, 3]\n",
        "bad_unknown_architecture": config(architectures=["GPT2LMHeadModel"]),
        "bad_missing_hidden_size": config(drop=("hidden_size",)),
        "bad_negative_heads": config(num_attention_heads=-4),
        "bad_kv_heads_not_dividing": config(num_key_value_heads=3),
        "bad_odd_head_dim": config(head_dim=15),
        "bad_rope_yarn": config(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        "bad_llama3_missing_factor": config(rope_scaling=llama3_no_factor),
        "bad_mistral_sliding_window": config(sliding_window=4096, **mistral),
        "bad_qwen2_use_sliding_window": config(use_sliding_window=True, **qwen2),
        "bad_gelu": config(hidden_act="gelu"),
        "bad_attention_bias": config(attention_bias=True),
        "gen_eos_int": b'{"bos_token_id": 1, "eos_token_id": 2}\n',
        "gen_eos_list": b'{"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}\n',
    }


GRANT_KEY = b"k" * 32


def grant(request_id, attempt, sender, receiver, expires_ms, positions, tokens, key=GRANT_KEY):
    """A KV handoff grant as kv_transfer/grant.h encodes it ("PDG2")."""

    def string(v):
        return struct.pack("<I", len(v)) + v.encode()

    digest = hashlib.sha256(b"".join(struct.pack("<i", t) for t in tokens)).digest()
    signed = (b"PDG2" + string(request_id) + struct.pack("<I", attempt) + string(sender) + string(receiver) +
              struct.pack("<qI", expires_ms, positions) + digest)
    return signed + hmac.new(key, signed, hashlib.sha256).digest()


def grant_seeds():
    good = grant("req-1", 1, "10.0.0.1", "10.0.0.2:7300", 2_000_000_000_000, 96, [1, 2, 3])
    tampered = good.replace(b"req-1", b"rep-1")
    return {
        "valid_grant": good,
        "valid_grant_v6_sender": grant("chatcmpl-9", 7, "fd00::5", "[fd00::6]:7300", 2_000_000_000_000, 4096,
                                       list(range(100))),
        "bad_empty": b"",
        "bad_truncated": good[:-5],
        "bad_tampered": tampered,
        "bad_other_key": grant("req-1", 1, "10.0.0.1", "10.0.0.2:7300", 2_000_000_000_000, 96, [1, 2, 3],
                               key=b"x" * 32),
        "bad_no_positions": grant("req-1", 1, "10.0.0.1", "10.0.0.2:7300", 2_000_000_000_000, 0, [1, 2, 3]),
        "bad_old_format": b"PDG1" + good[4:],
    }


def write(corpus, name, data):
    assert len(data) < MAX_SEED_BYTES, (corpus, name, len(data))
    d = os.path.join(CORPUS, corpus)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def main():
    for name, data in safetensors_seeds().items():
        write("safetensors", name, data)
    for name, data in config_seeds().items():
        write("config", name + ".json", data)
    for name, data in grant_seeds().items():
        write("grant", name, data)
    for model in sorted(os.listdir(FIXTURES)):
        src = os.path.join(FIXTURES, model, "config.json")
        if os.path.isfile(src):
            assert os.path.getsize(src) < MAX_SEED_BYTES, src
            shutil.copyfile(src, os.path.join(CORPUS, "config", "valid_fixture_%s.json" % model))


if __name__ == "__main__":
    main()

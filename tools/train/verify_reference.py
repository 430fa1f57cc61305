#!/usr/bin/python3
"""Cross-check reference/logits.json with a separate float64 numpy forward.

The numpy code is written independently of model.py (loop over heads, explicit
rotary formula per dimension pair) and reads model.safetensors plus
config.json directly, the way an inference engine would.
"""
import argparse
import json
import math
import os

import numpy as np

import safetensors_io

HERE = os.path.dirname(os.path.abspath(__file__))


def forward(W, cfg, ids):
    d, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = d // nh
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    T = len(ids)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, pos):  # x: [hd]
        half = hd // 2
        y = np.empty_like(x)
        for i in range(half):
            ang = pos * theta ** (-2.0 * i / hd)
            c, s = math.cos(ang), math.sin(ang)
            y[i] = x[i] * c - x[i + half] * s
            y[i + half] = x[i + half] * c + x[i] * s
        return y

    E = W["model.embed_tokens.weight"]
    x = E[ids].copy()
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l
        h = rms(x, W[p + "input_layernorm.weight"])
        q = h @ W[p + "self_attn.q_proj.weight"].T
        k = h @ W[p + "self_attn.k_proj.weight"].T
        v = h @ W[p + "self_attn.v_proj.weight"].T
        att_out = np.zeros((T, nh * hd))
        group = nh // nkv
        for head in range(nh):
            kv = head // group
            qh = np.stack([rope(q[t, head * hd:(head + 1) * hd], t) for t in range(T)])
            kh = np.stack([rope(k[t, kv * hd:(kv + 1) * hd], t) for t in range(T)])
            vh = v[:, kv * hd:(kv + 1) * hd]
            for t in range(T):
                sc = kh[:t + 1] @ qh[t] / math.sqrt(hd)
                sc = np.exp(sc - sc.max())
                sc /= sc.sum()
                att_out[t, head * hd:(head + 1) * hd] = sc @ vh[:t + 1]
        x = x + att_out @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ W[p + "mlp.down_proj.weight"].T
    return rms(x, W["model.norm.weight"]) @ E.T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(HERE, "..", "..", "deploy", "models", "kjv-tiny"))
    args = ap.parse_args()
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    W = {k: v.numpy().astype(np.float64) for k, v in safetensors_io.read(os.path.join(args.model, "model.safetensors")).items()}
    ref = json.load(open(os.path.join(args.model, "reference", "logits.json")))
    ok = True
    for i, c in enumerate(ref["cases"]):
        got = forward(W, cfg, c["token_ids"])
        want = np.array(c["logits"])
        err = np.abs(got - want).max()
        rel = err / np.abs(want).max()
        same_argmax = (got.argmax(-1) == want.argmax(-1)).mean()
        print("case %d: max abs diff %.3g, max abs logit %.3g, relative %.3g, argmax agreement %.3f"
              % (i, err, np.abs(want).max(), rel, same_argmax))
        ok &= rel < 1e-4
    print("OK" if ok else "MISMATCH")


if __name__ == "__main__":
    main()

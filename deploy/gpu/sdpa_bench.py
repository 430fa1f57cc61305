#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the attention shapes
pdserve-gpu-bench times its paged kernel on (Llama-3-8B heads: 32 query, 8 KV,
dim 128, BF16), for deploy/gpu/check.sh. Torch reads contiguous KV (no block
table): an upper bound for a paged kernel. Median of 5 timed runs (CUDA events)."""
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"no PyTorch here: {e}")
    sys.exit(0)

if not torch.cuda.is_available():
    print("PyTorch sees no GPU")
    sys.exit(0)

HEADS, KV_HEADS, DIM = 32, 8, 128
SHAPES = [(1, 4096, 1), (32, 4096, 1), (128, 1024, 1), (1, 0, 2048), (1, 0, 8192)]


def attend(q, k, v, causal):
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:  # Older torch: no enable_gqa.
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=causal)


def main():
    bw_probe = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
    del bw_probe
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for batch, history, new in SHAPES:
        total = history + new
        q = torch.randn(batch, HEADS, new, DIM, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(batch, KV_HEADS, total, DIM, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        causal = new > 1  # A decode row attends to everything before it.
        times = []
        for run in range(6):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            attend(q, k, v, causal)
            stop.record()
            torch.cuda.synchronize()
            if run:
                times.append(start.elapsed_time(stop))
        ms = sorted(times)[len(times) // 2]
        kv_bytes = batch * total * KV_HEADS * DIM * 2 * 2
        print(f"  batch {batch:4d} history {history:6d} new {new:5d}: {ms:8.3f} ms "
              f"(KV at {kv_bytes / (ms / 1e3) / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()

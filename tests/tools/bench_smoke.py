#!/usr/bin/env python3
"""The benchmarks print each figure beside a limit measured in the same run.

Runs pdctl bench-kv (a small request over TCP, then over UCX with and
without shared memory), bench-attention
(small histories, both KV formats) and bench-engine (a small random model,
forced onto each matrix path this CPU runs) with
--json, and checks that every figure and its limit are present, positive
and consistent with each other: the ratios are the figures divided by the
limits, not separately made-up numbers. Timings are never asserted.
Usage: bench_smoke.py BUILD_DIR
"""
import json
import os
import subprocess
import sys
import tempfile


def run_json(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=300)
    return json.loads(out.stdout)


def close(a, b):
    return abs(a - b) <= 1e-6 + 1e-3 * abs(b)


def main():
    build = sys.argv[1]
    pdctl = os.path.join(build, "tools", "pdctl", "pdctl")
    failures = []

    # The workers' default transport (TCP): the transport's own puts and
    # the cross-process copy are its references, and nothing of UCX's.
    plain = run_json([pdctl, "bench-kv", "--prompt-len", "128", "--iters", "3", "--json"])
    for key in ("handoff_gbps", "raw_put_gbps", "cross_process_copy_gbps"):
        if not plain.get(key, 0) > 0:
            failures.append(f"bench-kv --kv-transport=tcp: {key} missing or not positive: {plain.get(key)}")
    if plain.get("transport") != "tcp" or any(k.startswith("ucx_perftest") for k in plain):
        failures.append(f"bench-kv --kv-transport=tcp: not tcp, or a UCX reference: {sorted(plain)}")

    env = dict(os.environ, UCX_TLS="sm,tcp,self")
    kv = run_json([pdctl, "bench-kv", "--kv-transport", "ucx", "--prompt-len", "128", "--iters", "3", "--json"], env)
    for key in ("handoff_gbps", "raw_put_gbps", "cross_process_copy_gbps", "ucx_perftest_am_gbps"):
        if not kv.get(key, 0) > 0:
            failures.append(f"bench-kv: {key} missing or not positive: {kv.get(key)} "
                            f"({kv.get('ucx_perftest_error') or kv.get('cross_process_copy_error') or ''})")
    if not failures:
        if not close(kv["handoff_vs_cross_process_copy"], kv["handoff_gbps"] / kv["cross_process_copy_gbps"]):
            failures.append("bench-kv: handoff_vs_cross_process_copy is not handoff / copy")
        if not close(kv["handoff_vs_ucx_perftest"], kv["handoff_gbps"] / kv["ucx_perftest_am_gbps"]):
            failures.append("bench-kv: handoff_vs_ucx_perftest is not handoff / perftest")
        # Each request's commit is the tail of its stream, so the medians keep that order.
        if not 0 < kv.get("commit_ms_median", 0) <= kv["stream_commit_ms_median"]:
            failures.append(f"bench-kv: commit_ms_median {kv.get('commit_ms_median')} not within "
                            f"(0, stream {kv['stream_commit_ms_median']}]")

    # Over tcp the KV goes by messages on the control endpoint: the
    # perftest reference with peer error handling is measured too, and
    # only there (shared memory writes through a mapping).
    if "ucx_perftest_peer_errors_am_gbps" in kv or "ucx_perftest_peer_errors_error" in kv:
        failures.append("bench-kv: the peer-error-handling reference ran over shared memory")
    tcp = run_json([pdctl, "bench-kv", "--kv-transport", "ucx", "--prompt-len", "128", "--iters", "3", "--json"],
                   dict(os.environ, UCX_TLS="tcp"))
    if not tcp.get("ucx_perftest_peer_errors_am_gbps", 0) > 0:
        failures.append(f"bench-kv over tcp: ucx_perftest_peer_errors_am_gbps missing or not positive: "
                        f"{tcp.get('ucx_perftest_peer_errors_am_gbps')} ({tcp.get('ucx_perftest_peer_errors_error') or ''})")
    elif not close(tcp["handoff_vs_ucx_perftest_peer_errors"],
                   tcp["handoff_gbps"] / tcp["ucx_perftest_peer_errors_am_gbps"]):
        failures.append("bench-kv over tcp: handoff_vs_ucx_perftest_peer_errors is not handoff / perftest -e")

    # Both KV formats over scattered blocks, and BF16 over blocks in order;
    # every row also has the bare reader's rate over the same blocks.
    for kv_type, elem, in_order in (("bf16", 2, False), ("f32", 4, False), ("bf16", 2, True)):
        a = run_json([pdctl, "bench-attention", "--decode_batch", "1,2", "--decode_history", "16,40", "--kv", kv_type,
                      "--threads", "1", "--stream_mib", "4", "--json"] + (["--in_order_blocks"] if in_order else []))
        rows = a.get("rows", [])
        if a.get("kv") != kv_type or a.get("in_order_blocks") is not in_order or len(rows) != 4:
            failures.append(f"bench-attention --kv {kv_type}: wrong kv, block order or not 4 rows: {a}")
        for row in rows:
            r, s, l = (row["resident_bytes_per_second"], row["streamed_bytes_per_second"],
                       row["read_limit_bytes_per_second"])
            rd = row["block_reader_bytes_per_second"]
            if not (rd > 0 and close(row["streamed_fraction_of_block_reader"], s / rd)):
                failures.append(f"bench-attention --kv {kv_type}: no block reader rate, or a ratio that is not "
                                f"streamed / reader: {row}")
            # The KV one call reads: every position's K and V of 4 KV heads x 64.
            want = row["batch"] * row["history"] * 4 * 64 * 2 * elem
            if not (r > 0 and s > 0 and l > 0 and row["kv_bytes_per_call"] == want and
                    row["resident_fits_last_level_cache"] is True and
                    close(row["resident_fraction_of_limit"], r / l) and
                    close(row["streamed_fraction_of_limit"], s / l) and
                    close(row["no_overlap_bytes_per_second"], 1 / (1 / r + 1 / l))):
                failures.append(f"bench-attention --kv {kv_type}: row without a figure or a limit: {row} "
                                f"(KV bytes per call should be {want})")
        print(f"bench-attention --kv {kv_type}: ok")

    # A prompt's causal attention alone: its FLOPs from the shape, its rate
    # beside the same run's peak of its instruction (BF16 dot on the bf16
    # matrix path, else F32 FMA); no decode rows asked, none given.
    a = run_json([pdctl, "bench-attention", "--decode_batch", "", "--prompts", "40", "--threads", "1", "--json"])
    prompts = a.get("prompts", [])
    # BF16 KV at blocks of 16 (the defaults): the dot form exactly where the probe takes the bf16 path.
    want_form = "bf16_dot" if a.get("backend") == "cpu/avx512+bf16" else "f32_fma"
    if a.get("attention_form") != want_form:
        failures.append(f"bench-attention: attention_form {a.get('attention_form')} on {a.get('backend')}, "
                        f"want {want_form}")
    if a.get("rows") != [] or len(prompts) != 1:
        failures.append(f"bench-attention --prompts 40: want no decode rows and one prompt row: {a}")
    else:
        p = prompts[0]
        # 12 heads x 64, 40 rows: row r scores and applies r + 1 keys.
        want_flops = 4 * 64 * 12 * 40 * 41 / 2
        if not (p["tokens"] == 40 and p["flops"] == want_flops and p["seconds_per_call"] > 0 and
                p["peak_flops"] > 0 and close(p["flops_per_second"], want_flops / p["seconds_per_call"]) and
                close(p["fraction_of_peak"], p["flops_per_second"] / p["peak_flops"]) and
                p["kv_bytes"] == 3 * 16 * 4 * 64 * 2 * 2):
            failures.append(f"bench-attention --prompts 40: row inconsistent with its shape: {p} "
                            f"(FLOPs should be {want_flops})")
    print("bench-attention --prompts: ok")
    bad = subprocess.run([pdctl, "bench-attention", "--decode_batch", "", "--prompts", "40,0"], capture_output=True,
                         text=True, timeout=120)
    if bad.returncode == 0 or "--prompts" not in bad.stderr + bad.stdout:
        failures.append(f"bench-attention --prompts 40,0: not refused by name: {bad.returncode} {bad.stderr}")
    empty = subprocess.run([pdctl, "bench-attention", "--decode_batch", ""], capture_output=True, text=True,
                           timeout=120)
    if empty.returncode == 0 or "nothing to time" not in empty.stderr + empty.stdout:
        failures.append(f"bench-attention with nothing to time: not refused: {empty.returncode} {empty.stderr}")

    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        subprocess.run([pdctl, "make-model", "--shape", "tiny", "--dtype", "bf16", "--out", model], check=True,
                       capture_output=True, timeout=300)
        small = ["--threads", "1", "--prefill", "32", "--decode_history", "16", "--prefix_hit", "64:8",
                 "--shared_prefix", "2:64:8", "--steps", "2", "--json"]
        kjv = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "models", "kjv-tiny")
        probe = run_json([pdctl, "bench-engine", "--model", model, "--decode_batch", "1", "--mask_tokenizers", kjv]
                         + small)
        peaks = probe["matrix_peaks"]
        # The response format's cost per token, beside the batch-1 step.
        masks = probe.get("response_format_masks", [])
        if len(masks) != 1 or masks[0].get("vocab") != 4096 or masks[0].get("tokens", 0) <= 0 \
                or masks[0].get("step_seconds", 0) <= 0 or "mean_fraction_of_step" not in masks[0]:
            failures.append(f"bench-engine --mask_tokenizers: want one row at vocab 4096 beside the step: {masks}")
        else:
            print(f"bench-engine masks: {masks[0]['mean_token_seconds'] * 1e3:.3f} ms/token at vocab 4096")
        paths = ["f32"] + [p for p, key in (("fp16", "fp16_fma"), ("bf16", "bf16_dot"), ("amx", "amx_bf16")) if peaks.get(key, 0) > 0]
        # Prefill alone: no decode batch, so no history is prepared for one
        # (a history prepared for no batch would run the pool dry).
        alone = run_json([pdctl, "bench-engine", "--model", model, "--decode_batch", ""] + small +
                         ["--decode_history", "2048"])
        if not alone.get("prefill") or alone.get("decode"):
            failures.append(f"bench-engine --decode_batch '': want prefill rows and no decode rows: {sorted(alone)}")
        for path in paths:
            r = run_json([pdctl, "bench-engine", "--model", model, "--decode_batch", "1,4", "--matrix_path", path]
                         + small)
            if r.get("matrix_path") != path:
                failures.append(f"bench-engine --matrix_path {path}: reports path {r.get('matrix_path')}")
            # BF16 dot attention on the bf16 path (BF16 KV, blocks of 16), F32 elsewhere.
            want_form = "bf16_dot" if path == "bf16" and r.get("kv") == "bf16" else "f32_fma"
            if r.get("attention_form") != want_form:
                failures.append(f"bench-engine --matrix_path {path}: attention_form {r.get('attention_form')}, "
                                f"want {want_form}")
            for row in r.get("prefill", []):
                if not (row["tokens_per_second"] > 0 and row["peak_flops"] > 0 and
                        close(row["fraction_of_peak"], row["flops_per_second"] / row["peak_flops"])):
                    failures.append(f"bench-engine {path}: prefill row without a figure or a peak: {row}")
                # The ceiling with the attention at its instruction's peak, from
                # the row's own FLOPs and the run's peaks.
                mp = r["matrix_peaks"]
                attn_peak = mp["bf16_dot"] if r.get("attention_form") == "bf16_dot" else mp["f32_fma"]
                attn, total = row["attention_flops"], row["flops"]
                best = total / (attn / attn_peak + (total - attn) / mp["fastest"]) / mp["fastest"]
                if not (0 < attn < total and 0 < best <= 1 + 1e-9 and
                        close(r["attention_peak_flops"], attn_peak) and
                        close(row["fraction_of_fastest_attention_at_its_peak"], best)):
                    failures.append(f"bench-engine {path}: prefill ceiling with the attention at its peak wrong: {row}")
            for row in r.get("decode", []):
                if not (row["tokens_per_second"] > 0 and row["read_bandwidth"] > 0 and
                        close(row["fraction_of_bandwidth"], row["bytes_per_second"] / row["read_bandwidth"]) and
                        row["limit_seconds"] >= row["bytes_per_step"] / row["read_bandwidth"] * (1 - 1e-9) and
                        row["flops_per_step"] > 0 and
                        close(row["step_over_limit"], row["step_seconds"] / row["limit_seconds"])):
                    failures.append(f"bench-engine {path}: decode row without a figure or a limit: {row}")
                # The phases in turn: never below the overlapped limit, never
                # above the two added; the ratio is the step over it.
                if not (row["limit_seconds"] * (1 - 1e-9) <= row["serial_limit_seconds"] <=
                        2 * row["limit_seconds"] * (1 + 1e-9) and
                        close(row["step_over_serial_limit"], row["step_seconds"] / row["serial_limit_seconds"])):
                    failures.append(f"bench-engine {path}: decode row's serial limit inconsistent: {row}")
            if not r.get("prefill") or not r.get("decode"):
                failures.append(f"bench-engine {path}: no prefill or decode rows: {sorted(r)}")
            print(f"bench-engine --matrix_path {path}: ok")

    for f in failures:
        print("FAIL:", f)
    print("bench-kv:", {k: kv.get(k) for k in ("handoff_gbps", "cross_process_copy_gbps", "ucx_perftest_am_gbps")})
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

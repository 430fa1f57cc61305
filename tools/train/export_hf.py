#!/usr/bin/python3
"""Write the Hugging Face model directory and the C++ test fixtures (pdserve).

  model.safetensors      BF16 weights (own writer), HF Llama tensor names
  config.json, generation_config.json, tokenizer.json, tokenizer_config.json
  reference/logits.json  full logits for 3 held-out 32-token sequences
  reference/heldout_ppl.json, reference/heldout_ids.txt
  loss_curve.png, README.md (from model_card_template.md)

All reference numbers come from model.py's forward in float32 on the weights
read back from model.safetensors (i.e. after BF16 rounding).
"""
import argparse
import collections
import json
import math
import os
import shutil
import subprocess
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import safetensors_io  # noqa: E402
from bpe import Tokenizer  # noqa: E402
from model import Config, LlamaLM  # noqa: E402
from train_model import token_stream  # noqa: E402

WINDOW = 256
N_HELDOUT = 4096
CASE_LEN = 32
CASE_OFFSETS = [0, 8192, 16384]
GREEDY_PROMPT = "In the beginning"
GREEDY_MAX = 32


def fmt(x):
    return float("%.7g" % x)


@torch.no_grad()
def greedy(model, tok, prompt, n_new=40, eos=(0, 2)):
    ids = tok.encode(prompt)
    for _ in range(n_new):
        logits = model(torch.tensor([ids[-512:]]))[0, -1]
        nxt = int(torch.argmax(logits))
        if nxt in eos:
            break
        ids.append(nxt)
    return tok.decode(ids)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=os.path.join(HERE, "work", "final.pt"))
    ap.add_argument("--workdir", default=os.path.join(HERE, "work"))
    ap.add_argument("--out", default=os.path.join(HERE, "..", "..", "deploy", "models", "kjv-tiny"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    out = os.path.abspath(args.out)
    wd = args.workdir
    os.makedirs(os.path.join(out, "reference"), exist_ok=True)

    ck = torch.load(args.ckpt, map_location="cpu")
    cfg = Config(**ck["config"])
    model = LlamaLM(cfg)
    model.load_state_dict(ck["model"])
    model.eval()

    # --- weights + configs + tokenizer
    sd = model.hf_state_dict()
    st_path = os.path.join(out, "model.safetensors")
    safetensors_io.write_bf16(st_path, sd, {"format": "pt"})
    back = safetensors_io.read(st_path)
    for k, v in sd.items():
        assert torch.equal(back[k], v.to(torch.bfloat16).float()), k
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "use_cache": True,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": None, "eos_token_id": [2, 0], "pad_token_id": 0, "do_sample": False}, f, indent=2)
        f.write("\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(wd, "tokenizer", name), os.path.join(out, name))

    # --- reference forward on BF16-rounded weights
    ref = LlamaLM(cfg)
    ref.load_hf_state_dict(back)
    ref.eval()
    tok = Tokenizer(os.path.join(out, "tokenizer.json"))
    held = token_stream(tok, os.path.join(wd, "heldout.txt"))
    train = token_stream(tok, os.path.join(wd, "train.txt"))

    cases = []
    with torch.no_grad():
        for o in CASE_OFFSETS:
            ids = held[o:o + CASE_LEN]
            logits = ref(torch.tensor([ids]))[0]
            cases.append({"token_ids": ids, "text": tok.decode(ids),
                          "logits": [[fmt(v) for v in row] for row in logits.tolist()]})
    with open(os.path.join(out, "reference", "logits.json"), "w") as f:
        json.dump({"model": "kjv-tiny", "note": "float32 forward on BF16-rounded weights of model.safetensors; "
                   "logits[p] predicts the token after token_ids[p]; 7 significant digits",
                   "cases": cases}, f, separators=(",", ":"))

    # Same windows as train_model.evaluate and tests/common/default_model_test.cc:
    # window w feeds ids[wL, (w+1)L) and predicts ids[wL+1, (w+1)L+1]; the file holds
    # N_HELDOUT + 1 ids so that N_HELDOUT tokens are predicted.
    ids = held[:N_HELDOUT + 1]
    nll_sum, n_scored = 0.0, 0
    scored = []
    with torch.no_grad():
        for w in range((len(ids) - 1) // WINDOW):
            x = torch.tensor([ids[w * WINDOW:(w + 1) * WINDOW + 1]])
            logits = ref(x[:, :-1])[0].float()
            nll_sum += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            n_scored += WINDOW
            scored.extend(ids[w * WINDOW + 1:(w + 1) * WINDOW + 1])
    mean_nll = nll_sum / n_scored
    counts = collections.Counter(train)
    V, N = cfg.vocab_size, len(train)
    uni_nll = -sum(math.log((counts.get(t, 0) + 1) / (N + V)) for t in scored) / len(scored)
    ppl = {
        "tokens": n_scored,
        "mean_nll": mean_nll,
        "perplexity": math.exp(mean_nll),
        "token_ids_file": "heldout_ids.txt",
        "num_ids": len(ids),
        "window": WINDOW,
        "method": "heldout_ids.txt holds the first %d ids of the tokenized held-out split; window w (0..%d) "
                  "is run fresh from position 0 on ids[w*%d, (w+1)*%d) and predicts ids[w*%d+1, (w+1)*%d+1], "
                  "so tokens = %d predicted tokens; mean_nll is in nats"
                  % (len(ids), (len(ids) - 1) // WINDOW - 1, WINDOW, WINDOW, WINDOW, WINDOW, n_scored),
        "unigram_perplexity": math.exp(uni_nll),
        "unigram_mean_nll": uni_nll,
        "unigram_method": "token frequencies of the tokenized training split (with <|endoftext|> between "
                          "chapters), add-one smoothing over the %d-token vocabulary, scored on the same "
                          "%d predicted tokens" % (V, n_scored),
        "ratio_ppl_to_unigram": math.exp(mean_nll) / math.exp(uni_nll),
    }
    with open(os.path.join(out, "reference", "heldout_ppl.json"), "w") as f:
        json.dump(ppl, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "reference", "heldout_ids.txt"), "w") as f:
        f.write(",".join(str(i) for i in ids) + "\n")
    print(json.dumps({k: v for k, v in ppl.items() if "method" not in k}, indent=1))

    # --- samples (PyTorch, greedy, BF16-rounded weights)
    samples = {}
    for p in ["In the beginning", "And the LORD said unto Moses", "Blessed are the",
              "The LORD is my shepherd", "For God so loved the world"]:
        samples[p] = greedy(ref, tok, p)
        print("SAMPLE %r -> %r" % (p, samples[p]))
    with open(os.path.join(wd, "samples.json"), "w") as f:
        json.dump(samples, f, indent=1)
    # reference/greedy.json: GREEDY_MAX tokens of argmax decoding (no stop on EOS), decoded
    # skipping special tokens, as tests/common/default_model_test.cc replays it.
    p_ids = tok.encode(GREEDY_PROMPT)
    seq, gen = list(p_ids), []
    with torch.no_grad():
        for _ in range(GREEDY_MAX):
            logits = ref(torch.tensor([seq]))[0, -1]
            top2 = torch.topk(logits, 2).values
            nxt = int(torch.argmax(logits))
            gen.append(nxt)
            seq.append(nxt)
            margin = float(top2[0] - top2[1])
            min_margin = margin if not gen[:-1] else min(min_margin, margin)
    text = tok.decode([i for i in gen if i not in tok.special.values()])
    with open(os.path.join(out, "reference", "greedy.json"), "w") as f:
        json.dump({"prompt": GREEDY_PROMPT, "max_tokens": GREEDY_MAX, "token_ids": gen, "text": text,
                   "min_top1_top2_logit_margin": min_margin,
                   "note": "PyTorch float32 forward on the BF16-rounded weights; argmax each step, "
                           "no stop at EOS; text skips special tokens"}, f, indent=2)
        f.write("\n")
    print("GREEDY %r -> %r (min top1-top2 margin %.4f)" % (GREEDY_PROMPT, text, min_margin))

    # --- loss curve + model card
    subprocess.run([sys.executable, os.path.join(HERE, "plot_loss.py"), "--workdir", wd,
                    "--out", os.path.join(out, "loss_curve.png")], check=False)
    if os.path.exists(os.path.join(wd, "summary.json")):
        subprocess.run([sys.executable, os.path.join(HERE, "write_model_card.py"), "--workdir", wd,
                        "--out", out], check=False)


if __name__ == "__main__":
    main()

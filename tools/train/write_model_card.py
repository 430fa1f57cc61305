#!/usr/bin/python3
"""Write deploy/models/kjv-tiny/README.md from the run's outputs (pdserve)."""
import argparse
import json
import os
import platform
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              check=False).stdout.decode().strip()
    except OSError:
        return ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=os.path.join(HERE, "work"))
    ap.add_argument("--out", default=os.path.join(HERE, "..", "..", "deploy", "models", "kjv-tiny"))
    args = ap.parse_args()
    wd, out = args.workdir, args.out
    summ = json.load(open(os.path.join(wd, "summary.json")))
    split = json.load(open(os.path.join(wd, "split.json")))
    ppl = json.load(open(os.path.join(out, "reference", "heldout_ppl.json")))
    cfg = json.load(open(os.path.join(out, "config.json")))
    tr = {}
    try:
        import torch
        tr = torch.load(os.path.join(wd, "final.pt"), map_location="cpu")["args"]
    except Exception:  # noqa: BLE001 - fall back to the documented defaults
        pass
    ver = sh("dpkg-query -W -f='${Version}' bible-kjv-text") or "unknown"
    ver_ui = sh("dpkg-query -W -f='${Version}' bible-kjv") or "unknown"
    cpu = sh("lscpu | sed -n 's/^Model name: *//p'") or platform.processor()
    ncpu = os.cpu_count()
    torch_ver = sh("/usr/bin/python3 -c 'import torch; print(torch.__version__)'")
    py_ver = platform.python_version()
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    minutes = summ["wall_s"] / 60.0

    card = f"""# kjv-tiny

A very small Llama-architecture language model trained from scratch on the
King James Version of the Bible. It is the default model that pdserve ships so
that the server, the tools and the tests have a real (if tiny) model to load
without downloading anything. It writes KJV-flavoured English; it knows
nothing else and is not an instruction-following or chat model (the chat
template exists only so that the chat endpoints have something to format
with).

| | |
|---|---|
| Architecture | `LlamaForCausalLM` (Hugging Face Llama layout) |
| Parameters | {summ['n_params']:,} (embeddings tied with the output layer) |
| Weights | `model.safetensors`, BF16, {size / 1e6:.1f} MB |
| Vocabulary | 4096 byte-level BPE tokens, trained on the same corpus |
| Context | 512 positions (trained on 256-token windows) |
| Held-out perplexity | **{ppl['perplexity']:.2f}** (unigram baseline {ppl['unigram_perplexity']:.1f}, ratio {ppl['ratio_ppl_to_unigram']:.3f}) |

## Corpus

* Source: the Debian package `bible-kjv-text` version {ver} (source package
  `bible-kjv`), file `/usr/lib/bible.data` (the whole KJV, Genesis 1:1 to
  Revelation 22:21, in the package's compressed "EC02" format). The file is
  read through the `bible` program of the companion package `bible-kjv`
  (version {ver_ui}): `bible -f gen1:1-rev22:21` with output to a pipe prints
  one verse per line. `/usr/lib/bible.data.conc` (the concordance) is not used.
* License, as stated in `/usr/share/doc/bible-kjv-text/copyright`:

  > The copyright for the King James Version text of the Bible is expired since
  > the  translation was done in 1611 under King James the first of Great
  > Britain.

  The same file carries this legend for the Bible Retrieval System data files
  and programs (Chip Chapin, 1989), which it asks to be kept with them:

  > This file is provided for unrestricted use provided that this
  > legend is included on all tape media and as a part of the
  > software program in whole or part.  Users may copy, modify or
  > distribute this file at will.
  > -- Chip Chapin, September 4, 1989

  and states that the later code work (Matthew Vernon, 2003-2018) and
  `randverse` (Oliver Elphick, 1997) are under the GPL, version 2 or later.
  No GPL code is part of this model; only the Bible text was used. (Outside
  the Debian file: in the United Kingdom the Authorized Version remains under
  Crown letters patent; elsewhere the text is in the public domain.)

## Preprocessing and split

`tools/train/prepare_corpus.py` strips the verse reference (`Ge1:1 `,
`1Cor13:4 `, ...) from each line and collapses runs of whitespace, so each line
is one verse of plain prose. There is no other markup in this source. Verses
are grouped into chapters ({split['chapters']} chapters, {split['verses']} verses).

Split (deterministic): chapters are numbered 0..{split['chapters'] - 1} in canonical order;
chapter *i* is held out when *i* mod 50 = 49. That holds out
{len(split['heldout_chapters'])} chapters ({split['heldout_verses']} verses, about 2%):
{', '.join(split['heldout_chapters'])}.
The other {split['train_chapters']} chapters ({split['train_verses']} verses) are the training split.

Each chapter is one document: its verses, each followed by `\\n`. For the model,
documents are tokenized and joined with `<|endoftext|>` (id 0) after each one:
{summ['train_tokens']:,} training tokens and {summ['heldout_tokens']:,} held-out tokens.

## Tokenizer

`tools/train/train_bpe.py` (our own trainer) learns a byte-level BPE on the
training split: GPT-2 byte-to-unicode alphabet, GPT-2 pre-tokenizer regex
`'s|'t|'re|'ve|'m|'ll|'d| ?\\p{{L}}+| ?\\p{{N}}+| ?[^\\s\\p{{L}}\\p{{N}}]+|\\s+(?!\\S)|\\s+`,
pre-token frequencies, then 3837 greedy merges of the most frequent adjacent
pair (ties broken by the smaller pair of strings). Ids: 0 `<|endoftext|>`,
1 `<|im_start|>`, 2 `<|im_end|>` (special tokens), 3..258 the 256 bytes,
259..4095 the merges. `tokenizer.json` is in the Hugging Face `tokenizers`
format (Split + ByteLevel pre-tokenizer, ByteLevel decoder, no normalizer and
no post-processor, so no BOS is added). `tokenizer_config.json` sets
`eos_token` `<|im_end|>`, `pad_token` `<|endoftext|>`, no BOS, a ChatML chat
template, `model_max_length` 512. The held-out text averages about 4 bytes per token.

`tools/train/check_tokenizer.py` checks that decode(encode(x)) == x on the
held-out text and that the Hugging Face `tokenizers` npm package (from
`tests/fixtures/tokenizers`) gives the same ids as our encoder.

## Architecture

`tools/train/model.py` implements the Hugging Face Llama forward: RMSNorm
(float32, eps {cfg['rms_norm_eps']}), rotary position embeddings (rotate-half
pairing, theta {cfg['rope_theta']:g}), grouped-query attention, SwiGLU MLP, no
biases, tied embeddings, final norm.

| hidden | layers | heads | KV heads | head dim | FFN | vocab | max positions |
|---|---|---|---|---|---|---|---|
| {cfg['hidden_size']} | {cfg['num_hidden_layers']} | {cfg['num_attention_heads']} | {cfg['num_key_value_heads']} | {cfg['head_dim']} | {cfg['intermediate_size']} | {cfg['vocab_size']} | {cfg['max_position_embeddings']} |

Parameters: {summ['n_params']:,} (embedding {cfg['vocab_size'] * cfg['hidden_size']:,}, shared with the output projection).

## Training

`tools/train/train_model.py`: AdamW (beta 0.9/0.95, weight decay
{tr.get('weight_decay', 0.1)} on matrices only), peak learning rate
{tr.get('lr', 2e-3)}, {tr.get('warmup', 40)} warm-up steps, cosine decay to
{tr.get('min_lr_frac', 0.05)} of the peak, gradient clipping
{tr.get('clip', 1.0)}, batch {tr.get('batch', 8)} x {tr.get('seq_len', 256)} tokens,
float32, seed {tr.get('seed', 1234)}. The training stream is cut into
non-overlapping 257-token windows visited in a seeded random order per epoch.
The cosine schedule runs over the wall-clock budget (`--max-minutes`) rather
than a fixed step count, so the run always finishes; the learning rate of
every step is logged in `tools/train/work/loss.csv`, and `--steps N` gives a
step-based schedule for an exactly repeatable run.

* Steps: {summ['steps']:,}; tokens seen: {summ['tokens_seen']:,} ({summ['epochs']:.2f} epochs)
* Wall time: {minutes:.1f} minutes including data preparation and evaluation
* Machine: {ncpu} vCPU ({cpu}), CPU only, `torch.set_num_threads(2)`;
  Debian Python {py_ver}, PyTorch {torch_ver}. Other jobs (C++ builds) shared the
  CPUs at times, so the step count of a time-budgeted rerun will differ.

![loss curve](loss_curve.png)

## Evaluation

Held-out perplexity uses the first {ppl['num_ids']} ids of the tokenized
held-out split (`reference/heldout_ids.txt`), cut into
{ppl['tokens'] // ppl['window']} windows of {ppl['window']} tokens, each run
from position 0 with no carried-over context; every position predicts the
next id, {ppl['tokens']} predictions in all. The numbers come from a float32
forward over the BF16 weights exactly as stored in `model.safetensors`.

| model | mean NLL (nats) | perplexity |
|---|---|---|
| kjv-tiny | {ppl['mean_nll']:.4f} | **{ppl['perplexity']:.2f}** |
| unigram baseline (training-split token frequencies, add-one) | {ppl['unigram_mean_nll']:.4f} | {ppl['unigram_perplexity']:.2f} |

The quality bar for the shipped model is perplexity at most 1/5 of the unigram
baseline, i.e. at most {ppl['unigram_perplexity'] / 5:.1f}; kjv-tiny's ratio is
{ppl['ratio_ppl_to_unigram']:.3f}. Over the whole held-out split
({(summ['heldout_tokens'] - 1) // 256} windows, {(summ['heldout_tokens'] - 1) // 256 * 256:,} predictions, float32
weights before BF16 rounding) the final perplexity was {summ['final_heldout_ppl']:.2f}.

`reference/` holds fixtures for the C++ tests, all from that same forward:
`logits.json` (all 4096 logits at every position of three 32-token held-out
sequences, 7 significant digits), `heldout_ppl.json` + `heldout_ids.txt`, and
`greedy.json` (32 greedy tokens after the prompt "In the beginning").

## Samples

<!-- SAMPLES: to be filled in with text generated by the pdserve engine. -->

_Samples generated by the pdserve engine will be added here._

## Reproducing

```sh
apt-get install -y bible-kjv bible-kjv-text python3-regex python3-matplotlib   # Debian 12
cd tools/train
/usr/bin/python3 prepare_corpus.py     # work/train.txt, work/heldout.txt, work/split.json
/usr/bin/python3 train_bpe.py          # work/tokenizer/tokenizer.json, tokenizer_config.json
/usr/bin/python3 check_tokenizer.py    # round trip + npm tokenizers comparison
nohup /usr/bin/python3 {summ['command'].split('/')[-1]} > work/train.log 2>&1 &
# train_model.py runs export_hf.py at the end; to redo only the export:
/usr/bin/python3 export_hf.py --ckpt work/final.pt   # this directory, reference/, loss_curve.png
/usr/bin/python3 write_model_card.py   # this README
```

Everything is seeded (initialisation, data order). The corpus, split and
tokenizer are byte-for-byte reproducible. The model from a `--max-minutes` run
is not: its learning-rate schedule follows the wall clock, so the step count
and the per-step learning rates depend on machine speed and load (this run's
are in `tools/train/work/loss.csv`). For a deterministic run, fix the
schedule with `--steps N` (e.g. `--steps {summ['steps']}`, this run's step count;
the result is close to, but not bit-identical with, the shipped weights).
"""
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(card)
    print("wrote %s" % os.path.join(out, "README.md"))


if __name__ == "__main__":
    main()

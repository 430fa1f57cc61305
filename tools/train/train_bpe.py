#!/usr/bin/python3
"""Train a byte-level BPE tokenizer (written for pdserve) and write HF files.

Vocabulary layout: ids 0..2 are the special tokens, ids 3..258 the 256 byte
tokens in byte order, then one token per merge in merge order.

Merge selection: the pair with the highest count (summed over pre-token
frequencies); ties are broken by the smaller (left, right) pair of byte-level
unicode strings (Python string comparison), so training is deterministic.
"""
import argparse
import collections
import heapq
import json
import os
import time

from bpe import PRETOKENIZE_PATTERN, SPECIAL_TOKENS, BYTE_TO_CHAR, pretokenize, read_docs, to_symbols

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train(word_freq, vocab_size):
    n_special = len(SPECIAL_TOKENS)
    n_merges = vocab_size - n_special - 256
    tokens = [BYTE_TO_CHAR[b] for b in range(256)]  # symbol id -> string
    char_id = {c: i for i, c in enumerate(tokens)}

    words = []
    freqs = []
    for w, f in sorted(word_freq.items()):
        words.append([char_id[c] for c in to_symbols(w)])
        freqs.append(f)

    pair_count = collections.defaultdict(int)
    pair_where = collections.defaultdict(set)
    for wi, (w, f) in enumerate(zip(words, freqs)):
        for a, b in zip(w, w[1:]):
            pair_count[(a, b)] += f
            pair_where[(a, b)].add(wi)

    heap = [(-c, tokens[a], tokens[b], a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    merges = []
    while len(merges) < n_merges and heap:
        negc, _, _, a, b = heapq.heappop(heap)
        cur = pair_count.get((a, b), 0)
        if cur <= 0 or -negc != cur:
            continue  # stale entry
        new_id = len(tokens)
        tokens.append(tokens[a] + tokens[b])
        merges.append((a, b))
        touched = set()
        for wi in sorted(pair_where.pop((a, b))):
            w, f = words[wi], freqs[wi]
            for p in zip(w, w[1:]):
                pair_count[p] -= f
                touched.add(p)
            out = []
            i = 0
            while i < len(w):
                if i < len(w) - 1 and w[i] == a and w[i + 1] == b:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[wi] = out
            for p in zip(out, out[1:]):
                pair_count[p] += f
                pair_where[p].add(wi)
                touched.add(p)
        pair_count.pop((a, b), None)
        for p in touched:
            c = pair_count.get(p, 0)
            if c > 0 and p != (a, b):
                heapq.heappush(heap, (-c, tokens[p[0]], tokens[p[1]], p[0], p[1]))
            elif c <= 0:
                pair_count.pop(p, None)
    return tokens, merges


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--train", default=os.path.join(here, "work", "train.txt"))
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--out", default=os.path.join(here, "work", "tokenizer"))
    ap.add_argument("--max-length", type=int, default=512)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    t0 = time.time()
    word_freq = collections.Counter()
    for doc in read_docs(args.train):
        word_freq.update(pretokenize(doc))
    print("distinct pre-tokens: %d" % len(word_freq))
    tokens, merges = train(word_freq, args.vocab_size)
    print("merges: %d  (%.1fs)" % (len(merges), time.time() - t0))

    n_special = len(SPECIAL_TOKENS)
    # The special tokens are also listed in model.vocab (ids 0..2) so that HF
    # tokenizers does not assign them fresh ids past the end of the vocabulary.
    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    for i, s in enumerate(tokens):
        vocab[s] = i + n_special
    assert len(vocab) == len(tokens) + n_special, "duplicate token string"
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, s in enumerate(SPECIAL_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PRETOKENIZE_PATTERN},
                 "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                 "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab,
            "merges": [[tokens[a], tokens[b]] for a, b in merges],
        },
    }
    with open(os.path.join(args.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, indent=None, separators=(",", ":"))
    cfg = {
        "added_tokens_decoder": {
            str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, s in enumerate(SPECIAL_TOKENS)
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": args.max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    print("wrote %s" % args.out)


if __name__ == "__main__":
    main()

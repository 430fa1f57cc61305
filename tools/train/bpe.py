"""Byte-level BPE helpers shared by the pdserve training scripts.

Written for pdserve: the GPT-2 style byte-to-unicode table, the pre-tokenizer
regex, and a small encoder/decoder that reads the tokenizer.json we write.
"""
import json

import regex

PRETOKENIZE_PATTERN = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
                       r"|\s+(?!\S)|\s+")
PRETOKENIZE_RE = regex.compile(PRETOKENIZE_PATTERN)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_alphabet():
    """Map each byte 0..255 to a printable unicode character (GPT-2 scheme).

    Printable latin-1 bytes map to themselves; the remaining 68 bytes map, in
    increasing byte order, to code points 256, 257, ...
    """
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    table = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def to_symbols(text):
    """Text -> byte-level unicode string."""
    return "".join(BYTE_TO_CHAR[b] for b in text.encode("utf-8"))


def pretokenize(text):
    return PRETOKENIZE_RE.findall(text)


class Tokenizer:
    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            tj = json.load(f)
        model = tj["model"]
        self.vocab = dict(model["vocab"])
        for t in tj["added_tokens"]:
            self.vocab[t["content"]] = t["id"]
        self.inv = {i: s for s, i in self.vocab.items()}
        self.ranks = {(a, b): r for r, (a, b) in enumerate(model["merges"])}
        self.special = {t["content"]: t["id"] for t in tj["added_tokens"]}
        self.special_re = regex.compile("(" + "|".join(regex.escape(s) for s in self.special) + ")")
        self.cache = {}

    def _bpe(self, word):
        syms = list(word)
        while len(syms) > 1:
            best = None
            best_rank = None
            for i in range(len(syms) - 1):
                r = self.ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best_rank, best = r, (syms[i], syms[i + 1])
            if best is None:
                break
            out = []
            i = 0
            while i < len(syms):
                if i < len(syms) - 1 and syms[i] == best[0] and syms[i + 1] == best[1]:
                    out.append(syms[i] + syms[i + 1])
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            syms = out
        return syms

    def encode_plain(self, text):
        ids = []
        for piece in pretokenize(text):
            got = self.cache.get(piece)
            if got is None:
                got = [self.vocab[s] for s in self._bpe(to_symbols(piece))]
                self.cache[piece] = got
            ids.extend(got)
        return ids

    def encode(self, text):
        """Encode text; special-token strings become their ids."""
        ids = []
        for part in self.special_re.split(text):
            if not part:
                continue
            if part in self.special:
                ids.append(self.special[part])
            else:
                ids.extend(self.encode_plain(part))
        return ids

    def decode(self, ids):
        out = bytearray()
        for i in ids:
            s = self.inv[i]
            if s in self.special:
                out.extend(s.encode("utf-8"))
            else:
                out.extend(CHAR_TO_BYTE[c] for c in s)
        return out.decode("utf-8", errors="replace")


def read_docs(path):
    """Chapters: blocks of lines separated by a blank line; doc text keeps the newlines."""
    docs, cur = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line:
                cur.append(line + "\n")
            elif cur:
                docs.append("".join(cur))
                cur = []
    if cur:
        docs.append("".join(cur))
    return docs

#!/usr/bin/python3
"""Check the trained tokenizer: round-trip on held-out text, and (optionally)
compare ids with the Hugging Face `tokenizers` npm package via node."""
import argparse
import json
import os
import subprocess
import sys

from bpe import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
NODE_SCRIPT = r"""
const path = require('path');
const fs = require('fs');
const tk = require(process.argv[2]);
const Tok = tk.Tokenizer;
const t = Tok.fromFile(process.argv[3]);
const lines = JSON.parse(fs.readFileSync(process.argv[4], 'utf8'));
(async () => {
  const out = [];
  for (const l of lines) {
    const e = await t.encode(l, null, {addSpecialTokens: false});
    out.push(e.getIds());
  }
  process.stdout.write(JSON.stringify(out));
})();
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=os.path.join(HERE, "work", "tokenizer", "tokenizer.json"))
    ap.add_argument("--heldout", default=os.path.join(HERE, "work", "heldout.txt"))
    ap.add_argument("--node-lines", type=int, default=300)
    ap.add_argument("--npm-tokenizers", default=os.path.join(
        HERE, "..", "..", "tests", "fixtures", "tokenizers", "node_modules", "tokenizers"))
    args = ap.parse_args()

    tok = Tokenizer(args.tokenizer)
    text = open(args.heldout, encoding="utf-8").read()
    ids = tok.encode(text)
    assert tok.decode(ids) == text, "round trip failed on whole held-out file"
    lines = [l for l in text.split("\n") if l]
    bad = sum(1 for l in lines if tok.decode(tok.encode(l)) != l)
    print("held-out: %d bytes -> %d tokens (%.2f bytes/token); per-line round-trip failures: %d/%d"
          % (len(text.encode()), len(ids), len(text.encode()) / len(ids), bad, len(lines)))
    extra = ["Hello, world!  Multiple   spaces\tand tabs\n\nnewlines",
             "<|im_start|>user\nIn the beginning<|im_end|>\n<|im_start|>assistant\n",
             "unicode: café — naïve ✓ 日本語 🙂", "numbers 12345 and 3:16", "It's they'll we've I'm you'd"]
    for e in extra:
        assert tok.decode(tok.encode(e)) == e, e
    print("extra round-trips ok")
    if bad:
        sys.exit(1)

    npm = os.path.abspath(args.npm_tokenizers)
    if not os.path.isdir(npm):
        print("npm tokenizers not found at %s; node check skipped" % npm)
        return
    sample = lines[:args.node_lines] + extra
    # also multi-line chunks with newlines
    sample += ["\n".join(lines[i:i + 3]) + "\n" for i in range(0, 60, 3)]
    work = os.path.join(HERE, "work")
    with open(os.path.join(work, "node_lines.json"), "w") as f:
        json.dump(sample, f)
    with open(os.path.join(work, "node_check.js"), "w") as f:
        f.write(NODE_SCRIPT)
    res = subprocess.run(["node", os.path.join(work, "node_check.js"), npm, os.path.abspath(args.tokenizer),
                          os.path.join(work, "node_lines.json")], stdout=subprocess.PIPE, check=True)
    node_ids = json.loads(res.stdout)
    mism = [i for i, (s, n) in enumerate(zip(sample, node_ids)) if tok.encode(s) != n]
    print("node tokenizers check: %d/%d strings identical" % (len(sample) - len(mism), len(sample)))
    for i in mism[:5]:
        print("  MISMATCH %r\n   py  %s\n   node %s" % (sample[i], tok.encode(sample[i]), node_ids[i]))
    if mism:
        sys.exit(1)


if __name__ == "__main__":
    main()

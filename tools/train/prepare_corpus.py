#!/usr/bin/python3
"""Turn the Debian `bible-kjv-text` package into a plain-text training corpus.

The package ships the King James Version as a compressed database
(/usr/lib/bible.data, format "EC02"), readable through the `bible` program of
the companion package `bible-kjv`.  With its output going to a pipe, `bible -f`
prints one verse per line, prefixed by a reference such as "Ge1:1 " or
"1Cor13:4 ".  We strip that prefix so each line reads as prose.

Output (in --out, default tools/train/work/):
  train.txt    one verse per line; a blank line ends every chapter
  heldout.txt  same format
  split.json   which chapters were held out, and counts

Split rule (deterministic): number the 1189 chapters 0..1188 in canonical order
(Genesis 1 first); chapter i is held out when i % 50 == 49 (23 chapters, ~2%).
"""
import argparse
import json
import os
import re
import subprocess

REF = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def read_verses():
    out = subprocess.run(["bible", "-f", "gen1:1-rev22:21"], cwd="/tmp",
                         check=True, stdout=subprocess.PIPE).stdout
    text = out.decode("ascii")
    verses = []
    for line in text.split("\n"):
        line = line.rstrip()
        if not line:
            continue
        m = REF.match(line)
        if not m:
            raise SystemExit("unexpected line: %r" % line)
        book, chap, verse, body = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        body = " ".join(body.split())
        verses.append((book, chap, verse, body))
    return verses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "work"))
    ap.add_argument("--every", type=int, default=50)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    verses = read_verses()
    chapters = []  # list of (book, chap, [verse texts])
    for book, chap, _, body in verses:
        if not chapters or chapters[-1][0] != book or chapters[-1][1] != chap:
            chapters.append((book, chap, []))
        chapters[-1][2].append(body)

    held, train = [], []
    held_names = []
    for i, (book, chap, vs) in enumerate(chapters):
        if i % args.every == args.every - 1:
            held.append(vs)
            held_names.append("%s %d" % (book, chap))
        else:
            train.append(vs)

    def write(path, chs):
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for vs in chs:
                for v in vs:
                    f.write(v + "\n")
                f.write("\n")

    write(os.path.join(args.out, "train.txt"), train)
    write(os.path.join(args.out, "heldout.txt"), held)
    info = {
        "source": "bible -f gen1:1-rev22:21 (Debian bible-kjv / bible-kjv-text)",
        "verses": len(verses), "chapters": len(chapters),
        "rule": "chapter index i (0-based, canonical order) held out iff i %% %d == %d" % (args.every, args.every - 1),
        "heldout_chapters": held_names,
        "train_chapters": len(train),
        "train_verses": sum(len(c) for c in train),
        "heldout_verses": sum(len(c) for c in held),
    }
    with open(os.path.join(args.out, "split.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps({k: v for k, v in info.items() if k != "heldout_chapters"}))
    print("held out:", ", ".join(held_names))


if __name__ == "__main__":
    main()

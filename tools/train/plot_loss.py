#!/usr/bin/python3
"""Plot training loss (loss.csv) and periodic held-out loss (eval.csv)."""
import argparse
import csv
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "work"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tr = read(os.path.join(args.workdir, "loss.csv"))
    ev = read(os.path.join(args.workdir, "eval.csv"))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    ax.plot([int(r["step"]) for r in tr], [float(r["train_loss"]) for r in tr], lw=1.2,
            label="training loss (mean over 10 steps)")
    ax.plot([int(r["step"]) for r in ev], [float(r["heldout_nll"]) for r in ev], "o-", lw=1.5,
            label="held-out loss (23 chapters)")
    ax.set_xlabel("optimizer step (8 x 256 tokens)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("kjv-tiny training")
    ax.set_ylim(bottom=max(0.0, min(float(r["heldout_nll"]) for r in ev) - 1.0))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out)
    print("wrote %s" % args.out)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Train the kjv-tiny Llama model on CPU within a wall-clock budget (pdserve).

Data: work/train.txt / work/heldout.txt from prepare_corpus.py, tokenized with
the tokenizer from train_bpe.py.  Every chapter becomes a document
`encode(text) + [<|endoftext|>]`; documents are concatenated into one stream,
cut into non-overlapping windows of seq_len+1 tokens (stride seq_len), and
the windows are visited in a seeded random order each epoch.

LR schedule: linear warmup, then cosine decay to min_lr.  Progress is
step/--steps when --steps is given (fully reproducible), otherwise the
fraction of the --max-minutes training budget used so far, so that the run
always ends, fully decayed, inside the budget.  The lr used at every step is
logged in the CSV.

Outputs (in --workdir): loss.csv (step, tokens, lr, train loss, elapsed),
eval.csv (step, held-out nll/ppl), ckpt.pt (rolling checkpoint), final.pt.
At the end export_hf.py is run to write the Hugging Face directory.
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bpe import Tokenizer, read_docs  # noqa: E402
from model import Config, LlamaLM  # noqa: E402


def token_stream(tok, path, eot=0):
    ids = []
    for d in read_docs(path):
        ids.extend(tok.encode_plain(d))
        ids.append(eot)
    return ids


@torch.no_grad()
def evaluate(model, ids, seq_len, batch=8):
    """Mean next-token NLL over the stream cut into fresh windows of seq_len tokens."""
    model.eval()
    t = torch.tensor(ids, dtype=torch.long)
    n_win = (len(ids) - 1) // seq_len
    tot, cnt = 0.0, 0
    for s in range(0, n_win, batch):
        xs = [t[i * seq_len:(i + 1) * seq_len + 1] for i in range(s, min(n_win, s + batch))]
        x = torch.stack(xs)
        logits = model(x[:, :-1])
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1), reduction="sum")
        tot += nll.item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / cnt, cnt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=os.path.join(HERE, "work"))
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--max-minutes", type=float, default=45.0)
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (0: use the time budget)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-minutes", type=float, default=5.0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--export", default=os.path.join(HERE, "..", "..", "deploy", "models", "kjv-tiny"))
    ap.add_argument("--no-export", action="store_true")
    args = ap.parse_args()

    t_start = time.time()
    budget_s = args.max_minutes * 60.0
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    wd = args.workdir
    tok_path = args.tokenizer or os.path.join(wd, "tokenizer", "tokenizer.json")
    tok = Tokenizer(tok_path)
    train_ids = token_stream(tok, os.path.join(wd, "train.txt"))
    held_ids = token_stream(tok, os.path.join(wd, "heldout.txt"))
    print("train tokens %d, held-out tokens %d (%.1fs)" % (len(train_ids), len(held_ids), time.time() - t_start),
          flush=True)

    L = args.seq_len
    data = torch.tensor(train_ids, dtype=torch.long)
    n_win = (len(train_ids) - 1) // L
    windows = torch.stack([data[i * L:(i + 1) * L + 1] for i in range(n_win)])
    gen = torch.Generator().manual_seed(args.seed)

    cfg = Config(vocab_size=len(tok.inv), hidden_size=args.hidden, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                 intermediate_size=args.ffn, max_position_embeddings=512)
    model = LlamaLM(cfg)
    n_params = model.num_params()
    print("params %d" % n_params, flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    # reserve time for final eval + checkpoint + export
    train_budget = budget_s - (time.time() - t_start) - 90.0
    t_train0 = time.time()

    def progress(step):
        if args.steps:
            return step / args.steps
        return (time.time() - t_train0) / train_budget

    def lr_at(step, prog):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        p = min(1.0, max(0.0, prog))
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))

    loss_f = open(os.path.join(wd, "loss.csv"), "w", newline="")
    loss_w = csv.writer(loss_f)
    loss_w.writerow(["step", "tokens", "lr", "train_loss", "elapsed_s"])
    eval_f = open(os.path.join(wd, "eval.csv"), "w", newline="")
    eval_w = csv.writer(eval_f)
    eval_w.writerow(["step", "tokens", "heldout_nll", "heldout_ppl", "elapsed_s"])

    def do_eval(step, tokens):
        nll, cnt = evaluate(model, held_ids, L)
        eval_w.writerow([step, tokens, "%.5f" % nll, "%.3f" % math.exp(nll), "%.1f" % (time.time() - t_start)])
        eval_f.flush()
        print("eval step %d: held-out nll %.4f ppl %.2f (%d tokens)" % (step, nll, math.exp(nll), cnt), flush=True)
        return nll

    def save(path, step, tokens, extra=None):
        state = {"config": cfg.to_dict(), "model": model.state_dict(), "optimizer": opt.state_dict(),
                 "step": step, "tokens": tokens, "args": vars(args), "n_params": n_params}
        if extra:
            state.update(extra)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)

    step, tokens, epoch = 0, 0, 0
    order = torch.randperm(n_win, generator=gen)
    pos = 0
    run_loss, run_n = 0.0, 0
    last_eval = time.time()
    do_eval(0, 0)
    model.train()
    while True:
        prog = progress(step)
        if (args.steps and step >= args.steps) or (not args.steps and prog >= 1.0):
            break
        if pos + args.batch > n_win:
            epoch += 1
            order = torch.randperm(n_win, generator=gen)
            pos = 0
        x = windows[order[pos:pos + args.batch]]
        pos += args.batch
        lr = lr_at(step, prog)
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        tokens += x[:, 1:].numel()
        run_loss += loss.item()
        run_n += 1
        if step % args.log_every == 0:
            el = time.time() - t_start
            loss_w.writerow([step, tokens, "%.6g" % lr, "%.5f" % (run_loss / run_n), "%.1f" % el])
            loss_f.flush()
            print("step %d tok %d epoch %d lr %.3g loss %.4f  %.0fs  %.0f tok/s" % (
                step, tokens, epoch, lr, run_loss / run_n, el, tokens / (time.time() - t_train0)), flush=True)
            run_loss, run_n = 0.0, 0
        if time.time() - last_eval > args.eval_minutes * 60:
            do_eval(step, tokens)
            save(os.path.join(wd, "ckpt.pt"), step, tokens)
            last_eval = time.time()

    nll = do_eval(step, tokens)
    wall = time.time() - t_start
    summary = {"steps": step, "tokens_seen": tokens, "epochs": tokens / len(train_ids),
               "train_tokens": len(train_ids), "heldout_tokens": len(held_ids), "n_params": n_params,
               "final_heldout_nll": nll, "final_heldout_ppl": math.exp(nll), "wall_s": wall,
               "train_s": time.time() - t_train0, "command": " ".join(sys.argv)}
    save(os.path.join(wd, "final.pt"), step, tokens, {"summary": summary})
    with open(os.path.join(wd, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary), flush=True)
    loss_f.close()
    eval_f.close()
    if not args.no_export:
        r = subprocess.run([sys.executable, os.path.join(HERE, "export_hf.py"),
                            "--ckpt", os.path.join(wd, "final.pt"), "--out", args.export])
        print("export exit code %d" % r.returncode, flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The multi-host recipe of docs/operations.md ("Several plain hosts,
without Kubernetes"), run exactly as written.

The manual's recipe is a sequence of fenced ```sh blocks, each preceded by
an HTML comment `<!-- recipe: HOST -->`. This test:

- reads the `env` block for the names of the variables the recipe uses and
  gives each one its own value (the hosts' addresses, a folder of the built
  binaries, the shipped model, temporary folders); that is the only
  substitution, and a variable the test has no value for fails it;
- makes one network namespace per host (router, prefill, decode, and a
  client), each with a veth to a bridge in a namespace of its own, on
  10.203.0.0/24;
- runs every other block, in the manual's order, with
  `ip netns exec NS bash -euo pipefail -c BLOCK` in its host's namespace
  (the `ca` block in the test's own namespace: it needs no network);
- checks what the client block printed: the router's status, a generation
  through pdctl, and an OpenAI completion streamed as server-sent events
  with text in several chunks; then that the handoff crossed the network
  (the decode worker's committed transfers, scraped from its metrics port
  from the client host) and that the recipe's firewall is in force (the
  client cannot reach the decode worker's KV port).

Every process started in the namespaces is ended (SIGTERM, then SIGKILL)
and every namespace deleted, also on failure.

    plain_hosts.py REPO_DIR BUILD_DIR [--doc FILE] [--keep]

--doc runs the recipe of another copy of the manual (to see the test fail
on a broken one). Exit 77 (skipped) without root, `ip netns`, nft, openssl
or curl.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SUBNET = "10.203.0"
HOSTS = {"router": 10, "prefill": 11, "decode": 12, "client": 20}
BLOCK_TIMEOUT_S = 90
SKIP = 77


def log(*args):
    print(time.strftime("%H:%M:%S"), *args, flush=True)


def sh(cmd, check=True, timeout=30):
    r = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{cmd}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def parse_recipe(text):
    """[(host, block)] in the manual's order: each `<!-- recipe: HOST -->`
    marker and the ```sh block right after it."""
    steps = []
    for m in re.finditer(r"<!--\s*recipe:\s*([a-z]+)\s*-->", text):
        rest = text[m.end():]
        b = re.match(r"\s*\n```sh\n(.*?)\n```", rest, re.S)
        if not b:
            raise ValueError(f"marker '{m.group(0)}' is not followed by a ```sh block")
        steps.append((m.group(1), b.group(1)))
    if not steps:
        raise ValueError("no <!-- recipe: HOST --> markers")
    return steps


def env_names(block):
    """The variables the env block assigns (NAME=..., one per line)."""
    names = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=", line)
        if not m:
            raise ValueError(f"env block: not an assignment: {line!r}")
        names.append(m.group(1))
    return names


class Hosts:
    """The namespaces standing in for the hosts, on one bridge."""

    def __init__(self):
        self.prefix = f"pdh{os.getpid()}"
        self.net = f"{self.prefix}-net"
        self.made = []

    def ns(self, host):
        return f"{self.prefix}-{host}"

    def ip(self, host):
        return f"{SUBNET}.{HOSTS[host]}"

    def up(self):
        sh(f"ip netns add {self.net}")
        self.made.append(self.net)
        sh(f"ip -n {self.net} link set lo up && ip -n {self.net} link add br0 type bridge && "
           f"ip -n {self.net} link set br0 up")
        for i, host in enumerate(HOSTS):
            ns = self.ns(host)
            sh(f"ip netns add {ns}")
            self.made.append(ns)
            veth = f"ph{os.getpid() % 100000}x{i}"
            sh(f"ip -n {ns} link set lo up && "
               f"ip -n {self.net} link add {veth} type veth peer name eth0 netns {ns} && "
               f"ip -n {self.net} link set {veth} master br0 up && "
               f"ip -n {ns} addr add {self.ip(host)}/24 dev eth0 && ip -n {ns} link set eth0 up")

    def teardown(self):
        """SIGTERM to every process in the host namespaces, SIGKILL to what
        is left after 5 s, then the namespaces deleted."""
        def pids():
            out = []
            for ns in self.made:
                r = sh(["ip", "netns", "pids", ns], check=False)
                out += [int(p) for p in r.stdout.split()]
            return [p for p in out if p != os.getpid()]

        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            left = pids()
            for p in left:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = pids()
            if not left:
                break
        for ns in reversed(self.made):
            sh(["ip", "netns", "del", ns], check=False)
        self.made = []


def sse_text_chunks(out):
    """The texts of the OpenAI completion chunks in `out`, and whether the
    stream ended with [DONE]."""
    texts, done = [], False
    for line in out.splitlines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        for c in chunk.get("choices", []):
            if c.get("text"):
                texts.append(c["text"])
    return texts, done


def can_connect(hosts, src, ip, port):
    code = (f"import socket; s=socket.socket(); s.settimeout(1.5); "
            f"print(s.connect_ex(({ip!r}, {port})) == 0)")
    r = sh(["ip", "netns", "exec", hosts.ns(src), sys.executable, "-c", code], check=False)
    return r.stdout.strip() == "True"


def main():
    args = sys.argv[1:]
    keep = "--keep" in args
    args = [a for a in args if a != "--keep"]
    doc = None
    if "--doc" in args:
        i = args.index("--doc")
        doc = args[i + 1]
        del args[i:i + 2]
    if len(args) != 2:
        print(__doc__)
        return 2
    repo, build = (os.path.abspath(a) for a in args)
    doc = doc or os.path.join(repo, "docs/operations.md")

    if os.geteuid() != 0:
        print("SKIP: needs root (network namespaces and nftables)")
        return SKIP
    for tool in ("ip", "nft", "openssl", "curl"):
        if shutil.which(tool) is None:
            print(f"SKIP: {tool} is not installed")
            return SKIP
    probe = f"pdh{os.getpid()}-probe"
    if sh(["ip", "netns", "add", probe], check=False).returncode != 0:
        print("SKIP: cannot make network namespaces (ip netns add failed)")
        return SKIP
    sh(["ip", "netns", "del", probe], check=False)

    steps = parse_recipe(open(doc).read())
    env_blocks = [b for h, b in steps if h == "env"]
    if len(env_blocks) != 1:
        raise SystemExit(f"FAIL: {len(env_blocks)} env blocks in {doc} (expected 1)")
    unknown_hosts = {h for h, _ in steps} - set(HOSTS) - {"env", "ca"}
    if unknown_hosts:
        raise SystemExit(f"FAIL: recipe blocks for hosts the test does not know: {sorted(unknown_hosts)}")

    tmp = tempfile.mkdtemp(prefix="pdserve-plain-hosts-")
    os.chmod(tmp, 0o755)
    bindir = os.path.join(tmp, "bin")
    os.makedirs(bindir)
    for rel in ("router/pdserve-router", "prefill_worker/pdserve-prefill-worker",
                "decode_worker/pdserve-decode-worker", "tools/pdctl/pdctl"):
        src = os.path.join(build, rel)
        if not os.access(src, os.X_OK):
            raise SystemExit(f"FAIL: {src} is not built")
        os.symlink(src, os.path.join(bindir, os.path.basename(rel)))
    hosts = Hosts()
    values = {
        "ROUTER_HOST": hosts.ip("router"), "PREFILL_HOST": hosts.ip("prefill"), "DECODE_HOST": hosts.ip("decode"),
        "ADMIN_NET": f"{SUBNET}.0/24", "PDSERVE_BIN": bindir,
        "MODEL": os.path.join(repo, "deploy/models/kjv-tiny"), "CERTS": os.path.join(tmp, "certs"),
        "RUN": os.path.join(tmp, "run"), "MATRIX_PATH": "f32",
    }
    names = env_names(env_blocks[0])
    missing = [n for n in names if n not in values]
    if missing:
        raise SystemExit(f"FAIL: the env block sets {missing}, for which this test has no value")
    env = {k: v for k, v in os.environ.items() if k not in values}
    env.update({n: values[n] for n in names})

    failed = []
    outputs = {}
    t0 = time.monotonic()

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    try:
        hosts.up()
        log(f"hosts: {', '.join(f'{h} {hosts.ip(h)}' for h in HOSTS)} (namespaces {hosts.prefix}-*)")
        for n, (host, block) in enumerate(steps):
            if host == "env":
                continue
            argv = ["bash", "-euo", "pipefail", "-c", block]
            if host != "ca":
                argv = ["ip", "netns", "exec", hosts.ns(host)] + argv
            started = time.monotonic()
            try:
                r = subprocess.run(argv, env=env, cwd=tmp, capture_output=True, text=True,
                                   timeout=BLOCK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"block {n} ({host}) ran past {BLOCK_TIMEOUT_S} s:\n{block}")
            log(f"block {n} on {host}: exit {r.returncode} in {time.monotonic() - started:.1f} s")
            outputs.setdefault(host, []).append(r.stdout)
            if r.returncode != 0:
                raise RuntimeError(f"block {n} on {host} exited {r.returncode}:\n{block}\n--- stdout:\n"
                                   f"{r.stdout}\n--- stderr:\n{r.stderr}")
        client = "\n".join(outputs.get("client", []))
        if not client:
            failed.append("the recipe has no client block, or it printed nothing")
        print("--- client output:\n" + client, flush=True)
        texts, done = sse_text_chunks(client)
        if len(texts) < 2 or not done:
            failed.append(f"the streamed completion: {len(texts)} chunks with text, [DONE] {'seen' if done else 'missing'}")
        if "decode" not in client or "prefill" not in client:
            failed.append("pdctl status in the client block did not list the prefill and decode workers")
        # The handoff crossed namespaces: the decode worker committed some.
        r = sh(["ip", "netns", "exec", hosts.ns("client"), "curl", "-sS", "--max-time", "5",
                f"http://{hosts.ip('decode')}:9090/metrics"], check=False)
        m = re.search(r"^pdserve_handoff_transfers_total(?:\{[^}]*\})? (\S+)", r.stdout, re.M)
        transfers = float(m.group(1)) if m else 0.0
        log(f"decode worker: {transfers:g} committed handoffs")
        if transfers < 1:
            failed.append(f"the decode worker committed no handoff (metrics: {r.stdout[:200]!r} {r.stderr.strip()})")
        # The recipe's firewall is in force: the client may not reach the KV port.
        if can_connect(hosts, "client", hosts.ip("decode"), 7300):
            failed.append("the client reaches the decode worker's KV port 7300: the firewall is not in force")
    except (Exception, KeyboardInterrupt) as e:
        failed.append(str(e))
    finally:
        run = values["RUN"]
        if failed and os.path.isdir(run):
            for f in sorted(os.listdir(run)):
                if f.endswith(".log"):
                    lines = open(os.path.join(run, f), errors="replace").readlines()
                    print(f"--- {f} (last 15 lines):\n{''.join(lines[-15:])}", flush=True)
        hosts.teardown()
        if not keep and not failed:
            shutil.rmtree(tmp, ignore_errors=True)
    for f in failed:
        print("FAIL:", f)
    if failed:
        print(f"kept for inspection: {tmp}")
        return 1
    log(f"the recipe ran and served in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Attacks on the deployment's secrets: the CA key, the services' keys and
the KV grant key that deploy/make_certs.sh writes.

    front_deploy_test.py REPO_DIR TEST

TEST is one of:

- fresh_dir_is_private: make_certs.sh into a directory that does not exist
  yet. Attack: another local user lists the directory, or waits for it to be
  made and plants files in it. The directory is made under `umask 077`:
  made before it, it is 0755 under the usual umask (the keys in it are
  0600, but anyone can list the directory).
- refuses_foreign_dir: make_certs.sh into a directory another user (nobody)
  owns. Attack: that user made the directory first; as its owner it can
  rename and replace what the script writes there (a ca.pem of its own
  chosen CA, which every service would then trust). The script must refuse
  it, not write the CA and every key into it and exit 0. Needs root (to
  make a directory owned by nobody); skipped otherwise.
- dockerignore_excludes_certs: the certificates and keys make_certs.sh
  writes under deploy/k8s/overlays/*/certs (where the Kubernetes overlays
  read them) must not enter a Docker build context: the builder stage does
  `COPY . /src`, so they would sit in an image layer. .dockerignore
  excludes them (deploy/k8s/overlays/x/certs/ca.key, for one, must not be
  in the context).

Exit status: 0 passed, 1 failed, 77 skipped (CTest SKIP_RETURN_CODE).
"""
import os
import pwd
import re
import stat
import subprocess
import sys
import tempfile

SKIP = 77
KEYS = ["ca.key", "router.key", "prefill.key", "decode.key", "kv_grant.key"]


def make_certs(repo, directory):
    return subprocess.run(["bash", os.path.join(repo, "deploy/make_certs.sh"), directory], capture_output=True,
                          text=True)


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def fresh_dir_is_private(repo):
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = os.path.join(tmp, "certs")
        # The usual umask: what a directory made before `umask 077` gets.
        old = os.umask(0o022)
        try:
            r = make_certs(repo, directory)
        finally:
            os.umask(old)
        if r.returncode != 0:
            return [f"make_certs.sh failed: {r.stderr}"]
        if mode(directory) != 0o700:
            errors.append(f"{directory} is {oct(mode(directory))}, not 0o700")
        for k in KEYS:
            p = os.path.join(directory, k)
            if not os.path.exists(p):
                errors.append(f"{k} was not written")
            elif mode(p) != 0o600:
                errors.append(f"{k} is {oct(mode(p))}, not 0o600")
    return errors


def refuses_foreign_dir(repo):
    if os.geteuid() != 0:
        print("SKIPPED: needs root to make a directory owned by another user (nobody)")
        return None
    nobody = pwd.getpwnam("nobody")
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        directory = os.path.join(tmp, "certs")
        os.mkdir(directory, 0o755)
        os.chown(directory, nobody.pw_uid, nobody.pw_gid)
        r = make_certs(repo, directory)
        if r.returncode == 0:
            errors.append("make_certs.sh wrote into a directory owned by nobody and exited 0")
        if "own" not in r.stderr:
            errors.append(f"the refusal does not say why (stderr: {r.stderr!r})")
        written = sorted(os.listdir(directory))
        if written:
            errors.append(f"files written into the foreign directory: {written}")
    return errors


def dockerignore_patterns(path):
    """(pattern, negated) per line, as Docker reads .dockerignore: comments
    and blank lines skipped, a leading '/' dropped, the path cleaned."""
    out = []
    for line in open(path):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        if negated:
            line = line[1:].strip()
        line = os.path.normpath(line.lstrip("/"))
        out.append((line, negated))
    return out


def pattern_regex(pattern):
    """Docker's pattern syntax (moby/patternmatcher): '*' and '?' within one
    path element, '**' across any number of them, [...] classes."""
    out, i = "^", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
                out += "(.*/)?"
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.find("]", i)
            if end < 0:
                out += re.escape(c)
            else:
                out += "[" + pattern[i + 1:end].replace("\\", "\\\\") + "]"
                i = end
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + "$")


def excluded(patterns, path):
    """Whether Docker leaves `path` out of the context: the last pattern
    that matches it or one of its parent directories decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for pattern, negated in patterns:
        rx = pattern_regex(pattern)
        if any(rx.match(p) for p in prefixes):
            result = not negated
    return result


def dockerignore_excludes_certs(repo):
    patterns = dockerignore_patterns(os.path.join(repo, ".dockerignore"))
    errors = []
    for overlay in ["cpu-demo", "gpu", "x"]:
        for name in KEYS + ["ca.pem", "router.pem"]:
            p = f"deploy/k8s/overlays/{overlay}/certs/{name}"
            if not excluded(patterns, p):
                errors.append(f"{p} is in the Docker build context")
    # The matcher itself: what the images need stays in.
    for p in ["deploy/models/kjv-tiny/tokenizer.json", "deploy/k8s/overlays/cpu-demo/kustomization.yaml",
              "deploy/make_certs.sh"]:
        if excluded(patterns, p):
            errors.append(f"{p} is left out of the Docker build context")
    if not excluded(patterns, "build/router/pdserve-router"):
        errors.append("the matcher does not see build/ as excluded")
    return errors


TESTS = {f.__name__: f for f in [fresh_dir_is_private, refuses_foreign_dir, dockerignore_excludes_certs]}


def main():
    repo, name = sys.argv[1], sys.argv[2]
    errors = TESTS[name](repo)
    if errors is None:
        return SKIP
    for e in errors:
        print("FAIL:", e)
    if not errors:
        print("ok")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Checks deploy/images/Dockerfile without building it (containers cannot run
on the project's 2-core machines):

- every COPY source from the build context exists in the repository (and is
  not excluded by .dockerignore);
- every COPY --from=builder source is a file the build makes (present in
  BUILD_DIR after the build) whose target the builder stage builds;
- every ENTRYPOINT is a file a COPY of that stage (or a stage it derives
  from) put there;
- the runtime stage installs exactly the Debian packages that own the
  shared libraries the copied binaries link (ldd of the built binaries,
  dpkg -S), less those debian:bookworm-slim already has.

    check_dockerfile.py REPO_DIR BUILD_DIR [DOCKERFILE]

With --expect-failures, the file must fail each of the checks above (the
broken fixture proves the check can fail).
"""
import json
import os
import re
import shlex
import subprocess
import sys

# In debian:bookworm-slim already (apt's own dependencies).
BASE = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g", "libgnutls30", "libgmp10", "libhogweed6", "libidn2-0",
        "libnettle8", "libp11-kit0", "libtasn1-6", "libunistring2", "libffi8"}


def stages(text):
    """(name, base, lines) per FROM, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            out.append({"name": m.group(2) or "", "base": m.group(1), "lines": []})
        elif out:
            out[-1]["lines"].append(line)
    return out


_owners = None


def owner(path):
    """The Debian package that installed `path` (dpkg's file lists, read
    once: what `dpkg -S` answers, without a process per library)."""
    global _owners
    if _owners is None:
        _owners = {}
        info = "/var/lib/dpkg/info"
        for name in os.listdir(info):
            if name.endswith(".list"):
                pkg = name[:-5].split(":")[0]
                for line in open(os.path.join(info, name), errors="replace"):
                    _owners[line.rstrip("\n")] = pkg
    candidates = [path, os.path.realpath(path)]
    # usrmerge: a file listed under /lib may be found under /usr/lib and back.
    for c in list(candidates):
        if c.startswith("/usr/lib/"):
            candidates.append(c[4:])
        elif c.startswith("/lib/"):
            candidates.append("/usr" + c)
    for c in candidates:
        if c in _owners:
            return _owners[c]
    return None


def main():
    args = [a for a in sys.argv[1:] if a != "--expect-failures"]
    expect_failures = "--expect-failures" in sys.argv
    repo, build = args[0], args[1]
    text = open(args[2] if len(args) > 2 else os.path.join(repo, "deploy/images/Dockerfile")).read()
    ignored = [l.strip().rstrip("/") for l in open(os.path.join(repo, ".dockerignore"))
               if l.strip() and not l.startswith("#")]
    st = stages(text)
    by_name = {s["name"]: s for s in st if s["name"]}
    errors = []
    builder = by_name.get("builder")
    built_targets = set()
    for line in builder["lines"] if builder else []:
        for m in re.finditer(r"--target\s+((?:[\w.-]+\s*)+)", line):
            built_targets |= set(m.group(1).split())
    copied_into = {}  # stage -> destinations
    binaries = set()
    for s in st:
        dests = set()
        for line in s["lines"]:
            if not line.upper().startswith("COPY "):
                continue
            args = shlex.split(line)[1:]
            from_stage = None
            while args and args[0].startswith("--"):
                if args[0].startswith("--from="):
                    from_stage = args[0].split("=", 1)[1]
                args = args[1:]
            *srcs, dest = args
            dests.add(dest)
            for src in srcs:
                if from_stage == "builder":
                    rel = os.path.relpath(src, "/build")
                    if not os.path.isfile(os.path.join(build, rel)):
                        errors.append(f"stage {s['name']}: COPY --from=builder {src}: the build makes no {rel}")
                    elif os.path.basename(src) not in built_targets:
                        errors.append(f"stage {s['name']}: {src} is not among the builder's --target list")
                    else:
                        binaries.add(os.path.join(build, rel))
                elif from_stage is None:
                    if src != "." and not os.path.exists(os.path.join(repo, src)):
                        errors.append(f"stage {s['name']}: COPY {src}: no such path in the repository")
                    if any(src == i or src.startswith(i + "/") for i in ignored):
                        errors.append(f"stage {s['name']}: COPY {src}: excluded by .dockerignore")
        copied_into[s["name"]] = dests
    for s in st:
        for line in s["lines"]:
            if not line.upper().startswith("ENTRYPOINT"):
                continue
            exe = json.loads(line.split(None, 1)[1])[0]
            chain, cur = set(), s
            while cur is not None:
                chain |= copied_into.get(cur["name"], set())
                cur = by_name.get(cur["base"])
            if exe not in chain:
                errors.append(f"stage {s['name']}: ENTRYPOINT {exe} is not a file COPY put into it")
    # The runtime stage's packages against the binaries' libraries.
    runtime = by_name.get("runtime")
    listed = set()
    for line in runtime["lines"] if runtime else []:
        m = re.search(r"apt-get install\s+(.*?)(?:&&|$)", line)
        if m:
            listed |= {w for w in m.group(1).split() if not w.startswith("-")}
    needed = {}
    for b in sorted(binaries):
        out = subprocess.run(["ldd", b], capture_output=True, text=True).stdout
        for lib in re.findall(r"=>\s+(\S+)", out):
            pkg = owner(lib)
            if pkg is None:
                errors.append(f"{b}: no Debian package owns {lib}")
            else:
                needed.setdefault(pkg, os.path.basename(b))
    need = set(needed) - BASE
    for pkg in sorted(need - listed):
        errors.append(f"runtime stage: {pkg} is missing (needed by {needed[pkg]})")
    for pkg in sorted(listed - need):
        errors.append(f"runtime stage: {pkg} is installed but no binary links it")
    if not binaries:
        errors.append("no binary is copied from the builder")
    for e in errors:
        print("FAIL:", e)
    print(f"checked {len(st)} stages, {len(binaries)} binaries, {len(listed)} runtime packages")
    if expect_failures:
        kinds = ["no such path", "the build makes no", "ENTRYPOINT", "is missing", "no binary links it"]
        missed = [k for k in kinds if not any(k in e for e in errors)]
        if missed:
            print("the broken Dockerfile passed these checks:", missed)
            return 1
        return 0
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

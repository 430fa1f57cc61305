#!/usr/bin/env python3
"""Writes docs/reference.md: every flag of every binary, every metric, every
pdctl command; with --check, compares the file with the code instead.

    python3 tools/reference/gen_reference.py BUILD_DIR
    python3 tools/reference/gen_reference.py BUILD_DIR --check [--reference FILE] [--expect-failures]

Where each part comes from:
  flags     `<binary> --helpfull` (abseil's own listing), the groups whose
            file is in this repository; the type from the defining
            ABSL_FLAG in that file.
  metrics   a running cluster (one router, one prefill and one decode worker
            on the shipped model, plaintext, on free ports): each process's
            /metrics gives HELP, TYPE and the label sets it exports at start.
            The sources are parsed too (every call of a MetricsRegistry::Add*
            method in the non-test code), so that a metric registered later
            (on first use) is listed from its registration, and a
            registration the parser cannot read is an error, not a gap.
  commands  `pdctl help`, and `pdctl COMMAND --help` for each command's flags.

--check exits 1 and prints each difference between the code and the file:
an entry in the code and not in the file, one in the file and no longer in
the code, or one whose type, default, help, labels or flags differ.
--expect-failures inverts the exit status (a planted-violation copy must
fail the check). Standard library only.
"""

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_REFERENCE = REPO / "docs" / "reference.md"
GENERATE_COMMAND = "python3 tools/reference/gen_reference.py build"

# The binaries, by their path under the build directory.
BINARIES = {
    "pdserve-router": "router/pdserve-router",
    "pdserve-prefill-worker": "prefill_worker/pdserve-prefill-worker",
    "pdserve-decode-worker": "decode_worker/pdserve-decode-worker",
    "pdctl": "tools/pdctl/pdctl",
}
SERVERS = ["pdserve-router", "pdserve-prefill-worker", "pdserve-decode-worker"]

# Where metric registrations are looked for (non-test sources only).
METRIC_DIRS = ["router", "base", "kv", "model", "text", "grammar", "engine", "runtime", "prefill_worker", "decode_worker", "kv_transfer", "kernels"]
# A source-only metric (not exported at start) is attributed to a process by
# the directory of its registration.
PROCESS_OF_DIR = {
    "router": "pdserve-router",
    "prefill_worker": "pdserve-prefill-worker",
    "decode_worker": "pdserve-decode-worker",
}
# The MetricsRegistry methods this script knows the type of. A public Add*
# method of MetricsRegistry missing here is reported, so that a new kind of
# registration cannot be skipped silently.
METRIC_TYPE_OF_METHOD = {
    "AddCounter": "counter",
    "AddCounterFunc": "counter",
    "AddGauge": "gauge",
    "AddOptionalGauge": "gauge",
    "AddHistogram": "histogram",
}

# Flags whose default is computed on the machine that runs the binary (a
# core count, a host name, an environment variable): the reference prints
# the default as the code describes it, given here, and --check does not
# compare the default of these flags (it still compares name, type and
# help). Keyed by (binary, flag). No flag has such a default now; a default
# expression that calls one of MACHINE_DEPENDENT_CALLS and is not listed
# here is reported.
MACHINE_DEPENDENT_DEFAULTS: dict[tuple[str, str], str] = {}
MACHINE_DEPENDENT_CALLS = ("hardware_concurrency", "sysconf", "get_nprocs", "getenv", "gethostname", "GetEnv")

# pdctl's own spelling of its command-line help (see PrintCommandHelp in
# tools/pdctl/pdctl.cc).
PDCTL_FLAG_LINE = re.compile(r"^    --([a-z0-9-]+) \((.*)\); default: (.*);$")


class Errors(list):
    def add(self, msg):
        self.append(msg)


# ---------------------------------------------------------------- C++ text --

def strip_comments(src):
    """The source with // and /* */ comments blanked (string literals kept)."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            out.append(src[i:j + 1])
            i = j + 1
        elif src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * src.count("\n", i, j))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def call_args(src, open_paren):
    """The top-level arguments of the call whose '(' is at open_paren, and the
    index after its ')'. Strings and (), {}, [] nest; '<' '>' are not
    tracked (no argument this script reads holds a template with a comma)."""
    args, depth, start, i, n = [], 0, open_paren + 1, open_paren, len(src)
    while i < n:
        c = src[i]
        if c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            i = j + 1
            continue
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                args.append(src[start:i].strip())
                return args, i + 1
        elif c == "," and depth == 1:
            args.append(src[start:i].strip())
            start = i + 1
        i += 1
    return None, n


STRING_LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')


def string_value(expr):
    """The value of an expression made only of adjacent string literals, else None."""
    expr = expr.strip()
    if not expr.startswith('"'):
        return None
    pieces, pos = [], 0
    for m in STRING_LITERAL.finditer(expr):
        if expr[pos:m.start()].strip():
            return None
        pieces.append(m.group(1))
        pos = m.end()
    if expr[pos:].strip():
        return None
    raw = "".join(pieces)
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), raw)


def line_of(src, index):
    return src.count("\n", 0, index) + 1


# ------------------------------------------------------------------- flags --

def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


def repo_path(path):
    """A path as abseil prints it (the compiler's path without its leading
    '/'), relative to the repository root; None for a file outside it."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    for i in range(len(parts) - 1):  # at least dir/file
        candidate = "/".join(parts[i:])
        if (REPO / candidate).is_file():
            return candidate
    return None


def parse_helpfull(text):
    """{repo-relative file: {flag: {"help", "default"}}} from abseil's --helpfull."""
    groups, current, entry = {}, None, None
    entries = []
    for line in text.splitlines():
        m = re.match(r"^  Flags from (.+):$", line)
        if m:
            current = repo_path(m.group(1))
            if current is not None:
                groups.setdefault(current, {})
            entry = None
            continue
        if current is None:
            continue
        if line.startswith("    --"):
            entry = [current, line.strip()]
            entries.append(entry)
        elif line.startswith("      ") and entry is not None:
            entry[1] += " " + line.strip()
        else:
            entry = None
    for path, body in entries:
        m = re.match(r"^--(\w+) \((.*)\); default: (.*?);(?: currently: .*;)?$", body)
        if not m:
            raise ValueError(f"cannot read abseil's entry in {path}: {body!r}")
        groups[path][m.group(1)] = {"help": m.group(2), "default": m.group(3)}
    return groups


def flag_definitions(path):
    """{flag: (type, default expression)} of the ABSL_FLAGs in a source file."""
    src = strip_comments((REPO / path).read_text())
    defs = {}
    for m in re.finditer(r"\bABSL_FLAG\s*\(", src):
        args, _ = call_args(src, m.end() - 1)
        if args and len(args) >= 4:
            defs[args[1]] = (" ".join(args[0].split()), " ".join(args[2].split()))
    return defs


def collect_flags(build, errors):
    """{binary: {flag: {"type", "default", "help", "file"}}}."""
    out = {}
    for binary, rel in BINARIES.items():
        exe = build / rel
        cmd = [str(exe), "logits", "--helpfull"] if binary == "pdctl" else [str(exe), "--helpfull"]
        res = run(cmd)
        groups = parse_helpfull(res.stdout + res.stderr)
        if not groups:
            errors.add(f"{binary}: `{' '.join(cmd[1:])}` listed no flag from this repository")
        flags = {}
        for path, entries in groups.items():
            defs = flag_definitions(path)
            for name, e in entries.items():
                ftype, default_expr = defs.get(name, ("", ""))
                if not ftype:
                    errors.add(f"{binary}: --{name}: no ABSL_FLAG({name}) found in {path}")
                default = e["default"]
                key = (binary, name)
                if key in MACHINE_DEPENDENT_DEFAULTS:
                    default = MACHINE_DEPENDENT_DEFAULTS[key]
                elif any(call in default_expr for call in MACHINE_DEPENDENT_CALLS):
                    errors.add(f"{binary}: --{name}'s default ({default_expr}) depends on the machine; "
                               "describe it in MACHINE_DEPENDENT_DEFAULTS")
                flags[name] = {"type": ftype, "default": default, "help": e["help"], "file": path}
        out[binary] = flags
    return out


# ---------------------------------------------------------------- commands --

def parse_usage(text):
    """[(command, description)] from `pdctl help`."""
    commands = []
    for line in text.splitlines():
        m = re.match(r"^  ([a-z][a-z0-9-]*)\s+(\S.*)$", line)
        if m:
            commands.append([m.group(1), m.group(2).strip()])
        elif re.match(r"^\s{4,}\S", line) and commands:
            commands[-1][1] += " " + line.strip()
    return [(c, d) for c, d in commands]


def help_tags(help_text, commands):
    """The commands a pdctl flag's help is tagged with: "CMD[ / CMD][ --flag]: "
    at its start or after "; " (the rule of HelpTags in tools/pdctl/pdctl.cc)."""
    tags = []
    for segment in help_text.split("; "):
        if ":" not in segment:
            continue
        head = segment.split(":", 1)[0].split(" --", 1)[0]
        names = head.split(" / ")
        if names and all(n in commands for n in names):
            tags.extend(names)
    return tags


def collect_commands(build, pdctl_flags, errors):
    """{command: {"about", "flags": [flag names with dashes]}}."""
    exe = str(build / BINARIES["pdctl"])
    res = run([exe, "help"])
    if res.returncode != 0:
        errors.add(f"`pdctl help` exited {res.returncode}")
    usage = parse_usage(res.stdout)
    if not usage:
        errors.add("`pdctl help` listed no command")
    names = {c for c, _ in usage}
    out = {}
    for command, about in usage:
        res = run([exe, command, "--help"])
        lines = res.stdout.splitlines()
        flags = []
        if command == "help":
            pass  # `pdctl help --help` is the list itself.
        elif res.returncode != 0 or not lines or lines[0] != f"pdctl {command} [flags]":
            errors.add(f"`pdctl {command} --help` does not list the command's flags (exit {res.returncode})")
        else:
            for line in lines[1:]:
                m = PDCTL_FLAG_LINE.match(line)
                if m:
                    flags.append(m.group(1))
                elif line.startswith("    --"):
                    errors.add(f"`pdctl {command} --help`: cannot read {line!r}")
        out[command] = {"about": about, "flags": sorted(flags)}
    # Each flag tagged with a command is listed under it, and each flag pdctl
    # defines is listed under at least one command.
    listed = {}
    for command, c in out.items():
        for f in c["flags"]:
            listed.setdefault(f.replace("-", "_"), set()).add(command)
    for name, f in sorted(pdctl_flags.items()):
        for tag in help_tags(f["help"], names):
            if tag not in listed.get(name, set()):
                errors.add(f"pdctl: --{name}'s help names '{tag}', but `pdctl {tag} --help` does not list it")
        if f["file"].startswith("tools/pdctl/") and name not in listed:
            errors.add(f"pdctl: --{name} ({f['file']}) is listed by no `pdctl COMMAND --help`")
    for name, commands in sorted(listed.items()):
        if name not in pdctl_flags:
            errors.add(f"pdctl: `pdctl {sorted(commands)[0]} --help` lists --{name}, which pdctl does not define")
    return out


# ----------------------------------------------------------------- metrics --

def registration_methods(errors):
    """{method: index of its labels parameter} of MetricsRegistry's public Add* methods."""
    header = (REPO / "base" / "metrics.h").read_text()
    m = re.search(r"class MetricsRegistry \{(.*?)\n private:", header, re.S)
    if not m:
        errors.add("base/metrics.h: cannot find MetricsRegistry's public section")
        return {}
    body = strip_comments(m.group(1))
    methods = {}
    for d in re.finditer(r"\b(Add\w+)\s*\(", body):
        args, _ = call_args(body, d.end() - 1)
        names = [a.split("=")[0].split()[-1].lstrip("&*") if a.split() else "" for a in args or []]
        if not names or names[0] != "name" or "help" not in names:
            errors.add(f"base/metrics.h: cannot read the parameters of MetricsRegistry::{d.group(1)}")
            continue
        if d.group(1) not in METRIC_TYPE_OF_METHOD:
            errors.add(f"base/metrics.h: MetricsRegistry::{d.group(1)} registers metrics of a type "
                       "this script does not know (METRIC_TYPE_OF_METHOD)")
            continue
        methods[d.group(1)] = {"help": names.index("help"),
                               "labels": names.index("labels") if "labels" in names else None}
    if not methods:
        errors.add("base/metrics.h: no registration method found")
    return methods


def source_files():
    for d in METRIC_DIRS:
        for root, dirs, files in os.walk(REPO / d):
            dirs[:] = sorted(x for x in dirs if x not in ("test", "tests", "testdata"))
            for f in sorted(files):
                if f.endswith((".cc", ".h", ".cu")) and not re.search(r"_(test|fuzz|bench)\.", f):
                    yield Path(root) / f


def parse_metric_sources(errors):
    """{name: [{"type", "help", "labels": [keys], "file"}]} from the registrations in the sources."""
    methods = registration_methods(errors)
    found = {}
    if not methods:
        return found
    call = re.compile(r"(?:\.|->)\s*(" + "|".join(sorted(methods)) + r")\s*\(")
    for path in source_files():
        rel = path.relative_to(REPO).as_posix()
        if rel in ("base/metrics.h", "base/metrics.cc"):
            continue  # the registry itself
        src = strip_comments(path.read_text(errors="replace"))
        for m in call.finditer(src):
            method = m.group(1)
            spec = methods[method]
            args, _ = call_args(src, m.end() - 1)
            where = f"{rel}:{line_of(src, m.start())}"
            if args is None or len(args) <= spec["help"]:
                errors.add(f"{where}: cannot read the arguments of {method}")
                continue
            name, help_text = string_value(args[0]), string_value(args[spec["help"]])
            if name is None:
                errors.add(f"{where}: {method}'s name is not a string literal ({args[0]}); "
                           "the reference cannot list it")
                continue
            if help_text is None:
                errors.add(f"{where}: {name}'s help is not a string literal")
                continue
            labels = []
            if spec["labels"] is not None and len(args) > spec["labels"]:
                expr = args[spec["labels"]].strip()
                if re.fullmatch(r"[A-Za-z_]\w*", expr):
                    # A variable: its last assignment before the call.
                    assigned = list(re.finditer(rf"\b{expr}\s*=\s*([^;]*);", src[:m.start()]))
                    expr = assigned[-1].group(1) if assigned else expr
                labels = re.findall(r'([A-Za-z_][A-Za-z0-9_]*)=\\"', expr)
                if not labels and expr not in ('""', ""):
                    errors.add(f"{where}: cannot read {name}'s labels ({args[spec['labels']]})")
            found.setdefault(name, []).append({"type": METRIC_TYPE_OF_METHOD[method], "help": help_text,
                                               "labels": labels, "file": rel})
    return found


def parse_exposition(text):
    """{name: {"type", "help", "labels": {key: set(values)}}} from a /metrics page."""
    metrics, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            metrics.setdefault(name, {"type": "", "help": "", "labels": {}})["help"] = help_text
        elif line.startswith("# TYPE "):
            name, _, t = line[7:].partition(" ")
            metrics.setdefault(name, {"type": "", "help": "", "labels": {}})["type"] = t
            types[name] = t
        elif line and not line.startswith("#"):
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
            if not m:
                continue
            name = m.group(1)
            if name not in metrics:
                for suffix in ("_bucket", "_sum", "_count"):
                    if name.endswith(suffix) and types.get(name[:-len(suffix)]) == "histogram":
                        name = name[:-len(suffix)]
            if name not in metrics:
                continue
            for key, value in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""):
                if key != "le" or metrics[name]["type"] != "histogram":
                    metrics[name]["labels"].setdefault(key, set()).add(value)
    return metrics


def start_and_scrape(build, errors):
    """{process: /metrics page} of a router, a prefill and a decode worker."""
    model = REPO / "deploy" / "models" / "kjv-tiny"
    procs, pages = [], {}
    with tempfile.TemporaryDirectory(prefix="pdserve-reference-") as tmp:
        tmp = Path(tmp)

        def start(binary, *args):
            ready = tmp / f"{binary}.json"
            log = open(tmp / f"{binary}.log", "w")
            cmd = [str(build / BINARIES[binary]), "--insecure", f"--model={model}", f"--ready_file={ready}",
                   "--metrics_listen=127.0.0.1:0", *args]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp))
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                if ready.exists() and ready.read_text().strip().endswith("}"):
                    return json.loads(ready.read_text())
                if procs[-1].poll() is not None:
                    break
                time.sleep(0.1)
            log.flush()
            raise RuntimeError(f"{binary} did not become ready:\n{(tmp / f'{binary}.log').read_text()[-2000:]}")

        try:
            # Each with a second tier, so that its metrics are exported too.
            decode = start("pdserve-decode-worker", "--kv_positions=256", f"--kv_tier2_dir={tmp}/tier2-decode",
                           "--kv_tier2_bytes=1048576")
            prefill = start("pdserve-prefill-worker", "--kv_positions=256", f"--kv_tier2_dir={tmp}/tier2-prefill",
                            "--kv_tier2_bytes=1048576")
            router = start("pdserve-router", f"--prefill=127.0.0.1:{prefill['grpc_port']}",
                           f"--decode=127.0.0.1:{decode['grpc_port']}", "--http_listen=127.0.0.1:0")
            for binary, ready in (("pdserve-router", router), ("pdserve-prefill-worker", prefill),
                                  ("pdserve-decode-worker", decode)):
                url = f"http://127.0.0.1:{ready['metrics_port']}/metrics"
                with urllib.request.urlopen(url, timeout=10) as r:
                    pages[binary] = r.read().decode()
        except (RuntimeError, OSError, ValueError) as e:
            errors.add(f"cannot start the cluster to read its metrics: {e}")
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    return pages


def unit_of(name, mtype):
    if "_seconds" in name:
        return "seconds"
    if "_bytes" in name:
        return "bytes"
    if name.endswith("_per_second"):
        return "1/s"
    if "_tokens" in name:
        return "tokens"
    if mtype == "counter":
        return "count"
    return "—"


def collect_metrics(build, errors):
    """{process: {name: {"type", "help", "labels", "unit", "files", "source_only"}}}."""
    sources = parse_metric_sources(errors)
    pages = start_and_scrape(build, errors)
    out = {p: {} for p in SERVERS}
    scraped_names = set()
    for process, page in pages.items():
        for name, m in parse_exposition(page).items():
            scraped_names.add(name)
            regs = sources.get(name, [])
            if not regs:
                errors.add(f"{process} exports {name}, which no registration in the sources names")
            elif m["help"] not in {r["help"] for r in regs}:
                errors.add(f"{name}: {process}'s help ({m['help']!r}) is in no registration of it")
            # The registrations that can be this process's: same help and
            # type, in its own directory or a shared one.
            files = sorted({r["file"] for r in regs if r["help"] == m["help"] and r["type"] == m["type"]
                            and PROCESS_OF_DIR.get(r["file"].split("/")[0], process) == process})
            if regs and not files:
                errors.add(f"{name}: {process} exports it as a {m['type']}, no registration of it is one")
            keys = set(m["labels"]) | {k for r in regs if r["file"] in files for k in r["labels"]}
            out[process][name] = {
                "type": m["type"], "help": m["help"], "unit": unit_of(name, m["type"]), "files": files,
                "labels": {k: sorted(m["labels"].get(k, set())) for k in sorted(keys)}, "source_only": False}
    if not pages:
        return out
    # Registered in the sources, not exported at start: registered on first use.
    for name, regs in sorted(sources.items()):
        if name in scraped_names:
            continue
        for r in regs:
            top = r["file"].split("/")[0]
            process = PROCESS_OF_DIR.get(top)
            if process is None:
                errors.add(f"{name} ({r['file']}): no process exports it at start, and its directory "
                           "does not tell which would")
                continue
            entry = out[process].setdefault(name, {
                "type": r["type"], "help": r["help"], "unit": unit_of(name, r["type"]), "files": [],
                "labels": {}, "source_only": True})
            entry["files"] = sorted(set(entry["files"]) | {r["file"]})
            for k in r["labels"]:
                entry["labels"].setdefault(k, [])
    return out


# ---------------------------------------------------------------- markdown --

def cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def code(text):
    return f"`{text}`" if text else ""


def render(flags, metrics, commands):
    lines = [
        "# pdserve reference",
        "",
        "This file is generated: every flag of every binary, every metric and every `pdctl` command, read from",
        f"the built binaries and the sources by `{GENERATE_COMMAND}`. Do not edit it by hand; run that",
        "command after changing a flag, a metric or a command. CI runs the same script with `--check`",
        "(test `Docs.ReferenceListsEveryFlagAndMetric`) and fails when this file is out of date.",
        "",
        "Flags are spelled as abseil names them (`--kv_positions`); `pdctl` also accepts dashes",
        "(`--kv-positions`). A default of `\"\"` is the empty string; an empty default is an empty list.",
        "",
        "## Flags",
        "",
    ]
    for binary in BINARIES:
        fs = flags.get(binary, {})
        lines += [f"### {binary}", "", f"{len(fs)} flags.", "",
                  "| Flag | Type | Default | Defined in | Meaning |", "| --- | --- | --- | --- | --- |"]
        for name in sorted(fs):
            f = fs[name]
            lines.append(f"| `--{name}` | {cell(code(f['type']))} | {cell(code(f['default']))} | "
                         f"`{f['file']}` | {cell(f['help'])} |")
        lines.append("")
    total = len({n for p in metrics.values() for n in p})
    lines += [
        "## Metrics",
        "",
        f"{total} metrics. Each process serves Prometheus text on `/metrics` at its `--metrics_listen`",
        "address. The labels column gives each label with the values the process exports at start; a",
        "metric marked *on first use* is registered when its first event happens (its label values are",
        "known only then). The unit comes from the name's suffix (`_seconds`, `_bytes`, `_total`, ...).",
        "",
    ]
    for process in SERVERS:
        ms = metrics.get(process, {})
        lines += [f"### {process}", "", f"{len(ms)} metrics.", "",
                  "| Metric | Type | Unit | Labels | Registered in | Meaning |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name in sorted(ms):
            m = ms[name]
            labels = "; ".join(f"`{k}`" + (": " + ", ".join(f"`{v}`" for v in vs) if vs else "")
                               for k, vs in m["labels"].items())
            files = ", ".join(f"`{f}`" for f in m["files"])
            meaning = m["help"] + (" *(on first use)*" if m["source_only"] else "")
            lines.append(f"| `{name}` | {m['type']} | {m['unit']} | {cell(labels)} | {cell(files)} | "
                         f"{cell(meaning)} |")
        lines.append("")
    lines += [
        "## pdctl commands",
        "",
        "`pdctl COMMAND [flags]`; `pdctl COMMAND --help` prints the flags the command reads, with their",
        "defaults and help (the table of `pdctl` flags above gives each one's meaning).",
        "",
        "| Command | What it does | Flags |",
        "| --- | --- | --- |",
    ]
    for command, c in commands.items():
        fl = ", ".join(f"`--{f}`" for f in c["flags"]) or "—"
        lines.append(f"| `{command}` | {cell(c['about'])} | {fl} |")
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------- check --

def table_rows(text):
    """{(kind, section, key): {column: value}} of the reference's tables."""
    rows, section, kind, header = {}, None, None, None
    for line in text.splitlines():
        if line.startswith("## "):
            kind = {"## Flags": "flag", "## Metrics": "metric", "## pdctl commands": "command"}.get(line.strip())
            section, header = None, None
        elif line.startswith("### "):
            section, header = line[4:].strip(), None
        elif line.startswith("|") and kind:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if header is None:
                header = cells
            elif not all(set(c) <= {"-", " "} for c in cells):
                key = (kind, section or "pdctl", cells[0])
                rows[key] = dict(zip(header[1:], cells[1:]))
        elif not line.startswith("|"):
            header = None
    return rows


def describe(key):
    kind, section, name = key
    return {"flag": f"flag {name} of {section}", "metric": f"metric {name} of {section}",
            "command": f"pdctl command {name}"}[kind]


def compare(expected, actual):
    """The differences between the generated text and the file, one line each."""
    want, have = table_rows(expected), table_rows(actual)
    diffs = []
    for key in sorted(want.keys() - have.keys()):
        diffs.append(f"{describe(key)} is in the code, not in the file")
    for key in sorted(have.keys() - want.keys()):
        diffs.append(f"{describe(key)} is in the file, no longer in the code")
    for key in sorted(want.keys() & have.keys()):
        for column, value in want[key].items():
            if (key[0] == "flag" and column == "Default"
                    and (key[1], key[2].strip("`").lstrip("-")) in MACHINE_DEPENDENT_DEFAULTS):
                continue  # computed on the machine (see MACHINE_DEPENDENT_DEFAULTS)
            if have[key].get(column) != value:
                diffs.append(f"{describe(key)}: {column} is {have[key].get(column)!r} in the file, "
                             f"{value!r} in the code")
    if not diffs and expected != actual:
        text = "".join(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True),
                                            "file", "generated", n=1))
        diffs.append("the file's text differs from the generated text:\n" + text)
    return diffs


def plant_violations(text):
    """A copy of the reference with the first flag row of the router's table
    and the first metric row of the decode worker's removed, and the default
    of pdctl's first flag changed; and the start of each difference --check
    must report."""
    lines = text.splitlines(True)
    planted, expected = [], []
    section = None
    targets = {("flag", "pdserve-router"): "remove", ("metric", "pdserve-decode-worker"): "remove",
               ("flag", "pdctl"): "default"}
    kind = None
    out = []
    for line in lines:
        if line.startswith("## "):
            kind = {"## Flags": "flag", "## Metrics": "metric"}.get(line.strip())
        elif line.startswith("### "):
            section = line[4:].strip()
        action = targets.get((kind, section))
        m = re.match(r"^\| (`[^`]+`) \|", line)
        if action and m and (kind, section) not in planted:
            planted.append((kind, section))
            key = (kind, section, m.group(1))
            if action == "remove":
                expected.append(f"{describe(key)} is in the code, not in the file")
                continue
            cells = re.split(r"(?<!\\)\|", line)
            cells[3] = " `planted` "
            line = "|".join(cells)
            expected.append(f"{describe(key)}: Default is '`planted`' in the file")
        out.append(line)
    if len(planted) != len(targets):
        raise SystemExit("gen_reference: the reference has no row to plant a violation in")
    return "".join(out), expected


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build_dir")
    ap.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    ap.add_argument("--reference", default=str(DEFAULT_REFERENCE), help="the reference file (default: docs/reference.md)")
    ap.add_argument("--expect-failures", action="store_true",
                    help="with --check: succeed only when the check finds a difference")
    ap.add_argument("--plant-violations", action="store_true",
                    help="with --check: compare a copy of the reference with a flag and a metric removed and a "
                         "default changed; exit 1 when any of them goes unreported")
    a = ap.parse_args()
    build = Path(a.build_dir).resolve()
    for binary, rel in BINARIES.items():
        if not os.access(build / rel, os.X_OK):
            print(f"gen_reference: {build / rel} is not built", file=sys.stderr)
            return 2

    errors = Errors()
    flags = collect_flags(build, errors)
    commands = collect_commands(build, flags.get("pdctl", {}), errors)
    metrics = collect_metrics(build, errors)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    if errors:
        print(f"gen_reference: {len(errors)} errors reading the code; nothing compared or written", file=sys.stderr)
        return 1
    text = render(flags, metrics, commands)
    counts = ", ".join(f"{b} {len(f)}" for b, f in flags.items())
    summary = (f"flags: {counts}; metrics: {len({n for p in metrics.values() for n in p})}; "
               f"pdctl commands: {len(commands)}")

    reference = Path(a.reference)
    if not a.check:
        reference.parent.mkdir(parents=True, exist_ok=True)
        reference.write_text(text)
        print(f"wrote {reference} ({summary})")
        return 0
    actual = reference.read_text() if reference.exists() else ""
    expected = []
    if a.plant_violations:
        actual, expected = plant_violations(actual)
        reference = Path(f"{reference} (planted copy)")
    diffs = compare(text, actual)
    for d in diffs:
        print(f"{reference}: {d}")
    if diffs:
        print(f"{reference} is out of date ({len(diffs)} differences); run `{GENERATE_COMMAND}`")
    else:
        print(f"{reference} is up to date ({summary})")
    missed = [e for e in expected if not any(d.startswith(e) for d in diffs)]
    for e in missed:
        print(f"{reference}: the check does not report a planted violation: {e}")
    failed = bool(diffs)
    if missed:
        return 1  # blind to what was planted, whatever --expect-failures says
    if a.expect_failures:
        print("expected failures: " + ("seen" if failed else "none seen, the check is blind"))
        return 0 if failed else 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The floor table: each source folder sits on a floor, and a file may
include only from its own folder or from a lower floor. An include that
runs up, or sideways into another folder on the same floor, fails.

    floors.py ROOT                       check the tree; exit 1 on any offence
    floors.py ROOT --plant FILE:HEADER   check the tree as if FILE also
                                         included HEADER; exit 0 only if
                                         that include is the one offence
                                         reported (the checker's own test)

Tests (tests/) sit outside the table: they may include any floor.
"""
import os
import re
import sys

# Lowest first. A folder may include its own files and any folder on a
# lower floor; folders on one floor do not include each other.
FLOORS = [
    ["base"],  # dtype, metrics, gRPC server helpers, health, TLS, timers
    ["kernels"],  # the compute backends behind one interface
    ["kv"],  # block hashes, the KV cache layout, the KV manager, prefix cache
    ["model"],  # configuration, checkpoints, the forward, TP ranks
    ["text"],  # tokenizer, chat templates, detokenizer, stop strings
    ["engine"],  # sampling, generation, requests, scheduler, the engine
    ["kv_transfer"],  # the handoff protocol and its transports
    ["proto"],  # wire contracts and their conversions
    ["runtime"],  # what a worker process runs around its engine
    ["prefill_worker", "decode_worker", "router"],  # the three servers
    ["tools"],  # pdctl, benchmarks
]
# Generated headers, by the folder that generates them.
ALIASES = {"pdserve": "proto"}
SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def floor_of():
    table = {}
    for level, folders in enumerate(FLOORS):
        for folder in folders:
            table[folder] = level
    return table


def folder_of(path, table):
    first = path.split("/", 1)[0]
    first = ALIASES.get(first, first)
    return first if first in table else None


def offences(root, planted=None):
    table = floor_of()
    found = []
    for folder in table:
        top = os.path.join(root, folder)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                with open(path, encoding="utf-8", errors="replace") as f:
                    included = INCLUDE.findall(f.read())
                if planted is not None and planted[0] == rel:
                    included.append(planted[1])
                for header in included:
                    target = folder_of(header, table)
                    if target is None or target == folder:
                        continue
                    if table[target] > table[folder]:
                        found.append((rel, header, f"runs up from {folder}/ (floor {table[folder]}) to "
                                      f"{target}/ (floor {table[target]})"))
                    elif table[target] == table[folder]:
                        found.append((rel, header, f"runs sideways from {folder}/ to {target}/ (both floor "
                                      f"{table[folder]})"))
    return found


def main(argv):
    if len(argv) not in (2, 4) or (len(argv) == 4 and argv[2] != "--plant"):
        print(__doc__, file=sys.stderr)
        return 2
    root = argv[1]
    planted = None
    if len(argv) == 4:
        file, _, header = argv[3].partition(":")
        if not header or not os.path.isfile(os.path.join(root, file)):
            print(f"--plant FILE:HEADER: no file {file} under {root}", file=sys.stderr)
            return 2
        planted = (file, header)
    found = offences(root, planted)
    for rel, header, why in found:
        print(f"{rel}: #include \"{header}\" {why}")
    if planted is not None:
        if [(rel, header) for rel, header, _ in found] == [planted]:
            print(f"OK: the planted include ({planted[0]} -> {planted[1]}) is the one offence found")
            return 0
        print(f"FAIL: expected exactly the planted include ({planted[0]} -> {planted[1]}) to be reported")
        return 1
    if found:
        print(f"{len(found)} include(s) cross the floor table (tests/layout/floors.py lists the floors)")
        return 1
    print(f"OK: every include in {', '.join(sorted(table_folders()))} stays on its floor or goes down")
    return 0


def table_folders():
    return [folder for folders in FLOORS for folder in folders]


if __name__ == "__main__":
    sys.exit(main(sys.argv))

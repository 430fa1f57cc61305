#!/usr/bin/env python3
"""The floor table: each source folder sits on a floor, and a file may
include only from its own folder or from a lower floor. An include that
runs up, or sideways into another folder on the same floor, fails. Within
the table, no two units (a header with its .cc) include each other, even
through others: a cycle fails too.

    floors.py ROOT                       check the tree; exit 1 on any offence
    floors.py ROOT --plant FILE:HEADER   check the tree as if FILE also
                                         included HEADER; exit 0 only if
                                         that include is the one offence
                                         reported, or, staying on its
                                         floor, closes the one cycle (the
                                         checker's own tests)

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
    ["grammar"],  # JSON Schema grammars, their matcher and token masks
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


def cycles(root, planted=None):
    """The include cycles between units (path without its suffix) of the
    table's folders, each as a sorted list of units."""
    table = floor_of()
    edges = {}
    for folder in table:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, folder)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.join(dirpath, name)
                unit = os.path.splitext(os.path.relpath(path, root))[0]
                with open(path, encoding="utf-8", errors="replace") as f:
                    headers = INCLUDE.findall(f.read())
                if planted is not None and planted[0] == os.path.relpath(path, root):
                    headers.append(planted[1])
                for header in headers:
                    target = os.path.splitext(header)[0]
                    if target != unit and os.path.isfile(os.path.join(root, header)):
                        edges.setdefault(unit, set()).add(target)
    # Tarjan's strongly connected components, iteratively.
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
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
    loops = cycles(root, planted)
    for loop in loops:
        print(f"include cycle: {' <-> '.join(loop)}")
    if planted is not None:
        if [(rel, header) for rel, header, _ in found] == [planted]:
            print(f"OK: the planted include ({planted[0]} -> {planted[1]}) is the one offence found")
            return 0
        units = {os.path.splitext(planted[0])[0], os.path.splitext(planted[1])[0]}
        if not found and len(loops) == 1 and units <= set(loops[0]):
            print(f"OK: the planted include ({planted[0]} -> {planted[1]}) closes the one cycle found")
            return 0
        print(f"FAIL: expected exactly the planted include ({planted[0]} -> {planted[1]}) to be reported")
        return 1
    for loop in loops:
        print(f"include cycle: {' <-> '.join(loop)}")
    if found or loops:
        print(f"{len(found)} include(s) cross the floor table (tests/layout/floors.py lists the floors); "
              f"{len(loops)} include cycle(s)")
        return 1
    print(f"OK: every include in {', '.join(sorted(table_folders()))} stays on its floor or goes down, "
          "and no units include each other")
    return 0


def table_folders():
    return [folder for folders in FLOORS for folder in folders]


if __name__ == "__main__":
    sys.exit(main(sys.argv))

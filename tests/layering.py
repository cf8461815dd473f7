#!/usr/bin/env python3
"""The module graph that CMake's targets promise, checked on the build:

- the offline tools (ckptctl, ckptfs-fsck) need neither libfuse nor MPI
  (readelf -d lists no such library);
- no two files of store/ call each other in a circle (from the symbols
  each object file defines and uses, nm);
- store/ and planner/ objects use no FUSE or MPI symbol.

Usage: layering.py BUILD_DIR
"""
import os
import subprocess
import sys


def needed(binary):
    out = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True,
                         check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines()
            if "(NEEDED)" in line]


def symbols(obj):
    """(defined, undefined) global symbols of an object file."""
    out = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBRC":
            defined.add(parts[2])
    return defined, undefined


def objects(build, target, src_dir):
    d = os.path.join(build, "CMakeFiles", f"{target}.dir", src_dir)
    if not os.path.isdir(d):
        return []
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".o"))


def find_cycle(graph):
    state = {}

    def visit(n, path):
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                c = visit(m, path + [m])
                if c:
                    return c
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            c = visit(n, [n])
            if c:
                return c
    return None


def main():
    build = sys.argv[1]
    problems = []
    for tool in ("ckptctl", "ckptfs-fsck"):
        libs = needed(os.path.join(build, "bin", tool))
        bad = [lib for lib in libs if "fuse" in lib or "mpi" in lib]
        if bad:
            problems.append(f"{tool} links {', '.join(bad)}: the offline tools link the store only")
    objs = objects(build, "ckpt_store", "store")
    syms = {os.path.basename(o)[:-len(".c.o")]: symbols(o) for o in objs}
    if len(syms) < 5:
        problems.append(f"only {len(syms)} store objects found in {build}")
    owner = {s: f for f, (d, _) in syms.items() for s in d}
    graph = {f: {owner[s] for s in u if s in owner and owner[s] != f}
             for f, (_, u) in syms.items()}
    cycle = find_cycle(graph)
    if cycle:
        problems.append("store/ files call each other in a circle: " + " -> ".join(cycle))
    for target, d in (("ckpt_store", "store"), ("ckpt_planner", "planner")):
        for o in objects(build, target, d):
            _, u = symbols(o)
            bad = sorted(s for s in u if s.startswith(("fuse_", "MPI_", "PMPI_", "ompi_")))
            if bad:
                problems.append(f"{o}: uses {', '.join(bad[:5])}")
    for p in problems:
        print("layering:", p)
    print("layering: store/ graph:", {k: sorted(v) for k, v in sorted(graph.items())})
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

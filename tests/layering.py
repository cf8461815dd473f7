#!/usr/bin/env python3
"""The module graph that CMake's targets promise, checked on every build
(a wrong arrow fails the build, not only the tests):

- the offline tools (ckptctl, ckptfs-fsck) need neither libfuse nor MPI
  (readelf -d lists no such library);
- no two files of store/ call each other in a circle (from the symbols
  each object file defines and uses, nm);
- store/ and planner/ objects use no FUSE or MPI symbol;
- fs/ is in layers (FS_LAYERS, bottom first; one directory each): a file
  includes only headers of its own layer or lower ones, and another
  layer's private header (*_int.h) never; an object file calls only
  functions of its own layer or lower ones; files of one layer that call
  each other in a circle are at most MAX_CIRCLE.

Usage: layering.py BUILD_DIR [SOURCE_DIR]
"""
import glob
import os
import re
import subprocess
import sys

FS_LAYERS = ["core", "tree", "stage", "journal", "read", "tier", "commit", "ops", "daemon"]
MAX_CIRCLE = 4


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


def sccs(graph):
    """The strongly connected components of graph (Tarjan), as lists."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_of(path, layers):
    """The fs/ layer of path (".../fs/LAYER/file"), or None."""
    parts = path.replace(os.sep, "/").split("/")
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "fs" and parts[i + 1] in layers:
            return parts[i + 1]
    return None


def check_fs_objects(objs, layers=FS_LAYERS, max_circle=MAX_CIRCLE):
    """Problems with the calls between fs/ object files (paths with
    fs/LAYER/ in them): an arrow up the layers, a circle too large."""
    problems = []
    syms = {}
    for o in objs:
        lay = layer_of(o, layers)
        if lay is None:
            problems.append(f"{o}: not in a layer of fs/ ({', '.join(layers)})")
            continue
        syms[f"{lay}/{os.path.basename(o).split('.')[0]}"] = symbols(o)
    owner = {s: f for f, (d, _) in syms.items() for s in d}
    graph = {f: {owner[s] for s in u if s in owner and owner[s] != f}
             for f, (_, u) in syms.items()}
    rank = {lay: i for i, lay in enumerate(layers)}
    for f, (_, u) in sorted(syms.items()):
        for s in sorted(u):
            t = owner.get(s)
            if t and rank[t.split("/")[0]] > rank[f.split("/")[0]]:
                problems.append(f"fs/{f}.c calls {s} of fs/{t}.c: a layer above it")
    for comp in sccs(graph):
        if len(comp) > max_circle:
            problems.append(f"fs/ files call each other in a circle of {len(comp)} "
                            f"(at most {max_circle}): {', '.join(comp)}")
    return problems, graph


INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def check_fs_includes(fs_dir, layers=FS_LAYERS):
    """Problems with the includes of fs/'s sources: a header of a layer
    above, another layer's private header, a directory in no layer."""
    problems = []
    rank = {lay: i for i, lay in enumerate(layers)}
    home = {}
    for lay in layers:
        for h in glob.glob(os.path.join(fs_dir, lay, "*.h")):
            home[os.path.basename(h)] = lay
    for d in sorted(os.listdir(fs_dir)):
        full = os.path.join(fs_dir, d)
        if os.path.isdir(full) and d not in rank:
            problems.append(f"fs/{d}/ is in no layer ({', '.join(layers)})")
        elif not os.path.isdir(full):
            problems.append(f"fs/{d}: a file outside the layers' directories")
    for lay in layers:
        for src in sorted(glob.glob(os.path.join(fs_dir, lay, "*.[ch]"))):
            with open(src) as f:
                text = f.read()
            for inc in INCLUDE.findall(text):
                to = home.get(inc)
                name = f"fs/{lay}/{os.path.basename(src)}"
                if to is None:
                    continue
                if rank[to] > rank[lay]:
                    problems.append(f"{name} includes {inc} of fs/{to}/: a layer above it")
                elif inc.endswith("_int.h") and to != lay:
                    problems.append(f"{name} includes {inc}, private to fs/{to}/")
    return problems


def main():
    build = sys.argv[1]
    source = sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))
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
    fs_objs = sorted(glob.glob(os.path.join(build, "CMakeFiles", "ckpt_fs.dir", "fs", "*", "*.o")) +
                     glob.glob(os.path.join(build, "CMakeFiles", "ckptfs.dir", "fs", "*", "*.o")))
    if len(fs_objs) < 20:
        problems.append(f"only {len(fs_objs)} fs/ objects found in {build}")
    fs_problems, fs_graph = check_fs_objects(fs_objs)
    problems += fs_problems
    problems += check_fs_includes(os.path.join(source, "fs"))
    for p in problems:
        print("layering:", p)
    if problems:
        print("layering: the layers of fs/, bottom first:", " < ".join(FS_LAYERS),
              "(docs/code.md)")
    circles = [c for c in sccs(fs_graph) if len(c) > 1]
    print(f"layering: {len(problems)} problems; store/ {len(graph)} files, fs/ {len(fs_graph)} "
          f"files; fs/ circles: {circles}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

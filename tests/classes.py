#!/usr/bin/env python3
"""The test classes of a unittest file, one per line, for CMake (tests/
CMakeLists.txt registers one ctest per class): every class of the file,
in file order, that unittest.main would run, found without importing the
file (no torch, no MPI at configure time): a class with a test_* method of
its own (or added by a setattr(CLASS, ...) of the file) or inherited from
a class of the same file, and that derives,
through classes of the file or imported names, from something.  A class
whose name ends in "Case" or "Base", or that sets `__test__ = False`, is
a base of others and is not listed when it has no test of its own.

Usage: classes.py FILE.py
"""
import ast
import sys


def main(path):
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    classes = {}
    order = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = node
            order.append(node.name)

    # tests added after the class, by setattr(CLASS, "test_...", fn)
    added = {n.args[0].id for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "setattr" and n.args and isinstance(n.args[0], ast.Name)}

    def own_tests(node):
        return node.name in added or any(
            isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
            and b.name.startswith("test") for b in node.body)

    def base_names(node):
        out = []
        for b in node.bases:
            if isinstance(b, ast.Name):
                out.append(b.id)
            elif isinstance(b, ast.Attribute):
                out.append(b.attr)
        return out

    def has_tests(name, seen=()):
        node = classes.get(name)
        if node is None or name in seen:
            return False
        return own_tests(node) or any(has_tests(b, seen + (name,))
                                      for b in base_names(node))

    def disabled(node):
        for b in node.body:
            if isinstance(b, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__test__" for t in b.targets):
                return isinstance(b.value, ast.Constant) and b.value.value is False
        return False

    for name in order:
        node = classes[name]
        if not node.bases or disabled(node) or not has_tests(name):
            continue
        if name.endswith(("Case", "Base")) and not own_tests(node):
            continue
        print(name)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])

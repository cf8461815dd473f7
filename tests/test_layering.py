#!/usr/bin/env python3
"""tests/layering.py must catch a wrong arrow: a tiny fs/ tree is made in
a temporary directory (real gcc objects, real headers) with one defect at
a time, and each must be reported; the same tree without the defect must
pass. Usage: test_layering.py"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layering  # noqa: E402

LAYERS = ["core", "tree", "ops"]


class Tree:
    """fs/LAYER/NAME.c files compiled into BUILD/.../fs/LAYER/NAME.c.o."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="layering-")
        self.fs = os.path.join(self.root, "src", "fs")
        self.objs = []
        for lay in LAYERS:
            os.makedirs(os.path.join(self.fs, lay))

    def add(self, layer, name, code, header=None):
        src = os.path.join(self.fs, layer, name + ".c")
        with open(src, "w") as f:
            f.write(code)
        if header is not None:
            with open(os.path.join(self.fs, layer, header[0]), "w") as f:
                f.write(header[1])
        obj_dir = os.path.join(self.root, "build", "CMakeFiles", "ckpt_fs.dir", "fs", layer)
        os.makedirs(obj_dir, exist_ok=True)
        obj = os.path.join(obj_dir, name + ".c.o")
        incs = [f"-I{os.path.join(self.fs, lay)}" for lay in LAYERS]
        subprocess.run(["gcc", "-c", "-w", *incs, "-o", obj, src], check=True)
        self.objs.append(obj)

    def problems(self):
        p, _ = layering.check_fs_objects(self.objs, LAYERS, max_circle=2)
        return p + layering.check_fs_includes(self.fs, LAYERS)

    def close(self):
        shutil.rmtree(self.root)


class Layering(unittest.TestCase):
    def setUp(self):
        self.t = Tree()
        self.addCleanup(self.t.close)
        self.t.add("core", "base", "int base_fn(void) { return 1; }\n",
                   ("core.h", "int base_fn(void);\n"))
        self.t.add("tree", "nodes", '#include "core.h"\nint tree_fn(void) { return base_fn(); }\n',
                   ("tree.h", '#include "core.h"\nint tree_fn(void);\n'))
        self.t.add("ops", "table", '#include "tree.h"\nint ops_fn(void) { return tree_fn(); }\n',
                   ("ops.h", '#include "tree.h"\nint ops_fn(void);\n'))

    def test_downward_arrows_pass(self):
        self.assertEqual(self.t.problems(), [])

    def test_call_up_the_layers_is_reported(self):
        self.t.add("tree", "bad", "int ops_fn(void);\nint bad_fn(void) { return ops_fn(); }\n")
        p = self.t.problems()
        self.assertEqual(len(p), 1, p)
        self.assertIn("fs/tree/bad.c calls ops_fn of fs/ops/table.c: a layer above it", p[0])

    def test_include_up_the_layers_is_reported(self):
        self.t.add("core", "worse", '#include "ops.h"\nint worse_fn(void) { return 0; }\n')
        p = self.t.problems()
        self.assertEqual(p, ["fs/core/worse.c includes ops.h of fs/ops/: a layer above it"])

    def test_private_header_of_another_layer_is_reported(self):
        with open(os.path.join(self.t.fs, "tree", "tree_int.h"), "w") as f:
            f.write("int tree_private(void);\n")
        self.t.add("ops", "peek", '#include "tree_int.h"\nint peek_fn(void) { return 0; }\n')
        p = self.t.problems()
        self.assertEqual(p, ["fs/ops/peek.c includes tree_int.h, private to fs/tree/"])

    def test_circle_larger_than_allowed_is_reported(self):
        for a, b in (("a", "b"), ("b", "c"), ("c", "a")):
            self.t.add("ops", a, f"int {b}_fn(void);\nint {a}_fn(void) {{ return {b}_fn(); }}\n")
        p = self.t.problems()
        self.assertEqual(len(p), 1, p)
        self.assertIn("circle of 3 (at most 2): ops/a, ops/b, ops/c", p[0])

    def test_directory_in_no_layer_is_reported(self):
        os.makedirs(os.path.join(self.t.fs, "misc"))
        self.assertEqual(self.t.problems(), ["fs/misc/ is in no layer (core, tree, ops)"])


if __name__ == "__main__":
    unittest.main()

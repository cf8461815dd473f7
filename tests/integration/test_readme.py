#!/usr/bin/env python3
"""The README's quick starts run as written: the shell block (it mounts,
saves, browses and unmounts by itself), the C program (compiled with
-Wall -Werror, run on a mount) and the Python block (on a mount, with an
interpreter that has numpy). Only the paths are replaced: /mnt/ckpt by the
test's mountpoint, /var/tmp/ckpt-data by its backing directory,
build/bin/ckptfs by the binary under test.

    python3 tests/integration/test_readme.py --bin build/bin/ckptfs
"""

import os
import re
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckptfs_util  # noqa: E402
from ckptfs_util import CkptfsTestCase, main, mountinfo_has  # noqa: E402
from pyenv import REPO  # noqa: E402

README = os.path.join(REPO, "README.md")


def block(section, lang):
    """The one ```lang block of README section `## section`."""
    with open(README) as f:
        text = f.read()
    m = re.search(r"(?m)^## " + re.escape(section) + r"\n(.*?)(?=^## |\Z)", text, re.S)
    if not m:
        raise AssertionError(f"README has no section '## {section}'")
    blocks = re.findall(r"(?ms)^```" + lang + r"\n(.*?)^```", m.group(1))
    if len(blocks) != 1:
        raise AssertionError(f"'## {section}': {len(blocks)} ```{lang} blocks, expected 1")
    return blocks[0]


class QuickStarts(CkptfsTestCase):
    def paths(self, code):
        return (code.replace("build/bin/ckptfs", ckptfs_util.BIN)
                    .replace("/var/tmp/ckpt-data", self.backing)
                    .replace("/mnt/ckpt", self.mnt))

    def test_shell(self):
        for tool in ("setfattr", "getfattr", "sqlite3", "od"):
            if not shutil.which(tool):
                self.fail(f"no {tool}: scripts/install-deps.sh installs it")
        script = "set -euo pipefail\n" + self.paths(block("Quick start from the shell", "sh"))
        env = ckptfs_util.daemon_env()
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                           env=env, cwd=REPO, stdin=subprocess.DEVNULL)
        self.assertEqual(r.returncode, 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}")
        self.assertIn("committed\ntensors 1\nblobs 0\nworld_size 1\n", r.stdout)
        self.assertIn("model.layer0.weight|float32|[4,4]", r.stdout)
        self.assertIn('user.ckpt.shape="4,4"', r.stdout)
        self.assertRegex(r.stdout, r"-r--r--r-- .* 64 .* weight")
        self.assertFalse(mountinfo_has(self.mnt), "the block's unmount did not happen")
        self.assertTrue(os.path.exists(self.bk("step-100", ".metadata")))

    def test_c(self):
        cc = shutil.which("cc") or shutil.which("gcc")
        if not cc:
            self.fail("no C compiler: scripts/install-deps.sh installs build-essential")
        src = os.path.join(self.dir, "save.c")
        with open(src, "w") as f:
            f.write(block("Quick start in C", "c"))
        exe = os.path.join(self.dir, "save")
        r = subprocess.run([cc, "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror",
                            "-o", exe, src], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.mount()
        r = subprocess.run([exe, self.mnt], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "row 2: 8 9 10 11\n")
        with open(self.ck("step-1", ".status")) as f:
            self.assertEqual(f.readline(), "committed\n")

    def test_python(self):
        py = next((p for p in (sys.executable, "/usr/bin/python3")
                   if subprocess.run([p, "-c", "import numpy"], capture_output=True).returncode == 0),
                  None)
        if not py:
            self.fail("no Python with numpy: scripts/install-deps.sh installs python3-numpy")
        self.mount()
        code = self.paths(block("Quick start in Python", "python"))
        r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}")
        self.assertIn("committed\ntensors 1\n", r.stdout)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""bench/bench.py --floor --quick runs to the end on the binary under test
and prints every figure of issue 26's table for its three state dicts (16
large tensors, the FSDP2 GPT with Adam state, 1,000 tensors of 4 KiB), each
a ratio of two times measured in the run; the GPT state dict has the shape
its docstring claims. Times are not checked (a CI machine is no benchmark):
the point is that the bench cannot rot.

    python3 tests/integration/test_bench.py --bin build/bin/ckptfs
"""

import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

from ckpttest import util
from ckpttest.util import main
from ckpttest.pyenv import REPO, require_torch

sys.path.insert(0, os.path.join(REPO, "bench"))
import floor_table  # noqa: E402

PLAIN = ["plain writer: sync save vs direct write + fsync",
         "async stall vs the one-copy floor (write, no fsync)",
         "warm load, verify=1, vs direct reads", "warm load, verify=0, vs direct reads",
         "warm load: verify=1 time vs verify=0", "cold load, verify=1, vs direct reads",
         "cold load, verify=0, vs direct reads"]
DCP = ["dcp.save via ckptfs.dcp.Writer vs stock dcp.save", "ckptfs.save vs stock dcp.save",
       "dcp.load via ckptfs.dcp.Reader vs stock dcp.load"]


class FloorTable(unittest.TestCase):
    def test_gpt_state_dict(self):
        ts, _ = floor_table.state_dict("gpt", 256 << 20)
        self.assertEqual(len(ts), 400)
        self.assertEqual(sum(1 for t in ts if not t.shape), 100)      # Adam steps
        self.assertEqual(sum(1 for t in ts if t.path.endswith("/exp_avg_sq")), 100)
        total = sum(t.nbytes for t in ts)
        self.assertTrue(200 << 20 < total <= 256 << 20, total)
        sizes = {t.nbytes for t in ts if t.shape}
        self.assertGreater(max(sizes) / min(sizes), 1000)           # mixed sizes
        for t in ts:                                                 # shards tile each tensor
            got = sum(t.local(r, 4)[1] for r in range(4)) if t.shape else t.local(0, 4)[1]
            self.assertEqual(got, t.nbytes, t.path)

    def test_quick_run_prints_every_figure(self):
        py = require_torch(self)
        with tempfile.TemporaryDirectory(prefix="ckptfs-bench-") as tmp:
            out = os.path.join(tmp, "out.json")
            # two of the three state dicts: gpt (mixed sizes, DCP) and
            # small (its own branch: DCP in one process); large differs
            # from gpt only in its tensors (test_gpt_state_dict's kind)
            r = subprocess.run([py, os.path.join(REPO, "bench", "bench.py"), "--floor", "--quick",
                                "--cases", "gpt,small", "--no-venv", "--bin", util.BIN,
                                "--backing", os.path.join(tmp, "b"), "--json", out],
                               capture_output=True, text=True, timeout=600)
            self.assertEqual(r.returncode, 0, r.stderr[-3000:])
            with open(out) as f:
                table = json.load(f)["table"]
        self.assertIn("| figure | now | goal |", r.stdout)
        for case in ("gpt", "small"):
            got = [row for row in table if f"({case} " in row["figure"]]
            want = PLAIN + DCP
            self.assertEqual([row["figure"].rsplit(" (", 1)[0] for row in got], want, case)
            for row in got:
                self.assertTrue(row["time"] > 0 and row["limit"] > 0, row)
                self.assertTrue(math.isfinite(row["ratio"]) and row["ratio"] > 0, row)
                self.assertIn(row["figure"].rsplit(" (", 1)[0], r.stdout)
        scored = [row for row in table if row["goal"] != "-"]
        self.assertTrue(all(row["met"] in (True, False) for row in scored))


if __name__ == "__main__":
    main()

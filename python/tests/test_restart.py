#!/usr/bin/env python3
"""Crash and restart of a DCP training job on the same rank mounts (torch
2.13.0 under mpirun + gloo, FSDP2 where this torch can, Adam, async DCP
saves through ckptfs.dcp.Writer every 2 steps; python/tests/dcp_job.py
train_restart). The job SIGKILLs itself at a kill point (a rank, or every
rank, before a save, while it stages, right after its async save
returned); mpirun takes the rest of the job down. Then, on the same
mounts (the daemons never restarted):

  - no leftover of the killed job stays staged or committing on any rank
    for more than a few seconds (abandoned: the job is gone);
  - the restarted job resumes from ckptfs.latest() (the newest committed
    checkpoint, the same on every rank), saves the same names again
    without an error, and ends bit-exact with an uninterrupted run.

The kill points here are a representative few; CKPT_RESTART_ALL=1 (the
ctest label long) runs every one.

    PYTHONPATH=tests/integration:python \\
        python3 python/tests/test_restart.py --bin build/bin/ckptfs
"""

import os
import time

from ckpttest import util
from ckpttest.util import main, read_log
from test_dcp import DcpCase

QUICK = ["0:before:4", "1:after:4", "all:staging:6"]
ALL = [f"{r}:{w}:{s}" for s in (2, 4, 6, 8) for w in ("before", "staging", "after")
       for r in ("0", "1", "all")]


class Restart(DcpCase):

    def leftovers(self, w):
        return util.leftovers([w.mnt(r) for r in range(w.n)])

    def test_kill_points(self):
        ref_world = self.start_world(2, "commit_timeout=120",
                                     backing=os.path.join(self.dir, "ref"))
        ref = self.job(2, "train_restart", self.spec(ref_world), "run")
        self.stop(ref_world)
        digest = ref[0]["digest"]
        points = ALL if os.environ.get("CKPT_RESTART_ALL") == "1" else QUICK
        for point in points:
            with self.subTest(point=point):
                self.one(point, digest)

    def one(self, point, digest):
        w = self.start_world(2, "commit_timeout=120",
                             backing=os.path.join(self.dir, point.replace(":", "-")))
        t0 = time.monotonic()
        self.job(2, "train_restart", self.spec(w), "run", point, expect_ok=False)
        killed = time.monotonic()
        try:
            util.wait_until(lambda: not self.leftovers(w), 10, "no leftovers")
        except TimeoutError:
            self.fail(f"{point}: left {self.leftovers(w)}\n{read_log(w.log)[-4000:]}")
        settled = time.monotonic() - killed
        out = self.job(2, "train_restart", self.spec(w), "resume")
        took = time.monotonic() - killed
        for r in range(2):
            self.assertEqual(out[r]["digest"], digest,
                             f"{point}: rank {r} resumed from {out[r]['resumed']}: "
                             "not bit-exact with the uninterrupted run")
        print(f"\n  {point}: killed run {killed - t0:.1f} s, leftovers gone in "
              f"{settled:.2f} s, resumed from {out[0]['resumed']}, restart "
              f"{took:.1f} s", flush=True)
        self.assertIn("step-8", os.listdir(w.mnt(0)))
        self.stop(w)


if __name__ == "__main__":
    main()

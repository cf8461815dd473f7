#!/usr/bin/env python3
"""torchrun's elastic restart over ckptfs rank mounts, as
examples/python/torchrun_elastic.py shows it (docs/pytorch.md, "After a
crash"): torchrun --standalone --nproc-per-node 2 --max-restarts 1
--no-python ckpt-rank-exec ROOT PATH -- python torchrun_elastic.py (FSDP2
on gloo, dcp.save through ckptfs.dcp.Writer every 2 of 8 steps). On
attempt 0 rank 1 SIGKILLs itself in the middle of its save of step-6;
torchrun stops rank 0 (waiting in that save's commit) and restarts both.
Checked:

  - torchrun exits 0; it saw rank 1 die by SIGKILL, and never said it
    could not stop a worker (every worker of attempt 0 left the kernel:
    none is left in a FUSE request; their pids are gone);
  - each daemon abandoned the killed job's step-6 (the log says so);
  - attempt 1 resumed on both ranks from the newest checkpoint committed
    before the kill (step-4), saved step-6 and step-8 again without an
    error, and ends bit-exact with a run never interrupted (a second
    world); step-2..8 committed on both mounts, nothing else left.

    PYTHONPATH=tests/integration:python \\
        python3 python/tests/test_elastic.py --bin build/bin/ckptfs
"""

import os
import re
import subprocess
import time

from ckpttest import REPO
from ckpttest.pyenv import EXAMPLES, PACKAGE, require_torch
from ckpttest.util import CkptfsTestCase, main, read_log, status
from test_dcp import free_port

EXAMPLE = os.path.join(EXAMPLES, "torchrun_elastic.py")
RANK_EXEC = os.path.join(REPO, "mount-scripts", "ckpt-rank-exec")
LINE = re.compile(r"^rank (\d) \(attempt (\d), pid (\d+)\): (.*)$", re.M)
NAMES = ["step-2", "step-4", "step-6", "step-8"]


class TorchrunRestart(CkptfsTestCase):

    def setUp(self):
        super().setUp()
        self.py = require_torch(self)

    def torchrun(self, w, *args):
        """The example under torchrun (2 workers, 1 restart) over world w;
        (returncode, stdout, stderr, seconds)."""
        path = os.path.join(self.dir, f"ckpt-{os.path.basename(w.root)}")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=PACKAGE)
        # 127.0.0.1, not --standalone's "localhost": a minimal system
        # (a fresh debootstrap) has no /etc/hosts to resolve it
        cmd = [self.py, "-m", "torch.distributed.run", "--nnodes", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               "--local-addr", "127.0.0.1", "--nproc-per-node", "2", "--max-restarts", "1", "--no-python",
               RANK_EXEC, w.root, path, "--",
               self.py, EXAMPLE, "--mount", path, *args]
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                           env=env, stdin=subprocess.DEVNULL)
        return r.returncode, r.stdout, r.stderr, time.monotonic() - t0

    def events(self, out):
        """{(attempt, rank): [messages]} and {(attempt, rank): pid}."""
        said, pids = {}, {}
        for rank, attempt, pid, msg in LINE.findall(out):
            said.setdefault((int(attempt), int(rank)), []).append(msg)
            pids[(int(attempt), int(rank))] = int(pid)
        return said, pids

    def test_kill_mid_save_restart_resumes(self):
        t0 = time.monotonic()
        ref_world = self.start_world(2, "commit_timeout=120",
                                     backing=os.path.join(self.dir, "ref"))
        rc, out, err, ref_took = self.torchrun(ref_world)
        self.assertEqual(rc, 0, f"the uninterrupted run:\n{out}\n{err[-6000:]}")
        ref_said, _ = self.events(out)
        ref = {m.split()[-1] for m in ref_said[(0, 0)] + ref_said[(0, 1)]
               if m.startswith("final state sha256")}
        self.assertEqual(len(ref), 1, out)
        self.assertEqual(ref_world.stop(), 0, "the reference world's mpirun")

        w = self.start_world(2, "commit_timeout=120")
        rc, out, err, took = self.torchrun(w, "--crash-in-save", "1:6")
        report = f"\n--- stdout\n{out}\n--- stderr\n{err[-6000:]}"
        self.assertEqual(rc, 0, "torchrun failed" + report)
        said, pids = self.events(out)
        self.assertEqual(sorted(said), [(0, 0), (0, 1), (1, 0), (1, 1)], report)

        # attempt 0: step-2 and step-4 committed, rank 1 died saving step-6
        for r in (0, 1):
            saved = [m for m in said[(0, r)] if m.startswith("saved ")]
            self.assertEqual(saved, ["saved step-2", "saved step-4"], report)
        self.assertIn("SIGKILL in the middle of the save (--crash-in-save)",
                      said[(0, 1)], report)
        # torchrun saw that very process die by SIGKILL (ckpt-rank-exec
        # execs the trainer in its place), stopped rank 0, and never had to
        # give up on a worker stuck in the kernel
        self.assertRegex(err, rf"exitcode: -9\) local_rank: 1 \(pid: {pids[(0, 1)]}\)",
                         report)
        for sign in ("Unable to shutdown process", "did not exit after"):
            self.assertNotIn(sign, err, report)
        for r in (0, 1):
            pid = pids[(0, r)]
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    alive = b"torchrun_elastic" in f.read()
            except OSError:
                alive = False
            self.assertFalse(alive, f"attempt 0's rank {r} (pid {pid}) is still there")

        # both daemons abandoned the killed attempt's save of step-6 (rank
        # 1's staged, rank 0's staged or committing), naming its job
        log = read_log(w.log, 1 << 24)
        for r in (0, 1):
            self.assertRegex(log, r"step-6: abandoned: the job that wrote it is gone "
                                  rf"\(process {pids[(0, r)]}, [^)]*"
                                  rf"TORCHELASTIC_RESTART_COUNT=0 RANK={r} ", log[-4000:])

        # attempt 1: resumed from the newest committed, saved the same names
        for r in (0, 1):
            self.assertEqual(said[(1, r)][0],
                             "resumed from step-4 (the newest committed), step 4", report)
            saved = [m for m in said[(1, r)] if m.startswith("saved ")]
            self.assertEqual(saved, ["saved step-6", "saved step-8"], report)
            final = [m.split()[-1] for m in said[(1, r)] if m.startswith("final state")]
            self.assertEqual(final, list(ref), f"rank {r}: not bit-exact with the "
                             "uninterrupted run" + report)
        self.assertNotIn("Traceback", out + err, report)
        for r in (0, 1):
            names = sorted(n for n in os.listdir(w.mnt(r)) if not n.startswith("."))
            self.assertEqual(names, NAMES, f"rank {r}")
            for n in names:
                self.assertEqual(status(os.path.join(w.mnt(r), n)).split("\n")[0],
                                 "committed", f"rank {r}: {n}")
        print(f"\n  uninterrupted run {ref_took:.1f} s; killed and restarted run "
              f"{took:.1f} s; test {time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()

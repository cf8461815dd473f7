"""The world checked at once (issue 25): a mount's root tells its ckptfs
world (user.ckpt.world_size, user.ckpt.rank), and ckptfs.dcp.Writer and the
plain client refuse a trainer whose world size or rank is not the mount's,
within seconds and before anything is staged, naming both numbers (without
the check a save waited commit_timeout for ranks that never come, or wrote
one rank's part into another rank's mount).

    python3 python/tests/test_world.py --bin build/bin/ckptfs
"""

import errno
import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
import ckptfs_util  # noqa: E402
from ckptfs_util import CkptfsTestCase, main  # noqa: E402
from mpi_world import MPIRUN, World  # noqa: E402
from pyenv import PACKAGE, require_torch  # noqa: E402

sys.path.insert(0, PACKAGE)
import ckptfs  # noqa: E402  (the client under test)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A 2-process DCP trainer saving through ckptfs.dcp.Writer; each rank prints
# how long dcp.save and dcp.load took to raise and what they raised
# (into DIR/rankR.json).
DCP_TRAINER = r'''
import json, os, sys, time, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
import ckptfs.dcp
rank = int(os.environ["OMPI_COMM_WORLD_RANK"]); ws = int(os.environ["OMPI_COMM_WORLD_SIZE"])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group("gloo", rank=rank, world_size=ws)
sd = {"w": torch.arange(1000, dtype=torch.float32) + rank, "step": 3}
t0 = time.monotonic()
try:
    dcp.save(sd, checkpoint_id="mismatch",
             storage_writer=ckptfs.dcp.Writer(sys.argv[1]))
    err = None
except BaseException as e:  # DCP raises CheckpointException, a BaseException
    err = f"{type(e).__name__}: {e}"
secs = time.monotonic() - t0
t0 = time.monotonic()
try:
    dcp.load(sd, checkpoint_id="mismatch",
             storage_reader=ckptfs.dcp.Reader(sys.argv[1]))
    load_err = None
except BaseException as e:
    load_err = f"{type(e).__name__}: {e}"
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "secs": secs, "error": err,
               "load_secs": time.monotonic() - t0, "load_error": load_err}, f)
sys.stdout.flush()
os._exit(0)
'''


class World3Trainer2(CkptfsTestCase):

    def setUp(self):
        super().setUp()
        self.py = require_torch(self)
        log = os.path.join(self.dir, "world.log")
        self.extra_logs.append(log)
        # a short commit_timeout: without the check the save fails after it
        self.w = World(ckptfs_util.BIN, 3, self.backing, os.path.join(self.dir, "w"),
                       log, opts="commit_timeout=30")
        self.addCleanup(self.w.stop)
        self.w.start()

    def test_root_tells_the_world(self):
        from ckptfs._client import mount_world
        for r in range(3):
            m = self.w.mnt(r)
            self.assertEqual(os.getxattr(m, "user.ckpt.world_size"), b"3")
            self.assertEqual(os.getxattr(m, "user.ckpt.rank"), str(r).encode())
            self.assertLessEqual({"user.ckpt.world_size", "user.ckpt.rank"},
                                 set(os.listxattr(m)))
            self.assertEqual(mount_world(m), (r, 3))
            with self.assertRaises(OSError) as cm:
                os.setxattr(m, "user.ckpt.world_size", b"2")
            self.assertEqual(cm.exception.errno, errno.ENOTSUP)
            self.assertEqual(os.getxattr(m, "user.ckpt.world_size"), b"3")
        self.assertIsNone(mount_world(self.dir))   # not a ckptfs mount

    def test_dcp_trainer_of_2_over_world_of_3_fails_at_once(self):
        env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                   PYTHONPATH=PACKAGE, PYTHONWARNINGS="ignore")
        spec = os.path.join(self.w.root, "rank%r")
        r = subprocess.run(MPIRUN + ["-np", "2", "-x", "MASTER_PORT", "-x", "PYTHONPATH",
                                     "-x", "OMP_NUM_THREADS", "-x", "PYTHONWARNINGS",
                                     self.py, "-c", DCP_TRAINER, spec, self.dir],
                           capture_output=True, text=True, timeout=300, env=env,
                           stdin=subprocess.DEVNULL)
        res = {}
        for rank in range(2):
            path = os.path.join(self.dir, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    res[rank] = json.load(f)
        self.assertEqual(sorted(res), [0, 1], r.stdout[-3000:] + r.stderr[-3000:])
        for rank, d in res.items():
            self.assertIsNotNone(d["error"], f"rank {rank} saved into a world of 3")
            self.assertLess(d["secs"], 5.0, f"rank {rank}: {d}")
            self.assertIn("the trainer runs 2 ranks", d["error"])
            self.assertIn("a ckptfs world of 3 ranks", d["error"])
            # the Reader of a trainer checks as well
            self.assertIsNotNone(d["load_error"])
            self.assertLess(d["load_secs"], 5.0, f"rank {rank}: {d}")
            self.assertIn("the trainer runs 2 ranks", d["load_error"])
            self.assertIn("a ckptfs world of 3 ranks", d["load_error"])
        # nothing staged on any mount
        for m in self.w.mnts():
            self.assertNotIn("mismatch", os.listdir(m))
        why = [ln for ln in res[0]["error"].splitlines() if "ckptfs world of" in ln]
        print(f"\n  dcp.save raised after {[round(res[r]['secs'], 2) for r in (0, 1)]} s, "
              f"dcp.load after {[round(res[r]['load_secs'], 2) for r in (0, 1)]} s: "
              f"{why[0] if why else ''}", file=sys.stderr)


class ClientRank(CkptfsTestCase):

    def test_client_rank_1_into_a_1_rank_mount_refused(self):
        self.mount()
        sd = {"w": b"x" * 100, "step": 1}
        for fn in (ckptfs.save, ckptfs.async_save):
            t0 = time.monotonic()
            with self.assertRaises(ckptfs.CkptfsError) as cm:
                fut = fn(sd, self.mnt, "wrong", rank=1)
                if fut is not None:   # async_save: its future must not be made
                    fut.result(timeout=60)
            self.assertLess(time.monotonic() - t0, 5.0)
            msg = str(cm.exception)
            self.assertIn("rank 1", msg)
            self.assertIn("mount of rank 0", msg)
            self.assertNotIn("wrong", os.listdir(self.mnt))
        # the matching rank saves, and a solo save (a world of one) too
        ckptfs.save(sd, self.mnt, "right", rank=0)
        ckptfs.save(sd, self.mnt, "solo", rank=1, solo=True)
        self.assertEqual(ckptfs.load(None, self.mnt, "right")["step"], 1)


if __name__ == "__main__":
    main()

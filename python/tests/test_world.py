"""The world checked at once (issue 25): a mount's root tells its ckptfs
world (user.ckpt.world_size, user.ckpt.rank), and ckptfs.dcp.Writer and the
plain client refuse a trainer whose world size or rank is not the mount's,
within seconds and before anything is staged, naming both numbers (without
the check a save waited commit_timeout for ranks that never come, or wrote
one rank's part into another rank's mount). The cases of issue 25: 3 rank
mounts and a 2-process trainer (ckptfs.dcp.Writer; ckptfs.save and
ckptfs.commit without torch.distributed, whose world is the launcher's),
and a 3-process trainer over 2 mounts whose rank 2 finds a plain directory
at ROOT/rank2 (nothing may be written there).

    PYTHONPATH=tests/integration:python \\
        python3 python/tests/test_world.py --bin build/bin/ckptfs
"""

import errno
import json
import os
import socket
import subprocess
import sys
import time

from ckpttest.util import CkptfsTestCase, main
from ckpttest.world import MPIRUN
from ckpttest.pyenv import PACKAGE, require_torch

import ckptfs  # the client under test: python/ on PYTHONPATH


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


# A trainer of the plain client, without torch.distributed (its world is
# the launcher's): each rank saves with ckptfs.save, and commits files it
# wrote itself with ckptfs.commit (as echo sync > NAME/.commit would);
# each prints how long each took to raise and what it raised.
CLIENT_TRAINER = r'''
import json, os, sys, time
import ckptfs
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
mount = sys.argv[1].replace("%r", str(rank))
res = {"rank": rank}
for how in sys.argv[3].split(","):
    t0 = time.monotonic()
    try:
        if how == "save":
            ckptfs.save({"w": b"x" * 100000, "step": 3}, mount, "mm-save", rank=rank)
        else:
            os.makedirs(os.path.join(mount, "mm-commit"))
            with open(os.path.join(mount, "mm-commit", "f"), "wb") as f:
                f.write(b"y")
            ckptfs.commit(mount, "mm-commit")
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    res[how] = {"secs": time.monotonic() - t0, "error": err}
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump(res, f)
'''


class Mismatch(CkptfsTestCase):
    """A trainer of n processes over a ckptfs world of another size."""

    def world_of(self, n, opts="commit_timeout=30"):
        # a short commit_timeout: without the check the save fails after it
        self.w = self.start_world(n, opts, root=os.path.join(self.dir, "w"))

    def trainer(self, n, py, code, *args, env=None):
        """Run code at n processes under mpirun; {rank: its JSON}."""
        env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                   PYTHONPATH=PACKAGE, PYTHONWARNINGS="ignore")
        spec = os.path.join(self.w.root, "rank%r")
        r = subprocess.run(MPIRUN + ["-np", str(n), "-x", "MASTER_PORT", "-x", "PYTHONPATH",
                                     "-x", "OMP_NUM_THREADS", "-x", "PYTHONWARNINGS",
                                     py, "-c", code, spec, self.dir, *args],
                           capture_output=True, text=True, timeout=300, env=env,
                           stdin=subprocess.DEVNULL)
        res = {}
        for rank in range(n):
            path = os.path.join(self.dir, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    res[rank] = json.load(f)
                os.unlink(path)
        self.assertEqual(sorted(res), list(range(n)), r.stdout[-3000:] + r.stderr[-3000:])
        return res

    def assert_refused(self, d, what, trainer, world):
        self.assertIsNotNone(d["error"], f"{what} went ahead: {d}")
        self.assertLess(d["secs"], 5.0, f"{what}: {d}")
        self.assertIn(f"the trainer runs {trainer} ranks", d["error"])
        self.assertIn(f"a ckptfs world of {world} ranks", d["error"])


class World3Client2(Mismatch):

    def test_client_trainer_of_2_over_world_of_3_fails_at_once(self):
        """ckptfs.save and ckptfs.commit at 2 processes without
        torch.distributed: the launcher's world size is the trainer's."""
        self.world_of(3)
        res = self.trainer(2, sys.executable, CLIENT_TRAINER, "save,commit")
        for rank, d in res.items():
            for how in ("save", "commit"):
                self.assert_refused(d[how], f"rank {rank} {how}", 2, 3)
        for m in self.w.mnts():
            self.assertNotIn("mm-save", os.listdir(m))
        print(f"\n  ckptfs.save raised after {[round(res[r]['save']['secs'], 2) for r in (0, 1)]}"
              f" s, ckptfs.commit after {[round(res[r]['commit']['secs'], 2) for r in (0, 1)]}"
              " s", file=sys.stderr)


class World2Trainer3(Mismatch):
    """3 trainer processes over 2 mounts: rank 2's path ROOT/rank2 is a
    plain directory (left by an earlier, larger world, or made by a
    prolog): nothing may be written there, and every rank fails at once."""

    def setUp(self):
        super().setUp()
        self.world_of(2)
        self.plain = os.path.join(self.w.root, "rank2")
        os.mkdir(self.plain)

    def test_dcp_trainer_of_3_over_world_of_2(self):
        py = require_torch(self)
        res = self.trainer(3, py, DCP_TRAINER)
        for rank, d in res.items():
            self.assert_refused({"error": d["error"], "secs": d["secs"]},
                                f"rank {rank} dcp.save", 3, 2)
        self.assertEqual(os.listdir(self.plain), [])

    def test_client_trainer_of_3_over_world_of_2(self):
        res = self.trainer(3, sys.executable, CLIENT_TRAINER, "save")
        for rank, d in res.items():
            self.assertIsNotNone(d["save"]["error"], f"rank {rank} saved")
            self.assertLess(d["save"]["secs"], 5.0, f"rank {rank}: {d}")
        for rank in (0, 1):
            self.assert_refused(res[rank]["save"], f"rank {rank} save", 3, 2)
        self.assertIn(f"{self.plain} is not a ckptfs mount", res[2]["save"]["error"])
        self.assertIn("the trainer runs 3 ranks", res[2]["save"]["error"])
        self.assertIn("a ckptfs world of 2 ranks", res[2]["save"]["error"])
        self.assertEqual(os.listdir(self.plain), [])


class World3Trainer2(CkptfsTestCase):

    def setUp(self):
        super().setUp()
        self.py = require_torch(self)
        # a short commit_timeout: without the check the save fails after it
        self.w = self.start_world(3, "commit_timeout=30", root=os.path.join(self.dir, "w"))

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

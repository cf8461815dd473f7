#!/usr/bin/env python3
"""Several mounts over one BACKING_DIR (other worlds on this node or on
others): publishing a checkpoint is exclusive.

    python3 tests/integration/test_shared.py --bin build/bin/ckptfs [Class ...]

Classes:
  SameName   two and three one-rank mounts commit one NAME at once, with
             different bytes, many rounds (sync and async): exactly one
             commit succeeds, every other fails with EEXIST and its .status
             says the name was committed elsewhere; the published checkpoint
             is the winner's, whole (ckptfs-fsck clean, bytes exact on a
             fresh mount); nothing of the losers is left in BACKING_DIR, and
             a loser's staged checkpoint stays staged
  Visibility a checkpoint committed through one mount is seen by another at
             once by name (stat, open) and in listings within about a
             second, without a remount; one removed through one mount is
             gone from the other; a refused one (a gap) that appears is not
             shown and is logged once
  PerNodeBacking  a world whose ranks have a BACKING_DIR each (as nodes
             with local directories would): every rank's commit fails,
             saying BACKING_DIR must be shared, and nothing is left or
             deleted in either directory
  Leftovers  a save that was interrupted (killed daemon) leaves its own
             directory under .saves, never a NAME directory: the next mount
             removes it, and an unheld one only
Needs root (FUSE). Python standard library only.
"""

import errno
import os
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckptfs_util as cu  # noqa: E402
from ckptfs_util import (CkptfsTestCase, commit, read_all, status,  # noqa: E402
                         write_tensor, wait_state)

ROUNDS = 25
CKPT_SCAN_MAX_AGE = 1.0  # fs_int.h


def fsck(backing, *names):
    exe = os.path.join(os.path.dirname(cu.BIN), "ckptfs-fsck")
    return subprocess.run([exe, backing, *names], capture_output=True, text=True)


def payload(writer, rnd, n=64 * 1024):
    """Distinct bytes per writer and round (int32 values)."""
    base = (writer * 1000003 + rnd * 7919) & 0x7FFFFFFF
    return b"".join(((base + i) & 0x7FFFFFFF).to_bytes(4, "little") for i in range(n))


class SameName(CkptfsTestCase):
    def mounts_n(self, n, opts="sync_files=0"):
        mnts = []
        for i in range(n):
            mnt = os.path.join(self.dir, f"m{i}")
            self.mount(opts, mnt=mnt)
            mnts.append(mnt)
        return mnts

    def race(self, mnts, name, rnd, mode):
        """Stage NAME on every mount with its own bytes, commit all at once;
        return the outcome per mount: 0 or an errno."""
        for w, mnt in enumerate(mnts):
            ck = self.ck(name, mnt=mnt)
            os.mkdir(ck)
            write_tensor(os.path.join(ck, "t"), "int32", [64 * 1024], payload(w, rnd))
            os.makedirs(os.path.join(ck, "sub"))
            with open(os.path.join(ck, "sub", "writer"), "wb") as f:
                f.write(str(w).encode())
        start = threading.Barrier(len(mnts))
        out = [None] * len(mnts)

        def go(w):
            start.wait()
            try:
                commit(self.ck(name, mnt=mnts[w]), mode)
                if mode == "async":
                    st = wait_state(self.ck(name, mnt=mnts[w]), timeout=120)
                    out[w] = 0 if st.startswith("committed") else -1
                else:
                    out[w] = 0
            except OSError as e:
                out[w] = e.errno
        ts = [threading.Thread(target=go, args=(w,)) for w in range(len(mnts))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return out

    def check_round(self, mnts, name, rnd, out, mode):
        winners = [w for w, o in enumerate(out) if o == 0]
        self.assertEqual(len(winners), 1, f"round {rnd} ({mode}): exactly one commit of {name} "
                                          f"must succeed: outcomes {out}")
        win = winners[0]
        for w, o in enumerate(out):
            if w == win:
                continue
            st = status(self.ck(name, mnt=mnts[w]))
            if mode == "sync":
                self.assertEqual(o, errno.EEXIST, f"round {rnd}: the loser's commit must fail "
                                                  f"with EEXIST, got {o}; .status: {st}")
            self.assertIn("committed elsewhere", st,
                          f"round {rnd}: the loser's .status must say so:\n{st}")
            # the loser's staged data is still there
            self.assertEqual(read_all(self.ck(name, "sub", "writer", mnt=mnts[w])),
                             str(w).encode())
        r = fsck(self.backing, name)
        self.assertEqual(r.returncode, 0, f"round {rnd}: ckptfs-fsck:\n{r.stdout}{r.stderr}")
        # only the winner's files: its .metadata and rank 0's data files
        stored = os.listdir(self.bk(name))
        self.assertIn(".metadata", stored)
        self.assertFalse([f for f in stored if f != ".metadata" and
                          not (f.startswith("__0_") and f.endswith(".distcp"))],
                         f"round {rnd}: in {name}: {stored}")
        self.assertEqual(read_all(self.ck(name, "t", mnt=mnts[win])), payload(win, rnd),
                         f"round {rnd}: the winner's mount must serve its bytes")
        left = [e for e in os.listdir(self.backing) if e not in (name, ".staging")]
        self.assertFalse([e for e in left if not e.startswith("r")],
                         f"round {rnd}: left in BACKING_DIR: {left}")
        return win

    def run_rounds(self, n_mounts, mode):
        mnts = self.mounts_n(n_mounts)
        wins = [0] * n_mounts
        for rnd in range(ROUNDS):
            name = f"r{rnd:03d}"
            out = self.race(mnts, name, rnd, mode)
            wins[self.check_round(mnts, name, rnd, out, mode)] += 1
            for mnt in mnts:  # the losers discard their staged copies
                ck = self.ck(name, mnt=mnt)
                if os.path.isdir(ck) and "committed elsewhere" in status(ck):
                    subprocess.run(["rm", "-r", ck], check=True)
        print(f"\n  {n_mounts} mounts, {mode}: wins per mount {wins}", file=sys.stderr)
        # a fresh mount sees every winner, whole
        for m in self.mounts:
            m.stop()
        self.mounts.clear()
        fresh = os.path.join(self.dir, "fresh")
        self.mount(mnt=fresh)
        names = sorted(n for n in os.listdir(fresh))
        self.assertEqual(names, [f"r{i:03d}" for i in range(ROUNDS)])
        self.assertFalse(os.path.exists(self.bk(".saves")),
                         "the save directories must be gone")

    def test_two_mounts_sync(self):
        self.run_rounds(2, "sync")

    def test_three_mounts_sync(self):
        self.run_rounds(3, "sync")

    def test_two_mounts_async(self):
        self.run_rounds(2, "async")


class Visibility(CkptfsTestCase):
    def test_commit_and_removal_seen_by_another_mount(self):
        a, b = os.path.join(self.dir, "a"), os.path.join(self.dir, "b")
        self.mount(mnt=a)
        self.mount(mnt=b)
        self.assertEqual(os.listdir(b), [])  # listed (and cached) before
        data = payload(1, 1)
        ck = self.ck("x", mnt=a)
        os.mkdir(ck)
        write_tensor(os.path.join(ck, "t"), "int32", [64 * 1024], data)
        commit(ck)
        t0 = time.monotonic()
        while "x" not in os.listdir(b):
            self.assertLess(time.monotonic() - t0, 3, "mount b must list x within about a second")
            time.sleep(0.01)
        seen = time.monotonic() - t0
        print(f"\n  listed by the other mount after {seen * 1000:.0f} ms", file=sys.stderr)
        self.assertEqual(read_all(self.ck("x", "t", mnt=b)), data)
        self.assertIn("committed", status(self.ck("x", mnt=b)))
        # by name at once (no listing first)
        ck = self.ck("y", mnt=a)
        os.mkdir(ck)
        write_tensor(os.path.join(ck, "t"), "int32", [64 * 1024], payload(2, 2))
        commit(ck)
        self.assertEqual(read_all(self.ck("y", "t", mnt=b)), payload(2, 2))
        self.assertErrno(errno.EEXIST, os.mkdir, self.ck("y", mnt=b))
        # removed through a: gone from b by name at once, from listings soon
        subprocess.run(["rm", "-r", self.ck("x", mnt=a)], check=True)
        self.assertErrno(errno.ENOENT, os.stat, self.ck("x", mnt=b))
        t0 = time.monotonic()
        while "x" in os.listdir(b):
            self.assertLess(time.monotonic() - t0, 3, "the removal must show within a second")
            time.sleep(0.01)
        self.assertEqual(sorted(os.listdir(b)), ["y"])

    def test_refused_checkpoint_appearing_is_not_shown(self):
        a, b = os.path.join(self.dir, "a"), os.path.join(self.dir, "b")
        self.mount(mnt=a)
        self.mount(mnt=b)
        ck = self.ck("g", mnt=a)
        os.mkdir(ck)
        write_tensor(os.path.join(ck, "t"), "int32", [1024], payload(0, 0, 1024))
        commit(ck)
        # another copy whose tensor claims a shape its chunk does not cover
        import shutil
        import sqlite3
        shutil.copytree(self.bk("g"), os.path.join(self.dir, "gap"))
        db = sqlite3.connect(os.path.join(self.dir, "gap", ".metadata"))
        db.execute("update tensors set shape='[4096]'")
        db.commit()
        db.close()
        os.rename(os.path.join(self.dir, "gap"), self.bk("gap"))
        for _ in range(3):
            self.assertErrno(errno.ENOENT, os.stat, self.ck("gap", mnt=b))
            time.sleep(CKPT_SCAN_MAX_AGE)
            self.assertEqual(sorted(os.listdir(b)), ["g"])
        self.assertEqual(self.daemon_log().count("not showing checkpoint gap"), 1,
                         self.daemon_log())


class PerNodeBacking(unittest.TestCase):
    def test_commit_refused_on_every_rank(self):
        import shutil
        import tempfile
        from mpi_world import MPIRUN, TRANSPORTS, World
        if not shutil.which("mpirun"):
            self.fail("mpirun is missing")
        d = tempfile.mkdtemp(prefix="ckptfs-pernode-", dir="/tmp")
        self.addCleanup(shutil.rmtree, d, True)
        backs = [os.path.join(d, f"node{r}", "backing") for r in range(2)]
        for b in backs:
            os.makedirs(b)
        # something of each "node" that must survive
        for b in backs:
            with open(os.path.join(b, "keep"), "wb") as f:
                f.write(b"mine")

        class PerRank(World):
            def argv(self):
                cmd = MPIRUN + ["--mca", "btl", TRANSPORTS["vader"]]
                for var in ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS", "TSAN_OPTIONS"):
                    cmd += ["-x", var]
                for r in range(self.n):
                    if r:
                        cmd.append(":")
                    cmd += ["-np", "1", self.binary, "-f", "-o", "commit_timeout=30",
                            backs[r], self.mnt(r)]
                return cmd
        w = PerRank(cu.BIN, 2, backs[0], os.path.join(d, "mnt"), os.path.join(d, "log"))
        w.start()
        self.addCleanup(w.stop, 60)
        for r in range(2):
            ck = os.path.join(w.mnt(r), "step")
            os.mkdir(ck)
            write_tensor(os.path.join(ck, "t"), "int32", [2, 4], payload(r, 0, 4),
                         offsets=[r, 0], sizes=[1, 4])
        errs = [None, None]

        def go(r):
            try:
                commit(os.path.join(w.mnt(r), "step"))
            except OSError as e:
                errs[r] = e
        ts = [threading.Thread(target=go, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for r in range(2):
            self.assertIsInstance(errs[r], OSError, f"rank {r} must fail")
            st = status(os.path.join(w.mnt(r), "step"))
            self.assertIn("shared", st, f"rank {r}: .status must say why:\n{st}")
        for b in backs:
            self.assertEqual(sorted(os.listdir(b)), ["keep"], f"{b}: nothing left, nothing lost")
            with open(os.path.join(b, "keep"), "rb") as f:
                self.assertEqual(f.read(), b"mine")


class Leftovers(CkptfsTestCase):
    def test_killed_save_leaves_only_its_own_directory(self):
        env = {"CKPTFS_FAILPOINT": "write_done"}
        m = self.mount("sync_files=0", env=env)
        ck = self.ck("a")
        os.mkdir(ck)
        write_tensor(os.path.join(ck, "t"), "int32", [1024], payload(0, 0, 1024))
        try:
            commit(ck)
        except OSError:
            pass
        m.wait(60)
        self.mounts.clear()
        subprocess.run(["fusermount3", "-uz", self.mnt], capture_output=True)
        self.assertFalse(os.path.exists(self.bk("a")),
                         "an interrupted save must not leave a NAME directory")
        saves = os.listdir(self.bk(".saves"))
        self.assertEqual(len(saves), 1, saves)
        # a save directory somebody holds is left alone by a starting mount
        held = self.bk(".saves", "f" * 32)
        os.makedirs(held)
        fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_SH)
        self.mount()
        self.assertEqual(os.listdir(self.bk(".saves")), ["f" * 32])
        os.close(fd)
        self.assertEqual(os.listdir(self.mnt), [])


if __name__ == "__main__":
    cu.main()

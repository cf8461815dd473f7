#!/usr/bin/env python3
"""Removing one entry inside a committed checkpoint (issue 24): that entry
only, for every mount, atomically (a new version of the checkpoint), its
bytes freed; rm -r of the whole checkpoint from any mount; no ghost.

    python3 tests/integration/test_removal.py --bin build/bin/ckptfs [Class ...]

Classes:
  SingleEntry  two mounts of one BACKING_DIR: rm of one blob and of one
             tensor through mount a: gone on both mounts, every other file
             bit-exact on both and on a fresh mount, the checkpoint table
             the same but for save_id/previous_save_id/version, the removed
             rows gone (sqlite3), an unreferenced data file gone and the
             bytes of BACKING_DIR smaller; rmdir of an empty committed
             directory
  RmTree     rm -r of a 1000-blob checkpoint from mount b after rm of one
             blob on mount a: b exits 0, NAME gone from BACKING_DIR and from
             a's listing within a second (no ghost); the time is printed
             (rm -r unlinks .metadata first: the whole checkpoint at once)
  OpenReaders  handles opened on another mount before the removal: the
             removed items read their bytes or zeros (punched), EIO with
             verify=1; the rest unchanged; BACKING_DIR shrinks
  ReadsDuringRemovals  threads read what stays (new opens) on the removing
             mount and another while 40 entries are removed: no read fails
  StaleView  rm -r through a mount that showed the earlier version (by
             path, and one begun with NAME open before the removal
             elsewhere): NAME goes whole, no ghost; another save's NAME is
             never removed that way; replace= racing removals
  World2     a 2-rank world: rank 0 removes rank 1's file, both ranks see
             it, rm -r from rank 1, rank 0 stops listing NAME
  Rotation   Lightning-style top-k: several .ckpt blobs in one checkpoint,
             the oldest removed: the others bit-exact
  Concurrent two mounts each remove different entries at once, many
             rounds: every removal done, nothing else lost, fsck clean
  Crash      SIGKILL at each removal failpoint and at random times from
             outside while an entry is removed: the checkpoint is the old
             or the new version, bit-exact, fsck clean (20 trials)
Needs root (FUSE). Python standard library only.
"""

import errno
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import unittest

from ckpttest import util as cu
from ckpttest.util import CkptfsTestCase, commit, read_all, write_tensor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fsck_bin():
    return os.path.join(os.path.dirname(cu.BIN), "ckptfs-fsck")


def blob(i, n=4096):
    return random.Random(i).randbytes(n)


def du(path):
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def table(path, sql):
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return sorted(db.execute(sql).fetchall())
    finally:
        db.close()


class Base(CkptfsTestCase):
    def two(self):
        a, b = os.path.join(self.dir, "a"), os.path.join(self.dir, "b")
        self.mount(mnt=a)
        self.mount(mnt=b)
        return a, b

    def make(self, mnt, name, files, tensors=()):
        ck = self.ck(name, mnt=mnt)
        os.mkdir(ck)
        for rel, data in files.items():
            os.makedirs(os.path.dirname(os.path.join(ck, rel)), exist_ok=True)
            with open(os.path.join(ck, rel), "wb") as f:
                f.write(data)
        for rel, (dtype, shape, data) in dict(tensors).items():
            os.makedirs(os.path.dirname(os.path.join(ck, rel)), exist_ok=True)
            write_tensor(os.path.join(ck, rel), dtype, shape, data)
        commit(ck)
        return ck

    def fsck(self):
        r = subprocess.run([fsck_bin(), self.backing], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def listed(self, d):
        out = []
        for base, dirs, files in os.walk(d):
            dirs[:] = [x for x in dirs if not x.startswith(".")]
            for f in files:
                if base == d and f == ".metadata":
                    continue
                out.append(os.path.relpath(os.path.join(base, f), d))
        return sorted(out)


class SingleEntry(Base):
    def test_one_blob_and_one_tensor(self):
        a, b = self.two()
        files = {f"f{i}.bin": blob(i, 64 * 1024) for i in range(4)}
        tdata = cu.tensor_bytes("float32", [256, 64], seed=3)
        tensors = {"model/w": ("float32", [256, 64], tdata),
                   "model/v": ("float32", [256, 64], cu.tensor_bytes("float32", [256, 64], seed=4))}
        self.make(a, "c", files, tensors)
        md = self.bk("c", ".metadata")
        before = dict(table(md, "select key, value from checkpoint"))
        self.assertEqual(read_all(self.ck("c", "f1.bin", mnt=b)), files["f1.bin"])
        du0 = du(self.backing)
        os.unlink(self.ck("c", "f1.bin", mnt=a))
        # gone on both mounts at once, the rest intact
        self.assertErrno(errno.ENOENT, os.stat, self.ck("c", "f1.bin", mnt=a))
        self.assertErrno(errno.ENOENT, os.stat, self.ck("c", "f1.bin", mnt=b))
        for m in (a, b):
            self.assertNotIn("f1.bin", os.listdir(self.ck("c", mnt=m)))
            self.assertIn(".metadata", os.listdir(self.ck("c", mnt=m)))
            for k in ("f0.bin", "f2.bin", "f3.bin"):
                self.assertEqual(read_all(self.ck("c", k, mnt=m)), files[k], k)
            self.assertEqual(read_all(self.ck("c", "model", "w", mnt=m)), tdata)
        after = dict(table(md, "select key, value from checkpoint"))
        self.assertNotEqual(after["save_id"], before["save_id"])
        self.assertEqual(after["previous_save_id"], before["save_id"])
        self.assertEqual(after["version"], "2")
        for k in ("name", "created_at", "world_size", "format_version"):
            self.assertEqual(after[k], before[k], k)
        self.assertEqual([r[0] for r in table(md, "select fqn from blobs")],
                         ["f0.bin", "f2.bin", "f3.bin"])
        self.assertNotIn(("f1.bin",), table(md, "select path from entries"))
        # the tensor: its chunks go too; sqlite through the mount agrees
        os.unlink(self.ck("c", "model", "w", mnt=b))
        self.assertErrno(errno.ENOENT, os.stat, self.ck("c", "model", "w", mnt=a))
        self.assertEqual(table(self.ck("c", ".metadata", mnt=a), "select fqn from tensors"),
                         [("model.v",)])
        self.assertEqual(table(md, "select fqn from chunks"), [("model.v",)])
        self.assertEqual(dict(table(md, "select key, value from checkpoint"))["version"], "3")
        du1 = du(self.backing)
        self.assertLess(du1, du0 - 64 * 1024, f"bytes not freed: {du0} -> {du1}")
        print(f"\n  BACKING_DIR {du0} -> {du1} bytes after removing 64 KiB + 64 KiB",
              file=sys.stderr)
        self.assertEqual(sorted(os.listdir(self.bk())), ["c"])  # no .saves left
        self.fsck()
        # a fresh mount sees the same
        c = os.path.join(self.dir, "c3")
        self.mount(mnt=c)
        self.assertEqual(self.listed(self.ck("c", mnt=c)),
                         ["f0.bin", "f2.bin", "f3.bin", "model/v"])
        self.assertEqual(read_all(self.ck("c", "f3.bin", mnt=c)), files["f3.bin"])

    def test_unreferenced_data_file_goes(self):
        a, b = self.two()
        # one blob per rank-file: write a big one so that it fills a file
        files = {"big.bin": blob(1, 4 << 20), "small.bin": blob(2, 100)}
        self.make(a, "d", files)
        data_files = sorted(f for f in os.listdir(self.bk("d")) if f.endswith(".distcp"))
        du0 = du(self.bk("d"))
        os.unlink(self.ck("d", "big.bin", mnt=b))
        du1 = du(self.bk("d"))
        self.assertLess(du1, du0 - (3 << 20), f"{data_files}: {du0} -> {du1}")
        self.assertEqual(read_all(self.ck("d", "small.bin", mnt=a)), files["small.bin"])
        self.fsck()

    def test_rmdir_empty_directory_and_refusals(self):
        a, b = self.two()
        tdata = cu.tensor_bytes("int32", [4], seed=1)
        self.make(a, "e", {"sub/x": b"x" * 10, "keep": b"k" * 10},
                  {"t": ("int32", [4], tdata)})
        os.unlink(self.ck("e", "sub", "x", mnt=a))
        self.assertEqual(os.listdir(self.ck("e", "sub", mnt=b)), [])
        os.rmdir(self.ck("e", "sub", mnt=b))
        for m in (a, b):
            self.assertEqual(sorted(os.listdir(self.ck("e", mnt=m))), [".metadata", "keep", "t"])
        self.assertNotIn(("sub",), table(self.bk("e", ".metadata"), "select path from entries"))
        # not entries of the checkpoint: refused, nothing changes
        self.assertErrno(errno.EROFS, os.unlink, self.ck("e", ".npy", "t.npy", mnt=a))
        self.assertErrno(errno.EROFS, os.unlink, self.ck("e", ".t[0:2]", mnt=a))
        self.assertErrno(errno.EPERM, os.unlink, self.ck("e", ".status", mnt=a))
        self.assertEqual(read_all(self.ck("e", "t", mnt=b)), tdata)
        self.assertEqual(read_all(self.ck("e", "keep", mnt=b)), b"k" * 10)
        self.fsck()


class OpenReaders(Base):
    def test_reader_of_the_removed_entry_on_another_mount(self):
        """Handles opened on another mount before a removes f1 and big: the
        removed items read their bytes or zeros (their ranges punched out of
        data files other items share) with verify=0, never another item's;
        with verify=1 a chunk not verified before fails (EIO), one verified
        at open (read by passthrough) reads its bytes; the other
        entries' handles and new opens read their bytes."""
        a = os.path.join(self.dir, "a")
        self.mount(mnt=a)
        b = os.path.join(self.dir, "b")
        self.mount(mnt=b, opts="verify=1")
        c = os.path.join(self.dir, "c")
        self.mount(mnt=c, opts="verify=0")  # unchecked: what the data files hold
        files = {"f0": blob(0, 64 * 1024), "f1": blob(1, 64 * 1024),
                 "f2": blob(2, 64 * 1024), "big": blob(3, 6 << 20)}
        self.make(a, "o", files)
        du0 = du(self.backing)
        fds = {}
        for m, k in ((b, "f1"), (c, "f1"), (c, "big"), (c, "f2")):
            fd = os.open(self.ck("o", k, mnt=m), os.O_RDONLY)
            self.addCleanup(os.close, fd)
            fds[m, k] = fd
        os.unlink(self.ck("o", "f1", mnt=a))
        os.unlink(self.ck("o", "big", mnt=a))
        # verify=1: its bytes only if they were checked (FUSE passthrough
        # checks a whole-file item at open), else EIO; never zeros
        try:
            got = os.pread(fds[b, "f1"], 64 * 1024, 0)
        except OSError as e:
            self.assertEqual(e.errno, errno.EIO)
        else:
            self.assertTrue(got == files["f1"], "verify=1 served unchecked bytes")
        seen = []
        for k in ("f1", "big"):
            got = os.pread(fds[c, k], len(files[k]), 0)
            self.assertIn(got, (bytes(len(files[k])), files[k]), k)
            seen.append(f"{k}: {'zeros' if got != files[k] else 'its bytes'}")
        self.assertEqual(os.pread(fds[c, "f2"], 64 * 1024, 0), files["f2"])
        for m in (a, b, c):
            self.assertEqual(read_all(self.ck("o", "f0", mnt=m)), files["f0"])
        self.assertLess(du(self.backing), du0 - (5 << 20))
        print(f"\n  open handles on removed entries read: {', '.join(seen)}",
              file=sys.stderr)


class RmTree(Base):
    def test_rm_r_after_single_removal_no_ghost(self):
        a, b = self.two()
        files = {f"b{i:04d}": blob(i, 256) for i in range(1000)}
        self.make(a, "big", files)
        self.make(a, "other", {"o": b"o"})
        os.unlink(self.ck("big", "b0000", mnt=a))
        self.assertErrno(errno.ENOENT, os.stat, self.ck("big", "b0000", mnt=b))
        t0 = time.monotonic()
        subprocess.run(["rm", "-r", self.ck("big", mnt=b)], check=True)
        took = time.monotonic() - t0
        print(f"\n  rm -r of 999 blobs: {took:.2f} s", file=sys.stderr)
        self.assertFalse(os.path.exists(self.bk("big")), os.listdir(self.backing))
        t0 = time.monotonic()
        while "big" in os.listdir(a):
            self.assertLess(time.monotonic() - t0, 2, "a keeps listing big (a ghost)")
            time.sleep(0.02)
        self.assertErrno(errno.ENOENT, os.stat, self.ck("big", mnt=a))
        self.assertEqual(read_all(self.ck("other", "o", mnt=a)), b"o")
        self.assertLess(took, 10)
        self.fsck()

    def test_rm_r_on_the_same_mount(self):
        a, b = self.two()
        self.make(a, "t", {f"d{i}/f{j}": blob(i * 10 + j, 100) for i in range(3) for j in range(3)})
        subprocess.run(["rm", "-r", self.ck("t", mnt=a)], check=True)
        self.assertFalse(os.path.exists(self.bk("t")))
        self.assertErrno(errno.ENOENT, os.stat, self.ck("t", mnt=b))
        self.assertEqual(os.listdir(a), [])


class ReadsDuringRemovals(Base):
    def test_reads_on_the_removing_mount_never_fail(self):
        """Threads read the files that stay (new opens each time) on the
        mount that removes others one by one, and on another mount: every
        read returns its bytes."""
        import threading
        a, b = self.two()
        keep = {f"k{i}": blob(i, 8192) for i in range(4)}
        gone = {f"g{i:02d}": blob(100 + i, 8192) for i in range(40)}
        self.make(a, "rd", {**keep, **gone})
        stop, errors = threading.Event(), []

        def reader(m):
            while not stop.is_set():
                for k, v in keep.items():
                    try:
                        got = read_all(self.ck("rd", k, mnt=m))
                    except OSError as e:
                        errors.append(f"{m} {k}: {e!r}")
                        continue
                    if got != v:
                        errors.append(f"{m} {k}: other bytes")
        threads = [threading.Thread(target=reader, args=(m,)) for m in (a, a, b)]
        for t in threads:
            t.start()
        try:
            for k in gone:
                os.unlink(self.ck("rd", k, mnt=a))
        finally:
            stop.set()
            for t in threads:
                t.join()
        self.assertEqual(errors[:5], [], f"{len(errors)} failed reads")
        self.assertEqual(self.listed(self.ck("rd", mnt=b)), sorted(keep))


class StaleView(Base):
    def test_rm_r_through_a_mount_showing_the_earlier_version(self):
        """The issue's case: unlink NAME/x on mount a, then at once rm -r
        NAME on mount b, whose view (and the kernel's cached entries) are of
        the version before: NAME is gone from BACKING_DIR and from a."""
        a, b = self.two()
        for rnd in range(5):
            name = f"s{rnd}"
            files = {f"f{i}": blob(rnd * 10 + i, 3000) for i in range(5)}
            self.make(a, name, files)
            self.assertEqual(read_all(self.ck(name, "f1", mnt=b)), files["f1"])  # b's view
            os.unlink(self.ck(name, "f0", mnt=a))
            subprocess.run(["rm", "-r", self.ck(name, mnt=b)], check=True)
            self.assertFalse(os.path.exists(self.bk(name)), f"round {rnd}: data stays")
            t0 = time.monotonic()
            while name in os.listdir(a):
                self.assertLess(time.monotonic() - t0, 2, f"round {rnd}: a ghost on a")
                time.sleep(0.02)
        self.fsck()

    def test_rm_r_begun_before_a_removal_elsewhere(self):
        """An rm -r on mount b that opened NAME before mount a removed an
        entry inside it (its view is of the earlier version, through its
        open directory): NAME still goes as a whole, from BACKING_DIR and
        from a; a NAME committed anew by another save is never removed
        through such a view."""
        a, b = self.two()
        files = {f"f{i}": blob(i, 3000) for i in range(5)}
        self.make(a, "s", files)
        fd = os.open(self.ck("s", mnt=b), os.O_RDONLY | os.O_DIRECTORY)
        self.addCleanup(os.close, fd)
        names = os.listdir(fd)
        self.assertEqual(names[0], ".metadata")
        os.unlink(self.ck("s", "f0", mnt=a))
        for e in names:  # as rm -r goes on: .metadata first
            os.unlink(e, dir_fd=fd)
        os.rmdir(self.ck("s", mnt=b))
        self.assertFalse(os.path.exists(self.bk("s")), "data stays (a ghost)")
        t0 = time.monotonic()
        while "s" in os.listdir(a):
            self.assertLess(time.monotonic() - t0, 2, "a ghost on a")
            time.sleep(0.02)
        # another save's NAME is not a later version: left alone
        self.make(a, "t", files)
        fd2 = os.open(self.ck("t", mnt=b), os.O_RDONLY | os.O_DIRECTORY)
        self.addCleanup(os.close, fd2)
        subprocess.run(["rm", "-r", self.ck("t", mnt=a)], check=True)
        self.make(a, "t", {"new": b"new"})
        os.unlink(".metadata", dir_fd=fd2)
        self.assertTrue(os.path.exists(self.bk("t", ".metadata")))
        self.assertEqual(read_all(self.ck("t", "new", mnt=a)), b"new")
        self.fsck()

    def test_replace_races_removals(self):
        """sync replace=NAME on mount a while mount b removes NAME's files
        one by one: NAME ends as the replacement, whole."""
        a, b = self.two()
        old = {f"f{i}": blob(i, 2000) for i in range(10)}
        new = {f"g{i}": blob(100 + i, 2000) for i in range(10)}
        self.make(a, "r", old)
        os.listdir(self.ck("r", mnt=b))
        ck = self.ck("r-next", mnt=a)
        os.mkdir(ck)
        for k, v in new.items():
            with open(os.path.join(ck, k), "wb") as f:
                f.write(v)
        p = subprocess.Popen(["rm", "-f"] + [self.ck("r", k, mnt=b) for k in sorted(old)])
        with open(os.path.join(ck, ".commit"), "w") as f:
            f.write("sync replace=r\n")
        self.assertEqual(p.wait(), 0)
        c = os.path.join(self.dir, "c")
        self.mount(mnt=c)
        self.assertEqual(self.listed(self.ck("r", mnt=c)), sorted(new))
        for k, v in new.items():
            self.assertEqual(read_all(self.ck("r", k, mnt=c)), v)
        self.fsck()


class World2(Base):
    def test_single_removal_seen_by_both_ranks(self):
        from ckpttest.world import commit_all
        w = self.start_world(2, "commit_timeout=20")
        m = w.mnts()
        files = {r: {f"r{r}_{i}.ckpt": blob(r * 10 + i, 100 * 1024) for i in range(3)}
                 for r in range(2)}
        for r in range(2):
            os.mkdir(os.path.join(m[r], "n"))
            for k, v in files[r].items():
                with open(os.path.join(m[r], "n", k), "wb") as f:
                    f.write(v)
        res = commit_all(w, "n")
        self.assertEqual([res[r][0] for r in range(2)], [None, None], res)
        os.unlink(os.path.join(m[0], "n", "r1_0.ckpt"))  # rank 1's file, from rank 0
        want = sorted(k for r in range(2) for k in files[r] if k != "r1_0.ckpt")
        for r in range(2):
            self.assertErrno(errno.ENOENT, os.stat, os.path.join(m[r], "n", "r1_0.ckpt"))
            self.assertEqual(self.listed(os.path.join(m[r], "n")), want)
            for k in want:
                self.assertEqual(read_all(os.path.join(m[r], "n", k)), files[int(k[1])][k])
        subprocess.run(["rm", "-r", os.path.join(m[1], "n")], check=True)
        self.assertFalse(os.path.exists(self.bk("n")))
        t0 = time.monotonic()
        while "n" in os.listdir(m[0]):
            self.assertLess(time.monotonic() - t0, 2, "rank 0 keeps listing n")
            time.sleep(0.02)
        self.fsck()


class Rotation(Base):
    def test_top_k_rotation(self):
        a, b = self.two()
        files = {f"epoch={i}-step={i * 100}.ckpt": blob(i, 200 * 1024) for i in range(4)}
        self.make(a, "lightning", files)
        for i in range(2):
            os.remove(self.ck("lightning", f"epoch={i}-step={i * 100}.ckpt", mnt=a))
        for m in (a, b):
            self.assertEqual(sorted(os.listdir(self.ck("lightning", mnt=m))),
                             [".metadata", "epoch=2-step=200.ckpt", "epoch=3-step=300.ckpt"])
            for i in (2, 3):
                k = f"epoch={i}-step={i * 100}.ckpt"
                self.assertEqual(read_all(self.ck("lightning", k, mnt=m)), files[k])
        self.fsck()


class Concurrent(Base):
    def test_two_mounts_remove_at_once(self):
        a, b = self.two()
        for rnd in range(5):
            name = f"r{rnd}"
            files = {f"f{i:02d}": blob(rnd * 100 + i, 1000) for i in range(20)}
            self.make(a, name, files)
            os.listdir(self.ck(name, mnt=b))
            procs = [subprocess.Popen(["rm"] + [self.ck(name, f"f{i:02d}", mnt=m)
                                                for i in range(lo, 20, 2)])
                     for m, lo in ((a, 0), (b, 1))]
            for p in procs:
                self.assertEqual(p.wait(), 0)
            left = table(self.bk(name, ".metadata"), "select fqn from blobs")
            self.assertEqual(left, [], f"round {rnd}: left {left}")
        self.fsck()

    def test_interleaved_keep_some(self):
        a, b = self.two()
        files = {f"f{i:02d}": blob(i, 1000) for i in range(30)}
        self.make(a, "k", files)
        os.listdir(self.ck("k", mnt=b))
        gone_a = [f"f{i:02d}" for i in range(0, 10)]
        gone_b = [f"f{i:02d}" for i in range(10, 20)]
        procs = [subprocess.Popen(["rm"] + [self.ck("k", f, mnt=m) for f in fs])
                 for m, fs in ((a, gone_a), (b, gone_b))]
        for p in procs:
            self.assertEqual(p.wait(), 0)
        keep = [f"f{i:02d}" for i in range(20, 30)]
        self.assertEqual([r[0] for r in table(self.bk("k", ".metadata"), "select fqn from blobs")], keep)
        c = os.path.join(self.dir, "c")
        self.mount(mnt=c)
        for m in (a, b, c):
            for f in keep:
                self.assertEqual(read_all(self.ck("k", f, mnt=m)), files[f])
        self.fsck()


POINTS = ["remove_linked", "remove_metadata", "remove_exchanged", "remove_old"]


class Crash(Base):
    def one(self, trial, env=None, kill_after=None):
        files = {f"f{i}": blob(trial * 10 + i, 50 * 1024) for i in range(6)}
        m = self.mount(env=env)
        name = f"c{trial}"
        self.make(self.mnt, name, files)
        p = subprocess.Popen(["rm", self.ck(name, "f2")], stderr=subprocess.DEVNULL)
        if kill_after is not None:
            time.sleep(kill_after)
            try:
                os.kill(m.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
        m.stop()
        subprocess.run(["fusermount3", "-uz", self.mnt], capture_output=True)
        self.mounts.remove(m)
        m2 = self.mount()
        got = self.listed(self.ck(name))
        want_old = sorted(files)
        want_new = sorted(k for k in files if k != "f2")
        self.assertIn(got, (want_old, want_new), f"trial {trial}")
        for k in got:
            self.assertEqual(read_all(self.ck(name, k)), files[k], f"trial {trial} {k}")
        blobs = [r[0] for r in table(self.bk(name, ".metadata"), "select fqn from blobs")]
        self.assertEqual(blobs, got)
        keys = dict(table(self.bk(name, ".metadata"), "select key, value from checkpoint"))
        self.assertEqual(keys.get("version"), "2" if got == want_new else None, keys)
        m2.stop()
        self.mounts.remove(m2)
        self.fsck()
        self.assertFalse(os.path.exists(self.bk(".saves")) and os.listdir(self.bk(".saves")),
                         "a .saves directory stayed after a mount started")
        return got == want_new

    def test_failpoints_and_kills(self):
        rng = random.Random(24)
        results = []
        for trial in range(20):
            if trial < 2 * len(POINTS):
                pt = POINTS[trial % len(POINTS)]
                results.append((pt, self.one(trial, env={"CKPTFS_FAILPOINT": pt})))
            else:
                delay = rng.uniform(0.0, 0.01)
                results.append((f"kill@{delay * 1000:.1f}ms", self.one(trial, kill_after=delay)))
        print("\n  " + ", ".join(f"{k}:{'new' if v else 'old'}" for k, v in results), file=sys.stderr)
        # exchanged and later: the new version stays
        for pt, new in results[:len(POINTS)]:
            if pt in ("remove_exchanged", "remove_old"):
                self.assertTrue(new, pt)
            else:
                self.assertFalse(new, pt)


if __name__ == "__main__":
    cu.main()

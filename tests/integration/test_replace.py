#!/usr/bin/env python3
"""`sync replace=TARGET` (issue 24): a checkpoint staged under a working
name is published as TARGET over a committed TARGET in one atomic step, on
every mount. Readers of the old one with open files keep reading the old
bytes, new opens see the new one, and a crash at any point leaves exactly
one of the two whole (SIGKILL at each step of a replace, and from outside
at random moments, 20 trials)."""

import errno
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time

from ckpttest import util as cu
from ckpttest.util import (CkptfsTestCase, main, read_all, read_log, state, status, tensor_bytes,
                           wait_state, write_file, write_tensor)

MiB = 1 << 20


def commit_words(ckdir, words):
    fd = os.open(os.path.join(ckdir, ".commit"), os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, (words + "\n").encode())
    finally:
        os.close(fd)


def save_id(backing, name):
    db = sqlite3.connect(f"file:{backing}/{name}/.metadata?mode=ro", uri=True)
    try:
        return db.execute("select value from checkpoint where key='save_id'").fetchone()[0]
    finally:
        db.close()


def version(tag, size):
    """What version `tag` of the checkpoint holds: a tensor, a blob."""
    seed = sum(tag.encode())
    return {"model/w": tensor_bytes("float32", [size // 4], seed=seed),
            "trainer_state.json": b'{"version": "%s"}' % tag.encode()}


def stage(ckdir, files):
    os.makedirs(ckdir, exist_ok=True)
    for rel, data in files.items():
        p = os.path.join(ckdir, rel)
        if rel == "model/w":
            write_tensor(p, "float32", [len(data) // 4], data)
        else:
            write_file(p, data)


def seen(path, want, seconds=5.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if read_all(path) == want:
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


class Replace(CkptfsTestCase):
    def setUp(self):
        super().setUp()
        self.a = self.mount()
        self.b = self.mount(mnt=os.path.join(self.dir, "mnt2"))

    def test_replace_under_readers(self):
        v1, v2 = version("one", 8 * MiB), version("two", 4 * MiB)
        stage(self.ck("step-12"), v1)
        commit_words(self.ck("step-12"), "sync")
        old_id = save_id(self.backing, "step-12")
        # readers on both mounts hold files of the old one open and keep
        # reading them whole while it is replaced
        stop = threading.Event()
        problems, reads = [], [0]

        def reader(mnt, rel):
            path = os.path.join(mnt, "step-12", rel)
            fd = os.open(path, os.O_RDONLY)
            try:
                while not stop.is_set():
                    got = os.pread(fd, len(v1[rel]) + 10, 0)
                    if got != v1[rel]:
                        problems.append(f"{path}: {len(got)} bytes, not the old ones")
                        return
                    reads[0] += 1
            finally:
                os.close(fd)

        threads = [threading.Thread(target=reader, args=(m, rel))
                   for m in (self.a.mnt, self.b.mnt) for rel in v1]
        for t in threads:
            t.start()
        time.sleep(0.3)
        stage(self.ck("tmp-step-12"), v2)
        commit_words(self.ck("tmp-step-12"), "sync replace=step-12")
        # the working name is gone; TARGET is the new one on this mount at once
        self.assertFalse(os.path.exists(self.ck("tmp-step-12")))
        self.assertEqual(sorted(os.listdir(self.mnt)), ["step-12"])
        for rel, data in v2.items():
            self.assertEqual(read_all(self.ck("step-12", rel)), data, rel)
        # and on the other mount within about a second
        for rel, data in v2.items():
            self.assertTrue(seen(os.path.join(self.b.mnt, "step-12", rel), data), rel)
        self.assertEqual(os.stat(os.path.join(self.b.mnt, "step-12", "model", "w")).st_size,
                         len(v2["model/w"]))
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(30)
        self.assertEqual(problems, [])
        self.assertGreater(reads[0], 4)
        self.assertNotEqual(save_id(self.backing, "step-12"), old_id)
        self.assertEqual(state(self.ck("step-12")), "committed")
        # nothing of the old one is left in BACKING_DIR
        self.assertEqual(sorted(os.listdir(self.backing)), ["step-12"])
        r = subprocess.run([os.path.join(os.path.dirname(cu.BIN), "ckptfs-fsck"),
                            self.backing], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_replace_rules(self):
        # no TARGET yet: a plain publish under TARGET
        stage(self.ck("work"), version("a", 4096))
        commit_words(self.ck("work"), "sync replace=fresh")
        self.assertEqual(read_all(self.ck("fresh", "trainer_state.json")), b'{"version": "a"}')
        self.assertFalse(os.path.exists(self.ck("work")))
        # without replace=, a committed name stays EEXIST (the staged one stays)
        stage(self.ck("fresh2"), version("b", 4096))
        os.rename(self.ck("fresh2"), self.ck("fresh3"))
        # TARGET staged on this mount: refused, nothing changes
        stage(self.ck("x"), version("c", 4096))
        with self.assertRaises(OSError) as cm:
            commit_words(self.ck("x"), "sync replace=fresh3")
        self.assertEqual(cm.exception.errno, errno.EEXIST)
        self.assertEqual(state(self.ck("x")), "staging")
        self.assertIn("refused replace=fresh3", self.daemon_log())
        # malformed words: EINVAL, logged
        for words in ("sync replace=", "sync replace=.x", "sync replace=a replace=b",
                      "sync solo solo", "sync now"):
            with self.assertRaises(OSError) as cm:
                commit_words(self.ck("x"), words)
            self.assertEqual(cm.exception.errno, errno.EINVAL, words)
        self.assertEqual(state(self.ck("x")), "staging")
        # async replace: the working name's .status, held open, follows it
        fd = os.open(self.ck("x", ".status"), os.O_RDONLY)
        commit_words(self.ck("x"), "async replace=fresh")
        deadline = time.monotonic() + 30
        while os.path.exists(self.ck("x")) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(os.path.exists(self.ck("x")))
        os.close(fd)
        self.assertTrue(seen(self.ck("fresh", "trainer_state.json"), b'{"version": "c"}'))
        self.assertTrue(seen(os.path.join(self.b.mnt, "fresh", "trainer_state.json"),
                             b'{"version": "c"}'))
        # a file where TARGET would be: not replaced
        os.mkdir(os.path.join(self.backing, "..."))  # not a name: ignored
        with open(os.path.join(self.backing, "afile"), "w") as f:
            f.write("not a checkpoint")
        stage(self.ck("y"), version("d", 4096))
        with self.assertRaises(OSError) as cm:
            commit_words(self.ck("y"), "sync replace=afile")
        self.assertEqual(cm.exception.errno, errno.EEXIST)
        self.assertIn("not replaced", status(self.ck("y")))
        with open(os.path.join(self.backing, "afile")) as f:
            self.assertEqual(f.read(), "not a checkpoint")


class ReplaceRaces(CkptfsTestCase):
    """What a helper's review found: a replace never destroys what another
    mount's removal or its own mount's stager holds, and never takes
    anything but a committed checkpoint."""

    def setUp(self):
        super().setUp()
        self.a = self.mount()
        self.b = self.mount(mnt=os.path.join(self.dir, "mnt2"))
        self.bmnt = self.b.mnt

    def test_replace_meets_rm_r_on_another_mount(self):
        stage(self.ck("T"), {"f1": b"1", "f2": b"2"})
        commit_words(self.ck("T"), "sync")
        # rm -r T on B has begun: it unlinks .metadata first (listed first),
        # which removes T as a whole for every mount; then A replaces T
        os.listdir(os.path.join(self.bmnt, "T"))
        os.unlink(os.path.join(self.bmnt, "T", ".metadata"))
        stage(self.ck("W"), {"new": b"the new version"})
        with self.assertRaises(OSError) as cm:
            commit_words(self.ck("W"), "sync replace=T")
        self.assertEqual(cm.exception.errno, errno.EEXIST)  # being removed
        # refused, nothing lost: W is still staged; B's rm -r ends
        self.assertEqual(state(self.ck("W")), "failed")
        shutil.rmtree(os.path.join(self.bmnt, "T"))
        self.assertFalse(os.path.exists(os.path.join(self.backing, "T")))
        commit_words(self.ck("W"), "sync replace=T")
        self.assertEqual(read_all(self.ck("T", "new")), b"the new version")
        self.assertTrue(seen(os.path.join(self.bmnt, "T", "new"), b"the new version"))
        # an rm -r of the new T on B removes the new T: it is what B shows
        shutil.rmtree(os.path.join(self.bmnt, "T"))
        self.assertFalse(os.path.exists(os.path.join(self.backing, "T")))

    def test_only_committed_checkpoints_are_replaced_or_cleaned(self):
        self.a.stop()
        self.b.stop()
        os.makedirs(os.path.join(self.backing, "notes"))
        with open(os.path.join(self.backing, "notes", "important.txt"), "w") as f:
            f.write("mine")
        os.makedirs(os.path.join(self.backing, "lost+found"))
        with open(os.path.join(self.backing, "lost+found", "#1234"), "w") as f:
            f.write("recovered")
        self.a = self.mount()  # a starting mount cleans up unfinished saves
        self.assertIn("not removing notes: not a checkpoint", self.daemon_log())
        stage(self.ck("W"), {"x": b"x"})
        with self.assertRaises(OSError) as cm:
            commit_words(self.ck("W"), "sync replace=notes")
        self.assertEqual(cm.exception.errno, errno.EEXIST)
        self.a.stop()
        self.a = self.mount()
        with open(os.path.join(self.backing, "notes", "important.txt")) as f:
            self.assertEqual(f.read(), "mine")
        with open(os.path.join(self.backing, "lost+found", "#1234")) as f:
            self.assertEqual(f.read(), "recovered")

    def test_target_is_taken_while_a_replace_is_in_flight(self):
        stage(self.ck("W"), {"big": os.urandom(64 * MiB)})
        commit_words(self.ck("W"), "async replace=T")
        took = None
        try:
            os.mkdir(self.ck("T"))
            took = "mkdir"
        except OSError as e:
            self.assertIn(e.errno, (errno.EBUSY, errno.EEXIST))
        os.mkdir(self.ck("X"))
        write_file(self.ck("X", "mine.txt"), b"mine")
        try:
            os.rename(self.ck("X"), self.ck("T"))
            took = took or "rename"
        except OSError as e:
            self.assertIn(e.errno, (errno.EBUSY, errno.EEXIST))
        deadline = time.monotonic() + 60
        while os.path.exists(self.ck("W")) and time.monotonic() < deadline:
            time.sleep(0.05)
        # whatever came first, nothing staged was taken over silently
        if took is None:
            self.assertEqual(read_all(self.ck("X", "mine.txt")), b"mine")
        self.assertEqual(sorted(os.listdir(self.ck("T"))), [".metadata", "big"])


class ReplaceWorld(CkptfsTestCase):
    def test_world_of_two(self):
        w = self.start_world(2, "commit_timeout=30")
        for gen in range(3):
            names = {}
            for r in range(2):
                name = "step" if gen == 0 else f"work-{gen}-rank{r}"
                names[r] = name
                d = os.path.join(w.mnt(r), name)
                os.mkdir(d)
                write_file(os.path.join(d, f"shard{r}"), b"gen %d rank %d" % (gen, r))
            words = "sync" if gen == 0 else "sync replace=step"
            res = {}
            ths = [threading.Thread(target=lambda r=r: res.__setitem__(r, self._commit(
                os.path.join(w.mnt(r), names[r]), words))) for r in range(2)]
            for t in ths:
                t.start()
            for t in ths:
                t.join(120)
            self.assertEqual(res, {0: None, 1: None}, gen)
            for r in range(2):
                for s in range(2):
                    self.assertTrue(seen(os.path.join(w.mnt(r), "step", f"shard{s}"),
                                         b"gen %d rank %d" % (gen, s)), (gen, r, s))
                self.assertEqual(sorted(os.listdir(w.mnt(r))), ["step"])
        self.assertEqual(sorted(os.listdir(self.backing)), ["step"])

    @staticmethod
    def _commit(ckdir, words):
        try:
            commit_words(ckdir, words)
            return None
        except OSError as e:
            return e


class ReplaceCrash(CkptfsTestCase):
    """SIGKILL at each step of a replace (CKPTFS_FAILPOINT) and from outside
    at random moments: after a remount TARGET is exactly the old or the new
    version, fsck is clean, and nothing else is left in BACKING_DIR."""

    POINTS = ["local_plan", "global_plan", "write_data", "write_done", "metadata_tmp",
              "metadata_rename", "metadata_synced", "replace_remove", "committed"]

    def trial(self, k, point=None, kill_after=None):
        backing = os.path.join(self.dir, f"b{k}")
        mnt = os.path.join(self.dir, f"m{k}")
        old, new = version(f"old{k}", 6 * MiB), version(f"new{k}", 24 * MiB)
        m = cu.Mount(backing, mnt, self.log, opts="staging_mem=4M").start()
        stage(os.path.join(mnt, "ckpt"), old)
        commit_words(os.path.join(mnt, "ckpt"), "sync")
        self.assertEqual(m.stop(), 0)
        env = {"CKPTFS_FAILPOINT": point} if point else None
        m = cu.Mount(backing, mnt, self.log, opts="staging_mem=4M", env=env).start()
        stage(os.path.join(mnt, "work"), new)
        timer = None
        if kill_after is not None:
            pid = m.proc.pid
            timer = threading.Timer(kill_after, lambda: os.kill(pid, signal.SIGKILL))
            timer.start()
        try:
            commit_words(os.path.join(mnt, "work"), "sync replace=ckpt")
        except OSError:
            pass
        if timer:  # the commit ended first: killed now, after it
            timer.cancel()
            os.kill(pid, signal.SIGKILL)
        rc = m.wait(60)
        if point:
            self.assertEqual(rc, -signal.SIGKILL, f"{point}: did not die there\n"
                             + read_log(self.log)[-3000:])
        subprocess.run(["fusermount3", "-uz", mnt], capture_output=True)
        m = cu.Mount(backing, mnt, self.log).start()
        got = {rel: read_all(os.path.join(mnt, "ckpt", rel)) for rel in old}
        which = "old" if got == old else "new" if got == new else None
        self.assertIsNotNone(which, f"{point or kill_after}: neither version whole")
        self.assertEqual(sorted(os.listdir(mnt)), ["ckpt"])
        self.assertEqual(m.stop(), 0)
        self.assertEqual(sorted(os.listdir(backing)), ["ckpt"], point or kill_after)
        r = subprocess.run([os.path.join(os.path.dirname(cu.BIN), "ckptfs-fsck"), backing],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return which

    def test_twenty_trials(self):
        outcomes = {}
        for k, point in enumerate(self.POINTS):
            outcomes[point] = self.trial(k, point=point)
        # the exchange is the commit point
        for point in self.POINTS:
            want = "new" if point in ("metadata_rename", "metadata_synced", "replace_remove",
                                      "committed") else "old"
            self.assertEqual(outcomes[point], want, point)
        rnd = random.Random(20261204)
        for k in range(len(self.POINTS), 20):
            outcomes[f"kill {k}"] = self.trial(k, kill_after=rnd.uniform(0.0, 0.15))
        print(f"  replace crash trials: {sorted(outcomes.items())}", file=sys.stderr)


if __name__ == "__main__":
    main()

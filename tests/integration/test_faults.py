"""Backing faults beyond a plain full filesystem (test_edge.py has the
ENOSPC-at-write cases): the backing filesystem turns read-only, a
thin-provisioned backing device runs out of space only when the data is
flushed (write(2) succeeded, fsync fails), a daemon killed while it removes
a failed save, and a world of ranks whose backing fills up. Each time: the
commit fails with the system's reason, nothing of it is published, earlier
checkpoints stay intact, the staged checkpoint is still there, and the
retry after the fault is gone commits it.

    python3 tests/integration/test_faults.py --bin build/bin/ckptfs
"""

import errno
import os
import signal
import subprocess

from ckpttest import util as cu
from ckpttest.util import (CkptfsTestCase, commit, read_all, read_log, status, tensor_bytes,
                           wait_state, write_file, write_tensor)
from test_crash import Content, fsck, pattern, unmount_dead, write_backwards

MiB = 1 << 20


def run(*argv):
    return subprocess.run(list(argv), capture_output=True, text=True)


class FaultCase(CkptfsTestCase):
    def small_fs(self, path, size):
        """A tmpfs of size at path, unmounted at cleanup (after ckptfs)."""
        os.makedirs(path, exist_ok=True)
        r = run("mount", "-t", "tmpfs", "-o", f"size={size}", "ckptfs-fault", path)
        if r.returncode:
            self.skipTest(f"cannot mount a tmpfs: {r.stderr.strip()}")
        self.addCleanup(run, "umount", "-l", path)

    def stage_victim(self, name, size):
        """A tensor and a bytes item, written backwards (no write-behind
        stream holds a file open in BACKING_DIR)."""
        os.mkdir(self.ck(name))
        data = pattern(name, size)
        write_backwards(self.ck(name, "blob"), data)
        t = tensor_bytes("float32", [64, 16])
        write_tensor(self.ck(name, "t"), "float32", [64, 16], t)
        return {"blob": data, "t": t}

    def assertIntact(self, name, files):
        self.assertEqual(status(self.ck(name)).split("\n")[0], "committed")
        for f, data in files.items():
            self.assertTrue(read_all(self.ck(name, f)) == data, f"{name}/{f}")

    def assertFailed(self, name, reason):
        st = status(self.ck(name))
        self.assertEqual(st.split("\n")[0], "failed", st)
        self.assertIn(reason, st)
        self.assertNothingPublished(name)
        return st


class ReadOnlyBacking(FaultCase):
    """The backing filesystem is remounted read-only (as ext4 does with
    errors=remount-ro after an I/O error)."""

    def test_commit_fails_then_retry(self):
        self.small_fs(self.backing, "64m")
        m = self.mount()
        before = self.stage_victim("before", 2 * MiB)
        commit(self.ck("before"))
        for mode in ("sync", "async"):
            name = f"victim-{mode}"
            files = self.stage_victim(name, 3 * MiB)
            self.assertEqual(run("mount", "-o", "remount,ro", self.backing).returncode, 0)
            if mode == "sync":
                self.assertErrno(errno.EIO, commit, self.ck(name))
            else:
                commit(self.ck(name), "async")
                wait_state(self.ck(name))
            st = self.assertFailed(name, os.strerror(errno.EROFS))
            self.assertIn(self.backing, st)  # where it failed
            self.assertIntact("before", before)
            # the staged files are still there, readable, and can retry
            for f, data in files.items():
                self.assertTrue(read_all(self.ck(name, f)) == data)
            self.assertEqual(run("mount", "-o", "remount,rw", self.backing).returncode, 0)
            commit(self.ck(name), mode)
            wait_state(self.ck(name))
            self.assertIntact(name, files)
        self.assertEqual(m.stop(), 0)
        r = fsck(self.backing)
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertEqual(sorted(os.listdir(self.backing)),
                         ["before", "victim-async", "victim-sync"])


class ThinBacking(FaultCase):
    """ext4 on a loop device whose image is a sparse file on a small tmpfs:
    write(2) succeeds into the page cache, and the device fails when the
    data is flushed (fsync, sync_files=1) as thin-provisioned storage does
    when its pool runs out."""

    def test_flush_fails_then_retry(self):
        lower = os.path.join(self.dir, "lower")
        self.small_fs(lower, "24m")
        img = os.path.join(lower, "disk.img")
        with open(img, "wb") as f:
            f.truncate(256 * MiB)
        # no journal: a failed metadata write would abort it and turn the
        # filesystem read-only (ReadOnlyBacking covers that)
        r = run("mkfs.ext4", "-q", "-O", "^has_journal", "-E", "lazy_itable_init=0", img)
        if r.returncode:
            self.skipTest(f"mkfs.ext4: {r.stderr.strip()}")
        ext = os.path.join(self.dir, "ext")
        os.makedirs(ext)
        r = run("mount", "-o", "loop,errors=continue", img, ext)
        if r.returncode:
            self.skipTest(f"cannot mount a loop device: {r.stderr.strip()}")
        self.addCleanup(run, "umount", "-l", ext)
        self.backing = os.path.join(ext, "backing")
        m = self.mount("sync_files=1")
        before = self.stage_victim("before", 2 * MiB)
        commit(self.ck("before"))
        files = self.stage_victim("big", 48 * MiB)  # more than the pool has
        self.assertErrno(errno.EIO, commit, self.ck("big"))
        st = status(self.ck("big"))
        self.assertEqual(st.split("\n")[0], "failed", st)
        # the device's error as fsync got it
        self.assertTrue(os.strerror(errno.ENOSPC) in st or os.strerror(errno.EIO) in st, st)
        self.assertNothingPublished("big")
        self.assertIntact("before", before)
        # the pool grows: the same staged checkpoint commits
        self.assertEqual(run("mount", "-o", "remount,size=256m", lower).returncode, 0)
        try:
            commit(self.ck("big"))
        except OSError:
            self.fail(status(self.ck("big")) + run("dmesg").stdout[-1500:])
        self.assertIntact("big", files)
        self.assertEqual(m.stop(), 0)
        # from the device, not the page cache
        run("sync")
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        m = self.mount()
        self.assertIntact("before", before)
        self.assertIntact("big", files)
        self.assertEqual(m.stop(), 0)
        r = fsck(self.backing)
        self.assertEqual(r.returncode, 0, r.stdout)


class KilledWhileDiscarding(FaultCase):
    """A save fails (the backing is full) and the daemon dies while it
    removes what it wrote: the next mount removes the rest."""

    def test_discard_interrupted(self):
        self.small_fs(self.backing, "8m")
        m = self.mount()
        before = self.stage_victim("before", 1 * MiB)
        commit(self.ck("before"))
        self.assertEqual(m.stop(), 0)
        m = self.mount(env={"CKPTFS_FAILPOINT": "discard"})
        self.stage_victim("big", 12 * MiB)
        with self.assertRaises(OSError):
            commit(self.ck("big"))
        self.assertEqual(m.wait(60), -signal.SIGKILL, read_log(self.log))
        unmount_dead(self.mnt)
        saves = self.bk(".saves")
        self.assertTrue(os.path.isdir(saves) and os.listdir(saves),
                        "the failpoint came too late (the save's own directory is gone)")
        self.assertFalse(os.path.exists(self.bk("big")), "a failed save made a NAME directory")
        m = self.mount()
        self.assertEqual(os.listdir(self.backing), ["before"])
        self.assertIntact("before", before)
        self.assertEqual(m.stop(), 0)


class WorldBackingFull(CkptfsTestCase):
    """Two ranks, one backing filesystem that fills up during the writes:
    every rank's commit fails and says why; the retry commits."""

    def test_every_rank_fails_then_retry(self):
        backing = self.backing
        os.makedirs(backing)
        r = run("mount", "-t", "tmpfs", "-o", "size=40m", "ckptfs-fault", backing)
        if r.returncode:
            self.skipTest(f"cannot mount a tmpfs: {r.stderr.strip()}")
        self.addCleanup(run, "umount", "-l", backing)
        w = self.start_world(2, "commit_timeout=30", leak_check=False, stop_timeout=30)
        before = Content("before", 2)  # 2 x (20 MiB + 3 MiB) does not fit
        small = {r: pattern(f"small{r}", MiB) for r in range(2)}
        for r in range(2):
            os.mkdir(os.path.join(w.mnt(r), "small"))
            write_file(os.path.join(w.mnt(r), "small", f"r{r}"), small[r])
        errs = {}
        for r in range(2):
            before.stage(os.path.join(w.mnt(r), "before"), r)
        import threading

        def one(r, name):
            try:
                commit(os.path.join(w.mnt(r), name))
            except OSError as e:
                errs[(r, name)] = e
        for name in ("before",):
            ts = [threading.Thread(target=one, args=(r, name)) for r in range(2)]
            [t.start() for t in ts]
            [t.join(120) for t in ts]
        for r in range(2):
            self.assertIn((r, "before"), errs, f"rank {r} committed")
            self.assertEqual(errs[(r, "before")].errno, errno.EIO)
            st = status(os.path.join(w.mnt(r), "before"))
            self.assertEqual(st.split("\n")[0], "failed", st)
            self.assertIn(os.strerror(errno.ENOSPC), st)
        self.assertFalse(os.path.exists(os.path.join(backing, "before", ".metadata")))
        left = [f for f in os.listdir(os.path.join(backing, "before"))] \
            if os.path.isdir(os.path.join(backing, "before")) else []
        self.assertEqual(left, [], "files of the failed save left behind")
        # a smaller checkpoint still commits on both ranks meanwhile
        errs.clear()
        ts = [threading.Thread(target=one, args=(r, "small")) for r in range(2)]
        [t.start() for t in ts]
        [t.join(120) for t in ts]
        self.assertEqual(errs, {})
        # more space: the failed one commits as it was staged
        self.assertEqual(run("mount", "-o", "remount,size=128m", backing).returncode, 0)
        ts = [threading.Thread(target=one, args=(r, "before")) for r in range(2)]
        [t.start() for t in ts]
        [t.join(120) for t in ts]
        self.assertEqual(errs, {})
        for r in range(2):
            for path, data in before.files().items():
                self.assertTrue(read_all(os.path.join(w.mnt(r), "before", path)) == data)
            self.assertEqual(read_all(os.path.join(w.mnt(r), "small", "r1")), small[1])
        self.assertEqual(w.stop(30), 0)
        r = fsck(backing)
        self.assertEqual(r.returncode, 0, r.stdout)


if __name__ == "__main__":
    cu.main()

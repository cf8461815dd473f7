#!/usr/bin/env python3
"""Write-behind streams: staged files written front to back go straight
into unnamed files in BACKING_DIR/.staging while they are written, become
the data files at commit (the same inode: written once), and every way of
leaving the stream (writes out of order, truncate, rewrite, a failed
commit) keeps the bytes right."""

import errno
import os
import shutil
import time

from ckpttest.util import (CkptfsTestCase, commit, main, read_all, set_tensor_xattrs, state,
                           write_file, write_tensor)

MiB = 1 << 20


def tmpfiles(pid):
    """{inode: size} of the daemon's unnamed files in BACKING/.staging
    (streams and the spill file), seen through /proc."""
    out = {}
    fds = os.path.join("/proc", str(pid), "fd")
    for fd in os.listdir(fds):
        try:
            if "/.staging/#" in os.readlink(os.path.join(fds, fd)):
                st = os.stat(os.path.join(fds, fd))
                out[st.st_ino] = st.st_size
        except OSError:
            pass
    return out


class Streams(CkptfsTestCase):
    """Through the daemon (-o passthrough=0, and wherever FUSE passthrough
    is not available): test_write_once covers the default path."""

    def mount(self, opts=None, **kw):
        return super().mount(",".join(o for o in ("passthrough=0", opts) if o), **kw)

    def test_streamed_bytes_become_the_data_files(self):
        m = self.mount("io_threads=2,staging_mem=1M")
        os.mkdir(self.ck("s"))
        datas = [os.urandom(3 * MiB + i * 4097) for i in range(5)]
        for i, d in enumerate(datas):
            write_tensor(self.ck("s", f"t{i}"), "uint8", [len(d)], d)
        small = os.urandom(1000)                       # too small to stream
        write_file(self.ck("s", "small.bin"), small)
        st = tmpfiles(m.proc.pid)
        self.assertTrue(st, "nothing was written behind")
        self.assertGreaterEqual(sum(st.values()), sum(map(len, datas)))
        self.assertLessEqual(len(st), 2)               # io_threads streams at most
        self.assertEqual(os.listdir(self.bk(".staging")), [])  # unnamed
        for i, d in enumerate(datas):                  # staged view reads the streams
            self.assertEqual(read_all(self.ck("s", f"t{i}")), d)
        commit(self.ck("s"))
        for i, d in enumerate(datas):
            self.assertEqual(read_all(self.ck("s", f"t{i}")), d)
        self.assertEqual(read_all(self.ck("s", "small.bin")), small)
        files = sorted(f for f in os.listdir(self.bk("s")) if f.endswith(".distcp"))
        self.assertLessEqual(len(files), 2)
        # the data files are the streams themselves (same inodes)
        inodes = {os.stat(self.bk("s", f)).st_ino for f in files}
        self.assertEqual(set(st) & inodes, set(st))
        # each stream's bytes are stored once: the data files are not much
        # larger than the data (4 KiB alignment between files)
        stored = sum(os.stat(self.bk("s", f)).st_size for f in files)
        self.assertLess(stored, sum(map(len, datas)) + len(small) + 16 * 4096)
        self.mounts[0].stop()
        self.mount()                                   # remount reads the same
        for i, d in enumerate(datas):
            self.assertEqual(read_all(self.ck("s", f"t{i}")), d)

    def test_leaving_the_stream_keeps_the_bytes(self):
        self.mount("io_threads=1")
        os.mkdir(self.ck("s"))
        # written in order, then patched in the middle: leaves the stream
        a = bytearray(os.urandom(2 * MiB))
        p = self.ck("s", "a")
        write_file(p, bytes(a))
        with open(p, "r+b") as f:
            f.seek(MiB + 5)
            f.write(b"patch")
        a[MiB + 5:MiB + 10] = b"patch"
        # streamed, truncated, extended
        b = bytearray(os.urandom(MiB + 300))
        q = self.ck("s", "b")
        write_file(q, bytes(b))
        os.truncate(q, 70000)
        os.truncate(q, 90000)
        b = b[:70000] + bytes(20000)
        # streamed, then rewritten from the start (O_TRUNC)
        c1, c2 = os.urandom(MiB), os.urandom(300000)
        r = self.ck("s", "c")
        write_file(r, c1)
        write_file(r, c2)
        # two files written at once with one stream: the second is in RAM
        d1, d2 = os.urandom(MiB), os.urandom(MiB)
        fd1 = os.open(self.ck("s", "d1"), os.O_WRONLY | os.O_CREAT, 0o644)
        fd2 = os.open(self.ck("s", "d2"), os.O_WRONLY | os.O_CREAT, 0o644)
        for off in range(0, MiB, 128 * 1024):
            os.pwrite(fd1, d1[off:off + 128 * 1024], off)
            os.pwrite(fd2, d2[off:off + 128 * 1024], off)
        os.close(fd1)
        os.close(fd2)
        want = {"a": bytes(a), "b": bytes(b), "c": c2, "d1": d1, "d2": d2}
        for name, data in want.items():
            self.assertEqual(read_all(self.ck("s", name)), data, name)
        commit(self.ck("s"))
        for name, data in want.items():
            self.assertEqual(read_all(self.ck("s", name)), data, name)

    def test_failed_commit_keeps_streamed_data_for_the_retry(self):
        m = self.mount("io_threads=2")
        os.mkdir(self.ck("s"))
        big = os.urandom(4 * MiB)
        write_tensor(self.ck("s", "w"), "float32", [MiB], big)
        p = self.ck("s", "bad")
        write_file(p, os.urandom(2 * MiB))
        set_tensor_xattrs(p, "float32", [3, 3])        # wrong length
        fd = os.open(self.ck("s", ".commit"), os.O_WRONLY | os.O_TRUNC)
        with self.assertRaises(OSError) as e:
            os.write(fd, b"sync\n")
        os.close(fd)
        self.assertEqual(e.exception.errno, errno.EIO)
        self.assertEqual(state(self.ck("s")), "failed")
        self.assertFalse(os.path.exists(self.bk("s")))  # nothing published
        self.assertGreaterEqual(sum(tmpfiles(m.proc.pid).values()), 4 * MiB)  # kept
        os.unlink(p)
        more = os.urandom(3 * MiB)                      # streams work again
        write_tensor(self.ck("s", "more"), "uint8", [len(more)], more)
        commit(self.ck("s"))
        self.assertEqual(read_all(self.ck("s", "w")), big)
        self.assertEqual(read_all(self.ck("s", "more")), more)

    def test_discarded_checkpoint_removes_its_streams(self):
        m = self.mount()
        os.mkdir(self.ck("s"))
        write_file(self.ck("s", "x"), os.urandom(2 * MiB))
        self.assertEqual(sum(tmpfiles(m.proc.pid).values()), 2 * MiB)
        shutil.rmtree(self.ck("s"))
        # gone once the drain lets go of the file it may still be hashing
        # (it closed just before the removal; seconds under ASan and load)
        deadline = time.monotonic() + 10
        while tmpfiles(m.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(tmpfiles(m.proc.pid), {})

    def test_other_daemons_on_the_backing_dir_do_not_interfere(self):
        # two mounts on one BACKING_DIR staging the same name, and a third
        # starting (its cleanup of .staging) meanwhile
        m1 = self.mount()
        mnt2 = os.path.join(self.dir, "mnt2")
        os.makedirs(mnt2)
        self.mount(mnt=mnt2)
        a, b = os.urandom(MiB), os.urandom(MiB)
        os.mkdir(self.ck("X"))
        os.mkdir(self.ck("X", mnt=mnt2))
        write_file(self.ck("X", "a"), a)
        write_file(self.ck("X", "a", mnt=mnt2), b)
        mnt3 = os.path.join(self.dir, "mnt3")
        os.makedirs(mnt3)
        self.mount(mnt=mnt3)
        self.assertEqual(read_all(self.ck("X", "a")), a)
        commit(self.ck("X"))
        self.assertEqual(read_all(self.ck("X", "a")), a)
        shutil.rmtree(self.ck("X", mnt=mnt2))  # discards the other staging
        self.assertEqual(read_all(self.ck("X", "a")), a)
        self.assertEqual(m1.stop(), 0)


if __name__ == "__main__":
    main()

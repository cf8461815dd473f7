#!/usr/bin/env python3
"""File operations on a staged checkpoint (pwrite at scattered offsets,
holes, truncate, rename, unlink, several open files, writer threads,
spilling beyond staging_mem) and that the committed content is what was staged."""

import errno
import os
import re
import shutil
import subprocess
import struct
import sys
import threading
import time

from ckpttest.pyenv import PACKAGE
from ckpttest.util import (CkptfsTestCase, commit, main, pread, read_all, read_log, rss_kib,
                           set_tensor_xattrs, state, tensor_bytes, write_file, write_tensor)

MiB = 1 << 20


class Model:
    """What a file should contain after a series of writes and truncates."""

    def __init__(self):
        self.data = bytearray()

    def pwrite(self, data, off):
        if off > len(self.data):
            self.data += b"\0" * (off - len(self.data))
        self.data[off:off + len(data)] = data

    def truncate(self, n):
        if n < len(self.data):
            del self.data[n:]
        else:
            self.data += b"\0" * (n - len(self.data))


class StagingOps(CkptfsTestCase):
    def setUp(self):
        super().setUp()
        self.mount()
        os.mkdir(self.ck("s"))

    def check_both(self, path, want):
        """The staged file reads as want; after commit too."""
        self.assertEqual(os.stat(self.ck("s", path)).st_size, len(want))
        self.assertEqual(read_all(self.ck("s", path)), bytes(want))

    def test_scattered_pwrite_and_holes(self):
        p = self.ck("s", "scattered")
        m = Model()
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # descending and overlapping offsets, across segment boundaries
            for off, n in [(5 * MiB + 3, 10), (3, 5), (MiB - 2, 4), (2 * MiB, MiB + 1),
                           (100, 7000), (2 * MiB + 500, 20), (0, 1), (4096 - 1, 2)]:
                data = bytes((off + i) % 251 + 1 for i in range(n))
                self.assertEqual(os.pwrite(fd, data, off), n)
                m.pwrite(data, off)
            self.assertEqual(os.fstat(fd).st_size, len(m.data))
            os.fsync(fd)  # accepted (staged data lives in memory)
            for off, n in [(0, 200), (MiB - 10, 20), (3 * MiB, 100), (4 * MiB, MiB + 13)]:
                self.assertEqual(os.pread(fd, n, off), bytes(m.data[off:off + n]), (off, n))
        finally:
            os.close(fd)
        self.check_both("scattered", m.data)
        commit(self.ck("s"))
        self.check_both("scattered", m.data)
        self.assertEqual(pread(p, 10, 4 * MiB), b"\0" * 10)  # a hole

    def test_sparse_file_only_holes(self):
        p = self.ck("s", "sparse")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(fd, b"Z", 3 * MiB - 1)
        os.close(fd)
        want = b"\0" * (3 * MiB - 1) + b"Z"
        write_file(self.ck("s", "grown"), b"")
        os.truncate(self.ck("s", "grown"), 12345)
        commit(self.ck("s"))
        self.assertEqual(read_all(p), want)
        self.assertEqual(read_all(self.ck("s", "grown")), b"\0" * 12345)

    def test_truncate_down_and_up(self):
        p = self.ck("s", "t")
        m = Model()
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            data = bytes(range(1, 256)) * 20000  # ~5 MiB, no zeros
            os.write(fd, data)
            m.pwrite(data, 0)
            for n in [4 * MiB + 17, 3 * MiB, 3 * MiB + 100, 5000, 4 * MiB, 100, 0, 10,
                      MiB + 1, 2 * MiB]:
                os.ftruncate(fd, n)
                m.truncate(n)
                self.assertEqual(os.fstat(fd).st_size, n)
                # what was cut off must read as zeros when grown again
                self.assertEqual(os.pread(fd, n + 10, 0), bytes(m.data), n)
            os.pwrite(fd, b"end", len(m.data))
            m.pwrite(b"end", len(m.data))
        finally:
            os.close(fd)
        # O_TRUNC through open
        q = self.ck("s", "q")
        write_file(q, b"x" * 10000)
        write_file(q, b"y" * 10)
        self.assertEqual(read_all(q), b"y" * 10)
        os.truncate(q, 3)
        commit(self.ck("s"))
        self.check_both("t", m.data)
        self.assertEqual(read_all(q), b"yyy")

    def test_truncate_small_file_past_first_segment(self):
        # a small file (first segment partly allocated) grown by truncate
        # and then cut back to a size inside the first MiB
        p = self.ck("s", "small")
        m = Model()
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            for op, a, b in [("w", b"abc", 0), ("t", 2 * MiB, 0), ("t", 10000, 0),
                             ("w", b"Q", 9000), ("t", 3 * MiB, 0), ("t", 5000, 0)]:
                if op == "w":
                    os.pwrite(fd, a, b)
                    m.pwrite(a, b)
                else:
                    os.ftruncate(fd, a)
                    m.truncate(a)
                self.assertEqual(os.pread(fd, len(m.data) + 5, 0), bytes(m.data))
        finally:
            os.close(fd)
        # a file whose data starts past the first MiB, then a little at 0
        q = self.ck("s", "late")
        mq = Model()
        fd = os.open(q, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            for off, data in [(MiB + 5, b"late"), (0, b"early")]:
                os.pwrite(fd, data, off)
                mq.pwrite(data, off)
            os.ftruncate(fd, 8000)
            mq.truncate(8000)
            os.pwrite(fd, b"x", 7000)
            mq.pwrite(b"x", 7000)
            self.assertEqual(os.pread(fd, 9000, 0), bytes(mq.data))
        finally:
            os.close(fd)
        commit(self.ck("s"))
        self.check_both("small", m.data)
        self.check_both("late", mq.data)

    def test_rename_and_unlink(self):
        write_tensor(self.ck("s", "a/w"), "float32", [4], tensor_bytes("float32", [4]))
        write_file(self.ck("s", "a/gone"), b"gone")
        write_file(self.ck("s", "b1"), b"first")
        write_file(self.ck("s", "b2"), b"second")
        os.makedirs(self.ck("s", "d/e"))
        write_file(self.ck("s", "d/e/f"), b"deep")
        os.rename(self.ck("s", "a/w"), self.ck("s", "a/w2"))       # file, same dir
        os.rename(self.ck("s", "b1"), self.ck("s", "a/b1"))          # file, other dir
        os.rename(self.ck("s", "b2"), self.ck("s", "a/b1"))          # replaces
        os.rename(self.ck("s", "d"), self.ck("s", "moved"))          # directory
        os.rename(self.ck("s", "moved/e"), self.ck("s", "a/e"))      # directory, other parent
        os.unlink(self.ck("s", "a/gone"))
        os.mkdir(self.ck("s", "empty"))
        os.rmdir(self.ck("s", "empty"))
        self.assertErrno(errno.ENOTEMPTY, os.rmdir, self.ck("s", "a"))
        self.assertErrno(errno.EINVAL, os.rename, self.ck("s", "a"), self.ck("s", "a/e/inside"))
        self.assertErrno(errno.ENOENT, os.unlink, self.ck("s", "a/gone"))
        self.assertErrno(errno.EISDIR, os.unlink, self.ck("s", "a"))
        # moving out of the checkpoint is refused
        os.mkdir(self.ck("other"))
        self.assertErrno(errno.EXDEV, os.rename, self.ck("s", "a/w2"), self.ck("other", "w2"))
        self.assertEqual(sorted(os.listdir(self.ck("s", "a"))), ["b1", "e", "w2"])
        self.assertEqual(sorted(os.listdir(self.ck("s"))), ["a", "moved"])
        self.assertEqual(os.getxattr(self.ck("s", "a/w2"), "user.ckpt.dtype"), b"float32")
        commit(self.ck("s"))
        # empty directories are kept, as cp -a keeps them
        self.assertEqual(sorted(os.listdir(self.ck("s"))), [".metadata", "a", "moved"])
        self.assertEqual(read_all(self.ck("s", "a/w2")), tensor_bytes("float32", [4]))
        self.assertEqual(read_all(self.ck("s", "a/b1")), b"second")
        self.assertEqual(read_all(self.ck("s", "a/e/f")), b"deep")
        self.assertFalse(os.path.exists(self.ck("s", "a/gone")))
        self.assertFalse(os.path.exists(self.ck("s", "a/w")))

    def test_rename_errors(self):
        os.makedirs(self.ck("s", "full/x"))
        os.mkdir(self.ck("s", "emptydir"))
        write_file(self.ck("s", "f"), b"f")
        write_file(self.ck("s", "g"), b"g")
        self.assertErrno(errno.ENOTEMPTY, os.rename, self.ck("s", "emptydir"), self.ck("s", "full"))
        self.assertErrno(errno.ENOTDIR, os.rename, self.ck("s", "emptydir"), self.ck("s", "f"))
        self.assertErrno(errno.EISDIR, os.rename, self.ck("s", "f"), self.ck("s", "emptydir"))
        self.assertErrno(errno.ENOENT, os.rename, self.ck("s", "nope"), self.ck("s", "x"))
        # nothing moves to the top level or from it into a checkpoint (a
        # staged checkpoint's own rename is in test_names)
        self.assertErrno(errno.EPERM, os.rename, self.ck("s", "f"), self.ck("f"))
        os.mkdir(self.ck("t"))
        self.assertErrno(errno.EPERM, os.rename, self.ck("t"), self.ck("s", "t"))
        # RENAME_NOREPLACE through renameat2
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if hasattr(libc, "renameat2"):
            AT_FDCWD, RENAME_NOREPLACE = -100, 1
            rc = libc.renameat2(AT_FDCWD, self.ck("s", "f").encode(), AT_FDCWD,
                                self.ck("s", "g").encode(), RENAME_NOREPLACE)
            self.assertEqual((rc, ctypes.get_errno()), (-1, errno.EEXIST))
            rc = libc.renameat2(AT_FDCWD, self.ck("s", "f").encode(), AT_FDCWD,
                                self.ck("s", "h").encode(), RENAME_NOREPLACE)
            self.assertEqual(rc, 0)
        else:
            os.rename(self.ck("s", "f"), self.ck("s", "h"))
        os.rename(self.ck("s", "emptydir"), self.ck("s", "full/x"))  # onto an empty dir
        self.assertEqual(sorted(os.listdir(self.ck("s"))), ["full", "g", "h"])
        self.assertEqual(read_all(self.ck("s", "g")), b"g")
        self.assertEqual(read_all(self.ck("s", "h")), b"f")

    def test_unlink_while_open(self):
        p = self.ck("s", "open")
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"abc")
            os.unlink(p)
            self.assertFalse(os.path.exists(p))
            os.write(fd, b"def")  # still a working descriptor
            self.assertEqual(os.pread(fd, 10, 0), b"abcdef")
            self.assertEqual(os.fstat(fd).st_size, 6)
        finally:
            os.close(fd)
        write_file(self.ck("s", "kept"), b"k")
        commit(self.ck("s"))
        self.assertEqual(sorted(os.listdir(self.ck("s"))), [".metadata", "kept"])

    def test_metadata_calls_on_unlinked_open_file(self):
        # fchmod, fchown, futimens and the f*xattr calls send the kernel's
        # inode, not the handle: the node of an unlinked file must still be
        # found (ext4 answers all of them; stress-ng's chown stressor).
        p = self.ck("s", "gone")
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"abc")
            os.unlink(p)
            os.fchmod(fd, 0o600)
            self.assertEqual(os.fstat(fd).st_mode & 0o777, 0o600)
            os.fchown(fd, 1234, 5678)
            st = os.fstat(fd)
            self.assertEqual((st.st_uid, st.st_gid), (1234, 5678))
            os.utime(fd, ns=(2_000_000_000 * 10**9, 1_000_000_000 * 10**9))
            self.assertEqual(os.fstat(fd).st_mtime_ns, 1_000_000_000 * 10**9)
            os.setxattr(fd, "user.ckpt.dtype", b"uint8")
            self.assertEqual(os.getxattr(fd, "user.ckpt.dtype"), b"uint8")
            self.assertIn("user.ckpt.dtype", os.listxattr(fd))
            os.removexattr(fd, "user.ckpt.dtype")
            self.assertNotIn("user.ckpt.dtype", os.listxattr(fd))
            self.assertEqual(os.pread(fd, 3, 0), b"abc")
        finally:
            os.close(fd)
        # a removed directory, through a descriptor opened before
        d = self.ck("s", "dir")
        os.mkdir(d)
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.rmdir(d)
            os.fchmod(dfd, 0o700)
            self.assertEqual(os.fstat(dfd).st_mode & 0o777, 0o700)
            os.utime(dfd, ns=(10**18, 10**18))
            self.assertEqual(os.fstat(dfd).st_mtime_ns, 10**18)
        finally:
            os.close(dfd)
        write_file(self.ck("s", "kept"), b"k")
        commit(self.ck("s"))
        self.assertEqual(sorted(os.listdir(self.ck("s"))), [".metadata", "kept"])

    def test_access_execute_needs_an_execute_bit(self):
        # access(X_OK) is true for root only where some execute bit is set
        # (generic_permission); directories are always searchable by root.
        p = self.ck("s", "plain")
        write_file(p, b"#!/bin/sh\n")
        for mode, want in ((0o600, False), (0o644, False), (0o700, True),
                           (0o610, True), (0o601, True)):
            os.chmod(p, mode)
            self.assertEqual(os.access(p, os.X_OK), want, oct(mode))
            self.assertTrue(os.access(p, os.R_OK | os.W_OK), oct(mode))
        self.assertTrue(os.access(self.ck("s"), os.X_OK))
        os.chmod(p, 0o600)
        r = subprocess.run(["test", "-x", p])
        self.assertEqual(r.returncode, 1)
        commit(self.ck("s"))
        self.assertFalse(os.access(p, os.X_OK))
        self.assertTrue(os.access(p, os.R_OK))
        self.assertTrue(os.access(self.ck("s"), os.X_OK))
        self.assertTrue(os.access(self.ck("s", ".metadata"), os.R_OK))
        self.assertFalse(os.access(self.ck("s", ".metadata"), os.X_OK))

    def test_many_open_files_interleaved(self):
        n = 40
        fds = [os.open(self.ck("s", f"f{i:02d}"), os.O_WRONLY | os.O_CREAT, 0o644) for i in range(n)]
        models = [Model() for _ in range(n)]
        try:
            for rnd in range(20):
                for i, fd in enumerate(fds):
                    data = bytes([(i * 31 + rnd) % 256]) * (100 + 37 * i)
                    os.write(fd, data)
                    models[i].pwrite(data, len(models[i].data))
        finally:
            for fd in fds:
                os.close(fd)
        commit(self.ck("s"))
        for i in range(n):
            self.assertEqual(read_all(self.ck("s", f"f{i:02d}")), bytes(models[i].data), i)

    def test_writer_threads(self):
        nthreads, per_file = 8, 3 * MiB + 4321
        errors = []
        shared = self.ck("s", "shared")
        fd_shared = os.open(shared, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(fd_shared, nthreads * per_file)

        def work(t):
            try:
                data = bytes([(t * 13 + i) % 256 for i in range(256)]) * (per_file // 256 + 1)
                data = data[:per_file]
                # one file of its own, in 64 KiB pieces
                write_file(self.ck("s", f"t{t}/own"), data, chunk=65536)
                set_tensor_xattrs(self.ck("s", f"t{t}/own"), "uint8", [per_file])
                # and its slice of one shared file, with pwrite
                for off in range(0, per_file, 100000):
                    piece = data[off:off + 100000]
                    os.pwrite(fd_shared, piece, t * per_file + off)
            except Exception as e:  # reported below
                errors.append((t, e))

        threads = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        os.close(fd_shared)
        self.assertEqual(errors, [])
        want = {}
        for t in range(nthreads):
            data = bytes([(t * 13 + i) % 256 for i in range(256)]) * (per_file // 256 + 1)
            want[t] = data[:per_file]
        staged_shared = read_all(shared)
        self.assertEqual(staged_shared, b"".join(want[t] for t in range(nthreads)))
        commit(self.ck("s"))
        for t in range(nthreads):
            self.assertEqual(read_all(self.ck("s", f"t{t}/own")), want[t], t)
        self.assertEqual(read_all(shared), staged_shared)

    def test_writer_processes(self):
        # several processes (fork) write files of one checkpoint at once
        pids = []
        for k in range(4):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    write_tensor(self.ck("s", f"p{k}/w"), "int32", [1000, 100],
                                 tensor_bytes("int32", [1000, 100], seed=k))
                except BaseException:
                    code = 1
                os._exit(code)
            pids.append(pid)
        for pid in pids:
            _, st = os.waitpid(pid, 0)
            self.assertEqual(os.waitstatus_to_exitcode(st), 0)
        commit(self.ck("s"))
        for k in range(4):
            self.assertEqual(read_all(self.ck("s", f"p{k}/w")),
                             tensor_bytes("int32", [1000, 100], seed=k))

    def test_writes_refused_while_committing_and_after(self):
        """A file written through the daemon (-o passthrough=0): a
        handle kept open across the commit gets EROFS. (A file written
        once by FUSE passthrough, created write-only or read-write,
        refuses the commit instead, EBUSY: test_passthrough.)"""
        self.assertEqual(self.mounts[-1].stop(), 0)
        self.mount("passthrough=0")
        os.mkdir(self.ck("s"))
        p = self.ck("s", "w")
        cfd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        os.write(cfd, b"before")
        os.close(cfd)
        fd = os.open(p, os.O_WRONLY)
        try:
            commit(self.ck("s"))
            self.assertErrno(errno.EROFS, os.write, fd, b"after")
            self.assertErrno(errno.EROFS, os.ftruncate, fd, 0)
        finally:
            os.close(fd)
        self.assertEqual(read_all(p), b"before")

    def test_mode_and_times(self):
        p = self.ck("s", "m")
        write_file(p, b"x")
        os.chmod(p, 0o600)
        self.assertEqual(os.stat(p).st_mode & 0o777, 0o600)
        os.utime(p, (1000000000, 1000000000))
        self.assertEqual(int(os.stat(p).st_mtime), 1000000000)
        self.assertTrue(os.path.isfile(p))
        self.assertTrue(os.path.isdir(self.ck("s")))


def spill_file_size(pid):
    """Size of the daemon's spill file in BACKING/.staging (an unnamed
    O_TMPFILE, seen through /proc), or None if it has none."""
    fds = os.path.join("/proc", str(pid), "fd")
    for fd in os.listdir(fds):
        try:
            target = os.readlink(os.path.join(fds, fd))
        except OSError:
            continue
        if "/.staging/#" in target:  # O_TMPFILE: "#inode (deleted)"
            return os.stat(os.path.join(fds, fd)).st_size
    return None


class StagingMemory(CkptfsTestCase):
    """Staging memory and the spill file: files written through the daemon
    (-o passthrough=0, and wherever FUSE passthrough is not available)."""

    def mount(self, opts=None, **kw):
        return super().mount(",".join(o for o in ("passthrough=0", opts) if o), **kw)

    def test_spills_beyond_staging_mem(self):
        m = self.mount("staging_mem=1M")
        pid = m.proc.pid
        rss_before = rss_kib(pid)
        os.mkdir(self.ck("s"))
        big = os.urandom(24 * MiB)
        # written back to front (a file written in order from offset 0
        # would go to a write-behind stream instead): 1 MiB in RAM, the
        # rest spilled
        fd = os.open(self.ck("s", "big"), os.O_WRONLY | os.O_CREAT, 0o644)
        for off in range(len(big) - MiB, -1, -MiB):
            os.pwrite(fd, big[off:off + MiB], off)
        os.close(fd)
        model = Model()                                    # out of order, with holes
        p = self.ck("s", "scattered")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
        for off, n in [(5 * MiB + 3, 70000), (100, 2 * MiB), (9 * MiB, 1), (3 * MiB - 7, 10)]:
            data = os.urandom(n)
            os.pwrite(fd, data, off)
            model.pwrite(data, off)
        os.truncate(p, 4 * MiB + 11)                       # truncate inside a spilled segment
        model.truncate(4 * MiB + 11)
        os.pwrite(fd, b"x", 6 * MiB)                       # grows again: zeros in between
        model.pwrite(b"x", 6 * MiB)
        os.close(fd)
        self.assertGreater(spill_file_size(pid), 20 * MiB)
        # RAM stayed bounded while 30 MiB were staged with 1 MiB of staging_mem
        self.assertLess(rss_kib(pid) - rss_before, 12 * 1024)
        self.assertEqual(read_all(self.ck("s", "big")), big)   # staged view
        self.assertEqual(read_all(p), bytes(model.data))
        commit(self.ck("s"))
        self.assertEqual(read_all(self.ck("s", "big")), big)   # committed view
        self.assertEqual(read_all(p), bytes(model.data))
        # the spill file gives its space back once nothing is spilled
        self.assertEqual(spill_file_size(pid), 0)
        self.assertEqual(m.stop(), 0)
        self.assertEqual(os.listdir(self.bk(".staging")) if os.path.isdir(self.bk(".staging")) else [], [])

    def test_async_saves_beyond_staging_mem(self):
        # several async saves in flight, each larger than staging_mem
        self.mount("staging_mem=2M")
        datas = {}
        for name in ["a", "b", "c"]:
            os.mkdir(self.ck(name))
            datas[name] = os.urandom(5 * MiB)
            write_tensor(self.ck(name, "w"), "uint8", [5 * MiB], datas[name])
            commit(self.ck(name), "async")
        for name, data in datas.items():
            from ckpttest.util import wait_state
            self.assertTrue(wait_state(self.ck(name)).startswith("committed\n"))
            self.assertEqual(read_all(self.ck(name, "w")), data)

    def test_discarded_checkpoint_frees_memory(self):
        m = self.mount("staging_mem=2M")
        os.mkdir(self.ck("a"))
        fd = os.open(self.ck("a", "x"), os.O_WRONLY | os.O_CREAT, 0o644)
        for off in range(5 * MiB, -1, -MiB):  # out of order: no stream
            os.pwrite(fd, b"\1" * MiB, off)
        os.close(fd)
        self.assertGreater(spill_file_size(m.proc.pid), 0)
        shutil.rmtree(self.ck("a"))
        # freed with the node, once the handle's RELEASE (after the close,
        # asynchronous) let go of it
        deadline = time.monotonic() + 20
        while spill_file_size(m.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.assertEqual(spill_file_size(m.proc.pid), 0)
        os.mkdir(self.ck("b"))
        write_file(self.ck("b", "x"), b"\2" * (2 * MiB))
        commit(self.ck("b"))
        self.assertEqual(read_all(self.ck("b", "x")), b"\2" * (2 * MiB))


def requests_of(metrics_file, op):
    """The mount's count of FUSE requests op, from its metrics file (0
    before its first write)."""
    try:
        with open(metrics_file) as f:
            m = re.search(rf'^ckptfs_fuse_requests_total{{[^}}]*op="{op}"}} (\d+)$',
                          f.read(), re.M)
    except FileNotFoundError:
        return 0
    return int(m.group(1)) if m else 0


class BatchedDescriptions(CkptfsTestCase):
    """user.ckpt.metas on a staged directory: many files' user.ckpt.meta
    in one setxattr (StagingDirs(batch=True), the DCP Writer's and
    ckptfs.save's), applied in order, the first bad record ending it with
    its error."""

    def setUp(self):
        super().setUp()
        sys.path.insert(0, PACKAGE)
        from ckptfs import staging
        self.staging = staging

    def test_batches_describe_every_file_as_one_setxattr_each_would(self):
        mfile = os.path.join(self.dir, "metrics.prom")
        m = self.mount("metrics=" + mfile)
        os.mkdir(self.ck("b"))
        files = {}
        for i in range(300):  # long FQNs: more than one 60000-byte value
            fqn = f"layer{i}." + "x" * 300
            xattrs = [("user.ckpt.dtype", b"int32"), ("user.ckpt.shape", b"%d" % (i + 1)),
                      ("user.ckpt.fqn", fqn.encode())]
            files[f"d{i % 7}/e{i % 3}/f{i}"] = (struct.pack(f"<{i + 1}i", *range(i + 1)),
                                                xattrs)
        stager = self.staging.Stager(4)
        with self.staging.StagingDirs(self.ck("b"), batch=True) as dirs:
            for rel, (data, xattrs) in files.items():
                stager.submit(dirs.write_file, rel, data, xattrs, os.O_EXCL)
            stager.done()
            self.assertEqual(len(dirs.pending), 300)
            staged = self.ck("b", "d0", "e0", "f0")
            self.assertNotIn("user.ckpt.dtype", os.listxattr(staged))  # not yet
        self.assertEqual(os.getxattr(staged, "user.ckpt.shape"), b"1")
        commit(self.ck("b"))
        for rel, (data, xattrs) in files.items():
            p = self.ck("b", *rel.split("/"))
            self.assertEqual(read_all(p), data)
            for k, v in xattrs:
                self.assertEqual(os.getxattr(p, k), v, (rel, k))
        self.assertEqual(m.stop(), 0)
        # 300 files of ~330 bytes of description each: 2 batches, not 300
        self.assertLessEqual(requests_of(mfile, "setxattr"), 3)

    def test_bad_records(self):
        self.mount()
        os.mkdir(self.ck("c"))
        os.mkdir(self.ck("c", "sub"))
        for n in ("a", "b"):
            write_file(self.ck("c", "sub", n), b"\0" * 8)
        good = b"sub/a\0dtype=int32;shape=2\0"

        def refused(value, err, flags=0):
            with self.assertRaises(OSError, msg=value) as cm:
                os.setxattr(self.ck("c"), "user.ckpt.metas", value, flags)
            self.assertEqual(cm.exception.errno, err, value)

        refused(b"sub/a\0dtype=int32;shape=2", errno.EINVAL)  # no last NUL
        refused(b"sub/a\0", errno.EINVAL)                     # a path, no meta
        refused(b"", errno.EINVAL)
        for path in (b"../c/sub/a", b"/sub/a", b"sub//a", b"./sub/a", b"sub/./a"):
            refused(path + b"\0dtype=int32;shape=2\0", errno.EINVAL)
        refused(b"sub/none\0dtype=int32;shape=2\0", errno.ENOENT)
        refused(b"sub\0dtype=int32;shape=2\0", errno.EISDIR)
        refused(b"sub/a/x\0dtype=int32;shape=2\0", errno.ENOTDIR)
        refused(good, errno.EINVAL, os.XATTR_CREATE)
        for n in ("a", "b"):
            self.assertNotIn("user.ckpt.dtype", os.listxattr(self.ck("c", "sub", n)))
        # in order: a is described, the bad value for b ends the batch
        refused(good + b"sub/b\0dtype=bogus;shape=2\0", errno.EINVAL)
        self.assertEqual(os.getxattr(self.ck("c", "sub", "a"), "user.ckpt.dtype"), b"int32")
        self.assertNotIn("user.ckpt.dtype", os.listxattr(self.ck("c", "sub", "b")))
        self.assertIn('user.ckpt.metas: "sub/none": No such file', read_log(self.log))
        # from a staged subdirectory too; never stored or listed itself
        os.setxattr(self.ck("c", "sub"), "user.ckpt.metas", b"b\0dtype=int32;shape=2\0")
        self.assertEqual(os.getxattr(self.ck("c", "sub", "b"), "user.ckpt.shape"), b"2")
        for d in (self.ck("c"), self.ck("c", "sub")):
            self.assertNotIn("user.ckpt.metas", os.listxattr(d))
            with self.assertRaises(OSError) as cm:
                os.getxattr(d, "user.ckpt.metas")
            self.assertEqual(cm.exception.errno, errno.ENODATA)
        commit(self.ck("c"))
        refused(good, errno.EROFS)

    def test_mkdirs(self):
        """user.ckpt.mkdirs: mkdir -p of many directories in one request,
        with the mode given, owned by the caller; StagingDirs.make_all then
        only opens them."""
        mfile = os.path.join(self.dir, "metrics.prom")
        m = self.mount("metrics=" + mfile)
        os.mkdir(self.ck("m"))
        os.mkdir(self.ck("m", "old"), 0o700)
        os.setxattr(self.ck("m"), "user.ckpt.mkdirs",
                    b"750\0a/b/c\0a/b/d/\0old/e\0old\0")
        for d in ("a", "a/b", "a/b/c", "a/b/d", "old/e"):
            st = os.stat(self.ck("m", *d.split("/")))
            self.assertEqual((st.st_mode & 0o7777, st.st_uid), (0o750, os.getuid()), d)
        self.assertEqual(os.stat(self.ck("m", "old")).st_mode & 0o7777, 0o700)  # kept

        def refused(value, err):
            with self.assertRaises(OSError, msg=value) as cm:
                os.setxattr(self.ck("m"), "user.ckpt.mkdirs", value)
            self.assertEqual(cm.exception.errno, err, value)

        write_file(self.ck("m", "f"), b"x")
        for bad in (b"755\0a", b"\0a\0", b"x\0a\0", b"-1\0a\0", b"17777\0a\0",
                    b"755\0/a\0", b"755\0a/../b\0", b"755\0a//b\0", b"755\0\0"):
            refused(bad, errno.EINVAL)
        refused(b"755\0f/g\0", errno.ENOTDIR)
        refused(b"755\0f\0", errno.EEXIST)
        refused(b"755\0.commit\0", errno.EEXIST)  # served there by ckptfs
        refused(b"755\0__0_0.distcp\0", errno.EPERM)  # stock DCP's, refused
        refused(b"755\0x\0f/y\0z\0", errno.ENOTDIR)  # x made, z not: in order
        self.assertTrue(os.path.isdir(self.ck("m", "x")))
        self.assertFalse(os.path.exists(self.ck("m", "z")))
        self.assertNotIn("user.ckpt.mkdirs", os.listxattr(self.ck("m")))
        files = {f"p{i % 5}/q{i % 11}/t{i}": os.urandom(64) for i in range(100)}
        with self.staging.StagingDirs(self.ck("m"), batch=True) as dirs:
            dirs.make_all(os.path.dirname(r) for r in files)
            for rel, data in files.items():
                dirs.write_file(rel, data, (), os.O_EXCL)
        commit(self.ck("m"))
        for rel, data in files.items():
            self.assertEqual(read_all(self.ck("m", *rel.split("/"))), data)
        refused(b"755\0n\0", errno.EROFS)
        self.assertEqual(m.stop(), 0)
        # the test's own two mkdir(2)s; none for the 55 directories made at once
        self.assertEqual(requests_of(mfile, "mkdir"), 2)

    def test_a_removed_directory_takes_nothing(self):
        """A staged directory removed while open: a batch on its descriptor
        finds nothing below it and makes nothing in it (a directory made
        there was left in the tree when the removed one was freed, and the
        daemon aborted at the close)."""
        self.mount()
        os.mkdir(self.ck("r"))
        os.mkdir(self.ck("r", "d"))
        write_file(self.ck("r", "d", "f"), b"\0" * 4)
        fd = os.open(self.ck("r", "d"), os.O_RDONLY | os.O_DIRECTORY)
        try:
            shutil.rmtree(self.ck("r", "d"))
            for name, value in (("user.ckpt.mkdirs", b"755\0x\0"),
                                ("user.ckpt.metas", b"f\0dtype=int32;shape=1\0")):
                with self.assertRaises(OSError) as cm:
                    os.setxattr(fd, name, value)
                self.assertEqual(cm.exception.errno, errno.ENOENT, name)
        finally:
            os.close(fd)
        os.mkdir(self.ck("r", "e"))  # the daemon is alive, the tree whole
        os.setxattr(self.ck("r"), "user.ckpt.mkdirs", b"6755\0e/s\0")
        self.assertEqual(os.stat(self.ck("r", "e", "s")).st_mode & 0o7777, 0o755)  # no set-ID
        self.assertEqual(sorted(os.listdir(self.ck("r"))), ["e"])
        commit(self.ck("r"))
        self.assertEqual(state(self.ck("r")), "committed")

    def test_a_refused_batch_names_the_file(self):
        """The package falls back to one setxattr per file of a refused
        batch, so that the error names the file at fault."""
        self.mount()
        os.mkdir(self.ck("d"))
        with self.assertRaises(OSError) as cm:
            with self.staging.StagingDirs(self.ck("d"), batch=True) as dirs:
                dirs.write_file("ok", b"\0" * 4, [("user.ckpt.dtype", b"int32"),
                                                  ("user.ckpt.shape", b"1")])
                dirs.write_file("bad", b"\0" * 4, [("user.ckpt.dtype", b"int32"),
                                                   ("user.ckpt.shape", b"1,x")])
        self.assertEqual(cm.exception.errno, errno.EINVAL)
        self.assertIn(self.ck("d", "bad"), str(cm.exception))
        self.assertEqual(os.getxattr(self.ck("d", "ok"), "user.ckpt.shape"), b"1")


class StagingDirsThreads(CkptfsTestCase):
    """The package's StagingDirs on a mount: the staging threads make the
    directories their files need (mkdir -p), each directory once, while
    other threads wait for it, and never leave a descriptor behind."""

    def setUp(self):
        super().setUp()
        self.mount()
        sys.path.insert(0, PACKAGE)
        from ckptfs import staging
        self.staging = staging

    def open_fds(self):
        return len(os.listdir("/proc/self/fd"))

    def test_threads_make_shared_directories_once(self):
        os.mkdir(self.ck("t"))
        before = self.open_fds()
        files = {}
        for i in range(300):  # 3 levels, 40 leaf directories, ~7 files each
            files[f"a{i % 2}/b{i % 8}/c{i % 40}/f{i}"] = os.urandom(1000 + i)
        stager = self.staging.Stager(8)
        with self.staging.StagingDirs(self.ck("t")) as dirs:
            dirs.HELD = 4  # descriptors closed while other threads use theirs
            for rel, data in files.items():
                stager.submit(dirs.write_file, rel, data, (), os.O_EXCL)
            stager.done()
            self.assertEqual(dirs.holds, {}, "a directory still held")
            self.assertEqual(dirs.making, {}, "a directory still being made")
            self.assertLessEqual(len(dirs.fds), dirs.HELD)
        self.assertEqual(self.open_fds(), before, "descriptors left open")
        self.assertEqual(len([n for _, _, ns in os.walk(self.ck("t")) for n in ns]), 300)
        commit(self.ck("t"))
        for rel, data in files.items():
            self.assertEqual(read_all(self.ck("t", *rel.split("/"))), data)

    def test_a_directory_that_cannot_be_made_fails_every_file_in_it(self):
        os.mkdir(self.ck("u"))
        write_file(self.ck("u", "x"), b"a file where a directory should be")
        before = self.open_fds()
        stager = self.staging.Stager(4)
        with self.staging.StagingDirs(self.ck("u")) as dirs:
            # the first failure is raised by a later submit or by done();
            # neither hangs, and nothing is staged under x
            with self.assertRaises(NotADirectoryError):
                try:
                    for i in range(12):
                        stager.submit(dirs.write_file, f"x/d{i % 3}/f{i}", b"data", (),
                                      os.O_EXCL)
                except BaseException:
                    stager.abandon()  # as the package's callers do
                    raise
                stager.done()
            self.assertEqual((dirs.holds, dirs.making), ({}, {}))
        with self.assertRaises(ValueError):  # closed: refused, not a hang
            dirs.write_file("y", b"data")
        with self.staging.StagingDirs(self.ck("u")) as dirs:
            for bad in ("/abs/f", "/f"):  # absolute: refused, not a hang
                with self.assertRaises(ValueError):
                    dirs.write_file(bad, b"data")
            self.assertEqual((dirs.holds, dirs.making), ({}, {}))
        self.assertEqual(self.open_fds(), before, "descriptors left open")
        self.assertEqual(read_all(self.ck("u", "x")), b"a file where a directory should be")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Hostile input and access on one rank: NAME_MAX names end to end, `.`,
`..` and `a/../b` paths, `..` inside names, odd bytes in names, deep
nesting and the path length limit, hostile xattr values (slashes, garbage,
empty, huge), element counts that overflow, zero-sized dimensions, a
checkpoint of many small files, writes at huge offsets, garbage, oversized
and partial writes to .commit; the mount seen by another user with and
without -o allow_other, the modes of everything in BACKING_DIR, and
symlinks planted in BACKING_DIR.

After every hostile step the daemon must still run, still serve an earlier
checkpoint bit-exact and have no sanitizer report in its log.

Many small files: CKPTFS_HOSTILE_FILES (default 1000000: about 2.5 minutes
on a 2-vCPU VM, 4.5 with ASan) files in one checkpoint; the rate and the
daemon's RSS go to stderr."""

import errno
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import time
import unittest

from ckpttest import util as cu
from ckpttest.util import (CkptfsTestCase, commit, main, pread, read_all, rss_kib,
                           sanitizer_report, state, status, tensor_bytes, wait_state, write_file,
                           write_tensor)

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
NOBODY = 65534
MAX_FILE = TiB  # the largest staged file (staging.c)


def metadata_rows(path, sql):
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


class DirCursor:
    """An open directory that walks down one component at a time (paths
    longer than PATH_MAX)."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)

    def down(self, *parts, create=False):
        for p in parts:
            if create:
                os.mkdir(p, dir_fd=self.fd)
            nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY, dir_fd=self.fd)
            os.close(self.fd)
            self.fd = nfd
        return self

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class HostileCase(CkptfsTestCase):
    """A mount with an earlier checkpoint `good` that every hostile step
    must leave intact."""

    opts = None

    def setUp(self):
        super().setUp()
        self.m = self.mount(self.opts)
        os.mkdir(self.ck("good"))
        self.good = {
            "w": write_tensor(self.ck("good", "w"), "float32", [64, 33],
                              tensor_bytes("float32", [64, 33], seed=7)),
            "cfg/b": os.urandom(3000) + b"\0end",
        }
        write_file(self.ck("good", "cfg/b"), self.good["cfg/b"])
        commit(self.ck("good"))

    def alive(self, what=""):
        """The daemon runs, serves `good` bit-exact, logged no sanitizer
        report."""
        self.assertIsNone(self.m.proc.poll(), f"daemon exited after {what}")
        self.assertTrue(self.m.mounted(), f"mount gone after {what}")
        for path, data in self.good.items():
            self.assertEqual(read_all(self.ck("good", path)), data, f"{path} after {what}")
        self.assertEqual(state(self.ck("good")), "committed", what)
        self.assertIsNone(sanitizer_report(self.daemon_log()), f"after {what}")

    def rss(self):
        return rss_kib(self.m.proc.pid)

    def cursor(self, path):
        """A DirCursor at path, closed at the latest in cleanup (before the
        unmount, which an open directory would keep busy)."""
        c = DirCursor(path)
        self.addCleanup(c.close)
        return c


# ---- names -----------------------------------------------------------------

class Names(HostileCase):
    def test_name_max_end_to_end(self):
        name = "N" * 200 + "-._" + "9" * 52
        self.assertEqual(len(name), 255)
        fname, dname = "f" * 255, "d" * 255
        os.mkdir(self.ck(name))
        t = write_tensor(self.ck(name, dname, fname), "int16", [7, 3],
                         tensor_bytes("int16", [7, 3], seed=2))
        b = os.urandom(777)
        write_file(self.ck(name, fname), b)
        self.assertEqual(sorted(os.listdir(self.mnt)), sorted(["good", name]))
        commit(self.ck(name))
        self.assertEqual(state(self.ck(name)), "committed")
        self.assertEqual(read_all(self.ck(name, dname, fname)), t)
        self.assertEqual(read_all(self.ck(name, fname)), b)
        # stored under its own name in BACKING_DIR, paths in .metadata
        self.assertTrue(os.path.isfile(self.bk(name, ".metadata")))
        self.assertTrue(any(f.endswith(".distcp") for f in os.listdir(self.bk(name))))
        rows = metadata_rows(self.bk(name, ".metadata"),
                             "select fqn, path from tensors union all select fqn, path from blobs")
        self.assertEqual(sorted(rows), sorted([(f"{dname}.{fname}", f"{dname}/{fname}"),
                                               (fname, fname)]))
        # one byte more: refused everywhere
        self.assertErrno(errno.ENAMETOOLONG, os.mkdir, self.ck(name + "x"))
        os.mkdir(self.ck("n2"))
        write_file(self.ck("n2", "f"), b"1")
        self.assertErrno(errno.ENAMETOOLONG, os.rename, self.ck("n2", "f"),
                         self.ck("n2", "g" * 256))
        self.assertErrno(errno.ENAMETOOLONG, os.mkdir, self.ck("n2", "g" * 256))
        self.assertEqual(os.listdir(self.ck("n2")), ["f"])
        self.alive("NAME_MAX names")
        # and again after a remount, from BACKING_DIR
        self.assertEqual(self.m.stop(), 0)
        self.m = self.mount()
        self.assertEqual(read_all(self.ck(name, dname, fname)), t)
        self.assertEqual(read_all(self.ck(name, fname)), b)
        self.alive("remount")

    def test_dot_and_dotdot_paths(self):
        os.mkdir(self.ck("p"))
        os.mkdir(self.ck("p", "a"))
        before = sorted(os.listdir(self.backing))
        # "." and ".." never reach the daemon as names: the kernel resolves them
        for path in (self.ck("."), self.ck(".."), self.ck("p", "."), self.ck("p", "..")):
            self.assertErrno(errno.EEXIST, os.mkdir, path)
        for path in (self.ck("p", ".."), self.ck("p", "a", "..")):
            self.assertErrno(errno.EISDIR, os.open, path, os.O_WRONLY | os.O_CREAT, 0o644)
        write_file(self.ck("p", "f"), b"f")
        for target in (".", ".."):
            with self.assertRaises(OSError):
                os.rename(self.ck("p", "f"), self.ck("p", target))
        # a/../b is b; x/../y with no x is ENOENT; p/../q is the root (no files there)
        write_file(self.ck("p", "a/../b"), b"b via a/..")
        self.assertErrno(errno.ENOENT, os.open, self.ck("p", "x/../y"),
                         os.O_WRONLY | os.O_CREAT, 0o644)
        self.assertErrno(errno.EPERM, os.open, self.ck("p", "../q"),
                         os.O_WRONLY | os.O_CREAT, 0o644)
        os.mkdir(self.ck("p", "a/../c"))
        write_file(self.ck("p", "c/../a/./g"), b"g")
        self.assertEqual(sorted(os.listdir(self.ck("p"))), ["a", "b", "c", "f"])
        self.assertEqual(sorted(os.listdir(self.mnt)), ["good", "p"])
        # nothing named after them in BACKING_DIR (.staging: where staged
        # files written by FUSE passthrough live, unnamed)
        self.assertEqual(sorted(set(os.listdir(self.backing)) - {".staging"}),
                         sorted(set(before) - {".staging"}))
        commit(self.ck("p"))
        rows = metadata_rows(self.bk("p", ".metadata"), "select fqn, path from blobs")
        self.assertEqual(sorted(rows), [("a.g", "a/g"), ("b", "b"), ("f", "f")])
        self.assertEqual(read_all(self.ck("p", "a/../b")), b"b via a/..")
        self.assertEqual(read_all(self.ck("p", "a/../a/./g")), b"g")
        # the empty directory c is kept (cp -a of a tree keeps its empty directories)
        self.assertEqual(sorted(os.listdir(self.ck("p"))), [".metadata", "a", "b", "c", "f"])
        self.assertEqual(os.listdir(self.ck("p", "c")), [])
        self.alive("dot paths")

    def test_dotdot_inside_names(self):
        # ".." inside a name is an ordinary name: it stays one directory of BACKING_DIR
        names = ["a..b", "x..", "z...", "-..-"]
        for n in names:
            os.mkdir(self.ck(n))
            write_file(self.ck(n, "d..e", "x..y"), n.encode())
            write_file(self.ck(n, "f.."), b"2")
            write_file(self.ck(n, "..z"), b"3")  # dot-names are names inside
            os.mkdir(self.ck(n, "d..e", "..."))
            commit(self.ck(n))
        for n in ("..x", "...", ".a..b"):
            self.assertErrno(errno.EPERM, os.mkdir, self.ck(n))
        real = os.path.realpath(self.backing)
        for n in names:
            self.assertEqual(read_all(self.ck(n, "d..e", "x..y")), n.encode())
            d = os.path.realpath(self.bk(n))
            self.assertEqual(os.path.dirname(d), real)
            self.assertTrue(os.path.isfile(os.path.join(d, ".metadata")))
            rows = metadata_rows(os.path.join(d, ".metadata"), "select fqn from blobs")
            self.assertEqual(sorted(r[0] for r in rows), ["..z", "d..e.x..y", "f.."])
            self.assertTrue(os.path.isdir(self.ck(n, "d..e", "...")))
        self.assertEqual(sorted(os.listdir(self.backing)), sorted(names + ["good"]))
        self.alive("'..' in names")

    def test_odd_bytes_in_names(self):
        # only a leading '.' and the length are restricted inside a checkpoint
        os.mkdir(self.ck("odd"))
        want = {}
        for i, n in enumerate([b"new\nline", b"back\\slash", b"\xff\xfe not utf-8", b"tab\there",
                               b"star*?[", b"caf\xc3\xa9", b" lead space", b"x" * 255]):
            p = os.path.join(os.fsencode(self.ck("odd")), n)
            want[n] = bytes([i]) * (i + 1)
            write_file(p, want[n])
        commit(self.ck("odd"))
        got = set(os.listdir(os.fsencode(self.ck("odd"))))
        self.assertEqual(got, set(want) | {b".metadata"})
        for n, data in want.items():
            self.assertEqual(read_all(os.path.join(os.fsencode(self.ck("odd")), n)), data, n)
        self.alive("odd bytes in names")


# ---- nesting ---------------------------------------------------------------

class Nesting(HostileCase):
    def test_200_nested_directories(self):
        os.mkdir(self.ck("deep"))
        parts = [f"level{i:03d}" for i in range(200)]
        rel = "/".join(parts)
        self.assertLess(len(rel), 4000)
        tdata = write_tensor(self.ck("deep", rel, "w"), "bfloat16", [9, 5],
                             tensor_bytes("bfloat16", [9, 5], seed=1))
        mid = "/".join(parts[:100])
        write_file(self.ck("deep", mid, "blob"), b"in the middle")
        commit(self.ck("deep"))
        self.assertEqual(read_all(self.ck("deep", rel, "w")), tdata)
        self.assertEqual(read_all(self.ck("deep", mid, "blob")), b"in the middle")
        self.assertEqual(os.getxattr(self.ck("deep", rel, "w"), "user.ckpt.shape"), b"9,5")
        rows = metadata_rows(self.bk("deep", ".metadata"),
                             "select fqn, path from tensors union all select fqn, path from blobs")
        self.assertEqual(sorted(rows), sorted([(rel.replace("/", ".") + ".w", rel + "/w"),
                                               (mid.replace("/", ".") + ".blob", mid + "/blob")]))
        self.assertEqual(self.m.stop(), 0)
        self.m = self.mount()
        self.assertEqual(read_all(self.ck("deep", rel, "w")), tdata)
        self.alive("200 levels")

    def test_path_length_limit(self):
        # a path inside a checkpoint is at most 4095 bytes (PATH_MAX - 1):
        # longer ones get ENAMETOOLONG at mkdir, create and rename
        os.mkdir(self.ck("long"))
        dirs = ["%c" % (ord("a") + i) * 255 for i in range(15)]  # 15 * 256 - 1 = 3839
        root = self.cursor(self.ck("long"))
        c = self.cursor(self.ck("long")).down(*dirs, create=True)
        # 3839 + 1 + 255 = 4095: fits
        f = os.open("z" * 255, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=c.fd)
        os.write(f, b"at 4095")
        os.close(f)
        os.mkdir("y", dir_fd=c.fd)  # 3841
        os.close(os.open("y/" + "q" * 253, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=c.fd))  # 4095
        self.assertErrno(errno.ENAMETOOLONG, os.open, "y/" + "q" * 254,
                         os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=c.fd)
        self.assertErrno(errno.ENAMETOOLONG, os.mkdir, "y/" + "r" * 254, dir_fd=c.fd)
        # a directory whose subtree would end beyond 4095 cannot move deeper
        os.mkdir("sub", dir_fd=root.fd)
        os.mkdir("sub/" + "s" * 250, dir_fd=root.fd)
        self.assertErrno(errno.ENAMETOOLONG, os.rename, "sub", "y/sub", src_dir_fd=root.fd,
                         dst_dir_fd=c.fd)
        os.rename("sub/" + "s" * 250, "y/t", src_dir_fd=root.fd, dst_dir_fd=c.fd)  # 3843
        # (a listing through an fd opened before the entries were made)
        self.assertEqual(sorted(os.listdir(c.fd)), sorted(["z" * 255, "y"]))
        self.assertEqual(sorted(os.listdir(root.fd)), ["a" * 255, "sub"])
        c.close()
        root.close()
        commit(self.ck("long"))
        rows = metadata_rows(self.bk("long", ".metadata"), "select path from blobs")
        self.assertEqual(sorted(len(r[0]) for r in rows), [4095, 4095])
        c = self.cursor(self.ck("long")).down(*dirs)
        f = os.open("z" * 255, os.O_RDONLY, dir_fd=c.fd)
        self.assertEqual(os.read(f, 100), b"at 4095")
        os.close(f)
        c.close()
        self.alive("path length limit")

    def test_nesting_as_deep_as_allowed(self):
        # 1-byte names: 2048 levels make 4095 bytes; the 2049th is refused,
        # and such a tree commits, remounts and unmounts (no recursion to
        # overflow a stack: a 150000-deep tree crashed the commit once)
        os.mkdir(self.ck("chain"))
        c = self.cursor(self.ck("chain"))
        depth = 0
        while True:
            try:
                os.mkdir("d", dir_fd=c.fd)
            except OSError as e:
                self.assertEqual(e.errno, errno.ENAMETOOLONG)
                break
            c.down("d")
            depth += 1
            self.assertLess(depth, 5000)
        self.assertEqual(depth, 2048)
        c.close()
        c = self.cursor(self.ck("chain")).down(*["d"] * 2047)
        f = os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=c.fd)  # 4095 bytes
        os.write(f, b"bottom")
        os.close(f)
        c.close()
        commit(self.ck("chain"))
        rows = metadata_rows(self.bk("chain", ".metadata"), "select fqn from blobs")
        self.assertEqual(rows, [(".".join(["d"] * 2047 + ["f"]),)])
        self.assertEqual(self.m.stop(), 0)
        self.m = self.mount()
        c = self.cursor(self.ck("chain")).down(*["d"] * 2047)
        f = os.open("f", os.O_RDONLY, dir_fd=c.fd)
        self.assertEqual(os.read(f, 100), b"bottom")
        os.close(f)
        c.close()
        self.alive("deep chain")


# ---- xattrs ----------------------------------------------------------------

class Xattrs(HostileCase):
    NAMES = ("user.ckpt.dtype", "user.ckpt.shape", "user.ckpt.offsets", "user.ckpt.sizes")

    def setUp(self):
        super().setUp()
        os.mkdir(self.ck("x"))
        self.p = self.ck("x", "t")
        write_file(self.p, b"\0" * 24)

    def test_slashes_and_garbage(self):
        rng = random.Random(5)
        values = [b"/", b"float32/", b"/float32", b"../../etc/passwd", b"4/4", b"4,/4",
                  b"[4/4]", b"float32\\", b"\x7f", b"\xff\xfe", b"\x1b[2J", b"4\n4", b"\n\n",
                  b"[" * 100, b"]" * 100, b"4," * 2000, b"1e3", b"+4", b"4.0", b"\xe2\x80\x8b4"]
        for _ in range(200):
            n = rng.randrange(1, 300)
            values.append(bytes(rng.randrange(1, 256) for _ in range(n)))  # NUL-free
        for v in values:
            for name in self.NAMES:
                try:
                    os.setxattr(self.p, name, v)
                except OSError as e:
                    self.assertEqual(e.errno, errno.EINVAL, (name, v))
                    continue
                # the few random values that happen to parse: read back as set
                self.assertEqual(os.getxattr(self.p, name), v, (name, v))
                os.removexattr(self.p, name)
        self.assertEqual(os.listxattr(self.p), [])
        # values with NUL bytes
        for name in self.NAMES:
            self.assertErrno(errno.EINVAL, os.setxattr, self.p, name, b"float32\0")
            self.assertErrno(errno.EINVAL, os.setxattr, self.p, name, b"4\0,4")
        self.alive("garbage xattrs")
        # the file still works as a tensor
        os.setxattr(self.p, "user.ckpt.dtype", b"int32")
        os.setxattr(self.p, "user.ckpt.shape", b"2,3")
        commit(self.ck("x"))
        self.assertEqual(read_all(self.p), b"\0" * 24)
        self.alive("commit after garbage")

    def test_empty_values(self):
        self.assertErrno(errno.EINVAL, os.setxattr, self.p, "user.ckpt.dtype", b"")
        os.setxattr(self.p, "user.ckpt.shape", b"6")
        # empty offsets/sizes are 0-d lists: they do not fit a 1-d shape
        self.assertErrno(errno.EINVAL, os.setxattr, self.p, "user.ckpt.offsets", b"")
        self.assertErrno(errno.EINVAL, os.setxattr, self.p, "user.ckpt.sizes", b"")
        self.assertErrno(errno.EINVAL, os.setxattr, self.p, "user.ckpt.sizes", b"[]")
        # a scalar with every list empty commits
        s = self.ck("x", "scalar")
        data = tensor_bytes("float64", [1], seed=3)
        write_file(s, data)
        for name, v in (("user.ckpt.dtype", b"float64"), ("user.ckpt.shape", b""),
                        ("user.ckpt.offsets", b""), ("user.ckpt.sizes", b"[ ]")):
            os.setxattr(s, name, v)
        self.assertEqual(os.getxattr(s, "user.ckpt.sizes"), b"[ ]")
        # and a shape cannot become non-scalar under empty offsets
        self.assertErrno(errno.EINVAL, os.setxattr, s, "user.ckpt.shape", b"1")
        os.setxattr(self.p, "user.ckpt.dtype", b"float32")
        commit(self.ck("x"))
        self.assertEqual(read_all(s), data)
        self.assertEqual(os.getxattr(s, "user.ckpt.shape"), b"")
        self.assertEqual(os.stat(s).st_size, 8)
        self.alive("empty xattrs")

    def test_huge_values(self):
        # up to 4096 bytes are taken (blanks around a value are fine); beyond:
        # EINVAL from the daemon, and beyond 64 KiB E2BIG from the kernel
        v = b"4, 6" + b" " * 4092
        os.setxattr(self.p, "user.ckpt.shape", v)
        self.assertEqual(os.getxattr(self.p, "user.ckpt.shape"), v)
        os.removexattr(self.p, "user.ckpt.shape")
        for size in (4097, 16 * KiB, 64 * KiB - 1, 64 * KiB):
            for name in self.NAMES:
                self.assertErrno(errno.EINVAL, os.setxattr, self.p, name, b"4" + b" " * (size - 1))
                self.assertErrno(errno.EINVAL, os.setxattr, self.p, name, b"9" * size)
            # another user.* name is kept, replaced at each size
            os.setxattr(self.p, "user.other", b"x" * size)
            self.assertEqual(os.getxattr(self.p, "user.other"), b"x" * size)
        for size in (64 * KiB + 1, MiB, 16 * MiB):
            for name in self.NAMES + ("user.other",):
                self.assertErrno(errno.E2BIG, os.setxattr, self.p, name, b"7" * size)
        self.assertEqual(os.getxattr(self.p, "user.other"), b"x" * 64 * KiB)
        os.removexattr(self.p, "user.other")
        self.assertEqual(os.listxattr(self.p), [])
        # 64 dimensions are the most a list holds
        os.setxattr(self.p, "user.ckpt.shape", b",".join([b"1"] * 64))
        self.assertErrno(errno.EINVAL, os.setxattr, self.p, "user.ckpt.shape",
                         b",".join([b"1"] * 65))
        self.alive("huge xattr values")

    def test_element_count_overflow(self):
        # the element count overflows: refused at setxattr (2**32 * 2**32 = 2**64)
        self.assertErrno(errno.EINVAL, os.setxattr, self.p, "user.ckpt.shape",
                         b"4294967296,4294967296")
        self.assertErrno(errno.EINVAL, os.setxattr, self.p, "user.ckpt.shape",
                         b"9223372036854775808")  # > INT64_MAX
        os.setxattr(self.p, "user.ckpt.shape", b"4294967296,4294967295")  # fits
        os.setxattr(self.p, "user.ckpt.shape", b"9223372036854775807")
        # the byte count overflows (element count fits): the commit fails
        os.setxattr(self.p, "user.ckpt.shape", b"2305843009213693952,2")  # 2**62 elements
        os.setxattr(self.p, "user.ckpt.dtype", b"float64")
        write_tensor(self.ck("x", "huge_bytes"), "uint8", [9223372036854775807], b"\0" * 10)
        self.assertErrno(errno.EIO, commit, self.ck("x"))
        st = status(self.ck("x"))
        self.assertEqual(st.split("\n")[0], "failed", st)
        self.assertRegex(st, r"\nt \(t\): .*2305843009213693952")
        self.assertRegex(st, r"huge_bytes.*\b10\b.*9223372036854775807")
        self.assertNothingPublished("x")
        self.alive("overflowing element counts")
        # fixed, it commits
        os.setxattr(self.p, "user.ckpt.shape", b"3")
        os.unlink(self.ck("x", "huge_bytes"))
        commit(self.ck("x"))
        self.assertEqual(read_all(self.p), b"\0" * 24)


# ---- zero-sized dimensions ---------------------------------------------------

class ZeroDims(HostileCase):
    def test_zero_dims_with_huge_extents(self):
        # a zero extent makes numel 0 however large the others are
        big = 9223372036854775807
        os.mkdir(self.ck("z"))
        cases = {"a": [0, big], "b": [big, big, 0], "c": [0] * 64, "d": [5, 0, 4294967296]}
        for n, shape in cases.items():
            write_tensor(self.ck("z", n), "complex128", shape, b"")
        # shards of an empty tensor: zero-sized chunks at offsets
        write_tensor(self.ck("z", "e"), "int32", [4, 0], b"", offsets=[2, 0], sizes=[2, 0])
        write_tensor(self.ck("z", "f"), "int32", [0, big], b"", offsets=[0, 0], sizes=[0, big])
        # outside the shape is still refused
        g = self.ck("z", "g")
        write_file(g, b"")
        os.setxattr(g, "user.ckpt.shape", b"0,4")
        self.assertErrno(errno.EINVAL, os.setxattr, g, "user.ckpt.offsets", b"1,0")
        self.assertErrno(errno.EINVAL, os.setxattr, g, "user.ckpt.sizes", b"0,5")
        os.unlink(g)
        commit(self.ck("z"))
        for n, shape in cases.items():
            p = self.ck("z", n)
            self.assertEqual(os.stat(p).st_size, 0, n)
            self.assertEqual(read_all(p), b"", n)
            self.assertEqual(pread(p, 100, 1 << 62), b"", n)
            self.assertEqual(os.getxattr(p, "user.ckpt.shape"), ",".join(map(str, shape)).encode())
        self.assertEqual(read_all(self.ck("z", "e")), b"")
        shapes = dict(metadata_rows(self.bk("z", ".metadata"), "select fqn, shape from tensors"))
        self.assertEqual(shapes["b"], f"[{big},{big},0]")
        self.alive("zero dims")

    def test_data_for_an_empty_tensor_fails(self):
        os.mkdir(self.ck("z2"))
        write_tensor(self.ck("z2", "e"), "float32", [0, 3], b"\1\2\3\4")
        self.assertErrno(errno.EIO, commit, self.ck("z2"))
        st = status(self.ck("z2"))
        self.assertRegex(st, r"\ne \(e\): rank 0 wrote 4 bytes, 0 expected")
        self.assertNothingPublished("z2")
        self.alive("data for an empty tensor")


# ---- many small files --------------------------------------------------------

class ManySmallFiles(HostileCase):
    opts = "sync_files=0"

    def test_many_small_files(self):
        n = int(os.environ.get("CKPTFS_HOSTILE_FILES", "1000000"))
        per_dir = 1000
        os.mkdir(self.ck("many"))
        rss0 = self.rss()
        t0 = time.monotonic()
        for d in range((n + per_dir - 1) // per_dir):
            os.mkdir(self.ck("many", f"d{d:04d}"))
            dfd = os.open(self.ck("many", f"d{d:04d}"), os.O_RDONLY | os.O_DIRECTORY)
            try:
                for i in range(d * per_dir, min(n, (d + 1) * per_dir)):
                    fd = os.open(f"f{i}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=dfd)
                    if i % 3:
                        os.write(fd, b"%d" % i)  # a few bytes; every third empty
                    os.close(fd)
            finally:
                os.close(dfd)
        t_stage = time.monotonic() - t0
        rss_staged = self.rss()
        t1 = time.monotonic()
        commit(self.ck("many"))
        t_commit = time.monotonic() - t1
        rss_committed = self.rss()
        sys.stderr.write(f"\n  {n} small files: staged in {t_stage:.1f} s ({n / t_stage:.0f} files/s), "
                         f"committed in {t_commit:.1f} s; daemon RSS {rss0 // 1024} MiB before, "
                         f"{rss_staged // 1024} MiB staged, {rss_committed // 1024} MiB committed\n")
        self.assertEqual(state(self.ck("many")), "committed")
        count = metadata_rows(self.bk("many", ".metadata"), "select count(*) from blobs")[0][0]
        self.assertEqual(count, n)
        rng = random.Random(1)
        for i in rng.sample(range(n), 2000) + [0, 1, 2, n - 1]:
            want = b"%d" % i if i % 3 else b""
            self.assertEqual(read_all(self.ck("many", f"d{i // per_dir:04d}", f"f{i}")), want, i)
        self.assertEqual(len(os.listdir(self.ck("many", "d0000"))), min(n, per_dir))
        self.assertEqual(len(os.listdir(self.ck("many"))), (n + per_dir - 1) // per_dir + 1)
        # memory: about 1 KiB per staged file (1.7 KiB with ASan), not a
        # 4 KiB buffer per tiny file as once
        self.assertLess(rss_staged - rss0, n * 5 // 2 + 64 * 1024,
                        f"{(rss_staged - rss0) * 1024 // n} bytes of RSS per staged file")
        self.assertLess(rss_committed - rss0, n * 4 + 256 * 1024,
                        f"{(rss_committed - rss0) * 1024 // n} bytes of RSS per committed file")
        self.alive("many small files")


# ---- huge offsets ----------------------------------------------------------

class HugeOffsets(HostileCase):
    """Through the daemon (-o passthrough=0): every write and truncate is
    checked against the 1 TiB limit (PassthroughHugeOffsets: the default
    path, where the kernel writes)."""
    opts = "passthrough=0"

    def test_writes_and_truncates_beyond_the_limit(self):
        os.mkdir(self.ck("h"))
        p = self.ck("h", "f")
        rss0 = self.rss()
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"head")
            for off in (MAX_FILE, MAX_FILE + 1, 1 << 50, (1 << 52) - 100, 1 << 62,
                        (1 << 63) - 3):
                self.assertErrno(errno.EFBIG, os.pwrite, fd, b"xy", off)
            # ending beyond the largest file offset: refused by the kernel
            self.assertErrno(errno.EINVAL, os.pwrite, fd, b"xy", (1 << 63) - 2)
            self.assertErrno(errno.EINVAL, os.pwrite, fd, b"x", (1 << 63) - 1)
            self.assertErrno(errno.EINVAL, os.pwrite, fd, b"x", -1)
            with self.assertRaises(OverflowError):
                os.pwrite(fd, b"x", 1 << 63)
            os.lseek(fd, 1 << 62, os.SEEK_SET)
            self.assertErrno(errno.EFBIG, os.write, fd, b"x")
            for size in (MAX_FILE + 1, 1 << 62, (1 << 63) - 1):
                self.assertErrno(errno.EFBIG, os.ftruncate, fd, size)
                self.assertErrno(errno.EFBIG, os.truncate, p, size)
            self.assertEqual(os.fstat(fd).st_size, 4)
        finally:
            os.close(fd)
        self.assertEqual(read_all(p), b"head")
        self.assertLess(self.rss() - rss0, 16 * 1024)
        self.alive("huge offsets refused")
        # up to the limit a write works: a sparse file whose index stays small
        q = self.ck("h", "edge")
        for flags in (os.O_WRONLY, os.O_RDWR):  # direct, and through the page cache
            fd = os.open(q, flags | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                self.assertEqual(os.pwrite(fd, b"E", MAX_FILE - 1), 1)
                self.assertEqual(os.fstat(fd).st_size, MAX_FILE)
                self.assertErrno(errno.EFBIG, os.pwrite, fd, b"E", MAX_FILE)
                # across the limit: refused, or short up to the limit (as ext4 does)
                try:
                    self.assertEqual(os.pwrite(fd, b"EF", MAX_FILE - 1), 1)
                except OSError as e:
                    self.assertEqual(e.errno, errno.EFBIG)
                self.assertEqual(os.fstat(fd).st_size, MAX_FILE)
            finally:
                os.close(fd)
        self.assertEqual(pread(q, 1, MAX_FILE - 1), b"E")
        self.assertEqual(pread(q, 5, 1 << 39), b"\0" * 5)
        self.assertLess(self.rss() - rss0, 96 * 1024)
        os.unlink(q)  # (committing it would store a terabyte)
        self.alive("a write at the limit")
        commit(self.ck("h"))
        self.assertEqual(read_all(p), b"head")
        self.alive("commit after huge offsets")

    def test_passthrough_file_beyond_the_limit_fails_the_commit(self):
        """By default a file created write-only is written by the kernel
        (FUSE passthrough), which knows no 1 TiB limit: a write beyond it
        may succeed (the backing filesystem decides), and then the commit
        fails at once saying which file is too large; truncated, it
        commits."""
        self.m.stop()
        self.mounts.remove(self.m)
        self.m = self.mount()
        os.mkdir(self.ck("hp"))
        p = self.ck("hp", "f")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"head")
            try:
                os.pwrite(fd, b"xy", MAX_FILE + 4096)
                beyond = True
            except OSError as e:
                self.assertEqual(e.errno, errno.EFBIG)
                beyond = False
        finally:
            os.close(fd)
        if beyond:
            self.assertErrno(errno.EFBIG, commit, self.ck("hp"))
            st = status(self.ck("hp"))
            self.assertEqual(st.split("\n")[0], "failed", st)
            self.assertIn("rank 0: f is larger than a staged file may be", st)
            os.truncate(p, 4)
        commit(self.ck("hp"))
        self.assertEqual(read_all(p), b"head")
        self.alive("a passthrough file beyond the limit")

    def test_sparse_file_commits(self):
        os.mkdir(self.ck("sp"))
        p = self.ck("sp", "s")
        hole = 96 * MiB
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(fd, b"tail", hole)
        os.close(fd)
        t = write_tensor(self.ck("sp", "t"), "int8", [1 << 20], b"")
        os.truncate(self.ck("sp", "t"), 1 << 20)  # a tensor of zeros by truncate
        commit(self.ck("sp"))
        self.assertEqual(t, b"")
        self.assertEqual(os.stat(p).st_size, hole + 4)
        self.assertEqual(pread(p, 8, hole - 4), b"\0" * 4 + b"tail")
        self.assertEqual(pread(p, 4096, hole // 2), b"\0" * 4096)
        self.assertEqual(read_all(self.ck("sp", "t")), b"\0" * (1 << 20))
        self.alive("sparse commit")

    def test_sparse_file_commits_without_writing_holes(self):
        os.mkdir(self.ck("sp2"))
        fd = os.open(self.ck("sp2", "s"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(fd, b"tail", 96 * MiB)
        os.close(fd)
        commit(self.ck("sp2"))
        allocated = sum(os.stat(self.bk("sp2", f)).st_blocks * 512
                        for f in os.listdir(self.bk("sp2")) if f.endswith(".distcp"))
        self.assertLess(allocated, 8 * MiB)
        # and it reads back as written: zeros, then the tail
        self.assertEqual(os.stat(self.ck("sp2", "s")).st_size, 96 * MiB + 4)
        self.assertEqual(pread(self.ck("sp2", "s"), 8, 96 * MiB - 4), b"\0" * 4 + b"tail")
        self.assertEqual(pread(self.ck("sp2", "s"), MiB, 40 * MiB), b"\0" * MiB)
        fsck = os.path.join(os.path.dirname(cu.BIN), "ckptfs-fsck")
        r = subprocess.run([fsck, self.backing, "sp2"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


# ---- .commit -----------------------------------------------------------------

class CommitWrites(HostileCase):
    def setUp(self):
        super().setUp()
        os.mkdir(self.ck("c"))
        self.data = write_tensor(self.ck("c", "w"), "int64", [10], tensor_bytes("int64", [10]))

    def refused(self, payload, what):
        self.assertErrno(errno.EINVAL, commit, self.ck("c"), payload)
        self.assertEqual(state(self.ck("c")), "staging", what)
        self.assertFalse(os.path.exists(self.bk("c")), what)
        self.alive(what)

    def test_oversized_and_garbage(self):
        rng = random.Random(3)
        for payload, what in [
                (b"sync" + b"\n" * (64 * KiB), "sync and 64 KiB of newlines"),
                (b"sync" * (256 * KiB), "1 MiB of sync"),
                (b"async" + b"\0" * (4 * MiB), "async and 4 MiB of NULs"),
                (os.urandom(3 * MiB + 17), "3 MiB of random bytes"),
                (bytes(rng.randrange(1, 256) for _ in range(4096)), "4 KiB NUL-free garbage"),
                (b"\xff\xfesync", "non-UTF-8 prefix"),
                (b"sync\r\n", "CRLF"),
                (b"sync\n" * 2, "two lines")]:
            self.refused(payload, what)

    def test_partial_writes(self):
        fd = os.open(self.ck("c", ".commit"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            # pieces of "sync" in separate writes are each refused: no state is kept
            for piece in (b"sy", b"nc", b"s", b"ync\n", b"a", b"sync"[1:]):
                self.assertErrno(errno.EINVAL, os.write, fd, piece)
                self.assertEqual(state(self.ck("c")), "staging", piece)
            n = os.write(fd, b"")  # an empty write commits nothing
            self.assertEqual(n, 0)
            self.assertEqual(state(self.ck("c")), "staging")
            # one writev of the pieces is one write of "sync"
            self.assertEqual(os.writev(fd, [b"sy", b"nc", b"\n"]), 5)
        finally:
            os.close(fd)
        self.assertEqual(state(self.ck("c")), "committed")
        self.assertEqual(read_all(self.ck("c", "w")), self.data)
        # more writes to a committed checkpoint's .commit: refused, nothing changes
        for payload in (b"sync", b"async\n", b"junk"):
            with self.assertRaises(OSError) as cm:
                commit(self.ck("c"), payload)
            self.assertIn(cm.exception.errno, (errno.EROFS, errno.EINVAL), payload)
        self.assertEqual(read_all(self.ck("c", "w")), self.data)
        self.alive("partial writes")

    def test_wrong_opens(self):
        self.assertErrno(errno.EACCES, os.open, self.ck("c", ".commit"), os.O_RDONLY)
        fd = os.open(self.ck("c", ".commit"), os.O_RDWR)
        try:
            with self.assertRaises(OSError):
                os.read(fd, 10)
        finally:
            os.close(fd)
        self.assertErrno(errno.EACCES, os.open, self.ck("c", ".status"), os.O_WRONLY)
        self.assertErrno(errno.EPERM, os.unlink, self.ck("c", ".commit"))
        self.assertErrno(errno.EPERM, os.rename, self.ck("c", ".commit"), self.ck("c", "x"))
        self.assertEqual(state(self.ck("c")), "staging")
        commit(self.ck("c"), "async")
        self.assertEqual(wait_state(self.ck("c")).split("\n")[0], "committed")
        self.alive("wrong opens")


# ---- access ----------------------------------------------------------------

CHILD = r"""
import errno, json, os, sys
ops = json.loads(sys.argv[1])
out = []
for op, path, *arg in ops:
    try:
        if op == "stat":
            os.stat(path); r = "ok"
        elif op == "listdir":
            r = sorted(os.listdir(path))
        elif op == "read":
            with open(path, "rb") as f:
                r = f.read().hex()
        elif op == "getxattr":
            r = os.getxattr(path, arg[0]).decode()
        elif op == "mkdir":
            os.mkdir(path); r = "ok"
        elif op == "create":
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)); r = "ok"
        elif op == "write":
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, arg[0].encode())
            finally:
                os.close(fd)
            r = "ok"
        elif op == "truncate":
            os.truncate(path, 0); r = "ok"
        elif op == "unlink":
            os.unlink(path); r = "ok"
        elif op == "rmdir":
            os.rmdir(path); r = "ok"
        elif op == "rename":
            os.rename(path, arg[0]); r = "ok"
        elif op == "setxattr":
            os.setxattr(path, arg[0], arg[1].encode()); r = "ok"
        elif op == "chmod":
            os.chmod(path, 0o777); r = "ok"
        else:
            r = "bad op"
    except OSError as e:
        r = errno.errorcode.get(e.errno, str(e.errno))
    out.append(r)
print(json.dumps(out))
"""


def as_nobody():
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)


class Access(HostileCase):
    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest("needs root (the daemon as root, a child as another uid)")
        super().setUp()
        os.chmod(self.dir, 0o755)  # others may walk to the mountpoint

    def as_other(self, ops):
        """Run ops as uid/gid 65534 (an interpreter that others may run)."""
        python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable)
                       if os.path.exists(p) and os.stat(p).st_mode & 0o001), None)
        if not python:
            self.skipTest("no python3 that other users may run")
        r = subprocess.run([python, "-c", CHILD, json.dumps(ops)], preexec_fn=as_nobody,
                           cwd="/", capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        return json.loads(r.stdout)

    def test_other_user_without_allow_other(self):
        got = self.as_other([["stat", self.mnt], ["listdir", self.mnt],
                             ["stat", self.ck("good", "w")], ["read", self.ck("good", "cfg/b")],
                             ["mkdir", self.ck("theirs")], ["stat", self.dir]])
        self.assertEqual(got, ["EACCES"] * 5 + ["ok"])
        self.assertEqual(os.listdir(self.mnt), ["good"])
        self.alive("another user")

    def test_other_user_with_allow_other_reads_only(self):
        self.assertEqual(self.m.stop(), 0)
        self.m = self.mount("allow_other")
        os.mkdir(self.ck("staged"))
        write_file(self.ck("staged", "mine"), b"mine")
        good, staged = self.ck("good"), self.ck("staged")
        got = self.as_other([["listdir", self.mnt], ["listdir", good],
                             ["read", self.ck("good", "cfg/b")], ["read", self.ck("good", "w")],
                             ["getxattr", self.ck("good", "w"), "user.ckpt.shape"],
                             ["read", self.ck("good", ".status")],
                             ["read", self.ck("staged", "mine")]])
        self.assertEqual(got, [["good", "staged"], [".metadata", "cfg", "w"],
                               self.good["cfg/b"].hex(), self.good["w"].hex(), "64,33",
                               b"committed\ntensors 1\nblobs 1\nworld_size 1\n".hex(),
                               b"mine".hex()])
        # but changes nothing: neither their own checkpoints nor ours
        changes = [["mkdir", self.ck("theirs")], ["mkdir", self.ck("staged", "d")],
                   ["create", self.ck("staged", "new")], ["write", self.ck("staged", "mine"), "x"],
                   ["truncate", self.ck("staged", "mine")],
                   ["setxattr", self.ck("staged", "mine"), "user.ckpt.dtype", "uint8"],
                   ["chmod", self.ck("staged", "mine")],
                   ["rename", self.ck("staged", "mine"), self.ck("staged", "moved")],
                   ["write", self.ck("staged", ".commit"), "sync"],
                   ["unlink", self.ck("staged", "mine")], ["unlink", self.ck("good", "w")],
                   ["rmdir", self.ck("good", "cfg")], ["rmdir", staged],
                   # many entries at once: refused like each one
                   ["setxattr", staged, "user.ckpt.metas", "mine\0dtype=uint8;shape=4\0"],
                   ["setxattr", staged, "user.ckpt.mkdirs", "755\0d2\0"]]
        got = self.as_other(changes)
        keys = [" ".join(c[:3] if c[0] == "setxattr" else c[:2]) for c in changes]
        self.assertEqual(dict(zip(keys, got)), {k: "EACCES" for k in keys})
        self.assertEqual(sorted(os.listdir(self.mnt)), ["good", "staged"])
        self.assertEqual(os.listdir(staged), ["mine"])
        self.assertEqual(read_all(self.ck("staged", "mine")), b"mine")
        self.assertEqual(os.listxattr(self.ck("staged", "mine")), [])
        self.assertEqual(state(staged), "staging")
        self.assertEqual(sorted(os.listdir(good)), [".metadata", "cfg", "w"])
        # the mounting user still does everything
        commit(staged)
        shutil.rmtree(staged)
        self.assertEqual(os.listdir(self.mnt), ["good"])
        self.alive("allow_other")

    def test_commit_keeps_modes_and_owners(self):
        """A file staged 0600 in a 0700 directory stays unreadable by other
        users once committed (0400 in 0500, still the owner's), also after
        a remount, through .metadata and the views too; a 0644 one stays
        readable (0444). Committed files keep their staged times. Modes are
        kept without default_permissions as well (issue 13)."""
        self.assertEqual(self.m.stop(), 0)
        self.m = self.mount("allow_other,default_permissions")
        priv, pub = self.ck("priv"), self.ck("pub")
        os.mkdir(priv, 0o700)
        os.chmod(priv, 0o700)
        secret = os.path.join(priv, "secret")
        write_file(secret, b"secret")
        os.chmod(secret, 0o600)
        os.chown(secret, 12345, 23456)
        past = 1_500_000_000 * 10**9
        os.utime(secret, ns=(past, past))
        os.mkdir(pub, 0o755)
        os.chmod(pub, 0o755)
        write_file(os.path.join(pub, "open"), b"open")
        os.chmod(os.path.join(pub, "open"), 0o644)
        # a 0644 tensor inside a 0700 directory: its bytes must not leak
        # through the views either
        hidden = os.path.join(pub, "hidden")
        os.mkdir(hidden, 0o700)
        os.chmod(hidden, 0o700)
        write_tensor(os.path.join(hidden, "t"), "float32", [4], tensor_bytes("float32", [4], seed=3))
        os.chmod(os.path.join(hidden, "t"), 0o644)
        os.utime(hidden, ns=(past, past))
        before = self.as_other([["read", secret], ["listdir", priv]])
        self.assertEqual(before, ["EACCES", "EACCES"])
        commit(priv)
        commit(pub)

        def check(default_permissions):
            st = os.stat(secret)
            self.assertEqual((oct(st.st_mode), st.st_uid, st.st_gid),
                             (oct(0o100400), 12345, 23456))
            self.assertEqual(st.st_mtime_ns, past)
            self.assertEqual(oct(os.stat(priv).st_mode), oct(0o40500))
            self.assertEqual(oct(os.stat(os.path.join(pub, "open")).st_mode), oct(0o100444))
            self.assertEqual(oct(os.stat(pub).st_mode), oct(0o40555))
            self.assertEqual(oct(os.stat(hidden).st_mode), oct(0o40500))
            self.assertEqual(os.stat(hidden).st_mtime_ns, past)  # the staged time
            npy = os.path.join(pub, ".npy", "hidden", "t.npy")
            self.assertEqual(os.stat(npy).st_mode & 0o077, 0, oct(os.stat(npy).st_mode))
            md = os.stat(os.path.join(priv, ".metadata"))
            self.assertEqual(md.st_mode & 0o077, 0, oct(md.st_mode))
            if not default_permissions:
                return
            got = self.as_other([["read", secret], ["listdir", priv],
                                 ["read", os.path.join(priv, ".metadata")],
                                 ["read", os.path.join(priv, ".npy", "secret.npy")],
                                 ["read", os.path.join(pub, ".npy", "hidden", "t.npy")],
                                 ["read", os.path.join(hidden, "t")],
                                 ["read", os.path.join(pub, "open")]])
            self.assertEqual(got, ["EACCES"] * 6 + [b"open".hex()])

        check(True)
        self.assertEqual(read_all(secret), b"secret")  # root still reads it
        self.assertEqual(self.m.stop(), 0)
        self.m = self.mount("allow_other,default_permissions")
        check(True)
        self.assertEqual(self.m.stop(), 0)
        self.m = self.mount("allow_other")
        check(False)
        self.alive("modes kept")

    def test_backing_modes(self):
        # even with umask 0 nothing in BACKING_DIR is readable by group or others
        self.assertEqual(self.m.stop(), 0)
        shutil.rmtree(self.backing)
        old = os.umask(0)
        try:
            self.m = self.mount("staging_mem=1M,io_threads=2")
        finally:
            os.umask(old)
        self.good = {}  # gone with the backing directory
        seen = set()

        def check():
            for top, dirs, files in os.walk(self.backing):
                for n in [top] + [os.path.join(top, x) for x in dirs + files]:
                    try:
                        mode = os.lstat(n).st_mode
                    except FileNotFoundError:  # a temporary file went meanwhile
                        continue
                    rel = os.path.relpath(n, self.backing)
                    seen.add(rel)
                    self.assertEqual(mode & 0o077, 0, f"{rel}: {oct(mode)}")

        os.mkdir(self.ck("s"))
        write_file(self.ck("s", "stream"), os.urandom(4 * MiB))  # write-behind stream
        fd = os.open(self.ck("s", "spilled"), os.O_WRONLY | os.O_CREAT, 0o666)
        for i in range(4):  # out of order, beyond staging_mem: spilled
            os.pwrite(fd, os.urandom(MiB), (3 - i) * MiB)
        os.close(fd)
        write_tensor(self.ck("s", "t"), "float32", [4], tensor_bytes("float32", [4]))
        check()
        self.assertIn(".staging", seen)
        commit(self.ck("s"))
        os.mkdir(self.ck("a"))
        write_file(self.ck("a", "big"), os.urandom(16 * MiB))
        commit(self.ck("a"), "async")
        while state(self.ck("a")) == "committing":
            check()
        self.assertEqual(state(self.ck("a")), "committed")
        check()
        for want in (".", "s", "s/.metadata", "s/__0_0.distcp", "a", "a/.metadata"):
            self.assertIn(os.path.normpath(want), seen)

    def plant_outside(self):
        outside = os.path.join(self.dir, "outside")
        os.makedirs(outside)
        write_file(os.path.join(outside, "secret"), b"outside BACKING_DIR")
        return outside

    def snapshot(self, d):
        return {n: (read_all(os.path.join(d, n)), os.stat(os.path.join(d, n)).st_mtime_ns)
                for n in sorted(os.listdir(d))}

    def test_symlinked_checkpoint_name_not_followed(self):
        outside = self.plant_outside()
        before = self.snapshot(outside)
        os.symlink(outside, self.bk("evil"))
        write_file(self.bk("file"), b"an unrelated file")
        self.assertEqual(self.m.stop(), 0)
        self.m = self.mount()  # the scan at mount start
        self.assertEqual(os.listdir(self.mnt), ["good"])
        self.assertErrno(errno.ENOENT, os.stat, self.ck("evil"))
        self.assertErrno(errno.ENOENT, os.stat, self.ck("evil", "secret"))
        # the names are taken in BACKING_DIR: refused before any commit
        self.assertErrno(errno.EEXIST, os.mkdir, self.ck("evil"))
        self.assertErrno(errno.EEXIST, os.mkdir, self.ck("file"))
        self.assertEqual(os.readlink(self.bk("evil")), outside)
        self.assertEqual(read_all(self.bk("file")), b"an unrelated file")
        self.assertEqual(self.snapshot(outside), before)
        # a symlink planted between mkdir and commit: the commit fails
        os.mkdir(self.ck("late"))
        write_file(self.ck("late", "x"), b"data")
        os.symlink(outside, self.bk("late"))
        self.assertErrno(errno.EEXIST, commit, self.ck("late"))
        self.assertIn("late", status(self.ck("late")))
        self.assertIn("symbolic link", status(self.ck("late")))
        self.assertEqual(self.snapshot(outside), before)
        # no directory was made in its place either
        self.assertFalse(os.path.exists(self.bk("late")) and not os.path.islink(self.bk("late")))
        self.alive("symlinked checkpoint name")

    def test_failed_commit_keeps_what_it_did_not_create(self):
        outside = self.plant_outside()
        os.mkdir(self.ck("late"))
        write_file(self.ck("late", "x"), b"data")
        os.symlink(outside, self.bk("late"))
        os.mkdir(self.ck("late2"))
        write_file(self.ck("late2", "x"), b"data")
        write_file(self.bk("late2"), b"an unrelated file")
        self.assertErrno(errno.EEXIST, commit, self.ck("late"))
        self.assertErrno(errno.EEXIST, commit, self.ck("late2"))
        self.assertTrue(os.path.islink(self.bk("late")))
        self.assertTrue(os.path.isfile(self.bk("late2")))
        self.assertEqual(read_all(self.bk("late2")), b"an unrelated file")

    def test_mount_start_does_not_touch_a_symlink_target(self):
        outside = self.plant_outside()
        # a whole committed checkpoint outside, BACKING_DIR/evil pointing at it
        shutil.copytree(self.bk("good"), os.path.join(outside, "ck"))
        write_file(os.path.join(outside, "ck", ".metadata.tmp"), b"kept")
        before = self.snapshot(os.path.join(outside, "ck"))
        os.symlink(os.path.join(outside, "ck"), self.bk("evil"))
        self.assertEqual(self.m.stop(), 0)
        self.m = self.mount()
        self.assertEqual(os.listdir(self.mnt), ["good"])  # not shown: holds
        self.assertTrue(os.path.exists(os.path.join(outside, "ck", ".metadata.tmp")))
        self.assertEqual(self.snapshot(os.path.join(outside, "ck")), before)

    def test_symlink_to_a_checkpoint_outside_not_shown(self):
        outside = self.plant_outside()
        shutil.copytree(self.bk("good"), os.path.join(outside, "ck"))
        os.symlink(os.path.join(outside, "ck"), self.bk("evil"))
        self.assertEqual(self.m.stop(), 0)
        self.m = self.mount()
        self.assertEqual(os.listdir(self.mnt), ["good"])
        self.assertErrno(errno.ENOENT, os.stat, self.ck("evil", "w"))
        self.assertErrno(errno.EEXIST, os.mkdir, self.ck("evil"))
        self.assertTrue(os.path.isfile(os.path.join(outside, "ck", ".metadata")))
        self.alive("symlink to a checkpoint outside")

    def test_symlinked_data_file_not_followed(self):
        outside = self.plant_outside()
        data_files = [f for f in os.listdir(self.bk("good")) if f.endswith(".distcp")]
        self.assertEqual(self.m.stop(), 0)
        for f in data_files:
            size = os.stat(self.bk("good", f)).st_size
            fake = os.path.join(outside, f)
            write_file(fake, b"S" * size)
            os.unlink(self.bk("good", f))
            os.symlink(fake, self.bk("good", f))
        self.m = self.mount()
        with self.assertRaises(OSError) as cm:
            read_all(self.ck("good", "cfg/b"))
        self.assertEqual(cm.exception.errno, errno.EIO)


if __name__ == "__main__":
    main()

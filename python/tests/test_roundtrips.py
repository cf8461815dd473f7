#!/usr/bin/env python3
"""FUSE round trips per tensor of the Python package's saves: ckptfs.save
(with Shards) and dcp.save through ckptfs.dcp.Writer, 200 small tensors
three directories deep, counted by the daemon itself
(ckptfs_fuse_requests_total{op} of -o metrics=FILE, written at unmount).
A save costs LOOKUP, CREATE, one SETXATTR (user.ckpt.meta), WRITE, FLUSH
and RELEASE per tensor, plus MKDIR and two LOOKUPs per directory: a test
fails when a path lookup or a setxattr per xattr comes back (they were 22
and 13 requests per tensor). Also user.ckpt.meta itself: its fields land
as the separate xattrs, all or none.

    PYTHONPATH=tests/integration:python \\
        python3 python/tests/test_roundtrips.py --bin build/bin/ckptfs
"""

import errno
import os
import unittest

from ckpttest.util import CkptfsTestCase, fuse_requests, main
from ckpttest.pyenv import require_torch, run_py

N = 200
# The measured figure (6.2 per tensor at N = 200: 6 per file, 0.2 for the
# directories' MKDIR and LOOKUPs) plus a little for the mount and commit.
MAX_PER_TENSOR = 6.6

# Saves (argv: mnt client|dcp N), or with a 4th argument loads back and
# compares.
SAVE = r'''
import sys, torch, warnings
import ckptfs, ckptfs.dcp
import torch.distributed.checkpoint as dcp
mnt, how, n, load = sys.argv[1], sys.argv[2], int(sys.argv[3]), len(sys.argv) > 4
warnings.filterwarnings("ignore")
g = torch.Generator().manual_seed(3)
flat = {f"model.layers.{i // 10}.w{i % 10}": torch.randn(8, 16, generator=g) for i in range(n)}
if how == "client":
    sd = {}
    for k, t in flat.items():
        *dirs, leaf = k.split(".")
        d = sd
        for p in dirs:
            d = d.setdefault(p, {})
        # every other one a Shard: dtype, shape, offsets, sizes in one setxattr
        d[leaf] = ckptfs.Shard(t, (0, 0), (8, 16)) if int(leaf[1:]) % 2 else t
    if not load:
        ckptfs.save(sd, mnt, "c")
    else:
        back = ckptfs.load(None, mnt, "c")
        for k, t in flat.items():
            d = back
            for p in k.split("."):
                d = d[p]
            assert torch.equal(d, t), k
elif not load:
    dcp.save(flat, storage_writer=ckptfs.dcp.Writer(mnt), checkpoint_id="c")
else:
    back = {k: torch.zeros_like(t) for k, t in flat.items()}
    dcp.load(back, storage_reader=ckptfs.dcp.Reader(mnt), checkpoint_id="c")
    assert all(torch.equal(back[k], t) for k, t in flat.items())
'''


MANY_DIRS = r'''
import os, sys, torch
import ckptfs
from ckptfs.staging import StagingDirs as _StagingDirs
mnt = sys.argv[1]
n = 3 * _StagingDirs.HELD
sd = {f"d{i}": {"sub": {"w": torch.full((4,), float(i))}} for i in range(n)}
held = []
close = _StagingDirs.close
_StagingDirs.close = lambda self: (held.append(len(self.fds)), close(self))
before = len(os.listdir("/proc/self/fd"))
ckptfs.save(sd, mnt, "many")
assert held and max(held) <= _StagingDirs.HELD, held
assert len(os.listdir("/proc/self/fd")) == before, "directory fds left open"
back = ckptfs.load(None, mnt, "many")
assert all(torch.equal(back[f"d{i}"]["sub"]["w"], sd[f"d{i}"]["sub"]["w"]) for i in range(n))
print("ok")
'''



class RoundTrips(CkptfsTestCase):
    def save_counted(self, how):
        py = require_torch(self)
        mfile = os.path.join(self.dir, "m.prom")
        m = self.mount("metrics=" + mfile)
        run_py(self, py, SAVE, self.mnt, how, N)
        self.assertEqual(m.stop(), 0)  # the last metrics are written at unmount
        self.mount()
        run_py(self, py, SAVE, self.mnt, how, N, "load")
        return fuse_requests(mfile)

    def check(self, how):
        got = self.save_counted(how)
        # FORGETs are no round trips (nobody waits for them) and come when
        # the kernel evicts inodes: after the commit, or not at all
        got.pop("forget", None)
        per = {op: v / N for op, v in got.items() if v}
        total = sum(got.values()) / N
        self.assertLessEqual(total, MAX_PER_TENSOR, f"{how}: {per}")
        # one SETXATTR per file (user.ckpt.meta), one LOOKUP per file (the
        # new name under its held directory), a little more per directory
        self.assertLessEqual(per["setxattr"], 1.05, per)
        self.assertLessEqual(per["lookup"], 1.3, per)
        self.assertGreaterEqual(per["create"], 1.0, per)  # counted at all

    def test_client_save(self):
        self.check("client")

    def test_dcp_writer_save(self):
        self.check("dcp")

    def test_many_directories(self):
        """More directories than the client holds open at once (HELD): the
        idle ones are closed as it goes, none is left open, all is saved."""
        py = require_torch(self)
        self.mount()
        out = run_py(self, py, MANY_DIRS, self.mnt)
        self.assertIn("ok", out)


class Meta(CkptfsTestCase):
    """user.ckpt.meta through the plain system call."""

    def setUp(self):
        super().setUp()
        self.mount()
        os.mkdir(self.ck("m"))

    def staged(self, name, nbytes):
        path = self.ck("m", name)
        with open(path, "wb") as f:
            f.write(bytes(nbytes))
        return path

    def xattrs(self, path):
        return {k: os.getxattr(path, k) for k in os.listxattr(path)}

    def test_fields_land_as_the_xattrs(self):
        p = self.staged("w", 2 * 5 * 4)
        os.setxattr(p, "user.ckpt.meta",
                    b"dtype=float32;shape=6,5;offsets=2,0;sizes=2,5;fqn=m.w;x=y")
        self.assertEqual(self.xattrs(p), {
            "user.ckpt.dtype": b"float32", "user.ckpt.shape": b"6,5",
            "user.ckpt.offsets": b"2,0", "user.ckpt.sizes": b"2,5",
            "user.ckpt.fqn": b"m.w;x=y"})  # fqn runs to the end
        self.assertErrno(errno.ENODATA, os.getxattr, p, "user.ckpt.meta")
        self.assertNotIn("user.ckpt.meta", os.listxattr(p))

    def test_chunks_commit(self):
        """Three row chunks of one tensor described by user.ckpt.meta alone
        commit as the whole tensor."""
        rows = [bytes([i + 1]) * 40 for i in range(3)]
        for i, data in enumerate(rows):
            path = self.ck("m", f"w.{i}")
            with open(path, "wb") as f:
                os.setxattr(f.fileno(), "user.ckpt.meta",
                            f"dtype=float32;shape=6,5;offsets={2 * i},0;sizes=2,5;"
                            "fqn=model.w".encode())
                f.write(data)
        with open(self.ck("m", ".commit"), "w") as f:
            f.write("sync")
        with open(self.ck("m", "w.0"), "rb") as f:
            self.assertEqual(f.read(), b"".join(rows))
        self.assertEqual(os.getxattr(self.ck("m", "w.0"), "user.ckpt.shape"), b"6,5")

    def test_all_or_none(self):
        p = self.staged("v", 24)
        os.setxattr(p, "user.ckpt.dtype", b"uint8")
        for bad in (b"dtype=float32;shape=2,3;offsets=5,0", b"dtype=F99;shape=6",
                    b"dtype=float32;dtype=float32", b"colour=red", b"shape",
                    b"dtype=float32;shape=6;fqn=", b""):
            self.assertErrno(errno.EINVAL, os.setxattr, p, "user.ckpt.meta", bad)
            self.assertEqual(self.xattrs(p), {"user.ckpt.dtype": b"uint8"}, bad)
        self.assertErrno(errno.EEXIST, os.setxattr, p, "user.ckpt.meta",
                         b"dtype=float32;shape=6", os.XATTR_CREATE)
        self.assertEqual(self.xattrs(p), {"user.ckpt.dtype": b"uint8"})


if __name__ == "__main__":
    main()

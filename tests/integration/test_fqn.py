#!/usr/bin/env python3
"""Explicit FQNs: the staging xattr user.ckpt.fqn.

    python3 tests/integration/test_fqn.py --bin build/bin/ckptfs [Class ...]

Classes:
  OneRank  one mount: a tensor split into 3 chunks on one rank (paths w.0,
           w.1, w.2, all with user.ckpt.fqn "model.w"); FQNs that are not
           path-safe ("a..b", "x/y", a part of 300 bytes, ".hidden.part",
           quotes, backslashes and control bytes); EINVAL for bad values;
           the committed tree (one file per tensor, at the origin chunk's
           path), contents bit-exact through pread, getxattr/listxattr
           user.ckpt.fqn, .metadata through sqlite3 (FQNs kept exactly),
           the .safetensors view's JSON header, a remount; commits that
           fail (overlapping chunks of one rank, two paths for one implicit
           FQN, two bytes items of one FQN on one rank).
  World2   2 rank mounts (mpirun): rank 0 holds two chunks and rank 1 one
           chunk of one FQN at different paths; a replicated bytes item at
           different paths; two FQNs at one committed path fail the commit
           on both ranks.
"""

import errno
import json
import os
import sqlite3
import struct

from ckpttest import util, world
from ckpttest.util import (CkptfsTestCase, commit, pread, read_all, status, tensor_bytes,
                           block_bytes, write_file, write_tensor)

FQN = "user.ckpt.fqn"
LONG = "m." + "p" * 300 + ".w"
WEIRD = 'q"\\\n\x01/z'


def set_fqn(path, fqn):
    os.setxattr(path, FQN, fqn if isinstance(fqn, bytes) else fqn.encode())


def metadata_rows(path, sql):
    con = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    con.text_factory = bytes
    try:
        return [tuple(r) for r in con.execute(sql)]
    finally:
        con.close()


def st_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


class OneRank(CkptfsTestCase):
    def stage(self, name):
        ck = self.ck(name)
        os.mkdir(ck)
        want = {}
        # model.w: [6, 5] float32 in three row chunks, all on this rank,
        # written last chunk first
        full = tensor_bytes("float32", [6, 5], seed=1)
        for i in (2, 0, 1):
            p = self.ck(name, f"w.{i}")
            write_tensor(p, "float32", [6, 5],
                         block_bytes(full, [6, 5], 4, [2 * i, 0], [2, 5]),
                         offsets=[2 * i, 0], sizes=[2, 5])
            set_fqn(p, "model.w")
        want["model.w"] = ("w.0", full)
        for fqn, path, shape, seed in (("a..b", "ab", [4], 2),
                                       ("x/y", "xy", [3, 2], 3),
                                       (LONG, "long/w", [2], 4),
                                       (WEIRD, "weird", [3], 5)):
            data = tensor_bytes("float32", shape, seed=seed)
            p = self.ck(name, *path.split("/"))
            write_tensor(p, "float32", shape, data)
            set_fqn(p, fqn)
            want[fqn] = (path, data)
        p = self.ck(name, "hidden")
        write_file(p, b"hidden bytes\x00\xff")
        set_fqn(p, ".hidden.part")
        want[".hidden.part"] = ("hidden", b"hidden bytes\x00\xff")
        # an item without the xattr: FQN from its path
        data = tensor_bytes("int32", [2, 2], seed=6)
        write_tensor(self.ck(name, "plain", "t"), "int32", [2, 2], data)
        want["plain.t"] = ("plain/t", data)
        return want

    def check_committed(self, name, want):
        ck = self.ck(name)
        self.assertEqual(sorted(os.listdir(ck)),
                         [".metadata", "ab", "hidden", "long", "plain", "w.0", "weird", "xy"])
        self.assertEqual(os.listdir(self.ck(name, "long")), ["w"])
        for fqn, (path, data) in want.items():
            p = self.ck(name, *path.split("/"))
            self.assertEqual(os.stat(p).st_size, len(data), fqn)
            self.assertEqual(read_all(p), data, fqn)
            for off in range(0, len(data), 7):  # across chunk boundaries
                self.assertEqual(pread(p, 13, off), data[off:off + 13], (fqn, off))
            self.assertEqual(os.getxattr(p, FQN), fqn.encode(), fqn)
            listed = os.listxattr(p)
            # listed where the path does not spell the FQN
            self.assertEqual(FQN in listed, fqn != path.replace("/", "."), (fqn, listed))
        self.assertEqual(os.getxattr(self.ck(name, "w.0"), "user.ckpt.shape"), b"6,5")
        self.assertErrno(errno.EROFS, os.setxattr, self.ck(name, "w.0"), FQN, b"z")
        # .metadata keeps every FQN exactly
        md = self.ck(name, ".metadata")
        tensors = dict(metadata_rows(md, "SELECT fqn, path FROM tensors"))
        self.assertEqual(tensors, {f.encode(): p.encode() for f, (p, _) in want.items()
                                   if f != ".hidden.part"})
        self.assertEqual(metadata_rows(md, "SELECT fqn, path FROM blobs"),
                         [(b".hidden.part", b"hidden")])
        chunks = metadata_rows(md, "SELECT offsets, rank FROM chunks WHERE fqn='model.w'"
                                   " ORDER BY offsets")
        self.assertEqual(chunks, [(b"[0,0]", 0), (b"[2,0]", 0), (b"[4,0]", 0)])
        long_row = metadata_rows(md, "SELECT count(*) FROM chunks WHERE fqn=?1"
                                 .replace("?1", "'" + LONG + "'"))
        self.assertEqual(long_row, [(1,)])
        # the .safetensors view: names escaped in its JSON header
        st = self.ck(name, ".safetensors", "model.safetensors")
        header, base = st_header(st)
        names = sorted(k for k in header if k != "__metadata__")
        self.assertEqual(names, sorted(f for f in want if f != ".hidden.part"))
        for fqn in ("model.w", WEIRD, "x/y"):
            b, e = header[fqn]["data_offsets"]
            self.assertEqual(pread(st, e - b, base + b), want[fqn][1], fqn)

    def test_fqn(self):
        self.mount("sync_files=0")
        want = self.stage("c")
        # staged: shown as set
        self.assertEqual(os.getxattr(self.ck("c", "w.1"), FQN), b"model.w")
        self.assertIn(FQN, os.listxattr(self.ck("c", "w.1")))
        self.assertEqual(os.getxattr(self.ck("c", "weird"), FQN), WEIRD.encode())
        self.assertErrno(errno.ENODATA, os.getxattr, self.ck("c", "plain", "t"), FQN)
        # bad values: EINVAL, the old value stays
        p = self.ck("c", "hidden")
        self.assertErrno(errno.EINVAL, os.setxattr, p, FQN, b"")
        self.assertErrno(errno.EINVAL, os.setxattr, p, FQN, b"a\x00b")
        self.assertErrno(errno.EINVAL, os.setxattr, p, FQN, b"x" * 4097)
        self.assertEqual(os.getxattr(p, FQN), b".hidden.part")
        set_fqn(p, b"y" * 4096)  # the longest
        self.assertEqual(os.getxattr(p, FQN), b"y" * 4096)
        set_fqn(p, ".hidden.part")
        commit(self.ck("c"))
        self.assertEqual(status(self.ck("c")).split("\n")[0], "committed")
        self.check_committed("c", want)
        # again after a remount (the metadata loader)
        self.mounts[-1].stop()
        self.mounts.clear()
        self.mount("sync_files=0")
        self.check_committed("c", want)

    def failing(self, name, *why):
        with self.assertRaises(OSError) as cm:
            commit(self.ck(name))
        self.assertEqual(cm.exception.errno, errno.EIO)
        st = status(self.ck(name))
        self.assertTrue(st.startswith("failed"), st)
        for w in why:
            self.assertIn(w, st)
        self.assertNothingPublished(name)

    def test_refused(self):
        self.mount("sync_files=0")
        # overlapping chunks of one FQN on one rank
        os.mkdir(self.ck("ov"))
        for i, off in enumerate((0, 1)):
            p = self.ck("ov", f"w{i}")
            write_tensor(p, "float32", [4], tensor_bytes("float32", [2]), offsets=[off], sizes=[2])
            set_fqn(p, "w")
        self.failing("ov", "w (w0): chunks overlap: rank 0 offsets [0] sizes [2] and rank 0 "
                           "offsets [1] sizes [2]")
        # two paths for one FQN without the xattr (unchanged rule)
        os.mkdir(self.ck("two"))
        write_tensor(self.ck("two", "a", "b"), "float32", [4], tensor_bytes("float32", [2]),
                     offsets=[0], sizes=[2])
        write_tensor(self.ck("two", "a.b"), "float32", [4], tensor_bytes("float32", [2]),
                     offsets=[2], sizes=[2])
        self.failing("two", "a.b: two paths for one FQN: a.b (rank 0) and a/b (rank 0)")
        # the xattr on only one of them: still two paths
        set_fqn(self.ck("two", "a.b"), "a.b")
        self.failing("two", "two paths for one FQN")
        # on both: several chunks of one FQN, committed at the origin's path
        set_fqn(self.ck("two", "a", "b"), "a.b")
        commit(self.ck("two"))
        self.assertEqual(sorted(os.listdir(self.ck("two"))), [".metadata", "a"])
        self.assertEqual(read_all(self.ck("two", "a", "b")), tensor_bytes("float32", [2]) * 2)
        # two bytes items of one FQN on one rank
        os.mkdir(self.ck("bytes"))
        for n in ("p", "q"):
            write_file(self.ck("bytes", n), b"same")
            set_fqn(self.ck("bytes", n), "cfg")
        self.failing("bytes", "cfg: rank 0 holds two bytes items for one FQN: p and q")
        # the same chunk twice on one rank
        os.mkdir(self.ck("dup"))
        for n in ("p", "q"):
            write_tensor(self.ck("dup", n), "int8", [3], b"abc")
            set_fqn(self.ck("dup", n), "t")
        self.failing("dup", "t (p): rank 0 holds chunk offsets [0] sizes [3] twice: p and q")


class World2(CkptfsTestCase):
    N = 2

    def setUp(self):
        super().setUp()
        self.world = self.start_world(self.N, "commit_timeout=120,sync_files=0")

    def ck(self, r, *parts):
        return os.path.join(self.world.mnt(r), *parts)

    def test_chunks_on_two_ranks(self):
        shape = [6, 3]
        full = tensor_bytes("float64", shape, seed=9)
        layout = {0: [("s/a", 0), ("s/c", 4)], 1: [("t", 2)]}
        for r in range(self.N):
            os.mkdir(self.ck(r, "w"))
            for path, row in layout[r]:
                p = self.ck(r, "w", *path.split("/"))
                write_tensor(p, "float64", shape, block_bytes(full, shape, 8, [row, 0], [2, 3]),
                             offsets=[row, 0], sizes=[2, 3])
                set_fqn(p, "shared.w")
            p = self.ck(r, "w", f"cfg{r}")
            write_file(p, b"config")
            set_fqn(p, "cfg")
        res = world.commit_all(self.world, "w")
        self.assertTrue(all(e is None for e, _ in res.values()), res)
        for r in range(self.N):
            ck = self.ck(r, "w")
            self.assertEqual(sorted(os.listdir(ck)), [".metadata", "cfg0", "s"])
            self.assertEqual(os.listdir(os.path.join(ck, "s")), ["a"])
            p = os.path.join(ck, "s", "a")
            self.assertEqual(read_all(p), full)
            self.assertEqual(pread(p, 50, 40), full[40:90])
            self.assertEqual(os.getxattr(p, FQN), b"shared.w")
            self.assertEqual(read_all(os.path.join(ck, "cfg0")), b"config")
            self.assertEqual(os.getxattr(os.path.join(ck, "cfg0"), FQN), b"cfg")
            rows = metadata_rows(os.path.join(ck, ".metadata"),
                                 "SELECT offsets, rank FROM chunks ORDER BY offsets")
            self.assertEqual(rows, [(b"[0,0]", 0), (b"[2,0]", 1), (b"[4,0]", 0)])
            self.assertEqual(metadata_rows(os.path.join(ck, ".metadata"),
                                           "SELECT fqn, path FROM blobs"), [(b"cfg", b"cfg0")])

        # two FQNs at one committed path: refused on both ranks
        for r in range(self.N):
            os.mkdir(self.ck(r, "clash"))
            write_file(self.ck(r, "clash", "x"), b"r%d" % r)
            set_fqn(self.ck(r, "clash", "x"), f"f{r}")
        res = world.commit_all(self.world, "clash")
        for r in range(self.N):
            e, _ = res[r]
            self.assertIsInstance(e, OSError, res)
            self.assertEqual(e.errno, errno.EIO)
            st = status(self.ck(r, "clash"))
            self.assertIn("x: two FQNs at one committed path: f0 and f1", st)


if __name__ == "__main__":
    util.main()

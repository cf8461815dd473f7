#!/usr/bin/env python3
"""Block files of a committed checkpoint: a lookup of DIR/.N[a0:b0,...]
gives a read-only file whose content is that block of tensor N in row-major
order (docs/committed.md, "Block files").

    python3 tests/integration/test_blocks.py --bin build/bin/ckptfs [Class ...]

Classes:
  World2  a world of 2 rank mounts (mpirun) commits a 2-D row-sharded, a
          2-D column-sharded, a 3-D, a 1-D, a large 2-D (reads of several
          requests) and a 0-d tensor, each (but the 0-d) in 2 chunks; then,
          with -o verify=1: many blocks (column halves, interior blocks,
          blocks across chunk borders, empty and whole blocks, fewer slices
          than dimensions, open bounds, random ones) each read with one
          pread and compared bit-exactly with the slice computed here in
          pure Python; partial reads at random offsets; threads reading
          blocks at once; stat sizes and modes, xattrs (dtype, the block's
          shape), readdir (never listed), EROFS for every change, ENOENT
          for bad names (and on a staged checkpoint); a forgotten block node
          is freed (a new inode after the kernel drops its caches, and 3000
          distinct names looked up and forgotten); a damaged chunk gives EIO
          for the blocks that read it and only for those.
"""

import errno
import itertools
import math
import os
import random
import shutil
import stat
import subprocess
import sys
import threading
import time

from ckpttest import util, world
from ckpttest.util import CkptfsTestCase, wait_log


def strides(shape):
    return [math.prod(shape[i + 1:]) for i in range(len(shape))]


def box_bytes(data, shape, isz, lo, sizes):
    """Bytes of box [lo, lo+sizes) of a row-major tensor, row by row."""
    if any(s == 0 for s in sizes):
        return b""
    st = strides(shape)
    row = sizes[-1] * isz
    out = bytearray()
    for idx in itertools.product(*[range(o, o + s) for o, s in zip(lo[:-1], sizes[:-1])]):
        base = (sum(i * s for i, s in zip(idx, st[:-1])) + lo[-1]) * isz
        out += data[base:base + row]
    return bytes(out)


class T:
    def __init__(self, path, dtype, shape, chunks, seed):
        self.path, self.dtype, self.shape, self.chunks = path, dtype, shape, chunks
        self.isz = world.itemsize(dtype)
        self.data = world.tensor_bytes(dtype, shape, seed)

    def write(self, ckdir, rank):
        if rank not in self.chunks:
            return
        p = os.path.join(ckdir, self.path)
        c = self.chunks[rank]
        if c is None:
            world.write_file(p, self.data)
            world.set_xattrs(p, self.dtype, self.shape or b"")
        else:
            world.write_file(p, box_bytes(self.data, self.shape, self.isz, *c))
            world.set_xattrs(p, self.dtype, self.shape, c[0], c[1])


def block_name(path, slices):
    d, n = os.path.split(path)
    return os.path.join(d, f".{n}[{slices}]")


def resolve(shape, slices):
    """(lo, sizes) of a slice text, as Python would."""
    parts = slices.split(",")
    lo, sizes = [], []
    for j, dim in enumerate(shape):
        if j < len(parts):
            a, b = parts[j].split(":")
            a = int(a) if a else 0
            b = int(b) if b else dim
        else:
            a, b = 0, dim
        lo.append(a)
        sizes.append(b - a)
    return lo, sizes


def one_pread(path, n):
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)


class World2(CkptfsTestCase):
    N = 2

    def setUp(self):
        super().setUp()
        self.world = self.start_world(self.N, "commit_timeout=120,verify=1")

    def assertErrno(self, err, fn, *args):
        with self.assertRaises(OSError, msg=f"{fn.__name__}{args!r}") as cm:
            fn(*args)
        self.assertEqual(cm.exception.errno, err,
                         f"{fn.__name__}{args!r}: {cm.exception!r}, expected "
                         f"{errno.errorcode[err]}")

    def check_block(self, ck, t, slices):
        lo, sizes = resolve(t.shape, slices)
        want = box_bytes(t.data, t.shape, t.isz, lo, sizes)
        p = block_name(os.path.join(ck, t.path), slices)
        st = os.stat(p)
        self.assertTrue(stat.S_ISREG(st.st_mode), p)
        self.assertEqual(st.st_mode & 0o222, 0, p)
        self.assertEqual(st.st_size, len(want), p)
        got = one_pread(p, len(want) + 100)
        self.assertEqual(len(got), len(want), p)
        self.assertTrue(got == want, f"{p}: content differs")
        self.assertEqual(os.getxattr(p, "user.ckpt.dtype").decode(), t.dtype)
        self.assertEqual(os.getxattr(p, "user.ckpt.shape").decode(),
                         ",".join(str(s) for s in sizes))
        return p, want

    def test_blocks(self):
        rng = random.Random(7)
        items = [
            T("m/rows", "float32", [64, 48],
              {0: ([0, 0], [40, 48]), 1: ([40, 0], [24, 48])}, 1),
            T("m/cols", "int16", [30, 20],
              {0: ([0, 0], [30, 7]), 1: ([0, 7], [30, 13])}, 2),
            T("m/cube", "int64", [6, 10, 5],
              {0: ([0, 0, 0], [6, 4, 5]), 1: ([0, 4, 0], [6, 6, 5])}, 3),
            T("vec", "float64", [1000], {0: ([0], [333]), 1: ([333], [667])}, 4),
            T("big/w", "float32", [1024, 512],
              {0: ([0, 0], [600, 512]), 1: ([600, 0], [424, 512])}, 5),
            T("s", "complex64", [], {1: None}, 6),
            # damaged below, never read before (verify checks a chunk once)
            T("m/dmg", "float32", [20, 8], {0: ([0, 0], [12, 8]), 1: ([12, 0], [8, 8])}, 7),
        ]
        world.stage(self.world, "w", items)
        res = world.commit_all(self.world, "w")
        self.assertTrue(all(e is None for e, _ in res.values()), res)
        ck = os.path.join(self.world.mnt(0), "w")
        rows, cols, cube, vec, big, scalar, dmg = items

        named = {
            rows: [":,24:", ":,:24", "10:50", "38:42,5:9", "39:41", ":", "0:64,0:48",
                   "7:7", "64:", "3:3,1:5", "40:40,:", ":,47:", "0:1,0:1", "63:64,47:48",
                   "35:", "1:63,1:47"],
            cols: [":,10:", ":,:10", "5:6,6:8", "0:30,7:7", ":,6:14", "29:,19:", "12:18"],
            cube: ["1:5,2:7,1:4", ":,3:5", ":,:,2:3", "2:3", "0:6,4:4", ":,3:4,4:5",
                   "5:6,9:10,4:5", "::"[:1]],
            vec: ["100:900", "332:334", "333:", ":333", "0:0", "1000:", ":", "999:"],
            big: [":,256:", ":,:256", "300:700,100:400", "599:601", "0:1024,511:512",
                  ":"],
        }
        for t, names in named.items():
            for sl in names:
                with self.subTest(t=t.path, sl=sl):
                    self.check_block(ck, t, sl)
        # Random blocks, with and without bounds left out.
        for t in (rows, cols, cube, vec):
            for _ in range(40):
                parts = []
                for dim in t.shape[:rng.randint(1, len(t.shape))]:
                    a = rng.randint(0, dim)
                    b = rng.randint(a, dim)
                    parts.append(f"{'' if a == 0 and rng.random() < 0.3 else a}:"
                                 f"{'' if b == dim and rng.random() < 0.3 else b}")
                sl = ",".join(parts)
                with self.subTest(t=t.path, sl=sl):
                    self.check_block(ck, t, sl)
        # Partial reads at random offsets of a gathered block.
        p, want = self.check_block(ck, big, "100:900,128:400")
        fd = os.open(p, os.O_RDONLY)
        try:
            for _ in range(60):
                off = rng.randint(0, len(want))
                n = rng.randint(0, 3 << 20)
                self.assertTrue(os.pread(fd, n, off) == want[off:off + n], (off, n))
        finally:
            os.close(fd)
        # The other rank's mount serves them too.
        self.check_block(os.path.join(self.world.mnt(1), "w"), big, ":,256:")

        # Threads reading blocks at once.
        errors = []

        def reader(seed):
            r = random.Random(seed)
            try:
                for _ in range(20):
                    a = r.randint(0, 1024)
                    b = r.randint(a, 1024)
                    c = r.randint(0, 512)
                    sl = f"{a}:{b},{c}:"
                    lo, sizes = resolve(big.shape, sl)
                    want = box_bytes(big.data, big.shape, big.isz, lo, sizes)
                    got = one_pread(block_name(os.path.join(ck, big.path), sl), len(want) + 1)
                    if got != want:
                        errors.append(sl)
            except OSError as e:
                errors.append(repr(e))

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        self.assertEqual(errors, [])

        # Never listed; xattrs listed as the tensor's.
        for d in (ck, os.path.join(ck, "m"), os.path.join(ck, "big")):
            self.assertFalse([n for n in os.listdir(d) if n.startswith(".") and n != ".metadata"],
                             d)
        self.assertEqual(sorted(os.listdir(os.path.join(ck, "m"))), ["cols", "cube", "dmg", "rows"])
        bp = block_name(os.path.join(ck, "m/rows"), "1:2")
        self.assertEqual(set(os.listxattr(bp)), {"user.ckpt.dtype", "user.ckpt.shape"})
        self.assertErrno(errno.ENODATA, os.getxattr, bp, "user.ckpt.offsets")

        # Read-only like every committed file.
        self.assertErrno(errno.EROFS, os.open, bp, os.O_WRONLY)
        self.assertErrno(errno.EROFS, os.open, bp, os.O_RDWR)
        self.assertErrno(errno.EROFS, os.truncate, bp, 0)
        self.assertErrno(errno.EROFS, os.setxattr, bp, "user.ckpt.dtype", b"int8")
        self.assertErrno(errno.EROFS, os.removexattr, bp, "user.ckpt.dtype")
        self.assertErrno(errno.EROFS, os.unlink, bp)
        self.assertErrno(errno.EROFS, os.rename, bp, bp + "x")
        self.assertErrno(errno.EROFS, os.chmod, bp, 0o644)
        self.assertTrue(os.path.exists(os.path.join(self.backing, "w", ".metadata")))

        # Bad names: ENOENT.
        bad = [".rows[1]", ".rows[0:65]", ".rows[5:4]", ".rows[0:1,0:1,0:1]", ".rows[]",
               ".rows[0:1,]", ".rows[ 0:1]", ".rows[-1:2]", ".rows[0:1:1]", ".rows[0:1",
               ".rows0:1]", "rows[0:1]", ".nope[0:1]", ".rows[a:b]", ".rows[:,49:]",
               ".rows[:,:49]", ".cube[0:1]x"]
        for name in bad:
            self.assertErrno(errno.ENOENT, os.stat, os.path.join(ck, "m", name))
        self.assertErrno(errno.ENOENT, os.stat, os.path.join(ck, ".m[0:1]"))  # a directory
        self.assertErrno(errno.ENOENT, os.stat, os.path.join(ck, ".s[:]"))  # 0-d
        self.assertErrno(errno.ENOENT, os.stat, os.path.join(ck, ".s[]"))
        self.assertErrno(errno.ENOTDIR, os.stat, os.path.join(ck, "m", ".rows[:]", "x"))
        self.assertErrno(errno.ENOENT, os.stat, os.path.join(ck, ".npy", ".vec[0:1]"))
        # The 0-d tensor itself still reads.
        self.assertEqual(world.read_all(os.path.join(ck, "s")), scalar.data)

        # Staged checkpoints have no block files.
        st = os.path.join(self.world.mnt(0), "staged")
        os.mkdir(st)
        world.write_file(os.path.join(st, "x"), bytes(16))
        world.set_xattrs(os.path.join(st, "x"), "float32", [4])
        self.assertErrno(errno.ENOENT, os.stat, os.path.join(st, ".x[0:2]"))
        self.assertErrno(errno.EPERM, os.open, os.path.join(st, ".x[0:2]"),
                         os.O_WRONLY | os.O_CREAT, 0o644)
        shutil.rmtree(st)

        # Forgotten block nodes are freed: after the kernel drops its
        # dentries and inodes, the same name is a new node.
        can_drop = os.access("/proc/sys/vm/drop_caches", os.W_OK)
        p = block_name(os.path.join(ck, "vec"), "5:10")
        ino = os.stat(p).st_ino
        self.assertEqual(os.stat(p).st_ino, ino)  # the same node while known
        for i in range(3000):  # many distinct names, each looked up once
            os.stat(block_name(os.path.join(ck, "vec"), f"{i % 500}:{500 + i // 500}"))
        if can_drop:
            # a dentry looked up lately survives one pass of the kernel's
            # shrinker (its referenced bit): a few passes, as under load
            # (not looked up in between: a lookup would mark it again)
            # The kernel's FORGET needs no reply: a lookup may reach the
            # daemon before it (another thread, a slow build), find the
            # node still known and take it again; then drop once more.
            subprocess.run(["sync"], check=False)
            deadline = time.monotonic() + 20
            while True:
                for _ in range(3):
                    with open("/proc/sys/vm/drop_caches", "w") as f:
                        f.write("2\n")
                time.sleep(0.1)
                if os.stat(p).st_ino != ino:
                    break
                self.assertLess(time.monotonic(), deadline,
                                "the block node outlived the kernel's forget")
            self.check_block(ck, vec, "5:10")
        else:
            print("\n(no /proc/sys/vm/drop_caches: forget not exercised)", file=sys.stderr)

        # A damaged chunk: EIO for the blocks that read it, only those.
        db = os.path.join(self.backing, "w", ".metadata")
        (f, off, ln), = world.query(
            db, "SELECT file, file_offset, length FROM chunks WHERE fqn=? AND offsets=?",
            ("m.dmg", "[12,0]"))
        path = os.path.join(self.backing, "w", f)
        with open(path, "r+b") as fh:
            fh.seek(off + ln // 2)
            b = fh.read(1)
            fh.seek(off + ln // 2)
            fh.write(bytes([b[0] ^ 0xFF]))
        for sl in (":,4:", "11:13", "14:16,3:5", ":"):
            self.assertErrno(errno.EIO, one_pread,
                             block_name(os.path.join(ck, "m/dmg"), sl), 1 << 20)
        for sl in ("0:12", ":12,4:", "1:11,1:7"):
            self.check_block(ck, dmg, sl)
        self.assertErrno(errno.EIO, one_pread, os.path.join(ck, "m/dmg"), 1 << 20)
        self.assertIn("m.dmg", wait_log(self.world.log, "m.dmg"))

    def test_damage_in_an_interleaved_chunk(self):
        """Column chunks interleave in the file's byte order: a block all in
        the good chunk reads, though its byte range spans the damaged
        one's extent (verify checks only chunks that hold its bytes)."""
        import struct
        vals = list(range(16))  # 4 x 4 float32, row-major
        for r in range(self.N):
            os.mkdir(os.path.join(self.world.mnt(r), "cols"))
        ck0 = os.path.join(self.world.mnt(0), "cols")
        for k, c0 in enumerate((0, 2)):
            p = os.path.join(ck0, f"c.{k}")
            data = b"".join(struct.pack("<f", vals[i * 4 + j])
                            for i in range(4) for j in (c0, c0 + 1))
            with open(p, "wb") as f:
                f.write(data)
            world.set_xattrs(p, "float32", (4, 4), (0, c0), (4, 2))
            os.setxattr(p, "user.ckpt.fqn", b"c")
        res = world.commit_all(self.world, "cols")
        self.assertTrue(all(e is None for e, _ in res.values()), res)
        db = os.path.join(self.backing, "cols", ".metadata")
        (f, off, ln), = world.query(
            db, "SELECT file, file_offset, length FROM chunks WHERE fqn='c' AND offsets='[0,2]'")
        with open(os.path.join(self.backing, "cols", f), "r+b") as fh:
            fh.seek(off)
            b = fh.read(1)
            fh.seek(off)
            fh.write(bytes([b[0] ^ 0xFF]))
        ck = os.path.join(self.world.mnt(1), "cols")
        want = b"".join(struct.pack("<f", vals[4 + j]) for j in (0, 1))
        self.assertEqual(one_pread(block_name(os.path.join(ck, "c.0"), "1:2,0:2"), 64), want)
        self.assertEqual(one_pread(block_name(os.path.join(ck, "c.0"), "0:4,0:2"), 64),
                         b"".join(struct.pack("<f", vals[i * 4 + j])
                                  for i in range(4) for j in (0, 1)))
        self.assertErrno(errno.EIO, one_pread,
                         block_name(os.path.join(ck, "c.0"), "1:2,2:4"), 64)
        # the tensor file: a row segment inside the good chunk reads too
        fd = os.open(os.path.join(ck, "c.0"), os.O_RDONLY)
        try:
            self.assertEqual(os.pread(fd, 8, 16), want)
        finally:
            os.close(fd)


if __name__ == "__main__":
    util.main()

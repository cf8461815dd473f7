#!/usr/bin/env python3
"""Integrity of committed checkpoints: verify (on by default) fails reads of a chunk
whose XXH3-64 does not match with EIO (and only those), and the offline
checker ckptfs-fsck finds flipped bits, truncated and missing data files and
a damaged .metadata, naming the FQN, rank and file, with exit status 1;
intact checkpoints give 0, usage errors 2."""

import errno
import os
import sqlite3
import subprocess

from ckpttest import util
from ckpttest.util import CkptfsTestCase, commit, main, read_all, state, write_file, write_tensor

MiB = 1 << 20


def fsck(*args):
    exe = os.path.join(os.path.dirname(util.BIN), "ckptfs-fsck")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def stored(backing, name, fqn):
    """(file, file_offset, length) of the first chunk or blob of fqn."""
    db = sqlite3.connect(f"file:{os.path.join(backing, name, '.metadata')}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT file, file_offset, length FROM chunks WHERE fqn = ? "
                         "UNION ALL SELECT file, file_offset, length FROM blobs WHERE fqn = ?",
                         (fqn, fqn)).fetchone()
    finally:
        db.close()
    return row


def flip(path, offset, bit=0x04):
    fd = os.open(path, os.O_RDWR)
    try:
        b = bytearray(os.pread(fd, 1, offset))
        b[0] ^= bit
        os.pwrite(fd, bytes(b), offset)
    finally:
        os.close(fd)


class Integrity(CkptfsTestCase):
    def save(self, name):
        os.mkdir(self.ck(name))
        self.w = write_tensor(self.ck(name, "model", "w"), "float32", [768, 1024],
                              os.urandom(3 * MiB))
        self.b = write_tensor(self.ck(name, "model", "b"), "int64", [1000],
                              os.urandom(8000))
        self.cfg = os.urandom(5000)
        write_file(self.ck(name, "config"), self.cfg)
        commit(self.ck(name))
        self.assertEqual(state(self.ck(name)), "committed")

    def data_file(self, name, fqn):
        f, off, ln = stored(self.backing, name, fqn)
        return self.bk(name, f), off, ln

    def test_verify_fails_only_the_damaged_chunk(self):
        self.mount("verify=1")
        self.save("v")
        path, off, ln = self.data_file("v", "model.w")
        flip(path, off + ln // 2)
        with open(self.ck("v", "model", "w"), "rb") as f:
            self.assertErrno(errno.EIO, f.read)
            self.assertErrno(errno.EIO, os.pread, f.fileno(), 10, 0)  # known bad
        # the others still read, bit-exact
        self.assertEqual(read_all(self.ck("v", "model", "b")), self.b)
        self.assertEqual(read_all(self.ck("v", "config")), self.cfg)
        self.assertIn("model.w", self.daemon_log())
        # a damaged blob too
        path, off, ln = self.data_file("v", "config")
        flip(path, off)
        self.mounts[-1].stop()
        self.mount("verify=1")
        self.assertErrno(errno.EIO, read_all, self.ck("v", "config"))
        self.assertEqual(read_all(self.ck("v", "model", "b")), self.b)

    def test_without_verify_the_bytes_are_served(self):
        self.mount("verify=0")
        self.save("n")
        path, off, ln = self.data_file("n", "model.b")
        flip(path, off + 3, 0x80)
        got = read_all(self.ck("n", "model", "b"))
        self.assertEqual(len(got), len(self.b))
        self.assertNotEqual(got, self.b)

    def test_fsck_intact(self):
        self.mount()
        self.save("a")
        self.save("b")
        os.mkdir(self.ck("staged-only"))
        write_file(self.ck("staged-only", "x"), b"x")
        r = fsck(self.backing)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("a: ok: 2 tensors in 2 chunks, 1 blobs", r.stdout)
        self.assertIn("b: ok:", r.stdout)
        r = fsck(self.backing, "b")
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertNotIn("a: ok", r.stdout)

    def test_fsck_finds_each_kind_of_damage(self):
        self.mount()
        for n in ("flip", "trunc", "gone", "meta", "fine"):
            self.save(n)
        self.mounts[-1].stop()
        path, off, ln = self.data_file("flip", "model.w")
        flip(path, off + ln - 1)
        path, off, ln = self.data_file("trunc", "model.b")
        os.truncate(path, off + ln - 1)
        path, _, _ = self.data_file("gone", "config")
        os.unlink(path)
        with open(self.bk("meta", ".metadata"), "r+b") as f:
            f.seek(4096 + 8)   # page 2: a table's b-tree page, past its header
            f.write(b"\xff" * 600)
        r = fsck(self.backing)
        out = r.stdout
        self.assertEqual(r.returncode, 1, out + r.stderr)
        self.assertRegex(out, r"flip: tensor model\.w chunk \[0,0\], rank 0: __0_\d+\.distcp "
                              r"at \d+: checksum mismatch")
        self.assertRegex(out, r"trunc: tensor model\.b chunk \[0\], rank 0: __0_\d+\.distcp: "
                              r"truncated")
        self.assertRegex(out, r"gone: blob config, rank 0: __0_\d+\.distcp: No such file")
        self.assertRegex(out, r"meta: \.metadata is damaged: ")
        self.assertIn("fine: ok:", out)
        for n in ("flip", "trunc", "gone", "meta"):
            self.assertIn(f"{n}: DAMAGED" if n != "meta" else "meta: .metadata", out)
        # one name at a time: the status says which are intact
        self.assertEqual(fsck(self.backing, "fine").returncode, 0)
        self.assertEqual(fsck(self.backing, "flip").returncode, 1)

    def test_fsck_usage(self):
        self.assertEqual(fsck().returncode, 2)
        r = fsck(os.path.join(self.dir, "no-such-dir"))
        self.assertEqual(r.returncode, 2)
        self.assertIn("cannot open BACKING_DIR", r.stderr)
        os.makedirs(self.backing, exist_ok=True)
        r = fsck(self.backing, "missing", "../etc")
        self.assertEqual(r.returncode, 1)
        self.assertIn("missing: no such checkpoint", r.stdout)
        self.assertIn("../etc: not a checkpoint name", r.stdout)
        r = fsck("--help")
        self.assertEqual(r.returncode, 0)
        self.assertIn("usage: ckptfs-fsck", r.stdout)


if __name__ == "__main__":
    main()

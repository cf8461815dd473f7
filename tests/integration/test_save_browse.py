#!/usr/bin/env python3
"""Save, browse and reload one rank's checkpoint: staged view, committed
reads (whole and pread ranges), xattrs, EROFS, the .metadata database
(sqlite3 module and CLI), and a fresh mount after unmount."""

import errno
import json
import os
import shutil
import sqlite3
import subprocess

from ckpttest.util import (CkptfsTestCase, commit, main, pread, read_all, state, status,
                           tensor_bytes, write_file, write_tensor)

# (path, dtype, shape): nested directories, several dtypes.
TENSORS = [
    ("model/layer0/weight", "float32", [6, 10]),
    ("model/layer0/bias", "bfloat16", [10]),
    ("model/layer1/attn/q", "float16", [3, 5, 7]),
    ("model/embed", "int64", [9, 4]),
    ("model/mask", "bool", [17]),
    ("model/rot", "complex64", [4, 3]),
    ("model/tiny", "int8", [1]),
    ("stats/hist", "float64", [33]),
]
BLOBS = [
    ("optim/config.json", b'{"lr": 0.001, "betas": [0.9, 0.999]}\n'),
    ("rng/state.bin", bytes(range(256)) * 3 + b"\0\0\0binary\0tail"),
    ("empty.bin", b""),
]


def stage_all(t, name):
    """Stage TENSORS and BLOBS in NAME; return {path: bytes}."""
    os.mkdir(t.ck(name))
    want = {}
    for i, (path, dtype, shape) in enumerate(TENSORS):
        want[path] = write_tensor(t.ck(name, path), dtype, shape,
                                  tensor_bytes(dtype, shape, seed=i),
                                  xattrs_first=(i % 2 == 1))
    for path, data in BLOBS:
        write_file(t.ck(name, path), data)
        want[path] = data
    return want


class SaveBrowseReload(CkptfsTestCase):
    def check_committed(self, name, want, mnt=None):
        for path, dtype, shape in TENSORS:
            p = self.ck(name, path, mnt=mnt)
            self.assertEqual(read_all(p), want[path], path)
            self.assertEqual(os.stat(p).st_size, len(want[path]), path)
            self.assertEqual(os.getxattr(p, "user.ckpt.dtype"), dtype.encode(), path)
            self.assertEqual(os.getxattr(p, "user.ckpt.shape"),
                             ",".join(map(str, shape)).encode(), path)
            self.assertEqual(sorted(os.listxattr(p)), ["user.ckpt.dtype", "user.ckpt.shape"])
        for path, data in BLOBS:
            p = self.ck(name, path, mnt=mnt)
            self.assertEqual(read_all(p), data, path)
            self.assertEqual(os.stat(p).st_size, len(data), path)
            self.assertEqual(os.listxattr(p), [], path)
        self.assertEqual(sorted(os.listdir(self.ck(name, mnt=mnt))),
                         [".metadata", "empty.bin", "model", "optim", "rng", "stats"])
        self.assertEqual(sorted(os.listdir(self.ck(name, "model", mnt=mnt))),
                         ["embed", "layer0", "layer1", "mask", "rot", "tiny"])
        self.assertEqual(sorted(os.listdir(self.ck(name, "model/layer1/attn", mnt=mnt))), ["q"])
        self.assertTrue(os.path.isdir(self.ck(name, "model/layer1", mnt=mnt)))

    def test_save_browse_reload(self):
        self.mount()
        want = stage_all(self, "step-1")
        self.assertEqual(state(self.ck("step-1")), "staging")
        # the staged view, before commit: ls, stat, cat, getfattr
        for path, dtype, shape in TENSORS:
            p = self.ck("step-1", path)
            self.assertEqual(read_all(p), want[path], path)
            self.assertEqual(os.stat(p).st_size, len(want[path]))
            self.assertEqual(os.getxattr(p, "user.ckpt.dtype"), dtype.encode())
            self.assertEqual(os.getxattr(p, "user.ckpt.shape"), ",".join(map(str, shape)).encode())
        for path, data in BLOBS:
            self.assertEqual(read_all(self.ck("step-1", path)), data)
        listing = sorted(os.listdir(self.ck("step-1")))
        self.assertEqual(listing, ["empty.bin", "model", "optim", "rng", "stats"])
        self.assertNotIn(".commit", listing)
        self.assertNotIn(".status", listing)
        self.assertFalse(os.path.exists(self.bk("step-1")))  # nothing stored yet
        self.assertFalse(os.path.exists(self.ck("step-1", ".metadata")))
        self.assertGreater(os.statvfs(self.mnt).f_bsize, 0)

        commit(self.ck("step-1"))
        self.assertEqual(state(self.ck("step-1")), "committed")
        self.assertTrue(os.path.exists(self.bk("step-1", ".metadata")))
        self.assertTrue(os.path.exists(self.bk("step-1", "__0_0.distcp")))
        self.check_committed("step-1", want)

        # unmount, mount again: the same view
        m = self.mounts[0]
        self.assertEqual(m.stop(), 0, self.daemon_log())
        self.assertFalse(m.mounted())
        self.mount()
        self.assertEqual(os.listdir(self.mnt), ["step-1"])
        self.assertEqual(state(self.ck("step-1")), "committed")
        self.check_committed("step-1", want)

    def test_pread_ranges(self):
        self.mount()
        os.mkdir(self.ck("r"))
        shape = [37, 29]  # odd sizes: unaligned rows
        data = write_tensor(self.ck("r", "w"), "float32", shape, tensor_bytes("float32", shape))
        big = os.urandom(3 << 20) + b"end"  # > several FUSE requests
        write_tensor(self.ck("r", "big"), "uint8", [len(big)], big)
        blob = os.urandom(100003)
        write_file(self.ck("r", "blob"), blob)
        commit(self.ck("r"))
        ranges = [(0, 1), (1, 3), (3, 4), (115, 1000), (4 * 29 - 1, 2), (len(data) - 1, 1),
                  (len(data) - 7, 100), (len(data), 10), (len(data) + 100, 5), (0, len(data)),
                  (513, 4096)]
        for off, n in ranges:
            self.assertEqual(pread(self.ck("r", "w"), n, off), data[off:off + n], (off, n))
        for off, n in [(0, 1 << 20), ((1 << 20) - 3, 7), (12345, (2 << 20) + 17),
                       (len(big) - 5, 100), (len(big) // 2, 1)]:
            self.assertEqual(pread(self.ck("r", "big"), n, off), big[off:off + n], (off, n))
        for off, n in [(0, 10), (99999, 10), (4095, 4097), (50000, 50003)]:
            self.assertEqual(pread(self.ck("r", "blob"), n, off), blob[off:off + n], (off, n))
        # one fd, many preads in random order
        fd = os.open(self.ck("r", "w"), os.O_RDONLY)
        try:
            for off in [3000, 7, 0, 4000, 1, 2222]:
                self.assertEqual(os.pread(fd, 33, off), data[off:off + 33])
        finally:
            os.close(fd)

    def test_dtype_aliases_canonical(self):
        self.mount()
        os.mkdir(self.ck("a"))
        cases = [("torch.float32", "float32"), ("<f4", "float32"), ("BF16", "bfloat16"),
                 ("F16", "float16"), ("int64", "int64"), ("torch.bool", "bool"),
                 ("complex64", "complex64")]
        for i, (alias, canon) in enumerate(cases):
            write_tensor(self.ck("a", f"t{i}"), alias, [2], tensor_bytes(canon, [2]))
            # staged: the value as set
            self.assertEqual(os.getxattr(self.ck("a", f"t{i}"), "user.ckpt.dtype"), alias.encode())
        commit(self.ck("a"))
        for i, (alias, canon) in enumerate(cases):
            p = self.ck("a", f"t{i}")
            self.assertEqual(os.getxattr(p, "user.ckpt.dtype"), canon.encode(), alias)
            self.assertEqual(read_all(p), tensor_bytes(canon, [2]))

    def test_shape_bracket_form_reads_back_comma(self):
        self.mount()
        os.mkdir(self.ck("s"))
        p = self.ck("s", "w")
        write_file(p, tensor_bytes("int16", [2, 3, 4]))
        os.setxattr(p, "user.ckpt.dtype", b"int16")
        os.setxattr(p, "user.ckpt.shape", b"[2, 3, 4]")
        self.assertEqual(os.getxattr(p, "user.ckpt.shape"), b"[2, 3, 4]")
        commit(self.ck("s"))
        self.assertEqual(os.getxattr(p, "user.ckpt.shape"), b"2,3,4")
        self.assertEqual(os.stat(p).st_size, 2 * 3 * 4 * 2)

    def test_committed_is_read_only(self):
        self.mount()
        os.mkdir(self.ck("ro"))
        write_tensor(self.ck("ro", "d/w"), "float32", [4], tensor_bytes("float32", [4]))
        write_file(self.ck("ro", "blob"), b"abc")
        commit(self.ck("ro"))
        w, blob = self.ck("ro", "d/w"), self.ck("ro", "blob")
        self.assertErrno(errno.EROFS, os.open, w, os.O_WRONLY)
        self.assertErrno(errno.EROFS, os.open, w, os.O_RDWR)
        self.assertErrno(errno.EROFS, os.open, blob, os.O_WRONLY | os.O_TRUNC)
        self.assertErrno(errno.EROFS, os.open, self.ck("ro", "new"), os.O_WRONLY | os.O_CREAT, 0o644)
        self.assertErrno(errno.EROFS, os.open, self.ck("ro", "d/new"), os.O_WRONLY | os.O_CREAT, 0o644)
        self.assertErrno(errno.EROFS, os.mkdir, self.ck("ro", "nd"))
        self.assertErrno(errno.EROFS, os.mkdir, self.ck("ro", "d/nd"))
        self.assertErrno(errno.EROFS, os.setxattr, w, "user.ckpt.dtype", b"float64")
        self.assertErrno(errno.EROFS, os.setxattr, blob, "user.ckpt.dtype", b"float64")
        self.assertErrno(errno.EROFS, os.removexattr, w, "user.ckpt.dtype")
        self.assertErrno(errno.EROFS, os.truncate, w, 0)
        self.assertErrno(errno.EROFS, os.truncate, blob, 100)
        self.assertErrno(errno.EROFS, os.rename, w, self.ck("ro", "d/w2"))
        self.assertErrno(errno.EROFS, os.open, self.ck("ro", ".metadata"), os.O_WRONLY)
        # a second commit of a committed checkpoint
        self.assertErrno(errno.EROFS, commit, self.ck("ro"))
        # nothing changed
        self.assertEqual(read_all(w), tensor_bytes("float32", [4]))
        self.assertEqual(read_all(blob), b"abc")
        self.assertEqual(os.getxattr(w, "user.ckpt.dtype"), b"float32")
        self.assertEqual(state(self.ck("ro")), "committed")

    def test_metadata_sqlite(self):
        self.mount()
        want = stage_all(self, "db")
        commit(self.ck("db"))
        md = self.ck("db", ".metadata")
        self.assertIn(".metadata", os.listdir(self.ck("db")))
        self.assertEqual(os.stat(md).st_size, os.stat(self.bk("db", ".metadata")).st_size)
        self.assertEqual(read_all(md), read_all(self.bk("db", ".metadata")))
        con = sqlite3.connect(f"file:{md}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
            self.assertTrue({"checkpoint", "tensors", "chunks", "blobs"} <= tables, tables)
            kv = dict(con.execute("select key, value from checkpoint"))
            for k in ("format_version", "name", "save_id", "world_size", "created_at"):
                self.assertIn(k, kv)
            self.assertEqual(str(kv["world_size"]), "1")
            self.assertEqual(kv["name"], "db")
            self.assertEqual(con.execute("pragma journal_mode").fetchone()[0].lower(), "delete")
            header = read_all(md)[:100]
            self.assertEqual(header[:16], b"SQLite format 3\0")
            self.assertEqual(header[18:20], b"\x01\x01", "not rollback-journal mode")
            rows = {r[0]: r[1:] for r in con.execute("select fqn, path, dtype, shape from tensors")}
            self.assertEqual(len(rows), len(TENSORS))
            for path, dtype, shape in TENSORS:
                fqn = path.replace("/", ".")
                self.assertEqual(rows[fqn], (path, dtype, json.dumps(shape, separators=(",", ":"))))
            chunks = list(con.execute(
                "select fqn, offsets, sizes, rank, file, file_offset, length, checksum from chunks"))
            self.assertEqual(len(chunks), len(TENSORS))
            byfqn = {c[0]: c for c in chunks}
            data_file = read_all(self.bk("db", "__0_0.distcp"))
            for path, dtype, shape in TENSORS:
                fqn, offs, sizes, rank, file, foff, length, csum = byfqn[path.replace("/", ".")]
                self.assertEqual(offs, json.dumps([0] * len(shape), separators=(",", ":")))
                self.assertEqual(sizes, json.dumps(shape, separators=(",", ":")))
                self.assertEqual(rank, 0)
                self.assertRegex(file, r"^__0_\d+\.distcp$")
                self.assertEqual(length, len(want[path]))
                self.assertRegex(csum, r"^[0-9a-f]{16}$")
                if file == "__0_0.distcp":
                    self.assertEqual(data_file[foff:foff + length], want[path])
            blobs = {r[0]: r[1:] for r in con.execute(
                "select fqn, path, rank, file, file_offset, length, checksum from blobs")}
            self.assertEqual(set(blobs), {p.replace("/", ".") for p, _ in BLOBS})
            for path, data in BLOBS:
                bpath, rank, file, foff, length, csum = blobs[path.replace("/", ".")]
                self.assertEqual((bpath, rank, length), (path, 0, len(data)))
                self.assertRegex(file, r"^__0_\d+\.distcp$")
                self.assertRegex(csum, r"^[0-9a-f]{16}$")
                stored = read_all(self.bk("db", file))[foff:foff + length]
                self.assertEqual(stored, data)
            # identical content gives identical checksums, different content not
            self.assertEqual(len({b[-1] for b in blobs.values()}), len(BLOBS))
        finally:
            con.close()
        # no journal or WAL files appeared beside it
        self.assertEqual(sorted(f for f in os.listdir(self.bk("db")) if f.startswith(".")),
                         [".metadata"])

    @staticmethod
    def has_cli():
        return shutil.which("sqlite3") is not None

    def test_metadata_sqlite_cli(self):
        if not self.has_cli():
            self.skipTest("no sqlite3 CLI")
        self.mount()
        os.mkdir(self.ck("cli"))
        write_tensor(self.ck("cli", "model/w"), "float32", [6, 10], tensor_bytes("float32", [6, 10]))
        write_file(self.ck("cli", "meta.txt"), b"hello")
        commit(self.ck("cli"))
        r = subprocess.run(["sqlite3", "-batch", "-init", "/dev/null", "-readonly", "-separator", "|",
                            self.ck("cli", ".metadata"),
                            "select fqn, path, dtype, shape from tensors; "
                            "select count(*) from blobs; "
                            "select value from checkpoint where key='world_size'; "
                            "select offsets, sizes, file from chunks;"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.splitlines(),
                         ["model.w|model/w|float32|[6,10]", "1", "1", "[0,0]|[6,10]|__0_0.distcp"])

    def test_status_committed_and_staging(self):
        self.mount()
        os.mkdir(self.ck("st"))
        self.assertEqual(status(self.ck("st")).split("\n")[0], "staging")
        self.assertTrue(os.path.isfile(self.ck("st", ".status")))
        self.assertErrno(errno.EACCES, os.open, self.ck("st", ".commit"), os.O_RDONLY)
        write_file(self.ck("st", "x"), b"1")
        commit(self.ck("st"))
        self.assertEqual(status(self.ck("st")).split("\n")[0], "committed")
        self.assertNotIn(".status", os.listdir(self.ck("st")))
        self.assertNotIn(".commit", os.listdir(self.ck("st")))

    def test_several_checkpoints_and_names(self):
        self.mount()
        names = ["a", "step_000100", "run-2.final", "A.b-c_d", "x" * 255]
        for i, n in enumerate(names):
            os.mkdir(self.ck(n))
            write_tensor(self.ck(n, "w"), "int32", [i + 1], tensor_bytes("int32", [i + 1], seed=i))
        for n in names:
            commit(self.ck(n))
        self.assertEqual(sorted(os.listdir(self.mnt)), sorted(names))
        for i, n in enumerate(names):
            self.assertEqual(read_all(self.ck(n, "w")), tensor_bytes("int32", [i + 1], seed=i))
            self.assertTrue(os.path.exists(self.bk(n, ".metadata")))


if __name__ == "__main__":
    main()

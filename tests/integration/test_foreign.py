#!/usr/bin/env python3
"""Checkpoints this mount did not write: a checkpoint of a world of 4
(crafted from a real one by editing its metadata and data files) read back
whole and by byte ranges (resharding) from one rank; damaged checkpoints
(missing or short data files, unreadable metadata) fail reads with EIO or
are not shown, and the daemon keeps running. Two worlds of one sharing one
BACKING_DIR."""

import errno
import os
import random
import shutil
import sqlite3
import threading
import time

from ckpttest.util import (CkptfsTestCase, block_bytes, commit, main, pread, read_all, state,
                           status, tensor_bytes, wait_state, write_file, write_tensor, xxh3_hex)

W_SHAPE = [8, 6]       # float32, 2 x 2 blocks of [4, 3] on ranks 0..3
C_SHAPE = [5, 8]       # float64, two column halves on ranks 2 and 3
S_SHAPE = [3, 4, 5]    # int16, split along the middle dimension on ranks 1, 0


def js(xs):
    return "[" + ",".join(str(x) for x in xs) + "]"


class ForeignWorld(CkptfsTestCase):
    def make_world4(self):
        """BACKING/w4: a checkpoint saved by 4 ranks; returns {path: bytes}."""
        self.mount()
        os.mkdir(self.ck("w4"))
        write_tensor(self.ck("w4", "w"), "float32", W_SHAPE, tensor_bytes("float32", W_SHAPE))
        write_file(self.ck("w4", "blob"), b"blob of rank 0")
        commit(self.ck("w4"))
        self.assertEqual(self.mounts[0].stop(), 0)

        want = {"w": tensor_bytes("float32", W_SHAPE, seed=1),
                "sub/cols": tensor_bytes("float64", C_SHAPE, seed=2),
                "s3": tensor_bytes("int16", S_SHAPE, seed=3)}
        files = {}  # data file name -> bytearray

        def put(fname, data):
            buf = files.setdefault(fname, bytearray(b"\xee" * 5))  # some padding first
            off = len(buf)
            buf += data
            buf += b"\xdd" * 3
            return off

        chunks = []
        for r in range(4):
            offs, sizes = [4 * (r // 2), 3 * (r % 2)], [4, 3]
            data = block_bytes(want["w"], W_SHAPE, 4, offs, sizes)
            f = f"__{r}_0.distcp"
            chunks.append(("w", js(offs), js(sizes), r, f, put(f, data), len(data),
                           xxh3_hex(data)))
        for r, col in [(2, 0), (3, 4)]:
            offs, sizes = [0, col], [5, 4]
            data = block_bytes(want["sub/cols"], C_SHAPE, 8, offs, sizes)
            f = f"__{r}_1.distcp"
            chunks.append(("sub.cols", js(offs), js(sizes), r, f, put(f, data), len(data),
                           xxh3_hex(data)))
        for r, mid, n in [(1, 0, 1), (0, 1, 3)]:
            offs, sizes = [0, mid, 0], [3, n, 5]
            data = block_bytes(want["s3"], S_SHAPE, 2, offs, sizes)
            f = f"__{r}_0.distcp"
            chunks.append(("s3", js(offs), js(sizes), r, f, put(f, data), len(data),
                           xxh3_hex(data)))
        blob = b"blob of rank 3\0!"
        boff = put("__3_0.distcp", blob)
        want["blob"] = blob

        d = self.bk("w4")
        for f in os.listdir(d):
            if f.endswith(".distcp"):
                os.unlink(os.path.join(d, f))
        for f, data in files.items():
            with open(os.path.join(d, f), "wb") as fh:
                fh.write(data)
        con = sqlite3.connect(os.path.join(d, ".metadata"))
        with con:
            con.execute("update checkpoint set value='4' where key='world_size'")
            con.execute("delete from chunks")
            con.execute("delete from tensors where fqn != 'w'")
            con.execute("insert into tensors values ('sub.cols', 'sub/cols', 'float64', ?)",
                        (js(C_SHAPE),))
            con.execute("insert into tensors values ('s3', 's3', 'int16', ?)", (js(S_SHAPE),))
            for row in reversed(chunks):  # any row order
                con.execute("insert into chunks values (?, ?, ?, ?, ?, ?, ?, ?)", row)
            con.execute("update blobs set rank=3, file='__3_0.distcp', file_offset=?, length=?, "
                        "checksum=?", (boff, len(blob), xxh3_hex(blob)))
        con.close()
        return want

    def test_world4_read_from_one_rank(self):
        want = self.make_world4()
        self.mount()
        self.assertEqual(state(self.ck("w4")), "committed")
        self.assertEqual(sorted(os.listdir(self.ck("w4"))), [".metadata", "blob", "s3", "sub", "w"])
        for path, data in want.items():
            self.assertEqual(os.stat(self.ck("w4", path)).st_size, len(data), path)
            self.assertEqual(read_all(self.ck("w4", path)), data, path)
        self.assertEqual(os.getxattr(self.ck("w4", "sub/cols"), "user.ckpt.shape"), b"5,8")
        rnd = random.Random(7)
        for path, data in want.items():
            for _ in range(300):
                off = rnd.randrange(0, len(data) + 3)
                n = rnd.randrange(1, len(data) + 5)
                self.assertEqual(pread(self.ck("w4", path), n, off), data[off:off + n], (path, off, n))
        # resharding: another world's block, read row by row
        rows = b"".join(pread(self.ck("w4", "w"), 4 * 4, (r * 6 + 1) * 4) for r in range(2, 7))
        self.assertEqual(rows, block_bytes(want["w"], W_SHAPE, 4, [2, 1], [5, 4]))
        # the .status says so
        self.assertRegex(status(self.ck("w4")), r"\b4\b")

    def test_missing_and_short_data_files(self):
        want = self.make_world4()
        os.unlink(self.bk("w4", "__3_0.distcp"))
        with open(self.bk("w4", "__2_1.distcp"), "r+b") as f:
            f.truncate(20)
        self.mount()
        self.assertErrno(errno.EIO, read_all, self.ck("w4", "w"))
        self.assertErrno(errno.EIO, read_all, self.ck("w4", "blob"))
        self.assertErrno(errno.EIO, read_all, self.ck("w4", "sub/cols"))
        # what does not need the damaged files still reads
        self.assertEqual(read_all(self.ck("w4", "s3")), want["s3"])
        self.assertEqual(self.mounts[0].stop(), 0)

    def test_unreadable_metadata_not_shown(self):
        self.mount()
        for n in ("ok", "bad"):
            os.mkdir(self.ck(n))
            write_file(self.ck(n, "f"), n.encode())
            commit(self.ck(n))
        self.assertEqual(self.mounts[0].stop(), 0)
        with open(self.bk("bad", ".metadata"), "r+b") as f:
            f.write(b"this is not SQLite at all" * 10)
        self.mount()
        self.assertEqual(os.listdir(self.mnt), ["ok"])
        self.assertEqual(read_all(self.ck("ok", "f")), b"ok")
        self.assertIn("bad", self.daemon_log())
        # the directory is left alone (it has a .metadata)
        self.assertTrue(os.path.exists(self.bk("bad", ".metadata")))

    def test_metadata_with_wrong_content_not_shown(self):
        self.mount()
        os.mkdir(self.ck("x"))
        write_tensor(self.ck("x", "w"), "float32", [4], tensor_bytes("float32", [4]))
        commit(self.ck("x"))
        self.assertEqual(self.mounts[0].stop(), 0)
        for sql in ["update tensors set dtype='float33'",
                    "update tensors set shape='[4,'",
                    "update chunks set file='__9_0.distcp'",
                    "update chunks set checksum='xyz'",
                    "update checkpoint set value='99' where key='format_version'"]:
            shutil.copy(self.bk("x", ".metadata"), self.bk("x", "orig"))
            con = sqlite3.connect(self.bk("x", ".metadata"))
            with con:
                con.execute(sql)
            con.close()
            self.mount()
            self.assertEqual(os.listdir(self.mnt), [], sql)
            self.assertEqual(self.mounts[-1].stop(), 0, sql)
            os.replace(self.bk("x", "orig"), self.bk("x", ".metadata"))
        self.mount()
        self.assertEqual(read_all(self.ck("x", "w")), tensor_bytes("float32", [4]))


class SharedBacking(CkptfsTestCase):
    """Two worlds of one rank over one BACKING_DIR."""

    def test_two_worlds(self):
        a = self.mount()
        mnt_b = os.path.join(self.dir, "mnt_b")
        os.mkdir(self.ck("from_a"))
        write_file(self.ck("from_a", "f"), b"a")
        commit(self.ck("from_a"))
        self.mount(mnt=mnt_b)
        # B loaded A's checkpoint at its start
        self.assertEqual(read_all(os.path.join(mnt_b, "from_a", "f")), b"a")
        # a name A commits later is taken for B too
        os.mkdir(self.ck("later"))
        write_file(self.ck("later", "f"), b"later")
        commit(self.ck("later"))
        self.assertErrno(errno.EEXIST, os.mkdir, os.path.join(mnt_b, "later"))
        # the commit of a name the other world committed meanwhile fails
        os.mkdir(os.path.join(mnt_b, "race"))
        os.mkdir(self.ck("race"))
        write_file(self.ck("race", "f"), b"A wins")
        write_file(os.path.join(mnt_b, "race", "f"), b"B loses")
        commit(self.ck("race"))
        self.assertErrno(errno.EEXIST, commit, os.path.join(mnt_b, "race"))
        self.assertIn("race", status(os.path.join(mnt_b, "race")))
        self.assertIn("committed elsewhere", status(os.path.join(mnt_b, "race")))
        self.assertEqual(read_all(self.ck("race", "f")), b"A wins")
        # removal through A leaves B's view
        shutil.rmtree(self.ck("from_a"))
        self.assertNotIn("from_a", os.listdir(mnt_b))
        self.assertEqual(a.stop(), 0)

    def test_commits_while_other_world_starts_again_and_again(self):
        # world A commits small checkpoints while world B mounts over and
        # over (each start cleans up unfinished saves): no commit of A may
        # be disturbed
        self.mount("sync_files=0")
        mnt_b = os.path.join(self.dir, "mnt_b")
        stop = threading.Event()
        starts = []
        errors = []

        def restart_b():
            try:
                while not stop.is_set():
                    m = self.mount("sync_files=0", mnt=mnt_b)
                    starts.append(1)
                    self.assertEqual(m.stop(), 0)
                    self.mounts.remove(m)
            except Exception as e:
                errors.append(repr(e))

        th = threading.Thread(target=restart_b)
        th.start()
        failed = []
        try:
            deadline = time.monotonic() + 6
            i = 0
            while time.monotonic() < deadline:
                n = f"c{i}"
                os.mkdir(self.ck(n))
                write_file(self.ck(n, "f"), n.encode() * 100)
                try:
                    commit(self.ck(n))
                except OSError:
                    failed.append((n, status(self.ck(n))))
                i += 1
        finally:
            stop.set()
            th.join()
        self.assertEqual(errors, [])
        self.assertEqual(failed, [])
        self.assertGreaterEqual(len(starts), 2)
        for k in range(i):
            self.assertEqual(read_all(self.ck(f"c{k}", "f")), f"c{k}".encode() * 100)

    def test_mount_start_leaves_save_in_flight(self):
        # through the daemon: the commit writes the data files (a file
        # written once by passthrough has nothing left to write but its
        # sync, which the drain starts at its close: too quick to catch)
        self.mount("passthrough=0")
        mnt_b = os.path.join(self.dir, "mnt_b")
        for attempt, mib in enumerate([160, 320, 640]):
            name = f"big{attempt}"
            os.mkdir(self.ck(name))
            payload = os.urandom(1 << 20) * mib
            write_file(self.ck(name, "data"), payload)
            commit(self.ck(name), "async")
            # wait until its data files are being written, then start world B
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                saves = self.bk(".saves")  # the save's own directory
                try:
                    if any(f.endswith(".distcp") for d in os.listdir(saves)
                           for f in os.listdir(os.path.join(saves, d))):
                        break
                except FileNotFoundError:  # not made yet, or gone
                    pass
                if state(self.ck(name)) != "committing":
                    break
                time.sleep(0.001)
            b = self.mount(mnt=mnt_b)
            during = state(self.ck(name))
            self.assertEqual(wait_state(self.ck(name)).split("\n")[0], "committed")
            self.assertEqual(read_all(self.ck(name, "data")), payload)
            self.assertEqual(b.stop(), 0)
            shutil.rmtree(self.ck(name))
            if during == "committing":
                return
        self.fail("every save ended before world B started: the test proved nothing")


if __name__ == "__main__":
    main()

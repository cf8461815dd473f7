#!/usr/bin/env python3
"""Bad input on one rank: xattr values refused by setxattr, commits that
fail (EIO, .status "failed" with a reason naming file and numbers, nothing
published, earlier checkpoints intact, the retry after a fix commits),
garbage written to .commit, and refused names."""

import errno
import os
import shutil

from ckpttest.util import (CkptfsTestCase, commit, main, read_all, state, status, tensor_bytes,
                           write_file, write_tensor)


class BadXattrs(CkptfsTestCase):
    def setUp(self):
        super().setUp()
        self.mount()
        os.makedirs(self.ck("s", "t"))
        self.p = self.ck("s", "t", "w")
        write_file(self.p, b"")

    def refused(self, name, value):
        self.assertErrno(errno.EINVAL, os.setxattr, self.p, name, value)

    def test_unknown_dtype(self):
        for v in [b"float33", b"", b"tensor", b"f32x", b"int128", b"float32,int8"]:
            self.refused("user.ckpt.dtype", v)
        self.assertErrno(errno.ENODATA, os.getxattr, self.p, "user.ckpt.dtype")
        os.setxattr(self.p, "user.ckpt.dtype", b"float32")  # a good one still works
        self.refused("user.ckpt.dtype", b"nope")
        self.assertEqual(os.getxattr(self.p, "user.ckpt.dtype"), b"float32")

    def test_malformed_shape(self):
        for v in [b"4,x", b"[4", b"4]", b"-1,4", b"4,-1", b"4,,4", b",4", b"4,", b"1.5",
                  b"[4,[4]]", b"4 4", b"99999999999999999999999", b"0x10"]:
            self.refused("user.ckpt.shape", v)
        self.assertErrno(errno.ENODATA, os.getxattr, self.p, "user.ckpt.shape")
        for name in ("user.ckpt.offsets", "user.ckpt.sizes"):
            for v in [b"x", b"-1", b"[1", b"1,,2"]:
                self.refused(name, v)

    def test_numel_overflow(self):
        self.refused("user.ckpt.shape", b"4294967296,4294967296,4294967296")

    def test_length_mismatch(self):
        os.setxattr(self.p, "user.ckpt.shape", b"4,6")
        self.refused("user.ckpt.offsets", b"0")
        self.refused("user.ckpt.offsets", b"0,0,0")
        self.refused("user.ckpt.sizes", b"4")
        self.refused("user.ckpt.sizes", b"1,1,1")
        self.refused("user.ckpt.offsets", b"[]")
        # offsets/sizes first, then a shape of another length
        q = self.ck("s", "q")
        write_file(q, b"")
        os.setxattr(q, "user.ckpt.offsets", b"0,0")
        self.assertErrno(errno.EINVAL, os.setxattr, q, "user.ckpt.shape", b"8")
        os.setxattr(q, "user.ckpt.shape", b"8,8")
        r = self.ck("s", "r")
        write_file(r, b"")
        os.setxattr(r, "user.ckpt.offsets", b"0,0")
        self.assertErrno(errno.EINVAL, os.setxattr, r, "user.ckpt.sizes", b"1,1,1")

    def test_chunk_outside_shape(self):
        os.setxattr(self.p, "user.ckpt.shape", b"4,6")
        self.refused("user.ckpt.offsets", b"5,0")
        self.refused("user.ckpt.offsets", b"0,7")
        self.refused("user.ckpt.sizes", b"5,6")
        self.refused("user.ckpt.sizes", b"4,7")
        os.setxattr(self.p, "user.ckpt.offsets", b"2,0")
        self.refused("user.ckpt.sizes", b"3,6")   # rows 2..4 of 4
        os.setxattr(self.p, "user.ckpt.sizes", b"2,6")
        # and a shape that would leave the chunk outside
        self.refused("user.ckpt.shape", b"3,6")
        self.assertEqual(os.getxattr(self.p, "user.ckpt.shape"), b"4,6")

    def test_other_names(self):
        # other user.* names are kept (test_links.py); other namespaces and
        # unknown user.ckpt.* names are not
        self.assertErrno(errno.ENOTSUP, os.setxattr, self.p, "user.ckpt.other", b"1")
        self.assertErrno(errno.ENODATA, os.getxattr, self.p, "user.other")
        self.assertErrno(errno.ENODATA, os.removexattr, self.p, "user.ckpt.dtype")

    def test_xattr_flags_and_remove(self):
        os.setxattr(self.p, "user.ckpt.dtype", b"int8", os.XATTR_CREATE)
        self.assertErrno(errno.EEXIST, os.setxattr, self.p, "user.ckpt.dtype", b"int16",
                         os.XATTR_CREATE)
        self.assertErrno(errno.ENODATA, os.setxattr, self.p, "user.ckpt.shape", b"4",
                         os.XATTR_REPLACE)
        os.setxattr(self.p, "user.ckpt.dtype", b"int16", os.XATTR_REPLACE)
        self.assertEqual(os.getxattr(self.p, "user.ckpt.dtype"), b"int16")
        self.assertEqual(os.listxattr(self.p), ["user.ckpt.dtype"])
        os.removexattr(self.p, "user.ckpt.dtype")
        self.assertEqual(os.listxattr(self.p), [])


class CommitFailures(CkptfsTestCase):
    def setUp(self):
        super().setUp()
        self.mount()
        # an earlier checkpoint that must stay intact through every failure
        os.mkdir(self.ck("good"))
        self.good = write_tensor(self.ck("good", "w"), "float32", [4, 4],
                                 tensor_bytes("float32", [4, 4]))
        write_file(self.ck("good", "b"), b"blob\0data")
        commit(self.ck("good"))
        self.good_files = sorted(os.listdir(self.bk("good")))

    def fails(self, name):
        """Commit NAME: EIO, "failed", nothing published; return .status."""
        self.assertErrno(errno.EIO, commit, self.ck(name))
        st = status(self.ck(name))
        self.assertEqual(st.split("\n")[0], "failed", st)
        self.assertNothingPublished(name)
        self.assertEqual(read_all(self.ck("good", "w")), self.good)
        self.assertEqual(read_all(self.ck("good", "b")), b"blob\0data")
        self.assertEqual(sorted(os.listdir(self.bk("good"))), self.good_files)
        self.assertEqual(state(self.ck("good")), "committed")
        # still staged: the files are there as written
        self.assertIn(name, os.listdir(self.mnt))
        return st

    def retry_commits(self, name, checks):
        commit(self.ck(name))
        self.assertEqual(state(self.ck(name)), "committed")
        self.assertTrue(os.path.exists(self.bk(name, ".metadata")))
        for path, data in checks.items():
            self.assertEqual(read_all(self.ck(name, path)), data, path)

    def test_wrong_chunk_length(self):
        os.mkdir(self.ck("bad"))
        write_tensor(self.ck("bad", "layer/short_tensor"), "float32", [4, 4], b"\1" * 60)
        st = self.fails("bad")
        self.assertIn("layer/short_tensor", st)
        self.assertRegex(st, r"\b60\b")
        self.assertRegex(st, r"\b64\b")
        self.assertEqual(read_all(self.ck("bad", "layer/short_tensor")), b"\1" * 60)
        # too long fails as well
        write_file(self.ck("bad", "layer/short_tensor"), b"\1" * 65)
        st = self.fails("bad")
        self.assertRegex(st, r"\b65\b")
        # fixed: commits
        data = tensor_bytes("float32", [4, 4], seed=3)
        write_file(self.ck("bad", "layer/short_tensor"), data)
        self.retry_commits("bad", {"layer/short_tensor": data})

    def test_dtype_without_shape(self):
        os.mkdir(self.ck("ns"))
        p = self.ck("ns", "m/noshape")
        write_file(p, b"\0" * 16)
        os.setxattr(p, "user.ckpt.dtype", b"float32")
        st = self.fails("ns")
        self.assertIn("m/noshape", st)
        self.assertRegex(st, r"user\.ckpt\.shape is missing")
        os.setxattr(p, "user.ckpt.shape", b"4")
        self.retry_commits("ns", {"m/noshape": b"\0" * 16})

    def test_shape_without_dtype(self):
        os.mkdir(self.ck("nd"))
        p = self.ck("nd", "nodtype")
        write_file(p, b"\0" * 8)
        os.setxattr(p, "user.ckpt.shape", b"2")
        st = self.fails("nd")
        self.assertIn("nodtype", st)
        self.assertRegex(st, r"user\.ckpt\.dtype is missing")
        os.setxattr(p, "user.ckpt.dtype", b"float32")
        self.retry_commits("nd", {"nodtype": b"\0" * 8})
        self.assertEqual(os.getxattr(p, "user.ckpt.dtype"), b"float32")

    def test_offsets_without_sizes(self):
        os.mkdir(self.ck("os"))
        p = self.ck("os", "half")
        data = tensor_bytes("int32", [2, 4])
        write_tensor(p, "int32", [4, 4], data, offsets=[2, 0])
        st = self.fails("os")
        self.assertIn("half", st)
        self.assertRegex(st, r"user\.ckpt\.sizes is missing")
        # all-zero offsets need no sizes
        q = self.ck("os", "zero")
        write_tensor(q, "int32", [2], tensor_bytes("int32", [2]), offsets=[0])
        os.removexattr(p, "user.ckpt.offsets")
        os.setxattr(p, "user.ckpt.shape", b"2,4")
        self.retry_commits("os", {"half": data, "zero": tensor_bytes("int32", [2])})

    def test_gap(self):
        os.mkdir(self.ck("gap"))
        p = self.ck("gap", "part")
        data = tensor_bytes("float32", [2, 4])
        write_tensor(p, "float32", [4, 4], data, offsets=[0, 0], sizes=[2, 4])
        st = self.fails("gap")
        self.assertIn("part", st)
        self.assertRegex(st, r"\b8\b")    # elements covered
        self.assertRegex(st, r"\b16\b")   # of the tensor's
        os.setxattr(p, "user.ckpt.shape", b"2,4")
        os.setxattr(p, "user.ckpt.sizes", b"2,4")
        self.retry_commits("gap", {"part": data})

    def test_two_paths_one_fqn(self):
        os.mkdir(self.ck("fq"))
        write_file(self.ck("fq", "a/b"), b"one")
        write_file(self.ck("fq", "a.b"), b"two")
        st = self.fails("fq")
        self.assertIn("a.b", st)
        self.assertIn("a/b", st)
        os.unlink(self.ck("fq", "a.b"))
        self.retry_commits("fq", {"a/b": b"one"})

    def test_several_problems_reported_together(self):
        os.mkdir(self.ck("many"))
        write_tensor(self.ck("many", "x/first"), "int64", [3], b"\0" * 23)
        write_tensor(self.ck("many", "y/second"), "int16", [5], b"\0" * 3)
        write_file(self.ck("many", "z/ok"), b"fine")
        st = self.fails("many")
        self.assertIn("x/first", st)
        self.assertIn("y/second", st)
        self.assertRegex(st, r"\b23\b")
        self.assertRegex(st, r"\b24\b")

    def test_garbage_to_commit(self):
        os.mkdir(self.ck("g"))
        write_file(self.ck("g", "x"), b"data")
        for junk in [b"syncx\n", b"SYNC\n", b"now\n", b"sync\n\n", b" sync", b"\n", b"a" * 100,
                     b"sync\0", b"async\nsync\n", b"sync solo solo", b"sync replace=",
                     b"sync replace=.x", b"sync replace=a/b", b"sync solo ", b"solo sync"]:
            self.assertErrno(errno.EINVAL, commit, self.ck("g"), junk)
            self.assertEqual(state(self.ck("g")), "staging", junk)
        self.assertFalse(os.path.exists(self.bk("g")))
        # still writable, and a proper commit works; no newline is fine
        write_file(self.ck("g", "y"), b"more")
        commit(self.ck("g"), b"sync")
        self.assertEqual(read_all(self.ck("g", "y")), b"more")

    def test_failed_then_removed(self):
        os.mkdir(self.ck("rm"))
        write_tensor(self.ck("rm", "w"), "float32", [4], b"")
        self.fails("rm")
        # a failed checkpoint can be removed like a staged one
        shutil.rmtree(self.ck("rm"))
        self.assertNotIn("rm", os.listdir(self.mnt))
        self.assertFalse(os.path.exists(self.bk("rm")))
        os.mkdir(self.ck("rm"))  # the name is free again
        self.assertEqual(state(self.ck("rm")), "staging")
        self.assertEqual(os.listdir(self.ck("rm")), [])


class Names(CkptfsTestCase):
    def setUp(self):
        super().setUp()
        self.mount()

    def test_checkpoint_names(self):
        self.assertErrno(errno.EPERM, os.mkdir, self.ck(".x"))
        self.assertErrno(errno.EPERM, os.mkdir, self.ck(".staging"))
        self.assertErrno(errno.ENAMETOOLONG, os.mkdir, self.ck("x" * 256))
        self.assertEqual(os.listdir(self.mnt), [])
        # files at the top level are not checkpoints
        self.assertErrno(errno.EPERM, os.open, self.ck("file"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.mkdir(self.ck("x" * 255))
        self.assertEqual(os.listdir(self.mnt), ["x" * 255])

    def test_names_inside(self):
        os.mkdir(self.ck("n"))
        # reserved directly under the checkpoint only (test_names has the rest)
        self.assertErrno(errno.EPERM, os.open, self.ck("n", ".metadata"), os.O_WRONLY | os.O_CREAT, 0o644)
        self.assertErrno(errno.EPERM, os.mkdir, self.ck("n", ".npy"))
        os.mkdir(self.ck("n", "d"))
        self.assertErrno(errno.ENAMETOOLONG, os.open, self.ck("n", "f" * 256),
                         os.O_WRONLY | os.O_CREAT, 0o644)
        self.assertErrno(errno.ENAMETOOLONG, os.mkdir, self.ck("n", "d", "f" * 256))
        write_file(self.ck("n", "d", "ok"), b"1")
        self.assertErrno(errno.EPERM, os.rename, self.ck("n", "d", "ok"), self.ck("n", ".safetensors"))
        self.assertEqual(os.listdir(self.ck("n", "d")), ["ok"])
        write_file(self.ck("n", "f" * 255), b"long")
        commit(self.ck("n"))
        self.assertEqual(read_all(self.ck("n", "f" * 255)), b"long")
        self.assertEqual(read_all(self.ck("n", "d", "ok")), b"1")

    def test_mkdir_existing(self):
        os.mkdir(self.ck("e"))
        self.assertErrno(errno.EEXIST, os.mkdir, self.ck("e"))  # staged
        write_file(self.ck("e", "x"), b"x")
        commit(self.ck("e"))
        self.assertErrno(errno.EEXIST, os.mkdir, self.ck("e"))  # committed
        # found in BACKING by a fresh mount
        self.assertEqual(self.mounts[0].stop(), 0)
        self.mount()
        self.assertErrno(errno.EEXIST, os.mkdir, self.ck("e"))
        # inside a staged checkpoint too
        os.mkdir(self.ck("f"))
        os.mkdir(self.ck("f", "d"))
        self.assertErrno(errno.EEXIST, os.mkdir, self.ck("f", "d"))
        write_file(self.ck("f", "file"), b"")
        self.assertErrno(errno.EEXIST, os.mkdir, self.ck("f", "file"))
        self.assertErrno(errno.EEXIST, os.open, self.ck("f", "file"),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


if __name__ == "__main__":
    main()

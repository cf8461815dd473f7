#!/usr/bin/env python3
"""Names and renames as the tools people already use make them (issue 24):
checkpoint names such as Lightning's `epoch=0-step=100`, spaces and UTF-8;
dot-files and dot-directories inside a checkpoint (safetensors' `.tmpXXXX`,
`cp -a` of a tree holding them), the names ckptfs serves itself reserved at
the checkpoint's top level only; `os.replace` inside a staged checkpoint and
the Hugging Face Trainer's rename of `tmp-checkpoint-N` to `checkpoint-N`."""

import errno
import os
import stat
import subprocess

from ckpttest.util import (CkptfsTestCase, commit, main, read_all, state, tensor_bytes, write_file,
                           write_tensor)


def tree(root):
    """{relative path: (kind, mode bits, mtime_ns, bytes or None)} of root."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", st.st_mode & 0o7777, st.st_mtime_ns, None)
            else:
                out[rel] = ("f", st.st_mode & 0o7777, st.st_mtime_ns, read_all(p))
    return out


class Names(CkptfsTestCase):
    def setUp(self):
        super().setUp()
        self.m = self.mount()

    def test_checkpoint_names_any_file_name(self):
        names = ["epoch=0-step=100", "a b", "ünï", "x" * 255, "tab\there",
                 "semi;colon,comma+plus@at#hash%pct&amp(par)[br]{cu}'q\"dq",
                 "step-1.", "-dash", "new\nline"]
        for i, name in enumerate(names):
            os.mkdir(self.ck(name))
            write_file(self.ck(name, "w"), bytes([i]) * 10)
            commit(self.ck(name))
            self.assertEqual(state(self.ck(name)), "committed", name)
        self.assertEqual(sorted(os.listdir(self.mnt)), sorted(names))
        self.assertTrue(os.path.isfile(os.path.join(self.backing, "a b", ".metadata")))
        # the rules that stay: no leading '.', 1-255 bytes
        self.assertErrno(errno.EPERM, os.mkdir, self.ck(".hidden"))
        self.assertErrno(errno.ENAMETOOLONG, os.mkdir, self.ck("y" * 256))
        self.m.stop()
        self.m = self.mount()
        for i, name in enumerate(names):
            self.assertEqual(read_all(self.ck(name, "w")), bytes([i]) * 10, name)
        out = subprocess.run(["sqlite3", "-readonly", self.ck("a b", ".metadata"),
                              "select value from checkpoint where key='name'"],
                             capture_output=True, text=True)
        self.assertEqual(out.stdout.strip(), "a b", out.stderr)

    def test_dot_files_inside(self):
        os.mkdir(self.ck("s"))
        os.mkdir(self.ck("s", ".hidden"))
        write_file(self.ck("s", ".hidden", ".tmp1"), b"one")
        write_file(self.ck("s", ".tmp1"), b"top")
        os.mkdir(self.ck("s", "sub"))
        write_file(self.ck("s", "sub", ".npy"), b"not the view: a subdirectory")
        write_file(self.ck("s", "sub", ".commit"), b"nor the control file")
        write_tensor(self.ck("s", ".w"), "float32", [2, 2], tensor_bytes("float32", [2, 2]))
        self.assertEqual(sorted(os.listdir(self.ck("s"))), [".hidden", ".tmp1", ".w", "sub"])
        commit(self.ck("s"))
        self.assertEqual(state(self.ck("s")), "committed")
        self.m.stop()
        self.m = self.mount()
        self.assertEqual(read_all(self.ck("s", ".hidden", ".tmp1")), b"one")
        self.assertEqual(read_all(self.ck("s", ".tmp1")), b"top")
        self.assertEqual(read_all(self.ck("s", "sub", ".npy")), b"not the view: a subdirectory")
        self.assertEqual(read_all(self.ck("s", "sub", ".commit")), b"nor the control file")
        self.assertEqual(read_all(self.ck("s", ".w")), tensor_bytes("float32", [2, 2]))
        self.assertEqual(os.getxattr(self.ck("s", ".w"), "user.ckpt.dtype"), b"float32")
        self.assertEqual(sorted(os.listdir(self.ck("s"))),
                         [".hidden", ".metadata", ".tmp1", ".w", "sub"])
        out = subprocess.run(["sqlite3", "-readonly", self.ck("s", ".metadata"),
                              "select fqn from blobs order by fqn"],
                             capture_output=True, text=True)
        self.assertEqual(out.stdout.split(), [".hidden..tmp1", ".tmp1", "sub..commit", "sub..npy"])

    def test_reserved_top_level_names(self):
        os.mkdir(self.ck("s"))
        for name in (".commit", ".status", ".metadata", ".npy", ".safetensors", ".w[0:2]"):
            with self.subTest(name=name):
                if name in (".commit", ".status"):
                    # served already: the name exists
                    self.assertErrno(errno.EEXIST, os.mkdir, self.ck("s", name))
                else:
                    self.assertErrno(errno.EPERM, os.open, self.ck("s", name),
                                     os.O_WRONLY | os.O_CREAT, 0o644)
                    self.assertErrno(errno.EPERM, os.mkdir, self.ck("s", name))
        write_file(self.ck("s", "a"), b"a")
        self.assertErrno(errno.EPERM, os.rename, self.ck("s", "a"), self.ck("s", ".metadata"))
        self.assertIn("reserved", self.daemon_log())
        self.assertIn(".metadata", self.daemon_log())

    def test_other_node_types_refused_with_a_reason(self):
        os.mkdir(self.ck("s"))
        write_file(self.ck("s", "f"), b"f")
        self.assertErrno(errno.EPERM, os.mkfifo, self.ck("s", "fifo"))
        self.assertErrno(errno.EPERM, os.symlink, "f", self.ck("link"))  # at the root
        log = self.daemon_log()
        self.assertIn("fifo (in s): refused: a FIFO; a checkpoint holds regular "
                      "files, directories and links only", log)
        self.assertEqual(os.listdir(self.ck("s")), ["f"])

    def test_cp_a_tree_with_dot_files(self):
        src = os.path.join(self.dir, "src")
        os.makedirs(os.path.join(src, ".git", "objects"))
        os.makedirs(os.path.join(src, "model", ".cache"))
        os.makedirs(os.path.join(src, "empty", ".empty too"))
        files = {".gitignore": b"*.pyc\n", ".git/HEAD": b"ref: main\n",
                 ".git/objects/ab": os.urandom(3000), "model/.cache/x": b"",
                 "model/weights.bin": os.urandom(200000), "config.json": b"{}",
                 "model/.tmp0ENsvo": b"left over"}
        for rel, data in files.items():
            write_file(os.path.join(src, rel), data)
        os.chmod(os.path.join(src, "config.json"), 0o600)
        os.chmod(os.path.join(src, "model", ".cache"), 0o750)
        for i, rel in enumerate(sorted(files)):
            os.utime(os.path.join(src, rel), ns=(10**18 + i, 10**18 + 7 * i))
        # directories too (rsync, like on any filesystem, leaves a directory's
        # time alone when it is within the same second as the source's)
        for i, rel in enumerate(("model", "model/.cache", "empty", "empty/.empty too",
                                 ".git", ".git/objects")):
            os.utime(os.path.join(src, rel), ns=(10**18, 10**18 + 99 + i))
        os.mkdir(self.ck("tree"))
        r = subprocess.run(["cp", "-a", src + "/.", self.ck("tree")], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        commit(self.ck("tree"))
        self.m.stop()
        self.m = self.mount()
        got = tree(self.ck("tree"))
        self.assertEqual(got.pop(".metadata")[0], "f")
        want = tree(src)
        # committed: write bits cleared, everything else as staged
        want = {k: (kind, mode & ~0o222, mt, data) for k, (kind, mode, mt, data) in want.items()}
        self.assertEqual(got, want)
        r = subprocess.run(["diff", "-r", "-x", ".metadata", src, self.ck("tree")],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        # rsync -a writes each file as a dot-named temp file, then renames it
        os.mkdir(self.ck("synced"))
        r = subprocess.run(["rsync", "-a", src + "/", self.ck("synced") + "/"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        commit(self.ck("synced"))
        self.m.stop()
        self.m = self.mount()
        got = tree(self.ck("synced"))
        got.pop(".metadata")
        self.assertEqual(got, want)


class Renames(CkptfsTestCase):
    def setUp(self):
        super().setUp()
        self.m = self.mount()

    def test_replace_inside_staged(self):
        os.mkdir(self.ck("s"))
        write_file(self.ck("s", "model.safetensors"), b"old")
        # safetensors / torch.save via a temp file: write .tmpX, os.replace
        write_file(self.ck("s", ".tmpAbC"), b"new bytes")
        os.replace(self.ck("s", ".tmpAbC"), self.ck("s", "model.safetensors"))
        os.mkdir(self.ck("s", "empty"))
        os.mkdir(self.ck("s", ".d"))
        write_file(self.ck("s", ".d", "f"), b"f")
        os.replace(self.ck("s", ".d"), self.ck("s", "empty"))
        self.assertEqual(sorted(os.listdir(self.ck("s"))), ["empty", "model.safetensors"])
        commit(self.ck("s"))
        self.assertEqual(read_all(self.ck("s", "model.safetensors")), b"new bytes")
        self.assertEqual(read_all(self.ck("s", "empty", "f")), b"f")

    def test_rename_staged_checkpoint(self):
        os.mkdir(self.ck("tmp-checkpoint-5"))
        write_file(self.ck("tmp-checkpoint-5", "trainer_state.json"), b"{}")
        fd = os.open(self.ck("tmp-checkpoint-5", "open"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"written before")
        os.rename(self.ck("tmp-checkpoint-5"), self.ck("checkpoint-5"))
        os.write(fd, b" and after")  # a handle open across the rename goes on
        os.close(fd)
        self.assertFalse(os.path.exists(self.ck("tmp-checkpoint-5")))
        self.assertEqual(state(self.ck("checkpoint-5")), "staging")
        commit(self.ck("checkpoint-5"))
        self.assertTrue(os.path.isfile(self.bk("checkpoint-5", ".metadata")))
        self.assertFalse(os.path.exists(self.bk("tmp-checkpoint-5")))
        self.assertEqual(read_all(self.ck("checkpoint-5", "open")), b"written before and after")
        # the working name is free again
        os.mkdir(self.ck("tmp-checkpoint-5"))
        write_file(self.ck("tmp-checkpoint-5", "x"), b"x")
        # onto a name in use: committed, or staged here
        self.assertErrno(errno.EEXIST, os.rename, self.ck("tmp-checkpoint-5"), self.ck("checkpoint-5"))
        os.mkdir(self.ck("other"))
        self.assertErrno(errno.EEXIST, os.rename, self.ck("tmp-checkpoint-5"), self.ck("other"))
        # a committed checkpoint keeps its name; reserved names stay reserved
        self.assertErrno(errno.EPERM, os.rename, self.ck("checkpoint-5"), self.ck("c6"))
        self.assertErrno(errno.EPERM, os.rename, self.ck("tmp-checkpoint-5"), self.ck(".c6"))
        # a rename between two checkpoints: EXDEV, so mv copies
        self.assertErrno(errno.EXDEV, os.rename, self.ck("tmp-checkpoint-5", "x"), self.ck("other", "x"))
        r = subprocess.run(["mv", self.ck("tmp-checkpoint-5", "x"), self.ck("other", "x")],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(read_all(self.ck("other", "x")), b"x")

    def test_rename_committed_by_another_mount_name(self):
        m2 = self.mount(mnt=os.path.join(self.dir, "mnt2"))
        os.mkdir(self.ck("taken", mnt=m2.mnt))
        write_file(self.ck("taken", "f", mnt=m2.mnt), b"2")
        commit(self.ck("taken", mnt=m2.mnt))
        os.mkdir(self.ck("mine"))
        write_file(self.ck("mine", "f"), b"1")
        self.assertErrno(errno.EEXIST, os.rename, self.ck("mine"), self.ck("taken"))
        self.assertEqual(read_all(self.ck("taken", "f")), b"2")


if __name__ == "__main__":
    main()

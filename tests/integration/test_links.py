#!/usr/bin/env python3
"""Links and other extended attributes inside a checkpoint (issue 38,
cases 2, 3 and 5), with the system calls and with the real tools. Each
test stages into a mount, commits with `echo sync > NAME/.commit`, checks,
unmounts, mounts the same BACKING_DIR again and checks again.

    python3 tests/integration/test_links.py --bin build/bin/ckptfs [Class ...]

Classes:
  Symlinks   symlink(2) in a staged checkpoint: any target (relative,
             '..' escapes, absolute outside the mount, dangling, a loop,
             bytes that are not UTF-8, 4095 bytes) kept as written and
             never followed by the daemon; lstat S_IFLNK, st_size the
             target's length, the caller's owner; committed: the same
             links, read-only (EROFS/EPERM), an `entries` row each (mode
             S_IFLNK|0777, `target`). The tools: git clone of a repository
             with symlinks (before: core.symlinks=false, links written as
             regular files), unzip of a `zip -y` archive (before:
             "symlink error", rc 0, links missing), cp -a of a Hugging
             Face cache (snapshots/REV/FILE -> ../../blobs/SHA; before:
             cp failed).
  HardLinks  link(2) inside one staged checkpoint, any directory of it:
             one st_ino, st_nlink 2, writes seen through both names,
             unlink leaves nlink 1; across checkpoints and into or out of
             a committed one refused (EXDEV/EPERM/EROFS). Committed: one
             st_ino, nlink 2, the bytes stored once (data files under
             1.5x one copy). The tools: cp -a, tar -x, rsync -aH of trees
             with hard links; zarr-python 3 (formats 2 and 3: metadata
             finished by os.link of a .partial file), atomicwrites'
             atomic_write(overwrite=False) (os.link, EEXIST).
  Xattrs     user.* xattrs other than user.ckpt.* on staged files,
             tensors and directories: set, get (binary values byte-exact),
             list, remove, XATTR_CREATE/XATTR_REPLACE; bounds (a value
             over 64 KiB: E2BIG; a 65th name, or names and values over 64
             KiB: ENOSPC); other namespaces refused (ENOTSUP or EPERM).
             Committed: shown, read-only (EROFS/EPERM). The tools: cp -a
             (before: dropped without a word), rsync -aX (before: rc 23).
  Combined   rsync -aHX of a tree with a symlink, a hard-linked pair and
             xattrs: everything after the commit and a remount.
Needs root (FUSE), git, zip, unzip, rsync, tar, getfattr and setfattr
(a test skips, saying which, without its tool), and .venv's zarr and
atomicwrites for those two (pyenv.require_modules).
"""

import errno
import glob
import hashlib
import os
import shutil
import sqlite3
import stat
import subprocess

from ckpttest.pyenv import require_modules, run_py
from ckpttest.util import CkptfsTestCase, commit, main, read_all, state, status, write_file

KiB, MiB = 1 << 10, 1 << 20
REFUSED = (errno.EROFS, errno.EPERM)               # a change to a committed checkpoint
CROSS = (errno.EXDEV, errno.EPERM, errno.EROFS)    # a link across checkpoints
NOT_USER = (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM)  # trusted.*, security.*
S_IFLNK_0777 = stat.S_IFLNK | 0o777


def sha(data):
    return hashlib.sha256(data).hexdigest()


def run(argv, **kw):
    """argv's CompletedProcess (text, both outputs), never raising."""
    return subprocess.run(argv, capture_output=True, text=True, **kw)


def tree_of(root):
    """{relative path: ('l', target) | ('f', bytes) | ('d',)} of root,
    without following links."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d",)
            else:
                out[rel] = ("f", read_all(p))
    return out


def user_xattrs(path):
    """{name: value} of path's xattrs outside user.ckpt.* (not following a
    link)."""
    return {n: os.getxattr(path, n, follow_symlinks=False)
            for n in os.listxattr(path, follow_symlinks=False)
            if not n.startswith("user.ckpt.")}


class LinkCase(CkptfsTestCase):
    """Commit and remount helpers for the classes below."""

    def require(self, *tools):
        missing = [t for t in tools if not shutil.which(t)]
        if missing:
            self.skipTest(f"{', '.join(missing)} not installed")

    def commit_ok(self, name):
        try:
            commit(self.ck(name))
        except OSError as e:
            self.fail(f"commit of {name}: {e!r}; .status: {status(self.ck(name))!r}\n"
                      f"{self.daemon_log()[-3000:]}")
        self.assertEqual(state(self.ck(name)), "committed", status(self.ck(name)))

    def remount(self):
        self.assertEqual(self.mounts[-1].stop(), 0, "the daemon's exit code")
        self.mount()

    def committed_twice(self, name, check):
        """Commit NAME, check(), unmount, mount the same BACKING_DIR
        again, check() again (every check runs on both)."""
        self.commit_ok(name)
        with self.subTest(after="commit"):
            check()
        self.remount()
        self.assertEqual(state(self.ck(name)), "committed")
        with self.subTest(after="remount"):
            check()

    def run_ok(self, argv, **kw):
        r = run(argv, **kw)
        self.assertEqual(r.returncode, 0, f"{' '.join(argv)}: rc {r.returncode}\n"
                         f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r

    def entry_rows(self, name):
        """{path: (mode, target)} of the `entries` table of NAME's
        .metadata, read through the mount (bytes, whatever the column's
        type)."""
        db = self.ck(name, ".metadata")
        con = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
        try:
            con.text_factory = bytes
            cols = [r[1] for r in con.execute("pragma table_info(entries)")]
            self.assertIn(b"target", cols, "no target column in the entries table")
            rows = con.execute("select path, mode, target from entries").fetchall()
            items = {r[0] for r in con.execute("select path from blobs")}
            items |= {r[0] for r in con.execute("select path from tensors")}
        finally:
            con.close()
        self.entry_items = items  # the paths that are stored items
        return {p: (m, t if t is None or isinstance(t, bytes) else bytes(t))
                for p, m, t in rows}

    def assertRefused(self, errnos, fn, *args, **kw):
        call = f"{fn.__name__}{args!r}"
        call = call if len(call) < 300 else call[:300] + "...)"
        with self.assertRaises(OSError, msg=f"{call} was not refused") as cm:
            fn(*args, **kw)
        self.assertIn(cm.exception.errno, errnos,
                      f"{call}: {cm.exception!r}, expected one of "
                      f"{[errno.errorcode[e] for e in errnos]}")

    def assertLink(self, path, target):
        """path is a symbolic link to target (bytes), by lstat and readlink."""
        st = os.lstat(path)
        self.assertTrue(stat.S_ISLNK(st.st_mode), f"{path}: mode {st.st_mode:o}, not a symlink")
        self.assertEqual(os.readlink(os.fsencode(path)), target, path)
        self.assertEqual(st.st_size, len(target), f"{path}: st_size")

    def assertSameFile(self, a, b, nlink=2):
        sa, sb = os.stat(a), os.stat(b)
        self.assertEqual(sa.st_ino, sb.st_ino, f"{a} and {b}: two inodes")
        self.assertEqual(sa.st_nlink, nlink, f"{a}: st_nlink")
        self.assertEqual(sb.st_nlink, nlink, f"{b}: st_nlink")
        self.assertEqual(read_all(a), read_all(b))


# ---- symbolic links ----------------------------------------------------------

class Symlinks(LinkCase):

    def test_symlink_calls(self):
        """Every kind of target kept as written; lstat, readlink, the owner;
        relative links inside the mount followed by the kernel; committed:
        the same, read-only, an entries row each, nothing followed."""
        self.mount()
        os.makedirs(self.ck("s", "sub"))
        write_file(self.ck("s", "f"), b"hello")
        write_file(self.ck("s", "sub", "g"), b"in sub")
        outside = os.path.join(self.dir, "outside.bin")
        write_file(outside, os.urandom(256 * KiB))  # must never be stored
        links = {
            "rel": b"f",
            "into": b"sub/g",
            "sub/up": b"../f",
            "sub/dir": b"..",
            "abs": os.fsencode(outside),
            "escape": b"../../../../../../etc/passwd",
            "dangling": b"no/such/file",
            "loop": b"loop",
            "odd": "a b=c;d ä".encode() + b"\xff\x01",
            "long": b"x/" * 2047 + b"y",            # 4095 bytes, the most there is
        }
        self.assertEqual(len(links["long"]), 4095)
        for rel, target in links.items():
            os.symlink(target, os.fsencode(self.ck("s", rel)))
        # one made and removed while staged: not committed
        os.symlink(b"f", self.ck("s", "gone"))
        os.unlink(self.ck("s", "gone"))
        self.assertFalse(os.path.lexists(self.ck("s", "gone")))

        def check(committed):
            for rel, target in links.items():
                p = self.ck("s", rel)
                self.assertLink(p, target)
                st = os.lstat(p)
                self.assertEqual((st.st_uid, st.st_gid), (os.getuid(), os.getgid()), p)
            kinds = {e.name: e.is_symlink() for e in os.scandir(self.ck("s"))}
            self.assertTrue(all(kinds[r] for r in links if "/" not in r), kinds)
            self.assertFalse(kinds["f"])
            # the kernel follows relative links inside the mount
            self.assertEqual(read_all(self.ck("s", "rel")), b"hello")
            self.assertEqual(read_all(self.ck("s", "into")), b"in sub")
            self.assertEqual(read_all(self.ck("s", "sub", "up")), b"hello")
            self.assertTrue(os.path.isdir(self.ck("s", "sub", "dir")))
            self.assertEqual(read_all(self.ck("s", "sub", "dir", "f")), b"hello")
            with self.assertRaises(FileNotFoundError):
                os.stat(self.ck("s", "dangling"))
            with self.assertRaises(OSError) as cm:
                os.stat(self.ck("s", "loop"))
            self.assertEqual(cm.exception.errno, errno.ELOOP)
            if not committed:
                return
            self.assertRefused(REFUSED, os.symlink, "f", self.ck("s", "new"))
            self.assertRefused(REFUSED, os.symlink, "../f", self.ck("s", "sub", "new"))
            self.assertFalse(os.path.lexists(self.ck("s", "gone")))
            rows = self.entry_rows("s")
            for rel, target in links.items():
                self.assertIn(rel.encode(), rows, f"no entries row for {rel}")
                mode, tgt = rows[rel.encode()]
                self.assertEqual(mode, S_IFLNK_0777, f"{rel}: entries.mode {mode:o}")
                self.assertEqual(tgt, target, f"{rel}: entries.target")
            self.assertNotIn(b"gone", rows)
            # nothing a link points to was stored (the daemon follows none)
            self.assertEqual(self.entry_items, {b"f", b"sub/g"})
            data = sum(os.path.getsize(p) for p in glob.glob(self.bk("s", "__*_*.distcp")))
            self.assertLess(data, 64 * KiB, "the daemon stored what a link points to")

        check(False)
        self.committed_twice("s", lambda: check(True))

    def test_git_clone(self):
        """git clone of a repository with symlinks: they are symlinks
        (git's core.symlinks is not false), also committed; git status
        finds nothing changed where it can run on the read-only copy."""
        self.require("git")
        src = os.path.join(self.dir, "src")
        os.makedirs(os.path.join(src, "sub"))
        write_file(os.path.join(src, "file.txt"), b"top file\n")
        write_file(os.path.join(src, "sub", "data.bin"), bytes(range(256)) * 4)
        os.symlink("file.txt", os.path.join(src, "link"))
        os.symlink("sub/data.bin", os.path.join(src, "into-sub"))
        os.symlink("../file.txt", os.path.join(src, "sub", "up"))
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com",
               "-c", "init.defaultBranch=main"]
        self.run_ok(git + ["init", "-q", src])
        self.run_ok(git + ["-C", src, "add", "-A"])
        self.run_ok(git + ["-C", src, "commit", "-q", "-m", "links"])
        want = {"link": b"file.txt", "into-sub": b"sub/data.bin", "sub/up": b"../file.txt"}

        self.mount()
        os.mkdir(self.ck("g"))
        repo = self.ck("g", "repo")
        self.run_ok(git + ["clone", "-q", src, repo])
        cfg = run(["git", "-C", repo, "config", "core.symlinks"])
        self.assertNotEqual(cfg.stdout.strip(), "false",
                            "git found that the mount cannot hold symlinks")

        def check():
            for rel, target in want.items():
                self.assertLink(os.path.join(repo, rel), target)
            self.assertEqual(read_all(os.path.join(repo, "link")), b"top file\n")
            self.assertEqual(read_all(os.path.join(repo, "sub", "up")), b"top file\n")
            self.assertEqual(read_all(os.path.join(repo, "into-sub")), bytes(range(256)) * 4)

        check()
        r = run(["git", "-C", repo, "status", "--porcelain"])
        self.assertEqual((r.returncode, r.stdout), (0, ""), r.stderr)

        def check_committed():
            check()
            # git status reads only with GIT_OPTIONAL_LOCKS=0; where it
            # still has to write (an older git), that part is left out
            r = run(["git", "-c", f"safe.directory={repo}", "-C", repo, "status",
                     "--porcelain"], env=dict(os.environ, GIT_OPTIONAL_LOCKS="0"))
            if r.returncode == 0:
                self.assertEqual(r.stdout, "", "git status on the committed clone")

        self.committed_twice("g", check_committed)

    def test_unzip(self):
        """unzip of an archive made with zip -y (symlinks stored as
        links): rc 0, no "symlink error", the links there, committed too."""
        self.require("zip", "unzip")
        src = os.path.join(self.dir, "src")
        os.makedirs(os.path.join(src, "sub"))
        write_file(os.path.join(src, "a.txt"), b"a\n" * 100)
        write_file(os.path.join(src, "sub", "b.txt"), b"b\n" * 100)
        os.symlink("a.txt", os.path.join(src, "la"))
        os.symlink("../a.txt", os.path.join(src, "sub", "lb"))
        os.symlink("nowhere", os.path.join(src, "dangling"))
        archive = os.path.join(self.dir, "a.zip")
        self.run_ok(["zip", "-qry", archive, "."], cwd=src)

        self.mount()
        os.mkdir(self.ck("z"))
        out = self.ck("z", "u")
        r = self.run_ok(["unzip", "-q", archive, "-d", out])
        self.assertNotIn("symlink error", r.stdout + r.stderr)
        want = tree_of(src)
        self.assertEqual(tree_of(out), want)
        self.committed_twice("z", lambda: (self.assertEqual(tree_of(out), want),
                                           self.assertEqual(read_all(os.path.join(out, "la")),
                                                            b"a\n" * 100)))

    def test_hugging_face_cache(self):
        """cp -a of a Hugging Face hub cache: snapshots/REV/FILE ->
        ../../blobs/SHA; committed, a file read through its snapshot link
        gives the blob's bytes."""
        hub = os.path.join(self.dir, "hub")
        model = os.path.join(hub, "models--org--name")
        rev = "0123456789abcdef0123456789abcdef01234567"
        files = {"config.json": b'{"model_type": "gpt2", "n_embd": 64}\n',
                 "model.safetensors": os.urandom(48 * KiB),
                 "tokenizer/vocab.txt": b"a\nb\nc\n"}
        for name, data in files.items():
            blob = sha(data)
            write_file(os.path.join(model, "blobs", blob), data)
            link = os.path.join(model, "snapshots", rev, name)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(os.path.relpath(os.path.join(model, "blobs", blob),
                                       os.path.dirname(link)), link)
        write_file(os.path.join(model, "refs", "main"), rev.encode())
        os.makedirs(os.path.join(hub, ".locks", "models--org--name"))

        self.mount()
        os.mkdir(self.ck("hf"))
        self.run_ok(["cp", "-a", hub, self.ck("hf")])
        want = tree_of(hub)
        snap = self.ck("hf", "hub", "models--org--name", "snapshots", rev)

        def check():
            self.assertEqual(tree_of(self.ck("hf", "hub")), want)
            self.assertLink(os.path.join(snap, "config.json"),
                            b"../../blobs/" + sha(files["config.json"]).encode())
            for name, data in files.items():
                self.assertEqual(read_all(os.path.join(snap, name)), data, name)

        check()
        self.committed_twice("hf", check)


# ---- hard links --------------------------------------------------------------

def make_linked_tree(root):
    """A tree with two hard-linked pairs (one across directories) and a
    plain file; {relative path: bytes}, the pairs."""
    os.makedirs(os.path.join(root, "sub"))
    big, small = os.urandom(256 * KiB), b"small file\n"
    write_file(os.path.join(root, "a"), big)
    os.link(os.path.join(root, "a"), os.path.join(root, "sub", "a2"))
    write_file(os.path.join(root, "b"), small)
    os.link(os.path.join(root, "b"), os.path.join(root, "b2"))
    write_file(os.path.join(root, "c"), b"alone")
    return [("a", "sub/a2"), ("b", "b2")]


class HardLinks(LinkCase):

    def test_link_calls(self):
        """link(2) inside one staged checkpoint; refused across
        checkpoints and into or out of a committed one; committed: one
        inode, nlink 2, the bytes stored once."""
        self.mount()
        for d in ("h/d1", "h/d2", "h2"):
            os.makedirs(self.ck(*d.split("/")))
        data = os.urandom(8 * MiB)
        a, b = self.ck("h", "d1", "a"), self.ck("h", "d2", "b")
        write_file(a, data)
        os.link(a, b)
        self.assertSameFile(a, b)
        self.assertEqual(sha(read_all(b)), sha(data))
        # writes through one name are seen through the other
        s, t = self.ck("h", "s"), self.ck("h", "d2", "t")
        write_file(s, b"x" * 100)
        os.link(s, t)
        with open(t, "r+b") as f:
            f.write(b"Y")
        with open(s, "ab") as f:
            f.write(b"tail")
        self.assertEqual(read_all(s), b"Y" + b"x" * 99 + b"tail")
        self.assertEqual(read_all(t), read_all(s))
        self.assertEqual(os.stat(t).st_size, 104)
        # unlink of one name leaves the other
        os.unlink(s)
        self.assertEqual(os.stat(t).st_nlink, 1)
        self.assertEqual(read_all(t), b"Y" + b"x" * 99 + b"tail")
        # an existing name: EEXIST
        self.assertRefused((errno.EEXIST,), os.link, a, t)
        # across checkpoints
        write_file(self.ck("h2", "f"), b"other checkpoint")
        self.assertRefused(CROSS, os.link, a, self.ck("h2", "a"))
        self.assertRefused(CROSS, os.link, self.ck("h2", "f"), self.ck("h", "f"))

        def check():
            if not os.path.exists(self.ck("h2")):  # staged: gone with the remount
                os.mkdir(self.ck("h2"))
                write_file(self.ck("h2", "f"), b"other checkpoint")
            self.assertSameFile(a, b)
            self.assertEqual(sha(read_all(a)), sha(data))
            self.assertEqual(os.stat(t).st_nlink, 1)
            self.assertEqual(read_all(t), b"Y" + b"x" * 99 + b"tail")
            self.assertFalse(os.path.lexists(s))
            files = glob.glob(self.bk("h", "__*_*.distcp"))
            stored = sum(os.path.getsize(p) for p in files)
            self.assertGreaterEqual(stored, len(data), files)
            self.assertLess(stored, 1.5 * len(data), f"the linked file stored twice: {files}")
            # into and out of a committed checkpoint
            self.assertRefused(CROSS, os.link, a, self.ck("h2", "from-committed"))
            self.assertRefused(CROSS, os.link, self.ck("h2", "f"), self.ck("h", "into"))
            self.assertRefused(CROSS + REFUSED, os.link, a, self.ck("h", "d1", "again"))

        self.committed_twice("h", check)

    def test_remove_committed_names(self):
        """Inside a committed checkpoint: another name of a file goes alone
        (its row), for every mount; the first name, whose item holds the
        bytes, only after the others (EPERM, with a log line)."""
        self.mount()
        os.mkdir(self.ck("r"))
        data = os.urandom(4096)
        a, b, c = self.ck("r", "a"), self.ck("r", "b"), self.ck("r", "c")
        write_file(a, data)
        os.link(a, b)
        os.link(a, c)
        self.commit_ok("r")
        self.assertSameFile(a, c, nlink=3)
        self.assertRefused((errno.EPERM,), os.unlink, a)
        self.assertIn("remove the others first", self.daemon_log())
        os.unlink(b)
        self.assertFalse(os.path.lexists(b))
        self.assertSameFile(a, c)
        self.remount()
        self.assertEqual(sorted(os.listdir(self.ck("r"))), [".metadata", "a", "c"])
        self.assertSameFile(a, c)
        self.assertEqual(read_all(c), data)
        os.unlink(c)
        self.assertEqual(os.stat(a).st_nlink, 1)
        os.unlink(a)
        self.remount()
        self.assertEqual(os.listdir(self.ck("r")), [".metadata"])

    def _tool_copy(self, name, argv_of):
        """A tree with hard-linked pairs copied by argv_of(src, dest) into
        NAME: rc 0, the pairs one inode each, before and after commit."""
        src = os.path.join(self.dir, "src")
        pairs = make_linked_tree(src)
        want = tree_of(src)
        self.mount()
        os.mkdir(self.ck(name))
        dest = self.ck(name, "t")
        self.run_ok(argv_of(src, dest))

        def check():
            self.assertEqual(tree_of(dest), want)
            for x, y in pairs:
                self.assertSameFile(os.path.join(dest, x), os.path.join(dest, y))
            self.assertEqual(os.stat(os.path.join(dest, "c")).st_nlink, 1)

        check()
        self.committed_twice(name, check)

    def test_cp_a(self):
        self._tool_copy("cp", lambda src, dest: ["cp", "-a", src, dest])

    def test_tar_x(self):
        self.require("tar")
        archive = os.path.join(self.dir, "t.tar")

        def argv(src, dest):
            self.run_ok(["tar", "-cf", archive, "-C", src, "."])
            os.mkdir(dest)
            return ["tar", "-xf", archive, "-C", dest]

        self._tool_copy("tar", argv)

    def test_rsync_aH(self):
        self.require("rsync")
        self._tool_copy("rsync", lambda src, dest: ["rsync", "-aH", src + "/", dest + "/"])

    ZARR_WRITE = r'''
import hashlib, sys
import numpy as np, zarr
path, fmt = sys.argv[1], int(sys.argv[2])
g = zarr.open_group(path, mode="w", zarr_format=fmt)
g.attrs["step"] = 7
a = g.create_array("a/b", shape=(1000,), dtype="f4", chunks=(100,))
data = np.arange(1000, dtype="f4") * 0.5
a[:] = data
g.create_group("opt").create_array("m", shape=(4, 5), dtype="i8", chunks=(2, 5))[:] = \
    np.arange(20).reshape(4, 5)
back = zarr.open_group(path, mode="r")
assert np.array_equal(back["a/b"][:], data), "read back differs"
print(hashlib.sha256(data.tobytes()).hexdigest())
'''

    ZARR_READ = r'''
import hashlib, sys
import numpy as np, zarr
path, fmt = sys.argv[1], int(sys.argv[2])
g = zarr.open_group(path, mode="r", zarr_format=fmt)
assert g.attrs["step"] == 7, dict(g.attrs)
a = g["a/b"]
assert a.shape == (1000,) and a.dtype == np.dtype("f4"), (a.shape, a.dtype)
assert np.array_equal(g["opt/m"][:], np.arange(20).reshape(4, 5))
print(hashlib.sha256(a[:].tobytes()).hexdigest())
'''

    def _zarr(self, fmt):
        py = require_modules(self, "zarr", "numpy")
        self.mount()
        name = f"zarr{fmt}"
        os.mkdir(self.ck(name))
        path = self.ck(name, "z")
        digest = run_py(self, py, self.ZARR_WRITE, path, fmt, timeout=120).strip()
        self.committed_twice(name, lambda: self.assertEqual(
            run_py(self, py, self.ZARR_READ, path, fmt, timeout=120).strip(), digest))

    def test_zarr_v2(self):
        self._zarr(2)

    def test_zarr_v3(self):
        self._zarr(3)

    ATOMIC = r'''
import os, sys
from atomicwrites import atomic_write
path = sys.argv[1]
with atomic_write(path, mode="wb", overwrite=False) as f:
    f.write(b"state " * 1000)
try:
    with atomic_write(path, mode="wb", overwrite=False) as f:
        f.write(b"other")
except (FileExistsError, OSError) as e:
    assert getattr(e, "errno", None) == 17, repr(e)
else:
    sys.exit("atomic_write(overwrite=False) replaced an existing file")
print(sorted(os.listdir(os.path.dirname(path))))
'''

    def test_atomicwrites(self):
        """atomicwrites.atomic_write(overwrite=False): a temp file linked
        to its name (os.link) then unlinked; a second one gets EEXIST."""
        py = require_modules(self, "atomicwrites")
        self.mount()
        os.makedirs(self.ck("aw", "out"))
        path = self.ck("aw", "out", "state.bin")
        out = run_py(self, py, self.ATOMIC, path, timeout=60).strip()
        self.assertEqual(out, "['state.bin']", "temporary files left behind")

        def check():
            self.assertEqual(read_all(path), b"state " * 1000)
            self.assertEqual(os.stat(path).st_nlink, 1)
            self.assertEqual(os.listdir(self.ck("aw", "out")), ["state.bin"])

        self.committed_twice("aw", check)


# ---- other extended attributes ----------------------------------------------

BINARY = bytes(range(256)) + b"\0\0end"


class Xattrs(LinkCase):

    def test_xattr_calls(self):
        """user.* xattrs of staged files, a tensor and a directory: set,
        get, list, remove, flags, bounds, other namespaces refused;
        committed: the same values, read-only."""
        self.mount()
        os.makedirs(self.ck("x", "d"))
        f, d, t = self.ck("x", "f"), self.ck("x", "d"), self.ck("x", "t")
        write_file(f, b"a bytes item")
        write_file(t, bytes(16))
        os.setxattr(t, "user.ckpt.dtype", b"float32")
        os.setxattr(t, "user.ckpt.shape", b"2,2")
        want = {
            f: {"user.foo": b"bar", "user.bin": BINARY, "user.empty": b"",
                "user.mime_type": b"application/json",
                "user.big": os.urandom(32 * KiB)},
            d: {"user.dir": b"a directory's", "user.bin": BINARY},
            t: {"user.note": b"a tensor's"},
        }
        for path, attrs in want.items():
            for n, v in attrs.items():
                os.setxattr(path, n, v)
        # XATTR_CREATE, XATTR_REPLACE, replace, remove
        self.assertRefused((errno.EEXIST,), os.setxattr, f, "user.foo", b"x", os.XATTR_CREATE)
        self.assertRefused((errno.ENODATA,), os.setxattr, f, "user.nope", b"x",
                           os.XATTR_REPLACE)
        os.setxattr(f, "user.foo", b"first")
        os.setxattr(f, "user.foo", b"bar", os.XATTR_REPLACE)
        os.setxattr(f, "user.gone", b"soon")
        os.removexattr(f, "user.gone")
        self.assertRefused((errno.ENODATA,), os.getxattr, f, "user.gone")
        self.assertRefused((errno.ENODATA,), os.removexattr, f, "user.gone")
        # other namespaces
        for n in ("trusted.x", "security.x"):
            self.assertRefused(NOT_USER, os.setxattr, f, n, b"1")
        # bounds: a value over 64 KiB; a 65th name; names and values over 64 KiB
        n64, sized = self.ck("x", "n64"), self.ck("x", "sized")
        write_file(n64, b"1")
        write_file(sized, b"2")
        self.assertRefused((errno.E2BIG,), os.setxattr, sized, "user.huge", bytes(64 * KiB + 1))
        for i in range(64):
            os.setxattr(n64, f"user.n{i:02d}", str(i).encode())
        self.assertRefused((errno.ENOSPC,), os.setxattr, n64, "user.n64", b"64")
        os.setxattr(n64, "user.n00", b"replaced")  # a replace is no new name
        vals = {f"user.v{i}": os.urandom(16000) for i in range(4)}
        for n, v in vals.items():
            os.setxattr(sized, n, v)
        self.assertRefused((errno.ENOSPC,), os.setxattr, sized, "user.v4", os.urandom(16000))
        want[n64] = {f"user.n{i:02d}": str(i).encode() for i in range(64)}
        want[n64]["user.n00"] = b"replaced"
        want[sized] = vals

        def check(committed):
            for path, attrs in want.items():
                self.assertEqual(user_xattrs(path), attrs, path)
            self.assertEqual(os.getxattr(t, "user.ckpt.dtype"), b"float32")
            self.assertEqual(os.getxattr(f, "user.bin"), BINARY)
            self.assertRefused((errno.ENODATA,), os.getxattr, f, "user.gone")
            # getfattr, the tool, sees them too
            r = self.run_ok(["getfattr", "--only-values", "-n", "user.foo", f])
            self.assertEqual(r.stdout, "bar")
            if committed:
                for path in (f, d, t):
                    self.assertRefused(REFUSED, os.setxattr, path, "user.new", b"1")
                    self.assertRefused(REFUSED, os.setxattr, path,
                                       next(iter(want[path])), b"changed")
                    self.assertRefused(REFUSED, os.removexattr, path, next(iter(want[path])))
                self.assertEqual(user_xattrs(f), want[f])

        check(False)
        self.committed_twice("x", lambda: check(True))

    def _source(self):
        """A file and a directory with user.* xattrs, in the test's
        directory (ext4 or tmpfs: both keep user.*)."""
        self.require("setfattr", "getfattr")
        src = os.path.join(self.dir, "src")
        os.makedirs(os.path.join(src, "sub"))
        write_file(os.path.join(src, "weights.bin"), os.urandom(64 * KiB))
        write_file(os.path.join(src, "sub", "cfg.json"), b"{}")
        attrs = {"weights.bin": {"user.foo": b"bar", "user.bin": BINARY},
                 "sub": {"user.dir": b"yes"},
                 "sub/cfg.json": {"user.checksum": b"sha256:" + sha(b"{}").encode()}}
        try:
            for rel, a in attrs.items():
                for n, v in a.items():
                    os.setxattr(os.path.join(src, rel), n, v)
        except OSError as e:
            self.skipTest(f"{self.dir} keeps no user xattrs: {e}")
        return src, attrs

    def _check_attrs(self, dest, attrs):
        for rel, a in attrs.items():
            self.assertEqual(user_xattrs(os.path.join(dest, rel)), a, rel)
        r = self.run_ok(["getfattr", "--only-values", "-n", "user.foo",
                         os.path.join(dest, "weights.bin")])
        self.assertEqual(r.stdout, "bar")

    def test_cp_a(self):
        """cp -a keeps user.* xattrs (it drops what it cannot set without a
        word: checked with getfattr)."""
        src, attrs = self._source()
        self.mount()
        os.mkdir(self.ck("cp"))
        dest = self.ck("cp", "src")
        self.run_ok(["cp", "-a", src, self.ck("cp")])
        self._check_attrs(dest, attrs)
        self.committed_twice("cp", lambda: self._check_attrs(dest, attrs))

    def test_rsync_aX(self):
        self.require("rsync")
        src, attrs = self._source()
        self.mount()
        os.mkdir(self.ck("rs"))
        dest = self.ck("rs", "t")
        self.run_ok(["rsync", "-aX", src + "/", dest + "/"])
        self._check_attrs(dest, attrs)
        self.committed_twice("rs", lambda: self._check_attrs(dest, attrs))


# ---- all three --------------------------------------------------------------

class Combined(LinkCase):

    def test_rsync_aHX(self):
        """rsync -aHX of a tree with a symlink, a hard-linked pair and
        xattrs: rc 0, all of it after the commit and a remount."""
        self.require("rsync")
        src = os.path.join(self.dir, "src")
        pairs = make_linked_tree(src)
        os.symlink("a", os.path.join(src, "la"))
        os.symlink("../b", os.path.join(src, "sub", "lb"))
        try:
            os.setxattr(os.path.join(src, "a"), "user.origin", b"trainer")
            os.setxattr(os.path.join(src, "sub"), "user.dir", BINARY)
        except OSError as e:
            self.skipTest(f"{self.dir} keeps no user xattrs: {e}")
        want = tree_of(src)
        self.mount()
        os.mkdir(self.ck("all"))
        dest = self.ck("all", "t")
        self.run_ok(["rsync", "-aHX", src + "/", dest + "/"])

        def check():
            self.assertEqual(tree_of(dest), want)
            for x, y in pairs:
                self.assertSameFile(os.path.join(dest, x), os.path.join(dest, y))
            self.assertLink(os.path.join(dest, "la"), b"a")
            self.assertLink(os.path.join(dest, "sub", "lb"), b"../b")
            self.assertEqual(read_all(os.path.join(dest, "sub", "lb")), b"small file\n")
            self.assertEqual(user_xattrs(os.path.join(dest, "a")), {"user.origin": b"trainer"})
            # one inode: its other name has the same xattrs
            self.assertEqual(user_xattrs(os.path.join(dest, "sub", "a2")),
                             {"user.origin": b"trainer"})
            self.assertEqual(user_xattrs(os.path.join(dest, "sub")), {"user.dir": BINARY})

        check()
        self.committed_twice("all", check)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The life of checkpoints and of the daemon: async commit, removal (rm -r
of staged and committed checkpoints, unlink that only hides), remount and
the cleanup at mount start, options, SIGTERM, daemonizing, sync_files=0,
0-d and empty tensors, io_threads, many small files."""

import errno
import glob
import os
import shutil
import signal
import sqlite3
import subprocess
import time

from ckpttest import sanenv, util
from ckpttest.util import (CkptfsTestCase, commit, main, mountinfo_has, pread, read_all, state,
                           status, tensor_bytes, wait_state, write_file, write_tensor)

MiB = 1 << 20


class AsyncCommit(CkptfsTestCase):
    def test_async_commit(self):
        self.mount()
        os.mkdir(self.ck("a"))
        payload = os.urandom(MiB) * 64  # 64 MiB: the save takes a while
        write_tensor(self.ck("a", "big"), "float32", [4096, 4096], payload)
        write_file(self.ck("a", "cfg"), b"async")
        commit(self.ck("a"), "async")
        first = state(self.ck("a"))
        self.assertIn(first, ("committing", "committed"))
        # the trainer goes on at once with the next checkpoint
        os.mkdir(self.ck("b"))
        nxt = write_tensor(self.ck("b", "next"), "int32", [128, 128], tensor_bytes("int32", [128, 128]))
        seen = {first}
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            st = status(self.ck("a"))
            line = st.split("\n")[0]
            seen.add(line)
            if line == "committing":
                self.assertRegex(st, r"\b\d+\b.*\b\d+\b")  # progress numbers
            if line != "committing":
                break
            time.sleep(0.005)
        self.assertEqual(state(self.ck("a")), "committed", status(self.ck("a")))
        self.assertLessEqual(seen, {"committing", "committed"})
        self.assertIn("committing", seen, "64 MiB committed before the async write returned")
        self.assertEqual(read_all(self.ck("a", "big")), payload)
        self.assertEqual(read_all(self.ck("a", "cfg")), b"async")
        self.assertEqual(read_all(self.ck("b", "next")), nxt)
        self.assertEqual(state(self.ck("b")), "staging")
        commit(self.ck("b"))
        self.assertEqual(read_all(self.ck("b", "next")), nxt)
        # sync: committed when the write returns
        os.mkdir(self.ck("c"))
        write_tensor(self.ck("c", "big"), "float32", [4096, 4096], payload)
        commit(self.ck("c"), "sync")
        self.assertEqual(state(self.ck("c")), "committed")
        self.assertEqual(read_all(self.ck("c", "big")), payload)

    def test_staged_files_frozen_while_committing(self):
        self.mount()
        os.mkdir(self.ck("f"))
        payload = os.urandom(MiB) * 64
        write_file(self.ck("f", "big"), payload)
        commit(self.ck("f"), "async")
        if state(self.ck("f")) == "committing":
            # while the save runs nothing of the checkpoint may change
            try:
                os.open(self.ck("f", "new"), os.O_WRONLY | os.O_CREAT, 0o644)
                self.fail("create during commit succeeded")
            except OSError as e:
                self.assertIn(e.errno, (errno.EBUSY, errno.EROFS))
        wait_state(self.ck("f"))
        self.assertEqual(state(self.ck("f")), "committed")
        self.assertEqual(read_all(self.ck("f", "big")), payload)
        self.assertEqual(sorted(os.listdir(self.ck("f"))), [".metadata", "big"])

    def test_async_failure(self):
        self.mount()
        os.mkdir(self.ck("bad"))
        write_tensor(self.ck("bad", "w"), "float64", [10], b"\0" * 79)
        commit(self.ck("bad"), b"async\n")  # the write itself succeeds
        st = wait_state(self.ck("bad"))
        self.assertEqual(st.split("\n")[0], "failed")
        self.assertIn("79", st)
        self.assertNothingPublished("bad")
        write_file(self.ck("bad", "w"), b"\0" * 80)
        commit(self.ck("bad"), "async")
        self.assertEqual(wait_state(self.ck("bad")).split("\n")[0], "committed")


class LookupsDuringCommit(CkptfsTestCase):
    def test_checkpoint_never_vanishes_while_it_commits(self):
        """Lookups racing an async commit: whether BACKING_DIR/NAME is
        committed is looked up before the tree is locked, so a lookup that
        looked just before the publish must not take the freshly committed
        checkpoint for one removed elsewhere (it vanished: ENOENT)."""
        import threading
        self.mount("sync_files=0")
        stop = threading.Event()
        lost = []
        current = [None]

        def hammer():
            while not stop.is_set():
                name = current[0]
                if name is None:
                    continue
                try:
                    os.stat(self.ck(name, ".status"))
                except FileNotFoundError:
                    if current[0] == name:
                        lost.append(name)
        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            for i in range(150):
                name = f"c{i}"
                os.mkdir(self.ck(name))
                write_file(self.ck(name, "f"), b"x" * 4096)
                current[0] = name
                commit(self.ck(name), "async")
                self.assertEqual(wait_state(self.ck(name)).split("\n")[0], "committed")
                current[0] = None
        finally:
            stop.set()
            for t in threads:
                t.join()
        self.assertEqual(lost, [], "checkpoints vanished from the mount while committing")


class Removal(CkptfsTestCase):
    def test_rm_staged(self):
        self.mount()
        os.makedirs(self.ck("s", "d/e"))
        write_file(self.ck("s", "d/e/f"), b"x" * 1000)
        shutil.rmtree(self.ck("s"))
        self.assertEqual(os.listdir(self.mnt), [])
        self.assertFalse(os.path.exists(self.bk("s")))
        os.mkdir(self.ck("s"))  # a new, empty one
        self.assertEqual(os.listdir(self.ck("s")), [])

    def test_rmdir_with_status_and_commit_open(self):
        """A staged checkpoint removed while its .status and .commit are
        open: fstat of .status and a write of .commit must not reach the
        freed directory (a heap-use-after-free CI's TSan run found, with
        fstat racing rm -r in test_stress)."""
        self.mount()
        os.mkdir(self.ck("s"))
        st = os.open(self.ck("s", ".status"), os.O_RDONLY)
        cm = os.open(self.ck("s", ".commit"), os.O_WRONLY)
        try:
            os.rmdir(self.ck("s"))
            self.assertEqual(os.fstat(st).st_size, len(b"staging\nfiles 0\nbytes 0\n"))
            self.assertErrno(errno.ENOENT, os.write, cm, b"sync")
            self.assertErrno(errno.ENOENT, os.write, cm, b"async")
        finally:
            os.close(st)
            os.close(cm)
        self.assertEqual(os.listdir(self.mnt), [])
        os.mkdir(self.ck("s"))  # the name is free again, and commits
        write_file(self.ck("s", "blob"), b"b")
        commit(self.ck("s"))
        self.assertEqual(read_all(self.ck("s", "blob")), b"b")
        self.assertEqual(self.mounts[0].stop(), 0)

    def test_rm_committed(self):
        self.mount()
        for n in ("keep", "x"):
            os.mkdir(self.ck(n))
            write_tensor(self.ck(n, "m/w"), "int64", [3], tensor_bytes("int64", [3]))
            write_file(self.ck(n, "blob"), b"b")
            commit(self.ck(n))
        shutil.rmtree(self.ck("x"))
        self.assertEqual(os.listdir(self.mnt), ["keep"])
        self.assertFalse(os.path.exists(self.bk("x")))
        self.assertEqual(read_all(self.ck("keep", "m/w")), tensor_bytes("int64", [3]))
        # the name can be used again
        os.mkdir(self.ck("x"))
        write_file(self.ck("x", "blob"), b"new")
        commit(self.ck("x"))
        self.assertEqual(read_all(self.ck("x", "blob")), b"new")
        self.assertFalse(os.path.exists(self.ck("x", "m")))
        # and a remount agrees
        self.assertEqual(self.mounts[0].stop(), 0)
        self.mount()
        self.assertEqual(sorted(os.listdir(self.mnt)), ["keep", "x"])
        self.assertEqual(read_all(self.ck("x", "blob")), b"new")

    def test_rmdir_nonempty_committed(self):
        self.mount()
        os.mkdir(self.ck("c"))
        write_file(self.ck("c", "f"), b"f")
        commit(self.ck("c"))
        self.assertErrno(errno.ENOTEMPTY, os.rmdir, self.ck("c"))
        self.assertTrue(os.path.exists(self.bk("c", ".metadata")))

    def test_removal_inside_committed_removes_that_entry_everywhere(self):
        """Removing an entry inside a committed checkpoint removes that
        entry only, for every mount (a new version of the checkpoint);
        unlinking its .metadata (what rm -r NAME does first) removes the
        checkpoint as a whole: gone for every mount, this mount keeps the
        rest so that rm -r finishes, and rmdir NAME removes the data."""
        self.mount()
        other = os.path.join(self.dir, "other")
        self.mount(mnt=other)
        os.mkdir(self.ck("h"))
        write_tensor(self.ck("h", "m/w"), "float32", [8], tensor_bytes("float32", [8]))
        write_file(self.ck("h", "m/b"), b"blob")
        write_file(self.ck("h", "top"), b"top")
        write_file(self.ck("h", "top2"), b"top2")
        commit(self.ck("h"))
        self.assertEqual(read_all(self.ck("h", "top", mnt=other)), b"top")
        os.unlink(self.ck("h", "m/w"))
        # that entry only, gone for every mount at once
        self.assertTrue(os.path.exists(self.bk("h", ".metadata")))
        self.assertErrno(errno.ENOENT, os.stat, self.ck("h", "m", "w", mnt=other))
        self.assertEqual(read_all(self.ck("h", "m", "b", mnt=other)), b"blob")
        self.assertEqual(sorted(os.listdir(self.ck("h"))), [".metadata", "m", "top", "top2"])
        self.assertEqual(status(self.ck("h")).splitlines()[:3],
                         ["committed", "tensors 0", "blobs 3"])
        self.assertEqual(status(self.ck("h", mnt=other)).splitlines()[:3],
                         ["committed", "tensors 0", "blobs 3"])
        self.assertNotIn("removing", status(self.ck("h")))
        os.unlink(self.ck("h", "m/b"))
        os.rmdir(self.ck("h", "m"))
        self.assertEqual(sorted(os.listdir(self.ck("h", mnt=other))), [".metadata", "top", "top2"])
        # .metadata: the checkpoint as a whole, for every mount, durably
        os.unlink(self.ck("h", ".metadata"))
        self.assertFalse(os.path.exists(self.bk("h", ".metadata")))
        self.assertErrno(errno.ENOENT, os.stat, self.ck("h", mnt=other))
        self.assertNotIn("h", os.listdir(other))
        # this mount: the rest stays for rm -r
        self.assertEqual(sorted(os.listdir(self.ck("h"))), ["top", "top2"])
        self.assertIn("\nremoving:", status(self.ck("h")))
        os.unlink(self.ck("h", "top"))
        os.unlink(self.ck("h", "top2"))
        os.rmdir(self.ck("h"))
        self.assertFalse(os.path.exists(self.bk("h")))
        self.assertNotIn("h", os.listdir(self.mnt))
        # rm -r of a committed checkpoint's subdirectory: that subtree only,
        # for every mount and after a remount
        os.mkdir(self.ck("g"))
        write_file(self.ck("g", "sub", "f"), b"f")
        write_file(self.ck("g", "k"), b"k")
        commit(self.ck("g"))
        subprocess.run(["rm", "-r", self.ck("g", "sub")], check=True)
        self.assertEqual(sorted(os.listdir(self.ck("g", mnt=other))), [".metadata", "k"])
        for m in self.mounts:
            self.assertEqual(m.stop(), 0)
        self.mounts.clear()
        self.mount()
        self.assertEqual(os.listdir(self.mnt), ["g"])
        self.assertEqual(sorted(os.listdir(self.ck("g"))), [".metadata", "k"])
        self.assertEqual(read_all(self.ck("g", "k")), b"k")

    def test_removed_through_backing_leaves_view(self):
        self.mount()
        os.mkdir(self.ck("gone"))
        write_file(self.ck("gone", "f"), b"f")
        commit(self.ck("gone"))
        # as another mount sharing BACKING would: .metadata first
        os.unlink(self.bk("gone", ".metadata"))
        shutil.rmtree(self.bk("gone"))
        self.assertNotIn("gone", os.listdir(self.mnt))
        os.mkdir(self.ck("gone"))
        self.assertEqual(state(self.ck("gone")), "staging")


class MountStart(CkptfsTestCase):
    def test_remount_shows_committed(self):
        self.mount()
        want = {}
        for i, n in enumerate(["one", "two", "three"]):
            os.mkdir(self.ck(n))
            want[n] = write_tensor(self.ck(n, "w"), "int16", [5, i + 1],
                                   tensor_bytes("int16", [5, i + 1], seed=i))
            commit(self.ck(n))
        os.mkdir(self.ck("staged-only"))
        write_file(self.ck("staged-only", "x"), b"lost at unmount")
        self.assertEqual(self.mounts[0].stop(), 0)
        self.mount()
        self.assertEqual(sorted(os.listdir(self.mnt)), ["one", "three", "two"])
        for n, data in want.items():
            self.assertEqual(state(self.ck(n)), "committed")
            self.assertEqual(read_all(self.ck(n, "w")), data)
        self.assertFalse(os.path.exists(self.bk("staged-only")))

    def test_cleanup_of_unfinished_saves(self):
        self.mount()
        os.mkdir(self.ck("done"))
        write_file(self.ck("done", "f"), b"done")
        commit(self.ck("done"))
        self.assertEqual(self.mounts[0].stop(), 0)
        # an unfinished save (no .metadata), spilled staging data and a
        # stale temporary metadata file of a committed checkpoint
        os.makedirs(self.bk("half"))
        write_file(self.bk("half", "__0_0.distcp"), b"\0" * 100)
        write_file(self.bk("half", ".metadata.tmp"), b"junk")
        os.makedirs(self.bk(".staging", "sub"))
        write_file(self.bk(".staging", "sub", "spill"), b"x")
        write_file(self.bk("done", ".metadata.tmp"), b"junk")
        self.mount()
        # removed before the mount is ready
        self.assertFalse(os.path.exists(self.bk("half")))
        self.assertFalse(os.path.exists(self.bk(".staging")))
        self.assertFalse(os.path.exists(self.bk("done", ".metadata.tmp")))
        self.assertEqual(os.listdir(self.mnt), ["done"])
        self.assertEqual(read_all(self.ck("done", "f")), b"done")
        os.mkdir(self.ck("half"))  # the name is free
        write_file(self.ck("half", "f"), b"new")
        commit(self.ck("half"))
        self.assertEqual(read_all(self.ck("half", "f")), b"new")

    def test_failed_load_leaves_no_empty_checkpoint(self):
        """A committed checkpoint whose reader cannot be set up at the
        mount's start is not shown (logged), and the next lookup loads it:
        it was left as an empty staging checkpoint of that name, hiding the
        committed one until the next mount."""
        self.mount()
        os.mkdir(self.ck("c"))
        write_file(self.ck("c", "blob"), b"data")
        commit(self.ck("c"))
        self.assertEqual(self.mounts[0].stop(), 0)
        self.mount(env={"CKPTFS_FAILPOINT": "reader_init=EIO"})
        self.assertIn("not showing checkpoint c", self.daemon_log())
        self.assertEqual(state(self.ck("c")), "committed")
        self.assertEqual(read_all(self.ck("c", "blob")), b"data")
        self.assertEqual(os.listdir(self.mnt), ["c"])

    def test_unrelated_files_in_backing_kept(self):
        os.makedirs(self.backing)
        write_file(self.bk("README"), b"not a checkpoint")
        self.mount()
        self.assertEqual(os.listdir(self.mnt), [])
        self.assertEqual(read_all(self.bk("README")), b"not a checkpoint")

    def test_backing_created(self):
        self.backing = os.path.join(self.dir, "new", "backing")
        os.makedirs(os.path.dirname(self.backing))
        self.mount()
        self.assertTrue(os.path.isdir(self.backing))


class Options(CkptfsTestCase):
    def run_bin(self, *args, timeout=60):
        return subprocess.run([util.BIN, *args], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def test_malformed_options(self):
        for bad in ["staging_mem=lots", "staging_mem=", "staging_mem=0", "staging_mem=12Q",
                    "io_threads=0", "io_threads=x", "io_threads=-1", "io_threads=100000",
                    "sync_files=2", "sync_files=yes", "replica_check=maybe",
                    "direct_reads=2", "direct_reads=", "readahead=2G", "readahead=x",
                    "verify=yes", "verify=",
                    "commit_timeout=-1", "commit_timeout=abc", "commit_timeout=0",
                    "no_such_option", "no_such_option=1"]:
            r = self.run_bin("-f", "-o", bad, self.backing, self.mnt)
            self.assertEqual(r.returncode, 2, f"-o {bad}: rc {r.returncode}\n{r.stderr}")
            self.assertTrue(r.stderr.strip(), f"-o {bad}: no message")
            key = bad.split("=")[0]
            self.assertIn(key, r.stderr, f"-o {bad}: the message does not name it")
            self.assertFalse(mountinfo_has(self.mnt), bad)
            self.assertIsNone(util.sanitizer_report(r.stderr), r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.mnt, "x")))

    def test_usage_errors(self):
        for args in [["-f"], ["-f", self.backing], ["-f", self.backing, self.mnt, "extra"]]:
            r = self.run_bin(*args)
            self.assertEqual(r.returncode, 2, f"{args}: {r.stderr}")
            self.assertTrue(r.stderr.strip())
            self.assertIsNone(util.sanitizer_report(r.stderr), r.stderr)
        r = self.run_bin("--help")
        self.assertEqual(r.returncode, 0)
        self.assertIn("staging_mem", r.stdout)
        r = self.run_bin("--version")
        self.assertEqual(r.returncode, 0)
        self.assertIn("ckptfs", r.stdout)

    def test_backing_not_creatable(self):
        bad = os.path.join(self.dir, "no", "such", "parent")
        r = self.run_bin("-f", bad, self.mnt)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(bad, r.stderr)
        self.assertFalse(mountinfo_has(self.mnt))

    def test_refused_mount_leaves_nothing(self):
        """A mount refused for a bad option or a missing MOUNTPOINT does not
        create BACKING_DIR; a BACKING_DIR whose parent is missing is an
        error (a typo), not an empty store; one created says so (issue 13)."""
        fresh = os.path.join(self.dir, "fresh-backing")
        r = self.run_bin("-f", "-o", "bogus_option=1", fresh, self.mnt)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertFalse(os.path.exists(fresh), "a refused option created BACKING_DIR")
        r = self.run_bin("-f", fresh, os.path.join(self.dir, "no-such-mountpoint"))
        self.assertNotEqual(r.returncode, 0)
        self.assertFalse(os.path.exists(fresh), "a missing MOUNTPOINT created BACKING_DIR")
        typo = os.path.join(self.dir, "no-such-parent", "backing")
        r = self.run_bin("-f", typo, self.mnt)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("parent directory does not exist", r.stderr)
        self.assertFalse(os.path.exists(os.path.dirname(typo)))
        self.assertFalse(mountinfo_has(self.mnt))

    def test_name_too_long(self):
        """Names over 255 bytes: ENAMETOOLONG in every call, not ENOENT."""
        self.mount()
        os.mkdir(self.ck("n"))
        long = "x" * 256
        for call in (lambda p: os.stat(p), lambda p: os.open(p, os.O_RDONLY),
                     lambda p: os.open(p, os.O_WRONLY | os.O_CREAT, 0o644),
                     lambda p: os.mkdir(p), lambda p: os.unlink(p), lambda p: os.rmdir(p),
                     lambda p: os.rename(self.ck("n"), p)):
            for where in (os.path.join(self.mnt, long), self.ck("n", long)):
                with self.assertRaises(OSError) as e:
                    call(where)
                self.assertEqual(e.exception.errno, errno.ENAMETOOLONG, where[-20:])

    def test_staged_ctime_moves_before_close(self):
        """A write into a staged file open for appending moves its mtime
        and ctime at once, before the file is closed (written by FUSE
        passthrough, the write itself never reaches the daemon)."""
        self.mount()
        ck = self.ck("t")
        os.mkdir(ck)
        f = os.path.join(ck, "f")
        write_file(f, b"a" * (128 * 1024))  # passed through, not drained
        past = 1_000_000_000 * 10**9
        fd = os.open(f, os.O_WRONLY | os.O_APPEND)
        try:
            for k in range(5):
                os.utime(f, ns=(past, past))
                before = os.stat(f)
                os.write(fd, b"x")
                after = os.stat(f)
                self.assertGreater(after.st_mtime_ns, before.st_mtime_ns, k)
                self.assertGreater(after.st_ctime_ns, before.st_ctime_ns, k)
        finally:
            os.close(fd)

    def test_staged_times_and_links(self):
        """Staged files and directories keep POSIX times and link counts:
        a write, a truncate and O_TRUNC move mtime and ctime; entries
        created, removed or renamed move their directory's; atime can be
        set; a directory links 2 + its subdirectories; an open file that
        was unlinked has none (issue 13)."""
        self.mount()
        ck = self.ck("t")
        os.mkdir(ck)
        f = os.path.join(ck, "f")
        write_file(f, b"a")
        past = 1_000_000_000
        os.utime(f, ns=(past * 10**9, past * 10**9))
        st = os.stat(f)
        self.assertEqual((st.st_atime_ns, st.st_mtime_ns), (past * 10**9, past * 10**9))
        for i, change in enumerate((lambda: open(f, "ab").write(b"b"),
                                    lambda: os.truncate(f, 1),
                                    lambda: open(f, "wb").close(),
                                    lambda: os.pwrite(fd, b"x", 10))):
            os.utime(f, ns=(past * 10**9, past * 10**9))
            before = os.stat(f)
            fd = os.open(f, os.O_RDWR)
            try:
                change()
            finally:
                os.close(fd)
            after = os.stat(f)
            self.assertGreater(after.st_mtime_ns, before.st_mtime_ns, i)
            self.assertGreater(after.st_ctime_ns, before.st_ctime_ns, i)
            self.assertEqual(after.st_atime_ns, past * 10**9, i)
        os.utime(f, ns=(past * 10**9 + 5, os.stat(f).st_mtime_ns))  # touch -a
        self.assertEqual(os.stat(f).st_atime_ns, past * 10**9 + 5)
        d = os.path.join(ck, "d")
        for change, dirs in ((lambda: write_file(os.path.join(ck, "g"), b"g"), [ck]),
                             (lambda: os.mkdir(d), [ck]),
                             (lambda: os.rename(os.path.join(ck, "g"), os.path.join(d, "g")),
                              [ck, d]),
                             (lambda: os.unlink(os.path.join(d, "g")), [d]),
                             (lambda: os.rmdir(d), [ck])):
            for x in dirs:
                if os.path.exists(x):
                    os.utime(x, ns=(past * 10**9, past * 10**9))
            change()
            for x in dirs:
                self.assertGreater(os.stat(x).st_mtime_ns, past * 10**9, x)
                self.assertGreater(os.stat(x).st_ctime_ns, past * 10**9, x)
        self.assertEqual(os.stat(ck).st_nlink, 2)
        for d in ("d1", "d2", "d3"):
            os.mkdir(os.path.join(ck, d))
        os.mkdir(os.path.join(ck, "d1", "sub"))
        self.assertEqual(os.stat(ck).st_nlink, 5)
        self.assertEqual(os.stat(os.path.join(ck, "d1")).st_nlink, 3)
        self.assertEqual(os.stat(f).st_nlink, 1)
        fd = os.open(f, os.O_RDONLY)
        try:
            os.unlink(f)
            self.assertEqual(os.fstat(fd).st_nlink, 0)
        finally:
            os.close(fd)

    def test_good_options(self):
        self.mount("staging_mem=64M,commit_timeout=30,io_threads=2,sync_files=1,replica_check=warn,"
                   "allow_other,default_permissions")
        os.mkdir(self.ck("o"))
        write_file(self.ck("o", "f"), b"ok")
        commit(self.ck("o"))
        self.assertEqual(read_all(self.ck("o", "f")), b"ok")

    def test_sigterm(self):
        m = self.mount()
        os.mkdir(self.ck("s"))
        write_tensor(self.ck("s", "w"), "float32", [4], tensor_bytes("float32", [4]))
        commit(self.ck("s"))
        os.mkdir(self.ck("staged"))
        write_file(self.ck("staged", "f"), b"f")
        # files and directories still open when the daemon stops: the
        # kernel never releases them, the daemon must free them itself
        # (a leak report in the ASan build otherwise)
        held = [os.open(self.ck("staged", "f"), os.O_RDWR), os.open(self.ck("s", "w"), os.O_RDONLY),
                os.open(self.ck("s", ".metadata"), os.O_RDONLY),
                os.open(self.ck("s", ".status"), os.O_RDONLY),
                os.open(self.ck("s"), os.O_RDONLY | os.O_DIRECTORY)]
        os.read(held[1], 4)
        m.proc.send_signal(signal.SIGTERM)
        self.assertEqual(m.wait(60), 0, self.daemon_log())
        self.assertFalse(mountinfo_has(self.mnt), "still mounted after SIGTERM")
        for fd in held:
            try:
                os.close(fd)
            except OSError:
                pass
        self.assertTrue(os.path.exists(self.bk("s", ".metadata")))
        self.mount()
        self.assertEqual(os.listdir(self.mnt), ["s"])

    def test_sigterm_during_async_commit(self):
        m = self.mount()
        os.mkdir(self.ck("s"))
        payload = os.urandom(MiB) * 32
        write_file(self.ck("s", "big"), payload)
        commit(self.ck("s"), "async")
        m.proc.send_signal(signal.SIGTERM)
        self.assertEqual(m.wait(120), 0, self.daemon_log())
        self.assertFalse(mountinfo_has(self.mnt))
        # the save in flight finished (or left nothing half-visible)
        self.mount()
        if os.path.exists(self.bk("s", ".metadata")):
            self.assertEqual(read_all(self.ck("s", "big")), payload)
        else:
            self.assertNotIn("s", os.listdir(self.mnt))
            self.assertFalse(os.path.exists(self.bk("s")))

    def test_unmount_exit_code(self):
        m = self.mount()
        self.assertEqual(m.stop(), 0, self.daemon_log())
        self.assertFalse(mountinfo_has(self.mnt))

    def background_env(self):
        """The environment of a daemonized mount: its stderr goes to
        /dev/null, so sanitizer reports go to files (checked in cleanup)."""
        asan_log = os.path.join(self.dir, "asan")
        self.addCleanup(lambda: self.extra_logs.extend(glob.glob(asan_log + "*")))
        return sanenv.env(log_path=asan_log)

    def test_daemonize(self):
        m = util.Mount(self.backing, self.mnt, self.log, foreground=False)
        self.mounts.append(m)
        launcher = m.argv()
        t0 = time.monotonic()
        r = subprocess.run(launcher, capture_output=True, text=True, timeout=60,
                           env=self.background_env(), stdin=subprocess.DEVNULL)
        self.assertEqual(r.returncode, 0, r.stderr)
        # ready when the launching command returns
        self.assertTrue(mountinfo_has(self.mnt), "not mounted when the command returned")
        pid = util.find_daemon(self.mnt)
        self.assertIsNotNone(pid, "no daemon process")
        self.assertNotEqual(os.getsid(pid), os.getsid(0), "the daemon did not leave our session")
        os.mkdir(self.ck("bg"))
        write_file(self.ck("bg", "f"), b"background")
        commit(self.ck("bg"))
        self.assertEqual(read_all(self.ck("bg", "f")), b"background")
        r = subprocess.run(["fusermount3", "-u", self.mnt], capture_output=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(os.path.exists(f"/proc/{pid}"), "daemon still running after unmount")
        self.assertLess(time.monotonic() - t0, 60)
        self.assertTrue(os.path.exists(self.bk("bg", ".metadata")))

    def test_daemonized_log_file(self):
        """-o log=FILE on a daemonized mount (stderr is /dev/null there):
        a commit's outcome, a refused xattr (with the valid forms), a
        refused .commit word and a staged checkpoint discarded at unmount
        each leave a line (issue 13)."""
        logfile = os.path.join(self.dir, "daemon.log")
        r = subprocess.run([util.BIN, "-o", "log=" + logfile, self.backing, self.mnt],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                           env=self.background_env())
        self.assertEqual(r.returncode, 0, r.stderr)
        pid = util.find_daemon(self.mnt)
        self.assertIsNotNone(pid)
        os.mkdir(self.ck("good"))
        write_file(self.ck("good", "f"), b"x" * 100)
        commit(self.ck("good"))
        os.mkdir(self.ck("bad"))
        write_file(self.ck("bad", "w"), b"\0" * 16)
        with self.assertRaises(OSError) as e:
            os.setxattr(self.ck("bad", "w"), "user.ckpt.dtype", b"float33")
        self.assertEqual(e.exception.errno, errno.EINVAL)
        with self.assertRaises(OSError):
            os.setxattr(self.ck("bad", "w"), "user.ckpt.shape", b"4,x")
        fd = os.open(self.ck("bad", ".commit"), os.O_WRONLY)
        try:
            with self.assertRaises(OSError):
                os.write(fd, b"commit please")
        finally:
            os.close(fd)
        os.setxattr(self.ck("bad", "w"), "user.ckpt.dtype", b"float32")
        os.setxattr(self.ck("bad", "w"), "user.ckpt.shape", b"8")  # 32 bytes, 16 written
        with self.assertRaises(OSError) as e:
            commit(self.ck("bad"))
        self.assertEqual(e.exception.errno, errno.EIO)
        os.mkdir(self.ck("left"))
        write_file(self.ck("left", "f"), b"never committed")
        r = subprocess.run(["fusermount3", "-u", self.mnt], capture_output=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(logfile) as f:
            log = f.read()
        self.assertRegex(log, r"(?m)^\d{4}-\d\d-\d\dT[\d:.]+Z ckptfs\[\d+\] rank 0: good: committed")
        self.assertRegex(log, r'bad/w: refused user.ckpt.dtype="float33": valid: .*bfloat16.*float32')
        self.assertRegex(log, r'bad/w: refused user.ckpt.shape="4,x": valid: comma-separated')
        self.assertRegex(log, r'bad/.commit: refused .*"commit please".*"sync" or "async"')
        self.assertRegex(log, r"bad: commit failed: .*w")
        self.assertRegex(log, r"unmounted with checkpoint left staged but not committed")
        self.assertRegex(log, r"warning: unmounted with checkpoint bad staged but not committed "
                              r"\(\d+ files?, \d+ bytes\) \(its last commit failed\)")

    def test_fallocate_staged_file(self):
        """fallocate(2) on a staged file, each mode with its effect on the
        stored bytes: 0 extends with zeros, KEEP_SIZE changes nothing,
        PUNCH_HOLE and ZERO_RANGE zero the range (the latter may extend);
        COLLAPSE_RANGE is refused; the commit stores the result (issue 13)."""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

        def falloc(fd, mode, off, length):
            if libc.fallocate(fd, mode, off, length) != 0:
                e = ctypes.get_errno()
                raise OSError(e, os.strerror(e))
        KEEP, PUNCH, COLLAPSE, ZERO = 0x01, 0x02, 0x08, 0x10
        self.mount()
        os.mkdir(self.ck("fa"))
        path = self.ck("fa", "f")
        data = bytearray(os.urandom(3 * MiB + 123))
        write_file(path, bytes(data))
        fd = os.open(path, os.O_RDWR)
        try:
            falloc(fd, 0, 0, 1000)                       # inside: nothing changes
            falloc(fd, KEEP, len(data), 5 * MiB)         # beyond, size kept
            self.assertEqual(os.fstat(fd).st_size, len(data))
            falloc(fd, PUNCH | KEEP, 100, 2 * MiB)       # across segments
            data[100:100 + 2 * MiB] = bytes(2 * MiB)
            falloc(fd, ZERO, len(data) - 10, 30)         # zeroes the tail, extends by 20
            data[len(data) - 10:] = bytes(10)
            data += bytes(20)
            falloc(fd, 0, len(data), 4096)               # extends with zeros
            data += bytes(4096)
            self.assertEqual(os.fstat(fd).st_size, len(data))
            with self.assertRaises(OSError) as e:
                falloc(fd, COLLAPSE, 0, 4096)
            self.assertEqual(e.exception.errno, errno.EOPNOTSUPP)
            with self.assertRaises(OSError) as e:
                falloc(fd, PUNCH, 0, 10)                 # PUNCH needs KEEP_SIZE
            self.assertEqual(e.exception.errno, errno.EOPNOTSUPP)  # the kernel's check
        finally:
            os.close(fd)
        self.assertEqual(read_all(path), bytes(data))
        commit(self.ck("fa"))
        self.assertEqual(read_all(path), bytes(data))

    def test_unsupported_nodes_say_eperm(self):
        """FIFOs, device nodes and sockets: EPERM (not supported by this
        filesystem), not ENOSYS; mknod of a regular file makes an empty
        staged file (issue 13). Links and symlinks are kept
        (test_links.py)."""
        import socket
        import stat as st
        self.mount()
        ck = self.ck("n")
        os.mkdir(ck)
        write_file(os.path.join(ck, "a"), b"a")
        for what, call in (("fifo", lambda: os.mkfifo(os.path.join(ck, "d"))),
                           ("chardev", lambda: os.mknod(os.path.join(ck, "e"), 0o600 | st.S_IFCHR,
                                                        os.makedev(1, 3))),
                           ("socket", lambda: socket.socket(socket.AF_UNIX).bind(os.path.join(ck, "f")))):
            with self.assertRaises(OSError, msg=what) as e:
                call()
            self.assertEqual(e.exception.errno, errno.EPERM, what)
        os.mknod(os.path.join(ck, "reg"), 0o640 | st.S_IFREG)
        self.assertEqual(oct(os.stat(os.path.join(ck, "reg")).st_mode), oct(0o100640))
        with open(os.path.join(ck, "reg"), "ab") as f:
            f.write(b"r")
        commit(ck)
        self.assertEqual(sorted(os.listdir(ck)), [".metadata", "a", "reg"])
        self.assertEqual(read_all(os.path.join(ck, "reg")), b"r")

    def test_mmap_of_committed_tensor(self):
        """The README's np.memmap(mode="c"): a private mapping of a committed
        tensor reads its bytes with the default direct_reads=1; a shared
        one works where libfuse has FUSE_CAP_DIRECT_IO_ALLOW_MMAP, else it
        fails ENODEV (issue 13)."""
        import mmap
        self.mount()
        os.mkdir(self.ck("mm"))
        data = os.urandom(3 * 4096 + 100)
        write_file(self.ck("mm", "t"), data)
        commit(self.ck("mm"))
        fd = os.open(self.ck("mm", "t"), os.O_RDONLY)
        try:
            m = mmap.mmap(fd, len(data), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
            self.assertEqual(m[:], data)
            m.close()
            try:
                m = mmap.mmap(fd, len(data), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            except OSError as e:
                self.assertEqual(e.errno, errno.ENODEV)
            else:
                self.assertEqual(m[:], data)
                m.close()
        finally:
            os.close(fd)

    def test_daemonize_relative_paths(self):
        # relative BACKING_DIR and MOUNTPOINT, daemon stopped by SIGTERM
        cwd = os.getcwd()
        os.chdir(self.dir)
        try:
            r = subprocess.run([util.BIN, "backing", "mnt"], capture_output=True,
                               text=True, timeout=60, stdin=subprocess.DEVNULL,
                               env=self.background_env())
        finally:
            os.chdir(cwd)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(mountinfo_has(self.mnt))
        pid = util.find_daemon("mnt")
        self.assertIsNotNone(pid)
        os.mkdir(self.ck("rel"))
        write_file(self.ck("rel", "f"), b"rel")
        commit(self.ck("rel"))
        self.assertTrue(os.path.exists(self.bk("rel", ".metadata")))
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(os.path.exists(f"/proc/{pid}"))
        self.assertFalse(mountinfo_has(self.mnt), "SIGTERM left the mount behind")


class Shapes(CkptfsTestCase):
    def test_zero_d_and_empty_tensors(self):
        self.mount("sync_files=0")
        os.mkdir(self.ck("z"))
        scalar = tensor_bytes("float64", [1], seed=5)
        write_tensor(self.ck("z", "scalar_csv"), "float64", b"", scalar)
        write_tensor(self.ck("z", "scalar_json"), "int32", b"[]", tensor_bytes("int32", [1]))
        write_tensor(self.ck("z", "empty"), "float32", [0, 4], b"")
        write_tensor(self.ck("z", "empty2"), "bfloat16", b"[3, 0, 2]", b"")
        write_file(self.ck("z", "emptyblob"), b"")
        commit(self.ck("z"))
        self.assertEqual(read_all(self.ck("z", "scalar_csv")), scalar)
        self.assertEqual(os.stat(self.ck("z", "scalar_csv")).st_size, 8)
        self.assertEqual(os.getxattr(self.ck("z", "scalar_csv"), "user.ckpt.shape"), b"")
        self.assertEqual(read_all(self.ck("z", "scalar_json")), tensor_bytes("int32", [1]))
        self.assertEqual(read_all(self.ck("z", "empty")), b"")
        self.assertEqual(os.stat(self.ck("z", "empty")).st_size, 0)
        self.assertEqual(os.getxattr(self.ck("z", "empty"), "user.ckpt.shape"), b"0,4")
        self.assertEqual(os.getxattr(self.ck("z", "empty2"), "user.ckpt.shape"), b"3,0,2")
        self.assertEqual(os.getxattr(self.ck("z", "empty2"), "user.ckpt.dtype"), b"bfloat16")
        self.assertEqual(read_all(self.ck("z", "emptyblob")), b"")
        self.assertEqual(pread(self.ck("z", "scalar_csv"), 100, 3), scalar[3:])
        con = sqlite3.connect(f"file:{self.ck('z', '.metadata')}?mode=ro", uri=True)
        try:
            shapes = dict(con.execute("select fqn, shape from tensors"))
            self.assertEqual(shapes, {"scalar_csv": "[]", "scalar_json": "[]", "empty": "[0,4]",
                                      "empty2": "[3,0,2]"})
        finally:
            con.close()
        # the wrong length for a scalar fails
        os.mkdir(self.ck("z2"))
        write_tensor(self.ck("z2", "s"), "float64", b"", b"\0" * 16)
        self.assertErrno(errno.EIO, commit, self.ck("z2"))
        self.assertIn("16", status(self.ck("z2")))
        self.assertEqual(self.mounts[0].stop(), 0)

    def test_empty_checkpoint(self):
        self.mount()
        os.mkdir(self.ck("nothing"))
        commit(self.ck("nothing"))
        self.assertEqual(state(self.ck("nothing")), "committed")
        self.assertEqual(os.listdir(self.ck("nothing")), [".metadata"])
        self.assertTrue(os.path.exists(self.bk("nothing", ".metadata")))

    def test_explicit_offsets_and_sizes(self):
        # a chunk with explicit all-zero offsets and the full sizes
        self.mount()
        os.mkdir(self.ck("sh"))
        data = tensor_bytes("uint8", [3, 5])
        write_tensor(self.ck("sh", "w"), "uint8", [3, 5], data, offsets=[0, 0], sizes=[3, 5])
        commit(self.ck("sh"))
        self.assertEqual(read_all(self.ck("sh", "w")), data)


class IoThreads(CkptfsTestCase):
    def test_io_threads_3(self):
        self.mount("io_threads=3")
        os.mkdir(self.ck("io"))
        want = {}
        for i in range(60):
            shape = [(i * 7) % 50 + 1, 33]
            dtype = ["float32", "int8", "float64", "bfloat16"][i % 4]
            want[f"l{i // 10}/t{i:02d}"] = write_tensor(
                self.ck("io", f"l{i // 10}/t{i:02d}"), dtype, shape,
                tensor_bytes(dtype, shape, seed=i))
        for i in range(7):
            want[f"blobs/b{i}"] = os.urandom(1000 * i + 1)
            write_file(self.ck("io", f"blobs/b{i}"), want[f"blobs/b{i}"])
        commit(self.ck("io"))
        files = sorted(f for f in os.listdir(self.bk("io")) if f.endswith(".distcp"))
        self.assertGreaterEqual(len(files), 1)
        self.assertLessEqual(len(files), 3, files)
        for f in files:
            self.assertRegex(f, r"^__0_[0-2]\.distcp$")
        self.assertGreater(len(files), 1, "60 tensors in one data file with io_threads=3")
        total = sum(os.stat(self.bk("io", f)).st_size for f in files)
        self.assertGreaterEqual(total, sum(len(v) for v in want.values()))
        for path, data in want.items():
            self.assertEqual(read_all(self.ck("io", path)), data, path)
        con = sqlite3.connect(f"file:{self.ck('io', '.metadata')}?mode=ro", uri=True)
        try:
            used = {r[0] for r in con.execute("select file from chunks union select file from blobs")}
        finally:
            con.close()
        self.assertEqual(used, set(files))

    def test_io_threads_1(self):
        self.mount("io_threads=1")
        os.mkdir(self.ck("one"))
        for i in range(10):
            write_file(self.ck("one", f"b{i}"), bytes([i]) * 5000)
        commit(self.ck("one"))
        self.assertEqual(sorted(f for f in os.listdir(self.bk("one")) if f.endswith(".distcp")),
                         ["__0_0.distcp"])
        for i in range(10):
            self.assertEqual(read_all(self.ck("one", f"b{i}")), bytes([i]) * 5000)

    def test_many_small_files(self):
        self.mount("sync_files=0")
        os.mkdir(self.ck("many"))
        n = 2000
        for i in range(n):
            d = self.ck("many", f"d{i % 20}")
            if i < 20:
                os.mkdir(d)
            if i % 2:
                write_tensor(os.path.join(d, f"t{i}"), "int32", [3], tensor_bytes("int32", [3], seed=i))
            else:
                write_file(os.path.join(d, f"b{i}"), f"blob {i}".encode())
        commit(self.ck("many"))
        self.assertEqual(state(self.ck("many")), "committed")
        con = sqlite3.connect(f"file:{self.ck('many', '.metadata')}?mode=ro", uri=True)
        try:
            self.assertEqual(con.execute("select count(*) from tensors").fetchone()[0], n // 2)
            self.assertEqual(con.execute("select count(*) from blobs").fetchone()[0], n // 2)
        finally:
            con.close()
        for i in range(n):
            d = self.ck("many", f"d{i % 20}")
            if i % 2:
                self.assertEqual(read_all(os.path.join(d, f"t{i}")), tensor_bytes("int32", [3], seed=i))
            else:
                self.assertEqual(read_all(os.path.join(d, f"b{i}")), f"blob {i}".encode())
        self.assertEqual(sum(len(os.listdir(self.ck("many", f"d{k}"))) for k in range(20)), n)
        self.assertEqual(self.mounts[0].stop(), 0)
        self.mount()
        self.assertEqual(read_all(self.ck("many", "d7/t1987")), tensor_bytes("int32", [3], seed=1987))


if __name__ == "__main__":
    main()

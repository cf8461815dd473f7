#!/usr/bin/env python3
"""The daemon's own paths under BACKING_DIR (.staging, its kept links)
against a user who can write BACKING_DIR, and against other mounts of it
(issue 23, cases 2 and 8).

    python3 tests/integration/test_backing_paths.py --bin build/bin/ckptfs [Class ...]

Classes:
  StagingSymlink   .staging replaced by a symlink to a directory elsewhere
                   after the mount started: the spill file and the
                   write-behind streams of a file larger than staging_mem
                   are never created there (no daemon descriptor resolves
                   into it, nothing is named there); the refusal is logged
                   and the commit succeeds, bit-exact. The same with a
                   failed commit's streams kept aside for its retry
  KeptLinksSurvive A commit that failed with ENOSPC keeps its streams aside
                   in .staging; another mount of the same BACKING_DIR that
                   starts and stops meanwhile leaves them: once the space
                   is freed the retry commits (no second copy of the
                   streams needed), bit-exact
Needs root (tmpfs mounts, a directory in /dev/shm). Python standard library
only.
"""

import errno
import os
import shutil
import subprocess
import tempfile

from ckpttest import util as cu
from ckpttest.util import CkptfsTestCase, commit, read_all, status, write_file, write_tensor

MiB = 1 << 20


def run(*argv):
    return subprocess.run(list(argv), capture_output=True, text=True)


def fds_into(pid, where):
    """The targets of pid's descriptors that lie in directory where."""
    out = []
    fds = os.path.join("/proc", str(pid), "fd")
    for fd in os.listdir(fds):
        try:
            target = os.readlink(os.path.join(fds, fd))
        except OSError:
            continue
        if target == where or target.startswith(where + "/"):
            out.append(target)
    return out


def sizes_of(pid, where):
    """{target: size} of pid's descriptors of files in directory where."""
    out = {}
    fds = os.path.join("/proc", str(pid), "fd")
    for fd in os.listdir(fds):
        try:
            target = os.readlink(os.path.join(fds, fd))
            if target.startswith(where + "/"):
                out[target] = os.stat(os.path.join(fds, fd)).st_size
        except OSError:
            continue
    return out


class BackingCase(CkptfsTestCase):

    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest("needs root (tmpfs mounts, the daemon as root)")
        super().setUp()

    def assertReadsBack(self, name, data):
        for path, want in data.items():
            got = read_all(self.ck(name, path))
            self.assertTrue(got == want, f"{name}/{path}: {len(got)} bytes, "
                            f"expected {len(want)}, differ")


# ---- 2. .staging replaced by a symlink -----------------------------------------

class StagingSymlink(BackingCase):

    def test_spill_and_streams_never_leave_backing(self):
        """Through the daemon (-o passthrough=0): a write-behind stream and
        the spill file."""
        self.never_leave("passthrough=0", [64 * MiB, 8 * MiB])

    def test_passthrough_files_never_leave_backing(self):
        """By default (FUSE passthrough where available): each file's own
        backing file; the write-behind stream and spill file elsewhere."""
        self.never_leave("", None)

    def never_leave(self, opts, sizes):
        # elsewhere: another filesystem (a commit linking from there fails
        # with EXDEV), where an attacker would want the daemon's bytes
        outside = tempfile.mkdtemp(prefix="ckptfs-outside-", dir="/dev/shm")
        self.addCleanup(shutil.rmtree, outside, ignore_errors=True)
        m = self.mount("staging_mem=16M,io_threads=2" + ("," + opts if opts else ""))
        os.mkdir(self.ck("s"))
        write_file(self.ck("s", "warm"), os.urandom(4096))  # mount is serving
        # the attack, after the mount started (its start-up cleanup is past)
        if os.path.isdir(self.bk(".staging")) and not os.path.islink(self.bk(".staging")):
            os.rmdir(self.bk(".staging"))  # holds only unnamed files
        os.symlink(outside, self.bk(".staging"))
        data = {}
        # larger than staging_mem: streamed front to back, and spilled
        for k in range(2):
            data[f"t{k}"] = write_tensor(self.ck("s", f"t{k}"), "uint8", [32 * MiB],
                                         os.urandom(32 * MiB))
        # a file not written from offset 0 (a hole first) streams not: its
        # segments go to RAM, then to the spill file
        tail = os.urandom(24 * MiB)
        with open(self.ck("s", "spilled"), "wb") as f:
            f.seek(MiB)
            f.write(tail)
        data["spilled"] = bytes(MiB) + tail
        inside = sizes_of(m.proc.pid, self.bk(".staging"))
        escaped = fds_into(m.proc.pid, outside)
        named = os.listdir(outside)
        try:
            commit(self.ck("s"))
            err = None
        except OSError as e:
            err = f"{e!r}: {status(self.ck('s'))}"
        escaped += fds_into(m.proc.pid, outside)
        named += os.listdir(outside)
        self.assertEqual(escaped, [], "the daemon created files through the "
                         ".staging symlink, outside BACKING_DIR")
        self.assertEqual(named, [], "files named outside BACKING_DIR")
        if sizes:
            # in BACKING_DIR/.staging: the stream (the tensors were written
            # one after the other: one stream serves both) and the spill file
            self.assertEqual(len(inside), 2, inside)
            self.assertGreaterEqual(max(inside.values()), sizes[0], inside)
            self.assertGreaterEqual(min(inside.values()), sizes[1], inside)
        elif "passthrough: FUSE passthrough is not available" not in self.daemon_log():
            # each file in a backing file of its own there, as written
            self.assertEqual(sorted(inside.values()), [25 * MiB, 32 * MiB, 32 * MiB],
                             inside)
        self.assertIsNone(err, "the commit must succeed")
        self.assertEqual(status(self.ck("s")).split("\n")[0], "committed")
        data["warm"] = read_all(self.ck("s", "warm"))
        self.assertReadsBack("s", data)
        self.assertFalse(os.path.islink(self.bk(".staging")),
                         "the symlink is still there")
        self.assertIn(".staging is a symbolic link", self.daemon_log())
        self.assertEqual(m.stop(), 0)
        self.mount()
        self.assertReadsBack("s", data)

    def test_kept_streams_never_leave_backing(self):
        # a failed commit keeps its streams aside in .staging: with
        # .staging a symlink to a directory on the same filesystem (where a
        # rename through it would succeed), they must stay in BACKING_DIR
        outside = os.path.join(self.dir, "outside")
        os.mkdir(outside)
        self.mount("io_threads=2", env={"CKPTFS_FAILPOINT": "write_open=ENOSPC"})
        os.mkdir(self.ck("s"))
        data = {f"t{k}": write_tensor(self.ck("s", f"t{k}"), "uint8", [8 * MiB],
                                      os.urandom(8 * MiB)) for k in range(2)}
        if os.path.isdir(self.bk(".staging")) and not os.path.islink(self.bk(".staging")):
            os.rmdir(self.bk(".staging"))  # holds only unnamed files
        os.symlink(outside, self.bk(".staging"))
        with self.assertRaises(OSError, msg="the first data file open fails") as cm:
            commit(self.ck("s"))
        self.assertEqual(cm.exception.errno, errno.EIO)
        named = os.listdir(outside)
        try:
            commit(self.ck("s"))
            err = None
        except OSError as e:
            err = f"{e!r}: {status(self.ck('s'))}"
        self.assertEqual(named, [], "the failed commit kept its streams outside "
                         "BACKING_DIR")
        self.assertEqual(os.listdir(outside), [])
        self.assertIsNone(err, "the retry must commit")
        self.assertReadsBack("s", data)
        self.assertIn(".staging is a symbolic link", self.daemon_log())


# ---- 8. a starting mount and a live mount's kept links ---------------------------

class KeptLinksSurvive(BackingCase):

    def fill(self, path):
        """Write path until the filesystem is full."""
        chunk = b"\xa5" * MiB
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
        finally:
            os.close(fd)

    def kept(self):
        d = self.bk(".staging")
        return sorted(f for f in os.listdir(d) if f.startswith(".keep-")) \
            if os.path.isdir(d) else []

    def test_retry_after_another_mount_started(self):
        os.makedirs(self.backing)
        r = run("mount", "-t", "tmpfs", "-o", "size=200m", "ckptfs-keep", self.backing)
        if r.returncode:
            self.skipTest(f"cannot mount a tmpfs: {r.stderr.strip()}")
        self.addCleanup(run, "umount", "-l", self.backing)  # after the ckptfs mounts
        self.mount("io_threads=2")
        os.mkdir(self.ck("big"))
        data = {}
        for k in range(4):  # 120 MiB, streamed into .staging as written
            data[f"t{k}"] = write_tensor(self.ck("big", f"t{k}"), "uint8", [30 * MiB],
                                         os.urandom(30 * MiB))
        data["small"] = os.urandom(100)
        write_file(self.ck("big", "small"), data["small"])
        filler = self.bk("filler")  # not a checkpoint: no mount touches it
        self.fill(filler)
        with self.assertRaises(OSError, msg="a full backing filesystem") as cm:
            commit(self.ck("big"))
        self.assertEqual(cm.exception.errno, errno.EIO)
        st = status(self.ck("big"))
        self.assertEqual(st.split("\n")[0], "failed", st)
        self.assertIn(os.strerror(errno.ENOSPC), st)
        kept = self.kept()
        self.assertTrue(kept, "the failed commit kept no stream aside")
        os.unlink(filler)
        # another mount of the same BACKING_DIR starts (its cleanup) and stops
        mnt2 = os.path.join(self.dir, "mnt2")
        m2 = self.mount(mnt=mnt2)
        self.assertEqual(m2.stop(), 0)
        left = self.kept()
        try:
            commit(self.ck("big"))
            err = None
        except OSError as e:
            err = f"{e!r}: {status(self.ck('big'))}\n{run('df', '-h', self.backing).stdout}"
        self.assertIsNone(err, "after the space was freed the retry must commit")
        self.assertEqual(left, kept, "the second mount removed the live mount's kept links")
        self.assertEqual(status(self.ck("big")).split("\n")[0], "committed")
        self.assertReadsBack("big", data)
        self.assertEqual(self.kept(), [], "kept links left after the commit")

    def test_cleanup_removes_kept_links_of_a_gone_daemon(self):
        # a daemon that died left a kept link: nobody holds it, it goes
        os.makedirs(self.bk(".staging"))
        write_file(self.bk(".staging", ".keep-0123456789abcdef0123456789abcdef-0"),
                   b"x" * 4096)
        self.mount()
        self.assertFalse(os.path.exists(self.bk(".staging")),
                         os.listdir(self.bk(".staging")) if os.path.isdir(self.bk(".staging")) else "")


if __name__ == "__main__":
    cu.main()

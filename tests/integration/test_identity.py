#!/usr/bin/env python3
"""A checkpoint is known by its save, not by its directory's inode number.

    python3 tests/integration/test_identity.py --bin build/bin/ckptfs [Class ...]

Classes:
  InodeReuse  two mounts of one BACKING_DIR on a small ext4 image (64
              inodes, so that a new directory gets the inode number of one
              just removed): mount A removes checkpoint X and commits a new
              X of other files, sizes and bytes, several rounds. Mount B,
              which had X loaded, shows the new X within about a second
              (its listing, sizes and bytes), and a handle B opened on the
              old X before the removal never returns the new X's bytes (it
              reads the old bytes, or fails with EIO or ESTALE).
  ForeignSaveId  a checkpoint whose save ID is longer than ckptfs's 32
              hex digits (another tool wrote it) is shown and read like
              any other, by a mount that was running and by a new one.
Needs root (FUSE, a loop device). Python standard library only.
"""

import errno
import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import unittest

from ckpttest.util import CkptfsTestCase, commit, read_all

ROUNDS = 6


def have_loop():
    return (os.geteuid() == 0 and os.path.exists("/dev/loop-control") and
            shutil.which("mkfs.ext4") is not None)


def files_of(rnd):
    """The files of X in round rnd: names, sizes and bytes differ by round;
    one name ('w') is in every round, larger in the new X (rnd < 100) than
    in the one it replaces (100 + rnd), so that the old X's extent of it
    lies inside the new X's data."""
    fill = bytes([48 + rnd % 10] if rnd >= 100 else [65 + rnd % 26])
    out = {"w": fill * (2000 if rnd >= 100 else 5000 + 1000 * rnd)}
    out[f"only{rnd}"] = bytes([97 + rnd % 26]) * (500 + rnd)
    return out


@unittest.skipUnless(have_loop(), "needs root, loop devices and mkfs.ext4")
class InodeReuse(CkptfsTestCase):
    def setUp(self):
        super().setUp()
        img = os.path.join(self.dir, "img")
        self.fsdir = os.path.join(self.dir, "ext4")
        os.makedirs(self.fsdir)
        with open(img, "wb") as f:
            f.truncate(64 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-N", "64", img], check=True)
        subprocess.run(["mount", "-o", "loop", img, self.fsdir], check=True)
        self.addCleanup(self.unmount_image)
        self.backing = os.path.join(self.fsdir, "backing")
        self.fill = os.path.join(self.fsdir, "fill")

    def unmount_image(self):
        for m in self.mounts:  # the FUSE mounts first: they use the image
            m.stop()
        subprocess.run(["umount", self.fsdir], check=False)

    def stage(self, mnt, x, rnd):
        ck = self.ck(x, mnt=mnt)
        os.mkdir(ck)
        for name, data in files_of(rnd).items():
            with open(os.path.join(ck, name), "wb") as f:
                f.write(data)
        commit(ck)

    def fill_below(self, ino):
        """Take every free inode number below ino (ext4 gives a new inode
        the lowest free number of its group): the next inode is then the
        first one freed at or above it."""
        os.makedirs(self.fill, exist_ok=True)
        made = []
        try:
            while True:
                p = os.path.join(self.fill, str(len(made)))
                os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o600))
                made.append(p)
        except OSError as e:
            self.assertEqual(e.errno, errno.ENOSPC, e)
        for p in made:
            if os.stat(p).st_ino > ino:
                os.unlink(p)

    def view(self, mnt, x, data=True):
        ck = self.ck(x, mnt=mnt)
        names = sorted(n for n in os.listdir(ck) if n != ".metadata")
        return {n: (os.stat(os.path.join(ck, n)).st_size,
                    read_all(os.path.join(ck, n)) if data else None)
                for n in names}

    def want(self, rnd, data=True):
        return {n: (len(d), d if data else None) for n, d in files_of(rnd).items()}

    def wait_view(self, mnt, x, rnd, late, data=True):
        """Wait up to 2 s for mnt to show X of round rnd (its files and
        sizes, with data their bytes too); else note it in late."""
        t0 = time.monotonic()
        while True:
            try:
                seen = self.view(mnt, x, data)
            except OSError:
                seen = None
            if seen == self.want(rnd, data):
                return
            if time.monotonic() - t0 > 2.0:
                late.append(f"{x} of round {rnd}: b shows " + (
                    repr({n: s for n, (s, _) in seen.items()}) if seen else "an error")
                    + f", X is {sorted((n, len(d)) for n, d in files_of(rnd).items())}")
                return
            time.sleep(0.05)

    def test_new_checkpoint_in_a_reused_inode(self):
        a, b = os.path.join(self.dir, "a"), os.path.join(self.dir, "b")
        self.mount("sync_files=0", mnt=a)
        self.mount("sync_files=0", mnt=b)
        # another world's save in flight keeps .saves in place (else a new
        # save's first inode would be .saves, not its own directory)
        inflight = self.bk(".saves", "0" * 32)
        os.makedirs(inflight)
        held = os.open(inflight, os.O_RDONLY | os.O_DIRECTORY)
        self.addCleanup(os.close, held)
        fcntl.flock(held, fcntl.LOCK_SH)
        # and a live mount's kept retry link keeps .staging in place (else a
        # new staged checkpoint's .staging would take the freed number)
        os.makedirs(self.bk(".staging"), exist_ok=True)
        kept = os.open(self.bk(".staging", ".keep-" + "0" * 32 + "-0"),
                       os.O_CREAT | os.O_RDWR, 0o600)
        self.addCleanup(os.close, kept)
        fcntl.flock(kept, fcntl.LOCK_SH)
        reused, late = 0, []
        for rnd in range(1, ROUNDS + 1):
            # a name per round: b reads the bytes of the new X, so it holds
            # its data files (and so its directory) open from then on
            x = f"x{rnd}"
            self.stage(a, x, 100 + rnd)
            # b lists X and stats its files, reads nothing
            self.wait_view(b, x, 100 + rnd, late, data=False)
            ino = os.stat(self.bk(x)).st_ino
            # (no handle of b is open on X across its removal: an open
            # committed file holds its data files open, and so keeps their
            # inode numbers from reuse; that such a handle reads the old
            # bytes, never the new ones, integration_replace and
            # integration_removal test)
            self.fill_below(ino)
            subprocess.run(["rm", "-r", self.ck(x, mnt=a)], check=True)
            self.stage(a, x, rnd)
            shutil.rmtree(self.fill)
            reused += os.stat(self.bk(x)).st_ino == ino
            self.wait_view(b, x, rnd, late)
        print(f"\n  inode number reused in {reused} of {ROUNDS} rounds", file=sys.stderr)
        self.assertGreater(reused, 0, "the image never reused the inode: nothing was tested")
        self.assertEqual(late, [], f"in {len(late)} of {ROUNDS} rounds b did not show the "
                         "new X within about a second")


class ForeignSaveId(CkptfsTestCase):
    def test_long_save_id(self):
        a, b = os.path.join(self.dir, "a"), os.path.join(self.dir, "b")
        self.mount(mnt=a)
        self.mount(mnt=b)
        ck = self.ck("g", mnt=a)
        os.mkdir(ck)
        with open(os.path.join(ck, "w"), "wb") as f:
            f.write(b"foreign" * 100)
        commit(ck)
        copy = os.path.join(self.dir, "copy")
        shutil.copytree(self.bk("g"), copy)
        db = sqlite3.connect(os.path.join(copy, ".metadata"))
        db.execute("update checkpoint set value=? where key='save_id'", ("x" * 200,))
        db.commit()
        db.close()
        os.rename(copy, self.bk("f"))
        for mnt in (b, self.mount(mnt=os.path.join(self.dir, "c")).mnt):
            self.assertEqual(read_all(self.ck("f", "w", mnt=mnt)), b"foreign" * 100, mnt)
        self.assertNotIn("not showing", self.daemon_log())


if __name__ == "__main__":
    from ckpttest import util
    util.main()

#!/usr/bin/env python3
"""What other users can plant where a root ckptfs daemon writes or reads
(issue 33): a tier they can write, the metrics file's directory, the log.
The attacker is uid 65534 (nobody): what it would create, the test creates
as root and hands to it with chown, which is what the daemon sees.

    python3 tests/integration/test_planted.py --bin build/bin/ckptfs [Class ...]

Classes:
  PlantedTier     a tier other users can write (a fresh tmpfs is 1777) is
                  refused at mount, saying how to make it private, before
                  anything is served or flushed: a checkpoint planted in it
                  is never listed, a planted flush record never publishes
                  over BACKING_DIR; a private tier holding an entry of
                  another user's (planted before it was made private) is
                  refused, naming it; a private tier mounts
  PlantedMetrics  -o metrics=FILE in a directory another user owns: the
                  temporary name is not predictable and never opened
                  through a planted symlink (a root 0600 file stays as it
                  was) or FIFO (the daemon exits at unmount); FILE itself
                  planted as a symlink is replaced, not followed
  PlantedLog      -o log=FILE as a planted FIFO, or another user's file:
                  the mount is refused at once, nothing written to it
"""

import json
import os
import shutil
import stat
import subprocess
import time

from ckpttest import sanenv, util as cu
from ckpttest.util import CkptfsTestCase, commit, main, read_all, write_file

NOBODY = 65534


def chown_tree(path, uid=NOBODY):
    for root, dirs, files in os.walk(path):
        os.lchown(root, uid, uid)
        for n in dirs + files:
            os.lchown(os.path.join(root, n), uid, uid)


class PlantedCase(CkptfsTestCase):
    def run_mount(self, opts, timeout=30):
        """ckptfs -f with opts, expected to refuse: (exit code, output).
        Where it mounts instead, the output says so and what it served."""
        mnt = os.path.join(self.dir, "refused")
        os.makedirs(mnt, exist_ok=True)
        out = os.path.join(self.dir, "refused.out")
        with open(out, "wb") as f:
            p = subprocess.Popen([cu.BIN, "-f", "-o", opts, self.backing, mnt],
                                 stdin=subprocess.DEVNULL, stdout=f,
                                 stderr=subprocess.STDOUT, env=sanenv.env())
        served = None
        deadline = time.monotonic() + timeout
        while p.poll() is None and time.monotonic() < deadline:
            if cu.mountinfo_has(mnt):
                served = sorted(os.listdir(mnt))
                subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
                break
            time.sleep(0.05)
        try:
            rc = p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        text = read_all(out).decode(errors="replace")
        if served is not None:
            text = f"MOUNTED (not refused), serving {served}\n" + text
        elif rc < 0 and time.monotonic() >= deadline:
            text = f"neither mounted nor refused in {timeout}s\n" + text
        return rc, text

    def victim(self):
        """A root-only file that no metrics text may reach."""
        path = os.path.join(self.dir, "root-only")
        with open(path, "wb") as f:
            f.write(b"root's secret\n")
        os.chmod(path, 0o600)
        return path


class PlantedTier(PlantedCase):
    def setUp(self):
        super().setUp()
        self.tier = os.path.join(self.dir, "tier")
        os.makedirs(self.tier)

    def mount_tmpfs(self, mode=None):
        opts = "size=256m" + (f",mode={mode}" if mode else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", self.tier],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, f"cannot mount the tier's tmpfs: {r.stderr}")
        self.addCleanup(subprocess.run, ["umount", "-l", self.tier], capture_output=True)

    def legit_checkpoint(self, name, data):
        """NAME committed in BACKING_DIR through a mount without a tier."""
        m = self.mount()
        os.mkdir(self.ck(name))
        write_file(self.ck(name, "w"), data)
        commit(self.ck(name))
        m.stop()
        self.mounts.remove(m)

    def attacker_copy(self, src_name, dest):
        """The attacker's checkpoint: a real committed one (a .metadata
        and data files it made through a mount of its own), copied by it
        into dest."""
        shutil.copytree(self.bk(src_name), dest, symlinks=True)
        chown_tree(dest)

    def assertRefused(self, rc, out, what):
        self.assertEqual(rc, 2, f"{what}: the mount was not refused (exit {rc}):\n{out}")
        self.assertIn("not private to the daemon's user", out, out)
        self.assertIn("mode=0700", out, out)

    def test_world_writable_tier_refused(self):
        """A fresh tmpfs (mode 1777): uid 65534 plants step-300; the tier
        mount is refused and nothing of step-300 is ever served."""
        self.legit_checkpoint("evil", b"E" * 4096)
        self.mount_tmpfs()
        self.assertEqual(stat.S_IMODE(os.stat(self.tier).st_mode), 0o1777)
        self.attacker_copy("evil", os.path.join(self.tier, "step-300"))
        shutil.rmtree(self.bk("evil"))
        rc, out = self.run_mount(f"tier={self.tier}")
        self.assertRefused(rc, out, "tier of mode 1777")
        self.assertIn(f"{os.path.realpath(self.tier)} is writable by every user", out)
        # nothing in BACKING_DIR came from the tier
        self.assertFalse(os.path.exists(self.bk("step-300")))

    def test_planted_flush_record_refused(self):
        """A tier made private only after uid 65534 planted a flush record
        and its own step-100 there: refused, naming the planted entry;
        BACKING_DIR's committed step-100 keeps its bytes."""
        good = b"G" * 4096
        self.legit_checkpoint("evil", b"E" * 4096)
        self.legit_checkpoint("step-100", good)
        self.mount_tmpfs(mode="0700")
        planted = os.path.join(self.tier, "step-100")
        self.attacker_copy("evil", planted)
        shutil.rmtree(self.bk("evil"))
        fl = os.path.join(self.tier, ".flush")
        os.mkdir(fl, 0o700)  # root's own directory, a record of another user's in it
        ctl = os.path.join(os.path.dirname(cu.BIN), "ckptctl")
        sid = json.loads(subprocess.run([ctl, "show", "--json", self.tier, "step-100"],
                                        capture_output=True, text=True,
                                        check=True).stdout)["save_id"]
        rec = os.path.join(fl, f"{sid}.0")
        with open(rec, "w") as f:
            f.write(f"name step-100\nreplace 1\nbacking {os.path.realpath(self.backing)}\n")
        os.chown(rec, NOBODY, NOBODY)
        rc, out = self.run_mount(f"tier={self.tier}")
        self.assertRefused(rc, out, "a private tier holding planted entries")
        self.assertRegex(out, r"(step-100|\.flush/[0-9a-f]+\.0) is owned by another user \(uid 65534")
        time.sleep(1)
        m = self.mount()
        self.assertEqual(read_all(self.ck("step-100", "w")), good)
        m.stop()

    def test_private_tier_mounts(self):
        """mode=0700 as the docs say: the mount comes up and commits into it."""
        self.mount_tmpfs(mode="0700")
        self.mount(opts=f"tier={self.tier}")
        os.mkdir(self.ck("c"))
        write_file(self.ck("c", "w"), b"x" * 8192)
        commit(self.ck("c"))
        self.assertEqual(read_all(self.ck("c", "w")), b"x" * 8192)


class PlantedMetrics(PlantedCase):
    def setUp(self):
        super().setUp()
        # node_exporter's textfile directory: its service user's
        self.mdir = os.path.join(self.dir, "textfile")
        os.mkdir(self.mdir, 0o755)
        os.chown(self.mdir, NOBODY, NOBODY)
        self.file = os.path.join(self.mdir, "ckptfs.prom")

    def wait_rewritten(self, times=2, timeout=20):
        """Wait until FILE was replaced `times` more times (every 2 s)."""
        seen, ino = 0, None
        deadline = time.monotonic() + timeout
        while seen < times and time.monotonic() < deadline:
            try:
                st = os.lstat(self.file)
                if stat.S_ISREG(st.st_mode) and st.st_ino != ino:
                    seen, ino = seen + (ino is not None), st.st_ino
            except FileNotFoundError:
                pass
            time.sleep(0.05)
        self.assertEqual(seen, times, f"{self.file} not rewritten {times} times in {timeout}s")

    def daemon_pid(self, m):
        return m.proc.pid  # -f: the daemon itself

    def test_planted_symlink_not_followed(self):
        secret = self.victim()
        before = read_all(secret)
        m = self.mount(opts=f"metrics={self.file}")
        pid = self.daemon_pid(m)
        # the names the daemon used to write (FILE.tmp.PID), and FILE
        for name in (f"{self.file}.tmp.{pid}",):
            os.symlink(secret, name)
            os.lchown(name, NOBODY, NOBODY)
        self.wait_rewritten(times=2)
        self.assertEqual(read_all(secret), before,
                         "a root 0600 file was written through a planted symlink")
        self.assertEqual(os.stat(secret).st_mode & 0o777, 0o600)
        self.assertIn(b"ckptfs_", read_all(self.file))
        # FILE itself a symlink: rename replaces the link, never its target
        os.unlink(self.file)
        os.symlink(secret, self.file)
        self.wait_rewritten(times=1)
        self.assertFalse(os.path.islink(self.file))
        self.assertEqual(read_all(secret), before)
        m.stop()
        # nothing of the daemon's left beside FILE
        left = sorted(n for n in os.listdir(self.mdir)
                      if n.startswith("ckptfs.prom.tmp.") and
                      not os.path.islink(os.path.join(self.mdir, n)))
        self.assertEqual(left, [])

    def test_planted_fifo_does_not_hold_the_daemon(self):
        m = self.mount(opts=f"metrics={self.file}")
        pid = self.daemon_pid(m)
        fifo = f"{self.file}.tmp.{pid}"
        os.mkfifo(fifo, 0o666)
        os.chown(fifo, NOBODY, NOBODY)
        self.wait_rewritten(times=2)
        t0 = time.monotonic()
        self.assertTrue(m.unmount())
        rc = m.wait(timeout=10)
        self.assertIsNotNone(rc, "the daemon was still alive 10 s after its unmount "
                                 "(blocked opening a planted FIFO)")
        self.assertEqual(rc, 0, cu.read_log(self.log))
        self.assertLess(time.monotonic() - t0, 10)


class PlantedLog(PlantedCase):
    def test_fifo_refused(self):
        log = os.path.join(self.dir, "daemon-log")
        os.mkfifo(log, 0o666)
        os.chown(log, NOBODY, NOBODY)
        rc, out = self.run_mount(f"log={log}", timeout=10)
        self.assertNotEqual(rc, 0, out)
        self.assertIn("cannot open the log", out)

    def test_other_users_file_refused(self):
        log = os.path.join(self.dir, "daemon-log")
        with open(log, "w") as f:
            f.write("theirs\n")
        os.chown(log, NOBODY, NOBODY)
        rc, out = self.run_mount(f"log={log}", timeout=10)
        self.assertNotEqual(rc, 0, out)
        self.assertIn("belongs to another user", out)
        self.assertEqual(read_all(log), b"theirs\n")


if __name__ == "__main__":
    main()

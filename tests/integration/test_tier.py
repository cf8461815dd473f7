#!/usr/bin/env python3
"""The node-local tier (-o tier=DIR, -o flush_rate=SIZE; docs/tiers.md):
a commit lands in the tier and the background flush publishes it in
BACKING_DIR as a mount without the tier would have; a
flush killed midway leaves nothing published and the next mount resumes
it; one killed after the shared publish is not published twice; the mount
refuses a tier on BACKING_DIR's filesystem. Two ranks of one node (one
mpirun) share a tier: each flushes its own rank's files, the last one
publishes, a flush killed midway resumes in the next world.

The tier is a tmpfs mounted in the test's directory (needs root: the test
fails otherwise, it does not skip), large enough (2 GiB, a limit: only
what is written takes RAM) that passthrough=1 writes staged files into it;
BACKING_DIR is on /tmp's filesystem.
"""

import errno
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from ckpttest import util as cu
from ckpttest.util import CkptfsTestCase, Mount, commit, main, read_all, status, write_file
from ckpttest.world import commit_all

MiB = 1 << 20
SIZE = 64 * MiB


def digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(8 * MiB)
            if not b:
                return h.hexdigest()
            h.update(b)


def data_files(d):
    return {os.path.basename(p): digest(p)
            for p in sorted(glob.glob(os.path.join(d, "__*.distcp")))}


def committed_names(root):
    """The checkpoints published in root (a tier or BACKING_DIR)."""
    return [n for n in os.listdir(root) if not n.startswith(".")
            and os.path.exists(os.path.join(root, n, ".metadata"))]


def commit_before_kill(ckdir):
    """A sync commit whose daemon a failpoint of the flush kills just after
    the reply: the write must succeed; the close may find the daemon
    gone."""
    fd = os.open(os.path.join(ckdir, ".commit"), os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.write(fd, b"sync\n") == 5
    finally:
        try:
            os.close(fd)
        except OSError as e:
            if e.errno not in (errno.ENOTCONN, errno.ECONNABORTED):
                raise


class TierCase(CkptfsTestCase):
    def setUp(self):
        super().setUp()
        self.tier = os.path.join(self.dir, "tier")
        os.makedirs(self.tier)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=2g", "tmpfs",
                            self.tier],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, f"cannot mount the tier's tmpfs: {r.stderr}")
        # after the mounts' cleanup (cleanups run last-added first)
        self.addCleanup(subprocess.run, ["umount", "-l", self.tier], capture_output=True)
        self.data = os.urandom(SIZE)

    def tier_mount(self, extra="", env=None):
        opts = f"tier={self.tier}" + (f",{extra}" if extra else "")
        return self.mount(opts=opts, env=env)

    def stage(self, name="c"):
        os.mkdir(self.ck(name))
        write_file(self.ck(name, "weights"), self.data)

    def timed_commit(self, name="c"):
        t0 = time.monotonic()
        commit(self.ck(name))
        return time.monotonic() - t0

    def wait_status(self, phrase, name="c", timeout=60):
        """NAME's .status once it holds phrase, else the last one read."""
        deadline, s = time.monotonic() + timeout, ""
        while phrase not in s and time.monotonic() < deadline:
            s = status(self.ck(name))
            if phrase not in s:
                time.sleep(0.02)
        return s

    def wait_shared(self, name="c", timeout=60):
        s = self.wait_status("location shared", name, timeout)
        if "location shared" not in s:
            self.fail(f"not flushed in {timeout}s: {s!r}\n{self.daemon_log()}")
        return s

    def fsck_clean(self):
        exe = os.path.join(os.path.dirname(cu.BIN), "ckptfs-fsck")
        r = subprocess.run([exe, self.backing], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, f"ckptfs-fsck: {r.stdout}{r.stderr}")

    def read_without_tier(self, name="c", data=None):
        """A mount without the tier reads the flushed checkpoint bit-exact."""
        for m in self.mounts:
            m.stop()
        self.mounts = []
        self.mount()
        self.assertEqual(read_all(self.ck(name, "weights")),
                         self.data if data is None else data)

    def wait_flush_done(self, name="c", timeout=20):
        """After `location shared` the flush still drops its record,
        removes the tier's copy and tidies BACKING_DIR/.staging
        (fs/tier/flush.c, a thread at nice 10): wait for those."""
        deadline = time.monotonic() + timeout
        while self.records() or os.path.exists(os.path.join(self.tier, name)) or \
                os.path.exists(os.path.join(self.backing, ".staging")):
            if time.monotonic() > deadline:
                self.fail(f"flush of {name} not over in {timeout}s: records "
                          f"{self.records()}\n{cu.read_log(self.log)}")
            time.sleep(0.02)

    def records(self):
        """The flush records, SAVE_ID.RANK (not the node's .lock)."""
        d = os.path.join(self.tier, ".flush")
        return sorted(n for n in os.listdir(d) if not n.startswith(".")) \
            if os.path.isdir(d) else []

    def record_save(self):
        """The save ID of the one record."""
        self.assertEqual(len(self.records()), 1)
        return self.records()[0].split(".")[0]


class Flush(TierCase):
    def test_commit_local_then_shared(self):
        """A sync commit returns with the checkpoint in the tier only; the
        flush then publishes the same bytes in BACKING_DIR."""
        self.tier_mount("flush_rate=32M")  # 2 s: the local state is seen
        self.stage()
        commit(self.ck("c"))
        s = status(self.ck("c"))
        self.assertEqual(s.splitlines()[0], "committed")
        self.assertIn("location local", s)
        in_tier = data_files(os.path.join(self.tier, "c"))
        meta_mode = os.stat(os.path.join(self.tier, "c", ".metadata")).st_mode
        self.assertTrue(in_tier)
        self.assertEqual(len(self.records()), 1)
        self.assertFalse(os.path.exists(self.bk("c", ".metadata")))
        # its only copy: not removed (the flush would publish it again)
        self.assertErrno(errno.EBUSY, os.unlink, self.ck("c", "weights"))
        # read from the tier meanwhile; a handle open across the flush
        # reads on
        fd = os.open(self.ck("c", "weights"), os.O_RDONLY)
        try:
            self.assertEqual(os.pread(fd, MiB, 0), self.data[:MiB])
            self.assertIn("location local", status(self.ck("c")))
            s = self.wait_shared()
            self.assertEqual(os.pread(fd, SIZE - MiB, MiB), self.data[MiB:])
            # a new open meanwhile (its inode has the tier's file as its
            # passthrough backing) reads the same
            self.assertEqual(read_all(self.ck("c", "weights")), self.data)
        finally:
            os.close(fd)
        fl = [ln for ln in s.splitlines() if ln.startswith("flush bytes")]
        self.assertEqual(len(fl), 1, s)
        done, _, total = fl[0].split()[2:5]
        self.assertEqual(done, total)
        self.assertGreaterEqual(int(total), SIZE)
        self.assertEqual(data_files(self.bk("c")), in_tier)
        self.wait_flush_done()
        # BACKING_DIR holds what a commit without the tier leaves there
        self.assertEqual(sorted(os.listdir(self.backing)), ["c"])
        self.assertEqual(sorted(os.listdir(self.bk("c"))), [".metadata"] + sorted(in_tier))
        self.assertEqual(os.stat(self.bk("c", ".metadata")).st_mode, meta_mode)
        self.assertEqual(self.records(), [])
        self.assertFalse(os.path.exists(os.path.join(self.tier, "c")))
        # the same mount reads it from BACKING_DIR now
        self.assertEqual(read_all(self.ck("c", "weights")), self.data)
        self.read_without_tier()
        self.fsck_clean()

    def test_flush_rate(self):
        """flush_rate=16M: 64 MiB take 4 s to flush; the commit does not
        wait for that."""
        self.tier_mount("flush_rate=16M")
        self.stage()
        took = self.timed_commit()
        t0 = time.monotonic()
        self.assertIn("location local", status(self.ck("c")))
        self.wait_shared()
        flush = time.monotonic() - t0
        print(f"\n  tier commit {took:.3f} s, flush {flush:.2f} s "
              f"({SIZE / MiB / flush:.1f} MiB/s at flush_rate=16M)", file=sys.stderr)
        self.assertGreaterEqual(flush, 3.5)
        # the commit did not wait for the flush (a fixed bound in seconds
        # would time the machine, not the property)
        self.assertLess(took, flush / 3)
        # the same commit without a tier, for the record (not asserted:
        # /tmp's speed is the machine's)
        for m in self.mounts:
            m.stop()
        self.mounts = []
        self.mount()
        self.stage("d")
        print(f"  commit without tier {self.timed_commit('d'):.3f} s", file=sys.stderr)


    def test_level_shared_writes_backing_dir_directly(self):
        """`sync level=shared`: written to BACKING_DIR directly, as a mount
        without the tier would (issue 36: what the tier cannot hold is
        saved so): the commit returns once it is published there (64 MiB
        with flush_rate=1M: no 64 s flush in the way), with no flush
        record and no tier copy, `.status` saying location shared; a
        later tier commit flushes as usual; without a tier the word
        changes nothing."""
        self.tier_mount("flush_rate=1M")
        self.stage()
        t0 = time.monotonic()
        commit(self.ck("c"), "sync level=shared")
        took = time.monotonic() - t0
        self.assertTrue(os.path.exists(os.path.join(self.backing, "c", ".metadata")),
                        f"returned after {took:.2f} s, not in BACKING_DIR")
        self.assertLess(took, 30)
        self.assertEqual(self.records(), [])
        self.assertEqual(committed_names(self.tier), [])
        self.assertIn("location shared", status(self.ck("c")))
        self.assertEqual(read_all(self.ck("c", "weights")), self.data)
        os.mkdir(self.ck("d"))
        write_file(self.ck("d", "w"), b"small")
        commit(self.ck("d"))
        self.assertIn("location local", status(self.ck("d")))
        self.wait_shared("d")
        self.wait_flush_done("d")
        for m in self.mounts:
            m.stop()
        self.mounts = []
        self.mount()  # without the tier: the word is accepted, a plain sync
        self.assertEqual(read_all(self.ck("c", "weights")), self.data)
        self.stage("e")
        commit(self.ck("e"), "sync level=shared")
        self.assertTrue(os.path.exists(os.path.join(self.backing, "e", ".metadata")))
        self.fsck_clean()

    def test_flush_superseded_by_a_later_commit(self):
        """A tier commit of d whose flush (64 MiB at flush_rate=16M: 4 s)
        finds d committed meanwhile through a mount without the tier: that
        later commit stays d everywhere (fs/read/resolve.c), the flush publishes
        nothing, and d's .status and the log say the save was superseded;
        its record and tier copy go."""
        self.tier_mount("flush_rate=16M")
        self.stage("d")
        commit(self.ck("d"))
        tier_save = self.record_save()
        mnt2 = os.path.join(self.dir, "mnt2")
        os.makedirs(mnt2, exist_ok=True)
        self.mount(mnt=mnt2)  # no tier, the same BACKING_DIR
        os.mkdir(os.path.join(mnt2, "d"))
        write_file(os.path.join(mnt2, "d", "w"), b"other")
        commit(os.path.join(mnt2, "d"))
        st = self.wait_status("superseded: save", "d", timeout=60)
        self.assertIn(f"superseded: save {tier_save} of d", st, self.daemon_log())
        self.assertIn("is save", st)
        self.assertEqual(read_all(self.ck("d", "w")), b"other")
        self.assertEqual(read_all(os.path.join(mnt2, "d", "w")), b"other")
        cu.wait_until(lambda: not self.records() and not committed_names(self.tier), 20,
                      "the superseded save's record and tier copy removed")
        self.assertIn(f"save {tier_save} superseded, not published", self.daemon_log())
        self.fsck_clean()


class FlushTools(TierCase):
    """Retention across the tiers, ckptctl's view of them, a bad copy,
    tier_keep (a second ctest beside Flush: the sanitizer stages run
    them side by side)."""

    def test_retention_across_tiers(self):
        """keep=last:2 on BACKING_DIR, tier_keep=1 in the tier, by step:
        each applied once the checkpoint is flushed; an unflushed one is
        never evicted from the tier; the mount shows what BACKING_DIR
        keeps (a removed checkpoint's tier copy goes too)."""
        self.tier_mount("keep=last:2,tier_keep=1,flush_rate=16M")
        for step in (1, 2, 3, 4):
            name = f"s-{5 - step}"  # names ordered against the steps
            os.mkdir(self.ck(name))
            write_file(self.ck(name, "w"), self.data[:MiB])
            commit(self.ck(name), f"sync step={step}")
            self.wait_shared(name)
        want_shared, want_tier = {"s-2", "s-1"}, {"s-1"}
        deadline = time.monotonic() + 10
        while (set(committed_names(self.backing)), set(committed_names(self.tier))) != \
                (want_shared, want_tier) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(set(committed_names(self.backing)), want_shared, self.daemon_log())
        self.assertEqual(set(committed_names(self.tier)), want_tier)
        listed = set(os.listdir(self.mnt)) & {"s-4", "s-3", "s-2", "s-1"}
        self.assertEqual(listed, want_shared, f"{os.listdir(self.mnt)} {os.path.exists(self.ck('s-1'))}\n{self.daemon_log()}")
        self.stage("s-0")  # 64 MiB: 4 s in the tier alone
        commit(self.ck("s-0"), "sync step=5")
        time.sleep(0.5)
        self.assertIn("location local", status(self.ck("s-0")))
        self.assertEqual(set(committed_names(self.tier)), {"s-1", "s-0"})
        self.assertEqual(set(committed_names(self.backing)), want_shared)
        self.wait_shared("s-0")
        # the tier's eviction comes before keep= on BACKING_DIR (both
        # after the publish): wait for both
        want_shared, want_tier = {"s-1", "s-0"}, {"s-0"}
        deadline = time.monotonic() + 10
        while (set(committed_names(self.backing)), set(committed_names(self.tier))) != \
                (want_shared, want_tier) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(set(committed_names(self.backing)), {"s-1", "s-0"}, self.daemon_log())
        self.assertEqual(set(committed_names(self.tier)), {"s-0"})
        self.assertEqual(read_all(self.ck("s-0", "weights")), self.data)
        self.fsck_clean()

    def test_ckptctl_wait_level(self):
        """ckptctl wait --level: local returns once committed, shared once
        flushed (64 MiB at 16 MiB/s); a bad level is a usage error."""
        ctl = os.path.join(os.path.dirname(cu.BIN), "ckptctl")
        self.tier_mount("flush_rate=16M")
        self.stage()
        commit(self.ck("c"), "async")
        t0 = time.monotonic()
        r = subprocess.run([ctl, "wait", "--level", "local", self.ck("c")],
                           capture_output=True, text=True, timeout=60)
        local = time.monotonic() - t0
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.backing, "c", ".metadata")))
        r = subprocess.run([ctl, "wait", "--level", "shared", self.ck("c")],
                           capture_output=True, text=True, timeout=60)
        shared = time.monotonic() - t0
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(os.path.exists(os.path.join(self.backing, "c", ".metadata")))
        self.assertIn("location local", r.stdout)
        self.assertLess(local, 2.0)
        self.assertGreaterEqual(shared, 3.5)
        r = subprocess.run([ctl, "wait", "--level", "nowhere", self.ck("c")],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertIn("expected local, partner or shared", r.stderr)

    def test_ckptctl_ls_tier(self):
        """ckptctl ls --tier: a LOCATION per checkpoint, tier while not
        flushed, shared+tier when tier_keep keeps it, shared otherwise."""
        ctl = os.path.join(os.path.dirname(cu.BIN), "ckptctl")
        self.tier_mount("tier_keep=1,flush_rate=16M")
        for name in ("a", "b"):
            os.mkdir(self.ck(name))
            write_file(self.ck(name, "w"), self.data[:MiB])
            commit(self.ck(name))
            self.wait_shared(name)
        self.stage("c")
        commit(self.ck("c"))  # 64 MiB at 16 MiB/s: in the tier for 4 s

        def locations():
            r = subprocess.run([ctl, "ls", "--json", "--tier", self.tier, self.backing],
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 0, r.stderr)
            got = {}
            for e in json.loads(r.stdout)["checkpoints"]:
                if e["name"].startswith(".saves/"):
                    continue  # the flush's copy being written
                self.assertNotIn(e["name"], got, f"listed twice: {r.stdout}")
                got[e["name"]] = e.get("location")
            return got
        self.assertEqual(locations(), {"a": "shared", "b": "shared+tier", "c": "tier"})
        r = subprocess.run([ctl, "ls", "--tier", self.tier, self.backing],
                           capture_output=True, text=True, timeout=60)
        self.assertIn("LOCATION", r.stdout)
        self.wait_shared("c")
        # tier_keep=1 evicts b after c's publish (the flush's last step)
        want, deadline = {"a": "shared", "b": "shared", "c": "shared+tier"}, time.monotonic() + 20
        while (got := locations()) != want and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertEqual(got, want)
        r = subprocess.run([ctl, "ls", "--json", self.backing], capture_output=True, text=True)
        self.assertNotIn("location", r.stdout)  # without --tier: as before

    def test_bad_copy_not_published(self):
        """A data file damaged in the tier after the commit: the copy's
        checksums do not match the .metadata, nothing is published, the
        tier keeps the checkpoint and its record."""
        self.tier_mount("flush_rate=16M")  # 4 s: damaged before copied
        self.stage()
        commit(self.ck("c"))
        files = glob.glob(os.path.join(self.tier, "c", "__0_*.distcp"))
        big = max(files, key=os.path.getsize)
        with open(big, "r+b") as f:
            f.seek(os.path.getsize(big) - 1)
            last = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([last[0] ^ 0xFF]))
        s = self.wait_status("flush failed", timeout=30)
        self.assertIn("flush failed: ", s)
        self.assertIn("location local", s)
        self.assertIn("is not what was committed", self.daemon_log())
        self.assertFalse(os.path.exists(self.bk("c")))
        self.assertEqual(len(self.records()), 1)
        self.assertTrue(os.path.exists(os.path.join(self.tier, "c", ".metadata")))
        # failed for good: removed by hand through the mount, for good
        shutil.rmtree(self.ck("c"))
        self.assertFalse(os.path.exists(self.ck("c")))
        self.assertEqual(self.records(), [])
        self.assertFalse(os.path.exists(os.path.join(self.tier, "c")))
        self.assertFalse(os.path.exists(self.bk("c")))
        for m in self.mounts:
            m.stop()
        self.mounts = []
        self.tier_mount()
        self.assertEqual(os.listdir(self.mnt), [])
        time.sleep(0.3)  # no flush left to publish it
        self.assertFalse(os.path.exists(self.bk("c")))


    def test_tier_keep_keeps_newest_steps(self):
        # tier_keep=2: of four flushed checkpoints the tier keeps the two of
        # the highest steps (names and times ordered otherwise), BACKING_DIR
        # all four; a remount keeps them; without tier_keep they go.
        self.tier_mount("tier_keep=2")
        steps = {"z-old": 10, "b-new": 40, "y-mid": 20, "a-newer": 30}
        for name, step in steps.items():
            os.mkdir(self.ck(name))
            write_file(self.ck(name, "weights"), self.data[:MiB])
            commit(self.ck(name), f"sync step={step}")
            self.wait_shared(name)
        want = {"b-new", "a-newer"}
        deadline = time.monotonic() + 10
        while set(committed_names(self.tier)) != want and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(set(committed_names(self.tier)), want, self.daemon_log())
        self.assertEqual(set(committed_names(self.backing)), set(steps))
        self.assertEqual(read_all(self.ck("b-new", "weights")), self.data[:MiB])
        for m in self.mounts:
            m.stop()
        self.mounts = []
        self.tier_mount("tier_keep=2")
        self.assertEqual(set(committed_names(self.tier)), want)
        for name in steps:
            self.assertEqual(read_all(self.ck(name, "weights")), self.data[:MiB])
        for m in self.mounts:
            m.stop()
        self.mounts = []
        self.tier_mount()  # default: the tier keeps nothing flushed
        self.assertEqual(set(committed_names(self.tier)), set())
        self.fsck_clean()


class Replace(TierCase):
    def test_replace_racing_flushes(self):
        """replace= commits of one name, each landing while the flush of
        the one before is publishing it in BACKING_DIR (its data copied):
        the flush must not remove the newer commit from the tier. Every
        sync-committed version reads back at once; the newest is what the
        mount and BACKING_DIR hold once the flushes are done."""
        self.tier_mount("flush_rate=8M")  # 1 MiB: 125 ms of copy
        size, versions, prev = MiB, [], None
        for i in range(24):
            data = os.urandom(size)
            write_file(self.ck("w", "weights"), data)
            if prev is not None:
                # the flush of the one before has copied its data: the
                # metadata, the mark and the publish follow
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    s = status(self.ck("latest"))
                    fl = [ln.split() for ln in s.splitlines()
                          if ln.startswith("flush bytes")]
                    if "location shared" in s or (fl and fl[0][2] == fl[0][4]
                                                  and fl[0][2] != "0"):
                        break
                    time.sleep(0.001)
                time.sleep((i % 8) * 0.003)
            commit(self.ck("w"), "sync replace=latest")
            versions.append(data)
            prev = data
            # the flush before is done (or superseded): this version is
            # still in the tier or flushed, readable
            deadline = time.monotonic() + 30
            while len(self.records()) > 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            s = status(self.ck("latest"))
            self.assertNotIn("flush failed", s, f"version {i}\n{self.daemon_log()}")
            self.assertTrue("location shared" in s or os.path.exists(
                os.path.join(self.tier, "latest", ".metadata")),
                f"version {i} gone from the tier, not flushed\n{self.daemon_log()}")
            self.assertEqual(read_all(self.ck("latest", "weights")), data, f"version {i}")
        deadline = time.monotonic() + 60
        while self.records() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(self.records(), [], self.daemon_log())
        self.assertIn("location shared", status(self.ck("latest")))
        self.assertEqual(read_all(self.ck("latest", "weights")), versions[-1])
        self.assertNotIn("flush failed", status(self.ck("latest")))
        met = self.daemon_log().count("a newer save of it now")
        print(f"\n  {met} flush(es) of 23 met a newer commit", file=sys.stderr)
        self.read_without_tier("latest", versions[-1])
        self.fsck_clean()


class Crash(TierCase):
    def test_killed_during_copy(self):
        """Killed while copying: nothing in BACKING_DIR; the next mount
        resumes the flush from its record and publishes it."""
        m = self.tier_mount(env={"CKPTFS_FAILPOINT": "flush_copy"})
        self.stage()
        commit_before_kill(self.ck("c"))
        self.assertEqual(m.wait(timeout=60), -9, "the daemon did not die at flush_copy")
        self.assertIn("failpoint reached", self.daemon_log())
        m.unmount()
        self.assertFalse(os.path.exists(self.bk("c")))
        self.assertNothingPublished("c")
        self.assertEqual(len(self.records()), 1)
        save_id = self.record_save()
        self.assertTrue(os.path.isdir(self.bk(".saves", save_id)))
        self.mounts = []
        self.tier_mount()
        self.wait_shared()
        # the cleanup of unfinished saves left the one the record names
        self.assertNotIn(f"removing unfinished save .saves/{save_id}", self.daemon_log())
        self.wait_flush_done()
        self.assertEqual(self.records(), [])
        self.assertEqual(read_all(self.ck("c", "weights")), self.data)
        self.read_without_tier()
        self.fsck_clean()

    def test_killed_before_tier_publish(self):
        """Killed after the flush record is written, before the commit
        publishes in the tier (failpoint metadata_tmp): the commit point
        never came; the next mount drops the record and the unfinished
        save, and publishes nothing anywhere."""
        m = self.tier_mount(env={"CKPTFS_FAILPOINT": "metadata_tmp"})
        self.stage()
        try:
            commit(self.ck("c"))
        except OSError as e:
            self.assertIn(e.errno, (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO))
        self.assertEqual(m.wait(timeout=60), -9, "the daemon did not die at metadata_tmp")
        m.unmount()
        self.mounts = []
        self.assertEqual(len(self.records()), 1)
        self.assertFalse(os.path.exists(os.path.join(self.tier, "c")))
        self.tier_mount()
        self.assertIn("never published in the tier", self.daemon_log())
        self.assertEqual(self.records(), [])
        saves = os.path.join(self.tier, ".saves")
        self.assertFalse(os.path.isdir(saves) and os.listdir(saves))
        time.sleep(0.3)  # no flush left to publish it
        self.assertFalse(os.path.exists(self.bk("c")))
        self.assertNothingPublished("c")

    def test_resumed_copy_checks_linked_files(self):
        """Killed while copying the last data file: one linked in
        BACKING_DIR/.saves/ID by the killed run is damaged there (same
        size) before the next mount: the resumed flush checks it, copies
        it again, and publishes the committed bytes."""
        # as many data files as the same files make (six with passthrough,
        # two of them the staged files'; fewer on the daemon's path):
        # counted on a first commit, then killed at the last one's copy,
        # the others linked
        p = self.tier_mount()
        os.mkdir(self.ck("probe"))
        write_file(self.ck("probe", "weights"), self.data)
        write_file(self.ck("probe", "other"), self.data[::-1])
        commit(self.ck("probe"))
        self.wait_shared("probe")
        last = len(glob.glob(self.bk("probe", "__*.distcp")))
        p.unmount()
        p.wait(timeout=60)   # its lock on the tier goes with it
        self.mounts = []
        if last < 2:   # the daemon's path may pack both into one data file
            self.skipTest(f"{last} data file: none is linked before the last one's copy")
        m = self.tier_mount(env={"CKPTFS_FAILPOINT": f"flush_copy:{last}"})
        os.mkdir(self.ck("c"))
        write_file(self.ck("c", "weights"), self.data)
        write_file(self.ck("c", "other"), self.data[::-1])
        commit_before_kill(self.ck("c"))
        self.assertEqual(m.wait(timeout=60), -9, f"the daemon did not die at flush_copy:{last}")
        m.unmount()
        save_id = self.record_save()
        linked = [p for p in glob.glob(self.bk(".saves", save_id, "__*.distcp"))
                  if os.path.getsize(p) > 0]
        tier = {os.path.basename(p): os.path.getsize(p)
                for p in glob.glob(os.path.join(self.tier, "c", "__*.distcp"))}
        self.assertTrue(linked, f"none linked; tier {tier}")
        with open(linked[0], "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0xFF]))
        self.mounts = []
        self.tier_mount()
        self.wait_shared()
        self.assertEqual(read_all(self.ck("c", "weights")), self.data)
        self.assertEqual(read_all(self.ck("c", "other")), self.data[::-1])
        self.fsck_clean()

    def test_killed_after_publish(self):
        """Killed once published in BACKING_DIR, before the record went:
        the next mount drops the record, publishes nothing twice."""
        m = self.tier_mount(env={"CKPTFS_FAILPOINT": "flush_published"})
        self.stage()
        commit_before_kill(self.ck("c"))
        self.assertEqual(m.wait(timeout=60), -9, "the daemon did not die at flush_published")
        self.assertIn("failpoint reached", self.daemon_log())
        m.unmount()
        self.assertTrue(os.path.exists(self.bk("c", ".metadata")))
        self.assertEqual(len(self.records()), 1)
        before = os.stat(self.bk("c"))
        self.mounts = []
        self.tier_mount()
        self.assertIn("flushed already", cu.wait_log(self.log, "flushed already"))
        self.assertEqual(self.records(), [])
        self.assertFalse(os.path.exists(os.path.join(self.tier, "c")))
        s = status(self.ck("c"))
        self.assertIn("location shared", s)
        after = os.stat(self.bk("c"))
        self.assertEqual((before.st_ino, before.st_mtime_ns), (after.st_ino, after.st_mtime_ns))
        self.assertEqual(os.listdir(self.backing), ["c"])
        self.assertEqual(read_all(self.ck("c", "weights")), self.data)
        self.fsck_clean()


    def test_store_full_waits(self):
        """The shared store full (ENOSPC once): .status says the flush
        waits; it retries after 1 s and publishes."""
        self.tier_mount(env={"CKPTFS_FAILPOINT": "flush_copy=ENOSPC"})
        self.stage()
        commit(self.ck("c"))
        seen = self.wait_status("flush waiting: ", timeout=10)
        self.assertIn("flush waiting: ", seen)
        self.assertIn("No space left on device (retry in 1 s)", seen)
        self.assertIn("location local", seen)
        s = self.wait_shared()
        self.assertNotIn("flush waiting", s)
        self.assertEqual(read_all(self.ck("c", "weights")), self.data)
        self.fsck_clean()


    def test_killed_before_publish_other_mount_cleans(self):
        """Killed once marked 'publishing', before the publish; then a
        mount without the tier on the same BACKING_DIR removes the
        unfinished BACKING_DIR/.saves/ID (its cleanup): the tier's copy is
        the only one, and the next mount with the tier publishes it."""
        m = self.tier_mount(env={"CKPTFS_FAILPOINT": "flush_marked"})
        self.stage()
        commit_before_kill(self.ck("c"))
        self.assertEqual(m.wait(timeout=60), -9, "the daemon did not die at flush_marked")
        m.unmount()
        self.assertEqual(len(self.records()), 1)
        save_id = self.record_save()
        self.assertFalse(os.path.exists(self.bk("c")))
        self.mounts = []
        other = self.mount()  # without the tier: its cleanup runs
        self.assertEqual(os.listdir(self.mnt), [])
        other.stop()
        self.assertFalse(os.path.exists(self.bk(".saves", save_id)))
        self.mounts = []
        self.tier_mount()
        s = self.wait_shared()
        self.assertNotIn("flush failed", s)
        self.wait_flush_done()
        self.assertEqual(self.records(), [])
        self.assertEqual(read_all(self.ck("c", "weights")), self.data)
        self.read_without_tier()
        self.fsck_clean()

    def test_removed_after_publish_comes_back(self):
        """Killed once published, before the record went; then a mount
        without the tier removes the checkpoint. The next mount with the
        tier cannot tell that from a cleanup that removed the unpublished
        copy (above): it keeps the tier's copy and publishes it again
        (docs/tiers.md), without replacing anything."""
        m = self.tier_mount(env={"CKPTFS_FAILPOINT": "flush_published"})
        self.stage()
        commit_before_kill(self.ck("c"))
        self.assertEqual(m.wait(timeout=60), -9, "the daemon did not die at flush_published")
        m.unmount()
        self.assertEqual(len(self.records()), 1)
        self.mounts = []
        other = self.mount()  # without the tier
        shutil.rmtree(self.ck("c"))
        other.stop()
        self.assertFalse(os.path.exists(self.bk("c")))
        self.mounts = []
        self.tier_mount()
        self.assertIn("flushed again without replacing",
                      cu.wait_log(self.log, "flushed again without replacing"))
        self.wait_shared()
        self.wait_flush_done()
        self.assertEqual(self.records(), [])
        self.assertEqual(read_all(self.ck("c", "weights")), self.data)
        self.fsck_clean()


class Refused(TierCase):
    def refused(self, opts, want):
        m = self.mount(opts=opts, start=False)
        with self.assertRaises(RuntimeError) as cm:
            m.start()
        self.assertEqual(m.returncode, 2, str(cm.exception))
        self.assertIn(want, str(cm.exception))
        self.assertFalse(os.path.exists(self.backing), "BACKING_DIR made anyway")

    def test_same_filesystem(self):
        same = os.path.join(self.dir, "same")
        os.mkdir(same)
        self.refused(f"tier={same}", "same filesystem as BACKING_DIR")

    def test_missing_or_not_directory(self):
        self.refused(f"tier={self.dir}/none", "the tier directory must exist")
        f = os.path.join(self.tier, "file")
        open(f, "w").close()
        self.refused(f"tier={f}", "not a directory")

    def test_tier_in_use(self):
        self.tier_mount()
        m = Mount(os.path.join(self.dir, "backing2"), os.path.join(self.dir, "mnt2"),
                  self.log, opts=f"tier={self.tier}")
        self.mounts.append(m)
        with self.assertRaises(RuntimeError) as cm:
            m.start()
        self.assertEqual(m.returncode, 2, str(cm.exception))
        self.assertIn("is in use by another mount", str(cm.exception))

    def test_unflushed_for_another_backing_dir(self):
        """A tier holding a checkpoint unflushed to BACKING_DIR A is refused
        with BACKING_DIR B (B's mount would not flush it), then flushed by
        A's."""
        m = self.tier_mount(env={"CKPTFS_FAILPOINT": "flush_copy"})
        self.stage()
        commit_before_kill(self.ck("c"))
        self.assertEqual(m.wait(timeout=60), -9, "the daemon did not die at flush_copy")
        m.unmount()
        self.mounts = []
        other = Mount(os.path.join(self.dir, "backing2"), self.mnt, self.log,
                      opts=f"tier={self.tier}")
        self.mounts.append(other)
        with self.assertRaises(RuntimeError) as cm:
            other.start()
        self.assertEqual(other.returncode, 2, str(cm.exception))
        self.assertIn(f"not flushed yet to another BACKING_DIR, {self.backing} "
                      "(checkpoint c)", str(cm.exception))
        self.assertFalse(os.path.exists(os.path.join(self.dir, "backing2")))
        self.mounts = []
        self.tier_mount()
        self.wait_shared()
        self.assertEqual(read_all(self.ck("c", "weights")), self.data)


class MultiRank(TierCase):
    """Two ranks of one node (one mpirun) share the tier."""

    def setUp(self):
        super().setUp()
        self.root = os.path.join(self.dir, "w")
        self.world = None
        self.rank_data = [os.urandom(16 * MiB), os.urandom(16 * MiB)]

    def start_tier_world(self, extra="", env=None):
        """A world of 2 ranks over the tier (extra: more options, env: more
        variables for the ranks), its log the daemon's; stopped in cleanup."""
        opts = f"tier={self.tier}" + (f",{extra}" if extra else "")
        self.world = self.start_world(2, opts, root=self.root, log=self.log, env_extra=env)
        return self.world

    def stop_world(self):
        self.world.stop()
        self.world = None

    def stage_all(self, name="c"):
        for r in range(2):
            os.mkdir(os.path.join(self.world.mnt(r), name))
            write_file(os.path.join(self.world.mnt(r), name, f"rank{r}"), self.rank_data[r])

    def wait_rank(self, rank, phrase, name="c", timeout=60):
        ck = os.path.join(self.world.mnt(rank), name)
        deadline, s = time.monotonic() + timeout, ""
        while phrase not in s and time.monotonic() < deadline:
            s = status(ck)
            if phrase not in s:
                time.sleep(0.02)
        if phrase not in s:
            self.fail(f"rank {rank}: no {phrase!r} in {timeout}s: {s!r}\n"
                      f"{cu.read_log(self.log)}")
        return s

    def check_without_tier(self, name="c"):
        """Every rank's file bit-exact through a mount without the tier;
        fsck clean."""
        self.mount()
        for r in range(2):
            self.assertEqual(read_all(self.ck(name, f"rank{r}")), self.rank_data[r])
        self.fsck_clean()

    def test_two_ranks_local_then_shared(self):
        """Both ranks commit into one tier: the checkpoint is `location
        local` on both, with both ranks' data files in TIER/NAME and one
        record per rank; each rank's flush copies its own files and the
        one that sees the last linked publishes; the tier copy goes once
        both are flushed."""
        w = self.start_tier_world("flush_rate=8M")  # 2 s per rank: local is seen
        self.stage_all()
        res = commit_all(w, "c")
        self.assertEqual([res[r][0] for r in range(2)], [None, None], cu.read_log(self.log))
        for r in range(2):
            s = status(os.path.join(w.mnt(r), "c"))
            self.assertEqual(s.splitlines()[0], "committed")
            self.assertIn("location local", s)
        in_tier = data_files(os.path.join(self.tier, "c"))
        self.assertTrue(any(n.startswith("__0_") for n in in_tier), in_tier)
        self.assertTrue(any(n.startswith("__1_") for n in in_tier), in_tier)
        recs = self.records()
        self.assertEqual(len(recs), 2, recs)
        self.assertEqual(sorted(n.split(".")[1] for n in recs), ["0", "1"])
        self.assertFalse(os.path.exists(self.bk("c", ".metadata")))
        for r in range(2):
            s = self.wait_rank(r, "location shared")
            # each rank counts its own rank's files
            fl = [ln.split() for ln in s.splitlines() if ln.startswith("flush bytes")]
            self.assertEqual(len(fl), 1, s)
            self.assertEqual(fl[0][2], fl[0][4], s)
            self.assertGreaterEqual(int(fl[0][4]), 16 * MiB)
            self.assertLess(int(fl[0][4]), 32 * MiB)
        self.assertEqual(data_files(self.bk("c")), in_tier)
        self.wait_flush_done()
        self.assertEqual(sorted(os.listdir(self.backing)), ["c"])
        self.assertEqual(sorted(os.listdir(self.bk("c"))), [".metadata"] + sorted(in_tier))
        self.assertEqual(self.records(), [])
        self.assertFalse(os.path.exists(os.path.join(self.tier, "c")))
        self.assertFalse(os.listdir(os.path.join(self.tier, ".saves"))
                         if os.path.isdir(os.path.join(self.tier, ".saves")) else [])
        # every rank reads every rank's file, from BACKING_DIR now
        for r in range(2):
            for k in range(2):
                self.assertEqual(read_all(os.path.join(w.mnt(r), "c", f"rank{k}")),
                                 self.rank_data[k])
        self.stop_world()
        self.check_without_tier()

    def test_two_ranks_level_shared_direct(self):
        """`sync level=shared` on both ranks: written to BACKING_DIR
        directly by each rank (no record, nothing in the tier), published
        there when the commit returns, `location shared` on both; the
        write-behind streams in the tier are read back, not linked."""
        w = self.start_tier_world("flush_rate=1M")
        self.stage_all()
        res = commit_all(w, "c", "sync level=shared")
        self.assertEqual([res[r][0] for r in range(2)], [None, None], cu.read_log(self.log))
        self.assertTrue(os.path.exists(self.bk("c", ".metadata")))
        self.assertEqual(self.records(), [])
        self.assertEqual(committed_names(self.tier), [])
        for r in range(2):
            self.assertIn("location shared", status(os.path.join(w.mnt(r), "c")))
            self.assertEqual(read_all(os.path.join(w.mnt(r), "c", f"rank{r}")),
                             self.rank_data[r])
        self.stop_world()
        self.check_without_tier()

    def test_ranks_disagree_on_level_shared(self):
        """Rank 0 commits `sync level=shared`, rank 1 plain `sync`: one
        save cannot go to BACKING_DIR on one rank and into the tier on
        the other (rank 1's files would be lost), so the commit fails on
        both with the reason, nothing is published, and both stay staged:
        the same words then commit."""
        w = self.start_tier_world()
        self.stage_all()
        got = {}

        def one(r, words):
            try:
                commit(os.path.join(w.mnt(r), "c"), words)
                got[r] = None
            except OSError as e:
                got[r] = e.errno
        ts = [threading.Thread(target=one, args=(0, "sync level=shared")),
              threading.Thread(target=one, args=(1, "sync"))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        self.assertEqual(got, {0: errno.EIO, 1: errno.EIO}, cu.read_log(self.log))
        for r in range(2):
            st = status(os.path.join(w.mnt(r), "c"))
            self.assertTrue(st.startswith("failed"), st)
            self.assertIn("different level= words", st)
            self.assertEqual(read_all(os.path.join(w.mnt(r), "c", f"rank{r}")),
                             self.rank_data[r])
        self.assertFalse(os.path.exists(self.bk("c")))
        self.assertEqual(self.records(), [])
        res = commit_all(w, "c", "sync level=shared")
        self.assertEqual([res[r][0] for r in range(2)], [None, None], cu.read_log(self.log))
        self.stop_world()
        self.check_without_tier()

    def test_rank_waits_for_the_other(self):
        """Rank 1's copy fails once (EIO): rank 0's flush has linked its own
        files and waits, saying for whom, without publishing; rank 1's
        retry links its files, and then the checkpoint is published."""
        w = self.start_tier_world(env={"CKPTFS_FAILPOINT": "flush_copy@1=EIO"})
        self.stage_all()
        res = commit_all(w, "c")
        self.assertEqual([res[r][0] for r in range(2)], [None, None], cu.read_log(self.log))
        s = self.wait_rank(0, "flush waiting: rank 1 not in the shared store yet")
        self.assertIn("location local", s)
        self.assertFalse(os.path.exists(self.bk("c")))
        self.assertTrue(glob.glob(self.bk(".saves", "*", "__0_*.distcp")))
        for r in range(2):
            self.wait_rank(r, "location shared")
        # logged after the publish
        self.assertIn("rank 1's files", cu.wait_log(self.log, "rank 1's files"))
        self.stop_world()
        self.check_without_tier()

    def test_killed_during_copy(self):
        """Rank 1 killed while copying (mpirun ends the world): nothing is
        published in BACKING_DIR; the next world over the same tier resumes
        both ranks' records and publishes the checkpoint once."""
        w = self.start_tier_world(env={"CKPTFS_FAILPOINT": "flush_copy@1"})
        self.stage_all()
        threads = [threading.Thread(target=commit_before_kill_quiet,
                                    args=(os.path.join(w.mnt(r), "c"),), daemon=True)
                   for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        w.proc.wait(60)
        self.assertIn("failpoint reached", cu.read_log(self.log))
        self.stop_world()
        self.assertTrue(os.path.exists(os.path.join(self.tier, "c", ".metadata")),
                        cu.read_log(self.log))
        self.assertNothingPublished("c")
        self.assertFalse(os.path.exists(self.bk("c")))
        self.assertEqual(len(self.records()), 2)
        self.start_tier_world()
        for r in range(2):
            self.wait_rank(r, "location shared")
        self.wait_flush_done()
        self.assertEqual(self.records(), [])
        self.stop_world()
        self.check_without_tier()

    def test_solo_save_failed_flush_removed(self):
        """Rank 1's `sync solo` save (recorded as rank 0's files, the only
        rank of that save) whose flush fails for good (its data file
        damaged in the tier): removed through rank 1's mount, its record
        goes with it, and nothing is flushed or left behind."""
        w = self.start_tier_world("flush_rate=4M")  # 16 MiB: 4 s, damaged first
        ck = os.path.join(w.mnt(1), "c")
        os.mkdir(ck)
        write_file(os.path.join(ck, "w"), self.rank_data[1])
        commit(ck, "sync solo")
        self.assertEqual(len(self.records()), 1, self.records())
        self.assertTrue(self.records()[0].endswith(".0"), self.records())
        big = max(glob.glob(os.path.join(self.tier, "c", "__0_*.distcp")),
                  key=os.path.getsize)
        with open(big, "r+b") as f:
            f.seek(os.path.getsize(big) - 1)
            last = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([last[0] ^ 0xFF]))
        self.wait_rank(1, "flush failed")
        shutil.rmtree(ck)
        self.assertEqual(self.records(), [], cu.read_log(self.log))
        self.assertFalse(os.path.exists(os.path.join(self.tier, "c")))
        self.stop_world()
        self.assertFalse(os.path.exists(self.bk("c")))

    def test_world_and_one_rank_mount_exclude(self):
        """One world per tier: a mount of one rank is refused while the
        world runs on the tier."""
        self.start_tier_world()
        m = Mount(os.path.join(self.dir, "backing2"), os.path.join(self.dir, "mnt2"),
                  self.log, opts=f"tier={self.tier}")
        self.mounts.append(m)
        with self.assertRaises(RuntimeError) as cm:
            m.start()
        self.assertEqual(m.returncode, 2, str(cm.exception))
        self.assertIn("is in use by another mount", str(cm.exception))


def commit_before_kill_quiet(ckdir):
    """commit_before_kill, where the world may go before the reply."""
    try:
        commit_before_kill(ckdir)
    except OSError as e:
        if e.errno not in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO):
            raise


if __name__ == "__main__":
    main()

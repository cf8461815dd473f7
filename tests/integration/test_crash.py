"""The crash-point matrix: a daemon (one rank, or every rank of a world)
dies by SIGKILL at a named point of a sync or async save
(CKPTFS_FAILPOINT, fs/failpoint.h), or is killed from outside while it
writes data; then BACKING_DIR is mounted again, at the same or another
world size, and must show:

  - every checkpoint committed before, bit-exact (and ckptfs-fsck clean);
  - the interrupted save either committed whole, bit-exact, or absent;
    committed exactly when the coordinator got past renaming .metadata;
  - nothing else in BACKING_DIR: no unfinished NAME directory, no
    .metadata.tmp, no .staging;
  - the interrupted name can be saved again.

    python3 tests/integration/test_crash.py --bin build/bin/ckptfs
"""

import os
import shutil
import signal
import stat
import subprocess
import threading
import time

from ckpttest import util as cu, world as mw
from ckpttest.util import (CkptfsTestCase, commit, read_all, read_log, status, wait_state,
                           write_file, write_tensor)

MiB = 1 << 20

# (point, committed when the coordinator dies there)
POINTS = [
    ("local_plan", False),
    ("global_plan", False),
    ("write_begin", False),
    ("write_data", False),
    ("write_data:2", False),
    ("write_done", False),
    ("metadata_tmp", False),
    ("metadata_rename", True),
    ("metadata_synced", True),
    ("committed", True),
]


def pattern(tag, n):
    """n bytes that differ for every tag and position."""
    seed = sum(tag.encode()) * 2654435761 & 0xFFFFFFFF
    block = bytes((seed >> (8 * (i % 4)) ^ i * 31) & 0xFF for i in range(4093))
    return (block * (n // len(block) + 1))[:n]


def write_backwards(path, data, piece=MiB):
    """Made by mknod, then opened read-write (an existing file: not by
    FUSE passthrough, which takes the files created for writing) and
    written last piece first: through the daemon and not streamed behind,
    so the save's write step copies it into the data file (several write
    batches)."""
    os.mknod(path, 0o644 | stat.S_IFREG)
    fd = os.open(path, os.O_RDWR | os.O_TRUNC)
    try:
        for off in reversed(range(0, len(data), piece)):
            os.pwrite(fd, data[off:off + piece], off)
    finally:
        os.close(fd)


def unmount_dead(mnt):
    if mw.mountinfo_has(mnt):
        subprocess.run(["fusermount3", "-uz", mnt], capture_output=True)


def fsck(backing, *names):
    exe = os.path.join(os.path.dirname(cu.BIN), "ckptfs-fsck")
    return subprocess.run([exe, backing, *names], capture_output=True, text=True)


class Content:
    """What a checkpoint of NAME saved by a world of n ranks holds: a uint8
    tensor "w" of one chunk per rank (streamed: written in order), a bytes
    item big.bin per rank written backwards (copied by the write step, 20
    MiB: three 8 MiB write batches) and a small one."""

    CHUNK = 3 * MiB + 17
    BIG = 20 * MiB

    def __init__(self, name, n):
        self.name, self.n = name, n

    def files(self):
        """path -> bytes, as read back through any mount."""
        out = {"w": b"".join(pattern(f"{self.name}/w{r}", self.CHUNK)
                             for r in range(self.n))}
        for r in range(self.n):
            out[f"r{r}/big.bin"] = pattern(f"{self.name}/big{r}", self.BIG)
            out[f"r{r}/small"] = f"{self.name} rank {r}\n".encode()
        return out

    def stage(self, ckdir, r):
        os.mkdir(ckdir)
        files = self.files()
        os.mkdir(os.path.join(ckdir, f"r{r}"))
        write_tensor(os.path.join(ckdir, "w"), "uint8", [self.n * self.CHUNK],
                     files["w"][r * self.CHUNK:(r + 1) * self.CHUNK],
                     offsets=[r * self.CHUNK], sizes=[self.CHUNK])
        write_backwards(os.path.join(ckdir, f"r{r}", "big.bin"), files[f"r{r}/big.bin"])
        write_file(os.path.join(ckdir, f"r{r}", "small"), files[f"r{r}/small"])


class CrashChecks:
    """Checks shared by the single-rank and the multi-rank matrix."""

    def check_backing(self, backing, committed, victim, outcome):
        """After the remount: committed names only, each complete."""
        names = set(os.listdir(backing))
        want = set(committed) | ({victim} if outcome else set())
        self.assertEqual(names, want, f"BACKING_DIR after the remount ({outcome=})")
        for n in want:
            left = sorted(f for f in os.listdir(os.path.join(backing, n))
                          if not f.endswith(".distcp") and f != ".metadata")
            self.assertEqual(left, [], f"{n}: stale files in its directory")
        r = fsck(backing)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def check_view(self, mnt, contents):
        listed = set(os.listdir(mnt))
        for c in contents:
            self.assertIn(c.name, listed)
            self.assertEqual(status(os.path.join(mnt, c.name)).split("\n")[0], "committed")
            for path, data in c.files().items():
                got = read_all(os.path.join(mnt, c.name, path))
                self.assertTrue(got == data, f"{c.name}/{path}: {len(got)} bytes "
                                f"read, {len(data)} saved, first difference at "
                                f"{next((i for i, (a, b) in enumerate(zip(got, data)) if a != b), None)}")


# ---- one rank ----------------------------------------------------------------

class OneRank(CkptfsTestCase, CrashChecks):
    OPTS = "staging_mem=8M,commit_timeout=30"

    def crash_case(self, point, mode, expect_committed):
        before = Content("before", 1)
        m = self.mount(self.OPTS)
        before.stage(self.ck("before"), 0)
        commit(self.ck("before"))
        self.assertEqual(m.stop(), 0)

        victim = Content("victim", 1)
        m = self.mount(self.OPTS, env={"CKPTFS_FAILPOINT": point})
        victim.stage(self.ck("victim"), 0)
        err = None
        try:
            commit(self.ck("victim"), mode)
            if mode == "async":
                wait_state(self.ck("victim"), timeout=60)
        except OSError as e:
            err = e
        rc = m.wait(60)
        self.assertEqual(rc, -signal.SIGKILL,
                         f"{point}: the daemon did not die there ({err!r})\n"
                         + read_log(self.log))
        self.assertIn("failpoint reached", read_log(self.log))
        unmount_dead(self.mnt)

        m = self.mount(self.OPTS)
        present = os.path.exists(self.bk("victim", ".metadata"))
        self.assertEqual(present, expect_committed, f"{point} {mode}")
        self.check_backing(self.backing, ["before"], "victim", present)
        self.check_view(self.mnt, [before] + ([victim] if present else []))
        if not present:
            # the name is free: the same save succeeds now
            self.assertNotIn("victim", os.listdir(self.mnt))
            victim.stage(self.ck("victim"), 0)
            commit(self.ck("victim"), mode)
            wait_state(self.ck("victim"), timeout=60)
            self.check_view(self.mnt, [before, victim])
        self.assertEqual(m.stop(), 0)
        self.check_backing(self.backing, ["before", "victim"], "victim", True)
        shutil.rmtree(self.backing)


def _one_rank_case(point, mode, committed):
    def test(self):
        self.crash_case(point, mode, committed)
    return test


# The README's test command runs every point in one mode (sync and async
# in turn); CKPT_CRASH_ALL=1 (the long run integration_crash_all_points)
# runs each in both.
ALL = os.environ.get("CKPT_CRASH_ALL") == "1"

for _i, (_point, _committed) in enumerate(POINTS):
    for _mode in ("sync", "async"):
        if ALL or _mode == ("sync", "async")[_i % 2]:
            setattr(OneRank, f"test_{_point.replace(':', '_')}_{_mode}",
                    _one_rank_case(_point, _mode, _committed))


class KillFromOutside(CkptfsTestCase, CrashChecks):
    """SIGKILL sent by another process while the data files are written
    (the point is not chosen by the daemon)."""

    def test_sigkill_while_writing(self):
        before = Content("before", 1)
        m = self.mount("staging_mem=8M")
        before.stage(self.ck("before"), 0)
        commit(self.ck("before"))
        self.assertEqual(m.stop(), 0)
        outcomes = []
        for attempt in range(4):
            victim = Content(f"victim{attempt}", 1)
            m = self.mount("staging_mem=8M,io_threads=1")
            os.mkdir(self.ck(victim.name))
            # 192 MiB written backwards: long enough to be killed mid-way
            big = pattern(victim.name, 192 * MiB)
            write_backwards(self.ck(victim.name, "big.bin"), big, piece=8 * MiB)
            commit(self.ck(victim.name), "async")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                st = status(self.ck(victim.name))
                if st.startswith("committed") or "bytes" in st and not st.split("bytes ")[1].startswith("0 "):
                    break
                time.sleep(0.001)
            os.kill(m.proc.pid, signal.SIGKILL)
            self.assertEqual(m.wait(30), -signal.SIGKILL)
            unmount_dead(self.mnt)
            m = self.mount("staging_mem=8M")
            present = os.path.exists(self.bk(victim.name, ".metadata"))
            outcomes.append(present)
            self.check_backing(self.backing, ["before"], victim.name, present)
            self.check_view(self.mnt, [before])
            if present:
                self.assertEqual(read_all(self.ck(victim.name, "big.bin")), big)
                shutil.rmtree(self.ck(victim.name))
            self.assertEqual(m.stop(), 0)
        # at least one kill landed before the commit completed
        self.assertIn(False, outcomes)


class KilledWriter(CkptfsTestCase):
    """The trainer killed while its sync commit waits for the other rank
    (the commit runs inside its write to .commit): it leaves the kernel at
    once (the daemon answers the kernel's interrupt with EINTR), not after
    the save (up to 2 x commit_timeout in state D); the save goes on and
    commits once the other rank commits."""

    def test_killed_writer_leaves_the_kernel_at_once(self):
        w = self.start_world(2, "commit_timeout=60")
        for r in range(2):
            os.mkdir(os.path.join(w.mnt(r), "c"))
            write_file(os.path.join(w.mnt(r), "c", f"w{r}"), os.urandom(4096) * (r + 1))
        ck0 = os.path.join(w.mnt(0), "c")
        writer = subprocess.Popen(["sh", "-c", f"echo sync > {ck0}/.commit"])
        # rank 0's save waits for rank 1 in the collective
        cu.wait_until(lambda: "waiting for" in status(ck0), 30,
                      "rank 0 waiting for rank 1")
        time.sleep(0.2)  # the writer is inside its write (state D)
        t0 = time.monotonic()
        writer.kill()
        try:
            writer.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.fail("the writer killed during its sync commit was still in the "
                      f"kernel 5 s after SIGKILL: {status(ck0)!r}")
        took = time.monotonic() - t0
        self.assertLess(took, 1.0, f"left the kernel {took:.2f} s after SIGKILL")
        # the save went on: rank 1's commit completes it on both ranks
        commit(os.path.join(w.mnt(1), "c"))
        wait_state(ck0, ("committed",), timeout=60)
        self.assertEqual(status(ck0).split("\n")[0], "committed")
        self.assertIn("killed: answered", read_log(w.log))


# ---- worlds ------------------------------------------------------------------

class WorldCase(CkptfsTestCase, CrashChecks):
    """Worlds of 2 ranks save; the remount is at 1 or 3 ranks."""

    OPTS = "staging_mem=8M,commit_timeout=20"

    def world(self, n, failpoint=None, recovery=False):
        """A started world of n ranks over self.backing, leaks not checked
        (a killed rank's memory is never freed); failpoint: the ranks'
        CKPTFS_FAILPOINT; recovery: mpirun --enable-recovery, over TCP (the
        job goes on when a rank dies)."""
        more = {"mpirun_args": ["--enable-recovery"], "transport": "tcp"} if recovery else {}
        return self.start_world(n, self.OPTS, leak_check=False, stop_timeout=30,
                                env_extra={"CKPTFS_FAILPOINT": failpoint} if failpoint else None,
                                **more)

    def stage_commit(self, w, content, mode, stage=True):
        """Stage content on every rank and commit; the commits' errors."""
        for r in range(w.n if stage else 0):
            content.stage(os.path.join(w.mnt(r), content.name), r)
        errs = {}

        def one(r):
            try:
                commit(os.path.join(w.mnt(r), content.name), mode)
                if mode == "async":
                    wait_state(os.path.join(w.mnt(r), content.name), timeout=90)
            except OSError as e:
                errs[r] = e
        ts = [threading.Thread(target=one, args=(r,)) for r in range(w.n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(150)
        return errs

    def crash_case(self, point, rank, mode, remount_n):
        before = Content("before", 2)
        w = self.world(2)
        self.assertEqual(self.stage_commit(w, before, "sync"), {})
        self.assertEqual(w.stop(), 0)

        victim = Content("victim", 2)
        spec = point if rank is None else f"{point}@{rank}"
        w = self.world(2, failpoint=spec)
        self.stage_commit(w, victim, mode)
        deadline = time.monotonic() + 60
        while not w.dead() and time.monotonic() < deadline:
            # a surviving rank's commit failed; the job ends at unmount
            time.sleep(0.1)
        w.stop(timeout=30)
        self.assertIn("failpoint reached", read_log(w.log, limit=1 << 24))

        w = self.world(remount_n)
        present = os.path.exists(os.path.join(self.backing, "victim", ".metadata"))
        if rank in (None, 0) or point in ("local_plan", "write_begin", "write_data",
                                          "write_data:2"):
            expect = dict(POINTS)[point]
            self.assertEqual(present, expect, f"{spec} {mode}")
        self.check_backing(self.backing, ["before"], "victim", present)
        for r in range(remount_n):
            self.check_view(w.mnt(r), [before] + ([victim] if present else []))
        self.assertEqual(w.stop(), 0)
        return present


class Worlds(WorldCase):
    """The matrix of kill points in worlds (tests added below)."""


# Which rank dies, where, and the world size of the remount: each point
# at least once; the coordinator alone, a client alone, every rank.
WORLD_CASES = [
    ("local_plan", 1, "sync", 1),
    ("global_plan", 0, "async", 3),
    ("write_begin", None, "sync", 1),
    ("write_data:2", 1, "async", 3),
    ("write_data", None, "sync", 3),
    ("write_done", 1, "sync", 1),
    ("metadata_tmp", 0, "sync", 3),
    ("metadata_rename", 0, "async", 1),
    ("metadata_synced", None, "sync", 3),
    ("committed", 1, "async", 1),
]


def _world_case(point, rank, mode, n):
    def test(self):
        self.crash_case(point, rank, mode, n)
    return test


# the README's test command: 6 of them (the coordinator, a client and
# every rank dying, sync and async, remounts of 1 and 3); all with
# CKPT_CRASH_ALL=1
DEFAULT_WORLD_CASES = (0, 1, 3, 6, 8, 9)

for _i, (_point, _rank, _mode, _n) in enumerate(WORLD_CASES):
    if not ALL and _i not in DEFAULT_WORLD_CASES:
        continue
    _who = "all" if _rank is None else f"rank{_rank}"
    setattr(Worlds, f"test_{_point.replace(':', '_')}_{_who}_{_mode}_remount{_n}",
            _world_case(_point, _rank, _mode, _n))


class RankDies(WorldCase):
    """A client rank dies during the collective save, and the launcher
    keeps the job going: the surviving ranks' commits fail within
    commit_timeout with a reason naming the rank, their mounts keep
    serving what was committed, and a remount finds BACKING_DIR
    consistent. (Under mpirun's default, the job stops instead: the
    Worlds matrix.)"""

    TIMEOUT = 15
    OPTS = f"staging_mem=8M,commit_timeout={TIMEOUT}"

    def dies_at(self, point, mode):
        before = Content("before", 3)
        w = self.world(3)
        self.assertEqual(self.stage_commit(w, before, "sync"), {})
        self.assertEqual(w.stop(), 0)

        w = self.world(3, failpoint=f"{point}@1", recovery=True)
        victim = Content("victim", 3)
        for r in range(3):
            victim.stage(os.path.join(w.mnt(r), "victim"), r)
        t0 = time.monotonic()
        errs = self.stage_commit(w, victim, mode, stage=False)
        took = time.monotonic() - t0
        self.assertIn("failpoint reached", read_log(w.log, limit=1 << 24))
        for r in (0, 2):
            ckdir = os.path.join(w.mnt(r), "victim")
            if mode == "sync":
                self.assertIn(r, errs, "a survivor's commit succeeded")
            st = status(ckdir)
            self.assertEqual(st.split("\n")[0], "failed", st)
            self.assertRegex(st, r"rank 1 did not (commit|finish writing) victim "
                             rf"within {self.TIMEOUT} s \(commit_timeout\)")
            self.check_view(w.mnt(r), [before])
        # planning and writing take a few seconds; then one commit_timeout,
        # not two
        self.assertLess(took, 1.5 * self.TIMEOUT, "the survivors waited too long")
        w.stop(timeout=30)
        w = self.world(1)
        self.check_backing(self.backing, ["before"], "victim", False)
        self.check_view(w.mnt(0), [before])
        self.assertEqual(w.stop(), 0)

    def test_client_dies_before_its_plan(self):
        self.dies_at("local_plan", "sync")

    def test_client_dies_while_writing(self):
        self.dies_at("write_data", "async")


if __name__ == "__main__":
    cu.main()

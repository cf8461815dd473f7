"""Worlds across simulated nodes (netns.py): rank mounts started by
mount-scripts/ckpt-mount --hostfile on node 0 of a cluster through Open
MPI's rsh launcher with netns-agent, stopped by ckpt-umount, as users do
on a cluster (NetWorld); commits on several ranks at once (Commits); and
the test case of such worlds (NetnsCase): a cluster per test, under a
temporary directory, with BACKING_DIR one directory every node sees (a
shared filesystem) and MOUNTROOT a tmpfs of each node's own, so a rank's
mount is seen on its node only; the test reaches it through
/proc/<node>/root. Used by test_netns.py, test_partner.py,
test_tier_netns.py and bench/tiers.py. Python standard library only.

The scripts' environment (so mpirun's and, through netns-agent, every
rank's) is sanenv.env(mpi=True): in the ASan build Open MPI's never-freed
allocations are suppressed, or with CKPT_MR_LEAK_CHECK=0 leaks are not
checked.
"""

import errno
import glob
import itertools
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import unittest

from . import netns, sanenv, util as cu
from .util import CKPT_MOUNT, CKPT_UMOUNT
from .world import errname, query, read_all, state, status, write_file

DIR_PREFIX = "/tmp/ckptfs-netns-"


def fsck(backing, *names):
    exe = os.path.join(os.path.dirname(cu.BIN), "ckptfs-fsck")
    return subprocess.run([exe, backing, *names], capture_output=True, text=True)


def sweep_stale_dirs():
    """Temporary directories of runs whose process is gone."""
    for d in glob.glob(DIR_PREFIX + "*"):
        m = re.match(re.escape(DIR_PREFIX) + r"(\d+)-", d)
        if m and not netns.alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)


# ---- a world started by ckpt-mount on the nodes ---------------------------------

class NetWorld:
    """Rank mounts started by ckpt-mount --hostfile on node 0 of a cluster:
    slots[i] ranks on node i (block mapping, as mpirun maps a hostfile)."""

    def __init__(self, case, slots, opts, backing, tag):
        self.c = case.cluster
        self.slots = list(slots)
        self.n = sum(slots)
        self.rank_node = [i for i, s in enumerate(slots) for _ in range(s)]
        self.opts = opts
        self.backing = backing
        self.root = case.root
        self.log = os.path.join(case.dir, f"{tag}.log")
        self.hostfile = self.c.hostfile(os.path.join(case.dir, f"{tag}.hosts"), slots)

    def mnt(self, rank):
        """Rank's mount as its node shows it (for this process's file calls)."""
        return self.c.path(self.rank_node[rank], os.path.join(self.root, f"rank{rank}"))

    def local_mnt(self, rank):
        return os.path.join(self.root, f"rank{rank}")

    def mount_argv(self):
        argv = [CKPT_MOUNT, "--hostfile", self.hostfile, "--bin", cu.BIN, "--log", self.log,
                "--timeout", str(self.MOUNT_WAIT)]
        for a in self.c.mpi_args():
            argv.append("--mpirun-arg=" + a)
        if self.opts:
            argv += ["-o", self.opts]
        return argv + [self.backing, self.root]

    MOUNT_WAIT = 60  # ckpt-mount's own --timeout (its default)

    def mount(self, timeout=180):
        """ckpt-mount on node 0. Should it still wait 10 s before its
        --timeout, every node's processes are noted (r.snapshot): where a
        launch that never started a daemon was stuck."""
        t0 = time.monotonic()
        snap = []
        timer = threading.Timer(self.MOUNT_WAIT - 10, lambda: snap.append(self.node_ps()))
        timer.daemon = True
        timer.start()
        try:
            r = self.c.run(0, self.mount_argv(), env=self.c.env(sanenv.env(mpi=True)),
                           timeout=timeout)
        finally:
            timer.cancel()
            timer.join()  # a snapshot being taken is finished first
        r.seconds = time.monotonic() - t0
        r.snapshot = snap[0] if snap else ""
        return r

    def node_ps(self):
        """Every node's processes: pid, state, kernel wait channel, argv."""
        out = []
        for i in range(self.c.n):
            out.append(f"node {i}:")
            for p in self.c.processes(i):
                try:
                    with open(f"/proc/{p}/stat") as f:
                        st = f.read().rsplit(")", 1)[1].split()[0]
                    with open(f"/proc/{p}/wchan") as f:
                        wchan = f.read().strip()
                    argv = b" ".join(netns.cmdline(p) or []).decode(errors="replace")
                except OSError:
                    continue
                out.append(f"  {p} {st} {wchan or '-'} {argv[:200]}")
        return "\n".join(out)

    def daemon_lines(self):
        """Lines the daemons (not ckpt-mount, not mpirun's command line)
        wrote to the log."""
        return [ln for ln in self.log_text().splitlines() if ln.startswith("ckptfs")]

    def umount(self, *args, timeout=300):
        t0 = time.monotonic()
        r = self.c.run(0, [CKPT_UMOUNT, *args, self.root], env=self.c.env(sanenv.env(mpi=True)),
                       timeout=timeout)
        r.seconds = time.monotonic() - t0
        return r

    def ckpt_mounts(self):
        """{node: [mount points of fuse.ckptfs under MOUNTROOT]}."""
        return {i: sorted(mp for mp, _ in self.c.mounts(i, self.root, "fuse.ckptfs"))
                for i in range(self.c.n)}

    def launcher_pid(self):
        """mpirun's pid (ckpt-mount's pid file on node 0)."""
        with open(self.c.path(0, os.path.join(self.root, ".ckpt-mount.pid"))) as f:
            return int(f.read().split()[0])

    def daemon_pid(self, rank):
        """The ckptfs process of rank (on its node), or None."""
        want = f"OMPI_COMM_WORLD_RANK={rank}".encode()
        for p in self.c.processes(self.rank_node[rank]):
            argv = netns.cmdline(p)
            if not argv or os.path.basename(argv[0]) != b"ckptfs":
                continue
            try:
                with open(f"/proc/{p}/environ", "rb") as f:
                    if want in f.read().split(b"\0"):
                        return p
            except OSError:
                pass
        return None

    def log_text(self):
        return cu.read_log(self.log, limit=1 << 24)


class Commits:
    """Commits of one name on several ranks at once, a thread each; the
    outcome of each rank as it comes: results[r] = (None or the OSError,
    monotonic time it returned)."""

    def __init__(self, world, name, mode="sync", ranks=None):
        self.ranks = list(range(world.n) if ranks is None else ranks)
        self.results = {}
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._threads = []
        for r in self.ranks:
            t = threading.Thread(target=self._one, args=(world, r, name, mode), daemon=True)
            t.start()
            self._threads.append(t)

    def _one(self, world, r, name, mode):
        try:
            cu.commit(os.path.join(world.mnt(r), name), mode)
            out = None
        except OSError as e:
            out = e
        with self._lock:
            self.results[r] = (out, time.monotonic())

    def done(self, ranks=None):
        with self._lock:
            return all(r in self.results for r in (self.ranks if ranks is None else ranks))

    def wait(self, ranks=None, timeout=120):
        deadline = time.monotonic() + timeout
        while not self.done(ranks):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


# ---- the test case ----------------------------------------------------------------

class NetnsCase(unittest.TestCase):
    """A cluster of NODES simulated nodes per test, under a temporary
    directory: BACKING (shared), MNT (each node's own MOUNTROOT)."""

    NODES = 2
    PRIVATE_BACKING = False  # a BACKING_DIR of each node's own at one path
    PRIVATE_TIER = False  # self.tier: a node-local tier (tmpfs) per node
    _seq = itertools.count()

    def setUp(self):
        if not os.path.exists("/dev/fuse"):
            self.fail("/dev/fuse is missing: cannot mount ckptfs")
        if not shutil.which("mpirun"):
            self.fail("mpirun is missing: cannot start a world")
        netns.sweep_stale()  # first the processes of runs that died, then their files
        sweep_stale_dirs()
        self.dir = f"{DIR_PREFIX}{os.getpid()}-{next(self._seq)}"
        os.makedirs(self.dir)
        self.backing = os.path.join(self.dir, "backing")
        self.root = os.path.join(self.dir, "mnt")
        private = [self.root]
        if self.PRIVATE_BACKING:
            self.local_backing = os.path.join(self.dir, "node-backing")
            private.append(self.local_backing)
        self.tier = os.path.join(self.dir, "tier")
        if self.PRIVATE_TIER:
            private.append(self.tier)
        self.worlds = []
        self.cluster = netns.Cluster(self.NODES, self.dir, private_dirs=private)
        self.addCleanup(self._cleanup)
        try:
            self.cluster.start()
        except netns.Unavailable as e:
            self.skipTest(f"cannot simulate nodes with network namespaces here: {e}")

    def _cleanup(self):
        self.cluster.destroy()  # the nodes' processes, mounts and namespaces
        text = "".join(w.log_text() for w in self.worlds)
        if os.environ.get("CKPT_MR_KEEP") == "1":
            sys.stderr.write(f"\nkept {self.dir}\n")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        bad = cu.sanitizer_report(text)
        if bad:
            self.fail(f"sanitizer report in the daemons' output: {bad}\n"
                      f"{text[text.index(bad):][:6000]}")

    # ---- worlds
    def world(self, slots, opts="commit_timeout=5", backing=None, tag=None):
        w = NetWorld(self, slots, opts, backing or self.backing,
                     tag or f"world{len(self.worlds)}")
        self.worlds.append(w)
        return w

    def start_world(self, slots, opts="commit_timeout=5", backing=None, tag=None):
        """ckpt-mount --hostfile on node 0: every rank mounted on its own
        node, on no other."""
        w = self.world(slots, opts, backing, tag)
        r = w.mount()
        if r.returncode != 0 and "not mounted within" in r.stderr and not w.daemon_lines():
            # ckpt-mount waited its whole --timeout and no daemon wrote a
            # line (not even a start error): Open MPI's launch over the
            # simulated nodes stalled (seen once in a CI run, with an
            # empty log; never here). Launched once more, loudly, with
            # where every process was. Any other failure fails at once.
            sys.stderr.write(f"\nnote: ckpt-mount failed ({r.seconds:.1f}s) before any daemon "
                             f"wrote a line; launching once more\n{r.stderr}\n"
                             f"processes 10 s before it gave up:\n{r.snapshot}\n")
            r = w.mount()
        self.assertEqual(r.returncode, 0, f"ckpt-mount failed ({r.seconds:.1f}s):\n{r.stderr}\n"
                                          f"--- log ---\n{w.log_text()[-4000:]}\n"
                                          f"--- processes 10 s before it gave up ---\n"
                                          f"{r.snapshot}")
        want = [w.local_mnt(k) for k in range(w.n)]
        self.assertEqual(r.stdout.splitlines(), want)
        got = w.ckpt_mounts()
        for i in range(self.cluster.n):
            self.assertEqual(got[i], [w.local_mnt(k) for k in range(w.n) if w.rank_node[k] == i],
                             f"node {i}: rank mounts {got}")
        return w

    def umount_ok(self, w, *args):
        r = w.umount(*args)
        self.assertEqual(r.returncode, 0, f"ckpt-umount failed:\n{r.stderr}\n"
                                          f"--- log ---\n{w.log_text()[-4000:]}")
        self.assertIn("exited with code 0", r.stderr)
        self.assertNoMounts(w)
        self.assertNoDaemons()
        self.assertNoRankDirs(w)
        return r

    def assertNoRankDirs(self, w):
        """The rank directories ckpt-mount made on each node went with the
        mounts (the stop job removes each node's), and so did the record."""
        left = {i: sorted(d for d in os.listdir(self.cluster.path(i, w.root))
                          if d.startswith("rank") or d == ".ckpt-mount.made")
                for i in range(self.cluster.n)}
        self.assertEqual({i: d for i, d in left.items() if d}, {},
                         "rank directories left under MOUNTROOT (node: entries)")

    def assertNoMounts(self, w, msg=""):
        left = {i: m for i, m in w.ckpt_mounts().items() if m}
        self.assertEqual(left, {}, f"rank mounts left under {self.root} (node: mounts){msg}")

    def assertNoDaemons(self, timeout=20):
        """No ckptfs, orted or mpirun left on any node."""
        deadline = time.monotonic() + timeout
        while True:
            left = []
            for i in range(self.cluster.n):
                for p in self.cluster.processes(i):
                    argv = netns.cmdline(p)
                    if argv and os.path.basename(argv[0]) in (b"ckptfs", b"orted", b"mpirun") \
                            and netns.alive(p):
                        left.append((i, p, b" ".join(argv).decode(errors="replace")))
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.assertEqual(left, [], "processes left on the nodes")

    # ---- commits and checks
    def assertCommitted(self, res, w, name):
        bad = {r: errname(e) for r, (e, _) in res.items() if e is not None}
        if bad:
            self.fail(f"commits of {name} failed: {bad}\n" + "\n".join(
                f"rank {r}: {status(os.path.join(w.mnt(r), name))!r}" for r in sorted(bad)))
        self.assertEqual(sorted(res), list(range(w.n)))

    def commit_all(self, w, name, mode="sync", timeout=180):
        c = Commits(w, name, mode)
        if not c.wait(timeout=timeout):
            self.fail(f"commits of {name} did not return within {timeout}s: "
                      f"{sorted(c.results)} returned")
        return c.results

    def assertNamesRank(self, text, rank, msg=None):
        self.assertRegex(text, rf"\brank\W{{0,3}}{rank}\b", msg)

    def assertFailedCommit(self, w, name, r, res):
        e = res[0]
        st = status(os.path.join(w.mnt(r), name))
        self.assertIsInstance(e, OSError, f"rank {r}: the commit of {name} did not fail; "
                                          f".status: {st!r}")
        self.assertEqual(e.errno, errno.EIO, f"rank {r}: {e!r}")
        self.assertEqual(st.split("\n", 1)[0].strip(), "failed", f"rank {r}: {st!r}")
        return st

    def assertNothingPublished(self, w, name, backing=None):
        d = os.path.join(backing or self.backing, name)
        self.assertFalse(os.path.exists(os.path.join(d, ".metadata")),
                         f"{name} was published")
        if os.path.isdir(d):
            left = [f for f in os.listdir(d) if f.endswith(".distcp") or f.startswith(".metadata")]
            self.assertEqual(left, [], f"left behind in {d}")
        for r in range(w.n):
            self.assertNotEqual(state(os.path.join(w.mnt(r), name)), "committed",
                                f"rank {r} shows {name} committed")

    def wait_no_saves(self, timeout=30):
        """BACKING_DIR/.saves holds no save in flight (a failed save's files
        are removed by every rank that wrote)."""
        saves = os.path.join(self.backing, ".saves")
        deadline = time.monotonic() + timeout
        while os.path.isdir(saves) and os.listdir(saves) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(os.path.isdir(saves) and os.listdir(saves),
                         f"files of a failed save left in {saves}: "
                         f"{[(d, os.listdir(os.path.join(saves, d))) for d in os.listdir(saves)]}"
                         if os.path.isdir(saves) else "")

    def assertFsckClean(self, *names):
        r = fsck(self.backing, *names)
        self.assertEqual(r.returncode, 0, f"ckptfs-fsck {self.backing}:\n{r.stdout}{r.stderr}")

    def verify(self, w, name, items, saved_n, ranks=None, borders=True):
        """Every rank of w shows the checkpoint exactly: listing, xattrs,
        whole files, and preads around every shard border."""
        tensors = [it for it in items if it.kind == "tensor"]
        blobs = [it for it in items if it.kind == "bytes"]
        want_files = {it.path for it in items} | {".metadata"}
        for r in (range(w.n) if ranks is None else ranks):
            ck = os.path.join(w.mnt(r), name)
            self.assertEqual(state(ck), "committed", f"rank {r}: {name}")
            seen = set()
            for dirpath, _, files in os.walk(ck):
                for f in files:
                    seen.add(os.path.relpath(os.path.join(dirpath, f), ck))
            self.assertEqual(seen, want_files, f"rank {r}: listing of {name}")
            for t in tensors:
                p = os.path.join(ck, t.path)
                msg = f"rank {r} (node {w.rank_node[r]}): {name}/{t.path}"
                self.assertEqual(os.getxattr(p, "user.ckpt.dtype"), t.dtype.encode(), msg)
                self.assertEqual(os.getxattr(p, "user.ckpt.shape"),
                                 ",".join(map(str, t.shape)).encode(), msg)
                got = read_all(p)
                if got != t.data:
                    first = next((i for i, (a, b) in enumerate(zip(got, t.data)) if a != b), None)
                    self.fail(f"{msg}: {len(got)} bytes, {len(t.data)} expected, "
                              f"first difference at {first}")
                if borders:
                    self.check_borders(p, t, msg)
            for b in blobs:
                self.assertEqual(read_all(os.path.join(ck, b.path)), b.data,
                                 f"rank {r}: {name}/{b.path}")
        kv = dict(self.query(w, 0, name, "select key, value from checkpoint"))
        self.assertEqual(str(kv.get("world_size")), str(saved_n), f"{name}: world_size")

    def query(self, w, rank, name, sql):
        """sql on NAME/.metadata as rank's mount shows it. SQLite resolves
        the symbolic link /proc/PID/root (to this process's root), so it
        reads a copy."""
        copy = os.path.join(self.dir, f"query-{name}-{rank}.db")
        write_file(copy, read_all(os.path.join(w.mnt(rank), name, ".metadata")))
        try:
            return query(copy, sql)
        finally:
            os.unlink(copy)

    def check_borders(self, p, t, msg):
        """pread across every place where one chunk meets another, through
        the page cache and with O_DIRECT (the daemon gets the exact
        unaligned ranges)."""
        size = len(t.data)
        row = t.shape[-1] * t.isz
        for flags in (0, os.O_DIRECT):
            fd = os.open(p, os.O_RDONLY | flags)
            try:
                for b in t.boundaries():
                    for delta in (-3, -1, 0, 1):
                        off = min(max(0, b + delta), size)
                        for n in (1, 7, row + 5):
                            got = b""
                            while len(got) < n:
                                piece = os.pread(fd, n - len(got), off + len(got))
                                if not piece:
                                    break
                                got += piece
                            self.assertEqual(got, t.data[off:off + n],
                                             f"{msg}: pread({n}, {off}) flags {flags:#o}")
            finally:
                os.close(fd)

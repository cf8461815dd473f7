#!/usr/bin/env python3
"""Partner copies (-o tier=DIR,tier_level=partner) across simulated nodes
(network namespaces, ckpttest/netns.py; ranks started by ckpt-mount
--hostfile as in test_netns.py: ckpttest/networld.py). Each node's tier is
a tmpfs of its own; BACKING_DIR is shared.

    python3 tests/integration/test_partner.py --bin build/bin/ckptfs [Class ...]

Classes:
  Copies        2 nodes x 1 rank, 2 nodes x 2 ranks, and 2 ranks and 1
                (rank 2 keeps copies for both of node 0): once a sync commit
                at tier_level=partner returns, every data file of every rank
                is in its partner's node's tier too (the same names, the
                same bytes), and the partner copies are the only files of
                other nodes' ranks there
  KilledPartner 2 nodes x 2 ranks, mpirun --enable-recovery: rank 2's
                daemon dies (SIGKILL, CKPTFS_FAILPOINT partner_synced) once
                its first partner copy is in: ranks 0, 1 and 3 fail the
                commit, naming rank 2; nothing is published in BACKING_DIR
                or any tier, and the partner copies the survivors received
                are gone
  HungPartner   2 nodes x 1 rank: rank 1's daemon stopped (SIGSTOP) while
                rank 0 waits for its copies: rank 0 fails at commit_timeout
                saying what did not come, rank 1 too once continued; the
                next commit drops the late frames and commits exact copies
  PartnerFlush  2 nodes x 1 rank, every node alive: the owners' flushes
                copy every file once, the partner records are dropped,
                nothing of the partner copies is copied (and with
                partner_grace=0 it is: the count can fail)
  OneNode       2 ranks on one node, and one daemon without mpirun: the
                commit fails on every rank, saying that partner copies need
                two nodes; tier_level=partner without tier= is refused at
                mount
  Timing        (CKPT_PARTNER_BENCH=1 only) the sync commit of 64 MiB per
                rank, 2 nodes x 1 rank, at tier_level=partner against local,
                interleaved rounds; prints the ratio

Skipped where the namespaces cannot be made (see test_netns.py).
"""

import errno
import glob
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import unittest

from ckpttest import netns, sanenv, util as cu
from ckpttest.networld import Commits, NetnsCase
from ckpttest.world import Blob, read_all, stage, status

MiB = 1 << 20


def blobs(n, per_rank, seed):
    """Two files of random bytes per rank, per_rank bytes in all."""
    out = []
    for r in range(n):
        for k in range(2):
            data = os.urandom(per_rank // 2 - 4096 * k)
            out.append(Blob(f"rank{r}/part{k}-{seed}", {r: data}))
    return out


class PartnerCase(NetnsCase):
    """Every node's tier is a private tmpfs: the node-local directory that
    NetnsCase makes for PRIVATE_BACKING (each node sees its own at one
    path); BACKING_DIR stays the shared one."""

    PRIVATE_BACKING = True
    OPTS = "commit_timeout=20,io_threads=2,flush_rate=1K"

    def setUp(self):
        super().setUp()
        self.tier = self.local_backing

    def partner_world(self, slots, level="partner", extra="", tag=None):
        opts = f"{self.OPTS},tier={self.tier},tier_level={level}"
        return self.start_world(slots, opts=opts + (f",{extra}" if extra else ""), tag=tag)

    # ---- where the data files are
    def partner_of(self, w, rank):
        """The same index among its node's ranks, on the next node."""
        nodes = sorted(set(w.rank_node))
        node = w.rank_node[rank]
        idx = [r for r in range(w.n) if w.rank_node[r] == node].index(rank)
        nxt = nodes[(nodes.index(node) + 1) % len(nodes)]
        on_next = [r for r in range(w.n) if w.rank_node[r] == nxt]
        return on_next[idx % len(on_next)]

    def tier_files(self, node, name):
        """{file name: path} of the data files of checkpoint name in node's
        tier: TIER/NAME once published on that node, else the save's own
        directory TIER/.saves/SAVE_ID (one save in flight at most)."""
        root = self.cluster.path(node, self.tier)
        dirs = [os.path.join(root, name)]
        if not os.path.isdir(dirs[0]):
            dirs = glob.glob(os.path.join(root, ".saves", "*"))
        out = {}
        for d in dirs:
            for f in os.listdir(d):
                if f.endswith(".distcp"):
                    out[f] = os.path.join(d, f)
        return out

    def assertPartnerCopies(self, w, name):
        """Every rank's data files of name: in its own node's tier and,
        byte for byte, in its partner's node's tier; each tier holds its
        node's ranks' files and the copies for the previous node, no
        more."""
        files = {i: self.tier_files(i, name) for i in set(w.rank_node)}
        want = {i: set() for i in files}
        for r in range(w.n):
            own = sorted(f for f in files[w.rank_node[r]] if f.startswith(f"__{r}_"))
            self.assertTrue(own, f"rank {r}: no data file of {name} in its tier "
                                 f"(node {w.rank_node[r]}): {sorted(files[w.rank_node[r]])}")
            p = self.partner_of(w, r)
            pn = w.rank_node[p]
            self.assertNotEqual(pn, w.rank_node[r])
            for f in own:
                self.assertIn(f, files[pn], f"rank {r}'s {f}: no partner copy on node {pn} "
                                            f"(rank {p}'s tier): {sorted(files[pn])}")
                a = read_all(files[w.rank_node[r]][f])
                b = read_all(files[pn][f])
                self.assertEqual(len(a), len(b), f"{f}: sizes on nodes {w.rank_node[r]}, {pn}")
                self.assertTrue(a == b, f"{f}: the partner copy on node {pn} differs")
                want[w.rank_node[r]].add(f)
                want[pn].add(f)
        for i in files:
            self.assertEqual(set(files[i]), want[i], f"node {i}'s tier holds other files")


class Copies(PartnerCase):
    NODES = 2

    def one_world(self, slots, per_rank):
        w = self.partner_world(slots)
        n = sum(slots)
        items = blobs(n, per_rank, seed=1)
        stage(w, "step-1", items)
        self.assertCommitted(self.commit_all(w, "step-1"), w, "step-1")
        self.assertPartnerCopies(w, "step-1")
        for r in range(n):  # (flush_rate=1K: not flushed yet)
            st = status(os.path.join(w.mnt(r), "step-1"))
            self.assertIn("\nlocation partner\n", st, f"rank {r}: {st!r}")
        # the next save too (a second round of the exchange)
        items2 = blobs(n, per_rank // 2, seed=2)
        stage(w, "step-2", items2)
        self.assertCommitted(self.commit_all(w, "step-2"), w, "step-2")
        self.assertPartnerCopies(w, "step-2")
        for r in range(n):
            for it in items2:
                if r in it.copies:
                    self.assertEqual(read_all(os.path.join(w.mnt(r), "step-2", it.path)),
                                     it.data, f"rank {r}: step-2/{it.path}")
        self.umount_ok(w)

    def test_two_nodes_one_rank(self):
        self.one_world([1, 1], 24 * MiB)

    def test_two_nodes_two_ranks(self):
        self.one_world([2, 2], 12 * MiB)

    def test_uneven_nodes(self):
        # ranks 0 and 1 on node 0 both have rank 2 (node 1) as partner
        self.one_world([2, 1], 8 * MiB)


class KilledPartner(PartnerCase):
    NODES = 2
    OPTS = "commit_timeout=3,io_threads=2,flush_rate=1K"

    def start_with(self, failpoint, recovery=False):
        """The 2 x 2 world, its daemons with CKPTFS_FAILPOINT=failpoint;
        recovery: mpirun --enable-recovery (the others keep running when a
        rank dies; by default mpirun ends the world)."""
        w = self.world([2, 2], opts=f"{self.OPTS},tier={self.tier},tier_level=partner")
        argv = w.mount_argv()
        argv[1:1] = ["--mpirun-arg=-x", "--mpirun-arg=CKPTFS_FAILPOINT"]
        if recovery:
            argv[1:1] = ["--mpirun-arg=--enable-recovery"]
        env = dict(self.cluster.env(sanenv.env(mpi=True)), CKPTFS_FAILPOINT=failpoint)
        r = self.cluster.run(0, argv, env=env, timeout=180)
        if r.returncode != 0 and recovery and "enable-recovery" in r.stderr + w.log_text():
            self.skipTest(f"this mpirun has no --enable-recovery: {r.stderr[-500:]}")
        self.assertEqual(r.returncode, 0, f"ckpt-mount failed:\n{r.stderr}\n{w.log_text()[-3000:]}")
        return w

    def assertNothingLeft(self, w, name, dead=()):
        """name is published nowhere; of its files, only those of the dead
        ranks (their own, and the copies they took) are left in a tier."""
        self.assertFalse(os.path.exists(os.path.join(self.backing, name)))
        for i in range(2):
            self.assertFalse(os.path.exists(self.cluster.path(i, os.path.join(self.tier, name))),
                             f"{name} is published in node {i}'s tier")
        owners = {f"__{r}_" for r in dead} | {f"__{p}_" for p in range(w.n) if
                                               any(self.partner_of(w, p) == d for d in dead)}
        for i in range(2):
            left = sorted(self.tier_files(i, name))
            self.assertEqual([f for f in left if f[:f.index("_", 2) + 1] not in owners], [],
                             f"node {i}'s tier still holds files of {name}")
            # flush records: own (SAVE_ID.R) and partner ones (SAVE_ID.OWNER)
            recs = [os.path.basename(f) for f in glob.glob(
                os.path.join(self.cluster.path(i, self.tier), ".flush", "[!.]*"))]
            self.assertEqual([f for f in recs if f"__{f.rsplit('.', 1)[1]}_" not in owners], [],
                             f"node {i}'s tier still holds flush records of {name}")

    def test_partner_killed_mid_exchange(self):
        # rank 2 (node 1) dies once its copy of rank 0's first data file
        # is in and synced, its own files maybe still on their way
        w = self.start_with("partner_synced@2", recovery=True)
        stage(w, "lost", blobs(4, 32 * MiB, seed=3))
        pid2 = w.daemon_pid(2)
        self.assertIsNotNone(pid2)
        c = Commits(w, "lost")
        self.assertTrue(c.wait([0, 1, 3], timeout=120),
                        f"ranks 0, 1 and 3 still wait: {sorted(c.results)} returned")
        self.assertTrue(c.wait([2], timeout=30), "rank 2's commit did not return")
        self.assertFalse(netns.alive(pid2), "rank 2's daemon did not die at partner_synced")
        self.assertIsInstance(c.results[2][0], OSError, "rank 2's commit succeeded")
        for r in (0, 1, 3):
            st = self.assertFailedCommit(w, "lost", r, c.results[r])
            self.assertNamesRank(st, 2, f"rank {r}: .status must name rank 2: {st!r}")
            self.assertIn("partner copies", st, f"rank {r}: {st!r}")
        self.assertNothingLeft(w, "lost", dead=[2])

    def test_partner_cannot_write(self):
        # rank 3 cannot make its copy of rank 1's files (a full tier)
        w = self.start_with("partner_open@3=ENOSPC")
        stage(w, "full", blobs(4, 4 * MiB, seed=5))
        res = self.commit_all(w, "full")
        for r in range(4):
            st = self.assertFailedCommit(w, "full", r, res[r])
            self.assertNamesRank(st, 3, f"rank {r}: .status must name rank 3: {st!r}")
            self.assertIn(os.strerror(errno.ENOSPC), st, f"rank {r}: {st!r}")
        self.assertNothingLeft(w, "full")
        # the next save commits, copies and all
        stage(w, "next", blobs(4, 4 * MiB, seed=6))
        self.assertCommitted(self.commit_all(w, "next"), w, "next")
        self.assertPartnerCopies(w, "next")
        self.umount_ok(w, "--discard")  # "full" is still staged, failed


class HungPartner(PartnerCase):
    NODES = 2
    OPTS = "commit_timeout=3,io_threads=2,flush_rate=1K"

    def test_partner_stopped_then_next_commit(self):
        # rank 1's daemon is stopped (SIGSTOP) while rank 0 waits for its
        # partner copies: rank 0 gives up at commit_timeout saying what
        # did not come; rank 1, continued, fails too. Its frames of that
        # round are still on their way to rank 0: the next commit must
        # drop them and commit with exact copies.
        w = self.partner_world([1, 1])
        stage(w, "hung", blobs(2, 96 * MiB, seed=7))
        pid1 = w.daemon_pid(1)
        c = Commits(w, "hung")
        st0 = ""
        while "partner copies" not in st0 and not c.done([0]):
            st0 = status(os.path.join(w.mnt(0), "hung"))
        if c.done([0]):
            self.skipTest(f"rank 0's exchange ended before it was seen: {c.results}")
        os.kill(pid1, signal.SIGSTOP)
        try:
            self.assertIn("waiting for rank 1 (node 1) to take this rank's partner copies and "
                          "to send its own (commit_timeout)", st0)
            self.assertTrue(c.wait([0], timeout=60), "rank 0 still waits")
        finally:
            os.kill(pid1, signal.SIGCONT)
        st = self.assertFailedCommit(w, "hung", 0, c.results[0])
        self.assertRegex(st, r"rank 0: partner copies not done within 3 s \(commit_timeout\): "
                             r"\d+ of \d+ bytes came from rank 1 \(node 1\)|nothing came from "
                             r"rank 1", st)
        self.assertTrue(c.wait([1], timeout=60), "rank 1's commit did not return")
        self.assertFailedCommit(w, "hung", 1, c.results[1])
        self.assertNothingPublished(w, "hung")
        after = blobs(2, 8 * MiB, seed=8)
        stage(w, "after", after)
        self.assertCommitted(self.commit_all(w, "after"), w, "after")
        self.assertPartnerCopies(w, "after")
        self.umount_ok(w, "--discard")


class PartnerFlush(PartnerCase):
    """Every node alive: the partner copies are not flushed (fs/tier/flush.c,
    docs/tiers.md "Flush of partner copies"): each owner's flush copies its
    files, and each partner record is dropped. Rank 0 has 8 MiB, rank 1
    1 MiB, flush_rate=4M: node 1's flush looks at rank 0's copies while
    node 0's still copies them (~2 s), node 0's at rank 1's after node 1
    linked them. With partner_grace=0 node 1 copies rank 0's files at once
    (racing its owner: both count), which the count catches: the check
    that the first world's count can fail."""

    NODES = 2
    OPTS = "commit_timeout=20,io_threads=2,flush_rate=4M"

    def one(self, name, extra=""):
        w = self.partner_world([1, 1], extra=extra, tag=name)
        items = [Blob("rank0/big", {0: os.urandom(8 * MiB)}),
                 Blob("rank1/small", {1: os.urandom(1 * MiB)})]
        stage(w, name, items)
        self.assertCommitted(self.commit_all(w, name), w, name)
        # over when both ranks say shared and both partner records are gone
        deadline = time.monotonic() + 120
        while True:
            st = [status(os.path.join(w.mnt(r), name)) for r in range(w.n)]
            log = w.log_text()
            over = set(re.findall(r"the partner copies of rank (\d+) not flushed", log)) | \
                set(re.findall(rf"{name} flushed to \S+ \(rank (\d+)'s files, partner", log))
            records = [f for i in range(2)
                       for f in glob.glob(os.path.join(self.cluster.path(i, self.tier),
                                                       ".flush", "[!.]*"))]
            # each rank's own line is logged after its record went
            own = set(re.findall(rf"{name} flushed to \S+ \(rank (\d+)'s files\)", log))
            if all("location shared" in x for x in st) and over == {"0", "1"} and \
                    own == {"0", "1"} and not records:
                break
            self.assertLess(time.monotonic(), deadline, f"not over: {st}, {sorted(over)}, "
                            f"own {sorted(own)}, "
                            f"records {records}\n--- log ---\n{log[-4000:]}")
            time.sleep(0.2)
        for it in items:
            for r in range(w.n):
                self.assertTrue(read_all(os.path.join(w.mnt(r), name, it.path)) == it.data,
                                f"rank {r}: {name}/{it.path}")
        self.assertEqual(sorted(f for f in os.listdir(os.path.join(self.backing, name))
                                if f.endswith(".distcp")), ["__0_0.distcp", "__1_0.distcp"])
        self.umount_ok(w)
        copied = lambda kind: sorted(int(r) for r in re.findall(  # noqa: E731
            rf"{name} flushed to \S+ \(rank (\d+)'s files{kind}\)", log))
        return copied(""), copied(", partner copies"), log

    def test_all_alive_partners_not_flushed(self):
        own, partner, log = self.one("alive")
        self.assertEqual(own, [0, 1], "each rank's own flush, once")
        self.assertEqual(partner, [], "partner copies flushed with every node alive")
        self.assertRegex(log, r"flush waiting: partner copies of rank 0 kept until its node "
                              r"\(\S+\) flushes them")
        self.assertEqual(sorted(set(re.findall(r"the partner copies of rank (\d+) not flushed "
                                               r"from this tier", log))), ["0", "1"])
        # the check can fail: forced to copy at once, node 1 copies rank 0's
        # files too (rank 1's were linked before node 0 looked)
        own, partner, log = self.one("grace0", "partner_grace=0")
        self.assertEqual(own, [0, 1])
        self.assertEqual(partner, [0], "partner_grace=0: rank 0's copies not flushed by "
                                       "node 1 (the count above could not fail)")
        self.assertIn("flushing the partner copies of rank 0 from this tier", log)
        self.assertFsckClean()


class OneNode(PartnerCase):
    NODES = 1

    def test_one_node_refused(self):
        w = self.partner_world([2])
        stage(w, "alone", blobs(2, 1 * MiB, seed=4))
        res = self.commit_all(w, "alone")
        for r in range(2):
            st = self.assertFailedCommit(w, "alone", r, res[r])
            self.assertIn("tier_level=partner", st, f"rank {r}: {st!r}")
            self.assertIn("one node", st, f"rank {r}: {st!r}")
        self.assertFalse(os.path.exists(os.path.join(self.backing, "alone")))
        self.assertFalse(os.path.exists(self.cluster.path(0, os.path.join(self.tier, "alone"))))
        self.assertEqual(self.tier_files(0, "alone"), {})

    def test_world_of_one(self):
        # one daemon, no mpirun (a world of one rank, no MPI at all)
        mnt = os.path.join(self.root, "solo")
        os.makedirs(self.cluster.path(0, mnt))
        log = os.path.join(self.dir, "solo.log")
        argv = [cu.BIN, "-f", "-o", f"tier={self.tier},tier_level=partner,log={log}",
                self.backing, mnt]
        p = self.cluster.popen(0, argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=sanenv.env())
        try:
            seen = self.cluster.path(0, mnt)
            deadline = time.monotonic() + 30
            while not self.cluster.mounts(0, self.root, "fuse.ckptfs"):
                self.assertIsNone(p.poll(), f"the daemon exited: {cu.read_log(log)}")
                self.assertLess(time.monotonic(), deadline, "not mounted in 30 s")
                time.sleep(0.05)
            os.mkdir(os.path.join(seen, "one"))
            cu.write_file(os.path.join(seen, "one", "w"), b"x" * 4096)
            with self.assertRaises(OSError) as e:
                cu.commit(os.path.join(seen, "one"))
            self.assertEqual(e.exception.errno, errno.EIO)
            st = status(os.path.join(seen, "one"))
            self.assertIn("the 1 rank(s) of this world are all on one node", st, st)
        finally:
            self.cluster.run(0, ["fusermount3", "-u", mnt])
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def test_partner_needs_tier(self):
        mnt = os.path.join(self.dir, "solo-mnt")
        os.makedirs(mnt)
        r = subprocess.run([cu.BIN, "-f", "-o", "tier_level=partner", self.backing, mnt],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("tier_level=partner needs tier=", r.stderr)


@unittest.skipUnless(os.environ.get("CKPT_PARTNER_BENCH") == "1", "CKPT_PARTNER_BENCH=1 only")
class Timing(PartnerCase):
    NODES = 2
    ROUNDS = 4

    def one(self, level, i, per):
        """A world at level: one sync commit of per bytes per rank; its
        seconds (the slowest rank's), and those of writing the files
        through the mounts (one rank after the other). The tiers are
        emptied after it."""
        w = self.partner_world([1, 1], level=level, tag=f"{level}{i}")
        t0 = time.monotonic()
        stage(w, "t", blobs(2, per, seed=10 + i))
        self.staged.append(time.monotonic() - t0)
        c = Commits(w, "t")
        self.assertTrue(c.wait(timeout=300))
        self.assertCommitted(c.results, w, "t")
        took = max(t for _, t in c.results.values()) - c.t0
        self.assertEqual(w.umount().returncode, 0)
        for node in range(2):
            root = self.cluster.path(node, self.tier)
            for e in os.listdir(root):
                shutil.rmtree(os.path.join(root, e), ignore_errors=True)
        return took

    def test_partner_over_local(self):
        per = 64 * MiB
        self.staged = []
        took = {"local": [], "partner": []}
        for i in range(self.ROUNDS):
            for level in (("local", "partner") if i % 2 == 0 else ("partner", "local")):
                took[level].append(self.one(level, i, per))
        med = {k: statistics.median(v) for k, v in took.items()}
        sys.stderr.write(f"\n  sync commit of {per >> 20} MiB per rank, 2 nodes x 1 rank, median "
                         f"of {self.ROUNDS}: local {med['local']:.3f}s, partner "
                         f"{med['partner']:.3f}s, ratio {med['partner'] / med['local']:.2f}; "
                         f"local {['%.3f' % t for t in took['local']]}, partner "
                         f"{['%.3f' % t for t in took['partner']]}; writing the files "
                         f"through the mounts: median {statistics.median(self.staged):.3f}s\n")


if __name__ == "__main__":
    cu.main()

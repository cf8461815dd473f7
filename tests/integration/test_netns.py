#!/usr/bin/env python3
"""Multi-node worlds on one machine: nodes simulated by network, mount and
UTS namespaces (ckpttest/netns.py), ranks started on them by
mount-scripts/ckpt-mount --hostfile through Open MPI's rsh launcher with
ckpttest/netns-agent, stopped by ckpt-umount, as users do on a cluster
(the world and the test case: ckpttest/networld.py). BACKING_DIR is one
directory every node sees (a shared filesystem), MOUNTROOT a tmpfs of
each node's own, so a rank's mount is seen on its node only; the test
reaches it through /proc/<node>/root.

    python3 tests/integration/test_netns.py --bin build/bin/ckptfs [Class ...]

Classes (one cluster each; commit_timeout small where the test waits):
  SaveLoad          2 nodes x 2 ranks: sharded sync and async saves from
                    every rank, read back on every rank at every shard
                    border; then 3 nodes x 1 rank reload both bit for bit
                    and save at their own size
  LinkDown          3 nodes x 1 rank: node 2's cable is pulled while it
                    writes its data in a commit: ranks 0 and 1 fail within
                    commit_timeout naming rank 2, nothing is published
                    (ckptfs-fsck clean, no save left once rank 2 is back);
                    cable back, the same name commits on every rank
  LongOutage        2 nodes x 1 rank: node 1's cable is pulled before its
                    commit and stays out longer than the client's wait for
                    the coordinator: both commits fail (rank 0 names rank
                    1, rank 1 the coordinator); cable back, what was sent
                    meanwhile arrives, and the next save (a new name) of
                    every rank must commit
  KilledRemoteRank  2 nodes x 1 rank: SIGKILL of rank 1's daemon on node
                    1; once mpirun has ended the job, ckpt-umount on node 0
                    must leave no mount under MOUNTROOT on any node, and
                    ckpt-mount of the same MOUNTROOT must work again
  PerNodeBacking    2 nodes x 1 rank, each node with a BACKING_DIR of its
                    own at the same path: every rank's commit fails saying
                    BACKING_DIR must be shared; nothing is removed from
                    either node's directory
  TierTwoNodes      2 nodes x 1 rank, a node-local tier (-o tier=) each:
                    node 1 publishes the checkpoint in its own tier too;
                    rank 1 reads rank 0's file from what rank 0's flush
                    linked before the shared publish; the flusher that
                    links the last file (rank 1's, on node 1) publishes;
                    a later checkpoint is flushed while that one waits;
                    node 1 killed before its own tier publish: the next
                    world flushes its files from TIER/.saves/SAVE_ID

Skipped (exit 0, with the reason) where the namespaces cannot be made: not
root, no ip, nsenter or unshare, or the kernel refuses. Every namespace,
mount and process a test made is gone after it, also when it fails;
clusters of earlier runs that died are removed first. Needs mpirun
(Open MPI) and FUSE. Python standard library only.
"""

import glob
import itertools
import os
import signal
import sys
import time

from ckpttest import netns, util as cu
from ckpttest.networld import Commits, NetnsCase
from ckpttest.world import (Blob, Tensor, cuts, read_all, split, stage, status, wait_state,
                            write_file)


def sharded_items(n, seed=0):
    """A checkpoint of a world of n: row, column and block shards across
    the ranks (so across the nodes), a replicated tensor, bytes items."""
    grid = {4: [cuts([2, 4]), split(9, 2)], 3: [[(0, 6)], cuts([2, 3, 4])],
            2: [[(0, 6)], split(9, 2)], 1: [[(0, 6)], [(0, 9)]]}[n]
    blocks = {r: ([a[0], b[0]], [a[1], b[1]]) for r, (a, b) in enumerate(itertools.product(*grid))}
    return [
        Tensor("model/rows.weight", "float32", [12, 10],
               {r: ([o, 0], [s, 10]) for r, (o, s) in enumerate(split(12, n))}, seed=seed),
        Tensor("model/cols.weight", "float64", [5, 11],
               {r: ([0, o], [5, s]) for r, (o, s) in enumerate(split(11, n))}, seed=seed),
        Tensor("model/grid", "int32", [6, 9], blocks, seed=seed),
        Tensor("model/embed", "bfloat16", [1024, 96],
               {r: ([o, 0], [s, 96]) for r, (o, s) in
                enumerate(cuts({4: [300, 200, 400, 124], 3: [500, 300, 224],
                                2: [700, 324], 1: [1024]}[n]))}, seed=seed),
        Tensor("replicated/bias", "float32", [64], {r: None for r in range(n)}, seed=seed),
        Blob("extra/config.json", {r: b'{"lr": 0.1, "seed": %d}\n' % seed for r in range(n)}),
        *[Blob(f"rng/rank{r}.state", {r: os.urandom(100 + r)}) for r in range(n)],
    ]


class SaveLoad(NetnsCase):
    NODES = 3

    def test_save_load_across_nodes(self):
        # 2 nodes x 2 ranks: ranks 0, 1 on node 0, ranks 2, 3 on node 1
        w = self.start_world([2, 2, 0])
        items = sharded_items(4, seed=1)
        stage(w, "sync-1", items)
        self.assertCommitted(self.commit_all(w, "sync-1"), w, "sync-1")
        self.verify(w, "sync-1", items, 4)
        items2 = sharded_items(4, seed=2)
        stage(w, "async-1", items2)
        self.assertCommitted(self.commit_all(w, "async-1", mode="async"), w, "async-1")
        for r in range(w.n):
            st = wait_state(os.path.join(w.mnt(r), "async-1"), timeout=120)
            self.assertEqual(st.split("\n", 1)[0], "committed", f"rank {r}: {st!r}")
        self.verify(w, "async-1", items2, 4)
        self.umount_ok(w)
        self.assertFsckClean()
        # 3 nodes x 1 rank: another world size, other nodes for the ranks
        w3 = self.start_world([1, 1, 1])
        self.verify(w3, "sync-1", items, 4)
        self.verify(w3, "async-1", items2, 4)
        own = sharded_items(3, seed=3)
        stage(w3, "resaved-3", own)
        self.assertCommitted(self.commit_all(w3, "resaved-3"), w3, "resaved-3")
        self.verify(w3, "resaved-3", own, 3)
        self.umount_ok(w3)
        self.assertFsckClean()


BIG = 256 << 20  # rank 2's bytes in LinkDown: its writes take a while


def big_bytes():
    return bytes(range(256)) * (BIG // 256)


def write_out_of_order(path, data, piece=1 << 20):
    """The data written last piece first: not a write-behind stream (those
    are hard-linked at the commit), so the commit writes it all."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        for off in reversed(range(0, len(data), piece)):
            os.pwrite(fd, view[off:off + piece], off)
    finally:
        os.close(fd)


class LinkDown(NetnsCase):
    NODES = 3
    TIMEOUT = 5

    def test_link_down_while_writing(self):
        ct = self.TIMEOUT
        # passthrough=0: the commit writes the data (a file written once by
        # passthrough is its data file already, synced from its close on)
        w = self.start_world([1, 1, 1], opts=f"commit_timeout={ct},passthrough=0")
        # a first save: every rank's connections to the coordinator are up
        warm = [Tensor("w", "float32", [3, 4], {r: ([r, 0], [1, 4]) for r in range(3)})]
        stage(w, "warm", warm)
        self.assertCommitted(self.commit_all(w, "warm"), w, "warm")

        small = Tensor("model/w", "float32", [6, 8],
                       {r: ([o, 0], [s, 8]) for r, (o, s) in enumerate(split(6, 3))})
        stage(w, "cut", [small])
        data = big_bytes()
        big = os.path.join(w.mnt(2), "cut", "model", "big")
        write_out_of_order(big, data)
        os.setxattr(big, "user.ckpt.dtype", b"uint8")
        os.setxattr(big, "user.ckpt.shape", str(BIG).encode())

        commits = Commits(w, "cut")
        # rank 2 got its plan and writes its data files: pull its cable
        pattern = os.path.join(self.backing, ".saves", "*", "__2_*.distcp")
        deadline = time.monotonic() + 60
        while not glob.glob(pattern):
            self.assertFalse(commits.done([2]), f"rank 2's commit returned before it wrote: "
                                                f"{commits.results.get(2)}")
            self.assertLess(time.monotonic(), deadline, "rank 2 never began writing")
            time.sleep(0.002)
        self.cluster.link(2, False)
        t_cut = time.monotonic()
        try:
            self.assertTrue(commits.wait([0, 1], timeout=ct + 60),
                            "ranks 0 and 1 still wait for rank 2")
            for r in (0, 1):
                e, t_end = commits.results[r]
                if e is None:
                    self.fail(f"rank {r}'s commit succeeded: rank 2 wrote its {BIG >> 20} MiB "
                              f"and reported before its cable was pulled (make BIG larger)")
                st = self.assertFailedCommit(w, "cut", r, commits.results[r])
                self.assertNamesRank(st, 2, f"rank {r}: .status must name rank 2: {st!r}")
                self.assertLess(t_end - t_cut, ct + 10,
                                f"rank {r} failed {t_end - t_cut:.1f}s after the cut "
                                f"(commit_timeout {ct}s)")
            self.assertNothingPublished(w, "cut")
            self.assertFsckClean()
            self.assertNotIn("cut", os.listdir(self.backing))
        finally:
            self.cluster.link(2, True)
        # rank 2 learns the outcome once its cable is back
        t_back = time.monotonic()
        self.assertTrue(commits.wait([2], timeout=120),
                        "rank 2's commit did not return after its cable came back")
        self.assertFailedCommit(w, "cut", 2, commits.results[2])
        survivors = max(commits.results[r][1] for r in (0, 1)) - t_cut
        sys.stderr.write(f"\n  ranks 0 and 1 failed {survivors:.1f}s after the cable was pulled "
                         f"(commit_timeout {ct}s), rank 2 "
                         f"{commits.results[2][1] - t_back:.1f}s after it was back\n")
        self.wait_no_saves()
        self.assertNothingPublished(w, "cut")
        self.assertFsckClean()
        # the same name again, every rank: committed
        self.assertCommitted(self.commit_all(w, "cut"), w, "cut")
        self.verify(w, "cut", [small] + [_BigItem()], 3, borders=False)
        for r in range(3):
            p = os.path.join(w.mnt(r), "cut", "model", "big")
            for off in (0, (1 << 20) - 3, BIG // 2 + 5, BIG - 7):
                self.assertEqual(cu.pread(p, 11, off), data[off:off + 11],
                                 f"rank {r}: big at {off}")
        self.assertEqual(read_all(os.path.join(w.mnt(1), "cut", "model", "big")), data)
        self.assertFsckClean("cut")
        self.umount_ok(w)


class _BigItem:
    """LinkDown's big tensor in a listing (its bytes are checked apart)."""
    kind = "other"
    path = "model/big"


class LongOutage(NetnsCase):
    NODES = 2
    TIMEOUT = 2

    def test_outage_longer_than_client_wait(self):
        ct = self.TIMEOUT
        # how long a client waits for the coordinator (dist.c client_wait():
        # 2 * commit_timeout + 30 s; 3 * commit_timeout + 60 s before)
        client_wait = 3 * ct + 60
        w = self.start_world([1, 1], opts=f"commit_timeout={ct}")
        warm = [Tensor("w", "float32", [2, 4], {r: ([r, 0], [1, 4]) for r in range(2)})]
        stage(w, "warm", warm)
        self.assertCommitted(self.commit_all(w, "warm"), w, "warm")

        t = Tensor("w", "float32", [2, 4], {r: ([r, 0], [1, 4]) for r in range(2)}, seed=1)
        stage(w, "lost", [t])
        after = [Tensor("w", "int64", [2, 3], {r: ([r, 0], [1, 3]) for r in range(2)}, seed=2),
                 Blob("cfg", {r: b"after" for r in range(2)})]
        stage(w, "after", after)
        self.cluster.link(1, False)
        try:
            commits = Commits(w, "lost")
            # the coordinator's round fails: rank 1 never came
            self.assertTrue(commits.wait([0], timeout=ct + 60), "rank 0 still waits")
            st0 = self.assertFailedCommit(w, "lost", 0, commits.results[0])
            self.assertNamesRank(st0, 1, f"rank 0's .status must name rank 1: {st0!r}")
            took0 = commits.results[0][1] - commits.t0
            self.assertLess(took0, ct + 10, f"rank 0 failed after {took0:.1f}s")
            # rank 1 gives up waiting for the coordinator, cable still out
            self.assertTrue(commits.wait([1], timeout=client_wait + 60),
                            f"rank 1 still waits {client_wait + 60}s later")
            st1 = self.assertFailedCommit(w, "lost", 1, commits.results[1])
            self.assertNamesRank(st1, 0, f"rank 1's .status must name the coordinator: {st1!r}")
            took1 = commits.results[1][1] - commits.t0
            self.assertGreater(took1, ct, f"rank 1 gave up after {took1:.1f}s")
        finally:
            self.cluster.link(1, True)
        # what each side sent meanwhile arrives (TCP retransmits)
        drained = self.cluster.wait_tcp_drained()
        self.assertNothingPublished(w, "lost")
        # the next save of every rank commits
        res = self.commit_all(w, "after", timeout=120)
        self.assertCommitted(res, w, "after")
        self.verify(w, "after", after, 2)
        sys.stderr.write(f"\n  rank 0 failed after {took0:.1f}s, rank 1 (the client) after "
                         f"{took1:.1f}s; the queues drained {drained:.1f}s after the cable "
                         f"came back\n")
        self.assertFsckClean()
        # its failed checkpoint is still staged on every rank: ckpt-umount
        # refuses without --discard, and names each one with it (every host)
        r = self.umount_ok(w, "--discard")
        self.assertEqual(len([ln for ln in r.stderr.splitlines() if "discarding " in ln]), 2, r.stderr)


class KilledRemoteRank(NetnsCase):
    NODES = 2

    def test_umount_after_remote_daemon_killed(self):
        w = self.start_world([1, 1])
        items = [Tensor("w", "float32", [2, 4], {r: ([r, 0], [1, 4]) for r in range(2)})]
        stage(w, "before", items)
        self.assertCommitted(self.commit_all(w, "before"), w, "before")
        pid = w.daemon_pid(1)
        self.assertIsNotNone(pid, "no ckptfs process of rank 1 on node 1")
        self.assertEqual(self.cluster.node_of_pid(pid), 1)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while netns.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.assertFalse(netns.alive(pid), "rank 1's daemon survived SIGKILL")
        # Open MPI ends the job (the other daemon too, without unmounting);
        # mpirun exits
        launcher = w.launcher_pid()
        deadline = time.monotonic() + 60
        while netns.alive(launcher) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(netns.alive(launcher), "mpirun still runs 60 s after a rank died")
        # then the user runs ckpt-umount on node 0, and ckpt-mount again
        u = w.umount()
        left = {i: m for i, m in w.ckpt_mounts().items() if m}
        self.assertNoDaemons()
        w2 = self.world([1, 1], tag="again")
        r = w2.mount()
        problems = []
        if left:
            problems.append(f"ckpt-umount (exit {u.returncode}) left mounts under "
                            f"{self.root} (node: mounts): {left}\n{u.stderr}")
        if r.returncode != 0:
            problems.append(f"ckpt-mount on the same MOUNTROOT then failed "
                            f"(exit {r.returncode}):\n{r.stderr}")
        self.assertFalse(problems, "\n".join(problems))
        stage(w2, "after", items)
        self.assertCommitted(self.commit_all(w2, "after"), w2, "after")
        self.verify(w2, "after", items, 2)
        self.verify(w2, "before", items, 2)
        self.umount_ok(w2)


class PerNodeBacking(NetnsCase):
    NODES = 2
    PRIVATE_BACKING = True

    def test_commit_refused_on_every_rank(self):
        c = self.cluster
        for i in range(2):
            write_file(c.path(i, os.path.join(self.local_backing, "keep")), b"node %d" % i)
        w = self.start_world([1, 1], backing=self.local_backing)
        t = Tensor("w", "int32", [2, 4], {r: ([r, 0], [1, 4]) for r in range(2)})
        stage(w, "step", [t])
        res = self.commit_all(w, "step")
        for r in range(2):
            st = self.assertFailedCommit(w, "step", r, res[r])
            self.assertIn("shared", st, f"rank {r}: .status must say why: {st!r}")
        for i in range(2):
            d = c.path(i, self.local_backing)
            self.assertEqual(sorted(os.listdir(d)), ["keep"], f"node {i}: nothing left, "
                                                              f"nothing lost")
            self.assertEqual(read_all(os.path.join(d, "keep")), b"node %d" % i)
            self.assertFalse(os.path.exists(os.path.join(d, "step")))
        # its failed checkpoint is still staged on every rank, on both
        # hosts: ckpt-umount refuses (nothing unmounted), naming each
        r = w.umount()
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("refusing to unmount", r.stderr)
        for k in range(w.n):
            self.assertIn(f"{w.local_mnt(k)}/step: failed, 1 file", r.stderr)
        self.assertEqual(sum(len(v) for v in w.ckpt_mounts().values()), w.n)
        # and with --discard unmounts, naming what it discards
        r = self.umount_ok(w, "--discard")
        self.assertEqual(len([ln for ln in r.stderr.splitlines() if "discarding " in ln]), 2, r.stderr)
        for i in range(2):
            self.assertEqual(read_all(c.path(i, os.path.join(self.local_backing, "keep"))),
                             b"node %d" % i)


class TierTwoNodes(NetnsCase):
    NODES = 2
    PRIVATE_TIER = True

    def test_node_publish_and_leaderless_flush(self):
        c = self.cluster
        # rank 1's 12 MiB take 3 s at flush_rate=4M, rank 0's 1 MiB 0.25 s
        w = self.start_world([1, 1], opts=f"commit_timeout=10,tier={self.tier},flush_rate=4M")
        data = [os.urandom(1 << 20), os.urandom(12 << 20)]
        for r in range(2):
            os.mkdir(os.path.join(w.mnt(r), "c"))
            write_file(os.path.join(w.mnt(r), "c", f"rank{r}"), data[r])
        res = self.commit_all(w, "c")
        self.assertCommitted(res, w, "c")
        tiers = [c.path(i, os.path.join(self.tier, "c")) for i in range(2)]
        # node 1 published it in its own tier, from the OUTCOME's .metadata
        for i in range(2):
            self.assertTrue(os.path.exists(os.path.join(tiers[i], ".metadata")), f"node {i}")
            names = [n for n in os.listdir(tiers[i]) if n.endswith(".distcp")]
            self.assertTrue(names and all(n.startswith(f"__{i}_") for n in names),
                            f"node {i}'s tier: {names}")
        # rank 1 reads rank 0's file: in neither node 1's tier nor
        # BACKING_DIR/c yet, but linked by rank 0's flush (waited for)
        self.assertEqual(read_all(os.path.join(w.mnt(1), "c", "rank0")), data[0])
        self.assertFalse(os.path.exists(os.path.join(self.backing, "c")),
                         "published before rank 1's files were flushed")
        deadline, st = time.monotonic() + 20, ""
        while "not in the shared store yet" not in st and time.monotonic() < deadline:
            st = status(os.path.join(w.mnt(0), "c"))
            time.sleep(0.02)
        self.assertIn("flush waiting: rank 1 not in the shared store yet", st)
        # a later checkpoint is not held up by it: rank 0 copies d's file
        # while c still waits for rank 1 (busy with c's 12 MiB)
        small = [os.urandom(4096), os.urandom(4096)]
        for r in range(2):
            os.mkdir(os.path.join(w.mnt(r), "d"))
            write_file(os.path.join(w.mnt(r), "d", f"rank{r}"), small[r])
        self.assertCommitted(self.commit_all(w, "d"), w, "d")
        deadline, st = time.monotonic() + 20, ""
        while "not in the shared store yet" not in st and time.monotonic() < deadline:
            st = status(os.path.join(w.mnt(0), "d"))
            time.sleep(0.02)
        self.assertIn("flush waiting: rank 1 not in the shared store yet", st)
        self.assertFalse(os.path.exists(os.path.join(self.backing, "c")))
        for name in ("c", "d"):
            for r in range(2):
                deadline = time.monotonic() + 30
                while "location shared" not in status(os.path.join(w.mnt(r), name)):
                    self.assertLess(time.monotonic(), deadline, w.log_text()[-4000:])
                    time.sleep(0.05)
        pubs = [ln for ln in w.daemon_lines()
                if ln.startswith("ckptfs: tier: c published in")]
        self.assertEqual(len(pubs), 1, pubs)
        self.assertIn("by rank 1's flush", pubs[0])
        for i in range(2):
            deadline = time.monotonic() + 10
            while os.path.exists(tiers[i]) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertFalse(os.path.exists(tiers[i]), f"node {i}'s tier copy kept")
        for r in range(2):
            for k in range(2):
                self.assertEqual(read_all(os.path.join(w.mnt(r), "c", f"rank{k}")), data[k])
                self.assertEqual(read_all(os.path.join(w.mnt(r), "d", f"rank{k}")), small[k])
        self.umount_ok(w)
        self.assertFsckClean()

    def test_node_killed_before_its_tier_publish(self):
        """Rank 1 (node 1) killed once the checkpoint is committed, before
        its node publishes it in its tier (failpoint tier_publish): node 1
        has rank 1's files in TIER/.saves/SAVE_ID only, with its record.
        The next world flushes them from there, with the .metadata rank 0's
        flush linked in BACKING_DIR, and publishes the checkpoint once."""
        c = self.cluster
        w = self.world([1, 1], f"commit_timeout=10,tier={self.tier}")
        base = w.mount_argv
        w.mount_argv = lambda: base()[:1] + ["--mpirun-arg=-x",
                                             "--mpirun-arg=CKPTFS_FAILPOINT"] + base()[1:]
        os.environ["CKPTFS_FAILPOINT"] = "tier_publish@1"
        try:
            r = w.mount()
        finally:
            del os.environ["CKPTFS_FAILPOINT"]
        self.assertEqual(r.returncode, 0, f"{r.stderr}\n{w.log_text()[-4000:]}")
        data = [os.urandom(1 << 20), os.urandom(1 << 20)]
        for k in range(2):
            os.mkdir(os.path.join(w.mnt(k), "c"))
            write_file(os.path.join(w.mnt(k), "c", f"rank{k}"), data[k])
        Commits(w, "c").wait(timeout=60)  # rank 1 dies; rank 0 may too
        launcher = w.launcher_pid()
        deadline = time.monotonic() + 60
        while netns.alive(launcher) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(netns.alive(launcher), "mpirun still runs 60 s after a rank died")
        self.assertIn("failpoint reached", w.log_text())
        w.umount()
        self.assertNoDaemons()
        tier1 = c.path(1, self.tier)
        self.assertFalse(os.path.exists(os.path.join(tier1, "c")), "node 1 published it")
        saves = os.listdir(os.path.join(tier1, ".saves"))
        self.assertEqual(len(saves), 1, saves)
        self.assertTrue(glob.glob(os.path.join(tier1, ".saves", saves[0], "__1_*.distcp")))
        self.assertEqual([n for n in os.listdir(os.path.join(tier1, ".flush"))
                          if not n.startswith(".")], [saves[0] + ".1"])
        self.assertFalse(os.path.exists(os.path.join(self.backing, "c", ".metadata")))
        w2 = self.start_world([1, 1], f"commit_timeout=10,tier={self.tier}", tag="again")
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(self.backing, "c", ".metadata")):
            self.assertLess(time.monotonic(), deadline, w2.log_text()[-4000:])
            time.sleep(0.05)
        for i in range(2):
            t = c.path(i, self.tier)
            deadline = time.monotonic() + 20
            while (os.path.exists(os.path.join(t, "c")) or
                   [n for n in os.listdir(os.path.join(t, ".flush")) if not n.startswith(".")]) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertFalse(os.path.exists(os.path.join(t, "c")), f"node {i}")
            self.assertFalse(os.path.isdir(os.path.join(t, ".saves")) and
                             os.listdir(os.path.join(t, ".saves")), f"node {i}")
        pubs = [ln for ln in w2.daemon_lines() if ln.startswith("ckptfs: tier: c published in")]
        self.assertEqual(len(pubs), 1, pubs)
        for k in range(2):
            self.assertEqual(read_all(os.path.join(w2.mnt(0), "c", f"rank{k}")), data[k])
        self.umount_ok(w2)
        self.assertFsckClean()


if __name__ == "__main__":
    cu.main()

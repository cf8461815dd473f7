#!/usr/bin/env python3
"""One truth per checkpoint name, on every mount and every tier (issue 36,
cases 1 to 4): a change made through any mount (a commit, `replace=`, the
removal of a checkpoint or of one entry, `keep=`) is seen by every other
mount within about a second, a tier's copy is never served once
BACKING_DIR's NAME is another save, and a delayed flush never undoes a
later replace.

    python3 tests/integration/test_one_truth.py --bin build/bin/ckptfs [Class ...]

Classes (one per numbered case of the issue):
  DelayedFlush   case 1: a tier mount's replace= whose flush is throttled
                 publishes after a later replace made through a mount
                 without the tier: the later one must stay NAME on every
                 mount (a fresh one too), the flushing save be reported
                 superseded, and no fresh open of NAME's file ENOENT
  TierKeepStale  case 2: with tier_keep, a checkpoint removed and another
                 replaced through a mount without the tier: the tier
                 mount must stop listing and serving the removed one and
                 serve the new version within about a second
  TwoRanksEntry  case 3: 2 ranks of one node on one tier with tier_keep=1:
                 an entry removed through rank 0 must be gone on rank 1
                 within about a second
  KeepTierCopies case 4: keep=last:2 with tier_keep over commits and
                 entry removals: no tier copy of a save BACKING_DIR no
                 longer holds may be left, listed or served

Each tier is a private tmpfs mounted in the test's directory (needs root:
fails otherwise); BACKING_DIR is on /tmp's filesystem. Tensors are small
(64 KiB to 3 MiB), each version's bytes carry its own tag.
"""

import errno
import os
import shutil
import sqlite3
import subprocess
import threading
import time

from ckpttest import util as cu
from ckpttest.util import CkptfsTestCase, commit, main, read_all, status, write_file, write_tensor
from ckpttest.world import commit_all

KiB = 1 << 10
MiB = 1 << 20
SEEN = 3.0  # "within about a second", with room for a loaded machine


def tagged(tag, size):
    """size bytes (a multiple of 16) whose every 16-byte row spells tag."""
    row = (tag.encode() + b"|").ljust(16, b".")[:16]
    return row * (size // 16)


def tag_of(data):
    """The tag of bytes made by tagged()."""
    return data[:16].split(b"|", 1)[0].decode(errors="replace")


def head_tag(path):
    """The tag of path's first bytes, read through a fresh open."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return tag_of(os.pread(fd, 16, 0))
    finally:
        os.close(fd)


def stage(ckdir, tag, size, blobs=()):
    """model/w, a float32 tensor of tag's bytes, and one JSON blob per
    name in blobs (each naming tag)."""
    os.makedirs(ckdir, exist_ok=True)
    write_tensor(os.path.join(ckdir, "model", "w"), "float32", [size // 4], tagged(tag, size))
    for b in blobs:
        write_file(os.path.join(ckdir, b), b'{"version": "%s"}' % tag.encode())


def save_id(root, name):
    """The save ID in root/NAME/.metadata (root: BACKING_DIR or a tier),
    or None."""
    p = os.path.join(root, name, ".metadata")
    if not os.path.exists(p):
        return None
    db = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
    try:
        row = db.execute("select value from checkpoint where key='save_id'").fetchone()
        return row[0] if row else None
    finally:
        db.close()


def committed_names(root):
    """The checkpoints published in root (a tier or BACKING_DIR)."""
    return sorted(n for n in os.listdir(root) if not n.startswith(".")
                  and os.path.exists(os.path.join(root, n, ".metadata")))


def listed(mnt):
    """The names a mount lists (not its dot-names)."""
    return sorted(n for n in os.listdir(mnt) if not n.startswith("."))


def open_errno(path):
    """None if path opens and reads, else the errno of the failure."""
    try:
        read_all(path)
        return None
    except OSError as e:
        return e.errno


def settle(checks, timeout=SEEN, interval=0.05):
    """Poll checks (a function returning a list of problems) until it
    returns none or timeout s pass; the last problems (empty: settled)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            problems = checks()
        except OSError as e:
            problems = [f"{e!r}"]
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(interval)


class OneTruthCase(CkptfsTestCase):
    """A private tmpfs tier (self.tier) per test; mounts of one BACKING_DIR
    at DIR/<name>, every daemon's log the test's."""

    def setUp(self):
        super().setUp()
        self.tier = os.path.join(self.dir, "tier")
        os.makedirs(self.tier)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=2g", "tmpfs",
                            self.tier], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, f"cannot mount the tier's tmpfs: {r.stderr}")
        # after the mounts' cleanup (cleanups run last-added first)
        self.addCleanup(subprocess.run, ["umount", "-l", self.tier], capture_output=True)

    def mount_at(self, name, opts=None):
        """A one-rank mount of BACKING_DIR at DIR/name; its mount point."""
        return self.mount(opts=opts, mnt=os.path.join(self.dir, name)).mnt

    def records(self):
        """The tier's flush records, SAVE_ID.RANK (not the node's .lock)."""
        d = os.path.join(self.tier, ".flush")
        return sorted(n for n in os.listdir(d) if not n.startswith(".")) \
            if os.path.isdir(d) else []

    def wait_for(self, pred, what, timeout=30):
        try:
            return cu.wait_until(pred, timeout, what)
        except TimeoutError as e:
            self.fail(f"{e} (a step before the case's own checks)\n"
                      f"{self.daemon_log()[-6000:]}")

    def wait_shared(self, ckdir, timeout=30):
        return self.wait_for(lambda: "location shared" in status(ckdir),
                             f"{ckdir} flushed (location shared)", timeout)

    def report(self, problems, what):
        if problems:
            self.fail(f"{what}:\n  " + "\n  ".join(problems)
                      + f"\n--- daemon log (tail) ---\n{self.daemon_log()[-5000:]}")


class DelayedFlush(OneTruthCase):
    def test_delayed_flush_does_not_undo_a_later_replace(self):
        """Case 1: mount m1 (tier, flush_rate=1M) commits A with `sync
        replace=X` at t=0 (in its tier, a 3 s flush); mount m2 (no tier)
        commits B with `sync replace=X` at t=1 s, which succeeds. Once m1's
        flush is over, every mount (m1, m2 and a fresh one) must serve B,
        the later replace; A must be reported superseded (m1's .status of
        X or its log, with A's save ID); no fresh open of X/model/w may
        fail with ENOENT meanwhile, and m2 (which made B) must never serve
        anything but B once its commit returned."""
        m1 = self.mount_at("m1", "tier=%s,flush_rate=1M" % self.tier)
        m2 = self.mount_at("m2")
        x1, x2 = os.path.join(m1, "X"), os.path.join(m2, "X")
        w1, w2 = os.path.join(x1, "model", "w"), os.path.join(x2, "model", "w")

        stage(x2, "v0", 64 * KiB)
        commit(x2, "sync")
        self.wait_for(lambda: os.path.exists(w1) and head_tag(w1) == "v0",
                      "m1 sees X (v0)", SEEN)

        # readers: fresh opens of X/model/w on both mounts, all along
        reads, stop = [], threading.Event()

        def reader(tag, path):
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    got = head_tag(path)
                except OSError as e:
                    got = errno.errorcode.get(e.errno, str(e.errno))
                reads.append((tag, t0, got))
                time.sleep(0.005)
        threads = [threading.Thread(target=reader, args=a, daemon=True)
                   for a in (("m1", w1), ("m2", w2))]
        for t in threads:
            t.start()
        try:
            # t=0: A replaces X in m1's tier; 3 MiB at 1 MiB/s: flushed at ~3 s
            stage(os.path.join(m1, "a-work"), "A", 3 * MiB)
            t_a = time.monotonic()
            commit(os.path.join(m1, "a-work"), "sync replace=X")
            recs = self.records()
            self.assertEqual(len(recs), 1, f"A's flush record: {recs}")
            a_id = recs[0].split(".")[0]
            self.assertIn("location local", status(x1), "A is not in m1's tier only")
            # t=1 s: B replaces X through m2, on BACKING_DIR
            stage(os.path.join(m2, "b-work"), "B", 64 * KiB)
            time.sleep(max(0.0, t_a + 1.0 - time.monotonic()))
            self.assertTrue(self.records(), "A's flush over before B's commit: too early")
            commit(os.path.join(m2, "b-work"), "sync replace=X")
            t_b = time.monotonic()
            b_id = save_id(self.backing, "X")
            self.assertEqual(head_tag(w2), "B", "m2 does not serve its own replace")
            # m1's flush of A ends (published, or dropped as superseded)
            flush_over = settle(lambda: [f"flush records left: {self.records()}"]
                                if self.records() else [], timeout=20)
            t_flushed = time.monotonic()

            def every_mount_serves_b():
                out = []
                for m, w in (("m1", w1), ("m2", w2)):
                    got = head_tag(w)
                    if got != "B":
                        out.append(f"{m} serves X = {got!r}, not B (the later replace)")
                in_backing = save_id(self.backing, "X")
                if in_backing != b_id:
                    out.append(f"BACKING_DIR's X is save {in_backing}, not B's {b_id} "
                               f"(A's is {a_id})")
                return out
            problems = settle(every_mount_serves_b)
            time.sleep(0.3)  # a few more reads after the flush
        finally:
            stop.set()
            for t in threads:
                t.join(10)
        problems = flush_over + problems
        m3 = self.mount_at("m3")  # a fresh mount, without the tier
        got = head_tag(os.path.join(m3, "X", "model", "w"))
        if got != "B":
            problems.append(f"a fresh mount serves X = {got!r}, not B")
        log = self.daemon_log()
        said = [ln for ln in log.splitlines() if "superseded" in ln and a_id in ln]
        try:
            said += [ln for ln in status(x1).splitlines() if "superseded" in ln]
        except OSError:
            pass
        if not said:
            problems.append(f"A (save {a_id}) not reported superseded in m1's .status of X "
                            f"nor in the log")
        enoent = [(m, round(t - t_a, 2)) for m, t, g in reads if g == "ENOENT"]
        if enoent:
            problems.append(f"{len(enoent)} fresh open(s) of X/model/w failed with ENOENT "
                            f"(mount, s after A's commit): {enoent[:10]}")
        errs = sorted({g for m, t, g in reads if g not in ("v0", "A", "B", "ENOENT")})
        if errs:
            problems.append(f"other results of fresh opens: {errs}")
        stale = [(round(t - t_b, 2), g) for m, t, g in reads if m == "m2" and t > t_b and g != "B"]
        if stale:
            problems.append(f"{len(stale)} read(s) on m2 after its replace returned another "
                            f"version than B (s after B's commit, version): first "
                            f"{stale[:5]}, last {stale[-3:]}")
        print(f"\n  {len(reads)} reads; B committed {t_b - t_a:.2f} s after A, A's flush "
              f"over {t_flushed - t_a:.2f} s after A", flush=True)
        self.report(problems, "a delayed flush undid a later replace")


class TwoTiersRealTime(OneTruthCase):
    def test_later_replace_wins_across_tiers(self):
        """Two tier mounts (two nodes' tiers): m1 commits A with `sync
        replace=X` (flushed in about 1 s), then m2 commits B with `sync
        replace=X` (a throttled flush: about 6 s). A reaches BACKING_DIR
        first, yet B is the later commit: m2 serves B all along, B's flush
        replaces A, and every mount ends up serving B; nothing is reported
        superseded (the history test found m2 serving A: "later" was the
        order of reaching BACKING_DIR, not of the commits)."""
        tier2 = os.path.join(self.dir, "tier2")
        os.makedirs(tier2)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=256m", "tmpfs",
                            tier2], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, f"cannot mount the second tier: {r.stderr}")
        self.addCleanup(subprocess.run, ["umount", "-l", tier2], capture_output=True)
        m1 = self.mount_at("m1", f"tier={self.tier},flush_rate=2M")
        m2 = self.mount_at("m2", f"tier={tier2},flush_rate=512K")
        w2 = os.path.join(m2, "X", "model", "w")
        stage(os.path.join(m1, "a-work"), "A", 2 * MiB)
        commit(os.path.join(m1, "a-work"), "sync replace=X")
        stage(os.path.join(m2, "b-work"), "B", 3 * MiB)
        commit(os.path.join(m2, "b-work"), "sync replace=X")
        self.assertEqual(head_tag(w2), "B")
        self.wait_for(lambda: save_id(self.backing, "X") is not None,
                      "A published on BACKING_DIR by m1's flush", 30)
        seen = set()  # what m2 serves until B's flush is over
        deadline = time.monotonic() + 30
        while committed_names(tier2) and time.monotonic() < deadline:
            seen.add(head_tag(w2))
            time.sleep(0.02)

        def everyone_b():
            return [f"{m} serves X = {head_tag(os.path.join(d, 'X', 'model', 'w'))!r}"
                    for m, d in (("m1", m1), ("m2", m2))
                    if head_tag(os.path.join(d, "X", "model", "w")) != "B"]
        problems = settle(everyone_b)
        if seen != {"B"}:
            problems.append(f"m2 served {sorted(seen)} while the flushes ran, not only B")
        if committed_names(tier2):
            problems.append(f"B's flush not over in 30 s: {committed_names(tier2)}")
        m3 = self.mount_at("m3")
        got = head_tag(os.path.join(m3, "X", "model", "w"))
        if got != "B":
            problems.append(f"a fresh mount serves X = {got!r}, not B")
        if "superseded" in self.daemon_log():
            problems.append("a save was reported superseded")
        self.report(problems, "the later replace did not win across tiers")


class TierKeepStale(OneTruthCase):
    def test_removal_and_replace_elsewhere_seen_by_tier_mount(self):
        """Case 2: checkpoints A and B flushed and kept in the tier
        (tier_keep=2); through a mount without the tier, `rm -r A` and `sync
        replace=B` (a new version with one blob more). Within about a second
        the tier mount must no longer list, open or show A (nor A's
        .status), and fresh opens of B/model/w must return the new bytes,
        B's .status counting the new version's blobs and not claiming the
        tier's location."""
        m1 = self.mount_at("m1", "tier=%s,tier_keep=2" % self.tier)
        m2 = self.mount_at("m2")
        for name, step in (("A", 1), ("B", 2)):
            stage(os.path.join(m1, name), f"{name}-old", 64 * KiB, blobs=["extra.json"])
            commit(os.path.join(m1, name), f"sync step={step}")
            self.wait_shared(os.path.join(m1, name))
        self.wait_for(lambda: committed_names(self.tier) == ["A", "B"],
                      "A and B kept in the tier (tier_keep=2)", 10)
        self.wait_for(lambda: listed(m2) == ["A", "B"], "m2 lists A and B", SEEN)
        self.assertEqual(head_tag(os.path.join(m1, "A", "model", "w")), "A-old")
        self.assertEqual(head_tag(os.path.join(m1, "B", "model", "w")), "B-old")

        shutil.rmtree(os.path.join(m2, "A"))
        stage(os.path.join(m2, "b-work"), "B-new", 64 * KiB,
              blobs=["extra.json", "notes.json"])
        commit(os.path.join(m2, "b-work"), "sync replace=B")
        self.assertFalse(os.path.exists(os.path.join(self.backing, "A")))
        self.assertEqual(head_tag(os.path.join(m2, "B", "model", "w")), "B-new")
        new_id = save_id(self.backing, "B")

        def tier_mount_agrees():
            out = []
            names = listed(m1)
            if "A" in names:
                out.append(f"m1 lists A, removed through m2: {names}")
            e = open_errno(os.path.join(m1, "A", "model", "w"))
            if e != errno.ENOENT:
                out.append("m1 opens A/model/w: " + ("reads it" if e is None
                                                     else errno.errorcode.get(e, str(e))))
            try:
                s = status(os.path.join(m1, "A")).replace("\n", " | ")
                out.append(f"m1's A/.status still answers: {s}")
            except OSError:
                pass
            got = head_tag(os.path.join(m1, "B", "model", "w"))
            if got != "B-new":
                out.append(f"fresh open of B/model/w on m1 returns {got!r}, not B-new")
            s = status(os.path.join(m1, "B"))
            if "blobs 2" not in s.splitlines():
                out.append("m1's B/.status is not the new version's (blobs 2): "
                           + s.replace("\n", " | "))
            if "location local" in s:
                out.append("m1's B/.status claims location local: " + s.replace("\n", " | "))
            return out
        t0 = time.monotonic()
        problems = settle(tier_mount_agrees)
        print(f"\n  checked for {time.monotonic() - t0:.1f} s; BACKING_DIR's B is save {new_id}, "
              f"the tier's {save_id(self.tier, 'B')}; tier holds {committed_names(self.tier)}",
              flush=True)
        self.report(problems, f"the tier mount disagrees with BACKING_DIR {SEEN:.0f} s "
                    f"after rm -r A and replace=B through another mount")


class TwoRanksEntry(OneTruthCase):
    def test_entry_removal_seen_by_other_rank(self):
        """Case 3: 2 ranks on one node (one mpirun), `tier=T,tier_keep=1`;
        C committed and flushed (kept in the tier); `rm C/config.json`
        through rank 0 succeeds. Rank 1 must neither list nor open
        config.json within about a second, and still read every other
        entry."""
        w = self.start_world(2, f"tier={self.tier},tier_keep=1",
                             root=os.path.join(self.dir, "w"), log=self.log)
        ck = [os.path.join(w.mnt(r), "C") for r in range(2)]
        for r in range(2):
            os.mkdir(ck[r])
            write_file(os.path.join(ck[r], f"rank{r}"), tagged(f"rank{r}", 64 * KiB))
        write_file(os.path.join(ck[0], "config.json"), b'{"layers": 2}')
        res = commit_all(w, "C")
        self.assertEqual([res[r][0] for r in range(2)], [None, None], self.daemon_log())
        for r in range(2):
            self.wait_shared(ck[r])
        self.wait_for(lambda: committed_names(self.tier) == ["C"] and not self.records(),
                      "C flushed and kept in the tier (tier_keep=1)", 10)
        self.assertIn("config.json", os.listdir(ck[1]))
        self.assertEqual(read_all(os.path.join(ck[1], "config.json")), b'{"layers": 2}')

        os.unlink(os.path.join(ck[0], "config.json"))
        self.assertNotIn("config.json", os.listdir(ck[0]))

        def rank1_agrees():
            out = []
            names = os.listdir(ck[1])
            if "config.json" in names:
                out.append(f"rank 1 lists config.json: {sorted(names)}")
            e = open_errno(os.path.join(ck[1], "config.json"))
            if e != errno.ENOENT:
                out.append("rank 1 opens config.json: " + ("reads it" if e is None
                                                           else errno.errorcode.get(e, str(e))))
            for r in range(2):
                if read_all(os.path.join(ck[1], f"rank{r}")) != tagged(f"rank{r}", 64 * KiB):
                    out.append(f"rank 1 reads rank{r} wrong")
            return out
        problems = settle(rank1_agrees)
        self.report(problems, f"an entry removed through rank 0 is still there on rank 1 "
                    f"{SEEN:.0f} s later (tier_keep=1)")


class KeepTierCopies(OneTruthCase):
    def test_keep_leaves_no_stale_tier_copies(self):
        """Case 4: one tier mount, `keep=last:2,tier_keep=2`; 8 checkpoints
        s-1..s-8 (steps 1..8) each committed `sync level=shared`, and one
        entry (extra.json) removed inside each once flushed (a new version
        in BACKING_DIR while the tier holds the old save), so keep= later
        removes checkpoints whose tier copy is an older save. Once settled:
        the mount lists exactly BACKING_DIR's checkpoints; a removed one
        opens ENOENT; no removed entry is listed or served; the tier holds
        only copies of saves BACKING_DIR's names hold (at most 2), no flush
        record and nothing in .saves."""
        daemon = self.mount(opts="tier=%s,keep=last:2,tier_keep=2" % self.tier,
                            mnt=os.path.join(self.dir, "m1"))
        m = daemon.mnt
        n = 8
        for i in range(1, n + 1):
            ck = os.path.join(m, f"s-{i}")
            stage(ck, f"s-{i}", 64 * KiB, blobs=["extra.json", "config.json"])
            commit(ck, f"sync step={i} level=shared")
            self.wait_shared(ck)
            os.unlink(os.path.join(ck, "extra.json"))
        backing_names = committed_names(self.backing)
        self.assertEqual(backing_names, [f"s-{n - 1}", f"s-{n}"], "keep=last:2 on BACKING_DIR")

        def settled():
            out = []
            names = listed(m)
            if names != backing_names:
                out.append(f"the mount lists {names}, BACKING_DIR holds {backing_names}")
            for i in range(1, n + 1):
                name = f"s-{i}"
                w = os.path.join(m, name, "model", "w")
                e = open_errno(w)
                if name in backing_names:
                    if e is not None:
                        out.append(f"{name}/model/w: {errno.errorcode.get(e, e)}")
                    elif head_tag(w) != name:
                        out.append(f"{name}/model/w serves {head_tag(w)!r}")
                    if open_errno(os.path.join(m, name, "extra.json")) != errno.ENOENT:
                        out.append(f"{name}/extra.json (removed) still served")
                    if "extra.json" in os.listdir(os.path.join(m, name)):
                        out.append(f"{name}/extra.json (removed) still listed")
                elif e != errno.ENOENT:
                    out.append(f"{name} (removed by keep=) opens: "
                               + ("served" if e is None else errno.errorcode.get(e, str(e))))
            tier_names = committed_names(self.tier)
            stale = [f"{t} (save {save_id(self.tier, t)}, BACKING_DIR's "
                     f"{save_id(self.backing, t)})" for t in tier_names
                     if save_id(self.tier, t) != save_id(self.backing, t)]
            if stale:
                out.append(f"stale tier copies: {stale}")
            if len(tier_names) > 2:
                out.append(f"the tier holds {len(tier_names)} checkpoints, tier_keep=2: "
                           f"{tier_names}")
            other = sorted(set(os.listdir(self.tier)) - set(tier_names)
                           - {".flush", ".saves", ".staging", ".world"})
            if other:
                out.append(f"other entries in the tier: {other}")
            if self.records():
                out.append(f"flush records left: {self.records()}")
            saves = os.path.join(self.tier, ".saves")
            if os.path.isdir(saves) and os.listdir(saves):
                out.append(f"left in TIER/.saves: {os.listdir(saves)}")
            return out
        problems = settle(settled)

        def stale_descriptors():
            """The daemon's descriptors of data files of saves BACKING_DIR
            no longer holds (removed, or under a name it no longer has)."""
            out = []
            for fd in os.listdir(f"/proc/{daemon.proc.pid}/fd"):
                try:
                    t = os.readlink(f"/proc/{daemon.proc.pid}/fd/{fd}")
                except OSError:
                    continue
                for root in (self.tier, self.backing):
                    if not t.startswith(root + "/"):
                        continue
                    top = t[len(root) + 1:].split("/", 1)[0]
                    if top != ".staging" and (t.endswith(" (deleted)")
                                              or top not in backing_names):
                        out.append(t)
            return [f"the daemon holds {len(out)} descriptor(s) of data files BACKING_DIR "
                    f"no longer has: {sorted(out)}"] if out else []
        # an unused descriptor may be kept a while (test_shared RemovedSpace)
        problems += settle(stale_descriptors, timeout=10)
        self.report(problems, "keep= and entry removals left the tier mount showing "
                    "what BACKING_DIR no longer holds")



class FullTier(OneTruthCase):
    """Case 5: a checkpoint larger than its tier (a 32 MiB tmpfs)."""

    def small_tier(self):
        subprocess.run(["umount", "-l", self.tier], capture_output=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=32m", "tmpfs",
                            self.tier], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, f"cannot mount the tier's tmpfs: {r.stderr}")

    def test_commit_larger_than_the_tier(self):
        """Staged in RAM (passthrough=0), 48 MiB: the commit into the 32 MiB
        tier fails at once saying the tier is full and what to do, nothing
        is discarded (every staged byte reads back), and the remedy it
        names, `sync level=shared`, commits it to BACKING_DIR directly:
        served by this mount and one without the tier, no flush record,
        nothing left in the tier."""
        self.small_tier()
        m1 = self.mount_at("m1", f"tier={self.tier},passthrough=0,staging_mem=256M")
        ck = os.path.join(m1, "big")
        stage(ck, "big", 48 * MiB, blobs=("config.json",))
        with self.assertRaises(OSError) as cm:
            commit(ck)
        self.assertEqual(cm.exception.errno, errno.EIO)
        st = status(ck)
        self.assertTrue(st.startswith("failed"), st)
        self.assertIn("is full", st)
        self.assertIn("sync level=shared", st)
        self.assertIn("nothing is lost", st)
        # nothing discarded: the staged files read back whole
        self.assertEqual(read_all(os.path.join(ck, "model", "w")), tagged("big", 48 * MiB))
        self.assertEqual(read_all(os.path.join(ck, "config.json")), b'{"version": "big"}')
        commit(ck, "sync level=shared")
        self.assertTrue(status(ck).startswith("committed"), status(ck))
        self.assertIn("location shared", status(ck))
        self.assertEqual(save_id(self.backing, "big") is not None, True)
        self.assertEqual(self.records(), [])
        self.assertEqual(committed_names(self.tier), [])
        m2 = self.mount_at("m2")
        self.assertEqual(read_all(os.path.join(m2, "big", "model", "w")), tagged("big", 48 * MiB))
        self.assertEqual(head_tag(os.path.join(m1, "big", "model", "w")), "big")

    def test_staged_writes_into_a_full_tier(self):
        """Staged into a 32 MiB tier (RAM for 8 MiB, then the tier): a 40
        MiB file gets ENOSPC; the files staged before it are intact, the
        checkpoint's .status and the log say the tier is full and what to
        do; with the big file removed, `sync level=shared` commits the
        rest."""
        self.small_tier()
        m1 = self.mount_at("m1", f"tier={self.tier},staging_mem=8M")
        ck = os.path.join(m1, "c")
        stage(ck, "small", 1 * MiB, blobs=("config.json",))
        big = os.path.join(ck, "big.bin")
        chunk = b"x" * MiB
        with self.assertRaises(OSError) as cm:
            with open(big, "wb") as f:
                for _ in range(40):
                    f.write(chunk)
        self.assertEqual(cm.exception.errno, errno.ENOSPC)
        st = status(ck)
        self.assertIn("tier full", st)
        self.assertIn("sync level=shared", st)
        self.assertIn("c: a staged write got ENOSPC: tier full", self.daemon_log())
        os.unlink(big)
        self.assertEqual(read_all(os.path.join(ck, "model", "w")), tagged("small", 1 * MiB))
        commit(ck, "sync level=shared")
        self.assertTrue(status(ck).startswith("committed"), status(ck))
        m2 = self.mount_at("m2")
        self.assertEqual(head_tag(os.path.join(m2, "c", "model", "w")), "small")
        self.assertEqual(self.records(), [])

if __name__ == "__main__":
    main()

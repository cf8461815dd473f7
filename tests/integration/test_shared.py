#!/usr/bin/env python3
"""Several mounts over one BACKING_DIR (other worlds on this node or on
others): publishing a checkpoint is exclusive.

    python3 tests/integration/test_shared.py --bin build/bin/ckptfs [Class ...]

Classes:
  SameName   two and three one-rank mounts commit one NAME at once, with
             different bytes, many rounds (sync and async): exactly one
             commit succeeds, every other fails with EEXIST and its .status
             says the name was committed elsewhere; the published checkpoint
             is the winner's, whole (ckptfs-fsck clean, bytes exact on a
             fresh mount); nothing of the losers is left in BACKING_DIR, and
             a loser's mount shows the winner's checkpoint under NAME (its
             staged files discarded, .status saying so)
  LoserShowsWinner  two one-rank mounts commit race0..race7 at once: right
             after the loser's commit write fails with EEXIST, its mount
             serves the winner's bytes under NAME, .status says
             "committed" and, in a "lost:" line, that its staged files (N
             files, B bytes) were discarded, and the log says so
  Visibility a checkpoint committed through one mount is seen by another at
             once by name (stat, open) and in listings within about a
             second, without a remount; one removed through one mount is
             gone from the other; a refused one (a gap) that appears is not
             shown and is logged once
  RemovedSpace  a checkpoint read through one mount and removed through
             another: the reading mount lets go of its data files within
             a few seconds (its descriptor cache held them open, deleted,
             so their space stayed in use on the shared store until it
             evicted them), while a file of it that a reader still holds
             open keeps reading
  PerNodeBacking  a world whose ranks have a BACKING_DIR each (as nodes
             with local directories would): every rank's commit fails,
             saying BACKING_DIR must be shared, and nothing is left or
             deleted in either directory
  Leftovers  a save that was interrupted (killed daemon) leaves its own
             directory under .saves, never a NAME directory: the next mount
             removes it, and an unheld one only
  MixedWorlds  50 rounds of one NAME committed at once by three worlds
             over one BACKING_DIR, kept mounted across rounds: two one-rank
             mounts and a world of 2 ranks under mpirun (both ranks commit),
             each with its own bytes, sync and async: exactly one world
             wins (both ranks of the world of 2 agree), every other rank
             fails with EEXIST and its .status names the winner's save and
             world size; ckptfs-fsck is clean, all 4 mounts serve the
             winner's bytes (every shard), the losers' with a "lost:" line
             in .status; nothing is left in .saves or .staging (the losers'
             staged copies were discarded)
Needs root (FUSE). Python standard library only.
"""

import array
import errno
import os
import sqlite3
import subprocess
import sys
import threading
import time

from ckpttest import util as cu
from ckpttest.util import CkptfsTestCase, commit, read_all, status, write_tensor, wait_state

ROUNDS = 25
CKPT_SCAN_MAX_AGE = 1.0  # fs/core/fs.h


def fsck(backing, *names):
    exe = os.path.join(os.path.dirname(cu.BIN), "ckptfs-fsck")
    return subprocess.run([exe, backing, *names], capture_output=True, text=True)


def payload(writer, rnd, n=64 * 1024):
    """Distinct bytes per writer and round (int32 values)."""
    base = (writer * 1000003 + rnd * 7919) & 0x7FFFFFFF
    return b"".join(((base + i) & 0x7FFFFFFF).to_bytes(4, "little") for i in range(n))


class SameName(CkptfsTestCase):
    def mounts_n(self, n, opts="sync_files=0"):
        mnts = []
        for i in range(n):
            mnt = os.path.join(self.dir, f"m{i}")
            self.mount(opts, mnt=mnt)
            mnts.append(mnt)
        return mnts

    def race(self, mnts, name, rnd, mode):
        """Stage NAME on every mount with its own bytes, commit all at once;
        return the outcome per mount: 0 or an errno."""
        for w, mnt in enumerate(mnts):
            ck = self.ck(name, mnt=mnt)
            os.mkdir(ck)
            write_tensor(os.path.join(ck, "t"), "int32", [64 * 1024], payload(w, rnd))
            os.makedirs(os.path.join(ck, "sub"))
            with open(os.path.join(ck, "sub", "writer"), "wb") as f:
                f.write(str(w).encode())
        start = threading.Barrier(len(mnts))
        out = [None] * len(mnts)

        def go(w):
            start.wait()
            try:
                commit(self.ck(name, mnt=mnts[w]), mode)
                if mode == "async":
                    st = wait_state(self.ck(name, mnt=mnts[w]), timeout=120)
                    out[w] = 0 if st.startswith("committed") and "\nlost: " not in st else -1
                else:
                    out[w] = 0
            except OSError as e:
                out[w] = e.errno
        ts = [threading.Thread(target=go, args=(w,)) for w in range(len(mnts))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return out

    def check_round(self, mnts, name, rnd, out, mode):
        winners = [w for w, o in enumerate(out) if o == 0]
        self.assertEqual(len(winners), 1, f"round {rnd} ({mode}): exactly one commit of {name} "
                                          f"must succeed: outcomes {out}")
        win = winners[0]
        for w, o in enumerate(out):
            if w == win:
                continue
            st = status(self.ck(name, mnt=mnts[w]))
            if mode == "sync":
                self.assertEqual(o, errno.EEXIST, f"round {rnd}: the loser's commit must fail "
                                                  f"with EEXIST, got {o}; .status: {st}")
            self.assertIn("committed elsewhere", st,
                          f"round {rnd}: the loser's .status must say so:\n{st}")
            # the loser's mount shows the winner's checkpoint, its own
            # staged files discarded
            self.assertTrue(st.startswith("committed\n") and "were discarded" in st, st)
            self.assertEqual(read_all(self.ck(name, "sub", "writer", mnt=mnts[w])),
                             str(win).encode())
        r = fsck(self.backing, name)
        self.assertEqual(r.returncode, 0, f"round {rnd}: ckptfs-fsck:\n{r.stdout}{r.stderr}")
        # only the winner's files: its .metadata and rank 0's data files
        stored = os.listdir(self.bk(name))
        self.assertIn(".metadata", stored)
        self.assertFalse([f for f in stored if f != ".metadata" and
                          not (f.startswith("__0_") and f.endswith(".distcp"))],
                         f"round {rnd}: in {name}: {stored}")
        self.assertEqual(read_all(self.ck(name, "t", mnt=mnts[win])), payload(win, rnd),
                         f"round {rnd}: the winner's mount must serve its bytes")
        left = [e for e in os.listdir(self.backing) if e not in (name, ".staging")]
        self.assertFalse([e for e in left if not e.startswith("r")],
                         f"round {rnd}: left in BACKING_DIR: {left}")
        return win

    def run_rounds(self, n_mounts, mode):
        mnts = self.mounts_n(n_mounts)
        wins = [0] * n_mounts
        for rnd in range(ROUNDS):
            name = f"r{rnd:03d}"
            out = self.race(mnts, name, rnd, mode)
            wins[self.check_round(mnts, name, rnd, out, mode)] += 1
        print(f"\n  {n_mounts} mounts, {mode}: wins per mount {wins}", file=sys.stderr)
        # a fresh mount sees every winner, whole
        for m in self.mounts:
            m.stop()
        self.mounts.clear()
        fresh = os.path.join(self.dir, "fresh")
        self.mount(mnt=fresh)
        names = sorted(n for n in os.listdir(fresh))
        self.assertEqual(names, [f"r{i:03d}" for i in range(ROUNDS)])
        self.assertFalse(os.path.exists(self.bk(".saves")),
                         "the save directories must be gone")

    def test_two_mounts_sync(self):
        self.run_rounds(2, "sync")

    def test_three_mounts_sync(self):
        self.run_rounds(3, "sync")

    def test_two_mounts_async(self):
        self.run_rounds(2, "async")


class LoserShowsWinner(CkptfsTestCase):
    """Two one-rank mounts commit race{i} at once (sync), each with its own
    'small': the loser's mount shows the winner's checkpoint at once (not
    its own staged bytes), and says what became of its staged files."""
    ROUNDS = 8

    def test_loser_mount_serves_the_winner(self):
        mnts = [os.path.join(self.dir, f"m{i}") for i in range(2)]
        for mnt in mnts:
            self.mount("sync_files=0", mnt=mnt)
        wrong = []
        for rnd in range(self.ROUNDS):
            name = f"race{rnd}"
            mine = [f"round {rnd}, writer {w}\n".encode() * (w + 1) for w in range(2)]
            for w, mnt in enumerate(mnts):
                os.mkdir(os.path.join(mnt, name))
                with open(os.path.join(mnt, name, "small"), "wb") as f:
                    f.write(mine[w])
            start = threading.Barrier(2)
            out = [None, None]

            def go(w):
                start.wait()
                try:
                    commit(os.path.join(mnts[w], name))
                    out[w] = 0
                except OSError as e:
                    out[w] = e.errno
            ts = [threading.Thread(target=go, args=(w,)) for w in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            self.assertEqual(sorted(out), [0, errno.EEXIST], f"round {rnd}: outcomes {out}")
            win, lose = out.index(0), out.index(errno.EEXIST)
            # right after the loser's write returned: its mount shows NAME
            # as committed, the winner's bytes
            got = [read_all(os.path.join(mnt, name, "small")) for mnt in mnts]
            st = status(os.path.join(mnts[lose], name))
            if got != [mine[win], mine[win]] or not st.startswith("committed\n"):
                wrong.append(f"round {rnd}: small on the winner's mount "
                             f"{'ok' if got[win] == mine[win] else repr(got[win][:30])}, on the "
                             f"loser's {'the winner' if got[lose] == mine[win] else 'its own' if got[lose] == mine[lose] else repr(got[lose][:30])}"
                             f"; the loser's .status {st.strip()!r}")
                continue
            # .status and the log say what became of the loser's staged files
            self.assertIn(f"{name} is already committed elsewhere", st, st)
            self.assertIn(f"lost: this mount's commit of {name} failed", st, st)
            self.assertIn(f"its staged files of {name} (1 files, {len(mine[lose])} bytes) were "
                          "discarded", st, st)
            self.assertIn(f"{name}: this mount's staged files (1 files, {len(mine[lose])} bytes) "
                          "were discarded", self.daemon_log())
            self.assertFalse(st.split("\n", 1)[0] == "failed")
        print(f"\n  the loser's mount showed the winner's checkpoint in "
              f"{self.ROUNDS - len(wrong)} of {self.ROUNDS} rounds", file=sys.stderr)
        self.assertEqual(wrong, [], f"{len(wrong)} of {self.ROUNDS} rounds wrong")
        # nothing of the losers left: no save directory, no staged stream
        self.assertEqual(sorted(os.listdir(self.backing)),
                         sorted([f"race{r}" for r in range(self.ROUNDS)] +
                                [e for e in os.listdir(self.backing) if e in (".saves", ".staging")]))
        for d in (".saves", ".staging"):
            if os.path.isdir(self.bk(d)):
                self.assertEqual(os.listdir(self.bk(d)), [], d)


class Visibility(CkptfsTestCase):
    def test_commit_and_removal_seen_by_another_mount(self):
        a, b = os.path.join(self.dir, "a"), os.path.join(self.dir, "b")
        self.mount(mnt=a)
        self.mount(mnt=b)
        self.assertEqual(os.listdir(b), [])  # listed (and cached) before
        data = payload(1, 1)
        ck = self.ck("x", mnt=a)
        os.mkdir(ck)
        write_tensor(os.path.join(ck, "t"), "int32", [64 * 1024], data)
        commit(ck)
        t0 = time.monotonic()
        while "x" not in os.listdir(b):
            self.assertLess(time.monotonic() - t0, 3, "mount b must list x within about a second")
            time.sleep(0.01)
        seen = time.monotonic() - t0
        print(f"\n  listed by the other mount after {seen * 1000:.0f} ms", file=sys.stderr)
        self.assertEqual(read_all(self.ck("x", "t", mnt=b)), data)
        self.assertIn("committed", status(self.ck("x", mnt=b)))
        # by name at once (no listing first)
        ck = self.ck("y", mnt=a)
        os.mkdir(ck)
        write_tensor(os.path.join(ck, "t"), "int32", [64 * 1024], payload(2, 2))
        commit(ck)
        self.assertEqual(read_all(self.ck("y", "t", mnt=b)), payload(2, 2))
        self.assertErrno(errno.EEXIST, os.mkdir, self.ck("y", mnt=b))
        # removed through a: gone from b by name at once, from listings soon
        subprocess.run(["rm", "-r", self.ck("x", mnt=a)], check=True)
        self.assertErrno(errno.ENOENT, os.stat, self.ck("x", mnt=b))
        t0 = time.monotonic()
        while "x" in os.listdir(b):
            self.assertLess(time.monotonic() - t0, 3, "the removal must show within a second")
            time.sleep(0.01)
        self.assertEqual(sorted(os.listdir(b)), ["y"])

    def test_refused_checkpoint_appearing_is_not_shown(self):
        a, b = os.path.join(self.dir, "a"), os.path.join(self.dir, "b")
        self.mount(mnt=a)
        self.mount(mnt=b)
        ck = self.ck("g", mnt=a)
        os.mkdir(ck)
        write_tensor(os.path.join(ck, "t"), "int32", [1024], payload(0, 0, 1024))
        commit(ck)
        # another copy whose tensor claims a shape its chunk does not cover
        import shutil
        import sqlite3
        shutil.copytree(self.bk("g"), os.path.join(self.dir, "gap"))
        db = sqlite3.connect(os.path.join(self.dir, "gap", ".metadata"))
        db.execute("update tensors set shape='[4096]'")
        db.commit()
        db.close()
        os.rename(os.path.join(self.dir, "gap"), self.bk("gap"))
        for _ in range(3):
            self.assertErrno(errno.ENOENT, os.stat, self.ck("gap", mnt=b))
            time.sleep(CKPT_SCAN_MAX_AGE)
            self.assertEqual(sorted(os.listdir(b)), ["g"])
        self.assertEqual(self.daemon_log().count("not showing checkpoint gap"), 1,
                         self.daemon_log())


def deleted_held(pid, backing):
    """Data files under backing that process pid holds open, deleted."""
    out, fds = [], f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        try:
            target = os.readlink(os.path.join(fds, fd))
        except OSError:
            continue
        if target.startswith(backing + "/") and target.endswith(".distcp (deleted)"):
            out.append(target)
    return out


class RemovedSpace(CkptfsTestCase):
    def test_reader_mount_lets_go_of_removed_data_files(self):
        a, b = os.path.join(self.dir, "a"), os.path.join(self.dir, "b")
        self.mount(mnt=a)
        mb = self.mount(mnt=b)
        data = {f"t{i}": payload(i, 3, n=256 * 1024) for i in range(6)}
        for name in ("x", "y"):
            ck = self.ck(name, mnt=a)
            os.mkdir(ck)
            for t, d in data.items():
                write_tensor(os.path.join(ck, t), "int32", [256 * 1024], d)
            commit(ck)
        for t, d in data.items():   # every data file read (and cached) by b
            self.assertEqual(read_all(self.ck("x", t, mnt=b)), d)
        keep = open(self.ck("y", "t0", mnt=b), "rb")   # held by a reader
        self.addCleanup(keep.close)
        pid = mb.proc.pid
        self.assertEqual(deleted_held(pid, self.backing), [])
        for name in ("x", "y"):
            subprocess.run(["rm", "-r", self.ck(name, mnt=a)], check=True)
        t0 = time.monotonic()
        while True:
            held = deleted_held(pid, self.backing)
            # y's t0 stays open for the reader; nothing of x, nothing else of y
            if all("/y/" in h for h in held) and len(held) <= 1:
                break
            self.assertLess(time.monotonic() - t0, 10,
                            f"mount b still holds removed data files open: {held}")
            time.sleep(0.1)
        print(f"\n  let go after {time.monotonic() - t0:.1f} s", file=sys.stderr)
        self.assertEqual(keep.read(), data["t0"], "an open file of a removed checkpoint keeps reading")


class PerNodeBacking(CkptfsTestCase):
    def test_commit_refused_on_every_rank(self):
        backs = [os.path.join(self.dir, f"node{r}", "backing") for r in range(2)]
        for b in backs:
            os.makedirs(b)
        # something of each "node" that must survive
        for b in backs:
            with open(os.path.join(b, "keep"), "wb") as f:
                f.write(b"mine")
        # a BACKING_DIR of each rank's own (an mpirun app context per rank)
        w = self.start_world(2, "commit_timeout=30", backing=backs, stop_timeout=60)
        for r in range(2):
            ck = os.path.join(w.mnt(r), "step")
            os.mkdir(ck)
            write_tensor(os.path.join(ck, "t"), "int32", [2, 4], payload(r, 0, 4),
                         offsets=[r, 0], sizes=[1, 4])
        errs = [None, None]

        def go(r):
            try:
                commit(os.path.join(w.mnt(r), "step"))
            except OSError as e:
                errs[r] = e
        ts = [threading.Thread(target=go, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for r in range(2):
            self.assertIsInstance(errs[r], OSError, f"rank {r} must fail")
            st = status(os.path.join(w.mnt(r), "step"))
            self.assertIn("shared", st, f"rank {r}: .status must say why:\n{st}")
        for b in backs:
            self.assertEqual(sorted(os.listdir(b)), ["keep"], f"{b}: nothing left, nothing lost")
            with open(os.path.join(b, "keep"), "rb") as f:
                self.assertEqual(f.read(), b"mine")


class Leftovers(CkptfsTestCase):
    def test_killed_save_leaves_only_its_own_directory(self):
        env = {"CKPTFS_FAILPOINT": "write_done"}
        m = self.mount("sync_files=0", env=env)
        ck = self.ck("a")
        os.mkdir(ck)
        write_tensor(os.path.join(ck, "t"), "int32", [1024], payload(0, 0, 1024))
        try:
            commit(ck)
        except OSError:
            pass
        m.wait(60)
        self.mounts.clear()
        subprocess.run(["fusermount3", "-uz", self.mnt], capture_output=True)
        self.assertFalse(os.path.exists(self.bk("a")),
                         "an interrupted save must not leave a NAME directory")
        saves = os.listdir(self.bk(".saves"))
        self.assertEqual(len(saves), 1, saves)
        # a save directory somebody holds is left alone by a starting mount
        held = self.bk(".saves", "f" * 32)
        os.makedirs(held)
        fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_SH)
        self.mount()
        self.assertEqual(os.listdir(self.bk(".saves")), ["f" * 32])
        os.close(fd)
        self.assertEqual(os.listdir(self.mnt), [])


class MixedWorlds(CkptfsTestCase):
    """Three worlds race for one NAME per round: a and b (one rank each) and
    w (2 ranks under mpirun), all mounted once for every round."""

    ROUNDS = 50
    H = 256 * 1024          # int32 elements of model/t per shard of w (1 MiB)
    ROWS, COLS = 4, 1024    # model/m, int32, sharded on rows in w
    OPTS = "sync_files=0,commit_timeout=60"

    def setUp(self):
        super().setUp()
        self.world = self.start_world(2, self.OPTS)
        self.writers = []  # (writer name, [mountpoint of rank r])
        for wn in ("a", "b"):
            mnt = os.path.join(self.dir, wn)
            self.mount(self.OPTS, mnt=mnt)
            self.writers.append((wn, [mnt]))
        self.writers.append(("w", self.world.mnts()))
        self.all_mnts = [m for _, ms in self.writers for m in ms]

    # what writer wi stages in round rnd: the global tensors and a bytes
    # item per rank
    def tensors(self, wi, rnd):
        return (self.ramp(2 * wi, rnd, 2 * self.H),
                self.ramp(2 * wi + 1, rnd, self.ROWS * self.COLS))

    @staticmethod
    def ramp(k, rnd, n):
        """n int32 values from a start of its own per (k, round)."""
        base = ((k * 64 + rnd) * 4 * 1024 * 1024) % (2**31 - n)
        a = array.array("i", range(base, base + n))
        if sys.byteorder == "big":
            a.byteswap()
        return a.tobytes()

    def blob(self, wi, rnd, r):
        return f"writer {self.writers[wi][0]}, round {rnd}, rank {r}".encode()

    def stage(self, wi, rnd, name):
        t, m = self.tensors(wi, rnd)
        mnts = self.writers[wi][1]
        n = len(mnts)
        for r, mnt in enumerate(mnts):
            ck = os.path.join(mnt, name)
            os.mkdir(ck)
            if n == 1:
                write_tensor(os.path.join(ck, "model", "t"), "int32", [2 * self.H], t)
                write_tensor(os.path.join(ck, "model", "m"), "int32",
                             [self.ROWS, self.COLS], m)
            else:  # a shard per rank (n == 2)
                tb, rows = 4 * self.H, self.ROWS // n
                write_tensor(os.path.join(ck, "model", "t"), "int32", [2 * self.H],
                             t[r * tb:(r + 1) * tb], offsets=[r * self.H], sizes=[self.H])
                mb = rows * self.COLS * 4
                write_tensor(os.path.join(ck, "model", "m"), "int32", [self.ROWS, self.COLS],
                             m[r * mb:(r + 1) * mb], offsets=[r * rows, 0],
                             sizes=[rows, self.COLS])
            cu.write_file(os.path.join(ck, "meta", f"rank{r}"), self.blob(wi, rnd, r))

    def race(self, name, mode):
        """Commit NAME on every rank of every writer at once. Returns
        {(wi, r): (errno of the commit write or 0, .status after it)}."""
        jobs = [(wi, r, mnt) for wi, (_, ms) in enumerate(self.writers)
                for r, mnt in enumerate(ms)]
        start = threading.Barrier(len(jobs))
        out = {}

        def go(wi, r, mnt):
            ck = os.path.join(mnt, name)
            try:
                start.wait(30)
            except threading.BrokenBarrierError:
                pass
            try:
                commit(ck, mode)
                e = 0
            except OSError as ex:
                e = ex.errno
            try:
                st = wait_state(ck, timeout=120) if mode == "async" and e == 0 else status(ck)
            except (OSError, TimeoutError) as ex:
                st = f"(no .status: {ex!r})"
            out[(wi, r)] = (e, st)
        ts = [threading.Thread(target=go, args=j, daemon=True) for j in jobs]
        for t in ts:
            t.start()
        for t in ts:
            t.join(180)
        hung = [(j[0], j[1]) for j, t in zip(jobs, ts) if t.is_alive()]
        self.assertFalse(hung, f"{name}: commits of (writer, rank) {hung} did not return "
                               f"within 180 s:\n{cu.read_log(self.world.log)[-4000:]}")
        return out

    def check_round(self, rnd, name, mode, out, committed):
        tag = f"round {rnd} ({mode}, {name})"
        def where(wi, r):
            return f"{self.writers[wi][0]} rank {r}"
        ok = {k: e == 0 and st.split("\n", 1)[0] == "committed" and "\nlost: " not in st
              for k, (e, st) in out.items()}
        detail = "\n".join(f"  {where(*k)}: errno {errno.errorcode.get(e, e)}, .status "
                           f"{st.strip()!r}" for k, (e, st) in sorted(out.items()))
        if mode == "async":  # the commit write itself only queues the save
            self.assertTrue(all(e == 0 for e, _ in out.values()),
                            f"{tag}: an async commit write failed:\n{detail}")
        for wi, (wn, ms) in enumerate(self.writers):
            self.assertEqual(len({ok[(wi, r)] for r in range(len(ms))}), 1,
                             f"{tag}: the ranks of world {wn} disagree:\n{detail}")
        winners = [wi for wi in range(len(self.writers)) if ok[(wi, 0)]]
        self.assertEqual(len(winners), 1, f"{tag}: exactly one world must win:\n{detail}")
        win = winners[0]
        wsize = len(self.writers[win][1])

        # what BACKING_DIR holds under NAME: the winner's save, whole
        db = sqlite3.connect(f"file:{self.bk(name, '.metadata')}?mode=ro", uri=True)
        try:
            hdr = dict(db.execute("select key, value from checkpoint"))
        finally:
            db.close()
        self.assertEqual((hdr.get("name"), int(hdr.get("world_size", -1))), (name, wsize),
                         f"{tag}: .metadata {hdr}, winner {self.writers[win][0]}")
        save_id = hdr["save_id"]
        stored = sorted(os.listdir(self.bk(name)))
        files = [f for f in stored if f != ".metadata"]
        bad = [f for f in files if not (f.startswith("__") and f.endswith(".distcp") and
                                        f.split("_")[2].isdigit() and
                                        int(f.split("_")[2]) < wsize)]
        self.assertFalse(bad, f"{tag}: in BACKING_DIR/{name}: {stored}")
        self.assertEqual({int(f.split("_")[2]) for f in files}, set(range(wsize)),
                         f"{tag}: every rank of the winner has data files: {stored}")

        # the winner's ranks say committed, every other rank lost with EEXIST
        for (wi, r), (e, st) in sorted(out.items()):
            if wi == win:
                self.assertIn(f"world_size {wsize}\n", st, f"{tag}: {where(wi, r)}:\n{detail}")
                continue
            if mode == "sync":
                self.assertEqual(e, errno.EEXIST, f"{tag}: {where(wi, r)} must fail with "
                                                  f"EEXIST:\n{detail}")
            # NAME is the winner's checkpoint on the loser's mount too: its
            # .status says so, and what became of the loser's staged files
            self.assertEqual(st.split("\n", 1)[0], "committed", f"{tag}: {where(wi, r)}:\n{detail}")
            self.assertIn(f"\nlost: this mount's commit of {name} failed: ", st,
                          f"{tag}: {where(wi, r)}:\n{detail}")
            self.assertIn(f"{name} is already committed elsewhere (save {save_id}, world size "
                          f"{wsize}, created at ", st, f"{tag}: {where(wi, r)}:\n{detail}")
            self.assertIn(f"its staged files of {name} (", st, f"{tag}: {where(wi, r)}:\n{detail}")

        # every mount serves the winner's checkpoint, every shard of it
        t, m = self.tensors(win, rnd)
        for mnt in self.all_mnts:
            ck = os.path.join(mnt, name)
            at = f"{tag}: through {mnt} (winner {self.writers[win][0]})"
            st = status(ck)
            self.assertTrue(st.startswith("committed\n") and f"world_size {wsize}\n" in st,
                            f"{at}: .status {st!r}")
            self.assertEqual("\nlost: " in st, mnt not in self.writers[win][1], f"{at}: {st!r}")
            self.assertEqual(sorted(os.listdir(ck)), [".metadata", "meta", "model"], at)
            self.assertEqual(sorted(os.listdir(os.path.join(ck, "meta"))),
                             [f"rank{r}" for r in range(wsize)], at)
            for r in range(wsize):
                self.assertEqual(read_all(os.path.join(ck, "meta", f"rank{r}")),
                                 self.blob(win, rnd, r), at)
            got = read_all(os.path.join(ck, "model", "t"))
            self.assertTrue(got == t, f"{at}: model/t differs ({len(got)} bytes, "
                                      f"{len(t)} expected)")
            got = read_all(os.path.join(ck, "model", "m"))
            self.assertTrue(got == m, f"{at}: model/m differs ({len(got)} bytes, "
                                      f"{len(m)} expected)")

        # ckptfs-fsck: every checkpoint so far intact, nothing else
        committed.append(name)
        r = fsck(self.backing)
        lines = r.stdout.splitlines()
        self.assertEqual(r.returncode, 0, f"{tag}: ckptfs-fsck:\n{r.stdout}{r.stderr}")
        self.assertEqual(sorted(ln.split(":", 1)[0] for ln in lines), sorted(committed),
                         f"{tag}: ckptfs-fsck:\n{r.stdout}")
        self.assertFalse([ln for ln in lines if ": ok: " not in ln], f"{tag}:\n{r.stdout}")
        mine = [ln for ln in lines if ln.startswith(name + ":")]
        self.assertIn(f"world size {wsize},", mine[0], f"{tag}: {mine}")

        # no save directory, no stray entry, no staged stream left
        left = sorted(set(os.listdir(self.backing)) - set(committed) - {".staging"})
        if left == [".saves"]:
            self.assertEqual(os.listdir(self.bk(".saves")), [],
                             f"{tag}: save directories left in BACKING_DIR/.saves")
            left = []
        self.assertEqual(left, [], f"{tag}: left in BACKING_DIR")
        if os.path.isdir(self.bk(".staging")):
            self.assertEqual(os.listdir(self.bk(".staging")), [],
                             f"{tag}: left in BACKING_DIR/.staging")
        return win

    def test_fifty_rounds_one_name(self):
        t0 = time.monotonic()
        committed, wins = [], {wn: 0 for wn, _ in self.writers}
        modes = {"sync": 0, "async": 0}
        for rnd in range(self.ROUNDS):
            name = f"mixed-{rnd:03d}"
            mode = "async" if rnd % 3 == 2 else "sync"
            modes[mode] += 1
            for wi in range(len(self.writers)):
                self.stage(wi, rnd, name)
            out = self.race(name, mode)
            win = self.check_round(rnd, name, mode, out, committed)
            wins[self.writers[win][0]] += 1
        print(f"\n  {self.ROUNDS} rounds ({modes['sync']} sync, {modes['async']} async) in "
              f"{time.monotonic() - t0:.1f} s; wins: {wins}", file=sys.stderr)

        # every mount lists every round's checkpoint (within about a second)
        for mnt in self.all_mnts:
            deadline = time.monotonic() + 3
            while sorted(os.listdir(mnt)) != committed and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(sorted(os.listdir(mnt)), committed, mnt)
        # the world leaves cleanly; a fresh mount finds nothing to clean up
        for mt in self.mounts:
            self.assertEqual(mt.stop(), 0, cu.read_log(self.log)[-4000:])
        self.mounts.clear()
        rc = self.world.stop()
        self.assertEqual(rc, 0, f"mpirun exited with {rc}:\n"
                                f"{cu.read_log(self.world.log)[-4000:]}")
        fresh = os.path.join(self.dir, "fresh")
        self.mount(mnt=fresh)
        self.assertEqual(sorted(os.listdir(fresh)), committed)
        self.assertNotIn("removing unfinished save", self.daemon_log())
        self.assertNotIn("removing unfinished save", cu.read_log(self.world.log, 1 << 24))

if __name__ == "__main__":
    cu.main()

#!/usr/bin/env python3
"""Concurrency stress: many threads and processes writing, reading, listing
and committing at once, with async saves in flight, on one mount and on a
world of 2 rank mounts under mpirun. Every byte read back is compared with
what was written. scripts/test.sh runs it in every build, and also in a
ThreadSanitizer build (build-tsan, `ctest -L tsan`); a test fails when a
daemon's log shows a sanitizer report or a daemon (mpirun) does not exit 0
after its unmount.

    python3 tests/integration/test_stress.py --bin build-tsan/bin/ckptfs [Class ...]

Classes:
  OneMount  one mount (staging_mem=8M: staged data spills; verify=1): 3
            writer threads and 2 writer processes (each with a reader
            thread of its own) stage checkpoints with every write pattern
            (sequential, xattrs first, pwrite backwards, overwrite and
            truncate, rename, mmap), commit one async and, while its save
            is in flight, stage and commit the next sync or async, check
            that a committing checkpoint refuses changes, verify both, and
            rm -r the older ones; 2 reader threads list the mount, read
            every checkpoint's .status, verify committed checkpoints at
            random byte ranges (with xattrs, getfattr and the .metadata
            through sqlite3) and read staged files while they are written;
            all writers also stage parts of two shared checkpoints,
            committed async and sync while the others go on.
  World2    2 rank mounts over shared memory: per rank 2 writer threads and
            a writer process stage their parts of the same checkpoints
            (row and column shards, replicas, per-rank bytes items),
            committed alternately async and sync in the same order on both
            ranks; reader threads and processes on both ranks verify the
            committed checkpoints, list and read .status; rank 0 removes
            the old ones (every rank sees them go) while they are read.

CKPT_STRESS_SECONDS (default 20) is how long the busy phase of each test
lasts; every writer completes at least 2 rounds whatever it says.
CKPT_STRESS_SEED fixes the random choices (printed on failure).
A reader that fails to read a checkpoint that is being removed is fine;
wrong bytes never are. Python standard library only; a child process is
this file run with --child JSON.
"""

import errno
import functools
import json
import math
import mmap
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
import traceback

from ckpttest import util
from ckpttest.util import (CkptfsTestCase, commit, pread, read_all, read_log, sanitizer_report,
                           state, status, wait_state, write_file)
from ckpttest.world import block, csv, set_xattrs, split

SECONDS = float(os.environ.get("CKPT_STRESS_SECONDS", "20"))
HANG = 240  # seconds after the busy phase: a worker still running then hangs
MIN_ROUNDS = 2
STATES = ("staging", "committing", "committed", "failed")
ISZ = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1,
       "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "complex64": 8}
DTS = sorted(ISZ)
WRITE_WAYS = ("seq", "xattrs_first", "backwards", "overwrite", "rename", "mmap")


def new_seed():
    return int(os.environ.get("CKPT_STRESS_SEED") or random.SystemRandom().randrange(1 << 32))


class WrongBytes(AssertionError):
    """What was read back differs from what was written: always a failure."""


class Vanishing(Exception):
    """A listing that misses entries: fine only while the checkpoint is removed."""


# ---- what a checkpoint holds -------------------------------------------------

class Item:
    """A tensor (dtype set; chunks {rank: (offsets, sizes) or None for the
    whole}) or a bytes item (dtype None; copies {rank: bytes})."""

    def __init__(self, path, dtype, shape, data, chunks=None, copies=None):
        self.path, self.dtype, self.shape, self.data = path, dtype, shape, data
        self.chunks, self.copies = chunks, copies

    def holders(self):
        return self.chunks if self.dtype else self.copies

    def rank_bytes(self, rank):
        if not self.dtype:
            return self.copies[rank]
        c = self.chunks[rank]
        if c is None:
            return self.data
        return block(self.data, self.shape, ISZ[self.dtype], c[0], c[1])


@functools.lru_cache(maxsize=32)
def gen_items(name, part, n):
    """The items part `part` of checkpoint `name` holds in a world of n
    ranks, under NAME/part/: the same in every process."""
    rng = random.Random(f"{name}|{part}|{n}")
    out = []

    def tensor(path, dtype, shape, chunks):
        data = rng.randbytes(math.prod(shape) * ISZ[dtype])
        out.append(Item(f"{part}/{path}", dtype, shape, data, chunks=chunks))

    rows, cols = rng.randint(n, 40), rng.randint(1, 600)
    tensor("model/rows", rng.choice(DTS), [rows, cols],
           {r: ([o, 0], [s, cols]) for r, (o, s) in enumerate(split(rows, n))})
    rows, cols = rng.randint(1, 24), rng.randint(n, 300)
    tensor("model/cols", rng.choice(DTS), [rows, cols],
           {r: ([0, o], [rows, s]) for r, (o, s) in enumerate(split(cols, n))})
    tensor("optim/rep", rng.choice(DTS), [rng.randint(0, 3000)], {r: None for r in range(n)})
    tensor("optim/step", "int64", [], {r: None for r in range(n)})
    if rng.random() < 0.6:  # 1 to 2.5 MiB: several segments and FUSE requests
        rows = rng.randint(256, 640)
        tensor("model/big", "float32", [rows, 1024],
               {r: ([o, 0], [s, 1024]) for r, (o, s) in enumerate(split(rows, n))})
    cfg = rng.randbytes(rng.randint(0, 5000))
    out.append(Item(f"{part}/extra/config", None, None, cfg,
                    copies={r: cfg for r in range(n)}))
    for r in range(n):
        own = rng.randbytes(rng.randint(1, 70000))
        out.append(Item(f"{part}/rng/rank{r}", None, None, own, copies={r: own}))
    return tuple(out)


def expected(name, n, parts):
    """Every item of checkpoint name, or None for names not of this test."""
    if name.startswith("s-"):
        return list(gen_items(name, name.split("-")[1], n))
    if name.startswith(("team-", "g-")):
        return [it for p in parts for it in gen_items(name, p, n)]
    return None


# ---- writing ---------------------------------------------------------------------

def tensor_xattrs(path, it, rank):
    c = it.chunks[rank]
    shape = csv(it.shape).encode()
    if c is None:
        set_xattrs(path, it.dtype, shape)
    else:
        set_xattrs(path, it.dtype, shape, c[0], c[1])


def write_item(ckdir, it, rank, rng):
    """Write rank's share of it in one of WRITE_WAYS; returns the way."""
    p = os.path.join(ckdir, it.path)
    data = it.rank_bytes(rank)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    how = rng.choice(WRITE_WAYS)
    if how == "mmap" and not data:
        how = "seq"
    xattrs_done = False
    if how == "seq":
        write_file(p, data, chunk=rng.choice([4096, 65536, 300001, 1 << 20]))
    elif how == "xattrs_first":
        os.close(os.open(p, os.O_WRONLY | os.O_CREAT, 0o644))
        if it.dtype:
            tensor_xattrs(p, it, rank)
            xattrs_done = True
        write_file(p, data, chunk=rng.choice([8192, 1 << 20]))
    elif how == "backwards":
        step = rng.choice([1000, 65536, 777777])
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for off in reversed(range(0, len(data), step)):
                piece = data[off:off + step]
                if os.pwrite(fd, piece, off) != len(piece):
                    raise AssertionError(f"short pwrite to {p}")
        finally:
            os.close(fd)
    elif how == "overwrite":
        write_file(p, rng.randbytes(len(data) + rng.randint(1, 5000)))
        fd = os.open(p, os.O_WRONLY)
        try:
            pos = 0
            while pos < len(data):
                pos += os.pwrite(fd, data[pos:pos + (1 << 20)], pos)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)
    elif how == "rename":
        tmp = p + ".part"
        write_file(tmp, data)
        if it.dtype and rng.random() < 0.5:
            tensor_xattrs(tmp, it, rank)
            xattrs_done = True
        os.rename(tmp, p)
    elif how == "mmap":
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, len(data))
            with mmap.mmap(fd, len(data)) as m:
                m[:] = data
                m.flush()
        finally:
            os.close(fd)
    if it.dtype and not xattrs_done:
        tensor_xattrs(p, it, rank)
    return how


def stage_part(ckdir, name, part, n, rank, rng):
    """Write rank's share of part of name, then read it back as staged."""
    items = [it for it in gen_items(name, part, n) if rank in it.holders()]
    for it in items:
        write_item(ckdir, it, rank, rng)
    check_staged(ckdir, items, rank)


def check_staged(ckdir, items, rank):
    for it in items:
        p = os.path.join(ckdir, it.path)
        got, want = read_all(p), it.rank_bytes(rank)
        if got != want:
            raise WrongBytes(f"staged {p}: {describe_diff(got, want)}")
        if it.dtype and os.getxattr(p, "user.ckpt.dtype") != it.dtype.encode():
            raise WrongBytes(f"staged {p}: user.ckpt.dtype {os.getxattr(p, 'user.ckpt.dtype')!r}")


# ---- reading ---------------------------------------------------------------------

def describe_diff(got, want):
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                 min(len(got), len(want)))
    return f"{len(got)} bytes read, {len(want)} expected, first difference at {first}"


def listing(ckdir):
    seen = set()
    for dirpath, _, files in os.walk(ckdir):
        for f in files:
            seen.add(os.path.relpath(os.path.join(dirpath, f), ckdir))
    return seen


def verify_committed(ckdir, items, rng, thorough):
    """ckdir shows exactly items: the listing, sizes, xattrs, the whole
    content (thorough) or random items at random byte ranges."""
    want = {it.path for it in items} | {".metadata"}
    got = listing(ckdir)
    if got != want:
        raise Vanishing(f"listing of {ckdir}: missing {sorted(want - got)[:5]}, "
                        f"extra {sorted(got - want)[:5]}")
    for it in (items if thorough else rng.sample(items, min(3, len(items)))):
        p = os.path.join(ckdir, it.path)
        size = os.stat(p).st_size
        if size != len(it.data):
            raise WrongBytes(f"{p}: st_size {size}, {len(it.data)} expected")
        if thorough or rng.random() < 0.3:
            got = read_all(p)
            if got != it.data:
                raise WrongBytes(f"{p}: {describe_diff(got, it.data)}")
        for _ in range(3):
            off = rng.randint(0, len(it.data))
            length = rng.choice([1, 4095, 65536, 300000, 1 << 21])
            got = pread(p, length, off)
            if got != it.data[off:off + length]:
                raise WrongBytes(f"{p}: pread({length}, {off}): "
                                 f"{describe_diff(got, it.data[off:off + length])}")
        if it.dtype:
            dt, shape = os.getxattr(p, "user.ckpt.dtype"), os.getxattr(p, "user.ckpt.shape")
            if (dt, shape) != (it.dtype.encode(), csv(it.shape).encode()):
                raise WrongBytes(f"{p}: xattrs {dt!r} {shape!r}, expected "
                                 f"{it.dtype} {csv(it.shape)}")
        else:
            try:
                os.getxattr(p, "user.ckpt.dtype")
                raise WrongBytes(f"{p}: a bytes item with user.ckpt.dtype")
            except OSError as e:
                if e.errno != errno.ENODATA:
                    raise
    if thorough and rng.random() < 0.3 and shutil.which("getfattr"):
        it = rng.choice(items)
        r = subprocess.run(["getfattr", "--absolute-names", "-d", "-m", "-",
                            os.path.join(ckdir, it.path)], capture_output=True, text=True)
        if r.returncode != 0:
            raise OSError(errno.EIO, f"getfattr {it.path}: {r.stderr.strip()}")
        if it.dtype and f'user.ckpt.dtype="{it.dtype}"' not in r.stdout:
            raise WrongBytes(f"getfattr {it.path}: {r.stdout!r}")
    if thorough and rng.random() < 0.3:
        db = os.path.join(ckdir, ".metadata")
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            nt = con.execute("select count(*) from tensors").fetchone()[0]
            nb = con.execute("select count(*) from blobs").fetchone()[0]
        finally:
            con.close()
        want_t = sum(1 for it in items if it.dtype)
        if (nt, nb) != (want_t, len(items) - want_t):
            raise WrongBytes(f"{db}: {nt} tensors and {nb} blobs, expected "
                             f"{want_t} and {len(items) - want_t}")


def gone(mnt, name, wait=60.0):
    """Does name leave the listing of mnt within wait seconds?"""
    deadline = time.monotonic() + wait
    while True:
        if name not in os.listdir(mnt):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def peek(ckdir, rng, items, rank):
    """Read a file of a checkpoint that is staged or committing. While it
    is being written its content is not known yet: only that reading works
    or fails cleanly. Once frozen (items given) it is this rank's share, or
    the whole item if the commit has ended meanwhile."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(ckdir) for f in fs]
    if not files:
        return False
    p = rng.choice(files)
    try:
        os.stat(p)
        with open(p, "rb") as f:
            got = f.read(rng.choice([1, 4096, 1 << 20, 1 << 22]))
        os.listxattr(p)
        os.getxattr(p, "user.ckpt.shape")
    except OSError:
        return False
    it = next((i for i in items or () if i.path == os.path.relpath(p, ckdir)), None)
    if it is None:
        return False
    want = [it.data[:len(got)]]
    if rank in it.holders():
        want.append(it.rank_bytes(rank)[:len(got)])
    if got not in want:
        raise WrongBytes(f"{p} (frozen): {describe_diff(got, want[-1])}")
    return True


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.c = {}

    def add(self, key, k=1):
        with self.lock:
            self.c[key] = self.c.get(key, 0) + k

    def merge(self, d):
        for k, v in d.items():
            self.add(k, v)


def reader_loop(mnt, rank, n, parts, until, stop, stats, rng):
    """List rank's mount mnt, read .status of any checkpoint, verify
    committed ones at random, peek into the others; until until() is true."""
    while not until() and not stop.is_set():
        names = os.listdir(mnt)
        stats.add("listings")
        if not names:
            time.sleep(0.01)
            continue
        name = rng.choice(names)
        ck = os.path.join(mnt, name)
        try:
            st = status(ck)
        except OSError:
            if gone(mnt, name):
                stats.add("vanished")
                continue
            raise
        first = st.split("\n", 1)[0].strip()
        stats.add("status_" + first)
        if first not in STATES:
            raise AssertionError(f"{ck}/.status: {st!r}")
        if first == "failed":
            raise AssertionError(f"{ck} failed: {st}")
        items = expected(name, n, parts)
        if first == "committed" and items is not None:
            try:
                verify_committed(ck, items, rng, thorough=False)
                stats.add("reader_verified")
            except (OSError, Vanishing):
                if gone(mnt, name):
                    stats.add("vanished")
                    continue
                raise
        elif peek(ck, rng, items if first == "committing" else None, rank):
            stats.add("frozen_peeks_verified")
        else:
            stats.add("peeks")


def expect_refused(fn, what):
    """fn must fail with EBUSY (committing) or EROFS (committed)."""
    try:
        fn()
    except OSError as e:
        if e.errno not in (errno.EBUSY, errno.EROFS):
            raise AssertionError(f"{what}: {e!r}, expected EBUSY or EROFS")
        return
    raise AssertionError(f"{what}: succeeded on a checkpoint that commits")


def writer_loop(mnt, backing, part, deadline, stop, stats, rng, team, team_done):
    """One writer of the one-mount test (a thread or a child process)."""
    for t in team:
        stage_part(os.path.join(mnt, t), t, part, 1, 0, rng)
    team_done()
    rnd, committed = 0, []
    while not stop.is_set() and (time.monotonic() < deadline or rnd < MIN_ROUNDS):
        a, b = f"s-{part}-{rnd}a", f"s-{part}-{rnd}b"
        A, B = os.path.join(mnt, a), os.path.join(mnt, b)
        os.mkdir(A)
        stage_part(A, a, part, 1, 0, rng)
        commit(A, "async")
        stats.add("async_commits")
        if state(A) == "committing":
            stats.add("async_seen_in_flight")
        expect_refused(lambda: commit(A, "async"), f"a second commit of {a}")
        expect_refused(lambda: write_file(os.path.join(A, part, "late"), b"late"),
                       f"a new file in {a}")
        # the next checkpoint is staged and committed while A's save runs
        os.mkdir(B)
        stage_part(B, b, part, 1, 0, rng)
        mode = rng.choice(("sync", "async"))
        a_busy = state(A) == "committing"
        commit(B, mode)
        stats.add(f"{mode}_commits")
        if a_busy:
            stats.add(f"{mode}_commit_behind_async")
        for x, X in ((a, A), (b, B)):
            st = wait_state(X)
            if st.split("\n", 1)[0] != "committed":
                raise AssertionError(f"{x}: {st!r}")
            verify_committed(X, list(gen_items(x, part, 1)), rng, thorough=True)
            if not os.path.exists(os.path.join(backing, x, ".metadata")):
                raise AssertionError(f"{x}: no .metadata in the backing directory")
            committed.append(x)
        if rng.random() < 0.3:  # a checkpoint given up while staged
            d = f"d-{part}-{rnd}"
            os.mkdir(os.path.join(mnt, d))
            stage_part(os.path.join(mnt, d), d, part, 1, 0, rng)
            shutil.rmtree(os.path.join(mnt, d))
            if d in os.listdir(mnt):
                raise AssertionError(f"{d} still listed after rm -r")
            stats.add("discarded")
        while len(committed) > 3:
            old = committed.pop(0)
            shutil.rmtree(os.path.join(mnt, old))
            if old in os.listdir(mnt) or os.path.exists(os.path.join(backing, old)):
                raise AssertionError(f"{old} still there after rm -r")
            stats.add("removed")
        rnd += 1
    stats.add("writer_rounds", rnd)


# ---- child processes -------------------------------------------------------------

def child_main(cfg):
    """A writer process (mode "writer": one mount) or a stager of a rank
    (mode "world": commands on stdin); each with a reader thread."""
    seed = cfg["seed"]
    stats, stop = Stats(), threading.Event()
    errors = []
    done = threading.Event()

    def reader():
        try:
            reader_loop(cfg["mnt"], cfg["rank"], cfg["n"], cfg["parts"], done.is_set,
                        stop, stats, random.Random(seed + 1))
        except BaseException:
            errors.append(traceback.format_exc())
            stop.set()

    rt = threading.Thread(target=reader, daemon=True)
    rt.start()
    out = sys.stdout
    rc = 0
    try:
        rng = random.Random(seed)
        if cfg["mode"] == "writer":
            def team_done():
                out.write("team-done\n")
                out.flush()
            writer_loop(cfg["mnt"], cfg["backing"], cfg["part"],
                        time.monotonic() + cfg["seconds"], stop, stats, rng,
                        cfg["team"], team_done)
        else:
            for line in sys.stdin:
                cmd = json.loads(line)
                if cmd["op"] == "quit":
                    break
                try:
                    stage_part(cmd["ck"], cmd["name"], cmd["part"], cfg["n"], cfg["rank"], rng)
                    out.write("ok\n")
                except BaseException:
                    out.write("err " + json.dumps(traceback.format_exc()) + "\n")
                    raise
                finally:
                    out.flush()
    except BaseException:
        errors.append(traceback.format_exc())
        stop.set()
    done.set()
    rt.join()
    if errors:
        sys.stderr.write(f"child {cfg.get('part', cfg.get('rank'))} (seed {seed}):\n"
                         + "\n".join(errors))
        rc = 1
    out.write("stats " + json.dumps(stats.c) + "\n")
    out.flush()
    return rc


class Child:
    """A child process; with on_line, a thread of ours reads its stdout."""

    def __init__(self, cfg, errfile, on_line=None):
        self.err = open(errfile, "w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.stats = {}
        self.reader = None
        if on_line:
            def read():
                while True:
                    ln = self.line()
                    if not ln:
                        return
                    on_line(ln)
            self.reader = threading.Thread(target=read, daemon=True)
            self.reader.start()

    def line(self):
        ln = self.proc.stdout.readline()
        if ln.startswith("stats "):
            self.stats = json.loads(ln[6:])
        return ln

    def send(self, cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout=600):
        """Wait for the exit; the exit code and stderr."""
        if self.reader:
            self.reader.join(timeout)
        else:
            while self.line():
                pass
        rc = self.proc.wait(timeout)
        self.err.seek(0)
        return rc, self.err.read()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.err):
            try:
                f.close()
            except OSError:
                pass


# ---- the tests ---------------------------------------------------------------------

class Workers:
    """Threads that stop everything at the first error and keep it."""

    def __init__(self, seed, hard):
        self.seed, self.hard = seed, hard
        self.stop = threading.Event()
        self.errors = []
        self.threads = []

    def start(self, name, fn, *args):
        def run():
            try:
                fn(*args)
            except BaseException:
                self.errors.append(f"{name}:\n{traceback.format_exc()}")
                self.stop.set()
        t = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(t)
        t.start()
        return t

    def remaining(self):
        return max(1.0, self.hard - time.monotonic())

    def join(self, threads=None):
        for t in self.threads if threads is None else threads:
            t.join(self.remaining())
            if t.is_alive():
                self.errors.append(f"{t.name} did not finish {HANG} s after "
                                   "the busy phase (hung?)")
                self.stop.set()

    def check(self, test):
        if self.errors:
            test.fail(f"seed {self.seed}: {len(self.errors)} errors; first:\n"
                      + "\n".join(self.errors[:3]))


def report(title, stats, t0):
    sys.stderr.write(f"\n{title}: {time.monotonic() - t0:.1f} s, "
                     + ", ".join(f"{k}={v}" for k, v in sorted(stats.c.items())) + "\n")


def check_children(test, children, w):
    w.check(test)  # a hung worker: the children may hang too (cleanup kills them)
    for name, ch in children.items():
        rc, err = ch.finish(w.remaining())
        test.assertEqual(rc, 0, f"seed {w.seed}: child {name} exited {rc}:\n{err[-6000:]}")


class OneMount(CkptfsTestCase):
    N_THREADS = 3
    N_PROCS = 2
    N_READERS = 2
    TEAM = ("team-0", "team-1")
    OPTS = "staging_mem=8M,io_threads=3,verify=1,commit_timeout=300"

    def test_stress(self):
        t0 = time.monotonic()
        seed = new_seed()
        m = self.mount(opts=self.OPTS)
        mnt, backing = self.mnt, self.backing
        parts = [f"t{i}" for i in range(self.N_THREADS)] + [f"c{i}" for i in range(self.N_PROCS)]
        for t in self.TEAM:
            os.mkdir(os.path.join(mnt, t))
        deadline = time.monotonic() + SECONDS
        stats, w = Stats(), Workers(seed, deadline + HANG)
        team_left = [len(parts)]
        team_cv = threading.Condition()

        def team_done():
            with team_cv:
                team_left[0] -= 1
                team_cv.notify_all()

        children = {}
        self.addCleanup(lambda: [ch.kill() for ch in children.values()])
        for i, p in enumerate(parts):
            if p.startswith("c"):
                cfg = {"mode": "writer", "mnt": mnt, "backing": backing, "part": p,
                       "rank": 0, "n": 1, "parts": parts, "team": list(self.TEAM),
                       "seconds": SECONDS, "seed": seed + 100 * i}
                children[p] = Child(cfg, os.path.join(self.dir, f"{p}.err"),
                                    on_line=lambda ln: ln == "team-done\n" and team_done())
        for i, p in enumerate(parts):
            if p.startswith("t"):
                w.start(p, writer_loop, mnt, backing, p, deadline, w.stop, stats,
                        random.Random(seed + 100 * i), self.TEAM, team_done)
        writers_done = threading.Event()
        for i in range(self.N_READERS):
            w.start(f"reader{i}", reader_loop, mnt, 0, 1, parts, writers_done.is_set,
                    w.stop, stats, random.Random(seed + 7 + i))

        def team_commit():
            with team_cv:
                while team_left[0] > 0 and not w.stop.is_set():
                    team_cv.wait(1)
            if w.stop.is_set():
                return
            rng = random.Random(seed + 3)
            for t in self.TEAM:
                for p in parts:
                    check_staged(os.path.join(mnt, t),
                                 [it for it in gen_items(t, p, 1)], 0)
            commit(os.path.join(mnt, self.TEAM[0]), "async")
            commit(os.path.join(mnt, self.TEAM[1]), "sync")
            for t in self.TEAM:
                st = wait_state(os.path.join(mnt, t))
                if st.split("\n", 1)[0] != "committed":
                    raise AssertionError(f"{t}: {st!r}")
                verify_committed(os.path.join(mnt, t), expected(t, 1, parts), rng, True)
            stats.add("team_committed", len(self.TEAM))

        w.start("team", team_commit)
        w.join([t for t in w.threads if t.name.startswith(("t", "team"))])
        check_children(self, children, w)
        writers_done.set()
        w.join()
        w.check(self)
        for ch in children.values():
            stats.merge(ch.stats)
        self.final_check(mnt, backing, parts, seed)
        rc = m.stop()
        if rc != 0:
            text = self.daemon_log()
            bad = sanitizer_report(text)
            shown = text[text.index(bad):][:12000] if bad else text[-6000:]
            self.fail(f"the daemon exited {rc}:\n{shown}")
        self.assertGreaterEqual(stats.c.get("team_committed", 0), 2)
        self.assertGreater(stats.c.get("async_commits", 0), 0)
        self.assertGreater(stats.c.get("reader_verified", 0), 0)
        report(f"{type(self).__name__} (seed {seed})", stats, t0)

    def final_check(self, mnt, backing, parts, seed):
        """Everything left is committed, whole, and in the backing directory."""
        rng = random.Random(seed)
        names = sorted(os.listdir(mnt))
        self.assertTrue(set(self.TEAM) <= set(names), names)
        for name in names:
            ck = os.path.join(mnt, name)
            st = status(ck)
            self.assertEqual(st.split("\n", 1)[0], "committed", f"{name}: {st!r}")
            verify_committed(ck, expected(name, 1, parts), rng, thorough=True)
        stored = sorted(x for x in os.listdir(backing) if not x.startswith("."))
        self.assertEqual(stored, names, "backing directory and mount disagree")


class OneMountPassthrough(OneMount):
    """The same with -o passthrough=1 (where libfuse and the kernel have
    it): files created write-only go to memfds through the kernel, the
    drain thread copies closed ones into streams while writers reopen,
    rewrite, truncate and remove them and readers read them."""
    OPTS = OneMount.OPTS + ",passthrough=1"


class RemovedWhileOpen(CkptfsTestCase):
    """Committed files held open and read on several threads while their
    checkpoint is removed, then closed: the last close frees the removed
    nodes on whichever daemon thread takes it. Under ThreadSanitizer that
    free must be ordered after every read reply (replies spliced from a
    data file included): CI's TSan run reported a heap-use-after-free in
    OneMount, where readers hold files of checkpoints being removed."""

    ROUNDS = 12
    SHAPE = (256, 128)

    def test_read_remove_close(self):
        self.mount(opts="direct_reads=1,verify=1")
        data = bytes(random.Random(5).randrange(256) for _ in range(256 * 128 * 4))
        row = 128 * 4
        want = {"w": data, "blob": b"b" * 70000, ".npy/w.npy": None,
                ".w[0:256,0:64]": b"".join(data[r * row:r * row + 256] for r in range(256)),
                ".w[100:200]": data[100 * row:200 * row]}
        for rnd in range(self.ROUNDS):
            ck = self.ck(f"r{rnd}")
            os.mkdir(ck)
            write_file(os.path.join(ck, "w"), data)
            os.setxattr(os.path.join(ck, "w"), "user.ckpt.dtype", b"float32")
            os.setxattr(os.path.join(ck, "w"), "user.ckpt.shape", b"256,128")
            write_file(os.path.join(ck, "blob"), want["blob"])
            commit(ck)
            fds = {k: os.open(os.path.join(ck, k), os.O_RDONLY) for k in want}
            stop = threading.Event()
            errors = []

            def reader(seed):
                rng = random.Random(seed)
                while not stop.is_set():
                    k = rng.choice(sorted(fds))
                    try:
                        got = os.pread(fds[k], 1 << 20, 0)
                    except OSError:
                        continue  # removed under it: failing is fine
                    if k.endswith(".npy"):  # a header, then the tensor's bytes
                        got = got[-len(data):] if len(got) > len(data) else got
                    if got and got != (want[k] or data):
                        errors.append(f"{k}: {len(got)} wrong bytes")
                        return

            threads = [threading.Thread(target=reader, args=(rnd * 10 + i,))
                       for i in range(4)]
            for t in threads:
                t.start()
            time.sleep(0.05)
            shutil.rmtree(ck)
            time.sleep(0.05)
            stop.set()
            for t in threads:
                t.join()
            for fd in fds.values():
                os.close(fd)
            self.assertEqual(errors, [])
            self.assertFalse(os.path.exists(ck))
        self.assertEqual(os.listdir(self.mnt), [])
        rc = self.mounts[0].stop()
        text = self.daemon_log()
        bad = sanitizer_report(text)
        self.assertIsNone(bad, text[text.index(bad):][:12000] if bad else "")
        self.assertEqual(rc, 0, text[-6000:])


class World2(CkptfsTestCase):
    N = 2
    OPTS = "commit_timeout=300,staging_mem=16M,direct_reads=0"
    PARTS = ("t", "u", "c")  # 2 writer threads and a writer process per rank

    def setUp(self):
        super().setUp()
        self.world = self.start_world(self.N, self.OPTS, transport="vader")

    def test_stress(self):
        t0 = time.monotonic()
        seed = new_seed()
        w, n = self.world, self.N
        parts = list(self.PARTS)
        deadline = time.monotonic() + SECONDS
        stats, wk = Stats(), Workers(seed, deadline + HANG)
        children = {}
        self.addCleanup(lambda: [ch.kill() for ch in children.values()])
        for r in range(n):
            cfg = {"mode": "world", "mnt": w.mnt(r), "rank": r, "n": n, "parts": parts,
                   "seed": seed + 1000 * (r + 1)}
            children[r] = Child(cfg, os.path.join(self.dir, f"rank{r}.err"))
        verified = {r: set() for r in range(n)}  # names each rank's driver verified
        vlock = threading.Lock()

        # Every rank runs the same rounds: the drivers decide together
        # whether to begin another one.
        go, rounds = [True], [0]

        def decide():
            go[0] = not wk.stop.is_set() and (time.monotonic() < deadline
                                              or rounds[0] < MIN_ROUNDS + 1)
            rounds[0] += 1

        barrier = threading.Barrier(n, action=decide)

        def driver(r):
            try:
                driver_rounds(r)
            except BaseException:
                barrier.abort()  # the other drivers stop too
                raise

        def driver_rounds(r):
            mnt, child = w.mnt(r), children[r]
            rng = random.Random(seed + r)
            i, pending = 0, []
            while True:
                barrier.wait(wk.remaining())
                if not go[0]:
                    break
                name = f"g-{i}"
                ck = os.path.join(mnt, name)
                os.mkdir(ck)
                child.send({"op": "stage", "ck": ck, "name": name, "part": "c"})
                stagers = [wk.start(f"stage{r}{p}", stage_part, ck, name, p, n, r,
                                    random.Random(rng.random())) for p in ("t", "u")]
                reply = child.line()
                wk.join(stagers)
                if reply != "ok\n":
                    raise AssertionError(f"rank {r} child staging {name}: {reply!r}")
                if wk.stop.is_set():
                    barrier.abort()
                    return
                mode = "async" if i % 2 == 0 else "sync"
                prev_busy = bool(pending) and state(os.path.join(mnt, pending[-1])) == "committing"
                commit(ck, mode)  # sync: returns when both ranks have saved it
                stats.add(f"{mode}_commits")
                if prev_busy:
                    stats.add(f"{mode}_commit_behind_async")
                if mode == "async" and state(ck) == "committing":
                    stats.add("async_seen_in_flight")
                pending.append(name)
                finish(r, pending[:-1] if mode == "async" else pending, rng)
                del pending[:-1 if mode == "async" else len(pending)]
                if r == 0:
                    remove_old(keep_from=i - 2)
                i += 1
            finish(r, pending, rng)
            stats.add("rank_rounds", i)

        def finish(r, names, rng):
            for name in names:
                ck = os.path.join(w.mnt(r), name)
                st = wait_state(ck)
                if st.split("\n", 1)[0] != "committed":
                    raise AssertionError(f"rank {r} {name}: {st!r}")
                verify_committed(ck, expected(name, n, parts), rng, thorough=True)
                with vlock:
                    verified[r].add(name)

        def remove_old(keep_from):
            """rm -r on rank 0 what every rank has verified, but the last ones."""
            with vlock:
                old = sorted((x for x in set.intersection(*verified.values())
                              if int(x[2:]) < keep_from), key=lambda x: int(x[2:]))
                for x in old:
                    for v in verified.values():
                        v.discard(x)
            for x in old:
                shutil.rmtree(os.path.join(w.mnt(0), x))
                if os.path.exists(os.path.join(self.backing, x)):
                    raise AssertionError(f"{x} still in the backing directory after rm -r")
                for r in range(n):
                    if not gone(w.mnt(r), x, wait=10):
                        raise AssertionError(f"rank {r} still lists {x} after rm -r")
                stats.add("removed")

        drivers = [wk.start(f"driver{r}", driver, r) for r in range(n)]
        drivers_done = threading.Event()
        for r in range(n):
            wk.start(f"reader{r}", reader_loop, w.mnt(r), r, n, parts, drivers_done.is_set,
                     wk.stop, stats, random.Random(seed + 50 + r))
        wk.join(drivers)
        drivers_done.set()
        wk.check(self)
        for ch in children.values():
            if ch.proc.poll() is None:
                ch.send({"op": "quit"})
        check_children(self, children, wk)
        wk.join()
        wk.check(self)
        for ch in children.values():
            stats.merge(ch.stats)
        # what is left: the same on every rank, whole, and stored
        rng = random.Random(seed)
        names = sorted(os.listdir(w.mnt(0)))
        self.assertTrue(names, "nothing left to check")
        for r in range(n):
            self.assertEqual(sorted(os.listdir(w.mnt(r))), names, f"rank {r}")
            for name in names:
                verify_committed(os.path.join(w.mnt(r), name), expected(name, n, parts),
                                 rng, thorough=True)
        self.assertEqual(sorted(x for x in os.listdir(self.backing) if not x.startswith(".")),
                         names)
        rc = w.stop()
        self.extra_logs.remove(w.log)  # checked here, not again in cleanup
        text = read_log(w.log, limit=1 << 24)
        bad = sanitizer_report(text)
        if bad:
            self.fail(f"sanitizer report in {w.log}: {bad}\n{text[text.index(bad):][:8000]}")
        self.assertEqual(rc, 0, f"mpirun exited {rc} after the unmounts:\n{text[-6000:]}")
        self.assertGreater(stats.c.get("async_commits", 0), 0)
        self.assertGreater(stats.c.get("sync_commits", 0), 0)
        report(f"World2 (seed {seed})", stats, t0)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(child_main(json.loads(sys.argv[2])))
    util.main()

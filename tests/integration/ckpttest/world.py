"""Worlds of N rank mounts for the multi-rank tests: a real ckptfs world
started by mpirun (World), the trainers' side (tensors split into chunks,
bytes items), and the expected bytes of every tensor computed in Python
with struct. Python standard library only.

    w = World(BIN, 4, backing, root, log, transport="vader").start()
    ...                  # w.mnt(r) is rank r's mount
    rc = w.stop()        # fusermount3 -u on every rank, wait for mpirun

A test of util.CkptfsTestCase gets one with self.start_world(n, opts),
stopped and checked in its cleanup. A world's stdout and stderr (every
rank's, through mpirun) go to one log file; the tests fail when it shows a
sanitizer report. Mounts are always unmounted by stop(), lazily as a last
resort, and stragglers of the launched session are killed by pid.
"""

import errno
import itertools
import math
import os
import random
import signal
import sqlite3
import struct
import subprocess
import threading
import time

from . import sanenv
from .util import (commit, csv, mountinfo_has, pread, read_all,  # noqa: F401
                   read_log, sanitizer_report, state, status, wait_state)

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
TRANSPORTS = {"vader": "self,vader", "tcp": "self,tcp", "any": "self,vader,tcp"}


# ---- the world ---------------------------------------------------------------

def rank_pid(world, rank):
    """Pid of the ckptfs process of rank in world, or None."""
    want = f"OMPI_COMM_WORLD_RANK={rank}".encode()
    for pid in world.session_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"ckptfs" and want in env:
            return pid
    return None


class World:
    """N rank mounts of one ckptfs world (one mpirun) over one backing dir.

    Its environment is sanenv.env(env_extra, mpi=True, leak_check=...):
    in the ASan build, with leak_check (the default; env
    CKPT_MR_LEAK_CHECK=0 turns it off) leaks stay checked, Open MPI's own
    never-freed allocations suppressed; without it, ASAN_OPTIONS gets
    detect_leaks=0 for this mpirun world only. Every other ASan and UBSan
    report fails the test either way.

    env_extra: more variables for every rank (mpirun -x). mpirun_args:
    more mpirun options (say --enable-recovery). backing may be a list, a
    BACKING_DIR per rank (each node's own directory at its own path): one
    mpirun app context per rank.
    """

    def __init__(self, binary, n, backing, root, log, transport="vader",
                 opts="", leak_check=None, env_extra=None, mpirun_args=()):
        self.binary, self.n = binary, n
        self.env_extra = dict(env_extra or {})  # for every rank (mpirun -x)
        self.mpirun_args = list(mpirun_args)
        self.backing, self.root, self.log = backing, root, log
        self.transport = transport
        self.opts = opts
        if leak_check is None:
            leak_check = sanenv.leak_check_default()
        self.leak_check = leak_check
        self.proc = None
        self.returncode = None

    def mnt(self, rank):
        return os.path.join(self.root, f"rank{rank}")

    def mnts(self):
        return [self.mnt(r) for r in range(self.n)]

    def per_rank_backing(self):
        return isinstance(self.backing, (list, tuple))

    def argv(self):
        cmd = MPIRUN + self.mpirun_args
        if not self.per_rank_backing():
            cmd += ["-np", str(self.n)]
        cmd += ["--mca", "btl", TRANSPORTS[self.transport]]
        for var in (*sanenv.VARS, *sorted(self.env_extra)):
            cmd += ["-x", var]
        daemon = [self.binary, "-f"] + (["-o", self.opts] if self.opts else [])
        if not self.per_rank_backing():
            return cmd + daemon + [self.backing, os.path.join(self.root, "rank%r")]
        for r, b in enumerate(self.backing):  # an app context per rank
            cmd += ([":"] if r else []) + ["-np", "1"] + daemon + [b, self.mnt(r)]
        return cmd

    def env(self):
        return sanenv.env(self.env_extra, mpi=True, leak_check=self.leak_check)

    def start(self, timeout=90):
        for b in (self.backing if self.per_rank_backing() else [self.backing]):
            os.makedirs(b, exist_ok=True)
        for m in self.mnts():
            os.makedirs(m, exist_ok=True)
        with open(self.log, "ab") as logf:
            logf.write(("=== " + " ".join(self.argv()) + "\n").encode())
            logf.flush()
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL,
                                         stdout=logf, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=self.env())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(mountinfo_has(m) for m in self.mnts()):
                return self
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.stop()
                raise RuntimeError(f"mpirun exited with {rc} before every rank "
                                   f"was mounted:\n{read_log(self.log)}")
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.n} rank mounts not ready in {timeout}s:\n"
                           f"{read_log(self.log)}")

    def session_pids(self):
        """Every live process of the session mpirun leads (ranks included)."""
        pids = []
        if self.proc is None:
            return pids
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    if os.getsid(int(p)) == self.proc.pid:
                        pids.append(int(p))
                except OSError:
                    pass
        return pids

    def unmount(self, rank):
        """fusermount3 -u, retried while busy; False if it never worked."""
        m = self.mnt(rank)
        for _ in range(100):
            if not mountinfo_has(m):
                return True
            r = subprocess.run(["fusermount3", "-u", m], capture_output=True)
            if r.returncode == 0:
                return True
            time.sleep(0.1)
        return False

    def stop(self, timeout=120):
        """Unmount every rank, wait for mpirun; its exit code (None: killed)."""
        for r in range(self.n):
            self.unmount(r)
        if self.proc is not None:
            try:
                self.returncode = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.returncode = None
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    for pid in self.session_pids():
                        try:
                            os.kill(pid, sig)
                        except OSError:
                            pass
                    try:
                        self.proc.wait(10)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                self.returncode = None
            for pid in self.session_pids():  # stragglers
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            self.proc = None
        for m in self.mnts():
            if mountinfo_has(m):
                subprocess.run(["fusermount3", "-uz", m], capture_output=True)
        return self.returncode

    def dead(self):
        """mpirun has exited (or was never started)."""
        return self.proc is None or self.proc.poll() is not None

    def stop_checked(self, timeout=120):
        """stop(), then AssertionError when the log shows a sanitizer report
        or mpirun did not exit 0 (a class's world, in its class cleanup)."""
        rc = self.stop(timeout)
        text = read_log(self.log, limit=1 << 24)
        bad = sanitizer_report(text)
        if bad:
            raise AssertionError(f"sanitizer report in {self.log}: {bad}\n"
                                 f"{text[text.index(bad):][:6000]}")
        if rc != 0:
            raise AssertionError(f"mpirun exited with {rc} after the unmounts:\n{text[-4000:]}")


# ---- the trainer's side ---------------------------------------------------

def commit_all(world, names, mode="sync", ranks=None, timeout=180):
    """Commit on several ranks at once, one thread per rank.

    names: one checkpoint name for every rank, or {rank: name}. Returns
    {rank: (None or the OSError, seconds the write took)}; a write that did
    not return within timeout gives a TimeoutError.
    """
    ranks = list(range(world.n) if ranks is None else ranks)
    if isinstance(names, str):
        names = {r: names for r in ranks}
    results = {}
    barrier = threading.Barrier(len(ranks))

    def one(r):
        try:
            barrier.wait(10)
        except threading.BrokenBarrierError:
            pass
        t0 = time.monotonic()
        try:
            commit(os.path.join(world.mnt(r), names[r]), mode)
            results[r] = (None, time.monotonic() - t0)
        except OSError as e:
            results[r] = (e, time.monotonic() - t0)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for r in ranks:
        results.setdefault(r, (TimeoutError(f"rank {r}: commit did not return "
                                             f"in {timeout}s"), timeout))
    return results




def write_file(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        pos = 0
        while pos < len(data):
            pos += os.write(fd, view[pos:pos + (1 << 20)])
    finally:
        os.close(fd)


def set_xattrs(path, dtype, shape, offsets=None, sizes=None):
    """user.ckpt.*; shape may be bytes (given as is, e.g. b"" or b"[]")."""
    os.setxattr(path, "user.ckpt.dtype", dtype.encode())
    os.setxattr(path, "user.ckpt.shape",
                shape if isinstance(shape, bytes) else csv(shape).encode())
    if offsets is not None:
        os.setxattr(path, "user.ckpt.offsets", csv(offsets).encode())
    if sizes is not None:
        os.setxattr(path, "user.ckpt.sizes", csv(sizes).encode())


def query(db, sql, args=()):
    """Rows of sql on the SQLite file db, opened read-only."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return [tuple(row) for row in con.execute(sql, args)]
    finally:
        con.close()


# ---- tensor data ----------------------------------------------------------------

# dtype -> (struct code, itemsize, value generator). Values are exactly
# representable; bfloat16 is the upper half of a float32.
def _ints(lo, hi):
    return lambda rng: rng.randint(lo, hi)


DTYPES = {
    "bool": ("?", 1, lambda rng: rng.random() < 0.5),
    "uint8": ("B", 1, _ints(0, 255)),
    "int8": ("b", 1, _ints(-128, 127)),
    "int16": ("h", 2, _ints(-32768, 32767)),
    "int32": ("i", 4, _ints(-2**31, 2**31 - 1)),
    "int64": ("q", 8, _ints(-2**63, 2**63 - 1)),
    "float16": ("e", 2, lambda rng: rng.randint(-2048, 2048) / 4),
    "bfloat16": ("f", 2, lambda rng: rng.randint(-255, 255) * 2.0 ** rng.randint(-8, 8)),
    "float32": ("f", 4, lambda rng: rng.randint(-2**23, 2**23) / 64),
    "float64": ("d", 8, lambda rng: rng.random() * 1e6 - 5e5),
    "complex64": ("f", 8, lambda rng: rng.randint(-2**20, 2**20) / 8),
}


def itemsize(dtype):
    return DTYPES[dtype][1]


def tensor_bytes(dtype, shape, seed):
    """The whole tensor, row-major little-endian, from pseudo-random values
    (never periodic, so a chunk at the wrong place shows)."""
    code, size, gen = DTYPES[dtype]
    rng = random.Random(f"{dtype}/{csv(shape)}/{seed}")
    n = math.prod(shape)
    if dtype.startswith("complex"):
        vals = [gen(rng) for _ in range(2 * n)]
        return struct.pack(f"<{2 * n}{code}", *vals)
    vals = [gen(rng) for _ in range(n)]
    raw = struct.pack(f"<{n}{code}", *vals)
    if dtype == "bfloat16":
        raw = b"".join(raw[i + 2:i + 4] for i in range(0, len(raw), 4))
    return raw


def strides(shape, isz):
    """Byte strides of a row-major tensor."""
    return [math.prod(shape[i + 1:]) * isz for i in range(len(shape))]


def block(data, shape, isz, offsets, sizes):
    """The bytes of block (offsets, sizes) of row-major tensor bytes data."""
    if not shape:
        return data
    if math.prod(sizes) == 0:
        return b""
    st = strides(shape, isz)
    run = sizes[-1] * isz
    out = bytearray()
    for idx in itertools.product(*[range(o, o + s) for o, s in zip(offsets[:-1], sizes[:-1])]):
        start = sum(i * s for i, s in zip(idx, st)) + offsets[-1] * isz
        out += data[start:start + run]
    return bytes(out)


def split(n, parts):
    """[(offset, size)] of n split into parts as evenly as possible."""
    base, extra = divmod(n, parts)
    out, o = [], 0
    for p in range(parts):
        s = base + (1 if p < extra else 0)
        out.append((o, s))
        o += s
    return out


def cuts(sizes):
    """[(offset, size)] of consecutive sizes."""
    out, o = [], 0
    for s in sizes:
        out.append((o, s))
        o += s
    return out


class Tensor:
    """A global tensor and the chunk each rank holds.

    chunks: {rank: (offsets, sizes)} for shards, or {rank: None} for a whole
    replica (no offsets or sizes set). shape_attr, if given, is written as
    user.ckpt.shape verbatim (b"" or b"[]" for a 0-d tensor).
    """

    kind = "tensor"

    def __init__(self, path, dtype, shape, chunks, seed=0, shape_attr=None):
        self.path, self.dtype, self.shape = path, dtype, list(shape)
        self.chunks = chunks
        self.shape_attr = shape_attr
        self.data = tensor_bytes(dtype, self.shape, seed)
        self.isz = itemsize(dtype)

    @property
    def fqn(self):
        return self.path.replace("/", ".")

    def chunk_bytes(self, rank):
        c = self.chunks[rank]
        if c is None:
            return self.data
        return block(self.data, self.shape, self.isz, *c)

    def write(self, ckdir, rank):
        if rank not in self.chunks:
            return
        p = os.path.join(ckdir, self.path)
        write_file(p, self.chunk_bytes(rank))
        c = self.chunks[rank]
        shape = self.shape_attr if self.shape_attr is not None else self.shape
        if c is None:
            set_xattrs(p, self.dtype, shape)
        else:
            set_xattrs(p, self.dtype, shape, c[0], c[1])

    def saved_chunks(self):
        """The distinct (offsets, sizes) the checkpoint holds."""
        seen = []
        for r in sorted(self.chunks):
            c = self.chunks[r]
            c = ([0] * len(self.shape), list(self.shape)) if c is None else (list(c[0]), list(c[1]))
            if c not in seen:
                seen.append(c)
        return seen

    def boundaries(self):
        """Flat byte offsets where some chunk's data starts or ends in a row
        (the places a read crosses from one chunk into another)."""
        if not self.shape or math.prod(self.shape) == 0:
            return [0]
        st = strides(self.shape, self.isz)
        out = set()
        for offs, sizes in self.saved_chunks():
            if math.prod(sizes) == 0:
                continue
            # first and last row of the chunk in the innermost dimension
            for corner in itertools.product(*[(o, o + s - 1) for o, s in zip(offs[:-1], sizes[:-1])]):
                base = sum(i * s for i, s in zip(corner, st))
                out.add(base + offs[-1] * self.isz)
                out.add(base + (offs[-1] + sizes[-1]) * self.isz)
        return sorted(out)


class Blob:
    """A bytes item: {rank: bytes} of the ranks that hold it."""

    kind = "bytes"

    def __init__(self, path, copies):
        self.path = path
        self.copies = copies
        self.data = next(iter(copies.values()))

    @property
    def fqn(self):
        return self.path.replace("/", ".")

    def write(self, ckdir, rank):
        if rank in self.copies:
            write_file(os.path.join(ckdir, self.path), self.copies[rank])


def stage(world, name, items, ranks=None):
    """mkdir NAME on every rank and write its part of every item."""
    for r in (range(world.n) if ranks is None else ranks):
        ck = os.path.join(world.mnt(r), name)
        os.mkdir(ck)
        for it in items:
            it.write(ck, r)


def errname(e):
    if isinstance(e, OSError) and e.errno is not None:
        return errno.errorcode.get(e.errno, str(e.errno))
    return repr(e)

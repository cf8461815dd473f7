#!/usr/bin/env python3
"""ckptfs end-to-end benchmark: save and load one state dict through rank
mounts, next to the limit of the same machine and to PyTorch DCP.

    python3 bench/bench.py --bin build/bin/ckptfs --backing /var/tmp/ckbench,/dev/shm/ckbench \\
        --size 1G,4G [--ranks 4,1] [--staging-mem 1G] [--opts io_threads=4] [--repeat 3] \\
        [--dcp-threads 1,2,4] [--no-dcp] [--no-dcp-backend] [--no-venv] [--json out.json]
    python3 bench/bench.py --table-from out.json
    python3 bench/bench.py --floor --backing DIR[,DIR] [--size 1G,4G] [--quick] ...
        (issue 26's table: three state dicts against their limits, interleaved
        rounds; see bench/floor_table.py)
    python3 bench/bench.py --tiers [--per-rank 32M] [--slots 2,2,2] ...
        (issue 27's rows: levels none, local, partner, shared across simulated
        nodes over a slow store; see bench/tiers.py)
    python3 bench/bench.py --writers [--dir DIR] [--rounds 5] ...
        (issue 38's rows: safetensors, save_pretrained, h5py, torch.save,
        np.save, tensorstore into a mount against a plain directory + syncfs;
        see bench/writers.py)

Run as root (it drops the page cache). It re-runs itself under the project
venv's python (.venv/bin/python of this tree, else /work/main/.venv/bin/python:
torch 2.x) unless --no-venv; DCP needs `import torch` to work in the
interpreter that runs it (torch 1.13 still works: Debian's /usr/bin/python3).
Several --backing directories and --size values: every combination is one
configuration, run at every --ranks world size; each configuration prints
its detailed table, and the end one Markdown table of issue 15's figures
(figure, fs, size, ranks, ckptfs, limit, ratio, goal, met?), every limit
measured in the same run (--json: all of it, the table's rows under
"summary").

The state dict (deterministic for a --seed): tensors of log-uniform sizes
from 4 KiB to min(256 MiB, SIZE/8), float32 (60%), bfloat16 (30%), int64
(10%), 2-d [rows, cols] with rows >= 64, plus a few bytes items, summing to
exactly SIZE stored bytes. At N ranks a tensor is either row-sharded
(rank r holds rows [r*rows/N, (r+1)*rows/N)) or replicated (every rank
holds all of it: tensors of <= 64 KiB, and every 16th tensor of up to
32 MiB); bytes items are replicated (config, train state, param groups)
or owned by one rank (rng/rankI, held by rank I mod N). The content is
slices of one random pool shared by all processes (fork), so replicas are
identical and the loads can be checked byte for byte.

For each world size (one process per rank, multiprocessing, fork):
 1. limit: every rank's stored bytes (its shards, its own bytes items and
    its share of the replicated items, balanced by bytes) written straight
    into BACKING/limit/rankR.bin with 8 MiB writes, fsync, fsync of the dir.
 1b. one-copy floor: the same writes without any fsync (the limit of the
    async stall: the trainers' bytes copied once into the backing fs).
 2. sync save: each trainer mkdirs NAME in its rank mount, writes every
    local item (replicas too) with 1 MiB writes, sets user.ckpt.dtype,
    shape, offsets, sizes, waits for the other trainers (a barrier), then
    writes "sync\\n" to NAME/.commit. Time: first mkdir -> the last commit
    write returned.
 3. async save: the same with "async\\n". Stall: first mkdir -> the last
    commit write returned; committed: first mkdir -> .status reads
    "committed" on every rank (polled every 5 ms by each trainer).
 4. load: each rank preads (16 MiB reads) the byte range of its own shard
    of every sharded tensor, and the whole of every replicated tensor and
    bytes item it holds, from the committed files of its own mount, into
    one preallocated buffer; cold (sync; drop_caches) and warm; checked
    byte for byte afterwards (untimed). Reference: each rank reads its
    data files BACKING/NAME/__R_K.distcp directly, 16 MiB reads, cold and
    warm.
 4b. column shards: for the sharded 2-d tensors of >= 1 MiB whose rows and
    columns divide by m = max(N, 2), rank r reads pieces r, r+N, ... of m:
    the column block [:, p*cols/m, (p+1)*cols/m) through the committed
    block file NAME/dir/.T[:,a:b] (docs/committed.md), and, as its limit,
    the row range [p*rows/m, (p+1)*rows/m) of NAME/dir/T (same bytes);
    cold and warm, 16 MiB preads; blocks checked.
 5. DCP (when torch imports): torch.distributed.checkpoint.save/load, or
    on torch 1.13 torch.distributed._shard.checkpoint.save_state_dict /
    load_state_dict, with FileSystemWriter(single_file_per_rank=True,
    sync_files=True) into BACKING/dcp; 1 rank: no_dist=True and plain
    tensors; N ranks: a gloo process group of N processes, sharded tensors
    as ShardedTensor (init_from_local_shards, the same row shards),
    replicated tensors as plain tensors. torch 1.13 only saves non-sharded
    items from the coordinator, so at N ranks every rank holds every bytes
    item (rank 0 writes them all; they are a few KiB). Load into
    preallocated tensors of the same layout, cold and warm, checked.
 5b. (torch 2.x) DCP through ckptfs's backend, ckptfs.dcp.Writer/Reader on
    the rank mounts (the same state dict; as bench/dcp_bench.py), save and
    load cold and warm. Stock DCP saves once per --dcp-threads value
    (FileSystemWriter thread_count; the first is the default, 1); the
    table compares the best and the default. At N ranks torch 2.x shards
    are DTensor Shard(0) (rows split torch.chunk-wise).
 6. peak RSS: VmHWM of every ckptfs daemon, read just before unmounting
    (limit staging_mem + 64 MiB); daemon CPU: utime + stime of every
    daemon (/proc/PID/stat) before and after each save (async: until
    committed), summed over ranks, per GiB of state dict.

Ratios are throughput relative to the reference (reference_time / time),
except the async stall: stall_time / limit_time. Page caches are dropped
(sync; echo 3 > /proc/sys/vm/drop_caches) before the limit, each save and
each cold load. Checkpoints are removed through the mount between phases.
Other jobs on the machine skew the figures: before each cold phase the
bench waits up to --quiet-wait seconds for the CPUs to be < 15% busy, and
it reports the CPUs other processes used during each phase; --repeat N
runs every world size N times and reports medians (all runs in --json).
"""
import argparse
import ctypes
import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 1 << 20
GiB = 1 << 30
WCHUNK = 1 * MiB          # trainer write size through the mount
LIMIT_CHUNK = 8 * MiB     # write size of the limit writers
RCHUNK = 16 * MiB         # read size of the loaders
DTYPES = [("float32", 4, 0.6), ("bfloat16", 2, 0.3), ("int64", 8, 0.1)]
MIN_T = 4 << 10
MAX_T = 256 * MiB
WAIT = 3600               # seconds any phase may take before we give up


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    s = s.strip()
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def fmt_size(n):
    for unit, m in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= m:
            return f"{n / m:.2f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------
# The state dict.
# ---------------------------------------------------------------------------

class Item:
    """One state-dict entry: a 2-d tensor or a bytes item."""

    def __init__(self, path, dtype, itemsize, shape, nbytes, replicated, owner=None):
        self.path = path                 # relative path in the checkpoint
        self.fqn = path.replace("/", ".")
        self.dtype = dtype               # None for a bytes item
        self.itemsize = itemsize
        self.shape = shape               # [rows, cols] or None
        self.nbytes = nbytes
        self.replicated = replicated
        self.owner = owner               # bytes items held by one rank: index
        self.base = 0                    # offset of the content in the pool

    def rows_of(self, rank, n):
        """Row range [a, b) of rank's shard of a sharded tensor."""
        rows = self.shape[0]
        return rows * rank // n, rows * (rank + 1) // n

    def local(self, rank, n):
        """What rank holds at world size n: (offset, length, offsets, sizes)
        in bytes of the global tensor, or None."""
        if self.dtype is None:
            if self.replicated or self.owner % n == rank:
                return (0, self.nbytes, None, None)
            return None
        if self.replicated or n == 1:
            return (0, self.nbytes, [0, 0], list(self.shape))
        a, b = self.rows_of(rank, n)
        row = self.shape[1] * self.itemsize
        return (a * row, (b - a) * row, [a, 0], [b - a, self.shape[1]])


def make_state_dict(size, max_ranks, seed):
    rng = random.Random(seed)
    max_t = max(64 << 10, min(MAX_T, size // 8))
    items = []
    # bytes items: replicated metadata and per-rank RNG states
    blobs = [("meta/config.json", 2 << 10, True), ("meta/train_state.pkl", 16 << 10, True),
             ("optim/param_groups.pkl", 64 << 10, True)]
    blobs += [(f"rng/rank{i}", 8 << 10, False) for i in range(max_ranks)]
    budget = size - sum(b[1] for b in blobs)
    if budget < 64 * 8:
        sys.exit(f"--size {size} is too small")
    total = 0
    idx = 0
    wts = [d[2] for d in DTYPES]
    while True:
        target = int(round(2 ** rng.uniform(12, max_t.bit_length() - 1)))
        name, isz, _ = rng.choices(DTYPES, wts)[0]
        numel = target // isz
        cols = 1
        while cols * 2 <= 4096 and cols * 2 * 64 <= numel:
            cols *= 2
        rows = numel // cols
        nb = rows * cols * isz
        if total + nb > budget:
            break
        repl = nb <= (64 << 10) or (idx % 16 == 5 and nb <= 32 * MiB)
        items.append(Item(f"model/layer{idx // 8:03d}/p{idx % 8}", name, isz, [rows, cols], nb, repl))
        total += nb
        idx += 1
    rest = budget - total
    if rest >= 64:  # the remainder as one uint8 tensor [64, rest // 64]
        nb = rest // 64 * 64
        items.append(Item("model/tail", "uint8", 1, [64, rest // 64], nb, False))
        rest -= nb
    for i, (path, nb, repl) in enumerate(blobs):
        if i == 0:
            nb += rest  # the last few bytes go to the config blob
        it = Item(path, None, 1, None, nb, repl, owner=None if repl else int(path[8:]))
        items.append(it)
    pool_size = max_t + 32 * MiB
    for it in items:
        it.base = rng.randrange(0, (pool_size - it.nbytes) // 4096 + 1) * 4096
    assert sum(it.nbytes for it in items) == size
    return items, pool_size


def make_pool(n, seed):
    r = random.Random(seed ^ 0x5EED)
    buf = bytearray(n)
    mv = memoryview(buf)
    for off in range(0, n, 16 * MiB):
        k = min(16 * MiB, n - off)
        mv[off:off + k] = r.randbytes(k)
    return buf


def stored_assignment(items, n):
    """Bytes each rank stores: own shards and bytes items, replicas
    balanced by bytes (largest first to the least loaded rank)."""
    per = [[] for _ in range(n)]   # (item, offset, length)
    load = [0] * n
    for it in items:
        if it.replicated:
            continue
        for r in range(n):
            loc = it.local(r, n)
            if loc and loc[1]:
                per[r].append((it, loc[0], loc[1]))
                load[r] += loc[1]
    for it in sorted((i for i in items if i.replicated), key=lambda i: -i.nbytes):
        r = min(range(n), key=lambda k: load[k])
        per[r].append((it, 0, it.nbytes))
        load[r] += it.nbytes
    return per, load


# ---------------------------------------------------------------------------
# System helpers.
# ---------------------------------------------------------------------------

def mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def fs_type(path):
    path = os.path.realpath(path)
    best, typ = "", "?"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            mp_, fstype = parts[4], parts[parts.index("-") + 1]
            if (path == mp_ or path.startswith(mp_.rstrip("/") + "/")) and len(mp_) >= len(best):
                best, typ = mp_, fstype
    return typ


CAN_DROP = [True]


def drop_caches():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        CAN_DROP[0] = False


def cpu_busy(dt=0.5):
    """Fraction of all CPUs busy over dt seconds (/proc/stat)."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return sum(v), v[3] + v[4]
    t1, i1 = snap()
    time.sleep(dt)
    t2, i2 = snap()
    return 1 - (i2 - i1) / max(1, t2 - t1)


def others_cpu():
    """{(pid, start time): CPU seconds used so far} of the user processes
    that are not this bench or its descendants (trainers, mpirun,
    daemons): the other jobs on the machine."""
    procs = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields after comm: state ppid ... flags(7) ... utime(12) stime(13)
        procs[int(d)] = (int(st[1]), int(st[6]), int(st[11]) + int(st[12]), st[19])
    kids = {}
    for pid, (ppid, _, _, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    ours, todo = set(), [os.getpid()]
    while todo:
        p = todo.pop()
        ours.add(p)
        todo.extend(kids.get(p, []))
    hz = os.sysconf("SC_CLK_TCK")
    return {(pid, start): t / hz for pid, (ppid, flags, t, start) in procs.items()
            if pid not in ours and not flags & 0x00200000}   # PF_KTHREAD


class Others:
    """Average number of CPUs used by other jobs during each timed phase."""

    def __init__(self):
        self.cur, self.out = None, {}

    def start(self, phase):
        self.stop()
        self.cur = (phase, others_cpu(), time.perf_counter())

    def stop(self):
        if self.cur:
            phase, c0, t0 = self.cur
            # processes that exited meanwhile are not counted (an underestimate)
            used = sum(t - c0.get(k, 0) for k, t in others_cpu().items())
            self.out[phase] = round(used / max(1e-3, time.perf_counter() - t0), 2)
            self.cur = None


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def touch(buf):
    """Fault in every page of a buffer (untimed), so timed reads do not."""
    if len(buf):
        ctypes.memset((ctypes.c_char * len(buf)).from_buffer(buf), 0x5A, len(buf))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---------------------------------------------------------------------------
# Workers: one process per rank; the parent takes part in "pauses" (two
# barrier rounds) to drop caches while every worker waits.
# ---------------------------------------------------------------------------

class Ctx:
    def __init__(self, rank, n, pbar, wbar):
        self.rank, self.n, self.pbar, self.wbar = rank, n, pbar, wbar

    def pause(self):
        self.pbar.wait(WAIT)
        self.pbar.wait(WAIT)


class Aborted(Exception):
    pass


def _worker(fn, rank, n, q, pbar, wbar, kw):
    ctx = Ctx(rank, n, pbar, wbar)
    try:
        res = fn(ctx, **kw)
        q.put((rank, "ok", res))
    except threading.BrokenBarrierError:
        q.put((rank, "aborted", "stopped: another rank failed"))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        try:
            pbar.abort()
            wbar.abort()
        finally:
            q.put((rank, "err", f"{type(e).__name__}: {e}"))
    finally:
        q.close()
        q.join_thread()


def run_workers(n, fn, actions=(), **kw):
    """Runs fn(ctx, **kw) on n forked workers. actions: callables run by
    the parent at each ctx.pause() of the workers, in order. Returns
    ({rank: result}, [errors])."""
    c = mp.get_context("fork")
    q = c.Queue()
    pbar = c.Barrier(n + 1)
    wbar = c.Barrier(n)
    procs = [c.Process(target=_worker, args=(fn, r, n, q, pbar, wbar, kw)) for r in range(n)]
    for p in procs:
        p.start()
    errors = []
    try:
        for act in actions:
            pbar.wait(WAIT)
            act()
            pbar.wait(WAIT)
    except threading.BrokenBarrierError:
        pass
    results = {}
    deadline = time.time() + WAIT
    while len(results) + len(errors) < n and time.time() < deadline:
        try:
            rank, kind, val = q.get(timeout=1)
        except queue.Empty:
            if all(p.exitcode is not None for p in procs) and q.empty():
                break
            continue
        if kind == "ok":
            results[rank] = val
        elif kind == "err":
            errors.append(f"rank {rank}: {val}")
    for p in procs:
        p.join(30)
        if p.exitcode is None:
            p.kill()
            p.join()
    if len(results) < n and not errors:
        errors.append("workers exited without a result: " +
                      ", ".join(f"rank {r} exit {p.exitcode}" for r, p in enumerate(procs)))
    return results, errors


def span(results, start, end):
    return max(r[end] for r in results.values()) - min(r[start] for r in results.values())


# --- 1. the limit ----------------------------------------------------------

def w_limit(ctx, pool, per, outdir, sync=True):
    """sync=False: the one-copy floor (the same writes, no fsync)."""
    mv = memoryview(pool)
    path = os.path.join(outdir, f"rank{ctx.rank}.bin")
    ctx.pause()                                   # parent: sync + drop caches
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for it, off, ln in per[ctx.rank]:
        src = mv[it.base + off: it.base + off + ln]
        done = 0
        while done < ln:
            done += os.write(fd, src[done:done + LIMIT_CHUNK])
    if sync:
        os.fsync(fd)
    os.close(fd)
    if sync:
        fsync_dir(outdir)
    return {"t0": t0, "t1": time.perf_counter()}


# --- 2./3. saves through the mounts ----------------------------------------

def w_save(ctx, pool, items, mnts, name, mode):
    rank, n = ctx.rank, ctx.n
    mv = memoryview(pool)
    ck = os.path.join(mnts[rank], name)
    local = [(it, it.local(rank, n)) for it in items]
    local = [(it, loc) for it, loc in local if loc]
    ctx.pause()                                   # parent: sync + drop caches
    t0 = time.perf_counter()
    os.mkdir(ck)
    made = {""}
    where, staged = "mkdir", 0
    try:
        for it, (off, ln, offs, sizes) in local:
            d = os.path.dirname(it.path)
            if d not in made:
                os.makedirs(os.path.join(ck, d), exist_ok=True)
                made.add(d)
            p = os.path.join(ck, it.path)
            where = f"{it.path}"
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                src = mv[it.base + off: it.base + off + ln]
                done = 0
                while done < ln:
                    where = f"{it.path} at byte {done}"
                    done += os.write(fd, src[done:done + WCHUNK])
            finally:
                os.close(fd)   # may fail too (a flush error)
            if it.dtype:
                where = f"setxattr {it.path}"
                os.setxattr(p, "user.ckpt.dtype", it.dtype.encode())
                os.setxattr(p, "user.ckpt.shape", f"{it.shape[0]},{it.shape[1]}".encode())
                os.setxattr(p, "user.ckpt.offsets", f"{offs[0]},{offs[1]}".encode())
                os.setxattr(p, "user.ckpt.sizes", f"{sizes[0]},{sizes[1]}".encode())
            staged += ln
    except OSError as e:
        raise OSError(e.errno, f"write {where} (after {fmt_size(staged)} staged on this rank): "
                      f"{e.strerror}") from None
    t_w = time.perf_counter()
    ctx.wbar.wait(WAIT)                           # all trainers commit together
    fd = os.open(os.path.join(ck, ".commit"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    tc0 = time.perf_counter()
    try:
        os.write(fd, f"{mode}\n".encode())
    except OSError as e:
        with open(os.path.join(ck, ".status")) as f:
            raise OSError(e.errno, f"{mode} commit: {e.strerror}; .status: "
                          f"{f.read().strip()[:600]!r}") from None
    finally:
        os.close(fd)
    tc1 = time.perf_counter()
    res = {"t0": t0, "t_w": t_w, "tc0": tc0, "tc1": tc1,
           "bytes": sum(loc[1] for _, loc in local)}
    if mode == "async":
        st = os.path.join(ck, ".status")
        while True:
            with open(st) as f:
                text = f.read()
            first = text.split("\n", 1)[0].strip()
            if first == "committed":
                break
            if first == "failed":
                raise OSError(0, f"async save failed; .status: {text.strip()[:600]!r}")
            time.sleep(0.005)
        res["t_done"] = time.perf_counter()
    return res


# --- 4. loads --------------------------------------------------------------

def _read_all(reads, buf):
    """reads: (path, file_offset, length, buf_offset). 16 MiB preads."""
    mv = memoryview(buf)
    cur, fd = None, -1
    try:
        for path, foff, ln, boff in reads:
            if path != cur:
                if fd >= 0:
                    os.close(fd)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise OSError(e.errno, f"open {path}: {e.strerror}") from None
                cur = path
            done = 0
            while done < ln:
                try:
                    k = os.preadv(fd, [mv[boff + done: boff + min(ln, done + RCHUNK)]], foff + done)
                except OSError as e:
                    raise OSError(e.errno, f"preadv {path} at {foff + done} "
                                  f"({min(RCHUNK, ln - done)} bytes): {e.strerror}") from None
                if k <= 0:
                    raise OSError(0, f"short read of {path} at {foff + done}")
                done += k
    finally:
        if fd >= 0:
            os.close(fd)


def w_load(ctx, pool, items, mnts, name, backing, verify):
    rank, n = ctx.rank, ctx.n
    mreads, boff = [], 0
    for it in items:
        loc = it.local(rank, n)
        if loc and loc[1]:
            mreads.append((os.path.join(mnts[rank], name, it.path), loc[0], loc[1], boff, it))
            boff += loc[1]
    ck = os.path.join(backing, name)
    files = sorted(f for f in os.listdir(ck) if f.startswith(f"__{rank}_") and f.endswith(".distcp"))
    dreads, doff = [], 0
    for f in files:
        sz = os.path.getsize(os.path.join(ck, f))
        dreads.append((os.path.join(ck, f), 0, sz, doff))
        doff += sz
    buf = bytearray(max(boff, doff))
    touch(buf)
    out = {"mount_bytes": boff, "direct_bytes": doff, "direct_files": len(files)}
    _timed_reads(ctx, (("mount", [r[:4] for r in mreads]), ("direct", dreads)), buf, out,
                 lambda kind: kind == "mount" and verify and check(buf, pool, mreads))
    return out


def _timed_reads(ctx, kinds, buf, out, after):
    """For each (kind, reads), cold then warm: the parent's pause (sync and
    drop caches before cold), the timed reads into buf as out[KIND_TEMP] =
    (start, end), then after(kind) (untimed checks)."""
    for kind, reads in kinds:
        for temp in ("cold", "warm"):
            ctx.pause()                           # parent: sync + drop caches (cold)
            t0 = time.perf_counter()
            try:
                _read_all(reads, buf)
            except OSError as e:
                raise OSError(e.errno, f"{kind} {temp}: {e.strerror}") from None
            out[f"{kind}_{temp}"] = (t0, time.perf_counter())
            after(kind)


def check(buf, pool, mreads):
    mv, pv = memoryview(buf), memoryview(pool)
    for path, foff, ln, boff, it in mreads:
        if mv[boff:boff + ln] != pv[it.base + foff: it.base + foff + ln]:
            raise ValueError(f"content mismatch reading {path} [{foff}, {foff + ln})")


# --- 4b. column blocks vs row shards ----------------------------------------

def col_items(items, n):
    """The large 2-d tensors a column shard is read of: sharded (not
    replicated), >= 1 MiB, columns and rows divisible by max(n, 2)."""
    m = max(n, 2)
    return [it for it in items if it.dtype and not it.replicated and it.nbytes >= MiB
            and it.shape[1] % m == 0 and it.shape[0] % m == 0]


def w_cols(ctx, pool, items, mnts, name, verify):
    """Rank r reads pieces p = r, r + n, ... of m = max(n, 2) pieces of each
    large tensor: column block [:, p*cols/m, (p+1)*cols/m) through the block
    file .T[:,a:b] vs row shard [p*rows/m, (p+1)*rows/m) of the same size
    (one pread range of T); cold and warm, 16 MiB reads into one buffer."""
    rank, n = ctx.rank, ctx.n
    m = max(n, 2)
    ck = os.path.join(mnts[rank], name)
    col, row, boff, want = [], [], 0, []
    for it in col_items(items, n):
        rows, cols = it.shape
        rb = cols * it.itemsize
        d, b = os.path.split(it.path)
        for p in range(rank, m, n):
            a, z = cols * p // m, cols * (p + 1) // m
            ln = rows * (z - a) * it.itemsize
            col.append((os.path.join(ck, d, f".{b}[:,{a}:{z}]"), 0, ln, boff))
            r0 = rows * p // m
            row.append((os.path.join(ck, it.path), r0 * rb, ln, boff))
            want.append((it, a * it.itemsize, (z - a) * it.itemsize, rb, boff, rows))
            boff += ln
    buf = bytearray(boff)
    touch(buf)
    out = {"bytes": boff, "tensors": len(want)}
    def check_cols(kind):
        if kind != "col" or not verify:
            return
        mv, pv = memoryview(buf), memoryview(pool)
        for it, c0, cl, rb, bo, rows in want:
            for r in range(rows):
                s0 = it.base + r * rb + c0
                if mv[bo + r * cl: bo + (r + 1) * cl] != pv[s0:s0 + cl]:
                    raise ValueError(f"column block of {it.path} differs at row {r}")

    _timed_reads(ctx, (("col", col), ("row", row)), buf, out, check_cols)
    return out


# --- 5. DCP ----------------------------------------------------------------

def import_dcp():
    """Returns (torch, api) where api is 'new' (torch.distributed.checkpoint
    save/load) or 'old' (torch 1.13 _shard.checkpoint)."""
    import dataclasses
    import copy
    import torch
    try:
        import torch.distributed.checkpoint as dcp
        if hasattr(dcp, "save") and hasattr(dcp, "load"):
            return torch, dcp, "new"
    except Exception:  # noqa: BLE001
        pass
    # torch 1.13 on Python 3.11: sharded_tensor/metadata.py has a dataclass
    # field whose default is an (unhashable) dataclass instance, which 3.11
    # refuses ("mutable default"). Import it with field(default=X) turned
    # into field(default_factory=copy of X); nothing else changes.
    orig = dataclasses.field

    def field(*a, **kw):
        d = kw.get("default", dataclasses.MISSING)
        if d is not dataclasses.MISSING and dataclasses.is_dataclass(d) and type(d).__hash__ is None:
            kw.pop("default")
            kw["default_factory"] = lambda d=d: copy.deepcopy(d)
        return orig(*a, **kw)

    dataclasses.field = field
    try:
        import torch.distributed._shard.checkpoint as dcp
        import torch.distributed._shard.sharded_tensor  # noqa: F401
    finally:
        dataclasses.field = orig
    return torch, dcp, "old"


TORCH_DT = {"float32": "float32", "bfloat16": "bfloat16", "int64": "int64", "uint8": "uint8"}
SAME_SIZE_INT = {"float32": "int32", "bfloat16": "int16", "int64": "int64", "uint8": "uint8"}


def w_dcp(ctx, pool, items, path, port, threads=(1,), ckmount=None, async_phase=False):
    """Stock DCP into path, or (ckmount: the rank mounts' pattern, .../rank%r)
    DCP through ckptfs's backend ckptfs.dcp.Writer/Reader, checkpoint
    bench-dcp. async_phase (torch 2.x): then dcp.async_save of the same
    state dict (stall: until it returns; total: until its future is done),
    and with ckmount also the package's ckptfs.async_save of it."""
    rank, n = ctx.rank, ctx.n
    import warnings
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    torch, dcp, api = import_dcp()
    if ckmount:
        sys.path.insert(0, os.path.join(REPO, "python"))
        import ckptfs.dcp as ckdcp
    import torch.distributed as dist
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    if n > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=n)

    def sharded(local, it, a):
        if api == "old":
            from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
            sh = Shard.from_tensor_and_offsets(local, [a, 0], rank)
            return init_from_local_shards([sh], *it.shape)
        try:
            from torch.distributed.tensor import DeviceMesh, Shard as DShard, DTensor
        except ImportError:
            from torch.distributed._tensor import DeviceMesh, Shard as DShard, DTensor
        mesh = DeviceMesh("cpu", list(range(n)))
        return DTensor.from_local(local, mesh, [DShard(0)], run_check=False,
                                  shape=torch.Size(it.shape), stride=(it.shape[1], 1))

    def local_of(it):
        """(offset, length, offsets, sizes) of this rank's piece: DTensor's
        Shard(0) splits rows torch.chunk-wise (ceil), not rows*r//n."""
        loc = it.local(rank, n)
        if api == "old" or n == 1 or it.replicated:
            return loc
        rows, rb = it.shape[0], it.shape[1] * it.itemsize
        per = -(-rows // n)
        a, b = min(rows, rank * per), min(rows, (rank + 1) * per)
        return (a * rb, (b - a) * rb, [a, 0], [b - a, it.shape[1]])

    def build(fill):
        sd, src = {}, {}
        for it in items:
            if it.dtype is None:
                if n > 1 and api == "old":
                    held = True      # 1.13 writes non-sharded items from rank 0 only
                else:
                    held = it.local(rank, n) is not None
                if held:
                    sd[it.fqn] = bytes(pool[it.base: it.base + it.nbytes]) if fill else b""
                continue
            off, ln, offs, sizes = local_of(it)
            dt = getattr(torch, TORCH_DT[it.dtype])
            if fill:
                t = torch.frombuffer(pool, dtype=dt, count=ln // it.itemsize,
                                     offset=it.base + off).view(*sizes).clone()
            else:
                t = torch.empty(*sizes, dtype=dt)
                t.view(getattr(torch, SAME_SIZE_INT[it.dtype])).fill_(0)   # fault in pages
            src[it.fqn] = t
            sd[it.fqn] = sharded(t, it, offs[0]) if (n > 1 and not it.replicated) else t
        return sd, src

    def barrier():
        if n > 1:
            dist.barrier()

    def save(sd, t):
        if ckmount:
            dcp.save(sd, checkpoint_id="bench-dcp", storage_writer=ckdcp.Writer(ckmount),
                     no_dist=(n == 1))
            return
        kw = {"thread_count": t} if has_threads else {}    # torch 1.13 has none
        w = dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True, **kw)
        if api == "old":
            dcp.save_state_dict(sd, w, no_dist=(n == 1))
        else:
            dcp.save(sd, storage_writer=w, no_dist=(n == 1))

    def load(sd):
        if ckmount:
            dcp.load(sd, checkpoint_id="bench-dcp", storage_reader=ckdcp.Reader(ckmount),
                     no_dist=(n == 1))
            return
        if api == "old":
            dcp.load_state_dict(sd, dcp.FileSystemReader(path), no_dist=(n == 1))
        else:
            dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=(n == 1))

    sd, src = build(True)
    out = {"api": api, "torch": torch.__version__}
    import inspect
    has_threads = "thread_count" in inspect.signature(dcp.FileSystemWriter.__init__).parameters
    for t in threads:
        if t != threads[0] and not has_threads:
            ctx.pause()                           # the parent's drop caches for it: skip
            continue
        barrier()
        if rank == 0 and not ckmount:
            shutil.rmtree(path, ignore_errors=True)
        if ckmount:    # a committed checkpoint goes at the first mount, a staged one per rank
            p = os.path.join(ckdcp.rank_mount(ckmount, 0), "bench-dcp")
            if rank == 0 and os.path.lexists(p):
                subprocess.run(["rm", "-rf", p], check=True)
            barrier()
            p = os.path.join(ckdcp.rank_mount(ckmount, rank), "bench-dcp")
            if os.path.lexists(p):
                subprocess.run(["rm", "-rf", p], check=True)
        barrier()
        ctx.pause()                               # parent: sync + drop caches
        barrier()
        t0 = time.perf_counter()
        save(sd, t)
        out[f"save_t{t}"] = (t0, time.perf_counter())
        barrier()
    dst, dsrc = build(False)
    for kind in ("cold", "warm"):
        ctx.pause()                               # parent: drop caches (cold only)
        barrier()
        t0 = time.perf_counter()
        load(dst)
        out[f"load_{kind}"] = (t0, time.perf_counter())
        for fqn, t in src.items():
            iv = getattr(torch, SAME_SIZE_INT[next(i for i in items if i.fqn == fqn).dtype])
            if not torch.equal(t.view(iv), dsrc[fqn].view(iv)):
                raise ValueError(f"DCP load: {fqn} differs")
            dsrc[fqn].view(iv).fill_(0)
        for fqn, v in sd.items():
            if isinstance(v, bytes) and dst[fqn] != v:
                raise ValueError(f"DCP load: bytes item {fqn} differs")
    if async_phase:
        del dst, dsrc
        apath = path + "-async" if path else None
        if rank == 0 and apath:
            shutil.rmtree(apath, ignore_errors=True)
        ctx.pause()                               # parent: sync + drop caches
        barrier()
        t0 = time.perf_counter()
        if ckmount:
            fut = dcp.async_save(sd, checkpoint_id="bench-dcp-async",
                                 storage_writer=ckdcp.Writer(ckmount), no_dist=(n == 1))
        else:
            kw = {"thread_count": threads[0]} if has_threads else {}
            fut = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(
                apath, single_file_per_rank=True, sync_files=True, **kw), no_dist=(n == 1))
        t1 = time.perf_counter()
        fut.result()
        out["async"] = (t0, t1, time.perf_counter())
        barrier()
        if apath and rank == 0:
            shutil.rmtree(apath, ignore_errors=True)
        if ckmount:
            import ckptfs

            def drop(ck):
                """rm -r a committed checkpoint (through the first mount)
                once measured: at 4 GiB on tmpfs, the DCP checkpoints, the
                package's two and the buffers do not all fit in RAM."""
                barrier()
                p = os.path.join(ckdcp.rank_mount(ckmount, 0), ck)
                if rank == 0 and os.path.lexists(p):
                    subprocess.run(["rm", "-rf", p], check=True)
                barrier()
            drop("bench-dcp")
            drop("bench-dcp-async")
            pkg = {}                               # FQN a/b/c -> nested dicts
            for fqn, v in sd.items():
                d, parts = pkg, fqn.split("/")
                for part in parts[:-1]:
                    d = d.setdefault(part, {})
                d[parts[-1]] = v
            bufs = ckptfs.StagingBuffers()        # empty: the first save copies into fresh memory

            def timed_pkg_save(ck):
                ctx.pause()                       # parent: sync + drop caches
                barrier()
                t0 = time.perf_counter()
                fut = ckptfs.async_save(pkg, ckdcp.rank_mount(ckmount, rank), ck,
                                        rank=rank, buffers=bufs)
                t1 = time.perf_counter()
                fut.result()
                barrier()
                return (t0, t1, time.perf_counter())
            out["pkg_async"] = timed_pkg_save("bench-pkg")
            drop("bench-pkg")
            # the next save of a training run: into the buffers the last one left
            out["pkg_kept"] = timed_pkg_save("bench-pkg-kept")
            bufs.clear()
            drop("bench-pkg-kept")
    barrier()
    if n > 1:
        dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------
# A ckptfs world.
# ---------------------------------------------------------------------------

class World:
    def __init__(self, binpath, n, backing, opts):
        self.n, self.backing = n, backing
        self.root = tempfile.mkdtemp(prefix="ckptfs-bench-mnt-")
        self.mnts = [os.path.join(self.root, f"rank{r}") for r in range(n)]
        for m in self.mnts:
            os.makedirs(m)
        o = ["-o", opts] if opts else []
        if n == 1:  # a world of one: no launcher, no MPI
            cmd = [binpath, "-f"] + o + [backing, self.mnts[0]]
        else:
            cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n),
                   "--mca", "btl", "self,vader", binpath, "-f"] + o + \
                  [backing, os.path.join(self.root, "rank%r")]
        self.logpath = os.path.join(self.root, ".log")
        self.log = open(self.logpath, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + 60
        while not all(mounted(m) for m in self.mnts):
            if self.proc.poll() is not None or time.time() > deadline:
                log = self.tail()
                self.stop()
                sys.exit("ckptfs did not mount: " + log)
            time.sleep(0.05)
        self.exe = os.path.realpath(binpath)

    def tail(self):
        self.log.flush()
        with open(self.logpath) as f:
            return f.read()[-3000:]

    def daemons(self):
        pids = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                if os.path.realpath(f"/proc/{d}/exe") != self.exe:
                    continue
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
                if any(a.decode(errors="replace").startswith(self.root) for a in args):
                    pids.append(int(d))
            except OSError:
                pass
        return pids

    def cpu_seconds(self):
        """utime + stime of every daemon, summed (all threads)."""
        hz, t = os.sysconf("SC_CLK_TCK"), 0
        for pid in self.daemons():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    st = f.read().rsplit(")", 1)[1].split()
                t += int(st[11]) + int(st[12])
            except OSError:
                pass
        return t / hz

    def peak_rss(self):
        out = []
        for pid in self.daemons():
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            out.append(int(line.split()[1]) * 1024)
            except OSError:
                pass
        return out

    def remove(self, name):
        """rm -r NAME through every rank's mount (a staged checkpoint is
        per rank; a committed one goes from BACKING_DIR at the first)."""
        errs = []
        for m in self.mnts:
            p = os.path.join(m, name)
            if os.path.lexists(p):
                r = subprocess.run(["rm", "-rf", p], capture_output=True, text=True)
                if r.returncode:
                    errs.append(r.stderr.strip())
        if os.path.exists(os.path.join(self.backing, name)):
            errs.append(f"{name} still in the backing directory after rm -r")
        return errs

    def stop(self):
        for m in self.mnts:
            if mounted(m):
                subprocess.run(["fusermount3", "-u", m], capture_output=True)
        try:
            rc = self.proc.wait(300)
        except subprocess.TimeoutExpired:
            for m in self.mnts:
                subprocess.run(["fusermount3", "-uz", m], capture_output=True)
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)
        return rc


# ---------------------------------------------------------------------------
# One world size.
# ---------------------------------------------------------------------------

def bench_world(args, n, items, pool, dcp_ok):
    R = {"ranks": n, "failures": []}
    fail = R["failures"].append
    per, load = stored_assignment(items, n)
    R["stored_bytes_per_rank"] = load
    R["trainer_bytes_per_rank"] = [sum(it.local(r, n)[1] for it in items if it.local(r, n))
                                   for r in range(n)]

    R["busy"] = {}
    others = Others()
    R["others_cpus"] = others.out

    def pre(phase, cold=True):
        """Run by the parent while every worker waits: drop caches (cold),
        then wait (up to --quiet-wait s) until the machine is quiet, since
        other processes' CPU use skews the figures; record how busy it was."""
        def act():
            if cold:
                drop_caches()
            # warm phases start at once: this VM reclaims idle page cache
            deadline = time.time() + (args.quiet_wait if cold else 0)
            busy = cpu_busy()
            while busy > 0.15 and time.time() < deadline:
                busy = cpu_busy()
            if cold:
                R["busy"][phase] = round(busy, 3)
            others.start(phase)
        return act

    # 1. limit
    limit_dir = os.path.join(args.backing, "limit")
    shutil.rmtree(limit_dir, ignore_errors=True)
    os.makedirs(limit_dir)
    res, errs = run_workers(n, w_limit, actions=[pre("limit")], pool=pool, per=per, outdir=limit_dir)
    others.stop()
    shutil.rmtree(limit_dir, ignore_errors=True)
    if errs:
        sys.exit(f"limit writers failed at {n} ranks: {errs}")
    R["limit"] = span(res, "t0", "t1")
    log(f"  limit: {R['limit']:.3f} s")

    # 1b. the one-copy floor: the same writes, no fsync
    os.makedirs(limit_dir)
    res, errs = run_workers(n, w_limit, actions=[pre("floor")], pool=pool, per=per,
                            outdir=limit_dir, sync=False)
    others.stop()
    shutil.rmtree(limit_dir, ignore_errors=True)
    if errs:
        sys.exit(f"floor writers failed at {n} ranks: {errs}")
    R["floor"] = span(res, "t0", "t1")
    log(f"  one-copy floor (no fsync): {R['floor']:.3f} s")

    backing = os.path.join(args.backing, "ckptfs")
    shutil.rmtree(backing, ignore_errors=True)
    os.makedirs(backing)
    opts = ",".join(o for o in [f"staging_mem={args.staging_mem}"] + args.opts if o)
    world = World(args.bin, n, backing, opts)
    cpu0 = {}

    def cpu_pre(phase):
        """pre(phase), then a snapshot of the daemons' CPU seconds."""
        inner = pre(phase)

        def act():
            inner()
            cpu0[phase] = world.cpu_seconds()
        return act

    def cpu_post(phase):
        if phase in cpu0:
            R[f"{phase}_daemon_cpu"] = world.cpu_seconds() - cpu0[phase]
    try:
        # 2. sync save
        res, errs = run_workers(n, w_save, actions=[cpu_pre("sync_save")], pool=pool, items=items,
                                mnts=world.mnts, name="bench-sync", mode="sync")
        others.stop()
        cpu_post("sync_save")
        if errs:
            fail(f"sync save ({n} ranks): " + "; ".join(errs))
            log("  sync save FAILED: " + "; ".join(errs))
        else:
            R["sync_save"] = span(res, "t0", "tc1")
            R["sync_staging_writes"] = span(res, "t0", "t_w")
            R["sync_commit"] = max(r["tc1"] for r in res.values()) - max(r["tc0"] for r in res.values())
            R["sync_bytes_through_mounts"] = sum(r["bytes"] for r in res.values())
            log(f"  sync save: {R['sync_save']:.3f} s (staging writes {R['sync_staging_writes']:.3f} s)")
        for e in world.remove("bench-sync"):
            fail(f"rm -r bench-sync ({n} ranks): {e}")

        # 3. async save
        res, errs = run_workers(n, w_save, actions=[cpu_pre("async_save")], pool=pool, items=items,
                                mnts=world.mnts, name="bench-async", mode="async")
        others.stop()
        cpu_post("async_save")
        committed = not errs
        if errs:
            fail(f"async save ({n} ranks): " + "; ".join(errs))
            log("  async save FAILED: " + "; ".join(errs))
        else:
            R["async_stall"] = span(res, "t0", "tc1")
            R["async_committed"] = span(res, "t0", "t_done")
            R["async_background"] = R["async_committed"] - R["async_stall"]
            log(f"  async save: stall {R['async_stall']:.3f} s, committed {R['async_committed']:.3f} s")

        # 4. loads
        if committed:
            acts = [pre("load_mount_cold"), pre("load_mount_warm", False),
                    pre("load_direct_cold"), pre("load_direct_warm", False)]
            res, errs = run_workers(n, w_load, actions=acts,
                                    pool=pool, items=items, mnts=world.mnts, name="bench-async",
                                    backing=backing, verify=not args.no_verify)
            others.stop()
            if errs:
                fail(f"load ({n} ranks): " + "; ".join(errs))
                log("  load FAILED: " + "; ".join(errs))
            else:
                for k in ("mount_cold", "mount_warm", "direct_cold", "direct_warm"):
                    R[f"load_{k}"] = (max(r[k][1] for r in res.values()) -
                                      min(r[k][0] for r in res.values()))
                R["load_mount_bytes"] = sum(r["mount_bytes"] for r in res.values())
                R["load_direct_bytes"] = sum(r["direct_bytes"] for r in res.values())
                R["data_files"] = sum(r["direct_files"] for r in res.values())
                log("  load: " + ", ".join(f"{k} {R['load_' + k]:.3f} s" for k in
                                           ("mount_cold", "mount_warm", "direct_cold", "direct_warm")))
            # 4b. column blocks vs row shards of the same size
            acts = [pre("cols_col_cold"), pre("cols_col_warm", False),
                    pre("cols_row_cold"), pre("cols_row_warm", False)]
            res, errs = run_workers(n, w_cols, actions=acts, pool=pool, items=items,
                                    mnts=world.mnts, name="bench-async", verify=not args.no_verify)
            others.stop()
            if errs:
                fail(f"load column blocks ({n} ranks): " + "; ".join(errs))
                log("  column blocks FAILED: " + "; ".join(errs))
            elif res[0]["tensors"]:
                for k in ("col_cold", "col_warm", "row_cold", "row_warm"):
                    R[f"cols_{k}"] = (max(r[k][1] for r in res.values()) -
                                      min(r[k][0] for r in res.values()))
                R["cols_bytes"] = sum(r["bytes"] for r in res.values())
                R["cols_tensors"] = res[0]["tensors"]
                log("  column blocks vs row shards: " + ", ".join(
                    f"{k} {R['cols_' + k]:.3f} s" for k in ("col_cold", "row_cold", "col_warm", "row_warm")))
        else:
            fail(f"load ({n} ranks): skipped, no committed checkpoint")
        for e in world.remove("bench-async"):
            fail(f"rm -r bench-async ({n} ranks): {e}")

        # 6. peak RSS, just before unmounting
        rss = world.peak_rss()
        if len(rss) != n:
            fail(f"peak RSS ({n} ranks): found {len(rss)} ckptfs processes, expected {n}")
        if rss:
            R["rss_max"], R["rss_sum"], R["rss"] = max(rss), sum(rss), rss

        # 5b. DCP through ckptfs's backend (after the RSS reading: torch's
        # pickled items are not part of the figures above)
        if dcp_ok and args.dcp_backend:
            acts = [pre("ckdcp_save"), pre("ckdcp_load_cold"), pre("ckdcp_load_warm", False),
                    pre("ckdcp_async"), pre("pkg_async"), pre("pkg_kept")]
            res, errs = run_workers(n, w_dcp, actions=acts, pool=pool, items=items, path=None,
                                    port=free_port(), threads=(1,),
                                    ckmount=os.path.join(world.root, "rank%r"), async_phase=True)
            others.stop()
            if errs:
                fail(f"DCP via ckptfs.dcp ({n} ranks): " + "; ".join(errs))
                log("  DCP via ckptfs.dcp FAILED: " + "; ".join(errs))
            else:
                R["ckdcp_save"] = span({r: {"a": v["save_t1"][0], "b": v["save_t1"][1]}
                                        for r, v in res.items()}, "a", "b")
                for k in ("load_cold", "load_warm"):
                    R[f"ckdcp_{k}"] = max(r[k][1] for r in res.values()) - min(r[k][0] for r in res.values())
                for k, key in (("async", "ckdcp_async"), ("pkg_async", "pkg_async"),
                               ("pkg_kept", "pkg_kept")):
                    R[f"{key}_stall"] = max(r[k][1] for r in res.values()) - min(r[k][0] for r in res.values())
                    R[f"{key}_total"] = max(r[k][2] for r in res.values()) - min(r[k][0] for r in res.values())
                log(f"  DCP via ckptfs.dcp: save {R['ckdcp_save']:.3f} s, load cold "
                    f"{R['ckdcp_load_cold']:.3f} s, warm {R['ckdcp_load_warm']:.3f} s; async_save "
                    f"stall {R['ckdcp_async_stall']:.3f} s (done {R['ckdcp_async_total']:.3f} s); "
                    f"ckptfs.async_save stall {R['pkg_async_stall']:.3f} s "
                    f"(done {R['pkg_async_total']:.3f} s), with kept StagingBuffers "
                    f"{R['pkg_kept_stall']:.3f} s (done {R['pkg_kept_total']:.3f} s)")
            for ck in ("bench-dcp", "bench-dcp-async", "bench-pkg", "bench-pkg-kept"):
                for e in world.remove(ck):
                    fail(f"rm -r {ck} ({n} ranks): {e}")
    finally:
        daemon_log = world.tail()
        rc = world.stop()
        if rc:
            fail(f"ckptfs world of {n} exited with {rc}: {daemon_log[-800:]}")
        elif R["failures"] and daemon_log.strip():
            R["daemon_log"] = daemon_log
            fail(f"ckptfs log ({n} ranks), last lines: " + " | ".join(daemon_log.strip().splitlines()[-6:]))
    shutil.rmtree(backing, ignore_errors=True)

    # 5. DCP
    if dcp_ok:
        path = os.path.join(args.backing, "dcp")
        shutil.rmtree(path, ignore_errors=True)
        threads = args.dcp_threads
        acts = [pre(f"dcp_save_t{t}") for t in threads] + [pre("dcp_load_cold"), pre("dcp_load_warm", False)]
        if args.torch2:
            acts.append(pre("dcp_async"))
        res, errs = run_workers(n, w_dcp, actions=acts, pool=pool,
                                items=items, path=path, port=free_port(), threads=threads,
                                async_phase=args.torch2)
        others.stop()
        if not errs:
            R["dcp_bytes_on_disk"] = sum(os.path.getsize(os.path.join(path, f))
                                         for f in os.listdir(path))
        shutil.rmtree(path, ignore_errors=True)
        if errs:
            fail(f"DCP ({n} ranks): " + "; ".join(errs))
            log("  DCP FAILED: " + "; ".join(errs))
        else:
            r0 = res[0]
            R["dcp_api"] = f"torch {r0['torch']} " + (
                "torch.distributed._shard.checkpoint" if r0["api"] == "old"
                else "torch.distributed.checkpoint")
            threads = [t for t in threads if f"save_t{t}" in res[0]]
            for k in [f"save_t{t}" for t in threads] + ["load_cold", "load_warm"]:
                R[f"dcp_{k}"] = max(r[k][1] for r in res.values()) - min(r[k][0] for r in res.values())
            R["dcp_save_default"] = R[f"dcp_save_t{threads[0]}"]
            best = min(threads, key=lambda t: R[f"dcp_save_t{t}"])
            R["dcp_save"], R["dcp_best_threads"] = R[f"dcp_save_t{best}"], best
            if "async" in r0:
                R["dcp_async_stall"] = max(r["async"][1] for r in res.values()) - \
                    min(r["async"][0] for r in res.values())
                R["dcp_async_total"] = max(r["async"][2] for r in res.values()) - \
                    min(r["async"][0] for r in res.values())
            log(f"  DCP: save " + ", ".join(f"{R[f'dcp_save_t{t}']:.3f} s (thread_count={t})"
                                            for t in threads) + f", load cold {R['dcp_load_cold']:.3f} s, "
                f"warm {R['dcp_load_warm']:.3f} s" + (
                    f"; async_save stall {R['dcp_async_stall']:.3f} s (done "
                    f"{R['dcp_async_total']:.3f} s)" if "dcp_async_stall" in R else ""))
    return R


def combine(runs):
    """Several runs of one world size: the median of each time, the
    largest RSS, every failure; the per-run values kept under "runs"."""
    if len(runs) == 1:
        return runs[0]
    W = {"ranks": runs[0]["ranks"], "failures": [], "runs": runs}
    for i, r in enumerate(runs):
        W["failures"] += [f"{f} [run {i + 1}]" for f in r["failures"]]
    keys = {k for r in runs for k, v in r.items() if isinstance(v, (int, float)) and k != "ranks"}
    for k in keys:
        vals = [r[k] for r in runs if k in r]
        W[k] = max(vals) if k.startswith("rss") else statistics.median(vals)
        if not k.startswith("rss") and isinstance(vals[0], float):
            W.setdefault("spread", {})[k] = (min(vals), max(vals))
    for k in ("busy", "others_cpus"):
        W[k] = {}
        for r in runs:
            for ph, v in r.get(k, {}).items():
                W[k][ph] = max(W[k].get(ph, 0), v)
    for k in ("dcp_api", "stored_bytes_per_rank", "trainer_bytes_per_rank"):
        if k in runs[0]:
            W[k] = runs[0][k]
    return W


# ---------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------

def log(msg):
    print(msg, file=sys.stderr, flush=True)


PHASE = (("sync_", "sync save"), ("async_", "async save"), ("load_", "load"), ("dcp_", "DCP"))


def table(args, worlds, on_tmpfs):
    gib = args.total / GiB
    staging = parse_size(args.staging_mem)
    sync_target = 0.8 if on_tmpfs else 0.9
    # (label, key, reference key, kind, (target text, test of the ratio) or None)
    rows = [
        ("limit: write + fsync into DIR", "limit", "limit", "thr", None),
        ("one-copy floor: write, no fsync", "floor", "limit", "thr", None),
        ("sync save (writes + sync commit)", "sync_save", "limit", "thr",
         (f">= {sync_target}x limit ({'tmpfs' if on_tmpfs else 'disk'})", lambda r: r >= sync_target)),
        ("  staging writes (before commit)", "sync_staging_writes", "limit", "thr", None),
        ("  last commit write -> all done", "sync_commit", "limit", "thr", None),
        ("async save: trainer stall", "async_stall", "limit", "stall",
         ("stall <= 0.25x limit time", lambda r: r <= 0.25)),
        ("  stall vs one-copy floor", "async_stall", "floor", "stall",
         ("stall <= 1.25x floor time", lambda r: r <= 1.25)),
        ("async save: until committed", "async_committed", "limit", "thr", None),
        ("  stall end -> all committed", "async_background", "limit", "thr", None),
        ("load via mounts, cold", "load_mount_cold", "load_direct_cold", "thr",
         (">= 0.8x direct cold", lambda r: r >= 0.8)),
        ("load via mounts, warm", "load_mount_warm", "load_direct_warm", "thr",
         (">= 0.8x direct warm", lambda r: r >= 0.8)),
        ("direct read of data files, cold", "load_direct_cold", "load_direct_cold", "thr", None),
        ("direct read of data files, warm", "load_direct_warm", "load_direct_warm", "thr", None),
        ("DCP save (sync_files=True)", "dcp_save", "limit", "thr", None),
        ("DCP load, cold", "dcp_load_cold", "load_direct_cold", "thr", None),
        ("DCP load, warm", "dcp_load_warm", "load_direct_warm", "thr", None),
        ("sync save vs DCP save", "sync_save", "dcp_save", "vs",
         ("> 1 (faster than DCP)", lambda r: r > 1)),
        ("async committed vs DCP save", "async_committed", "dcp_save", "vs", None),
        ("load cold vs DCP load cold", "load_mount_cold", "dcp_load_cold", "vs",
         ("> 1 (faster than DCP)", lambda r: r > 1)),
        ("load warm vs DCP load warm", "load_mount_warm", "dcp_load_warm", "vs",
         ("> 1 (faster than DCP)", lambda r: r > 1)),
    ]
    w = 33

    def missing(W, key):
        for prefix, phase in PHASE:
            if key.startswith(prefix) and any(f.startswith(phase) for f in W["failures"]):
                return "FAILED"
        return "-"

    def cell(t="", g="", r="", m=""):
        return f"{t:>7} {g:>6} {r:>6} {m:<4}"

    col = len(cell())
    head = f"{'':{w}}" + "".join(
        f" | {str(W['ranks']) + (' ranks' if W['ranks'] > 1 else ' rank'):^{col}}" for W in worlds) + " |"
    sub = f"{'figure':{w}}" + "".join(" | " + cell("s", "GiB/s", "ratio", "") for _ in worlds) + " | target"
    lines = [head, sub, "-" * (len(sub) + 30)]
    for label, key, ref, kind, target in rows:
        cells = []
        for W in worlds:
            t, rt = W.get(key), W.get(ref)
            if t is None or (kind == "vs" and rt is None):
                cells.append(cell(missing(W, key) if t is None else "", "", missing(W, ref) if kind == "vs" else ""))
                continue
            ratio = (t / rt if kind == "stall" else rt / t) if rt else None
            mark = ""
            if target and ratio is not None:
                mark = "ok" if target[1](ratio) else "MISS"
            cells.append(cell("" if kind == "vs" else f"{t:.3f}", "" if kind == "vs" else f"{gib / t:.2f}",
                              "-" if ratio is None else f"{ratio:.2f}", mark))
        lines.append(f"{label:{w}}" + "".join(" | " + c for c in cells) + f" | {target[0] if target else ''}")
    for label, key in (("daemon peak RSS, max (MiB)", "rss_max"), ("daemon peak RSS, sum (MiB)", "rss_sum")):
        cells = []
        for W in worlds:
            v = W.get(key)
            if v is None:
                cells.append(cell("-"))
                continue
            mark = ("ok" if v <= staging + 64 * MiB else "MISS") if key == "rss_max" else ""
            cells.append(cell(f"{v / MiB:.0f}", "", "", mark))
        tgt = f"<= staging_mem + 64 MiB = {(staging + 64 * MiB) / MiB:.0f} MiB" if key == "rss_max" else ""
        lines.append(f"{label:{w}}" + "".join(" | " + c for c in cells) + f" | {tgt}")
    return "\n".join(lines)


def summary_rows(args, configs):
    """Issue 15's figures, one row per figure x configuration x world size:
    dicts with figure, fs, size, ranks, ckptfs, limit, ratio, goal, met."""
    out = []
    for c in configs:
        fs = f"{c['fstype']} {c['backing']}"
        size = fmt_size(c["size"])
        gib = c["size"] / GiB
        tgt_sync = 0.8 if c["on_tmpfs"] else 0.9
        for W in c["worlds"]:
            def row(fig, val, lim, ratio, goal, test, unit="s", lim_label=""):
                met = "-" if ratio is None or test is None else ("yes" if test(ratio) else "NO")
                fv = lambda v: "-" if v is None else (f"{v:.3f} s" if unit == "s" else f"{v:.0f} {unit}"
                                                       if unit == "MiB" else f"{v:.2f} {unit}")
                out.append({"figure": fig, "fs": fs, "size": size, "ranks": W["ranks"],
                            "ckptfs": fv(val), "limit": (fv(lim) + (" " + lim_label if lim_label else ""))
                            if lim is not None else (lim_label or "-"),
                            "ratio": "-" if ratio is None else f"{ratio:.2f}x", "goal": goal, "met": met,
                            "value": val, "limit_value": lim, "ratio_value": ratio})

            def thr(key, ref):      # throughput ratio: ref time / ckptfs time
                t, r = W.get(key), W.get(ref)
                return t, r, (r / t if t and r else None)

            t, r = W.get("async_stall"), W.get("floor")
            row("async save stall (trainer blocked)", t, r, t / r if t and r else None,
                "<= 1.25x", lambda x: x <= 1.25, lim_label="one-copy floor (write, no fsync)")
            r2 = W.get("limit")
            row("async save stall vs write + fsync", t, r2, t / r2 if t and r2 else None,
                "-", None, lim_label="write + fsync")
            row("sync save throughput", *thr("sync_save", "limit"),
                ">= 0.9x disk, 0.8x tmpfs", lambda x: x >= tgt_sync, lim_label="write + fsync")
            row("load cold", *thr("load_mount_cold", "load_direct_cold"),
                ">= 1.0x", lambda x: x >= 1.0, lim_label="direct reads")
            row("load warm", *thr("load_mount_warm", "load_direct_warm"),
                ">= 0.9x", lambda x: x >= 0.9, lim_label="direct reads")
            for temp in ("cold", "warm"):   # halves at 1 rank, 1/N at N
                row(f"column shard via block files, {temp}", *thr(f"cols_col_{temp}", f"cols_row_{temp}"),
                    ">= 0.5x", lambda x: x >= 0.5, lim_label="row shard, same bytes")
            if "dcp_save" in W:
                bt = W.get("dcp_best_threads")
                row("sync save vs DCP save, best thread_count", *thr("sync_save", "dcp_save"),
                    ">= 1.5x", lambda x: x >= 1.5, lim_label=f"DCP thread_count={bt}")
                row("sync save vs DCP save, default thread_count", *thr("sync_save", "dcp_save_default"),
                    ">= 1.5x", lambda x: x >= 1.5, lim_label=f"DCP thread_count={args.dcp_threads[0]}")
                row("load cold vs DCP load cold", *thr("load_mount_cold", "dcp_load_cold"),
                    ">= 1.5x", lambda x: x >= 1.5, lim_label="DCP")
                row("load warm vs DCP load warm", *thr("load_mount_warm", "dcp_load_warm"),
                    ">= 1.5x", lambda x: x >= 1.5, lim_label="DCP")
            for key, what in (("pkg_async_stall", "ckptfs.async_save"),
                              ("pkg_kept_stall", "ckptfs.async_save, kept buffers"),
                              ("ckdcp_async_stall", "dcp.async_save via ckptfs.dcp")):
                t, r = W.get(key), W.get("dcp_async_stall")
                if t is not None and r is not None:
                    row(f"async stall: {what} vs stock dcp.async_save", t, r, t / r,
                        "<= 1.0x", lambda x: x <= 1.0, lim_label="stock dcp.async_save stall")
            v, lim = W.get("rss_max"), c["staging"] + 64 * MiB
            if "ckdcp_save" in W:
                row("DCP via ckptfs.dcp save vs stock DCP save, best", *thr("ckdcp_save", "dcp_save"),
                    ">= 1.5x", lambda x: x >= 1.5, lim_label=f"DCP thread_count={W.get('dcp_best_threads')}")
                for temp in ("cold", "warm"):
                    row(f"DCP via ckptfs.dcp load {temp} vs stock DCP", *thr(f"ckdcp_load_{temp}",
                                                                            f"dcp_load_{temp}"),
                        ">= 1.5x", lambda x: x >= 1.5, lim_label="DCP")
            row("daemon peak RSS (VmHWM, max of ranks)", v / MiB if v else None, lim / MiB,
                v / lim if v else None, "<= 1.0x", lambda x: x <= 1.0, unit="MiB",
                lim_label="staging_mem + 64 MiB")
            for ph in ("sync_save", "async_save"):
                v = W.get(f"{ph}_daemon_cpu")
                row(f"daemon CPU per GiB saved, {ph.replace('_', ' ')}", None if v is None else v / gib,
                    None, None, "-", None, unit="s/GiB", lim_label="(sum over ranks, utime+stime)")
    return out


def summary(args, configs):
    rows = summary_rows(args, configs)
    cols = ("figure", "fs", "size", "ranks", "ckptfs", "limit", "ratio", "goal", "met")
    lines = ["## ckptfs vs its limits (issue 15): " + ("all goals met" if all(
        r["met"] != "NO" for r in rows) else f"{sum(r['met'] == 'NO' for r in rows)} goal(s) missed"),
        "",
        "| " + " | ".join(("met?" if c == "met" else c) for c in cols) + " |",
        "|" + "|".join("---" if c in ("figure", "fs", "limit", "goal") else "--:" for c in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    lines += ["",
              "ratio: throughput ckptfs / limit (limit time / ckptfs time), except the stall (stall "
              "time / limit time) and RSS (peak / limit). Limits are measured in the same run, on "
              "the same filesystem: one-copy floor = every rank's stored bytes written into the "
              "backing filesystem with 8 MiB writes, no fsync; write + fsync = the same with fsync; "
              "direct reads = the committed data files read with 16 MiB preads; row shard = the "
              "same number of bytes of the same tensors read as a row range of the committed file; "
              "DCP = torch.distributed.checkpoint save (FileSystemWriter sync_files=True) / load "
              "into the same filesystem. CPU s/GiB: the daemons' CPU time during the save (until "
              "committed) per GiB of state dict."]
    for c in configs:
        for W in c["worlds"]:
            o = W.get("others_cpus", {})
            if o and max(o.values()) > 0.1:
                ph = max(o, key=o.get)
                lines.append(f"WARNING: {c['fstype']} {fmt_size(c['size'])} {W['ranks']} rank(s): other "
                             f"processes used up to {o[ph]:.2f} CPUs during a timed phase ({ph}): "
                             "figures skewed")
    fails = [f for c in configs for W in c["worlds"] for f in W["failures"]]
    lines += [f"FAILED: {f}" for f in fails]
    return "\n".join(lines)


def pivot(rows):
    """The summary rows as one compact Markdown table: a row per figure, a
    column per configuration (fs, size, ranks), each cell the ratio and a
    mark for a missed goal; README shows this table."""
    cfgs, figs = [], []
    for r in rows:
        k = (r["fs"].split()[0], r["size"], r["ranks"])
        if k not in cfgs:
            cfgs.append(k)
        if (r["figure"], r["goal"]) not in figs:
            figs.append((r["figure"], r["goal"]))
    cell = {(r["figure"], (r["fs"].split()[0], r["size"], r["ranks"])): r for r in rows}

    def fmt(r):
        if r is None:
            return ""
        v = r["ratio"] if r["ratio"] != "-" else r["ckptfs"]
        return v + (" **miss**" if r["met"] == "NO" else "")
    head = ["figure", "goal"] + [f"{fs} {sz} {n}r" for fs, sz, n in cfgs]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "--:|" * len(cfgs)]
    for fig, goal in figs:
        lines.append("| " + " | ".join([fig, goal] + [fmt(cell.get((fig, k))) for k in cfgs]) + " |")
    missed = sum(r["met"] == "NO" for r in rows)
    met = sum(r["met"] == "yes" for r in rows)
    lines += ["", f"{met} goal cells met, {missed} missed; columns: filesystem, state dict size, "
              "ranks; cells: ratio against the limit of the same run (see the detailed table)."]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/bin/ckptfs", help="the ckptfs binary")
    ap.add_argument("--backing", required=True,
                    help="directory on the filesystem under test (limit files, backing dir, DCP dir); "
                         "comma-separated for several (e.g. a disk and a tmpfs)")
    ap.add_argument("--size", default="4G", help="state dict size (K/M/G suffixes), comma-separated for several")
    ap.add_argument("--dcp-threads", default="1,2,4",
                    help="FileSystemWriter thread_count values DCP saves with (the first is the "
                         "default one; the best is compared)")
    ap.add_argument("--no-dcp-backend", dest="dcp_backend", action="store_false",
                    help="skip DCP through ckptfs's backend (ckptfs.dcp.Writer/Reader)")
    ap.add_argument("--no-venv", action="store_true",
                    help="run with this interpreter (default: re-run under the project .venv's "
                         "python, torch 2.x, when there is one)")
    ap.add_argument("--ranks", default="4,1", help="world sizes, comma-separated")
    ap.add_argument("--staging-mem", default="1G", help="ckptfs -o staging_mem")
    ap.add_argument("--opts", action="append", default=[],
                    help="more ckptfs -o options (repeatable, or comma-separated)")
    ap.add_argument("--no-dcp", action="store_true", help="skip PyTorch DCP")
    ap.add_argument("--no-verify", action="store_true", help="do not check loaded bytes")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each world size this many times; the table shows medians")
    ap.add_argument("--quiet-wait", type=float, default=30,
                    help="before each timed phase wait up to this many seconds for the CPUs to be "
                         "< 15%% busy (other jobs skew the figures); the busy fraction is reported")
    ap.add_argument("--json", help="write all figures to this file")
    ap.add_argument("--table-from", metavar="JSON",
                    help="print the compact table of an earlier run's --json file and exit")
    if "--table-from" in sys.argv:   # no --backing needed, no venv
        i = sys.argv.index("--table-from")
        with open(sys.argv[i + 1]) as f:
            print(pivot(json.load(f)["summary"]))
        return 0
    ap.add_argument("--floor", action="store_true",
                    help="issue 26's table instead (bench/floor_table.py; --floor --help)")
    if "--floor" in sys.argv:        # issue 26's table: bench/floor_table.py
        in_venv("--no-venv" in sys.argv)
        import floor_table
        return floor_table.main([a for a in sys.argv[1:] if a != "--floor"])
    ap.add_argument("--tiers", action="store_true",
                    help="issue 27's rows instead (bench/tiers.py; --tiers --help)")
    if "--tiers" in sys.argv:        # issue 27's rows: bench/tiers.py (no torch)
        import tiers
        return tiers.main([a for a in sys.argv[1:] if a != "--tiers"])
    ap.add_argument("--writers", action="store_true",
                    help="issue 38's rows instead: each writer into a mount against a "
                         "plain directory (bench/writers.py; --writers --help)")
    if "--writers" in sys.argv:      # issue 38's rows: bench/writers.py
        import writers
        return writers.main([a for a in sys.argv[1:] if a != "--writers"])
    ap.add_argument("--user-view", action="store_true",
                    help="issue 39's rows instead: stock DCP against ckptfs.dcp, a GPT with "
                         "Adam, interleaved (bench/dcp_bench.py; --user-view --help)")
    if "--user-view" in sys.argv:    # issue 39's rows: bench/dcp_bench.py
        in_venv("--no-venv" in sys.argv)
        import dcp_bench
        return dcp_bench.main([a for a in sys.argv[1:] if a not in ("--user-view", "--no-venv")])
    args = ap.parse_args()
    in_venv(args.no_venv)
    args.dcp_threads = [int(x) for x in args.dcp_threads.split(",") if x.strip()]
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    if not os.access(args.bin, os.X_OK):
        sys.exit(f"bench: {args.bin} is not an executable (build it, or pass --bin)")
    dcp_ok, dcp_why = False, "--no-dcp"
    args.torch2 = False
    if not args.no_dcp:
        r = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True)
        dcp_ok = r.returncode == 0
        if dcp_ok and not r.stdout.strip().split(".")[0].isdigit() or \
                dcp_ok and int(r.stdout.strip().split(".")[0]) < 2:
            args.dcp_backend = False   # ckptfs.dcp needs torch 2.x
            log(f"bench: torch {r.stdout.strip()}: no DCP through ckptfs.dcp (it needs torch 2.x)")
        else:
            args.torch2 = dcp_ok       # dcp.async_save
        dcp_why = "" if dcp_ok else f"`import torch` fails under {sys.executable} " \
            "(the .venv has torch 2.x; Debian's python3-torch is for /usr/bin/python3)"
    configs, fails = [], 0
    backings = [b for b in args.backing.split(",") if b.strip()]
    sizes = [x for x in args.size.split(",") if x.strip()]
    for b in backings:
        for sz in sizes:
            a = argparse.Namespace(**vars(args))
            a.backing, a.size = b, sz
            c = run_config(a, ranks, dcp_ok, dcp_why)
            fails += c["fails"]
            configs.append(c)
    print()
    print(summary(args, configs))
    print()
    print(pivot(summary_rows(args, configs)))
    if args.json:
        # one configuration: its figures at the top level, as before
        out = dict(configs[0]["json"]) if len(configs) == 1 else {}
        out.update({"configs": [c["json"] for c in configs], "dcp": dcp_ok,
                    "summary": summary_rows(args, configs)})
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if fails else 0


def in_venv(no_venv):
    """Re-run this command under the project venv's python (torch 2.x)."""
    venv = next((v for v in (os.path.join(REPO, ".venv", "bin", "python"),
                             "/work/main/.venv/bin/python") if os.access(v, os.X_OK)), None)
    if venv and not no_venv and not os.environ.get("CKPTFS_BENCH_VENV") \
            and os.path.realpath(sys.prefix) != os.path.realpath(os.path.dirname(os.path.dirname(venv))):
        log(f"bench: re-running under {venv} (torch 2.x for DCP; --no-venv to stay)")
        os.environ["CKPTFS_BENCH_VENV"] = "1"
        os.execv(venv, [venv, os.path.abspath(__file__)] + sys.argv[1:])


def run_config(args, ranks, dcp_ok, dcp_why):
    """One --backing x --size: every world size; prints its detailed table."""
    args.total = parse_size(args.size)
    os.makedirs(args.backing, exist_ok=True)
    args.backing = os.path.realpath(args.backing)
    free = shutil.disk_usage(args.backing).free
    if free < 3 * args.total:
        sys.exit(f"bench: {args.backing} has {fmt_size(free)} free; the run needs 3 x --size = "
                 f"{fmt_size(3 * args.total)} (limit files, ckptfs checkpoint and its staging "
                 f"spill, DCP checkpoint). Free space or pass a smaller --size.")
    fstype = fs_type(args.backing)
    on_tmpfs = fstype in ("tmpfs", "ramfs")

    items, pool_size = make_state_dict(args.total, max(ranks), args.seed)
    pool = make_pool(pool_size, args.seed)
    tensors = [i for i in items if i.dtype]
    repl = sum(i.nbytes for i in items if i.replicated)
    by_dt = {}
    for i in tensors:
        by_dt[i.dtype] = by_dt.get(i.dtype, 0) + i.nbytes
    desc = (f"state dict {fmt_size(args.total)}: {len(tensors)} tensors "
            f"({fmt_size(min(i.nbytes for i in tensors))} .. {fmt_size(max(i.nbytes for i in tensors))}; "
            + ", ".join(f"{k} {100 * v / args.total:.0f}%" for k, v in sorted(by_dt.items()))
            + f"), {len(items) - len(tensors)} bytes items; replicated {fmt_size(repl)} in "
            f"{sum(1 for i in items if i.replicated)} items")
    log(desc)
    log(f"backing {args.backing} ({fstype}), staging_mem={args.staging_mem}, "
        f"DCP: {'yes' if dcp_ok else 'no (' + dcp_why + ')'}")

    worlds = []
    for n in ranks:
        runs = []
        for i in range(args.repeat):
            log(f"{n} rank(s)" + (f", run {i + 1} of {args.repeat}:" if args.repeat > 1 else ":"))
            runs.append(bench_world(args, n, items, pool, dcp_ok))
        worlds.append(combine(runs))

    print(desc)
    st = os.stat(args.bin)
    print(f"ckptfs {os.path.realpath(args.bin)} (built {time.strftime('%Y-%m-%d %H:%M', time.localtime(st.st_mtime))})")
    print(f"backing {args.backing} ({fstype}{', in RAM' if on_tmpfs else ''}), "
          f"ckptfs -o staging_mem={args.staging_mem}" + "".join("," + o for o in args.opts)
          + f"; {os.cpu_count()} CPUs")
    print(table(args, worlds, on_tmpfs))
    if args.repeat > 1:
        wide = [(W["ranks"], k, lo, hi) for W in worlds for k, (lo, hi) in W.get("spread", {}).items()]
        print(f"each time is the median of {args.repeat} runs (ratios of medians); the widest spreads: "
              + ", ".join(f"{k} at {n} rank(s) {lo:.2f}..{hi:.2f} s"
                          for n, k, lo, hi in sorted(wide, key=lambda x: -(x[3] / max(x[2], 1e-9)))[:4]))
    print("ratio: throughput vs the reference (reference time / time): the limit for saves, direct "
          "reads of the data files for loads, DCP for 'vs DCP'; async stall: stall time / limit time.")
    print("GiB/s: state dict size / time." + (
        " Mount loads read replicated items on every rank: " + ", ".join(
            f"{W['ranks']} rank(s) {fmt_size(W['load_mount_bytes'])} via mounts vs "
            f"{fmt_size(W['load_direct_bytes'])} of data files"
            for W in worlds if "load_mount_bytes" in W) + "."
        if any("load_mount_bytes" in W for W in worlds) else ""))
    for W in worlds:
        if "dcp_api" in W:
            print(f"DCP ({W['ranks']} rank(s)): {W['dcp_api']}, single_file_per_rank=True, sync_files=True, "
                  f"{fmt_size(W['dcp_bytes_on_disk'])} on disk")
    if not dcp_ok:
        print(f"DCP not run: {dcp_why}")
    for W in worlds:
        b = W.get("busy", {})
        if b:
            worst = max(b, key=b.get)
            o = W.get("others_cpus", {})
            ow = max(o, key=o.get) if o else worst
            print(f"other jobs on this machine ({W['ranks']} rank(s)): CPUs busy just before the cold "
                  f"phases (after waiting up to {args.quiet_wait:g} s for < 15%) max {100 * b[worst]:.0f}% "
                  f"({worst}); CPUs used by other processes during the timed phases "
                  f"max {o.get(ow, 0):.2f} ({ow})"
                  + ("  WARNING: not idle, figures skewed" if b[worst] > 0.15 or o.get(ow, 0) > 0.1 else ""))
    if not CAN_DROP[0]:
        print("WARNING: could not write /proc/sys/vm/drop_caches (not root?): 'cold' figures are not cold")
    fails = [f for W in worlds for f in W["failures"]]
    for f in fails:
        print("FAILED: " + f)
    if True:
        out = {"size": args.total, "backing": args.backing, "fstype": fstype,
               "staging_mem": args.staging_mem, "opts": args.opts, "seed": args.seed,
               "state_dict": {"tensors": len(tensors), "bytes_items": len(items) - len(tensors),
                              "replicated_bytes": repl, "bytes_by_dtype": by_dt},
               "worlds": worlds, "dcp": dcp_ok}
    return {"json": out, "worlds": worlds, "fstype": fstype, "on_tmpfs": on_tmpfs,
            "backing": args.backing, "size": args.total, "staging": parse_size(args.staging_mem),
            "fails": len(fails)}


if __name__ == "__main__":
    sys.exit(main())

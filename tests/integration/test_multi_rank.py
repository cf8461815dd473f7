#!/usr/bin/env python3
"""Integration tests of ckptfs worlds of several ranks: real mounts started
by mpirun over shared memory (vader) and TCP, driven with plain file calls
the way trainers do it.

    python3 tests/integration/test_multi_rank.py --bin build/bin/ckptfs [Class ...]

Each test class is one world, started once and reused by its tests (each
test uses checkpoint names of its own); reload tests start further worlds
over the same backing directory. A test fails when the world's output shows
a sanitizer report (ASan+UBSan build) or mpirun does not exit 0 after every
rank is unmounted. Python standard library only.

Classes:
  SaveLoadVader4   the main save/load scenario, 4 ranks over shared memory;
                   reloaded by worlds of 2 and 1 ranks
  SaveLoadTcp2     the same scenario, 2 ranks over TCP; reloaded at 3
  SaveLoadTcp4     the same scenario, 4 ranks over TCP
                   (each also: balanced replicas, ranks with nothing to
                   save, hundreds of files per rank, queued async commits)
  FailuresVader4   every failure of a commit, each on every rank and
                   followed by a good commit of the same world; async
                   commits (committed and failed), mixed sync/async, a stop
                   during an async save, rm -r seen by every rank
  TimeoutsVader4   ranks that do not commit within commit_timeout (3 s):
                   the last one, the coordinator, two, a late one
  TimingTcp2       2 ranks over TCP: commit_timeout, different names,
                   replica_check=warn, async
  StopOneRankTcp3  SIGTERM to one rank of a running world: a client while
                   a save is in flight, and the coordinator

Set CKPT_MR_VERBOSE=1 to print the failure reasons, CKPT_MR_KEEP=1 to keep
the temporary directories (logs, backing), CKPT_MR_LEAK_CHECK=0 to turn
LeakSanitizer off for the worlds (see ckpttest/sanenv.py).
"""

import errno
import itertools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

from ckpttest import util
from ckpttest.world import (Blob, Tensor, World, block, commit, commit_all, cuts, errname,
                            mountinfo_has, query, rank_pid, read_all, read_log, sanitizer_report,
                            split, stage, state, status, strides, wait_state, write_file)

# ---- the main scenario -------------------------------------------------------

def grid_chunks(shape, dim_cuts):
    """{rank: (offsets, sizes)} of the blocks of a grid, row-major over the
    grid; dim_cuts[d] lists the (offset, size) pieces of dimension d."""
    out = {}
    for r, pieces in enumerate(itertools.product(*dim_cuts)):
        out[r] = ([p[0] for p in pieces], [p[1] for p in pieces])
    return out


def main_items(n):
    """Every kind of item the scenario saves, laid out for a world of n."""
    all_ranks = range(n)
    rep = {r: None for r in all_ranks}
    items = [
        # row shards, even
        Tensor("model/layer0/rows.weight", "float32", [12, 10],
               {r: ([o, 0], [s, 10]) for r, (o, s) in enumerate(split(12, n))}),
        # column shards
        Tensor("model/layer0/cols.weight", "float64", [5, 11],
               {r: ([0, o], [5, s]) for r, (o, s) in enumerate(split(11, n))}),
        # 2-D blocks: a 2 x n/2 grid, uneven pieces
        Tensor("model/layer1/grid.weight", "int32", [6, 9],
               grid_chunks([6, 9], [cuts([2, 4]) if n > 1 else [(0, 6)],
                                    split(9, max(1, n // 2))])),
        # 3-D blocks on a grid
        Tensor("model/layer1/cube", "float16", [4, 6, 5],
               grid_chunks([4, 6, 5], {4: [cuts([1, 3]), [(0, 6)], cuts([2, 3])],
                                       2: [[(0, 4)], cuts([4, 2]), [(0, 5)]],
                                       1: [[(0, 4)], [(0, 6)], [(0, 5)]]}[n])),
        # uneven row split (5, 3, 7, 1 at 4 ranks)
        Tensor("model/uneven", "bfloat16", [16, 9],
               {r: ([o, 0], [s, 9]) for r, (o, s) in
                enumerate(cuts({4: [5, 3, 7, 1], 2: [11, 5], 1: [16]}[n]))}),
        # a bigger tensor, rows split unevenly: reads span many FUSE requests
        Tensor("model/embed", "float32", [1024, 320],
               {r: ([o, 0], [s, 320]) for r, (o, s) in
                enumerate(cuts({4: [300, 200, 400, 124], 2: [700, 324], 1: [1024]}[n]))}),
        # 1-D shards of small dtypes
        Tensor("model/mask", "bool", [37],
               {r: ([o], [s]) for r, (o, s) in enumerate(split(37, n))}),
        Tensor("model/codes", "uint8", [3, 101],
               {r: ([0, o], [3, s]) for r, (o, s) in enumerate(split(101, n))}),
        Tensor("optim/state/step_i8", "int8", [n * 2 + 1, 3],
               {r: ([o, 0], [s, 3]) for r, (o, s) in enumerate(split(n * 2 + 1, n))}),
        # replicated tensors: saved once each, spread over the ranks
        *[Tensor(f"replicated/buf{i}", "float32", [64], rep, seed=i) for i in range(8)],
        Tensor("replicated/table", "int16", [7, 3], rep),
        Tensor("replicated/phase", "complex64", [3], rep),
        Tensor("replicated/ids", "int64", [5], rep),
        # replicated on some ranks only
        Tensor("replicated/pair", "float64", [4, 2], {r: None for r in range(1, min(n, 3))}),
        # 0-d tensors, shape "" (and "[]") on every rank
        Tensor("scalars/step", "int64", [], rep, shape_attr=b""),
        Tensor("scalars/lr", "float64", [], rep, shape_attr=b""),
        Tensor("scalars/flag", "bool", [], rep, shape_attr=b"[]"),
        # zero-sized
        Tensor("model/empty", "float32", [0, 4], rep),
        # deep path, a tensor that only the last rank holds
        Tensor("a/b/c/d/e/deep.w", "int32", [3, 3], {n - 1: None}),
        # bytes items: identical on every rank (stored once), on one rank
        Blob("extra/config.json", {r: b'{"lr": 0.1, "layers": 2}\n' for r in all_ranks}),
        Blob("extra/rank0_only.bin", {0: os.urandom(5000) + b"\0end"}),
        Blob("extra/last_only.bin", {n - 1: os.urandom(777)}),
        Blob("extra/empty.bin", {r: b"" for r in all_ranks}),
        *[Blob(f"rng/rank{r}.state", {r: os.urandom(100 + r)}) for r in all_ranks],
    ]
    if n >= 3:
        # a tensor sharded over some ranks only (rank 0 has none of it)
        items.append(Tensor("optim/partial", "int64", [6, 3],
                            {r: ([o, 0], [s, 3]) for r, (o, s) in
                             zip(range(1, n), split(6, n - 1))}))
    if n == 4:
        # 3-D blocks that are no grid
        items.append(Tensor("model/layer2/irregular", "float32", [4, 6, 5], {
            0: ([0, 0, 0], [4, 3, 5]),
            1: ([0, 3, 0], [2, 3, 2]),
            2: ([2, 3, 0], [2, 3, 2]),
            3: ([0, 3, 2], [4, 3, 3])}))
    return items


def reshard_blocks(shape):
    """New shardings a loader might ask for: each dimension cut in 3
    uneven pieces, every block of that grid."""
    if not shape or math.prod(shape) == 0:
        return []
    dims = []
    for s in shape:
        a = max(1, s // 3 + 1) if s > 1 else s
        b = max(a, min(s, a + max(1, s // 4)))
        pieces = [(0, a)] + ([(a, b - a)] if b > a else []) + ([(b, s - b)] if s > b else [])
        dims.append(pieces)
    return [([p[0] for p in ps], [p[1] for p in ps]) for ps in itertools.product(*dims)]


# ---- base classes ------------------------------------------------------------

class WorldTestCase(unittest.TestCase):
    """One world per class, in a temporary directory of the class."""

    N = 4
    TRANSPORT = "vader"
    OPTS = "commit_timeout=60"

    @classmethod
    def setUpClass(cls):
        if not os.path.exists("/dev/fuse"):
            raise RuntimeError("/dev/fuse is missing: cannot mount ckptfs")
        if not shutil.which("mpirun"):
            raise RuntimeError("mpirun is missing: cannot start a world")
        cls.dir = tempfile.mkdtemp(prefix="ckptfs-mr-", dir="/tmp")
        cls.backing = os.path.join(cls.dir, "backing")
        cls.addClassCleanup(cls._rmdir)
        cls.worlds = []
        cls.world = cls.new_world(cls.N, cls.TRANSPORT, cls.OPTS, "world")
        cls.world.start()

    @classmethod
    def new_world(cls, n, transport, opts, tag):
        root = os.path.join(cls.dir, f"mnt-{tag}-{len(cls.worlds)}")
        log = os.path.join(cls.dir, f"{tag}-{len(cls.worlds)}.log")
        w = World(util.BIN, n, cls.backing, root, log, transport=transport, opts=opts)
        cls.worlds.append(w)
        cls.addClassCleanup(cls._stop_world, w)
        return w

    @classmethod
    def _stop_world(cls, w):
        w.stop_checked()

    @classmethod
    def _rmdir(cls):
        with open("/proc/self/mountinfo") as f:
            left = [line.split()[4] for line in f if line.split()[4].startswith(cls.dir)]
        for p in left:
            subprocess.run(["fusermount3", "-uz", p], capture_output=True)
        if os.environ.get("CKPT_MR_KEEP") == "1":
            sys.stderr.write(f"\nkept {cls.dir}\n")
        else:
            shutil.rmtree(cls.dir, ignore_errors=True)

    def setUp(self):
        w = self.world
        if w.proc is None or w.proc.poll() is not None:
            self.fail(f"the world is gone:\n{read_log(w.log)}")
        self.addCleanup(self._check_logs)

    def _check_logs(self):
        for w in self.worlds:
            text = read_log(w.log, limit=1 << 24)
            bad = sanitizer_report(text)
            if bad:
                self.fail(f"sanitizer report in {w.log}: {bad}\n"
                          f"{text[text.index(bad):][:6000]}")

    # paths
    def ck(self, rank, name, *parts, world=None):
        return os.path.join((world or self.world).mnt(rank), name, *parts)

    def bk(self, *parts):
        return os.path.join(self.backing, *parts)

    # commits
    def assertCommitted(self, res, ranks=None, world=None):
        w = world or self.world
        ranks = list(range(w.n) if ranks is None else ranks)
        self.assertEqual(sorted(res), sorted(ranks))
        bad = {r: errname(e) for r, (e, _) in res.items() if e is not None}
        self.assertEqual(bad, {}, f"commits failed: {bad}\n"
                         + "\n".join(self._statuses(w)))

    def _statuses(self, w):
        out = []
        for r in range(w.n):
            for name in os.listdir(w.mnt(r)):
                try:
                    out.append(f"rank {r} {name}: {status(self.ck(r, name, world=w))!r}")
                except OSError:
                    pass
        return out

    def assertNamesRank(self, text, rank):
        self.assertRegex(text, rf"\brank\W{{0,3}}{rank}\b")

    def assertFailedEverywhere(self, name, res, file, bad_ranks, ranks=None,
                               numbers=()):
        """Every committing rank got EIO; .status says failed, naming the
        file, the bad rank(s) and numbers; nothing of NAME is published."""
        ranks = list(range(self.world.n) if ranks is None else ranks)
        self.assertEqual(sorted(res), sorted(ranks))
        for r in ranks:
            e = res[r][0]
            self.assertIsInstance(e, OSError, f"rank {r}: the commit of {name} "
                                  f"did not fail: {e!r}")
            self.assertEqual(e.errno, errno.EIO, f"rank {r}: {e!r}")
        for r in ranks:
            st = status(self.ck(r, name))
            self.assertEqual(st.split("\n", 1)[0].strip(), "failed", f"rank {r}: {st!r}")
            if file is not None:
                self.assertTrue(file in st or file.replace("/", ".") in st,
                                f"rank {r}: {file} not named in {st!r}")
            for b in bad_ranks:
                self.assertNamesRank(st, b)
            for num in numbers:
                self.assertRegex(st, rf"\b{num}\b")
        self.assertNothingPublished(name)
        self.assertIsNone(self.world.proc.poll(), "the world died")
        st = status(self.ck(ranks[0], name))
        if os.environ.get("CKPT_MR_VERBOSE"):
            sys.stderr.write(f"\n[{name}] {st}")
        return st

    def assertNothingPublished(self, name):
        d = self.bk(name)
        self.assertFalse(os.path.exists(os.path.join(d, ".metadata")), d)
        if os.path.isdir(d):
            left = [f for f in os.listdir(d)
                    if f.endswith(".distcp") or f.startswith(".metadata")]
            self.assertEqual(left, [], f"left behind in {d}")
        for r in range(self.world.n):  # no mount shows it as committed
            self.assertNotEqual(state(self.ck(r, name)), "committed")

    # reading back
    def verify(self, world, name, items, saved_n, partial=True, ranks=None):
        """Every rank of world shows the global checkpoint exactly."""
        tensors = [it for it in items if it.kind == "tensor"]
        blobs = [it for it in items if it.kind == "bytes"]
        expect_files = {it.path for it in items} | {".metadata"}
        ranks = list(range(world.n) if ranks is None else ranks)
        for r in ranks:
            ck = self.ck(r, name, world=world)
            self.assertEqual(state(ck), "committed", f"rank {r}")
            seen = set()
            for dirpath, _, files in os.walk(ck):
                for f in files:
                    seen.add(os.path.relpath(os.path.join(dirpath, f), ck))
            self.assertEqual(seen, expect_files, f"rank {r}: listing of {name}")
            for t in tensors:
                p = os.path.join(ck, t.path)
                msg = f"rank {r}: {name}/{t.path}"
                self.assertEqual(os.stat(p).st_size, len(t.data), msg)
                self.assertEqual(os.getxattr(p, "user.ckpt.dtype"), t.dtype.encode(), msg)
                self.assertEqual(os.getxattr(p, "user.ckpt.shape"),
                                 ",".join(map(str, t.shape)).encode(), msg)
                got = read_all(p)
                if got != t.data:
                    self.fail(f"{msg}: content differs ({len(got)} bytes, "
                              f"{len(t.data)} expected; first difference at "
                              f"{next((i for i, (a, b) in enumerate(zip(got, t.data)) if a != b), None)})")
                if partial:
                    self.check_partial_reads(p, t, msg)
            for b in blobs:
                p = os.path.join(ck, b.path)
                self.assertEqual(read_all(p), b.data, f"rank {r}: {name}/{b.path}")
        self.check_metadata(world, name, items, saved_n, ranks[-1])

    def check_partial_reads(self, p, t, msg):
        """pread at and around chunk borders, at the end, and block by
        block as a loader with another sharding reads: through the page
        cache (the kernel asks for whole pages) and with O_DIRECT (the
        daemon gets the exact, unaligned offsets and lengths)."""
        for how, flags in (("cached", 0), ("O_DIRECT", os.O_DIRECT)):
            fd = os.open(p, os.O_RDONLY | flags)
            try:
                self._partial_reads(fd, t, f"{msg} ({how})")
            finally:
                os.close(fd)

    def _partial_reads(self, fd, t, msg):
        size = len(t.data)

        def rd(off, n):
            out = bytearray()
            while len(out) < n:
                b = os.pread(fd, n - len(out), off + len(out))
                if not b:
                    break
                out += b
            return bytes(out)

        # around every place where one chunk's data meets another's
        row = t.shape[-1] * t.isz if t.shape else t.isz
        for b in t.boundaries():
            for delta in (-3, -1, 0, 1):
                off = min(max(0, b + delta), size)
                for n in (1, 6, row + 5):
                    self.assertEqual(rd(off, n), t.data[off:off + n],
                                     f"{msg}: pread({n}, {off})")
        # the end of the file
        for off, n in ((size - 2, 10), (size, 10), (size + 100, 4)):
            if off >= 0:
                self.assertEqual(rd(off, n), t.data[off:off + n],
                                 f"{msg}: pread({n}, {off}) at the end")
        # loading with another sharding: every block of a 3-cut grid, one
        # pread per innermost run (column bands across column borders),
        # and each run again shifted by one byte (unaligned)
        st = strides(t.shape, t.isz) if t.shape else []
        for offs, sizes in reshard_blocks(t.shape):
            out = bytearray()
            for idx in itertools.product(*[range(o, o + s) for o, s in
                                           zip(offs[:-1], sizes[:-1])]):
                start = sum(i * s for i, s in zip(idx, st)) + offs[-1] * t.isz
                n = sizes[-1] * t.isz
                out += rd(start, n)
                if start + 1 + n <= size:
                    got = rd(start + 1, n)
                    if got != t.data[start + 1:start + 1 + n]:
                        self.fail(f"{msg}: pread({n}, {start + 1}) in block {offs} {sizes}")
            self.assertEqual(bytes(out), block(t.data, t.shape, t.isz, offs, sizes),
                             f"{msg}: block {offs} {sizes}")

    def check_metadata(self, world, name, items, saved_n, rank):
        """The .metadata tables (read on rank's mount), and the stored bytes
        behind every row."""
        db = os.path.join(self.ck(rank, name, world=world), ".metadata")
        kv = dict(query(db, "select key, value from checkpoint"))
        self.assertEqual(str(kv.get("world_size")), str(saved_n))
        self.assertEqual(kv.get("name"), name)
        tensors = [it for it in items if it.kind == "tensor"]
        blobs = [it for it in items if it.kind == "bytes"]
        rows = {fqn: (path, dtype, shape) for fqn, path, dtype, shape in
                query(db, "select fqn, path, dtype, shape from tensors")}
        self.assertEqual(set(rows), {t.fqn for t in tensors})
        for t in tensors:
            self.assertEqual(rows[t.fqn], (t.path, t.dtype,
                                           "[" + ",".join(map(str, t.shape)) + "]"), t.fqn)
        chunks = query(db, "select fqn, offsets, sizes, rank, file, file_offset, "
                           "length, checksum from chunks")
        by_fqn = {}
        for c in chunks:
            by_fqn.setdefault(c[0], []).append(c)
        ckdir = self.bk(name)
        for t in tensors:
            want = sorted((("[" + ",".join(map(str, o)) + "]"),
                           ("[" + ",".join(map(str, s)) + "]")) for o, s in t.saved_chunks())
            got = sorted((c[1], c[2]) for c in by_fqn.get(t.fqn, []))
            self.assertEqual(got, want, f"chunks of {t.fqn}")
            for fqn, offs, sizes, rank, file, off, length, cks in by_fqn.get(t.fqn, []):
                o = [int(x) for x in offs.strip("[]").split(",") if x]
                s = [int(x) for x in sizes.strip("[]").split(",") if x]
                exp = block(t.data, t.shape, t.isz, o, s)
                self.assertEqual(length, len(exp), f"{fqn} {offs}")
                self.assertRegex(file, rf"^__{rank}_\d+\.distcp$")
                self.assertRegex(cks, r"^[0-9a-f]{16}$")
                holders = [r for r, c in t.chunks.items()
                           if (c is None and o == [0] * len(t.shape) and s == t.shape)
                           or (c is not None and list(c[0]) == o and list(c[1]) == s)]
                self.assertIn(rank, holders, f"{fqn} {offs} stored by a rank without it")
                with open(os.path.join(ckdir, file), "rb") as f:
                    f.seek(off)
                    self.assertEqual(f.read(length), exp, f"stored bytes of {fqn} {offs}")
        brows = {fqn: (path, rank, file, off, length) for fqn, path, rank, file, off, length in
                 query(db, "select fqn, path, rank, file, file_offset, length from blobs")}
        self.assertEqual(len(query(db, "select fqn from blobs")), len(blobs))
        self.assertEqual(set(brows), {b.fqn for b in blobs})
        for b in blobs:
            path, rank, file, off, length = brows[b.fqn]
            self.assertEqual(path, b.path)
            self.assertIn(rank, b.copies)
            self.assertEqual(length, len(b.data))
            with open(os.path.join(ckdir, file), "rb") as f:
                f.seek(off)
                self.assertEqual(f.read(length), b.data, f"stored bytes of {b.fqn}")
        # no data file that the metadata does not name
        named = {c[4] for c in chunks} | {v[2] for v in brows.values()}
        on_disk = {f for f in os.listdir(ckdir) if f.endswith(".distcp")}
        self.assertLessEqual(named, on_disk)
        for f in on_disk - named:
            self.assertEqual(os.path.getsize(os.path.join(ckdir, f)), 0,
                             f"{f}: a data file the metadata does not name")


# ---- the main scenario on several worlds ---------------------------------------

class SaveLoadMixin:
    RELOAD = ()  # (world size, transport) of worlds that load it again

    def test_save_load(self):
        n = self.N
        items = main_items(n)
        stage(self.world, "step-100", items)
        for r in range(n):  # the staged view is this rank's own part
            self.assertEqual(state(self.ck(r, "step-100")), "staging")
        res = commit_all(self.world, "step-100")
        self.assertCommitted(res)
        self.verify(self.world, "step-100", items, n)
        db = os.path.join(self.ck(0, "step-100"), ".metadata")
        reps = [it for it in items if it.kind == "tensor" and all(
            c is None for c in it.chunks.values()) and len(it.chunks) > 1]
        self.assertGreater(len(reps), 10)
        for t in reps:  # one chunk row for each replicated tensor
            self.assertEqual(query(db, "select count(*) from chunks where fqn=?", (t.fqn,)),
                             [(1,)], t.fqn)
        self.assertEqual(query(db, "select count(*) from blobs where fqn='extra.config.json'"),
                         [(1,)])
        # a second checkpoint in the same world, then both stay readable
        more = [Tensor("w", "float32", [n, 3], {r: ([r, 0], [1, 3]) for r in range(n)}, seed=7)]
        stage(self.world, "step-200", more)
        self.assertCommitted(commit_all(self.world, "step-200"))
        self.verify(self.world, "step-200", more, n)
        self.verify(self.world, "step-100", items, n, partial=False)
        # reload with other world sizes over the same backing dir
        for m, transport in self.RELOAD:
            w = self.new_world(m, transport, "", f"reload{m}")
            w.start()
            self.verify(w, "step-100", items, n)
            self.verify(w, "step-200", more, n, partial=False)
            # and saves at its own size
            own = [Tensor("own/w", "float64", [7, 3],
                          {r: ([o, 0], [s, 3]) for r, (o, s) in enumerate(split(7, m))}),
                   Tensor("own/rep", "int32", [5], {r: None for r in range(m)}),
                   Blob("own/cfg", {r: b"reloaded" for r in range(m)})]
            stage(w, f"resaved-{m}", own)
            self.assertCommitted(commit_all(w, f"resaved-{m}"), world=w)
            self.verify(w, f"resaved-{m}", own, m)
            rc = w.stop()
            self.assertEqual(rc, 0, f"reload world of {m}: mpirun exited {rc}")


    def test_replicas_balanced(self):
        """Replicated items go to the rank with the fewest bytes so far: with
        equal shards and equal replicas every rank stores its share."""
        n = self.N
        shard = Tensor("shard", "float32", [n, 64], {r: ([r, 0], [1, 64]) for r in range(n)})
        reps = [Tensor(f"rep/t{i}", "float32", [256], {r: None for r in range(n)}, seed=i)
                for i in range(2 * n)]
        blobs = [Blob(f"rep/b{i}", {r: bytes([i]) * 1024 for r in range(n)}) for i in range(n)]
        items = [shard] + reps + blobs
        stage(self.world, "balance", items)
        self.assertCommitted(commit_all(self.world, "balance"))
        self.verify(self.world, "balance", items, n, partial=False)
        db = os.path.join(self.ck(0, "balance"), ".metadata")
        per_rank = dict.fromkeys(range(n), 0)
        for rank, length in query(db, "select rank, length from chunks where fqn like 'rep.%' "
                                      "union all select rank, length from blobs"):
            per_rank[rank] += length
        self.assertEqual(sum(per_rank.values()), 2 * n * 1024 + n * 1024)
        self.assertLessEqual(max(per_rank.values()) - min(per_rank.values()), 1024,
                             f"replicated bytes per rank: {per_rank}")
        holders = {rank for (rank,) in query(db, "select rank from chunks where fqn like 'rep.%'")}
        self.assertGreater(len(holders), 1, "every replicated tensor on one rank")


    def test_sparse_ranks(self):
        """Ranks with nothing to save take part all the same; a checkpoint
        with no item at all commits too."""
        n = self.N
        t = Tensor("only/last", "float32", [3], {n - 1: None})
        b = Blob("only/first.txt", {0: b"first"})
        stage(self.world, "sparse", [t, b])
        self.assertCommitted(commit_all(self.world, "sparse"))
        self.verify(self.world, "sparse", [t, b], n, partial=False)
        stage(self.world, "nothing", [])
        self.assertCommitted(commit_all(self.world, "nothing"))
        for r in range(n):
            self.assertEqual(os.listdir(self.ck(r, "nothing")), [".metadata"])
        db = os.path.join(self.ck(0, "nothing"), ".metadata")
        self.assertEqual(query(db, "select count(*) from tensors"), [(0,)])
        self.assertEqual(query(db, "select count(*) from blobs"), [(0,)])


    def test_many_items(self):
        """Hundreds of files per rank with long paths: plan messages far
        beyond the transports' eager limits."""
        n = self.N
        items = []
        for r in range(n):
            for i in range(300):
                path = f"rank{r}/" + "/".join([f"module_{i % 7}_" + "x" * 40] * 3) + f"/item{i}.bin"
                items.append(Blob(path, {r: f"{r}:{i}".encode() * (i % 5)}))
        items.append(Tensor("shared/w", "int64", [n * 50, 3],
                            {r: ([50 * r, 0], [50, 3]) for r in range(n)}))
        for i in range(50):
            items.append(Tensor(f"shared/rep{i}", "uint8", [i + 1], {r: None for r in range(n)}, seed=i))
        stage(self.world, "many", items)
        self.assertCommitted(commit_all(self.world, "many"))
        self.verify(self.world, "many", items, n, partial=False, ranks=[0, n - 1])
        db = os.path.join(self.ck(0, "many"), ".metadata")
        self.assertEqual(query(db, "select count(*) from blobs"), [(300 * n,)])

    def test_pipelined_async(self):
        """Several async commits queued back to back on every rank."""
        n = self.N
        names = [f"pipe-{k}" for k in range(3)]
        sets = {}
        for k, name in enumerate(names):
            sets[name] = [Tensor("w", "float32", [n, 100],
                                 {r: ([r, 0], [1, 100]) for r in range(n)}, seed=k),
                          Blob("step", {r: str(k).encode() for r in range(n)})]
            stage(self.world, name, sets[name])
            self.assertCommitted(commit_all(self.world, name, mode="async"))
        for name in names:
            for r in range(n):
                st = wait_state(self.ck(r, name))
                self.assertEqual(st.split("\n", 1)[0], "committed", f"rank {r} {name}: {st!r}")
            self.verify(self.world, name, sets[name], n, partial=False)


class SaveLoadVader4(SaveLoadMixin, WorldTestCase):
    N, TRANSPORT = 4, "vader"
    # the reload worlds mount the same backing dir while this one runs
    RELOAD = ((2, "vader"), (1, "vader"))


class SaveLoadTcp2(SaveLoadMixin, WorldTestCase):
    N, TRANSPORT = 2, "tcp"
    RELOAD = ((3, "tcp"),)


class SaveLoadTcp4(SaveLoadMixin, WorldTestCase):
    N, TRANSPORT = 4, "tcp"


# ---- failures ---------------------------------------------------------------

def rows_of(n_rows, starts_sizes, cols=3, dtype="float32", path="bad/w"):
    return Tensor(path, dtype, [n_rows, cols],
                  {r: ([o, 0], [s, cols]) for r, (o, s) in enumerate(starts_sizes)})


class FailuresVader4(WorldTestCase):
    """Each failure fails on every committing rank, publishes nothing, and
    the same world then commits (the fixed checkpoint) successfully."""

    N, TRANSPORT = 4, "vader"

    def fail_then_fix(self, name, items, file, bad_ranks, fix, numbers=(), fixed_items=None):
        good = Tensor("good/w", "int32", [8, 2], {r: ([2 * r, 0], [2, 2]) for r in range(4)})
        stage(self.world, name, items + [good])
        res = commit_all(self.world, name)
        st = self.assertFailedEverywhere(name, res, file, bad_ranks, numbers=numbers)
        # the checkpoint stays staged: fix it and commit again
        fix()
        self.assertCommitted(commit_all(self.world, name))
        self.verify(self.world, name, (fixed_items or items) + [good], self.N, partial=False)
        return st

    def test_overlap(self):
        bad = rows_of(16, [(0, 5), (4, 4), (8, 4), (12, 4)], path="layer/overlap.w")
        fixed = rows_of(16, [(0, 4), (4, 4), (8, 4), (12, 4)], path="layer/overlap.w")
        self.fail_then_fix("f-overlap", [bad], "layer/overlap.w", [0, 1],
                           lambda: fixed.write(self.ck(0, "f-overlap"), 0),
                           fixed_items=[fixed])

    def test_gap(self):
        bad = rows_of(16, [(0, 4), (4, 4), (9, 4), (13, 3)], path="layer/gap.w")
        fixed = rows_of(16, [(0, 4), (4, 4), (8, 5), (13, 3)], path="layer/gap.w")
        st = self.fail_then_fix("f-gap", [bad], "layer/gap.w", [],
                                lambda: fixed.write(self.ck(2, "f-gap"), 2),
                                fixed_items=[fixed])
        self.assertRegex(st, r"\b8\b", "the missing row is not named")
        self.assertRegex(st, r"\branks?\W{0,3}\d", "no rank named")

    def test_dtype_disagreement(self):
        t = rows_of(8, [(0, 2), (2, 2), (4, 2), (6, 2)], path="layer/dtype.w")
        odd = rows_of(8, [(0, 2), (2, 2), (4, 2), (6, 2)], dtype="float64", path="layer/dtype.w")
        name = "f-dtype"
        good = Tensor("good/w", "int32", [8, 2], {r: ([2 * r, 0], [2, 2]) for r in range(4)})
        for r in range(4):
            os.mkdir(self.ck(r, name))
            (odd if r == 2 else t).write(self.ck(r, name), r)
            good.write(self.ck(r, name), r)
        st = self.assertFailedEverywhere(name, commit_all(self.world, name),
                                         "layer/dtype.w", [2])
        self.assertIn("float64", st)
        t.write(self.ck(2, name), 2)
        self.assertCommitted(commit_all(self.world, name))
        self.verify(self.world, name, [t, good], 4, partial=False)

    def test_shape_disagreement(self):
        name = "f-shape"
        t = rows_of(8, [(0, 2), (2, 2), (4, 2), (6, 2)], path="layer/shape.w")
        good = Tensor("good/w", "int32", [8, 2], {r: ([2 * r, 0], [2, 2]) for r in range(4)})
        stage(self.world, name, [t, good])
        os.setxattr(self.ck(1, name, "layer/shape.w"), "user.ckpt.shape", b"9,3")
        st = self.assertFailedEverywhere(name, commit_all(self.world, name),
                                         "layer/shape.w", [1])
        self.assertRegex(st, r"\[?9,3\]?|9 ?x ?3")
        os.setxattr(self.ck(1, name, "layer/shape.w"), "user.ckpt.shape", b"[8, 3]")
        self.assertCommitted(commit_all(self.world, name))
        self.verify(self.world, name, [t, good], 4, partial=False)

    def test_same_fqn_different_paths_bytes(self):
        name = "f-fqn-bytes"
        blob = b"the same bytes on both ranks"
        os.mkdir(self.ck(0, name))
        os.mkdir(self.ck(1, name))
        os.mkdir(self.ck(2, name))
        os.mkdir(self.ck(3, name))
        write_file(self.ck(0, name, "a", "b.c"), blob)
        write_file(self.ck(1, name, "a.b", "c"), blob)
        st = self.assertFailedEverywhere(name, commit_all(self.world, name), "a.b.c", [0, 1])
        self.assertIn("a/b.c", st)
        self.assertIn("a.b/c", st)
        os.unlink(self.ck(1, name, "a.b", "c"))
        os.rmdir(self.ck(1, name, "a.b"))
        write_file(self.ck(1, name, "a", "b.c"), blob)
        self.assertCommitted(commit_all(self.world, name))
        self.verify(self.world, name, [Blob("a/b.c", {0: blob, 1: blob})], 4, partial=False)

    def test_same_fqn_different_paths_tensor(self):
        name = "f-fqn-tensor"
        t = Tensor("t/x.y", "float32", [4, 2], {r: ([r, 0], [1, 2]) for r in range(4)})
        stage(self.world, name, [t])
        # rank 3 writes its shard at t.x/y: the same FQN, another path
        os.makedirs(self.ck(3, name, "t.x"))
        os.rename(self.ck(3, name, "t", "x.y"), self.ck(3, name, "t.x", "y"))
        st = self.assertFailedEverywhere(name, commit_all(self.world, name), "t.x.y", [3])
        self.assertIn("t.x/y", st)
        os.rename(self.ck(3, name, "t.x", "y"), self.ck(3, name, "t", "x.y"))
        os.rmdir(self.ck(3, name, "t.x"))
        self.assertCommitted(commit_all(self.world, name))
        self.verify(self.world, name, [t], 4, partial=False)

    def test_differing_replicas_tensor(self):
        name = "f-replica"
        t = Tensor("rep/w", "float32", [8, 3], {r: None for r in range(4)}, seed=1)
        odd = Tensor("rep/w", "float32", [8, 3], {2: None}, seed=2)
        stage(self.world, name, [t])
        odd.write(self.ck(2, name), 2)
        self.fail_check(name, "rep/w", [2])
        t.write(self.ck(2, name), 2)
        self.assertCommitted(commit_all(self.world, name))
        self.verify(self.world, name, [t], 4, partial=False)

    def test_differing_replicas_bytes(self):
        name = "f-replica-bytes"
        b = Blob("extra/config.json", {r: b'{"a": 1}' for r in range(4)})
        stage(self.world, name, [b])
        write_file(self.ck(3, name, "extra/config.json"), b'{"a": 2}')
        self.fail_check(name, "extra/config.json", [3])
        b.write(self.ck(3, name), 3)
        self.assertCommitted(commit_all(self.world, name))
        self.verify(self.world, name, [b], 4, partial=False)

    def fail_check(self, name, file, bad_ranks):
        return self.assertFailedEverywhere(name, commit_all(self.world, name), file, bad_ranks)

    def test_wrong_chunk_length(self):
        name = "f-length"
        t = rows_of(8, [(0, 2), (2, 2), (4, 2), (6, 2)], path="layer/len.w")
        stage(self.world, name, [t])
        write_file(self.ck(3, name, "layer/len.w"), t.chunk_bytes(3)[:-4])
        # 2 x 3 float32 = 24 bytes expected, 20 written
        self.assertFailedEverywhere(name, commit_all(self.world, name), "layer/len.w", [3],
                                    numbers=(20, 24))
        t.write(self.ck(3, name), 3)
        self.assertCommitted(commit_all(self.world, name))
        self.verify(self.world, name, [t], 4, partial=False)

    def test_different_names_at_once(self):
        items = [rows_of(8, [(0, 2), (2, 2), (4, 2), (6, 2)], path="w")]
        stage(self.world, "n-a", items)
        stage(self.world, "n-b", items)
        res = commit_all(self.world, {0: "n-a", 1: "n-a", 2: "n-b", 3: "n-b"})
        for r in range(4):
            e = res[r][0]
            self.assertIsInstance(e, OSError, f"rank {r}: {e!r}")
            self.assertEqual(e.errno, errno.EIO)
        for r, name in ((0, "n-a"), (1, "n-a"), (2, "n-b"), (3, "n-b")):
            st = status(self.ck(r, name))
            self.assertEqual(st.split("\n", 1)[0], "failed", st)
            self.assertIn("n-a", st)
            self.assertIn("n-b", st)
            for k in range(4):
                self.assertNamesRank(st, k)
        for name in ("n-a", "n-b"):
            self.assertNothingPublished(name)
        self.assertCommitted(commit_all(self.world, "n-a"))
        self.assertCommitted(commit_all(self.world, "n-b"))
        self.verify(self.world, "n-a", items, 4, partial=False)
        self.verify(self.world, "n-b", items, 4, partial=False)

    def test_missing_xattr_one_rank(self):
        """A rank's local plan fails (a dtype without a shape): a client's,
        and the coordinator's own."""
        for bad in (1, 0):
            with self.subTest(rank=bad):
                name = f"f-xattr-{bad}"
                t = rows_of(8, [(0, 2), (2, 2), (4, 2), (6, 2)], path="layer/noshape.w")
                stage(self.world, name, [t])
                p = self.ck(bad, name, "layer/noshape.w")
                os.unlink(p)
                write_file(p, t.chunk_bytes(bad))
                os.setxattr(p, "user.ckpt.dtype", b"float32")
                st = self.assertFailedEverywhere(name, commit_all(self.world, name),
                                                 "layer/noshape.w", [bad])
                self.assertIn("shape", st)
                t.write(self.ck(bad, name), bad)
                self.assertCommitted(commit_all(self.world, name))
                self.verify(self.world, name, [t], 4, partial=False)

    def test_kind_disagreement(self):
        """One FQN: a tensor on some ranks, a bytes item on another."""
        name = "f-kind"
        t = Tensor("mixed/x", "int32", [4, 2], {r: None for r in range(3)})
        stage(self.world, name, [t])
        write_file(self.ck(3, name, "mixed/x"), t.data)  # no xattrs: bytes
        self.assertFailedEverywhere(name, commit_all(self.world, name), "mixed/x", [3])
        t.chunks[3] = None
        t.write(self.ck(3, name), 3)
        self.assertCommitted(commit_all(self.world, name))
        self.verify(self.world, name, [t], 4, partial=False)

    def test_write_failure_one_rank(self):
        """The backing filesystem fails one rank's data file (EISDIR, made
        by an error failpoint of that rank: a save writes into a directory
        of its own, where nothing can be planted in advance): every rank
        fails with the system's error text, nothing is published, and what
        the other ranks wrote is removed; the retry commits. A client, and
        the coordinator."""
        for bad in (2, 0):
            with self.subTest(rank=bad):
                w = self.new_world(4, "vader", self.OPTS, f"wf{bad}")
                w.env_extra = {"CKPTFS_FAILPOINT": f"write_open@{bad}=EISDIR"}
                w.start()
                name = f"f-write-{bad}"
                t = Tensor("w", "float32", [4, 64], {r: ([r, 0], [1, 64]) for r in range(4)})
                stage(w, name, [t])
                res = commit_all(w, name)
                for r in range(4):
                    e = res[r][0]
                    self.assertIsInstance(e, OSError, f"rank {r}: {e!r}")
                    self.assertEqual(e.errno, errno.EIO, f"rank {r}: {e!r}")
                for r in range(4):
                    st = status(self.ck(r, name, world=w))
                    self.assertEqual(st.split("\n", 1)[0], "failed", st)
                    self.assertNamesRank(st, bad)
                    self.assertIn(os.strerror(errno.EISDIR), st)
                if os.environ.get("CKPT_MR_VERBOSE"):
                    sys.stderr.write(f"\n[{name}] {st}")
                self.assertFalse(os.path.exists(self.bk(name)), "nothing may be published")
                saves = self.bk(".saves")
                self.assertFalse(os.path.isdir(saves) and os.listdir(saves),
                                 "files of the failed save left behind")
                self.assertCommitted(commit_all(w, name), world=w)
                self.verify(w, name, [t], 4, partial=False)

    def test_mixed_sync_async(self):
        name = "mixed-modes"
        t = Tensor("w", "int16", [8, 5], {r: ([2 * r, 0], [2, 5]) for r in range(4)})
        stage(self.world, name, [t])
        res = {}
        res.update(commit_all(self.world, name, mode="async", ranks=[1, 3]))
        res.update(commit_all(self.world, name, mode="sync", ranks=[0, 2]))
        self.assertCommitted(res)
        for r in range(4):
            self.assertEqual(wait_state(self.ck(r, name)).split("\n", 1)[0], "committed")
        self.verify(self.world, name, [t], 4, partial=False)

    def test_remove_everywhere(self):
        """rm -r of a committed checkpoint on one rank removes it for all."""
        name = "rm-me"
        t = Tensor("w", "float32", [4, 2], {r: ([r, 0], [1, 2]) for r in range(4)})
        stage(self.world, name, [t])
        self.assertCommitted(commit_all(self.world, name))
        self.verify(self.world, name, [t], 4, partial=False)
        shutil.rmtree(self.ck(2, name))
        self.assertFalse(os.path.exists(self.bk(name)))
        for r in range(4):
            self.assertNotIn(name, os.listdir(self.world.mnt(r)), f"rank {r}")
            self.assertFalse(os.path.exists(self.ck(r, name, "w")), f"rank {r}")
        # the name is free again, on every rank
        t2 = Tensor("w", "float32", [4, 2], {r: ([r, 0], [1, 2]) for r in range(4)}, seed=5)
        stage(self.world, name, [t2])
        self.assertCommitted(commit_all(self.world, name))
        self.verify(self.world, name, [t2], 4, partial=False)

    def test_stop_during_async(self):
        """Every rank is unmounted right after an async commit: the save in
        flight finishes, the daemons exit 0, and a new world loads it."""
        w = self.new_world(4, "vader", "commit_timeout=60", "stop")
        w.start()
        big = Tensor("model/big", "float32", [4096, 512],
                     {r: ([1024 * r, 0], [1024, 512]) for r in range(4)})
        rep = Tensor("model/rep", "int64", [1000], {r: None for r in range(4)})
        items = [big, rep, Blob("cfg", {r: b"x" for r in range(4)})]
        stage(w, "in-flight", items)
        self.assertCommitted(commit_all(w, "in-flight", mode="async"), world=w)
        rc = w.stop()
        self.assertEqual(rc, 0, f"mpirun exited {rc}:\n{read_log(w.log)}")
        self.assertTrue(os.path.exists(self.bk("in-flight", ".metadata")),
                        f"the save in flight did not finish:\n{read_log(w.log)}")
        w2 = self.new_world(2, "vader", "", "after-stop")
        w2.start()
        self.verify(w2, "in-flight", items, 4, partial=False)
        self.assertEqual(w2.stop(), 0)

    def test_async_every_rank(self):
        n = self.N
        big = Tensor("model/big", "float32", [2048, 256],
                     {r: ([o, 0], [s, 256]) for r, (o, s) in enumerate(split(2048, n))})
        rep = Tensor("model/bias", "float32", [256], {r: None for r in range(n)})
        cfg = Blob("extra/cfg", {r: b"async" for r in range(n)})
        items = [big, rep, cfg]
        stage(self.world, "async-1", items)
        # every rank but the last commits: the writes return although the
        # save cannot finish before the last rank commits
        res = commit_all(self.world, "async-1", mode="async", ranks=range(n - 1))
        self.assertCommitted(res, ranks=range(n - 1))
        for r in range(n - 1):
            st = status(self.ck(r, "async-1"))
            self.assertEqual(st.split("\n", 1)[0], "committing")
            self.assertRegex(st, r"\n.*\b\d+\b.* of \d+", "no progress line")
        self.assertEqual(state(self.ck(n - 1, "async-1")), "staging")
        # the trainer goes on with the next checkpoint at once
        nxt = [Tensor("w", "int64", [n, 2], {r: ([r, 0], [1, 2]) for r in range(n)})]
        stage(self.world, "async-2", nxt, ranks=range(n - 1))
        commit(self.ck(n - 1, "async-1"), "async")
        stage(self.world, "async-2", nxt, ranks=[n - 1])
        for r in range(n):
            st = wait_state(self.ck(r, "async-1"))
            self.assertEqual(st.split("\n", 1)[0], "committed", f"rank {r}: {st!r}")
        self.verify(self.world, "async-1", items, n, partial=False)
        self.assertCommitted(commit_all(self.world, "async-2"))
        self.verify(self.world, "async-2", nxt, n, partial=False)

    def test_async_failure(self):
        name = "async-bad"
        t = rows_of(8, [(0, 2), (2, 2), (4, 2), (6, 2)], path="layer/short.w")
        stage(self.world, name, [t])
        write_file(self.ck(1, name, "layer/short.w"), t.chunk_bytes(1)[:-1])
        res = commit_all(self.world, name, mode="async")
        self.assertCommitted(res)  # async: the write itself succeeds
        for r in range(self.N):
            st = wait_state(self.ck(r, name))
            self.assertEqual(st.split("\n", 1)[0], "failed", f"rank {r}: {st!r}")
            self.assertIn("short.w", st)
            self.assertNamesRank(st, 1)
        self.assertNothingPublished(name)
        t.write(self.ck(1, name), 1)
        self.assertCommitted(commit_all(self.world, name, mode="async"))
        for r in range(self.N):
            self.assertEqual(wait_state(self.ck(r, name)).split("\n", 1)[0], "committed")
        self.verify(self.world, name, [t], self.N, partial=False)


# ---- timeouts -----------------------------------------------------------------

class TimeoutMixin:
    """Ranks that do not commit within commit_timeout (3 s)."""

    TIMEOUT = 3

    def small(self):
        n = self.N
        return [Tensor("w", "float32", [n, 4], {r: ([r, 0], [1, 4]) for r in range(n)})]

    def missing(self, name, absent):
        n = self.N
        items = self.small()
        stage(self.world, name, items)
        present = [r for r in range(n) if r not in absent]
        t0 = time.monotonic()
        res = commit_all(self.world, name, ranks=present, timeout=120)
        took = time.monotonic() - t0
        self.assertFailedEverywhere(name, res, None, absent, ranks=present)
        self.assertGreaterEqual(took, self.TIMEOUT * 0.9, "failed before commit_timeout")
        for r in present:
            self.assertRegex(status(self.ck(r, name)), r"commit_timeout|did not commit",
                             f"rank {r}")
        for r in absent:  # untouched where it was never committed
            self.assertEqual(state(self.ck(r, name)), "staging")
        # the world goes on: everyone commits a new checkpoint
        new = name + "-next"
        stage(self.world, new, items)
        self.assertCommitted(commit_all(self.world, new))
        self.verify(self.world, new, items, n, partial=False)

    def test_last_rank_missing(self):
        self.missing("t-last", [self.N - 1])

    def test_coordinator_missing(self):
        self.missing("t-coord", [0])


class TimeoutsVader4(TimeoutMixin, WorldTestCase):
    N, TRANSPORT = 4, "vader"
    OPTS = "commit_timeout=3"

    def test_late_rank(self):
        """The last rank commits after the others gave up: its commit is a
        round of its own, which fails in turn, naming the others."""
        n = self.N
        name = "t-late"
        items = self.small()
        stage(self.world, name, items)
        res = commit_all(self.world, name, ranks=range(n - 1), timeout=120)
        self.assertFailedEverywhere(name, res, None, [n - 1], ranks=range(n - 1))
        t0 = time.monotonic()
        late = commit_all(self.world, name, ranks=[n - 1], timeout=120)
        self.assertGreaterEqual(time.monotonic() - t0, self.TIMEOUT * 0.9)
        e = late[n - 1][0]
        self.assertIsInstance(e, OSError, repr(e))
        self.assertEqual(e.errno, errno.EIO)
        st = status(self.ck(n - 1, name))
        self.assertEqual(st.split("\n", 1)[0], "failed")
        for r in range(n - 1):
            self.assertNamesRank(st, r)
        self.assertNothingPublished(name)
        # all together now: the same checkpoint commits
        self.assertCommitted(commit_all(self.world, name))
        self.verify(self.world, name, items, n, partial=False)

    def test_two_ranks_missing(self):
        self.missing("t-two", [1, 2])


class TimingTcp2(TimeoutMixin, WorldTestCase):
    """2 ranks over TCP: commit_timeout, different names, replica_check=warn,
    async."""

    N, TRANSPORT = 2, "tcp"
    OPTS = "commit_timeout=3,replica_check=warn"

    def test_different_names_at_once(self):
        items = self.small()
        stage(self.world, "d-a", items)
        stage(self.world, "d-b", items)
        res = commit_all(self.world, {0: "d-a", 1: "d-b"})
        for r, name in ((0, "d-a"), (1, "d-b")):
            self.assertIsInstance(res[r][0], OSError, f"rank {r}: {res[r]!r}")
            self.assertEqual(res[r][0].errno, errno.EIO)
            st = status(self.ck(r, name))
            self.assertEqual(st.split("\n", 1)[0], "failed")
            self.assertIn("d-a", st)
            self.assertIn("d-b", st)
            self.assertNamesRank(st, 0)
            self.assertNamesRank(st, 1)
        self.assertNothingPublished("d-a")
        self.assertNothingPublished("d-b")
        self.assertCommitted(commit_all(self.world, "d-b"))
        self.assertCommitted(commit_all(self.world, "d-a"))
        self.verify(self.world, "d-a", items, 2, partial=False)

    def test_status_says_what_a_commit_waits_for(self):
        """.status of a commit names the ranks it waits for (coordinator)
        and whom a client waits for, with the time left; issue 12 #8."""
        items = self.small()
        stage(self.world, "wait-a", items)
        out = {}
        t = threading.Thread(target=lambda: out.update(
            commit_all(self.world, "wait-a", ranks=[0], timeout=60)), daemon=True)
        t.start()
        st = ""
        deadline = time.monotonic() + 10
        # "waiting for its turn" may come first (the mount still ends an
        # earlier test's save): wait for the commit's own wait
        while "waiting for rank" not in st and time.monotonic() < deadline:
            st = status(self.ck(0, "wait-a"))
            time.sleep(0.02)
        self.assertEqual(st.split("\n", 1)[0], "committing", st)
        self.assertRegex(st, r"waiting for rank 1 to commit this checkpoint "
                             r"\(commit_timeout\), [0-3] s left", st)
        self.assertNotIn("rank 0 ", st.split("waiting for", 1)[1])
        t.join(60)
        self.assertEqual(out[0][0].errno, errno.EIO)
        # a client alone: it waits for the coordinator
        stage(self.world, "wait-b", items)
        t = threading.Thread(target=lambda: out.update(
            commit_all(self.world, "wait-b", ranks=[1], timeout=60)), daemon=True)
        t.start()
        st = ""
        deadline = time.monotonic() + 10
        while "waiting for rank" not in st and time.monotonic() < deadline:
            st = status(self.ck(1, "wait-b"))
            time.sleep(0.02)
        self.assertIn("waiting for rank 0 (the coordinator)", st)
        self.assertRegex(st, r", \d+ s left")
        t.join(60)
        self.assertEqual(out[1][0].errno, errno.EIO)
        st = status(self.ck(1, "wait-b"))
        self.assertEqual(st.split("\n", 1)[0], "failed", st)
        self.assertNotIn("waiting for", st)
        self.assertCommitted(commit_all(self.world, "wait-b"))

    def test_replica_warn(self):
        name = "r-warn"
        t = Tensor("rep/w", "float32", [6], {0: None}, seed=1)
        odd = Tensor("rep/w", "float32", [6], {1: None}, seed=2)
        b0 = Blob("extra/notes", {0: b"rank zero"})
        b1 = Blob("extra/notes", {1: b"rank one!"})
        stage(self.world, name, [t, odd, b0, b1])
        self.assertCommitted(commit_all(self.world, name))
        got = read_all(self.ck(1, name, "rep/w"))
        self.assertIn(got, (t.data, odd.data))
        for r in range(2):
            self.assertEqual(read_all(self.ck(r, name, "rep/w")), got)
            self.assertIn(read_all(self.ck(r, name, "extra/notes")), (b"rank zero", b"rank one!"))
        db = os.path.join(self.ck(0, name), ".metadata")
        self.assertEqual(query(db, "select count(*) from chunks where fqn='rep.w'"), [(1,)])
        self.assertEqual(query(db, "select count(*) from blobs where fqn='extra.notes'"), [(1,)])
        self.assertIn("rep.w", read_log(self.world.log), "no warning about rep.w in the log")

    def test_async(self):
        n = self.N
        t = Tensor("model/x", "int16", [1000, 64],
                   {r: ([o, 0], [s, 64]) for r, (o, s) in enumerate(split(1000, n))})
        stage(self.world, "as-1", [t])
        res = commit_all(self.world, "as-1", mode="async", ranks=[0])
        self.assertCommitted(res, ranks=[0])
        self.assertEqual(state(self.ck(0, "as-1")), "committing")
        commit(self.ck(1, "as-1"), "async")
        for r in range(n):
            self.assertEqual(wait_state(self.ck(r, "as-1")).split("\n", 1)[0], "committed")
        self.verify(self.world, "as-1", [t], n)


class StopOneRankTcp3(WorldTestCase):
    """SIGTERM stops one rank of a running world (3 ranks over TCP): its
    mount goes away at once, and the others go on."""

    N, TRANSPORT = 3, "tcp"
    OPTS = "commit_timeout=3"

    def test_sigterm_one_rank(self):
        n, w = self.N, self.world
        big = Tensor("model/big", "float32", [3 * 512, 1024],
                     {r: ([512 * r, 0], [512, 1024]) for r in range(n)})
        stage(w, "x", [big])
        self.assertCommitted(commit_all(w, "x", mode="async"))
        pid = rank_pid(w, 2)
        self.assertIsNotNone(pid, "no process of rank 2")
        os.kill(pid, signal.SIGTERM)
        # the save in flight finishes everywhere
        for r in range(n - 1):
            st = wait_state(self.ck(r, "x"), timeout=60)
            self.assertEqual(st.split("\n", 1)[0], "committed", f"rank {r}: {st!r}")
        self.assertTrue(os.path.exists(self.bk("x", ".metadata")))
        # the stopped rank's mount goes away, although its process may stay
        # (MPI_Finalize waits for the other ranks)
        deadline = time.monotonic() + 20
        while mountinfo_has(w.mnt(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(mountinfo_has(w.mnt(2)),
                         "rank 2 is still mounted 20 s after SIGTERM")
        # the others go on: a commit fails naming the stopped rank
        t = Tensor("w", "float32", [n, 2], {r: ([r, 0], [1, 2]) for r in range(n)})
        stage(w, "y", [t], ranks=range(n - 1))
        res = commit_all(w, "y", ranks=range(n - 1), timeout=120)
        self.assertFailedEverywhere("y", res, None, [2], ranks=range(n - 1))
        self.verify(w, "x", [big], n, partial=False, ranks=range(n - 1))

    def test_sigterm_coordinator(self):
        """SIGTERM stops rank 0 (in a world of its own) while the others
        wait for it in a commit, and the others commit again later: each
        time their commits fail at once, naming rank 0, not after
        commit_timeout (30 s) or the clients' longer wait."""
        n = self.N
        w = self.new_world(n, "tcp", "commit_timeout=30", "coord")
        w.start()
        t = Tensor("w", "float32", [n, 2], {r: ([r, 0], [1, 2]) for r in range(n)})
        stage(w, "z1", [t])
        stage(w, "z2", [t], ranks=range(1, n))
        out = {}
        waiting = threading.Thread(target=lambda: out.update(
            commit_all(w, "z1", ranks=range(1, n), timeout=200)), daemon=True)
        t0 = time.monotonic()
        waiting.start()
        time.sleep(1)  # rank 0 now runs a round without its own save
        pid = rank_pid(w, 0)
        self.assertIsNotNone(pid, "no process of rank 0")
        os.kill(pid, signal.SIGTERM)
        waiting.join(200)
        self.assertLess(time.monotonic() - t0, 25, "the commits waited for commit_timeout")
        deadline = time.monotonic() + 20
        while mountinfo_has(w.mnt(0)) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(mountinfo_has(w.mnt(0)), "rank 0 is still mounted 20 s after SIGTERM")
        for name, res in (("z1", out), ("z2", None)):
            if res is None:
                t0 = time.monotonic()
                res = commit_all(w, name, ranks=range(1, n), timeout=200)
                self.assertLess(time.monotonic() - t0, 25, "the commits waited")
            self.assertEqual(sorted(res), list(range(1, n)))
            for r in range(1, n):
                e = res[r][0]
                self.assertIsInstance(e, OSError, f"rank {r} {name}: {e!r}")
                self.assertEqual(e.errno, errno.EIO)
                st = status(self.ck(r, name, world=w))
                self.assertEqual(st.split("\n", 1)[0], "failed", st)
                self.assertIn("stopped", st)
                self.assertNamesRank(st, 0)
            self.assertFalse(os.path.exists(self.bk(name, ".metadata")))
        self.assertEqual(w.stop(), 0)

    def test_sigterm_during_sync_commit(self):
        """SIGTERM to a rank's daemon while sync commits are being written:
        the save finishes and every writer gets its real outcome (committed),
        not ENOTCONN; issue 12 #7."""
        n = self.N
        w = self.new_world(n, "tcp", "commit_timeout=30", "sigsync")
        w.start()
        for victim in (2, 0):
            name = f"sig{victim}"
            big = Tensor("model/big", "float32", [n * 1024, 4096],
                         {r: ([1024 * r, 0], [1024, 4096]) for r in range(n)})
            stage(w, name, [big])
            out = {}
            t = threading.Thread(target=lambda: out.update(commit_all(w, name, timeout=200)),
                                 daemon=True)
            t.start()
            deadline = time.monotonic() + 30
            while (time.monotonic() < deadline and
                   status(self.ck(victim, name, world=w)).split("\n", 1)[0] == "staging"):
                time.sleep(0.005)
            pid = rank_pid(w, victim)
            self.assertIsNotNone(pid)
            os.kill(pid, signal.SIGTERM)
            t.join(200)
            self.assertEqual(sorted(out), list(range(n)))
            for r in range(n):
                self.assertIsNone(out[r][0], f"{name}: rank {r}: {out[r]!r}")
            self.assertTrue(os.path.exists(self.bk(name, ".metadata")))
            self.assertEqual(w.stop(), 0)
            w = self.new_world(n, "tcp", "commit_timeout=30", f"sigsync{victim}")
            w.start()
            self.verify(w, name, [big], n, partial=False)
        self.assertEqual(w.stop(), 0)

    def assertNothingPublished(self, name):
        d = self.bk(name)
        self.assertFalse(os.path.exists(os.path.join(d, ".metadata")), d)


if __name__ == "__main__":
    util.main()

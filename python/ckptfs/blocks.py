"""ckptfs.blocks - reading a block of a committed tensor: the contiguous
runs of a block of a row-major tensor, its block file (`.NAME[a:b,c:d]`,
docs/committed.md), and preads of IO_STEP bytes at most per call. The
client's load and ckptfs.dcp's Reader and export read through it."""

import errno
import math
import os
import sqlite3
import threading
import urllib.parse

from .dtypes import parse_dims
from .errors import CkptfsError, CkptfsIOError

IO_STEP = 8 << 20  # bytes per write/pread call
SHARD_MIN = 64 << 10  # one run read through its block file from this size


def pread_into(fd, mv, offset, path):
    """Fill memoryview mv from offset of fd."""
    pos = 0
    while pos < len(mv):
        try:
            n = os.preadv(fd, [mv[pos:pos + IO_STEP]], offset + pos)
        except OSError as e:
            raise CkptfsIOError(e.errno, f"reading {path} at offset {offset + pos}: "
                                f"{e.strerror}") from e
        if n == 0:
            raise CkptfsError(f"{path}: file ends at byte {offset + pos}, "
                              f"{offset + len(mv)} expected")
        pos += n


def runs(global_shape, offsets, sizes):
    """(element offset in the global tensor, element count) of the contiguous
    runs of block (offsets, sizes) of a row-major tensor, in the block's
    row-major order."""
    n = len(global_shape)
    if n == 0:
        yield 0, 1
        return
    if any(s == 0 for s in sizes):
        return
    # d: the last dimension the block does not span whole; runs cover
    # sizes[d] x the full extent of every later dimension
    d = n - 1
    while d > 0 and sizes[d] == global_shape[d] and offsets[d] == 0:
        d -= 1
    strides = [math.prod(global_shape[i + 1:]) for i in range(n)]
    run = sizes[d] * strides[d]
    idx = [0] * d
    while True:
        flat = sum((offsets[i] + idx[i]) * strides[i] for i in range(d))
        yield flat + offsets[d] * strides[d], run
        i = d - 1
        while i >= 0:
            idx[i] += 1
            if idx[i] < sizes[i]:
                break
            idx[i] = 0
            i -= 1
        if i < 0:
            return


def block_file(path, offsets, sizes):
    """The block file of a committed tensor at path: the block (offsets,
    sizes) as one file, `.NAME[a:b,c:d]` beside it (docs/committed.md)."""
    d, base = os.path.split(path)
    sl = ",".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes))
    return os.path.join(d, f".{base}[{sl}]")


class StoredChunks:
    """How a committed checkpoint stores its tensors, from its .metadata:
    a tensor's chunks [(offsets, sizes)], looked up one tensor at a time
    (by FQN: the chunks table's index) when a load reads part of it, and
    kept. None to read (not a ckptfs checkpoint, a row it cannot parse):
    [], and the loaders read as they would without it. Thread-safe; close()
    when the load is done."""

    def __init__(self, ckdir):
        self.path = os.path.join(ckdir, ".metadata")
        self._lock = threading.Lock()
        self._con = None
        self._tried = False
        self._fqns = None  # tensor path: FQN (of_path)
        self._memo = {}

    def _db(self):  # under _lock
        if not self._tried:
            self._tried = True
            uri = f"file:{urllib.parse.quote(self.path)}?mode=ro&immutable=1"
            try:
                self._con = sqlite3.connect(uri, uri=True, check_same_thread=False)
            except sqlite3.Error:
                self._con = None
        return self._con

    def _query(self, sql, args):  # under _lock
        con = self._db()
        try:
            return con.execute(sql, args).fetchall() if con else []
        except sqlite3.Error:
            return []

    def of_fqn(self, fqn):
        with self._lock:
            if fqn not in self._memo:
                out = []
                for offs, sizes in self._query(
                        "SELECT offsets, sizes FROM chunks WHERE fqn = ?", (fqn,)):
                    try:
                        out.append((parse_dims(offs), parse_dims(sizes)))
                    except (ValueError, TypeError, UnicodeDecodeError):
                        out = []  # unreadable: none (the old path reads it)
                        break
                self._memo[fqn] = out
            return self._memo[fqn]

    def of_path(self, rel):
        """The chunks of the tensor file at rel (relative to the checkpoint)."""
        with self._lock:
            if self._fqns is None:
                self._fqns = dict(self._query("SELECT path, fqn FROM tensors", ()))
            fqn = self._fqns.get(rel)
        return self.of_fqn(fqn) if fqn is not None else []

    def close(self):
        with self._lock:
            if self._con is not None:
                self._con.close()
            self._con = None


def holding_chunk(chunks, offsets, sizes):
    """The stored chunk (offsets, sizes) of chunks that holds the whole
    block (offsets, sizes), or None."""
    for co, cs in chunks or ():
        if len(co) == len(cs) == len(offsets) and all(
                c <= o and o + s <= c + n for o, s, c, n in zip(offsets, sizes, co, cs)):
            return co, cs
    return None


def read_in_chunk(path, item, global_shape, offsets, sizes, mv, chunks):
    """Read a block that is one run inside one stored chunk, and not that
    chunk, from the chunk's own file (the tensor file where the chunk is the
    whole tensor, else the chunk's block file) at the run's offset in it:
    the mount serves such a file by passthrough where the chunk is a whole
    data file (written once), so a rank reading part of another rank's
    chunk (a load at another world size) does not go through the daemon.
    True if read, False where this does not apply."""
    held = holding_chunk(chunks, offsets, sizes)
    if held is None or held[1] == tuple(sizes) or len(mv) < SHARD_MIN:
        return False
    co, cs = held
    inner = list(runs(cs, [o - c for o, c in zip(offsets, co)], sizes))
    if len(inner) != 1:
        return False  # several runs: the block file of the block gathers them
    whole = tuple(cs) == tuple(global_shape)
    try:
        fd = os.open(path if whole else block_file(path, co, cs), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:  # no block files here, or a name too long for one
        if e.errno not in (errno.ENOENT, errno.ENAMETOOLONG):
            raise
        return False
    try:
        pread_into(fd, mv, inner[0][0] * item, path)
    finally:
        os.close(fd)
    return True


def read_block(path, item, global_shape, offsets, sizes, mv, chunks=None):
    """Read block (offsets, sizes) of the global tensor at path, of
    elements of item bytes, into mv (the block's bytes, row-major): one
    read of its block file, or one pread of the tensor's file for the whole
    tensor or a small run; part of one stored chunk (chunks: the tensor's
    [(offsets, sizes)], StoredChunks'), from that chunk's file;
    one pread per run where the mount has no block files (an older
    ckptfs, or a name too long for one)."""
    offsets, sizes = tuple(offsets), tuple(sizes)
    if chunks and read_in_chunk(path, item, global_shape, offsets, sizes, mv, chunks):
        return
    block = runs(global_shape, offsets, sizes)
    first = next(block, None)
    several = first is not None and next(block, None) is not None
    whole = tuple(sizes) == tuple(global_shape)
    # through its block file: several runs (gathered by the daemon in few
    # reads), or one large run that is not the whole tensor: a rank's
    # shard, which the mount serves straight from its data file
    # (passthrough) where that file holds just this chunk
    if several or (first is not None and not whole and len(mv) >= SHARD_MIN):
        try:
            fd = os.open(block_file(path, offsets, sizes), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:  # no block files here, or a name too long for one
            if e.errno not in (errno.ENOENT, errno.ENAMETOOLONG):
                raise
            fd = None
        if fd is not None:
            try:
                pread_into(fd, mv, 0, path)
            finally:
                os.close(fd)
            return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pos = 0
        for start, count in runs(global_shape, offsets, sizes):
            nbytes = count * item
            pread_into(fd, mv[pos:pos + nbytes], start * item, path)
            pos += nbytes
    finally:
        os.close(fd)



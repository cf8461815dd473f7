"""ckptfs._client - save and load PyTorch / NumPy state dicts through a
ckptfs rank mount, with plain file calls and extended attributes only.

    import ckptfs
    ckptfs.save({"model": model.state_dict(), "optim": opt.state_dict(),
                 "step": step}, "/mnt/ckpt/rank0", "step-100", rank=0)
    sd = ckptfs.load(None, "/mnt/ckpt/rank0", "step-100")          # a new dict
    ckptfs.load({"model": model.state_dict()}, mnt, "step-100")   # in place

The core is the Python standard library; numpy and torch are imported
only when a state dict holds their objects (or a load builds them).

Layout of a save (the ckptfs contract, docs/saving.md):

- Nested dicts become directories: the item at keys ("model",
  "layer0.weight") is the file MOUNT/NAME/model/layer0.weight, FQN
  "model.layer0.weight". Keys are str or int (an optimizer's state is keyed
  by parameter index); a key may not be empty, start with '.', or contain
  '/' or NUL, and the top-level key "_ckptfs" is reserved.
- torch tensors and numpy arrays are tensor chunks: their elements in
  row-major little-endian order, and user.ckpt.dtype / user.ckpt.shape. A
  shard of a larger tensor is given as Shard(local, offsets, global_shape):
  it also gets user.ckpt.offsets and user.ckpt.sizes. Items (tensors or
  not) that several ranks save under the same keys are replicas, stored
  once: their values must be equal on every rank or the commit fails
  (replica_check); give per-rank values per-rank keys ("rng/rank3").
- Every other value is a bytes item: bytes, bytearray and memoryview are
  stored as they are; anything else is pickled (objects="pickle", the
  default) or stored as UTF-8 JSON (objects="json", for values JSON can
  hold; JSON turns tuples into lists).
- How a loader tells them apart: a file with user.ckpt.dtype is a tensor;
  for the rest, each rank writes a manifest bytes item
  NAME/_ckptfs/rank<R>.json (JSON) that gives, for every file it saved, its
  original key path (with key types) and its kind: "torch", "numpy",
  "bytes", "pickle" or "json". A checkpoint written by other tools has no
  manifest: its tensors load as numpy arrays (torch tensors for dtypes numpy
  lacks, such as bfloat16) and its other files as bytes.

Saving a committed name again: overwrite=True stages the new version under
a working name (NAME.replace-TOKEN) and commits it with replace=NAME, which
publishes it as NAME in one atomic step for every mount (see "replacing a
committed checkpoint" below); without it the save is refused. solo=True:
one rank saves NAME alone, as a checkpoint of world size 1 (configs,
tokenizers, what only rank 0 writes).

Loading unpickles bytes items of kind "pickle": load only checkpoints you
trust, or pass allow_pickle=False (such items then raise).

Errors: a failed commit raises CommitError with the reason ckptfs gives in
NAME/.status; a missing checkpoint or item, a shape or dtype that does not
match, or an unsupported dtype raise with a message naming the item. A
rank whose save raises before it commits aborts the save on every rank at
once (_abort_save), and every rank discards what it staged.
"""


import errno
import hashlib
import json
import math
import os
import pickle
import re
import stat
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from . import job

__all__ = ["save", "async_save", "StagingBuffers", "load", "wait", "status",
           "commit", "Shard", "CommitError", "CkptfsError", "DTYPES"]

MANIFEST_DIR = "_ckptfs"
META_XATTR = "user.ckpt.meta"  # several user.ckpt.* xattrs in one setxattr
ABORT_ITEM = "_ckptfs_abort"   # the item a rank commits to abort a save (_abort_commit)
FORMAT = 1
IO_STEP = 8 << 20  # bytes per write/pread call

# ckptfs dtype -> itemsize
DTYPES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
# ckptfs dtype -> numpy dtype name (little-endian); bfloat16 and float8 have none
NUMPY_NAMES = {
    "bool": "bool", "uint8": "u1", "int8": "i1", "int16": "<i2",
    "int32": "<i4", "int64": "<i8", "float16": "<f2", "float32": "<f4",
    "float64": "<f8", "complex64": "<c8", "complex128": "<c16",
}


class CkptfsError(Exception):
    """A ckptfs save or load that cannot go on; the message says why."""


class CkptfsIOError(CkptfsError, OSError):
    """A read or write of a ckptfs file failed: an OSError too (errno
    kept, e.g. EIO for a damaged chunk), with the file in the message."""


class CommitError(CkptfsError):
    """A commit failed; .status holds the reason ckptfs gave. discarded:
    the staged checkpoint was discarded (a save that another rank aborted,
    or ckptfs.dcp's saves), else it stays staged for a fix and a retry.
    api: whose save it was ("client": ckptfs.save and friends; "dcp":
    ckptfs.dcp.Writer), for advice that applies to the caller."""

    def __init__(self, name, status_text, path=None, discarded=False, api="client"):
        self.name = name
        self.status = status_text
        self.path = path
        self.discarded = discarded
        self.api = api
        lines = [ln for ln in status_text.splitlines() if ln.strip()]
        reason = "; ".join(lines[1:]) if len(lines) > 1 else status_text.strip()
        where = f" ({path})" if path else ""
        what = "checkpoint_id" if api == "dcp" else "name"
        if status_text.startswith("committed\n"):
            # lost to another save of the name: that one is NAME now, on
            # this mount too (rm -r would remove it for every mount)
            lost = [ln[len("lost: "):] for ln in lines if ln.startswith("lost: ")]
            super().__init__(f"commit of checkpoint {name!r} failed{where}: "
                             f"{lost[0] if lost else reason}. Save under another {what}.")
            return
        if discarded:
            then = ("the staged checkpoint was discarded on every rank, so the "
                    f"same {what} can be saved again.")
        elif api == "dcp":
            then = ("this rank's staged checkpoint stays (failed); the next "
                    "dcp.save of this checkpoint_id discards it first.")
        else:
            then = ("the checkpoint stays staged on every rank: fix what the "
                    "reason names and save again with exist_ok=True, or discard "
                    "it with rm -r.")
        super().__init__(f"commit of checkpoint {name!r} failed{where}: {reason}. "
                         f"Nothing was published; {then}{_advice(reason, api)}")

    def __reduce__(self):
        # DCP pickles a rank's exception to send it to the coordinator: keep
        # the constructor's arguments, not the formatted message.
        return (type(self), (self.name, self.status, self.path, self.discarded, self.api))


# ckptfs's reason for replicas of one item whose bytes differ (planner/plan.c)
_REPLICAS_DIFFER = re.compile(r"\breplicas (of chunk .*)?differ: ")


def _advice(reason, api):
    """What the caller can do about the reason of a failed commit, in the
    terms of its own API ("" when there is nothing particular to say)."""
    if not _REPLICAS_DIFFER.search(reason):
        return ""
    why = (" Every rank that saves a key saves a replica of it, and ckptfs "
           "stores a replicated item once, only when every copy has the same "
           "bytes: give a value that differs by rank a key of its own on each "
           'rank (e.g. f"rank{rank}.x")')
    if api == "dcp":
        return (why + ', or save with ckptfs.dcp.Writer(mount, replicas="dedup") '
                "to store only the copy DCP's planner picks, as stock DCP does "
                "(or mount with -o replica_check=warn).")
    return (why + ", or put such a key in one rank's state dict only (or mount "
            "with -o replica_check=warn).")


class Shard:
    """A local shard of a larger tensor: `tensor` (torch tensor or numpy
    array) holds the block of the global tensor that starts at `offsets`;
    `global_shape` is the whole tensor's shape. Saved as one chunk; given to
    load(), only its byte ranges are read (resharding)."""

    __slots__ = ("tensor", "offsets", "global_shape")

    def __init__(self, tensor, offsets, global_shape):
        self.tensor = tensor
        self.offsets = tuple(int(o) for o in offsets)
        self.global_shape = tuple(int(s) for s in global_shape)
        shape = tuple(tensor.shape)
        if not (len(self.offsets) == len(self.global_shape) == len(shape)):
            raise ValueError(f"Shard: offsets {self.offsets}, global shape "
                             f"{self.global_shape} and the local shape {shape} "
                             "must have the same number of dimensions")
        for o, s, g in zip(self.offsets, shape, self.global_shape):
            if o < 0 or o + s > g:
                raise ValueError(f"Shard: the block at offsets {self.offsets} "
                                 f"of shape {shape} is outside the global "
                                 f"shape {self.global_shape}")

    def __repr__(self):
        return (f"Shard(shape={tuple(self.tensor.shape)}, offsets={self.offsets}, "
                f"global_shape={self.global_shape})")


# ---- tensors: torch and numpy, imported lazily ---------------------------------

def _is_torch(x):
    t = sys.modules.get("torch")
    return t is not None and isinstance(x, t.Tensor)


def _is_numpy(x):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, (np.ndarray, np.generic))


def _is_tensor(x):
    return isinstance(x, Shard) or _is_torch(x) or _is_numpy(x)


def _torch_dtype_name(dt):
    name = str(dt).replace("torch.", "")
    if name not in DTYPES:
        raise CkptfsError(f"torch dtype {dt} has no ckptfs dtype (ckptfs has: "
                          f"{', '.join(DTYPES)}); convert the tensor first")
    return name


def _numpy_dtype_name(dt):
    np = sys.modules["numpy"]
    for name, npname in NUMPY_NAMES.items():
        if np.dtype(npname) == dt.newbyteorder("<") or np.dtype(npname) == dt:
            return name
    raise CkptfsError(f"numpy dtype {dt} has no ckptfs dtype (ckptfs has: "
                      f"{', '.join(NUMPY_NAMES)}); convert the array first, "
                      "or save it as bytes")


def _torch_module():
    try:
        import torch
    except ImportError as e:
        raise CkptfsError("this item was saved as a torch tensor (or has a dtype "
                          "only torch has), but torch cannot be imported: "
                          f"{e}") from e
    return torch


def _numpy_module():
    try:
        import numpy
    except ImportError as e:
        raise CkptfsError(f"loading tensors needs numpy or torch: {e}") from e
    return numpy


def _torch_numpy_view(t):
    """A numpy array sharing t's memory (t on the CPU, contiguous); dtypes
    numpy lacks are viewed as integers of their size. The bytes are the
    host's: ckptfs stores little-endian, hence the check."""
    if sys.byteorder != "little":
        raise CkptfsError("torch tensors are moved as raw host bytes, and this "
                          "host is big-endian; ckptfs stores little-endian")
    torch = sys.modules["torch"]
    t = t.detach()
    name = _torch_dtype_name(t.dtype)
    if name in NUMPY_NAMES:
        return t.numpy()
    carrier = {1: torch.uint8, 2: torch.int16}[DTYPES[name]]
    return t.view(carrier).numpy()


def _tensor_info(x):
    """(ckptfs dtype, shape, byte buffer of the elements in row-major
    little-endian order, kind) of a torch tensor or numpy array."""
    if _is_torch(x):
        name = _torch_dtype_name(x.dtype)
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        arr = _torch_numpy_view(t)
        return name, tuple(x.shape), memoryview(arr.reshape(-1)).cast("B"), "torch"
    np = sys.modules["numpy"]
    arr = np.asarray(x)
    name = _numpy_dtype_name(arr.dtype)
    shape = tuple(arr.shape)   # ascontiguousarray makes a 0-d array 1-d
    arr = np.ascontiguousarray(arr, dtype=np.dtype(NUMPY_NAMES[name]))
    return name, shape, memoryview(arr.reshape(-1)).cast("B"), "numpy"


# ---- file calls -----------------------------------------------------------------

def _write_fd(fd, mv, path):
    """Write all of memoryview mv to fd, IO_STEP bytes per call."""
    pos = 0
    while pos < len(mv):
        try:
            pos += os.write(fd, mv[pos:pos + IO_STEP])
        except OSError as e:
            raise CkptfsIOError(e.errno, f"writing {path}: {e.strerror}") from e


def _write_all(path, buf):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        _write_fd(fd, memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf,
                  path)
    finally:
        os.close(fd)


class _StagingDirs:
    """The directories of a checkpoint being staged, held open (O_PATH) by
    path relative to it, so that a file is created relative to its
    directory: the kernel caches no staged entry, so a full path costs
    one FUSE LOOKUP per component, a name under a held directory one.
    make() runs on the caller's thread and holds the directory for one
    write_file() (on any thread), which lets it go. At most HELD
    directories stay open (the least recently made ones that no file
    holds are closed: a model has thousands). close() at the end."""

    _FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
    HELD = 64

    def __init__(self, ckdir):
        self.ckdir = ckdir
        self.lock = threading.Lock()
        self.fds = {"": os.open(ckdir, self._FLAGS)}  # oldest first
        self.holds = {}  # rel_dir: files made for and not written yet
        self.meta = True  # the mount takes user.ckpt.meta (until it says ENOTSUP)

    def make(self, rel_dir):
        """mkdir -p of rel_dir (relative to the checkpoint), held for one
        write_file."""
        self._open(rel_dir)
        with self.lock:
            self.holds[rel_dir] = self.holds.get(rel_dir, 0) + 1

    def _open(self, rel_dir):
        with self.lock:
            fd = self.fds.pop(rel_dir, None)
            if fd is not None:
                self.fds[rel_dir] = fd  # the most recent now
                return fd
        parent, base = os.path.split(rel_dir)
        pfd = self._open(parent)
        try:
            os.mkdir(base, dir_fd=pfd)
        except FileExistsError:
            pass
        fd = os.open(base, self._FLAGS, dir_fd=pfd)
        with self.lock:
            self.fds[rel_dir] = fd
            idle = [d for d in self.fds if d and d != rel_dir and not self.holds.get(d)]
            for d in idle[:max(0, len(self.fds) - self.HELD)]:
                os.close(self.fds.pop(d))
        return fd

    def write_file(self, rel, buf, xattrs=(), flags=os.O_TRUNC):
        """Create rel (its directory made by make()), set xattrs on the
        open file, write buf, close: LOOKUP, CREATE, one SETXATTR, WRITEs,
        FLUSH (then RELEASE, which close does not wait for)."""
        d, base = os.path.split(rel)
        try:
            with self.lock:
                dfd = self.fds[d]
            fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, 0o644,
                         dir_fd=dfd)
        finally:
            with self.lock:
                self.holds[d] -= 1
        try:
            self._set_xattrs(fd, xattrs)
            mv = memoryview(buf)
            if mv.format != "B" or mv.ndim != 1:
                mv = mv.cast("B")
            _write_fd(fd, mv, os.path.join(self.ckdir, rel))
            return len(mv)
        finally:
            os.close(fd)

    def _set_xattrs(self, fd, xattrs):
        """xattrs [(user.ckpt.KEY, bytes)] set on fd in one user.ckpt.meta
        ("KEY=VALUE;...", fqn last: its value runs to the end), else (a
        mount older than it) one by one."""
        if len(xattrs) > 1 and self.meta:
            fields = sorted(xattrs, key=lambda kv: kv[0] == "user.ckpt.fqn")
            value = b";".join(k[len("user.ckpt."):].encode() + b"=" + bytes(v)
                              for k, v in fields)
            try:
                os.setxattr(fd, META_XATTR, value)
                return
            except OSError as e:
                if e.errno != errno.ENOTSUP:
                    raise
                self.meta = False
        for k, v in xattrs:
            os.setxattr(fd, k, v)

    def close(self):
        with self.lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _pread_into(fd, mv, offset, path):
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


class _Stager:
    """Runs staging writes on `threads` threads (write(2) releases the GIL,
    and the daemon serves each file on its own thread and stream: one
    writer leaves the mount's daemon waiting between requests). At most
    2 x threads writes are queued or running: submit waits for room, so
    that buffers made for them (copies of GPU or strided tensors) are not
    all held at once. The first error is raised by done(), after every
    started write has ended."""

    def __init__(self, threads):
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, not {threads!r}")
        self.pool = ThreadPoolExecutor(threads) if threads > 1 else None
        self.room = threading.BoundedSemaphore(2 * threads)
        self.futures = []
        self.failed = None  # the first error of a write, once one failed

    def _run(self, fn, args):
        try:
            return fn(*args)
        except BaseException as e:  # noqa: B036 (kept, and re-raised)
            if self.failed is None:
                self.failed = e
            raise
        finally:
            self.room.release()

    def submit(self, fn, *args):
        """Run fn(*args) on a staging thread; raises the first failed
        write's error instead once one failed (staging stops early)."""
        if self.pool is None:
            return fn(*args)
        self.room.acquire()
        if self.failed is not None:
            self.room.release()
            raise self.failed
        try:
            self.futures.append(self.pool.submit(self._run, fn, args))
        except BaseException:
            self.room.release()
            raise
        return None

    def done(self):
        """Wait for every submitted write; raise the first error."""
        if self.pool is None:
            return
        try:
            for f in self.futures:
                f.exception()  # waits
            if self.failed is not None:
                raise self.failed
        finally:
            self.pool.shutdown()

    def abandon(self):
        """After an error in the caller: wait for what was started."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _csv(xs):
    return ",".join(str(int(v)) for v in xs).encode()


def _parse_dims(value):
    s = value.decode().strip().strip("[]")
    return tuple(int(v) for v in s.replace(" ", "").split(",") if v != "")


def _read_text(path):
    with open(path) as f:
        return f.read()


def mount_gone(path):
    """What a dead ckptfs mount at path is, in words."""
    return (f"the ckptfs mount at {path} is gone (ENOTCONN): its daemon exited; "
            "see its log")


def check_dir(mount, who=""):
    """CkptfsError (prefixed by who) unless mount is a directory this
    process can use: a ckptfs mount whose daemon exited (stat gives
    ENOTCONN, or ECONNABORTED once its connection was aborted) is named as
    a dead mount, not as a path that is no directory."""
    try:
        st = os.stat(mount)
    except OSError as e:
        if e.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            raise CkptfsError(who + mount_gone(mount)) from None
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise CkptfsError(f"{who}cannot use {mount}: {e.strerror}") from None
        st = None
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise CkptfsError(f"{who}{mount} is not a directory (is the rank's ckptfs "
                          "mounted there? mount it with ckptfs or "
                          "mount-scripts/ckpt-mount)")


def mount_world(mount):
    """(rank, world_size) of the ckptfs mount at mount, from the xattrs
    user.ckpt.rank and user.ckpt.world_size of its root; None when it has
    none (not a ckptfs mount, or a daemon older than these xattrs)."""
    try:
        return (int(os.getxattr(mount, "user.ckpt.rank")),
                int(os.getxattr(mount, "user.ckpt.world_size")))
    except (OSError, ValueError):
        return None


def _ranks(n):
    return f"{n} rank{'s' * (n != 1)}"


def world_mismatch(mount, rank, world_size=None, saving=False):
    """Why this process (rank, None when unknown; world_size when known)
    must not use the ckptfs mount at mount, or None when it may. Checked
    before anything is staged: a save into another world's mount would
    wait commit_timeout for ranks that never come, or write one rank's part
    into another's mount. saving: refuse a directory no ckptfs serves too
    (a rank beyond the world: a save there can never commit)."""
    w = mount_world(mount)
    if w is None:
        return _not_a_mount(mount, rank, world_size) if saving else None
    mrank, msize = w
    if world_size is not None and world_size != msize:
        return (f"the trainer runs {_ranks(world_size)} but {mount} belongs to a "
                f"ckptfs world of {_ranks(msize)} (mount it with {world_size} ranks, "
                f"e.g. mpirun -np {world_size} ckptfs ...)")
    if rank is not None and int(rank) != mrank:
        return (f"rank {int(rank)} uses {mount}, the mount of rank {mrank} of a "
                f"ckptfs world of {_ranks(msize)} (give each "
                "rank its own mount: the path with %r, or rank= the mount's rank)")
    return None


def _fs_type(path):
    """The type of the filesystem path is on (/proc/self/mountinfo), or None."""
    path, best, kind = os.path.realpath(path), "", None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
                    best, kind = mp, fields[fields.index("-") + 1]
    except (OSError, ValueError, IndexError):
        return None
    return kind


def _not_a_mount(mount, rank, world_size):
    """Why a save must not go into mount when it is no ckptfs mount (a
    daemon older than the world xattrs is a ckptfs mount still), naming the
    world of rank 0's mount beside it (MOUNTROOT/rank0 for MOUNTROOT/rankR)
    when there is one."""
    if _fs_type(mount) in ("fuse.ckptfs", None):
        return None
    why = f"{mount} is not a ckptfs mount"
    m = re.fullmatch(r"(.*\D)(\d+)", os.path.normpath(mount))
    first = m.group(1) + "0" if m and rank is not None and int(m.group(2)) == int(rank) else None
    w = mount_world(first) if first and first != os.path.normpath(mount) else None
    if w is not None and world_size is not None and w[1] != world_size:
        return (f"{why}: the trainer runs {_ranks(world_size)} but {first} belongs to "
                f"a ckptfs world of {_ranks(w[1])} (mount it with {world_size} ranks, "
                f"e.g. mpirun -np {world_size} ckptfs ...)")
    return f"{why} (is this rank's ckptfs mounted there?)"


# The launchers' variables, innermost first: torchrun started under srun or
# mpirun inherits the outer launcher's variables (one rank per node), so
# its own RANK/WORLD_SIZE win while TORCHELASTIC_RUN_ID says it is there.
_TORCHRUN = ("RANK", "WORLD_SIZE")
_LAUNCHERS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), _TORCHRUN,
              ("PMI_RANK", "PMI_SIZE"))


def _launchers():
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return (_TORCHRUN,) + tuple(v for v in _LAUNCHERS if v != _TORCHRUN)
    return _LAUNCHERS


def _trainer_world():
    """(rank, world_size) of this process: torch.distributed's when a
    process group is up (without importing torch: the core needs only the
    standard library), else its launcher's (Open MPI, torchrun, PMI), else
    (None, None). Slurm's SLURM_NTASKS is not one: a batch script's single
    process sees the whole allocation's count."""
    tdist = sys.modules.get("torch.distributed")
    try:
        if tdist is not None and tdist.is_available() and tdist.is_initialized():
            return tdist.get_rank(), tdist.get_world_size()
    except Exception:
        pass
    for rank_var, size_var in _launchers():
        r, n = os.environ.get(rank_var, ""), os.environ.get(size_var, "")
        if r.isdigit() and n.isdigit():
            return int(r), int(n)
    return None, None


def trainer_rank():
    """This process's global rank as _trainer_world says, else Slurm's
    SLURM_PROCID (a rank, though SLURM_NTASKS is no world size), else 0."""
    rank = _trainer_world()[0]
    if rank is None:
        v = os.environ.get("SLURM_PROCID", "")
        rank = int(v) if v.isdigit() else 0
    return rank


def _check_world(mount, rank, solo):
    """save()'s world check: the trainer's world size against the mount's
    (none for a solo save: a world of one), and a mount that is no ckptfs
    mount at all."""
    if solo:  # a world of one: any rank's mount, but a ckptfs one
        why = _not_a_mount(mount, None, None) if mount_world(mount) is None else None
    else:
        why = world_mismatch(mount, rank, _trainer_world()[1], saving=True)
    if why:
        raise CkptfsError(why)


def status(mount, name):
    """(state, text) of checkpoint name: state is the first line of
    NAME/.status (staging, committing, committed, failed)."""
    text = _read_text(os.path.join(mount, name, ".status"))
    return text.split("\n", 1)[0].strip(), text


def latest(mount, prefix=""):
    """The name of the newest committed checkpoint in mount (whose name
    starts with prefix), or None: newest by the step retention sees
    (user.ckpt.step: recorded at commit, else the digits of the name),
    then by time. Never a staged, committing or failed one: what a resumed
    job loads."""
    best, best_key = None, None
    for name in os.listdir(mount):
        if name.startswith(".") or not name.startswith(prefix):
            continue
        ckdir = os.path.join(mount, name)
        if _status_of(ckdir)[0] != "committed":
            continue
        try:
            step = int(os.getxattr(ckdir, "user.ckpt.step"))
        except (OSError, ValueError):
            step = -1
        try:
            when = os.stat(ckdir).st_mtime_ns
        except OSError:
            continue
        key = (step, when, name)
        if best_key is None or key > best_key:
            best, best_key = name, key
    return best


_JOB_ALIVE = re.compile(r"^job \d+ alive\b", re.M)


def leftovers(mount, match=None):
    """[(name, state)] of the checkpoints of mount (those whose name
    match(name) accepts; all when None) that are staged or failed with no
    live job writing them: no `job PID alive` line in their .status (the
    daemon shows one while a process that declared itself a job of the
    mount, ckptfs.job, stages it). A killed run's unfinished save, or one
    written by a process that never declared itself (cp, a shell)."""
    out = []
    try:
        names = sorted(os.listdir(mount))
    except OSError:
        return out
    for name in names:
        if name.startswith(".") or (match is not None and not match(name)):
            continue
        st, text = _status_of(os.path.join(mount, name))
        if st in ("staging", "failed") and not _JOB_ALIVE.search(text):
            out.append((name, st))
    return out


def discard_leftovers(mount, match=None):
    """Discard each of leftovers(mount, match) on this rank (rm -r of a
    staged checkpoint: other mounts keep their own parts); [(name,
    state)] of those discarded."""
    return [(name, st) for name, st in leftovers(mount, match)
            if _discard_uncommitted(os.path.join(mount, name))]


def _status_of(ckdir):
    """status() of the checkpoint directory ckdir; ("", "") if unreadable."""
    try:
        text = _read_text(os.path.join(ckdir, ".status"))
    except OSError:
        return "", ""
    return text.split("\n", 1)[0].strip(), text


# ---- save -----------------------------------------------------------------------

def _check_key(k, where):
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise CkptfsError(f"key {k!r} under {where or 'the top level'}: keys must "
                          "be str or int")
    s = str(k)
    if not s or s.startswith(".") or "/" in s or "\0" in s:
        raise CkptfsError(f"key {s!r} under {where or 'the top level'} cannot be a "
                          "file name: it must not be empty, start with '.', or "
                          "contain '/' or NUL")
    return s


def _dtensor_as_shard(x):
    """A torch DTensor as the Shard of this rank's local part (offsets from
    its device mesh and placements; a replicated one is its whole tensor,
    the same on every rank: a replica). Other values unchanged. Loading
    into the Shard reads into the DTensor's local tensor in place."""
    if not _is_torch(x) or type(x).__name__ != "DTensor":
        return x
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _shape, offsets = compute_local_shape_and_global_offset(
        x.shape, x.device_mesh, x.placements)
    return Shard(x.to_local(), offsets, tuple(x.shape))


def _flatten(obj, keys, out):
    """(key path, value) of every leaf: dicts recurse, everything else is a
    leaf (a DTensor becomes the Shard of its local part)."""
    for k, v in obj.items():
        where = "/".join(str(x) for x in keys)
        _check_key(k, where)
        if not keys and str(k) == MANIFEST_DIR:
            raise CkptfsError(f"the top-level key {MANIFEST_DIR!r} is reserved "
                              "for ckptfs.py's manifest")
        path = keys + [k]
        if isinstance(v, dict):
            if not v:
                out.append((path, v))  # an empty dict is kept as an object
            else:
                _flatten(v, path, out)
        else:
            out.append((path, _dtensor_as_shard(v)))
    return out


class _Encoded:
    """A bytes item already encoded (by async_save's snapshot)."""
    __slots__ = ("data", "kind")

    def __init__(self, data, kind):
        self.data, self.kind = data, kind


def _encode_object(v, objects):
    if isinstance(v, _Encoded):
        return v.data, v.kind
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v) if isinstance(v, memoryview) else v, "bytes"
    if objects == "json":
        try:
            return json.dumps(v, allow_nan=True).encode(), "json"
        except (TypeError, ValueError) as e:
            raise CkptfsError(f"cannot store {type(v).__name__} as JSON ({e}); use "
                              "objects='pickle' or bytes") from e
    return pickle.dumps(v, protocol=4), "pickle"


def _check_save_args(state_dict, mount, mode_arg, mode, objects):
    """The checks save() and async_save() make before anything is staged."""
    if mode not in ("sync", "async"):
        raise ValueError(f"{mode_arg} must be 'sync' or 'async', not {mode!r}")
    if objects not in ("pickle", "json"):
        raise ValueError(f"objects must be 'pickle' or 'json', not {objects!r}")
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, not {type(state_dict).__name__}")
    check_dir(mount)


def save(state_dict, mount, name, rank=0, mode="sync", objects="pickle",
         exist_ok=False, threads=4, overwrite=False, solo=False, step=None,
         metrics=None, protect=False):
    """Write state_dict into MOUNT/NAME and commit it.

    mount: this rank's ckptfs mount; name: the checkpoint name
    (any file name not starting with '.'); rank: this rank (names the
    manifest; every rank of the world must call save with the same name);
    mode: "sync" (return once committed and durable everywhere) or "async"
    (return once the staged data is frozen; then wait(mount, name));
    objects: "pickle" or "json" for values that are neither tensors nor bytes;
    exist_ok: when this rank already staged name and did not commit it (e.g.
    the commit failed), discard what is staged and save again;
    overwrite: replace a committed name (it is staged under a working name
    and committed with replace=NAME, on every rank: give every rank the same
    overwrite). False by default, unlike DCP's Writer and Accelerate's
    save_state (ckptfs.dcp, ckptfs.hf), which overwrite as their frameworks
    do: this is ckptfs's own API, whose committed names are write-once
    unless asked, so a save under a name already published raises before
    anything is staged instead of replacing it for every reader;
    solo: this rank alone saves name, as a checkpoint of world size 1 (the
    other ranks do not call save); threads: files written at once (the
    mount's io_threads streams take that many in parallel).
    step, metrics ({"loss": 0.25}) and protect: recorded at the commit for
    retention, as commit() does (step: the trainer's global step, which
    retention and latest() order by; without it the last run of digits in
    NAME counts). Raises CommitError when the commit fails.
    """
    _check_save_args(state_dict, mount, "mode", mode, objects)
    _check_world(mount, rank, solo)
    kept = retention_words(step, metrics, protect)  # bad values raise here
    stager = _Stager(threads)
    words = _save_words(name, overwrite, solo)
    try:
        leaves = _flatten(state_dict, [], [])
    except BaseException:
        _abort_unstaged(mount, name, exist_ok, overwrite, solo)
        raise
    ckdir = _make_checkpoint_dir(mount, name, exist_ok, overwrite, solo)
    if solo:
        rank = 0   # the rank of its world of one
    try:
        manifest = {}
        with _StagingDirs(ckdir) as dirs:
            try:
                _stage_leaves(leaves, dirs, name, objects, manifest, stager)
            except BaseException:
                stager.abandon()
                raise
            stager.done()
            dirs.make(MANIFEST_DIR)
            _stage_file(dirs, f"{MANIFEST_DIR}/rank{int(rank)}.json", name,
                        json.dumps({"format": FORMAT, "rank": int(rank),
                                    "items": manifest}, sort_keys=True).encode())
    except BaseException:
        _abort_save(ckdir, name, words)
        raise
    commit_staged(ckdir, mount, name, mode, words, kept)


def commit_staged(ckdir, mount, name, mode, words, kept=()):
    """Commit what a save staged in ckdir (MOUNT/NAME, or its working name)
    with mode and words, and kept (retention_words: step=N ...); on
    failure leave nothing of it staged where no retry can use it (a
    working name is this save's own), and fail a commit the other ranks
    wait for when this rank stops before it."""
    try:
        _commit_dir(ckdir, name, mode, tuple(words) + tuple(kept))
    except CommitError as e:
        aborted = _aborted_elsewhere(e, ckdir, name)
        if aborted is not None:
            raise aborted from None
        if ckdir != os.path.join(mount, name):
            # a working name is this save's own: nothing to restage under it
            raise CommitError(e.name, e.status, e.path,
                              discarded=_discard_uncommitted(ckdir)) from None
        raise
    except BaseException:
        _abort_save(ckdir, name, words)
        raise


def _save_words(name, overwrite, solo):
    """The modifiers after sync/async of a save of name. overwrite: always
    replace=NAME (ckptfs publishes it plainly when NAME is not committed),
    so that every rank gives the same words whatever its mount shows; a
    name that cannot follow replace= is replaced only when it must be
    (_make_checkpoint_dir refuses then)."""
    words = ("solo",) if solo else ()
    if overwrite and replaceable(name):
        words += (f"replace={name}",)
    return words


def _make_checkpoint_dir(mount, name, exist_ok, overwrite=False, solo=False):
    """Create the directory a save of NAME stages in (see save's exist_ok
    and overwrite): MOUNT/NAME, or a working name when NAME is committed
    and overwrite is set; its path. A staged NAME that exist_ok does not
    allow is aborted (_abort_commit: the other ranks wait for this rank's
    commit; not in a solo save) and left staged."""
    job.declare(mount)  # its leftovers are abandoned if this process dies
    ckdir = os.path.join(mount, name)
    try:
        os.mkdir(ckdir)
    except FileExistsError:
        try:
            st = status(mount, name)[0]
        except OSError:
            st = "committed"
        if st == "committed" and overwrite:
            if not replaceable(name):
                raise CkptfsError(_unreplaceable(name)) from None
            return make_working_dir(mount, name)
        if st in ("committed", "committing"):
            how = ("pass overwrite=True to replace it, " if st == "committed"
                   else "wait for its commit, ")
            raise CkptfsError(
                f"checkpoint {name!r} is already {st} in {mount}: {how}choose "
                f"another name, or remove it for every rank with rm -r {ckdir}") from None
        if not exist_ok:
            if not solo:
                _abort_commit(ckdir, name, reason=(
                    f"an earlier save of {name!r} was left staged on its mount "
                    "(exist_ok=True discards it)"))
            raise CkptfsError(
                f"checkpoint {name!r} is already staged ({st}) on this rank in "
                f"{mount}: choose another name, discard it with rm -r {ckdir}, "
                "or pass exist_ok=True to discard and restage it"
                + ("" if solo else " (this save was aborted on every rank)")) from None
        _discard_staged(ckdir)
        os.mkdir(ckdir)
    except OSError as e:
        raise CkptfsError(f"cannot create checkpoint {ckdir}: {e.strerror}"
                          + (" (a name is a file name not starting with '.')"
                             if e.errno in (errno.EINVAL, errno.EPERM) else "")) from e
    return ckdir


# ---- replacing a committed checkpoint ---------------------------------------------
#
# A new version of a committed NAME is staged under a working name
# (working_prefix(NAME) + a token) and committed with "replace=NAME":
# ckptfs publishes it as NAME over the committed one in one atomic step,
# for every mount, and the working name disappears (SPEC, Committing).
# Every rank of the world gives the same NAME; each may stage under a
# working name of its own. ckptfs.save and ckptfs.dcp.Writer both do this.

TOKEN_CHARS = 12


def replaceable(name):
    """Whether name can follow replace= in a commit word (the word ends at
    a space)."""
    return " " not in name and "\n" not in name


def _unreplaceable(name):
    return (f"checkpoint {name!r} is committed and cannot be replaced: a name "
            "holding a space cannot follow replace= in a commit word; save "
            "under another name, or remove it first with rm -r")


def working_prefix(name):
    """How the working names of saves replacing NAME begin: NAME.replace-,
    or replace-<sha1 of NAME>- where that would make a name too long."""
    prefix = f"{name}.replace-"
    if len(prefix.encode("utf-8", "surrogateescape")) + TOKEN_CHARS > 255:
        digest = hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()
        prefix = f"replace-{digest[:20]}-"
    return prefix


def make_working_dir(mount, name, token=None):
    """Create a working directory in mount for a save replacing NAME: the
    given token (TOKEN_CHARS hex digits) when that name is free, else a
    random one; its path."""
    for _ in range(3):
        token = token or uuid.uuid4().hex[:TOKEN_CHARS]
        path = os.path.join(mount, working_prefix(name) + token)
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            token = None
        except OSError as e:
            raise CkptfsError(f"cannot create {path} to replace checkpoint "
                              f"{name!r}: {e.strerror}") from e
    raise CkptfsError(f"cannot find a free working name to replace {name!r} in {mount}")


def _replacing(mount, name):
    """This mount's working directories of saves replacing NAME whose
    commit is running or failed: [(path, state, .status text)]."""
    prefix = working_prefix(name)
    try:
        names = [n for n in os.listdir(mount) if n.startswith(prefix)]
    except OSError:
        return []
    out = []
    for n in names:
        path = os.path.join(mount, n)
        st, text = _status_of(path)
        if st in ("committing", "failed"):
            out.append((path, st, text))
    return out


# ---- one rank's failure fails the save on every rank ----------------------------
#
# A commit waits for every rank's (up to commit_timeout, 600 s by default).
# A rank that fails before it commits therefore commits anyway, with an
# item ckptfs refuses (ABORT_ITEM): the commit fails on every rank within
# seconds, each rank discards what it staged, and the others raise
# CommitError saying another rank failed. ckpt.save, ckptfs.async_save and
# ckptfs.dcp.Writer all do this. A solo save has no other rank to tell.
# The item's user.ckpt.fqn is the rank's reason: the daemon fails the save
# with "rank R aborted the save: REASON" (fs/save.c, aborted_by), never
# naming the item (a daemon older than that names it:
# "_ckptfs_abort (...): rank R wrote 0 bytes, 4 expected").

ABORTED = re.compile(r"^rank \d+ aborted the save: ", re.M)
ABORT_REASON_MAX = 300


def _abort_reason(reason=None):
    """The reason an abort gives the other ranks: reason, else the error
    being handled (sys.exc_info), one line of at most ABORT_REASON_MAX
    bytes of UTF-8 (the daemon cuts a longer one)."""
    if reason is None:
        err = sys.exc_info()[1]
        if err is None:
            reason = "it failed before its commit"
        else:
            text = str(err).strip().splitlines()
            reason = f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
    reason = "".join(c if c >= " " and c != "\x7f" else "?" for c in reason)
    raw = reason.encode("utf-8", "replace")
    if len(raw) > ABORT_REASON_MAX:
        reason = raw[:ABORT_REASON_MAX - 3].decode("utf-8", "ignore") + "..."
    return reason


def _abort_commit(ckdir, name, words=(), reason=None):
    """Fail this save on every rank now rather than at commit_timeout:
    commit a chunk ckptfs refuses (a float32 of shape [1] with no bytes,
    its user.ckpt.fqn the reason: _abort_reason), with the save's own
    words (replace=NAME: the ranks match by NAME). Returns once the commit
    failed (when every rank committed)."""
    if "solo" in words:
        return
    why = _abort_reason(reason)
    try:
        if not os.path.isdir(ckdir) or _status_of(ckdir)[0] != "staging":
            return
        path = os.path.join(ckdir, ABORT_ITEM)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.setxattr(fd, "user.ckpt.dtype", b"float32")
            os.setxattr(fd, "user.ckpt.shape", b"1")
            try:
                os.setxattr(fd, "user.ckpt.fqn", why.encode("utf-8", "replace"))
            except OSError:
                pass  # the save fails all the same, the reason unsaid
        finally:
            os.close(fd)
        try:
            _commit_dir(ckdir, name, "sync", words)
        except (CkptfsError, OSError):
            pass
    except OSError:
        pass


def _discard_uncommitted(ckdir):
    """Discard ckdir on this rank if it is staged or failed (never a
    committed one); True if it was."""
    try:
        if os.path.isdir(ckdir) and _status_of(ckdir)[0] in ("staging", "failed"):
            _discard_staged(ckdir)
            return True
    except OSError:
        pass
    return False


def _abort_save(ckdir, name, words=()):
    """This rank's save into ckdir failed before its commit: fail it on
    every rank now (_abort_commit), then discard what this rank staged. The
    error being raised (sys.exc_info) gets a note saying so."""
    _abort_commit(ckdir, name, words)
    gone = _discard_uncommitted(ckdir)
    err = sys.exc_info()[1]
    if err is not None and hasattr(err, "add_note"):  # Python >= 3.11
        where = "" if "solo" in words else " was aborted on every rank"
        err.add_note(f"ckptfs: the save of {name!r}{where}"
                     + (" and this rank's staged files discarded" if gone else ""))


def _abort_unstaged(mount, name, exist_ok, overwrite=False, solo=False):
    """This rank failed before it staged anything (a key or value it cannot
    encode): make NAME only to abort it, as _abort_save (a solo save has
    nobody to tell)."""
    if solo:
        return
    try:
        ckdir = _make_checkpoint_dir(mount, name, exist_ok, overwrite)
    except CkptfsError:
        return  # not ours to abort, or aborted already
    _abort_save(ckdir, name, _save_words(name, overwrite, solo))


def _aborted_elsewhere(err, ckdir, name, api="client"):
    """err: this rank's CommitError. When another rank aborted the save
    (_abort_commit), discard this rank's staged files and return the
    CommitError to raise instead; else None."""
    if not ABORTED.search(err.status) and ABORT_ITEM not in err.status:
        return None
    _discard_uncommitted(ckdir)
    return CommitError(name, err.status + "\nanother rank failed before its commit "
                       "(while staging its items): its own error says why", ckdir,
                       discarded=True, api=api)


class StagingBuffers:
    """Host memory for async_save's copies, kept from one save to the next.

    Pass the same object to every async_save of a training run:
    async_save(sd, mount, name, buffers=bufs). A save copies each tensor
    into the buffer its key had in an earlier save (same shape and dtype)
    instead of fresh memory, so the caller's stall is a plain copy with no
    page faults; the buffers come back when the save's future is done. A
    key whose buffer is still in use by a save in flight, or whose shape or
    dtype changed, gets fresh memory (which is kept in its place after).
    It holds at most one buffer per key: about one state dict of host
    memory while idle; clear() gives it back."""

    def __init__(self):
        self._lock = threading.Lock()
        self._free = {}

    def _take(self, key, t):
        with self._lock:
            b = self._free.pop(key, None)
        if (b is not None and type(b) is type(t) and b.shape == t.shape
                and b.dtype == t.dtype):
            return b
        return None

    def _give(self, used):
        with self._lock:
            self._free.update(used)

    def clear(self):
        """Drop the kept buffers (their memory is freed when unreferenced).
        A save in flight still gives its buffers back when it ends."""
        with self._lock:
            self._free.clear()

    def __len__(self):
        with self._lock:
            return len(self._free)


def _snapshot_tensor(t, key=None, buffers=None, used=None):
    """A private contiguous CPU copy of tensor (or array) t: one copy, into
    buffers' earlier buffer for key when it fits."""
    if _is_torch(t):
        t = t.detach()
        out = buffers._take(key, t) if buffers is not None else None
        if out is None:   # (kept buffers are this function's CPU copies)
            out = _torch_module().empty(t.shape, dtype=t.dtype, device="cpu")
        out.copy_(t)
    else:
        np = _numpy_module()
        out = buffers._take(key, t) if buffers is not None else None
        if out is None:
            out = np.array(t, copy=True, order="C")
        else:
            np.copyto(out, t)
    if used is not None:
        used[key] = out
    return out


def _snapshot(obj, objects, buffers=None, used=None, prefix=()):
    """A copy of state dict obj that later changes to obj do not reach:
    tensors (a DTensor as the Shard of its local part) copied into private
    CPU memory (buffers' kept memory when given; each buffer used is put
    in used under its key path), other values encoded now (pickle or
    JSON), dicts rebuilt."""
    out = {}
    for k, v in obj.items():
        key = prefix + (k,)
        if isinstance(v, dict) and v:
            out[k] = _snapshot(v, objects, buffers, used, key)
            continue
        v = _dtensor_as_shard(v)
        if isinstance(v, Shard):
            out[k] = Shard(_snapshot_tensor(v.tensor, key, buffers, used), v.offsets,
                           v.global_shape)
        elif _is_tensor(v):
            out[k] = _snapshot_tensor(v, key, buffers, used)
        elif isinstance(v, (bytearray, memoryview)):
            out[k] = _Encoded(bytes(v), "bytes")   # a copy: they may change
        else:
            out[k] = _Encoded(*_encode_object(v, objects))
    return out


def async_save(state_dict, mount, name, rank=0, commit="sync", objects="pickle",
               exist_ok=False, threads=4, buffers=None, overwrite=False, solo=False,
               step=None, metrics=None, protect=False):
    """Save in the background: the caller waits only while state_dict is
    copied (tensors into private CPU memory, other values encoded); the
    writes into MOUNT/NAME and the commit run on a thread of their own.
    Returns a concurrent.futures.Future whose result() is None once the
    checkpoint is committed and durable everywhere (commit="sync"; with
    "async": once the staged data is frozen) and which raises what save()
    would (CommitError, CkptfsError). The copy is held until then: one
    more state dict of host memory per save in flight. Like DCP's
    async_save, every rank calls it with the same name; later changes to
    the tensors do not reach the checkpoint. buffers: a StagingBuffers
    kept across saves, so that the copy reuses the last save's memory.
    Other arguments as save() (overwrite False by default, step= for
    retention)."""
    _check_save_args(state_dict, mount, "commit", commit, objects)
    _check_world(mount, rank, solo)
    retention_words(step, metrics, protect)  # bad values raise here, not in the future
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, not {threads!r}")
    if buffers is not None and not isinstance(buffers, StagingBuffers):
        raise TypeError(f"buffers must be a ckptfs.StagingBuffers, not "
                        f"{type(buffers).__name__}")
    used = {} if buffers is not None else None
    try:
        _flatten(state_dict, [], [])   # bad keys raise here, not in the future
        snap = _snapshot(state_dict, objects, buffers, used)
    except BaseException:
        if buffers is not None:
            buffers._give(used)   # nothing writes from them: keep them
        # the other ranks' saves would wait for this rank's commit
        _abort_unstaged(mount, name, exist_ok, overwrite, solo)
        raise
    fut = Future()
    fut.set_running_or_notify_cancel()

    def run():
        try:
            save(snap, mount, name, rank=rank, mode=commit, objects=objects,
                 exist_ok=exist_ok, threads=threads, overwrite=overwrite, solo=solo,
                 step=step, metrics=metrics, protect=protect)
        except BaseException as e:  # noqa: B036 (the future raises it)
            err = e
        else:
            err = None
        if buffers is not None:
            snap.clear()          # the daemon has the bytes: the copies are free
            if err is not None:   # its frames would hold views of the buffers
                traceback.clear_frames(err.__traceback__)
            buffers._give(used)
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(err)

    try:
        threading.Thread(target=run, name=f"ckptfs-save-{name}").start()
    except BaseException:
        if buffers is not None:
            buffers._give(used)
        raise
    return fut


def _stage_file(dirs, rel, name, buf, xattrs=()):
    try:
        dirs.write_file(rel, buf, xattrs)
    except OSError as e:
        raise CkptfsError(f"cannot stage {rel} of checkpoint {name!r}: "
                          f"{e.strerror} ({os.path.join(dirs.ckdir, rel)})") from e


def _stage_leaves(leaves, dirs, name, objects, manifest, stager):
    for keys, v in leaves:
        rel = "/".join(str(k) for k in keys)
        entry = {"keys": [["i" if isinstance(k, int) else "s", k] for k in keys]}
        try:
            dirs.make(os.path.dirname(rel))
            if _is_tensor(v):
                shard = v if isinstance(v, Shard) else None
                dtype, shape, buf, kind = _tensor_info(shard.tensor if shard else v)
                xattrs = [("user.ckpt.dtype", dtype.encode())]
                if shard:
                    xattrs += [("user.ckpt.shape", _csv(shard.global_shape)),
                               ("user.ckpt.offsets", _csv(shard.offsets)),
                               ("user.ckpt.sizes", _csv(shape))]
                else:
                    xattrs.append(("user.ckpt.shape", _csv(shape)))
                stager.submit(_stage_file, dirs, rel, name, buf, xattrs)
                entry["kind"] = kind
            else:
                data, kind = _encode_object(v, objects)
                stager.submit(_stage_file, dirs, rel, name, data)
                entry["kind"] = kind
        except OSError as e:
            raise CkptfsError(f"cannot stage {rel} of checkpoint {name!r}: "
                              f"{e.strerror} ({os.path.join(dirs.ckdir, rel)})") from e
        manifest[rel] = entry


def _discard_staged(ckdir):
    """rm -r of a staged (never committed) checkpoint: discards it on this
    rank only. Never called on a committed one (that would delete it)."""
    for root, dirs, files in os.walk(ckdir, topdown=False):
        for f in files:
            os.unlink(os.path.join(root, f))
        for d in dirs:
            os.rmdir(os.path.join(root, d))
    os.rmdir(ckdir)


_METRIC_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def retention_words(step=None, metrics=None, protect=False):
    """The commit words retention reads (docs/saving.md, "Retention"):
    step=N, metric=KEY:VALUE per item of metrics (a dict), protect."""
    words = ()
    if step is not None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r}: a whole number >= 0")
        words += (f"step={step}",)
    for key, value in (metrics or {}).items():
        value = float(value)
        if not _METRIC_KEY.fullmatch(key) or not math.isfinite(value):
            raise ValueError(f"metric {key!r}={value!r}: a key of letters, digits, "
                             "_ . - (up to 64) and a finite number")
        words += (f"metric={key}:{value!r}",)
    return words + (("protect",) if protect else ())


def commit(mount, name, mode="sync", replace=None, solo=False, step=None,
           metrics=None, protect=False):
    """Write mode to NAME/.commit (what save() does last). replace=TARGET:
    publish the staged NAME as TARGET, over a committed TARGET; solo: this
    rank alone, as a world of one (SPEC, Committing). step, metrics
    ({"loss": 0.25}) and protect are recorded for retention (-o keep=,
    ckptctl prune)."""
    check_dir(mount)
    if not solo:  # as save() checks: the trainer's world is the mount's
        rank, size = _trainer_world()
        why = world_mismatch(mount, rank, size, saving=True)
        if why:
            raise CkptfsError(why)
    words = ("solo",) if solo else ()
    if replace is not None:
        if not replaceable(replace):
            raise ValueError(f"replace={replace!r}: a name holding a space cannot "
                             "follow replace= in a commit word")
        words += (f"replace={replace}",)
    words += retention_words(step, metrics, protect)
    _commit_dir(os.path.join(mount, name), name, mode, words)


def _commit_dir(ckdir, name, mode="sync", words=()):
    """Write mode and words (modifiers: "solo", "replace=NAME") to
    ckdir/.commit; CommitError with .status's reason when the commit
    fails."""
    try:
        fd = os.open(os.path.join(ckdir, ".commit"), os.O_WRONLY | os.O_TRUNC)
    except OSError as e:
        raise CkptfsError(f"cannot open {ckdir}/.commit: {e.strerror} (is "
                          f"{os.path.dirname(ckdir)} a ckptfs mount?)") from e
    word = " ".join((mode,) + tuple(words))
    try:
        os.write(fd, word.encode() + b"\n")
    except OSError as e:
        st, text = _status_of(ckdir)
        if st == "failed" or (st == "committed" and "\nlost: " in text):
            raise CommitError(name, text, ckdir) from e
        older = (f" (the daemon refused {word!r}: a ckptfs older than the words "
                 "solo and replace=?)" if words and e.errno == errno.EINVAL else "")
        raise CkptfsError(f"commit of {name!r} failed: {e.strerror}{older}"
                          + (f"; .status: {text.strip()}" if text else "")) from e
    finally:
        os.close(fd)


def _saved_by(ckdir):
    """Whose save the staged checkpoint ckdir is, for CommitError's advice:
    "client" (save() writes its manifest there) or "dcp" (an async commit
    of ckptfs.dcp.Writer, the other caller of wait)."""
    return "client" if os.path.isdir(os.path.join(ckdir, MANIFEST_DIR)) else "dcp"


def wait(mount, name, timeout=None, poll=0.05):
    """Wait until an async commit of name is committed (return its .status
    text) or failed, or lost to another mount's commit of name (raise
    CommitError); TimeoutError after timeout s. An async save that
    replaces a committed name (overwrite) is followed under its working
    name on this mount until it is published as name or fails (its
    working directory is then discarded)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        pending = _replacing(mount, name)
        for path, st, text in pending:
            if st == "failed":
                api = _saved_by(path)
                raise CommitError(name, text, path, discarded=_discard_uncommitted(path),
                                  api=api)
        if pending:
            st, text = "committing", pending[0][2]
        else:
            st, text = status(mount, name)
        # "lost:": this mount's commit lost to another save of the name,
        # which NAME is now (its staged files were discarded)
        if st == "committed" and "\nlost: " not in text:
            return text
        if st in ("failed", "committed"):
            path = os.path.join(mount, name)
            raise CommitError(name, text, path, api=_saved_by(path))
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint {name!r} is still {st} after "
                               f"{timeout} s: {text.strip()}")
        time.sleep(poll)


# ---- load -----------------------------------------------------------------------

def _manifest(ckdir):
    """{relative path: entry} merged from every rank's manifest."""
    items = {}
    d = os.path.join(ckdir, MANIFEST_DIR)
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return items
    for n in names:
        if n.startswith("rank") and n.endswith(".json"):
            with open(os.path.join(d, n), "rb") as f:
                doc = json.load(f)
            for rel, entry in doc.get("items", {}).items():
                items.setdefault(rel, entry)
    return items


def _walk(ckdir, top=True):
    """Relative paths of every file under ckdir; at the top of a checkpoint
    (top) but .metadata and the manifests."""
    out = []
    for root, dirs, files in os.walk(ckdir):
        rel_root = os.path.relpath(root, ckdir)
        if top and rel_root == MANIFEST_DIR:
            dirs[:] = []
            continue
        for f in files:
            rel = f if rel_root == "." else f"{rel_root}/{f}"
            if not (top and rel == ".metadata"):
                out.append(rel)
    return sorted(out)


def _xattrs(path):
    try:
        dtype = os.getxattr(path, "user.ckpt.dtype").decode()
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP):
            return None, None
        raise
    return dtype, _parse_dims(os.getxattr(path, "user.ckpt.shape"))


def _runs(global_shape, offsets, sizes):
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


def _read_block(path, dtype, global_shape, offsets, sizes, mv):
    """Read block (offsets, sizes) of the global tensor at path into mv
    (the block's bytes, row-major): one pread when it is one contiguous
    run, else one read of its block file; one pread per run where the
    mount has no block files."""
    item = DTYPES[dtype]
    runs = _runs(global_shape, offsets, sizes)
    first = next(runs, None)
    if first is not None and next(runs, None) is not None:
        try:
            fd = os.open(block_file(path, offsets, sizes), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:  # no block files here, or a name too long for one
            if e.errno not in (errno.ENOENT, errno.ENAMETOOLONG):
                raise
            fd = None
        if fd is not None:
            try:
                _pread_into(fd, mv, 0, path)
            finally:
                os.close(fd)
            return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pos = 0
        for start, count in _runs(global_shape, offsets, sizes):
            nbytes = count * item
            _pread_into(fd, mv[pos:pos + nbytes], start * item, path)
            pos += nbytes
    finally:
        os.close(fd)


def _new_tensor(kind, dtype, shape):
    """An empty tensor to read into, and a byte view of its memory."""
    if kind == "torch" or (kind != "numpy" and dtype not in NUMPY_NAMES):
        torch = _torch_module()
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        return t, memoryview(_torch_numpy_view(t).reshape(-1)).cast("B")
    if dtype not in NUMPY_NAMES:
        raise CkptfsError(f"dtype {dtype} has no numpy equivalent; load it as a "
                          "torch tensor")
    np = _numpy_module()
    a = np.empty(shape, dtype=np.dtype(NUMPY_NAMES[dtype]))
    return a, memoryview(a.reshape(-1)).cast("B")


def _load_into(target, path, rel, dtype, gshape):
    """Read the item at path into target (a tensor, array or Shard) in place."""
    shard = target if isinstance(target, Shard) else None
    t = shard.tensor if shard else target
    if _is_torch(t):
        want = _torch_dtype_name(t.dtype)
    else:
        want = _numpy_dtype_name(t.dtype)
    if want != dtype:
        raise CkptfsError(f"{rel}: the checkpoint holds {dtype}, the given "
                          f"tensor is {want}")
    shape = tuple(t.shape)
    if shard:
        if shard.global_shape != gshape:
            raise CkptfsError(f"{rel}: the checkpoint's shape is {list(gshape)}, "
                              f"the Shard's global shape {list(shard.global_shape)}")
        offsets = shard.offsets
    else:
        if shape != gshape:
            raise CkptfsError(f"{rel}: the checkpoint's shape is {list(gshape)}, "
                              f"the given tensor's {list(shape)} (give a Shard "
                              "to load part of it)")
        offsets = (0,) * len(shape)
    direct = None
    if _is_torch(t):
        if t.device.type == "cpu" and t.is_contiguous():
            direct = _torch_numpy_view(t)
    else:
        if t.flags.c_contiguous and t.flags.writeable and \
                t.dtype == t.dtype.newbyteorder("<"):
            direct = t  # stored bytes are little-endian: read them in place
    if direct is not None:
        _read_block(path, dtype, gshape, offsets, shape,
                    memoryview(direct.reshape(-1)).cast("B"))
        return
    tmp, mv = _new_tensor("torch" if _is_torch(t) else "numpy", dtype, shape)
    _read_block(path, dtype, gshape, offsets, shape, mv)
    if _is_torch(t):
        with sys.modules["torch"].no_grad():
            t.copy_(tmp)
    else:
        t[...] = tmp


def _decode_object(path, rel, kind, allow_pickle):
    with open(path, "rb") as f:
        data = f.read()
    if kind == "pickle":
        if not allow_pickle:
            raise CkptfsError(f"{rel} is pickled and allow_pickle is False")
        return pickle.loads(data)
    if kind == "json":
        return json.loads(data)
    return data


def _key(k):
    t, v = k
    return int(v) if t == "i" else v


def _load_item(path, rel, entry, allow_pickle):
    """A new tensor, array, bytes or object from the file at path."""
    dtype, shape = _xattrs(path)
    if dtype is not None:
        t, mv = _new_tensor(entry["kind"] if entry else None, dtype, shape)
        _read_block(path, dtype, shape, (0,) * len(shape), shape, mv)
        return t
    return _decode_object(path, rel, entry["kind"] if entry else "bytes",
                          allow_pickle)


def _load_tree(ckdir, sub, manifest, allow_pickle, rels, prog):
    """A new nested dict of the items rels (_walk's) under directory sub
    ("" for all)."""
    out = {}
    depth = len(sub.split("/")) if sub else 0
    for rel in rels:
        rel = f"{sub}/{rel}" if sub else rel
        entry = manifest.get(rel)
        keys = [_key(k) for k in entry["keys"]] if entry else rel.split("/")
        keys = keys[depth:]
        path = os.path.join(ckdir, rel)
        value = _load_item(path, rel, entry, allow_pickle)
        if prog.active:
            prog.add(os.path.getsize(path))
        d = out
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
    return out


def _file_bytes(top, rels, wanted=True):
    """The bytes of the files rels under top (0 unless wanted: a stat each)."""
    return sum(os.path.getsize(os.path.join(top, r)) for r in rels) if wanted else 0


def _check_progress(progress):
    """Refuse a progress argument a load cannot use, before anything is
    read; the tqdm class for True or "tqdm", else None."""
    if progress is None or progress is False or callable(progress):
        return None
    if progress is True or progress == "tqdm":
        try:
            from tqdm.auto import tqdm
        except ImportError:
            raise CkptfsError(f"progress={progress!r} shows a tqdm bar, but the "
                              "tqdm package is not installed (pip install tqdm); "
                              "or pass progress=callable(done_bytes, total_bytes)"
                              ) from None
        return tqdm
    raise ValueError(f"progress={progress!r}: pass a callable(done_bytes, "
                     "total_bytes), True or 'tqdm' (a tqdm bar), or None")


class _Progress:
    """A load's progress: progress(done_bytes, total_bytes) is called with
    (0, total) first, then each time an item has been read (done grows;
    it ends at total). progress: None or False (none), a callable, or True
    or "tqdm" (a tqdm bar). A context manager (the bar closes at its end);
    add() may be called from several threads."""

    def __init__(self, progress, total, what):
        self.total, self.done, self._bar = total, 0, None
        self._lock = threading.Lock()
        tqdm = _check_progress(progress)
        if tqdm is not None:
            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                             desc=what)
            self._fn = lambda done, total: self._bar.update(done - self._bar.n)
        else:
            self._fn = progress or None
        if self._fn is not None:
            self._fn(0, total)

    @property
    def active(self):
        return self._fn is not None

    def add(self, nbytes):
        if self._fn is None or nbytes <= 0:
            return
        with self._lock:  # one call at a time, done in order
            self.done += nbytes
            self._fn(self.done, self.total)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.close()


def load(spec, mount, name, allow_pickle=True, progress=None):
    """Read committed checkpoint name from this rank's mount.

    spec None: return a new nested dict of everything in the checkpoint
    (tensors as saved: torch tensors or numpy arrays; dtype and shape from
    the xattrs). spec a dict: fill it: its tensors, arrays and Shards are
    read in place (a Shard reads only its own byte ranges; dtype and global
    shape must match), its other leaves are replaced by the stored values;
    items of the checkpoint that spec does not name are not read. Returns
    the dict.

    progress: a callable(done_bytes, total_bytes), called with (0, total)
    first and after each item read, done ending at total (the bytes of the
    items read: a Shard's own part of a tensor); True or "tqdm" shows a
    tqdm bar (the tqdm package must be installed); None: nothing.
    """
    ckdir = os.path.join(mount, name)
    if not os.path.isdir(ckdir):
        check_dir(mount)
        try:
            have = sorted(n for n in os.listdir(mount) if not n.startswith("."))
        except OSError as e:
            raise CkptfsError(f"cannot list {mount}: {e.strerror}") from e
        raise CkptfsError(f"no checkpoint {name!r} in {mount} (it has: "
                          f"{', '.join(have) or 'none'})")
    try:
        st, text = status(mount, name)
    except OSError:
        st, text = "committed", ""  # not a ckptfs mount: read what is there
    if st != "committed":
        raise CkptfsError(f"checkpoint {name!r} is {st}, not committed: "
                          + ("wait(mount, name) first" if st == "committing"
                             else text.strip()))
    manifest = _manifest(ckdir)
    what = f"load {name}"
    _check_progress(progress)
    sizes = progress not in (None, False)  # the items' sizes: a stat each
    if spec is None:
        rels = _walk(ckdir)
        with _Progress(progress, _file_bytes(ckdir, rels, sizes), what) as prog:
            return _load_tree(ckdir, "", manifest, allow_pickle, rels, prog)
    if not isinstance(spec, dict):
        raise TypeError(f"spec must be a dict or None, not {type(spec).__name__}")
    # What to read, and its bytes, before reading any of it.
    todo = []
    for keys, v in _flatten(spec, [], []):
        rel = "/".join(str(k) for k in keys)
        path = os.path.join(ckdir, rel)
        try:
            dtype, shape = _xattrs(path)
        except FileNotFoundError:
            raise CkptfsError(f"checkpoint {name!r} has no item {rel} (FQN "
                              f"{rel.replace('/', '.')})") from None
        if _is_tensor(v):
            if dtype is None:
                raise CkptfsError(f"{rel} is a bytes item in checkpoint {name!r}, "
                                  "not a tensor")
            t = v.tensor if isinstance(v, Shard) else v
            todo.append((keys, rel, path, v, (dtype, shape),
                         math.prod(t.shape) * DTYPES.get(dtype, 1)))
        elif os.path.isdir(path):
            rels = _walk(path, top=False)
            todo.append((keys, rel, path, None, rels, _file_bytes(path, rels, sizes)))
        else:
            todo.append((keys, rel, path, None, None,
                         os.path.getsize(path) if sizes else 0))
    with _Progress(progress, sum(job[-1] for job in todo), what) as prog:
        for keys, rel, path, v, how, nbytes in todo:
            if v is not None:
                _load_into(v, path, rel, *how)
                prog.add(nbytes)
                continue
            if how is not None:
                value = _load_tree(ckdir, rel, manifest, allow_pickle, how, prog)
            else:
                value = _load_item(path, rel, manifest.get(rel), allow_pickle)
                prog.add(nbytes)
            d = spec
            for k in keys[:-1]:
                d = d[k]
            d[keys[-1]] = value
    return spec

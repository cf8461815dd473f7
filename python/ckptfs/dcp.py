"""ckptfs.dcp - a torch.distributed.checkpoint (DCP) storage backend.

    import torch.distributed.checkpoint as dcp
    import ckptfs.dcp
    dcp.save(state_dict, checkpoint_id="step-100",
             storage_writer=ckptfs.dcp.Writer("/mnt/ckpt/rank%r"))
    dcp.async_save(state_dict, checkpoint_id="step-200",
                   storage_writer=ckptfs.dcp.Writer("/mnt/ckpt/rank%r"))
    dcp.load(state_dict, checkpoint_id="step-100",
             storage_reader=ckptfs.dcp.Reader("/mnt/ckpt/rank%r"))

One mount per rank (`%r` is the rank: torch.distributed's when a process
group is up, else the launcher's OMPI_COMM_WORLD_RANK / RANK / PMI_RANK /
SLURM_PROCID, else 0). The checkpoint_id is the checkpoint's NAME in the
mount (any file name not starting with '.'), or a path MOUNT/NAME.

Saving: every rank writes every item of its local plan into its mount,
replicated ones too (DCP's planner keeps one copy of a replica; ckptfs
keeps them all, compares them (replica_check) and stores one), then commits
NAME collectively (`sync` written to NAME/.commit): the checkpoint is
durable and committed for every rank when write_data returns, and the
future of dcp.async_save completes then. A rank that fails before it
commits makes the commit fail on every rank at once (it commits an item
ckptfs refuses, carrying its error), so every rank raises, never hangs,
.status and the CommitError saying "rank R aborted the save: ITS ERROR";
the staged checkpoint is then discarded on every rank, so the same id can
be saved again.

Saving a checkpoint_id that is already committed replaces it, as stock
DCP's FileSystemWriter does by default (Writer(overwrite=True)): the
coordinator sees NAME committed while it makes the global plan and says so
in the plan's storage_data, with a token; every rank stages under the
working name NAME.replace-TOKEN and commits with replace=NAME, which
publishes the new version as NAME in one atomic step for every mount.
overwrite=False raises ("Checkpoint already exists ...") on every rank
before anything is staged.

Paths: an FQN whose dot-separated parts are path-safe (non-empty, no '/',
not starting with '.', at most 255 bytes) is saved at the path of its parts
(`model.layer0.weight` at model/layer0/weight), as every ckptfs tool
expects. Any other FQN, or one whose path another FQN needs as a
directory, is saved under `_fqn/<sha1 of the FQN>` with the FQN in the
user.ckpt.fqn xattr; `.metadata` keeps every FQN exactly. Several chunks of
one tensor on one rank (DTensors with several local shards) are several
files carrying one user.ckpt.fqn.

Loading reads `.metadata` and each tensor's committed file, which holds the
whole global tensor: a shard of any layout is one pread when it is a
contiguous byte range, else one read of a block file (`.NAME[a:b,c:d]`,
docs/committed.md), so loads work at any world size.
"""

import dataclasses
import enum
import errno
import functools
import sys
import hashlib
import io
import math
import os
import pickle
import re
import sqlite3
import stat
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,
                                                   ChunkStorageMetadata,
                                                   Metadata, MetadataIndex,
                                                   StorageMeta,
                                                   TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan,
                                                  LoadPlanner, SavePlan,
                                                  SavePlanner, WriteItemType)
from torch.distributed.checkpoint.storage import (StorageReader,
                                                  StorageWriter, WriteResult)
from torch.futures import Future

from . import _client, job
from .tiling import check_tiling, chunk_desc, dims_text
from ._client import (ABORT_ITEM, TOKEN_CHARS, CkptfsError, CommitError, _abort_commit,
                      _abort_save, _aborted_elsewhere, _commit_dir as _commit,
                      _discard_uncommitted, _Stager, _discard_staged as _discard,
                      _Progress, _StagingDirs, _check_progress, _pread_into,
                      _status_of as _status, _unreplaceable,
                      block_file, check_dir, make_working_dir, replaceable,
                      world_mismatch)

__all__ = ["Writer", "Reader", "import_checkpoint", "export_checkpoint",
           "fqn_paths", "CkptfsError", "CommitError"]

IO_STEP = 64 << 20          # bytes of rows per gather of a strided block

# ckptfs dtype name <-> torch dtype
_TORCH = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8,
    "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64,
    "complex64": torch.complex64, "complex128": torch.complex128,
}
for _n in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _n):
        _TORCH[_n] = getattr(torch, _n)
_CKPT = {v: k for k, v in _TORCH.items()}


def _dtype_name(dt, fqn):
    try:
        return _CKPT[dt]
    except KeyError:
        raise CkptfsError(f"{fqn}: dtype {dt} has no ckptfs equivalent (ckptfs "
                          f"stores {', '.join(sorted(_TORCH))})") from None


# ---- where things go ---------------------------------------------------------

def default_rank():
    """This process's rank: torch.distributed's, else the launcher's
    (ckptfs._client.trainer_rank)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _client.trainer_rank()


def default_world_size():
    """This process's world size: torch.distributed's, else the launcher's
    (Open MPI, torchrun, PMI; not Slurm's SLURM_NTASKS, which a batch
    script's single process sees too), else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _client._trainer_world()[1] or 1


def _check_world(mount, rank, world_size, saving=False):
    """Refuse, before anything is staged or read, a mount whose ckptfs world
    is not the trainer's (its size, or another rank's mount); saving: also
    a directory that is no ckptfs mount."""
    why = world_mismatch(mount, rank, world_size, saving)
    if why:
        raise CkptfsError(f"rank {rank}: {why}")


def rank_mount(mount, rank):
    """mount with %r replaced by rank (%% is a literal %)."""
    return re.sub(r"%[r%]", lambda m: str(rank) if m.group(0) == "%r" else "%",
                  os.fspath(mount))


def checkpoint_name(checkpoint_id, mount=None):
    """The checkpoint NAME of a DCP checkpoint_id: NAME itself, or a path
    MOUNT/NAME. ValueError when it is neither."""
    if checkpoint_id is None:
        raise ValueError("ckptfs.dcp needs a checkpoint_id: the checkpoint's "
                         "name in the mount, e.g. checkpoint_id=\"step-100\"")
    s = os.fspath(checkpoint_id)
    if isinstance(s, bytes):
        s = os.fsdecode(s)
    if "/" in s.rstrip("/"):
        s = s.rstrip("/")
        parent, base = os.path.split(s)
        if mount is not None and os.path.realpath(parent) != os.path.realpath(mount):
            raise ValueError(f"checkpoint_id {s!r} is not in the mount {mount!r}: "
                             "give the checkpoint's name, or MOUNT/NAME")
        s = base
    s = s.rstrip("/")
    b = s.encode("utf-8", "surrogateescape")
    if not s or s.startswith(".") or "\0" in s or len(b) > 255:
        raise ValueError(f"checkpoint_id {checkpoint_id!r}: a ckptfs checkpoint name "
                         "is a file name of 1-255 bytes not starting with '.'")
    return s


def _safe_parts(fqn):
    parts = fqn.split(".")
    for p in parts:
        b = p.encode("utf-8", "surrogateescape")
        if not p or p.startswith(".") or "/" in p or "\0" in p or len(b) > 255:
            return None
    return parts


def fqn_paths(fqns):
    """{fqn: path relative to the checkpoint} for a set of FQNs, the same on
    every rank: the FQN's parts as directories where that is possible,
    else _fqn/<sha1> (see the module's docstring)."""
    fqns = sorted(set(fqns))
    safe = {f: _safe_parts(f) for f in fqns}
    dirs = set()
    for parts in safe.values():
        if parts:
            for i in range(1, len(parts)):
                dirs.add("/".join(parts[:i]))
    tops = {parts[0] for parts in safe.values() if parts}
    prefix = "_fqn"
    k = 0
    while prefix in tops:
        k += 1
        prefix = f"_fqn{k}"
    out = {}
    for f in fqns:
        parts = safe[f]
        path = "/".join(parts) if parts else None
        if path is None or path in dirs:
            digest = hashlib.sha1(f.encode("utf-8", "surrogateescape")).hexdigest()
            path = f"{prefix}/{digest}"
        out[f] = path
    return out


def _path_fqn(path):
    return path.replace("/", ".")


# ---- file I/O ------------------------------------------------------------------

def _u8(t):
    """A writable uint8 memoryview of contiguous CPU tensor t's bytes
    (little-endian: ckptfs stores little-endian, and moves host bytes)."""
    if sys.byteorder != "little":
        raise CkptfsError("ckptfs.dcp moves tensors as raw host bytes, and this "
                          "host is big-endian; ckptfs stores little-endian")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _read_file(path):
    with open(path, "rb") as f:
        return f.read()


def _csv(xs):
    return ",".join(str(int(x)) for x in xs)


def _write_tensor_file(dirs, rel, t, fqn, global_shape, offsets, explicit_fqn):
    """Stage contiguous CPU tensor t (a chunk at offsets of a tensor of
    global_shape) at rel (its directory made: dirs.make) of the
    checkpoint."""
    xattrs = [("user.ckpt.dtype", _dtype_name(t.dtype, fqn).encode()),
              ("user.ckpt.shape", _csv(global_shape).encode())]
    if any(offsets) or tuple(t.shape) != tuple(global_shape):
        xattrs += [("user.ckpt.offsets", _csv(offsets).encode()),
                   ("user.ckpt.sizes", _csv(t.shape).encode())]
    if explicit_fqn:
        xattrs.append(("user.ckpt.fqn", fqn.encode("utf-8", "surrogateescape")))
    return _write_file(dirs, rel, _u8(t), fqn, xattrs)


def _write_bytes_file(dirs, rel, data, fqn, explicit_fqn):
    xattrs = []
    if explicit_fqn:
        xattrs.append(("user.ckpt.fqn", fqn.encode("utf-8", "surrogateescape")))
    return _write_file(dirs, rel, memoryview(data).cast("B"), fqn, xattrs)


def _write_file(dirs, rel, mv, fqn, xattrs):
    try:
        return dirs.write_file(rel, mv, xattrs, flags=os.O_EXCL)
    except OSError as e:
        raise CkptfsError(f"{fqn}: staging {os.path.join(dirs.ckdir, rel)}: "
                          f"{e.strerror}") from e


def _cpu_contiguous(t):
    if hasattr(t, "to_local"):  # a DTensor: its local shard
        t = t.to_local()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous()


# ---- the writer ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _SaveData:
    """The storage_data of the Writer's global plan, the same for every
    rank: paths {fqn: path in the checkpoint}; replace: NAME is committed,
    so the save is committed with replace=NAME; token: of the working name
    ranks whose mount shows NAME committed stage under."""
    paths: dict
    replace: bool
    token: str


class Writer(StorageWriter):
    """DCP StorageWriter over ckptfs rank mounts.

    mount: the rank's mount, "%r" replaced by the rank ("/mnt/ckpt/rank%r";
    the global rank, whatever process group the save runs on).
    replicas: "check" (the default: every rank writes its copy of a
    replicated item, ckptfs compares them, replica_check, and stores one)
    or "dedup" (only the rank DCP's planner picked writes it, as stock DCP
    does: for replicas that legitimately differ in their bytes, e.g.
    pickles of sets of strings under per-process hash seeds).
    commit: "sync" (the default: write_data returns once the checkpoint is
    committed and durable on every rank) or "async" (it returns once this
    rank's data is frozen; ckptfs finishes the save in the background and
    NAME/.status follows it; wait with ckptfs.wait(mount, name)).
    threads: files staged at once (4, the mount's default io_threads).
    overwrite: as stock DCP's FileSystemWriter (True by default): a save to
    the checkpoint_id of a committed checkpoint replaces it (staged under a
    working name, committed with replace=NAME: atomically, for every
    mount); False: such a save raises before anything is staged.
    """

    def __init__(self, mount, *, commit="sync", replicas="check", threads=4,
                 overwrite=True, checkpoint_id=None):
        super().__init__()
        if commit not in ("sync", "async"):
            raise ValueError(f"commit={commit!r}: use 'sync' or 'async'")
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads={threads!r}: use an int >= 1")
        self.threads = threads
        if replicas not in ("check", "dedup"):
            raise ValueError(f"replicas={replicas!r}: use 'check' or 'dedup'")
        self.mount_spec = os.fspath(mount)
        self.commit_mode = commit
        self.replicas = replicas
        self.overwrite = bool(overwrite)
        self.rank = None
        self.mount = None
        self.is_coordinator = False
        self.name = None
        self.save_id = None
        self._local_items = None
        self.checkpoint_id = None
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    # -- the protocol
    def reset(self, checkpoint_id=None):
        # None keeps the checkpoint this writer was given (stock
        # FileSystemWriter keeps its path): DCP's deprecated
        # save_state_dict calls reset() with no id
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
            self.name = checkpoint_name(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._local_items = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        try:
            checkpoint_name(checkpoint_id)
            return True
        except (ValueError, TypeError):
            return False

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        # DCP passes rank=, its rank in the save's process group (0 without
        # one); a mount belongs to a global rank (see default_rank).
        self.is_coordinator = is_coordinator
        self.rank = default_rank()
        self.mount = rank_mount(self.mount_spec, self.rank)
        if self.name is None:
            raise ValueError("ckptfs.dcp.Writer: pass checkpoint_id=NAME to "
                             "dcp.save (the checkpoint's name in the mount)")
        checkpoint_name(self.checkpoint_id, self.mount)  # a path elsewhere: refused
        # the mount checked before anything is planned: alive (a dead one
        # is named as one, ENOTCONN), a ckptfs mount, of this world and rank
        check_dir(self.mount, f"rank {self.rank}: ")
        _check_world(self.mount, self.rank, default_world_size(), saving=True)
        job.declare(self.mount)  # its leftovers are abandoned if this process dies

    def storage_meta(self):
        return StorageMeta(checkpoint_id=self.name, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Refused before anything is staged (DCP raises it on every rank):
        # a NAME that exists, as stock DCP's FileSystemWriter does without
        # overwrite, and one whose earlier save still commits on this mount.
        st = self._state_here()
        if st == "committing":
            raise CkptfsError(
                f"rank {self.rank}: checkpoint {self.name!r} is still being "
                f"committed in {self.mount} by an earlier save: wait for it "
                "(ckptfs.wait, or the future of dcp.async_save) before saving "
                "it again")
        if st == "committed" and not self.overwrite:
            raise CkptfsError(
                f"Checkpoint already exists and self.overwrite=False: checkpoint "
                f"{self.name!r} is committed in {self.mount} (rank {self.rank}); "
                "pass overwrite=True to replace it, or pick another checkpoint_id")
        # DCP's planner keeps one copy of each replica; ckptfs keeps them
        # all and checks them, so write_data writes this whole local plan.
        # A cached plan (enable_plan_caching: usable=False, no items) says
        # nothing new: write_data then writes the final plan it gets.
        if self.replicas == "check" and getattr(plan, "usable", True) and plan.items:
            self._local_items = list(plan.items)
        else:
            self._local_items = None
        return plan

    def prepare_global_plan(self, plans):
        # The coordinator decides for every rank whether this save replaces
        # a committed NAME (what its mount shows is what every mount shows),
        # and gives the token of the working name the ranks stage it under.
        fqns = {it.index.fqn for p in plans for it in p.items}
        replace = self.overwrite and self._state_here() == "committed"
        if replace and not replaceable(self.name):
            raise CkptfsError(_unreplaceable(self.name))
        data = _SaveData(fqn_paths(fqns), replace, self.save_id[:TOKEN_CHARS])
        return [dataclasses.replace(p, storage_data=data) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        fut = Future()
        try:
            fut.set_result(self._write(plan, planner))
        except BaseException as e:  # noqa: B036  (DCP gathers it)
            fut.set_exception(e)
        return fut

    def finish(self, metadata, results):
        # The commit in write_data published the checkpoint: .metadata is
        # ckptfs's own, written by the daemons.
        return None

    # -- the work
    def _state_here(self):
        """NAME's state on this rank's mount ("" when there is none)."""
        return _status(os.path.join(self.mount, self.name))[0]

    def _write(self, plan, planner):
        items = self._local_items if self._local_items is not None else list(plan.items)
        # DCP's plan caching hands write_data the plan of an earlier save,
        # storage_data and all: what it says is checked, not trusted.
        data = plan.storage_data
        if not isinstance(data, _SaveData):
            data = _SaveData(None, False, self.save_id[:TOKEN_CHARS])
        paths = data.paths
        if paths is None or any(it.index.fqn not in paths for it in items):
            paths = fqn_paths({it.index.fqn for it in items})
        ckdir = os.path.join(self.mount, self.name)
        try:
            ckdir = self._make_checkpoint_dir(ckdir, data.token)
        except CkptfsError:
            # Another save's staged checkpoint of this name, left on this
            # rank: fail this save on every rank now (the others wait for
            # this rank's commit), and leave that checkpoint as it is.
            _abort_commit(ckdir, self.name)
            raise
        # replace=NAME where the coordinator saw NAME committed, or where
        # this rank stages under a working name (a staged name other than
        # NAME is published as NAME only with replace=)
        replace = data.replace or os.path.basename(ckdir) != self.name
        words = (f"replace={self.name}",) if replace else ()
        try:
            sizes = self._stage(ckdir, items, paths, planner)
        except BaseException:
            _abort_save(ckdir, self.name, words)  # every rank fails now; discarded
            raise
        try:
            _commit(ckdir, self.name, self.commit_mode, words)
        except CommitError as e:
            aborted = _aborted_elsewhere(e, ckdir, self.name, api="dcp")
            if aborted is not None:
                raise aborted from None
            # a failed DCP save is discarded, so the same id can be saved again
            discarded = _discard_uncommitted(ckdir)
            raise CommitError(e.name, e.status, e.path, discarded=discarded,
                              api="dcp") from None
        except BaseException:
            _abort_save(ckdir, self.name, words)
            raise
        return [WriteResult(index=it.index, size_in_bytes=sizes.get(it.index, 0),
                            storage_data=paths.get(it.index.fqn)) for it in plan.items]

    def _make_checkpoint_dir(self, ckdir, token):
        """Create the directory this rank stages in: ckdir (MOUNT/NAME), or
        a working name of token's when NAME is committed (overwrite); its
        path."""
        try:
            os.mkdir(ckdir)
            return ckdir
        except FileExistsError:
            pass
        except OSError as e:
            raise CkptfsError(f"rank {self.rank}: cannot create {ckdir}: "
                              f"{e.strerror}") from e
        st, text = _status(ckdir)
        if st == "failed":
            # Our own earlier attempt that failed: it stays staged; start over.
            _discard(ckdir)
            os.mkdir(ckdir)
            return ckdir
        if st == "committed" and self.overwrite:
            if not replaceable(self.name):
                raise CkptfsError(f"rank {self.rank}: {_unreplaceable(self.name)}")
            return make_working_dir(self.mount, self.name, token)
        how = {"committed": "pass overwrite=True to replace it, ",
               "committing": "wait for its commit (ckptfs.wait), "}.get(st, "")
        raise CkptfsError(f"rank {self.rank}: checkpoint {self.name!r} already exists "
                          f"in {self.mount} ({st or 'unknown state'}): {how}pick another "
                          "checkpoint_id, or remove it first")

    def _stage(self, ckdir, items, paths, planner):
        stager = _Stager(self.threads)
        with _StagingDirs(ckdir) as dirs:
            try:
                sizes = self._stage_items(dirs, items, paths, planner, stager)
            except BaseException:
                stager.abandon()
                raise
            stager.done()
        return sizes

    def _stage_items(self, dirs, items, paths, planner, stager):
        """Stage the items, their writes on stager's threads; {index: bytes
        stored}. The planner's calls stay on this thread."""
        sizes = {}
        by_fqn = {}
        for it in items:
            by_fqn.setdefault(it.index.fqn, []).append(it)
        for fqn, group in by_fqn.items():
            base = paths[fqn]
            # Tensor chunks always carry user.ckpt.fqn: another rank may hold
            # several chunks of this FQN at several paths, which ckptfs
            # accepts only when every chunk names its FQN.
            explicit = _path_fqn(base) != fqn
            if group[0].type == WriteItemType.BYTE_IO:
                if len(group) > 1:
                    raise CkptfsError(f"{fqn}: {len(group)} bytes items under one FQN")
                data = planner.resolve_data(group[0])
                buf = data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data)
                dirs.make(os.path.dirname(base))
                sizes[group[0].index] = len(memoryview(buf).cast("B"))
                stager.submit(_write_bytes_file, dirs, base, buf, fqn, explicit)
                continue
            explicit = True
            group.sort(key=lambda it: tuple(it.tensor_data.chunk.offsets))
            for k, it in enumerate(group):
                td = it.tensor_data
                offsets = tuple(td.chunk.offsets)
                rel = base
                if k > 0:
                    rel = f"{base}@{'_'.join(str(o) for o in offsets)}"
                    if len(os.path.basename(rel).encode()) > 255:
                        digest = hashlib.sha1(fqn.encode("utf-8", "surrogateescape"))
                        rel = os.path.join(os.path.dirname(base),
                                           f"@{digest.hexdigest()[:16]}_{k}")
                t = _cpu_contiguous(planner.resolve_data(it))
                if tuple(t.shape) != tuple(td.chunk.sizes):
                    raise CkptfsError(f"{fqn}: the planner gave a chunk of shape "
                                      f"{tuple(t.shape)}, its plan says "
                                      f"{tuple(td.chunk.sizes)}")
                dirs.make(os.path.dirname(rel))
                sizes[it.index] = t.numel() * t.element_size()
                stager.submit(_write_tensor_file, dirs, rel, t, fqn, td.size,
                              offsets, explicit)
        return sizes


# ---- the reader ----------------------------------------------------------------

def _open_metadata(ckdir):
    path = os.path.join(ckdir, ".metadata")
    if not os.path.exists(path):
        st, text = _status(ckdir)
        raise CkptfsError(f"{ckdir}: no committed checkpoint there"
                          + (f" (.status: {st})" if st else ""))
    return sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)


def _dims(text):
    text = (text or "").strip()
    if text in ("", "[]"):
        return ()
    return tuple(int(x) for x in text.strip("[]").split(",") if x.strip() != "")


def read_catalog(ckdir):
    """(tensors {fqn: (path, dtype name, shape)}, blobs {fqn: path}) of a
    committed checkpoint, from its .metadata."""
    con = _open_metadata(ckdir)
    try:
        tensors = {f: (p, dt, _dims(sh)) for f, p, dt, sh in
                   con.execute("SELECT fqn, path, dtype, shape FROM tensors")}
        blobs = dict(con.execute("SELECT fqn, path FROM blobs"))
    finally:
        con.close()
    return tensors, blobs


def _strides(shape):
    st = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        st[i] = st[i + 1] * shape[i + 1]
    return st


def _contiguous_start(shape, offsets, lengths):
    """Element index where block (offsets, lengths) starts when it is one
    contiguous run of the row-major tensor, else None."""
    n = len(shape)
    d = 0
    while d < n and lengths[d] == 1:
        d += 1
    # dims after d must be whole
    for j in range(d + 1, n):
        if lengths[j] != shape[j] or offsets[j] != 0:
            return None
    st = _strides(shape)
    return sum(o * s for o, s in zip(offsets, st))


def read_block(path, dtype, shape, offsets, lengths, out=None):
    """The block [offsets, offsets+lengths) of the committed tensor at path
    (dtype torch dtype, shape its global shape), as a contiguous tensor
    (into out when given: contiguous, that dtype and shape)."""
    shape, offsets, lengths = tuple(shape), tuple(offsets), tuple(lengths)
    if out is None:
        out = torch.empty(lengths, dtype=dtype)
    mv = _u8(out)
    if len(mv) == 0:
        return out
    isz = out.element_size()
    start = _contiguous_start(shape, offsets, lengths)
    if start is not None:
        fd = os.open(path, os.O_RDONLY)
        try:
            _pread_into(fd, mv, start * isz, path)
        finally:
            os.close(fd)
        return out
    bpath = block_file(path, offsets, lengths)
    try:
        fd = os.open(bpath, os.O_RDONLY)
    except OSError as e:  # no block files here, or a name too long for one
        if e.errno not in (errno.ENOENT, errno.ENAMETOOLONG):
            raise
        fd = None
    if fd is not None:
        try:
            _pread_into(fd, mv, 0, bpath)
        finally:
            os.close(fd)
        return out
    # A ckptfs without block files: read rows of the outermost dimension
    # in groups, each group one contiguous span, and copy the block out.
    st = _strides(shape)
    row = st[0] * isz
    span_rows = max(1, IO_STEP // max(row, 1))
    fd = os.open(path, os.O_RDONLY)
    try:
        r = 0
        while r < lengths[0]:
            n = min(span_rows, lengths[0] - r)
            buf = torch.empty((n,) + shape[1:], dtype=dtype)
            _pread_into(fd, _u8(buf), (offsets[0] + r) * row, path)
            part = buf
            for k in range(1, len(shape)):
                part = part.narrow(k, offsets[k], lengths[k])
            out.narrow(0, r, n).copy_(part)
            r += n
    finally:
        os.close(fd)
    return out


def _item_bytes(dt, lengths):
    return _TORCH[dt].itemsize * math.prod(lengths) if dt in _TORCH else 0


class Reader(StorageReader):
    """DCP StorageReader over ckptfs rank mounts (any world size: every
    mount shows the whole committed checkpoint). The mount is checked at
    the first read (read_metadata, set_up_storage_reader), before
    anything is read: alive (a dead one is named as one, ENOTCONN), a
    ckptfs mount, and under torch.distributed this rank's mount in a
    world of the trainer's size.

    mount: the rank's mount, "%r" replaced by the rank. threads: how many
    reads run at once (FUSE serves them in parallel). progress: a
    callable(done_bytes, total_bytes) called with (0, total) first and as
    this rank's items are read, done ending at total (the bytes of this
    rank's load plan); True or "tqdm": a tqdm bar (the tqdm package must
    be installed; e.g. progress=(rank == 0) for one bar); None: nothing."""

    def __init__(self, mount, *, threads=4, checkpoint_id=None, progress=None):
        super().__init__()
        self.mount_spec = os.fspath(mount)
        self.threads = max(1, int(threads))
        _check_progress(progress)
        self.progress = progress
        self.rank = None
        self.name = None
        self.checkpoint_id = None
        self._checked = None  # the mount _ckdir checked
        self._tensors = None
        self._blobs = None
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    def reset(self, checkpoint_id=None):
        # None keeps the checkpoint this reader was given (as the Writer's)
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
            self.name = checkpoint_name(checkpoint_id)
        self._tensors = self._blobs = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return Writer.validate_checkpoint_id(checkpoint_id)

    def _ckdir(self):
        if self.rank is None:
            self.rank = default_rank()  # the global rank, as the Writer
        if self.name is None:
            raise ValueError("ckptfs.dcp.Reader: pass checkpoint_id=NAME to dcp.load")
        mount = rank_mount(self.mount_spec, self.rank)
        checkpoint_name(self.checkpoint_id, mount)  # a path elsewhere: refused
        if self._checked != mount:
            # before anything is read: alive (a dead mount is named as
            # one, ENOTCONN) and a ckptfs mount; a lone reader may read any
            # rank's mount (each shows the whole checkpoint), a trainer's
            # ranks must each read their own, of their world's size
            check_dir(mount, f"rank {self.rank}: ")
            trainer = dist.is_available() and dist.is_initialized()
            why = world_mismatch(mount, self.rank if trainer else None,
                                 dist.get_world_size() if trainer else None, saving=True)
            if why:
                raise CkptfsError(f"rank {self.rank}: {why}")
            self._checked = mount
        return os.path.join(mount, self.name)

    def read_metadata(self, *args, **kwargs):
        ckdir = self._ckdir()
        self._tensors, self._blobs = read_catalog(ckdir)
        md = {}
        storage = {}
        for fqn, (path, dt, shape) in self._tensors.items():
            if dt not in _TORCH:
                raise CkptfsError(f"{fqn}: dtype {dt} is not available in this torch")
            size = torch.Size(shape)
            zeros = torch.Size([0] * len(shape))
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_TORCH[dt]), size=size,
                chunks=[ChunkStorageMetadata(offsets=zeros, sizes=size)])
            storage[MetadataIndex(fqn, zeros)] = path
        for fqn, path in self._blobs.items():
            md[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = path
        return Metadata(state_dict_metadata=md,
                        planner_data={f: tuple(f.split(".")) for f in md},
                        storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=self.name,
                                                 load_id=uuid.uuid4().hex))

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        if self._tensors is None:
            self._tensors, self._blobs = read_catalog(self._ckdir())

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        fut = Future()
        try:
            self._read(plan, planner)
            fut.set_result(None)
        except BaseException as e:  # noqa: B036
            fut.set_exception(e)
        return fut

    def _read(self, plan, planner):
        ckdir = self._ckdir()
        with _Progress(self.progress, self._plan_bytes(ckdir, plan),
                       f"load {self.name}") as prog:
            self._read_items(ckdir, plan, planner, prog)

    def _plan_bytes(self, ckdir, plan):
        """The bytes plan reads: its tensor blocks and bytes items."""
        total = 0
        for ri in plan.items:
            fqn = ri.storage_index.fqn
            if ri.type == LoadItemType.BYTE_IO:
                if fqn not in self._blobs:
                    raise CkptfsError(f"{fqn}: not a bytes item of {ckdir}")
                total += os.path.getsize(os.path.join(ckdir, self._blobs[fqn]))
            else:
                if fqn not in self._tensors:
                    raise CkptfsError(f"{fqn}: not a tensor of {ckdir}")
                total += _item_bytes(self._tensors[fqn][1], ri.lengths)
        return total

    def _read_items(self, ckdir, plan, planner, prog):
        lock = threading.Lock()
        tensors = []
        for ri in plan.items:
            fqn = ri.storage_index.fqn
            if ri.type == LoadItemType.BYTE_IO:
                data = _read_file(os.path.join(ckdir, self._blobs[fqn]))
                planner.load_bytes(ri, io.BytesIO(data))
                prog.add(len(data))
            else:
                tensors.append(ri)

        def one(ri):
            fqn = ri.storage_index.fqn
            path, dt, shape = self._tensors[fqn]
            dtype = _TORCH[dt]
            with lock:
                target = planner.resolve_tensor(ri).detach()
            lengths = tuple(ri.lengths)
            if tuple(target.shape) != lengths:
                raise CkptfsError(f"{fqn}: the load plan wants {lengths}, its "
                                  f"target is {tuple(target.shape)}")
            if (target.dtype == dtype and target.device.type == "cpu"
                    and target.is_contiguous()):
                read_block(os.path.join(ckdir, path), dtype, shape,
                           ri.storage_offsets, lengths, out=target)
            else:
                blk = read_block(os.path.join(ckdir, path), dtype, shape,
                                 ri.storage_offsets, lengths)
                target.copy_(blk)
            with lock:
                planner.commit_tensor(ri, target)
            prog.add(_item_bytes(dt, lengths))

        if self.threads == 1 or len(tensors) <= 1:
            for ri in tensors:
                one(ri)
        else:
            with ThreadPoolExecutor(min(self.threads, len(tensors))) as ex:
                for f in [ex.submit(one, ri) for ri in tensors]:
                    f.result()


# ---- moving checkpoints between ckptfs and stock DCP directories ----------

def _mountinfo():
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            out[mp] = (fields[sep + 1], fields[sep + 2])
    return out


def _is_ckptfs_mount(path):
    info = _mountinfo().get(os.path.realpath(path))
    return info is not None and info[0] == "fuse.ckptfs"


def _binary(binary=None):
    import shutil
    cand = binary or os.environ.get("CKPTFS_BIN") or shutil.which("ckptfs")
    if not cand or not os.access(cand, os.X_OK):
        raise CkptfsError("no ckptfs binary to mount BACKING_DIR with: pass binary=, "
                          "set CKPTFS_BIN, or put ckptfs on PATH")
    return cand


class _Mounted:
    """target itself when it is a ckptfs mount (it must be a world of one
    rank: the commit is collective), else a one-rank mount of target (a
    BACKING_DIR) on a temporary directory for the duration."""

    def __init__(self, target, binary=None, timeout=60):
        self.target = os.fspath(target)
        self.binary = binary
        self.timeout = timeout
        self.proc = None
        self.tmp = None

    def __enter__(self):
        import subprocess
        import tempfile
        import time
        if _is_ckptfs_mount(self.target):
            return self.target
        if not os.path.isdir(self.target):
            if not os.path.isdir(os.path.dirname(os.path.abspath(self.target))):
                raise CkptfsError(f"{self.target}: neither a ckptfs mount nor a "
                                  "BACKING_DIR (nor in an existing directory)")
            os.mkdir(self.target)
        self.tmp = tempfile.mkdtemp(prefix="ckptfs-dcp-")
        self.log = open(os.path.join(self.tmp + ".log"), "w+b")
        mnt = os.path.join(self.tmp, "mnt")
        os.mkdir(mnt)
        self.proc = subprocess.Popen([_binary(self.binary), "-f", self.target, mnt],
                                     stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while not _is_ckptfs_mount(mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._close()
                raise CkptfsError(f"cannot mount {self.target}: {self._log_text()}")
            time.sleep(0.02)
        self.mnt = mnt
        return mnt

    def _log_text(self):
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

    def _close(self):
        import shutil
        import subprocess
        if self.proc is not None:
            mnt = os.path.join(self.tmp, "mnt")
            for _ in range(100):
                if not _is_ckptfs_mount(mnt):
                    break
                if subprocess.run(["fusermount3", "-u", mnt],
                                  capture_output=True).returncode == 0:
                    break
                import time
                time.sleep(0.1)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.tmp:
            self.log.close()
            os.unlink(self.tmp + ".log")
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def __exit__(self, *exc):
        self._close()
        return False


# ---- reading a stock DCP directory that anyone may own -------------------------
#
# import-dcp runs as root on directories other users write. DCP's
# FileSystemReader unpickles .metadata with pickle.load (any global, so any
# code) and opens DCP_DIR/relative_path (an absolute path, '..' or a symlink
# reads any file). The import reads .metadata with _MetadataUnpickler and
# every item through a descriptor of DCP_DIR, by plain name, O_NOFOLLOW.

# The classes of torch.distributed.checkpoint.metadata a .metadata holds.
_DCP_METADATA_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                         "StorageMeta", "_MEM_FORMAT_ENCODING")
_MEMORY_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d",
                   "preserve_format")
_admitted = {}


def _layout_by_name(name):
    """torch.serialization._get_layout for the unpickler: a torch.layout by
    its str(), nothing else."""
    for v in vars(torch).values():
        if isinstance(v, torch.layout) and str(v) == name:
            return v
    raise pickle.UnpicklingError(f"{name!r} is not a torch.layout")


def _admitted_globals():
    """{(module, name): object}: everything _MetadataUnpickler resolves.
    Nothing is imported or looked up by the pickle's names."""
    if _admitted:
        return _admitted
    import collections
    import pathlib
    from torch.distributed.checkpoint import filesystem, metadata
    g = {}
    for n in _DCP_METADATA_CLASSES:
        if hasattr(metadata, n):
            g[("torch.distributed.checkpoint.metadata", n)] = getattr(metadata, n)
    g[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    g[("torch", "Size")] = torch.Size
    for n, v in vars(torch).items():
        if isinstance(v, (torch.dtype, torch.layout)):
            g[("torch", n)] = v
    # A memory_format pickles as the global "torch.NAME" of whichever
    # loaded module pickle found holding `torch` (torch._utils in 2.13).
    for n in _MEMORY_FORMATS:
        g[("torch", n)] = getattr(torch, n)
        for mod in ("torch._utils", "torch.serialization", "torch.distributed.checkpoint.metadata"):
            g[(mod, f"torch.{n}")] = getattr(torch, n)
    g[("torch.serialization", "_get_layout")] = _layout_by_name
    g[("collections", "OrderedDict")] = collections.OrderedDict
    for mod in ("pathlib", "pathlib._local"):  # checkpoint_id as a Path (3.13: _local)
        g[(mod, "PosixPath")] = pathlib.PosixPath
        g[(mod, "PurePosixPath")] = pathlib.PurePosixPath
    g[("builtins", "set")] = set
    g[("builtins", "frozenset")] = frozenset
    # Some Python 3.11 releases (Debian 12's 3.11.2; not 3.11.7) pickle an enum member as
    # getattr(ENUM_CLASS, "NAME"): a lookup of members of admitted enums only
    enums = {v for v in g.values() if isinstance(v, type) and issubclass(v, enum.Enum)}
    g[("builtins", "getattr")] = functools.partial(_enum_member, frozenset(enums))
    _admitted.update(g)
    return _admitted


def _enum_member(enums, cls, name):
    """getattr(cls, name) as an enum's pickle asks for it: cls one of the
    admitted enums, name one of its members' names; else refused."""
    if cls not in enums or not isinstance(name, str) or name not in cls.__members__:
        raise CkptfsError(f"refused getattr({cls!r}, {name!r}) in a DCP .metadata: only "
                          "a member of an admitted enum is looked up; nothing of it was run")
    return cls.__members__[name]


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP .metadata admitting only the globals DCP puts there
    (torch 2.13's dcp.save, checked with pickletools):

    - torch.distributed.checkpoint.metadata: Metadata, TensorStorageMetadata,
      BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
      MetadataIndex, StorageMeta, _MEM_FORMAT_ENCODING (TensorProperties'
      memory format);
    - torch.distributed.checkpoint.filesystem._StorageInfo;
    - torch.Size; torch's dtypes and layouts (torch.float32, torch.strided,
      ...); torch.serialization._get_layout (as a lookup of torch's layouts
      by name only); the memory formats (torch.contiguous_format,
      channels_last, channels_last_3d, preserve_format) as older torch
      pickled them;
    - collections.OrderedDict; pathlib.PosixPath and PurePosixPath (a
      checkpoint_id given as a Path);
    - builtins set and frozenset (dicts, lists, tuples, strings, numbers,
      bytes, True/False/None are pickle opcodes, not globals);
    - builtins.getattr only as a stand-in that looks up a member of an
      admitted enum by name (how Debian 12's Python 3.11.2 pickles enums).

    Any other global, and any persistent id, raises CkptfsError naming it
    before anything is called."""

    def __init__(self, file, where):
        super().__init__(file)
        self.where = where

    def find_class(self, module, name):
        try:
            return _admitted_globals()[(module, name)]
        except KeyError:
            raise CkptfsError(
                f"{self.where}: refused global {module}.{name}: a DCP .metadata may "
                "hold only DCP's metadata classes, torch.Size, torch dtypes, layouts "
                "and memory formats, OrderedDict, PosixPath, set and frozenset "
                "(docs/pytorch.md); nothing of it was run") from None

    def persistent_load(self, pid):
        raise CkptfsError(f"{self.where}: refused persistent id {pid!r}: a DCP "
                          ".metadata has none")


def _plain_name(rel):
    """rel names a file directly inside the directory: not empty, not
    . or .., no '/', no NUL, at most 255 bytes."""
    return (isinstance(rel, str) and rel not in ("", ".", "..") and "/" not in rel
            and "\0" not in rel and len(rel.encode("utf-8", "surrogateescape")) <= 255)


def _open_item(dirfd, name, where):
    """The regular file NAME directly in directory dirfd, opened for reading
    without following a symlink (a FIFO does not block the open)."""
    if not _plain_name(name):
        raise CkptfsError(f"{where}: item file {name!r} refused: items must be plain "
                          "file names inside DCP_DIR")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dirfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CkptfsError(f"{where}: item file {name!r} refused: it is a symbolic "
                              "link (items are read only as regular files in DCP_DIR)") from None
        raise CkptfsError(f"{where}: item file {name!r}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CkptfsError(f"{where}: item file {name!r} refused: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_dims(xs, what):
    if not isinstance(xs, (tuple, list)) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs):
        raise CkptfsError(f"{what}: not a list of non-negative integers: {xs!r}")


def _check_metadata(md, dirfd, where):
    """Refuse (CkptfsError) a .metadata that is not the DCP metadata the
    import understands, whose items are not regular files named plainly
    in DCP_DIR, or whose sizes those files do not back; nothing is read
    from the items, only their sizes.

    Every tensor's chunks must tile it exactly (check_tiling); every
    chunk, and every bytes item, must have its storage_data entry, inside
    its file's size, the entries of different chunks and items not
    sharing bytes; and a chunk's entry must be at least as long as the
    chunk's elements' bytes. That bound is exact for what DCP writes
    (torch 2.13's FileSystemWriter): a chunk is the torch.save of a
    tensor whose storage is the chunk's bytes (it clones any other), and
    torch.save's zip stores its entries uncompressed (ZIP_STORED), after
    a pickle; with serialization_format=SAFETENSORS the length it records
    is those bytes exactly; there is no transform (compression) unless
    the writer is given _extensions, and entries with transforms are
    refused. So the tensors' total size is at most the item files' total
    size, whatever the .metadata claims: a 1 KiB .metadata cannot make
    the import (root) allocate and write terabytes."""
    if not isinstance(md, Metadata):
        raise CkptfsError(f"{where}: not a DCP Metadata but a {type(md).__name__}")
    sdm, storage = md.state_dict_metadata, md.storage_data
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise CkptfsError(f"{where}: state_dict_metadata and storage_data must be dicts")
    for fqn, m in sdm.items():
        if not isinstance(fqn, str):
            raise CkptfsError(f"{where}: FQN {fqn!r} is not a string")
        if isinstance(m, TensorStorageMetadata):
            dt = getattr(m.properties, "dtype", None)
            if not isinstance(dt, torch.dtype):
                raise CkptfsError(f"{where}: {fqn}: no torch dtype")
            _dtype_name(dt, f"{where}: tensor {fqn!r}")
            _check_dims(m.size, f"{where}: {fqn}: size")
            if not isinstance(m.chunks, (list, tuple)):
                raise CkptfsError(f"{where}: {fqn}: chunks is not a list")
            for c in m.chunks:
                if not isinstance(c, ChunkStorageMetadata):
                    raise CkptfsError(f"{where}: {fqn}: a chunk is a {type(c).__name__}, "
                                      "not a ChunkStorageMetadata")
                _check_dims(c.offsets, f"{where}: {fqn}: chunk offsets")
                _check_dims(c.sizes, f"{where}: {fqn}: chunk sizes")
        elif not isinstance(m, BytesStorageMetadata):
            raise CkptfsError(f"{where}: {fqn}: unknown item type {type(m).__name__}")
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    names = set()
    for idx, info in storage.items():
        what = f"{where}: {getattr(idx, 'fqn', idx)}"
        if not isinstance(idx, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CkptfsError(f"{what}: storage_data entry is not MetadataIndex -> _StorageInfo")
        if not isinstance(idx.fqn, str):
            raise CkptfsError(f"{what}: storage_data entry's FQN is not a string")
        if idx.offset is not None:
            _check_dims(idx.offset, f"{what}: storage_data entry's offset")
        if not _plain_name(info.relative_path):
            raise CkptfsError(f"{what}: relative_path {info.relative_path!r} refused: "
                              "items must be plain file names inside DCP_DIR (no '/', "
                              "no '..', not absolute, not empty)")
        _check_dims((info.offset, info.length), f"{what}: offset, length")
        if getattr(info, "transform_descriptors", None):
            raise CkptfsError(f"{what}: stored with transforms "
                              f"{info.transform_descriptors}: not supported")
        names.add(info.relative_path)
    file_size = {}
    for n in sorted(names):
        try:
            st = os.stat(n, dir_fd=dirfd, follow_symlinks=False)
        except OSError as e:
            raise CkptfsError(f"{where}: item file {n!r}: {e.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            raise CkptfsError(f"{where}: item file {n!r} refused: it is a symbolic link "
                              "(items are read only as regular files in DCP_DIR)")
        if not stat.S_ISREG(st.st_mode):
            raise CkptfsError(f"{where}: item file {n!r} refused: not a regular file")
        file_size[n] = st.st_size
    ranges = []  # (file, start, end, who) of every entry the import reads

    def stored(label, key, need=0, elements=""):
        what = f"{where}: {label}"
        info = storage.get(key)
        if info is None:
            raise CkptfsError(f"{what} has no storage_data entry")
        n, off, length = info.relative_path, info.offset, info.length
        if off + length > file_size[n]:
            raise CkptfsError(f"{what} is stored at bytes {off}..{off + length} of {n!r}, "
                              f"past the end of that file ({file_size[n]} bytes)")
        if length < need:
            raise CkptfsError(f"{what} needs {need} bytes ({elements}) but is stored in "
                              f"{length} bytes of {n!r}: its size is not backed by the item "
                              "files (a chunk's torch.save holds every element's bytes)")
        if length:
            ranges.append((n, off, off + length, label))

    for fqn, m in sdm.items():
        if isinstance(m, BytesStorageMetadata):
            stored(f"bytes item {fqn!r}", MetadataIndex(fqn))
            continue
        what = f"{where}: tensor {fqn!r}"
        size = tuple(m.size)
        vols = check_tiling(what, size, m.chunks)
        esize = m.properties.dtype.itemsize
        for i, (c, v) in enumerate(zip(m.chunks, vols)):
            if v:
                stored(f"tensor {fqn!r} (size {dims_text(size)}): {chunk_desc(i, c)}",
                       MetadataIndex(fqn, torch.Size(c.offsets)), v * esize,
                       f"{v} elements of {m.properties.dtype}")
            elif MetadataIndex(fqn, torch.Size(c.offsets)) not in storage:
                raise CkptfsError(f"{what}: {chunk_desc(i, c)} has no storage_data entry")
    ranges.sort()
    for a, b in zip(ranges, ranges[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            raise CkptfsError(f"{where}: {b[3]} and {a[3]} share stored bytes ({b[1]}..{a[2]} "
                              f"of {a[0]!r}): the item files do not back their total size")


def read_dcp_metadata(dirfd, where):
    """The checked Metadata of the stock DCP directory open at dirfd (where:
    its path, for messages): unpickled by _MetadataUnpickler, every item a
    regular file named plainly in the directory (_check_metadata)."""
    with _open_item(dirfd, ".metadata", where) as f:
        try:
            md = _MetadataUnpickler(f, f"{where}/.metadata").load()
        except CkptfsError:
            raise
        except Exception as e:  # noqa: BLE001  (a malformed pickle, any kind)
            raise CkptfsError(f"{where}/.metadata: not a DCP metadata pickle: "
                              f"{type(e).__name__}: {e}") from None
    _check_metadata(md, dirfd, where)
    return md


class _BeneathFS(FileSystem):
    """DCP's FileSystem, reading only plain names in one directory through
    its descriptor (_open_item)."""

    def __init__(self, dirfd, root, where):
        super().__init__()
        self.dirfd, self.root, self.where = dirfd, Path(root), where

    @contextmanager
    def create_stream(self, path, mode):
        path = Path(path)
        if mode != "rb" or path.parent != self.root:
            raise CkptfsError(f"{self.where}: refused to open {str(path)!r} ({mode})")
        with _open_item(self.dirfd, path.name, self.where) as f:
            yield f


class _DcpDirReader(FileSystemReader):
    """FileSystemReader of a DCP directory with its metadata already read
    by read_dcp_metadata, its items opened through _BeneathFS."""

    def __init__(self, dcp_dir, dirfd, metadata):
        super().__init__(dcp_dir)
        self.fs = _BeneathFS(dirfd, self.path, dcp_dir)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        return self._metadata


def import_checkpoint(dcp_dir, target, name, *, binary=None, batch_bytes=1 << 30):
    """Bring the checkpoint that stock DCP (dcp.save with FileSystemWriter)
    wrote to dcp_dir into ckptfs as NAME, bit for bit: every tensor whole
    (assembled by DCP's own reader from torch.save'd chunks of any stride),
    every bytes/object item with its stored bytes unchanged. target: a
    one-rank ckptfs mount, or a BACKING_DIR (mounted for the import).
    Tensors are read batch_bytes at a time.

    dcp_dir may belong to anyone: its .metadata is read by
    _MetadataUnpickler (DCP's classes only, nothing run) and its items
    only as regular files named plainly in it, never through a symlink;
    each tensor's chunks must tile it exactly and every size be backed by
    the item files' sizes (_check_metadata); anything else is refused
    before NAME is created, before target is mounted (or made)."""
    name = checkpoint_name(name)
    dirfd = os.open(dcp_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        md = read_dcp_metadata(dirfd, dcp_dir)
        with _Mounted(target, binary) as mnt:
            _import_into(mnt, name, dcp_dir, dirfd, md, batch_bytes)
    finally:
        os.close(dirfd)
    return name


def _import_into(mnt, name, dcp_dir, dirfd, md, batch_bytes):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    sdm = md.state_dict_metadata
    paths = fqn_paths(sdm)
    ckdir = os.path.join(mnt, name)
    try:
        os.mkdir(ckdir)
    except FileExistsError:
        raise CkptfsError(f"{name}: a checkpoint of that name exists in {mnt}") from None
    dirs = None
    try:
        dirs = _StagingDirs(ckdir)
        for fqn, m in sdm.items():
            if isinstance(m, BytesStorageMetadata):
                info = md.storage_data[MetadataIndex(fqn)]
                with _open_item(dirfd, info.relative_path, dcp_dir) as f:
                    f.seek(info.offset)
                    data = f.read(info.length)
                if len(data) != info.length:
                    raise CkptfsError(f"{fqn}: {info.relative_path} is truncated")
                dirs.make(os.path.dirname(paths[fqn]))
                _write_bytes_file(dirs, paths[fqn], data, fqn, _path_fqn(paths[fqn]) != fqn)
        batch, size = {}, 0
        tensors = [(f, m) for f, m in sdm.items() if isinstance(m, TensorStorageMetadata)]
        for i, (fqn, m) in enumerate(tensors):
            t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            batch[fqn] = t
            size += t.numel() * t.element_size()
            if size >= batch_bytes or i == len(tensors) - 1:
                dcp_load(batch, storage_reader=_DcpDirReader(dcp_dir, dirfd, md),
                         planner=DefaultLoadPlanner(allow_partial_load=True),
                         no_dist=True)
                for f, bt in batch.items():
                    m_ = sdm[f]
                    dirs.make(os.path.dirname(paths[f]))
                    _write_tensor_file(dirs, paths[f], bt, f, tuple(m_.size),
                                       (0,) * len(m_.size), _path_fqn(paths[f]) != f)
                batch, size = {}, 0
        dirs.close()
        _commit(ckdir, name, "sync")
    except BaseException:
        if dirs is not None:
            dirs.close()
        try:
            if _status(ckdir)[0] in ("staging", "failed"):
                _discard(ckdir)
        except OSError:
            pass
        raise


def export_checkpoint(source, name, dcp_dir, *, binary=None):
    """Write committed checkpoint NAME (source: a ckptfs mount, or a
    BACKING_DIR, mounted for the export) to dcp_dir as stock DCP does
    (one __0_0.distcp of torch.save'd tensors and the bytes items, and a
    pickled .metadata), so dcp.load(checkpoint_id=dcp_dir) reads it at any
    world size. Bytes items that are not torch.save output (files written
    by other tools) are stored as a torch.save'd bytes object.

    dcp_dir may belong to anyone: its files are created through a
    descriptor of it, never through a symlink planted there."""
    from torch.distributed.checkpoint._version import _derived_version
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    name = checkpoint_name(name)
    os.makedirs(dcp_dir, exist_ok=True)
    dirfd = os.open(dcp_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _export_into(source, name, dcp_dir, dirfd, binary)
    finally:
        os.close(dirfd)
    return dcp_dir


def _create_new(dirfd, name):
    """A new file NAME in directory dirfd for writing (a stale one, or a
    symlink planted under that name, is removed first, not followed)."""
    try:
        os.unlink(name, dir_fd=dirfd)
    except FileNotFoundError:
        pass
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644, dir_fd=dirfd)
    return os.fdopen(fd, "wb")


def _export_into(source, name, dcp_dir, dirfd, binary):
    from torch.distributed.checkpoint._version import _derived_version
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    try:
        os.stat(".metadata", dir_fd=dirfd, follow_symlinks=False)
        raise CkptfsError(f"{dcp_dir} already holds a DCP checkpoint (.metadata)")
    except FileNotFoundError:
        pass
    data_name = "__0_0.distcp"
    md = {}
    storage = {}
    with _Mounted(source, binary) as mnt:
        ckdir = os.path.join(mnt, name)
        tensors, blobs = read_catalog(ckdir)
        tmp = data_name + ".tmp"
        with _create_new(dirfd, tmp) as out:
            for fqn, (path, dt, shape) in sorted(tensors.items()):
                if dt not in _TORCH:
                    raise CkptfsError(f"{fqn}: dtype {dt} is not available in this torch")
                t = read_block(os.path.join(ckdir, path), _TORCH[dt], shape,
                               (0,) * len(shape), shape)
                buf = io.BytesIO()
                torch.save(t, buf)
                off = out.tell()
                out.write(buf.getbuffer())
                size = torch.Size(shape)
                zeros = torch.Size([0] * len(shape))
                md[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=_TORCH[dt]), size=size,
                    chunks=[ChunkStorageMetadata(offsets=zeros, sizes=size)])
                storage[MetadataIndex(fqn, zeros)] = _StorageInfo(data_name, off,
                                                                  len(buf.getbuffer()))
            for fqn, path in sorted(blobs.items()):
                data = _read_file(os.path.join(ckdir, path))
                if not data.startswith(b"PK\x03\x04"):
                    b = io.BytesIO()
                    torch.save(data, b)
                    data = b.getvalue()
                off = out.tell()
                out.write(data)
                md[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = _StorageInfo(data_name, off, len(data))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, data_name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    meta = Metadata(state_dict_metadata=md,
                    planner_data={f: tuple(f.split(".")) for f in md},
                    storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=dcp_dir, save_id=uuid.uuid4().hex))
    try:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
        meta.version = CURRENT_DCP_VERSION
    except ImportError:
        meta.version = _derived_version
    tmp = ".metadata.tmp"
    with _create_new(dirfd, tmp) as f:
        pickle.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ".metadata", src_dir_fd=dirfd, dst_dir_fd=dirfd)


REFUSED = 3  # main's exit status when it printed its error (ckptctl says so)


def main(argv=None):
    """ckptfs-dcp import DCP_DIR TARGET NAME | export SOURCE NAME DCP_DIR"""
    import argparse
    ap = argparse.ArgumentParser(prog="ckptfs-dcp", description=(
        "Move checkpoints between ckptfs and stock torch.distributed.checkpoint "
        "directories. TARGET/SOURCE: a one-rank ckptfs mount, or a BACKING_DIR "
        "(mounted for the duration with the ckptfs binary: --bin, $CKPTFS_BIN "
        "or PATH)."))
    ap.add_argument("--bin", default=None, help="the ckptfs binary")
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("import", help="a stock DCP directory into ckptfs as NAME")
    i.add_argument("dcp_dir")
    i.add_argument("target")
    i.add_argument("name")
    e = sub.add_parser("export", help="committed NAME to a stock DCP directory")
    e.add_argument("source")
    e.add_argument("name")
    e.add_argument("dcp_dir")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "import":
            import_checkpoint(a.dcp_dir, a.target, a.name, binary=a.bin)
            print(f"{a.name}: imported from {a.dcp_dir} into {a.target}")
        else:
            export_checkpoint(a.source, a.name, a.dcp_dir, binary=a.bin)
            print(f"{a.name}: exported to {a.dcp_dir} (stock DCP format)")
    except (CkptfsError, ValueError, OSError) as err:
        print(f"ckptfs-dcp: {err}", file=sys.stderr)
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())

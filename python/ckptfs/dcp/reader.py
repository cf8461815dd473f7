"""ckptfs.dcp.reader - the DCP StorageReader: the checkpoint's catalog from
its .metadata (ckptfs's own, written by the daemons), and each tensor
block a load plan asks for read from the committed file that holds the
whole global tensor (ckptfs.blocks: one pread, or its block file), so a
load works at any world size."""

import io
import math
import os
import sqlite3
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,
                                                   ChunkStorageMetadata,
                                                   Metadata, MetadataIndex,
                                                   StorageMeta,
                                                   TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import blocks
from ..dtypes import parse_dims, torch_dtypes, torch_u8
from ..errors import CkptfsError
from ..progress import Progress, check_progress
from ..protocol import status_of
from ..world import check_dir, refuse_mismatch
from .files import read_file
from .paths import checkpoint_name, default_rank, rank_mount
from .writer import Writer


def open_metadata(ckdir):
    path = os.path.join(ckdir, ".metadata")
    if not os.path.exists(path):
        st, text = status_of(ckdir)
        raise CkptfsError(f"{ckdir}: no committed checkpoint there"
                          + (f" (.status: {st})" if st else ""))
    return sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)


def read_catalog(ckdir):
    """(tensors {fqn: (path, dtype name, shape)}, blobs {fqn: path}) of a
    committed checkpoint, from its .metadata."""
    con = open_metadata(ckdir)
    try:
        tensors = {f: (p, dt, parse_dims(sh)) for f, p, dt, sh in
                   con.execute("SELECT fqn, path, dtype, shape FROM tensors")}
        blobs = dict(con.execute("SELECT fqn, path FROM blobs"))
    finally:
        con.close()
    return tensors, blobs


def read_block(path, dtype, shape, offsets, lengths, out=None, chunks=None):
    """The block [offsets, offsets+lengths) of the committed tensor at path
    (dtype torch dtype, shape its global shape), as a contiguous tensor
    (into out when given: contiguous, that dtype and shape); chunks: how
    the tensor is stored (blocks.StoredChunks'), or None."""
    if out is None:
        out = torch.empty(tuple(lengths), dtype=dtype)
    mv = torch_u8(out)
    if len(mv) == 0:
        return out
    blocks.read_block(path, out.element_size(), tuple(shape), tuple(offsets),
                      tuple(lengths), mv, chunks)
    return out


def item_bytes(dt, lengths):
    table = torch_dtypes()
    return table[dt].itemsize * math.prod(lengths) if dt in table else 0


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
        check_progress(progress)
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
            refuse_mismatch(mount, self.rank if trainer else None,
                            dist.get_world_size() if trainer else None, saving=True,
                            who=f"rank {self.rank}: ")
            self._checked = mount
        return os.path.join(mount, self.name)

    def read_metadata(self, *args, **kwargs):
        ckdir = self._ckdir()
        self._tensors, self._blobs = read_catalog(ckdir)
        md = {}
        storage = {}
        for fqn, (path, dt, shape) in self._tensors.items():
            if dt not in torch_dtypes():
                raise CkptfsError(f"{fqn}: dtype {dt} is not available in this torch")
            size = torch.Size(shape)
            zeros = torch.Size([0] * len(shape))
            md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtypes()[dt]), size=size,
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
        with Progress(self.progress, self._plan_bytes(ckdir, plan),
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
                total += item_bytes(self._tensors[fqn][1], ri.lengths)
        return total

    def _read_items(self, ckdir, plan, planner, prog):
        stored = blocks.StoredChunks(ckdir)
        try:
            self._read_stored(ckdir, plan, planner, prog, stored)
        finally:
            stored.close()

    def _read_stored(self, ckdir, plan, planner, prog, stored):
        lock = threading.Lock()
        tensors = []
        for ri in plan.items:
            fqn = ri.storage_index.fqn
            if ri.type == LoadItemType.BYTE_IO:
                data = read_file(os.path.join(ckdir, self._blobs[fqn]))
                planner.load_bytes(ri, io.BytesIO(data))
                prog.add(len(data))
            else:
                tensors.append(ri)

        def one(ri):
            fqn = ri.storage_index.fqn
            path, dt, shape = self._tensors[fqn]
            dtype = torch_dtypes()[dt]
            with lock:
                target = planner.resolve_tensor(ri).detach()
            lengths = tuple(ri.lengths)
            # part of the tensor: maybe inside one stored chunk
            chunks = stored.of_fqn(fqn) if lengths != tuple(shape) else None
            if tuple(target.shape) != lengths:
                raise CkptfsError(f"{fqn}: the load plan wants {lengths}, its "
                                  f"target is {tuple(target.shape)}")
            if (target.dtype == dtype and target.device.type == "cpu"
                    and target.is_contiguous()):
                read_block(os.path.join(ckdir, path), dtype, shape,
                           ri.storage_offsets, lengths, out=target, chunks=chunks)
            else:
                blk = read_block(os.path.join(ckdir, path), dtype, shape,
                                 ri.storage_offsets, lengths, chunks=chunks)
                target.copy_(blk)
            with lock:
                planner.commit_tensor(ri, target)
            prog.add(item_bytes(dt, lengths))

        if self.threads == 1 or len(tensors) <= 1:
            for ri in tensors:
                one(ri)
        else:
            with ThreadPoolExecutor(min(self.threads, len(tensors))) as ex:
                for f in [ex.submit(one, ri) for ri in tensors]:
                    f.result()


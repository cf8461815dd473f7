"""ckptfs.dcp.stock - moving checkpoints between ckptfs and stock DCP
directories (ckptctl import-dcp / export-dcp run it as `python -m
ckptfs.dcp`, or the ckptfs-dcp script): import_checkpoint brings a stock
DCP checkpoint into ckptfs bit for bit, export_checkpoint writes a
committed one as stock DCP does; either side may be a BACKING_DIR,
mounted for the duration (Mounted)."""

import io
import os
import pickle
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,
                                                   ChunkStorageMetadata,
                                                   Metadata, MetadataIndex,
                                                   StorageMeta,
                                                   TensorProperties,
                                                   TensorStorageMetadata)

from ..dtypes import torch_dtypes
from ..errors import CkptfsError
from ..protocol import commit_dir, discard_staged, status_of
from ..staging import StagingDirs
from ..world import is_ckptfs_mount
from .files import read_file, write_bytes_file, write_tensor_file
from .paths import checkpoint_name, fqn_paths, path_fqn
from .reader import read_block, read_catalog
from .stockmeta import open_item, read_dcp_metadata


def ckptfs_binary(binary=None):
    import shutil
    cand = binary or os.environ.get("CKPTFS_BIN") or shutil.which("ckptfs")
    if not cand or not os.access(cand, os.X_OK):
        raise CkptfsError("no ckptfs binary to mount BACKING_DIR with: pass binary=, "
                          "set CKPTFS_BIN, or put ckptfs on PATH")
    return cand


class Mounted:
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
        if is_ckptfs_mount(self.target):
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
        self.proc = subprocess.Popen([ckptfs_binary(self.binary), "-f", self.target, mnt],
                                     stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while not is_ckptfs_mount(mnt):
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
                if not is_ckptfs_mount(mnt):
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


class BeneathFS(FileSystem):
    """DCP's FileSystem, reading only plain names in one directory through
    its descriptor (open_item)."""

    def __init__(self, dirfd, root, where):
        super().__init__()
        self.dirfd, self.root, self.where = dirfd, Path(root), where

    @contextmanager
    def create_stream(self, path, mode):
        path = Path(path)
        if mode != "rb" or path.parent != self.root:
            raise CkptfsError(f"{self.where}: refused to open {str(path)!r} ({mode})")
        with open_item(self.dirfd, path.name, self.where) as f:
            yield f


class DcpDirReader(FileSystemReader):
    """FileSystemReader of a DCP directory with its metadata already read
    by read_dcp_metadata, its items opened through BeneathFS."""

    def __init__(self, dcp_dir, dirfd, metadata):
        super().__init__(dcp_dir)
        self.fs = BeneathFS(dirfd, self.path, dcp_dir)
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
    MetadataUnpickler (DCP's classes only, nothing run) and its items
    only as regular files named plainly in it, never through a symlink;
    each tensor's chunks must tile it exactly and every size be backed by
    the item files' sizes (check_metadata); anything else is refused
    before NAME is created, before target is mounted (or made)."""
    name = checkpoint_name(name)
    dirfd = os.open(dcp_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        md = read_dcp_metadata(dirfd, dcp_dir)
        with Mounted(target, binary) as mnt:
            import_into(mnt, name, dcp_dir, dirfd, md, batch_bytes)
    finally:
        os.close(dirfd)
    return name


def import_into(mnt, name, dcp_dir, dirfd, md, batch_bytes):
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
        dirs = StagingDirs(ckdir)
        for fqn, m in sdm.items():
            if isinstance(m, BytesStorageMetadata):
                info = md.storage_data[MetadataIndex(fqn)]
                with open_item(dirfd, info.relative_path, dcp_dir) as f:
                    f.seek(info.offset)
                    data = f.read(info.length)
                if len(data) != info.length:
                    raise CkptfsError(f"{fqn}: {info.relative_path} is truncated")
                write_bytes_file(dirs, paths[fqn], data, fqn, path_fqn(paths[fqn]) != fqn)
        batch, size = {}, 0
        tensors = [(f, m) for f, m in sdm.items() if isinstance(m, TensorStorageMetadata)]
        for i, (fqn, m) in enumerate(tensors):
            t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            batch[fqn] = t
            size += t.numel() * t.element_size()
            if size >= batch_bytes or i == len(tensors) - 1:
                dcp_load(batch, storage_reader=DcpDirReader(dcp_dir, dirfd, md),
                         planner=DefaultLoadPlanner(allow_partial_load=True),
                         no_dist=True)
                for f, bt in batch.items():
                    m_ = sdm[f]
                    write_tensor_file(dirs, paths[f], bt, f, tuple(m_.size),
                                       (0,) * len(m_.size), path_fqn(paths[f]) != f)
                batch, size = {}, 0
        dirs.close()
        commit_dir(ckdir, name, "sync")
    except BaseException:
        if dirs is not None:
            dirs.close()
        try:
            if status_of(ckdir)[0] in ("staging", "failed"):
                discard_staged(ckdir)
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
    name = checkpoint_name(name)
    os.makedirs(dcp_dir, exist_ok=True)
    dirfd = os.open(dcp_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        export_into(source, name, dcp_dir, dirfd, binary)
    finally:
        os.close(dirfd)
    return dcp_dir


def create_new(dirfd, name):
    """A new file NAME in directory dirfd for writing (a stale one, or a
    symlink planted under that name, is removed first, not followed)."""
    try:
        os.unlink(name, dir_fd=dirfd)
    except FileNotFoundError:
        pass
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644, dir_fd=dirfd)
    return os.fdopen(fd, "wb")


def export_into(source, name, dcp_dir, dirfd, binary):
    """export_checkpoint's work, in dcp_dir open at dirfd: the data file
    __0_0.distcp, then .metadata (each written under a temporary name,
    fsync'd, then renamed)."""
    try:
        os.stat(".metadata", dir_fd=dirfd, follow_symlinks=False)
        raise CkptfsError(f"{dcp_dir} already holds a DCP checkpoint (.metadata)")
    except FileNotFoundError:
        pass
    data_name = "__0_0.distcp"
    md = {}
    storage = {}
    with Mounted(source, binary) as mnt:
        ckdir = os.path.join(mnt, name)
        tensors, blobs = read_catalog(ckdir)
        tmp = data_name + ".tmp"
        with create_new(dirfd, tmp) as out:
            write_items(ckdir, tensors, blobs, out, data_name, md, storage)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, data_name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    write_metadata(dirfd, dcp_dir, md, storage)


def write_items(ckdir, tensors, blobs, out, data_name, md, storage):
    """Append the items (read_catalog's tensors, blobs) of committed
    checkpoint ckdir to file out (named
    data_name in the DCP directory) as stock DCP stores it: each tensor
    whole, torch.save'd; each bytes item as it is when it is torch.save
    output, else torch.save'd; their metadata into md and storage."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    for fqn, (path, dt, shape) in sorted(tensors.items()):
        if dt not in torch_dtypes():
            raise CkptfsError(f"{fqn}: dtype {dt} is not available in this torch")
        t = read_block(os.path.join(ckdir, path), torch_dtypes()[dt], shape,
                       (0,) * len(shape), shape)
        buf = io.BytesIO()
        torch.save(t, buf)
        off = out.tell()
        out.write(buf.getbuffer())
        size = torch.Size(shape)
        zeros = torch.Size([0] * len(shape))
        md[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch_dtypes()[dt]), size=size,
            chunks=[ChunkStorageMetadata(offsets=zeros, sizes=size)])
        storage[MetadataIndex(fqn, zeros)] = _StorageInfo(data_name, off,
                                                          len(buf.getbuffer()))
    for fqn, path in sorted(blobs.items()):
        data = read_file(os.path.join(ckdir, path))
        if not data.startswith(b"PK\x03\x04"):
            b = io.BytesIO()
            torch.save(data, b)
            data = b.getvalue()
        off = out.tell()
        out.write(data)
        md[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = _StorageInfo(data_name, off, len(data))


def write_metadata(dirfd, dcp_dir, md, storage):
    """The pickled .metadata of a stock DCP checkpoint of items md stored
    at storage."""
    from torch.distributed.checkpoint._version import _derived_version
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
    with create_new(dirfd, tmp) as f:
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


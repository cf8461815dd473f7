"""ckptfs.dcp.stockmeta - reading a stock DCP directory that anyone may own.

import-dcp runs as root on directories other users write. DCP's
FileSystemReader unpickles .metadata with pickle.load (any global, so any
code) and opens DCP_DIR/relative_path (an absolute path, '..' or a symlink
reads any file). The import reads .metadata with MetadataUnpickler and
every item through a descriptor of DCP_DIR, by plain name, O_NOFOLLOW,
and checks that the sizes the .metadata claims are backed by the item
files (check_metadata) before anything is created."""

import errno
import os
import stat

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,
                                                   ChunkStorageMetadata,
                                                   Metadata, MetadataIndex,
                                                   TensorStorageMetadata)

from ..errors import CkptfsError
from ..tiling import check_tiling, chunk_desc, dims_text
from .files import dtype_name
from .unpickler import MetadataUnpickler


def plain_name(rel):
    """rel names a file directly inside the directory: not empty, not
    . or .., no '/', no NUL, at most 255 bytes."""
    return (isinstance(rel, str) and rel not in ("", ".", "..") and "/" not in rel
            and "\0" not in rel and len(rel.encode("utf-8", "surrogateescape")) <= 255)


def open_item(dirfd, name, where):
    """The regular file NAME directly in directory dirfd, opened for reading
    without following a symlink (a FIFO does not block the open)."""
    if not plain_name(name):
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


def check_dims(xs, what):
    if not isinstance(xs, (tuple, list)) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs):
        raise CkptfsError(f"{what}: not a list of non-negative integers: {xs!r}")


def check_metadata(md, dirfd, where):
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
        _check_item(fqn, m, where)
    names = {_check_entry(idx, info, where) for idx, info in storage.items()}
    file_size = {n: _item_file_size(n, dirfd, where) for n in sorted(names)}
    _check_backed(sdm, storage, file_size, where)


def _check_item(fqn, m, where):
    """One item of state_dict_metadata: a tensor's dtype, size and chunks,
    or a bytes item."""
    if not isinstance(fqn, str):
        raise CkptfsError(f"{where}: FQN {fqn!r} is not a string")
    if isinstance(m, TensorStorageMetadata):
        dt = getattr(m.properties, "dtype", None)
        if not isinstance(dt, torch.dtype):
            raise CkptfsError(f"{where}: {fqn}: no torch dtype")
        dtype_name(dt, f"{where}: tensor {fqn!r}")
        check_dims(m.size, f"{where}: {fqn}: size")
        if not isinstance(m.chunks, (list, tuple)):
            raise CkptfsError(f"{where}: {fqn}: chunks is not a list")
        for c in m.chunks:
            if not isinstance(c, ChunkStorageMetadata):
                raise CkptfsError(f"{where}: {fqn}: a chunk is a {type(c).__name__}, "
                                  "not a ChunkStorageMetadata")
            check_dims(c.offsets, f"{where}: {fqn}: chunk offsets")
            check_dims(c.sizes, f"{where}: {fqn}: chunk sizes")
    elif not isinstance(m, BytesStorageMetadata):
        raise CkptfsError(f"{where}: {fqn}: unknown item type {type(m).__name__}")


def _check_entry(idx, info, where):
    """One storage_data entry; the name of its item file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    what = f"{where}: {getattr(idx, 'fqn', idx)}"
    if not isinstance(idx, MetadataIndex) or not isinstance(info, _StorageInfo):
        raise CkptfsError(f"{what}: storage_data entry is not MetadataIndex -> _StorageInfo")
    if not isinstance(idx.fqn, str):
        raise CkptfsError(f"{what}: storage_data entry's FQN is not a string")
    if idx.offset is not None:
        check_dims(idx.offset, f"{what}: storage_data entry's offset")
    if not plain_name(info.relative_path):
        raise CkptfsError(f"{what}: relative_path {info.relative_path!r} refused: "
                          "items must be plain file names inside DCP_DIR (no '/', "
                          "no '..', not absolute, not empty)")
    check_dims((info.offset, info.length), f"{what}: offset, length")
    if getattr(info, "transform_descriptors", None):
        raise CkptfsError(f"{what}: stored with transforms "
                          f"{info.transform_descriptors}: not supported")
    return info.relative_path


def _item_file_size(n, dirfd, where):
    """The size of item file n: a regular file directly in dirfd."""
    try:
        st = os.stat(n, dir_fd=dirfd, follow_symlinks=False)
    except OSError as e:
        raise CkptfsError(f"{where}: item file {n!r}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise CkptfsError(f"{where}: item file {n!r} refused: it is a symbolic link "
                          "(items are read only as regular files in DCP_DIR)")
    if not stat.S_ISREG(st.st_mode):
        raise CkptfsError(f"{where}: item file {n!r} refused: not a regular file")
    return st.st_size


def _check_backed(sdm, storage, file_size, where):
    """Every item's and chunk's bytes stored inside its file, long enough
    for its elements, and no two sharing bytes."""
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
    its path, for messages): unpickled by MetadataUnpickler, every item a
    regular file named plainly in the directory (check_metadata)."""
    with open_item(dirfd, ".metadata", where) as f:
        try:
            md = MetadataUnpickler(f, f"{where}/.metadata").load()
        except CkptfsError:
            raise
        except Exception as e:  # noqa: BLE001  (a malformed pickle, any kind)
            raise CkptfsError(f"{where}/.metadata: not a DCP metadata pickle: "
                              f"{type(e).__name__}: {e}") from None
    check_metadata(md, dirfd, where)
    return md


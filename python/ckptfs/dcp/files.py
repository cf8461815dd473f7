"""ckptfs.dcp.files - a DCP item as a staged file: a tensor chunk (its
user.ckpt.* xattrs, its bytes as the host holds them) or a bytes item,
written through ckptfs.staging's StagingDirs."""

import os

from ..dtypes import ckpt_dtype, torch_dtypes, torch_u8
from ..errors import CkptfsError
from ..staging import dims_csv


def dtype_name(dt, fqn):
    """The ckptfs dtype of torch dtype dt (fqn: the item, for the message)."""
    name = ckpt_dtype(dt)
    if name is None:
        raise CkptfsError(f"{fqn}: dtype {dt} has no ckptfs equivalent (ckptfs "
                          f"stores {', '.join(sorted(torch_dtypes()))})")
    return name


def read_file(path):
    with open(path, "rb") as f:
        return f.read()


def write_tensor_file(dirs, rel, t, fqn, global_shape, offsets, explicit_fqn):
    """Stage contiguous CPU tensor t (a chunk at offsets of a tensor of
    global_shape) at rel of the checkpoint (its directory made if
    missing)."""
    xattrs = [("user.ckpt.dtype", dtype_name(t.dtype, fqn).encode()),
              ("user.ckpt.shape", dims_csv(global_shape))]
    if any(offsets) or tuple(t.shape) != tuple(global_shape):
        xattrs += [("user.ckpt.offsets", dims_csv(offsets)),
                   ("user.ckpt.sizes", dims_csv(t.shape))]
    if explicit_fqn:
        xattrs.append(("user.ckpt.fqn", fqn.encode("utf-8", "surrogateescape")))
    return write_file(dirs, rel, torch_u8(t), fqn, xattrs)


def write_bytes_file(dirs, rel, data, fqn, explicit_fqn):
    xattrs = []
    if explicit_fqn:
        xattrs.append(("user.ckpt.fqn", fqn.encode("utf-8", "surrogateescape")))
    return write_file(dirs, rel, memoryview(data).cast("B"), fqn, xattrs)


def write_file(dirs, rel, mv, fqn, xattrs):
    try:
        return dirs.write_file(rel, mv, xattrs, flags=os.O_EXCL)
    except OSError as e:
        raise CkptfsError(f"{fqn}: staging {os.path.join(dirs.ckdir, rel)}: "
                          f"{e.strerror}") from e


def cpu_contiguous(t):
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



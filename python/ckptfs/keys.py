"""ckptfs.keys - a state dict's keys as the paths of its items: the keys a
file name allows, the (key path, value) of every leaf of a nested dict (a
DTensor as the Shard of its local part), and a key as a manifest gives it."""

from .dtypes import Shard, is_torch
from .errors import CkptfsError
from .protocol import MANIFEST_DIR


def check_key(k, where):
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise CkptfsError(f"key {k!r} under {where or 'the top level'}: keys must "
                          "be str or int")
    s = str(k)
    if not s or s.startswith(".") or "/" in s or "\0" in s:
        raise CkptfsError(f"key {s!r} under {where or 'the top level'} cannot be a "
                          "file name: it must not be empty, start with '.', or "
                          "contain '/' or NUL")
    return s


def dtensor_as_shard(x):
    """A torch DTensor as the Shard of this rank's local part (offsets from
    its device mesh and placements; a replicated one is its whole tensor,
    the same on every rank: a replica). Other values unchanged. Loading
    into the Shard reads into the DTensor's local tensor in place."""
    if not is_torch(x) or type(x).__name__ != "DTensor":
        return x
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _shape, offsets = compute_local_shape_and_global_offset(
        x.shape, x.device_mesh, x.placements)
    return Shard(x.to_local(), offsets, tuple(x.shape))


def flatten(obj, keys, out):
    """(key path, value) of every leaf: dicts recurse, everything else is a
    leaf (a DTensor becomes the Shard of its local part)."""
    for k, v in obj.items():
        where = "/".join(str(x) for x in keys)
        check_key(k, where)
        if not keys and str(k) == MANIFEST_DIR:
            raise CkptfsError(f"the top-level key {MANIFEST_DIR!r} is reserved "
                              "for ckptfs.py's manifest")
        path = keys + [k]
        if isinstance(v, dict):
            if not v:
                out.append((path, v))  # an empty dict is kept as an object
            else:
                flatten(v, path, out)
        else:
            out.append((path, dtensor_as_shard(v)))
    return out


def manifest_key(k):
    t, v = k
    return int(v) if t == "i" else v



"""ckptfs.loading - ckptfs.load: a committed checkpoint read back from a
rank mount, as a new nested dict (its manifests say each item's keys and
kind) or into the tensors, arrays and Shards of a given one (in place; a
Shard reads only its own byte ranges)."""

import errno
import json
import math
import os
import pickle
import sys

from .blocks import StoredChunks, read_block
from .dtypes import (DTYPES, NUMPY_NAMES, Shard, is_tensor, is_torch, numpy_dtype_name,
                     numpy_module, parse_dims, torch_dtype_name, torch_module,
                     torch_numpy_view)
from .errors import CkptfsError
from .keys import flatten, manifest_key
from .progress import Progress, check_progress
from .protocol import MANIFEST_DIR, status
from .world import check_dir


def read_manifest(ckdir):
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


def walk_items(ckdir, top=True):
    """Relative paths of every file under ckdir (not the symbolic links);
    at the top of a checkpoint (top) but .metadata and the manifests."""
    out = []
    for root, dirs, files in os.walk(ckdir):
        rel_root = os.path.relpath(root, ckdir)
        if top and rel_root == MANIFEST_DIR:
            dirs[:] = []
            continue
        for f in files:
            rel = f if rel_root == "." else f"{rel_root}/{f}"
            if os.path.islink(os.path.join(root, f)):
                continue  # a symbolic link is kept, not an item
            if not (top and rel == ".metadata"):
                out.append(rel)
    return sorted(out)


def tensor_xattrs(path):
    try:
        dtype = os.getxattr(path, "user.ckpt.dtype").decode()
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP):
            return None, None
        raise
    return dtype, parse_dims(os.getxattr(path, "user.ckpt.shape"))


def new_tensor(kind, dtype, shape):
    """An empty tensor to read into, and a byte view of its memory."""
    if kind == "torch" or (kind != "numpy" and dtype not in NUMPY_NAMES):
        torch = torch_module()
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        return t, memoryview(torch_numpy_view(t).reshape(-1)).cast("B")
    if dtype not in NUMPY_NAMES:
        raise CkptfsError(f"dtype {dtype} has no numpy equivalent; load it as a "
                          "torch tensor")
    np = numpy_module()
    a = np.empty(shape, dtype=np.dtype(NUMPY_NAMES[dtype]))
    return a, memoryview(a.reshape(-1)).cast("B")


def load_into(target, path, rel, dtype, gshape, chunks=None):
    """Read the item at path into target (a tensor, array or Shard) in place;
    chunks: how the tensor is stored (blocks.StoredChunks'), or None."""
    shard = target if isinstance(target, Shard) else None
    t = shard.tensor if shard else target
    if is_torch(t):
        want = torch_dtype_name(t.dtype)
    else:
        want = numpy_dtype_name(t.dtype)
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
    if is_torch(t):
        if t.device.type == "cpu" and t.is_contiguous():
            direct = torch_numpy_view(t)
    else:
        if t.flags.c_contiguous and t.flags.writeable and \
                t.dtype == t.dtype.newbyteorder("<"):
            direct = t  # stored bytes are little-endian: read them in place
    if direct is not None:
        read_block(path, DTYPES[dtype], gshape, offsets, shape,
                    memoryview(direct.reshape(-1)).cast("B"), chunks)
        return
    tmp, mv = new_tensor("torch" if is_torch(t) else "numpy", dtype, shape)
    read_block(path, DTYPES[dtype], gshape, offsets, shape, mv, chunks)
    if is_torch(t):
        with sys.modules["torch"].no_grad():
            t.copy_(tmp)
    else:
        t[...] = tmp


def decode_object(path, rel, kind, allow_pickle):
    with open(path, "rb") as f:
        data = f.read()
    if kind == "pickle":
        if not allow_pickle:
            raise CkptfsError(f"{rel} is pickled and allow_pickle is False")
        return pickle.loads(data)
    if kind == "json":
        return json.loads(data)
    return data


def load_item(path, rel, entry, allow_pickle):
    """A new tensor, array, bytes or object from the file at path."""
    dtype, shape = tensor_xattrs(path)
    if dtype is not None:
        t, mv = new_tensor(entry["kind"] if entry else None, dtype, shape)
        read_block(path, DTYPES[dtype], shape, (0,) * len(shape), shape, mv)
        return t
    return decode_object(path, rel, entry["kind"] if entry else "bytes",
                          allow_pickle)


def load_tree(ckdir, sub, manifest, allow_pickle, rels, prog):
    """A new nested dict of the items rels (walk_items's) under directory sub
    ("" for all)."""
    out = {}
    depth = len(sub.split("/")) if sub else 0
    for rel in rels:
        rel = f"{sub}/{rel}" if sub else rel
        entry = manifest.get(rel)
        keys = [manifest_key(k) for k in entry["keys"]] if entry else rel.split("/")
        keys = keys[depth:]
        path = os.path.join(ckdir, rel)
        value = load_item(path, rel, entry, allow_pickle)
        if prog.active:
            prog.add(os.path.getsize(path))
        d = out
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
    return out


def file_bytes(top, rels, wanted=True):
    """The bytes of the files rels under top (0 unless wanted: a stat each)."""
    return sum(os.path.getsize(os.path.join(top, r)) for r in rels) if wanted else 0


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
    ckdir = committed_dir(mount, name)
    manifest = read_manifest(ckdir)
    what = f"load {name}"
    check_progress(progress)
    sizes = progress not in (None, False)  # the items' sizes: a stat each
    if spec is None:
        rels = walk_items(ckdir)
        with Progress(progress, file_bytes(ckdir, rels, sizes), what) as prog:
            return load_tree(ckdir, "", manifest, allow_pickle, rels, prog)
    if not isinstance(spec, dict):
        raise TypeError(f"spec must be a dict or None, not {type(spec).__name__}")
    todo = plan_spec(spec, ckdir, name, sizes)
    with Progress(progress, sum(job[-1] for job in todo), what) as prog:
        fill_spec(spec, todo, ckdir, manifest, allow_pickle, prog)
    return spec


def committed_dir(mount, name):
    """MOUNT/NAME, once it is there and committed (a directory no ckptfs
    serves is read as it is); CkptfsError naming what is there instead."""
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
    return ckdir


def plan_spec(spec, ckdir, name, sizes):
    """What load() reads to fill spec, and its bytes, before reading any of
    it: [(keys, rel, path, tensor to read into or None, how, bytes)]."""
    todo = []
    for keys, v in flatten(spec, [], []):
        rel = "/".join(str(k) for k in keys)
        path = os.path.join(ckdir, rel)
        try:
            dtype, shape = tensor_xattrs(path)
        except FileNotFoundError:
            raise CkptfsError(f"checkpoint {name!r} has no item {rel} (FQN "
                              f"{rel.replace('/', '.')})") from None
        if is_tensor(v):
            if dtype is None:
                raise CkptfsError(f"{rel} is a bytes item in checkpoint {name!r}, "
                                  "not a tensor")
            t = v.tensor if isinstance(v, Shard) else v
            todo.append((keys, rel, path, v, (dtype, shape),
                         math.prod(t.shape) * DTYPES.get(dtype, 1)))
        elif os.path.isdir(path):
            rels = walk_items(path, top=False)
            todo.append((keys, rel, path, None, rels, file_bytes(path, rels, sizes)))
        else:
            todo.append((keys, rel, path, None, None,
                         os.path.getsize(path) if sizes else 0))
    return todo


def fill_spec(spec, todo, ckdir, manifest, allow_pickle, prog):
    """Read what plan_spec planned into spec."""
    stored = StoredChunks(ckdir)  # a Shard may be inside one stored chunk
    try:
        fill_stored(spec, todo, ckdir, manifest, allow_pickle, prog, stored)
    finally:
        stored.close()


def fill_stored(spec, todo, ckdir, manifest, allow_pickle, prog, stored):
    """fill_spec's reads (stored: the checkpoint's StoredChunks)."""
    for keys, rel, path, v, how, nbytes in todo:
        if v is not None:
            load_into(v, path, rel, *how,
                      stored.of_path(rel) if isinstance(v, Shard) else None)
            prog.add(nbytes)
            continue
        if how is not None:
            value = load_tree(ckdir, rel, manifest, allow_pickle, how, prog)
        else:
            value = load_item(path, rel, manifest.get(rel), allow_pickle)
            prog.add(nbytes)
        d = spec
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value

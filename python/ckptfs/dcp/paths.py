"""ckptfs.dcp.paths - where a DCP save goes: this process's rank and world
size, the rank's mount ("%r" in the mount given), the checkpoint NAME of a
checkpoint_id, and the path of each FQN in the checkpoint (fqn_paths: the
same on every rank)."""

import hashlib
import os
import re

import torch.distributed as dist

from ..world import trainer_rank, trainer_world


def default_rank():
    """This process's rank: torch.distributed's, else the launcher's
    (ckptfs.world.trainer_rank)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return trainer_rank()


def default_world_size():
    """This process's world size: torch.distributed's, else the launcher's
    (Open MPI, torchrun, PMI; not Slurm's SLURM_NTASKS, which a batch
    script's single process sees too), else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return trainer_world()[1] or 1


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


def safe_parts(fqn):
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
    safe = {f: safe_parts(f) for f in fqns}
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


def path_fqn(path):
    return path.replace("/", ".")



"""ckptfs.world - which ckptfs world a mount belongs to, and whether this
process may use it: a mount that is alive and a directory (check_dir), the
mount's rank and world size (its root's user.ckpt.rank and
user.ckpt.world_size), the trainer's (torch.distributed's, else its
launcher's), and the check made before anything is staged or read
(world_mismatch, refuse_mismatch). /proc/self/mountinfo tells a ckptfs
mount from another filesystem."""

import errno
import os
import re
import stat
import sys

from .errors import CkptfsError


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
        return not_a_mount(mount, rank, world_size) if saving else None
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


def refuse_mismatch(mount, rank, world_size=None, saving=False, who=""):
    """CkptfsError (prefixed by who) when world_mismatch gives a reason."""
    why = world_mismatch(mount, rank, world_size, saving)
    if why:
        raise CkptfsError(who + why)


def mountinfo():
    """{mount point: (filesystem type, source)} of /proc/self/mountinfo
    (a later line wins: the mount on top)."""
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            out[mp] = (fields[sep + 1], fields[sep + 2])
    return out


def is_ckptfs_mount(path):
    """Whether a ckptfs is mounted at path itself."""
    info = mountinfo().get(os.path.realpath(path))
    return info is not None and info[0] == "fuse.ckptfs"


def fs_type(path):
    """The type of the filesystem path is on (/proc/self/mountinfo), or None."""
    path, best, kind = os.path.realpath(path), "", None
    try:
        mounts = mountinfo()
    except (OSError, ValueError, IndexError):
        return None
    for mp, (fstype, _source) in mounts.items():
        if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
            best, kind = mp, fstype
    return kind


def not_a_mount(mount, rank, world_size):
    """Why a save must not go into mount when it is no ckptfs mount (a
    daemon older than the world xattrs is a ckptfs mount still), naming the
    world of rank 0's mount beside it (MOUNTROOT/rank0 for MOUNTROOT/rankR)
    when there is one."""
    if fs_type(mount) in ("fuse.ckptfs", None):
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


def launchers():
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return (_TORCHRUN,) + tuple(v for v in _LAUNCHERS if v != _TORCHRUN)
    return _LAUNCHERS


def trainer_world():
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
    for rank_var, size_var in launchers():
        r, n = os.environ.get(rank_var, ""), os.environ.get(size_var, "")
        if r.isdigit() and n.isdigit():
            return int(r), int(n)
    return None, None


def trainer_rank():
    """This process's global rank as trainer_world says, else Slurm's
    SLURM_PROCID (a rank, though SLURM_NTASKS is no world size), else 0."""
    rank = trainer_world()[0]
    if rank is None:
        v = os.environ.get("SLURM_PROCID", "")
        rank = int(v) if v.isdigit() else 0
    return rank


def check_save_world(mount, rank, solo):
    """save()'s world check: the trainer's world size against the mount's
    (none for a solo save: a world of one), and a mount that is no ckptfs
    mount at all."""
    if solo:  # a world of one: any rank's mount, but a ckptfs one
        why = not_a_mount(mount, None, None) if mount_world(mount) is None else None
        if why:
            raise CkptfsError(why)
    else:
        refuse_mismatch(mount, rank, trainer_world()[1], saving=True)

"""ckptfs.lightning - a Lightning CheckpointIO plugin that saves each
checkpoint path as a ckptfs checkpoint (docs/pytorch.md, "Lightning").

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    import ckptfs.lightning

    trainer = L.Trainer(strategy="ddp", plugins=[ckptfs.lightning.CheckpointIO()],
                        callbacks=[ModelCheckpoint(dirpath="/mnt/ckpt", save_top_k=2,
                                                   save_last=True, monitor="val_loss")])

Where a path goes. Lightning gives DIRPATH/NAME (epoch=0-step=4.ckpt,
last.ckpt); NAME becomes a checkpoint at the root of a rank mount (a
checkpoint is a directory at a mount's root, never deeper).
- CheckpointIO(): DIRPATH is the mount. Every rank passes Lightning the
  same dirpath, so under DDP either all ranks share a node and one
  mount's path, or each rank runs under mount-scripts/ckpt-rank-exec,
  which puts its own rank mount at that one path.
- CheckpointIO(mount="/mnt/ckpt/rank%r"): this process's rank mount (%r
  its global rank, or rank=); DIRPATH must still be a ckptfs mount of the
  same BACKING_DIR, because Lightning's ModelCheckpoint looks there itself
  (ckpt_path="last", name versions) and must see what was saved.

Who commits. Lightning calls save_checkpoint and remove_checkpoint on
global rank 0 only, then waits at a barrier. Under DDP rank 0's checkpoint
is the whole state (parameters and optimizer state are replicas), so rank
0 commits it solo, as a checkpoint of world size 1 that every mount shows;
the other ranks have nothing of their own to add. load_checkpoint runs on
every rank, each reading the global checkpoint through its own mount.

Layout of NAME: every torch.Tensor of the checkpoint is a tensor file at
the path of its keys (state_dict/layer.weight, optimizer_states/0/state/0/
exp_avg), so the views and resharded reads work on them; the rest of the
checkpoint is one bytes item, checkpoint.pkl, a pickle whose tensors are
references to those files. Loading unpickles it with torch's weights-only
unpickler unless weights_only=False (the rules of torch.load).

Saving a path again replaces its committed checkpoint in one atomic step
(save_last=True re-saves last.ckpt; a resumed run saves its names again),
as Lightning's own TorchCheckpointIO overwrites a file: there is no
overwrite argument. Each commit records the checkpoint's global_step
(trainer.global_step) as its step (user.ckpt.step), which retention
(-o keep=...) and ckptfs.latest order by, whatever digits the file name
holds ("{epoch}-{step}-{train_loss:.4f}" ends in the loss's).

ckpt_path="last" picks the newest last*.ckpt that ModelCheckpoint lists;
ckptfs.lightning.ModelCheckpoint lists committed checkpoints only, never
one a killed run left staged or failed (Lightning's own lists every
name, and loading a staged one then fails, saying so).

save_last="link" makes a symlink, which a mount's root refuses: use
ckptfs.lightning.ModelCheckpoint, which publishes last.ckpt as a copy of
the checkpoint it would link to. Model.load_from_checkpoint reads with
torch.load, not the CheckpointIO: give it
ckptfs.lightning.checkpoint_file(path).
"""

import errno
import hashlib
import io
import os
import pickle
import shutil
from urllib.parse import quote

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint as _ModelCheckpoint

from . import client, dtypes, protocol, world
from .errors import CkptfsError

__all__ = ["CheckpointIO", "ModelCheckpoint", "checkpoint_file"]

SKELETON = "checkpoint.pkl"   # the checkpoint with its tensors as references
OTHER = "_tensors"            # tensors without a path of dict keys: _tensors/N
RESERVED = (SKELETON, OTHER, protocol.MANIFEST_DIR)   # top-level names of ckptfs.lightning
LABEL_MAX = 200               # bytes of a key's file name; longer ones are hashed
PROTOCOL = 2                  # torch.save's pickle protocol (the weights-only unpickler reads it)


def _label(key):
    """The file name of dict key or list index key: the key itself when it
    is a valid file name, else an escaped form (the pickle keeps the key)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    if isinstance(key, str):
        s = key
        ok = s and not s.startswith(".") and "/" not in s and "\0" not in s
        if not ok:
            s = quote(s, safe=" =-_,:;'\"{}[]()+@!~")
            s = "%2E" + s[1:] if s.startswith(".") else (s or "%")
    else:
        s = "%" + quote(repr(key), safe="")
    try:
        raw = s.encode("utf-8")
    except UnicodeEncodeError:
        raw = quote(s, safe="", errors="surrogatepass").encode()
        s = raw.decode()
    if len(raw) > LABEL_MAX:
        digest = hashlib.sha1(raw).hexdigest()[:12]
        s = raw[:LABEL_MAX - 13].decode("utf-8", "ignore") + "~" + digest
    return s


def _storable(t):
    """Whether t is saved as a tensor file (else it is pickled as torch
    pickles it): a plain dense tensor of a dtype ckptfs has."""
    return (type(t) is torch.Tensor and t.layout == torch.strided
            and t.device.type != "meta" and not t.is_conj() and not t.is_neg()
            and str(t.dtype).replace("torch.", "") in dtypes.DTYPES)


class _Layout:
    """Where each tensor of a checkpoint goes: tree (nested dicts of
    tensors, what ckptfs.save stores) and paths (id of a tensor -> its
    path in tree)."""

    def __init__(self):
        self.tree = {}
        self.paths = {}
        self.held = []   # the tensors, so that their ids stay theirs
        # FQNs taken: the pickle's and the manifest's (a solo save is rank 0)
        self.fqns = {SKELETON, f"{protocol.MANIFEST_DIR}.rank0.json"}

    def walk(self, obj, keys=(), seen=None):
        """Give every tensor reachable through dicts, lists and tuples the
        path of its keys."""
        seen = set() if seen is None else seen
        if _storable(obj):
            self.add(obj, keys)
            return
        if isinstance(obj, dict):
            items = obj.items()
        elif isinstance(obj, (list, tuple)):
            items = enumerate(obj)
        else:
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        used = set()
        for k, v in items:
            base = label = _label(k)
            n = 0
            while label in used or (not keys and label in RESERVED):
                n += 1
                label = f"{base}~{n}"
            used.add(label)
            self.walk(v, keys + (label,), seen)

    def add(self, t, keys):
        """Put tensor t at keys (or at _tensors/N when keys are none or
        their FQN, the path with '.' for '/', is taken); its path."""
        if id(t) in self.paths:
            return self.paths[id(t)]
        n = 0
        while not keys or ".".join(keys) in self.fqns:
            keys = (OTHER, str(n))
            n += 1
        self.fqns.add(".".join(keys))
        d = self.tree
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = t
        self.paths[id(t)] = "/".join(keys)
        self.held.append(t)
        return self.paths[id(t)]


class _Pickler(pickle.Pickler):
    """Pickles a checkpoint with each storable tensor as a reference to its
    file: ("storage", "ckptfs", path, device, requires_grad). torch's
    weights-only unpickler accepts persistent ids that start with
    "storage" only."""

    def __init__(self, f, layout):
        super().__init__(f, protocol=PROTOCOL)
        self.layout = layout

    def persistent_id(self, obj):
        if not _storable(obj):
            return None
        return ("storage", "ckptfs", self.layout.add(obj, ()), str(obj.device),
                bool(obj.requires_grad))


def _place(t, location, map_location):
    """Tensor t (read on the CPU) where map_location says, as torch.load
    would put a storage saved at location."""
    if map_location is None:
        return t
    if callable(map_location):
        st = map_location(t.untyped_storage(), location)
        dev = location if st is None else st.device
    elif isinstance(map_location, dict):
        dev = map_location.get(location, location)
    else:
        dev = map_location
    return t if torch.device(dev) == t.device else t.to(dev)


def _weights_only(weights_only):
    """weights_only as torch.load resolves it (its environment overrides)."""
    yes = ("1", "y", "yes", "true")
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in yes:
        return True
    if weights_only is None:
        return os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in yes
    return bool(weights_only)


def _unpickle(data, tensors, map_location, weights_only, where):
    """The checkpoint from the pickle data, with the tensors of tensors
    (path -> tensor) put back in place."""
    placed = {}

    def persistent_load(pid):
        path, location, grad = pid[2], pid[3], pid[4]
        if path not in placed:
            if path not in tensors:
                raise CkptfsError(f"{where}: checkpoint.pkl refers to tensor {path}, "
                                  "which the checkpoint does not hold")
            t = _place(tensors[path], location, map_location)
            placed[path] = t.requires_grad_() if grad else t
        return placed[path]

    safe = _weights_only(weights_only)
    if safe:   # torch.load's own unpickler for weights_only (torch 2.x)
        from torch import _weights_only_unpickler
        up = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
    else:
        up = pickle.Unpickler(io.BytesIO(data), encoding="utf-8")
    up.persistent_load = persistent_load
    try:
        return up.load()
    except pickle.UnpicklingError as e:
        if not safe:
            raise
        raise CkptfsError(
            f"{where}: loading with weights_only=True failed: {e}. If you trust "
            "this checkpoint, load it with weights_only=False (trainer.fit("
            "..., weights_only=False)).") from e


def _tensor_paths(tree, prefix=""):
    """{path: tensor} of a tree ckptfs.load returned."""
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_tensor_paths(v, path + "/"))
        else:
            out[path] = v
    return out


def _global_rank():
    """This process's global rank: torch.distributed's when it is up, else
    the launcher's (ckptfs.world.trainer_rank)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return world.trainer_rank()


def _discard_stale(mount, name):
    """Discard what an earlier save of NAME left staged on this mount: the
    working directory of a replacing save that was killed (SIGKILL while
    last.ckpt was saved again). Only rank 0 saves, one save at a time, so
    none of them is a save in progress; the name itself is restaged by
    exist_ok."""
    prefix = protocol.working_prefix(name)
    try:
        names = [n for n in os.listdir(mount) if n.startswith(prefix)]
    except OSError:
        return
    for n in names:
        protocol.discard_uncommitted(os.path.join(mount, n))


def _check_alive(d, what):
    """A dead mount (its daemon exited: ENOTCONN) named as one."""
    try:
        os.stat(d)
    except OSError as e:
        if e.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            raise CkptfsError(f"{world.mount_gone(d)} ({what})") from None


def _not_a_mount(d, what, pattern=False):
    how = ("start the rank mounts first (ckpt-mount, docs/mounting.md)" if pattern else
           "give ModelCheckpoint(dirpath=) the mount itself (under DDP, with one "
           "dirpath for every rank: run each rank with ckpt-rank-exec MOUNTROOT "
           "DIRPATH, docs/mounting.md)")
    return (f"{d} is not the root of a ckptfs mount ({what}): a ckptfs checkpoint is "
            f"a directory at a rank mount's root, so {how}")


class CheckpointIO(_CheckpointIO):
    """Lightning's CheckpointIO over ckptfs rank mounts (module docstring).

    mount: None (a checkpoint path's directory is the mount), or this
    rank's mount, "%r" standing for the rank; rank: the rank %r stands for
    (default: the global rank of this process); threads: files written at
    once per save (default: ckptfs.staging.default_threads()).
    """

    def __init__(self, mount=None, rank=None, threads=None):
        super().__init__()
        self.mount, self.rank, self.threads = mount, rank, threads
        self._checked = None
        self.saves = {}   # path -> how many times it was saved (ModelCheckpoint's link)

    def _where(self, path, saving=False):
        """(mount, NAME) of Lightning's checkpoint path."""
        path = os.path.abspath(os.fspath(path))
        name, parent = os.path.basename(path), os.path.dirname(path)
        if world.mount_world(parent) is None and (self.mount is None or saving):
            _check_alive(parent, f"the directory of checkpoint {path}")
            raise CkptfsError(_not_a_mount(parent, f"the directory of checkpoint {path}"))
        if self.mount is None:
            return parent, name
        rank = _global_rank() if self.rank is None else int(self.rank)
        mount = os.fspath(self.mount).replace("%r", str(rank))
        if self._checked != mount:
            if world.mount_world(mount) is None:
                _check_alive(mount, f"CheckpointIO(mount={self.mount!r}) for rank {rank}")
                raise CkptfsError(_not_a_mount(mount, f"CheckpointIO(mount={self.mount!r}) "
                                               f"for rank {rank}", pattern=True))
            why = world.world_mismatch(mount, rank, world.trainer_world()[1])
            if why:
                raise CkptfsError(why)
            self._checked = mount
        return mount, name

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        """Save checkpoint as NAME and commit it solo (Lightning calls this
        on global rank 0 only), its "global_step" recorded as the step; a
        committed NAME (last.ckpt) is replaced in one atomic step, as
        Lightning overwrites a checkpoint file."""
        if storage_options is not None:
            raise TypeError("ckptfs.lightning.CheckpointIO takes no storage_options")
        mount, name = self._where(path, saving=True)
        layout = _Layout()
        layout.walk(checkpoint)
        buf = io.BytesIO()
        _Pickler(buf, layout).dump(checkpoint)
        tree = layout.tree
        tree[SKELETON] = buf.getvalue()
        self._save(tree, mount, name, _step(checkpoint.get("global_step")))
        key = os.path.abspath(os.fspath(path))
        self.saves[key] = self.saves.get(key, 0) + 1

    def _save(self, tree, mount, name, step=None):
        """Save tree as NAME in mount, solo, over a committed NAME, step
        recorded (None: the name's digits count)."""
        _discard_stale(mount, name)
        client.save(tree, mount, name, overwrite=True, exist_ok=True, solo=True,
                     threads=self.threads, step=step)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        """The checkpoint saved as path, its tensors where map_location says
        (None: on the CPU, as Lightning's default)."""
        mount, name = self._where(path)
        if not os.path.isdir(os.path.join(mount, name)):
            raise FileNotFoundError(f"Checkpoint file not found: {path} (no checkpoint "
                                    f"{name!r} in {mount})")
        st = protocol.status_of(os.path.join(mount, name))[0]
        if st in ("staging", "failed"):
            raise CkptfsError(
                f"checkpoint {path} is {st}, not committed: a save that did not "
                "finish (a killed run's leftover when no job writes it); "
                'ckpt_path="last" with ckptfs.lightning.ModelCheckpoint picks '
                "committed checkpoints only")
        tree = client.load(None, mount, name, allow_pickle=False)
        data = tree.pop(SKELETON, None)
        if not isinstance(data, bytes):
            raise CkptfsError(f"checkpoint {name!r} in {mount} has no {SKELETON}: it "
                              "was not saved by ckptfs.lightning")
        return _unpickle(data, _tensor_paths(tree), map_location, weights_only,
                         f"checkpoint {name!r} in {mount}")

    def copy_checkpoint(self, src, dst, step=None):
        """Publish checkpoint src again as dst (replacing a committed dst):
        its files read through the mount and saved, as they are, solo;
        step recorded as its step."""
        smount, sname = self._where(src)
        dmount, dname = self._where(dst, saving=True)
        self._save(client.load(None, smount, sname, allow_pickle=False), dmount, dname,
                   _step(step))

    def remove_checkpoint(self, path):
        """Remove NAME for every mount (save_top_k rotation): unlinking its
        .metadata removes a committed checkpoint whole, at once; the rest
        of the tree follows. A staged one is discarded."""
        mount, name = self._where(path)
        ckdir = os.path.join(mount, name)
        if not os.path.isdir(ckdir):
            return
        try:
            os.unlink(os.path.join(ckdir, ".metadata"))
        except FileNotFoundError:
            pass   # staged, never committed
        shutil.rmtree(ckdir)


def _step(step):
    """A checkpoint's global_step as the step to record (None: none)."""
    if isinstance(step, torch.Tensor):
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    return step


def checkpoint_file(path, mount=None, rank=None, map_location=None, weights_only=None):
    """The checkpoint saved as path, as an in-memory torch.save file, for
    what reads a checkpoint with torch.load instead of the CheckpointIO:
    Model.load_from_checkpoint(ckptfs.lightning.checkpoint_file(path)).
    mount and rank as CheckpointIO's."""
    ck = CheckpointIO(mount, rank).load_checkpoint(path, map_location, weights_only)
    f = io.BytesIO()
    torch.save(ck, f)
    f.seek(0)
    return f


def _resumable(path):
    """Whether a resume may pick the checkpoint at path: committed, or not
    a ckptfs checkpoint at all (no .status: another filesystem's file)."""
    st = protocol.status_of(path)[0]
    return st in ("", "committed")


class ModelCheckpoint(_ModelCheckpoint):
    """Lightning's ModelCheckpoint, whose save_last="link" works with
    ckptfs.lightning.CheckpointIO: a mount's root holds checkpoints only,
    not symlinks, so last.ckpt is published as a copy of the checkpoint
    just saved (once per save of it: a checkpoint saved again under its
    name is copied again). Other CheckpointIOs get Lightning's own links.

    ckpt_path="last" finds committed checkpoints only: a last*.ckpt a
    killed run left staged or failed (its save never finished) is not a
    candidate, so the newest committed one is resumed from."""

    def _find_last_checkpoints(self, trainer):
        found = super()._find_last_checkpoints(trainer)
        return {p for p in found if _resumable(p)}

    def _link_checkpoint(self, trainer, filepath, linkpath):
        cio = trainer.strategy.checkpoint_io
        cio = getattr(cio, "checkpoint_io", None) or cio   # AsyncCheckpointIO wraps one
        if not isinstance(cio, CheckpointIO):
            return _ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)
        src = os.path.abspath(os.fspath(filepath))
        if trainer.is_global_zero and src != os.path.abspath(os.fspath(linkpath)):
            # the same save of the same checkpoint is not copied twice; a
            # checkpoint saved again under its name (filename="best") is
            version = (filepath, linkpath, cio.saves.get(src, 0))
            if not (getattr(self, "_ckptfs_copied", None) == version and os.path.isdir(linkpath)):
                cio.copy_checkpoint(filepath, linkpath, trainer.global_step)
                self._ckptfs_copied = version
        trainer.strategy.barrier()
        return None

"""ckptfs.client - save and load PyTorch / NumPy state dicts through a
ckptfs rank mount, with plain file calls and extended attributes only.

    import ckptfs
    ckptfs.save({"model": model.state_dict(), "optim": opt.state_dict(),
                 "step": step}, "/mnt/ckpt/rank0", "step-100", rank=0)
    sd = ckptfs.load(None, "/mnt/ckpt/rank0", "step-100")          # a new dict
    ckptfs.load({"model": model.state_dict()}, mnt, "step-100")   # in place

The core is the Python standard library; numpy and torch are imported
only when a state dict holds their objects (or a load builds them).

Layout of a save (the ckptfs contract, docs/saving.md):

- Nested dicts become directories: the item at keys ("model",
  "layer0.weight") is the file MOUNT/NAME/model/layer0.weight, FQN
  "model.layer0.weight". Keys are str or int (an optimizer's state is keyed
  by parameter index); a key may not be empty, start with '.', or contain
  '/' or NUL, and the top-level key "_ckptfs" is reserved.
- torch tensors and numpy arrays are tensor chunks: their elements in
  row-major little-endian order, and user.ckpt.dtype / user.ckpt.shape. A
  shard of a larger tensor is given as Shard(local, offsets, global_shape):
  it also gets user.ckpt.offsets and user.ckpt.sizes. Items (tensors or
  not) that several ranks save under the same keys are replicas, stored
  once: their values must be equal on every rank or the commit fails
  (replica_check); give per-rank values per-rank keys ("rng/rank3").
- Every other value is a bytes item: bytes, bytearray and memoryview are
  stored as they are; anything else is pickled (objects="pickle", the
  default) or stored as UTF-8 JSON (objects="json", for values JSON can
  hold; JSON turns tuples into lists).
- How a loader tells them apart: a file with user.ckpt.dtype is a tensor;
  for the rest, each rank writes a manifest bytes item
  NAME/_ckptfs/rank<R>.json (JSON) that gives, for every file it saved, its
  original key path (with key types) and its kind: "torch", "numpy",
  "bytes", "pickle" or "json". A checkpoint written by other tools has no
  manifest: its tensors load as numpy arrays (torch tensors for dtypes numpy
  lacks, such as bfloat16) and its other files as bytes.

Saving a committed name again: overwrite=True stages the new version under
a working name (NAME.replace-TOKEN) and commits it with replace=NAME, which
publishes it as NAME in one atomic step for every mount (see "replacing a
committed checkpoint" below); without it the save is refused. solo=True:
one rank saves NAME alone, as a checkpoint of world size 1 (configs,
tokenizers, what only rank 0 writes).

Loading unpickles bytes items of kind "pickle": load only checkpoints you
trust, or pass allow_pickle=False (such items then raise).

Errors: a failed commit raises CommitError with the reason ckptfs gives in
NAME/.status; a missing checkpoint or item, a shape or dtype that does not
match, or an unsupported dtype raise with a message naming the item. A
rank whose save raises before it commits aborts the save on every rank at
once (ckptfs.abort), and every rank discards what it staged.

This module is the save side of the client (ckptfs.save, async_save) and
gathers the rest of its API: ckptfs.loading (load), ckptfs.protocol
(status, commit, wait, latest), ckptfs.snapshot (StagingBuffers).
"""

import errno
import json
import os
import threading
import traceback
from concurrent.futures import Future

from . import job
# The whole client API, whose save side this module is (ckptfs._client is
# its old name: the same module).
from .abort import abort_commit, abort_save, aborted_elsewhere
from .dtypes import DTYPES, Shard, is_tensor, tensor_info
from .errors import CkptfsError, CommitError
from .keys import flatten
from .loading import load
from .protocol import (MANIFEST_DIR, commit, commit_dir, discard_leftovers, discard_staged,
                       discard_uncommitted, latest, leftovers, make_working_dir, replaceable,
                       retention_words, status, unreplaceable, wait)
from .snapshot import StagingBuffers, encode_object, give_back, snapshot
from .staging import Stager, StagingDirs, check_threads, dims_csv
from .world import check_dir, check_save_world, mount_world
# names ckptfs._client had before the package was split by concern, kept
# there for code written against it
from .abort import ABORT_ITEM, ABORT_REASON_MAX, ABORTED  # noqa: F401
from .blocks import IO_STEP, block_file  # noqa: F401
from .dtypes import NUMPY_NAMES  # noqa: F401
from .errors import CkptfsIOError  # noqa: F401
from .protocol import TOKEN_CHARS, working_prefix  # noqa: F401
from .staging import META_XATTR  # noqa: F401
from .world import mount_gone, trainer_rank, world_mismatch  # noqa: F401

__all__ = ["save", "async_save", "StagingBuffers", "load", "wait", "status",
           "commit", "latest", "Shard", "CommitError", "CkptfsError", "DTYPES",
           "leftovers", "discard_leftovers", "mount_world", "commit_staged"]

FORMAT = 1  # of the manifests


def check_save_args(state_dict, mount, mode_arg, mode, objects):
    """The checks save() and async_save() make before anything is staged."""
    if mode not in ("sync", "async"):
        raise ValueError(f"{mode_arg} must be 'sync' or 'async', not {mode!r}")
    if objects not in ("pickle", "json"):
        raise ValueError(f"objects must be 'pickle' or 'json', not {objects!r}")
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, not {type(state_dict).__name__}")
    check_dir(mount)


def save(state_dict, mount, name, rank=0, mode="sync", objects="pickle",
         exist_ok=False, threads=None, overwrite=False, solo=False, step=None,
         metrics=None, protect=False):
    """Write state_dict into MOUNT/NAME and commit it.

    mount: this rank's ckptfs mount; name: the checkpoint name
    (any file name not starting with '.'); rank: this rank (names the
    manifest; every rank of the world must call save with the same name);
    mode: "sync" (return once committed and durable everywhere) or "async"
    (return once the staged data is frozen; then wait(mount, name));
    objects: "pickle" or "json" for values that are neither tensors nor bytes;
    exist_ok: when this rank already staged name and did not commit it (e.g.
    the commit failed), discard what is staged and save again;
    overwrite: replace a committed name (it is staged under a working name
    and committed with replace=NAME, on every rank: give every rank the same
    overwrite). False by default, unlike DCP's Writer and Accelerate's
    save_state (ckptfs.dcp, ckptfs.hf), which overwrite as their frameworks
    do: this is ckptfs's own API, whose committed names are write-once
    unless asked, so a save under a name already published raises before
    anything is staged instead of replacing it for every reader;
    solo: this rank alone saves name, as a checkpoint of world size 1 (the
    other ranks do not call save); threads: files written at once (the
    mount's io_threads streams take that many in parallel; default: 4, at
    most this rank's share of the node's CPUs).
    step, metrics ({"loss": 0.25}) and protect: recorded at the commit for
    retention, as commit() does (step: the trainer's global step, which
    retention and latest() order by; without it the last run of digits in
    NAME counts). Raises CommitError when the commit fails.
    """
    check_save_args(state_dict, mount, "mode", mode, objects)
    check_save_world(mount, rank, solo)
    kept = retention_words(step, metrics, protect)  # bad values raise here
    stager = Stager(threads)
    words = save_words(name, overwrite, solo)
    try:
        leaves = flatten(state_dict, [], [])
    except BaseException:
        abort_unstaged(mount, name, exist_ok, overwrite, solo)
        raise
    ckdir = make_checkpoint_dir(mount, name, exist_ok, overwrite, solo)
    if solo:
        rank = 0   # the rank of its world of one
    try:
        manifest = {}
        with StagingDirs(ckdir, batch=True) as dirs:
            try:
                stage_leaves(leaves, dirs, name, objects, manifest, stager)
            except BaseException:
                stager.abandon()
                raise
            stager.done()
            dirs.make(MANIFEST_DIR)
            stage_file(dirs, f"{MANIFEST_DIR}/rank{int(rank)}.json", name,
                        json.dumps({"format": FORMAT, "rank": int(rank),
                                    "items": manifest}, sort_keys=True).encode())
    except BaseException:
        abort_save(ckdir, name, words)
        raise
    commit_staged(ckdir, mount, name, mode, words, kept)


def commit_staged(ckdir, mount, name, mode, words, kept=()):
    """Commit what a save staged in ckdir (MOUNT/NAME, or its working name)
    with mode and words, and kept (retention_words: step=N ...); on
    failure leave nothing of it staged where no retry can use it (a
    working name is this save's own), and fail a commit the other ranks
    wait for when this rank stops before it."""
    try:
        commit_dir(ckdir, name, mode, tuple(words) + tuple(kept))
    except CommitError as e:
        aborted = aborted_elsewhere(e, ckdir, name)
        if aborted is not None:
            raise aborted from None
        if ckdir != os.path.join(mount, name):
            # a working name is this save's own: nothing to restage under it
            raise CommitError(e.name, e.status, e.path,
                              discarded=discard_uncommitted(ckdir)) from None
        raise
    except BaseException:
        abort_save(ckdir, name, words)
        raise


def save_words(name, overwrite, solo):
    """The modifiers after sync/async of a save of name. overwrite: always
    replace=NAME (ckptfs publishes it plainly when NAME is not committed),
    so that every rank gives the same words whatever its mount shows; a
    name that cannot follow replace= is replaced only when it must be
    (make_checkpoint_dir refuses then)."""
    words = ("solo",) if solo else ()
    if overwrite and replaceable(name):
        words += (f"replace={name}",)
    return words


def make_checkpoint_dir(mount, name, exist_ok, overwrite=False, solo=False):
    """Create the directory a save of NAME stages in (see save's exist_ok
    and overwrite): MOUNT/NAME, or a working name when NAME is committed
    and overwrite is set; its path. A staged NAME that exist_ok does not
    allow is aborted (abort_commit: the other ranks wait for this rank's
    commit; not in a solo save) and left staged."""
    job.declare(mount)  # its leftovers are abandoned if this process dies
    ckdir = os.path.join(mount, name)
    try:
        os.mkdir(ckdir)
    except FileExistsError:
        try:
            st = status(mount, name)[0]
        except OSError:
            st = "committed"
        if st == "committed" and overwrite:
            if not replaceable(name):
                raise CkptfsError(unreplaceable(name)) from None
            return make_working_dir(mount, name)
        if st in ("committed", "committing"):
            how = ("pass overwrite=True to replace it, " if st == "committed"
                   else "wait for its commit, ")
            raise CkptfsError(
                f"checkpoint {name!r} is already {st} in {mount}: {how}choose "
                f"another name, or remove it for every rank with rm -r {ckdir}") from None
        if not exist_ok:
            if not solo:
                abort_commit(ckdir, name, reason=(
                    f"an earlier save of {name!r} was left staged on its mount "
                    "(exist_ok=True discards it)"))
            raise CkptfsError(
                f"checkpoint {name!r} is already staged ({st}) on this rank in "
                f"{mount}: choose another name, discard it with rm -r {ckdir}, "
                "or pass exist_ok=True to discard and restage it"
                + ("" if solo else " (this save was aborted on every rank)")) from None
        discard_staged(ckdir)
        os.mkdir(ckdir)
    except OSError as e:
        raise CkptfsError(f"cannot create checkpoint {ckdir}: {e.strerror}"
                          + (" (a name is a file name not starting with '.')"
                             if e.errno in (errno.EINVAL, errno.EPERM) else "")) from e
    return ckdir


def abort_unstaged(mount, name, exist_ok, overwrite=False, solo=False):
    """This rank failed before it staged anything (a key or value it cannot
    encode): make NAME only to abort it, as abort_save (a solo save has
    nobody to tell)."""
    if solo:
        return
    try:
        ckdir = make_checkpoint_dir(mount, name, exist_ok, overwrite)
    except CkptfsError:
        return  # not ours to abort, or aborted already
    abort_save(ckdir, name, save_words(name, overwrite, solo))


def async_save(state_dict, mount, name, rank=0, commit="sync", objects="pickle",
               exist_ok=False, threads=None, buffers=None, overwrite=False, solo=False,
               step=None, metrics=None, protect=False):
    """Save in the background: the caller waits only while state_dict is
    copied (tensors into private CPU memory, other values encoded); the
    writes into MOUNT/NAME and the commit run on a thread of their own.
    Returns a concurrent.futures.Future whose result() is None once the
    checkpoint is committed and durable everywhere (commit="sync"; with
    "async": once the staged data is frozen) and which raises what save()
    would (CommitError, CkptfsError). The copy is held until then: one
    more state dict of host memory per save in flight. Like DCP's
    async_save, every rank calls it with the same name; later changes to
    the tensors do not reach the checkpoint. buffers: a StagingBuffers
    kept across saves, so that the copy reuses the last save's memory.
    Other arguments as save() (overwrite False by default, step= for
    retention)."""
    check_save_args(state_dict, mount, "commit", commit, objects)
    check_save_world(mount, rank, solo)
    retention_words(step, metrics, protect)  # bad values raise here, not in the future
    threads = check_threads(threads)
    if buffers is not None and not isinstance(buffers, StagingBuffers):
        raise TypeError(f"buffers must be a ckptfs.StagingBuffers, not "
                        f"{type(buffers).__name__}")
    used = {} if buffers is not None else None
    try:
        flatten(state_dict, [], [])   # bad keys raise here, not in the future
        snap = snapshot(state_dict, objects, buffers, used)
    except BaseException:
        give_back(buffers, used)   # nothing writes from them: keep them
        # the other ranks' saves would wait for this rank's commit
        abort_unstaged(mount, name, exist_ok, overwrite, solo)
        raise
    fut = Future()
    fut.set_running_or_notify_cancel()
    kwargs = dict(rank=rank, mode=commit, objects=objects, exist_ok=exist_ok,
                  threads=threads, overwrite=overwrite, solo=solo, step=step,
                  metrics=metrics, protect=protect)
    try:
        threading.Thread(target=save_in_background, name=f"ckptfs-save-{name}",
                         args=(fut, snap, mount, name, kwargs, buffers, used)).start()
    except BaseException:
        give_back(buffers, used)
        raise
    return fut


def save_in_background(fut, snap, mount, name, kwargs, buffers, used):
    """async_save's thread: save() of the snapshot snap, its outcome set
    on fut, the buffers it used given back to buffers."""
    try:
        save(snap, mount, name, **kwargs)
    except BaseException as e:  # noqa: B036 (the future raises it)
        err = e
    else:
        err = None
    if buffers is not None:
        snap.clear()          # the daemon has the bytes: the copies are free
        if err is not None:   # its frames would hold views of the buffers
            traceback.clear_frames(err.__traceback__)
        give_back(buffers, used)
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)


def stage_file(dirs, rel, name, buf, xattrs=()):
    try:
        dirs.write_file(rel, buf, xattrs)
    except OSError as e:
        raise CkptfsError(f"cannot stage {rel} of checkpoint {name!r}: "
                          f"{e.strerror} ({os.path.join(dirs.ckdir, rel)})") from e


def stage_leaves(leaves, dirs, name, objects, manifest, stager):
    for keys, v in leaves:
        rel = "/".join(str(k) for k in keys)
        entry = {"keys": [["i" if isinstance(k, int) else "s", k] for k in keys]}
        try:
            if is_tensor(v):
                shard = v if isinstance(v, Shard) else None
                dtype, shape, buf, kind = tensor_info(shard.tensor if shard else v)
                xattrs = [("user.ckpt.dtype", dtype.encode())]
                if shard:
                    xattrs += [("user.ckpt.shape", dims_csv(shard.global_shape)),
                               ("user.ckpt.offsets", dims_csv(shard.offsets)),
                               ("user.ckpt.sizes", dims_csv(shape))]
                else:
                    xattrs.append(("user.ckpt.shape", dims_csv(shape)))
                stager.submit(stage_file, dirs, rel, name, buf, xattrs)
                entry["kind"] = kind
            else:
                data, kind = encode_object(v, objects)
                stager.submit(stage_file, dirs, rel, name, data)
                entry["kind"] = kind
        except OSError as e:
            raise CkptfsError(f"cannot stage {rel} of checkpoint {name!r}: "
                              f"{e.strerror} ({os.path.join(dirs.ckdir, rel)})") from e
        manifest[rel] = entry



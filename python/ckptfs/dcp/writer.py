"""ckptfs.dcp.writer - the DCP StorageWriter: every rank stages its local
plan's items into its own mount (replicated ones too, unless
replicas="dedup"), then commits NAME collectively; a save over a committed
NAME is staged under a working name and committed with replace=NAME."""

import dataclasses
import hashlib
import io
import os
import uuid

from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import job
from ..abort import abort_commit, abort_save, aborted_elsewhere
from ..errors import CkptfsError, CommitError
from ..protocol import (TOKEN_CHARS, commit_dir, discard_staged, discard_uncommitted,
                        make_working_dir, replaceable, status_of, unreplaceable)
from ..staging import Stager, StagingDirs, check_threads
from ..world import check_dir, refuse_mismatch
from .files import cpu_contiguous, write_bytes_file, write_tensor_file
from .paths import (checkpoint_name, default_rank, default_world_size, fqn_paths, path_fqn,
                    rank_mount)


@dataclasses.dataclass(frozen=True)
class SaveData:
    """The storage_data of the Writer's global plan, the same for every
    rank: paths {fqn: path in the checkpoint}; replace: NAME is committed,
    so the save is committed with replace=NAME; token: of the working name
    ranks whose mount shows NAME committed stage under."""
    paths: dict
    replace: bool
    token: str


class Writer(StorageWriter):
    """DCP StorageWriter over ckptfs rank mounts.

    mount: the rank's mount, "%r" replaced by the rank ("/mnt/ckpt/rank%r";
    the global rank, whatever process group the save runs on).
    replicas: "check" (the default: every rank writes its copy of a
    replicated item, ckptfs compares them, replica_check, and stores one)
    or "dedup" (only the rank DCP's planner picked writes it, as stock DCP
    does: for replicas that legitimately differ in their bytes, e.g.
    pickles of sets of strings under per-process hash seeds).
    commit: "sync" (the default: write_data returns once the checkpoint is
    committed and durable on every rank) or "async" (it returns once this
    rank's data is frozen; ckptfs finishes the save in the background and
    NAME/.status follows it; wait with ckptfs.wait(mount, name)).
    threads: files staged at once (default: 4, the mount's default
    io_threads, but at most this rank's share of the node's CPUs;
    ckptfs.staging.default_threads).
    overwrite: as stock DCP's FileSystemWriter (True by default): a save to
    the checkpoint_id of a committed checkpoint replaces it (staged under a
    working name, committed with replace=NAME: atomically, for every
    mount); False: such a save raises before anything is staged.
    """

    def __init__(self, mount, *, commit="sync", replicas="check", threads=None,
                 overwrite=True, checkpoint_id=None):
        super().__init__()
        if commit not in ("sync", "async"):
            raise ValueError(f"commit={commit!r}: use 'sync' or 'async'")
        self.threads = check_threads(threads)
        if replicas not in ("check", "dedup"):
            raise ValueError(f"replicas={replicas!r}: use 'check' or 'dedup'")
        self.mount_spec = os.fspath(mount)
        self.commit_mode = commit
        self.replicas = replicas
        self.overwrite = bool(overwrite)
        self.rank = None
        self.mount = None
        self.is_coordinator = False
        self.name = None
        self.save_id = None
        self._local_items = None
        self.checkpoint_id = None
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    # -- the protocol
    def reset(self, checkpoint_id=None):
        # None keeps the checkpoint this writer was given (stock
        # FileSystemWriter keeps its path): DCP's deprecated
        # save_state_dict calls reset() with no id
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
            self.name = checkpoint_name(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._local_items = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        try:
            checkpoint_name(checkpoint_id)
            return True
        except (ValueError, TypeError):
            return False

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        # DCP passes rank=, its rank in the save's process group (0 without
        # one); a mount belongs to a global rank (see default_rank).
        self.is_coordinator = is_coordinator
        self.rank = default_rank()
        self.mount = rank_mount(self.mount_spec, self.rank)
        if self.name is None:
            raise ValueError("ckptfs.dcp.Writer: pass checkpoint_id=NAME to "
                             "dcp.save (the checkpoint's name in the mount)")
        checkpoint_name(self.checkpoint_id, self.mount)  # a path elsewhere: refused
        # the mount checked before anything is planned: alive (a dead one
        # is named as one, ENOTCONN), a ckptfs mount, of this world and rank
        check_dir(self.mount, f"rank {self.rank}: ")
        refuse_mismatch(self.mount, self.rank, default_world_size(), saving=True,
                        who=f"rank {self.rank}: ")
        job.declare(self.mount)  # its leftovers are abandoned if this process dies

    def storage_meta(self):
        return StorageMeta(checkpoint_id=self.name, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Refused before anything is staged (DCP raises it on every rank):
        # a NAME that exists, as stock DCP's FileSystemWriter does without
        # overwrite, and one whose earlier save still commits on this mount.
        st = self._state_here()
        if st == "committing":
            raise CkptfsError(
                f"rank {self.rank}: checkpoint {self.name!r} is still being "
                f"committed in {self.mount} by an earlier save: wait for it "
                "(ckptfs.wait, or the future of dcp.async_save) before saving "
                "it again")
        if st == "committed" and not self.overwrite:
            raise CkptfsError(
                f"Checkpoint already exists and self.overwrite=False: checkpoint "
                f"{self.name!r} is committed in {self.mount} (rank {self.rank}); "
                "pass overwrite=True to replace it, or pick another checkpoint_id")
        # DCP's planner keeps one copy of each replica; ckptfs keeps them
        # all and checks them, so write_data writes this whole local plan.
        # A cached plan (enable_plan_caching: usable=False, no items) says
        # nothing new: write_data then writes the final plan it gets.
        if self.replicas == "check" and getattr(plan, "usable", True) and plan.items:
            self._local_items = list(plan.items)
        else:
            self._local_items = None
        return plan

    def prepare_global_plan(self, plans):
        # The coordinator decides for every rank whether this save replaces
        # a committed NAME (what its mount shows is what every mount shows),
        # and gives the token of the working name the ranks stage it under.
        fqns = {it.index.fqn for p in plans for it in p.items}
        replace = self.overwrite and self._state_here() == "committed"
        if replace and not replaceable(self.name):
            raise CkptfsError(unreplaceable(self.name))
        data = SaveData(fqn_paths(fqns), replace, self.save_id[:TOKEN_CHARS])
        return [dataclasses.replace(p, storage_data=data) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        fut = Future()
        try:
            fut.set_result(self._write(plan, planner))
        except BaseException as e:  # noqa: B036  (DCP gathers it)
            fut.set_exception(e)
        return fut

    def finish(self, metadata, results):
        # The commit in write_data published the checkpoint: .metadata is
        # ckptfs's own, written by the daemons.
        return None

    # -- the work
    def _state_here(self):
        """NAME's state on this rank's mount ("" when there is none)."""
        return status_of(os.path.join(self.mount, self.name))[0]

    def _write(self, plan, planner):
        items = self._local_items if self._local_items is not None else list(plan.items)
        # DCP's plan caching hands write_data the plan of an earlier save,
        # storage_data and all: what it says is checked, not trusted.
        data = plan.storage_data
        if not isinstance(data, SaveData):
            data = SaveData(None, False, self.save_id[:TOKEN_CHARS])
        paths = data.paths
        if paths is None or any(it.index.fqn not in paths for it in items):
            paths = fqn_paths({it.index.fqn for it in items})
        ckdir = os.path.join(self.mount, self.name)
        try:
            ckdir = self._make_checkpoint_dir(ckdir, data.token)
        except CkptfsError:
            # Another save's staged checkpoint of this name, left on this
            # rank: fail this save on every rank now (the others wait for
            # this rank's commit), and leave that checkpoint as it is.
            abort_commit(ckdir, self.name)
            raise
        # replace=NAME where the coordinator saw NAME committed, or where
        # this rank stages under a working name (a staged name other than
        # NAME is published as NAME only with replace=)
        replace = data.replace or os.path.basename(ckdir) != self.name
        words = (f"replace={self.name}",) if replace else ()
        try:
            sizes = self._stage(ckdir, items, paths, planner)
        except BaseException:
            abort_save(ckdir, self.name, words)  # every rank fails now; discarded
            raise
        try:
            commit_dir(ckdir, self.name, self.commit_mode, words)
        except CommitError as e:
            aborted = aborted_elsewhere(e, ckdir, self.name, api="dcp")
            if aborted is not None:
                raise aborted from None
            # a failed DCP save is discarded, so the same id can be saved again
            discarded = discard_uncommitted(ckdir)
            raise CommitError(e.name, e.status, e.path, discarded=discarded,
                              api="dcp") from None
        except BaseException:
            abort_save(ckdir, self.name, words)
            raise
        return [WriteResult(index=it.index, size_in_bytes=sizes.get(it.index, 0),
                            storage_data=paths.get(it.index.fqn)) for it in plan.items]

    def _make_checkpoint_dir(self, ckdir, token):
        """Create the directory this rank stages in: ckdir (MOUNT/NAME), or
        a working name of token's when NAME is committed (overwrite); its
        path."""
        try:
            os.mkdir(ckdir)
            return ckdir
        except FileExistsError:
            pass
        except OSError as e:
            raise CkptfsError(f"rank {self.rank}: cannot create {ckdir}: "
                              f"{e.strerror}") from e
        st, text = status_of(ckdir)
        if st == "failed":
            # Our own earlier attempt that failed: it stays staged; start over.
            discard_staged(ckdir)
            os.mkdir(ckdir)
            return ckdir
        if st == "committed" and self.overwrite:
            if not replaceable(self.name):
                raise CkptfsError(f"rank {self.rank}: {unreplaceable(self.name)}")
            return make_working_dir(self.mount, self.name, token)
        how = {"committed": "pass overwrite=True to replace it, ",
               "committing": "wait for its commit (ckptfs.wait), "}.get(st, "")
        raise CkptfsError(f"rank {self.rank}: checkpoint {self.name!r} already exists "
                          f"in {self.mount} ({st or 'unknown state'}): {how}pick another "
                          "checkpoint_id, or remove it first")

    def _stage(self, ckdir, items, paths, planner):
        stager = Stager(self.threads)
        with StagingDirs(ckdir, batch=True) as dirs:
            dirs.make_all(os.path.dirname(paths[it.index.fqn]) for it in items)
            try:
                sizes = self._stage_items(dirs, items, paths, planner, stager)
            except BaseException:
                stager.abandon()
                raise
            stager.done()
        return sizes

    def _stage_items(self, dirs, items, paths, planner, stager):
        """Stage the items, their writes on stager's threads; {index: bytes
        stored}. The planner's calls stay on this thread."""
        sizes = {}
        by_fqn = {}
        for it in items:
            by_fqn.setdefault(it.index.fqn, []).append(it)
        for fqn, group in by_fqn.items():
            base = paths[fqn]
            # Tensor chunks always carry user.ckpt.fqn: another rank may hold
            # several chunks of this FQN at several paths, which ckptfs
            # accepts only when every chunk names its FQN.
            explicit = path_fqn(base) != fqn
            if group[0].type == WriteItemType.BYTE_IO:
                if len(group) > 1:
                    raise CkptfsError(f"{fqn}: {len(group)} bytes items under one FQN")
                data = planner.resolve_data(group[0])
                buf = data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data)
                sizes[group[0].index] = len(memoryview(buf).cast("B"))
                stager.submit(write_bytes_file, dirs, base, buf, fqn, explicit)
                continue
            explicit = True
            group.sort(key=lambda it: tuple(it.tensor_data.chunk.offsets))
            for k, it in enumerate(group):
                td = it.tensor_data
                offsets = tuple(td.chunk.offsets)
                rel = base
                if k > 0:
                    rel = f"{base}@{'_'.join(str(o) for o in offsets)}"
                    if len(os.path.basename(rel).encode()) > 255:
                        digest = hashlib.sha1(fqn.encode("utf-8", "surrogateescape"))
                        rel = os.path.join(os.path.dirname(base),
                                           f"@{digest.hexdigest()[:16]}_{k}")
                t = cpu_contiguous(planner.resolve_data(it))
                if tuple(t.shape) != tuple(td.chunk.sizes):
                    raise CkptfsError(f"{fqn}: the planner gave a chunk of shape "
                                      f"{tuple(t.shape)}, its plan says "
                                      f"{tuple(td.chunk.sizes)}")
                sizes[it.index] = t.numel() * t.element_size()
                stager.submit(write_tensor_file, dirs, rel, t, fqn, td.size,
                              offsets, explicit)
        return sizes


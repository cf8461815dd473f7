"""ckptfs for the Hugging Face Trainer (transformers) and Accelerate.

The Trainer writes output_dir/checkpoint-N/ with plain file writes: rank 0
the model, optimizer, scheduler, trainer_state.json and training_args.bin,
every rank its rng_state_R.pth (each rank makes the directory itself). With
output_dir a ckptfs rank mount (MOUNTROOT/rankR, one per process), all a
run needs is a commit of checkpoint-N on every rank once it is written:

    trainer = Trainer(..., args=TrainingArguments(output_dir=f"/mnt/ckpt/rank{rank}",
                                                  save_steps=500, save_total_limit=2),
                      callbacks=[ckptfs.hf.CommitCallback()])

The Trainer's own rotation (save_total_limit, rank 0's shutil.rmtree of the
oldest checkpoint-N) removes a committed checkpoint for every mount, and
resume_from_checkpoint=f"/mnt/ckpt/rank{rank}/checkpoint-N" reads the
committed files as any files, and resume_from_checkpoint=True finds the
newest committed one: the callback discards, when the Trainer is made and
again at train begin, every checkpoint-N a killed run left staged or
failed on this rank's mount (no live job writes it), before the Trainer's
get_last_checkpoint would pick it. Each commit records the Trainer's
global step (user.ckpt.step), which retention and ckptfs.latest order by.
Accelerate: save_state()/load_state() below. docs/pytorch.md has complete
examples.
"""

import logging
import os
import re
import shutil

from . import job
from .abort import abort_save
from .client import commit_staged, make_checkpoint_dir, save_words
from .errors import CkptfsError
from .protocol import commit, discard_leftovers, retention_words, status
from .world import check_dir, mount_world, world_mismatch

try:
    from transformers import TrainerCallback
except ImportError:  # Accelerate without transformers: save_state/load_state only
    TrainerCallback = object

PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
# the names transformers.trainer_utils.get_last_checkpoint takes
_CHECKPOINT_N = re.compile(r"^" + PREFIX + r"\-(\d+)$")

log = logging.getLogger(__name__)


def check_mount(mount, rank, world_size):
    """CkptfsError unless mount is the root of this rank's ckptfs mount in a
    world of world_size: checkpoints are directories directly under a mount's
    root, and a world of another size would wait commit_timeout at the first
    commit for ranks that never come. A mount whose daemon exited is named
    as one (ENOTCONN)."""
    check_dir(mount)
    if mount_world(mount) is None:
        raise CkptfsError(f"{mount} is not the root of a ckptfs rank mount (checkpoints "
                          "are directories directly under it: give each process its "
                          "own mount, e.g. output_dir=MOUNTROOT/rank{R})")
    why = world_mismatch(mount, rank, world_size)
    if why:
        raise CkptfsError(why)


def _barrier():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CommitCallback(TrainerCallback):
    """Commits each checkpoint-N on every rank after the Trainer saved it.

    on_save runs on every process once _save_checkpoint returned on it (the
    Trainer has no barrier there): the sync commit is collective, so it
    returns on each rank when every rank's part (rng_state_R.pth of each) is
    published as one checkpoint, or raises CommitError with the reason.
    args.output_dir must be this process's rank mount.

    A committed checkpoint-N that the run is about to save again (resumed
    from an earlier checkpoint) is removed first, as the Trainer overwrites
    it on a plain filesystem; a staged one a killed run left is discarded.
    Each commit records state.global_step as the checkpoint's step.

    Checked when the Trainer is made (on_init_end) and at train begin: the
    mount (alive, a ckptfs rank mount of this rank in a world of the
    Trainer's size, save_total_limit); then every checkpoint-N of this
    rank's mount that is staged or failed with no live job writing it
    (a killed run's leftover) is discarded, so that
    resume_from_checkpoint=True, whose get_last_checkpoint runs between
    the two, finds the newest committed checkpoint.
    """

    def on_init_end(self, args, state, control, **kwargs):
        self._start(args)

    def on_train_begin(self, args, state, control, **kwargs):
        self._start(args)

    def _start(self, args):
        check_mount(args.output_dir, args.process_index, args.world_size)
        if args.save_total_limit == 1:
            # the Trainer rotates before on_save commits the new checkpoint
            raise CkptfsError("save_total_limit=1 with ckptfs: the Trainer removes the "
                              "last committed checkpoint before the new one is "
                              "committed, so a failed commit would leave none; use "
                              "save_total_limit=2 or more, or leave it unset and mount "
                              "with -o keep_last=1 (removes only after a commit succeeded)")
        job.declare(args.output_dir)  # its leftovers are abandoned if this process dies
        for name, st in discard_leftovers(args.output_dir, _CHECKPOINT_N.match):
            log.warning("ckptfs: discarded %s on rank %d: %s with no live job writing it "
                        "(a killed run's leftover), so a resume does not pick it",
                        name, args.process_index, st)

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._make_room(args, state)

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._make_room(args, state)

    def on_save(self, args, state, control, **kwargs):
        name = f"{PREFIX}-{state.global_step}"
        # with save_only_model a rank other than 0 writes nothing, yet its
        # (empty) part must be committed too
        os.makedirs(os.path.join(args.output_dir, name), exist_ok=True)
        commit(args.output_dir, name, step=state.global_step)

    def _make_room(self, args, state):
        name = f"{PREFIX}-{state.global_step}"
        path = os.path.join(args.output_dir, name)
        try:
            st = status(args.output_dir, name)[0]
        except FileNotFoundError:
            st = None
        # rm -r of a committed checkpoint removes it for every mount (rank
        # 0's does); of a staged one discards this rank's files only
        if st in ("staging", "failed") or (st == "committed" and args.process_index == 0):
            shutil.rmtree(path)
        # every rank makes checkpoint-N itself: not before it is gone on rank 0
        _barrier()


def save_state(accelerator, mount, name, overwrite=True, exist_ok=False, step=None,
               **kwargs):
    """accelerator.save_state() into MOUNT/NAME on every process, then a sync
    commit of NAME on every rank (collective: call it on every process, each
    with its own rank mount).

    overwrite (True by default, as Accelerate's save_state overwrites its
    output_dir: a job resumed from step-4 saves step-8 again): a committed
    NAME is replaced atomically (staged under a working name, committed
    with replace=NAME; give every rank the same overwrite); False: a
    committed NAME raises on every rank before anything is written.
    exist_ok: discard what this rank left staged under NAME (a failed
    commit) and save again. step: the training step to record
    (user.ckpt.step), which retention (-o keep=...) and ckptfs.latest
    order by; None: the last run of digits in NAME counts. (Accelerate
    knows no global step: accelerator.step counts the batches of
    accelerator.accumulate() and restarts at 0 at each dataloader's end,
    so it is not used; pass your own.) kwargs go to save_state. Returns
    the path of NAME; CommitError when the commit fails, and a rank that
    fails before its commit fails it on every rank at once."""
    if accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("automatic_checkpoint_naming saves into project_dir/checkpoints/"
                         "checkpoint_I, not a checkpoint of the mount: turn it off and "
                         "name each checkpoint")
    check_mount(mount, accelerator.process_index, accelerator.num_processes)
    kept = retention_words(step)
    words = save_words(name, overwrite, False)
    ckdir = make_checkpoint_dir(mount, name, exist_ok, overwrite)
    try:
        accelerator.save_state(ckdir, **kwargs)
    except BaseException:
        abort_save(ckdir, name, words)
        raise
    commit_staged(ckdir, mount, name, "sync", words, kept)
    return os.path.join(mount, name)


def load_state(accelerator, mount, name, **kwargs):
    """accelerator.load_state() from the committed MOUNT/NAME (every process
    from its own rank mount; the committed checkpoint is the same on all)."""
    check_mount(mount, accelerator.process_index, accelerator.num_processes)
    st, text = status(mount, name)
    if st != "committed":
        raise CkptfsError(f"{name!r} in {mount} is {st}, not committed: "
                          f"{text.strip()}")
    accelerator.load_state(os.path.join(mount, name), **kwargs)

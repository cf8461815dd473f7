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
committed files as any files. Accelerate: save_state()/load_state() below.
docs/pytorch.md has complete examples.
"""

import os
import shutil

from . import job
from ._client import (CkptfsError, _abort_save, _make_checkpoint_dir, _save_words, commit,
                      commit_staged, mount_world, status, world_mismatch)

try:
    from transformers import TrainerCallback
except ImportError:  # Accelerate without transformers: save_state/load_state only
    TrainerCallback = object

PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


def check_mount(mount, rank, world_size):
    """CkptfsError unless mount is the root of this rank's ckptfs mount in a
    world of world_size: checkpoints are directories directly under a mount's
    root, and a world of another size would wait commit_timeout at the first
    commit for ranks that never come."""
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
    """

    def on_train_begin(self, args, state, control, **kwargs):
        check_mount(args.output_dir, args.process_index, args.world_size)
        job.declare(args.output_dir)  # its leftovers are abandoned if this process dies
        if args.save_total_limit == 1:
            # the Trainer rotates before on_save commits the new checkpoint
            raise CkptfsError("save_total_limit=1 with ckptfs: the Trainer removes the "
                              "last committed checkpoint before the new one is "
                              "committed, so a failed commit would leave none; use "
                              "save_total_limit=2 or more, or leave it unset and mount "
                              "with -o keep_last=1 (removes only after a commit succeeded)")

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
        commit(args.output_dir, name)

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


def save_state(accelerator, mount, name, overwrite=False, exist_ok=False, **kwargs):
    """accelerator.save_state() into MOUNT/NAME on every process, then a sync
    commit of NAME on every rank (collective: call it on every process, each
    with its own rank mount). overwrite: replace a committed NAME atomically
    (staged under a working name, committed with replace=NAME; give every
    rank the same overwrite), as save_state overwrites a plain directory;
    exist_ok: discard what this rank left staged under NAME (a failed
    commit) and save again. kwargs go to save_state. Returns the path of
    NAME; CommitError when the commit fails, and a rank that fails before
    its commit fails it on every rank at once."""
    if accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("automatic_checkpoint_naming saves into project_dir/checkpoints/"
                         "checkpoint_I, not a checkpoint of the mount: turn it off and "
                         "name each checkpoint")
    check_mount(mount, accelerator.process_index, accelerator.num_processes)
    words = _save_words(name, overwrite, False)
    ckdir = _make_checkpoint_dir(mount, name, exist_ok, overwrite)
    try:
        accelerator.save_state(ckdir, **kwargs)
    except BaseException:
        _abort_save(ckdir, name, words)
        raise
    commit_staged(ckdir, mount, name, "sync", words)
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

"""ckptfs.dcp - a torch.distributed.checkpoint (DCP) storage backend.

    import torch.distributed.checkpoint as dcp
    import ckptfs.dcp
    dcp.save(state_dict, checkpoint_id="step-100",
             storage_writer=ckptfs.dcp.Writer("/mnt/ckpt/rank%r"))
    dcp.async_save(state_dict, checkpoint_id="step-200",
                   storage_writer=ckptfs.dcp.Writer("/mnt/ckpt/rank%r"))
    dcp.load(state_dict, checkpoint_id="step-100",
             storage_reader=ckptfs.dcp.Reader("/mnt/ckpt/rank%r"))

One mount per rank (`%r` is the rank: torch.distributed's when a process
group is up, else the launcher's OMPI_COMM_WORLD_RANK / RANK / PMI_RANK /
SLURM_PROCID, else 0). The checkpoint_id is the checkpoint's NAME in the
mount (any file name not starting with '.'), or a path MOUNT/NAME.

Saving: every rank writes every item of its local plan into its mount,
replicated ones too (DCP's planner keeps one copy of a replica; ckptfs
keeps them all, compares them (replica_check) and stores one), then commits
NAME collectively (`sync` written to NAME/.commit): the checkpoint is
durable and committed for every rank when write_data returns, and the
future of dcp.async_save completes then. A rank that fails before it
commits makes the commit fail on every rank at once (it commits an item
ckptfs refuses, carrying its error), so every rank raises, never hangs,
.status and the CommitError saying "rank R aborted the save: ITS ERROR";
the staged checkpoint is then discarded on every rank, so the same id can
be saved again.

Saving a checkpoint_id that is already committed replaces it, as stock
DCP's FileSystemWriter does by default (Writer(overwrite=True)): the
coordinator sees NAME committed while it makes the global plan and says so
in the plan's storage_data, with a token; every rank stages under the
working name NAME.replace-TOKEN and commits with replace=NAME, which
publishes the new version as NAME in one atomic step for every mount.
overwrite=False raises ("Checkpoint already exists ...") on every rank
before anything is staged.

Paths: an FQN whose dot-separated parts are path-safe (non-empty, no '/',
not starting with '.', at most 255 bytes) is saved at the path of its parts
(`model.layer0.weight` at model/layer0/weight), as every ckptfs tool
expects. Any other FQN, or one whose path another FQN needs as a
directory, is saved under `_fqn/<sha1 of the FQN>` with the FQN in the
user.ckpt.fqn xattr; `.metadata` keeps every FQN exactly. Several chunks of
one tensor on one rank (DTensors with several local shards) are several
files carrying one user.ckpt.fqn.

Loading reads `.metadata` and each tensor's committed file, which holds the
whole global tensor: a shard of any layout is one pread when it is a

The package, by concern: paths (ranks, mounts, checkpoint names, FQN
paths), files (a DCP item as a staged file), writer (Writer), reader
(Reader, read_catalog, read_block), unpickler (a stock .metadata read
safely), stockmeta (a stock DCP directory checked before an import), stock
(import_checkpoint, export_checkpoint, the ckptfs-dcp command: main).
"""

from ..errors import CkptfsError, CommitError
from .paths import checkpoint_name, default_rank, default_world_size, fqn_paths, rank_mount
from .reader import Reader, read_block, read_catalog
from .stock import REFUSED, Mounted, export_checkpoint, import_checkpoint, main
from .stockmeta import read_dcp_metadata
from .unpickler import MetadataUnpickler
from .writer import Writer

# the name docs/pytorch.md gives the unpickler (its own module calls it
# MetadataUnpickler)
_MetadataUnpickler = MetadataUnpickler

__all__ = ["Writer", "Reader", "import_checkpoint", "export_checkpoint",
           "fqn_paths", "CkptfsError", "CommitError"]

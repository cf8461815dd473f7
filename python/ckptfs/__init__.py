"""ckptfs: save and load state dicts through a ckptfs rank mount.

    import ckptfs
    ckptfs.save({"model": model.state_dict(), "step": step},
                "/mnt/ckpt/rank0", "step-100", rank=0)
    sd = ckptfs.load(None, "/mnt/ckpt/rank0", "step-100")

and, for torch.distributed.checkpoint (DCP) users, a storage backend:

    import torch.distributed.checkpoint as dcp
    import ckptfs.dcp
    dcp.save(sd, checkpoint_id="step-100",
             storage_writer=ckptfs.dcp.Writer("/mnt/ckpt/rank%r"))

The core needs only the standard library; numpy and torch are imported
when a state dict holds their objects. ckptfs.dcp needs torch 2.x;
ckptfs.hf (the Hugging Face Trainer's CommitCallback, Accelerate's
save_state/load_state) imports transformers, and ckptfs.lightning (a
Lightning CheckpointIO) imports lightning, when first used.
"""

from . import job
from .client import (DTYPES, CkptfsError, CommitError, Shard, StagingBuffers,
                     async_save, commit, latest, load, save, status, wait)

__version__ = "0.3.0"
__all__ = ["save", "async_save", "StagingBuffers", "load", "wait", "status",
           "commit", "latest", "job", "Shard",
           "CommitError", "CkptfsError", "DTYPES"]


def __getattr__(name):
    # ckptfs.hf and ckptfs.lightning on first use: importing ckptfs must
    # import neither transformers nor lightning (ckptfs._client: the old
    # name of ckptfs.client)
    if name in ("hf", "lightning", "_client"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

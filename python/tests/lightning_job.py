"""One rank of a Lightning DDP run (CPU, gloo) checkpointing through
ckptfs.lightning.CheckpointIO, started by test_lightning.py under mpirun:

    lightning_job.py DIRPATH MOUNT CKPT_PATH RESULT

DIRPATH: ModelCheckpoint's dirpath (a ckptfs mount); MOUNT: the plugin's
mount pattern (rank%r), or "-" for none (DIRPATH is this rank's mount,
ckpt-rank-exec); CKPT_PATH: trainer.fit's ckpt_path ("-" for none);
RESULT: each rank writes RESULT.rankR, a JSON of its final state (sha256
of the bytes of every tensor of the model and the optimizer state), the
global step, the ModelCheckpoint's top k and last, its rank, and the
device (st_dev) and user.ckpt.rank of the mount at DIRPATH.
$CKPT_KILL_EPOCH: rank 0 SIGKILLs itself in the second training step of
that epoch.

The data, the model and the scores ModelCheckpoint monitors are fixed, so
that two runs of the same steps end in the same bits.
"""

import hashlib
import json
import os
import signal
import sys

# Lightning's LightningEnvironment from Open MPI's variables (its
# MPIEnvironment needs mpi4py): with LOCAL_RANK set, Lightning takes the
# processes as launched outside it.
RANK = os.environ["OMPI_COMM_WORLD_RANK"]
os.environ.update(RANK=RANK, WORLD_SIZE=os.environ["OMPI_COMM_WORLD_SIZE"],
                  LOCAL_RANK=os.environ["OMPI_COMM_WORLD_LOCAL_RANK"], NODE_RANK="0",
                  MASTER_ADDR="127.0.0.1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ckptfs.lightning  # noqa: E402

EPOCHS = 6
# the monitored score of each epoch (mode min): the top 2 are epochs 3 and
# 5, and epochs 0, 1, 2 and 4 enter the top 2 and are rotated out
SCORES = [5.0, 3.0, 4.0, 1.0, 2.5, 2.0]
KILL_EPOCH = int(os.environ.get("CKPT_KILL_EPOCH", "-1"))


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, i):
        if self.current_epoch == KILL_EPOCH and i == 1 and self.global_rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, i):
        pass

    def on_validation_epoch_end(self):
        self.log("score", SCORES[self.current_epoch], sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def digest(t):
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def main():
    dirpath, mount, ckpt_path, result = sys.argv[1:]
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g))
    L.seed_everything(0, verbose=False)
    model = Tiny()
    ckpt = ModelCheckpoint(dirpath=dirpath, save_top_k=2, save_last=True, monitor="score",
                           mode="min")
    io = ckptfs.lightning.CheckpointIO(mount=None if mount == "-" else mount)
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp",
                        max_epochs=EPOCHS, plugins=[io], callbacks=[ckpt], logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=os.path.dirname(result))
    trainer.fit(model, DataLoader(data, batch_size=2), DataLoader(data, batch_size=4),
                ckpt_path=None if ckpt_path == "-" else ckpt_path, weights_only=True)
    opt = trainer.optimizers[0].state_dict()
    state = {f"model.{k}": digest(v) for k, v in model.state_dict().items()}
    for p, st in opt["state"].items():
        state.update({f"opt.{p}.{k}": digest(v) for k, v in st.items()})
    with open(f"{result}.rank{RANK}", "w") as f:
        json.dump({"rank": int(RANK), "dev": os.stat(dirpath).st_dev,
                   "mount_rank": int(os.getxattr(dirpath, "user.ckpt.rank")),
                   "state": state, "global_step": trainer.global_step,
                   "top_k": sorted(os.path.basename(p) for p in ckpt.best_k_models),
                   "last": os.path.basename(ckpt.last_model_path)}, f)
    # as torch asks: a process ending with its gloo group alive aborts now
    # and then at exit ("terminate called without an active exception");
    # a gloo thread can still be freeing a collective's tensors after
    # destroy_process_group() (the trainer keeps the group): leave without
    # the interpreter's teardown
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

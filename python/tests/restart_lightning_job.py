"""One rank of a Lightning DDP run (CPU, gloo) that crashes and restarts
over ckptfs rank mounts, started by test_restart_frameworks.py under
mpirun:

    restart_lightning_job.py ROOT PHASE KILL

ROOT/rankR is this rank's mount (CheckpointIO(mount=ROOT/rank%r));
ModelCheckpoint's dirpath is ROOT/rank0 on every rank (it lists what was
saved there). PHASE "run" trains from scratch, "resume" with
ckpt_path="last" (ckptfs.lightning.ModelCheckpoint: committed last*.ckpt
only); KILL "none" or "RANKS:WHEN:STEP" (RANKS 0, 1 or all; WHEN before /
during / after; STEP the saves of that global step, epoch=E-step=STEP.ckpt
then last.ckpt):

    before  in ModelCheckpoint.on_train_batch_end of STEP, before it saves
    during  rank 0 (Lightning saves on rank 0 alone, a solo commit): once
            epoch=E-step=STEP.ckpt is staged, before its commit; another
            rank (nothing to write): as it enters the strategy's
            save_checkpoint, while rank 0 writes
    after   once ModelCheckpoint.on_train_batch_end returned: both saves
            committed

A small MLP (no dropout: Lightning saves no RNG state), Adam, 8 samples:
2 steps an epoch at 2 ranks, so that every save (every_n_train_steps=2)
is at an epoch's end (Lightning does not move a plain DataLoader to the
middle of an epoch on resume); max_steps=8; save_top_k=-1, save_last=True,
enable_version_counter=False (a resumed run saves its names again, not
-v1 copies). Each rank writes $CKPT_RESULT_DIR/rankR.json: the digest of
its final model and Adam state, the steps it trained, the checkpoint it
resumed from, what its mount lists.
"""

import hashlib
import json
import os
import sys

RANK = int(os.environ["OMPI_COMM_WORLD_RANK"])
# Lightning's LightningEnvironment from Open MPI's variables (lightning_job.py)
os.environ.update(RANK=str(RANK), WORLD_SIZE=os.environ["OMPI_COMM_WORLD_SIZE"],
                  LOCAL_RANK=os.environ["OMPI_COMM_WORLD_LOCAL_RANK"], NODE_RANK="0",
                  MASTER_ADDR="127.0.0.1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ckptfs  # noqa: E402
from restart_kill import die, kill_when  # noqa: E402
import ckptfs._client  # noqa: E402
import ckptfs.lightning  # noqa: E402

STEPS = 8


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 2))
        self.steps = []

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, i):
        self.steps.append(self.trainer.global_step)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Checkpoints(ckptfs.lightning.ModelCheckpoint):
    """ckptfs.lightning.ModelCheckpoint with the kill points."""

    def __init__(self, kill, **kw):
        super().__init__(**kw)
        self.kill = kill

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        when = kill_when(self.kill, step) if step % 2 == 0 else None
        if when == "before":
            die(f"before the saves of step {step}")
        elif when == "during":
            self.arm(trainer, step)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if when == "after":
            die(f"after the saves of step {step} were committed")

    def arm(self, trainer, step):
        if RANK == 0:
            real = ckptfs._client.commit_staged

            def commit_staged(ckdir, *a, **kw):
                die(f"during: {os.path.basename(ckdir)} staged, not committed")
                return real(ckdir, *a, **kw)
            ckptfs._client.commit_staged = commit_staged
        else:
            def save_checkpoint(*a, **kw):
                die(f"during: while rank 0 saves step {step}")
            trainer.strategy.save_checkpoint = save_checkpoint


def digest(model, opt):
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + v.detach().contiguous().reshape(-1).view(torch.uint8)
                 .numpy().tobytes())
    for p, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{p}.{k}".encode() + v.detach().contiguous().reshape(-1)
                     .view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(root, phase, kill):
    mount = os.path.join(root, f"rank{RANK}")
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))
    L.seed_everything(0, verbose=False)
    model = Tiny()
    ckpt = Checkpoints(kill, dirpath=os.path.join(root, "rank0"), every_n_train_steps=2,
                       save_top_k=-1, save_last=True, enable_version_counter=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp",
                        max_steps=STEPS, plugins=[ckptfs.lightning.CheckpointIO(
                            mount=os.path.join(root, "rank%r"))],
                        callbacks=[ckpt], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=os.environ["CKPT_RESULT_DIR"])
    trainer.fit(model, DataLoader(data, batch_size=2),
                ckpt_path="last" if phase == "resume" else None, weights_only=True)
    assert trainer.global_step == STEPS, trainer.global_step
    for name in os.listdir(mount):
        st = ckptfs.status(mount, name)[0]
        assert st == "committed", f"{name} is {st} on rank {RANK}"
    result(digest=digest(model, trainer.optimizers[0]), steps=model.steps,
           resumed=os.path.basename(trainer.ckpt_path) if trainer.ckpt_path else None,
           listing=sorted(os.listdir(mount)))


def result(**kw):
    d = os.environ["CKPT_RESULT_DIR"]
    with open(os.path.join(d, f".rank{RANK}.tmp"), "w") as f:
        json.dump(dict(rank=RANK, **kw), f)
    os.replace(os.path.join(d, f".rank{RANK}.tmp"), os.path.join(d, f"rank{RANK}.json"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    # leave without the interpreter's teardown once every rank is done
    # (torch's gloo threads abort a process at exit now and then:
    # lightning_job.py)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

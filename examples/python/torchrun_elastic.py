#!/usr/bin/env python3
"""torchrun_elastic.py - a DCP training loop that survives torchrun's
elastic restart on ckptfs: a rank dies in the middle of a save, torchrun
restarts the workers, and they resume from the newest committed checkpoint.

    mount-scripts/ckpt-mount -n 2 /var/tmp/ckpt /mnt/ckpt
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 --no-python \\
        mount-scripts/ckpt-rank-exec /mnt/ckpt /ckpt -- \\
        .venv/bin/python examples/python/torchrun_elastic.py --mount /ckpt \\
        --crash-in-save 1:6
    mount-scripts/ckpt-umount /mnt/ckpt

torchrun execs ckpt-rank-exec (hence --no-python), which puts this rank's
mount /mnt/ckpt/rank$RANK at /ckpt and execs Python in its place (the
worker torchrun watches and signals is this very process). Without
ckpt-rank-exec, run the script itself and give --mount /mnt/ckpt/rank%r.

A 2-layer MLP, fully_shard'ed (FSDP2) on a CPU mesh of all ranks (gloo),
Adam, --steps steps; every --save-every steps each rank saves {"model",
"optim", "step"} as step-N with dcp.save through ckptfs.dcp.Writer (the
Writer declares this process a job of its mount: ckptfs abandons what it
leaves half-saved if it dies). At start, every attempt loads
ckptfs.latest(mount, "step-") when there is one, and trains on from there;
it saves the same names again (an abandoned save left its name free; a
committed one is replaced). At the end each rank prints the SHA-256 of the
full model and optimizer state: bit-exact with a run never interrupted.

--crash-in-save RANK:STEP (a demonstration, on torchrun's first attempt
only): rank RANK SIGKILLs itself in the middle of the save of step-STEP,
after staging a few of its files. torchrun stops the other rank and starts
attempt 1 (TORCHELASTIC_RESTART_COUNT=1), which resumes from the save
before. Tested by python/tests/test_elastic.py; torch 2.13.0 (CPU).
"""

import argparse
import hashlib
import os
import signal
import sys

try:
    import ckptfs.dcp
except ImportError:  # a checkout without the package installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "python"))
    import ckptfs.dcp
import ckptfs  # noqa: E402
import ckptfs.job  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_distributed():
    # torchrun keeps one TCPStore for the whole run (its agent's): the keys
    # attempt 0's gloo group left there (each rank's address) are still
    # there when attempt 1 starts, and a group made on them again reads the
    # dead workers' addresses. A prefix of its own per attempt, keyed by
    # TORCHELASTIC_RESTART_COUNT, gives each attempt a fresh store.
    store, rank, size = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"attempt-{RESTART}", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    return rank, size


def build(size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    fully_shard(model, mesh=init_device_mesh("cpu", (size,)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model, opt, step, rank, size):
    g = torch.Generator().manual_seed(step)  # step's batch: the same in every run
    x = torch.randn(4 * size, 16, generator=g)[4 * rank:4 * (rank + 1)]
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def digest(model, opt):
    """SHA-256 of the full model and optimizer state (a collective)."""
    msd, osd = get_state_dict(model, opt)
    h = hashlib.sha256()
    flat = {f"model.{k}": v for k, v in msd.items()}
    flat.update({f"optim.{p}.{k}": v for p, st in osd["state"].items()
                 for k, v in st.items()})
    for k in sorted(flat):
        v = flat[k]
        v = v.full_tensor() if isinstance(v, DTensor) else v
        if torch.is_tensor(v):
            h.update(k.encode() + v.detach().contiguous().view(-1).view(torch.uint8)
                     .numpy().tobytes())
    return h.hexdigest()


class CrashMidSave(DefaultSavePlanner):
    """--crash-in-save: SIGKILL this process once it has handed DCP's
    writer a few items (the Writer is staging them into the mount)."""

    def __init__(self, say):
        super().__init__()
        self.say, self.items = say, 0

    def resolve_data(self, write_item):
        self.items += 1
        if self.items == 4:
            self.say("SIGKILL in the middle of the save (--crash-in-save)")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(write_item)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mount", default="/ckpt",
                    help="this rank's ckptfs mount (%%r: the rank) [/ckpt]")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--crash-in-save", metavar="RANK:STEP",
                    help="on the first attempt, rank RANK dies saving step-STEP")
    args = ap.parse_args()

    rank, size = init_distributed()

    def say(msg):  # one write(2): the ranks share torchrun's stdout
        line = f"rank {rank} (attempt {RESTART}, pid {os.getpid()}): {msg}\n"
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), line.encode())

    mount = ckptfs.dcp.rank_mount(args.mount, rank)
    model, opt = build(size)
    first = 0
    resume = ckptfs.latest(mount, "step-")   # newest committed, or None
    everyone = [None] * size
    dist.all_gather_object(everyone, resume)
    if len(set(everyone)) != 1:
        raise SystemExit(f"ranks see different newest checkpoints: {everyone}")
    if resume:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd, "step": 0}
        dcp.load(sd, checkpoint_id=resume, storage_reader=ckptfs.dcp.Reader(args.mount))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        first = int(sd["step"])
        say(f"resumed from {resume} (the newest committed), step {first}")
    else:
        say("no committed checkpoint: starting from scratch")

    crash = None
    if args.crash_in_save and RESTART == 0:
        r, s = args.crash_in_save.split(":")
        crash = (int(r), int(s))
    for step in range(first + 1, args.steps + 1):
        train_step(model, opt, step, rank, size)
        if step % args.save_every and step != args.steps:
            continue
        name = f"step-{step}"
        msd, osd = get_state_dict(model, opt)
        planner = CrashMidSave(say) if crash == (rank, step) else None
        dcp.save({"model": msd, "optim": osd, "step": step}, checkpoint_id=name,
                 storage_writer=ckptfs.dcp.Writer(args.mount), planner=planner)
        say(f"saved {name}")   # committed on every rank: dcp.save returned

    say(f"final state sha256 {digest(model, opt)}")
    dist.destroy_process_group()
    sys.stdout.flush()
    # os._exit skips atexit, where ckptfs says "end" for this job: say it
    # here (with dcp.save every save is committed already; it matters for
    # an async commit still under way). os._exit: a gloo thread still
    # freeing tensors may abort a normal interpreter exit.
    ckptfs.job.end()
    os._exit(0)


if __name__ == "__main__":
    main()

"""One rank of an Accelerate job that crashes and restarts over ckptfs rank
mounts, started by test_restart_frameworks.py under mpirun (gloo on CPU,
127.0.0.1:$MASTER_PORT):

    restart_acc_job.py ROOT PHASE KILL

ROOT/rankR is this rank's mount; PHASE "run" trains from scratch,
"resume" from ckptfs.latest(mount, "step-") (ckptfs.hf.load_state; every
rank must find the same); KILL "none" or "RANKS:WHEN:STEP" (RANKS 0, 1 or
all; WHEN before / during / after; STEP the save of step-STEP):

    before  before ckptfs.hf.save_state of step-STEP
    during  right after this rank's first torch.save into step-STEP (rank
            0: model.safetensors and optimizer.bin written, not the
            scheduler; rank 1: its random_states_1.pkl), before the commit
    after   once save_state returned: step-STEP committed

A DDP model with dropout, AdamW and StepLR, 8 steps, ckptfs.hf.save_state
of step-N every 2 steps (step=N recorded); each rank draws its data and
dropout from its own RNG stream, which save_state saves and load_state
restores. Each rank writes $CKPT_RESULT_DIR/rankR.json: the digest of its
final model, optimizer and scheduler state, the steps it trained, the
checkpoint it resumed from, what its mount lists.
"""

import hashlib
import json
import os
import sys

RANK = int(os.environ["OMPI_COMM_WORLD_RANK"])
WS = int(os.environ["OMPI_COMM_WORLD_SIZE"])
os.environ.update(RANK=str(RANK), WORLD_SIZE=str(WS), LOCAL_RANK=str(RANK),
                  LOCAL_WORLD_SIZE=str(WS), MASTER_ADDR="127.0.0.1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ckptfs  # noqa: E402
from restart_kill import die, kill_when  # noqa: E402
import ckptfs.hf  # noqa: E402

STEPS = 8


def dying_save(mount):
    """The first torch.save into a directory of mount (step-N, or the
    working name of a save replacing it) kills this process once written."""
    real = torch.save

    def save(obj, f, *a, **kw):
        real(obj, f, *a, **kw)
        if isinstance(f, (str, os.PathLike)) and os.path.dirname(
                os.path.dirname(os.path.abspath(f))) == os.path.abspath(mount):
            die(f"during: after writing {f}")
    torch.save = save


def digest(acc, model, opt, sched):
    h = hashlib.sha256()
    for k, v in sorted(acc.unwrap_model(model).state_dict().items()):
        h.update(k.encode() + v.detach().contiguous().reshape(-1).view(torch.uint8)
                 .numpy().tobytes())
    for p, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{p}.{k}".encode() + v.detach().contiguous().reshape(-1)
                     .view(torch.uint8).numpy().tobytes())
    h.update(repr(sched.state_dict()).encode())
    return h.hexdigest()


def main(root, phase, kill):
    from accelerate import Accelerator

    mount = os.path.join(root, f"rank{RANK}")
    acc = Accelerator(cpu=True)
    assert acc.num_processes == WS and acc.process_index == RANK
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    torch.manual_seed(1000 + RANK)   # data and dropout: this rank's stream
    first, resumed = 0, None
    if phase == "resume":
        resumed = ckptfs.latest(mount, "step-")
        everyone = [None] * WS
        dist.all_gather_object(everyone, resumed)
        assert len(set(everyone)) == 1, f"ranks resume from different checkpoints: {everyone}"
        if resumed is not None:
            ckptfs.hf.load_state(acc, mount, resumed)
            first = int(os.getxattr(os.path.join(mount, resumed), "user.ckpt.step"))
    steps = []
    for step in range(first + 1, STEPS + 1):
        acc.backward(model(torch.randn(4, 8)).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
        steps.append(step)
        if step % 2:
            continue
        when = kill_when(kill, step)
        if when == "before":
            die(f"before step-{step}")
        elif when == "during":
            dying_save(mount)
        ckptfs.hf.save_state(acc, mount, f"step-{step}", step=step)
        if when == "after":
            die(f"after step-{step} was committed")
    for name in os.listdir(mount):
        st = ckptfs.status(mount, name)[0]
        assert st == "committed", f"{name} is {st} on rank {RANK}"
    result(digest=digest(acc, model, opt, sched), steps=steps, resumed=resumed,
           listing=sorted(os.listdir(mount)))


def result(**kw):
    d = os.environ["CKPT_RESULT_DIR"]
    with open(os.path.join(d, f".rank{RANK}.tmp"), "w") as f:
        json.dump(dict(rank=RANK, **kw), f)
    os.replace(os.path.join(d, f".rank{RANK}.tmp"), os.path.join(d, f"rank{RANK}.json"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    # leave without the interpreter's teardown once every rank is done
    # (torch's gloo threads abort a process at exit now and then: hf_job.py)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

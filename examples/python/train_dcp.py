#!/usr/bin/env python3
"""train_dcp.py - train a small PyTorch model with FSDP2 (fully_shard) on N
ranks, checkpoint it with torch.distributed.checkpoint (DCP) into ckptfs
through ckptfs.dcp, async saves overlapping training, and resume it at
another world size, bit for bit.

Train (one process per rank mount, under mpirun; %r is the rank):

    mount-scripts/ckpt-mount -n 2 /var/tmp/ckpt /tmp/ckpt
    mpirun -np 2 --allow-run-as-root --oversubscribe .venv/bin/python \\
        examples/python/train_dcp.py --mount /tmp/ckpt/rank%r --ref /tmp/ckpt-ref.json
    mount-scripts/ckpt-umount /tmp/ckpt

Resume at 4 ranks (or 1, 2, 8) from mounts of the same backing directory:

    mount-scripts/ckpt-mount -n 4 /var/tmp/ckpt /tmp/ckpt
    mpirun -np 4 --allow-run-as-root --oversubscribe .venv/bin/python \\
        examples/python/train_dcp.py --mount /tmp/ckpt/rank%r --resume --ref /tmp/ckpt-ref.json
    mount-scripts/ckpt-umount /tmp/ckpt

The model is a 2-layer MLP on synthetic regression data with Adam,
fully_shard'ed on a CPU device mesh of all ranks (gloo; MASTER_ADDR
127.0.0.1, MASTER_PORT from the environment, default 29517; rank and world
size from Open MPI's OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE). Every
--save-every steps every rank saves {"model", "optim", "step"}
(get_state_dict: sharded DTensors) as checkpoint step-N with
dcp.async_save, on a gloo process group of its own, so the next training
steps overlap the save; the previous save's future is waited for before
the next starts. Rank 0 records a SHA-256 of the full tensor of every
parameter and optimizer state tensor at each saved step and at the last
step in --ref.

--resume (at any world size dividing --micro-batches) loads the newest
committed step-N with dcp.load into a freshly built sharded model and
optimizer (set_state_dict), checks every tensor against --ref bit for bit
(exit 1 if any differs), trains on to --steps (default: the run's last
step) and checks the final tensors against the original run's too.

Why the result does not depend on the world size: each step's global batch
is --micro-batches micro-batches (the same data at any world size); each
rank runs forward and backward on its share, one micro-batch at a time, so
every micro-batch gradient is computed with the same shapes everywhere.
Each micro-batch gradient is rounded to a multiple of 2^-20 and clamped to
[-1, 1] in the backward pass (QuantGrad), so adding them up, locally and in
FSDP's reduce-scatter (divide factor 1, a sum), is exact in float32 in any
order; the sum is then scaled by 1/micro-batches, a power of two, exactly.
Adam is elementwise. Needs torch 2.x (tested: 2.13.0, CPU build, in .venv
made by scripts/install-deps.sh) and the ckptfs package (pip install ./python).
"""

import argparse
import hashlib
import json
import os
import re
import sys

try:
    import ckptfs.dcp
except ImportError:  # a checkout without the package installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "python"))
    import ckptfs.dcp

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

IN, HIDDEN, OUT, MICRO_ROWS = 16, 64, 8, 4
GRID = 2.0 ** 20          # micro-batch gradients are multiples of 1/GRID


def world():
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", 0)))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    return rank, size


class QuantGrad(torch.autograd.Function):
    """Identity forward; backward rounds the gradient to the 2^-20 grid,
    within [-1, 1]: sums of up to 15 of them are exact in float32."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return torch.round(g * GRID).clamp_(-GRID, GRID) / GRID


class QLinear(torch.nn.Linear):
    def forward(self, x):
        return torch.nn.functional.linear(x, QuantGrad.apply(self.weight),
                                          QuantGrad.apply(self.bias))


def build(size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(QLinear(IN, HIDDEN), torch.nn.ReLU(), QLinear(HIDDEN, OUT))
    mesh = init_device_mesh("cpu", (size,))
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)   # the reduce-scatter is a plain
    model.set_gradient_divide_factor(1.0)           # sum (gloo has no PREMUL_SUM)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def micro_batch(step, j):
    """Micro-batch j of step's global batch: the same in every run."""
    g = torch.Generator().manual_seed(100003 * step + j)
    x = torch.randn(MICRO_ROWS, IN, generator=g)
    w = torch.linspace(-1, 1, IN * OUT).reshape(IN, OUT)
    return x, torch.tanh(x @ w) + 0.01 * torch.randn(MICRO_ROWS, OUT, generator=g)


def train_step(model, opt, step, rank, size, micro):
    mine = range(rank * (micro // size), (rank + 1) * (micro // size))
    for i, j in enumerate(mine):
        model.set_requires_gradient_sync(i == len(mine) - 1)   # reduce once, at the end
        x, y = micro_batch(step, j)
        torch.nn.functional.mse_loss(model(x), y).backward()
    for p in model.parameters():
        p.grad.mul_(1.0 / micro)   # a power of two: exact
    opt.step()
    opt.zero_grad(set_to_none=True)


def digests(model, opt):
    """{name: SHA-256 of the full tensor's bytes} of every parameter and
    optimizer state tensor (a collective: every rank calls it)."""
    msd, osd = get_state_dict(model, opt)
    out = {}

    def put(key, t):
        if isinstance(t, DTensor):
            t = t.full_tensor()
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        out[key] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()

    for k in sorted(msd):
        put("model." + k, msd[k])
    for pk in sorted(osd["state"]):
        for sk, v in sorted(osd["state"][pk].items()):
            if torch.is_tensor(v):
                put(f"optim.{pk}.{sk}", v)
    return out


def say(rank, msg, everyone=False):
    if everyone:
        print(f"rank {rank}: {msg}", flush=True)
    elif rank == 0:
        print(msg, flush=True)


def status(mount, name):
    with open(os.path.join(mount, name, ".status")) as f:
        return f.readline().strip()


def train(args, rank, size):
    model, opt = build(size)
    # async_save's collectives run in a background thread while training
    # runs its own: they need a process group of their own.
    ckpt_pg = dist.new_group(backend="gloo")
    mount = ckptfs.dcp.rank_mount(args.mount, rank)
    ref = {"world_size": size, "micro_batches": args.micro_batches}
    pending = fut = None
    for step in range(1, args.steps + 1):
        train_step(model, opt, step, rank, size, args.micro_batches)
        if step % args.save_every == 0:
            if fut is not None:
                fut.result()   # one save in flight at a time
                say(rank, f"{pending}: {status(mount, pending)} (saved while "
                          f"training steps {int(pending[5:]) + 1}-{step})", everyone=True)
            msd, osd = get_state_dict(model, opt)
            pending = f"step-{step}"
            fut = dcp.async_save({"model": msd, "optim": osd, "step": step},
                                 checkpoint_id=pending,
                                 storage_writer=ckptfs.dcp.Writer(args.mount),
                                 process_group=ckpt_pg)
            say(rank, f"step {step}: async save of {pending} started", everyone=True)
            ref[pending] = digests(model, opt)
    ref["final"] = {"step": args.steps, **digests(model, opt)}
    if fut is not None:
        fut.result()
        say(rank, f"{pending}: {status(mount, pending)}", everyone=True)
    dist.barrier()
    if rank == 0 and args.ref:
        with open(args.ref, "w") as f:
            json.dump(ref, f, indent=1, sort_keys=True)
    return True


def newest(mount):
    steps = []
    for n in os.listdir(mount):
        m = re.fullmatch(r"step-(\d+)", n)
        if m and status(mount, n) == "committed":
            steps.append(int(m.group(1)))
    return f"step-{max(steps)}" if steps else None


def compare(rank, what, got, want):
    bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    for k in bad:
        say(rank, f"  {what}: {k}: {got.get(k, 'missing')} != {want.get(k, 'missing')}")
    return not bad


def resume(args, rank, size):
    ref = None
    if args.ref:
        with open(args.ref) as f:
            ref = json.load(f)
    micro = ref["micro_batches"] if ref else args.micro_batches
    if micro % size:
        sys.exit(f"train_dcp.py: the world size ({size}) must divide the "
                 f"micro-batches per step ({micro})")
    args.micro_batches = micro
    mount = ckptfs.dcp.rank_mount(args.mount, rank)
    found = [newest(mount) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    name = found[0]
    if name is None:
        sys.exit(f"train_dcp.py: no committed step-N checkpoint in {mount}")
    model, opt = build(size)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "step": None}
    dcp.load(sd, checkpoint_id=name, storage_reader=ckptfs.dcp.Reader(args.mount))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    step = sd["step"]
    say(rank, f"resumed {name} (step {step}) at world size {size} from {args.mount}")
    ok = True
    origin = f"the {ref['world_size']}-rank run" if ref else ""
    got = digests(model, opt)
    if ref:
        if compare(rank, name, got, ref[name]):
            say(rank, f"{name}: model and optimizer state bit-identical to {origin} "
                      f"({len(got)} tensors)")
        else:
            ok = False
    final = args.steps or (ref["final"]["step"] if ref else step)
    for s in range(step + 1, final + 1):
        train_step(model, opt, s, rank, size, micro)
    got = digests(model, opt)
    if ref and final == ref["final"]["step"] and final > step:
        want = {k: v for k, v in ref["final"].items() if k != "step"}
        if compare(rank, f"step {final}", got, want):
            say(rank, f"step {final}: trained on from {name} at world size {size}, "
                      f"bit-identical to {origin}")
        else:
            ok = False
    elif final > step:
        say(rank, f"step {final}: trained on from {name} at world size {size}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mount", required=True,
                    help="each rank's mount; %%r is replaced by the rank")
    ap.add_argument("--steps", type=int, default=0,
                    help="train until this step (default: 10; with --resume: "
                         "the original run's last step, from --ref)")
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8,
                    help="micro-batches per step (of %d rows); the world size "
                         "must divide it (default 8)" % MICRO_ROWS)
    ap.add_argument("--ref", help="digests of the training run (written by "
                                  "training, checked by --resume)")
    ap.add_argument("--resume", action="store_true",
                    help="load the newest committed checkpoint and check it")
    args = ap.parse_args()
    if args.micro_batches > 15:
        sys.exit("train_dcp.py: at most 15 micro-batches (exact float32 sums)")
    rank, size = world()
    if not args.resume and args.micro_batches % size:
        sys.exit(f"train_dcp.py: the world size ({size}) must divide "
                 f"--micro-batches ({args.micro_batches})")
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        if args.resume:
            ok = resume(args, rank, size)
        else:
            args.steps = args.steps or 10
            ok = train(args, rank, size)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if not ok:
        print(f"train_dcp.py: rank {rank}: MISMATCH with the original run", file=sys.stderr)
    # Leave without the interpreter's teardown: even after
    # destroy_process_group() the FSDP mesh keeps the gloo group alive, and a
    # gloo thread still freeing a finished collective's tensors then aborts
    # the process at exit now and then ("terminate called without an active
    # exception": 2 of 30 4-rank resumes here, torch 2.13).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()

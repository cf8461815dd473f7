#!/usr/bin/env python3
"""train_resume.py - train a small PyTorch model data-parallel on 2 ranks,
checkpoint it through ckptfs with async commits, and resume it on 1 rank.

Train (one process per rank mount, under mpirun; ROOT/rank%r is each
process's mount, %r its rank):

    mount-scripts/ckpt-mount -n 2 /var/tmp/ckpt-backing /tmp/ckpt
    mpirun -np 2 --allow-run-as-root .venv/bin/python examples/python/train_resume.py \
        --mount /tmp/ckpt/rank%r --steps 10 --save-every 4 --ref /tmp/ref.json
    mount-scripts/ckpt-umount /tmp/ckpt

Resume (one process, on a 1-rank mount of the same backing directory):

    build/bin/ckptfs /var/tmp/ckpt-backing /tmp/ckpt1
    .venv/bin/python examples/python/train_resume.py --mount /tmp/ckpt1 --resume --ref /tmp/ref.json
    fusermount3 -u /tmp/ckpt1

The model is a 2-layer MLP on synthetic regression data with Adam. Each
rank computes the gradients of its half of every global batch; the two are
averaged with an all-reduce (gloo over loopback, with a file store: one
machine), so both replicas take identical steps. Every --save-every steps every rank saves
{"model", "optim", "step", "rng/rankR"} as checkpoint step-N with an async
commit (training goes on while it is written; the previous save is waited
for before the next starts), so model and optimizer state are replicas that
ckptfs stores once. Rank 0 records a SHA-256 of every parameter and
optimizer state tensor at each saved step, and at the last step, in --ref.

--resume loads the newest committed step-N into a freshly built model and
optimizer, checks every tensor against --ref bit for bit (exit 1 if any
differs), then trains on to --steps alone, computing both halves of each
batch itself in the same order, and checks the final parameters against
the 2-rank run's too. This is the plain client (ckptfs.save / load); for
torch.distributed.checkpoint see train_dcp.py. Needs torch (tested: 2.13.0
in .venv, made by scripts/install-deps.sh; Debian's python3-torch 1.13
works too) and the ckptfs package (pip install ./python; without it, the
checkout's python/ directory is used).
"""

import argparse
import hashlib
import json
import os
import re
import sys

try:
    import ckptfs  # the package: pip install ./python (.venv has it, editable)
except ImportError:  # a checkout without it installed: <repo>/python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "python"))
    import ckptfs  # noqa: E402

import torch  # noqa: E402

IN, HIDDEN, OUT, BATCH = 16, 32, 4, 32


def world():
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", 0)))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
    return rank, size


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, OUT))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def batch(step):
    """The global batch of step: the same on every rank and every run."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, IN, generator=g)
    w = torch.linspace(-1, 1, IN * OUT).reshape(IN, OUT)
    return x, torch.tanh(x @ w) + 0.01 * torch.randn(BATCH, OUT, generator=g)


def half_grads(model, x, y):
    """The gradients of one half-batch, as a list of tensors."""
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def step_2ranks(model, opt, step, rank):
    x, y = batch(step)
    h = BATCH // 2
    grads = half_grads(model, x[rank * h:(rank + 1) * h], y[rank * h:(rank + 1) * h])
    for p, g in zip(model.parameters(), grads):
        torch.distributed.all_reduce(g)  # g0 + g1 on both ranks
        p.grad = g / 2
    opt.step()


def step_1rank(model, opt, step):
    """What step_2ranks does on both ranks, computed in one process: the
    same half-batch gradients, summed in the same order."""
    x, y = batch(step)
    h = BATCH // 2
    g0 = half_grads(model, x[:h], y[:h])
    g1 = half_grads(model, x[h:], y[h:])
    for p, a, b in zip(model.parameters(), g0, g1):
        p.grad = (a + b) / 2
    opt.step()


def digests(model, opt):
    """SHA-256 of the bytes of every parameter and optimizer state tensor."""
    out = {}

    def put(key, t):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        out[key] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()

    for k, v in model.state_dict().items():
        put("model." + k, v)
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                put(f"optim.state.{pid}.{k}", v)
    return out


def state_dict(model, opt, step, rank):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "rng": {f"rank{rank}": torch.get_rng_state()}}


def train(args):
    rank, size = world()
    if size != 2:
        sys.exit(f"train_resume.py: training runs on 2 ranks (mpirun -np 2), not {size}")
    torch.set_num_threads(1)
    # One machine: gloo talks over loopback (a container's hostname may not
    # resolve to an interface); the file store is a local path too.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group("gloo", init_method="file://" + args.store,
                                         rank=rank, world_size=size)
    mount = args.mount.replace("%r", str(rank))
    model, opt = build()
    ref, pending = {}, None
    for step in range(1, args.steps + 1):
        step_2ranks(model, opt, step, rank)
        if step % args.save_every == 0:
            if pending:
                ckptfs.wait(mount, pending)  # one save in flight at a time
            pending = f"step-{step}"
            ckptfs.save(state_dict(model, opt, step, rank), mount, pending,
                        rank=rank, mode="async")
            ref[pending] = digests(model, opt)
            print(f"rank {rank}: step {step}: async save of {pending} started",
                  flush=True)
    ref["final"] = {"step": args.steps, **digests(model, opt)}
    if pending:
        print(f"rank {rank}: {pending}: {ckptfs.wait(mount, pending).splitlines()[0]}",
              flush=True)
    if rank == 0 and args.ref:
        with open(args.ref, "w") as f:
            json.dump(ref, f, indent=1, sort_keys=True)
    torch.distributed.barrier()
    if rank == 0:
        try:
            os.unlink(args.store)
        except FileNotFoundError:  # the last FileStore user removes it itself
            pass
    # Every save is committed and every rank is past the barrier: leave
    # without gloo's teardown, which now and then aborts a finished job
    # ("terminate called without an active exception", torch 2.x).
    sys.stdout.flush()
    os._exit(0)


def newest(mount):
    steps = []
    for n in os.listdir(mount):
        m = re.fullmatch(r"step-(\d+)", n)
        if m and ckptfs.status(mount, n)[0] == "committed":
            steps.append(int(m.group(1)))
    if not steps:
        sys.exit(f"train_resume.py: no committed step-N checkpoint in {mount}")
    return f"step-{max(steps)}"


def compare(what, got, want):
    bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    for k in bad:
        print(f"  {what}: {k}: {got.get(k, 'missing')} != {want.get(k, 'missing')}")
    return not bad


def resume(args):
    torch.set_num_threads(1)
    mount = args.mount.replace("%r", "0")
    name = newest(mount)
    model, opt = build()
    # Tensors of model.state_dict() share the parameters' memory: load reads
    # into them in place. Adam has no state before its first step, so its
    # state dict is loaded whole and handed to load_state_dict.
    loaded = ckptfs.load({"model": model.state_dict(), "optim": None, "step": None},
                         mount, name)
    opt.load_state_dict(loaded["optim"])
    step = loaded["step"]
    print(f"resumed {name} (step {step}) from {mount}")
    ok = True
    if args.ref:
        with open(args.ref) as f:
            ref = json.load(f)
        if compare(name, digests(model, opt), ref[name]):
            print(f"{name}: model and optimizer state bit-identical to the "
                  f"2-rank run ({len(ref[name])} tensors)")
        else:
            ok = False
    final = args.steps or (ref["final"]["step"] if args.ref else step)
    for s in range(step + 1, final + 1):
        step_1rank(model, opt, s)
    if args.ref and final == ref["final"]["step"] and final > step:
        want = {k: v for k, v in ref["final"].items() if k != "step"}
        if compare(f"step {final}", digests(model, opt), want):
            print(f"step {final}: trained on from {name} in 1 process, "
                  "bit-identical to the 2-rank run")
        else:
            ok = False
    if not ok:
        sys.exit("train_resume.py: MISMATCH with the 2-rank run")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mount", required=True,
                    help="this process's rank mount; %%r is replaced by the rank")
    ap.add_argument("--steps", type=int, default=0,
                    help="train until this step (default: 10; with --resume: "
                         "the 2-rank run's last step, from --ref)")
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--ref", help="digests of the 2-rank run (written by "
                                  "training, checked by --resume)")
    ap.add_argument("--store", help="gloo file store, a path that does not "
                                    "exist yet (default: --ref + '.store', else "
                                    "/tmp/train_resume.store); removed at the end")
    ap.add_argument("--resume", action="store_true",
                    help="load the newest checkpoint in 1 process and check it")
    args = ap.parse_args()
    if args.resume:
        resume(args)
    else:
        args.steps = args.steps or 10
        args.store = args.store or ((args.ref + ".store") if args.ref
                                    else "/tmp/train_resume.store")
        train(args)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The user's view (issue 39): a PyTorch user's DCP calls with stock
FileSystemWriter/FileSystemReader into a plain directory against the same
calls through ckptfs.dcp.Writer/Reader over rank mounts, on the same
filesystem, interleaved in one job per world size (each round runs both,
taking turns going first): dcp.save, dcp.async_save's stall (until the
call returns) and its total, dcp.load in the saving world, and a load by
a world of another size (--load-ranks, over the same BACKING_DIR: the
resharded load). Default options on both sides: the Writer's sync commit,
checksums verified (verify=1), fsync (sync_files).

    bench/bench.py --user-view --dir /dev/shm/dcpb [--model gpt|flat] \
        [--ranks 2] [--load-ranks 4] [--repeat 5]

--model gpt (the default): an 8-block GPT of width 1024 with Adam's
state, as FSDP2's state dict holds it (every parameter and moment a
DTensor Shard(0), a 0-dim step each; 400 tensors, 631 MiB a rank at 2
ranks); flat: 16 matrices of --size bytes. Run under the .venv's python
(bench.py re-runs itself there): it starts the worlds and the jobs with
mpirun. Prints one Markdown row per step: stock's and ckptfs's median
seconds with their ranges, and the ratio ckptfs / stock of the medians
with the range of the rounds' ratios (below 1: ckptfs is faster). --dir on
tmpfs measures the software's overheads; on a disk, durability.
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]

JOB = r"""
import gc, json, os, sys, time
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
import ckptfs.dcp
rank = int(os.environ["OMPI_COMM_WORLD_RANK"]); ws = int(os.environ["OMPI_COMM_WORLD_SIZE"])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group("gloo", rank=rank, world_size=ws)
phase, model, plain, mounts, size, reps = sys.argv[1:7]
size, reps = int(size), int(reps)
mesh = init_device_mesh("cpu", (ws,))


def shapes():
    # {fqn: global shape}: `flat` 16 matrices of --size bytes; `gpt` an
    # 8-block GPT of width 1024 with Adam's state, as FSDP2's state dict
    # holds it (every parameter and moment Shard(0), a 0-dim step each)
    if model == "flat":
        rows = max(ws, size // 16 // 4 // 1024)
        return {f"layer{i}.weight": (rows, 1024) for i in range(16)} | {"bias": (1024,)}
    w = 1024
    out = {"model.wte.weight": (8192, w), "model.wpe.weight": (1024, w)}
    for b in range(8):
        p = f"model.h.{b}."
        out |= {p + "ln_1.weight": (w,), p + "ln_1.bias": (w,),
                p + "attn.c_attn.weight": (3 * w, w), p + "attn.c_attn.bias": (3 * w,),
                p + "attn.c_proj.weight": (w, w), p + "attn.c_proj.bias": (w,),
                p + "ln_2.weight": (w,), p + "ln_2.bias": (w,),
                p + "mlp.c_fc.weight": (4 * w, w), p + "mlp.c_fc.bias": (4 * w,),
                p + "mlp.c_proj.weight": (w, 4 * w), p + "mlp.c_proj.bias": (w,)}
    out |= {"model.ln_f.weight": (w,), "model.ln_f.bias": (w,)}
    for k in [k for k in out if k.startswith("model.")]:
        out[f"optim.state.{k}.exp_avg"] = out[k]
        out[f"optim.state.{k}.exp_avg_sq"] = out[k]
        out[f"optim.state.{k}.step"] = ()
    return out


def make_sd(zero):
    sd, g = {}, torch.Generator().manual_seed(0)
    for i, (k, shp) in enumerate(shapes().items()):
        if shp == ():
            sd[k] = torch.tensor(0.0 if zero else 100.0)
            continue
        per = (shp[0] + ws - 1) // ws
        lo, hi = min(shp[0], rank * per), min(shp[0], (rank + 1) * per)
        loc = torch.zeros((hi - lo,) + shp[1:])
        if not zero:
            loc.add_(float(i)).add_(torch.arange(lo, hi).reshape((-1,) + (1,) * (len(shp) - 1)))
        sd[k] = DTensor.from_local(loc, mesh, [Shard(0)], run_check=False,
                                   shape=torch.Size(shp), stride=torch.empty(shp).stride())
    sd["optim.param_groups.lr"] = 0.0 if zero else 3e-4
    sd["step"] = 0 if zero else 100
    return sd


def check(tgt, sd):
    for k, v in sd.items():
        got = tgt[k]
        if hasattr(v, "to_local"):
            assert torch.equal(got.to_local(), v.to_local()), k
        elif isinstance(v, torch.Tensor):
            assert torch.equal(got, v), k
        else:
            assert got == v, k


def timed(fn):
    # Python's garbage of the steps before (the other side's too: stock's
    # async stager leaves 631 MiB of copies) collected first, on both
    # sides alike: a full collection falls into the step that happens to
    # cross its threshold, the same rounds in every run, ~0.1-0.3 s each
    gc.collect()
    dist.barrier(); t = time.monotonic()
    fn()
    dist.barrier()
    return time.monotonic() - t


def ids(kind, tag):
    return (os.path.join(plain, tag) if kind == "stock" else tag)


def writer(kind, tag):
    if kind == "stock":
        return dcp.FileSystemWriter(ids(kind, tag), sync_files=True)
    return ckptfs.dcp.Writer(mounts)


def reader(kind, tag):
    return dcp.FileSystemReader(ids(kind, tag)) if kind == "stock" else ckptfs.dcp.Reader(mounts)


def remove(kind, tag):
    dist.barrier()
    if rank == 0:
        import shutil
        shutil.rmtree(ids(kind, tag) if kind == "stock"
                      else os.path.join(ckptfs.dcp.rank_mount(mounts, 0), tag))
    dist.barrier()


def load(kind, tag, sd):
    tgt = make_sd(True)
    took = timed(lambda: dcp.load(tgt, checkpoint_id=ids(kind, tag), storage_reader=reader(kind, tag)))
    check(tgt, sd)
    return took


sd = make_sd(False)
res = {k: {"save": [], "async_stall": [], "async_total": [], "load": [], "reshard_load": []}
       for k in ("stock", "ckptfs")}
for rep in range(reps):
    # interleaved: stock and ckptfs take turns going first
    kinds = ("stock", "ckptfs") if rep % 2 == 0 else ("ckptfs", "stock")
    if phase == "save":
        last = rep == reps - 1
        for kind in kinds:
            tag = "saved" if last else f"s{rep}"
            res[kind]["save"].append(timed(lambda: dcp.save(
                sd, checkpoint_id=ids(kind, tag), storage_writer=writer(kind, tag))))
        for kind in kinds:
            box = {}
            def go():
                t = time.monotonic()
                fut = dcp.async_save(sd, checkpoint_id=ids(kind, f"a{rep}"),
                                     storage_writer=writer(kind, f"a{rep}"))
                box["stall"] = time.monotonic() - t
                fut.result()
            res[kind]["async_total"].append(timed(go))
            res[kind]["async_stall"].append(box["stall"])
        for kind in kinds:
            res[kind]["load"].append(load(kind, "saved" if last else f"s{rep}", sd))
        for kind in kinds:
            remove(kind, f"a{rep}")
            if not last:
                remove(kind, f"s{rep}")
    else:  # a world of another size loads what the save phase left
        for kind in kinds:
            res[kind]["reshard_load"].append(load(kind, "saved", sd))
out = {k: {s: v for s, v in r.items() if v} for k, r in res.items()}
out["bytes"] = sum(v.to_local().numel() * 4 for v in sd.values() if hasattr(v, "to_local"))
out["tensors"] = sum(1 for v in sd.values() if isinstance(v, torch.Tensor))
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # a gloo thread still freeing tensors may abort the interpreter's exit
"""


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(n, phase, model, plain, mounts, size, reps):
    env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.path.join(REPO, "python"), PYTHONWARNINGS="ignore")
    r = subprocess.run(MPIRUN + ["-np", str(n), "-x", "MASTER_PORT", "-x", "OMP_NUM_THREADS",
                                 "-x", "PYTHONPATH", "-x", "PYTHONWARNINGS",
                                 sys.executable, "-c", JOB, phase, model, plain, mounts,
                                 str(size), str(reps)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{phase} job at {n} ranks failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.exit(f"no result from {phase} at {n}:\n{r.stdout}")


class World:
    """A ckptfs world of n rank mounts over backing (mpirun, foreground)."""

    def __init__(self, binary, n, backing, root, opts):
        self.n, self.root = n, root
        for r in range(n):
            os.makedirs(self.mnt(r), exist_ok=True)
        self.log = open(os.path.join(root, f"world{n}.log"), "wb")
        self.proc = subprocess.Popen(MPIRUN + ["-np", str(n), binary, "-f", "-o", opts, backing,
                                               os.path.join(root, "rank%r")],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while not all(mounted(self.mnt(r)) for r in range(n)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                sys.exit(f"ckptfs world of {n} did not mount; see {self.log.name}")
            time.sleep(0.05)

    def mnt(self, r):
        return os.path.join(self.root, f"rank{r}")

    def close(self):
        for r in range(self.n):
            subprocess.run(["fusermount3", "-u", self.mnt(r)], capture_output=True)
        self.proc.wait(120)
        self.log.close()


def spread(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2], xs[0], xs[-1]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench.py --user-view")
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "bin", "ckptfs"))
    ap.add_argument("--dir", default="/dev/shm/ckptfs-dcp-bench")
    ap.add_argument("--model", default="gpt", choices=("gpt", "flat"),
                    help="gpt: an 8-block GPT of width 1024 with Adam (FSDP2's state dict); "
                         "flat: 16 matrices of --size bytes")
    ap.add_argument("--size", default="1G", help="--model flat's bytes in all")
    ap.add_argument("--ranks", default="2", help="world sizes that save (and load)")
    ap.add_argument("--load-ranks", default="4",
                    help="the world size that loads what --ranks saved (resharded); 0: none")
    ap.add_argument("--opts", default="", help="extra ckptfs -o options")
    ap.add_argument("--repeat", type=int, default=5, help="rounds; medians are printed")
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    lines = []
    for n in [int(x) for x in a.ranks.split(",")]:
        base = os.path.join(a.dir, f"n{n}")
        shutil.rmtree(base, ignore_errors=True)
        plain, backing, root = (os.path.join(base, x) for x in ("plain", "backing", "mnt"))
        for d in (plain, backing, root):
            os.makedirs(d)
        opts = "commit_timeout=600" + ("," + a.opts if a.opts else "")
        mounts = os.path.join(root, "rank%r")
        w = World(a.bin, n, backing, root, opts)
        try:
            res = job(n, "save", a.model, plain, mounts, size, a.repeat)
        finally:
            w.close()
        steps = [(f"{k}", n, res["stock"][k], res["ckptfs"][k])
                 for k in ("save", "async_stall", "async_total", "load")]
        m = int(a.load_ranks)
        if m:
            w = World(a.bin, m, backing, root, opts)
            try:
                r2 = job(m, "reshard", a.model, plain, mounts, size, a.repeat)
            finally:
                w.close()
            steps.append((f"load at {m}", n, r2["stock"]["reshard_load"],
                          r2["ckptfs"]["reshard_load"]))
        lines.append(f"{a.model}: {res['tensors']} tensors, {res['bytes'] / (1 << 20):.0f} MiB "
                     f"of float32 on rank 0 of {n}; dir {a.dir}; {a.repeat} interleaved rounds")
        for step, n_, s, c in steps:
            sm, sl, sh = spread(s)
            cm, cl, ch = spread(c)
            rr = sorted(x / y for x, y in zip(c, s))
            print(f"{step} at {n_}, round by round: stock "
                  f"{' '.join(f'{x:.3f}' for x in s)}; ckptfs "
                  f"{' '.join(f'{x:.3f}' for x in c)}", file=sys.stderr)
            lines.append(f"| {step} (saved at {n_}) | {sm:.3f} ({sl:.3f}-{sh:.3f}) | "
                         f"{cm:.3f} ({cl:.3f}-{ch:.3f}) | **{cm / sm:.2f}x** "
                         f"(rounds {rr[0]:.2f}-{rr[-1]:.2f}x, their median "
                         f"{rr[len(rr) // 2]:.2f}x) |")
        shutil.rmtree(base, ignore_errors=True)
    # ckptfs/stock: the ratio of the medians; each round's own ratio (the
    # two ran back to back) shows less of the machine's drift over a run
    print("| step | stock DCP s, median (range) | ckptfs s | ckptfs/stock |")
    print("|---|--:|--:|--:|")
    for ln in lines:
        print(ln)


if __name__ == "__main__":
    main()

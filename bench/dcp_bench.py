#!/usr/bin/env python3
"""Stock DCP (FileSystemWriter/FileSystemReader into a plain directory) vs
DCP through ckptfs (ckptfs.dcp.Writer/Reader over rank mounts), in one
run, on the same filesystem: save, async_save's stall (how long the
trainer waits before it may go on) and its total, and load, for one state
dict of --size bytes split over the ranks (DTensor Shard(0) float32
tensors, plus small replicated ones), at each --ranks world size.

    bench/dcp_bench.py --bin build/bin/ckptfs --dir /dev/shm/dcpb --size 1G --ranks 1,2

Run with the .venv's python (torch 2.13.0): it starts the ckptfs world
with mpirun and the DCP jobs with mpirun on the same interpreter. Prints a
table of median seconds per step over --repeat rounds and the ratio ckptfs / stock (below 1: ckptfs
is faster). --dir on tmpfs measures the software's overheads; on a disk,
durability (both fsync: FileSystemWriter's sync_files, ckptfs sync_files=1).
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

JOB = r'''
import json, os, sys, time
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard
import ckptfs.dcp
rank = int(os.environ["OMPI_COMM_WORLD_RANK"]); ws = int(os.environ["OMPI_COMM_WORLD_SIZE"])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group("gloo", rank=rank, world_size=ws)
kind, where, size, tag = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
mesh = init_device_mesh("cpu", (ws,))
n_t = 16
rows = max(ws, size // n_t // 4 // 1024)
from torch.distributed.tensor import DTensor
def make_sd(zero):
    sd = {}
    for i in range(n_t):
        per = (rows + ws - 1) // ws
        lo, hi = min(rows, rank * per), min(rows, (rank + 1) * per)
        loc = torch.zeros(hi - lo, 1024) if zero else torch.full((hi - lo, 1024), float(i)) + torch.arange(hi - lo).unsqueeze(1)
        sd[f"layer{i}.weight"] = DTensor.from_local(loc, mesh, [Shard(0)], run_check=False,
                                                    shape=torch.Size((rows, 1024)),
                                                    stride=(1024, 1))
    sd["step"] = 100
    sd["bias"] = torch.ones(1024)
    return sd
cid = os.path.join(where, tag) if kind == "stock" else tag
sd = make_sd(False)
reps = int(sys.argv[5])
res = {"save": [], "async_stall": [], "async_total": [], "load": []}
for rep in range(reps):
    c1, c2 = f"{cid}{rep}", f"{cid}{rep}-async"
    if kind == "stock":
        W1 = dcp.FileSystemWriter(c1, sync_files=True); W2 = dcp.FileSystemWriter(c2, sync_files=True)
        R1 = dcp.FileSystemReader(c1)
    else:
        W1, W2, R1 = ckptfs.dcp.Writer(where), ckptfs.dcp.Writer(where), ckptfs.dcp.Reader(where)
    dist.barrier(); t = time.monotonic()
    dcp.save(sd, checkpoint_id=c1, storage_writer=W1)
    dist.barrier(); res["save"].append(time.monotonic() - t)
    dist.barrier(); t = time.monotonic()
    fut = dcp.async_save(sd, checkpoint_id=c2, storage_writer=W2)
    res["async_stall"].append(time.monotonic() - t)
    fut.result()
    dist.barrier(); res["async_total"].append(time.monotonic() - t)
    tgt = make_sd(True)
    dist.barrier(); t = time.monotonic()
    dcp.load(tgt, checkpoint_id=c1, storage_reader=R1)
    dist.barrier(); res["load"].append(time.monotonic() - t)
    for k, v in sd.items():
        if hasattr(v, "to_local"):
            assert torch.equal(tgt[k].to_local(), v.to_local()), k
    del tgt
    dist.barrier()
    if rank == 0:  # keep memory (tmpfs) for the next round
        import shutil
        for c in (c1, c2):
            shutil.rmtree(c if kind == "stock" else os.path.join(ckptfs.dcp.rank_mount(where, 0), c))
    dist.barrier()
out = {k: sorted(v)[len(v) // 2] for k, v in res.items()}  # medians
out["bytes"] = sum(v.to_local().numel() * 4 for v in sd.values() if hasattr(v, "to_local")) * 1
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # a gloo thread still freeing tensors may abort the interpreter's exit
'''


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


def job(n, kind, where, size, tag, reps):
    env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.path.join(REPO, "python"), PYTHONWARNINGS="ignore")
    r = subprocess.run(MPIRUN + ["-np", str(n), "-x", "MASTER_PORT", "-x", "OMP_NUM_THREADS",
                                 "-x", "PYTHONPATH", "-x", "PYTHONWARNINGS",
                                 sys.executable, "-c", JOB, kind, where, str(size), tag, str(reps)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{kind} job at {n} ranks failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.exit(f"no result from {kind} at {n}:\n{r.stdout}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "bin", "ckptfs"))
    ap.add_argument("--dir", default="/dev/shm/ckptfs-dcp-bench")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--opts", default="", help="extra ckptfs -o options")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; medians are printed")
    a = ap.parse_args()
    size = parse_size(a.size)
    rows = []
    for n in [int(x) for x in a.ranks.split(",")]:
        base = os.path.join(a.dir, f"n{n}")
        shutil.rmtree(base, ignore_errors=True)
        plain, backing, root = (os.path.join(base, x) for x in ("plain", "backing", "mnt"))
        for d in (plain, backing):
            os.makedirs(d)
        for r in range(n):
            os.makedirs(os.path.join(root, f"rank{r}"))
        opts = "commit_timeout=600" + ("," + a.opts if a.opts else "")
        log = open(os.path.join(base, "world.log"), "wb")
        world = subprocess.Popen(MPIRUN + ["-np", str(n), a.bin, "-f", "-o", opts, backing,
                                           os.path.join(root, "rank%r")],
                                 stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not all(mounted(os.path.join(root, f"rank{r}")) for r in range(n)):
                if world.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"ckptfs world of {n} did not mount; see {log.name}")
                time.sleep(0.05)
            stock = job(n, "stock", plain, size, "s", a.repeat)
            ck = job(n, "ckptfs", os.path.join(root, "rank%r"), size, "s", a.repeat)
        finally:
            for r in range(n):
                subprocess.run(["fusermount3", "-u", os.path.join(root, f"rank{r}")],
                               capture_output=True)
            world.wait(120)
        rows.append((n, stock, ck))
        shutil.rmtree(base, ignore_errors=True)
    print(f"state dict: {rows[0][1]['bytes'] / (1 << 30):.2f} GiB of float32 "
          f"(16 DTensors, Shard(0)) + small items; dir {a.dir}")
    print(f"{'ranks':>5} {'step':<12} {'stock DCP s':>12} {'ckptfs s':>10} {'ckptfs/stock':>13}")
    for n, s, c in rows:
        for k in ("save", "async_stall", "async_total", "load"):
            print(f"{n:>5} {k:<12} {s[k]:>12.3f} {c[k]:>10.3f} {c[k] / s[k]:>13.2f}")


if __name__ == "__main__":
    main()

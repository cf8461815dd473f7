#!/usr/bin/env python3
"""Many small tensors, one process: `ckptfs.save`, `dcp.save` through
`ckptfs.dcp.Writer`, and stock `dcp.save` into a plain directory of the
same filesystem as BACKING (the limit), in interleaved rounds; prints
medians, ratios vs stock, and the FUSE requests per tensor of each
ckptfs path (the daemon's ckptfs_fuse_requests_total, -o metrics=FILE).

    python3 bench/small_tensors.py --bin build/bin/ckptfs --backing /dev/shm/stbench [--rounds 5] [--n 1000] [--size 4096]

Tensors are float32, named like a model's (model.layers.L.wK: three
directory levels). Every save is sync (committed and durable when it
returns). BACKING is emptied; use a tmpfs to see FUSE overheads."""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "python"))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import ckptfs  # noqa: E402
import ckptfs.dcp  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
from ckpttest.util import fuse_requests  # noqa: E402


OPTS = ""  # --opts


def state(n, size):
    flat = {f"model.layers.{i // 10}.w{i % 10}": torch.randn(size // 4) for i in range(n)}
    nested = {}
    for k, t in flat.items():
        d = nested
        *dirs, leaf = k.split(".")
        for p in dirs:
            d = d.setdefault(p, {})
        d[leaf] = t
    return flat, nested



class Mount:
    def __init__(self, binary, backing, tag):
        self.back = os.path.join(backing, f"b-{tag}")
        self.mnt = os.path.join(backing, f"mnt-{tag}")
        self.metrics = os.path.join(backing, f"metrics-{tag}.prom")
        self.binary = binary

    def __enter__(self):
        for d in (self.back, self.mnt):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        opts = ",".join(o for o in (f"metrics={self.metrics}", OPTS) if o)
        subprocess.check_call([self.binary, self.back, self.mnt, "-o", opts])
        return self

    def __exit__(self, *exc):
        for _ in range(100):
            if subprocess.call(["fusermount3", "-u", self.mnt],
                               stderr=subprocess.DEVNULL) == 0:
                break
            time.sleep(0.1)
        for _ in range(100):  # the daemon writes the last metrics as it exits
            if subprocess.call(["pgrep", "-f", f"ckptfs {self.back} "],
                               stdout=subprocess.DEVNULL) != 0:
                break
            time.sleep(0.05)


def saves(flat, nested):
    """name -> fn(mount, name, plain_dir) saving the state once."""
    def client(mnt, name, _):
        ckptfs.save(nested, mnt, name)

    def writer(mnt, name, _):
        dcp.save(flat, storage_writer=ckptfs.dcp.Writer(mnt), checkpoint_id=name)

    def stock(_, __, plain):
        dcp.save(flat, checkpoint_id=plain)
    return {"ckptfs.save": client, "dcp.save+Writer": writer, "stock dcp.save": stock}


def count(binary, backing, fn, n):
    """FUSE requests per tensor of one save (mount, save, unmount; less the
    requests of an empty mount's lifetime)."""
    with Mount(binary, backing, "empty") as m:
        pass
    base = fuse_requests(m.metrics)
    with Mount(binary, backing, "count") as m:
        fn(m.mnt, "c", None)
    got = fuse_requests(m.metrics)
    # FORGETs are no round trips (nobody waits for them) and come whenever
    # the kernel evicts inodes
    per = {op: (got.get(op, 0) - base.get(op, 0)) / n for op in got if op != "forget"}
    return {op: v for op, v in per.items() if v > 0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(REPO, "build/bin/ckptfs"))
    ap.add_argument("--backing", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--size", type=int, default=4096, help="bytes per tensor")
    ap.add_argument("--opts", default="", help="more mount options (passthrough=0)")
    a = ap.parse_args()
    global OPTS
    OPTS = a.opts
    warnings.filterwarnings("ignore")
    flat, nested = state(a.n, a.size)
    fns = saves(flat, nested)
    for name in ("ckptfs.save", "dcp.save+Writer"):
        per = count(a.bin, a.backing, fns[name], a.n)
        total = sum(per.values())
        detail = " ".join(f"{op}={v:.2f}" for op, v in sorted(per.items(), key=lambda x: -x[1]))
        print(f"{name:16s} FUSE requests per tensor: {total:.2f}  ({detail})")
    times = {k: [] for k in fns}
    with Mount(a.bin, a.backing, "time") as m:
        for r in range(a.rounds + 1):  # round 0 warms up, not counted
            for k, fn in fns.items():
                plain = os.path.join(a.backing, f"plain{r}")
                t = time.perf_counter()
                fn(m.mnt, f"{k.split()[0].replace('+', '-')}{r}", plain)
                t = time.perf_counter() - t
                shutil.rmtree(plain, ignore_errors=True)
                if r:
                    times[k].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    stock = times["stock dcp.save"]
    print(f"{a.n} tensors of {a.size} B, {a.rounds} interleaved rounds, medians "
          "(ratio: the median of each round's time over that round's stock time):")
    for k, v in med.items():
        ratio = statistics.median(x / s for x, s in zip(times[k], stock))
        print(f"  {k:16s} {v * 1e3:7.1f} ms  {ratio:5.2f}x stock  "
              f"({v / a.n * 1e6:.0f} us/tensor; runs {' '.join(f'{x * 1e3:.0f}' for x in times[k])})")


if __name__ == "__main__":
    main()

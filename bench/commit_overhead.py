#!/usr/bin/env python3
"""Commit overhead of a many-small-tensors checkpoint across rank mounts.

Starts an N-rank world under mpirun with the backing directory in memory
(/dev/shm, sync_files=0), writes T small tensors per rank (tensor i is a
[N, 16] float32 sharded by rows: rank r holds row r), then commits on
every rank at once and reports the time from the last commit write to
every rank committed: the cost of planning, messaging, writing and
publishing metadata, not of the disk.

    bench/commit_overhead.py --bin build/bin/ckptfs --ranks 4 --tensors 10000
"""
import argparse
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time


def mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def write_rank(mnt, rank, n, tensors):
    ck = os.path.join(mnt, "bench")
    os.mkdir(ck)
    row = struct.pack("<16f", *([float(rank)] * 16))
    shape = f"{n},16".encode()
    offs = f"{rank},0".encode()
    for i in range(tensors):
        d = os.path.join(ck, f"layer{i // 100}")
        if i % 100 == 0:
            os.mkdir(d)
        p = os.path.join(d, f"w{i % 100}")
        with open(p, "wb") as f:
            f.write(row)
        os.setxattr(p, "user.ckpt.dtype", b"float32")
        os.setxattr(p, "user.ckpt.shape", shape)
        os.setxattr(p, "user.ckpt.offsets", offs)
        os.setxattr(p, "user.ckpt.sizes", b"1,16")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/bin/ckptfs")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tensors", type=int, default=10000)
    args = ap.parse_args()
    n = args.ranks
    work = tempfile.mkdtemp(prefix="ckptfs-bench-", dir="/dev/shm")
    backing = os.path.join(work, "backing")
    mnts = [os.path.join(work, f"rank{r}") for r in range(n)]
    for m in mnts:
        os.makedirs(m)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n),
           "--mca", "btl", "self,vader", args.bin, "-f", "-o", "sync_files=0",
           backing, os.path.join(work, "rank%r")]
    log = open(os.path.join(work, "log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not all(mounted(m) for m in mnts):
            if proc.poll() is not None or time.time() > deadline:
                log.flush()
                sys.exit("mounts not ready: " + open(os.path.join(work, "log")).read()[-2000:])
            time.sleep(0.05)
        t0 = time.perf_counter()
        ths = [threading.Thread(target=write_rank, args=(mnts[r], r, n, args.tensors)) for r in range(n)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        t_write = time.perf_counter() - t0

        issued = [0.0] * n
        returned = [0.0] * n
        errors = []

        def commit(r):
            fd = os.open(os.path.join(mnts[r], "bench", ".commit"), os.O_WRONLY | os.O_TRUNC)
            issued[r] = time.perf_counter()
            try:
                os.write(fd, b"sync\n")
            except OSError as e:
                errors.append((r, e))
            returned[r] = time.perf_counter()
            os.close(fd)

        ths = [threading.Thread(target=commit, args=(r,)) for r in range(n)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        if errors:
            with open(os.path.join(mnts[0], "bench", ".status")) as f:
                sys.exit(f"commit failed: {errors} {f.read()}")
        overhead = max(returned) - max(issued)
        print(f"ranks {n}, tensors per rank {args.tensors} (chunks in all {n * args.tensors})")
        print(f"staging writes through the mounts  {t_write:8.3f} s")
        print(f"last commit write -> all committed {overhead:8.3f} s")
    finally:
        for m in mnts:
            subprocess.run(["fusermount3", "-u", m], capture_output=True)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

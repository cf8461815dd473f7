#!/usr/bin/env python3
"""Block files vs plain reads: a column half of a committed 4096x2048
float32 tensor (DTensor Shard(1)) read through its block file
NAME/.w[:,1024:] with one pread, against a row half (NAME/w bytes
[0, 16 MiB), one pread) and against the old way (one 4 KiB pread per row of
NAME/w), in interleaved rounds of one run, warm (data files in the page
cache of a tmpfs backing directory). Prints medians and the ratios; asserts
only that the bytes are right.

    python3 bench/block_read.py --bin build/bin/ckptfs [--rounds 9]
        [--backing-parent /dev/shm] [--rows 4096 --cols 2048] [--opts verify=1]
        [--chunks 1|2]

--chunks 2 saves the tensor as two row shards of a 2-rank world (mpirun);
default: one rank, one chunk.
"""
import argparse
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
from ckpttest import util as ckptfs_util  # noqa: E402


def pread_once(path, n, off=0):
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        b = os.pread(fd, n, off)
        return time.perf_counter() - t0, b
    finally:
        os.close(fd)


def per_row(path, rows, row_bytes, col_off, n):
    fd = os.open(path, os.O_RDONLY)
    out = bytearray(rows * n)
    try:
        t0 = time.perf_counter()
        for r in range(rows):
            out[r * n:(r + 1) * n] = os.pread(fd, n, r * row_bytes + col_off)
        return time.perf_counter() - t0, bytes(out)
    finally:
        os.close(fd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/bin/ckptfs")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--backing-parent", default="/dev/shm")
    ap.add_argument("--opts", default="")
    args = ap.parse_args()
    ckptfs_util.BIN = os.path.abspath(args.bin)
    rows, cols, isz = args.rows, args.cols, 4
    row_bytes = cols * isz
    half = rows * row_bytes // 2
    d = tempfile.mkdtemp(prefix="ckptfs-blockbench-", dir=args.backing_parent)
    mnt = tempfile.mkdtemp(prefix="ckptfs-blockbench-mnt-", dir="/tmp")
    m = ckptfs_util.Mount(os.path.join(d, "backing"), mnt, os.path.join(d, "log"),
                          opts=args.opts or None)
    try:
        m.start()
        ck = os.path.join(mnt, "b")
        os.mkdir(ck)
        data = struct.pack(f"<{rows * cols}f", *[float(i % 65521) for i in range(rows * cols)])
        ckptfs_util.write_tensor(os.path.join(ck, "w"), "float32", [rows, cols], data)
        ckptfs_util.commit(ck)
        w = os.path.join(ck, "w")
        blk = os.path.join(ck, f".w[:,{cols // 2}:]")
        want_col = b"".join(data[r * row_bytes + row_bytes // 2:(r + 1) * row_bytes]
                            for r in range(rows))
        assert os.stat(blk).st_size == half
        t = {"row half (1 pread of tensor file)": [],
             "column half (1 pread of block file)": [],
             f"column half ({rows} preads of tensor file)": []}
        keys = list(t)
        for i in range(args.rounds + 1):  # round 0 warms up, not counted
            s, b = pread_once(w, half, 0)
            assert b == data[:half]
            s2, b2 = pread_once(blk, half, 0)
            assert b2 == want_col, "block content differs"
            s3, b3 = per_row(w, rows, row_bytes, row_bytes // 2, row_bytes // 2)
            assert b3 == want_col
            if i:
                t[keys[0]].append(s)
                t[keys[1]].append(s2)
                t[keys[2]].append(s3)
        mib = half / (1 << 20)
        print(f"tensor {rows}x{cols} float32, {mib:.0f} MiB per half, {args.rounds} rounds, "
              f"backing on {args.backing_parent}, opts '{args.opts}'")
        med = {}
        for k in keys:
            med[k] = statistics.median(t[k])
            print(f"  {k:45s} median {med[k] * 1e3:8.2f} ms  {mib / med[k]:9.1f} MiB/s")
        print(f"  ratio column-half block / row half throughput: "
              f"{med[keys[0]] / med[keys[1]]:.2f}")
        print(f"  ratio column-half block / per-row preads throughput: "
              f"{med[keys[2]] / med[keys[1]]:.1f}x")
    finally:
        m.stop()
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(mnt, ignore_errors=True)


if __name__ == "__main__":
    main()

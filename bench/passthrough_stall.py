#!/usr/bin/env python3
"""One writer's async stall and sync save through a one-rank mount, with
and without -o passthrough=1, against the one-copy floor (the same writes
straight into BACKING), in interleaved rounds; prints medians and ratios.

    python3 bench/passthrough_stall.py --bin build/bin/ckptfs --backing /dev/shm/ptbench [--rounds 3]

16 files of 64 MiB written in 1 MiB write(2)s with dtype/shape xattrs;
stall = from the first write until `async` written to .commit returns;
sync = the same with `sync`. Run as root on an idle machine; the mount
point is BACKING/mnt (BACKING is emptied)."""
import argparse
import os
import shutil
import statistics
import subprocess
import time

MiB = 1 << 20


def writes(d, buf, xattrs):
    for i in range(16):
        p = f"{d}/t{i}"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for _ in range(64):
            os.write(fd, buf)
        if xattrs:
            os.setxattr(p, "user.ckpt.dtype", b"uint8")
            os.setxattr(p, "user.ckpt.shape", str(64 * MiB).encode())
        os.close(fd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/bin/ckptfs")
    ap.add_argument("--backing", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    buf = os.urandom(MiB)
    back, mnt = os.path.join(a.backing, "b"), os.path.join(a.backing, "mnt")

    def floor():
        d = os.path.join(a.backing, "floor")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        t = time.perf_counter()
        writes(d, buf, False)
        t = time.perf_counter() - t
        shutil.rmtree(d)
        return t

    def mounted(pt, mode):
        shutil.rmtree(back, ignore_errors=True)
        os.makedirs(back)
        os.makedirs(mnt, exist_ok=True)
        subprocess.check_call([a.bin, back, mnt, "-o", f"passthrough={pt}"])
        try:
            os.mkdir(f"{mnt}/c")
            t = time.perf_counter()
            writes(f"{mnt}/c", buf, True)
            fd = os.open(f"{mnt}/c/.commit", os.O_WRONLY | os.O_TRUNC | os.O_CREAT)
            os.write(fd, mode.encode())
            os.close(fd)
            t = time.perf_counter() - t
            while True:
                st = open(f"{mnt}/c/.status").readline().strip()
                if st != "committing":
                    break
                time.sleep(0.01)
            if st != "committed":
                raise SystemExit(f"passthrough={pt} {mode}: {st}")
            return t
        finally:
            subprocess.call(["fusermount3", "-u", mnt])
            shutil.rmtree(back, ignore_errors=True)

    res = {k: [] for k in ("floor", "async stall, passthrough",
                           "async stall, daemon", "sync save, passthrough",
                           "sync save, daemon")}
    for _ in range(a.rounds):
        res["floor"].append(floor())
        res["async stall, passthrough"].append(mounted(1, "async"))
        res["async stall, daemon"].append(mounted(0, "async"))
        res["sync save, passthrough"].append(mounted(1, "sync"))
        res["sync save, daemon"].append(mounted(0, "sync"))
    f = statistics.median(res["floor"])
    print("| path | median s | x floor |\n| --- | --- | --- |")
    for k, v in res.items():
        m = statistics.median(v)
        print(f"| {k} | {m:.3f} | {m / f:.2f} |")


if __name__ == "__main__":
    main()
